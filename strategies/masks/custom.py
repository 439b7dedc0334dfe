"""Masks from user code: any predicate of positions, and a different mask per head."""

import dataclasses
import functools
import operator
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
import numpy as np

from eqx_bsattn.contract import (
    AbstractBlockMask,
    AbstractMask,
    check_flex,
    classify,
    fits,
    params_tree,
    read_signature,
)


#: How often calls may bring a Predicate a new function of one definition before it is said
#: that each one traces and compiles the call again (`_note_new_function`).
NEW_FUNCTIONS_BEFORE_WARNING = 3
#: Per function definition (code object): [the last function's id, new functions seen, warned].
_NEW_FUNCTIONS: dict = {}


def _note_new_function(fn) -> None:
    """Count the calls whose Predicate holds a new function of a definition already seen (a
    lambda or a nested function made afresh each step): a new function is a new static
    mask, so `jax.jit` traces and compiles the call again. Warn once per definition."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    seen = _NEW_FUNCTIONS.setdefault(code, [id(fn), 0, False])
    if seen[0] == id(fn):
        return
    seen[0] = id(fn)
    seen[1] += 1
    if seen[1] >= NEW_FUNCTIONS_BEFORE_WARNING and not seen[2]:
        seen[2] = True
        warnings.warn(
            f"masks.Predicate has had a new function `{code.co_name}` "
            f"({code.co_filename}:{code.co_firstlineno}) in {seen[1] + 1} calls: each new "
            f"function is a new mask, so each call traces and compiles again; define the "
            f"function once and reuse it (values that change go in its `params`).",
            stacklevel=2)


class Predicate(AbstractMask):
    """Any JAX function of query and key positions: ``fn(q_pos, k_pos) -> bool array``, or
    ``fn(q_pos, k_pos, params)`` with per-call or learned data `params`.

    **Arguments:**

    - `fn`: receives broadcastable int32 arrays (queries ``[..., n, 1]``, keys ``[..., 1, m]``)
      and returns their broadcast boolean (size-1 axes may stay: ``[..., 1, m]`` for a
      predicate of the keys alone; a scalar only where it reads no position; another shape is
      refused in one line). A parameter named ``head`` receives the query head (an int32
      scalar, maybe traced) by keyword: the mask then varies by head.
    - `params`: a pytree of arrays passed as the third argument (default ``None``: `fn` takes
      two). They are leaves of the mask, so a new value (traced under `jit`, swapped in with
      `eqx.tree_at`) never recompiles; the layouts are then built on the device, as for
      per-call positions. A module holding them is compiled with `eqx.filter_jit`
      (`jax.jit(attn)` cannot hash it, and says so).

    The signature is read once, here: other positional parameters raise a one-line `TypeError`
    (a FlexAttention ``mask_mod`` ``(b, h, q_idx, kv_idx)`` goes through `masks.from_flex`).
    Masks see no batch index: per-sequence data is segment ids (`Document`) or positions.
    It has no `blocks`, so layouts evaluate `fn` one q-block at a time (once per trace when
    nothing is per call); where they are built as the call runs (`params`, per-call positions)
    its blocks are first classified from their ranges of positions, `fn` evaluated on
    intervals (`range_classes`: comparisons, ``+ - *``, min, max, abs, boolean logic, selects,
    division and remainder by values that read no position; a few operations per block pair,
    exact for a window, conservative otherwise), and pair by pair where an operation has no
    rule. It has no `terms`: `MosaicBlockSparse` and `PallasTpuBlockSparse` trace `fn` into
    their kernels on the partial blocks (per-call positions and segment ids included; `PallasTpuBlockSparse` also where `fn` reads its `params` at scalar indices, e.g.
    ``widths[head]``; otherwise, with `params`, they read a per-call element map), Triton and Splash
    read element bitmaps (static masks only). Define `fn` once, not as a fresh lambda per call:
    it is part of the module's static identity; data it closes over is a constant (a traced
    array there is refused: pass it as `params`).

    ```python
    def every_other(q, k):
        return (k <= q) & (k % 2 == 0)

    def window_per_head(q, k, widths, head):   # widths [H], per call
        return (k <= q) & (q - k < widths[head])

    masks.Predicate(every_other)
    masks.Predicate(window_per_head, jnp.array([4, 8, 16, 32]))
    ```
    """

    fn: Callable = eqx.field(static=True)
    params: Any = None
    takes_head: bool = eqx.field(default=False, static=True)
    #: The kind of each leaf of `params` as given (``"bool"``, ``"integer"``, ``"float"``,
    #: ``"complex"``): a call refuses leaves swapped in (`eqx.tree_at`) of another kind.
    param_kinds: tuple[str, ...] = eqx.field(default=(), static=True)

    reads_segment_ids: ClassVar[bool] = False

    def __init__(self, fn: Callable, params: Any = None):
        if not callable(fn):
            raise TypeError(f"Predicate needs a callable; got {type(fn).__name__}.")
        sig = read_signature(fn, ("head", "batch"))
        want = "(q_pos, k_pos" + (", params" if params is not None else "") + ")"
        if sig is not None and "batch" in sig.named:
            raise TypeError(f"Predicate's `fn` takes `batch`, which masks do not receive; got "
                            f"{sig.text}: per-sequence data goes in segment ids "
                            f"(masks.Document) or positions.")
        if not fits(sig, 3 if params is not None else 2):
            raise TypeError(f"Predicate's `fn` must take {want} (and `head=` by keyword if it "
                            f"wants it); got {sig.text}; a FlexAttention mask_mod (b, h, q_idx, "
                            f"kv_idx) goes through masks.from_flex.")
        self.fn = fn
        self.params = None if params is None else params_tree(params)
        self.takes_head = sig is not None and "head" in sig.keywords
        self.param_kinds = tuple(_dtype_kind(x.dtype) for x in jax.tree.leaves(self.params))

    def check(self, q_len, kv_len, num_heads):
        """At each call: the params keep the kinds of dtypes they were given, and `fn`
        closes over no traced value (either is refused in one line)."""
        leaves = jax.tree_util.tree_leaves_with_path(self.params)
        if len(leaves) == len(self.param_kinds):
            for (path, x), kind in zip(leaves, self.param_kinds):
                dtype = getattr(x, "dtype", None)
                if dtype is None and isinstance(x, (bool, int, float, complex)):
                    dtype = jnp.result_type(x)  # a Python number, as `elements` reads it
                if _dtype_kind(dtype) != kind:
                    what = (f"dtype {jnp.dtype(x.dtype).name}" if hasattr(x, "dtype")
                            else type(x).__name__)
                    raise TypeError(
                        f"`params`{jax.tree_util.keystr(path)} of the Predicate "
                        f"{_name(self.fn)} must be {'an' if kind[0] in 'aeiou' else 'a'} "
                        f"{kind} array, as it was given; got "
                        f"{what} (swapped in with eqx.tree_at?): swap in {kind} arrays.")
        _note_new_function(self.fn)
        if _closes_over_traced(self.fn, self.takes_head, self.params):
            raise TypeError(
                f"the mask's function closes over a traced array (the Predicate "
                f"{_name(self.fn)} reads an argument of a function under jit, vmap or grad): "
                f"pass the array as `params`, masks.Predicate(fn, params) with "
                f"fn(q_pos, k_pos, params).")

    def __hash__(self):
        # `jax.jit(attn)` hashes the module it is given; an array has no hash. Its static part
        # (the params partitioned out, as `eqx.filter_jit` and the kernels' caches see it) does.
        if any(isinstance(x, jax.Array | np.ndarray) for x in jax.tree.leaves(self.params)):
            raise TypeError(
                "a module holding a Predicate with `params` cannot be hashed, so `jax.jit(attn)` "
                "cannot take it: use `eqx.filter_jit(attn)`, or `eqx.filter_jit` of a function "
                "that takes the module as an argument."
            )
        return super().__hash__()

    @property
    def varies_by_head(self) -> bool:
        return self.takes_head

    def range_classes(self, q, k, head):
        """Block classes from the blocks' ranges of positions, or ``None``
        (`predicate_block_classes`): `build_layout` classifies a Predicate's blocks so when
        its layouts are built as the call runs, instead of evaluating every pair."""
        return predicate_block_classes(self, q, k, head)

    def elements(self, q, k, head):
        # A sharding hands replicated params to its devices as NumPy constants; `fn` may index
        # them by a traced head (``widths[head]``), which only a JAX array allows.
        params = () if self.params is None else (jax.tree.map(jnp.asarray, self.params),)
        args = (q.position, k.position) + params
        kwargs = {"head": jnp.asarray(head, jnp.int32)} if self.takes_head else {}
        out = jnp.asarray(self.fn(*args, **kwargs))
        if out.dtype != jnp.bool_:
            raise TypeError(f"Predicate function must return booleans; got dtype {out.dtype}.")
        shape = jnp.broadcast_shapes(q.position.shape, k.position.shape)
        reads_positions = functools.partial(_reads_positions, self.fn, self.takes_head, args[2:])
        if out.shape != shape and not _broadcasts(out.shape, shape, reads_positions):
            raise ValueError(
                f"the Predicate function {_name(self.fn)} must return the broadcast shape of "
                f"its positions, {shape}; got {out.shape} (a reduction or an index over them?): "
                f"keep one entry per (query, key) pair.")
        return jnp.broadcast_to(out, shape)


def _dtype_kind(dtype) -> str:
    """``"bool"``, ``"integer"``, ``"float"``, ``"complex"`` (or ``"other"``) for `dtype`."""
    if dtype is None:
        return "other"
    for kind, of in (("bool", jnp.bool_), ("integer", jnp.integer), ("float", jnp.floating),
                     ("complex", jnp.complexfloating)):
        if jnp.issubdtype(dtype, of):
            return kind
    return "other"


def _closes_over_traced(fn: Callable, takes_head: bool, params) -> bool:
    """Whether `fn` reads a traced value it closes over (an argument of an enclosing `jit`,
    `vmap` or `grad`), from its jaxpr on a 2 x 2 tile: such a value is one of the jaxpr's
    constants. Where `fn` does not trace there, ``False`` (the call says what fails)."""
    abstract = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))  # noqa: E731
    extra = () if params is None else (jax.tree.map(abstract, params),)
    head = (jax.ShapeDtypeStruct((), jnp.int32),) if takes_head else ()

    def call(q, k, extra, head):
        return fn(q, k, *extra, **({"head": head[0]} if head else {}))

    try:
        closed = jax.make_jaxpr(call)(jax.ShapeDtypeStruct((2, 1), jnp.int32),
                                      jax.ShapeDtypeStruct((1, 2), jnp.int32), extra, head)
    except Exception:  # noqa: BLE001
        return False
    return any(isinstance(c, jax.core.Tracer) for c in closed.consts)


def _reads_positions(fn: Callable, takes_head: bool, params: tuple) -> bool:
    """Whether predicate `fn` reads `q_pos` or `k_pos` (from its jaxpr on a 2 x 2 tile: an
    argument that reaches no equation is not read; one that does not trace counts as read).
    Cached per function and `params` shapes: layouts call it once per q-block."""
    leaves, treedef = jax.tree.flatten(params)
    avals = tuple(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves)
    try:
        return _reads_positions_cached(fn, takes_head, treedef, avals)
    except TypeError:  # an unhashable callable
        return _reads_positions_cached.__wrapped__(fn, takes_head, treedef, avals)


@functools.lru_cache(maxsize=256)
def _reads_positions_cached(fn, takes_head, treedef, avals) -> bool:
    kwargs = {"head": jnp.zeros((), jnp.int32)} if takes_head else {}
    params = jax.tree.unflatten(treedef, avals)
    try:
        jaxpr = jax.make_jaxpr(lambda q, k, p: fn(q, k, *p, **kwargs))(
            jax.ShapeDtypeStruct((2, 1), jnp.int32), jax.ShapeDtypeStruct((1, 2), jnp.int32),
            params).jaxpr
    except Exception:  # noqa: BLE001
        return True
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return any(id(v) in used for v in jaxpr.invars[:2])


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _broadcasts(got: tuple, shape: tuple, reads_positions) -> bool:
    """Whether a predicate's result of shape `got` stands for every pair of `shape`: one axis
    per axis of the positions, each of their size or 1 (a predicate of the keys alone is
    ``[..., 1, m]``), or a scalar where the predicate reads no position (of the head or
    params alone). Another rank would be broadcast against the wrong axes, and a scalar
    computed from positions reduced them. `reads_positions` is called only for a scalar."""
    if len(got) == len(shape):
        return all(g in (1, s) for g, s in zip(got, shape))
    return len(got) == 0 and not reads_positions()


@dataclasses.dataclass(frozen=True)
class _FlexMask:
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx[, params])`` that reads neither `b` nor
    `h`, as a `Predicate` function (`from_flex` has checked it: both are given as 0)."""

    mask_mod: Callable

    def __call__(self, q_pos, k_pos, *params):
        zero = jnp.zeros((), jnp.int32)
        return self.mask_mod(zero, zero, q_pos, k_pos, *params)


