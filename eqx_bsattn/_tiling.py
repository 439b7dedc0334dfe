"""Tilings: the strategy the plan asks for the config of the kernel that runs (`AbstractTiling`,
`AutoTiling`), the part every kernel's config shares (`AbstractKernelConfig`: the tiles of each
pass) and `Tiling`, the kernel-independent config."""

import abc
import dataclasses
import warnings
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import equinox as eqx
from equinox import AbstractClassVar

from ._cache import lookup, tiling_policy
from ._inputs import python_scalar
from ._strategy import AbstractStrategy


class PassBlocks(NamedTuple):
    """``(block_q, block_kv)`` of each pass: the tiles the plan builds each layout at
    (`CompiledMask.forward`, `.dq`, `.dkv`)."""

    forward: tuple[int, int]
    dq: tuple[int, int]
    dkv: tuple[int, int]


class AbstractTiling(AbstractStrategy):
    """The `tiling` strategy of a `BlockSparseAttention`: what the plan asks, once per trace,
    for the config of the kernel that runs.

    Two kinds: `AutoTiling` (the default) chooses per call, from the autotune cache or the
    kernel's heuristic; a config (`AbstractKernelConfig`: `Tiling` or a kernel's own, e.g.
    `kernels.TritonConfig`) is the module's choice. The plan then hands the answer to
    `AbstractKernel.adapt_tiling`, which returns the config the kernel runs.
    """

    @abc.abstractmethod
    def choose(self, kernel, features, mask) -> tuple["AbstractKernelConfig", str]:
        """``(config, source)`` for `kernel` on a call with these `Features` and this
        `ResolvedMask`; `source` says where it came from (``"module"``, ``"cache"``,
        ``"heuristic"``; `CallPlan.tiling_source`)."""


class AbstractKernelConfig(AbstractTiling):
    """A kernel's configuration: typed, immutable, checked when built (`__check_init__`).

    What every config says, whatever the kernel: the tiles of each pass (`blocks`), which the
    plan compiles the mask at. The rest (warps, stages, buffers) is the kernel's own. A kernel
    names its config type (`AbstractKernel.config_type`), builds its heuristic config
    (`default_tiling`), lists its autotune candidates (`tiling_candidates`) and turns any
    config into its own (`adapt_tiling`: another kernel's config gives its blocks).

    As a module's `tiling`, a config is the module's choice for every call.
    """

    #: The fields of the forward pass, which `autotune` combines with the fastest backward.
    forward_fields: AbstractClassVar[tuple[str, ...]]

    @property
    @abc.abstractmethod
    def blocks(self) -> PassBlocks:
        """The tiles of the forward, dq and dk/dv passes."""

    @abc.abstractmethod
    def explicit(self) -> "AbstractKernelConfig":
        """The same config with every field that defaults to another spelled out (configs
        equal as run compare equal); a config without such fields returns itself."""

    @abc.abstractmethod
    def text(self) -> str:
        """The config in one line, e.g. ``"fwd 128x128 | dq 128x64 | dk/dv 64x128"``
        (`blocks_text`)."""

    def variants(self, *groups: tuple[tuple[str, ...], Sequence[tuple]]) -> tuple:
        """This config, then this config with one group of fields set to each of its options,
        the groups taken in turn (the first option of every group, then the second, ...) so
        that a short prefix varies every group; duplicates dropped. For a kernel's
        `tiling_candidates`.

        ```python
        base.variants((("block_q", "block_kv"), [(64, 64), (128, 64)]),
                      (("num_warps", "num_stages"), [(4, 2), (8, 3)]))
        ```
        """
        lists = [[dataclasses.replace(self, **dict(zip(fields, option, strict=True)))
                  for option in options] for fields, options in groups]
        ordered = [self]
        for rank in range(max((len(x) for x in lists), default=0)):
            ordered.extend(x[rank] for x in lists if rank < len(x))
        return tuple(dict.fromkeys(ordered))

    def choose(self, kernel, features, mask):
        return self, "module"


def blocks_text(blocks: PassBlocks) -> str:
    """``"fwd 128x128 | dq 128x64 | dk/dv 64x128"``: a config's `text` of its blocks."""
    names = ("fwd", "dq", "dk/dv")
    return " | ".join(f"{n} {q}x{k}" for n, (q, k) in zip(names, blocks, strict=True))


def _field(**kwargs):
    return eqx.field(static=True, converter=python_scalar, **kwargs)


