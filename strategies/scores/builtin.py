"""The built-in score terms: `ALiBi`, `RelativePositionBias`, `ScoreFunction`."""

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from eqx_bsattn.contract import (
    AbstractScore,
    RelativeBuckets,
    ScoreTerm,
    ScoreTerms,
    params_tree,
)


def _float_array(name: str, x, shape_text: str, ndim: int) -> Array:
    if isinstance(x, (str, bytes, bool)) or x is None:
        raise TypeError(f"`{name}` must be a float array {shape_text}; got {type(x).__name__}.")
    try:
        x = jnp.asarray(x)
    except (TypeError, ValueError):
        raise TypeError(
            f"`{name}` must be a float array {shape_text}; got {type(x).__name__}.") from None
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`{name}` must be a float array {shape_text}; got dtype "
                        f"{jnp.dtype(x.dtype).name}.")
    if x.ndim != ndim:
        raise ValueError(f"`{name}` must have shape {shape_text}; got {tuple(x.shape)}.")
    return x


def alibi_slopes(num_heads: int) -> Float[Array, " num_heads"]:
    """The standard ALiBi slopes ``[num_heads]`` (a float32 JAX array, so a score function
    can index it with a traced head: ``slopes[head]``), as in Press et al. (2022).

    For ``n`` heads, a power of two: ``2 ** (-8 * (i + 1) / n)``; otherwise the slopes of the
    largest power of two below ``n`` followed by every other slope of twice that power.

    ```python
    alibi_slopes(8)   # [0.5, 0.25, ..., 0.00390625]
    ```
    """
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"`num_heads` must be a positive integer; got {num_heads!r}.")

    def power_of_two(n):
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    m = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(m) + power_of_two(2 * m)[0::2][: num_heads - m]
    # A concrete array even inside a trace (`jit`), so NumPy reads it and the plan checks it
    # on the host, as it did the NumPy slopes this returned before.
    with jax.ensure_compile_time_eval():
        return jnp.asarray(slopes, jnp.float32)


class ALiBi(AbstractScore):
    """ALiBi (attention with linear biases): ``s += slopes[h] * (k_pos - q_pos)``.

    **Arguments:**

    - `slopes`: ``[H]`` floats, one per query head; ``None`` (default) takes the standard
      geometric sequence for the call's head count (`alibi_slopes`).
    - `learned`: whether `slopes` are trained (their gradient flows); default ``False``, the
      slopes are constants (a zero gradient). Learned slopes are given, or filled with the
      standard ones by `MultiheadBlockSparseAttention`, which knows its head count.

    A key behind the query (``k_pos < q_pos``) gets a negative bias growing with its distance.

    ```python
    attn = BlockSparseAttention(mask=masks.Causal(), score=ALiBi())
    learned = ALiBi(alibi_slopes(8), learned=True)
    ```
    """

    slopes: Float[Array, " h"] | None = None
    learned: bool = eqx.field(default=False, static=True)

    def __init__(self, slopes=None, learned: bool = False):
        if not isinstance(learned, bool):
            raise TypeError(f"`learned` must be a bool; got {type(learned).__name__}.")
        self.slopes = None if slopes is None else _float_array("slopes", slopes, "[heads]", 1)
        self.learned = learned

    def compile(self, num_heads: int) -> ScoreTerms:
        if self.slopes is None and self.learned:
            raise ValueError(
                "ALiBi(learned=True) needs its initial `slopes`, e.g. ALiBi(alibi_slopes("
                f"{num_heads}), learned=True) (MultiheadBlockSparseAttention fills them)."
            )
        if self.slopes is None:  # NumPy: constants, which the call checks on the host
            return ScoreTerms(slopes=alibi_slopes(num_heads))
        if self.slopes.shape[0] != num_heads:
            raise ValueError(f"`slopes` must have one entry per query head, [{num_heads}]; "
                             f"got {tuple(self.slopes.shape)}.")
        slopes = self.slopes if self.learned else jax.lax.stop_gradient(self.slopes)
        return ScoreTerms(slopes=slopes)


