"""`RingAttention`: context parallelism; each device keeps its queries and the keys and values
travel around the ring of devices, skipping the (query shard, kv shard) steps the mask leaves
empty."""

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from eqx_bsattn.contract import (
    EMPTY,
    PassBlocks,
    Tiling,
    mesh_in_context,
    AbstractSharding,
    ScoreTerms,
    add_sinks,
    AttentionInputs,
    backward_delta,
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
    local_score,
    unsplit_like_query,
)
from .balance import balanced_chunks
from .shard_map import kv_head_plan, local_kv, split_inputs

_F32 = jnp.float32
#: The most slices per device of the ``"balanced"`` order (each pair of slots one ppermute).
_BALANCED_SLICES = 8


class RingSchedule(NamedTuple):
    """What `RingAttention` does for one call, decided at trace time.

    - `order`: ``"contiguous"`` (device ``d`` holds the ``d``-th of ``n`` slices of the
      sequence), ``"zigzag"`` (slices ``d`` and ``2n - 1 - d`` of ``2n``: under a causal
      mask every device then does the same work at every step) or ``"balanced"`` (``c``
      slices of ``c n`` per device, dealt from the block layout so that the devices' visible
      blocks are even: `balanced_chunks`).
    - `steps`: the ring steps computed; at step ``t`` device ``d`` attends to the keys of
      device ``(d - t) mod n``.
    - `pairs`: the (query shard, kv shard) pairs computed, or ``None`` where the mask depends
      on per-call data (then each device decides per step on its own data).
    - `hops`: how many times the key/value shards move one device forward and backward along
      the ring.
    - `work`: the visible blocks each device visits over the whole ring (at the schedule's
      tiles), or ``None`` where the mask depends on per-call data.
    """

    order: str
    steps: tuple[int, ...]
    pairs: frozenset[tuple[int, int]] | None
    hops: tuple[int, int]
    work: tuple[int, ...] | None = None
    #: The slices each device holds, ``chunks[d]`` (sorted) of ``n * len(chunks[d])``.
    chunks: tuple[tuple[int, ...], ...] = ()


def _table(order: str, n: int) -> tuple[tuple[int, ...], ...]:
    """The slices of each device in the contiguous or the zig-zag order."""
    return tuple((d,) if order == "contiguous" else (d, 2 * n - 1 - d) for d in range(n))


def _shard_tokens(chunks, device, length: int) -> ShardTokens:
    """Where device `device`'s (traced) shard of a `length`-token sequence sits in it."""
    piece = length // (len(chunks) * len(chunks[0]))
    starts = jnp.asarray(np.asarray(chunks, np.int32) * piece)[device]
    return ShardTokens(starts, piece)


def _token_order(chunks, length: int) -> np.ndarray:
    """Global token index of each position of the sharded sequence (device by device)."""
    piece = length // (len(chunks) * len(chunks[0]))
    return np.concatenate([np.arange(c * piece, (c + 1) * piece)
                           for row in chunks for c in row])


def _block_order(chunks, length: int, block: int) -> np.ndarray:
    return _token_order(chunks, length)[::block] // block


def _route(x, axis: int, chunks, axis_name: str, *, back: bool = False):
    """Inside `jax.shard_map`: this device's contiguous shard (slices ``c e .. c e + c - 1``
    of ``c n``) -> its slices `chunks[e]` (`back`: the inverse), by one ``ppermute`` of one
    slice per (source slot, target slot) pair that some device uses: no device gathers the
    sequence. Each target slot receives exactly one slice (the others add zeros)."""
    n, c = len(chunks), len(chunks[0])
    home = {g: (d, i) for d, row in enumerate(chunks) for i, g in enumerate(row)}
    parts = jnp.split(x, c, axis=axis)
    out = [jnp.zeros_like(part) for part in parts]
    for j in range(c):
        for i in range(c):
            pairs = [(e, home[e * c + j][0]) for e in range(n) if home[e * c + j][1] == i]
            if not pairs:
                continue
            if back:  # slot i of the holder goes home to slot j
                out[j] = out[j] + jax.lax.ppermute(parts[i], axis_name,
                                                   [(d, e) for e, d in pairs])
            else:
                out[i] = out[i] + jax.lax.ppermute(parts[j], axis_name, pairs)
    return jnp.concatenate(out, axis=axis)


def _zigzag_target(c: int, n: int) -> int:
    """The device that holds slice `c` of ``2n`` in zig-zag order."""
    return c if c < n else 2 * n - 1 - c


def _to_zigzag(x, axis: int, n: int, axis_name: str):
    """Inside `jax.shard_map`: this device's contiguous slice (slices ``2e, 2e + 1`` of
    ``2n`` along `axis`) -> its zig-zag slices ``d, 2n - 1 - d``, by two ``ppermute``s of half
    a shard (a gather of the whole array outside would collect the sequence on every
    device). Device ``d``'s first slice is even when ``d`` is."""
    even, odd = jnp.split(x, 2, axis=axis)
    from_even = jax.lax.ppermute(even, axis_name,
                                 [(e, _zigzag_target(2 * e, n)) for e in range(n)])
    from_odd = jax.lax.ppermute(odd, axis_name,
                                [(e, _zigzag_target(2 * e + 1, n)) for e in range(n)])
    first_even = jax.lax.axis_index(axis_name) % 2 == 0
    first = jnp.where(first_even, from_even, from_odd)
    second = jnp.where(first_even, from_odd, from_even)
    return jnp.concatenate([first, second], axis=axis)


def _from_zigzag(x, axis: int, n: int, axis_name: str):
    """The inverse of `_to_zigzag`."""
    first, second = jnp.split(x, 2, axis=axis)
    first_even = jax.lax.axis_index(axis_name) % 2 == 0
    even = jnp.where(first_even, first, second)
    odd = jnp.where(first_even, second, first)
    even = jax.lax.ppermute(even, axis_name, [(_zigzag_target(2 * e, n), e) for e in range(n)])
    odd = jax.lax.ppermute(odd, axis_name,
                           [(_zigzag_target(2 * e + 1, n), e) for e in range(n)])
    return jnp.concatenate([even, odd], axis=axis)


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


def _sum(a, b):
    return jax.tree.map(jnp.add, a, b)