def check_positive(owner: str, name: str, value: int | None) -> None:
    """`ValueError` naming ``owner.name`` unless `value` is a positive int (or ``None``)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"`{owner}.{name}` must be a positive int or None; got {value!r}.")


def check_fields(config) -> None:
    """`check_positive` on every field of a config (its `__check_init__`'s first step)."""
    for f in dataclasses.fields(config):
        check_positive(type(config).__name__, f.name, getattr(config, f.name))


def chained_blocks(block_q: int, block_kv: int, dq: tuple, dkv: tuple) -> PassBlocks:
    """`PassBlocks` of a config whose dk/dv blocks default to the forward ones and whose dq
    blocks default to the dk/dv ones: `dq`, `dkv` are ``(block_q, block_kv)`` pairs with
    ``None`` where unset."""
    kv_q, kv_k = dkv[0] or block_q, dkv[1] or block_kv
    return PassBlocks((block_q, block_kv), (dq[0] or kv_q, dq[1] or kv_k), (kv_q, kv_k))


#: `Tiling`'s launch parameters, kept for one release: they are `TritonBlockSparse`'s.
LAUNCH_FIELDS = ("num_warps", "num_stages", "num_warps_bwd", "num_stages_bwd", "num_warps_dq",
                 "num_stages_dq")


class Tiling(AbstractKernelConfig):
    """Block sizes of each pass, for any kernel that reads block layouts: the
    kernel-independent config. Each kernel takes these blocks into its own config
    (`AbstractKernel.adapt_tiling`); a kernel's own config (`kernels.TritonConfig`,
    `kernels.XlaConfig`, `kernels.SplashConfig`, `kernels.MosaicConfig`) also sets what only
    that kernel has.

    Backward fields left at ``None`` take the forward value; ``*_dq`` fields left at ``None``
    take the backward value.

    **Arguments:**

    - `block_q`, `block_kv`: forward block sizes (query rows, key columns of one tile).
    - `block_q_bwd`, `block_kv_bwd`: the dk/dv pass (over kv-blocks); default: forward's.
    - `block_q_dq`, `block_kv_dq`: the dq pass (over q-blocks); default: the dk/dv pass's.
    - `num_warps`, `num_stages` and their ``_bwd`` / ``_dq`` forms: deprecated (a
      `DeprecationWarning`): they are `TritonBlockSparse`'s; pass `kernels.TritonConfig`.
      For one release they still reach Triton.

    ```python
    tiling = Tiling(block_q=128, block_kv=64, block_q_bwd=64, block_kv_bwd=128)
    attn = BlockSparseAttention(mask=masks.Causal(), tiling=tiling)
    ```
    """

    block_q: int = _field()
    block_kv: int = _field()
    block_q_bwd: int | None = _field(default=None)
    block_kv_bwd: int | None = _field(default=None)
    num_warps: int | None = _field(default=None)
    num_stages: int | None = _field(default=None)
    num_warps_bwd: int | None = _field(default=None)
    num_stages_bwd: int | None = _field(default=None)
    block_q_dq: int | None = _field(default=None)
    block_kv_dq: int | None = _field(default=None)
    num_warps_dq: int | None = _field(default=None)
    num_stages_dq: int | None = _field(default=None)

    forward_fields: ClassVar[tuple[str, ...]] = ("block_q", "block_kv", "num_warps",
                                                 "num_stages")

    def __check_init__(self):
        check_fields(self)
        launch = [name for name in LAUNCH_FIELDS if getattr(self, name) is not None]
        if launch:
            # __check_init__ <- AbstractStrategy.__post_init__ <- __init__ <- the caller.
            warnings.warn(
                f"Tiling({', '.join(launch)}=...) is deprecated: launch parameters are "
                "TritonBlockSparse's; pass eqx_bsattn.kernels.TritonConfig(...) with the same "
                "fields instead (Tiling keeps only block sizes from the next release).",
                DeprecationWarning, stacklevel=4)

    @property
    def backward_blocks(self) -> tuple[int, int]:
        """``(block_q, block_kv)`` of the dk/dv pass."""
        return self.blocks.dkv

    @property
    def dq_blocks(self) -> tuple[int, int]:
        """``(block_q, block_kv)`` of the dq pass."""
        return self.blocks.dq

    @property
    def blocks(self) -> PassBlocks:
        return chained_blocks(self.block_q, self.block_kv, (self.block_q_dq, self.block_kv_dq),
                              (self.block_q_bwd, self.block_kv_bwd))

    def text(self) -> str:
        return blocks_text(self.blocks)

    def explicit(self) -> "Tiling":
        """The same tiling with every backward and dq block spelled out."""
        (bq_dq, bk_dq), (bq, bk) = self.dq_blocks, self.backward_blocks
        return dataclasses.replace(self, block_q_bwd=bq, block_kv_bwd=bk, block_q_dq=bq_dq,
                                   block_kv_dq=bk_dq)


class AutoTiling(AbstractTiling):
    """The default `tiling` of `BlockSparseAttention`: per call, the tuned config from the
    autotune cache, else the kernel's heuristic (`AbstractKernel.default_tiling`).

    The policy ``EQX_BSATTN_AUTOTUNE`` (`docs/autotune.md`) decides whether the cache is read.
    It never tunes: `eqx_bsattn.autotune` does, before the trace, and writes the cache this
    reads. ``BlockSparseAttention(tiling=None)`` means this.
    """

    def choose(self, kernel, features, mask):
        if tiling_policy() != "heuristics":
            cached = lookup(kernel, features, mask)
            if cached is not None:
                return cached, "cache"
        return kernel.default_tiling(features, mask), "heuristic"
