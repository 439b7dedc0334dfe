"""`RingAttention`: context parallelism; each device keeps its queries and the keys and values
travel around the ring of devices, skipping the (query shard, kv shard) steps the mask leaves
empty."""

import math
from collections.abc import Callable
from typing import ClassVar, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from eqx_bsattn.contract import (
    EMPTY,
    mesh_in_context,
    AbstractSharding,
    add_sinks,
    AttentionInputs,
    BlockLayout,
    CompiledMask,
    build_layout,
    layout_from_classes,
    typed_like,
)

from ._local import (
    LAYOUT_LISTS,
    Operands,
    ShardTokens,
    axis_size,
    check_divides,
    check_mesh,
    lead_spec,
    local_head_offset,
    local_mask,
    take_along,
)
from .shard_map import kv_head_plan, local_kv, split_inputs

_F32 = jnp.float32


class RingSchedule(NamedTuple):
    """What `RingAttention` does for one call, decided at trace time.

    - `order`: ``"contiguous"`` (device ``d`` holds the ``d``-th of ``n`` slices of the
      sequence) or ``"zigzag"`` (slices ``d`` and ``2n - 1 - d`` of ``2n``: under a causal
      mask every device then does the same work at every step).
    - `steps`: the ring steps computed; at step ``t`` device ``d`` attends to the keys of
      device ``(d - t) mod n``.
    - `pairs`: the (query shard, kv shard) pairs computed, or ``None`` where the mask depends
      on per-call data (then each device decides per step on its own data).
    - `hops`: how many times the key/value shards move one device forward and backward along
      the ring.
    """

    order: str
    steps: tuple[int, ...]
    pairs: frozenset[tuple[int, int]] | None
    hops: tuple[int, int]


def _chunks(order: str, n: int, device: int) -> tuple[int, ...]:
    return (device,) if order == "contiguous" else (device, 2 * n - 1 - device)


def _shard_tokens(order: str, n: int, device, length: int) -> ShardTokens:
    """Where device `device`'s (traced) shard of a `length`-token sequence sits in it."""
    piece = length // (n if order == "contiguous" else 2 * n)
    starts = jnp.stack([jnp.asarray(c, jnp.int32) * piece for c in _chunks(order, n, device)])
    return ShardTokens(starts, piece)


def _token_order(order: str, n: int, length: int) -> np.ndarray:
    """Global token index of each position of the sharded sequence (device by device)."""
    pieces = n if order == "contiguous" else 2 * n
    size = length // pieces
    return np.concatenate([np.arange(c * size, (c + 1) * size)
                           for d in range(n) for c in _chunks(order, n, d)])


def _block_order(order: str, n: int, length: int, block: int) -> np.ndarray:
    return _token_order(order, n, length)[::block] // block


def _signed(t: int, n: int) -> int:
    """Ring step `t` as the shortest signed distance: 1 forward hop or ``n - 1`` = 1 back."""
    return t if t <= n // 2 else t - n


def _merge(out_a, lse_a, out_b, lse_b):
    """Combine two partial softmax results by their log-sum-exp (rows that saw nothing have
    ``lse = -inf`` and zero output; never NaN, also in the gradient)."""
    m = jax.lax.stop_gradient(jnp.maximum(lse_a, lse_b))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    total = wa + wb
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)
    out = (wa[..., None] * out_a + wb[..., None] * out_b) / safe[..., None]
    return out, lse


