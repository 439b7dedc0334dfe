"""The launches of `TritonBlockSparse`: their static configuration, the arrays each reads, and a
vmap rule that folds a mapped axis into the launch's batch.

Triton and jax-triton are imported lazily, when a launch is traced: this module imports on
machines that have neither.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from eqx_bsattn.contract import BlockLayout, MaskTerms, RelativeBuckets, far_splits

from .heuristics import lists_are_ranges, pow2


def triton_call(*args, **kwargs):
    """`jax_triton.triton_call`, imported on first use."""
    import jax_triton

    return jax_triton.triton_call(*args, **kwargs)


def jit_kernels():
    """The module of `@triton.jit` kernels, imported on first use (it imports Triton)."""
    from . import jit_kernels

    return jit_kernels


@functools.cache
def gpu_takes_ptx() -> bool:
    """Whether the launches compile to PTX: the GPU JAX sees is not a ROCm one (as JAX tells
    them apart, by its client's platform version). Also where no GPU is visible: a launch
    traced there is compiled for an NVIDIA GPU (benchmarks/triton_ptxas.py) or run by
    Triton's interpreter, which stands in for the kernels' one PTX instruction
    (benchmarks/triton_interpret.py)."""
    gpu = next((d for d in jax.devices() if d.platform == "gpu"), None)
    return gpu is None or "rocm" not in gpu.client.platform_version


def term_constexprs(terms: MaskTerms | None) -> dict:
    """The kernels' constexpr switches for the canonical terms (all off when ``None``)."""
    if terms is None:
        return dict(CAUSAL=False, CAUSAL_OFF=0, WIN_L=-1, WIN_R=-1, CHUNK=0, PREFIX=-1)
    return dict(
        CAUSAL=terms.causal_offset is not None,
        CAUSAL_OFF=terms.causal_offset or 0,
        WIN_L=-1 if terms.window_left is None else terms.window_left,
        WIN_R=-1 if terms.window_right is None else terms.window_right,
        CHUNK=terms.chunk or 0,
        PREFIX=-1 if terms.prefix is None else terms.prefix,
    )


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything static about one call: shapes, flags and launch parameters (hashable)."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    dtype: str
    bias_shape: tuple[int, int] | None
    num_sinks: int
    softmax_scale: float
    soft_cap: float
    #: The canonical terms evaluated in partial blocks; ``None``: the layouts' bitmaps.
    terms: MaskTerms | None
    has_q_positions: bool
    has_kv_positions: bool
    #: Score terms evaluated in every block: ALiBi slopes ``[H]``; a relative-bias table
    #: ``[H, num_buckets]`` bucketed by `relative` (``None``: no table).
    alibi: bool
    relative: RelativeBuckets | None
    #: ``(block_q, block_kv)`` and ``(num_warps, num_stages)`` of the forward, dq and dk/dv
    #: launches; each launch reads a layout built at its own blocks.
    fwd_blocks: tuple[int, int]
    dq_blocks: tuple[int, int]
    dkdv_blocks: tuple[int, int]
    fwd_launch: tuple[int, int]
    dq_launch: tuple[int, int]
    dkdv_launch: tuple[int, int]
    #: How the forward, dq and dk/dv launches walk their full lists (`list_mode`).
    list_modes: tuple[str, str, str]
    #: Whether the launches compile to PTX (an NVIDIA GPU, `gpu_takes_ptx`): a table's near
    #: entries then load through inline PTX, in pipelined loops (`split_constexprs`).
    ptx: bool = True

    @property
    def has_score(self) -> bool:
        return self.alibi or self.relative is not None

    def common(self) -> dict:
        t = self.terms
        bb, hb = self.bias_shape or (1, 1)
        # Score terms read positions in every block, whatever the mask reads.
        positions = self.has_score or (t is not None and t.uses_positions)
        return dict(
            H=self.heads, HKV=self.kv_heads, LQ=self.q_len, LK=self.kv_len,
            D=self.head_dim, DV=self.value_dim, DP=pow2(self.head_dim),
            DVP=pow2(self.value_dim), BB=bb, HB=hb,
            SCALE=float(self.softmax_scale), SOFTCAP=float(self.soft_cap),
            HAS_BIAS=self.bias_shape is not None,
            HAS_QPOS=self.has_q_positions and positions,
            HAS_KPOS=self.has_kv_positions and positions,
            HAS_SEG=t is not None and t.segment_ids,
            USE_BITMAP=t is None,
            IEEE=self.dtype == "float32",
            **term_constexprs(t), **score_constexprs(self.alibi, self.relative),
        )

    @property
    def splits_far_blocks(self) -> bool:
        """Whether the launches walk each list in three parts with a table: the blocks far
        before the rows, those near them, those far after (`far_splits`). Per-call
        positions leave a block's distances unknown on the host: the kernels then decide
        per block."""
        return (self.relative is not None and not self.has_q_positions
                and not self.has_kv_positions)

    def distance_entries(self, table: jax.Array) -> jax.Array:
        """`entries_by_distance` of `table` where the launches walk three parts (else a
        placeholder)."""
        if not self.splits_far_blocks:
            return jnp.zeros((1,), jnp.float32)
        return entries_by_distance(table, self.relative)

    def split_constexprs(self, transposed: bool, stages: int) -> dict:
        """The launch's switches for `far_splits`: ``REL_SPLIT``, the buckets of the first
        and last parts of a list (``REL_LOW_B``, ``REL_HIGH_B``: a forward or dq list runs
        along the keys, from far before its queries to far after; a transposed one along the
        queries, the other way), the run of `distance_entries` (``REL_DOFF``: minus its
        lowest distance; ``REL_ND``: its length), and the pipeline stages of the parts'
        loops: ``STAGES``, the launch's `stages`, for every part where the entries' per-pair
        load is inline PTX (``PTX_ENTRIES``, `ptx`). A `tl.load` there would be staged
        through shared memory, a float32 tile per stage, as the pipeliner stages every load
        of 32 bits or more that feeds a product: without PTX the near part is not pipelined
        (``NEAR_STAGES``)."""
        if not self.splits_far_blocks:
            return dict(REL_SPLIT=False, REL_LOW_B=0, REL_HIGH_B=0, REL_DOFF=0, REL_ND=1,
                        STAGES=stages, NEAR_STAGES=stages, PTX_ENTRIES=False)
        (_, ahead), (_, behind) = self.relative.far_buckets()
        low, high = (behind, ahead) if transposed else (ahead, behind)
        lowest, count = near_distances(self.relative)
        return dict(REL_SPLIT=True, REL_LOW_B=low, REL_HIGH_B=high, REL_DOFF=-lowest,
                    REL_ND=count, STAGES=stages, NEAR_STAGES=stages if self.ptx else 1,
                    PTX_ENTRIES=self.ptx)

    def thresholds(self) -> jax.Array:
        """The table's bucket thresholds, int32 ``[NT]`` (a placeholder without a table)."""
        values = self.relative.thresholds if self.relative is not None else ()
        return jnp.asarray(values or (0,), jnp.int32)


def near_distances(relative: RelativeBuckets) -> tuple[int, int]:
    """``(lowest, count)``: the distances ``d = q_pos - k_pos`` from `lowest` on, `count` of
    them, whose entries `entries_by_distance` holds. Past either end every distance is in its
    side's far bucket (`RelativeBuckets.far_buckets`), so a kernel clamps ``d`` into the run
    and reads the exact entry."""
    (ahead_gap, _), (behind_gap, _) = relative.far_buckets()
    return -behind_gap, ahead_gap + behind_gap + 1


def entries_by_distance(table: jax.Array, relative: RelativeBuckets) -> jax.Array:
    """The entry of `table` ``[H, num_buckets]`` at each of `near_distances`, float32 ``[H,
    count]`` (an exact gather): the blocks near the diagonal read a pair's term by its
    distance, with no bucket to compute."""
    lowest, count = near_distances(relative)
    with jax.ensure_compile_time_eval():  # constants, also inside a trace
        buckets = np.asarray(relative.bucket(np.arange(lowest, lowest + count)))
    return jnp.take(table.astype(jnp.float32), jnp.asarray(buckets), axis=1)


def score_constexprs(alibi: bool, relative: RelativeBuckets | None) -> dict:
    """The kernels' constexpr switches for the score terms."""
    nb = 1 if relative is None else relative.num_buckets
    return dict(HAS_ALIBI=alibi, HAS_REL=relative is not None, NB=nb, NBP=max(2, pow2(nb)),
                REL_BIDIR=relative is not None and relative.bidirectional,
                REL_HALF=2 if relative is None else relative.half,
                NT=0 if relative is None else len(relative.thresholds))


def list_mode(layout: BlockLayout, transposed: bool) -> str:
    """How a launch walks the full lists of `layout`: ``"range"`` (static, every list a range
    of consecutive blocks: no index loads), ``"index"`` (static, scattered) or ``"check"``
    (built on the device from per-call data, or a static layout picked by a traced index, as
    the ring's steps pick theirs: the kernel checks each list for a range)."""
    count, index = ((layout.t_full_count, layout.t_full_index) if transposed
                    else (layout.full_count, layout.full_index))
    if not layout.is_static or isinstance(count, jax.core.Tracer):
        return "check"
    return "range" if lists_are_ranges(count, index) else "index"


def layout_arrays(layout: BlockLayout, transposed: bool,
                  relative: RelativeBuckets | None = None) -> tuple:
    """The seven arrays a launch reads of `layout`: full / partial counts and indices, the
    bitmap index of each partial entry (the partial counts as a placeholder without bitmaps),
    the bitmaps (int8; a placeholder without) and the lists' `far_splits` for a table's
    `relative` buckets (a placeholder without)."""
    bitmaps = layout.bitmaps
    if bitmaps is None:
        bitmaps = jnp.zeros((1,), jnp.int8)
        idx = layout.t_partial_count if transposed else layout.partial_count
    else:
        bitmaps = bitmaps.astype(jnp.int8)
        idx = layout.t_bitmap_index if transposed else layout.bitmap_index
    if transposed:
        arrays = (layout.t_full_count, layout.t_full_index, layout.t_partial_count,
                  layout.t_partial_index, idx, bitmaps)
    else:
        arrays = (layout.full_count, layout.full_index, layout.partial_count,
                  layout.partial_index, idx, bitmaps)
    splits = (jnp.zeros((1,), jnp.int32) if relative is None
              else far_splits(*arrays[:4], transposed, layout.block_q, layout.block_kv, relative))
    return tuple(jnp.asarray(a).astype(jnp.int32) if a.dtype != jnp.int8 else a
                 for a in arrays) + (jnp.asarray(splits, jnp.int32),)


def _list_params(arrays, mode: str, stages: int) -> dict:
    fcnt, fidx, _, pidx = arrays[:4]
    return dict(CF=fidx.shape[-1], CP=pidx.shape[-1], MB=fcnt.shape[0], MH=fcnt.shape[1],
                FULL_CONTIG=mode == "range", FULL_CHECK=mode == "check", PREFETCH=stages >= 3)


#: How a launch's arrays lie along the batch, for its vmap rule (`batched_launch`):
#: ``"batch"``: the leading axis is the call's batch (q, k, v, positions, segment ids, dO, ...);
#: ``"bcast"``: the leading axis is 1 (shared by the batch) or the batch (bias, layout lists);
#: ``"shared"``: no batch axis (sinks, bitmaps). A one-dimensional array is a placeholder for
#: an absent input (the kernel never reads it) whatever its role.
BATCH, BCAST, SHARED = "batch", "bcast", "shared"


def batched_launch(run, cfg: LaunchConfig, roles: tuple[str, ...], out_roles: tuple[str, ...]):
    """``run(cfg, *arrays) -> tuple of arrays``, with a vmap rule that folds the mapped axis
    into the batch: ``jax.vmap`` over a call (so `eqx.filter_vmap` over unbatched inputs) is one
    launch of ``V * B`` batch elements, not ``V`` launches.

    Arrays shared by the batch (a ``[1, ...]`` bias or layout) stay shared when they are not
    mapped, and are repeated per element when they are. Mapped sinks or bitmaps have no batch
    axis to fold into: such calls run one launch per element.
    """
    wrapped = jax.custom_batching.custom_vmap(functools.partial(run, cfg))

    @wrapped.def_vmap
    def rule(axis_size, in_batched, *args):
        if any(b and r == SHARED and a.ndim > 1 for a, b, r in zip(args, in_batched, roles)):
            args = tuple(a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
                         for a, b in zip(args, in_batched))
            out = jax.lax.map(lambda xs: wrapped(*xs), args)
            return out, jax.tree.map(lambda _: True, out)
        folded_batch = axis_size * cfg.batch
        folded = []
        for a, batched, role in zip(args, in_batched, roles):
            shape = a.shape[1:] if batched else a.shape
            if len(shape) <= 1:  # placeholder: the kernel never reads it
                folded.append(a[0] if batched else a)
            elif role == SHARED or (role == BCAST and not batched and shape[0] == 1):
                folded.append(a)
            else:
                full = (axis_size, cfg.batch) + shape[1:]
                a = jnp.broadcast_to(a if batched else a[None], full)
                folded.append(a.reshape((folded_batch,) + shape[1:]))
        bias_shape = cfg.bias_shape
        if bias_shape is not None:
            bias_shape = (folded[roles.index(BCAST)].shape[0], bias_shape[1])
        inner = batched_launch(run, dataclasses.replace(cfg, batch=folded_batch,
                                                        bias_shape=bias_shape),
                               roles, out_roles)
        outs = inner(*folded)
        unfolded = tuple(o if (r != BATCH or o.ndim <= 1)
                         else o.reshape((axis_size, cfg.batch) + o.shape[1:])
                         for o, r in zip(outs, out_roles))
        return unfolded, tuple(r == BATCH and o.ndim > 1 for o, r in zip(outs, out_roles))

    return wrapped


#: Roles (`batched_launch`) of each launch's arrays: q, k, v, bias (every launch's first
#: "bcast" array), [sinks,] the score arrays (slopes, table), the data (q / kv positions,
#: q / kv segment ids), [dO, lse, delta,] then the layout lists (`layout_arrays`: counts,
#: indices, bitmap indices, bitmaps, far splits).
_DATA_ROLES = (BATCH,) * 4
_LIST_ROLES = (BCAST,) * 5 + (SHARED, BCAST)
FORWARD_ROLES = (BATCH,) * 3 + (BCAST,) + (SHARED,) * 3 + _DATA_ROLES + _LIST_ROLES
BACKWARD_ROLES = (BATCH,) * 3 + (BCAST,) + (SHARED,) * 2 + _DATA_ROLES + (BATCH,) * 3 + _LIST_ROLES


def forward_launch(cfg: LaunchConfig, q, k, v, bias, sinks, score, data, lists):
    """``(out [B, H, Lq, Dv], lse [B, H, Lq] float32, base 2)``; `score` is ``(slopes,
    table)`` (float32, placeholders where off)."""

    def run(cfg, q, k, v, bias, sinks, slopes, table, *rest):
        lists = rest[4:]
        bq, bk = cfg.fwd_blocks
        nq = math.ceil(cfg.q_len / bq)
        warps, stages = cfg.fwd_launch
        return tuple(triton_call(
            q, k, v, bias, sinks, slopes, table, cfg.thresholds(), cfg.distance_entries(table),
            *rest,
            kernel=jit_kernels().forward_kernel,
            out_shape=(
                jax.ShapeDtypeStruct((cfg.batch, cfg.heads, cfg.q_len, cfg.value_dim), q.dtype),
                jax.ShapeDtypeStruct((cfg.batch, cfg.heads, cfg.q_len), jnp.float32),
            ),
            grid=(nq, cfg.heads, cfg.batch), num_warps=warps, num_stages=stages,
            NQB=nq, S=max(cfg.num_sinks, 1),
            SP=max(2, 1 << max(cfg.num_sinks - 1, 0).bit_length()),
            HAS_SINKS=cfg.num_sinks > 0, BLOCK_M=bq, BLOCK_N=bk,
            **_list_params(lists, cfg.list_modes[0], stages), **cfg.common(),
            **cfg.split_constexprs(False, stages),
        ))

    return batched_launch(run, cfg, FORWARD_ROLES, (BATCH, BATCH))(
        q, k, v, bias, sinks, *score, *data, *lists)


def dq_launch(cfg: LaunchConfig, q, k, v, bias, score, data, lists, do, lse, delta):
    """``(dq, dbias, dslopes, dtable)``: dq; the full-size float32 dS, which is the bias
    gradient, when there is a bias; with score terms, each program's partial sums of the
    slopes' gradient ``[B, H, NQB]`` and the table's ``[B, H, NQB, num_buckets]`` (float32,
    one row per program, summed by the caller). Placeholders where off."""

    def run(cfg, q, k, v, bias, slopes, table, *rest):
        lists = rest[7:]
        bq, bk = cfg.dq_blocks
        nq = math.ceil(cfg.q_len / bq)
        warps, stages = cfg.dq_launch
        has_bias = cfg.bias_shape is not None
        dbias_shape = (cfg.batch, cfg.heads, cfg.q_len, cfg.kv_len) if has_bias else (1,)
        programs = (cfg.batch, cfg.heads, nq)
        dslopes_shape = programs if cfg.alibi else (1,)
        dtable_shape = (programs + (cfg.relative.num_buckets,) if cfg.relative is not None
                        else (1,))
        return tuple(triton_call(
            q, k, v, bias, slopes, table, cfg.thresholds(), cfg.distance_entries(table),
            *rest,
            kernel=jit_kernels().dq_kernel,
            out_shape=(
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct(dbias_shape, jnp.float32),
                jax.ShapeDtypeStruct(dslopes_shape, jnp.float32),
                jax.ShapeDtypeStruct(dtable_shape, jnp.float32),
            ),
            # Blocks no program visits keep the zero gradient they have.
            zeroed_outputs=(1,) if has_bias else (),
            grid=(nq, cfg.heads, cfg.batch), num_warps=warps, num_stages=stages,
            NQB=nq, BLOCK_M=bq, BLOCK_N=bk, **_list_params(lists, cfg.list_modes[1], stages),
            **cfg.common(), **cfg.split_constexprs(False, stages),
        ))

    return batched_launch(run, cfg, BACKWARD_ROLES, (BATCH,) * 4)(
        q, k, v, bias, *score, *data, do, lse, delta, *lists)


def dkdv_launch(cfg: LaunchConfig, q, k, v, bias, score, data, t_lists, do, lse, delta):
    """dk and dv, one program per (kv-block, kv head, batch), over the transposed lists."""

    def run(cfg, q, k, v, bias, slopes, table, *rest):
        t_lists = rest[7:]
        bq, bk = cfg.dkdv_blocks
        nk = math.ceil(cfg.kv_len / bk)
        warps, stages = cfg.dkdv_launch
        return tuple(triton_call(
            q, k, v, bias, slopes, table, cfg.thresholds(), cfg.distance_entries(table),
            *rest,
            kernel=jit_kernels().dkdv_kernel,
            out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype),
                       jax.ShapeDtypeStruct(v.shape, v.dtype)),
            grid=(nk, cfg.kv_heads, cfg.batch), num_warps=warps, num_stages=stages,
            NKB=nk, BLOCK_M=bq, BLOCK_N=bk,
            **_list_params(t_lists, cfg.list_modes[2], stages),
            **cfg.common(), **cfg.split_constexprs(True, stages),
        ))

    return batched_launch(run, cfg, BACKWARD_ROLES, (BATCH, BATCH))(
        q, k, v, bias, *score, *data, do, lse, delta, *t_lists)