def _after(shard, result):
    """`shard` (its float arrays), made to depend on `result`, so that sending it waits for
    the step that produced `result`.

    XLA issues a collective as soon as its operand exists: every ``ppermute`` of the ring
    would run first and each device would keep every shard (memory growing with the
    number of devices); an ``optimization_barrier`` does not hold them back on the CPU. The
    zero added is ``min(|r|, 0)`` of one element of `result` (NaN only where `result` is),
    which XLA cannot fold away; it costs one elementwise pass over the shard.
    """
    if result is None:
        return shard
    first = jax.tree.leaves(result)[0]
    r = jax.lax.index_in_dim(first.reshape(-1), 0, keepdims=False).astype(_F32)
    zero = jnp.minimum(jnp.abs(r), 0.0)
    return jax.tree.map(
        lambda x: x + zero.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        shard)


class _Walk(NamedTuple):
    """The ring's positions in the order a `RingSchedule` visits them, at trace time.

    The forward visits step 0 (the own shard), the forward hops ``1 .. f`` (step ``t`` =
    hop), then the backward hops ``1 .. b`` (step ``n - hop``). The backward ring visits the
    backward hops from the farthest inward, then the forward hops from the farthest inward
    down to step 0. Each position is one trip of one `jax.lax.scan`: every step shares one
    loop body, so the kernel's temporaries are those of one step, whatever the number of
    devices. `steps[p]` is the step at forward position ``p`` (the stacked layouts follow
    this order).
    """

    n: int
    fwd_hops: int
    back_hops: int

    @property
    def steps(self) -> tuple[int, ...]:
        return ((0,) + tuple(range(1, self.fwd_hops + 1))
                + tuple(self.n - h for h in range(1, self.back_hops + 1)))

    def forward_table(self) -> dict:
        """Per forward position: its step, and how the shard for the next one arrives (0:
        nothing is sent, 1: the held shard one device forward, 2: one backward, 3: the own
        shard one backward, which starts the backward hops)."""
        f, b = self.fwd_hops, self.back_hops
        sends = [1] * f + [3 if b else 0] + [2] * max(b - 1, 0) + ([0] if b else [])
        return dict(position=np.arange(len(self.steps), dtype=np.int32),
                    step=np.asarray(self.steps, np.int32), send=np.asarray(sends, np.int32))

    def backward_table(self) -> dict:
        """Per backward position: its step, its forward position (for the layouts), how the
        shard for the next position comes (0: kept, 1: the held one from one device back,
        2: from one device forward, 3: the shard held at the last forward hop, 4: the own
        shard) and how the dk/dv accumulator moves on to this position (0: not at all, 1:
        one device forward, 2: one backward, 3: one device forward and home, the backward
        hops' last one, while this position's starts from zero). The first position holds
        the shard held at the last backward hop (or forward, without backward hops)."""
        f, b, n = self.fwd_hops, self.back_hops, self.n
        rows = []  # (step, shard for the next position, accumulator send)
        for i, hop in enumerate(range(b, 0, -1)):
            rows.append((n - hop, 1 if hop >= 2 else 3 if f else 4, 0 if i == 0 else 1))
        for i, hop in enumerate(range(f, -1, -1)):
            acc = (3 if b else 0) if i == 0 else 2
            rows.append((hop, 2 if hop >= 2 else 4 if hop == 1 else 0, acc))
        index = {t: p for p, t in enumerate(self.steps)}
        step, send, acc = map(list, zip(*rows))
        return dict(step=np.asarray(step, np.int32),
                    position=np.asarray([index[t] for t in step], np.int32),
                    send=np.asarray(send, np.int32), acc_send=np.asarray(acc, np.int32))


