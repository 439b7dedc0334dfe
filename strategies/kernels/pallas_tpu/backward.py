"""The two backward kernels, each gradient block written by one grid row in a fixed order
(deterministic, no atomics):

- dq: for each (batch, head, q-block) the dq layout's visit list, as the forward; it also
  sums, per (batch, head, q-block), the gradients of the ALiBi slopes, of the table's
  buckets and of the arrays a score function reads into rows of float32 outputs that XLA
  adds up after it, and writes the bias's gradient tile of each block it visits (each
  written once; the blocks no list visits keep the zeros the output starts from);
- dk/dv: for each (batch, kv head, kv-block) the transposed lists of the kv-block, for each
  query head of the kv head's group in turn (K / V are never repeated for GQA); its tiles are
  ``[keys, queries]``, so the log-sum-exp and the row term arrive as rows.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .common import SKIP, TileMath, Visits, data_reader, lanes, launch_struct, tile_coords
from .config import LANES, SUBLANES
from .forward import NN, NT, branches, dot, named_refs, pair_spec, smem_specs, token_specs
from .function import rows as data_rows


def _total(x):
    """The sum of a tile as a ``[1, 1]`` array: over its rows first (adds of whole
    registers), then across the lanes of the one row left."""
    return jnp.sum(jnp.sum(x, axis=0, keepdims=True), axis=1, keepdims=True)


def table_rows(num_buckets: int) -> int:
    """Rows of one table-gradient block: the buckets, rounded up to whole sublanes."""
    return -(-num_buckets // SUBLANES) * SUBLANES


def _ds(math: TileMath, s, batch, head, coords, r, p_of, dp, delta, masked: bool, far, case,
        bias=None):
    """``(P, dS, qp, kp, logits, g)`` of a tile: its probabilities, the gradient of its
    logits before the score function and the soft cap (that of ``softmax_scale * q . k``,
    the slopes' and the table's terms alike), its positions for the terms' gradients, its
    `Logits`, and `g` the gradient of the score function's result (zero where a pair is
    hidden; ``None`` unless the function reads arrays whose gradient is formed). `far`,
    `case`: the tile's `TileMath.far_tile` and table case; `bias` the bias's tile (of `s`'s
    shape), or ``None``; `dS` is its gradient too."""
    qp, kp = coords[2:4]
    logits = math.logits(s, batch, head, qp, kp, r.get("slopes"), r.get("table"), grad=True,
                         far=far, case=case, read=data_reader(math, r), bias=bias)
    s = logits.s
    visible = math.visible(head, coords, r) if masked else None
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    p = p_of(s)
    dp_s = p * (dp - delta)
    ds = dp_s if logits.factor is None else dp_s * logits.factor
    g = None
    if any(leaf.diff for leaf in math.data):
        g = dp_s if logits.cap is None else dp_s * logits.cap
    if visible is not None:  # a factor may be NaN where the logit is -inf
        ds = jnp.where(visible, ds, 0.0)
        g = None if g is None else jnp.where(visible, g, 0.0)
    return p, ds, qp, kp, logits, g


def _data_grads(math: TileMath, refs: dict, logits, batch, head, qp, kp, g):
    """Add a tile's share of the gradients of the arrays the score function reads to their
    blocks (`refs` by slot, ``[rows, 128]`` float32: element ``e`` at ``(e // 128, e %
    128)``): each scalar read's gradient at its element (one select per read)."""
    for slot, flat, value in math.data_grads(logits, batch, head, qp, kp, g):
        ref = refs[slot]
        index = (jax.lax.broadcasted_iota(jnp.int32, ref.shape, 0) * LANES
                 + jax.lax.broadcasted_iota(jnp.int32, ref.shape, 1))
        ref[...] += jnp.where(index == flat, value.astype(jnp.float32), 0.0)


def _bucket_sums(math: TileMath, rows, bucket, ds):
    """A ``[rows, 128]`` block with the sum of `ds` over bucket ``n`` in row ``n``."""
    acc = jnp.zeros(rows.shape, jnp.float32)
    for n in range(math.buckets.num_buckets):
        acc = jnp.where(rows == n, _total(jnp.where(bucket == n, ds, 0.0)), acc)
    return acc


