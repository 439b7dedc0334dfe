"""`MosaicBlockSparse`'s forward or backward at another git revision against the working
tree's, both in one process (Hopper GPU only).

Run-to-run spread on a lent GPU is often larger than a kernel change, so a change is judged
here against the kernel before it in the same process: the kernel module of ``--base``
(``strategies/kernels/mosaic/forward.py``, or ``backward.py`` with ``--backward``) is loaded
beside the working tree's, each is jitted through `MosaicBlockSparse` (the rest of the
package is the working tree's), and the two are timed in interleaved rounds (``--rounds``
rounds of ``--reps`` calls each). Prints TF/s (visible pairs only) per case as median / best
over the rounds: the forward's, or with ``--backward`` forward+backward's (3.5 times the
forward's FLOPs) in the mode ``--mode`` names. A base must be in the checkout's history (a
copy of the working tree on another machine may carry only HEAD and its ancestors), or the
path of a copy of the module's file.

```
python benchmarks/dev/mosaic_ab.py --base HEAD~1
python benchmarks/dev/mosaic_ab.py --base main --cases document:2:16384 window:32:1024
python benchmarks/dev/mosaic_ab.py --base HEAD other-branch --backward --mode single_pass
python benchmarks/dev/mosaic_ab.py --base HEAD --alibi --cases causal:2:16384 window:2:16384
```

`--alibi` adds ALiBi (the standard slopes) to every call; `--kv-heads` gives K and V fewer
heads than Q (GQA). A base's `dkv_call` builds its own schedule, and where it returns dk
and dv per query head (before the launch summed a group itself) they are summed per kv head
here, in float32, as the kernel did then. A base's launches take the working tree's
configuration in their revision's class (`_as_base_config`): persistent where the working
tree's launch of that name is, so both sides run the same way.
"""

import argparse
import dataclasses
import functools
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import eqx_bsattn as bsa
import eqx_bsattn.strategies.kernels.mosaic.kernel as mosaic_kernel
from eqx_bsattn.bench import median_ms, pattern, visible_pairs
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse

#: The module of each pass, and the names `kernel.py` imports from it (looked up when traced).
PASSES = {"forward": ("forward", ("forward_call",)),
          "backward": ("backward", ("dq_call", "dkv_call"))}
MODES = {"deterministic": True, "single_pass": False}


def launches_at(revision: str, module_name: str, names, number: int = 0) -> dict:
    """The launch functions `names` of the Mosaic module `module_name` at git `revision` (or
    in the file of that path), imported as a module of the installed package (so that its
    relative imports resolve to the working tree's). The backward's launches take the working
    tree's configuration in their revision's class (`_as_base_config`), and every launch is
    called without the keyword arguments its revision does not take yet (`_tolerant`)."""
    if os.path.isfile(revision):  # a copy of the module's file instead of a revision
        with open(revision) as f:
            source = f.read()
    else:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        source = subprocess.run(
            ["git", "-C", root, "show",
             f"{revision}:strategies/kernels/mosaic/{module_name}.py"],
            check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), f"{module_name}_base{number}.py")
    with open(path, "w") as f:
        f.write(source)
    name = f"eqx_bsattn.strategies.kernels.mosaic.{module_name}_base{number}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    launches = {n: _tolerant(getattr(module, n)) for n in names}
    if module_name == "backward":
        launches = {n: _with_base_config(module, f, "dq" if n == "dq_call" else "dkv")
                    for n, f in launches.items()}
        launches["dkv_call"] = _summed_per_kv_head(launches["dkv_call"])
    return launches


def _as_base_config(module, cfg, launch: str):
    """The working tree's backward configuration `cfg` as the base `module`'s own class: the
    fields that class has; where it has one persistence flag for both launches (a revision
    before the choice per launch), the flag of `launch` (``"dq"`` or ``"dkv"``)."""
    base = module.BackwardConfig
    fields = {f.name: f for f in dataclasses.fields(base)}
    values = {name: getattr(cfg, name) for name in fields if hasattr(cfg, name)}
    if isinstance(fields["persistent"].default, bool):
        values["persistent"] = launch in cfg.persistent
    return base(**values)


def _with_base_config(module, launch_fn, launch: str):
    """`launch_fn` of the base `module`, given its configuration in the module's class."""

    @functools.wraps(launch_fn)
    def call(cfg, *args, **kwargs):
        return launch_fn(_as_base_config(module, cfg, launch), *args, **kwargs)

    return call


