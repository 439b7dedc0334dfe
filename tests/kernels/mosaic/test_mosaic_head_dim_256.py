"""`MosaicBlockSparse` at head dim 256: its tiles and shared memory, the launches lowered for a
Hopper GPU on a host without one, the whole call in Pallas' CPU interpreter and on a Hopper
GPU against the float32 dense reference (output and every gradient: q, k, v, ALiBi's slopes,
a score function's params, a bias), and the one-line decline that keeps the selector off it
until it has run on a GPU (`MosaicBlockSparse.awaiting_device_run`).

At D = 256 the forward keeps one Q buffer (64 KiB) beside two 64-key K/V stages (64 KiB
each); the dq launch streams 32-key tiles and the dk/dv launch 32-query tiles, two stages
beside their 128 KiB of own tiles; dk and dv are two launches, each with one 64 x 256
float32 accumulator a warpgroup (both would take 256 registers a thread).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
import eqx_bsattn._layout as layout_internals
from eqx_bsattn import masks
from eqx_bsattn.strategies.kernels import DenseReference
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse, MosaicConfig
from tests.conftest import take_as_proven
from tests.kernels.mosaic.conftest import (assert_lowers_for_cuda, assert_matches_reference,
                                           call_inputs, call_with_extras)

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

D = 256


def window_by_head(q, k, head):
    """A mask without terms that varies by head."""
    return (k <= q) & (q - k < 30 + 40 * head)


def learned_distance(score, head, q_pos, k_pos, w):
    """A learned penalty per head on the distance, both ways (it stays a function: not
    ALiBi's)."""
    return score - w[head] * jnp.abs(k_pos - q_pos).astype(jnp.float32)


@pytest.fixture
def head_dim_256(monkeypatch):
    """The kernel as it will be once head dim 256 has run on a GPU."""
    take_as_proven(MosaicBlockSparse, "head_dim_256", monkeypatch=monkeypatch)


# ---------------------------------------------------------------------------------------------
# Tiles, shared memory and the decline (no GPU needed).


def test_tiles_fit_shared_memory_and_registers():
    """The launches' tiles at D = 256 and what they take: one Q buffer in the forward, two
    ring stages in each launch, all within `SMEM_BUDGET`; dk and dv as two launches. A
    ring without room for two stages raises instead of over-filling shared memory."""
    from eqx_bsattn.strategies.kernels.mosaic.backward import BackwardConfig
    from eqx_bsattn.strategies.kernels.mosaic.common import SMEM_BUDGET, ring_stages
    from eqx_bsattn.strategies.kernels.mosaic.forward import BLOCK_Q, q_buffers_for

    config = MosaicConfig.for_head_dim(D)
    assert config == MosaicConfig(block_q=128, block_kv=64, block_q_dq=128, block_kv_dq=32,
                                  block_q_dkv=32, block_kv_dkv=128, stages=2)
    assert q_buffers_for(D, 64) == 1 and q_buffers_for(128, 128) == 2
    forward_bytes = (q_buffers_for(D, config.block_kv) * BLOCK_Q * D * 2
                     + config.stages * 2 * config.block_kv * D * 2)
    assert forward_bytes <= SMEM_BUDGET
    bcfg = BackwardConfig(batch=1, heads=2, kv_heads=2, q_len=1024, kv_len=1024,
                          true_kv_len=1024, head_dim=D, softmax_scale=0.0625, terms=None,
                          dq_block_kv=32, dkv_block_q=32, dq_layout_axes=(1, 1),
                          dkv_layout_axes=(1, 1), persistent=("dq", "dkv"), ctas=132)
    for launch in ("dq", "dkv"):
        # Two sets of own tiles leave no room: one item a CTA, one set, two stages.
        assert not bcfg.persistent_for(launch) and bcfg.own_buffers(launch) == 1
        assert bcfg.stages(launch) == 2
        rows = bcfg.streamed_rows(launch)
        assert bcfg._fixed_bytes(rows, False, 1) + 2 * (2 * rows * D * 2) <= SMEM_BUDGET
    assert bcfg.dkv_launches == ("dk", "dv")
    with pytest.raises(ValueError, match="exceed the 204800 bytes"):
        ring_stages(4 * 64 * D * 2, 2 * 64 * D * 2)


def test_head_dim_256_is_declined_until_it_runs_on_a_gpu(hopper_host, monkeypatch):
    """Planned for a Hopper GPU, head dim 256 goes to another kernel with the reason, until
    the flag says it has run on one; 192 runs zero-padded to 256, which has a flag of its
    own (`test_mosaic_padded_head_dims.py`)."""
    q = jnp.zeros((1, 2, 256, D), jnp.bfloat16)
    attn = bsa.BlockSparseAttention(mask=masks.Causal() & masks.Dilated(2))
    choice = attn.plan(q, q, q, platform="gpu").choice
    assert choice.kernel.name != "mosaic"
    assert ("mosaic", "head dim 256 has not yet run on a GPU.") in choice.declined
    take_as_proven(MosaicBlockSparse, "head_dim_256", monkeypatch=monkeypatch)
    assert attn.plan(q, q, q, platform="gpu").choice.kernel.name == "mosaic"
    wide = jnp.zeros((1, 2, 256, 192), jnp.bfloat16)
    declined = dict(attn.plan(wide, wide, wide, platform="gpu").choice.declined)
    assert declined["mosaic"] == ("head dims 192 / 192, zero-padded to 256, have not yet run "
                                  "on a GPU.")


# ---------------------------------------------------------------------------------------------
# Lowered for CUDA (no GPU needed).

#: name: (mask, heads, kv_heads, q_len, kv_len, extras): "segments" (padded documents),
#: "slopes" (learned ALiBi), "params" (`learned_distance`), "bias" ([1, H, Lq, Lk]),
#: "single_pass" (deterministic=False, which takes the two kernels at D = 256).
CASES = {
    "causal_gqa_ragged": (masks.Causal(bottom_right=True), 2, 1, 130, 300, ()),
    "alibi_window": (masks.SlidingWindow(90, 40), 2, 2, 200, 300, ("slopes",)),
    "documents_single_pass": (masks.Causal() & masks.Document(), 2, 2, 200, 200,
                              ("segments", "single_pass")),
    "predicate_params_gqa": (masks.Predicate(window_by_head), 4, 2, 200, 300, ("params",)),
    "array_mask_bias": (masks.ArrayMask(np.random.default_rng(2).random((2, 200, 200)) < 0.4),
                        2, 2, 200, 200, ("bias",)),
}
QUICK = ("causal_gqa_ragged",)
#: The full tier's (`slow`); the rest are extended.
FULL = ("predicate_params_gqa",)


@pytest.mark.parametrize("case", [
    pytest.param(name, marks=[] if name in QUICK else [pytest.mark.slow] if name in FULL
                 else [pytest.mark.extended])
    for name in sorted(CASES)])
def test_launches_lower_for_cuda(hopper_host, head_dim_256, monkeypatch, case):
    """`jit(grad)` at D = 256 lowers for CUDA as four Mosaic GPU launches (the forward, dq,
    dk and dv; the single pass asked for takes the two kernels), its gradients of the
    inputs' shapes."""
    mask, heads, kv_heads, q_len, kv_len, extras = CASES[case]
    monkeypatch.setattr(layout_internals.eqx, "error_if", lambda x, *_, **__: x)
    q, k, v, cot, arrays, data = call_inputs(D, D, heads, kv_heads, q_len, kv_len, extras)
    kernel = MosaicBlockSparse(deterministic="single_pass" not in extras)
    f = call_with_extras(mask, kernel, jnp.bfloat16, data, learned_distance)
    assert_lowers_for_cuda(f, q, k, v, arrays, cot, 4, case)


# ---------------------------------------------------------------------------------------------
# The whole call against the float32 reference: in Pallas' CPU interpreter, and on a GPU.


def _check_against_reference(case, dtype, tolerance, extras_tolerance):
    """The call through Mosaic in `dtype` against the float32 reference
    (`assert_matches_reference`)."""
    mask, heads, kv_heads, q_len, kv_len, extras = CASES[case]
    q, k, v, cot, arrays, data = call_inputs(D, D, heads, kv_heads, q_len, kv_len, extras,
                                             seed=3)
    # The inputs as the kernel sees them (rounded), for both.
    q, k, v = (x.astype(dtype).astype(jnp.float32) for x in (q, k, v))
    kernel = MosaicBlockSparse(deterministic="single_pass" not in extras)
    assert_matches_reference(
        call_with_extras(mask, kernel, dtype, data, learned_distance),
        call_with_extras(mask, DenseReference(), jnp.float32, data, learned_distance),
        q, k, v, arrays, cot, tolerance, extras_tolerance, case)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_in_cpu_interpreter(interpreted, head_dim_256, case):
    """The forward and the backward launches at D = 256 in Pallas' CPU interpreter (plain
    products in place of wgmma), float16, against the float32 reference: output and the
    gradients in q, k, v and the extras (slopes, params, bias). Extended only: each takes
    minutes, and on a machine of few cores the interpreter's warpgroup threads, which wait
    on barriers inside host callbacks, can stall one another."""
    _check_against_reference(case, jnp.float16, 4e-3, 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_on_gpu(head_dim_256, case):
    """The launches at D = 256 on a Hopper GPU, bfloat16, against the float32 reference."""
    _check_against_reference(case, jnp.bfloat16, 2e-2, 5e-2)
