"""A score function that is ALiBi runs as ALiBi's slopes (`eqx_bsattn._score_alibi`).

What the jaxpr proves and what it refuses to prove; the slopes read from the function; and
calls through the module against the float64 oracle of the function as the user wrote it
(forward, the q, k, v gradients and the gradients of its arrays), under `jax.jit`, `jax.vmap`
and on the kernels a GPU plan picks."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
from eqx_bsattn._score import ScoreTerms
from eqx_bsattn._score_alibi import agrees_on_tiles, as_alibi, is_alibi, probe_params
from tests.conftest import assert_close, jnp_attention_f64, np_visibility, random_inputs

H = 4
SLOPES = jnp.asarray([0.5, -0.25, 0.125, 0.0625], jnp.float32)


@jax.jit
def _inner(a, b):
    return a + b


def _two_thirds(x):
    return x * 2.0 / 3.0


#: name: (fn, params, the slopes it is proven to be, or None where it must run as written).
CASES = {
    "closure": (lambda s, h, q, k: s + SLOPES[h] * (k - q), None, SLOPES),
    "split_products": (lambda s, h, q, k: s + SLOPES[h] * k - SLOPES[h] * q, None, SLOPES),
    "negated_distance": (lambda s, h, q, k: s - SLOPES[h] * (q - k).astype(jnp.float32),
                         None, SLOPES),
    "params": (lambda s, h, q, k, p: s + p["m"][h] * (k - q), {"m": SLOPES}, SLOPES),
    "exp_of_params_over_two": (lambda s, h, q, k, p: s + jnp.exp(p)[h] * (k - q) / 2.0,
                               jnp.log(jnp.abs(SLOPES)), jnp.abs(SLOPES) / 2),
    "head_formula": (lambda s, h, q, k: s + jnp.exp2(-1.0 - h) * (k - q), None,
                     2.0 ** -(1.0 + jnp.arange(H))),
    "inner_jit": (lambda s, h, q, k: _inner(s, SLOPES[h] * (k - q)), None, SLOPES),
    "helper": (lambda s, h, q, k: s + _two_thirds(SLOPES[h] * (k - q)), None,
               SLOPES * 2.0 / 3.0),
    "one_slope_for_all_heads": (lambda s, h, q, k, p: s + p * (k - q), jnp.float32(0.3),
                                jnp.full(H, 0.3)),
    # Not ALiBi, or not provably so: each runs as written.
    "identity": (lambda s, h, q, k: s, None, None),
    "symmetric": (lambda s, h, q, k: s - SLOPES[h] * jnp.abs(k - q), None, None),
    "where": (lambda s, h, q, k: jnp.where(k <= q, s + SLOPES[h] * (k - q), s), None, None),
    "plus_constant": (lambda s, h, q, k: s + SLOPES[h] * (k - q) + 1.0, None, None),
    "rows_only": (lambda s, h, q, k: s + SLOPES[h] * q, None, None),
    "scaled_score": (lambda s, h, q, k: 2.0 * s + SLOPES[h] * (k - q), None, None),
    "bfloat16_slopes": (lambda s, h, q, k: s + SLOPES.astype(jnp.bfloat16)[h] * (k - q),
                        None, None),
    "two_slopes": (lambda s, h, q, k: s + SLOPES[h] * k - SLOPES[(h + 1) % H] * q, None, None),
    "tanh": (lambda s, h, q, k: s + jnp.tanh(SLOPES[h] * (k - q)), None, None),
    "squared": (lambda s, h, q, k: s + (SLOPES[h] * (k - q)) ** 2, None, None),
    "transposed_queries": (lambda s, h, q, k: s + SLOPES[h] * (k - q.T), None, None),
    "reshaped_queries": (lambda s, h, q, k: s + SLOPES[h] * (k - q.reshape(1, -1)), None, None),
    "per_batch": (lambda s, h, q, k, batch: s + SLOPES[h] * (batch + 1) * (k - q), None, None),
    # An array broadcast along the probe's 8 key columns: a slope per column, not per head.
    "slope_per_column": (lambda s, h, q, k: s + jnp.arange(8.0) * (k - q), None, None),
    # A derivative rule of its own on the slopes alone is part of the slopes' evaluation.
    "custom_jvp_on_the_slopes": (lambda s, h, q, k: s + jax.nn.relu(SLOPES)[h] * (k - q), None,
                                 jax.nn.relu(SLOPES)),
}


@jax.custom_vjp
def _clipped_gradient(x):
    return x


_clipped_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),))


def _swapped_twice(s, h, q, k):  # symmetric ALiBi; one pass of the loop's body reads ALiBi
    pair = (s - SLOPES[h] * jnp.abs(k - q), s + SLOPES[h] * (k - q))
    return jax.lax.fori_loop(0, 2, lambda i, c: (c[1], c[0]), pair)[0]


def _on_the_probe_only(s, h, q, k):
    if s.shape[-1] == 8 and s.ndim == 3:  # the probe tile
        return s + SLOPES[h] * (k - q)
    return s - SLOPES[h] * jnp.abs(k - q)


#: Functions the probe's jaxpr alone would read as ALiBi, found otherwise: each runs as
#: written. name: (fn, which check sees it: "proof" (`is_alibi`) or "tiles"
#: (`agrees_on_tiles`)).
NOT_ALIBI = {
    # A loop runs its body more than once: 2 s + 2 c (k - q).
    "loop": (lambda s, h, q, k: jax.lax.fori_loop(0, 2, lambda i, x: 2.0 * x,
                                                   0.5 * s + SLOPES[h] * (k - q)), "proof"),
    "loop_swapping_a_pair": (_swapped_twice, "proof"),
    # The derivative in s is the rule's, not ALiBi's.
    "custom_vjp_on_the_logits": (lambda s, h, q, k: _clipped_gradient(s + SLOPES[h] * (k - q)),
                                 "proof"),
    "scaled_by_the_tile_width": (lambda s, h, q, k: s + SLOPES[h] * (k - q)
                                 * (8.0 / s.shape[-1]), "tiles"),
    "branch_on_the_tile_shape": (_on_the_probe_only, "tiles"),
    "count_of_the_heads_given": (lambda s, h, q, k: s + SLOPES[h] * (k - q) * 4.0
                                 / jnp.sum(h * 0 + 1).astype(jnp.float32), "tiles"),
    "count_of_the_columns": (lambda s, h, q, k: s + SLOPES[h] * (k - q) * 8.0
                             / jnp.sum(k - k + 1).astype(jnp.float32), "tiles"),
    # Under ShardMap over heads each shard sees its own heads' maximum.
    "maximum_of_the_heads_given": (lambda s, h, q, k: s + SLOPES[h] * (k - q) * 4.0
                                   / (jnp.max(h) + 1).astype(jnp.float32), "tiles"),
    # As polynomials the offsets cancel; in float32 the positions are rounded to 1/16 first.
    "offsets_float32_does_not_keep": (lambda s, h, q, k: s + 4.0 * SLOPES[h]
                                      * ((k * 0.01 + 1e6) - (q * 0.01 + 1e6)), "tiles"),
    "nan_slope": (lambda s, h, q, k: s + (SLOPES[h] + 0.0 * jnp.inf) * (k - q), "tiles"),
}


@pytest.mark.parametrize("name", NOT_ALIBI)
def test_what_the_probe_alone_would_misread(name):
    """Each function runs as written; the check named refuses it (the proof on the probe's
    jaxpr, or the numeric check on other tiles, which the proof alone would have passed)."""
    fn, check = NOT_ALIBI[name]
    terms = ScoreTerms(function=fn)
    assert as_alibi(terms, H) is terms
    key = probe_params(None)
    assert is_alibi(terms.function, *key) == (check == "tiles")
    if check == "tiles":
        assert not agrees_on_tiles(terms.function, *key, H)


def test_the_tiles_check_passes_what_the_proof_proves():
    """Every ALiBi form of `CASES` passes the numeric check too (with stand-ins for params)."""
    for name, (fn, params, slopes) in CASES.items():
        if slopes is not None:
            terms = ScoreTerms(function=fn, params=params)
            assert agrees_on_tiles(terms.function, *probe_params(params), H), name


@pytest.mark.parametrize("name", CASES)
def test_what_the_jaxpr_proves(name):
    fn, params, slopes = CASES[name]
    terms = ScoreTerms(function=fn, params=params)
    out = as_alibi(terms, H)
    if slopes is None:
        assert out is terms
        return
    assert out.function is None and out.params is None and out.kinds == ("alibi",)
    np.testing.assert_allclose(out.slopes, slopes, rtol=1e-6)
    assert out.alibi_from == "<lambda>"


def test_slopes_join_those_the_terms_have():
    terms = ScoreTerms(slopes=jnp.ones(H), function=CASES["closure"][0])
    np.testing.assert_allclose(as_alibi(terms, H).slopes, 1.0 + SLOPES, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Calls: the function as written is the oracle.


def learned_alibi(score, head, q_pos, k_pos, params):
    return score + params["slopes"][head] * (k_pos - q_pos)


def _oracle(q, k, v, visible, slopes, cot):
    """Output and the gradients of ``sum(out * cot)`` in (q, k, v, slopes), float64, with the
    function `learned_alibi` applied to the oracle's logits."""
    lq, lk = q.shape[-2], k.shape[-2]
    head = np.arange(q.shape[1])[None, :, None, None]
    qi, ki = np.arange(lq)[:, None], np.arange(lk)[None, :]
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # noqa: E731

        def loss(q, k, v, slopes):
            out = jnp_attention_f64(q, k, v, visible, score=lambda s: learned_alibi(
                s, head, qi, ki, {"slopes": slopes}))
            return jnp.sum(out * f64(cot)), out

        grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
            f64(q), f64(k), f64(v), f64(slopes))
        return np.asarray(out), [np.asarray(g) for g in grads]


