"""The README's first screen gives two set-up commands; these tests run them as a user types
them, not just check that they are mentioned. The demo runs through its real module entry
point in a subprocess and its table is read back. `.ci/run` executes both commands verbatim,
read from the README, so CI runs exactly what a newcomer runs."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import runtime_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIRST_SCREEN_LINES = 30
MASKS = ("causal", "window", "document", "bigbird")


def first_screen_commands() -> list[str]:
    """The shell commands of the README's first screen, in order (comment lines dropped)."""
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:FIRST_SCREEN_LINES])
    blocks = re.findall(r"```bash\n(.*?)```", head, re.S)
    assert blocks, "the README's first screen has no bash block"
    return [line.strip() for block in blocks for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def demo_rows(output: str) -> dict[str, list[str]]:
    """The demo's table, ``{mask: [density, kernel, ours ms, dense ms, speed-up, max err]}``."""
    rows = {}
    for line in output.splitlines():
        fields = line.split()
        if fields and fields[0] in MASKS and len(fields) == 7:
            rows[fields[0]] = fields[1:]
    return rows


def check_demo_table(output: str, platform: str = "cpu") -> None:
    rows = demo_rows(output)
    assert set(rows) == set(MASKS), f"the demo's table lacks rows: {output[-3000:]}"
    for name, (density, kernel, ours_ms, dense_ms, speed_up, max_err) in rows.items():
        assert 0.0 < float(density) <= 1.0, (name, density)
        assert kernel == ("xla" if platform == "cpu" else kernel), (name, kernel)
        assert float(ours_ms) > 0 and float(dense_ms) > 0, (name, ours_ms, dense_ms)
        assert speed_up.endswith("x") and float(speed_up[:-1]) > 0, (name, speed_up)
        assert float(max_err) < 1e-4, (name, max_err)  # float32 against the float32 reference
    assert "Why these kernels, and what they skip:" in output


def test_first_screen_has_exactly_the_two_commands():
    commands = first_screen_commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    assert demo.endswith("python -m eqx_bsattn"), demo
    assert "pip install -e ." in demo
    assert "python -m pytest" in tests and 'pip install -e ".[dev]"' in tests, tests


def test_ci_runs_the_readme_commands_verbatim():
    """`.ci/run` reads both commands from the README and runs them, so the two cannot drift."""
    script = (ROOT / ".ci" / "run").read_text()
    assert "README.md" in script and "eval" in script
    # No second, hand-written copy of the test command: the full tier's rest is the README's
    # pytest call with `--full -m slow` added.
    assert "python -m pytest" not in script
    assert '${commands[1]##*&& } --full -m slow' in script
    # The first command's output is kept for test_demo_command_as_typed_in_a_fresh_checkout.
    assert f'export {CI_DEMO_OUTPUT}=' in script


@pytest.mark.slow  # the demo takes about 30 s: the full suite and .ci/run run it
def test_demo_entry_point_prints_its_table():
    """`python -m eqx_bsattn` in a subprocess, at a short length so it takes seconds."""
    result = subprocess.run(
        [sys.executable, "-m", "eqx_bsattn", "--length", "512", "--reps", "1"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})  # at -O0: mostly compiling (16 s, 21 s at -O3)
    assert result.returncode == 0, result.stderr[-3000:]
    check_demo_table(result.stdout)


def _copy_checkout(dest: pathlib.Path) -> None:
    """The files a fresh clone has: tracked and untracked-not-ignored, no virtual environment."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("needs the repository's git metadata to copy a checkout")
    for name in filter(None, listed.stdout.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


#: Set by `.ci/run`: the standard output of the first command as CI ran it on its fresh clone,
#: after a line with the command itself.
CI_DEMO_OUTPUT = "EQX_BSATTN_CI_DEMO_OUTPUT"


def check_ci_demo_output(path: pathlib.Path, demo: str) -> None:
    """The output `.ci/run` kept is the README's first command's, and its table is right."""
    command, _, output = path.read_text().partition("\n")
    assert command == demo, f"CI ran {command!r}, the README says {demo!r}"
    check_demo_table(output)


def test_ci_demo_output_is_checked(tmp_path):
    """What CI kept is accepted only with the README's command and a right table."""
    demo = first_screen_commands()[0]
    table = "".join(f"{name} 0.25 xla 1.0 2.0 2.00x 1e-06\n" for name in MASKS)
    kept = tmp_path / "demo_output.txt"
    kept.write_text(f"{demo}\n{table}Why these kernels, and what they skip:\n")
    check_ci_demo_output(kept, demo)
    kept.write_text(f"python -m eqx_bsattn\n{table}Why these kernels, and what they skip:\n")
    with pytest.raises(AssertionError, match="the README says"):
        check_ci_demo_output(kept, demo)
    kept.write_text(f"{demo}\n{table.replace('1e-06', '0.5')}Why these kernels, and what they skip:\n")
    with pytest.raises(AssertionError):
        check_ci_demo_output(kept, demo)


@pytest.mark.slow
def test_demo_command_as_typed_in_a_fresh_checkout(tmp_path):
    """The first command, word for word, in a copy of the checkout with no virtual environment:
    it creates one, installs the package from pyproject.toml and runs the demo. Under
    `.ci/run`, which has just run that command on its fresh clone, the test reads that run's
    output (the same command, the same check) instead of installing and running it again."""
    demo = first_screen_commands()[0]
    if os.environ.get(CI_DEMO_OUTPUT):
        check_ci_demo_output(pathlib.Path(os.environ[CI_DEMO_OUTPUT]), demo)
        return
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    _copy_checkout(checkout)
    # XLA's default level, as a user runs it: the demo at its default length runs more than
    # it compiles (88 s of CPU at -O0, 34 s at the default level).
    env = {k: v for k, v in runtime_env(os.environ).items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(os.environ.get("VIRTUAL_ENV", "\0")))
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(["bash", "-c", f"set -e; {demo}"], cwd=checkout, env=env,
                            capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    check_demo_table(result.stdout)


def test_runtime_env_drops_only_the_suites_fast_compile_flag():
    """The demo's and the notebooks' processes run at XLA's default level: the suite's -O0
    goes, the other flags stay, and a level the user set (no marker) stays too."""
    from tests import conftest

    suite = {"XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {conftest._FAST_COMPILE}",
             conftest._FAST_COMPILE_SET: "1", "OTHER": "x"}
    assert runtime_env(suite) == {"XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                                  conftest._FAST_COMPILE_SET: "1", "OTHER": "x"}
    assert "XLA_FLAGS" not in runtime_env({**suite, "XLA_FLAGS": conftest._FAST_COMPILE})
    user = {"XLA_FLAGS": conftest._FAST_COMPILE}
    assert runtime_env(user) == user
