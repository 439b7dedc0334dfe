"""Reliability of the inputs: integer ids and positions checked before JAX narrows them, an
`ArrayMask` array swapped in behind its constructor, masks holding arrays through `pickle`, a
NaN bias, `dispatch_documents`' arguments and `AllToAllRing`'s refusal; and the documented
edges of a NaN key row and of a `-inf` bias under a soft cap (docs/reliability.md). Outputs
are checked against the float64 oracle of `tests/conftest.py`."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, sharding
from tests.conftest import assert_close, np_attention, np_visibility, random_array, random_inputs

H, L, D = 2, 16, 8
TILES = bsa.Tiling(block_q=8, block_kv=8)
KERNELS = [pytest.param(kernels.XlaBlockSparse, id="xla"),
           pytest.param(kernels.DenseReference, id="reference")]


def _qkv(seed: int = 0):
    """Random unbatched ``[H, L, D]`` query, key and value."""
    return random_inputs(seed, batch=None, heads=H, q_len=L, dim=D)


def _one_line(info) -> str:
    text = str(info.value)
    assert "\n" not in text, text
    return text


def _module(mask, kernel_cls=kernels.XlaBlockSparse):
    return bsa.BlockSparseAttention(mask=mask, kernel=kernel_cls(), tiling=TILES)


# ---------------------------------------------------------------------------------------------
# Integer ids and positions: checked on the host, before `jnp.asarray` narrows int64 to int32.

_TOKEN_DATA = ["q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions"]


def _token_call(entry: str, name: str, bad):
    """A call of `entry` whose `name` is `bad` and whose other ids and positions are good."""
    q, k, v = _qkv()
    data = {n: np.zeros(L, np.int64) if "segment" in n else np.arange(L, dtype=np.int64)
            for n in _TOKEN_DATA}
    data[name] = bad
    if entry == "module":
        return lambda: _module(masks.Causal())(q, k, v, **data)
    if entry == "function":
        return lambda: bsa.blocksparse_attention(q[None], k[None], v[None], **data)
    info = {n: data.pop(n) for n in ("q_segment_ids", "kv_segment_ids")}
    return lambda: bsa.blocksparse_attention(q[None], k[None], v[None],
                                             mask_info=bsa.MaskInfo(**info), **data)


@pytest.mark.parametrize("entry, name", [
    *((entry, name) for entry in ("module", "function") for name in _TOKEN_DATA),
    ("mask_info", "q_segment_ids"), ("mask_info", "kv_segment_ids"),
])
def test_int64_ids_and_positions_past_the_range_are_refused_without_x64(entry, name):
    """Without x64, int64 ``2**32`` became 0 in `jnp.asarray` before the range check: a key of
    document ``2**32`` joined document 0, and the call answered (error 1.06 against the
    oracle)."""
    assert not jax.config.jax_enable_x64
    kind = "positions" if "positions" in name else "segment ids"
    bad = np.arange(L, dtype=np.int64) + 2**32  # each id would alias to its index
    with pytest.raises(ValueError, match=rf"^`{name}` must lie in \[-2\*\*3[01], ") as info:
        _token_call(entry, name, bad)()
    assert kind in _one_line(info)
    # One past the lower end, in a Python list (which NumPy makes int64).
    low = [-(2**30) - 1 if kind == "positions" else -(2**31) - 1] + [0] * (L - 1)
    with pytest.raises(ValueError, match=rf"^`{name}` must lie in"):
        _token_call(entry, name, low)()


def test_int64_ids_in_range_give_the_oracle():
    """The host check lets through int64 ids and positions that fit: the same answer as the
    float64 oracle (documents 0 and 2**31 - 1, shifted positions)."""
    q, k, v = _qkv(1)
    ids = np.repeat(np.array([0, 2**31 - 1], np.int64), L // 2)
    pos = np.arange(L, dtype=np.int64) + 2**30 - L
    mask = masks.Causal() & masks.SlidingWindow(5, 0)
    got = _module(mask)(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, q_positions=pos,
                        kv_positions=pos)
    visible = np_visibility(masks.Document() & mask, batch=1, heads=H, q_len=L, kv_len=L,
                            q_pos=pos[None], kv_pos=pos[None], q_seg=ids[None],
                            kv_seg=ids[None])
    assert_close(got, np_attention(q[None], k[None], v[None], visible)[0])


def test_int64_kv_seq_lengths_past_int32_are_refused():
    """An int64 length of ``2**32`` became 0 (every key padding, every row zeros)."""
    q, k, v = (x[None] for x in _qkv())
    with pytest.raises(ValueError, match=r"^`kv_seq_lengths` must lie in \[0, 16\]"):
        bsa.blocksparse_attention(q, k, v, kv_seq_lengths=np.array([2**32], np.int64))


@pytest.mark.parametrize("name", _TOKEN_DATA)
def test_float_ids_and_positions_are_refused_naming_the_argument(name):
    with pytest.raises(TypeError, match=rf"^`{name}` must hold integers; got dtype float64 "
                                        r"\(any integer dtype is accepted") as info:
        _token_call("module", name, np.zeros(L, np.float64))()
    _one_line(info)


@pytest.mark.parametrize("given", [(2, L), (L + 1,), (1, 1, L)])
def test_ids_of_other_shapes_are_refused_naming_the_shapes_accepted(given):
    """Unbatched calls take ``[L]`` ids; batched ones ``[L]`` or ``[B, L]``."""
    with pytest.raises(ValueError, match=rf"^`q_segment_ids` must have shape \[{L}\]; got") \
            as info:
        _token_call("module", "q_segment_ids", np.zeros(given, np.int32))()
    _one_line(info)


# ---------------------------------------------------------------------------------------------
# An ArrayMask array swapped in with `eqx.tree_at`, behind the constructor's checks.

_KEEP = np.asarray(random_array(7, (L, L))) > 0.3  # about 40 % visible, random per pair


_CAUSAL = np.tril(np.ones((L, L), bool))
_COMBINED = {
    # name: (the mask around an ArrayMask, where its array is, the oracle's visibility)
    "alone": (lambda a: a, lambda m: m.mask, lambda keep: keep),
    "and": (lambda a: masks.Causal() & a, lambda m: m.right.mask, lambda keep: keep & _CAUSAL),
    "or": (lambda a: a | masks.Causal(), lambda m: m.left.mask, lambda keep: keep | _CAUSAL),
    "not": (lambda a: ~a, lambda m: m.inner.mask, lambda keep: ~keep),
}


@pytest.mark.parametrize("kernel_cls,combine", [  # the quick tier: XLA under `&` only
    pytest.param(*kernel.values, combine, id=f"{kernel.id}-{combine}",
                 marks=() if kernel.id == "reference" or combine == "and" else pytest.mark.slow)
    for kernel in KERNELS for combine in _COMBINED])
def test_an_int_array_swapped_into_an_array_mask_counts_where_nonzero(kernel_cls, combine):
    """{0, 2} ints swapped in met the bitwise ``&`` as ints (``2 & True == 0``): every key
    hidden, error 1.0 against the oracle."""
    make, where, visible = _COMBINED[combine]
    q, k, v = _qkv(2)
    attn = _module(make(masks.ArrayMask(np.zeros((L, L), bool))), kernel_cls)
    ints = jnp.asarray(_KEEP[None], jnp.int32) * 2
    swapped = eqx.tree_at(lambda m: where(m.mask), attn, ints)
    want = np_attention(q[None], k[None], v[None], visible(_KEEP))[0]
    assert_close(swapped(q, k, v), want)
    if combine == "and":  # traced, the array is read the same way
        assert_close(eqx.filter_jit(lambda m, q: m(q, k, v))(swapped, q), want)


@pytest.mark.parametrize("bad, error, message", [
    (np.ones((1, L, L), np.float32), TypeError,
     r"^`ArrayMask.mask` must hold booleans \(or integers, nonzero = visible\); got dtype "
     r"float32: swap in `masks.ArrayMask\(array\)` \(with `eqx.tree_at` or `swap_strategy`\)"),
    (np.ones((L, L), bool), ValueError,
     rf"^`ArrayMask.mask` must have shape \[H or 1, Lq, Lk\]; got \({L}, {L}\): swap in "
     r"`masks.ArrayMask\(array\)` \(with `eqx.tree_at` or `swap_strategy`\)"),
])
@pytest.mark.parametrize("kernel_cls", KERNELS)
def test_a_float_or_two_dimensional_array_swapped_in_is_refused(kernel_cls, bad, error,
                                                                message):
    q, k, v = _qkv()
    attn = _module(masks.Causal() & masks.ArrayMask(_KEEP), kernel_cls)
    swapped = eqx.tree_at(lambda m: m.mask.right.mask, attn, jnp.asarray(bad))
    with pytest.raises(error, match=message) as info:
        swapped(q, k, v)
    _one_line(info)


def test_int64_values_past_int32_count_as_visible():
    """``ArrayMask`` of int64 ``2**32`` (nonzero) was narrowed to 0: a visible pair hidden."""
    big = np.where(_KEEP, 2**32, 0).astype(np.int64)
    np.testing.assert_array_equal(masks.ArrayMask(big).mask[0], _KEEP)


# ---------------------------------------------------------------------------------------------
# Pickling masks that hold arrays (checkpoints pickle modules).


def _shifted_causal(q, k, shift):
    return k <= q + shift[0]


_PICKLED = {
    # name: (the mask, its visibility [H, Lq, Lk])
    "array": (lambda: masks.ArrayMask(_KEEP), _KEEP),
    "predicate": (lambda: masks.Predicate(_shifted_causal, jnp.array([2], jnp.int32)),
                  np.tril(np.ones((L, L), bool), 2)),
    "and": (lambda: masks.Causal() & masks.ArrayMask(_KEEP), _CAUSAL & _KEEP),
    "per_head": (lambda: masks.PerHead([masks.ArrayMask(_KEEP), masks.Causal()]),
                 np.stack([_KEEP, _CAUSAL])),
}


@pytest.mark.parametrize("name", [  # the quick tier: an array inside a mask, a predicate's
    pytest.param(name, marks=() if name in ("per_head", "predicate") else pytest.mark.slow)
    for name in _PICKLED])
def test_masks_holding_arrays_round_trip_through_pickle(name):
    """Their pytree twin shares its class's name, and pickle raised ``PicklingError: ... not
    the same object as ...``."""
    make, visible = _PICKLED[name]
    mask = make()
    loaded = pickle.loads(pickle.dumps(mask))
    assert type(loaded) is type(mask)  # the pytree twin again: its arrays are traced
    assert bool(loaded == mask)
    assert jax.tree.structure(loaded) == jax.tree.structure(mask)
    attn = _module(mask)
    restored = pickle.loads(pickle.dumps(attn))
    assert bool(restored == attn)
    q, k, v = _qkv(3)
    np.testing.assert_array_equal(restored(q, k, v), attn(q, k, v))
    assert_close(restored(q, k, v), np_attention(q[None], k[None], v[None], visible)[0])


# ---------------------------------------------------------------------------------------------
# A NaN bias is refused like +inf.


def test_nan_bias_is_refused_like_plus_inf():
    q, k, v = _qkv()
    attn = _module(masks.Causal())
    bias = np.array(random_array(4, (L, L)))
    bias[3, 2] = np.nan
    message = r"^`bias` must be finite or -inf \(which hides a pair\); got \+inf or NaN\.$"
    for given in (bias, jnp.asarray(bias)):
        with pytest.raises(ValueError, match=message):
            attn(q, k, v, bias=given)
    with pytest.raises(Exception, match=r"`bias` must be finite or -inf"):
        jax.block_until_ready(jax.jit(lambda b: attn(q, k, v, bias=b))(jnp.asarray(bias)))
    # The bias without its NaN is accepted, with the oracle's answer.
    bias[3, 2] = -np.inf
    assert_close(attn(q, k, v, bias=bias),
                 np_attention(q[None], k[None], v[None], _CAUSAL, bias=bias)[0])


# ---------------------------------------------------------------------------------------------
# dispatch_documents' arguments.

_IDS = np.repeat(np.arange(4, dtype=np.int32), 8)[None]  # [1, 32]: four documents


@pytest.mark.parametrize("call, error, message", [
    (lambda: sharding.dispatch_documents(_IDS, 2, block=0), ValueError,
     "`block` must be a positive int; got 0."),
    (lambda: sharding.dispatch_documents(_IDS, 0, block=8), ValueError,
     "`devices` must be a positive int; got 0."),
    (lambda: sharding.dispatch_documents(_IDS, 2.0, block=8), ValueError,
     "`devices` must be a positive int; got 2.0."),
    (lambda: sharding.dispatch_documents(_IDS[0], 2, block=8), ValueError,
     "`segment_ids` must have shape [batch, length]; got (32,) (one sequence: pass "
     "segment_ids[None])."),
    (lambda: sharding.dispatch_documents(_IDS * 1.0, 2, block=8), TypeError,
     "`segment_ids` must hold integers; got dtype float64"),
    (lambda: sharding.dispatch_documents(_IDS, 2, block=8, positions=np.arange(16)), ValueError,
     "`positions` must have shape [1, 32] or [32] (as `segment_ids`); got (16,)."),
    (lambda: sharding.dispatch_documents(_IDS, 2, block=8, positions=np.arange(32) + 2**31),
     ValueError, "`positions` must lie in [-2**30, 2**30 - 1]"),
], ids=["block", "devices", "float_devices", "one_d", "float_ids", "positions_shape",
        "positions_range"])
def test_dispatch_documents_refuses_bad_arguments_in_one_line(call, error, message):
    """``block=0`` and ``devices=0`` raised ZeroDivisionError, 1-D ids "not enough values to
    unpack", positions past int32 were wrapped by ``astype(np.int32)``."""
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error
    assert _one_line(info).startswith(message), str(info.value)


