"""`from_flex`: a FlexAttention ``score_mod`` as a `ScoreFunction`."""

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eqx_bsattn.contract import check_flex, params_tree

from .builtin import ScoreFunction


@dataclasses.dataclass(frozen=True)
class _FlexScore:
    """A FlexAttention ``score_mod(score, b, h, q_idx, kv_idx[, params])`` that does not read
    `b`, as a score function (`from_flex` has checked it: `b` is given as 0); its result
    broadcast to the logits' shape (a ``score_mod`` is written per element)."""

    score_mod: Callable

    @property
    def __name__(self) -> str:  # errors name the user's score_mod, not this wrapper
        return getattr(self.score_mod, "__name__", None) or type(self.score_mod).__name__

    def __call__(self, score, head, q_pos, k_pos, *params):
        return self._call(score, jnp.zeros((), jnp.int32), head, q_pos, k_pos, params)

    def _call(self, score, batch, head, q_pos, k_pos, params):
        out = self.score_mod(score, batch, head, q_pos, k_pos, *params)
        return jnp.broadcast_to(out, jnp.shape(score))


@dataclasses.dataclass(frozen=True)
class _FlexBatchScore(_FlexScore):
    """`_FlexScore` for a `score_mod` that reads `b`: it gets the batch index, so the call
    must be batched (an unbatched one, as under `jax.vmap`, is refused)."""

    def __call__(self, score, head, q_pos, k_pos, *params, batch):
        return self._call(score, batch, head, q_pos, k_pos, params)


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
    wrap = _FlexBatchScore if _reads_batch(score_mod, params) else _FlexScore
    score = ScoreFunction(wrap(score_mod), params)
    if _masks_only(score_mod, score.params):
        warnings.warn(f"`score_mod` {getattr(score_mod, '__name__', '')} only keeps the score or "
                      f"sets -inf: it is a mask, and as one (masks.from_flex) the kernel skips "
                      f"the blocks it hides.", stacklevel=2)
    return score


def _reads_batch(score_mod: Callable, params) -> bool:
    """Whether `score_mod` reads its `b` (from its jaxpr on a 2 x 2 tile: an argument that
    reaches no equation is not read). One that fails to trace there is taken to read it (the
    call then needs batched inputs, as every `score_mod` did)."""
    idx = jnp.arange(2, dtype=jnp.int32)
    extra = () if params is None else (params_tree(params),)
    try:
        jaxpr = jax.make_jaxpr(
            lambda b: score_mod(jnp.zeros((2, 2), jnp.float32), b, jnp.zeros((), jnp.int32),
                                idx[:, None], idx[None, :], *extra))(
            jnp.zeros((), jnp.int32)).jaxpr
    except Exception:  # noqa: BLE001
        return True
    var = jaxpr.invars[0]
    return (any(var is v for eqn in jaxpr.eqns for v in eqn.invars)
            or any(var is v for v in jaxpr.outvars))


def _masks_only(score_mod: Callable, params) -> bool:
    """Whether `score_mod` returns, on a 2-head 16 x 16 tile of random logits (batch 0 and
    1), only its input or ``-inf``, and ``-inf`` somewhere. Not probed with traced params."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
        return False
    idx = np.arange(16, dtype=np.int32)
    s = np.random.default_rng(0).normal(size=(2, 2, 16, 16)).astype(np.float32)
    extra = () if params is None else (params,)
    # Run here and now, also inside a `jax.jit` trace: every input is concrete.
    with jax.ensure_compile_time_eval():
        args = (jnp.arange(2, dtype=jnp.int32)[:, None, None, None],
                jnp.arange(2, dtype=jnp.int32)[None, :, None, None],
                jnp.asarray(idx[:, None]), jnp.asarray(idx[None, :]))
        out = jnp.broadcast_to(score_mod(jnp.asarray(s), *args, *extra), s.shape)
    if isinstance(out, jax.core.Tracer):  # it closes over a traced array
        return False
    out = np.asarray(out)
    hidden = out == -np.inf
    return bool(hidden.any() and ((out == s) | hidden).all())
