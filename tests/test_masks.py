"""Masks at element level and block level, against an independent dense NumPy reference."""

import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks
from eqx_bsattn._layout import element_mask
from eqx_bsattn.contract import TokenCoords
from tests.conftest import np_mask, np_visibility, random_inputs, sorted_segments

EMPTY, PARTIAL, FULL = masks.EMPTY, masks.PARTIAL, masks.FULL


def every_third_causal(q, k):
    return (k <= q) & ((q + k) % 3 != 1)


def _table(seed, rows, cols, density=0.5):
    return np.random.default_rng(seed).random((rows, cols)) < density


HEADS = 4

# (id, mask, tight): `tight` says the block classes must equal the truth (up to the ragged last
# kv block) when positions are the token indices.
ATOMS = [
    ("full", masks.Full(), True),
    ("causal", masks.Causal(), True),
    ("causal_offset_pos", masks.Causal(offset=5), True),
    ("causal_offset_neg", masks.Causal(offset=-3), True),
    ("causal_bottom_right", masks.Causal(bottom_right=True), True),
    ("causal_bottom_right_offset", masks.Causal(offset=-2, bottom_right=True), True),
    ("window_sym", masks.SlidingWindow(6), True),
    ("window_pair", masks.SlidingWindow(3, 9), True),
    ("window_past", masks.SlidingWindow(7, 0), True),
    ("window_future", masks.SlidingWindow(0, 5), True),
    ("window_left_unbounded", masks.SlidingWindow(None, 2), True),
    ("window_right_unbounded", masks.SlidingWindow(11, None), True),
    ("chunked_8", masks.ChunkedCausal(8), True),
    ("chunked_5", masks.ChunkedCausal(5), True),
    ("chunked_1", masks.ChunkedCausal(1), True),
    ("prefix_0", masks.PrefixLM(0), True),
    ("prefix_10", masks.PrefixLM(10), True),
    ("global_0", masks.GlobalTokens(0), True),
    ("global_3", masks.GlobalTokens(3), True),
    ("dilated_1", masks.Dilated(1), True),
    ("dilated_3", masks.Dilated(3), True),
    ("bigbird_causal", masks.BigBirdRandom(8, 2), True),
    ("bigbird_free", masks.BigBirdRandom(7, 3, seed=5, causal=False), True),
    ("block_layout_square", masks.BlockLayoutMask(_table(0, 12, 12), 8), True),
    ("block_layout_rect", masks.BlockLayoutMask(_table(1, 16, 14), (6, 7)), True),
    ("predicate", masks.Predicate(every_third_causal), True),
    ("per_head", masks.PerHead([masks.Causal(), masks.SlidingWindow(4), masks.Full(),
                                masks.ChunkedCausal(6)]), True),
]

COMPOSITES = [
    ("causal_and_window", masks.Causal() & masks.SlidingWindow(9, 0), False),
    ("window_or_global", masks.SlidingWindow(3) | masks.GlobalTokens(2), False),
    ("not_causal", ~masks.Causal(), True),  # the negation of a tight mask is tight
    ("not_window", ~masks.SlidingWindow(4, 2), True),
    ("causal_and_not_chunked", masks.Causal() & ~masks.ChunkedCausal(8), False),
    ("dilated_window", masks.SlidingWindow(12, 0) & masks.Dilated(4), False),
    ("bigbird_full", masks.Causal() & (masks.SlidingWindow(8, 0) | masks.GlobalTokens(5)
                                       | masks.BigBirdRandom(8, 1, seed=2)), False),
    ("predicate_or_prefix", masks.Predicate(every_third_causal) | masks.PrefixLM(4), False),
    ("per_head_composed", masks.PerHead([masks.Causal() & masks.SlidingWindow(5, 0),
                                         ~masks.Causal(), masks.Dilated(2) | masks.GlobalTokens(1),
                                         masks.Predicate(every_third_causal)]), False),
]

ALL_MASKS = ATOMS + COMPOSITES
LENGTHS = [pytest.param(37, 37, marks=pytest.mark.slow), (20, 45)]

#: The masks the quick subset (``-m "not slow"``) runs through the per-mask tests, on one shape
#: (Lq < Lk, ragged): a few families, a negation, and a composite mixing families, a window and
#: heads. The rest are `slow`.
QUICK_MASKS = {"causal_bottom_right_offset", "chunked_5", "bigbird_free", "block_layout_rect",
               "predicate", "not_window", "per_head_composed"}


def mask_params(table, quick=QUICK_MASKS):
    """``(name, mask, tight)`` parameters of `table`; those not in `quick` are `slow`."""
    return [pytest.param(name, mask, tight, id=name,
                         marks=() if name in quick else pytest.mark.slow)
            for name, mask, tight in table]


