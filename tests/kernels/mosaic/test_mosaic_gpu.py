"""`MosaicBlockSparse` on a Hopper GPU: forward and gradients (its single-pass backward and
its deterministic one) against the float32 dense reference for each mask family it expresses,
the edges (ragged lengths, Lq != Lk, one query, fully masked rows, grouped-query heads, head
dims 64 / 128, float16), sinks, a soft cap and the log-sum-exp, run-to-run identical results
in the deterministic mode, and what it declines.

The GPU tests skip unless JAX's default backend is a GPU. Slow tests run the forward kernel,
and the forward then each backward, in Pallas' CPU interpreter for Mosaic GPU (plain products
in place of wgmma there).
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks, scores
from eqx_bsattn._score_alibi import as_alibi
from eqx_bsattn.strategies.kernels import DenseReference
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse
from tests.conftest import widths_by_head

gpu_only = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]
#: The two backward modes, as `MosaicBlockSparse(deterministic=...)`.
MODES = pytest.mark.parametrize("deterministic", [False, True],
                                ids=["single_pass", "deterministic"])


def on_gpu(test):
    for mark in gpu_only:
        test = mark(test)
    return test

# Relative error in norm, ||out - ref|| / ||ref||, by input dtype (q, k, v and p rounded).
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def _rel(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    assert np.all(np.isfinite(a)), "non-finite values"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(seed, batch, heads, kv_heads, q_len, kv_len, dim):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (batch, heads, q_len, dim), jnp.float32)
    k = jax.random.normal(ks[1], (batch, kv_heads, kv_len, dim), jnp.float32)
    v = jax.random.normal(ks[2], (batch, kv_heads, kv_len, dim), jnp.float32)
    cot = jax.random.normal(ks[3], (batch, heads, q_len, dim), jnp.float32)
    return q, k, v, cot


def _run(kernel, mask, dtype, q, k, v, cot, data, grads):
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel)
    f = lambda q, k, v: attn(q.astype(dtype), k.astype(dtype), v.astype(dtype), **data)  # noqa: E731
    if not grads:
        return (jax.jit(f)(q, k, v),)

    def both(q, k, v):
        out, pullback = jax.vjp(f, q, k, v)
        return (out, *pullback(cot.astype(out.dtype)))

    return jax.jit(both)(q, k, v)


def _segments(batch, length, docs, pad, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.integers(0, docs, (batch, length)), axis=1).astype(np.int32)
    if pad:
        ids[:, -pad:] = -1
    return jnp.asarray(ids)


def window_by_head(q, k, head):
    """A mask without terms that varies by head: keys at most 30 + 40 * head before the
    query, and none after it."""
    return (k <= q) & (q - k < 30 + 40 * head)


CASES = {
    # name: (mask, batch, heads, kv_heads, q_len, kv_len, dim, dtype, segment ids, grads)
    "causal": (masks.Causal(), 2, 4, 4, 512, 512, 128, jnp.bfloat16, False, True),
    "window": (masks.Causal() & masks.SlidingWindow(100, 0), 1, 4, 2, 640, 640, 128,
               jnp.bfloat16, False, True),
    "document": (masks.Causal() & masks.Document(), 2, 2, 2, 700, 700, 64, jnp.bfloat16, True,
                 True),
    "chunked": (masks.ChunkedCausal(96), 1, 2, 1, 384, 384, 64, jnp.float16, False, False),
    "prefix": (masks.PrefixLM(70), 1, 2, 2, 300, 300, 64, jnp.bfloat16, False, False),
    "full_ragged": (masks.Full(), 1, 2, 2, 200, 333, 128, jnp.float16, False, True),
    "one_query": (masks.Causal(), 1, 2, 1, 1, 257, 128, jnp.bfloat16, False, False),
    # A negative offset: the first 150 rows see no key (zeros, never NaN).
    "empty_rows": (masks.Causal(offset=-150), 1, 2, 2, 384, 200, 64, jnp.bfloat16, False,
                   True),
    # Masks without in-kernel terms (the element predicate on partial blocks): by head with
    # grouped heads; dilated keys or global tokens within padded documents; causal less a
    # window, Lq != Lk.
    "predicate_by_head": (masks.Predicate(window_by_head), 1, 4, 2, 640, 640, 128,
                          jnp.bfloat16, False, True),
    "dilated_or_global_documents": (((masks.Dilated(2) & masks.Causal())
                                     | masks.GlobalTokens(8)) & masks.Document(), 2, 2, 2,
                                    700, 700, 64, jnp.bfloat16, True, True),
    "not_window_cross": (masks.Causal(bottom_right=True) & ~masks.SlidingWindow(100, 0), 1, 2,
                         1, 384, 520, 128, jnp.float16, False, True),
    # A predicate that reads an array: the element map (per batch row: it reads the ids).
    "array_documents": (masks.ArrayMask(np.random.default_rng(5).random((700, 700)) < 0.5)
                        & masks.Document(), 2, 2, 2, 700, 700, 64, jnp.bfloat16, True, True),
}


@on_gpu
@MODES
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(case, deterministic):
    mask, b, h, hkv, lq, lk, d, dtype, seg, grads = CASES[case]
    grads = grads or not deterministic  # every case's gradients through the single pass
    q, k, v, cot = _inputs(hash(case) % 1000, b, h, hkv, lq, lk, d)
    data = {}
    if seg:
        ids = _segments(b, lq, 4, pad=7)
        data = {"q_segment_ids": ids, "kv_segment_ids": ids}
    got = _run(MosaicBlockSparse(deterministic=deterministic), mask, dtype, q, k, v, cot, data,
               grads)
    with jax.default_matmul_precision("highest"):
        want = _run(DenseReference(), mask, jnp.float32, q, k, v, cot, data, grads)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        if case == "one_query" and name in ("dq", "dk"):
            # Top-left causal: the query sees one key, so its exact dq and dk are 0 (a
            # relative error is undefined); rounding leaves at most a trace.
            assert float(jnp.max(jnp.abs(g.astype(jnp.float32)))) < 1e-3, name
            continue
        assert _rel(g, w) < TOL[dtype], name


def _with_lse(kernel, mask, dtype, q, k, v, sinks, soft_cap, weights):
    """Output, log-sum-exp and the gradients in q, k, v and the sinks of a loss on both
    (rows that see no key weigh nothing in the log-sum-exp, which is -inf there)."""
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, logits_soft_cap=soft_cap)
    w_out, w_lse = weights

    def run(q, k, v, sinks):
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        plan = attn.plan(q, k, v, sinks=sinks)
        return plan.kernel.attention_with_lse(
            q, k, v, mask=plan.mask, inputs=plan.inputs, features=plan.features,
            tiling=plan.tiling, softmax_scale=plan.softmax_scale, logits_soft_cap=soft_cap)

    def loss(*args):
        out, lse = run(*args)
        return (jnp.sum(out.astype(jnp.float32) * w_out)
                + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse))

    out, lse = jax.jit(run)(q, k, v, sinks)
    grads = jax.jit(jax.grad(loss, argnums=range(4)))(q, k, v, sinks)
    return out, lse, grads


@on_gpu
@pytest.mark.parametrize("deterministic,soft_cap,dim", [(False, None, 128), (False, 5.0, 64),
                                                        (True, 5.0, 128)])
@pytest.mark.parametrize("rows", ["window", "empty_rows"])
def test_sinks_soft_cap_and_lse(deterministic, soft_cap, dim, rows):
    """Sinks (joined by the log-sum-exp), a soft cap (in the forward and in both backwards)
    and `attention_with_lse`: output, log-sum-exp and the gradients in q, k, v and the sinks
    through both, against the float32 reference. With
    ``empty_rows`` rows 0..139 see no key: zeros and a log-sum-exp of -inf."""
    mask = (masks.Causal() & masks.SlidingWindow(100, 0) if rows == "window"
            else masks.Causal(offset=-140))
    q, k, v, _ = _inputs(21, 1, 4, 2, 300, 300, dim)
    q = q * 2.0  # logits beyond the cap
    sinks = jax.random.normal(jax.random.key(22), (4, 2), jnp.float32)
    ks = jax.random.split(jax.random.key(23), 2)
    weights = (jax.random.normal(ks[0], (1, 4, 300, dim)), jax.random.normal(ks[1], (1, 4, 300)))
    kernel = MosaicBlockSparse(deterministic=deterministic)
    assert kernel.decline_reason(
        bsa.ResolvedMask(mask, q_len=300, kv_len=300, num_heads=4),
        bsa.Features(platform="gpu", dtype="bfloat16", head_dim=dim, value_dim=dim,
                     sinks=True, soft_cap=soft_cap is not None, lse=True)) is None
    out, lse, grads = _with_lse(kernel, mask, jnp.bfloat16, q, k, v, sinks, soft_cap, weights)
    with jax.default_matmul_precision("highest"):
        w_out, w_lse, w_grads = _with_lse(DenseReference(), mask, jnp.float32, q, k, v, sinks,
                                          soft_cap, weights)
    seen = np.isfinite(np.asarray(w_lse))
    assert np.array_equal(np.isfinite(np.asarray(lse)), seen)
    assert (~seen).any() == (rows == "empty_rows")
    assert _rel(np.asarray(lse)[seen], np.asarray(w_lse)[seen]) < 1e-2
    assert _rel(out, w_out) < TOL[jnp.bfloat16], "out"
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, w_grads):
        assert _rel(g, w) < TOL[jnp.bfloat16], name


ALIBI_CASES = {
    # name: (mask, batch, heads, kv_heads, length, head dim, documents, soft cap)
    "causal_gqa": (masks.Causal(), 2, 4, 2, 512, 128, False, None),
    "window_documents_soft_cap": (masks.Causal() & masks.SlidingWindow(100, 0), 1, 2, 2, 700,
                                  64, True, 5.0),
}


@on_gpu
@MODES
@pytest.mark.parametrize("case", sorted(ALIBI_CASES))
def test_alibi_matches_reference(case, deterministic):
    """Learned ALiBi slopes inside the kernel: output and the gradients in q, k, v and the
    slopes against the float32 reference, in both backward modes."""
    mask, b, h, hkv, length, d, documents, soft_cap = ALIBI_CASES[case]
    q, k, v, cot = _inputs(31, b, h, hkv, length, length, d)
    slopes = jnp.asarray(scores.alibi_slopes(h)) * 4.0  # steep: the term shapes each row
    data = {}
    if documents:
        ids = _segments(b, length, 4, pad=7)
        data = {"q_segment_ids": ids, "kv_segment_ids": ids}

    def run(kernel, dtype):
        def f(q, k, v, slopes):
            attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, logits_soft_cap=soft_cap,
                                            score=scores.ALiBi(slopes, learned=True))
            return attn(q.astype(dtype), k.astype(dtype), v.astype(dtype), **data)

        def both(q, k, v, slopes):
            out, pullback = jax.vjp(f, q, k, v, slopes)
            return (out, *pullback(cot.astype(out.dtype)))

        return jax.jit(both)(q, k, v, slopes)

    # The selector gives ALiBi to this kernel (cuDNN, above it, declines score terms).
    plan = bsa.BlockSparseAttention(mask=mask, score=scores.ALiBi()).plan(
        q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), **data)
    assert plan.choice.kernel.name == "mosaic", plan.choice.explain()
    kernel = MosaicBlockSparse(deterministic=deterministic)
    got = run(kernel, jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        want = run(DenseReference(), jnp.float32)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dslopes"), got, want):
        assert _rel(g, w) < TOL[jnp.bfloat16], name


FUNCTION_CASES = {
    # name: (mask, batch, heads, kv_heads, length, head dim, score function, soft cap)
    "alibi_function_causal_gqa": (masks.Causal(), 2, 4, 2, 512, 128, "function_alibi", None),
    "hiding_window_soft_cap": (masks.Causal() & masks.SlidingWindow(100, 0), 1, 2, 2, 700, 64,
                               "function_hiding", 5.0),
    "quadratic_ragged": (masks.Causal(bottom_right=True), 1, 2, 1, 333, 64,
                         "function_after_alibi_soft_cap", None),
}


def _function_run(kernel, case, dtype):
    """Output and gradients in q, k, v of `FUNCTION_CASES[case]` through `kernel`."""
    mask, b, h, hkv, length, d, fn, soft_cap = FUNCTION_CASES[case]
    q, k, v, cot = _inputs(41, b, h, hkv, length, length, d)
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, logits_soft_cap=soft_cap,
                                    score=scores.ScoreFunction(SCORE_FUNCTIONS[fn]))

    def both(q, k, v):
        out, pullback = jax.vjp(
            lambda q, k, v: attn(q.astype(dtype), k.astype(dtype), v.astype(dtype)), q, k, v)
        return (out, *pullback(cot.astype(out.dtype)))

    return jax.jit(both)(q, k, v)


@on_gpu
@MODES
@pytest.mark.parametrize("case", sorted(FUNCTION_CASES))
def test_score_function_matches_reference(case, deterministic):
    """A score function traced into the forward and backward kernels: output and gradients
    against the float32 reference in both backward modes (pairs and rows the function hides
    give zeros, never NaN); the selector gives such a call to this kernel. Each function
    runs as one (none is rewritten to built-in ALiBi)."""
    mask, b, h, hkv, length, d, fn, soft_cap = FUNCTION_CASES[case]
    score = scores.ScoreFunction(SCORE_FUNCTIONS[fn])
    assert as_alibi(score.compile(h), h).function is not None
    x = jnp.zeros((b, h, length, d), jnp.bfloat16)
    plan = bsa.BlockSparseAttention(mask=mask, logits_soft_cap=soft_cap, score=score).plan(
        x, x[:, :hkv], x[:, :hkv])
    assert plan.choice.kernel.name == "mosaic", plan.choice.explain()
    got = _function_run(MosaicBlockSparse(deterministic=deterministic), case, jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        want = _function_run(DenseReference(), case, jnp.float32)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel(g, w) < TOL[jnp.bfloat16], name


@on_gpu
def test_score_function_deterministic_mode_is_bit_identical():
    """Two runs of forward+backward with a score function in the deterministic mode give
    bit-identical outputs and gradients."""
    runs = [[np.asarray(x) for x in _function_run(MosaicBlockSparse(), "hiding_window_soft_cap",
                                                  jnp.bfloat16)] for _ in range(2)]
    for name, a, c in zip(("out", "dq", "dk", "dv"), *runs):
        assert np.array_equal(a, c), name


POSITION_CASES = {
    # name: (mask, heads, kv_heads, q_len, kv_len, head dim, score)
    "causal": (masks.Causal(), 4, 2, 384, 384, 128, None),
    "window_alibi": (masks.Causal() & masks.SlidingWindow(100, 0), 2, 2, 500, 700, 64,
                     "alibi"),
    "chunks_function": (masks.ChunkedCausal(96), 2, 1, 300, 300, 128,
                        "function_after_alibi_soft_cap"),
}


def _positions_run(kernel, case, dtype):
    """Output and gradients (q, k, v and, with ALiBi, the slopes) of `POSITION_CASES[case]`
    with per-call positions through `kernel`: two batch rows, queries at odd steps and keys
    at every step, from negative positions on, each row shifted."""
    mask, h, hkv, lq, lk, d, score = POSITION_CASES[case]
    q, k, v, cot = _inputs(51, 2, h, hkv, lq, lk, d)
    shift = np.arange(2)[:, None] * 5
    data = {"q_positions": jnp.asarray(2 * np.arange(lq)[None] - 31 + shift, jnp.int32),
            "kv_positions": jnp.asarray(np.arange(lk)[None] - 50 + shift, jnp.int32)}
    slopes = jnp.asarray(scores.alibi_slopes(h)) * 4.0

    def f(q, k, v, slopes):
        term = {None: None, "alibi": scores.ALiBi(slopes, learned=True)}.get(score)
        if term is None and score is not None:
            term = scores.ScoreFunction(SCORE_FUNCTIONS[score])
        attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, score=term)
        return attn(q.astype(dtype), k.astype(dtype), v.astype(dtype), **data)

    def both(q, k, v, slopes):
        out, pullback = jax.vjp(f, q, k, v, slopes)
        return (out, *pullback(cot.astype(out.dtype)))

    return jax.jit(both)(q, k, v, slopes)


@on_gpu
@MODES
@pytest.mark.parametrize("case", sorted(POSITION_CASES))
def test_per_call_positions_match_reference(case, deterministic):
    """Per-call positions (a layout built per call) for the mask's terms, ALiBi (its slopes'
    gradient too) and a score function: against the float32 reference in both modes."""
    got = _positions_run(MosaicBlockSparse(deterministic=deterministic), case, jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        want = _positions_run(DenseReference(), case, jnp.float32)
    names = ("out", "dq", "dk", "dv") + (("dslopes",) if POSITION_CASES[case][-1] == "alibi"
                                         else ())
    for name, g, w in zip(names, got, want):
        assert _rel(g, w) < TOL[jnp.bfloat16], name


@on_gpu
def test_fully_masked_rows_are_zero():
    q, k, v, _ = _inputs(5, 1, 2, 2, 256, 256, 128)
    # Rows 0..127 see no key.
    attn = bsa.BlockSparseAttention(mask=masks.Causal(offset=-128), kernel=MosaicBlockSparse())
    out = jax.jit(attn)(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    out = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out))
    assert np.all(out[:, :, :128] == 0.0)
    assert np.all(np.abs(out[:, :, 128:]).sum(-1) > 0)


def _vmapped(kernel, mask, dtype, q, k, v, cot, ids):
    """Forward and gradients of `jax.vmap` over unbatched calls (``[H, L, D]`` inputs and
    ``[L]`` segment ids per example), as `eqx.filter_vmap` of a layer makes them."""
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel)

    def one(q, k, v, ids):
        return attn(q.astype(dtype), k.astype(dtype), v.astype(dtype), q_segment_ids=ids,
                    kv_segment_ids=ids)

    def both(q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: jax.vmap(one)(q, k, v, ids), q, k, v)
        return (out, *pullback(cot.astype(out.dtype)))

    return jax.jit(both)(q, k, v)


@on_gpu
@MODES
def test_vmap_over_examples(deterministic):
    """Three examples of different documents under `jax.vmap`: each example's layout and
    schedule are its own, forward and gradients match the reference."""
    q, k, v, cot = _inputs(11, 3, 2, 2, 300, 300, 64)
    ids = _segments(3, 300, 3, pad=5, seed=4)
    mask = masks.Causal() & masks.Document()
    got = _vmapped(MosaicBlockSparse(deterministic=deterministic), mask, jnp.bfloat16, q, k, v,
                   cot, ids)
    with jax.default_matmul_precision("highest"):
        want = _vmapped(DenseReference(), mask, jnp.float32, q, k, v, cot, ids)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _rel(g, w) < TOL[jnp.bfloat16], name


@on_gpu
def test_declines_with_reasons():
    resolved = bsa.ResolvedMask(masks.Causal(), q_len=128, kv_len=128, num_heads=2)
    kernel = MosaicBlockSparse()
    base = dict(platform="gpu", dtype="bfloat16", head_dim=128, value_dim=128)
    assert kernel.decline_reason(resolved, bsa.Features(**base)) is None
    for change, word in ((dict(dtype="float32"), "dtype"), (dict(head_dim=96, value_dim=96),
                         "head dims"), (dict(value_dim=64), "head dims"),
                         (dict(bias=True, in_loop=True), "bias inside a sharding's loop")):
        why = kernel.decline_reason(resolved, bsa.Features(**{**base, **change}))
        assert why is not None and word in why, (change, why)
    assert kernel.decline_reason(resolved, bsa.Features(**base, bias=True)) is None
    # Per-call positions, with the mask's terms and the score terms.
    assert kernel.decline_reason(resolved, bsa.Features(**base, positions=True)) is None
    assert kernel.decline_reason(resolved, bsa.Features(**base, positions=True,
                                                        score=("alibi", "function"))) is None
    why = kernel.decline_reason(resolved, bsa.Features(**base, positions=True, in_loop=True))
    assert why is not None and "positions" in why and "RingAttention" in why
    # Masks without terms: the element predicate runs in the kernels (an element map where
    # it reads an array), but not inside a sharding's loop.
    dilated = bsa.ResolvedMask(masks.Causal() | masks.Dilated(2), q_len=128, kv_len=128,
                               num_heads=2)
    array = bsa.ResolvedMask(masks.ArrayMask(np.tri(128, dtype=bool)), q_len=128, kv_len=128,
                             num_heads=2)
    for resolved in (dilated, array):
        assert kernel.decline_reason(resolved, bsa.Features(**base)) is None
        why = kernel.decline_reason(resolved, bsa.Features(**base, in_loop=True))
        assert why is not None and "RingAttention" in why


@on_gpu
@pytest.mark.parametrize("case", ["causal", "document", "dilated_or_global_documents"])
def test_deterministic_mode_is_bit_identical(case):
    """Five runs of forward+backward in the deterministic mode give bit-identical outputs and
    gradients; the single pass gives the same gradients to rounding."""
    mask, b, h, hkv, lq, lk, d, dtype, seg, _ = CASES[case]
    q, k, v, cot = _inputs(3, b, h, hkv, lq, lk, d)
    data = {}
    if seg:
        ids = _segments(b, lq, 4, pad=7)
        data = {"q_segment_ids": ids, "kv_segment_ids": ids}
    runs = [[np.asarray(x) for x in _run(MosaicBlockSparse(deterministic=True), mask, dtype,
                                         q, k, v, cot, data, True)] for _ in range(5)]
    for later in runs[1:]:
        for name, a, c in zip(("out", "dq", "dk", "dv"), runs[0], later):
            assert np.array_equal(a, c), name
    single = _run(MosaicBlockSparse(deterministic=False), mask, dtype, q, k, v, cot, data, True)
    for name, a, c in zip(("out", "dq", "dk", "dv"), runs[0], single):
        assert _rel(c, a) < TOL[dtype], name


def test_backward_mode_and_its_tiles(monkeypatch):
    """Deterministic by default; the single pass with ``deterministic=False`` unless XLA's
    deterministic-ops flag is set (or JAX cannot pass the kernel a `jax.Ref`); the plan's
    tiles are the kernel's own (128 x 64 dq, 64 x 128 dk/dv at D = 128) whatever `Tiling` it
    is given; a bad value is refused."""
    from eqx_bsattn.strategies.kernels.mosaic.kernel import refs_reach_kernels

    with pytest.raises(TypeError, match="deterministic"):
        MosaicBlockSparse(deterministic="yes")
    single = MosaicBlockSparse(deterministic=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    assert single.single_pass() == refs_reach_kernels()
    assert not MosaicBlockSparse().single_pass()  # deterministic by default
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0 --xla_gpu_deterministic_ops=true")
    assert not single.single_pass()
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    assert single.single_pass() == refs_reach_kernels()
    resolved = bsa.ResolvedMask(masks.Causal(), q_len=512, kv_len=512, num_heads=2)
    for dim, dq_blocks in ((128, (128, 64)), (64, (128, 128))):
        features = bsa.Features(platform="gpu", dtype="bfloat16", head_dim=dim, value_dim=dim)
        for tiling in (MosaicBlockSparse().default_tiling(features, resolved),
                       MosaicBlockSparse().adapt_tiling(bsa.Tiling(64, 64), features)):
            assert isinstance(tiling, bsa.kernels.MosaicConfig)
            assert tiling.blocks == bsa.PassBlocks((128, 128), dq_blocks, (64, 128))


def _backward_config(dim, **kwargs):
    from eqx_bsattn.strategies.kernels.mosaic.backward import BackwardConfig, backward_blocks

    (_, dq_kv), (dkv_q, _) = backward_blocks(dim)
    shape = dict(batch=1, heads=1, kv_heads=1, q_len=1024, kv_len=1024, true_kv_len=1024,
                 head_dim=dim, softmax_scale=1.0, terms=bsa.MaskTerms(causal_offset=0),
                 dq_block_kv=dq_kv, dkv_block_q=dkv_q, dq_layout_axes=(1, 1),
                 dkv_layout_axes=(1, 1), ctas=132)
    return BackwardConfig(**{**shape, **kwargs})


def test_backward_persistence_choice():
    """Each backward launch is persistent where its static layout's lists are short (a dk/dv
    item of grouped heads walks its group's lists), and then only where two sets of own
    tiles leave room for two ring stages (not the single pass at D = 128); otherwise each
    CTA runs one item and the ring is deeper. A schedule of several items a CTA for a launch
    that is not persistent is refused, and so is one naming an item the launch lacks."""
    from eqx_bsattn.strategies.kernels.mosaic.backward import (
        LAUNCHES, PERSISTENT_MAX_MEAN_BLOCKS, dkv_call, dkv_schedule, dq_call, dq_schedule,
        short_lists)

    short = (np.full((1, 1, 8), PERSISTENT_MAX_MEAN_BLOCKS - 1, np.int32),
             np.ones((1, 1, 8), np.int32))
    long = (short[0] + 1, short[1])
    assert short_lists(*short) and not short_lists(*long)
    # Concrete device arrays are read on the host like NumPy ones.
    assert short_lists(*(jnp.asarray(c) for c in short))
    # An item that walks two lists (a kv head's two query heads) visits twice the blocks.
    assert not short_lists(*(jnp.asarray(c) for c in short), 2)
    assert short_lists(*(c // 2 for c in short), 2)
    seen = {}
    jax.jit(lambda f, p: seen.setdefault("device", short_lists(f, p)))(*short)
    assert seen["device"] is False  # a layout built per call: counts on the device

    for dim, fused_fits, stages in ((128, False, 2), (64, True, 4)):
        cfg = _backward_config(dim, persistent=LAUNCHES)
        assert cfg.persistent_for("dq") and cfg.persistent_for("dkv")
        assert cfg.persistent_for("dkv", fused=True) == fused_fits
        assert cfg.own_buffers("dkv") == 2 and cfg.stages("dkv") == stages
        assert cfg.launch_ctas("dkv", fused=True) == (132 if fused_fits else None)
        flat = _backward_config(dim)
        assert not flat.persistent_for("dq") and flat.own_buffers("dq") == 1
        assert flat.stages("dkv") == 4 and flat.launch_ctas("dkv") is None
        # One launch persistent, the other not.
        dq_only = _backward_config(dim, persistent=("dq",))
        assert dq_only.own_buffers("dq") == 2 and dq_only.own_buffers("dkv") == 1
        assert dq_only.launch_ctas("dq") == 132 and dq_only.launch_ctas("dkv") is None
    with pytest.raises(ValueError, match="`launch` must be one of"):
        cfg.persistent_for("dk")

    cfg = _backward_config(128, persistent=LAUNCHES)
    tiles = 1024 // 128
    counts = (np.arange(tiles, dtype=np.int32)[None, None], np.ones((1, 1, tiles), np.int32))
    items, _ = dq_schedule(cfg, *counts)
    assert items.shape == (tiles, 1)  # fewer items than CTAs: one each
    many_heads = _backward_config(128, persistent=LAUNCHES, heads=64, kv_heads=64)
    items, _ = dkv_schedule(many_heads, *counts, fused=False)
    assert items.shape[0] == 132 and items.shape[1] > 1
    items, _ = dkv_schedule(many_heads, *counts, fused=True)
    assert items.shape[1] == 1  # the single pass at D = 128 is not persistent
    # Grouped heads: a deterministic dk/dv item is a kv head's tile over its 4 query heads,
    # a single-pass item one query head's tile.
    grouped = _backward_config(128, heads=4, kv_heads=1)
    assert grouped.dkv_group(False) == 4 and grouped.dkv_group(True) == 1
    assert dkv_schedule(grouped, *counts, fused=False)[0].shape == (tiles, 1)
    per_query_head = dkv_schedule(grouped, *counts, fused=True)
    assert per_query_head[0].shape == (4 * tiles, 1)

    flat = _backward_config(128)
    x = jnp.zeros((1, 1, 1024, 128), jnp.bfloat16)
    rows = jnp.zeros((1, 1, 1024), jnp.float32)
    lists = tuple(jnp.asarray(c) for c in counts * 2)
    several = (np.zeros((2, 4), np.int32), np.full((2,), 4, np.int32))
    with pytest.raises(ValueError, match="persistent launch"):
        dq_call(flat, x, x, x, x, rows, rows, *lists, schedule=several)
    with pytest.raises(ValueError, match=f"names item {tiles}; the launch has {tiles}"):
        dq_call(flat, x, x, x, x, rows, rows, *lists,
                schedule=(np.arange(tiles + 1, dtype=np.int32)[:, None],
                          np.ones(tiles + 1, np.int32)))
    # The single pass's per-query-head items given to the grouped deterministic launch.
    q4 = jnp.zeros((1, 4, 1024, 128), jnp.bfloat16)
    rows4 = jnp.zeros((1, 4, 1024), jnp.float32)
    with pytest.raises(ValueError, match=f"the launch has {tiles} "):
        dkv_call(grouped, q4, x, x, q4, rows4, rows4, *lists, schedule=per_query_head)


@pytest.mark.parametrize("batch,heads,tiles,ctas", [(1, 1, 1, 132), (1, 3, 7, 4),
                                                     (2, 16, 128, 132), (32, 16, 8, 132)])
@pytest.mark.parametrize("known", [True, False], ids=["host_counts", "device_counts"])
def test_persistent_schedule(batch, heads, tiles, ctas, known):
    """Every work item goes to exactly one CTA, every CTA gets one, no device work is
    needed; with counts known on the host the CTAs' loads differ by at most one item's cost
    (the first-free-CTA rule), heavy tiles first."""
    from eqx_bsattn.strategies.kernels.mosaic.common import decode_item, persistent_schedule

    full = np.broadcast_to(np.arange(tiles, dtype=np.int32), (1, 1, tiles))  # causal-like
    partial = np.ones((batch, 1, tiles), np.int32)
    if known:
        items, counts = persistent_schedule(full, partial, batch, heads, ctas)
    else:
        seen = {}

        def build(f, p):
            seen["schedule"] = persistent_schedule(f, p, batch, heads, ctas)
            return f

        jax.jit(build)(full, partial)
        items, counts = seen["schedule"]
    assert isinstance(items, np.ndarray) and isinstance(counts, np.ndarray)
    total = batch * heads * tiles
    assert items.shape[0] == min(ctas, total) and counts.min() >= 1
    taken = np.concatenate([items[c, :n] for c, n in enumerate(counts)])
    assert sorted(taken.tolist()) == list(range(total))
    cost = lambda i: full[0, 0, int(decode_item(jnp.int32(i), tiles, heads)[2])] + 2.5  # noqa: E731
    loads = [sum(cost(i) for i in items[c, :n]) for c, n in enumerate(counts)]
    if known:
        assert max(loads) - min(loads) <= tiles - 1 + 2.5
        first = [int(decode_item(jnp.int32(i), tiles, heads)[2]) for i in items[:, 0]]
        assert max(first) == tiles - 1  # the heaviest tile starts first
    else:
        # Round-robin, alternately forwards and backwards: balanced over sorted costs.
        assert max(loads) - min(loads) <= 2 * (tiles + 2.5)


def test_grouped_schedule_costs_each_items_query_heads():
    """With ``group > 1`` an item is a kv head's tile over its group's query heads, and its
    cost is the sum of its query heads' lists (plus one): the counts below give a schedule
    that the group's mean, largest or first list, or a constant cost, would not give."""
    from eqx_bsattn.strategies.kernels.mosaic.common import persistent_schedule

    # Four query heads (two kv heads of two), two tiles: FULL counts per query head.
    full = np.array([[[4, 2], [9, 8], [1, 4], [0, 7]]], np.int32)
    partial = np.zeros_like(full)
    items, counts = persistent_schedule(full, partial, 1, 2, 2, heavy_tiles_last=False,
                                        group=2)
    # Items (kv head, tile) are numbered 2 * head + tile and cost 14, 11, 2 and 12; taken
    # tile by tile (0, 2, 1, 3), each to the CTA free first: CTA 0 takes item 0 (14), CTA 1
    # the rest (2 + 11 + 12, each taken while its load was below 14).
    assert [list(items[c, :n]) for c, n in enumerate(counts)] == [[0], [2, 1, 3]]


