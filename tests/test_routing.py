"""Routing conformance: the kernel the selector picks for a call can run that call.

Crashes found by audits shared one cause: a kernel accepted a call at plan time (its
`decline_reason`) that it could not run. Here a fixed sample of feature sets (masks with and
without arrays and closures, score terms, per-call data, `jax.vmap`, each sharding) is
planned for ``"cpu"``, ``"gpu"`` and ``"tpu"`` (a platform this host lacks is judged as if it
were there), and the kernel each plan picks runs in its CPU form:

- `XlaBlockSparse` and `DenseReference` as they are;
- `SplashBlockSparse` and `PallasTpuBlockSparse` interpreted (a plan for ``"tpu"`` runs them so
  off a TPU);
- `CudnnDense`: its `jax.nn.dot_product_attention(implementation="cudnn")` call, forward and
  gradients, lowered for CUDA (JAX's own checks of the call, with cuDNN taken as 9.10 on a
  Hopper GPU), and run with the same options by jax.nn's XLA implementation;
- `MosaicBlockSparse`: forward and gradients lowered for CUDA (three Mosaic GPU launches). Its
  numbers are not checked here: through the module, Pallas' CPU interpreter for Mosaic GPU
  ran the forward (21 s for one small call) but a jitted forward and backward did not finish
  in 15 minutes (jax 0.10.2); tests/kernels/mosaic run the launches in it one by one;
- `TritonBlockSparse`: run in Triton's interpreter where it is installed; where jax-triton is
  missing the call is planned again as if it were there, and a plan that picks Triton must
  build (its tiling and compiled mask). Its launches then do not run: a gap, not a pass.

Every run must match the float32 `DenseReference` on the same inputs, forward and every
gradient (q, k, v, bias, sinks and the score's learned arrays); or the selector must have
declined the kernel; or the call is refused in one line whatever the kernel (traced with the
reference kernel it is refused alike: a score function reading the batch index under
`jax.vmap`, score `params` under RingAttention). Failures open elsewhere are strict xfails
(`KNOWN_SHARDED`), so that each flips when fixed. The sample is fixed (no randomness in what is
drawn); the default tier takes a few routes, `--extended` the products. Calls with a sharding
run in a child process with two virtual CPU devices, as tests/test_sharding.py does.

The element-map bound under `jax.vmap` and the selector's answer for a platform this machine
lacks (`select_kernel(..., platform="gpu")` on a CPU) are tested at the end.
"""

import contextlib
import dataclasses
import itertools
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
import eqx_bsattn._layout as layout_internals
from eqx_bsattn import masks, scores
from eqx_bsattn import sharding as shardings
from eqx_bsattn._module import run_plan
from eqx_bsattn.strategies.kernels import cudnn as cudnn_module
from eqx_bsattn.strategies.kernels.triton import kernel as triton_kernel
from tests.conftest import rel_err, sorted_segments, widths_by_head, widths_by_key

_CHILD = "EQX_BSATTN_ROUTING_CHILD"
_DEVICES = 2
PLATFORMS = ("cpu", "gpu", "tpu")
BATCH, HEADS, DIM = 2, 2, 64

# ---------------------------------------------------------------------------------------------
# The features a call can have.


def every_other_causal(q, k):
    return (k <= q) & ((q - k) % 2 == 0)


#: An array the predicate and score function below close over (a constant of their identity).
_CLOSED = jnp.asarray([3, 5], jnp.int32)
_CLOSED_SCALE = jnp.asarray([1.0, 0.5], jnp.float32)


def skips_by_closed_array(q, k):
    """Causal, less the keys at distance 1 (mod a closed-over array's entry)."""
    return (k <= q) & ((q - k) % _CLOSED[1] != 1)


def distance_and_scale(s, head, q, k):
    """Not additive: its gradient in the logits is not one."""
    return s * (1.0 + 0.25 * head) - 0.1 * jnp.sqrt(jnp.abs(q - k).astype(jnp.float32))


def scaled_by_closed_array(s, head, q, k):
    return s * _CLOSED_SCALE[head] - 0.01 * (q - k).astype(jnp.float32)


def scaled_by_params(s, head, q, k, params):
    """Learned: a factor per head, and a shift per head of every third key (a shift of whole
    rows would have no gradient)."""
    return s * params["w"][head] + params["b"][head] * (k % 3 == 0)


def shifted_by_batch(s, head, q, k, batch):
    """Reads the batch index: each example's logits shifted apart."""
    return s + 0.5 * batch.astype(jnp.float32) * (k % 3 == 0)


