"""`PallasTpuBlockSparse` at long sequences on a TPU, causal: (a) what the first
``jax.jit(jax.grad(loss))`` call costs at B=1, H=16, L=8192, D=128 bfloat16 (target: under
10 s), whole and split into trace+lower / compile / first run; (b) forward+backward at B=1,
H=8, L = 16k, 32k, 64k, 128k: whether it fits, the compiled program's memory
(`memory_analysis()`: arguments, outputs, temporaries) and the device's peak bytes in use
(`memory_stats()`, where the backend keeps them), and the run's time; a table each. The split
of (a) is a second fresh function's, so what the first call left in the library's caches (the
mask's layouts) is not in it; the whole call's time is the cold one.

    python benchmarks/tpu_long.py           # on a TPU (see benchmarks/tpu_run.sh's header)
    python benchmarks/tpu_long.py --length 256 --heads 2 --dim 32 --long-lengths 256 512 \\
        --long-heads 1                      # the same code on a CPU, interpreted

Off a TPU the kernel runs in Pallas' interpret mode (as its tests do on the CPU): slow, so
pass small sizes. The loss is ``sum(out * cotangent)`` in float32; the gradients are of q, k
and v. No persistent compilation cache is turned on, so (a) is a cold compile.
"""

import argparse
import time

import jax
import jax.numpy as jnp

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks

MIB = 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=8192, help="(a): tokens")
    p.add_argument("--heads", type=int, default=16, help="(a): heads")
    p.add_argument("--batch", type=int, default=1, help="(a) and (b): batch")
    p.add_argument("--dim", type=int, default=128, help="(a) and (b): head dim")
    p.add_argument("--long-lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072],
                   help="(b): tokens, in this order")
    p.add_argument("--long-heads", type=int, default=8, help="(b): heads")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--skip-first-call", action="store_true", help="skip (a)")
    p.add_argument("--skip-long", action="store_true", help="skip (b)")
    return p.parse_args(argv)


def inputs(batch: int, heads: int, length: int, dim: int, dtype):
    """q, k, v and the output's cotangent, ``[B, H, L, D]``, random."""
    keys = jax.random.split(jax.random.key(length), 4)
    return tuple(jax.random.normal(kk, (batch, heads, length, dim), dtype) for kk in keys)


def grad_fn():
    """A new ``grad(loss)`` of (q, k, v, cotangent) each call (no tracing cache is shared)."""
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.PallasTpuBlockSparse())

    def loss(q, k, v, cot):
        return jnp.sum(attn(q, k, v).astype(jnp.float32) * cot.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


def _wall(fn):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def first_call(args) -> None:
    """(a): a fresh ``jit(grad)``'s first call, then another fresh one split in parts."""
    xs = jax.block_until_ready(inputs(args.batch, args.heads, args.length, args.dim,
                                      jnp.dtype(args.dtype)))
    _, whole = _wall(lambda: jax.jit(grad_fn())(*xs))
    jitted = jax.jit(grad_fn())
    lowered, lower = _wall(lambda: jitted.lower(*xs))
    compiled, compile_s = _wall(lambda: lowered.compile())
    _, run = _wall(lambda: compiled(*xs))
    _, again = _wall(lambda: compiled(*xs))
    print(f"\n(a) first jit(grad(loss)) call, B={args.batch} H={args.heads} L={args.length} "
          f"D={args.dim} {args.dtype}, causal, {jax.devices()[0].device_kind}\n")
    print("| first call, whole | trace + lower | compile | first run | second run | under 10 s |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| {whole:.2f} s | {lower:.2f} s | {compile_s:.2f} s | {run:.3f} s | {again:.3f} s | "
          f"{'yes' if whole < 10 else 'no'} |", flush=True)


def _peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def long_row(args, length: int) -> dict:
    """(b) at one length: compile, memory analysis, one run, the device's peak."""
    row = {"length": length}
    try:
        xs = jax.block_until_ready(inputs(args.batch, args.long_heads, length, args.dim,
                                          jnp.dtype(args.dtype)))
        compiled, row["compile_s"] = _wall(lambda: jax.jit(grad_fn()).lower(*xs).compile())
        analysis = compiled.memory_analysis()
        if analysis is not None:
            for name in ("argument", "output", "temp"):
                row[name] = getattr(analysis, f"{name}_size_in_bytes", None)
        _, row["first_s"] = _wall(lambda: compiled(*xs))
        _, row["run_s"] = _wall(lambda: compiled(*xs))
        row["fits"] = "yes"
    except Exception as e:  # noqa: BLE001 - a length that does not fit is a row
        row["fits"] = f"no: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    row["peak"] = _peak_bytes()
    return row


def _mib(x) -> str:
    return "-" if x is None else f"{x / MIB:.1f}"


def long_table(args) -> None:
    print(f"\n(b) forward+backward, B={args.batch} H={args.long_heads} D={args.dim} "
          f"{args.dtype}, causal, {jax.devices()[0].device_kind}; MiB (peak: the device's "
          "peak bytes in use so far, rising lengths)\n")
    print("| L | fits | arguments | outputs | temporaries | peak | compile s | run s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for length in args.long_lengths:
        r = long_row(args, length)
        run = f"{r['run_s']:.3f}" if "run_s" in r else "-"
        compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
        print(f"| {length} | {r['fits']} | {_mib(r.get('argument'))} | {_mib(r.get('output'))} "
              f"| {_mib(r.get('temp'))} | {_mib(r['peak'])} | {compile_s} | {run} |", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    print(jax.__version__, jax.devices(), flush=True)
    if not args.skip_first_call:
        first_call(args)
    if not args.skip_long:
        long_table(args)


if __name__ == "__main__":
    main()