def _mosaic_interpreter():
    try:
        import jax.experimental.pallas.mosaic_gpu  # noqa: F401
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except Exception:  # noqa: BLE001 - the interpreter is optional (it needs absl)
        return None
    return InterpretGPUParams


@pytest.mark.slow
@pytest.mark.parametrize("case,ctas", [("prefix_gqa_ragged", 3), ("document", 1)])
def test_forward_in_cpu_interpreter(case, ctas):
    """The persistent forward in Pallas' CPU interpreter: 4 work items on 3 CTAs (one CTA
    runs two) or all on one CTA (the Q buffers and the K / V ring carried across items).
    The prefix case has a soft cap."""
    params = _mosaic_interpreter()
    if params is None or jax.default_backend() != "cpu":
        pytest.skip("needs Pallas' Mosaic GPU interpreter on a CPU backend")
    from eqx_bsattn.strategies.kernels.mosaic.forward import (
        BLOCK_Q, ForwardConfig, forward_call, rows_padded)

    heads, kv_heads, lq, lk, d, bk = 2, 1, 200, 300, 64, 128
    data, seg = {}, None
    if case == "document":
        mask, kv_heads, lk = masks.Causal() & masks.Document(), 2, lq
        seg = np.repeat(np.arange(4, dtype=np.int32), [40, 70, 50, 40])
        seg[-9:] = -1
        data = {"q_segment_ids": jnp.asarray(seg[None]), "kv_segment_ids": jnp.asarray(seg[None])}
    else:
        mask = masks.PrefixLM(70)
    resolved = bsa.ResolvedMask(mask, q_len=lq, kv_len=lk, num_heads=heads, **data)
    layout = resolved.layout(BLOCK_Q, bk)
    terms = resolved.kernel_terms([(BLOCK_Q, bk)])
    plq, plk = rows_padded(lq, BLOCK_Q), rows_padded(lk, bk)
    soft_cap = 3.0 if case == "prefix_gqa_ragged" else None
    cfg = ForwardConfig(batch=1, heads=heads, kv_heads=kv_heads, q_len=plq, kv_len=plk,
                        true_kv_len=lk, head_dim=d, block_kv=bk, stages=2, ctas=ctas,
                        softmax_scale=d ** -0.5, terms=terms, soft_cap=soft_cap or 0.0,
                        layout_batch=layout.full_count.shape[0],
                        layout_heads=layout.full_count.shape[1])
    q, k, v, _ = _inputs(7, 1, heads, kv_heads, lq, lk, d)
    q, k, v = (x.astype(jnp.float16) for x in (q * 3.0, k, v))  # logits beyond the cap

    def pad(x, length, fill=0.0):
        widths = [(0, 0)] * (x.ndim - 1) + [(0, length - x.shape[-1])]
        if x.ndim == 4:
            widths = [(0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)]
        return jnp.pad(x, widths, constant_values=fill)

    lists = [jnp.asarray(a, jnp.int32) for a in (layout.full_count, layout.full_index,
                                                 layout.partial_count, layout.partial_index)]
    segs = [] if seg is None else [pad(data["q_segment_ids"], plq, -1),
                                   pad(data["kv_segment_ids"], plk, -2)]
    out, lse = forward_call(cfg, pad(q, plq), pad(k, plk), pad(v, plk), *lists, *segs,
                            interpret=params())
    ref = bsa.BlockSparseAttention(mask=mask, kernel=DenseReference(), logits_soft_cap=soft_cap)
    want = ref(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), **data)
    assert _rel(out[:, :, :lq], want) < TOL[jnp.float16]
    lse = np.asarray(lse[:, :, :lq])
    empty = np.asarray(jnp.abs(want).sum(-1) == 0)
    assert np.all(np.isinf(lse[empty])) and np.all(np.isfinite(lse[~empty]))


