"""`TritonBlockSparse`'s mask compiler (`canonical_mask`), on the CPU: no Triton needed.

The kernel evaluates the canonical terms inside the tiles the layout visits; what it computes
is ``visited(tile) & canonical(q, k)``. These tests check that this equals the mask itself,
in particular when tile-aligned block tables are dropped from the canonical form.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from eqx_bsattn import masks
from eqx_bsattn._layout import build_layout, element_mask
from eqx_bsattn.strategies.kernels.triton import CanonicalMask, canonical_mask


def _table(seed, rows, cols):
    return np.random.default_rng(seed).random((rows, cols)) < 0.4


def _np_canonical(c: CanonicalMask, q_len, kv_len, segments=None):
    q = np.arange(q_len)[:, None]
    k = np.arange(kv_len)[None, :]
    vis = np.ones((q_len, kv_len), bool)
    if c.causal_offset is not None:
        vis &= k <= q + c.causal_offset
    if c.window_left is not None:
        vis &= k >= q - c.window_left
    if c.window_right is not None:
        vis &= k <= q + c.window_right
    if c.chunk is not None:
        vis &= (q // c.chunk) == (k // c.chunk)
    if c.prefix is not None:
        vis &= (k < c.prefix) | (k <= q)
    if c.document:
        vis &= (segments[:, None] == segments[None, :]) & (segments[:, None] >= 0)
    return vis


def _kernel_view(mask, c, tile, q_len, kv_len, segments=None):
    """What the kernel computes: the canonical terms inside the tiles the layout visits."""
    bq, bk = tile
    seg = None if segments is None else jnp.asarray(segments)[None]
    layout = build_layout(mask, q_len=q_len, kv_len=kv_len, num_heads=1, block_q=bq,
                          block_kv=bk, q_segment_ids=seg, kv_segment_ids=seg)
    visited = np.asarray(layout.classes[0, 0]) != masks.EMPTY
    visited = np.repeat(np.repeat(visited, bq, 0), bk, 1)[:q_len, :kv_len]
    return visited & _np_canonical(c, q_len, kv_len, segments)


def _truth(mask, q_len, kv_len, segments=None):
    seg = None if segments is None else jnp.asarray(segments)
    return np.asarray(element_mask(mask, 0, jnp.arange(q_len)[:, None],
                                   jnp.arange(kv_len)[None, :], q_len=q_len, kv_len=kv_len,
                                   q_segment_ids=seg, kv_segment_ids=seg))


def test_tables_need_aligned_tiles():
    table = _table(0, 4, 4)
    mask = masks.Causal() & masks.BlockLayoutMask(table, 128)
    assert canonical_mask(mask) is None
    assert canonical_mask(mask, [(128, 128), (64, 128)]) == CanonicalMask(causal_offset=0)
    assert canonical_mask(mask, [(128, 128), (64, 256)]) is None
    rect = masks.BlockLayoutMask(table, (64, 32))
    assert canonical_mask(rect, [(64, 32), (32, 16)]) == CanonicalMask()
    assert canonical_mask(rect, [(64, 64)]) is None
    bird = masks.Causal() & masks.BigBirdRandom(64, 2)
    assert canonical_mask(bird, [(64, 64)]) == CanonicalMask(causal_offset=0)
    assert canonical_mask(bird, [(128, 64)]) is None
    # Only inside an AND: an OR with a table still needs bitmaps.
    assert canonical_mask(masks.Causal() | masks.BlockLayoutMask(table, 128), [(64, 64)]) is None


@pytest.mark.parametrize("q_len,kv_len", [(256, 256), (300, 260), (200, 333)])
@pytest.mark.parametrize("tile", [(64, 64), (32, 64), (64, 32), (16, 16)])
def test_dropping_aligned_tables_keeps_the_mask(q_len, kv_len, tile):
    rows, cols = math.ceil(q_len / 64), math.ceil(kv_len / 64)
    table = masks.BlockLayoutMask(_table(1, rows, cols), 64)
    bird = masks.BigBirdRandom(64, 2, seed=3)
    cases = [
        masks.Causal() & table,
        table & masks.SlidingWindow(70, 0),
        masks.Causal(offset=-5) & bird & masks.PrefixLM(40),
        table & bird,
        masks.ChunkedCausal(96) & table,
    ]
    for mask in cases:
        c = canonical_mask(mask, [tile])
        assert c is not None, mask
        np.testing.assert_array_equal(_kernel_view(mask, c, tile, q_len, kv_len),
                                      _truth(mask, q_len, kv_len))


def test_dropping_tables_with_documents():
    q_len = kv_len = 320
    segments = np.sort(np.random.default_rng(2).integers(0, 5, q_len)).astype(np.int32)
    segments[-7:] = -1
    table = masks.BlockLayoutMask(_table(4, 5, 5), 64)
    mask = masks.Causal() & table & masks.Document()
    c = canonical_mask(mask, [(64, 64), (32, 64)])
    assert c == CanonicalMask(causal_offset=0, document=True)
    for tile in ((64, 64), (32, 64)):
        np.testing.assert_array_equal(_kernel_view(mask, c, tile, q_len, kv_len, segments),
                                      _truth(mask, q_len, kv_len, segments))
