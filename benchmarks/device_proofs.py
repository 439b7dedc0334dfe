"""Every kernel feature that waits for a device run (`AbstractKernel.awaiting_device_run`),
proven on one lent device by one command, from the repository root:

    bash benchmarks/device_proofs.sh gpu [seconds]     # an H200; ./.whl carried
    bash benchmarks/device_proofs.sh tpu [seconds]     # a TPU v5e; ./.whl-tpu carried

(the script installs the carried wheels, then runs ``python3 benchmarks/device_proofs.py
--device gpu|tpu``). The features of that device run; in order, each stage within what is
left of `--budget` seconds, each in a process of its own (on a TPU one program at a time can
hold the chip, so this one never opens it):

1. the header of the log: the commit (and whether the tree differs from it), the GPU, the
   versions, and each kernel's record of features awaiting a device run;
2. the device tests of every awaiting feature and their conformance cases (`PROOFS`), in one
   pytest run with ``--prove-awaiting`` (the features taken as proven for that run), against
   the float32 / float64 references, forward and every gradient; a JUnit file gives each
   feature its own count of passed and failed tests;
3. the timings that decide whether the selector should use each feature (`TIMINGS`), each in
   a child process that takes the features as proven, beside the peers of the same run;
4. with the time left, the rest of the kernels' suites on that device (`REGRESSION`: what a
   feature could have broken).

Everything goes to ``$OUT/device_proofs.log`` (default ``./bench_out``), the verdicts to
``$OUT/device_proofs.json``; the timings' records to ``$OUT/<timing>.json``. The change that
lifts a decline cites the log (or a run of it at a named commit in
``../shared/device-runs/``). A CPU test (tests/test_device_proofs.py) keeps `PROOFS` equal to
the kernels' records, so no pending feature is left out of the command.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from typing import NamedTuple


class Proof(NamedTuple):
    """What proves one awaiting feature: the device it waits for (``"gpu"``, ``"tpu"``), its
    test files (on a GPU their ``gpu`` tests) and the ``-k`` expression of its conformance
    cases."""

    device: str
    tests: tuple[str, ...]
    conformance: str


#: ``(kernel class name, feature): Proof``, one per key of the kernels' `awaiting_device_run`.
PROOFS = {
    ("MosaicBlockSparse", "t5_table"): Proof(
        "gpu", ("tests/kernels/mosaic/test_mosaic_table_gpu.py",),
        "mosaic and score_relative"),
    ("MosaicBlockSparse", "head_dim_256"): Proof(
        "gpu", ("tests/kernels/mosaic/test_mosaic_head_dim_256.py",),
        "mosaic and head_dim_256"),
    ("MosaicBlockSparse", "padded_head_dims"): Proof(
        "gpu", ("tests/kernels/mosaic/test_mosaic_padded_head_dims.py",),
        "mosaic and (head_dim_80 or head_dim_96 or head_dim_192 or value_dim or everything)"),
    ("CudnnDense", "wide_heads"): Proof(
        "gpu", ("tests/kernels/cudnn/test_cudnn_gpu.py",),
        "cudnn and (head_dim_192 or head_dim_256)"),
    ("PallasTpuBlockSparse", "bias"): Proof(
        "tpu", ("tests/kernels/pallas_tpu/test_pallas_tpu_bias.py",),
        "pallas_tpu and bias"),
}

_BENCH = ["-m", "eqx_bsattn.bench", "--lengths", "16384", "--patterns", "causal", "window",
          "--batch", "2", "--heads", "16", "--dtype", "bfloat16", "--window", "1024",
          "--reps", "10", "--platform", "gpu", "--gqa-kv-heads", "0",
          "--kernels", "MosaicBlockSparse", "CudnnDense", "TritonBlockSparse"]

#: ``name: (features it decides on, seconds at most, argv after python3)``; each may write
#: ``$OUT/<name>.json`` (``{out}`` in its argv).
TIMINGS = {
    "t5_table": ((("MosaicBlockSparse", "t5_table"),), 110,
                 ["benchmarks/score_terms_gpu.py", "--kernel", "MosaicBlockSparse",
                  "TritonBlockSparse", "--masks", "causal", "window", "--scores", "none",
                  "relative", "--no-flex", "--reps", "10", "--rounds", "2", "--out", "{out}"]),
    "d256": ((("MosaicBlockSparse", "head_dim_256"), ("CudnnDense", "wide_heads")), 100,
             _BENCH + ["--dim", "256", "--out", "{out}"]),
    "d96": ((("MosaicBlockSparse", "padded_head_dims"),), 80,
            _BENCH + ["--dim", "96", "--out", "{out}"]),
    "d64_dv128": ((("MosaicBlockSparse", "padded_head_dims"),), 80,
                  _BENCH + ["--dim", "64", "--value-dim", "128", "--out", "{out}"]),
    # A [1, H, L, L] bias at 8k (B=1, H=16, D=128, bfloat16) beside the same call without
    # it and beside XlaBlockSparse with it, and one read of it at the chip's bandwidth.
    "tpu_bias": ((("PallasTpuBlockSparse", "bias"),), 240,
                 ["benchmarks/splash_tpu.py", "--skip-errors", "--skip-splash", "--pallas",
                  "--reps", "10", "--only", "pallas_tpu causal", "bias"]),
}

#: The rest of each device's suites, with the time left: the kernels' own tests there and
#: their conformance cases (``-k``) but those `PROOFS` ran.
REGRESSION = {
    "gpu": (("tests/kernels/mosaic/test_mosaic_gpu.py",
             "tests/kernels/mosaic/test_mosaic_bias_gpu.py",
             "tests/kernels/mosaic/test_mosaic_data_gpu.py"), "mosaic"),
    "tpu": (("tests/kernels/pallas_tpu/test_pallas_tpu.py",
             "tests/kernels/pallas_tpu/test_pallas_tpu_function_data.py",
             "tests/kernels/pallas_tpu/test_pallas_tpu_grid.py"), "pallas_tpu"),
}


def awaiting() -> dict[tuple[str, str], str]:
    """Every registered kernel's features awaiting a device run: ``{(kernel, feature):
    what it is}``."""
    import eqx_bsattn

    return {(kernel.__name__, feature): what
            for kernel in eqx_bsattn.registered_kernels()
            for feature, what in kernel.awaiting_device_run.items()}


def take_all_as_proven() -> None:
    """For this process: every kernel's awaiting features taken as proven (a timing child)."""
    import types

    import eqx_bsattn

    for kernel in eqx_bsattn.registered_kernels():
        type.__setattr__(kernel, "awaiting_device_run", types.MappingProxyType({}))


