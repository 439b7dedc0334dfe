"""The mask strategy: which (query, key) pairs attend, element by element and block by block."""

import abc
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

#: Block classes, as stored in :class:`eqx_bsattn.BlockLayout` ``classes``.
EMPTY = 0  # no pair of the block attends: the kernel skips it
PARTIAL = 1  # some pairs attend: the kernel evaluates the mask inside the block
FULL = 2  # every in-bounds pair attends: the kernel skips the mask


class TokenCoords(eqx.Module):
    """What a mask sees of one side (queries or keys) at element level.

    Arrays broadcast against the other side's: queries arrive as ``[..., n, 1]``, keys as
    ``[..., 1, m]``. ``position`` equals ``index`` unless the call passed positions;
    ``segment`` is ``None`` unless it passed segment ids. ``length`` is the sequence length.
    """

    index: Int[Array, "..."]
    position: Int[Array, "..."]
    segment: Int[Array, "..."] | None
    length: int = eqx.field(static=True)


class BlockCoords(eqx.Module):
    """What a mask sees of one side at block level: per block, the range of each coordinate.

    ``*_lo``/``*_hi`` are the smallest and largest value over the in-bounds tokens of a block
    (queries ``[..., nq, 1]``, keys ``[..., 1, nk]``). A mask classifies a pair of blocks from
    these ranges alone, conservatively: FULL only if every pair in the ranges attends, EMPTY only
    if none does.
    """

    index_lo: Int[Array, "..."]
    index_hi: Int[Array, "..."]
    pos_lo: Int[Array, "..."]
    pos_hi: Int[Array, "..."]
    seg_lo: Int[Array, "..."] | None
    seg_hi: Int[Array, "..."] | None
    length: int = eqx.field(static=True)
    block_size: int = eqx.field(static=True)
    #: True when positions are the token indices (no positions were passed): ranges are exact
    #: and contiguous, which some masks need to call a block FULL.
    positions_are_indices: bool = eqx.field(static=True)


def classify(all_visible: Any, none_visible: Any) -> Int[Array, "..."]:
    """Combine two boolean arrays into EMPTY / PARTIAL / FULL block classes (int8)."""
    all_visible = jnp.asarray(all_visible)
    none_visible = jnp.asarray(none_visible)
    out = jnp.where(all_visible, FULL, jnp.where(none_visible, EMPTY, PARTIAL))
    return out.astype(jnp.int8)


class AbstractMask(eqx.Module):
    """Which (query, key) pairs attend.

    A mask answers two questions:

    - `elements(q, k, head)`: for each pair of tokens, does the query see the key? Given
      :class:`TokenCoords`; returns a boolean array broadcast from the two sides.
    - `blocks(q, k, head)`: for each pair of blocks, is it EMPTY, PARTIAL or FULL? Given
      :class:`BlockCoords`; returns int8 classes. Built-in masks answer from the block
      coordinates analytically (``O(blocks)``), never by evaluating every element.

    Masks compose: ``a & b`` (both), ``a | b`` (either), ``~a`` (not). Every mask acts in
    position space; positions default to token indices.

    Subclass it for a mask of your own: implement `elements` and, for speed, `blocks` (the
    default evaluates `elements` block by block).
    """

    @abc.abstractmethod
    def elements(self, q: TokenCoords, k: TokenCoords, head: Any) -> Bool[Array, "..."]:
        """Element predicate: True where query ``q`` attends to key ``k`` for `head`."""

    def blocks(self, q: BlockCoords, k: BlockCoords, head: Any) -> Int[Array, "..."]:
        """Block classes (int8 EMPTY / PARTIAL / FULL). Default: conservative PARTIAL."""
        shape = jnp.broadcast_shapes(q.index_lo.shape, k.index_lo.shape)
        return jnp.full(shape, PARTIAL, jnp.int8)

    def atoms(self) -> Iterator["AbstractMask"]:
        """The non-composite masks this mask is built from."""
        yield self

    @property
    def uses_segment_ids(self) -> bool:
        """Whether the mask reads segment ids (then the call must pass them)."""
        return any(getattr(a, "_reads_segments", False) for a in self.atoms())

    @property
    def head_dependent(self) -> bool:
        """Whether different heads see different masks."""
        return any(getattr(a, "_per_head", False) for a in self.atoms())

    @property
    def evaluate_elements_for_blocks(self) -> bool:
        """Whether block classes come from evaluating `elements` block by block.

        True for masks whose `blocks` cannot answer from ranges (`Predicate`, and user masks
        that set the class attribute ``_element_blocks = True``).
        """
        return any(getattr(a, "_element_blocks", False) for a in self.atoms())

    def check(self, q_len: int, kv_len: int, num_heads: int) -> None:
        """Raise `ValueError` if the mask cannot serve these lengths or head count."""
        for atom in self.atoms():
            if atom is not self:
                atom.check(q_len, kv_len, num_heads)

    def resolve(self, q_len: int, kv_len: int) -> "AbstractMask":
        """Return the mask with length-dependent options (e.g. bottom-right causal) made concrete."""
        return self

    def __and__(self, other: "AbstractMask") -> "AbstractMask":
        _check_is_mask(other, "&")
        return And(self, other)

    def __or__(self, other: "AbstractMask") -> "AbstractMask":
        _check_is_mask(other, "|")
        return Or(self, other)

    def __invert__(self) -> "AbstractMask":
        return Not(self)


