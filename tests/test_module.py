"""`BlockSparseAttention` and `blocksparse_attention`: transforms, strategy swaps, the selector,
the function API's options, and input validation."""

import dataclasses
import inspect
import re
import warnings
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn.contract import MaskReads
from eqx_bsattn import kernels, masks
from eqx_bsattn.strategies.kernels.reference import reference_attention
from tests.conftest import (
    assert_close,
    np_attention,
    np_visibility,
    random_array,
    random_inputs,
    sorted_segments,
)

REF = kernels.DenseReference()


def ref_attn(mask=masks.Full(), **kw):
    return bsa.BlockSparseAttention(mask=mask, kernel=REF, **kw)


def expected(mask, q, k, v, **kw):
    """The float64 NumPy truth for batched ``q, k, v``."""
    b, h, lq = q.shape[:3]
    vis = np_visibility(mask, batch=b, heads=h, q_len=lq, kv_len=k.shape[2])
    return np_attention(q, k, v, vis, **kw)


@pytest.fixture(scope="module")
def qkv():
    return random_inputs(0, batch=2, heads=4, kv_heads=2, q_len=20, kv_len=28, dim=8, value_dim=6)


# ---------------------------------------------------------------------------------------------
# Shapes and transforms.


def test_batched_call_matches_truth(qkv):
    q, k, v = qkv
    out = eqx.filter_jit(ref_attn(masks.Causal()))(q, k, v)
    assert out.shape == (2, 4, 20, 6) and out.dtype == jnp.float32
    assert_close(out, expected(masks.Causal(), q, k, v))


@pytest.mark.slow
def test_unbatched_call_equals_batched_slice(qkv):
    q, k, v = qkv
    attn = ref_attn(masks.SlidingWindow(3, 1))
    out = attn(q[1], k[1], v[1])
    assert out.shape == (4, 20, 6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(attn(q, k, v)[1]), rtol=1e-6, atol=1e-6)


def test_jit_and_filter_jit_agree(qkv):
    q, k, v = qkv
    attn = ref_attn(masks.Causal() & masks.SlidingWindow(5, 0))
    a = jax.jit(lambda q, k, v: attn(q, k, v))(q, k, v)
    b = eqx.filter_jit(lambda m, q, k, v: m(q, k, v))(attn, q, k, v)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert_close(a, expected(attn.mask, q, k, v))


@pytest.mark.slow
def test_vmap_over_unbatched_call(qkv):
    q, k, v = qkv
    attn = ref_attn(masks.Causal())
    rng = np.random.default_rng(0)
    seg = jnp.asarray(sorted_segments(rng, 2, 20, 3))
    kseg = jnp.asarray(sorted_segments(rng, 2, 28, 3))
    vm = jax.jit(jax.vmap(lambda q, k, v, s, ks: attn(q, k, v, q_segment_ids=s, kv_segment_ids=ks)))
    got = vm(q, k, v, seg, kseg)
    want = attn(q, k, v, q_segment_ids=seg, kv_segment_ids=kseg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    bias = random_array(4, (2, 4, 20, 28))
    got = jax.vmap(lambda q, k, v, b: attn(q, k, v, bias=b))(q, k, v, bias)
    np.testing.assert_allclose(np.asarray(got), np.asarray(attn(q, k, v, bias=bias)), rtol=1e-6,
                               atol=1e-6)


def test_grad_and_checkpoint_agree(qkv):
    q, k, v = qkv
    attn = ref_attn(masks.Causal(bottom_right=True))

    def loss(q, k, v):
        return jnp.sum(jnp.sin(attn(q, k, v)))

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    gc = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g, gc):
        assert np.abs(np.asarray(a)).max() > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_module_is_a_pytree_of_strategies():
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), softmax_scale=0.5)
    # The mask (it holds no arrays), kernel, tiling and sharding are leaves that are not
    # arrays; no parameters.
    assert jax.tree_util.tree_leaves(attn) == [masks.Causal(), bsa.AutoKernel(),
                                               bsa.AutoTiling(), bsa.sharding.Unsharded()]
    assert jax.tree_util.tree_leaves(eqx.filter(attn, eqx.is_array)) == []
    assert attn == bsa.BlockSparseAttention(mask=masks.Causal(), softmax_scale=0.5)
    assert attn != bsa.BlockSparseAttention(mask=masks.Causal(), softmax_scale=0.25)


