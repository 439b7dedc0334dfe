"""Wall-clock timing of JAX calls, shared by the demo, the benchmark and autotune."""

import statistics
import time
from collections.abc import Callable

import jax


def median_ms(fn: Callable, args: tuple, reps: int, warmup: int = 1) -> float:
    """Median wall time in milliseconds of ``fn(*args)``, synchronised, after `warmup` calls
    (the first compiles)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
