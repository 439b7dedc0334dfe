"""Score terms (`eqx_bsattn.scores`): their definitions, their errors, the kernels that decline
them, the layer and the seed-style call. Kernels against the float64 oracle: the `score_*`
cases of tests/test_conformance.py."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
from tests.conftest import (assert_close, jnp_attention_f64, np_visibility, random_array,
                            score_f64, t5_bucket)

# ---------------------------------------------------------------------------------------------
# Definitions.


def test_alibi_slopes_are_the_standard_sequence():
    # Press et al.: 2 ** (-8 i / n) for n a power of two; otherwise the largest power of two's
    # slopes, then every other slope of twice that power.
    np.testing.assert_allclose(scores.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    np.testing.assert_allclose(scores.alibi_slopes(6),
                               [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    assert scores.alibi_slopes(1).tolist() == [2**-8]


@pytest.mark.parametrize("num_buckets,bidirectional,max_distance",
                         [(32, True, 128), (32, False, 128), (8, True, 20), (12, False, 40),
                          (64, True, 1000), (4, True, 3)])
def test_buckets_follow_t5(num_buckets, bidirectional, max_distance):
    buckets = scores.RelativeBuckets(num_buckets, bidirectional, max_distance)
    d = np.arange(-3 * max_distance - 50, 3 * max_distance + 50)
    got = np.asarray(buckets.bucket(jnp.asarray(d, jnp.int32)))
    want = t5_bucket(d, num_buckets, bidirectional, max_distance)
    np.testing.assert_array_equal(got, want)
    assert got.min() == 0 and got.max() == num_buckets - 1


@pytest.mark.parametrize("num_buckets,bidirectional,max_distance",
                         [(32, True, 128), (32, False, 128), (8, True, 20), (12, False, 40),
                          (64, True, 1000), (4, True, 3), (32, True, 256)])
def test_far_buckets(num_buckets, bidirectional, max_distance):
    """Past `far_buckets`' gaps every distance is in its side's bucket, one before is not."""
    buckets = scores.RelativeBuckets(num_buckets, bidirectional, max_distance)
    (ahead_gap, ahead), (behind_gap, behind) = buckets.far_buckets()
    d = np.arange(-3 * max_distance - 50, 3 * max_distance + 50)
    want = t5_bucket(d, num_buckets, bidirectional, max_distance)
    assert (want[d >= ahead_gap] == ahead).all() and want[d == ahead_gap - 1] != ahead
    assert (want[d <= -behind_gap] == behind).all()
    if bidirectional:
        assert want[d == 1 - behind_gap] != behind


def test_buckets_at_far_distances_and_exact_boundaries():
    buckets = scores.RelativeBuckets(32, True, 128)
    # 16 is max_exact * 2: log(2) / log(16) * 8 = 2 exactly, bucket 8 + 2.
    d = np.array([16, 15, 2**30 - 1, -(2**30), 127, 128, 0, -1])
    got = np.asarray(buckets.bucket(jnp.asarray(d, jnp.int32))).tolist()
    assert got == [10, 9, 15, 31, 15, 15, 0, 17]


def test_score_terms_apply_in_order():
    """ALiBi, then the table, then the function, on broadcastable coordinates."""
    terms = scores.ScoreTerms(slopes=jnp.array([0.5, 2.0]), table=jnp.arange(16.0).reshape(2, 8),
                              buckets=scores.RelativeBuckets(8, True, 20),
                              function=lambda s, h, q, k: s * 10.0)
    head = jnp.arange(2)[:, None, None]
    qp, kp = jnp.array([[3]]), jnp.array([[0, 5]])
    got = terms.apply(jnp.zeros((2, 1, 2)), head, qp, kp)
    # Key 0 before query 3: distance 3, bucket 2 (2 exact buckets, 3 < 7 = the next
    # threshold); key 5 after it: distance -2, bucket 4 + 2 = 6. Head 1: 2.0 * 2 + 14 = 18.
    np.testing.assert_allclose(got, [[[10 * (-1.5 + 2), 10 * (1.0 + 6)]],
                                     [[10 * (-6.0 + 10), 10 * (4.0 + 14)]]])
    assert terms.kinds == ("alibi", "relative_bias", "function")


# ---------------------------------------------------------------------------------------------
# Errors: one line naming the argument.

TABLE = jnp.zeros((4, 8))
Q = jnp.ones((1, 4, 16, 8))
K = jnp.ones((1, 2, 16, 8))


@pytest.mark.parametrize("make,error,message", [
    (lambda: scores.RelativePositionBias(jnp.zeros((4, 8), jnp.int32)), TypeError,
     r"^`table` must be a float array \[heads, num_buckets\]; got dtype int32\.$"),
    (lambda: scores.RelativePositionBias(jnp.zeros(8)), ValueError,
     r"^`table` must have shape \[heads, num_buckets\]; got \(8,\)\.$"),
    (lambda: scores.RelativePositionBias("table"), TypeError,
     r"^`table` must be a float array \[heads, num_buckets\]; got str\.$"),
    (lambda: scores.RelativePositionBias(TABLE, bidirectional=1), TypeError,
     r"^`bidirectional` must be a bool; got int\.$"),
    (lambda: scores.RelativePositionBias(TABLE, max_distance=2.5), TypeError,
     r"^`max_distance` must be an integer; got 2\.5\.$"),
    (lambda: scores.RelativePositionBias(TABLE, max_distance=2), ValueError,
     r"^`max_distance` must be an integer above max_exact = 2 .*; got 2\.$"),
    (lambda: scores.RelativePositionBias(TABLE, max_distance=2**36), ValueError,
     r"^`max_distance` must be below 2\*\*31 \(distances are int32\); got 68719476736\.$"),
    (lambda: scores.RelativeBuckets(8, max_distance=2**31), ValueError,
     r"^`max_distance` must be below 2\*\*31 "),
    (lambda: scores.RelativePositionBias(jnp.zeros((4, 3))), ValueError,
     r"^`num_buckets` must be at least 4 \(bidirectional=True\); got 3\.$"),
    (lambda: scores.ALiBi(jnp.zeros((4, 1))), ValueError,
     r"^`slopes` must have shape \[heads\]; got \(4, 1\)\.$"),
    (lambda: scores.ALiBi(jnp.arange(4)), TypeError,
     r"^`slopes` must be a float array \[heads\]; got dtype int32\.$"),
    (lambda: bsa.BlockSparseAttention(score=scores.ALiBi(learned=True)).plan(Q, K, K),
     ValueError, r"^ALiBi\(learned=True\) needs its initial `slopes`, e\.g\. "),
    (lambda: scores.ALiBi(learned=1), TypeError, r"^`learned` must be a bool; got int\.$"),
    (lambda: scores.ScoreFunction(3), TypeError, r"^`fn` must be callable; got int\.$"),
    (lambda: bsa.BlockSparseAttention(score=masks.Causal()), TypeError,
     r"^`score` must be an AbstractScore .* or None; got Causal\.$"),
])
def test_bad_score_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("score,message", [
    (scores.RelativePositionBias(jnp.zeros((2, 8))),
     r"^`table` must have one row per query head, \[4, num_buckets\]; got \(2, 8\)\.$"),
    (scores.ALiBi(jnp.ones(2)),
     r"^`slopes` must have one entry per query head, \[4\]; got \(2,\)\.$"),
])
def test_head_count_is_checked_per_call(score, message):
    # Query heads (4), not kv heads (2): GQA's kv heads share nothing of a score term.
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), score=score)
    with pytest.raises(ValueError, match=message):
        attn.plan(Q, K, K)
    with pytest.raises(ValueError, match=message):
        bsa.MultiheadBlockSparseAttention(4, 32, score=score, key=jax.random.key(0))


BAD_SLOPES = jnp.array([0.5, jnp.inf, 0.1, 0.2])
BAD_TABLE = TABLE.at[1, 3].set(jnp.nan)
SLOPES_MESSAGE = r"^`slopes` must be finite; got inf or NaN\.$"
TABLE_MESSAGE = (r"^`table` must be finite or -inf \(which hides the pairs of that bucket\); "
                 r"got \+inf or NaN\.$")


@pytest.mark.parametrize("score,message", [
    (scores.ALiBi(BAD_SLOPES, learned=True), SLOPES_MESSAGE),
    (scores.RelativePositionBias(BAD_TABLE), TABLE_MESSAGE),
    (scores.RelativePositionBias(TABLE.at[0, 0].set(jnp.inf)), TABLE_MESSAGE),
])
def test_non_finite_score_arrays_are_refused(score, message):
    """A concrete array is refused when the call is planned or made."""
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), score=score)
    with pytest.raises(ValueError, match=message):
        attn.plan(Q, K, K)
    with pytest.raises(ValueError, match=message):
        attn(Q, K, K)


_BAD_ARRAYS = {"nan-slope": lambda s, t: (s.at[2].set(jnp.nan), t),
               "inf-slope": lambda s, t: (s.at[0].set(-jnp.inf), t),
               "inf-entry": lambda s, t: (s, t.at[3, 5].set(jnp.inf)),
               "nan-entry": lambda s, t: (s, t.at[1, 0].set(jnp.nan))}
#: The quick tier's pairs: a bad slope through XlaBlockSparse, a bad table entry through
#: DenseReference; the other pairs are `slow`.
_BAD_QUICK = {("nan-slope", 0), ("inf-entry", 1)}


@pytest.mark.parametrize("kernel,bad", [
    pytest.param(kernel, bad, id=f"{name}-kernel{i}",
                 marks=() if (name, i) in _BAD_QUICK else pytest.mark.slow)
    for name, bad in _BAD_ARRAYS.items()
    for i, kernel in enumerate((kernels.XlaBlockSparse(), kernels.DenseReference()))])
def test_traced_score_arrays_gone_bad_make_every_row_nan(kernel, bad):
    """Learned slopes or a learned table that hold a bad entry inside a trace (a training
    step) make every row that sees a key NaN, and every gradient too: the whole array is
    poisoned, not just the pairs that read the entry, with no run-time conditional. A row
    that sees no key stays zero; -inf entries alone are valid (they hide)."""
    q = jax.random.normal(jax.random.key(0), (1, 4, 16, 8))
    slopes = jnp.asarray(scores.alibi_slopes(4))
    table = 0.1 * jax.random.normal(jax.random.key(1), (4, 8))
    mask = masks.Causal(offset=-4)  # the first four queries see no key

    def loss(q, slopes, table):
        score = SlopesAndTable(slopes, table)
        out = bsa.BlockSparseAttention(mask=mask, kernel=kernel, score=score)(q, q, q)
        return jnp.sum(out), out

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    (dq, dslopes, dtable), out = step(q, slopes, table.at[:, 0].set(-jnp.inf))
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(dq)).all()
    (dq, dslopes, dtable), out = step(q, *bad(slopes, table))
    out = np.asarray(out)
    assert np.isnan(out[:, :, 4:]).all() and (out[:, :, :4] == 0).all()
    # q is also the keys and values here, so its gradient reaches every row.
    assert np.isnan(np.asarray(dq)).all() and np.isnan(np.asarray(dslopes)).all()
    # An entry that no visible pair reads (the hidden distances 0 to 3, a bucket between
    # this sequence's distances) may have a zero gradient; the others are NaN.
    dtable = np.asarray(dtable)
    assert np.isnan(dtable[:, [4, 6, 7]]).all() and (np.isnan(dtable) | (dtable == 0)).all()


class SlopesAndTable(bsa.contract.AbstractScore):
    """Learned slopes and a learned table in one call."""

    slopes: jax.Array
    table: jax.Array

    def compile(self, num_heads):
        table = scores.RelativePositionBias(self.table, bidirectional=False,
                                            max_distance=6).compile(num_heads)
        return bsa.contract.ScoreTerms(slopes=self.slopes, table=table.table,
                                       buckets=table.buckets)


def test_score_arrays_carry_no_run_time_check():
    """No score array, and no sinks array, puts a run-time check (`eqx.error_if`, a
    conditional around a host callback, which waits on the host before the kernel starts) in
    the trace: the standard slopes are constants checked on the host, and traced slopes,
    tables and sinks are poisoned instead (above)."""
    import re

    def checks_in(call, *args):
        """The run-time checks in the trace of ``call(*args)``."""
        text = str(jax.make_jaxpr(call)(*args))
        return sorted(set(re.findall(r"\b(cond|pure_callback)\b", text)))

    def traced_checks(score_of, *arrays):
        def call(q, *arrays):
            score = score_of(*arrays)
            return bsa.BlockSparseAttention(mask=masks.Causal(), score=score)(q, K, K)

        return checks_in(call, Q, *arrays)

    slopes = jnp.asarray(scores.alibi_slopes(4))
    assert traced_checks(scores.ALiBi) == []
    assert traced_checks(scores.ALiBi, slopes) == []
    assert traced_checks(scores.RelativePositionBias, TABLE) == []
    # Learned sinks are poisoned the same way (tests/test_conformance.py).
    sinks_call = lambda q, s: bsa.BlockSparseAttention(mask=masks.Causal())(q, K, K, sinks=s)
    assert checks_in(sinks_call, Q, jnp.zeros((4,))) == []
    # The same tracer test sees the checks that remain elsewhere (a traced bias).
    bias_call = lambda q, b: bsa.BlockSparseAttention(mask=masks.Causal())(q, K, K, bias=b)
    assert "pure_callback" in checks_in(bias_call, Q, jnp.zeros((16, 16)))


def test_minus_inf_in_the_table_hides_its_bucket():
    table = jnp.zeros((4, 8)).at[:, 0].set(-jnp.inf)  # distance 0: the diagonal
    q = jax.random.normal(jax.random.key(0), (1, 4, 16, 8))
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.XlaBlockSparse(),
                                    score=scores.RelativePositionBias(table, bidirectional=False))
    out = np.asarray(attn(q, q, q))
    strict = bsa.BlockSparseAttention(mask=masks.Causal(offset=-1),
                                      kernel=kernels.DenseReference())(q, q, q)
    np.testing.assert_allclose(out, strict, rtol=1e-5, atol=1e-6)
    assert np.all(out[:, :, 0] == 0)  # the first query saw only itself


def test_score_under_ring_attention_on_one_device():
    """RingAttention passes the terms to each step's call (a one-device ring here; the
    8-device cases are in tests/test_sharding.py): output and the gradients of q and the
    learned slopes equal the unsharded call's."""
    mesh = jax.make_mesh((1,), ("seq",))
    q, k, v = (jax.random.normal(jax.random.key(i), s.shape) for i, s in enumerate((Q, K, K)))
    slopes = jnp.asarray(scores.alibi_slopes(4)) * 1.5
    proj = jax.random.normal(jax.random.key(3), Q.shape)

    def run(sharding):
        def attend(q, slopes):
            return bsa.BlockSparseAttention(
                mask=masks.Causal(), kernel=kernels.DenseReference(),
                score=scores.ALiBi(slopes, learned=True), sharding=sharding)(q, k, v)

        def both(q, slopes):
            out, pullback = jax.vjp(attend, q, slopes)
            return out, pullback(proj)

        return jax.jit(both)(q, slopes)

    (out, grads), (ref, want) = run(bsa.sharding.RingAttention(mesh, "seq")), run(bsa.Unsharded())
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want):
        assert np.abs(w).max() > 0
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_score_under_a_sharding_that_does_not_pass_it_is_refused():
    class Dropping(bsa.Unsharded):
        passes_score = False

    attn = bsa.BlockSparseAttention(mask=masks.Causal(), score=scores.ALiBi(),
                                    sharding=Dropping())
    with pytest.raises(ValueError, match=r"^`score` terms need a sharding that passes them to "
                                         r"each shard's call \(passes_score\); this module's "
                                         r"sharding Dropping does not\. Drop the sharding or "
                                         r"the score\.$"):
        attn.plan(Q, K, K)