@pytest.mark.slow
def test_tree_at_swaps_and_retraces(qkv):
    q, k, v = qkv
    traces = []

    @eqx.filter_jit
    def run(m, q, k, v):
        traces.append(1)
        return m(q, k, v)

    attn = ref_attn(masks.Causal())
    a = run(attn, q, k, v)
    run(ref_attn(masks.Causal()), q, k, v)  # an equal module: no new trace
    assert len(traces) == 1
    swapped = eqx.tree_at(lambda m: m.mask, attn, masks.SlidingWindow(2))
    b = run(swapped, q, k, v)
    assert len(traces) == 2
    assert_close(a, expected(masks.Causal(), q, k, v))
    assert_close(b, expected(masks.SlidingWindow(2), q, k, v))
    # The reference ignores the tiling; the block-sparse kernel reads it (16x16 tiles over
    # 20 queries and 28 keys: ragged in both), so the swap must retrace and stay exact.
    xla = eqx.tree_at(lambda m: m.kernel, attn, kernels.XlaBlockSparse())
    c = run(xla, q, k, v)
    assert len(traces) == 3
    tiled = eqx.tree_at(lambda m: m.tiling, xla, bsa.Tiling(block_q=16, block_kv=16))
    assert tiled.tiling == bsa.Tiling(block_q=16, block_kv=16) and xla.tiling == bsa.AutoTiling()
    d = run(tiled, q, k, v)
    assert len(traces) == 4, "swapping the tiling must retrace"
    assert_close(c, expected(masks.Causal(), q, k, v))
    assert_close(d, expected(masks.Causal(), q, k, v))
    doubled = eqx.tree_at(lambda m: m.kernel, attn, DoubledReference())
    np.testing.assert_allclose(np.asarray(doubled(q, k, v)), 2 * np.asarray(a), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Kernels: registry and selector.


class DoubledReference(bsa.AbstractKernel):
    """A user kernel: twice the reference's output. Not an automatic candidate anywhere."""

    name: ClassVar[str] = "test-doubled"
    platforms: ClassVar[tuple[str, ...]] = ("cpu", "gpu", "tpu")
    reads: ClassVar[MaskReads] = "dense"

    @classmethod
    def priority(cls, platform):
        return None

    def decline_reason(self, mask, features):
        return None

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        return 2 * reference_attention(query, key, value, mask=mask, inputs=inputs,
                                       softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap)


class _Declines(bsa.AbstractKernel):
    name: ClassVar[str] = "test-declines"
    platforms: ClassVar[tuple[str, ...]] = ("test-platform",)
    reads: ClassVar[MaskReads] = "dense"
    reason: str = eqx.field(default="it never runs anything", static=True)

    @classmethod
    def priority(cls, platform):
        return 100 if platform == "test-platform" else None

    def decline_reason(self, mask, features):
        return self.reason

    def __call__(self, query, key, value, **kw):
        raise AssertionError("a declining kernel was called")


class _AcceptsNoBias(bsa.AbstractKernel):
    name: ClassVar[str] = "test-no-bias"
    platforms: ClassVar[tuple[str, ...]] = ("test-platform", "cpu")
    reads: ClassVar[MaskReads] = "dense"

    @classmethod
    def priority(cls, platform):
        return 50 if platform == "test-platform" else None

    def decline_reason(self, mask, features):
        return "it takes no bias" if features.bias else None

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        return reference_attention(query, key, value, mask=mask, inputs=inputs,
                                   softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap)


def test_user_kernels_register_themselves():
    registered = bsa.registered_kernels()
    assert DoubledReference in registered and _Declines in registered
    assert kernels.DenseReference in registered
    assert bsa.AbstractKernel not in registered
    assert DoubledReference.priority("cpu") is None


def test_user_kernel_runs_in_the_module(qkv):
    q, k, v = qkv
    out = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=DoubledReference())(q, k, v)
    assert_close(out, 2 * expected(masks.Causal(), q, k, v))


