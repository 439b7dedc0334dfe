"""Shared helpers for the CPU test suite: random inputs, an independent float64 oracle, and the
list of kernels the conformance suite runs.

The oracle here is written from the semantics in DESIGN.md / notes/CONTRACT.md, not from the
package's code: a NumPy float64 forward (`np_attention`), a jnp float64 version for gradients
(`jnp_attention_f64`, to be called inside ``jax.enable_x64(True)``), and a dense NumPy boolean
mask evaluator (`np_mask`) that reads each built-in mask's fields.
"""

import atexit
import functools
import math
import os
import shutil
import tempfile

# The tests never read or write the user's autotune cache: a fresh, empty folder per run,
# made by the first process of the run (xdist's workers and the tests' children inherit it)
# and removed when that process ends.
if "EQX_BSATTN_CACHE_DIR" not in os.environ:
    os.environ["EQX_BSATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="eqx_bsattn_cache_")
    atexit.register(shutil.rmtree, os.environ["EQX_BSATTN_CACHE_DIR"], ignore_errors=True)

# The suite compiles thousands of small programs, and XLA's CPU backend spends most of that in
# LLVM: at -O0 it compiles them about a third faster (48 conformance cases on 2 cores: 190 s at
# the default level, 126 s at 0) while the 2^20-token runs take the same time. The programs and
# tolerances are the same; the memory tests' own processes run at the default level. The
# suite's child processes inherit it. CPU-only installs only: the flag is not per backend, and
# on an H200 (jax 0.11.2) GPU programs built at -O0 gave wrong layouts and outputs where
# per-call data builds the layout on the device (13 of 98 GPU tests failed; none at -O3).
_FAST_COMPILE = "--xla_backend_optimization_level=0"


def _accelerator_plugin_installed() -> bool:
    import importlib.metadata

    names = {(d.metadata["Name"] or "").lower().replace("_", "-")
             for d in importlib.metadata.distributions()}
    return any(n.startswith(("jax-cuda", "jax-rocm", "libtpu")) for n in names)


# Set where the suite added the flag, so that its worker and child processes (which inherit
# both) know the level is the suite's, not the user's.
_FAST_COMPILE_SET = "EQX_BSATTN_TESTS_SET_FAST_COMPILE"
if ("--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")
        and not _accelerator_plugin_installed()):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_COMPILE).strip()
    os.environ[_FAST_COMPILE_SET] = "1"


def runtime_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the suite's -O0 flag taken out of ``XLA_FLAGS``: for child processes that
    spend their time running programs rather than compiling them (the training and gallery
    notebooks, the demo at its default length), which -O0 slows many times over (the
    training notebook's step: 149 ms at the default level, 674 ms at -O0). A level the user
    set stays."""
    if env.get(_FAST_COMPILE_SET) != "1":
        return dict(env)
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f != _FAST_COMPILE)
    return {**{k: v for k, v in env.items() if k != "XLA_FLAGS"},
            **({"XLA_FLAGS": flags} if flags else {})}


if os.environ.get("EQX_BSATTN_TRITON_INTERPRET"):  # a debugging aid: benchmarks/triton_interpret.py
    import importlib.util
    import pathlib

    _path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "triton_interpret.py"
    _spec = importlib.util.spec_from_file_location("triton_interpret", _path)
    _interpret = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_interpret)
    _interpret.install(os.environ["EQX_BSATTN_TRITON_INTERPRET"])

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks

# ---------------------------------------------------------------------------------------------
# Kernels under the conformance suite: CPU kernels only (each GPU kernel has its own tests in tests/kernels/<kernel>/).

_CPU_KERNEL_NAMES = ("DenseReference", "XlaBlockSparse")
KERNELS = [name for name in _CPU_KERNEL_NAMES if hasattr(kernels, name)]


def make_kernel(name: str):
    return getattr(kernels, name)()


# ---------------------------------------------------------------------------------------------
# Random inputs.


class Inputs:
    """A bundle of random attention inputs (float32 JAX arrays) and their shapes."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


_POOL_SIZE = 1 << 18


@functools.lru_cache(maxsize=None)
def _normal_pool(seed: int) -> np.ndarray:
    """A fixed draw of `jax.random.normal` per seed; slicing it avoids one compile per shape."""
    return np.asarray(jax.random.normal(jax.random.key(seed), (_POOL_SIZE,), jnp.float32))


def random_array(seed: int, shape, dtype=jnp.float32, scale: float = 1.0):
    """Standard normal values (from `jax.random.normal`) of `shape`, times `scale`."""
    shape = tuple(shape)
    n = math.prod(shape)
    assert n <= _POOL_SIZE, shape
    x = _normal_pool(seed)[:n].reshape(shape).astype(np.float64) * scale
    return jnp.asarray(x, dtype)


def random_inputs(
    seed: int = 0,
    *,
    batch: int | None = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    q_len: int = 24,
    kv_len: int | None = None,
    dim: int = 8,
    value_dim: int | None = None,
    dtype=jnp.float32,
    scale: float = 1.0,
):
    """Random ``q, k, v`` (never zeros); ``batch=None`` gives unbatched ``[H, L, D]`` arrays.

    `scale` multiplies ``q`` and ``k`` (to make large logits).
    """
    kv_heads = heads if kv_heads is None else kv_heads
    kv_len = q_len if kv_len is None else kv_len
    value_dim = dim if value_dim is None else value_dim
    lead = () if batch is None else (batch,)
    q = random_array(3 * seed + 100_000, lead + (heads, q_len, dim), dtype, scale)
    k = random_array(3 * seed + 100_001, lead + (kv_heads, kv_len, dim), dtype, scale)
    v = random_array(3 * seed + 100_002, lead + (kv_heads, kv_len, value_dim), dtype)
    return q, k, v


def sorted_segments(rng: np.random.Generator, batch: int, length: int, num_docs: int,
                    pad: int = 0) -> np.ndarray:
    """[batch, length] int32 document ids 0, 1, ... in runs, the last `pad` tokens -1."""
    out = np.empty((batch, length), np.int32)
    body = length - pad
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, body), size=min(num_docs - 1, body - 1),
                                  replace=False)) if body > 1 and num_docs > 1 else []
        ids = np.zeros(body, np.int32)
        for c in cuts:
            ids[c:] += 1
        out[b, :body] = ids
        out[b, body:] = -1
    return out


