"""Benchmark: ``python -m eqx_bsattn.bench``.

For each pattern (causal, causal sliding window, document, BigBird) and length, times our
block-sparse kernels against the peers that can express the same mask, in one process:
`jax.nn.dot_product_attention` with cuDNN and with XLA, and Pallas' GPU flash attention.
Each is timed in its own input layout (ours ``[B, H, L, D]``, the peers ``[B, L, H, D]``), so
no transpose is inside a timed region. Forward and forward+backward; effective TFLOP/s count
only visible (query, key) pairs: ``2 * B * H * (D + Dv) * pairs`` forward (``Dv`` the value
head dim, ``--value-dim``; the peers run only where ``Dv == D``), 3.5 times that
forward+backward. Prints a table and writes JSON (``--out``) with the device and the versions.
Speed is measured here, never asserted in tests.

```
python -m eqx_bsattn.bench                                   # defaults for the platform
python -m eqx_bsattn.bench --lengths 16384 --batch 2 --heads 16 --dim 128 --dtype bfloat16
python -m eqx_bsattn.bench --kernels TritonBlockSparse MosaicBlockSparse --batch 32 --lengths 1024
```
"""

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import AbstractMask, BlockSparseAttention, ResolvedMask, default_platform, kernels, masks
from .contract import CompiledMask
from .timing import median_ms as median_ms

# ------------------------------------------------------------------------------------------------
# The patterns the demo, the benchmark and the scripts in benchmarks/ measure, defined once:
#
# - ``causal``: `Causal()`.
# - ``window``: `Causal() & SlidingWindow(window, 0)`.
# - ``document``: 16 documents of random length (segment ids), causal inside each.
# - ``bigbird``: 128-token blocks; causal; the diagonal block and the one before it, the first
#   2 blocks (global), and 3 random earlier blocks per row.


