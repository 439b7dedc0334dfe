"""Where the time of `MosaicBlockSparse`'s forward goes, per warpgroup, from Mosaic GPU's
on-device profiler (Hopper GPU only).

The kernel's phases are named scopes (`entry`, `wait_q`, `turn_qk`, `wait_qk`,
`softmax_full`, `softmax_partial`, `turn_pv`, `pv`, `turn_end`, `epilogue` in the compute
warpgroups; `wait_free`, `copy` in the memory warpgroup). This script compiles the forward
with the profiler switched on (a trace per call, written as Perfetto JSON under ``--out``),
and prints each phase's share of the warpgroups' time, its count and its mean length in SM
cycles. "(uncovered)" is time outside every named phase (loop bookkeeping, barrier
arrivals, the profiler's own records). Shapes are kept small, because each warpgroup records
its events in shared memory (``--space`` phases at most).

```
python benchmarks/mosaic_profile.py --out mosaic-profile
python benchmarks/mosaic_profile.py --cases documents --out mosaic-profile
```
"""

import argparse
import collections
import contextlib
import functools
import glob
import gzip
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

import eqx_bsattn as bsa
from eqx_bsattn.bench import median_ms, pattern, visible_pairs
from eqx_bsattn.strategies.kernels.mosaic.forward import ForwardConfig, forward_call

CASES = {
    # name: (pattern, batch, heads, length, window)
    "short-causal": ("causal", 4, 16, 1024, 256),
    "window": ("window", 1, 4, 16384, 1024),
    "documents": ("document", 1, 4, 16384, 1024),
    "causal": ("causal", 1, 4, 4096, 1024),
}
MEMORY_WARPGROUP = 2  # warpgroups 0 and 1 compute


@contextlib.contextmanager
def profiler(space: int, directory: str):
    """Compile Mosaic GPU kernels with the on-device profiler inside this block."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    plain = plgpu.CompilerParams
    plgpu.CompilerParams = functools.partial(plain, profile_space=space, profile_dir=directory)
    try:
        yield
    finally:
        plgpu.CompilerParams = plain


def phase_table(trace: dict) -> dict:
    """``{role: {phase: (total cycles, count)}, ...}`` and the CTAs' spans, from a trace."""
    by_warpgroup = collections.defaultdict(list)
    for event in trace["traceEvents"]:
        by_warpgroup[event["tid"]].append(event)
    totals = {"compute": collections.Counter(), "memory": collections.Counter()}
    counts = {"compute": collections.Counter(), "memory": collections.Counter()}
    spans = {"compute": 0.0, "memory": 0.0}
    cta_span = collections.defaultdict(float)
    for tid, events in by_warpgroup.items():
        role = "memory" if (tid - 1) % 3 == MEMORY_WARPGROUP else "compute"
        open_events, covered = [], 0.0
        for event in events:
            if event["ph"] == "B":
                open_events.append(event)
                continue
            begin = open_events.pop()
            cycles = (event["ts"] - begin["ts"]) * 1e3  # the trace's unit is 1000 cycles
            totals[role][begin["name"]] += cycles
            counts[role][begin["name"]] += 1
            if not open_events:
                covered += cycles
        span = (events[-1]["ts"] - events[0]["ts"]) * 1e3
        spans[role] += span
        totals[role]["(uncovered)"] += span - covered
        cta = (tid - 1) // 3
        cta_span[cta] = max(cta_span[cta], span)
    return {"totals": totals, "counts": counts, "spans": spans,
            "cta_spans": sorted(cta_span.values())}


def profile(name: str, space: int, out: str, reps: int) -> dict:
    kind, batch, heads, length, window = CASES[name]
    dim = 128
    mask, data = pattern(kind, length, window=window)
    seg = data.get("q_segment_ids")
    per_call = {}
    if seg is not None:
        ids = jnp.broadcast_to(jnp.asarray(seg, jnp.int32), (batch, length))
        per_call = {"q_segment_ids": ids, "kv_segment_ids": ids}
    resolved = bsa.ResolvedMask(mask, q_len=length, kv_len=length, num_heads=heads, **per_call)
    layout = resolved.layout(128, 128)
    lists = [jnp.asarray(a, jnp.int32) for a in (layout.full_count, layout.full_index,
                                                 layout.partial_count, layout.partial_index)]
    segments = [per_call["q_segment_ids"], per_call["kv_segment_ids"]] if per_call else []
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (batch, heads, length, dim), jnp.bfloat16) for key in keys)
    cfg = ForwardConfig(batch=batch, heads=heads, kv_heads=heads, q_len=length, kv_len=length,
                        true_kv_len=length, head_dim=dim, softmax_scale=dim ** -0.5,
                        terms=resolved.kernel_terms([(128, 128)]), block_kv=128, stages=2,
                        layout_batch=layout.full_count.shape[0],
                        layout_heads=layout.full_count.shape[1],
                        ctas=jax.devices()[0].core_count)
    args = (q, k, v, *lists, *segments)
    flops = 4.0 * batch * heads * dim * visible_pairs(mask, length, length, seg)
    plain = jax.jit(lambda *a: forward_call(cfg, *a)[0])
    ms = median_ms(plain, args, reps, warmup=2)
    directory = os.path.join(out, name)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    with profiler(space, directory):
        traced = jax.jit(lambda *a: forward_call(cfg, *a)[0])
        jax.block_until_ready(traced(*args))
    [path] = glob.glob(os.path.join(directory, "*-trace.json"))
    with open(path) as f:
        table = phase_table(json.load(f))
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(path)
    spans = table["cta_spans"]
    print(f"\n## {name}: B={batch} H={heads} L={length} D={dim}: {ms:.3f} ms, "
          f"{flops / ms / 1e9:.1f} TF/s without the profiler; CTA spans (cycles) min / median"
          f" / max {spans[0]:.0f} / {np.median(spans):.0f} / {spans[-1]:.0f}")
    for role in ("compute", "memory"):
        print(f"\n| {role} phase | share | count | mean cycles |\n| --- | --- | --- | --- |")
        for phase, cycles in table["totals"][role].most_common():
            count = table["counts"][role][phase]
            mean = f"{cycles / count:.0f}" if count else "-"
            print(f"| {phase} | {100 * cycles / table['spans'][role]:.1f} % | {count} | {mean} |")
    return {"case": name, "ms": ms, "tflops": flops / ms / 1e9,
            **{key: table[key] for key in ("totals", "counts", "spans")}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--space", type=int, default=400, help="phases a warpgroup can record")
    p.add_argument("--reps", type=int, default=20, help="timed calls without the profiler")
    p.add_argument("--out", required=True, help="folder for the traces and profile.json")
    args = p.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    records = [profile(name, args.space, args.out, args.reps) for name in args.cases]
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                   "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
