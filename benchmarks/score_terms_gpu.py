"""What ALiBi and a relative-position table cost inside the kernel, against the same call
without them, on a GPU (issue 27's speed target: at most 10 % of the forward and 15 % of
forward+backward at 16k tokens, causal and causal window 1024).

    python benchmarks/score_terms_gpu.py [--length 16384] [--batch 2] [--heads 16] [--dim 128]
        [--window 1024] [--buckets 32] [--reps 20] [--rounds 3]
        [--kernel TritonBlockSparse ...] [--no-flex] [--device-times] [--out score_terms.json]

For each mask (``causal``, ``window``: causal and a window of `--window` keys) and each score
(``none``, ``alibi``: learned slopes, ``relative``: a learned `--buckets`-bucket causal T5
table, ``both``: slopes and table together, ``function``: ALiBi's standard slopes in a
`scores.ScoreFunction` of symmetric ALiBi, ``-slope |k - q|``, the same term on the causal
pairs (ALiBi written as a function plans as built-in ALiBi, so it would time that),
``positions``: no score, but per-call positions, the token indices
passed as ``q_positions`` / ``kv_positions``), the median wall time of a jitted forward and of a
forward+backward (gradients of q, k, v and the learned arrays), and the ratio to ``none``,
for each kernel of `--kernel` (a kernel that declines a score gives an error row). Our scores
of one mask and kernel are compiled first, then timed in turn, `--rounds` times (each time the
median of `--reps` calls); a row gives the median of its rounds, so that a drift of the
machine's speed during the run falls on every score alike.
FlexAttention runs the same masks and score_mods as a peer when torch with CUDA imports
(`benchmarks/flex_peer.py`, in its own process: `torch.compile`d `flex_attention`; gradients
of q, k, v and the captured slopes / table).
With `--device-times`, each of our rows also gives where its device time goes: the mean
microseconds per call of each GPU kernel (the kernels' own launches and XLA's, by name), from a
`jax.profiler` trace of `--reps` calls; unlike the wall times, these hold no dispatch. A last
table then gives the ratios of the rows' device times (``alibi / none``, ``function / none``,
``function / alibi``, ``positions / none``), forward and forward+backward.
Not a test: numbers depend on the machine. On a CPU, ``--kernel XlaBlockSparse`` with small
sizes runs the same code (tests/test_bench.py does).
"""

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
from eqx_bsattn.bench import environment
from eqx_bsattn.contract import AbstractScore, ScoreTerms

MASKS = ("causal", "window")
SCORES = ("none", "alibi", "relative", "both", "function", "positions")
#: The scores FlexAttention's peer runs (`benchmarks/flex_peer.py`).
FLEX_SCORES = ("none", "alibi", "relative", "both")
#: The device-time ratios of the last table: (row, the row it is divided by).
DEVICE_RATIOS = (("alibi", "none"), ("function", "none"), ("function", "alibi"),
                 ("positions", "none"))
#: Issue 27's bounds on the ratio to the same call without score terms.
TARGET = {"fwd": 1.10, "fwdbwd": 1.15}


class SlopesAndTable(AbstractScore):
    """ALiBi slopes and a relative-position table in one call (both learned)."""

    slopes: jax.Array
    relative: scores.RelativePositionBias

    def compile(self, num_heads: int) -> ScoreTerms:
        table = self.relative.compile(num_heads)
        return ScoreTerms(slopes=self.slopes, table=table.table, buckets=table.buckets)


