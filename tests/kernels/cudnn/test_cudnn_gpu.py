"""`CudnnDense` on a GPU: the selector picks it where cuDNN expresses the mask.

GPU only: every test skips unless JAX's default backend is a GPU. The launch itself is checked
against the float64 oracle by the conformance suite (`tests/test_conformance.py`); the mask
translation and the decline reasons by `tests/kernels/cudnn/test_cudnn.py` on the CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks
from tests.conftest import take_as_proven

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]


def test_selected_on_gpu_for_causal():
    q = jnp.ones((1, 2, 256, 64), jnp.bfloat16)
    attn = bsa.BlockSparseAttention(mask=masks.Causal())
    assert attn.plan(q, q, q).kernel.name == "cudnn"
    sparse = bsa.BlockSparseAttention(mask=masks.Causal() & masks.ChunkedCausal(128))
    assert sparse.plan(q, q, q).kernel.name != "cudnn"


@pytest.mark.parametrize("dim", [192, 256])
@pytest.mark.parametrize("window", [None, 300], ids=["causal", "window_300"])
def test_head_dims_over_128_on_hopper(monkeypatch, dim, window):
    """Head dims 192 and 256 (which cuDNN takes on Hopper): forward and every gradient against
    the float32 dense reference at a length of 1024, and the selector's choice of cuDNN."""
    from eqx_bsattn.strategies.kernels import cudnn

    take_as_proven(cudnn.CudnnDense, "wide_heads", monkeypatch=monkeypatch)
    why = cudnn.head_dim_decline(dim)
    if why is not None:  # a GPU before Hopper
        pytest.skip(why)
    mask = masks.Causal() if window is None else masks.Causal() & masks.SlidingWindow(window, 0)
    keys = jax.random.split(jax.random.key(dim), 4)
    q, k, v, cot = (jax.random.normal(key, (2, 4, 1024, dim), jnp.float32) for key in keys)

    def run(kernel, dtype):
        attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel)

        def loss(q, k, v):
            out = attn(q.astype(dtype), k.astype(dtype), v.astype(dtype))
            return jnp.sum(out.astype(jnp.float32) * cot), out

        grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out, *grads)

    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    assert bsa.BlockSparseAttention(mask=mask).plan(*half).kernel.name == "cudnn"
    got = run(bsa.kernels.CudnnDense(), jnp.bfloat16)
    want = run(bsa.kernels.DenseReference(), jnp.float32)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), name
        err = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert err < 2e-2, f"{name}: relative error {err:.3g} at head dim {dim}"