def test_select_kernel_orders_by_priority_and_explains():
    choice = bsa.select_kernel(masks.Causal(), "test-platform")
    assert isinstance(choice.kernel, _AcceptsNoBias)
    assert choice.declined == (("test-declines", "it never runs anything"),)
    text = choice.explain()
    assert text.startswith("test-no-bias: priority 50, the highest on test-platform among the "
                           "registered kernels that accept this call; test-declines (100) ranks "
                           "higher but declined")
    assert "declined test-declines: it never runs anything" in text
    given = bsa.select_kernel(masks.Causal(), "test-platform",
                              candidates=[_Declines(), _AcceptsNoBias()])
    assert given.reason == ("candidate 2 of the 2 given, the first that accepts this call; "
                            "declined before it: test-declines")
    # With a bias the second declines too; the built-in kernels, whose priorities hold on
    # every platform, decline a platform they do not list: every reason is in the error.
    with pytest.raises(bsa.NoKernelError) as info:
        bsa.select_kernel(masks.Causal(), "test-platform", bsa.Features(platform="cpu", bias=True))
    msg = str(info.value)
    assert msg.index("test-declines") < msg.index("test-no-bias: it takes no bias")
    assert "reference: runs on cpu / gpu / tpu only; this call runs on 'test-platform'" in msg


def test_select_kernel_on_cpu_picks_a_cpu_candidate():
    choice = bsa.select_kernel(masks.Causal(), "cpu")
    cls = type(choice.kernel)
    assert cls.priority("cpu") is not None
    assert choice.kernel.name in choice.explain()
    # Nothing with a higher cpu priority was skipped silently.
    for other in bsa.registered_kernels():
        p = other.priority("cpu")
        if p is not None and p > cls.priority("cpu"):
            assert other.name in dict(choice.declined)


def test_no_kernel_error_lists_every_candidate():
    candidates = [_Declines(), _Declines(reason="the moon is full"), _AcceptsNoBias()]
    with pytest.raises(bsa.NoKernelError) as info:
        bsa.select_kernel(masks.Causal(), "test-platform", bsa.Features(bias=True),
                          candidates=candidates)
    msg = str(info.value)
    assert "it never runs anything" in msg and "the moon is full" in msg
    assert "test-no-bias: it takes no bias" in msg
    assert isinstance(info.value, ValueError)
    with pytest.raises(bsa.NoKernelError, match="no kernel is registered"):
        bsa.select_kernel(masks.Causal(), "cpu", candidates=[])
    with pytest.raises(TypeError, match="mask"):
        bsa.select_kernel("causal", "cpu")


def test_explicit_kernel_that_declines_raises(qkv):
    q, k, v = qkv
    attn = bsa.BlockSparseAttention(kernel=_AcceptsNoBias())
    attn(q, k, v)
    with pytest.raises(ValueError, match="test-no-bias.*no bias"):
        attn(q, k, v, bias=random_array(1, (20, 28)))


def test_plan_reports_features_and_choice(qkv, monkeypatch):
    # This call is small enough to run dense on a CPU (`_selector.small_call`); the rule off,
    # the block-sparse plan's report is read.
    monkeypatch.setattr("eqx_bsattn._selector.SMALL_CALL_PAIRS", 0)
    q, k, v = qkv
    rng = np.random.default_rng(0)
    seg = sorted_segments(rng, 2, 20, 2)
    plan = bsa.BlockSparseAttention(mask=masks.Causal(), logits_soft_cap=5.0).plan(
        q, k, v, q_segment_ids=seg, kv_segment_ids=sorted_segments(rng, 2, 28, 2),
        sinks=random_array(2, (4,)))
    f = plan.features
    assert (f.batch, f.num_heads, f.num_kv_heads, f.q_len, f.kv_len, f.head_dim, f.value_dim) == (
        2, 4, 2, 20, 28, 8, 6)
    assert f.segment_ids and f.sinks and f.soft_cap and not f.bias and not f.positions
    assert plan.mask.uses_segment_ids  # Document was added for the segment ids
    assert plan.choice is not None and plan.choice.kernel is plan.kernel
    assert plan.softmax_scale == pytest.approx(1 / np.sqrt(8))
    assert plan.tiling_source == "heuristic"
    text = plan.explain()
    assert text == str(plan)
    # Why it won: its cpu priority, the highest among those that accept the call, and the
    # candidates below it, each with its priority.
    top = type(plan.kernel).priority("cpu")
    below = [c for c in bsa.registered_kernels()
             if c.priority("cpu") is not None and c.priority("cpu") < top]
    assert below and f"kernel {plan.kernel.name}: priority {top}, the highest on cpu among the " \
        "registered kernels that accept this call; below it: " in text
    for cls in below:
        assert f"{cls.name} ({cls.priority('cpu')})" in text
    assert "mask terms: causal_offset=0, segment_ids=True" in text
    for name in ("forward", "dq", "dkv"):
        layout = getattr(plan.mask, name)
        assert f"pass {name}: {layout.block_q}x{layout.block_kv} tiles" in text
    assert "built on the device per call" in text  # the segment ids shape the layout
    assert plan.inputs.sinks.shape == (4, 1)


