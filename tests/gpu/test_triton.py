"""`TritonBlockSparse` against `DenseReference` (float32): forward and every gradient.

GPU only: every test skips unless JAX's default backend is a GPU and jax-triton imports.
Shapes are reused across cases so Triton compiles few kernels (compilation dominates the time).
"""

import importlib.util
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks
from eqx_bsattn.strategies.kernels import DenseReference, TritonBlockSparse

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
    pytest.mark.skipif(importlib.util.find_spec("jax_triton") is None, reason="needs jax-triton"),
]

# Relative error in norm, ||out - ref|| / ||ref||, by input dtype. float32 runs its products in
# full precision; the half types round q, k, v, p and dS to 8 or 11 bits.
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3, jnp.float32: 1e-4}


def _rel(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    assert np.all(np.isfinite(a)), "non-finite values"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _segments(rng, batch, length, docs, pad):
    ids = np.sort(rng.integers(0, docs, (batch, length)), axis=1).astype(np.int32)
    if pad:
        ids[:, -pad:] = -1
    return jnp.asarray(ids)


def _compare(mask, *, dtype=jnp.bfloat16, batch=2, heads=4, kv_heads=2, q_len=300,
             kv_len=None, dim=64, value_dim=None, soft_cap=None, seed=0, tiling=None, **call):
    kv_len = q_len if kv_len is None else kv_len
    value_dim = dim if value_dim is None else value_dim
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (batch, heads, q_len, dim), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (batch, kv_heads, kv_len, dim), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (batch, kv_heads, kv_len, value_dim), jnp.float32).astype(dtype)
    cot = jax.random.normal(ks[3], (batch, heads, q_len, value_dim), jnp.float32)
    diff = {n: call.pop(n) for n in ("bias", "sinks") if n in call}

    def run(kernel, tiling, q, k, v, diff):
        attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, tiling=tiling,
                                        logits_soft_cap=soft_cap)

        def f(q, k, v, diff):
            return attn(q, k, v, **diff, **call)

        out, vjp = jax.vjp(f, q, k, v, diff)
        return out, vjp(cot.astype(out.dtype))

    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731
    out, grads = jax.jit(lambda *a: run(TritonBlockSparse(), tiling, *a))(q, k, v, diff)
    q, k, v, diff = f32((q, k, v, diff))
    # The reference runs in full float32: XLA's default on this GPU rounds products to TF32.
    with jax.default_matmul_precision("highest"):
        ref, ref_grads = jax.jit(lambda *a: run(DenseReference(), None, *a))(q, k, v, diff)
    assert out.dtype == dtype
    tol = TOL[dtype]
    errors = {"out": _rel(out, ref)}
    for name, g, r in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3]):
        assert g.dtype == dtype
        errors[name] = _rel(g, r)
    for name in diff:
        errors["d" + name] = _rel(grads[3][name], ref_grads[3][name])
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"relative errors over {tol}: {errors}"
    return errors


_RNG = np.random.default_rng(0)
_TABLE = np.tril(np.ones((3, 3), bool)) & (_RNG.random((3, 3)) > 0.3)
_TABLE[np.arange(3), np.arange(3)] = True

