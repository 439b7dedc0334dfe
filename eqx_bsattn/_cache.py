"""The autotune cache: tuned tilings in one JSON file, shared by processes, read by the plan.

The file lives in the user's cache directory (`platformdirs.user_cache_dir`), or in the folder
that ``EQX_BSATTN_CACHE_DIR`` names. Entries are grouped by the call (device kind, kernel name,
version and fields, package version, dtype, shapes, features) and, inside that, by a digest of
the compiled mask. Writes take a lock, re-read the file, merge and replace it atomically; a
file that cannot be read is ignored with a warning, so the cache never fails a call.
``EQX_BSATTN_AUTOTUNE`` picks the policy of a plan whose module has no tiling.
"""

import contextlib
import contextvars
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import pathlib
import tempfile
import types
import warnings
from typing import Any

import jax
import numpy as np

from ._version import __version__

#: Folder of the cache file; default: the user's cache directory for eqx_bsattn.
CACHE_DIR_VARIABLE = "EQX_BSATTN_CACHE_DIR"
#: ``heuristics`` (never read the cache) or ``cache`` (the default: cache, then heuristics).
#: ``tune`` is deprecated: it reads as ``cache`` with a warning (a trace never tunes).
POLICY_VARIABLE = "EQX_BSATTN_AUTOTUNE"
POLICIES = ("heuristics", "cache")
FILE_NAME = "autotune.json"
FORMAT = "eqx_bsattn.autotune/1"

_policy_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "eqx_bsattn_tiling_policy", default=None
)


def cache_file() -> pathlib.Path:
    """Where the cache lives now: ``$EQX_BSATTN_CACHE_DIR/autotune.json``, else
    ``autotune.json`` in the user's cache directory for eqx_bsattn."""
    folder = os.environ.get(CACHE_DIR_VARIABLE)
    if not folder:
        import platformdirs  # imported on first use: plans that set the folder never need it

        folder = platformdirs.user_cache_dir("eqx_bsattn")
    return pathlib.Path(folder) / FILE_NAME


def tiling_policy() -> str:
    """The policy of a plan whose module has no tiling (``EQX_BSATTN_AUTOTUNE``)."""
    override = _policy_override.get()
    if override is not None:
        return override
    value = os.environ.get(POLICY_VARIABLE, "").strip().lower() or "cache"
    if value == "tune":
        warnings.warn(
            f"{POLICY_VARIABLE}=tune is deprecated and reads as 'cache': a trace never tunes. "
            "Run eqx_bsattn.autotune(attn, q, k, v) once before the trace; it writes the "
            "cache that untiled modules read.", DeprecationWarning, stacklevel=2)
        return "cache"
    if value not in POLICIES:
        raise ValueError(
            f"the environment variable {POLICY_VARIABLE} must be one of {', '.join(POLICIES)}; "
            f"got {os.environ[POLICY_VARIABLE]!r}."
        )
    return value


@contextlib.contextmanager
def policy(value: str):
    """Plans made inside use `value` as their tiling policy (autotune plans its candidates with
    ``"heuristics"``, so the heuristic is the reference of its checks)."""
    if value not in POLICIES:
        raise ValueError(f"the tiling policy must be one of {', '.join(POLICIES)}; got {value!r}.")
    token = _policy_override.set(value)
    try:
        yield
    finally:
        _policy_override.reset(token)


# ------------------------------------------------------------------------------------------------
# Keys.


