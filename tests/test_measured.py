"""The selector's measured table: which figures cover a call, and the kernel they pick."""

import dataclasses

import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks
from eqx_bsattn._measured import MEASURED, Measurement, covering, measured_choice, pattern_of

TPU_CALL = bsa.Features(platform="tpu", dtype="bfloat16", batch=1, num_heads=16, num_kv_heads=16,
                        q_len=32768, kv_len=32768, head_dim=128, value_dim=128)


def _terms(mask):
    return mask.terms(0)


@pytest.mark.parametrize("mask, segment_ids, want", [
    (masks.Causal(), False, "causal"),
    (masks.Causal() & masks.SlidingWindow(1024, 0), False, "window"),
    (masks.Causal() & masks.Document(), True, "documents"),
    (masks.Causal(offset=3), False, None),
    (masks.SlidingWindow(64, 64), False, None),
    (masks.ChunkedCausal(256), False, None),
    (masks.Full(), False, None),
])
def test_patterns_read_from_the_terms(mask, segment_ids, want):
    assert pattern_of(_terms(mask), segment_ids=segment_ids) == want


def test_a_row_covers_calls_within_a_factor_of_two_of_its_length():
    terms = _terms(masks.Causal())
    assert covering(TPU_CALL, terms).length == 32768
    assert covering(dataclasses.replace(TPU_CALL, q_len=8192, kv_len=8192), terms).length == 8192
    # Nearest in log-length: 16k is as near 8k as 32k; 20k is nearer 32k.
    assert covering(dataclasses.replace(TPU_CALL, q_len=20000, kv_len=20000), terms).length == 32768
    for change in (dict(q_len=2048, kv_len=2048), dict(q_len=131072, kv_len=131072),
                   dict(dtype="float32"), dict(platform="cpu"), dict(score=("alibi",)),
                   dict(bias=True), dict(positions=True), dict(lse=True), dict(kv_len=16384)):
        assert covering(dataclasses.replace(TPU_CALL, **change), terms) is None, change


def test_the_fastest_accepting_kernel_wins_and_the_reason_quotes_the_figures():
    row = covering(TPU_CALL, _terms(masks.Causal()))
    name, reason = measured_choice(row, "splash", ["pallas_tpu", "xla"], lambda n: True)
    assert name == "pallas_tpu"
    assert "157.02" in reason and "165.81" in reason and "splash" in reason
    # A faster kernel that declines the call does not win.
    name, _ = measured_choice(row, "splash", ["pallas_tpu"], lambda n: n != "pallas_tpu")
    assert name == "splash"
    # At 8k Splash is faster forward+backward: it stays.
    short = covering(dataclasses.replace(TPU_CALL, q_len=8192, kv_len=8192), _terms(masks.Causal()))
    name, reason = measured_choice(short, "splash", ["pallas_tpu"], lambda n: True)
    assert name == "splash" and "measured fastest" in reason
    # A winner the row does not time is kept, with no figure quoted.
    assert measured_choice(row, "mine", ["pallas_tpu"], lambda n: True) == ("mine", "")


def test_every_built_in_row_names_registered_kernels():
    names = {cls.name for cls in bsa.registered_kernels()}
    for row in MEASURED:
        assert isinstance(row, Measurement)
        assert {name for name, *_ in row.times} <= names, row
        assert row.pattern in ("causal", "window", "documents")


@pytest.mark.parametrize("mask, length, segment_ids, want", [
    (masks.Causal(), 32768, False, "pallas_tpu"),
    (masks.Causal() & masks.Document(), 32768, True, "pallas_tpu"),
    (masks.Causal() & masks.SlidingWindow(1024, 0), 32768, False, "splash"),
    (masks.Causal(), 8192, False, "splash"),
    (masks.Causal(), 2048, False, "splash"),  # no row this short: priority
])
def test_select_kernel_on_a_tpu_follows_the_measured_rows(mask, length, segment_ids, want):
    features = dataclasses.replace(TPU_CALL, q_len=length, kv_len=length,
                                   segment_ids=segment_ids)
    choice = bsa.select_kernel(mask, platform="tpu", features=features)
    assert choice.kernel.name == want, choice.explain()
    if length == 2048:
        assert "measured" not in choice.explain()
    else:
        assert "TPU v5 lite" in choice.explain()


@pytest.mark.parametrize("mask, batch, segment_ids, want", [
    (masks.Causal(), 1, False, "splash"),
    (masks.Causal(), 2, False, "pallas_tpu"),
    (masks.Causal(), 4, False, "pallas_tpu"),  # nearest measured batch: 2
    (masks.Causal() & masks.Document(), 1, True, "pallas_tpu"),
])
def test_the_row_nearest_in_batch_decides_at_one_length(mask, batch, segment_ids, want):
    features = dataclasses.replace(TPU_CALL, q_len=8192, kv_len=8192, batch=batch,
                                   segment_ids=segment_ids)
    row = covering(features, _terms(mask))
    assert row.length == 8192 and row.batch == min(batch, 2)
    choice = bsa.select_kernel(mask, platform="tpu", features=features)
    assert choice.kernel.name == want, choice.explain()


GPU_CALL = dataclasses.replace(TPU_CALL, platform="gpu", batch=2, q_len=16384, kv_len=16384)


@pytest.mark.parametrize("mask, length, batch, want", [
    (masks.Causal(), 16384, 2, "cudnn"),  # cuDNN measured faster: priority stands
    (masks.Causal() & masks.SlidingWindow(1024, 0), 16384, 2, "mosaic"),
    (masks.Causal() & masks.SlidingWindow(1024, 0), 65536, 1, "mosaic"),
    (masks.Causal(), 65536, 1, "cudnn"),
    (masks.Causal(), 1024, 32, "mosaic"),  # short rows: Mosaic measured faster
    (masks.Causal(), 4096, 2, "cudnn"),  # no row this length: priority
])
def test_select_kernel_on_an_h200_follows_the_measured_rows(mask, length, batch, want):
    features = dataclasses.replace(GPU_CALL, q_len=length, kv_len=length, batch=batch)
    choice = bsa.select_kernel(mask, platform="gpu", features=features)
    assert choice.kernel.name == want, choice.explain()
    assert ("NVIDIA H200" in choice.explain()) == (length != 4096), choice.explain()
