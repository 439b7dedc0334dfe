"""`MosaicBlockSparse`: the kernel strategy; its forward is `forward.forward_call`, its
backward `backward.dq_call` and `backward.dkv_call` apart (deterministic; the default) or
`backward.dkv_call` alone in one pass (dq summed across kv tiles by TMA reduce-add)."""

import dataclasses
import functools
import os
import types
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from eqx_bsattn.contract import (EMPTY, AbstractKernelConfig, AbstractLseKernel,
                                  CompiledMask, Features, MaskReads, ResolvedMask, TokenCoords,
                                  add_sinks, backward_delta, first_gpu, function_data, pad_axis,
                                  public_lse, refuse_forward_mode, refuse_second_order,
                                  typed_like, zero_cotangent)

from .backward import (BLOCK_OWN, BackwardConfig, backward_blocks, dkv_call,
                       dkv_launches_for, dkv_schedule, dq_accumulator_shape, dq_call,
                       dq_schedule, short_lists)
from .common import (ELEMENT_MAP_DTYPE, ROWS_PER_WARPGROUP, persistent_schedule,
                     score_function_tile)
from .common import LogitTerms, lowering_failure, relative_splits, relative_tiles, stored
from .config import MosaicConfig
from .data import (data_decline, data_lowering_failure, mask_terms, params_avals,
                   predicate_data, read_slots, read_tables, reads_arrays, table_gradients)
from .forward import BLOCK_Q, ForwardConfig, forward_call, rows_padded, stages_for

_DTYPES = ("bfloat16", "float16")
#: The head dims the launches take (q and v of one head dim); other head dims, and a value
#: head dim other than the query's, are zero-padded to the next of them (`kernel_head_dim`).
_HEAD_DIMS = (64, 128, 256)
#: The bias dtypes the launches read as they are (others are read as float32).
_BIAS_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
#: `_function_decline`'s params where the plan knows only that there are some.
_UNKNOWN = object()


#: `_mosaic_missing`'s reason on a machine without a GPU. The selector then judges the kernel
#: as if a Hopper GPU were there (and says once that this machine has none); running refuses.
NO_GPU = "no GPU is visible to JAX."


@functools.cache
def _mosaic_missing() -> str | None:
    """Why Pallas Mosaic GPU cannot run here, or ``None``."""
    try:
        import jax.experimental.pallas.mosaic_gpu  # noqa: F401
    except Exception as e:  # ImportError, or a jaxlib built without it
        return f"Pallas Mosaic GPU cannot be imported ({type(e).__name__}: {e})."
    gpu = first_gpu()
    if gpu is None:
        return NO_GPU
    capability = getattr(gpu, "compute_capability", None)
    if capability is not None and str(capability) not in ("9.0",):
        return f"needs a Hopper GPU (compute capability 9.0); found {capability}."
    return None


def score_function(score) -> tuple[object, object]:
    """``(term, params)`` of a call's score terms (`AttentionInputs.score`): its score
    function as the hashable ``term(s, batch, head, q_pos, k_pos, params)`` the kernels call
    (`ScoreTerm`) and its parameters (``None`` where it has none), or ``(None, None)``
    without a function."""
    if score is None or score.function is None:
        return None, None
    return score.function, score.params


@functools.lru_cache(maxsize=256)
def function_lowering_failure(term) -> str | None:
    """Why Pallas Mosaic GPU cannot lower the score function `term` (the first line of the
    error) or ``None``: the function and its derivative are lowered once for CUDA inside a
    one-warpgroup kernel, on a 64 x 128 float32 tile of logits and int32 position tiles in
    the wgmma layout, with traced batch and head scalars, as the attention kernels trace it.
    Cached per term: a verdict costs one lowering (runs nothing; no GPU needed)."""

    def tile(batch, head, rows, cols, s):
        value = score_function_tile(term, s, batch, head, rows, cols)
        again, derivative = score_function_tile(term, s, batch, head, rows, cols,
                                                derivative=True)
        return value + again * derivative

    return lowering_failure("the score function", tile)


@functools.lru_cache(maxsize=256)
def mask_lowering_failure(predicate) -> str | None:
    """Why Pallas Mosaic GPU cannot lower the element predicate of `predicate` (a
    `CompiledMask` without layouts; its `visible_at`) on the kernels' tiles (the first line of
    the error) or ``None``: lowered once for CUDA on 64 x 128 int32 index, position and
    segment id tiles in the wgmma layout with a traced head, as the partial blocks trace it.
    Cached per mask (runs nothing; no GPU needed)."""

    def tile(batch, head, rows, cols, s):
        segments = (lax.div(rows, 16), lax.div(cols, 16)) if predicate.uses_segment_ids else (
            None, None)
        visible = predicate.visible_at(
            head, TokenCoords(rows, rows + batch, segments[0], predicate.q_len),
            TokenCoords(cols, cols + batch, segments[1], predicate.kv_len))
        return jnp.where(visible, s, 0.0)

    return lowering_failure("the mask's element predicate", tile)




def _multiprocessors() -> int | None:
    """Streaming multiprocessors of the first GPU (the persistent forward runs one CTA on
    each), or ``None`` where JAX does not say."""
    return getattr(first_gpu(), "core_count", None)


def xla_asks_for_determinism() -> bool:
    """Whether ``XLA_FLAGS`` holds ``--xla_gpu_deterministic_ops=true`` (JAX's switch for
    run-to-run identical GPU results)."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == "--xla_gpu_deterministic_ops":
            return value.lower() in ("", "true", "1")
    return False


def refs_reach_kernels() -> bool:
    """Whether this JAX passes a `jax.Ref` into a Mosaic GPU kernel (0.11 and later), as the
    single-pass backward's dq accumulator needs."""
    return tuple(jax.__version_info__[:2]) >= (0, 11)


