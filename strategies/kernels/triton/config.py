"""`TritonConfig`: what `TritonBlockSparse` tunes (the blocks, warps and stages of its three
launches) and the checks a config must pass to launch. Its heuristic and autotune candidates
are in `heuristics`."""

import dataclasses
from typing import ClassVar

import equinox as eqx

from eqx_bsattn.contract import (AbstractKernelConfig, PassBlocks, Tiling, chained_blocks,
                                  check_fields)

_BLOCKS = ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd", "block_q_dq", "block_kv_dq")
_LAUNCHES = ("num_warps", "num_stages", "num_warps_bwd", "num_stages_bwd", "num_warps_dq",
             "num_stages_dq")


def _field(**kwargs):
    return eqx.field(static=True, **kwargs)


class TritonConfig(AbstractKernelConfig):
    """`TritonBlockSparse`'s config: blocks, warps and stages of the forward, dq and dk/dv
    launches.

    The ``_bwd`` fields tile the dk/dv launch (over kv-blocks) and default to the forward
    ones; the ``_dq`` fields tile the dq launch (over q-blocks) and default to the ``_bwd``
    ones. Warps default to 4 and stages to 2 where no field sets them. Every block must be a
    power of two of at least 16 (Triton's smallest dot); a config that breaks it raises a
    `ValueError` when built.

    **Arguments:**

    - `block_q`, `block_kv`, `num_warps`, `num_stages`: the forward launch.
    - `block_q_bwd`, `block_kv_bwd`, `num_warps_bwd`, `num_stages_bwd`: the dk/dv launch.
    - `block_q_dq`, `block_kv_dq`, `num_warps_dq`, `num_stages_dq`: the dq launch.

    ```python
    config = kernels.TritonConfig(block_q=128, block_kv=64, num_warps=8, num_stages=3)
    attn = BlockSparseAttention(mask=mask, kernel=kernels.TritonBlockSparse(), tiling=config)
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
        for name in _BLOCKS:
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(
                    f"TritonBlockSparse needs TritonConfig.{name} to be a power of two >= 16; "
                    f"got {value}.")

    @property
    def backward_blocks(self) -> tuple[int, int]:
        """``(block_q, block_kv)`` of the dk/dv launch."""
        return self.blocks.dkv

    @property
    def dq_blocks(self) -> tuple[int, int]:
        """``(block_q, block_kv)`` of the dq launch."""
        return self.blocks.dq

    @property
    def blocks(self) -> PassBlocks:
        return chained_blocks(self.block_q, self.block_kv, (self.block_q_dq, self.block_kv_dq),
                              (self.block_q_bwd, self.block_kv_bwd))

    def explicit(self) -> "TritonConfig":
        """The same config with every ``_bwd`` and ``_dq`` field spelled out (taken from the
        field it defaults to); launch parameters no field sets stay ``None``."""
        (bq, bk), (dq_q, dq_k) = self.backward_blocks, self.dq_blocks
        warps_bwd = self.num_warps_bwd or self.num_warps
        stages_bwd = self.num_stages_bwd or self.num_stages
        return dataclasses.replace(
            self, block_q_bwd=bq, block_kv_bwd=bk, num_warps_bwd=warps_bwd,
            num_stages_bwd=stages_bwd, block_q_dq=dq_q, block_kv_dq=dq_k,
            num_warps_dq=self.num_warps_dq or warps_bwd,
            num_stages_dq=self.num_stages_dq or stages_bwd)

    def text(self) -> str:
        """``"fwd 128x128 w8 s3 | dq 128x64 w8 s3 | dk/dv 64x128 w8 s3"`` (launch parameters
        where set)."""
        t = self.explicit()

        def launch(name, blocks, warps, stages):
            extra = "".join(f" {p}{x}" for p, x in (("w", warps), ("s", stages)) if x is not None)
            return f"{name} {blocks[0]}x{blocks[1]}{extra}"

        return " | ".join((
            launch("fwd", (t.block_q, t.block_kv), t.num_warps, t.num_stages),
            launch("dq", t.dq_blocks, t.num_warps_dq, t.num_stages_dq),
            launch("dk/dv", t.backward_blocks, t.num_warps_bwd, t.num_stages_bwd),
        ))

    @classmethod
    def from_config(cls, config: AbstractKernelConfig) -> "TritonConfig":
        """`config` as a `TritonConfig`: itself; a `Tiling`'s fields (its deprecated launch
        fields included, for one release); another kernel's config's blocks."""
        if isinstance(config, cls):
            return config
        if isinstance(config, Tiling):
            return cls(**{name: getattr(config, name) for name in _BLOCKS + _LAUNCHES})
        (bq, bk), (dq_q, dq_k), (kv_q, kv_k) = config.blocks
        return cls(block_q=bq, block_kv=bk, block_q_bwd=kv_q, block_kv_bwd=kv_k,
                   block_q_dq=dq_q, block_kv_dq=dq_k)
