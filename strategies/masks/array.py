"""A mask given as a boolean array: any pattern, at the cost of reading ``Lq x Lk`` per call."""

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool

from eqx_bsattn.contract import AbstractBlockMask, classify


class ArrayMask(AbstractBlockMask):
    """An explicit element mask: query ``i`` sees key ``j`` of head ``h`` where
    ``mask[h, i, j]`` is True.

    The array is per-call data, like segment ids: it is a leaf of the module (traced under
    `jit`, so a new array never recompiles), and block layouts are built from it on the device,
    one any/all reduction per block. It reads token indices, not positions. It has no
    in-kernel terms, so it runs on kernels that evaluate the element predicate (`DenseReference`,
    `XlaBlockSparse`) or read a per-call element map of it (`MosaicBlockSparse`,
    `PallasTpuBlockSparse`); kernels that need static element bitmaps decline it.

    It is also the way to mask under a soft cap: with ``logits_soft_cap=c`` a ``-inf`` bias
    becomes ``-c`` after the cap and no longer hides the key; a mask hides it.

    Holding an array, it is a pytree node, not a leaf: in a model being trained, swap to or
    from it with `bsa.swap_strategy(where, model, mask, opt_state)`, which carries the
    optimizer state over; after `eqx.tree_at` alone, optax's next ``update`` fails with a
    pytree-structure error ("different types at key path ...").

    **Arguments:**

    - `mask`: ``[Lq, Lk]`` or ``[H or 1, Lq, Lk]`` booleans (array-like; integers count as True
      where nonzero). For a different mask per batch element, `jax.vmap` the call over the batch
      (`blocksparse_attention(attention_mask=...)` does that for you).

    ```python
    keep = jax.random.bernoulli(jax.random.key(0), 0.3, (1024, 1024))
    attn = BlockSparseAttention(mask=masks.Causal() & masks.ArrayMask(keep))
    ```
    """

    mask: Bool[Array, "heads_or_1 q_len kv_len"]

    reads_segment_ids: ClassVar[bool] = False

    def __init__(self, mask):
        if not isinstance(mask, jax.Array):
            # NumPy first, compared with 0 on the host: `jnp.asarray` would narrow int64 to
            # int32 (without x64, 2**32 becomes 0 and a visible pair hidden).
            try:
                mask = np.asarray(mask)
            except (TypeError, ValueError, OverflowError):
                raise TypeError(
                    f"`mask` must be a boolean array [Lq, Lk] or [H or 1, Lq, Lk]; got "
                    f"{type(mask).__name__}."
                ) from None
        if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.integer):
            raise TypeError(
                f"`mask` must hold booleans (or integers, nonzero = visible); got dtype "
                f"{np.dtype(mask.dtype).name}."
            )
        if mask.ndim == 2:
            mask = mask[None]
        if mask.ndim != 3 or 0 in mask.shape:
            raise ValueError(
                f"`mask` must have shape [Lq, Lk] or [H or 1, Lq, Lk]; got {tuple(mask.shape)}."
            )
        self.mask = jnp.asarray(mask if mask.dtype == np.bool_ else mask != 0)

    def __hash__(self):
        # `jax.jit(attn)` hashes the module it is given; an array has no hash. Its static part
        # (the array partitioned out, as `eqx.filter_jit` and the kernels' caches see it) does.
        if isinstance(self.mask, jax.Array | np.ndarray):
            raise TypeError(
                "a module holding an ArrayMask cannot be hashed, so `jax.jit(attn)` cannot take "
                "it: use `eqx.filter_jit(attn)`, or `eqx.filter_jit` of a function that takes "
                "the module as an argument."
            )
        return hash((type(self), self.mask))

    @property
    def varies_by_head(self) -> bool:
        """Whether the array has a mask per head (its first axis is longer than 1)."""
        return self._array().shape[0] > 1

    def check(self, q_len, kv_len, num_heads):
        heads, rows, cols = self._array().shape
        if (rows, cols) != (q_len, kv_len) or heads not in (1, num_heads):
            raise ValueError(
                f"ArrayMask has shape {tuple(self.mask.shape)}; this call needs "
                f"[1 or {num_heads}, {q_len}, {kv_len}] (heads, q_len, kv_len)."
            )

    def _array(self) -> Bool[Array, "heads_or_1 q_len kv_len"]:
        """The array as booleans ``[H or 1, Lq, Lk]``, read this way everywhere.

        `eqx.tree_at` (and `swap_strategy`) can put any array in `mask` without `__init__`:
        integers would meet the bitwise ``&``, ``|``, ``~`` of combined masks as integers (2
        & True is 0), so they count where nonzero here too; floats and other ranks are refused.
        A sharding may hand the array over as a NumPy constant: it is read as a JAX array (the
        indices into it are traced).
        """
        mask = self.mask
        dtype = getattr(mask, "dtype", None)
        shape = tuple(getattr(mask, "shape", ()))
        if dtype is None or (dtype != jnp.bool_ and not jnp.issubdtype(dtype, jnp.integer)):
            given = (f"dtype {jnp.dtype(dtype).name}" if dtype is not None
                     else type(mask).__name__)
            raise TypeError(
                f"`ArrayMask.mask` must hold booleans (or integers, nonzero = visible); got "
                f"{given}: swap in `masks.ArrayMask(array)` (with `eqx.tree_at` or "
                "`swap_strategy`), which checks it, rather than a bare array."
            )
        if len(shape) != 3:
            raise ValueError(
                f"`ArrayMask.mask` must have shape [H or 1, Lq, Lk]; got {shape}: swap in "
                "`masks.ArrayMask(array)` (with `eqx.tree_at` or `swap_strategy`), which "
                "takes [Lq, Lk] too, rather than a bare array."
            )
        mask = jnp.asarray(mask)
        return mask if mask.dtype == jnp.bool_ else mask != 0

    def _table(self, head):
        mask = self._array()
        return mask[0] if mask.shape[0] == 1 else mask[head]

    def elements(self, q, k, head):
        table = self._table(head)
        rows, cols = table.shape
        return table[jnp.clip(q.index, 0, rows - 1), jnp.clip(k.index, 0, cols - 1)]

    def blocks(self, q, k, head):
        # One any/all per tile of the (block_q x block_kv) grid the layout is built on, then
        # the tiles of the blocks asked for (a layout may ask for some rows at a time).
        table = self._table(head)
        bq, bk = q.block_size, k.block_size
        nq, nk = math.ceil(q.length / bq), math.ceil(k.length / bk)
        pad = ((0, nq * bq - table.shape[0]), (0, nk * bk - table.shape[1]))
        tiles = (nq, bq, nk, bk)
        any_visible = jnp.pad(table, pad, constant_values=False).reshape(tiles).any((1, 3))
        all_visible = jnp.pad(table, pad, constant_values=True).reshape(tiles).all((1, 3))
        rows, cols = q.index_lo // bq, k.index_lo // bk
        return classify(all_visible[rows, cols], ~any_visible[rows, cols])
