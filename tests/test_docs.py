"""The README's and docs/'s code runs as written, the worked examples do what docs/ says, and
the notebooks execute without error."""

import contextlib
import importlib.util
import io
import os
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks
from tests.conftest import (
    assert_close,
    jnp_attention_f64,
    np_attention,
    np_visibility,
    runtime_env,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LOGS = sorted((ROOT / "docs" / "log").glob("*.md"))  # measurement logs behind the pages


def _python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def _run_blocks(path: pathlib.Path) -> dict:
    """Run a page's python blocks in one namespace, from the repository root (as written)."""
    blocks = _python_blocks(path)
    assert blocks, f"{path.name} has no python code blocks"
    namespace: dict = {"__name__": "tests.docs_blocks"}
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile("\n".join(blocks), str(path), "exec"), namespace)
    finally:
        os.chdir(cwd)
    return namespace


README_TOL = 2e-5  # float32 results against the float64 oracle, relative to the largest value


def _readme_truth(ns, mask, **kw):
    """The float64 oracle for the README's q, k, v (GQA: 8 query heads on 2 kv heads)."""
    q, k, v = (np.asarray(ns[n], np.float64) for n in ("q", "k", "v"))
    seg = kw.pop("segment_ids", None)
    seg = None if seg is None else np.broadcast_to(np.asarray(seg), (2, 512))
    vis = np_visibility(mask, batch=2, heads=8, q_len=512, kv_len=512, q_seg=seg, kv_seg=seg)
    return np_attention(q, k, v, vis, **kw)  # default scale 1 / sqrt(64)


def _blocks_visited(visible: np.ndarray, block: int) -> np.ndarray:
    """Which (q-block, kv-block) tiles of a [Lq, Lk] visibility hold a visible pair."""
    lq, lk = visible.shape
    return visible.reshape(lq // block, block, lk // block, block).any(axis=(1, 3))


@pytest.mark.slow
def test_readme_python_blocks_run():
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        ns = _run_blocks(ROOT / "README.md")
    printed = stdout.getvalue()
    text = (ROOT / "README.md").read_text()
    # The transformer block: its block-sparse attention computes what the dense kernel does.
    assert ns["y"].shape == (4, 1024, 256)
    dense = eqx.tree_at(lambda b: b.attention.attention.kernel, ns["block"],
                        bsa.kernels.DenseReference())
    assert_close(ns["y"], jax.vmap(dense)(ns["x"]), README_TOL, "y")
    # The printed plan is the one the README shows (on a CPU), the GPU question names its
    # winner's priority, and the printed density is the fraction of 64x64 tiles with a
    # visible pair, as the comment says.
    if jax.default_backend() == "cpu":
        shown = re.search(r"On a CPU the plan prints:\n\n```text\n(.*?)```", text, re.S).group(1)
        assert shown in printed
    assert "cudnn: priority 40, the highest on gpu among the registered kernels" in printed
    vis = np_visibility(ns["attn"].mask, batch=1, heads=1, q_len=512, kv_len=512)[0, 0]
    density = float(_blocks_visited(vis, 64).mean())
    assert printed.splitlines()[-1] == repr(density)
    assert f"print(float(layout.density()))               # {density!r}:" in text
    out = ns["out"]
    assert out.shape == (2, 8, 512, 32)
    assert ns["out_one"].shape == (8, 512, 32)
    assert ns["attn"].mask == masks.Causal() & masks.SlidingWindow(128, 0)
    want = _readme_truth(ns, ns["attn"].mask)
    assert_close(out, want, README_TOL, "out")
    assert_close(ns["out_one"], want[0], README_TOL, "out_one")
    np.testing.assert_allclose(np.asarray(ns["out_one"]), np.asarray(out[0]), rtol=0, atol=1e-5)
    assert_close(ns["out_vmapped"], want, README_TOL, "out_vmapped")
    assert_close(ns["out_fn"], want, README_TOL, "out_fn")  # the same mask, by options
    # Packed documents: the ids add a Document mask; the padded rows see nothing (zeros).
    want_docs = _readme_truth(ns, ns["attn"].mask & masks.Document(), segment_ids=ns["ids"])
    assert_close(ns["out_docs"], want_docs, README_TOL, "out_docs")
    assert (np.asarray(ns["out_docs"])[:, :, -12:] == 0).all()
    want_extra = _readme_truth(ns, masks.Causal(), sinks=np.asarray(ns["sinks"]),
                               bias=np.asarray(ns["bias"]), soft_cap=30.0)
    assert_close(ns["out_extra"], want_extra, README_TOL, "out_extra")
    want_fn2 = _readme_truth(ns, masks.ChunkedCausal(128), sinks=np.asarray(ns["sinks"]))
    assert_close(ns["out_fn2"], want_fn2, README_TOL, "out_fn2")
    # The gradients of sum(out ** 2), against the float64 oracle's.
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(np.asarray(ns[n], np.float64)) for n in ("q", "k", "v"))
        vis = jnp.asarray(np_visibility(ns["attn"].mask, batch=2, heads=8, q_len=512,
                                        kv_len=512))
        # `vis` is an argument, not a closed-over constant that XLA would fold for seconds.
        grads = jax.jit(jax.grad(lambda q, k, v, vis: jnp.sum(jnp_attention_f64(q, k, v, vis) ** 2),
                                 argnums=(0, 1, 2)))(q, k, v, vis)
        grads = [np.asarray(g) for g in grads]
    for name, want_g in zip(("dq", "dk", "dv"), grads):
        assert_close(ns[name], want_g, 5e-5, name)


