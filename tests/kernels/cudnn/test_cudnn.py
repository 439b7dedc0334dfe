"""CudnnDense's mask translation and its decline reasons (the launch itself needs a GPU)."""

import dataclasses

import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks
from eqx_bsattn.strategies.kernels.cudnn import cudnn_mask_options
from tests.conftest import take_as_proven

GPU_BF16 = bsa.Features(platform="gpu", dtype="bfloat16", q_len=256, kv_len=256,
                        head_dim=64, value_dim=64)


def _terms(mask, features=GPU_BF16):
    return bsa.ResolvedMask(mask, q_len=features.q_len, kv_len=features.kv_len,
                            num_heads=1).terms


def _decline(mask, features=GPU_BF16):
    """Why the selector declines CudnnDense for `mask` with `features` (None: it runs)."""
    choice_or_error = None
    try:
        bsa.select_kernel(mask, features.platform, features, candidates=[bsa.kernels.CudnnDense()])
    except bsa.NoKernelError as e:
        choice_or_error = str(e)
    return choice_or_error


@pytest.mark.parametrize("mask, expected", [
    (masks.Full(), {"is_causal": False}),
    (masks.Causal(), {"is_causal": True}),
    (masks.Causal() & masks.SlidingWindow(32, 7), {"is_causal": True, "local_window_size": (32, 0)}),
    (masks.Causal() & masks.SlidingWindow(None, 4), {"is_causal": True, "local_window_size": (256, 0)}),
])
def test_expressible_masks_translate(mask, expected):
    assert cudnn_mask_options(_terms(mask), 256) == expected
    assert _decline(mask) is None


@pytest.mark.parametrize("mask", [
    masks.Causal(offset=3), masks.ChunkedCausal(64), masks.Causal() | masks.GlobalTokens(4),
    ~masks.Causal(), masks.Causal() & masks.Document(),
    # A window without causal: cuDNN refuses a right side, and on the H200 its left-only window
    # without is_causal did not match the reference.
    masks.SlidingWindow(16, 4), masks.SlidingWindow(None, 4), masks.SlidingWindow(16, 0),
    # A table, even one that is all True, is no term cuDNN takes.
    masks.Causal() & masks.BlockLayoutMask([[True, True], [True, True]], 128),
])
def test_other_masks_are_declined(mask):
    assert cudnn_mask_options(_terms(mask), 256) is None
    why = _decline(mask)
    assert why is not None and "cuDNN expresses only full, causal" in why


@pytest.mark.parametrize("change, word", [
    ({"platform": "cpu"}, "runs on gpu only"), ({"dtype": "float32"}, "bfloat16"), ({"bias": True}, "bias"),
    ({"sinks": True}, "sinks"), ({"value_dim": 32}, "Dv"), ({"head_dim": 256, "value_dim": 256}, "128"),
    ({"kv_len": 300}, "Lq != Lk"), ({"q_len": 45, "kv_len": 45}, "even sequence length"),
])
def test_features_cudnn_lacks_are_declined(change, word):
    why = _decline(masks.Causal(), dataclasses.replace(GPU_BF16, **change))
    assert why is not None and word in why


def test_selector_prefers_cudnn_on_gpu_only_where_it_can_run():
    assert bsa.select_kernel(masks.Causal(), "gpu", GPU_BF16).kernel.name == "cudnn"
    choice = bsa.select_kernel(masks.ChunkedCausal(64), "gpu", GPU_BF16)
    assert choice.kernel.name != "cudnn"
    assert "cudnn" in dict(choice.declined)


@pytest.mark.parametrize("capability, run_on_gpu, dim, word", [
    (None, True, 256, "at most 128 (256 on a Hopper GPU)"),
    ((8, 0), True, 192, "at most 128 on this GPU"),
    ((9, 0), False, 256, "has not yet run on a GPU"),
    ((9, 0), True, 264, "at most 256 on this GPU"),
    ((9, 0), True, 250, "multiple of 8"),
    ((9, 0), True, 256, None), ((10, 0), True, 192, None), ((8, 6), False, 128, None),
])
def test_head_dims_over_128_need_a_hopper_gpu(monkeypatch, capability, run_on_gpu, dim, word):
    from eqx_bsattn.strategies.kernels import cudnn

    monkeypatch.setattr(cudnn, "_gpu_capability", lambda: capability)
    if run_on_gpu:
        take_as_proven(cudnn.CudnnDense, "wide_heads", monkeypatch=monkeypatch)
    else:
        assert cudnn.CudnnDense.awaits_device_run("wide_heads")
    why = _decline(masks.Causal(), dataclasses.replace(GPU_BF16, head_dim=dim, value_dim=dim))
    if word is None:
        assert why is None
    else:
        assert why is not None and word in why, why
