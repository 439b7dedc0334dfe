"""User masks and score functions in FlexAttention's terms: `masks.Predicate` with the head
index and per-call params, `masks.from_flex`, `scores.from_flex`, and their errors. The
attention-gym catalogue itself: tests/test_flex_catalogue.py."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
from tests.conftest import assert_close, jnp_attention_f64

B, H, L, D = 2, 4, 40, 8
TILES = bsa.Tiling(block_q=16, block_kv=16)


def _inputs():
    keys = jax.random.split(jax.random.key(3), 3)
    return tuple(jax.random.normal(x, (B, H, L, D)) for x in keys)


def window_per_head(q_pos, k_pos, widths, head):
    return (k_pos <= q_pos) & (q_pos - k_pos < widths[head])


def _oracle_check(attn, vis, q, k, v, score=None):
    """Forward and the q, k, v gradients of `attn` against the float64 oracle."""
    def loss(q, k, v):
        return jnp.sum(jnp.sin(attn(q, k, v)))

    out = attn(q, k, v)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]

        def oracle(q, k, v):
            return jnp_attention_f64(q, k, v, vis, score=score)

        want = oracle(*f64)
        wants = jax.grad(lambda *a: jnp.sum(jnp.sin(oracle(*a))), argnums=(0, 1, 2))(*f64)
    assert_close(out, want, 2e-5, "out")
    for got, w, what in zip(grads, wants, ("dq", "dk", "dv")):
        assert_close(got, w, 5e-5, what)


@pytest.mark.parametrize("kernel", [
    pytest.param(kernels.XlaBlockSparse(), marks=pytest.mark.slow), kernels.DenseReference()],
    ids=["xla", "reference"])
def test_predicate_with_head_and_traced_params_matches_the_oracle(kernel):
    """A Predicate that reads the head and per-call params: traced under jit (its layout is
    built on the device), a new value does not retrace, and the result is the oracle's."""
    q, k, v = _inputs()
    widths = jnp.array([3, 7, 12, 40])
    mask = masks.Predicate(window_per_head, widths)
    assert mask.head_dependent
    traces = []

    @jax.jit
    def call(widths, q, k, v):
        traces.append(1)
        attn = bsa.BlockSparseAttention(mask=eqx.tree_at(lambda m: m.params, mask, widths),
                                        kernel=kernel, tiling=TILES)
        return attn(q, k, v)

    class Jitted:
        def __init__(self, widths):
            self.widths = widths

        def __call__(self, q, k, v):
            return call(self.widths, q, k, v)

    qi, ki = np.arange(L)[:, None], np.arange(L)[None, :]
    vis = np.stack([(ki <= qi) & (qi - ki < int(x)) for x in widths])[None]
    _oracle_check(Jitted(widths), vis, q, k, v)
    other = widths[::-1]
    vis = np.stack([(ki <= qi) & (qi - ki < int(x)) for x in other])[None]
    assert_close(Jitted(other)(q, k, v), jnp_attention_f64(q, k, v, vis), 2e-5, "new params")
    assert len(traces) == 1  # the gradient and a new value reuse the trace


def test_predicate_signature_is_checked_when_made():
    with pytest.raises(TypeError, match=r"^Predicate's `fn` must take \(q_pos, k_pos\) .*got "
                                        r"flex_mask\(b, h, q_idx, kv_idx\); a FlexAttention "
                                        r"mask_mod .* masks\.from_flex\.$"):
        masks.Predicate(flex_mask)
    with pytest.raises(TypeError, match=r"must take \(q_pos, k_pos, params\)"):
        masks.Predicate(lambda q, k: q >= k, jnp.ones(2))
    with pytest.raises(TypeError, match=r"takes `batch`, which masks do not receive"):
        masks.Predicate(lambda q, k, batch: q >= k)
    with pytest.raises(TypeError, match=r"^Predicate needs a callable; got int\.$"):
        masks.Predicate(3)
    assert not masks.Predicate(lambda q, k: q >= k).head_dependent


def test_predicate_closing_over_a_traced_array_names_params():
    """Its layout cannot be built at trace time: one line names `params`."""
    q, k, v = _inputs()

    @jax.jit
    def call(width):
        mask = masks.Predicate(lambda qp, kp: (kp <= qp) & (qp - kp < width))
        return bsa.BlockSparseAttention(mask=mask, kernel=kernels.XlaBlockSparse())(q, k, v)

    with pytest.raises(TypeError, match=r"^the mask's function closes over a traced array.*"
                                        r"pass the array as `params`"):
        call(3)


