"""Packed documents on the GPU: the lists built by `_layout_kernel` (one launch) against
`build_layout`'s XLA path, alone and inside a whole `TritonBlockSparse` call.

    python notes/device_lists_timing.py [--reps 20]

Shapes: (B, H, L, D) = (2, 16, 16384, 128) and (8, 16, 2048, 128), bfloat16, 16 documents of
random length per sequence, `Causal() & Document()`. ms are medians of wall-clock time around a
jitted call; TF/s count visible pairs only (4 * D per pair forward, 3.5 times that
forward+backward).
"""

import argparse

import jax
import jax.numpy as jnp

import eqx_bsattn as bsa
from eqx_bsattn._layout import build_layout
from eqx_bsattn._patterns import pattern
from eqx_bsattn._timing import median_ms
from eqx_bsattn.bench import visible_pairs
from eqx_bsattn.strategies.kernels import triton as tr


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--shapes", default="2,16,16384,128;8,16,2048,128", help="B,H,L,D;...")
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    for b, h, length, d in (map(int, x.split(",")) for x in a.shapes.split(";")):
        mask, data = pattern("document", length)
        ids = jnp.broadcast_to(jnp.asarray(data["q_segment_ids"]), (b, length))
        pairs = visible_pairs(mask, length, length, data["q_segment_ids"])
        blocks = (64, 64)
        canonical = tr.canonical_mask(mask)
        fused = jax.jit(lambda s: tr._device_lists(
            canonical, q_len=length, kv_len=length, blocks=blocks, q_positions=None,
            kv_positions=None, q_segment_ids=s, kv_segment_ids=s))
        xla = jax.jit(lambda s: (lambda lay: (tr._layout_arrays(lay, False)[:4],
                                              tr._layout_arrays(lay, True)[:4]))(build_layout(
            mask, q_len=length, kv_len=length, num_heads=h, block_q=blocks[0],
            block_kv=blocks[1], q_segment_ids=s, kv_segment_ids=s)))
        f_lists, x_lists = fused(ids), xla(ids)
        same = all(bool(jnp.all(u == w)) for u, w in zip(
            (f_lists[0][0], f_lists[0][2], f_lists[1][0], f_lists[1][2]),
            (x_lists[0][0], x_lists[0][2], x_lists[1][0], x_lists[1][2])))
        ms_f = median_ms(fused, (ids,), a.reps, warmup=2)
        ms_x = median_ms(xla, (ids,), a.reps, warmup=2)
        print(f"B={b} L={length}: lists at 64x64, fused {ms_f * 1e3:7.1f} us, XLA "
              f"{ms_x * 1e3:7.1f} us, same counts {same}", flush=True)
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.random.normal(kk, (b, h, length, d), a.dtype) for kk in keys)
        attn = bsa.BlockSparseAttention(mask=mask, kernel=bsa.kernels.TritonBlockSparse())
        flops = 4.0 * b * h * d * pairs
        for on in (True, False):
            tr._FUSED_DEVICE_LISTS = on
            f = jax.jit(lambda q, k, v, s: attn(q, k, v, q_segment_ids=s, kv_segment_ids=s))
            fb = jax.jit(lambda q, k, v, s, do: jax.vjp(
                lambda q, k, v: attn(q, k, v, q_segment_ids=s, kv_segment_ids=s),
                q, k, v)[1](do))
            ms1 = median_ms(f, (q, k, v, ids), a.reps, warmup=2)
            ms2 = median_ms(fb, (q, k, v, ids, do), a.reps, warmup=2)
            print(f"  call, {'fused' if on else 'XLA  '} lists: fwd {ms1:7.3f} ms "
                  f"{flops / ms1 / 1e9:6.1f} TF/s, fwd+bwd {ms2:7.3f} ms "
                  f"{3.5 * flops / ms2 / 1e9:6.1f} TF/s", flush=True)
        tr._FUSED_DEVICE_LISTS = True


if __name__ == "__main__":
    main()
