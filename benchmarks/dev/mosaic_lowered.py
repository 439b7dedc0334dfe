"""The Mosaic GPU kernels that a set of calls lowers to, on a host without a GPU, compared
between revisions: which launches a change leaves as they were.

Each case's ``jit(grad)`` through `MosaicBlockSparse` (its deterministic backward) is lowered
for CUDA (``lower(lowering_platforms=("cuda",))``) with this host taken for an H200 (132
multiprocessors); nothing runs. For each launch (the forward, then dq, then dk/dv) it prints
a hash of its Mosaic module's text without source locations and the module's operation
count, and a hash of the program's constants (the layouts and work items the plan built).
Launches whose hashes match between two revisions are the same kernels on the GPU (with the
same JAX), so a change that keeps them and the constants needs no GPU run to keep their
speed. Each column (the working tree, each ``--revision``) runs in a copy of its package, in
a process of its own, with Equinox's run-time checks of per-call values off
(``EQX_ON_ERROR=off``): they are host callbacks, which JAX cannot lower for another
platform.

```
python benchmarks/dev/mosaic_lowered.py --revision HEAD~1
```
"""

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The launches of a case, in the order they lower.
LAUNCHES = ("forward", "dq", "dk/dv")

CASES = {
    "causal 4096": dict(mask="causal", shape=(1, 16, 16, 4096, 4096, 128)),
    "window 1024, 4096": dict(mask="window", shape=(1, 16, 16, 4096, 4096, 128)),
    "causal 2048, 4 kv heads": dict(mask="causal", shape=(1, 16, 4, 2048, 2048, 128)),
    "bottom-right causal, D=64, 1000 x 1500, soft cap": dict(
        mask="bottom_right", shape=(2, 4, 4, 1000, 1500, 64), soft_cap=30.0),
    "16 documents, 1024, B=32": dict(mask="causal", shape=(32, 16, 16, 1024, 1024, 128),
                                     documents=16),
    "causal 4096, ALiBi": dict(mask="causal", shape=(1, 16, 16, 4096, 4096, 128), alibi=True),
    "window 1024, 4096, ALiBi, soft cap": dict(mask="window", shape=(1, 16, 16, 4096, 4096, 128),
                                              alibi=True, soft_cap=30.0),
}


