"""The one conformance suite: every registered kernel against the float64 oracle.

Parametrised over kernels x cases x dtypes. Each case runs the kernel through
`BlockSparseAttention` with an explicit kernel and compares the forward output and the
gradients of q, k, v, bias and sinks (through one random cotangent) with `jnp_attention_f64`
of `tests.conftest`, whose mask comes from the NumPy evaluator `np_mask`, not from the package.
Inputs are random normals (never zeros) rounded to the case's dtype; the oracle reads the same
rounded values. Tolerances are by dtype.

The kernels are every concrete kernel class the package and the documentation's worked example
register (`registered_kernels()`, less the ones test modules define); a new kernel is tested by
being registered. Kernels that do not run on the CPU carry the `gpu` marker and skip without a
GPU. A kernel may decline a case: the test then checks that the plan refuses it with the
kernel's reason, and `test_declined_cases_are_the_expected_ones` checks that the declined cases
are exactly the ones each kernel is known to decline, so a kernel cannot pass by declining.
"""

import dataclasses
import importlib.util
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks
from tests.conftest import jnp_attention_f64, np_visibility, score_f64, sorted_segments

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_documented_kernels():
    """Import the worked examples of docs/ that define kernels, so that they register."""
    for path in sorted((ROOT / "docs" / "examples").glob("*kernel*.py")):
        spec = importlib.util.spec_from_file_location(f"docs_examples_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_load_documented_kernels()

KERNELS = [cls for cls in bsa.registered_kernels() if not cls.__module__.startswith("tests")]
ON_GPU = jax.default_backend() == "gpu"

# Maximum absolute error over the largest expected magnitude, forward and gradients, and the
# error in norm, ||got - want|| / ||want||, by input dtype. float32 kernels round only their
# arithmetic; the half types also round p and dS to 8 or 11 bits (the XLA kernel in bfloat16
# on the CPU: norm ~3e-3, maximum ~4.5e-3 for out, dq, dk, dv). The sink gradient sums
# p_sink * rowsum(dO * O) over every row with O rounded to the dtype: 1.1e-2 in norm for
# TritonBlockSparse in bfloat16 on the H200, hence the looser bound on gradients.
TOL = {
    "float32": {"max": (2e-5, 5e-5), "norm": (2e-5, 5e-5)},
    "float16": {"max": (4e-3, 4e-3), "norm": (2e-3, 4e-3)},
    "bfloat16": {"max": (2e-2, 3e-2), "norm": (1e-2, 2e-2)},
}
if jax.default_backend() == "tpu":
    # On a TPU v5e exp, log and tanh agree with float64 to four or five digits even at the
    # highest matmul precision, and the backward's probabilities exp(s - lse) carry that
    # error: PallasTpuBlockSparse's float32 bias cases measured up to 4.8e-5 on the output
    # (sinks), 8.5e-5 on dq and 1.3e-4 on a scalar bias's gradient (a sum over every pair),
    # 3e-5 in norm on q, k, v (2026-12-07, benchmarks/device_proofs.sh tpu).
    TOL["float32"] = {"max": (1e-4, 3e-4), "norm": (5e-5, 2e-4)}


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: the mask, shapes, per-call data and options; ``tiling="small"`` is a 16x32
    tiling (many blocks, full and partial), ``None`` the kernel's heuristic."""

    mask: object
    batch: int | None = 2
    heads: int = 4
    kv_heads: int | None = None
    q_len: int = 45
    kv_len: int | None = None
    dim: int = 8
    value_dim: int | None = None
    softmax_scale: float | None = None
    soft_cap: float | None = None
    # "qk", "hqk", "b1qk", "1hqk", "bhqk"; without an Lq or Lk axis of their own: per key
    # "b11k", per query "bhq1", a scalar "1111" (kernels that read size-1 axes get them so).
    bias: str | None = None
    sinks: str | None = None  # "s", "h", "hs"; "hs_inf": [H, 2] with -inf sinks (no sink)
    documents: int = 0  # sorted segment ids with this many documents
    pad: int = 0  # the last `pad` tokens are padding (segment id -1)
    interleaved: bool = False  # documents that resume after another one
    positions: str | None = None  # "sorted" (random, sorted), "shifted" or "edges"
    score: str | None = None  # a key of SCORES: the module's score term
    input_scale: float = 1.0
    tiling: object = "small"
    dtypes: tuple[str, ...] | None = None  # default: the kernel's own (see `_dtypes`)
    seed: int = 0


SMALL = bsa.Tiling(block_q=16, block_kv=32)


def distance_and_scale(s, head, q, k):
    """A score function that is not additive: its gradient in the logits is not one."""
    return s * (1.0 + 0.25 * head) - 0.1 * jnp.sqrt(jnp.abs(q - k))


#: Score terms the cases use: each one's learned arrays (``name -> shape`` by heads; random
#: normals, the oracle's differentiable inputs), the module's score from them, and the
#: oracle's `score_f64` arguments besides the arrays.
SCORES = {
    "alibi": ({}, lambda a: bsa.scores.ALiBi(), lambda h: {
        "slopes": np.asarray(bsa.scores.alibi_slopes(h), np.float64)}),
    "alibi_learned": ({"slopes": lambda h: (h,)},
                      lambda a: bsa.scores.ALiBi(a["slopes"], learned=True), lambda h: {}),
    "relative": ({"table": lambda h: (h, 8)},
                 lambda a: bsa.scores.RelativePositionBias(a["table"], max_distance=20),
                 lambda h: {"max_distance": 20}),
    "relative_causal": ({"table": lambda h: (h, 12)},
                        lambda a: bsa.scores.RelativePositionBias(a["table"], bidirectional=False,
                                                                  max_distance=40),
                        lambda h: {"bidirectional": False, "max_distance": 40}),
    "relative_t5": ({"table": lambda h: (h, 32)},
                    lambda a: bsa.scores.RelativePositionBias(a["table"]), lambda h: {}),
    "function": ({}, lambda a: bsa.scores.ScoreFunction(distance_and_scale),
                 lambda h: {"fn": distance_and_scale}),
}


def every_other_causal(q, k):
    return (k <= q) & ((q - k) % 2 == 0)


def every_fifth_skipped(q, k):
    return (k <= q) & ((q - k) % 5 != 2)


_TABLE = np.random.default_rng(4).random((8, 8)) < 0.4
_TABLE3 = np.tril(np.ones((3, 3), bool)) & (np.random.default_rng(0).random((3, 3)) > 0.3)
_TABLE3[np.arange(3), np.arange(3)] = True

R = dict(q_len=45, kv_len=45)  # ragged: not multiples of the small tiling
# Shapes on which the GPU kernels run their own tiles: the heuristic tiling, head dim 64, GQA.
BIG = dict(q_len=300, dim=64, kv_heads=2, tiling=None)

CASES = {
    # Mask families on a small tiling.
    "full_scale": Case(masks.Full(), softmax_scale=0.9, **R),
    "causal_bottom_right_lq_lt_lk": Case(masks.Causal(bottom_right=True), q_len=21, kv_len=70),
    "causal_lq_gt_lk": Case(masks.Causal(offset=3), q_len=70, kv_len=37),
    "window": Case(masks.SlidingWindow(13, 5), **R),
    "chunked": Case(masks.ChunkedCausal(24), **R),
    "prefix_lm": Case(masks.PrefixLM(18), **R),
    "global_window": Case(masks.SlidingWindow(6) | masks.GlobalTokens(4), **R),
    "dilated_window": Case(masks.SlidingWindow(30, 0) & masks.Dilated(3), **R),
    "bigbird": Case(masks.Causal() & (masks.SlidingWindow(16, 0) | masks.GlobalTokens(8)
                                      | masks.BigBirdRandom(16, 1, seed=1)), q_len=80),
    "block_layout": Case(masks.BlockLayoutMask(_TABLE, (8, 12)), q_len=50, kv_len=61),
    "aligned_table": Case(masks.Causal() & masks.BlockLayoutMask(_TABLE, (32, 32)), q_len=100,
                          kv_len=90),
    "predicate": Case(masks.Predicate(every_other_causal), **R),
    "not_window": Case(~masks.SlidingWindow(4), **R),
    "per_head": Case(masks.PerHead([masks.Causal(), masks.SlidingWindow(5),
                                    masks.ChunkedCausal(16), ~masks.Causal()]), **R),
    "fully_masked_rows": Case(masks.Causal(offset=-20), **R),
    # Features on a small tiling.
    "bias_qk": Case(masks.Causal(), bias="qk", **R),
    "bias_hqk_window": Case(masks.SlidingWindow(9), bias="hqk", **R),
    "bias_b1qk_chunked": Case(masks.ChunkedCausal(16), bias="b1qk", q_len=33, kv_len=50),
    "bias_b11k_gqa_window": Case(masks.SlidingWindow(9, 3), bias="b11k", kv_heads=2, q_len=33,
                                 kv_len=50),
    "bias_b11k_per_head": Case(masks.PerHead([masks.Causal(), masks.SlidingWindow(5),
                                              masks.ChunkedCausal(16), ~masks.Causal()]),
                               bias="b11k", kv_heads=2, **R),
    # A bias constant along a row shifts the row's logits alike: without sinks or a soft cap
    # its gradient is zero (the oracle's is rounding), so those cases carry one of them.
    "bias_bhq1_lq_gt_lk_sinks": Case(masks.Causal(offset=3), bias="bhq1", sinks="h",
                                     kv_heads=2, q_len=70, kv_len=37),
    "bias_bhq1_per_head_soft_cap": Case(masks.PerHead([masks.Causal(), masks.SlidingWindow(5),
                                                       masks.PrefixLM(9), masks.Full()]),
                                        bias="bhq1", soft_cap=3.0, **R),
    "bias_1111_chunked_sinks": Case(masks.ChunkedCausal(16), bias="1111", sinks="hs",
                                    kv_heads=1, q_len=33, kv_len=50),
    "gqa_causal_sinks_s": Case(masks.Causal(), sinks="s", heads=6, kv_heads=2, **R),
    "sinks_hs_window": Case(masks.SlidingWindow(8, 0), sinks="hs", **R),
    # -inf sinks are no sinks, also on rows that see no key (zeros, zero gradients).
    "sinks_minus_inf": Case(masks.Causal(offset=-20), sinks="hs_inf", **R),
    # Half-precision inputs with float32 sinks (Splash returned the sinks' gradient in bfloat16).
    "sinks_bfloat16": Case(masks.Causal(), sinks="hs", dtypes=("bfloat16",), q_len=64),
    "soft_cap": Case(masks.Causal(), soft_cap=2.0, input_scale=1.5, **R),
    "segments": Case(masks.Causal(), documents=3, q_len=64),
    "segments_padded_lq_ne_lk": Case(masks.Full(), documents=3, pad=5, q_len=40, kv_len=57),
    "positions": Case(masks.Causal() & masks.SlidingWindow(12, 0), positions="sorted",
                      q_len=30, kv_len=66),
    # Positions at the ends of the accepted range with mask sizes at theirs (2**30).
    "positions_edges_window": Case(masks.SlidingWindow(2**30), positions="edges", q_len=40,
                                   kv_len=48),
    "positions_edges_offsets": Case(masks.Causal(offset=-(2**30))
                                    | (masks.Causal(offset=2**30) & masks.Dilated(3))
                                    | masks.ChunkedCausal(2**30), positions="edges", q_len=40,
                                    kv_len=48),
    "mqa_window": Case(masks.SlidingWindow(7, 2), heads=4, kv_heads=1, **R),
    "value_dim": Case(masks.PrefixLM(9), dim=8, value_dim=12, **R),
    "one_query": Case(masks.Causal(bottom_right=True), q_len=1, kv_len=50),
    "unbatched": Case(masks.Causal(), batch=None, bias="hqk", **R),
    "everything": Case(masks.Causal(bottom_right=True) & masks.SlidingWindow(25, 0),
                       heads=4, kv_heads=2, q_len=39, kv_len=58, dim=8, value_dim=5,
                       softmax_scale=0.4, soft_cap=4.0, bias="b1qk", sinks="hs", documents=3,
                       pad=3),
    # Mask families on the kernel's own tiling.
    # Score terms on a small tiling, with every feature they compose with.
    "score_alibi": Case(masks.Causal(), score="alibi", **R),
    "score_alibi_learned_gqa": Case(masks.SlidingWindow(13, 5), score="alibi_learned", heads=6,
                                    kv_heads=2, sinks="hs", soft_cap=3.0, **R),
    "score_relative_lq_lt_lk": Case(masks.Full(), score="relative", q_len=30, kv_len=70),
    "score_relative_lq_gt_lk": Case(masks.Causal(offset=3), score="relative", q_len=70,
                                    kv_len=37),
    "score_relative_causal_positions": Case(masks.Causal(), score="relative_causal",
                                            positions="sorted", q_len=30, kv_len=66),
    # Causal buckets on a mask that sees later keys too: every later key is in bucket 0.
    "score_relative_causal_full": Case(masks.Full(), score="relative_causal", q_len=70,
                                       kv_len=100),
    "score_function_per_head": Case(masks.PerHead([masks.Causal(), masks.SlidingWindow(5),
                                                   masks.ChunkedCausal(16), ~masks.Causal()]),
                                    score="function", **R),
    "score_one_query": Case(masks.Causal(bottom_right=True), score="relative", q_len=1,
                            kv_len=50),
    "score_fully_masked_rows": Case(masks.Causal(offset=-20), score="alibi_learned", sinks="h",
                                    **R),
    "score_everything": Case(masks.Causal(bottom_right=True) & masks.SlidingWindow(25, 0),
                             heads=4, kv_heads=2, q_len=39, kv_len=58, value_dim=5,
                             softmax_scale=0.4, soft_cap=4.0, bias="b1qk", sinks="hs",
                             documents=3, pad=3, score="relative"),
    "tiled_full": Case(masks.Full(), **BIG),
    "tiled_causal": Case(masks.Causal(), **BIG),
    "tiled_causal_window": Case(masks.Causal() & masks.SlidingWindow(70, 0), **BIG),
    "tiled_causal_open_window": Case(masks.Causal() & masks.SlidingWindow(None, 5), **BIG),
    "tiled_gqa_long": Case(masks.Causal(), batch=1, heads=8, kv_heads=2, q_len=1024, dim=128,
                           tiling=None),
    "tiled_symmetric_window": Case(masks.SlidingWindow(40), **BIG),
    "tiled_chunked": Case(masks.ChunkedCausal(96), **BIG),
    "tiled_prefix": Case(masks.PrefixLM(77), **BIG),
    "tiled_global": Case(masks.SlidingWindow(30) | masks.GlobalTokens(20), **BIG),
    "tiled_dilated": Case(masks.Causal() & masks.Dilated(3), **BIG),
    "tiled_bigbird": Case(masks.Causal() & (masks.SlidingWindow(64, 0) | masks.GlobalTokens(32)
                                            | masks.BigBirdRandom(64, 2)), **BIG),
    "tiled_block_layout": Case(masks.BlockLayoutMask(_TABLE3, 128), **BIG),
    "tiled_predicate": Case(masks.Predicate(every_fifth_skipped), **BIG),
    "tiled_per_head": Case(masks.PerHead([masks.Causal(), masks.SlidingWindow(16),
                                          masks.PrefixLM(50), masks.Full()]), **BIG),
    "tiled_not_causal": Case(~masks.Causal(offset=-1), **BIG),
    "tiled_offset_window_chunk": Case(masks.Causal(offset=3) & masks.SlidingWindow(100, 10)
                                      & masks.ChunkedCausal(128), **BIG),
    # Features on the kernel's own tiling.
    "tiled_documents_window": Case(masks.Causal() & masks.SlidingWindow(50, 0), documents=4,
                                   pad=7, **BIG),
    "tiled_documents": Case(masks.Full(), documents=6, **BIG),
    "tiled_interleaved_documents": Case(masks.Full(), interleaved=True,
                                        **{**BIG, "q_len": 600}),
    "tiled_interleaved_documents_causal": Case(masks.Causal(), interleaved=True,
                                               **{**BIG, "q_len": 600, "dim": 128}),
    "tiled_positions": Case(masks.Causal() & masks.SlidingWindow(60, 0), positions="shifted",
                            **BIG),
    "tiled_dtypes": Case(masks.Causal() & masks.SlidingWindow(100, 0),
                         dtypes=("float16", "float32", "bfloat16"), **BIG),
    **{f"tiled_head_dim_{d}": Case(masks.Causal(), **{**BIG, "q_len": 200, "dim": d})
       for d in (80, 96, 128, 192, 256)},
    "tiled_value_dim": Case(masks.Causal(), value_dim=128, **{**BIG, "q_len": 200}),
    "tiled_decode_mqa": Case(masks.Causal(bottom_right=True), heads=8, kv_heads=1, q_len=1,
                             kv_len=500, dim=64, tiling=None),
    "tiled_cross_lengths": Case(masks.Causal(bottom_right=True) & masks.SlidingWindow(90, 0),
                                **{**BIG, "q_len": 130, "kv_len": 333}),
    "tiled_bias_1hqk": Case(masks.Causal(), bias="1hqk", **BIG),
    "tiled_bias_b1qk": Case(masks.Full(), bias="b1qk", **BIG),
    "tiled_bias_qk": Case(masks.Causal(), bias="qk", **BIG),
    "tiled_bias_b11k": Case(masks.Causal() & masks.SlidingWindow(80, 0), bias="b11k", **BIG),
    "tiled_bias_bhq1": Case(masks.Causal(), bias="bhq1", sinks="h", **BIG),
    "tiled_bias_1111": Case(masks.Full(), bias="1111", soft_cap=4.0, **BIG),
    "tiled_sinks_soft_cap": Case(masks.Causal(), sinks="hs", soft_cap=5.0, **BIG),
    "tiled_everything": Case(masks.Causal() & masks.SlidingWindow(80, 0), bias="bhqk",
                             sinks="hs", soft_cap=3.0, documents=3, pad=5,
                             **{**BIG, "dim": 80, "value_dim": 96}),
    "tiled_fully_masked_rows": Case(masks.Causal(offset=-40), **BIG),
    "tiled_fully_masked_rows_sinks": Case(masks.Causal(offset=-40), sinks="h", **BIG),
    "tiled_explicit": Case(masks.Causal() & masks.SlidingWindow(70, 0),
                           **{**BIG, "tiling": bsa.kernels.TritonConfig(
                               block_q=64, block_kv=32, block_q_bwd=32, block_kv_bwd=64,
                               num_warps=4, num_stages=2)}),
    "tiled_explicit_dq": Case(masks.Causal() & masks.SlidingWindow(70, 0),
                              **{**BIG, "tiling": bsa.kernels.TritonConfig(
                                  block_q=64, block_kv=64, block_q_bwd=32, block_kv_bwd=64,
                                  num_warps=4, num_stages=3, block_q_dq=64, block_kv_dq=32,
                                  num_stages_dq=3)}),
    "tiled_score_alibi_window": Case(masks.Causal() & masks.SlidingWindow(70, 0),
                                     score="alibi_learned", **BIG),
    "tiled_score_alibi_everything": Case(masks.Causal() & masks.SlidingWindow(80, 0),
                                         score="alibi_learned", sinks="hs", soft_cap=3.0,
                                         documents=3, pad=5, **{**BIG, "dim": 128}),
    "tiled_score_relative": Case(masks.Causal(), score="relative_t5", **{**BIG, "q_len": 600}),
    # Partial blocks read from bitmaps (no canonical terms), near blocks in slices.
    "tiled_score_relative_bitmaps": Case(masks.Predicate(every_other_causal), score="relative_t5",
                                         **{**BIG, "q_len": 400}),
    "tiled_score_function_positions": Case(masks.Causal() & masks.SlidingWindow(60, 0),
                                           score="function", positions="shifted", **BIG),
    "tiled_explicit_documents": Case(masks.Causal(), documents=4,
                                     **{**BIG, "tiling": bsa.kernels.TritonConfig(
                                         block_q=64, block_kv=64, block_q_bwd=32,
                                         block_kv_bwd=64, num_warps=4, num_stages=3,
                                         block_q_dq=64, block_kv_dq=32, num_stages_dq=3)}),
}


def _dtypes(kernel_cls, case: Case) -> tuple[str, ...]:
    """The case's dtypes, else the kernel's own: float32 where it runs on the CPU, bfloat16
    for a GPU-only kernel."""
    if case.dtypes is not None:
        return case.dtypes
    return ("float32",) if "cpu" in kernel_cls.platforms else ("bfloat16",)


def _unavailable(kernel_cls) -> str | None:
    """Why `kernel_cls` cannot run anywhere on this installation (a library it needs is
    missing), or None: its reason to decline a plain call on its own platform."""
    features = bsa.Features(platform=kernel_cls.platforms[0], dtype="bfloat16", q_len=128,
                            kv_len=128)
    resolved = bsa.ResolvedMask(masks.Full(), q_len=128, kv_len=128, num_heads=1)
    return kernel_cls().decline_reason(resolved, features)


def _marks(kernel_cls, runs: bool) -> list:
    """A GPU-only kernel carries the `gpu` marker. It skips where a library it needs is
    missing, and, when the test `runs` it, where this machine is not one of its platforms."""
    marks = [] if "cpu" in kernel_cls.platforms else [pytest.mark.gpu]
    why = _unavailable(kernel_cls)
    if why is None and runs and bsa.default_platform() not in kernel_cls.platforms:
        why = f"runs on {' / '.join(kernel_cls.platforms)}; this machine is {bsa.default_platform()}"
    if why is not None:
        marks.append(pytest.mark.skip(reason=f"{kernel_cls.name}: {why}"))
    return marks


#: The cases each kernel runs in the quick subset (``-m "not slow"``): the one that combines
#: every feature, and a single query (the default CPU kernel: a learned score term with GQA,
#: sinks and a soft cap instead);
#: cuDNN, which declines both, runs causal; Splash and PallasTpuBlockSparse (interpreted on the
#: CPU, seconds a case) a few of the features they take. The rest are marked `slow`.
QUICK_CASES = {"xla": {"everything", "score_alibi_learned_gqa"},
               "cudnn": {"tiled_causal"},
               "splash": {"window", "gqa_causal_sinks_s", "sinks_minus_inf"},
               "pallas_tpu": {"score_alibi_learned_gqa", "segments_padded_lq_ne_lk",
                              "score_relative_causal_positions", "bias_b11k_gqa_window"}}


#: Kernels whose cases beyond the quick subset are the `extended` tier on the CPU: the gather
#: kernel, Splash and PallasTpuBlockSparse (interpreted here, seconds a case). The CPU's
#: default kernels, XlaBlockSparse and DenseReference (small calls), run every case in the
#: full tier but the `tiled_` ones outside `TILED_FULL`. Off the CPU every kernel runs every
#: case.
EXTENDED_KERNELS = {"gather", "splash", "pallas_tpu"}

#: The `tiled_` cases (GPU-tile lengths, 256 to 1024 tokens) the CPU's default kernels run in
#: the full tier on the CPU, one of each kind: a long grouped causal call, a union with
#: global tokens and random blocks, documents under a window, a mask per head, an explicit
#: tiling and a broadcast bias. Their small cases cover each feature; the other `tiled_`
#: cases are the extended tier there (seconds each, a third of the full tier's conformance
#: time on 2 cores).
TILED_FULL = {"tiled_gqa_long", "tiled_bigbird", "tiled_documents_window", "tiled_per_head",
              "tiled_explicit", "tiled_bias_b11k"}

#: The inner points of the head-dim sweep, which the CPU kernel runs in the extended tier on
#: the CPU: its default run takes 80 (not a power of two) and 256 (the largest).
SWEEP_EXTENDED = {"tiled_head_dim_96", "tiled_head_dim_128", "tiled_head_dim_192"}


def _quick(cls, name: str) -> list:
    if name in QUICK_CASES.get(cls.name, {"everything", "one_query"}):
        return []
    tiled_extended = name.startswith("tiled_") and name not in TILED_FULL
    extended = ((cls.name in EXTENDED_KERNELS or name in SWEEP_EXTENDED or tiled_extended)
                and bsa.default_platform() == "cpu")
    return [pytest.mark.slow] + ([pytest.mark.extended] if extended else [])


#: Cases a kernel is known to miss, with what was measured (strict: a pass fails the run).
KNOWN_MISSES = {
    ("triton", "tiled_bias_1111", "bfloat16"): (
        "H200, jax 0.11.2: the scalar bias's gradient is 3.1e-2 off in bfloat16 (tolerance "
        "2e-2; out, dq, dk, dv 2e-3 to 3e-3). It sums dS over every pair, which nearly "
        "cancels (each row's dS sums to zero without the soft cap)."),
}


def _known_miss(cls, name, dtype) -> list:
    why = KNOWN_MISSES.get((cls.name, name, dtype))
    return [] if why is None else [pytest.mark.xfail(strict=True, reason=why)]


PARAMS = [pytest.param(cls, name, dtype, marks=_marks(cls, runs=True) + _quick(cls, name)
                       + _known_miss(cls, name, dtype), id=f"{cls.name}-{name}-{dtype}")
          for cls in KERNELS for name, case in CASES.items() for dtype in _dtypes(cls, case)]


# ---------------------------------------------------------------------------------------------
# Inputs and the oracle.


@dataclasses.dataclass
class Built:
    args: dict  # differentiable inputs: q, k, v, and bias / sinks when present
    data: dict  # segment ids / positions as the call takes them
    truth: dict  # the NumPy evaluator's arguments: mask, shapes, segment ids, positions
    cotangent: jax.Array

    @property
    def diff(self) -> dict:
        """The differentiable call arguments besides q, k, v: bias and sinks when present."""
        return {n: x for n, x in self.args.items() if n in ("bias", "sinks")}

    @property
    def score_arrays(self) -> dict:
        """The score term's learned arrays (``slopes``, ``table``) when present."""
        return {n: x for n, x in self.args.items() if n in ("slopes", "table")}

    @property
    def visible(self) -> np.ndarray:
        """``[B, H, Lq, Lk]`` visibility from the NumPy evaluator."""
        return np_visibility(**self.truth)


def _normal(rng, shape, dtype, scale=1.0):
    # Rounded in NumPy: an eager `astype` compiles once per shape (hundreds of cases).
    x = (rng.standard_normal(shape) * scale).astype(np.float32).astype(jnp.dtype(dtype))
    return jnp.asarray(x)


def build(case: Case, dtype: str) -> Built:
    rng = np.random.default_rng(case.seed)
    b = 1 if case.batch is None else case.batch
    lead = () if case.batch is None else (case.batch,)
    h, lq = case.heads, case.q_len
    hkv = h if case.kv_heads is None else case.kv_heads
    lk = lq if case.kv_len is None else case.kv_len
    dv = case.dim if case.value_dim is None else case.value_dim
    args = {
        "q": _normal(rng, lead + (h, lq, case.dim), dtype, case.input_scale),
        "k": _normal(rng, lead + (hkv, lk, case.dim), dtype, case.input_scale),
        "v": _normal(rng, lead + (hkv, lk, dv), dtype),
    }
    if case.bias is not None:
        shape = {"qk": (lq, lk), "hqk": (h, lq, lk), "b1qk": lead + (1, lq, lk),
                 "1hqk": (1, h, lq, lk), "bhqk": lead + (h, lq, lk), "b11k": lead + (1, 1, lk),
                 "bhq1": lead + (h, lq, 1), "1111": (1, 1, 1, 1)}[case.bias]
        args["bias"] = _normal(rng, shape, jnp.float32)
    if case.sinks is not None:
        args["sinks"] = _normal(rng, {"s": (3,), "h": (h,), "hs": (h, 2), "hs_inf": (h, 2)}[
            case.sinks], jnp.float32)
        if case.sinks == "hs_inf":  # head 0 has no sink, head 1 one of two
            args["sinks"] = args["sinks"].at[0].set(-jnp.inf).at[1, 0].set(-jnp.inf)
    if case.score is not None:
        for name, shape in SCORES[case.score][0].items():
            args[name] = _normal(rng, shape(h), jnp.float32, 0.3)
    data, truth = {}, {}
    if case.documents or case.interleaved:
        if case.interleaved:
            # Row 0: two documents alternating every 150 tokens; row 1: four packed documents.
            ids = np.stack([(np.arange(lq) // 150) % 2, np.repeat(np.arange(4), -(-lq // 4))[:lq]])
            qs = ks = ids[:b].astype(np.int32)
        else:
            qs = sorted_segments(rng, b, lq, case.documents, pad=case.pad)
            ks = qs if lk == lq else sorted_segments(rng, b, lk, case.documents, pad=case.pad)
        truth.update(q_seg=qs, kv_seg=ks)
        data.update(q_segment_ids=qs, kv_segment_ids=ks)
    if case.positions == "sorted":
        qp = np.sort(rng.choice(lq + lk, size=(b, lq)), axis=-1).astype(np.int32)
        kp = np.stack([np.arange(lk)] * b).astype(np.int32)
    elif case.positions == "shifted":
        qp = np.stack([np.arange(lq) + 1000, np.arange(lq)[::-1] * 2])[:b].astype(np.int32)
        kp = np.stack([np.arange(lk) + 950, np.arange(lk) * 2])[:b].astype(np.int32)
    elif case.positions == "edges":
        # The ends of the accepted range [-2**30, 2**30 - 1] and the middle, shuffled: with
        # mask sizes of 2**30, sums and differences reach the ends of int32.
        top, bottom = 2**30 - 1, -(2**30)

        def edges(length, salt):
            pieces = np.concatenate([top - np.arange(length), bottom + np.arange(length),
                                     np.arange(length) - length // 2])
            return np.stack([np.random.default_rng(salt + r).permutation(pieces)[:length]
                             for r in range(b)]).astype(np.int32)

        qp, kp = edges(lq, 10), edges(lk, 20)
    if case.positions is not None:
        truth.update(q_pos=qp, kv_pos=kp)
        data.update(q_positions=qp, kv_positions=kp)
    data = {n: jnp.asarray(x if case.batch is not None else x[0]) for n, x in data.items()}
    mask = case.mask & masks.Document() if (case.documents or case.interleaved) else case.mask
    truth.update(mask=mask, batch=b, heads=h, q_len=lq, kv_len=lk)
    cotangent = _normal(rng, lead + (h, lq, dv), dtype)
    return Built(args, data, truth, cotangent)


def oracle(case: Case, built: Built):
    """Float64 output and gradients of every differentiable input, on the CPU."""
    batched = case.batch is not None
    cpu = jax.devices("cpu")[0]
    visible = built.visible
    with jax.enable_x64(True), jax.default_device(cpu):
        a = {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in built.args.items()}
        vis = jnp.asarray(visible)

        def f(a, vis):
            lift = (lambda x: x) if batched else (lambda x: x[None])
            bias = a.get("bias")
            if bias is not None and not batched and bias.ndim == 3:
                bias = bias[None]
            out = jnp_attention_f64(lift(a["q"]), lift(a["k"]), lift(a["v"]), vis,
                                    scale=case.softmax_scale, bias=bias, sinks=a.get("sinks"),
                                    soft_cap=case.soft_cap, score=_oracle_score(case, built, a))
            return out if batched else out[0]

        # One compiled function (eager calls compile every operation separately); `vis` is an
        # argument, not a constant for XLA to fold.
        @jax.jit
        def value_and_grads(a, vis, ct):
            out, pullback = jax.vjp(lambda a: f(a, vis), a)
            return out, pullback(ct)[0]

        out, grads = value_and_grads(a, vis, jnp.asarray(np.asarray(built.cotangent, np.float64)))
        return np.asarray(out), {n: np.asarray(g) for n, g in grads.items()}


def _oracle_score(case: Case, built: Built, a: dict):
    """`score_f64` with the case's terms at the call's positions (float64 arrays `a`)."""
    if case.score is None:
        return None
    t = built.truth
    q_pos = t.get("q_pos", np.broadcast_to(np.arange(t["q_len"]), (t["batch"], t["q_len"])))
    kv_pos = t.get("kv_pos", np.broadcast_to(np.arange(t["kv_len"]), (t["batch"], t["kv_len"])))
    options = SCORES[case.score][2](t["heads"])
    options = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in options.items()}
    arrays = {n: a[n] for n in SCORES[case.score][0]}
    return lambda s: score_f64(s, q_pos=q_pos, kv_pos=kv_pos, **arrays, **options)


def _with_score(attn, case: Case, arrays: dict):
    """`attn` with the case's score term built from `arrays` (the learned ones)."""
    if case.score is None:
        return attn
    return eqx.tree_at(lambda m: m.score, attn, SCORES[case.score][1](arrays),
                       is_leaf=lambda x: x is None)


def run_kernel(attn, built: Built, case: Case | None = None):
    def f(a):
        scored = attn if case is None else _with_score(attn, case, a)
        return scored(a["q"], a["k"], a["v"], **{n: a[n] for n in built.diff}, **built.data)

    @jax.jit
    def run(a, ct):
        out, pullback = jax.vjp(f, a)
        return out, pullback(ct)[0]

    return run(built.args, built.cotangent)


def _module(case: Case, kernel, built: Built | None = None):
    tiling = SMALL if case.tiling == "small" else case.tiling
    attn = bsa.BlockSparseAttention(mask=case.mask, kernel=kernel, tiling=tiling,
                                    softmax_scale=case.softmax_scale,
                                    logits_soft_cap=case.soft_cap)
    return attn if built is None else _with_score(attn, case, built.score_arrays)


def _errors(got, want) -> tuple[float, float]:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert np.all(np.isfinite(got)), "non-finite values"
    scale = max(np.abs(want).max(initial=0.0), 1e-30)
    norm = max(np.linalg.norm(want), 1e-30)
    return float(np.abs(got - want).max(initial=0.0) / scale), float(np.linalg.norm(got - want) / norm)


def _decline(case: Case, kernel, built: Built, platform: str | None = None) -> str | None:
    """The kernel's reason to decline this call, through the plan (on `platform`, default
    this machine's), or None."""
    attn = _module(case, kernel, built)
    try:
        attn.plan(built.args["q"], built.args["k"], built.args["v"], platform=platform,
                  **built.diff, **built.data)
    except ValueError as e:
        if str(e).startswith(f"kernel {kernel.name} cannot run this call: "):
            return str(e)
        raise
    return None


# ---------------------------------------------------------------------------------------------
# The suite.


@pytest.mark.parametrize("kernel_cls,case_name,dtype", PARAMS)
def test_kernel_conforms(kernel_cls, case_name, dtype):
    check_conforms(kernel_cls(), case_name, dtype)


def check_conforms(kernel, case_name: str, dtype: str):
    """`kernel` on case `case_name` in `dtype` against the float64 oracle, forward and every
    gradient; or, where it declines, that the decline is an expected one."""
    case = CASES[case_name]
    built = build(case, dtype)
    why = _decline(case, kernel, built)
    if why is not None:
        assert (case_name, dtype) in EXPECTED_DECLINES.get(kernel.name, set()), (
            f"{kernel.name} declined {case_name} ({dtype}): {why}")
        return
    out, grads = run_kernel(_module(case, kernel, built), built, case)
    assert out.shape == built.cotangent.shape and out.dtype == jnp.dtype(dtype)
    want_out, want_grads = oracle(case, built)
    visible = built.visible
    (tol_max_out, tol_max_grad), (tol_norm_out, tol_norm_grad) = (
        TOL[dtype]["max"], TOL[dtype]["norm"])
    errors = {"out": _errors(out, want_out)}
    assert set(grads) == set(want_grads)
    for n in grads:
        assert grads[n].dtype == built.args[n].dtype, n
        assert np.abs(want_grads[n]).max() > 0, f"d{n} of the oracle is all zeros"
        errors[f"d{n}"] = _errors(grads[n], want_grads[n])
    bad = {n: e for n, e in errors.items()
           if e[0] > (tol_max_out if n == "out" else tol_max_grad)
           or e[1] > (tol_norm_out if n == "out" else tol_norm_grad)}
    assert not bad, f"(max, norm) relative errors over the {dtype} tolerance: {errors}"
    # Rows that see no key: exactly zero output and zero dq, never NaN.
    dead = ~visible.any(-1)
    if dead.any():
        b_out = np.asarray(out) if case.batch is not None else np.asarray(out)[None]
        b_dq = np.asarray(grads["q"]) if case.batch is not None else np.asarray(grads["q"])[None]
        assert (b_out[dead] == 0).all() and (b_dq[dead] == 0).all()


def _cudnn_wide_heads() -> bool:
    """Whether CudnnDense takes head dims over 128 here (on a Hopper GPU, once they have run on
    one)."""
    from eqx_bsattn.strategies.kernels.cudnn import head_dim_decline

    return head_dim_decline(256) is None


_CUDNN_RUNS = {"tiled_full", "tiled_causal", "tiled_causal_window",
               "tiled_causal_open_window", "tiled_gqa_long",
               "tiled_head_dim_80", "tiled_head_dim_96", "tiled_head_dim_128", "tiled_explicit",
               "tiled_explicit_dq",
               *(("tiled_head_dim_192", "tiled_head_dim_256") if _cudnn_wide_heads() else ())}


def _mosaic_lowers(fn) -> bool:
    """Whether Pallas Mosaic GPU lowers the score function `fn` with this JAX (its lowering
    rules grow from version to version; no GPU needed)."""
    try:
        from eqx_bsattn.contract import ScoreTerm
        from eqx_bsattn.strategies.kernels.mosaic.kernel import function_lowering_failure

        return function_lowering_failure(ScoreTerm.of(fn)) is None
    except ImportError:
        return False


def _pallas_tpu_awaits_bias() -> bool:
    """Whether PallasTpuBlockSparse still declines a bias (until it has run on a TPU)."""
    from eqx_bsattn.strategies.kernels import PallasTpuBlockSparse

    return PallasTpuBlockSparse.awaits_device_run("bias")


def _mosaic_table_runs() -> bool:
    """Whether MosaicBlockSparse takes a T5 table (it declines one until it has run on a
    GPU)."""
    from eqx_bsattn.strategies.kernels.mosaic import kernel

    return not kernel.MosaicBlockSparse.awaits_device_run("t5_table")


def _mosaic_head_dim_256() -> bool:
    """Whether MosaicBlockSparse takes head dim 256 (it declines it until it has run on a
    GPU)."""
    from eqx_bsattn.strategies.kernels.mosaic import kernel

    return not kernel.MosaicBlockSparse.awaits_device_run("head_dim_256")


def _mosaic_padded_head_dims() -> bool:
    """Whether MosaicBlockSparse takes head dims it zero-pads (``Dv != D``, or D outside 64 /
    128 / 256; it declines them until they have run on a GPU)."""
    from eqx_bsattn.strategies.kernels.mosaic import kernel

    return not kernel.MosaicBlockSparse.awaits_device_run("padded_head_dims")


#: MosaicBlockSparse: 16-bit, D = Dv in {64, 128} (and 256 once it has run on a GPU), other
#: head dims up to 256 zero-padded to those (once that has run on a GPU), masks
#: with shared in-kernel terms, an element predicate Mosaic GPU lowers or an element map
#: (BigBird's random blocks), a bias of any broadcast shape, ALiBi, score functions that
#: Mosaic GPU lowers and, once it has run on a GPU, a T5 table without per-call positions.
_MOSAIC_RUNS = {"tiled_positions", "tiled_global", "tiled_dilated", "tiled_predicate",
                *(("tiled_head_dim_256",) if _mosaic_head_dim_256() else ()),
                *(("tiled_head_dim_80", "tiled_head_dim_96", "tiled_value_dim",
                   "tiled_everything") if _mosaic_padded_head_dims() else ()),
                *(("tiled_head_dim_192",) if _mosaic_padded_head_dims()
                  and _mosaic_head_dim_256() else ()),
                *(("tiled_score_relative", "tiled_score_relative_bitmaps")
                  if _mosaic_table_runs() else ()),
                "tiled_not_causal", "tiled_per_head", "tiled_bigbird",
                *(("tiled_score_function_positions",) if _mosaic_lowers(distance_and_scale)
                  else ()),
                "tiled_full", "tiled_causal", "tiled_causal_window", "tiled_causal_open_window",
                "tiled_sinks_soft_cap", "tiled_fully_masked_rows_sinks", "tiled_gqa_long",
                "tiled_symmetric_window", "tiled_chunked", "tiled_prefix",
                "tiled_block_layout", "tiled_offset_window_chunk", "tiled_documents_window",
                "tiled_documents", "tiled_interleaved_documents",
                "tiled_interleaved_documents_causal", "tiled_head_dim_128", "tiled_decode_mqa",
                "tiled_cross_lengths", "tiled_fully_masked_rows", "tiled_explicit",
                "tiled_explicit_dq", "tiled_explicit_documents", "tiled_score_alibi_window",
                "tiled_score_alibi_everything", "tiled_bias_1hqk", "tiled_bias_b1qk",
                "tiled_bias_qk", "tiled_bias_b11k", "tiled_bias_bhq1", "tiled_bias_1111"}


#: The (case, dtype) pairs each kernel declines, with why. A kernel absent here declines none.
EXPECTED_DECLINES = {
    "mosaic": {(name, dtype) for name, case in CASES.items()
               for dtype in (case.dtypes or ("bfloat16",))
               if not (name in _MOSAIC_RUNS or (name == "tiled_dtypes" and dtype != "float32"))},
    # cuDNN: only full / causal / causal-window masks, 16-bit, no per-call data or extras,
    # Dv == D <= 128 (256 on a Hopper GPU), Lq == Lk, even lengths.
    "cudnn": {(name, dtype) for name, case in CASES.items()
              for dtype in (case.dtypes or ("bfloat16",))
              if not (name in _CUDNN_RUNS or (name == "tiled_dtypes" and dtype != "float32"))},
    # Splash: no bias, no positions, no float16, no score terms.
    "splash": {(name, dtype) for name, case in CASES.items()
               for dtype in (case.dtypes or ("float32",))
               if case.bias is not None or case.positions is not None or dtype == "float16"
               or case.score is not None},
    # PallasTpuBlockSparse: no float16, and no bias until one has run on a TPU (it takes
    # every mask).
    "pallas_tpu": {(name, dtype) for name, case in CASES.items()
                   for dtype in (case.dtypes or ("float32",))
                   if dtype == "float16"
                   or (case.bias is not None and _pallas_tpu_awaits_bias())},
    # Triton: ALiBi and the relative bias run in the kernel, a jnp score function does not.
    # (bfloat16 on a GPU, float32 in Triton's interpreter on the CPU.)
    # A union of terms with a dilation has no in-kernel terms, so it needs element bitmaps,
    # which per-call positions rule out.
    "triton": {(name, dtype) for name, case in CASES.items()
               for dtype in (case.dtypes or ("bfloat16", "float32"))
               if case.score == "function" or name == "positions_edges_offsets"},
    # The documented gather kernel: no score terms.
    "gather": {(name, dtype) for name, case in CASES.items()
               for dtype in (case.dtypes or ("float32",)) if case.score is not None},
}


#: Kernels whose declines the quick tier checks: cuDNN's (a plan a case). The rest are `slow`
#: (the full tier): Mosaic's verdicts lower kernels for CUDA, minutes on 2 cores.
_QUICK_DECLINES = {"cudnn"}


@pytest.mark.parametrize("kernel_cls", [
    pytest.param(cls, id=cls.name, marks=_marks(cls, runs=False)
                 + ([] if cls.name in _QUICK_DECLINES else [pytest.mark.slow]))
    for cls in KERNELS])
def test_declined_cases_are_the_expected_ones(kernel_cls):
    """The kernel declines exactly its expected cases. Declining needs no device: the plan is
    made for the kernel's own platform, so GPU kernels are checked on the CPU too."""
    kernel = kernel_cls()
    wrong = []
    for name, case in CASES.items():
        for dtype in _dtypes(kernel_cls, case):
            built = build(case, dtype)
            declined = _decline(case, kernel, built, kernel_cls.platforms[0]) is not None
            if declined != ((name, dtype) in EXPECTED_DECLINES.get(kernel.name, set())):
                wrong.append((name, dtype, "declined" if declined else "ran"))
    assert not wrong, wrong


@pytest.mark.parametrize("kernel_cls", [
    pytest.param(cls, id=cls.name, marks=_marks(cls, runs=False)) for cls in KERNELS])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["plus_inf", "nan"])
def test_plus_inf_and_nan_sinks_are_refused(kernel_cls, bad):
    """One rule for every kernel: sinks are finite or -inf (no sink). Concrete +inf and NaN
    sinks are refused before any kernel runs; traced ones (learned, inside a training step)
    are poisoned instead of checked at run time: every row that sees a key is NaN, and so
    are the gradients of q, k, v and the sinks. A row that sees no key stays zero where the
    sinks join after the kernel, and is NaN too where they join inside it (Splash, Triton's
    forward)."""
    case = Case(masks.Causal(offset=-4), sinks="hs", q_len=32)  # rows 0-3 see no key
    built = build(case, "float32")
    sinks = built.args["sinks"].at[1, 0].set(bad)
    attn = _module(case, kernel_cls())
    q, k, v = built.args["q"], built.args["k"], built.args["v"]
    message = r"`sinks` must be finite or -inf \(no sink\); got \+inf or NaN\."
    with pytest.raises(ValueError, match="^" + message + "$"):
        attn.plan(q, k, v, sinks=sinks, platform=kernel_cls.platforms[0])
    if (jax.default_backend() not in kernel_cls.platforms or _unavailable(kernel_cls)
            or _decline(case, kernel_cls(), built)):
        return  # runs only where the kernel runs (the GPU kernels on a GPU)

    def loss(q, k, v, s):
        out = attn(q, k, v, sinks=s)
        return jnp.sum(out.astype(jnp.float32)), out

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    grads, out = step(q, k, v, built.args["sinks"])
    assert all(np.isfinite(np.asarray(x)).all() for x in (out, *grads))
    (dq, dk, dv, dsinks), out = step(q, k, v, sinks)
    out = np.asarray(out)
    assert np.isnan(out[:, :, 4:]).all()
    inside = kernel_cls.name in ("splash", "triton")
    assert (np.isnan(out[:, :, :4]) if inside else out[:, :, :4] == 0).all()
    assert np.isnan(np.asarray(dq)[:, :, 4:]).all() and np.isnan(np.asarray(dsinks)).all()
    assert np.isnan(np.asarray(dk)).any() and np.isnan(np.asarray(dv)).any()


def test_every_built_in_kernel_is_in_the_suite():
    names = {cls.name for cls in KERNELS}
    assert {"reference", "xla", "triton", "cudnn", "splash", "mosaic", "pallas_tpu"} <= names
    assert "gather" in names  # the worked example of docs/custom_kernel.md
