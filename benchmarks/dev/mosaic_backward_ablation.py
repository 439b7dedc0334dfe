"""Where the single-pass Mosaic backward's time goes, by ablation: forward+backward TF/s of
`MosaicBlockSparse(deterministic=False)` as it is, then with parts of its dq path left out
(their results are wrong: timing only), next to the default deterministic two-kernel backward
and cuDNN, in one process.

- ``no reduce-add``: each block's dq partial is computed and staged, but not added to dq.
- ``no dq product``: neither the fifth product nor its stage and reduce-add (dS still goes
  to shared memory and the warpgroups still meet at its barrier).

```
python benchmarks/dev/mosaic_backward_ablation.py --lengths 16384 --patterns causal window
```
"""

import contextlib
import os
import sys

import jax.numpy as jnp

from eqx_bsattn.strategies.kernels.mosaic import common

# mosaic_forward.py, the benchmark this ablates, is one folder up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mosaic_forward import shape_arguments, speed  # noqa: E402


@contextlib.contextmanager
def patched(name, replacement):
    original = getattr(common.Ops, name)
    setattr(common.Ops, name, replacement)
    try:
        yield
    finally:
        setattr(common.Ops, name, original)


def _no_add(self, smem, gmem):
    return None


def _zeros(self, shape, pairs):
    return self.cast(jnp.zeros(shape, jnp.float32), self.wgmma_layout)


def main():
    p = shape_arguments(__doc__.split("\n\n")[0], reps=10)
    p.add_argument("--patterns", nargs="+", default=["causal"])
    args = p.parse_args()
    common_args = dict(lengths=args.lengths, batch=args.batch, heads=args.heads, dim=args.dim,
                       reps=args.reps, backward=True, patterns=args.patterns)
    table = []
    table += [("as is", r) for r in speed(**common_args, only=["mosaic", "mosaic-single-pass",
                                                                  "cudnn"])]
    with patched("add_to_gmem", _no_add):
        table += [("no reduce-add", r) for r in speed(**common_args, only=["mosaic-single-pass"])]
    with patched("add_to_gmem", _no_add), patched("sum_of_products_transposed_a", _zeros):
        table += [("no dq product", r) for r in speed(**common_args, only=["mosaic-single-pass"])]
    print("\n| variant | pattern | L | impl | fwd+bwd TF/s |")
    print("| --- | --- | --- | --- | --- |")
    for variant, r in table:
        print(f"| {variant} | {r['pattern']} | {r['L']} | {r['impl']} | "
              f"{r.get('fwdbwd', float('nan')):.1f} |")


if __name__ == "__main__":
    main()
