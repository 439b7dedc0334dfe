"""The arrays a score function reads, in the Mosaic GPU kernels.

A `ScoreFunction` may read arrays: those it closes over (``slopes[head]`` with ``slopes`` a
jnp array) and the leaves of its `params`. The function is traced at each tile shape the
launches evaluate it on (`eqx_bsattn.contract.function_data`; `params` enter the trace as
its constants) and evaluated in the tile code (`evaluate_function`) with each read of an
array at scalar indices replaced by a scalar the launch has. Each read's index depends on
the head and the batch row alone (`data_decline` checks it), so before the launches each
read's scalar is found for every batch row and query head (`read_tables`: ``[R, B, H]``, the
float reads in float32 and the others in int32); a launch loads a work item's scalars once
(`common.item_values`), as it loads ALiBi's slope of a head, and replays them into each
block's evaluation.

Gradients, where an array is traced: the dk/dv launch takes ``d function / d read`` on the
tile by a forward-mode product in that read's scalar and sums ``G d function / d read`` (`G`
the gradient of the function's value) per key row into its own float32 row of an output
(`backward.dkv_call`'s `data_rows`), in both backward modes; the rows are summed per head
and batch row (`table_gradients`), and JAX carries that table's cotangent to the arrays
through `read_tables`, whose float reads take their element by a comparison with every
element and a sum: the transpose is a sum in a fixed order, no scatter, no atomics, so the
gradients are bit-identical from run to run.

A mask's element predicate that reads arrays (a user predicate's per-head widths in its
params, ``widths[head]``, or an array it closes over) runs the same way on the partial
blocks (`predicate_data`): traced on the launches' int32 tiles
(`eqx_bsattn.contract.mask_data`), each read's index depending on the head alone
(predicates get no batch row), each read's scalar per head after the function's in the read
tables (broadcast over the batch rows), replayed into each block's predicate
(`common.mask_tile`). Its arrays are never differentiated (a mask has no gradient). Any
other such predicate reads an element map.

Declined, each in one line (`data_decline`): an array of other than 32 bits (or bool),
arrays of more than `DATA_LIMIT` elements together, one used other than at scalar indices (a
gather by the positions, a product with the whole array), one read at an index that depends
on the logits or the positions, and reads in another order at another tile.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from eqx_bsattn.contract import (MaskData, array_read_decline, evaluate_function,
                                  function_data, mask_data, recording_reads)

from .backward import backward_blocks
from .common import (ROWS_PER_WARPGROUP, LogitTerms, function_tile, item_values,
                     lowering_failure, mask_tile, read_derivatives)
from .forward import block_kv_for

#: The most elements of the arrays a score function reads, together: each read takes its
#: element by a comparison with every element (`read_tables`).
DATA_LIMIT = 65536


def tile_shapes(head_dim: int) -> tuple[tuple[int, int], ...]:
    """The tiles the launches evaluate the score function on at `head_dim`: the forward's
    and the dq launch's ``(64 queries, keys)``, the dk/dv launch's ``(64 keys, queries)``."""
    (_, dq_keys), (dkv_queries, _) = backward_blocks(head_dim)
    return ((ROWS_PER_WARPGROUP, block_kv_for(head_dim)), (ROWS_PER_WARPGROUP, dq_keys),
            (ROWS_PER_WARPGROUP, dkv_queries))


def reads_arrays(function, params) -> bool:
    """Whether the score function goes through `function_data` (it takes `params`, or it
    closes over arrays): traced with `params` on a small tile."""
    if function.takes_params:
        return True
    try:
        data = function_data(function, [(ROWS_PER_WARPGROUP, 128)], concrete(params))
    except Exception:  # noqa: BLE001 - the call raises it where it runs
        return False
    return bool(data.arrays)


def concrete(params):
    """`params` with each abstract leaf (a `jax.ShapeDtypeStruct`, as a plan knows them)
    replaced by zeros of its shape and dtype, so that the function traces on them."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype)
                        if isinstance(x, jax.ShapeDtypeStruct) else x, params)


