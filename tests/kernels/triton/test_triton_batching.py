"""`TritonBlockSparse`'s vmap rule (`_batched_launch`), on the CPU: no Triton needed.

Each launch is replaced by a stand-in that reads its arrays the way the kernels do (the batch
index ``b`` of q / k / v / positions / segment ids; ``b`` or 0 for a bias or layout of
leading size 1) and returns, per batch element, sums of what it read. A vmapped launch must
give what one launch per element gives, in one launch of the folded batch.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_bsattn.contract import MaskTerms, RelativeBuckets
from eqx_bsattn.strategies.kernels.triton import launch as tr

B, H, HKV, LQ, LK, D, V = 2, 4, 2, 24, 40, 8, 3


def _per_element(x, batch):
    """``[batch]``: the sum of each batch element's slice (axis 0 of size 1 is shared)."""
    sums = x.reshape(x.shape[0], -1).astype(jnp.float32).sum(axis=1)
    return jnp.broadcast_to(sums, (batch,)) if x.shape[0] == 1 else sums


def _stand_in(calls):
    def launch(*args, kernel, out_shape, grid, num_warps=None, num_stages=None,
               zeroed_outputs=(), **meta):
        batch = args[0].shape[0]
        calls.append((kernel, batch, grid))
        assert grid[-1] == batch
        data_at = 9 if kernel == "fwd" else 8
        lists = args[13:20] if kernel == "fwd" else args[15:22]
        seen = _per_element(args[0], batch) + 3 * _per_element(args[1], batch)
        if kernel == "fwd":
            assert args[4].ndim == 2  # sinks [H, S]: no batch axis
            seen = seen + 17 * args[4].sum()
        # Score slopes [H] and table [H, NB], then the thresholds and the table's entries by
        # distance [H, REL_ND]: no batch axis.
        slopes, table, thresholds, entries = args[data_at - 4:data_at]
        if meta["REL_SPLIT"]:
            assert entries.shape == (H, meta["REL_ND"])
        if meta["HAS_ALIBI"]:
            assert slopes.shape == (H,) and table.shape == (H, meta["NB"])
            assert thresholds.shape == (meta["NT"],)
            seen = seen + 19 * slopes.sum() + 23 * table.sum()
        if meta["HAS_BIAS"]:
            assert args[3].shape[0] == meta["BB"] and meta["BB"] in (1, batch)
            seen = seen + 5 * _per_element(args[3], batch)
        for i, x in enumerate(args[data_at:data_at + 4]):
            if x.ndim > 1:
                assert x.shape[0] == batch
                seen = seen + (7 + i) * _per_element(x, batch)
        assert lists[0].shape[0] == meta["MB"] and meta["MB"] in (1, batch)
        seen = seen + 11 * _per_element(lists[0], batch) + 13 * _per_element(lists[1], batch)
        # The lists' far splits [MB, MH, n, 4] are shared or per element like the lists.
        assert lists[6].shape[0] == meta["MB"] and lists[6].shape[-1] == 4
        seen = seen + 29 * _per_element(lists[6], batch)
        outs = []
        for i, s in enumerate(out_shape):
            if len(s.shape) == 1:
                outs.append(jnp.zeros(s.shape, s.dtype))
                continue
            assert s.shape[0] == batch
            outs.append((seen * (i + 1)).reshape((batch,) + (1,) * (len(s.shape) - 1))
                        * jnp.ones(s.shape, jnp.float32))
        return tuple(o.astype(s.dtype) for o, s in zip(outs, out_shape))

    return launch


@pytest.fixture
def calls(monkeypatch):
    recorded = []
    monkeypatch.setattr(tr, "triton_call", _stand_in(recorded))
    monkeypatch.setattr(tr, "jit_kernels", lambda: types.SimpleNamespace(
        forward_kernel="fwd", dq_kernel="dq", dkdv_kernel="dkdv"))
    return recorded


def _cfg(bias_shape):
    return tr.LaunchConfig(
        batch=B, heads=H, kv_heads=HKV, q_len=LQ, kv_len=LK, head_dim=D, value_dim=D,
        dtype="float32", bias_shape=bias_shape, num_sinks=1, softmax_scale=0.3, soft_cap=0.0,
        terms=MaskTerms(causal_offset=0, segment_ids=True), has_q_positions=False,
        has_kv_positions=False, alibi=True, relative=RelativeBuckets(8, True, 20),
        fwd_blocks=(16, 16), dq_blocks=(16, 16), dkdv_blocks=(16, 16),
        fwd_launch=(4, 2), dq_launch=(4, 2), dkdv_launch=(4, 2),
        list_modes=("check", "check", "check"))


