"""Time each `TritonBlockSparse` launch alone (forward, dq, dk/dv) at several tilings.

    python notes/launch_sweep.py [--only fwd,dq,dkdv,d64,layout,e2e] [--out FILE]
    SWEEP_BHLD=2,16,16384,64 python notes/launch_sweep.py --only d64

Layouts are built once outside the timed call and passed in, so each figure is one kernel
launch (plus dispatch). Patterns are the benchmark's (causal, document, BigBird). Every variant
is compared with the result at 128x128 (forward) or 64x128 (dq, dk/dv): max abs error / max
abs value. TF/s count visible pairs only: 4 * D per pair forward, 6 * D for dq, 8 * D for
dk/dv. ``contig`` says whether the full lists were walked as ranges or by index. The tables in
notes/TRITON.md come from this script (before its last edit it also timed the previous
kernels' file, kept aside for the run, as the "before" rows).
"""

import argparse
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

import eqx_bsattn as bsa
from eqx_bsattn._layout import build_layout
from eqx_bsattn._patterns import pattern
from eqx_bsattn._timing import median_ms
from eqx_bsattn.bench import nn_attention, visible_pairs
from eqx_bsattn.strategies.kernels import triton as tr

B, H, L, D = (int(x) for x in os.environ.get("SWEEP_BHLD", "2,16,16384,128").split(","))


def log(*a):
    print(*a, flush=True)


def layout_of(mask, data, bq, bk):
    kw = {n: jnp.broadcast_to(jnp.asarray(x), (B, L)) for n, x in data.items()}
    canonical = tr.canonical_mask(mask, ((bq, bk),))
    if kw:
        lay = jax.jit(lambda **kw: build_layout(mask, q_len=L, kv_len=L, num_heads=H, block_q=bq,
                                                block_kv=bk, **kw))(**kw)
    else:
        with jax.ensure_compile_time_eval():
            lay = build_layout(mask, q_len=L, kv_len=L, num_heads=H, block_q=bq, block_kv=bk,
                               with_bitmaps=canonical is None)
    lay = jax.device_get(lay)
    rng = (tr._ranges(lay.full_count, lay.full_index),
           tr._ranges(lay.t_full_count, lay.t_full_index))
    lists = jax.device_put(tr._layout_arrays(lay, False))
    t_lists = jax.device_put(tr._layout_arrays(lay, True))
    visits = np.asarray(lay.full_count) + np.asarray(lay.partial_count)
    return canonical, lists, t_lists, rng, float(visits.mean())


def cfg_of(canonical, data, fwd=(128, 128), dq=(64, 128), dkdv=(64, 128), fl=(8, 3), dl=(8, 2),
           kl=(8, 2), contig=(True, True, True)):
    return tr._Config(
        batch=B, heads=H, kv_heads=H, q_len=L, kv_len=L, head_dim=D, value_dim=D,
        dtype=os.environ.get("SWEEP_DTYPE", "bfloat16"), bias_shape=None, num_sinks=0, softmax_scale=1 / math.sqrt(D),
        soft_cap=0.0, canonical=canonical, has_q_positions=False, has_kv_positions=False,
        fwd_blocks=fwd, dq_blocks=dq, dkdv_blocks=dkdv, fwd_launch=fl, dq_launch=dl,
        dkdv_launch=kl, list_modes=tuple("range" if c else "index" for c in contig))


