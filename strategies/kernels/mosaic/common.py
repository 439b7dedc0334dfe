"""What the forward and backward Mosaic GPU kernels share: the canonical predicate, a CTA's
work items (`WorkItems`) and their persistent schedule, the memory warpgroup that streams
list entries through a ring of shared-memory slots, the walk of a FULL-then-PARTIAL block
list, ALiBi's terms over a work item's blocks (`AlibiBlocks`), and the few operations that
differ between the GPU and Pallas' CPU interpreter for Mosaic GPU (layout casts, iotas,
loads and matrix products).

Mosaic GPU is imported inside the functions, so this module imports anywhere.
"""

import dataclasses
import functools
import heapq
import inspect
import math
import operator
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from eqx_bsattn.contract import MaskTerms, TokenCoords

#: Rows per compute warpgroup (one wgmma M-tile) and compute warpgroups per CTA.
ROWS_PER_WARPGROUP = 64
COMPUTE_WARPGROUPS = 2
LOG2E = 1.4426950408889634
#: Registers a thread of a compute / the memory warpgroup holds (3 warpgroups fit 64 K).
COMPUTE_REGISTERS = 232
MEMORY_REGISTERS = 40
#: Shared memory a kernel's buffers may take: the rest of the 227 KiB is left to the barriers
#: and small buffers.
SMEM_BUDGET = 200 * 1024


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """What every launch knows statically: shapes (lengths padded to the tiles), the true key
    length (keys past it are hidden), the softmax scale and the canonical mask terms."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    true_kv_len: int
    head_dim: int
    softmax_scale: float
    #: The mask's canonical terms, evaluated on partial blocks; ``None`` where `predicate`
    #: stands in for them.
    terms: MaskTerms | None
    #: Where the mask has no terms at these tiles: the compiled mask without layouts
    #: (`CompiledMask.without_layouts`), whose element predicate (`visible_at`) partial
    #: blocks evaluate on their coordinate tiles; segment ids then reach it as the call
    #: passed them.
    predicate: Any = dataclasses.field(default=None, kw_only=True)
    #: Where that predicate cannot run on tiles (it reads an array): partial blocks read
    #: tiles of the call's element map instead (`CompiledMask.element_map`, an operand of
    #: each launch; the dk/dv launch reads it transposed).
    elements: bool = dataclasses.field(default=False, kw_only=True)

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.heads // self.kv_heads

    @property
    def padded_kv_len(self) -> int | None:
        """The true key length where keys were padded (partial blocks then hide the keys past
        it), else ``None``: `visible`'s `true_kv_len`."""
        return self.true_kv_len if self.true_kv_len < self.kv_len else None

    @property
    def log2_factor(self) -> float:
        """``softmax_scale * log2(e)``: logits in base 2."""
        return self.softmax_scale * LOG2E



@dataclasses.dataclass(frozen=True, kw_only=True)
class LogitTerms:
    """What a launch adds to each block's logits, the same in the forward and the backward
    (keyword fields, after each config's own)."""

    #: Logits soft cap ``c`` (``c * tanh(scaled logit / c)``); 0: none.
    soft_cap: float = 0.0
    #: ALiBi: ``slopes[h] * (k - q)`` added to each logit before the cap (`AlibiBlocks`).
    alibi: bool = False
    #: A score function, ``function(s, batch, head, q_pos, k_pos, params)`` on each block's
    #: logits in natural units (after ALiBi, before the cap and the mask); ``None``: none.
    function: Callable | None = None
    #: Per-call positions (``[B, L]`` int32 operands) in place of the token indices, for the
    #: mask's terms, ALiBi and the score function.
    positions: bool = False
    #: Where the score function reads arrays (its closure's constants, its `params`): the
    #: function traced at each tile shape the launches evaluate it on, ``((shape,
    #: TracedFunction), ...)`` (`function_data`), and what the kernels know of each array
    #: (`DataLeaf`, by slot). The scalars it reads are the launches' operands
    #: (`table_operands`). ``()``: `function` is traced as it is.
    traced: tuple = ()
    data: tuple = ()
    #: The data slot of each scalar the function reads on a tile, in the order it reads
    #: them (the same at every tile; each read's index depends on the head and batch row
    #: alone, so the launches take each read's scalar per work item: `item_values`).
    reads: tuple = ()
    #: Where the mask's element predicate reads arrays at scalar indices of the head (a
    #: user predicate's per-head widths): the predicate traced at each tile shape the
    #: launches evaluate it on, ``((shape, TracedFunction), ...)`` on ``(head, q index, k
    #: index, q position, k position[, q segment id, k segment id])`` int32 tiles
    #: (`eqx_bsattn.contract.mask_data`), its arrays' leaves (`DataLeaf`, by slot, never
    #: differentiated) and the slot of each scalar it reads, in order. Those scalars follow
    #: the score function's in the read tables (`read_columns`) and in `item_values`.
    #: ``()``: `AttentionShape.predicate` runs as it is (or the element map).
    mask_traced: tuple = ()
    mask_data: tuple = ()
    mask_reads: tuple = ()
    #: A bias (natural units, ``[1 or B, 1 or H, Lq, Lk]``, an operand of each launch; the
    #: dk/dv launch reads it transposed) added to every logit of every block, with ALiBi's
    #: term, before the score function and the cap (`load_pair_tile`). A -inf hides its pair.
    bias: bool = False
    #: A T5 table's buckets (``table[h, bucket(q - k)]`` added after the bias, before the
    #: score function and the cap; the ``[H, num_buckets]`` table an operand of each launch),
    #: or ``None``. Each launch walks its lists in three parts (`walk_list` with the lists'
    #: `far_splits`): a far part's blocks take one entry of the table, a near block a tile of
    #: its launch's bank (`RelativeTiles`).
    relative: Any = None

    @property
    def has_reads(self) -> bool:
        """Whether the launch takes read tables (the score function's or the mask's)."""
        return bool(self.traced or self.mask_traced)

    def traced_at(self, shape):
        """The function traced at tile `shape` (`traced`)."""
        for at, traced in self.traced:
            if tuple(at) == tuple(shape):
                return traced
        raise ValueError(f"the score function was not traced at the tile {tuple(shape)} "
                         f"(traced at {[tuple(at) for at, _ in self.traced]}).")

    @property
    def differentiated_reads(self) -> list[int]:
        """The reads (positions in `reads`) of arrays whose gradient is formed (traced float
        arrays: `DataLeaf.diff`)."""
        return [i for i, slot in enumerate(self.reads) if self.data[slot].diff]

    @property
    def data_gradients(self) -> bool:
        """Whether the dk/dv launch forms the gradient of a read (`differentiated_reads`)."""
        return bool(self.differentiated_reads)

    @property
    def read_columns(self) -> tuple[tuple[bool, int], ...]:
        """Per read, the score function's (`reads`) then the mask's (`mask_reads`), ``(is
        float, column)``: its column of the float32 or the int32 read table
        (`table_operands`)."""
        counts = {True: 0, False: 0}
        columns = []
        leaves = ([self.data[slot] for slot in self.reads]
                  + [self.mask_data[slot] for slot in self.mask_reads])
        for leaf in leaves:
            floating = bool(jnp.issubdtype(leaf.dtype, jnp.floating))
            columns.append((floating, counts[floating]))
            counts[floating] += 1
        return tuple(columns)

    @property
    def whole_terms(self) -> bool:
        """Whether each logit takes ALiBi's whole term (a soft cap or a score function
        follows it, neither shift-invariant, or positions make the distance no sum of a
        row's and a column's parts) rather than a part of it (`AlibiBlocks`)."""
        return bool(self.soft_cap) or self.function is not None or self.positions

