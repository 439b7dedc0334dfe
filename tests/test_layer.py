"""`MultiheadBlockSparseAttention` against `eqx.nn.MultiheadAttention`, a small model that
trains, and `swap_strategy` keeping an optax state valid across a kernel swap."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
from tests.conftest import np_attention, np_visibility

SIZE, HEADS, Q_LEN, KV_LEN = 32, 4, 40, 56


def _inputs(seed=0, q_len=Q_LEN, kv_len=KV_LEN):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (q_len, SIZE)), jax.random.normal(kk, (kv_len, SIZE)),
            jax.random.normal(kv, (kv_len, SIZE)))


def _equinox_twin(layer, **kw):
    """An `eqx.nn.MultiheadAttention` holding the layer's weights."""
    twin = eqx.nn.MultiheadAttention(HEADS, SIZE, key=jax.random.key(99), **kw)
    for name in ("query_proj", "key_proj", "value_proj", "output_proj"):
        twin = eqx.tree_at(lambda m, n=name: getattr(m, n), twin, getattr(layer, name))
    return twin


@pytest.mark.parametrize("kernel", [
    pytest.param(kernels.XlaBlockSparse(), marks=pytest.mark.slow), kernels.DenseReference()],
    ids=lambda k: k.name)
def test_full_mask_equals_equinox_multihead_attention(kernel):
    layer = bsa.MultiheadBlockSparseAttention(
        HEADS, SIZE, use_query_bias=True, use_output_bias=True, kernel=kernel,
        tiling=bsa.Tiling(block_q=16, block_kv=16), key=jax.random.key(1))
    # Biases are zero at init: make them count.
    layer = eqx.tree_at(lambda m: (m.query_proj.bias, m.output_proj.bias), layer,
                        (jnp.linspace(-1, 1, SIZE), jnp.linspace(1, -1, SIZE)))
    twin = _equinox_twin(layer, use_query_bias=True, use_output_bias=True)
    q, k, v = _inputs()
    call = eqx.filter_jit(lambda m, q, k, v: m(q, k, v))  # eager calls compile op by op: slow
    np.testing.assert_allclose(call(layer, q, k, v), call(twin, q, k, v), rtol=1e-5, atol=1e-5)


def test_same_key_gives_the_weights_of_equinox():
    layer = bsa.MultiheadBlockSparseAttention(HEADS, SIZE, key=jax.random.key(3))
    twin = eqx.nn.MultiheadAttention(HEADS, SIZE, key=jax.random.key(3))
    for name in ("query_proj", "key_proj", "value_proj", "output_proj"):
        np.testing.assert_array_equal(getattr(layer, name).weight, getattr(twin, name).weight)


@pytest.mark.slow
def test_mask_and_rotary_against_the_dense_equinox_layer():
    mask = masks.Causal() & masks.SlidingWindow(9, 0) | masks.GlobalTokens(2)
    layer = bsa.MultiheadBlockSparseAttention(
        HEADS, SIZE, mask=mask, rotary_theta=10_000.0,
        tiling=bsa.Tiling(block_q=8, block_kv=8), key=jax.random.key(2))
    twin = _equinox_twin(layer)
    q, k, v = _inputs(seed=1, kv_len=Q_LEN)
    qi, kj = np.arange(Q_LEN)[:, None], np.arange(Q_LEN)[None, :]
    visible = ((kj <= qi) & (kj >= qi - 9)) | (qi < 2) | (kj < 2)
    rope = eqx.nn.RotaryPositionalEmbedding(SIZE // HEADS)

    def rotate(qh, kh, vh):  # [L, H, D] heads, as equinox hands them over
        spin = jax.vmap(rope, in_axes=1, out_axes=1)
        return spin(qh), spin(kh), vh

    want = twin(q, k, v, mask=jnp.asarray(visible), process_heads=rotate)
    np.testing.assert_allclose(layer(q, k, v), want, rtol=1e-5, atol=1e-5)
    # Positions move both the rotary angles and the mask: shifting all of them by a constant
    # changes neither relative distances nor which pairs attend (no GlobalTokens here).
    local = eqx.tree_at(lambda m: m.attention.mask, layer, masks.Causal() & masks.SlidingWindow(9, 0))
    shifted = local(q, k, v, q_positions=jnp.arange(Q_LEN) + 7, kv_positions=jnp.arange(Q_LEN) + 7)
    np.testing.assert_allclose(shifted, local(q, k, v), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_grouped_query_heads_and_vmap_against_jax_attention():
    layer = bsa.MultiheadBlockSparseAttention(
        HEADS, SIZE, num_kv_heads=2, vo_size=6, output_size=10, mask=masks.Causal(),
        tiling=bsa.Tiling(block_q=16, block_kv=16), key=jax.random.key(4))
    assert layer.key_proj.out_features == 2 * (SIZE // HEADS)
    xs = jax.random.normal(jax.random.key(5), (3, Q_LEN, SIZE))
    got = eqx.filter_vmap(lambda x: layer(x, x, x))(xs)

    def dense(x):
        q = jax.vmap(layer.query_proj)(x).reshape(Q_LEN, HEADS, -1)
        k = jax.vmap(layer.key_proj)(x).reshape(Q_LEN, 2, -1)
        v = jax.vmap(layer.value_proj)(x).reshape(Q_LEN, 2, -1)
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 2)))  # jax's attention wants Dv == D
        out = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        return jax.vmap(layer.output_proj)(out[..., :6].reshape(Q_LEN, -1))

    assert got.shape == (3, Q_LEN, 10)
    np.testing.assert_allclose(got, jax.vmap(dense)(xs), rtol=1e-5, atol=1e-5)


