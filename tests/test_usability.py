"""What a new user trips on: a layout passed by mistake, errors that must stay one line,
jax.nn's argument names, the layer and the module reading the same arguments the same way, and
the log-sum-exp returned beside the output."""

import inspect
import warnings
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
from eqx_bsattn.contract import MaskReads
from eqx_bsattn.strategies.kernels.reference import reference_attention
from tests.conftest import assert_close, np_attention, random_array

B, H, HKV, L, D = 2, 4, 2, 16, 8
Q = random_array(0, (B, H, L, D))
K = random_array(1, (B, HKV, L, D))
V = random_array(2, (B, HKV, L, D))
#: jax.nn's [B, L, H, D] arrays: 64 tokens of 4 heads.
X = random_array(3, (2, 64, 4, 16))


def _one_line(info, *needles):
    text = str(info.value)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text


# --- a layout passed by mistake ------------------------------------------------------------

def _warned_once(record, *needles):
    texts = [str(w.message) for w in record if issubclass(w.category, UserWarning)]
    assert len(texts) == 1, texts
    assert "\n" not in texts[0], texts[0]
    for needle in needles:
        assert needle in texts[0], texts[0]


def test_jax_nn_layout_on_the_default_module_warns():
    with pytest.warns(UserWarning) as record:
        read_as_bhsd = bsa.BlockSparseAttention(kernel=kernels.DenseReference())(X, X, X)
    _warned_once(record, "qkv_layout='bshd'", "(2, 64, 4, 16)", "64 > 4")
    assert_close(read_as_bhsd, np_attention(X, X, X, True), 2e-5)  # 64 heads of 4 tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = jax.nn.dot_product_attention(X, X, X)
        assert_close(bsa.BlockSparseAttention(qkv_layout="bshd")(X, X, X), want, 2e-5)
        explicit = bsa.BlockSparseAttention(qkv_layout="bhsd", kernel=kernels.DenseReference())
        assert_close(explicit(X, X, X), read_as_bhsd, 1e-6)


def test_layout_that_fits_only_bshd_is_refused():
    # jax.nn's cross attention with grouped kv heads: 64 queries, 48 keys, 4 and 2 heads.
    k, v = random_array(4, (2, 48, 2, 16)), random_array(5, (2, 48, 2, 16))
    with pytest.raises(ValueError) as info:
        bsa.BlockSparseAttention()(X, k, v)
    _one_line(info, "query heads (64) must be a multiple of key/value heads (48)",
              "; these shapes fit qkv_layout='bshd': pass it if they are [batch, seq, heads, dim].")
    with pytest.raises(ValueError) as info:
        bsa.blocksparse_attention(X, k, v, causal=False)
    _one_line(info, "these shapes fit qkv_layouts='bshd'")
    want = jax.nn.dot_product_attention(X, k, v)
    assert_close(bsa.BlockSparseAttention(qkv_layout="bshd")(X, k, v), want, 2e-5)
    with pytest.raises(ValueError) as info:  # and the other way round
        bsa.BlockSparseAttention(qkv_layout="bshd")(*(jnp.swapaxes(x, 1, 2) for x in (X, k, v)))
    _one_line(info, "these shapes fit qkv_layout='bhsd': pass it if they are [batch, heads, seq, "
              "dim].")


def test_num_heads_names_the_layout_that_fits():
    with pytest.raises(ValueError) as info:
        bsa.BlockSparseAttention(num_heads=4)(X, X, X)
    _one_line(info, "64 heads", "num_heads=4", "looks like bshd; pass qkv_layout='bshd'")
    with pytest.raises(ValueError) as info:
        bsa.BlockSparseAttention(num_heads=64, qkv_layout="bshd")(X, X, X)
    _one_line(info, "looks like bhsd; pass qkv_layout='bhsd'")
    with pytest.raises(ValueError, match="has 4 heads in qkv_layout='bhsd', not num_heads=8"):
        bsa.BlockSparseAttention(num_heads=8).plan(Q, K, V)
    assert_close(bsa.BlockSparseAttention(num_heads=4, qkv_layout="bshd")(X, X, X),
                 jax.nn.dot_product_attention(X, X, X), 2e-5)
    with pytest.raises(ValueError, match=r"^`num_heads` must be a positive int or None"):
        bsa.BlockSparseAttention(num_heads=0)


