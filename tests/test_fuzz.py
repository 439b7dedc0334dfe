"""Differential fuzzing: every kernel that runs on this machine against the float64 oracle,
forward and every gradient, over calls drawn by `tests/test_properties.py` (random shapes, GQA,
mask algebra, per-head masks, documents with padding, positions (also at both ends of the
documented range), bias, sinks, soft cap, scale) and random dtypes and tilings (forward and
backward tiles apart); and `ArrayMask` calls under `ShardMap` and `RingAttention` on eight CPU
devices (in a child process, as `tests/test_sharding.py` runs).

Derandomized with a fixed example budget sized to add about a minute to CI on two cores; for a
longer randomized search run ``HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_fuzz.py``.
On a GPU machine the GPU kernels join (their cases carry the `gpu` marker); on the CPU the
Triton kernel runs through its interpreter when ``EQX_BSATTN_TRITON_INTERPRET`` is set.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eqx_bsattn as bsa
from tests.conftest import jnp_attention_f64
from tests.test_conformance import KERNELS, TOL, _marks
from tests.test_properties import attention_calls, examples

#: The dtypes each kernel is fuzzed in (the Triton interpreter computes bfloat16 dots wrongly;
#: cuDNN takes only half types).
_DTYPES = {"triton": ("float32", "float16"), "cudnn": ("bfloat16", "float16")}
_DEFAULT_DTYPES = ("float32", "bfloat16")

tilings = st.builds(
    lambda bq, bk, bq_bwd, bk_bwd: bsa.Tiling(block_q=bq, block_kv=bk, block_q_bwd=bq_bwd,
                                              block_kv_bwd=bk_bwd),
    st.sampled_from([16, 32, 64]), st.sampled_from([16, 32, 64]),
    st.sampled_from([16, 32]), st.sampled_from([16, 32]),
)


def _oracle(call, dtype, cotangent):
    """Float64 output and gradients (q, k, v, and bias / sinks when the call has them)."""
    mask, qkv, kw, oracle, vis = call
    args = {"q": qkv[0], "k": qkv[1], "v": qkv[2]}
    args.update({n: kw[n] for n in ("bias", "sinks") if n in kw})
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        a64 = {n: jnp.asarray(np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64))
               for n, x in args.items()}

        def f(a):
            bias = a.get("bias")
            if bias is not None:
                bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
            return jnp_attention_f64(a["q"], a["k"], a["v"], jnp.asarray(vis),
                                     scale=oracle["scale"], bias=bias, sinks=a.get("sinks"),
                                     soft_cap=oracle["soft_cap"])

        out, pullback = jax.vjp(f, a64)
        grads = pullback(jnp.asarray(np.asarray(cotangent, np.float64)))[0]
        return np.asarray(out), {n: np.asarray(g) for n, g in grads.items()}


def _errors(got, want) -> tuple[float, float]:
    """(max, norm) errors relative to `want`, floored at 1e-2 of unit scale: a gradient that is
    zero in exact arithmetic (one visible key) has only rounding noise to compare."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert np.all(np.isfinite(got)), "non-finite values"
    diff = got - want
    scale = max(np.abs(want).max(initial=0.0), 1e-2)
    norm = max(np.linalg.norm(want), 1e-2 * np.sqrt(want.size))
    return float(np.abs(diff).max(initial=0.0) / scale), float(np.linalg.norm(diff) / norm)