def make_mask(name: str, q_len: int, kv_len: int):
    if name == "causal":
        return masks.Causal()
    if name == "window":
        return masks.Causal() & masks.SlidingWindow(24, 0)
    if name == "document":
        return masks.Causal() & masks.Document()
    if name == "predicate":
        return masks.Predicate(every_other_causal)
    if name == "predicate_params":
        return masks.Predicate(widths_by_head, jnp.asarray([20, 70], jnp.int32))
    if name == "predicate_closure":
        return masks.Predicate(skips_by_closed_array)
    if name == "array":
        keep = np.random.default_rng(5).random((HEADS, q_len, kv_len)) < 0.35
        return masks.ArrayMask(keep)
    if name == "algebra":
        return ((masks.Causal() & ~masks.SlidingWindow(6, 0)) | masks.GlobalTokens(4)
                | (masks.Dilated(3) & masks.SlidingWindow(40)))
    if name == "per_head":
        return masks.PerHead([masks.Causal() & masks.SlidingWindow(16, 0),
                              masks.Causal() & masks.Dilated(2)])
    raise KeyError(name)


def make_score(name: str | None, rng: np.random.Generator):
    if name is None:
        return None
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    if name == "alibi":
        return scores.ALiBi()
    if name == "alibi_learned":
        return scores.ALiBi(0.1 * normal(HEADS), learned=True)
    if name == "relative":
        return scores.RelativePositionBias(0.3 * normal(HEADS, 8), max_distance=20)
    if name == "function":
        return scores.ScoreFunction(distance_and_scale)
    if name == "function_closure":
        return scores.ScoreFunction(scaled_by_closed_array)
    if name == "function_params":
        return scores.ScoreFunction(scaled_by_params, {"w": 1.0 + 0.2 * normal(HEADS),
                                                       "b": 0.1 * normal(HEADS)})
    if name == "function_batch":
        return scores.ScoreFunction(shifted_by_batch)
    raise KeyError(name)


MASKS = ("causal", "window", "document", "predicate", "predicate_params", "predicate_closure",
         "array", "algebra", "per_head")
SCORES = (None, "alibi", "alibi_learned", "relative", "function", "function_closure",
          "function_params", "function_batch")
#: Per-call data: positions, segment ids (documents with padding), a bias, sinks; the module's
#: soft cap; "vmap": the call mapped over the batch with `jax.vmap` (each example unbatched).
DATA = ((), ("positions",), ("segments",), ("bias",), ("sinks", "soft_cap"), ("vmap",),
        ("positions", "segments"), ("vmap", "positions"))
