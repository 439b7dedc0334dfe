"""`DenseReference` (through `BlockSparseAttention`) against the independent float64 oracle.

Forward: the NumPy float64 loop `np_attention`. Gradients: `jax.grad` of the reference (float32)
against `jax.grad` of `jnp_attention_f64` under ``jax.enable_x64(True)``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
from tests.conftest import (
    assert_close,
    jnp_attention_f64,
    np_attention,
    np_visibility,
    random_array,
    random_inputs,
    sorted_segments,
)

FWD_TOL = 2e-5
GRAD_TOL = 5e-5


@dataclasses.dataclass
class Case:
    mask: object = dataclasses.field(default_factory=masks.Full)
    batch: int | None = 2
    heads: int = 4
    kv_heads: int | None = None
    q_len: int = 19
    kv_len: int | None = None
    dim: int = 8
    value_dim: int | None = None
    softmax_scale: float | None = None
    soft_cap: float | None = None
    bias_shape: str | None = None  # "qk", "hqk", "b1qk"
    sinks_shape: str | None = None  # "s", "h", "hs"
    segments: bool = False
    pad: int = 0
    positions: bool = False
    input_scale: float = 1.0
    seed: int = 0


def build(case: Case):
    """Random inputs and the call's keyword arguments, plus the NumPy truth pieces."""
    kv_len = case.q_len if case.kv_len is None else case.kv_len
    q, k, v = random_inputs(case.seed, batch=case.batch, heads=case.heads, kv_heads=case.kv_heads,
                            q_len=case.q_len, kv_len=kv_len, dim=case.dim,
                            value_dim=case.value_dim, scale=case.input_scale)
    b = 1 if case.batch is None else case.batch
    lead = () if case.batch is None else (case.batch,)
    h, lq = case.heads, case.q_len
    kw = {}
    if case.bias_shape is not None:
        shape = {"qk": (lq, kv_len), "hqk": (h, lq, kv_len), "b1qk": lead + (1, lq, kv_len)}
        kw["bias"] = random_array(case.seed + 11, shape[case.bias_shape])
    if case.sinks_shape is not None:
        shape = {"s": (3,), "h": (h,), "hs": (h, 2)}[case.sinks_shape]
        kw["sinks"] = random_array(case.seed + 12, shape)
    data = {}
    rng = np.random.default_rng(case.seed)
    if case.segments:
        qs = sorted_segments(rng, b, lq, 3, pad=case.pad)
        ks = qs if kv_len == lq else sorted_segments(rng, b, kv_len, 3, pad=case.pad)
        data.update(q_seg=qs, kv_seg=ks)
        kw["q_segment_ids"] = jnp.asarray(qs if case.batch is not None else qs[0])
        kw["kv_segment_ids"] = jnp.asarray(ks if case.batch is not None else ks[0])
    if case.positions:
        qp = np.sort(rng.choice(lq + kv_len, size=(b, lq)), axis=-1).astype(np.int32)
        kp = np.stack([np.arange(kv_len)] * b).astype(np.int32)
        data.update(q_pos=qp, kv_pos=kp)
        kw["q_positions"] = jnp.asarray(qp if case.batch is not None else qp[0])
        kw["kv_positions"] = jnp.asarray(kp if case.batch is not None else kp[0])
    truth_mask = case.mask & masks.Document() if case.segments and not case.mask.uses_segment_ids \
        else case.mask
    vis = np_visibility(truth_mask, batch=b, heads=h, q_len=lq, kv_len=kv_len, **data)
    return q, k, v, kw, vis


def module(case: Case):
    return bsa.BlockSparseAttention(mask=case.mask, kernel=kernels.DenseReference(),
                                    softmax_scale=case.softmax_scale,
                                    logits_soft_cap=case.soft_cap)


def call(attn, q, k, v, purify=False, **kw):
    """One compiled call (eager calls compile every primitive separately: slow)."""
    return jax.jit(lambda q, k, v, kw: attn(q, k, v, purify=purify, **kw))(q, k, v, kw)


def _batched(x, case):
    return x if case.batch is not None else x[None]


def oracle_forward(case, q, k, v, kw, vis):
    bias = kw.get("bias")
    if bias is not None and case.batch is None:
        bias = np.asarray(bias)[None] if bias.ndim == 3 else bias
    out = np_attention(_batched(np.asarray(q), case), _batched(np.asarray(k), case),
                       _batched(np.asarray(v), case), vis, scale=case.softmax_scale, bias=bias,
                       sinks=kw.get("sinks"), soft_cap=case.soft_cap)
    return out if case.batch is not None else out[0]


DIFF = ("q", "k", "v", "bias", "sinks")