@dataclasses.dataclass(frozen=True)
class _FlexHeadMask(_FlexMask):
    """`_FlexMask` for a `mask_mod` that reads `h`: the mask varies by head."""

    def __call__(self, q_pos, k_pos, *params, head):
        return self.mask_mod(jnp.zeros((), jnp.int32), head, q_pos, k_pos, *params)


def _distinct(mask: AbstractMask) -> object:
    """A key under which equal masks meet: the mask where it can be hashed (no arrays),
    else its identity."""
    try:
        hash(mask)
    except TypeError:
        return ("identity", id(mask))
    return mask


def from_flex(mask_mod: Callable, params: Any = None) -> Predicate:
    """A `Predicate` from a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` (or
    ``mask_mod(b, h, q_idx, kv_idx, params)`` with `params`).

    `q_idx` and `kv_idx` are the call's positions (the token indices when none are passed),
    `h` the query head. Masks see no batch index: a `mask_mod` that reads `b` (a per-sequence
    document table, say) raises a one-line `TypeError`; pass such data as segment ids with
    `masks.Document`. Where a built-in mask says the same (causal, sliding window, prefix LM,
    documents), prefer it: it classifies blocks without evaluating every pair and runs
    inside every kernel (docs/flex.md).

    ```python
    def sliding_window_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 256)

    mask = masks.from_flex(sliding_window_causal)
    ```
    """
    check_flex(mask_mod, "mask_mod", "b, h, q_idx, kv_idx", params)
    zero = jnp.zeros((), jnp.int32)
    if _reads_argument(mask_mod, params, lambda b: (b, zero)):
        raise TypeError(f"`mask_mod` {getattr(mask_mod, '__name__', '')} reads the batch index "
                        f"`b`, which masks do not receive: pass per-sequence data as segment "
                        f"ids (masks.Document) or positions.")
    by_head = _reads_argument(mask_mod, params, lambda h: (zero, h))
    return Predicate((_FlexHeadMask if by_head else _FlexMask)(mask_mod), params)


