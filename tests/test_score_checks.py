"""The checks a call makes of user score functions and predicates: the batch index of an
unbatched call (as under `jax.vmap`), a score function that ignores the score or returns no
float, and a `Predicate` that `jax.jit` cannot hash or whose result is not one entry per pair.
Every call that runs is checked against the float64 oracles of tests/conftest.py."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
from tests.conftest import (
    assert_close,
    jnp_attention_f64,
    np_attention,
    np_visibility,
    random_array,
    random_inputs,
)

B, H, L, D = 2, 2, 24, 8
MASK = masks.Causal() & masks.SlidingWindow(12, 0)
TILES = bsa.Tiling(block_q=8, block_kv=8)
KERNELS = [pytest.param(kernels.XlaBlockSparse(), id="xla"),
           pytest.param(kernels.DenseReference(), id="reference")]
TEMPS = jnp.array([0.1, 5.0])


def _inputs(seed=0):
    return random_inputs(seed, batch=B, heads=H, q_len=L, dim=D)


def _attn(score=None, kernel=None, mask=MASK):
    return bsa.BlockSparseAttention(mask=mask, kernel=kernel or kernels.XlaBlockSparse(),
                                    tiling=TILES, score=score)


def _f64_out(q, k, v, visible, score):
    """The float64 jnp oracle's output (float32) with the score function `score` of the
    logits [B, H, L, L]."""
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # noqa: E731
        return np.asarray(jnp_attention_f64(f64(q), f64(k), f64(v), visible, score=score))


# ---------------------------------------------------------------------------------------------
# The batch index: a batched call reads it, an unbatched one (each example under vmap) has none.


def per_example_temperature(score, head, q_pos, k_pos, temps, batch):
    return score * temps[batch]


def flex_by_batch(score, b, h, q_idx, kv_idx):
    return score * (1.0 + b)


def flex_by_head(score, b, h, q_idx, kv_idx):
    return score - 0.1 * (h + 1) * jnp.abs(q_idx - kv_idx)


@pytest.mark.parametrize("kernel", [
    KERNELS[0], pytest.param(*KERNELS[1].values, id="reference", marks=pytest.mark.slow)])
def test_a_batched_call_reads_each_examples_temperature(kernel):
    """``score * temps[batch]`` with temps [0.1, 5.0]: example ``b``'s logits scaled by its
    own temperature (a float64 NumPy attention with ``scale = temps[b] / sqrt(D)``); and the
    vmapped form that indexes the temperature outside the call gives the same."""
    q, k, v = _inputs(1)
    attn = _attn(scores.ScoreFunction(per_example_temperature, TEMPS), kernel)
    got = attn(q, k, v)
    vis = np_visibility(MASK, batch=1, heads=H, q_len=L, kv_len=L)
    for b in range(B):
        want = np_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], vis,
                            scale=float(TEMPS[b]) / math.sqrt(D))
        assert_close(got[b:b + 1], want, 2e-5, f"example {b}")

    def temperature(score, head, q_pos, k_pos, t):
        return score * t

    one = _attn(scores.ScoreFunction(temperature, jnp.float32(1.0)), kernel)
    mapped = jax.vmap(lambda t, q, k, v: eqx.tree_at(lambda a: a.score.params, one, t)(q, k, v))
    assert_close(mapped(TEMPS, q, k, v), got, 2e-5, "vmap over the temperatures")


BATCH_REFUSED = (r"^the score function {} reads the batch index, which an unbatched call "
                 r"\(\[H, L, D\]\) does not have \(under jax\.vmap every example would see 0\): "
                 r"pass batched inputs \[B, H, L, D\], or index the per-example data outside "
                 r"the call \(as `params`\) and let vmap map it\.(\n|$)")  # JAX may add a line


@pytest.mark.parametrize("make,name", [
    (lambda: scores.ScoreFunction(per_example_temperature, TEMPS), "per_example_temperature"),
    (lambda: scores.from_flex(flex_by_batch), "flex_by_batch"),
], ids=["score_function", "from_flex"])
@pytest.mark.parametrize("how", ["call", "vmap", "plan", "layer", "vmap_layer"])
def test_an_unbatched_call_that_reads_the_batch_index_is_refused(make, name, how):
    """Before, every example under `jax.vmap` read batch index 0 (2.6 off here)."""
    q, k, v = _inputs(2)
    attn = _attn(make())
    layer = bsa.MultiheadBlockSparseAttention(H, 16, mask=MASK, score=make(),
                                              key=jax.random.key(0))
    x = random_array(5, (B, L, 16))
    run = {"call": lambda: attn(q[0], k[0], v[0]),
           "vmap": lambda: jax.vmap(attn)(q, k, v),
           "plan": lambda: attn.plan(q[0], k[0], v[0]),
           "layer": lambda: layer(x[0], x[0], x[0]),
           "vmap_layer": lambda: jax.vmap(layer)(x, x, x)}[how]
    with pytest.raises(ValueError, match=BATCH_REFUSED.format(name)):
        run()


def test_a_per_example_attention_mask_with_a_batch_reading_score_is_refused():
    """A per-example `attention_mask` runs each example as a call of its own, where the batch
    index reads 0: refused, naming the mask's way out; one mask for the batch still runs and
    reads each example's temperature."""
    q, k, v = _inputs(3)
    score = scores.ScoreFunction(per_example_temperature, TEMPS)
    keep = np.asarray(random_array(6, (B, 1, L, L))) > -0.5
    with pytest.raises(ValueError, match=r"^`score` reads the batch index, which a per-example "
                                         r"`attention_mask` \(its first axis 2\)") as info:
        bsa.blocksparse_attention(q, k, v, attention_mask=keep, score=score, causal=False)
    assert "\n" not in str(info.value)
    got = bsa.blocksparse_attention(q, k, v, attention_mask=keep[:1], score=score,
                                    causal=False, platform="xla")
    for b in range(B):
        want = np_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                            np.broadcast_to(keep[:1], (1, H, L, L)),
                            scale=float(TEMPS[b]) / math.sqrt(D))
        assert_close(got[b:b + 1], want, 2e-5, f"example {b}")