def visible(terms: MaskTerms, true_kv_len: int | None, q_index, k_index, q_seg=None,
            k_seg=None, *, ids_apart: bool = False, signed: bool = False, k_token=None):
    """The canonical predicate on broadcast token indices (and segment ids, when given): the
    switched-on terms of `terms`, and ``k_index < true_kv_len`` (padded keys are hidden;
    ``None`` when no key is padded). With `ids_apart` the segment ids went through
    `segment_ids_apart`, so equal ids are never padding and equality alone decides.

    With per-call positions, `q_index` and `k_index` are the positions (`signed`: any sign)
    and `k_token` the keys' token indices, which the padding test reads where given."""
    terms_on = []
    if true_kv_len is not None:
        terms_on.append((k_index if k_token is None else k_token) < true_kv_len)
    if terms.causal_offset is not None:
        terms_on.append(k_index <= q_index + terms.causal_offset)
    if terms.window_left is not None:
        terms_on.append(k_index >= q_index - terms.window_left)
    if terms.window_right is not None:
        terms_on.append(k_index <= q_index + terms.window_right)
    if terms.chunk is not None:
        # Indices are non-negative: truncating division is floor division there; positions
        # may be negative.
        chunk_of = (functools.partial(_floor_div, divisor=terms.chunk) if signed
                    else functools.partial(lax.div, y=terms.chunk))
        terms_on.append(chunk_of(q_index) == chunk_of(k_index))
    if terms.prefix is not None:
        terms_on.append((k_index < terms.prefix) | (k_index <= q_index))
    if q_seg is not None:
        terms_on.append(q_seg == k_seg)
        if not ids_apart:
            terms_on.append(q_seg >= 0)
    if not terms_on:
        return k_index >= 0
    return functools.reduce(operator.and_, terms_on)


#: The element map's dtype (`AttentionShape.elements`): 16 bits, loaded in the wgmma layout.
ELEMENT_MAP_DTYPE = jnp.bfloat16


def block_visible(cfg, ops: "Ops", head, shape, q_axis: int, q_base, k_base, positions,
                  q_seg=None, k_seg=None, map_tile=None, values=None):
    """The mask on a partial block of a launch with config `cfg` (an `AttentionShape` and
    `LogitTerms`), for query head `head`: a block of `shape` whose queries run along `q_axis`
    from token `q_base` (keys from `k_base`); `positions` are its ``(query, key)`` position
    tiles (the per-call positions where ``cfg.positions``, else the token indices), `q_seg`
    and `k_seg` its segment id tiles (``None`` without). The block's element-map tile is
    nonzero (``map_tile()``, loaded by `load_pair_tile`) where ``cfg.elements``; else the
    compiled mask's element predicate (``cfg.predicate``) on the tiles' indices, positions
    and ids (where it reads arrays, its trace at `shape`, ``cfg.mask_traced``, with the
    scalars it reads taken from `values`, the work item's: `item_values`); else the
    canonical terms (`visible`, the ids apart) on the positions, with the padded keys hidden
    by their token indices."""
    if cfg.elements:
        return map_tile()
    q_pos, k_pos = positions
    k_axis = 1 - q_axis
    if cfg.predicate is not None:
        predicate = cfg.predicate
        q_index, k_index = q_pos, k_pos
        if cfg.positions:
            q_index = q_base + ops.iota(shape, q_axis)
            k_index = k_base + ops.iota(shape, k_axis)
        if cfg.mask_traced:
            return mask_tile(cfg, head, (q_index, k_index, q_pos, k_pos, q_seg, k_seg),
                             values)
        return predicate.visible_at(head, TokenCoords(q_index, q_pos, q_seg, predicate.q_len),
                                    TokenCoords(k_index, k_pos, k_seg, predicate.kv_len))
    k_token = None
    if cfg.positions and cfg.padded_kv_len is not None:
        k_token = k_base + ops.iota(shape, k_axis)
    return visible(cfg.terms, cfg.padded_kv_len, q_pos, k_pos, q_seg, k_seg, ids_apart=True,
                   signed=cfg.positions, k_token=k_token)


def mask_tile(cfg, head, tiles, values):
    """The mask's element predicate that reads arrays (``cfg.mask_traced``) on one block:
    its trace at the tiles' shape on `head` and `tiles` ``(q index, k index, q position, k
    position, q segment id, k segment id)`` (the ids ``None`` without), each scalar it reads
    replayed from `values` (`item_values`: the score function's first, then the mask's)."""
    from eqx_bsattn.contract import evaluate_function, replaying_reads

    shape = tuple(tiles[0].shape)
    traced = next((t for at, t in cfg.mask_traced if tuple(at) == shape), None)
    if traced is None:
        raise ValueError(f"the mask's element predicate was not traced at the tile {shape} "
                         f"(traced at {[tuple(at) for at, _ in cfg.mask_traced]}).")
    args = (head, *tiles[:4]) + (tiles[4:] if len(traced.invars) == 7 else ())
    return evaluate_function(traced, args, replaying_reads(list(values)[len(cfg.reads):]))