def grads_both(case, q, k, v, kw, vis, purify=False):
    """(grads of the reference, grads of the float64 oracle) for every differentiable input.

    With `purify` the reference is called with ``purify=True``; `vis` must then hide the padded
    query rows (that is what purify means for the oracle).
    """
    attn = module(case)
    extra = {n: kw[n] for n in ("bias", "sinks") if n in kw}
    rest = {n: x for n, x in kw.items() if n not in extra}
    ct = random_array(case.seed + 99, jax.eval_shape(lambda: attn(q, k, v, **kw)).shape)

    def loss(args):
        out = attn(args["q"], args["k"], args["v"], **{n: args[n] for n in extra}, **rest,
                   purify=purify)
        return jnp.sum(out * ct)

    args = {"q": q, "k": k, "v": v, **extra}
    got = {n: np.asarray(x) for n, x in jax.jit(jax.grad(loss))(args).items()}

    with jax.enable_x64(True):
        a64 = {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in args.items()}
        ct64 = jnp.asarray(np.asarray(ct, np.float64))
        vis64 = jnp.asarray(vis)

        def loss64(a):
            bias = a.get("bias")
            if bias is not None and case.batch is None and bias.ndim == 3:
                bias = bias[None]
            out = jnp_attention_f64(_batched(a["q"], case), _batched(a["k"], case),
                                    _batched(a["v"], case), vis64, scale=case.softmax_scale,
                                    bias=bias, sinks=a.get("sinks"), soft_cap=case.soft_cap)
            out = out if case.batch is not None else out[0]
            return jnp.sum(out * ct64)

        want = jax.jit(jax.grad(loss64))(a64)
        want = {n: np.asarray(x) for n, x in want.items()}
    return got, want


CASES = {
    "plain": Case(),
    "causal": Case(mask=masks.Causal()),
    "unbatched": Case(batch=None, mask=masks.Causal()),
    "gqa": Case(heads=6, kv_heads=2, mask=masks.SlidingWindow(4, 2)),
    "mqa": Case(heads=4, kv_heads=1, mask=masks.Causal()),
    "value_dim": Case(dim=8, value_dim=5, mask=masks.ChunkedCausal(6)),
    "lq_lt_lk": Case(q_len=7, kv_len=23, mask=masks.Causal(bottom_right=True)),
    "lq_gt_lk": Case(q_len=23, kv_len=9, mask=masks.PrefixLM(3)),
    "one_query": Case(q_len=1, kv_len=17, mask=masks.Causal(bottom_right=True)),
    "scale": Case(softmax_scale=0.37, mask=masks.GlobalTokens(2) | masks.SlidingWindow(2)),
    "soft_cap": Case(soft_cap=2.5, input_scale=2.0, mask=masks.Causal()),
    "sinks_s": Case(sinks_shape="s", mask=masks.Causal()),
    "sinks_h": Case(sinks_shape="h", mask=masks.SlidingWindow(3, 0)),
    "sinks_hs": Case(sinks_shape="hs", heads=4, kv_heads=2),
    "bias_qk": Case(bias_shape="qk", mask=masks.Causal()),
    "bias_hqk": Case(bias_shape="hqk", q_len=11, kv_len=14),
    "bias_b1qk": Case(bias_shape="b1qk", mask=masks.Dilated(2)),
    "bias_unbatched": Case(batch=None, bias_shape="hqk", sinks_shape="hs"),
    "segments": Case(segments=True, mask=masks.Causal()),
    "segments_pad": Case(segments=True, pad=4, q_len=21, kv_len=21),
    "segments_lq_ne_lk": Case(segments=True, q_len=13, kv_len=22),
    "segments_unbatched": Case(batch=None, segments=True, pad=2, mask=masks.Causal()),
    "positions": Case(positions=True, mask=masks.Causal() & masks.SlidingWindow(6, 0),
                      q_len=12, kv_len=30),
    "per_head": Case(mask=masks.PerHead([masks.Causal(), ~masks.Causal(), masks.Full(),
                                         masks.Predicate(lambda q, k: (q + k) % 2 == 0)])),
    "bigbird": Case(q_len=40, mask=masks.Causal() & (masks.SlidingWindow(8, 0)
                                                     | masks.BigBirdRandom(8, 1, seed=3))),
    "everything": Case(heads=4, kv_heads=2, q_len=17, kv_len=26, dim=8, value_dim=6,
                       softmax_scale=0.5, soft_cap=3.0, bias_shape="b1qk", sinks_shape="hs",
                       segments=True, pad=3, mask=masks.Causal(bottom_right=True)),
}


#: The cases of the quick subset (``-m "not slow"``), forward and gradients; the rest are `slow`.
QUICK_FORWARD = {"unbatched", "gqa", "one_query", "lq_gt_lk", "per_head", "segments_pad",
                 "everything"}
