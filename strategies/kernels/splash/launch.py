"""Calling JAX's Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) with
block-info arrays of our own.

Splash is built for masks it processes itself (`make_splash_mha(mask, ...)`); here its kernel
object, `SplashAttentionKernel`, is built directly from `MaskInfo` tuples filled from our
layouts, with the keyword arguments `make_splash_mha` gives it. `splash_missing` checks that the
installed JAX has the interface this relies on (the same in jax 0.10.2 and at the head of the
jax repository); the kernel declines with its answer otherwise.
"""

import functools
import inspect

import jax
import jax.numpy as jnp

from eqx_bsattn.contract import sink_logsumexp

from .mask_info import BlockInfo

#: A sink logit far below any attention logit, yet far above Splash's masked-logit value
#: (``-0.7 * float32 max``): with it, a row whose keys are all masked sums to exactly zero
#: instead of averaging its masked values, and a q-block with no visited block gets a finite
#: log-sum-exp. It changes nothing else: ``exp(-1e30 - s) == 0`` for every real logit ``s``.
EMPTY_ROW_SINK = -1e30

#: The `MaskInfo` fields this module fills, and the `SplashAttentionKernel` keyword arguments
#: it passes (those `make_splash_mha` passes).
_MASK_INFO_FIELDS = ("data_next", "mask_next", "block_mask", "partial_mask_blocks", "q_sequence")
_KERNEL_KWARGS = frozenset({"block_sizes", "is_mqa", "save_residuals", "mask_value",
                            "attn_logits_soft_cap", "residual_checkpoint_name",
                            "mask_function", "interpret"})


def _modules():
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
        splash_attention_mask as mask_lib,
        splash_attention_mask_info as info_lib,
    )

    return kernel_lib, mask_lib, info_lib


@functools.cache
def splash_missing() -> str | None:
    """Why this JAX's Splash attention cannot serve the kernel, or ``None``.

    Checks the names and fields used here, and that `make_splash_mha` hands
    `SplashAttentionKernel` exactly the keyword arguments passed here (on a one-block mask).
    """
    try:
        kernel_lib, mask_lib, info_lib = _modules()
    except Exception as e:  # ImportError, or a broken install
        return f"JAX's Splash attention cannot be imported ({type(e).__name__}: {e})."
    for module, name in ((kernel_lib, "SplashAttentionKernel"), (kernel_lib, "BlockSizes"),
                         (kernel_lib, "SegmentIds"), (kernel_lib, "make_splash_mha"),
                         (info_lib, "MaskInfo"), (mask_lib, "FullMask")):
        if not hasattr(module, name):
            return f"this JAX's Splash attention has no `{name}`."
    if not set(_MASK_INFO_FIELDS) <= set(info_lib.MaskInfo._fields):
        return f"this JAX's Splash `MaskInfo` lacks fields {_MASK_INFO_FIELDS}."
    if "sinks" not in inspect.signature(kernel_lib.attention_reference).parameters:
        return "this JAX's Splash attention has no attention sinks."
    try:
        probe = kernel_lib.make_splash_mha(
            mask_lib.MultiHeadMask([mask_lib.FullMask((128, 128))]),
            head_shards=1, q_seq_shards=1)
        given = set(probe.kwargs)
    except Exception as e:
        return f"this JAX's Splash attention does not build a kernel ({type(e).__name__}: {e})."
    if given != _KERNEL_KWARGS:
        return (f"this JAX's Splash kernel takes {sorted(given)}, not the "
                f"{sorted(_KERNEL_KWARGS)} this kernel passes.")
    return None


def block_sizes(forward, dq, dkv):
    """Splash's `BlockSizes` from the ``(block_q, block_kv)`` of each pass."""
    kernel_lib, _, _ = _modules()
    return kernel_lib.BlockSizes(
        block_q=forward[0], block_kv=forward[1], block_kv_compute=forward[1],
        block_q_dkv=dkv[0], block_kv_dkv=dkv[1], block_kv_dkv_compute=dkv[1],
        block_q_dq=dq[0], block_kv_dq=dq[1])


