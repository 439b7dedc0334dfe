"""`blocksparse_attention`: the function-style front door, with the call signature of the kernel
library it replaces. It builds a `BlockSparseAttention` and calls it: one implementation."""

import warnings
from collections.abc import Callable

from jaxtyping import Array, Float, Int

from ._inputs import MaskInfo
from ._kernel import AbstractKernel, registered_kernels
from ._mask import AbstractMask, Full
from ._module import BlockSparseAttention, run_plan
from ._tiling import Tiling
from ._typing import ArrayOrNumpy, typechecked

_DEVICE_PLATFORMS = ("cpu", "gpu", "tpu")


def _mask_from_options(mask_builder, causal, sliding_window, chunk_size) -> AbstractMask:
    from .strategies import masks

    if mask_builder is None:
        mask = Full()
    elif isinstance(mask_builder, AbstractMask):
        mask = mask_builder
    elif callable(mask_builder):
        mask = mask_builder()
        if not isinstance(mask, AbstractMask):
            raise TypeError(
                f"`mask_builder()` must return a mask; it returned {type(mask).__name__}."
            )
    else:
        raise TypeError(
            "`mask_builder` must be a mask or a zero-argument callable returning one; "
            f"got {type(mask_builder).__name__}."
        )
    if causal:
        mask = masks.Causal() if isinstance(mask, Full) else mask & masks.Causal()
    if sliding_window is not None:
        try:
            if isinstance(sliding_window, int) and not isinstance(sliding_window, bool):
                window = masks.SlidingWindow(sliding_window)
            elif isinstance(sliding_window, (tuple, list)) and len(sliding_window) == 2:
                window = masks.SlidingWindow(*sliding_window)
            else:
                raise ValueError("neither an int nor a pair")
        except ValueError as e:
            # Name the argument the caller wrote, not the mask it becomes.
            raise ValueError(
                "`sliding_window` must be an int >= 0 (symmetric) or a pair (left, right) of "
                f"ints >= 0 or None, not both None; got {sliding_window!r}: {e}"
            ) from None
        mask = window if isinstance(mask, Full) else mask & window
    if chunk_size is not None:
        chunked = masks.ChunkedCausal(chunk_size)
        mask = chunked if isinstance(mask, Full) else mask & chunked
    return mask


def _kernel_for(platform: str | None, fused_backward: bool) -> tuple[AbstractKernel | None, str | None]:
    """An explicit kernel for `platform` when it names one, else (None, device platform)."""
    if platform is None or platform in _DEVICE_PLATFORMS:
        return None, platform
    aliases = {"dense": "reference", "flash": "triton", "pallas": "splash"}
    wanted = aliases.get(platform, platform)
    for cls in registered_kernels():
        if cls.name == wanted:
            if "fused_backward" in getattr(cls, "__dataclass_fields__", {}):
                return cls(fused_backward=fused_backward), None
            return cls(), None
    known = sorted({cls.name for cls in registered_kernels()} | set(_DEVICE_PLATFORMS))
    if wanted in ("triton", "pallas", "cudnn"):
        raise NotImplementedError(
            f"platform={platform!r}: that kernel is not available in this installation."
        )
    raise ValueError(f"`platform` must be one of {known} or None; got {platform!r}.")


def _tiling_from_cfg(cfg) -> Tiling | None:
    if cfg is None or isinstance(cfg, Tiling):
        return cfg
    if isinstance(cfg, dict):
        try:
            return Tiling(**cfg)
        except TypeError as e:
            raise ValueError(f"`cfg` holds a key Tiling does not take: {e}") from None
    raise TypeError(f"`cfg` must be a Tiling, a dict of Tiling fields, or None; got {type(cfg).__name__}.")


def _merge_mask_info(mask_info, **explicit):
    if mask_info is None:
        return explicit
    if not isinstance(mask_info, MaskInfo):
        raise TypeError(f"`mask_info` must be a MaskInfo; got {type(mask_info).__name__}.")
    merged = {}
    for name, value in explicit.items():
        from_info = getattr(mask_info, name)
        if value is not None and from_info is not None:
            raise ValueError(f"`{name}` is given both directly and in `mask_info`; give it once.")
        merged[name] = value if value is not None else from_info
    return merged