SHARDINGS = ("unsharded", "shard_map", "ring", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Route:
    """One call: a mask, a score term, per-call data, a dtype and a sharding."""

    mask: str
    score: str | None = None
    data: tuple[str, ...] = ()
    dtype: str = "bfloat16"
    sharding: str = "unsharded"
    kv_heads: int = 1
    q_len: int = 128
    kv_len: int = 128

    @property
    def id(self) -> str:
        parts = [self.mask, self.score or "no_score", "+".join(self.data) or "no_data",
                 self.dtype]
        if self.sharding != "unsharded":
            parts.append(self.sharding)
        if self.kv_heads != 1:
            parts.append(f"hkv{self.kv_heads}")
        if (self.q_len, self.kv_len) != (128, 128):
            parts.append(f"{self.q_len}x{self.kv_len}")
        return "-".join(parts)

    @property
    def data_items(self) -> set[str]:
        # `Document` reads segment ids: a call with it passes them.
        return set(self.data) | ({"segments"} if self.mask == "document" else set())


# ---------------------------------------------------------------------------------------------
# Building and running a call.


@dataclasses.dataclass
class Call:
    """A route's module (automatic kernel), its differentiable arguments, its fixed per-call
    data and a cotangent."""

    attn: bsa.BlockSparseAttention
    args: dict  # q, k, v, and bias, sinks, the score's arrays where present
    data: dict  # positions and segment ids (int32)
    cotangent: jax.Array
    vmapped: bool


def _mesh(route: Route):
    if route.sharding == "unsharded":
        return None
    devices = np.asarray(jax.devices()[:_DEVICES])
    axis = "b" if route.sharding == "shard_map" else "s"
    return jax.sharding.Mesh(devices, (axis,),
                             axis_types=(jax.sharding.AxisType.Auto,))


def _sharding(route: Route):
    mesh = _mesh(route)
    if mesh is None:
        return bsa.Unsharded()
    if route.sharding == "shard_map":
        return shardings.ShardMap(mesh, batch_axis="b")
    if route.sharding == "ring":
        return shardings.RingAttention(mesh, "s")
    return shardings.AllToAll(mesh, "s")


def build(route: Route, seed: int = 0) -> Call:
    rng = np.random.default_rng(seed)
    lq, lk = route.q_len, route.kv_len
    dtype = jnp.dtype(route.dtype)
    normal = lambda *shape: jnp.asarray(  # noqa: E731
        rng.standard_normal(shape).astype(np.float32).astype(dtype))
    args = {"q": normal(BATCH, HEADS, lq, DIM), "k": normal(BATCH, route.kv_heads, lk, DIM),
            "v": normal(BATCH, route.kv_heads, lk, DIM)}
    items = route.data_items
    if "bias" in items:
        args["bias"] = jnp.asarray(rng.standard_normal((BATCH, 1, lq, lk)), jnp.float32)
    if "sinks" in items:
        args["sinks"] = jnp.asarray(rng.standard_normal((HEADS,)), jnp.float32)
    data = {}
    if "segments" in items:
        q_ids = sorted_segments(rng, BATCH, lq, 3, pad=5)
        kv_ids = q_ids if lq == lk else sorted_segments(rng, BATCH, lk, 3, pad=5)
        data.update(q_segment_ids=jnp.asarray(q_ids), kv_segment_ids=jnp.asarray(kv_ids))
    if "positions" in items:
        # Shifted and spread: partial blocks differ from the token indices' ones.
        qp = np.stack([np.arange(lq) * 2 + 40, np.arange(lq) + 3])
        kp = np.stack([np.arange(lk) * 2 + 35, np.arange(lk)])
        data.update(q_positions=jnp.asarray(qp, jnp.int32),
                    kv_positions=jnp.asarray(kp, jnp.int32))
    score = make_score(route.score, rng)
    if score is not None:
        arrays, _ = eqx.partition(score, eqx.is_inexact_array)
        if jax.tree.leaves(arrays):
            args["score"] = arrays
    attn = bsa.BlockSparseAttention(
        mask=make_mask(route.mask, lq, lk), score=score, sharding=_sharding(route),
        logits_soft_cap=5.0 if "soft_cap" in items else None)
    cotangent = normal(BATCH, HEADS, lq, DIM)
    return Call(attn, args, data, cotangent, "vmap" in items)


def _with_score(attn, args):
    if "score" not in args:
        return attn
    _, static = eqx.partition(attn.score, eqx.is_inexact_array)
    return eqx.tree_at(lambda m: m.score, attn, eqx.combine(args["score"], static))


def _planned(attn, platform):
    """``f(q, k, v, **data)``: `attn`'s call planned for `platform` (``None``: this host's,
    the module's own `__call__`)."""
    if platform is None:
        return attn

    def call(q, k, v, **data):
        plan = attn.plan(q, k, v, platform=platform, **data)
        return run_plan(plan, q, k, v, attn.sharding, attn.logits_soft_cap, False)

    return call


def forward(call: Call, attn, platform):
    """``f(args) -> out`` of the call through `attn`, planned for `platform`; mapped over the
    batch for a `vmap` route."""
    data = call.data

    def f(args):
        fn = _planned(_with_score(attn, args), platform)
        extra = {n: args[n] for n in ("bias", "sinks") if n in args}
        if not call.vmapped:
            return fn(args["q"], args["k"], args["v"], **extra, **data)
        sinks = extra.pop("sinks", None)

        def one(q, k, v, extra, data):
            return fn(q, k, v, **extra, **data, **({} if sinks is None else {"sinks": sinks}))

        return jax.vmap(one)(args["q"], args["k"], args["v"], extra, data)

    return f


def value_and_grads(f, args, cotangent):
    @jax.jit
    def run(args, ct):
        out, pullback = jax.vjp(f, args)
        return out, pullback(ct)[0]

    return run(args, cotangent)


def reference(call: Call):
    """The float32 `DenseReference` on the call's inputs (upcast), unsharded and batched."""
    attn = eqx.tree_at(lambda m: (m.kernel, m.sharding), call.attn,
                       (bsa.kernels.DenseReference(), bsa.Unsharded()))
    args = jax.tree.map(lambda x: x.astype(jnp.float32), call.args)
    plain = dataclasses.replace(call, vmapped=False)
    with jax.default_matmul_precision("highest"):
        return value_and_grads(forward(plain, attn, None), args,
                               call.cotangent.astype(jnp.float32))


#: Maximum absolute error over the largest expected magnitude: output, gradients.
TOL = {"float32": (1e-4, 2e-4), "bfloat16": (2e-2, 4e-2)}


def assert_matches(got, want, dtype: str, what: str):
    out, grads = got
    want_out, want_grads = want
    tol_out, tol_grad = TOL[dtype]
    errors = {"out": rel_err(jnp.asarray(out, jnp.float32), want_out)}
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(want_grads),
                          jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        errors["d" + jax.tree_util.keystr(path[0])] = rel_err(jnp.asarray(g, jnp.float32), w)
    bad = {n: e for n, e in errors.items() if e > (tol_out if n == "out" else tol_grad)}
    assert not bad, f"{what}: relative errors over the {dtype} tolerance: {errors}"


# ---------------------------------------------------------------------------------------------
# The CPU forms of the GPU kernels.


@contextlib.contextmanager
def _patched(*triples):
    """Set ``(owner, name, value)`` attributes for the block, then restore them."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in triples]
    try:
        for owner, name, value in triples:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _cudnn_as_xla(q, k, v, **options):
    """`cudnn_module.nn_attention` with jax.nn's XLA implementation: the same options (the
    mask as `is_causal` / `local_window_size`) computed on the CPU."""
    options["implementation"] = "xla"
    return _NN_ATTENTION(q, k, v, **options)


_NN_ATTENTION = cudnn_module.nn_attention


def _lowered_for_cuda(f, args, cotangent):
    """The text of `f`'s forward and gradients (of a random projection) lowered for CUDA."""
    def both(args, ct):
        out, pullback = jax.vjp(f, args)
        return out, pullback(ct)[0]

    return jax.jit(both).trace(args, cotangent).lower(lowering_platforms=("cuda",)).as_text()


