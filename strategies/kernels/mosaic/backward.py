"""The backward launches of `MosaicBlockSparse`: a dq kernel and a dk/dv kernel in Pallas Mosaic
GPU, each warp-specialised like the forward (a TMA memory warpgroup, two compute
warpgroups) and, where its lists are short, persistent like it (below).

- `dq_call`: a work item is (batch row, head, q-tile of 128 rows); its CTA walks the q-tile's
  kv-block list of the dq layout (FULL, then PARTIAL). The memory warpgroup streams each
  block's K and V tiles into a ring of shared-memory slots; each compute warpgroup (64 rows,
  its Q and dO tiles in shared memory, its rows' log-sum-exp and delta in registers)
  recomputes ``P = exp2(S * scale * log2 e - lse)``, forms ``dP = dO V^T`` and ``dS = P (dP -
  delta)``, and accumulates ``dq += dS K``.
- `dkv_call`: a work item is (batch row, kv head, kv-tile of 128 keys); its CTA walks the
  kv-tile's transposed list of the dk/dv layout for each query head of the kv head's group
  in turn. The memory warpgroup streams each q-block's Q and dO tiles, and its log-sum-exp
  and delta rows; each compute warpgroup (64 keys, its K and V tiles in shared memory) forms
  ``S^T = K Q^T`` and ``dP^T = V dO^T`` and accumulates ``dv += P^T dO`` and ``dk += dS^T
  Q`` in float32 over the whole group (GQA's sum inside the kernel, in a fixed order). In
  the single pass an item is a query head's instead (`BackwardConfig.dkv_group`), and the
  caller sums a group's dk and dv.
  At D = 256 dk and dv are two such launches (`BackwardConfig.dkv_launches`), each with
  one accumulator.
- `dkv_call` with a dq accumulator is the single pass: it also forms each block's dq partial
  ``dS K`` and adds it into a float32 dq in global memory by TMA reduce-add (5 block products
  a block instead of the two kernels' 7; dq then varies from run to run in its last bits).

A persistent launch (`BackwardConfig.persistent`, each launch whose lists are short) runs one
CTA per SM: the memory warpgroup's ring runs on across a CTA's items, so the next item's
first tiles load while this one finishes, and each compute warpgroup's own tiles (Q and dO,
or K and V) have two buffers, so the next item's are copied in from the start of this one;
that leaves room for two ring stages, where one item per CTA has four. Where two buffers do
not fit (the single pass at D = 128) the launch has one item per CTA.

Partial blocks evaluate the same predicate as the forward (`common.block_visible`: the
canonical terms, the segment ids apart and the key length tested only where keys were
padded, or the mask's element predicate); FULL blocks run none. Rows
whose log-sum-exp is +inf (they see no key) get ``P = 0`` and contribute nothing.

With ALiBi each kernel adds to each logit the part of the distance that varies along the
keys of one query and subtracts the rest from that query's log-sum-exp (the whole term goes
into each logit under a soft cap), and the dk/dv kernel, in both modes, sums each key's share
of the slope's gradient, ``sum_q dS (k - q)``, as two row sums of dS
(`AlibiBlocks.gradient_rows`); the caller adds the shares per head. A bias adds its tile to
each logit in both kernels (the dk/dv kernel reads it transposed), and where it is
differentiated the dq kernel writes each visited block's dS, its gradient
(``BackwardConfig.bias_gradient``).

Arrays are batched ``[B, H, L, D]`` with lengths padded to 128 (the caller pads: Q, dO with
zeros, the log-sum-exp with +inf, delta with zeros). Mosaic GPU is imported when a launch is
traced, so this module imports anywhere.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .common import (COMPUTE_REGISTERS, COMPUTE_WARPGROUPS, LOG2E, ROWS_PER_WARPGROUP,
                     SMEM_BUDGET, AlibiBlocks, AttentionShape, LogitTerms, Ops, WorkItems,
                     ELEMENT_MAP_DTYPE, alibi_positions_term, base2_tile, block_visible,
                     function_tile, item_values, load_pair_tile, persistent_schedule,
                     read_derivatives, relative_operands, relative_tiles, ring_stages,
                     segment_ids_apart, split_counts, swizzle_for, swizzled, table_operands,
                     walk_list)

#: Rows of a work item's own tile: q rows in the dq kernel, keys in the dk/dv kernel.
BLOCK_OWN = ROWS_PER_WARPGROUP * COMPUTE_WARPGROUPS
#: Blocks a work item visits on average, up to which the backward launches are persistent:
#: short items gain more from the next item's own tiles loading during this one than they
#: lose to the shallower ring, long ones the other way round (docs/mosaic.md, "Persistent
#: backward").
PERSISTENT_MAX_MEAN_BLOCKS = 32
#: The backward's launches, as `BackwardConfig` names them: the dq kernel and the dk/dv
#: kernel (the single pass is the dk/dv launch with a dq accumulator).
LAUNCHES = ("dq", "dkv")


def short_lists(full_count, partial_count, lists_walked: int = 1) -> bool:
    """Whether a launch's lists (its layout's counts; a work item walks `lists_walked` of
    them) are known on the host (a static mask; a layout built per call has device counts)
    and visit at most `PERSISTENT_MAX_MEAN_BLOCKS` blocks a work item on average: whether
    the launch is among `BackwardConfig.persistent`."""
    try:
        blocks = np.asarray(full_count) + np.asarray(partial_count)
    except jax.errors.TracerArrayConversionError:
        return False
    return bool(np.mean(blocks) * lists_walked <= PERSISTENT_MAX_MEAN_BLOCKS)


def backward_blocks(head_dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(dq (block_q, block_kv), dk/dv (block_q, block_kv))``: the layouts' tiles, chosen so
    the accumulators (S, dP and dq; or S^T, dP^T, dk and dv) of a 64-row warpgroup fit its
    registers, and at D = 256 so that two stages of streamed tiles (32 rows) fit the shared
    memory beside the own tiles (`BackwardConfig.stages`)."""
    if head_dim > 128:
        return (BLOCK_OWN, 32), (32, BLOCK_OWN)
    return (BLOCK_OWN, 128 if head_dim <= 64 else 64), (64, BLOCK_OWN)


def dkv_launches_for(head_dim: int) -> tuple[str, ...]:
    """The dk/dv launches (`dkv_call`'s `computes`): one for both gradients up to D = 128;
    above, the dk and dv accumulators (64 keys x D in float32 each) would take 256 registers
    a thread, so dk (with every output read from dS) and dv are two launches, each forming
    S^T again (and the single pass, which needs both in one launch, is not taken)."""
    return ("both",) if head_dim <= 128 else ("dk", "dv")


