"""`PallasTpuConfig`: the tiles of `PallasTpuBlockSparse`'s forward pass and of its two
backward passes, its heuristic, and how any config fits a TPU's 128 lanes."""

from typing import ClassVar

import equinox as eqx

from eqx_bsattn.contract import (AbstractKernelConfig, Features, PassBlocks, blocks_text,
                                  chained_blocks, check_fields)

#: A TPU vector register is 8 sublanes by 128 lanes: key tiles (and, in the dk/dv pass, query
#: tiles) sit on the lanes.
LANES = 128
SUBLANES = 8
#: The heuristic's tiles on a TPU (Splash's measured best on a v5e at D <= 128).
TPU_BLOCK = 512


def _lanes(block: int, length: int) -> int:
    """`block` rounded up to whole lanes, no longer than `length` so rounded."""
    up = lambda n: -(-n // LANES) * LANES  # noqa: E731
    return min(up(block), up(length))


class PallasTpuConfig(AbstractKernelConfig):
    """`PallasTpuBlockSparse`'s config: the forward tiles and the backward tiles (the dq and
    the dk/dv pass share them; they default to the forward ones).

    On a TPU every tile is rounded up to a multiple of 128 (no longer than its sequence so
    rounded): keys sit on the lanes in the forward and dq passes, queries in the dk/dv pass.
    Interpreted off a TPU, tiles run as given.

    ```python
    tiling = kernels.PallasTpuConfig(block_q=512, block_kv=512, block_q_bwd=256)
    ```
    """

    block_q: int = eqx.field(static=True)
    block_kv: int = eqx.field(static=True)
    block_q_bwd: int | None = eqx.field(default=None, static=True)
    block_kv_bwd: int | None = eqx.field(default=None, static=True)

    forward_fields: ClassVar[tuple[str, ...]] = ("block_q", "block_kv")

    def __check_init__(self):
        check_fields(self)

    @property
    def blocks(self) -> PassBlocks:
        bwd = (self.block_q_bwd, self.block_kv_bwd)
        return chained_blocks(self.block_q, self.block_kv, bwd, bwd)

    def explicit(self) -> "PallasTpuConfig":
        (bq, bk), _, (bq_b, bk_b) = self.blocks
        return PallasTpuConfig(bq, bk, bq_b, bk_b)

    def text(self) -> str:
        return blocks_text(self.blocks)

    @classmethod
    def heuristic(cls, features: Features) -> "PallasTpuConfig":
        """512 x 512 in every pass on a TPU; 128 x 128 elsewhere (interpreted: correctness
        runs, where small tiles let short sequences span several)."""
        block = TPU_BLOCK if features.platform == "tpu" else LANES
        return cls(block_q=block, block_kv=block)

    @classmethod
    def of_blocks(cls, blocks: PassBlocks, features: Features) -> "PallasTpuConfig":
        """The config that runs another config's forward and dk/dv blocks (its dq blocks are
        the dk/dv ones here), in whole lanes on a TPU."""
        (bq, bk), _, (bq_b, bk_b) = blocks
        if features.platform == "tpu":
            lq, lk = features.q_len, features.kv_len
            bq, bk, bq_b, bk_b = (_lanes(bq, lq), _lanes(bk, lk), _lanes(bq_b, lq),
                                  _lanes(bk_b, lk))
        return cls(bq, bk, bq_b, bk_b)