def test_a_flex_score_that_does_not_read_b_runs_unbatched_and_under_vmap():
    """A `score_mod` that reads `h` but not `b` needs no batch index: the unbatched call and
    the vmapped one equal the batched one, which equals the oracle."""
    q, k, v = _inputs(3)
    attn = _attn(scores.from_flex(flex_by_head))
    assert not attn.score.term.takes_batch
    head = np.arange(H)[None, :, None, None]
    qi, ki = np.arange(L)[:, None], np.arange(L)[None, :]
    vis = np_visibility(MASK, batch=B, heads=H, q_len=L, kv_len=L)
    want = _f64_out(q, k, v, vis, lambda s: flex_by_head(s, 0, head, qi, ki))
    got = attn(q, k, v)
    assert_close(got, want, 2e-5, "batched")
    assert_close(attn(q[1], k[1], v[1]), want[1], 2e-5, "unbatched")
    assert_close(jax.vmap(attn)(q, k, v), want, 2e-5, "vmap")


# ---------------------------------------------------------------------------------------------
# A score function must use the score and return floats.


def slopes_only(score, head, q_pos, k_pos, slopes):
    return slopes[head] * (k_pos - q_pos)


def times_zero(score, head, q_pos, k_pos):
    return score * 0.0 + 0.1 * (k_pos - q_pos)


def times_zeros_like(score, head, q_pos, k_pos, slopes):
    return score * jnp.zeros_like(score) + slopes[head] * (k_pos - q_pos)


@jax.jit
def _zeros_plus(s, term):
    return jnp.zeros_like(s) + term


def jit_drops_score(score, head, q_pos, k_pos, slopes):
    return _zeros_plus(score, slopes[head] * (k_pos - q_pos))


def flex_distance(score, b, h, q_idx, kv_idx):
    return -0.1 * (h + 1) * jnp.abs(q_idx - kv_idx)


