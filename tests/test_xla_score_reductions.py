"""`XlaBlockSparse` with a score function that reduces over an axis of its own: the dot product
of per-token features (MLA's decoupled RoPE part), forward and the q, k, v and params
gradients against the float64 oracle.

Such a function's gradient is a broadcast-multiply-reduce over the block's rows or keys. Run
per unit under the kernel's four `vmap` levels it was an array of rank 8, and jaxlib 0.10.2's
CPU backend crashed the process on it (a segfault in YNNPACK, inside XLA's runtime); the
kernel now runs the score function on the slot flattened to ``[rows, bq, bk]``
(`strategies/kernels/xla.py`, `_slot_terms`). Before, the case with a batch of one crashed or
gave NaN and 1e14 entries in the features' gradient (out-of-bounds reads), the MQA case
crashed. The cases cover each level's shape: a batch of one, one query head per kv head,
per-head masks (units of one head), the batch index, the call's positions and a slot run in
chunks.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
from tests.conftest import assert_close, jnp_attention_f64, np_visibility

R = 4  # the features' width: the axis the function sums over


def feature_dot(score, head, q_pos, k_pos, params):
    """``score + 0.5 * <f_q[h, q_pos], f_k[h, k_pos]>`` (features ``[H, L, R]``)."""
    f_q, f_k = params
    return score + 0.5 * jnp.sum(f_q[head, q_pos] * f_k[head, k_pos], -1)


def feature_dot_per_example(score, head, q_pos, k_pos, params, *, batch):
    """`feature_dot` with features per example (``[B, H, L, R]``), read at the batch index."""
    f_q, f_k = params
    return score + 0.5 * jnp.sum(f_q[batch, head, q_pos] * f_k[batch, head, k_pos], -1)


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    kv_heads: int
    mask: masks.AbstractMask
    per_example: bool = False
    offset: int | None = None  # the queries' positions start here (the call passes them)
    slot: int | None = None  # XlaConfig.slot_elements: the slot runs in chunks


CASES = {
    # B = 1, one query head per kv head: every level but the heads' and the blocks' is one.
    "batch_of_one_mha": Case(1, 2, 2, masks.Causal()),
    # Units of one head each (a per-head mask), the slot in chunks.
    "per_head_chunks": Case(2, 4, 2, masks.PerHead(
        [masks.Causal(), masks.SlidingWindow(12, 12), masks.Full(), masks.Causal()]),
        slot=2**10),
    # One kv head for all query heads, features per example, the call's positions.
    "mqa_batch_index_positions": Case(2, 4, 1, masks.Causal(), per_example=True, offset=8),
}


#: The default tier runs the two that crashed or gave NaN gradients: the first in the quick
#: tier, the second in the full tier (`FULL`); the chunked per-head case (the levels' other
#: shapes) is extended.
EXTENDED = {"per_head_chunks"}
FULL = {"mqa_batch_index_positions"}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=(pytest.mark.extended,) if n in EXTENDED
                 else (pytest.mark.slow,) if n in FULL else ()) for n in CASES])
def test_score_function_reducing_its_own_axis_matches_the_oracle(name):
    case = CASES[name]
    b, h, hkv, d = case.batch, case.heads, case.kv_heads, 8
    q_len = 40
    kv_len = q_len + (case.offset or 0)
    keys = jax.random.split(jax.random.key(3), 5)
    q = jax.random.normal(keys[0], (b, h, q_len, d))
    k = jax.random.normal(keys[1], (b, hkv, kv_len, d))
    v = jax.random.normal(keys[2], (b, hkv, kv_len, d))
    lead = (b, h) if case.per_example else (h,)
    params = tuple(jax.random.normal(key, lead + (kv_len, R)) for key in keys[3:])
    fn = feature_dot_per_example if case.per_example else feature_dot
    call = {}
    q_pos = np.broadcast_to(np.arange(q_len), (b, q_len))
    if case.offset is not None:
        q_pos = q_pos + case.offset
        call["q_positions"] = q_pos
    tiling = kernels.XlaConfig(block_q=16, block_kv=16, slot_elements=case.slot)
    attn = bsa.BlockSparseAttention(mask=case.mask, kernel=kernels.XlaBlockSparse(),
                                    tiling=tiling, score=scores.ScoreFunction(fn, params))

    def loss(args):
        out = args[0](*args[1:], **call)
        return jnp.sum(jnp.sin(out)), out

    (_, out), (grads, dq, dk, dv) = eqx.filter_value_and_grad(loss, has_aux=True)(
        (attn, q, k, v))
    vis = np_visibility(case.mask, batch=b, heads=h, q_len=q_len, kv_len=kv_len,
                        q_pos=None if case.offset is None else q_pos)
    assert vis.any() and not vis.all()
    with jax.enable_x64(True):
        def f64(x):
            return jnp.asarray(np.asarray(x, np.float64))

        head = jnp.arange(h)[None, :, None, None]
        qp = jnp.asarray(q_pos)[:, None, :, None]
        kp = jnp.arange(kv_len)[None, None, None, :]
        kw = {"batch": jnp.arange(b)[:, None, None, None]} if case.per_example else {}

        def oracle(q, k, v, params):
            return jnp_attention_f64(q, k, v, vis,
                                     score=lambda s: fn(s, head, qp, kp, params, **kw))

        p64 = jax.tree.map(f64, params)
        want = oracle(f64(q), f64(k), f64(v), p64)
        wants = jax.grad(lambda *a: jnp.sum(jnp.sin(oracle(*a))), argnums=(0, 1, 2, 3))(
            f64(q), f64(k), f64(v), p64)
    assert_close(out, want, 5e-5, "out")
    for got, w, what in zip((dq, dk, dv), wants[:3], ("dq", "dk", "dv")):
        assert_close(got, w, 2e-4, what)
    for got, w, what in zip(grads.score.params, wants[3], ("df_q", "df_k")):
        assert np.abs(np.asarray(w)).max() > 0
        assert_close(got, w, 2e-4, what)
