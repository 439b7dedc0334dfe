"""A mesh that spans processes: `docs/examples/ring_two_hosts.py` run as two processes joined by
`jax.distributed` (a coordinator on 127.0.0.1, the CPU backend's gloo collectives), four
virtual CPU devices each. Each process checks `RingAttention` and `ShardMap` over the
8-device global mesh against the unsharded call, output and gradients; this test checks that
both processes succeed and report the same gathered results."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "ring_two_hosts.py"
PROCESSES, DEVICES_PER_PROCESS = 2, 4
TIMEOUT_S = 300  # about a minute on two busy cores; a hung collective must not hang the suite
TOLERANCE = 2e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(folder: pathlib.Path) -> list[tuple[int, str, str]]:
    """Start every process, wait for all of them (or kill all at the deadline), and return
    each one's (return code, stdout, stderr). Output goes to files, not pipes: a process
    blocked on a full pipe would stall the collectives of the others."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                        f"{DEVICES_PER_PROCESS}").strip()
    coordinator = f"127.0.0.1:{free_port()}"
    logs = [(folder / f"{i}.out", folder / f"{i}.err") for i in range(PROCESSES)]
    procs = []
    for i, (out, err) in enumerate(logs):
        with out.open("w") as stdout, err.open("w") as stderr:
            procs.append(subprocess.Popen(
                [sys.executable, str(EXAMPLE), "--coordinator", coordinator,
                 "--num-processes", str(PROCESSES), "--process-id", str(i)],
                cwd=ROOT, env=env, stdout=stdout, stderr=stderr))
    try:
        codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.wait()
        codes = None
    results = [(code, out.read_text(), err.read_text())
               for code, (out, err) in zip(codes or [None] * PROCESSES, logs)]
    if codes is None:
        pytest.fail(f"the processes did not finish within {TIMEOUT_S} s: "
                    f"{[err[-2000:] for _, _, err in results]}")
    return results


@pytest.mark.slow  # two processes each compile three sharded calls: about a minute
def test_two_processes_agree_with_the_unsharded_call(tmp_path):
    results = run_processes(tmp_path)
    for i, (code, out, err) in enumerate(results):
        assert code == 0, f"process {i} exited with {code}: {out[-2000:]} {err[-4000:]}"
    reports = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    assert [r["process"] for r in reports] == list(range(PROCESSES))
    for report in reports:
        assert report["processes"] == PROCESSES
        assert report["devices"] == PROCESSES * DEVICES_PER_PROCESS
        assert report["ok"], report
        names = {name.split(":")[0] for name in report["errors"]}
        assert names == {"ring", "heads", "ring x heads"}, report["errors"]
        for name, err in report["errors"].items():
            assert 0.0 <= err <= TOLERANCE, (report["process"], name, err)
    # Every process gathered the same results (the errors of the whole arrays agree too).
    assert len({r["digest"] for r in reports}) == 1, reports
    whole = [{n: e for n, e in r["errors"].items() if n.endswith("global")} for r in reports]
    assert all(w == whole[0] for w in whole), whole