#: Variants per --only part: (launch, pattern, (block_q, block_kv, warps, stages), walk).
#: walk: None = as the layout allows, True = as a range (skipped if the lists are not ranges),
#: False = by index.
SWEEPS = {
    "d64": [
        ("fwd", "causal", (128, 128, 4, 3), None),
        ("fwd", "causal", (128, 128, 8, 3), None),
        ("fwd", "causal", (128, 64, 4, 3), None),
        ("fwd", "causal", (128, 64, 8, 3), None),
        ("dq", "causal", (64, 128, 4, 2), None),
        ("dq", "causal", (64, 128, 4, 3), None),
        ("dq", "causal", (128, 64, 4, 3), None),
        ("dq", "causal", (128, 64, 8, 3), None),
        ("dq", "causal", (128, 128, 8, 3), None),
        ("dq", "causal", (128, 32, 4, 3), None),
        ("dkdv", "causal", (64, 128, 4, 2), None),
        ("dkdv", "causal", (64, 128, 4, 3), None),
        ("dkdv", "causal", (64, 128, 8, 3), None),
        ("dkdv", "causal", (128, 128, 8, 3), None),
        ("dkdv", "causal", (32, 128, 4, 3), None),
        ("fwd", "document", (64, 64, 4, 2), False),
        ("fwd", "document", (64, 64, 4, 3), False),
        ("fwd", "document", (128, 64, 4, 3), False),
        ("dq", "document", (64, 64, 4, 2), False),
        ("dq", "document", (64, 64, 4, 3), False),
        ("dq", "document", (128, 64, 4, 3), False),
        ("dkdv", "document", (64, 64, 4, 2), False),
        ("dkdv", "document", (64, 64, 4, 3), False),
        ("dkdv", "document", (64, 128, 4, 3), False),
    ],
    "fwd": [
        ("fwd", "causal", (128, 128, 8, 3), None),
        ("fwd", "causal", (128, 128, 8, 3), False),
        ("fwd", "document", (128, 128, 8, 3), False),
        ("fwd", "document", (128, 128, 8, 3), True),
        ("fwd", "document", (128, 128, 8, 2), False),
        ("fwd", "document", (128, 64, 8, 3), False),
        ("fwd", "document", (64, 64, 4, 3), False),
        ("fwd", "document", (64, 64, 4, 2), False),
        ("fwd", "document", (64, 64, 4, 3), True),
        ("fwd", "bigbird", (64, 64, 4, 2), None),
        ("fwd", "bigbird", (64, 64, 4, 3), None),
        ("fwd", "bigbird", (128, 128, 8, 3), None),
        ("fwd", "bigbird", (128, 64, 8, 3), None),
    ],
    "dq": [
        ("dq", "causal", (64, 128, 8, 2), None),
        ("dq", "causal", (64, 128, 8, 3), None),
        ("dq", "causal", (128, 64, 8, 3), None),
        ("dq", "causal", (128, 64, 8, 2), None),
        ("dq", "causal", (128, 32, 8, 3), None),
        ("dq", "causal", (64, 64, 4, 3), None),
        ("dq", "document", (64, 64, 4, 2), False),
        ("dq", "document", (64, 64, 4, 3), False),
        ("dq", "document", (64, 128, 8, 3), False),
        ("dq", "document", (128, 64, 8, 3), False),
        ("dq", "document", (128, 64, 8, 3), True),
        ("dq", "bigbird", (64, 64, 4, 2), None),
        ("dq", "bigbird", (64, 64, 4, 3), None),
        ("dq", "bigbird", (128, 64, 8, 3), None),
    ],
    "dkdv": [
        ("dkdv", "causal", (64, 128, 8, 2), None),
        ("dkdv", "causal", (64, 128, 8, 3), None),
        ("dkdv", "causal", (64, 128, 8, 4), None),
        ("dkdv", "causal", (32, 128, 8, 3), None),
        ("dkdv", "causal", (64, 64, 4, 3), None),
        ("dkdv", "document", (64, 64, 4, 2), False),
        ("dkdv", "document", (64, 64, 4, 3), False),
        ("dkdv", "document", (64, 128, 8, 3), False),
        ("dkdv", "document", (64, 128, 8, 3), True),
        ("dkdv", "document", (32, 128, 8, 3), False),
        ("dkdv", "bigbird", (64, 64, 4, 2), None),
        ("dkdv", "bigbird", (64, 64, 4, 3), None),
        ("dkdv", "bigbird", (64, 128, 8, 3), None),
    ],
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="fwd,dq,dkdv,layout,e2e")
    p.add_argument("--out", default=None)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    parts = a.only.split(",")
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, H, L, D), jnp.dtype(os.environ.get("SWEEP_DTYPE", "bfloat16"))) for kk in keys)
    bias = jnp.zeros((1,), jnp.float32)
    sinks = jnp.zeros((1, 1), jnp.float32)
    results = []
    pats = {}
    for name in ("causal", "document", "bigbird"):
        mask, data = pattern(name, L)
        pairs = visible_pairs(mask, L, L, data.get("q_segment_ids"))
        dat = tuple(jnp.zeros((1,), jnp.int32) if n not in data else
                    jnp.broadcast_to(jnp.asarray(data[n], jnp.int32), (B, L))
                    for n in ("q_positions", "kv_positions", "q_segment_ids", "kv_segment_ids"))
        pats[name] = (mask, data, pairs, dat)
        log(f"{name}: density {pairs / L / L:.4f}")

    layouts = {}

    def lay(name, bq, bk):
        if (name, bq, bk) not in layouts:
            mask, data, _, _ = pats[name]
            layouts[(name, bq, bk)] = layout_of(mask, data, bq, bk)
        return layouts[(name, bq, bk)]

    # Reference lse / delta / outputs per pattern at the D=128 default tiles.
    refs = {}

    def ref(name):
        if name not in refs:
            mask, data, pairs, dat = pats[name]
            can, lists, t_lists, rng, _ = lay(name, 128, 128)
            cfg = cfg_of(can, data, contig=(rng[0], rng[0], rng[1]))
            out, lse = jax.jit(lambda q, k, v, d, l: tr._forward_launch(cfg, q, k, v, bias, sinks, d, l))(q, k, v, dat, lists)
            delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1)
            can2, l2, t2, rng2, _ = lay(name, 64, 128)
            cfg2 = cfg_of(can2, data, contig=(rng2[0], rng2[0], rng2[1]))
            dq, _ = jax.jit(lambda *xs: tr._dq_launch(cfg2, q, k, v, bias, dat, l2, do, lse, delta))()
            dk, dv = jax.jit(lambda *xs: tr._dkdv_launch(cfg2, q, k, v, bias, dat, t2, do, lse, delta))()
            refs[name] = dict(out=out, lse=lse, delta=delta, dq=dq, dk=dk, dv=dv)
        return refs[name]

    def rel(a, b):
        a = a.astype(jnp.float32); b = b.astype(jnp.float32)
        return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))

    def record(kind, name, tile, contig, ms, err, extra=""):
        _, _, pairs, _ = pats[name]
        units = {"fwd": 4, "dq": 6, "dkdv": 8}[kind]  # 2 * matmuls per visible pair * D
        tf = units / 4 * 4.0 * B * H * D * pairs / ms / 1e9
        r = dict(kind=kind, pattern=name, tile=tile, contig=contig, ms=ms, tflops=tf, err=err)
        results.append(r)
        log(f"{kind:5} {name:9} {str(tile):22} contig={contig!s:5} {ms:8.3f} ms "
            f"{tf:7.1f} TF/s  err {err:.1e} {extra}")

    def run(kind, name, tile, contig=None):
        try:
            mask, data, pairs, dat = pats[name]
            bq, bk, w, s = tile
            can, lists, t_lists, rng, visits = lay(name, bq, bk)
            if contig is None:
                contig = rng[1] if kind == "dkdv" else rng[0]
            elif contig and not (rng[1] if kind == "dkdv" else rng[0]):
                log(f"skip {kind} {name} {tile}: lists are not ranges")
                return
            R = ref(name)
            cfg = cfg_of(can, data, fwd=(bq, bk), dq=(bq, bk), dkdv=(bq, bk), fl=(w, s), dl=(w, s),
                         kl=(w, s), contig=(contig, contig, contig))
            if kind == "fwd":
                f = jax.jit(lambda q, k, v, d, l: tr._forward_launch(cfg, q, k, v, bias, sinks, d, l)[0])
                args = (q, k, v, dat, lists)
                err = rel(f(*args), R["out"])
            elif kind == "dq":
                f = jax.jit(lambda q, k, v, d, l, lse, dl: tr._dq_launch(cfg, q, k, v, bias, d, l, do, lse, dl)[0])
                args = (q, k, v, dat, lists, R["lse"], R["delta"])
                err = rel(f(*args), R["dq"])
            else:
                f = jax.jit(lambda q, k, v, d, l, lse, dl: tr._dkdv_launch(cfg, q, k, v, bias, d, l, do, lse, dl))
                args = (q, k, v, dat, t_lists, R["lse"], R["delta"])
                dk, dv = f(*args)
                err = max(rel(dk, R["dk"]), rel(dv, R["dv"]))
            ms = median_ms(f, args, a.reps, warmup=2)
            record(kind, name, tile, contig, ms, err, f"visits/row {visits:.1f}")
        except Exception as e:  # noqa: BLE001
            log(f"{kind} {name} {tile} ERROR {type(e).__name__}: {str(e)[:300]}")

    for part in SWEEPS:
        if part in parts:
            for kind, name, tile, walk in SWEEPS[part]:
                run(kind, name, tile, walk)
    if "layout" in parts:
        mask, data, _, _ = pats["document"]
        ids = jnp.broadcast_to(jnp.asarray(data["q_segment_ids"]), (B, L))
        for bq, bk in ((128, 128), (64, 64), (64, 128)):
            g = jax.jit(lambda s, bq=bq, bk=bk: (lambda lay: (lay.full_count, lay.full_index,
                        lay.partial_count, lay.partial_index))(build_layout(
                            mask, q_len=L, kv_len=L, num_heads=H, block_q=bq, block_kv=bk,
                            q_segment_ids=s, kv_segment_ids=s)))
            ms = median_ms(g, (ids,), a.reps, warmup=2)
            log(f"layout document {bq}x{bk} forward lists {ms * 1e3:7.1f} us")
            results.append(dict(kind="layout", tile=(bq, bk), ms=ms))
    if "e2e" in parts:
        for name in ("causal", "document", "bigbird"):
            mask, data, pairs, _ = pats[name]
            cd = {n: jnp.asarray(x) for n, x in data.items()}
            attn = bsa.BlockSparseAttention(mask=mask, kernel=bsa.kernels.TritonBlockSparse())
            f = lambda q, k, v, attn=attn, cd=cd: attn(q, k, v, **cd)  # noqa: E731
            fb = jax.jit(lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do))
            flops = 4.0 * B * H * D * pairs
            ms1 = median_ms(jax.jit(f), (q, k, v), a.reps, warmup=2)
            ms2 = median_ms(fb, (q, k, v, do), a.reps, warmup=2)
            log(f"e2e {name:9} fwd {ms1:7.3f} ms {flops / ms1 / 1e9:6.1f} TF/s   fwd+bwd {ms2:7.3f} ms "
                f"{3.5 * flops / ms2 / 1e9:6.1f} TF/s")
            results.append(dict(kind="e2e", pattern=name, fwd_ms=ms1, fwdbwd_ms=ms2))
            if name == "causal":
                g = lambda q, k, v: nn_attention(q, k, v, implementation="cudnn", is_causal=True)  # noqa: E731
                gb = jax.jit(lambda q, k, v, do: jax.vjp(g, q, k, v)[1](do))
                c1 = median_ms(jax.jit(g), (q, k, v), a.reps, warmup=2)
                c2 = median_ms(gb, (q, k, v, do), a.reps, warmup=2)
                log(f"e2e cudnn causal fwd {c1:7.3f} ms ({ms1 and c1 / ms1:.2f})  fwd+bwd {c2:7.3f} ms ({c2 / ms2:.2f})")
                results.append(dict(kind="e2e", pattern="cudnn_causal", fwd_ms=c1, fwdbwd_ms=c2))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
