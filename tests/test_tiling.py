"""Tilings: the kernel-independent `Tiling`, each kernel's own config (checks, defaults, how it
takes another's), the strategy the plan asks, and the Triton heuristics (autotune:
test_autotune.py; the default tiles per kernel: test_default_tiles.py)."""

import dataclasses
import warnings

import jax
import pytest

import eqx_bsattn as bsa

K = bsa.kernels


def test_tiling_backward_defaults_and_validation():
    t = bsa.Tiling(block_q=64, block_kv=32)
    assert t.backward_blocks == (64, 32)
    assert bsa.Tiling(block_q=64, block_kv=32, block_q_bwd=16).backward_blocks == (16, 32)
    for bad in (0, -4, 1.5, True):
        with pytest.raises(ValueError, match="block_q"):
            bsa.Tiling(block_q=bad, block_kv=32)


def test_tiling_dq_defaults_and_validation():
    # The dq pass takes the backward blocks unless given its own.
    t = bsa.Tiling(block_q=128, block_kv=128, block_q_bwd=64)
    assert t.dq_blocks == (64, 128)
    t = bsa.Tiling(block_q=128, block_kv=128, block_q_bwd=64, block_kv_dq=32)
    assert t.dq_blocks == (64, 32) and t.backward_blocks == (64, 128)
    assert t.blocks == bsa.PassBlocks((128, 128), (64, 32), (64, 128))
    for field in ("block_q_dq", "block_kv_dq"):
        with pytest.raises(ValueError, match=field):
            bsa.Tiling(block_q=64, block_kv=64, **{field: 0})


def test_tiling_launch_fields_are_deprecated_and_still_reach_triton():
    with pytest.warns(DeprecationWarning, match="TritonConfig") as record:
        t = bsa.Tiling(block_q=64, block_kv=64, num_warps=4, num_stages_dq=2)
    assert "num_warps, num_stages_dq" in str(record[0].message)
    assert record[0].filename == __file__  # the warning points at the caller
    with pytest.raises(ValueError, match="num_warps"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            bsa.Tiling(block_q=64, block_kv=64, num_warps=0)
    config = K.TritonBlockSparse().adapt_tiling(t, bsa.Features(platform="gpu"))
    assert config == K.TritonConfig(block_q=64, block_kv=64, num_warps=4, num_stages_dq=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        bsa.Tiling(block_q=64, block_kv=64, block_q_dq=32)  # blocks alone: no warning


def test_triton_config_checks_its_blocks_when_built():
    assert K.TritonConfig(block_q=64, block_kv=64, block_q_dq=128, block_kv_dq=32).dq_blocks == (
        128, 32)
    with pytest.raises(ValueError, match="TritonConfig.block_kv_dq .* power of two >= 16; got 48"):
        K.TritonConfig(block_q=64, block_kv=64, block_kv_dq=48)
    with pytest.raises(ValueError, match="block_q .* power of two"):
        K.TritonConfig(block_q=8, block_kv=64)
    with pytest.raises(ValueError, match="TritonConfig.num_warps"):
        K.TritonConfig(block_q=64, block_kv=64, num_warps=0)
    # A Tiling the kernel cannot launch is refused with the field's name.
    with pytest.raises(ValueError, match="block_kv_dq"):
        K.TritonBlockSparse().adapt_tiling(bsa.Tiling(block_q=64, block_kv=64, block_kv_dq=48),
                                           bsa.Features(platform="gpu"))


def test_every_kernel_takes_another_kernels_config_by_its_blocks():
    features = bsa.Features(platform="gpu", q_len=512, kv_len=512)
    triton = K.TritonConfig(block_q=64, block_kv=32, block_q_bwd=32, block_kv_bwd=64,
                            num_warps=4)
    xla = K.XlaBlockSparse().adapt_tiling(triton, features)
    assert xla == K.XlaConfig(block_q=64, block_kv=32, block_q_dq=32, block_kv_dq=64,
                              block_q_dkv=32, block_kv_dkv=64)
    back = K.TritonBlockSparse().adapt_tiling(xla, features)
    assert back.blocks == triton.blocks and back.num_warps is None
    splash = K.SplashBlockSparse().adapt_tiling(triton, features)
    assert splash.blocks == bsa.PassBlocks((128, 128), (128, 128), (128, 128))  # whole lanes
    assert K.SplashBlockSparse().adapt_tiling(bsa.Tiling(256, 600), features).blocks.forward == (
        256, 512)
    mosaic = K.MosaicBlockSparse()
    dim128 = dataclasses.replace(features, head_dim=128, value_dim=128)
    assert mosaic.adapt_tiling(triton, dim128) == K.MosaicConfig.for_head_dim(128)
    with pytest.raises(ValueError, match="MosaicBlockSparse runs MosaicConfig.* fixed"):
        mosaic.adapt_tiling(K.MosaicConfig.for_head_dim(64), dim128)


def test_xla_and_splash_configs_default_and_check_their_passes():
    c = K.XlaConfig(block_q=128, block_kv=64, block_q_dkv=32)
    assert c.blocks == bsa.PassBlocks((128, 64), (32, 64), (32, 64))
    assert c.explicit() == K.XlaConfig(128, 64, 32, 64, 32, 64) and c.explicit().blocks == c.blocks
    with pytest.raises(ValueError, match="XlaConfig.block_kv_dq"):
        K.XlaConfig(block_q=128, block_kv=64, block_kv_dq=0)
    with pytest.raises(ValueError, match="SplashConfig.block_q"):
        K.SplashConfig(block_q=1.5, block_kv=128)
    with pytest.raises(ValueError, match="MosaicConfig.stages"):
        dataclasses.replace(K.MosaicConfig.for_head_dim(128), stages=0)
    short = bsa.Features(q_len=40, kv_len=20)
    assert K.XlaConfig(128, 64).clamped(short).blocks == bsa.PassBlocks(*[(40, 20)] * 3)


def test_configs_print_in_one_line():
    assert K.XlaConfig(128, 64, block_q_dkv=64).text() == "fwd 128x64 | dq 64x64 | dk/dv 64x64"
    assert K.TritonConfig(128, 64, num_warps=8, num_stages=3, block_q_dq=64).text() == (
        "fwd 128x64 w8 s3 | dq 64x64 w8 s3 | dk/dv 128x64 w8 s3")
    assert K.MosaicConfig.for_head_dim(128).text() == "fwd 128x128 | dq 128x64 | dk/dv 64x128 | s2"


def test_explain_prints_the_config_of_the_kernel_that_runs():
    q = jax.random.normal(jax.random.key(0), (1, 2, 64, 16))
    attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), kernel=K.XlaBlockSparse(),
                                    tiling=bsa.Tiling(block_q=32, block_kv=16))
    plan = attn.plan(q, q, q)
    assert plan.tiling == K.XlaConfig(32, 16, 32, 16, 32, 16) and plan.tiling_source == "module"
    assert ("tiling (given by the module): XlaConfig(block_q=32, block_kv=16, block_q_dq=32, "
            "block_kv_dq=16, block_q_dkv=32, block_kv_dkv=16)") in plan.explain()
    heuristic = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), kernel=K.XlaBlockSparse())
    with bsa._cache.policy("heuristics"):
        plan = heuristic.plan(q, q, q)
    assert isinstance(plan.tiling, K.XlaConfig) and plan.tiling_source == "heuristic"
    assert "tiling (the kernel's heuristic): XlaConfig(" in plan.explain()


