"""`BlockSparseAttention`: the Equinox module that holds the four strategies."""

import dataclasses
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._compile import CompiledMask, ResolvedMask, describe_terms
from ._inputs import AttentionInputs, prepare_inputs
from ._kernel import AbstractKernel, Features
from ._mask import EMPTY, AbstractMask, Document, Full
from ._selector import KernelChoice, choose_kernel, decline_reason, default_platform
from ._sharding import AbstractSharding, Unsharded
from ._swap import AutoKernel, AutoTiling, _kernel_or_auto, _tiling_or_auto, is_auto
from ._tiling import Tiling
from ._typing import ArrayOrNumpy, typechecked


class CallPlan(NamedTuple):
    """What one call will do, decided once at trace time: `str(plan)` explains it.

    - `kernel`, `choice`: the kernel and the selector's answer (``None`` when the module named
      its kernel).
    - `tiling`, `tiling_source`: the tiling and where it came from (``"module"`` or
      ``"heuristic"``).
    - `mask`: the `CompiledMask` the kernel reads (layouts per pass, terms, predicate).
    - `features`, `inputs`, `softmax_scale`: the call as the kernel sees it.
    """

    kernel: AbstractKernel
    choice: KernelChoice | None
    tiling: Tiling
    tiling_source: str
    mask: CompiledMask
    features: Features
    inputs: AttentionInputs
    softmax_scale: float

    def explain(self) -> str:
        """Kernel and why, tiling and where from, the mask's terms and each pass's density."""
        if self.choice is not None:
            lines = [f"kernel {self.choice.explain()}"]
        else:
            lines = [f"kernel {self.kernel.name}: given by the module"]
        lines.append(f"tiling ({self.tiling_source}): {_tiling_text(self.tiling)}")
        lines.append(f"mask terms: {describe_terms(self.mask.terms)}")
        layouts = self.mask.layouts()
        if not layouts:
            lines.append(f"passes: {self.kernel.name} reads no block layout (it visits every pair)")
        for name, layout in layouts.items():
            where = "static" if layout.is_static else "built on the device per call"
            if isinstance(layout.classes, jax.core.Tracer):  # built inside a trace
                density = "density known at run time"
            else:
                density = f"density {float(np.mean(np.asarray(layout.classes) != EMPTY)):.3f}"
            lines.append(f"pass {name}: {layout.block_q}x{layout.block_kv} tiles, "
                         f"{layout.num_q_blocks}x{layout.num_kv_blocks} blocks, {density} ({where})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def _tiling_text(tiling: Tiling) -> str:
    parts = [f"{f.name}={getattr(tiling, f.name)}" for f in dataclasses.fields(tiling)
             if getattr(tiling, f.name) is not None]
    return ", ".join(parts)


def _check_qkv(query, key, value) -> None:
    if not (query.ndim == key.ndim == value.ndim) or query.ndim not in (3, 4):
        raise ValueError(
            "`query`, `key`, `value` must all be [batch, heads, len, dim] or all [heads, len, dim]; "
            f"got shapes {query.shape}, {key.shape}, {value.shape}."
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"`query`, `key`, `value` must share one dtype; got {query.dtype}, {key.dtype}, "
            f"{value.dtype}."
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
    if query.shape[-2] == 0 or key.shape[-2] == 0:
        raise ValueError(
            f"sequence lengths must be positive; got q_len={query.shape[-2]}, kv_len={key.shape[-2]}."
        )


def _with_document(mask: AbstractMask, has_segments: bool) -> AbstractMask:
    if has_segments and not mask.uses_segment_ids:
        return mask & Document()
    if mask.uses_segment_ids and not has_segments:
        raise ValueError(
            "the mask contains `Document`, which reads segment ids: pass `q_segment_ids` and "
            "`kv_segment_ids`."
        )
    return mask


class BlockSparseAttention(eqx.Module):
    """Exact attention that skips the blocks its mask leaves empty.

    Holds four strategies: a `mask` (which pairs attend), a `kernel` (how it runs; the default
    `AutoKernel()` lets `select_kernel` pick per platform), a `tiling` (block sizes; the default
    `AutoTiling()` takes the kernel's heuristic) and a `sharding` (how it spreads over devices).
    Swap any of them with `eqx.tree_at` (in training, `swap_strategy` keeps the optimizer state).

    **Arguments:**

    - `mask`: an `AbstractMask`; default `masks.Full()` (dense attention).
    - `kernel`: an `AbstractKernel`; default `AutoKernel()` (selected per call; ``None`` means
      the same).
    - `tiling`: a `Tiling`; default `AutoTiling()` (the kernel's heuristic; ``None`` means the
      same).
    - `sharding`: an `AbstractSharding`; default `Unsharded()`.
    - `softmax_scale`: multiplies ``q . k``; default ``1 / sqrt(head_dim)``.
    - `logits_soft_cap`: if set to ``c``, logits become ``c * tanh(logits / c)``.

    ```python
    import eqx_bsattn as bsa
    attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal() & bsa.masks.SlidingWindow(256))
    out = attn(q, k, v)   # q [H, Lq, D] or [B, H, Lq, D]; k, v [(B,) Hkv, Lk, D | Dv]
    ```
    """

    mask: AbstractMask = Full()
    kernel: AbstractKernel | AutoKernel = eqx.field(default=AutoKernel(), converter=_kernel_or_auto)
    tiling: Tiling | AutoTiling = eqx.field(default=AutoTiling(), converter=_tiling_or_auto)
    sharding: AbstractSharding = Unsharded()
    softmax_scale: float | None = eqx.field(default=None, static=True)
    logits_soft_cap: float | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        if not isinstance(self.mask, AbstractMask):
            raise TypeError(f"`mask` must be an AbstractMask; got {type(self.mask).__name__}.")
        if not isinstance(self.kernel, (AbstractKernel, AutoKernel)):
            raise TypeError(f"`kernel` must be an AbstractKernel or None; got {type(self.kernel).__name__}.")
        if not isinstance(self.tiling, (Tiling, AutoTiling)):
            raise TypeError(f"`tiling` must be a Tiling or None; got {type(self.tiling).__name__}.")
        if not isinstance(self.sharding, AbstractSharding):
            raise TypeError(
                f"`sharding` must be an AbstractSharding; got {type(self.sharding).__name__}."
            )
        if self.softmax_scale is not None and not (
            isinstance(self.softmax_scale, (int, float)) and math.isfinite(self.softmax_scale)
        ):
            raise ValueError(f"`softmax_scale` must be a finite number; got {self.softmax_scale!r}.")
        if self.logits_soft_cap is not None and not (
            isinstance(self.logits_soft_cap, (int, float))
            and math.isfinite(self.logits_soft_cap)
            and self.logits_soft_cap > 0
        ):
            raise ValueError(
                f"`logits_soft_cap` must be a positive finite number or None; got {self.logits_soft_cap!r}."
            )

    def plan(
        self,
        query,
        key,
        value,
        *,
        bias=None,
        sinks=None,
        q_segment_ids=None,
        kv_segment_ids=None,
        q_positions=None,
        kv_positions=None,
        platform: str | None = None,
        fused_backward: bool = False,
    ) -> CallPlan:
        """Everything a call decides before it runs, once: the mask resolved and compiled,
        the per-call data normalised, the kernel and the tiling.

        Takes the arguments of `__call__`; ``print(attn.plan(q, k, v))`` says which kernel
        would run and why, with which tiling, and how dense each pass's layout is. Runs no
        attention.
        """
        _check_qkv(query, key, value)
        batched = query.ndim == 4
        batch = query.shape[0] if batched else 1
        heads, q_len, dim = query.shape[-3:]
        kv_heads, kv_len, value_dim = value.shape[-3:]
        inputs = prepare_inputs(
            batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, batched=batched,
            bias=bias, sinks=sinks, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
            q_positions=q_positions, kv_positions=kv_positions,
        )
        mask = _with_document(self.mask, inputs.q_segment_ids is not None)
        mask.check(q_len, kv_len, heads)
        resolved = ResolvedMask(
            mask, q_len=q_len, kv_len=kv_len, num_heads=heads,
            q_positions=inputs.q_positions, kv_positions=inputs.kv_positions,
            q_segment_ids=inputs.q_segment_ids, kv_segment_ids=inputs.kv_segment_ids,
        )
        platform = platform or default_platform()
        features = Features(
            platform=platform,
            dtype=jnp.dtype(query.dtype).name,
            batch=batch,
            num_heads=heads,
            num_kv_heads=kv_heads,
            q_len=q_len,
            kv_len=kv_len,
            head_dim=dim,
            value_dim=value_dim,
            bias=inputs.bias is not None,
            sinks=inputs.sinks is not None,
            soft_cap=self.logits_soft_cap is not None,
            segment_ids=inputs.q_segment_ids is not None,
            positions=inputs.q_positions is not None or inputs.kv_positions is not None,
            fused_backward=fused_backward,
        )
        if is_auto(self.kernel):
            choice = choose_kernel(resolved, features)
            kernel = choice.kernel
        else:
            choice = None
            kernel = self.kernel
            why = decline_reason(kernel, resolved, features)
            if why is not None:
                raise ValueError(f"kernel {kernel.name} cannot run this call: {why}")
        if not is_auto(self.tiling):
            tiling, source = self.tiling, "module"
        else:
            tiling, source = kernel.default_tiling(features, resolved), "heuristic"
        tiling = kernel.adapt_tiling(tiling, features)
        compiled = resolved.compile(tiling, kernel.reads)
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(dim)
        return CallPlan(kernel, choice, tiling, source, compiled, features, inputs, float(scale))

    @typechecked
    def __call__(
        self,
        query: Float[Array, "*batch heads q_len dim"],
        key: Float[Array, "*batch kv_heads kv_len dim"],
        value: Float[Array, "*batch kv_heads kv_len value_dim"],
        *,
        bias: Float[ArrayOrNumpy, "..."] | None = None,
        sinks: Float[ArrayOrNumpy, "..."] | None = None,
        q_segment_ids: Int[ArrayOrNumpy, "*_ q_len"] | None = None,
        kv_segment_ids: Int[ArrayOrNumpy, "*_ kv_len"] | None = None,
        q_positions: Int[ArrayOrNumpy, "*_ q_len"] | None = None,
        kv_positions: Int[ArrayOrNumpy, "*_ kv_len"] | None = None,
        purify: bool = False,
    ) -> Float[Array, "*batch heads q_len value_dim"]:
        """Attend.

        **Arguments:**

        - `query`: ``[B, H, Lq, D]`` or unbatched ``[H, Lq, D]``.
        - `key`: ``[B, Hkv, Lk, D]`` (``H % Hkv == 0``: query head ``h`` reads kv head
          ``h // (H // Hkv)``).
        - `value`: ``[B, Hkv, Lk, Dv]``.
        - `bias`: additive logits bias broadcasting to ``[B, H, Lq, Lk]``; differentiable.
        - `sinks`: extra logits joining every row's softmax denominator with a zero value:
          ``[S]`` shared by all heads, ``[H]`` one per head, or ``[H, S]``; differentiable.
        - `q_segment_ids`, `kv_segment_ids`: ``[B, L]`` (or ``[L]``) ints; a query sees a key
          only when their ids are equal and non-negative (``-1`` marks padding).
        - `q_positions`, `kv_positions`: ``[B, L]`` (or ``[L]``) ints; positional masks act on
          these instead of the token indices.
        - `purify`: zero the output rows of padded queries (``q_segment_ids < 0``).

        **Returns:** ``[B, H, Lq, Dv]`` (or ``[H, Lq, Dv]``) in the query dtype; a query that
        sees no key gets zeros.
        """
        plan = self.plan(
            query, key, value, bias=bias, sinks=sinks, q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids, q_positions=q_positions, kv_positions=kv_positions,
        )
        return run_plan(plan, query, key, value, self.sharding, self.logits_soft_cap, purify)


def run_plan(plan: CallPlan, query, key, value, sharding, logits_soft_cap, purify: bool):
    """Run a `CallPlan` (batching unbatched inputs, sharding, purify)."""
    if purify and plan.inputs.q_segment_ids is None:
        raise ValueError("`purify=True` zeroes rows whose q_segment_ids are negative: pass segment ids.")
    batched = query.ndim == 4
    if not batched:
        query, key, value = query[None], key[None], value[None]

    def attend(q, k, v, inputs, mask):
        return plan.kernel(
            q, k, v, mask=mask, inputs=inputs, features=plan.features, tiling=plan.tiling,
            softmax_scale=plan.softmax_scale, logits_soft_cap=logits_soft_cap,
        )

    out = sharding.wrap(attend)(query, key, value, plan.inputs, plan.mask)
    if purify:
        padded = (plan.inputs.q_segment_ids < 0)[:, None, :, None]
        out = jnp.where(padded, jnp.zeros((), out.dtype), out)
    return out if batched else out[0]
