"""Bad input -> the library's own one-line error: exception type and message, per entry point.

Each row of `CASES` is (id, call, exception type, substring of the message). The checks run
before jaxtyping/beartype, so the message is the library's, whether or not type checking is on.
"""

import os
import subprocess
import sys
import warnings
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn.contract import MaskReads
from eqx_bsattn import masks
from eqx_bsattn.strategies.kernels.reference import reference_attention
from tests.conftest import assert_close, np_attention, random_array

B, H, HKV, L, D = 2, 4, 2, 16, 8
Q = random_array(0, (B, H, L, D))
K = random_array(1, (B, HKV, L, D))
V = random_array(2, (B, HKV, L, D))
IDS = jnp.zeros((B, L), jnp.int32)
ATTN = bsa.BlockSparseAttention(mask=masks.Causal())


class _PowersOfTwo(bsa.AbstractKernel):
    """A test kernel that, like Triton, launches only power-of-two tiles of at least 16."""

    name: ClassVar[str] = "test-pow2"
    platforms: ClassVar[tuple[str, ...]] = ("cpu",)
    reads: ClassVar[MaskReads] = "dense"

    @classmethod
    def priority(cls, platform):
        return None

    def decline_reason(self, mask, features):
        return None

    def adapt_tiling(self, tiling, features):
        for field in ("block_q", "block_kv"):
            value = getattr(tiling, field)
            if value < 16 or value & (value - 1):
                raise ValueError(f"test-pow2 needs Tiling.{field} to be a power of two >= 16; "
                                 f"got {value}.")
        return tiling

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        return reference_attention(query, key, value, mask=mask, inputs=inputs,
                                   softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap)


def _fn(**kw):
    return lambda: bsa.blocksparse_attention(Q, K, V, **kw)


def _call(*args, **kw):
    return lambda: ATTN(*args, **kw)


def _swapped(where, value, **kw):
    """`ATTN` (or `kw`'s module) with a field swapped by `eqx.tree_at`, called."""
    attn = bsa.BlockSparseAttention(**kw) if kw else ATTN
    return lambda: eqx.tree_at(where, attn, value, is_leaf=lambda x: x is None)(Q, K, V)


def _window(q, k, width):
    return (k <= q) & (q - k < width)


def _layout(**kw):
    args = dict(mask=masks.Causal(), q_len=L, kv_len=L, num_heads=1, block_q=8, block_kv=8)
    return lambda: bsa.build_layout(**{**args, **kw})