# ---------------------------------------------------------------------------------------------
# Dense NumPy boolean masks, written from the documented semantics.


def np_mask(mask, *, q_len: int, kv_len: int, heads: int, q_pos=None, kv_pos=None,
            q_seg=None, kv_seg=None) -> np.ndarray:
    """``[heads, q_len, kv_len]`` bool visibility of `mask` for one batch element.

    `q_pos`/`kv_pos` default to token indices; `q_seg`/`kv_seg` are 1-D int arrays or None.
    """
    qp = (np.arange(q_len) if q_pos is None else np.asarray(q_pos)).astype(np.int64)[:, None]
    kp = (np.arange(kv_len) if kv_pos is None else np.asarray(kv_pos)).astype(np.int64)[None, :]
    qs = None if q_seg is None else np.asarray(q_seg).astype(np.int64)[:, None]
    ks = None if kv_seg is None else np.asarray(kv_seg).astype(np.int64)[None, :]
    shape = (q_len, kv_len)

    def table_lookup(table, bq, bk):
        table = np.asarray(table, bool)
        r, c = qp // bq, kp // bk
        inside = (r >= 0) & (r < table.shape[0]) & (c >= 0) & (c < table.shape[1])
        hit = table[np.clip(r, 0, table.shape[0] - 1), np.clip(c, 0, table.shape[1] - 1)]
        return inside & hit

    def ev(m, h) -> np.ndarray:
        if isinstance(m, masks.And):
            return ev(m.left, h) & ev(m.right, h)
        if isinstance(m, masks.Or):
            return ev(m.left, h) | ev(m.right, h)
        if isinstance(m, masks.Not):
            return ~ev(m.inner, h)
        if isinstance(m, masks.PerHead):
            return ev(m.masks[h], h)
        if isinstance(m, masks.Full):
            return np.ones(shape, bool)
        if isinstance(m, masks.Causal):
            off = m.offset + ((kv_len - q_len) if m.bottom_right else 0)
            return np.broadcast_to(kp <= qp + off, shape)
        if isinstance(m, masks.SlidingWindow):
            out = np.ones(shape, bool)
            if m.left is not None:
                out = out & (kp >= qp - m.left)
            if m.right is not None:
                out = out & (kp <= qp + m.right)
            return out
        if isinstance(m, masks.ChunkedCausal):
            c = m.chunk_size
            return np.broadcast_to((kp <= qp) & (np.floor_divide(kp, c) == np.floor_divide(qp, c)),
                                   shape)
        if isinstance(m, masks.Document):
            assert qs is not None and ks is not None
            return np.broadcast_to((qs == ks) & (qs >= 0), shape)
        if isinstance(m, masks.PrefixLM):
            return np.broadcast_to((kp < m.prefix_length) | (kp <= qp), shape)
        if isinstance(m, masks.GlobalTokens):
            return np.broadcast_to((qp < m.num_global) | (kp < m.num_global), shape)
        if isinstance(m, masks.Dilated):
            return np.broadcast_to(np.mod(qp - kp, m.stride) == 0, shape)
        if isinstance(m, masks.BlockLayoutMask):
            return np.broadcast_to(table_lookup(m.layout, *m.block_size), shape)
        if isinstance(m, masks.BigBirdRandom):
            table = np.asarray(m.table(q_len, kv_len))
            check_bigbird_table(m, table, q_len, kv_len)
            return np.broadcast_to(table_lookup(table, m.block_size, m.block_size), shape)
        if isinstance(m, masks.Predicate):
            return np.broadcast_to(np.asarray(m.fn(qp, kp), bool), shape)
        raise NotImplementedError(f"no NumPy reference for {type(m).__name__}")

    return np.stack([np.array(ev(mask, h), bool) for h in range(heads)])


