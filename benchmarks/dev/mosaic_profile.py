"""Where the time of `MosaicBlockSparse`'s launches goes, per warpgroup, from Mosaic GPU's
on-device profiler (Hopper GPU only): the forward, the backward's dq kernel and dk/dv kernel,
and the single pass (the dk/dv kernel with its dq partials).

Each launch's phases are named scopes. The forward's compute warpgroups: `entry`, `wait_q`,
`turn_qk`, `wait_qk`, `softmax_full`, `softmax_partial`, `turn_pv`, `pv`, `turn_end`,
`epilogue`. The backward's: `wait_kv` or `wait_q` (a streamed tile's barrier), `load_rows` (the
block's log-sum-exp and delta from global memory), `products` (S and dP in the dq kernel, S
alone in the dk/dv kernel), `softmax_full` or `softmax_partial` (P, and dS in the dq kernel),
`accumulate` (the dq kernel's dq), the dk/dv kernel's `dv_dp` (dv and dP), `ds` and `dk`, the
single pass's `ds_store`, `ds_barrier`, `dq_product`, `stage_wait`, `stage_store`,
`reduce_add`, and `epilogue`. The memory warpgroup's: `wait_free`, `copy`. This script
compiles each launch with the profiler switched on (a trace per call, written as Perfetto
JSON under ``--out``), and prints each
phase's share of the warpgroups' time, its count and its mean length in SM cycles.
"(uncovered)" is time outside every named phase (loop bookkeeping, barrier arrivals, the
profiler's own records). Shapes are kept small, because each warpgroup records at most
``--space`` phases.

```
python benchmarks/dev/mosaic_profile.py --out mosaic-profile
python benchmarks/dev/mosaic_profile.py --launches dkv single_pass --cases causal --out mosaic-profile
python benchmarks/dev/mosaic_profile.py --launches forward --cases window --alibi --out mosaic-profile
```

`--alibi` adds ALiBi with the standard slopes to every launch (the dk/dv kernel and the
single pass then also sum the slopes' gradient rows).
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
from eqx_bsattn.strategies.kernels.mosaic.backward import (BackwardConfig, backward_blocks,
                                                        dkv_call, dq_accumulator_shape, dq_call)
from eqx_bsattn.strategies.kernels.mosaic.forward import ForwardConfig, forward_call

CASES = {
    # name: (pattern, batch, heads, length, window)
    "short-causal": ("causal", 4, 16, 1024, 256),
    "window": ("window", 1, 4, 16384, 1024),
    "documents": ("document", 1, 4, 16384, 1024),
    "causal": ("causal", 1, 4, 4096, 1024),
    "causal-2k": ("causal", 1, 8, 2048, 1024),  # the backward's causal: fewer blocks a tile
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


LAUNCHES = ("forward", "dq", "dkv", "single_pass")
#: Block products per visible block of each launch (its FLOPs: 2 D per product and pair).
PRODUCTS = {"forward": 2, "dq": 3, "dkv": 4, "single_pass": 5}


def launch_functions(name: str, alibi: bool = False):
    """``({launch: (function, arguments)}, visible pairs, (B, H, L, D))`` for one case, with
    ALiBi's standard slopes where `alibi`."""
    kind, batch, heads, length, window = CASES[name]
    dim = 128
    mask, data = pattern(kind, length, window=window)
    seg = data.get("q_segment_ids")
    per_call = {}
    if seg is not None:
        ids = jnp.broadcast_to(jnp.asarray(seg, jnp.int32), (batch, length))
        per_call = {"q_segment_ids": ids, "kv_segment_ids": ids}
    resolved = bsa.ResolvedMask(mask, q_len=length, kv_len=length, num_heads=heads, **per_call)
    segments = [per_call["q_segment_ids"], per_call["kv_segment_ids"]] if per_call else []

    def lists(layout, transposed=False):
        names = ("full_count", "full_index", "partial_count", "partial_index")
        return [jnp.asarray(getattr(layout, ("t_" if transposed else "") + n), jnp.int32)
                for n in names]

    layout = resolved.layout(128, 128)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (batch, heads, length, dim), jnp.bfloat16)
                   for key in keys)
    shape = dict(batch=batch, heads=heads, kv_heads=heads, q_len=length, kv_len=length,
                 true_kv_len=length, head_dim=dim, softmax_scale=dim ** -0.5)
    fcfg = ForwardConfig(**shape, terms=resolved.kernel_terms([(128, 128)]), block_kv=128,
                         stages=2, layout_batch=layout.full_count.shape[0],
                         layout_heads=layout.full_count.shape[1],
                         ctas=jax.devices()[0].core_count, alibi=alibi)
    slopes = jnp.asarray(bsa.scores.alibi_slopes(heads)) if alibi else None
    forward_args = (q, k, v, *lists(layout), *segments)
    launches = {"forward": (lambda *a: forward_call(fcfg, *a, slopes=slopes)[0],
                            forward_args)}
    out, lse = jax.jit(lambda *a: forward_call(fcfg, *a, slopes=slopes))(*forward_args)
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    (dq_q, dq_k), (dkv_q, dkv_k) = backward_blocks(dim)
    dq_layout, dkv_layout = resolved.layout(dq_q, dq_k), resolved.layout(dkv_q, dkv_k)
    bcfg = BackwardConfig(**shape, terms=resolved.kernel_terms([(dq_q, dq_k), (dkv_q, dkv_k)]),
                          dq_block_kv=dq_k, dkv_block_q=dkv_q,
                          dq_layout_axes=dq_layout.full_count.shape[:2],
                          dkv_layout_axes=dkv_layout.full_count.shape[:2], alibi=alibi)
    operands = (q, k, v, do, lse, delta)
    t_lists = lists(dkv_layout, transposed=True)

    def single_pass(*a):
        accumulator = jax.new_ref(jnp.zeros(dq_accumulator_shape(bcfg, False), jnp.float32))
        grads = dkv_call(bcfg, *a, dq_accumulator=accumulator, slopes=slopes)
        return *grads, jax.freeze(accumulator)

    launches["dq"] = (lambda *a: dq_call(bcfg, *a, slopes=slopes),
                      (*operands, *lists(dq_layout), *segments))
    launches["dkv"] = (lambda *a: dkv_call(bcfg, *a, slopes=slopes),
                       (*operands, *t_lists, *segments))
    launches["single_pass"] = (single_pass, (*operands, *t_lists, *segments))
    return launches, visible_pairs(mask, length, length, seg), (batch, heads, length, dim)


