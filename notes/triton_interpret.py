"""Run `TritonBlockSparse` on a CPU through Triton's interpreter, for debugging without a GPU.

Setup (a separate environment: torch and triton next to this project's jax):

    python3 -m venv /work/tvenv && /work/tvenv/bin/pip install torch triton==3.6.0 numpy

Then, in the project's environment, import this module before anything else (it sets
``TRITON_INTERPRET=1``, puts that environment's site-packages on ``sys.path``, replaces the
kernel's launcher by a `jax.pure_callback` into the interpreter, and lets the kernel run on CPU):

    import notes.triton_interpret  # or exec it; then call the module as usual

Outputs are poisoned with NaN (integers: -7777) before each launch (except those the kernel
must zero), so unwritten elements show. Known limits of Triton 3.6's interpreter: bfloat16
``tl.dot`` gives wrong values (test with float16 / float32); a scalar ``tl.load`` used as a
loop bound needs its ``__index__`` to accept a one-element array
(``int(np.asarray(self.handle.data).reshape(-1)[0])`` in ``triton/runtime/interpreter.py``).
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.append(os.environ.get("TRITON_SITE", "/work/tvenv/lib/python3.11/site-packages"))

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import eqx_bsattn.strategies.kernels.triton as _triton  # noqa: E402

_TORCH = {np.dtype("float32"): torch.float32, np.dtype("float16"): torch.float16,
          np.dtype(ml_dtypes.bfloat16): torch.bfloat16, np.dtype("int32"): torch.int32,
          np.dtype("int8"): torch.int8}


def _to_torch(a):
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:  # numpy has no bfloat16: move the bits
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _to_numpy(t, dtype):
    if dtype == ml_dtypes.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def launch(*args, kernel, out_shape, grid, num_warps=None, num_stages=None, zeroed_outputs=(),
           **meta):
    """Stand-in for `jax_triton.triton_call` that runs `kernel` in the interpreter."""
    out_shape = tuple(out_shape)

    def host(*arrays):
        inputs = [_to_torch(a) for a in arrays]
        outputs = []
        for i, s in enumerate(out_shape):
            integer = np.issubdtype(np.dtype(s.dtype), np.integer)
            fill = 0 if i in zeroed_outputs else (-7777 if integer else float("nan"))
            outputs.append(torch.full(s.shape, fill, dtype=_TORCH[np.dtype(s.dtype)]))
        kernel[grid](*inputs, *outputs, **meta)
        return tuple(_to_numpy(o, np.dtype(s.dtype)) for o, s in zip(outputs, out_shape))

    return jax.pure_callback(host, out_shape, *args)


_triton._LAUNCH = launch
_triton.TritonBlockSparse.decline_reason = lambda self, mask, features: None
