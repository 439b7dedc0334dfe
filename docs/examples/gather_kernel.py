"""A kernel written against the public contract: `GatherKernel`.

For each q-block it gathers the kv-blocks that the compiled mask's forward layout lists (full,
then partial), evaluates the element predicate on them, and takes a softmax over the gathered
keys only. Plain JAX: autodiff gives every gradient, so there is no backward pass to write.
It is exact and block-sparse in its arithmetic, though its memory holds one row of gathered
blocks per q-block; `docs/custom_kernel.md` walks through it.

Defining the class registers it: `BlockSparseAttention(kernel=GatherKernel())` runs it, and the
test suite's conformance run picks it up.
"""

from typing import ClassVar

import jax
import jax.numpy as jnp

from eqx_bsattn.contract import (AbstractKernel, AttentionInputs, CompiledMask, Features,
                                  MaskReads, Tiling)


def _pad_to(x, axis: int, size: int):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


class GatherKernel(AbstractKernel):
    """Gathers each q-block's listed kv-blocks and attends over them (any platform).

    ```python
    attn = BlockSparseAttention(mask=mask, kernel=GatherKernel())
    out = attn(q, k, v)
    ```
    """

    name: ClassVar[str] = "gather"
    platforms: ClassVar[tuple[str, ...]] = ("cpu", "gpu", "tpu")
    reads: ClassVar[MaskReads] = "elements"  # a layout per pass; partial blocks: `visible`

    @classmethod
    def priority(cls, platform):
        return None  # never picked automatically: pass it as `kernel=`

    def decline_reason(self, mask, features):
        return None  # any mask (through `visible`) and every feature the contract has

    def default_tiling(self, features: Features, mask) -> Tiling:
        return Tiling(block_q=64, block_kv=64)

    def __call__(self, query, key, value, *, mask: CompiledMask, inputs: AttentionInputs,
                 features: Features, tiling: Tiling, softmax_scale: float,
                 logits_soft_cap: float | None):
        layout = mask.forward
        bq, bk = layout.block_q, layout.block_kv
        nq, nk = layout.num_q_blocks, layout.num_kv_blocks
        batch, heads, q_len, _ = query.shape
        group = heads // key.shape[1]

        # Each (batch, head, q-block) row: its full blocks, then its partial blocks. The lists
        # have a leading [1 or batch, 1 or heads]; broadcast them to every row.
        rows = (batch, heads, nq)
        index = jnp.concatenate([layout.full_index, layout.partial_index], axis=-1)
        slots = jnp.arange(index.shape[-1])
        cf = layout.full_index.shape[-1]
        live = jnp.where(slots < cf, slots < layout.full_count[..., None],
                         slots - cf < layout.partial_count[..., None])
        full = jnp.broadcast_to(slots < cf, live.shape)
        index, live, full = (jnp.broadcast_to(x, rows + x.shape[-1:]) for x in (index, live, full))

        q = _pad_to(query, 2, nq * bq).reshape(batch, heads, nq, bq, -1)
        k = _pad_to(key, 2, nk * bk).reshape(batch, key.shape[1], nk, bk, -1)
        v = _pad_to(value, 2, nk * bk).reshape(batch, value.shape[1], nk, bk, -1)
        bias = inputs.bias
        if bias is not None:
            bias = _pad_to(_pad_to(bias, 2, nq * bq), 3, nk * bk)

        def one_row(b, h, i):
            blocks = index[b, h, i]  # [c] kv-block ids
            keys = k[b, h // group][blocks].reshape(-1, k.shape[-1])  # [c * bk, D]
            vals = v[b, h // group][blocks].reshape(-1, v.shape[-1])
            q_idx = i * bq + jnp.arange(bq)
            k_idx = (blocks[:, None] * bk + jnp.arange(bk)).reshape(-1)
            s = (q[b, h, i].astype(jnp.float32) @ keys.astype(jnp.float32).T) * softmax_scale
            if bias is not None:
                plane = bias[b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0]
                s = s + plane[q_idx][:, k_idx].astype(jnp.float32)
            if logits_soft_cap is not None:
                s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
            per_call = {name: None if x is None else x[b] for name, x in (
                ("q_positions", inputs.q_positions), ("kv_positions", inputs.kv_positions),
                ("q_segment_ids", inputs.q_segment_ids),
                ("kv_segment_ids", inputs.kv_segment_ids))}
            # FULL blocks need no predicate; PARTIAL blocks ask the compiled mask.
            inside = mask.visible(h, q_idx[:, None], k_idx[None, :], **per_call)
            slot_live = jnp.repeat(live[b, h, i], bk)[None, :]
            slot_full = jnp.repeat(full[b, h, i], bk)[None, :]
            vis = slot_live & (slot_full | inside) & (q_idx < q_len)[:, None]
            # A softmax over the visible keys (and the sinks); a row that sees nothing is zeros.
            m = jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1)
            sinks = None if inputs.sinks is None else inputs.sinks[h].astype(jnp.float32)
            if sinks is not None:
                m = jnp.maximum(m, jnp.max(sinks))
            m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
            p = jnp.where(vis, jnp.exp(jnp.where(vis, s - m[:, None], 0.0)), 0.0)
            denom = p.sum(-1)
            if sinks is not None:
                denom = denom + jnp.exp(sinks[None, :] - m[:, None]).sum(-1)
            denom = jnp.where(vis.any(-1), denom, 1.0)
            return (p @ vals.astype(jnp.float32)) / denom[:, None]

        b, h, i = jnp.meshgrid(jnp.arange(batch), jnp.arange(heads), jnp.arange(nq),
                               indexing="ij")
        out = jax.vmap(one_row)(b.reshape(-1), h.reshape(-1), i.reshape(-1))
        out = out.reshape(batch, heads, nq * bq, -1)[:, :, :q_len]
        return out.astype(query.dtype)