def _cudnn_checks_pass():
    """JAX's cuDNN attention checks as on a Hopper GPU with cuDNN 9.10."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    return _patched((fused, "check_cudnn_version", lambda: 91000),
                    (fused, "check_compute_capability", lambda capability: True))


def _mosaic_module():
    from eqx_bsattn.strategies.kernels.mosaic import kernel

    return kernel


def _hopper_host():
    """This host as a Hopper GPU's for Mosaic's planning and lowering."""
    kernel = _mosaic_module()
    return _patched((kernel, "_mosaic_missing", lambda: None),
                    (kernel, "_multiprocessors", lambda: 132),
                    (layout_internals.eqx, "error_if", lambda x, *_, **__: x))


def _triton_available() -> bool:
    return triton_kernel._jax_triton_missing() is None


# ---------------------------------------------------------------------------------------------
# The check.


def plan_for(call: Call, platform: str):
    """The module's plan of the call for `platform` (under `jax.vmap` for a `vmap` route:
    one example's call, as the mapped call plans it)."""
    attn = _with_score(call.attn, call.args)
    args = call.args
    extra = {n: args[n] for n in ("bias", "sinks") if n in args}
    if not call.vmapped:
        return attn.plan(args["q"], args["k"], args["v"], platform=platform, **extra,
                         **call.data)
    sinks = extra.pop("sinks", None)
    seen = []

    def one(q, k, v, extra, data):
        seen.append(attn.plan(q, k, v, platform=platform, **extra, **data,
                              **({} if sinks is None else {"sinks": sinks})))
        return q

    jax.eval_shape(jax.vmap(one), args["q"], args["k"], args["v"], extra, call.data)
    return seen[0]


def _refusal(call: Call, platform: str) -> Exception | None:
    """The one-line `ValueError` or `TypeError` with which the call, traced (not run) with
    the reference kernel, which takes every mask and feature, is refused: a refusal that no
    kernel could avoid (by the plan, or by a sharding). Any other error is the kernel's to
    show: ``None``."""
    dense = eqx.tree_at(lambda m: m.kernel, call.attn, bsa.kernels.DenseReference())
    try:
        jax.eval_shape(forward(call, dense, platform), call.args)
    except (ValueError, TypeError) as e:
        if type(e) in (ValueError, TypeError) and "\n" not in str(e):
            return e
    return None


_REFERENCES: dict = {}


def reference_of(route: Route):
    """`reference` of the route's call, computed once per process."""
    if route not in _REFERENCES:
        _REFERENCES[route] = reference(build(route))
    return _REFERENCES[route]


