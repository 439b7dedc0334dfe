"""Where a per-head `Predicate`'s extra time goes in `PallasTpuBlockSparse` (TPU only): the
built-in causal window of 1024 with its own visit lists, then with the same lists widened the
way lists built on the device are (every head its own list, each list as wide as a row has
blocks, the grid bound read from the device), beside the `Predicate` with per-head widths in
`params` (B=1, H=16, D=128, bfloat16; ms forward / forward+backward, median).

The widened lists visit the same blocks in the same order: only the prefetched arrays' size
and the dynamic grid bound change, so a gap between the first two rows is their cost, and a
gap between the last two is the predicate's evaluation on the tiles or its layout, built on
the device each call. A second table times that build alone (the block classes from
position ranges, the eight lists, the kernel's visit lists) with the lists formed three ways:
the library's scatter, comparisons (slot s holds the column whose running count passes s),
and a stable sort of each row.

```
python benchmarks/dev/tpu_lists_ablation.py --length 32768
```
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
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


def _rows(classes, flag, by_column):
    part = jnp.swapaxes(classes, -1, -2) if by_column else classes
    *lead, n, width = part.shape
    return (part == flag).reshape(-1, width), lead, n


def compare_lists(classes, flag, capacity, *, by_column):
    hits, lead, n = _rows(classes, flag, by_column)
    seen = jnp.cumsum(hits, axis=-1, dtype=jnp.int32)
    slot = jnp.arange(capacity, dtype=jnp.int32)
    lists = jnp.sum(seen[:, None, :] <= slot[None, :, None], axis=-1, dtype=jnp.int32)
    lists = jnp.where(slot[None, :] < seen[:, -1:], lists, 0)
    return seen[:, -1].reshape(*lead, n), lists.reshape(*lead, n, capacity)


def sort_lists(classes, flag, capacity, *, by_column):
    hits, lead, n = _rows(classes, flag, by_column)
    column = jnp.broadcast_to(jnp.arange(hits.shape[-1], dtype=jnp.int32), hits.shape)
    _, order = jax.lax.sort((jnp.logical_not(hits).astype(jnp.int32), column), num_keys=1,
                            is_stable=True)
    count = jnp.sum(hits, axis=-1, dtype=jnp.int32)
    lists = order[:, :capacity]
    lists = jnp.where(jnp.arange(capacity)[None, :] < count[:, None], lists, 0)
    return count.reshape(*lead, n), lists.reshape(*lead, n, capacity)


def layout_table(length: int, heads: int, reps: int):
    from eqx_bsattn import _layout

    widths = jnp.full((heads,), 1024, jnp.int32)

    def build(w):
        mask, _ = _layout.resolve_mask(masks.Predicate(window_params, {"width": w}), length,
                                       length)
        layout = _layout.layout_of_resolved(mask, q_len=length, kv_len=length,
                                            num_heads=heads, block_q=512, block_kv=512)
        rows = length // 512
        return [(x.block, x.kind, x.steps) for x in (
            common.visits(layout, transposed=False, rows=rows),
            common.visits(layout, transposed=True, rows=rows))]

    scatter = _layout._jnp_lists
    print("\n| lists formed by | layout build ms |")
    print("| --- | --- |", flush=True)
    for label, lists in (("scatter", scatter), ("comparisons", compare_lists),
                         ("sort", sort_lists)):
        _layout._jnp_lists = lists
        ms = median_ms(jax.jit(build), (widths,), reps, warmup=1)
        print(f"| {label} | {ms:.3f} |", flush=True)
    _layout._jnp_lists = scatter


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layout-only", action="store_true")
    p.add_argument("--lists", action="store_true",
                   help="time the Predicate with its lists formed each way (not the widened "
                        "lists)")
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
    if args.lists:
        from eqx_bsattn import _layout

        scatter = _layout._jnp_lists
        runs = [runs[0]] + [
            (f"Predicate, per-head widths as params, lists by {name}", window_params,
             {"width": widths}, _VISITS, lists)
            for name, lists in (("scatter", scatter), ("comparisons", compare_lists),
                                ("sort", sort_lists))]
    print(jax.devices())
    print("| call | fwd ms | fwd+bwd ms |")
    print("| --- | --- | --- |", flush=True)
    for label, mask, params, visits, *lists in runs:
        kernel_module.visits = visits
        if lists:
            from eqx_bsattn import _layout

            _layout._jnp_lists = lists[0]

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
