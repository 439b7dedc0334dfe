"""`MosaicBlockSparse`: the kernel strategy; its forward is `forward.forward_call`, its
backward either `backward.dq_call` and `backward.dkv_call` or `TritonBlockSparse`'s dq and
dk/dv launches (the `backward` field)."""

import dataclasses
import functools
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp

from eqx_bsattn.contract import AbstractKernel, Features, ResolvedMask, Tiling, add_sinks

from ..padding import pad_axis
from ..triton.heuristics import check_tiling
from ..triton.heuristics import default_tiling as triton_default_tiling
from ..triton.kernel import TritonBlockSparse
from ..triton.launch import LaunchConfig, dkdv_launch, dq_launch, layout_arrays, list_mode
from ..triton.vjp import _public_lse, _zero_cotangent
from .backward import BackwardConfig, backward_blocks, dkv_call, dq_call
from .common import persistent_schedule
from .forward import BLOCK_Q, ForwardConfig, block_kv_for, forward_call, rows_padded, stages_for

_DTYPES = ("bfloat16", "float16")
#: Head dims checked on the H200; D=256 (64-key tiles) gave no result there in 45 s, unverified.
_HEAD_DIMS = (64, 128)


@functools.cache
def _first_gpu():
    """The first GPU JAX sees, or ``None``."""
    return next((d for d in jax.devices() if d.platform == "gpu"), None)


@functools.cache
def _mosaic_missing() -> str | None:
    """Why Pallas Mosaic GPU cannot run here, or ``None``."""
    try:
        import jax.experimental.pallas.mosaic_gpu  # noqa: F401
    except Exception as e:  # ImportError, or a jaxlib built without it
        return f"Pallas Mosaic GPU cannot be imported ({type(e).__name__}: {e})."
    gpu = _first_gpu()
    if gpu is None:
        return "no GPU is visible to JAX."
    capability = getattr(gpu, "compute_capability", None)
    if capability is not None and str(capability) not in ("9.0",):
        return f"needs a Hopper GPU (compute capability 9.0); found {capability}."
    return None


def _multiprocessors() -> int | None:
    """Streaming multiprocessors of the first GPU (the persistent forward runs one CTA on
    each), or ``None`` where JAX does not say."""
    return getattr(_first_gpu(), "core_count", None)


def _with_forward_blocks(tiling: Tiling, features: Features, mosaic_backward: bool) -> Tiling:
    """`tiling` with the forward tile this kernel runs: 128 query rows (two warpgroups of
    64) by `block_kv_for` keys; the backward blocks are the Mosaic backward's
    (`backward_blocks`) when `mosaic_backward`, else kept (Triton's launches)."""
    bq_bwd, bk_bwd = tiling.backward_blocks
    bq_dq, bk_dq = tiling.dq_blocks
    if mosaic_backward:
        (bq_dq, bk_dq), (bq_bwd, bk_bwd) = backward_blocks(features.head_dim)
    return dataclasses.replace(
        tiling, block_q=BLOCK_Q, block_kv=block_kv_for(features.head_dim),
        block_q_bwd=bq_bwd, block_kv_bwd=bk_bwd, block_q_dq=bq_dq, block_kv_dq=bk_dq,
        num_warps_bwd=tiling.num_warps_bwd or tiling.num_warps,
        num_stages_bwd=tiling.num_stages_bwd or tiling.num_stages,
        num_stages=stages_for(features.head_dim, block_kv_for(features.head_dim)),
        num_warps=12)