def data_decline(function, params, head_dim: int) -> str | None:
    """Why the Mosaic kernels cannot evaluate the score function `function` with the arrays
    it reads (its closure's and `params`' leaves, abstract ones allowed), or ``None``: each
    must be 32-bit (or bool), all of them at most `DATA_LIMIT` elements, each read only at
    scalar indices that depend on the head and batch row alone. A function that does not
    trace is left to the kernel's call (which raises the function's own error)."""
    try:
        data = function_data(function, tile_shapes(head_dim), concrete(params))
    except Exception:  # noqa: BLE001 - the call raises it where it runs
        return None
    why = array_read_decline(data, "the Mosaic kernels", DATA_LIMIT)
    if why is not None:
        return why
    if data.arrays and not _indices_by_head(data):
        return ("the score function reads an array at an index that depends on the logits "
                "or the positions (the Mosaic kernels read each scalar once per head and "
                "batch row; index by the head or the batch row, e.g. slopes[head]).")
    if len({read_slots(traced, data.leaves) for _, traced in data.traced}) > 1:
        return ("the score function reads its arrays in another order at another tile "
                "shape (the Mosaic kernels replay one order of reads at every tile).")
    return None


def _indices_by_head(data) -> bool:
    """Whether every read of `data`'s dk/dv trace takes an index of the head and batch row
    alone: the indices, mapped over the logits and position tiles, are not mapped."""
    shape, traced = data.traced[-1]

    def reader(slot, flat):
        x = jnp.asarray(data.arrays[slot]).reshape(-1)[flat]
        return x if data.leaves[slot].dtype != jnp.bool_ else x != 0

    def indices(s, q_pos, k_pos):
        record, reads = recording_reads(reader)
        evaluate_function(traced, (s, jnp.int32(0), jnp.int32(0), q_pos, k_pos), record)
        return [flat for _, flat, _ in reads.items]

    stacked = [jax.ShapeDtypeStruct((2, *shape), t) for t in (jnp.float32, jnp.int32,
                                                             jnp.int32)]
    try:
        jax.eval_shape(jax.vmap(indices, out_axes=None), *stacked)
    except ValueError:  # an index varies with the tiles: vmap cannot leave it unmapped
        return False
    return True


def read_slots(traced, leaves) -> tuple[int, ...]:
    """The data slot of each scalar one evaluation of `traced` (a score function's or a
    mask's) reads, in order (traced with stand-in reads: no FLOPs)."""
    record, reads = recording_reads(lambda slot, flat: jnp.zeros((), leaves[slot].dtype))
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in traced.invars]
    jax.make_jaxpr(lambda *args: evaluate_function(traced, args, record))(*args)
    return tuple(slot for slot, _, _ in reads.items)


def predicate_data(predicate, head_dim: int) -> MaskData | None:
    """The element predicate of `predicate` (a `CompiledMask` without layouts) traced at the
    launches' tiles of `head_dim` (`tile_shapes`; the dk/dv tile's rows are keys) where the
    kernels can read its arrays in-kernel, else ``None`` (an element map then): each 32-bit
    (or bool), at most `DATA_LIMIT` elements in all, read only at scalar indices
    (`eqx_bsattn.contract.mask_data`) that depend on the head alone (not on the tiles), in
    one order at every tile, and Pallas Mosaic GPU lowers it with its read tables
    (`mask_lowering_failure`)."""
    data = mask_data(predicate, tile_shapes(head_dim), predicate.uses_segment_ids,
                     room=DATA_LIMIT)
    if data is None or not all(_mask_indices_by_head(traced, data.leaves)
                                for _, traced in data.traced):
        return None
    if len({read_slots(traced, data.leaves) for _, traced in data.traced}) > 1:
        return None
    if mask_lowering_failure(predicate, data, head_dim) is not None:
        return None
    return data


def mask_terms(data: MaskData) -> dict:
    """The `LogitTerms` fields of a mask's predicate that reads arrays (`predicate_data`):
    ``mask_traced``, ``mask_data``, ``mask_reads``."""
    return dict(mask_traced=data.traced, mask_data=data.leaves,
                mask_reads=read_slots(data.traced[-1][1], data.leaves))


def _mask_indices_by_head(traced, leaves) -> bool:
    """Whether every read of the mask's trace `traced` takes an index of the head alone:
    the indices, mapped over the index, position (and segment id) tiles, are not mapped."""

    def indices(head, *tiles):
        record, reads = recording_reads(lambda slot, flat: jnp.zeros((), leaves[slot].dtype))
        evaluate_function(traced, (head, *tiles), record)
        return [flat for _, flat, _ in reads.items]

    tiles = [jax.ShapeDtypeStruct((2, *v.aval.shape), v.aval.dtype) for v in traced.invars[1:]]
    try:
        jax.eval_shape(jax.vmap(indices, (None, *[0] * len(tiles)), None),
                       jax.ShapeDtypeStruct((), jnp.int32), *tiles)
    except ValueError:  # an index varies with the tiles: vmap cannot leave it unmapped
        return False
    return True