def _lists(rng, mb, n):
    counts = jnp.asarray(rng.integers(0, 3, (mb, 1, n)), jnp.int32)
    index = jnp.asarray(rng.integers(0, 3, (mb, 1, n, 3)), jnp.int32)
    splits = jnp.asarray(rng.integers(0, 3, (mb, 1, n, 4)), jnp.int32)
    return (counts, index, counts + 1, index + 1, counts + 2, jnp.zeros((1,), jnp.int8), splits)


def _stacked_lists(rng, mb, n):
    """`_lists` for each of the V mapped elements, stacked on a leading axis."""
    return jax.tree.map(lambda *x: jnp.stack(x), *(_lists(rng, mb, n) for _ in range(V)))


def _inputs(seed, list_batch, bias_batch):
    # NumPy draws: eager `jax.random` calls compile once per shape (seconds in all).
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    q = normal(V, B, H, LQ, D)
    k = normal(V, B, HKV, LK, D)
    v = normal(V, B, HKV, LK, D)
    do = normal(V, B, H, LQ, D)
    lse = normal(V, B, H, LQ)
    delta = normal(V, B, H, LQ)
    bias = normal(V, bias_batch, H, LQ, LK)
    sinks = normal(H, 1)
    score = (normal(H), normal(H, 8))
    seg = jnp.asarray(rng.integers(0, 3, (V, B, LQ)), jnp.int32)
    kseg = jnp.asarray(rng.integers(0, 3, (V, B, LK)), jnp.int32)
    dummy = jnp.zeros((1,), jnp.int32)
    data = (dummy, dummy, seg, kseg)
    lists = _stacked_lists(rng, list_batch, 2)
    t_lists = _stacked_lists(rng, list_batch, 3)
    return dict(q=q, k=k, v=v, do=do, lse=lse, delta=delta, bias=bias, sinks=sinks,
                score=score, data=data, lists=lists, t_lists=t_lists)


def _launches(cfg):
    def all_three(q, k, v, bias, sinks, score, data, lists, t_lists, do, lse, delta):
        out, lse_out = tr.forward_launch(cfg, q, k, v, bias, sinks, score, data, lists)
        dq, dbias, dslopes, dtable = tr.dq_launch(cfg, q, k, v, bias, score, data, lists, do,
                                                  lse, delta)
        dk, dv = tr.dkdv_launch(cfg, q, k, v, bias, score, data, t_lists, do, lse, delta)
        return out, lse_out, dq, dbias, dslopes, dtable, dk, dv

    return all_three


# in_axes of (q, k, v, bias, sinks, score, data, lists, t_lists, do, lse, delta) per case.
_DATA_MAPPED = (None, None, 0, 0)
_LISTS_MAPPED = (0,) * 5 + (None, 0)
_CASES = {
    "everything_mapped": (0, 0, 0, 0, None, None, _DATA_MAPPED, _LISTS_MAPPED, _LISTS_MAPPED,
                          0, 0, 0),
    "shared_kv_and_bias": (0, None, None, None, None, None, _DATA_MAPPED, _LISTS_MAPPED,
                           _LISTS_MAPPED, 0, 0, 0),
    "static_layout": (0, 0, 0, 0, None, None, (None,) * 4, None, None, 0, 0, 0),
}


_ORDER = ("q", "k", "v", "bias", "sinks", "score", "data", "lists", "t_lists", "do", "lse",
          "delta")


def _zip_map(f, tree, axes):
    """`f(leaf, axis)` over `tree`, whose structure `axes` follows (None for a whole subtree)."""
    if axes is None or isinstance(axes, int):
        return jax.tree.map(lambda x: f(x, axes), tree)
    return type(tree)(_zip_map(f, t, a) for t, a in zip(tree, axes))


def _args(x, axes):
    """The arguments for in_axes `axes`: unmapped ones are element 0 (sinks and the score
    arrays are never stacked)."""
    return tuple(x[n] if n in ("sinks", "score") else _zip_map(
        lambda a, ax: a if ax is not None or a.ndim <= 1 else a[0], x[n], ax)
        for n, ax in zip(_ORDER, axes))


def _folded(calls, batch):
    """The kernels launched with `batch` elements. (`custom_vmap` also traces each launch
    once unbatched, for its output shapes: those calls have the unmapped batch.)"""
    return sorted(kernel for kernel, b, _ in calls if b == batch)


