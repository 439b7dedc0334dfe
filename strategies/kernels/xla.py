"""`XlaBlockSparse`: block-sparse flash attention in plain JAX (`lax` loops), for every platform.

Work is organised in four mapped levels ``(batch, kv_head, unit, block)``. A *unit* is the set of
query heads that share one list of kv-blocks: when the mask is the same for every head, the
``group = H // Hkv`` query heads of a kv head form one unit (``G = group`` heads inside a unit,
so each gathered K/V block serves the whole group); with per-head masks each query head is its
own unit (``G = 1``). One `lax.fori_loop` walks the slots of the `BlockLayout` lists, first the
FULL blocks (no masking), then the PARTIAL ones (mask evaluated on the block's token indices);
at each slot every (batch, kv_head, unit, block) advances at once, mapped with `vmap` (in
chunks of blocks one after another past `XlaConfig.slot_elements` scores, so memory stays linear). The work
scales with the number of visited blocks; no ``Lq x Lk`` array is built. A bias keeps its size-1
axes (``[bb, hb, Lq or 1, Lk or 1]``: the kernel is an `AbstractBroadcastBiasKernel`): each block
slices its rows and columns from it, and the gradient of a bias without an ``Lq`` (``Lk``) axis
is summed over the rows (keys) inside the loops, so such a bias costs ``O(Lq + Lk)``; only a bias
that is already ``Lq x Lk`` gets a gradient of that size."""

import functools
import math
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqx_bsattn.contract import (
    AbstractBroadcastBiasKernel,
    AbstractKernelConfig,
    AbstractLseKernel,
    BlockLayout,
    CompiledMask,
    Features,
    MaskReads,
    PassBlocks,
    ScoreTerms,
    backward_delta,
    blocks_text,
    chained_blocks,
    check_fields,
    pad_axis,
    public_lse,
    refuse_forward_mode,
    typed_like,
)

_F32 = jnp.float32
_FWD_LISTS = ("full_count", "full_index", "partial_count", "partial_index")
_T_LISTS = ("t_full_count", "t_full_index", "t_partial_count", "t_partial_index")


class _Trips(NamedTuple):
    """How many slots a loop over one block list runs, known at trace time for static layouts.

    ``n`` is the largest count (``None``: read it on the device); ``uniform`` is True when every
    list has exactly ``n`` entries, so no slot needs to be switched off.
    """

    n: int | None
    uniform: bool


class _Config(NamedTuple):
    """Everything static about one call; hashable, so compiled functions are reused."""

    mask: CompiledMask  # the static part (arrays partitioned out)
    scale: float
    soft_cap: float | None
    fwd_trips: tuple[_Trips, _Trips]  # full, partial lists of the forward layout
    dq_trips: tuple[_Trips, _Trips]  # the same lists of the dq layout
    dkv_trips: tuple[_Trips, _Trips]  # the transposed lists of the dk/dv layout
    slot: int  # the most score elements one chunk of a slot computes (`_chunk_width`)
    score: ScoreTerms | None = None  # the static part (arrays are inputs of the function)


# ------------------------------------------------------------------------------------------------
# Arranging arrays into the mapped levels.


def _map_levels(fn, sizes: tuple[int, ...], *args):
    """`vmap` `fn` over the leading axes `sizes` of every array in `args`.

    Each array has ``len(sizes)`` leading axes, each either the level's size (mapped) or 1
    (shared by the whole level: squeezed and broadcast by `vmap`, never copied).
    """
    if not sizes:
        return fn(*args)
    n = sizes[0]
    axes = jax.tree.map(lambda x: 0 if x.shape[0] == n else None, args)
    args = jax.tree.map(lambda x: x if x.shape[0] == n else x[0], args)
    inner = functools.partial(_map_levels, fn, sizes[1:])
    return jax.vmap(inner, in_axes=axes)(*args)


# The large inputs reach the loops *in rows*, ``[B, A, R, *e]`` with the rows of each block
# together on axis 2 and no axis of size 1 added, and each loop body views them in levels with a
# reshape. Viewed before the loop, an input would enter it with axes of size 1 between larger
# ones: XLA's CPU layout assignment gives such a view a permuted layout and copies the whole
# array into the loop in the standard one (256 MB for each of q and dO at L = 2^20).


