"""`SplashBlockSparse`: its block-info arrays against Splash's own, the selector, the TPU
head-dim padding, and one call per path in Splash's interpret mode. The conformance suite runs
it against the float64 oracle over its cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
from eqx_bsattn._api import _kernel_for
from eqx_bsattn._module import run_plan
from eqx_bsattn.strategies.kernels.splash.launch import splash_missing
from eqx_bsattn.strategies.kernels.splash.mask_info import TermsPredicate, block_info
from tests.conftest import np_mask

pytestmark = pytest.mark.skipif(splash_missing() is not None, reason=str(splash_missing()))

L, BLOCK = 640, 128


def _visits(data_next, block_mask, transposed: bool) -> set:
    """``{(row, block, class)}`` of one head's block-info arrays (rows: q-blocks, or kv-blocks
    when `transposed`)."""
    data_next, block_mask = np.asarray(data_next), np.asarray(block_mask)
    if transposed:
        data_next, block_mask = data_next.T, block_mask.T
    return {(row, int(data_next[row, s]), int(block_mask[row, s]))
            for row in range(data_next.shape[0]) for s in range(data_next.shape[1])
            if block_mask[row, s]}


def _splash_visits(dense: np.ndarray) -> tuple[set, set]:
    """The visits of Splash's own mask processing of a dense ``[L, L]`` mask (forward, dk/dv)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as mask_lib,
        splash_attention_mask_info as info_lib,
    )

    heads = mask_lib.MultiHeadMask([mask_lib.NumpyMask(dense)])
    fwd, _ = info_lib.process_mask(heads, (BLOCK, BLOCK))
    dkv, _ = info_lib.process_mask_dkv(heads, (BLOCK, BLOCK))
    return _visits(fwd.data_next[0], fwd.block_mask[0], False), _visits(
        dkv.data_next[0], dkv.block_mask[0], True)


@pytest.mark.parametrize("name", ["causal", "window", "not_window",
                                  pytest.param("document", marks=pytest.mark.slow)])
def test_block_info_visits_what_splash_would(name):
    """Our block-info arrays, gathered from the layout, list the blocks (and their classes)
    that Splash's own O(L^2) processing of the dense mask lists."""
    ids = np.repeat(np.arange(4, dtype=np.int32), [100, 300, 40, 200])
    mask, data = {
        "causal": (masks.Causal(), {}),
        "window": (masks.Causal() & masks.SlidingWindow(200, 0), {}),
        "not_window": (~masks.SlidingWindow(130), {}),
        "document": (masks.Causal() & masks.Document(),
                     {"q_segment_ids": ids[None], "kv_segment_ids": ids[None]}),
    }[name]
    resolved = bsa.ResolvedMask(mask, q_len=L, kv_len=L, num_heads=1,
                                **{n: jnp.asarray(x) for n, x in data.items()})
    compiled = resolved.compile(bsa.Tiling(block_q=BLOCK, block_kv=BLOCK), "terms")
    n = L // BLOCK
    fwd = block_info(compiled.forward, transposed=False, num_q_blocks=n, num_kv_blocks=n)
    dkv = block_info(compiled.dkv, transposed=True, num_q_blocks=n, num_kv_blocks=n)
    assert compiled.forward.is_static == (name != "document")
    dense = np_mask(mask, q_len=L, kv_len=L, heads=1,
                    q_seg=data.get("q_segment_ids", [None])[0],
                    kv_seg=data.get("kv_segment_ids", [None])[0])[0]
    want_fwd, want_dkv = _splash_visits(dense)
    assert _visits(fwd.data_next[0, 0], fwd.block_mask[0, 0], False) == want_fwd
    assert _visits(dkv.data_next[0, 0], dkv.block_mask[0, 0], True) == want_dkv


def test_block_info_padding_rows_visit_nothing_and_skipped_slots_refetch_nothing():
    layout = bsa.build_layout(masks.Causal(), q_len=300, kv_len=300, num_heads=1,
                              block_q=BLOCK, block_kv=BLOCK)
    info = block_info(layout, transposed=False, num_q_blocks=4, num_kv_blocks=4)
    assert info.block_mask.shape == (1, 1, 4, 3)  # rows padded to 4; 3 slots (longest row)
    assert not info.block_mask[0, 0, 3].any()
    # Row 0 visits block 0 only; its other slots repeat it (no new fetch).
    assert info.block_mask[0, 0, 0].tolist() == [1, 0, 0]
    assert info.data_next[0, 0, 0].tolist() == [0, 0, 0]