def load_pair_tile(ops: "Ops", ref, b, h, rows, cols):
    """A tile of a per-pair array `ref` (``[1 or B, 1 or H, R, C]``: a bias, an element map)
    for batch row `b` and query head `h`: rows and columns `rows` and `cols` (`pl.ds`
    slices), in `ref`'s dtype and the wgmma layout. Issued before a block's products, its
    latency hides behind them."""
    prefix = (b if ref.shape[0] > 1 else 0, h if ref.shape[1] > 1 else 0)
    return ops.load(ref, (*prefix, rows, cols), ops.wgmma_layout)


def base2_tile(tile):
    """A tile of natural-unit terms (a bias's, a T5 bank's) in base 2, float32."""
    return tile.astype(jnp.float32) * LOG2E


def _floor_div(x, divisor: int):
    """``floor(x / divisor)`` of int32 `x` for a positive `divisor` (truncating division
    rounds negative quotients up)."""
    return lax.div(x - jnp.where(x < 0, divisor - 1, 0), divisor)


def alibi_positions_term(slope, q_pos, k_pos):
    """ALiBi's base-2 term ``slope log2(e) (k_pos - q_pos)`` on position tiles (per-call
    positions: no split into row and column parts)."""
    return (slope * LOG2E) * (k_pos - q_pos).astype(jnp.float32)


def segment_ids_apart(q_segment_ids, kv_segment_ids):
    """Segment ids whose negatives (padding: such a query sees nothing, such a key is seen
    by none) are -1 on the query side and -2 on the key side, so that ``q == k`` alone is
    the segment term of `visible` (``ids_apart=True``)."""
    return (jnp.where(q_segment_ids >= 0, q_segment_ids, -1),
            jnp.where(kv_segment_ids >= 0, kv_segment_ids, -2))


class Ops:
    """Layout casts, iotas, loads and wgmma products on the GPU; plain arrays and `jnp.dot`
    in the CPU interpreter (`interpreted=True`), which models neither layouts nor wgmma."""

    def __init__(self, interpreted: bool):
        import jax.experimental.pallas.mosaic_gpu as plgpu

        self.interpreted = interpreted
        # Before jax 0.11 `load` takes the index as a required argument (since then it is
        # optional and deprecated).
        index = inspect.signature(plgpu.load).parameters.get("idx")
        self.load_takes_index = index is not None and index.default is inspect.Parameter.empty
        self.wgmma_layout = plgpu.Layout.WGMMA
        self.row_layout = plgpu.Layout.WGMMA.reduce(1)
        self.col_layout = plgpu.Layout.WGMMA.reduce(0)

    def cast(self, x, layout):
        if self.interpreted:
            return x
        import jax.experimental.pallas.mosaic_gpu as plgpu

        return plgpu.layout_cast(x, layout)

    def iota(self, shape, dim):
        """int32 indices along `dim` of `shape`, in the wgmma accumulator layout."""
        if self.interpreted:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        import jax.experimental.pallas.mosaic_gpu as plgpu

        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=self.wgmma_layout)

    def vector_iota(self, n: int, layout):
        """float32 ``[0, 1, .., n - 1]`` in `layout` (a row or column vector of the wgmma
        accumulator), built from each thread's own indices: no load."""
        if self.interpreted:
            return lax.iota(jnp.float32, n)
        import jax.experimental.pallas.mosaic_gpu as plgpu

        return plgpu.broadcasted_iota(jnp.float32, (n,), 0, layout=layout)

    def load(self, ref, idx, layout):
        """``ref[idx]`` from global memory in `layout` (a row or column vector)."""
        if self.interpreted:
            return ref[idx]
        import jax.experimental.pallas.mosaic_gpu as plgpu

        if self.load_takes_index:
            return plgpu.load(ref.at[idx], (), layout=layout, optimized=False)
        return plgpu.load(ref.at[idx], layout=layout, optimized=False)

    def load_smem(self, ref, layout):
        """A shared-memory vector ``ref[...]`` in `layout` (a row or column vector)."""
        if self.interpreted:
            return ref[...]
        import jax.experimental.pallas.mosaic_gpu as plgpu

        if self.load_takes_index:
            return plgpu.load(ref, (), layout=layout)
        return plgpu.load(ref, layout=layout)

    def products(self, shape, pairs):
        """Fresh float32 products ``a @ b`` (``a @ b.T`` where the pair says so), each of
        `shape`, for `pairs` of ``(a smem ref, b smem ref, transpose_b)``, issued as one
        wgmma group."""
        if self.interpreted:
            return tuple(jnp.dot(a[...], b[...].T if t else b[...],
                                 preferred_element_type=jnp.float32) for a, b, t in pairs)
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        def issue(*accs):
            for acc, (a, b, t) in zip(accs, pairs):
                plgpu.wgmma(acc, a, b.transpose((1, 0)) if t else b)
            return tuple(acc[...] for acc in accs)

        return pl.run_scoped(issue, *(plgpu.ACC(shape, jnp.float32) for _ in pairs))

    def sum_of_products_transposed_a(self, shape, pairs):
        """A fresh float32 sum ``sum a.T @ b`` of `shape` over `pairs` of smem refs `a`
        ``[K, M]`` and `b` ``[K, N]``, issued as one wgmma group into one accumulator."""
        if self.interpreted:
            return sum(jnp.dot(a[...].T, b[...], preferred_element_type=jnp.float32)
                       for a, b in pairs)
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        def issue(acc):
            for a, b in pairs:
                plgpu.wgmma(acc, a.transpose((1, 0)), b)
            return acc[...]

        return pl.run_scoped(issue, plgpu.ACC(shape, jnp.float32))

    def add_to_gmem(self, smem, gmem):
        """``gmem += smem``, atomically per element: TMA's bulk reduce-add on the GPU (issued
        asynchronously; `plgpu.wait_smem_to_gmem` before `smem` is written again). The CPU
        interpreter has no reduce-add: a read-modify-write there."""
        if self.interpreted:
            gmem[...] = gmem[...] + smem[...]
            return
        import jax.experimental.pallas.mosaic_gpu as plgpu

        plgpu.copy_smem_to_gmem(smem, gmem, reduction_op="add")

    def accumulate(self, accs, pairs):
        """``acc + a @ b`` for each float32 accumulator and pair ``(a, b)`` or ``(a, b,
        transpose_b)`` (`a` registers or a smem ref, `b` a smem ref, ``a @ b.T`` where the
        pair says so), issued as one wgmma group. A fresh product takes a zero
        accumulator."""
        pairs = [(*pair, False)[:3] for pair in pairs]
        if self.interpreted:  # a[...] reads a ref, and is an array's own value
            return tuple(acc + jnp.dot(a[...], b[...].T if t else b[...],
                                       preferred_element_type=jnp.float32)
                         for acc, (a, b, t) in zip(accs, pairs))
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        def issue(refs):
            for ref, (a, b, t) in zip(refs, pairs):
                plgpu.wgmma(ref, a, b.transpose((1, 0)) if t else b)

        return tuple(pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc in accs)))


