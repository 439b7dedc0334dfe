"""`blocksparse_attention`: the function-style front door, with the call signature of the kernel
library it replaces. It builds a `BlockSparseAttention` and calls it: one implementation."""

import dataclasses
import inspect
import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Integer

from ._inputs import (MaskInfo, as_array, as_bool_mask, check_call_data, check_kv_seq_lengths,
                      check_qkv, hide_keys,
                      python_scalar)
from ._kernel import AbstractKernel, registered_kernels
from ._mask import AbstractMask, Full, and_masks
from ._module import (BlockSparseAttention, _fits_bhsd, _swapped, check_layout, merge_alias,
                      run_plan, with_layout_hint)
from ._score import AbstractScore, compile_score
from ._selector import DEVICE_PLATFORMS
from ._sharding import run_on_auto_axes
from ._tiling import LAUNCH_FIELDS, AbstractKernelConfig, AbstractTiling, Tiling, check_positive
from ._typing import typechecked
from ._values import within

#: ejKernel's platform names that pick a device, not a kernel (``"auto"``: JAX's default).
_DEVICE_ALIASES = {"auto": None, "cuda": "gpu"}
#: Other names of kernels.
_KERNEL_ALIASES = {"dense": "reference", "flash": "triton"}
#: Tensor layout names for `qkv_layouts`: True when the sequence axis comes before the heads.
_LAYOUT_NAMES = {"bhsd": False, "bhtd": False, "bshd": True, "bthd": True}
_LAYOUTS_ACCEPTED = (
    "'bhsd' ([batch, heads, seq, head_dim], the default) or 'bshd' ([batch, seq, heads, "
    "head_dim]), one name for all three or a tuple of three (query, key, value)"
)
#: ejKernel's `cfg` (`fwd_params` / `bwd_params`) field names, as `TritonConfig` fields (the
#: blocks alone are `Tiling`'s).
_SEED_FWD = {"q_blocksize": "block_q", "kv_blocksize": "block_kv", "num_warps": "num_warps",
             "num_stages": "num_stages"}
_SEED_BWD = {"q_blocksize": "block_q_bwd", "kv_blocksize": "block_kv_bwd",
             "num_warps": "num_warps_bwd", "num_stages": "num_stages_bwd"}
#: What `fused_backward` (ejKernel's switch, accepted for its callers) now says.
FUSED_BACKWARD_DEPRECATION = (
    "`fused_backward` has no effect and will be removed: every kernel here runs its own "
    "backward. For a single-pass backward use BlockSparseAttention(kernel="
    "kernels.MosaicBlockSparse(deterministic=False)) on a Hopper GPU."
)
_BUILDER_FORMS = (
    "a mask, a zero-argument callable returning one, or a callable "
    "`(q_len, kv_len, num_heads, head_idx, num_reps) -> mask` called once per query head"
)
#: `jax.nn.dot_product_attention`'s arguments that ejKernel's function lacks. A call that uses
#: one (``None`` included), or `bias` by keyword (ejKernel takes it positionally only), is read
#: as jax.nn reads it: not causal unless `is_causal` (or `causal`) says so, its arrays jax.nn's
#: ``[B, T, N, H]`` unless `qkv_layouts` or their shapes say otherwise (`_jax_nn_layout`).
JAX_NN_NAMES = ("scale", "is_causal", "key_value_seq_lengths", "query_seq_lengths", "mask",
                "local_window_size", "implementation", "return_residual")
#: This function's arguments that jax.nn lacks and that change what is computed (the
#: execution options, `qkv_layouts`, `platform`, `cfg`, the mesh, `purify` and `return_lse`,
#: do not). Mixed with jax.nn's names they leave the causal default ambiguous: here ``True``,
#: in jax.nn ``False``.
OWN_NAMES = ("softmax_aux", "q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions",
             "attention_mask", "mask_info", "logits_soft_cap", "softmax_scale", "mask_builder",
             "sliding_window", "chunk_size", "score", "kv_seq_lengths")
#: jax.nn's `implementation` values, as this function's `platform` (a kernel name).
_IMPLEMENTATIONS = {"xla": "xla", "cudnn": "cudnn"}


class _NotGiven:
    """The default of jax.nn's names, which tells an argument not passed from one passed as
    ``None``: a wrapper that forwards its own arguments passes ``mask=None`` and means
    jax.nn's call, whose defaults (not causal) then apply."""

    __slots__ = ()

    def __repr__(self):
        return "<not given>"


NOT_GIVEN = _NotGiven()