def test_default_kernel_matches_truth(qkv):
    """With no kernel the selector's pick runs and agrees with the float64 truth."""
    q, k, v = qkv
    attn = bsa.BlockSparseAttention(mask=masks.Causal() & masks.SlidingWindow(6, 0))
    out = eqx.filter_jit(attn)(q, k, v)
    assert_close(out, expected(attn.mask, q, k, v), 2e-5)


# ---------------------------------------------------------------------------------------------
# blocksparse_attention.


def test_function_default_is_causal(qkv):
    q, k, v = qkv
    out = bsa.blocksparse_attention(q, k, v, platform="reference")
    assert_close(out, expected(masks.Causal(), q, k, v))
    out = bsa.blocksparse_attention(q, k, v, causal=False, platform="reference")
    assert_close(out, expected(masks.Full(), q, k, v))


@pytest.mark.parametrize("kw,mask", [
    (dict(sliding_window=4), masks.Causal() & masks.SlidingWindow(4)),
    (dict(sliding_window=(3, 2), causal=False), masks.SlidingWindow(3, 2)),
    (dict(sliding_window=(None, 1), causal=False), masks.SlidingWindow(None, 1)),
    (dict(chunk_size=7), masks.ChunkedCausal(7)),
    (dict(mask_builder=masks.PrefixLM(5)), masks.PrefixLM(5) & masks.Causal()),
    (dict(mask_builder=lambda: masks.GlobalTokens(3), causal=False), masks.GlobalTokens(3)),
    (dict(mask_builder=masks.Dilated(2), causal=False, sliding_window=(9, 0)),
     masks.Dilated(2) & masks.SlidingWindow(9, 0)),
])
def test_function_mask_options(qkv, kw, mask):
    q, k, v = qkv
    out = bsa.blocksparse_attention(q, k, v, platform="reference", **kw)
    assert_close(out, expected(mask, q, k, v))


def test_function_scalars_sinks_bias_positional(qkv):
    q, k, v = qkv
    sinks = random_array(5, (4, 2))
    bias = random_array(6, (2, 1, 20, 28))
    out = bsa.blocksparse_attention(q, k, v, sinks, bias, softmax_scale=0.3, logits_soft_cap=2.0,
                                    platform="reference")
    assert_close(out, expected(masks.Causal(), q, k, v, scale=0.3, bias=bias, sinks=sinks,
                               soft_cap=2.0))
    # Integer scalars are accepted like floats.
    a = bsa.blocksparse_attention(q, k, v, softmax_scale=1, logits_soft_cap=3, platform="reference")
    b = bsa.blocksparse_attention(q, k, v, softmax_scale=1.0, logits_soft_cap=3.0,
                                  platform="reference")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # `bias=` by keyword is jax.nn's spelling: the call reads as jax.nn's, not causal.
    assert_close(bsa.blocksparse_attention(q, k, v, bias=bias, platform="reference"),
                 expected(masks.Full(), q, k, v, bias=bias))


@pytest.mark.slow
def test_function_segment_ids_mask_info_and_purify(qkv):
    q, k, v = qkv
    rng = np.random.default_rng(2)
    qs = jnp.asarray(sorted_segments(rng, 2, 20, 3, pad=3))
    ks = jnp.asarray(sorted_segments(rng, 2, 28, 3, pad=2))
    direct = bsa.blocksparse_attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks,
                                       platform="reference")
    info = bsa.MaskInfo(q_segment_ids=qs, kv_segment_ids=ks)
    via_info = bsa.blocksparse_attention(q, k, v, mask_info=info, platform="reference")
    np.testing.assert_array_equal(np.asarray(direct), np.asarray(via_info))
    vis = np_visibility(masks.Causal() & masks.Document(), batch=2, heads=4, q_len=20, kv_len=28,
                        q_seg=np.asarray(qs), kv_seg=np.asarray(ks))
    assert_close(direct, np_attention(q, k, v, vis))
    with pytest.raises(ValueError, match="q_segment_ids.*mask_info"):
        bsa.blocksparse_attention(q, k, v, q_segment_ids=qs, mask_info=info)
    with pytest.raises(TypeError, match="mask_info"):
        bsa.blocksparse_attention(q, k, v, mask_info={"q_segment_ids": qs})
    # Purify: padded queries still see the global tokens, unless purified.
    mb = masks.GlobalTokens(2) | masks.Document()
    plain = bsa.blocksparse_attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks, causal=False,
                                      mask_builder=mb, platform="reference")
    pure = bsa.blocksparse_attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks, causal=False,
                                     mask_builder=mb, purify=True, platform="reference")
    pad = np.asarray(qs) < 0
    assert np.abs(np.asarray(plain).transpose(0, 2, 1, 3)[pad]).min() > 0
    assert (np.asarray(pure).transpose(0, 2, 1, 3)[pad] == 0).all()
    positions = bsa.MaskInfo(q_positions=jnp.arange(20) + 8,
                             kv_positions=jnp.arange(28))
    out = bsa.blocksparse_attention(q, k, v, mask_info=positions, platform="reference")
    assert_close(out, expected(masks.Causal(offset=8), q, k, v))


