"""`BlockLayout`: the sparse block metadata every kernel reads, built once per call (or trace)."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from ._inputs import check_token_range
from ._mask import EMPTY, FULL, PARTIAL, AbstractMask, BlockCoords, TokenCoords

_BIG = np.iinfo(np.int32).max // 2
#: Block pairs per chunk of q-block rows (or kv-block columns) in `build_layout`'s loops.
_CHUNK_PAIRS = 1 << 22
#: The widest rows `_jnp_lists` lists by a sort rather than a scatter.
_SORT_LISTS = 64
_RANGE_FIELDS = ("index_lo", "index_hi", "pos_lo", "pos_hi", "seg_lo", "seg_hi")


class BlockLayout(eqx.Module):
    """Which kv-blocks each q-block visits, and how: the contract between masks and kernels.

    Leading axes ``[mb, mh]`` are ``[1 or batch, 1 or heads]``: a mask that depends on neither
    data nor head has one layout for all. For q-block ``i`` of batch ``b`` and head ``h``,
    ``full_index[b, h, i, :full_count[b, h, i]]`` are the kv-blocks every pair of which attends
    (no masking needed) and ``partial_index[..., :partial_count]`` those where the kernel must
    evaluate the mask. Both lists are sorted; entries past the count are 0. The ``t_*`` arrays
    are the same lists transposed (per kv-block, its q-blocks), for the dk/dv backward pass.

    ``bitmaps`` (``[n, block_q, block_kv]`` bool, deduplicated, out-of-bounds pairs False) with
    ``bitmap_index`` / ``t_bitmap_index`` (aligned with the partial lists) are present only when
    asked for with ``with_bitmaps=True``, for kernels that cannot evaluate the mask themselves.

    ``classes`` keeps the whole ``[mb, mh, nq, nk]`` int8 block matrix (EMPTY 0, PARTIAL 1,
    FULL 2): ``O(blocks)`` memory, used for statistics and plots.
    """

    classes: Int[Array, "mb mh nq nk"]
    full_count: Int[Array, "mb mh nq"]
    full_index: Int[Array, "mb mh nq cf"]
    partial_count: Int[Array, "mb mh nq"]
    partial_index: Int[Array, "mb mh nq cp"]
    t_full_count: Int[Array, "mb mh nk"]
    t_full_index: Int[Array, "mb mh nk tf"]
    t_partial_count: Int[Array, "mb mh nk"]
    t_partial_index: Int[Array, "mb mh nk tp"]
    bitmaps: Bool[Array, "n bq bk"] | None
    bitmap_index: Int[Array, "mb mh nq cp"] | None
    t_bitmap_index: Int[Array, "mb mh nk tp"] | None
    q_len: int = eqx.field(static=True)
    kv_len: int = eqx.field(static=True)
    block_q: int = eqx.field(static=True)
    block_kv: int = eqx.field(static=True)
    #: True when built at trace time from the mask alone (no per-call data): the counts are
    #: exact and the capacities are the true maxima.
    is_static: bool = eqx.field(static=True)

    @property
    def num_q_blocks(self) -> int:
        return self.classes.shape[-2]

    @property
    def num_kv_blocks(self) -> int:
        return self.classes.shape[-1]

    def density(self) -> Array:
        """Fraction of blocks that are not EMPTY, over all of ``[mb, mh, nq, nk]``."""
        return jnp.mean(self.classes != EMPTY)

    def visited_pairs(self) -> Array:
        """Number of (query, key) pairs inside visited blocks, summed over ``[mb, mh]``."""
        bq = jnp.asarray(_block_lengths(self.q_len, self.block_q))
        bk = jnp.asarray(_block_lengths(self.kv_len, self.block_kv))
        sizes = bq[:, None] * bk[None, :]
        return jnp.sum(jnp.where(self.classes != EMPTY, sizes, 0))


def carries_arrays(mask: AbstractMask) -> bool:
    """Whether the mask holds per-call arrays (e.g. `ArrayMask`): its layouts are then built on
    the device, like those of segment ids."""
    return any(eqx.is_array(leaf) for leaf in jax.tree_util.tree_leaves(mask))


def _block_lengths(length: int, block: int) -> np.ndarray:
    n = math.ceil(length / block)
    starts = np.arange(n) * block
    return (np.minimum(starts + block, length) - starts).astype(np.int32)


def _pad_to_blocks(x: Array, block: int, fill: int) -> Array:
    """[B, L] -> [B, n, block], padding the tail with `fill`."""
    b, length = x.shape
    n = math.ceil(length / block)
    x = jnp.pad(x, ((0, 0), (0, n * block - length)), constant_values=fill)
    return x.reshape(b, n, block)


def _range_per_block(x: Array | None, block: int) -> tuple[Array, Array] | tuple[None, None]:
    if x is None:
        return None, None
    lo = _pad_to_blocks(x, block, _BIG).min(-1)
    hi = _pad_to_blocks(x, block, -_BIG).max(-1)
    return lo, hi


def block_coords(
    length: int,
    block: int,
    positions: Int[Array, "b l"] | None,
    segments: Int[Array, "b l"] | None,
    axis: int,
) -> BlockCoords:
    """Per-block coordinate ranges of one side; `axis` -2 for queries, -1 for keys.

    Returned arrays have shape ``[mb, n, 1]`` (queries) or ``[mb, 1, n]`` (keys).
    """
    n = math.ceil(length / block)
    index_lo = np.arange(n, dtype=np.int32) * block
    index_hi = (np.minimum(index_lo + block, length) - 1).astype(np.int32)
    pos_lo, pos_hi = _range_per_block(positions, block)
    seg_lo, seg_hi = _range_per_block(segments, block)

    def place(x):
        if x is None:
            return None
        xp = np if isinstance(x, np.ndarray) else jnp
        x = xp.asarray(x)
        if x.ndim == 1:
            x = x[None]
        return _on_device(xp.expand_dims(x, -1 if axis == -2 else -2))

    return BlockCoords(
        index_lo=place(index_lo),
        index_hi=place(index_hi),
        pos_lo=place(index_lo if pos_lo is None else pos_lo),
        pos_hi=place(index_hi if pos_hi is None else pos_hi),
        seg_lo=place(seg_lo),
        seg_hi=place(seg_hi),
        length=length,
        block_size=block,
        positions_are_indices=positions is None,
    )


def _on_device(x):
    """`x` as a JAX array: a NumPy one by a transfer alone (`jnp.asarray` of a NumPy array
    compiles a program per shape while a static layout is built), else `jnp.asarray`."""
    return jax.device_put(x) if isinstance(x, np.ndarray) else jnp.asarray(x)


def _q_rows(coords: BlockCoords, start, size: int) -> BlockCoords:
    """The query-side `coords` of the `size` q-blocks from `start` (an int, or a traced int32)
    only (arrays ``[mb, size, 1]``)."""
    fields = [f for f in _RANGE_FIELDS if getattr(coords, f) is not None]
    return eqx.tree_at(
        lambda c: [getattr(c, f) for f in fields], coords,
        [jax.lax.dynamic_slice_in_dim(getattr(coords, f), start, size, axis=-2)
         for f in fields])


def _row_blocks(mask: AbstractMask, q_coords: BlockCoords, kv_coords: BlockCoords, head: int,
                start, size: int):
    """`mask.blocks` of the `size` q-blocks from `start` against every kv-block."""
    return mask.blocks(_q_rows(q_coords, start, size), kv_coords, head)


# A static mask's blocks are classified at trace time, on concrete coordinates. Jitted, that is
# one compiled program per (mask, head, shapes, chunk height), reused by every chunk of rows;
# run op by op, each `jnp` operation in `blocks` compiled on its own for each new shape.
_row_blocks_jit = eqx.filter_jit(_row_blocks)


def token_coords(
    index: Array, positions: Array | None, segments: Array | None, length: int
) -> TokenCoords:
    """Element coordinates for token indices `index` (any shape; out-of-range indices clip).

    `positions`/`segments` are one batch element's ``[L]`` arrays or ``None``.
    """
    safe = jnp.clip(index, 0, length - 1)
    return TokenCoords(
        index=index,
        position=index if positions is None else positions[safe],
        segment=None if segments is None else segments[safe],
        length=length,
    )


def element_mask(
    mask: AbstractMask,
    head,
    q_index: Array,
    k_index: Array,
    *,
    q_len: int,
    kv_len: int,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
) -> Bool[Array, "..."]:
    """Evaluate `mask`, resolved against the lengths (`resolve_mask`), on broadcastable token
    indices, with out-of-bounds keys hidden: the one element predicate, which kernels read
    through `CompiledMask.visible`.

    Per-call arrays are one batch element's (``[L]``); segment ids are read only by a mask
    that uses them.
    """
    qc = token_coords(q_index, q_positions, q_segment_ids, q_len)
    kc = token_coords(k_index, kv_positions, kv_segment_ids, kv_len)
    in_bounds = (k_index < kv_len) & (k_index >= 0) & (q_index < q_len)
    return mask.elements(qc, kc, head) & in_bounds


def _classes_by_elements(mask, head, *, q_len, kv_len, block_q, block_kv, data):
    """Classify blocks by evaluating the element predicate one q-block at a time."""
    nq = math.ceil(q_len / block_q)
    nk = math.ceil(kv_len / block_kv)
    k_index = jnp.arange(nk * block_kv, dtype=jnp.int32)
    k_valid = (k_index < kv_len).reshape(nk, block_kv)

    def one_batch(qp, kp, qs, ks):
        def one_q_block(i):
            q_index = i * block_q + jnp.arange(block_q, dtype=jnp.int32)
            vis = element_mask(
                mask, head, q_index[:, None], k_index[None, :],
                q_len=q_len, kv_len=kv_len, q_positions=qp, kv_positions=kp,
                q_segment_ids=qs, kv_segment_ids=ks,
            ).reshape(block_q, nk, block_kv)
            valid = (q_index < q_len)[:, None, None] & k_valid[None]
            any_vis = jnp.any(vis & valid, axis=(0, 2))
            all_vis = jnp.all(vis | ~valid, axis=(0, 2))
            return jnp.where(all_vis, FULL, jnp.where(any_vis, PARTIAL, EMPTY)).astype(jnp.int8)

        return jax.lax.map(one_q_block, jnp.arange(nq, dtype=jnp.int32))

    arrays = [data[name] for name in ("qp", "kp", "qs", "ks")]
    batched = [a is not None for a in arrays]
    if not any(batched):
        return one_batch(None, None, None, None)[None]
    in_axes = tuple(0 if b else None for b in batched)
    return jax.vmap(one_batch, in_axes=in_axes)(*arrays)


# Jitted once per (mask, head, lengths, blocks): an eager call with a static mask then reuses
# the compiled classification instead of tracing a fresh `lax.map` body every call.
_classes_by_elements_jit = eqx.filter_jit(_classes_by_elements)


def _chunks(n: int, width: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges covering ``range(n)``, each of at most ``_CHUNK_PAIRS / width``
    rows (one at least): the transient of a chunk of ``width``-long rows stays bounded."""
    step = max(1, _CHUNK_PAIRS // max(width, 1))
    return [(start, min(start + step, n)) for start in range(0, n, step)]


def _np_lists(flags: np.ndarray, capacity: int) -> np.ndarray:
    """Sorted indices of the True entries along the last axis, padded with 0 to `capacity`.

    Sparse rows: `np.nonzero` lists the entries row by row in ascending order, and each
    entry's slot is its rank inside its row. Dense rows: a stable sort of "not flag" (a radix
    sort for booleans) puts the True entries first, in order.
    """
    rows = flags.reshape(-1, flags.shape[-1])
    if np.count_nonzero(rows) * 16 > rows.size:
        order = np.argsort(~rows, axis=-1, kind="stable")[:, :capacity]  # capacity <= n
        live = np.arange(capacity) < rows.sum(-1)[:, None]
        out = np.where(live, order, 0).astype(np.int32)
    else:
        r, c = np.nonzero(rows)
        counts = np.bincount(r, minlength=rows.shape[0])
        slot = np.arange(r.size) - (np.cumsum(counts) - counts)[r]
        out = np.zeros((rows.shape[0], capacity), np.int32)
        out[r, slot] = c
    return out.reshape(flags.shape[:-1] + (capacity,))


def _jnp_lists(classes: Array, flag: int, capacity: int, *, by_column: bool
               ) -> tuple[Array, Array]:
    """`_np_lists` of the `flag` entries of each row (each column, `by_column`) of a possibly
    traced ``[..., nq, nk]`` class matrix, in `jax.numpy`: counts ``[..., n]`` and indices
    ``[..., n, capacity]`` int32.

    Rows of at most ``_SORT_LISTS`` columns (32k tokens in 512-token blocks) are listed by a
    stable sort of "not an entry" with the column as payload, which puts the row's entries
    first, in order: on a TPU v5e that took a per-head `Predicate`'s call at 32k tokens from
    6.87 / 21.77 ms (forward / forward+backward) to 6.22 / 20.80 (on a CPU the sort costs
    more, 12 ms against 2 ms there). Wider rows scatter each entry to its rank. A loop over
    chunks of at most ``_CHUNK_PAIRS`` entries keeps the temporaries bounded. The counts are
    exact; a row with more entries than `capacity` would lose blocks, so the call then stops
    with an error, never a wrong answer.
    """
    *lead, nq, nk = classes.shape
    n, width = (nk, nq) if by_column else (nq, nk)
    rows = min(n, max(1, _CHUNK_PAIRS // width))
    # `zeros_like` keeps the mesh axes `classes` varies over (a loop carry inside shard_map).
    count = jnp.zeros_like(classes, dtype=jnp.int32, shape=(*lead, n))
    index = jnp.zeros_like(classes, dtype=jnp.int32, shape=(*lead, n, capacity))

    def chunk(step, carry):
        count, index = carry
        start = jnp.minimum(step * rows, n - rows)  # the last chunk may overlap the one before
        if by_column:
            part = jnp.swapaxes(jax.lax.dynamic_slice_in_dim(classes, start, rows, -1), -1, -2)
        else:
            part = jax.lax.dynamic_slice_in_dim(classes, start, rows, -2)
        hits = (part == flag).reshape(-1, width)
        column = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), hits.shape)
        total = jnp.sum(hits, axis=-1, dtype=jnp.int32)
        if width <= _SORT_LISTS:
            _, order = jax.lax.sort((jnp.logical_not(hits).astype(jnp.int32), column),
                                    num_keys=1, is_stable=True)
            lists = jnp.where(jnp.arange(capacity, dtype=jnp.int32) < total[:, None],
                              order[:, :capacity], 0)
        else:
            # A hit goes to its rank in the row; every other entry to a slot past the end of
            # its own (`capacity + column`), which the scatter drops: each index is unique, as
            # the scatter is told.
            slot = jnp.where(hits, jnp.cumsum(hits, axis=-1, dtype=jnp.int32) - 1,
                             capacity + column)
            which = jnp.arange(hits.shape[0], dtype=jnp.int32)[:, None]
            lists = jnp.zeros((hits.shape[0], capacity), jnp.int32).at[which, slot].set(
                column, mode="drop", unique_indices=True)
        counts = total.reshape(*lead, rows)
        count = jax.lax.dynamic_update_slice_in_dim(count, counts, start, -1)
        index = jax.lax.dynamic_update_slice_in_dim(
            index, lists.reshape(*lead, rows, capacity), start, -2)
        return count, index

    count, index = jax.lax.fori_loop(0, math.ceil(n / rows), chunk, (count, index))
    if capacity < width:
        index = eqx.error_if(
            index, jnp.max(count) > capacity,
            "eqx_bsattn: a block layout built on the device lists more blocks in one row than "
            "the capacity its mask's static part allows (the mask's `blocks` is not "
            "conservative for the widest segment ids); no block is dropped.")
    return count, index


def _capacities(capacity: tuple[int, int] | None, nq: int, nk: int) -> tuple[int, int]:
    """(per q-block row, per kv-block column) list capacities: `capacity` or every block."""
    rows, cols = (nk, nq) if capacity is None else capacity
    return max(1, min(rows, nk)), max(1, min(cols, nq))


def _lists_from_classes(classes, *, exact: bool,
                        capacity: tuple[int, int] | None = None) -> tuple:
    """The eight block lists of a ``[..., nq, nk]`` class matrix, in `BlockLayout` order.

    `exact` (a NumPy `classes`): capacities are the longest list (at least 1), computed in
    chunks of rows and columns so that no temporary is the size of `classes` (only the int8
    matrix itself is). Otherwise (`jax.numpy`, possibly traced): `capacity` (visited blocks
    per q-block row, per kv-block column; a run that needs more raises), else every block.
    """
    if not exact:
        rows, cols = _capacities(capacity, *classes.shape[-2:])
        return tuple(x for flag, cap, by_column in ((FULL, rows, False), (PARTIAL, rows, False),
                                                   (FULL, cols, True), (PARTIAL, cols, True))
                     for x in _jnp_lists(classes, flag, cap, by_column=by_column))
    *lead, nq, nk = classes.shape
    counts = {key: np.zeros((*lead, n), np.int32) for key, n in
              (("full", nq), ("partial", nq), ("t_full", nk), ("t_partial", nk))}
    for start, stop in _chunks(nq, nk):
        part = classes[..., start:stop, :]
        for name, flag in (("full", FULL), ("partial", PARTIAL)):
            hits = part == flag
            counts[name][..., start:stop] = hits.sum(-1)
            counts["t_" + name] += hits.sum(-2, dtype=np.int32)
    lists = {}
    for name, flag in (("full", FULL), ("partial", PARTIAL)):
        for key, n, width, take in ((name, nq, nk, lambda a, b: classes[..., a:b, :]),
                                    ("t_" + name, nk, nq,
                                     lambda a, b: np.swapaxes(classes[..., a:b], -1, -2))):
            capacity = max(int(counts[key].max()) if counts[key].size else 0, 1)
            index = np.zeros((*lead, n, capacity), np.int32)
            for start, stop in _chunks(n, width):
                index[..., start:stop, :] = _np_lists(take(start, stop) == flag, capacity)
            lists[key] = index
    return tuple(x for name in ("full", "partial", "t_full", "t_partial")
                 for x in (counts[name], lists[name]))


def _any_segments(coords: BlockCoords) -> BlockCoords:
    """`coords` whose blocks may hold every segment id (``[-2**31, 2**31 - 1]``)."""
    lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    return eqx.tree_at(lambda c: (c.seg_lo, c.seg_hi), coords,
                       (np.full(coords.index_lo.shape, lo, np.int32),
                        np.full(coords.index_lo.shape, hi, np.int32)),
                       is_leaf=lambda x: x is None)


def static_capacity(mask: AbstractMask, *, q_len: int, kv_len: int, num_heads: int,
                    block_q: int, block_kv: int) -> tuple[int, int] | None:
    """The most blocks a q-block row and a kv-block column can visit whatever the segment ids:
    the list capacities of a layout built on the device, from the mask's static part.

    `mask` (resolved) is classified at trace time with every block's segment range widened to
    all ids, so a term such as a window or causal offset bounds the lists and a `Document`
    term leaves every block it meets possible. ``None`` (every block) where no such bound is
    known at trace time: a mask array, or a mask that classifies only by elements. (Per-call
    positions leave window and causal terms unbounded; `build_layout` then passes none.)

    ```python
    static_capacity(masks.Causal() & masks.SlidingWindow(256, 0) & masks.Document(),
                    q_len=4096, kv_len=4096, num_heads=1, block_q=128, block_kv=64)  # (6, 3)
    ```
    """
    if carries_arrays(mask) or not mask.classifies_blocks:
        return None
    nq, nk = math.ceil(q_len / block_q), math.ceil(kv_len / block_kv)
    with jax.ensure_compile_time_eval():
        qc = _any_segments(block_coords(q_len, block_q, None, None, axis=-2))
        kc = _any_segments(block_coords(kv_len, block_kv, None, None, axis=-1))
        rows, cols = 0, np.zeros((nk,), np.int64)
        for h in range(num_heads if mask.head_dependent else 1):
            per_col = np.zeros((nk,), np.int64)
            for start, stop in _chunks(nq, nk):
                seen = np.asarray(_row_blocks_jit(mask, qc, kc, h, np.int32(start),
                                                  stop - start)) != EMPTY
                seen = np.broadcast_to(seen, (1, stop - start, nk))[0]
                rows = max(rows, int(seen.sum(-1).max()))
                per_col += seen.sum(0)
            cols = np.maximum(cols, per_col)
    return max(rows, 1), max(int(cols.max()), 1)


def _bitmaps(mask, partial_index, partial_count, t_partial_index, t_partial_count,
             *, q_len, kv_len, block_q, block_kv):
    """Element bitmaps of every partial block (static layouts only), deduplicated."""
    mb, mh, nq = partial_index.shape[:3]
    blocks = []  # (b, h, i, j)
    for b in range(mb):
        for h in range(mh):
            for i in range(nq):
                for s in range(int(partial_count[b, h, i])):
                    blocks.append((b, h, i, int(partial_index[b, h, i, s])))
    table = {}
    maps = []
    ids = np.zeros((len(blocks),), np.int32)
    qi = np.arange(block_q, dtype=np.int32)
    kj = np.arange(block_kv, dtype=np.int32)
    chunk = max(1, (1 << 22) // (block_q * block_kv))
    for start in range(0, len(blocks), chunk):
        part = blocks[start:start + chunk]
        by_head = {}
        for n, (_, h, i, j) in enumerate(part):
            by_head.setdefault(h, []).append((n, i, j))
        out = np.zeros((len(part), block_q, block_kv), bool)
        for h, items in by_head.items():
            rows = np.array([i for _, i, _ in items], np.int32)
            cols = np.array([j for _, _, j in items], np.int32)
            qidx = rows[:, None, None] * block_q + qi[None, :, None]
            kidx = cols[:, None, None] * block_kv + kj[None, None, :]
            with jax.ensure_compile_time_eval():
                vis = np.asarray(element_mask(mask, h, jnp.asarray(qidx), jnp.asarray(kidx),
                                              q_len=q_len, kv_len=kv_len))
            vis = np.broadcast_to(vis, (len(items), block_q, block_kv))
            out[[n for n, _, _ in items]] = vis
        for n in range(len(part)):
            key = np.packbits(out[n]).tobytes()
            if key not in table:
                table[key] = len(maps)
                maps.append(out[n])
            ids[start + n] = table[key]
    bitmaps = np.stack(maps) if maps else np.zeros((1, block_q, block_kv), bool)
    lookup = {blk: int(ids[n]) for n, blk in enumerate(blocks)}
    bitmap_index = np.zeros(partial_index.shape, np.int32)
    for b in range(mb):
        for h in range(mh):
            for i in range(nq):
                for s in range(int(partial_count[b, h, i])):
                    bitmap_index[b, h, i, s] = lookup[(b, h, i, int(partial_index[b, h, i, s]))]
    t_bitmap_index = np.zeros(t_partial_index.shape, np.int32)
    for b in range(mb):
        for h in range(mh):
            for j in range(t_partial_index.shape[2]):
                for s in range(int(t_partial_count[b, h, j])):
                    i = int(t_partial_index[b, h, j, s])
                    t_bitmap_index[b, h, j, s] = lookup[(b, h, i, j)]
    return bitmaps, bitmap_index, t_bitmap_index


def _per_call(name: str, x, length: int) -> Array | None:
    """Per-call data for `build_layout`: ``[L]`` or ``[B, L]`` integers, as ``[B or 1, L]``."""
    if x is None:
        return None
    if not isinstance(x, jax.Array):
        try:
            x = np.asarray(x)  # NumPy until range-checked: jnp.asarray would narrow int64
        except (TypeError, ValueError, OverflowError):
            raise TypeError(f"`{name}` must be an integer array; got {type(x).__name__}.") from None
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"`{name}` must hold integers; got dtype {np.dtype(x.dtype).name}.")
    if x.ndim not in (1, 2) or x.shape[-1] != length:
        raise ValueError(f"`{name}` must have shape [{length}] or [batch, {length}]; got "
                         f"{tuple(x.shape)}.")
    x = check_token_range(name, x)
    return (x[None] if x.ndim == 1 else x).astype(jnp.int32)


def build_layout(
    mask: AbstractMask,
    *,
    q_len: int,
    kv_len: int,
    num_heads: int,
    block_q: int,
    block_kv: int,
    q_positions: Int[Array, "b lq"] | None = None,
    kv_positions: Int[Array, "b lk"] | None = None,
    q_segment_ids: Int[Array, "b lq"] | None = None,
    kv_segment_ids: Int[Array, "b lk"] | None = None,
    with_bitmaps: bool = False,
) -> BlockLayout:
    """Classify every (q-block, kv-block) pair of `mask` and list the visited ones.

    Without per-call data the layout is computed at trace time (NumPy constants, exact
    capacities). With positions or segment ids it is computed on the device inside `jit` with a
    fixed capacity, so new data never recompiles: with segment ids alone, the most blocks a
    row (a column) can visit whatever the ids (`static_capacity`: a window or causal term
    bounds it); with positions, a mask array or an element-only mask, every block. A run
    whose lists would not fit stops with an error; no block is ever dropped.

    Memory: the int8 class matrix ``[mb, mh, nq, nk]`` (a field) is the only array of that
    size: `blocks` runs on chunks of q-block rows, and the lists are gathered from the matrix
    in chunks of rows and columns, so temporaries stay bounded. (Per-call lists without a
    static bound have every block's capacity, so they are that size themselves.)

    ```python
    layout = build_layout(masks.Causal(), q_len=4096, kv_len=4096, num_heads=8,
                          block_q=128, block_kv=128)
    layout.density()   # ~0.5
    ```
    """
    if not isinstance(mask, AbstractMask):
        raise TypeError(f"`mask` must be an AbstractMask; got {type(mask).__name__}.")
    for name, value in (("q_len", q_len), ("kv_len", kv_len), ("num_heads", num_heads),
                        ("block_q", block_q), ("block_kv", block_kv)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
            what = "block sizes must be positive ints" if name.startswith("block") else (
                f"`{name}` must be a positive int")
            raise ValueError(f"{what}; got `{name}`={value!r}.")
    q_len, kv_len, num_heads, block_q, block_kv = map(int, (q_len, kv_len, num_heads, block_q,
                                                           block_kv))
    q_positions, q_segment_ids = (_per_call("q_positions", q_positions, q_len),
                                  _per_call("q_segment_ids", q_segment_ids, q_len))
    kv_positions, kv_segment_ids = (_per_call("kv_positions", kv_positions, kv_len),
                                    _per_call("kv_segment_ids", kv_segment_ids, kv_len))
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("pass both `q_segment_ids` and `kv_segment_ids`, or neither.")
    mask.check(q_len, kv_len, num_heads)
    mask, data = resolve_mask(mask, q_len, kv_len, q_positions=q_positions,
                              kv_positions=kv_positions, q_segment_ids=q_segment_ids,
                              kv_segment_ids=kv_segment_ids)
    return layout_of_resolved(mask, q_len=q_len, kv_len=kv_len, num_heads=num_heads,
                              block_q=block_q, block_kv=block_kv, with_bitmaps=with_bitmaps,
                              **data)


def resolve_mask(mask: AbstractMask, q_len: int, kv_len: int,
                 **data) -> tuple[AbstractMask, dict]:
    """`mask` resolved against the lengths (e.g. bottom-right causal needs them), and the
    per-call `data` (``q_positions``, ..., ``kv_segment_ids``) without the segment ids when
    the mask does not read them (its layouts are then static). `ResolvedMask` and
    `build_layout` resolve through this, once per call."""
    mask = mask.resolve(q_len, kv_len)
    if not mask.uses_segment_ids:
        data = {**data, "q_segment_ids": None, "kv_segment_ids": None}
    return mask, data


def layout_of_resolved(mask: AbstractMask, *, q_len: int, kv_len: int, num_heads: int,
                       block_q: int, block_kv: int, q_positions=None, kv_positions=None,
                       q_segment_ids=None, kv_segment_ids=None,
                       with_bitmaps: bool = False) -> BlockLayout:
    """`build_layout` of a mask that `resolve_mask` resolved, with checked per-call data
    (``[B or 1, L]`` int32 or ``None``): nothing is checked or resolved again."""
    dynamic = carries_arrays(mask) or any(
        x is not None for x in (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    )
    if with_bitmaps and dynamic:
        raise ValueError(
            "element bitmaps need a static mask; this call passes positions, segment ids or a "
            "mask array."
        )
    per_call = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    if dynamic and not any(isinstance(x, jax.core.Tracer)
                           for x in (*per_call, *jax.tree.leaves(mask))):
        # Built outside a trace (an eager call, `plan`): one compiled program for the layout
        # rather than each of its `jnp` operations compiled on its own.
        return _layout_of_resolved_jit(
            mask, q_len=q_len, kv_len=kv_len, num_heads=num_heads, block_q=block_q,
            block_kv=block_kv, q_positions=q_positions, kv_positions=kv_positions,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    mh = num_heads if mask.head_dependent else 1
    nq = math.ceil(q_len / block_q)
    nk = math.ceil(kv_len / block_kv)
    data = {"qp": q_positions, "kp": kv_positions, "qs": q_segment_ids, "ks": kv_segment_ids}

    def element_classes():
        per_head = [_classes_by_elements_jit(mask, h, q_len=q_len, kv_len=kv_len,
                                             block_q=block_q, block_kv=block_kv, data=data)
                    for h in range(mh)]
        mb = max(c.shape[0] for c in per_head)
        xp = jnp if dynamic else np  # a static mask's classes on the host: no op compiled
        return xp.stack([xp.broadcast_to(xp.asarray(c), (mb, nq, nk)) for c in per_head],
                        axis=1)

    qc = block_coords(q_len, block_q, q_positions, q_segment_ids, axis=-2)
    kc = block_coords(kv_len, block_kv, kv_positions, kv_segment_ids, axis=-1)

    def row_classes(start, stop):
        """[mb, mh, stop - start, nk] int8: the classes of q-blocks ``start:stop``."""
        # Traced with the call's data, or (static) one compiled program per chunk height.
        blocks = _row_blocks if dynamic else _row_blocks_jit
        per_head = [blocks(mask, qc, kc, h, np.int32(start), stop - start) for h in range(mh)]
        mb = max(c.shape[0] if c.ndim == 3 else 1 for c in per_head)
        shape = (mb, stop - start, nk)
        xp = jnp if dynamic else np
        return ragged(xp.stack([xp.broadcast_to(xp.asarray(c), shape) for c in per_head], 1))

    def range_classes():
        """[mb, mh, nq, nk] int8 from the blocks' ranges of positions, where the mask
        classifies them so (a `Predicate`'s `range_classes`, conservative), else ``None``: a
        call's classes then cost a few operations per block pair rather than per token pair."""
        by_ranges = getattr(mask, "range_classes", None)
        if by_ranges is None:
            return None
        parts = []
        for start, stop in _chunks(nq, nk):
            per_head = [by_ranges(_q_rows(qc, np.int32(start), stop - start), kc, h)
                        for h in range(mh)]
            if any(c is None for c in per_head):
                return None
            mb = max(c.shape[0] if c.ndim == 3 else 1 for c in per_head)
            parts.append(jnp.stack([jnp.broadcast_to(c, (mb, stop - start, nk))
                                    for c in per_head], 1))
        return jnp.concatenate(parts, axis=-2)

    def ragged(classes):
        if not dynamic:
            classes = np.array(classes, np.int8)
            if kv_len % block_kv:
                classes[..., -1] = np.minimum(classes[..., -1], PARTIAL)
            return classes
        classes = classes.astype(jnp.int8)
        if kv_len % block_kv:
            # The ragged last kv-block must bound-check its keys, so it is never FULL.
            classes = classes.at[..., -1].set(jnp.minimum(classes[..., -1], PARTIAL))
        return classes

    # The class matrix is built a chunk of q-block rows at a time, so that the temporaries of
    # `blocks` (int32 and bool comparisons) stay bounded; only the int8 result is whole.
    if not dynamic:
        with jax.ensure_compile_time_eval():
            if mask.classifies_blocks:
                classes = None
                for start, stop in _chunks(nq, nk):
                    part = np.asarray(row_classes(start, stop))
                    if classes is None:
                        classes = np.empty(part.shape[:2] + (nq, nk), np.int8)
                    classes[..., start:stop, :] = part
            else:
                classes = np.asarray(ragged(element_classes()))
    elif mask.classifies_blocks:
        classes = jnp.concatenate([row_classes(*rows) for rows in _chunks(nq, nk)], axis=-2)
    else:
        classes = range_classes()
        classes = ragged(element_classes() if classes is None else classes)
    capacity = None
    if dynamic and q_positions is None and kv_positions is None:
        capacity = static_capacity(mask, q_len=q_len, kv_len=kv_len, num_heads=mh,
                                   block_q=block_q, block_kv=block_kv)
    (full_count, full_index, partial_count, partial_index, t_full_count, t_full_index,
     t_partial_count, t_partial_index) = _lists_from_classes(classes, exact=not dynamic,
                                                             capacity=capacity)

    bitmaps = bitmap_index = t_bitmap_index = None
    if with_bitmaps:
        bitmaps, bitmap_index, t_bitmap_index = _bitmaps(
            mask, partial_index, partial_count, t_partial_index, t_partial_count,
            q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv,
        )
        bitmaps, bitmap_index, t_bitmap_index = map(
            _on_device, (bitmaps, bitmap_index, t_bitmap_index)
        )

    return BlockLayout(
        classes=_on_device(classes),
        full_count=_on_device(full_count),
        full_index=_on_device(full_index),
        partial_count=_on_device(partial_count),
        partial_index=_on_device(partial_index),
        t_full_count=_on_device(t_full_count),
        t_full_index=_on_device(t_full_index),
        t_partial_count=_on_device(t_partial_count),
        t_partial_index=_on_device(t_partial_index),
        bitmaps=bitmaps,
        bitmap_index=bitmap_index,
        t_bitmap_index=t_bitmap_index,
        q_len=q_len,
        kv_len=kv_len,
        block_q=block_q,
        block_kv=block_kv,
        is_static=not dynamic,
    )


_layout_of_resolved_jit = eqx.filter_jit(layout_of_resolved)