def _positional_arity(fn) -> tuple[int, int] | None:
    """(required, accepted) positional parameters of `fn`; accepted is large for ``*args``."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in parameters if p.kind in kinds]
    required = sum(p.default is p.empty for p in positional)
    many = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in parameters)
    return required, (1 << 30) if many else len(positional)


def _built_mask(result, call: str) -> AbstractMask:
    if not isinstance(result, AbstractMask):
        raise TypeError(
            f"`{call}` must return a mask (an AbstractMask such as masks.Causal()); it returned "
            f"{type(result).__name__}. `mask_builder` accepts {_BUILDER_FORMS}."
        )
    return result


def _mask_from_builder(mask_builder, q_len: int, kv_len: int, heads: int, kv_heads: int):
    from .strategies import masks

    if mask_builder is None:
        return Full()
    if isinstance(mask_builder, AbstractMask):
        return mask_builder
    if not callable(mask_builder):
        raise TypeError(
            f"`mask_builder` must be {_BUILDER_FORMS}; got {type(mask_builder).__name__}."
        )
    arity = _positional_arity(mask_builder)
    if arity is None or arity[0] == 0:
        return _built_mask(mask_builder(), "mask_builder()")
    required, accepted = arity
    if required <= 5 <= accepted:
        reps = heads // kv_heads
        per_head = [
            _built_mask(mask_builder(q_len, kv_len, heads, h, reps),
                        f"mask_builder({q_len}, {kv_len}, {heads}, {h}, {reps})")
            for h in range(heads)
        ]
        if all(eqx.tree_equal(m, per_head[0]) is True for m in per_head[1:]):
            return per_head[0]
        return masks.PerHead(per_head)
    raise TypeError(
        f"`mask_builder` must be {_BUILDER_FORMS}; got a callable with {required} required "
        "positional arguments."
    )


def _window(value, argument: str) -> AbstractMask:
    """`sliding_window` (or jax.nn's `local_window_size`, named `argument`) as its mask."""
    from .strategies import masks

    try:
        if isinstance(value, int) and not isinstance(value, bool):
            return masks.SlidingWindow(value)
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return masks.SlidingWindow(*value)
        raise ValueError("neither an int nor a pair")
    except ValueError as e:
        # Name the argument the caller wrote, not the mask it becomes.
        raise ValueError(
            f"`{argument}` must be an int >= 0 (symmetric) or a pair (left, right) of ints >= 0 "
            f"or None, not both None; got {value!r}: {e}"
        ) from None


def _mask_from_options(mask, causal, sliding_window, chunk_size) -> AbstractMask:
    from .strategies import masks

    if causal:
        mask = and_masks(mask, masks.Causal())
    if sliding_window is not None:
        mask = and_masks(mask, _window(sliding_window, "sliding_window"))
    if chunk_size is not None:
        mask = and_masks(mask, masks.ChunkedCausal(chunk_size))
    return mask


def _spec_axis(spec, dim: int, arg: str):
    entry = spec[dim] if len(spec) > dim else None
    if entry is not None and not isinstance(entry, str):
        raise ValueError(
            f"`{arg}` splits dimension {dim} over {entry!r}; each dimension may be split over "
            "one mesh axis (a name) or None."
        )
    return entry


def _sharding_from_options(mesh, in_specs, out_specs, seq_axis):
    """The sharding strategy the seed-style mesh options ask for (None: unsharded)."""
    from .strategies import sharding

    if mesh is None:
        if in_specs is not None or out_specs is not None or seq_axis is not None:
            raise ValueError(
                "`in_specs`, `out_specs` and `sequence_parallelism_mesh_axis_name` need `mesh` "
                "(a jax.sharding.Mesh)."
            )
        return None
    accepted = ("`in_specs` must be a tuple of PartitionSpecs whose first three are those of "
                "query, key and value [batch, heads, seq, head_dim]: each dimension over one "
                "mesh axis or None, head_dim unsplit, key and value split like the query "
                "(heads may be unsplit for them)")
    batch_axis = head_axis = spec_seq = None
    if in_specs is not None:
        if not isinstance(in_specs, (tuple, list)) or len(in_specs) < 3 or not all(
            isinstance(x, PartitionSpec) for x in in_specs[:3]
        ):
            raise ValueError(f"{accepted}; got {in_specs!r}.")
        q_spec, k_spec, v_spec = in_specs[:3]
        batch_axis, head_axis, spec_seq = (_spec_axis(q_spec, d, "in_specs") for d in range(3))
        if _spec_axis(q_spec, 3, "in_specs") is not None:
            raise ValueError(f"{accepted}; the query spec {q_spec} splits head_dim.")
        for name, spec in (("key", k_spec), ("value", v_spec)):
            axes = tuple(_spec_axis(spec, d, "in_specs") for d in range(4))
            if axes[0] != batch_axis or axes[1] not in (head_axis, None) or \
                    axes[2] != spec_seq or axes[3] is not None:
                raise ValueError(f"{accepted}; the {name} spec {spec} differs from the "
                                 f"query's {q_spec}.")
    if seq_axis is not None and spec_seq is not None and seq_axis != spec_seq:
        raise ValueError(
            f"`sequence_parallelism_mesh_axis_name`={seq_axis!r} differs from the sequence "
            f"axis {spec_seq!r} of the query's spec in `in_specs`."
        )
    seq_axis = seq_axis if seq_axis is not None else spec_seq
    expected = PartitionSpec(batch_axis, head_axis, seq_axis, None)
    if out_specs is not None and tuple(out_specs) + (None,) * (4 - len(out_specs)) != \
            tuple(expected):
        raise ValueError(
            f"`out_specs` must split the output [batch, heads, seq, value_dim] like the query: "
            f"{expected} (or None); got {out_specs!r}."
        )
    if seq_axis is not None:
        return sharding.RingAttention(mesh, seq_axis, batch_axis=batch_axis, head_axis=head_axis)
    if in_specs is None:
        raise ValueError(
            "`mesh` needs `in_specs` (batch and head axes) or "
            "`sequence_parallelism_mesh_axis_name` (the sequence axis) to say how to split."
        )
    return sharding.ShardMap(mesh, batch_axis=batch_axis, head_axis=head_axis)


def _check_present(platform: str) -> None:
    try:
        jax.devices(platform)
    except RuntimeError:
        available = ", ".join(sorted({repr(d.platform) for d in jax.devices()}))
        raise ValueError(
            f"`platform={platform!r}`: JAX finds no {platform} device here (available: "
            f"{available}); pass platform=None or 'auto' to run on JAX's default device."
        ) from None


def _kernel_for(platform) -> tuple[AbstractKernel | None, str | None]:
    """An explicit kernel for `platform` when it names one, else (None, device platform)."""
    if platform is None or platform in _DEVICE_ALIASES or platform in DEVICE_PLATFORMS:
        device = _DEVICE_ALIASES.get(platform, platform)
        if device is not None:
            _check_present(device)
        return None, device
    if platform == "pallas":
        # The selector's pick on a TPU (SplashBlockSparse, else PallasTpuBlockSparse, which
        # take what Splash declines); off a TPU the Pallas kernels run interpreted.
        return None, "tpu"
    wanted = _KERNEL_ALIASES.get(platform, platform)
    for cls in registered_kernels():
        if cls.name == wanted:
            return cls(), None
    if wanted in ("triton", "pallas", "cudnn"):
        raise NotImplementedError(
            f"platform={platform!r}: that kernel is not available in this installation."
        )
    known = [*DEVICE_PLATFORMS, *_DEVICE_ALIASES,
             *sorted({cls.name for cls in registered_kernels()} | set(_KERNEL_ALIASES))]
    raise ValueError(
        f"`platform` must be one of {', '.join(map(repr, known))} or None; got {platform!r}."
    )


def _seed_params(params, table: dict, where: str) -> dict:
    if params is None:
        return {}
    if isinstance(params, dict):
        for name in params:
            if name not in table:
                raise ValueError(f"`cfg.{where}` has no field {name!r}; accepted: {list(table)}.")
        values = params
    else:
        values = {name: getattr(params, name, None) for name in table}
    return {table[name]: value for name, value in values.items() if value is not None}


class SeedTiling(AbstractTiling):
    """The tiling strategy of a seed-style `cfg` with warps or stages: per kernel, its own
    config where it takes every field by name (`TritonBlockSparse`'s `TritonConfig`), else
    the kernel-independent `Tiling` of the block fields (the warps and stages only mean
    something to Triton).

    - `fields`: ``((name, value), ...)``, `Tiling`'s field names.
    """

    fields: tuple[tuple[str, int], ...]

    def choose(self, kernel, features, mask):
        fields = dict(self.fields)
        own = kernel.config_type
        if own is not Tiling and set(fields) <= {f.name for f in dataclasses.fields(own)}:
            return own(**fields), "module"
        return Tiling(**{n: x for n, x in fields.items() if n not in LAUNCH_FIELDS}), "module"


def _config_of_fields(fields: dict) -> AbstractTiling:
    """`SeedTiling` where `fields` set warps or stages, else the kernel-independent `Tiling`."""
    fields = {name: value for name, value in fields.items() if value is not None}
    blocks = {n: x for n, x in fields.items() if n not in LAUNCH_FIELDS}
    tiling = Tiling(**blocks)  # checks the blocks and the names
    if len(blocks) == len(fields):
        return tiling
    for name in LAUNCH_FIELDS:
        if name in fields:
            check_positive("cfg", name, fields[name])
    return SeedTiling(tuple(sorted(fields.items())))


def _tiling_from_cfg(cfg) -> tuple[AbstractTiling | None, str | None]:
    """The tiling that `cfg` asks for, and the platform it names (ejKernel's `cfg.platform`)."""
    if cfg is None or isinstance(cfg, AbstractKernelConfig):
        return cfg, None
    get = cfg.get if isinstance(cfg, dict) else lambda name: getattr(cfg, name, None)
    fields_accepted = [f.name for f in dataclasses.fields(Tiling)]
    if get("fwd_params") is not None or get("bwd_params") is not None:
        if isinstance(cfg, dict):
            extra = set(cfg) - {"fwd_params", "bwd_params", "platform", "backend"}
            if extra:
                raise ValueError(f"`cfg` has no field {sorted(extra)[0]!r}; accepted: fwd_params, "
                                 "bwd_params, platform, backend.")
        fields = {**_seed_params(get("fwd_params"), _SEED_FWD, "fwd_params"),
                  **_seed_params(get("bwd_params"), _SEED_BWD, "bwd_params")}
        if "block_q" not in fields or "block_kv" not in fields:
            raise ValueError("`cfg.fwd_params` must give q_blocksize and kv_blocksize.")
        try:
            return _config_of_fields(fields), get("platform")
        except ValueError as e:
            raise ValueError(f"`cfg` (as Tiling): {e}") from None
    if isinstance(cfg, dict):
        for name in cfg:
            if name in fields_accepted:
                continue
            seed = _SEED_FWD.get(name)
            hint = f"; ejKernel's {name!r} is Tiling's {seed!r}" if seed else ""
            raise ValueError(
                f"`cfg` has a key Tiling does not take: {name!r}{hint}. Tiling fields: "
                f"{', '.join(fields_accepted)}."
            )
        return _config_of_fields(cfg), None
    raise TypeError(
        "`cfg` must be a Tiling (or a kernel's config, e.g. kernels.TritonConfig), a dict of "
        "Tiling fields, ejKernel's config (with `fwd_params` / `bwd_params`), or None; got "
        f"{type(cfg).__name__}."
    )


def _seq_first(qkv_layouts) -> tuple[bool, bool, bool]:
    """For query, key, value: whether its layout puts the sequence before the heads."""
    if qkv_layouts is None:
        return (False, False, False)
    names = (qkv_layouts,) * 3 if isinstance(qkv_layouts, str) else qkv_layouts
    if not (isinstance(names, (tuple, list)) and len(names) == 3
            and all(isinstance(n, str) for n in names)):
        raise NotImplementedError(
            f"`qkv_layouts` takes tensor layout names: {_LAYOUTS_ACCEPTED}; got "
            f"{type(qkv_layouts).__name__}. Precomputed block layouts (a tuple of sparse masks) "
            "are not taken: layouts come from the mask (`mask_builder`, `causal`, "
            "`sliding_window`, `chunk_size`, `attention_mask`)."
        )
    for name in names:
        if name.lower() not in _LAYOUT_NAMES:
            raise ValueError(f"`qkv_layouts` must be {_LAYOUTS_ACCEPTED}; got {name!r}.")
    return tuple(_LAYOUT_NAMES[n.lower()] for n in names)


def _to_bhsd(x, seq_first: bool):
    return jnp.swapaxes(x, -2, -3) if seq_first else x


def _attention_mask(mask, batch: int, heads: int, q_len: int, kv_len: int, batched: bool):
    """`attention_mask` as ``[B or 1, H or 1, Lq, Lk]`` booleans, or ``[B, Lk]`` key padding
    (``(mask, is_key_padding)``), or the error saying why not, quoting the shape given."""
    if mask is None:
        return None, False
    mask = as_bool_mask("attention_mask", mask)
    given = tuple(mask.shape)
    if batched and given == (batch, kv_len):
        # ejKernel's reading of a 2-D mask: key padding. Refused where [Lq, Lk] would differ.
        if given == (q_len, kv_len) and batch > 1:
            raise ValueError(
                f"`attention_mask` of shape {given} is ambiguous: it is both [batch, kv_len] "
                f"(key padding, ejKernel's reading) and [q_len, kv_len]; pass mask[:, None, "
                "None, :] for key padding ([B, 1, 1, Lk]) or mask[None] for one [Lq, Lk] mask."
            )
        return mask, True
    if batched:
        accepted = (f"[{batch} or 1, {heads} or 1, {q_len} or 1, {kv_len}], "
                    f"[{batch} or 1, {q_len}, {kv_len}], [{batch}, {kv_len}] (key padding) or "
                    f"[{q_len}, {kv_len}]")
        lead = {4: (), 3: (1,), 2: (0, 1)}.get(mask.ndim)
    else:
        accepted = f"[{heads} or 1, {q_len}, {kv_len}] or [{q_len}, {kv_len}]"
        lead = {3: (0,), 2: (0, 1)}.get(mask.ndim)
    if lead is not None:
        mask = jnp.expand_dims(mask, lead) if lead else mask
        if batched and mask.ndim == 4 and mask.shape[0] == batch and mask.shape[1:3] == (1, 1) \
                and mask.shape[3] == kv_len:
            return mask[:, 0, 0], True  # [B, 1, 1, Lk]: key padding, spelled out
        if (mask.shape[0] in (1, batch) and mask.shape[1] in (1, heads)
                and mask.shape[2] in (1, q_len) and mask.shape[3:] == (kv_len,)):
            return jnp.broadcast_to(mask, (*mask.shape[:2], q_len, kv_len)), False
    raise ValueError(f"`attention_mask` must have shape {accepted}; got {given}.")


def _jax_nn_mask(mask, batch: int, heads: int, q_len: int, kv_len: int, batched: bool):
    """jax.nn's boolean `mask` (4 or fewer dimensions, ones added in front, each dimension 1 or
    that of ``[B, N, T, S]``) as an `attention_mask` of the same meaning: ``[B or 1, H or 1,
    Lq or 1, Lk]`` (``[B, 1, 1, Lk]`` stays key padding), unbatched ``[H or 1, Lq, Lk]``."""
    mask = as_array("mask", mask)
    given = tuple(mask.shape)
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"`mask` must hold booleans (True = attend, as in jax.nn); got dtype "
            f"{jnp.dtype(mask.dtype).name}: pass `mask != 0`, or an additive mask as `bias`."
        )
    full = (batch, heads, q_len, kv_len)
    if mask.ndim > 4 or any(
        n not in (1, size) for n, size in zip((1,) * (4 - mask.ndim) + given, full)
    ):
        lead = "[B, N, T, S]" if batched else "[1, N, T, S] (jax.nn adds the batch)"
        raise ValueError(
            f"`mask` must have 4 (or fewer) dimensions broadcasting to {lead} = "
            f"{list(full)}, each 1 or that size, as in jax.nn; got shape {given}."
        )
    mask = mask.reshape((1,) * (4 - mask.ndim) + given)
    mask = jnp.broadcast_to(mask, (*mask.shape[:3], kv_len))
    if batched:
        return mask
    return jnp.broadcast_to(mask[0], (mask.shape[1], q_len, kv_len))


