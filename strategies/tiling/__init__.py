"""Tiling: block sizes and launch parameters; heuristics per platform."""

from eqx_bsattn._tiling import Tiling as Tiling
