"""Padding shared by the kernels: inputs grow to whole tiles before a launch."""

import jax.numpy as jnp
import numpy as np


def pad_axis(x, axis: int, size: int, value=0):
    """`x` (NumPy or JAX) padded with `value` along `axis` to `size` (unchanged if it is
    already that long)."""
    extra = size - x.shape[axis]
    if extra <= 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.pad(x, pad, constant_values=np.asarray(value, x.dtype))
