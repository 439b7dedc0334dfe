"""`blocksparse_attention` with the remaining arguments of ejKernel's function, against the
float64 oracle: `attention_mask` (and `masks.ArrayMask`), platform names, ejKernel's `cfg`, the
per-head `mask_builder` form, `kv_segment_ids` defaulting to `q_segment_ids`, `qkv_layouts`
names and `MaskInfo`."""

import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks
from eqx_bsattn._api import _mask_from_builder, _tiling_from_cfg
from tests.conftest import (
    assert_close,
    jnp_attention_f64,
    np_attention,
    np_visibility,
    random_array,
    random_inputs,
    sorted_segments,
    to_f64,
)

B, H, HKV, LQ, LK = 2, 4, 2, 20, 28
CFG = {"block_q": 8, "block_kv": 8}  # ragged tiles with empty, partial and full blocks
KERNELS = ["reference", "xla"]
DOC = masks.Causal() & masks.Document()  # the mask a call with segment ids gets


@pytest.fixture(scope="module")
def qkv():
    return random_inputs(3, batch=B, heads=H, kv_heads=HKV, q_len=LQ, kv_len=LK, dim=8,
                         value_dim=6)


def _mask_array(seed: int, shape) -> np.ndarray:
    """Random booleans with whole 8x8 tiles on and off, and two rows that see nothing."""
    rng = np.random.default_rng(seed)
    m = rng.random(shape) < 0.5
    m[..., :8, 8:16] = True
    m[..., 8:16, :8] = False
    m[..., 3, :] = False
    m[..., LQ - 1, :] = False
    return m


def _causal(batch=B, heads=H, q_len=LQ, kv_len=LK):
    return np_visibility(masks.Causal(), batch=batch, heads=heads, q_len=q_len, kv_len=kv_len)


# The accepted shapes of `attention_mask` for [B, H, Lq, Lk] queries, and their [B|1, H|1, ...].
SHAPES = {
    "[Lq, Lk]": ((LQ, LK), lambda m: m[None, None]),
    "[B, Lq, Lk]": ((B, LQ, LK), lambda m: m[:, None]),
    "[1, 1, Lq, Lk]": ((1, 1, LQ, LK), lambda m: m),
    "[1, H, Lq, Lk]": ((1, H, LQ, LK), lambda m: m),
    "[B, H, Lq, Lk]": ((B, H, LQ, LK), lambda m: m),
    "[B, 1, Lq, Lk] ints": ((B, 1, LQ, LK), lambda m: m),
}


#: (shape, kernel) pairs of the quick subset (``-m "not slow"``); the rest are `slow`.
_QUICK_SHAPES = {("[B, 1, Lq, Lk] ints", "xla")}


@pytest.mark.parametrize("shape,kernel", [
    pytest.param(shape, kernel, id=f"{shape}-{kernel}",
                 marks=() if (shape, kernel) in _QUICK_SHAPES else pytest.mark.slow)
    for shape in SHAPES for kernel in KERNELS])
def test_attention_mask_shapes(qkv, kernel, shape):
    q, k, v = qkv
    dims, as4 = SHAPES[shape]
    m = _mask_array(0, dims)
    given = m.astype(np.int32) if shape.endswith("ints") else m
    out = bsa.blocksparse_attention(q, k, v, attention_mask=given, platform=kernel, cfg=CFG)
    want = np_attention(q, k, v, _causal() & as4(m))
    assert_close(out, want, 2e-5, shape)
    assert np.all(np.asarray(out)[:, :, 3] == 0)  # a row that sees nothing gives zeros


@pytest.mark.slow
def test_attention_mask_with_segments_bias_sinks_and_gradients(qkv):
    q, k, v = qkv
    m = _mask_array(1, (B, H, LQ, LK))
    rng = np.random.default_rng(0)
    q_seg = sorted_segments(rng, B, LQ, 3, pad=2)
    kv_seg = sorted_segments(rng, B, LK, 3)
    bias = random_array(7, (B, 1, LQ, LK))
    sinks = random_array(8, (H,))
    vis = np_visibility(DOC, batch=B, heads=H, q_len=LQ, kv_len=LK, q_seg=q_seg,
                        kv_seg=kv_seg) & m

    def run(q, k, v, bias, sinks):
        return bsa.blocksparse_attention(q, k, v, sinks, bias, attention_mask=m,
                                         q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                         platform="xla", cfg=CFG)

    assert_close(run(q, k, v, bias, sinks),
                 np_attention(q, k, v, vis, bias=bias, sinks=sinks), 2e-5)
    cot = random_array(9, (B, H, LQ, 6))
    grads = jax.grad(lambda *a: jnp.sum(run(*a) * cot), argnums=(0, 1, 2, 3, 4))(
        q, k, v, bias, sinks)
    with jax.enable_x64(True):
        want = jax.grad(
            lambda *a: jnp.sum(jnp_attention_f64(*a[:3], vis, bias=a[3], sinks=a[4]) * to_f64(cot)),
            argnums=(0, 1, 2, 3, 4))(*map(to_f64, (q, k, v, bias, sinks)))
        want = [np.asarray(g) for g in want]
    for name, got, exp in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads, want):
        assert_close(got, exp, 5e-5, name)


