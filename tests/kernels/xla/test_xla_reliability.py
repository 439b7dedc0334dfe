"""`XlaBlockSparse` against the float64 oracle where it failed: the bfloat16 gradients of score
terms that sum ``dS`` along a query row, the gradient of a per-key bias with grouped query
heads (a process crash), and a bias under ``jax_enable_x64`` (a dtype error).

The first: the forward rounds ``p`` to the value dtype for ``p @ v``, and the backward's
``delta = rowsum(dO * O)`` read that output while its ``dS = p (dp - delta)`` recomputes ``p``
in float32, so each row's ``dS`` summed to ``dO . (O - O_exact)`` instead of zero. A gradient
that sums ``dS`` along rows (a per-query or per-head bias, whose true value is about zero;
learned ALiBi slopes; a T5 bucket table) was that noise: 6e-4 to 1e-2 of its scale in the
cases below on a CPU (ALiBi's: 1.5e-2 on a TPU v5e), where `DenseReference` in bfloat16 is
within 2e-6. The forward now also returns the output of the float32 ``p``, which the
backward's delta reads (`strategies/kernels/xla.py`, `_forward`).

The crash and the x64 case run in a child process, so that a segfault fails one test instead
of ending the run.
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
from tests.conftest import jnp_attention_f64, score_f64

ROOT = Path(__file__).resolve().parents[3]

# ---------------------------------------------------------------------------------------------
# bfloat16: gradients that sum dS along a row.

B, H, HKV, L, D = 1, 2, 1, 256, 16
TILING = bsa.Tiling(block_q=64, block_kv=64)
#: Of the gradient's scale (for the per-query bias, of a per-key bias's gradient). Measured
#: (per-query bias, ALiBi slopes, T5 table): 5.6e-4, 1.0e-2, 6.4e-4 before; 5.8e-7, 8.2e-6,
#: 1.8e-6 now; `DenseReference` 3.3e-8, 1.4e-6, 1.3e-6.
TOL = 1e-4


def _normal(seed, shape, dtype=jnp.bfloat16, scale=1.0):
    """Standard normals (NumPy's: no program to compile) times `scale`, in `dtype`."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def _bf16_inputs():
    q = _normal(10, (B, H, L, D))
    k = _normal(11, (B, HKV, L, D))
    v = _normal(12, (B, HKV, L, D))
    cot = _normal(13, (B, H, L, D))
    return q, k, v, cot


def _arrays():
    """The differentiated arrays: the biases bfloat16, the score arrays float32."""
    return {
        "per_query_bias": _normal(14, (1, H, L, 1)),
        "per_key_bias": _normal(15, (1, H, 1, L)),
        "alibi_slopes": _normal(16, (H,), jnp.float32, 0.1),
        "t5_table": _normal(17, (H, 32), jnp.float32, 0.5),
    }


def _kernel_grad(kernel, name, x, q, k, v, cot):
    def loss(x):
        bias = x if name.endswith("bias") else None
        score = (scores.ALiBi(x, learned=True) if name == "alibi_slopes"
                 else scores.RelativePositionBias(x) if name == "t5_table" else None)
        tiling = TILING if isinstance(kernel, kernels.XlaBlockSparse) else None
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernel, score=score,
                                        tiling=tiling)
        out = attn(q, k, v, bias=bias)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

    return np.asarray(jax.jit(jax.grad(loss))(x), np.float64)


def _oracle_grad(name, x, q, k, v, cot):
    f64 = lambda a: jnp.asarray(np.asarray(jnp.asarray(a, jnp.float32), np.float64))  # noqa: E731
    pos = np.arange(L)[None]
    visible = np.tril(np.ones((L, L), bool))
    with jax.enable_x64(True):
        q, k, v, cot = (f64(a) for a in (q, k, v, cot))
        x = jax.tree.map(f64, x)

        def loss(x):
            # A per-query bias is differentiated with a per-key one beside it: the latter's
            # gradient gives the former's scale, in the same program.
            bias = x[0] + x[1] if name == "per_query_bias" else None
            score = None
            if name == "alibi_slopes":
                score = lambda s: score_f64(s, q_pos=pos, kv_pos=pos, slopes=x)  # noqa: E731
            if name == "t5_table":
                score = lambda s: score_f64(s, q_pos=pos, kv_pos=pos, table=x)  # noqa: E731
            return jnp.sum(jnp_attention_f64(q, k, v, visible, bias=bias, score=score) * cot)

        return jax.tree.map(np.asarray, jax.jit(jax.grad(loss))(x))


@functools.cache
def _oracle(name):
    """The float64 gradient of `name` (`_arrays`) at `_bf16_inputs`, and its scale."""
    q, k, v, cot = _bf16_inputs()
    arrays = _arrays()
    if name != "per_query_bias":
        want = _oracle_grad(name, arrays[name], q, k, v, cot)
        return want, np.max(np.abs(want))
    # Its true gradient is zero (up to the oracle's rounding): measured against the gradient
    # of a per-key bias, whose terms are the same dS.
    want, per_key = _oracle_grad(name, (arrays[name], arrays["per_key_bias"]), q, k, v, cot)
    scale = np.max(np.abs(per_key))
    assert np.max(np.abs(want)) < 1e-9 * scale
    return want, scale


