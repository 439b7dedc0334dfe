"""`build_layout` against the plain dense algorithm: the whole ``[mb, mh, nq, nk]`` class
matrix, then each row's and column's sorted lists.

`build_layout` never forms that matrix's temporaries whole (it works through bounded chunks of
q-block rows and kv-block columns); every field must still come out bit-identical: classes,
counts, lists, capacities, dtypes, bitmaps. Chunks are forced down to a few block pairs here so
that their edges fall everywhere.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import _layout, masks
from eqx_bsattn._layout import block_coords, element_mask
from tests.conftest import sorted_segments
from tests.test_masks import ALL_MASKS, DYNAMIC_MASKS, HEADS

EMPTY, PARTIAL, FULL = masks.EMPTY, masks.PARTIAL, masks.FULL
LIST_FIELDS = ("full_count", "full_index", "partial_count", "partial_index", "t_full_count",
               "t_full_index", "t_partial_count", "t_partial_index")


def _rows(x):
    return None if x is None else jnp.asarray(x, jnp.int32).reshape(-1, np.shape(x)[-1])


def _element_classes(mask, head, q_len, kv_len, block_q, block_kv, qp, kp, qs, ks):
    """[mb, nq, nk] classes from the element predicate over every pair at once."""
    nq, nk = math.ceil(q_len / block_q), math.ceil(kv_len / block_kv)
    batch = max([1] + [x.shape[0] for x in (qp, kp, qs, ks) if x is not None])
    qi = jnp.arange(nq * block_q, dtype=jnp.int32)[:, None]
    kj = jnp.arange(nk * block_kv, dtype=jnp.int32)[None, :]
    valid = np.asarray((qi < q_len) & (kj < kv_len))
    out = []
    for b in range(batch):
        pick = [None if x is None else x[min(b, x.shape[0] - 1)] for x in (qp, kp, qs, ks)]
        vis = np.asarray(element_mask(mask, head, qi, kj, q_len=q_len, kv_len=kv_len,
                                      q_positions=pick[0], kv_positions=pick[1],
                                      q_segment_ids=pick[2], kv_segment_ids=pick[3]))
        vis = np.broadcast_to(vis, valid.shape)
        tiles = (nq, block_q, nk, block_kv)
        any_vis = (vis & valid).reshape(tiles).any((1, 3))
        all_vis = (vis | ~valid).reshape(tiles).all((1, 3))
        out.append(np.where(all_vis, FULL, np.where(any_vis, PARTIAL, EMPTY)))
    return np.stack(out).astype(np.int8)


def _lists(flags, capacity):
    """Sorted indices of True along the last axis, padded with 0 to `capacity`."""
    count = flags.sum(-1).astype(np.int32)
    if capacity is None:
        capacity = max(int(count.max()), 1)
    index = np.zeros(flags.shape[:-1] + (capacity,), np.int32)
    for pos in np.ndindex(flags.shape[:-1]):
        hits = np.flatnonzero(flags[pos])
        index[pos][:len(hits)] = hits
    return count, index


def dense_layout(mask, *, q_len, kv_len, num_heads, block_q, block_kv, q_positions=None,
                 kv_positions=None, q_segment_ids=None, kv_segment_ids=None):
    """The layout's arrays by the plain algorithm, as a dict of NumPy arrays."""
    mask = mask.resolve(q_len, kv_len)
    qp, kp = _rows(q_positions), _rows(kv_positions)
    qs, ks = (_rows(q_segment_ids), _rows(kv_segment_ids)) if mask.uses_segment_ids else (None,
                                                                                          None)
    dynamic = any(x is not None for x in (qp, kp, qs, ks)) or _layout.carries_arrays(mask)
    nq, nk = math.ceil(q_len / block_q), math.ceil(kv_len / block_kv)
    per_head = []
    for h in range(num_heads if mask.head_dependent else 1):
        if mask.classifies_blocks:
            qc = block_coords(q_len, block_q, qp, qs, axis=-2)
            kc = block_coords(kv_len, block_kv, kp, ks, axis=-1)
            c = np.asarray(mask.blocks(qc, kc, h))
            per_head.append(c if c.ndim == 3 else c[None])
        else:
            per_head.append(_element_classes(mask, h, q_len, kv_len, block_q, block_kv,
                                             qp, kp, qs, ks))
    mb = max(c.shape[0] for c in per_head)
    classes = np.stack([np.broadcast_to(c, (mb, nq, nk)) for c in per_head], 1).astype(np.int8)
    if kv_len % block_kv:
        classes[..., -1] = np.minimum(classes[..., -1], PARTIAL)
    cap_q, cap_k = (nk, nq) if dynamic else (None, None)
    out = {"classes": classes}
    for prefix, flag in (("full", FULL), ("partial", PARTIAL)):
        out[f"{prefix}_count"], out[f"{prefix}_index"] = _lists(classes == flag, cap_q)
        t = np.swapaxes(classes, -1, -2) == flag
        out[f"t_{prefix}_count"], out[f"t_{prefix}_index"] = _lists(t, cap_k)
    out["is_static"] = not dynamic
    return out


