"""Masks from user code: any predicate of positions, and a different mask per head."""

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqx_bsattn.contract import (
    AbstractBlockMask,
    AbstractMask,
    check_flex,
    fits,
    params_tree,
    read_signature,
)


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
    nothing is per call), and no `terms`: `MosaicBlockSparse` and `PallasTpuBlockSparse`
    trace `fn` into their kernels on the partial blocks (per-call positions and segment ids
    included; `PallasTpuBlockSparse` also where `fn` reads its `params` at scalar indices, e.g.
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

    def elements(self, q, k, head):
        args = (q.position, k.position) + (() if self.params is None else (self.params,))
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
                out = jnp.where(hit, value, out)
        return out

    def blocks(self, q, k, head):
        return self._pick("blocks", head, q, k)

    def terms(self, head):
        return self.masks[head].terms(head)