def _table_grad(math: TileMath, dtable_ref, ds, qp, kp, far, case):
    """Add a tile's share of the table's gradient to its ``[rows, 128]`` block (bucket
    ``n``'s in row ``n``, every lane): the sum of dS over the tile's pairs in each bucket.
    Where positions are the token indices (`far` is the tile's `TileMath.far_tile`, `case`
    its static table case): one sum for a tile that lies in a far bucket; on the others,
    piece by piece (`TileMath.pieces`), one sum for a piece in a far bucket, and on the rest
    the sums of the piece's diagonals (`TileMath.diagonal_sums`) gathered by the diagonals'
    buckets."""
    rows = jax.lax.broadcasted_iota(jnp.int32, dtable_ref.shape, 0)
    if case is None:
        dtable_ref[...] += _bucket_sums(math, rows, math.buckets.bucket(qp - kp), ds)
        return
    (_, ahead), (_, behind) = math.buckets.far_buckets()
    sign = far[3]

    def add_far(total, is_ahead, is_behind):
        dtable_ref[...] += (jnp.where(rows == ahead, jnp.where(is_ahead, total, 0.0), 0.0)
                            + jnp.where(rows == behind, jnp.where(
                                jnp.logical_and(is_behind, jnp.logical_not(is_ahead)),
                                total, 0.0), 0.0))

    def near():
        for r, c, d, is_ahead, is_behind in math.pieces(far, ds.shape):
            piece = ds[r, c]
            add_far(_total(piece), is_ahead, is_behind)

            def diagonals(piece=piece, d=d):
                sums = math.diagonal_sums(piece)
                bucket = math.buckets.bucket(math.diagonal_distances(d, sign, sums.shape))
                dtable_ref[...] += _bucket_sums(math, rows, bucket, sums)

            pl.when(jnp.logical_not(jnp.logical_or(is_ahead, is_behind)))(diagonals)

    if case == "near":
        near()
    else:
        dtable_ref[...] += jnp.where(rows == (ahead if case == "ahead" else behind),
                                     _total(ds), 0.0)


def _dq_kernel(block_ref, kind_ref, *refs, names, math: TileMath, visits: Visits, bq: int,
               bk: int):
    n_in = len(names)
    r = named_refs(names, refs[:n_in])
    outs = list(refs[n_in:])
    dq_ref = outs.pop(0)
    dslopes_ref = outs.pop(0) if math.slopes else None
    dtable_ref = outs.pop(0) if math.buckets is not None else None
    ddata_refs = {slot: outs.pop(0) for slot, leaf in enumerate(math.data) if leaf.diff}
    dbias_ref = outs.pop(0) if "bias" in r else None
    (acc_ref,) = outs
    b, h, i, j = (pl.program_id(a) for a in range(4))
    at = visits.at(b, h, i, j)
    kind, kv = kind_ref[at], block_ref[at]

    if dbias_ref is not None:
        # A row that visits nothing still holds one output tile (its slots repeat block
        # 0 of an empty list): zeros. Later slots past a list repeat its last block, whose
        # tile stays as its visit wrote it.
        @pl.when(jnp.logical_and(j == 0, kind == SKIP))
        def _empty_row():
            dbias_ref[...] = jnp.zeros(dbias_ref.shape, dbias_ref.dtype)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        for ref in (dslopes_ref, dtable_ref, *ddata_refs.values()):
            if ref is not None:
                ref[...] = jnp.zeros(ref.shape, jnp.float32)

    far = math.far_tile(i * bq, kv * bk, bq, bk)

    def step(masked: bool, case):
        q, k, v, do = r["q"][...], r["k"][...], r["v"][...], r["do"][...]
        s = dot(q, k, NT)
        dp = dot(do, v, NT)
        coords = tile_coords(s.shape, 0, i * bq, kv * bk, r)
        lse = lanes(r["lse"][...], bk)
        bias = r["bias"][...] if "bias" in r else None
        _, ds, qp, kp, logits, g = _ds(math, s, b, h, coords, r, lambda x: jnp.exp(x - lse),
                                       dp, lanes(r["delta"][...], bk), masked, far, case,
                                       bias)
        if dbias_ref is not None:
            dbias_ref[...] = ds.astype(dbias_ref.dtype)
        dq = dot(ds.astype(k.dtype), k, NN)
        acc_ref[...] += dq * math.scale
        if dslopes_ref is not None:
            part = _total(ds * (kp - qp).astype(jnp.float32))
            dslopes_ref[...] += jnp.broadcast_to(part, dslopes_ref.shape)
        if dtable_ref is not None:
            _table_grad(math, dtable_ref, ds, qp, kp, far, case)
        if ddata_refs:
            _data_grads(math, ddata_refs, logits, b, h, qp, kp, g)

    branches(kind, math.table_cases(far), step)

    @pl.when(j == pl.num_programs(3) - 1)  # `visits.width`, or the call's longest list
    def _end():
        dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)


