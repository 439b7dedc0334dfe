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
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jaxtyping import Array, Float, Int

from ._score_alibi import PROBE, as_alibi, inner_jaxpr, probe_params
from ._signature import fits, read_signature
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
        if self.max_distance >= 2**31:
            # Distances are int32: a threshold past them would not convert when bucketing.
            raise ValueError(f"`max_distance` must be below 2**31 (distances are int32); got "
                             f"{self.max_distance}.")

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


def far_splits(full_count, full_index, partial_count, partial_index, transposed: bool,
               block_q: int, block_kv: int, relative: RelativeBuckets):
    """``[MB, MH, n, 4]`` int32: for each list row, its full list's and its partial list's
    ``(far before, not far after)`` counts, where a row is a tile of queries (a tile of keys
    where `transposed`) and its list's entries tiles of keys (of queries). The entries
    ``[0, far before)`` of a list are tiles whose every pair is far enough from the row's
    tokens, on the side of the lower entries, to share one bucket (`RelativeBuckets.far_buckets`);
    so are ``[not far after, count)``, on the other side; the entries between are near. Lists
    are sorted, so each far part is a run at one end. Computed with NumPy when the lists are
    known on the host, else on the device."""
    (ahead_gap, _), (behind_gap, _) = relative.far_buckets()
    if transposed:
        rows, entries, low_gap, high_gap = block_kv, block_q, behind_gap, ahead_gap
    else:
        rows, entries, low_gap, high_gap = block_q, block_kv, ahead_gap, behind_gap
    arrays = (full_count, full_index, partial_count, partial_index)
    xp = jnp if any(isinstance(a, jax.core.Tracer) for a in arrays) else np
    parts = []
    for count, index in ((full_count, full_index), (partial_count, partial_index)):
        count, index = xp.asarray(count, xp.int32), xp.asarray(index, xp.int32)
        first = xp.arange(count.shape[-1], dtype=xp.int32)[:, None] * rows
        valid = xp.arange(index.shape[-1], dtype=xp.int32) < count[..., None]
        # An entry is far before when its last token is `low_gap` or more before the row's
        # first, far after when its first token is `high_gap` or more after the row's last.
        before = valid & (index * entries + entries - 1 <= first - low_gap)
        after = valid & (index * entries >= first + rows - 1 + high_gap)
        parts += [before.sum(-1, dtype=xp.int32), count - after.sum(-1, dtype=xp.int32)]
    return xp.stack(parts, axis=-1)


# ------------------------------------------------------------------------------------------------
# The contract: what a kernel reads.