@pytest.mark.slow
def test_forward_inside_shard_map_in_cpu_interpreter():
    """The forward inside `shard_map` on a one-device mesh, its lists and segment ids typed
    as varying over the mesh axis (as under `RingAttention` with documents), in Pallas' CPU
    interpreter: the FULL and PARTIAL loops' counts then differ in their mesh-axis types."""
    params = _mosaic_interpreter()
    if params is None or jax.default_backend() != "cpu":
        pytest.skip("needs Pallas' Mosaic GPU interpreter on a CPU backend")
    from eqx_bsattn.strategies.kernels.mosaic.forward import BLOCK_Q, ForwardConfig, forward_call

    heads, length, d = 2, 256, 64
    mask = masks.Causal() & masks.Document()
    ids = jnp.asarray(np.repeat(np.arange(4, dtype=np.int32), [40, 70, 50, 96])[None])
    data = {"q_segment_ids": ids, "kv_segment_ids": ids}
    resolved = bsa.ResolvedMask(mask, q_len=length, kv_len=length, num_heads=heads, **data)
    layout = resolved.layout(BLOCK_Q, 128)
    cfg = ForwardConfig(batch=1, heads=heads, kv_heads=heads, q_len=length, kv_len=length,
                        true_kv_len=length, head_dim=d, block_kv=128, stages=2, ctas=2,
                        softmax_scale=d ** -0.5, terms=resolved.kernel_terms([(BLOCK_Q, 128)]),
                        layout_batch=layout.full_count.shape[0],
                        layout_heads=layout.full_count.shape[1])
    q, k, v, _ = _inputs(5, 1, heads, heads, length, length, d)
    q, k, v = (x.astype(jnp.float16) for x in (q, k, v))
    lists = tuple(jnp.asarray(a, jnp.int32) for a in (
        layout.full_count, layout.full_index, layout.partial_count, layout.partial_index))
    mesh = jax.make_mesh((1,), ("x",))
    spec = jax.sharding.PartitionSpec("x")  # every array's leading axis has size 1
    args = jax.device_put((q, k, v, lists, ids), jax.NamedSharding(mesh, spec))

    def run(q, k, v, lists, ids):
        return forward_call(cfg, q, k, v, *lists, ids, ids, interpret=params())[0]

    out = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec))(*args)
    want = bsa.BlockSparseAttention(mask=mask, kernel=DenseReference())(
        *(x.astype(jnp.float32) for x in (q, k, v)), **data)
    assert _rel(out, want) < TOL[jnp.float16]


