"""Seconds of the first call of ``jit(grad)`` (trace, compile and one run) through
`MosaicBlockSparse` in each backward mode and `TritonBlockSparse`, causal, B=1, H=16, L=4096,
D=128, bfloat16; each in a fresh process so that no compilation is cached. The stages are
timed apart too (`jax.stages`: trace, lower, compile, the first run).

```
python benchmarks/mosaic_compile_time.py
```
"""

import subprocess
import sys

ONE = """
import time, jax, jax.numpy as jnp
import eqx_bsattn as bsa
from eqx_bsattn.strategies.kernels import TritonBlockSparse
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse
kernel = {kernel}
attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), kernel=kernel)
q, k, v = (jax.random.normal(jax.random.key(i), (1, 16, 4096, 128), jnp.bfloat16)
           for i in range(3))
jax.block_until_ready((q, k, v))
loss = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)),
                        argnums=(0, 1, 2)))
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

KERNELS = {"mosaic (deterministic, the default)": "MosaicBlockSparse()",
           "mosaic (single pass)": "MosaicBlockSparse(deterministic=False)",
           "triton": "TritonBlockSparse()"}


def main():
    print("| kernel | first jit(grad) call, s | trace | lower | compile | first run |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, kernel in KERNELS.items():
        run = subprocess.run([sys.executable, "-c", ONE.format(kernel=kernel)],
                             capture_output=True, text=True)
        seconds = run.stdout.strip().splitlines()[-1] if run.returncode == 0 else (
            "error: " + run.stderr.strip().splitlines()[-1])
        print(f"| {name} | {seconds} |", flush=True)


if __name__ == "__main__":
    main()
