"""`MosaicConfig`: the tiles `MosaicBlockSparse` runs, fixed by its warpgroups and the head dim
(`MosaicConfig.for_head_dim`, its heuristic and only candidate)."""

import dataclasses
from typing import ClassVar

import equinox as eqx

from eqx_bsattn.contract import AbstractKernelConfig, PassBlocks, blocks_text

from .backward import backward_blocks
from .forward import BLOCK_Q, block_kv_for, stages_for


class MosaicConfig(AbstractKernelConfig):
    """`MosaicBlockSparse`'s config: the tiles of each pass and the forward's K/V ring depth.

    They are fixed by the kernel's warpgroups and the head dim, so there is one config per
    head dim (`for_head_dim`): forward 128 query rows by `block_kv_for` keys (128 up to
    D = 128, 64 at 256); dk/dv 64 query rows by 128 keys (32 at D = 256); the dq pass 128
    rows by 64 keys (128 at D = 64, 32 at 256); `stages` K/V buffers that fit the shared
    memory next to the Q tiles. A module may hold it as its tiling; another config differs
    from it.

    ```python
    kernels.MosaicConfig.for_head_dim(128)
    # MosaicConfig(block_q=128, block_kv=128, block_q_dq=128, block_kv_dq=64, block_q_dkv=64,
    #              block_kv_dkv=128, stages=2)
    ```
    """

    block_q: int = eqx.field(static=True)
    block_kv: int = eqx.field(static=True)
    block_q_dq: int = eqx.field(static=True)
    block_kv_dq: int = eqx.field(static=True)
    block_q_dkv: int = eqx.field(static=True)
    block_kv_dkv: int = eqx.field(static=True)
    stages: int = eqx.field(static=True)

    forward_fields: ClassVar[tuple[str, ...]] = ("block_q", "block_kv", "stages")

    def __check_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"`MosaicConfig.{f.name}` must be a positive int; got "
                                 f"{value!r}.")

    @property
    def blocks(self) -> PassBlocks:
        return PassBlocks((self.block_q, self.block_kv), (self.block_q_dq, self.block_kv_dq),
                          (self.block_q_dkv, self.block_kv_dkv))

    def explicit(self) -> "MosaicConfig":
        return self  # every field is set

    def text(self) -> str:
        return f"{blocks_text(self.blocks)} | s{self.stages}"

    @classmethod
    def for_head_dim(cls, head_dim: int) -> "MosaicConfig":
        """The config the kernel runs at `head_dim` (at most 256: above, no tiles leave room
        for two K/V stages in shared memory)."""
        if head_dim > 256:
            raise ValueError(f"MosaicConfig.for_head_dim: head dim {head_dim} is over 256, the "
                             "largest whose tiles fit the kernel's shared memory.")
        (bq_dq, bk_dq), (bq_dkv, bk_dkv) = backward_blocks(head_dim)
        block_kv = block_kv_for(head_dim)
        return cls(block_q=BLOCK_Q, block_kv=block_kv, block_q_dq=bq_dq, block_kv_dq=bk_dq,
                   block_q_dkv=bq_dkv, block_kv_dkv=bk_dkv,
                   stages=stages_for(head_dim, block_kv))
