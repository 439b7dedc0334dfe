"""Where a per-head `Predicate`'s extra time goes in `PallasTpuBlockSparse` (TPU only): the
built-in causal window of 1024 with its own visit lists, then with the same lists widened the
way lists built on the device are (every head its own list, each list as wide as a row has
blocks, the grid bound read from the device), beside the `Predicate` with per-head widths in
`params` (B=1, H=16, D=128, bfloat16; ms forward / forward+backward, median).

The widened lists visit the same blocks in the same order: only the prefetched arrays' size
and the dynamic grid bound change, so a gap between the first two rows is their cost, and a
gap between the last two is the predicate's evaluation on the tiles or its layout, built on
the device each call. A second table times that build alone (`contract.build_layout`: the
block classes from position ranges and the eight lists, then the kernel's visit lists).
The comparison of the lists formed by a scatter, by comparisons and by a sort
(docs/splash.md) was run with this script at its revision of 2026-12-06 that patched the
library's list builder; the library now sorts rows up to 64 blocks wide.

```
python benchmarks/dev/tpu_lists_ablation.py --length 32768
```
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import eqx_bsattn as bsa
from eqx_bsattn import contract, kernels, masks
from eqx_bsattn.strategies.kernels.pallas_tpu import common
from eqx_bsattn.strategies.kernels.pallas_tpu import kernel as kernel_module
from eqx_bsattn.timing import median_ms

_VISITS = kernel_module.visits


def widened(heads: int, per_head: bool):
    """`common.visits` whose static lists are returned as lists built on the device would be:
    one per head where `per_head`, each as wide as a row has blocks, the grid bound an
    array."""

    def visits(layout, *, transposed: bool, rows: int):
        v = _VISITS(layout, transposed=transposed, rows=rows)
        if v.dynamic:
            return v
        width = layout.num_q_blocks if transposed else layout.num_kv_blocks
        mh = heads if per_head else v.mh
        shape = (v.mb, v.mh, v.rows, v.width)
        block = np.broadcast_to(v.block.reshape(shape), (v.mb, mh, v.rows, v.width))
        kind = np.broadcast_to(v.kind.reshape(shape), (v.mb, mh, v.rows, v.width))
        pad = ((0, 0), (0, 0), (0, 0), (0, width - v.width))
        block = np.pad(block, pad, mode="edge")
        kind = np.pad(kind, pad, constant_values=common.SKIP)
        return common.Visits(block.reshape(-1), kind.reshape(-1), v.mb, mh, v.rows, width,
                             jnp.asarray(v.steps), True)

    return visits


def window_params(q, k, params, head):
    return (k <= q) & (q - k <= params["width"][head])


def layout_table(length: int, heads: int, reps: int):
    """The device-side layout build of the per-head `Predicate` alone, jitted."""
    widths = jnp.full((heads,), 1024, jnp.int32)

    def build(w):
        layout = contract.build_layout(masks.Predicate(window_params, {"width": w}),
                                       q_len=length, kv_len=length, num_heads=heads,
                                       block_q=512, block_kv=512)
        rows = length // 512
        return [(x.block, x.kind, x.steps) for x in (
            common.visits(layout, transposed=False, rows=rows),
            common.visits(layout, transposed=True, rows=rows))]

    ms = median_ms(jax.jit(build), (widths,), reps, warmup=1)
    print(f"\nlayout build on the device, alone: {ms:.3f} ms", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layout-only", action="store_true")
    args = p.parse_args()
    layout_table(args.length, args.heads, 4 * args.reps)
    if args.layout_only:
        return
    shape = (1, args.heads, args.length, 128)
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, shape, jnp.bfloat16) for x in ks)
    widths = jnp.full((args.heads,), 1024, jnp.int32)
    window = masks.Causal() & masks.SlidingWindow(1024, 0)
    runs = [
        ("built-in window, its own lists", window, None, _VISITS),
        ("built-in window, lists as wide as a row", window, None, widened(args.heads, False)),
        ("built-in window, per-head lists as wide as a row", window, None,
         widened(args.heads, True)),
        ("Predicate, per-head widths as params", window_params, {"width": widths}, _VISITS),
    ]
    print(jax.devices())
    print("| call | fwd ms | fwd+bwd ms |")
    print("| --- | --- | --- |", flush=True)
    for label, mask, params, visits in runs:
        kernel_module.visits = visits

        def call(q, k, v, p, mask=mask):
            m = mask if p is None else masks.Predicate(mask, p)
            return bsa.BlockSparseAttention(mask=m, kernel=kernels.PallasTpuBlockSparse())(
                q, k, v)

        fwd = jax.jit(call)
        bwd = jax.jit(lambda q, k, v, p, call=call: jax.vjp(
            lambda q, k, v: call(q, k, v, p), q, k, v)[1](do))
        f_ms = median_ms(fwd, (q, k, v, params), args.reps, warmup=1)
        b_ms = median_ms(bwd, (q, k, v, params), args.reps, warmup=1)
        print(f"| {label} | {f_ms:.2f} | {b_ms:.2f} |", flush=True)
    kernel_module.visits = _VISITS


if __name__ == "__main__":
    main()
