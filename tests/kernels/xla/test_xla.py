"""`XlaBlockSparse` against `DenseReference`: forward and every gradient, edge cases of tiling,
transformations, and the promise that new segment ids never retrace."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import Tiling, kernels, masks
from tests.conftest import random_array

TOL = 1e-5


def _normal(seed, shape):
    return random_array(seed, shape)


def _segments(seed, batch, length, docs, pad=0):
    """Sorted document ids in runs; the last `pad` tokens are padding (-1)."""
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.integers(0, docs, (batch, length)), axis=-1).astype(np.int32)
    if pad:
        ids[:, length - pad:] = -1
    return jnp.asarray(ids)


def _grads(attn, q, k, v, diff, other, cotangent):
    """Output and gradients (q, k, v, and every array in `diff`) of ``<attn(...), cotangent>``."""

    def loss(q, k, v, diff):
        out = attn(q, k, v, **diff, **other)
        return jnp.sum(out * cotangent), out

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    grads, out = fn(q, k, v, diff)
    return out, grads


def _assert_close(actual, expected, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    scale = max(np.max(np.abs(expected), initial=0.0), 1e-2)
    err = np.max(np.abs(actual - expected), initial=0.0) / scale
    assert err <= TOL, f"{what}: relative error {err:.2e} > {TOL:.0e}"


def check(
    mask,
    *,
    batch=2,
    heads=4,
    kv_heads=2,
    q_len=50,
    kv_len=70,
    dim=16,
    value_dim=8,
    tiling=Tiling(16, 32),
    bias_shape=None,
    sinks_shape=None,
    soft_cap=None,
    softmax_scale=None,
    segments=None,
    positions=None,
    seed=0,
):
    """Compare forward and gradients of the xla kernel with the dense reference."""
    q = _normal(seed, (batch, heads, q_len, dim))
    k = _normal(seed + 1, (batch, kv_heads, kv_len, dim))
    v = _normal(seed + 2, (batch, kv_heads, kv_len, value_dim))
    cotangent = _normal(seed + 3, (batch, heads, q_len, value_dim))
    diff, other = {}, {}
    if bias_shape is not None:
        diff["bias"] = _normal(seed + 4, bias_shape)
    if sinks_shape is not None:
        diff["sinks"] = _normal(seed + 5, sinks_shape)
    if segments is not None:
        other["q_segment_ids"], other["kv_segment_ids"] = segments
    if positions is not None:
        other["q_positions"], other["kv_positions"] = positions
    options = dict(mask=mask, softmax_scale=softmax_scale, logits_soft_cap=soft_cap)
    reference = bsa.BlockSparseAttention(kernel=kernels.DenseReference(), **options)
    xla = bsa.BlockSparseAttention(kernel=kernels.XlaBlockSparse(), tiling=tiling, **options)
    out_ref, grads_ref = _grads(reference, q, k, v, diff, other, cotangent)
    out, grads = _grads(xla, q, k, v, diff, other, cotangent)
    assert out.dtype == q.dtype
    _assert_close(out, out_ref, "output")
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads[:3], grads_ref[:3]):
        _assert_close(g, g_ref, name)
    for name in diff:
        assert grads[3][name].shape == diff[name].shape
        _assert_close(grads[3][name], grads_ref[3][name], "d" + name)
    return out


def _every_other(q, k):
    return (k <= q) & ((q + k) % 3 != 0)


_TABLE = np.random.default_rng(7).random((4, 3)) < 0.5

_POSITIONS = tuple(
    jnp.asarray(np.sort(np.random.default_rng(3).integers(0, 90, (2, n)), -1), jnp.int32)
    for n in (50, 70)
)

# Each family also carries a feature or two, so that every feature meets a few masks without
# compiling more functions.
MASKS = {
    "causal": (masks.Causal(), {}),
    "chunked": (masks.ChunkedCausal(24), {"sinks_shape": (4, 1)}),
    "prefix_mqa_bias_soft_cap": (
        masks.PrefixLM(21), {"kv_heads": 1, "bias_shape": (1, 1, 50, 70), "soft_cap": 3.0}
    ),
    "global_or_window_positions": (
        masks.GlobalTokens(5) | masks.SlidingWindow(16, 6),
        {"positions": _POSITIONS, "sinks_shape": (4, 3)},
    ),
    "dilated": (masks.Causal() & masks.Dilated(3), {"softmax_scale": 0.5}),
    "bigbird": (masks.Causal() & (masks.SlidingWindow(16, 0) | masks.BigBirdRandom(16, 2)), {}),
    "block_layout": (masks.BlockLayoutMask(_TABLE, block_size=(16, 24)), {}),
    "predicate_positions": (masks.Predicate(_every_other), {"positions": _POSITIONS}),
    "not_causal": (~masks.Causal(offset=-3), {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MASKS))
def test_mask_families(name):
    # Ragged lengths (50, 70 are not multiples of 16, 32), Lq != Lk, GQA and Dv != D throughout;
    # `Causal() & SlidingWindow` runs in test_tilings, `Causal(bottom_right=True)` in
    # test_one_query, `Document` and `PerHead` below.
    mask, features = MASKS[name]
    check(mask, **features)


@pytest.mark.slow
def test_document_with_padding_cross_lengths():
    # Padded tokens (-1) see nothing: fully masked rows must give zeros and zero gradients.
    out = check(
        masks.Causal() & masks.Document(), sinks_shape=(4, 2),
        segments=(_segments(0, 2, 50, 4, pad=7), _segments(1, 2, 70, 4, pad=5)),
    )
    assert np.all(np.asarray(out)[:, :, -7:] == 0)


@pytest.mark.slow
def test_per_head_masks_with_gqa():
    per_head = masks.PerHead(
        [masks.Causal(), masks.SlidingWindow(5), masks.Full(), masks.ChunkedCausal(16)]
    )
    check(per_head, bias_shape=(4, 50, 70), sinks_shape=(4, 1))


@pytest.mark.slow
def test_bias_sinks_soft_cap_scale():
    check(
        masks.Causal() & masks.SlidingWindow(25, 0), bias_shape=(2, 4, 50, 70),
        sinks_shape=(4, 2), soft_cap=2.0, softmax_scale=0.7,
    )


@pytest.mark.slow
def test_fully_masked_rows():
    # Causal with offset -20: the first 20 queries see no key at all.
    out = check(masks.Causal(offset=-20), sinks_shape=(4, 2))
    assert np.all(np.asarray(out)[:, :, :20] == 0)


@pytest.mark.slow
def test_minus_inf_bias_hiding_a_full_block():
    # An additive -inf bias (a padding mask written as a bias) hides the first kv-block of every
    # row, which the mask calls FULL; later blocks are visible. The row maximum stays -inf over
    # the first block, so an unguarded online softmax computes exp(-inf - (-inf)) = NaN.
    q, k, v = _normal(0, (1, 2, 32, 8)), _normal(1, (1, 2, 32, 8)), _normal(2, (1, 2, 32, 8))
    bias = jnp.where(jnp.arange(32) < 16, -jnp.inf, 0.0) * jnp.ones((32, 1))
    cotangent = _normal(3, (1, 2, 32, 8))
    results = []
    for kernel in (kernels.DenseReference(), kernels.XlaBlockSparse()):
        attn = bsa.BlockSparseAttention(mask=masks.Full(), kernel=kernel, tiling=Tiling(16, 16))
        # Eager: XLA happens to fold the NaN away when the call is inlined into an outer jit.
        out, pullback = jax.vjp(lambda q, k, v, attn=attn: attn(q, k, v, bias=bias), q, k, v)
        results.append((out, pullback(cotangent)))
    (out_ref, grads_ref), (out, grads) = results
    _assert_close(out, out_ref, "output")
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        _assert_close(g, g_ref, name)


@pytest.mark.slow
def test_one_query():
    # Blocks larger than the sequences shrink to them (1 query, 75 keys).
    check(masks.Causal(bottom_right=True), q_len=1, kv_len=75, heads=2, kv_heads=1,
          tiling=Tiling(16, 128))


@pytest.mark.slow
@pytest.mark.parametrize(
    "tiling",
    [Tiling(5, 7), Tiling(16, 32, block_q_bwd=32, block_kv_bwd=8)],
    ids=["uneven", "backward_blocks"],
)
def test_tilings(tiling):
    check(masks.Causal() & masks.SlidingWindow(13, 2), tiling=tiling)


@pytest.mark.slow
def test_vmap_checkpoint_filter_jit_eager():
    # Unbatched calls vmapped over the batch and rematerialised; then filter_jit and eager.
    mask = masks.Causal() & masks.SlidingWindow(10, 0)
    xla = bsa.BlockSparseAttention(mask=mask, kernel=kernels.XlaBlockSparse(), tiling=Tiling(8, 16))
    ref = bsa.BlockSparseAttention(mask=mask, kernel=kernels.DenseReference())
    q, k, v = _normal(0, (3, 2, 33, 8)), _normal(1, (3, 1, 33, 8)), _normal(2, (3, 1, 33, 4))

    @jax.jit
    def loss_and_grads(q, k, v):
        def loss(attn, q, k, v):
            body = jax.checkpoint(lambda q, k, v: jax.vmap(attn)(q, k, v))
            return jnp.sum(jnp.sin(body(q, k, v)))

        got = jax.value_and_grad(lambda *a: loss(xla, *a), argnums=(0, 1, 2))(q, k, v)
        want = jax.value_and_grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2))(q, k, v)
        return got, want

    got, want = loss_and_grads(q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _assert_close(a, b, "vmap/checkpoint")
    expected = jax.jit(ref)(q[0], k[0], v[0])
    filtered = eqx.filter_jit(lambda m, *a: m(*a))(xla, q[0], k[0], v[0])
    _assert_close(filtered, expected, "filter_jit")
    _assert_close(xla(q[0], k[0], v[0]), expected, "eager")


@pytest.mark.slow
def test_new_segment_ids_do_not_retrace(monkeypatch):
    # Eager calls: each runs the kernel's own cached, jitted function. Count the traces of its
    # forward and backward; an outer jax.jit would hide a retrace (it traces once per shape).
    from eqx_bsattn.strategies.kernels import xla

    # Another test may have compiled this configuration already (the kernel caches its jitted
    # functions): start cold, so that the first call must trace.
    xla._attention_fn.cache_clear()
    traces = []
    for name in ("_forward", "_backward_dq", "_backward_dkv"):
        def counting(*args, _fn=getattr(xla, name), _name=name):
            traces.append(_name)
            return _fn(*args)

        monkeypatch.setattr(xla, name, counting)
    attn = bsa.BlockSparseAttention(
        mask=masks.Causal(), kernel=kernels.XlaBlockSparse(), tiling=Tiling(16, 16)
    )
    ref = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.DenseReference())

    def grads(attn, q, k, v, ids):
        return jax.grad(lambda q: jnp.sum(attn(q, k, v, q_segment_ids=ids, kv_segment_ids=ids)))(q)

    q, k, v = _normal(0, (2, 2, 48, 8)), _normal(1, (2, 2, 48, 8)), _normal(2, (2, 2, 48, 8))
    for seed in range(3):
        ids = _segments(seed, 2, 48, 2 + seed, pad=seed)
        got = grads(attn, q, k, v, ids)
        want = jax.jit(grads, static_argnums=0)(ref, q, k, v, ids)
        _assert_close(got, want, f"dq with segment ids #{seed}")
        if seed == 0:
            first = list(traces)
            assert set(first) == {"_forward", "_backward_dq", "_backward_dkv"}, first
    assert traces == first, "new segment ids retraced the kernel"


def _largest_intermediate(jaxpr) -> int:
    """Largest number of elements of any value produced anywhere in `jaxpr` (sub-jaxprs too)."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, math.prod(getattr(var.aval, "shape", ())))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    largest = max(largest, _largest_intermediate(getattr(inner, "jaxpr", inner)))
    return largest