def test_readme_first_screen_has_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first_screen = "\n".join(text.splitlines()[:30])
    assert "python -m eqx_bsattn" in first_screen
    assert "python -m pytest" in first_screen


def test_docs_pages_exist_and_link_to_each_other():
    names = {p.name for p in DOCS}
    assert {"design.md", "contract.md", "custom_mask.md", "custom_kernel.md",
            "triton.md"} <= names
    for page in [*DOCS, *LOGS, ROOT / "README.md"]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_docs_name_the_module_defaults_the_code_has():
    """The module's defaults are strategy objects (`AutoKernel()`, `AutoTiling()`), not None:
    the pages that describe them say what the code holds."""
    attn = bsa.BlockSparseAttention()
    autotune = (ROOT / "docs" / "autotune.md").read_text()
    assert f"`tiling` defaults to `{attn.tiling!r}`" in " ".join(autotune.split())
    for page in [*DOCS, ROOT / "README.md"]:
        text = " ".join(page.read_text().split())
        for name in ("tiling", "kernel"):
            assert f"whose `{name}` is `None`" not in text, page.name


#: Pages a user reads for one kernel or strategy: each opens with one screen.
_FIRST_SCREEN_PAGES = ("mosaic.md", "triton.md", "autotune.md", "reliability.md", "scores.md",
                       "design.md")


@pytest.mark.parametrize("name", _FIRST_SCREEN_PAGES)
def test_kernel_page_first_screen_says_what_it_declines_and_how_fast(name):
    """The first 40 lines say what the kernel or strategy declines (or refuses) and hold a
    measured table, with the date it was taken; the measurement logs come after."""
    lines = (ROOT / "docs" / name).read_text().splitlines()[:40]
    screen = "\n".join(lines)
    assert re.search(r"\bdeclin", screen), f"{name}: the first screen names no declines"
    assert any(a.startswith("| ") and b.startswith("| ---") for a, b in zip(lines, lines[1:])), (
        f"{name}: no table in the first screen")
    assert re.search(r"\b20\d\d-\d\d-\d\d\b", screen), (
        f"{name}: the first screen's numbers have no date")
    assert not re.search(r"^#+ Measurement log", screen, re.M), (
        f"{name}: the measurement log starts in the first screen")

#: Pages whose blocks take seconds (they compile many calls): `slow`, the rest quick. (The
#: worked kernel of custom_kernel.md is still in the quick conformance cases.)
_SLOW_PAGES = {"seed_api.md", "autotune.md", "custom_kernel.md", "custom_mask.md",
               "scores.md", "sharding.md"}


@pytest.mark.parametrize("path", [
    pytest.param(p, id=p.name, marks=pytest.mark.slow if p.name in _SLOW_PAGES else ())
    for p in DOCS if _python_blocks(p)])
def test_docs_python_blocks_run(path):
    _run_blocks(path)