SLOPES = jnp.array([0.5, -0.25])
IGNORES = r"^the score function {} ignores `score` \(its result would replace the logits\): " \
          r"return `score \+ term`\.(\n|$)"


@pytest.mark.parametrize("make,name,traced", [
    (lambda: scores.ScoreFunction(slopes_only, SLOPES), "slopes_only", False),
    (lambda: scores.ScoreFunction(slopes_only, SLOPES), "slopes_only", True),
    (lambda: scores.ScoreFunction(jit_drops_score, SLOPES), "jit_drops_score", True),
    (lambda: scores.ScoreFunction(times_zero), "times_zero", False),
    (lambda: scores.ScoreFunction(times_zeros_like, SLOPES), "times_zeros_like", True),
    (lambda: scores.from_flex(flex_distance), "flex_distance", False),
], ids=["params", "params_traced", "inner_jit_traced", "times_zero", "times_zeros_like_traced",
        "from_flex"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_score_function_that_ignores_the_score_is_refused(make, name, traced, kernel):
    """Before, each ran, attention computed from the term alone. The function's jaxpr is read
    (into the jits it calls; a product with a zero reaches nothing), so traced `params` under
    `jax.jit` are checked too."""
    q, k, v = _inputs(4)
    attn = _attn(make(), kernel)
    with pytest.raises(ValueError, match=IGNORES.format(name)):
        if traced:
            jax.jit(lambda p: eqx.tree_at(lambda a: a.score.params, attn, p)(q, k, v))(SLOPES)
        else:
            attn(q, k, v)
    if not traced:  # and inside a trace
        with pytest.raises(ValueError, match=IGNORES.format(name)):
            eqx.filter_jit(attn)(q, k, v)


def as_bool(score, head, q_pos, k_pos):
    return score > 0


def as_int(score, head, q_pos, k_pos):
    return score.astype(jnp.int32) + q_pos


def as_complex(score, head, q_pos, k_pos):
    return score + 1j * k_pos


def flex_as_int(score, b, h, q_idx, kv_idx):
    return (score > 0) + q_idx


@pytest.mark.parametrize("make,name,dtype", [
    (lambda: scores.ScoreFunction(as_bool), "as_bool", "bool"),
    (lambda: scores.ScoreFunction(as_int), "as_int", "int32"),
    (lambda: scores.ScoreFunction(as_complex), "as_complex", "complex64"),
    (lambda: scores.from_flex(flex_as_int), "flex_as_int", "int32"),
], ids=["bool", "int", "complex", "from_flex"])
def test_a_score_function_of_no_float_result_is_refused(make, name, dtype):
    """Before, the result was cast to the logits' dtype in silence."""
    q, k, v = _inputs(5)
    with pytest.raises(TypeError, match=rf"^the score function {name} returns {dtype}, not "
                                        r"float logits: return `score \+ term` with a float "
                                        r"term\.(\n|$)"):
        _attn(make())(q, k, v)


_add = jax.jit(lambda a, b: a + b)


def relu_then_distance(score, head, q_pos, k_pos):
    return jax.nn.relu(score) - 0.1 * jnp.abs(q_pos - k_pos)   # relu is a custom_jvp


def through_jit(score, head, q_pos, k_pos, slopes):
    return _add(score, slopes[head] * (k_pos - q_pos))


def hides_far_keys(score, head, q_pos, k_pos):
    return jnp.where(q_pos - k_pos > 9, -jnp.inf, score)


@pytest.mark.parametrize("fn,params", [(relu_then_distance, None), (through_jit, SLOPES),
                                       (hides_far_keys, None)],
                         ids=["custom_jvp", "inner_jit", "where"])
@pytest.mark.parametrize("traced", [pytest.param(False, id="eager", marks=pytest.mark.slow),
                                    pytest.param(True, id="jit")])
def test_score_functions_that_use_the_score_run(fn, params, traced):
    """The checks refuse none of these (the score reaches the result through a custom_jvp,
    an inner jit, a where), eager or with traced params, and the results match the oracle."""
    q, k, v = _inputs(6)
    attn = _attn(scores.ScoreFunction(fn, params))
    if traced and params is not None:
        got = jax.jit(lambda p: eqx.tree_at(lambda a: a.score.params, attn, p)(q, k, v))(params)
    elif traced:
        got = eqx.filter_jit(attn)(q, k, v)
    else:
        got = attn(q, k, v)
    head = np.arange(H)[None, :, None, None]
    qi, ki = np.arange(L)[:, None], np.arange(L)[None, :]
    vis = np_visibility(MASK, batch=B, heads=H, q_len=L, kv_len=L)
    extra = () if params is None else (np.asarray(params, np.float64),)
    want = _f64_out(q, k, v, vis, lambda s: fn(s, head, qi, ki, *map(jnp.asarray, extra)))
    assert_close(got, want, 2e-5, fn.__name__)


# ---------------------------------------------------------------------------------------------
# Predicates: `jax.jit` of a module holding params, and one entry per pair.


def window_from_params(q, k, w):
    return (k <= q) & (q - k <= w[0])


def test_jax_jit_of_a_predicate_with_params_says_what_to_use():
    """Before: JAX's bare 'unhashable type: ArrayImpl'. The forms it names work."""
    q, k, v = _inputs(7)
    attn = _attn(mask=masks.Predicate(window_from_params, jnp.array([5])))
    with pytest.raises(TypeError, match=r"^a module holding a Predicate with `params` cannot be "
                                        r"hashed, so `jax\.jit\(attn\)` cannot take it: use "
                                        r"`eqx\.filter_jit\(attn\)`, or "):
        jax.jit(attn)(q, k, v)
    qi, ki = np.arange(L)[:, None], np.arange(L)[None, :]
    want = np_attention(q, k, v, ((ki <= qi) & (qi - ki <= 5))[None, None])
    assert_close(eqx.filter_jit(attn)(q, k, v), want, 2e-5, "filter_jit(attn)")
    assert_close(eqx.filter_jit(lambda a, q: a(q, k, v))(attn, q), want, 2e-5, "as argument")


def first_rows(q, k):
    return k[0] <= q[0]          # one row of keys, read against the wrong axis


def all_causal(q, k):
    return jnp.all(k <= q + 100)  # a scalar that reduced the positions


# Layouts evaluate a predicate one q-block (8 rows here) against every key: (8, 24).
@pytest.mark.parametrize("fn,got", [(first_rows, r"\(24,\)"), (all_causal, r"\(\)")])
def test_a_predicate_that_is_not_one_entry_per_pair_is_refused(fn, got):
    """Before, the result was broadcast in silence."""
    q, k, v = _inputs(8)
    with pytest.raises(ValueError, match=rf"^the Predicate function {fn.__name__} must return "
                                         rf"the broadcast shape of its positions, \(8, 24\); "
                                         rf"got {got} \(a reduction or an index over them\?\): "
                                         r"keep one entry per \(query, key\) pair\.(\n|$)"):
        _attn(mask=masks.Predicate(fn))(q, k, v)


def keys_only(q, k):
    return k % 3 != 1            # [..., 1, m]: the same for every query


def first_head(q, k, head):
    return head == 0             # a scalar of the head alone


def test_predicates_of_one_side_or_of_the_head_broadcast():
    """Results that stand for every pair by broadcasting run, and match the oracle."""
    q, k, v = _inputs(9)
    qi, ki = np.arange(L)[:, None], np.arange(L)[None, :]
    causal = np.broadcast_to(ki <= qi, (H, L, L))
    attn = _attn(mask=masks.Causal() & masks.Predicate(keys_only))
    assert_close(attn(q, k, v), np_attention(q, k, v, (causal & (ki % 3 != 1))[None]),
                 2e-5, "keys_only")
    attn = _attn(mask=masks.Causal() & masks.Predicate(first_head))
    per_head = causal & (np.arange(H) == 0)[:, None, None]
    assert_close(attn(q, k, v), np_attention(q, k, v, per_head[None]), 2e-5, "first_head")