class Log:
    """The one log: each line printed and appended to ``device_proofs.log``."""

    def __init__(self, path: str):
        self.path = path
        open(path, "w").close()

    def __call__(self, *lines: str) -> None:
        with open(self.path, "a") as f:
            for line in lines:
                print(line, flush=True)
                f.write(line + "\n")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _run(argv: list[str], seconds: float, log: Log, env=None) -> tuple[int, float]:
    """Run `argv` for at most `seconds`; its output goes into the log. ``(exit status (124 on
    timeout), seconds taken)``."""
    start = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=max(1, seconds),
                              env=env)
        status, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        status = 124
        output = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                  else (e.stdout or "")) + "\n(stopped at its time limit)"
    log(*output.rstrip().splitlines())
    return status, time.monotonic() - start


def _feature_of(nodeid: str) -> tuple[str, str] | None:
    """Which `PROOFS` feature a test belongs to (a conformance case: by its kernel and case)."""
    for key, proof in PROOFS.items():
        if any(nodeid.startswith(path.removesuffix(".py").replace("/", "."))
               or nodeid.startswith(path) for path in proof.tests):
            return key
    if "test_kernel_conforms" in nodeid:
        for key, proof in PROOFS.items():
            if _matches_k(proof.conformance, nodeid):
                return key
    return None


def _matches_k(expression: str, nodeid: str) -> bool:
    """Whether a ``-k`` expression of names, ``and``, ``or``, ``not`` and brackets takes
    `nodeid` (pytest's rule: a name matches as a substring)."""
    words = expression.replace("(", " ( ").replace(")", " ) ").split()
    python = " ".join(w if w in ("and", "or", "not", "(", ")") else repr(w in nodeid)
                      for w in words)
    return bool(eval(python))  # only True, False and the operators above


def _junit_results(path: str) -> list[tuple[str, str]]:
    """``[(nodeid, "passed" | "failed" | "skipped"), ...]`` from a pytest JUnit file."""
    results = []
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return results
    for case in root.iter("testcase"):
        nodeid = f"{case.get('classname', '')}::{case.get('name', '')}"
        tags = {child.tag for child in case}
        verdict = ("failed" if tags & {"failure", "error"} else
                   "skipped" if "skipped" in tags else "passed")
        results.append((nodeid, verdict))
    return results