@pytest.mark.slow  # the module's warning is in the quick tier
def test_jax_nn_layout_in_the_function_warns():
    with pytest.warns(UserWarning) as record:
        bsa.blocksparse_attention(X, X, X, causal=False)
    _warned_once(record, "qkv_layouts='bshd'")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = bsa.blocksparse_attention(X, X, X, causal=False, qkv_layouts="bshd")
    assert_close(out, jax.nn.dot_product_attention(X, X, X), 2e-5)


@pytest.mark.parametrize("q_shape, kv_shape", [
    ((2, 8, 1, 16), (2, 8, 32, 16)),    # decoding: one query, more heads than queries
    ((2, 8, 1, 16), (2, 2, 32, 16)),    # decoding with grouped kv heads
    ((1, 8, 4, 16), (1, 2, 6, 16)),     # more heads than tokens, read as bshd 4 % 6 heads
    ((2, 4, 16, 8), (2, 2, 16, 8)),     # fewer heads than tokens
], ids=["decode", "decode gqa", "short gqa", "usual"])
def test_heads_first_inputs_that_cannot_be_bshd_run_by_default(q_shape, kv_shape):
    q, k, v = random_array(4, q_shape), random_array(5, kv_shape), random_array(6, kv_shape)
    want = np_attention(q, k, v, True)
    attn = bsa.BlockSparseAttention(kernel=kernels.DenseReference())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(attn(q, k, v), want, 2e-5)
        out = bsa.blocksparse_attention(q, k, v, causal=False, platform="reference")
    assert_close(out, want, 2e-5)


def test_the_layer_checks_its_heads():
    layer = bsa.MultiheadBlockSparseAttention(4, 16, key=jax.random.key(0))
    assert layer.attention.num_heads == 4 and layer.attention.qkv_layout == "bhsd"
    x = random_array(7, (3, 16))  # three tokens, fewer than the four heads: no false alarm
    assert layer(x, x, x).shape == (3, 16)


# --- errors that stay one line ------------------------------------------------------------

def test_array_as_mask_builder_is_one_line():
    with pytest.raises(TypeError) as info:
        bsa.blocksparse_attention(Q, K, V, mask_builder=jnp.ones((L, L), bool))
    _one_line(info, "`mask_builder`", "attention_mask", "masks.ArrayMask")


def test_float_kv_seq_lengths_on_the_layer_is_one_line():
    layer = bsa.MultiheadBlockSparseAttention(4, 16, key=jax.random.key(0))
    x = random_array(8, (24, 16))
    with pytest.raises(TypeError) as info:
        layer(x, x, x, kv_seq_lengths=30.0)
    _one_line(info, "`kv_seq_lengths`", "30.0")


def test_array_as_module_mask_names_array_mask():
    with pytest.raises(TypeError) as info:
        bsa.BlockSparseAttention(mask=jnp.ones((L, L), bool))
    _one_line(info, "`mask`", "masks.ArrayMask(array)")


def test_mask_strategy_in_the_layer_call_points_to_the_constructor():
    layer = bsa.MultiheadBlockSparseAttention(4, 16, key=jax.random.key(0))
    x = random_array(8, (24, 16))
    with pytest.raises(TypeError) as info:
        layer(x, x, x, mask=masks.Causal())
    _one_line(info, "`mask`", "constructor", "MultiheadBlockSparseAttention(..., mask=Causal(")


@pytest.mark.skipif(not bsa.TYPECHECK_ENABLED, reason="the type checks are switched off")
def test_other_type_errors_are_one_line_naming_the_argument():
    attn = bsa.BlockSparseAttention()
    with pytest.raises(TypeError) as info:
        attn(Q, K, V, purify="yes")
    _one_line(info, "`purify` must be bool; got str 'yes'.")
    with pytest.raises(TypeError) as info:
        bsa.blocksparse_attention(Q, K, V, chunk_size="8")
    _one_line(info, "`chunk_size` must be int or None")
    layer = bsa.MultiheadBlockSparseAttention(4, 16, key=jax.random.key(0))
    x = random_array(8, (24, 16))
    with pytest.raises(TypeError) as info:
        layer(x, x, x, inference="no")
    _one_line(info, "`inference` must be bool or None")


# --- jax.nn's names -----------------------------------------------------------------------

