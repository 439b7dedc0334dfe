"""Fixtures of the Mosaic tests that run without a GPU: this host planned and lowered for as
a Hopper GPU, a spy on the launches, and the launches run in Pallas' CPU interpreter."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
import eqx_bsattn._module as module_internals
from eqx_bsattn import scores

#: The H200's multiprocessors: the persistent launches' CTAs.
H200_MULTIPROCESSORS = 132


def _mosaic_kernel():
    from eqx_bsattn.strategies.kernels.mosaic import kernel

    return kernel


@pytest.fixture
def hopper_host(monkeypatch):
    """This host as a Hopper GPU's for planning and lowering (it runs nothing)."""
    monkeypatch.setattr(module_internals, "default_platform", lambda: "gpu")
    monkeypatch.setattr(_mosaic_kernel(), "_mosaic_missing", lambda: None)
    monkeypatch.setattr(_mosaic_kernel(), "_multiprocessors", lambda: H200_MULTIPROCESSORS)


@pytest.fixture
def launches(monkeypatch):
    """A list that receives each `kernel._attend`'s ``(fcfg, bcfg, data, maps)``: the
    launches' configurations, read tables and element maps."""
    kernel = _mosaic_kernel()
    seen, real = [], kernel._attend

    def spy(fcfg, bcfg, q, k, v, slopes, data, bias, table, seg, positions, maps, *rest):
        seen.append((fcfg, bcfg, data, maps))
        return real(fcfg, bcfg, q, k, v, slopes, data, bias, table, seg, positions, maps,
                    *rest)

    monkeypatch.setattr(kernel, "_attend", spy)
    return seen


