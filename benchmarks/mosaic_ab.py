"""`MosaicBlockSparse`'s forward at another git revision against the working tree's, both in
one process (Hopper GPU only).

Run-to-run spread on a lent GPU is often larger than a kernel change, so a change is judged
here against the forward before it in the same process: the forward kernel module
(``strategies/kernels/mosaic/forward.py``) of ``--base`` is loaded beside the working tree's,
each is jitted through `MosaicBlockSparse` (the rest of the package is the working tree's),
and the two are timed in interleaved rounds (``--rounds`` rounds of ``--reps`` calls each).
Prints forward TF/s (visible pairs only) per case as median / best over the rounds.

```
python benchmarks/mosaic_ab.py --base HEAD~1
python benchmarks/mosaic_ab.py --base main --cases document:2:16384 window:32:1024
```
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import eqx_bsattn as bsa
import eqx_bsattn.strategies.kernels.mosaic.kernel as mosaic_kernel
from eqx_bsattn.bench import median_ms, pattern, visible_pairs
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse

FORWARD = "strategies/kernels/mosaic/forward.py"


def forward_at(revision: str):
    """`forward_call` of the forward module at git `revision`, imported as a module of the
    installed package (so that its relative imports resolve to the working tree's)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "-C", root, "show", f"{revision}:{FORWARD}"],
                            check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "forward_base.py")
    with open(path, "w") as f:
        f.write(source)
    name = "eqx_bsattn.strategies.kernels.mosaic.forward_base"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.forward_call


def compare(cases, base: str, rounds: int, reps: int, heads: int, dim: int):
    calls = {f"base ({base})": forward_at(base), "working tree": mosaic_kernel.forward_call}
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"\nForward TF/s, H={heads} D={dim} bfloat16, median / best of {rounds} rounds")
    print("| pattern | L | B | " + " | ".join(calls) + " |")
    print("| --- | --- | --- |" + " --- |" * len(calls))
    working = mosaic_kernel.forward_call
    try:
        for case in cases:
            name, batch, length = case.split(":")
            batch, length = int(batch), int(length)
            mask, data = pattern(name, length, window=1024 if length > 2048 else 256)
            flops = 4.0 * batch * heads * dim * visible_pairs(
                mask, length, length, data.get("q_segment_ids"))
            keys = jax.random.split(jax.random.key(length), 3)
            q, k, v = (jax.random.normal(key, (batch, heads, length, dim), jnp.bfloat16)
                       for key in keys)
            per_call = {n: jnp.broadcast_to(jnp.asarray(x), (batch, length))
                        for n, x in data.items()}
            fns = {}
            for label, forward_call in calls.items():
                # `_forward` looks `forward_call` up when it is traced: trace each here.
                mosaic_kernel.forward_call = forward_call
                attn = bsa.BlockSparseAttention(mask=mask, kernel=MosaicBlockSparse())
                fn = jax.jit(lambda q, k, v, attn=attn: attn(q, k, v, **per_call))
                fn(q, k, v).block_until_ready()
                fns[label] = fn
            mosaic_kernel.forward_call = working
            times = {label: [] for label in fns}
            for _ in range(rounds):
                for label, fn in fns.items():
                    times[label].append(median_ms(fn, (q, k, v), reps, warmup=1))
            cells = [f"{flops / np.median(ms) / 1e9:.1f} / {flops / np.min(ms) / 1e9:.1f}"
                     for ms in times.values()]
            print(f"| {name} | {length} | {batch} | " + " | ".join(cells) + " |", flush=True)
    finally:
        mosaic_kernel.forward_call = working


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision of the forward to compare with")
    p.add_argument("--cases", nargs="+", default=[
        "causal:2:16384", "window:2:16384", "document:2:16384", "causal:32:1024",
        "window:32:1024", "document:32:1024"], help="pattern:batch:length")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    args = p.parse_args()
    compare(args.cases, args.base, args.rounds, args.reps, args.heads, args.dim)


if __name__ == "__main__":
    main()
