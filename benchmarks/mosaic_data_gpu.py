"""ALiBi written as a score function that reads its slopes (a closure's jnp array, or learned
slopes in `params`) against the built-in ALiBi, through `MosaicBlockSparse` on one GPU, in
one process; and the same slopes in a function the plan cannot turn into ALiBi (symmetric
ALiBi, equal to ALiBi under the causal mask), which the kernel evaluates on every logit.

    python benchmarks/mosaic_data_gpu.py [--length 16384] [--batch 2] [--heads 16]
        [--dim 128] [--reps 10] [--rounds 3] [--out data.json]

Forms, each under a causal mask: ``builtin`` (`scores.ALiBi(slopes)`, fixed slopes),
``closure`` (``ScoreFunction(lambda s, h, qp, kp: s + slopes[h] * (kp - qp))``, the slopes a
constant it closes over), ``builtin_learned`` (`scores.ALiBi(slopes, learned=True)`: the
slopes' gradient too) and ``params`` (``ScoreFunction(fn, {"slopes": slopes})``, the params'
gradient too); the plan proves both functions to be ALiBi and runs them as built-in ALiBi
(`eqx_bsattn._score_alibi`). ``symmetric`` (``s - slopes[h] * |kp - qp|``, a closure) and
``symmetric_params`` (the same with `params`) run as functions: their arrays are read
in-kernel, and ``symmetric_params`` forms its params' gradient there. Rows give the median wall time
of a jitted forward and of a forward+backward (gradients of q, k, v and, for the learned
forms, of the slopes), the median of `--rounds` rounds of `--reps` calls each, and each row's
time over its built-in form (``closure`` and ``symmetric`` over ``builtin``, ``params``
and ``symmetric_params`` over ``builtin_learned``). Not a test: numbers depend on the machine. On a CPU, ``--kernel
XlaBlockSparse --length 512`` runs the same code.
"""

import argparse
import json
import statistics

import jax
import jax.numpy as jnp

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
from eqx_bsattn.bench import environment, visible_pairs
from eqx_bsattn.timing import median_ms

#: Each form's base for the ratios.
BASES = {"builtin": "builtin", "closure": "builtin", "symmetric": "builtin",
         "builtin_learned": "builtin_learned", "params": "builtin_learned",
         "symmetric_params": "builtin_learned"}


def learned_alibi(s, h, qp, kp, params):
    return s + params["slopes"][h] * (kp - qp).astype(s.dtype)


def learned_symmetric(s, h, qp, kp, params):
    return s - params["slopes"][h] * jnp.abs(kp - qp).astype(s.dtype)


def calls(form: str, kernel, slopes):
    """Jitted ``(forward, forward+backward)`` of one form: each takes ``(q, k, v, slopes)``;
    the forward+backward differentiates the slopes too where the form learns them."""
    def attend(q, k, v, slopes):
        if form == "builtin":
            score = scores.ALiBi(slopes)
        elif form == "builtin_learned":
            score = scores.ALiBi(slopes, learned=True)
        elif form == "closure":
            score = scores.ScoreFunction(
                lambda s, h, qp, kp: s + slopes[h] * (kp - qp).astype(s.dtype))
        elif form == "symmetric":
            score = scores.ScoreFunction(
                lambda s, h, qp, kp: s - slopes[h] * jnp.abs(kp - qp).astype(s.dtype))
        elif form == "params":
            score = scores.ScoreFunction(learned_alibi, {"slopes": slopes})
        else:
            score = scores.ScoreFunction(learned_symmetric, {"slopes": slopes})
        return bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernel, score=score)(
            q, k, v)

    learned = form in ("builtin_learned", "params", "symmetric_params")
    if form in ("builtin", "closure", "symmetric"):
        # The slopes are constants of the program, as a hand-written closure has them.
        def forward(q, k, v, _):
            return attend(q, k, v, slopes)
    else:
        forward = attend

    def loss(q, k, v, s):
        return jnp.sum(forward(q, k, v, s).astype(jnp.float32))

    argnums = (0, 1, 2, 3) if learned else (0, 1, 2)
    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=argnums))


def run(args) -> list[dict]:
    keys = jax.random.split(jax.random.key(0), 3)
    shape = (args.batch, args.heads, args.length, args.dim)
    q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
    slopes = jnp.asarray(scores.alibi_slopes(args.heads), jnp.float32)
    kernel = getattr(kernels, args.kernel)()
    pairs = visible_pairs(masks.Causal(), args.length, args.length)
    rows = {}
    for form in BASES:
        try:
            fns = calls(form, kernel, slopes)
            for fn in fns:
                jax.block_until_ready(fn(q, k, v, slopes))  # compile
            rows[form] = (fns, [[], []])
        except Exception as e:  # noqa: BLE001 - a row that fails says why
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(f"{form}: failed: {first}", flush=True)
    for _ in range(args.rounds):
        for fns, times in rows.values():
            for fn, got in zip(fns, times):
                got.append(median_ms(fn, (q, k, v, slopes), args.reps))
    medians = {form: [statistics.median(t) for t in times] for form, (_, times) in rows.items()}
    flops = 4 * args.batch * args.heads * args.dim * pairs
    records = []
    for form, ms in medians.items():
        record = {"form": form, "kernel": args.kernel, "fwd_ms": ms[0], "fwdbwd_ms": ms[1],
                  "pairs": pairs, "fwd_tflops": flops / ms[0] / 1e9,
                  "fwdbwd_tflops": 3.5 * flops / ms[1] / 1e9}
        base = medians.get(BASES[form])
        if base is not None:
            record["fwd_ratio"], record["fwdbwd_ratio"] = ms[0] / base[0], ms[1] / base[1]
        records.append(record)
    return records


def table(records: list[dict]) -> str:
    lines = ["| form | kernel | fwd ms | fwd+bwd ms | fwd TF/s | fwd+bwd TF/s | "
             "/ its built-in form (fwd / fwd+bwd) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        ratio = (f"{r['fwd_ratio']:.3f} / {r['fwdbwd_ratio']:.3f}" if "fwd_ratio" in r
                 else "-")
        lines.append(f"| {r['form']} | {r['kernel']} | {r['fwd_ms']:.3f} | "
                     f"{r['fwdbwd_ms']:.3f} | {r['fwd_tflops']:.1f} | "
                     f"{r['fwdbwd_tflops']:.1f} | {ratio} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kernel", default="MosaicBlockSparse", help="a kernel class of `kernels`")
    p.add_argument("--out", default=None, help="write the records and environment as JSON")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    records = run(args)
    print(table(records), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(), "args": vars(args), "records": records},
                      f, indent=1)


if __name__ == "__main__":
    main()
