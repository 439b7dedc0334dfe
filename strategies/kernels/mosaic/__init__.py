"""`MosaicBlockSparse`: block-sparse flash attention for Hopper GPUs in Pallas Mosaic GPU.

- `forward`: the warp-specialised forward kernel (a TMA memory warpgroup, two compute
  warpgroups) over the compiled forward layout;
- `kernel`: the kernel strategy; its backward pass is `TritonBlockSparse`'s dq and dk/dv
  launches, which read the same base-2 log-sum-exp.

Mosaic GPU is imported when a launch is traced, so this package imports anywhere; the kernel
declines with a reason where it cannot run.
"""

from .kernel import MosaicBlockSparse as MosaicBlockSparse
