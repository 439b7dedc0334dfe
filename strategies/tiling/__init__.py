"""Tiling: block sizes and launch parameters. Each kernel holds its own heuristic
(`AbstractKernel.default_tiling`); `eqx_bsattn.autotune` times candidates on real inputs."""

from eqx_bsattn.contract import Tiling as Tiling