def test_attention_mask_under_jit_never_recompiles(qkv):
    q, k, v = qkv
    traces = []

    @jax.jit
    def run(q, k, v, m):
        traces.append(1)
        return bsa.blocksparse_attention(q, k, v, attention_mask=m, platform="xla", cfg=CFG)

    for seed in (2, 3):
        m = _mask_array(seed, (B, H, LQ, LK))
        assert_close(run(q, k, v, m), np_attention(q, k, v, _causal() & m), 2e-5, f"mask {seed}")
    assert len(traces) == 1


@pytest.mark.slow
def test_attention_mask_unbatched_and_soft_cap(qkv):
    q, k, v = (x[0] for x in qkv)
    m = _mask_array(4, (H, LQ, LK))
    out = bsa.blocksparse_attention(q, k, v, attention_mask=m, logits_soft_cap=2.0,
                                    platform="xla", cfg=CFG)
    want = np_attention(q[None], k[None], v[None], _causal(batch=1) & m[None], soft_cap=2.0)
    assert_close(out, want[0], 2e-5)
    # Under a soft cap a -inf bias becomes -cap: it no longer hides the key, the mask does.
    bias = np.where(m, 0.0, -np.inf).astype(np.float32)
    capped = bsa.blocksparse_attention(q, k, v, None, bias, logits_soft_cap=2.0, platform="xla")
    assert np.abs(np.asarray(capped) - want[0]).max() > 1e-2


@pytest.mark.slow
def test_array_mask_algebra_and_layout(qkv):
    q, k, v = qkv
    m = _mask_array(5, (LQ, LK))
    window = np_visibility(masks.SlidingWindow(3, 0), batch=1, heads=1, q_len=LQ, kv_len=LK)[0, 0]
    causal = _causal(1, 1)[0, 0]
    cases = {
        "(window | array) & causal": ((masks.SlidingWindow(3, 0) | masks.ArrayMask(m))
                                      & masks.Causal(), (window | m) & causal),
        "~array": (~masks.ArrayMask(m), ~m),
    }
    for name, (mask, vis) in cases.items():
        attn = bsa.BlockSparseAttention(mask=mask, kernel=bsa.kernels.XlaBlockSparse(),
                                        tiling=bsa.Tiling(8, 8))
        assert_close(attn(q, k, v), np_attention(q, k, v, vis), 2e-5, name)
        layout = bsa.build_layout(mask, q_len=LQ, kv_len=LK, num_heads=H, block_q=8, block_kv=8)
        pad = np.zeros((24, 32), bool)
        pad[:LQ, :LK] = vis
        valid = np.zeros((24, 32), bool)
        valid[:LQ, :LK] = True
        tiles = lambda x: x.reshape(3, 8, 4, 8).transpose(0, 2, 1, 3).reshape(3, 4, 64)  # noqa: E731
        any_ = tiles(pad).any(-1)
        all_ = (tiles(pad) | ~tiles(valid)).all(-1)
        classes = np.asarray(layout.classes)[0, 0]
        assert ((classes == masks.EMPTY) == ~any_).all(), name
        assert ((classes == masks.FULL) == (all_ & any_ & (np.arange(4) < 3))).all(), name
        assert not layout.is_static  # built on the device, like segment ids


def test_platform_names(qkv):
    q, k, v = qkv
    want = bsa.blocksparse_attention(q, k, v)
    assert_close(bsa.blocksparse_attention(q, k, v, platform="auto"), want, 1e-6)
    if jax.default_backend() == "cpu":
        for kw in ({"platform": "cuda"}, {"cfg": {"fwd_params": {"q_blocksize": 8,
                                                                 "kv_blocksize": 8},
                                                  "platform": "cuda"}}):
            with pytest.raises(ValueError, match="JAX finds no gpu device"):
                bsa.blocksparse_attention(q, k, v, **kw)


