"""`BlockSparseAttention`: the Equinox module that holds the four strategies."""

import collections
import dataclasses
import math
import warnings
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Integer

from ._compile import CompiledMask, ResolvedMask, describe_terms
from ._inputs import (AttentionInputs, check_call, full_bias, hide_keys, prepare_inputs,
                      python_scalar)
from ._kernel import (AbstractBroadcastBiasKernel, AbstractKernel, AbstractLseKernel, Features,
                      ScoreParams)
from ._mask import EMPTY, LENGTH_PADDING, AbstractMask, Document, Full, NonPaddingKeys
from ._score import AbstractScore, attach_score, check_score, describe_score
from ._selector import KernelChoice, check_platform, choose_kernel, decline_reason, default_platform
from ._sharding import AbstractSharding, Unsharded, run_on_auto_axes
from ._swap import AutoKernel, AutoTiling, _kernel_or_auto, _tiling_or_auto, is_auto
from ._tiling import AbstractKernelConfig, AbstractTiling
from ._typing import ArrayOrNumpy, typechecked


class CallPlan(NamedTuple):
    """What one call will do, decided once at trace time: `str(plan)` explains it.

    - `kernel`, `choice`: the kernel and the selector's answer (``None`` when the module named
      its kernel).
    - `tiling`, `tiling_source`: the config of the kernel that runs (its `config_type`, as
      `AbstractKernel.adapt_tiling` returned it) and where it came from, as the module's
      tiling strategy said: ``"module"`` (the module's own config), ``"cache"`` (tuned
      before: `autotune`) or ``"heuristic"`` (the kernel's `default_tiling`).
    - `mask`: the `CompiledMask` the kernel reads (layouts per pass, terms, predicate).
    - `features`, `inputs`, `softmax_scale`: the call as the kernel sees it.
    - `resolved`: the `ResolvedMask` the selector and the tiling heuristics saw.
    """

    kernel: AbstractKernel
    choice: KernelChoice | None
    tiling: AbstractKernelConfig
    tiling_source: str
    mask: CompiledMask
    features: Features
    inputs: AttentionInputs
    softmax_scale: float
    resolved: ResolvedMask | None = None

    def explain(self) -> str:
        """Kernel and why, tiling and where from, the mask's terms and each pass's density."""
        if self.choice is not None:
            lines = [f"kernel {self.choice.explain()}"]
        else:
            lines = [f"kernel {self.kernel.name}: given by the module"]
        source = _TILING_SOURCES.get(self.tiling_source, self.tiling_source)
        lines.append(f"tiling ({source}): {_tiling_text(self.tiling)}")
        lines.append(f"mask terms: {describe_terms(self.mask.terms)}")
        if self.inputs.score is not None:
            lines.append(f"score terms: {describe_score(self.inputs.score)}")
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


_TILING_SOURCES = {
    "module": "given by the module",
    "cache": "from the autotune cache",
    "heuristic": "the kernel's heuristic",
}


def _tiling_text(tiling: AbstractKernelConfig) -> str:
    parts = [f"{f.name}={getattr(tiling, f.name)}" for f in dataclasses.fields(tiling)
             if getattr(tiling, f.name) is not None]
    return f"{type(tiling).__name__}({', '.join(parts)})"


def _with_document(mask: AbstractMask, has_segments: bool) -> AbstractMask:
    """The mask a call with (or without) segment ids runs: `Document` added where the mask
    reads no segment ids, `NonPaddingKeys` where it reads them but lets a padding key (a
    negative id: also the keys past `kv_seq_lengths`) through somewhere."""
    if has_segments and not mask.uses_segment_ids:
        return mask & Document()
    if mask.uses_segment_ids and not has_segments:
        raise ValueError(
            "the mask contains `Document`, which reads segment ids: pass `q_segment_ids` and "
            "`kv_segment_ids`."
        )
    if has_segments and not mask.hides_padding_keys():
        return mask & NonPaddingKeys()
    return mask


