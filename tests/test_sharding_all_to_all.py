"""`AllToAll` (heads over the sequence axis) and the ring-by-heads hybrid on 8 virtual CPU
devices, against the unsharded call, forward and every gradient (in a child process, as
tests/test_sharding.py runs its own)."""

import os

import pytest

from tests.test_sharding import _CHILD, run_child

if os.environ.get(_CHILD) != "1":

    @pytest.mark.slow  # the quick tier's ShardMap and ring cases: tests/test_sharding.py
    def test_all_to_all_on_eight_devices():
        run_child("not slow", path=__file__)

    @pytest.mark.slow
    @pytest.mark.extended
    def test_all_to_all_on_eight_devices_slow_cases():
        run_child("slow", path=__file__)

else:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from eqx_bsattn import sharding
    from tests.conftest import bsa, kernels, masks, random_array, random_inputs
    from tests.test_sharding import (
        check_score_oracle,
        compare,
        make_mesh,
        module,
        scored,
    )

    slow = pytest.mark.slow
    L = 64  # 8 tokens per device on the way in; each device then holds 1 of 8 heads whole

    def skewed_documents(batch: int, length: int) -> np.ndarray:
        """Segment ids of documents of very different lengths (one long, several short), the
        last tokens padding (-1)."""
        lengths = [[37, 3, 5, 2, 9], [4, 41, 1, 6, 4]]
        out = np.full((batch, length), -1, np.int32)
        for b in range(batch):
            out[b, :sum(lengths[b])] = np.repeat(np.arange(5), lengths[b])
        return out

    def a2a(**kw):
        return sharding.AllToAll(make_mesh((8,), ("s",)), "s", **kw)

    def case(name):
        seg = jnp.asarray(skewed_documents(2, L))
        return {
            "documents": (masks.Causal(), dict(q_segment_ids=seg, kv_segment_ids=seg)),
            "window": (masks.Causal() & masks.SlidingWindow(12), {}),
            "bigbird": (masks.Causal() & (masks.SlidingWindow(8, 0) | masks.GlobalTokens(8)
                                          | masks.BigBirdRandom(8, 2)), {}),
            "bias_sinks": (masks.Causal(), dict(bias=random_array(8, (2, 8, L, L)),
                                                sinks=random_array(9, (8, 2)))),
            "per_head": (masks.PerHead([masks.Causal(), masks.SlidingWindow(5)] * 4),
                         dict(bias=random_array(6, (1, 1, 1, L)))),
        }[name]

    @pytest.mark.parametrize("kernel, name", [
        ("XlaBlockSparse", "documents"), ("DenseReference", "window"),
        *[pytest.param(k, n, marks=slow) for k, n in [
            ("XlaBlockSparse", "bigbird"),
            ("DenseReference", "documents"), ("XlaBlockSparse", "window"),
            ("DenseReference", "bigbird"), ("XlaBlockSparse", "bias_sinks"),
            ("DenseReference", "bias_sinks"), ("XlaBlockSparse", "per_head")]],
    ])
    def test_all_to_all(kernel, name):
        """GQA with 2 kv heads over 8 devices: each kv head goes to the 4 devices that hold
        its query heads."""
        mask, extra = case(name)
        q, k, v = random_inputs(5, batch=2, heads=8, kv_heads=2, q_len=L, value_dim=4)
        compare(module(mask, kernel), module(mask, kernel, a2a()), (q, k, v), extra)

    @pytest.mark.parametrize("kernel, kind", [
        ("DenseReference", "table"), pytest.param("XlaBlockSparse", "alibi", marks=slow),
        pytest.param("XlaBlockSparse", "table", marks=slow),
        pytest.param("DenseReference", "function", marks=slow),
    ])
    def test_all_to_all_score_terms(kernel, kind):
        """Each device reads its heads' slopes or table rows: output and the gradients of q, k,
        v and the score arrays equal the unsharded call's and the float64 oracle's."""
        q, k, v = random_inputs(22, batch=2, heads=8, kv_heads=8, q_len=L, value_dim=4)
        pos = jnp.asarray(np.stack([np.arange(L) * 3 + 7 * b for b in range(2)]), jnp.int32)
        base, arrays = scored(kind, kernel)
        sharded, _ = scored(kind, kernel, a2a(batch_axis=None))
        extra = dict(arrays, q_positions=pos, kv_positions=pos)
        out, (grads, d_arrays) = compare(base, sharded, (q, k, v), extra)
        check_score_oracle(kind, out, grads, d_arrays, (q, k, v), arrays,
                           np.tril(np.ones((L, L), bool)), pos)

    @slow
    def test_all_to_all_with_a_batch_axis():
        mesh = make_mesh((2, 4), ("b", "s"))
        mask, extra = case("documents")
        q, k, v = random_inputs(6, batch=2, heads=4, kv_heads=4, q_len=L)
        compare(module(mask, "XlaBlockSparse"),
                module(mask, "XlaBlockSparse", sharding.AllToAll(mesh, "s", batch_axis="b")),
                (q, k, v), extra)

    @pytest.mark.parametrize("heads, kv_heads, match", [
        (12, 12, r"query heads \(12\) must be a multiple of 8"),
        (24, 3, r"cannot split 3 key/value heads"),
    ])
    def test_all_to_all_refuses_layouts_it_cannot_split(heads, kv_heads, match):
        q, k, v = random_inputs(1, batch=1, heads=heads, kv_heads=kv_heads, q_len=L)
        attn = module(masks.Causal(), "XlaBlockSparse", a2a())
        with pytest.raises(ValueError, match=match):
            attn(q, k, v)

    @slow
    def test_all_to_all_sends_two_all_to_alls_each_way():
        """The compiled forward holds one all-to-all per q, k, v and one for the output, each
        moving a device's ``[B, H, L / n, D]`` shard; output and gradients together (`vjp`)
        the same again for the cotangents."""
        attn = module(masks.Causal(), "XlaBlockSparse", a2a())
        q, k, v = random_inputs(2, batch=1, heads=8, kv_heads=8, q_len=L)
        proj = random_array(3, q.shape)  # a cotangent XLA cannot fold

        def both(q, k, v):
            out, pullback = jax.vjp(attn, q, k, v)
            return out, pullback(proj)

        shard = q.size // 8 * 4  # float32 bytes of one device's shard
        fwd = sharding.collective_bytes(jax.jit(attn).lower(q, k, v).compile().as_text())
        assert fwd == {"all-to-all": [shard] * 4}, fwd
        grad = sharding.collective_bytes(jax.jit(both).lower(q, k, v).compile().as_text())
        assert grad == {"all-to-all": [shard] * 8}, grad

    # ---------------------------------------------------------------------------------------
    # The hybrid: all-to-all over one axis, the ring over the other.

    @pytest.mark.parametrize("kernel, name", [
        ("DenseReference", "window"),
        pytest.param("XlaBlockSparse", "documents", marks=slow),
        pytest.param("XlaBlockSparse", "bias_sinks", marks=slow),
    ])
    def test_all_to_all_ring(kernel, name):
        """A ring of 2 over rows of 4 all-to-all devices; 2 kv heads replicated over each row's
        4 head shards."""
        mesh = make_mesh((2, 4), ("r", "h"))
        mask, extra = case(name)
        q, k, v = random_inputs(7, batch=2, heads=8, kv_heads=2, q_len=L, value_dim=4)
        hybrid = sharding.AllToAllRing(mesh, "h", "r")
        compare(module(mask, kernel), module(mask, kernel, hybrid), (q, k, v), extra)

    @slow
    def test_all_to_all_ring_score_terms():
        mesh = make_mesh((2, 4), ("r", "h"))
        q, k, v = random_inputs(23, batch=2, heads=8, kv_heads=8, q_len=L, value_dim=4)
        pos = jnp.asarray(np.stack([np.arange(L) * 3 + 7 * b for b in range(2)]), jnp.int32)
        base, arrays = scored("table", "XlaBlockSparse")
        sharded, _ = scored("table", "XlaBlockSparse", sharding.AllToAllRing(mesh, "h", "r"))
        extra = dict(arrays, q_positions=pos, kv_positions=pos)
        compare(base, sharded, (q, k, v), extra)

    # ---------------------------------------------------------------------------------------
    # The cost model against the bytes the CPU mesh moves, and the choice it makes.

    def test_cost_model_bytes_match_the_compiled_collectives():
        """The model's bytes per device (float32 here) equal what the compiled programs'
        collectives move: the all-to-all's forward and backward all-to-alls (less the
        ``1 / n`` each device keeps), and the ring's hops, each a float32 k, v (dk, dv)
        shard."""
        from eqx_bsattn.strategies.sharding import cost

        batch, heads, dim, n = 1, 8, 8, 8
        q, k, v = random_inputs(2, batch=batch, heads=heads, kv_heads=heads, q_len=L, dim=dim)
        proj = random_array(3, q.shape)
        sizes = dict(devices=n, batch=batch, heads=heads, kv_heads=heads, length=L, dim=dim,
                     dtype_bytes=4, link_bytes_s=1e9, flops_s=1e12)

        def compiled(shard):
            attn = module(masks.Causal(), "XlaBlockSparse", shard)

            def both(q, k, v):
                out, pullback = jax.vjp(attn, q, k, v)
                return out, pullback(proj)

            return sharding.collective_bytes(jax.jit(both).lower(q, k, v).compile().as_text())

        moved = compiled(a2a())
        want = cost.all_to_all_cost(**sizes).sent_bytes
        assert sum(moved["all-to-all"]) * (n - 1) / n == want, (moved, want)
        moved = compiled(sharding.RingAttention(make_mesh((8,), ("s",)), "s",
                                                order="contiguous"))
        ring = cost.ring_cost(**sizes)
        hop_tensor = ring.sent_bytes / (n - 1) / 6  # k, v forward; k, v, dk, dv backward
        floats = {b for b in moved["collective-permute"] if b % (batch * heads * dim) == 0
                  and b >= batch * heads * (L // n) * dim}
        assert floats == {hop_tensor}, (moved, hop_tensor)

    def test_choose_sequence_sharding_explains_its_pick():
        mesh = make_mesh((8,), ("s",))
        many = sharding.choose_sequence_sharding(mesh, "s", heads=32, kv_heads=8,
                                                 length=131072, dim=128, density=0.5)
        assert isinstance(many.sharding, sharding.AllToAll)
        assert many.explain().startswith("picked AllToAll")
        few = sharding.choose_sequence_sharding(mesh, "s", heads=4, kv_heads=4,
                                                length=131072, dim=128)
        assert isinstance(few.sharding, sharding.RingAttention)
        assert "AllToAll: cannot run: the query heads (4)" in few.explain()
        grid = make_mesh((2, 4), ("s", "h"))
        hybrid = sharding.choose_sequence_sharding(grid, "s", heads_axis="h", heads=8,
                                                   kv_heads=8, length=1 << 20, dim=128)
        assert set(hybrid.costs) == {"RingAttention", "AllToAll", "AllToAllRing"}

    # ---------------------------------------------------------------------------------------
    # Memory per device at a fixed shard.

    def grad_temporaries(kind: str, devices: int, case: str, *, grad: bool = True,
                         shard: int = 4096) -> int:
        """Temporaries of `jit(grad)` (or `jit` of the call) of `XlaBlockSparse` under `kind`
        over the first `devices` devices, ``shard`` tokens per device, B=1, H=8, D=64,
        float32, inputs split on the sequence; compiled, never run."""
        from jax.sharding import NamedSharding, PartitionSpec as P

        devs = jax.devices()[:devices]
        if kind == "hybrid":
            mesh = jax.make_mesh((devices // 2, 2), ("r", "h"), devices=devs,
                                 axis_types=(jax.sharding.AxisType.Auto,) * 2)
            shard_with, seq = sharding.AllToAllRing(mesh, "h", "r"), ("r", "h")
        else:
            mesh = jax.make_mesh((devices,), ("s",), devices=devs,
                                 axis_types=(jax.sharding.AxisType.Auto,))
            shard_with, seq = sharding.AllToAll(mesh, "s"), "s"
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernels.XlaBlockSparse(),
                                        sharding=shard_with)
        length = devices * shard
        x = jax.ShapeDtypeStruct((1, 8, length, 64), jnp.float32,
                                 sharding=NamedSharding(mesh, P(None, None, seq, None)))
        ids = jax.ShapeDtypeStruct((1, length), jnp.int32,
                                   sharding=NamedSharding(mesh, P(None, seq)))

        def loss(q, k, v, seg):
            kw = dict(q_segment_ids=seg, kv_segment_ids=seg) if case == "documents" else {}
            return jnp.sum(attn(q, k, v, **kw))

        fn = jax.grad(loss, argnums=(0, 1, 2)) if grad else loss
        compiled = jax.jit(fn).lower(x, x, x, ids).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    # Measured (docs/sharding.md), MB at 2 / 8 devices: AllToAll causal jit(grad) 168 / 151,
    # forward 59 / 59; documents 127 / 128 and 59 / 62. AllToAllRing (2 head devices, a ring
    # of 2 then 4) causal jit(grad) 195 / 212 at 4 / 8 devices; at 2 devices its ring has
    # one device and no hop (114).

    @slow
    @pytest.mark.parametrize("kind, case, grad", [
        ("all_to_all", "causal", True), ("all_to_all", "documents", True),
        ("all_to_all", "causal", False), ("hybrid", "causal", True),
    ])
    def test_memory_is_set_by_the_shard(kind, case, grad):
        """Per-device temporaries at a shard of 4096 tokens: within 1.25x from 2 to 8 devices
        (the hybrid from 4, its smallest ring that moves anything)."""
        low = 4 if kind == "hybrid" else 2
        temps = {n: grad_temporaries(kind, n, case, grad=grad) for n in (low, 8)}
        assert temps[8] <= 1.25 * temps[low], temps
