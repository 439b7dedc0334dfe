"""`TritonBlockSparse`: block-sparse flash attention in Triton, launched through jax-triton.

Triton and jax-triton are imported lazily (inside functions), so this module imports on machines
that have neither; the kernel then declines with a reason the selector shows.
"""

import dataclasses
import functools
import math
import warnings
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqx_bsattn._kernel import AbstractKernel, Features
from eqx_bsattn._layout import build_layout
from eqx_bsattn._mask import AbstractMask, And, Full
from eqx_bsattn._tiling import Tiling

_LN2 = math.log(2.0)
_SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
_MAX_HEAD_DIM = 256

#: Tests replace this with a launcher of their own (e.g. Triton's interpreter on the CPU);
#: ``None`` means `jax_triton.triton_call`.
_LAUNCH = None


def _launcher():
    if _LAUNCH is not None:
        return _LAUNCH
    import jax_triton

    return jax_triton.triton_call


def _kernels():
    from . import _triton_kernels

    return _triton_kernels


@functools.cache
def _jax_triton_missing() -> str | None:
    try:
        import jax_triton  # noqa: F401
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install that fails at import
        return f"{type(e).__name__}: {e}"
    return None


# --------------------------------------------------------------------------------------------
# The mask compiler: mask tree -> the canonical form the kernel evaluates with constexprs.


@dataclasses.dataclass(frozen=True)
class CanonicalMask:
    """An AND of position predicates, each switched on by a kernel constexpr.

    ``causal_offset``: ``k <= q + offset``; ``window_left``/``window_right``:
    ``q - left <= k <= q + right``; ``chunk``: same ``pos // chunk``; ``prefix``:
    ``k < prefix or k <= q``; ``document``: equal, non-negative segment ids. ``None`` / False
    switch a term off.
    """

    causal_offset: int | None = None
    window_left: int | None = None
    window_right: int | None = None
    chunk: int | None = None
    prefix: int | None = None
    document: bool = False

    @property
    def uses_positions(self) -> bool:
        return any(x is not None for x in (self.causal_offset, self.window_left,
                                           self.window_right, self.chunk, self.prefix))

    def constexprs(self) -> dict:
        return dict(
            CAUSAL=self.causal_offset is not None,
            CAUSAL_OFF=self.causal_offset or 0,
            WIN_L=-1 if self.window_left is None else self.window_left,
            WIN_R=-1 if self.window_right is None else self.window_right,
            CHUNK=self.chunk or 0,
            PREFIX=-1 if self.prefix is None else self.prefix,
        )


def _min(a, b):
    return b if a is None else a if b is None else min(a, b)


def _table_cells(leaf) -> tuple[int, int] | None:
    """The ``(rows, cols)`` cell size of a block-table mask, else ``None``."""
    from eqx_bsattn.strategies.masks import BigBirdRandom, BlockLayoutMask

    if type(leaf) is BlockLayoutMask:
        return tuple(leaf.block_size)
    if type(leaf) is BigBirdRandom:
        return (leaf.block_size, leaf.block_size)
    return None


