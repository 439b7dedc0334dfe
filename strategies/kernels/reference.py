"""`DenseReference`: materialises every score in float32; the oracle and the last resort."""

from typing import ClassVar

import jax
import jax.numpy as jnp

from eqx_bsattn._kernel import AbstractKernel
from eqx_bsattn._layout import element_mask
from eqx_bsattn._tiling import Tiling


def dense_visibility(mask, inputs, *, heads: int, q_len: int, kv_len: int):
    """The ``[mb, mh, Lq, Lk]`` boolean visibility of `mask` (``mb``/``mh`` 1 or full).

    Materialises ``Lq x Lk`` per (batch, head) it depends on: for references and tests only.
    """
    qi = jnp.arange(q_len, dtype=jnp.int32)[:, None]
    kj = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
    data = {
        "q_positions": inputs.q_positions,
        "kv_positions": inputs.kv_positions,
        "q_segment_ids": inputs.q_segment_ids if mask.uses_segment_ids else None,
        "kv_segment_ids": inputs.kv_segment_ids if mask.uses_segment_ids else None,
    }
    present = {name: x for name, x in data.items() if x is not None}
    head_range = range(heads) if mask.head_dependent else range(1)

    def for_batch(arrays, h):
        return element_mask(mask, h, qi, kj, q_len=q_len, kv_len=kv_len, **arrays)

    per_head = []
    for h in head_range:
        if present:
            per_head.append(jax.vmap(lambda arrays: for_batch(arrays, h))(present))
        else:
            per_head.append(jnp.broadcast_to(for_batch({}, h), (1, q_len, kv_len)))
    return jnp.stack(per_head, axis=1)


def reference_attention(q, k, v, *, mask, inputs, softmax_scale, logits_soft_cap):
    """Dense attention in float32 with every feature; see `DenseReference`."""
    heads, q_len = q.shape[1:3]
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    f32 = jnp.float32
    k_rep = jnp.repeat(k.astype(f32), group, axis=1)
    v_rep = jnp.repeat(v.astype(f32), group, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(f32), k_rep) * softmax_scale
    if inputs.bias is not None:
        s = s + inputs.bias.astype(f32)
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    visible = dense_visibility(mask, inputs, heads=heads, q_len=q_len, kv_len=kv_len)
    s_visible = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s_visible, axis=-1)
    sinks = None if inputs.sinks is None else inputs.sinks.astype(f32)  # [H, S]
    if sinks is not None:
        m = jnp.maximum(m, jnp.max(sinks, axis=-1)[None, :, None])
    # The output does not depend on the shift m, so no gradient needs to flow through it.
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(jnp.where(visible, s - m[..., None], -jnp.inf))
    denom = jnp.sum(p, axis=-1)
    if sinks is not None:
        denom = denom + jnp.sum(jnp.exp(sinks[None, :, None, :] - m[..., None]), axis=-1)
    any_visible = jnp.any(visible, axis=-1)
    # m is a visible logit, so denom >= 1, unless a -inf bias hides every visible key: then the
    # row sees no key, and its zero weights over 1 give zeros (never 0 / 0).
    denom = jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhqk,bhkd->bhqd", p, v_rep) / denom[..., None]
    out = jnp.where(any_visible[..., None], out, 0.0)
    return out.astype(q.dtype)


class DenseReference(AbstractKernel):
    """Dense float32 attention with every feature: the oracle of the test suite.

    Materialises the ``[B, H, Lq, Lk]`` scores, so memory grows with ``Lq x Lk``; the selector
    falls back to it only when no block-sparse kernel can run a call. Differentiable by JAX's
    autodiff; rows that see no key give zeros and zero gradients.

    ```python
    attn = BlockSparseAttention(mask=masks.Causal(), kernel=kernels.DenseReference())
    ```
    """

    name: ClassVar[str] = "reference"

    @classmethod
    def priority(cls, platform):
        return 0  # the last resort everywhere

    def default_tiling(self, features):
        return Tiling(block_q=128, block_kv=128)  # unused: the reference has no tiles

    def __call__(self, query, key, value, *, mask, inputs, tiling, softmax_scale, logits_soft_cap):
        return reference_attention(
            query, key, value, mask=mask, inputs=inputs, softmax_scale=softmax_scale,
            logits_soft_cap=logits_soft_cap,
        )
