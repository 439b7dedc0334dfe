"""Tiling: block sizes and launch parameters (heuristics live with each kernel), and `autotune`."""

from eqx_bsattn._tiling import Tiling as Tiling

from .autotune import DEFAULT_BLOCKS as DEFAULT_BLOCKS, autotune as autotune
