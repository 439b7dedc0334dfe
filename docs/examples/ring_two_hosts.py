"""Attention over a mesh that spans hosts: one process per host, joined by `jax.distributed`.

Every process runs this same script. `jax.distributed.initialize` connects the processes;
from then on `jax.devices()` lists the devices of every host and a `jax.sharding.Mesh` may hold
them all. The library needs nothing more: `RingAttention` and `ShardMap` take that mesh as
they take a mesh of one host, and each process passes arrays whose shards it holds itself.

The script runs three shardings on a causal mask and checks each against the unsharded call
computed on one local device (the output and the gradients of q, k and v), shard by shard
where this process holds the shard, and whole after gathering the result:

- `ring`: `RingAttention` over every device; the mesh puts each host's devices next to each
  other, so only one hop per host boundary leaves a host.
- `heads`: `ShardMap` over the heads of every device: no communication during attention.
- `ring x heads`: a 2-D mesh, the ring over the devices of one host and the heads over the
  hosts, so the ring's hops stay inside the hosts.

Two processes on one machine, four virtual CPU devices each (port 12355 must be free):

    export XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu
    python docs/examples/ring_two_hosts.py --coordinator 127.0.0.1:12355 \
        --num-processes 2 --process-id 0 &
    python docs/examples/ring_two_hosts.py --coordinator 127.0.0.1:12355 \
        --num-processes 2 --process-id 1

On a cluster (SLURM, Open MPI, Kubernetes, Cloud TPU) give no arguments:
`jax.distributed.initialize()` reads the coordinator and the process id from the environment.
Each process prints one line of JSON (its process id, the largest relative error of each
check, and a digest of the gathered results, the same in every process) and exits with 1 if
a check fails.
"""

import argparse
import hashlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import eqx_bsattn as bsa

TOLERANCE = 2e-5  # float32, relative to the largest value of the unsharded result


def host_major_devices(*local_shape: int):
    """Every process's devices in a `(processes, *local_shape)` array, one process per row.

    `create_hybrid_device_mesh` treats processes as the slower network's units, so an axis of
    `local_shape` never leaves a host and the leading axis runs across hosts.
    """
    hosts = jax.process_count()
    return mesh_utils.create_hybrid_device_mesh(
        (1, *local_shape), (hosts, *(1,) * len(local_shape)), process_is_granule=True)


def global_array(x: np.ndarray, mesh: Mesh, spec: P) -> jax.Array:
    """`x` split over `mesh` as `spec`; this process places only the shards of its devices."""
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def max_rel_err(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def check(name, attn, mesh, spec, arrays, reference, digest) -> dict[str, float]:
    """Run `attn` on `arrays` split as `spec`; its largest errors against `reference` over
    this process's shards (`local`, each relative to its shard) and over the gathered whole
    (`global`). `digest` takes in the gathered results."""
    q, k, v, cotangent = (global_array(x, mesh, spec) for x in arrays)

    @jax.jit
    def forward_and_grads(q, k, v, cotangent):
        out, pullback = jax.vjp(attn, q, k, v)
        return (out, *pullback(cotangent))

    results = forward_and_grads(q, k, v, cotangent)
    local = global_ = 0.0
    for result, expected in zip(results, reference):
        for shard in result.addressable_shards:
            local = max(local, max_rel_err(shard.data, expected[shard.index]))
        whole = multihost_utils.process_allgather(result, tiled=True)
        global_ = max(global_, max_rel_err(whole, expected))
        digest.update(np.ascontiguousarray(whole).tobytes())
    return {f"{name}: local": local, f"{name}: global": global_}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", help="host:port of process 0 (default: from the "
                        "cluster's environment)")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    args = parser.parse_args(argv)
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id)

    hosts, local_devices = jax.process_count(), jax.local_device_count()
    devices = hosts * local_devices
    # Every process draws the same call; each then places only its own shards of it.
    batch, heads, length, dim = 1, devices, 64 * devices, 16
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((batch, heads, length, dim), np.float32) for _ in range(4)]
    q, k, v, cotangent = arrays

    mask, tiling = bsa.masks.Causal(), bsa.Tiling(block_q=16, block_kv=16)
    unsharded = bsa.BlockSparseAttention(mask=mask, tiling=tiling)
    out, pullback = jax.vjp(unsharded, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    reference = [np.asarray(x) for x in (out, *pullback(jnp.asarray(cotangent)))]

    ring_mesh = Mesh(host_major_devices(local_devices).reshape(devices), ("seq",))
    head_mesh = Mesh(host_major_devices(local_devices).reshape(devices), ("heads",))
    mesh_2d = Mesh(host_major_devices(local_devices), ("heads", "seq"))
    runs = [
        ("ring", bsa.sharding.RingAttention(ring_mesh, "seq"), P(None, None, "seq", None)),
        ("heads", bsa.sharding.ShardMap(head_mesh, head_axis="heads"),
         P(None, "heads", None, None)),
        ("ring x heads", bsa.sharding.RingAttention(mesh_2d, "seq", head_axis="heads"),
         P(None, "heads", "seq", None)),
    ]
    digest, errors = hashlib.sha256(), {}
    for name, sharding, spec in runs:
        attn = bsa.BlockSparseAttention(mask=mask, tiling=tiling, sharding=sharding)
        errors.update(check(name, attn, sharding.mesh, spec, arrays, reference, digest))

    ok = all(err <= TOLERANCE for err in errors.values())
    print(json.dumps({"process": jax.process_index(), "processes": hosts, "devices": devices,
                      "ok": ok, "errors": errors, "digest": digest.hexdigest()}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
