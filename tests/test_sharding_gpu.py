"""`RingAttention` and `ShardMap` on the GPUs of one host, with the GPU kernels inside: the
output and every gradient against the unsharded call with the same kernel and against the
float32 dense reference.

Mosaic runs in the ring only where the mask reads no positions (segment ids alone): the ring
passes every shard its tokens' global positions, which Mosaic's partial blocks do not read.

The mesh spans every local GPU. On a one-GPU machine it has one device: the ring then runs its
whole code path (the scan over its walk, the saved log-sum-exp, its own backward) with one
step and no transfer, which is what these tests check there. They skip without a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks, sharding
from eqx_bsattn.strategies.kernels import DenseReference, TritonBlockSparse
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]

#: Relative error in norm against the float32 reference, bfloat16 inputs.
TOL = 2e-2
#: Against the unsharded call with the same kernel (the same products, merged differently).
TOL_UNSHARDED = 1e-2


def _rel(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    assert np.all(np.isfinite(a)), "non-finite values"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _segments(batch, length, docs, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.integers(0, docs, (batch, length)), axis=1).astype(np.int32)
    ids[:, -5:] = -1
    return jnp.asarray(ids)


PATTERNS = {
    "causal": (masks.Causal(), False),
    "window": (masks.Causal() & masks.SlidingWindow(300, 0), False),
    "documents": (masks.Causal() & masks.Document(), True),
}


def _run(kernel, shard, mask, q, k, v, cot, data, dtype):
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, sharding=shard)

    def both(q, k, v):
        f = lambda q, k, v: attn(q.astype(dtype), k.astype(dtype), v.astype(dtype),  # noqa: E731
                                 **data)
        out, pullback = jax.vjp(f, q, k, v)
        return (out, *pullback(cot.astype(out.dtype)))

    return jax.jit(both)(q, k, v)


def _inputs(batch, heads, kv_heads, length, dim, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (batch, heads, length, dim), jnp.float32)
    k = jax.random.normal(ks[1], (batch, kv_heads, length, dim), jnp.float32)
    v = jax.random.normal(ks[2], (batch, kv_heads, length, dim), jnp.float32)
    cot = jax.random.normal(ks[3], (batch, heads, length, dim), jnp.float32)
    return q, k, v, cot


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("form", ["ring", "heads"])
def test_triton_sharded_matches_unsharded_and_reference(form, pattern):
    mask, seg = PATTERNS[pattern]
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("x",))
    shard = (sharding.RingAttention(mesh, seq_axis="x") if form == "ring"
             else sharding.ShardMap(mesh, head_axis="x"))
    length = 1024 * max(n, 2)  # a multiple of two 128-token tiles per device (zig-zag)
    q, k, v, cot = _inputs(1, 4 * n, 2 * n, length, 128)
    data = {}
    if seg:
        ids = _segments(1, length, 6)
        data = {"q_segment_ids": ids, "kv_segment_ids": ids}
    got = _run(TritonBlockSparse(), shard, mask, q, k, v, cot, data, jnp.bfloat16)
    alone = _run(TritonBlockSparse(), sharding.Unsharded(), mask, q, k, v, cot, data,
                 jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        want = _run(DenseReference(), sharding.Unsharded(), mask, q, k, v, cot, data,
                    jnp.float32)
    for name, g, a, w in zip(("out", "dq", "dk", "dv"), got, alone, want):
        assert _rel(g, a) < TOL_UNSHARDED, (name, "unsharded")
        assert _rel(g, w) < TOL, (name, "reference")


def test_mosaic_under_the_ring_declines_with_its_reason():
    """The ring passes every shard its tokens' global positions, and Mosaic's partial blocks
    compare token indices: the call refuses in one line rather than guess."""
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=MosaicBlockSparse(),
                                    sharding=sharding.RingAttention(mesh, seq_axis="x"))
    q = jnp.ones((1, 4, 2048, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="per-call positions"):
        jax.jit(attn)(q, q, q)


@pytest.mark.parametrize("deterministic", [False, True], ids=["single_pass", "deterministic"])
def test_mosaic_under_the_ring_with_documents_matches_reference(deterministic):
    """A mask whose only term is the segment ids reads no positions: Mosaic runs in the ring."""
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("x",))
    length = 1024 * max(n, 2)
    q, k, v, cot = _inputs(1, 4, 2, length, 128, seed=2)
    ids = _segments(1, length, 5, seed=2)
    data = {"q_segment_ids": ids, "kv_segment_ids": ids}
    mask = masks.Document()
    got = _run(MosaicBlockSparse(deterministic=deterministic),
               sharding.RingAttention(mesh, seq_axis="x"), mask, q, k, v, cot, data,
               jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        want = _run(DenseReference(), sharding.Unsharded(), mask, q, k, v, cot, data,
                    jnp.float32)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel(g, w) < TOL, name


@pytest.mark.parametrize("deterministic", [False, True], ids=["single_pass", "deterministic"])
def test_mosaic_under_shard_map_matches_reference(deterministic):
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("x",))
    mask = masks.Causal() & masks.SlidingWindow(300, 0)
    q, k, v, cot = _inputs(1, 4 * n, 2 * n, 1024, 128, seed=1)
    kernel = MosaicBlockSparse(deterministic=deterministic)
    got = _run(kernel, sharding.ShardMap(mesh, head_axis="x"), mask, q, k, v, cot, {},
               jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        want = _run(DenseReference(), sharding.Unsharded(), mask, q, k, v, cot, {},
                    jnp.float32)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel(g, w) < TOL, name
