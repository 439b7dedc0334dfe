"""`PallasTpuBlockSparse`: the kernel strategy; its forward is `forward.forward_call`, its
backward `backward.dq_call` and `backward.dkv_call`, joined by a `jax.custom_vjp`."""

import dataclasses
import functools
import math as pymath
import types
from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from eqx_bsattn.contract import (AbstractKernelConfig, AbstractLseKernel, CompiledMask,
                                  Features, MaskReads, ResolvedMask, add_sinks,
                                  backward_delta, function_data, pad_axis, public_lse,
                                  refuse_forward_mode, refuse_second_order, typed_like,
                                  zero_cotangent)

from .backward import dkv_call, dq_call, table_rows
from .common import TileMath, Visits, cotangent_like, run_untyped, token_inputs, visits
from .config import LANES, SUBLANES, PallasTpuConfig
from .forward import forward_call
from .function import (DATA_LIMIT, decline as function_decline, mask_data, reads_traced,
                       rows as data_rows, stored)

_DTYPES = ("bfloat16", "float32")
#: The tile a mask's element predicate is traced on, to see whether it runs in the kernels.
_TILE = (SUBLANES, LANES)


@functools.cache
def _pallas_tpu_missing() -> str | None:
    """Why Pallas' TPU backend cannot be imported here, or ``None``."""
    try:
        from jax.experimental import pallas as pl  # noqa: F401
        from jax.experimental.pallas import tpu as pltpu
    except Exception as e:  # ImportError, or a broken install
        return f"Pallas TPU cannot be imported ({type(e).__name__}: {e})."
    for name in ("PrefetchScalarGridSpec", "SMEM", "VMEM", "CompilerParams"):
        if not hasattr(pltpu, name):
            return f"this JAX's Pallas TPU has no `{name}`."
    return None