def _element(args, axes, i):
    return _zip_map(lambda a, ax: a if ax is None else a[i], args, axes)


#: (case, bias_batch, list_batch) of the quick subset: shared and mapped operands with a
#: shared bias; the rest are `slow` (each new shape compiles anew).
_QUICK = {("shared_kv_and_bias", 1, B)}


@pytest.mark.parametrize("case,bias_batch,list_batch", [
    pytest.param(case, bb, lb, id=f"{case}-{bb}-{lb}",
                 marks=() if (case, bb, lb) in _QUICK else pytest.mark.slow)
    for case in _CASES for bb in (1, B) for lb in (1, B)])
def test_vmap_folds_the_mapped_axis_into_the_batch(calls, case, bias_batch, list_batch):
    axes = _CASES[case]
    args = _args(_inputs(0, list_batch, bias_batch), axes)
    fn = _launches(_cfg((bias_batch, H)))
    got = jax.jit(jax.vmap(fn, in_axes=axes))(*args)
    assert _folded(calls, V * B) == ["dkdv", "dq", "fwd"], calls
    calls.clear()
    for i in range(V):
        want = fn(*_element(args, axes, i))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g[i]), np.asarray(w), rtol=1e-5)
    assert {c[1] for c in calls} == {B}


@pytest.mark.slow
def test_nested_vmap_folds_twice(calls):
    axes = _CASES["everything_mapped"]
    args = _args(_inputs(1, B, 1), axes)
    fn = _launches(_cfg((1, H)))
    twice = _zip_map(lambda a, ax: a if ax is None else jnp.stack([a, a + 1]), args, axes)
    outer = _zip_map(lambda a, ax: ax, args, axes)
    got = jax.vmap(jax.vmap(fn, in_axes=axes), in_axes=outer)(*twice)
    assert _folded(calls, 2 * V * B) == ["dkdv", "dq", "fwd"], calls
    once = jax.vmap(fn, in_axes=axes)(*_element(twice, outer, 1))
    for g, w in zip(got, once, strict=True):
        np.testing.assert_allclose(np.asarray(g[1]), np.asarray(w), rtol=1e-5)


def test_mapped_sinks_run_one_launch_per_element(calls):
    x = _inputs(2, 1, 1)
    cfg = dataclasses.replace(_cfg(None), terms=MaskTerms(causal_offset=0))
    sinks = jnp.stack([x["sinks"] * (i + 1) for i in range(V)])
    lists = jax.tree.map(lambda a: a[0] if a.ndim > 1 else a, x["lists"])
    dummy = jnp.zeros((1,), jnp.int32)

    def fwd(q, k, v, s):
        return tr.forward_launch(cfg, q, k, v, jnp.zeros((1,), jnp.float32), s, x["score"],
                                  (dummy,) * 4, lists)

    out, lse = jax.vmap(fwd)(x["q"], x["k"], x["v"], sinks)
    assert {c[1] for c in calls} == {B}
    for i in range(V):
        want, _ = fwd(x["q"][i], x["k"][i], x["v"][i], sinks[i])
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(want), rtol=1e-5)


@pytest.mark.slow
def test_mapped_score_arrays_run_one_launch_per_element(calls):
    """Slopes and a table mapped with the inputs have no batch axis to fold into: one launch
    per element, each reading its own arrays (forward and the dq launch's partial sums)."""
    x = _inputs(3, 1, 1)
    cfg = dataclasses.replace(_cfg(None), terms=MaskTerms(causal_offset=0))
    slopes, table = (jnp.stack([a * (i + 1) for i in range(V)]) for a in x["score"])
    lists = jax.tree.map(lambda a: a[0] if a.ndim > 1 else a, x["lists"])
    dummy = jnp.zeros((1,), jnp.int32)
    bias = jnp.zeros((1,), jnp.float32)

    def both(q, k, v, do, s, t):
        out, _ = tr.forward_launch(cfg, q, k, v, bias, x["sinks"], (s, t), (dummy,) * 4, lists)
        grads = tr.dq_launch(cfg, q, k, v, bias, (s, t), (dummy,) * 4, lists, do, do[..., 0],
                             do[..., 0])
        return (out,) + grads[2:]

    got = jax.vmap(both)(x["q"], x["k"], x["v"], x["do"], slopes, table)
    assert {c[1] for c in calls} == {B}
    for i in range(V):
        want = both(x["q"][i], x["k"][i], x["v"][i], x["do"][i], slopes[i], table[i])
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g[i]), np.asarray(w), rtol=1e-5)