class MosaicBlockSparse(AbstractKernel):
    """Block-sparse flash attention for Hopper GPUs, written in Pallas Mosaic GPU.

    The forward pass is warp-specialised: per (head, 128 query rows, batch) a memory
    warpgroup streams the K / V tiles of the q-tile's visited kv-blocks through TMA into a
    ring of shared-memory slots, while two compute warpgroups (64 rows each) run wgmma and an
    online softmax in base 2, staggered so that one's softmax overlaps the other's products.
    FULL blocks run without masking; partial blocks evaluate the compiled mask's canonical
    terms (causal with an offset, a window, chunks, a prefix, segment ids) on token indices.

    The backward pass is chosen by `backward`:

    - ``"triton"`` (the default): `TritonBlockSparse`'s dq and dk/dv kernels over the
      compiled dq and dk/dv layouts. The forward stores the same base-2 log-sum-exp (+inf on
      rows that see no key), so the two compose; training calls then need jax-triton.
    - ``"mosaic"``: a dq kernel and a dk/dv kernel in Pallas Mosaic GPU, warp-specialised like
      the forward, over the dq layout (128 q rows by 64 keys, 128 at D = 64) and the
      transposed dk/dv layout (64 q rows by 128 keys); grouped heads' dk / dv are summed
      after the kernel, so the result is deterministic. Where it cannot run (a mask whose
      block tables do not align with those tiles, a `Tiling` with other backward blocks, a
      soft cap) Triton's backward runs instead.

    Inputs ``[B, H, Lq, D]`` / ``[B, Hkv, Lk, D]`` / ``[B, Hkv, Lk, D]`` in bfloat16 or
    float16, D in {64, 128}, ``Dv == D``, any lengths (padded to the tiles inside),
    grouped-query heads, `jax.vmap`, a logits soft cap (in the forward kernel), attention
    sinks (joined to the kernel's output by its log-sum-exp, `add_sinks`, so their gradients
    flow) and `attention_with_lse` (the log-sum-exp differentiable too, as sequence sharding
    needs). Declines bias, per-call positions and masks without in-kernel terms, each with a
    reason; `TritonBlockSparse` then runs. Its
    priority on a GPU (35) is above Triton's (30) and below cuDNN's (40) (docs/mosaic.md
    has the measurements behind that order).

    ```python
    attn = BlockSparseAttention(mask=mask, kernel=kernels.MosaicBlockSparse())
    out = attn(q, k, v)          # q [B, H, L, 128] bfloat16 on an H100 / H200
    ```
    """

    backward: Literal["triton", "mosaic"] = eqx.field(default="triton", static=True)

    name: ClassVar[str] = "mosaic"
    platforms: ClassVar[tuple[str, ...]] = ("gpu",)
    reads: ClassVar[str] = "terms"
    returns_lse: ClassVar[bool] = True

    def __check_init__(self):
        if self.backward not in ("triton", "mosaic"):
            raise ValueError(f"`backward` must be 'triton' or 'mosaic'; got {self.backward!r}.")

    def _mosaic_backward_reason(self, mask: ResolvedMask, features: Features) -> str | None:
        """Why the Mosaic backward does not run for this mask (Triton's does), or ``None``."""
        if self.backward != "mosaic":
            return "backward='triton' was asked for."
        if features.soft_cap:
            return "the Mosaic backward has no soft cap."
        terms = mask.terms
        tiles = [(BLOCK_Q, block_kv_for(features.head_dim)), *backward_blocks(features.head_dim)]
        if terms is None or (terms.tables and mask.kernel_terms(tiles) is None):
            return "the mask's block tables do not align with the Mosaic backward's tiles."
        return None

    @classmethod
    def priority(cls, platform):
        # Above TritonBlockSparse (30), below cuDNN (40). On the H200 its forward beat
        # Triton's in every measured cell (long and short rows, causal, window, documents,
        # BigBird, D = 64 and 128, grouped heads), and with the same (Triton) backward
        # forward+backward was level or ahead in all but documents at D = 64 (-3 %). cuDNN
        # is faster forward+backward where it can express the mask (docs/mosaic.md).
        return 35 if platform == "gpu" else None

    def decline_reason(self, mask: ResolvedMask, features: Features) -> str | None:
        missing = _mosaic_missing()
        if missing is not None:
            return missing
        if features.dtype not in _DTYPES:
            return f"dtype {features.dtype} is not supported (bfloat16 and float16 are)."
        if features.head_dim not in _HEAD_DIMS or features.value_dim != features.head_dim:
            return (f"head dims {features.head_dim} / {features.value_dim} are not supported "
                    f"(equal q / v head dims in {_HEAD_DIMS} are).")
        if features.bias:
            return "bias is not supported by the forward kernel."
        terms = mask.terms
        forward_tile = (BLOCK_Q, block_kv_for(features.head_dim))
        if terms is None or (terms.tables and mask.kernel_terms([forward_tile]) is None):
            return ("the mask has no in-kernel terms shared by every head (causal / window / "
                    "chunk / prefix / document); this kernel reads no element bitmaps.")
        if features.positions and terms.uses_positions:
            return "per-call positions are not supported: partial blocks use token indices."
        if self._mosaic_backward_reason(mask, features) is None:
            return None
        backward = TritonBlockSparse().decline_reason(mask, features)
        if backward is not None:
            return f"its backward pass, TritonBlockSparse's, cannot run: {backward}"
        return None

    def default_tiling(self, features: Features, mask: ResolvedMask) -> Tiling:
        mosaic_backward = self._mosaic_backward_reason(mask, features) is None
        return _with_forward_blocks(triton_default_tiling(features, mask), features,
                                    mosaic_backward)

    def adapt_tiling(self, tiling: Tiling, features: Features) -> Tiling:
        # The forward tile is fixed by the warpgroups (128 rows) and the head dim; the
        # backward fields keep their values: the Mosaic backward runs where they are its
        # tiles (and `backward="mosaic"`), Triton's launches elsewhere.
        return check_tiling(_with_forward_blocks(tiling, features, False))

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        return self.attention_with_lse(
            query, key, value, mask=mask, inputs=inputs, features=features, tiling=tiling,
            softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap)[0]

    def attention_with_lse(self, query, key, value, *, mask, inputs, features, tiling,
                           softmax_scale, logits_soft_cap):
        out, lse = self._attention(query, key, value, mask, inputs, tiling, softmax_scale,
                                   logits_soft_cap)
        if inputs.sinks is not None:
            out, lse = add_sinks(out, lse, inputs.sinks)
        return out.astype(query.dtype), lse

    def _attention(self, query, key, value, mask, inputs, tiling, softmax_scale,
                   logits_soft_cap):
        """``(out, lse)`` without sinks, differentiable in both (`_attend`)."""
        if mask.terms is None:
            raise ValueError("MosaicBlockSparse needs in-kernel mask terms at these tiles; "
                             "the compiled mask has none.")
        batch, heads, q_len, dim = query.shape
        kv_heads, kv_len = key.shape[1:3]
        fwd, dq, dkdv = mask.forward, mask.dq, mask.dkv
        block_kv = fwd.block_kv
        lq, lk = rows_padded(q_len, BLOCK_Q), rows_padded(kv_len, block_kv)
        seg = (None, None)
        if mask.terms.segment_ids:
            seg = (_pad(inputs.q_segment_ids.astype(jnp.int32), lq, -1),
                   _pad(inputs.kv_segment_ids.astype(jnp.int32), lk, -2))
        shape = dict(batch=batch, heads=heads, kv_heads=kv_heads, q_len=lq, kv_len=lk,
                     true_kv_len=kv_len, head_dim=dim, softmax_scale=float(softmax_scale),
                     terms=mask.terms)
        soft_cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
        fcfg = ForwardConfig(**shape, block_kv=block_kv, stages=tiling.num_stages or 2,
                             layout_batch=fwd.full_count.shape[0],
                             layout_heads=fwd.full_count.shape[1], ctas=_multiprocessors(),
                             soft_cap=soft_cap)
        # The persistent forward's work items per CTA, built on the host.
        schedule = persistent_schedule(fwd.full_count, fwd.partial_count, batch, heads,
                                       fcfg.ctas)
        lists = tuple(jnp.asarray(a, jnp.int32) for a in (
            fwd.full_count, fwd.full_index, fwd.partial_count, fwd.partial_index, *schedule))
        if self.backward == "mosaic" and not soft_cap and (
                (dq.block_q, dq.block_kv), (dkdv.block_q, dkdv.block_kv)) == backward_blocks(dim):
            bcfg = BackwardConfig(
                **shape, dq_block_kv=dq.block_kv, dkv_block_q=dkdv.block_q,
                dq_layout_axes=dq.full_count.shape[:2], dkv_layout_axes=dkdv.full_count.shape[:2])
            bwd_lists = tuple(tuple(jnp.asarray(a, jnp.int32) for a in arrays) for arrays in (
                (dq.full_count, dq.full_index, dq.partial_count, dq.partial_index),
                (dkdv.t_full_count, dkdv.t_full_index, dkdv.t_partial_count,
                 dkdv.t_partial_index)))
            return _attend(fcfg, bcfg, query, key, value, seg, (), lists, bwd_lists)
        dummy_int = jnp.zeros((1,), jnp.int32)
        data = tuple(dummy_int if x is None else x.astype(jnp.int32) for x in (
            inputs.q_positions, inputs.kv_positions, inputs.q_segment_ids,
            inputs.kv_segment_ids))
        bwd_launch = (tiling.num_warps_bwd or 8, tiling.num_stages_bwd or 2)
        bcfg = LaunchConfig(
            batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len,
            head_dim=dim, value_dim=dim, dtype=jnp.dtype(query.dtype).name,
            bias_shape=None, num_sinks=0, softmax_scale=float(softmax_scale), soft_cap=soft_cap,
            terms=mask.terms, has_q_positions=inputs.q_positions is not None,
            has_kv_positions=inputs.kv_positions is not None,
            fwd_blocks=(fwd.block_q, fwd.block_kv), dq_blocks=(dq.block_q, dq.block_kv),
            dkdv_blocks=(dkdv.block_q, dkdv.block_kv), fwd_launch=bwd_launch,
            dq_launch=(tiling.num_warps_dq or bwd_launch[0],
                       tiling.num_stages_dq or bwd_launch[1]),
            dkdv_launch=bwd_launch,
            list_modes=("index", list_mode(dq, False), list_mode(dkdv, True)),
        )
        bwd_lists = (layout_arrays(dq, transposed=False), layout_arrays(dkdv, transposed=True))
        return _attend(fcfg, bcfg, query, key, value, seg, data, lists, bwd_lists)