# ---------------------------------------------------------------------------------------------
# Which kernels take them.


_FUNCTION = scores.ScoreFunction(lambda s, h, q, k: s)


@pytest.mark.parametrize("kernel,score,declared", [
    *((k, s, r"\(\)") for k in ("cudnn", "splash")
      for s in (scores.ALiBi(), scores.RelativePositionBias(TABLE), _FUNCTION)),
    # Triton evaluates ALiBi and the table in its kernels; a jnp function cannot be traced in.
    ("triton", _FUNCTION, r"\('alibi', 'relative_bias'\)")])
def test_gpu_and_tpu_kernels_decline_score_terms(kernel, score, declared):
    kind = score.compile(4).kinds[0]
    kernel_cls = next(c for c in bsa.registered_kernels() if c.name == kernel)
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernel_cls(), score=score)
    platform = kernel_cls.platforms[0]
    with pytest.raises(ValueError, match=rf"^kernel {kernel} cannot run this call: does not "
                                         rf"evaluate the score terms {kind} \(it declares "
                                         rf"score_kinds={declared}\)\.$"):
        attn.plan(Q.astype(jnp.bfloat16), K.astype(jnp.bfloat16), K.astype(jnp.bfloat16),
                  platform=platform)


def test_triton_is_not_declined_for_alibi_or_relative_bias():
    """The selector passes ALiBi and a table to Triton (here it declines only where jax-triton
    is missing, for that reason) and to Mosaic once its table has run on a GPU (until then it
    declines the table for that reason); cuDNN declines both."""
    from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse

    features = bsa.Features(platform="gpu", dtype="bfloat16", head_dim=128, value_dim=128,
                            score=("alibi", "relative_bias"))
    explain = bsa.select_kernel(masks.Causal(), "gpu", features).explain()
    lines = {line.split(":")[0].strip(): line for line in explain.splitlines()[1:]}
    assert "score terms" in lines["declined cudnn"]
    mosaic = lines.get("declined mosaic", "")
    assert "score terms" not in mosaic
    assert ("has not yet run on a GPU" in mosaic) == (
        MosaicBlockSparse.awaits_device_run("t5_table"))
    assert "score terms" not in lines.get("declined triton", "")


