"""Tiling validation, its helpers, and the Triton tiling heuristics (autotune: test_autotune.py)."""

import dataclasses

import pytest

import eqx_bsattn as bsa


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


@pytest.mark.slow
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


def test_explicit_spells_out_the_defaults_and_variants_vary_one_group_at_a_time():
    t = bsa.Tiling(block_q=128, block_kv=64, num_warps=8, num_stages=3, block_q_bwd=32,
                   num_stages_dq=2)
    e = t.explicit()
    assert (e.block_q_bwd, e.block_kv_bwd, e.block_q_dq, e.block_kv_dq) == (32, 64, 32, 64)
    assert (e.num_warps_bwd, e.num_stages_bwd, e.num_warps_dq, e.num_stages_dq) == (8, 3, 8, 2)
    assert e.backward_blocks == t.backward_blocks and e.dq_blocks == t.dq_blocks
    assert bsa.Tiling(block_q=16, block_kv=16).explicit().num_warps_dq is None
    base = bsa.Tiling(block_q=64, block_kv=64)
    out = base.variants((("block_q", "block_kv"), [(64, 64), (128, 64), (32, 32)]),
                        (("num_warps",), [(4,), (8,)]))
    assert out == (
        base,  # (64, 64) is the base itself: dropped
        bsa.Tiling(block_q=64, block_kv=64, num_warps=4),
        bsa.Tiling(block_q=128, block_kv=64),
        bsa.Tiling(block_q=64, block_kv=64, num_warps=8),
        bsa.Tiling(block_q=32, block_kv=32),
    )