def describe(x: Any, depth: int = 0) -> str:
    """A text that is equal for equal configurations in any process, and differs where they
    differ: classes by module and name, dataclass (`eqx.Module`) fields by name, concrete arrays
    by shape, dtype and a digest of their bytes, traced ones by shape and dtype, functions by
    their code, constants, closure and defaults. Never a Python id."""
    if depth > 32:
        return "..."
    deeper = functools.partial(describe, depth=depth + 1)
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return repr(x)
    if isinstance(x, (tuple, list)):
        return "(" + ",".join(map(deeper, x)) + ")"
    if isinstance(x, (set, frozenset)):  # iteration order differs between processes
        return "{" + ",".join(sorted(map(deeper, x))) + "}"
    if isinstance(x, (dict, types.MappingProxyType)):
        return "{" + ",".join(f"{deeper(k)}:{deeper(v)}" for k, v in sorted(x.items(), key=repr)) + "}"
    if isinstance(x, jax.core.Tracer):
        return f"array{tuple(x.shape)}{x.dtype}"
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        a = np.asarray(x)
        return f"array{a.shape}{a.dtype}:{hashlib.sha256(a.tobytes()).hexdigest()[:16]}"
    if isinstance(x, type):
        return f"{x.__module__}.{x.__qualname__}"
    if dataclasses.is_dataclass(x):
        fields = ",".join(f"{f.name}={deeper(getattr(x, f.name))}" for f in dataclasses.fields(x))
        return f"{describe(type(x))}({fields})"
    if isinstance(x, types.CodeType):
        return (f"code({x.co_code.hex()},{deeper(x.co_consts)},{deeper(x.co_names)},"
                f"{deeper(x.co_varnames)})")
    if isinstance(x, types.FunctionType):
        closure = tuple(c.cell_contents for c in x.__closure__ or ())
        return (f"{x.__module__}.{x.__qualname__}[{deeper(x.__code__)},{deeper(closure)},"
                f"{deeper(x.__defaults__)},{deeper(x.__kwdefaults__)}]")
    if isinstance(x, functools.partial):
        return f"partial({deeper(x.func)},{deeper(x.args)},{deeper(x.keywords)})"
    if isinstance(x, (types.BuiltinFunctionType, types.MethodType)):
        owner = getattr(x, "__self__", None)
        prefix = "" if owner is None or isinstance(owner, types.ModuleType) else deeper(owner) + "."
        return f"{prefix}{getattr(x, '__module__', None)}.{x.__qualname__}"
    wrapped = getattr(x, "__wrapped__", None)  # jit-wrapped and functools.wraps functions
    if callable(x) and wrapped is not None and wrapped is not x:
        return f"{describe(type(x))}<{deeper(wrapped)}>"
    text = repr(x)
    if " at 0x" in text:  # an id in the repr: keep the class and any name
        text = f"{getattr(x, '__module__', '')}.{getattr(x, '__qualname__', '')}"
    return f"{describe(type(x))}<{text}>"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def device_kind(platform: str) -> str:
    """The first device's kind on `platform` (e.g. ``"NVIDIA H200"``, ``"cpu"``), or the
    platform's name where it has no device here."""
    try:
        return jax.devices(platform)[0].device_kind
    except RuntimeError:
        return platform


#: The features a key names when set. `in_loop` changes the config a kernel runs
#: (`XlaBlockSparse` halves its slot), so a config tuned there is kept apart.
_FLAGS = ("bias", "sinks", "soft_cap", "segment_ids", "positions", "in_loop")


def call_key(kernel, features) -> str:
    """The part of a key that names the call without its mask (readable)."""
    f = features
    # Score terms change what a launch holds (a relative-bias table takes a tile of shared
    # memory), so a config tuned without them is not one for a call with them.
    score = [f"score={','.join(f.score)}"] if f.score else []
    flags = " ".join([name for name in _FLAGS if getattr(f, name)] + score) or "-"
    kernel_text = type(kernel).__qualname__ + describe(kernel)[len(describe(type(kernel))):]
    return " | ".join((
        device_kind(f.platform), f"eqx_bsattn {__version__}",
        f"{kernel.name} v{kernel.version} {kernel_text} {kernel.config_type.__name__}", f.dtype,
        f"B{f.batch} H{f.num_heads} Hkv{f.num_kv_heads} Lq{f.q_len} Lk{f.kv_len} "
        f"D{f.head_dim} Dv{f.value_dim}",
        flags,
    ))


def mask_key(resolved) -> str:
    """A digest of the resolved mask: its structure (classes, fields, code of functions) and,
    for a static mask with code or objects known only by their class, its block matrix at
    128x128 tiles. Masks that read per-call data (segment ids, positions) are keyed by their
    structure."""
    structure = describe(resolved.mask)
    parts = [structure, f"heads={resolved.num_heads}"]
    # Fields and arrays describe a mask fully; code (a predicate) and objects known only by
    # their class may not: then the block matrix joins the key.
    opaque = "code(" in structure or "<" in structure
    if opaque and resolved.is_static and not resolved.mask.uses_segment_ids:
        layout = resolved.layout(min(128, resolved.q_len), min(128, resolved.kv_len))
        parts.append(describe(np.asarray(layout.classes)))
    return _digest("\n".join(parts))[:32]


# ------------------------------------------------------------------------------------------------
# The file.


def _warn(message: str) -> None:
    warnings.warn(f"eqx_bsattn autotune cache: {message}", RuntimeWarning, stacklevel=3)


