"""`PallasTpuBlockSparse` with a `ScoreFunction` that reads arrays: arrays it closes over
(concrete, traced by `jit`, or differentiated by `jax.grad`) and the leaves of its `params`,
against the float64 oracle, forward and every gradient (q, k, v and the arrays), with GQA and
a causal mask, interpreted on the CPU; the programs lowered for a TPU v5e; what it declines at
plan time (an array read other than at scalar indices, not 32-bit, too large: for params from
their shapes alone), and the selector then running another kernel for a TPU call."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
from eqx_bsattn._score_alibi import as_alibi
from eqx_bsattn.contract import ScoreParams
from eqx_bsattn.strategies.kernels.pallas_tpu.function import DATA_LIMIT
from tests.conftest import jnp_attention_f64, np_visibility, score_f64
from tests.kernels.pallas_tpu.test_pallas_tpu import (  # noqa: F401 (v5e_lowering: a fixture)
    ON_TPU, SLOPES_TOL, TILES, TOL, TPU, _rel, v5e_lowering)

B, H, HKV, L, D = 2, 4, 2, 200, 32


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return (normal(B, H, L, D), normal(B, HKV, L, D), normal(B, HKV, L, D),
            normal(B, H, L, D), rng)


def _attention(fn, mask, kernel, soft_cap=None):
    return bsa.BlockSparseAttention(mask=mask, score=scores.ScoreFunction(fn), kernel=kernel,
                                    tiling=TILES, logits_soft_cap=soft_cap)


def _oracle(make_fn, mask, q, k, v, cot, arrays, soft_cap=None):
    """Output and the gradients of ``vdot(out, cot)`` in q, k, v and `arrays` (the arrays
    `make_fn(**arrays)` closes over), in float64."""
    visible = np_visibility(mask, batch=B, heads=H, q_len=L, kv_len=L)
    pos = np.broadcast_to(np.arange(L), (B, L))
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # noqa: E731

        def loss(qkv, arrays):
            fn = make_fn(**arrays)
            score = lambda s: score_f64(s, q_pos=pos, kv_pos=pos, fn=fn)  # noqa: E731
            out = jnp_attention_f64(*qkv, visible, soft_cap=soft_cap, score=score)
            return jnp.vdot(out, f64(cot)), out

        grads, out = jax.grad(loss, argnums=(0, 1), has_aux=True)(
            tuple(map(f64, (q, k, v))), {n: f64(x) for n, x in arrays.items()})
    return np.asarray(out), grads


def closure_alibi(slopes):
    """A hand-written ALiBi that closes over its slopes, symmetric
    (``-slopes[head] * |k - q|``): on the causal pairs it is ALiBi, and it is not ALiBi's
    affine form, so it runs as a function, its slopes read in the kernels (the natural
    ``slopes[head] * (k_pos - q_pos)`` would run as built-in ALiBi: `as_alibi`)."""
    return lambda score, head, q_pos, k_pos: score - slopes[head] * jnp.abs(k_pos - q_pos)


@pytest.mark.parametrize("closed_over", [  # the quick tier: the slopes' gradient too
    pytest.param("concrete", marks=pytest.mark.slow),
    pytest.param("traced", marks=pytest.mark.slow), "differentiated"])
def test_closure_alibi_matches_the_oracle(closed_over):
    """The slopes as a concrete array, a `jit` argument, or an argument of `jax.grad` (its
    gradient formed in the dq kernel, per program, summed after it)."""
    q, k, v, cot, rng = _inputs(1)
    slopes = jnp.asarray(rng.uniform(-0.4, 0.4, H), jnp.float32)
    mask = masks.Causal()
    kernel = kernels.PallasTpuBlockSparse()

    def loss(q, k, v, slopes):
        out = _attention(closure_alibi(slopes), mask, kernel)(q, k, v)
        return jnp.vdot(out, cot), out

    argnums = (0, 1, 2, 3) if closed_over == "differentiated" else (0, 1, 2)
    with jax.default_matmul_precision("highest"):
        if closed_over == "concrete":
            grads, out = jax.grad(lambda *a: loss(*a, slopes), argnums=(0, 1, 2),
                                  has_aux=True)(q, k, v)
        else:
            grads, out = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v,
                                                                              slopes)
    want_out, (want_qkv, want_arrays) = _oracle(closure_alibi, mask, q, k, v, cot,
                                                {"slopes": slopes})
    assert _rel(out, want_out) < TOL
    for g, w in zip(grads[:3], want_qkv):
        assert _rel(g, w) < TOL
    if closed_over == "differentiated":
        assert _rel(grads[3], want_arrays["slopes"]) < SLOPES_TOL


def mixed(alpha, log_slopes):
    """Reads a traced 0-d array whole, a traced array through an operation on all of it
    (computed before the kernels), and a concrete int32 table at two scalar indices."""
    widths = jnp.asarray([[0, 5], [1, 40], [2, 7], [3, 90]], jnp.int32)

    def fn(score, head, q_pos, k_pos):
        near = (q_pos - k_pos) < widths[head, 1]
        return (score + jnp.exp(log_slopes)[head] * (k_pos - q_pos).astype(score.dtype)
                + alpha * jnp.where(near, 1.0, -1.0))

    return fn


def test_arrays_read_whole_through_an_operation_and_by_two_indices_with_soft_cap():
    """A soft cap (the gradient of the function's result is the cap's times the rest), a
    window: output and the gradients of q, k, v, `alpha` and `log_slopes` against float64."""
    q, k, v, cot, rng = _inputs(2)
    arrays = {"alpha": jnp.float32(0.7),
              "log_slopes": jnp.asarray(rng.uniform(-3.0, -1.0, H), jnp.float32)}
    mask = masks.Causal() & masks.SlidingWindow(150, 0)
    kernel = kernels.PallasTpuBlockSparse()

    def loss(q, k, v, arrays):
        out = _attention(mixed(**arrays), mask, kernel, soft_cap=4.0)(q, k, v)
        return jnp.vdot(out, cot), out

    with jax.default_matmul_precision("highest"):
        (dq, dk, dv, d_arrays), out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3),
                                                       has_aux=True))(q, k, v, arrays)
    want_out, (want_qkv, want_arrays) = _oracle(mixed, mask, q, k, v, cot, arrays,
                                                soft_cap=4.0)
    assert _rel(out, want_out) < TOL
    for g, w in zip((dq, dk, dv), want_qkv):
        assert _rel(g, w) < TOL
    for name in arrays:
        assert _rel(d_arrays[name], want_arrays[name]) < SLOPES_TOL, name


@jax.custom_jvp
def _straight_through_clip(score, bound):
    return jnp.clip(score, -bound, bound)


@_straight_through_clip.defjvp
def _straight_through_clip_jvp(primals, tangents):
    return _straight_through_clip(*primals), tangents[0]  # the derivative in score is 1


def clip_by_head(bounds):
    """A clip of the logits per head whose derivative is its own rule (straight through),
    the bound read first, and that read under `jax.checkpoint`."""
    def fn(score, head, q_pos, k_pos):
        bound = jax.checkpoint(lambda b, h: b[h])(bounds, head)
        return _straight_through_clip(score, bound) - 0.01 * jnp.abs(q_pos - k_pos)

    return fn


def test_a_derivative_rule_of_the_users_runs_on_the_scalar_it_reads():
    """The rule, not its jaxpr, gives the gradients (the clip's own derivative would be 0 on
    the clipped logits): q, k and v against the float64 oracle, which runs the same rule."""
    q, k, v, cot, _ = _inputs(7)
    arrays = {"bounds": jnp.asarray([0.5, 1.0, 2.0, 4.0], jnp.float32)}
    mask = masks.Causal()
    attn = _attention(clip_by_head(**arrays), mask, kernels.PallasTpuBlockSparse())
    assert attn.plan(q, k, v).kernel.name == "pallas_tpu"

    def loss(q, k, v):
        out = attn(q, k, v)
        return jnp.vdot(out, cot), out

    with jax.default_matmul_precision("highest"):
        grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    want_out, (want_qkv, _) = _oracle(clip_by_head, mask, q, k, v, cot, arrays)
    assert _rel(out, want_out) < TOL
    for g, w in zip(grads, want_qkv):
        assert _rel(g, w) < TOL


def test_a_derivative_rule_taking_an_array_whole_is_declined():
    """The kernels differentiate what they replay: a rule given the whole array would be
    replaced by its jaxpr's derivative, so the call is declined in one line."""
    bounds = jnp.asarray([0.5, 1.0, 2.0, 4.0], jnp.float32)
    ste = jax.custom_jvp(lambda score, b, h: jnp.clip(score, -b[h], b[h]))
    ste.defjvp(lambda primals, tangents: (ste(*primals), tangents[0]))
    resolved = bsa.ResolvedMask(masks.Causal(), q_len=L, kv_len=L, num_heads=H)
    term = scores.ScoreFunction(lambda s, h, q, k: ste(s, bounds, h)).compile(H).function
    features = bsa.Features(**{**TPU, "score": ("function",), "score_function": term})
    why = kernels.PallasTpuBlockSparse().decline_reason(resolved, features)
    assert why == ("the score function reads an array only as the TPU kernels cannot: it "
                   "passes an array it reads (of shape (4,)) whole to a function with a "
                   "derivative rule of its own (`custom_jvp_call`); index it first and pass "
                   "the scalar (read arrays at scalar indices, e.g. slopes[head]).")