class RingAttention(AbstractSharding):
    """Context parallelism: the sequence is split over `seq_axis`; each device keeps its
    queries, and key/value shards travel around the ring with `jax.lax.ppermute`.

    At ring step ``t`` device ``d`` attends with its queries to the keys and values of device
    ``(d - t) mod n`` and merges the partial result into its own by log-sum-exp (so the
    kernel must return it: `AbstractKernel.returns_lse`); the transfer for the next step is
    issued before the current step's compute, so the two can overlap. The backward pass is
    the same ring run backwards by autodiff: dk/dv travel home by the inverse `ppermute`.

    Sparsity: a step that is empty for every device (no visible pair, decided at trace time
    from a block layout of the mask) is neither computed nor sent; a step empty for some
    devices only is skipped there (`jax.lax.cond`). Shards move forward and backward along
    the ring only as far as the farthest non-empty step: a sliding window narrower than a
    shard needs one neighbour. With segment ids or positions the mask is known only at run
    time: every step is sent and each device skips its empty ones.

    Balance: `order="zigzag"` gives device ``d`` the slices ``d`` and ``2n - 1 - d`` of
    ``2n``, so a causal mask gives every device the same work per step; ``"auto"`` (the
    default) picks the order with less work on the busiest device per step (zig-zag when a
    static mask is causal-like; for masks known only at run time, zig-zag when the mask has a
    causal term). Positions and segment ids stay global: each shard's kernel call gets its
    tokens' global positions, so a mask means the same sharded or not.

    Batch and head axes may split the rest like `ShardMap`. Sequence lengths must split into
    ``n`` (contiguous) or ``2n`` (zig-zag) slices whose lengths are multiples of the kernel's
    tiles.

    **Arguments:**

    - `mesh`: a `jax.sharding.Mesh`.
    - `seq_axis`: the mesh axis that splits the query and key sequences.
    - `batch_axis`, `head_axis`: mesh axes that split the batch and the heads, or ``None``.
    - `order`: ``"auto"``, ``"contiguous"`` or ``"zigzag"``.

    ```python
    mesh = jax.make_mesh((8,), ("seq",))
    attn = BlockSparseAttention(mask=masks.Causal() & masks.SlidingWindow(4096, 0),
                                sharding=sharding.RingAttention(mesh, "seq"))
    out = jax.jit(attn)(q, k, v)   # 64k tokens per device; each device talks to one neighbour
    ```
    """

    mesh: Mesh = eqx.field(static=True)
    seq_axis: str = eqx.field(static=True)
    batch_axis: str | None = eqx.field(default=None, static=True)
    head_axis: str | None = eqx.field(default=None, static=True)
    order: Literal["auto", "contiguous", "zigzag"] = eqx.field(default="auto", static=True)

    needs_lse: ClassVar[bool] = True
    passes_positions: ClassVar[bool] = True

    def __check_init__(self):
        if not isinstance(self.seq_axis, str):
            raise TypeError(f"`seq_axis` must be a mesh axis name; got {self.seq_axis!r}.")
        check_mesh(self.mesh, {"seq_axis": self.seq_axis, "batch_axis": self.batch_axis,
                               "head_axis": self.head_axis})
        if self.order not in ("auto", "contiguous", "zigzag"):
            raise ValueError(
                f"`order` must be 'auto', 'contiguous' or 'zigzag'; got {self.order!r}."
            )

    # --------------------------------------------------------------------------------------
    # The schedule, at trace time.

    def _orders(self, mask: CompiledMask) -> list[str]:
        n = axis_size(self.mesh, self.seq_axis)
        wanted = ["contiguous", "zigzag"] if self.order == "auto" else [self.order]
        fits = []
        for order in wanted:
            pieces = n if order == "contiguous" else 2 * n
            if mask.q_len % pieces or mask.kv_len % pieces:
                continue
            tiles = [(lay.block_q, lay.block_kv) for lay in mask.layouts().values()]
            if any((mask.q_len // pieces) % bq or (mask.kv_len // pieces) % bk
                   for bq, bk in tiles):
                continue
            fits.append(order)
        if not fits:
            tiles = sorted({(lay.block_q, lay.block_kv) for lay in mask.layouts().values()})
            raise ValueError(
                f"RingAttention over {n} devices (`seq_axis`={self.seq_axis!r}) splits the "
                f"sequence into {n} slices (contiguous) or {2 * n} (zig-zag) with `order`="
                f"{self.order!r}; q_len={mask.q_len} and kv_len={mask.kv_len} must be "
                f"multiples of that, and each slice a multiple of the kernel's tiles {tiles}: "
                "pick lengths or a `Tiling` that fit."
            )
        return fits

    def _coarse_classes(self, mask: CompiledMask, inputs: AttentionInputs | None):
        """A block matrix of the whole call at tiles that divide every slice (static: NumPy)."""
        n = axis_size(self.mesh, self.seq_axis)
        fwd = mask.forward
        unit_q = mask.q_len // (2 * n) if mask.q_len % (2 * n) == 0 else mask.q_len // n
        unit_k = mask.kv_len // (2 * n) if mask.kv_len % (2 * n) == 0 else mask.kv_len // n
        bq = math.gcd(unit_q, fwd.block_q if fwd is not None else 128)
        bk = math.gcd(unit_k, fwd.block_kv if fwd is not None else 128)
        if inputs is not None and (
            inputs.q_positions is not None or inputs.kv_positions is not None
            or (mask.uses_segment_ids and inputs.q_segment_ids is not None)
        ) or any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(mask.predicate)):
            return None, bq, bk  # known on the device only (also a mask array traced by jit)
        with jax.ensure_compile_time_eval():
            layout = build_layout(mask.predicate, q_len=mask.q_len, kv_len=mask.kv_len,
                                  num_heads=mask.num_heads, block_q=bq, block_kv=bk)
        return np.asarray(layout.classes), bq, bk

    def _pair_work(self, classes, order: str, bq: int, bk: int, q_len: int, kv_len: int):
        """``[n, n]``: how many blocks each (query shard, kv shard) pair visits."""
        n = axis_size(self.mesh, self.seq_axis)
        visited = (classes != EMPTY).any(axis=(0, 1))  # [nq, nk], over batch and heads
        qo = _block_order(order, n, q_len, bq)
        ko = _block_order(order, n, kv_len, bk)
        grid = visited[qo][:, ko].reshape(n, len(qo) // n, n, len(ko) // n)
        return grid.sum(axis=(1, 3))

    def schedule(self, mask: CompiledMask, inputs: AttentionInputs | None = None) -> RingSchedule:
        """The `RingSchedule` of a call with this compiled mask (and per-call data)."""
        n = axis_size(self.mesh, self.seq_axis)
        orders = self._orders(mask)
        classes, bq, bk = self._coarse_classes(mask, inputs)
        if classes is None:  # known at run time only
            terms = mask.terms
            causal = terms is not None and terms.causal_offset is not None
            order = "zigzag" if causal and "zigzag" in orders else orders[0]
            steps = tuple(range(n))
            pairs = None
        else:
            best = None
            for order in orders:
                work = self._pair_work(classes, order, bq, bk, mask.q_len, mask.kv_len)
                # The busiest device sets each step's time.
                cost = sum(max(work[d, (d - t) % n] for d in range(n)) for t in range(n))
                if best is None or cost < best[0]:
                    best = (cost, order, work)
            _, order, work = best
            pairs = frozenset((d, e) for d in range(n) for e in range(n) if work[d, e] > 0)
            steps = tuple(t for t in range(n) if any((d, (d - t) % n) in pairs for d in range(n)))
        signed = [_signed(t, n) for t in steps]
        hops = (max([s for s in signed if s > 0], default=0),
                max([-s for s in signed if s < 0], default=0))
        return RingSchedule(order, steps, pairs, hops)

    # --------------------------------------------------------------------------------------
    # The run.

    def _step_layouts(self, mask: CompiledMask, order: str, steps) -> dict:
        """For each step, each pass's lists per device: arrays with a leading ``[n]`` axis."""
        n = axis_size(self.mesh, self.seq_axis)
        out, first_name = {}, {}
        for name, layout in mask.layouts().items():
            if id(layout) in first_name:  # passes with equal tiles share one layout
                out.update({(t, name): out[(t, first_name[id(layout)])] for t in steps})
                continue
            first_name[id(layout)] = name
            if layout.bitmaps is not None:
                raise ValueError(
                    "RingAttention cuts layouts per shard and cannot cut element bitmaps; "
                    "this kernel reads bitmaps for this mask: use a kernel that evaluates "
                    "the mask itself (reads='elements'), such as XlaBlockSparse."
                )
            classes = layout.classes
            xp = jnp if isinstance(classes, jax.core.Tracer) else np
            classes = classes if xp is jnp else np.asarray(classes)
            qo = _block_order(order, n, mask.q_len, layout.block_q)
            ko = _block_order(order, n, mask.kv_len, layout.block_kv)
            nq, nk = len(qo) // n, len(ko) // n
            grid = classes[:, :, qo][:, :, :, ko]
            for t in steps:
                per_device = [grid[:, :, d * nq:(d + 1) * nq, e * nk:(e + 1) * nk]
                              for d in range(n) for e in [(d - t) % n]]
                cut = layout_from_classes(
                    xp.stack(per_device), q_len=mask.q_len // n, kv_len=mask.kv_len // n,
                    block_q=layout.block_q, block_kv=layout.block_kv,
                    is_static=layout.is_static,
                )
                out[(t, name)] = cut
        return out

    def wrap(self, fn: Callable) -> Callable:
        mesh, s_axis = self.mesh, self.seq_axis
        b_axis, h_axis = self.batch_axis, self.head_axis
        n = axis_size(mesh, s_axis)

        def run(query, key, value, inputs, mask):
            mesh = mesh_in_context(self.mesh)
            batch, heads, q_len = query.shape[:3]
            kv_heads, kv_len = key.shape[1:3]
            check_divides("the batch", batch, mesh, b_axis, "batch_axis")
            check_divides("the query heads", heads, mesh, h_axis, "head_axis")
            split_kv = kv_head_plan(heads, kv_heads, mesh, h_axis)
            local_heads = heads // axis_size(mesh, h_axis)
            sched = self.schedule(mask, inputs)
            order = sched.order
            q_order = _token_order(order, n, q_len)
            k_order = _token_order(order, n, kv_len)
            permute = order != "contiguous"

            def along(x, axis, idx):
                return x if not permute or x is None else jnp.take(x, idx, axis=axis)

            # Global positions travel with the tokens, so every shard's mask is the call's.
            q_pos, kv_pos = inputs.q_positions, inputs.kv_positions
            if q_pos is None:
                q_pos = jnp.broadcast_to(jnp.asarray(np.arange(q_len, dtype=np.int32)),
                                         (batch, q_len))
            if kv_pos is None:
                kv_pos = jnp.broadcast_to(jnp.asarray(np.arange(kv_len, dtype=np.int32)),
                                          (batch, kv_len))
            bias = inputs.bias
            if bias is not None:
                bias = along(along(bias, 2, q_order), 3, k_order)
            sharded = AttentionInputs(
                bias=bias, sinks=inputs.sinks,
                q_segment_ids=along(inputs.q_segment_ids, 1, q_order),
                kv_segment_ids=along(inputs.kv_segment_ids, 1, k_order),
                q_positions=along(q_pos, 1, q_order), kv_positions=along(kv_pos, 1, k_order),
            )
            ops = Operands(mesh)
            q_slot = ops.add(along(query, 2, q_order), P(b_axis, h_axis, s_axis, None))
            kv_spec = P(b_axis, h_axis if split_kv else None, s_axis, None)
            k_slot = ops.add(along(key, 2, k_order), kv_spec)
            v_slot = ops.add(along(value, 2, k_order), kv_spec)
            data = split_inputs(ops, sharded, batch=batch, heads=heads, batch_axis=b_axis,
                                head_axis=h_axis, q_axis=s_axis, kv_axis=s_axis)
            step_layouts = self._step_layouts(mask, order, sched.steps)
            layout_slots = {}
            slots_of_cut = {}
            for (t, name), cut in step_layouts.items():
                if id(cut) not in slots_of_cut:
                    mb, mh = cut.classes.shape[1:3]
                    lead = lead_spec(mb, mh, batch, heads, b_axis, h_axis)
                    slots_of_cut[id(cut)] = {f: ops.add(getattr(cut, f), P(s_axis, *lead))
                                             for f in LAYOUT_LISTS if getattr(cut, f) is not None}
                layout_slots[(t, name)] = slots_of_cut[id(cut)]
            # Which devices have work at each step: known now for a static mask; for one
            # built from per-call data, from the layout of each pair on the device.
            flags_slot, partial_steps = None, set()
            if sched.pairs is not None:
                flags = np.array([[(d, (d - t) % n) in sched.pairs for d in range(n)]
                                  for t in sched.steps])
                partial_steps = {t for t, row in zip(sched.steps, flags) if not row.all()}
                if partial_steps:
                    flags_slot = ops.add(jnp.asarray(flags.T), P(s_axis, None))
            arrays, rest = eqx.partition(mask.predicate, eqx.is_array)
            pred_slots = [ops.add(x, P(), constant_ok=True) for x in jax.tree.leaves(arrays)]
            q_local, kv_local = q_len // n, kv_len // n

            def body(*local):
                read = ops.reader(list(local))
                q, k, v = read(q_slot), read(k_slot), read(v_slot)
                k, v = local_kv(k, v, split=split_kv, head_axis=h_axis, heads=heads,
                                kv_heads=kv_heads, local_heads=local_heads)
                here = {name: read(slot) for name, slot in data.items()}
                pred = jax.tree.unflatten(jax.tree.structure(arrays),
                                          [read(s) for s in pred_slots])
                call_mask = eqx.tree_at(lambda m: m.predicate, mask, eqx.combine(pred, rest))
                head_offset = local_head_offset(h_axis, local_heads)
                me = jax.lax.axis_index(s_axis)
                flags = None if flags_slot is None else read(flags_slot)[0]

                def compute(t, shard):
                    k_t, v_t, kv_seg, kv_pos = shard
                    layouts = {}
                    for name in ("forward", "dq", "dkv"):
                        slots = layout_slots.get((t, name))
                        if slots is None:
                            layouts[name] = None
                            continue
                        like = step_layouts[(t, name)]
                        layouts[name] = BlockLayout(
                            **{f: read(slot)[0] for f, slot in slots.items()},
                            bitmaps=None, bitmap_index=None, t_bitmap_index=None,
                            q_len=like.q_len, kv_len=like.kv_len, block_q=like.block_q,
                            block_kv=like.block_kv, is_static=like.is_static,
                        )
                    bias_t = here.get("bias")
                    if bias_t is not None:
                        src = (me - t) % n
                        bias_t = jax.lax.dynamic_slice_in_dim(bias_t, src * kv_local, kv_local,
                                                              axis=3)
                    step_inputs = AttentionInputs(
                        bias=bias_t, q_segment_ids=here.get("q_segment_ids"),
                        kv_segment_ids=kv_seg, q_positions=here.get("q_positions"),
                        kv_positions=kv_pos,
                    )
                    step_mask = local_mask(
                        call_mask, layouts, q_len=q_local, kv_len=kv_local,
                        num_heads=local_heads, head_offset=head_offset,
                        q_tokens=_shard_tokens(order, n, me, q_len),
                        kv_tokens=_shard_tokens(order, n, (me - t) % n, kv_len))

                    def attend():
                        out, lse = fn(q, k_t, v_t, step_inputs, step_mask, return_lse=True)
                        return out.astype(_F32), lse.astype(_F32)

                    if sched.pairs is None and layouts["forward"] is not None:
                        # Known on the device only: skip a pair this device's layout leaves empty.
                        work = jnp.any(layouts["forward"].classes != EMPTY)
                    elif flags is not None and t in partial_steps:
                        work = flags[sched.steps.index(t)]
                    else:
                        return attend()

                    def skip():
                        shape = q.shape[:3]
                        out = jnp.zeros(shape + (v_t.shape[-1],), _F32)
                        lse = jnp.full(shape, -jnp.inf, _F32)
                        return typed_like((out, lse), q, k_t, v_t, step_inputs, flags)

                    return jax.lax.cond(work, attend, skip)

                shard0 = (k, v, here.get("kv_segment_ids"), here.get("kv_positions"))
                steps = set(sched.steps)
                fwd_hops, back_hops = sched.hops

                def send(shard, shift):
                    perm = [(d, (d + shift) % n) for d in range(n)]
                    return jax.tree.map(lambda x: jax.lax.ppermute(x, s_axis, perm), shard)

                # Issue each transfer before the compute it overlaps with.
                ahead = send(shard0, 1) if fwd_hops else None
                behind = send(shard0, -1) if back_hops else None
                acc = compute(0, shard0) if 0 in steps else None

                def add(acc, part):
                    return part if acc is None else _merge(*acc, *part)

                for hop in range(1, fwd_hops + 1):
                    current = ahead
                    ahead = send(current, 1) if hop < fwd_hops else None
                    if hop in steps:
                        acc = add(acc, compute(hop, current))
                for hop in range(1, back_hops + 1):
                    current = behind
                    behind = send(current, -1) if hop < back_hops else None
                    if (n - hop) in steps:
                        acc = add(acc, compute(n - hop, current))
                if acc is None:  # nothing visible anywhere
                    out = jnp.zeros(q.shape[:3] + (v.shape[-1],), _F32)
                    return typed_like(out, q, k, v).astype(q.dtype)
                out, lse = acc
                if here.get("sinks") is not None:
                    # Sinks join each row's denominator once, after every shard is merged.
                    out, _ = add_sinks(out, lse, here["sinks"])
                return out.astype(q.dtype)

            out_spec = P(b_axis, h_axis, s_axis, None)
            out = jax.shard_map(body, mesh=mesh, in_specs=tuple(ops.specs),
                                out_specs=out_spec)(*ops.inputs())
            if permute:
                out = take_along(out, np.argsort(q_order), 2, mesh, out_spec)
            return out

        return run
