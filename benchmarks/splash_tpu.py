"""`SplashBlockSparse` and `PallasTpuBlockSparse` on a TPU: the selector's choice and the
error against the float32 dense reference (forward and every gradient) per case, then forward
and forward+backward speed against JAX's own Splash with its own mask at the same block sizes,
and our speed at other block sizes; with ``--pallas``, the two kernels side by side without a
score term (causal, window 1024, 16 documents, a window and a dilated window written as
`Predicate`s) and the selector's choice through `AutoKernel` on each, then
`PallasTpuBlockSparse` with ALiBi, a 32-bucket T5 table and ALiBi written as a `ScoreFunction`.

Runs in one process (one program at a time can hold a TPU). On a CPU it runs too, with
Splash interpreted (slow: pass a short ``--length``). TF/s count visible pairs only
(`eqx_bsattn.bench`).

```
python benchmarks/splash_tpu.py                               # errors, speed at L = 8192
python benchmarks/splash_tpu.py --skip-errors --blocks 256 512 1024
python benchmarks/splash_tpu.py --skip-errors --skip-splash --pallas    # the two kernels
```
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
from eqx_bsattn.bench import pattern, visible_pairs
from eqx_bsattn.strategies.kernels import DenseReference
from eqx_bsattn.timing import median_ms

#: The TPU v5e's memory bandwidth, GB/s (its published figure).
HBM_GBPS = 819

CASES = {  # name: (mask, per-call data, B, H, Hkv, Lq, Lk, D)
    "causal gqa": (masks.Causal(), {}, 1, 8, 2, 2048, 2048, 128),
    "window 256": (masks.Causal() & masks.SlidingWindow(256, 0), {}, 2, 4, 4, 2048, 2048, 128),
    "documents": (*pattern("document", 2048), 1, 4, 4, 2048, 2048, 128),
    "bigbird": (*pattern("bigbird", 2048), 1, 4, 4, 2048, 2048, 128),
    "ragged Lq!=Lk d64": (masks.Causal(bottom_right=True), {}, 1, 4, 2, 1000, 1300, 64),
    "empty rows": (masks.Causal(offset=-150), {}, 1, 4, 4, 384, 256, 128),
}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def errors():
    """Per case: the kernel the selector picks, the relative error in norm of the output and
    each gradient (bfloat16 inputs) against `DenseReference` in float32 at the highest matmul
    precision, whether rows that see no key are zeros, and whether all is finite."""
    print("| case | kernel | out | dq | dk | dv | empty rows zero |", flush=True)
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (mask, data, b, h, hkv, lq, lk, d) in CASES.items():
        ks = jax.random.split(jax.random.key(len(name)), 4)
        q = jax.random.normal(ks[0], (b, h, lq, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, hkv, lk, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, hkv, lk, d), jnp.bfloat16)
        cot = jax.random.normal(ks[3], (b, h, lq, d), jnp.bfloat16)
        data = {n: jnp.broadcast_to(jnp.asarray(x), (b, lq)) for n, x in data.items()}
        attn = bsa.BlockSparseAttention(mask=mask)
        kernel = attn.plan(q, k, v, **data).kernel.name
        out, pull = jax.vjp(lambda q, k, v: attn(q, k, v, **data), q, k, v)
        grads = pull(cot)
        ref = bsa.BlockSparseAttention(mask=mask, kernel=DenseReference())
        with jax.default_matmul_precision("highest"):
            f32 = [x.astype(jnp.float32) for x in (q, k, v)]
            want, pull_ref = jax.vjp(lambda q, k, v: ref(q, k, v, **data), *f32)
            want_grads = pull_ref(cot.astype(jnp.float32))
        empty = np.asarray(jnp.abs(want).sum(-1) == 0)
        zeros = bool(np.all(np.asarray(out, np.float32)[empty] == 0)) if empty.any() else "-"
        finite = all(bool(jnp.isfinite(x).all()) for x in (out, *grads))
        errs = [rel(out, want)] + [rel(g, w) for g, w in zip(grads, want_grads)]
        print(f"| {name} | {kernel} | " + " | ".join(f"{e:.1e}" for e in errs)
              + f" | {zeros} (finite: {finite}) |", flush=True)


def splash_peer(name: str, length: int, heads: int, blocks: tuple[int, int]):
    """JAX's own Splash for `name` (its `CausalMask` or `LocalMask`, in its own ``[H, L, D]``
    layout, vmapped over the batch) at forward blocks `blocks` in every pass; the softmax
    scale goes into the queries, as Splash has none."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    own = (sm.CausalMask((length, length)) if name == "causal" else
           sm.LocalMask((length, length), (1024, 0), offset=0))
    bq, bk = blocks
    sizes = sk.BlockSizes(block_q=bq, block_kv=bk, block_q_dkv=bq, block_kv_dkv=bk,
                          block_q_dq=bq, block_kv_dq=bk)
    kernel = sk.make_splash_mha(sm.MultiHeadMask([own] * heads), block_sizes=sizes,
                                head_shards=1, q_seq_shards=1,
                                interpret=jax.default_backend() != "tpu")
    return lambda q, k, v: jax.vmap(kernel)(q * q.shape[-1] ** -0.5, k, v)


