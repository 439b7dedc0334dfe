"""The boundaries of the contract, read from the source: plug-ins import only public names,
kernels never name a mask class, the core never imports the strategies, and every class is
abstract or final."""

import ast
import importlib
import importlib.util
import inspect
import pathlib
import re
import subprocess
import sys
import typing
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from beartype.door import is_bearable

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


@pytest.mark.parametrize("path", STRATEGIES + sorted((ROOT / "benchmarks").rglob("*.py"))
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


def _repository_files() -> list[pathlib.Path]:
    """The repository's files: git's tracked and untracked-but-not-ignored ones where the
    checkout is a git work tree (a user's ignored scratch files are not the repository's),
    else every file outside the virtual environment and caches."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
            capture_output=True, text=True, check=True).stdout.split("\n")
        return [ROOT / name for name in listed if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__", ".pytest_cache"}
        return [p for p in ROOT.rglob("*") if p.is_file()
                and not skip.intersection(p.relative_to(ROOT).parts)
                and not any(part.endswith(".egg-info") for part in p.parts)]


def test_the_repository_names_no_machine_path():
    """No file points into one machine's folders (home, scratch or temporary directories)."""
    machine_path = re.compile(r"(?<![\w.~])/(?:home|work|tmp|root|Users|scratch)/")
    files = [p for p in _repository_files()
             if p.suffix in (".py", ".md", ".toml", ".ipynb", ".json", ".txt", ".cfg", ".sh")]
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
    return {obj.__name__ for obj in vars(masks).values()
            if inspect.isclass(obj) and issubclass(obj, bsa.AbstractMask)
            and not bsa.is_abstract(obj)}


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


def _load_examples():
    """The worked examples of docs/ as modules, each class defined into a throwaway registry
    (the conformance suite registers the documented kernel once, under its own name)."""
    from eqx_bsattn import _kernel

    loaded = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_kernel, "_REGISTRY", [])
        for path in sorted((ROOT / "docs" / "examples").glob("custom_*.py")) + sorted(
                (ROOT / "docs" / "examples").glob("*kernel*.py")):
            spec = importlib.util.spec_from_file_location(f"contract_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            loaded.append(module)
    return loaded


def _package_classes():
    """Every class of the package that is a module, a strategy or a mask, in definition order."""
    seen = {}
    for module_name, module in list(sys.modules.items()):
        if module_name == "eqx_bsattn" or module_name.startswith("eqx_bsattn."):
            for obj in vars(module).values():
                if inspect.isclass(obj) and issubclass(obj, (eqx.Module, bsa.AbstractStrategy, bsa.AbstractMask)) \
                        and obj.__module__.startswith("eqx_bsattn"):
                    seen[obj] = None
    return list(seen)


EXAMPLES = _load_examples()
EXAMPLE_CLASSES = [obj for module in EXAMPLES for obj in vars(module).values()
                   if inspect.isclass(obj) and obj.__module__ == module.__name__]


def _ours(cls) -> bool:
    return cls.__module__.startswith("eqx_bsattn") or cls in EXAMPLE_CLASSES


def test_the_examples_are_found():
    names = {cls.__name__ for cls in EXAMPLE_CLASSES}
    assert {"SinkTokens", "GatherKernel"} <= names


def test_every_class_is_abstract_or_final():
    """Equinox's rule: a class is abstract (it leaves an abstract method or class variable
    undefined, or says ``is_abstract=True``; named ``AbstractX``) or final (never subclassed).
    Abstractness is the class's own, never read from its name."""
    from eqx_bsattn.contract import is_abstract

    classes = _package_classes()
    assert len(classes) > 20
    for cls in classes:
        named = cls.__name__.startswith("Abstract")
        assert is_abstract(cls) == named, (
            f"{cls.__name__} is {'' if is_abstract(cls) else 'not '}abstract; abstract classes, "
            "and only they, are named AbstractX")
        # A mask class's pytree twin (its instances that hold arrays) is the class itself.
        subclasses = [s for s in cls.__subclasses__() if s.__module__.startswith("eqx_bsattn")
                      and getattr(s, "__mask_value_class__", s) is s]
        if not is_abstract(cls):
            assert not subclasses, f"{cls.__name__} is concrete but subclassed by {subclasses}"


def _concrete_owner(cls, name):
    """The nearest base of `cls` (ours) that defines `name` concretely, or ``None``."""
    for base in cls.__mro__[1:]:
        if _ours(base) and name in vars(base):
            value = vars(base)[name]
            func = getattr(value, "__func__", None) or getattr(value, "fget", None) or value
            return None if getattr(func, "__isabstractmethod__", False) else base
    return None


#: Concrete members that subclasses may still replace: the kernels' tiling defaults (their
#: config type and its heuristic, adaptation and candidates), which each kernel's own config
#: takes over, their autotune cache `version` (bumped when a change makes configs tuned
#: before it stale), the score terms they evaluate (none by default) and whether they zero
#: padding rows themselves (no by default); the masks'
#: structural hooks (an atom has no children, fits every length, resolves to itself, has no
#: in-kernel terms, hides no padding key unless it says so); a sharding's fit of an automatic tiling to its shards and its decline of a
#: kernel whose tiles cannot fit them (none by default).
REPLACEABLE = {
    "AbstractSharding": {"fit_tiling", "kernel_decline"},
    "AbstractKernel": {"config_type", "default_tiling", "adapt_tiling", "tiling_candidates",
                       "version", "score_kinds", "zeroes_padding", "awaiting_device_run"},
    "AbstractMask": {"terms", "children", "check", "resolve", "hides_padding_keys"},
}


@pytest.mark.parametrize("cls", _package_classes() + EXAMPLE_CLASSES, ids=lambda c: c.__name__)
def test_subclasses_define_only_what_their_bases_leave_abstract(cls):
    """No piecemeal override: a member a base defines concretely is never redefined below it
    (dunders aside: `__check_init__` runs at every level, as in equinox)."""
    for name in vars(cls):
        if name.startswith("__") and name.endswith("__") or name == "_abc_impl":
            continue
        owner = _concrete_owner(cls, name)
        if owner is not None:
            assert name in REPLACEABLE.get(owner.__name__, ()), (
                f"{cls.__name__}.{name} overrides the concrete {owner.__name__}.{name}")


def _kernel_classes():
    return [c for c in _package_classes() + EXAMPLE_CLASSES
            if issubclass(c, bsa.AbstractKernel) and not c.__name__.startswith("Abstract")]


def _mask_classes():
    return [c for c in _package_classes() + EXAMPLE_CLASSES
            if issubclass(c, bsa.AbstractMask) and not c.__name__.startswith("Abstract")]


def test_the_kernel_and_mask_lists_are_not_empty():
    kernel_names = {c.__name__ for c in _kernel_classes()}
    assert {"DenseReference", "XlaBlockSparse", "CudnnDense", "GatherKernel"} <= kernel_names
    assert {"Causal", "And", "PerHead", "Predicate", "SinkTokens"} <= {
        c.__name__ for c in _mask_classes()}


def _declared_class_variables(base):
    """``{name: T}`` for each class variable `base` declares (`AbstractClassVar[T]`, or
    `ClassVar[T]`) and the type each subclass's value must have."""
    out = {}
    for name, annotation in inspect.get_annotations(base).items():
        if typing.get_origin(annotation) in (eqx.AbstractClassVar, typing.ClassVar):
            out[name] = typing.get_args(annotation)[0]
    return out


def _check_class_variables(cls, base):
    declared = _declared_class_variables(base)
    assert declared, base
    for name, expected in declared.items():
        assert is_bearable(getattr(cls, name), expected), (
            f"{cls.__name__}.{name} = {getattr(cls, name)!r} is not a {expected}")
        for klass in cls.__mro__[: cls.__mro__.index(base)]:
            annotation = inspect.get_annotations(klass).get(name)
            if annotation is not None:
                assert annotation == typing.ClassVar[expected], (
                    f"{klass.__name__}.{name} is declared {annotation}; the contract says "
                    f"ClassVar[{expected}]")


@pytest.mark.parametrize("cls", _kernel_classes(), ids=lambda c: c.__name__)
def test_kernels_satisfy_the_declared_contract(cls):
    """Each kernel sets the contract's class variables with the declared types (`reads` a
    `MaskReads`, not any string), defines every abstract method, and says that it returns the
    log-sum-exp by its type alone: `attention_with_lse` exactly on `AbstractLseKernel`s."""
    _check_class_variables(cls, bsa.AbstractKernel)
    from eqx_bsattn.contract import AbstractLseKernel, is_abstract

    assert not is_abstract(cls), cls.__abstractmethods__
    assert cls in bsa.registered_kernels() or cls in EXAMPLE_CLASSES
    assert hasattr(cls, "attention_with_lse") == issubclass(cls, AbstractLseKernel), cls
    assert not hasattr(cls, "returns_lse"), f"{cls.__name__} declares returns_lse"


@pytest.mark.parametrize("cls", _mask_classes(), ids=lambda c: c.__name__)
def test_masks_satisfy_the_declared_contract(cls):
    """Each mask sets `reads_segment_ids` as a ``ClassVar[bool]``, defines `elements`, and has
    `blocks` exactly when it is an `AbstractBlockMask` (the type `classifies_blocks` tests)."""
    _check_class_variables(cls, bsa.AbstractMask)
    from eqx_bsattn.contract import AbstractBlockMask, is_abstract

    assert not is_abstract(cls), cls.__abstractmethods__
    assert hasattr(cls, "blocks") == issubclass(cls, AbstractBlockMask), cls


def test_a_blocks_method_outside_the_block_mask_type_is_refused():
    """`build_layout` reads block classes only from an `AbstractBlockMask`: a `blocks` on any
    other mask would be silently ignored, so defining one is an error."""
    with pytest.raises(TypeError, match="AbstractBlockMask"):
        class Stray(masks.AbstractMask):
            reads_segment_ids: ClassVar[bool] = False
            varies_by_head: ClassVar[bool] = False

            def elements(self, q, k, head):
                return k.position <= q.position

            def blocks(self, q, k, head):
                return masks.classify(k.pos_hi <= q.pos_lo, k.pos_lo > q.pos_hi)


def test_a_strategy_says_it_is_abstract_as_an_equinox_module_does():
    """``is_abstract=True`` marks a strategy abstract although it leaves nothing undefined
    (equinox's class keyword); its subclasses are concrete unless they say so too."""
    from eqx_bsattn.contract import is_abstract

    class AbstractFamily(bsa.AbstractStrategy, is_abstract=True):
        size: int = 1

    class Member(AbstractFamily):
        pass

    assert is_abstract(bsa.AbstractStrategy) and is_abstract(AbstractFamily)
    assert not is_abstract(Member) and Member(size=2) == Member(2)
    with pytest.raises(TypeError, match="abstract class AbstractFamily"):
        AbstractFamily()
    with pytest.raises(TypeError, match="`cls` must be a class; got Member"):
        is_abstract(Member())


def _kernel_class(base, class_name, **namespace):
    """A kernel class built on `base` with `namespace` (class variables and methods)."""
    def call(self, query, key, value, **kw):
        return bsa.kernels.DenseReference()(query, key, value, **kw)

    return type(class_name, (base,), {"__call__": call, **namespace})


_PRIORITY = classmethod(lambda cls, platform: None)
_ACCEPTS = lambda self, mask, features: None  # noqa: E731


def test_the_registry_reads_abstractness_not_names(monkeypatch):
    """A class that defines the whole contract is registered whatever its name; one that
    leaves a class variable or a method undefined is not, and cannot be instantiated."""
    from eqx_bsattn import _kernel
    from eqx_bsattn.contract import is_abstract

    monkeypatch.setattr(_kernel, "_REGISTRY", [])
    declared = dict(name="test-concrete", platforms=("cpu",), reads="dense")
    complete = _kernel_class(bsa.AbstractKernel, "AbstractLookingButConcrete", **declared,
                             priority=_PRIORITY, decline_reason=_ACCEPTS)
    no_reads = _kernel_class(bsa.AbstractKernel, "NoReads", name="test-no-reads",
                             platforms=("cpu",), priority=_PRIORITY, decline_reason=_ACCEPTS)
    no_decline = _kernel_class(bsa.AbstractKernel, "NoDeclineReason", **declared,
                               priority=_PRIORITY)
    assert bsa.registered_kernels() == (complete,)
    assert not is_abstract(complete) and is_abstract(no_reads) and is_abstract(no_decline)
    complete()
    with pytest.raises(TypeError, match="reads"):
        no_reads()
    with pytest.raises(TypeError, match="decline_reason"):
        no_decline()


def test_the_selector_reads_the_lse_capability_from_the_type(monkeypatch):
    """Returning the log-sum-exp is a type (`AbstractLseKernel`): a kernel of that type is a
    candidate for a call that needs it, any other kernel is declined saying so, and the old
    `returns_lse` flag is refused where it is written, naming the type."""
    from eqx_bsattn import _kernel
    from eqx_bsattn.contract import AbstractLseKernel

    monkeypatch.setattr(_kernel, "_REGISTRY", [])
    declared = dict(platforms=("cpu",), reads="dense", priority=_PRIORITY,
                    decline_reason=_ACCEPTS)

    def with_lse(self, query, key, value, **kw):
        return bsa.kernels.DenseReference().attention_with_lse(query, key, value, **kw)

    lse = _kernel_class(AbstractLseKernel, "WithLse", name="test-lse", **declared,
                        attention_with_lse=with_lse)
    plain = _kernel_class(bsa.AbstractKernel, "WithoutLse", name="test-plain", **declared)
    choice = bsa.select_kernel(masks.Causal(), platform="cpu", features=bsa.Features(lse=True),
                               candidates=[plain(), lse()])
    assert choice.kernel.name == "test-lse"
    assert [name for name, _ in choice.declined] == ["test-plain"]
    assert "AbstractLseKernel" in choice.declined[0][1]
    with pytest.raises(TypeError, match="AbstractLseKernel"):
        _kernel_class(bsa.AbstractKernel, "OldStyle", name="test-old", **declared,
                      returns_lse=True, attention_with_lse=with_lse)


def test_a_bias_keeps_its_size_1_axes_only_for_kernels_of_the_capability_type(monkeypatch):
    """Reading a bias with its size-1 axes is a type (`AbstractBroadcastBiasKernel`): a
    kernel of that type receives a per-key, per-query or scalar bias as given (its
    ``Lq x Lk`` broadcast never built), unsharded and under `ShardMap` and `RingAttention`
    (`keeps_bias_axes`); every other kernel, and any kernel under a sharding whose
    `keeps_bias_axes` is False, receives it broadcast to ``[bb, hb, Lq, Lk]`` as before; the
    bias's gradient has the caller's shape either way."""
    from eqx_bsattn import _kernel
    from eqx_bsattn.contract import AbstractBroadcastBiasKernel

    monkeypatch.setattr(_kernel, "_REGISTRY", [])
    seen = []

    def call(self, query, key, value, *, inputs, **kw):
        seen.append(inputs.bias.shape)
        return bsa.kernels.DenseReference()(query, key, value, inputs=inputs, **kw)

    declared = dict(platforms=("cpu",), reads="dense", priority=_PRIORITY,
                    decline_reason=_ACCEPTS, __call__=call)
    reading = _kernel_class(AbstractBroadcastBiasKernel, "ReadsBroadcastBias",
                            name="test-broadcast", **declared)
    plain = _kernel_class(bsa.AbstractKernel, "ReadsFullBias", name="test-full", **declared)
    assert isinstance(bsa.kernels.XlaBlockSparse(), AbstractBroadcastBiasKernel)
    assert isinstance(bsa.kernels.DenseReference(), AbstractBroadcastBiasKernel)
    assert not isinstance(bsa.kernels.CudnnDense(), AbstractBroadcastBiasKernel)

    class Broadcasting(bsa.AbstractSharding):  # splits only a bias [bb, hb, Lq, Lk]
        needs_lse: ClassVar[bool] = False
        passes_positions: ClassVar[bool] = False
        passes_score: ClassVar[bool] = True
        loops_kernel: ClassVar[bool] = False
        keeps_bias_axes: ClassVar[bool] = False

        def wrap(self, fn):
            return fn

    q = jax.random.normal(jax.random.key(0), (2, 4, 24, 8))
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    for shape in ((2, 1, 1, 24), (2, 4, 24, 1), (1, 1, 1, 1), (24, 1)):
        bias = jax.random.normal(jax.random.key(1), shape)
        given = (1,) * (4 - len(shape)) + shape
        full = given[:2] + (24, 24)
        for kernel, kept in ((reading(), given), (plain(), full),
                             (bsa.kernels.XlaBlockSparse(), given)):
            attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=kernel)
            assert attn.plan(q, q, q, bias=bias).inputs.bias.shape == kept, (kernel, shape)
            # Under ShardMap and RingAttention (an AbstractLseKernel's) as unsharded; under a
            # sharding that does not keep the axes, broadcast.
            shardings = [(bsa.sharding.ShardMap(mesh, "data"), kept), (Broadcasting(), full)]
            if kernel.name == "xla":
                shardings.append((bsa.sharding.RingAttention(mesh, "data"), kept))
            for shard, want in shardings:
                under = eqx.tree_at(lambda m: m.sharding, attn, shard)
                assert under.plan(q, q, q, bias=bias).inputs.bias.shape == want, (kernel, shard)
            if kernel.name == "xla":
                continue
            if shape != (2, 1, 1, 24):  # one call each (a compilation) is enough
                continue
            seen.clear()
            grad = jax.jit(jax.grad(lambda b: jnp.sum(jnp.sin(attn(q, q, q, bias=b)))))(bias)
            assert grad.shape == shape
            assert seen == [kept], (kernel, shape, seen)  # what the kernel itself received


def test_contract_exports_what_a_plug_in_needs():
    from eqx_bsattn import contract

    for name in ("AbstractMask", "AbstractKernel", "AbstractSharding", "CompiledMask",
                 "ResolvedMask", "MaskTerms", "BlockLayout", "TokenCoords", "BlockCoords",
                 "AttentionInputs", "Features", "Tiling", "classify", "EMPTY", "PARTIAL", "FULL",
                 "AbstractLseKernel", "AbstractBroadcastBiasKernel", "AbstractBlockMask",
                 "MaskReads", "is_abstract",
                 "public_lse", "backward_delta", "zero_cotangent", "pad_axis",
                 "refuse_forward_mode", "refuse_second_order", "first_gpu",
                 "add_sinks"):
        assert hasattr(contract, name), name
