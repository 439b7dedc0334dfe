"""Value checks on per-call arrays, shared by the input checks and the score terms."""

import equinox as eqx
import jax
import jax.numpy as jnp


def within(name: str, x, bad, message: str):
    """Raise `ValueError` now if `x` is concrete and `bad(x)` holds anywhere; inside a trace,
    check at run time (`eqx.error_if`: one reduction over the per-call array)."""
    if isinstance(x, jax.core.Tracer):
        return eqx.error_if(x, jnp.any(bad(x)), f"`{name}` {message}")
    with jax.ensure_compile_time_eval():  # a concrete array inside someone's trace, too
        found = bool(jnp.any(bad(x)))
    if found:
        raise ValueError(f"`{name}` {message}")
    return x