def _reads_argument(fn: Callable, params, lead) -> bool:
    """Whether `fn(*lead(x), q_idx, kv_idx[, params])` depends on the int32 scalar ``x`` (read
    from its jaxpr on a 2 x 2 tile: an argument that reaches no equation is not read)."""
    idx = jnp.arange(2, dtype=jnp.int32)
    extra = () if params is None else (params_tree(params),)
    jaxpr = jax.make_jaxpr(lambda x: fn(*lead(x), idx[:, None], idx[None, :], *extra))(
        jnp.zeros((), jnp.int32)).jaxpr
    var = jaxpr.invars[0]
    used = any(var is v for eqn in jaxpr.eqns for v in eqn.invars)
    return used or any(var is v for v in jaxpr.outvars)


class PerHead(AbstractBlockMask):
    """A different mask for each query head: head ``h`` uses ``masks[h]``.

    ```python
    masks.PerHead([masks.Causal()] * 4 + [masks.Causal() & masks.SlidingWindow(128)] * 4)
    ```
    """

    masks: tuple[AbstractMask, ...]

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = True

    def __init__(self, masks):
        masks = tuple(masks)
        if not masks:
            raise ValueError("PerHead needs at least one mask.")
        for m in masks:
            if not isinstance(m, AbstractMask):
                raise TypeError(f"PerHead takes masks; got {type(m).__name__}.")
        self.masks = masks

    def children(self):
        return self.masks

    def hides_padding_keys(self):
        return all(m.hides_padding_keys() for m in self.masks)

    def check(self, q_len, kv_len, num_heads):
        if len(self.masks) != num_heads:
            raise ValueError(
                f"PerHead has {len(self.masks)} masks but the query has {num_heads} heads."
            )
        for m in self.masks:
            m.check(q_len, kv_len, num_heads)

    def resolve(self, q_len, kv_len):
        return PerHead([m.resolve(q_len, kv_len) for m in self.masks])

    def _pick(self, method: str, head, *args):
        if isinstance(head, int):
            return getattr(self.masks[head], method)(*args, head)
        branches = [lambda *a, m=m: getattr(m, method)(*a, head) for m in self.masks]
        return jax.lax.switch(jnp.clip(head, 0, len(self.masks) - 1), branches, *args)

    def elements(self, q, k, head):
        if isinstance(head, int):
            return self.masks[head].elements(q, k, head)
        # A traced head: each distinct mask once (equal masks, or the same one where a mask
        # holds arrays and cannot be hashed), the head's value chosen by `where`s rather than
        # a `switch`, which not every kernel language lowers on tiles.
        head = jnp.clip(head, 0, len(self.masks) - 1)
        groups: dict[object, tuple[AbstractMask, list[int]]] = {}
        for h, m in enumerate(self.masks):
            groups.setdefault(_distinct(m), (m, []))[1].append(h)
        out = None
        for m, heads in groups.values():
            value = m.elements(q, k, head)
            if out is None:
                out = value
            else:
                hit = functools.reduce(operator.or_, [head == h for h in heads])
                # Logical ops, not `where`: Mosaic TPU selects no boolean vectors.
                out = (hit & value) | (~hit & out)
        return out

    def blocks(self, q, k, head):
        return self._pick("blocks", head, q, k)

    def terms(self, head):
        return self.masks[head].terms(head)


