"""Run-time shape and type checking for the public API.

Checking happens at trace time (jaxtyping + beartype), so it costs nothing inside a compiled
function. Set the environment variable ``EQX_BSATTN_TYPECHECK=0`` before importing
``eqx_bsattn`` to turn it off. The library's own argument checks (`typechecked(validate=...)`)
run first and always: they say in one line which argument is wrong and what is accepted.
"""

import collections.abc
import functools
import inspect
import os
import types
import typing
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from beartype import beartype
from beartype.door import is_bearable
from beartype.roar import BeartypeCallHintParamViolation
from jaxtyping import Array, TypeCheckError, jaxtyped

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
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{fn.__qualname__}: {e}") from None
        bound.apply_defaults()
        finish = validate(bound.arguments)
        try:
            out = checked(*bound.args, **bound.kwargs)
        except (BeartypeCallHintParamViolation, TypeCheckError) as e:
            message = _one_line(signature, bound.arguments)
            if message is None:
                raise
            raise TypeError(message) from e
        return out if finish is None else finish(out)

    return wrapper


def _hint_text(hint) -> str:
    """An annotation in words: ``Float[Array, "q_len dim"] | None`` -> ``a floating array
    [q_len, dim] or None``."""
    if hint is None or hint is type(None):
        return "None"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        words = []
        for arg in typing.get_args(hint):
            text = _hint_text(arg)
            if text not in words:
                words.append(text)
        return " or ".join(words)
    dims = getattr(hint, "dim_str", None)
    if dims is not None:
        kind = getattr(hint.dtype, "__name__", "").lower()
        kind = {"float": "floating", "int": "integer", "integer": "integer", "bool": "boolean",
                "shaped": "", "key": "PRNG key"}.get(kind, kind)
        shape = "scalar" if dims.strip() == "" else f"array [{', '.join(dims.split())}]"
        return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind} {shape}".replace("  ", " ")
    if typing.get_origin(hint) is collections.abc.Callable or hint is Callable:
        return "a callable"
    if typing.get_origin(hint) in (tuple, list):
        return f"a {typing.get_origin(hint).__name__}"
    return getattr(hint, "__name__", str(hint))


def _value_text(x) -> str:
    shape = getattr(x, "shape", None)
    if shape is not None and hasattr(x, "dtype"):
        return f"{type(x).__name__} of shape {tuple(shape)} and dtype {np.dtype(x.dtype).name}"
    return f"{type(x).__name__} {x!r}" if isinstance(x, (int, float, str)) else type(x).__name__


def _one_line(signature: inspect.Signature, arguments: dict) -> str | None:
    """The one-line message for a failed type check: the first argument whose annotation
    refuses its value on its own; ``None`` when none does (the library's own checks have
    compared the arrays' shapes already)."""
    hints = {}
    for name, parameter in signature.parameters.items():
        if parameter.annotation is not inspect.Parameter.empty and name in arguments:
            hints[name] = parameter.annotation
    for name, hint in hints.items():
        try:
            bearable = is_bearable(arguments[name], hint)
        except Exception:  # an annotation beartype cannot test alone
            continue
        if not bearable:
            return f"`{name}` must be {_hint_text(hint)}; got {_value_text(arguments[name])}."
    return None  # shapes that disagree with each other: the checker says which
