"""The kernel strategy: how attention runs on a device; and the registry the selector reads."""

import abc
import dataclasses
import functools
import types
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from equinox import AbstractClassVar
from jaxtyping import Array, Float

from ._compile import CompiledMask, MaskReads, ResolvedMask
from ._inputs import AttentionInputs
from ._strategy import AbstractStrategy, is_abstract
from ._tiling import AbstractKernelConfig, Tiling


@dataclasses.dataclass(frozen=True)
class ScoreParams:
    """A score function's `params` as a plan knows them: the tree's structure (`treedef`)
    and each leaf's shape and dtype name (`leaves`), hashable. Present (`Features.score_params`)
    whenever the function takes `params`; true where it has leaves.

    ```python
    ScoreParams.of({"slopes": jnp.ones(8)}).tree   # {"slopes": ShapeDtypeStruct((8,), float32)}
    ```
    """

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...] = ()

    @staticmethod
    def of(params) -> "ScoreParams":
        """The plan's view of `params` (a pytree of arrays, tracers or abstract leaves)."""
        leaves, treedef = jax.tree.flatten(params)
        return ScoreParams(treedef, tuple(
            (tuple(np.shape(x)), jnp.dtype(jnp.result_type(x)).name) for x in leaves))

    @property
    def tree(self):
        """`params` with each leaf a `jax.ShapeDtypeStruct` of its shape and dtype."""
        return jax.tree.unflatten(self.treedef, [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
                                                 for shape, dtype in self.leaves])

    def __bool__(self) -> bool:
        # True where there are leaves, as the flag this replaced (`if features.score_params:`).
        return bool(self.leaves)

    @property
    def size(self) -> int:
        """The elements of all leaves together."""
        return sum(int(np.prod(shape)) for shape, _ in self.leaves)


@dataclasses.dataclass(frozen=True)
class Features:
    """What a call asks of a kernel; the selector's input besides the mask and the platform.

    Built by `BlockSparseAttention.plan` from the arguments of a call; build one yourself to ask
    `select_kernel` about a call you have not made.
    """

    platform: str = "cpu"
    dtype: str = "float32"
    batch: int = 1
    num_heads: int = 1
    num_kv_heads: int = 1
    q_len: int = 1
    kv_len: int = 1
    head_dim: int = 64
    #: The value's head dim; ``None`` (the default): `head_dim`, as most calls have it.
    value_dim: int | None = None
    bias: bool = False
    sinks: bool = False
    soft_cap: bool = False
    segment_ids: bool = False
    #: Per-call positions: the caller's, or those a sharding passes to each shard's call.
    positions: bool = False
    lse: bool = False
    #: The kernel runs inside a sharding's loop body, forward and backward together
    #: (`AbstractSharding.loops_kernel`: `RingAttention`), where XLA keeps more of its
    #: temporaries live at once; a kernel that bounds them per step may lower the bound.
    in_loop: bool = False
    #: The kernel runs inside `jax.shard_map`, on one device's shard (any sharding but
    #: `Unsharded`): its launches' outputs must carry a mesh-axis type, and a score function
    #: reads its global head and batch ids through `jax.lax.axis_index`.
    sharded: bool = False
    #: The score terms the call adds (`ScoreTerms.kinds`): e.g. ``("alibi",)``; ``()``: none.
    score: tuple[str, ...] = ()
    #: The call's score function (`ScoreTerms.function`, a hashable `ScoreTerm`) or ``None``,
    #: and its `ScoreTerms.params` as shapes and dtypes (`ScoreParams`; ``None`` where it
    #: takes none): a kernel that traces the function may check it at plan time, on
    #: stand-ins of those shapes (`ScoreParams.tree`).
    score_function: Any = None
    score_params: "ScoreParams | None" = None

    def __post_init__(self):
        if self.value_dim is None:
            object.__setattr__(self, "value_dim", self.head_dim)


