"""The boundaries of the contract, read from the source: plug-ins import only public names,
kernels never name a mask class, the core never imports the strategies, and every class is
abstract or final."""

import ast
import importlib
import inspect
import pathlib
import re

import equinox as eqx
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import masks

ROOT = pathlib.Path(__file__).resolve().parents[1]
STRATEGIES = sorted((ROOT / "strategies").rglob("*.py"))
KERNEL_FILES = sorted((ROOT / "strategies" / "kernels").rglob("*.py")) + sorted(
    (ROOT / "docs" / "examples").glob("*kernel*.py"))
#: The core: what the plug-ins import through `eqx_bsattn.contract`, and the module. The front
#: doors that compose built-in strategies (the seed-style call, the demo, the benchmark with its
#: patterns) and the package's `__init__` (which registers the built-ins) may import them.
CORE = [p for p in sorted((ROOT / "eqx_bsattn").glob("*.py"))
        if p.name not in ("__init__.py", "__main__.py", "_api.py", "_layer.py", "bench.py")]


def _imports(path: pathlib.Path):
    """``(module, names)`` of every import statement in `path` (relative ones resolved)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    package = package.replace("strategies", "eqx_bsattn.strategies", 1) if package.startswith(
        "strategies") else package
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            yield module, [alias.name for alias in node.names]


def test_the_source_lists_are_not_empty():
    assert len(STRATEGIES) > 10 and len(KERNEL_FILES) > 5 and len(CORE) > 8


@pytest.mark.parametrize("path", STRATEGIES + sorted((ROOT / "benchmarks").glob("*.py"))
                         + sorted((ROOT / "docs" / "examples").glob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_plug_ins_and_scripts_import_no_private_name(path):
    for module, names in _imports(path):
        if module.startswith("eqx_bsattn") and not module.startswith("eqx_bsattn.strategies"):
            parts = module.split(".")
            assert not any(part.startswith("_") for part in parts), (path, module)
            assert not any(name.startswith("_") for name in names), (path, module, names)


#: The namespaces a user imports from; the demo and the benchmark import nothing else.
PUBLIC_NAMESPACES = ("eqx_bsattn", "eqx_bsattn.contract", "eqx_bsattn.bench",
                     "eqx_bsattn.timing")


@pytest.mark.parametrize("name", ["bench.py", "__main__.py"])
def test_the_demo_and_the_benchmark_import_only_public_names(name):
    """`python -m eqx_bsattn` and `python -m eqx_bsattn.bench` are user-facing tools: they
    import what a user can (`eqx_bsattn`, `eqx_bsattn.kernels`, `eqx_bsattn.masks`, the
    contract), never a private module or name, nor a kernel's own module."""
    path = ROOT / "eqx_bsattn" / name
    imported = [(m, names) for m, names in _imports(path) if m.split(".")[0] == "eqx_bsattn"]
    assert imported
    for module, names in imported:
        assert module in PUBLIC_NAMESPACES, (name, module)
        for imported_name in names:
            assert not imported_name.startswith("_"), (name, module, imported_name)
            assert hasattr(importlib.import_module(module), imported_name), (module, imported_name)


def test_the_repository_names_no_machine_path():
    """No file points into one machine's folders (home, scratch or temporary directories)."""
    machine_path = re.compile(r"(?<![\w.~])/(?:home|work|tmp|root|Users|scratch)/")
    skip = {".git", ".venv", "__pycache__", ".pytest_cache"}
    files = [p for p in ROOT.rglob("*") if p.is_file()
             and not skip.intersection(p.relative_to(ROOT).parts)
             and not any(part.endswith(".egg-info") for part in p.parts)
             and p.suffix in (".py", ".md", ".toml", ".ipynb", ".json", ".txt", ".cfg", ".sh")]
    assert len(files) > 50
    found = [f"{p.relative_to(ROOT)}: {m.group()}" for p in files
             for m in machine_path.finditer(p.read_text(errors="replace"))]
    assert not found, found


