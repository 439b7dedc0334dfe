"""The log-sum-exp convention every kernel shares, in one place.

A kernel that returns each row's log-sum-exp (`AbstractLseKernel.attention_with_lse`) gives it in
natural units, ``-inf`` on a row that sees no key. Inside, kernels may keep it in base 2 (the
GPU kernels' softmax runs on ``exp2``) and ``+inf`` on such rows, so that a backward's
``exp(s - lse)`` is 0 there without a test; `public_lse` turns that into the contract's form.
A backward takes the log-sum-exp's cotangent into the row term ``delta`` of
``dS = P (dP - delta)`` (`backward_delta`), since ``d lse_i / d s_ij = P_ij``; so one kernel's
backward can run after another kernel's forward when both hold this convention.

```python
out, lse = kernel.attention_with_lse(q, k, v, ...)          # lse natural, -inf on empty rows
delta = backward_delta(d_out, out, d_lse, lse)               # [B, H, Lq] float32
```
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

#: ``log(2)``: a base-2 log-sum-exp times this is the natural one.
LN2 = math.log(2.0)


def public_lse(lse, *, base2: bool):
    """The contract's log-sum-exp ``[B, H, Lq]`` (natural; ``-inf`` on rows that see no key)
    from a kernel's internal one (base 2 when `base2`; ``+inf`` on those rows)."""
    natural = lse * LN2 if base2 else lse
    return jnp.where(lse == jnp.inf, -jnp.inf, natural)


def backward_delta(d_out, out, d_lse=None, lse=None):
    """The backward's row term ``delta_i = sum_e dO_ie O_ie - dlse_i`` ``[B, H, Lq]``
    (float32) from the output's cotangent `d_out` and the output `out` ``[B, H, Lq, Dv]``, and
    where given the log-sum-exp's cotangent `d_lse` ``[B, H, Lq]``. Rows that see no key (a
    non-finite `lse`, in either convention) take none of `d_lse`: they have no logits."""
    delta = jnp.einsum("bhqe,bhqe->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    if d_lse is None:
        return delta
    return delta - jnp.where(jnp.isfinite(lse), d_lse.astype(jnp.float32), 0.0)


def zero_cotangent(x):
    """The zero cotangent of a `jax.custom_vjp` input that is never differentiated: zeros for
    a floating array, ``float0`` zeros for an integer one (layouts, positions, ids)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)
