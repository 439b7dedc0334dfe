"""Demo: ``python -m eqx_bsattn``.

For a few masks at a realistic length, prints the block density, the kernel the selector
picked and why, the time against dense attention with the same mask, and the largest error
against the float32 reference. Runs on CPU in well under a minute.
"""

import argparse
import functools

import jax
import jax.numpy as jnp

from . import BlockSparseAttention, kernels
from .bench import dense_mask, median_ms, nn_attention, pattern


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m eqx_bsattn", description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)

    length, heads, dim = args.length, args.heads, args.dim
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, heads, length, dim), jnp.float32)
    k = jax.random.normal(keys[1], (1, heads, length, dim), jnp.float32)
    v = jax.random.normal(keys[2], (1, heads, length, dim), jnp.float32)
    device = jax.devices()[0]
    print(f"eqx_bsattn demo on {device.platform} ({device.device_kind}): B=1, H={heads}, "
          f"L={length}, D={dim}, float32\n")
    header = f"{'mask':<10}{'density':>8}  {'kernel':<10}{'ours ms':>9}{'dense ms':>10}{'speed-up':>9}{'max err':>10}"
    print(header)
    print("-" * len(header))
    reasons = []
    for name in ("causal", "window", "document", "bigbird"):
        mask, data = pattern(name, length, window=args.window)
        data = {n: jnp.asarray(x)[None] for n, x in data.items()}
        attn = BlockSparseAttention(mask=mask)
        plan = attn.plan(q, k, v, **data)
        layout = plan.mask.forward  # the layout the forward pass walks
        ours = jax.jit(lambda q, k, v, data, attn=attn: attn(q, k, v, **data))
        reference = BlockSparseAttention(mask=mask, kernel=kernels.DenseReference())
        out = ours(q, k, v, data)
        ref = reference(q, k, v, **data)
        err = float(jnp.max(jnp.abs(out - ref)))

        seg = data.get("q_segment_ids")
        visible = dense_mask(plan.mask.predicate, length, None if seg is None else seg[0])
        dense = jax.jit(functools.partial(nn_attention, implementation="xla",
                                          mask=visible[None, None]))

        ours_ms = median_ms(ours, (q, k, v, data), args.reps)
        dense_ms = median_ms(dense, (q, k, v), args.reps)
        print(f"{name:<10}{float(layout.density()):>8.3f}  {plan.kernel.name:<10}{ours_ms:>9.1f}"
              f"{dense_ms:>10.1f}{dense_ms / ours_ms:>8.1f}x{err:>10.1e}")
        why = plan.choice.explain() if plan.choice is not None else "chosen explicitly"
        reasons.append(f"{name}: {why}")
    print("\nWhy these kernels:")
    for line in reasons:
        print("  " + line.replace("\n", "\n  "))


if __name__ == "__main__":
    main()