def _pad(x, length: int, fill=0):
    """Pad axis 2 (or the last axis of a ``[B, L]`` array) to `length`."""
    return pad_axis(x, 2 if x.ndim == 4 else x.ndim - 1, length, fill)


def _forward(fcfg: ForwardConfig, q, k, v, seg, lists):
    q_len = q.shape[2]
    *layout_lists, items, counts = lists
    out, lse = forward_call(fcfg, _pad(q, fcfg.q_len), _pad(k, fcfg.kv_len),
                            _pad(v, fcfg.kv_len), *layout_lists, *seg, schedule=(items, counts))
    return out[:, :, :q_len], lse[:, :, :q_len]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(fcfg, bcfg, q, k, v, seg, data, lists, bwd_lists):
    """``(out [B, H, Lq, D], lse [B, H, Lq])``, the log-sum-exp natural (``-inf`` on rows
    that see no key); differentiable in both."""
    out, lse = _forward(fcfg, q, k, v, seg, lists)
    return out, _public_lse(lse)


def _attend_fwd(fcfg, bcfg, q, k, v, seg, data, lists, bwd_lists):
    out, lse = _forward(fcfg, q, k, v, seg, lists)
    return (out, _public_lse(lse)), (q, k, v, seg, data, lists, bwd_lists, out, lse)


