"""Time `TritonBlockSparse` against cuDNN on one GPU, in one run (tiling variants included).

    python notes/triton_timing.py [--length 16384] [--variants]

B=2, H=16, D=128, bfloat16 by default; causal and causal window 1024; forward and
forward+backward (one `jax.vjp` with a random cotangent). Median of timed repetitions after a
warm-up, with `block_until_ready`. Prints milliseconds and the ratio cuDNN time / ours (> 1:
ours is faster).
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import eqx_bsattn as bsa
from eqx_bsattn import masks
from eqx_bsattn.strategies.kernels import TritonBlockSparse
from eqx_bsattn.strategies.kernels import triton as TK


def _time(fn, *args, reps=20):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--variants", action="store_true", help="also time other tilings")
    a = p.parse_args()
    B, H, L, D = a.batch, a.heads, a.length, a.dim
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, H, L, D), jnp.bfloat16) for kk in ks)
    qt, kt, vt, dot_ = (x.transpose(0, 2, 1, 3) for x in (q, k, v, do))

    def cudnn(window):
        def f(q, k, v):
            return jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn",
                local_window_size=None if window is None else (window, 0))
        return f

    def ours(mask, tiling):
        attn = bsa.BlockSparseAttention(mask=mask, kernel=TritonBlockSparse(), tiling=tiling)
        return attn

    def fwd_bwd(f):
        def g(q, k, v, do):
            out, vjp = jax.vjp(f, q, k, v)
            return vjp(do)
        return jax.jit(g)

    base = TritonBlockSparse().default_tiling(
        bsa.Features(platform="gpu", dtype="bfloat16", head_dim=D, value_dim=D, q_len=L,
                     kv_len=L))
    tilings = {"default": base}
    if a.variants:
        T = bsa.Tiling
        tilings.update({
            "indexed (no ranges)": None,
            "f128x128w8s3 b64x128w8s3": T(128, 128, 64, 128, 8, 3, 8, 3),
            "f128x128w8s3 b128x128w8s2": T(128, 128, 128, 128, 8, 3, 8, 2),
        })
    rows = []
    for label, window in (("causal", None), (f"window{a.window}", a.window)):
        mask = masks.Causal() if window is None else masks.Causal() & masks.SlidingWindow(window, 0)
        c_f = _time(jax.jit(cudnn(window)), qt, kt, vt)
        c_fb = _time(fwd_bwd(cudnn(window)), qt, kt, vt, dot_)
        for name, tiling in tilings.items():
            TK._CONTIGUOUS_RANGES = tiling is not None
            tiling = base if tiling is None else tiling
            try:
                attn = ours(mask, tiling)
                o_f = _time(jax.jit(lambda q, k, v: attn(q, k, v)), q, k, v)
                o_fb = _time(fwd_bwd(lambda q, k, v: attn(q, k, v)), q, k, v, do)
            except Exception as e:  # a variant that does not compile (shared memory) is skipped
                print(f"{label} {name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            rows.append((label, name, o_f, c_f, o_fb, c_fb))
            print(f"{label:11s} {name:28s} fwd {o_f:7.2f} ms (cudnn {c_f:7.2f}, x{c_f / o_f:.2f})"
                  f"  fwd+bwd {o_fb:7.2f} ms (cudnn {c_fb:7.2f}, x{c_fb / o_fb:.2f})", flush=True)
    print("\nsummary (ratio = cudnn time / ours)")
    for label, name, o_f, c_f, o_fb, c_fb in rows:
        print(f"{label:11s} {name:28s} fwd x{c_f / o_f:.2f}  fwd+bwd x{c_fb / o_fb:.2f}")


if __name__ == "__main__":
    main()
