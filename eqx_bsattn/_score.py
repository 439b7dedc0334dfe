"""Score terms: position-dependent additions to the logits, evaluated block by block.

A user writes a score strategy (`ALiBi`, `RelativePositionBias`, `ScoreFunction`, all
subclasses of `AbstractScore`); the plan compiles it into `ScoreTerms`, the contract type a
kernel reads (it never names a strategy class). A kernel evaluates `ScoreTerms.apply` on the
logits of each block it visits, so no ``[Lq, Lk]`` array is formed.

Where a term sits in a logit: ``s = softmax_scale * q . k + bias``, then
``s = terms.apply(s, head, q_pos, k_pos)``, then the soft cap ``c * tanh(s / c)``, then the
mask. Positions are the call's ``q_positions`` / ``kv_positions`` (the token indices when none
are passed).
"""

import abc
import dataclasses
import functools
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._values import poisoned as _poisoned

_F32 = jnp.float32


# ------------------------------------------------------------------------------------------------
# T5 bucketing.


@dataclasses.dataclass(frozen=True)
class RelativeBuckets:
    """T5's bucketing of the distance ``d = q_pos - k_pos`` into `num_buckets` buckets.

    - Bidirectional: keys after the query (``d < 0``) use the upper half of the buckets, and
      ``n = |d|``; each half has ``nb = num_buckets // 2`` buckets.
    - Causal (``bidirectional=False``): ``n = max(d, 0)`` (every later key shares bucket 0);
      ``nb = num_buckets``.
    - Within a half, distances ``n < nb // 2`` (``max_exact``) have a bucket each; larger
      ones go to ``max_exact + floor((nb - max_exact) * log(n / max_exact) /
      log(max_distance / max_exact))``, clipped to ``nb - 1`` (every ``n >= max_distance``).

    The floor is of the exact real number (integer thresholds, computed once): T5's float32
    formula, without its rounding. Mesh-TensorFlow's and Hugging Face's T5 use the same
    convention, with the relative position ``k_pos - q_pos = -d``.
    """

    num_buckets: int
    bidirectional: bool = True
    max_distance: int = 128

    def __post_init__(self):
        nb = self.half
        if nb < 2:
            need = 4 if self.bidirectional else 2
            raise ValueError(f"`num_buckets` must be at least {need} "
                             f"(bidirectional={self.bidirectional}); got {self.num_buckets}.")
        if not isinstance(self.max_distance, int) or self.max_distance <= nb // 2:
            raise ValueError(
                f"`max_distance` must be an integer above max_exact = {nb // 2} (half the "
                f"buckets of a direction); got {self.max_distance!r}.")

    @property
    def half(self) -> int:
        """Buckets per direction (``nb``)."""
        return self.num_buckets // 2 if self.bidirectional else self.num_buckets

    @functools.cached_property
    def thresholds(self) -> tuple[int, ...]:
        """The smallest distance of each logarithmic bucket after the first, ascending."""
        nb, md = self.half, self.max_distance
        me = nb // 2
        span = nb - me
        out = []
        for f in range(1, span):
            # floor(span * log(n / me) / log(md / me)) >= f  <=>  n**span >= me**(span-f) * md**f
            target = me ** (span - f) * md ** f
            lo, hi = me, md
            while lo < hi:  # the smallest n with n**span >= target
                mid = (lo + hi) // 2
                if mid ** span >= target:
                    hi = mid
                else:
                    lo = mid + 1
            out.append(lo)
        return tuple(out)

    @property
    def far_distance(self) -> int:
        """The least ``n`` from which every distance of a direction is in that direction's
        last bucket: the last threshold (``max_exact`` when there is no logarithmic bucket
        past the first). Kernels that visit blocks take such a block's entry as one scalar."""
        return self.thresholds[-1] if self.thresholds else self.half // 2

    def far_buckets(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((gap, bucket), (gap, bucket))`` of the keys far before the query and far after
        it: every ``d = q_pos - k_pos >= gap`` of the first is in its `bucket`, as is every
        ``d <= -gap`` of the second (causal bucketing puts every later key in bucket 0, so
        its gap is 0)."""
        ahead = (self.far_distance, self.half - 1)
        if self.bidirectional:
            return ahead, (self.far_distance, 2 * self.half - 1)
        return ahead, (0, 0)

    def bucket(self, distance: Int[Array, "..."]) -> Int[Array, "..."]:
        """Bucket ids (int32, same shape) of int32 distances ``q_pos - k_pos``."""
        distance = jnp.asarray(distance, jnp.int32)
        nb = self.half
        me = nb // 2
        if self.bidirectional:
            offset = jnp.where(distance < 0, nb, 0).astype(jnp.int32)
            # |d| as a non-negative int32 (d = -2**31 cannot occur: positions are within 2**30).
            n = jnp.abs(distance)
        else:
            offset = 0
            n = jnp.maximum(distance, 0)
        far = me + sum((n >= t).astype(jnp.int32) for t in self.thresholds)
        return offset + jnp.where(n < me, n, far).astype(jnp.int32)


# ------------------------------------------------------------------------------------------------
# The contract: what a kernel reads.


class ScoreTerms(eqx.Module):
    """The score terms of a call, as every kernel reads them (`AttentionInputs.score`).

    Each part is off when ``None``; the parts that are on apply in this order:

    - `slopes` ``[H]`` float: ALiBi, ``s += slopes[h] * (k_pos - q_pos)``.
    - `table` ``[H, num_buckets]`` float with `buckets` (`RelativeBuckets`): relative
      position bias, ``s += table[h, buckets.bucket(q_pos - k_pos)]``.
    - `function` (static): ``s = function(s, head, q_pos, k_pos)``, a jnp function.

    `slopes` and `table` are differentiable inputs of the kernel (their gradients are the
    sums of ``dS`` times the term's derivative over every visible pair). `kinds` names the
    parts that are on, for `decline_reason` and the selector.

    ```python
    terms.apply(s, head, q_pos, k_pos)   # s [..., bq, bk]; head, q_pos, k_pos broadcastable
    ```
    """

    slopes: Float[Array, " h"] | None = None
    table: Float[Array, "h buckets"] | None = None
    buckets: RelativeBuckets | None = eqx.field(default=None, static=True)
    function: Callable | None = eqx.field(default=None, static=True)

    #: The names `kinds` gives each part.
    KINDS: ClassVar[tuple[str, ...]] = ("alibi", "relative_bias", "function")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The parts that are on: a subset of ``("alibi", "relative_bias", "function")``."""
        on = (self.slopes is not None, self.table is not None, self.function is not None)
        return tuple(name for name, flag in zip(self.KINDS, on) if flag)

    @property
    def arrays(self) -> tuple:
        """``(slopes, table)``: the differentiable parts (``None`` where off)."""
        return self.slopes, self.table

    def with_arrays(self, slopes, table) -> "ScoreTerms":
        """These terms with `slopes` and `table` replaced (e.g. by per-unit rows)."""
        return ScoreTerms(slopes, table, self.buckets, self.function)

    def rows(self, heads: Int[Array, "..."]) -> "ScoreTerms":
        """These terms with each array's head axis gathered at `heads` (``slopes[heads]``,
        ``table[heads]``); `apply` then takes ``row`` indices into that axis."""
        return self.with_arrays(None if self.slopes is None else self.slopes[heads],
                                None if self.table is None else self.table[heads])

    def apply(self, s: Float[Array, "..."], head, q_pos, k_pos, *, row=None):
        """The logits `s` with the terms added (float32 where `s` is).

        `head` (query-head ids), `q_pos` and `k_pos` (int32 positions) broadcast against `s`;
        `row` (default `head`) indexes the arrays' first axis, for terms gathered by `rows`.
        """
        row = head if row is None else row
        if self.slopes is not None:
            distance = (jnp.asarray(k_pos) - jnp.asarray(q_pos)).astype(_F32)
            s = s + self.slopes.astype(_F32)[row] * distance
        if self.table is not None:
            bucket = self.buckets.bucket(jnp.asarray(q_pos) - jnp.asarray(k_pos))
            s = s + self.table.astype(_F32)[row, bucket]
        if self.function is not None:
            s = jnp.asarray(self.function(s, head, q_pos, k_pos), s.dtype)
        return s


def describe_score(terms: ScoreTerms | None) -> str:
    """One line naming the score terms, for `CallPlan.explain`."""
    if terms is None:
        return "none"
    parts = []
    if terms.slopes is not None:
        parts.append(f"alibi (slopes [{terms.slopes.shape[0]}])")
    if terms.table is not None:
        b = terms.buckets
        parts.append(f"relative_bias ({b.num_buckets} buckets, bidirectional={b.bidirectional}, "
                     f"max_distance={b.max_distance})")
    if terms.function is not None:
        parts.append(f"function {getattr(terms.function, '__name__', repr(terms.function))}")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------------
# The strategies a user writes.


class AbstractScore(eqx.Module):
    """A score term: what the plan adds to each logit, compiled into `ScoreTerms`.

    A subclass implements `compile` (its `ScoreTerms` for a call with `num_heads` query heads,
    raising a one-line `ValueError` naming the argument when the shapes do not fit). Learned
    arrays are its pytree leaves, so `eqx.filter_grad` reaches them.
    """

    @abc.abstractmethod
    def compile(self, num_heads: int) -> ScoreTerms:
        """The `ScoreTerms` a kernel reads, for a call with `num_heads` query heads."""


def check_score(score) -> None:
    """Raise the `TypeError` that names `score` unless it is an `AbstractScore` or ``None``."""
    if score is not None and not isinstance(score, AbstractScore):
        raise TypeError(f"`score` must be an AbstractScore (scores.ALiBi, "
                        f"scores.RelativePositionBias, scores.ScoreFunction) or None; got "
                        f"{type(score).__name__}.")


def compile_score(score: AbstractScore | None, num_heads: int) -> ScoreTerms | None:
    """The `ScoreTerms` of a module's `score` for a call with `num_heads` query heads."""
    check_score(score)
    return None if score is None else score.compile(num_heads)


def attach_score(score: AbstractScore | None, inputs, num_heads: int, sharding):
    """`inputs` (`AttentionInputs`) with the compiled `score` terms, or unchanged without."""
    terms = compile_score(score, num_heads)
    if terms is None:
        return inputs
    if not sharding.passes_score:
        # Unsharded, ShardMap and RingAttention pass them; a sharding of one's own may not.
        raise ValueError(
            f"`score` terms need a sharding that passes them to each shard's call "
            f"(passes_score); this module's sharding {type(sharding).__name__} does not. "
            f"Drop the sharding or the score.")
    # An infinite slope times a zero distance, or a +inf / NaN logit, has no softmax weight.
    # Concrete arrays (the standard slopes of `ALiBi()` come as NumPy) are checked here;
    # traced ones, learned in a training step, are poisoned whole instead (`_poisoned`: a
    # run-time check would cost each call a wait on the host).
    slopes, table = terms.arrays
    if slopes is not None:
        slopes = jnp.asarray(_poisoned("slopes", slopes, lambda x: ~(abs(x) < np.inf),
                                       "must be finite; got inf or NaN."))
    if table is not None:
        table = _poisoned("table", table, lambda x: jnp.isnan(x) | (x == jnp.inf),
                          "must be finite or -inf (which hides the pairs of that bucket); "
                          "got +inf or NaN.")
    return dataclasses.replace(inputs, score=terms.with_arrays(slopes, table))
