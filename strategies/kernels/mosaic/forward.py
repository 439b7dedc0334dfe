"""The forward launch of `MosaicBlockSparse`: a persistent, warp-specialised Pallas Mosaic GPU
kernel.

The work items are (batch row, head, q-tile of 128 rows). One CTA per SM runs the items
`persistent_schedule` gives it, one after another, with three warpgroups:

- a memory warpgroup walks each item's kv-block list (full blocks, then partial ones) and
  copies each block's K and V tile into a ring of shared-memory slots with TMA, waiting for a
  slot to be released before refilling it; the ring runs on across items, so the next item's
  first tiles arrive while this one finishes;
- two compute warpgroups each own 64 of the item's query rows: S = Q K^T with wgmma, an online
  softmax in base 2, O += P V with wgmma (P from registers). A shared barrier staggers them, so
  one warpgroup's softmax overlaps the other's matrix products. Q has two buffers: the next
  item's rows are copied in from the start of this item, and the output leaves through the
  buffer of the item it belongs to (at D = 256 one, `q_buffers_for`: the next item's rows
  are copied in once this item's output has left it).

A partial block's first key, key segment ids and element-map tile, and a block's bias tile
and T5 bank tile, are read before its products are issued, so their latency is hidden. The
phases of both kinds of warpgroup are named scopes, so Mosaic GPU's on-device profiler
(``CompilerParams(profile_space=..., profile_dir=...)``) times each of them per warpgroup.

FULL blocks skip every mask; partial blocks evaluate the compiled mask's canonical terms
(`MaskTerms`) on token indices, and segment ids when the mask has them, or, for a mask
without terms, its element predicate (`CompiledMask.visible_at`) traced on the block's
coordinate tiles (`common.block_visible`). A soft cap turns the
products into capped logits before either. Rows that see no key give zeros and a log-sum-exp
of +inf (the convention of the backward kernels).

ALiBi (``slope * (k - q)``, `AlibiBlocks`) splits in three: the columns' part (``slope *
j`` for the block's column j) is one vector per item added to each logit, the block's
constant (``slope * (k_base - q_base)``) is carried through the row maxima as a scalar, and
the rows' part (``-slope * i``) goes into the log-sum-exp at the end, since a row's softmax
does not change when a constant is added to it. Under a soft cap, which is not
shift-invariant, each logit takes the whole term before the cap. A bias (``cfg.bias``) adds
its tile, loaded from global memory, to every logit of every block (`common.load_pair_tile`).
A T5 table (``cfg.relative``) splits each list in three parts (`common.walk_list`): the
blocks of a far part add one entry of the table, a near block its tile of the launch's bank
(`common.RelativeTiles`).

Arrays are batched ``[B, H, L, D]``; lengths must be multiples of the tiles (the caller pads).
Mosaic GPU is imported when a launch is traced, so this module imports anywhere.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from .common import (COMPUTE_REGISTERS, COMPUTE_WARPGROUPS, LOG2E, ROWS_PER_WARPGROUP,
                     SMEM_BUDGET, AlibiBlocks, AttentionShape, LogitTerms, Ops, WorkItems,
                     ELEMENT_MAP_DTYPE, alibi_positions_term, base2_tile, block_visible,
                     function_tile, item_values, load_pair_tile, persistent_schedule,
                     relative_operands, relative_tiles, ring_stages, segment_ids_apart,
                     split_counts, swizzled, table_operands, walk_list)

#: Query rows per CTA (two compute warpgroups of 64).
BLOCK_Q = ROWS_PER_WARPGROUP * COMPUTE_WARPGROUPS


@dataclasses.dataclass(frozen=True)
class ForwardConfig(AttentionShape, LogitTerms):
    """Everything static about one forward launch (hashable)."""

    block_kv: int
    stages: int
    #: Leading axes of the layout lists: 1 or the batch, 1 or the heads.
    layout_batch: int
    layout_heads: int
    #: CTAs of the persistent launch (one per SM); ``None``: one per work item.
    ctas: int | None = None

def forward_call(cfg: ForwardConfig, q, k, v, full_count, full_index, partial_count,
                 partial_index, q_segment_ids=None, kv_segment_ids=None, *, slopes=None,
                 positions=None, element_map=None, bias=None, data=None, table=None,
                 schedule=None, interpret=None):
    """``(out [B, H, Lq, D], lse [B, H, Lq] float32, base 2)`` for padded inputs.
    `schedule` is the launch's ``(items, counts)`` (`persistent_schedule` of the counts on
    ``cfg.ctas`` CTAs when ``None``); `slopes` ``[H]`` float32 are ALiBi's (``cfg.alibi``);
    `positions` the padded ``(q_positions [B, Lq], kv_positions [B, Lk])`` int32
    (``cfg.positions``); `element_map` the padded ``[1 or B, 1 or H, Lq, Lk]`` map
    (``cfg.elements``); `bias` the padded ``[1 or B, 1 or H, Lq, Lk]`` bias (``cfg.bias``);
    `data` the read tables of the score function's arrays (``cfg.traced``;
    `common.table_operands`); `table` the T5 table ``[H, num_buckets]`` (``cfg.relative``:
    its near blocks read the launch's bank, `common.RelativeTiles`)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    ops = Ops(interpreted=interpret is not None)
    cast, wgmma_layout, row_layout = ops.cast, ops.wgmma_layout, ops.row_layout
    bq, bk, d = ROWS_PER_WARPGROUP, cfg.block_kv, cfg.head_dim
    dtype = q.dtype
    stages = cfg.stages
    # One Q buffer at D = 256 (`q_buffers_for`): the next item's Q then waits for this
    # item's output to leave the buffer.
    q_buffers = q_buffers_for(d, bk, jnp.dtype(dtype).itemsize)
    group = cfg.group
    num_q_tiles = cfg.q_len // BLOCK_Q
    if schedule is None:
        schedule = persistent_schedule(full_count, partial_count, cfg.batch, cfg.heads,
                                       cfg.ctas)
    items, counts = schedule
    cf, cp = full_index.shape[-1], partial_index.shape[-1]
    has_segments = q_segment_ids is not None
    # s * scale * log2(e), kept in base 2; with a positive factor the row maximum of the raw
    # products scales to the row maximum of the logits, so full blocks fold the factor into
    # the exponent's operand. ALiBi, a score function and a soft cap turn the products into
    # base-2 logits first (factor 1: no product), and so do a bias and a T5 table.
    function = cfg.function
    relative = relative_tiles(cfg, bq, bk, transposed=False)
    factor = (1.0 if cfg.soft_cap or cfg.alibi or cfg.bias or relative is not None
              or function is not None else cfg.log2_factor)
    if cfg.alibi and slopes is None:
        raise ValueError("forward_call: `slopes` must be given when cfg.alibi is on.")

    def kernel(items_ref, counts_ref, q_ref, k_ref, v_ref, fcnt_ref, fidx_ref, pcnt_ref,
               pidx_ref, qseg_ref, kseg_ref, slopes_ref, qpos_ref, kpos_ref, emap_ref,
               bias_ref, floats_ref, ints_ref, table_ref, bank_ref, splits_ref, out_ref, lse_ref,
               scoped):
        (q_buffers_ref, k_smem, v_smem, lse_buffers), (k_ready, v_ready, q_ready), \
            (k_free, v_free), turn = scoped
        wg = lax.axis_index("wg")
        cta_items = WorkItems(items_ref, counts_ref, num_q_tiles, cfg.heads,
                              (cfg.layout_batch, cfg.layout_heads),
                              (fcnt_ref, fidx_ref, pcnt_ref, pidx_ref), single=False)
        count = cta_items.count

        def take_turn():
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

            def load_q(j, item):
                """Start copying item j's Q rows into buffer ``j % q_buffers`` of this
                warpgroup (`item` is its `decoded` tuple)."""
                b, h, tile = item[:3]
                buffer = lax.rem(j, q_buffers)
                plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(tile * BLOCK_Q + wg * bq, bq)],
                                        q_buffers_ref.at[buffer, wg],
                                        q_ready.at[buffer * COMPUTE_WARPGROUPS + wg])

            load_q(0, cta_items.decoded(cta_items.raw(0)))

            def run_item(j, first_step, this_item, upcoming):
                # Item j + 1's list bounds (`upcoming`) were read just before this item;
                # they are used at its end (`WorkItems.run`).
                with jax.named_scope("entry"):
                    b, _, tile = this_item[:3]
                    h, prefix, n_full, n_steps = cta_items.member(this_item, 0)
                    splits = (None if relative is None
                              else split_counts(splits_ref, prefix))
                    buffer = lax.rem(j, q_buffers)
                    q_smem = q_buffers_ref.at[buffer, wg]
                    q_base = tile * BLOCK_Q + wg * bq
                    if has_segments:
                        q_seg = ops.load(qseg_ref, (b, pl.ds(q_base, bq)), row_layout)
                    if cfg.positions:
                        q_pos = lax.broadcast_in_dim(
                            ops.load(qpos_ref, (b, pl.ds(q_base, bq)), row_layout), (bq, bk),
                            [0])
                    # The scalars the score function and the mask read for this row and
                    # head.
                    values = item_values(cfg, floats_ref, ints_ref, b, h)
                    far_terms = (None if relative is None
                                 else relative.far_terms(table_ref, h))
                    alibi = col_term = None
                    if cfg.alibi:
                        alibi = AlibiBlocks(ops, slopes_ref[h], bq, rows_are_queries=True)
                    if cfg.alibi and not cfg.whole_terms:
                        # Without a cap, a block's logits take ALiBi's columns' part as
                        # this item's `col_term` (columns 0..bk-1) plus a scalar for the
                        # block, which the online softmax carries through the row maxima.
                        col_term = alibi.streamed(bk, 0)
                with jax.named_scope("wait_q"):
                    plgpu.barrier_wait(q_ready.at[buffer * COMPUTE_WARPGROUPS + wg])
                # The next item's Q is copied while this one runs, into the other buffer
                # once the output of item j - 1 has been read out of it (with one buffer,
                # after this item's output: `load_next_q`).
                def load_next_q():
                    @pl.when(j + 1 < count)
                    def _():
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        load_q(j + 1, upcoming)

                if q_buffers == 2:
                    with jax.named_scope("load_next_q"):
                        load_next_q()

                m_i = cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
                l_i = cast(jnp.zeros((bq,), jnp.float32), row_layout)
                acc = cast(jnp.zeros((bq, d), jnp.float32), wgmma_layout)

                @pl.when(n_steps > 0)
                def _():
                    plgpu.barrier_wait(k_ready.at[lax.rem(first_step, stages)])

                pl.when(wg == 1)(take_turn)

                def wait_next_k(it):
                    @pl.when(it + 1 < n_steps)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(first_step + it + 1, stages)])

                def partial_block(it):
                    """``(first key, key segment ids or None, element map tile or None)``
                    of partial step `it`, read before the step's products so that the loads'
                    latency is hidden."""
                    k_base = pidx_ref[(*prefix, jnp.minimum(it - n_full, cp - 1))] * bk
                    k_seg = emap = None
                    if has_segments:
                        k_seg = ops.load(kseg_ref, (b, pl.ds(k_base, bk)), ops.col_layout)
                    if cfg.elements:
                        emap = load_pair_tile(ops, emap_ref, b, h, pl.ds(q_base, bq),
                                              pl.ds(k_base, bk))
                    return k_base, k_seg, emap

                def block_keys(it, partial):
                    """``(first key, key positions)`` of step `it` where its logits need
                    them (ALiBi, the bias or the score function in every block, the mask in
                    partial ones), else ``None``: read before the step's products, so that
                    the loads' latency is hidden (a partial block's first key is in
                    `partial`). The key positions, a column vector, are the per-call
                    positions' (``cfg.positions``), else ``None``."""
                    if (alibi is None and function is None and partial is None
                            and not cfg.bias and relative is None):
                        return None
                    if partial is not None:
                        k_base = partial[0]
                    else:
                        k_base = fidx_ref[(*prefix, jnp.minimum(it, cf - 1))] * bk
                    k_pos = None
                    if cfg.positions:
                        k_pos = ops.load(kpos_ref, (b, pl.ds(k_base, bk)), ops.col_layout)
                    return k_base, k_pos

                def position_tiles(keys):
                    """Query and key positions of the block with `block_keys` `keys`, as
                    tiles: the per-call positions, or the token indices."""
                    k_base, k_pos = keys
                    if k_pos is not None:
                        return q_pos, lax.broadcast_in_dim(k_pos, (bq, bk), [1])
                    return q_base + ops.iota((bq, bk), 0), k_base + ops.iota((bq, bk), 1)

                def block_terms(keys, part):
                    """``(bias tile, table tile)`` of a block, each ``None`` where it has
                    none: loaded before its products, so that their latency hides behind
                    them (a far part's table term is a scalar, `far_terms`)."""
                    if keys is None:
                        return None, None
                    k_base = keys[0]
                    bias = None
                    if cfg.bias:
                        bias = load_pair_tile(ops, bias_ref, b, h, pl.ds(q_base, bq),
                                              pl.ds(k_base, bk))
                    table = None
                    if relative is not None:
                        table = relative.near_tile(ops, bank_ref, h, part, q_base - k_base)
                    return bias, table

                def online_softmax(s, acc, m_i, l_i, partial, keys, part, loaded):
                    """``(acc, m, l, p)`` after one block's raw products `s`: ALiBi's term
                    (from the block's first key `k_base`: the item's `col_term` in each
                    logit, the block's constant through the row maxima, the rows' part in
                    the log-sum-exp at the end; all of it in each logit under a soft cap),
                    the bias, the block's mask (`partial_block`'s, or None for a full
                    block), base-2 exponentials and the rescaled sums."""
                    shift = None  # a constant left out of every logit of the block
                    k_base = None if keys is None else keys[0]
                    # A score function, a bias or a table may hide pairs (-inf) in any
                    # block: each block then takes the guard of rows with nothing visible yet.
                    hides = (partial is not None or function is not None or cfg.bias
                             or relative is not None)
                    if alibi is not None and cfg.positions:
                        s = s * cfg.log2_factor + alibi_positions_term(slopes_ref[h],
                                                                       *position_tiles(keys))
                    elif alibi is not None and cfg.whole_terms:
                        s = s * cfg.log2_factor + alibi.whole(s.shape, k_base - q_base)
                    elif alibi is not None:
                        s = s * cfg.log2_factor + lax.broadcast_in_dim(col_term, s.shape, [1])
                        shift = alibi.shift(k_base - q_base)
                    if cfg.bias:
                        s = (s if alibi is not None else s * cfg.log2_factor) + base2_tile(
                            loaded[0])
                    if relative is not None:
                        s = (s if alibi is not None or cfg.bias else s * cfg.log2_factor) + \
                            relative.term(far_terms, part, loaded[1])
                    # s holds base-2 logits
                    base2 = alibi is not None or cfg.bias or relative is not None
                    if function is not None:
                        # The function sees natural units; base 2 again after it.
                        natural = s * (1.0 / LOG2E) if base2 else s * cfg.softmax_scale
                        s = function_tile(cfg, natural, b, h, *position_tiles(keys),
                                          values=values) * LOG2E
                    if cfg.soft_cap:
                        # c log2(e) tanh(s scale / c), tanh(x) = 1 - 2 / (exp(2x) + 1): an
                        # exponential overflowing to inf gives 1, never NaN.
                        already_base2 = base2 or function is not None
                        e = jnp.exp2(s * (2.0 / cfg.soft_cap if already_base2
                                          else 2.0 * cfg.log2_factor / cfg.soft_cap))
                        s = (1.0 - 2.0 / (e + 1.0)) * (cfg.soft_cap * LOG2E)
                    if hides:
                        s = _times(s, factor)
                    if partial is not None:
                        k_seg = partial[1]
                        segs = (None, None)
                        if has_segments:
                            segs = (lax.broadcast_in_dim(q_seg, (bq, bk), [0]),
                                    lax.broadcast_in_dim(k_seg, (bq, bk), [1]))
                        vis = block_visible(
                            cfg, ops, h, (bq, bk), 0, q_base, k_base, position_tiles(keys),
                            *segs, map_tile=lambda: partial[2] != 0, values=values)
                        s = jnp.where(vis, s, -jnp.inf)
                    if hides:
                        m_new = jnp.maximum(m_i, _plus(s.max(axis=1), shift))
                        # A row with nothing visible yet keeps m = -inf: subtract 0 instead,
                        # so its p and alpha are exp2(-inf) = 0, never NaN.
                        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                        p = jnp.exp2(s - lax.broadcast_in_dim(_plus(m_use, shift, -1.0), s.shape,
                                                              [0]))
                        alpha = jnp.exp2(m_i - m_use)
                    elif factor > 0:
                        m_new = jnp.maximum(m_i, _plus(_times(s.max(axis=1), factor), shift))
                        p = jnp.exp2(_times(s, factor) - lax.broadcast_in_dim(
                            _plus(m_new, shift, -1.0), s.shape, [0]))
                        alpha = jnp.exp2(m_i - m_new)
                    else:
                        s = s * factor
                        m_new = jnp.maximum(m_i, s.max(axis=1))
                        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                        alpha = jnp.exp2(m_i - m_new)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    l_i = l_i * alpha + p.sum(axis=1)
                    p16 = p.astype(dtype)
                    # Finish the row sums before the barriers (measured faster in JAX's own
                    # Mosaic GPU attention for D <= 128).
                    return lax.optimization_barrier((acc, m_new, l_i, p16))

                def step(it, carry, masked, part=None):
                    acc, m_i, l_i = carry
                    slot = lax.rem(first_step + it, stages)
                    partial = partial_block(it) if masked else None
                    keys = block_keys(it, partial)
                    with jax.named_scope("load_terms"):
                        loaded = block_terms(keys, part)

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                        with jax.named_scope("turn_qk"):
                            take_turn()
                        with jax.named_scope("wait_qk"):
                            return acc_ref[...]

                    if interpret is None:
                        s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
                    else:
                        # The CPU interpreter has no transposed refs: a plain product there.
                        s = jnp.dot(q_smem[...], k_smem[slot].T,
                                    preferred_element_type=jnp.float32)
                        take_turn()
                    plgpu.barrier_arrive(k_free.at[slot])
                    with jax.named_scope("softmax_partial" if masked else "softmax_full"):
                        acc, m_new, l_i, p16 = online_softmax(s, acc, m_i, l_i, partial, keys,
                                                              part, loaded)
                    with jax.named_scope("turn_pv"):
                        plgpu.barrier_arrive(turn)
                        plgpu.barrier_wait(v_ready.at[slot])
                        plgpu.barrier_wait(turn)

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                        wait_next_k(it)

                    with jax.named_scope("pv"):
                        if interpret is None:
                            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                        else:
                            acc = acc + jnp.dot(p16, v_smem[slot],
                                                preferred_element_type=jnp.float32)
                            wait_next_k(it)
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l_i

                acc, m_i, l_i = walk_list(n_full, n_steps, step, (acc, m_i, l_i), splits)
                with jax.named_scope("turn_end"):
                    pl.when(wg == 0)(take_turn)

                with jax.named_scope("epilogue"):
                    empty = l_i == 0.0
                    inv = 1.0 / jnp.where(empty, 1.0, l_i)
                    acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
                    lse = jnp.where(empty, jnp.inf, m_i + jnp.log2(jnp.where(empty, 1.0, l_i)))
                    if alibi is not None and not cfg.whole_terms:
                        lse = lse + alibi.own_term  # the rows' part of ALiBi, left out above
                    q_smem[...] = acc.astype(dtype)
                    lse_smem = lse_buffers.at[buffer, wg]
                    lse_smem[...] = lse
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, h, pl.ds(q_base, bq)])
                    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q_base, bq)])
                if q_buffers == 1:
                    with jax.named_scope("load_next_q"):
                        load_next_q()

            cta_items.run(run_item)
            plgpu.wait_smem_to_gmem(0)

        def tile_of_block(ref, b, h, block):
            return ref.at[b, lax.div(h, group), pl.ds(block * bk, bk)]

        pl.when(wg == COMPUTE_WARPGROUPS)(lambda: cta_items.memory_warpgroup(
            ((k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free)), stages,
            tile_of_block))

    def entry(*refs):
        smem = (
            swizzled((q_buffers, COMPUTE_WARPGROUPS, bq, d), dtype),
            swizzled((stages, bk, d), dtype),
            swizzled((stages, bk, d), dtype),
            plgpu.SMEM((q_buffers, COMPUTE_WARPGROUPS, bq), jnp.float32),
        )
        ready = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                 plgpu.Barrier(num_barriers=q_buffers * COMPUTE_WARPGROUPS))
        free = (plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),) * 2
        turn = plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS)
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smem, ready, free, turn,
                      collective_axes="wg")

    dummy = jnp.zeros((1, 1), jnp.int32)
    qseg, kseg = dummy, dummy
    slopes = jnp.zeros((1,), jnp.float32) if slopes is None else slopes.astype(jnp.float32)
    if has_segments and cfg.predicate is None:
        qseg, kseg = segment_ids_apart(q_segment_ids, kv_segment_ids)
    elif has_segments:  # the element predicate reads the ids as the call passed them
        qseg, kseg = q_segment_ids, kv_segment_ids
    if cfg.positions and positions is None:
        raise ValueError("forward_call: `positions` must be given when cfg.positions is on.")
    qpos, kpos = positions if cfg.positions else (dummy, dummy)
    if cfg.elements and element_map is None:
        raise ValueError("forward_call: `element_map` must be given when cfg.elements is on.")
    emap = element_map if cfg.elements else jnp.zeros((1, 1, 1, 1), ELEMENT_MAP_DTYPE)
    if cfg.bias and bias is None:
        raise ValueError("forward_call: `bias` must be given when cfg.bias is on.")
    bias = bias if cfg.bias else jnp.zeros((1, 1, 1, 1), jnp.float32)
    floats, ints = table_operands(cfg, data)
    table, bank, splits = relative_operands(relative, table, (full_count, full_index,
                                                              partial_count, partial_index),
                                            "forward_call")
    kwargs = {} if interpret is None else {"interpret": interpret}
    out, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype),
                   jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)),
        grid=(items.shape[0],),
        grid_names=("ctas",),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kwargs,
    )(items, counts, q, k, v, full_count, full_index, partial_count, partial_index, qseg, kseg,
      slopes, qpos, kpos, emap, bias, floats, ints, table, bank, splits)
    return out, lse