def test_mosaic_is_not_declined_for_alibi():
    """ALiBi alone passes the selector's score check for Mosaic (judged as on a Hopper GPU,
    also from a CPU)."""
    features = bsa.Features(platform="gpu", dtype="bfloat16", head_dim=128, value_dim=128,
                            score=("alibi",))
    explain = bsa.select_kernel(masks.Causal(), "gpu", features).explain()
    lines = {line.split(":")[0].strip(): line for line in explain.splitlines()[1:]}
    assert "score terms" not in lines.get("declined mosaic", "")
    assert "score terms alibi" in lines["declined cudnn"]


def test_selector_explains_the_decline_and_plan_names_the_terms():
    features = bsa.Features(platform="gpu", dtype="bfloat16", num_heads=4, num_kv_heads=2,
                            q_len=4096, kv_len=4096, score=("alibi",))
    choice = bsa.select_kernel(masks.Causal(), platform="gpu", features=features)
    assert choice.kernel.name == "mosaic"  # what a Hopper GPU runs, asked from any machine
    assert "does not evaluate the score terms alibi" in choice.explain()
    plan = bsa.BlockSparseAttention(mask=masks.Causal(), score=scores.ALiBi()).plan(Q, K, K)
    assert "score terms: alibi (slopes [4])" in str(plan)