class AlibiBlocks:
    """ALiBi, ``slope * (k_pos - q_pos)`` on token indices, over the blocks of one work item,
    in base 2 (the slope times log2 e, like the logits).

    A block's rows are the item's own 64 (queries in the forward and dq kernels, keys in the
    dk/dv kernel), its columns the streamed block's. The distance splits into ``own[i] +
    streamed[j]``: `own` is row i's offset within its 64 rows (small), `streamed` the distance
    from the first own row to column j (the large part), itself ``streamed(columns, 0)`` plus
    the block's constant `shift`. The forward and dq kernels add ``streamed(columns, 0)`` to
    each logit and fold the own part and `shift` into each row's maximum or log-sum-exp (the
    softmax of a row does not change when a constant is added to it); the dk/dv kernel, whose
    log-sum-exp runs along the columns, adds the own part to each logit and folds the
    streamed part into the columns' log-sum-exp. Under a soft cap (not shift-invariant) each
    logit takes the whole term.
    """

    def __init__(self, ops: Ops, slope, rows: int, rows_are_queries: bool):
        self.ops = ops
        self.sign = 1.0 if rows_are_queries else -1.0
        self.slope2 = slope * LOG2E
        #: The distance's part from the rows and its base-2 term, row vectors.
        self.own = -self.sign * ops.vector_iota(rows, ops.row_layout)
        self.own_term = self.slope2 * self.own

    def streamed(self, columns: int, offset):
        """The base-2 term of a block's columns' part of the distance, a column vector:
        `offset` (int32) is the first column's index minus the first own row's."""
        index = self.ops.vector_iota(columns, self.ops.col_layout)
        return self.slope2 * (self.sign * (index + jnp.asarray(offset).astype(jnp.float32)))

    def shift(self, offset):
        """The base-2 term of `offset` alone (a scalar): a block's ``streamed(columns,
        offset)`` is ``streamed(columns, 0) + shift(offset)``."""
        return self.slope2 * (self.sign * offset.astype(jnp.float32))

    def whole(self, shape, offset):
        """A block's whole base-2 term, ``shape = (rows, columns)`` (`offset` as in
        `streamed`): the columns' part along the columns plus the own rows' part along the
        rows, as each logit takes it under a soft cap."""
        return (lax.broadcast_in_dim(self.streamed(shape[1], offset), shape, [1])
                + lax.broadcast_in_dim(self.own_term, shape, [0]))

    def gradient_rows(self, ds, offset):
        """Each row's ``sum_j dS_ij (k_pos - q_pos)`` over one block (`ds` float32, the
        logits' gradient; `offset` as in `streamed`): the rows' shares of the slope's
        gradient, as ``(own_i + sign offset) sum_j dS_ij + sign sum_j dS_ij j``, two row sums
        and no distance tile."""
        index = self.ops.vector_iota(ds.shape[1], self.ops.col_layout)
        total = ds.sum(axis=1)
        weighted = (ds * lax.broadcast_in_dim(index, ds.shape, [1])).sum(axis=1)
        near = self.own + self.sign * offset.astype(jnp.float32)
        return near * total + self.sign * weighted


def score_function_tile(function, s, batch, head, q_pos, k_pos, params=None,
                        derivative: bool = False):
    """A score function (`ScoreTerms`' canonical ``term(s, batch, head, q_pos, k_pos,
    params)``) on one block's tile of logits `s` (float32, natural units, before the soft
    cap), `q_pos` and `k_pos` int32 tiles of its shape, `batch` and `head` int32 scalars.

    With `derivative`, ``(value, d value / d s)``: score functions are elementwise in `s`,
    so one forward-mode product with a tangent of ones gives both in one trace. Where the
    value is ``-inf`` (a hidden pair) the derivative is the caller's to discard."""

    def term(x):
        return jnp.asarray(function(x, batch, head, q_pos, k_pos, params), jnp.float32)

    if not derivative:
        return term(s)
    return jax.jvp(term, (s,), (jnp.ones_like(s),))


def function_tile(cfg: LogitTerms, s, batch, head, q_pos, k_pos, values=None,
                  derivative: bool = False):
    """The launch's score function (``cfg.function``) on one block's tile, as
    `score_function_tile` gives it; where it reads arrays (``cfg.traced``), its trace at the
    tile's shape evaluated with the scalars it reads there taken from `values`, the work
    item's (`item_values`), in the order it reads them."""
    if not cfg.traced:
        return score_function_tile(cfg.function, s, batch, head, q_pos, k_pos,
                                   derivative=derivative)
    from eqx_bsattn.contract import evaluate_function, replaying_reads

    traced = cfg.traced_at(s.shape)

    def term(x):
        return jnp.asarray(evaluate_function(traced, (x, batch, head, q_pos, k_pos),
                                             replaying_reads(values)), jnp.float32)

    if not derivative:
        return term(s)
    return jax.jvp(term, (s,), (jnp.ones_like(s),))


def read_derivatives(cfg: LogitTerms, s, batch, head, q_pos, k_pos, values):
    """``d function / d read`` on one block's tile for each read of an array whose gradient
    is formed (`LogitTerms.differentiated_reads`), in that order: forward-mode products in
    that read's scalar, the others replayed from `values` (`item_values`), on the
    natural-unit logits `s` the function was evaluated on."""
    from eqx_bsattn.contract import evaluate_function, replaying_reads

    traced = cfg.traced_at(s.shape)
    values = list(values)
    tiles = []
    for i in cfg.differentiated_reads:
        def term(x, i=i):
            replayed = values[:i] + [x] + values[i + 1:]
            return jnp.asarray(evaluate_function(traced, (s, batch, head, q_pos, k_pos),
                                                 replaying_reads(replayed)), jnp.float32)

        tiles.append(jax.jvp(term, (values[i],), (jnp.ones_like(values[i]),))[1])
    return tiles


