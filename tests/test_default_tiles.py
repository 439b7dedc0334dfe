"""The default tile choice of every kernel that tiles, pinned for a few shapes per kernel.

Measured GPU speed is compared before and after changes to how tilings are represented, so the
heuristic's blocks (and Triton's warps and stages, Mosaic's stages) must stay exactly these.
"""

import pytest

import eqx_bsattn as bsa

CAUSAL = bsa.masks.Causal()
DOCUMENT = CAUSAL & bsa.masks.Document()

# (dtype, head dim, Lq, Lk, features, mask)
SHAPES = {
    "bf16 D128 16k": ("bfloat16", 128, 16384, 16384, {}, CAUSAL),
    "bf16 D64 4k": ("bfloat16", 64, 4096, 4096, {}, CAUSAL),
    "f32 D128 4k": ("float32", 128, 4096, 4096, {}, CAUSAL),
    "bf16 D256 2k": ("bfloat16", 256, 2048, 2048, {}, CAUSAL),
    "bf16 D512 1k": ("bfloat16", 512, 1024, 1024, {}, CAUSAL),
    "bf16 D128 bias": ("bfloat16", 128, 4096, 4096, {"bias": True}, CAUSAL),
    "bf16 D128 documents": ("bfloat16", 128, 16384, 16384, {"segment_ids": True}, DOCUMENT),
    "bf16 D128 relative": ("bfloat16", 128, 16384, 16384, {"score": ("relative_bias",)}, CAUSAL),
    "bf16 D128 relative positions": ("bfloat16", 128, 16384, 16384,
                                     {"score": ("relative_bias",), "positions": True}, CAUSAL),
    "bf16 D128 decode": ("bfloat16", 128, 1, 100, {}, CAUSAL),
    "bf16 D64 ragged": ("bfloat16", 64, 40, 33, {}, CAUSAL),
}

# Blocks per pass ((forward), (dq), (dk/dv)), then Triton's (warps, stages) per launch in the
# same order, or Mosaic's forward stages.
TRITON = {
    "bf16 D128 16k": (((128, 128), (128, 64), (64, 128)), ((8, 3), (8, 3), (8, 3))),
    "bf16 D64 4k": (((128, 128), (128, 64), (32, 128)), ((4, 3), (4, 3), (4, 3))),
    "f32 D128 4k": (((64, 64), (64, 32), (64, 32)), ((8, 2), (8, 2), (8, 2))),
    "bf16 D256 2k": (((64, 64), (64, 32), (64, 32)), ((8, 2), (8, 2), (8, 2))),
    "bf16 D512 1k": (((32, 32), (32, 32), (32, 32)), ((4, 1), (4, 1), (4, 1))),
    "bf16 D128 bias": (((128, 64), (64, 64), (64, 64)), ((8, 2), (8, 2), (8, 2))),
    "bf16 D128 documents": (((64, 64), (64, 64), (64, 64)), ((4, 3), (4, 2), (4, 2))),
    # With per-call positions a relative-bias table's float32 tile takes the forward to two
    # stages (H200: 288 KiB asked at three); without, no loop holds it (the blocks near the
    # diagonal load their entries by distance, unpipelined).
    "bf16 D128 relative": (((128, 128), (128, 64), (64, 128)), ((8, 3), (8, 3), (8, 3))),
    "bf16 D128 relative positions": (((128, 128), (128, 64), (64, 128)),
                                     ((8, 2), (8, 3), (8, 3))),
    "bf16 D128 decode": (((16, 128), (16, 64), (16, 128)), ((8, 3), (8, 3), (8, 3))),
    "bf16 D64 ragged": (((64, 64), (64, 64), (32, 64)), ((4, 3), (4, 3), (4, 3))),
}
_XLA_CPU = ((128, 64), (128, 128), (128, 128))
XLA_CPU = {name: _XLA_CPU for name in SHAPES} | {
    "bf16 D128 decode": ((1, 64), (1, 100), (1, 100)),
    "bf16 D64 ragged": ((40, 33), (40, 33), (40, 33)),
}
XLA_GPU = {name: ((128, 128),) * 3 for name in SHAPES} | {
    "bf16 D128 decode": ((1, 100),) * 3,
    "bf16 D64 ragged": ((40, 33),) * 3,
}
# On a TPU 512 at head dims up to 128, within the sequences rounded to 128; 128 above.
SPLASH = {name: ((512, 512),) * 3 for name in SHAPES} | {
    "bf16 D256 2k": ((128, 128),) * 3,
    "bf16 D512 1k": ((128, 128),) * 3,
    "bf16 D128 decode": ((128, 128),) * 3,
    "bf16 D64 ragged": ((128, 128),) * 3,
}
_MOSAIC_128 = (((128, 128), (128, 64), (64, 128)), 2)
_MOSAIC_64 = (((128, 128), (128, 128), (64, 128)), 4)
# Head dim 256: 64-key forward tiles beside one Q buffer, 32-row streamed tiles in the
# backward (docs/mosaic.md, "Head dim 256"); over 256 no tiles fit its shared memory.
MOSAIC = {name: _MOSAIC_64 if SHAPES[name][1] == 64 else _MOSAIC_128 for name in SHAPES} | {
    "bf16 D256 2k": (((128, 64), (128, 32), (32, 128)), 2),
    "bf16 D512 1k": None,
}


