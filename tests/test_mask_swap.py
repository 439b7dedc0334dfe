"""Swapping a mask in the middle of training: a mask that holds no arrays is one leaf of the
model (like a kernel), so `eqx.tree_at` alone keeps the optimizer state valid; a mask that holds
arrays stays a pytree node (its arrays are traced), and `swap_strategy` carries the state over."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks


class _Model(eqx.Module):
    """A projection in front of the module: parameters for the optimizer."""

    proj: eqx.nn.Linear
    attention: bsa.BlockSparseAttention

    def __call__(self, x):
        h = jax.vmap(self.proj)(x).reshape(x.shape[0], 2, 8).transpose(1, 0, 2)
        return self.attention(h, h, h)


def _module_model(mask):
    return _Model(eqx.nn.Linear(16, 16, key=jax.random.key(0)),
                  bsa.BlockSparseAttention(mask=mask, kernel=kernels.DenseReference()))


def _layer_model(mask):
    return bsa.MultiheadBlockSparseAttention(2, 16, mask=mask, kernel=kernels.DenseReference(),
                                             key=jax.random.key(0))


#: Each model kind: how to build it, where its mask is, and a loss.
MODELS = {
    "module": (_module_model, lambda m: m.attention.mask,
               lambda m, x: jnp.sum(m(x) ** 2)),
    "layer": (_layer_model, lambda m: m.attention.mask,
              lambda m, x: jnp.sum(m(x, x, x) ** 2)),
}

X = jax.random.normal(jax.random.key(1), (48, 16))


def _step(optim, model, state, loss):
    grads = eqx.filter_grad(loss)(model, X)
    updates, state = optim.update(grads, state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), state


@pytest.mark.parametrize("kind", [pytest.param("module", marks=pytest.mark.slow), "layer"])
def test_plain_tree_at_mask_swap_keeps_the_optimizer_state(kind):
    """`Causal()` to `Causal() & SlidingWindow(32, 0)` with `eqx.tree_at` alone, then an Adam
    step: the gradients and the state keep their structure, and the new mask is the one used."""
    build, where, loss = MODELS[kind]
    model = build(masks.Causal())
    optim = optax.adam(1e-2)
    state = optim.init(eqx.filter(model, eqx.is_array))
    window = masks.Causal() & masks.SlidingWindow(32, 0)
    swapped = eqx.tree_at(where, model, window)
    assert jax.tree.structure(eqx.filter(swapped, eqx.is_array)) == \
        jax.tree.structure(eqx.filter(model, eqx.is_array))
    stepped, state = _step(optim, swapped, state, loss)  # raised a structure error before
    assert where(stepped) == window
    np.testing.assert_allclose(loss(swapped, X), loss(build(window), X), rtol=1e-6)
    assert not np.isclose(float(loss(swapped, X)), float(loss(model, X)))  # the window acts
    stepped, state = _step(optim, stepped, state, loss)
    assert np.isfinite(float(loss(stepped, X)))


def test_array_free_masks_are_leaves_compared_by_value():
    window = masks.Causal() & masks.SlidingWindow(32, 0)
    for mask in (masks.Causal(), window, ~window | masks.GlobalTokens(4),
                 masks.PerHead([masks.Causal(), window])):
        assert jax.tree.structure(mask) == jax.tree.structure(0), mask
        assert not eqx.is_array(mask)
    assert window == masks.Causal() & masks.SlidingWindow(32, 0)
    assert hash(window) == hash(masks.Causal() & masks.SlidingWindow(32, 0))
    assert window != masks.Causal() & masks.SlidingWindow(16, 0)
    assert repr(window) == ("And(left=Causal(offset=0, bottom_right=False), "
                            "right=SlidingWindow(left=32, right=0))")
    with pytest.raises(dataclasses.FrozenInstanceError, match="immutable"):
        window.left = masks.Full()


def test_filter_jit_retraces_for_a_new_mask_only():
    traces = []

    @eqx.filter_jit
    def call(attn, q):
        traces.append(attn.mask)
        return attn(q, q, q)

    q = jax.random.normal(jax.random.key(2), (2, 40, 8))
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.XlaBlockSparse())
    call(attn, q)
    call(eqx.tree_at(lambda m: m.mask, attn, masks.Causal()), q)  # equal: no retrace
    call(eqx.tree_at(lambda m: m.mask, attn, masks.Causal(offset=2)), q)
    assert traces == [masks.Causal(), masks.Causal(offset=2)]


def test_array_masks_stay_nodes_and_new_arrays_do_not_retrace():
    keep = jax.random.bernoulli(jax.random.key(3), 0.5, (40, 40))
    mask = masks.Causal() & masks.ArrayMask(keep)
    assert isinstance(mask, masks.And) and isinstance(mask.right, masks.ArrayMask)
    causal, leaf = jax.tree.leaves(mask)  # the array-free part is one leaf
    assert causal == masks.Causal()
    assert leaf.dtype == jnp.bool_ and leaf.shape == (1, 40, 40)
    traces = []

    @eqx.filter_jit
    def call(attn, q):
        traces.append(None)
        return attn(q, q, q)

    q = jax.random.normal(jax.random.key(2), (2, 40, 8))
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernels.XlaBlockSparse())
    out = call(attn, q)
    other = masks.Causal() & masks.ArrayMask(~keep)
    call(eqx.tree_at(lambda m: m.mask, attn, other), q)
    assert len(traces) == 1
    dense = eqx.tree_at(lambda m: m.kernel, attn, kernels.DenseReference())
    np.testing.assert_allclose(out, dense(q, q, q), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", MODELS)
def test_swap_strategy_carries_the_state_over_to_an_array_mask(kind):
    """A mask holding arrays changes the model's structure: `eqx.tree_at` alone breaks the
    next update (optax's error, not ours), `swap_strategy` keeps it going; a replacement that
    holds floating-point arrays is refused by name."""
    build, where, loss = MODELS[kind]
    model = build(masks.Causal())
    optim = optax.adam(1e-2)
    state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    keep = jax.random.bernoulli(jax.random.key(3), 0.7, (48, 48))
    new_mask = masks.Causal() & masks.ArrayMask(keep)
    plain = eqx.tree_at(where, model, new_mask)
    with pytest.raises(ValueError):
        _step(optim, plain, state, loss)
    swapped, new_state = bsa.swap_strategy(where, model, new_mask, state)
    stepped, _ = _step(optim, swapped, new_state, loss)
    assert where(stepped).right.mask is where(swapped).right.mask  # not trained
    assert np.isfinite(float(loss(stepped, X)))
    # And back to a mask without arrays.
    back, back_state = bsa.swap_strategy(where, stepped, masks.Causal(), new_state)
    _step(optim, back, back_state, loss)
    with pytest.raises(ValueError, match=r"holds arrays of floating point .*eqx\.tree_at"):
        bsa.swap_strategy(where, model, _Shifted(jnp.float32(2.0)), state)


class _Shifted(masks.AbstractMask):
    """A mask holding a floating-point array: a parameter, which swap_strategy cannot carry."""

    shift: jax.Array

    reads_segment_ids = False
    varies_by_head = False

    def elements(self, q, k, head):
        return k.position <= q.position + self.shift