def _summed_per_kv_head(dkv_call):
    """`dkv_call`, its dk and dv summed over each kv head's group of query heads where the
    launch returns them per query head (a revision before the launch summed them). It builds
    its own schedule: the working tree's may number its work items otherwise."""

    @functools.wraps(dkv_call)
    def call(cfg, q, k, v, *args, schedule=None, **kwargs):
        del schedule
        dk, dv, *rest = dkv_call(cfg, q, k, v, *args, **kwargs)
        if dk.shape[1] != k.shape[1]:
            dk, dv = (mosaic_kernel.summed_per_kv_head(x, k.shape[1]) for x in (dk, dv))
        return (dk, dv, *rest)

    return call


def _tolerant(launch):
    """`launch`, dropping the keyword arguments that its revision does not take yet (such as
    a persistent launch's ``schedule``, which an older launch builds itself or lacks)."""
    accepted = inspect.signature(launch).parameters

    @functools.wraps(launch)
    def call(*args, **kwargs):
        return launch(*args, **{k: v for k, v in kwargs.items() if k in accepted})

    return call


def set_launches(launches: dict):
    for name, fn in launches.items():
        setattr(mosaic_kernel, name, fn)


def compare(cases, bases, rounds: int, reps: int, heads: int, dim: int,
            backward: bool = False, mode: str = "deterministic", alibi: bool = False,
            kv_heads: int | None = None):
    module_name, names = PASSES["backward" if backward else "forward"]
    working = {n: getattr(mosaic_kernel, n) for n in names}
    calls = {f"base ({rev})": launches_at(rev, module_name, names, i)
             for i, rev in enumerate(bases)}
    calls["working tree"] = working
    kernel = MosaicBlockSparse(deterministic=MODES[mode])
    what = f"Forward+backward ({mode}) TF/s" if backward else "Forward TF/s"
    if alibi:
        what += " with ALiBi"
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    kv_heads = kv_heads or heads
    print(f"\n{what}, H={heads} H_kv={kv_heads} D={dim} bfloat16, median / best of {rounds} "
          f"rounds")
    print("| pattern | L | B | " + " | ".join(calls) + " |")
    print("| --- | --- | --- |" + " --- |" * len(calls))
    try:
        for case in cases:
            name, batch, length = case.split(":")
            batch, length = int(batch), int(length)
            mask, data = pattern(name, length, window=1024 if length > 2048 else 256)
            flops = 4.0 * batch * heads * dim * visible_pairs(
                mask, length, length, data.get("q_segment_ids"))
            if backward:
                flops *= 3.5
            keys = jax.random.split(jax.random.key(length), 4)
            q, k, v, do = (jax.random.normal(key, (batch, n, length, dim), jnp.bfloat16)
                           for key, n in zip(keys, (heads, kv_heads, kv_heads, heads)))
            per_call = {n: jnp.broadcast_to(jnp.asarray(x), (batch, length))
                        for n, x in data.items()}
            fns = {}
            for label, launches in calls.items():
                # The kernel looks its launches up when it is traced: trace each here.
                set_launches(launches)
                attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel,
                                                score=bsa.scores.ALiBi() if alibi else None)
                fn = lambda q, k, v, attn=attn: attn(q, k, v, **per_call)  # noqa: E731
                if backward:
                    fn = lambda q, k, v, f=fn: jax.vjp(f, q, k, v)[1](do)  # noqa: E731
                fn = jax.jit(fn)
                jax.block_until_ready(fn(q, k, v))
                fns[label] = fn
            set_launches(working)
            times = {label: [] for label in fns}
            for _ in range(rounds):
                for label, fn in fns.items():
                    times[label].append(median_ms(fn, (q, k, v), reps, warmup=1))
            cells = [f"{flops / np.median(ms) / 1e9:.1f} / {flops / np.min(ms) / 1e9:.1f}"
                     for ms in times.values()]
            print(f"| {name} | {length} | {batch} | " + " | ".join(cells) + " |", flush=True)
    finally:
        set_launches(working)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", nargs="+", default=["HEAD"],
                   help="git revisions of the kernel to compare with, or paths of module files")
    p.add_argument("--backward", action="store_true",
                   help="compare the backward module, timing forward+backward")
    p.add_argument("--mode", default="deterministic", choices=list(MODES),
                   help="the backward's mode (with --backward)")
    p.add_argument("--cases", nargs="+", default=[
        "causal:2:16384", "window:2:16384", "document:2:16384", "causal:32:1024",
        "window:32:1024", "document:32:1024"], help="pattern:batch:length")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--alibi", action="store_true", help="ALiBi in every call")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="heads of K and V (GQA; default: --heads)")
    args = p.parse_args()
    compare(args.cases, args.base, args.rounds, args.reps, args.heads, args.dim, args.backward,
            args.mode, args.alibi, args.kv_heads)


if __name__ == "__main__":
    main()