def canonical_mask(mask: AbstractMask, tiles=()) -> CanonicalMask | None:
    """Compile `mask` into a `CanonicalMask`, or ``None`` if it is not an AND of built-ins.

    Walks the ``&`` tree; each leaf must be `Full`, `Causal`, `SlidingWindow`, `ChunkedCausal`,
    `PrefixLM` or `Document` (with their options). Repeated terms merge (the tighter wins);
    two different chunk sizes do not. ``|``, ``~`` and every other mask give ``None``.

    `tiles`: the ``(block_q, block_kv)`` tilings the kernels will run with (forward and
    backward), for masks evaluated on token indices (no per-call positions). A block-table
    leaf (`BlockLayoutMask`, `BigBirdRandom`) whose cells are a multiple of every tile in both
    axes is constant on each tile; as a term of the AND, every tile the layout visits has it
    True, so the layout alone encodes it and it is dropped. Otherwise it gives ``None``.

    ```python
    canonical_mask(masks.Causal() & masks.SlidingWindow(1024, 0))
    # CanonicalMask(causal_offset=0, window_left=1024, window_right=0, ...)
    ```
    """
    from eqx_bsattn.strategies.masks import (
        Causal, ChunkedCausal, Document, PrefixLM, SlidingWindow,
    )

    leaves = []

    def walk(m):
        if type(m) is And:
            walk(m.left)
            walk(m.right)
        else:
            leaves.append(m)

    walk(mask)
    out = {"causal_offset": None, "window_left": None, "window_right": None, "chunk": None,
           "prefix": None, "document": False}
    for leaf in leaves:
        kind = type(leaf)
        if kind is Full:
            continue
        if kind is Causal:
            if leaf.bottom_right:  # not resolved against the lengths yet
                return None
            out["causal_offset"] = _min(out["causal_offset"], leaf.offset)
        elif kind is SlidingWindow:
            out["window_left"] = _min(out["window_left"], leaf.left)
            out["window_right"] = _min(out["window_right"], leaf.right)
        elif kind is ChunkedCausal:
            if out["chunk"] is not None and out["chunk"] != leaf.chunk_size:
                return None
            out["chunk"] = leaf.chunk_size
            out["causal_offset"] = _min(out["causal_offset"], 0)
        elif kind is PrefixLM:
            # (causal | k < p1) & (causal | k < p2) == causal | k < min(p1, p2)
            out["prefix"] = _min(out["prefix"], leaf.prefix_length)
        elif kind is Document:
            out["document"] = True
        elif (cells := _table_cells(leaf)) is not None and tiles and all(
            cells[0] % bq == 0 and cells[1] % bk == 0 for bq, bk in tiles
        ):
            continue  # tile-aligned table: the layout's EMPTY tiles already hold it
        else:
            return None
    return CanonicalMask(**out)


# --------------------------------------------------------------------------------------------
# Launch configuration and the launches.


def _pow2(n: int) -> int:
    return max(16, 1 << (int(n) - 1).bit_length())


def _check_tiling(tiling: Tiling) -> None:
    bq, bk = tiling.backward_blocks
    dq_q, dq_k = tiling.dq_blocks
    for name, value in (("block_q", tiling.block_q), ("block_kv", tiling.block_kv),
                        ("block_q_bwd", bq), ("block_kv_bwd", bk),
                        ("block_q_dq", dq_q), ("block_kv_dq", dq_k)):
        if value < 16 or value & (value - 1):
            raise ValueError(
                f"TritonBlockSparse needs Tiling.{name} to be a power of two >= 16; got {value}."
            )


@dataclasses.dataclass(frozen=True)
class _Config:
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
    canonical: CanonicalMask | None
    has_q_positions: bool
    has_kv_positions: bool
    #: ``(block_q, block_kv)`` and ``(num_warps, num_stages)`` of the forward, dq and dk/dv
    #: launches; each launch reads a layout built at its own blocks.
    fwd_blocks: tuple[int, int]
    dq_blocks: tuple[int, int]
    dkdv_blocks: tuple[int, int]
    fwd_launch: tuple[int, int]
    dq_launch: tuple[int, int]
    dkdv_launch: tuple[int, int]
    #: How the forward, dq and dk/dv launches walk their full lists (`_list_mode`).
    list_modes: tuple[str, str, str]

    def common(self) -> dict:
        c = self.canonical
        flags = dict(CAUSAL=False, CAUSAL_OFF=0, WIN_L=-1, WIN_R=-1, CHUNK=0, PREFIX=-1)
        if c is not None:
            flags = c.constexprs()
        bb, hb = self.bias_shape or (1, 1)
        return dict(
            H=self.heads, HKV=self.kv_heads, LQ=self.q_len, LK=self.kv_len,
            D=self.head_dim, DV=self.value_dim, DP=_pow2(self.head_dim),
            DVP=_pow2(self.value_dim), BB=bb, HB=hb,
            SCALE=float(self.softmax_scale), SOFTCAP=float(self.soft_cap),
            HAS_BIAS=self.bias_shape is not None,
            HAS_QPOS=self.has_q_positions and c is not None and c.uses_positions,
            HAS_KPOS=self.has_kv_positions and c is not None and c.uses_positions,
            HAS_SEG=c is not None and c.document,
            USE_BITMAP=c is None,
            IEEE=self.dtype == "float32",
            **flags,
        )