def check_call(kernel, call, dtype: str, tiling) -> None:
    mask, qkv, kw, oracle, vis = call
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, tiling=tiling,
                                    softmax_scale=oracle["scale"],
                                    logits_soft_cap=oracle["soft_cap"])
    args = {"q": qkv[0], "k": qkv[1], "v": qkv[2]}
    args.update({n: kw[n] for n in ("bias", "sinks") if n in kw})
    args = {n: x.astype(dtype) if n in ("q", "k", "v") else x for n, x in args.items()}
    data = {n: x for n, x in kw.items() if n not in args}
    try:
        attn.plan(args["q"], args["k"], args["v"], **{n: args[n] for n in args if n not in ("q", "k", "v")},
                  **data)
    except ValueError as e:
        if str(e).startswith(f"kernel {kernel.name} cannot run this call"):
            return  # the kernel declines this call: nothing to compare
        raise
    cotangent = jnp.asarray(np.random.default_rng(len(vis.ravel())).standard_normal(
        qkv[0].shape[:3] + (qkv[2].shape[-1],)), dtype)

    @jax.jit
    def run(a):
        out, pullback = jax.vjp(
            lambda a: attn(a["q"], a["k"], a["v"], **{n: a[n] for n in a if n not in ("q", "k", "v")},
                           **data), a)
        return out, pullback(cotangent)[0]

    out, grads = run(args)
    want_out, want_grads = _oracle(call, dtype, cotangent)
    (max_out, max_grad), (norm_out, norm_grad) = TOL[dtype]["max"], TOL[dtype]["norm"]
    # Maximum errors only in float32: in half types a tiny gradient entry (a row that sees one
    # key) has no meaningful relative maximum; norms are still checked.
    errors = {"out": _errors(out, want_out)}
    errors.update({f"d{n}": _errors(grads[n], want_grads[n]) for n in grads})
    norm_tol = {n: norm_out if n == "out" else norm_grad for n in errors}
    if dtype != "float32" and "dsinks" in errors:
        # d sink = -sum over rows of p_sink * rowsum(dO * O): cancelling terms, each rounded
        # with p in the half type (XlaBlockSparse, bfloat16: 3.3e-2 in norm seen).
        norm_tol["dsinks"] = 5e-2
    bad = {n: e for n, e in errors.items()
           if e[1] > norm_tol[n]
           or (dtype == "float32" and e[0] > (max_out if n == "out" else max_grad))}
    assert not bad, f"{kernel.name} {dtype}: (max, norm) relative errors {errors}"


#: Kernels fuzzed in the extended tier only: the CPU kernels beside XlaBlockSparse, the one the
#: default run fuzzes on the CPU (the conformance suite runs fixed cases of every kernel).
EXTENDED_KERNELS = {"reference", "gather"}
RUNS = [pytest.param(cls, id=cls.name, marks=_marks(cls, runs=True) + (
    [pytest.mark.extended] if cls.name in EXTENDED_KERNELS else [])) for cls in KERNELS]

#: A minute of CI on two cores: the quick subset (``-m "not slow"``) leaves fuzzing out; the
#: conformance suite keeps a few fixed cases of every kernel there.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kernel_cls", RUNS)
@examples(6)
@given(call=attention_calls(max_len=40), tiling=tilings, data=st.data())
def test_kernel_matches_the_oracle(kernel_cls, call, tiling, data):
    dtype = data.draw(st.sampled_from(_DTYPES.get(kernel_cls.name, _DEFAULT_DTYPES)), "dtype")
    check_call(kernel_cls(), call, dtype, tiling)


@pytest.mark.parametrize("kernel_cls", RUNS)
@examples(3)
@given(call=attention_calls(max_len=40, positions="limits"), tiling=tilings, data=st.data())
def test_kernel_matches_the_oracle_at_the_position_limits(kernel_cls, call, tiling, data):
    """Positions at either end of `contract.POSITION_LIMIT` (the main draw reaches them too)."""
    dtype = data.draw(st.sampled_from(_DTYPES.get(kernel_cls.name, _DEFAULT_DTYPES)), "dtype")
    check_call(kernel_cls(), call, dtype, tiling)


# ---------------------------------------------------------------------------------------------
# ArrayMask under both shardings, on 8 CPU devices (a child process: JAX fixes the device count
# when its backend starts).

_CHILD = "EQX_BSATTN_FUZZ_SHARDED_CHILD"
_IN_CHILD = os.environ.get(_CHILD) == "1"


