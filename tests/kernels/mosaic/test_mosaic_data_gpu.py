"""`MosaicBlockSparse` on a Hopper GPU with score functions that read arrays: a closure's
slopes, learned slopes in `params` (symmetric ALiBi: ALiBi itself would run as built-in
slopes, `as_alibi`), and an int32 window table per head, read in-kernel
(strategies/kernels/mosaic/data.py). Forward and every gradient (q, k, v, and the slopes or
params) against the float64 oracle in both backward modes, bit-identical gradients over two
runs in the deterministic mode, and the selector's choice of this kernel for them. They
skip unless JAX's default backend is a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks, scores
from eqx_bsattn._score_alibi import as_alibi
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse
from tests.conftest import (alibi_gradient_scale, jnp_attention_f64, np_visibility, score_f64,
                            widths_by_head)
from tests.kernels.mosaic.test_mosaic_gpu import MODES, TOL, _inputs, _rel, on_gpu

#: Batch, query heads, kv heads, length (ragged: not a multiple of the tiles), head dim.
B, H, HKV, L, D = 2, 4, 2, 1000, 128
#: Steep slopes, so that the term shapes each row (and the slopes' gradient is large).
SLOPES = jnp.asarray([0.5, -0.25, 0.125, 0.0625], jnp.float32)
#: A window width per head (int32), read by `table_window`.
WIDTHS = jnp.asarray([40, 900, 7, 300], jnp.int32)


def alibi_term(s, h, qp, kp, slopes):
    """Symmetric ALiBi, ``s - slopes[h] * |k - q|``: ALiBi on the causal pairs, run as a
    score function (ALiBi itself, affine in the positions, would become built-in ALiBi)."""
    return s - slopes[h] * jnp.abs(kp - qp).astype(s.dtype)


def table_window(s, h, qp, kp):
    """Keys farther than the head's width hidden (-inf), plus a fixed ALiBi term."""
    s = s + 0.05 * (kp - qp).astype(s.dtype)
    return jnp.where(qp - kp > WIDTHS[h], -jnp.inf, s)


def _score(case, data):
    """The case's `ScoreFunction` reading `data` (the slopes, or params holding them)."""
    if case == "closure_alibi":
        return scores.ScoreFunction(lambda s, h, qp, kp: alibi_term(s, h, qp, kp, data))
    if case == "params_alibi":
        return scores.ScoreFunction(
            lambda s, h, qp, kp, p: alibi_term(s, h, qp, kp, p["slopes"]), data)
    return scores.ScoreFunction(table_window)


def _oracle_fn(case, data):
    """The case's function as the float64 oracle applies it (`score_f64`'s `fn`)."""
    if case == "closure_alibi":
        return lambda s, h, qp, kp: alibi_term(s, h, qp, kp, data)
    if case == "params_alibi":
        return lambda s, h, qp, kp: alibi_term(s, h, qp, kp, data["slopes"])
    return table_window


CASES = {"closure_alibi": SLOPES, "params_alibi": {"slopes": SLOPES}, "table_window": None}


def _mosaic_run(case, deterministic):
    """``(out, dq, dk, dv, ddata)`` of the case through `MosaicBlockSparse`, bfloat16."""
    q, k, v, cot = _inputs(51, B, H, HKV, L, L, D)
    kernel = MosaicBlockSparse(deterministic=deterministic)

    def f(q, k, v, data):
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernel,
                                        score=_score(case, data))
        return attn(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))

    def both(q, k, v, data):
        out, pullback = jax.vjp(f, q, k, v, data)
        return (out, *pullback(cot.astype(out.dtype)))

    return jax.jit(both)(q, k, v, CASES[case])


def _oracle(case):
    """The float64 oracle's output and gradients on the bfloat16-rounded inputs."""
    q, k, v, cot = _inputs(51, B, H, HKV, L, L, D)
    visible = np_visibility(masks.Causal(), batch=B, heads=H, q_len=L, kv_len=L)
    positions = np.broadcast_to(np.arange(L), (B, L))

    def f64(x):
        return jnp.asarray(np.asarray(jnp.asarray(x, jnp.float32), np.float64))

    with jax.enable_x64(True):
        def attend(q, k, v, data):
            def score(s):
                return score_f64(s, q_pos=positions, kv_pos=positions,
                                 fn=_oracle_fn(case, data))
            return jnp_attention_f64(q, k, v, visible, score=score)

        args = [f64(x.astype(jnp.bfloat16)) for x in (q, k, v)]
        data = jax.tree.map(f64, CASES[case])
        out, pullback = jax.vjp(attend, *args, data)
        grads = pullback(f64(cot.astype(jnp.bfloat16)))
        return jax.tree.map(np.asarray, (out, *grads))


def _slopes_gradient_scale():
    """`alibi_gradient_scale` of the ALiBi cases, on the bfloat16-rounded inputs: the
    slopes' gradient cancels far below its terms (by 1.3e4 at the head whose slope is
    negative: its rows are weighted to their far keys)."""
    q, k, v, cot = (x.astype(jnp.bfloat16) for x in _inputs(51, B, H, HKV, L, L, D))
    return alibi_gradient_scale(q, k, v, cot, SLOPES)