def stored(x, leaf):
    """An array the function reads as the read tables take it: flattened, float32 (a float
    array) or int32 (integers and booleans)."""
    floating = jnp.issubdtype(leaf.dtype, jnp.floating)
    return jnp.ravel(jnp.asarray(x)).astype(jnp.float32 if floating else jnp.int32)


def table_operands(cfg: LogitTerms, tables):
    """The launch's ``(floats [Rf, B, H] float32, ints [Ri, B, H] int32)`` operands: the
    scalars each read of the function, then of the mask's element predicate, takes for each
    batch row and query head (`data.read_tables`), or one-element placeholders without
    them."""
    placeholders = (jnp.zeros((1, 1, 1), jnp.float32), jnp.zeros((1, 1, 1), jnp.int32))
    if not cfg.has_reads:
        return placeholders
    if tables is None or len(tables) != 2:
        raise ValueError("a launch whose score function or mask reads arrays needs its read "
                         "tables "
                         "`data=(floats, ints)` (`data.read_tables`).")
    return tuple(x if x.shape[0] else p for x, p in zip(tables, placeholders))


def item_values(cfg: LogitTerms, floats_ref, ints_ref, batch, head):
    """The scalars the function reads for batch row `batch` and query head `head`, in the
    order it reads them, then those the mask's element predicate reads (``cfg.mask_reads``)
    (each in its array's dtype): loaded once per work item from the read tables
    (`table_operands`), replayed into each block's evaluation (`function_tile`,
    `mask_tile`); ``None`` without data."""
    if not cfg.has_reads:
        return None
    values = []
    leaves = ([cfg.data[slot] for slot in cfg.reads]
              + [cfg.mask_data[slot] for slot in cfg.mask_reads])
    for leaf, (floating, column) in zip(leaves, cfg.read_columns):
        x = (floats_ref if floating else ints_ref)[column, batch, head]
        dtype = leaf.dtype
        values.append(x != 0 if dtype == jnp.bool_ else x.astype(dtype))
    return values

def list_entry(full_ref, partial_ref, prefix, it, n_full):
    """The block of entry `it` of a FULL-then-PARTIAL list: ``full_ref[*prefix, it]`` while
    ``it < n_full``, else ``partial_ref[*prefix, it - n_full]`` (indices clamped in range)."""
    cf, cp = full_ref.shape[-1], partial_ref.shape[-1]
    full_block = full_ref[(*prefix, jnp.clip(it, 0, cf - 1))]
    part_block = partial_ref[(*prefix, jnp.clip(it - n_full, 0, cp - 1))]
    return jnp.where(it < n_full, full_block, part_block)


def layout_prefix(layout_axes, b, h, tile):
    """The index prefix of one tile's lists in the ``[1 or batch, 1 or heads, tiles, ...]``
    list arrays (`layout_axes` their leading sizes)."""
    return (b if layout_axes[0] > 1 else 0, h if layout_axes[1] > 1 else 0, tile)


def list_bounds(layout_axes, b, h, tile, full_count_ref, partial_count_ref):
    """``(prefix, n_full, n_steps)`` of one tile's FULL-then-PARTIAL list: its
    `layout_prefix`, the FULL count and the total count."""
    prefix = layout_prefix(layout_axes, b, h, tile)
    n_full = full_count_ref[prefix]
    return prefix, n_full, n_full + partial_count_ref[prefix]


def walk_list(n_full, n_steps, step, carry, splits=None):
    """``step(it, carry, masked)`` over one tile's FULL-then-PARTIAL list (`list_bounds`):
    entries ``0 .. n_full - 1`` unmasked, then ``n_full .. n_steps - 1`` masked. Each loop
    counts from 0: inside `shard_map` the two counts may differ in their mesh-axis types, and
    a loop from one to the other fails to type its counter.

    With `splits`, the list's four `far_splits` counts ``(full far before, full not far
    after, partial far before, partial not far after)``, each of the two lists is walked in
    its three parts, ``step(it, carry, masked, part)`` with `part` 0 (far before), 1 (near)
    or 2 (far after), static in each loop."""
    if splits is None:
        carry = lax.fori_loop(0, n_full, lambda i, c: step(i, c, False), carry)
        return lax.fori_loop(0, n_steps - n_full, lambda j, c: step(n_full + j, c, True),
                             carry)
    full_before, full_near_end, partial_before, partial_near_end = splits
    bounds = ((0, full_before, False, 0), (full_before, full_near_end, False, 1),
              (full_near_end, n_full, False, 2), (n_full, n_full + partial_before, True, 0),
              (n_full + partial_before, n_full + partial_near_end, True, 1),
              (n_full + partial_near_end, n_steps, True, 2))
    for start, stop, masked, part in bounds:
        carry = lax.fori_loop(
            0, stop - start,
            lambda i, c, start=start, masked=masked, part=part: step(start + i, c, masked, part),
            carry)
    return carry


