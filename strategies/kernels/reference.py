"""`DenseReference`: materialises every score in float32; the oracle and the last resort."""

from typing import ClassVar

import jax
import jax.numpy as jnp

from eqx_bsattn.contract import (
    AbstractBroadcastBiasKernel,
    AbstractLseKernel,
    AttentionInputs,
    CompiledMask,
    MaskReads,
)


def dense_visibility(mask: CompiledMask, inputs: AttentionInputs):
    """The ``[mb, mh, Lq, Lk]`` boolean visibility of `mask` (``mb``/``mh`` 1 or full).

    Materialises ``Lq x Lk`` per (batch, head) it depends on: for references and tests only.
    """
    q_len, kv_len = mask.q_len, mask.kv_len
    qi = jnp.arange(q_len, dtype=jnp.int32)[:, None]
    kj = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
    data = {
        "q_positions": inputs.q_positions,
        "kv_positions": inputs.kv_positions,
        "q_segment_ids": inputs.q_segment_ids if mask.uses_segment_ids else None,
        "kv_segment_ids": inputs.kv_segment_ids if mask.uses_segment_ids else None,
    }
    present = {name: x for name, x in data.items() if x is not None}
    head_range = range(mask.num_heads) if mask.head_dependent else range(1)

    per_head = []
    for h in head_range:
        if present:
            per_head.append(jax.vmap(lambda arrays, h=h: mask.visible(h, qi, kj, **arrays))(present))
        else:
            per_head.append(jnp.broadcast_to(mask.visible(h, qi, kj), (1, q_len, kv_len)))
    return jnp.stack(per_head, axis=1)


def _with_score(s, inputs: AttentionInputs):
    """`s` ``[B, H, Lq, Lk]`` with the score terms at the call's positions (dense); the score
    function's params are read from `inputs.score`, so autodiff reaches them."""
    _, heads, q_len, kv_len = s.shape

    def positions(x, length):
        if x is None:
            return jnp.arange(length, dtype=jnp.int32)[None]
        return x

    qp = positions(inputs.q_positions, q_len)[:, None, :, None]
    kp = positions(inputs.kv_positions, kv_len)[:, None, None, :]
    head = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
    batch = jnp.arange(s.shape[0], dtype=jnp.int32)[:, None, None, None]
    return inputs.score.apply(s, head, qp, kp, batch=batch)


def reference_attention(q, k, v, *, mask: CompiledMask, inputs: AttentionInputs, softmax_scale,
                        logits_soft_cap, return_lse: bool = False):
    """Dense attention in float32 with every feature; see `DenseReference`.

    With `return_lse`, also each row's float32 log-sum-exp ``[B, H, Lq]`` (``-inf`` where the
    row sees no key)."""
    heads = q.shape[1]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    f32 = jnp.float32
    # (No repeat without groups: small calls on a CPU run here, where every op adds compile time.)
    k_rep = jnp.repeat(k.astype(f32), group, axis=1) if group > 1 else k.astype(f32)
    v_rep = jnp.repeat(v.astype(f32), group, axis=1) if group > 1 else v.astype(f32)
    s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(f32), k_rep) * softmax_scale
    if inputs.bias is not None:
        s = s + inputs.bias.astype(f32)
    if inputs.score is not None:
        s = _with_score(s, inputs)
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    visible = dense_visibility(mask, inputs)
    s_visible = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s_visible, axis=-1)
    sinks = None if inputs.sinks is None else inputs.sinks.astype(f32)  # [H, S]
    if sinks is not None:
        m = jnp.maximum(m, jnp.max(sinks, axis=-1)[None, :, None])
    # The output does not depend on the shift m, so no gradient needs to flow through it.
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(s_visible - m[..., None])  # m is finite: hidden pairs stay -inf, weigh 0
    denom = jnp.sum(p, axis=-1)
    if sinks is not None:
        denom = denom + jnp.sum(jnp.exp(sinks[None, :, None, :] - m[..., None]), axis=-1)
    any_visible = jnp.any(visible, axis=-1)
    # m is a visible logit, so denom >= 1, unless a -inf bias hides every visible key: then the
    # row sees no key, and its zero weights over 1 give zeros (never 0 / 0).
    denom = jnp.where(denom == 0, 1.0, denom)  # a NaN (poisoned) sink stays NaN
    out = jnp.einsum("bhqk,bhkd->bhqd", p, v_rep) / denom[..., None]
    out = jnp.where(any_visible[..., None], out, 0.0)
    if not return_lse:
        return out.astype(q.dtype)
    lse = jnp.where(any_visible, m + jnp.log(denom), -jnp.inf)
    return out.astype(q.dtype), lse


class DenseReference(AbstractLseKernel, AbstractBroadcastBiasKernel):
    """Dense float32 attention with every feature: the oracle of the test suite.

    Materialises the ``[B, H, Lq, Lk]`` scores, so memory grows with ``Lq x Lk``. The selector
    picks it where no block-sparse kernel can run a call, and for small calls on a CPU (at
    most ``256 x 256`` query-key pairs a head, unsharded: `select_kernel` says so), which it
    traces, compiles and runs faster than a kernel walking a block layout of a few blocks
    (docs/performance.md). Differentiable by JAX's
    autodiff; rows that see no key give zeros and zero gradients. It reads no block layout: it
    evaluates `CompiledMask.visible` on every pair. It reads a bias with its size-1 axes
    (an `AbstractBroadcastBiasKernel`): the scores broadcast them, autodiff sums them back.

    ```python
    attn = BlockSparseAttention(mask=mask, kernel=kernels.DenseReference())
    ```
    """

    name: ClassVar[str] = "reference"
    platforms: ClassVar[tuple[str, ...]] = ("cpu", "gpu", "tpu")
    reads: ClassVar[MaskReads] = "dense"
    score_kinds: ClassVar[tuple[str, ...]] = ("alibi", "relative_bias", "function")

    @classmethod
    def priority(cls, platform):
        return 0  # the last resort everywhere

    def decline_reason(self, mask, features):
        return None  # every mask and feature: the oracle

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        return reference_attention(
            query, key, value, mask=mask, inputs=inputs, softmax_scale=softmax_scale,
            logits_soft_cap=logits_soft_cap,
        )

    def attention_with_lse(self, query, key, value, *, mask, inputs, features, tiling,
                           softmax_scale, logits_soft_cap):
        return reference_attention(
            query, key, value, mask=mask, inputs=inputs, softmax_scale=softmax_scale,
            logits_soft_cap=logits_soft_cap, return_lse=True,
        )