def test_closure_gradients_lower_for_a_tpu(v5e_lowering):
    """``interpret=False``: the forward, dq (with the closed-over array's gradient blocks)
    and dk/dv kernels of `jax.grad` lower for a TPU v5e; the array is read from scalar
    memory."""
    x = jax.ShapeDtypeStruct((1, H, 256, 128), jnp.float32)

    def loss(q, k, v, arrays):
        attn = bsa.BlockSparseAttention(
            mask=masks.Causal(), score=scores.ScoreFunction(mixed(**arrays)),
            kernel=kernels.PallasTpuBlockSparse(interpret=False), tiling=TILES)
        return attn(q, k, v).sum()

    arrays = {"alpha": jax.ShapeDtypeStruct((), jnp.float32),
              "log_slopes": jax.ShapeDtypeStruct((H,), jnp.float32)}
    modules = v5e_lowering(jax.grad(loss, argnums=(0, 1, 2, 3)), x, x, x, arrays)
    assert set(modules) == {"pallas_tpu_forward", "pallas_tpu_dq", "pallas_tpu_dkv"}
    for name, text in modules.items():
        assert "memref<4xf32, #tpu.memory_space<smem>>" in text, name


TABLE = jnp.asarray(np.random.default_rng(3).standard_normal((H, 2 * L)), jnp.float32)


