"""Per-call data (bias, sinks, segment ids, positions), checked and brought to kernel shapes."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._mask import LENGTH_PADDING
from ._score import ScoreTerms
from ._values import poisoned as _poisoned
from ._values import within as _within


class AttentionInputs(eqx.Module):
    """Per-call data in the shapes every kernel reads (all batched).

    - `bias`: ``[bb, hb, q_len or 1, kv_len or 1]`` with ``bb`` in ``{1, batch}``, ``hb`` in
      ``{1, heads}``: the size-1 axes the caller gave are kept. A kernel that reads them
      (`AbstractBroadcastBiasKernel`) gets this form; the plan broadcasts the bias to
      ``[bb, hb, q_len, kv_len]`` for every other kernel (`full_bias`).
    - `sinks`: ``[heads, num_sinks]``: extra logits joining every row's softmax denominator.
    - `q_segment_ids`/`kv_segment_ids`: ``[batch, len]`` int32; ``-1`` (any negative) is padding.
      Callers may pass any integer dtype, signed or unsigned, whose values fit in int32.
    - `q_positions`/`kv_positions`: ``[batch, len]`` int32.
    - `score`: the `ScoreTerms` (ALiBi slopes, a relative-bias table, a score function) a
      kernel adds to each logit before the soft cap, or ``None``; its arrays are
      differentiable.
    """

    bias: Float[Array, "bb hb lq_or_1 lk_or_1"] | None = None
    sinks: Float[Array, "h s"] | None = None
    q_segment_ids: Int[Array, "b lq"] | None = None
    kv_segment_ids: Int[Array, "b lk"] | None = None
    q_positions: Int[Array, "b lq"] | None = None
    kv_positions: Int[Array, "b lk"] | None = None
    score: ScoreTerms | None = None


@dataclasses.dataclass(frozen=True)
class MaskInfo:
    """What masks one call, in one object, for `blocksparse_attention(mask_info=...)`.

    - `attention_mask`: booleans (or integers, nonzero = visible), ``[B or 1, H or 1, Lq, Lk]``,
      ``[B or 1, Lq, Lk]`` or ``[Lq, Lk]``: an element mask (`masks.ArrayMask`), combined
      by ``&`` with the rest of the call's mask.
    - `q_segment_ids`, `kv_segment_ids`: ``[batch, len]`` or ``[len]`` integers (``-1`` pads).
    - `q_positions`, `kv_positions`: ``[batch, len]`` or ``[len]`` integers.

    Every field defaults to ``None``. A field given both here and directly is an error.

    ```python
    info = MaskInfo(q_segment_ids=ids, kv_segment_ids=ids, attention_mask=keep)
    out = blocksparse_attention(q, k, v, mask_info=info)
    ```
    """

    q_segment_ids: Array | None = None
    kv_segment_ids: Array | None = None
    q_positions: Array | None = None
    kv_positions: Array | None = None
    attention_mask: Array | None = None


#: Positions lie in ``[-POSITION_LIMIT, POSITION_LIMIT - 1]`` and mask sizes (causal offsets,
#: windows, chunks, prefixes, ...) are at most ``POSITION_LIMIT`` in magnitude. Masks and
#: kernels compare positions in int32 through one sum of a position and a size (``q + window``,
#: ``q - left``) or one difference of two positions (``q - k``); inside these ranges every such
#: sum and difference lies in ``[-2**31, 2**31 - 1]``, so it is exact.
POSITION_LIMIT = 2**30


def _check_range(name: str, x, low: int, high: int, accepted: str):
    """`x` (any integer dtype, signed or not) checked to lie in ``[low, high]`` before it is
    narrowed to int32; bounds its dtype cannot pass are not compared (nothing to check for
    int32 segment ids, no negative bound for unsigned ids). A NumPy `x` stays NumPy and is
    checked on the host: `jnp.asarray` would narrow int64 to int32 first (without x64,
    ``2**32`` becomes 0) and the check would pass the aliased value."""
    if x is None:
        return None
    x = x if isinstance(x, jax.Array) else np.asarray(x)
    if not np.issubdtype(x.dtype, np.integer):
        return x  # `check_call` says what it accepts
    info = np.iinfo(x.dtype)
    below, above = low > int(info.min), high < int(info.max)
    if not (below or above):
        return x

    def bad(v):
        out = False
        if below:
            out = out | (v < low)
        if above:
            out = out | (v > high)
        return out

    return _within(name, x, bad, f"must lie in {accepted}; got values outside.")


def _check_positions(name: str, x):
    return _check_range(name, x, -POSITION_LIMIT, POSITION_LIMIT - 1,
                        "[-2**30, 2**30 - 1] (masks compare positions in int32)")


def _check_segment_ids(name: str, x):
    return _check_range(name, x, -(2**31), 2**31 - 1,
                        "[-2**31, 2**31 - 1] (segment ids are compared in int32)")


def check_token_range(name: str, x):
    """Positions (`name` ends in ``positions``) or segment ids checked to fit int32 as the
    masks compare them, on the host for a NumPy `x` (before any narrowing), a one-line
    `ValueError` naming `name` otherwise."""
    check = _check_positions if name.endswith("positions") else _check_segment_ids
    return check(name, x)


def _shape(x) -> tuple:
    return tuple(np.shape(x))


def python_scalar(x):
    """A NumPy number as the Python number it holds (static fields must hash and compare
    plainly); anything else unchanged."""
    if isinstance(x, np.generic) and np.issubdtype(type(x), np.number):
        return x.item()
    return x


def as_array(name: str, x) -> Array:
    """`x` as a JAX array (NumPy arrays, Python scalars and nested lists are converted)."""
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, (str, bytes)) or x is None:
        raise TypeError(f"`{name}` must be an array (JAX or NumPy); got {type(x).__name__}.")
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError):
        raise TypeError(
            f"`{name}` must be an array (JAX or NumPy); got {type(x).__name__}."
        ) from None


def as_bool_mask(name: str, x) -> Array:
    """A boolean or integer element mask `x` as booleans (integers count where nonzero), or
    the `TypeError` naming `name`. A NumPy (or nested-list) `x` is compared with 0 on the host:
    `jnp.asarray` would first narrow int64 to int32 (without x64, ``2**32`` becomes 0 and a
    visible pair would be hidden)."""
    if not isinstance(x, jax.Array):
        x = _host_array(name, x)
    if x.dtype != np.bool_ and not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"`{name}` must hold booleans (or integers, nonzero = attend); got "
                        f"dtype {_dtype_name(x)}.")
    return jnp.asarray(x if x.dtype == np.bool_ else x != 0)


def _dtype_name(x) -> str:
    return jnp.dtype(x.dtype).name


def check_qkv(query, key, value) -> tuple[Array, Array, Array]:
    """`query`, `key`, `value` as JAX arrays, or the error that says what is wrong with them."""
    query, key, value = as_array("query", query), as_array("key", key), as_array("value", value)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"`{name}` must be a floating-point array (bfloat16, float16, float32 or "
                f"float64); got dtype {_dtype_name(x)}."
            )
    if not (query.ndim == key.ndim == value.ndim) or query.ndim not in (3, 4):
        raise ValueError(
            "`query`, `key`, `value` must all be [batch, heads, len, dim] or all [heads, len, dim]; "
            f"got shapes {_shape(query)}, {_shape(key)}, {_shape(value)}."
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"`query`, `key`, `value` must share one dtype; got {_dtype_name(query)}, "
            f"{_dtype_name(key)}, {_dtype_name(value)}."
        )
    if query.ndim == 4 and not (query.shape[0] == key.shape[0] == value.shape[0]):
        raise ValueError(
            f"`query`, `key`, `value` must share the batch size; got {query.shape[0]}, "
            f"{key.shape[0]}, {value.shape[0]}."
        )
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if value.shape[-3] != kv_heads:
        raise ValueError(f"`key` has {kv_heads} heads but `value` has {value.shape[-3]}.")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads}) "
            "(grouped-query attention)."
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"`key` and `value` must have the same length; got {key.shape[-2]} and {value.shape[-2]}."
        )
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"`query` and `key` must have the same head dim; got {query.shape[-1]} and {key.shape[-1]}."
        )
    if query.shape[-1] == 0 or value.shape[-1] == 0:
        raise ValueError(
            f"head dims must be positive; got dim={query.shape[-1]} (`query`, `key`) and "
            f"value_dim={value.shape[-1]} (`value`)."
        )
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        raise ValueError(
            f"sequence lengths must be positive; got q_len={query.shape[-2]}, kv_len={key.shape[-2]}."
        )
    return query, key, value


def _host_array(name: str, x) -> np.ndarray:
    """`x` (not a JAX array) as a NumPy array of its own dtype: int64 stays int64 whether or
    not JAX has x64 on, so that a range check sees the values the caller gave."""
    if isinstance(x, (str, bytes)):
        raise TypeError(f"`{name}` must be an array (JAX or NumPy); got {type(x).__name__}.")
    try:
        return np.asarray(x)
    except (TypeError, ValueError, OverflowError):
        raise TypeError(
            f"`{name}` must be an array (JAX or NumPy); got {type(x).__name__}."
        ) from None


def _check_token_data(name: str, x, batch: int, length: int, batched: bool) -> Array | None:
    """Segment ids or positions (`name` says which) checked for dtype and shape; a NumPy
    array (or list) also for range, on the host, before it becomes a JAX array (which may
    narrow it to int32). JAX arrays are range-checked by `prepare_inputs`."""
    if x is None:
        return None
    host = not isinstance(x, jax.Array)
    x = _host_array(name, x) if host else x
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(
            f"`{name}` must hold integers; got dtype {_dtype_name(x)} (any integer dtype "
            "is accepted: cast it, e.g. with `.astype(jnp.int32)`)."
        )
    accepted = f"[{length}]" + (f" or [{batch}, {length}]" if batched else "")
    if not ((x.ndim == 1 and x.shape[0] == length) or (batched and x.shape == (batch, length))):
        raise ValueError(f"`{name}` must have shape {accepted}; got {_shape(x)}.")
    if host:
        x = jnp.asarray(check_token_range(name, x))
    return x


def _token_data(x, batch: int, length: int) -> Array | None:
    """Checked token data (`_check_token_data`) as ``[batch, length]`` int32."""
    if x is None:
        return None
    return jnp.broadcast_to(x, (batch, length)).astype(jnp.int32)


def _check_bias(bias, batch: int, heads: int, q_len: int, kv_len: int, batched: bool):
    if bias is None:
        return None
    bias = as_array("bias", bias)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"`bias` must be a floating array; got dtype {_dtype_name(bias)}.")
    full = (batch, heads, q_len, kv_len) if batched else (heads, q_len, kv_len)
    if bias.ndim > len(full):
        raise ValueError(f"`bias` must broadcast to {list(full)}; got shape {_shape(bias)}.")
    given = _shape(bias)
    if bias.ndim < 2:  # as NumPy broadcasts it (and jax.nn): a 1-D bias is one per key
        bias = bias.reshape((1,) * (2 - bias.ndim) + bias.shape)
    try:
        jnp.broadcast_shapes(bias.shape, full)
    except ValueError:
        raise ValueError(f"`bias` must broadcast to {list(full)}; got shape {given}.") from None
    return bias


def _bias(bias) -> Array | None:
    """A checked bias (`_check_bias`) as ``[bb, hb, q_len or 1, kv_len or 1]`` (its size-1
    axes kept: a per-key bias costs ``O(kv_len)``), refusing ``+inf`` and NaN."""
    if bias is None:
        return None
    # -inf hides a pair (without a soft cap, which turns it into -cap); +inf has no meaning
    # as a softmax weight (inf / inf) and NaN none at all: refuse both, as for sinks.
    # (A traced bias is checked by `eqx.error_if`, whose error JAX prints with its callback's
    # frames: a host callback of our own would not lower for another platform than the
    # host's, which the CUDA lowering checks on a CPU do.)
    bias = _within("bias", bias, lambda b: jnp.isnan(b) | (b == jnp.inf),
                   "must be finite or -inf (which hides a pair); got +inf or NaN.")
    return bias.reshape((1,) * (4 - bias.ndim) + bias.shape)


def full_bias(inputs: AttentionInputs, q_len: int, kv_len: int) -> AttentionInputs:
    """`inputs` with the bias broadcast to ``[bb, hb, q_len, kv_len]``: the form kernels that
    do not read size-1 axes (every kernel but an `AbstractBroadcastBiasKernel`) receive.
    Autodiff sums the bias's gradient back to the caller's shape."""
    if inputs.bias is None:
        return inputs
    bb, hb = inputs.bias.shape[:2]
    bias = jnp.broadcast_to(inputs.bias, (bb, hb, q_len, kv_len))
    return eqx.tree_at(lambda x: x.bias, inputs, bias)


def _sink_shapes(heads: int, kv_heads: int) -> str:
    """The sink shapes every entry point accepts (the module's and the layer's `sinks`, the
    function's `softmax_aux`), read as `BlockSparseAttention.__call__`'s docstring says."""
    if kv_heads == heads:
        return (f"[num_sinks] (shared by all heads), [{heads}] (one per head) or "
                f"[{heads}, num_sinks]")
    return (f"[num_sinks] (shared by all heads), [{heads}] (one per head), [{kv_heads}] (one "
            f"per kv head), [{heads}, num_sinks] or [{kv_heads}, num_sinks]")


def _check_sinks(sinks, heads: int, name: str, kv_heads: int | None = None):
    """Checked sinks, those given per kv head (``[Hkv]``, ``[Hkv, S]`` with ``Hkv != H``)
    repeated over each kv head's query heads to ``[H, S]``."""
    if sinks is None:
        return None
    sinks = as_array(name, sinks)
    label = f"`{name}`" if name == "sinks" else f"`{name}` (sinks)"
    kv_heads = heads if kv_heads is None else kv_heads
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"{label} must be a floating array; got dtype {_dtype_name(sinks)}.")
    if not (sinks.ndim == 1 or (sinks.ndim == 2 and sinks.shape[0] in (heads, kv_heads))):
        raise ValueError(
            f"{label} must have shape {_sink_shapes(heads, kv_heads)}; got {_shape(sinks)}."
        )
    if kv_heads != heads and sinks.shape[0] == kv_heads:
        per_kv = sinks[:, None] if sinks.ndim == 1 else sinks
        return jnp.repeat(per_kv, heads // kv_heads, axis=0)
    return sinks


def _sinks(sinks, heads: int, name: str) -> Array | None:
    """Checked sinks (`_check_sinks`) as ``[heads, num_sinks]``: ``+inf`` and NaN refused in
    concrete sinks, poisoned in traced ones."""
    if sinks is None:
        return None
    # -inf is a sink that never weighs (no sink); +inf would take every row's whole weight
    # (inf / inf) and NaN has no weight at all. Concrete sinks holding either are refused;
    # traced (learned) ones are poisoned rather than checked at run time, so every row that
    # sees a key is NaN (`_values.poisoned`).
    sinks = _poisoned(name, sinks, lambda s: jnp.isnan(s) | (s == jnp.inf),
                      "must be finite or -inf (no sink); got +inf or NaN.")
    if sinks.ndim == 2:
        return sinks
    if sinks.shape[0] == heads:
        return sinks[:, None]
    return jnp.broadcast_to(sinks[None, :], (heads, sinks.shape[0]))


def _check_segment_pair(q_segment_ids, kv_segment_ids) -> None:
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(
            "pass both `q_segment_ids` and `kv_segment_ids`, or neither; got only "
            + ("`q_segment_ids`." if kv_segment_ids is None else "`kv_segment_ids`.")
        )


def hide_keys(keep, q_segment_ids, kv_segment_ids, *, q_len: int):
    """Segment ids that hide the keys where `keep` (``[B, Lk]`` booleans) is False.

    Key padding rides on the segment ids (a hidden key gets id `LENGTH_PADDING`, int32's
    least, which no query matches and every mask hides: `NonPaddingKeys`), so its layout is
    built on the device like theirs: new padding never recompiles, and blocks of padding are
    skipped. Without segment ids every query gets id 0. Returns ``(q_segment_ids,
    kv_segment_ids)``, ``[B, Lq]`` and ``[B, Lk]`` (the key ids as int32).
    """
    batch, kv_len = keep.shape
    if q_segment_ids is None:
        q_segment_ids = jnp.zeros((batch, q_len), jnp.int32)
        kv_segment_ids = jnp.zeros((batch, kv_len), jnp.int32)
    q_segment_ids = jnp.broadcast_to(q_segment_ids, (batch, q_len))
    kv_segment_ids = jnp.broadcast_to(kv_segment_ids, (batch, kv_len)).astype(jnp.int32)
    return q_segment_ids, jnp.where(keep, kv_segment_ids, jnp.int32(LENGTH_PADDING))


def check_kv_seq_lengths(lengths, batch: int, kv_len: int, batched: bool, *,
                         name: str = "kv_seq_lengths", what: str = "kv_len"):
    """`kv_seq_lengths` (``[B]`` or a scalar: the number of real keys, the rest is padding)
    as ``[B]`` ints, or the error saying why not. The same check serves any count of real
    tokens of a sequence of `kv_len` (`name` and `what` name the argument and that length:
    ``query_seq_lengths`` against ``q_len``)."""
    if lengths is None:
        return None
    # NumPy lengths are checked on the host, before `jnp.asarray` can narrow them (an int64
    # 2**32 would become 0: every key padding).
    host = not isinstance(lengths, jax.Array)
    lengths = _host_array(name, lengths) if host else lengths
    if not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"`{name}` must hold integers; got dtype {_dtype_name(lengths)}.")
    accepted = f"[{batch}] or a scalar" if batched else "a scalar"
    if not (lengths.ndim == 0 or (batched and lengths.shape == (batch,))):
        raise ValueError(f"`{name}` must have shape {accepted}; got {_shape(lengths)}.")
    lengths = _within(name, lengths, lambda n: (n < 0) | (n > kv_len),
                      f"must lie in [0, {kv_len}] ({what}); got values outside.")
    return jnp.broadcast_to(jnp.asarray(lengths), (batch,))


