"""Sparse patterns: global tokens, dilation, explicit block layouts and BigBird random blocks."""

import functools
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqx_bsattn.contract import AbstractBlockMask, MaskTerms, classify

from .positional import _check_int


class GlobalTokens(AbstractBlockMask):
    """Longformer-style global tokens: the first `num_global` positions see and are seen by all.

    Key visible when ``pos_q < num_global`` or ``pos_k < num_global``. Combine with a local
    mask: ``SlidingWindow(256) | GlobalTokens(16)``.
    """

    num_global: int = eqx.field(static=True)

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def __check_init__(self):
        _check_int("num_global", self.num_global, minimum=0)

    def elements(self, q, k, head):
        return (q.position < self.num_global) | (k.position < self.num_global)

    def blocks(self, q, k, head):
        g = self.num_global
        full = (q.pos_hi < g) | (k.pos_hi < g)
        empty = (q.pos_lo >= g) & (k.pos_lo >= g)
        return classify(full, empty)


class Dilated(AbstractBlockMask):
    """Strided attention: key visible when ``(pos_q - pos_k) % stride == 0``.

    With a window, a dilated window: ``SlidingWindow(1024, 0) & Dilated(4)``. For
    ``stride > 1`` a block pair is FULL only when it holds a single pair at a multiple of the
    stride, and EMPTY when no difference in its range is a multiple of the stride.
    """

    stride: int = eqx.field(static=True)

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def __check_init__(self):
        _check_int("stride", self.stride, minimum=1)

    def elements(self, q, k, head):
        return (q.position - k.position) % self.stride == 0

    def blocks(self, q, k, head):
        s = self.stride
        lo = q.pos_lo - k.pos_hi  # smallest difference in the block pair
        hi = q.pos_hi - k.pos_lo
        # Some multiple of s lies in [lo, hi] iff floor(hi / s) >= ceil(lo / s).
        has_multiple = jnp.floor_divide(hi, s) >= -jnp.floor_divide(-lo, s)
        full = (lo == hi) & (lo % s == 0) if s > 1 else jnp.ones(lo.shape, bool)
        return classify(full, ~has_multiple)


def _prefix_sums(table: np.ndarray) -> jax.Array:
    """``[rows + 1, cols + 1]`` int32: ``sums[r, c]`` counts the True cells above and left."""
    rows, cols = table.shape
    sums = np.zeros((rows + 1, cols + 1), np.int32)
    sums[1:, 1:] = np.cumsum(np.cumsum(table, 0), 1)
    with jax.ensure_compile_time_eval():  # a constant, cached: never a tracer
        return jnp.asarray(sums)


def _table_blocks(table: np.ndarray, block_q: int, block_k: int, q, k, sums=None):
    """Classify tiles against a boolean table of (block_q x block_k) cells, by prefix sums
    (`sums`, computed from `table` when not given)."""
    rows, cols = table.shape
    sums = _prefix_sums(table) if sums is None else sums
    r0, r1 = q.pos_lo // block_q, q.pos_hi // block_q
    c0, c1 = k.pos_lo // block_k, k.pos_hi // block_k
    inside = (r0 >= 0) & (c0 >= 0) & (r1 < rows) & (c1 < cols)
    r0c, r1c = jnp.clip(r0, 0, rows), jnp.clip(r1 + 1, 0, rows)
    c0c, c1c = jnp.clip(c0, 0, cols), jnp.clip(c1 + 1, 0, cols)
    count = sums[r1c, c1c] - sums[r0c, c1c] - sums[r1c, c0c] + sums[r0c, c0c]
    area = (r1 - r0 + 1) * (c1 - c0 + 1)
    return classify(inside & (count == area), count == 0)


def _table_elements(table: np.ndarray, block_q: int, block_k: int, q, k):
    rows, cols = table.shape
    r = q.position // block_q
    c = k.position // block_k
    inside = (r >= 0) & (r < rows) & (c >= 0) & (c < cols)
    hit = jnp.asarray(table)[jnp.clip(r, 0, rows - 1), jnp.clip(c, 0, cols - 1)]
    return inside & hit


#: id(layout) -> (layout, table, prefix sums) of the last few `BlockLayoutMask` layouts.
_LAYOUT_TABLES: dict[int, tuple] = {}


def _layout_table(layout: tuple) -> tuple[np.ndarray, jax.Array]:
    """A `BlockLayoutMask` layout's boolean table and prefix sums, made once per layout object:
    a long sequence's layout classifies its blocks a chunk of rows at a time."""
    hit = _LAYOUT_TABLES.get(id(layout))
    if hit is None or hit[0] is not layout:  # the entry holds `layout`: its id is not reused
        table = np.asarray(layout, dtype=bool)
        table.flags.writeable = False
        hit = (layout, table, _prefix_sums(table))
        if len(_LAYOUT_TABLES) >= 8:
            _LAYOUT_TABLES.pop(next(iter(_LAYOUT_TABLES)))
        _LAYOUT_TABLES[id(layout)] = hit
    return hit[1], hit[2]