def gathers_by_position(score, head, q_pos, k_pos):
    """Reads its table at the positions: a gather on the tile."""
    return score + TABLE[head, q_pos - k_pos + L]


def reads_bfloat16(score, head, q_pos, k_pos):
    return score + TABLE.astype(jnp.bfloat16)[head, 0]


BIG = jnp.ones((DATA_LIMIT + 1,), jnp.float32)


def reads_a_big_array(score, head, q_pos, k_pos):
    return score + BIG[head]


@pytest.mark.parametrize("fn, reason", [
    (gathers_by_position, r"^the score function reads an array only as the TPU kernels "
                          r"cannot: it applies `gather` .*slopes\[head\]\)\.$"),
    (reads_bfloat16, r"^the score function reads an array of bfloat16 \(shape \(4, 400\)\): "
                     r"the TPU kernels read 32-bit or bool arrays\.$"),
    (reads_a_big_array, rf"^the score function reads arrays of {DATA_LIMIT + 1} elements"),
])
def test_functions_it_cannot_run_are_declined_at_plan_time(fn, reason):
    """Declined by name when planned (the selector then takes another kernel on a TPU), and
    an explicit request is refused before anything runs."""
    resolved = bsa.ResolvedMask(masks.Causal(), q_len=L, kv_len=L, num_heads=H)
    term = scores.ScoreFunction(fn).compile(H).function
    features = bsa.Features(**{**TPU, "score": ("function",), "score_function": term})
    kernel = kernels.PallasTpuBlockSparse()
    assert kernel.decline_reason(resolved, features) is not None
    assert re.match(reason, kernel.decline_reason(resolved, features))
    assert bsa.select_kernel(masks.Causal(), "tpu", features).kernel.name == "xla"
    q, k, v, _, _ = _inputs(4)
    with pytest.raises(ValueError, match=r"^kernel pallas_tpu cannot run this call: the "
                                         r"score function reads "):
        _attention(fn, masks.Causal(), kernel)(q, k, v)


def test_selector_picks_it_for_a_closure_on_a_tpu():
    term = scores.ScoreFunction(closure_alibi(jnp.ones((H,)))).compile(H).function
    features = bsa.Features(**{**TPU, "score": ("function",), "score_function": term})
    assert bsa.select_kernel(masks.Causal(), "tpu", features).kernel.name == "pallas_tpu"


