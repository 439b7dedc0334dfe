"""Per-call data (bias, sinks, segment ids, positions), checked and brought to kernel shapes."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


class AttentionInputs(eqx.Module):
    """Per-call data in the shapes every kernel reads (all batched).

    - `bias`: ``[bb, hb, q_len, kv_len]`` with ``bb`` in ``{1, batch}``, ``hb`` in ``{1, heads}``.
    - `sinks`: ``[heads, num_sinks]``: extra logits joining every row's softmax denominator.
    - `q_segment_ids`/`kv_segment_ids`: ``[batch, len]`` int32; ``-1`` (any negative) is padding.
    - `q_positions`/`kv_positions`: ``[batch, len]`` int32.
    """

    bias: Float[Array, "bb hb lq lk"] | None = None
    sinks: Float[Array, "h s"] | None = None
    q_segment_ids: Int[Array, "b lq"] | None = None
    kv_segment_ids: Int[Array, "b lk"] | None = None
    q_positions: Int[Array, "b lq"] | None = None
    kv_positions: Int[Array, "b lk"] | None = None


@dataclasses.dataclass(frozen=True)
class MaskInfo:
    """Segment ids and positions in one object, for `blocksparse_attention(mask_info=...)`.

    Each field is ``[batch, len]`` or ``[len]`` integers, or ``None``.
    """

    q_segment_ids: Array | None = None
    kv_segment_ids: Array | None = None
    q_positions: Array | None = None
    kv_positions: Array | None = None


#: Positions lie in ``[-POSITION_LIMIT, POSITION_LIMIT]``. Masks compare positions in int32
#: with sums such as ``q + window`` or ``q + offset``; inside this range (and with mask sizes up
#: to it) those sums are exact.
POSITION_LIMIT = 2**30


def _within(name: str, x, bad, message: str):
    """Raise `ValueError` now if `x` is concrete and `bad(x)` holds anywhere; inside a trace,
    check at run time (`eqx.error_if`: one reduction over the per-call array)."""
    if isinstance(x, jax.core.Tracer):
        return eqx.error_if(x, jnp.any(bad(x)), f"`{name}` {message}")
    with jax.ensure_compile_time_eval():  # a concrete array inside someone's trace, too
        found = bool(jnp.any(bad(x)))
    if found:
        raise ValueError(f"`{name}` {message}")
    return x


def _check_positions(name: str, x):
    if x is None:
        return None
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        return x  # `_token_data` says what it accepts
    return _within(
        name, x, lambda p: (p < -POSITION_LIMIT) | (p > POSITION_LIMIT),
        "must lie in [-2**30, 2**30] (masks compare positions in int32); got values outside.",
    )


def _shape(x) -> tuple:
    return tuple(np.shape(x))


def _token_data(name: str, x, batch: int, length: int, batched: bool) -> Array | None:
    if x is None:
        return None
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"`{name}` must hold integers; got dtype {x.dtype}.")
    accepted = f"[{length}]" + (f" or [{batch}, {length}]" if batched else "")
    if x.ndim == 1 and x.shape[0] == length:
        x = jnp.broadcast_to(x, (batch, length))
    elif batched and x.shape == (batch, length):
        pass
    else:
        raise ValueError(f"`{name}` must have shape {accepted}; got {_shape(x)}.")
    return x.astype(jnp.int32)


def _bias(bias, batch: int, heads: int, q_len: int, kv_len: int, batched: bool) -> Array | None:
    if bias is None:
        return None
    bias = jnp.asarray(bias)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"`bias` must be a floating array; got dtype {bias.dtype}.")
    full = (batch, heads, q_len, kv_len) if batched else (heads, q_len, kv_len)
    if bias.ndim > len(full) or bias.ndim < 2:
        raise ValueError(
            f"`bias` must broadcast to {list(full)} and have at least 2 dimensions; "
            f"got shape {_shape(bias)}."
        )
    try:
        jnp.broadcast_shapes(bias.shape, full)
    except ValueError:
        raise ValueError(f"`bias` must broadcast to {list(full)}; got shape {_shape(bias)}.") from None
    # -inf hides a pair; +inf has no meaning as a softmax weight (inf / inf): refuse it.
    bias = _within("bias", bias, lambda b: b == jnp.inf,
                   "must be finite or -inf (which hides a pair); got +inf.")
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    bb, hb = bias.shape[0], bias.shape[1]
    return jnp.broadcast_to(bias, (bb, hb, q_len, kv_len))


def _sinks(sinks, heads: int) -> Array | None:
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"`softmax_aux` (sinks) must be a floating array; got dtype {sinks.dtype}.")
    if sinks.ndim == 1 and sinks.shape[0] == heads:
        return sinks[:, None]
    if sinks.ndim == 1:
        return jnp.broadcast_to(sinks[None, :], (heads, sinks.shape[0]))
    if sinks.ndim == 2 and sinks.shape[0] == heads:
        return sinks
    raise ValueError(
        f"`softmax_aux` (sinks) must have shape [num_sinks] (shared by all heads), "
        f"[{heads}] (one per head) or [{heads}, num_sinks]; got {_shape(sinks)}."
    )


def prepare_inputs(
    *,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    batched: bool,
    bias=None,
    sinks=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_positions=None,
    kv_positions=None,
) -> AttentionInputs:
    """Check the per-call data against the attention shapes and bring it to kernel shapes."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(
            "pass both `q_segment_ids` and `kv_segment_ids`, or neither; got only "
            + ("`q_segment_ids`." if kv_segment_ids is None else "`kv_segment_ids`.")
        )
    return AttentionInputs(
        bias=_bias(bias, batch, heads, q_len, kv_len, batched),
        sinks=_sinks(sinks, heads),
        q_segment_ids=_token_data("q_segment_ids", q_segment_ids, batch, q_len, batched),
        kv_segment_ids=_token_data("kv_segment_ids", kv_segment_ids, batch, kv_len, batched),
        q_positions=_token_data("q_positions", _check_positions("q_positions", q_positions),
                                batch, q_len, batched),
        kv_positions=_token_data("kv_positions", _check_positions("kv_positions", kv_positions),
                                 batch, kv_len, batched),
    )