@pytest.mark.slow
def test_function_cfg_and_platforms(qkv):
    q, k, v = qkv
    want = expected(masks.Causal(), q, k, v)
    for cfg in (None, bsa.Tiling(block_q=8, block_kv=16), {"block_q": 16, "block_kv": 8}):
        for platform in (None, "cpu", "reference", "dense"):
            out = bsa.blocksparse_attention(q, k, v, cfg=cfg, platform=platform)
            assert_close(out, want, 2e-5, f"{cfg} {platform}")
    if hasattr(kernels, "XlaBlockSparse"):
        out = bsa.blocksparse_attention(q, k, v, cfg={"block_q": 8, "block_kv": 8}, platform="xla")
        assert_close(out, want, 2e-5, "xla")
    with pytest.raises(ValueError, match="platform"):
        bsa.blocksparse_attention(q, k, v, platform="no-such-kernel")
    with pytest.raises(ValueError, match="cfg"):
        bsa.blocksparse_attention(q, k, v, cfg={"block_size": 8})
    with pytest.raises(ValueError, match="block_q"):
        bsa.blocksparse_attention(q, k, v, cfg={"block_q": 0, "block_kv": 8})
    with pytest.raises(TypeError, match="cfg"):
        bsa.blocksparse_attention(q, k, v, cfg=(8, 8))


@pytest.mark.parametrize("fused", [True, False])
def test_function_fused_backward_is_deprecated_and_changes_nothing(qkv, fused):
    """ejKernel's switch is accepted, says it has no effect and names the single-pass
    backward that exists; the call is the one without it."""
    q, k, v = qkv
    with pytest.warns(DeprecationWarning, match=r"no effect.*deterministic=False") as caught:
        out = bsa.blocksparse_attention(q, k, v, fused_backward=fused, platform="reference")
    assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller
    assert bool(jnp.all(out == bsa.blocksparse_attention(q, k, v, platform="reference")))
    assert_close(out, expected(masks.Causal(), q, k, v))


def test_nothing_carries_fused_backward():
    assert "fused_backward" not in {f.name for f in dataclasses.fields(bsa.Features)}
    assert "fused_backward" not in inspect.signature(bsa.BlockSparseAttention.plan).parameters
    assert not hasattr(bsa.kernels.TritonBlockSparse(), "fused_backward")


@pytest.mark.parametrize("name", ["qkv_layouts"])
def test_function_unavailable_options(qkv, name):
    q, k, v = qkv
    with pytest.raises(NotImplementedError, match=name):
        bsa.blocksparse_attention(q, k, v, **{name: object()})


@pytest.mark.parametrize("name", ["in_specs", "out_specs", "sequence_parallelism_mesh_axis_name"])
def test_function_mesh_options_need_a_mesh(qkv, name):
    q, k, v = qkv
    with pytest.raises(ValueError, match="need `mesh`"):
        bsa.blocksparse_attention(q, k, v, **{name: "sp"})


def test_function_mask_builder_errors(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="mask_builder"):
        bsa.blocksparse_attention(q, k, v, mask_builder=lambda: "causal")
    with pytest.raises(TypeError, match="mask_builder"):
        bsa.blocksparse_attention(q, k, v, mask_builder=3)


@pytest.mark.parametrize("window", [-3, (2, -1), (None, None), (1, 2, 3)])
def test_function_bad_sliding_window(qkv, window):
    q, k, v = qkv
    with pytest.raises((ValueError, TypeError), match="sliding_window"):
        bsa.blocksparse_attention(q, k, v, sliding_window=window)


def test_function_bad_chunk_size(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="chunk_size"):
        bsa.blocksparse_attention(q, k, v, chunk_size=0)