CASES = [
    # BlockSparseAttention.__call__ (and .plan): q, k, v.
    ("rank", _call(Q[0, 0], K, V), ValueError,
     "`query`, `key`, `value` must all be [batch, heads, len, dim] or all [heads, len, dim]"),
    ("head dim", _call(Q, K[..., :4], V), ValueError,
     "`query` and `key` must have the same head dim; got 8 and 4."),
    ("kv length", _call(Q, K, V[:, :, :12]), ValueError,
     "`key` and `value` must have the same length; got 16 and 12."),
    ("int query", _call(Q.astype(jnp.int32), K, V), TypeError,
     "`query` must be a floating-point array (bfloat16, float16, float32 or float64); got dtype int32."),
    ("mixed dtypes", _call(Q, K.astype(jnp.float16), V), TypeError,
     "`query`, `key`, `value` must share one dtype; got float32, float16, float32."),
    ("batch", _call(Q, K[:1], V[:1]), ValueError, "must share the batch size; got 2, 1, 1."),
    ("gqa heads", _call(Q[:, :3], K, V), ValueError,
     "query heads (3) must be a multiple of key/value heads (2)"),
    ("kv heads", _call(Q, K, V[:, :1]), ValueError, "`key` has 2 heads but `value` has 1."),
    ("not an array", _call("q", K, V), TypeError, "`query` must be an array (JAX or NumPy); got str."),
    # Per-call data.
    ("segment length", _call(Q, K, V, q_segment_ids=IDS[:, :15], kv_segment_ids=IDS), ValueError,
     "`q_segment_ids` must have shape [16] or [2, 16]; got (2, 15)."),
    ("float segments", _call(Q, K, V, q_segment_ids=IDS * 1.0, kv_segment_ids=IDS), TypeError,
     "`q_segment_ids` must hold integers; got dtype float32 (any integer dtype is accepted"),
    ("one side segments", _call(Q, K, V, q_segment_ids=IDS), ValueError,
     "pass both `q_segment_ids` and `kv_segment_ids`, or neither; got only `q_segment_ids`."),
    ("positions length", _call(Q, K, V, kv_positions=np.arange(9)), ValueError,
     "`kv_positions` must have shape [16] or [2, 16]; got (9,)."),
    ("bias shape", _call(Q, K, V, bias=np.zeros((3, L, L), np.float32)), ValueError,
     "`bias` must broadcast to [2, 4, 16, 16]; got shape (3, 16, 16)."),
    ("bias 1-D of the wrong length", _call(Q, K, V, bias=np.zeros(9, np.float32)), ValueError,
     "`bias` must broadcast to [2, 4, 16, 16]; got shape (9,)."),
    ("int bias", _call(Q, K, V, bias=np.zeros((L, L), np.int32)), TypeError,
     "`bias` must be a floating array; got dtype int32."),
    ("sinks shape", _call(Q, K, V, sinks=np.zeros((3, 2), np.float32)), ValueError,
     "`sinks` must have shape [num_sinks] (shared by all heads), [4] (one per head), [2] (one "
     "per kv head), [4, num_sinks] or [2, num_sinks]; got (3, 2)."),
    ("softmax_aux shape", lambda: bsa.blocksparse_attention(Q, K, V, np.zeros((3, 2), np.float32)),
     ValueError,
     "`softmax_aux` (sinks) must have shape [num_sinks]"),
    # Platforms.
    ("plan platform", lambda: ATTN.plan(Q, K, V, platform="cuda"), ValueError,
     "`platform` must be one of 'cpu', 'gpu', 'tpu'"),
    ("select platform", lambda: bsa.select_kernel(masks.Causal(), platform="foo"), ValueError,
     "`platform` must be one of 'cpu', 'gpu', 'tpu'"),
    ("select mask", lambda: bsa.select_kernel("causal"), TypeError,
     "`mask` must be an AbstractMask; got str."),
    ("select features", lambda: bsa.select_kernel(masks.Causal(), features={"q_len": 8}),
     TypeError, "`features` must be a Features or None; got dict."),
    ("select candidates", lambda: bsa.select_kernel(masks.Causal(), candidates=["xla"]),
     TypeError, "`candidates` must hold AbstractKernel instances; got str."),
    ("function platform", _fn(platform="foo"), ValueError,
     "`platform` must be one of 'cpu', 'gpu', 'tpu', 'auto', 'cuda', "),
    ("absent platform", _fn(platform="tpu"), ValueError,
     "`platform='tpu'`: JAX finds no tpu device here (available: "),
    # Tilings.
    ("tiling for kernel",
     lambda: bsa.BlockSparseAttention(kernel=_PowersOfTwo(), tiling=bsa.Tiling(7, 13))(Q, K, V),
     ValueError, "the module tiling cannot run on kernel test-pow2: test-pow2 needs "
     "Tiling.block_q to be a power of two >= 16; got 7."),
    ("tiling zero", lambda: bsa.Tiling(0, 8), ValueError,
     "`Tiling.block_q` must be a positive int or None; got 0."),
    ("tiling float", lambda: bsa.Tiling(64, 8.5), ValueError,
     "`Tiling.block_kv` must be a positive int or None; got 8.5."),
    ("tiling warps", lambda: bsa.Tiling(64, 64, num_warps=-1), ValueError,
     "`Tiling.num_warps` must be a positive int or None; got -1."),
    # build_layout.
    ("layout mask", _layout(mask="causal"), TypeError, "`mask` must be an AbstractMask; got str."),
    ("layout length", _layout(q_len=0), ValueError, "`q_len` must be a positive int; got `q_len`=0."),
    ("layout block", _layout(block_kv=-8), ValueError,
     "block sizes must be positive ints; got `block_kv`=-8."),
    ("layout segments", _layout(mask=masks.Document(), q_segment_ids=np.zeros(L),
                                kv_segment_ids=np.zeros(L, int)), TypeError,
     "`q_segment_ids` must hold integers; got dtype float"),
    ("layout positions", _layout(q_positions=np.arange(L + 1)), ValueError,
     "`q_positions` must have shape [16] or [batch, 16]; got (17,)."),
    # autotune.
    ("autotune attn", lambda: bsa.autotune("attn", Q, K, V), TypeError,
     "`attn` must be a BlockSparseAttention; got str."),
    ("autotune candidates", lambda: bsa.autotune(ATTN, Q, K, V, candidates=[(8, 8)]), TypeError,
     "`candidates` must hold configs (AbstractKernelConfig instances, e.g. "
     "kernels.TritonConfig, Tiling); got tuple."),
    ("autotune reps", lambda: bsa.autotune(ATTN, Q, K, V, reps=0), ValueError,
     "`reps` must be an int >= 1; got 0."),
    # blocksparse_attention's own arguments.
    ("mask_builder form", _fn(mask_builder=lambda a, b: masks.Causal()), TypeError,
     "`mask_builder` must be a mask, a zero-argument callable returning one, or a callable "
     "`(q_len, kv_len, num_heads, head_idx, num_reps) -> mask`"),
    ("mask_builder result", _fn(mask_builder=lambda: "causal"), TypeError,
     "`mask_builder()` must return a mask (an AbstractMask such as masks.Causal()); it returned str."),
    ("cfg seed key", _fn(cfg={"q_blocksize": 64}), ValueError,
     "`cfg` has a key Tiling does not take: 'q_blocksize'; ejKernel's 'q_blocksize' is Tiling's 'block_q'."),
    ("cfg seed params", _fn(cfg={"fwd_params": {"q_block": 64}}), ValueError,
     "`cfg.fwd_params` has no field 'q_block'; accepted: ['q_blocksize', 'kv_blocksize', "),
    ("cfg type", _fn(cfg=(8, 8)), TypeError,
     "`cfg` must be a Tiling (or a kernel's config, e.g. kernels.TritonConfig), a dict of "
     "Tiling fields"),
    ("cfg warps", _fn(cfg={"block_q": 8, "block_kv": 8, "num_warps": 0}), ValueError,
     "`cfg.num_warps` must be a positive int or None; got 0."),
    ("layout name", _fn(qkv_layouts="bsdh"), ValueError,
     "`qkv_layouts` must be 'bhsd' ([batch, heads, seq, head_dim], the default) or 'bshd'"),
    ("attention_mask dtype", _fn(attention_mask=np.ones((L, L), np.float32)), TypeError,
     "`attention_mask` must hold booleans (or integers, nonzero = attend); got dtype float32."),
    ("attention_mask shape", _fn(attention_mask=np.ones((B, 3, L, L), bool)), ValueError,
     "`attention_mask` must have shape [2 or 1, 4 or 1, 16 or 1, 16], [2 or 1, 16, 16], "
     "[2, 16] (key padding) or [16, 16]; got (2, 3, 16, 16)."),
    ("attention_mask 2-D shape", _fn(attention_mask=np.ones((B, 192), bool)), ValueError,
     "[2, 16] (key padding) or [16, 16]; got (2, 192)."),
    ("attention_mask ambiguous", lambda: bsa.blocksparse_attention(
        Q[:, :, :2], K, V, attention_mask=np.ones((B, L), bool)), ValueError,
     "`attention_mask` of shape (2, 16) is ambiguous: it is both [batch, kv_len] (key padding"),
    ("softmax_aux kv heads 2-D",
     lambda: bsa.blocksparse_attention(Q, K, V, np.zeros((3, 2), np.float32)), ValueError,
     "[4, num_sinks] or [2, num_sinks]; got (3, 2)."),
    ("mask_info twice", _fn(q_segment_ids=IDS, mask_info=bsa.MaskInfo(q_segment_ids=IDS)),
     ValueError, "`q_segment_ids` is given both directly and in `mask_info`; give it once."),
    ("mask_info type", _fn(mask_info={"q_segment_ids": IDS}), TypeError,
     "`mask_info` must be a MaskInfo or None; got dict."),
    ("kv segments default",
     lambda: bsa.blocksparse_attention(Q, K[:, :, :12], V[:, :, :12], q_segment_ids=IDS),
     ValueError, "`kv_segment_ids` defaults to `q_segment_ids` only when q_len == kv_len; "
     "got q_len=16, kv_len=12: pass `kv_segment_ids`."),
    # Masks.
    ("array mask shape",
     lambda: bsa.BlockSparseAttention(mask=masks.ArrayMask(np.ones((3, L, L), bool)))(Q, K, V),
     ValueError, "ArrayMask has shape (3, 16, 16); this call needs [1 or 4, 16, 16]"),
    ("array mask dtype", lambda: masks.ArrayMask(np.ones((L, L), np.float32)), TypeError,
     "`mask` must hold booleans (or integers, nonzero = visible); got dtype float32."),
    # Fields swapped with eqx.tree_at (no `__init__` runs): checked at the call.
    ("swapped mask array", _swapped(lambda a: a.mask, jnp.ones((L, L), bool)), TypeError,
     "`mask` must be an AbstractMask (e.g. masks.Full(), masks.Causal()); got an array of "
     "shape (16, 16): an element mask is masks.ArrayMask(array)."),
    ("swapped mask None", _swapped(lambda a: a.mask, None), TypeError,
     "`mask` must be an AbstractMask (e.g. masks.Full(), masks.Causal()); got None."),
    ("swapped kernel str", _swapped(lambda a: a.kernel, "xla"), TypeError,
     "`kernel` must be an AbstractKernel (e.g. kernels.XlaBlockSparse()), AutoKernel() or "
     "None; got str 'xla'."),
    ("swapped alibi slopes", _swapped(lambda a: a.score.slopes, jnp.arange(H),
                                      score=bsa.scores.ALiBi(bsa.scores.alibi_slopes(H),
                                                             learned=True)),
     TypeError, "`slopes` of ALiBi must be a float array [h]; got dtype int32 (swapped in "
     "with eqx.tree_at?)."),
    ("swapped predicate params",
     _swapped(lambda a: a.mask.params, jnp.float32(4.0),
              mask=masks.Predicate(_window, jnp.int32(4))),
     TypeError, "`params` of the Predicate _window must be an integer array, as it was given; "
     "got dtype float32 (swapped in with eqx.tree_at?): swap in integer arrays."),
]