@on_gpu
@MODES
@pytest.mark.parametrize("case", sorted(CASES))
def test_data_function_matches_float64_oracle(case, deterministic):
    """Output and the gradients in q, k, v and the arrays read (slopes, params) against the
    float64 oracle, within bfloat16's tolerance; the selector gives such a call to this
    kernel (cuDNN, above it, declines score terms). The function runs as one (not rewritten
    to built-in ALiBi)."""
    score = _score(case, CASES[case])
    assert as_alibi(score.compile(H), H).function is not None
    x = jnp.zeros((B, H, L, D), jnp.bfloat16)
    plan = bsa.BlockSparseAttention(mask=masks.Causal(), score=score).plan(
        x, x[:, :HKV], x[:, :HKV])
    assert plan.choice.kernel.name == "mosaic", plan.choice.explain()
    got = _mosaic_run(case, deterministic)
    want = _oracle(case)
    names = ("out", "dq", "dk", "dv")
    for name, g, w in zip(names, got, want):
        assert _rel(g, w) < TOL[jnp.bfloat16], name
    if case == "table_window":  # an int32 table: no gradient
        assert got[4] is None and want[4] is None
        return
    # The slopes' gradient against its value and the magnitude of the terms it sums (as
    # test_mosaic_gpu.py checks the built-in ALiBi's at per-call positions).
    (g,), (w,) = jax.tree.leaves(got[4]), jax.tree.leaves(want[4])
    error = np.abs(np.asarray(g, np.float64) - w)
    scale = _slopes_gradient_scale()
    assert np.all(error <= TOL[jnp.bfloat16] * np.abs(w) + 1e-4 * scale), (g, w, scale)


@on_gpu
def test_data_gradients_are_bit_identical():
    """Two runs in the deterministic mode give bit-identical outputs and gradients, the
    slopes' and the params' included (each key's row summed, then each read's rows per head
    and batch row, in a fixed order: no atomics)."""
    for case in ("closure_alibi", "params_alibi"):
        runs = [[np.asarray(x) for x in jax.tree.leaves(_mosaic_run(case, True))]
                for _ in range(2)]
        for a, c in zip(*runs):
            assert np.array_equal(a, c), case


@on_gpu
def test_closure_alibi_matches_builtin_alibi():
    """A closure's symmetric ALiBi (a score function reading the slopes in-kernel) and the
    built-in ALiBi agree on a causal call (they agree on its pairs), forward and gradients,
    within bfloat16's tolerance."""
    q, k, v, cot = _inputs(52, B, H, HKV, L, L, D)

    def run(score):
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=MosaicBlockSparse(),
                                        score=score)

        def both(q, k, v):
            out, pullback = jax.vjp(lambda *a: attn(*(x.astype(jnp.bfloat16) for x in a)),
                                    q, k, v)
            return (out, *pullback(cot.astype(out.dtype)))

        return jax.jit(both)(q, k, v)

    builtin = run(scores.ALiBi(SLOPES))
    closure = run(scores.ScoreFunction(lambda s, h, qp, kp: alibi_term(s, h, qp, kp, SLOPES)))
    for name, a, c in zip(("out", "dq", "dk", "dv"), builtin, closure):
        assert _rel(c, a) < TOL[jnp.bfloat16], name


@on_gpu
def test_mask_reading_widths_matches_float64_oracle(launches):
    """A `Predicate` whose per-head widths are its params, evaluated on the partial blocks
    with the widths read in-kernel (no element map reaches the launches), alone and beside
    a score function that reads arrays (a closure's symmetric ALiBi slopes): output and the
    gradients in q, k and v against the float64 oracle within bfloat16's tolerance
    (deterministic backward); the selector gives the mask alone to this kernel."""
    mask = masks.Predicate(widths_by_head, WIDTHS)
    x = jnp.zeros((B, H, L, D), jnp.bfloat16)
    plan = bsa.BlockSparseAttention(mask=mask).plan(x, x[:, :HKV], x[:, :HKV])
    assert plan.choice.kernel.name == "mosaic", plan.choice.explain()
    q, k, v, cot = _inputs(53, B, H, HKV, L, L, D)
    widths = np.asarray(WIDTHS)
    positions = np.arange(L)
    visible = (positions[None, :, None] >= positions[None, None, :]) & (
        positions[:, None] - positions[None, :] < widths[:, None, None])
    visible = np.broadcast_to(visible[None], (B, H, L, L))

    def f64(x):
        return jnp.asarray(np.asarray(jnp.asarray(x, jnp.float32), np.float64))

    for score in (None, scores.ScoreFunction(lambda s, h, qp, kp: alibi_term(s, h, qp, kp,
                                                                              SLOPES))):
        attn = bsa.BlockSparseAttention(mask=mask, kernel=MosaicBlockSparse(), score=score)

        def both(q, k, v, attn=attn):
            out, pullback = jax.vjp(lambda *a: attn(*(y.astype(jnp.bfloat16) for y in a)),
                                    q, k, v)
            return (out, *pullback(cot.astype(out.dtype)))

        got = jax.jit(both)(q, k, v)
        assert launches[-1][3] is None  # no element map
        with jax.enable_x64(True):
            def oracle(q, k, v, score=score):
                terms = None if score is None else (lambda s: score_f64(
                    s, q_pos=np.broadcast_to(positions, (B, L)),
                    kv_pos=np.broadcast_to(positions, (B, L)),
                    fn=lambda s, h, qp, kp: alibi_term(s, h, qp, kp, f64(SLOPES))))
                return jnp_attention_f64(q, k, v, visible, score=terms)

            args = [f64(y.astype(jnp.bfloat16)) for y in (q, k, v)]
            out, pullback = jax.vjp(oracle, *args)
            want = (out, *pullback(f64(cot)))
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert _rel(g, np.asarray(w)) < TOL[jnp.bfloat16], (name, score is None)
