"""The forward kernel: for each (batch, head, q-block) it walks the q-block's visit list
(FULL then PARTIAL kv-blocks, prefetched into scalar memory and read by the K / V index maps,
so blocks the mask leaves empty are never fetched) with an online softmax in float32 scratch,
and writes the output and each row's log-sum-exp."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .common import (FULL, PARTIAL, TileMath, Visits, data_reader, lanes, launch_struct,
                     tile_coords)
from .config import LANES

#: ``a . b^T`` (both operands' last axis contracted) and ``a . b``.
NT = (((1,), (1,)), ((), ()))
NN = (((1,), (0,)), ((), ()))


def dot(a, b, dims):
    """A float32-accumulated tile product; float32 operands at full precision (16-bit ones
    run at the MXU's native precision)."""
    full = a.dtype == jnp.float32 and b.dtype == jnp.float32
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32,
                               precision=jax.lax.Precision.HIGHEST if full else None)


def named_refs(names, refs):
    """The kernel's input refs by name (`names` in the order the inputs were given)."""
    return dict(zip(names, refs))


def pair_spec(x, rows: int, cols: int, index):
    """The spec of an array read per pair tile, ``[mb, mh, R, C]`` with ``mb``, ``mh`` 1 or
    the call's (an element map, `CompiledMask.element_map`, or the call's bias): tiles of
    ``[rows, cols]``; `index` maps the grid and the prefetched lists to (batch, head, row
    block, column block), its batch and head taken as 0 where the array has no such axis."""
    mb, mh = x.shape[:2]

    def index_map(*args):
        b, h, i, j = index(*args)
        return b if mb > 1 else 0, h if mh > 1 else 0, i, j

    return pl.BlockSpec((None, None, rows, cols), index_map)


def token_specs(tokens: dict, q_spec, kv_spec, map_spec):
    """The per-token inputs in name order with their specs (query-side, key-side, or the
    element map's)."""
    names = sorted(tokens)
    spec = lambda n: (map_spec if n == "emap" else q_spec if n.startswith("q")  # noqa: E731
                      else kv_spec)(tokens[n])
    return [tokens[n] for n in names], [spec(n) for n in names], names


def smem_specs(math: TileMath, slopes, table, data=()):
    """The score arrays the call has, and the arrays its score function reads (`data`, as
    `function.stored` lays them out: inputs ``fdata0``, ...), with their whole-array
    scalar-memory specs."""
    arrays, specs, names = [], [], []
    for name, x, on in (("slopes", slopes, math.slopes), ("table", table,
                                                         math.buckets is not None)):
        if on:
            arrays.append(x.astype(jnp.float32))
            specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
            names.append(name)
    for n, x in enumerate(data):
        arrays.append(x)
        specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        names.append(f"fdata{n}")
    return arrays, specs, names


def branches(kind, cases, step):
    """Run ``step(masked, case)`` on the tile in the one branch its kind (FULL: unmasked,
    PARTIAL: masked) and its table case (`TileMath.table_cases`) select."""
    for value, masked in ((FULL, False), (PARTIAL, True)):
        for case, condition in cases:
            pl.when(jnp.logical_and(kind == value, condition))(
                functools.partial(step, masked, case))


