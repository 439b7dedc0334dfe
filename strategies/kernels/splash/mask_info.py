"""Splash attention's block-info arrays, filled from a `BlockLayout`, and the in-kernel predicate
of the canonical `MaskTerms`.

Splash walks a grid ``(head, q-block, slot)`` (forward, dq) or ``(kv-block, head, slot)``
(dk/dv) and reads, per grid step, three small integer arrays that it prefetches into scalar
memory: ``block_mask`` (0 skip, 1 partial, 2 full), ``data_next`` (the block to load) and
``mask_next`` (the partial-block bitmap to load, when bitmaps are used). These are exactly the
layout's visit lists written slot by slot, so they are gathered from the lists here, in
``O(number of visited blocks)``: with NumPy at trace time for a static layout (the grid is as
wide as the longest list), with `jax.numpy` on the device for a layout built from per-call data
(the grid is as wide as the capacity, every block). Splash's own builder instead evaluates its
mask object block by block on the host: ``O(Lq x Lk)``.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eqx_bsattn.contract import BlockLayout, MaskTerms, pad_axis

_FULL, _PARTIAL = 2, 1


class BlockInfo(NamedTuple):
    """One pass's Splash block-info arrays, with leading ``[mb, mh]`` axes (1 or B, 1 or H).

    Forward and dq: ``[mb, mh, nq, width]`` (slot axis last); dk/dv: ``[mb, mh, width, nk]``
    (slot axis in the middle, as Splash's dk/dv grid reads it). ``mask_next`` is ``None``
    without bitmaps.
    """

    data_next: object
    block_mask: object
    mask_next: object | None


def _smallest_int(bound: int):
    """The smallest signed integer type that holds ``0 .. bound`` (scalar memory is scarce)."""
    for dtype in (np.int8, np.int16):
        if bound <= np.iinfo(dtype).max:
            return dtype
    return np.int32


def _is_concrete(layout: BlockLayout) -> bool:
    return layout.is_static and not isinstance(layout.full_count, jax.core.Tracer)


def _slots(full_count, full_index, partial_count, partial_index, bitmap_index, width: int, xp):
    """Write each list's FULL then PARTIAL blocks into ``width`` slots.

    Slots past a list's end are skipped (``block_mask`` 0) and repeat its last block and bitmap,
    so Splash's pipeline fetches nothing new for them.
    """
    slot = xp.broadcast_to(xp.arange(width, dtype=np.int32), full_count.shape + (width,))
    fc = full_count[..., None].astype(np.int32)
    pc = partial_count[..., None].astype(np.int32)
    count = fc + pc
    in_full = slot < fc
    from_partial = xp.clip(slot - fc, 0, xp.maximum(pc - 1, 0))
    take = lambda a, i: xp.take_along_axis(a, i, axis=-1)  # noqa: E731
    index = xp.where(in_full, take(full_index, xp.clip(slot, 0, full_index.shape[-1] - 1)),
                     take(partial_index, from_partial))
    last = take(index, xp.clip(count - 1, 0, width - 1))
    index = xp.where(slot < count, index, last)
    block_mask = xp.where(in_full, _FULL, xp.where(slot < count, _PARTIAL, 0))
    mask_next = None if bitmap_index is None else take(bitmap_index, from_partial)
    return index, block_mask, mask_next


def block_info(layout: BlockLayout, *, transposed: bool, num_q_blocks: int,
               num_kv_blocks: int) -> BlockInfo:
    """Splash's block-info arrays for one pass of `layout`.

    `transposed` reads the per-kv-block lists (the dk/dv pass). `num_q_blocks` /
    `num_kv_blocks` are the block counts of the padded sequences Splash runs (at least the
    layout's): the extra blocks are padding and visit nothing.
    """
    if transposed:
        lists = (layout.t_full_count, layout.t_full_index, layout.t_partial_count,
                 layout.t_partial_index, layout.t_bitmap_index)
        rows, cols = num_kv_blocks, num_q_blocks
    else:
        lists = (layout.full_count, layout.full_index, layout.partial_count,
                 layout.partial_index, layout.bitmap_index)
        rows, cols = num_q_blocks, num_kv_blocks
    concrete = _is_concrete(layout)
    xp = np if concrete else jnp
    lists = tuple(None if a is None else (np.asarray(a) if concrete else jnp.asarray(a))
                  for a in lists)
    fc, fi, pc, pi, bi = lists
    if concrete:
        width = max(int((fc + pc).max()) if fc.size else 0, 1)
    else:
        width = max(fi.shape[-1], 1)  # the capacity: every block of the other side
    index, block_mask, mask_next = _slots(fc, fi, pc, pi, bi, width, xp)
    # Padding blocks of the listed side visit nothing.
    index, block_mask = (pad_axis(a, 2, rows) for a in (index, block_mask))
    if mask_next is not None:
        mask_next = pad_axis(mask_next, 2, rows)
    index = index.astype(_smallest_int(cols))
    block_mask = block_mask.astype(np.int8)
    if mask_next is not None:
        mask_next = mask_next.astype(_smallest_int(int(layout.bitmaps.shape[0])))
    if transposed:
        index, block_mask = (xp.swapaxes(a, -1, -2) for a in (index, block_mask))
        if mask_next is not None:
            mask_next = xp.swapaxes(mask_next, -1, -2)
    return BlockInfo(index, block_mask, mask_next)


@dataclasses.dataclass(frozen=True)
class TermsPredicate:
    """The canonical `MaskTerms` (less segment ids) as Splash's ``mask_function``.

    Called inside the kernel on int32 token indices of queries and keys (broadcast to one
    shape); hashable, as Splash passes it as a static argument. `kv_len` hides the keys Splash
    sees past the true length (its sequences are padded to whole blocks); ``None`` when nothing
    is padded.
    """

    causal_offset: int | None = None
    window_left: int | None = None
    window_right: int | None = None
    chunk: int | None = None
    prefix: int | None = None
    kv_len: int | None = None

    @classmethod
    def from_terms(cls, terms: MaskTerms | None, kv_len: int | None) -> "TermsPredicate | None":
        """The predicate of `terms` (``None``: no terms, only the padding), or ``None`` when
        there is nothing to evaluate."""
        fields = {} if terms is None else dict(
            causal_offset=terms.causal_offset, window_left=terms.window_left,
            window_right=terms.window_right, chunk=terms.chunk, prefix=terms.prefix)
        predicate = cls(**fields, kv_len=kv_len)
        return predicate if predicate != cls() else None

    def __call__(self, q, k):
        conditions = []
        if self.kv_len is not None:
            conditions.append(k < self.kv_len)
        if self.causal_offset is not None:
            conditions.append(k <= q + self.causal_offset)
        if self.window_left is not None:
            conditions.append(k >= q - self.window_left)
        if self.window_right is not None:
            conditions.append(k <= q + self.window_right)
        if self.chunk is not None:
            conditions.append((q // self.chunk) == (k // self.chunk))
        if self.prefix is not None:
            conditions.append((k < self.prefix) | (k <= q))
        visible = conditions[0]
        for condition in conditions[1:]:
            visible = visible & condition
        return jnp.broadcast_to(visible, jnp.broadcast_shapes(q.shape, k.shape))


def padded_length(length: int, blocks) -> int:
    """`length` rounded up to a multiple of every block size in `blocks`."""
    step = math.lcm(*blocks)
    return -(-length // step) * step