@pytest.fixture
def interpreted(hopper_host, monkeypatch):
    """`hopper_host`, and every launch of the kernel run in Pallas' CPU interpreter for
    Mosaic GPU (skipped where that interpreter is missing: it needs absl)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except Exception:  # noqa: BLE001 - the interpreter is optional
        pytest.skip("needs Pallas' Mosaic GPU interpreter")
    if jax.default_backend() != "cpu":
        pytest.skip("needs Pallas' Mosaic GPU interpreter on a CPU backend")
    kernel = _mosaic_kernel()
    monkeypatch.setattr(kernel, "_check_runnable", lambda: None)
    monkeypatch.setattr(kernel, "_multiprocessors", lambda: None)
    for name in ("forward_call", "mosaic_backward"):
        monkeypatch.setattr(kernel, name, functools.partial(
            getattr(kernel, name), interpret=InterpretGPUParams()))


@pytest.fixture(params=["interpreter", pytest.param("gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")])])
def mosaic_device(request):
    """Where a test's Mosaic launches run, one test each: Pallas' CPU interpreter
    (`interpreted`, on a CPU backend) or a Hopper GPU (on a GPU backend)."""
    if request.param == "interpreter":
        request.getfixturevalue("interpreted")
    return request.param


def relative_error(a, b) -> float:
    """``|a - b| / |b|`` in float32 (Frobenius norms); `a` must be finite."""
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    assert np.all(np.isfinite(a)), "non-finite values"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_matches_reference(got, want, q, k, v, arrays, cotangent, tolerance,
                             extras_tolerance, label):
    """`got(q, k, v, arrays)` against the reference `want` (run at the highest matmul
    precision): the output and the gradients in q, k, v within `tolerance` (relative norm),
    those in the differentiated extras `arrays` (a dict) within `extras_tolerance` (a slope's
    or a param's gradient sums dS times a distance over every pair, and each row's dS sums
    to zero, so it cancels far below its terms and keeps their rounding); rows that see no
    key are zeros, never NaN."""
    got_out, pullback = jax.vjp(got, q, k, v, arrays)
    got_grads = pullback(cotangent.astype(got_out.dtype))
    with jax.default_matmul_precision("highest"):
        want_out, pullback = jax.vjp(want, q, k, v, arrays)
        want_grads = pullback(cotangent)
    assert got_out.shape == want_out.shape == cotangent.shape, label
    errors = {"out": relative_error(got_out, want_out)}
    for name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads):
        assert g.shape == w.shape, (label, name)
        errors[name] = relative_error(g, w)
    for name in arrays:
        errors["d" + name] = relative_error(got_grads[3][name], want_grads[3][name])
    bad = {name: e for name, e in errors.items()
           if e > (extras_tolerance if name[1:] in arrays else tolerance)}
    assert not bad, f"{label}: relative errors over {tolerance} / {extras_tolerance}: {errors}"
    empty = np.asarray(jnp.abs(want_out).sum(-1) == 0)
    assert np.all(np.asarray(got_out, np.float32)[empty] == 0.0), label


def call_inputs(head_dim, value_dim, heads, kv_heads, q_len, kv_len, extras, seed=0):
    """``(q, k, v, cotangent, arrays, data)`` of one batch row in float32 for
    `call_with_extras`: `arrays` the differentiated extras named in `extras` ("slopes" per
    head, "params" per head, "bias" ``[1, H, Lq, Lk]``, "sinks" per head), `data` the segment
    ids ("segments": three documents over 200 tokens, the last 11 padding)."""
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (1, heads, q_len, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (1, kv_heads, kv_len, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (1, kv_heads, kv_len, value_dim), jnp.float32)
    cot = jax.random.normal(keys[3], (1, heads, q_len, value_dim), jnp.float32)
    arrays, data = {}, {}
    if "slopes" in extras:
        arrays["slopes"] = jnp.asarray([0.25, -0.1, 0.05, 0.15][:heads], jnp.float32)
    if "params" in extras:
        arrays["params"] = jnp.asarray([0.1, 0.2, 0.05, 0.3][:heads], jnp.float32)
    if "bias" in extras:
        arrays["bias"] = jax.random.normal(keys[4], (1, heads, q_len, kv_len), jnp.float32)
    if "sinks" in extras:
        arrays["sinks"] = jax.random.normal(jax.random.fold_in(keys[4], 1), (heads,),
                                            jnp.float32)
    if "segments" in extras:
        ids = np.repeat(np.arange(3, dtype=np.int32), [60, 90, 50])
        ids[-11:] = -1
        data = dict(q_segment_ids=jnp.asarray(ids[None]), kv_segment_ids=jnp.asarray(ids[None]))
    return q, k, v, cot, arrays, data


def call_with_extras(mask, kernel, dtype, data, function=None):
    """``f(q, k, v, arrays)``: the module's call in `dtype` with the extras of `arrays`
    (`call_inputs`: learned ALiBi slopes, `function`'s params, a bias, sinks) and `data`."""

    def f(q, k, v, arrays):
        score = None
        if "slopes" in arrays:
            score = scores.ALiBi(arrays["slopes"], learned=True)
        if "params" in arrays:
            score = scores.ScoreFunction(function, arrays["params"])
        attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel, score=score)
        return attn(*(x.astype(dtype) for x in (q, k, v)), bias=arrays.get("bias"),
                    sinks=arrays.get("sinks"), **data)

    return f


def assert_lowers_for_cuda(f, q, k, v, arrays, cotangent, launches, label):
    """`jit` of `f`'s pullback lowers for CUDA as `launches` Mosaic GPU launches, its
    gradients of the inputs' own shapes."""

    def grads(q, k, v, arrays):
        out, pullback = jax.vjp(f, q, k, v, arrays)
        assert out.shape == cotangent.shape, label
        return pullback(cotangent.astype(out.dtype))

    lowered = jax.jit(grads).trace(q, k, v, arrays).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("custom_call @mosaic_gpu") == launches, label
    shapes = [o.shape for o in jax.tree.leaves(lowered.out_info)]
    assert shapes == [x.shape for x in jax.tree.leaves((q, k, v, arrays))], label