class MosaicBlockSparse(AbstractLseKernel):
    """Block-sparse flash attention for Hopper GPUs, written in Pallas Mosaic GPU, forward and
    backward.

    The forward pass is persistent and warp-specialised: a memory warpgroup streams the K / V
    tiles of each q-tile's visited kv-blocks through TMA into a ring of shared-memory slots,
    while two compute warpgroups (64 rows each) run wgmma and an online softmax in base 2.
    FULL blocks run without masking; partial blocks evaluate the compiled mask's canonical
    terms (causal with an offset, a window, chunks, a prefix, segment ids) on token indices,
    or, for a mask without them, its element predicate (`CompiledMask.visible_at`) traced on
    the block's index, position and segment id tiles (where it reads arrays at scalar
    indices of the head, per-head widths, with those scalars from read tables: `data`,
    `mask_route`), or, where the predicate reads an array otherwise or Mosaic GPU cannot
    lower it, tiles of the call's element map (`CompiledMask.element_map`, at most 4 GiB
    with its transpose).

    The backward pass is its own, in one of two modes:

    - deterministic (the default, ``deterministic=True``): a dq kernel over the dq layout and
      a dk/dv kernel over the transposed dk/dv lists, each gradient block written by one CTA
      in a fixed order, so results are bit-identical from run to run; 7 block products per
      visible block; docs/mosaic.md compares the two modes' speed.
    - single pass (``deterministic=False``): per (head, 128 keys, batch) it walks the kv
      tile's visible q blocks once, recomputing ``S^T`` and ``dP^T`` and accumulating dV and
      dK in registers; each block's dS also goes to shared memory for its dq partial
      ``dS K``, which TMA's bulk reduce-add sums into a zeroed float32 dq in global memory.
      5 block products per visible block; the order of the additions varies, so dq varies
      from run to run in its last bits. It runs only where JAX can hand the kernel its
      accumulator (0.11 and later) and XLA is not asked for deterministic ops
      (``--xla_gpu_deterministic_ops=true`` in ``XLA_FLAGS``), and not for ALiBi with
      per-call positions; elsewhere the deterministic backward runs.

    Grouped heads' dk / dv: the deterministic dk/dv launch sums a kv head's group of query
    heads inside the kernel; the single pass writes them per query head, summed after it in
    float32 in a fixed order. A logits soft cap
    runs in both passes; sinks join the kernel's output through its log-sum-exp
    (`add_sinks`), so their gradients flow; `attention_with_lse` returns the log-sum-exp,
    differentiable too. Inputs ``[B, H, Lq, D]`` / ``[B, Hkv, Lk, D]`` / ``[B, Hkv, Lk, Dv]``
    in bfloat16 or float16, D = Dv in {64, 128, 256}, other head dims up to 256 and
    ``Dv != D`` zero-padded to the least of those that holds both (`kernel_head_dim`; not
    where that would more than double the width), any lengths (padded to the tiles
    inside). ALiBi (`scores.ALiBi`, fixed or learned slopes) is evaluated inside the
    forward and backward kernels, with the slopes' gradient; so is a score function
    (`scores.ScoreFunction`), traced into each kernel on its register tiles, its derivative
    in the logits taken by JAX in the kernel; the arrays it reads (its `params`, arrays it
    closes over) are the launches' operands, read at scalar indices, their gradient formed
    by the dk/dv launch (`data`). Per-call positions replace the token indices in the
    mask's terms, ALiBi and the score function. A bias ``[1 or B, 1 or H, Lq, Lk]`` is an
    operand of every launch, its gradient written by the dq launch where it is
    differentiated. Declines other score terms (`score_kinds`), score functions that Mosaic
    GPU cannot lower or that read arrays other than at scalar indices of the head and batch
    row, masks whose element map is too large, and per-call positions or masks without
    terms inside a sharding's loop, each with a reason, so the selector gives the whole call
    to another kernel. Its tiles are fixed (`MosaicConfig.for_head_dim`): another kernel's
    config or a `Tiling` gives way to them, and a `MosaicConfig` must be that one.
    Its priority on a GPU (35) is above Triton's (30) and below cuDNN's (40) (docs/mosaic.md
    has the measurements behind that order).

    ```python
    attn = BlockSparseAttention(mask=mask, kernel=kernels.MosaicBlockSparse())
    out = attn(q, k, v)          # q [B, H, L, 128] bfloat16 on an H100 / H200
    ```
    """

    deterministic: bool = eqx.field(default=True, static=True)

    name: ClassVar[str] = "mosaic"
    platforms: ClassVar[tuple[str, ...]] = ("gpu",)
    score_kinds: ClassVar[tuple[str, ...]] = ("alibi", "relative_bias", "function")
    reads: ClassVar[MaskReads] = "elements"
    config_type: ClassVar[type[AbstractKernelConfig]] = MosaicConfig
    #: Built, lowered for CUDA and checked in the CPU interpreter; declined in one line (the
    #: selector keeps cuDNN or Triton) until `benchmarks/device_proofs.sh` has run them on a
    #: Hopper GPU.
    awaiting_device_run: ClassVar[Mapping[str, str]] = types.MappingProxyType({
        "padded_head_dims": "head dims outside 64 / 128 / 256 and Dv != D, zero-padded to "
                            "the launches' (`kernel_head_dim`)",
        "head_dim_256": "head dim 256 (one Q buffer in the forward, 32-row streamed tiles in "
                        "the backward, dk and dv as two launches)",
        "t5_table": "the T5 table's launches (`common.RelativeTiles`)",
    })

    def __check_init__(self):
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"`deterministic` must be a bool; got {self.deterministic!r}.")

    def single_pass(self) -> bool:
        """Whether the backward runs in one pass: ``deterministic=False``, JAX >= 0.11 and
        XLA not asked for deterministic ops."""
        return not (self.deterministic or xla_asks_for_determinism()) and refs_reach_kernels()

    @classmethod
    def priority(cls, platform):
        # Above TritonBlockSparse (30), below cuDNN (40): docs/mosaic.md has the measurements.
        return 35 if platform == "gpu" else None

    def decline_reason(self, mask: ResolvedMask, features: Features) -> str | None:
        missing = _mosaic_missing()
        if missing is not None and missing != NO_GPU:
            # Without a GPU the call is judged as if a Hopper GPU were there: what would run
            # on one (running it here refuses, `_check_runnable`).
            return missing
        if features.dtype not in _DTYPES:
            return f"dtype {features.dtype} is not supported (bfloat16 and float16 are)."
        dims = (features.head_dim, features.value_dim)
        width = kernel_head_dim(*dims)
        if width is None:
            return (f"head dims {dims[0]} / {dims[1]} are not supported (at most "
                    f"{_HEAD_DIMS[-1]} each).")
        if width > 2 * max(dims):
            return (f"head dims {dims[0]} / {dims[1]} would be zero-padded to {width}, over "
                    "twice their width.")
        if dims != (width, width) and self.awaits_device_run("padded_head_dims"):
            return (f"head dims {dims[0]} / {dims[1]}, zero-padded to {width}, have not yet "
                    "run on a GPU.")
        if width == 256 and self.awaits_device_run("head_dim_256"):
            return "head dim 256 has not yet run on a GPU."
        if "relative_bias" in features.score:
            why = _table_decline(features)
            if why is not None:
                return why
        if features.bias and features.in_loop:
            # A bias runs in the kernels, but not yet tested inside a sharding's loop
            # (RingAttention passes each step its shards' block of it).
            return "a bias inside a sharding's loop (RingAttention) is not supported."
        if features.score_function is not None:
            if features.sharded and not features.in_loop:
                # ShardMap and AllToAll give the function its global head and batch ids
                # through `jax.lax.axis_index`, inside the kernel body.
                return ("a score function inside ShardMap or AllToAll reads its global head "
                        "and batch ids through jax.lax.axis_index, which Mosaic GPU cannot "
                        "lower in a kernel.")
            why = _function_decline(features.score_function, _planned_params(features),
                                    width, features.in_loop)
            if why is not None:
                return why
        tiles = list(MosaicConfig.for_head_dim(width).blocks)
        terms = mask.kernel_terms(tiles)
        if terms is None:
            predicate = mask.predicate()
            why = _predicate_decline(predicate, features)
            if why is None:
                size = _element_map_bytes(predicate, features)
                route = mask_route(predicate, width)
                if route.reads == "elements" and size > ELEMENT_MAP_LIMIT:
                    why = _element_map_decline(predicate, size)
            if why is not None:
                return why
        if features.positions and features.in_loop and (terms is None or terms.uses_positions
                                                        or features.score):
            # Per-call positions run in the kernels, but not yet tested inside a sharding's
            # loop (RingAttention passes each step its shards' global positions).
            return ("per-call positions inside a sharding's loop (RingAttention) are not "
                    "supported.")
        return None

    def default_tiling(self, features: Features, mask: ResolvedMask) -> MosaicConfig:
        return MosaicConfig.for_head_dim(_features_width(features))

    def adapt_tiling(self, tiling: AbstractKernelConfig, features: Features) -> MosaicConfig:
        width = _features_width(features)
        fixed = MosaicConfig.for_head_dim(width)
        if isinstance(tiling, MosaicConfig) and tiling != fixed:
            raise ValueError(f"MosaicBlockSparse runs {fixed} at head dim {width} "
                             f"(its tiles are fixed); got {tiling}.")
        return fixed

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        return self.attention_with_lse(
            query, key, value, mask=mask, inputs=inputs, features=features, tiling=tiling,
            softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap)[0]

    def attention_with_lse(self, query, key, value, *, mask, inputs, features, tiling,
                           softmax_scale, logits_soft_cap):
        # Head dims outside the launches' run zero-padded to theirs: zero columns of q and k
        # add nothing to the logits, zero columns of v give output columns cut off here (and
        # the padding's gradients are cut off by JAX).
        dim, value_dim = query.shape[3], value.shape[3]
        width = kernel_head_dim(dim, value_dim)
        if width is None:
            raise ValueError(f"MosaicBlockSparse: head dims {dim} / {value_dim} are not "
                             f"supported (at most {_HEAD_DIMS[-1]} each).")
        query, key, value = (pad_axis(x, 3, width) for x in (query, key, value))
        out, lse = self._attention(query, key, value, mask, inputs, softmax_scale,
                                   logits_soft_cap)
        out = out[..., :value_dim]
        if inputs.sinks is not None:
            out, lse = add_sinks(out, lse, inputs.sinks)
        return out.astype(query.dtype), lse

    def _attention(self, query, key, value, mask, inputs, softmax_scale, logits_soft_cap):
        """``(out, lse)`` without sinks, differentiable in both (`_attend`)."""
        _check_runnable()
        refuse_forward_mode(type(self).__name__, query, key, value, *jax.tree.leaves(inputs))
        batch, heads, q_len, dim = query.shape
        predicate, elements, route = None, False, None
        if mask.terms is None:
            predicate = mask.without_layouts()
            why = _predicate_decline(predicate, None)
            if why is not None:
                raise ValueError(f"MosaicBlockSparse: {why}")
            route = mask_route(predicate, dim)
            elements = route.reads == "elements"
        kv_heads, kv_len = key.shape[1:3]
        fwd, dq, dkdv = mask.forward, mask.dq, mask.dkv
        if ((dq.block_q, dq.block_kv), (dkdv.block_q, dkdv.block_kv)) != backward_blocks(dim):
            raise ValueError("MosaicBlockSparse: the compiled backward layouts are not at its "
                             f"tiles {backward_blocks(dim)}; plan the call with its tiling.")
        block_kv = fwd.block_kv
        # Keys padded to the dk/dv launch's 128-key items (the forward's tiles, 64 keys at
        # D = 256, divide them).
        lq, lk = rows_padded(q_len, BLOCK_Q), rows_padded(kv_len, BLOCK_OWN)
        seg = (None, None)
        if (mask.terms.segment_ids if predicate is None
                else predicate.uses_segment_ids and not elements):
            seg = (_pad(inputs.q_segment_ids.astype(jnp.int32), lq, -1),
                   _pad(inputs.kv_segment_ids.astype(jnp.int32), lk, -2))
        shape = dict(batch=batch, heads=heads, kv_heads=kv_heads, q_len=lq, kv_len=lk,
                     true_kv_len=kv_len, head_dim=dim, softmax_scale=float(softmax_scale),
                     terms=mask.terms, predicate=predicate, elements=elements)
        soft_cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
        slopes = None if inputs.score is None else inputs.score.slopes
        table = None if inputs.score is None else inputs.score.table
        buckets = None if table is None else inputs.score.buckets
        if table is not None and (inputs.q_positions is not None
                                  or inputs.kv_positions is not None):
            raise ValueError("MosaicBlockSparse: a T5 table (RelativePositionBias) with "
                             "per-call positions is not supported.")
        if inputs.score is not None and set(inputs.score.kinds) - set(self.score_kinds):
            raise ValueError(f"MosaicBlockSparse evaluates the score terms {self.score_kinds}; "
                             f"got {inputs.score.kinds}.")
        alibi = slopes is not None
        function, params = _checked_function(inputs.score, dim)
        # The arrays the score function reads (its params, its closure's), at the forward's,
        # the dq launch's and the dk/dv launch's tiles (64 rows each; the dk/dv tile's rows
        # are keys), as the launches' operands.
        traced, leaves, reads, arrays, data = (), (), (), (), None
        if function is not None and (function.takes_params or reads_arrays(function, params)):
            fdata = function_data(function, ((ROWS_PER_WARPGROUP, fwd.block_kv),
                                             (ROWS_PER_WARPGROUP, dq.block_kv),
                                             (ROWS_PER_WARPGROUP, dkdv.block_q)), params)
            traced, leaves = fdata.traced, fdata.leaves
            reads = read_slots(traced[-1][1], leaves)
            arrays = tuple(map(stored, fdata.arrays, fdata.leaves))
        # A mask predicate that reads arrays at scalar indices of the head: traced at the
        # same tiles, its scalars after the function's in the read tables.
        masked = {} if route is None or route.data is None else mask_terms(route.data)
        if traced or masked:
            # Each read's scalar per batch row and head, read by the launches once per work
            # item (differentiable in the function's arrays outside the launches).
            data = read_tables(
                LogitTerms(function=function, traced=traced, data=leaves, reads=reads,
                           **masked), arrays, batch, heads,
                () if not masked else tuple(map(stored, route.data.arrays,
                                                route.data.leaves)))
        reads_positions = (not elements if predicate is not None
                           else mask.terms.uses_positions)
        positions = _positions(inputs, batch, q_len, kv_len,
                               reads_positions or inputs.score is not None)
        # A predicate that reads an array: its element map, and the map transposed for the
        # dk/dv launch, built per call (per-call data and new arrays never recompile).
        maps = None
        if elements:
            emap = mask.element_map(inputs, lq, lk, ELEMENT_MAP_DTYPE)
            maps = (emap, jnp.swapaxes(emap, 2, 3))
        fcfg = ForwardConfig(**shape, block_kv=block_kv, stages=stages_for(dim, block_kv),
                             layout_batch=fwd.full_count.shape[0],
                             layout_heads=fwd.full_count.shape[1], ctas=_multiprocessors(),
                             soft_cap=soft_cap, alibi=alibi, function=function,
                             positions=positions is not None, traced=traced, data=leaves,
                             reads=reads, bias=inputs.bias is not None, relative=buckets,
                             **masked)
        # The persistent forward's work items per CTA, built on the host.
        schedule = persistent_schedule(fwd.full_count, fwd.partial_count, batch, heads,
                                       fcfg.ctas)
        lists = tuple(jnp.asarray(a, jnp.int32) for a in (
            fwd.full_count, fwd.full_index, fwd.partial_count, fwd.partial_index, *schedule))
        # ALiBi's slope rows from per-call positions in the single pass's dk/dv kernel fail
        # Mosaic GPU's layout inference (H200, jax 0.11.2): that call takes the two kernels.
        # A bias's gradient and the T5 table's come from the dq launch: a call with either
        # takes the two.
        # At D = 256 dk and dv are two launches (`dkv_launches_for`), which leave no room
        # for the single pass's dq partials: that call takes the two kernels.
        single_pass = (self.single_pass() and not (alibi and positions is not None)
                       and inputs.bias is None and table is None
                       and dkv_launches_for(dim) == ("both",))
        bcfg = BackwardConfig(
            **shape, dq_block_kv=dq.block_kv, dkv_block_q=dkdv.block_q,
            dq_layout_axes=dq.full_count.shape[:2], dkv_layout_axes=dkdv.full_count.shape[:2],
            soft_cap=soft_cap, single_pass=single_pass, ctas=_multiprocessors(),
            alibi=alibi, function=function, positions=positions is not None, traced=traced,
            data=leaves, reads=reads, bias=inputs.bias is not None, relative=buckets,
            **masked)
        # Each launch is persistent where its items are short; a dk/dv item walks the lists
        # of `dkv_group` query heads.
        walked = bcfg.dkv_group(bcfg.single_pass)
        bcfg = dataclasses.replace(bcfg, persistent=tuple(launch for launch, short in (
            ("dq", short_lists(dq.full_count, dq.partial_count)),
            ("dkv", short_lists(dkdv.t_full_count, dkdv.t_partial_count, walked))) if short))
        # The backward launches' work items per CTA, built on the host too (the single pass
        # runs no dq launch).
        schedules = (None if bcfg.single_pass else dq_schedule(bcfg, dq.full_count,
                                                               dq.partial_count),
                     dkv_schedule(bcfg, dkdv.t_full_count, dkdv.t_partial_count,
                                  bcfg.single_pass))
        bwd_lists = tuple(None if arrays is None else tuple(jnp.asarray(a, jnp.int32)
                                                           for a in arrays) for arrays in (
            (dq.full_count, dq.full_index, dq.partial_count, dq.partial_index),
            (dkdv.t_full_count, dkdv.t_full_index, dkdv.t_partial_count,
             dkdv.t_partial_index), *schedules))
        # With a bias, the dq layout's visited blocks at the launch's padded block counts:
        # its gradient, where asked for, is the dq launch's dS there and zero elsewhere.
        dq_visited = None
        if inputs.bias is not None:
            dq_visited = pad_axis(pad_axis(dq.classes != EMPTY, 2, lq // dq.block_q), 3,
                                  lk // dq.block_kv)
        # With a T5 table, the (offset class, 64-row block) slots of the dq launch's near
        # blocks: its gradient is their dS there (`relative_table_gradient`).
        table_visited = None
        if table is not None:
            table_visited = relative_visited(relative_tiles(bcfg, ROWS_PER_WARPGROUP,
                                                            dq.block_kv, transposed=False),
                                             bwd_lists[0])
        bwd_lists = (*bwd_lists, dq_visited, table_visited)
        # Without ALiBi a one-element placeholder stands for the slopes (a zero gradient).
        slopes = jnp.zeros((1,), jnp.float32) if slopes is None else slopes
        return _attend(fcfg, bcfg, query, key, value, slopes, data, _padded_bias(inputs, lq, lk),
                       table, seg, positions, maps, lists, bwd_lists)


def kernel_head_dim(head_dim: int, value_dim: int) -> int | None:
    """The head dim the launches run a call of query / key head dim `head_dim` and value head
    dim `value_dim` at: the least of `_HEAD_DIMS` that holds both (q, k and v zero-padded to
    it), or ``None`` where none does.

    ```python
    kernel_head_dim(128, 128), kernel_head_dim(96, 96), kernel_head_dim(64, 128)  # 128 each
    ```
    """
    return next((d for d in _HEAD_DIMS if d >= max(head_dim, value_dim)), None)


def _features_width(features: Features) -> int:
    """`kernel_head_dim` of the call (its largest head dim where none holds it, which
    `MosaicConfig.for_head_dim` refuses in one line)."""
    dims = (features.head_dim, features.value_dim)
    return kernel_head_dim(*dims) or max(dims)


def _table_decline(features: Features) -> str | None:
    """Why the launches cannot add the call's T5 table, or ``None``: its near blocks are
    classed by their offsets on token indices (`common.RelativeTiles`), so per-call positions
    are not taken, nor a sharding's loop (which passes positions)."""
    if MosaicBlockSparse.awaits_device_run("t5_table"):
        return "a T5 table (RelativePositionBias) has not yet run on a GPU."
    if features.positions:
        return "a T5 table (RelativePositionBias) with per-call positions is not supported."
    if features.in_loop:
        return ("a T5 table (RelativePositionBias) inside a sharding's loop (RingAttention) "
                "is not supported.")
    return None


def _check_runnable() -> None:
    """Refuse in one line a call on a machine where the kernels cannot run (no GPU, not a
    Hopper GPU, no Mosaic GPU): a plan made for ``platform="gpu"`` elsewhere, run here."""
    missing = _mosaic_missing()
    if missing is not None:
        raise ValueError(
            f"MosaicBlockSparse cannot run on this machine: {missing.rstrip('.')}; a plan for "
            "platform='gpu' runs on a Hopper GPU (here plan for platform=None, this machine's, "
            "or pass kernel=kernels.XlaBlockSparse()).")


def _positions(inputs, batch: int, q_len: int, kv_len: int, read: bool):
    """The call's ``(q_positions [B, Lq], kv_positions [B, Lk])`` int32 where it passes
    either (the other then the token indices) and the kernels `read` positions (the mask's
    terms or a score term), else ``None``."""
    given = (inputs.q_positions, inputs.kv_positions)
    if not read or given == (None, None):
        return None
    return tuple(jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
                 if x is None else x.astype(jnp.int32)
                 for x, length in zip(given, (q_len, kv_len)))


def _checked_function(score, head_dim: int):
    """``(function, params)``: the call's score function as the kernels call it
    (`score_function`) and its params, or ``(None, None)``; one the kernels cannot take
    (`_function_decline`) is refused in one line."""
    function, params = score_function(score)
    if function is None:
        return None, None
    why = _function_decline(function, params, head_dim)
    if why is not None:
        raise ValueError(f"MosaicBlockSparse: {why}")
    return function, params


def _planned_params(features: Features):
    """The score function's params as the plan knows them (`Features.score_params`):
    ``None`` where it takes none, a pytree of abstract leaves (`ScoreParams.tree`), or
    `_UNKNOWN` where the plan says only that there are some (a bool)."""
    known = features.score_params
    if known is None or known is False:
        return None
    tree = getattr(known, "tree", None)  # `ScoreParams`: stand-ins of the call's shapes
    return _UNKNOWN if tree is None else tree


def _function_decline(function, params, head_dim: int, in_loop: bool = False) -> str | None:
    """Why the kernels cannot take this score function with `params` (a pytree of arrays or
    abstract leaves, ``None``, or `_UNKNOWN`) at `head_dim`, or ``None``: one that reads no
    array must lower (`function_lowering_failure`); one that reads arrays must read them as
    the kernels can (`data.data_decline`), outside a sharding's loop, and must lower with
    them (`data_lowering_failure`)."""
    if params is _UNKNOWN:
        return None  # checked where the call runs, its params known
    if not (function.takes_params or reads_arrays(function, params)):
        return function_lowering_failure(function)
    if in_loop:
        return ("inside a sharding's loop (RingAttention) a score function that reads arrays "
                "(its params, or arrays it closes over) is not supported.")
    why = data_decline(function, params, head_dim)
    if why is not None:
        return why
    return data_lowering_failure(function, *params_avals(params), head_dim)


#: The tile a mask's element predicate is traced on, to see whether it runs in the kernels.
_TILE = (ROWS_PER_WARPGROUP, 128)
#: The largest element map (and its transposed copy) a call may build, in bytes.
ELEMENT_MAP_LIMIT = 4 * 2**30


def _predicate_decline(predicate: CompiledMask, features: Features | None) -> str | None:
    """Why the kernels cannot evaluate this mask's element predicate on their partial blocks
    (`features`: the call's, where the selector asks), or ``None``."""
    if features is not None and features.in_loop:
        return ("a mask without in-kernel terms inside a sharding's loop (RingAttention) is "
                "not supported.")
    return None


class MaskRoute(NamedTuple):
    """How partial blocks evaluate the element predicate of a mask without terms
    (`mask_route`)."""

    #: "tiles": the predicate traced on the blocks' tiles as it is; "data": traced likewise,
    #: the arrays it reads at scalar indices of the head taken from the read tables
    #: (`data.predicate_data`); "elements": tiles of the call's element map.
    reads: str
    #: The predicate's arrays and trace (`MaskData`) where ``reads == "data"``.
    data: Any = None


def mask_route(predicate: CompiledMask, head_dim: int) -> MaskRoute:
    """The one decision of how the kernels evaluate this mask's element predicate (a
    `CompiledMask` without layouts) at `head_dim`: on their tiles where it reads no array
    and Pallas Mosaic GPU lowers it (`mask_lowering_failure`); on their tiles with read
    tables where it reads arrays at scalar indices of the head and lowers so
    (`data.predicate_data`); else from the call's element map."""
    if predicate.traces_on_tiles(_TILE):
        return MaskRoute("tiles" if mask_lowering_failure(predicate) is None else "elements")
    data = predicate_data(predicate, head_dim)
    if data is None:
        return MaskRoute("elements")
    return MaskRoute("data", data)


def _element_map_bytes(predicate: CompiledMask, features: Features) -> int:
    """The bytes of the call's element map and its transpose (`CompiledMask.element_map`)
    at the kernels' padded lengths."""
    per_call = features.positions or (features.segment_ids and predicate.uses_segment_ids)
    lengths = (rows_padded(predicate.q_len, BLOCK_Q), rows_padded(predicate.kv_len, 128))
    return predicate.element_map_bytes(features.batch, per_call, lengths=lengths,
                                       itemsize=jnp.dtype(ELEMENT_MAP_DTYPE).itemsize)


def _element_map_decline(predicate: CompiledMask, size: int) -> str:
    """Why the call's element map of `size` bytes (past `ELEMENT_MAP_LIMIT`) is refused,
    in one line: Mosaic GPU cannot lower the predicate, or it reads an array otherwise than
    the kernels can read in-kernel (`mask_route`)."""
    limit = ELEMENT_MAP_LIMIT // 2**30
    if predicate.traces_on_tiles(_TILE):
        why = mask_lowering_failure(predicate)
    else:
        why = "the mask's element predicate reads an array"
    return (f"{why.rstrip('.')}; its element map would take {size / 2**30:.1f} GiB per call "
            f"(at most {limit} GiB).")


def _pad(x, length: int, fill=0):
    """Pad axis 2 (or the last axis of a ``[B, L]`` array) to `length`."""
    return pad_axis(x, 2 if x.ndim == 4 else x.ndim - 1, length, fill)


def _padded_bias(inputs, q_len: int, kv_len: int):
    """The call's bias ``[bb, hb, Lq, Lk]`` padded with zeros to the launches' lengths, in a
    dtype they read (`_BIAS_DTYPES`, else float32), or ``None``."""
    bias = inputs.bias
    if bias is None:
        return None
    if bias.dtype not in _BIAS_DTYPES:
        bias = bias.astype(jnp.float32)
    return _pad(pad_axis(bias, 3, kv_len), q_len)


def _forward(fcfg: ForwardConfig, q, k, v, slopes, data, bias, table, seg, positions, maps,
             lists):
    """The forward launch's ``(out, lse)``, typed like q, k and v inside `shard_map` (a
    launch's outputs vary over no mesh axis). `maps` is ``(element map, transposed)`` at
    the padded lengths, or ``None``; `bias` the padded bias (`_padded_bias`) or ``None``."""
    q_len = q.shape[2]
    *layout_lists, items, counts = lists
    if positions is not None:
        positions = (_pad(positions[0], fcfg.q_len), _pad(positions[1], fcfg.kv_len))
    out, lse = forward_call(fcfg, _pad(q, fcfg.q_len), _pad(k, fcfg.kv_len),
                            _pad(v, fcfg.kv_len), *layout_lists, *seg,
                            slopes=slopes if fcfg.alibi else None, positions=positions,
                            element_map=None if maps is None else maps[0], bias=bias,
                            data=data, table=table, schedule=(items, counts))
    return typed_like((out[:, :, :q_len], lse[:, :, :q_len]), q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(fcfg, bcfg, q, k, v, slopes, data, bias, table, seg, positions, maps, lists,
            bwd_lists):
    """``(out [B, H, Lq, D], lse [B, H, Lq])``, the log-sum-exp as the contract has it
    (`public_lse`); differentiable in both, in ALiBi's `slopes` ``[H]``, in the arrays
    the score function reads (`data`, their read tables: `data.read_tables`) and in the
    padded `bias` and in the T5 `table` ``[H, num_buckets]`` (each gradient formed only
    where its input is differentiated: `_attend_fwd` sees which inputs are, through
    `jax.custom_vjp`'s symbolic zeros)."""
    out, lse = _forward(fcfg, q, k, v, slopes, data, bias, table, seg, positions, maps, lists)
    return out, public_lse(lse, base2=True)


def _attend_fwd(fcfg, bcfg, *primals):
    bias_gradient, table_gradient = (x is not None and x.perturbed for x in primals[5:7])
    q, k, v, slopes, data, bias, table, seg, positions, maps, lists, bwd_lists = jax.tree.map(
        lambda x: x.value, primals, is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
    refuse_second_order("MosaicBlockSparse", q, k, v, slopes, data, bias, table)
    out, lse = _forward(fcfg, q, k, v, slopes, data, bias, table, seg, positions, maps, lists)
    return (out, public_lse(lse, base2=True)), (
        q, k, v, slopes, data, bias, table, (bias_gradient, table_gradient), seg, positions,
        maps, lists, bwd_lists, out, lse)


def _attend_bwd(fcfg, bcfg, res, cotangents):
    refuse_second_order("MosaicBlockSparse", res, cotangents)
    (q, k, v, slopes, data, bias, table, (bias_gradient, table_gradient), seg, positions, maps,
     lists, bwd_lists, out, lse) = res
    do, dlse = cotangents
    if isinstance(do, SymbolicZero):
        do = jnp.zeros(out.shape, out.dtype)
    delta = backward_delta(do, out, None if isinstance(dlse, SymbolicZero) else dlse, lse)
    dq_lists, t_lists, dq_items, dkv_items, dq_visited, table_visited = bwd_lists
    bcfg = dataclasses.replace(bcfg, bias_gradient=bias_gradient,
                               relative_gradient=table_gradient)
    dq, dk, dv, dslopes, data_rows, dbias, dtable = mosaic_backward(
        bcfg, q, k, v, do.astype(q.dtype), lse, delta, seg, dq_lists, t_lists,
        slopes=slopes if bcfg.alibi else None, positions=positions, maps=maps, bias=bias,
        dq_visited=dq_visited, table=table, table_visited=table_visited, data=data,
        schedules=(dq_items, dkv_items))
    dslopes = jnp.zeros_like(slopes) if dslopes is None else dslopes.astype(slopes.dtype)
    ddata = None
    if data is not None:
        dfloats, dints = table_gradients(bcfg, data, data_rows)
        ddata = (typed_like(dfloats, data[0]), dints)
    if dbias is not None:
        # Each row and head the bias broadcast over: summed, in float32.
        axes = tuple(axis for axis in (0, 1) if bias.shape[axis] == 1)
        dbias = typed_like(dbias.sum(axis=axes, keepdims=True).astype(bias.dtype), bias)
    if dtable is not None:
        dtable = typed_like(dtable.astype(table.dtype), table)
    zeros = jax.tree.map(zero_cotangent, (seg, positions, maps, lists, bwd_lists))
    # Inside `shard_map` each cotangent takes its input's mesh axes (the launches' are none).
    return tuple(typed_like(g, x) for g, x in zip((dq, dk, dv, dslopes),
                                                  (q, k, v, slopes))) + (
        ddata, dbias, dtable) + zeros


def mosaic_backward(cfg: BackwardConfig, q, k, v, do, lse, delta, seg, dq_lists, t_lists, *,
                    slopes=None, positions=None, maps=None, bias=None, dq_visited=None,
                    table=None, table_visited=None, data=None, schedules=(None, None),
                    interpret=None):
    """``(dq, dk, dv, dslopes)`` of the Mosaic backward for unpadded inputs: pads to the
    tiles (dO with zeros, the base-2 log-sum-exp with +inf, so padded rows contribute
    nothing), runs the single pass (`dkv_call` with a zeroed float32 dq accumulator, scaled
    and cast after) or `dq_call` and `dkv_call` apart (`cfg.single_pass`); dk and dv come
    out per kv head (the deterministic dk/dv launch sums each group of query heads; the
    single pass's per query head are summed here, in float32). With ALiBi
    (``cfg.alibi``) `dslopes` ``[H]`` float32 is the slopes' gradient (the launch's per-row
    shares summed), else ``None``. `positions` are the unpadded ``(q_positions [B, Lq],
    kv_positions [B, Lk])`` int32 (``cfg.positions``; padded here); `maps` the element map
    and its transpose at the padded lengths (``cfg.elements``). `schedules` holds the dq and
    dk/dv launches' ``(items, counts)`` (``None``: built from the lists' counts, `dq_schedule`
    and `dkv_schedule`). `data` are the score function's read tables (``cfg.traced``);
    `data_rows`, last, is `dkv_call`'s rows of their reads' cotangents where one is traced
    (``cfg.data_gradients``), else ``None``. `bias` is the bias at the padded lengths
    (``cfg.bias``; the dk/dv launch reads it transposed); `dbias`, last, its gradient
    ``[B, H, Lq, Lk]`` float32 at the padded lengths where ``cfg.bias_gradient``, zero
    outside `dq_visited` (the dq layout's visited blocks, ``BlockLayout.classes !=
    EMPTY`` at the launch's block counts), else ``None``. `table` is the T5 table ``[H,
    num_buckets]`` (``cfg.relative``); `dtable`, after `dbias`, its gradient (float32)
    where ``cfg.relative_gradient`` (`table_visited`: `relative_visited` of the dq lists),
    else ``None``."""
    q_len, kv_len = q.shape[2], k.shape[2]
    pad_q = functools.partial(_pad, length=cfg.q_len)
    pad_k = functools.partial(_pad, length=cfg.kv_len)
    operands = (pad_q(q), pad_k(k), pad_k(v), pad_q(do), _pad(lse, cfg.q_len, jnp.inf),
                pad_q(delta))
    segments = () if seg[0] is None else seg
    if positions is not None:
        positions = (pad_q(positions[0]), pad_k(positions[1]))
    maps_n, maps_t = (None, None) if maps is None else maps
    bias_t = None if bias is None else jnp.swapaxes(bias, 2, 3)
    dbias = dtable = None
    if cfg.single_pass and (cfg.bias_gradient or cfg.relative_gradient):
        raise ValueError("mosaic_backward: the gradients of a bias and of a T5 table come "
                         "from the dq launch; the single pass has none.")
    if cfg.single_pass and cfg.dkv_launches != ("both",):
        raise ValueError(f"mosaic_backward: the single pass runs at head dims up to 128; got "
                         f"{cfg.head_dim}.")
    if cfg.single_pass:
        interpreted = interpret is not None
        accumulator = jax.new_ref(jnp.zeros(dq_accumulator_shape(cfg, interpreted), jnp.float32))
        dk, dv, *extra = dkv_call(cfg, *operands, *t_lists, *segments,
                                  dq_accumulator=accumulator, slopes=slopes,
                                  positions=positions, element_map=maps_t, bias=bias_t,
                                  data=data, table=table,
                                  schedule=schedules[1], interpret=interpret)
        dq = jax.freeze(accumulator)
        dq = (dq.sum(0) if interpreted else dq) * cfg.softmax_scale
        dq = dq.astype(q.dtype)
    else:
        dq = dq_call(cfg, *operands, *dq_lists, *segments, slopes=slopes,
                     positions=positions, element_map=maps_n, bias=bias, data=data,
                     table=table, schedule=schedules[0], interpret=interpret)
        if cfg.bias_gradient or cfg.relative_gradient:
            dq, *grads = dq
            if cfg.bias_gradient:
                dbias = _zeroed_outside(grads.pop(0), dq_visited)
            if cfg.relative_gradient:
                tiles = relative_tiles(cfg, ROWS_PER_WARPGROUP, cfg.dq_block_kv,
                                       transposed=False)
                dtable = relative_table_gradient(tiles, *grads, table_visited,
                                                 table.shape[1])
        dkv = functools.partial(dkv_call, cfg, *operands, *t_lists, *segments, slopes=slopes,
                                positions=positions, element_map=maps_t, bias=bias_t,
                                data=data, table=table, schedule=schedules[1],
                                interpret=interpret)
        if cfg.dkv_launches == ("both",):
            dk, dv, *extra = dkv()
        else:  # D = 256: dk (and the rows read from dS), then dv, apart
            dk, *extra = dkv(computes="dk")
            dv = dkv(computes="dv")
    # Each row's share of the slope's gradient, summed per head (padded rows' are zero).
    dslopes = extra.pop(0).sum(axis=(0, 2)) if cfg.alibi else None
    data_rows = extra.pop(0) if extra else None
    if dk.shape[1] != cfg.kv_heads:
        dk, dv = (summed_per_kv_head(x, cfg.kv_heads) for x in (dk, dv))
    return (dq[:, :, :q_len], dk[:, :, :kv_len], dv[:, :, :kv_len], dslopes, data_rows, dbias,
            dtable)


def relative_visited(tiles, lists):
    """``[MB, MH, C, Lq / rows]`` bool: whether the dq launch writes the near block of
    offset class ``c`` (`common.RelativeTiles`) for each warpgroup's block of `tiles.rows`
    rows, from the dq layout's `lists` ``(full count, full index, partial count, partial
    index)`` and their `far_splits` (a q-tile's near blocks have distinct offsets, so each
    class holds one block's dS at most)."""
    first, count = tiles.offsets
    splits = relative_splits(tiles, lists)
    warpgroups = tiles.list_rows // tiles.rows
    seen = []
    for index, (lo, hi) in ((lists[1], (0, 1)), (lists[3], (2, 3))):
        index = jnp.asarray(index, jnp.int32)
        at = jnp.arange(index.shape[-1], dtype=jnp.int32)
        near = (at >= splits[..., lo, None]) & (at < splits[..., hi, None])
        row_first = jnp.arange(index.shape[2], dtype=jnp.int32)[:, None] * tiles.list_rows
        per_warpgroup = []
        for w in range(warpgroups):
            offset = row_first + w * tiles.rows - index * tiles.cols
            c = (offset - first) // tiles.step
            hit = near[..., None] & (c[..., None] == jnp.arange(count, dtype=jnp.int32))
            per_warpgroup.append(hit.any(axis=3))  # [MB, MH, n, C]
        seen.append(jnp.stack(per_warpgroup, axis=3))  # [MB, MH, n, W, C]
    visited = seen[0] | seen[1]
    mb, mh, n = visited.shape[:3]
    return jnp.moveaxis(visited.reshape(mb, mh, n * warpgroups, count), 3, 2)


def relative_table_gradient(tiles, dnear, dfar, visited, num_buckets: int):
    """The T5 table's gradient ``[H, num_buckets]`` float32 from the dq launch's `dnear`
    ``[B, H, C, Lq, cols]`` (each near block's dS at its offset class, kept where
    `visited`: `relative_visited`) and `dfar` ``[2, B, H, Lq]`` (each row's sums over the
    two far parts): the near blocks summed per class over the batch and the rows, then per
    bucket of the class's pairs (`RelativeTiles.bank_buckets`), plus the far sums at the
    far buckets; every sum in float32, in a fixed order."""
    batch, heads, count, q_len, cols = dnear.shape
    blocks = dnear.reshape(batch, heads, count, q_len // tiles.rows, tiles.rows, cols)
    keep = visited[:, :, :, :, None, None]
    per_class = jnp.where(keep, blocks, 0.0).sum(axis=(0, 3))  # [H, C, rows, cols]
    ids = tiles.bank_buckets
    grad = jnp.stack([jnp.where(ids == n, per_class, 0.0).sum(axis=(1, 2, 3))
                      for n in range(num_buckets)], axis=1)
    low, high = tiles.far_buckets
    far = dfar.sum(axis=(1, 3))  # [2, H]
    return grad.at[:, low].add(far[0]).at[:, high].add(far[1])


def _zeroed_outside(x, visited):
    """`x` ``[B, H, R, C]`` with zeros outside the `visited` blocks (``[1 or B, 1 or H, R /
    r, C / c]``; the blocks' shape ``[r, c]`` follows from the two)."""
    batch, heads, rows, cols = x.shape
    nq, nk = visited.shape[2:]
    blocks = x.reshape(batch, heads, nq, rows // nq, nk, cols // nk)
    keep = visited[:, :, :, None, :, None]
    return jnp.where(keep, blocks, 0.0).reshape(x.shape)


def summed_per_kv_head(x, kv_heads: int):
    """A gradient per query head, ``[B, H, L, D]``, summed over each kv head's group of query
    heads in float32 (a fixed order): ``[B, kv_heads, L, D]`` in `x`'s dtype."""
    batch, heads, *rest = x.shape
    shape = (batch, kv_heads, heads // kv_heads, *rest)
    return x.reshape(shape).astype(jnp.float32).sum(2).astype(x.dtype)


_attend.defvjp(_attend_fwd, _attend_bwd, symbolic_zeros=True)
