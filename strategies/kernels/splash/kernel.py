"""`SplashBlockSparse`: the kernel strategy, reading the compiled mask into Splash's inputs."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from eqx_bsattn.contract import (AbstractKernel, AbstractKernelConfig, Features, MaskReads,
                                  ResolvedMask, pad_axis, refuse_forward_mode)

from .config import LANES, SplashConfig
from .launch import block_sizes, never_matching, sink_logits, splash_attention, splash_missing
from .mask_info import TermsPredicate, block_info, padded_length

_DTYPES = ("bfloat16", "float32")


def _tpu_head_dim(dim: int) -> int:
    """The head dim a TPU launch runs: 64 or a multiple of 128 (those Splash's own tests
    cover); others are zero-padded up to the next multiple of 128."""
    return dim if dim == 64 or dim % LANES == 0 else -(-dim // LANES) * LANES


class SplashBlockSparse(AbstractKernel):
    """Block-sparse flash attention on TPU through JAX's Splash attention (Pallas, Mosaic).

    JAX's `jax.experimental.pallas.ops.tpu.splash_attention` computes the forward pass and a
    split backward (a dq kernel over q-blocks, a dk/dv kernel over kv-blocks) on a grid that
    visits, for each row, only the blocks its block-info arrays list. Those arrays are filled
    here from the compiled mask's three layouts (forward, dq, dk/dv at their own tiles) in
    ``O(number of blocks)``, never from a dense mask. Partial blocks evaluate the mask's
    canonical terms (causal with an offset, a window, chunks, a prefix) inside the kernel as
    Splash's ``mask_function``, with segment ids through Splash's own; a mask without terms
    uses the layouts' deduplicated element bitmaps as Splash's partial-mask blocks.

    Features: GQA/MQA, ``Dv != D``, ``Lq != Lk``, ragged lengths (padded to whole blocks),
    soft cap, sinks (several per head join as their log-sum-exp; differentiable), segment ids,
    per-head masks, fully masked rows (zeros). Declines: an additive bias, positions, float16,
    and masks without terms together with segment ids or per-call mask arrays. Its config is
    `SplashConfig`; block sizes are rounded up to multiples of 128.

    Runs on a TPU, and anywhere in Splash's interpret mode (`interpret`): the conformance suite
    runs it that way on the CPU. The selector picks it on TPU only. On a TPU v5e chip it
    matched the float32 reference and ran at the speed `docs/splash.md` gives; its tests run
    it interpreted, on a CPU.

    **Arguments:**

    - `interpret`: run Splash's kernels in Pallas' interpreter; ``None`` (default) interprets
      everywhere but on a TPU.

    ```python
    attn = BlockSparseAttention(mask=mask, kernel=kernels.SplashBlockSparse())
    out = attn(q, k, v)          # q [B, H, L, D] on a TPU; interpreted elsewhere
    ```
    """

    interpret: bool | None = eqx.field(default=None, static=True)

    name: ClassVar[str] = "splash"
    platforms: ClassVar[tuple[str, ...]] = ("tpu", "cpu")
    reads: ClassVar[MaskReads] = "terms"
    config_type: ClassVar[type[AbstractKernelConfig]] = SplashConfig

    @classmethod
    def priority(cls, platform):
        # Above XlaBlockSparse (10) on a TPU; on the CPU only when asked for (it interprets).
        return 20 if platform == "tpu" else None

    def decline_reason(self, mask: ResolvedMask, features: Features) -> str | None:
        missing = splash_missing()
        if missing is not None:
            return missing
        if features.sharded:
            return ("JAX's Splash kernels cannot run inside jax.shard_map (a sharding's call): "
                    "their launches give their outputs no mesh-axis type.")
        if features.bias:
            return "Splash attention has no additive bias."
        if features.positions:
            return "Splash evaluates masks on token indices; it cannot take per-call positions."
        if features.dtype not in _DTYPES:
            return f"Splash attention runs bfloat16 or float32 inputs; got {features.dtype}."
        per_call = features.segment_ids or not mask.is_static  # not static: a mask array
        if per_call and (mask.terms is None or mask.terms.tables):
            return ("the mask has no in-kernel terms (causal / window / chunk / prefix / "
                    "document), so it needs element bitmaps, which cannot be built from "
                    "per-call data (segment ids, mask arrays).")
        return None

    def default_tiling(self, features: Features, mask: ResolvedMask) -> SplashConfig:
        return SplashConfig.heuristic(features)

    def adapt_tiling(self, tiling: AbstractKernelConfig, features: Features) -> SplashConfig:
        # Another kernel's config (or a `Tiling`) gives its blocks.
        return SplashConfig.of_blocks(tiling.blocks).in_lanes(features)

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        refuse_forward_mode(type(self).__name__, query, key, value, *jax.tree.leaves(inputs))
        on_tpu = features.platform == "tpu" and jax.default_backend() == "tpu"
        interpret = not on_tpu if self.interpret is None else self.interpret
        _, heads, q_len, dim = query.shape
        kv_len, value_dim = value.shape[2], value.shape[3]
        passes = tiling.blocks._asdict()
        lq = padded_length(q_len, [bq for bq, _ in passes.values()])
        lk = padded_length(kv_len, [bk for _, bk in passes.values()])
        infos = tuple(
            block_info(getattr(mask, name), transposed=name == "dkv", num_q_blocks=lq // bq,
                       num_kv_blocks=lk // bk)
            for name, (bq, bk) in passes.items())
        if mask.forward.bitmaps is not None:
            bitmaps = (mask.forward.bitmaps, mask.dq.bitmaps,
                       jnp.swapaxes(mask.dkv.bitmaps, -1, -2))
            predicate = None
        else:
            bitmaps = (None, None, None)
            predicate = TermsPredicate.from_terms(mask.terms, kv_len if lk > kv_len else None)
        segment_ids = None
        if mask.uses_segment_ids:
            q_ids, kv_ids = never_matching(inputs.q_segment_ids, inputs.kv_segment_ids)
            segment_ids = (pad_axis(q_ids, 1, lq, -1), pad_axis(kv_ids, 1, lk, -2))
        # Splash has no softmax scale: it goes into the queries.
        q = (query.astype(jnp.float32) * softmax_scale).astype(query.dtype)
        q, k, v = pad_axis(q, 2, lq), pad_axis(key, 2, lk), pad_axis(value, 2, lk)
        if features.platform == "tpu":
            q, k = pad_axis(q, 3, _tpu_head_dim(dim)), pad_axis(k, 3, _tpu_head_dim(dim))
            v = pad_axis(v, 3, _tpu_head_dim(value_dim))
        out = splash_attention(
            q, k, v, infos=infos, bitmaps=bitmaps, segment_ids=segment_ids,
            sinks=sink_logits(inputs.sinks, heads),
            sizes=block_sizes(*passes.values()), predicate=predicate,
            soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
            interpret=interpret)
        return out[:, :, :q_len, :value_dim].astype(query.dtype)