def check_route(route: Route, platform: str):
    """Plan `route` for `platform` and run the chosen kernel in its CPU form against the
    float32 reference. A kernel the plan for ``"cpu"`` picks too runs in that case only."""
    call = build(route)
    refusal = _refusal(call, platform)
    if refusal is not None:
        # Refused whatever the kernel (the reference is refused too): the documented answer,
        # given in one line to the automatic choice as well.
        with pytest.raises(type(refusal)) as info:
            jax.eval_shape(forward(call, call.attn, platform), call.args)
        assert str(info.value) == str(refusal)
        return "refused"
    plan = plan_for(call, platform)
    kernel = plan.kernel
    if platform == "gpu" and not _triton_available():
        # What a GPU with jax-triton would pick: a plan that picks Triton must build.
        with _patched((triton_kernel, "_jax_triton_missing", lambda: None)):
            plan_for(call, "gpu")
    if platform != "cpu" and plan_for(call, "cpu").kernel.name == kernel.name:
        return kernel.name
    what = f"{route.id} planned for {platform}: {kernel.name}"
    f = forward(call, call.attn, platform)
    if kernel.name == "cudnn":
        with _cudnn_checks_pass():
            text = _lowered_for_cuda(f, call.args, call.cotangent)
        assert "__cudnn$fmha" in text, what
        with _patched((cudnn_module, "nn_attention", _cudnn_as_xla)):
            got = value_and_grads(f, call.args, call.cotangent)
    elif kernel.name == "mosaic":
        with _hopper_host():
            # Per-call data as constants: a traced position's range check is a host callback,
            # which JAX cannot lower for another platform.
            constants = {n: np.asarray(x) for n, x in call.data.items()}
            g = forward(dataclasses.replace(call, data=constants), call.attn, platform)
            text = _lowered_for_cuda(g, call.args, call.cotangent)
        assert text.count("custom_call @mosaic_gpu") == 3, what
        return kernel.name
    elif kernel.name == "triton" and "cpu" not in kernel.platforms:
        return kernel.name  # a GPU's: tests/kernels/triton run it there
    else:
        got = value_and_grads(f, call.args, call.cotangent)
    assert_matches(got, reference_of(route), route.dtype, what)
    return kernel.name


# ---------------------------------------------------------------------------------------------
# The sample.


