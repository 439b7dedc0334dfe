"""The sharding strategy: how the work spreads over devices."""

import abc
from collections.abc import Callable

import equinox as eqx


class AbstractSharding(eqx.Module):
    """How a kernel call spreads over devices.

    `wrap(fn)` takes the kernel's function ``fn(query, key, value, inputs, mask) -> out``
    (batched ``[B, H, L, D]`` arrays, the `AttentionInputs` and the `CompiledMask`) and returns
    one with the same signature that runs it spread over devices, splitting the compiled mask
    per shard where it splits the sequence. `Unsharded` returns it unchanged.
    """

    @abc.abstractmethod
    def wrap(self, fn: Callable) -> Callable:
        """Return `fn` wrapped to run over devices."""


class Unsharded(AbstractSharding):
    """Run on whatever devices the inputs already live on; no explicit partitioning."""

    def wrap(self, fn: Callable) -> Callable:
        return fn