def check_call(query, key, value, *, sinks_name: str = "sinks", **data) -> tuple:
    """Check one call's arguments before anything else looks at them, once per call.

    `data` holds the per-call arrays by their `__call__` names (``bias``, ``sinks``,
    ``q_segment_ids``, ..., ``kv_seq_lengths``). Returns ``(query, key, value, data)`` with
    every array-like turned into a JAX array; raises `TypeError`/`ValueError` naming the
    argument, what was given and what is accepted. `sinks_name` is the name the caller wrote
    for the sinks.
    """
    query, key, value = check_qkv(query, key, value)
    return query, key, value, check_call_data(query, key, value, sinks_name=sinks_name, **data)


def check_call_data(query, key, value, *, sinks_name: str = "sinks", **data) -> dict:
    """`check_call` for a `query`, `key` and `value` that `check_qkv` has checked: the
    per-call `data`, checked against their shapes."""
    batched = query.ndim == 4
    batch = query.shape[0] if batched else 1
    heads, q_len = query.shape[-3], query.shape[-2]
    kv_len = key.shape[-2]
    lengths = {"q_segment_ids": q_len, "kv_segment_ids": kv_len, "q_positions": q_len,
               "kv_positions": kv_len}
    out = dict(data)
    for name, length in lengths.items():
        if name in out:
            out[name] = _check_token_data(name, out[name], batch, length, batched)
    if "bias" in out:
        out["bias"] = _check_bias(out["bias"], batch, heads, q_len, kv_len, batched)
    if "sinks" in out:
        out["sinks"] = _check_sinks(out["sinks"], heads, sinks_name, key.shape[-3])
    if out.get("kv_seq_lengths") is not None:
        out["kv_seq_lengths"] = check_kv_seq_lengths(out["kv_seq_lengths"], batch, kv_len,
                                                     batched)
    _check_segment_pair(out.get("q_segment_ids"), out.get("kv_segment_ids"))
    return out


def prepare_inputs(
    *,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    bias=None,
    sinks=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_positions=None,
    kv_positions=None,
    sinks_name: str = "sinks",
) -> AttentionInputs:
    """Bring per-call data that `check_call` has checked (shapes, dtypes) to kernel shapes,
    with the checks of their values (ranges, ``+inf`` and NaN), which need the arrays
    themselves."""
    return AttentionInputs(
        bias=_bias(bias),
        sinks=_sinks(sinks, heads, sinks_name),
        q_segment_ids=_token_data(_check_segment_ids("q_segment_ids", q_segment_ids),
                                  batch, q_len),
        kv_segment_ids=_token_data(_check_segment_ids("kv_segment_ids", kv_segment_ids),
                                   batch, kv_len),
        q_positions=_token_data(_check_positions("q_positions", q_positions), batch, q_len),
        kv_positions=_token_data(_check_positions("kv_positions", kv_positions), batch, kv_len),
    )
