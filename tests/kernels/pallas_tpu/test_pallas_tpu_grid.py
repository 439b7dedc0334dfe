"""`PallasTpuBlockSparse`'s launch grids where the layouts are built when the call runs (a
`Predicate` with per-head widths as `params`, per-call positions): the grid walks the call's
longest visit list, not the lists' capacity (every block of a row), so such a Predicate visits
as many grid steps as its built-in equal; and the answer stays the float64 oracle's when the
widths differ by head, are traced, and are swapped for wider ones without a retrace."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks
from eqx_bsattn.strategies.kernels.pallas_tpu.common import visits
from tests.conftest import jnp_attention_f64
from tests.kernels.pallas_tpu.test_pallas_tpu import TOL, _rel

BLOCK = 64
TILES = kernels.PallasTpuConfig(block_q=BLOCK, block_kv=BLOCK)


def window_params(q, k, params, head):
    """A causal window of ``width[head] + 1`` keys (the benchmark's form)."""
    return (k <= q) & (q - k <= params["width"][head])


def _visits(mask, length: int, heads: int):
    """The forward's and the dk/dv pass's `Visits`."""
    layout = bsa.ResolvedMask(mask, q_len=length, kv_len=length,
                              num_heads=heads).layout(BLOCK, BLOCK)
    return [visits(layout, transposed=t, rows=layout.num_q_blocks) for t in (False, True)]


def _steps(mask, length: int, heads: int):
    """``[(steps, width)]`` of the forward and the dk/dv pass: the grid's slots per row
    and the lists' width."""
    return [(int(np.asarray(v.steps)[0]), v.width) for v in _visits(mask, length, heads)]


def test_a_predicate_with_params_walks_as_many_steps_as_the_built_in_window():
    """At 1024 tokens in 64-token blocks the window of 128 visits 3 blocks a row; the
    Predicate's device-built lists have every block's capacity (16) but its grid walks 3
    slots a row, concrete or traced (under `eqx.filter_jit`), as the built-in one does."""
    length, heads = 1024, 4
    built_in = _steps(masks.Causal() & masks.SlidingWindow(128, 0), length, heads)
    pred = masks.Predicate(window_params, {"width": jnp.full((heads,), 128, jnp.int32)})
    assert built_in == [(3, 3), (3, 3)]
    assert _steps(pred, length, heads) == [(3, 16), (3, 16)]
    traced = eqx.filter_jit(
        lambda m: jnp.concatenate([v.steps for v in _visits(m, length, heads)]))
    assert np.asarray(traced(pred)).tolist() == [3, 3]
    # Each head's own width: the widest head sets the steps.
    wide = eqx.tree_at(lambda m: m.params["width"], pred,
                       jnp.asarray([0, 128, 300, 64], jnp.int32))
    assert np.asarray(traced(wide)).tolist() == [6, 6]


def _oracle(q, k, v, cot, widths):
    """Output and (q, k, v) gradients of the causal window of ``widths[h] + 1`` keys in
    float64."""
    lq = q.shape[2]
    i = np.arange(lq)
    visible = np.stack([(i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= w)
                        for w in widths])[None]
    with jax.enable_x64(True):
        a = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        c = jnp.asarray(np.asarray(cot, np.float64))

        def loss(q, k, v):
            out = jnp_attention_f64(q, k, v, visible)
            return jnp.vdot(out, c), out

        grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(*a)
        return np.asarray(out), [np.asarray(g) for g in grads]


@pytest.mark.slow
def test_traced_widths_swapped_for_wider_ones_match_the_oracle():
    """One compiled program (`eqx.filter_jit`, the widths traced) runs narrow per-head widths
    (2 slots a row) and then wider ones (4): the grid's length follows the data, so no
    block the wider widths need is left out, and the narrow run visits no more than it needs.
    Output and gradients against float64, at each."""
    heads, length, dim = 4, 256, 32
    rng = np.random.default_rng(3)
    q, k, v, cot = (jnp.asarray(rng.standard_normal((1, heads, length, dim)), jnp.float32)
                    for _ in range(4))

    @eqx.filter_jit
    def run(mask, q, k, v):
        def loss(q, k, v):
            attn = bsa.BlockSparseAttention(mask=mask, kernel=kernels.PallasTpuBlockSparse(),
                                            tiling=TILES)
            out = attn(q, k, v)
            return jnp.vdot(out, cot), out

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    mask = masks.Predicate(window_params, {"width": jnp.asarray([5, 40, 63, 17], jnp.int32)})
    for widths in ([5, 40, 63, 17], [0, 200, 130, 64]):
        mask = eqx.tree_at(lambda m: m.params["width"], mask, jnp.asarray(widths, jnp.int32))
        with jax.default_matmul_precision("highest"):
            grads, out = run(mask, q, k, v)
        want_out, want_grads = _oracle(q, k, v, cot, widths)
        errors = [_rel(out, want_out)] + [_rel(g, w) for g, w in zip(grads, want_grads)]
        assert max(errors) < TOL, (widths, errors)
    assert run._cached._cache_size() == 1
