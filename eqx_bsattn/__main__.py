"""Demo: ``python -m eqx_bsattn``.

Runs one attention call (batch 1, float32, random inputs) under four masks at a realistic
length and, for each, prints how much of the attention matrix the mask leaves to compute, the
kernel the selector picked and why, the time against dense attention with the same mask, and
the largest error against the float32 reference. Runs on CPU in well under a minute.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import BlockSparseAttention, kernels, registered_kernels
from .bench import dense_mask, median_ms, pattern
from .contract import EMPTY, FULL, describe_terms

DESCRIPTIONS = {
    "causal": "each query sees every earlier key (causal)",
    "window": "causal, and only the last {window} keys (sliding window)",
    "document": "16 packed documents of random length (segment ids), causal inside each",
    "bigbird": "BigBird: causal; the diagonal block, the first 2 blocks and 3 random earlier "
               "blocks per row of 128-token blocks",
}

COLUMNS = """\
Columns:
  density   fraction of the (query block, key block) tiles the kernel visits; the rest are
            skipped, so the work is about density x dense attention
  kernel    the kernel the selector picked for this platform (reasons below)
  ours ms   median time of one jitted forward call of BlockSparseAttention
  dense ms  the same call through jax.nn.dot_product_attention (XLA) with the mask as a dense
            boolean [L, L] matrix: every pair computed, the masked ones thrown away
  speed-up  dense ms / ours ms
  max err   largest absolute difference from the DenseReference kernel (float32, dense) on the
            same inputs: the block-sparse result is exact up to rounding
"""


def _alternatives(chosen: str, platform: str) -> str:
    """Which registered kernels rank above or beside the chosen one, and why they did not run."""
    elsewhere = sorted(cls.name for cls in registered_kernels()
                       if cls.priority(platform) is None and cls.name != chosen)
    if not elsewhere:
        return ""
    return f"; not candidates on {platform}: {', '.join(elsewhere)}"


def why_line(name: str, plan) -> str:
    """A specific reason for one row: what the kernel is, what it skips, what it evaluates."""
    layout = plan.mask.forward
    classes = np.asarray(layout.classes)
    total, visited = classes.size, int(np.sum(classes != EMPTY))
    full, partial = int(np.sum(classes == FULL)), int(np.sum(classes != EMPTY) - np.sum(classes == FULL))
    kernel = plan.kernel.name
    if plan.choice is None:
        head = f"{kernel}: given explicitly"
    else:
        head = f"{kernel}: {plan.choice.reason}"
        if plan.choice.declined:
            head += " (declined: " + "; ".join(f"{n}: {w}" for n, w in plan.choice.declined) + ")"
    head += _alternatives(kernel, plan.features.platform)
    tiles = f"{layout.block_q}x{layout.block_kv}"
    detail = (f"visits {visited} of {total} {tiles} tiles ({full} fully visible, computed "
              f"without a mask; {partial} partly visible, masked element by element), skips "
              f"{total - visited}; mask terms evaluated in the partial tiles: "
              f"{describe_terms(plan.mask.terms)}")
    return f"{name}: {head}\n    {detail}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m eqx_bsattn", description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--length", type=int, default=4096,
                   help="sequence length L of queries and keys (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4,
                   help="number of attention heads H (default: %(default)s)")
    p.add_argument("--dim", type=int, default=64,
                   help="head dimension D of queries, keys and values (default: %(default)s)")
    p.add_argument("--window", type=int, default=256,
                   help="keys each query sees under the 'window' mask (default: %(default)s)")
    p.add_argument("--reps", type=int, default=3,
                   help="timed calls per measurement; the median is shown (default: %(default)s)")
    args = p.parse_args(argv)

    length, heads, dim = args.length, args.heads, args.dim
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, heads, length, dim), jnp.float32)
    k = jax.random.normal(keys[1], (1, heads, length, dim), jnp.float32)
    v = jax.random.normal(keys[2], (1, heads, length, dim), jnp.float32)
    q_blhd, k_blhd, v_blhd = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    device = jax.devices()[0]
    print(f"eqx_bsattn demo on {device.platform} ({device.device_kind}): one attention call with "
          f"batch 1, {heads} heads, {length} queries and keys, head dim {dim}, float32, random "
          "inputs.\n\nMasks:")
    for name, text in DESCRIPTIONS.items():
        print(f"  {name:<9} {text.format(window=args.window)}")
    print()
    print(COLUMNS)
    header = (f"{'mask':<10}{'density':>8}  {'kernel':<16}{'ours ms':>9}{'dense ms':>10}"
              f"{'speed-up':>9}{'max err':>10}")
    print(header)
    print("-" * len(header))
    reasons = []
    for name in DESCRIPTIONS:
        mask, data = pattern(name, length, window=args.window)
        data = {n: jnp.asarray(x)[None] for n, x in data.items()}
        attn = BlockSparseAttention(mask=mask)
        plan = attn.plan(q, k, v, **data)
        ours = jax.jit(lambda q, k, v, data, attn=attn: attn(q, k, v, **data))
        reference = BlockSparseAttention(mask=mask, kernel=kernels.DenseReference())
        out = ours(q, k, v, data)
        ref = reference(q, k, v, **data)
        err = float(jnp.max(jnp.abs(out - ref)))

        seg = data.get("q_segment_ids")
        visible = dense_mask(plan.mask.predicate, length, None if seg is None else seg[0])
        # jax.nn.dot_product_attention in its own [B, L, H, D] layout, transposed outside
        # the timed call.
        dense = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="xla",
                                          mask=visible[None, None]))

        ours_ms = median_ms(ours, (q, k, v, data), args.reps)
        dense_ms = median_ms(dense, (q_blhd, k_blhd, v_blhd), args.reps)
        density = float(plan.mask.forward.density())
        print(f"{name:<10}{density:>8.3f}  {plan.kernel.name:<16}{ours_ms:>9.1f}"
              f"{dense_ms:>10.1f}{dense_ms / ours_ms:>8.1f}x{err:>10.1e}")
        reasons.append(why_line(name, plan))
    print("\nWhy these kernels, and what they skip:")
    for line in reasons:
        print("  " + line)
    print("\nSwap the kernel or the tiling with eqx.tree_at, e.g. "
          "eqx.tree_at(lambda m: m.kernel, attn, bsa.kernels.DenseReference()); "
          "`python -m eqx_bsattn.bench --help` times more kernels.")


if __name__ == "__main__":
    main()