def check_bigbird_table(m, table, q_len, kv_len):
    """The random table has the documented shape and per-row counts (and is causal if asked)."""
    rows, cols = math.ceil(q_len / m.block_size), math.ceil(kv_len / m.block_size)
    assert table.shape == (rows, cols)
    for r in range(rows):
        limit = min(r + 1, cols) if m.causal else cols
        assert table[r].sum() == min(m.num_random, limit)
        assert not table[r, limit:].any()


def widths_by_head(q, k, widths, head):
    """A causal window whose width per head is read from an array, ``widths[head]``: the
    `masks.Predicate` function (``params=widths``) the kernels read in-kernel per head."""
    return (k <= q) & (q - k < widths[head])


def widths_by_key(q, k, widths, head):
    """A causal window whose width is read at the keys' indices, ``widths[k % 2]``: a
    gather, which the kernels cannot read in-kernel, so a `masks.Predicate` of it reads the
    call's element map."""
    return (k <= q) & (q - k < widths[k % 2])


def np_visibility(mask, *, batch, heads, q_len, kv_len, q_pos=None, kv_pos=None, q_seg=None,
                  kv_seg=None) -> np.ndarray:
    """``[batch, heads, q_len, kv_len]`` visibility; per-call arrays are ``[batch, L]`` or None."""
    out = []
    for b in range(batch):
        pick = lambda x: None if x is None else np.asarray(x)[b]  # noqa: E731
        out.append(np_mask(mask, q_len=q_len, kv_len=kv_len, heads=heads, q_pos=pick(q_pos),
                           kv_pos=pick(kv_pos), q_seg=pick(q_seg), kv_seg=pick(kv_seg)))
    return np.stack(out)


# ---------------------------------------------------------------------------------------------
# The float64 attention oracle.


