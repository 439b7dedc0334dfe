"""Small calls on a CPU run dense attention (`_selector.small_call`): the selector says so in
`explain()`, larger, sharded and explicitly routed calls keep the block-sparse kernel, and the
dense path gives the documented answer (forward, log-sum-exp and gradients against the float64
oracle, rows that see no key zeros). Speed is measured by benchmarks/cpu_small_model.py, not
asserted here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
from eqx_bsattn._selector import SMALL_CALL_ELEMENTS, SMALL_CALL_PAIRS
from tests.conftest import jnp_attention_f64, np_visibility, random_array, random_inputs, rel_err


def _choice(**features):
    return bsa.select_kernel(masks.Causal(), "cpu", bsa.Features(platform="cpu", **features))


def test_a_small_cpu_call_runs_dense_and_explain_says_why():
    q, k, v = random_inputs(0, batch=2, heads=4, kv_heads=2, q_len=40, kv_len=56, dim=8)
    plan = bsa.BlockSparseAttention(mask=masks.Causal() & masks.SlidingWindow(8, 0)).plan(q, k, v)
    assert plan.kernel.name == "reference"
    text = plan.explain()
    assert "kernel reference: a small call on the cpu (40 x 56 query-key pairs a head" in text
    assert "xla (priority 10) runs the larger calls" in text
    assert "declined xla: accepts this call, but leaves a small call on the cpu" in text
    assert "reads no block layout" in text


def test_the_bound_of_a_small_call():
    side = int(SMALL_CALL_PAIRS ** 0.5)
    assert _choice(q_len=side, kv_len=side).kernel.name == "reference"
    assert _choice(q_len=side, kv_len=side + 1).kernel.name == "xla"
    assert _choice(q_len=1, kv_len=SMALL_CALL_PAIRS).kernel.name == "reference"
    # All heads together: a batch whose scores would pass the bound keeps the block layout.
    heads = SMALL_CALL_ELEMENTS // SMALL_CALL_PAIRS
    assert _choice(q_len=side, kv_len=side, num_heads=heads).kernel.name == "reference"
    assert _choice(q_len=side, kv_len=side, num_heads=heads, batch=2).kernel.name == "xla"


def test_sharded_and_explicit_calls_keep_the_block_sparse_kernel():
    assert _choice(q_len=64, kv_len=64, sharded=True).kernel.name == "xla"
    assert _choice(q_len=64, kv_len=64, in_loop=True, lse=True).kernel.name == "xla"
    given = bsa.select_kernel(masks.Causal(), "cpu", bsa.Features(q_len=64, kv_len=64),
                              candidates=[kernels.XlaBlockSparse(), kernels.DenseReference()])
    assert given.kernel.name == "xla"
    # A kernel named by the module runs, whatever the size.
    q, k, v = random_inputs(1, batch=1, heads=2, q_len=16, dim=8)
    plan = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.XlaBlockSparse()).plan(
        q, k, v)
    assert plan.kernel.name == "xla" and plan.choice is None


@pytest.mark.slow  # about 9 s: the float64 oracle's gradients compile
def test_the_dense_path_matches_the_float64_oracle():
    """Through the selector's pick (dense), with padding, a window, a bias and sinks: the
    output, the log-sum-exp and the gradients of q, k, v, bias and sinks; the padded queries'
    rows see no key and are zeros."""
    batch, heads, kv_heads, length, dim = 2, 4, 2, 24, 8
    q, k, v = random_inputs(2, batch=batch, heads=heads, kv_heads=kv_heads, q_len=length,
                            dim=dim)
    bias = random_array(3, (batch, 1, length, length))
    sinks = random_array(4, (heads,))
    seg = np.zeros((batch, length), np.int32)
    seg[0, -5:] = -1  # padding: these queries see nothing
    seg[1, 10:] = 1
    mask = masks.Causal() & masks.SlidingWindow(6, 0)
    attn = bsa.BlockSparseAttention(mask=mask)
    ids = dict(q_segment_ids=seg, kv_segment_ids=seg)
    assert attn.plan(q, k, v, bias=bias, sinks=sinks, **ids).kernel.name == "reference"

    def ours(q, k, v, bias, sinks):
        out, lse = attn(q, k, v, bias=bias, sinks=sinks, return_lse=True, **ids)
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse), \
            (out, lse)

    w_out = random_array(5, (batch, heads, length, dim))
    w_lse = random_array(6, (batch, heads, length))
    (_, (out, lse)), grads = jax.value_and_grad(ours, argnums=range(5), has_aux=True)(
        q, k, v, bias, sinks)

    visible = np_visibility(mask & masks.Document(), batch=batch, heads=heads, q_len=length,
                            kv_len=length, q_seg=seg, kv_seg=seg)
    with jax.enable_x64(True):
        def oracle(q, k, v, bias, sinks):
            out = jnp_attention_f64(q, k, v, visible, bias=bias, sinks=sinks)
            group = heads // kv_heads
            kk = jnp.repeat(k, group, axis=1)
            s = jnp.einsum("bhid,bhjd->bhij", q, kk) / np.sqrt(dim) + bias
            s = jnp.where(visible, s, -jnp.inf)
            lse = jax.nn.logsumexp(jnp.concatenate(
                [s, jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))], -1), -1)
            lse = jnp.where(visible.any(-1), lse, -jnp.inf)
            return jnp.sum(out * w_out.astype(jnp.float64)) + jnp.sum(
                jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse.astype(jnp.float64)), (out, lse)

        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, bias, sinks)]
        (_, (want, want_lse)), want_grads = jax.value_and_grad(
            oracle, argnums=range(5), has_aux=True)(*args)
        want, want_lse = np.asarray(want), np.asarray(want_lse)
        want_grads = [np.asarray(g) for g in want_grads]
    assert rel_err(out, want) < 2e-5
    hidden = ~visible.any(-1)
    assert hidden[0, :, -5:].all() and np.all(np.asarray(out)[hidden] == 0)
    assert np.all(np.asarray(lse)[hidden] == -np.inf)
    assert rel_err(np.where(hidden, 0, lse), np.where(hidden, 0, want_lse)) < 2e-5
    for name, got, expected in zip("q k v bias sinks".split(), grads, want_grads):
        assert rel_err(got, expected) < 1e-4, name


@pytest.mark.parametrize("length", [pytest.param(32, marks=pytest.mark.slow), 300])
def test_the_layer_matches_eqx_nn_on_either_side_of_the_bound(length):
    """The layer against `eqx.nn.MultiheadAttention` with the same weights and mask array, on
    the dense path (32 tokens) and the block-sparse one (300 x 300 > 256 x 256 pairs)."""
    import equinox as eqx

    layer = bsa.MultiheadBlockSparseAttention(2, 16, mask=masks.Causal(), key=jax.random.key(0))
    theirs = eqx.nn.MultiheadAttention(2, 16, key=jax.random.key(0))
    x = random_array(7, (length, 16))
    heads = jnp.zeros((2, length, 8))
    assert layer.attention.plan(heads, heads, heads).kernel.name == (
        "reference" if length * length <= SMALL_CALL_PAIRS else "xla")
    causal = jnp.tril(jnp.ones((length, length), bool))
    assert rel_err(layer(x, x, x), theirs(x, x, x, mask=causal)) < 2e-5


@pytest.mark.slow  # about 7 s: four jitted gradients
def test_layouts_of_a_static_mask_are_built_once_across_layers_and_swaps(monkeypatch):
    """A model whose layers share a mask builds its layouts once per trace, and a mask swapped
    away and back is not built again (`_module.compile_mask`); the cached plan computes what a
    fresh one does."""
    import equinox as eqx

    from eqx_bsattn import _compile, _module

    built = []
    build = _compile.layout_of_resolved
    monkeypatch.setattr(_compile, "layout_of_resolved",
                        lambda mask, **kw: built.append(mask) or build(mask, **kw))
    monkeypatch.setattr(_module, "_COMPILED", type(_module._COMPILED)())
    tiling = kernels.XlaConfig(block_q=8, block_kv=8)  # one tile size: one layout a mask

    def model(mask):
        return tuple(bsa.BlockSparseAttention(mask=mask, kernel=kernels.XlaBlockSparse(),
                                              tiling=tiling) for _ in range(2))

    def loss(layers, q):
        for layer in layers:
            q = layer(q, q, q)
        return jnp.sum(q ** 2)

    q = random_array(8, (2, 32, 8))
    narrow, wide = masks.Causal() & masks.SlidingWindow(4, 0), masks.Causal()
    layers = model(narrow)
    grads = []
    for mask in (narrow, wide, narrow):
        layers = eqx.tree_at(lambda m: tuple(a.mask for a in m), layers, (mask, mask))
        grads.append(eqx.filter_jit(jax.grad(loss, argnums=1))(layers, q))
    assert built == [narrow, wide]
    np.testing.assert_array_equal(grads[0], grads[2])
    monkeypatch.setattr(_module, "_COMPILED", type(_module._COMPILED)())
    fresh = eqx.filter_jit(jax.grad(loss, argnums=1))(model(narrow), q)
    assert built == [narrow, wide, narrow]
    np.testing.assert_array_equal(grads[0], fresh)
