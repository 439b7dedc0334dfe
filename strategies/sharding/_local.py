"""What the shardings share: mesh checks, partition specs, and a call's mask as one shard sees it."""

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from eqx_bsattn.contract import (
    AbstractMask,
    BlockLayout,
    CompiledMask,
    ScoreTerms,
    TokenCoords,
)

#: The `BlockLayout` arrays with leading ``[mb, mh]`` axes (everything but the bitmaps).
LAYOUT_LISTS = ("classes", "full_count", "full_index", "partial_count", "partial_index",
                "t_full_count", "t_full_index", "t_partial_count", "t_partial_index",
                "bitmap_index", "t_bitmap_index")


def check_mesh(mesh: Any, axes: dict[str, str | None]) -> None:
    """Raise a clear error unless `mesh` is a `jax.sharding.Mesh` holding each named axis once."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"`mesh` must be a jax.sharding.Mesh; got {type(mesh).__name__}.")
    named = {arg: axis for arg, axis in axes.items() if axis is not None}
    for arg, axis in named.items():
        if axis not in mesh.axis_names:
            raise ValueError(
                f"`{arg}`={axis!r} is not an axis of the mesh; its axes are {mesh.axis_names}."
            )
    if len(set(named.values())) != len(named):
        raise ValueError(f"each mesh axis may split one dimension only; got {named}.")


def axis_size(mesh: Mesh, axis: str | None) -> int:
    return 1 if axis is None else mesh.shape[axis]


def check_divides(what: str, size: int, mesh: Mesh, axis: str | None, arg: str) -> None:
    n = axis_size(mesh, axis)
    if size % n:
        raise ValueError(
            f"{what} ({size}) must be a multiple of the size of mesh axis `{arg}`={axis!r} ({n})."
        )


def _differentiated_eagerly(x) -> bool:
    """Whether `x` is being differentiated outside any `jit` (the value under its autodiff
    tracers is a concrete array)."""
    if not isinstance(x, jax.core.Tracer) or not hasattr(x, "primal"):
        return False
    while isinstance(x, jax.core.Tracer) and hasattr(x, "primal"):
        x = x.primal
    return not isinstance(x, jax.core.Tracer)


def place(x, mesh: Mesh, spec: P):
    """`x` resharded to `spec` where the mesh has explicit axes (`jax.shard_map` then needs
    its inputs sharded as it reads them); unchanged otherwise (it reshards them itself).

    Gradients taken eagerly on such a mesh fail in JAX outside the call (the loss's scalar
    carries the mesh, and eager ops run on one device) unless a mesh is set: refused here
    with the way out, before any work."""
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        if jax.sharding.get_abstract_mesh().empty and _differentiated_eagerly(x):
            raise ValueError(
                "gradients of a sharded call on a mesh with Explicit axes (jax.make_mesh's "
                "default) cannot be taken eagerly: jit the function that takes them (`jax.jit`, "
                "`eqx.filter_jit`), or run it inside `with jax.set_mesh(mesh):`."
            )
        return jax.reshard(x, NamedSharding(mesh, spec))
    return x


def lead_spec(size_b: int, size_h: int, batch: int, heads: int, batch_axis, head_axis):
    """Spec entries for leading ``[b, h]`` axes of size 1 (shared) or the call's size (split)."""
    return (batch_axis if size_b == batch and size_b > 1 else None,
            head_axis if size_h == heads and size_h > 1 else None)


