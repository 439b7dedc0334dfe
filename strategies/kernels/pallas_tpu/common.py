"""What the forward and both backward kernels share: the visit lists they prefetch into
scalar memory, and the logits of one tile (score terms, soft cap, mask terms) evaluated on
its coordinates inside the kernel body."""

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from eqx_bsattn.contract import (BlockLayout, MaskTerms, TokenCoords, evaluate_function, pad_axis,
                                  recording_reads, replaying_reads, typed_like)

from .config import LANES, SUBLANES
from .function import value

#: Each slot of a visit list: skipped, a block whose mask is evaluated, a block seen whole.
SKIP, PARTIAL, FULL = 0, 1, 2


def launch_struct(shape, dtype) -> jax.ShapeDtypeStruct:
    """A `pallas_call` output's shape and dtype, typed to vary over no mesh axis.

    Inside `jax.shard_map` (``check_vma``, its default) Pallas asks each output for the mesh
    axes it varies over. A launch's body sees every input as varying over none, so its
    outputs are typed so; the caller gives them the inputs' axes after (`typed_like`, and
    `cotangent_like` for a custom backward). Outside `shard_map` the type is ignored."""
    none = getattr(jax.sharding, "ManualAxisType", None)
    if none is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=none())
    try:  # releases before `ManualAxisType` name the axes `vma`
        return jax.ShapeDtypeStruct(shape, dtype, vma=frozenset())
    except TypeError:
        return jax.ShapeDtypeStruct(shape, dtype)


