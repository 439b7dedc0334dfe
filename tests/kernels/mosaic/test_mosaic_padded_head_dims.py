"""`MosaicBlockSparse` at head dims its launches do not take (``Dv != D``, or D outside 64 /
128 / 256): q, k and v zero-padded to the least launch head dim that holds both
(`kernel.kernel_head_dim`), the output and the gradients cut back to the call's. Checked
here: the width chosen and the declines (no GPU needed), the launches lowered for a Hopper
GPU on a host without one, and the whole call in Pallas' CPU interpreter and on a Hopper GPU
against the float32 dense reference (output and every gradient), and the one-line decline
that keeps the selector off such calls until they have run on a GPU
(`MosaicBlockSparse.awaiting_device_run`).
"""

import jax
import jax.numpy as jnp
import pytest

import eqx_bsattn as bsa
import eqx_bsattn._layout as layout_internals
from eqx_bsattn import masks
from eqx_bsattn.strategies.kernels import DenseReference
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse, MosaicConfig
from eqx_bsattn.strategies.kernels.mosaic import kernel as mosaic_kernel
from tests.conftest import take_as_proven
from tests.kernels.mosaic.conftest import (assert_lowers_for_cuda, assert_matches_reference,
                                           call_inputs, call_with_extras)

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


def window_by_head(q, k, head):
    """A mask without terms that varies by head."""
    return (k <= q) & (q - k < 30 + 40 * head)


@pytest.fixture
def padded_head_dims(monkeypatch):
    """The kernel as it will be once padded head dims have run on a GPU."""
    take_as_proven(MosaicBlockSparse, "padded_head_dims", monkeypatch=monkeypatch)


# ---------------------------------------------------------------------------------------------
# The width and the declines (no GPU needed).


@pytest.mark.parametrize("dims, width", [
    ((64, 64), 64), ((33, 33), 64), ((64, 128), 128), ((128, 64), 128), ((80, 96), 128),
    ((96, 96), 128), ((129, 64), 256), ((192, 192), 256), ((256, 256), 256),
    ((16, 16), 64), ((257, 64), None), ((64, 300), None)])
def test_kernel_head_dim(dims, width):
    """The least launch head dim holding both of the call's, ``None`` over 256."""
    assert mosaic_kernel.kernel_head_dim(*dims) == width


@pytest.mark.parametrize("dims, reason", [
    ((64, 128), None), ((128, 64), None), ((96, 96), None), ((24, 40), None),
    ((16, 16), "head dims 16 / 16 would be zero-padded to 64, over twice their width."),
    ((128, 320), "head dims 128 / 320 are not supported (at most 256 each)."),
])
def test_padded_head_dims_are_declined_until_they_run_on_a_gpu(hopper_host, monkeypatch, dims,
                                                                reason):
    """Planned for a Hopper GPU, a padded call goes to another kernel with the reason until
    the flag says padded calls have run on one; then it is Mosaic's, at the padded width's
    tiles, its softmax scale still the call's head dim's. Always declined: padding that would
    more than double the work (Triton runs such narrow heads at their own width), and head
    dims no launch holds."""
    head_dim, value_dim = dims
    q = jnp.zeros((1, 2, 256, head_dim), jnp.bfloat16)
    v = jnp.zeros((1, 2, 256, value_dim), jnp.bfloat16)
    attn = bsa.BlockSparseAttention(mask=masks.Causal() & masks.Dilated(2))
    width = mosaic_kernel.kernel_head_dim(*dims)
    assert MosaicBlockSparse.awaits_device_run("padded_head_dims")
    for flag in (False, True):
        if flag:
            take_as_proven(MosaicBlockSparse, "padded_head_dims", monkeypatch=monkeypatch)
        plan = attn.plan(q, q, v, platform="gpu")
        choice = plan.choice
        expected = reason
        if reason is None and not flag:
            expected = (f"head dims {head_dim} / {value_dim}, zero-padded to {width}, have not "
                        "yet run on a GPU.")
        assert dict(choice.declined).get("mosaic") == expected, (flag, choice.declined)
        if expected is None:
            assert choice.kernel.name == "mosaic"
            assert plan.tiling == MosaicConfig.for_head_dim(width)
            # The scale is the call's own head dim's, not the padded width's.
            assert plan.softmax_scale == pytest.approx(head_dim ** -0.5)
        else:
            assert choice.kernel.name != "mosaic"


