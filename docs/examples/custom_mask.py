"""A mask written against the public contract: `SinkTokens`.

The first `num_sinks` keys are visible to every query: the "attention sink" tokens that
streaming attention keeps beside its window. Combined with the built-ins,
``Causal() & (SlidingWindow(256, 0) | SinkTokens(4))`` attends to a local window plus the first
four tokens. `docs/custom_mask.md` walks through it.
"""

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp

from eqx_bsattn.contract import AbstractBlockMask, classify


class SinkTokens(AbstractBlockMask):
    """Key visible when ``pos_k < num_sinks``, for every query.

    ```python
    mask = masks.Causal() & (masks.SlidingWindow(256, 0) | SinkTokens(4))
    ```
    """

    num_sinks: int = eqx.field(static=True)  # static: equal masks trace once

    # It reads no segment ids, and every head sees the same mask.
    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def __check_init__(self):
        if not isinstance(self.num_sinks, int) or self.num_sinks < 0:
            raise ValueError(f"`num_sinks` must be an int >= 0; got {self.num_sinks!r}.")

    def elements(self, q, k, head):
        # Queries arrive as [..., n, 1], keys as [..., 1, m]: answer for every pair.
        shape = jnp.broadcast_shapes(q.position.shape, k.position.shape)
        return jnp.broadcast_to(k.position < self.num_sinks, shape)

    def blocks(self, q, k, head):
        # From the block ranges alone: FULL when the whole key block lies among the sinks,
        # EMPTY when none of it does. (A mask without it subclasses `AbstractMask`, and its
        # layout is built by evaluating `elements` block by block: the same classes, at
        # O(Lq x Lk) cost.)
        shape = jnp.broadcast_shapes(q.pos_lo.shape, k.pos_lo.shape)
        all_visible = jnp.broadcast_to(k.pos_hi < self.num_sinks, shape)
        none_visible = jnp.broadcast_to(k.pos_lo >= self.num_sinks, shape)
        return classify(all_visible, none_visible)
