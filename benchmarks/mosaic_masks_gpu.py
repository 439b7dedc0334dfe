"""Masks without in-kernel terms in `MosaicBlockSparse` (the element predicate traced on the
partial blocks) against the built-in masks that say the same, on one GPU, in one process.

    python benchmarks/mosaic_masks_gpu.py [--length 16384] [--batch 2] [--heads 16]
        [--dim 128] [--window 1024] [--reps 10] [--rounds 3] [--out masks.json]

Masks (``window``: causal and a window of `--window` keys; ``dilated``: a window of
`--window` keys both ways, every second key) in two forms: ``builtin`` (`masks.Causal() &
masks.SlidingWindow`, and `masks.SlidingWindow & masks.Dilated(2)`), ``predicate`` (the
same as a `masks.Predicate` function, traced into Mosaic's partial blocks) and ``array`` (the
same as a `masks.ArrayMask`: Mosaic reads its per-call element map), and for the window
``widths`` (a `masks.Predicate` reading each head's width from its params: Mosaic reads the
widths from its read tables); each form through
`MosaicBlockSparse` and `TritonBlockSparse` (its element bitmaps: the path a predicate took
before). Rows give the
median wall time of a jitted forward and of a forward+backward (gradients of q, k and v),
the median of `--rounds` rounds (each the median of `--reps` calls; every row of a mask is
timed once per round, in turn), effective TFLOP/s over the visible pairs (``4 B H D pairs``
forward, 2.5 times that more for the backward), and each row's time over the built-in form
through Mosaic. Not a test: numbers depend on the machine. On a CPU, ``--kernels
XlaBlockSparse --length 512 --window 64`` runs the same code.
"""

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
from eqx_bsattn.bench import environment, visible_pairs
from eqx_bsattn.timing import median_ms


class CausalWindow:
    """``k <= q`` and ``q - k <= width``, as a `masks.Predicate` function (hashable)."""

    def __init__(self, width: int):
        self.width = width

    def __eq__(self, other):
        return type(other) is type(self) and other.width == self.width

    def __hash__(self):
        return hash((type(self), self.width))

    def __call__(self, q, k):
        return (k <= q) & (q - k <= self.width)


class WindowByHead:
    """``k <= q`` and ``q - k <= widths[head]``: a `masks.Predicate` function reading its
    params (per-head widths) at the head."""

    def __call__(self, q, k, widths, head):
        return (k <= q) & (q - k <= widths[head])

    def __eq__(self, other):
        return type(other) is type(self)

    def __hash__(self):
        return hash(type(self))


class DilatedWindow(CausalWindow):
    """``|q - k| <= width`` and ``k - q`` even."""

    def __call__(self, q, k):
        return (abs(q - k) <= self.width) & ((k - q) % 2 == 0)


def _boolean(fn, length: int) -> np.ndarray:
    """``fn`` on every pair of `length` tokens, as a NumPy boolean array."""
    q = np.arange(length, dtype=np.int32)[:, None]
    k = np.arange(length, dtype=np.int32)[None, :]
    return np.asarray(fn(q, k))


def forms(width: int, length: int, heads: int) -> dict[str, dict[str, bsa.AbstractMask]]:
    """Each mask's built-in, predicate and boolean-array forms; the window also as a
    predicate reading the width per head from its params (``widths``: the same width for
    every head, so that each form sees the same pairs)."""
    window, dilated = CausalWindow(width), DilatedWindow(width)
    widths = jnp.full((heads,), width, jnp.int32)
    return {
        "window": {"builtin": masks.Causal() & masks.SlidingWindow(width, 0),
                   "predicate": masks.Predicate(window),
                   "widths": masks.Predicate(WindowByHead(), widths),
                   "array": masks.ArrayMask(_boolean(window, length))},
        "dilated": {"builtin": masks.SlidingWindow(width, width) & masks.Dilated(2),
                    "predicate": masks.Predicate(dilated),
                    "array": masks.ArrayMask(_boolean(dilated, length))},
    }


def calls(mask, kernel):
    """Jitted ``(forward, forward+backward)`` of one mask through one kernel; the module is
    closed over, so an `ArrayMask`'s array is a constant and its layouts are built once."""
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel)

    def loss(q, k, v):
        return jnp.sum(attn(q, k, v).astype(jnp.float32))

    return jax.jit(lambda q, k, v: attn(q, k, v)), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def run(args) -> list[dict]:
    keys = jax.random.split(jax.random.key(0), 3)
    shape = (args.batch, args.heads, args.length, args.dim)
    q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
    records = []
    for mask_name, by_form in forms(args.window, args.length, args.heads).items():
        pairs = visible_pairs(by_form["builtin"], args.length, args.length)
        rows = {}
        for form, mask in by_form.items():
            for kernel_name in args.kernels:
                kernel = getattr(kernels, kernel_name)()
                try:
                    fns = calls(mask, kernel)
                    for fn in fns:
                        jax.block_until_ready(fn(q, k, v))  # compile
                    rows[(form, kernel_name)] = (fns, [[], []])
                except Exception as e:  # noqa: BLE001 - a row that fails says why
                    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                    print(f"{mask_name} {form} {kernel_name}: failed: {first}", flush=True)
        for _ in range(args.rounds):
            for fns, times in rows.values():
                for fn, got in zip(fns, times):
                    got.append(median_ms(fn, (q, k, v), args.reps))
        base = rows.get(("builtin", args.kernels[0]))
        base_ms = None if base is None else [statistics.median(t) for t in base[1]]
        flops = 4 * args.batch * args.heads * args.dim * pairs
        for (form, kernel_name), (_, times) in rows.items():
            ms = [statistics.median(t) for t in times]
            record = {"mask": mask_name, "form": form, "kernel": kernel_name,
                      "fwd_ms": ms[0], "fwdbwd_ms": ms[1], "pairs": pairs,
                      "fwd_tflops": flops / ms[0] / 1e9,
                      "fwdbwd_tflops": 3.5 * flops / ms[1] / 1e9}
            if base_ms is not None:
                record["fwd_ratio"] = ms[0] / base_ms[0]
                record["fwdbwd_ratio"] = ms[1] / base_ms[1]
            records.append(record)
    return records


def table(records: list[dict], first_kernel: str) -> str:
    lines = [f"| mask | form | kernel | fwd ms | fwd+bwd ms | fwd TF/s | fwd+bwd TF/s | "
             f"/ builtin {first_kernel} (fwd / fwd+bwd) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        ratio = (f"{r['fwd_ratio']:.3f} / {r['fwdbwd_ratio']:.3f}" if "fwd_ratio" in r
                 else "-")
        lines.append(f"| {r['mask']} | {r['form']} | {r['kernel']} | {r['fwd_ms']:.3f} | "
                     f"{r['fwdbwd_ms']:.3f} | {r['fwd_tflops']:.1f} | "
                     f"{r['fwdbwd_tflops']:.1f} | {ratio} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kernels", nargs="+", default=["MosaicBlockSparse", "TritonBlockSparse"],
                   help="kernel classes of `kernels`; the first is the ratios' base")
    p.add_argument("--out", default=None, help="write the records and environment as JSON")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    records = run(args)
    print(table(records, args.kernels[0]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(), "args": vars(args), "records": records},
                      f, indent=1)


if __name__ == "__main__":
    main()
