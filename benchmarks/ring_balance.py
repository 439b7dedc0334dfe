"""How evenly a ring's devices share the work, simulated from the block layout alone (CPU).

For each mask, the visible blocks of every query block row (128-token blocks of a 2^20-token
sequence) are counted from the layout (`build_layout`; the documents' from their segment ids),
and each device's work is the sum over the query rows it holds (in a ring a device visits its
rows against every kv shard). Printed: max / mean of the devices' work for the contiguous
order, the zig-zag order (slices ``d`` and ``2n - 1 - d`` of ``2n``) and the balanced order
(`balanced_chunks` over 8 slices per device, as `RingAttention(order="balanced")` deals
them), at 8, 64 and 1024 devices.

    python benchmarks/ring_balance.py [--length 1048576] [--block 128] [--out FILE.json]
"""

import argparse
import json

import numpy as np

from eqx_bsattn import masks
from eqx_bsattn.contract import EMPTY, build_layout
from eqx_bsattn.strategies.sharding.balance import balanced_chunks, document_row_work


def skewed_documents(length: int, seed: int = 0) -> np.ndarray:
    """Sorted segment ids: one document of 40 % of the sequence, one of 15 %, and documents
    of log-normal lengths (median 2k tokens), in a random order; the last 1 % padding."""
    rng = np.random.default_rng(seed)
    sizes = [int(0.40 * length), int(0.15 * length)]
    body = int(0.99 * length)
    while sum(sizes) < body:
        sizes.append(max(16, int(rng.lognormal(np.log(2048), 1.0))))
    sizes[-1] -= sum(sizes) - body
    sizes = rng.permutation(sizes)  # the long documents anywhere in the sequence
    ids = np.full(length, -1, np.int64)
    ids[:body] = np.repeat(np.arange(len(sizes)), sizes)
    return ids


def row_work(case: str, length: int, block: int) -> np.ndarray:
    if case == "skewed documents":
        return document_row_work(skewed_documents(length), block)
    mask = {
        "window 1024": masks.Causal() & masks.SlidingWindow(1024, 0),
        "BigBird": masks.Causal() & (masks.SlidingWindow(256, 0) | masks.GlobalTokens(256)
                                     | masks.BigBirdRandom(block, 3)),
    }[case]
    layout = build_layout(mask, q_len=length, kv_len=length, num_heads=1, block_q=block,
                          block_kv=block)
    return (np.asarray(layout.classes)[0, 0] != EMPTY).sum(axis=1)


def imbalance(work: np.ndarray, rows: np.ndarray) -> float:
    loads = work[rows].sum(axis=1)
    return float(loads.max() / loads.mean())


def orders(blocks: int, n: int) -> dict[str, np.ndarray]:
    """``{order: [n, rows per device]}`` block rows each device holds."""
    ids = np.arange(blocks)
    half = ids.reshape(2 * n, -1)
    return {
        "contiguous": ids.reshape(n, -1),
        "zig-zag": np.concatenate([half[:n], half[::-1][:n]], axis=1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1 << 20)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--out", help="write the table as JSON")
    args = parser.parse_args()
    rows = []
    print("| mask | devices | contiguous | zig-zag | balanced | visible blocks |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in ("skewed documents", "window 1024", "BigBird"):
        work = row_work(case, args.length, args.block)
        for n in (8, 64, 1024):
            got = {name: imbalance(work, r) for name, r in orders(len(work), n).items()}
            # As RingAttention(order="balanced") deals them: 8 slices per device.
            slices = work.reshape(n * 8, -1).sum(axis=1)
            got["balanced"] = imbalance(slices, balanced_chunks(slices, n))
            rows.append(dict(mask=case, devices=n, **got, visible=int(work.sum())))
            print(f"| {case} | {n} | {got['contiguous']:.3f} | {got['zig-zag']:.3f} | "
                  f"{got['balanced']:.3f} | {int(work.sum()):,} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