def test_dropout_needs_a_key_and_inference_turns_it_off():
    layer = bsa.MultiheadBlockSparseAttention(HEADS, SIZE, dropout_p=0.5, key=jax.random.key(6))
    q, k, v = _inputs()
    off = layer(q, k, v, inference=True)
    np.testing.assert_allclose(off, eqx.nn.inference_mode(layer)(q, k, v), rtol=1e-6)
    dropped = layer(q, k, v, key=jax.random.key(7))
    assert not np.allclose(dropped, off)
    with pytest.raises(RuntimeError):
        layer(q, k, v)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="num_kv_heads"):
        bsa.MultiheadBlockSparseAttention(4, 32, num_kv_heads=3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="qk_size"):
        bsa.MultiheadBlockSparseAttention(4, 32, qk_size=5, rotary_theta=1e4, key=jax.random.key(0))


# ---- a small model that trains, and a kernel swap in the middle of training ----------------


class TinyTransformer(eqx.Module):
    embed: eqx.nn.Embedding
    attention: bsa.MultiheadBlockSparseAttention
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, vocab, size, mask, *, key):
        ke, ka, kh = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, size, key=ke)
        self.attention = bsa.MultiheadBlockSparseAttention(
            2, size, mask=mask, rotary_theta=10_000.0, tiling=bsa.Tiling(block_q=8, block_kv=8),
            key=ka)
        self.norm = eqx.nn.LayerNorm(size)
        self.head = eqx.nn.Linear(size, vocab, key=kh)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        x = x + self.attention(x, x, x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def _copy_task(batch=8, length=32, vocab=8, lag=3):
    """Predict the token `lag` places back: needs attention within a causal window."""
    tokens = jax.random.randint(jax.random.key(8), (batch, length), 0, vocab)
    targets = jnp.roll(tokens, lag, axis=1)
    return tokens, targets


def _loss(model, tokens, targets):
    logits = jax.vmap(model)(tokens)[:, 3:]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets[:, 3:]).mean()


def _training(model):
    optim = optax.adam(3e-2)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state, tokens, targets):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, tokens, targets)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return opt_state, step


@pytest.mark.slow
def test_small_model_trains_and_a_kernel_swap_keeps_the_optimizer_state():
    model = TinyTransformer(8, 16, masks.Causal() & masks.SlidingWindow(4, 0),
                            key=jax.random.key(9))
    tokens, targets = _copy_task()
    opt_state, step = _training(model)
    losses = []
    for _ in range(6):
        model, opt_state, loss = step(model, opt_state, tokens, targets)
        losses.append(float(loss))
    where = lambda m: m.attention.attention.kernel  # noqa: E731
    swapped, swapped_state = bsa.swap_strategy(where, model, kernels.DenseReference(), opt_state)
    assert isinstance(swapped.attention.attention.kernel, kernels.DenseReference)
    assert isinstance(model.attention.attention.kernel, bsa.AutoKernel)  # the old one untouched
    # The swap changes no array: parameters and moments carry over as they are.
    for before, after in ((model, swapped), (opt_state, swapped_state)):
        old = jax.tree.leaves(eqx.filter(before, eqx.is_array))
        new = jax.tree.leaves(eqx.filter(after, eqx.is_array))
        assert len(old) == len(new) > 0
        assert all(a is b for a, b in zip(old, new))
    # The reference kernel computes the same loss, and training goes on from the same state.
    np.testing.assert_allclose(_loss(swapped, tokens, targets), _loss(model, tokens, targets),
                               rtol=1e-5)
    for _ in range(6):
        swapped, swapped_state, loss = step(swapped, swapped_state, tokens, targets)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(np.isfinite(losses))


