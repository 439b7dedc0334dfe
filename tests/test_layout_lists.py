"""Block lists built on the device (`_layout._jnp_lists`) against the host's (`_np_lists`):
both forms, the sort (rows up to `_SORT_LISTS` wide) and the scatter, on random class
matrices with empty and full rows, by row and by column."""

import jax.numpy as jnp
import numpy as np
import pytest

from eqx_bsattn import _layout


@pytest.mark.parametrize("sort_up_to", [0, 64])
@pytest.mark.parametrize("shape", [(2, 3, 7, 5),
                                   pytest.param((1, 2, 40, 33), marks=pytest.mark.slow),
                                   pytest.param((1, 1, 3, 1), marks=pytest.mark.slow)])
def test_device_lists_match_the_host_lists(monkeypatch, sort_up_to, shape):
    monkeypatch.setattr(_layout, "_SORT_LISTS", sort_up_to)
    rng = np.random.default_rng(sum(shape))
    classes = rng.integers(0, 3, shape).astype(np.int8)
    classes[..., 0, :] = 2  # a row every block of which is an entry
    classes[..., -1, :] = 0  # and one with none
    for by_column in (False, True):
        rows = np.swapaxes(classes, -1, -2) if by_column else classes
        for flag in (1, 2):
            hits = (rows == flag).reshape(-1, rows.shape[-1])
            capacity = max(int(hits.sum(-1).max()), 1)
            count, index = _layout._jnp_lists(jnp.asarray(classes), flag, capacity,
                                              by_column=by_column)
            np.testing.assert_array_equal(np.asarray(count).reshape(-1), hits.sum(-1))
            np.testing.assert_array_equal(np.asarray(index).reshape(-1, capacity),
                                          _layout._np_lists(hits, capacity))
