"""`blocksparse_attention` with `jax.nn.dot_product_attention`'s names means what jax.nn means:
not causal unless `is_causal=True`, and `mask`, `query_seq_lengths`, `local_window_size`,
`implementation` and `return_residual` as jax.nn reads them. Each case is checked against
jax.nn itself (float32, ``implementation="xla"``) and against the float64 NumPy oracle, on
jax.nn's ``[B, T, N, H]`` layout with grouped kv heads and ``T != S``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from tests.conftest import (
    assert_close,
    jnp_attention_f64,
    np_attention,
    np_visibility,
    random_array,
    sorted_segments,
    to_f64,
)

B, T, S, N, K, D = 2, 20, 28, 4, 2, 8  # batch, queries, keys, query heads, kv heads, head dim
Q = random_array(40, (B, T, N, D))
KEY = random_array(41, (B, S, K, D))
VALUE = random_array(42, (B, S, K, D))
TOL = 2e-5


def _bhsd(x):
    return np.swapaxes(np.asarray(x), 1, 2)


def _visible(*, is_causal=False, mask=None, q_lengths=None, kv_lengths=None, window=None):
    """``[B, N, T, S]`` visibility by jax.nn's documented rules, in NumPy."""
    qi, kj = np.arange(T)[:, None], np.arange(S)[None, :]
    vis = np.ones((B, N, T, S), bool)
    if is_causal:
        vis &= kj <= qi
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        vis &= (kj >= qi - left) & (kj <= qi + right)
    if mask is not None:
        vis &= np.asarray(mask).reshape((1,) * (4 - np.ndim(mask)) + np.shape(mask))
    if q_lengths is not None:
        vis &= (np.arange(T)[None, :] < np.asarray(q_lengths)[:, None])[:, None, :, None]
    if kv_lengths is not None:
        vis &= (np.arange(S)[None, :] < np.asarray(kv_lengths)[:, None])[:, None, None, :]
    return vis


def _oracle(visible, scale=None):
    """The float64 oracle's output in jax.nn's layout."""
    return _bhsd(np_attention(_bhsd(Q), _bhsd(KEY), _bhsd(VALUE), visible, scale=scale))


def _ours(**kw):
    return bsa.blocksparse_attention(Q, KEY, VALUE, qkv_layouts="bshd", **kw)


def _jax_nn(**kw):
    return jax.nn.dot_product_attention(Q, KEY, VALUE, implementation="xla", **kw)


def _one_line(info, *needles):
    text = str(info.value)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text


def _random_mask(seed, shape):
    """Random booleans where every row of the broadcast [B, N, T, S] keeps a key."""
    m = np.random.default_rng(seed).random(shape) < 0.6
    m[..., :1] = True
    return m


LENGTHS = np.array([9, 20], np.int32)
KV_LENGTHS = np.array([13, 28], np.int32)

# One jax.nn-only name each, as jax.nn would be called (non-causal: its default), and the
# visibility it means.
ALONE = {
    "scale": (dict(scale=0.25), {}),
    "key_value_seq_lengths": (dict(key_value_seq_lengths=KV_LENGTHS),
                              dict(kv_lengths=KV_LENGTHS)),
    "query_seq_lengths": (dict(query_seq_lengths=LENGTHS), dict(q_lengths=LENGTHS)),
    "mask": (dict(mask=_random_mask(0, (B, 1, T, S))), dict(mask=_random_mask(0, (B, 1, T, S)))),
    "local_window_size": (dict(local_window_size=(3, 2)), dict(window=(3, 2))),
    "implementation": (dict(implementation="xla"), {}),
}


@pytest.mark.parametrize("name", ALONE)
def test_a_jax_nn_name_alone_is_not_causal(name):
    """`scale=0.25` with the seed's causal default was wrong by 2.7 against jax.nn: any of
    jax.nn's own names makes the call read as jax.nn reads it."""
    kw, vis_kw = ALONE[name]
    want = _oracle(_visible(**vis_kw), scale=kw.get("scale"))
    out = _ours(**kw)
    assert_close(out, want, TOL, name)
    assert_close(_jax_nn(**{n: x for n, x in kw.items() if n != "implementation"}), want, TOL,
                 f"{name} (jax.nn)")
    # The seed's own spelling keeps the seed's causal default.
    if name == "scale":
        causal = _oracle(_visible(is_causal=True), scale=0.25)
        assert_close(_ours(softmax_scale=0.25), causal, TOL, "softmax_scale")
        assert np.abs(np.asarray(out) - causal).max() > 0.1


