"""Sharding on 8 virtual CPU devices: kernels inside a user's `jax.shard_map` and under `jit`
with sharded inputs, `ShardMap` (batch and heads) and `RingAttention` (sequence), each against
the unsharded call, forward and every gradient.

JAX fixes the number of CPU devices when its backend starts, so these tests run in a child
process started with ``--xla_force_host_platform_device_count=8``: the test collected in the
main run starts it and passes on its verdict (and its marker selection).
"""

import os
import subprocess
import sys

import pytest

_CHILD = "EQX_BSATTN_SHARDING_CHILD"
_DEVICES = 8


def run_child(marker: str, keyword: str | None = None, path: str = __file__):
    """Run the tests of `path` with `marker` (and `keyword`) in a child process with 8
    virtual CPU devices; assert that they pass."""
    env = dict(os.environ, **{_CHILD: "1"})
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={_DEVICES}").strip()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--full",
           "-m", marker,
           *(["-k", keyword] if keyword else []), os.path.abspath(path)]
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]


if os.environ.get(_CHILD) != "1":

    #: The quick tier's cases on 8 devices: ShardMap over batch and heads, the ring over two
    #: mesh axes with GQA, the ring's steps against the mask and the mesh checks;
    #: `test_sharding_on_eight_devices_rest` (the full tier) runs the others, document
    #: dispatch and the ring's score function params among them.
    QUICK = ("(test_shard_map and not score_terms and not per_head and not segment_ids) or "
             "test_ring_two_axes_gqa or test_ring_steps_match_the_mask or "
             "test_bad_mesh_and_axes")

    def test_sharding_on_eight_devices():
        run_child("not slow", QUICK)

    @pytest.mark.slow
    def test_sharding_on_eight_devices_rest():
        run_child("not slow", f"not ({QUICK})")

    # The slow cases in two children, so that the suite's workers run them side by side: the
    # extended tier.
    @pytest.mark.slow
    @pytest.mark.extended
    @pytest.mark.parametrize("part", ["ring", "not ring"])
    def test_sharding_on_eight_devices_slow_cases(part):
        run_child("slow", part)