def _dense_truth(mask, q_len, kv_len, heads=HEADS, **data):
    """[B or 1, H, Lq, Lk] from the NumPy reference."""
    batch = 1
    for x in data.values():
        if x is not None:
            batch = np.asarray(x).shape[0]
    return np_visibility(mask, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, **data)


def _package_elements(mask, q_len, kv_len, heads=HEADS):
    mask = mask.resolve(q_len, kv_len)
    qi = jnp.arange(q_len, dtype=jnp.int32)[:, None]
    kj = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
    return np.stack([
        np.broadcast_to(np.asarray(element_mask(mask, h, qi, kj, q_len=q_len, kv_len=kv_len)),
                        (q_len, kv_len))
        for h in range(heads)
    ])


# ---------------------------------------------------------------------------------------------
# Element level.


@pytest.mark.covering("name", "q_len")
@pytest.mark.parametrize("q_len,kv_len", LENGTHS)
@pytest.mark.parametrize("name,mask,tight", mask_params(ALL_MASKS))
def test_elements_match_numpy(name, mask, tight, q_len, kv_len):
    got = _package_elements(mask, q_len, kv_len)
    want = np_mask(mask, q_len=q_len, kv_len=kv_len, heads=HEADS)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name,mask,tight", mask_params(ATOMS))
def test_one_query_row(name, mask, tight):
    got = _package_elements(mask, 1, 30)
    np.testing.assert_array_equal(got, np_mask(mask, q_len=1, kv_len=30, heads=HEADS))