# --- Block classes of a `Predicate` from its positions' ranges -------------------------------
#
# Where a Predicate's layouts are built when the call runs (it holds `params`), evaluating it on
# every (query, key) pair costs heads x Lq x Lk operations per call: more than the attention
# itself at long lengths. Evaluated on intervals instead (each block's range of positions), its
# classes cost heads x nq x nk. Each value is a pair ``(lo, hi)`` bounding it over the block pair
# (booleans: ``(surely, maybe)``); values that depend on no position (the params, the head)
# are exact and run as they are. Every rule is conservative, so a block is called EMPTY only
# where the predicate is false on every pair of its ranges and FULL only where it is true on
# every one; an operation without a rule on a ranged value declines (`None`), and the layout
# evaluates the pairs as before.


class _NoRule(Exception):
    """An operation on a ranged value that `_range_eval` has no rule for."""


def _exact(x) -> bool:
    return not isinstance(x, tuple)


def _pair(x):
    return (x, x) if _exact(x) else x


def _bind(eqn, *args):
    out = eqn.primitive.bind(*args, **eqn.params)
    return out if eqn.primitive.multiple_results else [out]


def _compare(name, a, b):
    """``(surely, maybe)`` of ``a <op> b`` for ranges ``a``, ``b``."""
    (alo, ahi), (blo, bhi) = a, b
    if name in ("gt", "ge"):
        name, (alo, ahi), (blo, bhi) = {"gt": "lt", "ge": "le"}[name], (blo, bhi), (alo, ahi)
    if name == "lt":
        return ahi < blo, alo < bhi
    if name == "le":
        return ahi <= blo, alo <= bhi
    surely = (alo == ahi) & (blo == bhi) & (alo == blo)
    maybe = (alo <= bhi) & (blo <= ahi)
    return (surely, maybe) if name == "eq" else (~maybe, ~surely)