def _load(name: str):
    path = ROOT / "docs" / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"tests.docs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_worked_mask_classifies_blocks_as_its_elements_do():
    sinks = _load("custom_mask").SinkTokens(5)
    assert sinks.classifies_blocks
    same = masks.Predicate(  # the same mask, its blocks classified from its elements
        lambda q, k: jnp.broadcast_to(k < 5, jnp.broadcast_shapes(q.shape, k.shape)))
    assert not same.classifies_blocks
    window = masks.Causal() & masks.SlidingWindow(20, 0)
    for q_len, kv_len, bq, bk in ((96, 96, 8, 8), (70, 130, 16, 4)):
        kw = dict(q_len=q_len, kv_len=kv_len, num_heads=1, block_q=bq, block_kv=bk)

        def classes(mask):
            return np.asarray(bsa.build_layout(mask, **kw).classes[0, 0])

        # Alone, the ranges decide exactly what the elements do.
        np.testing.assert_array_equal(classes(sinks), classes(same))
        # Combined, the ranges are conservative: never FULL or EMPTY where the pairs say
        # otherwise, and visiting no more than about the blocks the elements visit.
        analytic, exact = classes(window | sinks), classes(window | same)
        assert not ((analytic == masks.FULL) & (exact != masks.FULL)).any()
        assert not ((analytic == masks.EMPTY) & (exact != masks.EMPTY)).any()
        np.testing.assert_array_equal(analytic != masks.EMPTY, exact != masks.EMPTY)
        assert 0 < (analytic != masks.EMPTY).mean() < 0.6


