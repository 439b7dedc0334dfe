"""The lists' far splits (`contract.far_splits`) on the CPU: no Triton needed.

With a relative-bias table the kernels walk each list in three parts and take the table's
entry of the first and last parts as one scalar, so every pair of those tiles must be in the
part's bucket; these tests check that against T5's buckets of every pair.
"""

import jax
import numpy as np
import pytest

from eqx_bsattn.contract import RelativeBuckets, far_splits
from eqx_bsattn.strategies.kernels.triton import launch as tr
from tests.conftest import t5_bucket


def _sorted_lists(rng, rows: int, blocks: int, capacity: int):
    """``(count [1, 2, rows], index [1, 2, rows, capacity])``: sorted lists of distinct
    blocks, padded with 0."""
    count = rng.integers(0, capacity + 1, (1, 2, rows)).astype(np.int32)
    index = np.zeros((1, 2, rows, capacity), np.int32)
    for h in range(2):
        for r in range(rows):
            n = count[0, h, r]
            index[0, h, r, :n] = np.sort(rng.choice(blocks, n, replace=False))
    return count, index


@pytest.mark.parametrize("transposed", [False, True], ids=["by_queries", "by_keys"])
@pytest.mark.parametrize("buckets", [
    RelativeBuckets(32, True, 128), RelativeBuckets(32, False, 128), RelativeBuckets(8, True, 20),
    RelativeBuckets(12, False, 40), RelativeBuckets(4, True, 3)],
    ids=["t5", "t5_causal", "small", "small_causal", "tiny"])
@pytest.mark.parametrize("block_q,block_kv", [(16, 32), (64, 16), (128, 128)])
def test_far_parts_hold_one_bucket(transposed, buckets, block_q, block_kv):
    """Every pair of a far part's tiles is in that part's bucket, each tile left between is
    near the row, and the device's splits are the host's."""
    rng = np.random.default_rng(block_q + 3 * block_kv + 7 * transposed)
    length = 1024
    rows_block, entry_block = (block_kv, block_q) if transposed else (block_q, block_kv)
    rows, blocks = length // rows_block, length // entry_block
    full = _sorted_lists(rng, rows, blocks, min(blocks, 24))
    partial = _sorted_lists(rng, rows, blocks, min(blocks, 6))
    splits = far_splits(*full, *partial, transposed, block_q, block_kv, buckets)
    assert splits.shape == (1, 2, rows, 4) and splits.dtype == np.int32
    # Traced lists (a layout built per call) give the same splits on the device.
    traced = jax.jit(lambda *a: far_splits(*a, transposed, block_q, block_kv, buckets))(
        *full, *partial)
    np.testing.assert_array_equal(np.asarray(traced), splits)

    (ahead_gap, ahead), (behind_gap, behind) = buckets.far_buckets()
    low_bucket, high_bucket = (behind, ahead) if transposed else (ahead, behind)
    offsets = np.arange(rows_block)[:, None] - np.arange(entry_block)[None, :]
    parts_seen = set()
    for which, (count, index) in enumerate((full, partial)):
        for h in range(2):
            for r in range(rows):
                n = count[0, h, r]
                before, not_after = splits[0, h, r, 2 * which:2 * which + 2]
                assert 0 <= before <= not_after <= n
                for slot in range(n):
                    e = index[0, h, r, slot]
                    # q - k of every pair of the tile (rows are keys when transposed).
                    d = r * rows_block - e * entry_block + offsets
                    d = -d if transposed else d
                    got = t5_bucket(d, buckets.num_buckets, buckets.bidirectional,
                                    buckets.max_distance)
                    if slot < before:
                        assert (got == low_bucket).all(), (which, h, r, slot)
                    elif slot >= not_after:
                        assert (got == high_bucket).all(), (which, h, r, slot)
                    else:
                        # Near: neither every pair far before the query nor far after it.
                        assert d.min() < ahead_gap and d.max() > -behind_gap, (which, h, r, slot)
                    parts_seen.add(0 if slot < before else 2 if slot >= not_after else 1)
    assert parts_seen == {0, 1, 2}


@pytest.mark.parametrize("buckets", [
    RelativeBuckets(32, True, 128), RelativeBuckets(32, False, 128), RelativeBuckets(8, True, 20),
    RelativeBuckets(12, False, 40), RelativeBuckets(4, True, 3), RelativeBuckets(32, True, 256),
    RelativeBuckets(64, True, 1000)],
    ids=["t5", "t5_causal", "small", "small_causal", "tiny", "t5_256", "wide"])
def test_entries_by_distance_clamped_are_the_table(buckets):
    """A near tile's term, read from `entries_by_distance` at its distance clamped into
    `near_distances` (as the kernels read it), is the table's entry at T5's bucket for every
    distance, up to the ends of the position range."""
    rng = np.random.default_rng(buckets.num_buckets)
    table = rng.normal(size=(3, buckets.num_buckets)).astype(np.float32)
    entries = np.asarray(tr.entries_by_distance(table, buckets))
    lowest, count = tr.near_distances(buckets)
    assert entries.shape == (3, count) and entries.dtype == np.float32
    d = np.concatenate([np.arange(-4 * buckets.max_distance, 4 * buckets.max_distance),
                        [2**30, -(2**30), 2**30 - 1]])
    at = np.clip(d - lowest, 0, count - 1)
    want = table[:, t5_bucket(d, buckets.num_buckets, buckets.bidirectional,
                              buckets.max_distance)]
    np.testing.assert_array_equal(entries[:, at], want)


@pytest.mark.parametrize("devices,want", [
    ([("cpu", "")], True),
    ([("gpu", "cuda 13000")], True),
    ([("gpu", "rocm 60302")], False),
    ([("cpu", ""), ("gpu", "rocm 60302")], False),
], ids=["no_gpu", "cuda", "rocm", "rocm_after_cpu"])
def test_gpu_takes_ptx_by_the_platform_version(devices, want, monkeypatch):
    """The PTX load of a table's entries is used unless the GPU is a ROCm one, which JAX
    tells by its client's platform version; with no GPU (the CPU tools) it is used."""
    from types import SimpleNamespace

    fake = [SimpleNamespace(platform=p, client=SimpleNamespace(platform_version=v))
            for p, v in devices]
    monkeypatch.setattr(tr.jax, "devices", lambda: fake)
    tr.gpu_takes_ptx.cache_clear()
    try:
        assert tr.gpu_takes_ptx() is want
    finally:
        tr.gpu_takes_ptx.cache_clear()
