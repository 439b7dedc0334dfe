"""A T5 table (`scores.RelativePositionBias`) in `MosaicBlockSparse`, on a host without a GPU.

Each launch walks its lists in three parts (`contract.far_splits`): every pair of a block in
a far part lies in one bucket, so the block adds one entry of the table; a near block adds
its tile of the launch's bank (`common.RelativeTiles`: the table's entry at each pair of a
block, one tile per offset class). The dq launch writes each near block's dS at its offset
class and each row's sums over the far parts: the table's gradient, summed per bucket
outside the launch (`kernel.relative_table_gradient`). Here: the classes cover every near
block and their buckets are T5's; the forward and the backward lower for CUDA with a table,
alone and beside a soft cap, a window and a mask without terms; the plan's declines; and
extended tests run the whole call in Pallas' CPU interpreter for Mosaic GPU against the
float64 oracle (test_mosaic_table_gpu.py runs it on a GPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks, scores
from eqx_bsattn.contract import RelativeBuckets, far_splits
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse
from eqx_bsattn.strategies.kernels.mosaic import kernel as mosaic_kernel
from eqx_bsattn.strategies.kernels.mosaic.common import RelativeTiles
from tests.conftest import (jnp_attention_f64, np_visibility, random_array, rel_err,
                            t5_bucket, take_as_proven)

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

#: (rows, cols, transposed): the forward's tiles, the dq launch's and the dk/dv launch's.
LAUNCH_TILES = [(64, 128, False), (64, 64, False), (64, 64, True)]
BUCKETS = [RelativeBuckets(32, True, 128), RelativeBuckets(32, False, 128),
           RelativeBuckets(8, True, 20), RelativeBuckets(16, False, 40)]


@pytest.mark.parametrize("tiles", LAUNCH_TILES, ids=["forward", "dq", "dkv"])
@pytest.mark.parametrize("buckets", BUCKETS, ids=lambda b: f"nb{b.num_buckets}_"
                         f"{'bi' if b.bidirectional else 'causal'}_{b.max_distance}")
def test_offset_classes_cover_the_near_blocks(tiles, buckets):
    """Every near entry of every list row (all blocks of a 2048-token square, each warpgroup's
    rows) has an offset in the bank's classes, and the class's buckets are T5's buckets of
    that block's pairs; every pair of a far entry lies in its part's bucket."""
    rows, cols, transposed = tiles
    relative = RelativeTiles(buckets, rows, cols, 2 * rows, transposed)
    first, count = relative.offsets
    length, span = 2048, 2 * rows
    n_rows, n_entries = length // span, length // cols
    full_count = np.full((1, 1, n_rows), n_entries, np.int32)
    full_index = np.broadcast_to(np.arange(n_entries, dtype=np.int32),
                                 (1, 1, n_rows, n_entries)).copy()
    none = np.zeros((1, 1, n_rows), np.int32), np.zeros((1, 1, n_rows, 1), np.int32)
    block_q, block_kv = (cols, span) if transposed else (span, cols)
    splits = far_splits(full_count, full_index, *none, transposed, block_q, block_kv, buckets)
    low, high = relative.far_buckets
    near_seen = 0
    for r in range(n_rows):
        before, near_end = splits[0, 0, r, :2]
        for e in range(n_entries):
            part = 0 if e < before else (1 if e < near_end else 2)
            for w in range(span // rows):
                own = r * span + w * rows
                if transposed:  # rows are keys, columns queries
                    offset = e * cols - own
                    d = offset + np.arange(cols)[None, :] - np.arange(rows)[:, None]
                else:
                    offset = own - e * cols
                    d = offset + np.arange(rows)[:, None] - np.arange(cols)[None, :]
                want = t5_bucket(d, buckets.num_buckets, buckets.bidirectional,
                                 buckets.max_distance)
                if part == 1:
                    near_seen += 1
                    assert first <= offset <= first + (count - 1) * relative.step
                    assert (offset - first) % relative.step == 0
                    c = (offset - first) // relative.step
                    np.testing.assert_array_equal(relative.bank_buckets[c], want)
                else:
                    assert (want == (low if part == 0 else high)).all(), (r, e, w, part)
    assert near_seen > 0


def test_table_is_declined_until_it_runs_on_a_gpu():
    """Until the table's launches have run on a Hopper GPU the plan keeps another kernel."""
    resolved = bsa.ResolvedMask(masks.Causal(), q_len=256, kv_len=256, num_heads=2)
    features = bsa.Features(platform="gpu", dtype="bfloat16", head_dim=128, value_dim=128,
                            score=("relative_bias",))
    assert MosaicBlockSparse.awaits_device_run("t5_table")
    assert MosaicBlockSparse().decline_reason(resolved, features) == (
        "a T5 table (RelativePositionBias) has not yet run on a GPU.")


