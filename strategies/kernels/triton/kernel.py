"""`TritonBlockSparse`: the kernel strategy, reading the compiled mask into the launches."""

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from eqx_bsattn.contract import (AbstractKernelConfig, AbstractLseKernel, Features, MaskReads,
                                  ResolvedMask, add_sinks, refuse_forward_mode)

from .config import TritonConfig
from .heuristics import default_tiling, tiling_candidates
from .launch import LaunchConfig, gpu_takes_ptx, layout_arrays, list_mode
from .vjp import attend, attend_with_lse

_SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
_MAX_HEAD_DIM = 256

#: The jax-triton releases this kernel was run with, each with the Triton release series it was
#: run against (on an H200 with jax 0.11.2). jax-triton breaks with new Triton releases; the
#: `gpu` extra pins the same pairs.
KNOWN_GOOD_VERSIONS = {"0.3.1": ("3.6",)}


def version_problem(jax_triton_version: str, triton_version: str) -> str | None:
    """Why this jax-triton / Triton pair is not one the kernel was run with, or ``None``."""
    series = KNOWN_GOOD_VERSIONS.get(jax_triton_version, ())
    if any(triton_version == s or triton_version.startswith(s + ".") for s in series):
        return None
    known = "; ".join(f"jax-triton {jt} with triton {', '.join(s + '.x' for s in ts)}"
                      for jt, ts in KNOWN_GOOD_VERSIONS.items())
    return (f"jax-triton {jax_triton_version} with triton {triton_version} is not a pair this "
            f"kernel was run with (known good: {known}); install the `gpu` extra.")


@functools.cache
def _jax_triton_missing() -> str | None:
    """Why jax-triton and Triton cannot serve this kernel here, or ``None``."""
    try:
        import jax_triton
        import triton
    except Exception as e:  # ImportError, or a broken install that fails at import
        return (f"jax_triton / triton cannot be imported ({type(e).__name__}: {e}); install the "
                "`gpu` extra.")
    return version_problem(jax_triton.__version__, triton.__version__)


