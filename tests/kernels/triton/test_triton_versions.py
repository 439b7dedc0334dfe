"""The `gpu` extra pins the jax-triton / Triton pair the Triton kernel was run with, the README
names it, and any other pair makes the kernel decline with the versions (CPU only)."""

import pathlib
import re
import tomllib

import pytest
from packaging.requirements import Requirement

import eqx_bsattn as bsa
from eqx_bsattn import masks
from eqx_bsattn.strategies.kernels.triton import kernel as triton_kernel

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _gpu_extra() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["optional-dependencies"]["gpu"]]
    return {r.name: r for r in requirements}


def test_the_extra_pins_exactly_the_known_good_pairs():
    extra = _gpu_extra()
    assert set(extra) == {"jax-triton", "triton"}
    for jax_triton, series in triton_kernel.KNOWN_GOOD_VERSIONS.items():
        assert extra["jax-triton"].specifier.contains(jax_triton)
        for s in series:
            assert extra["triton"].specifier.contains(f"{s}.0")
            assert extra["triton"].specifier.contains(f"{s}.9")
    # Nothing outside the known series: the next minor release and the one before.
    for outside in ("3.5.1", "3.7.0", "3.9.0", "4.0.0"):
        assert not extra["triton"].specifier.contains(outside), outside
    assert not extra["jax-triton"].specifier.contains("0.4.0")


def test_the_readme_names_the_pinned_pair():
    text = " ".join((ROOT / "README.md").read_text().split())
    for jax_triton, series in triton_kernel.KNOWN_GOOD_VERSIONS.items():
        for s in series:
            assert re.search(rf"jax-triton {re.escape(jax_triton)} with triton {re.escape(s)}",
                             text), (jax_triton, s)


@pytest.mark.parametrize("jax_triton,triton,good", [
    ("0.3.1", "3.6.0", True), ("0.3.1", "3.6.2", True), ("0.3.1", "3.7.0", False),
    ("0.3.1", "3.60.0", False), ("0.4.0", "3.7.0", False), ("0.3.0", "3.6.0", False),
])
def test_version_problem_names_both_versions(jax_triton, triton, good):
    why = triton_kernel.version_problem(jax_triton, triton)
    if good:
        assert why is None
    else:
        assert f"jax-triton {jax_triton} with triton {triton}" in why
        assert "known good: jax-triton 0.3.1 with triton 3.6.x" in why


def test_an_unknown_pair_declines_with_the_versions(monkeypatch):
    why = triton_kernel.version_problem("0.4.0", "3.9.0")
    monkeypatch.setattr(triton_kernel, "_jax_triton_missing", lambda: why)
    features = bsa.Features(platform="gpu", dtype="bfloat16")
    # Triton and the kernel below it (Mosaic, above them on a Hopper GPU, takes this call).
    candidates = [bsa.kernels.TritonBlockSparse(), bsa.kernels.XlaBlockSparse()]
    choice = bsa.select_kernel(masks.ChunkedCausal(64), "gpu", features, candidates)
    assert choice.kernel.name == "xla"
    assert dict(choice.declined)["triton"] == why