def learned_alibi(score, head, q_pos, k_pos, params):
    """`closure_alibi` with the slopes in `params`: symmetric, so it runs as a function."""
    return score - params["slopes"][head] * jnp.abs(k_pos - q_pos)


def learned(score, head, q_pos, k_pos, params):
    """Learned ALiBi slopes, a per-head window weight read at two scalar indices, and a 0-d
    temperature."""
    distance = (k_pos - q_pos).astype(score.dtype)
    near = jnp.where(q_pos - k_pos < 40, 1.0, -1.0)
    return (score * params["temperature"] + params["slopes"][head] * distance
            + params["bias"][head, 1] * near)


def _learned_params(rng):
    return {"slopes": jnp.asarray(rng.uniform(-0.4, 0.4, H), jnp.float32),
            "bias": jnp.asarray(rng.standard_normal((H, 2)), jnp.float32),
            "temperature": jnp.float32(1.3)}


def test_params_run_in_the_kernels_and_match_the_oracle():
    """A `ScoreFunction` with `params` (learned slopes, a per-head weight ``[H, 2]``, a 0-d
    temperature), planned for a TPU: the selector takes this kernel; run (interpreted), output and
    the gradients of q, k, v and every leaf of `params` against float64, and the params'
    gradients bit-identical on a second run (per-program blocks summed in a fixed order)."""
    q, k, v, cot, rng = _inputs(5)
    params = _learned_params(rng)
    mask = masks.Causal()
    score = scores.ScoreFunction(learned, params)
    plan = bsa.BlockSparseAttention(mask=mask, score=score).plan(q, k, v, platform="tpu")
    assert plan.kernel.name == "pallas_tpu", plan.choice.explain()
    kernel = kernels.PallasTpuBlockSparse()

    def loss(q, k, v, params):
        attn = bsa.BlockSparseAttention(mask=mask, score=scores.ScoreFunction(learned, params),
                                        kernel=kernel, tiling=TILES)
        out = attn(q, k, v)
        return jnp.vdot(out, cot), out

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    with jax.default_matmul_precision("highest"):
        (dq, dk, dv, dparams), out = step(q, k, v, params)
        again = step(q, k, v, params)[0][3]
    make = lambda **p: (lambda s, h, qp, kp: learned(s, h, qp, kp, p))  # noqa: E731
    want_out, (want_qkv, want_params) = _oracle(make, mask, q, k, v, cot, params)
    assert _rel(out, want_out) < TOL
    for g, w in zip((dq, dk, dv), want_qkv):
        assert _rel(g, w) < TOL
    for name in params:
        assert _rel(dparams[name], want_params[name]) < SLOPES_TOL, name
        np.testing.assert_array_equal(np.asarray(dparams[name]), np.asarray(again[name]))


def test_params_gradients_lower_for_a_tpu(v5e_lowering):
    """``interpret=False``: with `params`, the forward, dq (the params' gradient blocks) and
    dk/dv kernels of `jax.grad` lower for a TPU v5e, the leaves read from scalar memory."""
    x = jax.ShapeDtypeStruct((1, H, 256, 128), jnp.float32)

    def loss(q, k, v, params):
        attn = bsa.BlockSparseAttention(
            mask=masks.Causal(), score=scores.ScoreFunction(learned, params),
            kernel=kernels.PallasTpuBlockSparse(interpret=False), tiling=TILES)
        return attn(q, k, v).sum()

    params = {"slopes": jax.ShapeDtypeStruct((H,), jnp.float32),
              "bias": jax.ShapeDtypeStruct((H, 2), jnp.float32),
              "temperature": jax.ShapeDtypeStruct((), jnp.float32)}
    modules = v5e_lowering(jax.grad(loss, argnums=(0, 1, 2, 3)), x, x, x, params)
    assert set(modules) == {"pallas_tpu_forward", "pallas_tpu_dq", "pallas_tpu_dkv"}
    for name, text in modules.items():
        assert "memref<4xf32, #tpu.memory_space<smem>>" in text, name
        assert "memref<8xf32, #tpu.memory_space<smem>>" in text, name


def table_by_distance(score, head, q_pos, k_pos, params):
    """Reads a learned ``[H, 2L - 1]`` table at the tile's distances: a gather on the tile."""
    return score + params["table"][head, k_pos - q_pos + L - 1]