def _query_seq_lengths(lengths, batch: int, q_len: int, batched: bool):
    """jax.nn's `query_seq_lengths` (``[B]`` or a scalar: the number of real queries) as
    ``[B]`` ints, or the error saying why not (checked as `kv_seq_lengths` is)."""
    if lengths is None:
        return None
    return check_kv_seq_lengths(lengths, batch, q_len, batched, name="query_seq_lengths",
                                what="q_len")


def _hide_queries(keep, q_segment_ids, kv_segment_ids, *, kv_len: int):
    """Segment ids that hide the queries where `keep` (``[B, Lq]``) is False: id ``-1`` sees
    no key, so blocks of padded queries are skipped (`hide_keys` with the roles swapped)."""
    kv_segment_ids, q_segment_ids = hide_keys(keep, kv_segment_ids, q_segment_ids,
                                              q_len=kv_len)
    return q_segment_ids, kv_segment_ids


def _zero_queries_past(result, keep, return_lse: bool):
    """`result` with the rows of queries past `query_seq_lengths` (``keep`` ``[B, Lq]`` False)
    zeroed, and their lse ``-inf``: jax.nn multiplies them by zero after the softmax, and a
    mask that reads segment ids through an ``|`` can still let a hidden query see keys."""
    out, lse = result if return_lse else (result, None)
    keep = keep if out.ndim == 4 else keep[0]
    out = jnp.where(keep[..., None, :, None], out, jnp.zeros((), out.dtype))
    if lse is None:
        return out
    return out, jnp.where(keep[..., None, :], lse, -jnp.inf)