@pytest.mark.parametrize("kernel", ["XlaBlockSparse", "DenseReference"])
@pytest.mark.parametrize("name", ["per_query_bias", "alibi_slopes", "t5_table"])
def test_bfloat16_row_sum_gradients_match_the_float64_oracle(name, kernel):
    q, k, v, cot = _bf16_inputs()
    arrays = _arrays()
    got = _kernel_grad(getattr(kernels, kernel)(), name, arrays[name], q, k, v, cot)
    want, scale = _oracle(name)
    err = np.max(np.abs(got - want)) / scale
    assert np.all(np.isfinite(got)) and err <= TOL, (name, kernel, err)


# ---------------------------------------------------------------------------------------------
# Child processes: a per-key bias's gradient with grouped query heads, and x64.

#: Computes, for each bias shape, each kernel's output and its gradients in q, k, v and the
#: bias (of ``<out, cot>``) and the float64 oracle's; prints the largest errors as JSON, each
#: of its array's scale (at least 1: a per-query or per-head bias's true gradient is zero).
_CHILD = """
import json, sys
import numpy as np
import jax, jax.numpy as jnp
import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
from tests.conftest import jnp_attention_f64

def normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)

kernel_names, shapes, argnums = (json.loads(x) for x in sys.argv[1:4])
argnums = tuple(argnums)
b, h, hkv, length, dim = 2, 4, 2, 64, 8
q = normal(20, (b, h, length, dim))
k = normal(21, (b, hkv, length, dim))
v = normal(22, (b, hkv, length, dim))
cot = normal(23, (b, h, length, dim))
visible = np.tril(np.ones((length, length), bool))
errors = {}
for n, shape in enumerate(shapes):
    bias = normal(24 + n, shape)
    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))
        def oracle(q, k, v, bias):
            return jnp.sum(jnp_attention_f64(q, k, v, visible, bias=bias) * f64(cot))
        want = jax.jit(jax.grad(oracle, argnums))(f64(q), f64(k), f64(v), f64(bias))
        want_out = jnp_attention_f64(f64(q), f64(k), f64(v), visible, bias=f64(bias))
    for name in kernel_names:
        tiling = bsa.Tiling(16, 16) if name == "XlaBlockSparse" else None
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=getattr(kernels, name)(),
                                        tiling=tiling)
        out = attn(q, k, v, bias=bias)
        got = jax.jit(jax.grad(lambda q, k, v, bias: jnp.sum(attn(q, k, v, bias=bias) * cot),
                               argnums))(q, k, v, bias)
        def rel(a, e):  # of the array's scale, at least 1 (a row bias's gradient is ~0)
            a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
            assert a.shape == e.shape and np.all(np.isfinite(a)), (a.shape, e.shape)
            return float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1.0))
        assert out.dtype == q.dtype and got[-1].dtype == bias.dtype, (out.dtype, got[-1].dtype)
        errors[f"{name} {shape}"] = [rel(out, want_out)] + [rel(g, w) for g, w in zip(got, want)]
print("ERRORS " + json.dumps(errors))
"""


def _run_child(kernel_names, shapes, argnums, **env):
    """The child's errors by ``"kernel shape"``: the output's, then the gradients' in the
    arguments `argnums` of ``(q, k, v, bias)``; a crash (a signal) or an exception fails the
    calling test with the child's output."""
    args = (kernel_names, shapes, argnums)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *(json.dumps(x) for x in args)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=600)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, f"child exited with {done.returncode}:\n{tail}"
    line = [x for x in done.stdout.splitlines() if x.startswith("ERRORS ")]
    assert line, tail
    return json.loads(line[-1][len("ERRORS "):])


@pytest.mark.slow
def test_per_key_bias_gradient_with_grouped_heads_runs_and_matches_the_oracle():
    """A bias without a query axis (``[B, 1, 1, Lk]``, ``[1, 1, 1, Lk]``, ``[B, H, 1, Lk]``)
    and H = 4 query heads on 2 kv heads. Its gradient, each key's sum of dS, was a sum over
    the query axis of the block under the kernel's four `vmap` levels: a rank-7 reduction of
    a middle axis fused with the dp product, which jaxlib 0.10.2's CPU backend hands to
    YNNPACK; with 13 CPU threads the process died of SIGSEGV (with 2 it ran). The kernel now
    takes that sum as a product with ones."""
    b, h, length = 2, 4, 64
    shapes = [[b, 1, 1, length], [1, 1, 1, length], [b, h, 1, length]]
    errors = _run_child(["XlaBlockSparse"], shapes, [3])
    for case, errs in errors.items():
        assert max(errs) <= 1e-5, (case, errs)


@pytest.mark.slow
def test_bias_under_x64_matches_the_oracle():
    """With ``JAX_ENABLE_X64=1`` a bias's block slice started at a Python 0 (int64 there) and
    a traced int32 index, and XlaBlockSparse raised "lax.concatenate requires arguments to
    have the same dtypes"; forward and gradients of both CPU kernels, every bias kind."""
    b, h, length = 2, 4, 64
    shapes = [[b, h, length, length], [1, 1, 1, length], [b, h, length, 1], [1, h, 1, 1]]
    errors = _run_child(["XlaBlockSparse", "DenseReference"], shapes, [0, 1, 2, 3],
                        JAX_ENABLE_X64="1")
    assert len(errors) == 2 * len(shapes)
    for case, errs in errors.items():
        assert max(errs) <= 1e-5, (case, errs)