@pytest.mark.parametrize("kernel", [
    pytest.param(kernels.XlaBlockSparse(), marks=pytest.mark.slow), kernels.DenseReference()],
    ids=["xla", "reference"])
def test_learned_slopes_in_params_match_the_oracle(kernel):
    """Ragged lengths with more keys than queries, grouped heads and a mask that keeps keys on
    both sides of the query (so the sign of the distance matters), under `jax.jit`."""
    q, k, v = random_inputs(1, heads=H, kv_heads=2, q_len=21, kv_len=37)
    mask = masks.SlidingWindow(9)
    slopes = SLOPES * jnp.asarray([1.0, 2.0, -1.0, 3.0])
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, tiling=bsa.Tiling(8, 8),
                                    score=scores.ScoreFunction(learned_alibi, {"slopes": slopes}))
    plan = attn.plan(q, k, v)
    assert plan.inputs.score.kinds == ("alibi",)
    assert "alibi (slopes [4], from the function learned_alibi)" in plan.explain()
    cot = random_inputs(2, heads=H, q_len=21)[0]

    @eqx.filter_jit
    def loss(attn, q, k, v):
        out = attn(q, k, v)
        return jnp.sum(out * cot), out

    (grad_module, dq, dk, dv), out = _all_grads(loss, attn, q, k, v)
    vis = np_visibility(mask, batch=2, heads=H, q_len=21, kv_len=37)
    want_out, (want_dq, want_dk, want_dv, want_slopes) = _oracle(q, k, v, vis, slopes, cot)
    assert_close(out, want_out, 2e-5, "out")
    for got, want, what in ((dq, want_dq, "dq"), (dk, want_dk, "dk"), (dv, want_dv, "dv"),
                            (grad_module.score.params["slopes"], want_slopes, "dslopes")):
        assert_close(got, want, 5e-5, what)
    assert np.abs(want_slopes).min() > 0