def _wraps(fn, *args):
    """Where integer `fn(*args)` leaves int32 (it would wrap), computed in float32 (exact
    to 2^-24, so values within that of the bounds count as leaving: conservative)."""
    out = fn(*(x.astype(jnp.float32) for x in args))
    return (out <= -(2.0 ** 31)) | (out >= 2.0 ** 31)


def _widen(lo, hi, wraps):
    """``(lo, hi)``, the whole int32 range where an operation would wrap."""
    info = jnp.iinfo(jnp.int32)
    return jnp.where(wraps, info.min, lo), jnp.where(wraps, info.max, hi)


def _no_wrap(fn, lo_args, hi_args):
    """``(fn(*lo_args), fn(*hi_args))`` of a monotone `fn`, widened where integers wrap."""
    lo, hi = fn(*lo_args), fn(*hi_args)
    if not jnp.issubdtype(lo.dtype, jnp.integer):
        return lo, hi
    return _widen(lo, hi, _wraps(fn, *lo_args) | _wraps(fn, *hi_args))


def _no_wrap_product(a, b):
    """The range of ``x * y`` over ranges `a`, `b`: the extremes of the corners' products,
    widened where integers wrap."""
    pairs = [(x, y) for x in a for y in b]
    products = [x * y for x, y in pairs]
    lo, hi = functools.reduce(jnp.minimum, products), functools.reduce(jnp.maximum, products)
    if not jnp.issubdtype(lo.dtype, jnp.integer):
        return lo, hi
    return _widen(lo, hi, functools.reduce(
        operator.or_, [_wraps(lambda x, y: x * y, x, y) for x, y in pairs]))


