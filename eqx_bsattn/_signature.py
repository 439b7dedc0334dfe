"""Reading a user function's signature once, when a strategy that calls it is made."""

import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp

class Signature(NamedTuple):
    """What a strategy needs of a user function's parameters."""

    required: int  # positional parameters without a default (-1: a keyword-only one we never pass)
    capacity: float  # positional parameters it takes (``inf`` with ``*args``)
    keywords: frozenset  # the optional keywords it takes, of those offered
    named: frozenset  # those of `keywords` its signature names (not through ``**kwargs``)
    names: tuple[str, ...]  # its positional parameters' names
    text: str  # ``name(params)``, for errors


def read_signature(fn, keywords: tuple[str, ...]) -> Signature | None:
    """The `Signature` of `fn` (a callable object's ``__call__`` too), with each name of
    `keywords` taken out of the positional parameters (it is passed by keyword where `fn`
    has it, or ``**kwargs``); ``None`` where Python cannot read it (a builtin)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    required, capacity, names, taken, named = 0, 0.0, [], set(), set()
    for p in sig.parameters.values():
        if p.name in keywords and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            taken.add(p.name)
            named.add(p.name)
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            capacity += 1
            names.append(p.name)
            required += p.default is p.empty
        elif p.kind is p.VAR_POSITIONAL:
            capacity = float("inf")
        elif p.kind is p.VAR_KEYWORD:
            taken.update(keywords)
        elif p.kind is p.KEYWORD_ONLY and p.default is p.empty:
            required = -1
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return Signature(required, capacity, frozenset(taken), frozenset(named), tuple(names),
                     f"{name}{sig}")


def fits(sig: Signature | None, positional: int) -> bool:
    """Whether `fn` takes exactly `positional` positional arguments (and looks like no
    FlexAttention function: no parameters ``b, h`` in a row)."""
    if sig is None:
        return True
    flex = any(sig.names[i:i + 2] == ("b", "h") for i in range(len(sig.names)))
    return not flex and 0 <= sig.required <= positional <= sig.capacity


def check_flex(fn, what: str, names: str, params) -> None:
    """Raise the one-line `TypeError` unless `fn` (the argument `what`) is callable and takes
    FlexAttention's positional arguments `names` (``"b, h, q_idx, kv_idx"``), then ``params``
    where `params` is not ``None``."""
    if not callable(fn):
        raise TypeError(f"`{what}` must be callable; got {type(fn).__name__}.")
    sig = read_signature(fn, ())
    want = names.split(", ") + ([] if params is None else ["params"])
    if sig is not None and not 0 <= sig.required <= len(want) <= sig.capacity:
        raise TypeError(f"`{what}` must take ({', '.join(want)}); got {sig.text}.")


def params_tree(params):
    """`params` with every leaf a jnp array (NumPy arrays and Python numbers converted); a
    one-line `TypeError` names a leaf that is not numeric."""
    def leaf(path, x):
        try:
            y = None if isinstance(x, (str, bytes)) else jnp.asarray(x)
        except (TypeError, ValueError):
            y = None
        if y is None or not (jnp.issubdtype(y.dtype, jnp.number) or y.dtype == bool):
            raise TypeError(f"`params` must be a pytree of arrays; got "
                            f"{type(x).__name__} at {jax.tree_util.keystr(path) or 'the root'}.")
        return y

    return jax.tree_util.tree_map_with_path(leaf, params)
