"""`attend` (and `attend_with_lse`): the three launches of `TritonBlockSparse` under one
`jax.custom_vjp`."""

import functools

import jax
import jax.numpy as jnp

from eqx_bsattn.contract import (LN2, backward_delta, public_lse, refuse_second_order,
                                  typed_like, zero_cotangent)

from .launch import LaunchConfig, dkdv_launch, dq_launch, forward_launch


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend(cfg: LaunchConfig, q, k, v, bias, sinks, score, data, lists, bwd_lists):
    """Attention output ``[B, H, Lq, Dv]``; differentiable in q, k, v, bias, sinks and the
    score arrays.

    `bias` and `sinks` are one-element placeholders when absent; `score` the ALiBi slopes
    ``[H]`` and the relative-bias table ``[H, num_buckets]`` (float32, placeholders when off);
    `data` the positions and segment ids (placeholders when absent); `lists` the forward
    layout's arrays and `bwd_lists` the dq layout's and the dk/dv layout's
    (`launch.layout_arrays`).
    """
    out, _ = _forward(cfg, q, k, v, bias, sinks, score, data, lists)
    return out


def _forward(cfg, q, k, v, *args):
    """`forward_launch`, its outputs typed like q, k and v inside `shard_map` (a launch's
    outputs vary over no mesh axis)."""
    return typed_like(forward_launch(cfg, q, k, v, *args), q, k, v)


def _attend_fwd(cfg, q, k, v, bias, sinks, score, data, lists, bwd_lists):
    refuse_second_order("TritonBlockSparse", q, k, v, bias, sinks, score)
    out, lse = _forward(cfg, q, k, v, bias, sinks, score, data, lists)
    return out, (q, k, v, bias, sinks, score, data, lists, bwd_lists, out, lse)


def _attend_bwd(cfg, res, do, dlse=None):
    refuse_second_order("TritonBlockSparse", res, do, dlse)
    q, k, v, bias, sinks, score, data, lists, bwd_lists, out, lse = res
    do = do.astype(q.dtype)
    # delta = rowsum(dO * O) - dlse: one fused elementwise pass in XLA, memory-bound.
    delta = backward_delta(do, out, dlse, lse)
    dq_lists, t_lists = bwd_lists
    dq, dbias_full, dslopes, dtable = dq_launch(cfg, q, k, v, bias, score, data, dq_lists, do,
                                                lse, delta)
    dk, dv = dkdv_launch(cfg, q, k, v, bias, score, data, t_lists, do, lse, delta)
    # The dq programs' partial sums, one row each ([B, H, NQB, ...]), added per query head.
    slopes, table = score
    dscore = (jnp.sum(dslopes, axis=(0, 2)) if cfg.alibi else jnp.zeros_like(slopes),
              jnp.sum(dtable, axis=(0, 2)) if cfg.relative is not None
              else jnp.zeros_like(table))
    if cfg.bias_shape is not None:
        bb, hb = cfg.bias_shape
        axes = tuple(a for a, n in ((0, bb), (1, hb)) if n == 1)
        dbias = jnp.sum(dbias_full, axis=axes, keepdims=True).astype(bias.dtype)
    else:
        dbias = jnp.zeros_like(bias)
    if cfg.num_sinks > 0:
        # d sink[h, s] = -sum over rows of exp(sink - lse) * delta (lse stored in base 2).
        lse_nat = lse * LN2
        weight = jnp.exp(sinks[None, :, None, :] - lse_nat[..., None])  # [B, H, LQ, S]
        dsinks = -jnp.sum(weight * delta[..., None], axis=(0, 2)).astype(sinks.dtype)
    else:
        dsinks = jnp.zeros_like(sinks)
    zeros = jax.tree.map(zero_cotangent, (data, lists, bwd_lists))
    # Inside `shard_map` each cotangent takes its input's mesh axes (the launches' are none).
    grads = jax.tree.map(typed_like, (dq, dk, dv, dbias, dsinks, dscore),
                         (q, k, v, bias, sinks, score))
    return grads + zeros


attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend_with_lse(cfg: LaunchConfig, q, k, v, bias, sinks, score, data, lists, bwd_lists):
    """`attend` and each row's float32 log-sum-exp ``[B, H, Lq]`` (natural log; ``-inf`` on
    rows that see no key); differentiable in both."""
    out, lse = _forward(cfg, q, k, v, bias, sinks, score, data, lists)
    return out, public_lse(lse, base2=True)


def _attend_with_lse_fwd(cfg, *args):
    out, res = _attend_fwd(cfg, *args)
    return (out, public_lse(res[-1], base2=True)), res


def _attend_with_lse_bwd(cfg, res, cotangents):
    do, dlse = cotangents
    return _attend_bwd(cfg, res, do, dlse)


attend_with_lse.defvjp(_attend_with_lse_fwd, _attend_with_lse_bwd)
