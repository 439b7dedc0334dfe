"""The Mosaic GPU kernels that a set of calls lowers to, on a host without a GPU, compared
between revisions: which launches a change leaves as they were.

Each case's ``jit(grad)`` through `MosaicBlockSparse` (its deterministic backward) is lowered
for CUDA (``lower(lowering_platforms=("cuda",))``) with this host taken for an H200 (132
multiprocessors); nothing runs. For each launch (the forward, then dq, then dk/dv) it prints
a hash of its Mosaic module's text without source locations and the module's operation
count, and a hash of the program's constants (the layouts and work items the plan built).
Launches whose hashes match between two revisions are the same kernels on the GPU (with the
same JAX), so a change that keeps them and the constants needs no GPU run to keep their
speed. The working tree is one column; each ``--revision`` runs in a copy of
that revision's package, in a process of its own. ALiBi is not among the cases: its slopes'
run-time check is a host callback, which JAX cannot lower for another platform.

```
python benchmarks/mosaic_lowered.py --revision HEAD~1
```
"""

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile

CASES = {
    "causal 4096": dict(mask="causal", shape=(1, 16, 16, 4096, 4096, 128)),
    "window 1024, 4096": dict(mask="window", shape=(1, 16, 16, 4096, 4096, 128)),
    "causal 2048, 4 kv heads": dict(mask="causal", shape=(1, 16, 4, 2048, 2048, 128)),
    "bottom-right causal, D=64, 1000 x 1500, soft cap": dict(
        mask="bottom_right", shape=(2, 4, 4, 1000, 1500, 64), soft_cap=30.0),
    "16 documents, 1024, B=32": dict(mask="causal", shape=(32, 16, 16, 1024, 1024, 128),
                                     documents=16),
}


def lowered_kernels(case: dict) -> dict:
    """``{"constants": hash, "launches": [[hash, operations], ...]}`` of one case."""
    import jax
    import jax.experimental.mosaic.gpu.core as mosaic_core
    import jax.numpy as jnp

    import eqx_bsattn as bsa
    import eqx_bsattn._module as module_internals
    from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse
    from eqx_bsattn.strategies.kernels.mosaic import kernel as mosaic_kernel

    module_internals.default_platform = lambda: "gpu"
    mosaic_kernel._mosaic_missing = lambda: None
    mosaic_kernel._multiprocessors = lambda: 132
    modules = []
    serde = mosaic_core._run_serde_pass

    def keep_text(module, serialize, **kwargs):
        if serialize:  # the module as the launch will carry it, before it is serialised
            modules.append(module.operation.get_asm(enable_debug_info=False))
        return serde(module, serialize=serialize, **kwargs)

    mosaic_core._run_serde_pass = keep_text
    masks = bsa.masks
    mask = {"causal": masks.Causal(), "bottom_right": masks.Causal(bottom_right=True),
            "window": masks.Causal() & masks.SlidingWindow(1024, 0)}[case["mask"]]
    batch, heads, kv_heads, q_len, kv_len, dim = case["shape"]
    attn = bsa.BlockSparseAttention(mask=mask, kernel=MosaicBlockSparse(deterministic=True),
                                    logits_soft_cap=case.get("soft_cap"))
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
    program = loss.trace(q, k, k, data).lower(lowering_platforms=("cuda",)).as_text()
    # The arrays the plan built (layouts, work items) enter the program as constants; their
    # order in it follows the order the plan built them in, so they are compared sorted.
    constants = "\n".join(sorted(re.findall(r"stablehlo\.constant (dense<.*?> : tensor<[^>]*>)",
                                            program)))

    def digest(text):
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    return {"constants": digest(constants),
            "launches": [[digest(m), len(re.findall(r"^\s*(?:%\S+ = )?\"?[a-z_]+\.", m, re.M))]
                         for m in modules]}


def at_revision(revision: str) -> dict:
    """`lowered_kernels` of every case, run in a copy of `revision`'s package."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = tempfile.mkdtemp()
    archive = subprocess.run(["git", "-C", root, "archive", revision, "eqx_bsattn",
                              "strategies"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    # The package as installed: the strategies are its subpackage.
    os.rename(os.path.join(folder, "strategies"),
              os.path.join(folder, "eqx_bsattn", "strategies"))
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--json"],
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": folder}, check=False)
    if run.returncode:
        raise SystemExit(f"{revision}: {run.stderr.strip().splitlines()[-1]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def all_cases() -> dict:
    found = {}
    for name, case in CASES.items():
        try:
            found[name] = lowered_kernels(case)
        except Exception as e:  # noqa: BLE001 - reported in its row
            found[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
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
    columns = {f"{r}": at_revision(r) for r in args.revision}
    columns["working tree"] = all_cases()
    import jax
    print(f"jax {jax.__version__}, lowered for CUDA on {jax.default_backend()}; a launch: "
          "hash (operations), = where it matches the first column")
    print("| case | part | " + " | ".join(columns) + " |")
    print("| --- | --- |" + " --- |" * len(columns))
    for name in CASES:
        found = [columns[c][name] for c in columns]
        if any("error" in f for f in found):
            print(f"| {name} | | " + " | ".join(f.get("error", "") for f in found) + " |")
            continue
        parts = ["constants"] + ["forward", "dq", "dk/dv"][:len(found[0]["launches"])]
        for i, part in enumerate(parts):
            cells = [f["constants"] if i == 0 else "{} ({})".format(*f["launches"][i - 1])
                     for f in found]
            marks = [cells[0]] + ["=" if c == cells[0] else c for c in cells[1:]]
            print(f"| {name} | {part} | " + " | ".join(marks) + " |")


if __name__ == "__main__":
    main()
