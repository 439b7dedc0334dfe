"""FlexAttention (torch) on the masks and score terms of `score_terms_gpu.py`, in a process of
its own: torch's compiler and JAX's Triton kernels do not share one process cleanly, so that
script starts this one and reads its records.

    python benchmarks/flex_peer.py ARRAYS.npz --batch 2 --heads 16 --kv-heads 16 --length 16384
        --dim 128 --dtype bfloat16 --window 1024 --masks causal window
        --scores none alibi relative both --reps 20

`ARRAYS.npz` holds the learned arrays (``slopes [H]``, ``table [H, num_buckets]``) and the
table's T5 buckets (``half``, ``bidirectional``, ``thresholds``: `RelativeBuckets`). Each
(mask, score) prints one line ``RECORD {json}`` with the median forward and forward+backward
milliseconds (`torch.compile`d `flex_attention`; gradients of q, k, v), or an error. The
captured arrays are constants unless `--learned`: with their gradients FlexAttention's
backward formed a float32 ``[B, H, Lq, Lk]`` buffer on the H200 (32 GiB at B=2, H=16,
16k tokens; docs/scores.md). Needs torch with CUDA; imports neither JAX nor eqx_bsattn.
"""

import argparse
import json
import statistics
import time

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("arrays", help="the .npz of learned arrays and buckets")
    for name, kind in (("batch", int), ("heads", int), ("kv-heads", int), ("length", int),
                       ("dim", int), ("window", int), ("reps", int)):
        p.add_argument(f"--{name}", type=kind, required=True)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--masks", nargs="+", required=True, choices=("causal", "window"))
    p.add_argument("--scores", nargs="+", required=True,
                   choices=("none", "alibi", "relative", "both"))
    p.add_argument("--learned", action="store_true",
                   help="differentiate the captured slopes and table too")
    return p.parse_args(argv)


def t5_bucket(torch, distance, half: int, bidirectional: bool, thresholds):
    """`RelativeBuckets.bucket` in torch, from its integer thresholds (the same buckets)."""
    exact = half // 2
    if bidirectional:
        offset, n = torch.where(distance < 0, half, 0), distance.abs()
    else:
        offset, n = 0, distance.clamp(min=0)
    far = exact + sum((n >= int(t)).int() for t in thresholds)
    return offset + torch.where(n < exact, n, far)


def median_ms(fn, reps: int, sync) -> float:
    """Median wall time of ``fn()`` in ms, after two warm-up calls (the first compiles)."""
    for _ in range(2):
        sync(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        sync(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not torch.cuda.is_available():
        raise SystemExit("flex_peer.py: torch sees no CUDA device.")
    arrays = np.load(args.arrays)
    half, bidirectional = int(arrays["half"]), bool(arrays["bidirectional"])
    thresholds = [int(t) for t in arrays["thresholds"]]
    dev, dtype = "cuda", getattr(torch, args.dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    shape = (args.batch, args.heads, args.length, args.dim)
    kv_shape = (args.batch, args.kv_heads, args.length, args.dim)

    def sync(x):
        torch.cuda.synchronize()
        return x

    def timed(mask_name, score_name):
        window = args.window
        # A fresh compile each row: past torch's recompile limit a compiled function falls
        # back to running eagerly, which forms every score (on the H200 the window rows
        # then asked 32 GiB).
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention)

        def mask_mod(b, h, q_idx, kv_idx):
            visible = kv_idx <= q_idx
            return visible & (q_idx - kv_idx <= window) if mask_name == "window" else visible

        block_mask = create_block_mask(mask_mod, None, None, args.length, args.length,
                                       device=dev)
        slopes = torch.tensor(arrays["slopes"], device=dev, requires_grad=args.learned)
        table = torch.tensor(arrays["table"], device=dev, requires_grad=args.learned)

        def score_mod(score, b, h, q_idx, kv_idx):
            if score_name in ("alibi", "both"):
                score = score + slopes[h] * (kv_idx - q_idx)
            if score_name in ("relative", "both"):
                bucket = t5_bucket(torch, q_idx - kv_idx, half, bidirectional, thresholds)
                score = score + table[h, bucket]
            return score

        q, k, v = (torch.randn(s, device=dev, dtype=dtype, generator=gen, requires_grad=True)
                   for s in (shape, kv_shape, kv_shape))
        do = torch.randn(shape, device=dev, dtype=dtype, generator=gen)
        mod = None if score_name == "none" else score_mod
        gqa = args.kv_heads != args.heads
        wrt = [q, k, v]
        if args.learned:
            wrt += ([slopes] if score_name in ("alibi", "both") else []) + (
                [table] if score_name in ("relative", "both") else [])

        def fwd():
            with torch.no_grad():
                return compiled(q, k, v, score_mod=mod, block_mask=block_mask, enable_gqa=gqa)

        def fwdbwd():
            out = compiled(q, k, v, score_mod=mod, block_mask=block_mask, enable_gqa=gqa)
            return torch.autograd.grad(out, wrt, do)

        return {"fwd_ms": median_ms(fwd, args.reps, sync),
                "fwdbwd_ms": median_ms(fwdbwd, args.reps, sync)}

    for mask_name in args.masks:
        for score_name in args.scores:
            record = {"impl": "flex_attention", "mask": mask_name, "score": score_name}
            try:
                record.update(timed(mask_name, score_name))
            except Exception as e:  # noqa: BLE001 - one failed call is a row, not a crash
                record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            record["learned"] = args.learned
            print("RECORD " + json.dumps(record), flush=True)
            torch.cuda.empty_cache()  # a failed row's buffers do not crowd the next one


if __name__ == "__main__":
    main()
