"""The compiled mask: the contract between masks and kernels, built once per call by the plan.

`ResolvedMask` is a call's mask with its lengths, head count and per-call data (what the
selector and the tiling heuristics see); `ResolvedMask.compile` turns it, at the tiling the plan
picked, into the `CompiledMask` that a kernel reads: one `BlockLayout` per pass, the canonical
predicate terms, bitmaps for partial blocks that no term describes, and the element predicate.
"""

import dataclasses
import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from ._layout import (BlockLayout, carries_arrays, element_mask, layout_of_resolved,
                      resolve_mask)
from ._mask import AbstractMask, And, Document, MaskTerms, TokenCoords

#: How a kernel reads the mask (`AbstractKernel.reads`).
MaskReads = Literal["dense", "elements", "terms"]

#: The passes of a call, each at the tiles of the config's `blocks`.
PASSES = ("forward", "dq", "dkv")


def _pass_tiles(tiling) -> dict[str, tuple[int, int]]:
    return tiling.blocks._asdict()


class CompiledMask(eqx.Module):
    """Everything a kernel reads about the mask of one call.

    Built by `BlockSparseAttention.plan` for the kernel it picked, at the tiling it picked
    (`ResolvedMask.compile`):

    - `forward`, `dq`, `dkv`: the `BlockLayout` of each pass at its own tiles (the config's
      `AbstractKernelConfig.blocks`); the dk/dv pass walks the transposed lists of
      `dkv`. Passes with equal tiles share one layout. ``None`` for a kernel that reads no
      layout (``reads == "dense"``).
    - `terms`: the canonical predicate (`MaskTerms`) that holds for every head at these tiles,
      with the block tables the layouts already hold removed; ``None`` when the mask has none.
      Then a kernel that evaluates terms (``reads == "terms"``) finds element bitmaps of the
      partial blocks in the layouts (``bitmaps``, ``bitmap_index``, ``t_bitmap_index``).
    - `head_terms`: the terms of each head (one entry when every head sees the same mask, as
      the mask declares them, tables included), ``None`` where a head's mask has none.
    - `predicate`: the resolved mask, as an element predicate: call `visible`.
    - `hides_padding`: every pair the mask lets through has equal, non-negative segment ids
      (a `Document` in an AND at the top, or terms that say so for every head), so a padding
      token (a negative id) sees no key and is seen by no query. Its rows of q, k and v must
      then reach no result, whatever they hold: the plan zeroes them before the kernel runs,
      unless the kernel does it itself (`AbstractKernel.zeroes_padding`).
    - `mapped`: the product of the `jax.vmap` axes the arrays that shape the mask (per-call
      positions and segment ids, the mask's own arrays) are mapped over where the call is
      planned (`vmapped_size`; 1 outside `jax.vmap`): what is built from them, an element
      map, is built once per example.

    Kernels never look inside `predicate`: the terms, the layouts and `visible` are the
    contract.
    """

    forward: BlockLayout | None
    dq: BlockLayout | None
    dkv: BlockLayout | None
    predicate: AbstractMask
    terms: MaskTerms | None = eqx.field(static=True)
    head_terms: tuple[MaskTerms | None, ...] = eqx.field(static=True)
    q_len: int = eqx.field(static=True)
    kv_len: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    hides_padding: bool = eqx.field(default=False, static=True)
    mapped: int = eqx.field(default=1, static=True)

    @property
    def uses_segment_ids(self) -> bool:
        """Whether the predicate reads segment ids."""
        return self.predicate.uses_segment_ids

    @property
    def head_dependent(self) -> bool:
        """Whether heads see different masks (layouts then have a head axis ``mh = H``)."""
        return self.predicate.head_dependent

    @property
    def is_static(self) -> bool:
        """Whether the layouts were built at trace time (no per-call data): counts exact."""
        return all(layout.is_static for layout in self.layouts().values())

    def layouts(self) -> dict[str, BlockLayout]:
        """The layouts by pass name (``"forward"``, ``"dq"``, ``"dkv"``); empty if none."""
        return {name: getattr(self, name) for name in PASSES if getattr(self, name) is not None}

    def visible(
        self,
        head,
        q_index: Int[Array, "..."],
        k_index: Int[Array, "..."],
        *,
        q_positions: Int[Array, " lq"] | None = None,
        kv_positions: Int[Array, " lk"] | None = None,
        q_segment_ids: Int[Array, " lq"] | None = None,
        kv_segment_ids: Int[Array, " lk"] | None = None,
    ) -> Bool[Array, "..."]:
        """Whether query `q_index` sees key `k_index` (broadcastable int32 token indices).

        Per-call arrays are one batch element's ``[L]``; segment ids are read only when the
        mask uses them. Keys outside ``[0, kv_len)`` are hidden. `head` may be traced.
        """
        return element_mask(self.predicate, head, q_index, k_index, q_len=self.q_len,
                            kv_len=self.kv_len, q_positions=q_positions,
                            kv_positions=kv_positions, q_segment_ids=q_segment_ids,
                            kv_segment_ids=kv_segment_ids)

    def visible_at(self, head, q: TokenCoords, k: TokenCoords) -> Bool[Array, "..."]:
        """`visible` on coordinates already read per element: `q` and `k` hold broadcastable
        token indices with each token's position and segment id (``None`` without), for a
        kernel that loads per-call data as tiles and cannot index an ``[L]`` array. Keys
        outside ``[0, kv_len)`` and queries past `q_len` are hidden."""
        in_bounds = (k.index < self.kv_len) & (k.index >= 0) & (q.index < self.q_len)
        return self.predicate.elements(q, k, head) & in_bounds

    def without_layouts(self) -> "CompiledMask":
        """This mask without its layouts: what a kernel body needs of it to call
        `visible_at`, hashable where the predicate holds no array (a static argument of a
        launch)."""
        return CompiledMask(None, None, None, self.predicate, self.terms, self.head_terms,
                            self.q_len, self.kv_len, self.num_heads, self.hides_padding,
                            self.mapped)

    def traces_on_tiles(self, tile_shape: tuple[int, int]) -> bool:
        """Whether `visible_at` can run inside a kernel body on int32 tiles of `tile_shape`:
        the predicate closes over no array (a table, a mask's boolean array), is hashable, and
        its traced form indexes no array by traced values (a gather, a dynamic slice).
        Whether a kernel language then lowers its operations is the kernel's to check."""
        if any(eqx.is_array(x) for x in jax.tree.leaves(self.predicate)):
            return False
        try:
            hash(self.without_layouts())
        except TypeError:
            return False
        tile = jax.ShapeDtypeStruct(tile_shape, jnp.int32)
        seg = tile if self.uses_segment_ids else None

        def body(head, qi, ki, qp, kp, qs, ks):
            return self.visible_at(head, TokenCoords(qi, qp, qs, self.q_len),
                                   TokenCoords(ki, kp, ks, self.kv_len))

        try:
            closed = jax.make_jaxpr(body)(jax.ShapeDtypeStruct((), jnp.int32), tile, tile,
                                          tile, tile, seg, seg)
        except Exception:  # noqa: BLE001 - it does not trace on tiles; an element map may
            return False
        return not closed.consts and _indexes_no_array(closed.jaxpr)

    def element_map_bytes(self, batch: int, per_call: bool, copies: int = 2,
                          itemsize: int = 1, lengths: tuple[int, int] | None = None) -> int:
        """The bytes of `copies` element maps (`element_map`) at `lengths` (``(q_len,
        kv_len)``, the padded ones a kernel builds them at; default the mask's), with
        elements of `itemsize` bytes: per batch element where `per_call` data (positions,
        or segment ids the mask reads) shapes the mask, per head where heads differ, and per
        example of the `jax.vmap` axes its arrays are mapped over (`mapped`: a call under
        `vmap` is planned with batch 1, and builds its map for every example)."""
        heads = self.num_heads if self.head_dependent else 1
        q_len, kv_len = lengths or (self.q_len, self.kv_len)
        maps = (batch if per_call else 1) * self.mapped
        return copies * itemsize * maps * heads * q_len * kv_len

    def element_map(self, inputs, q_len: int, kv_len: int, dtype=jnp.int8):
        """The element predicate on every pair of `q_len` x `kv_len` tokens (the padded
        lengths; pairs past the mask's own are hidden), ``[mb, mh, q_len, kv_len]`` in
        `dtype` (1 visible, 0 hidden): ``mb`` the batch where `inputs` (`AttentionInputs`)
        pass positions or segment ids the mask reads, else 1; ``mh`` the heads where they see
        different masks, else 1. What a kernel's partial blocks read as tiles where the
        predicate cannot run in the kernel (it indexes an array)."""
        names = ("q_positions", "kv_positions", "q_segment_ids", "kv_segment_ids")
        data = {n: getattr(inputs, n) for n in names}
        if not self.uses_segment_ids:
            data["q_segment_ids"] = data["kv_segment_ids"] = None
        batched = {n: x for n, x in data.items() if x is not None}
        heads = self.num_heads if self.head_dependent else 1
        qi = jnp.arange(q_len, dtype=jnp.int32)[:, None]
        ki = jnp.arange(kv_len, dtype=jnp.int32)[None, :]

        def one(arrays):
            per_head = lambda h: self.visible(h, qi, ki, **arrays)  # noqa: E731
            return jax.vmap(per_head)(jnp.arange(heads, dtype=jnp.int32))

        out = jax.vmap(one)(batched) if batched else one({})[None]
        return out.astype(dtype)