# ---------------------------------------------------------------------------------------------
# Lowered for CUDA (no GPU needed), and the whole call against the float32 reference.

#: name: (head_dim, value_dim, mask, heads, kv_heads, q_len, kv_len, extras): "slopes"
#: (learned ALiBi), "params" (per-head widths of `window_by_head`), "segments" (padded
#: documents), "sinks" (per head), "single_pass" (deterministic=False).
CASES = {
    "value_wider_gqa_ragged": (64, 128, masks.Causal(bottom_right=True), 2, 1, 130, 300, ()),
    "value_narrower_alibi": (128, 64, masks.SlidingWindow(90, 40), 2, 2, 200, 300,
                             ("slopes", "sinks")),
    "odd_predicate": (96, 96, masks.Predicate(window_by_head), 2, 2, 200, 200, ()),
    "odd_pair_documents_single_pass": (80, 96, masks.Causal() & masks.Document(), 2, 2, 200,
                                       200, ("segments", "single_pass")),
}
QUICK = ("value_wider_gqa_ragged",)


@pytest.mark.parametrize("case", [
    pytest.param(name, marks=[] if name in QUICK else [pytest.mark.extended])
    for name in sorted(CASES)])
def test_launches_lower_for_cuda(hopper_host, padded_head_dims, monkeypatch, case):
    """`jit(grad)` of a padded call lowers for CUDA as the launches of its padded width (the
    forward, dq and dk/dv; the single pass asked for runs the forward and one backward
    launch), its gradients of the inputs' own shapes."""
    head_dim, value_dim, mask, heads, kv_heads, q_len, kv_len, extras = CASES[case]
    monkeypatch.setattr(layout_internals.eqx, "error_if", lambda x, *_, **__: x)
    q, k, v, cot, arrays, data = call_inputs(head_dim, value_dim, heads, kv_heads, q_len,
                                             kv_len, extras)
    single_pass = "single_pass" in extras
    kernel = MosaicBlockSparse(deterministic=not single_pass)
    f = call_with_extras(mask, kernel, jnp.bfloat16, data)
    launches = 2 if single_pass and kernel.single_pass() else 3
    assert_lowers_for_cuda(f, q, k, v, arrays, cot, launches, case)


def _check_against_reference(case, dtype, tolerance, extras_tolerance):
    """The call through Mosaic in `dtype` against the float32 reference
    (`assert_matches_reference`)."""
    head_dim, value_dim, mask, heads, kv_heads, q_len, kv_len, extras = CASES[case]
    q, k, v, cot, arrays, data = call_inputs(head_dim, value_dim, heads, kv_heads, q_len,
                                             kv_len, extras, seed=3)
    q, k, v = (x.astype(dtype).astype(jnp.float32) for x in (q, k, v))
    kernel = MosaicBlockSparse(deterministic="single_pass" not in extras)
    assert_matches_reference(call_with_extras(mask, kernel, dtype, data),
                             call_with_extras(mask, DenseReference(), jnp.float32, data),
                             q, k, v, arrays, cot, tolerance, extras_tolerance, case)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_in_cpu_interpreter(interpreted, padded_head_dims, case):
    """A padded call's launches in Pallas' CPU interpreter, float16, against the float32
    reference: output and the gradients in q, k, v and the extras (slopes, sinks).
    Extended only: each takes a minute or more on a machine of few cores."""
    _check_against_reference(case, jnp.float16, 4e-3, 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_on_gpu(padded_head_dims, case):
    """A padded call's launches on a Hopper GPU, bfloat16, against the float32 reference."""
    _check_against_reference(case, jnp.bfloat16, 2e-2, 5e-2)
