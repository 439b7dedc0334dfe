"""The backward launches of `MosaicBlockSparse`: a dq kernel and a dk/dv kernel in Pallas Mosaic
GPU, each warp-specialised like the forward (a TMA memory warpgroup, two compute warpgroups).

- `dq_call`: one CTA per (head, q-tile of 128 rows, batch) walks the q-tile's kv-block list of
  the dq layout (FULL, then PARTIAL). The memory warpgroup streams each block's K and V tiles
  into a ring of shared-memory slots; each compute warpgroup (64 rows, its Q and dO tiles in
  shared memory, its rows' log-sum-exp and delta in registers) recomputes
  ``P = exp2(S * scale * log2 e - lse)``, forms ``dP = dO V^T`` and ``dS = P (dP - delta)``,
  and accumulates ``dq += dS K``.
- `dkv_call`: one CTA per (head, kv-tile of 128 keys, batch) walks the kv-tile's transposed
  list of the dk/dv layout. The memory warpgroup streams each q-block's Q and dO tiles; each
  compute warpgroup (64 keys, its K and V tiles in shared memory) forms ``S^T = K Q^T`` and
  ``dP^T = V dO^T``, reads the block's log-sum-exp and delta, and accumulates
  ``dv += P^T dO`` and ``dk += dS^T Q``. dk / dv come out per query head; the caller sums a
  group's heads (deterministic, no atomics).
- `dkv_call` with a dq accumulator is the single pass: it also forms each block's dq partial
  ``dS K`` and adds it into a float32 dq in global memory by TMA reduce-add (5 block products
  a block instead of the two kernels' 7; dq then varies from run to run in its last bits).

Partial blocks evaluate the same predicate as the forward (`common.visible`, the segment ids
apart and the key length tested only where keys were padded); FULL blocks run none. Rows
whose log-sum-exp is +inf (they see no key) get ``P = 0`` and contribute nothing.

Arrays are batched ``[B, H, L, D]`` with lengths padded to 128 (the caller pads: Q, dO with
zeros, the log-sum-exp with +inf, delta with zeros). Mosaic GPU is imported when a launch is
traced, so this module imports anywhere.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from .common import (COMPUTE_REGISTERS, COMPUTE_WARPGROUPS, LOG2E, ROWS_PER_WARPGROUP,
                     AttentionShape, Ops, list_bounds, list_entry, memory_warpgroup, ring_stages,
                     segment_ids_apart, swizzled, visible, walk_list)

#: Rows of a CTA's own tile: q rows in the dq kernel, keys in the dk/dv kernel.
BLOCK_OWN = ROWS_PER_WARPGROUP * COMPUTE_WARPGROUPS


def backward_blocks(head_dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(dq (block_q, block_kv), dk/dv (block_q, block_kv))``: the layouts' tiles, chosen so
    the accumulators (S, dP and dq; or S^T, dP^T, dk and dv) of a 64-row warpgroup fit its
    registers."""
    return (BLOCK_OWN, 128 if head_dim <= 64 else 64), (64, BLOCK_OWN)