def test_return_residual_alone_is_not_causal_and_is_jax_nn_lse():
    out, lse = _ours(return_residual=True)
    want_out, want_lse = _jax_nn(return_residual=True)
    assert lse.shape == (B, T, N) == want_lse.shape  # jax.nn's [B, T, N], not our [B, H, Lq]
    q, k = (np.asarray(x, np.float64) for x in (_bhsd(Q), _bhsd(KEY)))
    logits = np.einsum("bhid,bhjd->bhij", q, np.repeat(k, N // K, axis=1)) / np.sqrt(D)
    top = logits.max(-1)
    lse64 = top + np.log(np.exp(logits - top[..., None]).sum(-1))  # [B, N, T]
    assert_close(out, _oracle(_visible()), TOL, "out")
    assert_close(lse, np.swapaxes(lse64, 1, 2), TOL, "lse")
    assert_close(want_lse, np.swapaxes(lse64, 1, 2), TOL, "lse (jax.nn)")
    assert_close(want_out, out, TOL, "out (jax.nn)")


@pytest.mark.parametrize("kw,causal", [
    (dict(is_causal=True, scale=0.3), True),
    (dict(causal=True, mask=np.ones((T, S), bool)), True),  # ours decides as well
    (dict(causal=False, scale=0.3, sliding_window=(4, 1)), False),  # said: no ambiguity
    (dict(is_causal=False), False),
    (dict(), True),  # no jax.nn name: the seed's default
])
def test_causal_or_is_causal_decides(kw, causal):
    window = kw.get("sliding_window")
    vis = _visible(is_causal=causal, window=window)
    assert_close(_ours(**kw), _oracle(vis, scale=kw.get("scale")), TOL, str(kw))
    if window is None:
        theirs = {n: x for n, x in kw.items() if n not in ("causal", "is_causal")}
        assert_close(_jax_nn(is_causal=causal, **theirs), _oracle(vis, scale=kw.get("scale")),
                     TOL, f"{kw} (jax.nn)")


@pytest.mark.parametrize("kw,needles", [
    (dict(scale=0.3, sliding_window=4), ("`scale`", "`sliding_window`", "causal=True")),
    (dict(mask=np.ones((T, S), bool), q_segment_ids=np.zeros((B, T), np.int32),
          kv_segment_ids=np.zeros((B, S), np.int32)),
     ("`mask`", "`q_segment_ids`")),
    (dict(local_window_size=2, logits_soft_cap=5.0), ("`local_window_size`",
                                                      "`logits_soft_cap`")),
    (dict(key_value_seq_lengths=KV_LENGTHS, mask_builder=bsa.masks.Full()),
     ("`key_value_seq_lengths`", "`mask_builder`")),
])
def test_mixed_names_without_causal_are_refused(kw, needles):
    """jax.nn's names beside this function's own: the two defaults disagree, so the call must
    say; with `causal=` it runs."""
    with pytest.raises(ValueError) as info:
        _ours(**kw)
    _one_line(info, "`causal` is ambiguous", *needles)
    _ours(causal=False, **kw)


@pytest.mark.parametrize("ours,theirs", [
    (dict(causal=True), dict(is_causal=False)),
    (dict(sliding_window=3), dict(local_window_size=3)),
    (dict(attention_mask=np.ones((T, S), bool)), dict(mask=np.ones((T, S), bool))),
    (dict(platform="xla"), dict(implementation="xla")),
    (dict(return_lse=True), dict(return_residual=True)),
])
def test_both_names_of_one_argument_are_refused(ours, theirs):
    with pytest.raises(TypeError) as info:
        _ours(**ours, **theirs)
    _one_line(info, f"`{next(iter(ours))}`", f"`{next(iter(theirs))}`", "pass one")


# jax.nn's `mask` shapes: 4 (or fewer) dimensions, each 1 or that of [B, N, T, S].
MASK_SHAPES = [(B, N, T, S), (1, N, T, S), (B, 1, T, S), (B, 1, 1, S), (B, N, T, 1), (T, S),
               (N, T, S), (1, 1, T, S)]
#: A mask per example maps the call over the batch (a compile of its own): one stays quick.
_SLOW_SHAPES = {(B, N, T, S), (B, N, T, 1)}


@pytest.mark.parametrize("shape", [
    pytest.param(shape, id=str(shape), marks=pytest.mark.slow if shape in _SLOW_SHAPES else ())
    for shape in MASK_SHAPES])
def test_mask_as_jax_nn_reads_it(shape):
    m = _random_mask(1, shape)
    for causal in (False, True) if shape == (B, 1, T, S) else (False,):
        want = _oracle(_visible(mask=m, is_causal=causal))
        out = _ours(mask=jnp.asarray(m), is_causal=causal)
        assert_close(out, want, TOL, f"{shape} causal={causal}")
        assert_close(_jax_nn(mask=jnp.asarray(m), is_causal=causal), want, TOL,
                     f"{shape} causal={causal} (jax.nn)")


def test_mask_rows_that_see_nothing_give_zeros():
    """A query row the mask hides entirely gives zeros here; jax.nn gives the mean of every
    value (its softmax of equal large negative logits). docs/seed_api.md says so."""
    m = _random_mask(2, (B, N, T, S))
    m[:, :, 5] = False
    out = np.asarray(_ours(mask=m))
    assert np.all(out[:, 5] == 0)
    assert_close(out, _oracle(_visible(mask=m)), TOL)
    theirs = np.asarray(_jax_nn(mask=jnp.asarray(m)))
    seen = np.ones(T, bool)
    seen[5] = False
    assert_close(out[:, seen], theirs[:, seen], TOL, "rows that see a key")


@pytest.mark.parametrize("mask,needles,error", [
    (np.ones((B, N, T, S), np.int32), ("`mask` must hold booleans", "int32"), TypeError),
    (np.ones((B, K, T, S), bool), ("`mask`", f"{(B, K, T, S)}", "[2, 4, 20, 28]"), ValueError),
    (np.ones((1, B, N, T, S), bool), ("`mask`", "4 (or fewer)"), ValueError),
    (np.ones((B, S), bool), ("`mask`", f"{(B, S)}"), ValueError),  # not key padding: jax.nn's
])
def test_mask_errors_are_one_line(mask, needles, error):
    with pytest.raises(error) as info:
        _ours(mask=mask)
    _one_line(info, *needles)


@pytest.mark.slow  # the quick tier's query-length tests check the rows forward
def test_query_seq_lengths_give_zero_rows_and_gradients_like_jax_nn():
    """Queries past `query_seq_lengths` give zero rows and zero gradients, as jax.nn's (which
    multiplies them by zero), with key lengths and causality beside them."""
    kw = dict(query_seq_lengths=LENGTHS, key_value_seq_lengths=KV_LENGTHS, is_causal=True)
    vis = _visible(q_lengths=LENGTHS, kv_lengths=KV_LENGTHS, is_causal=True)
    out = np.asarray(_ours(**kw))
    assert np.all(out[0, LENGTHS[0]:] == 0)
    assert_close(out, _oracle(vis), TOL)
    assert_close(_jax_nn(**kw), out, TOL, "jax.nn")
    cot = random_array(43, (B, T, N, D))

    def loss(attention):
        return lambda q, k, v: jnp.sum(attention(q, k, v) * cot)

    ours = jax.grad(loss(lambda q, k, v: bsa.blocksparse_attention(
        q, k, v, qkv_layouts="bshd", **kw)), argnums=(0, 1, 2))(Q, KEY, VALUE)
    theirs = jax.grad(loss(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="xla", **kw)), argnums=(0, 1, 2))(Q, KEY, VALUE)
    with jax.enable_x64(True):
        f64 = jax.grad(loss(lambda q, k, v: jnp.swapaxes(jnp_attention_f64(
            *(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), vis), 1, 2)), argnums=(0, 1, 2))(
            *map(to_f64, (Q, KEY, VALUE)))
        f64 = [np.asarray(g) for g in f64]
    for name, got, jnn, want in zip(("dq", "dk", "dv"), ours, theirs, f64):
        assert_close(got, want, 5e-5, name)
        assert_close(jnn, want, 5e-5, f"{name} (jax.nn)")
    assert np.all(np.asarray(ours[0])[0, LENGTHS[0]:] == 0)


def test_query_seq_lengths_zero_the_rows_a_mask_sees_through():
    """A mask that reads segment ids through an ``|`` lets a hidden query see keys; the rows
    past `query_seq_lengths` are zeroed all the same, as jax.nn zeroes them."""
    mask = bsa.masks.Document() | bsa.masks.SlidingWindow(1)
    rng = np.random.default_rng(5)
    seg_q, seg_kv = sorted_segments(rng, B, T, 2), sorted_segments(rng, B, S, 2)
    out = _ours(query_seq_lengths=LENGTHS, mask_builder=mask, q_segment_ids=seg_q,
                kv_segment_ids=seg_kv, causal=False)
    vis = np_visibility(mask, batch=B, heads=N, q_len=T, kv_len=S, q_seg=seg_q, kv_seg=seg_kv)
    assert_close(out, _oracle(vis & _visible(q_lengths=LENGTHS)), TOL)
    assert np.all(np.asarray(out)[0, LENGTHS[0]:] == 0)


@pytest.mark.slow
def test_query_seq_lengths_lse_and_unbatched():
    """`return_lse` gives -inf past the query lengths (a row that sees no key); unbatched
    ``[H, L, D]`` inputs take a scalar length and a ``[N, T, S]`` mask."""
    out, lse = _ours(query_seq_lengths=LENGTHS, return_lse=True)
    assert lse.shape == (B, N, T)
    assert np.all(np.isneginf(np.asarray(lse)[0, :, LENGTHS[0]:]))
    assert np.all(np.isfinite(np.asarray(lse)[0, :, :LENGTHS[0]]))
    assert_close(out, _oracle(_visible(q_lengths=LENGTHS)), TOL)
    m = _random_mask(3, (N, T, S))
    q, k, v = (_bhsd(x)[0] for x in (Q, KEY, VALUE))
    one = bsa.blocksparse_attention(q, k, v, mask=m, query_seq_lengths=7)
    want = np_attention(q[None], k[None], v[None], _visible(mask=m, q_lengths=[7, 7])[:1])[0]
    assert_close(one, want, TOL, "unbatched")


@pytest.mark.parametrize("lengths,needles,error", [
    (np.array([3.0, 4.0]), ("`query_seq_lengths` must hold integers",), TypeError),
    (np.array([1, 2, 3]), ("`query_seq_lengths` must have shape [2] or a scalar", "(3,)"),
     ValueError),
    (np.array([3, T + 1]), ("`query_seq_lengths` must lie in [0, 20]",), ValueError),
])
def test_query_seq_lengths_errors_are_one_line(lengths, needles, error):
    with pytest.raises(error) as info:
        _ours(query_seq_lengths=lengths)
    _one_line(info, *needles)


def test_query_seq_lengths_under_jit_never_recompile():
    traces = []

    @jax.jit
    def run(lengths):
        traces.append(1)
        return _ours(query_seq_lengths=lengths)

    for lengths in (LENGTHS, np.array([20, 4], np.int32)):
        assert_close(run(lengths), _oracle(_visible(q_lengths=lengths)), TOL, str(lengths))
    assert len(traces) == 1


@pytest.mark.parametrize("window", [2, (3, 1), (0, 4)], ids=str)
def test_local_window_size_is_jax_nn_window(window):
    for causal in (False, True):
        want = _oracle(_visible(window=window, is_causal=causal))
        out = _ours(local_window_size=window, is_causal=causal)
        assert_close(out, want, TOL, f"{window} causal={causal}")
        assert_close(_jax_nn(local_window_size=window, is_causal=causal), want, TOL,
                     f"{window} causal={causal} (jax.nn)")


def test_local_window_size_errors_name_it():
    with pytest.raises(ValueError) as info:
        _ours(local_window_size=(-1, 2))
    _one_line(info, "`local_window_size` must be", "(-1, 2)")


def test_implementation_picks_the_kernel():
    """`implementation` picks the kernel as ``platform=`` does ('xla': `XlaBlockSparse`,
    'cudnn': `CudnnDense`, which says it runs on a GPU only when there is none); other values
    are refused in one line that names `platform=`."""
    out = _ours(implementation="xla", is_causal=True)
    assert_close(out, _oracle(_visible(is_causal=True)), TOL)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError) as info:
            _ours(implementation="cudnn")
        _one_line(info, "kernel cudnn cannot run this call", "gpu only")
    with pytest.raises(ValueError) as info:
        _ours(implementation="triton")
    _one_line(info, "`implementation` must be None, 'xla' or 'cudnn'", "'triton'", "platform=")