@pytest.mark.parametrize("params, fn, reason", [
    ({"table": jnp.zeros((H, 2 * L - 1), jnp.float32)}, table_by_distance,
     r"^the score function reads an array only as the TPU kernels cannot: it applies "
     r"`gather` to an array it reads \(of shape \(4, 399\)\) other than at scalar indices "
     r"\(read arrays at scalar indices, e.g\. slopes\[head\]\)\.$"),
    ({"slopes": jnp.zeros((H,), jnp.bfloat16)}, learned_alibi,
     r"^the score function reads an array of bfloat16 \(shape \(4,\)\): the TPU kernels "
     r"read 32-bit or bool arrays\.$"),
    ({"slopes": jnp.zeros((DATA_LIMIT + 1,), jnp.float32)}, learned_alibi,
     rf"^the score function reads arrays of {DATA_LIMIT + 1} elements \(at most "
     rf"{DATA_LIMIT}, in scalar memory\)\.$"),
])
def test_params_it_cannot_read_are_declined_at_plan_time(params, fn, reason):
    """Declined from the params' shapes alone (`Features.score_params`), in one line naming
    the reason; the selector then takes another kernel on a TPU, and an explicit request is
    refused before anything runs."""
    resolved = bsa.ResolvedMask(masks.Causal(), q_len=L, kv_len=L, num_heads=H)
    term = scores.ScoreFunction(fn, params).compile(H).function
    features = bsa.Features(**{**TPU, "score": ("function",), "score_function": term,
                               "score_params": ScoreParams.of(params)})
    why = kernels.PallasTpuBlockSparse().decline_reason(resolved, features)
    assert why is not None and re.match(reason, why) and "\n" not in why, why
    assert bsa.select_kernel(masks.Causal(), "tpu", features).kernel.name == "xla"
    q, k, v, _, _ = _inputs(4)
    explicit = bsa.BlockSparseAttention(mask=masks.Causal(),
                                        score=scores.ScoreFunction(fn, params),
                                        kernel=kernels.PallasTpuBlockSparse())
    with pytest.raises(ValueError, match=r"^kernel pallas_tpu cannot run this call: the "
                                         r"score function reads "):
        explicit(q, k, v)


def test_selector_picks_it_for_params_on_a_tpu():
    """At the issue's size (bf16, 16 heads, 8k), from the params' shapes alone."""
    params = {"slopes": jnp.ones((16,), jnp.float32)}
    term = scores.ScoreFunction(learned_alibi, params).compile(16).function
    features = bsa.Features(**{**TPU, "score": ("function",), "score_function": term,
                               "score_params": ScoreParams.of(params)})
    choice = bsa.select_kernel(masks.Causal(), "tpu", features)
    assert choice.kernel.name == "pallas_tpu", choice.explain()
    # Features built by hand with the flag this field once was: the way out, in one line.
    resolved = bsa.ResolvedMask(masks.Causal(), q_len=8192, kv_len=8192, num_heads=16)
    flagged = bsa.Features(**{**TPU, "score": ("function",), "score_function": term,
                              "score_params": True})
    assert kernels.PallasTpuBlockSparse().decline_reason(resolved, flagged) == (
        "the call's Features give the score function's params as a flag, not their shapes: "
        "pass score_params=ScoreParams.of(params).")


@pytest.mark.parametrize("fn, params", [
    (closure_alibi(jnp.ones((H,))), None), (mixed(jnp.float32(0.7), jnp.zeros((H,))), None),
    (gathers_by_position, None), (reads_bfloat16, None), (reads_a_big_array, None),
    (learned_alibi, {"slopes": jnp.ones((H,), jnp.float32)}),
    (learned_alibi, {"slopes": jnp.zeros((H,), jnp.bfloat16)}),
    (learned_alibi, {"slopes": jnp.zeros((DATA_LIMIT + 1,), jnp.float32)}),
    (learned, _learned_params(np.random.default_rng(0))),
    (table_by_distance, {"table": jnp.zeros((H, 2 * L - 1), jnp.float32)}),
])
def test_the_functions_here_run_as_functions(fn, params):
    """None of them is rewritten to built-in ALiBi (`as_alibi`): the tests above exercise the
    kernels reading (or declining) a function's arrays and params."""
    assert as_alibi(scores.ScoreFunction(fn, params).compile(H), H).function is not None
