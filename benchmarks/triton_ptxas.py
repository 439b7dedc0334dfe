"""Compile `TritonBlockSparse`'s three kernels for a Hopper GPU on a machine without one, and
print what ptxas says of each: registers, spills and shared memory. A check of register
pressure before spending GPU time on a kernel change.

Needs triton 3.6 (its CUDA backend ships ptxas) in an environment beside this project's, as
benchmarks/triton_interpret.py does::

    python benchmarks/triton_ptxas.py --triton-site ../tvenv/lib/python3.11/site-packages \\
        [--mask causal|window] [--score none|alibi|relative] [--length 2048] [--heads 2] \\
        [--dim 128] [--dtype bfloat16]

One call (forward and backward, at the heuristics' tiles for these sizes) is traced as a real
call traces it, with each launch recorded instead of run; each recorded launch is compiled by
Triton for sm_90a, its arrays aligned to 16 bytes as JAX's are, and assembled by its ptxas
with ``-v``. Prints one line per kernel:

    forward_kernel: 255 registers, spills 0 / 0 bytes (stores / loads), shared 65536 bytes

Not a test: the numbers depend on the Triton version.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

#: Triton's pointer type names of the arrays a launch passes.
POINTER_TYPES = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "int32": "*i32",
                 "int16": "*i16", "int8": "*i8"}


def signature(arg_names, dtypes) -> dict:
    """Triton's signature of a kernel whose first ``len(dtypes)`` parameters take arrays of
    those dtypes (the launch's inputs, then its outputs) and whose others are constexprs."""
    if len(dtypes) > len(arg_names):
        raise ValueError(f"{len(dtypes)} arrays for a kernel of {len(arg_names)} parameters")
    sig = {name: POINTER_TYPES[str(dtype)] for name, dtype in zip(arg_names, dtypes)}
    sig.update({name: "constexpr" for name in arg_names[len(dtypes):]})
    return sig


def ptxas_summary(report: str) -> dict:
    """``{"registers", "spill_stores", "spill_loads"}`` from ``ptxas -v``'s report."""
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if registers is None or spills is None:
        raise ValueError(f"no register or spill line in ptxas' report:\n{report}")
    return {"registers": int(registers.group(1)), "spill_stores": int(spills.group(1)),
            "spill_loads": int(spills.group(2))}


def record_launches(args) -> list:
    """``[(kernel, dtypes, num_warps, num_stages, constexprs)]`` of one call's launches."""
    import jax.numpy as jnp

    from eqx_bsattn.strategies.kernels.triton import kernel, launch

    launches = []

    def record(*arrays, kernel, out_shape, grid, num_warps=4, num_stages=3, zeroed_outputs=(),
               **constexprs):
        dtypes = [jnp.dtype(a.dtype) for a in list(arrays) + list(out_shape)]
        launches.append((kernel, dtypes, num_warps, num_stages, constexprs))
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shape)

    patched = [(launch, "triton_call", record), (kernel, "_jax_triton_missing", lambda: None),
               (kernel.TritonBlockSparse, "platforms", ("gpu", "cpu"))]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, value in patched:
        setattr(owner, name, value)
    try:
        trace_one_call(args)
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    return launches


def trace_one_call(args) -> None:
    """Forward and backward of one call of `TritonBlockSparse` at the sizes of `args`."""
    import jax
    import jax.numpy as jnp

    import eqx_bsattn as bsa
    from eqx_bsattn import masks, scores
    from eqx_bsattn.strategies.kernels.triton import kernel

    dtype = jnp.dtype(args.dtype)
    q = jax.random.normal(jax.random.key(0), (1, args.heads, args.length, args.dim), dtype)
    mask = masks.Causal()
    if args.mask == "window":
        mask = mask & masks.SlidingWindow(args.window, 0)
    score = {"none": None,
             "alibi": scores.ALiBi(),
             "relative": scores.RelativePositionBias(
                 jnp.ones((args.heads, args.buckets), jnp.float32), bidirectional=False)
             }[args.score]

    def attend(q):
        attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel.TritonBlockSparse(),
                                        score=score)
        return attn(q, q, q)

    out, pullback = jax.vjp(attend, q)
    pullback(out)


def compile_for_hopper(kernel, dtypes, num_warps, num_stages, constexprs) -> dict:
    """`ptxas_summary` of one launch compiled for sm_90a, plus its shared memory."""
    import triton
    import triton.backends.nvidia
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    sig = signature(kernel.arg_names, dtypes)
    # Every array aligned to 16 bytes, as the launches from JAX tell the compiler.
    aligned = make_backend(target).parse_attr("D")
    source = ASTSource(fn=kernel, signature=sig,
                       constexprs={n: constexprs[n] for n, t in sig.items() if t == "constexpr"},
                       attrs={(i,): aligned for i in range(len(dtypes))})
    compiled = triton.compile(source, target=target,
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    ptxas = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o",
                                 os.path.join(tmp, "kernel.cubin")],
                                capture_output=True, text=True, check=True).stderr
    return ptxas_summary(report) | {"shared": compiled.metadata.shared}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--triton-site", required=True,
                   help="site-packages of an environment with triton 3.6")
    p.add_argument("--mask", default="causal", choices=("causal", "window"))
    p.add_argument("--window", type=int, default=1024, help="the window mask's keys")
    p.add_argument("--score", default="relative", choices=("none", "alibi", "relative"))
    p.add_argument("--buckets", type=int, default=32, help="the relative table's buckets")
    p.add_argument("--length", type=int, default=2048, help="tokens (queries = keys)")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=128, help="head dim")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = p.parse_args(argv)
    sys.path.append(args.triton_site)
    for kernel, dtypes, warps, stages, constexprs in record_launches(args):
        r = compile_for_hopper(kernel, dtypes, warps, stages, constexprs)
        print(f"{kernel.fn.__name__}: {r['registers']} registers, spills {r['spill_stores']} / "
              f"{r['spill_loads']} bytes (stores / loads), shared {r['shared']} bytes")


if __name__ == "__main__":
    main()