def _sinks_hs(sinks, heads, kv_heads=None):
    """Bring sinks to [H, S] by the documented rule ([H] per head, [Hkv] per kv head when
    Hkv != H, any other [S] shared, [H, S], [Hkv, S] per kv head)."""
    kv_heads = heads if kv_heads is None else kv_heads
    if sinks is None:
        return None
    sinks = np.asarray(sinks, np.float64)
    if kv_heads != heads and sinks.shape[0] == kv_heads:
        return np.repeat(sinks.reshape(kv_heads, -1), heads // kv_heads, axis=0)
    if sinks.ndim == 1 and sinks.shape[0] == heads:
        return sinks[:, None]
    if sinks.ndim == 1:
        return np.tile(sinks[None, :], (heads, 1))
    return sinks


def np_attention(q, k, v, visible, *, scale=None, bias=None, sinks=None, soft_cap=None):
    """Float64 NumPy attention with every feature.

    ``q [B, H, Lq, D]``, ``k [B, Hkv, Lk, D]``, ``v [B, Hkv, Lk, Dv]``, `visible` broadcasting
    to ``[B, H, Lq, Lk]``, `bias` broadcasting to it, `sinks` ``[S]``, ``[H]`` or ``[H, S]``.
    Rows that see no key give zeros.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, h, lq, v.shape[-1]))
    visible = np.broadcast_to(np.asarray(visible, bool), (b, h, lq, k.shape[2]))
    bias = None if bias is None else np.broadcast_to(np.asarray(bias, np.float64),
                                                     (b, h, lq, k.shape[2]))
    sinks = _sinks_hs(sinks, h, hkv)
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // hkv)
            s = scale * q[bi, hi] @ k[bi, g].T
            if bias is not None:
                s = s + bias[bi, hi]
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            for i in range(lq):
                vis = visible[bi, hi, i]
                if not vis.any():
                    continue
                logits = s[i][vis]
                extra = sinks[hi] if sinks is not None else np.zeros(0)
                mx = max(logits.max(), extra.max() if extra.size else -np.inf)
                w = np.exp(logits - mx)
                denom = w.sum() + np.exp(extra - mx).sum()
                out[bi, hi, i] = (w / denom) @ v[bi, g][vis]
    return out


def t5_bucket(distance, num_buckets: int, bidirectional: bool, max_distance: int) -> np.ndarray:
    """T5's relative-position bucket of ``distance = q_pos - k_pos`` (T5's relative position is
    ``k_pos - q_pos``), written from the formula in the T5 paper's code: exact near, logarithmic
    far, clipped. The floor is of the real number (float64 plus a hair, so that exact integers
    such as ``8 * log(2) / log(16) * 4`` do not round down)."""
    rel = -np.asarray(distance, np.int64)
    out = np.zeros_like(rel)
    n = num_buckets
    if bidirectional:
        n //= 2
        out = out + (rel > 0) * n
        rel = np.abs(rel)
    else:
        rel = np.maximum(-rel, 0)
    max_exact = n // 2
    with np.errstate(divide="ignore"):
        large = max_exact + np.floor(np.log(np.maximum(rel, 1) / max_exact)
                                     / math.log(max_distance / max_exact) * (n - max_exact)
                                     + 1e-9).astype(np.int64)
    return out + np.where(rel < max_exact, rel, np.minimum(large, n - 1))


def score_f64(s, *, q_pos, kv_pos, slopes=None, table=None, bidirectional=True,
              max_distance=128, fn=None):
    """The documented score terms on float64 logits ``s [B, H, Lq, Lk]`` (jnp, differentiable
    in `s`, `slopes` ``[H]`` and `table` ``[H, num_buckets]``). `q_pos` ``[B, Lq]`` and
    `kv_pos` ``[B, Lk]`` are NumPy positions (the token indices when the call passes none).
    ALiBi: ``s += slopes[h] * (k - q)``; table: ``s += table[h, bucket(q - k)]``; `fn`:
    ``s = fn(s, h, q, k)``, in that order."""
    qp = np.asarray(q_pos, np.int64)[:, None, :, None]
    kp = np.asarray(kv_pos, np.int64)[:, None, None, :]
    heads = s.shape[1]
    if slopes is not None:
        s = s + slopes[None, :, None, None] * jnp.asarray((kp - qp).astype(np.float64))
    if table is not None:
        bucket = t5_bucket(qp - kp, table.shape[1], bidirectional, max_distance)
        bucket = np.broadcast_to(bucket, (s.shape[0], 1) + bucket.shape[2:])
        s = s + table[np.arange(heads)[None, :, None, None], bucket]
    if fn is not None:
        head = np.arange(heads)[None, :, None, None]
        s = fn(s, jnp.asarray(head), jnp.asarray(qp), jnp.asarray(kp))
    return s


def alibi_gradient_scale(q, k, v, cot, slopes):
    """Per head, ``sum |dS (k - q)|`` over the causal pairs (token indices) of attention with
    ALiBi `slopes` ``[H]``, in float64 NumPy on the arrays as given (q and the cotangent
    `cot` ``[B, H, L, D]``, k and v ``[B, Hkv, L, D]``; round them as the kernel sees them
    first): the magnitude of the terms the slopes' gradient sums. Each row's dS sums to zero,
    so that gradient can cancel far below its terms, and a kernel's 16-bit output and P,
    rounded into dS, err in proportion to those terms."""
    q, k, v, cot = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, cot))
    heads, length, dim = q.shape[1], q.shape[2], q.shape[3]
    k, v = (np.repeat(x, heads // x.shape[1], axis=1) for x in (k, v))
    distance = (np.arange(length)[None, :] - np.arange(length)[:, None]).astype(np.float64)
    logits = (np.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(dim)
              + np.asarray(slopes, np.float64)[None, :, None, None] * distance)
    logits = np.where(distance <= 0, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = np.einsum("bhqd,bhkd->bhqk", cot, v)
    delta = (cot * np.einsum("bhqk,bhkd->bhqd", p, v)).sum(-1, keepdims=True)
    return np.abs(p * (dp - delta) * distance).sum(axis=(0, 2, 3))


def jnp_attention_f64(q, k, v, visible, *, scale=None, bias=None, sinks=None, soft_cap=None,
                      score=None):
    """The oracle in jnp (differentiable); call inside ``jax.enable_x64(True)`` with float64 arrays.

    Masked logits are replaced before the exponential and the weights zeroed after it, so no
    gradient reaches a masked pair and a fully masked row gives zeros and zero gradients.
    `score`: a function of the logits ``[B, H, Lq, Lk]`` after the bias and before the soft cap
    (`score_f64` with the call's terms).
    """
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = h // hkv
    head_of = np.arange(h) // group
    kk, vv = k[:, head_of], v[:, head_of]
    s = scale * jnp.einsum("bhid,bhjd->bhij", q, kk)
    if bias is not None:
        s = s + bias
    if score is not None:
        s = score(s)
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    vis = jnp.broadcast_to(jnp.asarray(visible), (b, h, lq, lk))
    row_max = jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1, keepdims=True)
    if sinks is not None:
        if hkv != h and sinks.shape[0] == hkv:  # per kv head
            sinks = jnp.repeat(sinks.reshape(hkv, -1), group, axis=0)
        elif sinks.ndim == 1 and sinks.shape[0] == h:
            sinks = sinks[:, None]
        elif sinks.ndim == 1:
            sinks = jnp.broadcast_to(sinks[None], (h, sinks.shape[0]))
        row_max = jnp.maximum(row_max, jnp.max(sinks, -1)[None, :, None, None])
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    w = jnp.where(vis, jnp.exp(jnp.where(vis, s - row_max, 0.0)), 0.0)
    denom = w.sum(-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sinks[None, :, None, :] - row_max).sum(-1, keepdims=True)
    any_vis = vis.any(-1, keepdims=True)
    denom = jnp.where(any_vis, denom, 1.0)
    return jnp.einsum("bhij,bhjd->bhid", w, vv) / denom


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max(max |expected|, tiny)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    assert np.all(np.isfinite(a)), "non-finite values"
    return float(np.max(np.abs(a - e), initial=0.0) / max(np.max(np.abs(e), initial=0.0), 1e-30))


def assert_close(actual, expected, tol=2e-5, what=""):
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def to_f64(x):
    return None if x is None else jnp.asarray(np.asarray(x, np.float64))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


__all__ = [
    "KERNELS", "make_kernel", "random_inputs", "random_array", "sorted_segments", "np_mask",
    "np_visibility", "np_attention", "jnp_attention_f64", "t5_bucket", "score_f64", "rel_err",
    "assert_close", "to_f64",
    "bsa", "kernels", "masks",
]


# ---------------------------------------------------------------------------------------------
# Order: the tests that run for a minute or more on one worker (measured on 2 cores, in
# seconds) start first, so that no worker ends the run alone on one of them while the others
# idle. They go longest first; every other test keeps the collection order.

LONG_TESTS = {
    "test_sharding_on_eight_devices_slow_cases": 290,
    "test_notebook_executes": 90,
    "test_demo_command_as_typed_in_a_fresh_checkout": 139,
    "test_sharding_on_eight_devices_rest": 122,
    "test_pallas_tpu_sharded_on_eight_devices": 92,
    "test_declined_cases_are_the_expected_ones": 87,
    "test_attention_gym_catalogue_lowers_through_mosaic": 82,
    "test_kernel_matches_the_oracle": 80,
    "test_all_to_all_on_eight_devices": 75,
    "test_readme_notebook_command_leaves_the_checkout_clean": 60,
    "test_readme_python_blocks_run": 61,
    "test_dynamic_layout_consistent_with_dense_mask": 61,
    "test_alibi_at_long_lengths_adds_no_memory": 61,
    "test_xla_block_sparse_matches_numpy_oracle": 53,
    "test_backward_in_cpu_interpreter": 53,
    "test_array_masks_under_both_shardings_on_eight_devices": 51,
    "test_two_processes_agree_with_the_unsharded_call": 44,
    "test_sharding_on_eight_devices": 9,
    "test_sharded_routes_on_two_devices": 36,
}


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the tests marked `slow` (the full tier, which CI runs): "
                          "the long tests and the rest of the quick tier's cross products")
    parser.addoption("--extended", action="store_true",
                     help="also run the extended tier (tests marked `extended`): the rest of "
                          "the cross products whose covering subset the full tier takes; "
                          "implies --full")
    parser.addoption("--prove-awaiting", action="store_true",
                     help="take every kernel's features awaiting a device run "
                          "(`AbstractKernel.awaiting_device_run`) as proven for this run, so "
                          "the selector, the GPU tests and the conformance suite run them: for "
                          "the proof command on a lent device (benchmarks/device_proofs.sh)")


def take_as_proven(kernel_type, *features, monkeypatch=None):
    """Take `features` of `kernel_type`'s `awaiting_device_run` (all of them where none is
    named) as proven: for one test with `monkeypatch`, else for the rest of the process."""
    import types

    left = types.MappingProxyType({name: what for name, what
                                   in kernel_type.awaiting_device_run.items()
                                   if features and name not in features})
    if monkeypatch is None:
        type.__setattr__(kernel_type, "awaiting_device_run", left)
    else:
        monkeypatch.setattr(kernel_type, "awaiting_device_run", left)


def pytest_configure(config):
    if config.getoption("--prove-awaiting"):
        import eqx_bsattn

        for kernel_type in eqx_bsattn.registered_kernels():
            if kernel_type.awaiting_device_run:
                take_as_proven(kernel_type)
    config.addinivalue_line(
        "markers", "covering(first, second): of the cross product of two parametrized "
        "arguments, the default run takes `first`'s value i with `second`'s value i mod n, "
        "so that every value of each runs; the other pairs, but those of the quick subset, "
        "are the extended tier")


def _parameter_index(item, name: str) -> tuple[int, int]:
    """``(index, count)``: where the value `item` takes for the parametrized argument `name`
    stands among the values of its `parametrize` marker that are not `extended` themselves,
    and how many such values there are."""
    value = item.callspec.params[name]
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if name not in names:
            continue
        at = names.index(name)
        entries = [e for e in mark.args[1]
                   if not any(m.name == "extended" for m in getattr(e, "marks", ()))]
        for index, entry in enumerate(entries):
            values = getattr(entry, "values", entry if len(names) > 1 else (entry,))
            if values[at] is value:
                return index, len(entries)
        return -1, len(entries)  # an extended value: its pairs are extended already
    raise ValueError(f"{item.nodeid}: covering names {name!r}, which no parametrize lists")


def _mark_covering_products(items):
    """Mark `extended` the pairs a `covering(first, second)` marker leaves out: value ``i`` of
    `first` stays in the default run with value ``i mod n`` of `second` (its ``n`` values; both
    counted among the values not marked `extended` themselves), and so do the quick subset's
    pairs (those not marked `slow`)."""
    for item in items:
        marker = item.get_closest_marker("covering")
        if marker is not None and item.get_closest_marker("slow") is not None:
            first, second = marker.args
            i, count = _parameter_index(item, first)
            j, n = _parameter_index(item, second)
            if count < n:  # then some value of `second` would never run by default
                raise ValueError(f"{item.nodeid}: covering({first!r}, {second!r}) needs at "
                                 f"least as many values of {first!r} ({count}) as of "
                                 f"{second!r} ({n})")
            if j != i % n:
                item.add_marker(pytest.mark.extended)


def pytest_collection_modifyitems(config, items):
    _mark_covering_products(items)
    extended = config.getoption("--extended")
    full = extended or config.getoption("--full")
    skip_extended = pytest.mark.skip(reason="the extended tier: python -m pytest --extended")
    skip_slow = pytest.mark.skip(reason="the full tier: python -m pytest --full")
    for item in items:
        if "extended" in item.keywords and not extended:
            item.add_marker(skip_extended)
        elif "slow" in item.keywords and not full:
            item.add_marker(skip_slow)

    def longest_first(item):
        return -LONG_TESTS.get(getattr(item, "originalname", item.name), 0)

    items.sort(key=longest_first)


def pytest_sessionfinish(session, exitstatus):
    """Make a worker's end quick and quiet. pytest ends with a full garbage collection, which
    over the suite's thousands of compiled programs can outlast the 5 s an xdist worker is
    given to stop on a loaded machine; the worker is then sent SIGINT, and a passing run
    printed the `KeyboardInterrupt` raised inside hypothesis' garbage-collection timer.
    Freezing what is alive now leaves that collection little to walk, and the timer is taken
    out of `gc.callbacks`."""
    import gc

    gc.callbacks[:] = [c for c in gc.callbacks
                       if not getattr(c, "__module__", "").startswith("hypothesis")]
    gc.freeze()
