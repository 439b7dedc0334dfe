"""`jax.vmap` over unbatched calls against one batched call, on a GPU.

    python benchmarks/vmap_gpu.py [--reps 20] [--shape B,H,L,D]

Causal and packed documents (segment ids per element), bfloat16, `TritonBlockSparse`, forward
and forward+backward; ms are medians of wall-clock time around a jitted call. With the Triton
launches folding the mapped axis into their batch, the two columns should agree; one launch
per element would not. Not a test: numbers depend on the machine.
"""

import argparse

import jax
import jax.numpy as jnp

import eqx_bsattn as bsa
from eqx_bsattn.bench import document_segment_ids, median_ms


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20, help="timed calls per measurement")
    p.add_argument("--shape", default="8,16,2048,128", help="B,H,L,D")
    a = p.parse_args()
    b, h, length, d = map(int, a.shape.split(","))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (b, h, length, d), jnp.bfloat16) for kk in keys)
    ids = jnp.stack([jnp.asarray(document_segment_ids(length, seed=i)) for i in range(b)])
    for name, mask, seg in (("causal", bsa.masks.Causal(), None),
                            ("document", bsa.masks.Causal() & bsa.masks.Document(), ids)):
        attn = bsa.BlockSparseAttention(mask=mask, kernel=bsa.kernels.TritonBlockSparse())

        def call(q, k, v, s):
            return attn(q, k, v) if s is None else attn(q, k, v, q_segment_ids=s,
                                                        kv_segment_ids=s)

        mapped = jax.vmap(call, in_axes=(0, 0, 0, None if seg is None else 0))
        row = []
        for f in (call, mapped):
            fwd = jax.jit(f)
            fb = jax.jit(lambda q, k, v, s, do, f=f: jax.vjp(lambda q, k, v: f(q, k, v, s),
                                                              q, k, v)[1](do))
            row.append((median_ms(fwd, (q, k, v, seg), a.reps, warmup=2),
                        median_ms(fb, (q, k, v, seg, do), a.reps, warmup=2)))
        (f1, b1), (f2, b2) = row
        print(f"{name:9} B={b} L={length}: batched fwd {f1:.3f} ms, fwd+bwd {b1:.3f} ms | "
              f"vmap over unbatched fwd {f2:.3f} ms, fwd+bwd {b2:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