def sink_logsumexp(sinks):
    """Each head's sinks ``[H, S]`` as one float32 logit ``[H]``: their log-sum-exp, ``-inf``
    for a head whose sinks are all ``-inf`` (it has none), NaN for a head with a NaN sink.
    The gradient of a ``-inf`` sink is zero, never NaN. The plan refuses ``+inf`` and NaN
    sinks; traced sinks that hold one arrive as NaN (poisoned), and stay NaN here."""
    sinks = sinks.astype(jnp.float32)
    present = jnp.any(sinks != -jnp.inf, axis=-1)
    lse = jax.nn.logsumexp(jnp.where(present[:, None], sinks, 0.0), axis=-1)
    return jnp.where(present, lse, -jnp.inf)


def add_sinks(out, lse, sinks):
    """Join attention sinks to a result computed without them: ``(out, lse)`` as
    `AbstractLseKernel.attention_with_lse` returns them (``[B, H, Lq, Dv]``, ``[B, H, Lq]``)
    and `sinks` ``[H, S]``. Returns the float32 output and log-sum-exp with the sinks in each
    row's denominator; a row that sees no key keeps zeros and ``-inf``, a head whose sinks are
    all ``-inf`` keeps its result. Differentiable (never NaN on those rows). A NaN sink
    makes each row of its head that sees a key NaN.
    """
    sink_lse = sink_logsumexp(sinks)[None, :, None]
    joined = jnp.isfinite(lse) & (sink_lse != -jnp.inf)
    row = jnp.where(joined, lse, 0.0)
    total = jnp.logaddexp(row, jnp.where(joined, sink_lse, 0.0))
    scale = jnp.where(joined, jnp.exp(row - total), jnp.where(jnp.isfinite(lse), 1.0, 0.0))
    return out.astype(jnp.float32) * scale[..., None], jnp.where(joined, total, lse)


def pad_axis(x, axis: int, size: int, value=0):
    """`x` (NumPy or JAX) padded with `value` along `axis` to `size` (unchanged if it is
    already that long)."""
    extra = size - x.shape[axis]
    if extra <= 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.pad(x, pad, constant_values=np.asarray(value, x.dtype))


@functools.cache
def first_gpu():
    """The first GPU device JAX sees (its ``compute_capability``, its ``core_count``), or
    ``None``."""
    return next((d for d in jax.devices() if d.platform == "gpu"), None)


def _traced_by(arrays, tracers: set[str]) -> bool:
    """Whether a leaf of `arrays` is a tracer of one of JAX's `tracers` classes, by name (not
    all of them are public)."""
    return any(isinstance(x, jax.core.Tracer) and tracers & {c.__name__ for c in type(x).__mro__}
               for x in jax.tree.leaves(arrays))


def refuse_forward_mode(kernel_name: str, *arrays) -> None:
    """Raise a `TypeError` naming the way out if `arrays` are being differentiated in forward
    mode (`jax.jvp`, `jax.jacfwd`, `jax.hessian`).

    For kernels that define only a reverse-mode rule (`jax.custom_vjp`): JAX refuses forward
    mode through them, and under `jit` it says so only when lowering, without naming the
    kernel. Reverse mode (`jax.grad`, `jax.vjp`) traces with linearize tracers and passes.
    """
    # With direct linearization off, reverse mode traces with JVP tracers too: say nothing.
    if not getattr(jax.config, "jax_use_direct_linearize", True):
        return
    if _traced_by(arrays, {"JVPTracer"}):
        raise TypeError(
            f"kernel {kernel_name} has no forward-mode rule (`jax.jvp`, `jax.jacfwd`, "
            "`jax.hessian`): it defines only a reverse-mode gradient (`jax.custom_vjp`). For "
            "forward-mode AD pass `kernel=kernels.DenseReference()` (plain JAX; memory grows "
            "with Lq x Lk)."
        )