def test_jax_nn_bias_in_fourth_place_is_refused_with_the_way_out():
    """jax.nn's 4th positional argument is `bias`; here it is `softmax_aux` (sinks): a 4-D
    array there is refused, naming the 5th place, where the bias gives jax.nn's answer."""
    bias = random_array(44, (B, N, T, S))
    with pytest.raises(ValueError) as info:
        bsa.blocksparse_attention(Q, KEY, VALUE, bias, qkv_layouts="bshd", scale=0.3)
    _one_line(info, "`softmax_aux`", f"{(B, N, T, S)}", "(query, key, value, None, bias)")
    out = bsa.blocksparse_attention(Q, KEY, VALUE, None, bias, qkv_layouts="bshd", scale=0.3)
    want = _bhsd(np_attention(_bhsd(Q), _bhsd(KEY), _bhsd(VALUE), _visible(), scale=0.3,
                              bias=bias))
    assert_close(out, want, TOL)
    assert_close(_jax_nn(bias=bias, scale=0.3), want, TOL, "jax.nn")


# --- jax.nn's names given as None, its layout, its bias and 3-D inputs --------------------
# New shapes and options run under `jax.jit`: one compile each, not one per operation.

#: jax.nn's names as a wrapper forwarding its own defaults passes them: each given, as None.
AS_NONE = ["mask", "scale", "implementation", "local_window_size", "key_value_seq_lengths",
           "query_seq_lengths", "is_causal", "return_residual", "bias"]