#: How a launch's arrays lie along the batch, for its vmap rule (`_batched_launch`):
#: ``"batch"``: the leading axis is the call's batch (q, k, v, positions, segment ids, dO, ...);
#: ``"bcast"``: the leading axis is 1 (shared by the batch) or the batch (bias, layout lists);
#: ``"shared"``: no batch axis (sinks, bitmaps). A one-dimensional array is a placeholder for
#: an absent input (the kernel never reads it) whatever its role.
_BATCH, _BCAST, _SHARED = "batch", "bcast", "shared"


def _batched_launch(run, cfg: "_Config", roles: tuple[str, ...], out_roles: tuple[str, ...]):
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
        if any(b and r == _SHARED and a.ndim > 1 for a, b, r in zip(args, in_batched, roles)):
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
            elif role == _SHARED or (role == _BCAST and not batched and shape[0] == 1):
                folded.append(a)
            else:
                full = (axis_size, cfg.batch) + shape[1:]
                a = jnp.broadcast_to(a if batched else a[None], full)
                folded.append(a.reshape((folded_batch,) + shape[1:]))
        bias_shape = cfg.bias_shape
        if bias_shape is not None:
            bias_shape = (folded[roles.index(_BCAST)].shape[0], bias_shape[1])
        inner = _batched_launch(run, dataclasses.replace(cfg, batch=folded_batch,
                                                         bias_shape=bias_shape),
                                roles, out_roles)
        outs = inner(*folded)
        unfolded = tuple(o if (r != _BATCH or o.ndim <= 1)
                         else o.reshape((axis_size, cfg.batch) + o.shape[1:])
                         for o, r in zip(outs, out_roles))
        return unfolded, tuple(r == _BATCH and o.ndim > 1 for o, r in zip(outs, out_roles))

    return wrapped


def _layout_arrays(layout, transposed: bool):
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
    return tuple(jnp.asarray(a).astype(jnp.int32) if a.dtype != jnp.int8 else a for a in arrays)


def _list_params(arrays, mode: str, stages: int) -> dict:
    fcnt, fidx, _, pidx, _, _ = arrays
    return dict(CF=fidx.shape[-1], CP=pidx.shape[-1], MB=fcnt.shape[0], MH=fcnt.shape[1],
                FULL_CONTIG=mode == "range", FULL_CHECK=mode == "check", PREFETCH=stages >= 3)


#: Static layouts whose rows visit fewer blocks than this on average, scattered (their full
#: lists are not ranges), run with `_short_row_blocks` when the tiling is the default.
_SHORT_ROWS_BELOW = 16


def _row_width(features: Features) -> int:
    """Bytes per row of the wider of q / v, over 2: the padded head dim, doubled for float32."""
    width = max(_pow2(features.head_dim), _pow2(features.value_dim))
    return width * (2 if features.dtype == "float32" else 1)


def _short_row_blocks(features: Features) -> tuple[int, int, int, int] | None:
    """``(block_q, block_kv, warps, stages)`` for short rows, or ``None`` (no such variant).

    64x64 tiles, 4 warps, 2 stages: for bf16 D=128 the forward takes 82 KiB of shared memory
    and ~170 registers a thread, the dq and dk/dv kernels ~99 KiB, so two programs share an SM
    and one's prologue and epilogue overlap the other's loop, which a row of a few blocks does
    not amortise. Measured on the H200: faster for BigBird (forward and backward) and for the
    document (segment ids: `default_tiling` sets the stages per kernel); causal rows are long.
    """
    if _row_width(features) > 128 or features.bias:
        return None
    return (64, 64, 4, 2)


def _short_scattered_rows(layout) -> bool:
    visits = np.asarray(layout.full_count) + np.asarray(layout.partial_count)
    if not visits.size or float(visits.mean()) >= _SHORT_ROWS_BELOW:
        return False
    return not _ranges(layout.full_count, layout.full_index)


