"""A bias in `MosaicBlockSparse`, on a host without a GPU.

The bias ``[1 or B, 1 or H, Lq, Lk]`` is an operand of each launch: every visited block adds
its tile to the logits (the dk/dv launch reads it transposed), and the dq launch writes
each visited block's dS, the bias's gradient, where the bias is differentiated (the blocks
the layout skips are zeroed after, from `BlockLayout.classes`). Here: the forward and the
backward lower for CUDA with a bias, alone and beside a mask without terms, ALiBi, a score
function and a soft cap; the selector keeps the kernel for such a call; and extended tests
run the whole call in Pallas' CPU interpreter for Mosaic GPU against the float64 oracle
(test_mosaic_bias_gpu.py runs it on a GPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks, scores
from eqx_bsattn._score_alibi import as_alibi
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse
from eqx_bsattn.strategies.kernels.mosaic import kernel as mosaic_kernel
from tests.conftest import jnp_attention_f64, np_visibility, random_array, rel_err, score_f64

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


def _head_slopes(score, head, q_pos, k_pos):
    """Symmetric ALiBi written as a score function, ``score - 2^-(head + 1) |k - q|``: ALiBi
    on the pairs with k <= q, but not affine in the positions, so it runs as a function
    (ALiBi itself would run as built-in slopes: `as_alibi`)."""
    slope = jnp.exp2(-1.0 - jnp.asarray(head).astype(jnp.float32))
    return score - slope * jnp.abs(k_pos - q_pos).astype(jnp.float32)


def _qkv(batch, heads, kv_heads, q_len, kv_len, dim, dtype=jnp.float32):
    return (random_array(1, (batch, heads, q_len, dim), dtype),
            random_array(2, (batch, kv_heads, kv_len, dim), dtype),
            random_array(3, (batch, kv_heads, kv_len, dim), dtype))


def test_bias_is_chosen(hopper_host):
    """The selector keeps this kernel for a call with a bias on a Hopper GPU (it ran there:
    test_mosaic_bias_gpu.py)."""
    q, k, v = _qkv(1, 2, 2, 256, 256, 64, jnp.bfloat16)
    bias = random_array(4, (1, 2, 256, 256), jnp.bfloat16)
    plan = bsa.BlockSparseAttention(mask=masks.Causal() & masks.SlidingWindow(64, 0)).plan(
        q, k, v, bias=bias)
    assert plan.choice.kernel.name == "mosaic", plan.choice.explain()


def test_bias_inside_a_sharding_loop_is_declined(hopper_host):
    """A bias runs in the kernels, but inside a sharding's loop (RingAttention) it has not
    run yet: declined there in one line, taken elsewhere."""
    resolved = bsa.ResolvedMask(masks.Causal(), q_len=256, kv_len=256, num_heads=2)
    base = dict(platform="gpu", dtype="bfloat16", head_dim=128, value_dim=128, bias=True)
    kernel = MosaicBlockSparse()
    assert kernel.decline_reason(resolved, bsa.Features(**base)) is None
    why = kernel.decline_reason(resolved, bsa.Features(**base, in_loop=True))
    assert why == "a bias inside a sharding's loop (RingAttention) is not supported."


def _lowered_qkv(batch, heads, kv_heads, q_len, kv_len, dim):
    """q, k and v in bfloat16 for a call that is only lowered (any size)."""
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = ((batch, heads, q_len, dim), (batch, kv_heads, kv_len, dim),
              (batch, kv_heads, kv_len, dim))
    return tuple(jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes))


def _no_run_time_checks(monkeypatch):
    """A traced bias's run-time check (no +inf or NaN) is a host callback, which JAX cannot
    lower for another platform: taken out where these tests lower for CUDA."""
    import eqx_bsattn._values as values

    monkeypatch.setattr(values.eqx, "error_if", lambda x, *_: x)


#: name: (mask, shapes, bias shape, bias dtype, module options)
LOWERED = {
    "causal_head_bias": (masks.Causal(), dict(batch=2, heads=2, kv_heads=2, q_len=512,
                                              kv_len=512, dim=128),
                         (1, 2), jnp.bfloat16, {}),
    "window_gqa_batch_bias_f32": (masks.Causal() & masks.SlidingWindow(256, 0),
                                  dict(batch=2, heads=4, kv_heads=2, q_len=512, kv_len=512,
                                       dim=128), (2, 1), jnp.float32, {}),
    # Ragged lengths, a mask without terms, ALiBi and a soft cap.
    "predicate_alibi_soft_cap_ragged": (
        masks.Predicate(lambda q, k: (k <= q) & ((q - k) % 3 != 1)),
        dict(batch=1, heads=2, kv_heads=1, q_len=200, kv_len=333, dim=64), (1, 2),
        jnp.bfloat16, dict(score=scores.ALiBi(), logits_soft_cap=20.0)),
    "function_full_bias": (masks.Causal(), dict(batch=1, heads=2, kv_heads=2, q_len=384,
                                                kv_len=384, dim=64),
                           (1, 1), jnp.float16, dict(score=scores.ScoreFunction(_head_slopes))),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LOWERED))
def test_bias_lowers_for_cuda(hopper_host, monkeypatch, case):
    """`jit(grad)` with a bias lowers for CUDA: three Mosaic GPU launches (the forward, dq
    and dk/dv), the bias's gradient in its own shape (a constant bias:
    `test_constant_bias_writes_no_gradient`). A score function runs as one (not rewritten
    to built-in ALiBi)."""
    _no_run_time_checks(monkeypatch)
    mask, shape, bias_shape, dtype, options = LOWERED[case]
    if isinstance(options.get("score"), scores.ScoreFunction):
        heads = shape["heads"]
        assert as_alibi(options["score"].compile(heads), heads).function is not None
    attn = bsa.BlockSparseAttention(mask=mask, kernel=MosaicBlockSparse(), **options)
    q, k, v = _lowered_qkv(**shape)
    bias = jax.random.normal(jax.random.key(4), (*bias_shape, shape["q_len"],
                                                 shape["kv_len"]), dtype)
    loss = jax.jit(jax.grad(
        lambda q, k, v, bias: jnp.sum(attn(q, k, v, bias=bias).astype(jnp.float32)),
        argnums=(0, 1, 2, 3)))
    lowered = loss.trace(q, k, v, bias).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("custom_call @mosaic_gpu") == 3, case
    assert [o.shape for o in jax.tree.leaves(lowered.out_info)] == [q.shape, k.shape, v.shape,
                                                                    bias.shape]


def test_constant_bias_writes_no_gradient(hopper_host, launches, monkeypatch):
    """A bias that is not differentiated costs the backward no gradient: the dq launch
    writes dS only where the bias's gradient is asked for."""
    _no_run_time_checks(monkeypatch)
    from eqx_bsattn.strategies.kernels.mosaic import backward

    written = []
    real = backward.dq_call

    def spy(cfg, *args, **kwargs):
        written.append(cfg.bias_gradient)
        return real(cfg, *args, **kwargs)

    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(1, 2, 2, 256, 256, 64))
    bias = random_array(4, (1, 2, 256, 256), jnp.bfloat16)
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=MosaicBlockSparse())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mosaic_kernel, "dq_call", spy)
        for argnums in ((0,), (0, 3)):
            jax.jit(jax.grad(lambda q, k, v, b: jnp.sum(attn(q, k, v, bias=b)
                                                        .astype(jnp.float32)),
                             argnums=argnums)).trace(q, k, v, bias).lower(
                lowering_platforms=("cuda",))
    assert written == [False, True]
    assert all(fcfg.bias and bcfg.bias and not bcfg.single_pass for fcfg, bcfg, *_ in launches)


