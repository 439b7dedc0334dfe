"""The README's and docs/'s code runs as written, the worked examples do what docs/ says, and
the notebooks execute without error."""

import importlib.util
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))


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


def test_readme_python_blocks_run():
    namespace = _run_blocks(ROOT / "README.md")
    out = namespace["out"]
    assert out.shape == (2, 8, 512, 32)
    assert namespace["out_one"].shape == (8, 512, 32)


def test_readme_first_screen_has_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first_screen = "\n".join(text.splitlines()[:30])
    assert "python -m eqx_bsattn" in first_screen
    assert "python -m pytest" in first_screen


def test_docs_pages_exist_and_link_to_each_other():
    names = {p.name for p in DOCS}
    assert {"design.md", "contract.md", "custom_mask.md", "custom_kernel.md",
            "triton.md"} <= names
    for page in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


@pytest.mark.parametrize("path", [p for p in DOCS if _python_blocks(p)], ids=lambda p: p.name)
def test_docs_python_blocks_run(path):
    _run_blocks(path)


def _load(name: str):
    path = ROOT / "docs" / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"tests.docs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    assert NOTEBOOKS, "no notebooks found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path):
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