@pytest.mark.parametrize("name", AS_NONE)
def test_a_jax_nn_name_passed_as_none_means_jax_nn_defaults(name):
    """``mask=None`` (and the others) counted as not given, so the call kept ejKernel's causal
    default: 1.4-2.8 off jax.nn with the same arguments. A jax.nn name given at all is jax.nn's
    call: not causal."""
    out = _ours(**{name: None})
    assert_close(out, _oracle(_visible()), TOL, name)
    theirs = jax.nn.dot_product_attention(Q, KEY, VALUE, **{name: None})
    assert_close(theirs, out, TOL, f"{name} (jax.nn)")


def _forwarding(attention, **fixed):
    """A wrapper with jax.nn's signature that forwards every argument, defaults included."""
    def wrapper(q, k, v, bias=None, mask=None, *, scale=None, is_causal=False,
                query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                implementation=None):
        return attention(q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
                         query_seq_lengths=query_seq_lengths,
                         key_value_seq_lengths=key_value_seq_lengths,
                         local_window_size=local_window_size, implementation=implementation,
                         **fixed)
    return wrapper


def _out_and_grads(attention, *args):
    """``attention(*args)`` and the gradients of a random projection of it to each of `args`,
    in one compiled call."""
    cot = random_array(45, jax.eval_shape(attention, *args).shape)

    def loss(*a):
        out = attention(*a)
        return jnp.sum(out * cot), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))),
                                                 has_aux=True))(*args)
    return out, grads