def refuse_second_order(kernel_name: str, *arrays) -> None:
    """Raise a `TypeError` naming the way out if a kernel's gradient is being differentiated
    (a gradient of a gradient, a Hessian): call it in the forward rule of a `jax.custom_vjp`
    whose launches JAX cannot differentiate, on its inputs, and in its backward rule, on the
    residuals and the cotangents (`arrays`).

    Under `jax.grad` of a gradient both rules run on linearize tracers, under forward mode over
    a gradient (`jax.hessian`, `jax.jvp` of `jax.grad`) on JVP tracers; a first-order gradient
    shows them neither.
    """
    if _traced_by(arrays, {"JVPTracer", "LinearizeTracer"}):
        raise TypeError(
            f"kernel {kernel_name} has no second-order gradient (a gradient of its gradient, "
            "a Hessian): its backward runs launches JAX cannot differentiate. "
            "`kernel=kernels.XlaBlockSparse()` and `kernel=kernels.DenseReference()` (plain "
            "JAX) differentiate twice."
        )


_REGISTRY: list[type["AbstractKernel"]] = []


def registered_kernels() -> tuple[type["AbstractKernel"], ...]:
    """Every concrete kernel class defined so far, built-in or user's, in definition order.

    Concrete means not abstract in equinox's sense (`is_abstract`): it defines every abstract
    method and class variable of the contract.
    """
    return tuple(cls for cls in _REGISTRY if not is_abstract(cls))


