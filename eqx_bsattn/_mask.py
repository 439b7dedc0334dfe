"""The mask strategy: which (query, key) pairs attend, element by element, block by block, and
as the in-kernel terms a GPU or TPU kernel evaluates inside a partial block."""

import abc
import dataclasses
import inspect
import threading
from collections.abc import Iterator
from typing import Any, ClassVar, get_origin

import equinox as eqx
import jax
import jax.numpy as jnp
from equinox import AbstractClassVar, AbstractVar
from jaxtyping import Array, Bool, Int

from ._strategy import _DECLARED_ABSTRACT, _abstract_class_vars

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


def _tighter(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


@dataclasses.dataclass(frozen=True)
class MaskTerms:
    """The canonical predicate: an AND of terms a kernel evaluates in a partial block.

    A key at position ``kp`` is visible to a query at ``qp`` when every term that is switched
    on holds (``None`` / ``False`` / ``()`` switch a term off):

    - `causal_offset`: ``kp <= qp + causal_offset``;
    - `window_left`, `window_right`: ``qp - window_left <= kp <= qp + window_right``;
    - `chunk`: ``qp // chunk == kp // chunk``;
    - `prefix`: ``kp < prefix`` or ``kp <= qp``;
    - `segment_ids`: the segment ids are equal and non-negative;
    - `tables`: ``(rows, cols)`` cell sizes of boolean block tables in the AND. A table is
      constant on each of its cells, so where every tile of a layout is a whole number of
      cells and positions are the token indices, the layout already holds it: a visited tile
      has it True (`aligned`). Elsewhere it has no in-kernel form.

    Mask atoms declare their terms with `AbstractMask.terms`; ``&`` combines two ANDs (the
    tighter bound wins) and gives ``None`` when no single AND expresses both (two chunk sizes).

    ```python
    (masks.Causal() & masks.SlidingWindow(1024, 0)).terms(0)
    # MaskTerms(causal_offset=0, window_left=1024, window_right=0, ...)
    ```
    """

    causal_offset: int | None = None
    window_left: int | None = None
    window_right: int | None = None
    chunk: int | None = None
    prefix: int | None = None
    segment_ids: bool = False
    tables: tuple[tuple[int, int], ...] = ()

    def __and__(self, other: "MaskTerms") -> "MaskTerms | None":
        if self.chunk is not None and other.chunk is not None and self.chunk != other.chunk:
            return None
        return MaskTerms(
            causal_offset=_tighter(self.causal_offset, other.causal_offset),
            window_left=_tighter(self.window_left, other.window_left),
            window_right=_tighter(self.window_right, other.window_right),
            chunk=self.chunk if self.chunk is not None else other.chunk,
            # (k < p1 or causal) and (k < p2 or causal) == k < min(p1, p2) or causal
            prefix=_tighter(self.prefix, other.prefix),
            segment_ids=self.segment_ids or other.segment_ids,
            tables=tuple(dict.fromkeys(self.tables + other.tables)),
        )

    @property
    def uses_positions(self) -> bool:
        """Whether a term reads positions (every term but `segment_ids`)."""
        return any(x is not None for x in (self.causal_offset, self.window_left,
                                           self.window_right, self.chunk, self.prefix))

    def aligned(self, tiles) -> "MaskTerms | None":
        """These terms without their tables, if every ``(block_q, block_kv)`` in `tiles`
        covers whole cells of every table (so the layout holds the tables); else ``None``.

        Valid only where positions are the token indices: tables are looked up on positions.
        """
        for rows, cols in self.tables:
            if any(rows % bq or cols % bk for bq, bk in tiles):
                return None
        return dataclasses.replace(self, tables=())


# --- Masks as values: a pytree leaf unless they hold arrays ------------------------------------

_initialising = threading.local()


def _abstract_vars(cls: type) -> frozenset[str]:
    """The names `cls` or a base annotates `eqx.AbstractVar[...]` that no class has defined
    since (as a field, a class variable or a property): equinox's rule, for masks."""
    names: set[str] = set()
    for klass in reversed(cls.__mro__):
        annotations = inspect.get_annotations(klass)
        names |= {name for name, annotation in annotations.items()
                  if get_origin(annotation) is AbstractVar and name not in vars(klass)}
        names -= vars(klass).keys()
        names -= {name for name, annotation in annotations.items()
                  if get_origin(annotation) not in (AbstractVar, AbstractClassVar)}
    return frozenset(names)


def _holds_arrays(mask) -> bool:
    values = [getattr(mask, f.name) for f in dataclasses.fields(mask)
              if not f.metadata.get("static", False)]
    return any(eqx.is_array(leaf) for leaf in jax.tree_util.tree_leaves(values))


class _MaskMeta(abc.ABCMeta):
    """Makes each mask class a dataclass, and each mask a pytree leaf unless it holds arrays.

    A mask that holds no array (every built-in mask but `ArrayMask`, and any combination of
    them) is one leaf that is not an array, like a kernel or a tiling: swapping it with
    `eqx.tree_at` keeps the structure of the model, of its gradients and of an optimizer state
    built from it, and `eqx.filter_jit` treats it as static (hashed by value). A mask that holds
    arrays is an instance of its class's pytree twin (a registered subclass): its non-static
    fields are children, so `jit` traces its arrays and new values never recompile.
    """

    def __new__(mcs, name, bases, namespace, *, pytree_twin_of=None, is_abstract=False,
                **kwargs):
        cls = super().__new__(mcs, name, bases, namespace, **kwargs)
        if pytree_twin_of is not None:
            return cls
        if is_abstract:  # equinox's keyword: abstract although nothing is left undefined
            _DECLARED_ABSTRACT.add(cls)
        cls.__abstractclassvars__ = _abstract_class_vars(cls)
        cls.__abstractvars__ = _abstract_vars(cls)
        own = inspect.get_annotations(cls)
        # Abstract variables are declarations, not fields (equinox's rule).
        cls.__annotations__ = {n: a for n, a in own.items()
                               if get_origin(a) not in (AbstractVar, AbstractClassVar)}
        custom_init = "__init__" in namespace or any(
            getattr(base, "__mask_custom_init__", False) for base in bases)
        dataclasses.dataclass(init=not custom_init, eq=False, repr=False)(cls)
        cls.__annotations__ = own
        cls.__mask_custom_init__ = custom_init
        cls.__mask_value_class__ = cls
        cls.__mask_pytree_class__ = _pytree_twin(mcs, cls)
        return cls

    def __call__(cls, *args, **kwargs):
        cls = cls.__mask_value_class__
        if cls in _DECLARED_ABSTRACT:
            raise TypeError(f"Can't instantiate abstract class {cls.__name__}.")
        if cls.__abstractvars__ or cls.__abstractclassvars__:
            missing = ", ".join(sorted(cls.__abstractvars__ | cls.__abstractclassvars__))
            raise TypeError(f"Can't instantiate abstract class {cls.__name__} without "
                            f"{missing}.")
        self = cls.__new__(cls)
        pending = _initialising.__dict__.setdefault("ids", set())
        pending.add(id(self))
        try:
            cls.__init__(self, *args, **kwargs)
        finally:
            pending.discard(id(self))
        for field in dataclasses.fields(cls):
            try:
                object.__setattr__(self, field.name, getattr(self, field.name))  # or its default
            except AttributeError:
                raise TypeError(
                    f"{cls.__name__}: field {field.name!r} was not initialised.") from None
            converter = field.metadata.get("converter")
            if converter is not None:
                object.__setattr__(self, field.name, converter(getattr(self, field.name)))
        for klass in reversed(cls.__mro__):
            check = vars(klass).get("__check_init__")
            if check is not None:
                check(self)
        if _holds_arrays(self):
            object.__setattr__(self, "__class__", cls.__mask_pytree_class__)
        return self


def _pytree_twin(meta: type, cls: type) -> type:
    """`cls`'s pytree twin: a subclass registered with JAX, whose instances are the masks of
    class `cls` that hold arrays (non-static fields are children, static ones auxiliary)."""
    twin = meta.__new__(meta, cls.__name__, (cls,), {
        "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
        "__reduce__": _reduce_twin,
    }, pytree_twin_of=cls)
    fields = dataclasses.fields(cls)
    dynamic = tuple(f.name for f in fields if not f.metadata.get("static", False))
    static = tuple(f.name for f in fields if f.metadata.get("static", False))

    def flatten(mask):
        return [getattr(mask, n) for n in dynamic], tuple(getattr(mask, n) for n in static)

    def flatten_with_keys(mask):
        children = [(jax.tree_util.GetAttrKey(n), getattr(mask, n)) for n in dynamic]
        return children, tuple(getattr(mask, n) for n in static)

    def unflatten(aux, children):
        mask = object.__new__(twin)
        for name, value in (*zip(dynamic, children), *zip(static, aux)):
            object.__setattr__(mask, name, value)
        return mask

    jax.tree_util.register_pytree_with_keys(twin, flatten_with_keys, unflatten, flatten)
    return twin


def _reduce_twin(mask):
    # Pickle finds a class by its module and name, which lead to the value class, not to its
    # twin: a twin is pickled as its value class and rebuilt as the twin (`_unpickle_twin`).
    return _unpickle_twin, (mask.__mask_value_class__, dict(vars(mask)))


def _unpickle_twin(cls: type, state: dict):
    """A mask of class `cls` that holds arrays (an instance of its pytree twin), from the
    attributes `_reduce_twin` saved."""
    mask = object.__new__(cls.__mask_pytree_class__)
    for name, value in state.items():
        object.__setattr__(mask, name, value)
    return mask


def _short(value) -> str:
    return eqx.tree_pformat(value, short_arrays=True) if eqx.is_array(value) else repr(value)


class AbstractMask(metaclass=_MaskMeta):
    """Which (query, key) pairs attend.

    A mask answers up to three questions:

    - `elements(q, k, head)` (abstract): for each pair of tokens, does the query see the key?
      Given :class:`TokenCoords`; returns a boolean array broadcast from the two sides.
    - `blocks(q, k, head)`: for each pair of blocks, is it EMPTY, PARTIAL or FULL? Only a mask
      that subclasses `AbstractBlockMask` has it. Any other has its blocks classified by
      evaluating `elements` block by block: exact, but ``O(Lq x Lk)`` once per layout.
    - `terms(head)` (optional): the mask as a `MaskTerms` AND that GPU and TPU kernels
      evaluate inside a partial block; ``None`` (the default) means it has none: the Pallas
      kernels (Mosaic, TPU) then trace `elements` into their partial blocks, or read a
      per-call element map where it reads an array, and Triton and Splash read element
      bitmaps of the partial blocks (static masks only).

    Every concrete mask declares two attributes (abstract here): `reads_segment_ids` (a class
    variable: its `elements` reads the segment ids, so a call must pass them) and
    `varies_by_head` (it gives different heads different masks; a class variable, or a property
    where it depends on the mask's data). Masks compose: ``a & b`` (both), ``a | b`` (either),
    ``~a`` (not). Every mask acts in position space; positions default to token indices.

    ```python
    class EveryOther(AbstractMask):
        reads_segment_ids: ClassVar[bool] = False
        varies_by_head: ClassVar[bool] = False

        def elements(self, q, k, head):
            return (k.position <= q.position) & ((q.position - k.position) % 2 == 0)
    ```
    """

    reads_segment_ids: AbstractClassVar[bool]
    varies_by_head: AbstractVar[bool]

    def __setattr__(self, name, value):
        if id(self) not in getattr(_initialising, "ids", ()):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign to field {name!r}: masks are immutable (use eqx.tree_at or "
                "build a new mask).")
        object.__setattr__(self, name, value)

    def _values(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def __eq__(self, other):
        if self is other:
            return True
        if getattr(other, "__mask_value_class__", None) is not self.__mask_value_class__:
            return False
        return eqx.tree_equal(self._values(), other._values())

    def __hash__(self):
        return hash((self.__mask_value_class__, self._values()))

    def __repr__(self):
        fields = ", ".join(f"{f.name}={_short(getattr(self, f.name))}"
                           for f in dataclasses.fields(self))
        return f"{self.__mask_value_class__.__name__}({fields})"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A `blocks` outside `AbstractBlockMask` (the base that declares it abstract) would be
        # silently ignored by `build_layout`.
        declared = any(getattr(vars(base).get("blocks"), "__isabstractmethod__", False)
                       for base in cls.__mro__)
        if "blocks" in vars(cls) and not declared:
            raise TypeError(f"{cls.__name__} defines `blocks`: a mask that classifies blocks "
                            "from their ranges subclasses `AbstractBlockMask`.")

    @abc.abstractmethod
    def elements(self, q: TokenCoords, k: TokenCoords, head: Any) -> Bool[Array, "..."]:
        """Element predicate: True where query ``q`` attends to key ``k`` for `head`."""

    def terms(self, head: int) -> MaskTerms | None:
        """The in-kernel form of this mask for query head `head`, or ``None`` if it has none."""
        return None

    def hides_padding_keys(self) -> bool:
        """Whether the keys past a call's `kv_seq_lengths` (segment id `LENGTH_PADDING`) are
        hidden from every query, as by a mask that hides every negative id's key
        (`Document`). ``False`` unless a mask knows it: a call with segment ids then adds
        `NonPaddingKeys`."""
        return False

    def children(self) -> tuple["AbstractMask", ...]:
        """The masks this one combines (none for an atom)."""
        return ()

    def nodes(self) -> Iterator["AbstractMask"]:
        """This mask and every mask it is built from, depth first."""
        yield self
        for child in self.children():
            yield from child.nodes()

    @property
    def uses_segment_ids(self) -> bool:
        """Whether the mask reads segment ids (then the call must pass them)."""
        return any(node.reads_segment_ids for node in self.nodes())

    @property
    def head_dependent(self) -> bool:
        """Whether different heads see different masks."""
        return any(node.varies_by_head for node in self.nodes())

    @property
    def classifies_blocks(self) -> bool:
        """Whether every part of the mask is an `AbstractBlockMask` (classifies blocks from
        their ranges); if not, layouts evaluate `elements` block by block."""
        return all(isinstance(node, AbstractBlockMask) for node in self.nodes())

    def check(self, q_len: int, kv_len: int, num_heads: int) -> None:
        """Raise `ValueError` if the mask cannot serve these lengths or head count."""
        for child in self.children():
            child.check(q_len, kv_len, num_heads)

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


class AbstractBlockMask(AbstractMask):
    """A mask that also classifies blocks from their coordinate ranges, in ``O(blocks)``.

    Besides the `AbstractMask` contract it implements `blocks(q, k, head)`: given
    :class:`BlockCoords` for both sides, int8 EMPTY / PARTIAL / FULL classes (`classify`),
    conservatively (FULL only if every pair in the ranges attends, EMPTY only if none does).
    A composite (`And`, `Or`, `Not`, `PerHead`) combines its children's classes, so a mask
    classifies blocks when every node of it does (`classifies_blocks`).

    ```python
    class Banded(AbstractBlockMask):
        reads_segment_ids: ClassVar[bool] = False
        varies_by_head: ClassVar[bool] = False

        def elements(self, q, k, head):
            return abs(q.position - k.position) <= 4

        def blocks(self, q, k, head):
            return classify((q.pos_hi - k.pos_lo <= 4) & (k.pos_hi - q.pos_lo <= 4),
                            (k.pos_lo - q.pos_hi > 4) | (q.pos_lo - k.pos_hi > 4))
    ```
    """

    @abc.abstractmethod
    def blocks(self, q: BlockCoords, k: BlockCoords, head: Any) -> Int[Array, "..."]:
        """Block classes (int8 EMPTY / PARTIAL / FULL) from block ranges.

        Classify exactly the blocks `q` and `k` hold: `build_layout` passes the q-blocks a
        chunk of rows at a time on long sequences.
        """


def _check_is_mask(other: Any, op: str) -> None:
    if not isinstance(other, AbstractMask):
        raise TypeError(
            f"masks combine with `{op}` only with other masks; got {type(other).__name__}."
        )


class Full(AbstractBlockMask):
    """Every query attends to every key (dense attention).

    ```python
    attn = BlockSparseAttention(mask=masks.Full())
    ```
    """

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def elements(self, q, k, head):
        return jnp.ones(jnp.broadcast_shapes(q.index.shape, k.index.shape), bool)

    def blocks(self, q, k, head):
        shape = jnp.broadcast_shapes(q.index_lo.shape, k.index_lo.shape)
        return jnp.full(shape, FULL, jnp.int8)

    def terms(self, head):
        return MaskTerms()


def and_masks(mask: AbstractMask, other: AbstractMask) -> AbstractMask:
    """``mask & other``, or `other` alone where `mask` is `Full` (nothing to combine with)."""
    return other if isinstance(mask, Full) else mask & other


class Document(AbstractBlockMask):
    """A query sees a key only inside its own document: equal segment ids, both ``>= 0``.

    Reads the call's ``q_segment_ids`` / ``kv_segment_ids`` (negative ids mark padding). The
    layout is built on the device inside `jit`, so new segment ids never recompile. Passing
    segment ids to a call adds this mask automatically.

    ```python
    attn = BlockSparseAttention(mask=masks.Causal() & masks.Document())
    out = attn(q, k, v, q_segment_ids=ids, kv_segment_ids=ids)
    ```
    """

    reads_segment_ids: ClassVar[bool] = True
    varies_by_head: ClassVar[bool] = False

    def elements(self, q, k, head):
        if q.segment is None or k.segment is None:
            raise ValueError("`Document` needs `q_segment_ids` and `kv_segment_ids`.")
        return (q.segment == k.segment) & (q.segment >= 0)

    def blocks(self, q, k, head):
        if q.seg_lo is None or k.seg_lo is None:
            raise ValueError("`Document` needs `q_segment_ids` and `kv_segment_ids`.")
        single = (q.seg_lo == q.seg_hi) & (k.seg_lo == k.seg_hi)
        full = single & (q.seg_lo == k.seg_lo) & (q.seg_lo >= 0)
        empty = (
            (q.seg_hi < k.seg_lo) | (k.seg_hi < q.seg_lo) | (q.seg_hi < 0) | (k.seg_hi < 0)
        )
        return classify(full, jnp.asarray(empty))

    def terms(self, head):
        return MaskTerms(segment_ids=True)

    def hides_padding_keys(self):
        return True


#: The segment id of a key past a call's `kv_seq_lengths` (or hidden by a key-padding
#: `attention_mask`): int32's least value, hidden under every mask (`NonPaddingKeys`).
LENGTH_PADDING = -(2**31)


class NonPaddingKeys(AbstractBlockMask):
    """Every key but those past a call's `kv_seq_lengths` (segment id `LENGTH_PADDING`), for
    every query.

    A call with segment ids adds it to a mask that reads them but does not itself hide those
    keys (`hides_padding_keys`: an ``|``, a ``~``, a head of a `PerHead` without `Document`,
    a mask of one's own), so that the keys past the lengths are never seen; a mask that
    reads no segment ids gets `Document` instead. Keys a caller gives other negative ids stay
    as the mask decides.

    ```python
    attn = BlockSparseAttention(mask=~masks.Document() & masks.NonPaddingKeys())
    ```
    """

    reads_segment_ids: ClassVar[bool] = True
    varies_by_head: ClassVar[bool] = False

    def elements(self, q, k, head):
        if k.segment is None:
            raise ValueError("`NonPaddingKeys` needs `kv_segment_ids`.")
        shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in (q.index, k.index, k.segment)
                                       + (() if q.segment is None else (q.segment,))))
        return jnp.broadcast_to(k.segment != LENGTH_PADDING, shape)

    def blocks(self, q, k, head):
        if k.seg_lo is None:
            raise ValueError("`NonPaddingKeys` needs `kv_segment_ids`.")
        shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in (q.index_lo, k.index_lo, k.seg_lo)
                                       + (() if q.seg_lo is None else (q.seg_lo,))))
        # LENGTH_PADDING is the least id: a block holds none above its least id, all at most.
        return classify(jnp.broadcast_to(k.seg_lo != LENGTH_PADDING, shape),
                        jnp.broadcast_to(k.seg_hi == LENGTH_PADDING, shape))

    def hides_padding_keys(self):
        return True


