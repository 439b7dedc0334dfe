"""`TritonBlockSparse`'s heuristic `TritonConfig` (the default per head dim and feature, the
short-row variant), its autotune candidates and the shared memory a config's launches take."""

import dataclasses

import numpy as np

from eqx_bsattn.contract import BlockLayout, Features, ResolvedMask

from .config import TritonConfig

#: Static layouts whose rows visit fewer blocks than this on average, scattered (their full
#: lists are not ranges), run with `short_row_blocks` when the tiling is the heuristic's.
SHORT_ROWS_BELOW = 16


def pow2(n: int) -> int:
    """The smallest power of two >= `n`, at least 16 (Triton's smallest dot)."""
    return max(16, 1 << (int(n) - 1).bit_length())


def row_width(features: Features) -> int:
    """Bytes per row of the wider of q / v, over 2: the padded head dim, doubled for float32."""
    width = max(pow2(features.head_dim), pow2(features.value_dim))
    return width * (2 if features.dtype == "float32" else 1)


def short_row_blocks(features: Features) -> tuple[int, int, int, int] | None:
    """``(block_q, block_kv, warps, stages)`` for short rows, or ``None`` (no such variant).

    64x64 tiles, 4 warps, 2 stages: two programs share an SM, so one's prologue and epilogue
    overlap the other's loop, which a row of a few blocks does not amortise (docs/triton.md,
    "Tiling", has the measurements).
    """
    if row_width(features) > 128 or features.bias:
        return None
    return (64, 64, 4, 2)


def lists_are_ranges(count, index) -> bool:
    """Whether every list of a concrete layout is a range of consecutive blocks."""
    count = np.asarray(count)
    index = np.asarray(index)
    first = index[..., 0]
    last = np.take_along_axis(index, np.maximum(count - 1, 0)[..., None], axis=-1)[..., 0]
    return bool(np.all((count == 0) | (last - first == count - 1)))


def short_scattered_rows(layout: BlockLayout) -> bool:
    """Whether a static layout's rows visit few blocks on average, not as ranges."""
    visits = np.asarray(layout.full_count) + np.asarray(layout.partial_count)
    if not visits.size or float(visits.mean()) >= SHORT_ROWS_BELOW:
        return False
    return not lists_are_ranges(layout.full_count, layout.full_index)