@dataclasses.dataclass(frozen=True)
class RelativeTiles:
    """A T5 table's term on the blocks of one launch (`LogitTerms.relative`), whose lists
    are walked in three parts (`walk_list`, `far_splits`). Every pair of a block in a far
    part lies in one bucket (`far_buckets`: the lower entries' part's, then the higher
    ones'), so the block takes one entry of the table; a near block's distances
    ``q - k`` are ``offset + i - j`` (``offset + j - i`` where `transposed`: rows are keys)
    for its first query minus its first key, ``offset``, of `count` possible values
    ``first + c * step``; the launch's bank (`bank`, ``[H, count, rows, cols]``) holds the
    term of each, and a near block reads its class's tile.

    `rows` are a compute warpgroup's own rows (queries, or keys where `transposed`), `cols`
    a block's columns, `list_rows` the rows of one list (the work item's tile)."""

    buckets: Any  # RelativeBuckets
    rows: int
    cols: int
    list_rows: int
    transposed: bool

    @property
    def gaps(self) -> tuple[int, int]:
        """``(gap of the lower entries' far part, of the higher ones')`` as `far_splits`
        takes them."""
        (ahead, _), (behind, _) = self.buckets.far_buckets()
        return (behind, ahead) if self.transposed else (ahead, behind)

    @property
    def far_buckets(self) -> tuple[int, int]:
        """``(low_bucket, high_bucket)``: the bucket of every pair of a block in the far
        part of the lower entries (keys before the queries, or queries before the keys where
        `transposed`) and of the higher ones."""
        (_, ahead), (_, behind) = self.buckets.far_buckets()
        return (behind, ahead) if self.transposed else (ahead, behind)

    @property
    def step(self) -> int:
        return math.gcd(self.rows, self.cols)

    @functools.cached_property
    def offsets(self) -> tuple[int, int]:
        """``(first, count)``: the near blocks' offsets (first query minus first key) are
        multiples of `step` from `first`, `count` of them. A list's entry is near when it
        is neither far before (its last token `low` gap or more before the row's first) nor
        far after (its first `high` gap or more after the row's last): `far_splits`."""
        low, high = self.gaps
        rows, cols, span = self.rows, self.cols, self.list_rows
        if self.transposed:  # offset = entry - own rows' first, over the warpgroups
            lower, upper = -(span - rows) - low - cols + 1, span - 1 + high
        else:  # offset = own rows' first - entry
            lower, upper = -(span - 1 + high), (span - rows) + low + cols - 1
        g = self.step
        first = (lower // g + 1) * g       # the least multiple of g above `lower`
        last = -((-upper) // g + 1) * g    # the greatest below `upper`
        return first, (last - first) // g + 1

    @functools.cached_property
    def bank_buckets(self) -> np.ndarray:
        """``[count, rows, cols]`` int32: the bucket of each pair of a near block of each
        offset class."""
        first, count = self.offsets
        offset = first + self.step * np.arange(count)[:, None, None]
        i = np.arange(self.rows)[None, :, None]
        j = np.arange(self.cols)[None, None, :]
        distance = offset + (j - i if self.transposed else i - j)
        with jax.ensure_compile_time_eval():  # a constant, also where a trace asks for it
            return np.asarray(self.buckets.bucket(distance.astype(np.int32)), np.int32)

    def bank(self, table):
        """``[H, count, rows, cols]`` float32: the table's entry at each pair of a near
        block of each offset class (`bank_buckets`), for table ``[H, num_buckets]``."""
        return jnp.asarray(table, jnp.float32)[:, self.bank_buckets]

    def far_terms(self, table_ref, head):
        """The base-2 terms of the two far parts' blocks of head `head` (scalars, read
        once per work item)."""
        return tuple(table_ref[head, bucket] * LOG2E for bucket in self.far_buckets)

    @staticmethod
    def term(far_terms, part: int, near_tile):
        """The base-2 term of one block in walk part `part` (static): the far part's entry
        of the table (a scalar of `far_terms`), or the near block's tile of the bank as
        `near_tile` loaded it before the block's products."""
        if part != 1:
            return far_terms[0 if part == 0 else 1]
        return base2_tile(near_tile)

    def near_tile(self, ops: "Ops", bank_ref, head, part: int, offset):
        """A near block's tile of the bank (natural units), or ``None`` in a far part: to
        be loaded before the block's products, so that its latency hides behind them."""
        if part != 1:
            return None
        return self.tile(ops, bank_ref, head, self.offset_class(offset))

    def offset_class(self, offset):
        """The bank class of a near block's `offset` (clamped in range)."""
        first, count = self.offsets
        return jnp.clip(lax.div(jnp.maximum(offset - first, 0), self.step), 0, count - 1)

    def tile(self, ops: "Ops", bank_ref, head, c):
        """The bank's ``[rows, cols]`` tile of class `c` for `head`, natural units."""
        import jax.experimental.pallas as pl

        return ops.load(bank_ref, (head, c, pl.ds(0, self.rows), pl.ds(0, self.cols)),
                        ops.wgmma_layout)


def relative_tiles(cfg: "LogitTerms", rows: int, cols: int, transposed: bool
                   ) -> "RelativeTiles | None":
    """A launch's `RelativeTiles` (its warpgroups' `rows`, its blocks' `cols`; lists of
    two warpgroups' rows), or ``None`` without a table."""
    if cfg.relative is None:
        return None
    return RelativeTiles(cfg.relative, rows, cols, rows * COMPUTE_WARPGROUPS, transposed)


def relative_splits(tiles: "RelativeTiles | None", lists):
    """The launch's `far_splits` operand ``[MB, MH, n, 4]`` int32 of its lists ``(full
    count, full index, partial count, partial index)`` (transposed ones where
    `tiles.transposed`), or a placeholder without a table."""
    from eqx_bsattn.contract import far_splits

    if tiles is None:
        return jnp.zeros((1, 1, 1, 4), jnp.int32)
    if tiles.transposed:
        block_q, block_kv = tiles.cols, tiles.list_rows
    else:
        block_q, block_kv = tiles.list_rows, tiles.cols
    return jnp.asarray(far_splits(*lists, tiles.transposed, block_q, block_kv,
                                  tiles.buckets), jnp.int32)


def relative_operands(tiles: "RelativeTiles | None", table, lists, launch: str):
    """A launch's ``(table [H, num_buckets] float32, bank, splits)`` operands
    (`RelativeTiles.bank`, `relative_splits` of its `lists`), or placeholders without a
    table."""
    if tiles is None:
        return (jnp.zeros((1, 1), jnp.float32), jnp.zeros((1, 1, 1, 1), jnp.float32),
                relative_splits(None, lists))
    if table is None:
        raise ValueError(f"{launch}: `table` must be given when cfg.relative is on.")
    return (jnp.asarray(table, jnp.float32), tiles.bank(table), relative_splits(tiles, lists))


def split_counts(splits_ref, prefix):
    """The four `far_splits` counts of one list (`walk_list`'s `splits`)."""
    return tuple(splits_ref[(*prefix, n)] for n in range(4))


def memory_warpgroup(num_items, walk, streams, stages: int, registers: int = MEMORY_REGISTERS):
    """The memory warpgroup: for each of the CTA's `num_items` lists ``i`` in turn (a work
    item's, or each of its heads' where an item walks a group of heads), and each entry
    ``it`` of the list, copy each stream's tile ``tile_of(ref, it)`` into the next
    slot of its ring with TMA, where ``(n_steps, tile_of) = walk(i)``. The slots are used
    round-robin over all items together (step ``g`` of the CTA uses slot ``g % stages``), so
    the ring fills with the next item's tiles while the compute warpgroups finish this one;
    from the second lap on, a slot is refilled after its "free" barrier, and the last lap's
    releases are awaited at the end. It lowers its threads' registers to `registers`.

    `streams` holds ``(ref, ring, ready, free)``: the global-memory array, the ``[stages,
    ...]`` shared-memory slots and their barriers (the compute warpgroups wait on `ready` and
    arrive on `free`).
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    plgpu.set_max_registers(registers, action="decrease")

    def item(i, first_step):
        n_steps, tile_of = walk(i)

        @pl.loop(0, n_steps)
        def _(it):
            step = first_step + it
            slot = lax.rem(step, stages)
            for ref, ring, ready, free in streams:
                with jax.named_scope("wait_free"):
                    pl.when(step >= stages)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
                with jax.named_scope("copy"):
                    plgpu.copy_gmem_to_smem(tile_of(ref, it), ring.at[slot], ready.at[slot])

        return first_step + n_steps

    steps = lax.fori_loop(0, num_items, item, jnp.int32(0))
    # Observe the last lap's releases too, so that no barrier phase goes unwaited.
    for i in range(stages):
        step = steps - stages + i
        for _, _, _, free in streams:
            pl.when(step >= 0)(
                lambda free=free, step=step: plgpu.barrier_wait(free.at[lax.rem(step, stages)]))


class WorkItems:
    """The work items of one CTA of a launch over a layout's lists (inside the kernel): one
    (``single``, statically), or in a persistent launch several, ``items_ref[cta,
    :counts_ref[cta]]`` (`persistent_schedule`), their numbers read one item ahead so that
    the next item's list bounds are read while this one runs. An item is ``(b, h, tile)``;
    with ``group > 1`` its head stands for `group` heads of the lists (a kv head's query
    heads), which the item walks one after another (`member`)."""

    def __init__(self, items_ref, counts_ref, num_tiles, heads, layout_axes, list_refs,
                 single: bool, group: int = 1):
        self.items_ref, self.num_tiles, self.heads = items_ref, num_tiles, heads
        self.layout_axes, self.single, self.group = layout_axes, single, group
        self.fcnt_ref, self.fidx_ref, self.pcnt_ref, self.pidx_ref = list_refs
        self.cta = lax.axis_index("ctas")
        self.count = 1 if single else counts_ref[self.cta]  # at least one

    def raw(self, j):
        """The number of the CTA's item j (clamped to its last item)."""
        if self.single:
            return self.items_ref[self.cta, 0]
        return self.items_ref[self.cta, jnp.minimum(j, self.count - 1)]

    def _bounds(self, b, h, tile):
        return list_bounds(self.layout_axes, b, h, tile, self.fcnt_ref, self.pcnt_ref)[1:]

    def decoded(self, raw):
        """``(b, h, tile, n_full, n_steps)`` of the item numbered `raw`: its list's FULL
        count and length; with ``group > 1``, ``n_full`` is None and ``n_steps`` the length
        of its query heads' lists together."""
        b, h, tile = decode_item(raw, self.num_tiles, self.heads)
        if self.group == 1:
            return b, h, tile, *self._bounds(b, h, tile)
        n_steps = lax.fori_loop(0, self.group, lambda g, n: n + self._bounds(
            b, h * self.group + g, tile)[1], jnp.int32(0))
        return b, h, tile, None, n_steps

    def member(self, item, g):
        """``(head, prefix, n_full, n_steps)`` of the list of the item's query head `g` of
        its group: the head, its lists' index prefix (`layout_prefix`), FULL count and
        length."""
        b, h, tile, n_full, n_steps = item
        if self.group > 1:
            h = h * self.group + g
            n_full, n_steps = self._bounds(b, h, tile)
        return h, layout_prefix(self.layout_axes, b, h, tile), n_full, n_steps

    def block(self, prefix, it, n_full):
        """The block of entry `it` of a FULL-then-PARTIAL list (`list_entry`)."""
        return list_entry(self.fidx_ref, self.pidx_ref, prefix, it, n_full)

    def run(self, run_item):
        """``run_item(j, first_step, item, upcoming)`` for each of the CTA's items in turn;
        `first_step` counts the ring steps of the items before (their list lengths),
        `upcoming` is item j + 1's `decoded` tuple (item j's again for the last; ``None``
        for a single item)."""
        if self.single:
            run_item(0, jnp.int32(0), self.decoded(self.raw(0)), None)
            return

        def body(j, carry):
            first_step, this_item, next_raw = carry
            upcoming = self.decoded(next_raw)
            after_next_raw = self.raw(j + 2)
            run_item(j, first_step, this_item, upcoming)
            return first_step + this_item[4], upcoming, after_next_raw

        lax.fori_loop(0, self.count, body, (jnp.int32(0), self.decoded(self.raw(0)),
                                            self.raw(1)))

    def memory_warpgroup(self, streams, stages, tile_of_block):
        """The memory warpgroup over these items (each head of a group's in turn): each list
        entry's tiles, ``tile_of_block(ref, b, h, block)``, streamed through `streams`'
        rings (`memory_warpgroup`)."""

        def walk(j):
            b, h, tile = decode_item(self.raw(lax.div(j, self.group)), self.num_tiles,
                                     self.heads)
            n_full, n_steps = (None, None) if self.group > 1 else self._bounds(b, h, tile)
            h, prefix, n_full, n_steps = self.member((b, h, tile, n_full, n_steps),
                                                     lax.rem(j, self.group))

            def tile_of(ref, it):
                return tile_of_block(ref, b, h, self.block(prefix, it, n_full))

            return n_steps, tile_of

        memory_warpgroup(self.count * self.group, walk, streams, stages)


def persistent_schedule(full_count, partial_count, batch: int, heads: int,
                        ctas: int | None, heavy_tiles_last: bool = True, group: int = 1):
    """``(items [ctas, n] int32, counts [ctas] int32)``: the work items CTA ``c`` of a
    persistent launch runs, in order, ``items[c, :counts[c]]``; an item is ``(b * heads + h)
    * tiles + tile``; ``ctas=None`` gives one CTA per item. Built on the host, so the launch
    needs no extra device work. With ``group > 1`` an item's head ``h`` stands for the lists
    of heads ``h * group .. h * group + group - 1`` (a kv head's query heads), which it walks
    one after another.

    The items are taken batch row by batch row, heavy tiles first (under a causal mask the
    last q-tiles, or with ``heavy_tiles_last=False`` the first kv-tiles), the heads of a
    tile together (so that the tiles in flight share their streamed tiles in L2), and each
    goes to the CTA that becomes free first (`first_free`): FULL blocks cost 1, PARTIAL ones
    1.5 (the mask), and an item 1 more (its prologue and epilogue). When the counts are known
    only on the device (a layout built per call), the items are dealt round-robin instead
    (`dealt`), heavy tiles first.
    """
    tiles = full_count.shape[-1]
    grid = np.arange(batch * heads * tiles, dtype=np.int32).reshape(batch, heads, tiles)
    if heavy_tiles_last:
        grid = grid[:, :, ::-1]
    ctas = ctas or grid.size
    try:
        cost = np.asarray(full_count) + 1.5 * np.asarray(partial_count) + 1.0
    except jax.errors.TracerArrayConversionError:  # a layout built per call
        return dealt(grid.transpose(2, 0, 1).reshape(-1), ctas)
    cost = np.broadcast_to(cost - 1.0, (batch, heads * group, tiles))
    cost = cost.reshape(batch, heads, group, tiles).sum(axis=2).reshape(-1) + 1.0
    return first_free(grid.transpose(0, 2, 1).reshape(-1), cost, ctas)


def first_free(order, cost, ctas: int):
    """`persistent_schedule`'s lists when each item of `order` goes to the CTA whose items
    so far cost least (`cost` is indexed by item)."""
    ctas = min(ctas, len(order))
    free_at = [(0.0, c) for c in range(ctas)]
    lists = [[] for _ in range(ctas)]
    for item in order:
        load, c = heapq.heappop(free_at)
        lists[c].append(int(item))
        heapq.heappush(free_at, (load + float(cost[item]), c))
    return _padded(lists)


def dealt(order, ctas: int):
    """`persistent_schedule`'s lists when the items of `order` are dealt one per CTA per
    round, alternately forwards and backwards (balanced when `order` is heavy first)."""
    ctas = min(ctas, len(order))
    rounds = -(-len(order) // ctas)
    table = np.full(rounds * ctas, -1, np.int64)
    table[:len(order)] = order
    table = table.reshape(rounds, ctas)
    table[1::2] = table[1::2, ::-1]
    return _padded([[int(i) for i in table[:, c] if i >= 0] for c in range(ctas)])


def _padded(lists):
    counts = np.array([len(x) for x in lists], np.int32)
    items = np.zeros((len(lists), counts.max()), np.int32)
    for c, x in enumerate(lists):
        items[c, :len(x)] = x
    return items, counts


def decode_item(item, tiles: int, heads: int):
    """``(b, h, tile)`` of a work item ``(b * heads + h) * tiles + tile``."""
    rows = lax.div(item, tiles)
    return lax.div(rows, heads), lax.rem(rows, heads), lax.rem(item, tiles)


def ring_stages(fixed_bytes: int, stage_bytes: int) -> int:
    """Slots of a ring (2 to 4) that fit the 227 KiB of shared memory next to `fixed_bytes`,
    with a margin for barriers and small buffers (`SMEM_BUDGET`); a launch whose buffers
    leave no room for two raises."""
    stages = min(4, (SMEM_BUDGET - fixed_bytes) // stage_bytes)
    if stages < 2:
        raise ValueError(f"ring_stages: {fixed_bytes} bytes of own tiles and two stages of "
                         f"{stage_bytes} exceed the {SMEM_BUDGET} bytes of shared memory "
                         "the launches take.")
    return stages


def swizzled(shape, dtype, swizzle: int = 128):
    """A shared-memory buffer in the tiled, swizzled form wgmma reads (rows of `swizzle`
    bytes: 64 16-bit or 32 float32 elements at 128). A product's operands share one swizzle,
    and its contraction is a multiple of a row (`swizzle_for`)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    columns = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, columns)),
                                                plgpu.SwizzleTransform(swizzle)))


def swizzle_for(contraction: int, itemsize: int = 2) -> int:
    """The swizzle (bytes) of a launch whose shortest product contraction is `contraction`
    elements: 128, or 64 where a 128-byte row would not divide it (the backward's 32-row
    streamed tiles at D = 256)."""
    return 128 if contraction * itemsize % 128 == 0 else 64


def lowering_failure(what: str, tile, shape=(ROWS_PER_WARPGROUP, 128),
                      data=()) -> str | None:
    """Why Pallas Mosaic GPU cannot lower ``tile(batch, head, rows, cols, s, *data_refs)``
    (a float32 tile of `shape` from traced batch and head scalars, int32 row and column index
    tiles and a float32 tile, all in the wgmma layout; `data_refs` the kernel's operands of
    the abstract arrays `data`) inside a one-warpgroup kernel for CUDA: the first line of the
    error, naming `what`, or ``None``."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    def body(coords_ref, *refs):
        *data_refs, out_ref, stage = refs
        layout = plgpu.Layout.WGMMA
        rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
        cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
        s = plgpu.broadcasted_iota(jnp.float32, shape, 1, layout=layout) * 0.01
        stage[...] = tile(coords_ref[0], coords_ref[1], rows, cols, s, *data_refs)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stage, out_ref)
        plgpu.wait_smem_to_gmem(0)

    launch = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(shape, jnp.float32),
                          scratch_types=[plgpu.SMEM(shape, jnp.float32)],
                          compiler_params=plgpu.CompilerParams(approx_math=True))
    try:
        jax.jit(launch).trace(jax.ShapeDtypeStruct((2,), jnp.int32), *data).lower(
            lowering_platforms=("cuda",))
    except Exception as e:  # noqa: BLE001 - any failure to lower is the verdict
        first = (str(e).strip().splitlines() or [""])[0]
        unimplemented = re.match(r"Unimplemented primitive in Pallas Mosaic GPU lowering: "
                                 r"(\S+)", first)
        if unimplemented:
            first = f"it applies `{unimplemented.group(1)}`, which it has no lowering for"
        elif not first:  # an assertion inside the lowering
            first = f"{type(e).__name__} in its lowering (an operation it does not support)"
        return f"Pallas Mosaic GPU cannot lower {what}: {first}"
    return None