def test_dispatch_documents_takes_one_sequence_of_positions():
    """``[L]`` positions are every batch row's; the reordered positions are theirs."""
    ids = np.concatenate([_IDS, _IDS[:, ::-1]])  # [2, 32]
    pos = np.arange(32) * 3 + 5
    d = sharding.dispatch_documents(ids, 2, block=8, positions=pos)
    np.testing.assert_array_equal(d.positions, pos[d.permutation])
    np.testing.assert_array_equal(np.take_along_axis(d.permutation, d.inverse, axis=1),
                                  np.broadcast_to(np.arange(32), (2, 32)))


# ---------------------------------------------------------------------------------------------
# AllToAllRing's refusal names itself (on 4 virtual CPU devices, in a child process).

_ALL_TO_ALL_RING = """
import jax, jax.numpy as jnp
from jax.sharding import AxisType
import eqx_bsattn as bsa
from eqx_bsattn import masks, sharding
mesh = jax.make_mesh((2, 2), ("r", "h"), axis_types=(AxisType.Auto,) * 2)
attn = bsa.BlockSparseAttention(mask=masks.Causal(), sharding=sharding.AllToAllRing(mesh, "h", "r"))
for heads, kv_heads in ((3, 3), (6, 3)):
    q = jnp.ones((1, heads, 16, 4)); k = jnp.ones((1, kv_heads, 16, 4))
    try:
        attn(q, k, k)
    except ValueError as e:
        print(e)
"""