@dataclasses.dataclass(frozen=True)
class BackwardConfig(AttentionShape, LogitTerms):
    """Everything static about the two backward launches (hashable); lengths padded to 128.
    Its `LogitTerms` are the forward's: ALiBi's slopes' gradient comes out per key row, from
    `dkv_call` in both modes, and a score function's derivative in `s` joins dS
    (`probabilities`)."""

    #: Keys per block of the dq layout, queries per block of the dk/dv layout (`backward_blocks`).
    dq_block_kv: int
    dkv_block_q: int
    #: Leading axes (1 or the batch, 1 or the heads) of the dq and of the dk/dv lists.
    dq_layout_axes: tuple[int, int]
    dkv_layout_axes: tuple[int, int]
    #: One pass (`dkv_call` with a dq accumulator) or the dq kernel and the dk/dv kernel
    #: apart (bit-identical from run to run).
    single_pass: bool = False
    #: The launches, of `LAUNCHES`, that may run persistent (`persistent_for`): `ctas` CTAs
    #: (one per SM; ``None``: one per work item) each running several items, the next item's
    #: own tiles loading during this one. Otherwise one item per CTA.
    persistent: tuple[str, ...] = ()
    ctas: int | None = None
    #: Whether the dq launch also writes the bias's gradient (each visited block's dS, in
    #: float32; ``cfg.bias``, the two launches apart).
    bias_gradient: bool = False
    #: Whether the dq launch also writes the T5 table's gradient (``cfg.relative``, the two
    #: launches apart): each near block's dS at its offset class, and each row's sums of dS
    #: over the blocks of the two far parts (`dq_call`).
    relative_gradient: bool = False

    def reads_keys(self, masked: bool) -> bool:
        """Whether a block's logits read its first key (and its positions): the mask in a
        partial block, ALiBi, the bias, the T5 table and the score function in every
        block."""
        return (masked or self.alibi or self.bias or self.relative is not None
                or self.function is not None)

    @property
    def dq_columns(self) -> int:
        """Head-dim columns of dq each compute warpgroup of the single pass adds per block: at
        D >= 128 the two split the columns (each over both warpgroups' keys, so a block's dq
        partial is added once); below, each adds all columns over its own keys (a 32-column
        half would not be a whole 128-byte swizzle row)."""
        return self.head_dim // COMPUTE_WARPGROUPS if self.head_dim >= 128 else self.head_dim

    def _fixed_bytes(self, streamed_rows: int, fused: bool, buffers: int) -> int:
        """Shared memory besides the ring: `buffers` sets of four own 64-row tiles (two per
        compute warpgroup) and, `fused`, the double-buffered dS tiles and each warpgroup's
        float32 dq stage."""
        fixed = buffers * 4 * ROWS_PER_WARPGROUP * self.head_dim * 2
        if fused:
            fixed += COMPUTE_WARPGROUPS * streamed_rows * (
                2 * ROWS_PER_WARPGROUP * 2 + self.dq_columns * 4)
        return fixed

    def streamed_rows(self, launch: str) -> int:
        """Rows of the tiles `launch` streams through its ring: the dq launch's kv-blocks,
        the dk/dv launch's q-blocks."""
        if launch not in LAUNCHES:
            raise ValueError(f"`launch` must be one of {LAUNCHES}; got {launch!r}.")
        return self.dq_block_kv if launch == "dq" else self.dkv_block_q

    def persistent_for(self, launch: str, fused: bool = False) -> bool:
        """Whether `launch` (`fused`: the single pass) is persistent: named in `persistent`,
        where two sets of own tiles leave room for two ring stages."""
        rows = self.streamed_rows(launch)
        stage = 2 * rows * self.head_dim * 2
        return launch in self.persistent and \
            self._fixed_bytes(rows, fused, 2) + 2 * stage <= SMEM_BUDGET

    def own_buffers(self, launch: str, fused: bool = False) -> int:
        """Buffers of each compute warpgroup's own tiles: 2 in a persistent launch, else 1."""
        return 2 if self.persistent_for(launch, fused) else 1

    def launch_ctas(self, launch: str, fused: bool = False) -> int | None:
        """CTAs of the launch: `ctas` where it is persistent, else ``None`` (one per item)."""
        return self.ctas if self.persistent_for(launch, fused) else None

    def stages(self, launch: str, fused: bool = False) -> int:
        """Ring depth of `launch` for two streamed tiles next to the own tiles
        (`own_buffers` sets of four 64-row tiles) and, `fused`, the double-buffered dS
        tiles and each warpgroup's float32 dq stage."""
        rows = self.streamed_rows(launch)
        buffers = self.own_buffers(launch, fused)
        return ring_stages(self._fixed_bytes(rows, fused, buffers),
                           2 * rows * self.head_dim * 2)

    @property
    def dkv_launches(self) -> tuple[str, ...]:
        """The dk/dv launches at this head dim (`dkv_launches_for`)."""
        return dkv_launches_for(self.head_dim)

    def dkv_group(self, fused: bool) -> int:
        """Query heads one work item of the dk/dv launch walks: the kv head's whole group
        (dk and dv summed in the kernel), or in the single pass (`fused`) one, so that its
        dk and dv come out per query head for the caller to sum. Whole groups measured 5 to
        14 % slower there (docs/mosaic.md, "Grouped heads in the dk/dv launch")."""
        return 1 if fused else self.group

    def probabilities(self, s, lse, vis=None, term=None, function=None):
        """``(P, factors)`` of one block from its raw products ``s = q . k`` (either
        orientation; `lse` (base 2) broadcast to it, `vis` the partial block's predicate,
        `term` a base-2 addition to the logits before the cap, ALiBi's, `function` the score
        function on the block's natural-unit logits, returning its value and derivative):
        ``P = exp2(logit - lse)``, and `factors` for `score_gradient`: the soft cap's ``t =
        tanh(capped logit / c)`` and the score function's derivative (each None without
        it)."""
        t = derivative = None
        base2 = term is not None
        logits = s if term is None else s * self.log2_factor + term
        if function is not None:
            value, derivative = function(logits * (1.0 / LOG2E) if base2
                                         else s * self.softmax_scale)
            logits, base2 = value * LOG2E, True
        if self.soft_cap:
            # tanh(x) = 1 - 2 / (exp(2x) + 1), as in the forward: no NaN at any logit.
            e = jnp.exp2(logits * (2.0 / self.soft_cap) if base2
                         else s * (2.0 * self.log2_factor / self.soft_cap))
            t = 1.0 - 2.0 / (e + 1.0)
            logits = t * (self.soft_cap * LOG2E)
        elif not base2:
            logits = s * self.log2_factor
        if vis is not None:
            logits = jnp.where(vis, logits, -jnp.inf)
        p = jnp.exp2(logits - lse)
        if derivative is not None:
            # Pairs the function or the mask hide (P = 0) take no gradient, whatever the
            # derivative is there (inf or NaN at -inf).
            derivative = jnp.where(p > 0.0, derivative, 0.0)
        return p, (t, derivative)

    def score_gradient(self, p, dp, delta, factors, value_gradient: bool = False):
        """``dS = P (dp - delta)`` from `probabilities`' ``(P, factors)`` and the block's raw
        ``dp = dO . v`` (`delta` broadcast to it), times the soft cap's derivative ``1 -
        t^2`` and the score function's where there are they. dS is the gradient of the
        products before the softmax scale: dq and dk take the scale afterwards.

        With `value_gradient`, ``(dS, G)``: `G` is the gradient of the score function's
        value (dS before the function's derivative), which the arrays it reads take."""
        t, derivative = factors
        ds = p * (dp - delta)
        if t is not None:
            ds = ds * (1.0 - t * t)
        value = ds
        ds = ds if derivative is None else ds * derivative
        return (ds, value) if value_gradient else ds


