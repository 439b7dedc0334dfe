"""A researcher's data inside `PallasTpuBlockSparse` on a TPU: forward and forward+backward
times of score functions and predicates that read arrays, beside their built-in equals, all
through the same kernel (B=1, H=16, L=8192, D=128, bfloat16, causal; ms, median).

- ALiBi: built in; and, as a `ScoreFunction` evaluated in the kernel, symmetric ALiBi (the
  same term on the causal pairs; ALiBi written as a function plans as built-in ALiBi)
  closing over a slopes array, and with the slopes as learned `params` (its backward
  differentiates the params too).
- A causal window of 1024: built in; as a `Predicate` with each head's width as `params`;
  and, to tell where that one's time goes, as a `Predicate` without data and as the
  per-head `Predicate` with its widths fixed when traced (no layout built on the device).
- A 32-bucket T5 table (`RelativePositionBias`) on causal and on the window, against the
  same mask without a term.

Each row also names the kernel the selector picks for the call. Runs in one process (one
program at a time can hold a TPU); on a CPU pass a short ``--length`` (interpreted: slow).

```
python benchmarks/tpu_data.py                 # L = 8192
python benchmarks/tpu_data.py --length 32768 --reps 5
```
"""

import argparse

import jax
import jax.numpy as jnp

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
from eqx_bsattn.timing import median_ms


def alibi_closure(slopes):
    def alibi(s, head, q, k):
        return s - slopes[head] * jnp.abs(k - q).astype(jnp.float32)
    return alibi


def alibi_params(s, head, q, k, params):
    return s - params["slopes"][head] * jnp.abs(k - q).astype(jnp.float32)


def window_params(q, k, params, head):
    return (k <= q) & (q - k <= params["width"][head])


def window_static(q, k):
    return (k <= q) & (q - k <= 1024)


def calls(heads: int):
    """``(label, base label, make(params) -> module, params or None)`` of each timed call."""
    slopes = jnp.asarray(scores.alibi_slopes(heads), jnp.float32)
    widths = jnp.full((heads,), 1024, jnp.int32)
    table = 0.3 * jax.random.normal(jax.random.key(1), (heads, 32), jnp.float32)
    causal, kernel = masks.Causal(), kernels.PallasTpuBlockSparse()
    window = masks.Causal() & masks.SlidingWindow(1024, 0)

    def module(mask, score=None, kernel=kernel):
        return bsa.BlockSparseAttention(mask=mask, score=score, kernel=kernel)

    return [
        ("causal", None, lambda p: module(causal), None),
        ("causal + built-in ALiBi", "causal", lambda p: module(causal, scores.ALiBi()), None),
        ("causal + symmetric ALiBi closing over its slopes", "causal + built-in ALiBi",
         lambda p: module(causal, scores.ScoreFunction(alibi_closure(slopes))), None),
        ("causal + symmetric ALiBi, slopes as params (grad too)", "causal + built-in ALiBi",
         lambda p: module(causal, scores.ScoreFunction(alibi_params, p)), {"slopes": slopes}),
        ("window 1024 built in", None, lambda p: module(window), None),
        ("window 1024 Predicate, widths as params", "window 1024 built in",
         lambda p: module(masks.Predicate(window_params, p)), {"width": widths}),
        ("window 1024 Predicate, no data", "window 1024 built in",
         lambda p: module(masks.Predicate(window_static)), None),
        ("window 1024 Predicate, widths fixed when traced", "window 1024 built in",
         lambda p: module(masks.Predicate(window_params, {"width": widths})), None),
        ("causal + T5 table", "causal",
         lambda p: module(causal, scores.RelativePositionBias(table)), None),
        ("window 1024 + T5 table", "window 1024 built in",
         lambda p: module(window, scores.RelativePositionBias(table)), None),
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    shape = (1, args.heads, args.length, args.dim)
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, shape, jnp.bfloat16) for x in ks)
    print(jax.devices())
    print("| call | selector picks | fwd ms | fwd+bwd ms | against | fwd ratio | fwd+bwd ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    times = {}
    for label, base, make, params in calls(args.heads):
        auto = make(params)
        picks = bsa.BlockSparseAttention(mask=auto.mask, score=auto.score).plan(q, k, v)
        fwd = jax.jit(lambda q, k, v, p, make=make: make(p)(q, k, v))
        if params is None:
            bwd = jax.jit(lambda q, k, v, p, make=make: jax.vjp(
                lambda q, k, v: make(p)(q, k, v), q, k, v)[1](do))
        else:  # the learned data's gradient too
            bwd = jax.jit(lambda q, k, v, p, make=make: jax.vjp(
                lambda q, k, v, p: make(p)(q, k, v), q, k, v, p)[1](do))
        try:
            f_ms = median_ms(fwd, (q, k, v, params), args.reps, warmup=1)
            b_ms = median_ms(bwd, (q, k, v, params), args.reps, warmup=1)
        except Exception as e:  # one failing call must not hide the others' times
            print(f"| {label} | {picks.kernel.name} | failed: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:300]} |", flush=True)
            continue
        times[label] = (f_ms, b_ms)
        ratio = ("-", "-", "-")
        if base in times:
            bf, bb = times[base]
            ratio = (base, f"{f_ms / bf:.2f}", f"{b_ms / bb:.2f}")
        print(f"| {label} | {picks.kernel.name} | {f_ms:.2f} | {b_ms:.2f} | {' | '.join(ratio)} |",
              flush=True)


if __name__ == "__main__":
    main()