def speed(length: int, batch: int, heads: int, dim: int, reps: int, blocks=None):
    """Forward and forward+backward of our call (the heuristic's blocks, or each of `blocks`)
    on causal and causal window 1024; with the heuristic, JAX's Splash at the same blocks."""
    print("\n| pattern | L | impl | blocks | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for name in ("causal", "window"):
        mask, _ = pattern(name, length, window=1024)
        ks = jax.random.split(jax.random.key(length), 4)
        q, k, v, do = (jax.random.normal(x, (batch, heads, length, dim), jnp.bfloat16)
                       for x in ks)
        flops = 4.0 * batch * heads * dim * visible_pairs(mask, length, length)
        runs = []
        for block in blocks or [None]:
            tiling = None if block is None else kernels.SplashConfig(block, block)
            attn = bsa.BlockSparseAttention(mask=mask, kernel=kernels.SplashBlockSparse(),
                                            tiling=tiling)
            used = attn.plan(q, k, v).tiling.blocks.forward
            runs.append(("eqx_bsattn", used, lambda q, k, v, attn=attn: attn(q, k, v)))
            if block is None:
                runs.append(("jax splash", used, splash_peer(name, length, heads, used)))
        for label, used, fn in runs:
            fwd = jax.jit(fn)
            bwd = jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1](do))
            f_ms = median_ms(fwd, (q, k, v), reps, warmup=1)
            b_ms = median_ms(bwd, (q, k, v), reps, warmup=1)
            print(f"| {name} | {length} | {label} | {used[0]} x {used[1]} | {f_ms:.2f} | "
                  f"{flops / f_ms / 1e9:.1f} | {b_ms:.2f} | {3.5 * flops / b_ms / 1e9:.1f} |",
                  flush=True)


def alibi_function(heads: int):
    """Symmetric ALiBi written as a `ScoreFunction` (ALiBi's term on the causal pairs; ALiBi
    itself, affine in the positions, would plan as built-in ALiBi): the standard slopes
    picked by the head id with scalar selects."""
    slopes = [float(x) for x in bsa.scores.alibi_slopes(heads)]

    def alibi(s, head, q, k):
        slope = functools.reduce(lambda acc, h: jnp.where(head == h, slopes[h], acc),
                                 range(heads), jnp.float32(0.0))
        return s - slope * jnp.abs(k - q).astype(jnp.float32)

    return alibi


def window_predicate(q, k):
    """A causal window of 1024 written as a `Predicate` (a mask without in-kernel terms)."""
    return (k <= q) & (q - k <= 1024)