@dataclasses.dataclass(frozen=True)
class BackwardConfig(AttentionShape):
    """Everything static about the two backward launches (hashable); lengths padded to 128."""

    #: Keys per block of the dq layout, queries per block of the dk/dv layout (`backward_blocks`).
    dq_block_kv: int
    dkv_block_q: int
    #: Leading axes (1 or the batch, 1 or the heads) of the dq and of the dk/dv lists.
    dq_layout_axes: tuple[int, int]
    dkv_layout_axes: tuple[int, int]
    #: Logits soft cap ``c`` of the forward (``c * tanh(scaled logit / c)``); 0: none.
    soft_cap: float = 0.0
    #: One pass (`dkv_call` with a dq accumulator) or the dq kernel and the dk/dv kernel
    #: apart (bit-identical from run to run).
    single_pass: bool = False

    @property
    def dq_columns(self) -> int:
        """Head-dim columns of dq each compute warpgroup of the single pass adds per block: at
        D >= 128 the two split the columns (each over both warpgroups' keys, so a block's dq
        partial is added once); below, each adds all columns over its own keys (a 32-column
        half would not be a whole 128-byte swizzle row)."""
        return self.head_dim // COMPUTE_WARPGROUPS if self.head_dim >= 128 else self.head_dim

    def stages(self, streamed_rows: int, fused: bool = False) -> int:
        """Ring depth for two streamed tiles of `streamed_rows` next to four own 64-row tiles
        (and, `fused`, the double-buffered dS tiles and each warpgroup's float32 dq stage)."""
        d = self.head_dim
        fixed = 4 * ROWS_PER_WARPGROUP * d * 2
        if fused:
            fixed += COMPUTE_WARPGROUPS * streamed_rows * (
                2 * ROWS_PER_WARPGROUP * 2 + self.dq_columns * 4)
        return ring_stages(fixed, 2 * streamed_rows * d * 2)

    def probabilities(self, s, lse, vis=None):
        """``(P, t)`` of one block from its raw products ``s = q . k`` (either orientation;
        `lse` (base 2) broadcast to it, `vis` the partial block's predicate): ``P =
        exp2(logit - lse)``, and the soft cap's ``t = tanh(scaled logit / c)`` (None
        without one)."""
        t = None
        if self.soft_cap:
            # tanh(x) = 1 - 2 / (exp(2x) + 1), as in the forward: no NaN at any logit.
            t = 1.0 - 2.0 / (jnp.exp2(s * (2.0 * self.log2_factor / self.soft_cap)) + 1.0)
            logits = t * (self.soft_cap * LOG2E)
        else:
            logits = s * self.log2_factor
        if vis is not None:
            logits = jnp.where(vis, logits, -jnp.inf)
        return jnp.exp2(logits - lse), t

    def score_gradient(self, p, dp, delta, t):
        """``dS = P (dp - delta)`` from `probabilities`' ``(P, t)`` and the block's raw
        ``dp = dO . v`` (`delta` broadcast to it), times the soft cap's derivative ``1 -
        t^2`` where there is one. dS is the gradient of the logits before the softmax scale:
        dq and dk take the scale afterwards."""
        ds = p * (dp - delta)
        return ds if t is None else ds * (1.0 - t * t)


def _launch(cfg, body, scratch, grid_name, num_tiles, out_type, operands, interpret):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    def entry(*refs):
        pl.run_scoped(lambda *scoped: body(*refs, scoped), *scratch, collective_axes="wg")

    kwargs = {} if interpret is None else {"interpret": interpret}
    return plgpu.kernel(
        entry, out_type=out_type, grid=(cfg.heads, num_tiles, cfg.batch),
        grid_names=("heads", grid_name, "batch"), num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True), **kwargs,
    )(*operands)


def _scratch(own_shape, ring_shape, dtype, stages):
    """Two own tiles per compute warpgroup, two rings of streamed tiles, and their barriers."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    smem = (swizzled(own_shape, dtype), swizzled(own_shape, dtype),
            swizzled(ring_shape, dtype), swizzled(ring_shape, dtype))
    ready = (plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),) * 2 + \
        (plgpu.Barrier(num_barriers=stages),) * 2
    free = (plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),) * 2
    return smem, ready, free


def _segments(q_segment_ids, kv_segment_ids):
    """``(has ids, query ids, key ids)``, the ids apart (`segment_ids_apart`) so that the
    partial blocks' segment term is equality alone, as in the forward."""
    dummy = jnp.zeros((1, 1), jnp.int32)
    if q_segment_ids is None:
        return False, dummy, dummy
    return True, *segment_ids_apart(q_segment_ids, kv_segment_ids)