def _launch(body, scratch, ctas: int, out_type, operands, interpret):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    def entry(*refs):
        pl.run_scoped(lambda *scoped: body(*refs, scoped), *scratch, collective_axes="wg")

    kwargs = {} if interpret is None else {"interpret": interpret}
    return plgpu.kernel(
        entry, out_type=out_type, grid=(ctas,), grid_names=("ctas",),
        num_threads=COMPUTE_WARPGROUPS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), **kwargs,
    )(*operands)


def _scratch(own_shape, ring_shape, dtype, stages):
    """Two own tiles per compute warpgroup (``own_shape = (buffers, warpgroups, rows, d)``),
    two rings of streamed tiles (``(stages, rows, d)``), and their barriers (an own tile's
    ready barrier is ``buffer * COMPUTE_WARPGROUPS + warpgroup``). The products contract
    over the streamed tiles' rows too: their swizzle is `swizzle_for` those rows."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    own_barriers = own_shape[0] * COMPUTE_WARPGROUPS
    swizzle = swizzle_for(ring_shape[1], jnp.dtype(dtype).itemsize)
    smem = (swizzled(own_shape, dtype, swizzle), swizzled(own_shape, dtype, swizzle),
            swizzled(ring_shape, dtype, swizzle), swizzled(ring_shape, dtype, swizzle))
    ready = (plgpu.Barrier(num_barriers=own_barriers),) * 2 + \
        (plgpu.Barrier(num_barriers=stages),) * 2
    free = (plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),) * 2
    return smem, ready, free


def _segments(cfg: BackwardConfig, q_segment_ids, kv_segment_ids):
    """``(has ids, query ids, key ids)``, the ids apart (`segment_ids_apart`) so that the
    partial blocks' segment term is equality alone, as in the forward; the element predicate
    (``cfg.predicate``) reads them as the call passed them."""
    dummy = jnp.zeros((1, 1), jnp.int32)
    if q_segment_ids is None:
        return False, dummy, dummy
    if cfg.predicate is not None:
        return True, q_segment_ids, kv_segment_ids
    return True, *segment_ids_apart(q_segment_ids, kv_segment_ids)


def _own_tiles(buffers: int, wg, own, ready, source_of):
    """``(load(j, item), tiles(j), wait(j))`` of a compute warpgroup's own tiles: ``load``
    starts copying item j's two tiles (``source_of(n, item)``, the global-memory slice of
    tile n) into buffer ``j % buffers``; ``tiles`` is that buffer's pair of smem refs;
    ``wait`` waits for both copies."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    def barrier(j):
        return lax.rem(j, buffers) * COMPUTE_WARPGROUPS + wg

    def tiles(j):
        buffer = lax.rem(j, buffers)
        return tuple(x.at[buffer, wg] for x in own)

    def load(j, item):
        for n, (smem, ready_ref) in enumerate(zip(tiles(j), ready)):
            plgpu.copy_gmem_to_smem(source_of(n, item), smem, ready_ref.at[barrier(j)])

    def wait(j):
        for ready_ref in ready:
            plgpu.barrier_wait(ready_ref.at[barrier(j)])

    return load, tiles, wait


