"""`MultiheadBlockSparseAttention`: a drop-in for `eqx.nn.MultiheadAttention` with projections,
grouped-query heads, rotary embedding and a block-sparse mask."""

import jax
import jax.numpy as jnp
import equinox as eqx
from jaxtyping import Array, Bool, Float, Int, Integer, PRNGKeyArray

from ._inputs import as_array, as_bool_mask
from ._kernel import AbstractKernel
from ._mask import AbstractMask, Full, and_masks
from ._module import BlockSparseAttention, merge_alias
from ._score import AbstractScore, compile_score
from ._sharding import AbstractSharding, Unsharded
from ._swap import AutoKernel, AutoTiling
from ._tiling import AbstractTiling
from ._typing import ArrayOrNumpy, typechecked


def apply_rotary(
    x: Float[Array, "heads seq dim"], positions: Int[Array, " seq"], theta: float
) -> Float[Array, "heads seq dim"]:
    """Rotary position embedding of `x` at `positions`, halves rotated as in
    `eqx.nn.RotaryPositionalEmbedding` (``x * cos + rotate_half(x) * sin``), in float32."""
    dim = x.shape[-1]
    freqs = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
    cos = jnp.tile(jnp.cos(angles), (1, 2))
    sin = jnp.tile(jnp.sin(angles), (1, 2))
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _validate_layer_call(arguments: dict) -> None:
    """The layer's own checks, before jaxtyping sees the arguments: one line each, naming the
    argument, the shape given and the shape accepted."""
    layer = arguments["self"]
    arrays = {}
    for name, field, size in (("query", "query_size", layer.query_size),
                              ("key_", "key_size", layer.key_size),
                              ("value", "value_size", layer.value_size)):
        x = as_array(name, arguments[name])
        if x.ndim != 2:
            batch_hint = " (the layer is unbatched: jax.vmap it over a batch)" if x.ndim == 3 \
                else ""
            raise ValueError(
                f"`{name}` must be [seq_len, {size}]{batch_hint}; got shape {tuple(x.shape)}."
            )
        if x.shape[1] != size:
            raise ValueError(
                f"`{name}` must have {size} channels ([seq_len, {size}]: the layer's "
                f"`{field}`); got shape {tuple(x.shape)}."
            )
        if x.shape[0] == 0:
            raise ValueError(f"`{name}` must hold at least one token; got shape {tuple(x.shape)}.")
        arrays[name] = x
    q_len, kv_len = arrays["query"].shape[0], arrays["key_"].shape[0]
    if arrays["value"].shape[0] != kv_len:
        raise ValueError(
            f"`key_` and `value` must have the same length; got shapes "
            f"{tuple(arrays['key_'].shape)} and {tuple(arrays['value'].shape)}."
        )
    mask = arguments["mask"]
    if isinstance(mask, AbstractMask):
        raise TypeError(
            f"the call's `mask` is an array (booleans [q_len, kv_len]); a mask strategy such as "
            f"{type(mask).__name__} goes in the constructor: "
            f"MultiheadBlockSparseAttention(..., mask={type(mask).__name__}(...))."
        )
    if mask is not None:
        arguments["mask"] = _call_mask(mask, layer.num_heads, q_len, kv_len)
    merge_alias(arguments, "kv_seq_lengths", "key_value_seq_lengths")
    lengths = arguments["kv_seq_lengths"]
    if lengths is not None and not (
        (isinstance(lengths, int) and not isinstance(lengths, bool))
        or (hasattr(lengths, "dtype") and jnp.issubdtype(lengths.dtype, jnp.integer)
            and jnp.ndim(lengths) == 0)
    ):
        raise TypeError(
            "`kv_seq_lengths` must be an int or an integer scalar array (the layer is "
            f"unbatched: jax.vmap it over a batch of lengths); got {_given(lengths)}."
        )
    arguments.update(arrays)


def _given(x) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array of shape {tuple(x.shape)} and dtype {jnp.dtype(x.dtype).name}"
    return f"{type(x).__name__} {x!r}"


def _call_mask(mask, heads: int, q_len: int, kv_len: int):
    """The call's element mask as booleans ``[Lq, Lk]`` or ``[H, Lq, Lk]``: integers count
    where nonzero (as `blocksparse_attention`'s `attention_mask`), a size-1 heads axis is
    shared by all heads."""
    mask = as_bool_mask("mask", mask)
    if mask.shape not in ((q_len, kv_len), (1, q_len, kv_len), (heads, q_len, kv_len)):
        raise ValueError(
            f"`mask` must have shape [{q_len}, {kv_len}] or [{heads} or 1, {q_len}, {kv_len}] "
            f"([num_heads,] q_len, kv_len); got {tuple(mask.shape)}."
        )
    return mask[0] if mask.shape[0] == 1 and mask.ndim == 3 else mask