# ---------------------------------------------------------------------------------------------
# No [Lq, Lk] array, and the other ways in.


def _largest_intermediate(jaxpr) -> int:
    """The most elements of any value in `jaxpr`, its sub-jaxprs (loops, custom rules) too."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, int(np.prod(getattr(var.aval, "shape", ()))))
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (tuple, list)) else (param,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    largest = max(largest, _largest_intermediate(inner))
    return largest


@pytest.mark.parametrize("score", [scores.ALiBi(), scores.RelativePositionBias(jnp.ones((2, 32))),
                                   scores.ScoreFunction(lambda s, h, q, k: s - abs(q - k))])
def test_xla_forms_no_lq_by_lk_array(score):
    """Forward and backward: the score terms add no value larger than the same call without
    them forms (the scores of one slot of blocks, ``L x block_kv`` per head), far below
    ``Lq x Lk``."""
    length = 2048
    q = jnp.ones((1, 2, length, 16))

    def largest(score):
        attn = bsa.BlockSparseAttention(mask=masks.Causal() & masks.SlidingWindow(128, 0),
                                        kernel=kernels.XlaBlockSparse(), score=score)
        jaxpr = jax.make_jaxpr(jax.grad(lambda q: attn(q, q, q).sum()))(q).jaxpr
        return _largest_intermediate(jaxpr)

    with_score = largest(score)
    assert with_score <= largest(None)
    assert with_score <= 2 * length * 128


@pytest.mark.slow
def test_layer_learns_the_table():
    """The table is a parameter of the layer: its gradient matches the oracle's."""
    heads, size, length = 4, 32, 40
    table = 0.3 * jax.random.normal(jax.random.key(1), (heads, 16))
    layer = bsa.MultiheadBlockSparseAttention(
        heads, size, mask=masks.Causal(), kernel=kernels.XlaBlockSparse(),
        tiling=bsa.Tiling(block_q=16, block_kv=16),
        score=scores.RelativePositionBias(table, bidirectional=False, max_distance=30),
        key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(2), (length, size))
    grads = eqx.filter_grad(lambda m: jnp.sum(jnp.sin(m(x, x, x))))(layer)
    got = grads.attention.score.table
    with jax.enable_x64(True):
        f64 = jax.tree.map(lambda a: a.astype(jnp.float64) if eqx.is_array(a) else a, layer)
        x64 = x.astype(jnp.float64)
        pos = np.arange(length)[None]

        def oracle(table):
            q, k, v = (f64._heads(p, x64, heads)[None]
                       for p in (f64.query_proj, f64.key_proj, f64.value_proj))
            vis = np.tril(np.ones((length, length), bool))
            out = jnp_attention_f64(q, k, v, vis, score=lambda s: score_f64(
                s, q_pos=pos, kv_pos=pos, table=table, bidirectional=False, max_distance=30))
            out = jnp.transpose(out[0], (1, 0, 2)).reshape(length, -1)
            return jnp.sum(jnp.sin(jax.vmap(f64.output_proj)(out)))

        want = jax.grad(oracle)(jnp.asarray(np.asarray(table, np.float64)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    assert np.abs(want).max() > 0


@pytest.mark.slow
def test_seed_style_call_takes_a_score():
    q = jax.random.normal(jax.random.key(0), (1, 4, 33, 8))
    k = jax.random.normal(jax.random.key(1), (1, 2, 33, 8))
    got = bsa.blocksparse_attention(q, k, k, causal=True, sliding_window=(8, 0),
                                    score=scores.ALiBi(), platform="xla")
    want = bsa.BlockSparseAttention(mask=masks.Causal() & masks.SlidingWindow(8, 0),
                                    kernel=kernels.DenseReference(), score=scores.ALiBi())(q, k, k)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    plain = bsa.blocksparse_attention(q, k, k, causal=True, sliding_window=(8, 0), platform="xla")
    assert not np.allclose(got, plain, atol=1e-3)


@pytest.mark.slow
def test_fixed_slopes_have_no_gradient_and_learned_ones_do():
    q = jax.random.normal(jax.random.key(0), (2, 24, 8))
    slopes = jnp.asarray(scores.alibi_slopes(2))

    def grad_of(learned):
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.XlaBlockSparse(),
                                        score=scores.ALiBi(slopes, learned=learned))
        return eqx.filter_grad(lambda m: jnp.sum(m(q, q, q) ** 2))(attn).score.slopes

    assert np.all(np.asarray(grad_of(False)) == 0)
    assert np.all(np.abs(np.asarray(grad_of(True))) > 0)


# ---------------------------------------------------------------------------------------------
# Score functions: params (learned or per call), the batch index, the signature's errors.

B, H, HKV, LQ, LK, D = 2, 4, 2, 37, 45, 8


def _table_by_distance(score, head, q_pos, k_pos, params):
    """A learned table of clipped distances and a per-batch scale read by keyword."""
    return score + params["table"][head, jnp.clip(q_pos - k_pos, 0, 15)] * params["scale"]


def _table_and_batch(score, head, q_pos, k_pos, params, batch):
    return _table_by_distance(score, head, q_pos, k_pos, params) - 0.25 * batch * (head + 1)


def _batch_only(score, head, q_pos, k_pos, *, batch):
    return jnp.tanh(score) * (1.0 + batch) + 0.1 * jnp.sin(q_pos * 0.7 + k_pos * 1.3 + head)


def _score_case(fn, with_params):
    keys = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(keys[0], (B, H, LQ, D))
    k = jax.random.normal(keys[1], (B, HKV, LK, D))
    v = jax.random.normal(keys[2], (B, HKV, LK, D))
    params = None
    if with_params:
        params = {"table": jax.random.normal(keys[3], (H, 16)), "scale": jnp.float32(0.8)}
    return (q, k, v), params


SCORE_FUNCTIONS = {"params": (_table_by_distance, True, False),
                   "params_batch": (_table_and_batch, True, True),
                   "batch": (_batch_only, False, True)}
#: The quick tier runs the batch index on the reference (params' gradients: the tests below);
#: the full tier params with the batch index on XLA and params on the reference
#: (`SCORE_FULL`); the rest is extended.
SCORE_DEFAULT = {("reference", "batch")}
SCORE_FULL = {("xla", "params_batch"), ("reference", "params")}
# bottom-right causal with a window over Lq != Lk, so both FULL and PARTIAL blocks of 16.
SCORE_MASK = masks.Causal(bottom_right=True) & masks.SlidingWindow(20, 0)


@pytest.mark.parametrize("kernel,name", [
    pytest.param(k, n, id=f"{n}-{i}",
                 marks=() if (i, n) in SCORE_DEFAULT else (pytest.mark.slow,)
                 if (i, n) in SCORE_FULL else (pytest.mark.extended,))
    for i, k in (("xla", kernels.XlaBlockSparse()), ("reference", kernels.DenseReference()))
    for n in SCORE_FUNCTIONS])
def test_score_function_with_params_and_batch_matches_the_oracle(kernel, name):
    """Forward and every gradient (q, k, v and the params) against the float64 oracle, with
    GQA, Lq != Lk, and the batch index where the function asks for it."""
    fn, with_params, with_batch = SCORE_FUNCTIONS[name]
    (q, k, v), params = _score_case(fn, with_params)
    tiling = bsa.Tiling(block_q=16, block_kv=16)
    if isinstance(kernel, kernels.XlaBlockSparse):
        # A slot of 2^10 scores: each pass runs its q-blocks in chunks, one after another, so
        # the params' gradient is summed over the chunks too.
        tiling = kernels.XlaConfig(block_q=16, block_kv=16, slot_elements=2**10)
    attn = bsa.BlockSparseAttention(mask=SCORE_MASK, kernel=kernel, tiling=tiling,
                                    score=scores.ScoreFunction(fn, params))
    assert attn.score.term.takes_batch == with_batch

    def loss(args):
        out = args[0](*args[1:])
        return jnp.sum(jnp.sin(out)), out

    (_, out), (grads, dq, dk, dv) = eqx.filter_value_and_grad(loss, has_aux=True)(
        (attn, q, k, v))
    vis = np_visibility(SCORE_MASK, batch=1, heads=H, q_len=LQ, kv_len=LK)
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # noqa: E731
        qp = np.arange(LQ)[None, None, :, None]
        kp = np.arange(LK)[None, None, None, :]
        head = np.arange(H)[None, :, None, None]
        batch = np.arange(B)[:, None, None, None]

        def oracle(q, k, v, params):
            args = (jnp.asarray(head), jnp.asarray(qp), jnp.asarray(kp))
            kw = {"batch": jnp.asarray(batch)} if with_batch else {}

            def score(s):
                return fn(s, *args, *(() if params is None else (params,)), **kw)

            return jnp_attention_f64(q, k, v, vis, score=score)

        p64 = None if params is None else jax.tree.map(f64, params)
        want = oracle(f64(q), f64(k), f64(v), p64)
        wants = jax.grad(lambda *a: jnp.sum(jnp.sin(oracle(*a))), argnums=(0, 1, 2, 3))(
            f64(q), f64(k), f64(v), p64)
    assert_close(out, want, 2e-5, "out")
    for got, w, what in zip((dq, dk, dv), wants[:3], ("dq", "dk", "dv")):
        assert_close(got, w, 5e-5, what)
    if with_params:
        assert_close(grads.score.params["table"], wants[3]["table"], 5e-5, "dtable")
        assert np.abs(np.asarray(wants[3]["table"])).max() > 0
        assert_close(grads.score.params["scale"], wants[3]["scale"], 5e-5, "dscale")


def _scaled_with_offsets(score, head, q_pos, k_pos, params):
    """A learned scale per head and an integer offset per head (not differentiable)."""
    shifted = jnp.abs(q_pos - k_pos + params["offset"][head]).astype(jnp.float32)
    return score * params["scale"][head] - 0.05 * shifted


@pytest.mark.parametrize("kernel", [
    pytest.param(kernels.XlaBlockSparse(), marks=pytest.mark.slow), kernels.DenseReference()],
    ids=["xla", "reference"])
def test_params_with_an_integer_leaf_differentiate_in_the_float_ones(kernel):
    """An int32 leaf in `params` takes no gradient (a float0 cotangent); q's and the float
    leaf's gradients match the float64 oracle, with the params closed over and traced."""
    (q, k, v), _ = _score_case(_scaled_with_offsets, False)
    scale = jnp.asarray([0.5, 1.5, -1.0, 2.0])
    offset = jnp.asarray([0, 3, -7, 11], jnp.int32)
    vis = np_visibility(SCORE_MASK, batch=1, heads=H, q_len=LQ, kv_len=LK)

    def loss(q, scale):
        attn = bsa.BlockSparseAttention(
            mask=SCORE_MASK, kernel=kernel, tiling=bsa.Tiling(block_q=16, block_kv=16),
            score=scores.ScoreFunction(_scaled_with_offsets,
                                       {"scale": scale, "offset": offset}))
        return jnp.sum(jnp.sin(attn(q, k, v)))

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, scale)
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # noqa: E731
        head = jnp.asarray(np.arange(H)[None, :, None, None])
        qp, kp = jnp.asarray(np.arange(LQ)[:, None]), jnp.asarray(np.arange(LK)[None, :])

        def oracle(q, scale):
            fn = lambda s: _scaled_with_offsets(  # noqa: E731
                s, head, qp, kp, {"scale": scale, "offset": offset})
            return jnp.sum(jnp.sin(jnp_attention_f64(q, f64(k), f64(v), vis, score=fn)))

        want = jax.grad(oracle, argnums=(0, 1))(f64(q), f64(scale))
    assert_close(got[0], want[0], 5e-5, "dq")
    assert_close(got[1], want[1], 5e-5, "dscale")
    assert np.abs(np.asarray(want[1])).min() > 0


