"""`MosaicBlockSparse`: block-sparse flash attention for Hopper GPUs in Pallas Mosaic GPU.

- `forward`: the warp-specialised forward kernel (a TMA memory warpgroup, two compute
  warpgroups) over the compiled forward layout;
- `backward`: the warp-specialised dq and dk/dv kernels over the compiled dq and transposed
  dk/dv layouts;
- `common`: the predicate, list walk, TMA ring loop and interpreter stand-ins they share;
- `config`: `MosaicConfig`, its tiles (fixed per head dim);
- `kernel`: the kernel strategy; its backward pass is `backward`'s kernels (the dq and dk/dv
  pair, or the single pass), reading the forward's base-2 log-sum-exp.

ALiBi (`scores.ALiBi`) runs inside all of them (`common.AlibiBlocks`); other score terms and
bias are declined.

Mosaic GPU is imported when a launch is traced, so this package imports anywhere; the kernel
declines with a reason where it cannot run.
"""

from .config import MosaicConfig as MosaicConfig
from .kernel import MosaicBlockSparse as MosaicBlockSparse
