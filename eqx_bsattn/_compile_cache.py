"""`enable_compilation_cache`: JAX's persistent compilation cache, plus a disk cache for the
Triton kernels' own compilation, which JAX's cache does not hold.

What a new process still pays on its first call of a shape it has compiled before:

- JAX's cache stores the XLA executable, keyed by the lowered program. Tracing and lowering
  run in every process, before the key is known: the plan (mask resolution, block layouts
  built with NumPy, the autotune cache lookup) and the kernels' Python.
- jax-triton compiles each Triton kernel to PTX while lowering, and jaxlib assembles the PTX on
  the first launch; both caches live in the process. The disk cache here stores the PTX (per
  kernel source, signature, constants, launch options, compute capability, versions), so a
  new process skips Triton's compiler; the assembly at the first launch remains.
- Mosaic GPU kernels travel in the executable as MLIR and are compiled by jaxlib when the
  executable is loaded or first run, in every process.
"""

import hashlib
import json
import os
import pathlib
import tempfile
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

#: The jax-triton release whose lowering the Triton disk cache wraps (its function's signature).
_TRITON_CACHE_JAX_TRITON = "0.3.1"
_FORMAT = "eqx_bsattn.triton-ptx/1"

#: Hits and misses of the Triton disk cache in this process (``hits``, ``misses``, ``writes``).
triton_cache_stats: dict[str, int] = {"hits": 0, "misses": 0, "writes": 0}


def default_cache_dir() -> pathlib.Path:
    """The folder `enable_compilation_cache` uses when given none:
    ``compilation`` in the user's cache directory for eqx_bsattn (``platformdirs``)."""
    import platformdirs

    return pathlib.Path(platformdirs.user_cache_dir("eqx_bsattn")) / "compilation"


def enable_compilation_cache(
    path: str | os.PathLike | None = None,
    *,
    min_compile_time_secs: float = 0.0,
    min_entry_size_bytes: int = 0,
    triton: bool = True,
) -> pathlib.Path:
    """Keep compiled programs on disk, so a new process skips their compilation.

    Sets JAX's three options (``jax_compilation_cache_dir``,
    ``jax_persistent_cache_min_compile_time_secs``,
    ``jax_persistent_cache_min_entry_size_bytes``) for the whole process: every jitted program
    is cached, ours and the rest. With `triton` (and jax-triton 0.3.1 installed) it also keeps
    the PTX of `TritonBlockSparse`'s kernels under ``<path>/triton``, which JAX's cache does
    not hold. Call it once, early; programs compiled before the call are not written (a call
    compiles them again to write them), and calling again with another folder moves both
    caches.

    **Arguments:**

    - `path`: the folder; default `default_cache_dir()` (the user's cache directory). Created
      if missing. A shared file system works: JAX writes each entry atomically.
    - `min_compile_time_secs`: cache only programs that took at least this long to compile
      (JAX's default is 1 s; 0 keeps every program, the plan's small ones too).
    - `min_entry_size_bytes`: cache only entries at least this large (0: all).
    - `triton`: also keep the Triton kernels' PTX.

    **Returns:** the folder, as a `pathlib.Path`.

    ```python
    import eqx_bsattn as bsa
    bsa.enable_compilation_cache()            # before the first jit
    ```
    """
    folder = pathlib.Path(path) if path is not None else default_cache_dir()
    if not isinstance(min_compile_time_secs, int | float) or min_compile_time_secs < 0:
        raise ValueError(f"`min_compile_time_secs` must be a number >= 0; got "
                         f"{min_compile_time_secs!r}.")
    if not isinstance(min_entry_size_bytes, int) or min_entry_size_bytes < 0:
        raise ValueError(f"`min_entry_size_bytes` must be an int >= 0; got "
                         f"{min_entry_size_bytes!r}.")
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    # JAX reads 0 as "its default for the backend"; -1 means no minimum.
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", min_entry_size_bytes or -1)
    # JAX opens its cache folder once per process: start afresh, so a new folder takes effect.
    compilation_cache.reset_cache()
    if triton:
        install_triton_cache(folder / "triton")
    return folder


