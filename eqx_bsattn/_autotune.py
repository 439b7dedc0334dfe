"""`autotune`: time a kernel's candidate configs on one call, check each against the heuristic
config's result, keep the fastest and write it to the cache, which the plan's `AutoTiling`
reads. The plan never imports this module: tuning happens before a trace, never inside one."""

import dataclasses
import sys
import time
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

from ._cache import cache_file, call_key, mask_key, policy, store
from ._module import BlockSparseAttention
from ._tiling import AbstractKernelConfig
from .timing import median_ms

#: Largest ``max |candidate - heuristic| / max |heuristic|`` over the output and the gradients
#: that a candidate may show, by dtype: a few roundings of the largest value, since tilings
#: only reorder the float32 sums (and, on GPUs, the TF32 roundings of float32 products).
TOLERANCES = {"float64": 1e-6, "float32": 2e-3, "float16": 1e-2, "bfloat16": 4e-2}


def _is_none(x) -> bool:
    return x is None


@dataclasses.dataclass(frozen=True)
class TilingTrial:
    """One candidate of an `autotune` run.

    - `tiling`: the candidate config as listed (the kernel's `adapt_tiling` may shrink it to
      run).
    - `origin`: ``"heuristic"``, ``"module"`` (the module's own), ``"kernel"``
      (`AbstractKernel.tiling_candidates`), ``"given"`` (the `candidates` argument) or
      ``"combined"`` (the fastest forward fields with the fastest backward fields).
    - `status`: ``"ok"``, ``"rejected"`` (the kernel cannot run it: `reason`), ``"failed"``
      (it did not compile or run: `reason`) or ``"wrong"`` (its output or gradients differ
      from the heuristic tiling's: `reason`, `error`).
    - `forward_ms`, `forward_backward_ms`: median wall times (``None`` where not measured).
    - `error`: ``max |difference| / max |value|`` against the heuristic tiling's output and
      gradients (0 for the heuristic itself).
    """

    tiling: AbstractKernelConfig
    origin: str
    status: str
    reason: str | None = None
    forward_ms: float | None = None
    forward_backward_ms: float | None = None
    error: float | None = None

    @property
    def tiling_text(self) -> str:
        """The config in one line (`AbstractKernelConfig.text`): ``"fwd 128x128 w8 s3 | dq
        128x64 w8 s3 | dk/dv ..."``."""
        return self.tiling.text()


@dataclasses.dataclass(frozen=True)
class AutotuneReport:
    """What `autotune` tried and found; ``print(report)`` shows it as a table.

    - `kernel`: the kernel's name; `cache_key`: the call's key in the cache and the mask's
      digest (`docs/autotune.md`).
    - `objective`: ``"forward+backward"`` or ``"forward"``: the time that picks the winner.
    - `trials`: a `TilingTrial` per candidate, the heuristic first.
    - `best`: the winning config; `tuning_seconds`: the wall time of the whole run.
    - `cache_file`: where the result was written (``None``: not written).
    - `untried`: runnable candidates left out by `max_candidates`.
    """

    kernel: str
    cache_key: str
    objective: str
    trials: tuple[TilingTrial, ...]
    best: AbstractKernelConfig
    tuning_seconds: float
    cache_file: str | None
    untried: int

    def _time(self, trial: TilingTrial) -> float | None:
        return trial.forward_backward_ms if self.objective == "forward+backward" else trial.forward_ms

    @property
    def heuristic(self) -> TilingTrial:
        """The heuristic tiling's trial (the reference of the checks)."""
        return self.trials[0]

    @property
    def winner(self) -> TilingTrial:
        """The winning trial."""
        return next(t for t in self.trials if t.status == "ok" and t.tiling == self.best)

    @property
    def speedup(self) -> float:
        """The heuristic's time over the winner's (by `objective`; >= 1)."""
        return self._time(self.heuristic) / self._time(self.winner)

    def __str__(self) -> str:
        def ms(x):
            return f"{x:10.3f}" if x is not None else " " * 9 + "-"

        texts = [t.tiling_text for t in self.trials]
        width = max(len(x) for x in texts + ["tiling"])
        lines = [
            f"autotune: kernel {self.kernel}, by {self.objective} time; {len(self.trials)} "
            f"candidates in {self.tuning_seconds:.1f} s",
            f"    {'tiling':<{width}}  {'fwd ms':>10}  {'fwd+bwd ms':>10}  result",
        ]
        winner = self.winner
        for trial, text in zip(self.trials, texts, strict=True):
            mark = "*" if trial is winner else " "
            result = f"{trial.status} ({trial.origin})"
            if trial.reason:
                result += f": {trial.reason}"
            lines.append(f"  {mark} {text:<{width}}  {ms(trial.forward_ms)}  "
                         f"{ms(trial.forward_backward_ms)}  {result}")
        if self.untried:
            lines.append(f"  ({self.untried} more runnable candidates not tried: max_candidates)")
        where = f"cached in {self.cache_file}" if self.cache_file else "not cached"
        lines.append(f"best: {self.best.text()}, {self.speedup:.2f}x the heuristic; {where}")
        return "\n".join(lines)