def test_element_semantics_spot_checks():
    """A few hand-derived entries, so the NumPy reference itself is anchored."""
    m = np_mask(masks.Causal(bottom_right=True), q_len=2, kv_len=5, heads=1)[0]
    np.testing.assert_array_equal(m, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    m = np_mask(masks.SlidingWindow(1, 0), q_len=3, kv_len=3, heads=1)[0]
    np.testing.assert_array_equal(m, [[1, 0, 0], [1, 1, 0], [0, 1, 1]])
    m = np_mask(masks.ChunkedCausal(2), q_len=4, kv_len=4, heads=1)[0]
    np.testing.assert_array_equal(m, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])
    m = np_mask(masks.PrefixLM(2), q_len=3, kv_len=4, heads=1)[0]
    np.testing.assert_array_equal(m, [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
    seg = np.array([0, 0, 1, -1])
    m = np_mask(masks.Document(), q_len=4, kv_len=4, heads=1, q_seg=seg, kv_seg=seg)[0]
    np.testing.assert_array_equal(m, [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])


@pytest.mark.slow  # documents with padding: the dynamic layouts' quick cases
def test_document_elements_with_padding():
    rng = np.random.default_rng(0)
    q_seg = sorted_segments(rng, 1, 30, 3, pad=4)[0]
    kv_seg = sorted_segments(rng, 1, 41, 4, pad=6)[0]
    mask = masks.Causal() & masks.Document()
    qi = jnp.arange(30)[:, None]
    kj = jnp.arange(41)[None, :]
    got = np.asarray(element_mask(mask, 0, qi, kj, q_len=30, kv_len=41,
                                  q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg)))
    want = np_mask(mask, q_len=30, kv_len=41, heads=1, q_seg=q_seg, kv_seg=kv_seg)[0]
    np.testing.assert_array_equal(got, want)
    assert not got[q_seg < 0].any() and not got[:, kv_seg < 0].any()


@pytest.mark.slow
def test_element_mask_hides_out_of_bounds_keys():
    qi = jnp.arange(8)[:, None]
    kj = jnp.arange(16)[None, :]
    got = np.asarray(element_mask(masks.Full(), 0, qi, kj, q_len=8, kv_len=10))
    assert got[:, :10].all() and not got[:, 10:].any()
    got = np.asarray(element_mask(~masks.Causal(), 0, qi, kj, q_len=8, kv_len=10))
    assert not got[:, 10:].any()


@pytest.mark.slow  # positions: the dynamic layouts' quick cases
def test_positions_shift_the_masks():
    qp = np.arange(10, 22)
    kp = np.arange(0, 30)
    mask = masks.Causal() & masks.SlidingWindow(4, 0)
    got = np.asarray(element_mask(mask, 0, jnp.arange(12)[:, None], jnp.arange(30)[None, :],
                                  q_len=12, kv_len=30, q_positions=jnp.asarray(qp),
                                  kv_positions=jnp.asarray(kp)))
    want = (kp[None] <= qp[:, None]) & (kp[None] >= qp[:, None] - 4)
    np.testing.assert_array_equal(got, want)


def test_per_head_traced_head_selects_the_mask():
    mask = masks.PerHead([masks.Causal(), masks.SlidingWindow(2), ~masks.Causal()])
    qi, kj = jnp.arange(9)[:, None], jnp.arange(9)[None, :]
    f = jax.jit(lambda h: element_mask(mask, h, qi, kj, q_len=9, kv_len=9))
    want = np_mask(mask, q_len=9, kv_len=9, heads=3)
    for h in range(3):
        np.testing.assert_array_equal(np.asarray(f(jnp.int32(h))), want[h])


def test_per_head_traced_head_evaluates_each_distinct_mask_once():
    """With a traced head, equal masks (not only the same object) are evaluated once and
    chosen by `where`s: no `switch`, which kernels on tiles may not lower; out-of-range heads
    take the last mask, as before."""
    traces = []

    def window(q, k):
        traces.append(1)
        return (k <= q) & (q - k < 3)

    mask = masks.PerHead([masks.Predicate(window), masks.Causal(), masks.Predicate(window),
                          masks.Causal() & masks.SlidingWindow(2, 0)])
    qi, kj = jnp.arange(9)[:, None], jnp.arange(9)[None, :]
    coords = (TokenCoords(qi, qi, None, 9), TokenCoords(kj, kj, None, 9))
    jaxpr = jax.make_jaxpr(lambda h: mask.elements(*coords, h))(jnp.int32(0))
    assert len(traces) == 1
    assert not any(e.primitive.name in ("cond", "switch") for e in jaxpr.jaxpr.eqns)
    want = np_mask(mask, q_len=9, kv_len=9, heads=4)
    f = jax.jit(lambda h: mask.elements(*coords, h))
    for h, expected in ((0, 0), (1, 1), (2, 2), (3, 3), (7, 3), (-1, 0)):
        np.testing.assert_array_equal(np.asarray(f(jnp.int32(h))), want[expected])


def test_mask_algebra_types_and_properties():
    a, b = masks.Causal(), masks.Document()
    assert isinstance(a & b, masks.And) and isinstance(a | b, masks.Or)
    assert isinstance(~a, masks.Not)
    assert (a & b).uses_segment_ids and not a.uses_segment_ids
    assert (~b).uses_segment_ids
    assert masks.PerHead([a, a]).head_dependent and not (a & b).head_dependent
    assert not masks.Predicate(every_third_causal).classifies_blocks
    assert not (a & masks.Predicate(every_third_causal)).classifies_blocks
    assert (a | masks.SlidingWindow(3)).classifies_blocks
    combined = a & (b | ~a)
    assert list(combined.nodes()) == [combined, a, b | ~a, b, ~a, a]


class CausalWindowElements(masks.AbstractMask):
    """A user mask that gives only its element predicate: a causal window of `width`."""

    width: int

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def elements(self, q, k, head):
        return (k.position <= q.position) & (k.position >= q.position - self.width)


@pytest.mark.slow
@pytest.mark.parametrize("lengths,blocks", [((256, 256), (32, 32)), ((200, 333), (16, 64))])
def test_an_elements_only_mask_gets_real_block_classes(lengths, blocks):
    q_len, kv_len = lengths
    user = CausalWindowElements(40)
    builtin = masks.Causal() & masks.SlidingWindow(40, 0)
    assert not user.classifies_blocks and builtin.classifies_blocks
    kw = dict(q_len=q_len, kv_len=kv_len, num_heads=1, block_q=blocks[0], block_kv=blocks[1])
    got = bsa.build_layout(user, **kw)
    want = bsa.build_layout(builtin, **kw)
    assert float(got.density()) == float(want.density()) < 0.5
    np.testing.assert_array_equal(np.asarray(got.classes), np.asarray(want.classes))


def test_concrete_masks_declare_their_class_variables():
    class Forgetful(masks.AbstractMask):
        def elements(self, q, k, head):
            return k.position <= q.position

    with pytest.raises(TypeError, match="reads_segment_ids|varies_by_head"):
        Forgetful()


def test_sliding_window_takes_its_arguments_by_name():
    # The README writes `SlidingWindow(left, right=left)`; the docstring lists both by name.
    assert masks.SlidingWindow(256, right=0) == masks.SlidingWindow(256, 0)
    assert masks.SlidingWindow(left=3) == masks.SlidingWindow(3, 3)
    assert masks.SlidingWindow(left=None, right=2) == masks.SlidingWindow(None, 2)


def test_equal_masks_are_equal_and_hash():
    assert masks.Causal() == masks.Causal()
    assert masks.SlidingWindow(3, 4) == masks.SlidingWindow(3, 4)
    assert hash(masks.BlockLayoutMask(np.eye(3, dtype=bool), 4)) == hash(
        masks.BlockLayoutMask(np.eye(3, dtype=bool), 4))


# ---------------------------------------------------------------------------------------------
# Block level.


def _truth_classes(vis, block_q, block_kv):
    """[..., Lq, Lk] bool -> [..., nq, nk] true classes over in-bounds pairs."""
    *lead, lq, lk = vis.shape
    nq, nk = math.ceil(lq / block_q), math.ceil(lk / block_kv)
    out = np.zeros((*lead, nq, nk), np.int8)
    for i in range(nq):
        for j in range(nk):
            blk = vis[..., i * block_q:(i + 1) * block_q, j * block_kv:(j + 1) * block_kv]
            allv = blk.all(axis=(-1, -2))
            anyv = blk.any(axis=(-1, -2))
            out[..., i, j] = np.where(allv, FULL, np.where(anyv, PARTIAL, EMPTY))
    return out


def _check_lists(classes, count, index, flag):
    """`index[..., :count]` lists exactly the positions where classes == flag, sorted; rest 0."""
    for pos in np.ndindex(classes.shape[:-1]):
        want = np.flatnonzero(classes[pos] == flag)
        c = int(count[pos])
        assert c == len(want), (pos, c, want)
        np.testing.assert_array_equal(index[pos][:c], want)
        assert (index[pos][c:] == 0).all()


def check_layout(layout, vis, *, tight: bool):
    """Every block class is consistent with the dense truth `vis` ``[mb', H, Lq, Lk]``; lists match.

    `vis` broadcasts against the layout's ``[mb, mh]`` leading axes.
    """
    bq, bk = layout.block_q, layout.block_kv
    lq, lk = vis.shape[-2:]
    assert (layout.q_len, layout.kv_len) == (lq, lk)
    classes = np.asarray(layout.classes)
    truth = _truth_classes(vis, bq, bk)
    nq, nk = truth.shape[-2:]
    assert classes.shape[-2:] == (nq, nk)
    lead = np.broadcast_shapes(classes.shape[:2], truth.shape[:2])
    c = np.broadcast_to(classes, lead + (nq, nk))
    t = np.broadcast_to(truth, lead + (nq, nk))
    assert set(np.unique(c)) <= {EMPTY, PARTIAL, FULL}
    # Soundness: FULL blocks are fully visible, EMPTY blocks have nothing visible.
    assert not ((c == FULL) & (t != FULL)).any(), "a FULL block hides some pair"
    assert not ((c == EMPTY) & (t != EMPTY)).any(), "an EMPTY block shows some pair"
    if lk % bk:
        assert (c[..., -1] != FULL).all(), "the ragged last kv block must not be FULL"
    if tight:
        expect = t.copy()
        if lk % bk:
            expect[..., -1] = np.minimum(expect[..., -1], PARTIAL)
        bad = np.argwhere(c != expect)
        assert bad.size == 0, f"not tight at {bad[:5].tolist()}: got {c[tuple(bad[0])]}, truth {expect[tuple(bad[0])]}"
    # Lists and transposed lists match the classes.
    _check_lists(classes, np.asarray(layout.full_count), np.asarray(layout.full_index), FULL)
    _check_lists(classes, np.asarray(layout.partial_count), np.asarray(layout.partial_index), PARTIAL)
    ct = np.swapaxes(classes, -1, -2)
    _check_lists(ct, np.asarray(layout.t_full_count), np.asarray(layout.t_full_index), FULL)
    _check_lists(ct, np.asarray(layout.t_partial_count), np.asarray(layout.t_partial_index), PARTIAL)
    if layout.is_static:
        # Static capacities are the true maxima.
        assert layout.full_index.shape[-1] == max(int(np.max(layout.full_count)), 1)
        assert layout.partial_index.shape[-1] == max(int(np.max(layout.partial_count)), 1)
    return classes


def check_bitmaps(layout, vis):
    bq, bk = layout.block_q, layout.block_kv
    lq, lk = vis.shape[-2:]
    nq, nk = layout.num_q_blocks, layout.num_kv_blocks
    padded = np.zeros(vis.shape[:-2] + (nq * bq, nk * bk), bool)
    padded[..., :lq, :lk] = vis
    bitmaps = np.asarray(layout.bitmaps)
    assert bitmaps.shape[1:] == (bq, bk)
    # Deduplicated: no two table entries are equal.
    assert len({b.tobytes() for b in bitmaps}) == len(bitmaps)

    def check(counts, indices, ids, transposed):
        """Each listed block's bitmap is the visibility of that block; returns how many."""
        seen = 0
        counts, indices, ids = (np.asarray(x) for x in (counts, indices, ids))
        for b, h, r in np.ndindex(counts.shape):
            vb = padded[min(b, padded.shape[0] - 1), min(h, padded.shape[1] - 1)]
            for s in range(counts[b, h, r]):
                i, j = (indices[b, h, r, s], r) if transposed else (r, indices[b, h, r, s])
                np.testing.assert_array_equal(bitmaps[ids[b, h, r, s]],
                                              vb[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk])
                seen += 1
        return seen

    assert check(layout.partial_count, layout.partial_index, layout.bitmap_index, False) \
        == int(np.asarray(layout.partial_count).sum())
    check(layout.t_partial_count, layout.t_partial_index, layout.t_bitmap_index, True)


# (q_len, kv_len, block_q, block_kv): square ragged, Lq < Lk ragged, Lq > Lk exact.
LAYOUT_SHAPES = [pytest.param(37, 37, 8, 8, marks=pytest.mark.slow), (20, 45, 16, 32),
                 pytest.param(45, 20, 32, 16, marks=pytest.mark.slow)]


@pytest.mark.covering("name", "q_len")
@pytest.mark.parametrize("q_len,kv_len,block_q,block_kv", LAYOUT_SHAPES)
@pytest.mark.parametrize("name,mask,tight", mask_params(ALL_MASKS))
def test_static_layout_matches_dense(name, mask, tight, q_len, kv_len, block_q, block_kv):
    layout = bsa.build_layout(mask, q_len=q_len, kv_len=kv_len, num_heads=HEADS,
                              block_q=block_q, block_kv=block_kv)
    assert layout.is_static
    assert layout.classes.shape[:2] == (1, HEADS if mask.head_dependent else 1)
    check_layout(layout, _dense_truth(mask, q_len, kv_len), tight=tight)


BITMAP_MASKS = [m for m in ALL_MASKS if m[0] in (
    "causal_bottom_right", "window_pair", "chunked_5", "dilated_3", "bigbird_free",
    "block_layout_rect", "predicate", "per_head", "not_causal", "bigbird_full",
    "per_head_composed")]


@pytest.mark.parametrize("name,mask,tight", mask_params(BITMAP_MASKS, {"predicate"}))
def test_bitmaps_reproduce_the_mask(name, mask, tight):
    q_len, kv_len = 37, 45
    layout = bsa.build_layout(mask, q_len=q_len, kv_len=kv_len, num_heads=HEADS, block_q=16,
                              block_kv=8, with_bitmaps=True)
    check_bitmaps(layout, _dense_truth(mask, q_len, kv_len))


def test_layout_counts_for_causal_are_exact():
    layout = bsa.build_layout(masks.Causal(), q_len=64, kv_len=64, num_heads=1, block_q=16,
                              block_kv=16)
    np.testing.assert_array_equal(np.asarray(layout.full_count)[0, 0], [0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(layout.partial_count)[0, 0], [1, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(layout.partial_index)[0, 0, :, 0], [0, 1, 2, 3])
    assert float(layout.density()) == pytest.approx(10 / 16)
    assert int(layout.visited_pairs()) == 10 * 256


def test_ragged_visited_pairs():
    layout = bsa.build_layout(masks.Full(), q_len=20, kv_len=13, num_heads=1, block_q=8,
                              block_kv=8)
    assert int(layout.visited_pairs()) == 20 * 13
    assert (np.asarray(layout.classes)[..., -1] == PARTIAL).all()
    assert (np.asarray(layout.classes)[..., 0] == FULL).all()


# Dynamic layouts (positions, segment ids).

DYNAMIC_MASKS = ALL_MASKS + [
    ("document", masks.Document(), False),
    ("causal_document", masks.Causal() & masks.Document(), False),
    ("window_document", masks.SlidingWindow(5, 2) & masks.Document(), False),
    ("not_document", ~masks.Document(), False),
    ("document_or_global", masks.Document() | masks.GlobalTokens(3), False),
    ("per_head_document", masks.PerHead([masks.Document(), masks.Causal() & masks.Document(),
                                         masks.SlidingWindow(4), ~masks.Document()]), False),
]

# Masks whose layouts must hold FULL blocks under the positions and segment ids below (with
# small tiles), so that "no FULL block hides a pair" is not checked vacuously. Windows without
# `Causal` on top among them.
FULL_UNDER_CALL_DATA = {
    "full", "causal", "causal_offset_pos", "causal_bottom_right", "window_sym", "window_pair",
    "window_past", "window_left_unbounded", "window_right_unbounded", "prefix_10", "dilated_1",
    "bigbird_causal", "block_layout_square", "per_head", "not_causal", "not_window", "document",
    "causal_document", "not_document", "document_or_global", "per_head_document",
}


def _positions_with_gaps(rng, batch, length, start):
    """[batch, length] sorted int32 positions from `start`: repeats (step 0) and gaps (> 1)."""
    steps = rng.choice([0, 0, 1, 1, 1, 2, 3, 6], size=(batch, length))
    steps[:, 0] = 0
    return (np.asarray(start)[:, None] + np.cumsum(steps, axis=-1)).astype(np.int32)


def _segments_padded_both_ends(rng, batch, length, docs):
    """[batch, length] sorted document ids with -1 padding at the start and at the end."""
    out = np.empty((batch, length), np.int32)
    for b in range(batch):
        lead, trail = rng.integers(1, 6), rng.integers(1, 6)
        body = sorted_segments(rng, 1, length - lead, docs, pad=trail)[0]
        out[b] = np.concatenate([np.full(lead, -1, np.int32), body])
    return out


@pytest.mark.covering("name", "block_q")
@pytest.mark.parametrize("block_q,block_kv", [
    pytest.param(8, 16, id="8x16", marks=pytest.mark.slow), pytest.param(4, 8, id="4x8")])
@pytest.mark.parametrize("name,mask,tight", mask_params(DYNAMIC_MASKS, {
    "window_document", "per_head_document"}))
def test_dynamic_layout_with_positions_and_segments(name, mask, tight, block_q, block_kv):
    """Block classes agree with the element predicate under per-call positions and segment ids:
    no FULL block holds a hidden in-bounds pair, no EMPTY block a visible one."""
    rng = np.random.default_rng(7)
    batch, q_len, kv_len = 4, 29, 43
    # Positions: a shifted range, a random permutation-like mix, and two sorted draws with
    # repeats and gaps (queries starting a little after the keys).
    qpos = np.concatenate([
        np.stack([np.arange(q_len) + 11, rng.permutation(q_len + 14)[:q_len]]),
        _positions_with_gaps(rng, 2, q_len, rng.integers(0, 8, 2)),
    ]).astype(np.int32)
    kpos = np.concatenate([
        np.stack([np.arange(kv_len), rng.permutation(kv_len)]),
        _positions_with_gaps(rng, 2, kv_len, [0, 0]),
    ]).astype(np.int32)
    # Segment ids with padding on both ends of both sides; masks that do not read them get
    # them too (and must ignore them).
    qs = _segments_padded_both_ends(rng, batch, q_len, 3)
    ks = _segments_padded_both_ends(rng, batch, kv_len, 4)
    layout = bsa.build_layout(mask, q_len=q_len, kv_len=kv_len, num_heads=HEADS, block_q=block_q,
                              block_kv=block_kv, q_positions=jnp.asarray(qpos),
                              kv_positions=jnp.asarray(kpos), q_segment_ids=jnp.asarray(qs),
                              kv_segment_ids=jnp.asarray(ks))
    assert not layout.is_static
    assert layout.classes.shape[0] in (1, batch)
    # Dynamic capacities are every block.
    assert layout.full_index.shape[-1] == layout.num_kv_blocks
    assert layout.t_partial_index.shape[-1] == layout.num_q_blocks
    vis = _dense_truth(mask, q_len, kv_len, q_pos=qpos, kv_pos=kpos, q_seg=qs, kv_seg=ks)
    classes = check_layout(layout, vis, tight=False)
    if name in FULL_UNDER_CALL_DATA and (block_q, block_kv) == (4, 8):
        assert (classes == FULL).any(), "no FULL block: the FULL check above was vacuous"


@pytest.mark.slow
@pytest.mark.parametrize("name,mask,tight", ATOMS, ids=[m[0] for m in ATOMS])
def test_dynamic_index_positions_equal_static(name, mask, tight):
    """Positions equal to the token indices give exactly the static layout."""
    q_len, kv_len = 37, 45
    mask = mask.resolve(q_len, kv_len)
    static = bsa.build_layout(mask, q_len=q_len, kv_len=kv_len, num_heads=HEADS, block_q=8,
                              block_kv=16)
    dyn = bsa.build_layout(mask, q_len=q_len, kv_len=kv_len, num_heads=HEADS, block_q=8,
                           block_kv=16, q_positions=jnp.arange(q_len)[None],
                           kv_positions=jnp.arange(kv_len)[None])
    np.testing.assert_array_equal(np.asarray(dyn.classes), np.asarray(static.classes))


def test_document_layout_is_tight_for_sorted_segments():
    rng = np.random.default_rng(3)
    seg = sorted_segments(rng, 3, 96, 5)
    mask = masks.Document()
    layout = bsa.build_layout(mask, q_len=96, kv_len=96, num_heads=2, block_q=8, block_kv=8,
                              q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg))
    check_layout(layout, _dense_truth(mask, 96, 96, heads=2, q_seg=seg, kv_seg=seg), tight=True)


@pytest.mark.slow
def test_document_layout_padding_blocks_are_empty():
    seg = np.full((1, 64), -1, np.int32)
    seg[0, :20] = 0
    layout = bsa.build_layout(masks.Document(), q_len=64, kv_len=64, num_heads=1, block_q=16,
                              block_kv=16, q_segment_ids=jnp.asarray(seg),
                              kv_segment_ids=jnp.asarray(seg))
    classes = np.asarray(layout.classes)[0, 0]
    assert (classes[2:, :] == EMPTY).all() and (classes[:, 2:] == EMPTY).all()
    assert classes[0, 0] == FULL and classes[1, 1] == PARTIAL


def test_segment_ids_ignored_by_masks_that_do_not_read_them():
    seg = jnp.zeros((2, 32), jnp.int32)
    layout = bsa.build_layout(masks.Causal(), q_len=32, kv_len=32, num_heads=1, block_q=8,
                              block_kv=8, q_segment_ids=seg, kv_segment_ids=seg)
    assert layout.is_static


def test_new_segment_ids_do_not_retrace():
    traces = []
    q, k, v = random_inputs(0, batch=2, heads=2, q_len=32, dim=8)
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=bsa.kernels.DenseReference())

    @jax.jit
    def f(seg):
        traces.append(1)
        layout = bsa.build_layout(attn.mask & masks.Document(), q_len=32, kv_len=32, num_heads=2,
                                  block_q=8, block_kv=8, q_segment_ids=seg, kv_segment_ids=seg)
        return layout.classes, attn(q, k, v, q_segment_ids=seg, kv_segment_ids=seg)

    rng = np.random.default_rng(0)
    outs = []
    for n in (2, 3, 5):
        seg = jnp.asarray(sorted_segments(rng, 2, 32, n, pad=2))
        classes, out = f(seg)
        truth = _truth_classes(_dense_truth(masks.Causal() & masks.Document(), 32, 32, heads=1,
                                            q_seg=np.asarray(seg), kv_seg=np.asarray(seg)), 8, 8)
        c = np.asarray(classes)
        assert not ((c == EMPTY) & (truth != EMPTY)).any()
        assert not ((c == FULL) & (truth != FULL)).any()
        outs.append(np.asarray(out))
    assert len(traces) == 1
    assert not np.allclose(outs[0], outs[2])


def test_equal_modules_trace_once_per_mask():
    # The module is an argument, rebuilt for every call: equal masks must compare and hash equal
    # (static hyperparameters only), so only a different mask traces again.
    traces = []
    q, k, v = random_inputs(1, batch=1, heads=2, q_len=16, dim=8)

    @eqx.filter_jit
    def f(attn, q, k, v):
        traces.append(1)
        return attn(q, k, v)

    builders = [
        lambda: masks.Causal() & masks.SlidingWindow(4, 0),
        lambda: masks.BlockLayoutMask(np.eye(2, dtype=bool), 8) | ~masks.ChunkedCausal(4),
        lambda: masks.PerHead([masks.Predicate(every_third_causal), masks.BigBirdRandom(8, 1)]),
    ]
    for n, build in enumerate(builders, 1):
        for shift in (0.0, 1.0):
            attn = bsa.BlockSparseAttention(mask=build(), kernel=bsa.kernels.DenseReference())
            f(attn, q + shift, k, v)
        assert len(traces) == n


def test_build_layout_under_jit_with_positions():
    mask = masks.Causal() & masks.SlidingWindow(8, 0)

    @jax.jit
    def f(qp, kp):
        return bsa.build_layout(mask, q_len=24, kv_len=40, num_heads=1, block_q=8, block_kv=8,
                                q_positions=qp, kv_positions=kp)

    for shift in (0, 16):
        qp = np.arange(24)[None] + shift
        kp = np.arange(40)[None]
        layout = f(jnp.asarray(qp), jnp.asarray(kp))
        check_layout(layout, _dense_truth(mask, 24, 40, heads=1, q_pos=qp, kv_pos=kp), tight=True)


def test_bottom_right_causal_layout_without_resolving():
    """`build_layout` honours `bottom_right` when given the mask as the user wrote it."""
    mask = masks.Causal(bottom_right=True)
    layout = bsa.build_layout(mask, q_len=16, kv_len=48, num_heads=1, block_q=8, block_kv=8)
    check_layout(layout, _dense_truth(mask, 16, 48, heads=1), tight=True)


# ---------------------------------------------------------------------------------------------
# Validation.


@pytest.mark.parametrize("make,match", [
    (lambda: masks.SlidingWindow(-1), "left"),
    (lambda: masks.SlidingWindow(3, -2), "right"),
    (lambda: masks.SlidingWindow(2.5), "left"),
    (lambda: masks.SlidingWindow(None, None), "left"),
    (lambda: masks.ChunkedCausal(0), "chunk_size"),
    (lambda: masks.ChunkedCausal(-4), "chunk_size"),
    (lambda: masks.PrefixLM(-1), "prefix_length"),
    (lambda: masks.GlobalTokens(-1), "num_global"),
    (lambda: masks.Dilated(0), "stride"),
    (lambda: masks.BigBirdRandom(0, 2), "block_size"),
    (lambda: masks.BigBirdRandom(8, -1), "num_random"),
    (lambda: masks.Causal(offset=1.5), "offset"),
    (lambda: masks.PerHead([]), "PerHead"),
    (lambda: masks.BlockLayoutMask(np.zeros((0, 3), bool), 8), "layout"),
    (lambda: masks.BlockLayoutMask(np.full((2, 2), 3), 8), "layout"),
    (lambda: masks.BlockLayoutMask(np.ones((2, 2), bool), (8, 8, 8)), "block_size"),
    (lambda: masks.BlockLayoutMask(np.ones((2, 2), bool), 0), "block_size"),
])
def test_mask_construction_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_mask_type_errors():
    with pytest.raises(TypeError, match="Predicate"):
        masks.Predicate(3)
    with pytest.raises(TypeError, match="PerHead"):
        masks.PerHead([masks.Causal(), "causal"])
    with pytest.raises(TypeError, match="masks combine"):
        masks.Causal() & 1
    with pytest.raises(TypeError, match="masks combine"):
        masks.Causal() | None
    bad = masks.Predicate(lambda q, k: (q - k).astype(jnp.int32))
    with pytest.raises(TypeError, match="booleans"):
        bsa.build_layout(bad, q_len=8, kv_len=8, num_heads=1, block_q=8, block_kv=8)


def test_per_head_head_count_mismatch():
    mask = masks.PerHead([masks.Causal()] * 3)
    with pytest.raises(ValueError, match="3 masks.*4 heads"):
        mask.check(16, 16, 4)
    q, k, v = random_inputs(0, batch=1, heads=4, q_len=16)
    with pytest.raises(ValueError, match="PerHead"):
        bsa.BlockSparseAttention(mask=mask, kernel=bsa.kernels.DenseReference())(q, k, v)
    with pytest.raises(ValueError, match="PerHead"):
        bsa.BlockSparseAttention(mask=masks.Causal() & mask)(q, k, v)


def test_block_layout_mask_too_small():
    mask = masks.BlockLayoutMask(np.ones((2, 3), bool), (8, 8))
    mask.check(16, 24, 1)  # exactly covered
    with pytest.raises(ValueError, match="BlockLayoutMask.*q_len=17"):
        mask.check(17, 24, 1)
    with pytest.raises(ValueError, match="kv_len=25"):
        mask.check(16, 25, 1)
    q, k, v = random_inputs(0, batch=1, heads=1, q_len=16, kv_len=32)
    with pytest.raises(ValueError, match="BlockLayoutMask"):
        bsa.BlockSparseAttention(mask=mask)(q, k, v)


def test_build_layout_errors():
    with pytest.raises(ValueError, match="block sizes"):
        bsa.build_layout(masks.Causal(), q_len=8, kv_len=8, num_heads=1, block_q=0, block_kv=8)
    seg = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="bitmaps"):
        bsa.build_layout(masks.Document(), q_len=8, kv_len=8, num_heads=1, block_q=8,
                         block_kv=8, q_segment_ids=seg, kv_segment_ids=seg, with_bitmaps=True)
    with pytest.raises(ValueError, match="Document"):
        bsa.build_layout(masks.Document(), q_len=8, kv_len=8, num_heads=1, block_q=8, block_kv=8)


@pytest.mark.slow
def test_predicate_params_held_as_numpy_are_indexed_by_a_traced_head():
    """A sharding hands replicated params to its devices as NumPy constants; a predicate
    reading ``widths[head]`` with the head traced (an element map built under `jax.vmap`)
    must still see them as an array it can index so."""

    def window(q, k, widths, head):
        return (k <= q) & (q - k < widths[head])

    mask = masks.Predicate(window, jnp.asarray([2, 5], jnp.int32))
    mask = eqx.tree_at(lambda m: m.params, mask, np.asarray([2, 5], np.int32))
    qi, ki = jnp.arange(8)[:, None], jnp.arange(8)[None, :]
    got = jax.vmap(lambda h: element_mask(mask, h, qi, ki, q_len=8, kv_len=8))(jnp.arange(2))
    q, k = np.arange(8)[:, None], np.arange(8)[None, :]
    want = np.stack([(k <= q) & (q - k < w) for w in (2, 5)])
    np.testing.assert_array_equal(np.asarray(got), want)
