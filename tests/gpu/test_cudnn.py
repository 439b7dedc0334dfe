"""`CudnnDense` against `DenseReference` (float32) on a GPU: forward and every gradient.

GPU only: every test skips unless JAX's default backend is a GPU. The CPU tests
(`tests/test_cudnn.py`) cover the mask translation and the decline reasons; these check that the
launch itself computes the same attention as the reference, and that the selector picks it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks
from eqx_bsattn.strategies.kernels import CudnnDense, DenseReference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def _rel(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    assert np.all(np.isfinite(a)), "non-finite values"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


MASKS = {
    "full": masks.Full(),
    "causal": masks.Causal(),
    "causal_window": masks.Causal() & masks.SlidingWindow(100, 0),
    "causal_window_open_left": masks.Causal() & masks.SlidingWindow(None, 5),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("shape", [(2, 4, 4, 300, 64), (1, 8, 2, 1024, 128)],
                         ids=["mha_ragged", "gqa"])
def test_matches_reference(name, dtype, shape):
    batch, heads, kv_heads, length, dim = shape
    mask = MASKS[name]
    ks = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(ks[0], (batch, heads, length, dim), jnp.float32)
    k = jax.random.normal(ks[1], (batch, kv_heads, length, dim), jnp.float32)
    v = jax.random.normal(ks[2], (batch, kv_heads, length, dim), jnp.float32)
    cot = jax.random.normal(ks[3], (batch, heads, length, dim), jnp.float32)

    def run(kernel, q, k, v):
        attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel)
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(cot.astype(out.dtype))

    half = lambda x: x.astype(dtype)  # noqa: E731
    out, grads = jax.jit(lambda *a: run(CudnnDense(), *a))(half(q), half(k), half(v))
    with jax.default_matmul_precision("highest"):
        ref, ref_grads = jax.jit(lambda *a: run(DenseReference(), *a))(q, k, v)
    assert out.dtype == dtype
    errors = {"out": _rel(out, ref)}
    errors.update({n: _rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    bad = {n: e for n, e in errors.items() if not e <= TOL[dtype]}
    assert not bad, f"relative errors over {TOL[dtype]}: {errors}"


def test_selected_on_gpu_for_causal():
    q = jnp.ones((1, 2, 256, 64), jnp.bfloat16)
    attn = bsa.BlockSparseAttention(mask=masks.Causal())
    assert attn.plan(q, q, q).kernel.name == "cudnn"
    sparse = bsa.BlockSparseAttention(mask=masks.Causal() & masks.ChunkedCausal(128))
    assert sparse.plan(q, q, q).kernel.name != "cudnn"
