"""`TritonBlockSparse`'s score terms, and its launches inside `shard_map`, on the CPU, through
Triton's interpreter.

These run only where `tests/conftest.py` installed the interpreter
(``EQX_BSATTN_TRITON_INTERPRET``, see benchmarks/triton_interpret.py); elsewhere they skip.
The kernels against the float64 oracle are the conformance suite's ``score_*`` cases.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks, scores, sharding
from eqx_bsattn.strategies.kernels import DenseReference, TritonBlockSparse
from eqx_bsattn.strategies.kernels.triton import launch
from tests.conftest import t5_bucket

pytestmark = pytest.mark.skipif(
    "cpu" not in TritonBlockSparse.platforms,
    reason="needs Triton's interpreter (EQX_BSATTN_TRITON_INTERPRET)")

if "cpu" in TritonBlockSparse.platforms:  # Triton imports: the interpreter is installed
    import triton
    import triton.language as tl

    from eqx_bsattn.strategies.kernels.triton.jit_kernels import _bucket, _bucket_spans

    @triton.jit
    def _bucket_kernel(D, THRESH, OUT, N: tl.constexpr, BIDIR: tl.constexpr,
                       HALF: tl.constexpr, NT: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(OUT + offs, _bucket(tl.load(D + offs), THRESH, BIDIR, HALF, NT))


@pytest.mark.parametrize("num_buckets,bidirectional,max_distance",
                         [(32, True, 128), (32, False, 128), (8, True, 20), (12, False, 40),
                          (4, True, 3)])
def test_kernel_buckets_follow_t5(num_buckets, bidirectional, max_distance):
    """The kernels' `_bucket` on distances near zero, at every threshold and at the ends of
    the position range (+-2**30 apart and more), against T5's formula."""

    buckets = scores.RelativeBuckets(num_buckets, bidirectional, max_distance)
    cfg = launch.score_constexprs(False, buckets)

    near = np.arange(-3 * max_distance - 50, 3 * max_distance + 50)
    edges = np.array([2**31 - 1, -(2**31 - 1), 2**30, -(2**30), 2**30 - 1])
    at = np.array(buckets.thresholds + (max_distance,))
    d = np.concatenate([near, edges, at - 1, at, -at, 1 - at]).astype(np.int32)
    n = 1 << (len(d) - 1).bit_length()
    d = np.pad(d, (0, n - len(d)))
    got = launch.triton_call(
        jnp.asarray(d), jnp.asarray(buckets.thresholds or (0,), jnp.int32),
        kernel=_bucket_kernel, out_shape=(jax.ShapeDtypeStruct((n,), jnp.int32),), grid=(1,),
        N=n, BIDIR=cfg["REL_BIDIR"], HALF=cfg["REL_HALF"], NT=cfg["NT"])
    np.testing.assert_array_equal(np.asarray(got[0]), t5_bucket(d, num_buckets, bidirectional,
                                                             max_distance))


if "cpu" in TritonBlockSparse.platforms:

    @triton.jit
    def _spans_kernel(THRESH, OUT, NBP: tl.constexpr, BIDIR: tl.constexpr,
                      HALF: tl.constexpr, NT: tl.constexpr):
        dmin, dmax = _bucket_spans(THRESH, NBP, BIDIR, HALF, NT)
        offs = tl.arange(0, NBP)
        tl.store(OUT + offs, dmin)
        tl.store(OUT + NBP + offs, dmax)


@pytest.mark.parametrize("num_buckets,bidirectional,max_distance",
                         [(32, True, 128), (32, False, 128), (8, True, 20), (12, False, 40),
                          (5, True, 9), (7, False, 20), (4, True, 3)])
