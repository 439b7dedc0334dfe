"""Tiling validation and autotune."""

import dataclasses
from typing import ClassVar

import jax
import pytest

import eqx_bsattn as bsa
from eqx_bsattn.strategies.kernels.reference import reference_attention
from tests.conftest import assert_close, np_attention, np_visibility


class _OnlyBlock32(bsa.AbstractKernel):
    """A test kernel: exact, but launches only 32-query tiles."""

    name: ClassVar[str] = "only32"
    platforms: ClassVar[tuple[str, ...]] = ("cpu",)
    reads: ClassVar[str] = "dense"

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        if tiling.block_q != 32:
            raise ValueError(f"only32 needs block_q=32; got {tiling.block_q}")
        return reference_attention(query, key, value, mask=mask, inputs=inputs,
                                   softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap)


def test_tiling_backward_defaults_and_validation():
    t = bsa.Tiling(block_q=64, block_kv=32)
    assert t.backward_blocks == (64, 32)
    assert bsa.Tiling(block_q=64, block_kv=32, block_q_bwd=16).backward_blocks == (16, 32)
    for bad in (0, -4, 1.5, True):
        with pytest.raises(ValueError, match="block_q"):
            bsa.Tiling(block_q=bad, block_kv=32)
    with pytest.raises(ValueError, match="num_warps"):
        bsa.Tiling(block_q=64, block_kv=64, num_warps=0)


def test_tiling_dq_defaults_and_validation():
    # The dq pass takes the backward blocks unless given its own.
    t = bsa.Tiling(block_q=128, block_kv=128, block_q_bwd=64)
    assert t.dq_blocks == (64, 128)
    t = bsa.Tiling(block_q=128, block_kv=128, block_q_bwd=64, block_kv_dq=32)
    assert t.dq_blocks == (64, 32) and t.backward_blocks == (64, 128)
    for field in ("block_q_dq", "block_kv_dq", "num_warps_dq", "num_stages_dq"):
        with pytest.raises(ValueError, match=field):
            bsa.Tiling(block_q=64, block_kv=64, **{field: 0})


def test_triton_checks_dq_blocks():
    triton = bsa.kernels.TritonBlockSparse()
    features = bsa.Features(platform="gpu")
    tiling = bsa.Tiling(block_q=64, block_kv=64, block_q_dq=128, block_kv_dq=32)
    assert triton.adapt_tiling(tiling, features) == tiling
    with pytest.raises(ValueError, match="block_kv_dq"):
        triton.adapt_tiling(bsa.Tiling(block_q=64, block_kv=64, block_kv_dq=48), features)


def _triton_tiling(mask, features):
    resolved = bsa.ResolvedMask(mask, q_len=features.q_len, kv_len=features.kv_len,
                                num_heads=features.num_heads)
    return bsa.kernels.TritonBlockSparse().default_tiling(features, resolved)


def test_triton_default_tiling_gives_dq_its_own_tile():
    features = bsa.Features(platform="gpu", dtype="bfloat16", head_dim=128, value_dim=128,
                            q_len=16384, kv_len=16384)
    causal = bsa.masks.Causal()
    t = _triton_tiling(causal, features)
    assert t.dq_blocks == (128, 64) and t.backward_blocks == (64, 128)
    # 16-bit D=64: the dk/dv tile is 32 queries tall (64x128 spilled), three stages each.
    t = _triton_tiling(causal, dataclasses.replace(features, head_dim=64, value_dim=64))
    assert t.dq_blocks == (128, 64) and t.backward_blocks == (32, 128)
    assert t.num_stages_dq == t.num_stages_bwd == 3
    # Packed documents: one 64x64 layout for the three launches.
    t = _triton_tiling(causal & bsa.masks.Document(),
                       dataclasses.replace(features, segment_ids=True))
    assert (t.block_q, t.block_kv) == t.backward_blocks == t.dq_blocks == (64, 64)


def test_triton_short_scattered_rows_take_small_tiles():
    from eqx_bsattn.bench import bigbird_mask

    features = bsa.Features(platform="gpu", dtype="bfloat16", head_dim=128, value_dim=128,
                            q_len=4096, kv_len=4096)
    t = _triton_tiling(bigbird_mask(4096), features)
    assert (t.block_q, t.block_kv, t.num_warps, t.num_stages) == (64, 64, 4, 2)
    assert t.backward_blocks == t.dq_blocks == (64, 64)
    # Causal rows are long ranges, a window's rows ranges too: the default tiles.
    for mask in (bsa.masks.Causal(), bsa.masks.Causal() & bsa.masks.SlidingWindow(1024, 0)):
        assert _triton_tiling(mask, features).block_q == 128


def test_autotune_keeps_a_runnable_candidate_and_reports_rejections():
    keys = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(kk, (1, 2, 96, 16)) for kk in keys)
    attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), kernel=_OnlyBlock32())
    candidates = [bsa.Tiling(block_q=64, block_kv=64), bsa.Tiling(block_q=32, block_kv=64),
                  bsa.Tiling(block_q=32, block_kv=16)]
    tuned, timings = bsa.autotune(attn, q, k, v, candidates=candidates, reps=1)
    assert [t for t, _ in timings] == candidates
    assert timings[0][1] is None
    assert timings[1][1] is not None and timings[2][1] is not None
    assert tuned.tiling in candidates[1:]
    assert tuned.mask == attn.mask and attn.tiling == bsa.AutoTiling()  # the original is untouched
    # The test kernel wraps the reference, so compare with the independent float64 oracle.
    vis = np_visibility(attn.mask, batch=1, heads=2, q_len=96, kv_len=96)
    assert_close(tuned(q, k, v), np_attention(q, k, v, vis), 2e-5, "tuned")


def test_autotune_raises_when_every_candidate_is_rejected():
    q = jax.random.normal(jax.random.key(4), (1, 2, 40, 8))
    attn = bsa.BlockSparseAttention(kernel=_OnlyBlock32())
    with pytest.raises(ValueError, match="rejected every candidate"):
        bsa.autotune(attn, q, q, q, candidates=[bsa.Tiling(block_q=16, block_kv=16)], reps=1)