def flex_mask(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & ((q_idx - kv_idx) % (h + 2) == 0)


def flex_mask_by_batch(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (b == 0)


def flex_mask_plain(b, h, q_idx, kv_idx, doc):
    return doc[q_idx] == doc[kv_idx]


def test_masks_from_flex():
    """Reads of `h` make the mask vary by head; a read of `b` is refused in one line; params
    are the mask_mod's last argument."""
    assert masks.from_flex(flex_mask).head_dependent
    doc = jnp.asarray(np.repeat(np.arange(4), 10))
    plain = masks.from_flex(flex_mask_plain, doc)
    assert not plain.head_dependent
    with pytest.raises(TypeError, match=r"^`mask_mod` flex_mask_by_batch reads the batch index "
                                        r"`b`, which masks do not receive"):
        masks.from_flex(flex_mask_by_batch)
    with pytest.raises(TypeError, match=r"^`mask_mod` must take \(b, h, q_idx, kv_idx\); got "):
        masks.from_flex(lambda q, k: q >= k)
    q, k, v = _inputs()
    attn = bsa.BlockSparseAttention(mask=masks.from_flex(flex_mask), tiling=TILES,
                                    kernel=kernels.XlaBlockSparse())
    qi, ki = np.arange(L)[:, None], np.arange(L)[None, :]
    vis = np.stack([(qi >= ki) & ((qi - ki) % (h + 2) == 0) for h in range(H)])[None]
    np.testing.assert_allclose(
        attn(q, k, v), jnp_attention_f64(q, k, v, vis).astype(jnp.float32), rtol=1e-5,
        atol=2e-6)


def score_by_batch(score, b, h, q_idx, kv_idx):
    return score * (1.0 + b) - 0.05 * h * jnp.abs(q_idx - kv_idx)


def score_masks_only(score, b, h, q_idx, kv_idx):
    return jnp.where(q_idx >= kv_idx, score, -jnp.inf)


@pytest.mark.parametrize("kernel", [  # the batch index: test_scores.py's quick tier
    pytest.param(kernels.XlaBlockSparse(), id="xla", marks=pytest.mark.slow),
    pytest.param(kernels.DenseReference(), id="reference", marks=pytest.mark.extended)])
def test_scores_from_flex_reads_the_batch_index(kernel):
    q, k, v = _inputs()
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernel, tiling=TILES,
                                    score=scores.from_flex(score_by_batch))
    qi, ki = np.arange(L)[:, None], np.arange(L)[None, :]
    batch = np.arange(B)[:, None, None, None]
    head = np.arange(H)[None, :, None, None]
    _oracle_check(attn, np.tril(np.ones((L, L), bool)), q, k, v,
                  score=lambda s: score_by_batch(s, batch, head, qi, ki))


def test_scores_from_flex_points_a_mask_in_disguise_to_the_mask_form():
    with pytest.warns(UserWarning, match=r"only keeps the score or sets -inf: it is a mask.*"
                                         r"masks\.from_flex"):
        scores.from_flex(score_masks_only)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores.from_flex(score_by_batch)
    with pytest.raises(TypeError, match=r"^`score_mod` must take \(score, b, h, q_idx, kv_idx, "
                                        r"params\); got "):
        scores.from_flex(score_by_batch, jnp.ones(3))


def test_scores_from_flex_inside_a_jit_trace():
    """Made inside `jax.jit` (a layer built in the traced function), `from_flex` reads the
    score_mod on concrete values as outside, warns of a mask in disguise alike, and a
    score_mod closing over a traced array runs."""
    q, k, v = _inputs()
    scale = jnp.float32(0.5)

    def call(q, k, v, scale):
        with_scale = lambda s, b, h, qi, ki: score_by_batch(s, b, h, qi, ki) * scale  # noqa: E731
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.XlaBlockSparse(),
                                        tiling=TILES, score=scores.from_flex(with_scale))
        return attn(q, k, v)

    got = jax.jit(call)(q, k, v, scale)
    np.testing.assert_allclose(got, call(q, k, v, scale), rtol=1e-5, atol=1e-6)
    with pytest.warns(UserWarning, match=r"only keeps the score or sets -inf: it is a mask"):
        jax.jit(lambda q: scores.from_flex(score_masks_only) and q)(q)