def test_a_forwarding_wrapper_matches_jax_nn_with_gradients():
    ours = _forwarding(bsa.blocksparse_attention, qkv_layouts="bshd")
    out, got = _out_and_grads(ours, Q, KEY, VALUE)
    _, want = _out_and_grads(_forwarding(jax.nn.dot_product_attention), Q, KEY, VALUE)
    assert_close(out, _oracle(_visible()), TOL)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, 5e-5, name)


# Shapes that fit [B, T, N, H] and [B, H, L, D] alike (T == N == 16).
SQUARE = random_array(46, (B, 16, 16, D))


@pytest.mark.parametrize("kw", [dict(scale=0.3), dict(mask=None), dict(is_causal=True),
                                dict(bias=None)], ids=str)
def test_jax_nn_names_on_shapes_of_both_layouts_need_qkv_layouts(kw):
    """jax.nn's [B, T, N, H] arrays with T <= N were read as [B, H, L, D] without a word (1.36
    off jax.nn at T = N = 16): a call with jax.nn's names whose shapes fit both layouts is
    refused, naming `qkv_layouts`; with it, the answer is jax.nn's."""
    x = SQUARE
    with pytest.raises(ValueError) as info:
        bsa.blocksparse_attention(x, x, x, **kw)
    _one_line(info, "`qkv_layouts` must be given", f"`{next(iter(kw))}`", "qkv_layouts='bshd'")
    if kw == dict(scale=0.3):
        want = jax.jit(lambda x: jax.nn.dot_product_attention(x, x, x, scale=0.3))(x)
        out = jax.jit(lambda x: bsa.blocksparse_attention(x, x, x, qkv_layouts="bshd",
                                                          scale=0.3))(x)
        assert_close(out, want, TOL)


