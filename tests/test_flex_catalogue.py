"""The attention-gym catalogue of FlexAttention ``mask_mod`` and ``score_mod`` functions, each
written here in JAX and run two ways: through `masks.from_flex` / `scores.from_flex`, and in
the library's own terms (a built-in mask or score) where one says the same. Every form is
checked against the float64 oracle, forward and the q, k, v gradients (and the params'
where a score_mod reads learned arrays), through each CPU kernel that takes it
(`XlaBlockSparse`, `DenseReference`). docs/flex.md lists the catalogue.

The default tier runs a few entries through `XlaBlockSparse` (one small shape each; the quick
tier one of them); the product of every entry, form and kernel is the extended tier.
"""

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
from tests.conftest import assert_close, jnp_attention_f64

B, H, HKV, D = 2, 4, 2, 8


def _gym_catalogue():
    """benchmarks/gym_catalogue.py (the functions), imported by path: benchmarks/ is no
    package."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gym_catalogue.py"
    spec = importlib.util.spec_from_file_location("gym_catalogue", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gym = _gym_catalogue()


# ---------------------------------------------------------------------------------------------
# The catalogue.


@dataclasses.dataclass(frozen=True)
class Entry:
    """One attention-gym function and its forms. `ours` builds the library's own form
    (``dict(mask=..., score=..., logits_soft_cap=...)``), ``None`` where only `from_flex`
    expresses it; `call` gives the call's extra arguments (segment ids, positions)."""

    mask_mod: Callable | None = None
    score_mod: Callable | None = None
    params: Any = None
    ours: Callable | None = None
    q_len: int = 48
    kv_len: int | None = None
    call: Callable | None = None
    default: bool = False  # in the default tier (through XlaBlockSparse, the from_flex form)


DOC = np.repeat(np.arange(4), [9, 17, 5, 17])  # 48 tokens in 4 documents
OFFSETS = np.concatenate([[0], np.cumsum(np.bincount(DOC))])
SEGMENTS = dict(q_segment_ids=np.stack([DOC] * B), kv_segment_ids=np.stack([DOC] * B))
_rope = jax.random.normal(jax.random.key(9), (B, H + HKV, 48, 4)) * 0.5
ROPE = (_rope[:, :H], _rope[:, H:])