@jax.jit
def _relative_error(candidate, reference):
    a = candidate.astype(jnp.float32)
    b = reference.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(b)), jnp.finfo(jnp.float32).tiny)
    error = jnp.max(jnp.abs(a - b)) / scale
    return jnp.where(jnp.all(jnp.isfinite(a)), error, jnp.inf)


def _error(results, reference) -> float:
    return max(float(_relative_error(a, b)) for a, b in zip(results, reference, strict=True))


@eqx.filter_jit
def _forward(module, query, key, value, data):
    return (module(query, key, value, **data),)


@eqx.filter_jit
def _forward_backward(module, query, key, value, data, cotangent):
    out, pullback = jax.vjp(lambda q, k, v: module(q, k, v, **data), query, key, value)
    return (out, *pullback(cotangent))


def _failure(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"


class _Runner:
    """Runs, checks and times candidate tilings of one call."""

    def __init__(self, module, args, data, cotangent, backward, reps, tolerance):
        self.module, self.args, self.data, self.cotangent = module, args, data, cotangent
        self.backward, self.reps, self.tolerance = backward, reps, tolerance
        self.reference = None  # the heuristic's (forward, forward+backward) results

    def trial(self, tiling: AbstractKernelConfig, origin: str) -> TilingTrial:
        module = eqx.tree_at(lambda m: m.tiling, self.module, tiling, is_leaf=_is_none)
        passes = [("forward", _forward, ())]
        if self.backward:
            passes.append(("forward_backward", _forward_backward, (self.cotangent,)))
        times, results = {}, []
        for name, fn, extra in passes:

            def call(*args, fn=fn, module=module, extra=extra):
                return fn(module, *args, self.data, *extra)

            try:
                results.append(jax.block_until_ready(call(*self.args)))  # compiles
            except Exception as e:  # any compile or launch error: skip the candidate
                return TilingTrial(tiling, origin, "failed", _failure(e), **times)
            if self.reference is not None:
                error = _error(results[-1], self.reference[len(results) - 1])
                if not error <= self.tolerance:
                    return TilingTrial(
                        tiling, origin, "wrong",
                        f"{name.replace('_', '+')} differs from the heuristic tiling's by "
                        f"{error:.3g} (max |difference| / max |value|; tolerance "
                        f"{self.tolerance:g})", error=error, **times)
            times[f"{name}_ms"] = median_ms(call, self.args, self.reps)
        if self.reference is None:
            self.reference = results
            return TilingTrial(tiling, origin, "ok", error=0.0, **times)
        errors = [_error(r, ref) for r, ref in zip(results, self.reference, strict=True)]
        return TilingTrial(tiling, origin, "ok", error=max(errors), **times)


def _check_arguments(attn, candidates, backward, reps) -> None:
    if not isinstance(attn, BlockSparseAttention):
        raise TypeError(f"`attn` must be a BlockSparseAttention; got {type(attn).__name__}.")
    if candidates is not None:
        if isinstance(candidates, AbstractKernelConfig) or not isinstance(candidates, Sequence):
            raise TypeError(
                "`candidates` must be a sequence of configs (e.g. kernels.TritonConfig, Tiling) "
                f"or None; got {type(candidates).__name__}."
            )
        for tiling in candidates:
            if not isinstance(tiling, AbstractKernelConfig):
                raise TypeError(
                    "`candidates` must hold configs (AbstractKernelConfig instances, e.g. "
                    f"kernels.TritonConfig, Tiling); got {type(tiling).__name__}."
                )
    if not isinstance(backward, bool):
        raise TypeError(f"`backward` must be a bool; got {type(backward).__name__}.")
    if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
        raise ValueError(f"`reps` must be an int >= 1; got {reps!r}.")


def autotune(
    attn,
    query,
    key,
    value,
    *,
    candidates: Sequence[AbstractKernelConfig] | None = None,
    max_candidates: int | None = None,
    backward: bool = True,
    reps: int = 5,
    tolerance: float | None = None,
    cache: bool = True,
    progress: bool | None = None,
    **call_data,
):
    """Time candidate configs on one call's inputs; return the module with the fastest correct
    one, and a report.

    Candidates are the kernel's heuristic config, the module's own config if it has one, and
    the kernel's `AbstractKernel.tiling_candidates` for this call (or `candidates`); those the
    kernel rejects are listed with its reason. Each runnable candidate is compiled and run
    forward and forward+backward (``jax.vjp`` with a random cotangent) under ``jit``; its output
    and ``dq, dk, dv`` are checked against the heuristic config's, and one that differs by more
    than `tolerance` is rejected as wrong; one that fails to compile or run is skipped with the
    error. The median of `reps` timed runs ranks the rest. When the fastest forward and the
    fastest forward+backward are different candidates, their combination is tried too. The
    winner is written to the cache (`docs/autotune.md`), so a module whose tiling is
    `AutoTiling` picks it for these shapes and this mask from then on, in any process, also
    inside ``jit``. Call it outside ``jit``: it runs the candidates.

    Use real inputs or random ones (never zeros: every tiling gives zeros alike).

    **Arguments:**

    - `attn`: a `BlockSparseAttention` (its kernel, or the one the selector picks).
    - `query`, `key`, `value`, `**call_data`: one call's arguments (as for ``attn(...)``).
    - `candidates`: configs to try instead of the kernel's list (the kernel's `config_type`;
      another kernel's config or a `Tiling` gives its blocks, as in `adapt_tiling`).
    - `max_candidates`: time at most this many runnable candidates (the heuristic included),
      in the kernel's order (most promising first); default: all.
    - `backward`: rank by forward+backward time (default) or, if False, by forward time
      alone (then only the forward is run and checked).
    - `reps`: timed runs per candidate and pass.
    - `tolerance`: the largest ``max |difference| / max |value|`` allowed; default by dtype
      (`TOLERANCES`).
    - `cache`: write the winner to the cache file.
    - `progress`: show a progress bar (default: when stderr is a terminal).

    **Returns:** ``(tuned_attn, report)``: `attn` with the winning config, and an
    `AutotuneReport` (``print(report)`` shows the table).

    ```python
    tuned, report = bsa.autotune(attn, q, k, v)
    print(report)
    ```
    """
    _check_arguments(attn, candidates, backward, reps)
    start = time.perf_counter()
    plan_data = {n: x for n, x in call_data.items() if n != "purify"}
    untiled = eqx.tree_at(lambda m: m.tiling, attn, None, is_leaf=_is_none)
    with policy("heuristics"):
        plan = untiled.plan(query, key, value, **plan_data)
    kernel, features, resolved = plan.kernel, plan.features, plan.resolved
    if tolerance is None:
        tolerance = TOLERANCES.get(features.dtype, 2e-3)

    listed = [(kernel.default_tiling(features, resolved), "heuristic", None)]
    if isinstance(attn.tiling, AbstractKernelConfig):
        listed.append((attn.tiling, "module", None))
    if candidates is None:
        listed += [(t, "kernel", why) for t, why in kernel.tiling_candidates(features, resolved)]
    else:
        listed += [(t, "given", None) for t in candidates]
    rejected, runnable, seen = [], [], set()
    for tiling, origin, why in listed:
        if why is None:
            try:
                runs = kernel.adapt_tiling(tiling, features).explicit()
            except ValueError as e:
                why = str(e)
        if why is not None:
            rejected.append(TilingTrial(tiling, origin, "rejected", why))
        elif runs not in seen:
            seen.add(runs)
            runnable.append((tiling, origin))
    limit = len(runnable) if max_candidates is None else max(1, max_candidates)
    untried = max(0, len(runnable) - limit)
    runnable = runnable[:limit]

    cotangent = jax.random.normal(
        jax.random.key(0), query.shape[:-1] + (value.shape[-1],), jnp.float32
    ).astype(query.dtype)
    module = eqx.tree_at(lambda m: m.kernel, untiled, kernel, is_leaf=_is_none)
    runner = _Runner(module, (query, key, value), call_data, cotangent, backward, reps, tolerance)
    objective = "forward_backward_ms" if backward else "forward_ms"
    objective_name = "forward+backward" if backward else "forward"
    trials = []
    from tqdm import tqdm  # imported on first use, like the tuning itself

    bar = tqdm(total=len(runnable), desc=f"autotune {kernel.name}", unit="tiling",
               file=sys.stderr, leave=False, disable=None if progress is None else not progress)
    with bar:
        for tiling, origin in runnable:
            trials.append(runner.trial(tiling, origin))
            if trials[0].status != "ok":
                raise ValueError(
                    f"autotune: the heuristic config ({tiling.text()}) of kernel "
                    f"{kernel.name} does not run this call ({trials[0].reason}); candidates are "
                    "checked against its result."
                )
            ok = [t for t in trials if t.status == "ok"]
            bar.set_postfix_str(f"best {min(getattr(t, objective) for t in ok):.3f} ms")
            bar.update()
        ok = [t for t in trials if t.status == "ok"]
        fastest_forward = min(ok, key=lambda t: t.forward_ms)
        fastest = min(ok, key=lambda t: getattr(t, objective))
        if backward and fastest_forward is not fastest:
            base = fastest.tiling.explicit()
            forward_fields = {n: getattr(fastest_forward.tiling.explicit(), n)
                              for n in type(base).forward_fields}
            try:
                combined = dataclasses.replace(base, **forward_fields)
            except (TypeError, ValueError):  # configs of two types, or fields it refuses
                combined = None
            try:
                new = combined is not None and (
                    kernel.adapt_tiling(combined, features).explicit() not in seen)
            except ValueError:  # a pair of fields the kernel does not take together
                new = False
            if new:
                trials.append(runner.trial(combined, "combined"))
    winner = min((t for t in trials if t.status == "ok"), key=lambda t: getattr(t, objective))
    best = winner.tiling
    seconds = time.perf_counter() - start
    written = None
    if cache:
        heuristic = trials[0]
        record = {
            "objective": objective_name,
            "forward_ms": winner.forward_ms, "forward_backward_ms": winner.forward_backward_ms,
            "heuristic_forward_ms": heuristic.forward_ms,
            "heuristic_forward_backward_ms": heuristic.forward_backward_ms,
            "candidates": len(trials), "tuning_seconds": round(seconds, 2),
        }
        path = cache_file()
        # The config as the kernel runs it, of its `config_type`, which the cache reads back.
        runs = kernel.adapt_tiling(best, features)
        if store(kernel, features, resolved, runs, record, path):
            written = str(path)
    report = AutotuneReport(
        kernel=kernel.name,
        cache_key=f"{call_key(kernel, features)} | mask {mask_key(resolved)}",
        objective=objective_name,
        trials=tuple(trials + rejected),
        best=best,
        tuning_seconds=seconds,
        cache_file=written,
        untried=untried,
    )
    tuned = eqx.tree_at(lambda m: m.tiling, attn, best, is_leaf=_is_none)
    return tuned, report