@typechecked
def blocksparse_attention(
    query: Float[Array, "*batch heads q_len dim"],
    key: Float[Array, "*batch kv_heads kv_len dim"],
    value: Float[Array, "*batch kv_heads kv_len value_dim"],
    softmax_aux: Float[ArrayOrNumpy, "..."] | None = None,
    bias: Float[ArrayOrNumpy, "..."] | None = None,
    /,
    *,
    q_segment_ids: Int[ArrayOrNumpy, "*_ q_len"] | None = None,
    kv_segment_ids: Int[ArrayOrNumpy, "*_ kv_len"] | None = None,
    q_positions: Int[ArrayOrNumpy, "*_ q_len"] | None = None,
    kv_positions: Int[ArrayOrNumpy, "*_ kv_len"] | None = None,
    mask_info: MaskInfo | None = None,
    logits_soft_cap: float | int | None = None,
    softmax_scale: float | int | None = None,
    mask_builder: AbstractMask | Callable[[], AbstractMask] | None = None,
    sliding_window: int | tuple[int | None, int | None] | list[int | None] | None = None,
    chunk_size: int | None = None,
    causal: bool = True,
    fused_backward: bool = False,
    purify: bool = False,
    platform: str | None = None,
    cfg: Tiling | dict | None = None,
    mesh=None,
    in_specs=None,
    out_specs=None,
    sequence_parallelism_mesh_axis_name: str | None = None,
    qkv_layouts=None,
) -> Float[Array, "*batch heads q_len value_dim"]:
    """Block-sparse attention, function style: ``[B, H, Lq, D]`` in, ``[B, H, Lq, Dv]`` out.

    Builds a `BlockSparseAttention` from the options and calls it.

    **Arguments:**

    - `query`, `key`, `value`: ``[B, H, Lq, D]``, ``[B, Hkv, Lk, D]``, ``[B, Hkv, Lk, Dv]``
      (GQA when ``H % Hkv == 0``); unbatched ``[H, L, D]`` also works.
    - `softmax_aux`: attention sinks, ``[S]``, ``[H]`` or ``[H, S]`` (positional).
    - `bias`: additive bias broadcasting to ``[B, H, Lq, Lk]`` (positional).
    - `q_segment_ids`, `kv_segment_ids`, `q_positions`, `kv_positions`: ``[B, L]`` ints, or in
      one `MaskInfo` as `mask_info`.
    - `logits_soft_cap`, `softmax_scale`: as in `BlockSparseAttention`.
    - `mask_builder`: a mask, or a zero-argument callable returning one; the options below
      are combined with it by ``&``.
    - `causal` (default ``True``), `sliding_window` (int, or ``(left, right)``),
      `chunk_size` (chunked causal).
    - `purify`: zero the rows of padded queries (``q_segment_ids < 0``).
    - `platform`: ``None`` (select per device), ``"cpu"``/``"gpu"``/``"tpu"`` (select for that
      platform), or a kernel name (``"reference"``, ``"xla"``, ``"triton"``, ...).
    - `cfg`: a `Tiling` (or a dict of its fields).
    - `fused_backward`: ask for the fused backward pass where the kernel has one; others warn
      and use their split backward.
    - `mesh`, `in_specs`, `out_specs`, `sequence_parallelism_mesh_axis_name`,
      `qkv_layouts`: not available yet; anything but ``None`` raises `NotImplementedError`.

    ```python
    out = blocksparse_attention(q, k, v, causal=True, sliding_window=1024)
    ```
    """
    for name, value_ in (
        ("mesh", mesh),
        ("in_specs", in_specs),
        ("out_specs", out_specs),
        ("sequence_parallelism_mesh_axis_name", sequence_parallelism_mesh_axis_name),
    ):
        if value_ is not None:
            raise NotImplementedError(
                f"`{name}` (multi-device sharding) is not available yet; pass None and shard "
                "the call with jax.jit/shard_map around it."
            )
    if qkv_layouts is not None:
        raise NotImplementedError(
            "`qkv_layouts` other than the default [batch, heads, seq, head_dim] is not available yet."
        )
    data = _merge_mask_info(
        mask_info, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        q_positions=q_positions, kv_positions=kv_positions,
    )
    mask = _mask_from_options(mask_builder, causal, sliding_window, chunk_size)
    kernel, device_platform = _kernel_for(platform, fused_backward)
    attn = BlockSparseAttention(
        mask=mask, kernel=kernel, tiling=_tiling_from_cfg(cfg),
        softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
    )
    plan = attn.plan(
        query, key, value, bias=bias, sinks=softmax_aux, platform=device_platform,
        fused_backward=fused_backward, **data,
    )
    if fused_backward and not getattr(plan.kernel, "fused_backward", False):
        warnings.warn(
            f"fused_backward=True: kernel {plan.kernel.name!r} has no fused backward pass; "
            "it uses its split backward.",
            stacklevel=2,
        )
    return run_plan(plan, query, key, value, attn.sharding, logits_soft_cap, purify)