def test_bucket_spans_follow_t5(num_buckets, bidirectional, max_distance):
    """The distances of each bucket (`_bucket_spans`, the dq kernel's near blocks' per-row
    sums) are exactly T5's, and the buckets past the table's, padding, are empty."""
    buckets = scores.RelativeBuckets(num_buckets, bidirectional, max_distance)
    cfg = launch.score_constexprs(False, buckets)
    nbp = cfg["NBP"]
    got = launch.triton_call(
        jnp.asarray(buckets.thresholds or (0,), jnp.int32), kernel=_spans_kernel,
        out_shape=(jax.ShapeDtypeStruct((2 * nbp,), jnp.int32),), grid=(1,), NBP=nbp,
        BIDIR=bidirectional, HALF=buckets.half, NT=cfg["NT"])
    dmin, dmax = np.asarray(got[0]).reshape(2, nbp)
    d = np.arange(-4 * max_distance - 50, 4 * max_distance + 50)
    want = t5_bucket(d, num_buckets, bidirectional, max_distance)
    for b in range(nbp):
        np.testing.assert_array_equal((d >= dmin[b]) & (d <= dmax[b]), want == b, err_msg=str(b))


def test_minus_inf_in_the_table_hides_its_bucket():
    """A -inf entry hides its bucket's pairs: here the diagonal, so the first query sees no key
    (zero output, zero gradients) and the rest attend strictly before themselves."""
    table = jnp.zeros((4, 8)).at[:, 0].set(-jnp.inf)
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, 4, 40, 8)) for kk in ks)
    score = scores.RelativePositionBias(table, bidirectional=False)

    def run(attn):
        out, pullback = jax.vjp(lambda q, k, v: attn(q, k, v), q, k, v)
        return (out,) + pullback(jnp.cos(out))

    got = run(bsa.BlockSparseAttention(mask=masks.Causal(), kernel=TritonBlockSparse(),
                                       tiling=bsa.Tiling(block_q=16, block_kv=16), score=score))
    want = run(bsa.BlockSparseAttention(mask=masks.Causal(offset=-1), kernel=DenseReference()))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)
    assert np.all(np.asarray(got[0])[:, :, 0] == 0) and np.all(np.asarray(got[1])[:, :, 0] == 0)


@pytest.mark.parametrize("score", [scores.ALiBi(), scores.RelativePositionBias(jnp.ones((2, 32)))])
def test_no_lq_by_lk_array(score):
    """Forward and backward with a score term: no value of the traced call (the launches'
    outputs included) is larger than the same call without it forms, far below Lq x Lk."""
    from tests.test_scores import _largest_intermediate

    length = 1024
    q = jnp.ones((1, 2, length, 16))

    def largest(score):
        attn = bsa.BlockSparseAttention(mask=masks.Causal() & masks.SlidingWindow(128, 0),
                                        kernel=TritonBlockSparse(), score=score)
        jaxpr = jax.make_jaxpr(jax.grad(lambda q: attn(q, q, q).sum()))(q).jaxpr
        return _largest_intermediate(jaxpr)

    with_score = largest(score)
    assert with_score <= largest(None) < length * length // 8


class _SlopesAndTable(scores.AbstractScore):
    """Learned ALiBi slopes and a relative table in one call."""

    slopes: jax.Array
    table: jax.Array

    def compile(self, num_heads):
        buckets = scores.RelativeBuckets(self.table.shape[1], bidirectional=True, max_distance=30)
        return bsa.contract.ScoreTerms(slopes=self.slopes, table=self.table, buckets=buckets)


def test_slopes_and_table_together_with_gqa_and_vmap():
    """Both terms in one call (GQA, Lq != Lk, ragged tiles), under `jax.vmap` with the arrays
    shared: output and the gradients of q, k, v, slopes and table against the reference."""
    ks = jax.random.split(jax.random.key(3), 6)
    q = jax.random.normal(ks[0], (2, 4, 37, 16))
    k = jax.random.normal(ks[1], (2, 2, 53, 16))
    v = jax.random.normal(ks[2], (2, 2, 53, 8))
    slopes = 0.2 * jax.random.normal(ks[3], (4,))
    table = jax.random.normal(ks[4], (4, 16))
    cot = jax.random.normal(ks[5], (2, 4, 37, 8))
    mask = masks.Causal(bottom_right=True) & masks.SlidingWindow(40, 3)

    def run(kernel):
        def f(q, k, v, slopes, table):
            attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, score=_SlopesAndTable(
                slopes, table), tiling=bsa.Tiling(block_q=16, block_kv=16))
            return jax.vmap(lambda q, k, v: attn(q, k, v))(q, k, v)

        out, pullback = jax.vjp(f, q, k, v, slopes, table)
        return (out,) + pullback(cot)

    got = run(TritonBlockSparse())
    with jax.default_matmul_precision("highest"):
        want = run(DenseReference())
    for name, g, w in zip(("out", "q", "k", "v", "slopes", "table"), got, want):
        assert np.abs(np.asarray(w)).max() > 0, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4,
                                   atol=1e-4 * np.abs(np.asarray(w)).max(), err_msg=name)