def test_score_function_params_get_gradients_under_jit_per_call():
    """Per-call params (traced under jit, swapped in with eqx.tree_at) give the same result
    as concrete ones, with no retrace for a new value."""
    (q, k, v), params = _score_case(_table_by_distance, True)
    attn = bsa.BlockSparseAttention(mask=SCORE_MASK, kernel=kernels.XlaBlockSparse(),
                                    score=scores.ScoreFunction(_table_by_distance, params))
    traces = []

    @jax.jit
    def call(table):
        traces.append(1)
        swapped = eqx.tree_at(lambda a: a.score.params["table"], attn, table)
        return swapped(q, k, v)

    for scale in (1.0, 2.0):
        got = call(params["table"] * scale)
        swapped = eqx.tree_at(lambda a: a.score.params["table"], attn, params["table"] * scale)
        np.testing.assert_allclose(got, swapped(q, k, v), rtol=1e-5, atol=1e-6)
    assert len(traces) == 1


def test_equal_score_functions_are_one_static_term():
    """The compiled term is equal and hashed by the user function and its flags, so two
    modules built from the same function share their kernel's compiled function; a callable
    object's ``__call__`` is read like a function's signature."""
    a = scores.ScoreFunction(_batch_only).compile(4)
    b = scores.ScoreFunction(_batch_only).compile(4)
    assert a.function == b.function and hash(a.function) == hash(b.function)
    assert a.function != scores.ScoreFunction(_table_by_distance, {"t": 1.0}).compile(4).function

    class Shift:
        def __call__(self, score, head, q_pos, k_pos, params, batch=None):
            return score + params * batch

    term = scores.ScoreFunction(Shift(), jnp.float32(1.0)).term
    assert term.takes_batch and term.takes_params
    assert scores.ScoreTerms(function=lambda s, h, q, k: s).kinds == ("function",)


