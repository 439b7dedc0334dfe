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
from tests import test_conformance as conformance

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


# ---------------------------------------------------------------------------------------------
# Score terms in the kernels.

#: The conformance suite's score cases that Triton evaluates (ALiBi, relative bias), and the
#: ones it declines (a jnp score function).
_SCORE_CASES = sorted(n for n, c in conformance.CASES.items() if c.score not in (None, "function"))
_FUNCTION_CASES = sorted(n for n, c in conformance.CASES.items() if c.score == "function")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("case_name", _SCORE_CASES)
def test_score_terms_against_the_oracle(case_name, dtype):
    """Forward and every gradient (q, k, v, bias, sinks, slopes, table) of each score case, in
    each dtype, against the float64 oracle with the conformance suite's tolerances."""
    conformance.check_conforms(TritonBlockSparse(), case_name, dtype)


@pytest.mark.parametrize("case_name", _FUNCTION_CASES)
def test_score_function_declines(case_name):
    case = conformance.CASES[case_name]
    built = conformance.build(case, "bfloat16")
    why = conformance._decline(case, TritonBlockSparse(), built)
    assert why is not None and "score terms function" in why


def test_score_terms_vmap_folds_and_maps_learned_arrays():
    """A shared learned table under `jax.vmap` over q, k, v (the launches fold the mapped
    axis), and ALiBi slopes mapped with the inputs (one launch per element): outputs and every
    gradient against the reference."""
    ks = jax.random.split(jax.random.key(7), 5)
    n, heads, length = 3, 4, 200
    q = jax.random.normal(ks[0], (n, heads, length, 64), jnp.float32)
    k = jax.random.normal(ks[1], (n, 2, length, 64), jnp.float32)
    v = jax.random.normal(ks[2], (n, 2, length, 64), jnp.float32)
    table = 0.3 * jax.random.normal(ks[3], (heads, 32), jnp.float32)
    slopes = 0.1 * jax.random.normal(ks[4], (n, heads), jnp.float32)
    mask = masks.Causal() & masks.SlidingWindow(90, 0)

    def run(kernel, dtype):
        def attn(score):
            return bsa.BlockSparseAttention(mask=mask, kernel=kernel, score=score)

        def loss(q, k, v, table, slopes):
            cast = lambda x: x.astype(dtype)  # noqa: E731
            relative = attn(bsa.scores.RelativePositionBias(table, bidirectional=False))
            shared = jax.vmap(lambda q, k, v: relative(cast(q), cast(k), cast(v)))(q, k, v)
            each = jax.vmap(lambda q, k, v, s: attn(bsa.scores.ALiBi(s, learned=True))(
                cast(q), cast(k), cast(v)))(q, k, v, slopes)
            out = shared.astype(jnp.float32) + each.astype(jnp.float32)
            return jnp.sum(out * jnp.cos(out)), out

        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True))(
            q, k, v, table, slopes)

    (_, out), grads = run(TritonBlockSparse(), jnp.float16)
    with jax.default_matmul_precision("highest"):
        (_, want), want_grads = run(DenseReference(), jnp.float32)
    assert _rel(out, want) < TOL[jnp.float16]
    for name, g, w in zip(("q", "k", "v", "table", "slopes"), grads, want_grads):
        assert np.abs(np.asarray(w)).max() > 0, name
        assert _rel(g, w) < TOL[jnp.float16], name


def test_selected_for_relative_bias_on_gpu():
    """A table goes to Triton (Mosaic evaluates ALiBi alone, and takes that: its own tests)."""
    for kinds in (("relative_bias",), ("alibi", "relative_bias")):
        features = bsa.Features(platform="gpu", dtype="bfloat16", score=kinds)
        choice = bsa.select_kernel(masks.Causal(), "gpu", features)
        assert isinstance(choice.kernel, TritonBlockSparse), choice.explain()


@pytest.mark.parametrize("bidirectional", [False, True])
def test_relative_bias_at_the_default_tiles(bidirectional):
    """A relative-bias table at head dim 128 and the default 128-wide tiles with three stages,
    where a gathered [rows, cols] table tile would be pipelined past the 227 KiB of shared
    memory: the launch starts, and output and every gradient match the reference."""
    ks = jax.random.split(jax.random.key(11), 4)
    heads, length = 2, 1024
    q, k, v = (jax.random.normal(x, (1, heads, length, 128), jnp.float32) for x in ks[:3])
    table = 0.5 * jax.random.normal(ks[3], (heads, 32), jnp.float32)
    mask = masks.Causal() if not bidirectional else masks.SlidingWindow(300, 300)

    def run(kernel, dtype):
        def loss(q, k, v, table):
            score = bsa.scores.RelativePositionBias(table, bidirectional=bidirectional)
            out = bsa.BlockSparseAttention(mask=mask, kernel=kernel, score=score)(
                q.astype(dtype), k.astype(dtype), v.astype(dtype)).astype(jnp.float32)
            return jnp.sum(out * jnp.cos(out)), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
            q, k, v, table)

    (_, out), grads = run(TritonBlockSparse(), jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        (_, want), want_grads = run(DenseReference(), jnp.float32)
    assert _rel(out, want) < TOL[jnp.bfloat16]
    for name, g, w in zip(("q", "k", "v", "table"), grads, want_grads):
        assert np.abs(np.asarray(w)).max() > 0, name
        assert _rel(g, w) < TOL[jnp.bfloat16], name
