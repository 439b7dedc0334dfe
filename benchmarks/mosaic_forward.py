"""`MosaicBlockSparse` on a Hopper GPU: its error against the float32 dense reference per mask
and backward mode (single pass or deterministic), then forward and forward+backward TF/s of
Mosaic in both modes against `TritonBlockSparse` and cuDNN in one process.

cuDNN runs `jax.nn.dot_product_attention(implementation="cudnn")` on inputs already in its own
``[B, L, H, D]`` layout, so no transpose is timed. TF/s count visible pairs only
(`eqx_bsattn.bench`): ``4 B H D pairs`` forward, 3.5 times that forward+backward. At the speed
shapes each implementation's output and gradients are compared with the first's (Mosaic with its
default, deterministic backward) as a relative error in norm.

```
python benchmarks/mosaic_forward.py --out mosaic.json   # errors, then B=2 H=16 L=16384 D=128
python benchmarks/mosaic_forward.py --skip-errors --lengths 16384
python benchmarks/mosaic_forward.py --skip-errors --soft-cap 50 --sinks 1  # no cuDNN row
```
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import eqx_bsattn as bsa
from eqx_bsattn import masks
from eqx_bsattn.bench import median_ms, pattern, visible_pairs
from eqx_bsattn.strategies.kernels import DenseReference, TritonBlockSparse
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse

ERROR_CASES = {
    # name: (mask, batch, heads, kv_heads, q_len, kv_len, dim, dtype, documents)
    "causal": (masks.Causal(), 2, 4, 4, 1024, 1024, 128, jnp.bfloat16, 0),
    "window": (masks.Causal() & masks.SlidingWindow(200, 0), 1, 4, 2, 1000, 1000, 128,
               jnp.bfloat16, 0),
    "document": (masks.Causal() & masks.Document(), 2, 2, 2, 700, 700, 128, jnp.bfloat16, 5),
    "chunked": (masks.ChunkedCausal(96), 1, 2, 1, 384, 384, 64, jnp.float16, 0),
    "prefix": (masks.PrefixLM(70), 1, 2, 2, 300, 300, 64, jnp.bfloat16, 0),
    "full Lq!=Lk": (masks.Full(), 1, 2, 2, 200, 333, 128, jnp.float16, 0),
    # Bottom-right: the query sees all 257 keys (top-left it sees one, and its dq, dk are 0).
    "one query": (masks.Causal(bottom_right=True), 1, 2, 1, 1, 257, 128, jnp.bfloat16, 0),
    "empty rows": (masks.Causal(offset=-150), 1, 2, 2, 384, 200, 64, jnp.bfloat16, 0),
}


def _segments(batch, length, docs, pad=7, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.integers(0, docs, (batch, length)), axis=1).astype(np.int32)
    ids[:, -pad:] = -1
    return jnp.asarray(ids)


#: The backward modes, as `MosaicBlockSparse` builds them.
MODES = {"deterministic": MosaicBlockSparse(),
         "single_pass": MosaicBlockSparse(deterministic=False)}


def errors(cases=None, backwards=tuple(MODES)) -> list[dict]:
    print("| mask | backward | shape | dtype | out max abs | out rel | dq rel | dk rel | dv rel |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    records = []
    for (name, (mask, b, h, hkv, lq, lk, d, dtype, docs)), backward in (
            (case, bwd) for case in ERROR_CASES.items() for bwd in backwards):
        if cases and name not in cases:
            continue
        ks = jax.random.split(jax.random.key(len(name)), 4)
        q = jax.random.normal(ks[0], (b, h, lq, d), jnp.float32)
        k = jax.random.normal(ks[1], (b, hkv, lk, d), jnp.float32)
        v = jax.random.normal(ks[2], (b, hkv, lk, d), jnp.float32)
        cot = jax.random.normal(ks[3], (b, h, lq, d), jnp.float32)
        data = {}
        if docs:
            ids = _segments(b, lq, docs)
            data = {"q_segment_ids": ids, "kv_segment_ids": ids}

        def run(kernel, dt):
            attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel)
            f = lambda q, k, v: attn(q.astype(dt), k.astype(dt), v.astype(dt), **data)  # noqa: E731

            def both(q, k, v):
                out, pullback = jax.vjp(f, q, k, v)
                return (out, *pullback(cot.astype(out.dtype)))

            return [np.asarray(x, np.float32) for x in jax.jit(both)(q, k, v)]

        record = {"mask": name, "backward": backward, "shape": [b, h, hkv, lq, lk, d],
                  "dtype": jnp.dtype(dtype).name}
        try:
            got = run(MODES[backward], dtype)
            with jax.default_matmul_precision("highest"):
                want = run(DenseReference(), jnp.float32)
            rel = [float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
                   for g, w in zip(got, want)]
            finite = all(np.all(np.isfinite(g)) for g in got)
            record.update(out_max_abs=float(np.abs(got[0] - want[0]).max()), finite=finite,
                          **dict(zip(("out", "dq", "dk", "dv"), rel)))
            print(f"| {name} | {backward} | B{b} H{h}/{hkv} {lq}x{lk} D{d} | "
                  f"{jnp.dtype(dtype).name} | {record['out_max_abs']:.2e} | "
                  + " | ".join(f"{r:.2e}" for r in rel)
                  + ("" if finite else " NON-FINITE") + " |", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            import sys
            import traceback

            print(traceback.format_exc()[-4000:], file=sys.stderr)
            record["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            print(f"| {name} | {backward} | ERROR {record['error']} |", flush=True)
        records.append(record)
    return records


def speed(lengths, batch, heads, dim, reps, backward, only=None, soft_cap=None, sinks=0,
          patterns=("causal", "window", "document")):
    dtype = jnp.bfloat16
    extras = {}
    if sinks:
        extras["sinks"] = jax.random.normal(jax.random.key(1), (heads, sinks), jnp.float32)
    rows = []
    for length in lengths:
        for name in patterns:
            mask, data = pattern(name, length, window=1024)
            pairs = visible_pairs(mask, length, length, data.get("q_segment_ids"))
            flops = 4.0 * batch * heads * dim * pairs
            ks = jax.random.split(jax.random.key(length), 4)
            q, k, v, do = (jax.random.normal(kk, (batch, heads, length, dim), dtype) for kk in ks)
            call = {n: jnp.broadcast_to(jnp.asarray(x), (batch, length)) for n, x in data.items()}
            call.update(extras)
            impls = {}
            for impl, kernel in (("mosaic", MODES["deterministic"]),
                                 ("mosaic-single-pass", MODES["single_pass"]),
                                 ("triton", TritonBlockSparse())):
                attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel,
                                                logits_soft_cap=soft_cap)
                impls[impl] = (lambda q, k, v, attn=attn: attn(q, k, v, **call), (q, k, v))
            if name != "document" and not extras and soft_cap is None:
                blhd = tuple(jnp.swapaxes(x, 1, 2) for x in (q, k, v))
                window = (1024, 0) if name == "window" else None
                impls["cudnn"] = (lambda q, k, v, window=window: jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, local_window_size=window, implementation="cudnn"),
                    blhd)
            base = None
            for impl, (f, args) in impls.items():
                if only and impl not in only:
                    continue
                row = {"pattern": name, "L": length, "impl": impl}
                try:
                    cot = do if impl != "cudnn" else jnp.swapaxes(do, 1, 2)

                    def fb(*a, f=f, cot=cot):
                        out, pull = jax.vjp(f, *a)
                        return (out, *pull(cot))

                    fwd, both = jax.jit(f), jax.jit(fb)
                    # Output, then dq, dk, dv, compared with the first implementation's.
                    got = both(*args) if backward else (fwd(*args),)
                    if impl == "cudnn":
                        got = tuple(jnp.swapaxes(x, 1, 2) for x in got)
                    got = tuple(x.astype(jnp.float32) for x in got)
                    if base is None:
                        base = got
                    else:
                        row["diff"] = {n: float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
                                       for n, g, w in zip(("out", "dq", "dk", "dv"), got, base)}
                    del got
                    if impl != "mosaic-single-pass":  # the same forward as "mosaic"
                        row["fwd"] = flops / median_ms(fwd, args, reps, warmup=2) / 1e9
                    if backward:
                        row["fwdbwd"] = 3.5 * flops / median_ms(both, args, reps,
                                                                 warmup=2) / 1e9
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(row, flush=True)
    print(f"\nB={batch} H={heads} D={dim} bfloat16, soft cap {soft_cap}, {sinks} sinks a head, "
          "effective TF/s (visible pairs)")
    print("| pattern | L | impl | fwd TF/s | fwd+bwd TF/s | max rel diff vs mosaic (out, dq, dk, dv) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        f = lambda key: format(r[key], ".1f") if key in r else "-"  # noqa: E731
        diff = format(max(r["diff"].values()), ".1e") if "diff" in r else "-"
        print(f"| {r['pattern']} | {r['L']} | {r['impl']} | {f('fwd')} | {f('fwdbwd')} | "
              f"{diff} |" + (f" {r['error']}" if "error" in r else ""))
    return rows


def shape_arguments(description: str, reps: int) -> argparse.ArgumentParser:
    """A parser with the speed runs' shape options (lengths, batch, heads, dim, reps)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--lengths", type=int, nargs="+", default=[16384])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=reps)
    return p