def dilated_predicate(q, k):
    """A causal window of 2048 keeping every other key (stride 2), as a `Predicate`."""
    return (k <= q) & (q - k <= 2048) & ((q - k) % 2 == 0)


PREDICATES = {"predicate window": window_predicate, "predicate dilated": dilated_predicate}


def mask_of(name: str, length: int):
    """``(mask, per-call data)`` of a pattern of `eqx_bsattn.bench`, or of `PREDICATES`."""
    if name in PREDICATES:
        return masks.Predicate(PREDICATES[name]), {}
    return pattern(name, length, window=1024)


def pallas_runs(length: int, heads: int):
    """``(label, pattern, kernel, score, bias)`` of each timed call: both kernels without a
    term on each pattern (the predicates too: Splash reads them as element bitmaps, this
    kernel traces them into its body), then `PallasTpuBlockSparse` with each score term on
    the causal mask, and with a bias ``[1, H, L, L]`` (`bias` True), beside XlaBlockSparse
    with the same bias."""
    table = 0.1 * jax.random.normal(jax.random.key(1), (heads, 32))
    runs = [(name, pattern_name, kernel, None, False)
            for pattern_name in ("causal", "window", "document", *PREDICATES)
            for name, kernel in (("splash", kernels.SplashBlockSparse()),
                                 ("pallas_tpu", kernels.PallasTpuBlockSparse()),
                                 ("auto", None))]
    for label, score in (("alibi", bsa.scores.ALiBi()),
                         ("t5 table 32", bsa.scores.RelativePositionBias(table)),
                         ("alibi function", bsa.scores.ScoreFunction(alibi_function(heads)))):
        runs.append((f"pallas_tpu + {label}", "causal", kernels.PallasTpuBlockSparse(), score,
                     False))
    runs.append(("pallas_tpu + bias 1hqk", "causal", kernels.PallasTpuBlockSparse(), None,
                 True))
    runs.append(("xla + bias 1hqk", "causal", kernels.XlaBlockSparse(), None, True))
    return runs


def _picks(attn, data: dict, args) -> str:
    """The kernel the selector picks for the call ``attn(q, k, v[, bias], **data)``, planned
    on the arguments' shapes (a concrete bias of gigabytes would be checked on the host)."""
    picked = []

    def plan(q, k, v, *bias):
        extra = {"bias": bias[0]} if bias else {}
        picked.append(attn.plan(q, k, v, **data, **extra).kernel.name)
        return q

    jax.eval_shape(plan, *args)
    return picked[0]