def test_table_declines(hopper_host, monkeypatch):
    """Per-call positions and a sharding's loop are declined in one line each (the near
    blocks are classed by offsets of token indices); the plain call is taken."""
    take_as_proven(MosaicBlockSparse, "t5_table", monkeypatch=monkeypatch)
    resolved = bsa.ResolvedMask(masks.Causal(), q_len=256, kv_len=256, num_heads=2)
    base = dict(platform="gpu", dtype="bfloat16", head_dim=128, value_dim=128,
                score=("relative_bias",))
    kernel = MosaicBlockSparse()
    assert kernel.decline_reason(resolved, bsa.Features(**base)) is None
    assert kernel.decline_reason(resolved, bsa.Features(**base, positions=True)) == (
        "a T5 table (RelativePositionBias) with per-call positions is not supported.")
    assert kernel.decline_reason(resolved, bsa.Features(**base, in_loop=True)) == (
        "a T5 table (RelativePositionBias) inside a sharding's loop (RingAttention) is not "
        "supported.")


def _no_run_time_checks(monkeypatch):
    """Run-time checks are host callbacks, which JAX cannot lower for another platform:
    taken out where these tests lower for CUDA."""
    import eqx_bsattn._values as values

    monkeypatch.setattr(values.eqx, "error_if", lambda x, *_: x)


def _table(heads: int, num_buckets: int, seed: int = 4):
    return random_array(seed, (heads, num_buckets)) * 0.5


#: name: (mask, shapes, (num_buckets, bidirectional, max_distance), module options)
LOWERED = {
    "causal_bidirectional": (masks.Causal(), dict(batch=2, heads=2, kv_heads=2, q_len=1024,
                                                  kv_len=1024, dim=128), (32, True, 128), {}),
    "window_gqa_decoder_cap": (
        masks.Causal() & masks.SlidingWindow(384, 0),
        dict(batch=1, heads=4, kv_heads=2, q_len=768, kv_len=768, dim=64), (32, False, 128),
        dict(logits_soft_cap=20.0)),
    "predicate_ragged_full": (masks.Predicate(lambda q, k: (q - k) % 3 != 1),
                              dict(batch=1, heads=2, kv_heads=1, q_len=200, kv_len=333, dim=64),
                              (8, True, 20), {}),
}


def _module(mask, heads, table_spec, options, table=None):
    num_buckets, bidirectional, max_distance = table_spec
    table = _table(heads, num_buckets) if table is None else table
    score = scores.RelativePositionBias(table, bidirectional, max_distance)
    return bsa.BlockSparseAttention(mask=mask, kernel=MosaicBlockSparse(), score=score,
                                    **options)


def _lowered_qkv(batch, heads, kv_heads, q_len, kv_len, dim):
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = ((batch, heads, q_len, dim), (batch, kv_heads, kv_len, dim),
              (batch, kv_heads, kv_len, dim))
    return tuple(jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes))


def _with_table(attn, table):
    import equinox as eqx

    return eqx.tree_at(lambda m: m.score.table, attn, table)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LOWERED))
def test_table_lowers_for_cuda(hopper_host, monkeypatch, case):
    """`jit(grad)` with a T5 table lowers for CUDA: three Mosaic GPU launches (the forward,
    dq and dk/dv), the table's gradient in its own shape."""
    _no_run_time_checks(monkeypatch)
    take_as_proven(MosaicBlockSparse, "t5_table", monkeypatch=monkeypatch)
    mask, shape, table_spec, options = LOWERED[case]
    attn = _module(mask, shape["heads"], table_spec, options)
    q, k, v = _lowered_qkv(**shape)
    table = _table(shape["heads"], table_spec[0])

    def loss(q, k, v, table):
        return jnp.sum(_with_table(attn, table)(q, k, v).astype(jnp.float32))

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, k, v, table).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().count("custom_call @mosaic_gpu") == 3, case
    assert [o.shape for o in jax.tree.leaves(lowered.out_info)] == [
        q.shape, k.shape, v.shape, table.shape]