class AbstractKernel(AbstractStrategy):
    """How attention is computed: a reference, an XLA loop, a Triton or cuDNN launch.

    A concrete subclass (one that is not `is_abstract`) is registered with the selector when it
    is defined. It sets three class variables (abstract here, `eqx.AbstractClassVar`):

    - `name`: the short name the selector, the plan and the benchmark show.
    - `platforms`: where it runs, e.g. ``("gpu",)``; the selector declines it elsewhere.
    - `reads` (a `MaskReads`): what it reads of the `CompiledMask`: ``"dense"`` (no layout:
      it visits every pair, or expresses the terms itself), ``"elements"`` (a layout per pass;
      partial blocks through `CompiledMask.visible`) or ``"terms"`` (a layout per pass; partial
      blocks from `CompiledMask.terms` inside the kernel, or from element bitmaps the plan puts
      in the layouts where the mask has no terms).

    and implements three abstract methods:

    - `priority(platform)` (classmethod): higher is tried first by the selector on that
      platform; ``None`` means "not a candidate there" (it can still be chosen explicitly).
    - `decline_reason(mask, features)`: ``None`` if it can run this call, else one sentence
      saying why not (the selector shows it to the user). `mask` is the `ResolvedMask`: its
      `terms` say what the mask is in kernel terms.
    - `__call__(query, key, value, *, mask, inputs, features, tiling, softmax_scale,
      logits_soft_cap)`: batched ``[B, H, Lq, D]`` / ``[B, Hkv, Lk, D]`` / ``[B, Hkv, Lk, Dv]``
      in, ``[B, H, Lq, Dv]`` out, differentiable in query, key, value, bias and sinks; `mask`
      is the `CompiledMask`.

    Its config has defaults it may replace:

    - `config_type` (class variable, default `Tiling`): its config, an `AbstractKernelConfig`
      (typed, immutable, checked when built); the autotune cache stores its fields.
    - `default_tiling(features, mask)`: its heuristic config when the module has none.
    - `adapt_tiling(tiling, features)`: the config it runs for any config (its own, or
      another's blocks; e.g. blocks clamped to the sequence), or a `ValueError` naming the
      field it cannot run.
    - `tiling_candidates(features, mask)`: the configs `eqx_bsattn.autotune` times, each with
      ``None`` or the reason it cannot run; by default the heuristic alone.

    A kernel that also returns each row's log-sum-exp (sequence sharding merges partial
    results by it) subclasses `AbstractLseKernel` instead.

    ```python
    class MyKernel(AbstractKernel):
        name: ClassVar[str] = "mine"
        platforms: ClassVar[tuple[str, ...]] = ("cpu",)
        reads: ClassVar[MaskReads] = "dense"

        @classmethod
        def priority(cls, platform):
            return None                      # only when passed explicitly

        def decline_reason(self, mask, features):
            return None                      # runs every call

        def __call__(self, query, key, value, *, mask, inputs, features, tiling,
                     softmax_scale, logits_soft_cap):
            ...
    ```
    """

    name: AbstractClassVar[str]
    platforms: AbstractClassVar[tuple[str, ...]]
    reads: AbstractClassVar[MaskReads]
    #: The score terms (`ScoreTerms.kinds`) it adds inside its loop; the selector declines
    #: calls with others. Default none: a kernel that does not know of them never drops them.
    score_kinds: ClassVar[tuple[str, ...]] = ()
    #: Part of the autotune cache key: change it when a change to the kernel makes tilings
    #: tuned before it stale.
    version: ClassVar[str] = "1"
    config_type: ClassVar[type[AbstractKernelConfig]] = Tiling
    #: The features it has built and checked without its device (in an interpreter, lowered
    #: for it) that have not yet run on that device: ``{feature: what it is}``. Its
    #: `decline_reason` declines a call that needs one, in one line ("... has not yet run on a
    #: GPU"), until a device run proves it and the feature leaves the record
    #: (`benchmarks/device_proofs.sh` runs every kernel's pending proofs; the tests' option
    #: ``--prove-awaiting`` takes the features as if proven, for that run only).
    awaiting_device_run: ClassVar[Mapping[str, str]] = types.MappingProxyType({})
    #: True: where the mask hides padding (`CompiledMask.hides_padding`) and the call has
    #: segment ids, the kernel zeroes the q, k, v rows of padding tokens (negative ids) in each
    #: block it reads, and their rows of dq, dk, dv, itself. Default False: the plan selects
    #: zeros into full-size copies of q, k and v before the call.
    zeroes_padding: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "returns_lse" in vars(cls):
            raise TypeError(
                f"{cls.__name__}: `returns_lse` is no longer read; a kernel that returns the "
                "log-sum-exp subclasses `AbstractLseKernel` (and implements `attention_with_lse`)."
            )
        _REGISTRY.append(cls)

    @classmethod
    def awaits_device_run(cls, feature: str) -> bool:
        """Whether `feature` (a key of `awaiting_device_run`) still waits for a run on this
        kernel's device."""
        return feature in cls.awaiting_device_run

    @classmethod
    @abc.abstractmethod
    def priority(cls, platform: str) -> int | None:
        """Selector order on `platform`: higher first; ``None`` = not an automatic candidate."""

    @abc.abstractmethod
    def decline_reason(self, mask: ResolvedMask, features: Features) -> str | None:
        """``None`` if this kernel runs the call, else why it does not."""

    def default_tiling(self, features: Features, mask: ResolvedMask) -> AbstractKernelConfig:
        """The heuristic config (a `config_type`) for `features` and `mask`."""
        return Tiling(block_q=128, block_kv=128)

    def adapt_tiling(
        self, tiling: AbstractKernelConfig, features: Features
    ) -> AbstractKernelConfig:
        """The config this kernel runs for `tiling` and `features`; raise `ValueError` if it
        cannot."""
        return tiling

    def tiling_candidates(
        self, features: Features, mask: ResolvedMask
    ) -> tuple[tuple[AbstractKernelConfig, str | None], ...]:
        """The tilings worth timing for this call, most promising first, the heuristic
        (`default_tiling`) among them: ``((tiling, None), ...)`` for those it can run,
        ``(tiling, reason)`` for those it cannot (too much shared memory, a block its launch
        does not take, ...). `eqx_bsattn.autotune` times the runnable ones and shows the
        reasons. A kernel without choices (the default) offers its heuristic alone.

        ```python
        kernel.tiling_candidates(plan.features, plan.resolved)
        # ((TritonConfig(block_q=128, block_kv=64, ...), None), ...)
        ```
        """
        return ((self.default_tiling(features, mask), None),)

    @abc.abstractmethod
    def __call__(
        self,
        query: Float[Array, "batch heads q_len dim"],
        key: Float[Array, "batch kv_heads kv_len dim"],
        value: Float[Array, "batch kv_heads kv_len value_dim"],
        *,
        mask: CompiledMask,
        inputs: AttentionInputs,
        features: Features,
        tiling: AbstractKernelConfig,
        softmax_scale: float,
        logits_soft_cap: float | None,
    ) -> Float[Array, "batch heads q_len value_dim"]:
        """Attention output ``[B, H, Lq, Dv]`` (rows that see no key are zeros)."""