def document_segment_ids(length: int, num_documents: int = 16, seed: int = 0) -> np.ndarray:
    """``[length]`` int32 segment ids: `num_documents` contiguous documents of random length."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, length), size=num_documents - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [length]]))
    return np.repeat(np.arange(num_documents, dtype=np.int32), lengths)


def bigbird_mask(length: int, block: int = 128, num_global_blocks: int = 2, num_random: int = 3,
                 seed: int = 0) -> AbstractMask:
    """Causal BigBird at block granularity: the diagonal and previous block, the first
    `num_global_blocks` blocks, and `num_random` random earlier blocks per row of blocks."""
    n = -(-length // block)
    rows = np.arange(n)[:, None]
    cols = np.arange(n)[None, :]
    table = ((rows - cols) >= 0) & ((rows - cols) <= 1)
    table |= cols < num_global_blocks
    table |= masks.BigBirdRandom(block, num_random, seed=seed, causal=True).table(length, length)
    return masks.Causal() & masks.BlockLayoutMask(table, block)


def pattern(name: str, length: int, *, window: int = 1024, seed: int = 0) -> tuple[AbstractMask, dict]:
    """``(mask, per_call_kwargs)`` of a named pattern at `length` (kwargs: segment ids)."""
    if name == "causal":
        return masks.Causal(), {}
    if name == "window":
        return masks.Causal() & masks.SlidingWindow(window, 0), {}
    if name == "document":
        ids = document_segment_ids(length, seed=seed)
        return masks.Causal() & masks.Document(), {"q_segment_ids": ids, "kv_segment_ids": ids}
    if name == "bigbird":
        return bigbird_mask(length, seed=seed), {}
    raise ValueError(f"unknown pattern {name!r}; known: causal, window, document, bigbird.")


PATTERNS = ("causal", "window", "document", "bigbird")


# ------------------------------------------------------------------------------------------------
# Measuring.


def _predicate(mask: AbstractMask, q_len: int, kv_len: int) -> CompiledMask:
    """`mask` at these lengths as kernels read it, for its element predicate
    (`CompiledMask.visible`); no layout is built."""
    return ResolvedMask(mask, q_len=q_len, kv_len=kv_len, num_heads=1).compile(None, "dense")


def visible_pairs(mask, q_len: int, kv_len: int, segment_ids=None, rows_per_step: int = 512) -> int:
    """Exact number of visible (query, key) pairs of one (batch, head), evaluated in row chunks."""
    seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    predicate = _predicate(mask, q_len, kv_len)

    @jax.jit
    def count_rows(start):
        qi = start + jnp.arange(rows_per_step, dtype=jnp.int32)[:, None]
        kj = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
        vis = predicate.visible(0, qi, kj, q_segment_ids=seg, kv_segment_ids=seg)
        return jnp.sum(vis & (qi < q_len), dtype=jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)

    total = 0
    for start in range(0, q_len, rows_per_step):
        total += int(count_rows(jnp.int32(start)))
    return total


def dense_mask(mask, length: int, segment_ids=None):
    """The ``[length, length]`` boolean visibility of `mask` (one batch element, head 0)."""
    seg = None if segment_ids is None else jnp.asarray(segment_ids)
    index = jnp.arange(length)
    return _predicate(mask, length, length).visible(0, index[:, None], index[None, :],
                                                    q_segment_ids=seg, kv_segment_ids=seg)


def _with_backward(f: Callable) -> Callable:
    def fwd_bwd(q, k, v, do):
        out, pullback = jax.vjp(f, q, k, v)
        return pullback(do)

    return jax.jit(fwd_bwd)


#: Input layouts: ours take ``[B, H, L, D]``; `jax.nn.dot_product_attention` and Pallas' GPU
#: attention take ``[B, L, H, D]`` and are timed on inputs already in it.
BHLD, BLHD = "bhld", "blhd"


def _peers(name, mask, data, args, platform, layout_bhld) -> dict[str, tuple[Callable, str]]:
    """``{peer: (f, layout)}`` for every peer that expresses the pattern: ``f(q, k, v) -> out``
    on arrays in `layout` (each peer in its own layout, so no transpose is timed)."""
    peers = {}
    q_len = layout_bhld[2]
    terms = ResolvedMask(mask, q_len=q_len, kv_len=q_len, num_heads=1).terms
    options = None if data else kernels.cudnn_mask_options(terms, q_len)
    if platform == "gpu" and options is not None and args.dtype in ("bfloat16", "float16"):
        peers["cudnn"] = (functools.partial(
            jax.nn.dot_product_attention, implementation="cudnn", **options), BLHD)
    if q_len <= args.xla_max_len:
        if options is None:
            dense = dense_mask(mask, q_len, data.get("q_segment_ids"))
            options = {"mask": dense[None, None]}
        peers["xla"] = (functools.partial(
            jax.nn.dot_product_attention, implementation="xla", **options), BLHD)
    if platform == "gpu" and name in ("causal", "document"):
        try:
            from jax.experimental.pallas.ops.gpu import attention as pallas_attention
        except Exception:  # noqa: BLE001 - the peer is optional
            pallas_attention = None
        if pallas_attention is not None and layout_bhld[3] in (64, 128):
            seg = data.get("q_segment_ids")

            def pallas(q, k, v):
                segment_ids = None if seg is None else jnp.broadcast_to(
                    jnp.asarray(seg), (q.shape[0], q_len))
                return pallas_attention.mha(q, k, v, segment_ids,
                                            sm_scale=1.0 / math.sqrt(q.shape[-1]), causal=True)

            peers["pallas_mha"] = (pallas, BLHD)
    return peers


def _ours(args, platform) -> list:
    """Our kernels to time: those named by ``--kernels``, else the platform's usual one."""
    names = {"cpu": "XlaBlockSparse", "tpu": "XlaBlockSparse", "gpu": "TritonBlockSparse"}
    chosen = []
    for wanted in args.kernels or [names.get(platform, "XlaBlockSparse")]:
        cls = getattr(kernels, wanted, None)
        if cls is None:
            known = ", ".join(n for n in dir(kernels) if n[0].isupper())
            raise SystemExit(f"--kernels: unknown kernel {wanted!r}; known: {known}.")
        chosen.append(cls())
    return chosen