class AbstractBinaryMask(AbstractBlockMask):
    """A mask that combines two masks pair by pair (`And`, `Or`)."""

    left: AbstractMask
    right: AbstractMask

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def children(self):
        return (self.left, self.right)

    def resolve(self, q_len, kv_len):
        return type(self)(self.left.resolve(q_len, kv_len), self.right.resolve(q_len, kv_len))


class And(AbstractBinaryMask):
    """Pairs visible under both masks. Usually written ``left & right``."""

    def elements(self, q, k, head):
        return self.left.elements(q, k, head) & self.right.elements(q, k, head)

    def blocks(self, q, k, head):
        a = self.left.blocks(q, k, head)
        b = self.right.blocks(q, k, head)
        return jnp.minimum(a, b).astype(jnp.int8)  # EMPTY < PARTIAL < FULL

    def terms(self, head):
        left, right = self.left.terms(head), self.right.terms(head)
        return None if left is None or right is None else left & right

    def hides_padding_keys(self):
        return self.left.hides_padding_keys() or self.right.hides_padding_keys()


class Or(AbstractBinaryMask):
    """Pairs visible under either mask. Usually written ``left | right``."""

    def elements(self, q, k, head):
        return self.left.elements(q, k, head) | self.right.elements(q, k, head)

    def blocks(self, q, k, head):
        a = self.left.blocks(q, k, head)
        b = self.right.blocks(q, k, head)
        return jnp.maximum(a, b).astype(jnp.int8)

    def hides_padding_keys(self):
        return self.left.hides_padding_keys() and self.right.hides_padding_keys()


class Not(AbstractBlockMask):
    """Pairs the inner mask hides. Usually written ``~inner``."""

    inner: AbstractMask

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def elements(self, q, k, head):
        return ~self.inner.elements(q, k, head)

    def blocks(self, q, k, head):
        return (FULL - self.inner.blocks(q, k, head)).astype(jnp.int8)

    def children(self):
        return (self.inner,)

    def resolve(self, q_len, kv_len):
        return Not(self.inner.resolve(q_len, kv_len))
