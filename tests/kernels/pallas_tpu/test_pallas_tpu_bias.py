"""`PallasTpuBlockSparse` with an additive bias, against the float64 oracle, forward and every
gradient (q, k, v, the bias, sinks), in Pallas' interpret mode on the CPU and compiled on a
TPU (float32 inputs, products at the highest precision); the bias's gradient bit-identical
over two runs; the decline until a bias has run on a TPU, and the selector's choice after.

The kernel reads the bias in the tiles its visit lists reach and writes the gradient's tile
of each (the others stay zero): the cases have blocks the lists skip (causal, a window,
documents), rows that see no key, grouped heads and a bias broadcast over the batch, the
heads, the queries or the keys (the plan gives the kernel ``[bb, hb, Lq, Lk]``)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
from tests.conftest import jnp_attention_f64, np_visibility, take_as_proven
from tests.kernels.pallas_tpu.test_pallas_tpu import TILES, TOL, _rel

Kernel = kernels.PallasTpuBlockSparse


@pytest.fixture(autouse=True)
def _bias_taken(monkeypatch):
    """These tests run the bias's launches, whether or not the selector takes them yet."""
    take_as_proven(Kernel, "bias", monkeypatch=monkeypatch)


@dataclasses.dataclass(frozen=True)
class Case:
    mask: object
    bias: tuple  # the bias's shape, by names: "b", "h", "q", "k" or 1
    batch: int = 2
    heads: int = 4
    kv_heads: int = 2
    q_len: int = 300
    kv_len: int = 300
    soft_cap: float | None = None
    sinks: bool = False
    hidden: float = 0.0  # the share of pairs the bias hides with -inf


CASES = {
    # The default tier: one case with every kind of block, -inf entries and grouped heads.
    "window_gqa_hidden": Case(masks.Causal() & masks.SlidingWindow(150, 0),
                              ("b", "h", "q", "k"), hidden=0.05),
    # The extended tier: each broadcast, the soft cap, sinks, rows that see nothing, Lq != Lk.
    "heads_only_cap_sinks": Case(masks.Causal(), (1, "h", "q", "k"), soft_cap=4.0,
                                 sinks=True),
    "batch_only_cross": Case(masks.Causal(bottom_right=True), ("b", 1, "q", "k"),
                             q_len=200, kv_len=330),
    "keys_only_full": Case(masks.Full(), ("b", 1, 1, "k"), heads=2, kv_heads=1),
    "queries_only_empty_rows": Case(masks.Causal(offset=-150), ("b", "h", "q", 1),
                                    q_len=260, kv_len=256, sinks=True),
    "shared_mqa": Case(masks.SlidingWindow(60, 20), (1, 1, "q", "k"), heads=4, kv_heads=1),
}
QUICK = {"window_gqa_hidden"}


def _build(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    b, h, hkv, lq, lk = case.batch, case.heads, case.kv_heads, case.q_len, case.kv_len
    sizes = {"b": b, "h": h, "q": lq, "k": lk, 1: 1}
    args = {"q": normal(b, h, lq, 64), "k": normal(b, hkv, lk, 64),
            "v": normal(b, hkv, lk, 64)}
    bias = np.array(normal(*(sizes[n] for n in case.bias)))
    if case.hidden:
        bias[rng.random(bias.shape) < case.hidden] = -np.inf
    args["bias"] = jnp.asarray(bias)
    if case.sinks:
        args["sinks"] = normal(h, 2)
    visible = np_visibility(case.mask, batch=1, heads=1, q_len=lq, kv_len=lk)
    return args, visible, normal(b, h, lq, 64)


def _ours(case: Case, args, cot):
    attn = bsa.BlockSparseAttention(mask=case.mask, logits_soft_cap=case.soft_cap,
                                    kernel=Kernel(), tiling=TILES)

    def loss(args):
        out = attn(args["q"], args["k"], args["v"], bias=args["bias"], sinks=args.get("sinks"))
        return jnp.vdot(out, cot), out

    with jax.default_matmul_precision("highest"):
        grads, out = jax.jit(jax.grad(loss, has_aux=True))(args)
    return out, grads


def _oracle(case: Case, args, visible, cot):
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        a = {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in args.items()}

        def loss(a):
            out = jnp_attention_f64(a["q"], a["k"], a["v"], visible, bias=a["bias"],
                                    sinks=a.get("sinks"), soft_cap=case.soft_cap)
            return jnp.vdot(out, jnp.asarray(np.asarray(cot, np.float64))), out

        grads, out = jax.grad(loss, has_aux=True)(a)
        return np.asarray(out), {n: np.asarray(g) for n, g in grads.items()}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[] if n in QUICK else [pytest.mark.slow, pytest.mark.extended])
    for n in CASES])
def test_bias_matches_the_oracle(name):
    case = CASES[name]
    args, visible, cot = _build(case)
    out, grads = _ours(case, args, cot)
    want_out, want_grads = _oracle(case, args, visible, cot)
    errors = {"out": _rel(out, want_out)}
    for n in args:
        if n == "bias" and case.bias[-1] == 1 and not case.sinks and not case.soft_cap:
            # A bias constant along each row shifts it alike: its true gradient is zero, so
            # it is held to the scale of a q gradient's entries, not to its own.
            scale = np.abs(want_grads["q"]).max()
            errors[n] = float(np.abs(np.asarray(grads[n]) - want_grads[n]).max() / scale)
        else:
            errors[n] = _rel(grads[n], want_grads[n])
    assert set(errors) >= {"out", "q", "k", "v", "bias"}
    assert grads["bias"].shape == args["bias"].shape
    bad = {n: e for n, e in errors.items() if e > TOL}
    assert not bad, errors
    dead = ~np.broadcast_to(visible, out.shape[:3] + (case.kv_len,)).any(-1)
    if dead.any():  # rows that see no key: exact zeros
        assert (np.asarray(out)[dead] == 0).all()
    if name == "queries_only_empty_rows":
        assert dead.any()


def test_bias_gradient_is_the_same_bits_twice():
    """Each gradient tile is written by one grid row, in a fixed order: no atomics."""
    case = CASES["window_gqa_hidden"]
    args, _, cot = _build(case, seed=3)
    first = _ours(case, args, cot)[1]["bias"]
    second = _ours(case, args, cot)[1]["bias"]
    assert np.array_equal(np.asarray(first), np.asarray(second))


def test_selector_takes_a_bias_on_a_tpu_once_it_has_run_there(monkeypatch):
    """Until a bias has run on a TPU the kernel declines it in one line and the selector
    keeps XlaBlockSparse (Splash has no bias); taken as proven, the selector picks it; inside
    a sharding's loop it is declined either way."""
    features = bsa.Features(platform="tpu", dtype="bfloat16", head_dim=128, value_dim=128,
                            q_len=4096, kv_len=4096, bias=True)
    picked = bsa.select_kernel(masks.Causal(), "tpu", features)
    assert picked.kernel.name == "pallas_tpu", picked.explain()
    monkeypatch.setattr(Kernel, "awaiting_device_run", {"bias": "an additive bias"})
    declined = bsa.select_kernel(masks.Causal(), "tpu", features)
    assert declined.kernel.name == "xla"
    assert ("pallas_tpu", "a bias has not yet run on a TPU.") in declined.declined
    loop = dataclasses.replace(features, in_loop=True)
    monkeypatch.setattr(Kernel, "awaiting_device_run", {})
    resolved = bsa.ResolvedMask(masks.Causal(), q_len=4096, kv_len=4096, num_heads=2)
    assert "sharding's loop" in Kernel().decline_reason(resolved, loop)