def _all_grads(loss, attn, q, k, v):
    """``((d attn, dq, dk, dv), out)`` of `loss`."""
    (value, out), grads = eqx.filter_value_and_grad(
        lambda args: loss(*args), has_aux=True)((attn, q, k, v))
    del value
    return grads, out


def test_vmap_over_learned_slopes():
    """Each example's slopes give its own answer: the slopes are read per example, as any JAX
    code under `jax.vmap`."""
    q, k, v = random_inputs(3, batch=None, heads=H, q_len=16)
    mask = masks.Causal()
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernels.XlaBlockSparse(),
                                    tiling=bsa.Tiling(8, 8),
                                    score=scores.ScoreFunction(learned_alibi, {"slopes": SLOPES}))
    per_example = jnp.stack([SLOPES, -2.0 * SLOPES, 0.5 + SLOPES])
    got = jax.vmap(lambda s: eqx.tree_at(lambda a: a.score.params["slopes"], attn, s)(q, k, v))(
        per_example)
    for i, s in enumerate(per_example):
        builtin = eqx.tree_at(lambda a: a.score, attn, scores.ALiBi(s))
        assert_close(got[i], builtin(q, k, v), 1e-6, f"example {i}")


def test_a_gpu_plan_gives_a_closure_alibi_to_the_kernels_of_built_in_alibi():
    """Planned for a GPU from this machine: the closure's call is planned as built-in ALiBi,
    with no array read in the kernel."""
    q, k, v = random_inputs(4, heads=H, q_len=256, dim=64, dtype=jnp.bfloat16)
    closure = bsa.BlockSparseAttention(mask=masks.Causal(),
                                       score=scores.ScoreFunction(CASES["closure"][0]))
    builtin = eqx.tree_at(lambda a: a.score, closure, scores.ALiBi(SLOPES))
    got, want = (a.plan(q, k, v, platform="gpu") for a in (closure, builtin))
    assert got.kernel.name == want.kernel.name
    assert got.features.score == want.features.score == ("alibi",)
    assert got.features.score_function is None


