"""`PallasTpuBlockSparse` under `ShardMap` (a 1-device mesh too), `AllToAll` and
`RingAttention` on 8 virtual CPU devices, interpreted: output and the gradients of q, k, v
and the score arrays (ALiBi's slopes, the T5 table) against the unsharded call and the
float64 oracle; and every sharding's program lowered for a TPU v5e (compiled kernels).

JAX fixes the number of CPU devices when its backend starts: the tests run in a child
process, as tests/test_sharding.py runs its own.
"""

import os

import pytest

from tests.test_sharding import _CHILD, run_child

if os.environ.get(_CHILD) != "1":

    @pytest.mark.slow  # a child process that compiles the kernel interpreted on 8 devices
    def test_pallas_tpu_sharded_on_eight_devices():
        run_child("not slow", path=__file__)

    @pytest.mark.slow
    @pytest.mark.extended
    def test_pallas_tpu_sharded_on_eight_devices_slow_cases():
        run_child("slow", path=__file__)

else:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from eqx_bsattn import BlockSparseAttention, kernels, masks, scores, sharding
    from eqx_bsattn._score_alibi import as_alibi
    from tests.conftest import np_mask, random_inputs
    from tests.kernels.pallas_tpu.test_pallas_tpu import v5e_lowering  # noqa: F401 (fixture)
    from tests.test_sharding import (
        TILES,
        check_score_oracle,
        compare,
        make_mesh,
        ring,
        scored,
    )

    KERNEL = "PallasTpuBlockSparse"
    slow = pytest.mark.slow

    #: name -> (sharding, batch, heads, kv heads, length, positions that are not the indices)
    def shardings(name):
        return {
            # Slopes and table rows split by head and read by every batch shard: their
            # gradients are summed over the batch devices.
            "shard_map": (lambda: sharding.ShardMap(make_mesh((2, 4), ("b", "h")), "b", "h"),
                          2, 8, 2, 32, True),
            "shard_map_one_device": (lambda: sharding.ShardMap(make_mesh((1,), ("h",)), None,
                                                               "h"), 1, 4, 2, 32, False),
            "all_to_all": (lambda: sharding.AllToAll(make_mesh((8,), ("s",)), "s"),
                           1, 8, 2, 64, True),
            # MQA over the head axis, zig-zag over 4 sequence devices.
            "ring": (lambda: ring("2d_heads"), 1, 4, 1, 64, True),
            # Contiguous slices: causal steps a device has no work in are skipped there.
            "ring_contiguous": (lambda: ring("1d", order="contiguous"), 1, 4, 2, 128, False),
            # One step, whose lists (exact capacities, read at a traced step) are the whole
            # causal layout's: the visits of a row fill both lists' capacities together.
            "ring_one_device": (lambda: sharding.RingAttention(make_mesh((1,), ("s",)), "s"),
                                1, 4, 2, 64, False),
        }[name]

    @pytest.mark.parametrize("name, kind", [
        ("shard_map", "alibi"), ("shard_map_one_device", "table"), ("all_to_all", "table"),
        ("ring", "alibi"), ("ring_one_device", "alibi"),
        *[pytest.param(n, k, marks=slow) for n, k in [
            ("shard_map", "table"), ("all_to_all", "alibi"), ("ring", "table"),
            ("ring_contiguous", "alibi")]],
    ])
    def test_sharded_matches_unsharded_and_the_oracle(name, kind):
        """A causal mask, GQA or MQA, learned slopes or table: output and the gradients of q,
        k, v and the score array equal the unsharded call's and the float64 oracle's."""
        make, batch, heads, kv_heads, length, positions = shardings(name)
        q, k, v = random_inputs(31, batch=batch, heads=heads, kv_heads=kv_heads, q_len=length,
                                value_dim=4)
        pos = np.stack([np.arange(length) * (3 if positions else 1) + (7 * b if positions
                                                                        else 0)
                        for b in range(batch)]).astype(np.int32)
        base, arrays = scored(kind, KERNEL, heads=heads)
        sharded, _ = scored(kind, KERNEL, make(), heads=heads)
        extra = dict(arrays, **(dict(q_positions=jnp.asarray(pos), kv_positions=jnp.asarray(pos))
                                if positions else {}))
        out, (grads, d_arrays) = compare(base, sharded, (q, k, v), extra)
        assert set(d_arrays) == set(arrays) != set()
        visible = np.stack([np_mask(masks.Causal(), q_len=length, kv_len=length, heads=heads,
                                    q_pos=p, kv_pos=p) for p in pos])
        check_score_oracle(kind, out, grads, d_arrays, (q, k, v), arrays, visible, pos)

    @pytest.mark.parametrize("name", ["shard_map", "all_to_all", "ring"])
    def test_compiled_kernels_lower_for_a_tpu_inside_each_sharding(name, v5e_lowering):
        """``interpret=False``: the forward, dq and dk/dv launches of `jax.grad` through each
        sharding, ALiBi, the T5 table and a function that closes over its slopes, trace
        inside `jax.shard_map` (their outputs typed by mesh axis) and lower for a TPU v5e."""
        make, batch, heads, kv_heads, _, _ = shardings(name)
        length = 1024 if name == "ring" else 256  # zig-zag slices of whole 128-lane tiles
        shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731 (traced only)
        q = shape(batch, heads, length, 128)
        k = v = shape(batch, kv_heads, length, 128)
        slopes, table = shape(heads), shape(heads, 32)

        # Inside a sharding's loop the kernel takes concrete closed-over arrays only.
        closed_over = jnp.linspace(0.1, 0.8, heads) if name == "ring" else None

        def loss(q, k, v, slopes, table):
            total = 0.0
            for score in (scores.ALiBi(slopes, learned=True),
                          scores.RelativePositionBias(table),
                          scores.ScoreFunction(closure_alibi(
                              slopes if closed_over is None else closed_over))):
                attn = BlockSparseAttention(
                    mask=masks.Causal(), score=score, sharding=make(),
                    kernel=kernels.PallasTpuBlockSparse(interpret=False),
                    tiling=kernels.PallasTpuConfig(block_q=128, block_kv=128))
                total = total + attn(q, k, v).sum()
            return total

        modules = v5e_lowering(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), q, k, v, slopes, table)
        assert set(modules) == {"pallas_tpu_forward", "pallas_tpu_dq", "pallas_tpu_dkv"}

    # Symmetric ALiBi (``-slopes[head] * |k - q|``): ALiBi on the causal pairs, and not its
    # affine form, so it runs as a function (`as_alibi` would make the natural
    # ``slopes[head] * (k_pos - q_pos)`` built-in ALiBi).
    def closure_alibi(slopes):
        return lambda score, head, q_pos, k_pos: score - slopes[head] * jnp.abs(k_pos - q_pos)

    def learned_alibi(score, head, q_pos, k_pos, params):
        return score - params["slopes"][head] * jnp.abs(k_pos - q_pos)

    @pytest.mark.parametrize("name, how", [
        ("shard_map", "closure"), ("shard_map", "params"),
        pytest.param("ring", "closure", marks=slow)])
    def test_function_closing_over_its_slopes(name, how):
        """Symmetric ALiBi written as a function of slopes it closes over, or reads in its
        `params` (run as a function, not as built-in ALiBi): under ShardMap the slopes are
        differentiated (each device's share of their gradient, at the call's head ids, summed
        over the devices); inside the ring's loop they are a concrete array (RingAttention
        refuses `params`). On the causal pairs it is ALiBi: the oracle is ALiBi's."""
        make, batch, heads, kv_heads, length, _ = shardings(name)
        q, k, v = random_inputs(33, batch=batch, heads=heads, kv_heads=kv_heads, q_len=length,
                                value_dim=4)
        slopes = jnp.linspace(-0.5, 0.4, heads)
        arrays = {"slopes": slopes} if name == "shard_map" else {}

        def score_of(x):
            if how == "params":
                return scores.ScoreFunction(learned_alibi, {"slopes": x})
            return scores.ScoreFunction(closure_alibi(x))

        assert as_alibi(score_of(slopes).compile(heads), heads).function is not None

        def call(shard):
            def fn(q, k, v, **extra):
                attn = BlockSparseAttention(
                    mask=masks.Causal(), kernel=kernels.PallasTpuBlockSparse(),
                    tiling=TILES, score=score_of(extra.pop("slopes", slopes)),
                    **({} if shard is None else {"sharding": shard}))
                return attn(q, k, v, **extra)

            return fn

        out, (grads, d_arrays) = compare(call(None), call(make()), (q, k, v), arrays)
        pos = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length))
        visible = np.tril(np.ones((length, length), bool))
        check_score_oracle("alibi", out, grads, d_arrays, (q, k, v), {"slopes": slopes},
                           visible, pos)
