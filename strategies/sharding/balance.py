"""Balanced dispatch: which slices of the sequence each device of a ring holds, so that every
device visits about as many blocks, whatever the mask."""

from typing import NamedTuple

import numpy as np


def balanced_chunks(work, devices: int) -> np.ndarray:
    """``[devices, c]`` chunk ids (each row sorted): ``len(work) / devices`` chunks per device,
    chosen so that the devices' summed `work` is as even as a greedy split can make it.

    `work` ``[num_chunks]``: the cost of each chunk (e.g. the visible blocks of its query
    rows). Chunks go heaviest first to the least loaded device that still has room, then
    pairs of chunks are swapped between the most and least loaded devices while that lowers
    the largest load.

    ```python
    rows = balanced_chunks(np.arange(16), 4)   # causal rows: each device gets ~30
    ```
    """
    work = np.asarray(work, np.float64)
    total = len(work)
    if devices < 1 or total % devices:
        raise ValueError(f"{total} chunks cannot be split evenly over {devices} devices.")
    per = total // devices
    load = np.zeros(devices)
    room = np.full(devices, per)
    owner = np.empty(total, np.int64)
    for c in np.argsort(-work, kind="stable"):
        d = int(np.argmin(np.where(room > 0, load, np.inf)))
        owner[c] = d
        load[d] += work[c]
        room[d] -= 1
    groups = [list(np.flatnonzero(owner == d)) for d in range(devices)]
    for _ in range(4 * devices):
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = load[hi] - load[lo]
        if gap <= 0:
            break
        a = np.asarray(groups[hi])
        b = np.asarray(groups[lo])
        # Swapping chunk i of `hi` with chunk j of `lo` moves d = w_i - w_j; the best d is
        # the one closest to gap / 2 (it must lie in (0, gap) to help).
        diff = work[a][:, None] - work[b][None, :]
        score = np.where((diff > 0) & (diff < gap), np.abs(diff - gap / 2), np.inf)
        i, j = np.unravel_index(int(np.argmin(score)), score.shape)
        if not np.isfinite(score[i, j]):
            break
        ca, cb = int(a[i]), int(b[j])
        groups[hi][i], groups[lo][j] = cb, ca
        load[hi] -= diff[i, j]
        load[lo] += diff[i, j]
    return np.sort(np.asarray(groups, np.int64), axis=1)


def chunk_order(chunks: np.ndarray, chunk: int) -> np.ndarray:
    """The token permutation of a chunk assignment: the sequence device by device, each
    device's chunks in order (``perm[i]`` is the call's token at position ``i``)."""
    starts = np.asarray(chunks).reshape(-1) * chunk
    return (starts[:, None] + np.arange(chunk)).reshape(-1)


def document_row_work(segment_ids, block: int) -> np.ndarray:
    """``[L / block]`` visible blocks of each query block of a causal document mask with
    sorted segment ids ``[L]`` (padding, negative, sees nothing), from the ids alone: key
    block ``j <= i`` is visible from query block ``i`` where they share a document."""
    ids = np.asarray(segment_ids).reshape(-1, block)
    lo = np.where(ids >= 0, ids, np.iinfo(np.int64).max).min(axis=1)
    hi = ids.max(axis=1)
    visible = np.tril((hi[None, :] >= lo[:, None]) & (lo[None, :] <= hi[:, None]))
    return visible.sum(axis=1) * (hi >= 0)


class Dispatch(NamedTuple):
    """A batch's tokens reordered for balanced devices (`dispatch_documents`).

    - `permutation` ``[B, L]``: position ``i`` of the reordered sequence holds the call's
      token ``permutation[b, i]`` (`jnp.take_along_axis` on the sequence axis).
    - `positions` ``[B, L]``: the tokens' positions in the user's order, to pass as
      `q_positions` and `kv_positions` with the reordered inputs, so that causal and
      position-reading masks and score terms keep their meaning.
    - `inverse` ``[B, L]``: ``out[:, :, inverse[b]]`` brings an output back to the user's
      order.
    - `work` ``[B, devices]``: visible blocks per device after the reordering.
    """

    permutation: np.ndarray
    positions: np.ndarray
    inverse: np.ndarray
    work: np.ndarray