def _seed_cfg(fwd, bwd, platform=None):
    return types.SimpleNamespace(
        fwd_params=types.SimpleNamespace(**fwd), bwd_params=types.SimpleNamespace(**bwd),
        platform=platform, backend="any")


def test_seed_cfg_maps_onto_tiling(qkv):
    fwd = dict(q_blocksize=16, kv_blocksize=8, num_warps=4, num_stages=2)
    bwd = dict(q_blocksize=8, kv_blocksize=16, num_warps=8, num_stages=None)
    # Warps and stages are Triton's: Triton runs them in its TritonConfig, other kernels take
    # the blocks.
    want = dict(block_q=16, block_kv=8, num_warps=4, num_stages=2, block_q_bwd=8,
                block_kv_bwd=16, num_warps_bwd=8)
    tiling, platform = _tiling_from_cfg(_seed_cfg(fwd, bwd, "xla"))
    assert platform == "xla" and _tiling_from_cfg({"fwd_params": fwd, "bwd_params": bwd}) == (
        tiling, None)
    features = bsa.Features(q_len=64, kv_len=64)
    resolved = bsa.ResolvedMask(bsa.masks.Causal(), q_len=64, kv_len=64, num_heads=1)
    xla, _ = tiling.choose(bsa.kernels.XlaBlockSparse(), features, resolved)
    assert xla == bsa.Tiling(block_q=16, block_kv=8, block_q_bwd=8, block_kv_bwd=16)
    with pytest.raises(ValueError, match="TritonConfig.block_kv to be a power of two .* got 8"):
        tiling.choose(bsa.kernels.TritonBlockSparse(), features, resolved)
    wide = {"fwd_params": {**fwd, "kv_blocksize": 32}, "bwd_params": {**bwd, "q_blocksize": 16}}
    triton, _ = _tiling_from_cfg(wide)[0].choose(bsa.kernels.TritonBlockSparse(), features,
                                                 resolved)
    assert triton == bsa.kernels.TritonConfig(**{**want, "block_kv": 32, "block_q_bwd": 16})
    q, k, v = qkv
    out = bsa.blocksparse_attention(q, k, v, cfg=_seed_cfg(fwd, bwd, "xla"))
    assert_close(out, np_attention(q, k, v, _causal()), 2e-5)


