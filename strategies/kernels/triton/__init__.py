"""`TritonBlockSparse`: block-sparse flash attention in Triton, launched through jax-triton.

- `config`: `TritonConfig`, what it tunes, and the checks a config must pass;
- `heuristics`: the heuristic config, the autotune candidates, the shared memory estimate;
- `launch`: each launch's static configuration and arrays, and their vmap rule;
- `vjp`: the three launches under one `jax.custom_vjp`;
- `jit_kernels`: the `@triton.jit` kernels (imported only when a launch is traced);
- `kernel`: the kernel strategy itself.

Triton and jax-triton are imported lazily, so this package imports on machines that have
neither; the kernel then declines with a reason the selector shows.
"""

from .config import TritonConfig as TritonConfig
from .kernel import TritonBlockSparse as TritonBlockSparse