def _times(x, factor: float):
    """``x * factor``, with no product where the factor is 1."""
    return x if factor == 1.0 else x * factor


def _plus(x, shift, sign: float = 1.0):
    """``x + sign * shift``, or `x` where there is no shift (``None``)."""
    if shift is None:
        return x
    return x + shift if sign > 0 else x - shift


def q_buffers_for(head_dim: int, block_kv: int, itemsize: int = 2) -> int:
    """Q buffers of the forward: two (this item's and the next's, loaded during this one)
    where they leave room for two K/V stages; one above (D = 256: 64 KiB of Q tiles and
    two 64 KiB stages), the next item's Q then loaded after this one's output left."""
    q_bytes = BLOCK_Q * head_dim * itemsize
    stage_bytes = 2 * block_kv * head_dim * itemsize
    return 2 if 2 * q_bytes + 2 * stage_bytes <= SMEM_BUDGET else 1


def stages_for(head_dim: int, block_kv: int, itemsize: int = 2) -> int:
    """K/V ring depth that fits the 227 KiB of shared memory next to the Q tiles."""
    q_bytes = q_buffers_for(head_dim, block_kv, itemsize) * BLOCK_Q * head_dim * itemsize
    stage_bytes = 2 * block_kv * head_dim * itemsize
    return ring_stages(q_bytes, stage_bytes)


def block_kv_for(head_dim: int) -> int:
    """The kv tile: 128 keys (D <= 128), 64 above (registers and shared memory)."""
    return 128 if head_dim <= 128 else 64


def rows_padded(length: int, block: int) -> int:
    return math.ceil(length / block) * block