def _parse(path: pathlib.Path) -> tuple[dict, str | None]:
    """``(entries, problem)``: the file's entries, or ``{}`` and why they cannot be used
    (``None`` when the file is absent). Entries that are not ``{mask key: dict}`` are dropped,
    and `problem` says so."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, f"cannot read {path} ({e}); it is ignored."
    except UnicodeDecodeError as e:
        return {}, (f"{path} is not UTF-8 text ({e}); it is ignored and replaced on the next "
                    "write.")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply to parse
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        return {}, (f"{path} is not valid JSON ({why}); it is ignored and replaced on the next "
                    "write.")
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(
        data.get("entries"), dict
    ):
        return {}, f"{path} is not an eqx_bsattn autotune cache ({FORMAT}); it is ignored."
    entries, dropped = {}, 0
    for call, by_mask in data["entries"].items():
        if not isinstance(by_mask, dict):
            dropped += 1
            continue
        entries[call] = {mask: entry for mask, entry in by_mask.items() if isinstance(entry, dict)}
        dropped += len(by_mask) - len(entries[call])
    if dropped:
        return entries, (f"{path} holds {dropped} malformed entr{'y' if dropped == 1 else 'ies'} "
                         "(not a dict); ignored, and dropped on the next write.")
    return entries, None


_read_memo: dict[str, tuple[tuple, dict]] = {}


def read_entries(path: pathlib.Path | None = None) -> dict:
    """The cache's entries, ``{call key: {mask key: entry}}``; re-read when the file changes."""
    path = path or cache_file()
    try:
        stat = path.stat()
    except OSError:
        return {}
    stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
    memo = _read_memo.get(str(path))
    if memo is not None and memo[0] == stamp:
        return memo[1]
    entries, problem = _parse(path)
    if problem is not None:
        _warn(problem)
    _read_memo[str(path)] = (stamp, entries)
    return entries


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    """Hold an exclusive lock on ``path.lock`` (POSIX); elsewhere writes only merge."""
    try:
        import fcntl
    except ImportError:  # Windows: merge-on-write without a lock
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_entry(call: str, mask: str, entry: dict, path: pathlib.Path | None = None) -> bool:
    """Add one entry: lock, re-read, merge, write a temporary file and `os.replace` it.
    Returns whether it was written; a failure warns and returns ``False``."""
    path = path or cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            entries, problem = _parse(path)
            if problem is not None and "not an eqx_bsattn autotune cache" in problem:
                _warn(problem.replace("it is ignored", "it is left alone: nothing is written"))
                return False
            if problem is not None:
                _warn(problem)
            entries.setdefault(call, {})[mask] = entry
            data = {"format": FORMAT, "entries": entries}
            handle = tempfile.NamedTemporaryFile(
                "w", encoding="utf-8", dir=path.parent, prefix=path.name + ".", suffix=".tmp",
                delete=False,
            )
            try:
                with handle:
                    json.dump(data, handle, indent=1, sort_keys=True)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(handle.name, path)
            except BaseException:
                os.unlink(handle.name)
                raise
    except OSError as e:
        _warn(f"cannot write {path} ({e}); the tuned tiling is not kept.")
        return False
    return True


def tiling_to_json(config) -> dict:
    """A config's fields that are set, by name (what an entry's ``"tiling"`` holds)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) is not None}


def lookup(kernel, features, resolved, path: pathlib.Path | None = None):
    """The cached config of this call (a `kernel.config_type`), or ``None``. The mask is
    digested only when the file holds entries for the call; an entry the kernel cannot run is
    ignored with a warning."""
    path = path or cache_file()
    by_mask = read_entries(path).get(call_key(kernel, features))
    if not isinstance(by_mask, dict) or not by_mask:
        return None
    entry = by_mask.get(mask_key(resolved))
    if entry is None:
        return None
    try:
        tiling = kernel.config_type(**entry["tiling"])
        kernel.adapt_tiling(tiling, features)
    except (KeyError, TypeError, ValueError) as e:
        _warn(f"an entry of {path} cannot be used ({type(e).__name__}: {e}); the heuristic "
              "runs instead.")
        return None
    return tiling


def store(kernel, features, resolved, tiling, record: dict,
          path: pathlib.Path | None = None) -> bool:
    """Write the config `tiling` (and the timings in `record`) as this call's entry."""
    entry = dict(record, tiling=tiling_to_json(tiling),
                 written=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    return write_entry(call_key(kernel, features), mask_key(resolved), entry, path)