#: `qkv_layout` names: whether the sequence axis comes before the heads.
QKV_LAYOUTS = {"bhsd": False, "bshd": True}


def _fits_bhsd(q: tuple, k: tuple, v: tuple) -> bool:
    """Whether shapes could be ``[(B,) H, Lq, D]``, ``[(B,) Hkv, Lk, D]``, ``[(B,) Hkv, Lk, Dv]``
    (``H % Hkv == 0``, key and value alike, query and key of one head dim)."""
    if not (len(q) == len(k) == len(v) and len(q) in (3, 4)):
        return False
    return (k[-3] > 0 and q[-3] % k[-3] == 0 and k[-3:-1] == v[-3:-1] and q[-1] == k[-1]
            and q[:-3] == k[:-3] == v[:-3])


def _swapped(shape: tuple) -> tuple:
    """`shape` with its heads and sequence axes exchanged."""
    return (*shape[:-3], shape[-2], shape[-3], shape[-1])


def check_layout(query, key, value, *, layout: str | None, num_heads: int | None = None,
                 argument: str = "qkv_layout", stacklevel: int = 5) -> str | None:
    """Say in one line when arrays are probably not in the layout the call reads.

    `layout` is the caller's (``None``: the default, ``"bhsd"``). Refused: a query whose heads
    axis does not hold `num_heads` (when known), naming the layout whose axis does. Returned:
    for shapes that fit only the other layout, the hint that `check_qkv`'s error gains
    (`with_layout_hint`). Warned of (`UserWarning`), in the default layout only:
    shapes that fit both layouts and read as ``[B, H, L, D]`` give more heads than tokens to
    the query and to the key, as jax.nn's ``[B, L, H, D]`` arrays read that way do (short
    sequences in ``[B, H, L, D]`` do too: naming the layout silences it).
    """
    name = layout or "bhsd"
    other = "bhsd" if QKV_LAYOUTS[name] else "bshd"
    given = tuple(tuple(np.shape(x)) for x in (query, key, value))
    if not all(len(shape) in (3, 4) for shape in given):
        return None  # `check_qkv` (or the bshd transpose) says what is wrong
    read = tuple(map(_swapped, given)) if QKV_LAYOUTS[name] else given  # as [B, H, L, D]
    if num_heads is not None and read[0][-3] != num_heads:
        hint = (f": it looks like {other}; pass {argument}={other!r}"
                if read[0][-2] == num_heads else "")
        raise ValueError(
            f"`query` of shape {given[0]} has {read[0][-3]} heads in {argument}={name!r}, not "
            f"num_heads={num_heads}{hint}."
        )
    fits_other = _fits_bhsd(*map(_swapped, read))
    if not _fits_bhsd(*read):
        if not fits_other:
            return None
        axes = "[batch, heads, seq, dim]" if other == "bhsd" else "[batch, seq, heads, dim]"
        return f"these shapes fit {argument}={other!r}: pass it if they are {axes}"
    (q, k, _) = read
    if layout is None and num_heads is None and fits_other and q[-3] > q[-2] and k[-3] > k[-2]:
        warnings.warn(
            f"`query` {q} and `key` {k} read as [batch, heads, seq, dim] (the default "
            f"{argument}) have more heads than tokens ({q[-3]} > {q[-2]}): for jax.nn's "
            f"[batch, seq, heads, dim] pass {argument}='bshd'; pass {argument}='bhsd' to "
            "keep this reading without this warning.",
            UserWarning, stacklevel=stacklevel,
        )
    return None


def with_layout_hint(hint: str | None, check, *args, **kwargs):
    """``check(*args, **kwargs)``, its `ValueError` given `hint` (from `check_layout`)."""
    try:
        return check(*args, **kwargs)
    except ValueError as e:
        if hint is None:
            raise
        raise ValueError(f"{str(e).rstrip('.')}; {hint}.") from None


