"""Run `TritonBlockSparse` on the CPU through Triton's interpreter: a debugging aid, not CI.

Needs an environment with torch and triton 3.6 beside this project's, for example::

    python3 -m venv ../tvenv
    ../tvenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    ../tvenv/bin/pip install triton==3.6.0 numpy

Name its site-packages in ``EQX_BSATTN_TRITON_INTERPRET`` and `tests/conftest.py` installs this
file's `install` before the tests import anything else::

    EQX_BSATTN_TRITON_INTERPRET=$(../tvenv/bin/python -c "import site; print(site.getsitepackages()[0])") \
        python -m pytest tests/test_conformance.py -k "triton and not bfloat16"

The launches then go through a `jax.pure_callback` into the interpreter (outputs poisoned with
NaN, integers with -7777, except those the kernel must zero, so unwritten elements show) and
the kernel runs on the CPU as a CPU kernel. Triton 3.6's interpreter computes bfloat16
``tl.dot`` wrongly: test float16 and float32 there.
"""

import os
import sys


def install(site_packages: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.append(site_packages)

    import jax
    import ml_dtypes
    import numpy as np
    import torch
    from triton.runtime import interpreter

    from eqx_bsattn.strategies.kernels.triton import kernel, launch

    torch_dtypes = {np.dtype("float32"): torch.float32, np.dtype("float16"): torch.float16,
                    np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
                    np.dtype("int32"): torch.int32, np.dtype("int8"): torch.int8}

    def to_torch(a):
        a = np.asarray(a)
        if a.dtype == ml_dtypes.bfloat16:  # NumPy has no bfloat16 of its own: move the bits
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(a.copy())

    def to_numpy(t, dtype):
        if dtype == ml_dtypes.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    def interpreted(*args, kernel, out_shape, grid, num_warps=None, num_stages=None,
                    zeroed_outputs=(), **meta):
        out_shape = tuple(out_shape)

        def host(*arrays):
            inputs = [to_torch(a) for a in arrays]
            outputs = []
            for i, s in enumerate(out_shape):
                integer = np.issubdtype(np.dtype(s.dtype), np.integer)
                fill = 0 if i in zeroed_outputs else (-7777 if integer else float("nan"))
                outputs.append(torch.full(s.shape, fill, dtype=torch_dtypes[np.dtype(s.dtype)]))
            kernel[grid](*inputs, *outputs, **meta)
            return tuple(to_numpy(o, np.dtype(s.dtype)) for o, s in zip(outputs, out_shape))

        return jax.pure_callback(host, out_shape, *args)

    # A scalar loaded in the kernel and used as a loop bound arrives as a one-element array,
    # which the interpreter's own `__index__` refuses.
    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_tensor_index

    # The kernels' one inline PTX instruction (`jit_kernels._load_entries`), a float32 load at
    # each address, is run as the interpreter's own load; any other still raises.
    own_inline_asm = interpreter.InterpreterBuilder.create_inline_asm

    class Results:
        def __init__(self, *handles):
            self.handles = handles

        def get_result(self, i):
            return self.handles[i]

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        if asm == "ld.global.nc.f32 $0, [$1];" and constraints == "=r,l" and len(values) == 1:
            return Results(self.create_load(values[0], None, None, False))
        return own_inline_asm(self, asm, constraints, values, types, is_pure, pack)

    interpreter.InterpreterBuilder.create_inline_asm = create_inline_asm

    launch.triton_call = interpreted
    kernel._jax_triton_missing = lambda: None
    kernel.TritonBlockSparse.platforms = ("gpu", "cpu")
