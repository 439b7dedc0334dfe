"""`autotune`: time candidate tilings on the caller's own inputs and keep the fastest."""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

from ._tiling import Tiling
from ._timing import median_ms

DEFAULT_BLOCKS = ((64, 64), (64, 128), (128, 64), (128, 128), (128, 256), (256, 128))


def _check_arguments(attn, candidates, backward, reps) -> None:
    from ._module import BlockSparseAttention

    if not isinstance(attn, BlockSparseAttention):
        raise TypeError(f"`attn` must be a BlockSparseAttention; got {type(attn).__name__}.")
    if candidates is not None:
        if isinstance(candidates, Tiling) or not isinstance(candidates, Sequence):
            raise TypeError(
                f"`candidates` must be a sequence of Tiling or None; got {type(candidates).__name__}."
            )
        if not candidates:
            raise ValueError("`candidates` must hold at least one Tiling (or be None); got none.")
        for tiling in candidates:
            if not isinstance(tiling, Tiling):
                raise TypeError(
                    f"`candidates` must hold Tiling instances; got {type(tiling).__name__}."
                )
    if not isinstance(backward, bool):
        raise TypeError(f"`backward` must be a bool; got {type(backward).__name__}.")
    if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
        raise ValueError(f"`reps` must be an int >= 1; got {reps!r}.")


def autotune(
    attn,
    query,
    key,
    value,
    *,
    candidates: Sequence[Tiling] | None = None,
    backward: bool = True,
    reps: int = 5,
    verbose: bool = False,
    **call_kwargs,
):
    """Return `attn` with the fastest of `candidates` as its tiling, timed on these inputs.

    Each candidate runs the forward pass (and, with ``backward=True``, a backward pass on a
    random cotangent) under `jax.jit`; the median of `reps` timed runs decides. Candidates the
    kernel rejects (for example, block sizes it cannot launch) are skipped. Inputs should be
    real data or random numbers, never zeros.

    **Arguments:**

    - `attn`: a `BlockSparseAttention`.
    - `query`, `key`, `value`, `**call_kwargs`: one call's arguments.
    - `candidates`: `Tiling`s to try; default: block pairs in `DEFAULT_BLOCKS` with the
      kernel's heuristic launch parameters, forward and backward alike.

    **Returns:** ``(tuned_attn, timings)``: the module with the best tiling, and
    ``[(tiling, seconds or None if rejected), ...]``.

    ```python
    tuned, timings = autotune(attn, q, k, v)
    ```
    """
    _check_arguments(attn, candidates, backward, reps)
    plan_kwargs = {n: x for n, x in call_kwargs.items() if n != "purify"}
    heuristic = eqx.tree_at(lambda m: m.tiling, attn, None, is_leaf=lambda x: x is None)
    plan = heuristic.plan(query, key, value, **plan_kwargs)
    if candidates is None:
        base = plan.tiling
        candidates = [
            Tiling(block_q=bq, block_kv=bk, num_warps=base.num_warps, num_stages=base.num_stages,
                   num_warps_bwd=base.num_warps_bwd, num_stages_bwd=base.num_stages_bwd)
            for bq, bk in DEFAULT_BLOCKS
        ]
    cotangent = jax.random.normal(
        jax.random.key(0), query.shape[:-1] + (value.shape[-1],), jnp.float32
    ).astype(query.dtype)
    timings = []
    for tiling in candidates:
        module = eqx.tree_at(lambda m: m.tiling, attn, tiling, is_leaf=lambda x: x is None)
        module = eqx.tree_at(lambda m: m.kernel, module, plan.kernel, is_leaf=lambda x: x is None)

        def run(q, k, v, module=module):
            if not backward:
                return module(q, k, v, **call_kwargs)
            out, pullback = jax.vjp(lambda q, k, v: module(q, k, v, **call_kwargs), q, k, v)
            return pullback(cotangent)

        try:
            seconds = median_ms(jax.jit(run), (query, key, value), reps) / 1e3
        except (ValueError, TypeError, NotImplementedError) as e:
            seconds = None
            if verbose:
                print(f"{tiling}: rejected ({e})")
        timings.append((tiling, seconds))
        if verbose and seconds is not None:
            print(f"{tiling}: {seconds * 1e3:.2f} ms")
    timed = [(s, i) for i, (_, s) in enumerate(timings) if s is not None]
    if not timed:
        raise ValueError("autotune: the kernel rejected every candidate tiling.")
    best = candidates[min(timed)[1]]
    tuned = eqx.tree_at(lambda m: m.tiling, attn, best, is_leaf=lambda x: x is None)
    return tuned, timings