else:
    from typing import ClassVar

    import equinox as eqx

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from eqx_bsattn import scores, sharding
    from eqx_bsattn.strategies.sharding import ring as ring_module
    from eqx_bsattn.contract import MaskReads
    from tests.conftest import (
        assert_close,
        bsa,
        jnp_attention_f64,
        kernels,
        make_kernel,
        masks,
        np_mask,
        random_array,
        random_inputs,
        score_f64,
        sorted_segments,
        to_f64,
    )

    assert jax.device_count() == _DEVICES, jax.devices()

    def make_mesh(shape, names):
        return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))

    TILES = bsa.Tiling(block_q=8, block_kv=8)

    def compare(base, sharded, args, extra, *, tol=2e-5):
        """`sharded` against `base` (both functions of `args` and keywords `extra`), forward and
        the gradients of a random projection in every float argument; returns the sharded
        call's ``(out, (grads of args, grads of the float keywords))``."""
        floats = {name: x for name, x in extra.items() if jnp.issubdtype(x.dtype, jnp.floating)}
        fixed = {name: x for name, x in extra.items() if name not in floats}
        q = args[0]
        proj = random_array(7, q.shape[:-1] + (args[2].shape[-1],))

        def run(fn):  # one compilation for the output and every gradient
            def both(a, f):
                out, pullback = jax.vjp(lambda a, f: fn(*a, **f, **fixed), a, f)
                return out, pullback(proj)

            return jax.jit(both)(args, floats)

        out, got = run(sharded)
        ref, want = run(base)
        assert_close(out, ref, tol, "output")
        for path, g, w in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got),
                              jax.tree.leaves(want)):
            assert_close(g, w, tol, f"gradient {jax.tree_util.keystr(path[0])}")
        return out, got

    def module(mask, kernel, shard=None, tiling=TILES):
        return bsa.BlockSparseAttention(mask=mask, kernel=make_kernel(kernel), tiling=tiling,
                                        **({} if shard is None else {"sharding": shard}))

    # ---------------------------------------------------------------------------------------
    # Every kernel inside a user's shard_map, and under jit with sharded inputs.

    slow = pytest.mark.slow

    @pytest.mark.parametrize("kernel, shape", [
        ("DenseReference", (2,)), pytest.param("XlaBlockSparse", (2, 4), marks=slow),
        pytest.param("DenseReference", (2, 4), marks=slow),
        pytest.param("XlaBlockSparse", (2,), marks=slow),
    ])
    def test_kernel_inside_user_shard_map(kernel, shape):
        names = ("b", "h")[:len(shape)]
        mesh = make_mesh(shape, names)
        q, k, v = random_inputs(1, batch=2, heads=8, kv_heads=4, q_len=32)
        seg = jnp.asarray(sorted_segments(np.random.default_rng(0), 2, 32, 3))
        attn = module(masks.Causal(), kernel)
        spec = P(*names)

        def per_device(q, k, v, seg):  # default check_vma=True
            return attn(q, k, v, q_segment_ids=seg, kv_segment_ids=seg)

        mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(spec, spec, spec, P("b")),
                               out_specs=spec)
        compare(lambda q, k, v: per_device(q, k, v, seg), lambda q, k, v: mapped(q, k, v, seg),
                (q, k, v), {})

    @pytest.mark.slow
    @pytest.mark.parametrize("kernel", ["XlaBlockSparse", "DenseReference"])
    def test_kernel_under_jit_with_named_sharding(kernel):
        mesh = make_mesh((2, 4), ("b", "h"))
        q, k, v = random_inputs(2, batch=2, heads=8, kv_heads=4, q_len=32)
        put = lambda x: jax.device_put(x, NamedSharding(mesh, P("b", "h")))  # noqa: E731
        attn = module(masks.Causal() & masks.SlidingWindow(9), kernel)
        compare(attn, attn, tuple(map(put, (q, k, v))), {})

    # ---------------------------------------------------------------------------------------
    # ShardMap: batch and heads.

    @pytest.mark.parametrize("kernel, axes", [
        pytest.param("XlaBlockSparse", ("b", "h"), marks=slow), ("DenseReference", ("b", None)),
        pytest.param("DenseReference", (None, "h"), marks=slow),
        pytest.param("XlaBlockSparse", ("b", None), marks=slow),
        pytest.param("XlaBlockSparse", (None, "h"), marks=slow),
    ])
    def test_shard_map(kernel, axes):
        mesh = make_mesh((2, 4), ("b", "h"))
        q, k, v = random_inputs(3, batch=2, heads=8, kv_heads=2, q_len=32, value_dim=4)
        seg = jnp.asarray(sorted_segments(np.random.default_rng(1), 2, 32, 3, pad=3))
        extra = dict(bias=random_array(4, (2, 1, 32, 32)), sinks=random_array(5, (8,)),
                     q_segment_ids=seg, kv_segment_ids=seg)
        mask = masks.Causal()
        compare(module(mask, kernel), module(mask, kernel, sharding.ShardMap(mesh, *axes)),
                (q, k, v), extra)

    @pytest.mark.slow
    @pytest.mark.parametrize("kernel", ["DenseReference", "XlaBlockSparse"])
    def test_shard_map_per_head_mask(kernel):
        mesh = make_mesh((2, 4), ("b", "h"))
        q, k, v = random_inputs(4, batch=2, heads=8, kv_heads=8, q_len=32)
        mask = masks.PerHead([masks.Causal(), masks.SlidingWindow(5)] * 4)
        extra = dict(bias=random_array(6, (1, 8, 32, 32)))
        compare(module(mask, kernel), module(mask, kernel, sharding.ShardMap(mesh, "b", "h")),
                (q, k, v), extra)

    # ShardMap with score terms: each device reads its query heads' slopes and table rows, a
    # score function the call's head ids; gradients of the arrays sum over the batch shards.

    def head_penalty(score, head, q_pos, k_pos):  # differs per head: a local id would show
        return score - 0.1 * (head + 1) * jnp.sqrt(jnp.abs(q_pos - k_pos).astype(score.dtype))

    def scored(kind, kernel, shard=None, *, heads=8, mask=None):
        """`fn(q, k, v, **arrays)` calling a module with the score `kind` built from `arrays`
        (so the gradients reach them), and those arrays (none for the fixed ALiBi slopes)."""
        if kind == "alibi":
            slopes = jnp.asarray(scores.alibi_slopes(heads)) * (1 + random_array(20, (heads,)))
            arrays = dict(slopes=slopes)
            make = lambda slopes: scores.ALiBi(slopes, learned=True)  # noqa: E731
        elif kind == "alibi_fixed":
            arrays = {}
            make = scores.ALiBi
        elif kind == "table":
            arrays = dict(table=random_array(21, (heads, 16)))
            make = lambda table: scores.RelativePositionBias(table, max_distance=24)  # noqa: E731
        else:
            arrays = {}
            make = lambda: scores.ScoreFunction(head_penalty)  # noqa: E731

        def fn(q, k, v, **extra):
            own = {name: extra.pop(name) for name in arrays}
            attn = bsa.BlockSparseAttention(
                mask=masks.Causal() if mask is None else mask, kernel=make_kernel(kernel),
                tiling=TILES, score=make(**own), **({} if shard is None else {"sharding": shard}))
            return attn(q, k, v, **extra)

        return fn, arrays

    def check_score_oracle(kind, out, grads, d_arrays, qkv, arrays, visible, pos, *, tol=5e-5):
        """The sharded call's output and gradients (on `compare`'s projection) against the
        float64 oracle with the documented terms; `visible` ``[B or 1, H, Lq, Lk]``, `pos`
        ``[B, L]`` the call's positions."""
        q, _, v = qkv
        heads = q.shape[1]
        if kind == "alibi_fixed":
            arrays = dict(slopes=jnp.asarray(scores.alibi_slopes(heads)))
        with jax.enable_x64(True):
            def oracle(qkv, arrays):
                score = lambda s: score_f64(  # noqa: E731
                    s, q_pos=pos, kv_pos=pos, max_distance=24,
                    fn=head_penalty if kind == "function" else None, **arrays)
                return jnp_attention_f64(*qkv, visible, score=score)

            wide = lambda t: jax.tree.map(to_f64, t)  # noqa: E731
            ref, pullback = jax.vjp(oracle, wide(qkv), wide(arrays))
            want, d_want = pullback(wide(random_array(7, q.shape[:-1] + (v.shape[-1],))))
        assert_close(out, ref, tol, "output against the float64 oracle")
        pairs = [*zip("qkv", grads, want), *((n, d_arrays[n], d_want[n]) for n in d_arrays)]
        for name, g, w in pairs:
            assert_close(g, w, tol, f"d{name} against the float64 oracle")

    @pytest.mark.parametrize("kernel, axes, kind", [
        ("DenseReference", ("b", "h"), "alibi"),
        # Each term over each split once, and the XLA kernel's per-block path for each term
        # with heads split (where the global head ids and the per-head rows matter).
        *[pytest.param(kernel, axes, kind, marks=slow) for kernel, axes, kind in [
            ("DenseReference", ("b", None), "table"), ("DenseReference", ("b", None), "function"),
            ("DenseReference", (None, "h"), "alibi"), ("DenseReference", ("b", "h"), "table"),
            ("XlaBlockSparse", (None, "h"), "alibi"), ("XlaBlockSparse", (None, "h"), "table"),
            ("XlaBlockSparse", (None, "h"), "function"), ("XlaBlockSparse", ("b", "h"), "function"),
        ]],
    ], ids=lambda x: "-".join(a or "_" for a in x) if isinstance(x, tuple) else str(x))
    def test_shard_map_score_terms(kernel, axes, kind):
        """Output and the gradients of q, k, v and the score arrays equal the unsharded call's,
        with GQA (2 kv heads over 4 head devices) and positions that are not the indices."""
        mesh = make_mesh((2, 4), ("b", "h"))
        q, k, v = random_inputs(22, batch=2, heads=8, kv_heads=2, q_len=32, value_dim=4)
        pos = jnp.asarray(np.stack([np.arange(32) * 3 + 7 * b for b in range(2)]), jnp.int32)
        base, arrays = scored(kind, kernel)
        sharded, _ = scored(kind, kernel, sharding.ShardMap(mesh, *axes))
        extra = dict(arrays, q_positions=pos, kv_positions=pos)
        out, (grads, d_arrays) = compare(base, sharded, (q, k, v), extra)
        # And the float64 oracle with the documented terms, on the same projection.
        check_score_oracle(kind, out, grads, d_arrays, (q, k, v), arrays,
                           np.tril(np.ones((32, 32), bool)), pos)

    # ---------------------------------------------------------------------------------------
    # RingAttention: the sequence.

    L = 128  # 8 devices: 16 tokens each, or two slices of 8 in zig-zag order

    def ring_case(name):
        table = np.random.default_rng(3).random((L // 16, L // 16)) < 0.4
        shuffled = jnp.asarray(np.stack([np.random.default_rng(b).permutation(L)
                                         for b in range(2)]).astype(np.int32))
        seg = jnp.asarray(sorted_segments(np.random.default_rng(2), 2, L, 5, pad=5))
        return {
            "causal": (masks.Causal(), {}),
            "window": (masks.Causal() & masks.SlidingWindow(12), {}),
            "document": (masks.Causal(), dict(q_segment_ids=seg, kv_segment_ids=seg)),
            "block_table": (masks.BlockLayoutMask(table, 16), {}),
            "bias_sinks": (masks.Causal(), dict(bias=random_array(8, (2, 1, L, L)),
                                                # head 0 has no sink (-inf)
                                                sinks=random_array(9, (4, 2)).at[0].set(
                                                    -jnp.inf))),
            "array": (array_mask(1), {}),
            # Positions that are not the token indices: an ArrayMask reads indices, Causal
            # positions, and a shard must see both as the whole call does.
            "array_heads_positions": (masks.Causal() & array_mask(4),
                                      dict(q_positions=shuffled, kv_positions=shuffled)),
        }[name]

    def array_mask(heads, seed=4):
        return masks.ArrayMask(np.random.default_rng(seed).random((heads, L, L)) < 0.3)

    RING_MESHES = {
        "1d": (((8,), ("s",)), dict(seq_axis="s")),
        "2d_heads": (((4, 2), ("s", "h")), dict(seq_axis="s", head_axis="h")),
        "2d_batch": (((2, 4), ("b", "s")), dict(seq_axis="s", batch_axis="b")),
    }

    def ring(mesh_name, **kw):
        (shape, names), axes = RING_MESHES[mesh_name]
        return sharding.RingAttention(make_mesh(shape, names), **axes, **kw)

    def check_ring(case, kernel, mesh_name, *, kv_heads=2, **kw):
        mask, extra = ring_case(case)
        q, k, v = random_inputs(5, batch=2, heads=4, kv_heads=kv_heads, q_len=L)
        compare(module(mask, kernel), module(mask, kernel, ring(mesh_name, **kw)),
                (q, k, v), extra)

    @pytest.mark.parametrize("kernel, case", [
        ("XlaBlockSparse", "block_table"),
        *[pytest.param(k, c, marks=slow) for k, c in [
            ("DenseReference", "causal"), ("XlaBlockSparse", "bias_sinks"),
            ("XlaBlockSparse", "array")]],
    ])
    def test_ring_balanced_order(kernel, case):
        """The balanced order: slices dealt from the layout, routed in and out by
        ppermutes; output and every gradient as unsharded. A mask known only from per-call
        data is refused with the way out."""
        check_ring(case, kernel, "1d", order="balanced")
        if case == "block_table":
            with pytest.raises(ValueError, match="dispatch_documents on the host"):
                check_ring("document", kernel, "1d", order="balanced")

    def test_ring_schedule_reports_balanced_work():
        """Static skewed documents (an `ArrayMask`), 1024 tokens on 8 devices: the schedule
        reports each device's visible blocks; the balanced order keeps them within 5 % of the
        mean where contiguous and zig-zag do not."""
        length = 1024
        ids = np.repeat(np.arange(6), [500, 40, 300, 20, 100, 64])
        visible = (ids[:, None] == ids[None, :]) & np.tril(np.ones((length, length), bool))
        x = jnp.zeros((1, 2, length, 8))
        spread = {}
        for order in ("contiguous", "zigzag", "balanced"):
            attn = module(masks.ArrayMask(visible), "XlaBlockSparse",
                          sharding.RingAttention(make_mesh((8,), ("s",)), "s", order=order),
                          tiling=bsa.Tiling(block_q=16, block_kv=16))
            sched = attn.sharding.schedule(attn.plan(x, x, x).mask)
            work = np.asarray(sched.work)
            assert work.sum() == (visible.reshape(64, 16, 64, 16).any(axis=(1, 3))).sum()
            spread[order] = work.max() / work.mean()
        assert spread["balanced"] <= 1.05 < spread["zigzag"] < spread["contiguous"], spread

    def test_dispatch_documents():
        """Host-side dispatch of skewed documents: the ring's contiguous order on the
        reordered batch (positions passed) gives the unsharded output and gradients back in
        the user's order, and each device's visible blocks are within 5 % of the mean."""
        seg = np.stack([np.repeat(np.arange(5), lengths) for lengths in
                        ([90, 10, 8, 12, 8], [6, 70, 2, 30, 20])]).astype(np.int32)
        d = sharding.dispatch_documents(seg, 8, block=8)
        assert (np.take_along_axis(d.permutation, d.inverse, axis=1) == np.arange(L)).all()
        q, k, v = random_inputs(13, batch=2, heads=4, kv_heads=2, q_len=L)
        base = module(masks.Causal(), "XlaBlockSparse")
        ring_attn = module(masks.Causal(), "XlaBlockSparse",
                           ring("1d", order="contiguous"))
        perm, inv, pos = (jnp.asarray(a) for a in (d.permutation, d.inverse, d.positions))
        take = lambda x, p: jnp.take_along_axis(x, p[:, None, :, None], axis=2)  # noqa: E731
        seg_p = jnp.take_along_axis(jnp.asarray(seg), perm, axis=1)

        def dispatched(q, k, v):
            out = ring_attn(take(q, perm), take(k, perm), take(v, perm), q_segment_ids=seg_p,
                            kv_segment_ids=seg_p, q_positions=pos, kv_positions=pos)
            return take(out, inv)

        compare(lambda q, k, v: base(q, k, v, q_segment_ids=jnp.asarray(seg),
                                     kv_segment_ids=jnp.asarray(seg)),
                dispatched, (q, k, v), {})
        big = np.stack([np.repeat(np.arange(4), [5000, 200, 2500, 492])])
        work = sharding.dispatch_documents(big, 8, block=16).work
        assert work.max() / work.mean() <= 1.05, work

    @pytest.mark.slow
    @pytest.mark.parametrize("case", ["causal", "document", "block_table", "window", "bias_sinks"])
    def test_ring_reference(case):
        check_ring(case, "DenseReference", "1d")

    @pytest.mark.slow
    @pytest.mark.parametrize("case", ["window", "causal"])
    def test_ring_xla(case):
        check_ring(case, "XlaBlockSparse", "1d")

    @pytest.mark.parametrize("mesh_name", ["2d_heads", pytest.param("2d_batch", marks=slow)])
    def test_ring_two_axes_gqa(mesh_name):
        check_ring("causal", "DenseReference", mesh_name, kv_heads=1)

    @pytest.mark.slow
    @pytest.mark.parametrize("case", ["document", "block_table", "bias_sinks"])
    @pytest.mark.parametrize("mesh_name", ["1d", "2d_heads"])
    def test_ring_xla_slow(case, mesh_name):
        check_ring(case, "XlaBlockSparse", mesh_name)

    @pytest.mark.parametrize("kernel, case, order", [
        pytest.param("XlaBlockSparse", "array", "contiguous", marks=slow),
        pytest.param("XlaBlockSparse", "array_heads_positions", "zigzag", marks=slow),
        pytest.param("DenseReference", "array", "zigzag", marks=slow),
        pytest.param("DenseReference", "array_heads_positions", "contiguous", marks=slow),
    ])
    def test_ring_array_mask(kernel, case, order):
        """Each shard looks the array up at its tokens' global indices (and positions)."""
        check_ring(case, kernel, "1d", order=order)

    # RingAttention with score terms: each step's call evaluates them at its tokens' global
    # positions (and, with a head axis, on the rows of the device's query heads and the call's
    # head ids); the arrays' gradients are summed over the ring's steps and the sequence and
    # batch shards, once.

    @pytest.mark.parametrize("kernel, mesh_name, order, mask_name, kind, positions", [
        # A head axis (MQA: 1 kv head for 2 head devices), zig-zag, positions that are not the
        # token indices (the schedule is then decided on the device); and the steps the window
        # leaves empty skipped at trace time. The XLA kernel's per-block path: the slow cases.
        ("DenseReference", "2d_heads", "zigzag", "causal", "alibi", True),
        ("DenseReference", "1d", "contiguous", "window", "table", False),
        *[pytest.param(*case, marks=slow) for case in [
            ("XlaBlockSparse", "1d", "contiguous", "window", "table", False),
            ("XlaBlockSparse", "2d_heads", "zigzag", "causal", "function", False),
            ("XlaBlockSparse", "2d_batch", "zigzag", "causal", "alibi", True),
            ("XlaBlockSparse", "1d", "contiguous", "window", "alibi_fixed", False),
            ("XlaBlockSparse", "2d_heads", "contiguous", "window", "table", True),
            ("DenseReference", "2d_batch", "contiguous", "window", "function", True),
            ("DenseReference", "1d", "contiguous", "causal", "table", True),
            ("DenseReference", "2d_heads", "zigzag", "window", "alibi_fixed", True),
        ]],
    ], ids=lambda x: str(x))
    def test_ring_score_terms(kernel, mesh_name, order, mask_name, kind, positions):
        """Output and the gradients of q, k, v and the score arrays equal the unsharded call's
        and the float64 oracle's, with GQA."""
        length = 64  # 8 tokens per device, or two slices of 8 over 4 sequence devices
        kv_heads = 1 if mesh_name == "2d_heads" else 2
        q, k, v = random_inputs(23, batch=2, heads=4, kv_heads=kv_heads, q_len=length)
        pos = np.stack([np.arange(length) * 3 + 7 * b for b in range(2)]).astype(np.int32)
        if not positions:
            pos = np.broadcast_to(np.arange(length, dtype=np.int32), (2, length))
        mask = {"causal": masks.Causal(),
                "window": masks.Causal() & masks.SlidingWindow(12 * (3 if positions else 1))
                }[mask_name]
        base, arrays = scored(kind, kernel, heads=4, mask=mask)
        sharded, _ = scored(kind, kernel, ring(mesh_name, order=order), heads=4, mask=mask)
        extra = dict(arrays, **(dict(q_positions=jnp.asarray(pos), kv_positions=jnp.asarray(pos))
                                if positions else {}))
        out, (grads, d_arrays) = compare(base, sharded, (q, k, v), extra)
        visible = np.stack([np_mask(mask, q_len=length, kv_len=length, heads=4, q_pos=p,
                                    kv_pos=p) for p in pos])
        check_score_oracle(kind, out, grads, d_arrays, (q, k, v), arrays, visible, pos)

    def _table_and_shift(score, head, q_pos, k_pos, params):
        """A learned table (float: differentiated) read at a distance shifted by an integer
        param (not differentiated), per head."""
        index = jnp.clip(q_pos - k_pos + params["shift"], 0, params["table"].shape[1] - 1)
        return score + params["table"][head, index]

    @pytest.mark.parametrize("kernel, mesh_name, order, mask_name", [
        ("DenseReference", "2d_heads", "zigzag", "causal"),
        *[pytest.param(*case, marks=slow) for case in [
            ("XlaBlockSparse", "1d", "contiguous", "window"),
            ("XlaBlockSparse", "2d_batch", "zigzag", "causal"),
        ]],
    ], ids=lambda x: str(x))
    def test_ring_score_function_params(kernel, mesh_name, order, mask_name):
        """A `ScoreFunction`'s params reach every ring step: output and the gradients of q,
        k, v and the float params (summed over the steps and the devices) equal the unsharded
        call's, float32; an integer leaf of the params is read, not differentiated."""
        length = 64
        q, k, v = random_inputs(24, batch=2, heads=4, kv_heads=2, q_len=length)
        mask = {"causal": masks.Causal(),
                "window": masks.Causal() & masks.SlidingWindow(12)}[mask_name]

        def call(shard):
            def fn(q, k, v, table, shift):
                score = scores.ScoreFunction(_table_and_shift, dict(table=table, shift=shift))
                attn = bsa.BlockSparseAttention(
                    mask=mask, kernel=make_kernel(kernel), tiling=TILES, score=score,
                    **({} if shard is None else {"sharding": shard}))
                return attn(q, k, v)

            return fn

        params = dict(table=random_array(25, (4, 16)), shift=jnp.asarray(-2, jnp.int32))
        compare(call(None), call(ring(mesh_name, order=order)), (q, k, v), params)

    @pytest.mark.slow
    @pytest.mark.parametrize("kernel", ["XlaBlockSparse", "DenseReference"])
    def test_ring_array_mask_traced(kernel):
        """The mask array as a traced argument of `jit`: the ring's schedule is then known on
        the device only, like that of segment ids."""
        keep = array_mask(4, seed=5).mask
        q, k, v = random_inputs(10, batch=2, heads=4, kv_heads=2, q_len=L)
        proj = random_array(7, q.shape)

        def run(shard):
            def both(keep, q, k, v):
                attn = module(masks.Causal() & masks.ArrayMask(keep), kernel, shard)
                out, pullback = jax.vjp(attn, q, k, v)
                return out, pullback(proj)

            return jax.jit(both)(keep, q, k, v)

        (out, grads), (ref, want) = run(ring("2d_heads")), run(None)
        assert_close(out, ref, what="output")
        for name, g, w in zip("qkv", grads, want):
            assert_close(g, w, what=f"d{name}")

    @pytest.mark.slow
    @pytest.mark.parametrize("kernel", ["DenseReference", "XlaBlockSparse"])
    def test_shard_map_per_head_array_mask(kernel):
        mesh = make_mesh((2, 4), ("b", "h"))
        q, k, v = random_inputs(11, batch=2, heads=8, kv_heads=4, q_len=32)
        keep = np.random.default_rng(6).random((8, 32, 32)) < 0.3
        mask = masks.Causal() & masks.ArrayMask(keep)
        compare(module(mask, kernel), module(mask, kernel, sharding.ShardMap(mesh, "b", "h")),
                (q, k, v), {})

    @pytest.mark.slow
    @pytest.mark.parametrize("per_example", [False, True])
    def test_function_style_ring_attention_mask(per_example):
        """`blocksparse_attention(attention_mask=...)` over a sequence axis, shared by the
        batch or one mask per example (the call is then mapped over the batch)."""
        mesh = make_mesh((8,), ("s",))
        q, k, v = random_inputs(12, batch=2, heads=4, kv_heads=2, q_len=L)
        keep = np.random.default_rng(7).random((2 if per_example else 1, 4, L, L)) < 0.3
        spec = P(None, None, "s", None)
        opts = dict(attention_mask=jnp.asarray(keep), causal=False, platform="xla",
                    cfg=bsa.Tiling(8, 8))
        compare(lambda q, k, v: bsa.blocksparse_attention(q, k, v, **opts),
                lambda q, k, v: bsa.blocksparse_attention(
                    q, k, v, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, **opts),
                (q, k, v), {})

    @pytest.mark.slow
    @pytest.mark.parametrize("order", ["contiguous", "zigzag"])
    def test_ring_orders(order):
        check_ring("window", "DenseReference", "1d", order=order)

    # ---------------------------------------------------------------------------------------
    # A bias keeps its size-1 axes under ShardMap and RingAttention (for the kernels that read
    # them): a size-1 axis is never split, and the bias's gradient has its shape, summed over
    # the devices that share it. Sinks make the gradient of a bias constant along a row
    # nonzero (without them it shifts the row's softmax and its exact gradient is zero).

    def bias_case(kind, batch, heads, length):
        return {"key": (1, 1, 1, length), "query": (batch, 1, length, 1),
                "head": (1, heads, 1, 1), "scalar": (1, 1, 1, 1),
                "full": (batch, heads, length, length)}[kind]

    BIAS_SHARDINGS = {  # (sharding, heads, kv heads, length)
        "shard_map": (lambda: sharding.ShardMap(make_mesh((2, 4), ("b", "h")), "b", "h"),
                      8, 2, 32),
        "contiguous": (lambda: ring("1d", order="contiguous"), 4, 2, L),
        "zigzag": (lambda: ring("1d", order="zigzag"), 4, 2, L),
        "ring_heads": (lambda: ring("2d_heads", order="zigzag"), 4, 2, L),
    }

    @pytest.mark.parametrize("where, kind, kernel", [
        ("shard_map", "key", "XlaBlockSparse"), ("zigzag", "query", "DenseReference"),
        *[pytest.param(where, kind, kernel, marks=slow) for where, kind, kernel in [
            # Every shape under ShardMap and the zig-zag ring; the contiguous ring differs in
            # the key columns' order, so it takes the shapes with a key or query axis.
            ("zigzag", "query", "XlaBlockSparse"),
            ("shard_map", "query", "XlaBlockSparse"), ("shard_map", "head", "XlaBlockSparse"),
            ("shard_map", "scalar", "XlaBlockSparse"), ("shard_map", "full", "XlaBlockSparse"),
            ("contiguous", "key", "XlaBlockSparse"), ("contiguous", "query", "XlaBlockSparse"),
            ("contiguous", "key", "DenseReference"),
            ("zigzag", "key", "XlaBlockSparse"), ("zigzag", "head", "XlaBlockSparse"),
            ("zigzag", "scalar", "XlaBlockSparse"), ("zigzag", "full", "XlaBlockSparse"),
            ("ring_heads", "head", "XlaBlockSparse"), ("ring_heads", "key", "XlaBlockSparse"),
        ]],
    ])
    def test_bias_keeps_its_shape_under_sharding(where, kind, kernel):
        """The kernel gets the bias with the axes the caller gave (a full one as it is); the
        output and the gradients of q, k, v, the sinks and the bias (of the bias's shape)
        equal the unsharded call's and the float64 oracle's."""
        make, heads, kv_heads, length = BIAS_SHARDINGS[where]
        q, k, v = random_inputs(30, batch=2, heads=heads, kv_heads=kv_heads, q_len=length,
                                value_dim=4)
        bias = random_array(31, bias_case(kind, 2, heads, length))
        sinks = random_array(32, (heads,))
        mask = masks.Causal()
        sharded = module(mask, kernel, make())
        assert sharded.plan(q, k, v, bias=bias, sinks=sinks).inputs.bias.shape == bias.shape
        extra = dict(bias=bias, sinks=sinks)
        out, (grads, d_extra) = compare(module(mask, kernel), sharded, (q, k, v), extra)
        assert d_extra["bias"].shape == bias.shape
        with jax.enable_x64(True):
            def oracle(qkv, extra):
                return jnp_attention_f64(*qkv, np.tril(np.ones((length, length), bool)),
                                         **extra)

            wide = lambda t: jax.tree.map(to_f64, t)  # noqa: E731
            ref, pullback = jax.vjp(oracle, wide((q, k, v)), wide(extra))
            want, d_want = pullback(wide(random_array(7, q.shape[:-1] + (v.shape[-1],))))
        assert_close(out, ref, 5e-5, "output against the float64 oracle")
        pairs = [*zip("qkv", grads, want), *((n, d_extra[n], d_want[n]) for n in extra)]
        for name, g, w in pairs:
            assert_close(g, w, 5e-5, f"d{name} against the float64 oracle")

    def bias_memory(where, length, bias_shape):
        """Per-device temporaries (bytes) of the compiled `jit(grad)` of `XlaBlockSparse` under
        `where` with a bias of `bias_shape` (or none), with respect to every input; B=2, H=8,
        P("b", "h") on a (2, 4) mesh for ShardMap, B=1, H=2, P(None, None, "s") on 8 devices
        for the ring; D=16, float32, causal. Compiled, never run."""
        if where == "shard_map":
            mesh = make_mesh((2, 4), ("b", "h"))
            shard, shape, spec = sharding.ShardMap(mesh, "b", "h"), (2, 8), P("b", "h")
        else:
            mesh = make_mesh((8,), ("s",))
            shard, shape, spec = sharding.RingAttention(mesh, "s", order=where), (1, 2), \
                P(None, None, "s")
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.XlaBlockSparse(),
                                        sharding=shard)
        x = jax.ShapeDtypeStruct((*shape, length, 16), jnp.float32,
                                 sharding=NamedSharding(mesh, spec))
        args = (x, x, x)
        if bias_shape is not None:
            args += (jax.ShapeDtypeStruct(bias_shape, jnp.float32,
                                          sharding=NamedSharding(mesh, P())),)
        loss = lambda q, k, v, *b: jnp.sum(attn(q, k, v, bias=b[0] if b else None))  # noqa: E731
        fn = jax.grad(loss, argnums=tuple(range(len(args))))
        return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    # Measured (docs/sharding.md): per-device temporaries with a per-key bias, against none:
    # ShardMap at 2048 tokens 12.12 / 11.48 MB, the zig-zag ring at 4096 over 8 devices
    # 5.27 / 5.23 MB; with the bias broadcast to [B, 1, Lq, Lk] first, 89.42 and 35.48 MB
    # (4.6 and 3.6 of the per-device [Lq, Lk] or [Lq / 8, Lk] float32 array).
    @pytest.mark.parametrize("where, length", [("shard_map", 2048),
                                               pytest.param("zigzag", 4096, marks=slow)])
    def test_a_per_key_bias_builds_no_lq_x_lk_array_per_device(where, length):
        """A per-key ``[B, 1, 1, Lk]`` bias adds under a sixteenth of one ``Lq x Lk`` float32
        array per device (the ring's ``Lq / n x Lk``) to the temporaries of jit(grad)."""
        batch = 2 if where == "shard_map" else 1
        per_device = length * length * 4 // (1 if where == "shard_map" else 8)
        without = bias_memory(where, length, None)
        with_bias = bias_memory(where, length, (batch, 1, 1, length))
        assert with_bias - without < per_device / 16, (with_bias, without, per_device)

    @pytest.mark.slow
    def test_explicit_mesh():  # jax.make_mesh's default axis type
        mesh = jax.make_mesh((4, 2), ("s", "h"))
        q, k, v = random_inputs(8, batch=2, heads=4, kv_heads=2, q_len=64)
        mask = masks.Causal() & masks.SlidingWindow(10)
        for shard in (sharding.RingAttention(mesh, "s", head_axis="h"),
                      sharding.ShardMap(mesh, None, "h")):
            compare(module(mask, "DenseReference"), module(mask, "DenseReference", shard),
                    (q, k, v), {})

    @pytest.mark.slow
    def test_explicit_mesh_eager_gradients():
        """On jax.make_mesh's default (Explicit) mesh, eager gradients failed in JAX outside the
        call with a message about device assignments; now a one-line error says how to take
        them, and they match the unsharded call inside `jax.set_mesh`."""
        mesh = jax.make_mesh((4, 2), ("s", "h"))
        q, k, v = random_inputs(8, batch=2, heads=4, kv_heads=2, q_len=64)
        base = module(masks.Causal(), "XlaBlockSparse")
        want = jax.grad(lambda q: base(q, k, v).sum())(q)
        for shard in (sharding.RingAttention(mesh, "s", head_axis="h", order="contiguous"),
                      sharding.ShardMap(mesh, None, "h")):
            attn = module(masks.Causal(), "XlaBlockSparse", shard)
            loss = lambda q: attn(q, k, v).sum()  # noqa: E731
            assert_close(attn(q, k, v), base(q, k, v))  # the forward runs eagerly
            with pytest.raises(ValueError, match=r"cannot be taken eagerly: jit .*set_mesh"):
                jax.grad(loss)(q)
            with jax.set_mesh(mesh):
                assert_close(jax.grad(loss)(q), want)

    @pytest.mark.parametrize("kind", ["all_to_all", pytest.param("ring", marks=slow),
                                      pytest.param("shard_map", marks=slow)])
    def test_explicit_mesh_vjp_with_an_unsplit_cotangent(kind):
        """Inside `jax.set_mesh` on an Explicit mesh, unsplit inputs give an unsplit output:
        `jax.vjp`'s pullback takes a cotangent of the query's type (it was refused: the output
        was typed as split), and the gradients match the unsharded call's."""
        mesh = jax.make_mesh((4, 2), ("s", "h"))
        q, k, v = random_inputs(8, batch=2, heads=4, kv_heads=2, q_len=64)
        proj = random_array(7, q.shape)
        base = module(masks.Causal(), "XlaBlockSparse")
        want = jax.vjp(lambda q: base(q, k, v), q)[1](proj)[0]
        shard = {"ring": lambda: sharding.RingAttention(mesh, "s", head_axis="h",
                                                        order="contiguous"),
                 "shard_map": lambda: sharding.ShardMap(mesh, None, "h"),
                 "all_to_all": lambda: sharding.AllToAll(mesh, "s")}[kind]()
        attn = module(masks.Causal(), "XlaBlockSparse", shard)
        with jax.set_mesh(mesh):
            out, pullback = jax.vjp(lambda q: attn(q, k, v), q)
            assert jax.typeof(out).sharding.spec == P(None, None, None, None)
            assert_close(pullback(proj)[0], want)

    def test_learned_score_arrays_placed_on_an_explicit_mesh():
        """Learned ALiBi slopes, a T5 table and a score function's params placed (replicated)
        on jax.make_mesh's default mesh, the inputs split over it, inside `jax.set_mesh`:
        the arrays go to Auto axes with the inputs (they raised a mesh mismatch), and the
        output and the arrays' gradients match the unplaced, unsharded call's."""
        mesh = jax.make_mesh((4, 2), ("s", "h"))
        q, k, v = random_inputs(12, batch=2, heads=4, kv_heads=2, q_len=64)
        put = lambda x, spec=P(): jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731

        def symmetric(s, head, q_pos, k_pos, slopes):
            return s - slopes[head] * jnp.abs(k_pos - q_pos).astype(s.dtype)

        cases = [(lambda a: scores.ALiBi(a, learned=True), jnp.linspace(-0.3, 0.4, 4)),
                 (scores.RelativePositionBias, random_array(13, (4, 32))),
                 (lambda a: scores.ScoreFunction(symmetric, a), jnp.linspace(0.1, 0.4, 4))]
        for make, array in cases:
            def loss(q, array, shard=None):
                attn = bsa.BlockSparseAttention(
                    mask=masks.Causal(), kernel=make_kernel("DenseReference"), tiling=TILES,
                    score=make(array), **({} if shard is None else {"sharding": shard}))
                return jnp.sum(jnp.sin(attn(q, k, v)))

            want = jax.value_and_grad(loss, argnums=(0, 1))(q, array)
            shards = [None, sharding.RingAttention(mesh, "s", head_axis="h")]
            for shard in shards:
                with jax.set_mesh(mesh):
                    got = jax.jit(jax.value_and_grad(lambda q, a: loss(q, a, shard),
                                                     argnums=(0, 1)))(
                        put(q, P(None, "h", "s", None)), put(array))
                assert_close(got[0], want[0], 2e-5, "loss")
                assert_close(got[1][0], want[1][0], 2e-5, "dq")
                assert_close(got[1][1], want[1][1], 2e-5, "d array")

    @pytest.mark.slow
    def test_explicit_mesh_zigzag():  # the zig-zag order's output gather moves tokens
        mesh = jax.make_mesh((4, 2), ("s", "h"))
        q, k, v = random_inputs(9, batch=2, heads=4, kv_heads=2, q_len=64)
        ring = sharding.RingAttention(mesh, "s", head_axis="h", order="zigzag")
        compare(module(masks.Causal(), "DenseReference"),
                module(masks.Causal(), "DenseReference", ring), (q, k, v), {})

    # ---------------------------------------------------------------------------------------
    # Inputs placed on a mesh (Explicit axes, jax.make_mesh's default, or Auto), passed to a
    # module without a sharding strategy, under jit: every CPU kernel, forward and gradients.

    def check_placed(kernel, axis_type, *, segments=True, strategy=None):
        shape, names = (2, 4), ("data", "model")
        mesh = (jax.make_mesh(shape, names) if axis_type == "default"
                else make_mesh(shape, names) if axis_type == "Auto"
                else jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * 2))
        q, k, v = random_inputs(10, batch=4, heads=8, kv_heads=4, q_len=48, kv_len=40,
                                value_dim=6)
        seg = np.stack([sorted_segments(np.random.default_rng(s), 1, 48, 3)[0] for s in range(4)])
        kv_seg = seg[:, :40]
        extra = dict(q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(kv_seg)) \
            if segments else {}
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
        placed = [put(x, P("data", "model")) for x in (q, k, v)]
        placed_extra = {n: put(x, P("data")) for n, x in extra.items()}
        attn = bsa.BlockSparseAttention(
            mask=masks.Causal(), **({} if kernel is None else dict(kernel=make_kernel(kernel))),
            **({} if strategy is None else dict(sharding=strategy(mesh))))
        ref = module(masks.Causal(), "DenseReference")
        proj = random_array(11, (4, 8, 48, 6))

        def loss(fn):
            return lambda q, k, v, e: jnp.sum(fn(q, k, v, **e) * proj)

        out = jax.jit(lambda q, k, v, e: attn(q, k, v, **e))(*placed, placed_extra)
        if axis_type != "Auto":
            assert out.sharding.spec[:2] == ("data", "model"), out.sharding
        assert_close(out, ref(q, k, v, **extra), 2e-5, "output")
        got = jax.jit(jax.grad(loss(attn), argnums=(0, 1, 2)))(*placed, placed_extra)
        want = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v, extra)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert_close(g, w, 2e-5, name)

    @pytest.mark.parametrize("kernel, axis_type", [
        ("DenseReference", "default"),  # the quick case: the XLA kernel compiles for seconds
        pytest.param(None, "default", marks=slow),
        pytest.param(None, "Auto", marks=slow),
        pytest.param("XlaBlockSparse", "Explicit", marks=slow),
        pytest.param("DenseReference", "Explicit", marks=slow),
        pytest.param("SplashBlockSparse", "Explicit", marks=slow),
        pytest.param("SplashBlockSparse", "Auto", marks=slow),
    ])
    def test_inputs_placed_on_a_mesh(kernel, axis_type):
        check_placed(kernel, axis_type)

    @pytest.mark.slow
    def test_shard_map_with_segment_ids_placed_on_an_explicit_mesh():
        check_placed("XlaBlockSparse", "Explicit",
                     strategy=lambda mesh: sharding.ShardMap(mesh, "data", "model"))

    # ---------------------------------------------------------------------------------------
    # What the ring computes and sends.

    def oracle_pairs(mask, order, n=_DEVICES, seg=None):
        """(query shard, kv shard) pairs with a visible pair, from the NumPy mask."""
        pieces = n if order == "contiguous" else 2 * n
        size = L // pieces
        chunks = {d: [d] if order == "contiguous" else [d, 2 * n - 1 - d] for d in range(n)}
        tokens = {d: np.concatenate([np.arange(c * size, (c + 1) * size) for c in chunks[d]])
                  for d in range(n)}
        vis = np_mask(mask, q_len=L, kv_len=L, heads=1, q_seg=seg, kv_seg=seg)[0]
        return {(a, b) for a in range(n) for b in range(n)
                if vis[np.ix_(tokens[a], tokens[b])].any()}

    @pytest.mark.parametrize("case", ["window", "causal",
                                      pytest.param("document", marks=slow)])
    def test_ring_steps_match_the_mask(case):
        mask, extra = ring_case(case)
        strategy = ring("1d")
        q, k, v = random_inputs(6, batch=2, heads=4, kv_heads=2, q_len=L)
        attn = module(mask, "XlaBlockSparse", strategy)
        plan = attn.plan(q, k, v, **extra)
        sched = strategy.schedule(plan.mask, plan.inputs)
        if case == "document":  # known on the device only: every step, decided per device
            assert sched.pairs is None and sched.steps == tuple(range(_DEVICES))
            assert sched.order == "zigzag"
        else:
            assert sched.pairs == oracle_pairs(mask, sched.order)
        if case == "window":  # a window narrower than a shard: one neighbour, one hop
            assert sched.order == "contiguous"
            assert sched.steps == (0, 1) and sched.hops == (1, 0)
        if case == "causal":  # zig-zag: every device works at every step
            assert sched.order == "zigzag"
            assert len(sched.pairs) == _DEVICES * _DEVICES and sched.hops == (4, 3)

        calls = []

        def counting(q, k, v, inputs, mask, *, return_lse=False):
            calls.append(mask.forward.num_q_blocks)
            return plan.kernel.attention_with_lse(
                q, k, v, mask=mask, inputs=inputs, features=plan.features, tiling=plan.tiling,
                softmax_scale=plan.softmax_scale, logits_soft_cap=None)

        jaxpr = jax.make_jaxpr(lambda q, k, v: strategy.wrap(counting)(
            q, k, v, plan.inputs, plan.mask))(q, k, v)
        # One loop over the walk's positions: the kernel is traced once, whatever the steps.
        assert len(calls) == 1
        fwd, back = sched.hops
        positions = 1 + fwd + back
        assert f"length={positions}" in str(jaxpr)
        walk = ring_module._Walk(_DEVICES, fwd, back)
        assert set(sched.steps) <= set(walk.steps) and len(walk.steps) == positions
        table = walk.forward_table()
        # Sent at each position: one hop forward per forward hop, then the own shard and the
        # held ones one hop backward per backward hop, nothing after the last.
        assert list(table["send"]) == [1] * fwd + ([3] + [2] * (back - 1) + [0] if back
                                                   else [0])
        sent = 3 + (case == "document")  # k, v, kv positions (and kv segment ids)
        # Zig-zag: each sequence operand (q and the q-side data too) comes in contiguous and
        # is reordered on the devices by two ppermutes of half a shard; so is the output.
        reorder = 0 if sched.order == "contiguous" else 2 * (2 * sent - 1 + 1)  # + output
        # The loop body's three ways to send a shard (forward, backward, the own backward).
        assert str(jaxpr).count("ppermute") == 3 * sent + reorder

        # The backward ring: one more loop over the same positions, the kernel traced once
        # more; the shards move from the farthest hop inward (one fewer hop each way) and
        # their dk/dv accumulators every hop, the backward hops' last one home.
        calls.clear()
        jax.make_jaxpr(jax.grad(lambda q, k, v: strategy.wrap(counting)(
            q, k, v, plan.inputs, plan.mask).sum(), argnums=(0, 1, 2)))(q, k, v)
        assert len(calls) == 2
        table = walk.backward_table()
        assert sorted(table["step"]) == sorted(walk.steps)
        shard_hops = sum(int(k in (1, 2)) for k in table["send"])
        assert shard_hops == max(fwd - 1, 0) + max(back - 1, 0)
        assert sum(int(k != 0) for k in table["acc_send"]) == fwd + back

    # ---------------------------------------------------------------------------------------
    # The seed-style door and errors.

    @pytest.mark.slow
    def test_function_style_mesh_options():
        mesh = make_mesh((2, 4), ("b", "s"))
        q, k, v = random_inputs(7, batch=2, heads=4, kv_heads=2, q_len=32)
        want = bsa.blocksparse_attention(q, k, v, sliding_window=(6, 0), platform="reference")
        spec = P("b", None, "s", None)
        got = jax.jit(lambda q, k, v: bsa.blocksparse_attention(
            q, k, v, sliding_window=(6, 0), platform="reference", mesh=mesh,
            in_specs=(spec, spec, spec), out_specs=spec))(q, k, v)
        assert_close(got, want)
        got = jax.jit(lambda q, k, v: bsa.blocksparse_attention(
            q, k, v, platform="reference", mesh=mesh, in_specs=(P("b"),) * 3,
            sequence_parallelism_mesh_axis_name="s", sliding_window=(6, 0)))(q, k, v)
        assert_close(got, want)
        heads = P("b", "s")
        got = jax.jit(lambda q, k, v: bsa.blocksparse_attention(
            q, k, v, platform="reference", mesh=mesh, in_specs=(heads, heads, heads),
            sliding_window=(6, 0)))(q, k, v)
        assert_close(got, want)

    def test_function_style_rejects_specs():
        mesh = make_mesh((2, 4), ("b", "s"))
        q, k, v = random_inputs(7, batch=2, heads=4, kv_heads=2, q_len=64)
        call = lambda **kw: bsa.blocksparse_attention(q, k, v, mesh=mesh, **kw)  # noqa: E731
        with pytest.raises(ValueError, match="head_dim"):
            call(in_specs=(P(None, None, None, "s"),) * 3)
        with pytest.raises(ValueError, match="one mesh axis"):
            call(in_specs=(P(("b", "s")),) * 3)
        with pytest.raises(ValueError, match="differs from the query"):
            call(in_specs=(P("b"), P(None), P("b")))
        with pytest.raises(ValueError, match="out_specs"):
            call(in_specs=(P("b"),) * 3, out_specs=P("s"))
        with pytest.raises(ValueError, match="sequence_parallelism_mesh_axis_name"):
            call(in_specs=(P(None, None, "s"),) * 3, sequence_parallelism_mesh_axis_name="b")
        with pytest.raises(ValueError, match="in_specs"):
            call()
        # One mask per example maps the call over the batch, a batch of one each.
        keep = jnp.asarray(np.random.default_rng(5).random((2, 4, 64, 64)) < 0.4)
        with pytest.raises(ValueError, match=r"^a per-example `attention_mask` \(its first "
                                             r"axis 2\) runs each example as a call of its "
                                             r"own, whose batch of one the mesh axis 'b' in "
                                             r"`in_specs` cannot split: "):
            call(in_specs=(P("b"),) * 3, attention_mask=keep)

    def test_bad_mesh_and_axes():
        mesh = make_mesh((2, 4), ("b", "s"))
        with pytest.raises(TypeError, match="jax.sharding.Mesh"):
            sharding.ShardMap("mesh", "b")
        with pytest.raises(ValueError, match="'x' is not an axis of the mesh"):
            sharding.ShardMap(mesh, "x")
        with pytest.raises(ValueError, match="one dimension only"):
            sharding.RingAttention(mesh, "s", head_axis="s")
        with pytest.raises(ValueError, match="order"):
            sharding.RingAttention(mesh, "s", order="spiral")
        q, k, v = random_inputs(7, batch=2, heads=4, kv_heads=2, q_len=18)
        with pytest.raises(ValueError, match=r"needs q_len and kv_len that are multiples of 4; "
                                             r"got q_len=18, kv_len=18: pad the sequence"):
            module(masks.Causal(), "DenseReference", sharding.RingAttention(mesh, "s"))(q, k, v)
        q, k, v = random_inputs(7, batch=2, heads=4, kv_heads=2, q_len=32)
        with pytest.raises(ValueError, match="tiles"):  # 8- or 4-token slices, 16-token tiles
            module(masks.Causal(), "XlaBlockSparse", sharding.RingAttention(mesh, "s"),
                   tiling=bsa.Tiling(block_q=16, block_kv=16))(q, k, v)
        with pytest.raises(ValueError, match="batch"):
            module(masks.Causal(), "DenseReference",
                   sharding.ShardMap(make_mesh((8,), ("b",)), "b"))(q, k, v)
        mesh = make_mesh((2, 4), ("b", "h"))
        q, k, v = random_inputs(7, batch=2, heads=12, kv_heads=6, q_len=16)
        with pytest.raises(ValueError, match="key/value heads"):
            module(masks.Causal(), "DenseReference", sharding.ShardMap(mesh, None, "h"))(q, k, v)

    def test_ring_calls_carry_positions():
        """A ring hands each shard's call its tokens' global positions, so the plan's features
        say so and a kernel that cannot read per-call positions is declined, saying why."""
        class NoPositions(bsa.AbstractLseKernel):
            name: ClassVar[str] = "no-positions-test"
            platforms: ClassVar[tuple[str, ...]] = ("cpu",)
            reads: ClassVar[MaskReads] = "dense"

            @classmethod
            def priority(cls, platform):
                return None

            def decline_reason(self, mask, features):
                return "per-call positions are not read." if features.positions else None

            def __call__(self, query, key, value, **kw):
                return kernels.DenseReference()(query, key, value, **kw)

            def attention_with_lse(self, query, key, value, **kw):
                return kernels.DenseReference().attention_with_lse(query, key, value, **kw)

        mesh = make_mesh((8,), ("s",))
        q, k, v = random_inputs(7, batch=2, heads=4, kv_heads=2, q_len=64)
        ring = sharding.RingAttention(mesh, "s")
        assert bsa.BlockSparseAttention(mask=masks.Causal(), sharding=ring).plan(
            q, k, v).features.positions
        unsharded = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=NoPositions())
        assert not unsharded.plan(q, k, v).features.positions
        dense = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.DenseReference())
        assert_close(unsharded(q, k, v), dense(q, k, v), what="unsharded")
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=NoPositions(), sharding=ring)
        with pytest.raises(ValueError, match="no-positions-test cannot run this call.*positions"):
            attn(q, k, v)

    def test_ring_fits_the_automatic_tiling_to_its_slices():
        """At L=512 on 8 devices the default tiles (128) do not divide a slice: the ring's
        automatic tiling shrinks to the zig-zag slices of 32 tokens (it was refused), a causal
        mask then takes the zig-zag order as documented, and the call matches unsharded; a
        module's own tiling is kept."""
        mesh = make_mesh((8,), ("s",))
        q, k, v = random_inputs(12, batch=1, heads=2, q_len=512)
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.XlaBlockSparse(),
                                        sharding=sharding.RingAttention(mesh, "s"))
        plan = attn.plan(q, k, v)
        assert {b for pass_blocks in plan.tiling.blocks for b in pass_blocks} == {32}
        assert attn.sharding.schedule(plan.mask).order == "zigzag"
        compare(bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.XlaBlockSparse()),
                attn, (q, k, v), {})
        own = module(masks.Causal(), "XlaBlockSparse", sharding.RingAttention(mesh, "s"),
                     tiling=bsa.Tiling(block_q=64, block_kv=64))
        assert own.plan(q, k, v).tiling.blocks.forward == (64, 64)

    def test_ring_declines_kernels_without_lse():
        class NoLse(bsa.AbstractKernel):
            name: ClassVar[str] = "no-lse-test"
            platforms: ClassVar[tuple[str, ...]] = ("cpu",)
            reads: ClassVar[MaskReads] = "dense"

            @classmethod
            def priority(cls, platform):
                return None

            def decline_reason(self, mask, features):
                return None

            def __call__(self, query, key, value, **kw):
                return kernels.DenseReference()(query, key, value, **kw)

        mesh = make_mesh((8,), ("s",))
        q, k, v = random_inputs(7, batch=2, heads=4, kv_heads=2, q_len=64)
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=NoLse(),
                                        sharding=sharding.RingAttention(mesh, "s"))
        with pytest.raises(ValueError, match="no-lse-test cannot run this call.*log-sum-exp"):
            attn(q, k, v)
        choice = bsa.select_kernel(masks.Causal(), platform="cpu", features=bsa.Features(lse=True),
                                   candidates=[NoLse(), kernels.XlaBlockSparse()])
        assert choice.kernel.name == "xla"
        assert [(name, "log-sum-exp" in why) for name, why in choice.declined] == [
            ("no-lse-test", True)]

    def test_ring_runs_the_xla_kernel_at_half_its_slot():
        """The ring runs the kernel in its loop bodies (`loops_kernel`): the plan's features say
        so and `XlaBlockSparse` takes half its default slot there; a slot given is kept.
        Unsharded and under `ShardMap`, the slot stays unset (the default)."""
        mesh = make_mesh((8,), ("s",))
        q, k, v = random_inputs(7, batch=2, heads=4, kv_heads=2, q_len=64)

        def plan(shard, tiling=None):
            attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.XlaBlockSparse(),
                                            tiling=tiling, **shard)
            return attn.plan(q, k, v)

        ring_plan = plan(dict(sharding=sharding.RingAttention(mesh, "s")))
        assert ring_plan.features.in_loop and ring_plan.tiling.slot_elements == 1 << 21
        assert "slot 2^21" in ring_plan.tiling.text()
        given = kernels.XlaConfig(16, 16, slot_elements=512)
        assert plan(dict(sharding=sharding.RingAttention(mesh, "s")),
                    given).tiling.slot_elements == 512
        for shard in ({}, dict(sharding=sharding.ShardMap(mesh, batch_axis="s"))):
            unlooped = plan(shard)
            assert not unlooped.features.in_loop and unlooped.tiling.slot_elements is None

    # ---------------------------------------------------------------------------------------
    # Long shards: the kernel's chunked loops inside the ring, and memory set by the shard.

    @pytest.mark.slow
    def test_ring_through_chunked_kernel_loops(monkeypatch):
        """With a small chunk bound every kernel loop of the ring runs in chunks (as a shard of
        32768 tokens does at the default bound): outputs and gradients match unsharded."""
        from eqx_bsattn.strategies.kernels import xla

        monkeypatch.setattr(xla, "_SLOT_ELEMENTS", 1 << 9)
        xla._attention_fn.cache_clear()
        try:
            mask, extra = ring_case("document")
            q, k, v = random_inputs(11, batch=2, heads=4, kv_heads=2, q_len=L)
            compare(module(mask, "XlaBlockSparse"),
                    module(mask, "XlaBlockSparse", ring("1d")), (q, k, v), extra)
        finally:
            xla._attention_fn.cache_clear()

    def ring_grad_compiled(devices, length, case, *, grad=True):
        """`jit(grad)` (or `jit` of the call) of `XlaBlockSparse` in a ring over the first
        `devices` devices, B=1, H=2, D=64, float32, inputs sharded P(None, None, 'seq',
        None); compiled, never run."""
        mesh = jax.make_mesh((devices,), ("seq",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:devices])
        mask = {"causal": masks.Causal(), "window": masks.Causal() & masks.SlidingWindow(4096),
                "documents": masks.Causal()}[case]
        attn = bsa.BlockSparseAttention(mask=mask, kernel=kernels.XlaBlockSparse(),
                                        sharding=sharding.RingAttention(mesh, "seq"))
        x = jax.ShapeDtypeStruct((1, 2, length, 64), jnp.float32,
                                 sharding=NamedSharding(mesh, P(None, None, "seq", None)))
        seg = jax.ShapeDtypeStruct((1, length), jnp.int32,
                                   sharding=NamedSharding(mesh, P(None, "seq")))

        def loss(q, k, v, seg):
            kw = dict(q_segment_ids=seg, kv_segment_ids=seg) if case == "documents" else {}
            return jnp.sum(attn(q, k, v, **kw))

        fn = jax.grad(loss, argnums=(0, 1, 2)) if grad else loss
        return jax.jit(fn).lower(x, x, x, seg).compile()

    @pytest.mark.slow
    def test_ring_compiles_with_long_shards():
        """Two devices, 65536 tokens: shards of 32768 take the kernel's chunked loops, whose
        carries must be typed like their inputs inside shard_map."""
        assert ring_grad_compiled(2, 65536, "causal").memory_analysis() is not None

    # Measured (docs/sharding.md): the causal backward's loop body holds the kernel's slot
    # twice; with the ring's half slot (`Features.in_loop`, `XlaConfig.slot_elements` 2^21) the
    # causal jit(grad) is 196 / 214 MB at 2 / 8 devices, under 8x one shard's q, k, v and
    # output (268 MB; 283 / 301 MB at 2^22). Documents (a layout built from the segment ids)
    # was 171 / 221 MB while the ring built every step's pair lists outside its loops; built
    # in the loops' bodies from the device's class rows, 170 / 187 MB.

    @pytest.mark.slow
    @pytest.mark.parametrize("case, grad", [
        ("causal", True), ("window", True), ("window", False), ("causal", False),
        ("documents", True), ("documents", False),
    ])
    def test_ring_memory_is_set_by_the_shard(case, grad):
        """Per-device temporaries of jit(grad) (forward and backward) and of the forward alone
        at a shard of 16384 tokens: within 1.25x from 2 to 8 devices, and within 8x one
        shard's q, k, v and output (docs/sharding.md)."""
        shard = 16384
        temps = {n: ring_grad_compiled(n, n * shard, case, grad=grad)
                 .memory_analysis().temp_size_in_bytes for n in (2, 8)}
        qkvo = 4 * 2 * shard * 64 * 4
        assert temps[8] <= 1.25 * temps[2], temps
        assert max(temps.values()) <= 8 * qkvo, (temps, qkvo)

    def _batch_only_term(score, head, q_pos, k_pos, batch):
        return score * (1.0 + 0.5 * batch) - 0.1 * jnp.abs(q_pos - k_pos)

    def _batch_and_params(score, head, q_pos, k_pos, table, batch):
        return score + table[head, jnp.clip(q_pos - k_pos, 0, 7)] * (1.0 + batch)

    @pytest.mark.parametrize("shard", ["shard_map", "ring"])
    def test_score_function_reads_the_global_batch_index(shard):
        """With the batch split over devices, a score function that reads the batch index gets
        the call's, not the shard's, and its params' gradient equals the unsharded one."""
        table = random_array(30, (4, 8))
        q, k, v = random_inputs(31, batch=2, heads=4, kv_heads=2, q_len=32)
        if shard == "shard_map":
            split = sharding.ShardMap(make_mesh((2, 4), ("b", "h")), "b", "h")
        else:
            split = sharding.RingAttention(make_mesh((2, 4), ("b", "s")), seq_axis="s",
                                           batch_axis="b")

        def grads(shard):
            attn = bsa.BlockSparseAttention(
                mask=masks.Causal(), kernel=kernels.XlaBlockSparse(), tiling=TILES,
                score=scores.ScoreFunction(_batch_and_params, table),
                **({} if shard is None else {"sharding": shard}))
            loss = lambda a, q: jnp.sum(jnp.sin(a(q, k, v)))  # noqa: E731
            return eqx.filter_jit(eqx.filter_value_and_grad(loss))(attn, q)

        if shard == "ring":  # a function without params too
            table_free = scores.ScoreFunction(_batch_only_term)
            ring = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.XlaBlockSparse(),
                                            tiling=TILES, score=table_free, sharding=split)
            plain = eqx.tree_at(lambda a: a.sharding, ring, sharding.Unsharded(),
                                is_leaf=lambda x: x is None)
            np.testing.assert_allclose(ring(q, k, v), plain(q, k, v), rtol=2e-5, atol=2e-6)
        (want, want_grad), (got, got_grad) = grads(None), grads(split)
        np.testing.assert_allclose(got, want, rtol=2e-5)
        np.testing.assert_allclose(got_grad.score.params, want_grad.score.params, rtol=2e-4,
                                   atol=2e-5)