@dataclasses.dataclass(frozen=True, eq=False)
class ScoreTerm:
    """A user score function in the one form kernels call:
    ``term(s, batch, head, q_pos, k_pos, params) -> s``.

    It wraps `fn`, called as ``fn(s, head, q_pos, k_pos)``, with ``params`` as a fifth
    positional argument where `takes_params`, and ``batch=`` by keyword where `takes_batch`
    (the signature has a parameter named ``batch``, or ``**kwargs``). Equal (and hashed) by
    `fn` and the flags, so equal modules trace once. Build it with `ScoreTerm.of`.

    The result must have the logits' shape (a one-line `ValueError` names `fn` otherwise) and
    is cast to their dtype. That it is float and depends on ``s`` is checked once per call, where
    the plan attaches the terms (`check_function`), not per tile here.
    """

    fn: Callable
    takes_batch: bool = False
    takes_params: bool = False

    @classmethod
    def of(cls, fn: Callable, takes_params: bool = False, *,
           what: str = "ScoreFunction") -> "ScoreTerm":
        """The term calling `fn`, whose signature is read once here: a one-line `TypeError`
        names the expected signature when its positional parameters do not fit."""
        if isinstance(fn, ScoreTerm):
            return fn
        if not callable(fn):
            raise TypeError(f"`fn` must be callable; got {type(fn).__name__}.")
        want = "(score, head, q_pos, k_pos" + (", params" if takes_params else "") + ")"
        sig = read_signature(fn, ("batch",))
        if not fits(sig, 5 if takes_params else 4):
            raise TypeError(
                f"{what}'s `fn` must take {want} (and `batch=` by keyword if it wants it); got "
                f"{sig.text}; a FlexAttention score_mod (score, b, h, q_idx, kv_idx) goes "
                f"through scores.from_flex.")
        takes_batch = sig is not None and "batch" in sig.keywords
        return cls(fn, takes_batch, takes_params)

    @property
    def __name__(self) -> str:
        return _name(self.fn)

    def __eq__(self, other):
        if not isinstance(other, ScoreTerm):
            return NotImplemented
        if (self.takes_batch, self.takes_params) != (other.takes_batch, other.takes_params):
            return False
        if self.fn is other.fn:
            return True
        try:
            return bool(self.fn == other.fn)
        except Exception:  # noqa: BLE001  (an object whose == is not a bool)
            return False

    def __hash__(self):
        try:
            key = hash(self.fn)
        except TypeError:
            key = id(self.fn)
        return hash((ScoreTerm, key, self.takes_batch, self.takes_params))

    def __call__(self, s, batch, head, q_pos, k_pos, params):
        args = (s, head, q_pos, k_pos) + ((params,) if self.takes_params else ())
        out = self.fn(*args, **({"batch": batch} if self.takes_batch else {}))
        if jnp.shape(out) != jnp.shape(s):
            raise _shape_error(self.fn, jnp.shape(s), jnp.shape(out))
        return jnp.asarray(out, s.dtype)


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _shape_error(fn, want, got) -> ValueError:
    return ValueError(f"the score function {_name(fn)} must return the logits' shape "
                      f"{tuple(want)}; got {tuple(got)} (write e.g. `score + term`, not `term`).")


# ------------------------------------------------------------------------------------------------
# Checks of a user function, once per call on a small tile.


#: Primitives whose result is zero where their (first) operand is: a zero stays one through
#: them, so ``score * jnp.zeros_like(score)`` is seen as a zero.
_KEEPS_ZERO = frozenset({"broadcast_in_dim", "convert_element_type", "reshape", "squeeze",
                         "expand_dims", "transpose", "copy", "copy_p", "neg", "slice",
                         "reduce_precision"})
#: Primitives whose result is zero where any operand is.
_ZERO_IF_ANY = frozenset({"mul", "dot_general"})


def _reached(jaxpr, live, zero=frozenset()) -> tuple[list[bool], list[bool]]:
    """For each output of `jaxpr`, whether it depends on a variable of `live` (a set of its
    variables), and whether it is known to be zero (from a literal zero, or a variable of
    `zero`).

    Forward through the equations, into the jaxprs they call one for one; any other equation
    (a loop, a branch) counts each output as reached by any input it reads. A product with a
    known zero reaches nothing: ``score * 0 + term`` does not depend on ``score``."""
    live, zero = set(live), set(zero)

    def is_zero(v):
        if isinstance(v, jex_core.Literal):
            return bool(np.all(np.asarray(v.val) == 0))
        return v in zero

    for eqn in jaxpr.eqns:
        zeros = [is_zero(v) for v in eqn.invars]
        name = eqn.primitive.name
        inner = inner_jaxpr(eqn)
        if inner is not None:
            hit = [isinstance(v, jex_core.Var) and v in live for v in eqn.invars]
            outs, out_zeros = _reached(
                inner, {v for v, h in zip(inner.invars, hit) if h},
                {v for v, z in zip(inner.invars, zeros) if z})
            live.update(v for v, d in zip(eqn.outvars, outs) if d)
            zero.update(v for v, z in zip(eqn.outvars, out_zeros) if z)
            continue
        if (name in _ZERO_IF_ANY and any(zeros)) or (name in _KEEPS_ZERO and zeros[0]):
            zero.update(eqn.outvars)
            continue
        if any(isinstance(v, jex_core.Var) and v in live for v in eqn.invars):
            live.update(eqn.outvars)
    outs = [isinstance(v, jex_core.Var) and v in live for v in jaxpr.outvars]
    return outs, [is_zero(v) for v in jaxpr.outvars]


