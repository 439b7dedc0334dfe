"""`MosaicBlockSparse` on a Hopper GPU with a bias: forward and every gradient (q, k, v and
the bias) against the float64 oracle for biases per head (shared by the batch), per batch
row and per both, in float32 and bfloat16, under a causal mask, a causal window and a mask
without terms beside ALiBi and a soft cap, with pairs and a whole row hidden by -inf;
bit-identical gradients over two runs; the forward alone with a constant bias; and the
selector's choice of this kernel once a bias has run.

They passed on the H200 on 2026-12-06 (5 of 5). They skip unless JAX's default backend is
a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks, scores
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse
from tests.conftest import jnp_attention_f64, np_visibility, score_f64
from tests.kernels.mosaic.test_mosaic_gpu import TOL, _inputs, _rel, on_gpu

#: Batch, query heads, kv heads, length (ragged: not a multiple of the tiles), head dim.
B, H, HKV, L, D = 2, 4, 2, 1000, 128


def _alibi_slopes():
    return np.asarray(scores.ALiBi().compile(H).slopes, np.float64)


#: name: (mask, bias's leading shape, bias dtype, module options)
CASES = {
    "causal_head_bias_f32": (masks.Causal(), (1, H), jnp.float32, {}),
    "window_batch_bias_bf16": (masks.Causal() & masks.SlidingWindow(300, 0), (B, 1),
                               jnp.bfloat16, {}),
    "predicate_alibi_cap": (masks.Predicate(lambda q, k: (k <= q) & ((q - k) % 3 != 1)),
                            (B, H), jnp.bfloat16,
                            dict(score=scores.ALiBi(), logits_soft_cap=20.0)),
}


def _bias(shape, dtype):
    """A random bias with pairs hidden (-inf) in the last head and row 7 of the first hidden
    wholly."""
    bias = 2.0 * jax.random.normal(jax.random.key(9), (*shape, L, L), jnp.float32)
    bias = bias.at[0, -1, 100:140, :500].set(-jnp.inf)
    bias = bias.at[0, 0, 7].set(-jnp.inf)
    return bias.astype(dtype)


def _mosaic_run(case, deterministic=True, bias_grad=True):
    """``(out, dq, dk, dv[, dbias])`` of the case through `MosaicBlockSparse`, bfloat16."""
    mask, shape, dtype, options = CASES[case]
    q, k, v, cot = _inputs(61, B, H, HKV, L, L, D)
    attn = bsa.BlockSparseAttention(mask=mask, kernel=MosaicBlockSparse(
        deterministic=deterministic), **options)

    def f(q, k, v, bias):
        return attn(*(x.astype(jnp.bfloat16) for x in (q, k, v)), bias=bias)

    def both(q, k, v, bias):
        if not bias_grad:
            out, pullback = jax.vjp(lambda q, k, v: f(q, k, v, bias), q, k, v)
        else:
            out, pullback = jax.vjp(f, q, k, v, bias)
        return (out, *pullback(cot.astype(out.dtype)))

    return jax.jit(both)(q, k, v, _bias(shape, dtype))


def _oracle(case):
    """The float64 oracle's output and gradients on the rounded inputs (the -inf pairs
    hidden by the mask, so that a row they hide wholly gives zeros)."""
    mask, shape, dtype, options = CASES[case]
    q, k, v, cot = _inputs(61, B, H, HKV, L, L, D)
    bias = np.asarray(_bias(shape, dtype).astype(jnp.float32), np.float64)
    finite = np.isfinite(bias)
    cap = options.get("logits_soft_cap")
    # A soft cap follows the bias and turns -inf into -cap (docs/reliability.md): nothing is
    # hidden then; -1e4 saturates the cap as -inf does.
    visible = np_visibility(mask, batch=B, heads=H, q_len=L, kv_len=L) & (finite | bool(cap))
    positions = np.broadcast_to(np.arange(L), (B, L))

    def f64(x):
        return jnp.asarray(np.asarray(jnp.asarray(x, jnp.float32), np.float64))

    with jax.enable_x64(True):
        def attend(q, k, v, bias):
            score = None
            if "score" in options:
                def score(s):
                    return score_f64(s, q_pos=positions, kv_pos=positions,
                                     slopes=jnp.asarray(_alibi_slopes()))
            return jnp_attention_f64(q, k, v, visible,
                                     bias=jnp.where(finite, bias, -1e4 if cap else 0.0),
                                     score=score, soft_cap=cap)

        args = [f64(x.astype(jnp.bfloat16)) for x in (q, k, v)]
        out, pullback = jax.vjp(attend, *args, jnp.asarray(bias))
        grads = pullback(f64(cot.astype(jnp.bfloat16)))
        return jax.tree.map(np.asarray, (out, *grads))


@on_gpu
@pytest.mark.parametrize("case", list(CASES))
def test_bias_matches_float64_oracle(case):
    """Output and the gradients in q, k, v and the bias against the float64 oracle within
    bfloat16's tolerance; a row the bias hides wholly gives zeros; the selector gives such
    a call to this kernel."""
    mask, shape, dtype, options = CASES[case]
    x = jnp.zeros((B, H, L, D), jnp.bfloat16)
    plan = bsa.BlockSparseAttention(mask=mask, **options).plan(
        x, x[:, :HKV], x[:, :HKV], bias=jnp.zeros((*shape, L, L), dtype))
    assert plan.choice.kernel.name == "mosaic", plan.choice.explain()
    got = _mosaic_run(case)
    want = _oracle(case)
    if "logits_soft_cap" not in options:  # under a cap a -inf bias hides nothing
        assert np.abs(np.asarray(got[0], np.float32)[0, 0, 7]).max() == 0.0
    for name, g, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert g.shape == w.shape, name
        assert _rel(g, w) < TOL[jnp.bfloat16], name


@on_gpu
def test_bias_gradients_are_bit_identical():
    """Two runs give bit-identical outputs and gradients, the bias's included (each block's
    dS written once, the batch's sum in a fixed order: no atomics)."""
    runs = [[np.asarray(x) for x in _mosaic_run("causal_head_bias_f32")] for _ in range(2)]
    for a, c in zip(*runs):
        assert np.array_equal(a, c)


@on_gpu
def test_constant_bias_and_single_pass():
    """A bias that is not differentiated gives the same output and q, k, v gradients as one
    that is, and the kernel's single-pass mode, which takes the two launches for a bias,
    too."""
    case = "window_batch_bias_bf16"
    full = _mosaic_run(case)
    for got in (_mosaic_run(case, bias_grad=False),
                _mosaic_run(case, deterministic=False, bias_grad=False)):
        assert len(got) == 4
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, full):
            assert _rel(g, w) < 1e-6, name
