"""`from_flex`: a FlexAttention ``score_mod`` as a `ScoreFunction`."""

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eqx_bsattn.contract import check_flex

from .builtin import ScoreFunction


@dataclasses.dataclass(frozen=True)
class _FlexScore:
    """A FlexAttention ``score_mod(score, b, h, q_idx, kv_idx[, params])`` as a score function
    that reads the batch index; its result broadcast to the logits' shape (a ``score_mod``
    is written per element)."""

    score_mod: Callable

    def __call__(self, score, head, q_pos, k_pos, *params, batch):
        out = self.score_mod(score, batch, head, q_pos, k_pos, *params)
        return jnp.broadcast_to(out, jnp.shape(score))


def from_flex(score_mod: Callable, params: Any = None) -> ScoreFunction:
    """A `ScoreFunction` from a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)`` (or
    ``score_mod(score, b, h, q_idx, kv_idx, params)`` with `params`, learned or per call).

    `b` is the batch index, `h` the query head, `q_idx` and `kv_idx` the call's positions (the
    token indices when none are passed). A ``score_mod`` that only ever returns the score or
    ``-inf`` is a mask in disguise: it runs, but every block is visited; this warns, pointing
    to `masks.from_flex` (a mask skips the blocks it hides). Where a built-in term says the
    same (ALiBi, T5's table, the soft cap), prefer it (docs/flex.md).

    ```python
    def relative_positional(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx)

    score = scores.from_flex(relative_positional)
    ```
    """
    check_flex(score_mod, "score_mod", "score, b, h, q_idx, kv_idx", params)
    score = ScoreFunction(_FlexScore(score_mod), params)
    if _masks_only(score_mod, score.params):
        warnings.warn(f"`score_mod` {getattr(score_mod, '__name__', '')} only keeps the score or "
                      f"sets -inf: it is a mask, and as one (masks.from_flex) the kernel skips "
                      f"the blocks it hides.", stacklevel=2)
    return score


def _masks_only(score_mod: Callable, params) -> bool:
    """Whether `score_mod` returns, on a 2-head 16 x 16 tile of random logits (batch 0 and
    1), only its input or ``-inf``, and ``-inf`` somewhere. Not probed with traced params."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
        return False
    idx = np.arange(16, dtype=np.int32)
    s = np.random.default_rng(0).normal(size=(2, 2, 16, 16)).astype(np.float32)
    args = (jnp.arange(2, dtype=jnp.int32)[:, None, None, None],
            jnp.arange(2, dtype=jnp.int32)[None, :, None, None],
            jnp.asarray(idx[:, None]), jnp.asarray(idx[None, :]))
    extra = () if params is None else (params,)
    with jax.ensure_compile_time_eval():
        out = np.asarray(jnp.broadcast_to(score_mod(jnp.asarray(s), *args, *extra), s.shape))
    hidden = out == -np.inf
    return bool(hidden.any() and ((out == s) | hidden).all())