def _unit(module: str) -> str:
    """The plug-in a module of ``eqx_bsattn.strategies`` belongs to: a kernel's folder or
    file (``kernels.triton``, ``kernels.xla``); the masks, the tilings and the shardings are
    each one family (they share private helpers within it)."""
    parts = module.split(".")[2:]
    return ".".join(parts[:2] if parts[:1] == ["kernels"] else parts[:1])


def _strategy_imports(path):
    module = "eqx_bsattn." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
    module = module.replace("eqx_bsattn.strategies.kernels.__init__", "eqx_bsattn.strategies")
    for imported, names in _imports(path):
        if imported.startswith("eqx_bsattn.strategies."):
            yield module, imported, names


@pytest.mark.parametrize("path", sorted((ROOT / "strategies" / "kernels").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_a_kernel_imports_no_other_kernel(path):
    """Kernels are independent plug-ins: a kernel's files import the contract and their own
    folder, never another kernel (what two share lives in `eqx_bsattn.contract`). The
    package's `__init__`, which gathers them, is the one exception."""
    if path.name == "__init__.py" and path.parent.name == "kernels":
        return
    for module, imported, _ in _strategy_imports(path):
        assert _unit(imported) == _unit(module), (path.name, imported)


@pytest.mark.parametrize("path", STRATEGIES, ids=lambda p: str(p.relative_to(ROOT)))
def test_plug_ins_import_no_private_name_of_another(path):
    """No strategy reaches into another strategy's private names."""
    for module, imported, names in _strategy_imports(path):
        if _unit(imported) != _unit(module):
            assert not any(part.startswith("_") for part in imported.split(".")), (path, imported)
            assert not any(name.startswith("_") for name in names), (path, imported, names)


def _mask_class_names() -> set[str]:
    names = set()
    for obj in vars(masks).values():
        if inspect.isclass(obj) and issubclass(obj, bsa.AbstractMask):
            if not obj.__name__.startswith("Abstract"):
                names.add(obj.__name__)
    return names


def test_the_mask_catalogue_is_found():
    assert {"Causal", "SlidingWindow", "Document", "Full", "And", "PerHead"} <= _mask_class_names()


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_kernels_never_name_a_mask_class(path):
    text = path.read_text()
    found = sorted(name for name in _mask_class_names() if re.search(rf"\b{name}\b", text))
    assert not found, f"{path.name} names mask classes {found}: read the compiled mask instead"


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_the_core_never_imports_the_strategies(path):
    for module, _ in _imports(path):
        assert "strategies" not in module, (path.name, module)


def _package_classes():
    seen = {}
    for module_name, module in list(__import__("sys").modules.items()):
        if module_name == "eqx_bsattn" or module_name.startswith("eqx_bsattn."):
            for obj in vars(module).values():
                if inspect.isclass(obj) and issubclass(obj, eqx.Module) and (
                        obj.__module__.startswith("eqx_bsattn")):
                    seen[obj] = None
    return list(seen)


def test_every_class_is_abstract_or_final():
    classes = _package_classes()
    assert len(classes) > 20
    for cls in classes:
        subclasses = [s for s in cls.__subclasses__() if s.__module__.startswith("eqx_bsattn")]
        if cls.__name__.startswith("Abstract"):
            continue
        assert not subclasses, f"{cls.__name__} is concrete but subclassed by {subclasses}"
        for base in cls.__mro__[1:]:
            if base in classes:
                assert base.__name__.startswith("Abstract"), (cls.__name__, base.__name__)


def test_contract_exports_what_a_plug_in_needs():
    from eqx_bsattn import contract

    for name in ("AbstractMask", "AbstractKernel", "AbstractSharding", "CompiledMask",
                 "ResolvedMask", "MaskTerms", "BlockLayout", "TokenCoords", "BlockCoords",
                 "AttentionInputs", "Features", "Tiling", "classify", "EMPTY", "PARTIAL", "FULL",
                 "public_lse", "backward_delta", "zero_cotangent", "pad_axis",
                 "refuse_forward_mode", "add_sinks"):
        assert hasattr(contract, name), name
