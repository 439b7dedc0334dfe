"""What the persistent compilation cache saves: the first ``jit(grad)`` call of a fresh process,
twice per kernel with one cache folder (the first process fills it, the second reads it).

For each kernel (causal; default B=2, H=16, L=4096, D=128, bfloat16) it prints, per process,
the seconds of each stage of the first call (trace, lower, compile, first run), JAX's cache
hits and misses while compiling, the Triton kernels' disk-cache hits, and the files in the
folder before and after. `cudnn` is `jax.nn.dot_product_attention(implementation="cudnn")` in
its own ``[B, L, H, D]`` layout, for comparison. With ``$OUT`` set it writes
``$OUT/compile_cache_gpu.json``.

```
python benchmarks/compile_cache_gpu.py                       # mosaic, triton, cudnn on a GPU
python benchmarks/compile_cache_gpu.py --kernels xla --batch 1 --heads 2 --length 256 \
    --dim 32 --dtype float32                                 # the same on a CPU, small
```
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

#: One process: the first call, stage by stage. Prints one JSON line prefixed ``RESULT``.
CHILD = r"""
import json, sys, time
start = time.perf_counter()
import jax, jax.numpy as jnp
args = json.loads(sys.argv[1])
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
import eqx_bsattn as bsa
from eqx_bsattn import _compile_cache
bsa.enable_compilation_cache(args["cache"])
imported = time.perf_counter() - start
shape = (args["batch"], args["heads"], args["length"], args["dim"])
dtype = jnp.dtype(args["dtype"])
q, k, v = (jax.random.normal(jax.random.key(i), shape, dtype) for i in range(3))
kernel = args["kernel"]
if kernel == "cudnn":
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # its own layout
    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
else:
    if kernel == "mosaic":
        from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse as make
    elif kernel == "triton":
        from eqx_bsattn.strategies.kernels import TritonBlockSparse as make
    else:
        from eqx_bsattn.strategies.kernels import XlaBlockSparse as make
    attend = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), kernel=make())
jax.block_until_ready((q, k, v))
loss = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)),
                        argnums=(0, 1, 2)))
def hits():
    return (events.count("/jax/compilation_cache/cache_hits"),
            events.count("/jax/compilation_cache/cache_misses"))
marks = [time.perf_counter()]
traced = loss.trace(q, k, v)
marks.append(time.perf_counter())
lowered = traced.lower()
marks.append(time.perf_counter())
before = hits()
compiled = lowered.compile()
marks.append(time.perf_counter())
after = hits()
jax.block_until_ready(compiled(q, k, v))
marks.append(time.perf_counter())
trace, lower, compile_, run = (b - a for a, b in zip(marks, marks[1:]))
print("RESULT " + json.dumps(dict(
    import_s=imported, trace_s=trace, lower_s=lower, compile_s=compile_, first_run_s=run,
    total_s=marks[-1] - marks[0], compile_hits=after[0] - before[0],
    compile_misses=after[1] - before[1], trace_hits=before[0], trace_misses=before[1],
    triton_disk=dict(_compile_cache.triton_cache_stats),
    device=str(jax.devices()[0].device_kind))), flush=True)
"""


def count_files(folder: pathlib.Path) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file())


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def run_child(args: dict, timeout: float) -> dict:
    """One fresh process; its RESULT, or an ``error`` line."""
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"exit {done.returncode}: {last_line(done.stderr or done.stdout)}"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="+", default=["mosaic", "triton", "cudnn"],
                        choices=["mosaic", "triton", "cudnn", "xla"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per process")
    parser.add_argument("--cache-root", default=None,
                        help="parent of the per-kernel cache folders (default: a temporary one)")
    opts = parser.parse_args(argv)
    root = pathlib.Path(opts.cache_root or tempfile.mkdtemp(prefix="bsa-compile-cache-"))
    shape = dict(batch=opts.batch, heads=opts.heads, length=opts.length, dim=opts.dim,
                 dtype=opts.dtype)
    print(f"causal, B={opts.batch} H={opts.heads} L={opts.length} D={opts.dim} {opts.dtype}; "
          f"cache folders under {root}", flush=True)
    results = {}
    for kernel in opts.kernels:
        folder = root / kernel
        folder.mkdir(parents=True, exist_ok=True)
        runs = []
        for process in ("fill", "read"):
            files_before = count_files(folder)
            started = time.perf_counter()
            result = run_child(dict(shape, kernel=kernel, cache=str(folder)), opts.timeout)
            result.update(process=process, wall_s=time.perf_counter() - started,
                          files_before=files_before, files_after=count_files(folder))
            runs.append(result)
            if "error" in result:
                print(f"{kernel:7s} {process}: {result['error']}", flush=True)
            else:
                print(f"{kernel:7s} {process}: trace {result['trace_s']:.2f} lower "
                      f"{result['lower_s']:.2f} compile {result['compile_s']:.2f} first run "
                      f"{result['first_run_s']:.2f} total {result['total_s']:.2f} s; JAX cache "
                      f"hits/misses while compiling {result['compile_hits']}/"
                      f"{result['compile_misses']} (while tracing {result['trace_hits']}/"
                      f"{result['trace_misses']}); Triton disk {result['triton_disk']}; files "
                      f"{files_before} -> {result['files_after']}", flush=True)
        read = runs[1]
        hit = "error" not in read and read["compile_hits"] > 0 and read["compile_misses"] == 0
        results[kernel] = dict(runs=runs, second_process_hit=hit)

    print("\n| kernel | process | trace | lower | compile | first run | total | cache hit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kernel, entry in results.items():
        for run in entry["runs"]:
            if "error" in run:
                print(f"| {kernel} | {run['process']} | {run['error']} | | | | | |")
                continue
            hit = ("yes" if run["compile_hits"] and not run["compile_misses"] else "no")
            print(f"| {kernel} | {run['process']} | {run['trace_s']:.2f} | {run['lower_s']:.2f} "
                  f"| {run['compile_s']:.2f} | {run['first_run_s']:.2f} | {run['total_s']:.2f} "
                  f"| {hit} |")
    out = os.environ.get("OUT")
    if out:
        path = pathlib.Path(out) / "compile_cache_gpu.json"
        path.write_text(json.dumps(dict(shape=shape, results=results), indent=1))
        print(f"wrote {path}")
    failed = any("error" in run for entry in results.values() for run in entry["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