class TritonBlockSparse(AbstractLseKernel):
    """Block-sparse flash attention written in Triton, launched from JAX with jax-triton.

    The forward pass runs one program per (q-block, head, batch) over that q-block's visited
    kv-blocks: full blocks without masking, partial blocks with the mask evaluated in the
    kernel; online softmax in base 2 with float32 accumulation; it keeps the log-sum-exp for
    the backward pass. The backward pass is split: a dq kernel over q-blocks and a dk/dv
    kernel over kv-blocks (the layout's transposed lists) that loops over the q heads of its
    group, so grouped-query gradients are reduced deterministically, without atomics. The
    forward, dq and dk/dv launches read the compiled mask's three layouts, each at its own
    tiles (its `TritonConfig`'s forward, ``*_dq`` and ``*_bwd`` fields). FULL lists that are
    ranges of blocks are walked without index loads: known on the host for static layouts,
    checked per row in the kernel for layouts built from per-call data.

    Score terms (`ScoreTerms`: ALiBi slopes, a T5 relative-bias table) are evaluated on
    positions in every visited block, forward and backward; the dq launch sums their
    gradients per program (one row each, added in XLA: deterministic, no atomics).

    Partial blocks evaluate the compiled mask's canonical terms (causal with an offset, a
    window, chunks, a prefix, segment ids) on positions; block tables whose cells are
    multiples of the tiles need no term (the layouts hold them). A mask without terms uses the
    layouts' deduplicated element bitmaps, which need a static mask: with positions or segment
    ids such a mask declines.

    With the heuristic tiling, a static layout whose rows visit few, scattered blocks
    (BigBird-like) runs with 64x64 tiles, 4 warps and 2 stages, forward and backward; with
    segment ids all three launches take 64x64 tiles.

    Inputs ``[B, H, Lq, D]`` / ``[B, Hkv, Lk, D]`` / ``[B, Hkv, Lk, Dv]`` in bfloat16, float16
    or float32 (float32 products in full precision), head dims up to 256 (padded to a power of
    two inside the kernel); bias, sinks, soft cap, segment ids and positions, all
    differentiable where they are floating. GPU only; needs ``jax-triton`` (the ``gpu``
    extra).

    ```python
    attn = BlockSparseAttention(mask=mask, kernel=kernels.TritonBlockSparse())
    out = attn(q, k, v)          # q [B, H, L, D] bfloat16 on a GPU
    ```
    """

    name: ClassVar[str] = "triton"
    platforms: ClassVar[tuple[str, ...]] = ("gpu",)
    reads: ClassVar[MaskReads] = "terms"
    config_type: ClassVar[type[AbstractKernelConfig]] = TritonConfig
    #: ALiBi and the relative-position bias run inside the kernels; a `ScoreFunction` is a
    #: jnp function, which cannot be traced into Triton, so the selector declines it.
    score_kinds: ClassVar[tuple[str, ...]] = ("alibi", "relative_bias")

    @classmethod
    def priority(cls, platform):
        return 30 if platform == "gpu" else None

    def decline_reason(self, mask: ResolvedMask, features: Features) -> str | None:
        missing = _jax_triton_missing()
        if missing is not None:
            return missing
        if features.dtype not in _SUPPORTED_DTYPES:
            return f"dtype {features.dtype} is not supported (bfloat16, float16, float32 are)."
        if max(features.head_dim, features.value_dim) > _MAX_HEAD_DIM:
            return (f"head dims above {_MAX_HEAD_DIM} are not supported; got "
                    f"{features.head_dim} / {features.value_dim}.")
        per_call = features.positions or features.segment_ids or not mask.is_static
        if per_call and (mask.terms is None or mask.terms.tables):
            return ("the mask has no in-kernel terms (causal / window / chunk / prefix / "
                    "document), so it needs element bitmaps, which cannot be built from per-call data "
                    "(positions, segment ids, mask arrays).")
        return None

    def default_tiling(self, features: Features, mask: ResolvedMask) -> TritonConfig:
        return default_tiling(features, mask)

    def adapt_tiling(self, tiling: AbstractKernelConfig, features: Features) -> TritonConfig:
        return TritonConfig.from_config(tiling)

    def tiling_candidates(self, features: Features, mask: ResolvedMask):
        return tiling_candidates(features, mask)

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        return self._run(query, key, value, mask, inputs, tiling, softmax_scale,
                         logits_soft_cap, with_lse=False)

    def attention_with_lse(self, query, key, value, *, mask, inputs, features, tiling,
                           softmax_scale, logits_soft_cap):
        return self._run(query, key, value, mask, inputs, tiling, softmax_scale,
                         logits_soft_cap, with_lse=True)

    def _run(self, query, key, value, mask, inputs, tiling, softmax_scale, logits_soft_cap,
             with_lse):
        refuse_forward_mode(type(self).__name__, query, key, value, *jax.tree.leaves(inputs))
        batch, heads, q_len, dim = query.shape
        kv_heads, kv_len, value_dim = value.shape[1:]
        fwd, dq, dkdv = mask.forward, mask.dq, mask.dkv
        dummy_int = jnp.zeros((1,), jnp.int32)
        data = tuple(dummy_int if x is None else x.astype(jnp.int32) for x in (
            inputs.q_positions, inputs.kv_positions, inputs.q_segment_ids, inputs.kv_segment_ids))
        bias, sinks, terms = inputs.bias, inputs.sinks, inputs.score
        slopes = None if terms is None else terms.slopes
        table = None if terms is None else terms.table
        placeholder = jnp.zeros((1,), jnp.float32)
        score_args = tuple(placeholder if x is None else x.astype(jnp.float32)
                           for x in (slopes, table))
        # With the log-sum-exp, sinks join after the launch (`add_sinks`), so that a row that
        # sees no key keeps lse = -inf.
        kernel_sinks = None if with_lse else sinks
        bias_arg = jnp.zeros((1,), jnp.float32) if bias is None else bias
        sinks_arg = (jnp.zeros((1, 1), jnp.float32) if kernel_sinks is None
                     else kernel_sinks.astype(jnp.float32))
        fwd_warps = tiling.num_warps or 4
        fwd_stages = tiling.num_stages or 2
        bwd_launch = (tiling.num_warps_bwd or fwd_warps, tiling.num_stages_bwd or fwd_stages)
        cfg = LaunchConfig(
            batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len,
            head_dim=dim, value_dim=value_dim, dtype=jnp.dtype(query.dtype).name,
            bias_shape=None if bias is None else tuple(bias.shape[:2]),
            num_sinks=0 if kernel_sinks is None else kernel_sinks.shape[-1],
            softmax_scale=float(softmax_scale),
            soft_cap=0.0 if logits_soft_cap is None else float(logits_soft_cap),
            terms=mask.terms,
            has_q_positions=inputs.q_positions is not None,
            has_kv_positions=inputs.kv_positions is not None,
            alibi=slopes is not None, relative=None if table is None else terms.buckets,
            fwd_blocks=(fwd.block_q, fwd.block_kv), dq_blocks=(dq.block_q, dq.block_kv),
            dkdv_blocks=(dkdv.block_q, dkdv.block_kv),
            fwd_launch=(fwd_warps, fwd_stages),
            dq_launch=(tiling.num_warps_dq or bwd_launch[0], tiling.num_stages_dq or bwd_launch[1]),
            dkdv_launch=bwd_launch,
            list_modes=(list_mode(fwd, False), list_mode(dq, False), list_mode(dkdv, True)),
            ptx=gpu_takes_ptx(),
        )
        relative = cfg.relative if cfg.splits_far_blocks else None
        lists = layout_arrays(fwd, transposed=False, relative=relative)
        bwd_lists = (layout_arrays(dq, transposed=False, relative=relative),
                     layout_arrays(dkdv, transposed=True, relative=relative))
        args = (cfg, query, key, value, bias_arg, sinks_arg, score_args, data, lists, bwd_lists)
        if with_lse:
            out, lse = attend_with_lse(*args)
            if sinks is not None:
                out, lse = add_sinks(out, lse, sinks)
            return out.astype(query.dtype), lse
        return attend(*args).astype(query.dtype)
