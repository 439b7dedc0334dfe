"""A bias ``[1, H, L, L]`` read in-kernel against the same call without one, on one GPU, in one
process, causal.

    python benchmarks/mosaic_bias_gpu.py [--length 16384] [--batch 2] [--heads 16]
        [--dim 128] [--reps 10] [--rounds 3] [--kernels MosaicBlockSparse ...]
        [--out bias.json]

Forms: ``none`` (no bias), ``constant`` (a bfloat16 bias, not differentiated: each launch
reads it) and ``learned`` (its gradient too, summed over the batch). Rows give the median wall
time of a jitted forward and of a forward+backward (gradients of q, k, v and, for
``learned``, of the bias), the median of `--rounds` rounds of `--reps` calls each, each
row's time over ``none``, and the target's bound: 1.2 times ``none`` plus the time to read the
bias once at the bandwidth this GPU gives a sum over it (``read_ms``, measured here). Not a
test: numbers depend on the machine. On a CPU, ``--kernels XlaBlockSparse --length 512``
runs the same code.
"""

import argparse
import json
import statistics

import jax
import jax.numpy as jnp

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
from eqx_bsattn.bench import environment, visible_pairs
from eqx_bsattn.timing import median_ms

FORMS = ("none", "constant", "learned")


def calls(form: str, kernel):
    """Jitted ``(forward, forward+backward)`` of one form, each on ``(q, k, v, bias)``."""
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernel)

    def forward(q, k, v, bias):
        return attn(q, k, v, bias=None if form == "none" else bias)

    def loss(q, k, v, bias):
        return jnp.sum(forward(q, k, v, bias).astype(jnp.float32))

    argnums = (0, 1, 2, 3) if form == "learned" else (0, 1, 2)
    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=argnums))


def run(args) -> list[dict]:
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (args.batch, args.heads, args.length, args.dim)
    q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys[:3])
    bias = jax.random.normal(keys[3], (1, args.heads, args.length, args.length), jnp.bfloat16)
    operands = (q, k, v, bias)
    read_ms = median_ms(jax.jit(lambda b: jnp.sum(b, dtype=jnp.float32)), (bias,), args.reps)
    pairs = visible_pairs(masks.Causal(), args.length, args.length)
    flops = 4 * args.batch * args.heads * args.dim * pairs
    records = []
    for name in args.kernels:
        kernel = getattr(kernels, name)()
        rows = {}
        for form in FORMS:
            try:
                fns = calls(form, kernel)
                for fn in fns:
                    jax.block_until_ready(fn(*operands))  # compile
                rows[form] = (fns, [[], []])
            except Exception as e:  # noqa: BLE001 - a row that fails says why
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                print(f"{name} {form}: failed: {first}", flush=True)
        for _ in range(args.rounds):
            for fns, times in rows.values():
                for fn, got in zip(fns, times):
                    got.append(median_ms(fn, operands, args.reps))
        medians = {form: [statistics.median(t) for t in times]
                   for form, (_, times) in rows.items()}
        base = medians.get("none")
        for form, ms in medians.items():
            record = {"form": form, "kernel": name, "fwd_ms": ms[0], "fwdbwd_ms": ms[1],
                      "read_ms": read_ms, "fwd_tflops": flops / ms[0] / 1e9,
                      "fwdbwd_tflops": 3.5 * flops / ms[1] / 1e9}
            if base is not None:
                record["fwd_ratio"], record["fwdbwd_ratio"] = ms[0] / base[0], ms[1] / base[1]
                record["fwdbwd_bound_ms"] = 1.2 * base[1] + read_ms
            records.append(record)
    return records


def table(records: list[dict]) -> str:
    lines = ["| form | kernel | fwd ms | fwd+bwd ms | / none (fwd / fwd+bwd) | "
             "bound: 1.2 none + read (ms) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in records:
        ratio = (f"{r['fwd_ratio']:.3f} / {r['fwdbwd_ratio']:.3f}" if "fwd_ratio" in r
                 else "-")
        bound = f"{r['fwdbwd_bound_ms']:.3f}" if "fwdbwd_bound_ms" in r else "-"
        lines.append(f"| {r['form']} | {r['kernel']} | {r['fwd_ms']:.3f} | "
                     f"{r['fwdbwd_ms']:.3f} | {ratio} | {bound} |")
    if records:
        lines.append(f"\nReading the bias once (a float32 sum over it): "
                     f"{records[0]['read_ms']:.3f} ms")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kernels", nargs="+", default=["MosaicBlockSparse"],
                   help="kernel classes of `kernels`")
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