QUICK_GRADIENTS = {"gqa", "segments_unbatched"}


def case_params(quick):
    return [pytest.param(name, marks=() if name in quick else pytest.mark.slow)
            for name in CASES]


@pytest.mark.parametrize("name", case_params(QUICK_FORWARD))
def test_forward_matches_oracle(name):
    case = CASES[name]
    q, k, v, kw, vis = build(case)
    out = call(module(case), q, k, v, **kw)
    assert out.dtype == q.dtype
    assert out.shape == q.shape[:-1] + (v.shape[-1],)
    assert_close(out, oracle_forward(case, q, k, v, kw, vis), FWD_TOL, name)


@pytest.mark.parametrize("name", case_params(QUICK_GRADIENTS))
def test_gradients_match_oracle(name):
    case = CASES[name]
    q, k, v, kw, vis = build(case)
    got, want = grads_both(case, q, k, v, kw, vis)
    assert set(got) == set(want)
    for n in got:
        assert got[n].shape == want[n].shape, n
        assert np.abs(want[n]).max() > 0, f"{name}: the oracle's d{n} is all zeros"
        assert_close(got[n], want[n], GRAD_TOL, f"{name} d{n}")


def test_oracles_agree():
    """The two oracles (NumPy loop, jnp float64) agree with each other on a full-feature case."""
    case = CASES["everything"]
    q, k, v, kw, vis = build(case)
    oracle = jax.jit(jnp_attention_f64, static_argnames=("scale", "soft_cap"))
    with jax.enable_x64(True):
        out64 = oracle(*(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)),
                       jnp.asarray(vis), scale=0.5,
                       bias=jnp.asarray(np.asarray(kw["bias"], np.float64)),
                       sinks=jnp.asarray(np.asarray(kw["sinks"], np.float64)), soft_cap=3.0)
        out64 = np.asarray(out64)
    np.testing.assert_allclose(out64, oracle_forward(case, q, k, v, kw, vis), rtol=1e-12,
                               atol=1e-12)


def test_default_scale_is_inverse_sqrt_dim():
    q, k, v = random_inputs(3, heads=2, q_len=9, dim=16)
    a = call(bsa.BlockSparseAttention(kernel=kernels.DenseReference()), q, k, v)
    b = call(bsa.BlockSparseAttention(kernel=kernels.DenseReference(), softmax_scale=0.25), q, k, v)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    c = call(bsa.BlockSparseAttention(kernel=kernels.DenseReference(), softmax_scale=1.0), q, k, v)
    assert not np.allclose(np.asarray(a), np.asarray(c), atol=1e-3)


@pytest.mark.slow
def test_soft_cap_huge_logits_do_not_overflow():
    case = Case(soft_cap=20.0, input_scale=1e3, mask=masks.Causal(), sinks_shape="hs")
    q, k, v, kw, vis = build(case)
    out = call(module(case), q, k, v, **kw)
    assert np.isfinite(np.asarray(out)).all()
    assert_close(out, oracle_forward(case, q, k, v, kw, vis), 1e-4, "huge capped")
    got, want = grads_both(case, q, k, v, kw, vis)
    assert set(got) == set(want) == {"q", "k", "v", "sinks"}
    for n in got:
        assert np.isfinite(got[n]).all(), n
        # Every capped logit saturates (|s| ~ 1e6 >> cap), so the oracle's dq and dk are
        # exactly zero and the reference's must be too; dv and dsinks carry the softmax.
        assert_close(got[n], want[n], GRAD_TOL, f"huge capped d{n}")
    assert np.abs(want["v"]).max() > 0 and np.abs(want["sinks"]).max() > 0


@pytest.mark.slow
def test_huge_logits_without_cap_stay_finite_and_convex():
    case = Case(input_scale=300.0, mask=masks.Causal())
    q, k, v, kw, vis = build(case)
    out = np.asarray(call(module(case), q, k, v, **kw))
    assert np.isfinite(out).all()
    vv = np.asarray(v)
    for b in range(2):
        for h in range(4):
            for i in range(case.q_len):
                seen = vv[b, h][vis[b, h, i]]
                assert (out[b, h, i] >= seen.min(0) - 1e-5).all()
                assert (out[b, h, i] <= seen.max(0) + 1e-5).all()
    got, want = grads_both(case, q, k, v, kw, vis)
    for n in got:
        assert np.isfinite(got[n]).all(), n
    assert_close(got["v"], want["v"], GRAD_TOL, "huge dv")
    # dq and dk: the weights are one-hot up to float32 rounding, so the oracle's dq, dk are
    # ~1e-13 while float32 leaves terms of order eps * scale * |k| * |dO . v| (~1e-4 here).
    # Measure the error against that natural size (dk swaps |k| for |q|); a wrong term would
    # be O(1) of it.
    ct = np.abs(random_array(case.seed + 99, out.shape)).max()
    qk = max(np.abs(np.asarray(q)).max(), np.abs(np.asarray(k)).max())
    natural = ct * np.abs(vv).max() * qk / np.sqrt(case.dim)
    for n in ("q", "k"):
        err = np.abs(got[n] - want[n]).max() / natural
        assert err <= 1e-6, f"huge d{n}: error {err:.2e} of the natural size"


