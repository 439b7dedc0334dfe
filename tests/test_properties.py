"""Property tests: random shapes, block sizes, GQA groups, per-call positions and segment ids, and
masks composed from the built-ins (predicates, per-head masks and documents among them).

CI runs the "ci" hypothesis profile: derandomized, a few examples per test. For a longer,
randomized search run ``HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_properties.py``.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
from eqx_bsattn.contract import POSITION_LIMIT
from tests.conftest import (
    assert_close,
    np_attention,
    np_visibility,
    random_array,
    random_inputs,
    sorted_segments,
)
from tests.test_masks import check_layout

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None, derandomize=False,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
_BASE = settings.get_profile(PROFILE)


def examples(ci: int) -> settings:
    """`ci` examples under the CI profile; the chosen profile's count otherwise."""
    return settings(_BASE, max_examples=ci if PROFILE == "ci" else _BASE.max_examples)


small = st.integers(0, 40)


def _table_mask(draw_seed, bq, bk):
    table = np.random.default_rng(draw_seed).random((96 // bq + 1, 96 // bk + 1)) < 0.5
    return masks.BlockLayoutMask(table, (bq, bk))


# Predicates are module-level functions: a mask's function is part of its static identity.
def _every_third_causal(q, k):
    return (k <= q) & ((q + k) % 3 != 1)


def _even_sum(q, k):
    return (q + k) % 2 == 0


def _near_or_fifth(q, k):
    return (jnp.abs(q - k) <= 3) | (k % 5 == 0)


PREDICATES = (_every_third_causal, _even_sum, _near_or_fifth)

# (mask, tight): atoms whose block classes must equal the truth (positions = indices). A
# Document's layout is not tight: padding (-1) after the documents breaks the id ranges' order.
atoms = st.one_of(
    st.just((masks.Full(), True)),
    st.builds(lambda o, br: (masks.Causal(offset=o, bottom_right=br), True),
              st.integers(-20, 20), st.booleans()),
    st.builds(lambda left, right: (masks.SlidingWindow(left, right), True),
              st.none() | small, small),
    st.builds(lambda c: (masks.ChunkedCausal(c), True), st.integers(1, 40)),
    st.builds(lambda p: (masks.PrefixLM(p), True), small),
    st.builds(lambda g: (masks.GlobalTokens(g), True), st.integers(0, 10)),
    st.builds(lambda s: (masks.Dilated(s), True), st.integers(1, 5)),
    st.builds(lambda bs, n, seed, c: (masks.BigBirdRandom(bs, n, seed=seed, causal=c), True),
              st.integers(4, 24), st.integers(0, 3), st.integers(0, 9), st.booleans()),
    st.builds(lambda seed, bq, bk: (_table_mask(seed, bq, bk), True),
              st.integers(0, 99), st.integers(4, 24), st.integers(4, 24)),
    st.builds(lambda f: (masks.Predicate(f), True), st.sampled_from(PREDICATES)),
    st.just((masks.Document(), False)),
)


def _compose(children):
    return st.one_of(
        st.builds(lambda a, b: (a[0] & b[0], False), children, children),
        st.builds(lambda a, b: (a[0] | b[0], False), children, children),
        st.builds(lambda a: (~a[0], a[1]), children),  # negation keeps tightness
    )


plain_masks = st.recursive(atoms, _compose, max_leaves=4)


def _per_head(heads: int):
    """A `PerHead` of `heads` small masks (tight when every one is)."""
    children = st.recursive(atoms, _compose, max_leaves=2)
    return st.lists(children, min_size=heads, max_size=heads).map(
        lambda ms: (masks.PerHead([m for m, _ in ms]), all(t for _, t in ms)))


def _with_document():
    """A `Document` alone, or combined with a small mask (never tight)."""
    combine = {
        "alone": lambda m: masks.Document(),
        "and": lambda m: m & masks.Document(),
        "or": lambda m: m | masks.Document(),
        "not": lambda m: ~masks.Document() & m,
    }
    return st.builds(lambda how, m: (combine[how](m[0]), False), st.sampled_from(list(combine)),
                     st.recursive(atoms, _compose, max_leaves=2))


def mask_strategy(heads: int):
    """(mask, tight) for `heads` query heads: plain masks, documents, and `PerHead`s."""
    return st.one_of(plain_masks, _with_document(), _per_head(heads))


def _gappy_positions(rng, batch, length, start):
    """Sorted positions from `start` with repeats (step 0) and gaps (steps > 1)."""
    steps = rng.choice([0, 0, 1, 1, 1, 2, 3, 7], size=(batch, length))
    steps[:, 0] = 0
    return start + np.cumsum(steps, axis=-1)


@st.composite
def call_data(draw, mask, batch: int, q_len: int, kv_len: int,
              positions: bool | str = True):
    """NumPy per-call arrays ``{q_pos, kv_pos, q_seg, kv_seg}`` (``[batch, L]`` or absent).

    Segment ids whenever `mask` reads them: sorted documents, -1 padding at either end.
    Positions (if asked; a kind's name asks for that kind) are token indices (``"indices"``), a
    shifted range (``"shift"``), sorted with repeats and gaps (``"gaps"``), or a range at
    either end of the documented limits (``"limits"``).
    """
    data = {}
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if mask.uses_segment_ids:
        for name, length in (("q_seg", q_len), ("kv_seg", kv_len)):
            lead = draw(st.integers(0, min(9, length - 1)))
            trail = draw(st.integers(0, min(9, length - lead - 1)))
            docs = draw(st.integers(1, 4))
            body = sorted_segments(rng, batch, length - lead, docs, pad=trail)
            data[name] = np.concatenate([np.full((batch, lead), -1, np.int32), body], axis=1)
    if isinstance(positions, str):  # one kind asked for
        kind = positions
    else:
        kinds = ["indices", "shift", "gaps", "limits"] if positions else ["indices"]
        kind = draw(st.sampled_from(kinds))
    if kind == "limits":
        # Both ends of the documented range (`contract.POSITION_LIMIT`), queries a little off
        # the keys: every sum of a position and a mask size here stays inside int32.
        top = POSITION_LIMIT - 2 * max(q_len, kv_len) - 20
        base = draw(st.sampled_from([-POSITION_LIMIT, top]))
        data["q_pos"] = np.tile(np.arange(q_len) + base + draw(st.integers(0, 10)), (batch, 1))
        data["kv_pos"] = np.tile(np.arange(kv_len) + base, (batch, 1))
    elif kind == "shift":
        shift = draw(st.integers(-10, 30))
        data["q_pos"] = np.tile(np.arange(q_len) + shift, (batch, 1))
        data["kv_pos"] = np.tile(np.arange(kv_len), (batch, 1))
    elif kind == "gaps":
        data["q_pos"] = _gappy_positions(rng, batch, q_len, rng.integers(0, 10, (batch, 1)))
        data["kv_pos"] = _gappy_positions(rng, batch, kv_len, 0)
    return {n: np.asarray(x, np.int32) for n, x in data.items()}


def _call_kwargs(data):
    names = {"q_pos": "q_positions", "kv_pos": "kv_positions", "q_seg": "q_segment_ids",
             "kv_seg": "kv_segment_ids"}
    return {names[n]: jnp.asarray(x) for n, x in data.items()}


# ---------------------------------------------------------------------------------------------
# Layouts.


@pytest.mark.slow
@examples(25)
@given(data=st.data(), q_len=st.integers(1, 96), kv_len=st.integers(1, 96),
       block_q=st.integers(8, 64), block_kv=st.integers(8, 64), heads=st.integers(1, 3))
def test_layout_consistent_with_dense_mask(data, q_len, kv_len, block_q, block_kv, heads):
    mask, tight = data.draw(mask_strategy(heads), "mask")
    arrays = data.draw(call_data(mask, 1, q_len, kv_len, positions=False), "segment ids")
    layout = bsa.build_layout(mask, q_len=q_len, kv_len=kv_len, num_heads=heads,
                              block_q=block_q, block_kv=block_kv, **_call_kwargs(arrays))
    vis = np_visibility(mask, batch=1, heads=heads, q_len=q_len, kv_len=kv_len, **arrays)
    check_layout(layout, vis, tight=tight)


@pytest.mark.slow
@examples(25)
@given(data=st.data(), q_len=st.integers(1, 96), kv_len=st.integers(1, 96),
       block_q=st.sampled_from([4, 5, 8, 16, 64]), block_kv=st.sampled_from([4, 7, 8, 16, 64]),
       heads=st.integers(1, 2))
def test_dynamic_layout_consistent_with_dense_mask(data, q_len, kv_len, block_q, block_kv,
                                                   heads):
    mask, _ = data.draw(mask_strategy(heads), "mask")
    arrays = data.draw(call_data(mask, 2, q_len, kv_len), "per-call arrays")
    layout = bsa.build_layout(mask, q_len=q_len, kv_len=kv_len, num_heads=heads, block_q=block_q,
                              block_kv=block_kv, **_call_kwargs(arrays))
    vis = np_visibility(mask, batch=2, heads=heads, q_len=q_len, kv_len=kv_len, **arrays)
    check_layout(layout, vis, tight=False)


# ---------------------------------------------------------------------------------------------
# Kernels against the float64 oracle.


@st.composite
def attention_calls(draw, max_len: int = 96, positions: bool | str = True):
    """A whole call: shapes (GQA), mask, per-call arrays (`positions` as for `call_data`), and
    sometimes bias, sinks, soft cap and scale. Returns ``(mask, (q, k, v), call keyword arguments, oracle keyword arguments,
    visibility)``."""
    batch = draw(st.integers(1, 2))
    kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    heads = kv_heads * group
    q_len, kv_len = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    mask, _ = draw(mask_strategy(heads))
    arrays = draw(call_data(mask, batch, q_len, kv_len, positions))
    seed = draw(st.integers(0, 1000))
    qkv = random_inputs(seed, batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len,
                        kv_len=kv_len, dim=8, value_dim=draw(st.sampled_from([4, 8])))
    kw, oracle = _call_kwargs(arrays), {}
    bias = draw(st.sampled_from([None, (q_len, kv_len), (heads, q_len, kv_len),
                                 (batch, 1, q_len, kv_len)]))
    if bias is not None:
        kw["bias"] = oracle["bias"] = random_array(seed + 1, bias)
    sinks = draw(st.sampled_from([None, (2,), (heads,), (heads, 3)]))
    if sinks is not None:
        kw["sinks"] = oracle["sinks"] = random_array(seed + 2, sinks)
    oracle["soft_cap"] = draw(st.none() | st.floats(0.5, 20.0))
    oracle["scale"] = draw(st.none() | st.floats(0.1, 2.0))
    vis = np_visibility(mask, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, **arrays)
    return mask, qkv, kw, oracle, vis


def _check_kernel(kernel, call, tiling=None):
    mask, (q, k, v), kw, oracle, vis = call
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, tiling=tiling,
                                    softmax_scale=oracle["scale"],
                                    logits_soft_cap=oracle["soft_cap"])
    out = jax.jit(lambda q, k, v, kw: attn(q, k, v, **kw))(q, k, v, kw)
    assert_close(out, np_attention(q, k, v, vis, **oracle), 2e-5, type(kernel).__name__)


@pytest.mark.slow
@examples(20)
@given(call=attention_calls())
def test_reference_matches_numpy_oracle(call):
    _check_kernel(kernels.DenseReference(), call)


@pytest.mark.slow
@examples(20)
@given(call=attention_calls(max_len=64), block_q=st.sampled_from([4, 8, 16]),
       block_kv=st.sampled_from([4, 8, 16]))
def test_xla_block_sparse_matches_numpy_oracle(call, block_q, block_kv):
    _check_kernel(kernels.XlaBlockSparse(), call, bsa.Tiling(block_q=block_q, block_kv=block_kv))