def _mask_info(info: BlockInfo, bitmaps, q_sequence):
    _, _, info_lib = _modules()
    return info_lib.MaskInfo(data_next=info.data_next, mask_next=info.mask_next,
                             block_mask=info.block_mask, partial_mask_blocks=bitmaps,
                             q_sequence=q_sequence)


def splash_attention(q, k, v, *, infos, bitmaps, segment_ids, sinks, sizes, predicate,
                     soft_cap, interpret):
    """Splash attention over a batch: ``q [B, H, Lq, D]``, ``k [B, Hkv, Lk, D]``,
    ``v [B, Hkv, Lk, Dv]`` (lengths whole blocks of every pass) -> ``[B, H, Lq, Dv]``.

    - `infos`: the forward, dq and dk/dv `BlockInfo` (leading ``[mb, mh]``; mb 1 or B).
    - `bitmaps`: the forward, dq and dk/dv partial-block bitmaps (dk/dv transposed), or
      ``None`` where the predicate evaluates the mask.
    - `segment_ids`: ``([B, Lq], [B, Lk])`` int32 (ids that never match where padded) or
      ``None``.
    - `sinks`: ``[H]`` float32 sink logits.
    - `predicate`: Splash's ``mask_function`` (a `TermsPredicate`) or ``None``.
    """
    kernel_lib, _, _ = _modules()
    q_len = q.shape[2]
    q_sequence = None if predicate is None else jnp.arange(q_len, dtype=jnp.int32)
    batch_axes = [0 if info.data_next.shape[0] > 1 else None for info in infos]
    squeeze = [jax.tree.map(lambda x: x if axis == 0 else x[0], tuple(info))
               for info, axis in zip(infos, batch_axes)]

    def one(q, k, v, segments, fwd, dq, dkv):
        mask_infos = [_mask_info(BlockInfo(*i), b, q_sequence)
                      for i, b in zip((fwd, dq, dkv), bitmaps)]
        splash = kernel_lib.SplashAttentionKernel(
            *mask_infos, block_sizes=sizes, is_mqa=False, save_residuals=False,
            mask_value=kernel_lib.DEFAULT_MASK_VALUE, attn_logits_soft_cap=soft_cap,
            residual_checkpoint_name=None, mask_function=predicate, interpret=interpret)
        ids = None if segments is None else kernel_lib.SegmentIds(q=segments[0], kv=segments[1])
        return splash(q, k, v, ids, sinks)

    in_axes = (0, 0, 0, None if segment_ids is None else 0,
               *[jax.tree.map(lambda _: a, s) for a, s in zip(batch_axes, squeeze)])
    return jax.vmap(one, in_axes=in_axes)(q, k, v, segment_ids, *squeeze)


@jax.custom_vjp
def _float32_cotangent(x):
    """The identity on float32 `x`, whose cotangent leaves as float32: Splash returns the
    sinks' gradient in the inputs' dtype (bfloat16), which float32 sink logits cannot take."""
    return x


_float32_cotangent.defvjp(lambda x: (x, None), lambda _, g: (g.astype(jnp.float32),))


def sink_logits(sinks, num_heads: int):
    """Splash's one sink logit per head: the log-sum-exp of the call's sinks ``[H, S]``
    (`sink_logsumexp`, differentiable), at least `EMPTY_ROW_SINK`, which stands in for a head
    without sinks (all ``-inf``, or none passed)."""
    if sinks is None:
        return jnp.full((num_heads,), EMPTY_ROW_SINK, jnp.float32)
    # exp(EMPTY_ROW_SINK - s) is zero for every real logit s: raising a lower sink to it
    # changes no output, and gives a fully masked row zeros.
    return _float32_cotangent(jnp.maximum(sink_logsumexp(sinks), EMPTY_ROW_SINK))


def never_matching(q_ids, kv_ids):
    """Segment ids for Splash, which attends equal ids: negative (padding) ids become -1 for
    queries and -2 for keys, so padding attends nothing."""
    q_ids = jnp.where(q_ids < 0, -1, q_ids).astype(jnp.int32)
    kv_ids = jnp.where(kv_ids < 0, -2, kv_ids).astype(jnp.int32)
    return q_ids, kv_ids