def flex_score(score, b, h, q_idx, kv_idx):
    return score


@pytest.mark.parametrize("fn,params,want", [
    (flex_score, None, "(score, head, q_pos, k_pos)"),
    (flex_score, 1.0, "(score, head, q_pos, k_pos, params)"),
    (lambda s, h, q: s, None, "(score, head, q_pos, k_pos)"),
    (lambda s, h, q, k: s, jnp.ones(2), "(score, head, q_pos, k_pos, params)"),
    (lambda s, h, q, k, p, extra: s, 1.0, "(score, head, q_pos, k_pos, params)"),
])
def test_score_function_signature_is_checked_when_made(fn, params, want):
    """One line naming the expected signature and the FlexAttention port."""
    with pytest.raises(TypeError) as info:
        scores.ScoreFunction(fn, params)
    message = str(info.value)
    assert "\n" not in message and want in message and "scores.from_flex" in message


def test_score_function_params_must_be_arrays():
    with pytest.raises(TypeError, match=r"^`params` must be a pytree of arrays; got str at "
                                        r"\['name'\]\.$"):
        scores.ScoreFunction(_table_by_distance, {"name": "table"})


def _distance_only(score, head, q_pos, k_pos):
    return -jnp.abs(q_pos - k_pos).astype(jnp.float32)  # broadcasts, but drops the logits