BACKWARD_INTERPRETER_CASES = {
    # name: (mask, heads, kv_heads, q_len, kv_len, head_dim, documents, soft cap, ALiBi)
    "causal_gqa_ragged": (masks.Causal(bottom_right=True), 2, 1, 130, 200, 64, False, None,
                          False),
    "window": (masks.Causal() & masks.SlidingWindow(50, 0), 1, 1, 256, 256, 128, False, None,
               False),
    "documents_padded": (masks.Causal() & masks.Document(), 1, 1, 200, 200, 64, True, None,
                         False),
    # A negative offset: rows 0..139 see no key (lse = +inf), whole q-tiles are empty.
    "empty_rows": (masks.Causal(offset=-140), 1, 1, 256, 130, 64, False, None, False),
    # Logits well beyond the cap (inputs scaled by 3 below), so its derivative matters.
    "soft_cap": (masks.PrefixLM(70), 2, 2, 200, 256, 64, False, 2.0, False),
    # Learned ALiBi slopes (their gradient checked too): two kv heads of two query heads
    # each (the dk/dv launch sums a group, each head with its own slope), ragged keys, keys
    # before and after the query index (bottom-right), full and partial blocks, D = 128
    # (the split single pass).
    "alibi": (masks.Causal(bottom_right=True), 4, 2, 200, 300, 128, False, None, True),
    # A window both ways: partial blocks only; one head, whose slope's gradient cancels to
    # 1/900 of its terms' magnitude (`_slope_gradient_scale`).
    "alibi_window": (masks.SlidingWindow(90, 40), 1, 1, 200, 300, 64, False, None, True),
    # ALiBi under a soft cap (both parts of the distance in each logit), a prefix.
    "alibi_soft_cap": (masks.PrefixLM(70), 2, 2, 200, 256, 64, False, 2.0, True),
    # Score functions (`SCORE_FUNCTIONS`): symmetric ALiBi, with grouped heads, ragged
    # keys and D = 128; a tanh cap that hides pairs and whole rows (-inf) under a prefix;
    # built-in ALiBi then a function then the module's soft cap, with documents.
    "function_alibi": (masks.Causal(bottom_right=True), 4, 2, 200, 300, 128, False, None,
                       False),
    "function_hiding": (masks.PrefixLM(70), 2, 1, 200, 256, 64, False, None, False),
    "function_after_alibi_soft_cap": (masks.Causal() & masks.Document(), 2, 2, 200, 200, 64,
                                      True, 2.0, True),
    # Per-call positions (`POSITIONS`), negative ones too, for the mask's terms, ALiBi and a
    # score function (one that hides pairs and rows); ragged keys.
    "positions_alibi_window": (masks.Causal() & masks.SlidingWindow(60, 0), 2, 1, 200, 300,
                               64, False, None, True),
    "positions_function_chunks": (masks.ChunkedCausal(48), 2, 2, 200, 256, 64, False, None,
                                  False),
    # Positions for the mask alone (no score term), documents beside them.
    "positions_documents_window": (masks.Causal() & masks.SlidingWindow(60, 0)
                                   & masks.Document(), 1, 1, 200, 200, 128, True, None, False),
    # Masks without in-kernel terms: the element predicate on the partial blocks' tiles. A
    # predicate by head with grouped heads and ragged keys; dilated keys or global tokens
    # within documents (the predicate reads the ids as passed, padding -1 included); a
    # causal mask less a window, at per-call positions, with a score function.
    "predicate_by_head_gqa": (masks.Predicate(window_by_head), 4, 2, 200, 300, 64, False,
                              None, False),
    "dilated_or_global_documents": (((masks.Dilated(2) & masks.Causal()) | masks.GlobalTokens(8))
                                    & masks.Document(), 2, 2, 200, 200, 128, True, None,
                                    False),
    "positions_not_window_function": (masks.Causal() & ~masks.SlidingWindow(20, 0), 2, 1, 200,
                                      256, 64, False, None, False),
    # Masks whose predicate reads an array: the element map's tiles (transposed in the dk/dv
    # kernel). A boolean array per head with grouped heads, ragged keys; a predicate with
    # params (a window width per head) at per-call positions, D = 128.
    "array_by_head_gqa": (masks.ArrayMask(np.random.default_rng(3).random((2, 200, 300)) < 0.4),
                          2, 1, 200, 300, 64, False, None, False),
    "positions_predicate_params": (masks.Predicate(widths_by_head, jnp.asarray([40, 90])), 2,
                                   2, 200, 256, 128, False, None, False),
}