def _varying(x) -> frozenset:
    """The mesh axes `x` varies over inside `jax.shard_map` (none outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def run_untyped(fn, interpret: bool, *args):
    """``fn(*args)`` (a launch on pytrees of arrays), interpreted where it must be.

    Pallas' HLO interpreter (``interpret=True``) evaluates a kernel's body and index maps
    when the program is lowered, under `jax.shard_map`'s mesh-axis type checks: inside a
    `shard_map` every operation that meets an array varying over a mesh axis and a grid
    index or a constant (varying over none) is refused. There, the launch runs in a nested
    `shard_map` over no new axis with those checks off (JAX's own way out), on copies typed
    to vary over none; its outputs vary over none (the caller types them, `typed_like`,
    `cotangent_like`). Compiled launches, and those outside `shard_map`, run as they are."""
    leaves, tree = jax.tree.flatten(args)
    if not interpret or not any(_varying(x) for x in leaves):
        return fn(*args)

    def untyped(*leaves):
        # With the checks off an operation's result varies over no axis.
        return fn(*jax.tree.unflatten(tree, [x + jnp.zeros((), x.dtype) for x in leaves]))

    return jax.shard_map(untyped, in_specs=(P(),) * len(leaves), out_specs=P(),
                         axis_names=frozenset(), check_vma=False)(*leaves)


def cotangent_like(ct, primal, *inputs):
    """A launch's cotangent `ct` of `primal` (a sum over this device's share of the work,
    typed to vary over no mesh axis) as a custom backward must return it inside
    `jax.shard_map`: summed over the mesh axes the work varies over (those of `inputs`) and
    `primal` does not (a score array every batch shard reads: each device holds a part of its
    gradient), then typed like `primal`. Outside `shard_map` it is `ct`."""
    axes = frozenset().union(*map(_varying, inputs)) - _varying(primal)
    if axes:
        ct = jax.lax.psum(typed_like(ct, *inputs), tuple(sorted(axes)))
    return typed_like(ct, primal)


@dataclasses.dataclass(frozen=True)
class Visits:
    """One pass's visit lists, flattened for scalar memory: for row ``r`` (a q-block, or a
    kv-block in the dk/dv pass) of batch ``b`` and head ``h`` (each 1 where the layout has
    no such axis), slot ``s`` sits at ``((b * mh + h) * rows + r) * width + s``.

    `block` holds the block of the other side each slot visits and `kind` its class (`FULL`,
    `PARTIAL`, `SKIP`). Slots past a row's list repeat its last block, so the pipeline
    fetches nothing new for them.

    `steps` (int32 ``[1]``) is how many slots of each row a launch walks: `width` where the
    lists are known at trace time; where they are built when the call runs (`dynamic`:
    per-call data, a user predicate's params) the longest list, found on the device, so the
    grid is as long as the lists, not as their capacity (every block of a row).
    """

    block: Any  # int32 [mb * mh * rows * width]
    kind: Any
    mb: int
    mh: int
    rows: int
    width: int
    steps: Any = None
    dynamic: bool = False

    def at(self, b, h, row, slot):
        """The flat index of a slot (traced scalars; `b`, `h` the call's batch and head)."""
        b = b if self.mb > 1 else 0
        h = h if self.mh > 1 else 0
        return ((b * self.mh + h) * self.rows + row) * self.width + slot

    def static(self) -> "Visits":
        """The lists' shape alone, for a kernel body (which reads the lists from its refs)."""
        return dataclasses.replace(self, block=None, kind=None, steps=None)

    def grid_steps(self):
        """The launch grid's slot axis: `width`, or (`dynamic`) the traced `steps`."""
        return self.steps[0] if self.dynamic else self.width


def visits(layout: BlockLayout, *, transposed: bool, rows: int) -> Visits:
    """The visit lists of `layout` (its transposed lists when `transposed`): FULL blocks
    first, then PARTIAL ones, each row padded to `rows` rows (the extra ones are padding and
    visit nothing). NumPy at trace time for a static layout (width: the longest list),
    `jax.numpy` for one known only when it runs (per-call data, a ring step's lists read at
    a traced step): width the FULL and the PARTIAL lists' capacities together, at most
    every block of a row (exact capacities, as a ring's lists have, may each hold less)."""
    prefix = "t_" if transposed else ""
    names = ("full_count", "full_index", "partial_count", "partial_index")
    fc, fi, pc, pi = (getattr(layout, prefix + n) for n in names)
    static = layout.is_static and not isinstance(fc, jax.core.Tracer)
    xp = np if static else jnp
    fc, fi, pc, pi = (xp.asarray(a).astype(np.int32) for a in (fc, fi, pc, pi))
    if static and fc.size:
        width = int((fc + pc).max())
    else:
        blocks = layout.num_q_blocks if transposed else layout.num_kv_blocks
        width = min(fi.shape[-1] + pi.shape[-1], blocks)
    width = max(width, 1)
    count = (fc + pc)[..., None]
    slot = xp.broadcast_to(xp.arange(width, dtype=np.int32), fc.shape + (width,))
    in_full = slot < fc[..., None]
    take = lambda a, i: xp.take_along_axis(  # noqa: E731
        a, xp.clip(i, 0, a.shape[-1] - 1), axis=-1)
    block = xp.where(in_full, take(fi, slot), take(pi, slot - fc[..., None]))
    last = take(block, count - 1)
    block = xp.where(slot < count, block, last)
    kind = xp.where(in_full, FULL, xp.where(slot < count, PARTIAL, SKIP)).astype(np.int32)
    block, kind = (pad_axis(a, 2, rows) for a in (block, kind))
    mb, mh = block.shape[:2]
    if static:
        steps = np.asarray([width], np.int32)
    else:
        # The capacity holds every block a row may visit whatever the data; the grid walks
        # only the longest list this call has (one slot at least).
        steps = jnp.clip(jnp.max(count), 1, width).astype(jnp.int32).reshape(1)
    return Visits(block.reshape(-1), kind.reshape(-1), mb, mh, rows, width, steps,
                  not static)


def as_column(x, length: int, value):
    """``[B, L]`` per-token ints as ``[B, length, 128]`` (each token's value across the
    lanes): a tile's rows read them as a column."""
    x = pad_axis(x.astype(jnp.int32), 1, length, value)
    return jnp.broadcast_to(x[:, :, None], x.shape + (LANES,))


def as_row(x, length: int, value):
    """``[B, L]`` per-token ints as ``[B, 8, length]``: a tile's columns read them as a
    row."""
    x = pad_axis(x.astype(jnp.int32), 1, length, value)
    return jnp.broadcast_to(x[:, None, :], (x.shape[0], SUBLANES, x.shape[1]))


@dataclasses.dataclass(frozen=True)
class TileMath:
    """The static part of a call's logits, evaluated per tile inside the kernels.

    A tile's logits are ``softmax_scale * q . k``, then the score terms (ALiBi slopes, the
    relative-position table, the score function, in that order), then the soft cap; in a
    PARTIAL block the mask terms (and ``k < kv_len``) hide pairs. Hashable: kernels take it
    as a static argument.
    """

    terms: MaskTerms | None
    kv_len: int
    scale: float
    soft_cap: float | None
    slopes: bool = False
    buckets: Any = None  # RelativeBuckets, with a table
    function: Callable | None = None  # a ScoreTerm; with params, `traced` is set
    #: Where the function reads arrays (`FunctionData`): its jaxpr at each tile
    #: shape, ``((shape, TracedFunction), ...)``, and the arrays' `DataLeaf`s (kernel inputs
    #: ``fdata0``, ... in scalar memory; where `DataLeaf.diff`, dq outputs ``dfdata0``, ...).
    traced: tuple = ()
    data: tuple = ()
    positions: bool = False  # per-call positions (else the token indices)
    segment_ids: bool = False
    #: Where the mask has no terms: a `CompiledMask` without layouts whose element predicate
    #: (`CompiledMask.visible_at`) is traced into the kernels on their tiles' coordinates.
    predicate: Any = None
    #: Where that predicate cannot be traced there (it gathers from an array): partial blocks
    #: read a tile of the call's element map instead (input ``emap``, int8).
    elements: bool = False
    #: Where it reads arrays at scalar indices only (a user predicate's ``widths[head]``): it is
    #: evaluated on the tiles as the score function is (`function.mask_data`), ``((shape,
    #: TracedFunction), ...)``, its arrays data slots after the function's (never
    #: differentiated); `predicate` is then ``None``.
    mask_traced: tuple = ()

    def far_tile(self, q_start, k_start, num_q: int, num_k: int, *, q_rows: bool = True):
        """Where positions are the token indices, ``(ahead, behind, d0, sign)`` of a tile
        (queries `q_start` ..., keys `k_start` ...; along its rows where `q_rows`): scalar
        booleans saying that every pair lies in the table's last bucket ahead / behind
        (`RelativeBuckets.far_buckets`), whose entry is then one scalar, and the distance of
        pair ``(r, c)``, ``d0 + sign * (c - r)`` (`pieces`). ``None`` without a
        table or with per-call positions."""
        if self.buckets is None or self.positions:
            return None
        (gap_ahead, _), (gap_behind, _) = self.buckets.far_buckets()
        d_min = q_start - (k_start + num_k - 1)
        d_max = q_start + num_q - 1 - k_start
        return d_min >= gap_ahead, d_max <= -gap_behind, q_start - k_start, -1 if q_rows else 1

    def table_cases(self, far):
        """``[(case, condition), ...]``: the static cases a tile's table term takes, each with
        the scalar boolean that selects it. The kernels run one branch per case (`pl.when`),
        so a far tile adds one scalar and no tile-sized value crosses a branch (a ``lax.cond``
        that yields the tile's logits stores and reloads them through VMEM on every tile).
        ``[(None, True)]`` without a table or where `far` is ``None`` (per-call positions:
        each pair's bucket)."""
        if self.buckets is None or far is None:
            return [(None, True)]
        ahead, behind = far[:2]
        return [("ahead", ahead), ("behind", jnp.logical_and(behind, jnp.logical_not(ahead))),
                ("near", jnp.logical_not(jnp.logical_or(ahead, behind)))]

    def pieces(self, far, shape):
        """The pieces a near tile's table term is formed on, ``(rows, cols, d, ahead,
        behind)`` each: its row and column slices, the distance of its first pair (pair
        ``(r, c)`` of the piece is at ``d + sign * (c - r)``) and scalar booleans saying that
        every pair lies in the last bucket ahead / behind (`far_tile`'s test on the piece).
        Pieces are 128 x 128 (one vector register wide), or a whole axis that is not a
        multiple of 128 (interpreted odd tiles)."""
        (gap_ahead, _), (gap_behind, _) = self.buckets.far_buckets()
        _, _, d0, sign = far
        size_r, size_c = (LANES if n % LANES == 0 else n for n in shape)
        out = []
        for r in range(0, shape[0], size_r):
            for c in range(0, shape[1], size_c):
                d = d0 + sign * (c - r)
                # Over the piece's pairs c - r runs from -(size_r - 1) to size_c - 1.
                lo, hi = sorted((sign * -(size_r - 1), sign * (size_c - 1)))
                out.append((slice(r, r + size_r), slice(c, c + size_c), d,
                            d + lo >= gap_ahead, d + hi <= -gap_behind))
        return out

    @staticmethod
    def _pad(shape):
        """Lanes of a piece's diagonal vectors: whole registers, at least its rows and cols."""
        return -(-max(shape) // LANES) * LANES

    def diagonal_distances(self, d, sign: int, shape):
        """The distances of the diagonals of a piece whose pair ``(r, c)`` is at ``d + sign *
        (c - r)``, on a block of `shape` ``[n >= 2, P]``: lane ``j`` of row 0 is the diagonal
        ``c - r = j`` (on and above the main one), of row 1 the diagonal ``c - r = j - P``
        (below it); other rows repeat row 0."""
        j = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
        below = jax.lax.broadcasted_iota(jnp.int32, shape, 0) == 1
        return d + sign * jnp.where(below, j - shape[1], j)

    def diagonal_piece(self, fn, d, shape, sign: int):
        """``fn(e)`` on a piece whose pair ``(r, c)`` is at ``e = d + sign * (c - r)``: `fn`
        runs once on one ``[8, P]`` block of the diagonals' distances (`diagonal_distances`:
        P whole lanes, at least the piece's sides); each row of the piece is then the row of
        the diagonals above, and that of those below, rotated by its row index (a strided
        lane roll of one register per 8 rows), the two joined at the main diagonal. `fn`
        maps int32 distances to a 32-bit array of their shape."""
        rows, cols = shape
        width = self._pad(shape)
        v = fn(self.diagonal_distances(d, sign, (SUBLANES, width)))

        def spread(row):
            tile = jnp.broadcast_to(row, (rows, width))
            return pltpu.roll(tile, 0, 1, stride=1, stride_axis=0)[:, :cols]

        upper = (jax.lax.broadcasted_iota(jnp.int32, shape, 1)
                 >= jax.lax.broadcasted_iota(jnp.int32, shape, 0))
        return jnp.where(upper, spread(v[0:1, :]), spread(v[1:2, :]))

    def diagonal_sums(self, x):
        """A ``[2, P]`` block of the sums of a ``[R, C]`` piece's diagonals, in
        `diagonal_distances`' layout: lane ``j`` of row 0 sums the pairs at ``c - r = j``, of
        row 1 those at ``c - r = j - P``. Row ``r`` must move left by ``r`` lanes, which a
        strided roll cannot do on a TPU (its stride may not exceed what one 8-row register
        spans), so the piece's rows are reversed on the MXU (a product with the exchange
        matrix: one exact product by 1.0 per output at the highest precision) and row ``r' =
        R - 1 - r`` rolled right by ``r'`` (stride 1, as `diagonal_piece`) after one roll of
        the piece by ``P - (R - 1)``: row ``r``'s element ``(r + j) mod P`` lands on lane
        ``j``, above the main diagonal where ``r + j < P``; then summed over the rows."""
        rows, cols = x.shape
        width = self._pad(x.shape)
        if cols < width:
            x = jnp.concatenate([x, jnp.zeros((rows, width - cols), x.dtype)], axis=1)
        square = (rows, rows)
        exchange = (jax.lax.broadcasted_iota(jnp.int32, square, 0)
                    + jax.lax.broadcasted_iota(jnp.int32, square, 1) == rows - 1)
        t = jax.lax.dot(exchange.astype(jnp.float32), x.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
        shift = (width - (rows - 1)) % width
        if shift:
            t = pltpu.roll(t, shift, 1)
        t = pltpu.roll(t, 0, 1, stride=1, stride_axis=0)
        # Row r' holds original row r = R - 1 - r'; lane j is the pair (r, r + j mod P).
        upper = ((rows - 1 - jax.lax.broadcasted_iota(jnp.int32, t.shape, 0))
                 + jax.lax.broadcasted_iota(jnp.int32, t.shape, 1) < width)
        return jnp.concatenate([jnp.sum(jnp.where(upper, t, 0.0), axis=0, keepdims=True),
                                jnp.sum(jnp.where(upper, 0.0, t), axis=0, keepdims=True)],
                               axis=0)

    def table_near(self, table_ref, head, far, shape):
        """``table[head, bucket(d)]`` on a tile that `far_tile` finds near: piece by piece
        (`pieces`), a scalar on a piece whose pairs all lie in a far bucket, the diagonals'
        entries (`diagonal_piece`) on the others."""
        (_, ahead), (_, behind) = self.buckets.far_buckets()
        entry = lambda d: self.table_tile(self.buckets.bucket(d), head, table_ref)  # noqa: E731
        grid = {}
        for rows, cols, d, is_ahead, is_behind in self.pieces(far, shape):
            size = (rows.stop - rows.start, cols.stop - cols.start)
            scalar = jnp.where(is_ahead, table_ref[head, ahead], table_ref[head, behind])
            grid.setdefault(rows.start, []).append(jax.lax.cond(
                jnp.logical_or(is_ahead, is_behind),
                lambda scalar=scalar, size=size: jnp.broadcast_to(scalar, size),
                lambda d=d, size=size: self.diagonal_piece(entry, d, size, far[3])))
        return jnp.concatenate([jnp.concatenate(row, axis=1) for row in grid.values()], axis=0)

    def logits(self, s, batch, head, qp, kp, slopes_ref, table_ref, *, grad: bool, far=None,
               case=None, read=None, bias=None) -> "Logits":
        """The tile's logits from ``q . k`` (float32) and, where `grad`, their derivatives
        (`Logits`). `batch`, `head` are the tile's indices (int32 scalars); `qp`, `kp` int32
        tiles of `s`'s shape; `far` is the tile's `far_tile` and `case` its static table case
        (`table_cases`); `read` the kernel's reader of the function's arrays
        (`data_reader`); `bias` the call's bias tile of `s`'s shape, or ``None``."""
        s = s * self.scale if self.scale != 1.0 else s
        if bias is not None:
            s = s + bias.astype(jnp.float32)
        if self.slopes:
            s = s + slopes_ref[head] * (kp - qp).astype(jnp.float32)
        if self.buckets is not None:
            if case is None:
                s = s + self.table_tile(self.buckets.bucket(qp - kp), head, table_ref)
            elif case == "near":
                s = s + self.table_near(table_ref, head, far, s.shape)
            else:
                (_, ahead), (_, behind) = self.buckets.far_buckets()
                s = s + table_ref[head, ahead if case == "ahead" else behind]
        factor = fn_in = cap = reads = None
        if self.function is not None:
            fn_in = s
            value, fn, reads = self._function(s, batch, head, qp, kp, read)
            if grad:
                s, factor = jax.jvp(fn, (s,), (jnp.ones_like(s),))
            else:
                s = fn(s) if value is None else value
        if self.soft_cap is not None:
            t = jnp.tanh(s * (1.0 / self.soft_cap))
            s = self.soft_cap * t
            if grad:
                cap = 1.0 - t * t
                factor = cap if factor is None else factor * cap
        return Logits(s, factor, fn_in, cap, reads)

    def _function(self, s, batch, head, qp, kp, read):
        """``(value, fn, reads)``: the score function on the tile `s` (``None`` where it
        reads no array: ``fn(s)``), as a function of the logits (``fn(x)``, reading the same
        scalars), and the scalars it read from its arrays (`Reads`, loaded once
        here; ``None`` where it reads none)."""
        if not self.traced:
            return None, (lambda x: self.function(x, batch, head, qp, kp, None)), None
        traced = dict(self.traced)[tuple(s.shape)]
        rec, reads = recording_reads(read)
        value = evaluate_function(traced, (s, batch, head, qp, kp), rec)
        # The derivatives read the values loaded here (no loads under `jax.jvp`).
        values = [v for _, _, v in reads.items]
        return value, (lambda x: evaluate_function(traced, (x, batch, head, qp, kp),
                                          replaying_reads(values))), reads

    def data_grads(self, logits: "Logits", batch, head, qp, kp, g):
        """``[(slot, flat, value)]``: the gradient of each scalar the function read from an
        array whose gradient is formed (`DataLeaf.diff`), where `g` is that of the function's
        result on the tile (zero where a pair is hidden)."""
        items = logits.reads.items
        diff = [n for n, (slot, _, _) in enumerate(items) if self.data[slot].diff]
        if not diff:
            return []
        traced = dict(self.traced)[tuple(logits.fn_in.shape)]
        values = [v for _, _, v in items]

        def fn(*scalars):
            read = list(values)
            for n, x in zip(diff, scalars):
                read[n] = x
            return evaluate_function(traced, (logits.fn_in, batch, head, qp, kp), replaying_reads(read))

        _, pull = jax.vjp(fn, *(values[n] for n in diff))
        return [(items[n][0], items[n][1], d) for n, d in zip(diff, pull(g))]

    def table_tile(self, bucket, head, table_ref):
        """``table[head, bucket]`` on a tile of bucket ids, one select per bucket (a vector
        gather from scalar memory does not lower)."""
        out = jnp.zeros(bucket.shape, jnp.float32)
        for n in range(self.buckets.num_buckets):
            out = jnp.where(bucket == n, table_ref[head, n], out)
        return out

    def visible(self, head, coords, refs):
        """The mask on a tile: `coords` its `tile_coords` (keys past `kv_len` hidden), `head`
        its query head (an int32 scalar), `refs` the kernel's inputs (the element map's tile,
        ``emap``, where the call has one)."""
        qi, ki, qp, kp, qs, ks = coords
        if self.mask_traced:
            traced = dict(self.mask_traced)[tuple(qi.shape)]
            args = [x for x in (head, qi, ki, qp, kp, qs, ks) if x is not None]
            return evaluate_function(traced, args, data_reader(self, refs))
        if self.elements:
            return refs["emap"][...].astype(jnp.int32) != 0
        if self.predicate is not None:
            q_len, kv_len = self.predicate.q_len, self.predicate.kv_len
            return self.predicate.visible_at(head, TokenCoords(qi, qp, qs, q_len),
                                             TokenCoords(ki, kp, ks, kv_len))
        ok = ki < self.kv_len
        t = self.terms
        if t is None:
            return ok
        d = kp - qp  # positions are within 2**30: no overflow
        if t.causal_offset is not None:
            ok &= d <= t.causal_offset
        if t.window_left is not None:
            ok &= -d <= t.window_left
        if t.window_right is not None:
            ok &= d <= t.window_right
        if t.chunk is not None:
            ok &= jnp.floor_divide(qp, t.chunk) == jnp.floor_divide(kp, t.chunk)
        if t.prefix is not None:
            ok &= (kp < t.prefix) | (d <= 0)
        if t.segment_ids:
            ok &= (qs == ks) & (qs >= 0)
        return ok


class Logits(NamedTuple):
    """A tile's logits (`TileMath.logits`): `s`; where derivatives were asked for, `factor`
    (that of `s` in the logits before the score function and the soft cap; ``None``
    without either) and `cap` (that of the soft cap alone); the score function's input tile
    `fn_in` and the scalars it read (`reads`, or ``None``)."""

    s: Any
    factor: Any = None
    fn_in: Any = None
    cap: Any = None
    reads: Any = None


def data_reader(math: TileMath, refs: dict):
    """``read(slot, flat)`` of the score function's arrays in a kernel (`refs` its inputs by
    name): a scalar load from scalar memory, in the array's own dtype."""
    return lambda slot, flat: value(math.data[slot], refs[f"fdata{slot}"][flat])


def lanes(x, width: int):
    """A ``[rows, 128]`` value whose lanes are equal (a per-row value) widened or narrowed to
    ``[rows, width]`` in the forms Mosaic lowers: whole lane tiles repeated, or a slice."""
    if width % x.shape[1] == 0:
        return jnp.tile(x, (1, width // x.shape[1])) if width != x.shape[1] else x
    if width < x.shape[1]:
        return x[:, :width]
    return jnp.broadcast_to(x[:, :1], (x.shape[0], width))  # interpreted odd tiles only


def _side(ref, axis: int, shape):
    """A per-token block (`as_column` when the tokens run along the tile's rows, ``axis``
    0; `as_row` along its columns) broadcast to the tile."""
    if axis == 0:
        return lanes(ref[...], shape[1])
    return jnp.broadcast_to(ref[:1, :], shape)


def tile_coords(shape, q_axis: int, q_start, k_start, refs: dict):
    """``(qi, ki, qp, kp, qs, ks)`` int32 tiles of `shape`: token indices, positions (the
    indices without per-call ones) and segment ids (``None`` without) of the queries along
    `q_axis` and the keys along the other axis. `refs` holds the blocks of the per-token
    inputs that the call has (``q_pos``, ``kv_pos``, ``q_seg``, ``kv_seg``)."""
    k_axis = 1 - q_axis
    qi = jax.lax.broadcasted_iota(jnp.int32, shape, q_axis) + q_start
    ki = jax.lax.broadcasted_iota(jnp.int32, shape, k_axis) + k_start
    read = lambda name, axis, default: (  # noqa: E731
        _side(refs[name], axis, shape) if name in refs else default)
    return (qi, ki, read("q_pos", q_axis, qi), read("kv_pos", k_axis, ki),
            read("q_seg", q_axis, None), read("kv_seg", k_axis, None))


def token_inputs(inputs, math: TileMath, lq: int, lk: int, *, q_rows: bool) -> dict:
    """The per-token inputs the kernels read, by name, laid out for a pass whose tiles have
    the queries along their rows (`q_rows`: forward, dq) or the keys (dk/dv). Padding tokens
    get segment ids that match nothing (-1 queries, -2 keys)."""
    out = {}
    q_side, k_side = (as_column, as_row) if q_rows else (as_row, as_column)
    if math.positions:
        out["q_pos"] = q_side(inputs.q_positions, lq, 0)
        out["kv_pos"] = k_side(inputs.kv_positions, lk, 0)
    if math.segment_ids:
        out["q_seg"] = q_side(inputs.q_segment_ids, lq, -1)
        out["kv_seg"] = k_side(inputs.kv_segment_ids, lk, -2)
    return out