def _where(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


class _Cut(NamedTuple):
    """How one pass's layout of a (query shard, kv shard) pair reaches the ring's loops.

    `stacked` (a layout known at trace time): the ring hands each device its pairs' lists at
    every position of the walk (``[positions, mb, mh, ...]``, built exactly in NumPy) and a
    step reads them at its position. Otherwise (a layout built from per-call data, or from a
    mask array traced by `jit`): each device gets the class rows of its query blocks over
    every kv block of the call (``rows``, ``[mb, mh, nq, n * nk]`` int8, the kv blocks
    device by device in the ring's order), and each step builds its pair's lists in the loop
    body from the ``nk`` columns of the kv shard it holds, so that no device ever holds the
    lists of other pairs or of other steps. The rest is the cut layout's static metadata
    (per-shard lengths and tiles).
    """

    stacked: bool
    q_len: int
    kv_len: int
    block_q: int
    block_kv: int
    is_static: bool

    def layout(self, arrays: dict, p, src) -> BlockLayout:
        """The pass's `BlockLayout` at forward position `p` (stacked), where the kv shard of
        device `src` is held (rows); both traced. `arrays`: this device's part of the pass's
        arrays (stacked lists, or ``{"rows": ...}``)."""
        meta = dict(q_len=self.q_len, kv_len=self.kv_len, block_q=self.block_q,
                    block_kv=self.block_kv, is_static=self.is_static)
        if not self.stacked:
            nk = self.kv_len // self.block_kv
            classes = jax.lax.dynamic_slice_in_dim(arrays["rows"], src * nk, nk, axis=-1)
            return layout_from_classes(classes, **meta)
        at = {f: jax.lax.dynamic_index_in_dim(x, p, keepdims=False) for f, x in arrays.items()}
        return BlockLayout(**at, bitmaps=None, bitmap_index=None, t_bitmap_index=None, **meta)


@dataclasses.dataclass(frozen=True)
class _DeviceRing:
    """One device's part of a `RingAttention` call, inside `jax.shard_map`: the forward ring
    and the backward ring of its `jax.custom_vjp`, each one `jax.lax.scan` over the walk's
    positions.

    Static context only (the schedule, the slots of the operands, the kernel's function); the
    arrays come in as arguments. The shards of the kv sequence travel as ``(k, v, kv segment
    ids, kv positions)`` tuples (``None`` where absent). Each pass's layout comes as a `_Cut`
    (`layout_cuts`) and the slots of its arrays (`layout_slots`): a static layout's lists of
    every position stacked (``[positions, ...]`` per device) and read at the position, a
    run-time one's class rows, from which each step builds its pair's lists; `work_slot` holds
    which devices work at each position (``None``: every device at every position, or, for
    a mask known on the device only, each device's layout decides). `score` is the static
    part of the score terms each step's kernel call reads (its slopes and table come in as
    differentiated arguments, the rows of this device's query heads), or ``None``.
    """

    fn: Callable
    ops: Operands
    sched: RingSchedule
    walk: _Walk
    n: int
    seq_axis: str
    data: dict
    layout_cuts: dict
    layout_slots: dict
    work_slot: int | None
    pred_slots: list
    arrays: Any
    rest: Any
    mask: CompiledMask
    chunks: tuple
    q_len: int  # per device
    kv_len: int
    local_heads: int
    head_offset: Callable
    score: ScoreTerms | None = None
    #: A score function's `params`: their tree, the slot of each leaf, and which leaves are
    #: float (differentiated, in the ring's `score` argument; the others are read from `aux`).
    param_def: Any = None
    param_slots: tuple = ()
    param_learned: tuple[bool, ...] = ()

    # --------------------------------------------------------------------------------------
    # One step: the kernel's problem for (this device's queries, the kv shard it holds).

    def _problems(self, aux):
        """``problem(t, p, kv_seg, kv_pos) -> (inputs without bias, mask, work)`` for this
        device at step `t` (forward position `p`, both traced), where `work` is ``None``
        (every device works at every position) or a boolean scalar."""
        read = self.ops.reader(aux)
        here = {name: read(slot) for name, slot in self.data.items()}
        pred = jax.tree.unflatten(jax.tree.structure(self.arrays),
                                  [read(s) for s in self.pred_slots])
        call_mask = eqx.tree_at(lambda m: m.predicate, self.mask,
                                eqx.combine(pred, self.rest))
        head_offset = self.head_offset()
        work_flags = None if self.work_slot is None else read(self.work_slot)[0]

        def problem(t, p, kv_seg, kv_pos):
            n, me = self.n, jax.lax.axis_index(self.seq_axis)
            src = (me - t) % n  # the device whose kv shard is held at step `t`
            layouts, built = {}, {}
            for name in ("forward", "dq", "dkv"):
                slots, cut = self.layout_slots.get(name), self.layout_cuts.get(name)
                if slots is None:
                    layouts[name] = None
                    continue
                if id(slots) not in built:  # passes with equal tiles share one layout
                    arrays = {f: read(slot)[0] for f, slot in slots.items()}
                    built[id(slots)] = cut.layout(arrays, p, src)
                layouts[name] = built[id(slots)]
            inputs = dict(q_segment_ids=here.get("q_segment_ids"), kv_segment_ids=kv_seg,
                          q_positions=here.get("q_positions"), kv_positions=kv_pos)
            step_mask = local_mask(
                call_mask, layouts, q_len=self.q_len, kv_len=self.kv_len,
                num_heads=self.local_heads, head_offset=head_offset,
                q_tokens=_shard_tokens(self.chunks, me, n * self.q_len),
                kv_tokens=_shard_tokens(self.chunks, src, n * self.kv_len))
            work = None
            if self.sched.pairs is None and layouts["forward"] is not None:
                # Known on the device only: skip a pair this device's layout leaves empty.
                work = jnp.any(layouts["forward"].classes != EMPTY)
            elif work_flags is not None:
                work = jax.lax.dynamic_index_in_dim(work_flags, p, keepdims=False)
            return inputs, step_mask, work

        return here, problem

    def _bias_at(self, bias, t):
        """The bias columns of the kv shard this device holds at step `t` (a bias without a
        key axis of its own, as it is)."""
        if bias is None or bias.shape[3] == 1:
            return bias
        src = (jax.lax.axis_index(self.seq_axis) - t) % self.n
        return jax.lax.dynamic_slice_in_dim(bias, src * self.kv_len, self.kv_len, axis=3)

    def _add_bias_grad_at(self, dbias_sum, dbias, t):
        """`dbias_sum` with step `t`'s gradient `dbias` of `_bias_at(bias, t)` in its place:
        written into the columns of the kv shard held at `t`, or added where the bias has no
        key axis (every step reads all of it)."""
        if dbias_sum is None:
            return None
        if dbias_sum.shape[3] == 1:
            return dbias_sum + dbias
        src = (jax.lax.axis_index(self.seq_axis) - t) % self.n
        return jax.lax.dynamic_update_slice_in_dim(dbias_sum, dbias, src * self.kv_len, axis=3)

    def _fixed_params(self, aux) -> tuple:
        """The leaves of a score function's `params` that are not differentiated (integer
        and boolean arrays), read from the operands `aux`."""
        read = self.ops.reader(aux)
        return tuple(read(slot) for slot, learned in zip(self.param_slots, self.param_learned)
                     if not learned)

    def _params(self, learned: tuple, fixed: tuple):
        """A score function's `params` rebuilt from its float leaves `learned` and the
        others, `fixed`."""
        if self.param_def is None:
            return None
        learned, fixed = iter(learned), iter(fixed)
        leaves = [next(learned) if flag else next(fixed) for flag in self.param_learned]
        return jax.tree.unflatten(self.param_def, leaves)

    def _kernel(self, inputs, step_mask, fixed):
        def call(q, k, v, bias, score):
            # The step's score terms: positions are the tokens' global ones (`inputs`), so a
            # term means what it means unsharded; `score` is (slopes, table, the float leaves
            # of the function's params), `fixed` the params' other leaves.
            terms = None
            if self.score is not None:
                slopes, table, learned = score
                terms = self.score.with_arrays(slopes, table, self._params(learned, fixed))
            return self.fn(q, k, v, AttentionInputs(bias=bias, score=terms, **inputs),
                           step_mask, return_lse=True)

        return call

    def _send(self, tree, shift: int):
        perm = [(d, (d + shift) % self.n) for d in range(self.n)]
        return jax.tree.map(lambda x: jax.lax.ppermute(x, self.seq_axis, perm), tree)

    def _move(self, how, tree, own=None):
        """`tree` sent by `how` (traced: 0 kept, 1 one device forward, 2 one backward, 3
        the shard of ``own = (shard, result)`` one backward once `result` exists). One
        `jax.lax.switch`: every device takes the same branch."""
        branches = [lambda x, o: x, lambda x, o: self._send(x, 1),
                    lambda x, o: self._send(x, -1)]
        if own is not None:
            branches.append(lambda x, o: self._send(_after(*o), -1))
        return jax.lax.switch(how, branches, tree, own)

    @staticmethod
    def _when(work, compute, skipped, refs):
        """`compute()` where this device works at the step, else `skipped()` (zeros); both
        typed alike (`typed_like` of `refs`), as `jax.lax.cond` wants."""
        if work is None:
            return compute()
        return jax.lax.cond(work, lambda: typed_like(compute(), *refs),
                            lambda: typed_like(skipped(), *refs))

    # --------------------------------------------------------------------------------------
    # The forward ring.

    def _forward(self, q, k, v, bias, score, aux):
        """``(out, lse)`` float32 merged over every step, and the kv shards held at the last
        hop forward and backward (the backward ring starts from them)."""
        here, problem = self._problems(aux)
        fixed = self._fixed_params(aux)
        refs = (q, k, v, bias, score, aux)

        def compute(t, p, shard):
            k_t, v_t, kv_seg, kv_pos = shard
            inputs, step_mask, work = problem(t, p, kv_seg, kv_pos)
            bias_t = self._bias_at(bias, t)

            def attend():
                out, lse = self._kernel(inputs, step_mask, fixed)(q, k_t, v_t, bias_t, score)
                return out.astype(_F32), lse.astype(_F32)

            def skipped():
                shape = q.shape[:3]
                return (jnp.zeros(shape + (v_t.shape[-1],), _F32),
                        jnp.full(shape, -jnp.inf, _F32))

            return self._when(work, attend, skipped, (q, k_t, v_t, bias_t, score, inputs,
                                                      work))

        fwd_hops, back_hops = self.walk.fwd_hops, self.walk.back_hops
        # One type for every shard the loop holds (the carry's).
        shard0 = typed_like((k, v, here.get("kv_segment_ids"), here.get("kv_positions")), *refs)

        def body(carry, row):
            incoming, far, acc = carry
            # This step starts, and the next shard leaves, once the previous step is done:
            # one transfer overlaps one compute, and at most two shards are held at a time.
            held = _after(incoming, acc)
            far = _where(row["position"] == fwd_hops, held, far)
            incoming = self._move(row["send"], held, (shard0, acc))
            acc = _merge(*acc, *compute(row["step"], row["position"], held))
            return typed_like((incoming, far, acc), *refs), None

        # Rows that saw nothing yet: zero output, lse -inf (merging into them is exact).
        empty = (jnp.zeros(q.shape[:3] + (v.shape[-1],), _F32),
                 jnp.full(q.shape[:3], -jnp.inf, _F32))
        start = typed_like((shard0, shard0, empty), *refs)
        (last, far, acc), _ = jax.lax.scan(body, start, self.walk.forward_table())
        # After the last position nothing is sent: `last` is the shard held there.
        return acc, (far, last if back_hops else shard0)

    # --------------------------------------------------------------------------------------
    # The backward ring.

    def _backward(self, residuals, cotangents):
        """Cotangents of ``(q, k, v, bias, score)`` from a second ring pass.

        Each step recomputes its partial result with the kernel and pulls back through it
        (`jax.vjp`): with the step's log-sum-exp ``lse_t`` and the merged ``lse``, its weight
        in the merged output is ``w = exp(lse_t - lse)``; the cotangents ``w * dO`` for its
        output and ``w * (rowsum(dO * O_t) - rowsum(dO * O) + dlse)`` for its log-sum-exp
        make the kernel's backward see ``p = exp(s - lse)`` and ``delta = w * (rowsum(dO *
        O) - dlse)``, the terms of the merged softmax. The kv shards walk the ring again from
        the farthest hop inward, each with its dk/dv accumulator, so that the accumulators
        arrive home with the last hop; steps skipped by the forward are skipped here. dq,
        dbias and the score arrays' gradients stay on the device, summed over its steps
        (autodiff then sums the score's over the devices that share them).
        """
        q, k, v, bias, score, aux, out, lse, far = residuals
        d_out, d_lse = cotangents
        here, problem = self._problems(aux)
        fixed = self._fixed_params(aux)
        seen = jnp.isfinite(lse)
        # rowsum(dO * O) - dlse: the merged softmax's diagonal term, per row.
        delta = backward_delta(d_out, out, d_lse, lse)
        refs = (q, k, v, bias, score, aux, d_out, lse)
        f32_zeros = lambda x: None if x is None else jnp.zeros(x.shape, _F32)  # noqa: E731
        tree_zeros = lambda t: jax.tree.map(f32_zeros, t)  # noqa: E731  (None stays None)

        def grads(t, p, shard):
            k_t, v_t, kv_seg, kv_pos = shard
            inputs, step_mask, work = problem(t, p, kv_seg, kv_pos)
            bias_t = self._bias_at(bias, t)

            def pull():
                (out_t, lse_t), pullback = jax.vjp(self._kernel(inputs, step_mask, fixed),
                                                   q, k_t, v_t, bias_t, score)
                w = jnp.where(seen, jnp.exp(lse_t.astype(_F32) - jnp.where(seen, lse, 0.0)),
                              0.0)
                own = backward_delta(d_out, out_t)
                dq, dk, dv, dbias, dscore = pullback(
                    ((w[..., None] * d_out).astype(out_t.dtype), w * (own - delta)))
                f32 = lambda x: None if x is None else x.astype(_F32)  # noqa: E731
                return (dq.astype(_F32), (dk.astype(_F32), dv.astype(_F32)), f32(dbias),
                        jax.tree.map(f32, dscore))

            def skipped():
                return (f32_zeros(q), (f32_zeros(k_t), f32_zeros(v_t)), f32_zeros(bias_t),
                        tree_zeros(score))

            return self._when(work, pull, skipped, (q, k_t, v_t, bias_t, score, inputs, work,
                                                    d_out, lse))

        shard0, far = typed_like(((k, v, here.get("kv_segment_ids"), here.get("kv_positions")),
                                  far), *refs)
        zero_kv = (jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))

        def body(carry, row):
            shard, acc, home, dq_sum, dbias_sum, dscore_sum = carry
            # The accumulator of the shard held now comes from the neighbour while this step
            # computes (at the first forward hop, the backward hops' last goes home instead).
            moves = [lambda a, h: (a, h), lambda a, h: (self._send(a, 1), h),
                     lambda a, h: (self._send(a, -1), h)]
            if home is not None:
                moves.append(lambda a, h: (typed_like(zero_kv, *refs), self._send(a, 1)))
            acc, home = jax.lax.switch(row["acc_send"], moves, acc, home)
            # This step starts, and the next shard leaves, once the previous step is done
            # (as in the forward).
            shard = _after(shard, dq_sum)
            following = jax.lax.switch(row["send"], [
                lambda x: x, lambda x: self._send(x, 1), lambda x: self._send(x, -1),
                lambda x: far[0], lambda x: shard0], shard)
            t = row["step"]
            dq, part, dbias, dscore = grads(t, row["position"], shard)
            dbias_sum = self._add_bias_grad_at(dbias_sum, dbias, t)
            carry = (following, _sum(acc, part), home, dq_sum + dq, dbias_sum,
                     _sum(dscore_sum, dscore))
            return typed_like(carry, *refs), None

        # dq, dbias and the score arrays' gradients stay on the device, summed step by step.
        first = far[1] if self.walk.back_hops else far[0] if self.walk.fwd_hops else shard0
        start = (first, zero_kv, zero_kv if self.walk.back_hops else None,
                 jnp.zeros(q.shape, _F32), f32_zeros(bias), tree_zeros(score))
        carry, _ = jax.lax.scan(body, typed_like(start, *refs), self.walk.backward_table())
        _, dkv, home, dq, dbias, dscore = carry
        dkv = _sum(dkv, home) if self.walk.back_hops else dkv
        cts = typed_like((dq, *dkv, dbias, dscore), q, k, v, bias, score)
        # Each cotangent in its input's dtype (None where the input is None).
        return (*jax.tree.map(lambda c, x: c.astype(x.dtype), cts, (q, k, v, bias, score)),
                None)

    def attend(self, q, k, v, bias, score, aux):
        """``(out, lse)`` float32 of this device's queries over the whole kv sequence;
        `score` is ``(slopes, table, learned)``: the rows of this device's query heads
        (``None`` where off) and the float leaves of a score function's `params` (a tuple)."""

        @jax.custom_vjp
        def ring(q, k, v, bias, score, aux):
            return self._forward(q, k, v, bias, score, aux)[0]

        def ring_fwd(q, k, v, bias, score, aux):
            (out, lse), far = self._forward(q, k, v, bias, score, aux)
            return (out, lse), (q, k, v, bias, score, aux, out, lse, far)

        ring.defvjp(ring_fwd, self._backward)
        return ring(q, k, v, bias, score, aux)


