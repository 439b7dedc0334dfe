"""Plotting a `BlockLayout` (needs matplotlib, from the `notebooks` extra)."""

import numpy as np

from ._layout import BlockLayout


def plot_layout(layout: BlockLayout, ax=None, *, batch: int = 0, head: int = 0, title: str | None = None):
    """Draw the block classes of one (batch, head) of `layout`: white EMPTY, light PARTIAL, dark FULL.

    Returns the matplotlib ``Axes``.

    ```python
    layout = build_layout(masks.Causal(), q_len=2048, kv_len=2048, num_heads=1,
                          block_q=128, block_kv=128)
    plot_layout(layout)
    ```
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    classes = np.asarray(layout.classes)
    b = batch if classes.shape[0] > 1 else 0
    h = head if classes.shape[1] > 1 else 0
    if ax is None:
        _, ax = plt.subplots(figsize=(4, 4))
    cmap = ListedColormap(["#ffffff", "#9ecae1", "#08519c"])
    ax.imshow(classes[b, h], cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
    ax.set_xlabel(f"kv block ({layout.block_kv} keys)")
    ax.set_ylabel(f"q block ({layout.block_q} queries)")
    density = float(np.mean(classes[b, h] != 0))
    ax.set_title(title or f"density {density:.3f}")
    return ax


def plot_score(score, *, num_heads: int, q_len: int = 64, kv_len: int | None = None,
               heads=None, axes=None):
    """Draw the term a score strategy adds to each logit, one panel per head.

    `score` is an `AbstractScore` (`scores.ALiBi`, `scores.RelativePositionBias`,
    `scores.ScoreFunction`: drawn on zero logits); the picture is ``[q_len, kv_len]`` of
    token indices, queries down, keys across. `heads` picks the heads drawn (default all).
    Returns the matplotlib ``Figure``.

    ```python
    plot_score(scores.ALiBi(), num_heads=4, q_len=32)
    ```
    """
    import jax.numpy as jnp
    import matplotlib.pyplot as plt

    from ._score import compile_score

    kv_len = q_len if kv_len is None else kv_len
    terms = compile_score(score, num_heads)
    heads = list(range(num_heads)) if heads is None else list(heads)
    head = jnp.asarray(heads, jnp.int32)[:, None, None]
    qp = jnp.arange(q_len, dtype=jnp.int32)[None, :, None]
    kp = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :]
    values = np.asarray(terms.apply(jnp.zeros((len(heads), q_len, kv_len)), head, qp, kp,
                                    batch=jnp.zeros((), jnp.int32)))  # the first sequence
    if axes is None:
        fig, axes = plt.subplots(1, len(heads), figsize=(2.6 * len(heads), 2.8), squeeze=False)
        axes = axes[0]
    else:
        fig = axes[0].figure
    for ax, h, term in zip(axes, heads, values):
        image = ax.imshow(term, cmap="RdBu_r", vmin=-np.abs(term).max(), vmax=np.abs(term).max(),
                          interpolation="nearest")
        ax.set_title(f"head {h}")
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        fig.colorbar(image, ax=ax, shrink=0.7)
    fig.suptitle(type(score).__name__)
    fig.tight_layout()
    return fig
