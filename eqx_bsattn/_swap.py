"""Swapping strategies: the "choose automatically" defaults and `swap_strategy` for training."""

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax

from ._strategy import AbstractStrategy
from ._tiling import AutoTiling


class AutoKernel(AbstractStrategy):
    """The default `kernel` of `BlockSparseAttention`: let `select_kernel` pick one per call.

    A strategy object rather than ``None``, so ``eqx.tree_at(lambda m: m.kernel, attn, k)``
    needs no ``is_leaf``. ``BlockSparseAttention(kernel=None)`` still works and means this.
    """


def _kernel_or_auto(kernel):
    return AutoKernel() if kernel is None else kernel


def _tiling_or_auto(tiling):
    return AutoTiling() if tiling is None else tiling


def is_auto(strategy) -> bool:
    """Whether a `kernel` or `tiling` field asks for the automatic choice (``None`` included:
    `eqx.tree_at` can still put ``None`` there)."""
    return strategy is None or isinstance(strategy, (AutoKernel, AutoTiling))


Model = TypeVar("Model")
State = TypeVar("State")


def _structure(tree):
    # None counts as a leaf: a filtered copy of a model (`eqx.filter(model, eqx.is_array)`) has
    # None where the model has a non-array leaf, and the same nodes everywhere else.
    return jax.tree_util.tree_structure(tree, is_leaf=lambda x: x is None)


def _trainable_paths(tree) -> list[str]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [jax.tree_util.keystr(path) for path, leaf in leaves if eqx.is_inexact_array(leaf)]


def swap_strategy(
    where: Callable[[Model], Any], model: Model, replacement: Any, opt_state: State
) -> tuple[Model, State]:
    """Swap a strategy in the middle of training, keeping the optimizer state.

    Kernels, tilings, shardings and masks that hold no arrays are leaves of the model that are
    not arrays: an optimizer state holds ``None`` there, so `eqx.tree_at` alone swaps them and
    the state stays valid. A mask that holds arrays (`masks.ArrayMask`, or a combination with
    one) is a pytree node: swapping it in or out changes the model's structure, not its
    parameters, and an optimizer state built from the model (for example
    ``optim.init(eqx.filter(model, eqx.is_inexact_array))``) holds copies of that structure
    (Adam's moments, say), so after an `eqx.tree_at` alone the next ``optim.update`` fails
    with "different types at key path ...". This swaps the strategy in the model and in
    every copy of the model's structure inside `opt_state` (with ``None`` at the new mask's
    arrays, which are not trained); the parameters and the moments are untouched. It takes
    any strategy, so one call works for all of them.

    **Arguments:**

    - `where`: as in `eqx.tree_at`: a function from the model to the node(s) to replace, e.g.
      ``lambda m: m.attention.attention.kernel`` (the kernel of a
      `MultiheadBlockSparseAttention` held in the model's field `attention`); it may return a
      tuple of nodes.
    - `model`: the model being trained.
    - `replacement`: the new strategy (a tuple of them when `where` returns a tuple).
    - `opt_state`: the optimizer state, built from the model or a filtered copy of it that
      keeps only floating-point arrays (``eqx.is_inexact_array``, equinox's usual filter).

    **Returns:** ``(new_model, new_opt_state)``.

    **Raises:** `ValueError` if the replaced node or its replacement holds arrays of floating
    point (parameters): their optimizer state could not be carried over.

    ```python
    model, opt_state = bsa.swap_strategy(
        lambda m: m.attention.attention.mask, model,
        bsa.masks.Causal() & bsa.masks.ArrayMask(keep), opt_state)
    ```
    """
    old = where(model)
    for name, tree in (("the node `where` picks", old), ("`replacement`", replacement)):
        paths = _trainable_paths(tree)
        if paths:
            raise ValueError(
                f"swap_strategy carries the optimizer state over only when the swap changes no "
                f"parameters, but {name} holds arrays of floating point (parameters) at "
                f"{', '.join(paths)}; use `eqx.tree_at` and re-initialise the optimizer instead."
            )
    new_model = eqx.tree_at(where, model, replacement)
    model_type = type(model)
    model_structure = _structure(model)
    # In the state's copies, the replacement carries None where it has leaves (no parameters).
    replacement_in_state = jax.tree.map(lambda _: None, replacement)

    def is_model_copy(node) -> bool:
        return type(node) is model_type and _structure(node) == model_structure

    def swap_copy(node):
        if is_model_copy(node):
            return eqx.tree_at(where, node, replacement_in_state, is_leaf=lambda x: x is None)
        return node

    new_state = jax.tree.map(swap_copy, opt_state, is_leaf=is_model_copy)
    return new_model, new_state