class RingAttention(AbstractSharding):
    """Context parallelism: the sequence is split over `seq_axis`; each device keeps its
    queries, and key/value shards travel around the ring with `jax.lax.ppermute`.

    At ring step ``t`` device ``d`` attends with its queries to the keys and values of device
    ``(d - t) mod n`` and merges the partial result into its own by log-sum-exp (so the
    kernel must be an `AbstractLseKernel`); the transfer for the next step is
    issued before the current step's compute, so the two can overlap, and after the step
    before it, so a device holds two kv shards at a time. The backward pass is a ring of its
    own (a `jax.custom_vjp`): the forward saves the device's shards, the merged output and
    log-sum-exp; the kv shards walk the ring again with their dk/dv accumulators, which
    arrive home with the last hop, and each step pulls back through the kernel. Each ring
    is one `jax.lax.scan` over its steps (the kernel is traced once), so memory per device
    is set by the shard, not by the number of devices.

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
    tokens' global positions, so a mask means the same sharded or not, and so do score terms
    (`score=`): each step's call evaluates them at those positions, on the slopes' and
    table's rows of the device's query heads (a score function gets the call's head ids and
    its `params` whole), and their gradients are summed over the steps and the devices that
    share the arrays.

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
    order: Literal["auto", "contiguous", "zigzag", "balanced"] = eqx.field(default="auto",
                                                                           static=True)

    needs_lse: ClassVar[bool] = True
    passes_positions: ClassVar[bool] = True
    passes_score: ClassVar[bool] = True
    # Each ring is one `jax.lax.scan`; the backward's body recomputes the step's forward.
    loops_kernel: ClassVar[bool] = True
    keeps_bias_axes: ClassVar[bool] = True

    def __check_init__(self):
        if not isinstance(self.seq_axis, str):
            raise TypeError(f"`seq_axis` must be a mesh axis name; got {self.seq_axis!r}.")
        check_mesh(self.mesh, {"seq_axis": self.seq_axis, "batch_axis": self.batch_axis,
                               "head_axis": self.head_axis})
        if self.order not in ("auto", "contiguous", "zigzag", "balanced"):
            raise ValueError(
                "`order` must be 'auto', 'contiguous', 'zigzag' or 'balanced'; got "
                f"{self.order!r}."
            )

    def fit_tiling(self, tiling, kernel, features):
        """An automatic tiling shrunk so that each pass's tiles divide every slice of the
        sequence: the ``2n`` slices of the zig-zag order where the lengths split into them
        (and `order` allows it), so that ``"auto"`` may choose either order, else the ``n``
        contiguous ones. Each tile becomes its greatest common divisor with the slice."""
        n = axis_size(self.mesh, self.seq_axis)
        zigzag = (self.order != "contiguous" and features.q_len % (2 * n) == 0
                  and features.kv_len % (2 * n) == 0)
        pieces = 2 * n if zigzag else n
        if features.q_len % pieces or features.kv_len % pieces:
            return tiling  # the call refuses the lengths (`_orders`), saying what fits
        slice_q, slice_k = features.q_len // pieces, features.kv_len // pieces
        blocks = tiling.blocks
        fitted = PassBlocks(*((math.gcd(q, slice_q), math.gcd(k, slice_k)) for q, k in blocks))
        if fitted == blocks:
            return tiling
        (bq, bk), (dq_q, dq_k), (kv_q, kv_k) = fitted
        return kernel.adapt_tiling(
            Tiling(block_q=bq, block_kv=bk, block_q_bwd=kv_q, block_kv_bwd=kv_k,
                   block_q_dq=dq_q, block_kv_dq=dq_k), features)

    def kernel_decline(self, kernel, mask, features):
        """Where `kernel`'s heuristic tiles, shrunk to fit the slices (`fit_tiling`), divide
        the slices of no order this ring may take (a kernel with a least tile, as a TPU's 128
        lanes, on short slices): the tiles and the contiguous slices, in one line."""
        try:
            tiling = kernel.adapt_tiling(kernel.default_tiling(features, mask), features)
            tiling = self.fit_tiling(tiling, kernel, features)
        except ValueError as e:
            return f"its tiles cannot fit the ring's slices: {e}"
        tiles = sorted({tuple(b) for b in tiling.blocks})
        n = axis_size(self.mesh, self.seq_axis)
        if (features.q_len % n or features.kv_len % n
                or self._fitting_orders(features.q_len, features.kv_len, tiles)):
            return None  # it fits, or the lengths fit no order whatever the kernel
        return (f"its least tiles {tiles} divide no slicing of the sequence the ring may take "
                f"(`order`={self.order!r}; contiguous slices of {features.q_len // n} x "
                f"{features.kv_len // n} tokens over {n} device{'s' if n > 1 else ''}).")

    # --------------------------------------------------------------------------------------
    # The schedule, at trace time.

    def _slices(self, q_len: int, kv_len: int, tiles, order: str) -> int | None:
        """Slices per device of `order` for a call of these lengths and tiles (the most, up
        to `_BALANCED_SLICES`, for ``"balanced"``), or ``None`` where the lengths and tiles
        do not split into them."""
        n = axis_size(self.mesh, self.seq_axis)
        options = {"contiguous": (1,), "zigzag": (2,),
                   "balanced": tuple(range(_BALANCED_SLICES, 1, -1))}[order]
        for c in options:
            pieces = n * c
            if q_len % pieces or kv_len % pieces:
                continue
            if any((q_len // pieces) % bq or (kv_len // pieces) % bk for bq, bk in tiles):
                continue
            return c
        return None

    def _fitting_orders(self, q_len: int, kv_len: int, tiles) -> dict[str, int]:
        """``{order: slices per device}`` of the orders that fit these lengths and tiles."""
        wanted = (["contiguous", "zigzag", "balanced"] if self.order == "auto"
                  else [self.order])
        return {order: c for order in wanted
                if (c := self._slices(q_len, kv_len, tiles, order)) is not None}

    def _orders(self, mask: CompiledMask) -> dict[str, int]:
        """``{order: slices per device}`` of the orders that fit this call."""
        n = axis_size(self.mesh, self.seq_axis)
        tiles = sorted({(lay.block_q, lay.block_kv) for lay in mask.layouts().values()})
        fits = self._fitting_orders(mask.q_len, mask.kv_len, tiles)
        if not fits and (mask.q_len % n or mask.kv_len % n):
            raise ValueError(
                f"RingAttention over {n} devices (`seq_axis`={self.seq_axis!r}) needs "
                f"q_len and kv_len that are multiples of {n}; got q_len={mask.q_len}, "
                f"kv_len={mask.kv_len}: pad the sequence (and hide the padding with "
                f"kv_seq_lengths or segment ids).")
        if not fits:
            raise ValueError(
                f"RingAttention over {n} devices (`seq_axis`={self.seq_axis!r}) splits the "
                f"sequence into {n} slices (contiguous), {2 * n} (zig-zag) or more (balanced) "
                f"with `order`={self.order!r}; q_len={mask.q_len} and kv_len={mask.kv_len} "
                f"must be multiples of that, and each slice a multiple of the kernel's tiles "
                f"{tiles}: pick lengths or a `Tiling` that fit."
            )
        return fits

    def _coarse_classes(self, mask: CompiledMask, inputs: AttentionInputs | None,
                        slices: int):
        """A block matrix of the whole call at tiles that divide every slice (static: NumPy),
        `slices` per device."""
        n = axis_size(self.mesh, self.seq_axis)
        fwd = mask.forward
        bq = math.gcd(mask.q_len // (n * slices), fwd.block_q if fwd is not None else 128)
        bk = math.gcd(mask.kv_len // (n * slices), fwd.block_kv if fwd is not None else 128)
        if inputs is not None and (
            inputs.q_positions is not None or inputs.kv_positions is not None
            or (mask.uses_segment_ids and inputs.q_segment_ids is not None)
        ) or any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(mask.predicate)):
            return None, bq, bk  # known on the device only (also a mask array traced by jit)
        with jax.ensure_compile_time_eval():
            layout = build_layout(mask.predicate, q_len=mask.q_len, kv_len=mask.kv_len,
                                  num_heads=mask.num_heads, block_q=bq, block_kv=bk)
        return np.asarray(layout.classes), bq, bk

    def _balanced_table(self, classes, slices: int, bq: int):
        """The ``"balanced"`` order's slices per device, from the visible blocks of each
        query slice (`balanced_chunks`)."""
        n = axis_size(self.mesh, self.seq_axis)
        rows = (classes != EMPTY).any(axis=(0, 1)).sum(axis=1)  # per coarse query block
        work = rows.reshape(n * slices, -1).sum(axis=1)
        return tuple(tuple(int(c) for c in row) for row in balanced_chunks(work, n))

    def _pair_work(self, classes, chunks, bq: int, bk: int, q_len: int, kv_len: int):
        """``[n, n]``: how many blocks each (query shard, kv shard) pair visits."""
        n = axis_size(self.mesh, self.seq_axis)
        visited = (classes != EMPTY).any(axis=(0, 1))  # [nq, nk], over batch and heads
        qo = _block_order(chunks, q_len, bq)
        ko = _block_order(chunks, kv_len, bk)
        grid = visited[qo][:, ko].reshape(n, len(qo) // n, n, len(ko) // n)
        return grid.sum(axis=(1, 3))

    def schedule(self, mask: CompiledMask, inputs: AttentionInputs | None = None) -> RingSchedule:
        """The `RingSchedule` of a call with this compiled mask (and per-call data)."""
        n = axis_size(self.mesh, self.seq_axis)
        orders = self._orders(mask)
        classes, bq, bk = self._coarse_classes(mask, inputs, max(orders.values()))
        if classes is None:  # known at run time only
            orders.pop("balanced", None)  # dealt from a layout known at trace time
            if not orders:
                raise ValueError("RingAttention(order='balanced') deals slices from a layout "
                                 "known at trace time; this mask depends on per-call data: "
                                 "use dispatch_documents on the host, or another order.")
            terms = mask.terms
            causal = terms is not None and terms.causal_offset is not None
            order = "zigzag" if causal and "zigzag" in orders else next(iter(orders))
            chunks = _table(order, n)
            steps = tuple(range(n))
            pairs = None
        else:
            best = None
            for order, slices in orders.items():  # contiguous, zig-zag, balanced: ties to
                chunks = (self._balanced_table(classes, slices, bq) if order == "balanced"
                          else _table(order, n))  # the earlier
                work = self._pair_work(classes, chunks, bq, bk, mask.q_len, mask.kv_len)
                # The busiest device sets each step's time.
                cost = sum(max(work[d, (d - t) % n] for d in range(n)) for t in range(n))
                if best is None or cost < best[0]:
                    best = (cost, order, work, chunks)
            _, order, work, chunks = best
            pairs = frozenset((d, e) for d in range(n) for e in range(n) if work[d, e] > 0)
            steps = tuple(t for t in range(n) if any((d, (d - t) % n) in pairs for d in range(n)))
        signed = [_signed(t, n) for t in steps]
        hops = (max([s for s in signed if s > 0], default=0),
                max([-s for s in signed if s < 0], default=0))
        per_device = None if classes is None else tuple(int(w) for w in work.sum(axis=1))
        return RingSchedule(order, steps, pairs, hops, per_device, chunks)

    # --------------------------------------------------------------------------------------
    # The run.

    def _cut_layouts(self, mask: CompiledMask, chunks, steps) -> dict:
        """``{pass: (_Cut, {name: array with a leading [n] axis})}``: how each pass's layout
        reaches the devices. Passes with equal tiles share one dict.

        A layout known at trace time (NumPy classes) is cut here into every (query shard, kv
        shard) pair of every step in `steps` and its lists are stacked in `steps`' order
        (``[n, len(steps), ...]``; index lists padded with 0 to the longest step's capacity,
        the counts say how much of them is read). A layout built on the device (traced
        classes) gives each device the class rows of its query blocks over the call's kv
        blocks (``rows``, ``[n, mb, mh, nq, n * nk]``, the kv blocks in the devices' order),
        and each step builds its pair's lists inside the ring's loops (`_Cut.layout`): lists
        of every pair and step built here would be materialised together, on every device.
        """
        n = axis_size(self.mesh, self.seq_axis)
        out, first_name = {}, {}
        for name, layout in mask.layouts().items():
            if id(layout) in first_name:  # passes with equal tiles share one layout
                out[name] = out[first_name[id(layout)]]
                continue
            first_name[id(layout)] = name
            if layout.bitmaps is not None:
                raise ValueError(
                    "RingAttention cuts layouts per shard and cannot cut element bitmaps; "
                    "this kernel reads bitmaps for this mask: use a kernel that evaluates "
                    "the mask itself (reads='elements'), such as XlaBlockSparse."
                )
            classes = layout.classes
            stacked = not isinstance(classes, jax.core.Tracer)
            classes = np.asarray(classes) if stacked else classes
            qo = _block_order(chunks, mask.q_len, layout.block_q)
            ko = _block_order(chunks, mask.kv_len, layout.block_kv)
            nq, nk = len(qo) // n, len(ko) // n
            grid = classes[:, :, qo][:, :, :, ko]
            cut = _Cut(stacked, q_len=mask.q_len // n, kv_len=mask.kv_len // n,
                       block_q=layout.block_q, block_kv=layout.block_kv,
                       is_static=layout.is_static)
            if not stacked:
                mb, mh = grid.shape[:2]
                rows = jnp.moveaxis(grid.reshape(mb, mh, n, nq, n * nk), 2, 0)
                out[name] = (cut, {"rows": rows})
                continue
            per_step = []
            for t in steps:
                per_device = [grid[:, :, d * nq:(d + 1) * nq, e * nk:(e + 1) * nk]
                              for d in range(n) for e in [(d - t) % n]]
                per_step.append(layout_from_classes(
                    np.stack(per_device), q_len=cut.q_len, kv_len=cut.kv_len,
                    block_q=cut.block_q, block_kv=cut.block_kv, is_static=cut.is_static))
            lists = {}
            for f in LAYOUT_LISTS:
                arrays = [getattr(c, f) for c in per_step]
                if arrays[0] is None:
                    continue
                width = max(x.shape[-1] for x in arrays)
                pad = lambda x: jnp.pad(  # noqa: E731
                    x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
                lists[f] = jnp.stack([pad(x) for x in arrays], axis=1)
            out[name] = (cut, lists)
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
            k_order = _token_order(sched.chunks, kv_len)
            permute = order != "contiguous"

            # Global positions travel with the tokens, so every shard's mask is the call's.
            q_pos, kv_pos = inputs.q_positions, inputs.kv_positions
            if q_pos is None:
                q_pos = jnp.broadcast_to(jnp.asarray(np.arange(q_len, dtype=np.int32)),
                                         (batch, q_len))
            if kv_pos is None:
                kv_pos = jnp.broadcast_to(jnp.asarray(np.arange(kv_len, dtype=np.int32)),
                                          (batch, kv_len))
            bias = inputs.bias
            if bias is not None and bias.shape[3] > 1:
                # Every device keeps all key columns (a per-key bias too: O(Lk)): their order
                # is a local gather. The query axis is split and reordered inside the shard_map
                # (`_to_zigzag`) where the bias has one; a size-1 axis is shared by all devices.
                bias = bias if not permute else jnp.take(bias, k_order, axis=3)
            sharded = AttentionInputs(
                bias=bias, sinks=inputs.sinks, q_segment_ids=inputs.q_segment_ids,
                kv_segment_ids=inputs.kv_segment_ids, q_positions=q_pos, kv_positions=kv_pos,
            )
            ops = Operands(mesh)
            q_slot = ops.add(query, P(b_axis, h_axis, s_axis, None))
            kv_spec = P(b_axis, h_axis if split_kv else None, s_axis, None)
            k_slot = ops.add(key, kv_spec)
            v_slot = ops.add(value, kv_spec)
            data = split_inputs(ops, sharded, batch=batch, heads=heads, batch_axis=b_axis,
                                head_axis=h_axis, q_axis=s_axis, kv_axis=s_axis)
            # The score arrays split over the heads like ShardMap's (every sequence and batch
            # shard holds its query heads' rows); each step's call reads them at the tokens'
            # global positions, and a score function gets the call's head ids.
            # A score function's `params` reach every device whole; their float leaves are
            # differentiated like the slopes (summed over the steps on the device, then by
            # autodiff over the devices), the others are read as they are.
            terms = inputs.score
            slopes, table = (None, None) if terms is None else terms.arrays
            score_slots = (ops.add(slopes, P(h_axis)), ops.add(table, P(h_axis, None)))
            params = None if terms is None else terms.params
            param_leaves, param_def = jax.tree.flatten(params)
            param_slots = tuple(ops.add(x, P()) for x in param_leaves)
            param_learned = tuple(bool(jnp.issubdtype(x.dtype, jnp.inexact))
                                  for x in param_leaves)
            learned_slots = tuple(s for s, f in zip(param_slots, param_learned) if f)
            score_like = local_score(terms, None, None, head_axis=h_axis,
                                     local_heads=local_heads, batch_axis=b_axis,
                                     local_batch=batch // axis_size(mesh, b_axis))
            if score_like is not None:  # the arrays come in as the ring's arguments
                score_like = score_like.with_arrays(None, None, None)
            walk = _Walk(n, *sched.hops)
            # Each pass's layout per device: its lists at every position of the walk
            # ([n, positions, mb, mh, ...]), or the class rows its steps build them from
            # ([n, mb, mh, nq, n * nk]).
            cuts = self._cut_layouts(mask, sched.chunks, walk.steps)
            layout_cuts, layout_slots, slots_of_cut = {}, {}, {}
            for name, (cut, parts) in cuts.items():
                if id(parts) not in slots_of_cut:
                    if cut.stacked:
                        mb, mh = parts["classes"].shape[2:4]
                        spec = P(s_axis, None, *lead_spec(mb, mh, batch, heads, b_axis, h_axis))
                    else:
                        mb, mh = parts["rows"].shape[1:3]
                        spec = P(s_axis, *lead_spec(mb, mh, batch, heads, b_axis, h_axis))
                    slots_of_cut[id(parts)] = {f: ops.add(x, spec) for f, x in parts.items()}
                layout_cuts[name], layout_slots[name] = cut, slots_of_cut[id(parts)]
            # Which devices have work at each position: known now for a static mask; for one
            # built from per-call data, from the layout of each pair on the device.
            work_slot = None
            if sched.pairs is not None:
                flags = np.array([[(d, (d - t) % n) in sched.pairs for t in walk.steps]
                                  for d in range(n)])
                if not flags.all():
                    work_slot = ops.add(jnp.asarray(flags), P(s_axis, None))
            arrays, rest = eqx.partition(mask.predicate, eqx.is_array)
            pred_slots = [ops.add(x, P(), constant_ok=True) for x in jax.tree.leaves(arrays)]
            q_local, kv_local = q_len // n, kv_len // n

            device_ring = _DeviceRing(
                fn=fn, ops=ops, sched=sched, walk=walk, n=n, seq_axis=s_axis, data=data,
                layout_cuts=layout_cuts, layout_slots=layout_slots, work_slot=work_slot,
                pred_slots=pred_slots, arrays=arrays,
                rest=rest, mask=mask, chunks=sched.chunks, q_len=q_local, kv_len=kv_local,
                local_heads=local_heads, head_offset=lambda: local_head_offset(h_axis,
                                                                               local_heads),
                score=score_like, param_def=None if params is None else param_def,
                param_slots=param_slots, param_learned=param_learned,
            )
            diff_slots = {q_slot, k_slot, v_slot, data.get("bias"), *score_slots,
                          *learned_slots}

            # The operands split along the sequence, and that axis.
            seq_dims = {q_slot: 2, k_slot: 2, v_slot: 2}
            if bias is not None and bias.shape[2] > 1:
                seq_dims[data["bias"]] = 2
            seq_dims.update({data.get(name): 1 for name in (
                "q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions")})

            def reorder(x, axis, back=False):  # contiguous slices <-> the order's
                if order == "zigzag":
                    return (_from_zigzag if back else _to_zigzag)(x, axis, n, s_axis)
                return _route(x, axis, sched.chunks, s_axis, back=back)

            def body(*local):
                if permute:  # contiguous slices in, zig-zag slices on the devices
                    local = [reorder(x, seq_dims[slot]) if slot in seq_dims else x
                             for (slot, _), x in zip(ops.arrays, local)]
                read = ops.reader(list(local))
                q, k, v = read(q_slot), read(k_slot), read(v_slot)
                k, v = local_kv(k, v, split=split_kv, head_axis=h_axis, heads=heads,
                                kv_heads=kv_heads, local_heads=local_heads)
                bias, sinks = read(data.get("bias")), read(data.get("sinks"))
                score = (*map(read, score_slots), tuple(map(read, learned_slots)))
                if not sched.steps:  # nothing visible anywhere
                    out = jnp.zeros(q.shape[:3] + (v.shape[-1],), q.dtype)
                    return typed_like(out, q, k, v, bias)
                # The rest of the operands (never differentiated), without the ones above.
                aux = [None if slot in diff_slots else x
                       for (slot, _), x in zip(ops.arrays, local)]
                # One type for the differentiated operands: the ring's backward gives each
                # cotangent that type, and autodiff sums where an input is shared by devices
                # (the score arrays over the sequence and batch shards).
                diff = typed_like((q, k, v, bias, score), q, k, v, bias, score)
                out, lse = device_ring.attend(*diff, aux)
                if sinks is not None:
                    # Sinks join each row's denominator once, after every shard is merged.
                    out, _ = add_sinks(out, lse, sinks)
                out = out.astype(q.dtype)
                return reorder(out, 2, back=True) if permute else out

            out_spec = P(b_axis, h_axis, s_axis, None)
            out = jax.shard_map(body, mesh=mesh, in_specs=tuple(ops.specs),
                                out_specs=out_spec)(*ops.inputs())
            return unsplit_like_query(out, mesh)

        return run