def _default(kernel, platform, name):
    dtype, dim, q_len, kv_len, extra, mask = SHAPES[name]
    features = bsa.Features(platform=platform, dtype=dtype, head_dim=dim, value_dim=dim,
                            q_len=q_len, kv_len=kv_len, num_heads=2, num_kv_heads=2, **extra)
    resolved = bsa.ResolvedMask(mask, q_len=q_len, kv_len=kv_len, num_heads=2)
    return kernel.adapt_tiling(kernel.default_tiling(features, resolved), features)


def _blocks(config):
    return tuple(config.blocks)


@pytest.mark.parametrize("name", SHAPES)
def test_triton_default_tiles(name):
    config = _default(bsa.kernels.TritonBlockSparse(), "gpu", name).explicit()
    assert isinstance(config, bsa.kernels.TritonConfig)
    launches = ((config.num_warps, config.num_stages),
                (config.num_warps_dq, config.num_stages_dq),
                (config.num_warps_bwd, config.num_stages_bwd))
    assert (_blocks(config), launches) == TRITON[name]


@pytest.mark.parametrize("platform, expected", [("cpu", XLA_CPU), ("gpu", XLA_GPU)])
@pytest.mark.parametrize("name", SHAPES)
def test_xla_default_tiles(name, platform, expected):
    assert _blocks(_default(bsa.kernels.XlaBlockSparse(), platform, name)) == expected[name]


@pytest.mark.parametrize("name", SHAPES)
def test_splash_default_tiles(name):
    assert _blocks(_default(bsa.kernels.SplashBlockSparse(), "tpu", name)) == SPLASH[name]
    # Off a TPU (interpreted, for correctness) Splash's own default, 128, within the sequence.
    assert _blocks(_default(bsa.kernels.SplashBlockSparse(), "cpu", name)) == \
        ((128, 128),) * 3


@pytest.mark.parametrize("name", SHAPES)
def test_mosaic_default_tiles(name):
    if MOSAIC[name] is None:
        with pytest.raises(ValueError, match="head dim 512 is over 256"):
            _default(bsa.kernels.MosaicBlockSparse(), "gpu", name)
        return
    config = _default(bsa.kernels.MosaicBlockSparse(), "gpu", name)
    assert isinstance(config, bsa.kernels.MosaicConfig)
    assert (_blocks(config), config.stages) == MOSAIC[name]


def test_triton_bigbird_default_tiles():
    from eqx_bsattn.bench import bigbird_mask

    features = bsa.Features(platform="gpu", dtype="bfloat16", head_dim=128, value_dim=128,
                            q_len=4096, kv_len=4096, num_heads=2, num_kv_heads=2)
    resolved = bsa.ResolvedMask(bigbird_mask(4096), q_len=4096, kv_len=4096, num_heads=2)
    kernel = bsa.kernels.TritonBlockSparse()
    config = kernel.adapt_tiling(kernel.default_tiling(features, resolved), features).explicit()
    launches = ((config.num_warps, config.num_stages),
                (config.num_warps_dq, config.num_stages_dq),
                (config.num_warps_bwd, config.num_stages_bwd))
    assert (_blocks(config), launches) == (((64, 64),) * 3, ((4, 2),) * 3)