def environment() -> dict:
    """The device and the versions a run's numbers depend on, for its JSON."""
    from importlib import metadata

    device = jax.devices()[0]
    versions = {}
    for package in ("eqx_bsattn", "jax", "jaxlib", "equinox", "triton", "jax-triton"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return {"device": device.device_kind, "platform": device.platform,
            "device_count": jax.device_count(), "versions": versions}


def run(args) -> list[dict]:
    platform = args.platform or default_platform()
    dtype = jnp.dtype(args.dtype)
    ours = _ours(args, platform)
    records = []
    key = jax.random.key(args.seed)
    for length in args.lengths:
        for name in args.patterns:
            mask, data = pattern(name, length, window=args.window, seed=args.seed)
            head_options = [args.heads]
            if name == "causal" and args.gqa_kv_heads:
                head_options.append(args.gqa_kv_heads)
            pairs = visible_pairs(mask, length, length, data.get("q_segment_ids"))
            for kv_heads in head_options:
                keys = jax.random.split(jax.random.fold_in(key, length * 31 + kv_heads), 4)
                b, h, d = args.batch, args.heads, args.dim
                dv = args.value_dim or d
                q = jax.random.normal(keys[0], (b, h, length, d), dtype)
                k = jax.random.normal(keys[1], (b, kv_heads, length, d), dtype)
                v = jax.random.normal(keys[2], (b, kv_heads, length, dv), dtype)
                do = jax.random.normal(keys[3], (b, h, length, dv), dtype)
                call_data = {n: jnp.asarray(x) for n, x in data.items()}
                impls = {}
                for kernel in ours:
                    attn = BlockSparseAttention(mask=mask, kernel=kernel)

                    def call(q, k, v, attn=attn, call_data=call_data):
                        return attn(q, k, v, **call_data)

                    impls[f"ours:{kernel.name}"] = (call, BHLD)
                if kv_heads == args.heads and dv == d:
                    impls.update(_peers(name, mask, data, args, platform, q.shape))
                flops_fwd = 2.0 * b * h * (d + dv) * pairs
                reference_out = None
                native = {BHLD: (q, k, v, do),
                          BLHD: tuple(jnp.swapaxes(x, 1, 2) for x in (q, k, v, do))}
                for impl, (f, layout) in impls.items():
                    record = {
                        "pattern": name, "length": length, "batch": b, "heads": h,
                        "kv_heads": kv_heads, "dim": d, "value_dim": dv, "dtype": args.dtype,
                        "impl": impl,
                        "layout": layout, "platform": platform,
                        "density": pairs / float(length * length),
                    }
                    qi, ki, vi, doi = native[layout]
                    try:
                        fwd = jax.jit(f)
                        out = fwd(qi, ki, vi)
                        out = (out if layout == BHLD else jnp.swapaxes(out, 1, 2)).astype(jnp.float32)
                        if reference_out is None:
                            reference_out = out
                        else:
                            diff = jnp.linalg.norm(out - reference_out)
                            record["rel_diff_vs_ours"] = float(diff / jnp.linalg.norm(reference_out))
                        record["fwd_ms"] = median_ms(fwd, (qi, ki, vi), args.reps, warmup=2)
                        record["fwd_tflops"] = flops_fwd / record["fwd_ms"] / 1e9
                        if not args.forward_only:
                            record["fwdbwd_ms"] = median_ms(_with_backward(f), (qi, ki, vi, doi),
                                                            args.reps, warmup=2)
                            record["fwdbwd_tflops"] = 3.5 * flops_fwd / record["fwdbwd_ms"] / 1e9
                    except Exception as e:  # noqa: BLE001 - a failing peer is reported, not fatal
                        record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    records.append(record)
                    print(_row(record), flush=True)
    _add_ratios(records)
    return records


def _add_ratios(records: list[dict]) -> None:
    by_case = {}
    for r in records:
        by_case.setdefault((r["pattern"], r["length"], r["kv_heads"]), {})[r["impl"]] = r
    for (pat, length, kv_heads), impls in by_case.items():
        cudnn = impls.get("cudnn")
        causal = by_case.get(("causal", length, kv_heads), {})
        for r in impls.values():
            # Each of our kernels against itself on the causal mask at the same length.
            own_causal = causal.get(r["impl"]) if r["impl"].startswith("ours") else None
            for metric in ("fwd_tflops", "fwdbwd_tflops"):
                if cudnn and metric in r and metric in cudnn:
                    r[f"{metric}_vs_cudnn"] = r[metric] / cudnn[metric]
                if own_causal and metric in r and metric in own_causal:
                    r[f"{metric}_vs_own_causal"] = r[metric] / own_causal[metric]


def _row(r: dict) -> str:
    def fmt(key, spec="7.1f"):
        return format(r[key], spec) if key in r else "      -"

    return (
        f"{r['pattern']:>9} L={r['length']:<6} kvh={r['kv_heads']:<3} {r['impl']:<18} "
        f"dens={r['density']:.3f} fwd {fmt('fwd_ms', '8.2f')} ms {fmt('fwd_tflops')} TF/s | "
        f"fwd+bwd {fmt('fwdbwd_ms', '8.2f')} ms {fmt('fwdbwd_tflops')} TF/s"
        + (f"  ERROR {r['error']}" if "error" in r else "")
    )


def _table(records: list[dict]) -> str:
    lines = [
        "| pattern | L | kv heads | impl | layout | density | fwd TF/s | fwd+bwd TF/s | "
        "fwd / cuDNN | fwd+bwd / cuDNN | fwd / own causal | fwd+bwd / own causal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def f(r, key, spec=".1f"):
        return format(r[key], spec) if key in r else "-"

    for r in records:
        lines.append(
            f"| {r['pattern']} | {r['length']} | {r['kv_heads']} | {r['impl']} | "
            f"{r.get('layout', '-')} | {r['density']:.3f} | {f(r, 'fwd_tflops')} | {f(r, 'fwdbwd_tflops')} | "
            f"{f(r, 'fwd_tflops_vs_cudnn', '.2f')} | {f(r, 'fwdbwd_tflops_vs_cudnn', '.2f')} | "
            f"{f(r, 'fwd_tflops_vs_own_causal', '.2f')} | {f(r, 'fwdbwd_tflops_vs_own_causal', '.2f')} |"
            + (f" error: {r['error']}" if "error" in r else "")
        )
    return "\n".join(lines)


def parse_args(argv=None):
    platform = default_platform()
    gpu = platform == "gpu"
    p = argparse.ArgumentParser(
        prog="python -m eqx_bsattn.bench",
        description=" ".join(__doc__.split("\n\n")[1].split()),
        epilog=f"Defaults are for this platform ({platform}).",
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[16384] if gpu else [2048],
                   help="sequence lengths to time, one table row per pattern and length "
                        "(default: %(default)s)")
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS,
                   help="masks to time: causal, causal sliding window, 16 packed documents, "
                        "BigBird (default: all)")
    p.add_argument("--batch", type=int, default=2 if gpu else 1,
                   help="batch size B (default: %(default)s)")
    p.add_argument("--heads", type=int, default=16 if gpu else 4,
                   help="query heads H (default: %(default)s)")
    p.add_argument("--gqa-kv-heads", type=int, default=4 if gpu else 0,
                   help="also time causal with this many kv heads, grouped-query attention "
                        "(0: skip; default: %(default)s)")
    p.add_argument("--dim", type=int, default=128 if gpu else 64,
                   help="head dimension D (default: %(default)s)")
    p.add_argument("--value-dim", type=int, default=None,
                   help="the value's head dimension Dv (default: D); the peers need Dv == D")
    p.add_argument("--dtype", default="bfloat16" if gpu else "float32",
                   help="dtype of q, k, v, e.g. float32, bfloat16, float16 (default: %(default)s)")
    p.add_argument("--window", type=int, default=1024 if gpu else 256,
                   help="keys each query sees under the 'window' pattern (default: %(default)s)")
    p.add_argument("--reps", type=int, default=10 if gpu else 3,
                   help="timed calls per measurement; the median is reported (default: %(default)s)")
    p.add_argument("--xla-max-len", type=int, default=4096,
                   help="time the dense XLA peer only up to this length, since it materialises "
                        "L x L (default: %(default)s)")
    p.add_argument("--kernels", nargs="+", default=None,
                   help="our kernels to time, by class name, e.g. TritonBlockSparse "
                        "MosaicBlockSparse (default: TritonBlockSparse on a GPU, "
                        "XlaBlockSparse elsewhere)")
    p.add_argument("--platform", default=None,
                   help="platform the selector picks for: cpu, gpu or tpu (default: JAX's "
                        "default backend)")
    p.add_argument("--forward-only", action="store_true",
                   help="time the forward pass only (default: forward and forward+backward)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random inputs, document lengths and BigBird blocks "
                        "(default: %(default)s)")
    p.add_argument("--out", default=None,
                   help="write the records as JSON to this path (one object per pattern and "
                        "length; see notebooks/ for a plot of it)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    env = environment()
    versions = ", ".join(f"{n} {v}" for n, v in env["versions"].items())
    print(f"device: {env['device']} ({env['platform']}); {versions}")
    records = run(args)
    print()
    print(_table(records))
    print("\nEach implementation is timed in its own input layout (ours [B, H, L, D]; "
          "jax.nn.dot_product_attention and Pallas' attention [B, L, H, D]).")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({**env, "jax": jax.__version__, "records": records}, fh, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