def _load_next_own_tiles(cta_items: WorkItems, load, j, upcoming):
    """In a persistent launch, start loading item j + 1's own tiles into the other buffer
    (once item j - 1's gradient, which left through it, has been read out)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if cta_items.single:
        return

    @pl.when(j + 1 < cta_items.count)
    def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        load(j + 1, upcoming)


def _slopes(cfg: BackwardConfig, slopes, launch: str):
    """The launch's ALiBi slopes operand: `slopes` as float32, or a one-element placeholder
    without ALiBi."""
    if not cfg.alibi:
        return jnp.zeros((1,), jnp.float32)
    if slopes is None:
        raise ValueError(f"{launch}: `slopes` must be given when cfg.alibi is on.")
    return slopes.astype(jnp.float32)


def _position_tiles(cfg: BackwardConfig, ops: Ops, shape, q_axis: int, q_base, k_base,
                    q_vector, k_vector):
    """``(query positions, key positions)`` of a block of `shape` whose queries run along
    `q_axis`, as tiles: the per-call positions (``cfg.positions``; `q_vector` and `k_vector`
    the block's rows' and columns' vectors in that orientation), else the token indices from
    `q_base` and `k_base`."""
    k_axis = 1 - q_axis
    if cfg.positions:
        return (lax.broadcast_in_dim(q_vector, shape, [q_axis]),
                lax.broadcast_in_dim(k_vector, shape, [k_axis]))
    return q_base + ops.iota(shape, q_axis), k_base + ops.iota(shape, k_axis)


def _positions_operands(cfg: BackwardConfig, positions, launch: str):
    """The launch's ``(q_positions, kv_positions)`` operands: the padded per-call positions,
    or one-element placeholders without them."""
    if not cfg.positions:
        dummy = jnp.zeros((1, 1), jnp.int32)
        return dummy, dummy
    if positions is None:
        raise ValueError(f"{launch}: `positions` must be given when cfg.positions is on.")
    return positions


def _element_map_operand(cfg: BackwardConfig, element_map, launch: str):
    """The launch's element map operand (``cfg.elements``), or a one-element placeholder."""
    if not cfg.elements:
        return jnp.zeros((1, 1, 1, 1), ELEMENT_MAP_DTYPE)
    if element_map is None:
        raise ValueError(f"{launch}: `element_map` must be given when cfg.elements is on.")
    return element_map


def _bias_operand(cfg: BackwardConfig, bias, launch: str):
    """The launch's bias operand: `bias` where ``cfg.bias`` (required), else a placeholder."""
    if not cfg.bias:
        return jnp.zeros((1, 1, 1, 1), jnp.float32)
    if bias is None:
        raise ValueError(f"{launch}: `bias` must be given when cfg.bias is on.")
    return bias


def _function_tiles(cfg: BackwardConfig, b, h, positions, values=None, seen=None):
    """The score function of a block as `BackwardConfig.probabilities` takes it (natural-unit
    logits to their value and derivative), on the query and key position tiles
    ``positions()`` (in the block's orientation), the scalars it reads taken from `values`
    (`common.item_values`), or ``None`` without one. `seen`, a list, receives the logits it
    was evaluated on (for `common.read_derivatives`)."""
    if cfg.function is None:
        return None

    def tiles(s):
        if seen is not None:
            seen.append(s)
        return function_tile(cfg, s, b, h, *positions(), values=values, derivative=True)

    return tiles


def data_read_count(cfg: BackwardConfig) -> int:
    """Reads of arrays whose gradient is formed (`LogitTerms.differentiated_reads`): the
    rows `dkv_call` returns for them (``0`` without)."""
    return len(cfg.differentiated_reads)


def _store_rows(stage, rows, target, wait: bool):
    """Write a row vector (e.g. one head's slope-gradient rows) to global memory through the
    warpgroup's shared-memory `stage`, once the copy out of it before has read it (`wait`:
    where there was one)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if wait:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    stage[...] = rows
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, target)


def _check_schedule(items, buffers: int, launch: str, num_items: int):
    """Refuse a schedule of several items a CTA for a launch that is not persistent, and,
    where the items are known on the host, one that names an item the launch does not have
    (`num_items` of them: a dk/dv item of grouped heads is a kv head's tile)."""
    if buffers == 1 and items.shape[1] != 1:
        raise ValueError(f"{launch}: a schedule of several items a CTA needs a persistent "
                         f"launch (`BackwardConfig.persistent_for`); got items of shape "
                         f"{items.shape}.")
    try:
        largest = int(np.max(np.asarray(items)))
    except jax.errors.TracerArrayConversionError:
        return
    if largest >= num_items:
        raise ValueError(f"{launch}: the schedule names item {largest}; the launch has "
                         f"{num_items} (batch x heads it walks apart x tiles).")


def dq_call(cfg: BackwardConfig, q, k, v, do, lse, delta, full_count, full_index,
            partial_count, partial_index, q_segment_ids=None, kv_segment_ids=None, *,
            slopes=None, positions=None, element_map=None, bias=None, data=None, table=None,
            schedule=None, interpret=None):
    """dq ``[B, H, Lq, D]`` (the query's dtype) for padded inputs; `lse` (base 2) and `delta`
    are ``[B, H, Lq]`` float32; the lists are the dq layout's. `schedule` is the launch's
    ``(items, counts)`` (`dq_schedule` when ``None``).

    `bias` is the padded ``[1 or B, 1 or H, Lq, Lk]`` bias (``cfg.bias``); with
    ``cfg.bias_gradient`` the launch returns ``(dq, dbias)``: `dbias` ``[B, H, Lq, Lk]``
    float32 holds each visited block's dS (the bias's gradient there) and is undefined in
    the blocks the layout skips (the caller zeroes them: `BlockLayout.classes`).

    `table` is the T5 table ``[H, num_buckets]`` (``cfg.relative``); with
    ``cfg.relative_gradient`` the launch also returns ``(dnear, dfar)``, after `dbias`:
    `dnear` ``[B, H, C, Lq, Dk]`` float32 holds each near block's dS at its offset class
    (`common.RelativeTiles`; ``Dk`` the block's keys; undefined at the classes a q-tile's
    near blocks do not take: `relative_visited`), `dfar` ``[2, B, H, Lq]`` float32 each
    row's sum of dS over the blocks of the far part of the lower keys and of the higher
    ones (every pair there in `RelativeTiles.far_buckets`).

    With ALiBi (``cfg.alibi``, `slopes` ``[H]`` float32) each logit takes its term; the
    slopes' gradient comes from `dkv_call`. `positions` are the padded ``(q_positions,
    kv_positions)`` ``[B, L]`` int32 (``cfg.positions``); `element_map` the padded
    ``[1 or B, 1 or H, Lq, Lk]`` map (``cfg.elements``); `data` the read tables of the score
    function's arrays (``cfg.traced``; `common.table_operands`)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    ops = Ops(interpreted=interpret is not None)
    bq, d, dtype = ROWS_PER_WARPGROUP, cfg.head_dim, q.dtype
    bk = cfg.dq_block_kv
    buffers = cfg.own_buffers("dq")
    stages = cfg.stages("dq")
    group = cfg.group
    num_tiles = cfg.q_len // BLOCK_OWN
    has_segments, qseg, kseg = _segments(cfg, q_segment_ids, kv_segment_ids)
    slopes = _slopes(cfg, slopes, "dq_call")
    qpos, kpos = _positions_operands(cfg, positions, "dq_call")
    emap = _element_map_operand(cfg, element_map, "dq_call")
    bias = _bias_operand(cfg, bias, "dq_call")
    floats, ints = table_operands(cfg, data)
    relative = relative_tiles(cfg, bq, bk, transposed=False)
    table, bank, splits = relative_operands(
        relative, table, (full_count, full_index, partial_count, partial_index), "dq_call")
    table_grad = cfg.relative_gradient
    if table_grad and relative is None:
        raise ValueError("dq_call: cfg.relative_gradient needs cfg.relative.")
    items, counts = schedule if schedule is not None else dq_schedule(cfg, full_count,
                                                                       partial_count)
    _check_schedule(items, buffers, "dq_call", cfg.batch * cfg.heads * num_tiles)

    def body(items_ref, counts_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, fcnt_ref,
             fidx_ref, pcnt_ref, pidx_ref, qseg_ref, kseg_ref, slopes_ref, qpos_ref, kpos_ref,
             emap_ref, bias_ref, floats_ref, ints_ref, table_ref, bank_ref, splits_ref, *refs):
        *outputs, scoped = refs
        dq_ref, *outputs = outputs
        dbias_ref = outputs.pop(0) if cfg.bias_gradient else None
        dnear_ref, dfar_ref = outputs if table_grad else (None, None)
        if table_grad:
            *scoped, far_stage = scoped
        (q_own, do_own, k_ring, v_ring), (q_ready, do_ready, k_ready, v_ready), \
            (k_free, v_free) = scoped
        wg = lax.axis_index("wg")
        cta_items = WorkItems(items_ref, counts_ref, num_tiles, cfg.heads, cfg.dq_layout_axes,
                           (fcnt_ref, fidx_ref, pcnt_ref, pidx_ref), items.shape[1] == 1)

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

            def source_of(n, item):
                b, h, tile = item[:3]
                return (q_ref, do_ref)[n].at[b, h, pl.ds(tile * BLOCK_OWN + wg * bq, bq)]

            load, own_tiles, wait_own = _own_tiles(buffers, wg, (q_own, do_own),
                                                   (q_ready, do_ready), source_of)
            load(0, cta_items.decoded(cta_items.raw(0)))

            def run_item(j, first_step, item, upcoming):
                b, h, tile = item[:3]
                _, prefix, n_full, n_steps = cta_items.member(item, 0)
                splits = None if relative is None else split_counts(splits_ref, prefix)
                q_smem, do_smem = own_tiles(j)
                q_base = tile * BLOCK_OWN + wg * bq
                rows = pl.ds(q_base, bq)
                with jax.named_scope("entry"):
                    lse = ops.load(lse_ref, (b, h, rows), ops.row_layout)
                    delta = ops.load(delta_ref, (b, h, rows), ops.row_layout)
                    q_seg = None
                    if has_segments:
                        q_seg = lax.broadcast_in_dim(
                            ops.load(qseg_ref, (b, rows), ops.row_layout), (bq, bk), [0])
                    alibi = (AlibiBlocks(ops, slopes_ref[h], bq, rows_are_queries=True)
                             if cfg.alibi else None)
                    q_pos = (ops.load(qpos_ref, (b, rows), ops.row_layout) if cfg.positions
                             else None)
                    values = item_values(cfg, floats_ref, ints_ref, b, h)
                    far_terms = (None if relative is None
                                 else relative.far_terms(table_ref, h))
                with jax.named_scope("wait_own"):
                    wait_own(j)
                _load_next_own_tiles(cta_items, load, j, upcoming)

                def block_terms(k_base, part, masked):
                    """``(bias tile, table tile, element map tile)`` of a block (each
                    ``None`` where it has none), loaded before its products so that their
                    latency hides."""
                    bias = table = emap = None
                    if cfg.bias:
                        bias = load_pair_tile(ops, bias_ref, b, h, rows, pl.ds(k_base, bk))
                    if relative is not None:
                        table = relative.near_tile(ops, bank_ref, h, part, q_base - k_base)
                    if masked and cfg.elements:
                        emap = load_pair_tile(ops, emap_ref, b, h, rows, pl.ds(k_base, bk))
                    return bias, table, emap

                def block_grad(s, dp, k_base, k_pos, masked, part, loaded):
                    """dS from the block's products S and dP (`k_base` its first key and
                    `k_pos` its keys' positions, read before them where its logits need
                    them: `BackwardConfig.reads_keys`)."""
                    vis = term = None
                    row_lse = lse

                    def tiles():
                        return _position_tiles(cfg, ops, (bq, bk), 0, q_base, k_base, q_pos,
                                               k_pos)

                    if alibi is not None and cfg.positions:
                        term = alibi_positions_term(slopes_ref[h], *tiles())
                    elif alibi is not None:
                        offset = k_base - q_base
                        if cfg.whole_terms:
                            term = alibi.whole((bq, bk), offset)
                        else:
                            # The columns' part in each logit; the rows' part and the
                            # block's constant in the rows' log-sum-exp.
                            term = lax.broadcast_in_dim(alibi.streamed(bk, 0), (bq, bk), [1])
                            row_lse = lse - (alibi.own_term + alibi.shift(offset))
                    if cfg.bias:
                        bias_term = base2_tile(loaded[0])
                        term = bias_term if term is None else term + bias_term
                    if relative is not None:
                        table_term = relative.term(far_terms, part, loaded[1])
                        term = table_term if term is None else term + table_term
                    if masked:
                        k_seg = None
                        if has_segments:
                            k_seg = lax.broadcast_in_dim(
                                ops.load(kseg_ref, (b, pl.ds(k_base, bk)), ops.col_layout),
                                (bq, bk), [1])
                        vis = block_visible(
                            cfg, ops, h, (bq, bk), 0, q_base, k_base, tiles(), q_seg, k_seg,
                            map_tile=lambda: loaded[2] != 0, values=values)
                    p, factors = cfg.probabilities(
                        s, lax.broadcast_in_dim(row_lse, (bq, bk), [0]), vis, term,
                        _function_tiles(cfg, b, h, tiles, values))
                    return cfg.score_gradient(p, dp, lax.broadcast_in_dim(delta, (bq, bk), [0]),
                                              factors)

                def step(it, carry, masked, part=None):
                    acc, *far = carry
                    slot = lax.rem(first_step + it, stages)
                    k_base = k_pos = None
                    if cfg.reads_keys(masked):
                        k_base = cta_items.block(prefix, it, n_full) * bk
                        if cfg.positions:
                            k_pos = ops.load(kpos_ref, (b, pl.ds(k_base, bk)), ops.col_layout)
                    loaded = (None, None, None)
                    if cfg.bias or relative is not None or (masked and cfg.elements):
                        with jax.named_scope("load_terms"):
                            loaded = block_terms(k_base, part, masked)
                    with jax.named_scope("wait_kv"):
                        plgpu.barrier_wait(k_ready.at[slot])
                        plgpu.barrier_wait(v_ready.at[slot])
                    with jax.named_scope("products"):
                        s, dp = ops.products((bq, bk), [(q_smem, k_ring.at[slot], True),
                                              (do_smem, v_ring.at[slot], True)])
                    plgpu.barrier_arrive(v_free.at[slot])
                    with jax.named_scope("softmax_partial" if masked else "softmax_full"):
                        ds = block_grad(s, dp, k_base, k_pos, masked, part, loaded)
                    if dbias_ref is not None:
                        with jax.named_scope("bias_gradient"):
                            dbias_ref.at[b, h, rows, pl.ds(k_base, bk)][...] = ds
                    if table_grad:
                        with jax.named_scope("table_gradient"):
                            if part == 1:
                                c = relative.offset_class(q_base - k_base)
                                dnear_ref.at[b, h, c, rows][...] = ds
                            else:
                                far[part // 2] = far[part // 2] + ds.sum(axis=1)
                    with jax.named_scope("accumulate"):
                        (acc,) = ops.accumulate((acc,), [(ds.astype(dtype), k_ring.at[slot])])
                    plgpu.barrier_arrive(k_free.at[slot])
                    return (acc, *far)

                acc = ops.cast(jnp.zeros((bq, d), jnp.float32), ops.wgmma_layout)
                far = (() if not table_grad else
                       tuple(ops.cast(jnp.zeros((bq,), jnp.float32), ops.row_layout)
                             for _ in range(2)))
                acc, *far = walk_list(n_full, n_steps, step, (acc, *far), splits)
                if table_grad:
                    with jax.named_scope("table_far_rows"):
                        if not cta_items.single:
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for n, sums in enumerate(far):
                            far_stage.at[wg, n][...] = sums
                        plgpu.commit_smem()
                        for n in range(2):
                            plgpu.copy_smem_to_gmem(far_stage.at[wg, n],
                                                    dfar_ref.at[n, b, h, rows])
                with jax.named_scope("epilogue"):
                    q_smem[...] = (acc * cfg.softmax_scale).astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, h, rows])

            cta_items.run(run_item)
            plgpu.wait_smem_to_gmem(0)

        def tile_of_block(ref, b, h, block):
            return ref.at[b, lax.div(h, group), pl.ds(block * bk, bk)]

        pl.when(wg == COMPUTE_WARPGROUPS)(lambda: cta_items.memory_warpgroup(
            ((k_ref, k_ring, k_ready, k_free), (v_ref, v_ring, v_ready, v_free)), stages,
            tile_of_block))

    scratch = _scratch((buffers, COMPUTE_WARPGROUPS, bq, d), (stages, bk, d), dtype, stages)
    out_type = (jax.ShapeDtypeStruct(q.shape, dtype),)
    if cfg.bias_gradient:
        out_type = (*out_type, jax.ShapeDtypeStruct((cfg.batch, cfg.heads, cfg.q_len,
                                                     cfg.kv_len), jnp.float32))
    if table_grad:
        classes = relative.offsets[1]
        out_type = (*out_type,
                    jax.ShapeDtypeStruct((cfg.batch, cfg.heads, classes, cfg.q_len, bk),
                                         jnp.float32),
                    jax.ShapeDtypeStruct((2, cfg.batch, cfg.heads, cfg.q_len), jnp.float32))
        scratch = (*scratch, plgpu.SMEM((COMPUTE_WARPGROUPS, 2, bq), jnp.float32))
    out = _launch(body, scratch, items.shape[0], out_type,
                  (items, counts, q, k, v, do, lse, delta, full_count, full_index,
                   partial_count, partial_index, qseg, kseg, slopes, qpos, kpos, emap, bias,
                   floats, ints, table, bank, splits), interpret)
    return tuple(out) if len(out) > 1 else out[0]


def dq_schedule(cfg: BackwardConfig, full_count, partial_count):
    """The dq launch's ``(items, counts)`` (`persistent_schedule` of the dq layout's counts:
    q-tiles, heavy last tiles first; one item per CTA unless the launch is persistent)."""
    return persistent_schedule(full_count, partial_count, cfg.batch, cfg.heads,
                               cfg.launch_ctas("dq"))


def dkv_schedule(cfg: BackwardConfig, t_full_count, t_partial_count, fused: bool):
    """The dk/dv launch's ``(items, counts)``, `fused` for the single pass
    (`persistent_schedule` of the transposed counts: kv-tiles of each kv head over its group
    of query heads, or of each query head in the single pass (`BackwardConfig.dkv_group`),
    heavy first tiles first; one item per CTA unless the launch is persistent)."""
    group = cfg.dkv_group(fused)
    return persistent_schedule(t_full_count, t_partial_count, cfg.batch, cfg.heads // group,
                               cfg.launch_ctas("dkv", fused), heavy_tiles_last=False,
                               group=group)


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
             dq_accumulator=None, slopes=None, positions=None, element_map=None, bias=None,
             data=None, table=None, schedule=None, computes="both", interpret=None):
    """``(dk, dv)``, each ``[B, H_kv, Lk, D]`` (a kv head's gradient summed over its group of
    query heads in float32, in the kernel), for padded inputs ``q, do [B, H, Lq, D]`` and
    ``k, v [B, H_kv, Lk, D]``; the lists are the dk/dv layout's transposed ones. `schedule`
    is the launch's ``(items, counts)`` (`dkv_schedule` when ``None``). In the single pass
    dk and dv are ``[B, H, Lk, D]``, per query head (`BackwardConfig.dkv_group`).

    With `dq_accumulator` (a zeroed float32 `jax.Ref` of `dq_accumulator_shape`) the pass is
    the whole backward: each block's dS also goes to shared memory (16-bit) for a fifth product,
    the block's dq partial ``dS K`` (unscaled; `BackwardConfig.dq_columns` says how the two
    compute warpgroups share it), which is staged in shared memory in float32 and added into
    the accumulator by TMA's bulk reduce-add. The order of those additions
    varies between runs, so the sum does too, in its last bits.

    With ALiBi (``cfg.alibi``, `slopes` ``[H]`` float32) it also returns `slope_rows`
    ``[B, H, Lk]`` float32, each key's ``sum_q dS (k - q)`` (the slope's gradient summed
    over the batch and the rows), as ``(dk, dv, slope_rows)``, in both modes (docs/mosaic.md,
    "ALiBi", says why not in the dq kernel). `positions` are the padded ``(q_positions,
    kv_positions)`` ``[B, L]`` int32 (``cfg.positions``); `element_map` the padded map
    transposed, ``[1 or B, 1 or H, Lk, Lq]`` (``cfg.elements``), `bias` the padded bias
    transposed, the same shape (``cfg.bias``), and `table` the T5 table ``[H, num_buckets]``
    (``cfg.relative``; its gradient comes from `dq_call`).

    `data` are the read tables of the score function's arrays (``cfg.traced``;
    `common.table_operands`). Where one is traced (``cfg.data_gradients``) it also returns,
    last, `data_rows` ``[R, B, H, Lk]`` float32: for each of the function's R reads of such
    an array (`LogitTerms.differentiated_reads`, in the order it reads them), each key's sum
    over its visible queries of the read's cotangent, ``G d function / d read`` (`G` the
    gradient of the function's value); the caller sums them per head and batch row (each
    read's scalar is the same for all of a head's and batch row's pairs).

    `computes` (of `BackwardConfig.dkv_launches`) is ``"both"``, or ``"dk"`` (dk and the
    rows above, no dv: the result has no `dv`) or ``"dv"`` (`dv` alone, no dS formed: the
    result is `dv`)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    ops = Ops(interpreted=interpret is not None)
    bk, d, dtype = ROWS_PER_WARPGROUP, cfg.head_dim, q.dtype
    bq = cfg.dkv_block_q
    fused = dq_accumulator is not None
    if computes not in ("both", "dk", "dv"):
        raise ValueError(f"dkv_call: `computes` must be 'both', 'dk' or 'dv'; got "
                         f"{computes!r}.")
    if fused and computes != "both":
        raise ValueError("dkv_call: the single pass (a dq accumulator) forms both dk and dv.")
    # Which accumulators this launch keeps; the dv part forms no dS, so none of the outputs
    # read from it.
    with_dk, with_dv = computes != "dv", computes != "dk"
    buffers = cfg.own_buffers("dkv", fused)
    stages = cfg.stages("dkv", fused)
    dq_cols = cfg.dq_columns
    split = dq_cols < d
    # Query heads an item walks, and items a kv head has.
    group = cfg.dkv_group(fused)
    kv_share = cfg.group // group
    num_tiles = cfg.kv_len // BLOCK_OWN
    has_segments, qseg, kseg = _segments(cfg, q_segment_ids, kv_segment_ids)
    slopes = _slopes(cfg, slopes, "dkv_call")
    qpos, kpos = _positions_operands(cfg, positions, "dkv_call")
    emap = _element_map_operand(cfg, element_map, "dkv_call")
    bias = _bias_operand(cfg, bias, "dkv_call")
    floats, ints = table_operands(cfg, data)
    relative = relative_tiles(cfg, bk, bq, transposed=True)
    table, bank, splits = relative_operands(
        relative, table, (t_full_count, t_full_index, t_partial_count, t_partial_index),
        "dkv_call")
    reads_out = data_read_count(cfg) if with_dk else 0
    slope_out = cfg.alibi and with_dk
    items, counts = schedule if schedule is not None else dkv_schedule(
        cfg, t_full_count, t_partial_count, fused)
    _check_schedule(items, buffers, "dkv_call", cfg.batch * cfg.heads // group * num_tiles)

    def body(items_ref, counts_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, fcnt_ref,
             fidx_ref, pcnt_ref, pidx_ref, qseg_ref, kseg_ref, slopes_ref, qpos_ref, kpos_ref,
             emap_ref, bias_ref, floats_ref, ints_ref, table_ref, bank_ref, splits_ref, *refs):
        # Inputs (the dq accumulator), outputs, then the scratch buffers in one tuple.
        *refs, scoped = refs
        if reads_out:
            *scoped, data_stage = scoped
            *refs, data_ref = refs
        if slope_out:
            *scoped, rows_stage = scoped
            *refs, rows_ref = refs
        if fused:
            dq_ref, *refs = refs
            *scoped, (ds_own, dq_stage, ds_ready, item_done) = scoped
        dk_ref = refs.pop(0) if with_dk else None
        dv_ref = refs.pop(0) if with_dv else None
        *scoped, rows_scoped = scoped
        (k_own, v_own, q_ring, do_ring), (k_ready, v_ready, q_ready, do_ready), \
            (q_free, do_free) = scoped
        (lse_ring, delta_ring), (lse_ready, delta_ready), (lse_free, delta_free) = rows_scoped
        wg = lax.axis_index("wg")
        cta_items = WorkItems(items_ref, counts_ref, num_tiles, cfg.heads // group,
                           cfg.dkv_layout_axes, (fcnt_ref, fidx_ref, pcnt_ref, pidx_ref),
                           items.shape[1] == 1, group)

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

            def source_of(n, item):
                b, h, tile = item[:3]
                keys = pl.ds(tile * BLOCK_OWN + wg * bk, bk)
                return (k_ref, v_ref)[n].at[b, lax.div(h, kv_share), keys]

            load, own_tiles, wait_own = _own_tiles(buffers, wg, (k_own, v_own),
                                                   (k_ready, v_ready), source_of)
            load(0, cta_items.decoded(cta_items.raw(0)))

            def streamed_row(ring, ready, free, slot):
                """The q-block's log-sum-exp or delta from its ring slot, in registers."""
                plgpu.barrier_wait(ready.at[slot])
                row = ops.load_smem(ring.at[slot], ops.col_layout)
                plgpu.barrier_arrive(free.at[slot])
                return row

            def run_item(j, first_step, item, upcoming):
                b, h_item, tile = item[:3]
                k_smem, v_smem = own_tiles(j)
                k_base = tile * BLOCK_OWN + wg * bk
                keys = pl.ds(k_base, bk)
                k_seg = k_pos = None
                with jax.named_scope("entry"):
                    if has_segments:
                        k_seg = lax.broadcast_in_dim(
                            ops.load(kseg_ref, (b, keys), ops.row_layout), (bk, bq), [0])
                    if cfg.positions:
                        k_pos = ops.load(kpos_ref, (b, keys), ops.row_layout)
                with jax.named_scope("wait_own"):
                    wait_own(j)
                _load_next_own_tiles(cta_items, load, j, upcoming)
                # The split dq partial reads the other warpgroup's K tile too.
                buffer = lax.rem(j, buffers)

                def add_dq_partial(ds_t, step, h, cols):
                    """dq[cols] += dS K, the fifth product: at D >= 128 this warpgroup's half
                    of the columns over both warpgroups' keys (their dS tiles meet in shared
                    memory, double-buffered over the CTA's steps: a tile is rewritten two
                    blocks on, after both warpgroups passed the next block's barrier), else
                    all columns over its own keys."""
                    slot = lax.rem(step, 2)
                    with jax.named_scope("ds_store"):
                        ds_own.at[slot, wg][...] = ds_t
                        plgpu.commit_smem()
                    if split:
                        with jax.named_scope("ds_barrier"):
                            plgpu.barrier_arrive(ds_ready.at[slot])
                            plgpu.barrier_wait(ds_ready.at[slot])
                        columns = pl.ds(wg * dq_cols, dq_cols)
                        pairs = [(ds_own.at[slot, w], k_own.at[buffer, w, :, columns])
                                 for w in range(COMPUTE_WARPGROUPS)]
                    else:
                        columns = pl.ds(0, d)
                        pairs = [(ds_own.at[slot, wg], k_smem)]
                    with jax.named_scope("dq_product"):
                        dq_part = ops.sum_of_products_transposed_a((bq, dq_cols), pairs)
                    # The previous block's reduce-add has read the stage before it is
                    # rewritten.
                    with jax.named_scope("stage_wait"):
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    stage = dq_stage.at[wg]
                    with jax.named_scope("stage_store"):
                        stage[...] = dq_part
                        plgpu.commit_smem()
                    # In the interpreter each (kv tile, warpgroup) has its own slice of the
                    # accumulator (`dq_accumulator_shape`): it has no atomic reduce-add.
                    target = (dq_ref.at[tile * COMPUTE_WARPGROUPS + wg] if ops.interpreted
                              else dq_ref)
                    with jax.named_scope("reduce_add"):
                        ops.add_to_gmem(stage, target.at[b, h, cols, columns])

                def run_member(g, carry):
                    """Walk the list of query head `g` of the kv head's group (the ring's
                    steps from `step0` on), adding into dk and dv; with ALiBi, write that
                    head's slope-gradient rows."""
                    step0, dk, dv = carry
                    h, prefix, n_full, n_steps = cta_items.member(item, g)
                    splits = None if relative is None else split_counts(splits_ref, prefix)
                    alibi = (AlibiBlocks(ops, slopes_ref[h], bk, rows_are_queries=False)
                             if cfg.alibi else None)
                    values = item_values(cfg, floats_ref, ints_ref, b, h)
                    far_terms = (None if relative is None
                                 else relative.far_terms(table_ref, h))

                    def step(it, carry, masked, part=None):
                        dk, dv, slope_rows, data_rows = carry
                        slot = lax.rem(step0 + it, stages)
                        q_base = cta_items.block(prefix, it, n_full) * bq
                        cols = pl.ds(q_base, bq)
                        q_pos = None
                        if cfg.positions and cfg.reads_keys(masked):
                            q_pos = ops.load(qpos_ref, (b, cols), ops.col_layout)

                        def tiles():
                            return _position_tiles(cfg, ops, (bk, bq), 1, q_base, k_base,
                                                   q_pos, k_pos)

                        # The block's bias, table and element map tiles, loaded before its
                        # products so that their latency hides (each None where it has none).
                        loaded = (None, None, None)
                        if cfg.bias or relative is not None or (masked and cfg.elements):
                            with jax.named_scope("load_terms"):
                                loaded = (
                                    None if not cfg.bias
                                    else load_pair_tile(ops, bias_ref, b, h, keys, cols),
                                    None if relative is None
                                    else relative.near_tile(ops, bank_ref, h, part,
                                                            q_base - k_base),
                                    None if not (masked and cfg.elements)
                                    else load_pair_tile(ops, emap_ref, b, h, keys, cols))
                        with jax.named_scope("load_rows"):
                            lse = streamed_row(lse_ring, lse_ready, lse_free, slot)
                        with jax.named_scope("wait_q"):
                            plgpu.barrier_wait(q_ready.at[slot])
                            plgpu.barrier_wait(do_ready.at[slot])
                        with jax.named_scope("products"):
                            (s_t,) = ops.products((bk, bq),
                                                  [(k_smem, q_ring.at[slot], True)])
                        # The logits the score function was evaluated on, for the gradient
                        # of the scalars it reads (`data_rows`).
                        seen = []
                        with jax.named_scope("softmax_partial" if masked else "softmax_full"):
                            vis = None
                            if masked:
                                q_seg = None
                                if has_segments:
                                    q_seg = lax.broadcast_in_dim(
                                        ops.load(qseg_ref, (b, cols), ops.col_layout),
                                        (bk, bq), [1])
                                vis = block_visible(
                                    cfg, ops, h, (bk, bq), 1, q_base, k_base, tiles(), q_seg,
                                    k_seg, map_tile=lambda: loaded[2] != 0, values=values)
                            term = None
                            if alibi is not None and cfg.positions:
                                term = alibi_positions_term(slopes_ref[h], *tiles())
                            elif alibi is not None:
                                # The columns' part goes into their lse, the rows' into
                                # each logit (both into each logit under a soft cap or
                                # before a score function).
                                if cfg.whole_terms:
                                    term = alibi.whole((bk, bq), q_base - k_base)
                                else:
                                    term = lax.broadcast_in_dim(alibi.own_term, (bk, bq), [0])
                                    lse = lse - alibi.streamed(bq, q_base - k_base)
                            if cfg.bias:
                                bias_term = base2_tile(loaded[0])
                                term = bias_term if term is None else term + bias_term
                            if relative is not None:
                                table_term = relative.term(far_terms, part, loaded[1])
                                term = table_term if term is None else term + table_term
                            p_t, factors = cfg.probabilities(
                                s_t, lax.broadcast_in_dim(lse, (bk, bq), [1]), vis, term,
                                _function_tiles(cfg, b, h, tiles, values, seen))
                        # dV's product and dP's in one group, dK's after dS: fewer live
                        # registers than S and dP together beside the dk and dv accumulators.
                        with jax.named_scope("dv_dp"):
                            dv_pair = (p_t.astype(dtype), do_ring.at[slot])
                            dp_pair = (v_smem, do_ring.at[slot], True)
                            if not with_dk:
                                (dv,) = ops.accumulate((dv,), [dv_pair])
                            else:
                                fresh = ops.cast(jnp.zeros((bk, bq), jnp.float32),
                                                 ops.wgmma_layout)
                                if with_dv:
                                    dv, dp_t = ops.accumulate((dv, fresh), [dv_pair, dp_pair])
                                else:
                                    (dp_t,) = ops.accumulate((fresh,), [dp_pair])
                        plgpu.barrier_arrive(do_free.at[slot])
                        with jax.named_scope("load_rows"):
                            # Read in every part, so that the ring moves on.
                            delta = streamed_row(delta_ring, delta_ready, delta_free, slot)
                        if not with_dk:
                            plgpu.barrier_arrive(q_free.at[slot])
                            return dk, dv, slope_rows, data_rows
                        with jax.named_scope("ds"):
                            ds_t, value_t = cfg.score_gradient(
                                p_t, dp_t, lax.broadcast_in_dim(delta, (bk, bq), [1]), factors,
                                value_gradient=True)
                            if reads_out:
                                # Each read's cotangent, G d function / d read, summed per
                                # key (pairs hidden, P = 0, take none).
                                derivatives = read_derivatives(cfg, seen[0], b, h, *tiles(),
                                                               values)
                                data_rows = tuple(
                                    rows + jnp.where(p_t > 0.0, value_t * dr, 0.0).sum(axis=1)
                                    for rows, dr in zip(data_rows, derivatives))
                            if slope_out and cfg.positions:
                                # Each key's sum of dS (k_pos - q_pos) over the block.
                                q_tile, k_tile = tiles()
                                distance = (k_tile - q_tile).astype(jnp.float32)
                                slope_rows = slope_rows + (ds_t * distance).sum(axis=1)
                            elif slope_out:
                                slope_rows = slope_rows + alibi.gradient_rows(
                                    ds_t, q_base - k_base)
                            ds_t = ds_t.astype(dtype)
                        with jax.named_scope("dk"):
                            (dk,) = ops.accumulate((dk,), [(ds_t, q_ring.at[slot])])
                        plgpu.barrier_arrive(q_free.at[slot])
                        if fused:
                            add_dq_partial(ds_t, step0 + it, h, cols)
                        return dk, dv, slope_rows, data_rows

                    def zero_rows():
                        return ops.cast(jnp.zeros((bk,), jnp.float32), ops.row_layout)

                    slope_rows = zero_rows() if slope_out else None
                    data_rows = tuple(zero_rows() for _ in range(reads_out))
                    dk, dv, slope_rows, data_rows = walk_list(
                        n_full, n_steps, step, (dk, dv, slope_rows, data_rows), splits)
                    if reads_out:
                        with jax.named_scope("data_rows"):
                            if not cta_items.single or group > 1:
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            for r, rows in enumerate(data_rows):
                                data_stage.at[wg, r][...] = rows
                            plgpu.commit_smem()
                            for r in range(reads_out):
                                plgpu.copy_smem_to_gmem(data_stage.at[wg, r],
                                                        data_ref.at[r, b, h, keys])
                    if slope_out:
                        with jax.named_scope("slope_rows"):
                            _store_rows(rows_stage.at[wg], slope_rows,
                                        rows_ref.at[b, h, keys],
                                        wait=not cta_items.single or group > 1)
                    return step0 + n_steps, dk, dv

                zeros = ops.cast(jnp.zeros((bk, d), jnp.float32), ops.wgmma_layout)
                start = (first_step, zeros if with_dk else None, zeros if with_dv else None)
                if group == 1:
                    _, dk, dv = run_member(0, start)
                else:
                    _, dk, dv = lax.fori_loop(0, group, run_member, start)
                if fused and split:
                    # Both warpgroups' last dq partials have read both K tiles before either
                    # is overwritten (by the gradient below, or the next item's tiles).
                    with jax.named_scope("item_barrier"):
                        plgpu.barrier_arrive(item_done)
                        plgpu.barrier_wait(item_done)
                with jax.named_scope("epilogue"):
                    if with_dk:
                        k_smem[...] = (dk * cfg.softmax_scale).astype(dtype)
                    if with_dv:
                        v_smem[...] = dv.astype(dtype)
                    plgpu.commit_smem()
                    if with_dk:
                        plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, h_item, keys])
                    if with_dv:
                        plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, h_item, keys])

            cta_items.run(run_item)
            plgpu.wait_smem_to_gmem(0)

        def tile_of_block(ref, b, h, block):
            return ref.at[b, h, pl.ds(block * bq, bq)]

        pl.when(wg == COMPUTE_WARPGROUPS)(lambda: cta_items.memory_warpgroup(
            ((q_ref, q_ring, q_ready, q_free), (lse_ref, lse_ring, lse_ready, lse_free),
             (do_ref, do_ring, do_ready, do_free),
             (delta_ref, delta_ring, delta_ready, delta_free)), stages, tile_of_block))

    # Q and dO tiles, and beside them each q-block's log-sum-exp and delta rows.
    scratch = (*_scratch((buffers, COMPUTE_WARPGROUPS, bk, d), (stages, bq, d), dtype, stages),
               ((plgpu.SMEM((stages, bq), jnp.float32),) * 2,
                (plgpu.Barrier(num_barriers=stages),) * 2,
                (plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),) * 2))
    operands = (items, counts, q, k, v, do, lse, delta, t_full_count, t_full_index,
                t_partial_count, t_partial_index, qseg, kseg, slopes, qpos, kpos, emap, bias,
                floats, ints, table, bank, splits)
    if fused:
        scratch = (*scratch, (swizzled((2, COMPUTE_WARPGROUPS, bk, bq), dtype),
                              swizzled((COMPUTE_WARPGROUPS, bq, dq_cols), jnp.float32),
                              plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=2),
                              plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS)))
        operands = (*operands, dq_accumulator)
    grads = jax.ShapeDtypeStruct((cfg.batch, cfg.heads // group, cfg.kv_len, d), dtype)
    out_type = (grads,) * (with_dk + with_dv)
    if slope_out:
        scratch = (*scratch, plgpu.SMEM((COMPUTE_WARPGROUPS, bk), jnp.float32))
        out_type = (*out_type, jax.ShapeDtypeStruct((cfg.batch, cfg.heads, cfg.kv_len),
                                                    jnp.float32))
    if reads_out:
        scratch = (*scratch, plgpu.SMEM((COMPUTE_WARPGROUPS, reads_out, bk), jnp.float32))
        out_type = (*out_type, jax.ShapeDtypeStruct(
            (reads_out, cfg.batch, cfg.heads, cfg.kv_len), jnp.float32))
    out = _launch(body, scratch, items.shape[0], out_type, operands, interpret)
    return out[0] if computes == "dv" else out