@pytest.mark.slow  # each name alone is in the quick tier: tests/test_jaxnn_parity.py
def test_function_takes_jax_nn_names():
    lengths = jnp.array([5, 64])
    want = jax.nn.dot_product_attention(X, X, X, is_causal=True, scale=0.3,
                                        key_value_seq_lengths=lengths)
    out = bsa.blocksparse_attention(X, X, X, is_causal=True, scale=0.3,
                                    key_value_seq_lengths=lengths, qkv_layouts="bshd")
    assert_close(out, want, 2e-5)
    ours = bsa.blocksparse_attention(X, X, X, causal=True, softmax_scale=0.3,
                                     kv_seq_lengths=lengths, qkv_layouts="bshd")
    assert_close(ours, want, 2e-5)
    no_mask = bsa.blocksparse_attention(X, X, X, is_causal=False, qkv_layouts="bshd")
    assert_close(no_mask, jax.nn.dot_product_attention(X, X, X), 2e-5)


@pytest.mark.parametrize("ours, theirs", [
    (dict(softmax_scale=0.3), dict(scale=0.3)),
    (dict(causal=True), dict(is_causal=True)),
    (dict(kv_seq_lengths=3), dict(key_value_seq_lengths=3)),
])
def test_both_names_in_the_function_is_one_line(ours, theirs):
    with pytest.raises(TypeError) as info:
        bsa.blocksparse_attention(Q, K, V, **ours, **theirs)
    _one_line(info, f"`{next(iter(ours))}` and `{next(iter(theirs))}`")


@pytest.mark.slow
def test_module_and_layer_take_key_value_seq_lengths():
    lengths = jnp.array([5, 16])
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.DenseReference())
    ours = attn(Q, K, V, kv_seq_lengths=lengths)
    assert_close(attn(Q, K, V, key_value_seq_lengths=lengths), ours, 1e-6)
    keys = np.arange(L)[None, :] < np.asarray(lengths)[:, None]
    visible = np.tril(np.ones((L, L), bool))[None, None] & keys[:, None, None, :]
    assert_close(ours, np_attention(Q, K, V, visible), 2e-5)
    with pytest.raises(TypeError) as info:
        attn(Q, K, V, kv_seq_lengths=lengths, key_value_seq_lengths=lengths)
    _one_line(info, "`kv_seq_lengths` and `key_value_seq_lengths`")
    layer = bsa.MultiheadBlockSparseAttention(4, 16, key=jax.random.key(0))
    x = random_array(8, (24, 16))
    assert_close(layer(x, x, x, key_value_seq_lengths=7), layer(x, x, x, kv_seq_lengths=7), 1e-6)


# --- the layer and the module agree -------------------------------------------------------

@pytest.mark.slow
def test_learned_alibi_in_the_layer_takes_the_standard_slopes():
    layer = bsa.MultiheadBlockSparseAttention(4, 16, score=scores.ALiBi(learned=True),
                                              mask=masks.Causal(), key=jax.random.key(0))
    score = layer.attention.score
    assert score.learned
    np.testing.assert_array_equal(np.asarray(score.slopes), scores.alibi_slopes(4))
    x = random_array(9, (12, 16))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x, x, x) ** 2))(layer)
    assert float(jnp.abs(grads.attention.score.slopes).sum()) > 0
    fixed = eqx.tree_at(lambda m: m.attention.score, layer, scores.ALiBi())
    assert_close(layer(x, x, x), fixed(x, x, x), 1e-6)  # the standard slopes, now learned


@pytest.mark.slow
def test_layer_has_the_module_defaults_and_a_sharding():
    layer_params = inspect.signature(bsa.MultiheadBlockSparseAttention).parameters
    module_params = inspect.signature(bsa.BlockSparseAttention).parameters
    for name in ("mask", "kernel", "tiling", "sharding"):
        assert layer_params[name].default == module_params[name].default, name
    mesh = jax.make_mesh((1,), ("model",))
    sharding = bsa.sharding.ShardMap(mesh, head_axis="model")
    layer = bsa.MultiheadBlockSparseAttention(4, 16, sharding=sharding, key=jax.random.key(0))
    assert layer.attention.sharding == sharding
    plain = eqx.tree_at(lambda m: m.attention.sharding, layer, bsa.Unsharded())
    x = random_array(10, (12, 16))
    assert_close(layer(x, x, x), plain(x, x, x), 1e-5)