@pytest.mark.slow
def test_plain_tree_at_swap_keeps_the_optimizer_state_and_retraces():
    """Kernels and tilings are leaves of the model that are not arrays, so a swap with plain
    `eqx.tree_at` leaves the structure of the gradients and of the optimizer state as it was:
    `optim.update` goes on, `jax.tree.map` pairs the gradients of a model and its swapped twin,
    and `eqx.filter_jit` retraces for the new kernel."""
    model = TinyTransformer(8, 16, masks.Causal() & masks.SlidingWindow(4, 0),
                            key=jax.random.key(9))
    tokens, targets = _copy_task(batch=2, length=16)
    optim = optax.adam(3e-2)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    traces = []

    @eqx.filter_jit
    def step(model, opt_state):
        traces.append(model.attention.attention.kernel.name
                      if hasattr(model.attention.attention.kernel, "name") else "auto")
        loss, grads = eqx.filter_value_and_grad(_loss)(model, tokens, targets)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss, grads

    model, opt_state, _, grads = step(model, opt_state)
    where = lambda m: m.attention.attention.kernel  # noqa: E731
    swapped = eqx.tree_at(where, model, kernels.DenseReference())
    twin_grads = eqx.filter_grad(_loss)(swapped, tokens, targets)
    same_grads = eqx.filter_grad(_loss)(model, tokens, targets)
    gaps = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), twin_grads, same_grads)
    assert max(jax.tree.leaves(gaps)) < 1e-5
    swapped, opt_state, loss, _ = step(swapped, opt_state)   # no structure error
    tiled = eqx.tree_at(lambda m: m.attention.attention.tiling, swapped,
                        bsa.Tiling(block_q=16, block_kv=16))
    tiled, opt_state, _, _ = step(tiled, opt_state)
    tiled, opt_state, _, _ = step(tiled, opt_state)          # same strategies: no retrace
    assert traces == ["auto", "reference", "reference"], traces
    assert np.isfinite(float(loss))
    # swap_strategy gives the same model and state as the plain swap.
    via, via_state = bsa.swap_strategy(where, tiled, kernels.XlaBlockSparse(), opt_state)
    plain = eqx.tree_at(where, tiled, kernels.XlaBlockSparse())
    assert jax.tree.structure(via) == jax.tree.structure(plain)
    assert jax.tree.structure(via_state) == jax.tree.structure(opt_state)


@pytest.mark.slow
def test_tree_at_needs_no_is_leaf_and_swap_strategy_reaches_the_tiling():
    layer = bsa.MultiheadBlockSparseAttention(2, 16, mask=masks.Causal(), key=jax.random.key(0))
    assert layer.attention.kernel == bsa.AutoKernel() and layer.attention.tiling == bsa.AutoTiling()
    assert bsa.BlockSparseAttention(kernel=None, tiling=None) == bsa.BlockSparseAttention()
    tiled = eqx.tree_at(lambda m: m.attention.tiling, layer, bsa.Tiling(block_q=8, block_kv=8))
    assert tiled.attention.tiling == bsa.Tiling(block_q=8, block_kv=8)
    x = jax.random.normal(jax.random.key(1), (24, 16))
    np.testing.assert_allclose(tiled(x, x, x), layer(x, x, x), rtol=1e-5, atol=1e-6)
    # An optimizer state with moments (SGD with momentum), a swap of two strategies at once.
    optim = optax.sgd(0.1, momentum=0.9)
    state = optim.init(eqx.filter(layer, eqx.is_array))
    where = lambda m: (m.attention.kernel, m.attention.tiling)  # noqa: E731
    new, new_state = bsa.swap_strategy(
        where, layer, (kernels.XlaBlockSparse(), bsa.Tiling(block_q=8, block_kv=8)), state)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x, x, x) ** 2))(new)
    updates, _ = optim.update(grads, new_state)  # raises if the structures differ
    assert jax.tree.structure(updates) == jax.tree.structure(grads)
    with pytest.raises(ValueError, match="holds arrays"):
        bsa.swap_strategy(lambda m: m.query_proj, layer, layer.key_proj, state)