# ---------------------------------------------------------------------------------------------
# Bad inputs: ValueError / TypeError naming the argument.


def _bad_calls():
    q, k, v = random_inputs(1, batch=2, heads=4, kv_heads=2, q_len=12, kv_len=16, dim=8)
    seg_q = jnp.zeros((2, 12), jnp.int32)
    seg_k = jnp.zeros((2, 16), jnp.int32)
    attn = bsa.BlockSparseAttention(kernel=REF)
    return [
        ("3d_key_4d_query", lambda: attn(q, k[0], v[0]), r"key|query"),
        ("batch_mismatch", lambda: attn(q, k[:1], v[:1]), r"key"),
        ("heads_not_divisible", lambda: attn(q, k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1)),
         r"heads"),
        ("head_dim_mismatch", lambda: attn(q, k[..., :4], v), r"key"),
        ("value_len_mismatch", lambda: attn(q, k, v[:, :, :8]), r"value"),
        ("value_heads_mismatch", lambda: attn(q, k, v[:, :1]), r"value"),
        ("int_query", lambda: attn(q.astype(jnp.int32), k, v), r"query"),
        ("dtype_mismatch", lambda: attn(q, k.astype(jnp.bfloat16), v), r"dtype"),
        ("sinks_shape", lambda: attn(q, k, v, sinks=random_array(0, (3, 2))), r"sinks"),
        ("sinks_3d", lambda: attn(q, k, v, sinks=random_array(0, (4, 2, 1))), r"sinks"),
        ("sinks_int", lambda: attn(q, k, v, sinks=jnp.ones((4,), jnp.int32)), r"sinks"),
        ("bias_shape", lambda: attn(q, k, v, bias=random_array(0, (12, 15))), r"bias"),
        ("bias_heads", lambda: attn(q, k, v, bias=random_array(0, (3, 12, 16))), r"bias"),
        ("bias_1d", lambda: attn(q, k, v, bias=random_array(0, (15,))), r"bias"),
        ("bias_5d", lambda: attn(q, k, v, bias=random_array(0, (1, 2, 4, 12, 16))), r"bias"),
        ("q_segments_length", lambda: attn(q, k, v, q_segment_ids=seg_q[:, :11],
                                           kv_segment_ids=seg_k), r"q_segment_ids"),
        ("kv_segments_length", lambda: attn(q, k, v, q_segment_ids=seg_q,
                                            kv_segment_ids=seg_q), r"kv_segment_ids"),
        ("segments_batch", lambda: attn(q, k, v, q_segment_ids=jnp.zeros((3, 12), jnp.int32),
                                        kv_segment_ids=jnp.zeros((3, 16), jnp.int32)),
         r"segment_ids"),
        ("only_q_segments", lambda: attn(q, k, v, q_segment_ids=seg_q), r"kv_segment_ids"),
        ("only_kv_segments", lambda: attn(q, k, v, kv_segment_ids=seg_k), r"q_segment_ids"),
        ("float_segments", lambda: attn(q, k, v, q_segment_ids=seg_q.astype(jnp.float32),
                                        kv_segment_ids=seg_k), r"q_segment_ids"),
        ("positions_length", lambda: attn(q, k, v, q_positions=jnp.arange(11)), r"q_positions"),
        ("document_without_segments",
         lambda: bsa.BlockSparseAttention(mask=masks.Causal() & masks.Document(), kernel=REF)(q, k, v),
         r"segment_ids"),
        ("purify_without_segments", lambda: attn(q, k, v, purify=True), r"purify"),
        ("zero_length", lambda: attn(q[:, :, :0], k, v), r"len"),
        ("per_head_count", lambda: bsa.BlockSparseAttention(
            mask=masks.PerHead([masks.Full()] * 2), kernel=REF)(q, k, v), r"PerHead.*heads"),
    ]


BAD = _bad_calls()


