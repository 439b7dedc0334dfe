"""Heuristic against tuned tilings, on a GPU: what `eqx_bsattn.autotune` gains and costs.

    python benchmarks/autotune_gpu.py [--out autotune_gpu.json]
    python benchmarks/autotune_gpu.py --smoke          # tiny shapes on any platform

For the patterns of `eqx_bsattn.bench` (causal, window, document, BigBird) at each length
(default L=4096 and 16384, B=2, H=16, D=128, bfloat16) and each kernel that takes a tiling
(`TritonBlockSparse`, then `XlaBlockSparse`), runs `autotune` on random inputs with at most
``--max-candidates`` candidates per kernel and prints the heuristic's and the winner's times
(forward, forward+backward; medians, both measured inside the same run), the winner, the
candidates that were wrong, failed or rejected, and the tuning time. Each kernel has an equal
share of ``--budget-s`` (what one leaves goes to the next); configurations it cannot begin
within its share are skipped and listed. Results go to a fresh cache folder (or
``--cache-dir``); the plan of an untiled module is checked to read them from there.
Not a test: numbers depend on the machine.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import eqx_bsattn as bsa
from eqx_bsattn.bench import PATTERNS, pattern, visible_pairs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, two candidates, one rep: checks that the script runs")
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    p.add_argument("--kernels", nargs="+", default=None,
                   help="kernel class names (default: TritonBlockSparse XlaBlockSparse on a "
                        "GPU, XlaBlockSparse elsewhere)")
    p.add_argument("--max-candidates", type=int, nargs="+", default=None,
                   help="per kernel, in --kernels order (default: 8 for Triton, 3 for XLA)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per candidate and pass")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="begin no configuration after this many seconds; each kernel gets an "
                        "equal share of what the kernels before it left")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--cache-dir", default=None, help="default: a fresh temporary folder")
    p.add_argument("--out", default=None, help="write the records as JSON here")
    return p.parse_args(argv)


def _defaults(args):
    gpu = jax.default_backend() == "gpu"
    smoke = args.smoke
    fill = {
        "lengths": [128] if smoke else [4096, 16384],
        "kernels": ["TritonBlockSparse", "XlaBlockSparse"] if gpu else ["XlaBlockSparse"],
        "reps": 1 if smoke else 3,
        "batch": 1 if smoke else 2,
        "heads": 2 if smoke else 16,
        "dim": 32 if smoke else 128,
        "dtype": "float32" if smoke or not gpu else "bfloat16",
    }
    for name, value in fill.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.max_candidates is None:
        args.max_candidates = [2 if smoke else (8 if "Triton" in k else 3) for k in args.kernels]
    if len(args.max_candidates) == 1:
        args.max_candidates = args.max_candidates * len(args.kernels)
    if len(args.max_candidates) != len(args.kernels):
        raise SystemExit("--max-candidates takes one number, or one per kernel in --kernels")
    return args


def _tflops(pairs, batch, heads, dim, ms, factor=1.0):
    return None if ms is None else factor * 4.0 * batch * heads * dim * pairs / ms / 1e9


def measure(args, kernel_name, max_candidates, length, name, key) -> dict:
    kernel = getattr(bsa.kernels, kernel_name)()
    mask, data = pattern(name, length)
    b, h, d = args.batch, args.heads, args.dim
    keys = jax.random.split(jax.random.fold_in(key, length), 3)
    q, k, v = (jax.random.normal(kk, (b, h, length, d), jnp.dtype(args.dtype)) for kk in keys)
    call_data = {n: jnp.asarray(x) for n, x in data.items()}
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel)
    record = {"pattern": name, "length": length, "kernel": kernel.name, "batch": b, "heads": h,
              "dim": d, "dtype": args.dtype}
    try:
        _, report = bsa.autotune(attn, q, k, v, max_candidates=max_candidates, reps=args.reps,
                                 **call_data)
    except Exception as e:  # noqa: BLE001 - a configuration that cannot run is reported
        record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return record
    heuristic, winner = report.heuristic, report.winner
    pairs = visible_pairs(mask, length, length, data.get("q_segment_ids"))
    record.update(
        density=pairs / float(length * length),
        heuristic=heuristic.tiling_text, tuned=winner.tiling_text,
        tuned_origin=winner.origin,
        heuristic_fwd_ms=heuristic.forward_ms, heuristic_fwdbwd_ms=heuristic.forward_backward_ms,
        tuned_fwd_ms=winner.forward_ms, tuned_fwdbwd_ms=winner.forward_backward_ms,
        heuristic_fwd_tflops=_tflops(pairs, b, h, d, heuristic.forward_ms),
        heuristic_fwdbwd_tflops=_tflops(pairs, b, h, d, heuristic.forward_backward_ms, 3.5),
        tuned_fwd_tflops=_tflops(pairs, b, h, d, winner.forward_ms),
        tuned_fwdbwd_tflops=_tflops(pairs, b, h, d, winner.forward_backward_ms, 3.5),
        speedup_fwdbwd=report.speedup, tuning_s=report.tuning_seconds,
        tried=sum(t.status != "rejected" for t in report.trials), untried=report.untried,
        **{status: [f"{t.tiling_text}: {t.reason}" for t in report.trials
                    if t.status == status] for status in ("wrong", "failed", "rejected")},
    )
    record["plan_reads_cache"] = attn.plan(q, k, v, **call_data).tiling_source == "cache"
    print(report, flush=True)
    return record


def _row(r: dict) -> str:
    head = f"{r['kernel']:>7} {r['pattern']:>9} L={r['length']:<6}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"

    def ms(x):
        return f"{x:8.2f}" if x is not None else "       -"

    return (f"{head} heuristic fwd {ms(r['heuristic_fwd_ms'])} fwd+bwd {ms(r['heuristic_fwdbwd_ms'])}"
            f" ms | tuned fwd {ms(r['tuned_fwd_ms'])} fwd+bwd {ms(r['tuned_fwdbwd_ms'])} ms "
            f"({r['speedup_fwdbwd']:.2f}x) | tuning {r['tuning_s']:.1f} s, {r['tried']} tried, "
            f"{len(r['wrong'])} wrong, {len(r['failed'])} failed | {r['tuned']}")


def main(argv=None):
    args = _defaults(parse_args(argv))
    folder = args.cache_dir or tempfile.mkdtemp(prefix="eqx_bsattn_autotune_")
    os.environ["EQX_BSATTN_CACHE_DIR"] = folder
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}; "
          f"cache: {folder}", flush=True)
    start = time.perf_counter()
    records, skipped = [], []
    key = jax.random.key(0)
    for i, (kernel_name, limit) in enumerate(zip(args.kernels, args.max_candidates, strict=True)):
        # Each kernel gets an equal share of the time the kernels before it left.
        kernel_start = time.perf_counter()
        share = (args.budget_s - (kernel_start - start)) / (len(args.kernels) - i)
        for length in args.lengths:
            for name in args.patterns:
                if time.perf_counter() - kernel_start > share:
                    skipped.append(f"{kernel_name} {name} L={length}")
                    continue
                records.append(measure(args, kernel_name, limit, length, name, key))
                print(_row(records[-1]), flush=True)
    total = time.perf_counter() - start
    print("\nsummary")
    for r in records:
        print(_row(r))
    if skipped:
        print(f"skipped (past the kernel's share of --budget-s {args.budget_s:g}): {', '.join(skipped)}")
    print(f"total {total:.1f} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": device.device_kind, "jax": jax.__version__, "total_s": total,
                       "skipped": skipped, "records": records}, fh, indent=1)
        print(f"wrote {args.out}")
    failed = [r for r in records if "error" in r or not r.get("plan_reads_cache")]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