class BlockLayoutMask(AbstractBlockMask):
    """An explicit boolean block matrix: pair visible when ``layout[pos_q // bq, pos_k // bk]``.

    **Arguments:**

    - `layout`: ``[rows, cols]`` booleans (array-like); it must cover the sequence lengths.
    - `block_size`: an int, or ``(bq, bk)``: the size of one cell of `layout` in tokens.

    ```python
    layout = np.tril(np.ones((32, 32), bool))
    masks.BlockLayoutMask(layout, block_size=128)
    ```
    """

    layout: tuple[tuple[bool, ...], ...] = eqx.field(static=True)
    block_size: tuple[int, int] = eqx.field(static=True)

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def __init__(self, layout, block_size: int | tuple[int, int]):
        table = np.asarray(layout)
        if table.ndim != 2 or table.size == 0:
            raise ValueError(f"`layout` must be a non-empty 2-D boolean matrix; got shape {table.shape}.")
        if table.dtype != bool:
            if not np.isin(table, (0, 1)).all():
                raise ValueError("`layout` must hold booleans (or 0/1).")
            table = table.astype(bool)
        self.layout = tuple(tuple(bool(x) for x in row) for row in table)
        if isinstance(block_size, int):
            block_size = (block_size, block_size)
        block_size = tuple(block_size)
        if len(block_size) != 2:
            raise ValueError(f"`block_size` must be an int or a pair; got {block_size!r}.")
        for b in block_size:
            _check_int("block_size", b, minimum=1)
        self.block_size = block_size

    @property
    def table(self) -> np.ndarray:
        """The layout as a read-only ``[rows, cols]`` boolean array."""
        return _layout_table(self.layout)[0]

    def check(self, q_len, kv_len, num_heads):
        rows, cols = len(self.layout), len(self.layout[0])
        need = (math.ceil(q_len / self.block_size[0]), math.ceil(kv_len / self.block_size[1]))
        if rows < need[0] or cols < need[1]:
            raise ValueError(
                f"BlockLayoutMask layout is {rows}x{cols} cells of {self.block_size}, but "
                f"q_len={q_len}, kv_len={kv_len} need at least {need[0]}x{need[1]}."
            )

    def elements(self, q, k, head):
        return _table_elements(self.table, *self.block_size, q, k)

    def blocks(self, q, k, head):
        table, sums = _layout_table(self.layout)
        return _table_blocks(table, *self.block_size, q, k, sums)

    def terms(self, head):
        return MaskTerms(tables=(self.block_size,))


@functools.lru_cache(maxsize=8)
def _random_block_sums(rows: int, cols: int, num_random: int, seed: int,
                       causal: bool) -> jax.Array:
    # Layouts of long sequences classify a chunk of rows at a time: the sums once per table.
    return _prefix_sums(_random_blocks(rows, cols, num_random, seed, causal))


@functools.lru_cache(maxsize=64)
def _random_blocks(rows: int, cols: int, num_random: int, seed: int, causal: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    table = np.zeros((rows, cols), bool)
    for r in range(rows):
        limit = min(r + 1, cols) if causal else cols
        if limit <= 0:
            continue
        picks = rng.choice(limit, size=min(num_random, limit), replace=False)
        table[r, picks] = True
    return table


class BigBirdRandom(AbstractBlockMask):
    """BigBird's random blocks: each row of `block_size` queries sees `num_random` random key blocks.

    Seeded, so the pattern is the same every call. With ``causal=True`` the random blocks
    are drawn among blocks at or before the row. Combine with a window and global tokens for
    full BigBird: ``Causal() & (SlidingWindow(256, 0) | GlobalTokens(256) | BigBirdRandom(128, 3))``.
    """

    block_size: int = eqx.field(static=True)
    num_random: int = eqx.field(static=True)
    seed: int = eqx.field(default=0, static=True)
    causal: bool = eqx.field(default=True, static=True)

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def __check_init__(self):
        _check_int("block_size", self.block_size, minimum=1)
        _check_int("num_random", self.num_random, minimum=0)
        _check_int("seed", self.seed, minimum=0, maximum=None)

    def table(self, q_len: int, kv_len: int) -> np.ndarray:
        """The ``[ceil(q_len / bs), ceil(kv_len / bs)]`` boolean table of random blocks."""
        rows = math.ceil(q_len / self.block_size)
        cols = math.ceil(kv_len / self.block_size)
        return _random_blocks(rows, cols, self.num_random, self.seed, self.causal)

    def elements(self, q, k, head):
        t = self.table(q.length, k.length)
        return _table_elements(t, self.block_size, self.block_size, q, k)

    def blocks(self, q, k, head):
        t = self.table(q.length, k.length)
        sums = _random_block_sums(*t.shape, self.num_random, self.seed, self.causal)
        return _table_blocks(t, self.block_size, self.block_size, q, k, sums)

    def terms(self, head):
        return MaskTerms(tables=((self.block_size, self.block_size),))