def _forward_kernel(block_ref, kind_ref, *refs, names, math: TileMath, visits: Visits,
                    bq: int, bk: int):
    n_in = len(names)
    r = named_refs(names, refs[:n_in])
    o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[n_in:]
    b, h, i, j = (pl.program_id(a) for a in range(4))
    at = visits.at(b, h, i, j)
    kind, kv = kind_ref[at], block_ref[at]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    far = math.far_tile(i * bq, kv * bk, bq, bk)

    def step(masked: bool, case):
        q, k, v = r["q"][...], r["k"][...], r["v"][...]
        s = dot(q, k, NT)
        coords = tile_coords(s.shape, 0, i * bq, kv * bk, r)
        qp, kp = coords[2:4]
        bias = r["bias"][...] if "bias" in r else None
        s = math.logits(s, b, h, qp, kp, r.get("slopes"), r.get("table"), grad=False,
                        far=far, case=case, read=data_reader(math, r), bias=bias).s
        if masked:
            s = jnp.where(math.visible(h, coords, r), s, -jnp.inf)
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row that has seen no logit yet keeps m = -inf: shift it by 0 instead.
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        p = jnp.exp(s - lanes(m_safe, s.shape[1]))
        alpha = jnp.exp(m_prev - m_safe)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        pv = dot(p.astype(v.dtype), v, NN)
        acc_ref[...] = lanes(alpha, pv.shape[1]) * acc_ref[...] + pv

    branches(kind, math.table_cases(far), step)

    @pl.when(j == pl.num_programs(3) - 1)  # `visits.width`, or the call's longest list
    def _end():
        l, m = l_ref[...], m_ref[...]
        empty = l == 0.0
        inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
        o_ref[...] = (acc_ref[...] * lanes(inv, o_ref.shape[-1])).astype(o_ref.dtype)
        # +inf on a row that sees no key: the backward's exp(s - lse) is 0 there.
        lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def forward_call(q, k, v, tokens: dict, slopes, table, visits: Visits, *, math: TileMath,
                 bq: int, bk: int, interpret: bool, data=(), bias=None):
    """``(out [B, H, Lq, Dv], lse [B, H, Lq, 128])`` on padded inputs: `lse` natural, +inf
    on rows that see no key, broadcast across the lanes. `data`: the arrays the score
    function reads (`function.stored`); `bias`: the call's ``[bb, hb, Lq, Lk]`` (padded), or
    ``None``."""
    batch, heads, lq, dim = q.shape
    kv_heads, lk, dim_v = v.shape[1], v.shape[2], v.shape[3]
    group = heads // kv_heads
    vb = visits.static()

    def kv_map(b, h, i, j, block_ref, kind_ref):
        return b, h // group, block_ref[vb.at(b, h, i, j)], 0

    def kv_token_map(b, h, i, j, block_ref, kind_ref):
        return b, 0, block_ref[vb.at(b, h, i, j)]

    def pair_map(b, h, i, j, block_ref, kind_ref):
        return b, h, i, block_ref[vb.at(b, h, i, j)]

    toks, tok_specs, tok_names = token_specs(
        tokens, lambda x: pl.BlockSpec((None, bq, LANES), lambda b, h, i, j, *_: (b, i, 0)),
        lambda x: pl.BlockSpec((None, x.shape[1], bk), kv_token_map),
        lambda x: pair_spec(x, bq, bk, pair_map))
    more, more_specs, more_names = smem_specs(math, slopes, table, data)
    biases = [] if bias is None else [bias]
    arrays = [q, k, v, *biases, *toks, *more]
    specs = [pl.BlockSpec((None, None, bq, dim), lambda b, h, i, j, *_: (b, h, i, 0)),
             pl.BlockSpec((None, None, bk, dim), kv_map),
             pl.BlockSpec((None, None, bk, dim_v), kv_map),
             *(pair_spec(x, bq, bk, pair_map) for x in biases), *tok_specs, *more_specs]
    names = ["q", "k", "v", *("bias" for _ in biases), *tok_names, *more_names]
    row_spec = lambda width: pl.BlockSpec(  # noqa: E731
        (None, None, bq, width), lambda b, h, i, j, *_: (b, h, i, 0))
    kernel = functools.partial(_forward_kernel, names=tuple(names), math=math, visits=vb,
                               bq=bq, bk=bk)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, heads, lq // bq, visits.grid_steps()),
            in_specs=specs,
            out_specs=[row_spec(dim_v), row_spec(LANES)],
            scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),
                            pltpu.VMEM((bq, LANES), jnp.float32),
                            pltpu.VMEM((bq, dim_v), jnp.float32)]),
        out_shape=[launch_struct((batch, heads, lq, dim_v), q.dtype),
                   launch_struct((batch, heads, lq, LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="pallas_tpu_forward",
    )(visits.block, visits.kind, *arrays)
