"""`ShardMap`: data and head parallelism with `jax.shard_map`."""

from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec as P

from eqx_bsattn.contract import (AbstractSharding, AttentionInputs, mesh_in_context,
                                  typed_like)

from ._local import (
    Operands,
    axis_size,
    check_divides,
    check_mesh,
    lead_spec,
    local_head_offset,
    local_mask,
    local_score,
    read_layout,
    unsplit_like_query,
)


def split_inputs(ops: Operands, inputs: AttentionInputs, *, batch: int, heads: int,
                 batch_axis, head_axis, q_axis=None, kv_axis=None) -> dict:
    """Register the per-call data with matching specs; returns their slots by field name."""
    slots = {}
    if inputs.bias is not None:
        bb, hb, bq = inputs.bias.shape[:3]
        lead = lead_spec(bb, hb, batch, heads, batch_axis, head_axis)
        # A size-1 axis is never split (the devices share it; autodiff sums its gradient over
        # them). Every device keeps all the bias's key columns: a ring walks them.
        slots["bias"] = ops.add(inputs.bias, P(*lead, q_axis if bq > 1 else None, None))
    if inputs.sinks is not None:
        slots["sinks"] = ops.add(inputs.sinks, P(head_axis, None))
    for name, axis in (("q_segment_ids", q_axis), ("kv_segment_ids", kv_axis),
                       ("q_positions", q_axis), ("kv_positions", kv_axis)):
        x = getattr(inputs, name)
        if x is not None:
            slots[name] = ops.add(x, P(batch_axis if batch > 1 else None, axis))
    return slots


def kv_head_plan(heads: int, kv_heads: int, mesh: Mesh, head_axis: str | None) -> bool:
    """Whether kv heads split over `head_axis` like the query heads (else every device gets
    them all and takes the one its query heads read: MQA/GQA with fewer kv heads than devices).
    """
    n = axis_size(mesh, head_axis)
    if kv_heads % n == 0:
        return True
    if n % kv_heads == 0:
        return False
    raise ValueError(
        f"key/value heads ({kv_heads}) and the size of mesh axis `head_axis`={head_axis!r} ({n}) "
        "must divide one another, so that each device's query heads read whole kv heads."
    )


def local_kv(k, v, *, split: bool, head_axis, heads: int, kv_heads: int, local_heads: int):
    """The kv heads this device's query heads read (all of its own when they are split)."""
    if split or head_axis is None:
        return k, v
    group = heads // kv_heads
    first = local_head_offset(head_axis, local_heads) // group
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, first, 1, axis=1)  # noqa: E731
    return take(k), take(v)