def _attend_bwd(fcfg, bcfg, res, cotangents):
    q, k, v, seg, data, lists, bwd_lists, out, lse = res
    do, dlse = cotangents
    do = do.astype(q.dtype)
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    # The log-sum-exp's cotangent (d lse / d s = p) joins the same correction; rows that see
    # no key (lse = +inf here) have p = 0 everywhere.
    delta = delta - jnp.where(lse == jnp.inf, 0.0, dlse.astype(jnp.float32))
    dq_lists, t_lists = bwd_lists
    if isinstance(bcfg, BackwardConfig):
        dq, dk, dv = mosaic_backward(bcfg, q, k, v, do, lse, delta, seg, dq_lists, t_lists)
    else:
        no_bias = jnp.zeros((1,), jnp.float32)
        dq, _ = dq_launch(bcfg, q, k, v, no_bias, data, dq_lists, do, lse, delta)
        dk, dv = dkdv_launch(bcfg, q, k, v, no_bias, data, t_lists, do, lse, delta)
    zeros = jax.tree.map(_zero_cotangent, (seg, data, lists, bwd_lists))
    return (dq, dk, dv) + zeros


def mosaic_backward(cfg: BackwardConfig, q, k, v, do, lse, delta, seg, dq_lists, t_lists, *,
                    interpret=None):
    """``(dq, dk, dv)`` of the Mosaic backward for unpadded inputs: pads to the tiles (dO
    with zeros, the base-2 log-sum-exp with +inf, so padded rows contribute nothing), runs
    `dq_call` and `dkv_call` and sums each kv head's group of query-head dk / dv."""
    q_len, kv_len = q.shape[2], k.shape[2]
    pad_q = functools.partial(_pad, length=cfg.q_len)
    pad_k = functools.partial(_pad, length=cfg.kv_len)
    operands = (pad_q(q), pad_k(k), pad_k(v), pad_q(do), _pad(lse, cfg.q_len, jnp.inf),
                pad_q(delta))
    segments = () if seg[0] is None else seg
    dq = dq_call(cfg, *operands, *dq_lists, *segments, interpret=interpret)
    dk, dv = dkv_call(cfg, *operands, *t_lists, *segments, interpret=interpret)
    group = cfg.heads // cfg.kv_heads
    if group > 1:
        shape = (cfg.batch, cfg.kv_heads, group, cfg.kv_len, cfg.head_dim)
        dk, dv = (x.reshape(shape).astype(jnp.float32).sum(2).astype(x.dtype) for x in (dk, dv))
    return dq[:, :, :q_len], dk[:, :, :kv_len], dv[:, :, :kv_len]


_attend.defvjp(_attend_fwd, _attend_bwd)
