"""The attention-gym catalogue's FlexAttention functions written in JAX: each ``mask_mod``
``(b, h, q_idx, kv_idx[, params]) -> bool`` and ``score_mod``
``(score, b, h, q_idx, kv_idx[, params]) -> score`` (factories where the function has
parameters: a width, a canvas, a number of heads). Plain JAX and NumPy, no test framework:
tests/test_flex_catalogue.py checks each against the float64 oracle at small sizes and
benchmarks/gym_gpu.py times them at full size (`benchmarks/flex_gym_peer.py` holds their
torch forms, by the same names).
"""

import jax.numpy as jnp
import numpy as np


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
