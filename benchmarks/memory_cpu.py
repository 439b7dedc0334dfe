"""Peak memory of `XlaBlockSparse` forward+backward on the CPU as the sequence grows.

For each length L, a fresh worker process builds ``q, k, v`` (B=1, H=1, D=64, float32), runs
``jax.grad`` of ``sum(out * w)`` with respect to ``q, k, v`` under `jax.jit` for the mask
``Causal() & SlidingWindow(256, 0)``, and reports its peak resident set size (``ru_maxrss``)
and what the arrays it must hold cost: ``q, k, v, w`` (inputs), the output and ``dq, dk, dv``.
With ``--bias`` the call adds a bias of that shape (per key ``[1, 1, 1, L]``, per query
``[1, 1, L, 1]``, a scalar ``[1, 1, 1, 1]``) and the gradient is taken of it too. With
``--documents N`` it passes segment ids (documents of N tokens) as an argument of the jitted
function; ``--loss`` picks ``sum(out * w)`` (``weighted``, the default: ``w`` is an input),
``value_and_grad`` of ``sum(out ** 2)`` (``squared``) or ``mean(out)`` (``mean``).
One process per length, one at a time, so the peaks do not mix.

Run from the repository root::

    python benchmarks/memory_cpu.py                          # L = 2^16, 2^18, 2^20
    python benchmarks/memory_cpu.py --lengths 65536 1048576
    python benchmarks/memory_cpu.py --lengths 1048576 --bias key
    python benchmarks/memory_cpu.py --lengths 1048576 --documents 1000 --loss squared

Not a test: the peak depends on the allocator and the XLA version.
"""

import argparse
import json
import resource
import subprocess
import sys

DIM, WINDOW = 64, 256
BIAS_SHAPES = {"none": None, "key": lambda n: (1, 1, 1, n), "query": lambda n: (1, 1, n, 1),
               "scalar": lambda n: (1, 1, 1, 1)}


LOSSES = ("weighted", "squared", "mean")


def _worker(length: int, bias: str, documents: int | None, loss: str) -> dict:
    import time

    import jax
    import jax.numpy as jnp

    import eqx_bsattn as bsa
    from eqx_bsattn import kernels, masks

    attn = bsa.BlockSparseAttention(
        mask=masks.Causal() & masks.SlidingWindow(WINDOW, 0), kernel=kernels.XlaBlockSparse()
    )
    shape = (1, 1, length, DIM)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, w = (jax.random.normal(key, shape, jnp.float32) for key in keys)
    extra = () if BIAS_SHAPES[bias] is None else (
        jax.random.normal(keys[0], BIAS_SHAPES[bias](length), jnp.float32),)
    ids = None if documents is None else jnp.arange(length, dtype=jnp.int32)[None] // documents
    if loss != "weighted":
        del w  # the loss computes its cotangent

    @jax.jit
    def grads(q, k, v, w, ids, *b):
        def objective(q, k, v, *b):
            out = attn(q, k, v, bias=b[0] if b else None, q_segment_ids=ids,
                       kv_segment_ids=ids)
            if loss == "weighted":
                return jnp.sum(out * w)
            return jnp.sum(out ** 2) if loss == "squared" else jnp.mean(out)

        argnums = tuple(range(3 + len(b)))
        if loss == "squared":
            return jax.value_and_grad(objective, argnums=argnums)(q, k, v, *b)
        return jax.grad(objective, argnums=argnums)(q, k, v, *b)

    start = time.perf_counter()
    jax.block_until_ready(grads(q, k, v, w if loss == "weighted" else None, ids, *extra))
    seconds = time.perf_counter() - start
    # q, k, v, (w,) out, dq, dk, dv
    array_bytes = (8 if loss == "weighted" else 7) * q.size * q.dtype.itemsize
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"length": length, "peak_rss_gb": peak / 1e9, "arrays_gb": array_bytes / 1e9,
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2**16, 2**18, 2**20])
    parser.add_argument("--bias", choices=tuple(BIAS_SHAPES), default="none")
    parser.add_argument("--documents", type=int, default=None,
                        help="pass segment ids: documents of this many tokens")
    parser.add_argument("--loss", choices=LOSSES, default="weighted")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(_worker(args.worker, args.bias, args.documents, args.loss)))
        return
    arrays = "q, k, v, w, out, dq, dk, dv" if args.loss == "weighted" else "q, k, v, out, dq, dk, dv"
    print(f"| L | peak RSS (GB) | {arrays} (GB) | seconds (compile + run) |")
    print("| ---: | ---: | ---: | ---: |")
    for length in args.lengths:
        documents = [] if args.documents is None else ["--documents", str(args.documents)]
        done = subprocess.run([sys.executable, __file__, "--worker", str(length), "--bias",
                               args.bias, "--loss", args.loss, *documents],
                              capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {length} | {row['peak_rss_gb']:.2f} | {row['arrays_gb']:.2f} | "
              f"{row['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
