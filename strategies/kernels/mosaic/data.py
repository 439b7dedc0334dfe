"""The arrays a score function reads, in the Mosaic GPU kernels.

A `ScoreFunction` may read arrays: those it closes over (``slopes[head]`` with ``slopes`` a
jnp array) and the leaves of its `params`. The function is traced at each tile shape the
launches evaluate it on (`eqx_bsattn.contract.function_data`; `params` enter the trace as
its constants); the arrays become two operands of each launch, the float ones concatenated
in float32 and the others in int32 (`common.data_operands`), and every read of an array at
scalar indices is a scalar load from global memory inside the tile code
(`common.data_reader`), as the kernels read ALiBi's slope of a head.

Gradients, where an array is traced: the dk/dv launch records the scalars each evaluation
reads, takes ``d function / d read`` on the tile by a forward-mode product in that scalar,
and sums ``G d function / d read`` (`G` the gradient of the function's value) per key row
into its own float32 row of an output (`backward.dkv_call`'s `data_rows`), in both backward
modes. Each read's index depends on the head and the batch row alone (`data_decline` checks
it), so the rows of one read are summed per head and batch row and added at the element that
read takes there (`read_indices`), in a fixed order: no atomics, bit-identical from run to
run (`data_gradients`).

Declined, each in one line (`data_decline`): an array of other than 32 bits (or bool),
arrays of more than `DATA_LIMIT` elements together, one used other than at scalar indices (a
gather by the positions, a product with the whole array), and one read at an index that
depends on the logits or the positions.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from eqx_bsattn.contract import (evaluate_function, function_data, recording_reads,
                                  unsupported_read)

from .backward import backward_blocks
from .common import (ROWS_PER_WARPGROUP, LogitTerms, data_reader, differentiated_reads,
                     function_tile, read_derivatives)
from .forward import block_kv_for

#: The most elements of the arrays a score function reads, together: each read's gradient
#: is added at its element by a comparison with every element (`data_gradients`).
DATA_LIMIT = 65536


def tile_shapes(head_dim: int) -> tuple[tuple[int, int], ...]:
    """The tiles the launches evaluate the score function on at `head_dim`: the forward's
    and the dq launch's ``(64 queries, keys)``, the dk/dv launch's ``(64 keys, queries)``."""
    (_, dq_keys), (dkv_queries, _) = backward_blocks(head_dim)
    return ((ROWS_PER_WARPGROUP, block_kv_for(head_dim)), (ROWS_PER_WARPGROUP, dq_keys),
            (ROWS_PER_WARPGROUP, dkv_queries))


def dkv_tile(cfg) -> tuple[int, int]:
    """The dk/dv launch's tile of a `BackwardConfig`: ``(64 keys, queries)``."""
    return ROWS_PER_WARPGROUP, cfg.dkv_block_q


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
    for leaf in data.leaves:
        if not (jnp.dtype(leaf.dtype).itemsize == 4 or leaf.dtype == jnp.bool_):
            return (f"the score function reads an array of {jnp.dtype(leaf.dtype).name} "
                    f"(shape {leaf.shape}): the Mosaic kernels read 32-bit or bool arrays.")
    total = sum(leaf.size for leaf in data.leaves)
    if total > DATA_LIMIT:
        return (f"the score function reads arrays of {total} elements (at most "
                f"{DATA_LIMIT}).")
    why = unsupported_read(data)
    if why is not None:
        return (f"the score function reads an array only as the Mosaic kernels cannot: {why} "
                f"(read arrays at scalar indices, e.g. slopes[head]).")
    if data.arrays and not _indices_by_head(data):
        return ("the score function reads an array at an index that depends on the logits "
                "or the positions (the Mosaic kernels form an array's gradient per head and "
                "batch row; index it by the head or the batch row, e.g. slopes[head]).")
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


def data_terms(function, params, head_dim: int, with_gradients: bool) -> LogitTerms:
    """The `LogitTerms` of a launch that reads the score function's arrays, traced at the
    tiles of `head_dim` (`params` concrete or abstract); with `with_gradients` each float
    array counts as traced (`DataLeaf.diff`), so that the read derivatives are formed."""
    data = function_data(function, tile_shapes(head_dim), concrete(params))
    leaves = tuple(type(leaf)(leaf.shape, leaf.dtype, with_gradients and bool(
        jnp.issubdtype(leaf.dtype, jnp.floating))) for leaf in data.leaves)
    return LogitTerms(function=function, traced=data.traced, data=leaves)