def test_all_to_all_ring_refusals_name_it_and_its_way_out():
    """They said `AllToAll` and suggested `RingAttention`, which `AllToAllRing` already runs."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                      + " --xla_force_host_platform_device_count=4").strip())
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _ALL_TO_ALL_RING], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    way_out = "give `heads_axis` fewer devices, a number that fits the heads, and `ring_axis` " \
              "the rest"
    assert lines[0] == ("AllToAllRing over 2 devices gives each device heads / 2 query heads: "
                        f"the query heads (3) must be a multiple of 2 ({way_out}).")
    assert lines[1].startswith("AllToAllRing over 2 devices cannot split 3 key/value heads")
    assert way_out in lines[1] and "RingAttention" not in "".join(lines)


# ---------------------------------------------------------------------------------------------
# What docs/reliability.md says of a NaN key row and of a -inf bias under a soft cap.


@pytest.mark.parametrize("kernel_cls", [
    KERNELS[0], pytest.param(*KERNELS[1].values, id="reference", marks=pytest.mark.slow)])
def test_a_nan_key_row_reaches_only_the_rows_that_see_it_forward_and_every_dq_row(kernel_cls):
    q, k, v = _qkv(5)
    k = k.at[:, 5].set(jnp.nan)
    attn = _module(masks.Causal(), kernel_cls)
    out = attn(q, k, v)
    assert np.isnan(out[:, 5:]).all()
    assert_close(out[:, :5], np_attention(q[None], k[None], v[None], _CAUSAL)[0, :, :5])
    dq = jax.grad(lambda q: attn(q, k, v).sum())(q)
    assert np.isnan(dq).any(-1).all()  # rows 0..4 see no NaN key, yet their dq is NaN


@pytest.mark.parametrize("kernel_cls", KERNELS)
def test_minus_inf_bias_under_a_soft_cap_becomes_minus_cap(kernel_cls):
    """The cap follows the bias: ``-inf`` becomes ``-cap`` and hides nothing; a row of
    ``-inf`` attends uniformly to every key its mask lets through."""
    q, k, v = _qkv(6)
    bias = np.zeros((L, L))
    bias[3] = -np.inf
    bias[7, :4] = -np.inf
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernel_cls(), tiling=TILES,
                                    logits_soft_cap=2.0)
    out = attn(q, k, v, bias=bias)
    assert_close(out, np_attention(q[None], k[None], v[None], _CAUSAL, bias=bias,
                                   soft_cap=2.0)[0])
    assert_close(out[:, 3], np.asarray(v[:, :4], np.float64).mean(1))


# ---------------------------------------------------------------------------------------------
# The other doors that take integer masks, lengths and ids: compared or checked on the host.


def test_int64_attention_masks_past_int32_count_as_attend():
    """`attention_mask` of int64 ``2**32`` (nonzero: attend) was narrowed to 0 before the
    comparison: every key hidden, every row zeros."""
    q, k, v = (x[None] for x in _qkv(2))
    big = np.where(_KEEP, 2**32, 0).astype(np.int64)
    got = bsa.blocksparse_attention(q, k, v, attention_mask=big[None, None], causal=False)
    want = np_attention(q, k, v, np.broadcast_to(_KEEP, (1, H, L, L)))
    assert_close(got, want)


def test_int64_query_seq_lengths_past_int32_are_refused():
    """jax.nn's `query_seq_lengths`: an int64 ``2**32`` became 0 (every query dropped)."""
    q, k, v = (x[None] for x in _qkv())
    with pytest.raises(ValueError, match=r"^`query_seq_lengths` must lie in \[0, 16\] "
                                         r"\(q_len\)") as info:
        bsa.blocksparse_attention(q, k, v, query_seq_lengths=np.array([2**32], np.int64),
                                  qkv_layouts="bhsd")  # [B, H, L, D] shapes that fit both
    _one_line(info)


@pytest.mark.parametrize("name", ["q_segment_ids", "q_positions"])
def test_build_layout_refuses_int64_data_past_int32(name):
    """`build_layout`'s per-call data: an int64 ``2**32`` was read as 0."""
    bad = np.arange(L, dtype=np.int64) + 2**32
    mask = masks.Document() if "segment" in name else masks.Causal()
    other = "kv_segment_ids" if "segment" in name else "kv_positions"
    with pytest.raises(ValueError, match=rf"^`{name}` must lie in") as info:
        bsa.build_layout(mask, q_len=L, kv_len=L, num_heads=1, block_q=8, block_kv=8,
                         **{name: bad, other: np.arange(L)})
    _one_line(info)
