"""`CudnnDense` on a GPU: the selector picks it where cuDNN expresses the mask.

GPU only: every test skips unless JAX's default backend is a GPU. The launch itself is checked
against the float64 oracle by the conformance suite (`tests/test_conformance.py`); the mask
translation and the decline reasons by `tests/kernels/cudnn/test_cudnn.py` on the CPU.
"""

import jax
import jax.numpy as jnp
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks

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
