"""The built-in strategies: masks, kernels, tilings and shardings.

Importing this package registers the built-in kernels with the selector.
"""

from . import kernels as kernels, masks as masks, sharding as sharding, tiling as tiling
from . import scores as scores