def test_terms_predicate():
    terms = (masks.Causal(offset=2) & masks.SlidingWindow(5, None) & masks.ChunkedCausal(8)
             & masks.PrefixLM(3)).terms(0)
    predicate = TermsPredicate.from_terms(terms, kv_len=30)
    q, k = np.arange(32)[:, None], np.arange(32)[None, :]
    want = np.zeros((32, 32), bool)
    want[:30, :30] = np_mask(masks.Causal(offset=2) & masks.SlidingWindow(5, None)
                             & masks.ChunkedCausal(8) & masks.PrefixLM(3),
                             q_len=30, kv_len=30, heads=1)[0]
    assert (np.asarray(predicate(jnp.asarray(q), jnp.asarray(k)))[:30] == want[:30]).all()
    assert TermsPredicate.from_terms(masks.Full().terms(0), kv_len=None) is None
    assert TermsPredicate.from_terms(None, kv_len=30) == TermsPredicate(kv_len=30)


def test_selector_picks_splash_on_tpu_only():
    features = bsa.Features(platform="tpu", q_len=1024, kv_len=1024, dtype="bfloat16")
    assert bsa.select_kernel(masks.Causal(), "tpu", features).kernel.name == "splash"
    with_bias = bsa.select_kernel(masks.Causal(), "tpu", bsa.Features(
        platform="tpu", q_len=1024, kv_len=1024, dtype="bfloat16", bias=True))
    assert with_bias.kernel.name == "xla"
    assert ("splash", "Splash attention has no additive bias.") in with_bias.declined
    assert bsa.select_kernel(masks.Causal(), "cpu").kernel.name != "splash"
    assert _kernel_for("pallas") == (None, "tpu")  # the selector's pick on a TPU


def test_selector_declines_a_mask_array_on_tpu():
    """An `ArrayMask` has no in-kernel terms and its bitmaps would come from per-call data:
    Splash declines it at selection (it raised when called), with or without other terms, and
    the call goes to `PallasTpuBlockSparse`."""
    features = bsa.Features(platform="tpu", q_len=256, kv_len=256, dtype="bfloat16")
    array = masks.ArrayMask(jnp.asarray(np.tril(np.ones((256, 256), bool))))
    for mask in (array, array & masks.Causal()):
        choice = bsa.select_kernel(mask, "tpu", features)
        # PallasTpuBlockSparse reads the array's element tiles: it takes what Splash declines.
        assert choice.kernel.name == "pallas_tpu", choice.explain()
        assert "declined splash" in choice.explain()
        assert any(name == "splash" and "mask arrays" in why for name, why in choice.declined)


def test_adapt_tiling_rounds_blocks_to_lanes():
    kernel = kernels.SplashBlockSparse()
    features = bsa.Features(platform="tpu", q_len=300, kv_len=1000)
    tiling = kernel.adapt_tiling(bsa.Tiling(block_q=16, block_kv=600, block_q_bwd=512),
                                 features)
    assert isinstance(tiling, bsa.kernels.SplashConfig)
    assert tiling.blocks == bsa.PassBlocks((128, 640), (384, 640), (384, 640))


def _attend(kernel, mask, q, k, v, platform=None, **kw):
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel)

    @jax.jit
    def run(q, k, v):
        def f(q, k, v):
            plan = attn.plan(q, k, v, platform=platform, **kw)
            return run_plan(plan, q, k, v, attn.sharding, None, False)

        out, pullback = jax.vjp(f, q, k, v)
        return out, pullback(jnp.cos(out))

    return run(q, k, v)


@pytest.mark.slow
def test_tpu_head_dims_are_padded_and_exact():
    """A TPU call pads head dims to 64 or a multiple of 128 (here 40 -> 128, 24 -> 128): run it
    in interpret mode and compare with the reference."""
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (1, 2, 130, 40))
    k = jax.random.normal(keys[1], (1, 1, 130, 40))
    v = jax.random.normal(keys[2], (1, 1, 130, 24))
    mask = masks.Causal() & masks.SlidingWindow(50, 0)
    got = _attend(kernels.SplashBlockSparse(interpret=True), mask, q, k, v, platform="tpu")
    want = _attend(kernels.DenseReference(), mask, q, k, v)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, atol=3e-5, rtol=3e-5)


@pytest.mark.slow
def test_pallas_platform_runs_splash():
    keys = jax.random.split(jax.random.key(4), 3)
    q, k, v = (jax.random.normal(key, (1, 2, 64, 16)) for key in keys)
    got = bsa.blocksparse_attention(q, k, v, causal=True, sliding_window=20, platform="pallas")
    want = bsa.blocksparse_attention(q, k, v, causal=True, sliding_window=20, platform="dense")
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_a_q_block_that_visits_nothing_gives_zeros():
    """Rows 0-127 see no key: their q-block has no visited block at all, so Splash's grid
    skips every slot of it. Output and gradients match the reference (zeros there)."""
    keys = jax.random.split(jax.random.key(5), 3)
    q, k, v = (jax.random.normal(key, (1, 2, 256, 16)) for key in keys)
    mask = masks.Causal(offset=-130)
    got = _attend(kernels.SplashBlockSparse(), mask, q, k, v)
    want = _attend(kernels.DenseReference(), mask, q, k, v)
    assert not np.asarray(got[0][:, :, :128]).any()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, atol=3e-5, rtol=3e-5)