def default_tiling(features: Features, mask: ResolvedMask) -> TritonConfig:
    """The heuristic config: per head dim and features, then the short-row variant for static
    layouts whose rows visit few, scattered blocks (BigBird-like)."""
    width = row_width(features)
    short = short_row_blocks(features)
    # Blocks ``(block_q, block_kv)`` and launches ``(warps, stages)`` of the forward, dk/dv
    # and dq kernels. dq walks kv-blocks for a tall q tile and dk/dv q-blocks for a tall kv
    # tile; with three stages each fetches two tiles ahead (measured: docs/triton.md).
    if width <= 64:
        # 16-bit D=64: a 64x128 dk/dv tile spills registers (docs/triton.md).
        fwd, fl, bwd, bl, dq, dl = (128, 128), (4, 3), (32, 128), (4, 3), (128, 64), (4, 3)
    elif width <= 128:
        fwd, fl, bwd, bl, dq, dl = (128, 128), (8, 3), (64, 128), (8, 3), (128, 64), (8, 3)
    elif width <= 256:
        fwd, fl, bwd, bl = (64, 64), (8, 2), (64, 32), (8, 2)
        dq, dl = bwd, bl
    else:
        fwd, fl, bwd, bl = (32, 32), (4, 1), (32, 32), (4, 1)
        dq, dl = bwd, bl
    if features.bias:
        # The float32 bias tile is pipelined through shared memory like k and v: halve the
        # kv tile (and keep two stages) so every stage still fits in the 227 KiB.
        fwd, bwd = (fwd[0], max(32, fwd[1] // 2)), (bwd[0], max(32, bwd[1] // 2))
        fl, bl = (fl[0], min(fl[1], 2)), (bl[0], min(bl[1], 2))
        dq, dl = bwd, bl
    if features.segment_ids and short is not None:
        # Per-call documents: the layout is built on the device, so its rows cannot be
        # seen here; packed documents make short rows, which run faster with small tiles
        # (docs/triton.md), and one layout then serves all three launches.
        fwd = bwd = dq = short[:2]
        fl, bl = (short[2], 3), short[2:]
        dl = bl
    # Short sequences (decoding) waste less with smaller tiles.
    cap_q, cap_k = pow2(features.q_len), pow2(features.kv_len)
    tiling = TritonConfig(
        block_q=min(fwd[0], cap_q), block_kv=min(fwd[1], cap_k),
        block_q_bwd=min(bwd[0], cap_q), block_kv_bwd=min(bwd[1], cap_k),
        num_warps=fl[0], num_stages=fl[1], num_warps_bwd=bl[0], num_stages_bwd=bl[1],
        block_q_dq=min(dq[0], cap_q), block_kv_dq=min(dq[1], cap_k),
        num_warps_dq=dl[0], num_stages_dq=dl[1],
    )
    tiling = fewer_stages_where_over(tiling, features)
    if short is not None and mask.is_static and not (features.segment_ids or features.positions):
        # Short scattered rows (BigBird-like static layouts): the short-row tiling.
        bitmaps = mask.kernel_terms([(tiling.block_q, tiling.block_kv)]) is None
        if short_scattered_rows(mask.layout(tiling.block_q, tiling.block_kv, bitmaps=bitmaps)):
            tiling = TritonConfig(block_q=min(short[0], cap_q), block_kv=min(short[1], cap_k),
                            num_warps=short[2], num_stages=short[3])
    return tiling


#: Shared memory one program may use on sm_90 (H100, H200); a launch over it cannot start.
SHARED_MEMORY_BYTES = 227 * 1024

# The alternatives `tiling_candidates` tries for each group of fields, best guesses first.
_FORWARD_BLOCKS = ((128, 128), (128, 64), (64, 128), (64, 64))
_DKV_BLOCKS = ((64, 128), (128, 128), (32, 128), (64, 64), (128, 64))
_DQ_BLOCKS = ((128, 64), (64, 64), (128, 128), (64, 128))
_LAUNCHES = ((8, 3), (4, 3), (8, 2), (4, 2), (4, 4), (8, 4))


def shared_memory(tiling: TritonConfig, features: Features) -> dict[str, int]:
    """Bytes of shared memory each launch of `tiling` takes, estimated from its pipelined
    tiles: the forward holds a q tile and `num_stages` k/v tiles; the dq kernel holds q and
    dO tiles and pipelines k/v; the dk/dv kernel holds k/v tiles and pipelines q and dO. A
    bias tile (float32) is pipelined with the others (docs/triton.md compares the count with
    the compiler's)."""
    t = tiling.explicit()
    size = 4 if features.dtype == "float32" else 2
    d, dv = pow2(features.head_dim), pow2(features.value_dim)

    def launch(held_rows, held_width, piped_rows, piped_width, stages, bias_tile):
        stages = stages or 2
        bias = stages * bias_tile * 4 if features.bias else 0
        # A relative-bias table's scores take one float32 tile once (measured on the H200:
        # the 128x128 forward asked 64 KiB more than without). Without per-call positions
        # no loop holds it: the blocks near the diagonal load their entries by distance,
        # unpipelined (`LaunchConfig.split_constexprs`).
        table = (bias_tile * 4 if "relative_bias" in features.score and features.positions
                 else 0)
        return (held_rows * held_width + stages * piped_rows * piped_width) * size + bias + table

    bq, bk = t.block_q, t.block_kv
    dq_q, dq_k = t.dq_blocks
    kv_q, kv_k = t.backward_blocks
    return {
        "forward": launch(bq, d, bk, d + dv, t.num_stages, bq * bk),
        "dq": launch(dq_q, d + dv, dq_k, d + dv, t.num_stages_dq, dq_q * dq_k),
        "dk/dv": launch(kv_k, d + dv, kv_q, d + dv, t.num_stages_bwd, kv_q * kv_k),
    }


#: Each launch's stages field, by `shared_memory`'s names.
_STAGES = {"forward": "num_stages", "dq": "num_stages_dq", "dk/dv": "num_stages_bwd"}


def fewer_stages_where_over(tiling: TritonConfig, features: Features) -> TritonConfig:
    """`tiling` with each launch over the shared memory (`shared_memory`) given fewer stages,
    down to two, until it fits (with per-call positions, a relative-bias table's tile takes
    the 128x128 forward from three stages to two)."""
    for name, field in _STAGES.items():
        while shared_memory(tiling, features)[name] > SHARED_MEMORY_BYTES:
            stages = getattr(tiling.explicit(), field) or 2
            if stages <= 2:
                break
            tiling = dataclasses.replace(tiling.explicit(), **{field: stages - 1})
    return tiling


def launch_problem(tiling: TritonConfig, features: Features) -> str | None:
    """Why `tiling` cannot launch for `features` (shared memory), or ``None``; its blocks
    were checked when it was built."""
    for name, used in shared_memory(tiling, features).items():
        if used > SHARED_MEMORY_BYTES:
            return (f"the {name} launch needs ~{used // 1024} KiB of shared memory; "
                    f"{SHARED_MEMORY_BYTES // 1024} KiB is the most a program gets.")
    return None


def tiling_candidates(
    features: Features, mask: ResolvedMask
) -> tuple[tuple[TritonConfig, str | None], ...]:
    """The heuristic, then the heuristic with one group of fields changed (forward blocks,
    dk/dv blocks, dq blocks, then each launch's warps and stages), the groups taken in turn so
    a short prefix of the list varies each of them; each with the reason it cannot launch, or
    ``None``. Blocks are capped at the sequence (a power of two) as the heuristic caps them."""
    base = default_tiling(features, mask).explicit()
    cap_q, cap_k = pow2(features.q_len), pow2(features.kv_len)

    def blocks(pairs):
        return [(min(q, cap_q), min(k, cap_k)) for q, k in pairs]

    candidates = base.variants(
        (("block_q", "block_kv"), blocks(_FORWARD_BLOCKS)),
        (("block_q_bwd", "block_kv_bwd"), blocks(_DKV_BLOCKS)),
        (("block_q_dq", "block_kv_dq"), blocks(_DQ_BLOCKS)),
        (("num_warps", "num_stages"), _LAUNCHES),
        (("num_warps_bwd", "num_stages_bwd"), _LAUNCHES),
        (("num_warps_dq", "num_stages_dq"), _LAUNCHES),
    )
    return tuple((t, launch_problem(t, features)) for t in candidates)