@pytest.mark.skipif(_IN_CHILD, reason="the child runs the draw itself")
def test_array_masks_under_both_shardings_on_eight_devices():
    env = dict(os.environ, **{_CHILD: "1"})
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--full",
           os.path.abspath(__file__), "-k", "sharded_array_mask"]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]


@st.composite
def sharded_array_calls(draw):
    """``(sharding, mask, (q, k, v), visibility, tiling)``: a random `ArrayMask` (shared or per
    head, alone or with a causal or window term) under `ShardMap` over batch and heads or
    `RingAttention` over the sequence in either order."""
    from jax.sharding import AxisType

    from eqx_bsattn import masks, sharding
    from tests.conftest import np_mask, random_inputs

    def mesh(shape, names):
        return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))

    how = draw(st.sampled_from(["shard_map", "ring_contiguous", "ring_zigzag"]), "sharding")
    heads, kv_heads = draw(st.sampled_from([(4, 4), (4, 2), (4, 1)]), "heads")
    if how == "shard_map":
        shard = sharding.ShardMap(mesh((2, 4), ("b", "h")), "b", "h")
        length, tiling = draw(st.integers(1, 40), "length"), draw(tilings, "tiling")
    else:
        order = how.split("_")[1]
        shard = sharding.RingAttention(mesh((8,), ("s",)), "s", order=order)
        length, tiling = 64, bsa.Tiling(block_q=4, block_kv=4)
    seed = draw(st.integers(0, 1000), "seed")
    keep = np.random.default_rng(seed).random((draw(st.sampled_from([1, heads])), length,
                                               length)) < draw(st.sampled_from([0.1, 0.5, 0.9]))
    term = draw(st.sampled_from([None, masks.Causal(), masks.SlidingWindow(5, 2)]), "term")
    mask = masks.ArrayMask(keep) if term is None else term & masks.ArrayMask(keep)
    vis = np.broadcast_to(keep, (heads, length, length))
    if term is not None:
        vis = vis & np_mask(term, q_len=length, kv_len=length, heads=heads)
    qkv = random_inputs(seed, batch=2, heads=heads, kv_heads=kv_heads, q_len=length, dim=8)
    return shard, mask, qkv, np.broadcast_to(vis, (2, heads, length, length)), tiling


@pytest.mark.skipif(not _IN_CHILD, reason="runs in the 8-device child process")
@pytest.mark.parametrize("kernel_name", ["DenseReference", "XlaBlockSparse"])
@examples(4)
@given(call=sharded_array_calls())
def test_sharded_array_mask_matches_the_oracle(kernel_name, call):
    from eqx_bsattn import kernels

    shard, mask, (q, k, v), vis, tiling = call
    attn = bsa.BlockSparseAttention(mask=mask, kernel=getattr(kernels, kernel_name)(),
                                    tiling=tiling, sharding=shard)
    cotangent = jnp.asarray(np.random.default_rng(vis.size).standard_normal(q.shape), q.dtype)

    @jax.jit
    def run(a):
        out, pullback = jax.vjp(lambda a: attn(*a), a)
        return out, pullback(cotangent)[0]

    out, grads = run((q, k, v))
    with jax.enable_x64(True):
        a64 = tuple(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v))
        want, pullback = jax.vjp(lambda *a: jnp_attention_f64(*a, jnp.asarray(vis)), *a64)
        want_grads = pullback(jnp.asarray(np.asarray(cotangent, np.float64)))
    (max_out, max_grad) = TOL["float32"]["max"]
    errors = {"out": _errors(out, np.asarray(want))}
    errors.update({n: _errors(g, np.asarray(w)) for n, g, w in zip("qkv", grads, want_grads)})
    bad = {n: e for n, e in errors.items() if e[0] > (max_out if n == "out" else max_grad)}
    assert not bad, f"{kernel_name} {type(shard).__name__}: (max, norm) errors {errors}"