def pallas_speed(length: int, batch: int, heads: int, dim: int, reps: int,
                 only=None) -> list[tuple]:
    """Forward and forward+backward (of q, k, v) of each of `pallas_runs` (those whose label
    or pattern holds one of `only`'s words, where given), the heuristic's blocks; prints a
    row per call as it goes and returns them. With a bias, the line after the table gives
    the time of one read of it at the chip's memory bandwidth."""
    print("\n| call | pattern | selector picks | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    ks = jax.random.split(jax.random.key(length), 4)
    q, k, v, do = (jax.random.normal(x, (batch, heads, length, dim), jnp.bfloat16) for x in ks)
    rows = []
    bias = None
    for label, name, kernel, score, with_bias in pallas_runs(length, heads):
        if only and not any(word in f"{label} {name}" for word in only):
            continue
        mask, data = mask_of(name, length)
        data = {n: jnp.broadcast_to(jnp.asarray(x), (batch, length)) for n, x in data.items()}
        if with_bias and bias is None:
            bias = 0.5 * jax.random.normal(jax.random.key(2), (1, heads, length, length),
                                           jnp.bfloat16)
        seg = data.get("q_segment_ids")
        flops = 4.0 * batch * heads * dim * visible_pairs(
            mask, length, length, None if seg is None else seg[0])
        args = (q, k, v) + ((bias,) if with_bias else ())
        picks = _picks(bsa.BlockSparseAttention(mask=mask, score=score), data, args)
        attn = (bsa.BlockSparseAttention(mask=mask, score=score) if kernel is None else
                bsa.BlockSparseAttention(mask=mask, score=score, kernel=kernel))
        # The bias is an argument of the jitted call (a constant of 2 GiB would be compiled
        # into it); the gradient is of q, k and v (the kernels form the bias's all the same).
        fn = lambda q, k, v, *bias, attn=attn, data=data: attn(  # noqa: E731
            q, k, v, **data, **({"bias": bias[0]} if bias else {}))
        fwd = jax.jit(fn)
        bwd = jax.jit(lambda q, k, v, *bias, fn=fn: jax.vjp(
            lambda q, k, v: fn(q, k, v, *bias), q, k, v)[1](do))
        try:
            f_ms = median_ms(fwd, args, reps, warmup=1)
            b_ms = median_ms(bwd, args, reps, warmup=1)
        except Exception as e:  # one failing call must not hide the others' times
            print(f"| {label} | {name} | {picks} | failed: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200]} |", flush=True)
            rows.append((label, name, picks, float("nan"), float("nan")))
            continue
        print(f"| {label} | {name} | {picks} | {f_ms:.2f} | {flops / f_ms / 1e9:.1f} | "
              f"{b_ms:.2f} | {3.5 * flops / b_ms / 1e9:.1f} |", flush=True)
        rows.append((label, name, picks, f_ms, b_ms))
    if bias is not None:
        print(f"\nOne read of the bias ({bias.nbytes / 1e9:.2f} GB) at {HBM_GBPS} GB/s: "
              f"{bias.nbytes / HBM_GBPS / 1e6:.2f} ms", flush=True)
    return rows


def summary(rows: list[tuple]) -> None:
    """The short table: each call's times and its ratio to the same pattern's call without a
    term by the same kernel (terms), to Splash (our kernel, no term), or to the faster of the
    two kernels (``auto``, the selector's choice through `AutoKernel`)."""
    base = {(label, name): (f, b) for label, name, _, f, b in rows}
    for (label, name), (f, b) in list(base.items()):
        if label == "splash" and ("pallas_tpu", name) in base:
            other = base[("pallas_tpu", name)]
            base[("min(splash, pallas_tpu)", name)] = (min(f, other[0]), min(b, other[1]))
    print("\n| call | pattern | fwd ms | fwd+bwd ms | vs | fwd ratio | fwd+bwd ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, name, _, f, b in rows:
        ref = ("splash" if label == "pallas_tpu" else "pallas_tpu" if "+" in label
               else "min(splash, pallas_tpu)" if label == "auto" else None)
        if ref is None or (ref, name) not in base:
            print(f"| {label} | {name} | {f:.2f} | {b:.2f} | - | - | - |")
            continue
        rf, rb = base[(ref, name)]
        print(f"| {label} | {name} | {f:.2f} | {b:.2f} | {ref} | {f / rf:.2f} | {b / rb:.2f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-errors", action="store_true")
    p.add_argument("--skip-splash", action="store_true",
                   help="skip the Splash-against-JAX's-Splash speed table")
    p.add_argument("--pallas", action="store_true",
                   help="time PallasTpuBlockSparse beside SplashBlockSparse, and with terms")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--blocks", type=int, nargs="+", default=None,
                   help="time ours at these square blocks instead of the heuristic's")
    p.add_argument("--only", nargs="+", default=None,
                   help="with --pallas, time only the calls whose label and pattern (e.g. "
                        "'pallas_tpu causal', 'bias') hold one of these")
    args = p.parse_args()
    print(jax.__version__, jax.devices(), flush=True)
    if not args.skip_errors:
        errors()
    if not args.skip_splash:
        speed(args.length, args.batch, args.heads, args.dim, args.reps, args.blocks)
    if args.pallas:
        summary(pallas_speed(args.length, args.batch, args.heads, args.dim, args.reps,
                             args.only))


if __name__ == "__main__":
    main()
