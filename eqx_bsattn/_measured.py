"""Measured kernel times: the figures the selector orders kernels by where they cover a call.

Priorities say which kernel is tried first; where two kernels accept the same call, the faster
one should run it, and which is faster depends on the pattern and the length (on a TPU v5e the
Pallas TPU kernel beats Splash on causal rows at 32k tokens, Splash wins at 8k; on an H200
cuDNN wins long causal rows, the Mosaic kernel windows and short causal rows). Each
`Measurement` is one benchmark row: a pattern at one shape on one device, each kernel's
forward and forward+backward time, measured in one process. `measured_choice` finds the
row that covers a call and names the fastest of the kernels that accept it; the selector
uses it and `KernelChoice.explain()` quotes the figure that decided.
"""

import dataclasses
import math
from collections.abc import Sequence

from ._mask import MaskTerms

#: The patterns a measurement can describe, read from a call's mask terms (`pattern_of`).
PATTERNS = ("causal", "window", "documents")


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measured row: each kernel's median time on one call shape, in one process.

    - `platform`, `device`: where it ran (``"tpu"``, ``"TPU v5 lite"``).
    - `pattern`: one of `PATTERNS`: ``"causal"``, ``"window"`` (causal with a left window;
      the width in `detail`), ``"documents"`` (causal inside documents given by segment ids).
    - `length`, `batch`, `heads`, `head_dim`, `dtype`: the call's shape (``Lq = Lk``).
    - `times`: ``((kernel name, forward ms, forward+backward ms), ...)``.
    - `source`: the command and date the figures come from.
    """

    platform: str
    device: str
    pattern: str
    length: int
    batch: int
    heads: int
    head_dim: int
    dtype: str
    times: tuple[tuple[str, float, float], ...]
    source: str
    detail: str = ""

    def time_of(self, kernel: str) -> tuple[float, float] | None:
        """``(forward ms, forward+backward ms)`` of `kernel`, or ``None`` if not measured."""
        for name, forward, both in self.times:
            if name == kernel:
                return forward, both
        return None

    def describe(self) -> str:
        what = self.pattern + (f" {self.detail}" if self.detail else "")
        return (f"{what}, B={self.batch} H={self.heads} L={self.length} D={self.head_dim} "
                f"{self.dtype} on {self.device} ({self.source})")


_TPU = "benchmarks/splash_tpu.py --pallas, 2026-12-06"
#: The H200 rows, the default (deterministic) backward: 16k from the module's own kernels in
#: one process; 64k and 1k from docs/log/mosaic.md's "Backward modes" table (ms from its TF/s
#: over the visible pairs).
_GPU = "benchmarks/mosaic_forward.py --impls mosaic cudnn, 2026-12-04"
_GPU_16K = "python -m eqx_bsattn.bench --kernels MosaicBlockSparse CudnnDense, 2026-12-06"
_TPU_8K = "benchmarks/splash_tpu.py --pallas [--batch 2], 2026-12-06, after the grid fix"

#: The built-in figures. A row counts for calls within a factor of two of its length, on its
#: platform, with 16-bit inputs and no score term, bias, sinks or soft cap.
MEASURED: tuple[Measurement, ...] = (
    Measurement("tpu", "TPU v5 lite", "causal", 8192, 1, 16, 128, "bfloat16",
                (("splash", 3.36, 11.79), ("pallas_tpu", 3.54, 12.00)), _TPU_8K),
    Measurement("tpu", "TPU v5 lite", "window", 8192, 1, 16, 128, "bfloat16",
                (("splash", 1.61, 4.57), ("pallas_tpu", 1.58, 4.93)), _TPU_8K, "1024"),
    Measurement("tpu", "TPU v5 lite", "documents", 8192, 1, 16, 128, "bfloat16",
                (("splash", 2.15, 6.58), ("pallas_tpu", 1.72, 5.83)), _TPU_8K, "(16)"),
    Measurement("tpu", "TPU v5 lite", "causal", 8192, 2, 16, 128, "bfloat16",
                (("splash", 7.18, 25.00), ("pallas_tpu", 6.46, 23.68)), _TPU_8K),
    Measurement("tpu", "TPU v5 lite", "window", 8192, 2, 16, 128, "bfloat16",
                (("splash", 2.60, 8.78), ("pallas_tpu", 2.63, 8.87)), _TPU_8K, "1024"),
    Measurement("tpu", "TPU v5 lite", "documents", 8192, 2, 16, 128, "bfloat16",
                (("splash", 3.70, 15.87), ("pallas_tpu", 2.98, 11.01)), _TPU_8K, "(16)"),
    Measurement("tpu", "TPU v5 lite", "causal", 32768, 1, 16, 128, "bfloat16",
                (("splash", 45.01, 165.81), ("pallas_tpu", 40.72, 157.02)), _TPU),
    Measurement("tpu", "TPU v5 lite", "window", 32768, 1, 16, 128, "bfloat16",
                (("splash", 4.79, 16.57), ("pallas_tpu", 4.75, 16.82)), _TPU, "1024"),
    Measurement("tpu", "TPU v5 lite", "documents", 32768, 1, 16, 128, "bfloat16",
                (("splash", 20.36, 67.73), ("pallas_tpu", 17.40, 62.38)), _TPU, "(16)"),
    Measurement("gpu", "NVIDIA H200", "causal", 16384, 2, 16, 128, "bfloat16",
                (("cudnn", 4.294, 14.790), ("mosaic", 3.752, 15.828)), _GPU_16K),
    Measurement("gpu", "NVIDIA H200", "window", 16384, 2, 16, 128, "bfloat16",
                (("cudnn", 1.308, 3.213), ("mosaic", 0.848, 2.798)), _GPU_16K, "1024"),
    Measurement("gpu", "NVIDIA H200", "causal", 65536, 1, 16, 128, "bfloat16",
                (("cudnn", 29.985, 111.891), ("mosaic", 30.853, 125.558)), _GPU),
    Measurement("gpu", "NVIDIA H200", "window", 65536, 1, 16, 128, "bfloat16",
                (("cudnn", 1.543, 5.323), ("mosaic", 1.367, 4.977)), _GPU, "1024"),
    Measurement("gpu", "NVIDIA H200", "causal", 1024, 32, 16, 128, "bfloat16",
                (("cudnn", 0.546, 1.825), ("mosaic", 0.425, 1.608)), _GPU),
)


def pattern_of(terms: MaskTerms | None, *, segment_ids: bool) -> str | None:
    """The measured pattern a mask's shared terms describe, or ``None`` (no figure applies).

    ``"causal"``: a causal offset of 0 and nothing else; ``"window"``: that and a left window;
    ``"documents"``: causal within segment ids. Chunks, prefixes, right windows, tables and
    masks without terms have no measured row."""
    if terms is None or terms.causal_offset != 0:
        return None
    if terms.chunk is not None or terms.prefix is not None or terms.tables:
        return None
    if terms.window_right not in (None, 0):
        return None
    if terms.segment_ids or segment_ids:
        return "documents" if terms.window_left is None else None
    return "causal" if terms.window_left is None else "window"


def covering(features, terms: MaskTerms | None,
             table: Sequence[Measurement] = MEASURED) -> Measurement | None:
    """The row of `table` nearest the call in length (then in batch) that covers it, or
    ``None``.

    A row covers a call on its platform with its pattern, ``Lq = Lk`` within a factor of two
    of its length, 16-bit inputs, and none of the features that change the kernels' relative
    cost (score terms, bias, sinks, soft cap, per-call positions, log-sum-exp for a ring)."""
    if features.dtype not in ("bfloat16", "float16") or features.q_len != features.kv_len:
        return None
    if (features.score or features.bias or features.sinks or features.soft_cap
            or features.positions or features.lse or features.in_loop):
        return None
    pattern = pattern_of(terms, segment_ids=features.segment_ids)
    if pattern is None:
        return None
    rows = [m for m in table if m.platform == features.platform and m.pattern == pattern
            and abs(math.log2(features.kv_len / m.length)) <= 1]
    if not rows:
        return None
    return min(rows, key=lambda m: (abs(math.log2(features.kv_len / m.length)),
                                    abs(math.log2(max(features.batch, 1) / m.batch))))


def measured_choice(row: Measurement, winner: str, others: Sequence[str], accepts) -> tuple[str, str]:
    """``(kernel name, reason)``: of `winner` (the first by priority that accepts the call)
    and the `others` that `row` also times and that `accepts(name)`, the one with the least
    forward+backward time in `row`; the reason quotes the figures that decided.

    `winner` stays when `row` does not time it (nothing to compare it with)."""
    mine = row.time_of(winner)
    if mine is None:
        return winner, ""
    best, best_time = winner, mine
    for name in others:
        theirs = row.time_of(name)
        if theirs is not None and theirs[1] < best_time[1] and accepts(name):
            best, best_time = name, theirs
    figures = ", ".join(f"{name} {fwd:g} / {both:g} ms" for name, fwd, both in row.times)
    if best == winner:
        return winner, f"measured fastest forward+backward of those that accept it ({figures}: {row.describe()})"
    return best, (f"measured faster forward+backward than {winner}, which ranks higher "
                  f"({figures}: {row.describe()})")