def _device_facts(log: Log) -> tuple[list[str], str]:
    """``(devices, jax version)``, read by a child process (which lets go of the device)."""
    code = ("import jax; print(repr([str(getattr(d, 'device_kind', d)) for d in jax.devices()])); "
            "print(jax.default_backend()); print(jax.__version__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240)
    lines = done.stdout.strip().splitlines()
    if done.returncode or len(lines) < 3:
        log("could not read the devices:", *done.stderr.strip().splitlines()[-5:])
        return [], ""
    return [*eval(lines[-3]), f"backend {lines[-2]}"], lines[-1]


def _pytest(device: str, workers: int) -> list[str]:
    """The start of a pytest command line on `device` (on a TPU, one process: one program at
    a time can hold the chip)."""
    line = [sys.executable, "-m", "pytest", "--extended", "--prove-awaiting", "-p",
            "no:cacheprovider", "-q", "-rfE"]
    if device == "gpu":
        return line + ["-m", "gpu", "-n", str(workers)]
    return line + ["-p", "no:xdist"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("gpu", "tpu"), default="gpu",
                   help="the device whose awaiting features to prove (default: gpu)")
    p.add_argument("--budget", type=float, default=560,
                   help="seconds for all stages together (default: %(default)s)")
    p.add_argument("--workers", type=int, default=8, help="pytest workers on a GPU (default: 8)")
    p.add_argument("--commit", default=None,
                   help="the commit the tree is (default: git's HEAD, where git is there)")
    p.add_argument("--time", default=None, choices=list(TIMINGS),
                   help=argparse.SUPPRESS)  # a timing child: run that timing, features proven
    args = p.parse_args(argv)
    out = os.environ.get("OUT") or os.path.join(os.getcwd(), "bench_out")
    os.makedirs(out, exist_ok=True)

    if args.time is not None:
        import runpy

        take_all_as_proven()
        script = TIMINGS[args.time][2]
        argv = [a.replace("{out}", os.path.join(out, f"{args.time}.json")) for a in script]
        sys.argv = [argv[1], *argv[2:]] if argv[0] == "-m" else argv
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__")
        else:
            runpy.run_path(argv[0], run_name="__main__")
        return 0

    start = time.monotonic()
    left = lambda: args.budget - (time.monotonic() - start)  # noqa: E731
    log = Log(os.path.join(out, "device_proofs.log"))
    pending = awaiting()
    commit = args.commit or _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no") if not args.commit else ""
    devices, jax_version = _device_facts(log)
    log(f"commit {commit or '(unknown)'}"
        f"{' (with uncommitted changes to tracked files)' if dirty else ''}",
        f"device {args.device}: {devices}; jax {jax_version}; python {sys.version.split()[0]}",
        "features awaiting a device run:",
        *(f"  {kernel}.{feature}: {what}" for (kernel, feature), what in pending.items()))
    summary = {"commit": commit, "dirty": bool(dirty), "device": args.device,
               "devices": devices, "jax": jax_version, "awaiting": [list(k) for k in pending],
               "features": {}, "timings": {}}
    missing = set(pending) - set(PROOFS)
    if missing:
        log(f"no proof is declared for {sorted(missing)} (PROOFS): their tests do not run")
    if f"backend {args.device}" not in devices:
        log(f"no {args.device} here: its tests would skip and prove nothing; stopping.")
        return 1

    proofs = {key: PROOFS[key] for key in pending
              if key in PROOFS and PROOFS[key].device == args.device}
    files = sorted({path for proof in proofs.values() for path in proof.tests})
    conformance = " or ".join(f"({proof.conformance})" for proof in proofs.values())
    junit = os.path.join(out, "proof_tests.xml")
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if proofs:
        log("", f"== the tests of {len(proofs)} awaiting features and their conformance cases")
        status, took = _run(
            [*_pytest(args.device, args.workers), *files, "tests/test_conformance.py",
             "-k", f"not test_kernel_conforms or {conformance}", f"--junitxml={junit}"],
            min(330, left() - 150), log, env)
        log(f"tests: exit status {status} in {took:.0f} s")
        results = _junit_results(junit)
    else:
        log("", f"no feature awaits a run on a {args.device}.")
        status, results = 0, []
    for key in proofs:
        verdicts = [v for nodeid, v in results if _feature_of(nodeid) == key]
        counts = {v: verdicts.count(v) for v in ("passed", "failed", "skipped")}
        # Exit status 1: some test failed (maybe another feature's); others mean the run
        # itself broke (a crash, the time limit), which proves nothing.
        proven = counts["passed"] > 0 and counts["failed"] == 0 and status in (0, 1)
        summary["features"][".".join(key)] = {**counts, "proven": proven}
        log(f"  {'.'.join(key)}: {counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped")

    for name, (decides, seconds, _) in TIMINGS.items():
        if not any(key in proofs for key in decides):
            continue
        if left() < 30:
            log(f"== timing {name}: no time left")
            continue
        log("", f"== timing {name} (decides {', '.join('.'.join(k) for k in decides)})")
        status, took = _run([sys.executable, __file__, "--time", name],
                               min(seconds, left() - 10), log, env)
        summary["timings"][name] = {"status": status, "seconds": round(took)}
        log(f"{name}: exit status {status} in {took:.0f} s")

    rest, kernel = REGRESSION[args.device]
    if left() > 60:
        log("", f"== the rest of the {args.device} suites")
        status, took = _run(
            [*_pytest(args.device, args.workers), *rest, "tests/test_conformance.py", "-k",
             f"not test_kernel_conforms or ({kernel} and not ({conformance}))" if conformance
             else f"not test_kernel_conforms or {kernel}"],
            left() - 10, log, env)
        summary["regression"] = {"status": status, "seconds": round(took)}
        log(f"regression: exit status {status} in {took:.0f} s")

    with open(os.path.join(out, "device_proofs.json"), "w") as f:
        json.dump(summary, f, indent=1)
    log("", "verdicts: " + (", ".join(f"{k} {'proven' if v['proven'] else 'NOT proven'}"
                                     for k, v in summary["features"].items()) or "none"),
        f"all stages took {time.monotonic() - start:.0f} s")
    return 0 if all(v["proven"] for v in summary["features"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
