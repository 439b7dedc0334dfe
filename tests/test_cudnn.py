"""CudnnDense's mask translation and its decline reasons (the launch itself needs a GPU)."""

import dataclasses

import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks
from eqx_bsattn.strategies.kernels.cudnn import cudnn_mask_options

GPU_BF16 = bsa.Features(platform="gpu", dtype="bfloat16", q_len=256, kv_len=256,
                        head_dim=64, value_dim=64)


@pytest.mark.parametrize("mask, expected", [
    (masks.Full(), {"is_causal": False}),
    (masks.Causal(), {"is_causal": True}),
    (masks.Causal() & masks.SlidingWindow(32, 7), {"is_causal": True, "local_window_size": (32, 0)}),
    (masks.Causal() & masks.SlidingWindow(None, 4), {"is_causal": True, "local_window_size": (256, 0)}),
])
def test_expressible_masks_translate(mask, expected):
    assert cudnn_mask_options(mask, 256) == expected
    assert bsa.kernels.CudnnDense().decline_reason(mask, GPU_BF16) is None


@pytest.mark.parametrize("mask", [
    masks.Causal(offset=3), masks.ChunkedCausal(64), masks.Causal() | masks.GlobalTokens(4),
    ~masks.Causal(), masks.Causal() & masks.Document(),
    # A window without causal: cuDNN refuses a right side, and on the H200 its left-only window
    # without is_causal did not match the reference.
    masks.SlidingWindow(16, 4), masks.SlidingWindow(None, 4), masks.SlidingWindow(16, 0),
])
def test_other_masks_are_declined(mask):
    assert cudnn_mask_options(mask, 256) is None
    why = bsa.kernels.CudnnDense().decline_reason(mask, GPU_BF16)
    assert why is not None and "mask" in why


@pytest.mark.parametrize("change, word", [
    ({"platform": "cpu"}, "GPU"), ({"dtype": "float32"}, "bfloat16"), ({"bias": True}, "bias"),
    ({"sinks": True}, "sinks"), ({"value_dim": 32}, "Dv"), ({"head_dim": 256, "value_dim": 256}, "128"),
    ({"kv_len": 300}, "Lq != Lk"),
])
def test_features_cudnn_lacks_are_declined(change, word):
    why = bsa.kernels.CudnnDense().decline_reason(masks.Causal(), dataclasses.replace(GPU_BF16, **change))
    assert why is not None and word in why


def test_selector_prefers_cudnn_on_gpu_only_where_it_can_run():
    assert bsa.select_kernel(masks.Causal(), "gpu", GPU_BF16).kernel.name == "cudnn"
    choice = bsa.select_kernel(masks.ChunkedCausal(64), "gpu", GPU_BF16)
    assert choice.kernel.name != "cudnn"
    assert "cudnn" in dict(choice.declined)