def _dkv_kernel(block_ref, kind_ref, steps_ref, *refs, names, math: TileMath, visits: Visits,
                bq: int, bk: int, group: int):
    n_in = len(names)
    r = named_refs(names, refs[:n_in])
    dk_ref, dv_ref, dk_acc, dv_acc = refs[n_in:]
    b, hk, n, t = (pl.program_id(a) for a in range(4))
    width = _steps(visits, steps_ref)
    h = hk * group + t // width
    at = visits.at(b, h, n, t % width)
    kind, qb = kind_ref[at], block_ref[at]

    @pl.when(t == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    far = math.far_tile(qb * bq, n * bk, bq, bk, q_rows=False)

    def step(masked: bool, case):
        q, k, v, do = r["q"][...], r["k"][...], r["v"][...], r["do"][...]
        s = dot(k, q, NT)  # [bk, bq]
        dp = dot(v, do, NT)
        coords = tile_coords(s.shape, 1, qb * bq, n * bk, r)
        lse = r["lse"][:1, :]
        # The bias's tile is read [queries, keys], as the other passes read it.
        bias = r["bias"][...].astype(jnp.float32).T if "bias" in r else None
        p, ds, *_ = _ds(math, s, b, h, coords, r, lambda x: jnp.exp(x - lse), dp,
                        r["delta"][:1, :], masked, far, case, bias)
        dv_acc[...] += dot(p.astype(do.dtype), do, NN)
        dk = dot(ds.astype(q.dtype), q, NN)
        dk_acc[...] += dk * math.scale

    branches(kind, math.table_cases(far), step)

    @pl.when(t == pl.num_programs(3) - 1)
    def _end():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _steps(visits: Visits, steps_ref):
    """The slots the dk/dv grid walks per query head: `visits.width`, or (lists built when
    the call runs) the call's longest list, read from scalar memory."""
    return steps_ref[0] if visits.dynamic else visits.width


_PARAMS = pltpu.CompilerParams(
    dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def dq_call(q, k, v, do, lse, delta, tokens: dict, slopes, table, visits: Visits, *,
            math: TileMath, bq: int, bk: int, interpret: bool, data=(), bias=None):
    """``(dq [B, H, Lq, D], dslopes [B, H, nq * 8, 128] | None, dtable [B, H, nq * rows, 128]
    | None, ddata)`` on padded inputs; `lse`, `delta` ``[B, H, Lq, 128]`` (lane-broadcast).
    The score arrays' gradients sit at element 0 of each lane row: one row per q-block for
    the slopes, one per bucket for the table. `data`: the arrays the score function reads
    (`function.stored`); `ddata` their gradients where formed (``{slot: [B, H, nq * rows,
    128]}``, `function.rows` rows per q-block). `bias`: the call's ``[bb, hb, Lq, Lk]``
    (padded), or ``None``; with one, `dbias` follows: ``[B, H, Lq, Lk]``, in the bias's
    dtype where it has the call's batch and heads (else float32, for the caller's sum)."""
    batch, heads, lq, dim = q.shape
    kv_heads, lk, dim_v = v.shape[1], v.shape[2], v.shape[3]
    group = heads // kv_heads
    vb = visits.static()
    nq = lq // bq

    def kv_map(b, h, i, j, block_ref, kind_ref):
        return b, h // group, block_ref[vb.at(b, h, i, j)], 0

    def kv_token_map(b, h, i, j, block_ref, kind_ref):
        return b, 0, block_ref[vb.at(b, h, i, j)]

    def pair_map(b, h, i, j, block_ref, kind_ref):
        return b, h, i, block_ref[vb.at(b, h, i, j)]

    row = lambda width: pl.BlockSpec(  # noqa: E731
        (None, None, bq, width), lambda b, h, i, j, *_: (b, h, i, 0))
    toks, tok_specs, tok_names = token_specs(
        tokens, lambda x: pl.BlockSpec((None, bq, LANES), lambda b, h, i, j, *_: (b, i, 0)),
        lambda x: pl.BlockSpec((None, x.shape[1], bk), kv_token_map),
        lambda x: pair_spec(x, bq, bk, pair_map))
    more, more_specs, more_names = smem_specs(math, slopes, table, data)
    biases = [] if bias is None else [bias]
    arrays = [q, k, v, do, lse, delta, *biases, *toks, *more]
    specs = [row(dim), pl.BlockSpec((None, None, bk, dim), kv_map),
             pl.BlockSpec((None, None, bk, dim_v), kv_map), row(dim_v), row(LANES),
             row(LANES), *(pair_spec(x, bq, bk, pair_map) for x in biases), *tok_specs,
             *more_specs]
    names = ["q", "k", "v", "do", "lse", "delta", *("bias" for _ in biases), *tok_names,
             *more_names]
    out_shape = [launch_struct(q.shape, q.dtype)]
    out_specs = [row(dim)]
    for on, rows in ((math.slopes, SUBLANES), (math.buckets is not None,
                                               table_rows(math.buckets.num_buckets)
                                               if math.buckets is not None else 0)):
        if on:
            out_shape.append(launch_struct((batch, heads, nq * rows, LANES), jnp.float32))
            out_specs.append(pl.BlockSpec((None, None, rows, LANES),
                                          lambda b, h, i, j, *_: (b, h, i, 0)))
    diff = [slot for slot, leaf in enumerate(math.data) if leaf.diff]
    for slot in diff:
        rows = data_rows(math.data[slot])
        out_shape.append(launch_struct((batch, heads, nq * rows, LANES), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, rows, LANES),
                                      lambda b, h, i, j, *_: (b, h, i, 0)))
    aliases = {}
    if bias is not None:
        # The gradient's blocks no list visits are never written: the output starts as
        # zeros (an input it aliases, left in memory untouched by the kernel).
        exact = bias.shape[:2] == (batch, heads)
        zeros = jnp.zeros((batch, heads, lq, lk), bias.dtype if exact else jnp.float32)
        aliases = {2 + len(arrays): len(out_shape)}
        arrays.append(zeros)
        specs.append(pl.BlockSpec(memory_space=pl.ANY))
        names.append("dbias_zeros")
        out_shape.append(launch_struct(zeros.shape, zeros.dtype))
        out_specs.append(pl.BlockSpec((None, None, bq, bk), pair_map))
    kernel = functools.partial(_dq_kernel, names=tuple(names), math=math, visits=vb, bq=bq,
                               bk=bk)
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(batch, heads, nq, visits.grid_steps()),
            in_specs=specs,
            out_specs=out_specs, scratch_shapes=[pltpu.VMEM((bq, dim), jnp.float32)]),
        out_shape=out_shape, compiler_params=_PARAMS, interpret=interpret,
        input_output_aliases=aliases, name="pallas_tpu_dq",
    )(visits.block, visits.kind, *arrays)
    outs = list(outs)
    dq = outs.pop(0)
    dslopes = outs.pop(0) if math.slopes else None
    dtable = outs.pop(0) if math.buckets is not None else None
    ddata = {slot: outs.pop(0) for slot in diff}
    return dq, dslopes, dtable, ddata, (outs.pop(0) if bias is not None else None)


