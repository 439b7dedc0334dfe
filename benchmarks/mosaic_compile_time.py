"""Seconds of the first call of ``jit(grad)`` (trace, compile and one run) through
`MosaicBlockSparse` in each backward mode (and with a `scores.ScoreFunction`, symmetric
ALiBi written as a function) and `TritonBlockSparse`, causal, B=1, H=16, L=4096, D=128, bfloat16;
each in a fresh process so that no compilation is cached. The stages are
timed apart too (`jax.stages`: trace, lower, compile, the first run).

```
python benchmarks/mosaic_compile_time.py [--profile]
```

`--profile` also compiles the default kernel's call once more under `jax.profiler` and prints
the seconds of each Mosaic GPU kernel's own compilation (its `Compile` trace events: the
kernel's MLIR, LLVM and PTX assembly) against the whole compile stage.
"""

import argparse
import glob
import gzip
import json
import re
import subprocess
import sys
import tempfile

#: The call, built in a fresh process: ``loss`` is its ``jit(grad)`` on ``q, k, v``.
CALL = """
import time, jax, jax.numpy as jnp
import eqx_bsattn as bsa
from eqx_bsattn.strategies.kernels import TritonBlockSparse
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse
kernel = {kernel}
score = {score}
attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), score=score, kernel=kernel)
q, k, v = (jax.random.normal(jax.random.key(i), (1, 16, 4096, 128), jnp.bfloat16)
           for i in range(3))
jax.block_until_ready((q, k, v))
loss = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)),
                        argnums=(0, 1, 2)))
"""

ONE = CALL + """
marks = [time.perf_counter()]
traced = loss.trace(q, k, v)
marks.append(time.perf_counter())
lowered = traced.lower()
marks.append(time.perf_counter())
compiled = lowered.compile()
marks.append(time.perf_counter())
jax.block_until_ready(compiled(q, k, v))
marks.append(time.perf_counter())
stages = [b - a for a, b in zip(marks, marks[1:])]
print(f"{{marks[-1] - marks[0]:.2f}} | " + " | ".join(f"{{s:.2f}}" for s in stages))
"""

#: Symmetric ALiBi with the standard slopes of 16 heads, as a score function (ALiBi's term on
#: the causal pairs; ALiBi itself, affine in the positions, would plan as built-in ALiBi).
FUNCTION = ("bsa.scores.ScoreFunction(lambda s, h, q, k: s - jnp.exp2((jnp.asarray(h)"
            ".astype(jnp.float32) + 1.0) * -0.5) * jnp.abs(k - q).astype(jnp.float32))")

#: Name: (kernel, score).
KERNELS = {"mosaic (deterministic, the default)": ("MosaicBlockSparse()", "None"),
           "mosaic (single pass)": ("MosaicBlockSparse(deterministic=False)", "None"),
           "mosaic + ScoreFunction (deterministic)": ("MosaicBlockSparse()", FUNCTION),
           "triton": ("TritonBlockSparse()", "None")}


PROFILED = CALL + """
lowered = loss.trace(q, k, v).lower()
jax.profiler.start_trace({folder!r})
start = time.perf_counter()
lowered.compile()
print(f"{{time.perf_counter() - start:.2f}}")
jax.profiler.stop_trace()
"""


def last_error(stderr: str) -> str:
    """The exception line of a child's `stderr` (JAX may print a note after it)."""
    lines = stderr.strip().splitlines() or ["no output"]
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    return (raised or lines)[-1]


def kernel_compiles(trace_folder: str) -> list[float]:
    """Seconds of each Mosaic GPU kernel's `Compile` event in the profiler trace under
    `trace_folder`, in the order they ran."""
    events = []
    for path in glob.glob(f"{trace_folder}/**/*.trace.json.gz", recursive=True):
        with gzip.open(path) as f:
            events += [e for e in json.load(f)["traceEvents"]
                       if e.get("ph") == "X" and e.get("name") == "Compile"]
    return [e["dur"] / 1e6 for e in sorted(events, key=lambda e: e["ts"])]


def profile():
    """Print the default kernel's compile stage and its kernels' own compilations."""
    with tempfile.TemporaryDirectory() as folder:
        kernel, score = KERNELS["mosaic (deterministic, the default)"]
        program = PROFILED.format(kernel=kernel, score=score, folder=folder)
        run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
        if run.returncode:
            print("profile: error: " + last_error(run.stderr))
            return
        seconds = kernel_compiles(folder)
    print(f"compile stage under the profiler: {run.stdout.strip().splitlines()[-1]} s; "
          f"Mosaic GPU kernels' own compilation: "
          + ", ".join(f"{s:.2f}" for s in seconds) + f" s (sum {sum(seconds):.2f} s)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", action="store_true",
                   help="also time each Mosaic GPU kernel's own compilation (jax.profiler)")
    args = p.parse_args()
    print("| kernel | first jit(grad) call, s | trace | lower | compile | first run |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (kernel, score) in KERNELS.items():
        run = subprocess.run([sys.executable, "-c", ONE.format(kernel=kernel, score=score)],
                             capture_output=True, text=True)
        seconds = (run.stdout.strip().splitlines()[-1] if run.returncode == 0
                   else "error: " + last_error(run.stderr))
        print(f"| {name} | {seconds} |", flush=True)
    if args.profile:
        profile()


if __name__ == "__main__":
    main()