MASKS = {
    "full": masks.Full(),
    "causal": masks.Causal(),
    "window": masks.Causal() & masks.SlidingWindow(70, 0),
    "symmetric_window": masks.SlidingWindow(40),
    "chunked": masks.ChunkedCausal(96),
    "prefix": masks.PrefixLM(77),
    "global": masks.SlidingWindow(30) | masks.GlobalTokens(20),
    "dilated": masks.Causal() & masks.Dilated(3),
    "bigbird": masks.Causal() & (masks.SlidingWindow(64, 0) | masks.GlobalTokens(32)
                                 | masks.BigBirdRandom(64, 2)),
    "block_layout": masks.BlockLayoutMask(_TABLE, 128),
    "predicate": masks.Predicate(lambda q, k: (k <= q) & ((q - k) % 5 != 2)),
    "per_head": masks.PerHead([masks.Causal(), masks.SlidingWindow(16), masks.PrefixLM(50),
                               masks.Full()]),
    "not_causal": ~masks.Causal(offset=-1),
    "causal_offset_window_chunk": masks.Causal(offset=3) & masks.SlidingWindow(100, 10)
    & masks.ChunkedCausal(128),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_mask_families(name):
    _compare(MASKS[name])


def test_document_and_window_with_segment_ids():
    ids = _segments(_RNG, 2, 300, 4, pad=7)
    _compare(masks.Causal() & masks.SlidingWindow(50, 0), q_segment_ids=ids, kv_segment_ids=ids)


def test_document_only():
    ids = _segments(_RNG, 2, 300, 6, pad=0)
    _compare(masks.Full(), q_segment_ids=ids, kv_segment_ids=ids)


def test_interleaved_segment_ids():
    # A document that resumes after another one: in batch row 0 the full lists have gaps (the
    # kernel walks them by index), in row 1 they are ranges (walked without index loads).
    length = 600
    interleaved = (np.arange(length) // 150) % 2
    packed = np.repeat(np.arange(4), 150)
    ids = jnp.asarray(np.stack([interleaved, packed]).astype(np.int32))
    _compare(masks.Full(), q_segment_ids=ids, kv_segment_ids=ids, q_len=length)
    _compare(masks.Causal(), q_segment_ids=ids, kv_segment_ids=ids, q_len=length, dim=128)


def test_positions():
    qpos = jnp.asarray(np.stack([np.arange(300) + 1000, np.arange(300)[::-1] * 2]), jnp.int32)
    kpos = jnp.asarray(np.stack([np.arange(300) + 950, np.arange(300) * 2]), jnp.int32)
    _compare(masks.Causal() & masks.SlidingWindow(60, 0), q_positions=qpos, kv_positions=kpos)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_dtypes(dtype):
    _compare(masks.Causal() & masks.SlidingWindow(100, 0), dtype=dtype)


@pytest.mark.parametrize("dim", [80, 96, 128, 192, 256])
def test_head_dims(dim):
    _compare(masks.Causal(), dim=dim, q_len=200)


def test_value_dim_differs():
    _compare(masks.Causal(), dim=64, value_dim=128, q_len=200)


def test_decode_and_mqa():
    _compare(masks.Causal(bottom_right=True), heads=8, kv_heads=1, q_len=1, kv_len=500)


def test_cross_lengths():
    _compare(masks.Causal(bottom_right=True) & masks.SlidingWindow(90, 0), q_len=130,
             kv_len=333)


def test_bias_broadcast_and_full():
    bias = jax.random.normal(jax.random.key(7), (1, 4, 300, 300))
    _compare(masks.Causal(), bias=bias)
    bias = jax.random.normal(jax.random.key(8), (2, 1, 300, 300)).astype(jnp.bfloat16)
    _compare(masks.Full(), bias=bias)
    # One [Lq, Lk] plane for every batch element and head.
    bias = jax.random.normal(jax.random.key(9), (300, 300))
    _compare(masks.Causal(), bias=bias)


def test_sinks_and_soft_cap():
    sinks = jax.random.normal(jax.random.key(9), (4, 3))
    _compare(masks.Causal(), sinks=sinks, soft_cap=5.0)


def test_everything_at_once():
    ids = _segments(_RNG, 2, 300, 3, pad=5)
    bias = jax.random.normal(jax.random.key(10), (2, 4, 300, 300))
    sinks = jax.random.normal(jax.random.key(11), (4, 2))
    _compare(masks.Causal() & masks.SlidingWindow(80, 0), bias=bias, sinks=sinks, soft_cap=3.0,
             q_segment_ids=ids, kv_segment_ids=ids, dim=80, value_dim=96)


def test_fully_masked_rows_are_zero():
    # The first 40 queries see no key (with and without sinks): zeros, finite gradients.
    errors = _compare(masks.Causal(offset=-40))
    assert all(np.isfinite(list(errors.values())))
    _compare(masks.Causal(offset=-40), sinks=jnp.ones((4, 1)))


def test_explicit_tiling():
    tiling = bsa.Tiling(block_q=64, block_kv=32, block_q_bwd=32, block_kv_bwd=64, num_warps=4,
                        num_stages=2)
    _compare(masks.Causal() & masks.SlidingWindow(70, 0), tiling=tiling)
    # A dq tile of its own, three stages everywhere (index prefetch on every list walk).
    tiling = bsa.Tiling(block_q=64, block_kv=64, block_q_bwd=32, block_kv_bwd=64, num_warps=4,
                        num_stages=3, block_q_dq=64, block_kv_dq=32, num_stages_dq=3)
    _compare(masks.Causal() & masks.SlidingWindow(70, 0), tiling=tiling)
    ids = _segments(_RNG, 2, 300, 4, pad=0)
    _compare(masks.Causal(), tiling=tiling, q_segment_ids=ids, kv_segment_ids=ids)


def test_vmap_and_unbatched():
    q = jax.random.normal(jax.random.key(1), (3, 2, 100, 64), jnp.bfloat16)
    mask = masks.Causal()
    tri = bsa.BlockSparseAttention(mask=mask, kernel=TritonBlockSparse())
    ref = bsa.BlockSparseAttention(mask=mask, kernel=DenseReference())
    out = jax.jit(jax.vmap(lambda x: tri(x, x, x)))(q)
    want = jax.vmap(lambda x: ref(x, x, x))(q.astype(jnp.float32))
    assert _rel(out, want) < TOL[jnp.bfloat16]
    g = jax.grad(lambda x: jnp.sum(jax.vmap(lambda y: tri(y, y, y))(x).astype(jnp.float32)))(q)
    gr = jax.grad(lambda x: jnp.sum(jax.vmap(lambda y: ref(y, y, y))(x)))(q.astype(jnp.float32))
    assert _rel(g, gr) < TOL[jnp.bfloat16]


def test_vmap_folds_segment_ids_bias_and_groups():
    # Unbatched GQA calls mapped with their own segment ids (layouts built per element) and
    # bias; the launches run once on the folded batch. Forward and every gradient.
    ks = jax.random.split(jax.random.key(4), 5)
    n, heads, length = 3, 4, 200
    q = jax.random.normal(ks[0], (n, heads, length, 64), jnp.float32)
    k = jax.random.normal(ks[1], (n, 2, length, 64), jnp.float32)
    v = jax.random.normal(ks[2], (n, 2, length, 64), jnp.float32)
    bias = jax.random.normal(ks[3], (n, 1, length, length), jnp.float32)
    ids = _segments(_RNG, n, length, 3, pad=5)
    mask = masks.Causal() & masks.Document()

    def run(kernel, dtype):
        attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel)

        def loss(q, k, v, b):
            one = lambda q, k, v, s, b: attn(q.astype(dtype), k.astype(dtype), v.astype(dtype),  # noqa: E731
                                            q_segment_ids=s, kv_segment_ids=s, bias=b)
            out = jax.vmap(one)(q, k, v, ids, b).astype(jnp.float32)
            return jnp.sum(out * jnp.cos(out)), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
            q, k, v, bias)
        return out, grads

    out, grads = run(TritonBlockSparse(), jnp.bfloat16)
    want, want_grads = run(DenseReference(), jnp.float32)
    assert _rel(out, want) < TOL[jnp.bfloat16]
    for g, w in zip(grads, want_grads):
        assert _rel(g, w) < TOL[jnp.bfloat16]


def test_selected_on_gpu():
    features = bsa.Features(platform="gpu", dtype="bfloat16", segment_ids=True)
    choice = bsa.select_kernel(masks.Causal() & masks.Document(), "gpu", features)
    assert isinstance(choice.kernel, TritonBlockSparse), choice.explain()


def test_declines_bitmap_mask_with_positions():
    features = bsa.Features(platform="gpu", positions=True)
    why = TritonBlockSparse().decline_reason(masks.Causal() & masks.Dilated(2), features)
    assert why is not None and "bitmaps" in why


def test_fused_backward_warns():
    q = jax.random.normal(jax.random.key(2), (1, 2, 64, 64), jnp.bfloat16)
    attn = bsa.BlockSparseAttention(mask=masks.Causal(),
                                    kernel=TritonBlockSparse(fused_backward=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attn(q, q, q)
    assert any("split backward" in str(w.message) for w in caught)
