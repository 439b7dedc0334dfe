"""Run-time shape and type checking for the public API.

Checking happens at trace time (jaxtyping + beartype), so it costs nothing inside a compiled
function. Set the environment variable ``EQX_BSATTN_TYPECHECK=0`` before importing
``eqx_bsattn`` to turn it off. The library's own argument checks (`typechecked(validate=...)`)
run first and always: they say in one line which argument is wrong and what is accepted.
"""

import functools
import inspect
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


def typechecked(fn: _F | None = None, *, validate: Callable[[dict], Callable | None] | None = None):
    """Decorate `fn` with jaxtyping + beartype checks, unless checking is switched off.

    `validate`, if given, runs before them on the bound arguments (a dict, name -> value, with
    defaults applied): it raises the library's own errors and may replace values in the dict
    (e.g. NumPy arrays by JAX arrays), which `fn` then receives. If it returns a function, that
    function is applied to `fn`'s (checked) result.
    """
    if fn is None:
        return functools.partial(typechecked, validate=validate)
    checked = jaxtyped(typechecker=beartype)(fn) if TYPECHECK_ENABLED else fn
    if validate is None:
        return checked
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        finish = validate(bound.arguments)
        out = checked(*bound.args, **bound.kwargs)
        return out if finish is None else finish(out)

    return wrapper
