"""A `Predicate` whose layouts are built when the call runs (it holds `params`) classifies its
blocks from their ranges of positions (`Predicate.range_classes`, intervals), not by
evaluating every (query, key) pair: exactly the built-in window's blocks for a per-head window,
conservative (never a visible block skipped, never a hidden pair in a FULL block) for any
other, and by pairs where an operation has no interval rule. Checked against the classes of
every pair in NumPy."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks
from eqx_bsattn.strategies.masks import custom


def window_params(q, k, params, head):
    return (k <= q) & (q - k <= params["width"][head])


def mixed(q, k, w, head):
    """Remainders, absolute values, products and a select: classified conservatively."""
    near = jnp.abs(q - 2 * k) < w[head] * 5
    return jnp.where(w[head] > 1, (k <= q - 3) & ((q - k) % 2 == 1), near) | (k == 0)


def bitwise(q, k, w, head):
    """An exclusive or of positions: no interval rule, so every pair is evaluated."""
    return ((q ^ k) & 7) < w[head]


def _exact_classes(fn, params, heads, lq, lk, bq, bk, q_pos=None):
    """``[heads, nq, nk]`` EMPTY / PARTIAL / FULL of every block from all its pairs (the
    ragged last kv-block never FULL)."""
    qp = np.arange(lq) if q_pos is None else np.asarray(q_pos)
    vis = np.stack([np.asarray(fn(jnp.asarray(qp)[:, None], jnp.arange(lk)[None], params,
                                  head=h)) for h in range(heads)])
    nq, nk = -(-lq // bq), -(-lk // bk)
    pad = np.zeros((heads, nq * bq, nk * bk), bool)
    pad[:, :lq, :lk] = np.broadcast_to(vis, (heads, lq, lk))
    valid = np.zeros((nq * bq, nk * bk), bool)
    valid[:lq, :lk] = True
    blocks, valid = pad.reshape(heads, nq, bq, nk, bk), valid.reshape(nq, bq, nk, bk)
    out = np.where((blocks | ~valid).all((2, 4)), 2, np.where((blocks & valid).any((2, 4)), 1, 0))
    if lk % bk:
        out[..., -1] = np.minimum(out[..., -1], 1)
    return out


def _classes(mask, heads, lq, lk, bq, bk, **data):
    layout = bsa.build_layout(mask, q_len=lq, kv_len=lk, num_heads=heads, block_q=bq,
                              block_kv=bk, **data)
    assert not layout.is_static
    return np.asarray(layout.classes)[0]


def _by_ranges(monkeypatch) -> list:
    """Whether each call of `predicate_block_classes` classified by ranges (not ``None``)."""
    calls, real = [], custom.predicate_block_classes

    def spy(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(custom, "predicate_block_classes", spy)
    return calls


def test_per_head_window_by_ranges_is_the_built_in_windows_layout(monkeypatch):
    """Widths that differ by head (0, within a block, across blocks), ragged lengths: each
    head's classes are those of every pair, and those of the built-in window of its width;
    traced widths (`eqx.filter_jit`) give the same."""
    calls = _by_ranges(monkeypatch)
    widths = np.asarray([0, 7, 64, 200], np.int32)
    mask = masks.Predicate(window_params, {"width": jnp.asarray(widths)})
    lq, lk, bq, bk = 300, 270, 32, 64
    got = _classes(mask, 4, lq, lk, bq, bk)
    assert calls and all(calls)
    want = _exact_classes(window_params, {"width": widths}, 4, lq, lk, bq, bk)
    np.testing.assert_array_equal(got, want)
    for h, w in enumerate(widths):
        built_in = bsa.build_layout(masks.Causal() & masks.SlidingWindow(int(w), 0), q_len=lq,
                                    kv_len=lk, num_heads=1, block_q=bq, block_kv=bk)
        np.testing.assert_array_equal(got[h], np.asarray(built_in.classes)[0, 0])
    traced = eqx.filter_jit(lambda m: bsa.build_layout(
        m, q_len=lq, kv_len=lk, num_heads=4, block_q=bq, block_kv=bk).classes)(mask)
    np.testing.assert_array_equal(np.asarray(traced)[0], want)


def test_other_predicates_by_ranges_are_conservative(monkeypatch):
    """Remainders, absolute values, products and selects, with per-call positions: no block
    with a visible pair is EMPTY and no block with a hidden pair is FULL."""
    calls = _by_ranges(monkeypatch)
    w = jnp.asarray([0, 1, 2, 3], jnp.int32)
    lq, lk, bq, bk = 200, 256, 32, 64
    q_pos = np.sort(np.random.default_rng(0).choice(400, size=lq)).astype(np.int32)
    got = _classes(masks.Predicate(mixed, w), 4, lq, lk, bq, bk, q_positions=q_pos,
                   kv_positions=np.arange(lk, dtype=np.int32))
    assert calls and all(calls)
    want = _exact_classes(mixed, w, 4, lq, lk, bq, bk, q_pos=q_pos)
    assert ((got == 0) <= (want == 0)).all() and ((got == 2) <= (want == 2)).all()
    assert (got == 0).any()


def test_a_predicate_without_interval_rules_is_classified_by_its_pairs(monkeypatch):
    calls = _by_ranges(monkeypatch)
    w = jnp.asarray([1, 3, 5, 8], jnp.int32)
    got = _classes(masks.Predicate(bitwise, w), 4, 256, 256, 64, 64)
    assert calls and not any(calls)
    np.testing.assert_array_equal(got, _exact_classes(bitwise, w, 4, 256, 256, 64, 64))


@pytest.mark.parametrize("name", ["lt", "le", "gt", "ge", "eq", "ne"])
def test_comparison_ranges_bound_every_pair(name):
    """``(surely, maybe)`` of a comparison of two ranges against every pair in them."""
    rng = np.random.default_rng(1)
    lo = rng.integers(-5, 5, size=(2, 200))
    hi = lo + rng.integers(0, 4, size=(2, 200))
    surely, maybe = map(np.asarray, custom._compare(
        name, (jnp.asarray(lo[0]), jnp.asarray(hi[0])), (jnp.asarray(lo[1]), jnp.asarray(hi[1]))))
    op = getattr(np, {"lt": "less", "le": "less_equal", "gt": "greater",
                      "ge": "greater_equal", "eq": "equal", "ne": "not_equal"}[name])
    for n in range(200):
        a, b = np.arange(lo[0, n], hi[0, n] + 1), np.arange(lo[1, n], hi[1, n] + 1)
        pairs = op(a[:, None], b[None, :])
        assert surely[n] == pairs.all() and maybe[n] == pairs.any(), (n, name)


def test_products_that_would_wrap_int32_keep_every_block():
    """``q * k`` past 2^31 wraps in int32: its range is then the whole int32 range, so the
    blocks there stay PARTIAL (never EMPTY) wherever a pair is visible."""
    def far(q, k, w, head):
        return q * k * 4 >= w[head]

    w = jnp.asarray([2**31 - 1], jnp.int32)
    pos = np.arange(0, 2**16, 2**16 // 256, dtype=np.int32) + 2**15
    got = _classes(masks.Predicate(far, w), 1, 256, 256, 64, 64, q_positions=pos,
                   kv_positions=pos)
    assert (got == 1).all()
