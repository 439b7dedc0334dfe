"""Value checks on per-call arrays, shared by the input checks and the score terms."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def within(name: str, x, bad, message: str):
    """Raise `ValueError` now if `x` is concrete and `bad(x)` holds anywhere; inside a trace,
    check at run time (`eqx.error_if`: one reduction over the per-call array). A NumPy `x`
    is checked on the host (with NumPy where `bad` uses operators only)."""
    if isinstance(x, jax.core.Tracer):
        return eqx.error_if(x, jnp.any(bad(x)), f"`{name}` {message}")
    if isinstance(x, np.ndarray):
        found = bool(np.any(np.asarray(bad(x))))
    else:
        with jax.ensure_compile_time_eval():  # a concrete array inside someone's trace, too
            found = bool(jnp.any(bad(x)))
    if found:
        raise ValueError(f"`{name}` {message}")
    return x


def poisoned(name: str, x, bad, message: str):
    """Raise `ValueError` now if `x` is concrete and `bad(x)` holds anywhere (as `within`);
    inside a trace, `x` with NaN added to every entry where `bad(x)` holds anywhere: no
    run-time conditional (`eqx.error_if` waits on the host for its predicate before the
    kernel can start), and every logit that reads `x`, so every row that sees a key, is NaN,
    its gradients too (a learned array that has gone bad shows in the loss)."""
    if not isinstance(x, jax.core.Tracer):
        return within(name, x, bad, message)
    return x + jnp.where(jnp.any(bad(x)), jnp.nan, 0.0).astype(x.dtype)