@pytest.mark.parametrize("name,call,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_naming_the_argument(name, call, pattern):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert re.search(pattern, str(info.value)), str(info.value)[:500]


@pytest.mark.parametrize("make,pattern", [
    (lambda: bsa.BlockSparseAttention(softmax_scale=float("nan")), "softmax_scale"),
    (lambda: bsa.BlockSparseAttention(softmax_scale=float("inf")), "softmax_scale"),
    (lambda: bsa.BlockSparseAttention(softmax_scale="0.5"), "softmax_scale"),
    (lambda: bsa.BlockSparseAttention(logits_soft_cap=0.0), "logits_soft_cap"),
    (lambda: bsa.BlockSparseAttention(logits_soft_cap=-3.0), "logits_soft_cap"),
    (lambda: bsa.BlockSparseAttention(logits_soft_cap=float("inf")), "logits_soft_cap"),
    (lambda: bsa.BlockSparseAttention(mask="causal"), "mask"),
    (lambda: bsa.BlockSparseAttention(kernel="xla"), "kernel"),
    (lambda: bsa.BlockSparseAttention(tiling=(128, 128)), "tiling"),
    (lambda: bsa.BlockSparseAttention(sharding=None), "sharding"),
    (lambda: bsa.Tiling(block_q=0, block_kv=8), "block_q"),
    (lambda: bsa.Tiling(block_q=8, block_kv=-8), "block_kv"),
    (lambda: bsa.Tiling(block_q=8.0, block_kv=8), "block_q"),
    (lambda: bsa.Tiling(block_q=8, block_kv=8, num_warps=0), "num_warps"),
    (lambda: bsa.Tiling(block_q=8, block_kv=8, block_q_bwd=True), "block_q_bwd"),
])
def test_bad_options_raise_naming_the_argument(make, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        make()


def test_function_bad_scalars(qkv):
    q, k, v = qkv
    with pytest.raises((ValueError, TypeError), match="softmax_scale"):
        bsa.blocksparse_attention(q, k, v, softmax_scale=float("nan"))
    with pytest.raises((ValueError, TypeError), match="logits_soft_cap"):
        bsa.blocksparse_attention(q, k, v, logits_soft_cap=-1.0)


def test_tiling_backward_defaults():
    t = bsa.Tiling(block_q=32, block_kv=64)
    assert t.backward_blocks == (32, 64)
    t = bsa.Tiling(block_q=32, block_kv=64, block_q_bwd=16)
    assert t.backward_blocks == (16, 64)


def test_typecheck_is_on_by_default():
    assert bsa.TYPECHECK_ENABLED


def test_no_warnings_on_a_plain_call(qkv):
    q, k, v = qkv
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref_attn(masks.Causal())(q, k, v)


@pytest.mark.slow
def test_bshd_layout_matches_the_oracle_and_jax_attention():
    """`qkv_layout="bshd"` takes and returns jax.nn.dot_product_attention's [B, L, H, D]
    arrays (GQA, Dv != D, Lq != Lk); the default layout would read them as other shapes."""
    q, k, v = random_inputs(21, heads=4, kv_heads=2, q_len=24, kv_len=40, dim=8, value_dim=6)
    to_bshd = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), qkv_layout="bshd",
                                    tiling=bsa.Tiling(block_q=8, block_kv=8))
    out = attn(to_bshd(q), to_bshd(k), to_bshd(v))
    assert out.shape == (2, 24, 4, 6)
    vis = np_visibility(masks.Causal(), batch=2, heads=4, q_len=24, kv_len=40)
    assert_close(jnp.swapaxes(out, 1, 2), np_attention(q, k, v, vis), 2e-5)
    full = bsa.BlockSparseAttention(qkv_layout="bshd", kernel=REF)
    want = jax.nn.dot_product_attention(to_bshd(q), to_bshd(k), to_bshd(k))
    assert_close(full(to_bshd(q), to_bshd(k), to_bshd(k)), want, 2e-5)
    unbatched = attn(to_bshd(q)[0], to_bshd(k)[0], to_bshd(v)[0])
    assert_close(unbatched, out[0], 1e-6)
    with pytest.raises(ValueError, match="`qkv_layout` must be 'bhsd'"):
        bsa.BlockSparseAttention(qkv_layout="BTNH")