def _with_standard_slopes(score, num_heads: int):
    """`score`, with ``ALiBi(learned=True)`` given no slopes starting from the standard ones
    for `num_heads` (the layer knows its head count; the score term alone does not)."""
    from .strategies.scores import ALiBi, alibi_slopes

    if isinstance(score, ALiBi) and score.learned and score.slopes is None:
        return ALiBi(alibi_slopes(num_heads), learned=True)
    return score


class MultiheadBlockSparseAttention(eqx.Module):
    """Multi-head attention with learned projections, in the manner of
    `eqx.nn.MultiheadAttention`, computed by a `BlockSparseAttention` that skips the blocks its
    mask leaves empty.

    Projects ``query [Lq, query_size]`` to `num_heads` heads of `qk_size`, ``key_`` and
    ``value [Lk, *]`` to `num_kv_heads` heads (of `qk_size` and `vo_size`), optionally rotates
    query and key heads by their positions (rotary embedding), attends, and projects the
    ``num_heads * vo_size`` channels to `output_size`. The call is unbatched, as in
    `equinox.nn`: map it over a batch with `jax.vmap` or `eqx.filter_vmap`.

    With the same weights, a full mask and no rotary embedding it computes what
    `eqx.nn.MultiheadAttention` computes. Dropout is the one difference: block-sparse kernels
    never form the attention weights, so `dropout_p` drops elements of each head's attention
    output (before the output projection) instead of attention weights.

    The strategies sit in `attention` and swap with `eqx.tree_at`
    (``lambda m: m.attention.kernel``); in training use `swap_strategy` to keep the optimizer
    state.

    **Arguments:**

    - `num_heads`: number of query heads ``H``.
    - `query_size`: channels of the query input.
    - `key_size`, `value_size`: channels of the key and value inputs; default `query_size`.
    - `output_size`: output channels; default `query_size`.
    - `qk_size`, `vo_size`: channels per head for query/key and for value/output; default
      ``query_size // num_heads``.
    - `num_kv_heads`: key/value heads ``Hkv`` (grouped-query attention; ``H % Hkv == 0``,
      query head ``h`` reads kv head ``h // (H // Hkv)``); default `num_heads`.
    - `mask`: an `AbstractMask`; default `masks.Full()`.
    - `kernel`, `tiling`, `sharding`: as in `BlockSparseAttention`, with its defaults
      (`AutoKernel()`, `AutoTiling()`: chosen per call; `Unsharded()`).
    - `rotary_theta`: if set, rotary position embedding with this base (``10_000.0`` is the
      usual value) on the query and key heads; `qk_size` must be even. Default ``None``: off.
    - `use_query_bias`, `use_key_bias`, `use_value_bias`, `use_output_bias`: biases of the
      four projections; default ``False``.
    - `dropout_p`: dropout probability on the attention output; default ``0.0``.
    - `inference`: if ``True`` dropout is off (toggle with `eqx.nn.inference_mode`).
    - `softmax_scale`, `logits_soft_cap`: as in `BlockSparseAttention`.
    - `score`: a score term added to every logit (`scores.ALiBi`,
      `scores.RelativePositionBias`, `scores.ScoreFunction`), as in `BlockSparseAttention`;
      its learned slopes or table are parameters of the layer (``layer.attention.score``).
      ``scores.ALiBi(learned=True)`` without slopes starts from the standard slopes of
      `num_heads` (`scores.alibi_slopes`).
    - `dtype`: dtype of the weights; default float32 (float64 in 64-bit mode).
    - `key`: a `jax.random` key for the initial weights (keyword only).

    ```python
    import equinox as eqx, jax
    import eqx_bsattn as bsa

    layer = bsa.MultiheadBlockSparseAttention(
        num_heads=8, query_size=256, num_kv_heads=2, rotary_theta=10_000.0,
        mask=bsa.masks.Causal() & bsa.masks.SlidingWindow(128, 0), key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 1024, 256))      # [batch, seq, channels]
    y = jax.vmap(lambda x: layer(x, x, x))(x)                       # [4, 1024, 256]
    exact = eqx.tree_at(lambda m: m.attention.kernel, layer, bsa.kernels.DenseReference())
    ```
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    attention: BlockSparseAttention
    dropout: eqx.nn.Dropout
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    query_size: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    output_size: int = eqx.field(static=True)
    qk_size: int = eqx.field(static=True)
    vo_size: int = eqx.field(static=True)
    rotary_theta: float | None = eqx.field(static=True)

    def __init__(
        self,
        num_heads: int,
        query_size: int,
        key_size: int | None = None,
        value_size: int | None = None,
        output_size: int | None = None,
        qk_size: int | None = None,
        vo_size: int | None = None,
        num_kv_heads: int | None = None,
        mask: AbstractMask = Full(),
        kernel: AbstractKernel | AutoKernel | None = AutoKernel(),
        tiling: AbstractTiling | None = AutoTiling(),
        rotary_theta: float | None = None,
        use_query_bias: bool = False,
        use_key_bias: bool = False,
        use_value_bias: bool = False,
        use_output_bias: bool = False,
        dropout_p: float = 0.0,
        inference: bool = False,
        softmax_scale: float | None = None,
        logits_soft_cap: float | None = None,
        dtype=None,
        *,
        key: PRNGKeyArray,
        score: AbstractScore | None = None,
        sharding: AbstractSharding = Unsharded(),
    ):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                            ("query_size", query_size)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"`{name}` must be a positive int; got {value!r}.")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"`num_heads` ({num_heads}) must be a multiple of `num_kv_heads` ({num_kv_heads})."
            )
        key_size = query_size if key_size is None else key_size
        value_size = query_size if value_size is None else value_size
        output_size = query_size if output_size is None else output_size
        qk_size = query_size // num_heads if qk_size is None else qk_size
        vo_size = query_size // num_heads if vo_size is None else vo_size
        if qk_size <= 0 or vo_size <= 0:
            raise ValueError(
                f"`qk_size` and `vo_size` must be positive; got {qk_size} and {vo_size} "
                f"(they default to query_size // num_heads = {query_size} // {num_heads})."
            )
        if rotary_theta is not None and (qk_size % 2 or rotary_theta <= 0):
            raise ValueError(
                "rotary embedding needs an even `qk_size` and a positive `rotary_theta`; got "
                f"qk_size={qk_size}, rotary_theta={rotary_theta!r}."
            )
        score = _with_standard_slopes(score, num_heads)
        compile_score(score, num_heads)  # a table or slopes of the wrong head count: say now
        # The key split of eqx.nn.MultiheadAttention: equal keys give equal initial weights.
        qkey, kkey, vkey, okey = jax.random.split(key, 4)
        self.query_proj = eqx.nn.Linear(query_size, num_heads * qk_size, use_bias=use_query_bias,
                                        dtype=dtype, key=qkey)
        self.key_proj = eqx.nn.Linear(key_size, num_kv_heads * qk_size, use_bias=use_key_bias,
                                      dtype=dtype, key=kkey)
        self.value_proj = eqx.nn.Linear(value_size, num_kv_heads * vo_size,
                                        use_bias=use_value_bias, dtype=dtype, key=vkey)
        self.output_proj = eqx.nn.Linear(num_heads * vo_size, output_size,
                                         use_bias=use_output_bias, dtype=dtype, key=okey)
        self.attention = BlockSparseAttention(
            mask=mask, kernel=kernel, tiling=tiling, sharding=sharding,
            softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, score=score,
            qkv_layout="bhsd", num_heads=num_heads,
        )
        self.dropout = eqx.nn.Dropout(dropout_p, inference=inference)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.query_size = query_size
        self.key_size = key_size
        self.value_size = value_size
        self.output_size = output_size
        self.qk_size = qk_size
        self.vo_size = vo_size
        self.rotary_theta = None if rotary_theta is None else float(rotary_theta)

    @typechecked(validate=_validate_layer_call)
    def __call__(
        self,
        query: Float[Array, "q_len query_size"],
        key_: Float[Array, "kv_len key_size"],
        value: Float[Array, "kv_len value_size"],
        mask: Bool[Array, "*heads q_len kv_len"] | None = None,
        *,
        bias: Float[ArrayOrNumpy, "..."] | None = None,
        sinks: Float[ArrayOrNumpy, "..."] | None = None,
        kv_seq_lengths: Integer[ArrayOrNumpy, ""] | int | None = None,
        q_positions: Integer[ArrayOrNumpy, " q_len"] | None = None,
        kv_positions: Integer[ArrayOrNumpy, " kv_len"] | None = None,
        q_segment_ids: Integer[ArrayOrNumpy, " q_len"] | None = None,
        kv_segment_ids: Integer[ArrayOrNumpy, " kv_len"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        key_value_seq_lengths: Integer[ArrayOrNumpy, ""] | int | None = None,
        return_lse: bool = False,
    ) -> Float[Array, "q_len output_size"] | tuple[Float[Array, "q_len output_size"],
                                                     Float[Array, "heads q_len"]]:
        """**Arguments:**

        - `query`: ``[Lq, query_size]``.
        - `key_`: ``[Lk, key_size]``.
        - `value`: ``[Lk, value_size]``.
        - `mask`: booleans ``[Lq, Lk]`` or ``[num_heads or 1, Lq, Lk]`` (True: attend; integers
          count where nonzero), as in `eqx.nn.MultiheadAttention`; and'ed with the layer's
          mask (a mask strategy such as `masks.Causal()` goes in the constructor). It is
          per-call data (a `masks.ArrayMask`): its block layout is built on the device, so a
          new mask never recompiles, and blocks it leaves empty are skipped.
        - `bias`: additive logits bias broadcasting to ``[num_heads, Lq, Lk]``.
        - `sinks`: attention sinks, read as `BlockSparseAttention`'s `sinks` (``[S]``,
          ``[num_heads]``, ``[num_kv_heads]``, ``[num_heads, S]``, ``[num_kv_heads, S]``).
        - `kv_seq_lengths` (or jax.nn's `key_value_seq_lengths`): an int (or an integer
          scalar array): only the first `kv_seq_lengths` keys are seen, the rest is padding
          (per example under `jax.vmap`).
        - `q_positions`, `kv_positions`: ``[Lq]``, ``[Lk]`` ints; the rotary embedding and
          the positional masks read them. Default: the token indices.
        - `q_segment_ids`, `kv_segment_ids`: ``[Lq]``, ``[Lk]`` ints for packed documents (a
          query sees a key only in its own document; ``-1`` marks padding).
        - `key`: a `jax.random` key for dropout (keyword only).
        - `inference`: overrides the module's `inference` for this call.
        - `return_lse`: also return each head's log-sum-exp ``[num_heads, Lq]`` (as
          `BlockSparseAttention`'s `return_lse`).

        **Returns:** ``[Lq, output_size]``; with `return_lse`, ``(out, lse)``.
        """
        q_len, kv_len = query.shape[0], key_.shape[0]
        q = self._heads(self.query_proj, query, self.num_heads)        # [H, Lq, qk]
        k = self._heads(self.key_proj, key_, self.num_kv_heads)        # [Hkv, Lk, qk]
        v = self._heads(self.value_proj, value, self.num_kv_heads)     # [Hkv, Lk, vo]
        if self.rotary_theta is not None:
            q_pos = jnp.arange(q_len) if q_positions is None else jnp.asarray(q_positions)
            kv_pos = jnp.arange(kv_len) if kv_positions is None else jnp.asarray(kv_positions)
            q = apply_rotary(q, q_pos, self.rotary_theta)
            k = apply_rotary(k, kv_pos, self.rotary_theta)
        attention = self.attention
        if mask is not None:
            from .strategies.masks import ArrayMask

            attention = eqx.tree_at(lambda a: a.mask, attention,
                                    and_masks(attention.mask, ArrayMask(mask)))
        out = attention(
            q, k, v, bias=bias, sinks=sinks, kv_seq_lengths=kv_seq_lengths,
            q_positions=q_positions, kv_positions=kv_positions,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, return_lse=return_lse,
        )                                                              # [H, Lq, vo]
        out, lse = out if return_lse else (out, None)
        out = self.dropout(out, key=key, inference=inference)
        out = jnp.transpose(out, (1, 0, 2)).reshape(q_len, self.num_heads * self.vo_size)
        out = jax.vmap(self.output_proj)(out)
        return out if lse is None else (out, lse)

    @staticmethod
    def _heads(proj: eqx.nn.Linear, x, heads: int):
        """``[L, channels] -> [heads, L, channels_per_head]``."""
        projected = jax.vmap(proj)(x)
        return jnp.transpose(projected.reshape(x.shape[0], heads, -1), (1, 0, 2))