def main():
    p = shape_arguments(__doc__.split("\n\n")[0], reps=20)
    p.add_argument("--skip-errors", action="store_true")
    p.add_argument("--cases", nargs="+", default=None, choices=sorted(ERROR_CASES),
                   help="only these error cases")
    p.add_argument("--backwards", nargs="+", default=list(MODES), choices=list(MODES),
                   help="the error table's backward modes")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--impls", nargs="+", default=None,
                   choices=["mosaic", "mosaic-single-pass", "triton", "cudnn"],
                   help="time only these (the first timed is the reference of the diffs)")
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--soft-cap", type=float, default=None, help="logits soft cap (no cuDNN)")
    p.add_argument("--sinks", type=int, default=0, help="sinks a head (no cuDNN)")
    p.add_argument("--patterns", nargs="+", default=["causal", "window", "document"],
                   choices=["causal", "window", "document"])
    p.add_argument("--out", default=None, help="write the records as JSON here")
    args = p.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "jaxlib": jax.lib.__version__, "args": vars(args)}
    if not args.skip_errors:
        result["errors"] = errors(args.cases, args.backwards)
    if not args.skip_speed:
        result["speed"] = speed(args.lengths, args.batch, args.heads, args.dim, args.reps,
                                not args.forward_only, args.impls, args.soft_cap, args.sinks,
                                args.patterns)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