def _host_tokens(name: str, x) -> np.ndarray:
    """`x` as a NumPy array of integers, or the `TypeError` saying why not."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"`{name}` must hold integers; got dtype {x.dtype.name} (cast it, e.g. "
                        "with `.astype(np.int32)`).")
    return x


def dispatch_documents(segment_ids, devices: int, *, block: int = 128,
                       positions=None) -> Dispatch:
    """Host-side balanced dispatch of packed documents (causal within each document) over a
    ring of `devices`: the sequence is cut into chunks of `block` tokens, each chunk weighed
    by the blocks its queries see, and the chunks dealt to devices (`balanced_chunks`) so
    that each device's visible blocks are close to the mean. Run it in the data loader; pass
    the reordered arrays, the segment ids reordered alike and the returned `positions` to a
    `RingAttention(..., order="contiguous")` call, and reorder its output back with
    `inverse`.

    `segment_ids` ``[B, L]`` integers (sorted, padding negative; one sequence is
    ``ids[None]``); `positions` ``[B, L]`` or ``[L]`` integers in ``[-2**30, 2**30 - 1]``, the
    tokens' positions (default: their indices). `devices` and `block` are positive ints, and
    ``L`` must be a multiple of ``devices * block``. Anything else is a one-line `ValueError`
    or `TypeError` naming the argument.

    ```python
    d = dispatch_documents(seg, 8)
    take = lambda x: jnp.take_along_axis(x, d.permutation[:, None, :, None], axis=2)
    out = attn(take(q), take(k), take(v), q_segment_ids=seg_p, kv_segment_ids=seg_p,
               q_positions=d.positions, kv_positions=d.positions)
    out = jnp.take_along_axis(out, d.inverse[:, None, :, None], axis=2)
    ```
    """
    for name, value in (("devices", devices), ("block", block)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be a positive int; got {value!r}.")
    segment_ids = _host_tokens("segment_ids", segment_ids)
    if segment_ids.ndim != 2:
        raise ValueError(f"`segment_ids` must have shape [batch, length]; got "
                         f"{segment_ids.shape} (one sequence: pass segment_ids[None]).")
    batch, length = segment_ids.shape
    if length % (devices * block):
        raise ValueError(f"the sequence ({length}) must be a multiple of devices x block "
                         f"({devices} x {block}) to be dealt in chunks of {block}.")
    if positions is None:
        positions = np.broadcast_to(np.arange(length), (batch, length))
    positions = _host_tokens("positions", positions)
    if positions.shape not in ((batch, length), (length,)):
        raise ValueError(f"`positions` must have shape [{batch}, {length}] or [{length}] "
                         f"(as `segment_ids`); got {positions.shape}.")
    # The reordered positions are returned as int32, for a call that accepts the range below.
    if positions.size and (positions.min() < -(2**30) or positions.max() > 2**30 - 1):
        raise ValueError("`positions` must lie in [-2**30, 2**30 - 1] (masks compare positions "
                         "in int32); got values outside.")
    positions = np.broadcast_to(positions, (batch, length))
    perms, works = [], []
    for b in range(batch):
        row = document_row_work(segment_ids[b], block)
        chunks = balanced_chunks(row, devices)
        perms.append(chunk_order(chunks, block))
        works.append(row[chunks].sum(axis=1))
    perm = np.stack(perms).astype(np.int32)
    inverse = np.argsort(perm, axis=1).astype(np.int32)
    return Dispatch(perm, np.take_along_axis(positions, perm, axis=1).astype(np.int32),
                    inverse, np.stack(works))