def _keyword_bias(a: dict) -> bool:
    """Fold jax.nn's `bias=` (keyword) and ejKernel's 5th positional `positional_bias` into
    `bias`; whether the keyword was given (``None`` included)."""
    keyword, positional = a["bias"], a["positional_bias"]
    a["positional_bias"] = None
    if keyword is NOT_GIVEN:
        a["bias"] = positional
        return False
    if positional is not None:
        raise TypeError("`bias` is given both 5th positionally and by keyword (jax.nn's way); "
                        "pass one.")
    return True


def _jax_nn_names(a: dict, keyword_bias: bool) -> list:
    """Fold jax.nn's names in `a` into this function's own, and settle `causal`; returns the
    jax.nn names the call used: those passed at all (`NOT_GIVEN` is not passed, ``None`` is),
    and ``"bias"`` where `keyword_bias`. `mask` and `query_seq_lengths` stay for `_validate`,
    which needs the shapes to read them."""
    used = [name for name in JAX_NN_NAMES if a[name] is not NOT_GIVEN]
    used += ["bias"] if keyword_bias else []
    for name in JAX_NN_NAMES:
        if a[name] is NOT_GIVEN:
            a[name] = None
    ours = [name for name in OWN_NAMES if a[name] is not None]  # before the aliases fold in
    merge_alias(a, "kv_seq_lengths", "key_value_seq_lengths")
    merge_alias(a, "softmax_scale", "scale")
    merge_alias(a, "causal", "is_causal")
    if a["local_window_size"] is not None:
        _window(a["local_window_size"], "local_window_size")  # its errors name it
    merge_alias(a, "sliding_window", "local_window_size")
    if a["mask"] is not None and a["attention_mask"] is not None:
        raise TypeError("`attention_mask` and `mask` (its jax.nn name) are the same argument; "
                        "pass one.")
    implementation = a.pop("implementation")
    if implementation is not None:
        if implementation not in _IMPLEMENTATIONS:
            raise ValueError(
                f"`implementation` must be None, 'xla' or 'cudnn' (jax.nn's names); got "
                f"{implementation!r}: to pick another kernel or a device pass `platform=` "
                "(e.g. 'reference', 'triton', 'gpu')."
            )
        if a["platform"] is not None:
            raise TypeError("`platform` and `implementation` (jax.nn's name) both pick the "
                            "kernel; pass one.")
        a["platform"] = _IMPLEMENTATIONS[implementation]
    residual = a.pop("return_residual")
    if residual is not None:
        if a["return_lse"]:
            raise TypeError("`return_lse` and `return_residual` (its jax.nn name) are the same "
                            "argument; pass one.")
        a["return_lse"] = bool(residual)
    if a["causal"] is None:
        if used and ours:
            raise ValueError(
                f"`causal` is ambiguous: the call uses jax.nn's `{used[0]}` (not causal unless "
                f"said) and `{ours[0]}` of this function (causal by default); pass "
                "causal=True or causal=False."
            )
        a["causal"] = not used
    for name in JAX_NN_NAMES:
        a.setdefault(name, None)  # folded into ours: the body sees None, never `NOT_GIVEN`
    return used