def dq_call(cfg: BackwardConfig, q, k, v, do, lse, delta, full_count, full_index,
            partial_count, partial_index, q_segment_ids=None, kv_segment_ids=None, *,
            interpret=None):
    """dq ``[B, H, Lq, D]`` (the query's dtype) for padded inputs; `lse` (base 2) and `delta`
    are ``[B, H, Lq]`` float32; the lists are the dq layout's."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    ops = Ops(interpreted=interpret is not None)
    bq, d, dtype = ROWS_PER_WARPGROUP, cfg.head_dim, q.dtype
    bk = cfg.dq_block_kv
    stages = cfg.stages(bk)
    group = cfg.group
    num_tiles = cfg.q_len // BLOCK_OWN
    has_segments, qseg, kseg = _segments(q_segment_ids, kv_segment_ids)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, fcnt_ref, fidx_ref, pcnt_ref,
             pidx_ref, qseg_ref, kseg_ref, dq_ref, scoped):
        (q_own, do_own, k_ring, v_ring), (q_ready, do_ready, k_ready, v_ready), \
            (k_free, v_free) = scoped
        h = lax.axis_index("heads")
        tile = num_tiles - 1 - lax.axis_index("q_tiles")  # heavy causal tiles first
        b = lax.axis_index("batch")
        wg = lax.axis_index("wg")
        prefix, n_full, n_steps = list_bounds(cfg.dq_layout_axes, b, h, tile, fcnt_ref, pcnt_ref)

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            q_smem, do_smem = q_own.at[wg], do_own.at[wg]
            q_base = tile * BLOCK_OWN + wg * bq
            rows = pl.ds(q_base, bq)
            plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_ready.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[b, h, rows], do_smem, do_ready.at[wg])
            lse = ops.load(lse_ref, (b, h, rows), ops.row_layout)
            delta = ops.load(delta_ref, (b, h, rows), ops.row_layout)
            q_seg = None
            if has_segments:
                q_seg = lax.broadcast_in_dim(
                    ops.load(qseg_ref, (b, rows), ops.row_layout), (bq, bk), [0])
            plgpu.barrier_wait(q_ready.at[wg])
            plgpu.barrier_wait(do_ready.at[wg])

            def block_grad(s, dp, it, masked):
                """The block's dS from its products S and dP."""
                vis = None
                if masked:
                    k_base = list_entry(fidx_ref, pidx_ref, prefix, it, n_full) * bk
                    k_seg = None
                    if has_segments:
                        k_seg = lax.broadcast_in_dim(
                            ops.load(kseg_ref, (b, pl.ds(k_base, bk)), ops.col_layout),
                            (bq, bk), [1])
                    vis = visible(cfg.terms, cfg.padded_kv_len, q_base + ops.iota((bq, bk), 0),
                                  k_base + ops.iota((bq, bk), 1), q_seg, k_seg, ids_apart=True)
                p, t = cfg.probabilities(s, lax.broadcast_in_dim(lse, (bq, bk), [0]), vis)
                return cfg.score_gradient(p, dp, lax.broadcast_in_dim(delta, (bq, bk), [0]), t)

            def step(it, acc, masked):
                slot = lax.rem(it, stages)
                with jax.named_scope("wait_kv"):
                    plgpu.barrier_wait(k_ready.at[slot])
                    plgpu.barrier_wait(v_ready.at[slot])
                with jax.named_scope("products"):
                    s, dp = ops.products((bq, bk), [(q_smem, k_ring.at[slot], True),
                                          (do_smem, v_ring.at[slot], True)])
                plgpu.barrier_arrive(v_free.at[slot])
                with jax.named_scope("softmax_partial" if masked else "softmax_full"):
                    ds = block_grad(s, dp, it, masked)
                with jax.named_scope("accumulate"):
                    (acc,) = ops.accumulate((acc,), [(ds.astype(dtype), k_ring.at[slot])])
                plgpu.barrier_arrive(k_free.at[slot])
                return acc

            acc = ops.cast(jnp.zeros((bq, d), jnp.float32), ops.wgmma_layout)
            acc = walk_list(n_full, n_steps, step, acc)
            with jax.named_scope("epilogue"):
                q_smem[...] = (acc * cfg.softmax_scale).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, h, rows])
                plgpu.wait_smem_to_gmem(0)

        def tile_of(ref, it):
            block = list_entry(fidx_ref, pidx_ref, prefix, it, n_full)
            return ref.at[b, lax.div(h, group), pl.ds(block * bk, bk)]

        pl.when(wg == COMPUTE_WARPGROUPS)(lambda: memory_warpgroup(
            1, lambda _: (n_steps, tile_of),
            ((k_ref, k_ring, k_ready, k_free), (v_ref, v_ring, v_ready, v_free)), stages))

    scratch = _scratch((COMPUTE_WARPGROUPS, bq, d), (stages, bk, d), dtype, stages)
    return _launch(cfg, body, scratch, "q_tiles", num_tiles, jax.ShapeDtypeStruct(q.shape, dtype),
                   (q, k, v, do, lse, delta, full_count, full_index, partial_count, partial_index,
                    qseg, kseg), interpret)