def _tpu_head_dim(dim: int) -> int:
    """The head dim a TPU launch runs: 64 or whole lanes (zero-padded up)."""
    return dim if dim == 64 or dim % LANES == 0 else -(-dim // LANES) * LANES


@dataclasses.dataclass(frozen=True)
class _Static:
    """What the custom VJP keeps static: the tiles' math, each pass's blocks and lists'
    shapes, and whether to interpret."""

    math: TileMath
    fwd: tuple[int, int]
    bwd: tuple[int, int]
    lists: tuple[Visits, Visits, Visits]  # forward, dq, dk/dv (shapes only)
    interpret: bool


class PallasTpuBlockSparse(AbstractLseKernel):
    """Block-sparse flash attention on TPU, written in Pallas (Mosaic TPU), forward and
    backward; it evaluates score terms inside its kernels.

    Each pass runs on a grid over (batch, head, block, slot): the block's visit list (FULL
    then PARTIAL blocks of the compiled layout) is prefetched into scalar memory and read by
    the K / V (or Q / dO) index maps, so blocks the mask leaves empty are never fetched.
    Partial blocks evaluate the canonical mask terms (causal with an offset, a window,
    chunks, a prefix, segment ids) on the call's positions; a mask without them has its
    element predicate (`CompiledMask.visible_at`) traced into the kernels on the tiles'
    token indices, positions and segment ids (the arrays it reads at scalar indices,
    a user predicate's per-head widths, in scalar memory: `function.mask_data`), or, where that
    predicate gathers from an array (a mask built from a boolean array), reads tiles of the
    call's element map (`CompiledMask.element_map`). The score terms run in every visited block: ALiBi slopes
    and the relative-position table from scalar memory (the table through T5's bucket
    thresholds, one scalar on whole pieces in a far bucket, by diagonals on the others), a
    `ScoreFunction` traced into the kernel body; then the soft cap. Arrays a score function
    closes over (``slopes[head]``) and the leaves of its `params` are kernel inputs in scalar
    memory, read at the scalar indices the function reads them at (`function`). The forward keeps an online softmax in
    float32 scratch and returns the log-sum-exp; sinks join after it (`add_sinks`).

    The backward is a dq kernel over the dq layout and a dk/dv kernel over the transposed
    lists, which walks every query head of a kv head's group (K / V are never repeated);
    each gradient block is written by one grid row, in a fixed order, so results are
    deterministic. The score function's derivative is `jax.jvp` of it on the tile; the
    slopes', the table's, the closed-over arrays' and the params' gradients are summed per
    (batch, head, q-block) by the dq kernel and added up after it.

    Features: GQA/MQA, ``Dv != D``, ``Lq != Lk``, ragged lengths, soft cap, sinks, segment
    ids, per-call positions, fully masked rows (zeros), every score term, every mask; under
    `ShardMap`, `AllToAll` and `RingAttention`. An additive bias ``[1 or B, 1 or H, Lq, Lk]``
    is read in ``[bq, bk]`` tiles beside the K / V blocks (only those the lists visit), its
    gradient written tile by tile by the dq kernel (summed after it over the batch and heads
    it broadcasts over). Declines: a bias inside a sharding's loop, float16, an
    element map over 4 GiB, a score function that reads an array (closed over, or a leaf of
    its `params`, checked from their shapes when the call is planned) other than at scalar
    indices (or a non-32-bit one, or more than `function.DATA_LIMIT` elements), and inside a
    sharding's loop a traced array it closes over. Its config is `PallasTpuConfig`.

    Runs on a TPU, and anywhere in Pallas' interpret mode (`interpret`): its tests run it so
    on the CPU (inside `jax.shard_map` too). The selector picks it on a TPU below
    `SplashBlockSparse`, so it takes the calls Splash declines (score terms, positions).

    **Arguments:**

    - `interpret`: run the kernels in Pallas' interpreter; ``None`` (default) interprets
      everywhere but on a TPU.

    ```python
    attn = BlockSparseAttention(mask=mask, score=scores.ALiBi(),
                                kernel=kernels.PallasTpuBlockSparse())
    out = attn(q, k, v)          # q [B, H, L, D] on a TPU; interpreted elsewhere
    ```
    """

    interpret: bool | None = eqx.field(default=None, static=True)

    name: ClassVar[str] = "pallas_tpu"
    platforms: ClassVar[tuple[str, ...]] = ("tpu", "cpu")
    reads: ClassVar[MaskReads] = "elements"
    score_kinds: ClassVar[tuple[str, ...]] = ("alibi", "relative_bias", "function")
    config_type: ClassVar[type[AbstractKernelConfig]] = PallasTpuConfig
    #: Checked in Pallas' interpreter on the CPU; declined in one line (the selector keeps
    #: XlaBlockSparse) until `benchmarks/device_proofs.sh` has run it on a TPU.
    awaiting_device_run: ClassVar[Mapping[str, str]] = types.MappingProxyType({
        "bias": "an additive bias, read in tiles beside the K / V blocks, its gradient "
                "written by the dq kernel",
    })

    @classmethod
    def priority(cls, platform):
        # Below SplashBlockSparse (20), above XlaBlockSparse (10) on a TPU: it takes what
        # Splash declines. On the CPU only when asked for (it interprets).
        return 15 if platform == "tpu" else None

    def decline_reason(self, mask: ResolvedMask, features: Features) -> str | None:
        missing = _pallas_tpu_missing()
        if missing is not None:
            return missing
        if features.bias and self.awaits_device_run("bias"):
            return "a bias has not yet run on a TPU."
        if features.bias and features.in_loop:
            # A bias runs in the kernels, but not yet inside a sharding's loop
            # (RingAttention passes each step its shards' block of it).
            return "a bias inside a sharding's loop (RingAttention) is not supported."
        if features.dtype not in _DTYPES:
            return f"it runs bfloat16 or float32 inputs; got {features.dtype}."
        if features.score_function is not None:
            # Its params are read as the arrays it closes over are (kernel inputs in scalar
            # memory): checked on stand-ins of their shapes.
            why = function_decline(features.score_function, features.score_params)
            if why is not None:
                return why
            if features.in_loop and reads_traced(features.score_function):
                # The loop's own backward (RingAttention's) closes over the array: the
                # gradient the kernel forms would not reach it. (RingAttention refuses
                # `params` itself.)
                return ("inside a sharding's loop (RingAttention) it does not take a traced "
                        "array the score function closes over (its gradient would not reach "
                        "it): close over a concrete array, or shard with ShardMap.")
        tiles = self.adapt_tiling(self.default_tiling(features, mask), features).blocks
        if mask.kernel_terms(list(tiles)) is None:
            predicate = mask.predicate()
            size = _element_map_bytes(predicate, features)
            if (not predicate.traces_on_tiles(_TILE) and size > _ELEMENT_MAP_LIMIT
                    and mask_data(predicate, [_TILE], predicate.uses_segment_ids) is None):
                return (f"the mask's element predicate indexes an array, so it would read an "
                        f"element map of {size / 2**30:.1f} GiB per call (at most "
                        f"{_ELEMENT_MAP_LIMIT // 2**30} GiB).")
        return None

    def default_tiling(self, features: Features, mask: ResolvedMask) -> PallasTpuConfig:
        return PallasTpuConfig.heuristic(features)

    def adapt_tiling(self, tiling: AbstractKernelConfig, features: Features) -> PallasTpuConfig:
        return PallasTpuConfig.of_blocks(tiling.blocks, features)

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        return self.attention_with_lse(
            query, key, value, mask=mask, inputs=inputs, features=features, tiling=tiling,
            softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap)[0]

    def attention_with_lse(self, query, key, value, *, mask, inputs, features, tiling,
                           softmax_scale, logits_soft_cap):
        refuse_forward_mode(type(self).__name__, query, key, value, *jax.tree.leaves(inputs))
        on_tpu = features.platform == "tpu" and jax.default_backend() == "tpu"
        interpret = not on_tpu if self.interpret is None else self.interpret
        _, _, q_len, dim = query.shape
        kv_len, value_dim = value.shape[2], value.shape[3]
        fwd, dq, dkv = (mask.forward, mask.dq, mask.dkv)
        blocks = ((fwd.block_q, fwd.block_kv), (dq.block_q, dq.block_kv),
                  (dkv.block_q, dkv.block_kv))
        if blocks[1] != blocks[2]:
            raise ValueError(f"PallasTpuBlockSparse runs the dq and dk/dv passes at one tile; "
                             f"the compiled layouts have {blocks[1]} and {blocks[2]}.")
        lq = _multiple(q_len, [bq for bq, _ in blocks])
        lk = _multiple(kv_len, [bk for _, bk in blocks])
        score = inputs.score
        function = None if score is None else score.function
        # The arrays the function reads (those it closes over, and the leaves of its params:
        # constants of its trace alike), at the tiles of the forward, dq and dk/dv passes
        # (the dk/dv tiles are [keys, queries]).
        params = score.params if function is not None and function.takes_params else None
        fdata = None if function is None else function_data(
            function, (blocks[0], blocks[1], blocks[1][::-1]), params)
        if fdata is not None and not fdata.arrays and params is None:
            fdata = None  # the function is called as it is (`TileMath._function`)
        predicate = None if mask.terms is not None else mask.without_layouts()
        elements = predicate is not None and not predicate.traces_on_tiles(_TILE)
        mdata = None
        if elements:
            # A predicate that reads arrays at scalar indices (per-head widths) runs on the
            # tiles as the score function does, its arrays in scalar memory after the
            # function's; any other reads an element map.
            used = 0 if fdata is None else sum(leaf.size for leaf in fdata.leaves)
            mdata = mask_data(predicate, (blocks[0], blocks[1], blocks[1][::-1]),
                              mask.uses_segment_ids, 0 if fdata is None else len(fdata.arrays),
                              DATA_LIMIT - used)
            elements = mdata is None
        segment_ids = (mask.terms.segment_ids if mask.terms is not None
                       else mask.uses_segment_ids and not elements)
        math = TileMath(
            terms=mask.terms, kv_len=kv_len, scale=float(softmax_scale),
            soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
            slopes=score is not None and score.slopes is not None,
            buckets=None if score is None or score.table is None else score.buckets,
            function=function, traced=() if fdata is None else fdata.traced,
            data=(() if fdata is None else fdata.leaves) + (() if mdata is None
                                                            else mdata.leaves),
            positions=inputs.q_positions is not None, segment_ids=segment_ids,
            predicate=None if elements or mdata is not None else predicate,
            elements=elements, mask_traced=() if mdata is None else mdata.traced)
        lists = (visits(fwd, transposed=False, rows=lq // blocks[0][0]),
                 visits(dq, transposed=False, rows=lq // blocks[1][0]),
                 visits(dkv, transposed=True, rows=lk // blocks[2][1]))
        static = _Static(math, blocks[0], blocks[1], tuple(x.static() for x in lists),
                         interpret)
        tokens = (token_inputs(inputs, math, lq, lk, q_rows=True),
                  token_inputs(inputs, math, lq, lk, q_rows=False))
        if elements:
            emap = mask.element_map(inputs, lq, lk)
            tokens[0]["emap"], tokens[1]["emap"] = emap, jnp.swapaxes(emap, 2, 3)
        arrays = tuple(jnp.asarray(a, jnp.int32) for x in lists
                       for a in (x.block, x.kind, x.steps))
        q, k, v = pad_axis(query, 2, lq), pad_axis(key, 2, lk), pad_axis(value, 2, lk)
        if features.platform == "tpu":
            q, k = pad_axis(q, 3, _tpu_head_dim(dim)), pad_axis(k, 3, _tpu_head_dim(dim))
            v = pad_axis(v, 3, _tpu_head_dim(value_dim))
        slopes = None if score is None else score.slopes
        table = None if score is None else score.table
        data = () if fdata is None else tuple(map(stored, fdata.arrays, fdata.leaves))
        if mdata is not None:
            data += tuple(map(stored, mdata.arrays, mdata.leaves))
        bias = inputs.bias
        if bias is not None:
            bias = pad_axis(pad_axis(bias, 2, lq), 3, lk)
            if bias.dtype not in (jnp.bfloat16, jnp.float32):
                bias = bias.astype(jnp.float32)
        out, lse = _attend(static, q, k, v, slopes, table, data, bias, tokens, arrays)
        out, lse = out[:, :, :q_len, :value_dim], lse[:, :, :q_len]
        if inputs.sinks is not None:
            out, lse = add_sinks(out, lse, inputs.sinks)
        return out.astype(query.dtype), lse


#: The largest element map (and its transposed copy) a call may build, in bytes.
_ELEMENT_MAP_LIMIT = 4 * 2**30


def _element_map_bytes(mask: CompiledMask, features: Features) -> int:
    """The bytes of the element map and its transposed copy (`CompiledMask.element_map`)."""
    per_call = features.positions or (features.segment_ids and mask.uses_segment_ids)
    return mask.element_map_bytes(features.batch, per_call)


def _multiple(length: int, blocks) -> int:
    """`length` rounded up to a multiple of every block."""
    step = functools.reduce(pymath.lcm, blocks, 1)
    return -(-length // step) * step


def _with_lists(static: _Static, arrays):
    """The three passes' `Visits` with their arrays."""
    triples = zip(arrays[0::3], arrays[1::3], arrays[2::3])
    return tuple(dataclasses.replace(v, block=b, kind=k, steps=n)
                 for v, (b, k, n) in zip(static.lists, triples))


def _forward(static: _Static, q, k, v, slopes, table, data, bias, tokens, arrays):
    def launch(q, k, v, slopes, table, data, bias, tokens, arrays):
        fwd_visits = _with_lists(static, arrays)[0]
        return forward_call(q, k, v, tokens[0], slopes, table, fwd_visits, math=static.math,
                            bq=static.fwd[0], bk=static.fwd[1], interpret=static.interpret,
                            data=data, bias=bias)

    out, lse = run_untyped(launch, static.interpret, q, k, v, slopes, table, data, bias,
                           tokens, arrays)
    # Inside `shard_map` the outputs take the inputs' mesh axes (the launch's are none).
    return typed_like((out, lse[..., 0]), q, k, v, slopes, table, data, bias, tokens, arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(static, q, k, v, slopes, table, data, bias, tokens, arrays):
    """``(out, lse)`` on padded inputs, the log-sum-exp as the contract has it; both
    differentiable, and in the score arrays, the arrays the score function reads (`data`,
    as `function.stored` lays them out) and the bias (``[bb, hb, Lq, Lk]``, padded)."""
    out, lse = _forward(static, q, k, v, slopes, table, data, bias, tokens, arrays)
    return out, public_lse(lse, base2=False)


def _attend_fwd(static, q, k, v, slopes, table, data, bias, tokens, arrays):
    refuse_second_order("PallasTpuBlockSparse", q, k, v, slopes, table, data, bias)
    out, lse = _forward(static, q, k, v, slopes, table, data, bias, tokens, arrays)
    return (out, public_lse(lse, base2=False)), (q, k, v, slopes, table, data, bias, tokens,
                                                 arrays, out, lse)


def _attend_bwd(static, res, cotangents):
    refuse_second_order("PallasTpuBlockSparse", res, cotangents)
    q, k, v, slopes, table, data, bias, tokens, arrays, out, lse = res
    do, dlse = cotangents
    delta = backward_delta(do, out, dlse, public_lse(lse, base2=False))
    do = do.astype(q.dtype)
    column = lambda x: jnp.broadcast_to(x[..., None], x.shape + (LANES,))  # noqa: E731
    row = lambda x: jnp.broadcast_to(  # noqa: E731
        x[..., None, :], x.shape[:2] + (SUBLANES, x.shape[-1]))
    (bq, bk), m = static.bwd, static.math

    def launches(q, k, v, do, lse, delta, slopes, table, data, bias, tokens, arrays):
        _, dq_visits, dkv_visits = _with_lists(static, arrays)
        dq, dslopes, dtable, ddata, dbias = dq_call(
            q, k, v, do, column(lse), column(delta), tokens[0], slopes, table, dq_visits,
            math=m, bq=bq, bk=bk, interpret=static.interpret, data=data, bias=bias)
        dk, dv = dkv_call(q, k, v, do, row(lse), row(delta), tokens[1], slopes, table,
                          dkv_visits, math=m, bq=bq, bk=bk, interpret=static.interpret,
                          data=data, bias=bias)
        return dq, dk, dv, dslopes, dtable, ddata, dbias

    dq, dk, dv, dslopes, dtable, ddata, dbias = run_untyped(
        launches, static.interpret, q, k, v, do, lse, delta, slopes, table, data, bias,
        tokens, arrays)
    batch, heads = q.shape[:2]
    if dbias is not None:
        # Summed over the batch and heads the bias broadcasts over (float32 for that sum).
        axes = tuple(a for a in (0, 1) if bias.shape[a] == 1 and dbias.shape[a] > 1)
        dbias = dbias.sum(axes, keepdims=True).astype(bias.dtype) if axes else dbias
    if dslopes is not None:
        dslopes = dslopes.reshape(batch, heads, -1, SUBLANES, LANES)[..., 0, 0].sum((0, 2))
        dslopes = dslopes.astype(slopes.dtype)
    if dtable is not None:
        nb = table.shape[-1]
        dtable = dtable.reshape(batch, heads, -1, table_rows(nb), LANES)[..., :nb, 0]
        dtable = dtable.sum((0, 2)).astype(table.dtype)
    # Each dq program's block of an array's gradient, added up in a fixed order.
    ddata = tuple(
        ddata[slot].reshape(batch, heads, -1, data_rows(leaf) * LANES)[..., :leaf.size].sum((0, 1, 2))
        if slot in ddata else None for slot, leaf in enumerate(m.data))
    zeros = jax.tree.map(zero_cotangent, (tokens, arrays))
    # Inside `shard_map` each cotangent takes its input's mesh axes (the launches' are none),
    # summed over those the work varies over and its input does not.
    work = jax.tree.leaves((q, k, v, do, dlse, slopes, table, data, bias, tokens, arrays))
    grads = tuple(None if g is None else cotangent_like(g, x, *work)
                  for g, x in zip((dq, dk, dv, dslopes, dtable), (q, k, v, slopes, table)))
    ddata = tuple(zero_cotangent(x) if g is None else cotangent_like(g, x, *work)
                  for g, x in zip(ddata, data))
    dbias = None if dbias is None else cotangent_like(dbias, bias, *work)
    return grads + (ddata, dbias) + zeros


_attend.defvjp(_attend_fwd, _attend_bwd)