def _merge_mask_info(mask_info, **explicit):
    if mask_info is None:
        return explicit
    if not isinstance(mask_info, MaskInfo):
        raise TypeError(f"`mask_info` must be a MaskInfo or None; got {type(mask_info).__name__}.")
    merged = {}
    for name, value in explicit.items():
        from_info = getattr(mask_info, name)
        if value is not None and from_info is not None:
            raise ValueError(f"`{name}` is given both directly and in `mask_info`; give it once.")
        merged[name] = value if value is not None else from_info
    return merged


def _jax_nn_layout(qkv, used: list) -> tuple[bool, bool, bool]:
    """`_seq_first` for a call that uses jax.nn's names (`used`) without `qkv_layouts`:
    jax.nn's ``[B, T, N, H]`` (or ``[T, N, H]``) where only it fits the shapes, ``[B, H, L, D]``
    where only that fits (a call written for this function), else a one-line refusal: shapes
    that fit both would be read in one of them without a word."""
    shapes = [tuple(x.shape) for x in qkv]
    as_bhsd = _fits_bhsd(*shapes)
    as_bshd = _fits_bhsd(*map(_swapped, shapes)) if all(len(x) >= 3 for x in shapes) else False
    if as_bhsd and as_bshd:
        theirs, ours = ("[B, T, N, H]", "[B, H, L, D]") if len(shapes[0]) == 4 else (
            "[T, N, H]", "[H, L, D]")
        raise ValueError(
            f"`qkv_layouts` must be given: the call uses jax.nn's `{used[0]}`, whose arrays are "
            f"{theirs}, and the shapes {', '.join(map(str, shapes))} fit both that and "
            f"{ours}; pass qkv_layouts='bshd' (jax.nn's layout) or 'bhsd' ({ours}). Only "
            "shapes that fit both layouts need it."
        )
    return (as_bshd and not as_bhsd,) * 3


def _broadcast_bias(bias, batched: bool):
    """`bias` in a shape `check_call_data` reads, broadcast as jax.nn broadcasts it: ones in
    front of fewer than 2 dimensions (a 1-D bias is one per key), and the leading batch axis
    of size 1 dropped for unbatched inputs (jax.nn's bias is 4-D whatever the inputs)."""
    if bias is None:
        return None
    bias = as_array("bias", bias)
    if bias.ndim < 2:
        return bias.reshape((1,) * (2 - bias.ndim) + bias.shape)
    if not batched and bias.ndim == 4 and bias.shape[0] == 1:
        return bias[0]
    return bias