def test_layer_takes_int_and_single_head_masks():
    layer = bsa.MultiheadBlockSparseAttention(4, 16, key=jax.random.key(0))
    x = random_array(11, (12, 16))
    keep = np.tril(np.ones((12, 12), bool)) | (np.arange(12)[None, :] % 3 == 0)
    want = layer(x, x, x, jnp.asarray(keep))
    assert_close(layer(x, x, x, jnp.asarray(keep, jnp.int32)), want, 1e-6)
    assert_close(layer(x, x, x, jnp.asarray(keep[None])), want, 1e-6)
    assert_close(layer(x, x, x, np.asarray(keep[None], np.uint8) * 7), want, 1e-6)
    causal = eqx.tree_at(lambda m: m.attention.mask, layer, masks.Causal())
    assert_close(layer(x, x, x, jnp.asarray(np.tril(np.ones((1, 12, 12), int)))), causal(x, x, x),
                 1e-5)


def test_layer_reads_kv_head_sinks_like_the_function():
    layer = bsa.MultiheadBlockSparseAttention(4, 16, num_kv_heads=2, key=jax.random.key(0))
    x = random_array(12, (12, 16))
    sinks = random_array(13, (2,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = layer(x, x, x, sinks=sinks)
    assert_close(out, layer(x, x, x, sinks=jnp.repeat(sinks, 2)), 1e-6)


# --- the log-sum-exp beside the output ----------------------------------------------------

def _dense_lse(q, k, visible, *, sinks=None, scale=None):
    """Float32 log-sum-exp ``[B, H, Lq]`` of the visible logits (and the sinks ``[H, S]``),
    ``-inf`` where a row sees no key; differentiable by autodiff."""
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("bhqd,bhkd->bhqk", q, jnp.repeat(k, group, axis=1),
                   precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(visible, s, -jnp.inf)
    if sinks is not None:
        extra = jnp.broadcast_to(sinks[None, :, None, :], (*s.shape[:3], sinks.shape[-1]))
        s = jnp.concatenate([s, extra], axis=-1)
    lse = jax.nn.logsumexp(jnp.where(jnp.isneginf(s), -1e30, s), axis=-1)
    return jnp.where(jnp.any(jnp.broadcast_to(visible, s.shape[:3] + (L,)), axis=-1), lse,
                     -jnp.inf)


@pytest.mark.parametrize("kernel, with_sinks", [
    (kernels.DenseReference(), False),
    pytest.param(kernels.XlaBlockSparse(), True, marks=pytest.mark.slow),
    pytest.param(kernels.DenseReference(), True, marks=pytest.mark.extended),
    pytest.param(kernels.XlaBlockSparse(), False, marks=pytest.mark.extended),
], ids=["reference", "xla-sinks", "reference-sinks", "xla"])
def test_return_lse_forward_and_gradient_against_dense(kernel, with_sinks):
    # Query 3 of example 0 is padding (segment -1): it sees no key, its lse is -inf.
    ids = np.zeros((B, L), np.int32)
    ids[0, 3] = -1
    ids = jnp.asarray(ids)
    sinks = random_array(14, (H, 2)) if with_sinks else None
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernel,
                                    tiling=bsa.Tiling(block_q=8, block_kv=8))
    causal = np.tril(np.ones((L, L), bool))
    same = (np.asarray(ids)[:, :, None] == np.asarray(ids)[:, None, :]) & \
        (np.asarray(ids)[:, :, None] >= 0)
    visible = jnp.asarray(causal[None, None] & same[:, None])
    w = random_array(15, (B, H, L))

    def ours(q, k, v):
        out, lse = attn(q, k, v, sinks=sinks, q_segment_ids=ids, kv_segment_ids=ids,
                        return_lse=True)
        return out, lse

    out, lse = ours(Q, K, V)
    assert lse.shape == (B, H, L) and lse.dtype == jnp.float32
    assert_close(out, attn(Q, K, V, sinks=sinks, q_segment_ids=ids, kv_segment_ids=ids), 1e-6)
    want = _dense_lse(Q, K, visible, sinks=sinks)
    assert bool(jnp.isneginf(lse[0, :, 3]).all()) and bool(jnp.isfinite(lse[1]).all())
    finite = jnp.isfinite(want)
    np.testing.assert_array_equal(np.asarray(jnp.isfinite(lse)), np.asarray(finite))
    assert_close(jnp.where(finite, lse, 0.0), jnp.where(finite, want, 0.0), 2e-5)

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(w * jnp.where(jnp.isfinite(lse), lse, 0.0)) + jnp.sum(out ** 2)
        return f

    def dense(q, k, v):
        out = reference_attention_dense(q, k, v, visible, sinks)
        return out, _dense_lse(q, k, visible, sinks=sinks)

    got = jax.grad(loss(ours), argnums=(0, 1, 2))(Q, K, V)
    expected = jax.grad(loss(dense), argnums=(0, 1, 2))(Q, K, V)
    for g, e, name in zip(got, expected, "qkv"):
        assert bool(jnp.isfinite(g).all()), name
        assert_close(g, e, 1e-4, name)


def reference_attention_dense(q, k, v, visible, sinks):
    """The output of dense attention by autodiff-able JAX (rows that see no key: zeros)."""
    group = q.shape[1] // k.shape[1]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, jnp.repeat(k, group, axis=1),
                   precision=jax.lax.Precision.HIGHEST) / np.sqrt(q.shape[-1])
    lse = _dense_lse(q, k, visible, sinks=sinks)
    shift = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]
    p = jnp.exp(jnp.where(visible, s, -jnp.inf) - shift)
    return jnp.einsum("bhqk,bhkd->bhqd", p, jnp.repeat(v, group, axis=1),
                      precision=jax.lax.Precision.HIGHEST)


