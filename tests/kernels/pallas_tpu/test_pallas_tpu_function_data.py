"""`PallasTpuBlockSparse` with a `ScoreFunction` that reads arrays: arrays it closes over
(concrete, traced by `jit`, or differentiated by `jax.grad`) against the float64 oracle,
forward and every gradient (q, k, v and the closed-over arrays), with GQA and a causal mask,
interpreted on the CPU; the programs lowered for a TPU v5e; what it declines at plan time
(an array read other than at scalar indices, a score function's `params`), and the selector
then running another kernel for a TPU call."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
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
    """The natural hand-written ALiBi: a function that closes over its slopes."""
    return lambda score, head, q_pos, k_pos: score + slopes[head] * (k_pos - q_pos)


@pytest.mark.parametrize("closed_over", ["concrete", "traced", "differentiated"])
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
    return score + params["slopes"][head] * (k_pos - q_pos)


def test_a_score_function_with_params_goes_to_another_kernel_on_a_tpu():
    """Planned for a TPU on the CPU, a function with `params` is declined by this kernel at
    plan time (before: chosen, then refused when run); the kernel chosen instead runs (here
    in its CPU form) and matches float64, `params` gradient included."""
    q, k, v, cot, rng = _inputs(5)
    params = {"slopes": jnp.asarray(rng.uniform(-0.4, 0.4, H), jnp.float32)}
    score = scores.ScoreFunction(learned_alibi, params)
    plan = bsa.BlockSparseAttention(mask=masks.Causal(), score=score).plan(
        q, k, v, platform="tpu")
    assert plan.kernel.name != "pallas_tpu"
    assert "it does not read a score function's `params` yet" in plan.choice.explain()

    def loss(q, k, v, params):
        out = bsa.blocksparse_attention(q, k, v, causal=True, platform="pallas",
                                        score=scores.ScoreFunction(learned_alibi, params))
        return jnp.vdot(out, cot), out

    with jax.default_matmul_precision("highest"):
        grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, params)
    want_out, (want_qkv, want_arrays) = _oracle(
        closure_alibi, masks.Causal(), q, k, v, cot, {"slopes": params["slopes"]})
    assert _rel(out, want_out) < TOL
    for g, w in zip(grads[:3], want_qkv):
        assert _rel(g, w) < TOL
    # XlaBlockSparse's float32 sum of dS times the distance (SLOPES_TOL's note: 1.9e-4 on
    # another call against float64; on a TPU v5e this call measured 8.9e-4, 2026-12-06).
    assert _rel(grads[3]["slopes"], want_arrays["slopes"]) < (2e-3 if ON_TPU else 5e-4)
    explicit = bsa.BlockSparseAttention(mask=masks.Causal(), score=score,
                                        kernel=kernels.PallasTpuBlockSparse())
    with pytest.raises(ValueError, match=r"^kernel pallas_tpu cannot run this call: it does "
                                         r"not read a score function's `params` yet"):
        explicit(q, k, v)