#: Per-call ``(q_positions, kv_positions)`` of a case's lengths: queries at odd steps from
#: -31, keys at every index from -50 (so that partial blocks, whole empty rows and negative
#: chunks occur).
POSITIONS = {
    "positions_alibi_window": lambda lq, lk: (2 * np.arange(lq) - 31, np.arange(lk) - 50),
    "positions_function_chunks": lambda lq, lk: (2 * np.arange(lq) - 31, np.arange(lk) - 50),
    "positions_documents_window": lambda lq, lk: (np.arange(lq) - 31, np.arange(lk) - 50),
    "positions_not_window_function": lambda lq, lk: (2 * np.arange(lq) - 31,
                                                     np.arange(lk) - 50),
    "positions_predicate_params": lambda lq, lk: (np.arange(lq) + 7, np.arange(lk)),
}



def alibi_function(score, head, q_pos, k_pos):
    """Symmetric ALiBi as a score function, ``score - 2^-(head + 3) |k - q|``: ALiBi on the
    pairs with k <= q, but not affine in the positions, so it runs as a function (ALiBi
    itself would run as built-in slopes: `as_alibi`)."""
    slope = jnp.exp2(-3.0 - jnp.asarray(head).astype(jnp.float32))
    return score - slope * jnp.abs(k_pos - q_pos).astype(jnp.float32)


