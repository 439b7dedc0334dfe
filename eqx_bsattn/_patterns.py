"""The attention patterns the demo and the benchmark measure, defined once.

- ``causal``: `Causal()`.
- ``window``: `Causal() & SlidingWindow(window, 0)`.
- ``document``: 16 documents of random length (segment ids), causal inside each.
- ``bigbird``: 128-token blocks; causal; the diagonal block and the one before it, the first
  2 blocks (global), and 3 random earlier blocks per row.
"""

import numpy as np

from ._mask import AbstractMask
from .strategies import masks


def document_segment_ids(length: int, num_documents: int = 16, seed: int = 0) -> np.ndarray:
    """``[length]`` int32 segment ids: `num_documents` contiguous documents of random length."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, length), size=num_documents - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [length]]))
    return np.repeat(np.arange(num_documents, dtype=np.int32), lengths)


def bigbird_mask(length: int, block: int = 128, num_global_blocks: int = 2, num_random: int = 3,
                 seed: int = 0) -> AbstractMask:
    """Causal BigBird at block granularity: the diagonal and previous block, the first
    `num_global_blocks` blocks, and `num_random` random earlier blocks per row of blocks."""
    n = -(-length // block)
    rows = np.arange(n)[:, None]
    cols = np.arange(n)[None, :]
    table = ((rows - cols) >= 0) & ((rows - cols) <= 1)
    table |= cols < num_global_blocks
    table |= masks.BigBirdRandom(block, num_random, seed=seed, causal=True).table(length, length)
    return masks.Causal() & masks.BlockLayoutMask(table, block)


def pattern(name: str, length: int, *, window: int = 1024, seed: int = 0) -> tuple[AbstractMask, dict]:
    """``(mask, per_call_kwargs)`` of a named pattern at `length` (kwargs: segment ids)."""
    if name == "causal":
        return masks.Causal(), {}
    if name == "window":
        return masks.Causal() & masks.SlidingWindow(window, 0), {}
    if name == "document":
        ids = document_segment_ids(length, seed=seed)
        return masks.Causal() & masks.Document(), {"q_segment_ids": ids, "kv_segment_ids": ids}
    if name == "bigbird":
        return bigbird_mask(length, seed=seed), {}
    raise ValueError(f"unknown pattern {name!r}; known: causal, window, document, bigbird.")


PATTERNS = ("causal", "window", "document", "bigbird")