def check_function(terms: "ScoreTerms", num_heads: int) -> None:
    """Refuse, in one line naming it, a score function whose result does not have the
    logits' shape or does not depend on ``score`` (`ValueError`: its result would replace the
    logits), or is not float (`TypeError`).

    Once per call: the function is traced on an 8 x 8 float32 tile of heads ``0`` and
    ``num_heads - 1`` with `params` of the call's shapes (no FLOPs; the same for traced
    `params`; cached per function, head count and `params` shapes) and its jaxpr walked from
    ``score`` to the result (`_reached`: ``score * 0 + term`` counts as not depending on it).
    A function that does not trace on the tile is left to the kernel's own call.
    """
    term = terms.function
    if term is None:
        return
    error = _probe(term, num_heads, *probe_params(terms.params))
    if error is not None:
        raise error[0](error[1])


@functools.lru_cache(maxsize=256)
def _probe(term: ScoreTerm, num_heads: int, treedef, avals: tuple):
    """``(type, message)`` of `check_function`'s error, or ``None``: read from the function's
    jaxpr on the probe tile."""
    n = PROBE
    head = np.asarray([0, num_heads - 1], np.int32)[:, None, None]
    q_pos = np.arange(n, dtype=np.int32)[:, None]
    k_pos = np.arange(n, dtype=np.int32)[None, :]

    def run(s, params):  # the function's own result (`ScoreTerm` casts it to the logits')
        args = (s, jnp.asarray(head), jnp.asarray(q_pos), jnp.asarray(k_pos))
        args += (params,) if term.takes_params else ()
        batch = {"batch": jnp.zeros((), jnp.int32)} if term.takes_batch else {}
        return term.fn(*args, **batch)

    tile = jax.ShapeDtypeStruct((2, n, n), _F32)
    try:
        closed = jax.make_jaxpr(run)(tile, jax.tree.unflatten(treedef, avals))
    except Exception:  # noqa: BLE001  (the kernel's own call raises it, or the tile was odd)
        return None
    if len(closed.out_avals) != 1:
        return None  # not one array: `ScoreTerm.__call__` names the shape it wants
    out = closed.out_avals[0]
    name = _name(term.fn)
    if out.shape != tile.shape:
        return ValueError, str(_shape_error(term.fn, tile.shape, out.shape))
    if not jnp.issubdtype(out.dtype, jnp.floating):
        return TypeError, (f"the score function {name} returns {jnp.dtype(out.dtype).name}, "
                           f"not float logits: return `score + term` with a float term.")
    jaxpr = closed.jaxpr
    # Constants the function closes over that are all zero count as zeros.
    zero = {v for v, c in zip(jaxpr.constvars, closed.consts)
            if not isinstance(c, jax.core.Tracer) and np.size(c) and not np.any(np.asarray(c))}
    if not _reached(jaxpr, {jaxpr.invars[0]}, zero)[0][0]:
        return ValueError, (f"the score function {name} ignores `score` (its result would "
                            f"replace the logits): return `score + term`.")
    return None