def test_fully_masked_rows_give_zeros_and_zero_gradients():
    # Query rows 0..3 see nothing: keys are visible only from query 4 on (offset -4), and padded
    # queries (segment -1) see nothing either.
    mask = masks.Causal(offset=-4)
    case = Case(mask=mask, segments=True, pad=3, sinks_shape="hs", bias_shape="b1qk")
    q, k, v, kw, vis = build(case)
    attn = module(case)
    out = np.asarray(call(attn, q, k, v, **kw))
    dead = ~vis.any(-1)  # [B, H, Lq]
    assert dead[:, :, :4].all() and dead[:, :, -3:].all() and not dead.all()
    assert (out[dead] == 0).all() and np.isfinite(out).all()
    assert_close(out, oracle_forward(case, q, k, v, kw, vis), FWD_TOL, "masked rows")

    got, want = grads_both(case, q, k, v, kw, vis)
    for n in got:
        assert np.isfinite(got[n]).all(), n
        assert_close(got[n], want[n], GRAD_TOL, f"masked rows d{n}")
    dq, dbias = got["q"], got["bias"]
    assert (dq[dead] == 0).all() and np.abs(dq[~dead]).max() > 0
    assert (dbias[:, 0][dead.any(1)] == 0).all()


def test_everything_masked_gives_zeros_and_zero_gradients():
    attn = bsa.BlockSparseAttention(mask=~masks.Full(), kernel=kernels.DenseReference())
    q, k, v = random_inputs(5, heads=2, q_len=8)
    sinks = random_array(6, (2, 3))
    out = call(attn, q, k, v, sinks=sinks)
    assert (np.asarray(out) == 0).all()
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(attn(a[0], a[1], a[2], sinks=a[3])), argnums=(0, 1, 2, 3)))(
        q, k, v, sinks)
    for g in grads:
        assert (np.asarray(g) == 0).all()


@pytest.mark.slow
def test_purify_zeroes_padded_query_rows():
    # Padded queries still see the global tokens under `GlobalTokens | Document`; purify hides them.
    mask = masks.GlobalTokens(2) | masks.Document()
    case = Case(mask=mask, segments=True, pad=4)
    q, k, v, kw, vis = build(case)
    attn = module(case)
    plain = np.asarray(call(attn, q, k, v, **kw))
    assert_close(plain, oracle_forward(case, q, k, v, kw, vis), FWD_TOL, "no purify")
    padded = np.asarray(kw["q_segment_ids"]) < 0
    assert np.abs(plain.transpose(0, 2, 1, 3)[padded]).min() > 0
    pure = np.asarray(call(attn, q, k, v, purify=True, **kw))
    assert (pure.transpose(0, 2, 1, 3)[padded] == 0).all()
    np.testing.assert_array_equal(pure.transpose(0, 2, 1, 3)[~padded],
                                  plain.transpose(0, 2, 1, 3)[~padded])
    # For the oracle, purify hides every key from a padded query.
    pure_vis = vis & ~padded[:, None, :, None]
    assert_close(pure, oracle_forward(case, q, k, v, kw, pure_vis), FWD_TOL, "purify")
    got, want = grads_both(case, q, k, v, kw, pure_vis, purify=True)
    for n in got:
        assert_close(got[n], want[n], GRAD_TOL, f"purify d{n}")
    assert (got["q"].transpose(0, 2, 1, 3)[padded] == 0).all()


@pytest.mark.parametrize("dtype", [
    jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_low_precision_inputs(dtype):
    case = Case(mask=masks.Causal(), sinks_shape="h")
    q, k, v, kw, vis = build(case)
    attn = module(case)
    out = call(attn, q.astype(dtype), k.astype(dtype), v.astype(dtype), **kw)
    assert out.dtype == dtype
    want = oracle_forward(case, q.astype(dtype).astype(jnp.float32),
                          k.astype(dtype).astype(jnp.float32), v.astype(dtype).astype(jnp.float32),
                          kw, vis)
    assert_close(out.astype(jnp.float32), want, 1e-2, str(dtype))