def test_a_tiling_strategy_is_asked_by_the_plan():
    """A user's own tiling strategy (an `AbstractTiling` that is not a config) decides per
    call; the plan adapts its answer to the kernel."""

    class Quarter(bsa.AbstractTiling):
        def choose(self, kernel, features, mask):
            return bsa.Tiling(features.q_len // 4, features.kv_len // 4), "quarter"

    q = jax.random.normal(jax.random.key(0), (1, 2, 64, 16))
    attn = bsa.BlockSparseAttention(kernel=K.XlaBlockSparse(), tiling=Quarter())
    plan = attn.plan(q, q, q)
    assert plan.tiling.blocks.forward == (16, 16) and plan.tiling_source == "quarter"
    assert plan.mask.forward.block_q == 16
    with pytest.raises(TypeError, match="`tiling` must be a kernel's config"):
        bsa.BlockSparseAttention(tiling=(16, 16))


def _triton_tiling(mask, features):
    resolved = bsa.ResolvedMask(mask, q_len=features.q_len, kv_len=features.kv_len,
                                num_heads=features.num_heads)
    return K.TritonBlockSparse().default_tiling(features, resolved)


def test_triton_default_tiling_gives_dq_its_own_tile():
    features = bsa.Features(platform="gpu", dtype="bfloat16", head_dim=128, value_dim=128,
                            q_len=16384, kv_len=16384)
    causal = bsa.masks.Causal()
    t = _triton_tiling(causal, features)
    assert isinstance(t, K.TritonConfig)
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
    t = K.TritonConfig(block_q=128, block_kv=64, num_warps=8, num_stages=3, block_q_bwd=32,
                       num_stages_dq=2)
    e = t.explicit()
    assert (e.block_q_bwd, e.block_kv_bwd, e.block_q_dq, e.block_kv_dq) == (32, 64, 32, 64)
    assert (e.num_warps_bwd, e.num_stages_bwd, e.num_warps_dq, e.num_stages_dq) == (8, 3, 8, 2)
    assert e.backward_blocks == t.backward_blocks and e.dq_blocks == t.dq_blocks
    assert K.TritonConfig(block_q=16, block_kv=16).explicit().num_warps_dq is None
    assert bsa.Tiling(block_q=64, block_kv=32).explicit() == bsa.Tiling(64, 32, 64, 32,
                                                                       block_q_dq=64,
                                                                       block_kv_dq=32)
    base = K.TritonConfig(block_q=64, block_kv=64)
    out = base.variants((("block_q", "block_kv"), [(64, 64), (128, 64), (32, 32)]),
                        (("num_warps",), [(4,), (8,)]))
    assert out == (
        base,  # (64, 64) is the base itself: dropped
        K.TritonConfig(block_q=64, block_kv=64, num_warps=4),
        K.TritonConfig(block_q=128, block_kv=64),
        K.TritonConfig(block_q=64, block_kv=64, num_warps=8),
        K.TritonConfig(block_q=32, block_kv=32),
    )