def test_no_lq_by_lk_array():
    q_len = kv_len = 512
    attn = bsa.BlockSparseAttention(
        mask=masks.Causal() & masks.SlidingWindow(32, 0), kernel=kernels.XlaBlockSparse(),
        tiling=Tiling(32, 32),
    )
    q, k, v = (jax.ShapeDtypeStruct((1, 2, q_len, 8), jnp.float32) for _ in range(3))
    grad = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v)), argnums=(0, 1, 2))
    largest = _largest_intermediate(jax.make_jaxpr(grad)(q, k, v).jaxpr)
    assert largest < q_len * kv_len // 4, largest


def test_selector_prefers_xla_on_cpu_and_tpu():
    # Past the small calls a CPU gives DenseReference (tests/test_small_calls.py).
    features = bsa.Features(platform="cpu", q_len=1024, kv_len=1024)
    assert bsa.select_kernel(masks.Causal(), "cpu", features=features).kernel.name == "xla"
    assert kernels.XlaBlockSparse.priority("tpu") == 10
    assert kernels.XlaBlockSparse.priority("gpu") == 5


def test_slot_elements_is_checked_printed_and_kept_by_every_copy():
    for bad in (0, -4, 1.5, True):
        with pytest.raises(ValueError, match=r"`XlaConfig.slot_elements` must be a positive int"):
            kernels.XlaConfig(128, 64, slot_elements=bad)
    config = kernels.XlaConfig(128, 64, slot_elements=1 << 21)
    assert config.text() == "fwd 128x64 | dq 128x64 | dk/dv 128x64 | slot 2^21"
    assert kernels.XlaConfig(64, 64, slot_elements=3000).text().endswith("| slot 3000")
    assert kernels.XlaConfig(128, 64).text() == "fwd 128x64 | dq 128x64 | dk/dv 128x64"
    short = bsa.Features(q_len=40, kv_len=20)
    kernel = kernels.XlaBlockSparse()
    for copy in (config.explicit(), config.clamped(short), kernel.adapt_tiling(config, short),
                 *config.candidates(short)):
        assert copy.slot_elements == 1 << 21
    # Unset: the default, except inside a sharding's loop (Features.in_loop), where a slot
    # holds half of it; a slot given is kept there too.
    looped = bsa.Features(q_len=40, kv_len=20, in_loop=True)
    assert kernel.adapt_tiling(Tiling(16, 16), short).slot_elements is None
    assert kernel.adapt_tiling(Tiling(16, 16), looped).slot_elements == 1 << 21
    assert kernel.adapt_tiling(kernels.XlaConfig(16, 16), looped).slot_elements == 1 << 21
    assert kernel.adapt_tiling(config.explicit().clamped(looped), looped) == config.clamped(looped)
    assert kernel.adapt_tiling(kernels.XlaConfig(16, 16, slot_elements=512),
                               looped).slot_elements == 512


@pytest.mark.slow
def test_a_smaller_slot_runs_in_chunks_with_less_memory_and_the_same_result():
    """Causal, L=4096, H=2: every pass fits one slot at the default; at 2^18 scores a slot the
    backward runs its blocks in 4 chunks, the result unchanged and jit(grad)'s temporaries
    smaller."""
    q, k, v = (random_array(i, (1, 2, 4096, 32)) for i in range(3))

    def attn(slot):
        return bsa.BlockSparseAttention(
            mask=masks.Causal(), kernel=kernels.XlaBlockSparse(),
            tiling=kernels.XlaConfig(128, 128, slot_elements=slot))

    def loss(m):
        return lambda q, k, v: jnp.sum(m(q, k, v) ** 2)

    grads = {}
    temps = {}
    for slot in (None, 1 << 18):
        fn = jax.jit(jax.grad(loss(attn(slot)), argnums=(0, 1, 2)))
        temps[slot] = fn.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
        grads[slot] = fn(q, k, v)
    assert temps[1 << 18] < temps[None], temps
    np.testing.assert_allclose(attn(1 << 18)(q, k, v), attn(None)(q, k, v), atol=1e-6)
    for a, b in zip(grads[1 << 18], grads[None]):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
