"""The document (packed sequences) mask, from per-call segment ids."""

import jax.numpy as jnp

from eqx_bsattn._mask import AbstractMask, classify


class Document(AbstractMask):
    """A query sees a key only inside its own document: equal segment ids, both ``>= 0``.

    Reads the call's ``q_segment_ids`` / ``kv_segment_ids`` (negative ids mark padding). The
    layout is built on the device inside `jit`, so new segment ids never recompile. Passing
    segment ids to a call adds this mask automatically.

    ```python
    attn = BlockSparseAttention(mask=masks.Causal() & masks.Document())
    out = attn(q, k, v, q_segment_ids=ids, kv_segment_ids=ids)
    ```
    """

    _reads_segments = True

    def elements(self, q, k, head):
        if q.segment is None or k.segment is None:
            raise ValueError("`Document` needs `q_segment_ids` and `kv_segment_ids`.")
        return (q.segment == k.segment) & (q.segment >= 0)

    def blocks(self, q, k, head):
        if q.seg_lo is None or k.seg_lo is None:
            raise ValueError("`Document` needs `q_segment_ids` and `kv_segment_ids`.")
        single = (q.seg_lo == q.seg_hi) & (k.seg_lo == k.seg_hi)
        full = single & (q.seg_lo == k.seg_lo) & (q.seg_lo >= 0)
        empty = (
            (q.seg_hi < k.seg_lo) | (k.seg_hi < q.seg_lo) | (q.seg_hi < 0) | (k.seg_hi < 0)
        )
        return classify(full, jnp.asarray(empty))
