"""The attention-gym catalogue of FlexAttention ``mask_mod`` and ``score_mod`` functions, each
written here in JAX and run two ways: through `masks.from_flex` / `scores.from_flex`, and in
the library's own terms (a built-in mask or score) where one says the same. Every form is
checked against the float64 oracle, forward and the q, k, v gradients (and the params'
where a score_mod reads learned arrays), through each CPU kernel that takes it
(`XlaBlockSparse`, `DenseReference`). docs/flex.md lists the catalogue.

The default tier runs a few entries through `XlaBlockSparse` (one small shape each); the
product of every entry, form and kernel is the extended tier.
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


# ---------------------------------------------------------------------------------------------
# The mask_mods, as FlexAttention writes them: (b, h, q_idx, kv_idx[, params]) -> bool.


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def noop_mask(b, h, q_idx, kv_idx):
    return jnp.full(jnp.broadcast_shapes(jnp.shape(q_idx), jnp.shape(kv_idx)), True)


def sliding_window(width):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= width)
    return mask_mod


def prefix_lm(prefix, inclusive=False):
    def mask_mod(b, h, q_idx, kv_idx):
        seen = kv_idx <= prefix if inclusive else kv_idx < prefix
        return seen | (q_idx >= kv_idx)
    return mask_mod


def decode_offset(offset):
    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx
    return mask_mod


def document_causal(b, h, q_idx, kv_idx, doc):
    """Causal inside each document; `doc` [L] the document of each token."""
    return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)


def nested_causal(b, h, q_idx, kv_idx, params):
    """Causal on each sequence's own indices of a packed (jagged) batch."""
    seq, offsets = params["seq"], params["offsets"]
    q_local = q_idx - offsets[seq[q_idx]]
    kv_local = kv_idx - offsets[seq[kv_idx]]
    return (seq[q_idx] == seq[kv_idx]) & (q_local >= kv_local)


def dilated_window(width, dilation):
    def mask_mod(b, h, q_idx, kv_idx):
        gap = jnp.abs(q_idx - kv_idx)
        return (gap <= width) & (gap % dilation == 0)
    return mask_mod


def batchify_causal(size):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx // size == kv_idx // size) & (q_idx % size >= kv_idx % size)
    return mask_mod