def test_jax_nn_names_read_the_layout_only_one_of_them_fits():
    """Without `qkv_layouts`, a jax.nn call's arrays are jax.nn's [B, T, N, H] where only that
    layout fits them (here T=20, N=4, S=28, K=2) and [B, H, L, D] where only that fits."""
    want = _jax_nn(scale=0.3, is_causal=True)
    out = bsa.blocksparse_attention(Q, KEY, VALUE, scale=0.3, is_causal=True)
    assert_close(out, want, TOL, "bshd inferred")
    out = bsa.blocksparse_attention(*(_bhsd(x) for x in (Q, KEY, VALUE)), scale=0.3,
                                    is_causal=True)
    assert_close(_bhsd(out), want, TOL, "bhsd kept")


def test_bias_by_keyword_is_jax_nn_bias_with_gradients():
    """jax.nn's `bias=` (keyword) was refused as positional-only: it is taken, as one of
    jax.nn's names (not causal), its gradient jax.nn's."""
    bias = random_array(47, (B, N, T, S))
    out, got = _out_and_grads(
        lambda q, b, v: bsa.blocksparse_attention(q, KEY, v, bias=b), Q, bias, VALUE)
    theirs, want = _out_and_grads(
        lambda q, b, v: jax.nn.dot_product_attention(q, KEY, v, bias=b), Q, bias, VALUE)
    assert_close(out, theirs, TOL)
    for name, g, w in zip(("dq", "dbias", "dv"), got, want):
        assert_close(g, w, 5e-5, name)
    with pytest.raises(TypeError) as info:
        bsa.blocksparse_attention(Q, KEY, VALUE, None, bias, bias=bias, qkv_layouts="bshd")
    _one_line(info, "`bias`", "pass one")


@pytest.mark.parametrize("shape", [(S,), ()], ids=str)
def test_a_bias_of_fewer_than_two_dimensions_broadcasts_as_in_jax_nn(shape):
    """A 1-D bias was refused; jax.nn adds ones in front (its trailing axis is the keys), by
    keyword or 5th positionally (ejKernel's place), its gradient of the caller's shape."""
    bias = random_array(49, shape)
    seed = jax.jit(lambda b: bsa.blocksparse_attention(Q, KEY, VALUE, None, b, causal=False,
                                                       qkv_layouts="bshd"))(bias)
    if not shape:  # a scalar shifts every logit alike: its gradient is zero up to rounding
        want = jax.jit(lambda b: jax.nn.dot_product_attention(Q, KEY, VALUE, bias=b))(bias)
        assert_close(seed, want, TOL, "5th positional")
        return
    out, (got,) = _out_and_grads(lambda b: bsa.blocksparse_attention(Q, KEY, VALUE, bias=b),
                                 bias)
    want, (grad,) = _out_and_grads(lambda b: jax.nn.dot_product_attention(Q, KEY, VALUE, bias=b),
                                   bias)
    assert_close(out, want, TOL, "keyword")
    assert_close(seed, want, TOL, "5th positional")
    assert got.shape == shape
    assert_close(got, grad, 5e-5, "dbias")


def _unbatched_call():
    """jax.nn's 3-D call: [T, N, H] inputs, its 4-D `mask` and `bias`, a [1] length."""
    kw = dict(mask=_random_mask(6, (1, N, T, S)), bias=random_array(50, (1, N, T, S)),
              key_value_seq_lengths=np.array([13], np.int32), scale=0.3)
    return (Q[0], KEY[0], VALUE[0]), kw


def test_unbatched_inputs_are_jax_nn_3d_call():
    """jax.nn takes [T, N, H] (adding the batch), which was refused: so does its door here,
    with its 4-D `mask` and `bias`, [1] lengths and its [T, N] residual."""
    (q, k, v), kw = _unbatched_call()
    want, want_lse = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, return_residual=True, **kw))(q, k, v)
    out, lse = jax.jit(lambda q, k, v: bsa.blocksparse_attention(  # the layout inferred
        q, k, v, return_residual=True, **kw))(q, k, v)
    assert out.shape == (T, N, D) and lse.shape == (T, N) == want_lse.shape
    assert_close(out, want, TOL)
    assert_close(lse, want_lse, TOL, "lse")


@pytest.mark.slow
def test_unbatched_jax_nn_3d_call_gradients():
    (q, k, v), kw = _unbatched_call()
    out, got = _out_and_grads(
        lambda q, k, v: bsa.blocksparse_attention(q, k, v, qkv_layouts="bshd", **kw), q, k, v)
    theirs, want = _out_and_grads(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw), q, k, v)
    assert_close(out, theirs, TOL)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, 5e-5, name)