def _validate(arguments: dict):
    """The function door's own checks, before jaxtyping sees the arguments (see `typechecked`).

    Brings query, key and value to ``[B, H, L, D]``; returns the function that brings the
    output back to the query's layout, or ``None``.
    """
    a = arguments
    aux = a["softmax_aux"]
    if getattr(aux, "ndim", 0) > 2:
        # Sinks are at most [H, S]: this is jax.nn's bias, which jax.nn takes 4th.
        raise ValueError(
            f"`softmax_aux` (the 4th positional argument: attention sinks, at most [H, S]) got "
            f"shape {tuple(aux.shape)}: jax.nn's 4th positional `bias` is the 5th here; "
            "pass (query, key, value, None, bias) or bias= by keyword."
        )
    residual = a["return_residual"] is not NOT_GIVEN and a["return_residual"] is not None
    used = _jax_nn_names(a, _keyword_bias(a))
    residual = residual and a["return_lse"]  # jax.nn's residual: the lse in the query's layout
    builder = a["mask_builder"]
    if not isinstance(builder, AbstractMask) and hasattr(builder, "shape") \
            and hasattr(builder, "dtype"):
        raise TypeError(
            f"`mask_builder` must be {_BUILDER_FORMS}; got an array of shape "
            f"{tuple(builder.shape)}: pass an element mask as `attention_mask` (or "
            "masks.ArrayMask(array) as `mask_builder`)."
        )
    if a["fused_backward"] is not None:
        warnings.warn(FUSED_BACKWARD_DEPRECATION, DeprecationWarning, stacklevel=3)
    seq_first = _seq_first(a["qkv_layouts"])
    qkv = [as_array(name, a[name]) for name in ("query", "key", "value")]
    inferred = a["qkv_layouts"] is None and used
    if inferred:
        seq_first = _jax_nn_layout(qkv, used)
    if seq_first != (False, False, False) and not all(x.ndim in (3, 4) for x in qkv):
        raise ValueError(
            "`qkv_layouts` other than 'bhsd' needs inputs of 4 dimensions ([batch, seq, heads, "
            "dim]) or 3 ([seq, heads, dim]); got shapes "
            f"{', '.join(str(tuple(x.shape)) for x in qkv)}."
        )
    hint = None
    if len(set(seq_first)) == 1:  # one layout for all three: check it (mixed ones are named)
        named = None if a["qkv_layouts"] is None and not inferred else (
            "bshd" if seq_first[0] else "bhsd")
        hint = check_layout(*qkv, layout=named, argument="qkv_layouts", stacklevel=4)
    q, k, v = with_layout_hint(hint, check_qkv,
                               *(_to_bhsd(x, s) for x, s in zip(qkv, seq_first)))
    a.update(query=q, key=k, value=v, qkv_layouts=None)
    batched = q.ndim == 4
    batch = q.shape[0] if batched else 1
    a["bias"] = _broadcast_bias(a["bias"], batched)
    if not batched:
        for name in ("kv_seq_lengths", "query_seq_lengths"):
            if np.shape(a[name]) == (1,):  # jax.nn's [B] lengths of its 3-D call (B = 1)
                a[name] = a[name][0]
    if a["mask"] is not None:
        a["attention_mask"] = _jax_nn_mask(a["mask"], batch, q.shape[-3], q.shape[-2],
                                           k.shape[-2], batched)
    a["mask"] = None
    a.update(_merge_mask_info(
        a["mask_info"], q_segment_ids=a["q_segment_ids"], kv_segment_ids=a["kv_segment_ids"],
        q_positions=a["q_positions"], kv_positions=a["kv_positions"],
        attention_mask=a["attention_mask"],
    ), mask_info=None)
    if a["q_segment_ids"] is not None and a["kv_segment_ids"] is None:
        q_len, kv_len = q.shape[-2], k.shape[-2]
        if q_len != kv_len:
            raise ValueError(
                f"`kv_segment_ids` defaults to `q_segment_ids` only when q_len == kv_len; got "
                f"q_len={q_len}, kv_len={kv_len}: pass `kv_segment_ids`."
            )
        a["kv_segment_ids"] = a["q_segment_ids"]
    names = ("bias", "q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions")
    data = check_call_data(q, k, v, sinks_name="softmax_aux", sinks=a["softmax_aux"],
                           kv_seq_lengths=a["kv_seq_lengths"],
                           **{name: a[name] for name in names})
    a.update({name: data[name] for name in names}, softmax_aux=data["sinks"])
    q_lengths = _query_seq_lengths(a["query_seq_lengths"], batch, q.shape[-2], batched)
    a["query_seq_lengths"] = None
    if q_lengths is not None:
        keep = jnp.arange(q.shape[-2])[None, :] < q_lengths[:, None]
        ids = _hide_queries(keep, a["q_segment_ids"], a["kv_segment_ids"], kv_len=k.shape[-2])
        a["q_segment_ids"], a["kv_segment_ids"] = ids if batched else (ids[0][0], ids[1][0])
        a["query_seq_lengths"] = q_lengths  # the body zeroes the rows past them
    if data["kv_seq_lengths"] is not None:
        keep = jnp.arange(k.shape[-2])[None, :] < data["kv_seq_lengths"][:, None]
        ids = hide_keys(keep, a["q_segment_ids"], a["kv_segment_ids"], q_len=q.shape[-2])
        a["q_segment_ids"], a["kv_segment_ids"] = ids if batched else (ids[0][0], ids[1][0])
    a["kv_seq_lengths"] = None
    mask, key_padding = _attention_mask(
        a["attention_mask"], q.shape[0] if batched else 1, q.shape[-3], q.shape[-2], k.shape[-2],
        batched,
    )
    if key_padding:
        a["q_segment_ids"], a["kv_segment_ids"] = hide_keys(
            mask, a["q_segment_ids"], a["kv_segment_ids"], q_len=q.shape[-2])
        mask = None
    a["attention_mask"] = mask
    a.update(softmax_scale=python_scalar(a["softmax_scale"]),
             logits_soft_cap=python_scalar(a["logits_soft_cap"]))
    if not seq_first[0]:
        return None
    if a["return_lse"]:
        # jax.nn's residual is in its query's layout ([B, T, N]); our lse stays [B, H, Lq].
        return lambda result: (_to_bhsd(result[0], True),
                               jnp.swapaxes(result[1], -1, -2) if residual else result[1])
    return lambda out: _to_bhsd(out, True)


def _attend(attn, platform, purify, return_lse, query, key, value, mask_array, data):
    """Plan and run one call of `attn` (its mask and'ed with `mask_array` when given) on the
    arguments `_validate` has checked."""
    from .strategies import masks

    if mask_array is not None:
        mask = and_masks(attn.mask, masks.ArrayMask(mask_array))
        attn = eqx.tree_at(lambda m: m.mask, attn, mask)

    def plan_and_run(attn, query, key, value, data):
        plan = attn._plan(query, key, value, platform=platform, return_lse=return_lse, **data)
        return run_plan(plan, query, key, value, attn.sharding, attn.logits_soft_cap, purify,
                        return_lse=return_lse)

    return run_on_auto_axes(plan_and_run, attn, query, key, value, data)


def _attend_per_example(attend, query, key, value, mask, data):
    """`attend` mapped over the batch: for an `attention_mask` that differs per example."""
    batch = query.shape[0]

    def axis(name, x):
        if x is None or name == "sinks":
            return None, x
        if name == "bias":
            if x.ndim == 4 and x.shape[0] == batch:
                return 0, x
            return None, x[0] if x.ndim == 4 else x
        return (0, x) if x.ndim == 2 else (None, x)

    placed = {name: axis(name, x) for name, x in data.items()}
    axes = {name: ax for name, (ax, _) in placed.items()}
    values = {name: x for name, (_, x) in placed.items()}
    return jax.vmap(attend, in_axes=(0, 0, 0, 0, axes))(query, key, value, mask, values)