@pytest.mark.slow
def test_kv_seq_lengths_hide_padding_without_recompiling():
    """`kv_seq_lengths` (jax.nn's `key_value_seq_lengths`): keys past each example's length
    are unseen, whatever they hold, and new lengths reuse the compiled call."""
    q, k, v = random_inputs(22, heads=4, kv_heads=2, q_len=24, kv_len=40, dim=8)
    attn = bsa.BlockSparseAttention(mask=masks.Causal(bottom_right=True),
                                    tiling=bsa.Tiling(block_q=8, block_kv=8))
    traces = []

    @jax.jit
    def run(k, v, lengths):
        traces.append(1)
        return attn(q, k, v, kv_seq_lengths=lengths)

    base = np_visibility(masks.Causal(bottom_right=True), batch=2, heads=4, q_len=24, kv_len=40)
    for lengths in ([40, 13], [0, 29]):
        keep = np.arange(40)[None, :] < np.asarray(lengths)[:, None]
        garbage = lambda x: jnp.where(keep[:, None, :, None], x, jnp.nan)  # noqa: E731
        out = run(garbage(k), garbage(v), jnp.asarray(lengths))
        assert_close(out, np_attention(q, k, v, base & keep[:, None, None, :]), 2e-5)
    assert len(traces) == 1
    want = np_attention(q[:1], k[:1], v[:1], base[:1] & (np.arange(40) < 13))
    assert_close(attn(q[0], k[0], v[0], kv_seq_lengths=13), want[0], 2e-5)
    with pytest.raises(ValueError, match=r"`kv_seq_lengths` must have shape \[2\] or a scalar"):
        attn(q, k, v, kv_seq_lengths=np.array([1, 2, 3]))


# ---------------------------------------------------------------------------------------------
# The call path does each step once.

_STEPS: dict[str, int] = {}


class _CountedCausal(bsa.AbstractMask):
    """Causal, counting how often a call checks and resolves it."""

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def elements(self, q, k, head):
        return k.position <= q.position

    def check(self, q_len, kv_len, num_heads):
        _STEPS["mask.check"] = _STEPS.get("mask.check", 0) + 1

    def resolve(self, q_len, kv_len):
        _STEPS["mask.resolve"] = _STEPS.get("mask.resolve", 0) + 1
        return self


#: The input checks of `eqx_bsattn._inputs`, counted wherever the package refers to them.
_INPUT_CHECKS = ("check_qkv", "_check_token_data", "_check_bias", "_check_sinks",
                 "check_kv_seq_lengths")


def _count_steps(monkeypatch):
    """Wrap every module-level reference to the input checks, in every module of the package,
    with a counter; `_STEPS` is then how often a call ran each check."""
    import sys

    from eqx_bsattn import _inputs

    _STEPS.clear()
    for name in _INPUT_CHECKS:
        original = getattr(_inputs, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            _STEPS[_name] = _STEPS.get(_name, 0) + 1
            return _original(*args, **kwargs)

        for module_name, module in list(sys.modules.items()):
            if module_name.split(".")[0] == "eqx_bsattn":
                for attr, value in list(vars(module).items()):
                    if value is original:
                        monkeypatch.setattr(module, attr, counted)


def _module_call(q, k, v, bias, sinks, ids):
    attn = bsa.BlockSparseAttention(mask=_CountedCausal())
    return attn(q, k, v, bias=bias, sinks=sinks, q_segment_ids=ids, kv_segment_ids=ids,
                kv_seq_lengths=jnp.full((2,), 20))


def _function_call(q, k, v, bias, sinks, ids):
    return bsa.blocksparse_attention(q, k, v, sinks, bias, q_segment_ids=ids,
                                     kv_segment_ids=ids, mask_builder=_CountedCausal(),
                                     causal=False)


def _layer_call(q, k, v, bias, sinks, ids):
    layer = bsa.MultiheadBlockSparseAttention(num_heads=4, query_size=8, mask=_CountedCausal(),
                                              key=jax.random.key(0))
    x = q[0, 0]  # [L, 8]
    return layer(x, x, x, bias=bias[0], sinks=sinks, q_segment_ids=ids[0],
                 kv_segment_ids=ids[0], kv_seq_lengths=20)


@pytest.mark.parametrize("door", [pytest.param(_module_call, marks=pytest.mark.slow),
                                  _function_call,
                                  pytest.param(_layer_call, marks=pytest.mark.slow)],
                         ids=["module", "function", "layer"])
def test_a_call_checks_its_inputs_and_resolves_its_mask_once(monkeypatch, door):
    q = random_array(1, (2, 4, 24, 8))
    bias = random_array(2, (2, 4, 24, 24))
    sinks = random_array(3, (4,))
    ids = jnp.asarray(np.repeat([[0, 1, 2]], 8, axis=1).repeat(2, axis=0), jnp.int32)
    # Each check once (four token arrays: the segment ids and the positions, here None).
    _count_steps(monkeypatch)
    door(q, q, q, bias, sinks, ids)
    expected_steps = {"check_qkv": 1, "_check_token_data": 4, "_check_bias": 1,
                      "_check_sinks": 1, "mask.check": 1, "mask.resolve": 1}
    if door is not _function_call:
        expected_steps["check_kv_seq_lengths"] = 1
    assert _STEPS == expected_steps