#: Walk contiguous full lists as ranges (set False to measure the indexed path).
_CONTIGUOUS_RANGES = True

#: dk/dv: walk a group's q heads in one loop of (block, head) steps where the heads share one
#: list (set False to measure one loop per head).
_FLAT_GROUPS = True


def _list_mode(layout, transposed: bool) -> str:
    """How a launch walks the full lists of `layout`: ``"range"`` (static, every list a range
    of consecutive blocks: no index loads), ``"index"`` (static, scattered) or ``"check"``
    (built on the device from per-call data: the kernel checks each list for a range)."""
    if not layout.is_static:
        return "check" if _CONTIGUOUS_RANGES else "index"
    count, index = ((layout.t_full_count, layout.t_full_index) if transposed
                    else (layout.full_count, layout.full_index))
    return "range" if _CONTIGUOUS_RANGES and _ranges(count, index) else "index"


def _ranges(count, index) -> bool:
    """Whether every list of a concrete layout is a range of consecutive blocks."""
    count = np.asarray(count)
    index = np.asarray(index)
    first = index[..., 0]
    last = np.take_along_axis(index, np.maximum(count - 1, 0)[..., None], axis=-1)[..., 0]
    return bool(np.all((count == 0) | (last - first == count - 1)))


#: Roles (`_batched_launch`) of each launch's arrays: q, k, v, bias (every launch's first
#: "bcast" array), [sinks,] the data (q / kv positions, q / kv segment ids), [dO, lse, delta,]
#: then the layout lists (`_layout_arrays`: counts, indices, bitmap indices, bitmaps).
_DATA_ROLES = (_BATCH,) * 4
_LIST_ROLES = (_BCAST,) * 5 + (_SHARED,)
_FORWARD_ROLES = (_BATCH,) * 3 + (_BCAST, _SHARED) + _DATA_ROLES + _LIST_ROLES
_BACKWARD_ROLES = (_BATCH,) * 3 + (_BCAST,) + _DATA_ROLES + (_BATCH,) * 3 + _LIST_ROLES


def _forward_launch(cfg: _Config, q, k, v, bias, sinks, data, lists):
    def run(cfg, q, k, v, bias, sinks, *rest):
        lists = rest[4:]
        bq, bk = cfg.fwd_blocks
        nq = math.ceil(cfg.q_len / bq)
        warps, stages = cfg.fwd_launch
        return tuple(_launcher()(
            q, k, v, bias, sinks, *rest,
            kernel=_kernels()._fwd_kernel,
            out_shape=(
                jax.ShapeDtypeStruct((cfg.batch, cfg.heads, cfg.q_len, cfg.value_dim), q.dtype),
                jax.ShapeDtypeStruct((cfg.batch, cfg.heads, cfg.q_len), jnp.float32),
            ),
            grid=(nq, cfg.heads, cfg.batch), num_warps=warps, num_stages=stages,
            NQB=nq, S=max(cfg.num_sinks, 1),
            SP=max(2, 1 << max(cfg.num_sinks - 1, 0).bit_length()),
            HAS_SINKS=cfg.num_sinks > 0, BLOCK_M=bq, BLOCK_N=bk,
            **_list_params(lists, cfg.list_modes[0], stages), **cfg.common(),
        ))

    return _batched_launch(run, cfg, _FORWARD_ROLES, (_BATCH, _BATCH))(
        q, k, v, bias, sinks, *data, *lists)


