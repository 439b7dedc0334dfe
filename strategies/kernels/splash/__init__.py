"""`SplashBlockSparse`: block-sparse attention on TPU through JAX's Splash attention.

- `mask_info`: Splash's block-info arrays filled from our layouts, and the in-kernel predicate
  of the canonical mask terms;
- `launch`: the check that this JAX's Splash has the interface used, and the call;
- `config`: `SplashConfig`, the block sizes of its passes;
- `kernel`: the kernel strategy itself.

Splash is imported lazily, so this package imports on a JAX without it; the kernel then
declines with a reason the selector shows.
"""

from .config import SplashConfig as SplashConfig
from .kernel import SplashBlockSparse as SplashBlockSparse
