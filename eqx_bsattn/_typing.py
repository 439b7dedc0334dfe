"""Run-time shape and type checking for the public API.

Checking happens at trace time (jaxtyping + beartype), so it costs nothing inside a compiled
function. Set the environment variable ``EQX_BSATTN_TYPECHECK=0`` before importing
``eqx_bsattn`` to turn it off.
"""

import os
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from beartype import beartype
from jaxtyping import Array, jaxtyped

_F = TypeVar("_F", bound=Callable)

#: Per-call data may be a JAX or a NumPy array.
ArrayOrNumpy = Array | np.ndarray

TYPECHECK_ENABLED: bool = os.environ.get("EQX_BSATTN_TYPECHECK", "1").lower() not in (
    "0",
    "false",
    "off",
    "no",
)


def typechecked(fn: _F) -> _F:
    """Decorate `fn` with jaxtyping + beartype checks, unless checking is switched off."""
    if not TYPECHECK_ENABLED:
        return fn
    return jaxtyped(typechecker=beartype)(fn)