def dq_accumulator_shape(cfg: BackwardConfig, interpreted: bool) -> tuple[int, ...]:
    """The float32 dq accumulator of the single pass: ``[B, H, Lq, D]`` (padded lengths); in
    Pallas' CPU interpreter, which has no atomic reduce-add, one such slice per kv tile and
    compute warpgroup in front (summed after the kernel)."""
    shape = (cfg.batch, cfg.heads, cfg.q_len, cfg.head_dim)
    if interpreted:
        shape = (cfg.kv_len // BLOCK_OWN * COMPUTE_WARPGROUPS, *shape)
    return shape


def dkv_call(cfg: BackwardConfig, q, k, v, do, lse, delta, t_full_count, t_full_index,
             t_partial_count, t_partial_index, q_segment_ids=None, kv_segment_ids=None, *,
             dq_accumulator=None, interpret=None):
    """``(dk, dv)``, each ``[B, H, Lk, D]`` per query head (the caller sums a group's heads),
    for padded inputs; the lists are the dk/dv layout's transposed ones.

    With `dq_accumulator` (a zeroed float32 `jax.Ref` of `dq_accumulator_shape`) the pass is
    the whole backward: each block's dS also goes to shared memory (16-bit) for a fifth product,
    the block's dq partial ``dS K`` (unscaled; `BackwardConfig.dq_columns` says how the two
    compute warpgroups share it), which is staged in shared memory in float32 and added into
    the accumulator by TMA's bulk reduce-add. The order of those additions
    varies between runs, so the sum does too, in its last bits."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    ops = Ops(interpreted=interpret is not None)
    bk, d, dtype = ROWS_PER_WARPGROUP, cfg.head_dim, q.dtype
    bq = cfg.dkv_block_q
    fused = dq_accumulator is not None
    stages = cfg.stages(bq, fused)
    dq_cols = cfg.dq_columns
    split = dq_cols < d
    group = cfg.group
    num_tiles = cfg.kv_len // BLOCK_OWN
    has_segments, qseg, kseg = _segments(q_segment_ids, kv_segment_ids)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, fcnt_ref, fidx_ref, pcnt_ref,
             pidx_ref, qseg_ref, kseg_ref, *refs):
        if fused:
            dq_ref, dk_ref, dv_ref, (*scoped, rows_scoped, (ds_own, dq_stage, ds_ready)) = refs
        else:
            dk_ref, dv_ref, (*scoped, rows_scoped) = refs
        (k_own, v_own, q_ring, do_ring), (k_ready, v_ready, q_ready, do_ready), \
            (q_free, do_free) = scoped
        (lse_ring, delta_ring), (lse_ready, delta_ready), (lse_free, delta_free) = rows_scoped
        h = lax.axis_index("heads")
        tile = lax.axis_index("kv_tiles")  # under causal masks the first tiles are heavy
        b = lax.axis_index("batch")
        wg = lax.axis_index("wg")
        prefix, n_full, n_steps = list_bounds(cfg.dkv_layout_axes, b, h, tile, fcnt_ref,
                                              pcnt_ref)

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            k_smem, v_smem = k_own.at[wg], v_own.at[wg]
            k_base = tile * BLOCK_OWN + wg * bk
            keys = pl.ds(k_base, bk)
            kv_h = lax.div(h, group)
            plgpu.copy_gmem_to_smem(k_ref.at[b, kv_h, keys], k_smem, k_ready.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[b, kv_h, keys], v_smem, v_ready.at[wg])
            k_seg = None
            if has_segments:
                k_seg = lax.broadcast_in_dim(
                    ops.load(kseg_ref, (b, keys), ops.row_layout), (bk, bq), [0])
            plgpu.barrier_wait(k_ready.at[wg])
            plgpu.barrier_wait(v_ready.at[wg])

            def add_dq_partial(ds_t, it, cols):
                """dq[cols] += dS K, the fifth product: at D >= 128 this warpgroup's half of
                the columns over both warpgroups' keys (their dS tiles meet in shared
                memory, double-buffered: a tile is rewritten two blocks on, after both
                warpgroups passed the next block's barrier), else all columns over its own
                keys."""
                slot = lax.rem(it, 2)
                with jax.named_scope("ds_store"):
                    ds_own.at[slot, wg][...] = ds_t
                    plgpu.commit_smem()
                if split:
                    with jax.named_scope("ds_barrier"):
                        plgpu.barrier_arrive(ds_ready.at[slot])
                        plgpu.barrier_wait(ds_ready.at[slot])
                    columns = pl.ds(wg * dq_cols, dq_cols)
                    pairs = [(ds_own.at[slot, w], k_own.at[w, :, columns])
                             for w in range(COMPUTE_WARPGROUPS)]
                else:
                    columns = pl.ds(0, d)
                    pairs = [(ds_own.at[slot, wg], k_smem)]
                with jax.named_scope("dq_product"):
                    dq_part = ops.sum_of_products_transposed_a((bq, dq_cols), pairs)
                # The previous block's reduce-add has read the stage before it is rewritten.
                with jax.named_scope("stage_wait"):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                stage = dq_stage.at[wg]
                with jax.named_scope("stage_store"):
                    stage[...] = dq_part
                    plgpu.commit_smem()
                # In the interpreter each (kv tile, warpgroup) has its own slice of the
                # accumulator (`dq_accumulator_shape`): it has no atomic reduce-add.
                target = dq_ref.at[tile * COMPUTE_WARPGROUPS + wg] if ops.interpreted else dq_ref
                with jax.named_scope("reduce_add"):
                    ops.add_to_gmem(stage, target.at[b, h, cols, columns])

            def streamed_row(ring, ready, free, slot):
                """The q-block's log-sum-exp or delta from its ring slot, in registers."""
                plgpu.barrier_wait(ready.at[slot])
                row = ops.load_smem(ring.at[slot], ops.col_layout)
                plgpu.barrier_arrive(free.at[slot])
                return row

            def step(it, carry, masked):
                dk, dv = carry
                slot = lax.rem(it, stages)
                q_base = list_entry(fidx_ref, pidx_ref, prefix, it, n_full) * bq
                cols = pl.ds(q_base, bq)
                with jax.named_scope("load_rows"):
                    lse = streamed_row(lse_ring, lse_ready, lse_free, slot)
                with jax.named_scope("wait_q"):
                    plgpu.barrier_wait(q_ready.at[slot])
                    plgpu.barrier_wait(do_ready.at[slot])
                with jax.named_scope("products"):
                    (s_t,) = ops.products((bk, bq), [(k_smem, q_ring.at[slot], True)])
                with jax.named_scope("softmax_partial" if masked else "softmax_full"):
                    vis = None
                    if masked:
                        q_seg = None
                        if has_segments:
                            q_seg = lax.broadcast_in_dim(
                                ops.load(qseg_ref, (b, cols), ops.col_layout), (bk, bq), [1])
                        vis = visible(cfg.terms, cfg.padded_kv_len,
                                      q_base + ops.iota((bk, bq), 1),
                                      k_base + ops.iota((bk, bq), 0), q_seg, k_seg,
                                      ids_apart=True)
                    p_t, t = cfg.probabilities(s_t, lax.broadcast_in_dim(lse, (bk, bq), [1]), vis)
                # dV's product and dP's in one group, dK's after dS: fewer live registers
                # than S and dP together beside the dk and dv accumulators.
                with jax.named_scope("dv_dp"):
                    fresh = ops.cast(jnp.zeros((bk, bq), jnp.float32), ops.wgmma_layout)
                    dv, dp_t = ops.accumulate((dv, fresh), [
                        (p_t.astype(dtype), do_ring.at[slot]),
                        (v_smem, do_ring.at[slot], True)])
                plgpu.barrier_arrive(do_free.at[slot])
                with jax.named_scope("load_rows"):
                    delta = streamed_row(delta_ring, delta_ready, delta_free, slot)
                with jax.named_scope("ds"):
                    ds_t = cfg.score_gradient(
                        p_t, dp_t, lax.broadcast_in_dim(delta, (bk, bq), [1]), t).astype(dtype)
                with jax.named_scope("dk"):
                    (dk,) = ops.accumulate((dk,), [(ds_t, q_ring.at[slot])])
                plgpu.barrier_arrive(q_free.at[slot])
                if fused:
                    add_dq_partial(ds_t, it, cols)
                return dk, dv

            zeros = ops.cast(jnp.zeros((bk, d), jnp.float32), ops.wgmma_layout)
            dk, dv = walk_list(n_full, n_steps, step, (zeros, zeros))
            with jax.named_scope("epilogue"):
                k_smem[...] = (dk * cfg.softmax_scale).astype(dtype)
                v_smem[...] = dv.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, h, keys])
                plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, h, keys])
                plgpu.wait_smem_to_gmem(0)

        def tile_of(ref, it):
            block = list_entry(fidx_ref, pidx_ref, prefix, it, n_full)
            return ref.at[b, h, pl.ds(block * bq, bq)]

        pl.when(wg == COMPUTE_WARPGROUPS)(lambda: memory_warpgroup(
            1, lambda _: (n_steps, tile_of),
            ((q_ref, q_ring, q_ready, q_free), (lse_ref, lse_ring, lse_ready, lse_free),
             (do_ref, do_ring, do_ready, do_free),
             (delta_ref, delta_ring, delta_ready, delta_free)), stages))

    # Q and dO tiles, and beside them each q-block's log-sum-exp and delta rows.
    scratch = (*_scratch((COMPUTE_WARPGROUPS, bk, d), (stages, bq, d), dtype, stages),
               ((plgpu.SMEM((stages, bq), jnp.float32),) * 2,
                (plgpu.Barrier(num_barriers=stages),) * 2,
                (plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),) * 2))
    operands = (q, k, v, do, lse, delta, t_full_count, t_full_index, t_partial_count,
                t_partial_index, qseg, kseg)
    if fused:
        scratch = (*scratch, (swizzled((2, COMPUTE_WARPGROUPS, bk, bq), dtype),
                              swizzled((COMPUTE_WARPGROUPS, bq, dq_cols), jnp.float32),
                              plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=2)))
        operands = (*operands, dq_accumulator)
    grads = jax.ShapeDtypeStruct((cfg.batch, cfg.heads, cfg.kv_len, d), dtype)
    return _launch(cfg, body, scratch, "kv_tiles", num_tiles, (grads, grads), operands,
                   interpret)