def lowered_kernels(case: dict) -> dict:
    """``{"constants": hash, "launches": [[hash, operations], ...]}`` of one case."""
    import jax
    import jax.experimental.mosaic.gpu.core as mosaic_core
    import jax.numpy as jnp

    import eqx_bsattn as bsa
    from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse
    from eqx_bsattn.strategies.kernels.mosaic import kernel as mosaic_kernel

    # The call's platform is JAX's default backend's (this process lowers and runs nothing).
    jax.default_backend = lambda: "gpu"
    mosaic_kernel._mosaic_missing = lambda: None
    mosaic_kernel._multiprocessors = lambda: 132
    masks = bsa.masks
    mask = {"causal": masks.Causal(), "bottom_right": masks.Causal(bottom_right=True),
            "window": masks.Causal() & masks.SlidingWindow(1024, 0)}[case["mask"]]
    batch, heads, kv_heads, q_len, kv_len, dim = case["shape"]
    attn = bsa.BlockSparseAttention(mask=mask, kernel=MosaicBlockSparse(deterministic=True),
                                    logits_soft_cap=case.get("soft_cap"),
                                    score=bsa.scores.ALiBi() if case.get("alibi") else None)
    q = jnp.ones((batch, heads, q_len, dim), jnp.bfloat16)
    k = jnp.ones((batch, kv_heads, kv_len, dim), jnp.bfloat16)
    data = {}
    if case.get("documents"):
        ids = jnp.repeat(jnp.arange(case["documents"], dtype=jnp.int32),
                         q_len // case["documents"])
        ids = jnp.broadcast_to(ids, (batch, q_len))
        data = dict(q_segment_ids=ids, kv_segment_ids=ids)
    loss = jax.jit(jax.grad(lambda q, k, v, d: jnp.sum(attn(q, k, v, **d).astype(jnp.float32)),
                            argnums=(0, 1, 2)))
    modules = []
    serde = mosaic_core._run_serde_pass

    def keep_text(module, *args, **kwargs):
        if kwargs.get("serialize"):  # the module as the launch carries it, before serialising
            modules.append(module.operation.get_asm(enable_debug_info=False))
        return serde(module, *args, **kwargs)

    mosaic_core._run_serde_pass = keep_text
    try:
        program = loss.trace(q, k, k, data).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        mosaic_core._run_serde_pass = serde
    if len(modules) != len(LAUNCHES):
        raise RuntimeError(f"{len(modules)} Mosaic launches lowered; expected "
                           f"{len(LAUNCHES)} (was the call given to another kernel?)")
    # The arrays the plan built (layouts, work items) enter the program as constants; their
    # order in it follows the order the plan built them in, so they are compared sorted.
    constants = "\n".join(sorted(re.findall(r"stablehlo\.constant (dense<.*?> : tensor<[^>]*>)",
                                            program)))

    def digest(text):
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    return {"constants": digest(constants),
            "launches": [[digest(m), len(re.findall(r"^\s*(?:%\S+ = )?\"?[a-z_]+\.", m, re.M))]
                         for m in modules]}


def package_copy(revision: str | None) -> str:
    """A folder holding the package as installed (`eqx_bsattn` with its `strategies`) at
    `revision`, or of the working tree (``None``)."""
    folder = tempfile.mkdtemp()
    if revision is None:
        for part in ("eqx_bsattn", "strategies"):
            shutil.copytree(os.path.join(ROOT, part), os.path.join(folder, part),
                            ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(["git", "-C", ROOT, "archive", revision, "eqx_bsattn",
                                  "strategies"], check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder, filter="data")
    os.rename(os.path.join(folder, "strategies"),
              os.path.join(folder, "eqx_bsattn", "strategies"))
    return folder


def column(revision: str | None) -> dict:
    """Every case's `lowered_kernels`, in a process of its own on `package_copy`."""
    folder = package_copy(revision)
    try:
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--json"],
                             capture_output=True, text=True, check=False,
                             env={**os.environ, "PYTHONPATH": folder, "EQX_ON_ERROR": "off"})
        lines = run.stdout.strip().splitlines()
        if run.returncode or not lines:
            raise SystemExit(f"{revision or 'working tree'}: "
                             f"{(run.stderr.strip().splitlines() or ['no output'])[-1]}")
        found = json.loads(lines[-1])
        if not found["package"].startswith(folder):
            raise SystemExit(f"{revision or 'working tree'}: imported {found['package']}, "
                             f"not the copy in {folder}")
        return found
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def all_cases() -> dict:
    import jax

    import eqx_bsattn

    found = {"package": eqx_bsattn.__file__, "jax": jax.__version__, "cases": {}}
    for name, case in CASES.items():
        try:
            found["cases"][name] = lowered_kernels(case)
        except Exception as e:  # noqa: BLE001 - reported in its row
            found["cases"][name] = {
                "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"}
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--revision", nargs="*", default=[],
                   help="git revisions to compare the working tree with")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.json:
        print(json.dumps(all_cases()))
        return
    columns = {r: column(r) for r in args.revision}
    columns["working tree"] = column(None)
    versions = sorted({c["jax"] for c in columns.values()})
    print(f"jax {', '.join(versions)}, lowered for CUDA; a launch: hash (operations), = where "
          "it matches the first column")
    print("| case | part | " + " | ".join(columns) + " |")
    print("| --- | --- |" + " --- |" * len(columns))
    for name in CASES:
        found = [c["cases"][name] for c in columns.values()]
        if any("error" in f for f in found):
            print(f"| {name} | | " + " | ".join(f.get("error", "") for f in found) + " |")
            continue
        for i, part in enumerate(("constants",) + LAUNCHES):
            cells = [f["constants"] if i == 0 else "{} ({})".format(*f["launches"][i - 1])
                     for f in found]
            marks = [cells[0]] + ["=" if c == cells[0] else c for c in cells[1:]]
            print(f"| {name} | {part} | " + " | ".join(marks) + " |")


if __name__ == "__main__":
    main()