def dkv_call(q, k, v, do, lse, delta, tokens: dict, slopes, table, visits: Visits, *,
             math: TileMath, bq: int, bk: int, interpret: bool, data=(), bias=None):
    """``(dk [B, Hkv, Lk, D], dv [B, Hkv, Lk, Dv])`` on padded inputs; `lse`, `delta`
    ``[B, H, 8, Lq]`` (sublane-broadcast rows); `visits` the transposed lists; `data` the
    arrays the score function reads (`function.stored`); `bias` the call's ``[bb, hb, Lq,
    Lk]`` (padded; read in ``[bq, bk]`` tiles), or ``None``."""
    batch, heads, lq, dim = q.shape
    kv_heads, lk, dim_v = v.shape[1], v.shape[2], v.shape[3]
    group = heads // kv_heads
    vb = visits.static()

    def head(hk, t, steps_ref):
        return hk * group + t // _steps(vb, steps_ref)

    def q_block(b, hk, n, t, block_ref, steps_ref):
        """(head, q-block) of grid step ``t`` of kv-block `n`."""
        h = head(hk, t, steps_ref)
        return h, block_ref[vb.at(b, h, n, t % _steps(vb, steps_ref))]

    def q_map(b, hk, n, t, block_ref, kind_ref, steps_ref):
        h, i = q_block(b, hk, n, t, block_ref, steps_ref)
        return b, h, i, 0

    def q_row_map(b, hk, n, t, block_ref, kind_ref, steps_ref):
        h, i = q_block(b, hk, n, t, block_ref, steps_ref)
        return b, h, 0, i

    def q_token_map(b, hk, n, t, block_ref, kind_ref, steps_ref):
        return b, 0, q_block(b, hk, n, t, block_ref, steps_ref)[1]

    def emap_map(b, hk, n, t, block_ref, kind_ref, steps_ref):
        h, i = q_block(b, hk, n, t, block_ref, steps_ref)
        return b, h, n, i

    def bias_map(b, hk, n, t, block_ref, kind_ref, steps_ref):
        h, i = q_block(b, hk, n, t, block_ref, steps_ref)
        return b, h, i, n

    kv_spec = lambda width_: pl.BlockSpec(  # noqa: E731
        (None, None, bk, width_), lambda b, hk, n, t, *_: (b, hk, n, 0))
    toks, tok_specs, tok_names = token_specs(
        tokens, lambda x: pl.BlockSpec((None, x.shape[1], bq), q_token_map),
        lambda x: pl.BlockSpec((None, bk, LANES), lambda b, hk, n, t, *_: (b, n, 0)),
        lambda x: pair_spec(x, bk, bq, emap_map))
    more, more_specs, more_names = smem_specs(math, slopes, table, data)
    biases = [] if bias is None else [bias]
    arrays = [q, k, v, do, lse, delta, *biases, *toks, *more]
    specs = [pl.BlockSpec((None, None, bq, dim), q_map), kv_spec(dim), kv_spec(dim_v),
             pl.BlockSpec((None, None, bq, dim_v), q_map),
             pl.BlockSpec((None, None, SUBLANES, bq), q_row_map),
             pl.BlockSpec((None, None, SUBLANES, bq), q_row_map),
             *(pair_spec(x, bq, bk, bias_map) for x in biases), *tok_specs, *more_specs]
    names = ("q", "k", "v", "do", "lse", "delta", *("bias" for _ in biases), *tok_names,
             *more_names)
    kernel = functools.partial(_dkv_kernel, names=names, math=math, visits=vb, bq=bq, bk=bk,
                               group=group)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, kv_heads, lk // bk, group * visits.grid_steps()),
            in_specs=specs, out_specs=[kv_spec(dim), kv_spec(dim_v)],
            scratch_shapes=[pltpu.VMEM((bk, dim), jnp.float32),
                            pltpu.VMEM((bk, dim_v), jnp.float32)]),
        out_shape=[launch_struct(k.shape, k.dtype), launch_struct(v.shape, v.dtype)],
        compiler_params=_PARAMS, interpret=interpret, name="pallas_tpu_dkv",
    )(visits.block, visits.kind, visits.steps, *arrays)