class RelativePositionBias(AbstractScore):
    """T5's learned relative position bias: ``s += table[h, bucket(q_pos - k_pos)]``.

    **Arguments:**

    - `table`: ``[H, num_buckets]`` floats, learned (a pytree leaf: its gradient flows).
    - `bidirectional`: T5's encoder bucketing (keys before and after the query in separate
      halves of the buckets; default); ``False`` for the decoder's (every later key in bucket
      0). See `RelativeBuckets`.
    - `max_distance`: distances from this on share the last bucket; default 128.

    ```python
    table = 0.02 * jax.random.normal(jax.random.key(0), (8, 32))
    attn = BlockSparseAttention(mask=masks.Full(), score=RelativePositionBias(table))
    ```
    """

    table: Float[Array, "h buckets"]
    buckets: RelativeBuckets = eqx.field(static=True)

    def __init__(self, table, bidirectional: bool = True, max_distance: int = 128):
        table = _float_array("table", table, "[heads, num_buckets]", 2)
        if not isinstance(bidirectional, bool):
            raise TypeError(f"`bidirectional` must be a bool; got {type(bidirectional).__name__}.")
        if isinstance(max_distance, bool) or not isinstance(max_distance, (int, np.integer)):
            raise TypeError(f"`max_distance` must be an integer; got {max_distance!r}.")
        self.table = table
        self.buckets = RelativeBuckets(int(table.shape[1]), bidirectional, int(max_distance))

    @property
    def bidirectional(self) -> bool:
        return self.buckets.bidirectional

    @property
    def max_distance(self) -> int:
        return self.buckets.max_distance

    def compile(self, num_heads: int) -> ScoreTerms:
        if self.table.shape[0] != num_heads:
            raise ValueError(f"`table` must have one row per query head, [{num_heads}, "
                             f"num_buckets]; got {tuple(self.table.shape)}.")
        return ScoreTerms(table=self.table, buckets=self.buckets)


class ScoreFunction(AbstractScore):
    """Any jnp function of the logits and coordinates: ``fn(score, head, q_pos, k_pos)``, or
    ``fn(score, head, q_pos, k_pos, params)`` with learned or per-call arrays `params`.

    **Arguments:**

    - `fn`: a function (or callable object) of float32 logits `score` ``[..., n, m]`` and
      broadcastable int32 arrays (`head` the query head, `q_pos` ``[..., n, 1]``, `k_pos`
      ``[..., 1, m]``) that returns new float logits of the same shape that depend on
      `score` (``score + term``), finite or ``-inf`` (which hides a pair). A parameter named
      ``batch`` receives the batch index (an int32 array broadcastable against `score`) by
      keyword; only a batched call ``[B, H, L, D]`` has one (an unbatched call, also each
      example under `jax.vmap`, is refused: pass per-example data as `params` and vmap them).
    - `params`: a pytree of arrays passed as the fifth argument (default ``None``: `fn`
      takes four). They are leaves of the module: they get gradients, as learned arrays
      (a Graphormer-style table), and may be traced per call (`eqx.tree_at` a new value in).

    The signature is read once, here: a function whose positional parameters do not fit
    raises a one-line `TypeError` (a FlexAttention ``score_mod`` ``(score, b, h, q_idx,
    kv_idx)`` goes through `scores.from_flex`). Each call traces it once on a small tile and
    refuses in one line a result that is not float (`TypeError`), not the logits' shape or
    independent of `score` (`ValueError`).

    It runs before the soft cap and the mask, on every visited block, in the kernels that
    trace JAX functions (`kernels.DenseReference`, `kernels.XlaBlockSparse`,
    `kernels.MosaicBlockSparse` and `kernels.PallasTpuBlockSparse` where they can lower it);
    the others decline it. A function the plan proves to be ALiBi, ``score + c(head) *
    (k_pos - q_pos)``, runs as `ALiBi` with slopes ``c(h)`` (docs/scores.md, "A score
    function that is ALiBi runs as ALiBi"). Gradients flow through `score` and `params`.
    Data that changes per call or is learned must be in `params`: an array `fn` closes over
    is a constant of the module's static identity (and a traced one cannot be differentiated
    through the kernel). Define `fn` once, not as a fresh lambda per call.

    ```python
    def distance_penalty(score, head, q_pos, k_pos):
        return score - 0.1 * (head + 1) * jnp.abs(q_pos - k_pos) ** 0.5

    def learned_table(score, head, q_pos, k_pos, table):   # table [H, 2 L - 1]
        return score + table[head, q_pos - k_pos + L - 1]

    attn = BlockSparseAttention(mask=masks.Causal(), score=ScoreFunction(distance_penalty))
    learned = ScoreFunction(learned_table, jnp.zeros((8, 2 * L - 1)))
    ```
    """

    fn: Callable = eqx.field(static=True)
    params: Any = None
    term: ScoreTerm = eqx.field(static=True, repr=False)

    def __init__(self, fn: Callable, params: Any = None):
        self.term = ScoreTerm.of(fn, params is not None)
        self.fn = fn
        self.params = None if params is None else params_tree(params)

    def compile(self, num_heads: int) -> ScoreTerms:
        return ScoreTerms(function=self.term, params=self.params)