def test_return_lse_in_the_function_and_the_layouts():
    out, lse = bsa.blocksparse_attention(X, X, X, qkv_layouts="bshd", return_lse=True)
    assert out.shape == X.shape and lse.shape == (2, 4, 64)
    xt = jnp.swapaxes(X, 1, 2)
    causal = jnp.asarray(np.tril(np.ones((64, 64), bool)))
    assert_close(lse, jax.nn.logsumexp(
        jnp.where(causal, jnp.einsum("bhqd,bhkd->bhqk", xt, xt) / 4.0, -jnp.inf), -1), 2e-5)
    module = bsa.BlockSparseAttention(mask=masks.Causal(), qkv_layout="bshd")
    m_out, m_lse = module(X, X, X, return_lse=True)
    assert_close(m_out, out, 1e-6)
    assert_close(m_lse, lse, 1e-6)
    one_out, one_lse = module(X[0], X[0], X[0], return_lse=True)  # unbatched: [H, Lq]
    assert one_lse.shape == (4, 64)
    assert_close(one_lse, lse[0], 1e-6)


def test_return_lse_in_the_layer():
    layer = bsa.MultiheadBlockSparseAttention(4, 16, mask=masks.Causal(), key=jax.random.key(0))
    x = random_array(16, (12, 16))
    out, lse = layer(x, x, x, return_lse=True)
    assert_close(out, layer(x, x, x), 1e-6)
    q = layer._heads(layer.query_proj, x, 4)
    k = layer._heads(layer.key_proj, x, 4)
    causal = jnp.asarray(np.tril(np.ones((12, 12), bool)))
    want = jax.nn.logsumexp(jnp.where(causal, jnp.einsum("hqd,hkd->hqk", q, k) / 2.0, -jnp.inf),
                            -1)
    assert lse.shape == (4, 12)
    assert_close(lse, want, 2e-5)


class _NoLse(bsa.AbstractKernel):
    """A test kernel that returns no log-sum-exp (dense, never selected)."""

    name: ClassVar[str] = "test-no-lse"
    platforms: ClassVar[tuple[str, ...]] = ("cpu", "gpu", "tpu")
    reads: ClassVar[MaskReads] = "dense"

    @classmethod
    def priority(cls, platform):
        return None

    def decline_reason(self, mask, features):
        return None

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        return reference_attention(query, key, value, mask=mask, inputs=inputs,
                                   softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap)


def test_return_lse_refuses_a_kernel_without_it_and_a_sharding():
    attn = bsa.BlockSparseAttention(kernel=_NoLse())
    assert attn(Q, K, V).shape == (B, H, L, D)
    with pytest.raises(ValueError) as info:
        attn(Q, K, V, return_lse=True)
    _one_line(info, "`return_lse=True`", "test-no-lse")
    mesh = jax.make_mesh((1,), ("model",))
    sharded = bsa.BlockSparseAttention(sharding=bsa.sharding.ShardMap(mesh, head_axis="model"))
    with pytest.raises(ValueError) as info:
        sharded(Q, K, V, return_lse=True)
    _one_line(info, "`return_lse=True` runs unsharded only", "ShardMap")