def _layout_to_bhsd(layout: str | None, *arrays):
    """`arrays` from the module's `qkv_layout` to ``[B, H, L, D]`` (and back: it is its own
    inverse)."""
    if not QKV_LAYOUTS[layout or "bhsd"]:
        return arrays
    for name, x in zip(("query", "key", "value"), arrays):
        if np.ndim(x) not in (3, 4):
            raise ValueError(
                f"`{name}` must be [batch, seq, heads, dim] or [seq, heads, dim] "
                f"(qkv_layout='bshd'); got shape {tuple(np.shape(x))}."
            )
    return tuple(jnp.swapaxes(jnp.asarray(x), -2, -3) for x in arrays)


#: Compiled static masks by what they are built from (`compile_mask`), least recently used
#: first: each layer of a model that shares a mask, each retrace of a jitted step (a second
#: `jit`, a mask swapped back) reuses the layouts built on the host instead of building them
#: again. Entries hold at most `_COMPILED_BYTES` of arrays (layouts of short sequences; long
#: ones are built once per trace, their cost dwarfed by the call's), `_COMPILED_ENTRIES` in all.
_COMPILED: "collections.OrderedDict[tuple, CompiledMask]" = collections.OrderedDict()
_COMPILED_ENTRIES = 32
_COMPILED_BYTES = 4 << 20


def compile_mask(resolved: ResolvedMask, tiling: AbstractKernelConfig, reads) -> CompiledMask:
    """``resolved.compile(tiling, reads)``, from `_COMPILED` where the mask is static (no
    per-call data, no arrays: its layouts are constants of the trace) and hashable."""
    if not resolved.is_static:
        return resolved.compile(tiling, reads)
    key = (resolved.mask, resolved.q_len, resolved.kv_len, resolved.num_heads, tiling.blocks,
           reads, jax.config.jax_enable_x64)
    try:
        compiled = _COMPILED.get(key)
    except TypeError:  # an unhashable mask (a predicate closing over a list, say)
        return resolved.compile(tiling, reads)
    if compiled is not None:
        _COMPILED.move_to_end(key)
        return compiled
    compiled = resolved.compile(tiling, reads)
    arrays = [x for x in jax.tree.leaves(compiled) if eqx.is_array(x)]
    if any(isinstance(x, jax.core.Tracer) for x in arrays):
        return compiled
    if sum(x.nbytes for x in arrays) <= _COMPILED_BYTES:
        _COMPILED[key] = compiled
        while len(_COMPILED) > _COMPILED_ENTRIES:
            _COMPILED.popitem(last=False)
    return compiled


#: The per-call arguments of `__call__` and `plan` besides query, key and value.
_CALL_DATA = ("bias", "sinks", "q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions",
              "kv_seq_lengths")


def merge_alias(arguments: dict, name: str, alias: str, *, default=None) -> None:
    """`arguments[name]` from jax.nn's `alias` when only that is given (the alias then
    ``default``); both given is an error."""
    value, other = arguments.get(name, default), arguments.pop(alias, default)
    if other is default:
        return
    if value is not default:
        raise TypeError(f"`{name}` and `{alias}` (its jax.nn name) are the same argument; "
                        "pass one.")
    arguments[name] = other


def _checked(attn: "BlockSparseAttention", query, key, value, data: dict) -> tuple:
    """A call's arguments checked (`check_call`, the one place), query, key and value brought
    from the module's `qkv_layout` to ``[B, H, L, D]``: ``(query, key, value, data)``."""
    hint = check_layout(query, key, value, layout=attn.qkv_layout, num_heads=attn.num_heads)
    query, key, value = _layout_to_bhsd(attn.qkv_layout, query, key, value)
    return with_layout_hint(hint, check_call, query, key, value, **data)


def _validate_call(arguments: dict):
    attn = arguments["self"]
    merge_alias(arguments, "kv_seq_lengths", "key_value_seq_lengths")
    q, k, v, data = _checked(attn, arguments["query"], arguments["key"], arguments["value"],
                             {name: arguments[name] for name in _CALL_DATA})
    arguments.update(query=q, key=k, value=v, key_value_seq_lengths=None, **data)
    if not QKV_LAYOUTS[attn.qkv_layout or "bhsd"]:
        return None
    if arguments["return_lse"]:
        return lambda result: (_layout_to_bhsd(attn.qkv_layout, result[0])[0], result[1])
    return lambda out: _layout_to_bhsd(attn.qkv_layout, out)[0]