def _q_rows(x, block: int, group: int, per_head: bool, value=0):
    """q-side arrays (q, dO, lse, delta) ``[B, H, L, *e]`` in rows, padded to whole blocks with
    `value`: ``[B, H, n * block, *e]``, or ``[B, Hkv, n * G * block, *e]`` (the G query heads
    of a block together) when the heads of a kv head share one list."""
    b, h, length = x.shape[:3]
    n = math.ceil(length / block)
    x = pad_axis(x, 2, n * block, value)
    if per_head or group == 1:
        return x
    x = x.reshape(b, h // group, group, n, block, *x.shape[3:])
    return jnp.moveaxis(x, 2, 3).reshape(b, h // group, n * group * block, *x.shape[5:])


def _q_units(x, kv_heads: int, units: int, group: int, block: int):
    """`_q_rows` arrays -> ``[B, Hkv, U, n, G, block, *e]`` (a reshape)."""
    return x.reshape(x.shape[0], kv_heads, units, -1, group, block, *x.shape[3:])


def _units_to_rows(x, length: int, per_head: bool):
    """Results in levels ``[B, Hkv, U, n, G, block, *e]`` -> ``[B, H, L, *e]`` (the inverse of
    `_q_rows` and `_q_units`)."""
    x = x[:, :, :, :, 0] if per_head else jnp.moveaxis(x[:, :, 0], 3, 2)
    b, hkv, group, n, block = x.shape[:5]
    return x.reshape(b, hkv * group, n * block, *x.shape[5:])[:, :, :length]


def _kv_rows(x, block: int):
    """``[B, Hkv, L, e]`` zero-padded to whole blocks (in rows, see `_q_rows`)."""
    return pad_axis(x, 2, math.ceil(x.shape[2] / block) * block)


def _kv_units(x, block: int):
    """`_kv_rows` arrays -> ``[B, Hkv, nk, block, e]`` (a reshape)."""
    return x.reshape(*x.shape[:2], -1, block, x.shape[3])


def _lists_to_units(x, group: int, per_head: bool):
    """Layout arrays ``[mb, mh, n, *c]`` -> ``[mb, Hkv or 1, U, n, *c]``."""
    if per_head:
        return x.reshape(x.shape[0], x.shape[1] // group, group, *x.shape[2:])
    return x[:, :, None]


def _per_head_to_units(x, heads: int, group: int, per_head: bool):
    """Arrays with a leading axis of 1 or ``H`` -> ``[Hkv or 1, U or 1, G or 1, ...]``."""
    if x.shape[0] == 1 or heads == 1:
        return x[:, None, None]
    x = x.reshape(heads // group, group, *x.shape[1:])
    return x[:, :, None] if per_head else x[:, None]


def _bias_to_units(bias, heads: int, group: int, per_head: bool, bq: int, bk: int):
    """``[bb, hb, Lq|1, Lk|1]`` -> ``[bb, Hkv|1, U|1, Gb, Lq'|1, Lk'|1]``, the long axes padded
    to whole blocks (a size-1 axis stays one: every block reads it)."""
    for axis, block in ((2, bq), (3, bk)):
        if bias.shape[axis] > 1:
            bias = pad_axis(bias, axis, math.ceil(bias.shape[axis] / block) * block)
    return jax.vmap(lambda b: _per_head_to_units(b, heads, group, per_head))(bias)


def _bias_grad_kind(bias) -> str | None:
    """Where the bias's gradient is summed: ``"pairs"`` (a bias ``[.., Lq, Lk]``: each visited
    block's ds, scattered), ``"rows"`` (``[.., Lq or 1, 1]``: each row's sum of ds, in the dq
    pass) or ``"keys"`` (``[.., 1, Lk]``: each key's sum of ds, in the dk/dv pass)."""
    if bias is None:
        return None
    rows, keys = bias.shape[2:]
    if keys == 1:
        return "rows"
    return "keys" if rows == 1 else "pairs"


def _summed_to(x, shape):
    """A gradient ``[B, H, Lq|1, Lk|1]`` summed over the axes a bias of `shape` broadcasts."""
    axes = tuple(a for a in range(4) if shape[a] == 1 and x.shape[a] != 1)
    return jnp.sum(x, axis=axes, keepdims=True)


# ------------------------------------------------------------------------------------------------
# The pieces every pass shares.


def _slot_loop(trips: _Trips, count, index, body, carry):
    """Walk block lists slot by slot: at slot ``t`` every unit advances by its ``t``-th block.

    `count` ``[..., n]`` and `index` ``[..., n, c]`` are a layout's lists arranged in levels.
    ``body(t, j, live, carry)`` gets each unit's block ``j`` at that slot and whether the slot
    is inside the unit's list (``None`` when every list is full, so nothing is switched off).
    The loop is the outermost construct and the work inside it is mapped: one loop for all
    units keeps tracing and compiling cheap.
    """
    if trips.n == 0:
        return carry
    # A layout built on the device: loop to the largest count there.
    stop = jnp.max(count) if trips.n is None else trips.n

    def step(t, carry):
        j = jax.lax.dynamic_index_in_dim(index, t, axis=-1, keepdims=False)
        live = None if trips.uniform else t < count
        return body(t, j, live, carry)

    return jax.lax.fori_loop(0, stop, step, carry)


def _logits(cfg: _Config, q_blk, k_blk, bias_blk):
    """Logits of one block before the score terms, float32: ``[G, bq, D] x [bk, D] -> [G, bq,
    bk]``, plus the bias block."""
    s = jnp.einsum("gqd,kd->gqk", q_blk, k_blk, preferred_element_type=_F32) * cfg.scale
    if bias_blk is not None:
        s = s + bias_blk.astype(_F32)
    return s


def _capped(cfg: _Config, s):
    """`s` under the soft cap, and ``tanh(s / c)`` (the backward pass needs its derivative;
    ``None`` without a cap)."""
    if cfg.soft_cap is None:
        return s, None
    t = jnp.tanh(s / cfg.soft_cap)
    return cfg.soft_cap * t, t


def _block_positions(data, index, block: int):
    """Positions of the tokens of block `index` (``[block]`` int32): the call's, else the
    token indices. Rows past the end read the last position (they are hidden or dropped)."""
    idx = index * block + jnp.arange(block, dtype=jnp.int32)
    return idx if data is None else jnp.take(data, idx, mode="clip")


def _slot_terms(cfg: _Config, arr: "_Arranged", i, j, blocks):
    """The score terms of one slot: ``terms(s, arrays)``, the logits `s` ``[B, Hkv, U, n, G, bq,
    bk]`` (all units, before the terms) with the terms added; ``None`` without score terms.
    `arrays` are ``(slopes, table, params)``: each unit's rows of the per-head arrays
    (`_Arranged.score`) and the function's params, whole. `i` and `j` are each unit's q- and
    kv-block, in levels.

    ALiBi and the bucket table run per unit, under the four `vmap` levels. The function runs on
    the slot flattened to ``[B * Hkv * U * n * G, bq, bk]`` (each row with its own head,
    positions and batch index), which is what its contract's ``[..., n, m]`` allows: under
    the levels, a function that reduces over an axis of its own (the dot product of per-token
    features of MLA's RoPE part) ran at rank 8, and its gradient at rank 7 and 8 in
    multiply-reduce fusions that jaxlib 0.10.2's CPU backend hands to YNNPACK, which crashes
    the process on them (a segfault in a worker thread, jax-ml/jax#40412). Flat, the function
    sees rank 3 plus its own axes."""
    if cfg.score is None:
        return None
    bq, bk = blocks
    sizes = arr.sizes
    heads = arr.score[0]  # [1, Hkv, U, 1, G]
    group = heads.shape[-1]
    full = sizes + (group,)
    rows = math.prod(full)
    rows_u = jnp.arange(group, dtype=jnp.int32)[:, None, None]

    def unit(s, i, j, q_data, k_data, slopes, table):
        qp = _block_positions(q_data, i, bq)[:, None]
        kp = _block_positions(k_data, j, bk)[None, :]
        return ScoreTerms(slopes, table, cfg.score.buckets).apply(s, rows_u, qp, kp)

    def positions(data, index, block):  # [*sizes, block]: each unit's block's positions
        idx = (jnp.broadcast_to(index, sizes)[..., None] * block
               + jnp.arange(block, dtype=jnp.int32))
        return idx if data is None else jnp.take_along_axis(data, idx, axis=-1, mode="clip")

    def flat(x, tail):  # [*sizes, G, *tail] (broadcast) -> [rows, *tail]
        return jnp.broadcast_to(x, full + tail).reshape((rows,) + tail)

    function = cfg.score.function is not None
    if function:
        head = flat(heads[..., None, None], (1, 1))
        q_pos = flat(positions(arr.data[0], i, bq)[..., None, :, None], (bq, 1))
        k_pos = flat(positions(arr.data[1], j, bk)[..., None, None, :], (1, bk))
        batch = None if arr.batch is None else flat(arr.batch[..., None, None, None], (1, 1))

    def terms(s, arrays):
        slopes, table, params = arrays
        if slopes is not None or table is not None:
            s = _map_levels(unit, sizes, s, i, j, *arr.data[:2], slopes, table)
        if function:
            out = cfg.score.with_arrays(None, None, params).apply(
                s.reshape((rows,) + s.shape[-2:]), head, q_pos, k_pos, batch=batch)
            s = out.reshape(s.shape)
        return s

    return terms


def _masked_scores(mask: CompiledMask, s, head, i, j, masked: bool, live, data, blocks):
    """`s` with invisible pairs at ``-inf``; also says whether any pair could be hidden.

    PARTIAL blocks evaluate the mask on their token indices (bounds included); FULL blocks
    skip it. `live` (a scalar) switches off a slot past the end of its list.
    """
    bq, bk = blocks
    vis = None
    if masked:
        qp, kp, qs, ks = data
        q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)
        k_idx = j * bk + jnp.arange(bk, dtype=jnp.int32)
        vis = mask.visible(
            0 if head is None else head, q_idx[:, None], k_idx[None, :],
            q_positions=qp, kv_positions=kp, q_segment_ids=qs, kv_segment_ids=ks,
        )
    if live is not None:
        vis = live if vis is None else vis & live
    if vis is None:
        return s, False
    return jnp.where(vis, s, -jnp.inf), True


def _bias_block(bias_u, i, j, bq: int, bk: int):
    """Block ``(i, j)`` of a bias ``[Gb, Lq'|1, Lk'|1]``: ``[Gb, bq|1, bk|1]`` (a size-1 axis
    is read whole and broadcasts against the block's scores)."""
    if bias_u is None:
        return None
    rows, keys = bias_u.shape[1:]
    # int32 throughout: a Python 0 is int64 under `jax_enable_x64`, and the batched slice
    # concatenates its start indices, which must share one dtype.
    zero = jnp.zeros((), jnp.int32)
    start = (zero, zero if rows == 1 else jnp.asarray(i * bq, jnp.int32),
             zero if keys == 1 else jnp.asarray(j * bk, jnp.int32))
    return jax.lax.dynamic_slice(bias_u, start, (bias_u.shape[0], min(rows, bq), min(keys, bk)))


def _zero_padding(x, ids, index, block: int):
    """Block `index` of `x` (``[..., block, e]``) with the rows of padding tokens (negative
    segment `ids`, ``[L]``) zeroed, as `CompiledMask.hides_padding` asks; `x` itself when
    `ids` is ``None``."""
    if ids is None:
        return x
    keep = _block_positions(ids, index, block) >= 0
    return jnp.where(keep[:, None], x, jnp.zeros((), x.dtype))


def _zero_padding_rows(x, ids, block_ids, block: int):
    """Results of the blocks `block_ids` in levels ``[B, Hkv, U, n, (G,) block, e]`` with the
    rows of padding tokens (`ids` ``[B or 1, L]``) zeroed; `x` itself when `ids` is ``None``."""
    if ids is None:
        return x
    idx = block_ids[:, None] * block + jnp.arange(block, dtype=jnp.int32)
    keep = jnp.take(ids, idx, axis=-1, mode="clip") >= 0  # [B or 1, n, block]
    b, n = keep.shape[:2]
    keep = keep.reshape((b, 1, 1, n) + (1,) * (x.ndim - 6) + (block, 1))
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


def _padding_ids(mask: CompiledMask, aux):
    """``(q_segment_ids, kv_segment_ids)`` when the kernel zeroes padding rows (the mask hides
    padding and the call has segment ids), else ``(None, None)``."""
    qs, ks = aux["data"][2:]
    return (qs, ks) if mask.hides_padding and qs is not None else (None, None)


class _Arranged(NamedTuple):
    """One pass's arrays arranged in mapped levels (see `_map_levels`)."""

    sizes: tuple[int, ...]
    per_head: bool
    heads: Any  # [1, Hkv, U, 1] query-head ids for per-head masks; None: one mask for all
    blocks: Any  # [1, 1, 1, n] block ids of the last level
    data: list  # positions / segment ids, [B, 1, 1, 1, L] or None
    bias: Any  # [bb, Hkv|1, U|1, 1, Gb, Lq'|1, Lk'|1] or None
    score: Any  # (heads [1, Hkv, U, 1, G], slopes [..., G] | None, table [..., G, nb] | None)
    batch: Any = None  # [B, 1, 1, 1] batch ids where the score function reads them


def _per_head_layout(layout: BlockLayout) -> bool:
    """Whether the layout has one list per query head (a per-head mask) or one for all."""
    return layout.full_count.shape[1] > 1


def _arrange(cfg: _Config, aux, per_head: bool, bias, q, k, bq: int, bk: int, last: int,
             score=None) -> _Arranged:
    batch, heads = q.shape[:2]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    units = group if per_head else 1
    head_ids = None
    if per_head:
        head_ids = jnp.asarray(np.arange(heads, dtype=np.int32).reshape(1, kv_heads, group, 1))
    block_ids = jnp.asarray(np.arange(last, dtype=np.int32).reshape(1, 1, 1, last))
    data = [None if x is None else x[:, None, None, None] for x in aux["data"]]
    if bias is not None:
        bias = _bias_to_units(bias, heads, group, per_head, bq, bk)[:, :, :, None]
    sc = batch_ids = None
    if score is not None:
        # Each unit's query heads, and the rows of the per-head score arrays for them, float32
        # (the terms compute in it, and their gradients sum over the slots in it); the
        # function's params stay whole, outside the mapped levels.
        ids = np.arange(heads, dtype=np.int32).reshape(1, kv_heads, units, 1, -1)
        sc = (jnp.asarray(ids),) + tuple(None if x is None else x.astype(_F32)[ids]
                                         for x in score[:2])
        if cfg.score.takes_batch:
            batch_ids = jnp.arange(batch, dtype=jnp.int32).reshape(batch, 1, 1, 1)
    return _Arranged((batch, kv_heads, units, last), per_head, head_ids, block_ids, data, bias,
                     sc, batch_ids)


#: The default of `XlaConfig.slot_elements`: the most score elements (``rows x keys``, all
#: mapped levels together) one slot of a pass computes at once. Past it the blocks of the last
#: level run in chunks, one after another, so the temporaries of a slot (scores, probabilities,
#: gathered K/V) stay bounded as L grows. A call inside a sharding's loop (`Features.in_loop`)
#: gets half of it (`XlaBlockSparse.adapt_tiling`).
_SLOT_ELEMENTS = 1 << 22


def _chunk_width(sizes: tuple[int, ...], block_elements: int, slot: int) -> int:
    """How many blocks of the last level one chunk maps, for blocks of `block_elements` scores
    and at most `slot` scores a chunk."""
    per_block = math.prod(sizes[:-1]) * block_elements
    return max(1, slot // per_block)


def _carry_like(value, *refs):
    """A loop's initial carry (fresh zeros or ``-inf``) typed like `refs` (`typed_like`: inside
    `jax.shard_map` a carry must vary over the mesh axes its inputs vary over) and computed
    from their data: a zero made from one element of each (``0 * (x != x)``: never NaN, and
    not foldable), so that XLA builds it when this call runs. A constant carry would be one
    buffer that XLA copies up front for every call of the program (a ring's steps then each
    hold one for the whole ring)."""
    leaves = [x for x in jax.tree.leaves(refs) if x is not None and x.size]
    lax = jax.lax
    zero = jnp.zeros((), _F32)
    for x in leaves:  # in `lax` primitives: jnp's wrappers cost more to trace (30 leaves)
        one = lax.reshape(lax.slice(lax.reshape(x, (x.size,)), (0,), (1,)), ())
        zero = lax.add(zero, lax.mul(lax.convert_element_type(lax.ne(one, one), _F32),
                                     jnp.float32(0.0)))
    return jax.tree.map(lambda c: c + zero.astype(c.dtype), typed_like(value, *refs))


def _by_chunks(run, n: int, width: int, lists, rows, block_rows: int, like):
    """``run(lists, rows, block_ids)`` on chunks of at most `width` of the `n` blocks, one
    chunk after another; outputs (in levels) are joined along axis 3, the block level.

    `lists` are arrays in levels, sliced along axis 3; `rows` are arrays in rows (`_q_rows`,
    `_kv_rows`) with `block_rows` rows per block, sliced along axis 2. Each chunk is sliced out
    of the inputs and written into the outputs in place, so no input is copied (unless padded
    to whole chunks: padding blocks are computed and dropped). `like`: every input `run`
    reads, closed over or not; the loop's output buffers are built from them (`_carry_like`),
    since each chunk's output varies over the mesh axes they vary over."""
    chunks = math.ceil(n / width)
    if chunks <= 1:
        return run(lists, rows, jnp.arange(n, dtype=jnp.int32))
    width = math.ceil(n / chunks)
    total = chunks * width
    lists = jax.tree.map(lambda x: pad_axis(x, 3, total), lists)
    rows = jax.tree.map(lambda x: pad_axis(x, 2, total * block_rows), rows)

    def one_chunk(c):
        def part(axis, size):
            return lambda x: jax.lax.dynamic_slice_in_dim(x, c * size, size, axis=axis)

        return run(jax.tree.map(part(3, width), lists),
                   jax.tree.map(part(2, width * block_rows), rows),
                   c * width + jnp.arange(width, dtype=jnp.int32))

    def step(c, out):
        return jax.tree.map(
            lambda o, x: jax.lax.dynamic_update_slice_in_dim(o, x, c * width, axis=3),
            out, one_chunk(c))

    shapes = jax.eval_shape(one_chunk, 0)
    out = jax.tree.map(
        lambda x: jnp.zeros(x.shape[:3] + (total,) + x.shape[4:], x.dtype), shapes)
    out = _carry_like(out, lists, rows, like)
    out = jax.lax.fori_loop(0, chunks, step, out)
    return jax.tree.map(lambda x: x[:, :, :, :n], out)


def _in_chunk(arr: _Arranged, block_ids) -> _Arranged:
    """`arr` for the chunk of blocks `block_ids` (global ids: the mask and the bias read them)."""
    return arr._replace(sizes=arr.sizes[:3] + (block_ids.shape[0],),
                        blocks=block_ids.reshape(1, 1, 1, -1))


# ------------------------------------------------------------------------------------------------
# Forward.


def _forward(cfg: _Config, q, k, v, bias, sinks, score, aux):
    """Returns the output ``[B, H, Lq, Dv]`` and the log-sum-exp ``[B, H, Lq]`` (``+inf`` on
    rows that see no key), both float32, and the output of the float32 probabilities
    ``[B, H, Lq, Dv]`` float32 where the values are narrower and the call has a bias, sinks or
    score terms (else ``None``).

    ``p @ v`` runs with ``p`` rounded to the value dtype, so with 16-bit values the output is
    that of probabilities 8 (11) bits exact. The backward recomputes ``p`` in float32, and its
    ``delta = rowsum(dO * O)`` must be of that ``p`` (``rowsum(p * dp)``), else each row's
    ``dS`` sums to ``dO . (O - O_exact)`` instead of 0, and every gradient that sums ``dS``
    along a row (a per-query or per-head bias, ALiBi slopes, a bucket table) is that rounding
    noise. The third output adds ``(p - round(p)) @ v`` (a second 16-bit product) to the
    output: exact to about 16 bits of ``p``. Only the forward rule reads it; the primal drops
    it, and XLA removes the dead loop state (the primal's CPU program has the products it had
    without it)."""
    mask = eqx.combine(aux["mask"], cfg.mask)
    layout = mask.forward
    pad_q, pad_kv = _padding_ids(mask, aux)
    batch, heads, q_len, _ = q.shape
    kv_heads, value_dim = v.shape[1], v.shape[3]
    group = heads // kv_heads
    bq, bk = layout.block_q, layout.block_kv
    per_head = _per_head_layout(layout)
    fc, fi, pc, pi = (_lists_to_units(getattr(layout, name), group, per_head) for name in _FWD_LISTS)
    nq = fc.shape[3]
    arr = _arrange(cfg, aux, per_head, bias, q, k, bq, bk, nq, score)
    units, g = arr.sizes[2], (1 if per_head else group)
    q_r = _q_rows(q, bq, group, per_head)
    k_r, v_r = _kv_rows(k, bk), _kv_rows(v, bk)
    arrays = None if score is None else (*arr.score[1:], score[2])
    # 16-bit values round p in p @ v: the third output makes that up (float32, float64 don't)
    # where a gradient sums dS along rows (a bias, sinks, score terms); q, k and v's gradients
    # do not need it.
    compensate = jnp.finfo(v.dtype).bits < 32 and any(
        x is not None for x in (bias, sinks, score))

    def run_list(arr, q_r, trips, count, index, masked, carry):
        def body(t, j, live, carry):
            def logits(j, q_blk, k_blocks, bias_u, i, qs, ks):
                q_blk = _zero_padding(q_blk, None if pad_q is None else qs, i, bq)
                k_blk = _zero_padding(k_blocks[j], None if pad_kv is None else ks, j, bk)
                return _logits(cfg, q_blk, k_blk, _bias_block(bias_u, i, j, bq, bk))

            def unit(carry, s, j, live, v_blocks, head, i, qp, kp, qs, ks):
                m, l, acc, acc_lo = carry
                v_blk = _zero_padding(v_blocks[j], None if pad_kv is None else ks, j, bk)
                s, _ = _capped(cfg, s)
                s, hidden = _masked_scores(mask, s, head, i, j, masked, live,
                                           (qp, kp, qs, ks), (bq, bk))
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                # A row that has seen nothing yet (hidden by the mask, or by a -inf bias or
                # score) keeps m = -inf; shift it by 0 so that exp(-inf - (-inf)) never happens.
                guard = hidden or bias is not None or cfg.score is not None
                shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0) if guard else m_new
                alpha = jnp.exp(m - shift)
                p = jnp.exp(s - shift[..., None])
                if acc_lo is None:
                    p_v = p.astype(v_blk.dtype)
                else:  # p in two parts: what rounding it to the value dtype keeps, and the rest
                    # (`reduce_precision`, not a round trip through the 16-bit type: XLA may
                    # drop a convert pair when it allows excess precision, as on a TPU).
                    finfo = jnp.finfo(v_blk.dtype)
                    p_hi = jax.lax.reduce_precision(p, finfo.nexp, finfo.nmant)
                    p_v = p_hi.astype(v_blk.dtype)
                    acc_lo = alpha[..., None] * acc_lo + jnp.einsum(
                        "gqk,kd->gqd", (p - p_hi).astype(v_blk.dtype), v_blk,
                        preferred_element_type=_F32)
                pv = jnp.einsum("gqk,kd->gqd", p_v, v_blk, preferred_element_type=_F32)
                return (m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv,
                        acc_lo)

            q_u = _q_units(q_r, kv_heads, units, g, bq)
            k_b, v_b = (_kv_units(x, bk)[:, :, None, None] for x in (k_r, v_r))
            s = _map_levels(logits, arr.sizes, j, q_u, k_b, arr.bias, arr.blocks, *arr.data[2:])
            terms = _slot_terms(cfg, arr, arr.blocks, j, (bq, bk))
            if terms is not None:
                s = terms(s, arrays)
            return _map_levels(unit, arr.sizes, carry, s, j, live, v_b, arr.heads, arr.blocks,
                               *arr.data)

        return _slot_loop(trips, count, index, body, carry)

    sinks_lse = None
    if sinks is not None:
        sinks_u = _per_head_to_units(sinks.astype(_F32), heads, group, arr.per_head)
        sinks_u = sinks_u[None, :, :, None]  # [1, Hkv, U|1, 1, G|1, S]
        sinks_lse = jax.nn.logsumexp(sinks_u, axis=-1)[..., None]

    def run_chunk(lists, rows, block_ids):
        (fc, fi, pc, pi), (q_c,) = lists, rows
        arr_c = _in_chunk(arr, block_ids)
        lead = (batch, kv_heads, units, block_ids.shape[0], g, bq)
        carry = (jnp.full(lead, -jnp.inf, _F32), jnp.zeros(lead, _F32),
                 jnp.zeros(lead + (value_dim,), _F32),
                 jnp.zeros(lead + (value_dim,), _F32) if compensate else None)
        carry = _carry_like(carry, q, k, v, bias, score, aux)
        carry = run_list(arr_c, q_c, cfg.fwd_trips[0], fc, fi, False, carry)
        m, l, acc, acc_lo = run_list(arr_c, q_c, cfg.fwd_trips[1], pc, pi, True, carry)
        # Each chunk normalises its own rows: the output leaves the loop as a plain array, not
        # an expression XLA would fuse into the backward's full-length reduction for delta.
        seen = l > 0
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        if sinks_lse is not None:
            lse = jnp.logaddexp(lse, sinks_lse)
        norm = jnp.where(seen, jnp.exp(m - lse), 0.0)[..., None]
        exact = None if acc_lo is None else (acc + acc_lo) * norm
        return acc * norm, jnp.where(seen, lse, jnp.inf), exact

    width = _chunk_width(arr.sizes, g * bq * bk, cfg.slot)
    out, lse, exact = _by_chunks(run_chunk, nq, width, (fc, fi, pc, pi), (q_r,), g * bq,
                                 (q, k, v, bias, sinks, score, aux))
    out, lse = (_units_to_rows(x, q_len, arr.per_head) for x in (out, lse))
    return out, lse, None if exact is None else _units_to_rows(exact, q_len, arr.per_head)



# ------------------------------------------------------------------------------------------------
# Backward: dq (and the bias gradient) over q-blocks, dk/dv over kv-blocks.


def _ds(p, dp, delta, t):
    """Gradient of the loss at the logits before the soft cap: ``p * (dp - delta) * cap'``."""
    ds = p * (dp - delta[..., None])
    if t is not None:
        ds = ds * (1.0 - t * t)
    return ds


def _q_side_rows(q, d_out, lse, delta, block: int, group: int, per_head: bool):
    """The backward's q-side arrays in rows; padded rows get ``lse = inf`` (so ``p = 0``)."""
    return (
        _q_rows(q, block, group, per_head),
        _q_rows(d_out, block, group, per_head),
        _q_rows(lse, block, group, per_head, value=jnp.inf),
        _q_rows(delta, block, group, per_head),
    )


def _backward_dq(cfg: _Config, q, k, v, bias, score, aux, d_out, lse, delta):
    """``dq [B, H, Lq, D]`` float32; with a bias whose gradient this pass sums (`pairs`, `rows`:
    `_bias_grad_kind`), ``dbias`` in the bias's shape (else ``None``); with score arrays, their
    float32 gradients ``(dslopes [H], dtable [H, nb], dparams)`` (``None`` where off)."""
    mask = eqx.combine(aux["mask"], cfg.mask)
    layout = mask.dq
    pad_q, pad_kv = _padding_ids(mask, aux)
    batch, heads, q_len, _ = q.shape
    kv_heads, kv_len = k.shape[1:3]
    group = heads // kv_heads
    bq, bk = layout.block_q, layout.block_kv
    per_head = _per_head_layout(layout)
    fc, fi, pc, pi = (_lists_to_units(getattr(layout, name), group, per_head) for name in _FWD_LISTS)
    nq = fc.shape[3]
    nk = layout.num_kv_blocks
    cf, cp = fi.shape[-1], pi.shape[-1]
    arr = _arrange(cfg, aux, per_head, bias, q, k, bq, bk, nq, score)
    units, g = arr.sizes[2], (1 if per_head else group)
    q_side = _q_side_rows(q, d_out, lse, delta, bq, group, per_head)
    k_r, v_r = _kv_rows(k, bk), _kv_rows(v, bk)
    arrays = None if score is None else (*arr.score[1:], score[2])

    kind = _bias_grad_kind(bias)

    def run_list(arr, q_side, trips, count, index, masked, offset, carry):
        def body(t, j, live, carry):
            dq, d_score, rows, ds_buf = carry

            def logits(j, q_blk, k_blocks, bias_u, i, qs, ks):
                q_blk = _zero_padding(q_blk, None if pad_q is None else qs, i, bq)
                k_blk = _zero_padding(k_blocks[j], None if pad_kv is None else ks, j, bk)
                return _logits(cfg, q_blk, k_blk, _bias_block(bias_u, i, j, bq, bk))

            def grad(s, j, live, do_blk, lse_blk, delta_blk, v_blocks, head, i, qp, kp, qs, ks):
                v_blk = _zero_padding(v_blocks[j], None if pad_kv is None else ks, j, bk)
                s, tc = _capped(cfg, s)
                s, hidden = _masked_scores(mask, s, head, i, j, masked, live,
                                           (qp, kp, qs, ks), (bq, bk))
                p = jnp.exp(s - lse_blk[..., None])
                dp = jnp.einsum("gqe,ke->gqk", do_blk, v_blk, preferred_element_type=_F32)
                ds = _ds(p, dp, delta_blk, tc)
                if hidden and cfg.score is not None:
                    # A hidden pair reads no entry of the score arrays: its ds is zero even
                    # where the row is NaN (a poisoned array, lse NaN).
                    ds = jnp.where(s == -jnp.inf, 0.0, ds)
                return ds

            def accumulate(acc, ds, j, k_blocks, ks):
                dq, rows = acc
                k_blk = _zero_padding(k_blocks[j], None if pad_kv is None else ks, j, bk)
                # ds in float32: p * (dp - delta) cancels, so 8 bits of it lose the small terms.
                dq = dq + jnp.einsum("gqk,kd->gqd", ds, k_blk.astype(_F32),
                                     preferred_element_type=_F32)
                if rows is not None:  # a bias without a key axis: each row's sum of ds
                    rows = rows + jnp.sum(ds, axis=-1)
                return dq, rows

            q_u, do_u, lse_u, delta_u = (_q_units(x, kv_heads, units, g, bq) for x in q_side)
            k_b, v_b = (_kv_units(x, bk)[:, :, None, None] for x in (k_r, v_r))
            s = _map_levels(logits, arr.sizes, j, q_u, k_b, arr.bias, arr.blocks, *arr.data[2:])
            terms = _slot_terms(cfg, arr, arr.blocks, j, (bq, bk))
            if terms is not None:
                s, back = jax.vjp(terms, s, arrays)
            ds = _map_levels(grad, arr.sizes, s, j, live, do_u, lse_u, delta_u, v_b, arr.heads,
                             arr.blocks, *arr.data)
            if terms is not None:  # through the score terms, to q . k and their arrays
                ds, d_arrays = back(ds)
                # An integer leaf of `params` has a float0 cotangent: its sum stays zero.
                d_score = jax.tree.map(lambda acc, d: acc if d.dtype == jax.dtypes.float0
                                       else acc + d, d_score, d_arrays)
            dq, rows = _map_levels(accumulate, arr.sizes, (dq, rows), ds, j, k_b, arr.data[3])
            if ds_buf is not None:
                ds_buf = jax.lax.dynamic_update_index_in_dim(ds_buf, ds, offset + t, 0)
            return dq, d_score, rows, ds_buf

        return _slot_loop(trips, count, index, body, carry)

    def run_chunk(lists, q_side, block_ids):
        fc, fi, pc, pi = lists
        arr_c = _in_chunk(arr, block_ids)
        sides = (arr_c, q_side)
        lead = (batch, kv_heads, units, block_ids.shape[0], g, bq)
        ds_buf = jnp.zeros((cf + cp,) + lead + (bk,), _F32) if kind == "pairs" else None
        rows = jnp.zeros(lead, _F32) if kind == "rows" else None
        # The gradients of the score arrays (slopes, table, params), float32, summed over the
        # slots (and the chunks, below).
        d_score = jax.tree.map(lambda x: jnp.zeros(x.shape, _F32), arrays)
        carry = (jnp.zeros(lead + (q.shape[-1],), _F32), d_score, rows, ds_buf)
        carry = _carry_like(carry, q, k, v, bias, score, aux, d_out, lse, delta)
        carry = run_list(*sides, cfg.dq_trips[0], fc, fi, False, 0, carry)
        dq, d_score, rows, ds_buf = run_list(*sides, cfg.dq_trips[1], pc, pi, True, cf, carry)
        dq = _zero_padding_rows(dq, pad_q, block_ids, bq)
        # The slot axis last, so that the block level is axis 3 as `_by_chunks` joins it; the
        # score arrays' gradients get a block axis of one (summed below).
        d_score = jax.tree.map(lambda x: x.reshape((1, 1, 1, 1) + x.shape), d_score)
        return dq, d_score, rows, (None if ds_buf is None else jnp.moveaxis(ds_buf, 0, -1))

    width = _chunk_width(arr.sizes, g * bq * bk, cfg.slot)
    dq, d_score, rows, ds_buf = _by_chunks(
        run_chunk, nq, width, (fc, fi, pc, pi), q_side, g * bq,
        (q, k, v, bias, score, aux, d_out, lse, delta))
    if d_score is not None:
        # Units hold the query heads in order (kv head, unit, group member): sum the batch and
        # the q-blocks (and the chunks), and the head axis of the rows is the flat rest.
        d_slopes, d_table, d_params = jax.tree.map(lambda x: x.sum(axis=(0, 1, 2, 3)), d_score)
        d_score = tuple(None if x is None else x.reshape(heads, *x.shape[5:])
                        for x in (d_slopes, d_table)) + (d_params,)
    dq = _units_to_rows(dq * cfg.scale, q_len, per_head)
    if kind == "rows":
        rows = _summed_to(_units_to_rows(rows, q_len, per_head)[..., None], bias.shape)
        return dq, rows, d_score
    if kind != "pairs":
        return dq, None, d_score
    ds_buf = jnp.moveaxis(ds_buf, -1, 0)

    # Scatter-add each visited block's ds into [bb, hb, nq, nk, bq, bk]: summing over the batch
    # and head axes the bias was broadcast along comes for free from repeated indices.
    bb, hb = bias.shape[:2]
    units = arr.sizes[2]
    shape = (cf + cp, batch, kv_heads, units, nq, g)
    b_idx = np.arange(batch).reshape(1, -1, 1, 1, 1, 1) if bb == batch else np.zeros((1,) * 6, int)
    if hb == heads and heads > 1:
        head = (np.arange(kv_heads).reshape(1, 1, -1, 1, 1, 1) * group
                + np.arange(units).reshape(1, 1, 1, -1, 1, 1)
                + np.arange(g).reshape(1, 1, 1, 1, 1, -1))
    else:
        head = np.zeros((1,) * 6, int)
    i_idx = np.arange(nq).reshape(1, 1, 1, 1, -1, 1)
    j_idx = jnp.moveaxis(jnp.concatenate([fi, pi], axis=-1), -1, 0)[..., None]
    idx = tuple(jnp.broadcast_to(jnp.asarray(x), shape) for x in (b_idx, head, i_idx, j_idx))
    blocks = jnp.zeros((bb, hb, nq, nk, bq, bk), _F32).at[idx].add(ds_buf)
    dbias = jnp.swapaxes(blocks, 3, 4).reshape(bb, hb, nq * bq, nk * bk)
    return dq, dbias[:, :, :q_len, :kv_len], d_score


def _backward_dkv(cfg: _Config, q, k, v, bias, score, aux, d_out, lse, delta):
    """``dk [B, Hkv, Lk, D]``, ``dv [B, Hkv, Lk, Dv]`` float32, summed over each kv head's
    group, and, for a bias without a query axis (``[.., 1, Lk]``: `_bias_grad_kind` ``keys``),
    ``dbias`` in its shape (else ``None``)."""
    mask = eqx.combine(aux["mask"], cfg.mask)
    layout = mask.dkv
    pad_q, pad_kv = _padding_ids(mask, aux)
    batch, heads, q_len, _ = q.shape
    kv_heads, kv_len = k.shape[1:3]
    group = heads // kv_heads
    bq, bk = layout.block_q, layout.block_kv
    per_head = _per_head_layout(layout)
    fc, fi, pc, pi = (_lists_to_units(getattr(layout, name), group, per_head) for name in _T_LISTS)
    nk = fc.shape[3]
    arr = _arrange(cfg, aux, per_head, bias, q, k, bq, bk, nk, score)
    units, g = arr.sizes[2], (1 if per_head else group)
    q_side = _q_side_rows(q, d_out, lse, delta, bq, group, per_head)
    arrays = None if score is None else (*arr.score[1:], score[2])

    def run_list(arr, k_c, v_c, trips, count, index, masked, carry):
        def body(t, i, live, carry):
            dk, dv, keys = carry

            def logits(i, q_all, k_blk, bias_u, j, qs, ks):
                q_blk = _zero_padding(q_all[i], None if pad_q is None else qs, i, bq)
                k_blk = _zero_padding(k_blk, None if pad_kv is None else ks, j, bk)
                return _logits(cfg, q_blk, k_blk, _bias_block(bias_u, i, j, bq, bk))

            def grad(dv, s, i, live, v_blk, do_all, lse_all, delta_all, head, j, qp, kp, qs,
                     ks):
                v_blk = _zero_padding(v_blk, None if pad_kv is None else ks, j, bk)
                do_blk = do_all[i]
                s, tc = _capped(cfg, s)
                s, _ = _masked_scores(mask, s, head, i, j, masked, live, (qp, kp, qs, ks),
                                      (bq, bk))
                p = jnp.exp(s - lse_all[i][..., None])
                dv = dv + jnp.einsum("gqk,gqe->ke", p, do_blk.astype(_F32),
                                     preferred_element_type=_F32)
                dp = jnp.einsum("gqe,ke->gqk", do_blk, v_blk, preferred_element_type=_F32)
                return dv, _ds(p, dp, delta_all[i], tc)

            def accumulate(acc, ds, i, q_all, qs):
                dk, keys = acc
                q_blk = _zero_padding(q_all[i], None if pad_q is None else qs, i, bq)
                dk = dk + jnp.einsum("gqk,gqd->kd", ds, q_blk.astype(_F32),
                                     preferred_element_type=_F32)
                if keys is not None and ds.shape[0] > 1:  # a bias without a query axis
                    # Grouped query heads: each key's sum of ds as a product with ones, not a
                    # sum over axis 1: under the four levels that sum is a rank-7 reduction of
                    # a middle axis fused with the dp product, which jaxlib 0.10.2's CPU
                    # backend hands to YNNPACK, and with a dozen or more CPU threads it
                    # crashed the process (SIGSEGV). HIGHEST: a TPU's default precision would
                    # round ds to bf16. (Without groups the sum stays: the product's layout
                    # costs temporaries of a few L-sized arrays.)
                    keys = keys + jnp.einsum("gqk,q->gk", ds, jnp.ones(ds.shape[1], _F32),
                                             preferred_element_type=_F32,
                                             precision=jax.lax.Precision.HIGHEST)
                elif keys is not None:
                    keys = keys + jnp.sum(ds, axis=1)
                return dk, keys

            # Every q-side array is shared by all kv-blocks of a unit: a size-1 level.
            q_u, do_u, lse_u, delta_u = (
                _q_units(x, kv_heads, units, g, bq)[:, :, :, None] for x in q_side)
            k_b, v_b = (_kv_units(x, bk)[:, :, None] for x in (k_c, v_c))
            s = _map_levels(logits, arr.sizes, i, q_u, k_b, arr.bias, arr.blocks, *arr.data[2:])
            terms = _slot_terms(cfg, arr, i, arr.blocks, (bq, bk))
            if terms is not None:
                s, back = jax.vjp(lambda s: terms(s, arrays), s)
            dv, ds = _map_levels(grad, arr.sizes, dv, s, i, live, v_b, do_u, lse_u, delta_u,
                                 arr.heads, arr.blocks, *arr.data)
            if terms is not None:  # through the score terms (the dq pass sums their arrays')
                ds = back(ds)[0]
            dk, keys = _map_levels(accumulate, arr.sizes, (dk, keys), ds, i, q_u, arr.data[2])
            return dk, dv, keys

        return _slot_loop(trips, count, index, body, carry)

    def run_chunk(lists, rows, block_ids):
        (fc, fi, pc, pi), (k_c, v_c) = lists, rows
        arr_c = _in_chunk(arr, block_ids)
        lead = (batch, kv_heads, units, block_ids.shape[0], bk)
        keys = None
        if _bias_grad_kind(bias) == "keys":
            keys = jnp.zeros((batch, kv_heads, units, block_ids.shape[0], g, bk), _F32)
        carry = (jnp.zeros(lead + (k.shape[-1],), _F32), jnp.zeros(lead + (v.shape[-1],), _F32),
                 keys)
        carry = _carry_like(carry, q, k, v, bias, score, aux, d_out, lse, delta)
        carry = run_list(arr_c, k_c, v_c, cfg.dkv_trips[0], fc, fi, False, carry)
        dk, dv, keys = run_list(arr_c, k_c, v_c, cfg.dkv_trips[1], pc, pi, True, carry)
        return (_zero_padding_rows(dk, pad_kv, block_ids, bk),
                _zero_padding_rows(dv, pad_kv, block_ids, bk), keys)

    width = _chunk_width(arr.sizes, g * bq * bk, cfg.slot)  # G query heads of bq rows each
    k_r, v_r = _kv_rows(k, bk), _kv_rows(v, bk)
    dk, dv, keys = _by_chunks(run_chunk, nk, width, (fc, fi, pc, pi), (k_r, v_r), bk,
                              (q, k, v, bias, score, aux, d_out, lse, delta))
    # Sum the units (query heads with their own masks) of each kv head.
    dk = (dk.sum(axis=2) * cfg.scale).reshape(batch, kv_heads, nk * bk, -1)[:, :, :kv_len]
    dv = dv.sum(axis=2).reshape(batch, kv_heads, nk * bk, -1)[:, :, :kv_len]
    if keys is not None:
        keys = _summed_to(_units_to_rows(keys, kv_len, per_head)[:, :, None], bias.shape)
    return dk, dv, keys


# ------------------------------------------------------------------------------------------------
# The differentiable function, one per static configuration.


@functools.lru_cache(maxsize=128)
def _attention_fn(cfg: _Config, with_lse: bool = False):
    """A jitted `custom_vjp` function ``(q, k, v, bias, sinks, score, aux) -> out`` for `cfg`
    (``-> (out, lse)`` `with_lse`); `score` is ``(slopes, table, params)`` of the score terms
    (the function's params a pytree), or ``None``.

    `aux` carries the integer inputs (layouts, positions, segment ids) and the array leaves of
    the mask: never differentiated. Cached so that eager calls reuse one compilation.
    """

    # Differentiated, `custom_vjp` traces the primal and the forward rule, both of which run
    # the forward pass: as one jitted function, its second trace is a cache hit (the forward
    # is half of a call's trace time; a mask swap retraces it). JAX keys that cache on the
    # abstract mesh in context, which is unset when the primal is traced and set (empty) when
    # the rule is: naming the current one makes the two keys equal.
    jitted_forward = jax.jit(functools.partial(_forward, cfg))

    def forward(*args):
        with jax.sharding.use_abstract_mesh(jax.sharding.get_abstract_mesh()):
            return jitted_forward(*args)

    @jax.custom_vjp
    def attend(q, k, v, bias, sinks, score, aux):
        out, lse, _ = forward(q, k, v, bias, sinks, score, aux)
        out = out.astype(q.dtype)
        return (out, public_lse(lse, base2=False)) if with_lse else out

    def attend_fwd(q, k, v, bias, sinks, score, aux):
        out, lse, exact = forward(q, k, v, bias, sinks, score, aux)
        # The backward's delta = rowsum(dO * O) reads the float32 output of the float32
        # probabilities, those its dS recomputes (`_forward`): with O rounded to a half type,
        # or of p rounded to one, each row's dS no longer sums to zero.
        result = out.astype(q.dtype)
        result = (result, public_lse(lse, base2=False)) if with_lse else result
        return result, (q, k, v, bias, sinks, score, aux, out if exact is None else exact, lse)

    def attend_bwd(residuals, cotangent):
        q, k, v, bias, sinks, score, aux, out, lse = residuals
        d_out, d_lse = cotangent if with_lse else (cotangent, None)
        # The cotangent of a loss such as sum(out ** 2) or mean(out) is a fusion of the output
        # (or a broadcast): fused into the contraction below and the loops, XLA's CPU runtime
        # allocated full-length temporaries outside its buffer assignment (1.7 GB at 2^20).
        # The barrier makes it one buffer, as a cotangent passed in is.
        d_out = jax.lax.optimization_barrier(d_out)
        # delta = rowsum(dO * O) - dlse, the contract's contraction (a sum(dO * O) runs, on
        # the CPU, in a fusion with full-length temporaries outside XLA's buffer assignment).
        delta = backward_delta(d_out, out, d_lse, lse)
        d_out = d_out.astype(v.dtype)
        dq, dbias, dscore = _backward_dq(cfg, q, k, v, bias, score, aux, d_out, lse, delta)
        dk, dv, dbias_keys = _backward_dkv(cfg, q, k, v, bias, score, aux, d_out, lse, delta)
        dbias = dbias_keys if dbias is None else dbias
        dsinks = None
        if sinks is not None:
            # A sink joins the denominator with a zero value: d sink = -sum_rows p_sink * delta.
            p_sink = jnp.exp(sinks.astype(_F32)[None, :, None, :] - lse[..., None])
            dsinks = -jnp.einsum("bhqs,bhq->hs", p_sink, delta).astype(sinks.dtype)
        if dbias is not None:
            dbias = dbias.astype(bias.dtype)
        if score is not None:
            dscore = jax.tree.map(lambda x, d: d.astype(x.dtype), score, dscore)
        return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, dsinks,
                dscore, None)

    attend.defvjp(attend_fwd, attend_bwd)
    return jax.jit(attend)


def _static_trips(layout: BlockLayout, names: tuple[str, str]) -> tuple[_Trips, _Trips]:
    """Trip counts of two block lists, read at trace time when the layout is a constant."""
    out = []
    for name in names:
        count = getattr(layout, name)
        if not layout.is_static or isinstance(count, jax.core.Tracer):
            out.append(_Trips(None, False))
            continue
        count = np.asarray(count)
        n = int(count.max()) if count.size else 0
        out.append(_Trips(n, bool((count == n).all())))
    return tuple(out)


def _lists_only(mask: CompiledMask) -> CompiledMask:
    """`mask` with each layout's ``[mb, mh, nq, nk]`` class matrix reduced to its shape.

    The kernel walks the block lists; the class matrix grows with ``Lq x Lk`` (134 MB at
    L = 2^20 with 128 x 64 tiles) and would otherwise be an argument, or a constant, of the
    compiled function.
    """
    def shape_only(layout: BlockLayout) -> BlockLayout:
        c = layout.classes
        return eqx.tree_at(lambda x: x.classes, layout, jax.ShapeDtypeStruct(c.shape, c.dtype))

    return eqx.tree_at(lambda m: (m.forward, m.dq, m.dkv), mask,
                       tuple(shape_only(x) for x in (mask.forward, mask.dq, mask.dkv)))


class XlaConfig(AbstractKernelConfig):
    """`XlaBlockSparse`'s config: the block sizes of its forward, dq and dk/dv passes, and the
    size of one slot's work.

    The dk/dv blocks default to the forward ones, the dq blocks to the dk/dv ones. Blocks
    longer than a sequence shrink to it when the kernel runs (`XlaBlockSparse.adapt_tiling`).

    `slot_elements` bounds the scores one step of a pass's loop computes at once: every
    (batch, kv head, unit) at one slot of its block list, ``B x Hkv x U x blocks x G x bq x
    bk`` float32 elements (``[B, Hkv, U, blocks, G, bq, bk]``). Past it the blocks of a pass
    run in chunks of ``slot_elements // (B x Hkv x U x G x bq x bk)`` blocks (at least one),
    one after another, so each of the slot's temporaries (scores, probabilities, their
    gradients) holds at most that many elements: 4 bytes each, 16.8 MB at the default.
    ``None`` (the default) is ``2**22``, or ``2**21`` for a call inside a sharding's loop
    (`Features.in_loop`: `RingAttention`, in whose backward loop body XLA holds a slot's
    temporaries twice). A smaller slot lowers the peak memory and runs more, shorter loops.

    ```python
    tiling = kernels.XlaConfig(block_q=128, block_kv=64, block_q_dkv=128, block_kv_dkv=128)
    lean = kernels.XlaConfig(block_q=128, block_kv=128, slot_elements=2**20)  # 4.2 MB a score array
    ```
    """

    block_q: int = eqx.field(static=True)
    block_kv: int = eqx.field(static=True)
    block_q_dq: int | None = eqx.field(default=None, static=True)
    block_kv_dq: int | None = eqx.field(default=None, static=True)
    block_q_dkv: int | None = eqx.field(default=None, static=True)
    block_kv_dkv: int | None = eqx.field(default=None, static=True)
    slot_elements: int | None = eqx.field(default=None, static=True)

    forward_fields: ClassVar[tuple[str, ...]] = ("block_q", "block_kv")

    def __check_init__(self):
        check_fields(self)

    @property
    def blocks(self) -> PassBlocks:
        return chained_blocks(self.block_q, self.block_kv, (self.block_q_dq, self.block_kv_dq),
                              (self.block_q_dkv, self.block_kv_dkv))

    def explicit(self) -> "XlaConfig":
        """The same config with the dq and dk/dv blocks spelled out (the slot as it is)."""
        return XlaConfig.of_blocks(self.blocks, self.slot_elements)

    def text(self) -> str:
        """The blocks (`blocks_text`), and the slot where set: ``"... | slot 2^21"``."""
        text = blocks_text(self.blocks)
        slot = self.slot_elements
        if slot is None:
            return text
        power = slot.bit_length() - 1
        return f"{text} | slot {f'2^{power}' if slot == 1 << power else slot}"

    @classmethod
    def of_blocks(cls, blocks: PassBlocks, slot_elements: int | None = None) -> "XlaConfig":
        """The config that runs these `PassBlocks` (another config's `blocks`), with this
        `slot_elements`."""
        (bq, bk), (dq_q, dq_k), (kv_q, kv_k) = blocks
        return cls(block_q=bq, block_kv=bk, block_q_dq=dq_q, block_kv_dq=dq_k, block_q_dkv=kv_q,
                   block_kv_dkv=kv_k, slot_elements=slot_elements)

    @classmethod
    def heuristic(cls, features: Features) -> "XlaConfig":
        """128 x 128 tiles; on a CPU 128 x 64 forward tiles, 128 x 128 backward ones."""
        if features.platform == "cpu":
            # Measured on a 2-core CPU (B=1, H=4, L=4096-8192, D=64; causal and a 256 window):
            # 128 x 64 forward tiles waste the least of each partial block; the backward pass,
            # which does more work per block, prefers 128 x 128.
            return cls(block_q=128, block_kv=64, block_q_dkv=128, block_kv_dkv=128)
        return cls(block_q=128, block_kv=128)

    def clamped(self, features: Features) -> "XlaConfig":
        """Every block shrunk to its sequence (a longer one only pads it), spelled out."""
        lq, lk = features.q_len, features.kv_len
        blocks = PassBlocks(*((min(q, lq), min(k, lk)) for q, k in self.blocks))
        return XlaConfig.of_blocks(blocks, self.slot_elements)

    def candidates(self, features: Features) -> tuple["XlaConfig", ...]:
        """This config, then the forward, dk/dv and dq blocks in turn set to each of a few
        options (64 to 256), shrunk to the sequence; those that run alike are dropped."""
        options = ((128, 128), (128, 64), (64, 128), (256, 128), (64, 64), (128, 256))
        base = self.explicit()
        candidates = base.variants((("block_q", "block_kv"), options),
                                   (("block_q_dkv", "block_kv_dkv"), options),
                                   (("block_q_dq", "block_kv_dq"), options))
        return tuple(dict.fromkeys(t.clamped(features) for t in candidates))


class XlaBlockSparse(AbstractLseKernel, AbstractBroadcastBiasKernel):
    """Block-sparse flash attention in plain JAX: runs on every platform.

    For each q-block it visits only the kv-blocks its `BlockLayout` lists, with an online
    softmax in float32: FULL blocks skip the mask, PARTIAL blocks evaluate the element
    predicate (`CompiledMask.visible`) on their token indices. The backward pass is
    block-sparse too (a `jax.custom_vjp`): ``dq`` over q-blocks with the dq layout, ``dk``/``dv``
    over kv-blocks with the transposed lists of the dk/dv layout; it keeps only the output and
    the log-sum-exp, never the scores. Memory grows with the number of visited blocks, not with
    ``Lq x Lk`` (except a user-given bias that already is that size). A bias keeps its size-1
    axes (an `AbstractBroadcastBiasKernel`): a per-key ``[B, 1, 1, Lk]``, a per-query
    ``[B, H, Lq, 1]`` or a scalar bias, and its gradient, cost ``O(Lq + Lk)``.

    Every feature of `DenseReference`: GQA/MQA, ``Dv != D``, ``Lq != Lk``, ragged lengths,
    soft cap, sinks, bias, segment ids, positions, per-head masks. The selector's default on
    CPU (calls of at most 256 x 256 query-key pairs a head go to `DenseReference` there) and
    TPU, and the fallback on GPU. Block sizes larger than a sequence shrink to it.

    Shapes: ``query [B, H, Lq, D]``, ``key [B, Hkv, Lk, D]``, ``value [B, Hkv, Lk, Dv]`` ->
    ``[B, H, Lq, Dv]`` in the query dtype. Its config is `XlaConfig` (block sizes per pass).

    ```python
    attn = BlockSparseAttention(
        mask=mask,
        kernel=kernels.XlaBlockSparse(),
        tiling=kernels.XlaConfig(block_q=128, block_kv=128),
    )
    out = attn(q, k, v)
    ```
    """

    name: ClassVar[str] = "xla"
    zeroes_padding: ClassVar[bool] = True
    platforms: ClassVar[tuple[str, ...]] = ("cpu", "gpu", "tpu")
    reads: ClassVar[MaskReads] = "elements"
    config_type: ClassVar[type[AbstractKernelConfig]] = XlaConfig
    score_kinds: ClassVar[tuple[str, ...]] = ("alibi", "relative_bias", "function")

    @classmethod
    def priority(cls, platform):
        # Below the dedicated GPU kernels (20 and up); the default where none exists.
        return 5 if platform == "gpu" else 10

    def decline_reason(self, mask, features):
        return None  # every feature of DenseReference, every mask through `visible`

    def default_tiling(self, features: Features, mask) -> XlaConfig:
        return XlaConfig.heuristic(features)

    def adapt_tiling(self, tiling: AbstractKernelConfig, features: Features) -> XlaConfig:
        # Another kernel's config (or a `Tiling`) gives its blocks. A sharding's loop body holds
        # a slot's temporaries twice, so a slot left unset there is half the default
        # (docs/sharding.md has the measurements).
        slot = tiling.slot_elements if isinstance(tiling, XlaConfig) else None
        if slot is None and features.in_loop:
            slot = _SLOT_ELEMENTS // 2
        return XlaConfig.of_blocks(tiling.blocks, slot).clamped(features)

    def tiling_candidates(self, features: Features, mask):
        return tuple((t, None) for t in self.default_tiling(features, mask).candidates(features))

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        return self._run(query, key, value, mask, inputs, tiling, softmax_scale,
                         logits_soft_cap, False)

    def attention_with_lse(self, query, key, value, *, mask, inputs, features, tiling,
                           softmax_scale, logits_soft_cap):
        return self._run(query, key, value, mask, inputs, tiling, softmax_scale,
                         logits_soft_cap, True)

    def _run(self, query, key, value, mask, inputs, tiling, softmax_scale, logits_soft_cap,
             with_lse):
        terms = inputs.score
        score = None if terms is None else (*terms.arrays, terms.params)
        refuse_forward_mode(type(self).__name__, query, key, value, inputs.bias, inputs.sinks,
                            *jax.tree.leaves(score))
        data = (inputs.q_positions, inputs.kv_positions, inputs.q_segment_ids,
                inputs.kv_segment_ids)
        # The layouts of a static mask are NumPy-derived constants: their trip counts are known
        # at trace time.
        mask_arrays, mask_static = eqx.partition(_lists_only(mask), eqx.is_array)
        cfg = _Config(
            mask=mask_static,
            scale=float(softmax_scale),
            soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
            fwd_trips=_static_trips(mask.forward, ("full_count", "partial_count")),
            dq_trips=_static_trips(mask.dq, ("full_count", "partial_count")),
            dkv_trips=_static_trips(mask.dkv, ("t_full_count", "t_partial_count")),
            # The plan hands the kernel its own config (`adapt_tiling`); unset: the default.
            slot=(tiling.slot_elements if isinstance(tiling, XlaConfig) else None)
            or _SLOT_ELEMENTS,
            score=None if terms is None else terms.with_arrays(None, None, None),
        )
        aux = {"mask": mask_arrays, "data": data}
        # Inside `jax.shard_map`, a custom backward must give each input's cotangent that
        # input's type: type them alike here, so that autodiff sums the cotangents of inputs
        # shared by several devices (a bias broadcast over heads split across devices).
        diff_args = typed_like((query, key, value, inputs.bias, inputs.sinks, score), query, key,
                                value, inputs.bias, inputs.sinks, score)
        try:
            fn = _attention_fn(cfg, with_lse)
        except TypeError:  # an unhashable user mask: build the function afresh
            fn = _attention_fn.__wrapped__(cfg, with_lse)
        try:
            return fn(*diff_args, aux)
        except Exception as error:  # noqa: BLE001  (jax's class for it is private)
            if type(error).__name__ != "CustomVJPException":
                raise
            raise TypeError(
                "XlaBlockSparse: the score function or mask closes over an array that is being "
                "differentiated; pass it as `params` (scores.ScoreFunction(fn, params)) so "
                "that it gets its gradient.") from None
