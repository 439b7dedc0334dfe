"""Cost of preparing a mask for Splash attention on the CPU: ours against Splash's own.

For each pattern of `eqx_bsattn.bench` (causal, causal window 1024, document, BigBird) and
each length, with 128 x 128 blocks for the forward, dq and dk/dv passes and one head:

- **ours**: `ResolvedMask.compile` (the three `BlockLayout`s) and `block_info` for each pass
  (Splash's block-info arrays), as `SplashBlockSparse` reads them. Static masks are prepared
  at trace time in NumPy; the document mask from its segment ids on the device, inside
  `jax.jit`. Timed on a second call with a fresh mask; the first call in a process also
  compiles JAX's operations (and the jitted function): shown apart as "first call +".
- **Splash**: `process_mask` and `process_mask_dkv` of Splash's mask info module on the same
  mask as Splash's own mask objects: `CausalMask`, `LocalMask((1024, 0))`, and for document
  and BigBird (no mask class fits) a `NumpyMask` of the dense ``L x L`` mask, whose
  construction is not timed. Splash could also take the document mask as `CausalMask` plus
  `SegmentIds`, but then it visits every causal block rather than skipping other documents'.

Each cell runs in its own process under a time limit; a cell over it reads ``> N s``, and a
dense mask too large for this machine's memory reads ``(dense mask: N GiB)``.

Run from the repository root::

    python benchmarks/splash_mask_prep.py                       # 16k, 128k, 1M; 60 s limit
    python benchmarks/splash_mask_prep.py --lengths 16384 --limit 30

Not a test: numbers depend on the machine and its load.
"""

import argparse
import json
import os
import subprocess
import sys
import time

BLOCK = 128
PATTERNS = ("causal", "window", "document", "bigbird")
WINDOW = 1024


def _ours(pattern: str, length: int) -> dict:
    import jax
    import jax.numpy as jnp

    import eqx_bsattn as bsa
    from eqx_bsattn.bench import pattern as make_pattern
    from eqx_bsattn.strategies.kernels.splash.mask_info import block_info

    mask, data = make_pattern(pattern, length, window=WINDOW)
    tiling = bsa.Tiling(block_q=BLOCK, block_kv=BLOCK)
    n = length // BLOCK

    def prepare(data):
        resolved = bsa.ResolvedMask(mask, q_len=length, kv_len=length, num_heads=1, **data)
        compiled = resolved.compile(tiling, "terms")
        return [block_info(getattr(compiled, p), transposed=p == "dkv", num_q_blocks=n,
                           num_kv_blocks=n) for p in ("forward", "dq", "dkv")]

    if data:
        data = {name: jnp.asarray(ids)[None] for name, ids in data.items()}
        run = jax.jit(prepare)
    else:
        run = prepare
    times = []
    for _ in range(2):  # the first call compiles JAX's operations (and the jitted function)
        start = time.perf_counter()
        jax.block_until_ready(run(data))
        times.append(time.perf_counter() - start)
    return {"seconds": times[1], "first_call_extra": times[0] - times[1]}


def _dense_bytes(pattern: str, length: int) -> int:
    return length * length if pattern in ("document", "bigbird") else 0


def _splash(pattern: str, length: int) -> dict:
    import numpy as np
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as mask_lib,
        splash_attention_mask_info as info_lib,
    )

    import eqx_bsattn as bsa
    from eqx_bsattn.bench import pattern as make_pattern

    shape = (length, length)
    if pattern == "causal":
        mask = mask_lib.CausalMask(shape)
    elif pattern == "window":
        mask = mask_lib.LocalMask(shape, (WINDOW, 0), offset=0)
    else:
        ours, data = make_pattern(pattern, length, window=WINDOW)
        i = np.arange(length, dtype=np.int32)
        data = {name: np.asarray(ids)[None] for name, ids in data.items()}
        resolved = bsa.ResolvedMask(ours, q_len=length, kv_len=length, num_heads=1, **data)
        compiled = resolved.compile(bsa.Tiling(block_q=length, block_kv=length), "elements")
        ids = data.get("q_segment_ids")
        dense = np.asarray(compiled.visible(
            0, i[:, None], i[None, :],
            q_segment_ids=None if ids is None else ids[0],
            kv_segment_ids=None if ids is None else ids[0]))
        mask = mask_lib.NumpyMask(dense)
    heads = mask_lib.MultiHeadMask([mask])
    blocks = (BLOCK, BLOCK)
    start = time.perf_counter()
    info_lib.process_mask(heads, blocks)  # forward; the dq pass (same blocks) hits its cache
    info_lib.process_mask_dkv(heads, blocks)
    return {"seconds": time.perf_counter() - start}


def _cell(side: str, pattern: str, length: int, limit: float) -> str:
    dense = _dense_bytes(pattern, length) if side == "splash" else 0
    if dense > _memory_bytes() // 4:
        return f"(dense mask: {dense / 2**30:.0f} GiB)"
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import splash_mask_prep as m; print(json.dumps(m._{side}({pattern!r}, {length})))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=limit + (60 if side == "splash" else 900))
    except subprocess.TimeoutExpired:
        return f"> {limit:.0f} s"
    if done.returncode != 0:
        return "error: " + done.stderr.strip().splitlines()[-1]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["seconds"] > limit:
        return f"> {limit:.0f} s"
    text = f"{result['seconds']:.3g} s"
    if "first_call_extra" in result:
        text += f" (first call +{result['first_call_extra']:.2g} s)"
    return text


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 131072, 1048576])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS))
    parser.add_argument("--limit", type=float, default=60.0,
                        help="seconds per cell (its process may take longer to build the mask, untimed)")
    args = parser.parse_args()
    print("| pattern | L | ours | Splash's own |")
    print("| --- | --- | --- | --- |")
    for pattern in args.patterns:
        for length in args.lengths:
            ours = _cell("ours", pattern, length, args.limit)
            theirs = _cell("splash", pattern, length, args.limit)
            print(f"| {pattern} | {length // 1024}k | {ours} | {theirs} |", flush=True)


if __name__ == "__main__":
    main()
