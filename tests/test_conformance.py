"""The shared conformance suite: every CPU kernel in `KERNELS` against `DenseReference`.

Parametrised over kernels x cases (mask families x features). Each case compares the forward
output and the gradients of q, k, v, bias and sinks (through one random cotangent) at float32
tolerance, with a small tiling so several blocks, full and partial, are exercised. A kernel
joins by its name appearing in `tests.conftest.KERNELS`.

`DenseReference` itself is checked here against the independent float64 oracle instead (checking
it against itself could not fail).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
from tests.conftest import KERNELS, assert_close, jnp_attention_f64, make_kernel, random_array
from tests.test_reference import Case, build

TILING = bsa.Tiling(block_q=16, block_kv=32)
FWD_TOL = 2e-5
GRAD_TOL = 5e-5


def every_other_causal(q, k):
    return (k <= q) & ((q - k) % 2 == 0)


_TABLE = np.random.default_rng(4).random((8, 8)) < 0.4

# Ragged lengths (not multiples of the tiling) unless a case says otherwise.
R = dict(q_len=45, kv_len=45)
CASES = {
    # mask families
    "full_scale": Case(mask=masks.Full(), softmax_scale=0.9, **R),
    "causal_bottom_right_lq_lt_lk": Case(mask=masks.Causal(bottom_right=True), q_len=21, kv_len=70),
    "causal_lq_gt_lk": Case(mask=masks.Causal(offset=3), q_len=70, kv_len=37),
    "window": Case(mask=masks.SlidingWindow(13, 5), **R),
    "chunked": Case(mask=masks.ChunkedCausal(24), **R),
    "prefix_lm": Case(mask=masks.PrefixLM(18), **R),
    "global_window": Case(mask=masks.SlidingWindow(6) | masks.GlobalTokens(4), **R),
    "dilated_window": Case(mask=masks.SlidingWindow(30, 0) & masks.Dilated(3), **R),
    "bigbird": Case(mask=masks.Causal() & (masks.SlidingWindow(16, 0) | masks.GlobalTokens(8)
                                           | masks.BigBirdRandom(16, 1, seed=1)), q_len=80, kv_len=80),
    "block_layout": Case(mask=masks.BlockLayoutMask(_TABLE, (8, 12)), q_len=50, kv_len=61),
    "predicate": Case(mask=masks.Predicate(every_other_causal), **R),
    "not_window": Case(mask=~masks.SlidingWindow(4), **R),
    "per_head": Case(mask=masks.PerHead([masks.Causal(), masks.SlidingWindow(5),
                                         masks.ChunkedCausal(16), ~masks.Causal()]), **R),
    "fully_masked_rows": Case(mask=masks.Causal(offset=-20), **R),
    # features
    "bias_qk": Case(mask=masks.Causal(), bias_shape="qk", **R),
    "bias_hqk_window": Case(mask=masks.SlidingWindow(9), bias_shape="hqk", **R),
    "bias_b1qk_chunked": Case(mask=masks.ChunkedCausal(16), bias_shape="b1qk", q_len=33, kv_len=50),
    "gqa_causal_sinks_s": Case(mask=masks.Causal(), sinks_shape="s", heads=6, kv_heads=2, **R),
    "sinks_hs_window": Case(mask=masks.SlidingWindow(8, 0), sinks_shape="hs", **R),
    "soft_cap": Case(mask=masks.Causal(), soft_cap=2.0, input_scale=1.5, **R),
    "segments": Case(mask=masks.Causal(), segments=True, q_len=64, kv_len=64),
    "segments_padded_lq_ne_lk": Case(mask=masks.Full(), segments=True, pad=5, q_len=40, kv_len=57),
    "positions": Case(mask=masks.Causal() & masks.SlidingWindow(12, 0), positions=True,
                      q_len=30, kv_len=66),
    "mqa_window": Case(mask=masks.SlidingWindow(7, 2), heads=4, kv_heads=1, **R),
    "value_dim": Case(mask=masks.PrefixLM(9), dim=8, value_dim=12, **R),
    "one_query": Case(mask=masks.Causal(bottom_right=True), q_len=1, kv_len=50),
    "unbatched": Case(mask=masks.Causal(), batch=None, bias_shape="hqk", **R),
    "everything": Case(mask=masks.Causal(bottom_right=True) & masks.SlidingWindow(25, 0),
                       heads=4, kv_heads=2, q_len=39, kv_len=58, dim=8, value_dim=5,
                       softmax_scale=0.4, soft_cap=4.0, bias_shape="b1qk", sinks_shape="hs",
                       segments=True, pad=3),
}


def _split(kw):
    diff = {n: kw[n] for n in ("bias", "sinks") if n in kw}
    rest = {n: x for n, x in kw.items() if n not in diff}
    return diff, rest


def kernel_fwd_and_grads(attn, q, k, v, kw, ct):
    diff, rest = _split(kw)

    def f(a):
        return attn(a["q"], a["k"], a["v"], **{n: a[n] for n in diff}, **rest)

    @jax.jit
    def run(a, ct):
        out, pullback = jax.vjp(f, a)
        return out, pullback(ct)[0]

    return run({"q": q, "k": k, "v": v, **diff}, ct)


def oracle_fwd_and_grads(case, q, k, v, kw, vis, ct):
    diff, _ = _split(kw)
    batched = case.batch is not None

    def lift(x):
        return x if batched else x[None]

    with jax.enable_x64(True):
        a = {n: jnp.asarray(np.asarray(x, np.float64))
             for n, x in {"q": q, "k": k, "v": v, **diff}.items()}
        vis64 = jnp.asarray(vis)

        def f(a):
            bias = a.get("bias")
            if bias is not None and not batched and bias.ndim == 3:
                bias = bias[None]
            out = jnp_attention_f64(lift(a["q"]), lift(a["k"]), lift(a["v"]), vis64,
                                    scale=case.softmax_scale, bias=bias, sinks=a.get("sinks"),
                                    soft_cap=case.soft_cap)
            return out if batched else out[0]

        @jax.jit
        def run(a, ct):
            out, pullback = jax.vjp(f, a)
            return out, pullback(ct)[0]

        out, grads = run(a, jnp.asarray(np.asarray(ct, np.float64)))
        return np.asarray(out), {n: np.asarray(g) for n, g in grads.items()}


@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("kernel_name", KERNELS)
def test_kernel_conforms(kernel_name, case_name):
    case = CASES[case_name]
    q, k, v, kw, vis = build(case)
    attn = bsa.BlockSparseAttention(mask=case.mask, kernel=make_kernel(kernel_name),
                                    tiling=TILING, softmax_scale=case.softmax_scale,
                                    logits_soft_cap=case.soft_cap)
    out_shape = q.shape[:-1] + (v.shape[-1],)
    ct = random_array(case.seed + 77, out_shape)
    out, grads = kernel_fwd_and_grads(attn, q, k, v, kw, ct)
    assert out.shape == out_shape and out.dtype == q.dtype
    if kernel_name == "DenseReference":
        want_out, want_grads = oracle_fwd_and_grads(case, q, k, v, kw, vis, ct)
    else:
        ref = bsa.BlockSparseAttention(mask=case.mask, kernel=kernels.DenseReference(),
                                       softmax_scale=case.softmax_scale,
                                       logits_soft_cap=case.soft_cap)
        want_out, want_grads = kernel_fwd_and_grads(ref, q, k, v, kw, ct)
    assert_close(out, want_out, FWD_TOL, f"{kernel_name} {case_name} out")
    dead = ~vis.any(-1)
    if dead.any():  # rows that see nothing: exactly zero output and zero dq
        b_out = np.asarray(out) if case.batch is not None else np.asarray(out)[None]
        b_dq = np.asarray(grads["q"]) if case.batch is not None else np.asarray(grads["q"])[None]
        assert (b_out[dead] == 0).all() and (b_dq[dead] == 0).all()
    assert set(grads) == set(want_grads)
    for n in grads:
        assert np.abs(np.asarray(want_grads[n])).max() > 0, f"{case_name}: d{n} is all zeros"
        assert_close(grads[n], want_grads[n], GRAD_TOL, f"{kernel_name} {case_name} d{n}")


def test_kernel_list_is_not_empty():
    assert "DenseReference" in KERNELS


@pytest.mark.parametrize("kernel_name", KERNELS)
def test_rows_hidden_by_a_minus_inf_bias_give_zeros(kernel_name):
    # Query 5 sees keys through the mask, but a -inf bias hides every one of them: it sees no
    # key, so zeros and zero gradients, never NaN; the other rows are untouched.
    q, k, v = (random_array(s, (1, 2, 40, 8)) for s in (31, 32, 33))
    bias = jnp.zeros((40, 40)).at[5].set(-jnp.inf)
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=make_kernel(kernel_name),
                                    tiling=TILING)
    ct = random_array(34, (1, 2, 40, 8))
    out, grads = kernel_fwd_and_grads(attn, q, k, v, {"bias": bias}, ct)
    want, _ = kernel_fwd_and_grads(attn, q, k, v, {"bias": jnp.zeros((40, 40))}, ct)
    assert (np.asarray(out)[:, :, 5] == 0).all()
    rows = np.arange(40) != 5
    assert_close(np.asarray(out)[:, :, rows], np.asarray(want)[:, :, rows], FWD_TOL, "other rows")
    for n, g in grads.items():
        assert np.isfinite(np.asarray(g)).all(), n
    assert (np.asarray(grads["q"])[:, :, 5] == 0).all()
