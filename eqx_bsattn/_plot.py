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