@pytest.mark.parametrize("kernel", [kernels.XlaBlockSparse(), kernels.DenseReference()],
                         ids=["xla", "reference"])
def test_score_function_of_the_wrong_shape_names_itself(kernel):
    """A result that broadcasts against the logits but is not their shape is refused in one
    line naming the function and the expected shape (forward and gradient)."""
    q = jax.random.normal(jax.random.key(0), (1, 2, 16, 8))
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernel,
                                    score=scores.ScoreFunction(_distance_only))
    message = r"^the score function _distance_only must return the logits' shape \("
    with pytest.raises(ValueError, match=message):
        jax.grad(lambda q: jnp.sum(attn(q, q, q)))(q)
    with pytest.raises(ValueError, match=message):
        attn(q, q, q)


@pytest.mark.slow
def test_a_closure_over_a_differentiated_array_names_params():
    """XlaBlockSparse's custom gradient cannot reach an array a score function closes over
    while it is being differentiated: a one-line error names `params` (DenseReference, plain
    autodiff, differentiates it); as `params` both agree."""
    q = jax.random.normal(jax.random.key(0), (1, 2, 16, 8))
    table = jax.random.normal(jax.random.key(1), (2, 8))

    def loss(table, kernel, as_params):
        def closed(s, h, qp, kp):
            return s + table[h, jnp.clip(qp - kp, 0, 7)]

        def explicit(s, h, qp, kp, t):
            return s + t[h, jnp.clip(qp - kp, 0, 7)]

        score = (scores.ScoreFunction(explicit, table) if as_params
                 else scores.ScoreFunction(closed))
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernel, score=score)
        return jnp.sum(jnp.sin(attn(q, q, q)))

    with pytest.raises(TypeError, match=r"closes over an array that is being differentiated; "
                                        r"pass it as `params`"):
        jax.grad(loss)(table, kernels.XlaBlockSparse(), False)
    want = jax.grad(loss)(table, kernels.DenseReference(), False)
    got = jax.grad(loss)(table, kernels.XlaBlockSparse(), True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert np.abs(np.asarray(want)).max() > 0


@pytest.mark.parametrize("kernel", [
    pytest.param(kernels.XlaBlockSparse(), marks=pytest.mark.slow), kernels.DenseReference()],
    ids=["xla", "reference"])
def test_poisoned_table_keeps_a_zero_gradient_where_no_visible_pair_reads(kernel):
    """A traced table with a NaN entry makes every row NaN, and the gradient of every entry a
    visible pair reads; each entry that no visible pair reads (later keys, hidden distances,
    padding of ragged blocks) keeps exactly zero, as documented."""
    length, heads = 37, 4
    q = jax.random.normal(jax.random.key(0), (1, heads, length, 8))
    table = 0.1 * jax.random.normal(jax.random.key(1), (heads, 32))
    mask = masks.Causal(offset=-4)
    buckets = scores.RelativeBuckets(32, True, 20)

    @jax.jit
    def dtable(table):
        score = scores.RelativePositionBias(table, max_distance=20)
        attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, score=score,
                                        tiling=bsa.Tiling(block_q=16, block_kv=16))
        return jax.grad(lambda t: jnp.sum(eqx.tree_at(lambda a: a.score.table, attn, t)(
            q, q, q)))(table)

    d = np.arange(length)[:, None] - np.arange(length)[None, :]
    read = np.unique(np.asarray(buckets.bucket(jnp.asarray(d[d >= 4], jnp.int32))))
    unread = np.setdiff1d(np.arange(32), read)
    assert len(unread) > 16
    grad = np.asarray(dtable(table.at[2, 1].set(jnp.nan)))
    assert np.isnan(grad[:, read]).all()
    assert (grad[:, unread] == 0).all(), np.isnan(grad[:, unread]).mean()