@pytest.mark.parametrize("how", [  # a score under the ring: test_scores.py's quick tier
    "shard_map", pytest.param("ring", marks=pytest.mark.slow)])
def test_under_a_sharding_the_slopes_reach_each_shard(how):
    """On a one-device mesh (the 8-device shardings are tests/test_sharding.py's), ShardMap
    over batch and heads and RingAttention over the sequence pass the slopes read from the
    function to each shard's call: output and the gradients of q and of the params equal
    those of built-in learned ALiBi unsharded."""
    q, k, v = random_inputs(5, heads=H, kv_heads=2, q_len=24)
    if how == "shard_map":
        shard = bsa.sharding.ShardMap(jax.make_mesh((1, 1), ("b", "h")), "b", "h")
    else:
        shard = bsa.sharding.RingAttention(jax.make_mesh((1,), ("s",)), "s")
    cot = random_inputs(6, heads=H, q_len=24)[0]
    planned = bsa.BlockSparseAttention(
        mask=masks.Causal(), kernel=kernels.XlaBlockSparse(), tiling=bsa.Tiling(8, 8),
        sharding=shard, score=scores.ScoreFunction(learned_alibi, {"slopes": SLOPES}))
    assert planned.plan(q, k, v).inputs.score.kinds == ("alibi",)

    def run(score_of, sharding):
        def loss(q, slopes):
            attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.XlaBlockSparse(),
                                            tiling=bsa.Tiling(8, 8), sharding=sharding,
                                            score=score_of(slopes))
            return jnp.sum(attn(q, k, v) * cot)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(q, SLOPES)

    (got, (dq, dslopes)) = run(lambda s: scores.ScoreFunction(learned_alibi, {"slopes": s}),
                               shard)
    (want, (want_dq, want_dslopes)) = run(lambda s: scores.ALiBi(s, learned=True),
                                          bsa.Unsharded())
    assert_close(got, want, 1e-5, "loss")
    assert_close(dq, want_dq, 1e-5, "dq")
    assert_close(dslopes, want_dslopes, 1e-5, "dslopes")
    assert np.abs(want_dslopes).min() > 0
