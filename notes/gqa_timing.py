"""Grouped-query attention on `TritonBlockSparse`: each launch alone, and forward+backward,
with as many kv heads as q heads against a quarter of them; the dk/dv launch with one loop per
q head of a group against one loop of (q-block, head) steps (`triton._FLAT_GROUPS`).

    python notes/gqa_timing.py
    SWEEP_BHLD=2,16,16384,128 python notes/gqa_timing.py   # the default shape

Causal mask, bfloat16; the forward at 128x128 (8 warps, 3 stages), dq at 128x64 and dk/dv at
64x128 (8 warps, 3 stages): the D=128 defaults. Three rounds, interleaved, to see the spread.
Writes gqa_timing.json to $OUT (default /tmp).
"""

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp

import eqx_bsattn as bsa
from eqx_bsattn._timing import median_ms
from eqx_bsattn.strategies.kernels import TritonBlockSparse
from eqx_bsattn.strategies.kernels import triton as tr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launch_sweep as ls  # noqa: E402

B, H, L, D = ls.B, ls.H, ls.L, ls.D
OUT = os.environ.get("OUT", "/tmp")
log = ls.log
mask = bsa.masks.Causal()
lay = {bt: ls.layout_of(mask, {}, *bt) for bt in ((128, 128), (128, 64), (64, 128))}
can = lay[(128, 128)][0]
keys = jax.random.split(jax.random.key(3), 6)
q = jax.random.normal(keys[0], (B, H, L, D), jnp.bfloat16)
do = jax.random.normal(keys[3], (B, H, L, D), jnp.bfloat16)
bias = jnp.zeros((1,), jnp.float32)
sinks = jnp.zeros((1, 1), jnp.float32)
dat = tuple(jnp.zeros((1,), jnp.int32) for _ in range(4))
pairs = L * (L + 1) / 2
rec = []
kvs = {}
for kvh in (H, H // 4):
    kvs[kvh] = (jax.random.normal(keys[1], (B, kvh, L, D), jnp.bfloat16),
                jax.random.normal(keys[2], (B, kvh, L, D), jnp.bfloat16))
for rnd in range(3):
    for kvh in (H, H // 4):
        k, v = kvs[kvh]
        cfg = dataclasses.replace(ls.cfg_of(can, {}, fwd=(128, 128), dq=(128, 64), dkdv=(64, 128),
                                            fl=(8, 3), dl=(8, 3), kl=(8, 3)), kv_heads=kvh)
        fwd = jax.jit(lambda q, k, v: tr._forward_launch(cfg, q, k, v, bias, sinks, dat, lay[(128, 128)][1]))
        out, lse = fwd(q, k, v)
        delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), -1)
        dq = jax.jit(lambda q, k, v: tr._dq_launch(cfg, q, k, v, bias, dat, lay[(128, 64)][1], do, lse, delta))
        t = {"fwd": median_ms(fwd, (q, k, v), 20), "dq": median_ms(dq, (q, k, v), 20)}
        res = {}
        for flat in (False, True):
            tr._FLAT_GROUPS = flat
            dkdv = jax.jit(lambda q, k, v: tr._dkdv_launch(cfg, q, k, v, bias, dat, lay[(64, 128)][2], do, lse, delta))
            res[flat] = dkdv(q, k, v)
            t[f"dkdv_flat{int(flat)}"] = median_ms(dkdv, (q, k, v), 20)
        err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(res[True], res[False]))
        log(f"round {rnd} kvh={kvh}: " + ", ".join(f"{n} {x:.3f} ms" for n, x in t.items()) + f"; flat vs loops max diff {err:.2e}")
        rec.append(dict(kind="launch", rnd=rnd, kvh=kvh, **t, diff=err))
    attn = bsa.BlockSparseAttention(mask=mask, kernel=TritonBlockSparse())
    for kvh in (H, H // 4):
        k, v = kvs[kvh]
        for flat in (False, True):
            tr._FLAT_GROUPS = flat
            def fb(q, k, v, do):
                o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v), q, k, v)
                return vjp(do)
            f = jax.jit(fb)
            ms = median_ms(f, (q, k, v, do), 15)
            log(f"round {rnd} kvh={kvh} flat={flat}: fwd+bwd {ms:.3f} ms {3.5*4*B*H*D*pairs/ms/1e9:.1f} TF/s")
            rec.append(dict(kind="e2e", rnd=rnd, kvh=kvh, flat=flat, ms=ms))
tr._FLAT_GROUPS = True
json.dump(rec, open(f"{OUT}/gqa_timing.json", "w"), indent=1)
