"""The proof command (`benchmarks/device_proofs.py`) covers every kernel feature that waits for
a device run, and its bookkeeping reads pytest's results as it should."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

import eqx_bsattn

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _proofs_module():
    spec = importlib.util.spec_from_file_location("device_proofs",
                                                  ROOT / "benchmarks" / "device_proofs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_awaiting_feature_has_a_proof_and_every_proof_a_feature():
    proofs = _proofs_module()
    assert set(proofs.PROOFS) == set(proofs.awaiting())
    for decides, _, _ in proofs.TIMINGS.values():
        assert set(decides) <= set(proofs.PROOFS)


@pytest.mark.slow  # a child process collecting tests per proof
def test_the_proofs_select_tests_and_conformance_cases():
    """Each proof's files select tests (on a GPU, its ``gpu`` tests), and its conformance
    expression selects cases, each of which the log counts for that feature."""
    proofs = _proofs_module()
    for key, proof in proofs.PROOFS.items():
        assert proof.device in proofs.REGRESSION, key
        marker = ["-m", "gpu"] if proof.device == "gpu" else []
        collected = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", *marker,
             "--extended", "--prove-awaiting", "-p", "no:cacheprovider",
             *proof.tests, "tests/test_conformance.py",
             "-k", f"not test_kernel_conforms or {proof.conformance}"],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
        ids = [line for line in collected.stdout.splitlines() if "::" in line]
        assert any(i.startswith(proof.tests[0]) for i in ids), (key, collected.stdout[-500:])
        cases = [i for i in ids if "test_kernel_conforms" in i]
        assert cases and all(proofs._feature_of(i) == key for i in cases), key


@pytest.mark.parametrize("expression, nodeid, expected", [
    ("mosaic and score_relative", "t.py::test_kernel_conforms[mosaic-score_relative-bf16]", True),
    ("mosaic and score_relative", "t.py::test_kernel_conforms[cudnn-score_relative-bf16]", False),
    ("mosaic and (head_dim_80 or value_dim)", "x[mosaic-tiled_value_dim-b]", True),
    ("mosaic and not (head_dim_80 or value_dim)", "x[mosaic-tiled_value_dim-b]", False),
])
def test_k_expressions_match_as_pytest_does(expression, nodeid, expected):
    assert _proofs_module()._matches_k(expression, nodeid) is expected


@pytest.mark.slow  # three child processes
def test_the_option_takes_every_feature_as_proven(tmp_path):
    """``--prove-awaiting`` empties each kernel's record for that run only; without it the
    records are the kernels' own."""
    code = ("import eqx_bsattn as b; print(sorted(f for k in b.registered_kernels() "
            "for f in k.awaiting_device_run))")
    before = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120).stdout
    assert before.strip() == str(sorted(f for k in eqx_bsattn.registered_kernels()
                                        for f in k.awaiting_device_run))
    probe = tmp_path / "test_probe.py"
    probe.write_text("import eqx_bsattn\n\ndef test_probe():\n    assert not any("
                     "k.awaiting_device_run for k in eqx_bsattn.registered_kernels())\n")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
               "tests.conftest", "--rootdir", str(tmp_path), str(probe)]
    run = subprocess.run([*command, "--prove-awaiting"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-800:]
    if before.strip("[]\n"):  # a feature still awaits: without the option the probe fails
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 1, run.stdout[-800:]