class ScoreTerms(eqx.Module):
    """The score terms of a call, as every kernel reads them (`AttentionInputs.score`).

    Each part is off when ``None``; the parts that are on apply in this order:

    - `slopes` ``[H]`` float: ALiBi, ``s += slopes[h] * (k_pos - q_pos)``.
    - `table` ``[H, num_buckets]`` float with `buckets` (`RelativeBuckets`): relative
      position bias, ``s += table[h, buckets.bucket(q_pos - k_pos)]``.
    - `function` (static, a `ScoreTerm`): ``s = function(s, batch, head, q_pos, k_pos,
      params)``, a jnp function; `params` is a pytree of arrays (or ``None``) it reads.

    `slopes`, `table` and `params` are differentiable inputs of the kernel (their gradients
    are the sums of ``dS`` times the term's derivative over every visible pair). `kinds`
    names the parts that are on, for `decline_reason` and the selector. A plain callable
    ``fn(s, head, q_pos, k_pos)`` (``fn(..., params)`` with `params`) given as `function` is
    wrapped into a `ScoreTerm`; a `ScoreTerm` is kept as it is.

    ```python
    terms.apply(s, head, q_pos, k_pos, batch=b)   # s [..., bq, bk]; the rest broadcastable
    ```
    """

    slopes: Float[Array, " h"] | None = None
    table: Float[Array, "h buckets"] | None = None
    buckets: RelativeBuckets | None = eqx.field(default=None, static=True)
    function: ScoreTerm | None = eqx.field(default=None, static=True)
    params: Any = None
    #: The name of the score function `slopes` were read from (`as_alibi`), or ``None``.
    alibi_from: str | None = eqx.field(default=None, static=True)

    #: The names `kinds` gives each part.
    KINDS: ClassVar[tuple[str, ...]] = ("alibi", "relative_bias", "function")

    def __init__(self, slopes=None, table=None, buckets=None, function=None, params=None, *,
                 alibi_from: str | None = None):
        self.slopes = slopes
        self.table = table
        self.buckets = buckets
        if function is not None:
            function = ScoreTerm.of(function, params is not None, what="ScoreTerms")
        self.function = function
        self.params = params
        self.alibi_from = alibi_from

    @property
    def kinds(self) -> tuple[str, ...]:
        """The parts that are on: a subset of ``("alibi", "relative_bias", "function")``."""
        on = (self.slopes is not None, self.table is not None, self.function is not None)
        return tuple(name for name, flag in zip(self.KINDS, on) if flag)

    @property
    def function_terms(self) -> tuple[ScoreTerm, ...]:
        """The user functions, in the order they apply (``()`` or one `ScoreTerm`)."""
        return () if self.function is None else (self.function,)

    @property
    def takes_batch(self) -> bool:
        """Whether a function reads the batch index (`apply` then needs ``batch=``)."""
        return any(t.takes_batch for t in self.function_terms)

    @property
    def arrays(self) -> tuple:
        """``(slopes, table)``: the per-head differentiable parts (``None`` where off);
        `params`, the function's, is a field of its own."""
        return self.slopes, self.table

    def with_arrays(self, slopes, table, params=...) -> "ScoreTerms":
        """These terms with `slopes` and `table` (and `params`, where given) replaced."""
        params = self.params if params is ... else params
        return ScoreTerms(slopes, table, self.buckets, self.function, params,
                          alibi_from=self.alibi_from)

    def rows(self, heads: Int[Array, "..."]) -> "ScoreTerms":
        """These terms with each array's head axis gathered at `heads` (``slopes[heads]``,
        ``table[heads]``); `apply` then takes ``row`` indices into that axis. `params` stay
        whole: the function reads them by the `head` it is given."""
        return self.with_arrays(None if self.slopes is None else self.slopes[heads],
                                None if self.table is None else self.table[heads])

    def apply(self, s: Float[Array, "..."], head, q_pos, k_pos, *, row=None, batch=None):
        """The logits `s` with the terms added (float32 where `s` is).

        `head` (query-head ids), `q_pos` and `k_pos` (int32 positions) broadcast against `s`;
        `row` (default `head`) indexes the arrays' first axis, for terms gathered by `rows`.
        `batch` is the batch index, an int32 scalar or an array broadcastable against `s`: a
        kernel must pass it when `takes_batch` (a `ValueError` otherwise).
        """
        row = head if row is None else row
        if self.slopes is not None:
            distance = (jnp.asarray(k_pos) - jnp.asarray(q_pos)).astype(_F32)
            s = s + self.slopes.astype(_F32)[row] * distance
        if self.table is not None:
            bucket = self.buckets.bucket(jnp.asarray(q_pos) - jnp.asarray(k_pos))
            s = s + self.table.astype(_F32)[row, bucket]
        if self.function is not None:
            if batch is None and self.function.takes_batch:
                raise ValueError(f"the score function {self.function.__name__} reads the "
                                 f"batch index: `apply` needs `batch=` (an int32 array).")
            s = self.function(s, batch, head, q_pos, k_pos, self.params)
        return s


