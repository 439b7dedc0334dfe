"""Masks defined by query and key positions: causal, sliding window, chunked causal, prefix-LM."""

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp

from eqx_bsattn.contract import POSITION_LIMIT, AbstractBlockMask, MaskTerms, classify


def _check_int(name: str, value, *, minimum: int, maximum: int | None = POSITION_LIMIT) -> None:
    """A mask size: an int in ``[minimum, maximum]``; by default at most ``2**30``, so that a
    position plus a size stays exact in int32 (`POSITION_LIMIT`)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    if ok and (maximum is None or value <= maximum):
        return

    def show(x):
        return {POSITION_LIMIT: "2**30", -POSITION_LIMIT: "-2**30"}.get(x, str(x))

    accepted = f">= {minimum}" if maximum is None else f"in [{show(minimum)}, {show(maximum)}]"
    raise ValueError(f"`{name}` must be an int {accepted}; got {value!r}.")


class Causal(AbstractBlockMask):
    """Key ``j`` is visible to query ``i`` when ``pos_k[j] <= pos_q[i] + offset``.

    **Arguments:**

    - `offset`: shifts the diagonal right (positive) or left (negative); default 0.
    - `bottom_right`: align the diagonal to the bottom-right corner when ``Lq != Lk``
      (adds ``Lk - Lq`` to `offset`), as for decoding the last queries against a longer cache.

    ```python
    masks.Causal()                       # top-left aligned
    masks.Causal(bottom_right=True)      # the last query sees every key
    ```
    """

    offset: int = eqx.field(default=0, static=True)
    bottom_right: bool = eqx.field(default=False, static=True)

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def __check_init__(self):
        _check_int("Causal.offset", self.offset, minimum=-POSITION_LIMIT)

    def resolve(self, q_len, kv_len):
        if self.bottom_right:
            offset = self.offset + kv_len - q_len
            if abs(offset) > POSITION_LIMIT:
                raise ValueError(
                    f"`Causal.offset` with bottom_right=True becomes offset + kv_len - q_len = "
                    f"{offset}; it must lie in [-2**30, 2**30]."
                )
            return Causal(offset=offset)
        return self

    def elements(self, q, k, head):
        return k.position <= q.position + self.offset

    def blocks(self, q, k, head):
        return classify(
            k.pos_hi <= q.pos_lo + self.offset, k.pos_lo > q.pos_hi + self.offset
        )

    def terms(self, head):
        # Bottom-right alignment needs the lengths: the plan resolves it first.
        return None if self.bottom_right else MaskTerms(causal_offset=self.offset)


class SlidingWindow(AbstractBlockMask):
    """Key visible when ``pos_q - left <= pos_k <= pos_q + right``.

    The convention of `jax.nn.dot_product_attention`'s ``local_window_size``. ``None`` leaves a
    side unbounded. Combine with `Causal` for a causal window: ``Causal() & SlidingWindow(1024)``.

    **Arguments:**

    - `left`: keys at most this far before the query; an int >= 0 or ``None``.
    - `right`: keys at most this far after; defaults to `left` (a symmetric window).

    ```python
    masks.SlidingWindow(256)          # 256 each side
    masks.SlidingWindow(256, 0)       # only the past 256 and the query itself
    ```
    """

    left: int | None = eqx.field(static=True)
    right: int | None = eqx.field(static=True)

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def __init__(self, left: int | None, right: int | None = ...):  # type: ignore[assignment]
        self.left = left
        self.right = left if right is ... else right

    def __check_init__(self):
        for name in ("left", "right"):
            value = getattr(self, name)
            if value is not None:
                _check_int(f"SlidingWindow.{name}", value, minimum=0)
        if self.left is None and self.right is None:
            raise ValueError("SlidingWindow needs `left` or `right`; both are None (use Full()).")

    def elements(self, q, k, head):
        ok = jnp.ones(jnp.broadcast_shapes(q.position.shape, k.position.shape), bool)
        if self.left is not None:
            ok = ok & (k.position >= q.position - self.left)
        if self.right is not None:
            ok = ok & (k.position <= q.position + self.right)
        return ok

    def blocks(self, q, k, head):
        shape = jnp.broadcast_shapes(q.pos_lo.shape, k.pos_lo.shape)
        full = jnp.ones(shape, bool)
        empty = jnp.zeros(shape, bool)
        if self.left is not None:
            full = full & (k.pos_lo >= q.pos_hi - self.left)
            empty = empty | (k.pos_hi < q.pos_lo - self.left)
        if self.right is not None:
            full = full & (k.pos_hi <= q.pos_lo + self.right)
            empty = empty | (k.pos_lo > q.pos_hi + self.right)
        return classify(full, empty)

    def terms(self, head):
        return MaskTerms(window_left=self.left, window_right=self.right)


class ChunkedCausal(AbstractBlockMask):
    """Causal attention inside fixed chunks: ``pos_k <= pos_q`` and ``pos_q // C == pos_k // C``.

    ```python
    masks.ChunkedCausal(1024)
    ```
    """

    chunk_size: int = eqx.field(static=True)

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def __check_init__(self):
        _check_int("chunk_size", self.chunk_size, minimum=1)

    def elements(self, q, k, head):
        c = self.chunk_size
        return (k.position <= q.position) & (k.position // c == q.position // c)

    def blocks(self, q, k, head):
        c = self.chunk_size
        same_chunk = (q.pos_lo // c == q.pos_hi // c) & (k.pos_lo // c == k.pos_hi // c) & (
            q.pos_lo // c == k.pos_lo // c
        )
        full = (k.pos_hi <= q.pos_lo) & same_chunk
        empty = (k.pos_lo > q.pos_hi) | (k.pos_hi // c < q.pos_lo // c) | (
            k.pos_lo // c > q.pos_hi // c
        )
        return classify(full, empty)

    def terms(self, head):
        return MaskTerms(causal_offset=0, chunk=self.chunk_size)


class PrefixLM(AbstractBlockMask):
    """Prefix-LM: every query sees the first `prefix_length` keys, and is causal after them.

    Key visible when ``pos_k < prefix_length`` or ``pos_k <= pos_q``.

    ```python
    masks.PrefixLM(512)
    ```
    """

    prefix_length: int = eqx.field(static=True)

    reads_segment_ids: ClassVar[bool] = False
    varies_by_head: ClassVar[bool] = False

    def __check_init__(self):
        _check_int("prefix_length", self.prefix_length, minimum=0)

    def elements(self, q, k, head):
        return (k.position < self.prefix_length) | (k.position <= q.position)

    def blocks(self, q, k, head):
        p = self.prefix_length
        full = (k.pos_hi < p) | (k.pos_hi <= q.pos_lo)
        empty = (k.pos_lo >= p) & (k.pos_lo > q.pos_hi)
        return classify(full, empty)

    def terms(self, head):
        return MaskTerms(prefix=self.prefix_length)