@pytest.mark.slow
def test_constant_table_writes_no_gradient(hopper_host, launches, monkeypatch):
    """A table that is not differentiated costs the backward no gradient: the dq launch
    writes its dS only where the table's gradient is asked for; a table takes the two
    backward launches."""
    _no_run_time_checks(monkeypatch)
    take_as_proven(MosaicBlockSparse, "t5_table", monkeypatch=monkeypatch)
    from eqx_bsattn.strategies.kernels.mosaic import backward

    written = []
    real = backward.dq_call

    def spy(cfg, *args, **kwargs):
        written.append(cfg.relative_gradient)
        return real(cfg, *args, **kwargs)

    q, k, v = _lowered_qkv(1, 2, 2, 256, 256, 64)
    attn = _module(masks.Causal(), 2, (32, True, 128), {})
    table = _table(2, 32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mosaic_kernel, "dq_call", spy)
        for argnums in ((0,), (0, 3)):
            jax.jit(jax.grad(lambda q, k, v, t: jnp.sum(_with_table(attn, t)(q, k, v)
                                                        .astype(jnp.float32)),
                             argnums=argnums)).trace(q, k, v, table).lower(
                lowering_platforms=("cuda",))
    assert written == [False, True]
    assert all(fcfg.relative is not None and not bcfg.single_pass
               for fcfg, bcfg, *_ in launches)


#: name: (mask, shapes, table spec, options)
INTERPRETED = {
    # Grouped heads, ragged keys, Lq != Lk (bottom-right causal), T5's encoder buckets with a
    # short max distance, so that near, far-before and far-after blocks all occur; one
    # entry of the table is -inf (its pairs hidden).
    "causal_gqa_ragged": (masks.Causal(bottom_right=True),
                          dict(batch=2, heads=2, kv_heads=1, q_len=300, kv_len=400, dim=64),
                          (8, True, 20), dict(hidden_bucket=2)),
    # A mask without terms with the decoder's buckets and a soft cap: every list walked
    # whole in three parts, partial blocks in each.
    "predicate_decoder_cap": (
        masks.Predicate(lambda q, k: (q - k) % 3 != 1),
        dict(batch=1, heads=2, kv_heads=2, q_len=384, kv_len=384, dim=64), (16, False, 40),
        dict(logits_soft_cap=5.0)),
}


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("case", list(INTERPRETED))
def test_table_in_cpu_interpreter(interpreted, monkeypatch, case):
    """The whole call, its launches in Pallas' CPU interpreter for Mosaic GPU: output and the
    gradients in q, k, v and the table against the float64 oracle (the table's term as a
    float64 bias gathered by T5's buckets)."""
    take_as_proven(MosaicBlockSparse, "t5_table", monkeypatch=monkeypatch)
    mask, shape, table_spec, options = INTERPRETED[case]
    heads, lq, lk = shape["heads"], shape["q_len"], shape["kv_len"]
    q, k, v = (random_array(seed, (shape["batch"], h, length, shape["dim"]))
               for seed, h, length in ((1, heads, lq), (2, shape["kv_heads"], lk),
                                       (3, shape["kv_heads"], lk)))
    options = dict(options)
    hidden = options.pop("hidden_bucket", None)
    table = _table(heads, table_spec[0])
    if hidden is not None:
        table = table.at[0, hidden].set(-jnp.inf)
    cot = random_array(5, q.shape)
    attn = _module(mask, heads, table_spec, options, table)

    def call(q, k, v, table):
        return _with_table(attn, table)(*(x.astype(jnp.float16) for x in (q, k, v))).astype(
            jnp.float32)

    out, pullback = jax.vjp(call, q, k, v, table)
    got = pullback(cot)
    distance = np.arange(lq)[:, None] - np.arange(lk)[None, :]
    bucket = t5_bucket(distance, *table_spec)
    finite = np.isfinite(np.asarray(table))[:, bucket][None]
    visible = np_visibility(mask, batch=shape["batch"], heads=heads, q_len=lq,
                            kv_len=lk) & finite
    cap = options.get("logits_soft_cap")
    with jax.enable_x64(True):
        def oracle(q, k, v, table):
            bias = jnp.where(finite, table[:, bucket][None], 0.0)
            return jnp_attention_f64(q, k, v, visible, bias=bias, soft_cap=cap)

        f64 = [jnp.asarray(np.asarray(x.astype(jnp.float16), np.float64)) for x in (q, k, v)]
        want_out, oracle_pullback = jax.vjp(oracle, *f64,
                                            jnp.asarray(np.asarray(table, np.float64)))
        want = oracle_pullback(jnp.asarray(np.asarray(cot, np.float64)))
    assert rel_err(out, want_out) < 4e-3
    for name, g, w in zip(("dq", "dk", "dv", "dtable"), got, want):
        assert g.shape == w.shape, name
        assert rel_err(g, np.where(np.isfinite(w), w, 0.0)) < 1e-2, name