class AlibiFunction:
    """Symmetric ALiBi with the standard slopes of `heads` heads (``2^(-8 (h + 1) /
    heads)``, as `scores.alibi_slopes` gives them for a power of two), written as a score
    function: ``fn(score, head, q_pos, k_pos)``; ALiBi on the causal pairs, and not affine in
    the positions, so the kernel evaluates it on every logit. Equal for equal `heads` (a score function is part of
    the module's static identity)."""

    def __init__(self, heads: int):
        self.heads = heads

    def __eq__(self, other):
        return isinstance(other, AlibiFunction) and other.heads == self.heads

    def __hash__(self):
        return hash((AlibiFunction, self.heads))

    def __call__(self, score, head, q_pos, k_pos):
        exponent = (jnp.asarray(head).astype(jnp.float32) + 1.0) * (-8.0 / self.heads)
        return score - jnp.exp2(exponent) * jnp.abs(k_pos - q_pos).astype(jnp.float32)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=16384, help="tokens (queries = keys)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--dim", type=int, default=128, help="head dim")
    p.add_argument("--window", type=int, default=1024, help="the window mask's keys")
    p.add_argument("--buckets", type=int, default=32, help="the relative table's buckets")
    p.add_argument("--max-distance", type=int, default=128, help="the table's max_distance")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--reps", type=int, default=20, help="timed calls per measurement")
    p.add_argument("--rounds", type=int, default=3,
                   help="measurements per row, interleaved with the other scores'")
    p.add_argument("--kernel", nargs="+", default=["TritonBlockSparse"],
                   help="classes of eqx_bsattn.kernels, each timed in turn")
    p.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    p.add_argument("--scores", nargs="+", default=list(SCORES), choices=SCORES)
    p.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peer")
    p.add_argument("--flex-learned", action="store_true",
                   help="FlexAttention differentiates the slopes and table too (default: "
                        "constants; see benchmarks/flex_peer.py)")
    p.add_argument("--device-times", action="store_true",
                   help="also each GPU kernel's device time per call (a profiler trace)")
    p.add_argument("--out", default=None, help="write the records to this JSON file")
    args = p.parse_args(argv)
    for name in args.kernel:
        if getattr(kernels, name, None) is None:
            p.error(f"--kernel: unknown kernel {name!r}.")
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads must divide --heads ({args.heads}); got {args.kv_heads}.")
    return args


def _mask(name: str, window: int):
    return masks.Causal() if name == "causal" else masks.Causal() & masks.SlidingWindow(window, 0)


def _arrays(args) -> dict:
    """The learned arrays: standard slopes, a small random table (float32)."""
    rng = np.random.default_rng(0)
    return {"slopes": jnp.asarray(scores.alibi_slopes(args.heads), jnp.float32),
            "table": jnp.asarray(0.3 * rng.standard_normal((args.heads, args.buckets)),
                                 jnp.float32)}


def _score(name: str, arrays: dict, args):
    relative = scores.RelativePositionBias(arrays["table"], bidirectional=False,
                                           max_distance=args.max_distance)
    return {"none": None, "alibi": scores.ALiBi(arrays["slopes"], learned=True),
            "relative": relative, "both": SlopesAndTable(arrays["slopes"], relative),
            "function": scores.ScoreFunction(AlibiFunction(args.heads)),
            "positions": None}[name]


def median_ms(fn, *xs, reps: int, sync=jax.block_until_ready) -> float:
    """Median wall time of ``fn(*xs)`` in ms, after two warm-up calls (the first compiles)."""
    for _ in range(2):
        sync(fn(*xs))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        sync(fn(*xs))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def kernel_microseconds(trace_folder: str) -> dict[str, float]:
    """Device microseconds of each GPU kernel name in the profiler trace under `trace_folder`:
    the events of a GPU process's stream lines (not its per-op summary lines), summed by
    name."""
    events = []
    for path in glob.glob(f"{trace_folder}/**/*.trace.json.gz", recursive=True):
        with gzip.open(path) as f:
            events += json.load(f)["traceEvents"]
    names = {(e.get("name"), e["pid"], e.get("tid")): e.get("args", {}).get("name", "")
             for e in events if e.get("ph") == "M"}
    gpus = {pid for (kind, pid, _), name in names.items()
            if kind == "process_name" and "GPU" in name}
    totals = collections.Counter()
    for e in events:
        if (e.get("ph") == "X" and e["pid"] in gpus
                and names.get(("thread_name", e["pid"], e.get("tid")), "").startswith("Stream")):
            totals[e["name"]] += e["dur"]
    return dict(totals)


