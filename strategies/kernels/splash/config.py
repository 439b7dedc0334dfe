"""`SplashConfig`: what `SplashBlockSparse` tunes, the block sizes of Splash's three passes (as
Splash's own `BlockSizes` names them), its heuristic and how a config fits Splash's lanes."""

from typing import ClassVar

import equinox as eqx

from eqx_bsattn.contract import (AbstractKernelConfig, Features, PassBlocks, blocks_text,
                                  chained_blocks, check_fields)

LANES = 128  # Splash's key blocks (and query blocks with segment ids) are multiples of this
#: The heuristic's blocks on a TPU, and the largest head dim they were measured at there.
TPU_BLOCK = 512
MEASURED_HEAD_DIM = 128


def whole_lanes(block: int, length: int) -> int:
    """`block` rounded up to a multiple of 128, but no longer than `length` so rounded."""
    up = lambda n: -(-n // LANES) * LANES  # noqa: E731
    return min(up(block), up(length))


class SplashConfig(AbstractKernelConfig):
    """`SplashBlockSparse`'s config: the blocks of the forward, dq and dk/dv passes, named as
    in Splash's `BlockSizes` (its ``*_compute`` blocks equal the key blocks).

    The dk/dv blocks default to the forward ones, the dq blocks to the dk/dv ones. The kernel
    runs every block rounded up to a multiple of 128, no longer than its sequence so rounded
    (`SplashBlockSparse.adapt_tiling`).

    ```python
    tiling = kernels.SplashConfig(block_q=256, block_kv=128)
    ```
    """

    block_q: int = eqx.field(static=True)
    block_kv: int = eqx.field(static=True)
    block_q_dq: int | None = eqx.field(default=None, static=True)
    block_kv_dq: int | None = eqx.field(default=None, static=True)
    block_q_dkv: int | None = eqx.field(default=None, static=True)
    block_kv_dkv: int | None = eqx.field(default=None, static=True)

    forward_fields: ClassVar[tuple[str, ...]] = ("block_q", "block_kv")

    def __check_init__(self):
        check_fields(self)

    @property
    def blocks(self) -> PassBlocks:
        return chained_blocks(self.block_q, self.block_kv, (self.block_q_dq, self.block_kv_dq),
                              (self.block_q_dkv, self.block_kv_dkv))

    def explicit(self) -> "SplashConfig":
        return SplashConfig.of_blocks(self.blocks)

    def text(self) -> str:
        return blocks_text(self.blocks)

    @classmethod
    def of_blocks(cls, blocks: PassBlocks) -> "SplashConfig":
        """The config that runs these `PassBlocks` (another config's `blocks`)."""
        (bq, bk), (dq_q, dq_k), (kv_q, kv_k) = blocks
        return cls(block_q=bq, block_kv=bk, block_q_dq=dq_q, block_kv_dq=dq_k, block_q_dkv=kv_q,
                   block_kv_dkv=kv_k)

    @classmethod
    def heuristic(cls, features: Features) -> "SplashConfig":
        """On a TPU, 512 for every pass at head dims up to `MEASURED_HEAD_DIM`: measured on a
        TPU v5e, they ran 6 times faster than Splash's own default, 128 (docs/splash.md).
        Elsewhere, and at larger head dims (not yet measured on a TPU), 128 for every pass
        (`BlockSizes.get_default`); the interpreted runs off a TPU are for correctness, and
        small blocks let short test sequences span several of them."""
        if features.platform == "tpu" and features.head_dim <= MEASURED_HEAD_DIM:
            return cls(block_q=TPU_BLOCK, block_kv=TPU_BLOCK)
        return cls(block_q=128, block_kv=128)

    def in_lanes(self, features: Features) -> "SplashConfig":
        """Every block in whole lanes (`whole_lanes`), spelled out."""
        lq, lk = features.q_len, features.kv_len
        return SplashConfig.of_blocks(PassBlocks(
            *((whole_lanes(q, lq), whole_lanes(k, lk)) for q, k in self.blocks)))