@pytest.mark.slow
def test_worked_mask_runs_on_every_cpu_kernel():
    sinks = _load("custom_mask").SinkTokens(3)
    mask = masks.SlidingWindow(9, 0) | sinks
    keys = jax.random.split(jax.random.key(5), 3)
    q, k, v = (jax.random.normal(key, (2, 3, 70, 8)) for key in keys)
    qi, kj = np.arange(70)[:, None], np.arange(70)[None, :]
    visible = ((kj >= qi - 9) & (kj <= qi)) | (kj < 3)
    s = np.einsum("bhqd,bhkd->bhqk", np.asarray(q, np.float64), np.asarray(k, np.float64))
    s = np.where(visible, s / np.sqrt(8), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ np.asarray(v, np.float64)
    for kernel in (bsa.kernels.DenseReference(), bsa.kernels.XlaBlockSparse()):
        attn = bsa.BlockSparseAttention(mask=mask, kernel=kernel,
                                        tiling=bsa.Tiling(block_q=16, block_kv=16))
        np.testing.assert_allclose(np.asarray(attn(q, k, v)), want, rtol=1e-5, atol=1e-5)


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
    assert {"quickstart.ipynb", "training.ipynb", "mask_gallery.ipynb"} <= {p.name for p in NOTEBOOKS}


def test_readme_says_how_to_run_the_notebooks_with_an_extra():
    """The README's command runs with what an extra installs: `jupyter execute` comes from
    nbclient, which the `notebooks` extra (and `dev`) holds, with a Python kernel."""
    import tomllib

    text = " ".join((ROOT / "README.md").read_text().split())
    assert 'pip install -e ".[notebooks]"' in text
    assert "--inplace" not in text  # it rewrites the committed notebook
    _notebook_command()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra in ("notebooks", "dev"):
        names = {re.split(r"[<>=\[ ]", req)[0] for req in extras[extra]}
        assert {"nbclient", "ipykernel", "matplotlib"} <= names, (extra, names)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_executed_with_its_pictures(path):
    """Read on GitHub as committed: every code cell ran, in order, without error, and the
    figures are inline (no non-interactive backend that would drop them)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1))
    outputs = [o for c in cells for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert not any("matplotlib.use(" in c.source for c in cells)


def _notebook_command() -> str:
    """The README's command that runs a notebook, `jupyter execute notebooks/<name>.ipynb
    --output="$HOME/<name>"`: the executed copy goes to the home folder, not the checkout."""
    text = " ".join((ROOT / "README.md").read_text().split())
    found = re.findall(r'`(jupyter execute notebooks/(\w+)\.ipynb --output="\$HOME/\2")`', text)
    assert len(found) == 1, "the README gives no single `jupyter execute` command"
    return found[0][0]


def _jupyter_shim(folder: pathlib.Path) -> pathlib.Path:
    """A `jupyter` command in `folder` whose `execute` is nbclient's, run by this Python (so the
    notebook's kernel imports the package under test, as in a user's environment)."""
    import sys

    folder.mkdir()
    shim = folder / "jupyter"
    shim.write_text(f"""#!/bin/sh
[ "$1" = execute ] || exit 2
shift
exec "{sys.executable}" -c "import sys; from nbclient.cli import main; sys.exit(main())" "$@"
""")
    shim.chmod(0o755)
    return folder


def _tree_state() -> tuple[str, dict[str, bytes]]:
    import subprocess

    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    return status, {str(p.relative_to(ROOT)): p.read_bytes()
                    for p in (ROOT / "notebooks").rglob("*") if p.is_file()}


# The full tier: its one notebook (quickstart) stands for the others there (half a minute of
# CPU in a child process).
@pytest.mark.slow
def test_readme_notebook_command_leaves_the_checkout_clean(tmp_path):
    """The README's command as typed, on the quickest notebook, with a temporary home folder:
    it executes every cell and writes the copy there, and git sees no change (`--inplace`,
    the command it replaces, rewrote the committed notebook)."""
    import shutil
    import subprocess

    import nbformat

    if shutil.which("git") is None or shutil.which("bash") is None:
        pytest.skip("needs git and bash")
    command = _notebook_command()
    name = re.search(r"notebooks/(\w+)\.ipynb", command).group(1)
    command = command.replace(name, "quickstart")
    before = _tree_state()
    shim = _jupyter_shim(tmp_path / "bin")
    # The suite's -O0 stays: quickstart compiles more than it runs (34 s of CPU at -O0, 43 s
    # at the default level).
    env = {**os.environ, "HOME": str(tmp_path),
           "PATH": os.pathsep.join([str(shim), os.environ.get("PATH", "")])}
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _tree_state() == before, "running a notebook changed the checkout"
    nb = nbformat.read(tmp_path / "quickstart.ipynb", as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1))
    assert not [o for c in cells for o in c.outputs if o.output_type == "error"]
    # The committed notebook's printed plans (the selector's choices and priorities) are
    # those the code prints now; the timings may differ.
    committed = [c for c in nbformat.read(ROOT / "notebooks" / "quickstart.ipynb",
                                          as_version=4).cells if c.cell_type == "code"]
    for old, new in zip(committed, cells):
        if "priority" in _printed(old) or "priority" in _printed(new):
            assert _printed(old) == _printed(new), (
                f"notebooks/quickstart.ipynb's committed output of\n{old.source}\nis stale: run "
                "the notebook again and commit it")


def _printed(cell) -> str:
    """What a code cell printed (its stream outputs)."""
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream")


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name != "quickstart.ipynb"],
                         ids=lambda p: p.name)  # quickstart runs through the README's command
def test_notebook_executes(path, monkeypatch):
    import nbclient
    import nbformat

    # The kernel starts with this environment, at XLA's default level: these notebooks run
    # their programs many times (the training steps, the timings), which -O0 slows many times
    # over (CPU time: training 243 s at -O0, 107 s at the default level; mask_gallery 78 s,
    # 47 s).
    flags = runtime_env(os.environ).get("XLA_FLAGS")
    if flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", flags)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors


@pytest.mark.slow
def test_notebook_bench_json_is_what_the_benchmark_writes(tmp_path):
    """mask_gallery.ipynb plots a benchmark run kept in notebooks/data: the fields of each kind
    of record are those a fresh run writes, and its densities are those of the benchmark's
    patterns at those lengths."""
    import json

    from eqx_bsattn import bench

    kept = json.loads((ROOT / "notebooks" / "data" / "bench_cpu.json").read_text())
    out = tmp_path / "fresh.json"
    bench.main(["--lengths", "128", "--reps", "1", "--patterns", "causal", "window",
                "--out", str(out)])
    fresh = json.loads(out.read_text())
    assert set(kept) == set(fresh) == {"device", "platform", "device_count", "versions", "jax",
                                       "records"}

    def fields(result):
        by_impl = {}
        for r in result["records"]:
            by_impl.setdefault(r["impl"], set()).update(r)
        return by_impl

    assert fields(kept) == fields(fresh)
    for r in kept["records"]:
        mask, data = bench.pattern(r["pattern"], r["length"], window=256)
        pairs = bench.visible_pairs(mask, r["length"], r["length"], data.get("q_segment_ids"))
        assert r["density"] == pairs / r["length"] ** 2, r


def _public_names(namespace) -> list[str]:
    import types

    return [n for n in dir(namespace) if not n.startswith("_")
            and not isinstance(getattr(namespace, n), types.ModuleType)]


@pytest.mark.parametrize("where", ["bsa", "masks", "kernels", "scores", "sharding", "tiling",
                                   "contract"])
def test_every_public_name_is_on_some_page(where):
    # A user finds a name by reading: each public name of the package and of its strategy
    # namespaces appears in the README or a page of docs/ (the measurement logs do not count).
    namespace = bsa if where == "bsa" else getattr(bsa, where)
    text = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in DOCS)
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    missing = [n for n in _public_names(namespace) if n not in words]
    assert not missing, f"public names of {where} on no page of README.md or docs/: {missing}"