class ShardTokens(eqx.Module):
    """Where one shard's tokens sit in the call's sequence: the shard is ``len(starts)``
    slices of `piece` tokens, slice ``c`` starting at global token ``starts[c]``.

    A ring's contiguous order gives one slice per shard, the zig-zag order two.
    """

    starts: Any  # int32 [slices], traced per device
    piece: int = eqx.field(static=True)

    def global_index(self, index):
        """The call's token index of local token `index` (any shape, int32)."""
        starts = jnp.asarray(self.starts, jnp.int32)
        slot = jnp.clip(index // self.piece, 0, starts.shape[0] - 1)
        return starts[slot] + (index - slot * self.piece)


class ShardPredicate(AbstractMask):
    """A call's resolved mask as one shard sees it: token coordinates keep the call's global
    lengths (a mask may read them), token indices (`q_tokens`, `kv_tokens` map a shard's
    local indices to the call's; ``None``: the shard holds the whole sequence) and positions
    (the caller passes each shard's global positions), and local head ``h`` is global head
    ``h + head_offset``. So every mask, `ArrayMask` included, means the same as unsharded."""

    inner: AbstractMask
    q_len: int = eqx.field(static=True)
    kv_len: int = eqx.field(static=True)
    head_offset: Any = None  # int32 scalar, traced per device; None: heads are not split
    q_tokens: ShardTokens | None = None
    kv_tokens: ShardTokens | None = None

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def children(self):
        return (self.inner,)

    def elements(self, q, k, head):
        zero = 0
        if self.head_offset is not None:
            head = head + self.head_offset
            # The head differs by device: so do the coordinates (a per-head choice between
            # masks then sees operands of one type).
            zero = jnp.zeros_like(self.head_offset)
        q_index = q.index if self.q_tokens is None else self.q_tokens.global_index(q.index)
        k_index = k.index if self.kv_tokens is None else self.kv_tokens.global_index(k.index)
        q = TokenCoords(q_index + zero, q.position + zero, q.segment, self.q_len)
        k = TokenCoords(k_index + zero, k.position + zero, k.segment, self.kv_len)
        return self.inner.elements(q, k, head)

    def terms(self, head):
        return self.inner.terms(head) if self.head_offset is None else None


def local_mask(mask: CompiledMask, layouts: dict[str, BlockLayout | None], *, q_len: int,
               kv_len: int, num_heads: int, head_offset=None,
               q_tokens: ShardTokens | None = None,
               kv_tokens: ShardTokens | None = None) -> CompiledMask:
    """The `CompiledMask` one shard's kernel call reads: its layouts, its lengths and heads,
    the call's predicate in global coordinates (`q_tokens`, `kv_tokens`: where the shard's
    tokens sit in the call's sequence, for a shard of the sequence)."""
    predicate = mask.predicate
    split_heads = head_offset is not None and mask.head_dependent
    cut = (q_len, kv_len) != (mask.q_len, mask.kv_len)
    if cut and (q_tokens is None or kv_tokens is None):
        raise ValueError("a shard of the sequence must say where its tokens sit in the call's "
                         "(`q_tokens`, `kv_tokens`), or index-reading masks would misread it.")
    if cut or split_heads:
        predicate = ShardPredicate(predicate, mask.q_len, mask.kv_len,
                                   head_offset if split_heads else None, q_tokens, kv_tokens)
    head_terms = mask.head_terms
    if split_heads:
        shared = all(t == head_terms[0] for t in head_terms)
        head_terms = (head_terms[0] if shared else None,) * num_heads
    return CompiledMask(layouts["forward"], layouts["dq"], layouts["dkv"], predicate,
                        mask.terms, head_terms, q_len, kv_len, num_heads, mask.hides_padding)


class Operands:
    """Arrays handed to `jax.shard_map` with their specs, in one flat list; concrete arrays
    that every device sees whole stay outside (constants keep a static layout static)."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.arrays: list = []
        self.specs: list = []
        self.constants: dict[int, Any] = {}

    def add(self, x, spec: P, *, constant_ok: bool = False) -> int | None:
        """Register `x`; returns its slot (``None`` for ``None``)."""
        if x is None:
            return None
        slot = len(self.arrays) + len(self.constants)
        whole = all(s is None for s in spec)
        if constant_ok and whole and not isinstance(x, jax.core.Tracer):
            # As NumPy: a constant placed on an explicitly sharded mesh cannot be closed over.
            self.constants[slot] = np.asarray(x)
        else:
            self.arrays.append((slot, place(x, self.mesh, spec)))
            self.specs.append(spec)
        return slot

    def add_layout(self, layout: BlockLayout | None, lead: tuple) -> dict | None:
        if layout is None:
            return None
        slots = {name: self.add(getattr(layout, name), P(*lead), constant_ok=True)
                 for name in LAYOUT_LISTS}
        slots["bitmaps"] = self.add(layout.bitmaps, P(), constant_ok=True)
        return slots

    def inputs(self) -> list:
        return [x for _, x in self.arrays]

    def reader(self, local: list):
        """A function slot -> array inside the shard_map body."""
        values = dict(self.constants)
        values.update({slot: x for (slot, _), x in zip(self.arrays, local)})
        return lambda slot: None if slot is None else values[slot]


def read_layout(read, slots: dict | None, like: BlockLayout | None, **static) -> BlockLayout | None:
    if slots is None:
        return None
    arrays = {name: read(slot) for name, slot in slots.items()}
    fields = dict(q_len=like.q_len, kv_len=like.kv_len, block_q=like.block_q,
                  block_kv=like.block_kv, is_static=like.is_static)
    fields.update(static)
    return BlockLayout(**arrays, **fields)


def local_head_offset(head_axis: str | None, local_heads: int):
    if head_axis is None:
        return None
    return jax.lax.axis_index(head_axis).astype(jnp.int32) * local_heads


@dataclasses.dataclass(frozen=True)
class GlobalHeads:
    """A score function called with the call's query-head ids on a device that holds
    `local_heads` of them (a contiguous run, split over mesh axis `head_axis`).

    The kernel passes local head ids; the device's offset is read from its mesh position when
    the function runs, so this holds no traced value and stays hashable (a kernel keeps the
    score function in its static configuration)."""

    fn: Callable
    head_axis: str
    local_heads: int

    def __call__(self, score, head, q_pos, k_pos, *params, **batch):
        offset = local_head_offset(self.head_axis, self.local_heads)
        return self.fn(score, head + offset, q_pos, k_pos, *params, **batch)


def local_score(terms: ScoreTerms | None, slopes, table, *, head_axis: str | None,
                local_heads: int) -> ScoreTerms | None:
    """The `ScoreTerms` one shard's kernel call reads: `slopes` ``[local_heads]`` and `table`
    ``[local_heads, buckets]`` are the rows of its query heads, and a score function gets the
    call's head ids, so every term means the same as unsharded."""
    if terms is None:
        return None
    fn = terms.function  # a `ScoreTerm`: its user function gets the global head ids
    if fn is not None and head_axis is not None:
        fn = dataclasses.replace(fn, fn=GlobalHeads(fn.fn, head_axis, local_heads))
    return ScoreTerms(slopes, table, terms.buckets, fn, terms.params)