#: The accepted `logits_soft_cap` values. Kernels compute ``c * tanh(s / c)`` in float32,
#: which flushes ``|s / c| < 2**-126`` to zero: a cap ``c`` loses the logits below
#: ``c * 2**-126``, 1.2e-8 at ``c = 1e30`` (under float32's rounding of logits near one; at
#: 1e37 whole logits vanish and the output is wrong). Caps below 1e-30 approach the float32
#: numbers that are themselves flushed to zero.
SOFT_CAP_RANGE = (1e-30, 1e30)


def _given(value) -> str:
    """What a field holds, for an error message."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(value.shape)}"
    if isinstance(value, str):
        return f"str {value!r}"
    return "None" if value is None else type(value).__name__


def _check_strategies(attn: "BlockSparseAttention") -> None:
    """A one-line `TypeError` naming the field unless `mask`, `kernel`, `tiling`, `score` and
    `sharding` are strategies of their kinds: when the module is made, and at each call, since
    `eqx.tree_at` swaps a field in without `__init__`."""
    if not isinstance(attn.mask, AbstractMask):
        hint = ": an element mask is masks.ArrayMask(array)" if hasattr(attn.mask, "shape") else ""
        raise TypeError(
            f"`mask` must be an AbstractMask (e.g. masks.Full(), masks.Causal()); got "
            f"{_given(attn.mask)}{hint}."
        )
    # None means automatic (as `__init__`'s converters read it), also swapped in.
    if not isinstance(attn.kernel, (AbstractKernel, AutoKernel, type(None))):
        raise TypeError(
            "`kernel` must be an AbstractKernel (e.g. kernels.XlaBlockSparse()), AutoKernel() "
            f"or None; got {_given(attn.kernel)}."
        )
    if not isinstance(attn.tiling, (AbstractTiling, type(None))):
        raise TypeError(
            "`tiling` must be a kernel's config (e.g. kernels.TritonConfig, or Tiling), "
            f"AutoTiling() or None; got {_given(attn.tiling)}."
        )
    check_score(attn.score)
    if not isinstance(attn.sharding, AbstractSharding):
        raise TypeError(
            "`sharding` must be an AbstractSharding (e.g. sharding.Unsharded(), "
            f"sharding.ShardMap(mesh, ...)); got {_given(attn.sharding)}."
        )


class BlockSparseAttention(eqx.Module):
    """Exact attention that skips the blocks its mask leaves empty.

    Holds four strategies: a `mask` (which pairs attend), a `kernel` (how it runs; the default
    `AutoKernel()` lets `select_kernel` pick per platform), a `tiling` (block sizes; the default
    `AutoTiling()` takes the tuned config from the autotune cache, else the kernel's heuristic)
    and a `sharding` (how it spreads over devices).
    Swap any of them with `eqx.tree_at` (in training, `swap_strategy` keeps the optimizer state).

    **Arguments:**

    - `mask`: an `AbstractMask`; default `masks.Full()` (dense attention).
    - `kernel`: an `AbstractKernel`; default `AutoKernel()` (selected per call; ``None`` means
      the same).
    - `tiling`: an `AbstractTiling`: a config (the kernel's own, e.g. `kernels.TritonConfig`,
      or the kernel-independent `Tiling` of block sizes); default `AutoTiling()` (the cache,
      else the kernel's heuristic; ``None`` means the same).
    - `sharding`: an `AbstractSharding`; default `Unsharded()`.
    - `score`: an `AbstractScore` added to every logit before the soft cap (`scores.ALiBi`,
      `scores.RelativePositionBias`, `scores.ScoreFunction`; see docs/scores.md), or ``None``
      (default). Its learned arrays are leaves of the module.
    - `softmax_scale`: multiplies ``q . k``; default ``1 / sqrt(head_dim)``.
    - `logits_soft_cap`: if set to ``c``, logits become ``c * tanh(logits / c)``; ``c`` in
      ``[1e-30, 1e30]`` (beyond that float32 loses the logits).
    - `qkv_layout`: ``"bhsd"`` (``[B, H, L, D]``) or ``"bshd"`` (``[B, L, H, D]``, the layout
      of `jax.nn.dot_product_attention`, for query, key, value and the output; unbatched
      ``[L, H, D]``). The arrays are transposed; no kernel reads ``bshd`` in place. Default
      ``None``: ``"bhsd"``, with a `UserWarning` where the shapes fit both layouts and the
      ``"bhsd"`` reading has more heads than tokens (as jax.nn's arrays read that way do);
      naming the layout silences it. Shapes that fit only the other layout are refused,
      naming it.
    - `num_heads`: the query head count, or ``None`` (default). When given, every call checks
      that the query's heads axis (in `qkv_layout`) holds it, and names the layout that fits
      when the other axis does.

    ```python
    import eqx_bsattn as bsa
    attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal() & bsa.masks.SlidingWindow(256))
    out = attn(q, k, v)   # q [H, Lq, D] or [B, H, Lq, D]; k, v [(B,) Hkv, Lk, D | Dv]
    ```
    """

    mask: AbstractMask = Full()
    kernel: AbstractKernel | AutoKernel = eqx.field(default=AutoKernel(), converter=_kernel_or_auto)
    tiling: AbstractTiling = eqx.field(default=AutoTiling(), converter=_tiling_or_auto)
    sharding: AbstractSharding = Unsharded()
    softmax_scale: float | None = eqx.field(default=None, static=True, converter=python_scalar)
    logits_soft_cap: float | None = eqx.field(default=None, static=True, converter=python_scalar)
    qkv_layout: str | None = eqx.field(default=None, static=True)
    score: AbstractScore | None = None
    num_heads: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        if self.num_heads is not None and (
            not isinstance(self.num_heads, int) or isinstance(self.num_heads, bool)
            or self.num_heads <= 0
        ):
            raise ValueError(
                f"`num_heads` must be a positive int or None; got {self.num_heads!r}."
            )
        if self.qkv_layout is not None and self.qkv_layout not in QKV_LAYOUTS:
            raise ValueError(
                "`qkv_layout` must be 'bhsd' ([batch, heads, seq, dim], the default) or 'bshd' "
                f"([batch, seq, heads, dim], jax.nn.dot_product_attention's); got "
                f"{self.qkv_layout!r}."
            )
        _check_strategies(self)
        if self.softmax_scale is not None and not (
            isinstance(self.softmax_scale, (int, float)) and math.isfinite(self.softmax_scale)
        ):
            raise ValueError(f"`softmax_scale` must be a finite number; got {self.softmax_scale!r}.")
        cap = self.logits_soft_cap
        if cap is not None and not (
            isinstance(cap, (int, float)) and not isinstance(cap, bool)
            and SOFT_CAP_RANGE[0] <= cap <= SOFT_CAP_RANGE[1]
        ):
            raise ValueError(
                f"`logits_soft_cap` must be a number in [1e-30, 1e30] or None; got {cap!r}."
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
        kv_seq_lengths=None,
        platform: str | None = None,
        key_value_seq_lengths=None,
        return_lse: bool = False,
    ) -> CallPlan:
        """Everything a call decides before it runs, once: the mask resolved and compiled,
        the per-call data normalised, the kernel and the tiling.

        Takes the arguments of `__call__`; ``print(attn.plan(q, k, v))`` says which kernel
        would run and why, with which tiling, and how dense each pass's layout is. Runs no
        attention.
        """
        data = dict(bias=bias, sinks=sinks, q_segment_ids=q_segment_ids,
                    kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                    kv_positions=kv_positions, kv_seq_lengths=kv_seq_lengths,
                    key_value_seq_lengths=key_value_seq_lengths)
        merge_alias(data, "kv_seq_lengths", "key_value_seq_lengths")
        query, key, value, data = _checked(self, query, key, value, data)
        return self._plan(query, key, value, platform=platform, return_lse=return_lse, **data)

    def _plan(self, query, key, value, *, kv_seq_lengths=None, platform=None,
              return_lse: bool = False, **data) -> CallPlan:
        """`plan` for ``[B, H, L, D]`` (or ``[H, L, D]``) arrays that `check_call` has checked
        (`__call__`'s decorator, `plan` or the function door): nothing is checked twice."""
        _check_strategies(self)  # `eqx.tree_at` may have swapped a field since `__init__`
        platform = check_platform(platform)
        if return_lse and not isinstance(self.sharding, Unsharded):
            raise ValueError(
                f"`return_lse=True` runs unsharded only; this module's sharding is "
                f"{type(self.sharding).__name__}."
            )
        batched = query.ndim == 4
        batch = query.shape[0] if batched else 1
        heads, q_len, dim = query.shape[-3:]
        kv_heads, kv_len, value_dim = value.shape[-3:]
        if kv_seq_lengths is not None:
            keep = jnp.arange(kv_len)[None, :] < kv_seq_lengths[:, None]
            q_seg, kv_seg = hide_keys(keep, data["q_segment_ids"], data["kv_segment_ids"],
                                      q_len=q_len)
            data.update(q_segment_ids=q_seg if batched else q_seg[0],
                        kv_segment_ids=kv_seg if batched else kv_seg[0])
        inputs = prepare_inputs(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, **data)
        inputs = attach_score(self.score, inputs, heads, self.sharding, batched=batched)
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
            positions=(inputs.q_positions is not None or inputs.kv_positions is not None
                       or self.sharding.passes_positions),
            lse=self.sharding.needs_lse or return_lse,
            in_loop=self.sharding.loops_kernel,
            sharded=not isinstance(self.sharding, Unsharded),
            score=() if inputs.score is None else inputs.score.kinds,
            score_function=None if inputs.score is None else inputs.score.function,
            score_params=(None if inputs.score is None or inputs.score.function is None
                          or not inputs.score.function.takes_params
                          else ScoreParams.of(inputs.score.params)),
        )
        if is_auto(self.kernel):
            choice = choose_kernel(resolved, features, refuses=lambda kernel: (
                self.sharding.kernel_decline(kernel, resolved, features)))
            kernel = choice.kernel
        else:
            choice = None
            kernel = self.kernel
            if return_lse and not isinstance(kernel, AbstractLseKernel):
                raise ValueError(
                    f"`return_lse=True` needs a kernel that returns the log-sum-exp (an "
                    f"AbstractLseKernel); kernel {kernel.name} does not."
                )
            why = decline_reason(kernel, resolved, features)
            if why is not None:
                raise ValueError(f"kernel {kernel.name} cannot run this call: {why}")
        # The one place a bias's size-1 axes are broadcast: for kernels that do not read them,
        # and under a sharding that does not split them as they are (`keeps_bias_axes`), the
        # bias is ``[bb, hb, Lq, Lk]`` as it always was.
        if not (isinstance(kernel, AbstractBroadcastBiasKernel)
                and self.sharding.keeps_bias_axes):
            inputs = full_bias(inputs, q_len, kv_len)
        strategy = AutoTiling() if is_auto(self.tiling) else self.tiling
        tiling, source = strategy.choose(kernel, features, resolved)
        try:
            tiling = kernel.adapt_tiling(tiling, features)
        except ValueError as e:
            raise ValueError(f"the {source} tiling cannot run on kernel {kernel.name}: {e}") from None
        if source != "module":  # an automatic tiling fits the sharding's shards
            tiling = self.sharding.fit_tiling(tiling, kernel, features)
        compiled = compile_mask(resolved, tiling, kernel.reads)
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(dim)
        return CallPlan(kernel, choice, tiling, source, compiled, features, inputs, float(scale),
                        resolved)

    @typechecked(validate=_validate_call)
    def __call__(
        self,
        query: Float[Array, "*batch heads q_len dim"],
        key: Float[Array, "*batch kv_heads kv_len dim"],
        value: Float[Array, "*batch kv_heads kv_len value_dim"],
        *,
        bias: Float[ArrayOrNumpy, "..."] | None = None,
        sinks: Float[ArrayOrNumpy, "..."] | None = None,
        q_segment_ids: Integer[ArrayOrNumpy, "*_ q_len"] | None = None,
        kv_segment_ids: Integer[ArrayOrNumpy, "*_ kv_len"] | None = None,
        q_positions: Integer[ArrayOrNumpy, "*_ q_len"] | None = None,
        kv_positions: Integer[ArrayOrNumpy, "*_ kv_len"] | None = None,
        kv_seq_lengths: Integer[ArrayOrNumpy, "*_"] | int | None = None,
        purify: bool = False,
        key_value_seq_lengths: Integer[ArrayOrNumpy, "*_"] | int | None = None,
        return_lse: bool = False,
    ) -> (Float[Array, "*batch heads q_len value_dim"]
          | tuple[Float[Array, "*batch heads q_len value_dim"],
                  Float[Array, "*batch heads q_len"]]):
        """Attend.

        **Arguments** (in the default `qkv_layout`, ``"bhsd"``; with ``"bshd"`` query, key,
        value and the output are ``[B, L, H, D]``). jax.nn's names are accepted beside ours:
        `key_value_seq_lengths` for `kv_seq_lengths` (one of the two).

        - `query`: ``[B, H, Lq, D]`` or unbatched ``[H, Lq, D]``.
        - `key`: ``[B, Hkv, Lk, D]`` (``H % Hkv == 0``: query head ``h`` reads kv head
          ``h // (H // Hkv)``).
        - `value`: ``[B, Hkv, Lk, Dv]``.
        - `bias`: additive logits bias broadcasting to ``[B, H, Lq, Lk]``; differentiable.
        - `sinks`: extra logits joining every row's softmax denominator with a zero value;
          differentiable. Every entry point reads their shape this way: ``[H]`` one per head;
          ``[Hkv]`` (when ``Hkv != H``) one per kv head, shared by its ``H // Hkv`` query
          heads; any other length ``[S]`` shared by all heads; ``[H, S]``, or ``[Hkv, S]`` per
          kv head. (``S`` sinks shared by all heads when ``S == Hkv``:
          ``jnp.broadcast_to(sinks, (H, S))``.)
        - `q_segment_ids`, `kv_segment_ids`: ``[B, L]`` (or ``[L]``) ints; a query sees a key
          only when their ids are equal and non-negative (``-1`` marks padding).
        - `q_positions`, `kv_positions`: ``[B, L]`` (or ``[L]``) ints; positional masks act on
          these instead of the token indices.
        - `kv_seq_lengths`: ``[B]`` ints (or a scalar): only the first ``kv_seq_lengths[b]``
          keys of example ``b`` are seen, the rest is padding (as `key_value_seq_lengths` of
          `jax.nn.dot_product_attention`). It rides on the segment ids, so new lengths never
          recompile and padding blocks are skipped.
        - `purify`: zero the output rows of padded queries (``q_segment_ids < 0``).
        - `return_lse`: also return each row's log-sum-exp (below); needs an unsharded module
          and a kernel that returns it (an `AbstractLseKernel`: the selector picks one, a
          named kernel that is not one is refused).

        **Returns:** ``[B, H, Lq, Dv]`` (or ``[H, Lq, Dv]``) in the query dtype; a query that
        sees no key gets zeros. With `return_lse`, ``(out, lse)``: `lse` ``[B, H, Lq]`` (or
        ``[H, Lq]``, in every `qkv_layout`) float32, the natural log of each row's softmax
        denominator, ``log(sum_j exp(s_ij) + sum_s exp(sink_s))`` over the keys the row sees,
        ``-inf`` on a row that sees no key (and on purified rows); differentiable, with the
        kernel's own gradient (`eqx_bsattn.contract.public_lse`'s convention).
        """
        data = dict(bias=bias, sinks=sinks, q_segment_ids=q_segment_ids,
                    kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                    kv_positions=kv_positions, kv_seq_lengths=kv_seq_lengths)

        def attend(module, query, key, value, data):
            plan = module._plan(query, key, value, return_lse=return_lse, **data)
            return run_plan(plan, query, key, value, module.sharding, module.logits_soft_cap,
                            purify, return_lse=return_lse)

        return run_on_auto_axes(attend, self, query, key, value, data)


def _hide_padding(mask: CompiledMask, inputs: AttentionInputs, query, key, value):
    """Zero the query rows and the key/value rows of padding tokens, when the mask hides them
    (`CompiledMask.hides_padding`); else the key/value rows of the keys past `kv_seq_lengths`
    (segment id `LENGTH_PADDING`), which every mask a call runs hides (`NonPaddingKeys`).

    A token with a negative segment id under such a mask sees no key (as a query) and is seen
    by no query (as a key). Its rows then must not influence anything, whatever they hold:
    padding buffers often hold garbage, and ``0 * nan`` in a kernel's ``p @ v`` (or ``ds @ k``
    in the backward) would spread it to every row of a tile. Selecting zeros makes the output
    and every gradient independent of those rows, and their own gradients exactly zero. The
    copies are full-size and the kernel keeps them for its backward; a kernel that zeroes the
    rows block by block itself (`AbstractKernel.zeroes_padding`) gets the arrays unchanged.
    """
    if inputs.q_segment_ids is None:
        return query, key, value

    def keep(x, kept):  # x [B, H, L, D], kept [B, L]
        return jnp.where(kept[:, None, :, None], x, jnp.zeros((), x.dtype))

    if mask.hides_padding:
        return (keep(query, inputs.q_segment_ids >= 0), keep(key, inputs.kv_segment_ids >= 0),
                keep(value, inputs.kv_segment_ids >= 0))
    if mask.predicate.hides_padding_keys():
        kept = inputs.kv_segment_ids != LENGTH_PADDING
        return query, keep(key, kept), keep(value, kept)
    return query, key, value


def run_plan(plan: CallPlan, query, key, value, sharding, logits_soft_cap, purify: bool, *,
             return_lse: bool = False):
    """Run a `CallPlan` (batching unbatched inputs, hiding padding, sharding, purify); with
    `return_lse` (unsharded: `_plan` has refused the rest), ``(out, lse)``."""
    if purify and plan.inputs.q_segment_ids is None:
        raise ValueError("`purify=True` zeroes rows whose q_segment_ids are negative: pass segment ids.")
    batched = query.ndim == 4
    if not batched:
        query, key, value = query[None], key[None], value[None]
    if not (plan.kernel.zeroes_padding and plan.mask.hides_padding):
        query, key, value = _hide_padding(plan.mask, plan.inputs, query, key, value)

    def attend(q, k, v, inputs, mask, *, return_lse=False):
        call = plan.kernel.attention_with_lse if return_lse else plan.kernel
        return call(
            q, k, v, mask=mask, inputs=inputs, features=plan.features, tiling=plan.tiling,
            softmax_scale=plan.softmax_scale, logits_soft_cap=logits_soft_cap,
        )

    if return_lse:
        out, lse = attend(query, key, value, plan.inputs, plan.mask, return_lse=True)
    else:
        out, lse = sharding.wrap(attend)(query, key, value, plan.inputs, plan.mask), None
    if purify:
        padded = (plan.inputs.q_segment_ids < 0)[:, None, :]
        out = jnp.where(padded[..., None], jnp.zeros((), out.dtype), out)
        lse = None if lse is None else jnp.where(padded, -jnp.inf, lse)
    if not batched:
        out, lse = out[0], None if lse is None else lse[0]
    return out if lse is None else (out, lse)