def capped_and_hiding(score, head, q_pos, k_pos):
    """A tanh cap of 3 that hides every pair with ``q + k = 2 (mod 5)`` and rows 0..23."""
    hidden = ((q_pos + k_pos) % 5 == 2) | (q_pos < 24)
    return jnp.where(hidden, -jnp.inf, 3.0 * jnp.tanh(score / 3.0))


def squared_distance(score, head, q_pos, k_pos):
    """A head-dependent quadratic penalty on the distance, nonlinear in the score."""
    distance = (q_pos - k_pos).astype(jnp.float32) * 0.05
    return score * (1.0 + 0.1 * jnp.asarray(head).astype(jnp.float32)) - distance * distance


SCORE_FUNCTIONS = {"function_alibi": alibi_function, "function_hiding": capped_and_hiding,
                   "function_after_alibi_soft_cap": squared_distance,
                   "positions_function_chunks": capped_and_hiding,
                   "positions_not_window_function": squared_distance}


def _slope_gradient_scale(reference, q, k, v, slopes, cot, q_len, kv_len, positions=None):
    """Per head, ``sum |dS (k - q)|`` over every pair (`positions` ``(q [1, Lq], k [1, Lk])``
    in place of the indices where given): the magnitude of the terms the slopes' gradient
    sums, from the float32 reference's dS (its gradient in a zero bias)."""
    bias = jnp.zeros((1, q.shape[1], q_len, kv_len), jnp.float32)
    with jax.default_matmul_precision("highest"):
        _, pullback = jax.vjp(lambda b: reference(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                  slopes, b), bias)
        (ds,) = pullback(cot.astype(jnp.float32))
    q_pos, k_pos = (jnp.arange(q_len), jnp.arange(kv_len)) if positions is None else (
        positions[0][0], positions[1][0])
    distance = k_pos[None, :] - q_pos[:, None]
    return np.asarray(jnp.sum(jnp.abs(ds * distance), axis=(0, 2, 3)))