def test_mask_builder_per_head_form(qkv):
    q, k, v = qkv
    calls = []
    per_head = [masks.SlidingWindow(4, 0), masks.ChunkedCausal(8)] * 2

    def builder(q_len, kv_len, num_heads, head_idx, num_reps):
        calls.append((q_len, kv_len, num_heads, head_idx, num_reps))
        return per_head[head_idx]

    out = bsa.blocksparse_attention(q, k, v, mask_builder=builder, platform="xla", cfg=CFG)
    assert calls == [(LQ, LK, H, h, H // HKV) for h in range(H)]
    vis = np_visibility(masks.PerHead(per_head) & masks.Causal(), batch=B, heads=H, q_len=LQ,
                        kv_len=LK)
    assert_close(out, np_attention(q, k, v, vis), 2e-5)
    # One mask for every head stays one mask (no per-head layouts); a `*args` builder is
    # called with no arguments.
    window = masks.SlidingWindow(4, 0)
    assert _mask_from_builder(lambda a, b, c, d, e: window, LQ, LK, H, HKV) == window
    assert _mask_from_builder(lambda *a: window if not a else None, LQ, LK, H, HKV) == window
    assert _mask_from_builder(builder, LQ, LK, H, HKV) == masks.PerHead(per_head)


@pytest.mark.slow
def test_kv_segment_ids_default_to_q_segment_ids():
    q, k, v = random_inputs(4, batch=B, heads=H, kv_heads=HKV, q_len=LQ, dim=8)
    seg = sorted_segments(np.random.default_rng(1), B, LQ, 3, pad=1)
    out = bsa.blocksparse_attention(q, k, v, q_segment_ids=seg, platform="xla", cfg=CFG)
    vis = np_visibility(DOC, batch=B, heads=H, q_len=LQ, kv_len=LQ, q_seg=seg,
                        kv_seg=seg)
    assert_close(out, np_attention(q, k, v, vis), 2e-5)


def test_qkv_layouts(qkv):
    q, k, v = qkv
    want = np_attention(q, k, v, _causal())
    bshd = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
    out = bsa.blocksparse_attention(*bshd, qkv_layouts="BSHD", platform="xla")
    assert out.shape == (B, LQ, H, 6)
    assert_close(jnp.swapaxes(out, 1, 2), want, 2e-5)
    mixed = bsa.blocksparse_attention(q, bshd[1], bshd[2], qkv_layouts=("bhsd", "bshd", "bshd"))
    assert_close(mixed, want, 2e-5)


@pytest.mark.slow
def test_mask_info_carries_everything(qkv):
    q, k, v = qkv
    rng = np.random.default_rng(2)
    data = dict(q_segment_ids=sorted_segments(rng, B, LQ, 2),
                kv_segment_ids=sorted_segments(rng, B, LK, 2),
                q_positions=np.arange(LQ)[None].repeat(B, 0) + 8,
                kv_positions=np.arange(LK)[None].repeat(B, 0),
                attention_mask=_mask_array(6, (B, 1, LQ, LK)))
    via_info = bsa.blocksparse_attention(q, k, v, mask_info=bsa.MaskInfo(**data), platform="xla",
                                         cfg=CFG)
    vis = np_visibility(DOC, batch=B, heads=H, q_len=LQ, kv_len=LK,
                        q_pos=data["q_positions"], kv_pos=data["kv_positions"],
                        q_seg=data["q_segment_ids"], kv_seg=data["kv_segment_ids"])
    assert_close(via_info, np_attention(q, k, v, vis & data["attention_mask"]), 2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("spelled", ["[B, Lk]", "[B, 1, 1, Lk]"])
def test_key_padding_attention_mask(qkv, spelled):
    """ejKernel reads a 2-D `attention_mask` as key padding ``[B, Lk]``; so does this door
    (also spelled ``[B, 1, 1, Lk]``), with segment ids or without, and padding garbage in the
    hidden keys changes nothing."""
    q, k, v = qkv
    rng = np.random.default_rng(4)
    keep = rng.random((B, LK)) < 0.7
    keep[1] = False  # an example that sees no key at all gives zeros
    given = keep if spelled == "[B, Lk]" else keep[:, None, None, :]
    k_bad = jnp.where(keep[:, None, :, None], k, jnp.nan)
    out = bsa.blocksparse_attention(q, k_bad, v, attention_mask=given, platform="xla", cfg=CFG)
    assert_close(out, np_attention(q, k, v, _causal() & keep[:, None, None, :]), 2e-5)
    q_seg = sorted_segments(rng, B, LQ, 3)
    kv_seg = sorted_segments(rng, B, LK, 3)
    out = bsa.blocksparse_attention(q, k, v, attention_mask=given, q_segment_ids=q_seg,
                                    kv_segment_ids=kv_seg, platform="reference")
    vis = np_visibility(DOC, batch=B, heads=H, q_len=LQ, kv_len=LK, q_seg=q_seg, kv_seg=kv_seg)
    assert_close(out, np_attention(q, k, v, vis & keep[:, None, None, :]), 2e-5)


def test_softmax_aux_of_kv_head_length_is_one_sink_per_kv_head(qkv):
    """ejKernel's XLA backend reads `softmax_aux` of length ``Hkv`` (``!= H``) as one sink per
    kv head, repeated over its query heads (and ``[Hkv, S]`` likewise); so does every entry
    point here: the module's `sinks` agree with the function, without a warning."""
    q, k, v = qkv
    aux = random_array(5, (HKV,)) * 3.0
    out = bsa.blocksparse_attention(q, k, v, aux, platform="reference")
    per_head = np.repeat(np.asarray(aux), H // HKV)
    assert_close(out, np_attention(q, k, v, _causal(), sinks=per_head), 2e-5)
    aux2 = random_array(6, (HKV, 3))
    out2 = bsa.blocksparse_attention(q, k, v, aux2, platform="reference")
    want2 = np_attention(q, k, v, _causal(), sinks=np.repeat(np.asarray(aux2), H // HKV, 0))
    assert_close(out2, want2, 2e-5)
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=bsa.kernels.DenseReference())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(attn(q, k, v, sinks=aux), out, 1e-6)
        assert_close(attn(q, k, v, sinks=aux2), out2, 1e-6)
    shared = attn(q, k, v, sinks=jnp.broadcast_to(aux, (H, HKV)))  # HKV sinks shared by all
    want_shared = np_attention(q, k, v, _causal(), sinks=np.broadcast_to(aux, (H, HKV)))
    assert_close(shared, want_shared, 2e-5)