@functools.lru_cache(maxsize=256)
def data_lowering_failure(function, treedef, avals: tuple, head_dim: int) -> str | None:
    """Why Pallas Mosaic GPU cannot lower the score function `function` with the arrays it
    reads (`params` of `treedef` and `avals`, ``None``-free), the first line of the error,
    or ``None``: its value, its derivative in the logits and in each float scalar it reads
    (each summed per row, as the dk/dv launch sums it), on a 64-row tile of a
    one-warpgroup kernel that takes the arrays as its float32 and int32 operands. Cached
    per function and the params' shapes (runs nothing; no GPU needed)."""
    from .kernel import _lowering_failure

    params = jax.tree.unflatten(treedef, list(avals))
    try:
        cfg = data_terms(function, params, head_dim, with_gradients=True)
    except Exception:  # noqa: BLE001 - the call raises the function's own error
        return None
    sizes = {True: 1, False: 1}
    for leaf in cfg.data:
        floating = bool(jnp.issubdtype(leaf.dtype, jnp.floating))
        sizes[floating] += leaf.size
    shape = tile_shapes(head_dim)[-1]

    def tile(batch, head, rows, cols, s, floats_ref, ints_ref):
        read = data_reader(cfg, floats_ref, ints_ref)
        record, reads = recording_reads(read)
        value, derivative = function_tile(cfg, s, batch, head, rows, cols, read=record,
                                          derivative=True)
        out = value + derivative
        for d in read_derivatives(cfg, s, batch, head, rows, cols, reads):
            out = out + jax.lax.broadcast_in_dim((d * s).sum(axis=1), s.shape, [0])
        return out

    return _lowering_failure("the score function", tile, shape,
                             data=(jax.ShapeDtypeStruct((sizes[True],), jnp.float32),
                                   jax.ShapeDtypeStruct((sizes[False],), jnp.int32)))


def read_slots(cfg) -> list[int]:
    """The data slot of each read `backward.dkv_call` returns rows for
    (`differentiated_reads` of one evaluation on its tile), in order."""
    shape = dkv_tile(cfg)
    record, reads = recording_reads(lambda slot, flat: jnp.zeros((), cfg.data[slot].dtype))
    jax.make_jaxpr(lambda *args: evaluate_function(cfg.traced_at(shape), args, record))(
        *_tile_args(shape))
    return [reads.items[i][0] for i in differentiated_reads(cfg, reads)]


def read_indices(cfg, data: tuple, batch: int, heads: int):
    """``[R, batch, heads]`` int32: the flat index each read of `read_slots` takes for
    each batch row and query head, evaluated as the dk/dv launch evaluates the function
    (on the stored arrays `data`; the tiles' values do not reach the indices)."""
    shape = dkv_tile(cfg)
    traced = cfg.traced_at(shape)

    def reader(slot, flat):
        x = data[slot][flat]
        return x != 0 if cfg.data[slot].dtype == jnp.bool_ else x.astype(cfg.data[slot].dtype)

    def indices(b, h):
        record, reads = recording_reads(reader)
        args = (jnp.zeros(shape, jnp.float32), b, h, jnp.zeros(shape, jnp.int32),
                jnp.zeros(shape, jnp.int32))
        evaluate_function(traced, args, record)
        return jnp.stack([reads.items[i][1] for i in differentiated_reads(cfg, reads)])

    rows = jnp.arange(batch, dtype=jnp.int32)
    cols = jnp.arange(heads, dtype=jnp.int32)
    flats = jax.vmap(jax.vmap(indices, (None, 0)), (0, None))(rows, cols)  # [B, H, R]
    return jnp.moveaxis(flats, -1, 0)


def data_gradients(cfg, data: tuple, data_rows) -> tuple:
    """Each stored array's gradient (`data`, by slot; ``None`` where it is not traced) from
    `backward.dkv_call`'s `data_rows` ``[R, B, H, Lk]``: each read's rows summed per batch
    row and head, then added at the element it read there, in a fixed order (a comparison
    with every element and a sum, no scatter)."""
    reads, batch, heads, _ = data_rows.shape
    cotangents = data_rows.sum(axis=-1)  # [R, B, H]
    slots = read_slots(cfg)
    flats = read_indices(cfg, data, batch, heads)
    grads = []
    for slot, leaf in enumerate(cfg.data):
        mine = [r for r, s in enumerate(slots) if s == slot]
        if not leaf.diff:
            grads.append(None)
            continue
        if not mine:
            grads.append(jnp.zeros((leaf.size,), jnp.float32))
            continue
        index = jnp.asarray(mine)
        hits = flats[index][..., None] == jnp.arange(leaf.size, dtype=jnp.int32)
        terms = jnp.where(hits, cotangents[index][..., None], 0.0)
        grads.append(terms.reshape(-1, leaf.size).sum(axis=0))
    return tuple(grads)


def params_avals(params):
    """``(treedef, avals)`` of `params` for `data_lowering_failure`'s cache key."""
    leaves, treedef = jax.tree.flatten(params)
    return treedef, tuple(jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
                          for x in leaves)
