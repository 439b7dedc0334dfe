"""CPU benchmark of `XlaBlockSparse` against dense XLA attention, and its memory growth with L.

Measures, for B=1, H=4, D=64, float32 and the mask ``Causal() & SlidingWindow(256, 0)``:

- time (median of several runs after a warm-up) of the forward and of forward+backward, for
  `jax.nn.dot_product_attention(..., mask=<dense bool mask>, implementation="xla")` and for
  `XlaBlockSparse`, at one length, both in one worker process;
- peak memory of forward+backward of `XlaBlockSparse` at several lengths, each in a fresh
  process: ``ru_maxrss`` of the process, and the bytes XLA plans for the compiled function
  (``memory_analysis()``: temporaries + outputs), which excludes the interpreter and the
  compiler.

Run from the repository root::

    python benchmarks/xla_cpu.py                         # table on stdout, JSON file
    python benchmarks/xla_cpu.py --lengths 8192 16384 32768 --json benchmarks/xla_cpu.json

Not a test: numbers depend on the machine and its load.
"""

import argparse
import json
import os
import resource
import subprocess
import sys

BATCH, HEADS, DIM, WINDOW = 1, 4, 64, 256


def _inputs(length: int, layout: str):
    import jax

    shape = (BATCH, HEADS, length, DIM) if layout == "bhld" else (BATCH, length, HEADS, DIM)
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, shape, jax.numpy.float32) for k in keys]


def _dense_functions(length: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    i = np.arange(length)
    visible = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - WINDOW)
    mask = jnp.asarray(visible[None, None])

    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")

    return forward


def _xla_functions(length: int):
    import eqx_bsattn as bsa
    from eqx_bsattn import kernels, masks

    attn = bsa.BlockSparseAttention(
        mask=masks.Causal() & masks.SlidingWindow(WINDOW, 0), kernel=kernels.XlaBlockSparse()
    )

    def forward(q, k, v):
        return attn(q, k, v)

    return forward


def _compiled(forward, args):
    """Jitted forward and forward+backward (gradient of q, k, v), compiled for `args`."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v):
        return jnp.sum(forward(q, k, v) ** 2)

    fwd = jax.jit(forward).lower(*args).compile()
    both = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return fwd, both


def _median_seconds(fn, args, runs: int) -> float:
    from eqx_bsattn.bench import median_ms

    return median_ms(fn, args, runs) / 1e3


def _planned_bytes(compiled) -> int | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def worker_time(length: int, runs: int, dense_runs: int) -> dict:
    out = {"length": length}
    for name, make, layout, n in (
        ("dense", _dense_functions, "blhd", dense_runs),
        ("xla", _xla_functions, "bhld", runs),
    ):
        args = _inputs(length, layout)
        fwd, both = _compiled(make(length), args)
        out[f"{name}_fwd_s"] = _median_seconds(fwd, args, n)
        out[f"{name}_fwd_bwd_s"] = _median_seconds(both, args, n)
    return out


def worker_memory(length: int, impl: str) -> dict:
    import jax

    make, layout = (_xla_functions, "bhld") if impl == "xla" else (_dense_functions, "blhd")
    args = _inputs(length, layout)
    jax.block_until_ready(args)
    before = _maxrss_bytes()
    _, both = _compiled(make(length), args)
    compiled_rss = _maxrss_bytes()
    jax.block_until_ready(both(*args))
    return {
        "impl": impl,
        "length": length,
        "planned_bytes": _planned_bytes(both),
        "rss_before_compile_bytes": before,
        "rss_after_compile_bytes": compiled_rss,
        "peak_rss_bytes": _maxrss_bytes(),
    }


def _spawn(*argv: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", *argv]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--time-length", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--dense-runs", type=int, default=3)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "xla_cpu.json"))
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        kind, *rest = args.worker
        if kind == "time":
            result = worker_time(int(rest[0]), int(rest[1]), int(rest[2]))
        else:
            result = worker_memory(int(rest[0]), rest[1])
        print(json.dumps(result))
        return

    import jax

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs; "
          f"B={BATCH} H={HEADS} D={DIM} float32, mask Causal() & SlidingWindow({WINDOW}, 0)")
    timing = _spawn("time", str(args.time_length), str(args.runs), str(args.dense_runs))
    memory = [_spawn("memory", str(n), "xla") for n in args.lengths]
    dense_memory = _spawn("memory", str(args.time_length), "dense")

    speed_fwd = timing["dense_fwd_s"] / timing["xla_fwd_s"]
    speed_both = timing["dense_fwd_bwd_s"] / timing["xla_fwd_bwd_s"]
    print(f"\nTime at L={args.time_length} (median; dense: {args.dense_runs} runs, "
          f"xla: {args.runs} runs)")
    print(f"{'':24}{'forward':>12}{'fwd+bwd':>12}")
    print(f"{'dense XLA (s)':24}{timing['dense_fwd_s']:>12.4f}{timing['dense_fwd_bwd_s']:>12.4f}")
    print(f"{'XlaBlockSparse (s)':24}{timing['xla_fwd_s']:>12.4f}{timing['xla_fwd_bwd_s']:>12.4f}")
    print(f"{'speedup':24}{speed_fwd:>11.1f}x{speed_both:>11.1f}x")

    print("\nPeak memory of forward+backward, one process per row (MiB)")
    print(f"{'impl':8}{'L':>8}{'XLA planned':>14}{'RSS before':>12}{'RSS compiled':>14}"
          f"{'RSS peak':>10}{'peak - before':>15}")
    for row in memory + [dense_memory]:
        print(f"{row['impl']:8}{row['length']:>8}{_mib(row['planned_bytes']):>14}"
              f"{_mib(row['rss_before_compile_bytes']):>12}"
              f"{_mib(row['rss_after_compile_bytes']):>14}{_mib(row['peak_rss_bytes']):>10}"
              f"{_mib(row['peak_rss_bytes'] - row['rss_before_compile_bytes']):>15}")
    if len(memory) > 1 and all(r["planned_bytes"] for r in memory):
        base = memory[0]

        def used(row):
            return row["peak_rss_bytes"] - row["rss_before_compile_bytes"]

        print(f"\nGrowth relative to L={base['length']}:")
        for r in memory[1:]:
            print(f"  L={r['length']}: length x{r['length'] / base['length']:.0f}, XLA planned "
                  f"x{r['planned_bytes'] / base['planned_bytes']:.2f}, "
                  f"RSS peak - before x{used(r) / used(base):.2f}")

    result = {
        "config": {"batch": BATCH, "heads": HEADS, "dim": DIM, "window": WINDOW,
                   "dtype": "float32", "jax": jax.__version__, "cpus": os.cpu_count()},
        "timing": {**timing, "speedup_fwd": speed_fwd, "speedup_fwd_bwd": speed_both},
        "memory": memory + [dense_memory],
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
