"""`TritonBlockSparse`'s own behaviour on a GPU: its vmap rule, its selection and what it
declines. Correctness on every mask family and feature is the conformance suite's
(`tests/test_conformance.py`).

GPU only: every test skips unless JAX's default backend is a GPU and jax-triton imports.
"""

import dataclasses
import importlib.util

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


_RNG = np.random.default_rng(0)


def test_vmap_and_unbatched():
    # Distinct q, k and v, so that a swap of the k and v gradients cannot pass.
    ks = jax.random.split(jax.random.key(1), 4)
    q, k, v = (jax.random.normal(kk, (3, 2, 100, 64), jnp.float32) for kk in ks[:3])
    cot = jax.random.normal(ks[3], (3, 2, 100, 64), jnp.float32)
    mask = masks.Causal()
    tri = bsa.BlockSparseAttention(mask=mask, kernel=TritonBlockSparse())
    ref = bsa.BlockSparseAttention(mask=mask, kernel=DenseReference())

    def run(attn, dtype):
        f = jax.vmap(lambda q, k, v: attn(q, k, v))
        out, pullback = jax.vjp(f, *(x.astype(dtype) for x in (q, k, v)))
        return (out, *pullback(cot.astype(dtype)))

    got = jax.jit(lambda: run(tri, jnp.bfloat16))()
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda: run(ref, jnp.float32))()
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel(g, w) < TOL[jnp.bfloat16], name


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
    """Triton where MosaicBlockSparse (priority 35, Hopper only) declines: float32 here,
    and every dtype on GPUs other than Hopper."""
    from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse

    mask = masks.Causal() & masks.Document()
    half = bsa.Features(platform="gpu", dtype="bfloat16", segment_ids=True)
    on_hopper = getattr(jax.devices()[0], "compute_capability", None) == "9.0"
    choice = bsa.select_kernel(mask, "gpu", half)
    expected = MosaicBlockSparse if on_hopper else TritonBlockSparse
    assert isinstance(choice.kernel, expected), choice.explain()
    single = dataclasses.replace(half, dtype="float32")
    choice = bsa.select_kernel(mask, "gpu", single)
    assert isinstance(choice.kernel, TritonBlockSparse), choice.explain()
    if on_hopper:
        assert "mosaic (35)" in choice.explain() and "float32" in choice.explain()


def test_declines_bitmap_mask_with_positions():
    features = bsa.Features(platform="gpu", positions=True)
    resolved = bsa.ResolvedMask(masks.Causal() & masks.Dilated(2), q_len=1, kv_len=1,
                                num_heads=1)
    why = TritonBlockSparse().decline_reason(resolved, features)
    assert why is not None and "bitmaps" in why