def vmapped_size(*trees) -> int:
    """The product of the sizes of the `jax.vmap` axes that any array of `trees` is mapped
    over where this runs (1 outside `jax.vmap`, and for arrays it does not map).

    A call under `vmap` is planned as the call of one example, but what it builds from the
    mapped arrays (an element map from per-call positions, segment ids or a mask's array) is
    built for every example. The axes are read from the arrays' tracers, through those of
    `jax.grad` and `jax.vjp`. A `jax.jit` between the `vmap` and the call hides them (it
    traces the call at one example's shapes): then this is 1."""
    sizes = {}
    for x in jax.tree.leaves(trees):
        for _ in range(64):  # one level per enclosing transformation
            if not isinstance(x, jax.core.Tracer):
                break
            trace = getattr(x, "_trace", None)
            axis = getattr(trace, "axis_data", None)
            if getattr(x, "batch_dim", None) is not None and axis is not None:
                sizes[id(trace)] = (trace, int(axis.size))  # the trace kept alive: ids unique
            x = getattr(x, "val", getattr(x, "primal", None))
    return math.prod(size for _, size in sizes.values())


#: Operations that index an array by traced values: no kernel body runs them on tiles.
_GATHERS = frozenset({"gather", "dynamic_slice", "dynamic_update_slice", "scatter",
                      "scatter-add"})


