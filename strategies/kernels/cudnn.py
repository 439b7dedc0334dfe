"""`CudnnDense`: cuDNN's fused attention through `jax.nn.dot_product_attention`, for the masks
it can express (full, causal, causal with a sliding window) on a GPU."""

import types
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp

from eqx_bsattn.contract import (AbstractKernel, MaskReads, MaskTerms, first_gpu,
                                  refuse_forward_mode)


def _gpu_capability() -> tuple[int, ...] | None:
    """The compute capability of the first GPU JAX sees, ``(major, minor)``, or ``None``."""
    capability = getattr(first_gpu(), "compute_capability", None)
    if capability is None:
        return None
    return tuple(int(part) for part in str(capability).split("."))


def head_dim_decline(head_dim: int) -> str | None:
    """Why cuDNN's fused attention cannot take `head_dim` here, or ``None``: a multiple of 8,
    at most 128, or at most 256 on a Hopper or later GPU (on a host without a GPU, 128)."""
    capability = _gpu_capability()
    wide = capability is not None and capability >= (9, 0)
    limit = 256 if wide else 128
    if head_dim % 8 or head_dim > limit:
        where = " on this GPU" if capability is not None else " (256 on a Hopper GPU)"
        return (f"cuDNN attention needs a head dim that is a multiple of 8, at most "
                f"{limit}{where}; got {head_dim}.")
    if head_dim > 128 and CudnnDense.awaits_device_run("wide_heads"):
        return f"cuDNN attention at head dim {head_dim} (over 128) has not yet run on a GPU."
    return None


def nn_attention(q, k, v, **options):
    """`jax.nn.dot_product_attention` on ``[B, H, L, D]`` arrays (it takes ``[B, L, H, D]``);
    `options` go to it unchanged."""
    to_blhd = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    out = jax.nn.dot_product_attention(to_blhd(q), to_blhd(k), to_blhd(v), **options)
    return jnp.swapaxes(out, 1, 2)


def cudnn_mask_options(terms: MaskTerms | None, length: int) -> dict | None:
    """``is_causal`` / ``local_window_size`` equivalent to the canonical `terms` at sequence
    `length`, or ``None`` if cuDNN cannot express them (a window only together with causal)."""
    if terms is None or terms.chunk is not None or terms.prefix is not None:
        return None
    if terms.segment_ids or terms.tables:
        return None
    if terms.causal_offset not in (None, 0):
        return None
    causal = terms.causal_offset == 0
    options = {"is_causal": causal}
    if terms.window_left is not None or terms.window_right is not None:
        if not causal:
            # Without is_causal cuDNN refuses a right side, and with right=0 it computed
            # something else (H200, jax 0.11.2: relative error 0.92 against the reference).
            return None
        # An unbounded left side is a window as long as the sequence; causal cuts the right.
        left = length if terms.window_left is None else terms.window_left
        options["local_window_size"] = (left, 0)
    return options


class CudnnDense(AbstractKernel):
    """cuDNN flash attention via ``jax.nn.dot_product_attention(implementation="cudnn")``.

    On the H200 this is the fastest kernel for the masks cuDNN expresses: full, causal, and
    causal with a sliding window (mask terms: causal offset 0, optionally a window). The
    selector prefers it there and sends every other mask or feature (bias, sinks, soft cap,
    segment ids, positions, ``Dv != D``, ``Lq != Lk``, float32, head dims over 128 before
    Hopper and over 256 on it) to the block-sparse kernels. It reads no block layout: cuDNN
    gets the mask's terms.

    ```python
    attn = BlockSparseAttention(mask=mask, kernel=kernels.CudnnDense())
    ```
    """

    name: ClassVar[str] = "cudnn"
    platforms: ClassVar[tuple[str, ...]] = ("gpu",)
    reads: ClassVar[MaskReads] = "dense"
    #: Declined in one line (the selector keeps Triton) until `benchmarks/device_proofs.sh`
    #: has run them on a Hopper GPU.
    awaiting_device_run: ClassVar[Mapping[str, str]] = types.MappingProxyType({
        "wide_heads": "head dims 136 to 256, which jax.nn's cuDNN path takes on Hopper and "
                      "later GPUs",
    })

    @classmethod
    def priority(cls, platform):
        return 40 if platform == "gpu" else None

    def decline_reason(self, mask, features):
        if cudnn_mask_options(mask.terms, features.kv_len) is None:
            return "cuDNN expresses only full, causal and causal sliding-window masks."
        asked = [name for name in ("bias", "sinks", "soft_cap", "segment_ids", "positions")
                 if getattr(features, name)]
        if asked:
            return f"cuDNN attention here has no {', '.join(asked)}."
        if features.dtype not in ("bfloat16", "float16"):
            return f"cuDNN attention needs bfloat16 or float16 inputs; got {features.dtype}."
        if features.head_dim != features.value_dim:
            return "cuDNN attention needs Dv == D."
        why = head_dim_decline(features.head_dim)
        if why is not None:
            return why
        if features.q_len != features.kv_len:
            return "cuDNN's causal and window masks align top-left; this call has Lq != Lk."
        if features.q_len % 2:
            # jax 0.11.2 refuses odd lengths in cuDNN's training path ("Unsupported sequence
            # length"), and a forward taken now may be differentiated later.
            return f"cuDNN attention's backward pass needs an even sequence length; got {features.q_len}."
        return None

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        refuse_forward_mode(type(self).__name__, query, key, value)
        options = cudnn_mask_options(mask.terms, key.shape[2])
        if options is None:
            raise ValueError("CudnnDense cannot express this mask; see decline_reason.")
        return nn_attention(query, key, value, scale=softmax_scale, implementation="cudnn",
                            **options)