@typechecked(validate=_validate)
def blocksparse_attention(
    query: Float[Array, "*batch heads q_len dim"],
    key: Float[Array, "*batch kv_heads kv_len dim"],
    value: Float[Array, "*batch kv_heads kv_len value_dim"],
    softmax_aux: Float[Array, "..."] | None = None,
    positional_bias: Float[Array, "..."] | None = None,
    /,
    *,
    q_segment_ids: Integer[Array, "*_ q_len"] | None = None,
    kv_segment_ids: Integer[Array, "*_ kv_len"] | None = None,
    q_positions: Integer[Array, "*_ q_len"] | None = None,
    kv_positions: Integer[Array, "*_ kv_len"] | None = None,
    attention_mask: Array | None = None,
    mask_info: MaskInfo | None = None,
    logits_soft_cap: float | int | None = None,
    softmax_scale: float | int | None = None,
    mask_builder: AbstractMask | Callable[..., AbstractMask] | None = None,
    sliding_window: int | tuple[int | None, int | None] | list[int | None] | None = None,
    chunk_size: int | None = None,
    causal: bool | None = None,
    fused_backward: bool | None = None,
    purify: bool = False,
    platform: str | None = None,
    cfg: AbstractKernelConfig | dict | object | None = None,
    mesh=None,
    in_specs=None,
    out_specs=None,
    sequence_parallelism_mesh_axis_name: str | None = None,
    qkv_layouts: str | tuple[str, str, str] | None = None,
    score: AbstractScore | None = None,
    kv_seq_lengths: Integer[Array, "*_"] | int | None = None,
    return_lse: bool = False,
    key_value_seq_lengths: Integer[Array, "*_"] | int | None = NOT_GIVEN,
    scale: float | int | None = NOT_GIVEN,
    is_causal: bool | None = NOT_GIVEN,
    mask: Array | None = NOT_GIVEN,
    query_seq_lengths: Integer[Array, "*_"] | int | None = NOT_GIVEN,
    local_window_size: int | tuple[int | None, int | None] | list[int | None] | None = NOT_GIVEN,
    implementation: str | None = NOT_GIVEN,
    return_residual: bool | None = NOT_GIVEN,
    bias: Float[Array, "..."] | None = NOT_GIVEN,
) -> (Float[Array, "*batch heads q_len value_dim"]
      | tuple[Float[Array, "*batch heads q_len value_dim"], Float[Array, "*batch heads q_len"]]):
    """Block-sparse attention, function style: ``[B, H, Lq, D]`` in, ``[B, H, Lq, Dv]`` out.

    Builds a `BlockSparseAttention` from the options and calls it. Array arguments may be JAX
    or NumPy arrays. `docs/seed_api.md` maps each argument of the library this replaces.

    `jax.nn.dot_product_attention`'s names are accepted too, with jax.nn's meaning (below).
    **The causal default:** `causal` (or jax.nn's `is_causal`; one of them) decides when given.
    Otherwise a call is causal, ejKernel's default, unless it uses one of jax.nn's own names
    (`scale`, `key_value_seq_lengths`, `query_seq_lengths`, `mask`, `local_window_size`,
    `implementation`, `return_residual`, or `bias` by keyword), given at all (``mask=None``
    counts, as a wrapper that forwards its arguments passes it): then it is not causal, as in
    jax.nn. A call that mixes those with this function's own (`softmax_scale`,
    `sliding_window`, `attention_mask`, `mask_builder`, segment ids, ...) and gives neither is
    refused: pass ``causal=``.

    **The layout of a jax.nn call:** a call that uses jax.nn's names and no `qkv_layouts`
    reads its arrays as jax.nn's ``[B, T, N, H]`` (``[T, N, H]``) where only that layout fits
    their shapes, as ``[B, H, L, D]`` (``[H, L, D]``) where only that one fits, and is refused
    (a `ValueError` naming `qkv_layouts`) where both fit: pass ``qkv_layouts="bshd"``.

    **Arguments:**

    - `query`, `key`, `value`: ``[B, H, Lq, D]``, ``[B, Hkv, Lk, D]``, ``[B, Hkv, Lk, Dv]``
      (GQA when ``H % Hkv == 0``); unbatched ``[H, L, D]`` also works.
    - `softmax_aux`: attention sinks (positional), read as `BlockSparseAttention`'s `sinks`:
      ``[S]``, ``[H]``, ``[Hkv]`` (one per kv head), ``[H, S]`` or ``[Hkv, S]``.
    - `bias`: additive bias broadcasting to ``[B, H, Lq, Lk]`` (unbatched ``[H, Lq, Lk]``, or
      jax.nn's ``[1, H, Lq, Lk]``), a 1-D bias one per key: 5th positional, after
      `softmax_aux`, or by keyword as in jax.nn (then one of jax.nn's names, above).
    - `q_segment_ids`, `kv_segment_ids`, `q_positions`, `kv_positions`: ``[B, L]`` ints;
      `kv_segment_ids` defaults to `q_segment_ids` when ``Lq == Lk``.
    - `attention_mask`: booleans ``[B or 1, H or 1, Lq, Lk]`` (also ``[B or 1, Lq, Lk]``,
      ``[Lq, Lk]``; integers count as True where nonzero): a `masks.ArrayMask` and'ed with
      the rest of the mask. A mask that differs per example maps the call over the batch.
    - `mask_info`: a `MaskInfo` holding any of the five arguments above.
    - `logits_soft_cap`, `softmax_scale`: as in `BlockSparseAttention`.
    - `score`: a score term added to every logit before the soft cap (`scores.ALiBi`,
      `scores.RelativePositionBias`, `scores.ScoreFunction`), as in `BlockSparseAttention`.
    - `mask_builder`: a mask; a zero-argument callable returning one; or
      ``fn(q_len, kv_len, num_heads, head_idx, num_reps) -> mask``, called once per query
      head (``num_reps = H // Hkv``; different masks make a `masks.PerHead`). The options below
      are combined with it by ``&``.
    - `causal` (default ``True``, ``False`` with jax.nn's names: above), `sliding_window`
      (int, or ``(left, right)``), `chunk_size` (chunked causal).
    - `kv_seq_lengths`: ``[B]`` ints (or a scalar): only the first ``kv_seq_lengths[b]`` keys
      of example ``b`` are seen.
    - `purify`: zero the rows of padded queries (``q_segment_ids < 0``).
    - `return_lse`: return ``(out, lse)``, `lse` ``[B, H, Lq]`` float32 as in
      `BlockSparseAttention.__call__`.
    - `platform`: ``None`` or ``"auto"`` (select for JAX's default device), ``"cpu"`` /
      ``"gpu"`` (or ``"cuda"``) / ``"tpu"`` (select for that platform, which must be
      present), or a kernel name (``"reference"``, ``"xla"``, ``"triton"``, ...).
    - `cfg`: a config (a kernel's own, e.g. `kernels.TritonConfig`, or `Tiling`), a dict of
      their fields, or ejKernel's config (``fwd_params`` / ``bwd_params`` with
      ``q_blocksize``, ``kv_blocksize``, ``num_warps``, ``num_stages``; its ``platform``
      applies when `platform` is ``None``). Block sizes alone make a `Tiling`; with warps or
      stages, `TritonBlockSparse` runs them as its `kernels.TritonConfig` and other kernels
      take the blocks.
    - `fused_backward`: deprecated and without effect (a `DeprecationWarning` says so); for
      a single-pass backward run
      ``BlockSparseAttention(kernel=kernels.MosaicBlockSparse(deterministic=False))`` on a
      Hopper GPU.
    - `qkv_layouts`: ``"bhsd"`` or ``"bshd"`` (``[B, L, H, D]``, unbatched ``[L, H, D]``, in
      and out), or one name each for query, key, value; inputs are transposed (no kernel reads
      ``bshd``). Default ``None``: ``"bhsd"``, checked as `BlockSparseAttention`'s default
      `qkv_layout` is (a warning where the shapes fit both layouts with more heads than
      tokens); in a call with jax.nn's names, the layout their shapes fit (above).
    - `mesh`: a `jax.sharding.Mesh` to spread the call over, with `in_specs` (the
      PartitionSpecs of query, key, value, ...; batch and head axes give `ShardMap`, a
      sequence axis `RingAttention`), `out_specs` (``None`` or the query's spec) and/or
      `sequence_parallelism_mesh_axis_name` (the sequence axis: `RingAttention`).

    jax.nn's names (each is refused beside its counterpart here; jax.nn's arrays are
    ``[B, T, N, H]`` or ``[T, N, H]``: pass ``qkv_layouts="bshd"``, needed where the shapes
    fit both layouts):

    - `scale`, `is_causal`, `key_value_seq_lengths`: `softmax_scale`, `causal`,
      `kv_seq_lengths`.
    - `bias` (keyword): the 5th positional `bias`.
    - `mask`: booleans of 4 (or fewer) dimensions, each 1 or that of ``[B, N, T, S]``
      (``[B, H, Lq, Lk]``), True = attend; read as `attention_mask`. A row it hides entirely
      gives zeros (jax.nn's gives the mean of the values).
    - `query_seq_lengths`: ``[B]`` ints (or a scalar): the queries past ``query_seq_lengths[b]``
      give zero rows and zero gradients (their lse is ``-inf``), as in jax.nn.
    - `local_window_size`: `sliding_window` (an int is symmetric, or ``(left, right)``).
    - `implementation`: ``None`` (the selector), ``"xla"`` or ``"cudnn"``: that kernel, as
      ``platform="xla"`` / ``"cudnn"``; for other kernels or a device pass `platform`.
    - `return_residual`: `return_lse`, its lse in the query's layout (``[B, T, N]`` under
      ``"bshd"``, as jax.nn's residual), float32.

    ```python
    out = blocksparse_attention(q, k, v, causal=True, sliding_window=1024)
    # jax.nn's call, same answer (not causal): jax.nn.dot_product_attention(x, x, x, scale=0.1)
    out = blocksparse_attention(x, x, x, scale=0.1, qkv_layouts="bshd")
    ```
    """
    shard = _sharding_from_options(mesh, in_specs, out_specs, sequence_parallelism_mesh_axis_name)
    del qkv_layouts  # `_validate` brought the inputs to [B, H, L, D] and turns the output back
    del positional_bias  # `_validate` folded it into `bias`
    del fused_backward  # `_validate` warned that it has no effect
    tiling, cfg_platform = _tiling_from_cfg(cfg)
    kernel, device = _kernel_for(platform if platform is not None else cfg_platform)
    heads, q_len = query.shape[-3], query.shape[-2]
    kv_heads, kv_len = key.shape[-3], key.shape[-2]
    # jax.nn's `mask` and names `_validate` folded into ours (`attention_mask`, ...) arrive None.
    mask = _mask_from_builder(mask_builder, q_len, kv_len, heads, kv_heads)
    mask = _mask_from_options(mask, causal, sliding_window, chunk_size)
    attn = BlockSparseAttention(
        mask=mask, kernel=kernel, tiling=tiling,
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, score=score,
        **({} if shard is None else {"sharding": shard}),
    )
    data = dict(bias=bias, sinks=softmax_aux, q_segment_ids=q_segment_ids,
                kv_segment_ids=kv_segment_ids, q_positions=q_positions, kv_positions=kv_positions)

    def attend(q, k, v, mask_array, data):
        return _attend(attn, device, purify, return_lse, q, k, v, mask_array, data)

    if attention_mask is None or attention_mask.shape[0] == 1:
        mask_array = None if attention_mask is None else attention_mask[0]
        out = attend(query, key, value, mask_array, data)
    else:
        if score is not None and compile_score(score, heads).takes_batch:
            # Each example runs as a call of its own (a batch of one), where a batch index
            # would read 0: refuse rather than answer with the first example's data.
            raise ValueError(
                "`score` reads the batch index, which a per-example `attention_mask` (its "
                f"first axis {attention_mask.shape[0]}) cannot give, since each example then "
                "runs as a call of its own: pass one mask for the batch ([1, H or 1, Lq, Lk]) "
                "or the padding as `kv_seq_lengths`, or drop `batch` from the score.")
        if getattr(shard, "batch_axis", None) is not None:
            # Each example runs as a batch of one, which no mesh axis can split.
            raise ValueError(
                "a per-example `attention_mask` (its first axis "
                f"{attention_mask.shape[0]}) runs each example as a call of its own, whose "
                f"batch of one the mesh axis {shard.batch_axis!r} in `in_specs` cannot split: "
                "leave the batch unsplit in `in_specs`, or pass one mask for the batch "
                "([1, H or 1, Lq, Lk]) or the padding as `kv_seq_lengths`.")
        out = _attend_per_example(attend, query, key, value, attention_mask, data)
    if query_seq_lengths is not None:
        keep = jnp.arange(q_len)[None, :] < query_seq_lengths[:, None]
        out = _zero_queries_past(out, keep, return_lse)
    return out