def _product_sample() -> list[Route]:
    """Every mask with every score term, the per-call data, dtype, kv heads and lengths
    turning with them (fixed: no draw)."""
    routes = []
    for i, (mask, score) in enumerate(itertools.product(MASKS, SCORES)):
        data = DATA[(i + i // len(SCORES)) % len(DATA)]
        lengths = dict(q_len=96, kv_len=160) if i % 7 == 5 else {}
        routes.append(Route(mask, score, data, "float32" if i % 4 == 3 else "bfloat16",
                            kv_heads=2 if i % 3 == 1 else 1, **lengths))
    return routes


def _sharded_sample() -> list[Route]:
    """Each sharding with every mask, score terms and per-call data (no `vmap`) turning."""
    data = [d for d in DATA if "vmap" not in d]
    return [Route(mask, SCORES[(3 * i + j) % len(SCORES)], data[(i + 2 * j) % len(data)],
                  "float32" if (i + j) % 4 == 3 else "bfloat16", sharding=sharding)
            for j, sharding in enumerate(SHARDINGS[1:]) for i, mask in enumerate(MASKS)]


#: The default tier: the routes to the kernels that decline (cuDNN, Mosaic, Splash, Pallas
#: TPU) through masks with arrays, score terms with learned arrays or closures, per-call data,
#: `vmap` and each sharding, on the platforms given (the others, and the product samples, are
#: the extended tier: about a minute here). Pallas TPU's interpreter with a relative-position
#: table takes half a minute, so the table runs there in the extended tier only.
DEFAULT = {
    Route("window"): ("gpu", "tpu"),
    Route("predicate_params", "alibi_learned", ("positions", "segments")): ("gpu", "tpu"),
    Route("array", "alibi", ("vmap", "positions"), kv_heads=2): PLATFORMS,
    Route("document", "function_batch", ("vmap",)): PLATFORMS,
    Route("causal", "function_closure", ("vmap", "positions")): ("gpu", "tpu"),
}
#: The default tier's pairs that are the full tier (`slow`): the quick tier plans each of
#: its routes for one platform (a mask without arrays for a GPU, arrays under `vmap` on the
#: CPU, learned ALiBi with per-call data for a TPU, a closure for a GPU, a batch-reading
#: score for each).
DEFAULT_SLOW = {(Route("window"), "tpu"),
                (Route("predicate_params", "alibi_learned", ("positions", "segments")), "gpu"),
                (Route("array", "alibi", ("vmap", "positions"), kv_heads=2), "gpu"),
                (Route("array", "alibi", ("vmap", "positions"), kv_heads=2), "tpu"),
                (Route("causal", "function_closure", ("vmap", "positions")), "tpu")}
DEFAULT_SHARDED = {
    Route("document", "alibi", (), sharding="ring"): ("gpu", "tpu"),
    Route("predicate", None, ("segments",), sharding="shard_map"): PLATFORMS,
    Route("window", "relative", ("positions",), "float32", sharding="all_to_all",
          kv_heads=2): ("gpu", "tpu"),
}


#: The sharded routes that fail today, by cause (`known_failure`): each found by this test.
KNOWN_SHARDED: dict = {}


def known_failure(route: Route, platform: str) -> str | None:
    """Why `route` fails on `platform` today for a reason open elsewhere (`KNOWN_SHARDED`),
    or ``None``. Strict xfails: each flips when fixed."""
    return KNOWN_SHARDED.get((route.id, platform))


def _params(routes: dict, sample: list) -> list:
    """`(route, platform)` pairs: those of `routes` in the default tier, every other pair of
    `routes` and `sample` in the extended tier."""
    out = []
    for route in list(routes) + [r for r in sample if r not in routes]:
        for platform in PLATFORMS:
            marks = ([pytest.mark.slow] if (route, platform) in DEFAULT_SLOW else []
                     ) if platform in routes.get(route, ()) else [pytest.mark.extended]
            why = known_failure(route, platform)
            if why is not None:
                marks.append(pytest.mark.xfail(strict=True, reason=why))
            out.append(pytest.param(route, platform, marks=marks, id=f"{route.id}-{platform}"))
    return out


# ---------------------------------------------------------------------------------------------
# Asking about a platform this machine lacks (issue 66, item 7).


def _gpu_features(**kw):
    return bsa.Features(platform="gpu", dtype="bfloat16", batch=2, num_heads=2, num_kv_heads=2,
                        q_len=512, kv_len=512, head_dim=64, value_dim=64, **kw)


#: Calls Mosaic takes on a Hopper GPU and cuDNN does not: per-call positions with a window,
#: a predicate that reads an array (its element map), a predicate it traces on its tiles.
_MOSAIC_CALLS = [
    (masks.Causal() & masks.SlidingWindow(64, 0), dict(positions=True)),
    (masks.Predicate(widths_by_head, jnp.asarray([20, 70], jnp.int32)), {}),
    (masks.Predicate(every_other_causal), dict(segment_ids=True)),
]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="asks about a GPU from a CPU")
@pytest.mark.parametrize("index", range(len(_MOSAIC_CALLS)))
def test_asking_about_a_gpu_from_a_cpu_judges_every_kernel_as_on_a_gpu(index):
    """`select_kernel(..., platform="gpu")` on a machine without a GPU gives the answer a
    Hopper GPU would (Mosaic, not XLA, for masks Mosaic takes), and says once, in
    `explain()`, that this machine has no GPU."""
    mask, extra = _MOSAIC_CALLS[index]
    features = _gpu_features(**extra)
    here = bsa.select_kernel(mask, "gpu", features)
    with _hopper_host():  # a Hopper GPU's answer
        there = bsa.select_kernel(mask, "gpu", features)
    assert here.kernel.name == there.kernel.name == "mosaic", here.explain()
    assert here.declined == there.declined
    text = here.explain()
    assert here.absent and text.count("this machine has no gpu device") == 1, text
    assert "each kernel was judged as if one were present" in text
    assert "no GPU is visible" not in text
    # The module's plan says the same.
    call = build(Route("window", data=("positions",)))
    plan = plan_for(call, "gpu")
    assert plan.kernel.name == "mosaic" and str(plan).count("has no gpu device") == 1


def test_asking_about_this_machines_platform_says_nothing_of_absence():
    from eqx_bsattn._selector import platform_absent

    choice = bsa.select_kernel(masks.Causal(), bsa.default_platform())
    assert choice.absent == "" and "device" not in choice.explain()
    # Nor about a platform that only a kernel names (JAX has no device kind of that name).
    assert platform_absent("test-platform") == ""
    assert platform_absent("cpu") == ""


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="asks about a GPU from a CPU")
def test_no_kernel_error_for_an_absent_platform_says_so():
    with pytest.raises(bsa.NoKernelError) as info:
        bsa.select_kernel(masks.Causal(), "gpu", _gpu_features(),
                          candidates=[bsa.kernels.SplashBlockSparse()])
    assert str(info.value).endswith("(this machine has no gpu device: each kernel was judged "
                                    "as if one were present, and the choice runs only on a "
                                    "gpu)")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="runs a GPU plan on a CPU")
def test_running_a_gpu_plan_on_a_cpu_fails_in_one_line():
    """A plan for ``platform="gpu"`` that picks Mosaic, run on this CPU host, refuses in one
    line before anything reaches Mosaic GPU; `blocksparse_attention(platform="gpu")` refuses
    before planning."""
    call = build(Route("window", data=("positions",)))
    f = forward(call, call.attn, "gpu")
    assert plan_for(call, "gpu").kernel.name == "mosaic"
    with pytest.raises(ValueError) as info:
        f(call.args)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith("MosaicBlockSparse cannot run on this machine: no GPU is "
                              "visible to JAX; a plan for platform='gpu' runs on a Hopper GPU")
    q, k, v = (call.args[n] for n in "qkv")
    with pytest.raises(ValueError, match=r"^`platform='gpu'`: JAX finds no gpu device here"):
        bsa.blocksparse_attention(q, k, v, platform="gpu")
    # cuDNN's plan for a GPU, run here: JAX's one-line refusal.
    window = build(Route("window"))
    assert plan_for(window, "gpu").kernel.name == "cudnn"
    with pytest.raises(RuntimeError, match=r"^cuDNN is not detected\.$"):
        forward(window, window.attn, "gpu")(window.args)


