"""Time `TritonBlockSparse` tilings on the short-row patterns (document, BigBird), in one run.

    python notes/short_rows_timing.py [--length 16384] [--only fwd,bwd,causal,layout]

B=2, H=16, D=128, bfloat16; the benchmark's patterns (`eqx_bsattn._patterns`). Prints
effective TFLOP/s (visible pairs only, as `eqx_bsattn.bench`) forward and forward+backward per
tiling, and the device cost of building the document layout alone. f128x128w8s3 with
b64x128w8s2 equals the default tiling, so since the short-row re-tiling a static BigBird layout
at that tiling runs 64x64 (see `TritonBlockSparse`); the table in notes/TRITON.md predates it.
"""

import argparse

import jax
import jax.numpy as jnp

import eqx_bsattn as bsa
from eqx_bsattn import Tiling
from eqx_bsattn._layout import build_layout
from eqx_bsattn._patterns import pattern
from eqx_bsattn._timing import median_ms
from eqx_bsattn.bench import visible_pairs
from eqx_bsattn.strategies.kernels import TritonBlockSparse

FWD = {  # (block_q, block_kv, warps, stages)
    "f128x128w8s3": (128, 128, 8, 3),
    "f64x64w4s2": (64, 64, 4, 2),  # 82 KiB, 168-177 registers: two programs per SM
    "f64x128w4s2": (64, 128, 4, 2),
}
BWD = {
    "b64x128w8s2": (64, 128, 8, 2),
    "b64x64w4s2": (64, 64, 4, 2),  # dq 98 KiB, dk/dv 99 KiB: two programs per SM
}
# Forward tilings timed forward-only; backward tilings timed forward+backward (forward at
# f128x128w8s3).
FWD_RUNS = ["f128x128w8s3", "f64x64w4s2", "f64x128w4s2"]
BWD_RUNS = ["b64x128w8s2", "b64x64w4s2"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--only", default="layout,fwd,bwd,causal")
    a = p.parse_args()
    parts = a.only.split(",")
    B, H, L, D = 2, 16, a.length, 128
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, H, L, D), jnp.bfloat16) for kk in ks)

    def tiling(f, b):
        return Tiling(block_q=f[0], block_kv=f[1], num_warps=f[2], num_stages=f[3],
                      block_q_bwd=b[0], block_kv_bwd=b[1], num_warps_bwd=b[2], num_stages_bwd=b[3])

    def run(name, f, b, fwd_only):
        mask, data = pattern(name, L)
        data = {n: jnp.asarray(x) for n, x in data.items()}
        pairs = visible_pairs(mask, L, L, data.get("q_segment_ids"))
        flops = 4.0 * B * H * D * pairs
        attn = bsa.BlockSparseAttention(mask=mask, kernel=TritonBlockSparse(),
                                        tiling=tiling(FWD[f], BWD[b]))

        def fn(q, k, v, data):
            return attn(q, k, v, **data)

        def fb(q, k, v, do, data):
            out, pull = jax.vjp(lambda q, k, v: fn(q, k, v, data), q, k, v)
            return pull(do)

        row = f"{name:>9} {f:>13} {b:>12}"
        try:
            ms = median_ms(jax.jit(fn), (q, k, v, data), a.reps, warmup=2)
            row += f"  fwd {ms:7.3f} ms {flops / ms / 1e9:6.1f} TF/s"
            if not fwd_only:
                ms = median_ms(jax.jit(fb), (q, k, v, do, data), a.reps, warmup=2)
                row += f"  fwd+bwd {ms:7.3f} ms {3.5 * flops / ms / 1e9:6.1f} TF/s"
        except Exception as e:  # noqa: BLE001
            row += f"  ERROR {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(row, flush=True)

    if "layout" in parts:
        mask, data = pattern("document", L)
        ids = jnp.broadcast_to(jnp.asarray(data["q_segment_ids"]), (B, L))
        for bq, bk in ((128, 128), (64, 128)):
            f = jax.jit(lambda s, bq=bq, bk=bk: build_layout(
                mask, q_len=L, kv_len=L, num_heads=H, block_q=bq, block_kv=bk,
                q_segment_ids=s, kv_segment_ids=s))
            ms = median_ms(f, (ids,), a.reps, warmup=2)
            print(f"document layout {bq}x{bk} (all lists): {ms * 1e3:7.1f} us", flush=True)
            g = jax.jit(lambda s, bq=bq, bk=bk: (lambda lay: (lay.full_count, lay.full_index,
                        lay.partial_count, lay.partial_index))(build_layout(
                            mask, q_len=L, kv_len=L, num_heads=H, block_q=bq, block_kv=bk,
                            q_segment_ids=s, kv_segment_ids=s)))
            ms = median_ms(g, (ids,), a.reps, warmup=2)
            print(f"document layout {bq}x{bk} (forward lists): {ms * 1e3:7.1f} us", flush=True)
    if "fwd" in parts:
        for name in ("document", "bigbird"):
            for f in FWD_RUNS:
                run(name, f, "b64x128w8s2", fwd_only=True)
    if "bwd" in parts:
        for name in ("document", "bigbird"):
            for b in BWD_RUNS:
                run(name, "f128x128w8s3", b, fwd_only=False)
    if "causal" in parts:
        for name in ("causal", "window"):
            run(name, "f128x128w8s3", "b64x128w8s2", fwd_only=False)


if __name__ == "__main__":
    main()