def assert_same_layout(layout, want):
    assert layout.is_static == want["is_static"]
    for name in ("classes",) + LIST_FIELDS:
        got = np.asarray(getattr(layout, name))
        assert got.dtype == want[name].dtype, (name, got.dtype)
        assert got.shape == want[name].shape, (name, got.shape, want[name].shape)
        np.testing.assert_array_equal(got, want[name], err_msg=name)


#: Block pairs per chunk: the library's default, then a few (one or two rows or columns).
CHUNKS = (None, 9)


def assert_chunked_layouts_are(want, build, monkeypatch):
    """`build()` gives `want` at the default chunk size and at tiny ones."""
    default = _layout._CHUNK_PAIRS
    for pairs in CHUNKS:
        monkeypatch.setattr(_layout, "_CHUNK_PAIRS", default if pairs is None else pairs)
        assert_same_layout(build(), want)


# (q_len, kv_len, block_q, block_kv): ragged, Lq != Lk both ways, one query, one-token and odd
# tiles, tiles longer than the sequence.
# The first runs in every test run, the others carry the `slow` marker.
SHAPES = [(23, 17, 1, 5), (20, 45, 16, 32), (37, 37, 8, 8), (45, 20, 32, 16), (1, 19, 4, 3),
          (13, 29, 7, 64)]


def _shape_id(shape) -> str:
    return "x".join(map(str, shape))


def _shapes(shapes):
    return [pytest.param(s, id=_shape_id(s), marks=[pytest.mark.slow] if n else [])
            for n, s in enumerate(shapes)]


def _masks_by_shapes(masks_, shapes, quick=(), full=()):
    """``(name, mask, tight, shape)`` params over masks x shapes. The default run takes mask
    ``i`` at shape ``i mod len(shapes)``, so that it builds every mask and every shape, and
    the masks in `quick` and `full` at the first shape too; the rest of the cross product is
    the `extended` tier. Every pair but the masks in `quick` at the first shape is `slow`."""
    params = []
    for i, (name, mask, tight) in enumerate(masks_):
        for n, shape in enumerate(shapes):
            quick_pair = name in quick and n == 0
            marks = [] if quick_pair else [pytest.mark.slow]
            if not quick_pair and n != i % len(shapes) and not (name in full and n == 0):
                marks.append(pytest.mark.extended)
            params.append(pytest.param(name, mask, tight, shape, marks=marks,
                                       id=f"{name}-{_shape_id(shape)}"))
    return params


# A few masks of each kind in the quick subset (the masks' own tests cover the catalogue),
# and at the first shape in the full tier.
QUICK_STATIC = ("block_layout_rect", "not_window")
FULL_STATIC = ("per_head_composed",)


@pytest.mark.parametrize("name,mask,tight,shape", _masks_by_shapes(ALL_MASKS, SHAPES,
                                                                   QUICK_STATIC, FULL_STATIC))
def test_static_layout_is_the_dense_one(name, mask, tight, shape, monkeypatch):
    q_len, kv_len, block_q, block_kv = shape
    kw = dict(q_len=q_len, kv_len=kv_len, num_heads=HEADS, block_q=block_q, block_kv=block_kv)
    assert_chunked_layouts_are(dense_layout(mask, **kw), lambda: bsa.build_layout(mask, **kw),
                               monkeypatch)


