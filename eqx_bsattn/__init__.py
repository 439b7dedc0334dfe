"""eqx_bsattn: block-sparse attention for JAX, as an Equinox module built from strategies.

```python
import eqx_bsattn as bsa
attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal() & bsa.masks.SlidingWindow(1024))
out = attn(q, k, v)
```
"""

from . import contract as contract
from ._api import blocksparse_attention as blocksparse_attention
from ._autotune import (
    AutotuneReport as AutotuneReport,
    TilingTrial as TilingTrial,
    autotune as autotune,
)
from ._compile import CompiledMask as CompiledMask, ResolvedMask as ResolvedMask
from ._compile_cache import enable_compilation_cache as enable_compilation_cache
from ._inputs import AttentionInputs as AttentionInputs, MaskInfo as MaskInfo
from ._kernel import (
    AbstractBroadcastBiasKernel as AbstractBroadcastBiasKernel,
    AbstractKernel as AbstractKernel,
    AbstractLseKernel as AbstractLseKernel,
    Features as Features,
    registered_kernels as registered_kernels,
)
from ._layer import MultiheadBlockSparseAttention as MultiheadBlockSparseAttention
from ._layout import BlockLayout as BlockLayout, build_layout as build_layout
from ._mask import (
    AbstractBlockMask as AbstractBlockMask,
    AbstractMask as AbstractMask,
    MaskTerms as MaskTerms,
)
from ._plot import plot_layout as plot_layout, plot_score as plot_score
from ._module import BlockSparseAttention as BlockSparseAttention, CallPlan as CallPlan
from ._selector import (
    KernelChoice as KernelChoice,
    NoKernelError as NoKernelError,
    default_platform as default_platform,
    select_kernel as select_kernel,
)
from ._sharding import AbstractSharding as AbstractSharding, Unsharded as Unsharded
from ._strategy import AbstractStrategy as AbstractStrategy, is_abstract as is_abstract
from ._swap import (
    AutoKernel as AutoKernel,
    AutoTiling as AutoTiling,
    swap_strategy as swap_strategy,
)
from ._tiling import (
    AbstractKernelConfig as AbstractKernelConfig,
    AbstractTiling as AbstractTiling,
    PassBlocks as PassBlocks,
    Tiling as Tiling,
)
from ._typing import TYPECHECK_ENABLED as TYPECHECK_ENABLED

# Importing the strategies registers the built-in kernels with the selector.
from . import strategies as strategies  # noqa: E402  isort: skip
from .strategies import kernels as kernels, masks as masks  # noqa: E402  isort: skip
from .strategies import sharding as sharding, tiling as tiling  # noqa: E402  isort: skip
from .strategies import scores as scores  # noqa: E402  isort: skip

from ._version import __version__ as __version__  # noqa: E402  isort: skip
