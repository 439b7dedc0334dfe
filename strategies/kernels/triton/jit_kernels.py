"""The `@triton.jit` kernels of `TritonBlockSparse` (imported lazily: Triton may be absent).

Every array is contiguous and batched: q ``[B, H, LQ, D]``, k ``[B, HKV, LK, D]``,
v ``[B, HKV, LK, DV]``, o ``[B, H, LQ, DV]``, lse ``[B, H, LQ]`` (base 2: ``log2 sum exp2``),
bias ``[BB, HB, LQ, LK]``, sinks ``[H, S]`` (float32), positions / segment ids ``[B, L]``,
ALiBi slopes ``[H]`` and the relative-bias table ``[H, NB]`` (float32, query heads) with its
bucket thresholds ``[NT]`` (int32, `RelativeBuckets.thresholds`).
Layout lists are ``[MB, MH, n, capacity]`` int32 as in `eqx_bsattn.BlockLayout`.

Every shape, flag and scalar is a `tl.constexpr`: jax-triton passes Python floats as fp64,
and the shapes are static under `jit` anyway, so specialising on them costs no recompiles.

The mask of a partial block is the AND of the canonical terms switched on by constexprs
(``CAUSAL``, ``WIN_L``/``WIN_R``, ``CHUNK``, ``PREFIX``, ``HAS_SEG``), evaluated on positions;
or, with ``USE_BITMAP``, a lookup in the layout's deduplicated element bitmaps.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _floordiv(a, c: tl.constexpr):
    # Integer division rounding toward -inf whatever the hardware's rounding (positions may be
    # negative).
    t = a // c
    return t - ((a - t * c) < 0).to(t.dtype)


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): exp overflowing to inf gives 1, underflowing to 0 gives -1; never NaN.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _load2d(ptrs, row_ok, col_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    if CHECK_ROWS and CHECK_COLS:
        x = tl.load(ptrs, mask=row_ok & col_ok, other=0.0)
    elif CHECK_ROWS:
        x = tl.load(ptrs, mask=row_ok, other=0.0)
    elif CHECK_COLS:
        x = tl.load(ptrs, mask=col_ok, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _visible(qp, kp, qs, ks, k_in,
             CAUSAL: tl.constexpr, CAUSAL_OFF: tl.constexpr, WIN_L: tl.constexpr,
             WIN_R: tl.constexpr, CHUNK: tl.constexpr, PREFIX: tl.constexpr,
             HAS_SEG: tl.constexpr):
    """Canonical mask on broadcastable query / key positions (and segment ids)."""
    vis = k_in
    if CAUSAL:
        vis = vis & (kp <= qp + CAUSAL_OFF)
    if WIN_L >= 0:
        vis = vis & (kp >= qp - WIN_L)
    if WIN_R >= 0:
        vis = vis & (kp <= qp + WIN_R)
    if CHUNK > 0:
        vis = vis & (_floordiv(qp, CHUNK) == _floordiv(kp, CHUNK))
    if PREFIX >= 0:
        vis = vis & ((kp < PREFIX) | (kp <= qp))
    if HAS_SEG:
        vis = vis & (qs == ks) & (qs >= 0)
    return vis


@triton.jit
def _bucket(d, THRESH, BIDIR: tl.constexpr, HALF: tl.constexpr, NT: tl.constexpr):
    """T5 bucket ids (`RelativeBuckets.bucket`) of int32 distances ``d = q_pos - k_pos``."""
    if BIDIR:
        offset = tl.where(d < 0, HALF, 0)
        n = tl.abs(d)
    else:
        offset = 0
        n = tl.maximum(d, 0)
    ME: tl.constexpr = HALF // 2
    far = n * 0 + ME
    # The logarithmic buckets by their integer thresholds: no float log, so no rounding.
    for f in tl.static_range(NT):
        far += (n >= tl.load(THRESH + f)).to(tl.int32)
    return offset + tl.where(n < ME, n, far)


@triton.jit
def _span(pos, start, N: tl.constexpr, HAS_POS: tl.constexpr):
    """``(least, greatest)`` of the positions `pos` of `N` tokens from index `start`: from the
    index alone where the call gives no positions (no reduction)."""
    if HAS_POS:
        lo = tl.min(pos)
        hi = tl.max(pos)
    else:
        lo = start
        hi = start + N - 1
    return lo, hi


@triton.jit
def _load_entries(ptrs, PTX_ENTRIES: tl.constexpr):
    """float32 loads at a tile of addresses that stay in registers. With ``PTX_ENTRIES`` (an
    NVIDIA GPU) each is one inline PTX load, so Triton's pipeliner, which stages every load
    of 32 bits or more that feeds a product through shared memory (one float32 tile per
    stage), leaves it to the loop's own step; else a `tl.load`, and the loop must not be
    pipelined (`LaunchConfig.split_constexprs`)."""
    if PTX_ENTRIES:
        x = tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$1];", "=r,l", [ptrs],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _score_tile(SLOPES, TABLE, ENTRIES, THRESH, h, qp, kp, d_lo, d_hi, HAS_ALIBI: tl.constexpr,
                HAS_REL: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, BIDIR: tl.constexpr,
                HALF: tl.constexpr, NT: tl.constexpr, PART: tl.constexpr, NPARTS: tl.constexpr,
                LOW_B: tl.constexpr, HIGH_B: tl.constexpr, DOFF: tl.constexpr,
                ND: tl.constexpr, PTX_ENTRIES: tl.constexpr):
    """``(term, distance, bucket, lowest, highest)`` on broadcastable query / key positions of
    query head `h` (a table of `NB` buckets, `NBP` its power of two), whose distances
    ``q_pos - k_pos`` lie in ``[d_lo, d_hi]``: the float32 score terms (`ScoreTerms.apply`),
    ``k_pos - q_pos`` as float32 (the slope's derivative), the table's bucket ids and their
    least and greatest value where a tile walked whole decides at run time (else 0).

    A list walked in three parts (``NPARTS == 3``, `_list_part`) knows its tiles' buckets
    from the part: in the first and last every pair is in bucket `LOW_B` / `HIGH_B`, so the
    table's term is one scalar (no tile, no branch), and in the middle (near the diagonal)
    each pair reads its entry by its distance from `ENTRIES` (`LaunchConfig.distance_entries`:
    ``[H, ND]``, distance ``d`` at ``d + DOFF``, clamped: past either end the entry is the far
    one). Walked whole, each tile decides at run time."""
    if HAS_REL and NPARTS == 3:
        if HAS_ALIBI:
            dist = (kp - qp).to(tl.float32)
            term = tl.load(SLOPES + h) * dist
        else:
            dist = 0.0
            term = 0.0
        bucket = 0
        lowest = 0
        highest = 0
        if PART == 0:
            term += tl.load(TABLE + h * NB + LOW_B)
        elif PART == 2:
            term += tl.load(TABLE + h * NB + HIGH_B)
        else:
            at = tl.minimum(tl.maximum(qp - kp + DOFF, 0), ND - 1)
            term += _load_entries(ENTRIES + h * ND + at, PTX_ENTRIES)
    else:
        delta = kp - qp
        dist = delta.to(tl.float32)
        term = dist * 0.0
        if HAS_ALIBI:
            term += tl.load(SLOPES + h) * dist
        bucket = delta * 0
        lowest = 0
        highest = 0
        if HAS_REL:
            # Buckets grow with |distance| on each side of the diagonal, so the buckets of the
            # tile's nearest and farthest distances (from the bounds of its positions,
            # `_span`) bound it; where they agree (all tiles but those near the diagonal) the
            # term is one scalar. Else the table's row, held in registers, is gathered at each
            # pair's bucket (`tl.gather`; a load from the table at a [rows, cols] tile of
            # addresses would be pipelined through shared memory like k and v, past the 227
            # KiB of a Hopper SM).
            b_lo = _bucket(d_lo, THRESH, BIDIR, HALF, NT)
            b_hi = _bucket(d_hi, THRESH, BIDIR, HALF, NT)
            one_side = (d_lo >= 0) | (d_hi < 0) if BIDIR else d_lo == d_lo
            lowest = b_lo
            highest = b_hi
            if one_side & (b_lo == b_hi):
                bucket += b_lo
                term += tl.load(TABLE + h * NB + b_lo)
            else:
                bucket += _bucket(qp - kp, THRESH, BIDIR, HALF, NT)
                lowest = tl.min(bucket)
                highest = tl.max(bucket)
                offs_nb = tl.arange(0, NBP)
                row = tl.load(TABLE + h * NB + offs_nb, mask=offs_nb < NB, other=0.0)
                term += tl.gather(tl.broadcast_to(row[None, :], (bucket.shape[0], NBP)),
                                  bucket, 1)
    return term, dist, bucket, lowest, highest


@triton.jit
def _with_score(bias, SLOPES, TABLE, ENTRIES, THRESH, KPOS, b, h, qp, q_lo, q_hi, j, offs_n,
                LK: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_KPOS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_REL: tl.constexpr,
                NB: tl.constexpr, NBP: tl.constexpr, BIDIR: tl.constexpr, HALF: tl.constexpr,
                NT: tl.constexpr, PART: tl.constexpr, NPARTS: tl.constexpr,
                LOW_B: tl.constexpr, HIGH_B: tl.constexpr, DOFF: tl.constexpr,
                ND: tl.constexpr, PTX_ENTRIES: tl.constexpr):
    """`_score_tile` of queries at positions `qp` (rows, from `q_lo` to `q_hi`) and keys
    `offs_n` of kv-block `j` (columns) of batch `b`, its terms added to `bias`:
    ``(bias + term, distance, bucket, lowest, highest)``."""
    kp, ks = _coords(KPOS, KPOS, b, offs_n, LK, HAS_KPOS, False, 0)
    k_lo, k_hi = _span(kp, j * BLOCK_N, BLOCK_N, HAS_KPOS)
    term, dist, bucket, lowest, highest = _score_tile(
        SLOPES, TABLE, ENTRIES, THRESH, h, qp[:, None], kp[None, :], q_lo - k_hi, q_hi - k_lo,
        HAS_ALIBI, HAS_REL, NB, NBP, BIDIR, HALF, NT, PART, NPARTS, LOW_B, HIGH_B, DOFF, ND,
        PTX_ENTRIES)
    return bias + term, dist, bucket, lowest, highest


@triton.jit
def _table_grad(dtab, ds, bucket, lowest, highest, NBP: tl.constexpr):
    """`dtab` ``[NBP]`` plus the per-bucket sums of `ds` over one tile whose buckets run from
    `lowest` to `highest`: off the diagonal a tile holds one."""
    offs_nb = tl.arange(0, NBP)
    for bb in range(lowest, highest + 1):
        part = tl.sum(tl.where(bucket == bb, ds, 0.0))
        dtab += tl.where(offs_nb == bb, part, 0.0)
    return dtab


@triton.jit
def _bucket_spans(THRESH, NBP: tl.constexpr, BIDIR: tl.constexpr, HALF: tl.constexpr,
                  NT: tl.constexpr):
    """``(dmin, dmax)``, int32 ``[NBP]``: the distances ``d = q_pos - k_pos`` of each bucket,
    ``dmin <= d <= dmax`` (a bucket holds a run of distances on its side of the diagonal;
    an empty one has ``dmin > dmax``; +-2**30 stand for no bound)."""
    BIG: tl.constexpr = 1 << 30
    ME: tl.constexpr = HALF // 2
    b = tl.arange(0, NBP)
    k = b % HALF if BIDIR else b
    # Within a side, bucket k >= ME holds n from threshold k - ME (ME for the first) to the
    # next one less one (no bound for the last).
    f = k - ME
    t_lo = tl.where(f <= 0, ME, tl.load(THRESH + f - 1, mask=(f >= 1) & (f <= NT), other=BIG))
    t_hi = tl.load(THRESH + f, mask=(f >= 0) & (f < NT), other=BIG) - 1
    n_lo = tl.where(k < ME, k, t_lo)
    n_hi = tl.where(k < ME, k, t_hi)
    if BIDIR:
        upper = b >= HALF
        dmin = tl.where(upper, -n_hi, n_lo)
        dmax = tl.where(upper, -n_lo, n_hi)
        # The later keys' side has no distance 0 (its bucket HALF stays empty), and an odd
        # bucket count leaves the last one, like the padding to NBP, empty.
        dmin = tl.where((upper & (k == 0)) | (b >= 2 * HALF), BIG, dmin)
    else:
        # With causal bucketing, bucket 0 also holds every later key.
        dmin = tl.where(b == 0, -BIG, n_lo)
        dmax = n_hi
    return dmin, dmax


@triton.jit
def _table_grad_rows(dtab_rows, ds, offset, dmin, dmax, BLOCK_N: tl.constexpr):
    """`dtab_rows` ``[rows, NBP]`` plus each row's per-bucket sums of `ds` ``[rows,
    BLOCK_N]``, a tile of token indices whose pair ``(i, j)`` is ``d = offset + i - j`` apart
    (`_bucket_spans`' ``dmin`` / ``dmax``): a bucket's pairs in a row are the columns ``offset
    + i - dmax .. offset + i - dmin``, so each row's sum is a difference of its prefix sums
    (one scan of the row and two gathers; no pass per bucket)."""
    rows = tl.arange(0, ds.shape[0])[:, None]
    prefix = tl.cumsum(ds, 1)
    hi = tl.minimum(offset + rows - dmin[None, :], BLOCK_N - 1)
    lo = tl.maximum(offset + rows - dmax[None, :], 0)
    upto_hi = tl.where(hi >= 0, tl.gather(prefix, tl.maximum(hi, 0), 1), 0.0)
    before_lo = tl.where(lo >= 1, tl.gather(prefix, tl.minimum(tl.maximum(lo - 1, 0),
                                                                BLOCK_N - 1), 1), 0.0)
    return dtab_rows + tl.where(hi >= lo, upto_hi - before_lo, 0.0)


@triton.jit
def _logits(s, bias, SCALE: tl.constexpr, SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Raw ``q.k`` to base-2 logits; also the tanh of the soft cap (for its gradient)."""
    if SOFTCAP > 0:
        s = s * SCALE
        if HAS_BIAS:
            s = s + bias
        t = _tanh(s * (1.0 / SOFTCAP))
        s = t * (SOFTCAP * LOG2E)
    elif HAS_BIAS:
        # One multiply-add where the bias is a scalar (a far tile's table entry).
        s = s * (SCALE * LOG2E) + bias * LOG2E
        t = s
    else:
        t = s
        s = s * (SCALE * LOG2E)
    return s, t


@triton.jit
def _bias_plane(BIAS, b, h, BB: tl.constexpr, HB: tl.constexpr, LQ: tl.constexpr,
                LK: tl.constexpr):
    """Pointer to the ``[LQ, LK]`` bias plane of batch `b`, head `h` (size-1 axes broadcast)."""
    # ``b * 0``, not ``0``: a bias of shape [1, 1, LQ, LK] must still index with a tensor.
    bi = b if BB > 1 else b * 0
    hi = h if HB > 1 else h * 0
    return BIAS + (bi * HB + hi).to(tl.int64) * (LQ * LK)


@triton.jit
def _list_bounds(count_ptr, index_ptr, CONTIG: tl.constexpr, CHECK_RANGE: tl.constexpr):
    """``(lo, hi, first, is_range)`` of one layout list; the walk is ``range(lo, hi)``.

    ``CONTIG``: the host knows the list is a range of blocks (static causal / window / chunk
    layouts), walked as the block range itself. Otherwise the steps are slots of the list;
    `first` is the block of slot 0 (slot 0 always exists: lists have a capacity of at least
    one, padded with 0). ``CHECK_RANGE`` (layouts built on the device, where the host cannot
    look): `is_range` says whether this list turned out to be a range, so the walk needs no
    index loads (packed documents give ranges).
    """
    count = tl.load(count_ptr)
    first = tl.load(index_ptr)
    if CONTIG:
        lo = first
    else:
        lo = 0
    if CHECK_RANGE:
        last = tl.load(index_ptr + tl.maximum(count - 1, 0))
        is_range = last - first == count - 1
    else:
        is_range = count < 0  # never read
    return lo, lo + count, first, is_range


@triton.jit
def _list_step(index_ptr, it, hi, first, is_range, prefetched, CONTIG: tl.constexpr,
               CHECK_RANGE: tl.constexpr, PREFETCH: tl.constexpr):
    """``(block, prefetched)``: the block of step `it`, and what the next step needs.

    ``PREFETCH`` (launches of 3 or more stages) reads the next slot one step early: the index
    load is then off the path from one tile's address to the next, and Triton's pipeliner
    fetches K / V two steps ahead; with the load in the step it waits on every step for a copy
    issued at the end of the previous one. With 2 stages the plain load measured faster.
    """
    if CONTIG:
        block = it
        upcoming = prefetched
    elif PREFETCH:
        if CHECK_RANGE:
            block = tl.where(is_range, first + it, prefetched)
            upcoming = tl.load(index_ptr + it + 1, mask=(it + 1 < hi) & (is_range == 0), other=0)
        else:
            block = prefetched
            upcoming = tl.load(index_ptr + it + 1, mask=it + 1 < hi, other=0)
    else:
        upcoming = prefetched
        if CHECK_RANGE:
            block = tl.where(is_range, first + it,
                             tl.load(index_ptr + it, mask=is_range == 0, other=0))
        else:
            block = tl.load(index_ptr + it)
    return block, upcoming


@triton.jit
def _coords(POS, SEG, b, offs, L: tl.constexpr, HAS_POS: tl.constexpr, HAS_SEG: tl.constexpr,
            SEG_PAD: tl.constexpr):
    """``(positions, segment ids)`` of tokens `offs` of batch `b` (their indices where the call
    gives none); tokens past `L` read position 0 and segment `SEG_PAD`."""
    if HAS_POS:
        pos = tl.load(POS + b * L + offs, mask=offs < L, other=0)
    else:
        pos = offs
    if HAS_SEG:
        seg = tl.load(SEG + b * L + offs, mask=offs < L, other=SEG_PAD)
    else:
        seg = offs
    return pos, seg


@triton.jit
def _phase_list(phase: tl.constexpr, lrow, FCNT, FIDX, PCNT, PIDX, CF: tl.constexpr,
                CP: tl.constexpr, FULL_CONTIG: tl.constexpr, FULL_CHECK: tl.constexpr):
    """``(index_ptr, lo, hi, first, is_range)``: the walk over row `lrow`'s full list (phase
    0; contiguous static lists are walked as the block range itself) or partial list (1)."""
    if phase == 0:
        idx_ptr = FIDX + lrow * CF
        lo, hi, first, is_range = _list_bounds(FCNT + lrow, idx_ptr, FULL_CONTIG, FULL_CHECK)
    else:
        idx_ptr = PIDX + lrow * CP
        lo, hi, first, is_range = _list_bounds(PCNT + lrow, idx_ptr, False, False)
    return idx_ptr, lo, hi, first, is_range


@triton.jit
def _list_part(split_ptr, PART: tl.constexpr, NPARTS: tl.constexpr, lo, hi):
    """``(start, end)`` of part `PART` of a list walked as ``range(lo, hi)``: the whole walk
    (``NPARTS == 1``), or its entries far before the row, near it, or far after it (parts 0,
    1, 2), by the row's two counts at `split_ptr` (`contract.far_splits`)."""
    start = lo
    end = hi
    if NPARTS == 3:
        if PART == 0:
            end = lo + tl.load(split_ptr)
        elif PART == 1:
            start = lo + tl.load(split_ptr)
            end = lo + tl.load(split_ptr + 1)
        else:
            start = lo + tl.load(split_ptr + 1)
    return start, end


@triton.jit
def _partial_visible(bm_ptr, it, BMAPS, b, offs_n, qp, qs, KPOS, KSEG,
                     LK: tl.constexpr, HAS_KPOS: tl.constexpr, HAS_SEG: tl.constexpr,
                     CAUSAL: tl.constexpr, CAUSAL_OFF: tl.constexpr, WIN_L: tl.constexpr,
                     WIN_R: tl.constexpr, CHUNK: tl.constexpr, PREFIX: tl.constexpr,
                     USE_BITMAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` visibility of a partial block (step `it` of the partial list) for
    queries ``qp`` / ``qs`` and keys ``offs_n``: its bitmap, or the canonical terms."""
    if USE_BITMAP:
        bid = tl.load(bm_ptr + it).to(tl.int64)
        bits = tl.load(BMAPS + bid * (BLOCK_M * BLOCK_N)
                       + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
        vis = bits != 0
    else:
        kp, ks = _coords(KPOS, KSEG, b, offs_n, LK, HAS_KPOS, HAS_SEG, -2)
        vis = _visible(qp[:, None], kp[None, :], qs[:, None], ks[None, :],
                       (offs_n < LK)[None, :], CAUSAL, CAUSAL_OFF, WIN_L, WIN_R,
                       CHUNK, PREFIX, HAS_SEG)
    return vis


@triton.jit
def _row_tile(q, k_base, BIAS, SLOPES, TABLE, ENTRIES, THRESH, KPOS, KSEG, bm_ptr, BMAPS, b, h,
              j, it, offs_m, offs_n, qp, qs, q_lo, q_hi, phase: tl.constexpr,
              part: tl.constexpr, LQ: tl.constexpr, LK: tl.constexpr, D: tl.constexpr,
              DP: tl.constexpr, BB: tl.constexpr, HB: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_KPOS: tl.constexpr, HAS_SEG: tl.constexpr,
              CAUSAL: tl.constexpr, CAUSAL_OFF: tl.constexpr, WIN_L: tl.constexpr,
              WIN_R: tl.constexpr, CHUNK: tl.constexpr, PREFIX: tl.constexpr,
              USE_BITMAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_REL: tl.constexpr,
              NB: tl.constexpr, NBP: tl.constexpr, REL_BIDIR: tl.constexpr,
              REL_HALF: tl.constexpr, NT: tl.constexpr, NPARTS: tl.constexpr,
              REL_LOW_B: tl.constexpr, REL_HIGH_B: tl.constexpr, REL_DOFF: tl.constexpr,
              REL_ND: tl.constexpr, PTX_ENTRIES: tl.constexpr, IEEE: tl.constexpr):
    """One tile of a program that walks a q-block's row (the forward and dq kernels): the
    queries `offs_m` (`q` ``[BLOCK_M, DP]``, positions `qp` from `q_lo` to `q_hi`, segments
    `qs`) against the keys `offs_n` of kv-block `j`, step `it` of the list of `phase` (1:
    partial, its visibility applied; `bm_ptr` its bitmap ids), in part `part` of `NPARTS`
    (`_list_part`). ``(s, t, k, distance, bucket, lowest, highest)``: the base-2 logits
    ``[BLOCK_M, BLOCK_N]`` (-inf where hidden), `_logits`' tanh, the key tile ``[BLOCK_N,
    DP]``, and `_score_tile`'s terms for the gradients."""
    # FULL blocks never hold the ragged last kv-block: no row check there.
    k = _load2d(k_base + offs_n[:, None] * D + tl.arange(0, DP)[None, :],
                (offs_n < LK)[:, None], (tl.arange(0, DP) < D)[None, :],
                phase == 1 and LK % BLOCK_N != 0, D != DP)
    s = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE)
    if HAS_BIAS:
        bias = tl.load(_bias_plane(BIAS, b, h, BB, HB, LQ, LK) + offs_m[:, None] * LK
                       + offs_n[None, :], mask=(offs_m < LQ)[:, None] & (offs_n < LK)[None, :],
                       other=0.0).to(tl.float32)
    else:
        bias = 0.0
    dist = 0.0
    bucket = 0
    lowest = 0
    highest = 0
    if HAS_ALIBI or HAS_REL:
        bias, dist, bucket, lowest, highest = _with_score(
            bias, SLOPES, TABLE, ENTRIES, THRESH, KPOS, b, h, qp, q_lo, q_hi, j, offs_n, LK,
            BLOCK_N, HAS_KPOS, HAS_ALIBI, HAS_REL, NB, NBP, REL_BIDIR, REL_HALF, NT, part, NPARTS,
            REL_LOW_B, REL_HIGH_B, REL_DOFF, REL_ND, PTX_ENTRIES)
    s, t = _logits(s, bias, SCALE, SOFTCAP, HAS_BIAS or HAS_ALIBI or HAS_REL)
    if phase == 1:
        vis = _partial_visible(bm_ptr, it, BMAPS, b, offs_n, qp, qs, KPOS, KSEG, LK,
                               HAS_KPOS, HAS_SEG, CAUSAL, CAUSAL_OFF, WIN_L, WIN_R, CHUNK, PREFIX,
                               USE_BITMAP, BLOCK_M, BLOCK_N)
        s = tl.where(vis, s, float("-inf"))
    return s, t, k, dist, bucket, lowest, highest


@triton.jit
def forward_kernel(
    Q, K, V, BIAS, SINKS, SLOPES, TABLE, THRESH, ENTRIES, QPOS, KPOS, QSEG, KSEG,
    FCNT, FIDX, PCNT, PIDX, BMIDX, BMAPS, SPLITS,
    O, LSE,
    H: tl.constexpr, HKV: tl.constexpr, LQ: tl.constexpr, LK: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
    NQB: tl.constexpr, CF: tl.constexpr, CP: tl.constexpr, MB: tl.constexpr, MH: tl.constexpr,
    BB: tl.constexpr, HB: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
    SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_QPOS: tl.constexpr,
    HAS_KPOS: tl.constexpr, HAS_SEG: tl.constexpr,
    CAUSAL: tl.constexpr, CAUSAL_OFF: tl.constexpr, WIN_L: tl.constexpr, WIN_R: tl.constexpr,
    CHUNK: tl.constexpr, PREFIX: tl.constexpr, USE_BITMAP: tl.constexpr,
    FULL_CONTIG: tl.constexpr, FULL_CHECK: tl.constexpr, PREFETCH: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_REL: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
    REL_BIDIR: tl.constexpr, REL_HALF: tl.constexpr, NT: tl.constexpr,
    REL_SPLIT: tl.constexpr, REL_LOW_B: tl.constexpr, REL_HIGH_B: tl.constexpr,
    REL_DOFF: tl.constexpr, REL_ND: tl.constexpr,
    STAGES: tl.constexpr, NEAR_STAGES: tl.constexpr,
    PTX_ENTRIES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    # Last q-blocks first: under causal-like masks they visit the most kv-blocks, and starting
    # the longest programs first shortens the tail of the launch.
    pid_m = NQB - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    hk = h // (H // HKV)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DP)
    offs_dv = tl.arange(0, DVP)
    row_ok = (offs_m < LQ)[:, None]
    d_ok = (offs_d < D)[None, :]
    dv_ok = (offs_dv < DV)[None, :]

    q_base = Q + (b * H + h).to(tl.int64) * (LQ * D)
    k_base = K + (b * HKV + hk).to(tl.int64) * (LK * D)
    v_base = V + (b * HKV + hk).to(tl.int64) * (LK * DV)
    q = _load2d(q_base + offs_m[:, None] * D + offs_d[None, :], row_ok, d_ok,
                LQ % BLOCK_M != 0, D != DP)
    qp, qs = _coords(QPOS, QSEG, b, offs_m, LQ, HAS_QPOS, HAS_SEG, -1)
    q_lo, q_hi = _span(qp, pid_m * BLOCK_M, BLOCK_M, HAS_QPOS)

    lrow = ((b if MB > 1 else 0) * MH + (h if MH > 1 else 0)) * NQB + pid_m
    if HAS_SINKS:
        offs_s = tl.arange(0, SP)
        sk = tl.load(SINKS + h * S + offs_s, mask=offs_s < S, other=float("-inf")) * LOG2E
        ms = tl.max(sk, 0)
        m_i = tl.zeros([BLOCK_M], tl.float32) + ms
        # A head whose sinks are all -inf has none: shift by 0, so exp2 gives 0, not NaN.
        ms_safe = tl.where(ms == float("-inf"), 0.0, ms)
        l_i = tl.zeros([BLOCK_M], tl.float32) + tl.sum(tl.exp2(sk - ms_safe), 0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DVP], tl.float32)

    # With a table, each list is walked in three parts: far before, near, far after.
    NPARTS: tl.constexpr = 3 if REL_SPLIT else 1
    for phase in tl.static_range(2):
        idx_ptr, lo, hi, first, is_range = _phase_list(phase, lrow, FCNT, FIDX, PCNT, PIDX,
                                                       CF, CP, FULL_CONTIG, FULL_CHECK)
        j_next = first
        for part in tl.static_range(NPARTS):
            start, end = _list_part(SPLITS + lrow * 4 + phase * 2, part, NPARTS, lo, hi)
            for it in tl.range(start, end, num_stages=NEAR_STAGES if part == 1 else STAGES):
                j, j_next = _list_step(idx_ptr, it, hi, first, is_range, j_next,
                                       phase == 0 and FULL_CONTIG, phase == 0 and FULL_CHECK,
                                       PREFETCH)
                offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
                col_ok = (offs_n < LK)[:, None]
                s, t, k, dist, bucket, lowest, highest = _row_tile(
                    q, k_base, BIAS, SLOPES, TABLE, ENTRIES, THRESH, KPOS, KSEG,
                    BMIDX + lrow * CP, BMAPS, b, h, j, it, offs_m, offs_n, qp, qs,
                    q_lo, q_hi, phase, part, LQ, LK, D, DP, BB, HB, BLOCK_M, BLOCK_N, SCALE,
                    SOFTCAP, HAS_BIAS, HAS_KPOS, HAS_SEG, CAUSAL, CAUSAL_OFF, WIN_L, WIN_R,
                    CHUNK, PREFIX, USE_BITMAP, HAS_ALIBI, HAS_REL, NB, NBP, REL_BIDIR,
                    REL_HALF, NT, NPARTS, REL_LOW_B, REL_HIGH_B, REL_DOFF, REL_ND,
                    PTX_ENTRIES, IEEE)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # A row that has seen nothing yet keeps m = -inf: shift by 0 so exp2 gives
                # 0, not NaN.
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = _load2d(v_base + offs_n[:, None] * DV + offs_dv[None, :], col_ok, dv_ok,
                            phase == 1 and LK % BLOCK_N != 0, DV != DVP)
                acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
                m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    # An empty row stores lse = +inf, so the backward's exp2(s - lse) is 0 there.
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o_base = O + (b * H + h).to(tl.int64) * (LQ * DV)
    tl.store(o_base + offs_m[:, None] * DV + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=row_ok & dv_ok)
    tl.store(LSE + (b * H + h).to(tl.int64) * LQ + offs_m, lse, mask=offs_m < LQ)


@triton.jit
def dq_kernel(
    Q, K, V, BIAS, SLOPES, TABLE, THRESH, ENTRIES, QPOS, KPOS, QSEG, KSEG, DO, LSE, DELTA,
    FCNT, FIDX, PCNT, PIDX, BMIDX, BMAPS, SPLITS,
    DQ, DBIAS, DSLOPES, DTABLE,
    H: tl.constexpr, HKV: tl.constexpr, LQ: tl.constexpr, LK: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
    NQB: tl.constexpr, CF: tl.constexpr, CP: tl.constexpr, MB: tl.constexpr, MH: tl.constexpr,
    BB: tl.constexpr, HB: tl.constexpr,
    SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr,
    HAS_SEG: tl.constexpr,
    CAUSAL: tl.constexpr, CAUSAL_OFF: tl.constexpr, WIN_L: tl.constexpr, WIN_R: tl.constexpr,
    CHUNK: tl.constexpr, PREFIX: tl.constexpr, USE_BITMAP: tl.constexpr,
    FULL_CONTIG: tl.constexpr, FULL_CHECK: tl.constexpr, PREFETCH: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_REL: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
    REL_BIDIR: tl.constexpr, REL_HALF: tl.constexpr, NT: tl.constexpr,
    REL_SPLIT: tl.constexpr, REL_LOW_B: tl.constexpr, REL_HIGH_B: tl.constexpr,
    REL_DOFF: tl.constexpr, REL_ND: tl.constexpr,
    STAGES: tl.constexpr, NEAR_STAGES: tl.constexpr,
    PTX_ENTRIES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    # Last q-blocks first: under causal-like masks they visit the most kv-blocks, and starting
    # the longest programs first shortens the tail of the launch.
    pid_m = NQB - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    hk = h // (H // HKV)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DP)
    offs_dv = tl.arange(0, DVP)
    row_ok = (offs_m < LQ)[:, None]
    d_ok = (offs_d < D)[None, :]
    dv_ok = (offs_dv < DV)[None, :]
    CHECK_Q: tl.constexpr = LQ % BLOCK_M != 0

    bh = (b * H + h).to(tl.int64)
    q = _load2d(Q + bh * (LQ * D) + offs_m[:, None] * D + offs_d[None, :], row_ok, d_ok,
                CHECK_Q, D != DP)
    do = _load2d(DO + bh * (LQ * DV) + offs_m[:, None] * DV + offs_dv[None, :], row_ok, dv_ok,
                 CHECK_Q, DV != DVP)
    lse = tl.load(LSE + bh * LQ + offs_m, mask=offs_m < LQ, other=float("inf"))
    delta = tl.load(DELTA + bh * LQ + offs_m, mask=offs_m < LQ, other=0.0)
    k_base = K + (b * HKV + hk).to(tl.int64) * (LK * D)
    v_base = V + (b * HKV + hk).to(tl.int64) * (LK * DV)
    if HAS_BIAS:
        dbias_base = DBIAS + bh * (LQ * LK)
    qp, qs = _coords(QPOS, QSEG, b, offs_m, LQ, HAS_QPOS, HAS_SEG, -1)
    q_lo, q_hi = _span(qp, pid_m * BLOCK_M, BLOCK_M, HAS_QPOS)

    lrow = ((b if MB > 1 else 0) * MH + (h if MH > 1 else 0)) * NQB + pid_m
    dq = tl.zeros([BLOCK_M, DP], tl.float32)
    dslope = tl.sum(tl.zeros([BLOCK_M], tl.float32))
    dtab = tl.zeros([NBP], tl.float32)
    # With a table, each list is walked in three parts: far before, near, far after; the
    # first and last hold one bucket each, whose gradient is summed per row (`ds_low`,
    # `ds_high`) and added to `dtab` at the end.
    NPARTS: tl.constexpr = 3 if REL_SPLIT else 1
    ds_low = tl.zeros([BLOCK_M], tl.float32)
    ds_high = tl.zeros([BLOCK_M], tl.float32)
    # Near tiles' per-bucket sums, per row: each tile's rows reduce within their warps, and
    # the rows are summed once at the end.
    dtab_rows = tl.zeros([BLOCK_M, NBP if NPARTS == 3 else 2], tl.float32)
    if NPARTS == 3:
        dmin, dmax = _bucket_spans(THRESH, NBP, REL_BIDIR, REL_HALF, NT)
    for phase in tl.static_range(2):
        idx_ptr, lo, hi, first, is_range = _phase_list(phase, lrow, FCNT, FIDX, PCNT, PIDX,
                                                       CF, CP, FULL_CONTIG, FULL_CHECK)
        j_next = first
        for part in tl.static_range(NPARTS):
            start, end = _list_part(SPLITS + lrow * 4 + phase * 2, part, NPARTS, lo, hi)
            for it in tl.range(start, end, num_stages=NEAR_STAGES if part == 1 else STAGES):
                j, j_next = _list_step(idx_ptr, it, hi, first, is_range, j_next,
                                       phase == 0 and FULL_CONTIG, phase == 0 and FULL_CHECK,
                                       PREFETCH)
                CHECK_K: tl.constexpr = phase == 1 and LK % BLOCK_N != 0
                offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
                col_ok = (offs_n < LK)[:, None]
                s, t, k, dist, bucket, lowest, highest = _row_tile(
                    q, k_base, BIAS, SLOPES, TABLE, ENTRIES, THRESH, KPOS, KSEG,
                    BMIDX + lrow * CP, BMAPS, b, h, j, it, offs_m, offs_n, qp, qs,
                    q_lo, q_hi, phase, part, LQ, LK, D, DP, BB, HB, BLOCK_M, BLOCK_N, SCALE,
                    SOFTCAP, HAS_BIAS, HAS_KPOS, HAS_SEG, CAUSAL, CAUSAL_OFF, WIN_L, WIN_R,
                    CHUNK, PREFIX, USE_BITMAP, HAS_ALIBI, HAS_REL, NB, NBP, REL_BIDIR,
                    REL_HALF, NT, NPARTS, REL_LOW_B, REL_HIGH_B, REL_DOFF, REL_ND,
                    PTX_ENTRIES, IEEE)
                v = _load2d(v_base + offs_n[:, None] * DV + offs_dv[None, :], col_ok, dv_ok,
                            CHECK_K, DV != DVP)
                p = tl.exp2(s - lse[:, None])
                dp = _dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32),
                          IEEE)
                ds = p * (dp - delta[:, None])
                if SOFTCAP > 0:
                    ds = ds * (1.0 - t * t)
                if HAS_BIAS:
                    tl.store(dbias_base + offs_m[:, None] * LK + offs_n[None, :], ds,
                             mask=row_ok & (offs_n < LK)[None, :])
                # dS is the gradient of each term too: invisible pairs hold dS = 0 (p = 0).
                if HAS_ALIBI:
                    dslope += tl.sum(ds * dist)
                if HAS_REL:
                    if NPARTS == 3 and part == 0:
                        ds_low += tl.sum(ds, 1)
                    elif NPARTS == 3 and part == 2:
                        ds_high += tl.sum(ds, 1)
                    elif NPARTS == 3:
                        dtab_rows = _table_grad_rows(
                            dtab_rows, ds, pid_m * BLOCK_M - j * BLOCK_N, dmin, dmax, BLOCK_N)
                    else:
                        dtab = _table_grad(dtab, ds, bucket, lowest, highest, NBP)
                dq = _dot(ds.to(k.dtype), k, dq, IEEE)
    dq = dq * SCALE
    # Each program writes its own row of partial sums; XLA adds the rows (deterministic).
    prog = bh * NQB + pid_m
    if HAS_ALIBI:
        tl.store(DSLOPES + prog, dslope)
    if HAS_REL:
        offs_nb = tl.arange(0, NBP)
        if NPARTS == 3:
            dtab += tl.sum(dtab_rows, 0)
            dtab += tl.where(offs_nb == REL_LOW_B, tl.sum(ds_low), 0.0)
            dtab += tl.where(offs_nb == REL_HIGH_B, tl.sum(ds_high), 0.0)
        tl.store(DTABLE + prog * NB + offs_nb, dtab, mask=offs_nb < NB)
    tl.store(DQ + bh * (LQ * D) + offs_m[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_ok & d_ok)


@triton.jit
def dkdv_kernel(
    Q, K, V, BIAS, SLOPES, TABLE, THRESH, ENTRIES, QPOS, KPOS, QSEG, KSEG, DO, LSE, DELTA,
    FCNT, FIDX, PCNT, PIDX, BMIDX, BMAPS, SPLITS,
    DK, DV_OUT,
    H: tl.constexpr, HKV: tl.constexpr, LQ: tl.constexpr, LK: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr,
    NKB: tl.constexpr, CF: tl.constexpr, CP: tl.constexpr, MB: tl.constexpr, MH: tl.constexpr,
    BB: tl.constexpr, HB: tl.constexpr,
    SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr,
    HAS_SEG: tl.constexpr,
    CAUSAL: tl.constexpr, CAUSAL_OFF: tl.constexpr, WIN_L: tl.constexpr, WIN_R: tl.constexpr,
    CHUNK: tl.constexpr, PREFIX: tl.constexpr, USE_BITMAP: tl.constexpr,
    FULL_CONTIG: tl.constexpr, FULL_CHECK: tl.constexpr, PREFETCH: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_REL: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
    REL_BIDIR: tl.constexpr, REL_HALF: tl.constexpr, NT: tl.constexpr,
    REL_SPLIT: tl.constexpr, REL_LOW_B: tl.constexpr, REL_HIGH_B: tl.constexpr,
    REL_DOFF: tl.constexpr, REL_ND: tl.constexpr,
    STAGES: tl.constexpr, NEAR_STAGES: tl.constexpr,
    PTX_ENTRIES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    """One program per (kv-block, kv head, batch); it walks the q heads of its group too, so
    grouped-query gradients are summed in registers, deterministically, without atomics.
    Tiles are computed transposed (``[BLOCK_N, BLOCK_M]``: keys by queries). Where the heads
    share one list, one loop of (q-block, head) steps instead of a loop per head."""
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    GROUP: tl.constexpr = H // HKV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DP)
    offs_dv = tl.arange(0, DVP)
    n_ok = (offs_n < LK)[:, None]
    d_ok = (offs_d < D)[None, :]
    dv_ok = (offs_dv < DV)[None, :]
    CHECK_K: tl.constexpr = LK % BLOCK_N != 0
    CHECK_Q: tl.constexpr = LQ % BLOCK_M != 0

    bhk = (b * HKV + hk).to(tl.int64)
    k = _load2d(K + bhk * (LK * D) + offs_n[:, None] * D + offs_d[None, :], n_ok, d_ok,
                CHECK_K, D != DP)
    v = _load2d(V + bhk * (LK * DV) + offs_n[:, None] * DV + offs_dv[None, :], n_ok, dv_ok,
                CHECK_K, DV != DVP)
    kp, ks = _coords(KPOS, KSEG, b, offs_n, LK, HAS_KPOS, HAS_SEG, -2)
    k_lo, k_hi = _span(kp, pid_n * BLOCK_N, BLOCK_N, HAS_KPOS)
    k_in = (offs_n < LK)[:, None]

    dk = tl.zeros([BLOCK_N, DP], tl.float32)
    dv = tl.zeros([BLOCK_N, DVP], tl.float32)
    # With one list for every head (MH == 1), a group's q heads walk one loop of (block, head)
    # steps, heads fastest: one pipeline fill per phase instead of one per head, and the Q / dO
    # tiles of a block's heads are read together.
    FLAT: tl.constexpr = GROUP > 1 and MH == 1
    HEAD_LOOPS: tl.constexpr = 1 if FLAT else GROUP
    STEP_HEADS: tl.constexpr = GROUP if FLAT else 1
    # With a table, each list is walked in three parts: far before, near, far after.
    NPARTS: tl.constexpr = 3 if REL_SPLIT else 1
    for g0 in range(HEAD_LOOPS):
        lrow = ((b if MB > 1 else 0) * MH + (hk * GROUP + g0 if MH > 1 else 0)) * NKB + pid_n
        for phase in tl.static_range(2):
            idx_ptr, lo, hi, first, is_range = _phase_list(
                phase, lrow, FCNT, FIDX, PCNT, PIDX, CF, CP, FULL_CONTIG, FULL_CHECK)
            i_next = first
            for part in tl.static_range(NPARTS):
                start, end = _list_part(SPLITS + lrow * 4 + phase * 2, part, NPARTS, lo, hi)
                for t in tl.range(start * STEP_HEADS, end * STEP_HEADS,
                                  num_stages=NEAR_STAGES if part == 1 else STAGES):
                    it = t // STEP_HEADS
                    i, upcoming = _list_step(idx_ptr, it, hi, first, is_range, i_next,
                                             phase == 0 and FULL_CONTIG,
                                             phase == 0 and FULL_CHECK, PREFETCH)
                    if STEP_HEADS > 1:
                        i_next = tl.where(t % STEP_HEADS == STEP_HEADS - 1, upcoming, i_next)
                    else:
                        i_next = upcoming
                    h = hk * GROUP + g0 + t % STEP_HEADS
                    bh = (b * H + h).to(tl.int64)
                    offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
                    m_ok = (offs_m < LQ)[:, None]
                    q = _load2d(Q + bh * (LQ * D) + offs_m[:, None] * D + offs_d[None, :],
                                m_ok, d_ok, CHECK_Q, D != DP)
                    do = _load2d(DO + bh * (LQ * DV) + offs_m[:, None] * DV
                                 + offs_dv[None, :], m_ok, dv_ok, CHECK_Q, DV != DVP)
                    lse = tl.load(LSE + bh * LQ + offs_m, mask=offs_m < LQ,
                                  other=float("inf"))
                    delta = tl.load(DELTA + bh * LQ + offs_m, mask=offs_m < LQ, other=0.0)
                    s = _dot(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M],
                                                      tl.float32), IEEE)
                    if HAS_BIAS:
                        bias_base = _bias_plane(BIAS, b, h, BB, HB, LQ, LK)
                        bias = tl.load(bias_base + offs_m[None, :] * LK + offs_n[:, None],
                                       mask=(offs_m < LQ)[None, :] & n_ok,
                                       other=0.0).to(tl.float32)
                    else:
                        bias = 0.0
                    if HAS_ALIBI or HAS_REL:
                        qp_m, qs_m = _coords(QPOS, QSEG, b, offs_m, LQ, HAS_QPOS, False, 0)
                        q_lo, q_hi = _span(qp_m, i * BLOCK_M, BLOCK_M, HAS_QPOS)
                        term, dist, bucket, lowest, highest = _score_tile(
                            SLOPES, TABLE, ENTRIES, THRESH, h, qp_m[None, :], kp[:, None],
                            q_lo - k_hi, q_hi - k_lo, HAS_ALIBI, HAS_REL, NB, NBP,
                            REL_BIDIR, REL_HALF, NT, part, NPARTS, REL_LOW_B, REL_HIGH_B,
                            REL_DOFF, REL_ND, PTX_ENTRIES)
                        bias = bias + term
                    s, t_cap = _logits(s, bias, SCALE, SOFTCAP,
                                       HAS_BIAS or HAS_ALIBI or HAS_REL)
                    if phase == 1:
                        if USE_BITMAP:
                            bid = tl.load(BMIDX + lrow * CP + it).to(tl.int64)
                            bits = tl.load(BMAPS + bid * (BLOCK_M * BLOCK_N)
                                           + tl.arange(0, BLOCK_M)[None, :] * BLOCK_N
                                           + tl.arange(0, BLOCK_N)[:, None])
                            vis = bits != 0
                        else:
                            qp, qs = _coords(QPOS, QSEG, b, offs_m, LQ, HAS_QPOS, HAS_SEG,
                                             -1)
                            vis = _visible(qp[None, :], kp[:, None], qs[None, :],
                                           ks[:, None], k_in, CAUSAL, CAUSAL_OFF, WIN_L,
                                           WIN_R, CHUNK, PREFIX, HAS_SEG)
                        s = tl.where(vis, s, float("-inf"))
                    p = tl.exp2(s - lse[None, :])
                    dv = _dot(p.to(do.dtype), do, dv, IEEE)
                    dp = _dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M],
                                                        tl.float32), IEEE)
                    ds = p * (dp - delta[None, :])
                    if SOFTCAP > 0:
                        ds = ds * (1.0 - t_cap * t_cap)
                    dk = _dot(ds.to(q.dtype), q, dk, IEEE)
    dk = dk * SCALE
    tl.store(DK + bhk * (LK * D) + offs_n[:, None] * D + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=n_ok & d_ok)
    tl.store(DV_OUT + bhk * (LK * DV) + offs_n[:, None] * DV + offs_dv[None, :],
             dv.to(DV_OUT.dtype.element_ty), mask=n_ok & dv_ok)
