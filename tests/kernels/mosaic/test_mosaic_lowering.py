"""`MosaicBlockSparse` planned and lowered for a Hopper GPU on a host without one.

JAX lowers a program for a platform it does not run on (``lower(lowering_platforms=("cuda",))``),
and Pallas lowers Mosaic GPU kernels in Python, so on a CPU these tests check what the GPU
tests cannot check without a GPU: that each kernel lowers (forward, the dq and the dk/dv
launches) for masks, head dims, ragged lengths, grouped heads, segment ids, a soft cap and
ALiBi, and that the launch configurations a call builds are the same under `jax.jit` as
eagerly. The host is told it has a GPU: the default platform is "gpu", Mosaic GPU is taken
as runnable, and the GPU has an H200's 132 multiprocessors. Nothing here runs a kernel.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
import eqx_bsattn._layout as layout_internals
from eqx_bsattn import masks, scores
from eqx_bsattn._score_alibi import as_alibi
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse
from eqx_bsattn.strategies.kernels.mosaic import kernel as mosaic_kernel
from tests.conftest import widths_by_head, widths_by_key

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")



def _head_slopes(score, head, q_pos, k_pos):
    """Symmetric ALiBi written as a score function, ``score - 2^-(head + 1) |k - q|``: ALiBi
    on the pairs with k <= q, but not affine in the positions, so it runs as a function
    (ALiBi itself would run as built-in slopes: `as_alibi`)."""
    slope = jnp.exp2(-1.0 - jnp.asarray(head).astype(jnp.float32))
    return score - slope * jnp.abs(k_pos - q_pos).astype(jnp.float32)


def _hiding(score, head, q_pos, k_pos):
    """A tanh cap that hides every third key (-inf)."""
    return jnp.where(k_pos % 3 == 0, -jnp.inf, 4.0 * jnp.tanh(score / 4.0))


def _running_sum(score, head, q_pos, k_pos):
    """Not elementwise: a running sum along the keys (Mosaic GPU has no cumsum)."""
    return jnp.cumsum(score, axis=-1)


def _window_by_head(q, k, head):
    """A mask without terms that varies by head."""
    return (k <= q) & (q - k < 30 + 40 * head)


def _round_window(q, k):
    """A mask Mosaic GPU cannot lower: a window measured with a square root."""
    return jnp.sqrt(((q - k) * (q - k)).astype(jnp.float32)) < 50.0


def _inputs(batch, heads, kv_heads, q_len, kv_len, dim):
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = ((batch, heads, q_len, dim), (batch, kv_heads, kv_len, dim),
              (batch, kv_heads, kv_len, dim))
    return tuple(jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes))


def _launch_configs(monkeypatch, attn, q, k, v, jitted, **data):
    """The ``(forward, backward)`` launch configurations the call builds, eagerly or inside
    `jax.jit` (the kernels themselves are replaced by zeros)."""
    seen = []

    def record(fcfg, bcfg, q, k, v, *rest):
        seen.append((fcfg, bcfg))
        return jnp.zeros_like(q), jnp.zeros(q.shape[:3], jnp.float32)

    monkeypatch.setattr(mosaic_kernel, "_attend", record)
    call = (lambda q, k, v: attn(q, k, v, **data))
    (jax.jit(call) if jitted else call)(q, k, v)
    (configs,) = seen
    return configs


@pytest.mark.parametrize("mask, length, heads, kv_heads, persistent", [
    (masks.Causal() & masks.SlidingWindow(512, 0), 2048, 4, 4, ("dq", "dkv")),
    # A dk/dv item walks four query heads' lists of about 9 blocks: too long for it alone.
    (masks.Causal() & masks.SlidingWindow(512, 0), 2048, 8, 2, ("dq",)),
    (masks.Causal(), 8192, 4, 4, ()),
], ids=["window", "window_grouped_heads", "causal_long_lists"])
def test_launch_configs_same_under_jit(hopper_host, monkeypatch, mask, length, heads, kv_heads,
                                       persistent):
    """Each backward launch of a static mask is persistent where its work items visit few
    blocks, whether the call is traced or eager: the choice reads the layouts' counts on the
    host, never a product traced with them; a dk/dv item of grouped heads walks its group's
    lists."""
    attn = bsa.BlockSparseAttention(mask=mask, kernel=MosaicBlockSparse())
    q, k, v = _inputs(1, heads, kv_heads, length, length, 128)
    eager = _launch_configs(monkeypatch, attn, q, k, v, jitted=False)
    traced = _launch_configs(monkeypatch, attn, q, k, v, jitted=True)
    assert traced == eager
    assert eager[1].persistent == persistent and not eager[1].single_pass


LOWERED = {
    "causal": (masks.Causal(), dict(batch=1, heads=2, kv_heads=2, q_len=1024, kv_len=1024,
                                    dim=128), {}),
    "window_gqa": (masks.Causal() & masks.SlidingWindow(256, 0),
                   dict(batch=1, heads=4, kv_heads=2, q_len=1024, kv_len=1024, dim=128),
                   {}),
    "soft_cap_d64_ragged": (masks.Causal(bottom_right=True),
                            dict(batch=2, heads=2, kv_heads=1, q_len=200, kv_len=333, dim=64),
                            dict(logits_soft_cap=30.0)),
    "segment_ids": (masks.Causal(), dict(batch=2, heads=2, kv_heads=2, q_len=512, kv_len=512,
                                         dim=128), dict(segments=True)),
    # ALiBi's standard slopes (constants: no run-time check, which is a host callback that
    # JAX cannot lower for another platform), with a soft cap and grouped heads.
    "alibi_soft_cap_gqa": (masks.Causal(), dict(batch=1, heads=4, kv_heads=2, q_len=512,
                                                kv_len=512, dim=64),
                           dict(score=scores.ALiBi(), logits_soft_cap=20.0)),
    # Score functions: symmetric ALiBi with grouped heads; one that hides pairs, under a soft
    # cap, with segment ids and ragged lengths.
    "function_alibi_gqa": (masks.Causal() & masks.SlidingWindow(256, 0),
                           dict(batch=1, heads=4, kv_heads=2, q_len=1024, kv_len=1024,
                                dim=128), dict(score=scores.ScoreFunction(_head_slopes))),
    "function_hiding_soft_cap": (masks.Causal(), dict(batch=2, heads=2, kv_heads=2, q_len=300,
                                                      kv_len=300, dim=64),
                                 dict(score=scores.ScoreFunction(_hiding),
                                      logits_soft_cap=10.0, segments=True)),
    # Per-call positions (a layout built per call): ALiBi under a window, and a score
    # function under chunks, ragged keys.
    "positions_alibi_window": (masks.Causal() & masks.SlidingWindow(256, 0),
                               dict(batch=2, heads=2, kv_heads=1, q_len=512, kv_len=640,
                                    dim=128), dict(score=scores.ALiBi(), positions=True)),
    # Masks without terms (the element predicate on partial blocks): a predicate by head
    # with grouped heads; dilated keys or global tokens within documents, ragged; a causal
    # mask less a window at per-call positions, with a score function.
    "predicate_by_head_gqa": (masks.Predicate(_window_by_head),
                              dict(batch=1, heads=4, kv_heads=2, q_len=512, kv_len=512,
                                   dim=128), {}),
    # A mask per head, without terms shared by the heads: `where`s on the traced head.
    "per_head": (masks.PerHead([masks.Causal(), masks.Causal() & masks.Dilated(2)]),
                 dict(batch=1, heads=2, kv_heads=1, q_len=384, kv_len=384, dim=64), {}),
    # Masks whose predicate reads an array: the element map's tiles (a boolean array by
    # head, ragged; a predicate with params under per-call positions, grouped heads).
    "array_by_head": (masks.ArrayMask(np.random.default_rng(0).random((2, 200, 333)) < 0.3),
                      dict(batch=1, heads=2, kv_heads=1, q_len=200, kv_len=333, dim=64), {}),
    "predicate_params_positions": (masks.Predicate(widths_by_head, jnp.asarray([40, 90])),
                                   dict(batch=2, heads=2, kv_heads=2, q_len=300, kv_len=300,
                                        dim=128), dict(positions=True)),
    "dilated_or_global_documents": (((masks.Dilated(2) & masks.Causal()) | masks.GlobalTokens(8))
                                    & masks.Document(),
                                    dict(batch=2, heads=2, kv_heads=2, q_len=300, kv_len=300,
                                         dim=64), dict(segments=True)),
    "positions_not_window_function": (masks.Causal() & ~masks.SlidingWindow(20, 0),
                                      dict(batch=1, heads=2, kv_heads=1, q_len=300, kv_len=300,
                                           dim=64),
                                      dict(score=scores.ScoreFunction(_head_slopes),
                                           positions=True)),
    "positions_function_chunks": (masks.ChunkedCausal(96),
                                  dict(batch=1, heads=2, kv_heads=2, q_len=300, kv_len=300,
                                       dim=64),
                                  dict(score=scores.ScoreFunction(_head_slopes),
                                       positions=True)),
}


#: The quick tier's cases, one of each feature: a soft cap on ragged lengths, ALiBi with
#: grouped heads, a score function, per-call positions, an array's element map, a predicate's
#: per-head widths read in-kernel, a mask without terms traced within documents. The rest are
#: the full tier (`slow`).
QUICK_LOWERED = {"soft_cap_d64_ragged", "alibi_soft_cap_gqa", "function_alibi_gqa",
                 "positions_function_chunks", "array_by_head", "predicate_params_positions",
                 "dilated_or_global_documents"}


@pytest.mark.parametrize("case", [
    pytest.param(name, marks=() if name in QUICK_LOWERED else pytest.mark.slow)
    for name in LOWERED])
def test_forward_and_backward_lower_for_cuda(hopper_host, monkeypatch, case):
    """`jit(grad)` through the Mosaic kernels lowers for CUDA: three Mosaic GPU launches (the
    forward, dq and dk/dv; the deterministic backward, which every JAX runs), and the
    lowered program's outputs are the three gradients. A score function runs as one (none
    here is rewritten to built-in ALiBi)."""
    mask, shape, options = LOWERED[case]
    options = dict(options)
    if isinstance(options.get("score"), scores.ScoreFunction):
        heads = shape["heads"]
        assert as_alibi(options["score"].compile(heads), heads).function is not None
    data, constants = {}, {}
    if options.pop("segments", False):
        ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), -(-shape["q_len"] // 4))
        ids = ids[:shape["q_len"]]
        ids = jnp.broadcast_to(ids, (shape["batch"], shape["q_len"]))
        data = dict(q_segment_ids=ids, kv_segment_ids=ids)
    if options.pop("positions", False):
        # Constants: traced positions get a run-time range check, a host callback that JAX
        # cannot lower for another platform; so does the layout built on the device from
        # them (its capacity check), which is taken out here.
        monkeypatch.setattr(layout_internals.eqx, "error_if", lambda x, *_: x)
        constants = dict(q_positions=np.arange(shape["q_len"], dtype=np.int32) * 2 - 40,
                         kv_positions=np.arange(shape["kv_len"], dtype=np.int32) - 7)
    attn = bsa.BlockSparseAttention(mask=mask, kernel=MosaicBlockSparse(), **options)
    q, k, v = _inputs(**shape)
    loss = jax.jit(jax.grad(
        lambda q, k, v, data: jnp.sum(attn(q, k, v, **data, **constants).astype(jnp.float32)),
        argnums=(0, 1, 2)))
    lowered = loss.trace(q, k, v, data).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("custom_call @mosaic_gpu") == 3, case
    assert [o.shape for o in jax.tree.leaves(lowered.out_info)] == [q.shape, k.shape, v.shape]


def test_forward_mode_and_second_order_are_refused(hopper_host):
    """Forward mode through the kernel, and a gradient of its gradient, raise one line naming
    the kernel and the way out while the call is traced (nothing lowers or runs)."""
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=MosaicBlockSparse())
    q, k, v = _inputs(batch=1, heads=2, kv_heads=2, q_len=256, kv_len=256, dim=64)
    with pytest.raises(TypeError, match=r"MosaicBlockSparse has no forward-mode.*DenseRef"):
        jax.jit(lambda q: jax.jvp(lambda q: attn(q, k, v), (q,), (q,))).trace(q)

    def loss(q):
        return jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2)

    with pytest.raises(TypeError, match=r"MosaicBlockSparse has no second-order.*XlaBlock"):
        jax.jit(jax.grad(lambda q: jnp.sum(jax.grad(loss)(q).astype(jnp.float32)))).trace(q)


def test_score_function_mosaic_cannot_lower_is_declined(hopper_host):
    """A score function Pallas Mosaic GPU cannot lower gives the first line of the reason
    (once per function: the verdict is cached), and the call is refused in one line when the
    kernel is asked for it; a function with parameters that it lowers is taken
    (tests/kernels/mosaic/test_mosaic_data.py)."""
    from eqx_bsattn.strategies.kernels.mosaic.kernel import (
        _function_decline, function_lowering_failure, score_function)

    def term(fn):
        return score_function(scores.ScoreFunction(fn).compile(2))[0]

    assert score_function(None) == (None, None)
    assert term(_hiding) == term(_hiding) and hash(term(_hiding)) == hash(term(_hiding))
    assert _function_decline(term(_hiding), None, 64) is None
    why = _function_decline(term(_running_sum), None, 64)
    assert why.startswith("Pallas Mosaic GPU cannot lower the score function: ")
    assert "cumsum" in why and "\n" not in why
    # A primitive it has no lowering for is named, in one short line.
    frozen = lambda s, h, qp, kp: s + 0.1 * jax.lax.stop_gradient(s)  # noqa: E731
    assert _function_decline(term(frozen), None, 64) == (
        "Pallas Mosaic GPU cannot lower the score function: it applies `stop_gradient`, "
        "which it has no lowering for")
    hits = function_lowering_failure.cache_info().hits
    assert _function_decline(term(_running_sum), None, 64) == why
    assert function_lowering_failure.cache_info().hits == hits + 1
    scaled = score_function(scores.ScoreFunction(_scaled, {"w": jnp.ones(2)}).compile(2))[0]
    assert _function_decline(scaled, {"w": jnp.ones(2)}, 64) is None
    attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=MosaicBlockSparse(),
                                    score=scores.ScoreFunction(_running_sum))
    q, k, v = _inputs(1, 2, 2, 256, 256, 64)
    with pytest.raises(ValueError, match="cannot lower the score function: .*cumsum"):
        jax.jit(attn).trace(q, k, v)
    # The selector, at plan time: this kernel for a function it lowers (with parameters or
    # without), another (with the reason in `explain`) for one it cannot lower.
    for score, chosen, word in (
            (scores.ScoreFunction(_hiding), True, None),
            (scores.ScoreFunction(_running_sum), False, "cumsum"),
            (scores.ScoreFunction(_scaled, {"w": jnp.ones(2)}), True, None)):
        plan = bsa.BlockSparseAttention(mask=masks.Causal(), score=score).plan(q, k, v)
        assert (plan.choice.kernel.name == "mosaic") == chosen, plan.choice.explain()
        assert word is None or word in plan.choice.explain()


def _scaled(score, head, q_pos, k_pos, params):
    """A score function with parameters: one learned factor per head."""
    return score * params["w"][head]


@pytest.mark.slow
def test_masks_without_terms_run_their_predicate_or_its_element_map(hopper_host):
    """A mask without in-kernel terms goes to this kernel: its element predicate traced on
    the partial blocks (with a Predicate's per-head widths read in-kernel), or, where the
    predicate reads an array otherwise (an ArrayMask, a gather by the keys) or Pallas
    Mosaic GPU cannot lower it (the verdict cached per mask), the call's element map,
    unless that map would pass `ELEMENT_MAP_LIMIT`: then it is declined with the reason
    (the selector then picks another kernel)."""
    from eqx_bsattn.strategies.kernels.mosaic.kernel import (
        ELEMENT_MAP_LIMIT, mask_lowering_failure, mask_route)

    q, k, v = _inputs(1, 2, 2, 256, 256, 64)
    kernel = MosaicBlockSparse()
    for mask, from_map in ((masks.Predicate(_window_by_head), False),
                           (masks.Causal() & ~masks.SlidingWindow(20, 0), False),
                           ((masks.Dilated(2) & masks.Causal()) | masks.GlobalTokens(8), False),
                           (masks.ArrayMask(np.tri(256, dtype=bool)), True),
                           (masks.Predicate(widths_by_head, jnp.asarray([9, 30])), False),
                           (masks.Predicate(widths_by_key, jnp.asarray([9, 30])), True),
                           (masks.Predicate(_round_window), True)):
        plan = bsa.BlockSparseAttention(mask=mask).plan(q, k, v)
        assert plan.choice.kernel.name == "mosaic", plan.choice.explain()
        assert (mask_route(plan.mask.without_layouts(), 64).reads == "elements") == from_map, mask
    round_window = bsa.ResolvedMask(masks.Predicate(_round_window), q_len=256, kv_len=256,
                                    num_heads=2).predicate()
    assert "cannot lower the mask's element predicate: " in mask_lowering_failure(round_window)
    assert "sqrt" in mask_lowering_failure(round_window)
    hits = mask_lowering_failure.cache_info().hits
    assert mask_route(round_window, 64).reads == "elements"
    assert mask_lowering_failure.cache_info().hits == hits + 1
    # Element maps per batch row (per-call positions) and head past the limit: declined.
    length = 20480
    features = dict(platform="gpu", dtype="bfloat16", head_dim=64, value_dim=64, batch=2,
                    q_len=length, kv_len=length)
    size = 2 * 2 * 2 * 2 * length * length  # maps and their transposes, 16-bit, B = H = 2
    assert size > ELEMENT_MAP_LIMIT >= size // 2
    # Per-head widths are read in-kernel, with no element map: taken at any length.
    widths = bsa.ResolvedMask(masks.Predicate(widths_by_head, jnp.asarray([9, 30])),
                              q_len=length, kv_len=length, num_heads=2)
    assert kernel.decline_reason(widths, bsa.Features(**features, positions=True)) is None
    for mask, reason in ((masks.Predicate(widths_by_key, jnp.asarray([9, 30])),
                          "element predicate reads an array"),
                         (masks.PerHead([masks.Predicate(_round_window), masks.Causal()]),
                          "cannot lower the mask's element predicate: .*sqrt")):
        resolved = bsa.ResolvedMask(mask, q_len=length, kv_len=length, num_heads=2)
        assert kernel.decline_reason(resolved, bsa.Features(**features)) is None
        why = kernel.decline_reason(resolved, bsa.Features(**features, positions=True))
        assert why is not None and re.search(reason, why), why
        assert "element map would take 6.2 GiB" in why and "\n" not in why, why


#: attention-gym entries (tests/test_flex_catalogue.py) whose `from_flex` form
#: `MosaicBlockSparse` declines: a score function that reads params (rotary vectors) by the
#: positions, a gather, not a read at scalar indices. Masks that read params (a document
#: table, image intervals) run on their element maps.
GYM_DECLINED = {"rope_latent"}


def _gym_names():
    from tests.test_flex_catalogue import CATALOGUE

    return list(CATALOGUE)


#: The catalogue entries lowered in the full tier, one of each kind (a mask with terms, a
#: 2D neighbourhood, documents read from an array, a jagged batch, a score term, a soft cap,
#: one declined); the rest are the extended tier (each lowers three kernels for CUDA:
#: seconds on 2 cores).
GYM_FULL = {"causal", "natten", "document", "nested_jagged", "alibi", "tanh_softcap",
            "rope_latent"}


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[] if name in GYM_FULL else [pytest.mark.extended])
    for name in _gym_names()])
def test_attention_gym_catalogue_lowers_through_mosaic(hopper_host, monkeypatch, name):
    """Each attention-gym mask and score of the catalogue through `from_flex` (masks as
    `Predicate`s, scores as `ScoreFunction`s) runs in this kernel: `jit(grad)` lowers for CUDA
    (three Mosaic GPU launches), except the score functions that read params
    (`GYM_DECLINED`), which it declines with a reason."""
    from tests.test_flex_catalogue import B, CATALOGUE, H, HKV, _flex_form

    monkeypatch.setattr(layout_internals.eqx, "error_if", lambda x, *_: x)
    entry = CATALOGUE[name]
    kv_len = entry.kv_len or entry.q_len
    q, k, v = _inputs(B, H, HKV, entry.q_len, kv_len, 64)
    extra = {} if entry.call is None else {n: np.asarray(x) for n, x in entry.call().items()}
    attn = bsa.BlockSparseAttention(kernel=MosaicBlockSparse(), **_flex_form(entry))
    if name in GYM_DECLINED:
        with pytest.raises(ValueError, match="reads an array only as the Mosaic kernels cannot"):
            attn.plan(q, k, v, **extra)
        return
    loss = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        attn(q, k, v, **extra).astype(jnp.float32)), argnums=(0, 1, 2)))
    text = loss.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 3, name