def _rule(eqn, args):
    """The outputs (ranges, or exact values) of one equation with a ranged input."""
    name = eqn.primitive.name
    if name in ("pjit", "jit", "closed_call", "core_call"):
        closed = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
        jaxpr = getattr(closed, "jaxpr", closed)
        return _range_eval(jaxpr, getattr(closed, "consts", ()), args)
    if name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "copy",
                "copy_p", "convert_element_type"):
        (x,) = args
        lo, hi = _pair(x)
        if name == "convert_element_type":
            old, new = jnp.dtype(lo.dtype), jnp.dtype(eqn.params["new_dtype"])
            # Monotone conversions only: a narrowing integer cast wraps.
            widening = (old == jnp.bool_ or jnp.issubdtype(new, jnp.floating)
                        or (jnp.issubdtype(new, jnp.integer) and jnp.issubdtype(old, jnp.integer)
                            and jnp.iinfo(new).bits >= jnp.iinfo(old).bits
                            and jnp.issubdtype(new, jnp.signedinteger)
                            == jnp.issubdtype(old, jnp.signedinteger)))
            if not widening or new == jnp.bool_:
                raise _NoRule(name)
        return [(_bind(eqn, lo)[0], _bind(eqn, hi)[0])]
    a = [_pair(x) for x in args]
    dtype = jnp.dtype(a[0][0].dtype)
    boolean = dtype == jnp.bool_
    if name == "add":
        return [_no_wrap(lambda x, y: x + y, (a[0][0], a[1][0]), (a[0][1], a[1][1]))]
    if name == "sub":
        return [_no_wrap(lambda x, y: x - y, (a[0][0], a[1][1]), (a[0][1], a[1][0]))]
    if name == "neg":
        return [_no_wrap(lambda x: -x, (a[0][1],), (a[0][0],))]
    if name == "mul" and not boolean:
        return [_no_wrap_product(a[0], a[1])]
    if name in ("max", "min"):
        op = jnp.maximum if name == "max" else jnp.minimum
        return [(op(a[0][0], a[1][0]), op(a[0][1], a[1][1]))]
    if name == "abs":
        lo, hi = a[0]
        return [(jnp.where(lo >= 0, lo, jnp.where(hi <= 0, -hi, 0)),
                 jnp.maximum(jnp.abs(lo), jnp.abs(hi)))]
    if name in ("lt", "le", "gt", "ge", "eq", "ne"):
        as_int = lambda r: tuple(x.astype(jnp.int32) for x in r) if boolean else r  # noqa: E731
        return [_compare(name, as_int(a[0]), as_int(a[1]))]
    if name == "sign":
        return [(jnp.sign(a[0][0]), jnp.sign(a[0][1]))]
    if boolean and name in ("and", "or"):
        op = operator.and_ if name == "and" else operator.or_
        return [(op(a[0][0], a[1][0]), op(a[0][1], a[1][1]))]
    if boolean and name == "not":
        return [(~a[0][1], ~a[0][0])]
    if name == "select_n" and len(a) == 3 and jnp.dtype(a[0][0].dtype) == jnp.bool_:
        (surely, maybe), (lo0, hi0), (lo1, hi1) = a
        pick = lambda v0, v1, both: jnp.where(  # noqa: E731
            surely, v1, jnp.where(maybe, both, v0))
        if jnp.dtype(lo0.dtype) == jnp.bool_:
            return [(pick(lo0, lo1, lo0 & lo1), pick(hi0, hi1, hi0 | hi1))]
        return [(pick(lo0, lo1, jnp.minimum(lo0, lo1)), pick(hi0, hi1, jnp.maximum(hi0, hi1)))]
    if name == "div" and _exact(args[1]) and jnp.issubdtype(dtype, jnp.integer):
        # Truncating division by an exact divisor is monotone, increasing for a positive one.
        (lo, hi), d = a[0], args[1]
        x, y = jax.lax.div(lo, d), jax.lax.div(hi, d)
        return [(jnp.where(d > 0, x, y), jnp.where(d > 0, y, x))]
    if name == "rem" and _exact(args[1]) and jnp.issubdtype(dtype, jnp.integer):
        # Within one period of a positive divisor, from a non-negative start, the remainder
        # runs monotone; elsewhere it is bounded by the divisor.
        (lo, hi), d = a[0], jnp.abs(args[1])
        same = (lo >= 0) & (jax.lax.div(lo, d) == jax.lax.div(hi, d))
        return [(jnp.where(same, jax.lax.rem(lo, d), jnp.where(lo >= 0, 0, 1 - d)),
                 jnp.where(same, jax.lax.rem(hi, d), jnp.where(hi <= 0, 0, d - 1)))]
    raise _NoRule(name)


