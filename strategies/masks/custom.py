"""Masks from user code: any predicate of positions, and a different mask per head."""

from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from eqx_bsattn.contract import AbstractBlockMask, AbstractMask


class Predicate(AbstractMask):
    """Any JAX function of query and key positions: ``fn(q_pos, k_pos) -> bool array``.

    `fn` receives broadcastable int32 arrays (queries ``[..., n, 1]``, keys ``[..., 1, m]``)
    and must return their broadcast boolean. It has no `blocks`, so layouts evaluate `fn` one
    q-block at a time (once per trace when no positions are passed), and no `terms`, so GPU
    kernels read element bitmaps. Define `fn` once, not as a fresh lambda per call: the
    function is part of the module's static identity.

    ```python
    def every_other(q, k):
        return (k <= q) & (k % 2 == 0)

    masks.Predicate(every_other)
    ```
    """

    fn: Callable = eqx.field(static=True)

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def __check_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Predicate needs a callable; got {type(self.fn).__name__}.")

    def elements(self, q, k, head):
        out = jnp.asarray(self.fn(q.position, k.position))
        if out.dtype != jnp.bool_:
            raise TypeError(f"Predicate function must return booleans; got dtype {out.dtype}.")
        return jnp.broadcast_to(out, jnp.broadcast_shapes(q.position.shape, k.position.shape))


class PerHead(AbstractBlockMask):
    """A different mask for each query head: head ``h`` uses ``masks[h]``.

    ```python
    masks.PerHead([masks.Causal()] * 4 + [masks.Causal() & masks.SlidingWindow(128)] * 4)
    ```
    """

    masks: tuple[AbstractMask, ...]

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = True

    def __init__(self, masks):
        masks = tuple(masks)
        if not masks:
            raise ValueError("PerHead needs at least one mask.")
        for m in masks:
            if not isinstance(m, AbstractMask):
                raise TypeError(f"PerHead takes masks; got {type(m).__name__}.")
        self.masks = masks

    def children(self):
        return self.masks

    def check(self, q_len, kv_len, num_heads):
        if len(self.masks) != num_heads:
            raise ValueError(
                f"PerHead has {len(self.masks)} masks but the query has {num_heads} heads."
            )
        for m in self.masks:
            m.check(q_len, kv_len, num_heads)

    def resolve(self, q_len, kv_len):
        return PerHead([m.resolve(q_len, kv_len) for m in self.masks])

    def _pick(self, method: str, head, *args):
        if isinstance(head, int):
            return getattr(self.masks[head], method)(*args, head)
        branches = [lambda *a, m=m: getattr(m, method)(*a, head) for m in self.masks]
        return jax.lax.switch(jnp.clip(head, 0, len(self.masks) - 1), branches, *args)

    def elements(self, q, k, head):
        return self._pick("elements", head, q, k)

    def blocks(self, q, k, head):
        return self._pick("blocks", head, q, k)

    def terms(self, head):
        return self.masks[head].terms(head)
