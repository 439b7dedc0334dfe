"""Draws docs/images/scores.png: each built-in score term's addition to the logits, per head.

    MPLBACKEND=Agg python docs/examples/score_gallery.py
"""

import pathlib

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import eqx_bsattn as bsa
from eqx_bsattn import scores


def penalty(s, head, q, k):
    """A score function: a square-root distance penalty, steeper for later heads."""
    return s - 0.5 * (head + 1) * jnp.sqrt(jnp.abs(q - k))


def main(path=pathlib.Path(__file__).parents[1] / "images" / "scores.png"):
    table = jnp.asarray(np.random.default_rng(0).standard_normal((4, 32)), jnp.float32)
    rows = [("ALiBi()", "ALiBi", scores.ALiBi()),
            ("RelativePositionBias(table, max_distance=32)", "relative bias",
             scores.RelativePositionBias(table, max_distance=32)),
            ("ScoreFunction(penalty)", "function", scores.ScoreFunction(penalty))]
    fig, axes = plt.subplots(len(rows), 4, figsize=(11, 8.4))
    for row, (_, label, score) in zip(axes, rows):
        bsa.plot_score(score, num_heads=4, q_len=48, axes=row)
        for h, ax in enumerate(row):
            ax.set_title(f"{label}, head {h}", fontsize=9)
    fig.suptitle("score terms per head, 48 tokens (queries down, keys across); rows: "
                 + "; ".join(name for name, _, _ in rows), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


if __name__ == "__main__":
    main()