# ---------------------------------------------------------------------------------------------
# The element-map bound counts what a call under `jax.vmap` builds.


def _map_bytes_under_vmap(attn, args, data, mask_array=None):
    """``(counted, built)`` for a call planned under `jax.vmap` over the batch of `args`:
    the bytes `CompiledMask.element_map_bytes` counts for one element map (1 byte an
    element), and the bytes of the map the call builds. `data` (per-call positions) are
    mapped when they have a batch axis, and so is `mask_array` (one mask per example, as
    `blocksparse_attention(attention_mask=...)` maps it) where given."""
    seen = {}

    def one(q, k, v, data, mask_array):
        module = attn if mask_array is None else eqx.tree_at(
            lambda m: m.mask, attn, masks.ArrayMask(mask_array))
        plan = module.plan(q, k, v, platform="cpu", **data)
        compiled = plan.mask
        seen["counted"] = compiled.element_map_bytes(plan.features.batch,
                                                     plan.features.positions, copies=1)
        return compiled.element_map(plan.inputs, compiled.q_len, compiled.kv_len)

    mapped = any(x.ndim == 2 for x in data.values()) or mask_array is not None
    in_axes = (0, 0, 0, {n: 0 if x.ndim == 2 else None for n, x in data.items()},
               None if mask_array is None else 0)
    # Out axes None where nothing that shapes the map is mapped: the map must be built once.
    built = jax.eval_shape(jax.vmap(one, in_axes=in_axes, out_axes=0 if mapped else None),
                           args["q"], args["k"], args["v"], data, mask_array)
    return seen["counted"], int(np.prod(built.shape)) * built.dtype.itemsize


@pytest.mark.parametrize("case", ["positions", "positions_unmapped", "mask_array"])
def test_element_map_bound_counts_the_maps_vmap_builds(case):
    """Under `jax.vmap` a call is planned with batch 1, but an element map built from mapped
    positions (or a mapped mask array) is built for every example: the bound counts each,
    and counts one where nothing that shapes the map is mapped."""
    call = build(Route("predicate_params", data=("positions",)))
    attn, data, mask_array = call.attn, dict(call.data), None
    if case == "positions_unmapped":
        data = {n: x[0] for n, x in data.items()}
    if case == "mask_array":
        keep = np.random.default_rng(1).random((BATCH, HEADS, 128, 128)) < 0.4
        attn, data, mask_array = call.attn, {}, jnp.asarray(keep)
    counted, built = _map_bytes_under_vmap(attn, call.args, data, mask_array)
    examples = 1 if case == "positions_unmapped" else BATCH
    assert built == examples * HEADS * 128 * 128
    assert counted == built


def test_mapped_examples_are_read_through_grad():
    """`CompiledMask.mapped` of a call differentiated under `jax.vmap` (`vmap(grad(...))`):
    the batch the positions are mapped over; 1 when the `vmap` does not map them."""
    call = build(Route("predicate_params", data=("positions",)))
    k, v, kv_positions = call.args["k"][0], call.args["v"][0], call.data["kv_positions"][0]
    seen = []

    def loss(q, q_positions):
        plan = call.attn.plan(q, k, v, q_positions=q_positions, kv_positions=kv_positions,
                              platform="cpu")
        seen.append(plan.mask.mapped)
        return jnp.sum(q.astype(jnp.float32))

    jax.eval_shape(jax.vmap(jax.grad(loss)), call.args["q"], call.data["q_positions"])
    jax.eval_shape(jax.vmap(jax.grad(loss), in_axes=(0, None)), call.args["q"],
                   call.data["q_positions"][0])
    assert seen == [BATCH, 1]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="plans as on a CPU host")
