"""`PallasTpuBlockSparse`: block-sparse attention on TPU in Pallas (Mosaic TPU), with score
terms evaluated inside its kernels.

- `common`: the visit lists prefetched into scalar memory, and a tile's logits (score terms,
  soft cap, mask terms) on its coordinates;
- `forward`: the forward kernel (online softmax, log-sum-exp);
- `backward`: the dq and dk/dv kernels, and the score arrays' gradients;
- `function`: the arrays a score function closes over, as kernel inputs;
- `config`: `PallasTpuConfig`, the tiles of its passes;
- `kernel`: the kernel strategy itself.
"""

from .config import PallasTpuConfig as PallasTpuConfig
from .kernel import PallasTpuBlockSparse as PallasTpuBlockSparse