def _dq_launch(cfg: _Config, q, k, v, bias, data, lists, do, lse, delta):
    """dq (and the full-size float32 dS, which is the bias gradient, when there is a bias)."""

    def run(cfg, q, k, v, bias, *rest):
        lists = rest[7:]
        bq, bk = cfg.dq_blocks
        nq = math.ceil(cfg.q_len / bq)
        warps, stages = cfg.dq_launch
        has_bias = cfg.bias_shape is not None
        dbias_shape = (cfg.batch, cfg.heads, cfg.q_len, cfg.kv_len) if has_bias else (1,)
        return tuple(_launcher()(
            q, k, v, bias, *rest,
            kernel=_kernels()._dq_kernel,
            out_shape=(
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct(dbias_shape, jnp.float32),
            ),
            # Blocks no program visits keep the zero gradient they have.
            zeroed_outputs=(1,) if has_bias else (),
            grid=(nq, cfg.heads, cfg.batch), num_warps=warps, num_stages=stages,
            NQB=nq, BLOCK_M=bq, BLOCK_N=bk, **_list_params(lists, cfg.list_modes[1], stages),
            **cfg.common(),
        ))

    return _batched_launch(run, cfg, _BACKWARD_ROLES, (_BATCH, _BATCH))(
        q, k, v, bias, *data, do, lse, delta, *lists)


def _dkdv_launch(cfg: _Config, q, k, v, bias, data, t_lists, do, lse, delta):
    """dk and dv, one program per (kv-block, kv head, batch), over the transposed lists."""

    def run(cfg, q, k, v, bias, *rest):
        t_lists = rest[7:]
        bq, bk = cfg.dkdv_blocks
        nk = math.ceil(cfg.kv_len / bk)
        warps, stages = cfg.dkdv_launch
        return tuple(_launcher()(
            q, k, v, bias, *rest,
            kernel=_kernels()._dkdv_kernel,
            out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype),
                       jax.ShapeDtypeStruct(v.shape, v.dtype)),
            grid=(nk, cfg.kv_heads, cfg.batch), num_warps=warps, num_stages=stages,
            NKB=nk, BLOCK_M=bq, BLOCK_N=bk, FLAT_GROUP=_FLAT_GROUPS,
            **_list_params(t_lists, cfg.list_modes[2], stages),
            **cfg.common(),
        ))

    return _batched_launch(run, cfg, _BACKWARD_ROLES, (_BATCH, _BATCH))(
        q, k, v, bias, *data, do, lse, delta, *t_lists)


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(cfg, q, k, v, bias, sinks, data, lists, bwd_lists):
    out, _ = _forward_launch(cfg, q, k, v, bias, sinks, data, lists)
    return out


def _attend_fwd(cfg, q, k, v, bias, sinks, data, lists, bwd_lists):
    out, lse = _forward_launch(cfg, q, k, v, bias, sinks, data, lists)
    return out, (q, k, v, bias, sinks, data, lists, bwd_lists, out, lse)


def _attend_bwd(cfg, res, do):
    q, k, v, bias, sinks, data, lists, bwd_lists, out, lse = res
    do = do.astype(q.dtype)
    # delta = rowsum(dO * O): one fused elementwise pass in XLA, memory-bound and cheap.
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    dq_lists, t_lists = bwd_lists
    dq, dbias_full = _dq_launch(cfg, q, k, v, bias, data, dq_lists, do, lse, delta)
    dk, dv = _dkdv_launch(cfg, q, k, v, bias, data, t_lists, do, lse, delta)
    if cfg.bias_shape is not None:
        bb, hb = cfg.bias_shape
        axes = tuple(a for a, n in ((0, bb), (1, hb)) if n == 1)
        dbias = jnp.sum(dbias_full, axis=axes, keepdims=True).astype(bias.dtype)
    else:
        dbias = jnp.zeros_like(bias)
    if cfg.num_sinks > 0:
        # d sink[h, s] = -sum over rows of exp(sink - lse) * delta (lse stored in base 2).
        lse_nat = lse * _LN2
        weight = jnp.exp(sinks[None, :, None, :] - lse_nat[..., None])  # [B, H, LQ, S]
        dsinks = -jnp.sum(weight * delta[..., None], axis=(0, 2)).astype(sinks.dtype)
    else:
        dsinks = jnp.zeros_like(sinks)
    zeros = jax.tree.map(_zero_cotangent, (data, lists, bwd_lists))
    return (dq, dk, dv, dbias, dsinks) + zeros


_attend.defvjp(_attend_fwd, _attend_bwd)


# --------------------------------------------------------------------------------------------
# The kernel strategy.