#: name: (mask, shapes, bias shape, options)
INTERPRETED = {
    # The batch's rows share a bias per head (its gradient summed over the batch), grouped
    # heads, ragged keys, Lq != Lk, a row wholly hidden by the bias and rows partly hidden.
    "causal_gqa_head_bias": (masks.Causal(bottom_right=True),
                             dict(batch=2, heads=2, kv_heads=1, q_len=150, kv_len=200, dim=64),
                             (1, 2), {}),
    # A bias per batch row and head, under a mask without terms, ALiBi and a soft cap.
    "predicate_alibi_soft_cap": (masks.Predicate(lambda q, k: (k <= q) & ((q - k) % 3 != 1)),
                                 dict(batch=2, heads=2, kv_heads=2, q_len=200, kv_len=200,
                                      dim=64), (2, 2),
                                 dict(score=scores.ALiBi(), logits_soft_cap=5.0)),
}


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("case", list(INTERPRETED))
def test_bias_in_cpu_interpreter(interpreted, case):
    """The whole call, its launches in Pallas' CPU interpreter for Mosaic GPU: output and the
    gradients in q, k, v and the bias against the float64 oracle (a bias of -inf hides its
    pair, and a row it hides wholly gives zeros; under a soft cap it weighs as -cap)."""
    mask, shape, bias_shape, options = INTERPRETED[case]
    options = dict(options)
    q, k, v = _qkv(**shape)
    lq, lk, heads = shape["q_len"], shape["kv_len"], shape["heads"]
    bias = random_array(4, (*bias_shape, lq, lk)) * 2.0
    bias = bias.at[0, -1, 5:9, : lk // 2].set(-jnp.inf)  # rows partly hidden
    bias = bias.at[0, 0, 7].set(-jnp.inf)  # a row wholly hidden
    cot = random_array(5, q.shape)
    attn = bsa.BlockSparseAttention(mask=mask, kernel=MosaicBlockSparse(), **options)

    def call(q, k, v, bias):
        return attn(*(x.astype(jnp.float16) for x in (q, k, v)),
                    bias=bias).astype(jnp.float32)

    out, pullback = jax.vjp(call, q, k, v, bias)
    got = pullback(cot)
    finite = np.isfinite(np.asarray(bias))
    cap = options.get("logits_soft_cap")
    # A soft cap follows the bias and turns -inf into -cap (docs/reliability.md): nothing is
    # hidden then; -1e4 saturates the cap as -inf does.
    visible = np_visibility(mask, batch=shape["batch"], heads=heads, q_len=lq,
                            kv_len=lk) & (finite | bool(cap))
    positions = (np.arange(lq)[None], np.arange(lk)[None])
    with jax.enable_x64(True):
        def oracle(q, k, v, bias):
            score = None
            if "score" in options:
                def score(s):
                    return score_f64(s, q_pos=positions[0], kv_pos=positions[1],
                                     slopes=jnp.asarray(np.asarray(
                                         scores.ALiBi().compile(heads).slopes, np.float64)))
            return jnp_attention_f64(q, k, v, visible,
                                     bias=jnp.where(finite, bias, -1e4 if cap else 0.0),
                                     score=score, soft_cap=cap)

        f64 = [jnp.asarray(np.asarray(x.astype(jnp.float16), np.float64)) for x in (q, k, v)]
        want_out, oracle_pullback = jax.vjp(oracle, *f64,
                                            jnp.asarray(np.asarray(bias, np.float64)))
        want = oracle_pullback(jnp.asarray(np.asarray(cot, np.float64)))
    assert not np.isnan(np.asarray(out)).any()
    if not cap:  # the row the bias hides wholly (a cap hides nothing)
        assert np.abs(np.asarray(out)[0, 0, 7]).max() == 0.0
    assert rel_err(out, want_out) < 4e-3
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert g.shape == w.shape, name
        assert not np.isnan(np.asarray(g)).any(), name
        assert rel_err(g, w) < 1e-2, name
