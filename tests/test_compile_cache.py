"""`enable_compilation_cache`: a second process reads what the first compiled; the Triton
kernels' PTX cache, with jax-triton stood in for (it cannot run on a CPU)."""

import json
import pathlib
import subprocess
import sys
import types

import jax
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import _compile_cache

HERE = pathlib.Path(__file__).resolve().parent

#: One process: enable the cache, compile and run a small `XlaBlockSparse` call, and report
#: JAX's cache hits and misses while compiling it.
_CHILD = r"""
import json, sys
import jax, jax.numpy as jnp
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
import eqx_bsattn as bsa
bsa.enable_compilation_cache(sys.argv[1])
attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), kernel=bsa.kernels.XlaBlockSparse())
q = k = v = jnp.ones((1, 40, 8))
lowered = jax.jit(attn).lower(q, k, v)
start = len(events)
compiled = lowered.compile()
jax.block_until_ready(compiled(q, k, v))
during = events[start:]
print(json.dumps({"hits": during.count("/jax/compilation_cache/cache_hits"),
                  "misses": during.count("/jax/compilation_cache/cache_misses")}))
"""


def _run_child(folder) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(folder)], capture_output=True,
                          text=True, cwd=HERE.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two child processes
def test_second_process_reads_the_cache(tmp_path):
    folder = tmp_path / "cache"
    first = _run_child(folder)
    assert first == {"hits": 0, "misses": 1}
    files = sorted(p.name for p in folder.iterdir())
    assert files, "the first process wrote nothing"
    second = _run_child(folder)
    assert second == {"hits": 1, "misses": 0}
    assert sorted(p.name for p in folder.iterdir()) == files  # read, not written again


@pytest.fixture
def restore_cache_options():
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    _compile_cache.compilation_cache.reset_cache()


def test_options_and_default_folder(tmp_path, monkeypatch, restore_cache_options):
    import platformdirs

    monkeypatch.setattr(platformdirs, "user_cache_dir", lambda name: str(tmp_path / name))
    folder = bsa.enable_compilation_cache(triton=False)
    assert folder == tmp_path / "eqx_bsattn" / "compilation" and folder.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(folder)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    bsa.enable_compilation_cache(tmp_path / "other", min_compile_time_secs=2,
                                 min_entry_size_bytes=100, triton=False)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "other")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == 100


@pytest.mark.parametrize("kwargs, name", [({"min_compile_time_secs": -1}, "min_compile_time"),
                                          ({"min_entry_size_bytes": 1.5}, "min_entry_size")])
def test_bad_options_are_named(tmp_path, kwargs, name, restore_cache_options):
    with pytest.raises(ValueError, match=name):
        bsa.enable_compilation_cache(tmp_path, **kwargs)


# --- The Triton kernels' PTX cache, against a stand-in for jax-triton 0.3.1 -------------------

#: The parts of jax_triton.triton_lib the cache wraps, shaped as in jax-triton 0.3.1: the kernel
#: function looks up `compile_ttir_inplace` in its module when it runs.
_FAKE_TRITON_LIB = r"""
compiles = []

class CompilationResult:
    def __init__(self, binary, name, shared_mem_bytes):
        self.binary, self.name, self.shared_mem_bytes = binary, name, shared_mem_bytes

def compile_ttir_inplace(ttir, backend, options, compute_capability, platform):
    compiles.append(str(ttir))
    return CompilationResult(f"ptx of {ttir} at {options}", "kernel_0d1d", 1024)

def get_or_create_triton_kernel(backend_init_func, platform, fn, arg_dtypes, scalar_args, *,
                                num_warps, num_stages, num_ctas, compute_capability,
                                enable_fp_fusion, metaparams, dump):
    ttir = f"ttir of {fn.__name__} {metaparams}"
    result = compile_ttir_inplace(ttir, None, num_warps, compute_capability, platform)
    attrs = {(i,): [["tt.divisibility", 16]] for i, d in enumerate(arg_dtypes) if d[0] == "*"}
    attrs[(len(arg_dtypes),)] = [("tt.pair", (1, 2))]
    kernel = triton_kernel_call_lib.TritonKernel(result.name, num_warps or 4, num_ctas,
                                                 result.shared_mem_bytes, result.binary, ttir,
                                                 compute_capability or 90)
    return kernel, attrs
"""