def _clamped_window(q_x, q_y, kv_x, kv_y, canvas_w, canvas_h, kernel_w, kernel_h):
    """A kernel centred on the query, its centre kept `kernel // 2` inside the canvas."""
    centre_x = jnp.clip(q_x, kernel_w // 2, canvas_w - 1 - kernel_w // 2)
    centre_y = jnp.clip(q_y, kernel_h // 2, canvas_h - 1 - kernel_h // 2)
    return (jnp.abs(centre_x - kv_x) <= kernel_w // 2) & (jnp.abs(centre_y - kv_y) <= kernel_h // 2)


def natten(canvas_w, canvas_h, kernel_w, kernel_h):
    def mask_mod(b, h, q_idx, kv_idx):
        return _clamped_window(q_idx // canvas_w, q_idx % canvas_w, kv_idx // canvas_w,
                               kv_idx % canvas_w, canvas_w, canvas_h, kernel_w, kernel_h)
    return mask_mod


def tiled_natten(canvas_w, canvas_h, kernel_w, kernel_h, tile_w, tile_h):
    def coords(idx):
        tile, inner = idx // (tile_w * tile_h), idx % (tile_w * tile_h)
        tiles_x = canvas_w // tile_w
        return ((tile % tiles_x) * tile_w + inner % tile_w,
                (tile // tiles_x) * tile_h + inner // tile_w)

    def mask_mod(b, h, q_idx, kv_idx):
        (q_x, q_y), (kv_x, kv_y) = coords(q_idx), coords(kv_idx)
        return _clamped_window(q_x, q_y, kv_x, kv_y, canvas_w, canvas_h, kernel_w, kernel_h)
    return mask_mod


def _spread_bits(x):
    """The low 16 bits of `x` at the even bit positions (a Morton code's half)."""
    x = x & 0xFFFF
    for shift, keep in ((8, 0x00FF00FF), (4, 0x0F0F0F0F), (2, 0x33333333), (1, 0x55555555)):
        x = (x | (x << shift)) & keep
    return x


def _gather_bits(code):
    code = code & 0x55555555
    for shift, keep in ((1, 0x33333333), (2, 0x0F0F0F0F), (4, 0x00FF00FF), (8, 0x0000FFFF)):
        code = (code | (code >> shift)) & keep
    return code


def morton_natten(canvas_w, canvas_h, kernel_w, kernel_h):
    def mask_mod(b, h, q_idx, kv_idx):
        q_x, q_y = _gather_bits(q_idx), _gather_bits(q_idx >> 1)
        kv_x, kv_y = _gather_bits(kv_idx), _gather_bits(kv_idx >> 1)
        return _clamped_window(q_x, q_y, kv_x, kv_y, canvas_w, canvas_h, kernel_w, kernel_h)
    return mask_mod


def sasa(width, window):
    def mask_mod(b, h, q_idx, kv_idx):
        return ((jnp.abs(q_idx // width - kv_idx // width) <= window)
                & (jnp.abs(q_idx % width - kv_idx % width) <= window))
    return mask_mod


def _tile_window(q_tile, kv_tile, tiles, kernel_tiles):
    """Sliding tile attention along one axis: the kernel's tiles around the query's tile,
    kept inside the canvas."""
    left = kernel_tiles // 2
    right = kernel_tiles // 2 + kernel_tiles % 2 - 1
    centre = jnp.clip(q_tile, left, tiles - 1 - right)
    return (kv_tile >= centre - left) & (kv_tile <= centre + right)


def sta(canvas, kernel, tile, text):
    """Sliding tile attention over a video canvas of any rank (2D: (h, w); 3D: (t, h, w))
    flattened tile by tile, then `text` text tokens that see the video and themselves."""
    tiles = tuple(c // t for c, t in zip(canvas, tile))
    kernel_tiles = tuple(k // t for k, t in zip(kernel, tile))
    vision = int(np.prod(canvas))

    def tile_coords(idx):
        tile_id = idx // int(np.prod(tile))
        out = []
        for n in reversed(tiles):
            out.append(tile_id % n)
            tile_id = tile_id // n
        return out[::-1]

    def mask_mod(b, h, q_idx, kv_idx):
        near = (q_idx < vision) & (kv_idx < vision)
        for q_t, kv_t, n, k in zip(tile_coords(q_idx), tile_coords(kv_idx), tiles, kernel_tiles):
            near = near & _tile_window(q_t, kv_t, n, k)
        to_text = (q_idx < vision) & (kv_idx >= vision) & (kv_idx < vision + text)
        from_text = (q_idx >= vision) & (kv_idx < vision + text)
        return near | to_text | from_text
    return mask_mod


def svg_spatial(prompt, per_frame, width, sink, round_to):
    band = (width * per_frame) // round_to * round_to

    def mask_mod(b, h, q_idx, kv_idx):
        first_column = kv_idx < (prompt + per_frame if sink else prompt)
        return first_column | (q_idx < prompt) | (jnp.abs(q_idx - kv_idx) < band)
    return mask_mod


def svg_temporal(prompt, frames, per_frame, width):
    band = (width * per_frame) // frames

    def mask_mod(b, h, q_idx, kv_idx):
        q_in, kv_in = (q_idx - prompt) % per_frame, (kv_idx - prompt) % per_frame
        return (kv_idx < prompt) | (q_idx < prompt) | (jnp.abs(q_in - kv_in) < band)
    return mask_mod


def vision_cross_attention(b, h, q_idx, kv_idx, params):
    """Flamingo: a text token sees the image tokens of the image whose interval holds it."""
    interval = params["intervals"][params["image"][kv_idx]]
    return (q_idx >= interval[..., 0]) & (q_idx < interval[..., 1])


# ---------------------------------------------------------------------------------------------
# The score_mods: (score, b, h, q_idx, kv_idx[, params]) -> score.


def alibi(num_heads):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx) * jnp.exp2(-(h + 1) * 8.0 / num_heads)
    return score_mod


def tanh_softcap(cap):
    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * jnp.tanh(score / cap)
    return score_mod


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + 0.1 * (q_idx - kv_idx)


def head_bias(score, b, h, q_idx, kv_idx):
    return score + 2 * h


def checkerboard(score, b, h, q_idx, kv_idx):
    odd = jnp.abs(kv_idx - q_idx) % 2 == 1
    return jnp.where(odd, score * 0.5, score * 2.0)


def causal_bias(score, b, h, q_idx, kv_idx):
    return jnp.where(q_idx >= kv_idx, score, -jnp.inf)


def alibi_and_causal(num_heads):
    bias = alibi(num_heads)

    def score_mod(score, b, h, q_idx, kv_idx):
        return jnp.where(q_idx >= kv_idx, bias(score, b, h, q_idx, kv_idx), -jnp.inf)
    return score_mod


def noop_score(score, b, h, q_idx, kv_idx):
    return score


def rope_latent(group, scale):
    """MLA's decoupled RoPE term: the dot product of per-token rotary parts, read per batch
    and head from learned arrays (``params = (q_rope [B, H, L, r], k_rope [B, Hkv, L, r])``)."""
    def score_mod(score, b, h, q_idx, kv_idx, params):
        q_rope, k_rope = params
        return score + scale * jnp.sum(q_rope[b, h, q_idx] * k_rope[b, h // group, kv_idx], -1)
    return score_mod


def relative_bias_offset(offset):
    """A decoding step's score_mod: the query's index shifted by the cache length."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return relative_bias(score, b, h, q_idx + offset, kv_idx)
    return score_mod


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
    "causal": Entry(causal, ours=lambda: dict(mask=masks.Causal())),
    "noop": Entry(noop_mask, ours=lambda: dict(mask=masks.Full())),
    "sliding_window": Entry(sliding_window(8),
                            ours=lambda: dict(mask=masks.Causal() & masks.SlidingWindow(8, 0))),
    "prefix_lm": Entry(prefix_lm(10), ours=lambda: dict(mask=masks.PrefixLM(10))),
    "prefix_lm_inclusive": Entry(prefix_lm(10, True), ours=lambda: dict(mask=masks.PrefixLM(11))),
    "decode_offset": Entry(decode_offset(5), ours=lambda: dict(mask=masks.Causal(offset=5)),
                           q_len=8),
    "document": Entry(document_causal, params=jnp.asarray(DOC), default=True,
                      ours=lambda: dict(mask=masks.Document() & masks.Causal()),
                      call=lambda: SEGMENTS),
    "nested_jagged": Entry(nested_causal,
                           params={"seq": jnp.asarray(DOC), "offsets": jnp.asarray(OFFSETS)},
                           ours=lambda: dict(mask=masks.Document() & masks.Causal()),
                           call=lambda: SEGMENTS),
    "dilated_sliding_window": Entry(dilated_window(12, 3), ours=lambda: dict(
        mask=masks.SlidingWindow(12, 12) & masks.Dilated(3))),
    "batchify_causal": Entry(batchify_causal(16), ours=lambda: dict(mask=masks.ChunkedCausal(16))),
    "natten": Entry(natten(8, 8, 3, 3), q_len=64),
    "tiled_natten": Entry(tiled_natten(8, 8, 3, 3, 4, 4), q_len=64),
    "morton_natten": Entry(morton_natten(8, 8, 3, 3), q_len=64),
    "sasa": Entry(sasa(8, 1), q_len=64),
    "sta_2d": Entry(sta((8, 8), (4, 4), (2, 2), 8), q_len=72),
    "sta_3d": Entry(sta((2, 4, 4), (2, 2, 2), (1, 2, 2), 8), q_len=40),
    "svg_spatial": Entry(svg_spatial(6, 10, 1, True, 4), q_len=46),
    "svg_temporal": Entry(svg_temporal(6, 4, 10, 2), q_len=46),
    "vision_cross_attention": Entry(
        vision_cross_attention, q_len=24, kv_len=15, default=True,
        params={"intervals": jnp.array([[0, 7], [7, 15], [15, 20]]),
                "image": jnp.repeat(jnp.arange(3), 5)}),
    # scores
    "alibi": Entry(causal, alibi(H),
                   ours=lambda: dict(mask=masks.Causal(), score=scores.ALiBi())),
    "tanh_softcap": Entry(None, tanh_softcap(2.0), ours=lambda: dict(logits_soft_cap=2.0)),
    "relative_bias": Entry(None, relative_bias),
    "head_bias": Entry(None, head_bias),
    "checkerboard": Entry(None, checkerboard),
    "causal_bias": Entry(None, causal_bias, ours=lambda: dict(mask=masks.Causal())),
    "alibi_and_causal": Entry(None, alibi_and_causal(H), ours=lambda: dict(
        mask=masks.Causal(), score=scores.ALiBi())),
    "noop_score": Entry(None, noop_score, ours=lambda: {}),
    "rope_latent": Entry(causal, rope_latent(H // HKV, 0.5), params=ROPE, default=True),
    "decode_offset_score": Entry(None, relative_bias_offset(40), q_len=8, ours=lambda: dict(
        score=scores.from_flex(relative_bias)), call=lambda: dict(
        q_positions=np.broadcast_to(np.arange(8) + 40, (B, 8)))),
}


def _flex_form(entry: Entry) -> dict:
    """The module's fields for `entry` through `from_flex`; params go to the function that
    reads them (the mask_mod, or the score_mod when it takes them)."""
    fields = {}
    score_params = entry.params if entry.score_mod is not None and entry.mask_mod in (
        None, causal) else None
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
    score_reads = entry.score_mod is not None and entry.mask_mod in (None, causal)
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


def _cases(form: str):
    for name, entry in CATALOGUE.items():
        if form == "ours" and entry.ours is None:
            continue
        for kernel in KERNELS:
            default = form == "flex" and kernel == "xla" and entry.default
            yield pytest.param(name, kernel, id=f"{name}-{kernel}",
                               marks=() if default else (pytest.mark.extended,))


@pytest.mark.parametrize("name,kernel", list(_cases("flex")))
def test_catalogue_through_from_flex(name, kernel):
    entry = CATALOGUE[name]
    _check(entry, _flex_form(entry), KERNELS[kernel], learned=True)


@pytest.mark.parametrize("name,kernel", list(_cases("ours")))
def test_catalogue_in_our_terms(name, kernel):
    entry = CATALOGUE[name]
    _check(entry, entry.ours(), KERNELS[kernel], learned=False)


def test_catalogue_masks_are_not_trivial():
    """Each mask entry hides some pairs and shows others (a catalogue of Full masks would
    test nothing), and the from_flex masks read the head only where they should."""
    for name, entry in CATALOGUE.items():
        vis = _oracle_parts(entry)[0]
        if entry.mask_mod in (None, noop_mask):
            continue
        assert vis.any() and not vis.all(), name
        mask = _flex_form(entry).get("mask")
        assert mask is not None and not mask.head_dependent, name