def _jaxprs(params):
    """The jaxprs among an equation's parameters (branches of a `cond`, bodies of loops)."""
    for value in params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(x, "jaxpr") and hasattr(x, "consts"):  # a closed jaxpr
                yield x.jaxpr
            elif hasattr(x, "eqns"):
                yield x


def _indexes_no_array(jaxpr) -> bool:
    """Whether `jaxpr` indexes no array (`_GATHERS`), here or in a nested jaxpr."""
    return all(eqn.primitive.name not in _GATHERS
               and all(_indexes_no_array(j) for j in _jaxprs(eqn.params))
               for eqn in jaxpr.eqns)


def _shared(head_terms: tuple[MaskTerms | None, ...]) -> MaskTerms | None:
    first = head_terms[0]
    return first if all(t == first for t in head_terms) else None


class ResolvedMask:
    """A call's mask resolved against its lengths, head count and per-call data.

    What the selector (`AbstractKernel.decline_reason`) and the tiling heuristics
    (`AbstractKernel.default_tiling`) see before the tiling is fixed; `compile` then builds the
    `CompiledMask` a kernel reads. Layouts are built once per ``(block_q, block_kv)`` and
    reused by every pass and heuristic that asks for them.

    **Arguments:**

    - `mask`: the mask as the user wrote it (resolved against the lengths here; the plan has
      checked it with `AbstractMask.check`).
    - `q_len`, `kv_len`, `num_heads`: the call's lengths and query heads.
    - `q_positions`, `kv_positions`, `q_segment_ids`, `kv_segment_ids`: ``[B, L]`` int32 or
      ``None`` (segment ids are dropped when the mask does not read them).

    ```python
    resolved = ResolvedMask(masks.Causal(), q_len=4096, kv_len=4096, num_heads=8)
    resolved.terms          # MaskTerms(causal_offset=0)
    resolved.layout(128, 128).density()
    ```
    """

    def __init__(self, mask: AbstractMask, *, q_len: int, kv_len: int, num_heads: int,
                 q_positions=None, kv_positions=None, q_segment_ids=None, kv_segment_ids=None):
        mask, self.data = resolve_mask(mask, q_len, kv_len, q_positions=q_positions,
                                       kv_positions=kv_positions, q_segment_ids=q_segment_ids,
                                       kv_segment_ids=kv_segment_ids)
        self.mask = mask
        self.q_len, self.kv_len, self.num_heads = q_len, kv_len, num_heads
        #: The `jax.vmap` axes the mask's arrays and per-call data are mapped over
        #: (`CompiledMask.mapped`).
        self.mapped = vmapped_size(self.data, mask)
        heads = num_heads if mask.head_dependent else 1
        #: Each head's `MaskTerms` (one entry when the mask is the same for every head).
        self.head_terms: tuple[MaskTerms | None, ...] = tuple(mask.terms(h) for h in range(heads))
        #: The terms every head shares, tables included; ``None`` if there are none.
        self.terms: MaskTerms | None = _shared(self.head_terms)
        self._layouts: dict[tuple[int, int, bool], BlockLayout] = {}

    @property
    def is_static(self) -> bool:
        """Whether no per-call data shapes the mask: layouts are built at trace time."""
        return all(x is None for x in self.data.values()) and not carries_arrays(self.mask)

    def predicate(self) -> CompiledMask:
        """The mask as a `CompiledMask` without layouts or terms: its element predicate
        (`CompiledMask.visible_at`), for a kernel that asks, before the tiling is fixed,
        whether the predicate runs on its tiles (`CompiledMask.traces_on_tiles`)."""
        return CompiledMask(None, None, None, self.mask, None, self.head_terms, self.q_len,
                            self.kv_len, self.num_heads,
                            hides_padding(self.mask, self.head_terms), self.mapped)

    @property
    def positions_are_indices(self) -> bool:
        """Whether the call passed no positions (block tables then align with tiles)."""
        return self.data["q_positions"] is None and self.data["kv_positions"] is None

    def layout(self, block_q: int, block_kv: int, *, bitmaps: bool = False) -> BlockLayout:
        """The `BlockLayout` at ``block_q x block_kv`` (built once; concrete when static)."""
        key = (block_q, block_kv, bitmaps)
        if key not in self._layouts:
            if (block_q, block_kv, True) in self._layouts:
                self._layouts[key] = self._layouts[(block_q, block_kv, True)]
            else:
                def build():  # the mask is checked (by the plan) and resolved (here) once
                    return layout_of_resolved(self.mask, q_len=self.q_len, kv_len=self.kv_len,
                                              num_heads=self.num_heads, block_q=block_q,
                                              block_kv=block_kv, with_bitmaps=bitmaps,
                                              **self.data)

                if self.is_static:
                    # Concrete even under jit, so heuristics and kernels can read it on the host.
                    try:
                        with jax.ensure_compile_time_eval():
                            self._layouts[key] = build()
                    except jax.errors.TracerArrayConversionError:
                        raise TypeError(
                            "the mask's function closes over a traced array, so its layout "
                            "cannot be built when traced; pass the array as `params` "
                            "(masks.Predicate(fn, params)).") from None
                else:
                    self._layouts[key] = build()
        return self._layouts[key]

    def kernel_terms(self, tiles) -> MaskTerms | None:
        """The shared terms as a kernel evaluates them at `tiles` (``(block_q, block_kv)``
        pairs): block tables dropped where the tiles cover whole cells and positions are the
        token indices; ``None`` where that fails or the mask has no terms."""
        if self.terms is None or not self.terms.tables:
            return self.terms
        return self.terms.aligned(tiles) if self.positions_are_indices else None

    def compile(self, tiling, reads: MaskReads) -> CompiledMask:
        """The `CompiledMask` for a kernel that `reads` the mask that way, at the tiles of
        `tiling` (an `AbstractKernelConfig`: its `blocks`).

        - ``"dense"``: no layouts; `CompiledMask.terms` are the mask's own.
        - ``"elements"``: a layout per pass; partial blocks are evaluated with `visible`.
        - ``"terms"``: a layout per pass; where the mask has no terms at these tiles, the
          layouts carry element bitmaps (which need a static mask).
        """
        hides = hides_padding(self.mask, self.head_terms)
        if reads == "dense":
            return CompiledMask(None, None, None, self.mask, self.terms, self.head_terms,
                                self.q_len, self.kv_len, self.num_heads, hides, self.mapped)
        if reads not in ("elements", "terms"):
            raise ValueError(f"`reads` must be 'dense', 'elements' or 'terms'; got {reads!r}.")
        tiles = _pass_tiles(tiling)
        terms = self.kernel_terms(tiles.values())
        bitmaps = reads == "terms" and terms is None
        if bitmaps and not self.is_static:
            raise ValueError(
                "this mask has no in-kernel terms at these tiles, so the kernel needs element "
                "bitmaps, which need a static mask; this call passes positions, segment ids or a "
                "mask array."
            )
        layouts = {name: self.layout(*blocks, bitmaps=bitmaps) for name, blocks in tiles.items()}
        return CompiledMask(layouts["forward"], layouts["dq"], layouts["dkv"], self.mask, terms,
                            self.head_terms, self.q_len, self.kv_len, self.num_heads, hides,
                            self.mapped)


def _needs_equal_segments(mask: AbstractMask) -> bool:
    """Whether every pair `mask` lets through has equal, non-negative segment ids (a `Document`
    in an AND at the top)."""
    if isinstance(mask, Document):
        return True
    if isinstance(mask, And):
        return _needs_equal_segments(mask.left) or _needs_equal_segments(mask.right)
    return False


def hides_padding(mask: AbstractMask, head_terms: tuple[MaskTerms | None, ...]) -> bool:
    """`CompiledMask.hides_padding` of a resolved `mask` whose heads have `head_terms`."""
    terms_say = bool(head_terms) and all(t is not None and t.segment_ids for t in head_terms)
    return terms_say or _needs_equal_segments(mask)


def describe_terms(terms: MaskTerms | None) -> str:
    """One line naming the switched-on terms, for `CallPlan.explain`."""
    if terms is None:
        return "none (element predicate or bitmaps)"
    values = {f.name: getattr(terms, f.name) for f in dataclasses.fields(terms)}
    parts = [f"{name}={value!r}" for name, value in values.items()
             if value is not None and value is not False and value != ()]
    return ", ".join(parts) if parts else "always visible"