def head_shard_call(ops: Operands, inputs: AttentionInputs, mask, *, batch: int, heads: int,
                    batch_axis, head_axis) -> Callable:
    """Register a call's per-call data, score arrays, layouts and mask arrays for devices that
    each hold every token of their batch and head shard; returns ``call(read, fn, q, k, v)``,
    which runs `fn` on one device's shard inside `jax.shard_map` (`read`: `ops.reader` of
    the body's operands) with the per-call data, score terms and compiled mask as that shard
    sees them (global head ids, the rows of its heads)."""
    local_heads = heads // axis_size(ops.mesh, head_axis)
    data = split_inputs(ops, inputs, batch=batch, heads=heads, batch_axis=batch_axis,
                        head_axis=head_axis)
    terms = inputs.score
    # The score arrays split over the heads like the sinks: each device holds its query
    # heads' rows, and autodiff sums their gradients over the batch shards.
    slopes, table = (None, None) if terms is None else terms.arrays
    score_slots = (ops.add(slopes, P(head_axis)), ops.add(table, P(head_axis, None)))
    layouts = {}
    for name, layout in mask.layouts().items():
        mb, mh = layout.classes.shape[:2]
        layouts[name] = ops.add_layout(
            layout, lead_spec(mb, mh, batch, heads, batch_axis, head_axis))
    arrays, rest = eqx.partition(mask.predicate, eqx.is_array)
    pred_slots = [ops.add(x, P(), constant_ok=True) for x in jax.tree.leaves(arrays)]

    def call(read, fn, q, k, v):
        score = local_score(terms, *map(read, score_slots), head_axis=head_axis,
                            local_heads=local_heads, batch_axis=batch_axis,
                            local_batch=batch // axis_size(ops.mesh, batch_axis))
        if score is not None:
            # Typed like q (varying over the batch axis too), so autodiff sums the score
            # arrays' gradients over the batch shards whatever type a kernel's backward gives
            # them (a launch's outputs vary over no mesh axis).
            slopes, table = typed_like(score.arrays, q)
            score = score.with_arrays(slopes, table, typed_like(score.params, q))
        local_inputs = AttentionInputs(**{n: read(s) for n, s in data.items()}, score=score)
        pred = jax.tree.unflatten(jax.tree.structure(arrays), [read(s) for s in pred_slots])
        shard = mask.layouts()
        shard_layouts = {n: read_layout(read, layouts.get(n), shard.get(n))
                         for n in ("forward", "dq", "dkv")}
        local = local_mask(
            eqx.tree_at(lambda m: m.predicate, mask, eqx.combine(pred, rest)),
            shard_layouts, q_len=mask.q_len, kv_len=mask.kv_len, num_heads=local_heads,
            head_offset=local_head_offset(head_axis, local_heads),
        )
        return fn(q, k, v, local_inputs, local)

    return call


class ShardMap(AbstractSharding):
    """Data and head parallelism: the kernel runs once per device on its batch and head shard.

    Splits ``[B, H, L, D]`` query, key and value over `batch_axis` and `head_axis` of `mesh`
    (either may be ``None``) with `jax.shard_map`; bias, sinks, segment ids and positions are
    split to match (the score terms' slopes and table by head, a score function gets the call's
    head ids), and so are the compiled mask's layouts where they differ by batch (masks
    built from segment ids) or by head (per-head masks). Key/value heads split with their
    query heads (GQA groups stay on one device); with fewer kv heads than devices on the head
    axis, each device takes the kv head its query heads read. No communication is needed:
    every shard is a whole attention problem. Gradients flow; works under `jax.jit`.

    **Arguments:**

    - `mesh`: a `jax.sharding.Mesh`.
    - `batch_axis`: the mesh axis that splits the batch, or ``None``.
    - `head_axis`: the mesh axis that splits the query (and key/value) heads, or ``None``.

    ```python
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    attn = BlockSparseAttention(mask=masks.Causal(),
                                sharding=sharding.ShardMap(mesh, "data", "model"))
    out = attn(q, k, v)   # q [8, 16, 4096, 128]: 2 sequences and 8 heads per device
    ```
    """

    mesh: Mesh = eqx.field(static=True)
    batch_axis: str | None = eqx.field(default=None, static=True)
    head_axis: str | None = eqx.field(default=None, static=True)

    needs_lse: ClassVar[bool] = False
    passes_positions: ClassVar[bool] = False
    passes_score: ClassVar[bool] = True
    loops_kernel: ClassVar[bool] = False
    keeps_bias_axes: ClassVar[bool] = True

    def __check_init__(self):
        check_mesh(self.mesh, {"batch_axis": self.batch_axis, "head_axis": self.head_axis})

    def wrap(self, fn: Callable) -> Callable:
        mesh, b_axis, h_axis = self.mesh, self.batch_axis, self.head_axis

        def run(query, key, value, inputs, mask):
            mesh = mesh_in_context(self.mesh)
            batch, heads = query.shape[:2]
            kv_heads = key.shape[1]
            check_divides("the batch", batch, mesh, b_axis, "batch_axis")
            check_divides("the query heads", heads, mesh, h_axis, "head_axis")
            split_kv = kv_head_plan(heads, kv_heads, mesh, h_axis)
            local_heads = heads // axis_size(mesh, h_axis)
            ops = Operands(mesh)
            q_slot = ops.add(query, P(b_axis, h_axis, None, None))
            kv_spec = P(b_axis, h_axis if split_kv else None, None, None)
            k_slot, v_slot = ops.add(key, kv_spec), ops.add(value, kv_spec)
            call = head_shard_call(ops, inputs, mask, batch=batch, heads=heads,
                                   batch_axis=b_axis, head_axis=h_axis)

            def body(*local):
                read = ops.reader(list(local))
                q, k, v = read(q_slot), read(k_slot), read(v_slot)
                k, v = local_kv(k, v, split=split_kv, head_axis=h_axis, heads=heads,
                                kv_heads=kv_heads, local_heads=local_heads)
                return call(read, fn, q, k, v)

            out = jax.shard_map(body, mesh=mesh, in_specs=tuple(ops.specs),
                                 out_specs=P(b_axis, h_axis, None, None))(*ops.inputs())
            return unsplit_like_query(out, mesh)

        return run