def _call_data(rng, batch, q_len, kv_len):
    qpos = np.stack([np.arange(q_len) + 3, rng.permutation(q_len + 5)[:q_len]]
                    + [np.sort(rng.integers(0, q_len + 9, q_len)) for _ in range(batch - 2)])
    kpos = np.stack([np.arange(kv_len), rng.permutation(kv_len)]
                    + [np.sort(rng.integers(0, kv_len + 4, kv_len)) for _ in range(batch - 2)])
    qs = sorted_segments(rng, batch, q_len, 3, pad=min(2, q_len // 2))
    ks = sorted_segments(rng, batch, kv_len, 4, pad=min(3, kv_len // 2))
    return {name: jnp.asarray(x, jnp.int32) for name, x in (
        ("q_positions", qpos), ("kv_positions", kpos), ("q_segment_ids", qs),
        ("kv_segment_ids", ks))}


# Eager builds with call data dispatch every operation of every chunk: they are all `slow`;
# one mask is built under `jit` in every test run.
QUICK_DYNAMIC = ("causal_document",)
DYNAMIC = [pytest.param(*m, id=m[0], marks=[] if m[0] in QUICK_DYNAMIC else [pytest.mark.slow])
           for m in DYNAMIC_MASKS]


@pytest.mark.slow
@pytest.mark.parametrize("name,mask,tight,shape", _masks_by_shapes(DYNAMIC_MASKS, SHAPES[:5]))
def test_dynamic_layout_is_the_dense_one(name, mask, tight, shape, monkeypatch):
    """Per-call positions and segment ids."""
    q_len, kv_len, block_q, block_kv = shape
    kw = dict(q_len=q_len, kv_len=kv_len, num_heads=HEADS, block_q=block_q, block_kv=block_kv)
    data = _call_data(np.random.default_rng(3), 3, q_len, kv_len)
    want = dense_layout(mask, **kw, **data)
    if name in RANGE_CLASSIFIED:
        assert_sound_classes(bsa.build_layout(mask, **kw, **data), want)
        return
    assert_chunked_layouts_are(want, lambda: bsa.build_layout(mask, **kw, **data), monkeypatch)


#: Masks whose layouts built at call time classify blocks from position ranges (a `Predicate`:
#: `Predicate.range_classes`): sound, but a block the ranges cannot decide stays PARTIAL where
#: every pair would find it EMPTY or FULL (``(q - k) % 3`` over permuted positions).
RANGE_CLASSIFIED = {"predicate"}


def assert_sound_classes(layout, want):
    """Every block the layout calls EMPTY or FULL is that in the every-pair layout `want`,
    and every block `want` finds visible is visited."""
    got, exact = np.asarray(layout.classes), want["classes"]
    assert got.shape == exact.shape, (got.shape, exact.shape)
    decided = got != PARTIAL
    np.testing.assert_array_equal(got[decided], exact[decided])
    assert np.all(got[exact != 0] != 0)


@pytest.mark.parametrize("name,mask,tight", DYNAMIC)
def test_traced_layout_is_the_dense_one(name, mask, tight, monkeypatch):
    """Per-call positions and segment ids, the layout built inside `jit`."""
    kw = dict(q_len=37, kv_len=37, num_heads=HEADS, block_q=8, block_kv=8)
    data = _call_data(np.random.default_rng(5), 3, 37, 37)
    def build():  # a fresh function each time: each chunk size traces anew
        return jax.jit(lambda d: bsa.build_layout(mask, **kw, **d))(data)

    if name in RANGE_CLASSIFIED:
        assert_sound_classes(build(), dense_layout(mask, **kw, **data))
        return
    assert_chunked_layouts_are(dense_layout(mask, **kw, **data), build, monkeypatch)


@pytest.mark.parametrize("shape", _shapes(SHAPES[:4]))
@pytest.mark.slow
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head"])
def test_array_mask_layout_is_the_dense_one(shape, per_head, monkeypatch):
    """A mask array (per-call data in the mask itself), alone and under `Causal`."""
    q_len, kv_len, block_q, block_kv = shape
    rng = np.random.default_rng(11)
    table = rng.random((HEADS if per_head else 1, q_len, kv_len)) < 0.6
    table[..., : q_len // 2, :] = True  # some FULL blocks
    kw = dict(q_len=q_len, kv_len=kv_len, num_heads=HEADS, block_q=block_q, block_kv=block_kv)
    for mask in (masks.ArrayMask(table), masks.Causal() & masks.ArrayMask(table)):
        assert_chunked_layouts_are(dense_layout(mask, **kw),
                                   lambda: bsa.build_layout(mask, **kw), monkeypatch)


def test_bitmaps_survive_chunking(monkeypatch):
    """Element bitmaps are read from the lists: forcing small chunks changes none of them."""
    mask = masks.Causal() & (masks.SlidingWindow(5, 0) | masks.Predicate(
        lambda q, k: (q + k) % 3 == 0))
    kw = dict(q_len=29, kv_len=37, num_heads=2, block_q=8, block_kv=4, with_bitmaps=True)
    whole = bsa.build_layout(mask, **kw)
    monkeypatch.setattr(_layout, "_CHUNK_PAIRS", 3)
    chunked = bsa.build_layout(mask, **kw)
    for name in ("bitmaps", "bitmap_index", "t_bitmap_index", "classes") + LIST_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(chunked, name)),
                                      np.asarray(getattr(whole, name)), err_msg=name)


@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 1.0])
def test_np_lists_sparse_and_dense_rows(density):
    """Both ways of listing (nonzero for sparse chunks, a sort for dense ones) agree."""
    flags = np.random.default_rng(2).random((3, 5, 200)) < density
    capacity = max(int(flags.sum(-1).max()), 1)
    np.testing.assert_array_equal(_layout._np_lists(flags, capacity), _lists(flags, capacity)[1])