@pytest.mark.parametrize("ptx", [True, False])
def test_near_entries_with_and_without_ptx(ptx, monkeypatch):
    """A table's near entries load through inline PTX (an NVIDIA GPU, pipelined near loops)
    or through `tl.load` (a ROCm GPU, unpipelined): both against the reference, forward and
    every gradient, on windowed causal blocks at 32-token tiles, ragged, with the launches
    seen to take the path asked."""
    from eqx_bsattn.strategies.kernels.triton import kernel as triton_kernel

    monkeypatch.setattr(triton_kernel, "gpu_takes_ptx", lambda: ptx)
    seen = []
    run_launch = launch.triton_call

    def spy(*args, **kwargs):
        seen.append((kwargs["PTX_ENTRIES"], kwargs["NEAR_STAGES"]))
        return run_launch(*args, **kwargs)

    monkeypatch.setattr(launch, "triton_call", spy)
    ks = jax.random.split(jax.random.key(4), 5)
    q, k, v = (jax.random.normal(kk, (1, 2, 150, 16)) for kk in ks[:3])
    table = jax.random.normal(ks[3], (2, 32))
    cot = jax.random.normal(ks[4], (1, 2, 150, 16))
    mask = masks.Causal() & masks.SlidingWindow(100, 0)

    def run(kernel, tiling=None):
        def f(q, k, v, table):
            score = scores.RelativePositionBias(table, bidirectional=False, max_distance=40)
            attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, tiling=tiling, score=score)
            return attn(q, k, v)

        out, pullback = jax.vjp(f, q, k, v, table)
        return (out,) + pullback(cot)

    got = run(TritonBlockSparse(),
              bsa.kernels.TritonConfig(block_q=32, block_kv=32, num_stages=2))
    with jax.default_matmul_precision("highest"):
        want = run(DenseReference())
    assert set(seen) == {(ptx, 2 if ptx else 1)}, seen
    for name, g, w in zip(("out", "q", "k", "v", "table"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4,
                                   atol=1e-4 * np.abs(np.asarray(w)).max(), err_msg=name)


@pytest.mark.parametrize("form", ["heads", "ring"])
def test_inside_shard_map_on_a_one_device_mesh(form):
    """`ShardMap` and `RingAttention` (one step) run the launches inside `shard_map`: each
    output and cotangent must carry its input's mesh axes, and a ring step's static layout,
    picked by a traced index, is walked as lists checked on the device."""
    mesh = jax.make_mesh((1,), ("x",))
    shard = (sharding.ShardMap(mesh, head_axis="x") if form == "heads"
             else sharding.RingAttention(mesh, seq_axis="x"))
    ks = jax.random.split(jax.random.key(4), 4)
    q, k, v, w = (jax.random.normal(kk, (1, 2, 128, 16)) for kk in ks)
    mask = masks.Causal() & masks.SlidingWindow(40, 0)

    def run(kernel, shard):
        attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, sharding=shard,
                                        tiling=bsa.Tiling(block_q=32, block_kv=32))
        loss = lambda q, k, v: jnp.sum(attn(q, k, v) * w)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    got = run(TritonBlockSparse(), shard)
    with jax.default_matmul_precision("highest"):
        want = run(DenseReference(), sharding.Unsharded())
    for name, g, w_ in zip(("loss", "q", "k", "v"), jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w_), rtol=1e-4,
                                   atol=1e-4 * np.abs(np.asarray(w_)).max(), err_msg=name)