def test_mosaic_declines_an_element_map_that_vmap_makes_too_large():
    """Per-call positions at 20480 tokens, two heads, a mask whose widths are read at the
    keys: one example's element maps (and their transposes) take 3.1 GiB, under the 4 GiB
    bound; mapped over a batch of two by `jax.vmap` the call builds 6.2 GiB, and Mosaic
    declines it (XLA takes the call). Widths read at the head alone Mosaic reads in-kernel,
    with no map: it takes that vmapped call."""
    length = 20480
    widths = jnp.asarray([40, 90], jnp.int32)
    qkv = [jax.ShapeDtypeStruct((BATCH, HEADS, length, DIM), jnp.bfloat16)] * 3
    positions = [jax.ShapeDtypeStruct((BATCH, length), jnp.int32)] * 2
    choices = []

    def plan_of(fn):
        attn = bsa.BlockSparseAttention(mask=masks.Predicate(fn, widths))

        def one(q, k, v, qp, kp):
            choices.append(attn.plan(q, k, v, q_positions=qp, kv_positions=kp,
                                     platform="gpu").choice)
            return q

        return one

    by_key = plan_of(widths_by_key)
    jax.eval_shape(by_key, *(jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
                             for x in qkv + positions))
    assert choices[-1].kernel.name == "mosaic", choices[-1].explain()
    jax.eval_shape(jax.vmap(by_key), *qkv, *positions)
    assert choices[-1].kernel.name == "xla", choices[-1].explain()
    assert ("mosaic", "the mask's element predicate reads an array; its element map would "
            "take 6.2 GiB per call (at most 4 GiB).") in choices[-1].declined
    jax.eval_shape(jax.vmap(plan_of(widths_by_head)), *qkv, *positions)
    assert choices[-1].kernel.name == "mosaic", choices[-1].explain()


def run_child(extended: bool):
    """Run this file's sharded routes (the default tier's, or the extended tier's) in a child
    process with two virtual CPU devices; assert that they pass."""
    env = dict(os.environ, **{_CHILD: "1"})
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={_DEVICES}").strip()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tier = ["--extended", "-m", "extended"] if extended else ["--full"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tier,
           "-k", "test_sharded_route", os.path.abspath(__file__)]
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]


if os.environ.get(_CHILD) != "1":

    @pytest.mark.parametrize("route, platform", _params(DEFAULT, _product_sample()))
    def test_route(route, platform):
        """The kernel the plan for `platform` picks runs the call and matches the float32
        reference, forward and every gradient."""
        check_route(route, platform)

    @pytest.mark.slow  # a child process on two virtual devices
    def test_sharded_routes_on_two_devices():
        run_child(extended=False)

    @pytest.mark.slow
    @pytest.mark.extended
    def test_sharded_routes_on_two_devices_extended():
        run_child(extended=True)

else:
    assert jax.device_count() == _DEVICES, jax.devices()

    @pytest.mark.parametrize("route, platform",
                             _params(DEFAULT_SHARDED, _sharded_sample()))
    def test_sharded_route(route, platform):
        check_route(route, platform)


def test_ring_passes_over_a_kernel_whose_least_tiles_fit_no_slicing():
    """Planned for a TPU, RingAttention's slices of 64 tokens take no 128-token tile of
    PallasTpuBlockSparse: the selector passes it over (the ring would refuse the call) and
    says why; at 128 tokens a slice it keeps it. One device, so no child process."""
    mesh = jax.make_mesh((1,), ("s",))
    attn = bsa.BlockSparseAttention(mask=masks.Causal(),
                                    sharding=bsa.sharding.RingAttention(mesh, "s"))
    short = jnp.zeros((1, 2, 64, 64), jnp.bfloat16)
    choice = attn.plan(short, short, short, platform="tpu").choice
    assert choice.kernel.name == "xla", choice.explain()
    assert ("pallas_tpu", "its least tiles [(128, 128)] divide no slicing of the sequence the "
            "ring may take (`order`='auto'; contiguous slices of 64 x 64 tokens over 1 "
            "device).") in choice.declined
    longer = jnp.zeros((1, 2, 128, 64), jnp.bfloat16)
    assert attn.plan(longer, longer, longer, platform="tpu").kernel.name == "pallas_tpu"


def test_hypothetical_features_take_the_value_dim_of_their_head_dim():
    """`Features(head_dim=128)` asks about a call with Dv = D = 128 (as most calls have it),
    so `explain()` on a CPU picks cuDNN for a plain bfloat16 causal GPU call rather than
    declining it for ``Dv != D``; an explicit `value_dim` is kept."""
    features = bsa.Features(platform="gpu", dtype="bfloat16", head_dim=128, q_len=4096,
                            kv_len=4096)
    assert features.value_dim == 128
    choice = bsa.select_kernel(masks.Causal(), "gpu", features)
    assert choice.kernel.name == "cudnn", choice.explain()
    assert bsa.Features(head_dim=128, value_dim=64).value_dim == 64
    narrow = bsa.select_kernel(masks.Causal(), "gpu", bsa.Features(
        platform="gpu", dtype="bfloat16", head_dim=128, value_dim=64, q_len=4096,
        kv_len=4096))
    assert ("cudnn", "cuDNN attention needs Dv == D.") in narrow.declined
