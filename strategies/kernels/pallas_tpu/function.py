"""A score function's arrays inside the TPU kernels: their layout and the plan's decline.

The interpreter is the core's (`eqx_bsattn.contract.function_data`, `evaluate_function`): the
function is traced once per tile shape into a jaxpr whose constants are the arrays it reads,
and evaluated in the kernel with each read of an array at scalar indices turned into a
scalar load. Here: each array goes whole into scalar memory (32-bit, flattened: `stored`),
read back in its own dtype (`value`). Mosaic TPU gathers from neither a vector nor scalar
memory by a traced index on a vector value, so a function that uses an array otherwise (a
gather by the positions, a product with the whole array) is declined at plan time
(`decline`). A mask's element predicate that reads arrays at scalar indices (a
user predicate's per-head widths) runs the same way on the tiles (`mask_data`).

Gradients: where such an array is traced (the caller differentiates with respect to it), each
dq program sums, over its tiles, the cotangent of every scalar it read (`jax.vjp` of the
function in those scalars) into its own float32 block ``[rows(leaf), 128]`` at the element's
place; the blocks are added up after the launch in a fixed order (no atomics:
deterministic).
"""

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from eqx_bsattn.contract import (DataLeaf, MaskData, ScoreParams, array_read_decline,
                                  function_data, mask_data as shared_mask_data,
                                  reads_traced as reads_traced_on)

from .config import LANES, SUBLANES

#: The most elements of the arrays a function reads (scalar memory, and a gradient block per
#: dq program of at most this many float32 elements).
DATA_LIMIT = 8192
#: The tile the plan traces a function on.
_TILE = (SUBLANES, LANES)


def stored_dtype(leaf: DataLeaf):
    """A leaf's dtype in scalar memory: float32, or int32 (integers and booleans)."""
    return jnp.float32 if jnp.issubdtype(leaf.dtype, jnp.floating) else jnp.int32


def rows(leaf: DataLeaf) -> int:
    """Rows of a leaf's gradient block ``[rows, 128]``: element ``e`` at ``(e // 128, e %
    128)``, whole sublanes."""
    n = max(-(-leaf.size // LANES), 1)
    return -(-n // SUBLANES) * SUBLANES


def value(leaf: DataLeaf, x):
    """A scalar read from scalar memory (`stored_dtype`) in the leaf's own dtype."""
    return x != 0 if leaf.dtype == jnp.bool_ else x.astype(leaf.dtype)


def stored(x, leaf: DataLeaf):
    """An array as scalar memory holds it: flattened, 32-bit."""
    return jnp.ravel(jnp.asarray(x)).astype(stored_dtype(leaf))


def reads_traced(function: Callable) -> bool:
    """Whether the score function's kernel part reads a float array that is traced (whose
    gradient the kernels would form): traced on a small tile, where the call is planned."""
    return reads_traced_on(function, _TILE)


def decline(function, params: ScoreParams | None = None) -> str | None:
    """Why the kernels cannot evaluate the score function `function` (a `ScoreTerm`) with
    the arrays it reads (those it closes over and the leaves of its `params`, known at plan
    time by their shapes: `ScoreParams`), or ``None``: each must be 32-bit (or bool), all of
    them at most `DATA_LIMIT` elements, each read only at scalar indices. Traced once on a
    small tile (on abstract stand-ins of the params: nothing is allocated); cached per
    function and params' shapes. A function that does not trace is left to the kernel's call
    (which raises the function's own error)."""
    if isinstance(params, bool):  # a `Features` built by hand with the flag it once had
        params = None if not params else _FLAG
    if params is _FLAG:
        return ("the call's Features give the score function's params as a flag, not their "
                "shapes: pass score_params=ScoreParams.of(params).")
    return _decline(function, params)


_FLAG = object()


@functools.lru_cache(maxsize=256)
def _decline(function, params: ScoreParams | None) -> str | None:
    if params is None:
        return _decline_with(function, None)
    found = []

    def run(tree):  # the params as tracers: abstract, and marked traced (`DataLeaf.diff`)
        found.append(_decline_with(function, tree))
        return jnp.zeros(())

    try:
        jax.eval_shape(run, params.tree)
    except Exception:  # noqa: BLE001 - the call raises it where it runs
        return None
    return found[0] if found else None


def _decline_with(function, params) -> str | None:
    try:
        data = function_data(function, [_TILE], params)
    except Exception:  # noqa: BLE001 - the call raises it where it runs
        return None
    return array_read_decline(data, "the TPU kernels", DATA_LIMIT, ", in scalar memory")


def mask_data(predicate, shapes, segment_ids: bool, first_slot: int = 0,
              room: int = DATA_LIMIT) -> MaskData | None:
    """The element predicate of `predicate` traced on int32 tiles of each shape of `shapes`,
    its arrays as data slots `first_slot`, ... (`eqx_bsattn.contract.mask_data`), at most
    `room` elements in all (default: what scalar memory holds, `DATA_LIMIT`); ``None``: the
    kernels read an element map."""
    return shared_mask_data(predicate, shapes, segment_ids, first_slot, room)
