"""The sharding strategy: how the work spreads over devices."""

import abc
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from equinox import AbstractClassVar

from ._layout import BlockLayout, _lists_from_classes
from ._strategy import AbstractStrategy


class AbstractSharding(AbstractStrategy):
    """How a kernel call spreads over devices.

    `wrap(fn)` takes the kernel's function
    ``fn(query, key, value, inputs, mask, *, return_lse=False) -> out`` (or ``(out, lse)``
    with `return_lse`; batched ``[B, H, L, D]`` arrays, the `AttentionInputs` and the
    `CompiledMask`) and returns one with the signature ``(query, key, value, inputs, mask) ->
    out`` that runs it spread over devices, splitting the compiled mask per shard.
    `Unsharded` returns it unchanged.

    Every concrete sharding sets five class variables (abstract here):

    - `needs_lse`: the sharding merges partial results by their log-sum-exp, so the selector
      declines every kernel that is not an `AbstractLseKernel`.
    - `passes_positions`: the sharding hands each shard's call its tokens' global positions,
      so the call's `Features.positions` is set and kernels that cannot read per-call
      positions decline.
    - `passes_score`: the sharding hands each shard's call the score terms with their
      unsharded meaning (the rows of the shard's query heads, global head ids and
      positions); a module with a `score` refuses the other shardings.
    - `loops_kernel`: the sharding runs the kernel inside the body of a loop of its own, its
      forward and its backward together (`RingAttention`'s backward recomputes each step's
      forward there), so the call's `Features.in_loop` is set and a kernel that bounds its
      temporaries per step may lower the bound (`XlaConfig.slot_elements`).
    - `keeps_bias_axes`: the sharding splits a bias with size-1 axes as it is (a size-1 axis
      is never split; the bias's gradient keeps its shape and autodiff sums it over the
      devices that share it), so an `AbstractBroadcastBiasKernel` gets the bias ``[bb, hb,
      Lq or 1, Lk or 1]`` under it as unsharded. ``False``: the plan broadcasts the bias to
      ``[bb, hb, Lq, Lk]`` first (`full_bias`), for a sharding that splits only that form.
    """

    needs_lse: AbstractClassVar[bool]
    passes_positions: AbstractClassVar[bool]
    passes_score: AbstractClassVar[bool]
    loops_kernel: AbstractClassVar[bool]
    keeps_bias_axes: AbstractClassVar[bool]

    @abc.abstractmethod
    def wrap(self, fn: Callable) -> Callable:
        """Return `fn` wrapped to run over devices."""

    def fit_tiling(self, tiling, kernel, features):
        """The config each shard's kernel call runs, for an automatic `tiling` (the cache's or
        the kernel's heuristic, already `kernel.adapt_tiling`-ed) of a call with these
        `Features`; a sharding whose shards are shorter than the call shrinks its tiles to
        fit them. A module's own tiling is never changed. Default: `tiling` itself."""
        return tiling

    def kernel_decline(self, kernel, mask, features) -> str | None:
        """Why this sharding cannot run `kernel` on this call even where the kernel accepts
        it (its smallest tiles do not fit the shards), in one line, or ``None``. The selector
        then passes the kernel over, as if it had declined. Default: ``None``."""
        return None


class Unsharded(AbstractSharding):
    """Run on whatever devices the inputs already live on; no explicit partitioning."""

    needs_lse: ClassVar[bool] = False
    passes_positions: ClassVar[bool] = False
    passes_score: ClassVar[bool] = True
    loops_kernel: ClassVar[bool] = False
    keeps_bias_axes: ClassVar[bool] = True

    def wrap(self, fn: Callable) -> Callable:
        return fn


def _explicit_axes(x) -> tuple:
    """``(sharding, names)``: the sharding of `x`'s type and its mesh's Explicit axes, or
    ``(None, set())`` where `x` has no mesh in its type."""
    try:
        sharding = jax.typeof(x).sharding
    except (AttributeError, TypeError):
        return None, set()
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_types", ()):
        return None, set()
    return sharding, {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                      if kind == jax.sharding.AxisType.Explicit}


def _explicit_sharding(x):
    """The `NamedSharding` of `x`'s type when it splits `x` over Explicit mesh axes, else None."""
    sharding, explicit = _explicit_axes(x)
    if not explicit:
        return None
    used = {a for entry in sharding.spec if entry is not None
            for a in ((entry,) if isinstance(entry, str) else entry)}
    return sharding if explicit & used else None


def on_auto_axes(fn: Callable, query, *others) -> Callable:
    """`fn` run with the mesh's Explicit axes made Auto, when an input is split over them.

    Arrays on a mesh with Explicit axes (the default of `jax.make_mesh`) carry their sharding
    in their type, and reshapes, gathers and `vmap`s that would move a split axis are refused
    at trace time. Kernels index blocks freely, so they run on Auto axes, where XLA places the
    work (as it does for arrays on an Auto mesh); the output ``[B, H, Lq, Dv]`` comes back split
    like the query's ``[B, H, Lq]`` axes. Without Explicit axes, `fn` itself.
    """
    found = [s for s in map(_explicit_sharding, (query, *others)) if s is not None]
    if not found:
        return fn
    q_sharding = _explicit_sharding(query)
    spec = () if q_sharding is None else tuple(q_sharding.spec)
    spec = spec + (None,) * (query.ndim - len(spec))
    out_sharding = found[0].update(spec=jax.sharding.PartitionSpec(*spec[:-1], None))
    return jax.sharding.auto_axes(fn, out_sharding=out_sharding)


def _on_explicit_mesh(x) -> bool:
    """Whether `x`'s type places it on a mesh with Explicit axes (split over them or not)."""
    return bool(_explicit_axes(x)[1])


def run_on_auto_axes(fn: Callable, module, query, key, value, data):
    """``fn(module, query, key, value, data)`` under `on_auto_axes`, the module's own arrays
    on a mesh with Explicit axes (learned slopes, a table or params placed on it) taken to
    Auto axes with the inputs: a module closed over inside would keep its arrays' Explicit
    types, which operations under Auto axes refuse."""
    placed, rest = eqx.partition(module, _on_explicit_mesh)

    def call(placed, query, key, value, data):
        return fn(eqx.combine(placed, rest), query, key, value, data)

    wrapped = on_auto_axes(call, query, key, value, *jax.tree.leaves((data, placed)))
    return wrapped(placed, query, key, value, data)


def mesh_in_context(mesh):
    """`mesh`, or the context's abstract mesh where that is `mesh` with other axis types.

    Inside `on_auto_axes` the context mesh has Auto axes where `mesh` (a sharding strategy's)
    has Explicit ones; `jax.shard_map` must be given the context's.
    """
    context = jax.sharding.get_abstract_mesh()
    if (context is None or context.empty or context.axis_names != mesh.axis_names
            or tuple(context.axis_sizes) != tuple(mesh.axis_sizes)):
        return mesh
    return context if tuple(context.axis_types) != tuple(mesh.axis_types) else mesh


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