@pytest.mark.slow
@pytest.mark.covering("case", "persistent")  # each default case runs one launch
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "item_a_cta"])
@pytest.mark.parametrize("single_pass", [True, False], ids=["single_pass", "deterministic"])
@pytest.mark.parametrize("case", [  # the default run takes these two; the rest is extended
    pytest.param(name, marks=[] if name in ("soft_cap", "alibi", "positions_function_chunks",
                                            "dilated_or_global_documents")
                 else [pytest.mark.extended])
    for name in sorted(BACKWARD_INTERPRETER_CASES)])
def test_backward_in_cpu_interpreter(case, single_pass, persistent):
    """The Mosaic backward after the Mosaic forward, both in Pallas' CPU interpreter, against
    the gradients of the float32 dense reference: the single pass (the dk/dv kernel with its
    dq partials added into a float32 accumulator; the interpreter has no TMA reduce-add, so
    there each addition is a read-modify-write) and the deterministic dq and dk/dv kernels.
    Launched one item a CTA, or persistent on one CTA, which then runs every item (some
    with empty lists) through one ring, its own tiles double-buffered (except the single
    pass at D = 128, which has no room for that and runs one item a CTA)."""
    params = _mosaic_interpreter()
    if params is None or jax.default_backend() != "cpu":
        pytest.skip("needs Pallas' Mosaic GPU interpreter on a CPU backend")
    from eqx_bsattn.strategies.kernels.mosaic.backward import (
        LAUNCHES, BackwardConfig, backward_blocks)
    from eqx_bsattn.strategies.kernels.mosaic.common import ELEMENT_MAP_DTYPE
    from eqx_bsattn.strategies.kernels.mosaic.forward import (
        BLOCK_Q, ForwardConfig, forward_call, rows_padded)
    from eqx_bsattn.strategies.kernels.mosaic.kernel import (
        _pad, mosaic_backward, refs_reach_kernels, score_function)

    if single_pass and not refs_reach_kernels():
        pytest.skip(f"the single pass needs JAX >= 0.11 (jax.Ref operands); this is "
                    f"{jax.__version__}")
    mask, heads, kv_heads, lq, lk, d, documents, soft_cap, alibi = \
        BACKWARD_INTERPRETER_CASES[case]
    fn = SCORE_FUNCTIONS.get(case)
    function = None
    if fn is not None:
        compiled = scores.ScoreFunction(fn).compile(heads)
        # The reference runs it as a function too (not rewritten to built-in ALiBi).
        assert as_alibi(compiled, heads).function is not None
        function, _ = score_function(compiled)
    # Slopes large enough that the term moves the softmax over these short rows.
    slopes = jnp.asarray([0.25, -0.1, 0.05, 0.15][:heads], jnp.float32) if alibi else None
    data, seg, positions = {}, (None, None), None
    if documents:
        ids = np.repeat(np.arange(3, dtype=np.int32), [60, 90, 50])
        ids[-11:] = -1
        data = {"q_segment_ids": jnp.asarray(ids[None]), "kv_segment_ids": jnp.asarray(ids[None])}
    if case in POSITIONS:
        positions = tuple(jnp.asarray(x[None], jnp.int32) for x in POSITIONS[case](lq, lk))
        data = {**data, "q_positions": positions[0], "kv_positions": positions[1]}
    resolved = bsa.ResolvedMask(mask, q_len=lq, kv_len=lk, num_heads=heads, **data)
    dq_tile, dkv_tile = backward_blocks(d)
    terms = resolved.kernel_terms([(BLOCK_Q, 128), dq_tile, dkv_tile])
    # A mask without terms at these tiles: its element predicate on the partial blocks, or
    # the element map's tiles where the predicate reads an array.
    predicate = None if terms is not None else resolved.predicate()
    assert (predicate is not None) == case.startswith(
        ("predicate", "dilated", "positions_not", "array", "positions_predicate"))
    elements = predicate is not None and not predicate.traces_on_tiles((64, 128))
    assert elements == case.startswith(("array", "positions_predicate"))
    plq, plk = rows_padded(lq, BLOCK_Q), rows_padded(lk, 128)
    maps = None
    if elements:
        inputs = types.SimpleNamespace(**{**dict.fromkeys(
            ("q_positions", "kv_positions", "q_segment_ids", "kv_segment_ids")), **data})
        emap = predicate.element_map(inputs, plq, plk, ELEMENT_MAP_DTYPE)
        maps = (emap, jnp.swapaxes(emap, 2, 3))
    if documents:
        seg = (_pad(data["q_segment_ids"], plq, -1), _pad(data["kv_segment_ids"], plk, -2))
    fwd, dq_layout, dkv_layout = (resolved.layout(*tile)
                                  for tile in ((BLOCK_Q, 128), dq_tile, dkv_tile))
    fcfg = ForwardConfig(batch=1, heads=heads, kv_heads=kv_heads, q_len=plq, kv_len=plk,
                         true_kv_len=lk, head_dim=d, block_kv=128, stages=2,
                         softmax_scale=d ** -0.5, terms=terms, soft_cap=soft_cap or 0.0,
                         layout_batch=fwd.full_count.shape[0],
                         layout_heads=fwd.full_count.shape[1],
                         # Persistent on 2 CTAs: items follow one another, some empty.
                         ctas=2, alibi=alibi, function=function,
                         positions=positions is not None, predicate=predicate,
                         elements=elements)
    bcfg = BackwardConfig(batch=1, heads=heads, kv_heads=kv_heads, q_len=plq, kv_len=plk,
                          true_kv_len=lk, head_dim=d, dq_block_kv=dq_tile[1],
                          dkv_block_q=dkv_tile[0], softmax_scale=d ** -0.5, terms=terms,
                          dq_layout_axes=dq_layout.full_count.shape[:2],
                          dkv_layout_axes=dkv_layout.full_count.shape[:2],
                          soft_cap=soft_cap or 0.0, single_pass=single_pass,
                          persistent=LAUNCHES if persistent else (), ctas=1,
                          alibi=alibi, function=function, positions=positions is not None,
                          predicate=predicate, elements=elements)

    def arrays(*xs):
        return tuple(jnp.asarray(x, jnp.int32) for x in xs)

    q, k, v, cot = _inputs(11, 1, heads, kv_heads, lq, lk, d)
    if soft_cap:
        q = q * 3.0
    q, k, v, cot = (x.astype(jnp.float16) for x in (q, k, v, cot))
    segments = () if seg[0] is None else seg
    out, lse = forward_call(fcfg, _pad(q, plq), _pad(k, plk), _pad(v, plk),
                            *arrays(fwd.full_count, fwd.full_index, fwd.partial_count,
                                    fwd.partial_index), *segments, slopes=slopes,
                            positions=None if positions is None else (
                                _pad(positions[0], plq), _pad(positions[1], plk)),
                            element_map=None if maps is None else maps[0],
                            interpret=params())
    out, lse = out[:, :, :lq], lse[:, :, :lq]
    delta = jnp.sum(cot.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    got = mosaic_backward(
        bcfg, q, k, v, cot, lse, delta, seg,
        arrays(dq_layout.full_count, dq_layout.full_index, dq_layout.partial_count,
               dq_layout.partial_index),
        arrays(dkv_layout.t_full_count, dkv_layout.t_full_index, dkv_layout.t_partial_count,
               dkv_layout.t_partial_index), slopes=slopes, positions=positions, maps=maps,
        interpret=params())

    def reference(q, k, v, slopes, bias=None):
        score = None if slopes is None else scores.ALiBi(slopes, learned=True)
        if fn is not None and slopes is not None:
            # Built-in ALiBi, then the function: one function for the reference.
            score = scores.ScoreFunction(lambda s, h, qp, kp: fn(
                s + slopes[h] * (kp - qp).astype(jnp.float32), h, qp, kp))
        elif fn is not None:
            score = scores.ScoreFunction(fn)
        ref = bsa.BlockSparseAttention(mask=mask, kernel=DenseReference(),
                                       logits_soft_cap=soft_cap, score=score)
        return ref(q, k, v, bias=bias, **data)

    with jax.default_matmul_precision("highest"):
        want_out, pullback = jax.vjp(reference, *(x.astype(jnp.float32) for x in (q, k, v)),
                                     slopes)
        want = pullback(cot.astype(jnp.float32))
    assert _rel(out, want_out) < TOL[jnp.float16]
    assert (got[3] is None) == (not alibi)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        assert _rel(g, w) < TOL[jnp.float16], name
    if alibi and fn is None:  # the reference's function closes over the slopes
        # The slopes' gradient sums dS (k - q) over every pair, and each row's dS sums to
        # zero, so it can cancel far below its terms: its error is measured against their
        # magnitude (float16 rounding of dS, about 1e-5 of it) as well as against its value.
        scale = _slope_gradient_scale(reference, q, k, v, slopes, cot, lq, lk, positions)
        error = np.abs(np.asarray(got[3]) - np.asarray(want[3]))
        assert np.all(error <= TOL[jnp.float16] * np.abs(np.asarray(want[3])) + 1e-4 * scale), (
            got[3], want[3], scale)
    empty = np.asarray(jnp.abs(want_out).sum(-1) == 0)
    assert np.all(np.asarray(got[0], np.float32)[empty] == 0.0)
