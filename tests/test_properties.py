"""Property tests: random shapes, block sizes, GQA groups and masks composed from the built-ins."""

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
from tests.conftest import assert_close, np_attention, np_visibility, random_inputs
from tests.test_masks import check_layout

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

small = st.integers(0, 40)


def _table_mask(draw_seed, bq, bk):
    table = np.random.default_rng(draw_seed).random((96 // bq + 1, 96 // bk + 1)) < 0.5
    return masks.BlockLayoutMask(table, (bq, bk))


# (mask, tight): atoms whose block classes must equal the truth (positions = indices).
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
)


def _compose(children):
    return st.one_of(
        st.builds(lambda a, b: (a[0] & b[0], False), children, children),
        st.builds(lambda a, b: (a[0] | b[0], False), children, children),
        st.builds(lambda a: (~a[0], a[1]), children),  # negation keeps tightness
    )


mask_strategy = st.recursive(atoms, _compose, max_leaves=4)


@SETTINGS
@given(mask=mask_strategy, q_len=st.integers(1, 96), kv_len=st.integers(1, 96),
       block_q=st.integers(8, 64), block_kv=st.integers(8, 64), heads=st.integers(1, 3))
def test_layout_consistent_with_dense_mask(mask, q_len, kv_len, block_q, block_kv, heads):
    mask, tight = mask
    layout = bsa.build_layout(mask, q_len=q_len, kv_len=kv_len, num_heads=heads,
                              block_q=block_q, block_kv=block_kv)
    vis = np_visibility(mask, batch=1, heads=heads, q_len=q_len, kv_len=kv_len)
    check_layout(layout, vis, tight=tight)


@SETTINGS
@given(mask=mask_strategy, q_len=st.integers(1, 96), kv_len=st.integers(1, 96),
       block_q=st.integers(8, 64), block_kv=st.integers(8, 64),
       shift=st.integers(-10, 30))
def test_dynamic_layout_consistent_with_dense_mask(mask, q_len, kv_len, block_q, block_kv, shift):
    mask, _ = mask
    qp = (np.arange(q_len) + shift)[None].astype(np.int32)
    kp = np.arange(kv_len)[None].astype(np.int32)
    layout = bsa.build_layout(mask, q_len=q_len, kv_len=kv_len, num_heads=1, block_q=block_q,
                              block_kv=block_kv, q_positions=qp, kv_positions=kp)
    vis = np_visibility(mask, batch=1, heads=1, q_len=q_len, kv_len=kv_len, q_pos=qp, kv_pos=kp)
    check_layout(layout, vis, tight=False)


@settings(SETTINGS, max_examples=20)
@given(mask=mask_strategy, q_len=st.integers(1, 96), kv_len=st.integers(1, 96),
       kv_heads=st.integers(1, 2), group=st.integers(1, 3), seed=st.integers(0, 1000))
def test_reference_matches_numpy_oracle(mask, q_len, kv_len, kv_heads, group, seed):
    mask, _ = mask
    heads = kv_heads * group
    q, k, v = random_inputs(seed, batch=1, heads=heads, kv_heads=kv_heads, q_len=q_len,
                            kv_len=kv_len, dim=8, value_dim=4)
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernels.DenseReference())
    out = jax.jit(lambda q, k, v: attn(q, k, v))(q, k, v)
    vis = np_visibility(mask, batch=1, heads=heads, q_len=q_len, kv_len=kv_len)
    assert_close(out, np_attention(q, k, v, vis), 2e-5)
