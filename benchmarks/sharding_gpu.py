"""Sharded against unsharded attention on the GPUs of one host: equal results, and the time.

    python benchmarks/sharding_gpu.py [--out sharding_gpu.json]
    python benchmarks/sharding_gpu.py --smoke        # tiny shapes on any platform

For each pattern of `eqx_bsattn.bench` (causal, window, document) it runs one call three ways
with the same kernel (`TritonBlockSparse` on a GPU, else the platform's default):

- ``single``: unsharded, on the first device;
- ``heads``: `ShardMap` over all devices on the head axis (no communication);
- ``ring``: `RingAttention` over all devices on the sequence axis (keys and values move);
- ``all_to_all``: `AllToAll` over all devices on the sequence axis (one all-to-all in, one
  out), with the same kernel;
- ``all_to_all_auto``: the same with the kernel the selector picks for each device's whole
  sequences (on a GPU cuDNN where the mask allows; the ring cannot run it).

The sequence-parallel forms get their inputs split on the sequence, ``heads`` on the heads.
`AllToAll` needs the heads to be a multiple of the devices. For the L=131072 comparison of
two GPUs against one::

    python benchmarks/sharding_gpu.py --length 131072 --heads 16 --patterns causal document

For each sharded form it reports the largest relative error (in norm) of the output and of the
three gradients against the unsharded call, forward and forward+backward median milliseconds,
effective TFLOP/s (visible pairs only) and the speed-up over ``single``, and for the ring the
steps it computes (`RingAttention.schedule`). Needs at least two devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2`` gives two on a CPU). Not a test:
numbers depend on the machine.
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_bsattn as bsa
from eqx_bsattn.bench import median_ms, pattern, visible_pairs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes: checks that the script runs")
    p.add_argument("--patterns", nargs="+", default=["causal", "window", "document"],
                   choices=["causal", "window", "document", "bigbird"])
    p.add_argument("--length", type=int, default=None, help="default 32768 (GPU), 256 (smoke)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="default 16 (GPU), 2 (smoke)")
    p.add_argument("--dim", type=int, default=None, help="default 128 (GPU), 32 (smoke)")
    p.add_argument("--window", type=int, default=None, help="default 1024 (GPU), 32 (smoke)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per form (default 10)")
    p.add_argument("--out", default=None, help="write the records as JSON here")
    return p.parse_args(argv)


def _relative_error(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _calls(attn, data):
    """``forward(q, k, v)`` and ``forward_backward(q, k, v, w) -> (out, (dq, dk, dv))``, jitted."""

    def forward(q, k, v):
        return attn(q, k, v, **data)

    def forward_backward(q, k, v, w):
        def loss(q, k, v):
            out = attn(q, k, v, **data)
            return jnp.sum(out.astype(jnp.float32) * w), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    return jax.jit(forward), jax.jit(forward_backward)


def main(argv=None) -> None:
    args = parse_args(argv)
    devices = jax.devices()
    n = len(devices)
    if n < 2:
        sys.exit(f"needs at least two devices; found {n} ({devices[0].device_kind}).")
    gpu = jax.default_backend() == "gpu"
    length = args.length or (256 if args.smoke else 32768)
    heads = args.heads or (2 if args.smoke else 16)
    dim = args.dim or (32 if args.smoke else 128)
    window = args.window or (32 if args.smoke else 1024)
    reps = args.reps or (2 if args.smoke else 10)
    dtype = jnp.bfloat16 if gpu else jnp.float32
    kernel = bsa.kernels.TritonBlockSparse() if gpu else bsa.kernels.XlaBlockSparse()
    tiling = None if gpu else bsa.Tiling(block_q=32, block_kv=32)
    # Each device's slice must be a whole number of tiles: the ring cuts the layouts per shard.
    if length % (n * 128):
        sys.exit(f"--length must be a multiple of {n * 128} (128-token tiles on {n} devices).")

    shape = (args.batch, heads, length, dim)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, shape, dtype) for key in keys[:3])
    w = jax.random.normal(keys[3], shape, jnp.float32)
    flat = jax.make_mesh((n,), ("x",))
    forms = {
        "single": bsa.sharding.Unsharded(),
        "heads": bsa.sharding.ShardMap(flat, head_axis="x"),
        "ring": bsa.sharding.RingAttention(flat, seq_axis="x"),
        "all_to_all": bsa.sharding.AllToAll(flat, seq_axis="x"),
        "all_to_all_auto": bsa.sharding.AllToAll(flat, seq_axis="x"),
    }
    split = {"heads": P(None, "x", None, None), "ring": P(None, None, "x", None),
             "all_to_all": P(None, None, "x", None), "all_to_all_auto": P(None, None, "x", None)}
    records = []
    print(f"{n} x {devices[0].device_kind}; B={args.batch} H={heads} L={length} D={dim} "
          f"{jnp.dtype(dtype).name}; kernel {type(kernel).__name__}")
    for name in args.patterns:
        mask, data = pattern(name, length, window=window)
        pairs = visible_pairs(mask, length, length, segment_ids=data.get("q_segment_ids"))
        data = {key: np.broadcast_to(x, (args.batch, length)) for key, x in data.items()}
        flops = 4 * args.batch * heads * dim * pairs
        results, single = {}, None
        for form, sharding in forms.items():
            auto = form == "all_to_all_auto"
            attn = bsa.BlockSparseAttention(mask=mask, kernel=None if auto else kernel,
                                            tiling=None if auto else tiling, sharding=sharding)
            forward, forward_backward = _calls(attn, data)
            where = devices[0] if form == "single" else NamedSharding(flat, split[form])
            inputs, w_in = jax.device_put(((q, k, v), w), where)
            out, grads = forward_backward(*inputs, w_in)
            results[form] = (out, grads)
            fwd_ms = median_ms(forward, inputs, reps)
            fb_ms = median_ms(forward_backward, (*inputs, w_in), reps)
            record = {
                "pattern": name, "form": form, "devices": n, "device_kind": devices[0].device_kind,
                "batch": args.batch, "heads": heads, "length": length, "dim": dim,
                "dtype": jnp.dtype(dtype).name,
                "kernel": attn.plan(q, k, v, **data).kernel.name if auto else type(kernel).__name__,
                "visible_pairs": pairs, "fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms,
                "fwd_tflops": flops / fwd_ms / 1e9, "fwd_bwd_tflops": 3.5 * flops / fb_ms / 1e9,
            }
            if form != "single":
                ref_out, ref_grads = results["single"]
                record["rel_err"] = {
                    "out": _relative_error(out, ref_out),
                    **{f"d{x}": _relative_error(g, r) for x, g, r in zip("qkv", grads, ref_grads)},
                }
                record["speedup_fwd"] = single["fwd_ms"] / fwd_ms
                record["speedup_fwd_bwd"] = single["fwd_bwd_ms"] / fb_ms
            if form == "ring":
                plan = attn.plan(q, k, v, **data)
                schedule = sharding.schedule(plan.mask, plan.inputs)
                record["ring_steps"] = str(schedule)
            records.append(record)
            single = record if form == "single" else single
            err = record.get("rel_err")
            err_text = "" if err is None else " | max rel err " + f"{max(err.values()):.2e}"
            speed = ("" if form == "single" else
                     f" | x{record['speedup_fwd']:.2f} / x{record['speedup_fwd_bwd']:.2f}")
            print(f"{name:>9} {form:>6}: fwd {fwd_ms:8.2f} ms ({record['fwd_tflops']:6.1f} TF/s)"
                  f"  fwd+bwd {fb_ms:8.2f} ms ({record['fwd_bwd_tflops']:6.1f} TF/s){speed}"
                  f"{err_text}")
            if form == "ring":
                print(f"{'':>17}{record['ring_steps']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