def describe_score(terms: ScoreTerms | None) -> str:
    """One line naming the score terms, for `CallPlan.explain`."""
    if terms is None:
        return "none"
    parts = []
    if terms.slopes is not None:
        source = "" if terms.alibi_from is None else f", from the function {terms.alibi_from}"
        parts.append(f"alibi (slopes [{terms.slopes.shape[0]}]{source})")
    if terms.table is not None:
        b = terms.buckets
        parts.append(f"relative_bias ({b.num_buckets} buckets, bidirectional={b.bidirectional}, "
                     f"max_distance={b.max_distance})")
    for term in terms.function_terms:
        params = ""
        if term.takes_params:
            params = f", params {len(jax.tree.leaves(terms.params))} arrays"
        parts.append(f"function {term.__name__}{params}")
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


def _array_kinds(annotation) -> tuple[tuple, bool]:
    """The jaxtyping array types a field's `annotation` names (``Float[Array, "h"]``, also in
    ``X | None``), and whether it allows ``None``."""
    arms = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (
        annotation,)
    kinds = tuple(a for a in arms if hasattr(a, "dtypes") and hasattr(a, "dim_str"))
    return kinds, type(None) in arms


def check_score_arrays(score: AbstractScore) -> None:
    """A one-line `TypeError` naming the field where a score's array field, annotated with a
    jaxtyping dtype (``slopes: Float[Array, " h"]``), holds something else: what its
    `__init__` checked, again at each call (`eqx.tree_at` swaps a field in without it)."""
    for field in dataclasses.fields(score):
        if field.metadata.get("static", False):
            continue
        kinds, optional = _array_kinds(field.type)
        value = getattr(score, field.name)
        if not kinds or (value is None and optional):
            continue
        dtype = getattr(value, "dtype", None)
        if dtype is not None and any(jnp.dtype(dtype).name in k.dtypes for k in kinds):
            continue
        kind = kinds[0]
        wanted = ("a float" if all("float" in d for d in kind.dtypes)
                  else "an integer" if all("int" in d for d in kind.dtypes) else "an")
        got = (f"dtype {jnp.dtype(dtype).name}" if dtype is not None
               else type(value).__name__)
        raise TypeError(
            f"`{field.name}` of {type(score).__name__} must be {wanted} array "
            f"[{kind.dim_str}]; got {got} (swapped in with eqx.tree_at?).")


def compile_score(score: AbstractScore | None, num_heads: int) -> ScoreTerms | None:
    """The `ScoreTerms` of a module's `score` for a call with `num_heads` query heads."""
    check_score(score)
    if score is None:
        return None
    check_score_arrays(score)
    return score.compile(num_heads)


def attach_score(score: AbstractScore | None, inputs, num_heads: int, sharding, *,
                 batched: bool = True):
    """`inputs` (`AttentionInputs`) with the compiled `score` terms, or unchanged without.

    `batched` says whether the call's query is ``[B, H, L, D]``; an unbatched call (``[H, L,
    D]``, also each example under `jax.vmap`) is refused when a term reads the batch index.
    A score function is checked here, once per call (`check_function`); one proven to be
    ALiBi runs as ALiBi's slopes (`as_alibi`).
    """
    terms = compile_score(score, num_heads)
    if terms is None:
        return inputs
    if not sharding.passes_score:
        # Unsharded, ShardMap and RingAttention pass them; a sharding of one's own may not.
        raise ValueError(
            f"`score` terms need a sharding that passes them to each shard's call "
            f"(passes_score); this module's sharding {type(sharding).__name__} does not. "
            f"Drop the sharding or the score.")
    if not batched and terms.takes_batch:
        # Under jax.vmap each example is an unbatched call, batched again as a batch of one:
        # every example would read batch index 0.
        raise ValueError(
            f"the score function {terms.function.__name__} reads the batch index, which an "
            f"unbatched call ([H, L, D]) does not have (under jax.vmap every example would see "
            f"0): pass batched inputs [B, H, L, D], or index the per-example data outside the "
            f"call (as `params`) and let vmap map it.")
    check_function(terms, num_heads)
    terms = as_alibi(terms, num_heads)
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