def profile(name: str, launch: str, function, args, pairs, dims, space: int, out: str,
            reps: int) -> dict:
    batch, heads, length, dim = dims
    flops = 2.0 * PRODUCTS[launch] * batch * heads * dim * pairs
    ms = median_ms(jax.jit(function), args, reps, warmup=2)
    directory = os.path.join(out, f"{name}-{launch}")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    with profiler(space, directory):  # a new function: the timed one's program is cached
        jax.block_until_ready(jax.jit(lambda *a: function(*a))(*args))
    [path] = glob.glob(os.path.join(directory, "*-trace.json"))
    with open(path) as f:
        table = phase_table(json.load(f))
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(path)
    spans = table["cta_spans"]
    print(f"\n## {name}, {launch}: B={batch} H={heads} L={length} D={dim}: {ms:.3f} ms, "
          f"{flops / ms / 1e9:.1f} TF/s ({PRODUCTS[launch]} products a block) without the "
          f"profiler; CTA spans (cycles) min / median / max {spans[0]:.0f} / "
          f"{np.median(spans):.0f} / {spans[-1]:.0f}")
    for role in ("compute", "memory"):
        print(f"\n| {role} phase | share | count | mean cycles |\n| --- | --- | --- | --- |")
        for phase, cycles in table["totals"][role].most_common():
            count = table["counts"][role][phase]
            mean = f"{cycles / count:.0f}" if count else "-"
            print(f"| {phase} | {100 * cycles / table['spans'][role]:.1f} % | {count} | {mean} |")
    return {"case": name, "launch": launch, "ms": ms, "tflops": flops / ms / 1e9,
            **{key: table[key] for key in ("totals", "counts", "spans")}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--launches", nargs="+", default=list(LAUNCHES), choices=LAUNCHES)
    p.add_argument("--space", type=int, default=400, help="phases a warpgroup can record")
    p.add_argument("--reps", type=int, default=20, help="timed calls without the profiler")
    p.add_argument("--out", required=True, help="folder for the traces and profile.json")
    p.add_argument("--alibi", action="store_true", help="ALiBi in every launch")
    args = p.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    records = []
    for name in args.cases:
        launches, pairs, dims = launch_functions(name, args.alibi)
        for launch in args.launches:
            function, operands = launches[launch]
            try:
                records.append(profile(name, launch, function, operands, pairs, dims,
                                       args.space, args.out, args.reps))
            except ValueError as error:  # e.g. the profiler's records overflow shared memory
                print(f"\n## {name}, {launch}: not profiled: {str(error).splitlines()[0]}")
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                   "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