@pytest.mark.parametrize("call, error, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_its_message(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error  # the library's own, not jaxtyping's
    text = str(info.value)
    assert message in text, text
    assert "\n" not in text, text  # one line says it all


def test_plan_checks_like_the_call():
    with pytest.raises(ValueError, match="same head dim"):
        ATTN.plan(Q, K[..., :4], V)
    with pytest.raises(ValueError, match="`sinks` must have shape"):
        ATTN.plan(Q, K, V, sinks=np.zeros((3, 2), np.float32))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="needs a machine without a GPU")
def test_gpu_requested_on_a_cpu_machine():
    with pytest.raises(ValueError, match=r"`platform='gpu'`: JAX finds no gpu device here \(available: 'cpu'\)"):
        bsa.blocksparse_attention(Q, K, V, platform="gpu")


def test_select_kernel_says_what_it_assumed():
    text = bsa.select_kernel(masks.Causal(), platform="cpu").explain()
    assert "no `features` given: assumed a float32 call" in text
    given = bsa.select_kernel(masks.Causal(), platform="cpu",
                              features=bsa.Features(platform="cpu", dtype="bfloat16"))
    assert "assumed" not in given.explain()


@pytest.mark.slow
def test_numpy_and_python_scalars_are_accepted():
    want = ATTN(Q, K, V)
    q, k, v = (np.asarray(x) for x in (Q, K, V))
    assert_close(ATTN(q, k, v), want, 1e-6)
    assert_close(bsa.blocksparse_attention(q, k, v, softmax_scale=np.float32(D ** -0.5)),
                 want, 1e-6)
    plan = ATTN.plan(q, k, v, q_segment_ids=np.zeros(L, np.int64),
                     kv_segment_ids=np.zeros((B, L), np.int16))
    assert plan.inputs.q_segment_ids.shape == (B, L)
    assert bsa.Tiling(np.int64(32), np.int32(16)) == bsa.Tiling(32, 16)
    attn = bsa.BlockSparseAttention(softmax_scale=np.float32(0.5), logits_soft_cap=np.int64(30))
    assert attn == bsa.BlockSparseAttention(softmax_scale=0.5, logits_soft_cap=30)
    layout = bsa.build_layout(masks.Document(), q_len=L, kv_len=L, num_heads=1, block_q=8,
                              block_kv=8, q_segment_ids=np.zeros(L, int),
                              kv_segment_ids=np.zeros(L, int))
    assert float(layout.density()) == 1.0


