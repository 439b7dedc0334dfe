"""The sharding strategy: how the work spreads over devices."""

import abc
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._layout import BlockLayout, _lists_from_classes


class AbstractSharding(eqx.Module):
    """How a kernel call spreads over devices.

    `wrap(fn)` takes the kernel's function
    ``fn(query, key, value, inputs, mask, *, return_lse=False) -> out`` (or ``(out, lse)``
    with `return_lse`; batched ``[B, H, L, D]`` arrays, the `AttentionInputs` and the
    `CompiledMask`) and returns one with the signature ``(query, key, value, inputs, mask) ->
    out`` that runs it spread over devices, splitting the compiled mask per shard.
    `Unsharded` returns it unchanged.

    `needs_lse` (class variable, default ``False``): the sharding merges partial results by
    their log-sum-exp, so the selector declines kernels that do not return it
    (`AbstractKernel.returns_lse`).

    `passes_positions` (class variable, default ``False``): the sharding hands each shard's
    call its tokens' global positions, so the call's `Features.positions` is set and kernels
    that cannot read per-call positions decline.
    """

    needs_lse: ClassVar[bool] = False
    passes_positions: ClassVar[bool] = False

    @abc.abstractmethod
    def wrap(self, fn: Callable) -> Callable:
        """Return `fn` wrapped to run over devices."""


class Unsharded(AbstractSharding):
    """Run on whatever devices the inputs already live on; no explicit partitioning."""

    def wrap(self, fn: Callable) -> Callable:
        return fn


def typed_like(value, *refs):
    """`value` (a pytree of fresh arrays) typed to vary over every mesh axis `refs` vary over.

    Inside `jax.shard_map` JAX types each value by the mesh axes it varies over; a loop's
    carry must keep its type, and a custom backward must give each input's cotangent that
    input's type. Fresh constants (zeros, ``-inf``) vary over none: adding a zero made from
    each of `refs` (`jnp.zeros_like` keeps the type) gives `value` theirs. Outside
    `shard_map` it adds zeros, which XLA folds away.

    ```python
    carry = typed_like((jnp.zeros(shape), jnp.full(shape, -jnp.inf)), q, k, v)
    ```
    """
    leaves = [x for x in jax.tree.leaves(refs) if x is not None]
    zero = sum(jnp.zeros_like(x, dtype=jnp.float32, shape=()) for x in leaves)
    return jax.tree.map(lambda c: c + jnp.asarray(zero).astype(c.dtype), value)


def layout_from_classes(classes, *, q_len: int, kv_len: int, block_q: int, block_kv: int,
                        is_static: bool) -> BlockLayout:
    """The `BlockLayout` whose block matrix is `classes` (``[..., nq, nk]`` int8).

    For a sharding that cuts a layout into the blocks one device sees: a NumPy `classes`
    gives exact capacities (the largest count over every leading index, so the lists of
    several shards stack); a traced one gives capacities of every block. Leading axes are
    kept as they are (a `BlockLayout` proper has two, ``[mb, mh]``). No bitmaps.
    """
    lists = _lists_from_classes(classes, exact=isinstance(classes, np.ndarray))
    arrays = (classes, *lists)
    return BlockLayout(*map(jnp.asarray, arrays), None, None, None, q_len=q_len, kv_len=kv_len,
                       block_q=block_q, block_kv=block_kv, is_static=is_static)