def _features_of(query, value, inputs) -> Features:
    """The parts of `Features` that `TritonBlockSparse.default_tiling` reads, from a call."""
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len, value_dim = value.shape[1:]
    return Features(
        platform="gpu", dtype=jnp.dtype(query.dtype).name, batch=batch, num_heads=heads,
        num_kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, head_dim=dim, value_dim=value_dim,
        bias=inputs.bias is not None, sinks=inputs.sinks is not None,
        segment_ids=inputs.q_segment_ids is not None,
        positions=inputs.q_positions is not None or inputs.kv_positions is not None,
    )


class TritonBlockSparse(AbstractKernel):
    """Block-sparse flash attention written in Triton, launched from JAX with jax-triton.

    The forward pass runs one program per (q-block, head, batch) over that q-block's visited
    kv-blocks: full blocks without masking, partial blocks with the mask evaluated in the
    kernel; online softmax in base 2 with float32 accumulation; it keeps the log-sum-exp for
    the backward pass. The backward pass is split: a dq kernel over q-blocks and a dk/dv
    kernel over kv-blocks (the layout's transposed lists) that loops over the q heads of its
    group, so grouped-query gradients are reduced deterministically, without atomics. The
    forward, dq and dk/dv launches have their own block sizes (`Tiling`'s forward, ``*_dq`` and
    backward fields) and layouts. Full lists that are ranges of blocks are walked without index
    loads: known on the host for static layouts, checked per row in the kernel for layouts built
    from per-call data.

    Masks that are an AND of `Causal`, `SlidingWindow`, `ChunkedCausal`, `PrefixLM`,
    `Document` and `Full` are evaluated in the kernel from positions (and segment ids); so are
    ANDs that also hold `BlockLayoutMask` / `BigBirdRandom` tables whose cells are multiples of
    the tiles (the layout encodes those). Any other mask without per-call data uses the
    layout's deduplicated element bitmaps.

    With the default tiling (none given, or one equal to `default_tiling`), a static layout
    whose rows visit few, scattered blocks (BigBird-like) runs with 64x64 tiles, 4 warps and 2
    stages, forward and backward; with segment ids all three launches take 64x64 tiles.

    Inputs ``[B, H, Lq, D]`` / ``[B, Hkv, Lk, D]`` / ``[B, Hkv, Lk, Dv]`` in bfloat16, float16
    or float32 (float32 products in full precision), head dims up to 256 (padded to a power of
    two inside the kernel); bias, sinks, soft cap, segment ids and positions, all
    differentiable where they are floating. GPU only; needs ``jax-triton`` (the ``gpu``
    extra).

    **Arguments:**

    - `fused_backward`: accepted for symmetry with other kernels, but no fused backward is
      built: when True, a warning says the split backward runs instead.

    ```python
    attn = BlockSparseAttention(mask=masks.Causal(), kernel=kernels.TritonBlockSparse())
    out = attn(q, k, v)          # q [B, H, L, D] bfloat16 on a GPU
    ```
    """

    fused_backward: bool = eqx.field(default=False, static=True)

    name: ClassVar[str] = "triton"

    @classmethod
    def priority(cls, platform):
        return 30 if platform == "gpu" else None

    def decline_reason(self, mask: AbstractMask, features: Features) -> str | None:
        if features.platform != "gpu":
            return f"Triton kernels run only on GPUs; this call runs on {features.platform!r}."
        missing = _jax_triton_missing()
        if missing is not None:
            return f"jax_triton / triton cannot be imported ({missing}); install the `gpu` extra."
        if features.dtype not in _SUPPORTED_DTYPES:
            return f"dtype {features.dtype} is not supported (bfloat16, float16, float32 are)."
        if max(features.head_dim, features.value_dim) > _MAX_HEAD_DIM:
            return (f"head dims above {_MAX_HEAD_DIM} are not supported; got "
                    f"{features.head_dim} / {features.value_dim}.")
        if canonical_mask(mask) is None and (features.positions or features.segment_ids):
            return ("the mask is not an AND of causal/window/chunk/prefix/document masks, so it "
                    "needs element bitmaps, which cannot be built with per-call positions or "
                    "segment ids.")
        return None

    def default_tiling(self, features: Features) -> Tiling:
        width = _row_width(features)
        short = _short_row_blocks(features)
        # Blocks ``(block_q, block_kv)`` and launches ``(warps, stages)`` of the forward, dk/dv
        # and dq kernels. dq walks kv-blocks for a tall q tile and dk/dv q-blocks for a tall kv
        # tile; with three stages each fetches two tiles ahead. H200, causal, L=16384, bf16,
        # D=128: dq 11.3 -> 5.6 ms against 64x128 with two stages, dk/dv 8.4 -> 8.2 ms.
        if width <= 64:
            # 16-bit D=64: dk/dv 64x128 spilled (27.5 ms); 32x128 with three stages: 4.95 ms.
            fwd, fl, bwd, bl, dq, dl = (128, 128), (4, 3), (32, 128), (4, 3), (128, 64), (4, 3)
        elif width <= 128:
            fwd, fl, bwd, bl, dq, dl = (128, 128), (8, 3), (64, 128), (8, 3), (128, 64), (8, 3)
        elif width <= 256:
            fwd, fl, bwd, bl = (64, 64), (8, 2), (64, 32), (8, 2)
            dq, dl = bwd, bl
        else:
            fwd, fl, bwd, bl = (32, 32), (4, 1), (32, 32), (4, 1)
            dq, dl = bwd, bl
        if features.bias:
            # The float32 bias tile is pipelined through shared memory like k and v: halve the
            # kv tile (and keep two stages) so every stage still fits in the 227 KiB.
            fwd, bwd = (fwd[0], max(32, fwd[1] // 2)), (bwd[0], max(32, bwd[1] // 2))
            fl, bl = (fl[0], min(fl[1], 2)), (bl[0], min(bl[1], 2))
            dq, dl = bwd, bl
        if features.segment_ids and short is not None:
            # Per-call documents: the layout is built on the device, so its rows cannot be
            # seen here; packed documents make short rows, which run faster with small tiles
            # (H200, 16 documents in 16384 tokens: forward with 3 stages, dq and dk/dv with
            # 2), and one layout then serves all three launches.
            fwd = bwd = dq = short[:2]
            fl, bl = (short[2], 3), short[2:]
            dl = bl
        # Short sequences (decoding) waste less with smaller tiles.
        cap_q, cap_k = _pow2(features.q_len), _pow2(features.kv_len)
        return Tiling(
            block_q=min(fwd[0], cap_q), block_kv=min(fwd[1], cap_k),
            block_q_bwd=min(bwd[0], cap_q), block_kv_bwd=min(bwd[1], cap_k),
            num_warps=fl[0], num_stages=fl[1], num_warps_bwd=bl[0], num_stages_bwd=bl[1],
            block_q_dq=min(dq[0], cap_q), block_kv_dq=min(dq[1], cap_k),
            num_warps_dq=dl[0], num_stages_dq=dl[1],
        )

    def __call__(self, query, key, value, *, mask, inputs, tiling, softmax_scale,
                 logits_soft_cap):
        if self.fused_backward:
            warnings.warn(
                "TritonBlockSparse(fused_backward=True): no fused backward is built; the split "
                "backward (dq kernel + dk/dv kernel) runs instead.",
                stacklevel=2,
            )
        _check_tiling(tiling)
        batch, heads, q_len, dim = query.shape
        kv_heads, kv_len, value_dim = value.shape[1:]
        fwd_blocks = (tiling.block_q, tiling.block_kv)
        dq_blocks, dkdv_blocks = tiling.dq_blocks, tiling.backward_blocks
        # Tables are looked up on positions: with per-call positions a tile is no cell.
        on_indices = inputs.q_positions is None and inputs.kv_positions is None
        tiles = (fwd_blocks, dq_blocks, dkdv_blocks) if on_indices else ()
        canonical = canonical_mask(mask, tiles)
        bitmaps = canonical is None
        if bitmaps and (inputs.q_positions is not None or inputs.kv_positions is not None
                        or inputs.q_segment_ids is not None):
            raise ValueError(
                "TritonBlockSparse cannot run this mask with per-call positions or segment ids "
                "(it needs element bitmaps, which need a static layout)."
            )
        positional = dict(q_positions=inputs.q_positions, kv_positions=inputs.kv_positions,
                          q_segment_ids=inputs.q_segment_ids,
                          kv_segment_ids=inputs.kv_segment_ids)

        static = all(x is None for x in positional.values())

        def layout_for(bq, bk, canonical):
            def build():
                return build_layout(mask, q_len=q_len, kv_len=kv_len, num_heads=heads,
                                    block_q=bq, block_kv=bk, with_bitmaps=canonical is None,
                                    **positional)

            if not static:
                return build()
            # Concrete even under jit, so the host can see which full lists are ranges.
            with jax.ensure_compile_time_eval():
                return build()

        fwd_layout = layout_for(*fwd_blocks, canonical)
        features = _features_of(query, value, inputs)
        if static and tiling == self.default_tiling(features):
            # Short scattered rows (BigBird-like static layouts): the short-row tiling.
            short = _short_row_blocks(features)
            if short is not None and _short_scattered_rows(fwd_layout):
                bq, bk = min(short[0], _pow2(q_len)), min(short[1], _pow2(kv_len))
                tiling = Tiling(block_q=bq, block_kv=bk, num_warps=short[2],
                                num_stages=short[3])
                fwd_blocks = dq_blocks = dkdv_blocks = (bq, bk)
                canonical = canonical_mask(mask, (fwd_blocks,))
                fwd_layout = layout_for(*fwd_blocks, canonical)
        layouts = {fwd_blocks: fwd_layout}
        for blocks in (dq_blocks, dkdv_blocks):
            if blocks not in layouts:
                layouts[blocks] = layout_for(*blocks, canonical)
        dq_layout, dkdv_layout = layouts[dq_blocks], layouts[dkdv_blocks]
        lists = _layout_arrays(fwd_layout, transposed=False)
        bwd_lists = (_layout_arrays(dq_layout, transposed=False),
                     _layout_arrays(dkdv_layout, transposed=True))

        dummy_int = jnp.zeros((1,), jnp.int32)

        def int_or_dummy(x):
            return dummy_int if x is None else x.astype(jnp.int32)

        data = tuple(int_or_dummy(positional[n]) for n in
                     ("q_positions", "kv_positions", "q_segment_ids", "kv_segment_ids"))
        bias = inputs.bias
        bias_arg = jnp.zeros((1,), jnp.float32) if bias is None else bias
        sinks = inputs.sinks
        sinks_arg = (jnp.zeros((1, 1), jnp.float32) if sinks is None
                     else sinks.astype(jnp.float32))
        fwd_warps = tiling.num_warps or 4
        fwd_stages = tiling.num_stages or 2
        bwd_launch = (tiling.num_warps_bwd or fwd_warps, tiling.num_stages_bwd or fwd_stages)
        cfg = _Config(
            batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len,
            head_dim=dim, value_dim=value_dim, dtype=jnp.dtype(query.dtype).name,
            bias_shape=None if bias is None else tuple(bias.shape[:2]),
            num_sinks=0 if sinks is None else sinks.shape[-1],
            softmax_scale=float(softmax_scale),
            soft_cap=0.0 if logits_soft_cap is None else float(logits_soft_cap),
            canonical=canonical,
            has_q_positions=inputs.q_positions is not None,
            has_kv_positions=inputs.kv_positions is not None,
            fwd_blocks=fwd_blocks, dq_blocks=dq_blocks, dkdv_blocks=dkdv_blocks,
            fwd_launch=(fwd_warps, fwd_stages),
            dq_launch=(tiling.num_warps_dq or bwd_launch[0], tiling.num_stages_dq or bwd_launch[1]),
            dkdv_launch=bwd_launch,
            list_modes=(_list_mode(fwd_layout, False), _list_mode(dq_layout, False),
                        _list_mode(dkdv_layout, True)),
        )
        out = _attend(cfg, query, key, value, bias_arg, sinks_arg, data, lists, bwd_lists)
        return out.astype(query.dtype)