def _check_is_mask(other: Any, op: str) -> None:
    if not isinstance(other, AbstractMask):
        raise TypeError(
            f"masks combine with `{op}` only with other masks; got {type(other).__name__}."
        )


class Full(AbstractMask):
    """Every query attends to every key (dense attention).

    ```python
    attn = BlockSparseAttention(mask=masks.Full())
    ```
    """

    def elements(self, q, k, head):
        return jnp.ones(jnp.broadcast_shapes(q.index.shape, k.index.shape), bool)

    def blocks(self, q, k, head):
        shape = jnp.broadcast_shapes(q.index_lo.shape, k.index_lo.shape)
        return jnp.full(shape, FULL, jnp.int8)


class And(AbstractMask):
    """Pairs visible under both masks. Usually written ``left & right``."""

    left: AbstractMask
    right: AbstractMask

    def elements(self, q, k, head):
        return self.left.elements(q, k, head) & self.right.elements(q, k, head)

    def blocks(self, q, k, head):
        a = self.left.blocks(q, k, head)
        b = self.right.blocks(q, k, head)
        return jnp.minimum(a, b).astype(jnp.int8)  # EMPTY < PARTIAL < FULL

    def atoms(self):
        yield from self.left.atoms()
        yield from self.right.atoms()

    def check(self, q_len, kv_len, num_heads):
        self.left.check(q_len, kv_len, num_heads)
        self.right.check(q_len, kv_len, num_heads)

    def resolve(self, q_len, kv_len):
        return And(self.left.resolve(q_len, kv_len), self.right.resolve(q_len, kv_len))


class Or(AbstractMask):
    """Pairs visible under either mask. Usually written ``left | right``."""

    left: AbstractMask
    right: AbstractMask

    def elements(self, q, k, head):
        return self.left.elements(q, k, head) | self.right.elements(q, k, head)

    def blocks(self, q, k, head):
        a = self.left.blocks(q, k, head)
        b = self.right.blocks(q, k, head)
        return jnp.maximum(a, b).astype(jnp.int8)

    def atoms(self):
        yield from self.left.atoms()
        yield from self.right.atoms()

    def check(self, q_len, kv_len, num_heads):
        self.left.check(q_len, kv_len, num_heads)
        self.right.check(q_len, kv_len, num_heads)

    def resolve(self, q_len, kv_len):
        return Or(self.left.resolve(q_len, kv_len), self.right.resolve(q_len, kv_len))


class Not(AbstractMask):
    """Pairs the inner mask hides. Usually written ``~inner``."""

    inner: AbstractMask

    def elements(self, q, k, head):
        return ~self.inner.elements(q, k, head)

    def blocks(self, q, k, head):
        return (FULL - self.inner.blocks(q, k, head)).astype(jnp.int8)

    def atoms(self):
        yield from self.inner.atoms()

    def check(self, q_len, kv_len, num_heads):
        self.inner.check(q_len, kv_len, num_heads)

    def resolve(self, q_len, kv_len):
        return Not(self.inner.resolve(q_len, kv_len))
