"""`AbstractLseKernel.attention_with_lse`: every kernel that is an `AbstractLseKernel` against a
float64 oracle, the output, the log-sum-exp and the gradients through both."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import assert_close, bsa, masks, np_visibility, random_array, random_inputs

B, H, HKV, L, D = 2, 4, 2, 40, 8
TILES = bsa.Tiling(block_q=16, block_kv=16)


#: Kernels that decline this file's case (float32, D = 8, a bias), with where their
#: log-sum-exp is tested instead.
_OWN_TESTS = {"mosaic": "16-bit, D in {64, 128}, no bias: tests/kernels/mosaic/test_mosaic_gpu.py",
              "pallas_tpu": "no bias: tests/kernels/pallas_tpu/test_pallas_tpu.py"}


def _lse_kernels():
    platform = bsa.default_platform()
    return [cls for cls in bsa.registered_kernels()
            if issubclass(cls, bsa.AbstractLseKernel) and platform in cls.platforms
            and cls.name not in _OWN_TESTS]


def _call(kernel, mask, q, k, v, bias, sinks):
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, tiling=TILES)
    plan = attn.plan(q, k, v, bias=bias, sinks=sinks)
    return plan.kernel.attention_with_lse(
        q, k, v, mask=plan.mask, inputs=plan.inputs, features=plan.features, tiling=plan.tiling,
        softmax_scale=plan.softmax_scale, logits_soft_cap=None)


def _oracle(q, k, v, bias, sinks, visible):
    """float64 output and log-sum-exp (rows that see no key: zeros and -inf)."""
    group = H // HKV
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(D) + bias
    s = jnp.where(visible, s, -jnp.inf)
    seen = visible.any(-1)
    logits = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))],
                             axis=-1)
    lse = jax.nn.logsumexp(jnp.where(seen[..., None], logits, 0.0), axis=-1)
    p = jnp.exp(s - lse[..., None])
    out = jnp.where(seen[..., None], jnp.einsum("bhqk,bhkd->bhqd", p, v), 0.0)
    return out, jnp.where(seen, lse, -jnp.inf)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", _lse_kernels(), ids=lambda cls: cls.name)
@pytest.mark.parametrize("mask", [masks.Causal() & masks.SlidingWindow(12, 0),
                                  masks.Causal(offset=-9)], ids=["window", "empty_rows"])
def test_attention_with_lse_against_float64(kernel, mask):
    q, k, v = random_inputs(11, batch=B, heads=H, kv_heads=HKV, q_len=L, dim=D)
    bias = random_array(12, (B, 1, L, L))
    sinks = random_array(13, (H,))
    visible = np_visibility(mask, batch=B, heads=1, q_len=L, kv_len=L)
    seen = visible.any(-1)
    w_out, w_lse = random_array(14, (B, H, L, D)), random_array(15, (B, H, L))

    def loss(fn, *args):
        out, lse = fn(*args)
        # Rows that see nothing have lse = -inf: weigh only the others.
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(seen, lse, 0.0) * w_lse)

    run = lambda *a: _call(kernel(), mask, *a)  # noqa: E731
    out, lse = jax.jit(run)(q, k, v, bias, sinks)
    grads = jax.jit(jax.grad(lambda *a: loss(run, *a), argnums=range(5)))(q, k, v, bias, sinks)
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, bias, sinks)]
        oracle = lambda *a: _oracle(*a, jnp.asarray(visible))  # noqa: E731
        # Jitted: eager calls compile every operation separately (seconds).
        want_out, want_lse = jax.jit(oracle)(*f64)
        want_grads = jax.jit(jax.grad(lambda *a: loss(oracle, *a), argnums=range(5)))(*f64)
    assert lse.dtype == jnp.float32
    assert np.all(np.isneginf(np.asarray(lse)[~np.broadcast_to(seen, lse.shape)]))
    rows = np.broadcast_to(seen, lse.shape)
    assert_close(np.asarray(lse)[rows], np.asarray(want_lse)[rows], what="lse")
    assert_close(out, want_out, what="output")
    for name, g, w in zip("q k v bias sinks".split(), grads, want_grads):
        assert_close(g, w, what=f"d{name}")


def test_the_contract_log_sum_exp_convention():
    """`public_lse` turns a kernel's internal log-sum-exp (base 2 or natural, +inf on empty
    rows) into the contract's (natural, -inf there); `backward_delta` drops the log-sum-exp's
    cotangent on rows that see no key, in either convention."""
    from eqx_bsattn.contract import LN2, backward_delta, public_lse

    internal = jnp.array([[[3.0, jnp.inf, -1.5]]])
    np.testing.assert_allclose(public_lse(internal, base2=True),
                               [[[3.0 * LN2, -jnp.inf, -1.5 * LN2]]])
    np.testing.assert_allclose(public_lse(internal, base2=False), [[[3.0, -jnp.inf, -1.5]]])
    d_out = jnp.arange(6.0).reshape(1, 1, 3, 2) - 2.0
    out = jnp.ones((1, 1, 3, 2)) * 0.5
    d_lse = jnp.array([[[0.25, 7.0, -1.0]]])
    rows = jnp.array([[[-1.5, 0.5, 2.5]]])  # rowsum(dO * O): 0.5 * (-2 - 1, 0 + 1, 2 + 3)
    want = rows - jnp.array([[[0.25, 0.0, -1.0]]])
    for lse in (internal, public_lse(internal, base2=True)):
        np.testing.assert_allclose(backward_delta(d_out, out, d_lse, lse), want)
    np.testing.assert_allclose(backward_delta(d_out, out), rows)


def test_add_sinks_with_minus_inf_sinks():
    """`add_sinks` (the ring's, Triton's and Mosaic's way to join sinks): a head whose sinks
    are all -inf keeps its result, rows that see no key keep zeros, and every gradient is
    finite (zero for a -inf sink)."""
    from eqx_bsattn.contract import add_sinks

    lse = jnp.asarray([[[0.3, -jnp.inf, 1.0, 2.0]] * 3])
    out = random_array(1, (1, 3, 4, 2)).at[:, :, 1].set(0.0)  # row 1 sees no key
    sinks = jnp.asarray([[-jnp.inf, -jnp.inf], [0.5, -jnp.inf], [0.1, 0.2]])
    got, got_lse = add_sinks(out, lse, sinks)
    np.testing.assert_array_equal(got[:, 0], out[:, 0])
    np.testing.assert_array_equal(got_lse[:, 0], lse[:, 0])
    np.testing.assert_allclose(got[:, 1], out[:, 1] * jnp.exp(lse[:, 1] - jnp.logaddexp(
        lse[:, 1], 0.5))[..., None])
    assert (got[:, :, 1] == 0).all() and (got_lse[:, :, 1] == -jnp.inf).all()
    grads = jax.grad(lambda o, l, s: add_sinks(o, l, s)[0].sum(), argnums=(0, 1, 2))(
        out, lse, sinks)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    assert (grads[2][0] == 0).all() and grads[2][1, 1] == 0 and grads[2][1, 0] != 0