def _triton_kernel_key(fn, platform, arg_dtypes, scalar_args, options: dict) -> str | None:
    """A digest of everything that shapes a Triton kernel's PTX, or None where the kernel's
    source has no stable digest (then it is not cached)."""
    import jax_triton
    import jaxlib
    import triton

    source_key = getattr(fn, "cache_key", None)
    if not isinstance(source_key, str):
        return None
    parts = {
        "format": _FORMAT,
        "triton": triton.__version__,
        "jax_triton": jax_triton.__version__,
        "jaxlib": jaxlib.__version__,
        "fn": [getattr(fn, "__module__", ""), getattr(fn, "__name__", ""), source_key],
        "platform": platform,
        "arg_dtypes": [str(x) for x in arg_dtypes],
        "scalar_args": [[int(i), str(dtype), repr(value)] for i, dtype, value in scalar_args],
        "options": {name: repr(value) for name, value in sorted(options.items())},
        # Triton's own cache treats its TRITON_* settings as part of a kernel's identity.
        "environment": sorted((k, v) for k, v in os.environ.items() if k.startswith("TRITON_")),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _encode(value):
    """JSON for the specialisation attributes, keeping tuples apart from lists."""
    if isinstance(value, tuple):
        return {"tuple": [_encode(x) for x in value]}
    if isinstance(value, list):
        return [_encode(x) for x in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot store a {type(value).__name__}")


def _decode(value):
    if isinstance(value, dict):
        return tuple(_decode(x) for x in value["tuple"])
    if isinstance(value, list):
        return [_decode(x) for x in value]
    return value


def _write_json(file: pathlib.Path, record: dict) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record)  # before any file exists: a record JSON cannot hold leaves none
    with tempfile.NamedTemporaryFile("w", dir=file.parent, delete=False, suffix=".tmp") as f:
        f.write(text)
    os.replace(f.name, file)  # atomic: a reader sees the old file or the whole new one


def install_triton_cache(folder: str | os.PathLike) -> bool:
    """Keep the PTX jax-triton compiles while lowering in `folder` (one JSON file a kernel).

    Wraps jax-triton 0.3.1's kernel compilation in this process; returns False (and changes
    nothing) where jax-triton or Triton is missing or another release is installed. A file
    that cannot be read is a miss, and a failed write leaves the call as it was.
    """
    try:
        import jax_triton
        from jax_triton import triton_lib
    except Exception:  # not installed, or no GPU build of jaxlib: nothing to wrap
        return False
    if jax_triton.__version__ != _TRITON_CACHE_JAX_TRITON:
        return False
    original = triton_lib.get_or_create_triton_kernel
    state = getattr(original, "disk_cache_state", None)
    if state is not None:
        state["folder"] = pathlib.Path(folder)
        return True
    state = {"folder": pathlib.Path(folder)}

    def get_or_create(backend_init_func, platform, fn, arg_dtypes, scalar_args, *, num_warps,
                      num_stages, num_ctas, compute_capability, enable_fp_fusion, metaparams,
                      dump):
        kwargs = dict(num_warps=num_warps, num_stages=num_stages, num_ctas=num_ctas,
                      compute_capability=compute_capability,
                      enable_fp_fusion=enable_fp_fusion, metaparams=metaparams, dump=dump)
        call = (backend_init_func, platform, fn, arg_dtypes, scalar_args)
        try:
            if compute_capability is None:  # jax-triton asks device 0, as here
                compute_capability = triton_lib.triton_kernel_call_lib.get_compute_capability(0)
            options = dict(num_warps=4 if num_warps is None else num_warps,
                           num_stages=3 if num_stages is None else num_stages,
                           num_ctas=num_ctas, compute_capability=compute_capability,
                           enable_fp_fusion=enable_fp_fusion,
                           metaparams=sorted(metaparams.items()))
            key = None if dump else _triton_kernel_key(fn, platform, arg_dtypes, scalar_args,
                                                       options)
        except Exception:
            key = None
        if key is None:
            return original(*call, **kwargs)
        file = state["folder"] / f"{key}.json"
        record = _read_record(file)
        if record is not None:
            triton_cache_stats["hits"] += 1
            kernel = triton_lib.triton_kernel_call_lib.TritonKernel(
                record["name"], record["num_warps"], record["num_ctas"],
                record["shared_mem_bytes"], record["ptx"], record["ttir"],
                record["compute_capability"])
            attrs = {(int(i),): _decode(value) for i, value in record["attrs"]}
            return kernel, attrs
        triton_cache_stats["misses"] += 1
        compiled: list[tuple[Any, str]] = []
        compile_ttir = triton_lib.compile_ttir_inplace

        def recording(ttir, *args, **kw):
            text = str(ttir)  # before the passes change the module in place, as jax-triton
            result = compile_ttir(ttir, *args, **kw)
            compiled.append((result, text))
            return result

        triton_lib.compile_ttir_inplace = recording
        try:
            kernel, attrs = original(*call, **kwargs)
        finally:
            triton_lib.compile_ttir_inplace = compile_ttir
        if len(compiled) == 1 and platform == "cuda":
            result, ttir = compiled[0]
            try:
                _write_json(file, {
                    "format": _FORMAT, "name": result.name, "num_warps": options["num_warps"],
                    "num_ctas": num_ctas, "shared_mem_bytes": int(result.shared_mem_bytes),
                    "ptx": result.binary, "ttir": ttir,
                    "compute_capability": int(compute_capability),
                    "attrs": [[i, _encode(value)] for (i,), value in attrs.items()],
                })
                triton_cache_stats["writes"] += 1
            except (OSError, TypeError, ValueError):
                pass  # an unwritable folder or an attribute that JSON cannot hold: not cached
        return kernel, attrs

    get_or_create.disk_cache_state = state
    triton_lib.get_or_create_triton_kernel = get_or_create
    return True


def _read_record(file: pathlib.Path) -> dict | None:
    try:
        with open(file) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != _FORMAT:
        return None
    return record