@pytest.mark.slow
def test_checks_run_with_type_checking_off():
    # The same messages with jaxtyping/beartype switched off (they are the library's own).
    script = (
        "import jax.numpy as jnp, eqx_bsattn as bsa\n"
        "assert not bsa.TYPECHECK_ENABLED\n"
        "q = jnp.ones((1, 2, 8, 4)); k = jnp.ones((1, 2, 8, 2))\n"
        "for call in (lambda: bsa.BlockSparseAttention()(q, k, k),\n"
        "             lambda: bsa.blocksparse_attention(q, k, k)):\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as e:\n"
        "        print(e)\n"
    )
    env = {**os.environ, "EQX_BSATTN_TYPECHECK": "0", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["`query` and `key` must have the same head dim; got 4 and 2."] * 2


def test_jax_jit_of_a_module_holding_an_array_mask_says_what_to_use():
    """`jax.jit(attn)` hashes the module; with an `ArrayMask` it failed with JAX's bare
    'unhashable type'. Now the error names the forms that work, and they do."""
    import equinox as eqx

    q = random_array(3, (1, 2, L, 4))
    keep = masks.ArrayMask(np.tril(np.ones((L, L), bool)))
    attn = bsa.BlockSparseAttention(mask=masks.SlidingWindow(4) & keep)
    with pytest.raises(TypeError, match=r"ArrayMask cannot be hashed.*eqx\.filter_jit\(attn\)"):
        jax.jit(attn)(q, q, q)
    want = attn(q, q, q)
    assert_close(eqx.filter_jit(attn)(q, q, q), want)
    assert_close(eqx.filter_jit(lambda a, q: a(q, q, q))(attn, q), want)


@pytest.mark.parametrize("length", [256, 512])
def test_predicate_closing_over_a_traced_value_is_refused_at_every_length(length):
    """A Predicate whose function closes over an argument of `jax.jit`: refused in one line
    at every length (it ran at 256, where the dense kernel evaluates it in the trace, and
    failed at 512, where a block layout is built from it on the host); passed as `params`,
    it runs at both."""
    q = random_array(5, (1, 1, length, 4))

    def closing(q, width):
        attn = bsa.BlockSparseAttention(mask=masks.Predicate(lambda qp, kp: _window(qp, kp, width)))
        return attn(q, q, q)

    with pytest.raises(TypeError) as info:
        jax.jit(closing)(q, 8)
    text = str(info.value)
    assert "\n" not in text, text
    assert text.startswith("the mask's function closes over a traced array (the Predicate "
                           "<lambda> reads an argument of a function under jit"), text
    assert "pass the array as `params`, masks.Predicate(fn, params)" in text, text

    def passing(q, width):
        return bsa.BlockSparseAttention(mask=masks.Predicate(_window, width))(q, q, q)

    index = np.arange(length)
    visible = np.asarray(_window(index[:, None], index[None, :], 8))
    assert_close(jax.jit(passing)(q, 8), np_attention(q, q, q, visible))


def test_traced_nan_bias_is_refused_naming_bias():
    """A NaN in a traced bias is found as the call runs (`eqx.error_if`): the error names
    `bias` and what it accepts."""
    bias = jnp.zeros((L, L)).at[3, 2].set(jnp.nan)
    with pytest.raises(Exception) as info:
        jax.block_until_ready(jax.jit(lambda b: ATTN(Q, K, V, bias=b))(bias))
    assert ("`bias` must be finite or -inf (which hides a pair); got +inf or NaN."
            in str(info.value)), str(info.value)
    # A concrete one is refused before anything runs, in that one line.
    with pytest.raises(ValueError) as info:
        ATTN(Q, K, V, bias=np.asarray(bias))
    assert str(info.value) == ("`bias` must be finite or -inf (which hides a pair); got +inf "
                               "or NaN."), str(info.value)


def test_a_bias_of_fewer_than_two_dimensions_broadcasts_as_numpy_does():
    """A 1-D bias is one value per key and a scalar one value for every pair, as NumPy (and
    jax.nn) broadcast them: the same answer as the 2-D bias they stand for."""
    per_key = np.linspace(-1.0, 1.0, L).astype(np.float32)
    np.testing.assert_allclose(ATTN(Q, K, V, bias=per_key), ATTN(Q, K, V, bias=per_key[None]),
                               rtol=0, atol=0)
    np.testing.assert_allclose(ATTN(Q, K, V, bias=np.float32(0.5)),
                               ATTN(Q, K, V, bias=np.full((1, 1), 0.5, np.float32)),
                               rtol=0, atol=0)


def test_a_predicate_from_a_new_function_every_call_warns_once():
    """A Predicate built from a fresh lambda each step traces and compiles every step: after
    a few such calls one warning names the function and the way out; a function defined
    once never warns."""
    from eqx_bsattn.strategies.masks import custom

    q = jnp.ones((1, 2, 16, 8))
    step = jax.jit(lambda attn, q: attn(q, q, q), static_argnums=0)

    def fresh(width):
        return bsa.BlockSparseAttention(mask=masks.Predicate(lambda i, j: abs(i - j) < width))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for width in range(custom.NEW_FUNCTIONS_BEFORE_WARNING + 3):
            step(fresh(3), q)
    said = [w for w in caught if "new function `<lambda>`" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "define the function once" in str(said[0].message)

    def near(i, j):
        return abs(i - j) < 3

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(custom.NEW_FUNCTIONS_BEFORE_WARNING + 3):
            step(bsa.BlockSparseAttention(mask=masks.Predicate(near)), q)
