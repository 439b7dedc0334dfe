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

Declined, each in one line (`data_decline`): an array of other than 32 bits (or bool),
arrays of more than `DATA_LIMIT` elements together, one used other than at scalar indices (a
gather by the positions, a product with the whole array), one read at an index that depends
on the logits or the positions, and reads in another order at another tile.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from eqx_bsattn.contract import (array_read_decline, evaluate_function, function_data,
                                  recording_reads)

from .backward import backward_blocks
from .common import (ROWS_PER_WARPGROUP, LogitTerms, function_tile, item_values,
                     lowering_failure, read_derivatives)
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


def _tile_args(shape):
    f32, i32 = (jax.ShapeDtypeStruct(shape, t) for t in (jnp.float32, jnp.int32))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return f32, scalar, scalar, i32, i32


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
    """The data slot of each scalar one evaluation of `traced` reads, in order (traced with
    stand-in reads: no FLOPs)."""
    shape = traced.invars[0].aval.shape
    record, reads = recording_reads(lambda slot, flat: jnp.zeros((), leaves[slot].dtype))
    jax.make_jaxpr(lambda *args: evaluate_function(traced, args, record))(*_tile_args(shape))
    return tuple(slot for slot, _, _ in reads.items)


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


def read_tables(cfg, data: tuple, batch: int, heads: int):
    """``(floats [Rf, batch, heads] float32, ints [Ri, batch, heads] int32)``: the scalar
    each read of the function (``cfg.reads``, float reads and the others apart:
    `LogitTerms.read_columns`) takes for each batch row and query head, from the stored
    arrays `data` (`common.stored`, by slot). The indices come from evaluating the trace
    per batch row and head (the tiles do not reach them: `data_decline`); a float read's
    scalar is the one element its index selects, summed out of the array by a comparison
    with every element, so that its gradient, the transpose, is a sum in a fixed order (no
    scatter: deterministic)."""
    empty = {True: jnp.zeros((0, batch, heads), jnp.float32),
             False: jnp.zeros((0, batch, heads), jnp.int32)}
    if not cfg.reads:
        return empty[True], empty[False]
    shape, traced = cfg.traced[-1]

    def reader(slot, flat):
        x = data[slot][flat]
        return x != 0 if cfg.data[slot].dtype == jnp.bool_ else x.astype(cfg.data[slot].dtype)

    def indices(b, h):
        record, reads = recording_reads(reader)
        args = (jnp.zeros(shape, jnp.float32), b, h, jnp.zeros(shape, jnp.int32),
                jnp.zeros(shape, jnp.int32))
        evaluate_function(traced, args, record)
        return jnp.stack([jnp.asarray(flat, jnp.int32) for _, flat, _ in reads.items])

    rows = jnp.arange(batch, dtype=jnp.int32)
    cols = jnp.arange(heads, dtype=jnp.int32)
    flats = jnp.moveaxis(jax.vmap(jax.vmap(indices, (None, 0)), (0, None))(rows, cols), -1, 0)
    floats, ints = [], []
    for r, (slot, (floating, _)) in enumerate(zip(cfg.reads, cfg.read_columns)):
        x = data[slot]
        if floating:
            hits = flats[r][..., None] == jnp.arange(x.shape[0], dtype=jnp.int32)
            floats.append(jnp.where(hits, x, 0.0).sum(axis=-1))
        else:
            ints.append(x[flats[r]])
    return tuple(jnp.stack(xs) if xs else empty[f] for xs, f in ((floats, True),
                                                                  (ints, False)))


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