#: `mask_lowering_failure`'s verdicts, by the predicate less its arrays, their shapes and the
#: head dim (a predicate that holds arrays is not hashable itself).
_MASK_LOWERINGS: dict = {}


def mask_lowering_failure(predicate, data: MaskData, head_dim: int) -> str | None:
    """Why Pallas Mosaic GPU cannot lower the mask's predicate that reads arrays (`data`,
    traced by `mask_data`), the first line of the error, or ``None``: on the dk/dv launch's
    tile in a one-warpgroup kernel that takes the read tables as its operands and loads its
    scalars at the traced head. Cached per predicate less its arrays and their shapes (runs
    nothing; no GPU needed)."""
    arrays, rest = eqx.partition(predicate, eqx.is_array)
    key = (rest, tuple((np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(arrays)),
           head_dim)
    try:
        return _MASK_LOWERINGS[key]
    except TypeError:  # unhashable: judged each time
        return _mask_lowering(predicate, data, head_dim)
    except KeyError:
        pass
    if len(_MASK_LOWERINGS) >= 256:
        _MASK_LOWERINGS.clear()
    _MASK_LOWERINGS[key] = _mask_lowering(predicate, data, head_dim)
    return _MASK_LOWERINGS[key]


def _mask_lowering(predicate, data: MaskData, head_dim: int) -> str | None:
    cfg = LogitTerms(**mask_terms(data))
    counts = [sum(1 for floating, _ in cfg.read_columns if floating == f) or 1
              for f in (True, False)]

    def tile(batch, head, rows, cols, s, floats_ref, ints_ref):
        values = item_values(cfg, floats_ref, ints_ref, batch, head)
        segments = ((lax.div(rows, 16), lax.div(cols, 16)) if predicate.uses_segment_ids
                    else (None, None))
        visible = mask_tile(cfg, head, (rows, cols, rows + batch, cols + batch, *segments),
                            values)
        return jnp.where(visible, s, 0.0)

    return lowering_failure("the mask's element predicate", tile, tile_shapes(head_dim)[-1],
                            data=(jax.ShapeDtypeStruct((counts[0], 2, 2), jnp.float32),
                                  jax.ShapeDtypeStruct((counts[1], 2, 2), jnp.int32)))


def data_terms(function, params, head_dim: int, with_gradients: bool) -> LogitTerms:
    """The `LogitTerms` of a launch that reads the score function's arrays, traced at the
    tiles of `head_dim` (`params` concrete or abstract); with `with_gradients` each float
    array counts as traced (`DataLeaf.diff`), so that the read derivatives are formed."""
    data = function_data(function, tile_shapes(head_dim), concrete(params))
    leaves = tuple(type(leaf)(leaf.shape, leaf.dtype, with_gradients and bool(
        jnp.issubdtype(leaf.dtype, jnp.floating))) for leaf in data.leaves)
    return LogitTerms(function=function, traced=data.traced, data=leaves,
                      reads=read_slots(data.traced[-1][1], leaves))


@functools.lru_cache(maxsize=256)
def data_lowering_failure(function, treedef, avals: tuple, head_dim: int) -> str | None:
    """Why Pallas Mosaic GPU cannot lower the score function `function` with the arrays it
    reads (`params` of `treedef` and `avals`), the first line of the error, or ``None``:
    its value, its derivative in the logits and in each float scalar it reads (each summed
    per row, as the dk/dv launch sums it), on the dk/dv launch's tile in a one-warpgroup
    kernel that takes the read tables as its operands and loads its scalars at the traced
    batch row and head. Cached per function and the params' shapes (runs nothing; no GPU
    needed)."""

    params = jax.tree.unflatten(treedef, list(avals))
    try:
        cfg = data_terms(function, params, head_dim, with_gradients=True)
    except Exception:  # noqa: BLE001 - the call raises the function's own error
        return None
    counts = [sum(1 for floating, _ in cfg.read_columns if floating == f) or 1
              for f in (True, False)]
    shape = tile_shapes(head_dim)[-1]

    def tile(batch, head, rows, cols, s, floats_ref, ints_ref):
        values = item_values(cfg, floats_ref, ints_ref, batch, head)
        value, derivative = function_tile(cfg, s, batch, head, rows, cols, values=values,
                                          derivative=True)
        out = value + derivative
        for d in read_derivatives(cfg, s, batch, head, rows, cols, values):
            out = out + jax.lax.broadcast_in_dim((d * s).sum(axis=1), s.shape, [0])
        return out

    return lowering_failure("the score function", tile, shape,
                             data=(jax.ShapeDtypeStruct((counts[0], 2, 2), jnp.float32),
                                   jax.ShapeDtypeStruct((counts[1], 2, 2), jnp.int32)))


def read_tables(cfg, data: tuple, batch: int, heads: int, mask_arrays: tuple = ()):
    """``(floats [Rf, batch, heads] float32, ints [Ri, batch, heads] int32)``: the scalar
    each read of the function (``cfg.reads``), then of the mask's predicate
    (``cfg.mask_reads``), float reads and the others apart (`LogitTerms.read_columns`),
    takes for each batch row and query head, from the stored arrays `data` and
    `mask_arrays` (`common.stored`, by slot). The indices come from evaluating the traces
    per batch row and head (the tiles do not reach them: `data_decline`, `predicate_data`); a
    function's float read's scalar is the one element its index selects, summed out of the
    array by a comparison with every element, so that its gradient, the transpose, is a sum
    in a fixed order (no scatter: deterministic). The mask's scalars are taken per head
    (gathered: no gradient) and broadcast over the batch rows."""
    empty = {True: jnp.zeros((0, batch, heads), jnp.float32),
             False: jnp.zeros((0, batch, heads), jnp.int32)}
    columns = {True: [], False: []}
    rows = jnp.arange(batch, dtype=jnp.int32)
    cols = jnp.arange(heads, dtype=jnp.int32)

    def reader(arrays, leaves):
        def read(slot, flat):
            x = arrays[slot][flat]
            return x != 0 if leaves[slot].dtype == jnp.bool_ else x.astype(leaves[slot].dtype)
        return read

    if cfg.reads:
        shape, traced = cfg.traced[-1]

        def indices(b, h):
            record, reads = recording_reads(reader(data, cfg.data))
            args = (jnp.zeros(shape, jnp.float32), b, h, jnp.zeros(shape, jnp.int32),
                    jnp.zeros(shape, jnp.int32))
            evaluate_function(traced, args, record)
            return jnp.stack([jnp.asarray(flat, jnp.int32) for _, flat, _ in reads.items])

        flats = jnp.moveaxis(jax.vmap(jax.vmap(indices, (None, 0)), (0, None))(rows, cols),
                             -1, 0)
        for r, (slot, (floating, _)) in enumerate(zip(cfg.reads, cfg.read_columns)):
            x = data[slot]
            if floating:
                hits = flats[r][..., None] == jnp.arange(x.shape[0], dtype=jnp.int32)
                columns[True].append(jnp.where(hits, x, 0.0).sum(axis=-1))
            else:
                columns[False].append(x[flats[r]])
    if cfg.mask_reads:
        traced = cfg.mask_traced[-1][1]
        arrays = tuple(lax.stop_gradient(x) for x in mask_arrays)

        def mask_indices(h):
            record, reads = recording_reads(reader(arrays, cfg.mask_data))
            tiles = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in traced.invars[1:]]
            evaluate_function(traced, (h, *tiles), record)
            return jnp.stack([jnp.asarray(flat, jnp.int32) for _, flat, _ in reads.items])

        flats = jax.vmap(mask_indices)(cols)  # [heads, reads]
        for r, slot in enumerate(cfg.mask_reads):
            floating = cfg.read_columns[len(cfg.reads) + r][0]
            columns[floating].append(jnp.broadcast_to(arrays[slot][flats[:, r]],
                                                      (batch, heads)))
    return tuple(jnp.stack(columns[f]) if columns[f] else empty[f] for f in (True, False))


def table_gradients(cfg, tables, data_rows):
    """The read tables' cotangents (`read_tables`) from `backward.dkv_call`'s `data_rows`
    ``[R, B, H, Lk]`` (one per differentiated read): each read's rows summed over the keys
    (a fixed order), zeros for the other float reads, ``float0`` zeros for the integer
    table."""
    floats, ints = tables
    sums = {} if data_rows is None else dict(zip(cfg.differentiated_reads,
                                                 data_rows.sum(axis=-1)))
    columns = [sums.get(r, jnp.zeros(floats.shape[1:], jnp.float32))
               for r, (floating, _) in enumerate(cfg.read_columns) if floating]
    dfloats = jnp.stack(columns) if columns else jnp.zeros_like(floats)
    return dfloats, np.zeros(ints.shape, jax.dtypes.float0)


def params_avals(params):
    """``(treedef, avals)`` of `params` for `data_lowering_failure`'s cache key."""
    leaves, treedef = jax.tree.flatten(params)
    return treedef, tuple(jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
                          for x in leaves)