def _range_eval(jaxpr, consts, args) -> list:
    """Evaluate `jaxpr` on exact values and ``(lo, hi)`` ranges (`_rule`)."""
    env = {}
    read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]  # noqa: E731
    for var, x in zip(jaxpr.constvars, consts):
        env[var] = x
    for var, x in zip(jaxpr.invars, args):
        env[var] = x
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _bind(eqn, *ins) if all(map(_exact, ins)) else _rule(eqn, ins)
        for var, x in zip(eqn.outvars, outs):
            env[var] = x
    return [read(v) for v in jaxpr.outvars]


def predicate_block_classes(mask: Predicate, q, k, head):
    """EMPTY / PARTIAL / FULL classes (int8, ``[..., nq, nk]``) of `mask`'s blocks from their
    ranges of positions (`BlockCoords` `q` ``[..., nq, 1]`` and `k` ``[..., 1, nk]``), the
    predicate evaluated on intervals (conservative: EMPTY only where it is false on every
    pair of the ranges, FULL only where it is true on every one); ``None`` where an operation
    of `fn` on positions has no interval rule (the layout then evaluates every pair)."""
    params = () if mask.params is None else (mask.params,)
    leaves, treedef = jax.tree.flatten(params)
    takes_head = mask.takes_head

    def fn(qp, kp, head, *leaves):
        kwargs = {"head": head} if takes_head else {}
        return mask.fn(qp, kp, *jax.tree.unflatten(treedef, leaves), **kwargs)

    qlo, qhi = jnp.asarray(q.pos_lo, jnp.int32), jnp.asarray(q.pos_hi, jnp.int32)
    klo, khi = jnp.asarray(k.pos_lo, jnp.int32), jnp.asarray(k.pos_hi, jnp.int32)
    head = jnp.asarray(head, jnp.int32)
    try:
        closed = jax.make_jaxpr(fn)(qlo, klo, head, *leaves)
        out = _range_eval(closed.jaxpr, closed.consts, [(qlo, qhi), (klo, khi), head, *leaves])
    except _NoRule:
        return None
    (out,) = out
    surely, maybe = _pair(out)
    if jnp.dtype(surely.dtype) != jnp.bool_:
        return None
    shape = jnp.broadcast_shapes(qlo.shape, klo.shape)
    return classify(jnp.broadcast_to(surely, shape), ~jnp.broadcast_to(maybe, shape))