class _Kernel(tuple):
    def __new__(cls, *fields):
        return super().__new__(cls, fields)


@pytest.fixture
def fake_jax_triton(monkeypatch):
    triton_lib = types.ModuleType("jax_triton.triton_lib")
    triton_lib.triton_kernel_call_lib = types.SimpleNamespace(
        TritonKernel=_Kernel, get_compute_capability=lambda device: 90)
    exec(_FAKE_TRITON_LIB, vars(triton_lib))
    package = types.ModuleType("jax_triton")
    package.__version__ = "0.3.1"
    package.triton_lib = triton_lib
    triton = types.ModuleType("triton")
    triton.__version__ = "3.6.0"
    monkeypatch.setitem(sys.modules, "jax_triton", package)
    monkeypatch.setitem(sys.modules, "jax_triton.triton_lib", triton_lib)
    monkeypatch.setitem(sys.modules, "triton", triton)
    return triton_lib


def _launch(triton_lib, fn, **overrides):
    options = dict(num_warps=8, num_stages=3, num_ctas=1, compute_capability=None,
                   enable_fp_fusion=True, metaparams={"BLOCK": 128}, dump=False)
    options.update(overrides)
    return triton_lib.get_or_create_triton_kernel(None, "cuda", fn, ["*bf16", "i32"],
                                                  [(1, "i32", 7)], **options)


def test_triton_ptx_cache_across_processes(tmp_path, fake_jax_triton):
    fn = types.SimpleNamespace(__name__="fwd", __module__="kernels", cache_key="source-digest")
    assert _compile_cache.install_triton_cache(tmp_path)
    stats = dict(_compile_cache.triton_cache_stats)
    first = _launch(fake_jax_triton, fn)
    assert len(fake_jax_triton.compiles) == 1 and len(list(tmp_path.iterdir())) == 1
    # A new process: its in-memory caches are empty, the folder is not.
    again = _launch(fake_jax_triton, fn)
    assert len(fake_jax_triton.compiles) == 1, "the kernel was compiled again"
    assert again == first  # the same kernel and the same attributes, tuples kept
    assert again[1][(2,)] == [("tt.pair", (1, 2))]
    # Anything that shapes the PTX is part of the key.
    for change in ({"metaparams": {"BLOCK": 64}}, {"num_warps": 4}, {"compute_capability": 80}):
        _launch(fake_jax_triton, fn, **change)
    source_changed = types.SimpleNamespace(**{**vars(fn), "cache_key": "other-digest"})
    _launch(fake_jax_triton, source_changed)
    assert len(fake_jax_triton.compiles) == 5
    # A kernel with no source digest is never cached.
    _launch(fake_jax_triton, types.SimpleNamespace(__name__="fwd", __module__="kernels"))
    assert len(fake_jax_triton.compiles) == 6 and len(list(tmp_path.iterdir())) == 5
    assert _compile_cache.triton_cache_stats["hits"] - stats["hits"] == 1


def test_triton_ptx_cache_unreadable_file_is_a_miss(tmp_path, fake_jax_triton):
    fn = types.SimpleNamespace(__name__="fwd", __module__="kernels", cache_key="digest")
    assert _compile_cache.install_triton_cache(tmp_path)
    _launch(fake_jax_triton, fn)
    (entry,) = tmp_path.iterdir()
    entry.write_text("{ not json")
    _launch(fake_jax_triton, fn)
    assert len(fake_jax_triton.compiles) == 2
    assert json.loads(entry.read_text())["name"] == "kernel_0d1d"  # written again


def test_triton_ptx_cache_needs_its_jax_triton(tmp_path, fake_jax_triton, monkeypatch):
    monkeypatch.setattr(sys.modules["jax_triton"], "__version__", "0.4.0")
    original = fake_jax_triton.get_or_create_triton_kernel
    assert not _compile_cache.install_triton_cache(tmp_path)
    assert fake_jax_triton.get_or_create_triton_kernel is original