def device_times(fn, *xs, reps: int) -> dict[str, float]:
    """Mean device microseconds per call of ``fn(*xs)`` by GPU kernel (`kernel_microseconds`
    of `reps` traced calls, after one untraced)."""
    jax.block_until_ready(fn(*xs))
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            for _ in range(reps):
                out = fn(*xs)
            jax.block_until_ready(out)
        totals = kernel_microseconds(folder)
    return {name: us / reps for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def time_ours(args, kernel_name: str, mask_name: str, score_name: str, inputs):
    """``({"fwd_ms": timer, "fwdbwd_ms": timer}, trace)`` for one row, compiled and run once
    (so that a declined score raises here); each timer returns `median_ms` of `--reps` calls.
    `trace` (``--device-times``, else ``None``) returns each pass's `device_times`."""
    q, k, v, do = inputs
    arrays = _arrays(args)
    kernel = getattr(kernels, kernel_name)()

    data = {}
    if score_name == "positions":
        positions = jnp.broadcast_to(jnp.arange(args.length, dtype=jnp.int32),
                                     (args.batch, args.length))
        data = {"q_positions": positions, "kv_positions": positions}

    def attend(q, k, v, arrays):
        attn = bsa.BlockSparseAttention(mask=_mask(mask_name, args.window), kernel=kernel,
                                        score=_score(score_name, arrays, args))
        return attn(q, k, v, **data)

    fwd = jax.jit(attend)
    fwdbwd = jax.jit(lambda q, k, v, arrays, do: jax.vjp(attend, q, k, v, arrays)[1](do))
    calls = {"fwd_ms": (fwd, (q, k, v, arrays)), "fwdbwd_ms": (fwdbwd, (q, k, v, arrays, do))}
    for fn, xs in calls.values():
        jax.block_until_ready(fn(*xs))
    timers = {key: functools.partial(median_ms, fn, *xs, reps=args.reps)
              for key, (fn, xs) in calls.items()}
    if not args.device_times:
        return timers, None
    return timers, lambda: {key.removesuffix("_ms"): device_times(fn, *xs, reps=args.reps)
                            for key, (fn, xs) in calls.items()}


def flex_records(args) -> list[dict] | None:
    """FlexAttention's records for every (mask, score) of the run, from
    `benchmarks/flex_peer.py` in a process of its own (torch's compiler failed to compile
    FlexAttention in a process that had imported JAX's Triton kernels); ``None`` where torch
    with CUDA is missing."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    buckets = scores.RelativeBuckets(args.buckets, False, args.max_distance)
    arrays = {name: np.asarray(x) for name, x in _arrays(args).items()}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "arrays.npz")
        np.savez(path, **arrays, half=buckets.half, bidirectional=buckets.bidirectional,
                 thresholds=np.asarray(buckets.thresholds, np.int64))
        command = [sys.executable, os.path.join(os.path.dirname(__file__), "flex_peer.py"),
                   path, "--batch", str(args.batch), "--heads", str(args.heads),
                   "--kv-heads", str(args.kv_heads), "--length", str(args.length),
                   "--dim", str(args.dim), "--dtype", args.dtype, "--window", str(args.window),
                   "--reps", str(args.reps), "--masks", *args.masks,
                   "--scores", *[name for name in args.scores if name in FLEX_SCORES],
                   *(["--learned"] if args.flex_learned else [])]
        done = subprocess.run(command, capture_output=True, text=True)
    records = [json.loads(line[len("RECORD "):]) for line in done.stdout.splitlines()
               if line.startswith("RECORD ")]
    if not records:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        records = [{"impl": "flex_attention", "mask": m, "score": s,
                    "error": f"flex_peer.py exited {done.returncode}: {tail[0][:200]}"}
                   for m in args.masks for s in args.scores]
    return records


def _add_ratios(records: list[dict]) -> None:
    base = {(r["impl"], r["mask"]): r for r in records if r["score"] == "none"}
    for r in records:
        none = base.get((r["impl"], r["mask"]))
        if none is None or "error" in r or "error" in none:
            continue
        for key in ("fwd", "fwdbwd"):
            r[f"{key}_vs_none"] = r[f"{key}_ms"] / none[f"{key}_ms"]
        r["within_target"] = all(r[f"{key}_vs_none"] <= TARGET[key] for key in TARGET)


def _table(records: list[dict]) -> str:
    lines = ["| impl | mask | score | fwd ms | fwd+bwd ms | fwd / none | fwd+bwd / none | "
             f"within {TARGET['fwd']:.2f} / {TARGET['fwdbwd']:.2f} |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['mask']} | {r['score']} | {r['error']} |")
            continue
        ratios = (f"{r['fwd_vs_none']:.3f} | {r['fwdbwd_vs_none']:.3f} | "
                  f"{'yes' if r['within_target'] else 'no'}" if "fwd_vs_none" in r else "| |")
        lines.append(f"| {r['impl']} | {r['mask']} | {r['score']} | {r['fwd_ms']:.3f} | "
                     f"{r['fwdbwd_ms']:.3f} | {ratios} |")
    return "\n".join(lines)


def _device_table(records: list[dict], top: int = 6) -> str:
    """Per row and pass, the device microseconds per call in all and of its `top` kernels."""
    lines = ["| impl | mask | score | pass | device us | largest kernels, us |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in records:
        for key, kernels_us in r.get("device_us", {}).items():
            largest = ", ".join(f"{name[:40]} {us:.1f}"
                                for name, us in list(kernels_us.items())[:top])
            lines.append(f"| {r['impl']} | {r['mask']} | {r['score']} | {key} | "
                         f"{sum(kernels_us.values()):.1f} | {largest} |")
    return "\n".join(lines)


def _device_ratio_table(records: list[dict]) -> str:
    """`DEVICE_RATIOS` of our rows' device times per call (all kernels summed), forward and
    forward+backward, per kernel and mask."""
    total = {(r["impl"], r["mask"], r["score"]): {key: sum(us.values())
                                                  for key, us in r["device_us"].items()}
             for r in records if "device_us" in r}
    lines = ["| impl | mask | ratio | fwd | fwd+bwd |", "| --- | --- | --- | --- | --- |"]
    for impl, mask in dict.fromkeys((i, m) for i, m, _ in total):
        for top, bottom in DEVICE_RATIOS:
            a, b = total.get((impl, mask, top)), total.get((impl, mask, bottom))
            if a is None or b is None or not (b["fwd"] and b["fwdbwd"]):
                continue  # a row missing, or no device time (no GPU)
            lines.append(f"| {impl} | {mask} | {top} / {bottom} | "
                         f"{a['fwd'] / b['fwd']:.3f} | {a['fwdbwd'] / b['fwdbwd']:.3f} |")
    return "\n".join(lines)


def run(args) -> list[dict]:
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (args.batch, args.heads, args.length, args.dim)
    kv_shape = (args.batch, args.kv_heads, args.length, args.dim)
    inputs = tuple(jax.random.normal(kk, s, dtype)
                   for kk, s in zip(keys, (shape, kv_shape, kv_shape, shape)))
    peers = {f"ours:{name}": functools.partial(time_ours, args, name, inputs=inputs)
             for name in args.kernel}
    records = []
    for mask_name in args.masks:
        for impl, timers in peers.items():
            rows, calls, traces = [], {}, {}
            for score_name in args.scores:
                record = {"impl": impl, "mask": mask_name, "score": score_name}
                try:
                    calls[score_name], trace = timers(mask_name, score_name)
                except Exception as e:  # noqa: BLE001 - one failed call is a row, not a crash
                    record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                else:
                    if trace is not None:  # traced after the timed rounds
                        traces[score_name] = trace
                rows.append(record)
            samples = {name: {key: [] for key in timed} for name, timed in calls.items()}
            for _ in range(args.rounds):
                for name, timed in calls.items():
                    for key, timer in timed.items():
                        samples[name][key].append(timer())
            for record in rows:
                record.update({key: statistics.median(times)
                               for key, times in samples.get(record["score"], {}).items()})
                if record["score"] in traces:
                    record["device_us"] = traces[record["score"]]()
                records.append(record)
                print(record, flush=True)
    flex = None if args.no_flex else flex_records(args)
    for record in flex or ():
        print(record, flush=True)
    records += flex or []
    _add_ratios(records)
    return records


def main(argv=None) -> None:
    args = parse_args(argv)
    records = run(args)
    print(f"\nB={args.batch} H={args.heads} Hkv={args.kv_heads} L={args.length} D={args.dim} "
          f"{args.dtype}, window {args.window}, {args.buckets} buckets "
          f"(max_distance {args.max_distance}); median of {args.rounds} rounds of {args.reps} "
          "calls each, interleaved\n")
    print(_table(records))
    if args.device_times:
        print("\n" + _device_table(records))
        print("\nDevice-time ratios\n\n" + _device_ratio_table(records))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "environment": environment(), "records": records}, f,
                      indent=1)


if __name__ == "__main__":
    main()
