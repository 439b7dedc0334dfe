"""The compiled mask: each mask's canonical terms, their tile alignment, and what the plan
compiles for each kind of kernel. No kernel needed.

A kernel that evaluates terms computes ``visited(tile) & terms(q, k)``; these tests check that
this equals the mask (by the NumPy reference of `tests.conftest`) for every mask with terms.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks
from eqx_bsattn.contract import MaskTerms
from tests.conftest import np_mask, sorted_segments


def _table(seed, rows, cols):
    return np.random.default_rng(seed).random((rows, cols)) < 0.4


def _np_terms(t: MaskTerms, q_len, kv_len, q_pos=None, kv_pos=None, segments=None):
    """The terms evaluated in NumPy, from their documented meaning."""
    q = (np.arange(q_len) if q_pos is None else np.asarray(q_pos))[:, None]
    k = (np.arange(kv_len) if kv_pos is None else np.asarray(kv_pos))[None, :]
    vis = np.ones((q_len, kv_len), bool)
    if t.causal_offset is not None:
        vis &= k <= q + t.causal_offset
    if t.window_left is not None:
        vis &= k >= q - t.window_left
    if t.window_right is not None:
        vis &= k <= q + t.window_right
    if t.chunk is not None:
        vis &= np.floor_divide(q, t.chunk) == np.floor_divide(k, t.chunk)
    if t.prefix is not None:
        vis &= (k < t.prefix) | (k <= q)
    if t.segment_ids:
        vis &= (segments[:, None] == segments[None, :]) & (segments[:, None] >= 0)
    assert not t.tables, "tables have no in-kernel form"
    return vis


def _kernel_view(resolved, terms, tile, **np_data):
    """What a terms-evaluating kernel computes: the terms inside the tiles the layout visits."""
    bq, bk = tile
    layout = resolved.layout(bq, bk)
    visited = np.asarray(layout.classes[0, 0]) != masks.EMPTY
    visited = np.repeat(np.repeat(visited, bq, 0), bk, 1)[:resolved.q_len, :resolved.kv_len]
    return visited & _np_terms(terms, resolved.q_len, resolved.kv_len, **np_data)


def _resolve(mask, q_len, kv_len, segments=None, heads=1):
    seg = None if segments is None else jnp.asarray(segments)[None]
    return bsa.ResolvedMask(mask, q_len=q_len, kv_len=kv_len, num_heads=heads,
                            q_segment_ids=seg, kv_segment_ids=seg)


def test_atoms_declare_their_terms():
    assert masks.Full().terms(0) == MaskTerms()
    assert masks.Causal(offset=-2).terms(0) == MaskTerms(causal_offset=-2)
    assert masks.Causal(bottom_right=True).terms(0) is None  # unresolved
    assert masks.SlidingWindow(5, None).terms(0) == MaskTerms(window_left=5)
    assert masks.ChunkedCausal(8).terms(0) == MaskTerms(causal_offset=0, chunk=8)
    assert masks.PrefixLM(4).terms(0) == MaskTerms(prefix=4)
    assert masks.Document().terms(0) == MaskTerms(segment_ids=True)
    assert masks.BlockLayoutMask(np.eye(2, dtype=bool), (4, 8)).terms(0) == MaskTerms(
        tables=((4, 8),))
    assert masks.BigBirdRandom(16, 2).terms(0) == MaskTerms(tables=((16, 16),))
    for none in (masks.GlobalTokens(2), masks.Dilated(3), masks.Predicate(np.greater_equal),
                 ~masks.Causal(), masks.Causal() | masks.SlidingWindow(3)):
        assert none.terms(0) is None


def test_and_takes_the_tighter_term():
    mask = (masks.Causal(offset=3) & masks.SlidingWindow(10, 4) & masks.ChunkedCausal(16)
            & masks.PrefixLM(9) & masks.PrefixLM(5) & masks.SlidingWindow(20, 2)
            & masks.Document())
    assert mask.terms(0) == MaskTerms(causal_offset=0, window_left=10, window_right=2,
                                      chunk=16, prefix=5, segment_ids=True)
    assert (masks.ChunkedCausal(8) & masks.ChunkedCausal(16)).terms(0) is None
    assert (masks.ChunkedCausal(8) & masks.ChunkedCausal(8)).terms(0) == MaskTerms(
        causal_offset=0, chunk=8)


def test_per_head_terms_and_the_shared_terms():
    per_head = masks.PerHead([masks.Causal(), masks.SlidingWindow(4), masks.Dilated(2)])
    resolved = bsa.ResolvedMask(per_head, q_len=16, kv_len=16, num_heads=3)
    assert resolved.head_terms == (MaskTerms(causal_offset=0),
                                   MaskTerms(window_left=4, window_right=4), None)
    assert resolved.terms is None
    same = masks.PerHead([masks.Causal()] * 2) & masks.SlidingWindow(3, 0)
    resolved = bsa.ResolvedMask(same, q_len=16, kv_len=16, num_heads=2)
    assert resolved.terms == MaskTerms(causal_offset=0, window_left=3, window_right=0)


def test_resolution_makes_bottom_right_causal_a_term():
    resolved = bsa.ResolvedMask(masks.Causal(bottom_right=True), q_len=10, kv_len=25,
                                num_heads=1)
    assert resolved.terms == MaskTerms(causal_offset=15)


def test_tables_need_aligned_tiles():
    table = _table(0, 4, 4)
    resolved = _resolve(masks.Causal() & masks.BlockLayoutMask(table, 128), 512, 512)
    assert resolved.terms == MaskTerms(causal_offset=0, tables=((128, 128),))
    assert resolved.kernel_terms([(128, 128), (64, 128)]) == MaskTerms(causal_offset=0)
    assert resolved.kernel_terms([(128, 128), (64, 256)]) is None
    rect = _resolve(masks.BlockLayoutMask(table, (64, 32)), 256, 128)
    assert rect.kernel_terms([(64, 32), (32, 16)]) == MaskTerms()
    assert rect.kernel_terms([(64, 64)]) is None
    bird = _resolve(masks.Causal() & masks.BigBirdRandom(64, 2), 256, 256)
    assert bird.kernel_terms([(64, 64)]) == MaskTerms(causal_offset=0)
    assert bird.kernel_terms([(128, 64)]) is None
    # Only inside an AND: an OR with a table has no terms at all.
    assert _resolve(masks.Causal() | masks.BlockLayoutMask(table, 128), 512, 512).terms is None
    # Tables are looked up on positions: with positions, a tile is no cell.
    pos = jnp.arange(512)[None]
    moved = bsa.ResolvedMask(masks.Causal() & masks.BlockLayoutMask(table, 128), q_len=512,
                             kv_len=512, num_heads=1, q_positions=pos, kv_positions=pos)
    assert moved.kernel_terms([(128, 128)]) is None


#: (tile, q_len, kv_len) of the quick subset (``-m "not slow"``); the rest are `slow`.
_QUICK_ALIGNED = {((64, 32), 200, 333)}


@pytest.mark.parametrize("tile,q_len,kv_len", [
    pytest.param(tile, q_len, kv_len, id=f"tile{tile[0]}x{tile[1]}-{q_len}-{kv_len}",
                 marks=() if (tile, q_len, kv_len) in _QUICK_ALIGNED else pytest.mark.slow)
    for tile in [(64, 64), (32, 64), (64, 32), (16, 16)]
    for q_len, kv_len in [(256, 256), (300, 260), (200, 333)]])
def test_aligned_tables_in_visited_tiles_keep_the_mask(q_len, kv_len, tile):
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
        resolved = _resolve(mask, q_len, kv_len)
        terms = resolved.kernel_terms([tile])
        assert terms is not None, mask
        np.testing.assert_array_equal(_kernel_view(resolved, terms, tile),
                                      np_mask(mask, q_len=q_len, kv_len=kv_len, heads=1)[0])


TERM_MASKS = {
    "full": masks.Full(),
    "causal_offset": masks.Causal(offset=-3),
    "bottom_right": masks.Causal(bottom_right=True),
    "window": masks.SlidingWindow(9, 2),
    "window_open": masks.SlidingWindow(None, 0) & masks.SlidingWindow(6, None),
    "chunked": masks.ChunkedCausal(12),
    "prefix": masks.PrefixLM(7) & masks.Causal(offset=2),
    "everything": masks.Causal(offset=1) & masks.SlidingWindow(20, 3) & masks.ChunkedCausal(32)
    & masks.PrefixLM(5),
}


@pytest.mark.parametrize("documents,tile,name", [
    # With documents: `slow` (outside the quick subset, ``-m "not slow"``).
    pytest.param(documents, tile, name, id=f"{documents}-tile{tile[0]}x{tile[1]}-{name}",
                 marks=pytest.mark.slow if documents else ())
    for documents in (False, True) for tile in [(16, 16), (8, 32)] for name in TERM_MASKS])
def test_terms_in_visited_tiles_are_the_mask(name, tile, documents):
    q_len, kv_len = 70, 85
    mask = TERM_MASKS[name]
    segments = None
    if documents:
        mask = mask & masks.Document()
        q_len = kv_len = 80
        segments = sorted_segments(np.random.default_rng(3), 1, q_len, 4, pad=6)[0]
    resolved = _resolve(mask, q_len, kv_len, segments)
    terms = resolved.kernel_terms([tile])
    got = _kernel_view(resolved, terms, tile, segments=segments)
    want = np_mask(mask, q_len=q_len, kv_len=kv_len, heads=1, q_seg=segments, kv_seg=segments)[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_terms_under_positions_are_the_mask():
    rng = np.random.default_rng(5)
    q_pos = np.sort(rng.integers(0, 200, 50))
    kv_pos = np.sort(rng.integers(0, 200, 90))
    mask = masks.Causal() & masks.SlidingWindow(30, 0) & masks.ChunkedCausal(64)
    resolved = bsa.ResolvedMask(mask, q_len=50, kv_len=90, num_heads=1,
                                q_positions=jnp.asarray(q_pos)[None],
                                kv_positions=jnp.asarray(kv_pos)[None])
    terms = resolved.kernel_terms([(16, 16)])
    layout = resolved.layout(16, 16)
    visited = np.asarray(layout.classes[0, 0]) != masks.EMPTY
    visited = np.repeat(np.repeat(visited, 16, 0), 16, 1)[:50, :90]
    got = visited & _np_terms(terms, 50, 90, q_pos=q_pos, kv_pos=kv_pos)
    want = np_mask(mask, q_len=50, kv_len=90, heads=1, q_pos=q_pos, kv_pos=kv_pos)[0]
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# What `compile` builds for each kind of kernel.

TILING = bsa.Tiling(block_q=32, block_kv=16, block_q_bwd=16, block_kv_bwd=32, block_q_dq=32,
                    block_kv_dq=16)


def test_compile_for_dense_kernels_builds_no_layout():
    compiled = _resolve(masks.Causal(), 64, 64).compile(TILING, "dense")
    assert compiled.layouts() == {} and compiled.terms == MaskTerms(causal_offset=0)


def test_compile_builds_one_layout_per_pass_and_shares_equal_tiles():
    resolved = _resolve(masks.Causal() & masks.SlidingWindow(20, 0), 96, 80)
    compiled = resolved.compile(TILING, "elements")
    assert (compiled.forward.block_q, compiled.forward.block_kv) == (32, 16)
    assert (compiled.dkv.block_q, compiled.dkv.block_kv) == (16, 32)
    assert compiled.dq is compiled.forward  # the dq tiles equal the forward ones
    assert compiled.forward.bitmaps is None and compiled.is_static
    want = bsa.build_layout(masks.Causal() & masks.SlidingWindow(20, 0), q_len=96, kv_len=80,
                            num_heads=1, block_q=16, block_kv=32)
    for name in ("classes", "t_full_count", "t_full_index", "t_partial_count",
                 "t_partial_index"):
        np.testing.assert_array_equal(getattr(compiled.dkv, name), getattr(want, name))


@pytest.mark.slow
def test_compile_adds_bitmaps_only_for_terms_kernels_without_terms():
    dilated = _resolve(masks.Causal() & masks.Dilated(3), 64, 64)
    assert dilated.compile(TILING, "elements").forward.bitmaps is None
    compiled = dilated.compile(TILING, "terms")
    assert compiled.terms is None and compiled.forward.bitmaps is not None
    causal = _resolve(masks.Causal(), 64, 64).compile(TILING, "terms")
    assert causal.terms == MaskTerms(causal_offset=0) and causal.forward.bitmaps is None
    # An unaligned table: no terms at these tiles, so bitmaps.
    table = _resolve(masks.BlockLayoutMask(np.eye(4, dtype=bool), 24), 96, 96)
    assert table.compile(TILING, "terms").forward.bitmaps is not None


@pytest.mark.slow
def test_compile_refuses_bitmaps_for_per_call_data():
    ids = jnp.asarray(sorted_segments(np.random.default_rng(0), 1, 64, 3))
    resolved = _resolve(masks.Dilated(2) & masks.Document(), 64, 64, segments=ids[0])
    assert not resolved.is_static
    with pytest.raises(ValueError, match="bitmaps"):
        resolved.compile(TILING, "terms")
    assert not resolved.compile(TILING, "elements").is_static


def test_compiled_visible_matches_the_reference():
    ids = sorted_segments(np.random.default_rng(1), 1, 40, 3, pad=4)[0]
    mask = masks.PerHead([masks.Causal(), ~masks.SlidingWindow(3)]) & masks.Document()
    compiled = _resolve(mask, 40, 40, segments=ids, heads=2).compile(TILING, "dense")
    qi, kj = jnp.arange(40)[:, None], jnp.arange(48)[None, :]
    want = np_mask(mask, q_len=40, kv_len=40, heads=2, q_seg=ids, kv_seg=ids)
    for h in range(2):
        got = np.asarray(compiled.visible(h, qi, kj, q_segment_ids=jnp.asarray(ids),
                                          kv_segment_ids=jnp.asarray(ids)))
        np.testing.assert_array_equal(got[:, :40], want[h])
        assert not got[:, 40:].any()  # keys past kv_len are hidden
