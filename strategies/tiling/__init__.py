"""Tilings: the strategy the plan asks for the config of the kernel that runs. `AutoTiling` (the
default) reads the autotune cache, else the kernel's heuristic (`AbstractKernel.default_tiling`);
`Tiling` is the kernel-independent config (block sizes); each kernel's own config lives with the
kernel (`eqx_bsattn.kernels.TritonConfig`, `XlaConfig`, `SplashConfig`, `MosaicConfig`).
`eqx_bsattn.autotune` times candidates on real inputs and writes the cache."""

from eqx_bsattn.contract import (
    AbstractKernelConfig as AbstractKernelConfig,
    AbstractTiling as AbstractTiling,
    AutoTiling as AutoTiling,
    PassBlocks as PassBlocks,
    Tiling as Tiling,
)