class AbstractLseKernel(AbstractKernel):
    """A kernel that also returns each row's log-sum-exp: what `RingAttention` merges shards
    by. The selector declines any other kernel for a call that needs it (``Features.lse``).

    Besides the `AbstractKernel` contract it implements `attention_with_lse`, with the same
    arguments as `__call__`: ``(out [B, H, Lq, Dv], lse [B, H, Lq] float32)``, both
    differentiable. `public_lse`, `backward_delta` and `add_sinks` (in `eqx_bsattn.contract`)
    hold the convention, so one kernel's backward can follow another's forward.

    ```python
    isinstance(kernels.XlaBlockSparse(), AbstractLseKernel)    # True
    out, lse = kernel.attention_with_lse(q, k, v, mask=..., inputs=..., features=...,
                                         tiling=..., softmax_scale=..., logits_soft_cap=None)
    ```
    """

    @abc.abstractmethod
    def attention_with_lse(
        self,
        query: Float[Array, "batch heads q_len dim"],
        key: Float[Array, "batch kv_heads kv_len dim"],
        value: Float[Array, "batch kv_heads kv_len value_dim"],
        *,
        mask: CompiledMask,
        inputs: AttentionInputs,
        features: Features,
        tiling: AbstractKernelConfig,
        softmax_scale: float,
        logits_soft_cap: float | None,
    ) -> tuple[Float[Array, "batch heads q_len value_dim"], Float[Array, "batch heads q_len"]]:
        """The output of `__call__` and each row's log-sum-exp ``[B, H, Lq]`` (float32).

        The log-sum-exp is ``log(sum_k exp(s_k) + sum_sinks exp(sink))`` over the row's visible
        logits ``s_k`` (after bias and soft cap); ``-inf`` on a row that sees no key (whose
        output is zeros). Both are differentiable: a custom backward adds the log-sum-exp's
        cotangent as ``delta_i -= dlse_i``.
        """


class AbstractBroadcastBiasKernel(AbstractKernel):
    """A kernel that reads a bias with its size-1 axes kept, so that a bias without an
    ``Lq`` or ``Lk`` axis of its own costs ``O(Lq + Lk)``, not ``Lq x Lk``.

    Its `AttentionInputs.bias` is ``[bb, hb, Lq or 1, Lk or 1]`` (``bb`` in ``{1, B}``, ``hb``
    in ``{1, H}``: a per-key ``[B, 1, 1, Lk]``, a per-query ``[B, H, Lq, 1]``, a scalar
    ``[1, 1, 1, 1]``); it broadcasts each block's rows and columns itself, and the bias's
    cotangent it returns has the bias's shape (summed over the broadcast axes). Every other
    kernel receives the bias broadcast to ``[bb, hb, Lq, Lk]`` by the plan. It adds no method:
    a kernel declares the capability by subclassing it (besides `AbstractLseKernel` if it is
    one).

    ```python
    class MyKernel(AbstractLseKernel, AbstractBroadcastBiasKernel):
        ...

    isinstance(kernels.XlaBlockSparse(), AbstractBroadcastBiasKernel)   # True
    ```
    """