CATALOGUE = {
    # masks
    "causal": Entry(gym.causal, ours=lambda: dict(mask=masks.Causal())),
    "noop": Entry(gym.noop_mask, ours=lambda: dict(mask=masks.Full())),
    "sliding_window": Entry(gym.sliding_window(8),
                            ours=lambda: dict(mask=masks.Causal() & masks.SlidingWindow(8, 0))),
    "prefix_lm": Entry(gym.prefix_lm(10), ours=lambda: dict(mask=masks.PrefixLM(10))),
    "prefix_lm_inclusive": Entry(gym.prefix_lm(10, True),
                                 ours=lambda: dict(mask=masks.PrefixLM(11))),
    "decode_offset": Entry(gym.decode_offset(5), ours=lambda: dict(mask=masks.Causal(offset=5)),
                           q_len=8),
    "document": Entry(gym.document_causal, params=jnp.asarray(DOC), default=True,
                      ours=lambda: dict(mask=masks.Document() & masks.Causal()),
                      call=lambda: SEGMENTS),
    "nested_jagged": Entry(gym.nested_causal,
                           params={"seq": jnp.asarray(DOC), "offsets": jnp.asarray(OFFSETS)},
                           ours=lambda: dict(mask=masks.Document() & masks.Causal()),
                           call=lambda: SEGMENTS),
    "dilated_sliding_window": Entry(gym.dilated_window(12, 3), ours=lambda: dict(
        mask=masks.SlidingWindow(12, 12) & masks.Dilated(3))),
    "batchify_causal": Entry(gym.batchify_causal(16),
                             ours=lambda: dict(mask=masks.ChunkedCausal(16))),
    "natten": Entry(gym.natten(8, 8, 3, 3), q_len=64),
    "tiled_natten": Entry(gym.tiled_natten(8, 8, 3, 3, 4, 4), q_len=64),
    "morton_natten": Entry(gym.morton_natten(8, 8, 3, 3), q_len=64),
    "sasa": Entry(gym.sasa(8, 1), q_len=64),
    "sta_2d": Entry(gym.sta((8, 8), (4, 4), (2, 2), 8), q_len=72),
    "sta_3d": Entry(gym.sta((2, 4, 4), (2, 2, 2), (1, 2, 2), 8), q_len=40),
    "svg_spatial": Entry(gym.svg_spatial(6, 10, 1, True, 4), q_len=46),
    "svg_temporal": Entry(gym.svg_temporal(6, 4, 10, 2), q_len=46),
    "vision_cross_attention": Entry(
        gym.vision_cross_attention, q_len=24, kv_len=15, default=True,
        params={"intervals": jnp.array([[0, 7], [7, 15], [15, 20]]),
                "image": jnp.repeat(jnp.arange(3), 5)}),
    # scores
    "alibi": Entry(gym.causal, gym.alibi(H),
                   ours=lambda: dict(mask=masks.Causal(), score=scores.ALiBi())),
    "tanh_softcap": Entry(None, gym.tanh_softcap(2.0), ours=lambda: dict(logits_soft_cap=2.0)),
    "relative_bias": Entry(None, gym.relative_bias),
    "head_bias": Entry(None, gym.head_bias),
    "checkerboard": Entry(None, gym.checkerboard),
    "causal_bias": Entry(None, gym.causal_bias, ours=lambda: dict(mask=masks.Causal())),
    "alibi_and_causal": Entry(None, gym.alibi_and_causal(H), ours=lambda: dict(
        mask=masks.Causal(), score=scores.ALiBi())),
    "noop_score": Entry(None, gym.noop_score, ours=lambda: {}),
    "rope_latent": Entry(gym.causal, gym.rope_latent(H // HKV, 0.5), params=ROPE, default=True),
    "decode_offset_score": Entry(None, gym.relative_bias_offset(40), q_len=8, ours=lambda: dict(
        score=scores.from_flex(gym.relative_bias)), call=lambda: dict(
        q_positions=np.broadcast_to(np.arange(8) + 40, (B, 8)))),
}


def _flex_form(entry: Entry) -> dict:
    """The module's fields for `entry` through `from_flex`; params go to the function that
    reads them (the mask_mod, or the score_mod when it takes them)."""
    fields = {}
    score_params = entry.params if entry.score_mod is not None and entry.mask_mod in (
        None, gym.causal) else None
    if entry.mask_mod is not None:
        mask_params = None if score_params is not None else entry.params
        fields["mask"] = masks.from_flex(entry.mask_mod, mask_params)
    if entry.score_mod is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # causal_bias: a mask in disguise, warned of
            fields["score"] = scores.from_flex(entry.score_mod, score_params)
    return fields


def _oracle_parts(entry: Entry):
    """The visibility ``[B, H, Lq, Lk]`` and the float64 score function of `entry`, from its
    FlexAttention functions on every pair."""
    kv_len = entry.kv_len or entry.q_len
    b = jnp.arange(B)[:, None, None, None]
    h = jnp.arange(H)[None, :, None, None]
    q_idx = jnp.arange(entry.q_len)[None, None, :, None]
    kv_idx = jnp.arange(kv_len)[None, None, None, :]
    score_reads = entry.score_mod is not None and entry.mask_mod in (None, gym.causal)
    mask_extra = () if entry.params is None or score_reads else (entry.params,)
    vis = np.ones((B, H, entry.q_len, kv_len), bool)
    if entry.mask_mod is not None:
        vis = np.broadcast_to(np.asarray(entry.mask_mod(b, h, q_idx, kv_idx, *mask_extra)),
                              vis.shape)
    score = None
    if entry.score_mod is not None:
        def score(s, params=None):
            extra = () if params is None else (params,)
            return entry.score_mod(s, b, h, q_idx, kv_idx, *extra)
    return vis, score, score_reads


def _check(entry: Entry, fields: dict, kernel, learned: bool):
    """Forward and the gradients of q, k, v (and of the score_mod's params when `learned`)
    of a module with `fields` through `kernel`, against the float64 oracle."""
    kv_len = entry.kv_len or entry.q_len
    keys = jax.random.split(jax.random.key(11), 3)
    q = jax.random.normal(keys[0], (B, H, entry.q_len, D))
    k = jax.random.normal(keys[1], (B, HKV, kv_len, D))
    v = jax.random.normal(keys[2], (B, HKV, kv_len, D))
    tiling = bsa.Tiling(block_q=16, block_kv=16) if isinstance(
        kernel, kernels.XlaBlockSparse) else None
    attn = bsa.BlockSparseAttention(kernel=kernel, tiling=tiling, **fields)
    extra = {} if entry.call is None else entry.call()

    def loss(attn, q, k, v):
        out = attn(q, k, v, **extra)
        return jnp.sum(jnp.sin(out)), out

    (_, out), grads = eqx.filter_value_and_grad(
        lambda args: loss(*args), has_aux=True)((attn, q, k, v))
    vis, score, score_reads = _oracle_parts(entry)
    learned = learned and score_reads and entry.params is not None
    with jax.enable_x64(True):
        def f64(x):
            return jnp.asarray(np.asarray(x, np.float64))

        def oracle(q, k, v, params):
            def term(s):
                return score(s, params if score_reads else None)
            return jnp_attention_f64(q, k, v, vis, score=None if score is None else term)

        params = None if not score_reads or entry.params is None else jax.tree.map(
            f64, entry.params)
        want = oracle(f64(q), f64(k), f64(v), params)
        wants = jax.grad(lambda *a: jnp.sum(jnp.sin(oracle(*a))), argnums=(0, 1, 2, 3))(
            f64(q), f64(k), f64(v), params)
    assert_close(out, want, 5e-5, "out")
    for got, w, what in zip(grads[1:], wants[:3], ("dq", "dk", "dv")):
        assert_close(got, w, 2e-4, what)
    if learned:
        for got, w in zip(jax.tree.leaves(grads[0].score.params),
                          jax.tree.leaves(wants[3])):
            assert_close(got, w, 2e-4, "dparams")


KERNELS = {"xla": kernels.XlaBlockSparse(), "reference": kernels.DenseReference()}


#: The default entry of the quick tier (a mask reading params); the other default entries
#: are the full tier (`slow`).
QUICK = {"document"}


def _cases(form: str):
    for name, entry in CATALOGUE.items():
        if form == "ours" and entry.ours is None:
            continue
        for kernel in KERNELS:
            default = form == "flex" and kernel == "xla" and entry.default
            marks = ((() if name in QUICK else (pytest.mark.slow,)) if default
                     else (pytest.mark.extended,))
            yield pytest.param(name, kernel, id=f"{name}-{kernel}", marks=marks)


@pytest.mark.parametrize("name,kernel", list(_cases("flex")))
def test_catalogue_through_from_flex(name, kernel):
    entry = CATALOGUE[name]
    _check(entry, _flex_form(entry), KERNELS[kernel], learned=True)


@pytest.mark.parametrize("name,kernel", list(_cases("ours")))
def test_catalogue_in_our_terms(name, kernel):
    entry = CATALOGUE[name]
    _check(entry, entry.ours(), KERNELS[kernel], learned=False)


@pytest.mark.slow
def test_catalogue_masks_are_not_trivial():
    """Each mask entry hides some pairs and shows others (a catalogue of Full masks would
    test nothing), and the from_flex masks read the head only where they should."""
    for name, entry in CATALOGUE.items():
        vis = _oracle_parts(entry)[0]
        if entry.mask_mod in (None, gym.noop_mask):
            continue
        assert vis.any() and not vis.all(), name
        mask = _flex_form(entry).get("mask")
        assert mask is not None and not mask.head_dependent, name
