"""`MosaicBlockSparse` on a Hopper GPU with a T5 table (`scores.RelativePositionBias`): forward
and every gradient (q, k, v and the table) against the float64 oracle, with the encoder's and
the decoder's buckets, under a causal mask with grouped heads, a causal window with a soft
cap and a mask without terms, at a ragged length; bit-identical gradients over two runs; a
constant table and the single-pass mode; and the selector's choice of this kernel.

They skip unless JAX's default backend is a GPU.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks, scores
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse
from tests.conftest import jnp_attention_f64, np_visibility, t5_bucket, take_as_proven
from tests.kernels.mosaic.test_mosaic_gpu import TOL, _inputs, _rel, on_gpu

#: Batch, query heads, kv heads, length (ragged: not a multiple of the tiles), head dim.
B, H, HKV, L, D = 2, 4, 2, 1000, 128

#: name: (mask, (num_buckets, bidirectional, max_distance), module options)
CASES = {
    "causal_encoder_buckets": (masks.Causal(), (32, True, 128), {}),
    "window_decoder_cap": (masks.Causal() & masks.SlidingWindow(300, 0), (32, False, 64),
                           dict(logits_soft_cap=20.0)),
    "predicate_short_distance": (masks.Predicate(lambda q, k: (q - k) % 3 != 1),
                                 (16, True, 40), {}),
}


@pytest.fixture(autouse=True)
def _table_on(monkeypatch):
    """These tests run the table's launches, whether or not the selector takes them yet."""
    take_as_proven(MosaicBlockSparse, "t5_table", monkeypatch=monkeypatch)


def _table(spec):
    return 0.5 * jax.random.normal(jax.random.key(7), (H, spec[0]), jnp.float32)


def _module(case, deterministic=True):
    mask, spec, options = CASES[case]
    score = scores.RelativePositionBias(_table(spec), spec[1], spec[2])
    return bsa.BlockSparseAttention(mask=mask, score=score, kernel=MosaicBlockSparse(
        deterministic=deterministic), **options)


def _mosaic_run(case, deterministic=True, table_grad=True):
    """``(out, dq, dk, dv[, dtable])`` of the case through `MosaicBlockSparse`, bfloat16."""
    attn = _module(case, deterministic)
    q, k, v, cot = _inputs(71, B, H, HKV, L, L, D)

    def f(q, k, v, table):
        return eqx.tree_at(lambda m: m.score.table, attn, table)(
            *(x.astype(jnp.bfloat16) for x in (q, k, v)))

    def both(q, k, v, table):
        if not table_grad:
            out, pullback = jax.vjp(lambda q, k, v: f(q, k, v, table), q, k, v)
        else:
            out, pullback = jax.vjp(f, q, k, v, table)
        return (out, *pullback(cot.astype(out.dtype)))

    return jax.jit(both)(q, k, v, attn.score.table)


def _oracle(case):
    """The float64 oracle's output and gradients on the rounded inputs: the table's term as
    a bias gathered at T5's buckets of ``q - k``."""
    mask, spec, options = CASES[case]
    q, k, v, cot = _inputs(71, B, H, HKV, L, L, D)
    visible = np_visibility(mask, batch=B, heads=H, q_len=L, kv_len=L)
    bucket = t5_bucket(np.arange(L)[:, None] - np.arange(L)[None, :], *spec)

    def f64(x):
        return jnp.asarray(np.asarray(jnp.asarray(x, jnp.float32), np.float64))

    with jax.enable_x64(True):
        def attend(q, k, v, table):
            return jnp_attention_f64(q, k, v, visible, bias=table[:, bucket][None],
                                     soft_cap=options.get("logits_soft_cap"))

        args = [f64(x.astype(jnp.bfloat16)) for x in (q, k, v)]
        out, pullback = jax.vjp(attend, *args, f64(_table(spec)))
        grads = pullback(f64(cot.astype(jnp.bfloat16)))
        return jax.tree.map(np.asarray, (out, *grads))


@on_gpu
@pytest.mark.parametrize("case", list(CASES))
def test_table_matches_float64_oracle(case):
    """Output and the gradients in q, k, v and the table against the float64 oracle within
    bfloat16's tolerance; the selector gives such a call to this kernel."""
    mask, spec, options = CASES[case]
    x = jnp.zeros((B, H, L, D), jnp.bfloat16)
    plan = bsa.BlockSparseAttention(
        mask=mask, score=scores.RelativePositionBias(_table(spec), spec[1], spec[2]),
        **options).plan(x, x[:, :HKV], x[:, :HKV])
    assert plan.choice.kernel.name == "mosaic", plan.choice.explain()
    got = _mosaic_run(case)
    want = _oracle(case)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dtable"), got, want):
        assert g.shape == w.shape, name
        assert _rel(g, w) < TOL[jnp.bfloat16], name


@on_gpu
def test_table_gradients_are_bit_identical():
    """Two runs give bit-identical outputs and gradients, the table's included (each near
    block's dS written once, the sums in a fixed order: no atomics)."""
    runs = [[np.asarray(x) for x in _mosaic_run("causal_encoder_buckets")] for _ in range(2)]
    for a, c in zip(*runs):
        assert np.array_equal(a, c)


@on_gpu
def test_constant_table_and_single_pass():
    """A table that is not differentiated gives the same output and q, k, v gradients as one
    that is, and the kernel's single-pass mode, which takes the two launches for a table,
    too."""
    case = "window_decoder_cap"
    full = _mosaic_run(case)
    for got in (_mosaic_run(case, table_grad=False),
                _mosaic_run(case, deterministic=False, table_grad=False)):
        assert len(got) == 4
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, full):
            assert _rel(g, w) < 1e-6, name