def test_alibi_slopes_index_with_a_traced_head():
    """A hand-written ALiBi reads ``slopes[head]`` with a traced head: the standard slopes are
    a JAX array (NumPy raised TracerArrayConversionError), and the function matches the
    built-in ALiBi."""
    slopes = scores.alibi_slopes(4)
    assert isinstance(slopes, jax.Array) and slopes.dtype == jnp.float32
    # Concrete under a trace too: NumPy (an oracle, the plan's host check) still reads it.
    jax.jit(lambda: np.asarray(scores.alibi_slopes(4)).sum())()

    def alibi(score, head, q_pos, k_pos):
        return score + slopes[head] * (k_pos - q_pos)

    q, k, v = (random_array(s, (1, 4, 32, 8)) for s in (1, 2, 3))
    tiles = bsa.Tiling(block_q=16, block_kv=16)
    mine = bsa.BlockSparseAttention(mask=masks.Causal(), score=scores.ScoreFunction(alibi),
                                    kernel=kernels.XlaBlockSparse(), tiling=tiles)
    builtin = eqx.tree_at(lambda a: a.score, mine, scores.ALiBi())
    np.testing.assert_allclose(np.asarray(jax.jit(mine)(q, k, v)),
                               np.asarray(builtin(q, k, v)), rtol=1e-5, atol=1e-6)
