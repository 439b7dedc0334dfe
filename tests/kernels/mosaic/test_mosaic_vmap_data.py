"""`jax.vmap` over a call of `MosaicBlockSparse` whose score function or mask predicate reads
arrays (`strategies/kernels/mosaic/data.py`): over q, k and v with the arrays unbatched,
over the arrays with q, k and v unbatched, and over both. Each call runs its launches in
Pallas' CPU interpreter for Mosaic GPU on a CPU, and on a Hopper GPU where JAX's backend is
one (`mosaic_device`), and is checked against the float64 oracle, example by example.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks, scores
from eqx_bsattn._score import ScoreTerms
from eqx_bsattn._score_alibi import as_alibi
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse
from tests.conftest import (alibi_gradient_scale, jnp_attention_f64, random_array, rel_err,
                            score_f64, widths_by_head)

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

HEADS, LENGTH, DIM = 2, 128, 64
#: Two examples' slopes per head (of `alibi`), one row each.
MANY_SLOPES = jnp.asarray([[0.25, -0.1], [-0.3, 0.05]], jnp.float32)
#: Two examples' window widths per head (int32), one row each.
MANY_WIDTHS = jnp.asarray([[30, 120], [90, 7]], jnp.int32)


def _qkv(seed, lead):
    """bf16 q, k, v ``[*lead, H, L, D]``, random."""
    return tuple(random_array(seed + i, (*lead, HEADS, LENGTH, DIM), jnp.bfloat16)
                 for i in range(3))


def alibi(s, h, qp, kp, slopes):
    """Symmetric ALiBi, ``s - slopes[h] * |k - q|``: ALiBi on the causal pairs, run as a
    score function reading `slopes` (ALiBi itself would become built-in ALiBi: `as_alibi`)."""
    return s - slopes[h] * jnp.abs(kp - qp).astype(s.dtype)


def learned_alibi(s, h, qp, kp, params):
    return alibi(s, h, qp, kp, params["slopes"])


def _oracle(q, k, v, *, fn=None, widths=None):
    """The float64 attention of one call ``[B, H, L, D]`` (call under
    ``jax.enable_x64``): causal, or the window of `widths` per head; the score function
    `fn(s, h, q_pos, k_pos)` where given, on the token indices."""
    q, k, v = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v))
    qi, ki = np.arange(LENGTH)[:, None], np.arange(LENGTH)[None, :]
    visible = (np.broadcast_to(ki <= qi, (HEADS, LENGTH, LENGTH)) if widths is None else
               np.stack([widths_by_head(qi, ki, np.asarray(widths), h) for h in range(HEADS)]))
    visible = np.broadcast_to(visible, (q.shape[0], HEADS, LENGTH, LENGTH))
    positions = np.broadcast_to(np.arange(LENGTH), (q.shape[0], LENGTH))
    score = None if fn is None else (
        lambda s: score_f64(s, q_pos=positions, kv_pos=positions, fn=fn))
    return jnp_attention_f64(q, k, v, visible, score=score)


def _f64(x):
    return jnp.asarray(np.asarray(x, np.float64))


@pytest.mark.slow
@pytest.mark.extended
def test_vmap_over_qkv_and_params_reading_the_batch_index(mosaic_device, launches):
    """vmap over q, k, v (a leading axis of 2, each ``[2, H, L, D]``) and over a score
    function's params (a temperature per batch row, ``params[batch]``; one row per example)
    while it closes over unbatched (symmetric) ALiBi slopes: each example's output and
    temperatures' gradient are its own call's, the batch index the row within that call's
    batch (docs/scores.md), against the float64 oracle; the arrays are read from the read
    tables."""
    slopes = MANY_SLOPES[0]
    temperatures = jnp.asarray([[1.5, 0.5], [0.25, 2.0]], jnp.float32)
    cot = random_array(5, (2, 2, HEADS, LENGTH, DIM))

    def fn(s, h, qp, kp, t, *, batch):
        return alibi(s, h, qp, kp, slopes) * t[batch]

    def call(t, q, k, v, cot):
        def attend(t):
            attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=MosaicBlockSparse(),
                                            score=scores.ScoreFunction(fn, t))
            return attn(q, k, v).astype(jnp.float32)

        out, pullback = jax.vjp(attend, t)
        return out, pullback(cot)[0]

    q, k, v = _qkv(1, (2, 2))
    out, dt = jax.vmap(call)(temperatures, q, k, v, cot)
    assert launches and all(data is not None and maps is None for *_, data, maps in launches)
    for i in range(2):
        def oracle(t, i=i):
            return jnp.concatenate([_oracle(
                q[i, b:b + 1], k[i, b:b + 1], v[i, b:b + 1],
                fn=lambda s, h, qp, kp, b=b: fn(s, h, qp, kp, t, batch=b)) for b in range(2)])

        with jax.enable_x64(True):
            want, pullback = jax.vjp(oracle, _f64(temperatures[i]))
            (want_dt,) = pullback(_f64(cot[i]))
        assert rel_err(out[i], want) < 1e-2, i
        assert rel_err(dt[i], want_dt) < 2e-2, i


@pytest.mark.slow
@pytest.mark.extended
def test_vmap_over_params_slopes_with_unbatched_qkv(mosaic_device):
    """vmap over a `ScoreFunction`'s params (symmetric ALiBi slopes, one row per example),
    q, k, v unbatched: each example's output and slopes' gradient are its own slopes'
    (float64 oracle; the gradient within bfloat16's 2e-2 of its value plus 1e-4 of the
    magnitude of the terms it sums, as tests/kernels/mosaic/test_mosaic_data_gpu.py checks
    it)."""
    q, k, v = _qkv(4, (1,))
    cot = random_array(9, (2, 1, HEADS, LENGTH, DIM))

    def call(slopes, cot):
        def attend(slopes):
            attn = bsa.BlockSparseAttention(
                mask=masks.Causal(), kernel=MosaicBlockSparse(),
                score=scores.ScoreFunction(learned_alibi, {"slopes": slopes}))
            return attn(q, k, v).astype(jnp.float32)

        out, pullback = jax.vjp(attend, slopes)
        return out, pullback(cot)[0]

    out, dslopes = jax.vmap(call)(MANY_SLOPES, cot)
    for i in range(2):
        # The kernel's output is bfloat16, so it takes the cotangent rounded to bfloat16.
        cot_i = cot[i].astype(jnp.bfloat16)
        with jax.enable_x64(True):
            want, pullback = jax.vjp(lambda sl: _oracle(q, k, v, fn=lambda s, h, qp, kp: alibi(
                s, h, qp, kp, sl)), _f64(MANY_SLOPES[i]))
            (want_ds,) = pullback(_f64(cot_i.astype(jnp.float32)))
        assert rel_err(out[i], want) < 1e-2, i
        # The slopes' gradient sums dS (k - q) over the visible pairs and cancels far below
        # its terms; bfloat16 errs in proportion to them.
        error = np.abs(np.asarray(dslopes[i], np.float64) - np.asarray(want_ds))
        scale = alibi_gradient_scale(q, k, v, cot_i, MANY_SLOPES[i])
        assert np.all(error <= 2e-2 * np.abs(np.asarray(want_ds)) + 1e-4 * scale), (
            i, dslopes[i], want_ds, scale)


@pytest.mark.slow
@pytest.mark.extended
def test_vmap_over_predicate_widths(mosaic_device, launches):
    """vmap over a `Predicate`'s per-head widths (one row per example), q, k, v unbatched:
    each example's output uses its own window (float64 oracle), its widths read from the
    read tables (no element map)."""
    q, k, v = _qkv(7, (1,))

    def call(widths):
        attn = bsa.BlockSparseAttention(mask=masks.Predicate(widths_by_head, widths),
                                        kernel=MosaicBlockSparse())
        return attn(q, k, v)

    out = jax.vmap(call)(MANY_WIDTHS)
    assert launches and all(data is not None and maps is None for *_, data, maps in launches)
    for i in range(2):
        with jax.enable_x64(True):
            want = _oracle(q, k, v, widths=MANY_WIDTHS[i])
        assert rel_err(out[i], want) < 1e-2, i


@pytest.mark.slow
def test_vmapped_calls_lower_for_cuda(hopper_host):
    """`jit(vmap)` over a score function's params (with the gradient in them and in q, k,
    v unbatched) and over a `Predicate`'s widths lowers for CUDA: Pallas Mosaic GPU's own
    vmap rule of each launch (a grid axis in front, each mapped operand sliced per example),
    the same rule the interpreter tests above run. The score function runs as one (its
    slopes read in-kernel), not as built-in ALiBi."""
    q, k, v = _qkv(1, (1,))
    terms = ScoreTerms(function=learned_alibi, params={"slopes": MANY_SLOPES[0]})
    assert as_alibi(terms, HEADS).function is not None

    def loss(slopes, q, k, v):
        attn = bsa.BlockSparseAttention(
            mask=masks.Causal(), kernel=MosaicBlockSparse(),
            score=scores.ScoreFunction(learned_alibi, {"slopes": slopes}))
        return jnp.sum(attn(q, k, v).astype(jnp.float32))

    grads = jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3)), (0, None, None, None))
    lowered = jax.jit(grads).trace(MANY_SLOPES, q, k, v).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("custom_call @mosaic_gpu") == 3
    shapes = [o.shape for o in jax.tree.leaves(lowered.out_info)]
    assert shapes == [MANY_SLOPES.shape] + [(2, *q.shape)] * 3

    def forward(widths):
        attn = bsa.BlockSparseAttention(mask=masks.Predicate(widths_by_head, widths),
                                        kernel=MosaicBlockSparse())
        return attn(q, k, v)

    lowered = jax.jit(jax.vmap(forward)).trace(MANY_WIDTHS).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().count("custom_call @mosaic_gpu") == 1
    assert [o.shape for o in jax.tree.leaves(lowered.out_info)] == [(2, *q.shape)]