@pytest.mark.parametrize("args, message", [
    (lambda q, k, v: (q[:0], k, v), "`query` must hold at least one token; got shape (0, 32)."),
    (lambda q, k, v: (q, k[:0], v[:0]), "`key_` must hold at least one token; got shape (0, 32)."),
    (lambda q, k, v: (q[None], k, v), "`query` must be [seq_len, 32] (the layer is unbatched: "
     "jax.vmap it over a batch); got shape (1, 40, 32)."),
    (lambda q, k, v: (q, k, v[:, :8]), "`value` must have 32 channels ([seq_len, 32]: the "
     "layer's `value_size`); got shape (56, 8)."),
    (lambda q, k, v: (q[:, :16], k, v), "`query` must have 32 channels"),
    (lambda q, k, v: (q, k, v[:3]), "`key_` and `value` must have the same length; got shapes "
     "(56, 32) and (3, 32)."),
    (lambda q, k, v: (q, k, v, np.ones((3, 56), bool)), "`mask` must have shape [40, 56] or "
     "[4 or 1, 40, 56] ([num_heads,] q_len, kv_len); got (3, 56)."),
], ids=["no queries", "no keys", "batched", "value channels", "query channels", "lengths",
        "mask shape"])
def test_layer_errors_are_one_line(args, message):
    layer = bsa.MultiheadBlockSparseAttention(HEADS, SIZE, key=jax.random.key(0))
    with pytest.raises(ValueError) as info:
        layer(*args(*_inputs()))
    assert message in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def _oracle_layer(layer, q, k, v, visible, **kw):
    """The layer's projections around the float64 oracle: [Lq, output_size]."""
    heads = [layer._heads(proj, x, n)[None] for proj, x, n in (
        (layer.query_proj, q, HEADS), (layer.key_proj, k, layer.num_kv_heads),
        (layer.value_proj, v, layer.num_kv_heads))]
    out = np_attention(*heads, visible, **kw)[0]          # [H, Lq, vo]
    out = np.transpose(out, (1, 0, 2)).reshape(q.shape[0], -1)
    return out @ np.asarray(layer.output_proj.weight, np.float64).T


@pytest.mark.slow
def test_per_call_mask_bias_sinks_and_kv_lengths_against_the_oracle():
    """`layer(q, k, v, mask)` takes eqx.nn.MultiheadAttention's boolean mask (and'ed with the
    layer's), per-call `bias`, `sinks` and `kv_seq_lengths`; a new mask reuses the compiled
    call."""
    layer = bsa.MultiheadBlockSparseAttention(
        HEADS, SIZE, num_kv_heads=2, mask=masks.SlidingWindow(20), kernel=kernels.XlaBlockSparse(),
        tiling=bsa.Tiling(block_q=8, block_kv=8), key=jax.random.key(4))
    q, k, v = _inputs(seed=3)
    rng = np.random.default_rng(1)
    window = np_visibility(masks.SlidingWindow(20), batch=1, heads=HEADS, q_len=Q_LEN,
                           kv_len=KV_LEN)[0]
    bias = jnp.asarray(rng.normal(size=(HEADS, 1, KV_LEN)), jnp.float32)
    sinks = jnp.asarray(rng.normal(size=(HEADS,)), jnp.float32)
    traces = []

    @eqx.filter_jit
    def run(layer, mask, bias, sinks):
        traces.append(1)
        return layer(q, k, v, mask, bias=bias, sinks=sinks, kv_seq_lengths=50)

    keep = np.arange(KV_LEN) < 50
    for seed in (5, 6):
        mask = np.random.default_rng(seed).random((HEADS, Q_LEN, KV_LEN)) < 0.6
        want = _oracle_layer(layer, q, k, v, window & mask & keep, bias=bias, sinks=sinks)
        np.testing.assert_allclose(run(layer, mask, bias, sinks), want, rtol=2e-5, atol=2e-5)
    assert len(traces) == 1
    twin = _equinox_twin(layer.__class__(HEADS, SIZE, key=jax.random.key(4)))
    mask = jnp.asarray(rng.random((Q_LEN, KV_LEN)) < 0.5)
    full = bsa.MultiheadBlockSparseAttention(HEADS, SIZE, kernel=kernels.XlaBlockSparse(),
                                             key=jax.random.key(4))
    np.testing.assert_allclose(full(q, k, v, mask), twin(q, k, v, mask=mask), rtol=1e-5,
                               atol=1e-5)
