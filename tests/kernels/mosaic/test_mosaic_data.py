"""A score function that reads arrays (its `params`, arrays it closes over) in
`MosaicBlockSparse`, on a host without a GPU.

Each read's scalar, per batch row and head, is an operand of the launches (its read table),
loaded once per work item; the dk/dv launch forms the tables' cotangent and JAX carries it to
the arrays (`strategies/kernels/mosaic/data.py`). Here: the read tables and their gradient
against NumPy; the forward and the backward lower for CUDA with a closure's slopes, learned
slopes in `params` (symmetric ALiBi: ALiBi itself would run as built-in slopes, `as_alibi`),
and an integer table per head; what stays unsupported is declined in one line. One extended
test runs the whole call, forward and every gradient, in Pallas' CPU interpreter for Mosaic
GPU against the float64 oracle.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
import eqx_bsattn._layout as layout_internals
from eqx_bsattn import masks, scores
from eqx_bsattn._score import ScoreTerms
from eqx_bsattn._score_alibi import as_alibi
from eqx_bsattn.strategies.kernels.mosaic import MosaicBlockSparse
from eqx_bsattn.strategies.kernels.mosaic import kernel as mosaic_kernel
from tests.conftest import (jnp_attention_f64, np_visibility, random_array, rel_err, score_f64,
                            widths_by_head)

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

HEADS = 4
#: Slopes of four heads, closed over by `closure_alibi`.
SLOPES = jnp.asarray([0.5, 0.25, -0.125, 0.0625], jnp.float32)
#: A window width per head (int32), closed over by `table_window`.
WIDTHS = jnp.asarray([40, 90, 7, 300], jnp.int32)


def symmetric_alibi(score, head, q_pos, k_pos, slopes):
    """Symmetric ALiBi, ``score - slopes[head] * |k - q|``: ALiBi on the pairs with k <= q,
    but not affine in the positions, so it runs as a score function (reading `slopes` in the
    kernels) where ALiBi as written by hand would become built-in ALiBi (`as_alibi`)."""
    return score - slopes[head] * jnp.abs(k_pos - q_pos).astype(jnp.float32)


def closure_alibi(score, head, q_pos, k_pos):
    """Symmetric ALiBi, its slopes a jnp array the function closes over."""
    return symmetric_alibi(score, head, q_pos, k_pos, SLOPES)


def learned_alibi(score, head, q_pos, k_pos, params):
    """Symmetric ALiBi with learned slopes, ``params["slopes"] [H]``."""
    return symmetric_alibi(score, head, q_pos, k_pos, params["slopes"])


def table_window(score, head, q_pos, k_pos):
    """A window per head read from an int32 table: farther keys hidden (-inf)."""
    return jnp.where(q_pos - k_pos > WIDTHS[head], -jnp.inf, score)


def _qkv(batch, heads, kv_heads, length, dim, dtype=jnp.bfloat16):
    q = random_array(1, (batch, heads, length, dim), dtype)
    k = random_array(2, (batch, kv_heads, length, dim), dtype)
    v = random_array(3, (batch, kv_heads, length, dim), dtype)
    return q, k, v


def _term(fn, params=None):
    return scores.ScoreFunction(fn, params).compile(HEADS).function


def test_functions_are_not_rewritten_to_builtin_alibi():
    """The score functions here that read slopes run as functions (the in-kernel reads these
    tests are about), never as built-in ALiBi: `as_alibi` leaves each of them as it is."""
    for fn, params in ((closure_alibi, None), (learned_alibi, {"slopes": SLOPES}),
                       (lambda s, h, qp, kp: symmetric_alibi(s, h, qp, kp, SLOPES), None)):
        assert as_alibi(ScoreTerms(function=fn, params=params), HEADS).function is not None


#: name: (the loss's score for traced `data`, `data`, arrays the gradient has beside q, k, v)
LOWERED = {
    # The closure's slopes traced (a gradient is asked for them).
    "closure_alibi": (lambda sl: scores.ScoreFunction(
        lambda s, h, qp, kp: symmetric_alibi(s, h, qp, kp, sl)), SLOPES, 1),
    "params_alibi": (lambda p: scores.ScoreFunction(learned_alibi, p),
                     {"slopes": SLOPES}, 1),
    # An int32 table: read, never differentiated.
    "table_window": (lambda _: scores.ScoreFunction(table_window), None, 0),
    # Learned log-slopes, exponentiated whole before the read (folded before the launches).
    "params_exp": (lambda p: scores.ScoreFunction(
        lambda s, h, qp, kp, p: symmetric_alibi(s, h, qp, kp, jnp.exp(p["log"])), p),
        {"log": jnp.log(jnp.abs(SLOPES))}, 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LOWERED))
def test_data_functions_lower_for_cuda(hopper_host, case):
    """`jit(grad)` of a call whose score function reads arrays lowers for CUDA: the forward,
    dq and dk/dv launches (the deterministic backward, which every JAX runs), each taking
    the arrays as operands; where they are traced, the dk/dv launch also returns their
    reads' rows and the gradient has their shapes."""
    make, data, extra = LOWERED[case]
    q, k, v = _qkv(2, HEADS, 2, 300, 64)

    def loss(q, k, v, data):
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=MosaicBlockSparse(),
                                        score=make(data))
        return jnp.sum(attn(q, k, v).astype(jnp.float32))

    argnums = (0, 1, 2, 3) if extra else (0, 1, 2)
    lowered = jax.jit(jax.grad(loss, argnums=argnums)).trace(q, k, v, data).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("custom_call @mosaic_gpu") == 3, case
    shapes = [o.shape for o in jax.tree.leaves(lowered.out_info)]
    assert shapes == [q.shape, k.shape, v.shape] + [(HEADS,)] * extra, case


def test_data_reads_are_operands_of_each_launch(hopper_host, launches):
    """The launch configurations carry the function traced at each launch's tile (the
    forward's and dq's 64 x 128 at D = 64, the dk/dv launch's 64 keys x 64 queries) and
    the arrays' leaves; only a traced float array is differentiated, and the dk/dv launch
    returns rows for its one read a tile (`backward.data_read_count`)."""
    from eqx_bsattn.strategies.kernels.mosaic.backward import data_read_count

    q, k, v = _qkv(1, HEADS, HEADS, 256, 64)

    def call(fn, q):
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=MosaicBlockSparse(),
                                        score=scores.ScoreFunction(fn))
        return attn(q, k, v)

    def loss(slopes):
        fn = lambda s, h, qp, kp: symmetric_alibi(s, h, qp, kp, slopes)  # noqa: E731
        return jnp.sum(call(fn, q).astype(jnp.float32))

    jax.eval_shape(jax.grad(loss), SLOPES)
    # The module's concrete slopes: read, not differentiated.
    jax.eval_shape(functools.partial(call, closure_alibi), q)
    (traced_f, traced_b, _, _), (const_f, const_b, _, _) = launches
    assert [tuple(shape) for shape, _ in traced_b.traced] == [(64, 128), (64, 64)]
    assert traced_f.traced == traced_b.traced
    assert [leaf.diff for leaf in traced_b.data] == [True]
    assert [leaf.diff for leaf in const_b.data] == [False]
    assert data_read_count(traced_b) == 1 and data_read_count(const_b) == 0


def test_read_tables_and_their_gradient_match_numpy():
    """`read_tables`: each read's scalar for every batch row and head (a float array read
    at ``[head]`` and at ``[batch, head]``, an int32 one at ``[head]``, in the order the
    function reads them), and its transpose: a random cotangent of the float table lands on
    the elements read, summed (float64 NumPy)."""
    from eqx_bsattn.strategies.kernels.mosaic.common import stored
    from eqx_bsattn.strategies.kernels.mosaic.data import data_terms, read_tables

    batch, heads = 3, HEADS
    bias = random_array(5, (batch, heads))

    def fn(s, h, qp, kp, p, batch):
        return jnp.where(qp - kp > WIDTHS[h], -jnp.inf,
                         s * p["w"][h] + p["bias"][batch, h])

    params = {"w": random_array(6, (heads,)), "bias": bias}
    term = scores.ScoreFunction(fn, params).compile(heads).function
    cfg = data_terms(term, params, 64, with_gradients=True)
    leaves = cfg.data
    arrays = [None] * len(leaves)
    for slot, leaf in enumerate(leaves):  # the leaves by shape: w [H], bias [B, H], widths
        arrays[slot] = {(heads,): params["w"] if leaf.dtype != jnp.int32 else WIDTHS,
                        (batch, heads): bias}[leaf.shape]
    data = tuple(stored(x, leaf) for x, leaf in zip(arrays, leaves))
    kinds = [leaves[slot].shape + (str(leaves[slot].dtype),) for slot in cfg.reads]
    assert kinds == [(heads, "int32"), (heads, "float32"), (batch, heads, "float32")]
    (floats, ints), pullback = jax.vjp(lambda d: read_tables(cfg, d, batch, heads), data)
    b, h = np.meshgrid(np.arange(batch), np.arange(heads), indexing="ij")
    np.testing.assert_array_equal(np.asarray(ints[0]), np.asarray(WIDTHS)[h])
    np.testing.assert_array_equal(np.asarray(floats[0]), np.asarray(params["w"])[h])
    np.testing.assert_array_equal(np.asarray(floats[1]), np.asarray(bias))
    cot = np.asarray(random_array(7, floats.shape), np.float64)
    (grads,) = pullback((jnp.asarray(cot, jnp.float32),
                         np.zeros(ints.shape, jax.dtypes.float0)))
    want_w = np.zeros(heads)
    np.add.at(want_w, h.ravel(), cot[0].ravel())
    slot_w = [i for i, x in enumerate(arrays) if x is params["w"]][0]
    slot_b = [i for i, x in enumerate(arrays) if x is bias][0]
    np.testing.assert_allclose(np.asarray(grads[slot_w]), want_w, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads[slot_b]), cot[1].ravel(), rtol=1e-6)


def _gather(score, head, q_pos, k_pos):
    """Reads the slopes at the keys' positions: a gather, not a scalar read."""
    return score + SLOPES[k_pos % HEADS]


def _corner(score, head, q_pos, k_pos):
    """Reads the slopes at an index taken from the tile of positions."""
    return score + SLOPES[q_pos[0, 0] % HEADS]


_BIG = jnp.ones((70000,), jnp.float32)
_HALF = SLOPES.astype(jnp.bfloat16)


def _big(score, head, q_pos, k_pos):
    return score + _BIG[head]


def _half(score, head, q_pos, k_pos):
    return score + _HALF[head].astype(jnp.float32)


@pytest.mark.parametrize("fn, words", [
    (_gather, "reads an array only as the Mosaic kernels cannot: it applies `gather`"),
    (_corner, "reads an array at an index that depends on the logits or the positions"),
    (_big, "reads arrays of 70000 elements (at most 65536)"),
    (_half, "reads an array of bfloat16 (shape (4,)): the Mosaic kernels read 32-bit"),
])
def test_unsupported_reads_are_declined_in_one_line(fn, words):
    """What the kernels cannot read is declined, in one line: a gather by the positions, an
    index from the tiles, too many elements, a 16-bit array."""
    why = mosaic_kernel._function_decline(_term(fn), None, 64)
    assert why is not None and words in why and "\n" not in why, why


def test_functions_reading_arrays_are_taken():
    """A function that reads arrays as the kernels can is taken (it lowers): a closure's
    slopes, an int table, learned slopes in params, concrete or abstract, or params the plan
    knows only by their presence (checked where the call runs); so is one that reads no
    array; inside a sharding's loop one that reads arrays is declined."""
    decline = mosaic_kernel._function_decline
    cases = [(_term(closure_alibi), None), (_term(table_window), None),
             (_term(learned_alibi, {"slopes": SLOPES}), {"slopes": SLOPES}),
             (_term(learned_alibi, {"slopes": SLOPES}),
              {"slopes": jax.ShapeDtypeStruct((HEADS,), jnp.float32)}),
             (_term(learned_alibi, {"slopes": SLOPES}), mosaic_kernel._UNKNOWN)]
    for term, params in cases:
        assert decline(term, params, 64) is None
    # An operation on a whole array before the read runs before the launches: its result is
    # one array at every launch's tile (three tiles at D = 128), whether the params are
    # concrete or traced.
    folded = lambda s, h, qp, kp, p: s - (jnp.exp(p["log"]) / p["log"].size)[h]  # noqa: E731
    params = {"log": SLOPES}
    for dim in (64, 128):
        assert decline(_term(folded, params), params, dim) is None
    traced = []
    jax.jit(lambda p: traced.append(decline(_term(folded, p), p, 128)) or 0.0)(params)
    assert traced == [None]
    assert "loop (RingAttention)" in decline(cases[0][0], None, 64, in_loop=True)
    plain = _term(lambda s, h, qp, kp: s * 0.5)
    assert decline(plain, None, 64) is None


@pytest.mark.slow
@pytest.mark.extended
def test_data_gradients_in_cpu_interpreter(interpreted):
    """The whole call, its launches in Pallas' CPU interpreter for Mosaic GPU: a function
    reading a closure's traced slopes (doubled whole first), a learned scale per head in
    `params` and an int32
    window table (two differentiated reads a tile and an integer one), grouped heads and
    ragged keys; output and the gradients in q, k, v, the slopes and the params against the
    float64 oracle."""
    heads, kv_heads, length, dim = 2, 1, 200, 64
    slopes = jnp.asarray([0.25, -0.1], jnp.float32)
    scale = {"w": jnp.asarray([1.5, 0.75], jnp.float32)}
    widths = jnp.asarray([60, 150], jnp.int32)

    def fn(s, h, qp, kp, sl, p):
        # The slopes doubled whole before the read: one array folded before the launches,
        # the same slot at each launch's tile.
        s = s * p["w"][h] + (2.0 * sl)[h] * (kp - qp).astype(s.dtype)
        return jnp.where(qp - kp > widths[h], -jnp.inf, s)

    q, k, v = (x.astype(jnp.float32) for x in _qkv(1, heads, kv_heads, length, dim))
    cot = random_array(4, q.shape)

    def call(q, k, v, sl, p):
        score = scores.ScoreFunction(lambda s, h, qp, kp, p: fn(s, h, qp, kp, sl, p), p)
        attn = bsa.BlockSparseAttention(mask=masks.Causal(), kernel=MosaicBlockSparse(),
                                        score=score)
        return attn(*(x.astype(jnp.float16) for x in (q, k, v))).astype(jnp.float32)

    out, pullback = jax.vjp(call, q, k, v, slopes, scale)
    got = pullback(cot)
    visible = np_visibility(masks.Causal(), batch=1, heads=heads, q_len=length, kv_len=length)
    positions = np.arange(length)[None]
    with jax.enable_x64(True):
        def oracle(q, k, v, sl, p):
            def score(s):
                return score_f64(s, q_pos=positions, kv_pos=positions,
                                 fn=lambda s, h, qp, kp: fn(s, h, qp, kp, sl, p))
            return jnp_attention_f64(q, k, v, visible, score=score)

        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in
               (*(x.astype(jnp.float16) for x in (q, k, v)), slopes)]
        want_out, oracle_pullback = jax.vjp(
            oracle, *f64, jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), scale))
        want = oracle_pullback(jnp.asarray(np.asarray(cot, np.float64)))
    assert rel_err(out, want_out) < 4e-3
    for name, g, w in zip(("dq", "dk", "dv", "dslopes", "dscale"), got, want):
        assert rel_err(jax.tree.leaves(g)[0], jax.tree.leaves(w)[0]) < 1e-2, name


# A mask's element predicate that reads arrays at scalar indices of the head: evaluated on
# the partial blocks with its scalars from the read tables (`data.predicate_data`), no
# element map.

def closure_widths(q, k, head):
    """The same window, its widths a jnp array the predicate closes over."""
    return (k <= q) & (q - k < WIDTHS[head])


#: name: (mask, a score function reading traced slopes too, per-call segment ids and
#: positions)
MASK_READS = {
    "params": (masks.Predicate(widths_by_head, WIDTHS), False, False),
    "closure": (masks.Predicate(closure_widths), False, False),
    # Both the mask's and the score function's reads (its slopes traced) in one call.
    "closure_with_function": (masks.Predicate(closure_widths), True, False),
    # The predicate on segment id and position tiles too (its trace takes seven tiles).
    "params_documents_positions": (masks.Predicate(widths_by_head, WIDTHS) & masks.Document(),
                                   False, True),
}


#: The quick tier's cases (params, and a closure beside a score function's reads); the
#: others are the full tier (`slow`).
QUICK_MASK_READS = {"params", "closure_with_function"}


@pytest.mark.parametrize("case", [
    pytest.param(name, marks=() if name in QUICK_MASK_READS else pytest.mark.slow)
    for name in sorted(MASK_READS)])
def test_mask_reading_arrays_lowers_for_cuda_without_element_map(hopper_host, launches,
                                                                 monkeypatch, case):
    """`jit(grad)` of a call whose mask predicate reads per-head widths (a `Predicate`'s
    params, or a closure's array) lowers for CUDA (forward, dq and dk/dv launches), the
    predicate traced at each launch's tile (the dk/dv tile's rows are keys) and its widths
    read as one int32 scalar per head from the read tables (broadcast over the batch rows);
    no element map is built or passed. With a score function reading traced slopes too,
    both sets of reads share the tables and only the slopes get a gradient."""
    mask, score, per_call = MASK_READS[case]
    batch, q_len, dim = 2, 300, 64
    q, k, v = _qkv(batch, HEADS, 2, q_len, dim)
    data = {}
    if per_call:
        # Constant positions (traced ones get a run-time range check, a host callback that
        # JAX cannot lower for another platform); segment ids traced.
        ids = jnp.broadcast_to(jnp.arange(q_len, dtype=jnp.int32) // 80, (batch, q_len))
        positions = np.arange(q_len, dtype=np.int32) * 2 - 40
        data = dict(q_segment_ids=ids, kv_segment_ids=ids)

    def loss(q, k, v, slopes, data):
        fn = None if not score else scores.ScoreFunction(
            lambda s, h, qp, kp: symmetric_alibi(s, h, qp, kp, slopes))
        attn = bsa.BlockSparseAttention(mask=mask, kernel=MosaicBlockSparse(), score=fn)
        extra = dict(q_positions=positions, kv_positions=positions) if per_call else {}
        return jnp.sum(attn(q, k, v, **data, **extra).astype(jnp.float32))

    argnums = (0, 1, 2, 3) if score else (0, 1, 2)
    if per_call:
        # The layout built on the device from positions checks its capacity the same way.
        monkeypatch.setattr(layout_internals.eqx, "error_if", lambda x, *_: x)
    lowered = jax.jit(jax.grad(loss, argnums=argnums)).trace(q, k, v, SLOPES, data).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().count("custom_call @mosaic_gpu") == 3, case
    shapes = [o.shape for o in jax.tree.leaves(lowered.out_info)]
    assert shapes == [q.shape, k.shape, v.shape] + [(HEADS,)] * bool(score), case
    ((fcfg, bcfg, (floats, ints), maps),) = launches
    assert maps is None and not fcfg.elements and not bcfg.elements
    assert [tuple(s) for s, _ in fcfg.mask_traced] == [(64, 128), (64, 64)]
    assert bcfg.mask_traced == fcfg.mask_traced and len(fcfg.mask_reads) == 1
    assert [leaf.diff for leaf in fcfg.mask_data] == [False]
    # The mask's int32 widths: one table row, its scalar per head for every batch row.
    assert ints.shape == (1, batch, HEADS) and floats.shape[0] == bool(score)
    assert [leaf.diff for leaf in bcfg.data] == [True] * bool(score)
    arguments = 7 if per_call else 5
    assert all(len(t.invars) == arguments for _, t in fcfg.mask_traced)
    assert fcfg.positions == per_call


def test_mask_read_tables_match_numpy():
    """`read_tables` with a mask predicate's reads after the score function's: the
    function's float slopes at ``[head]``, then the mask's int32 widths at ``[head]`` and a
    float threshold at ``[head + 1]``, each for every batch row (float64 NumPy)."""
    from eqx_bsattn.strategies.kernels.mosaic.common import LogitTerms, stored
    from eqx_bsattn.strategies.kernels.mosaic.data import (data_terms, mask_terms,
                                                            predicate_data, read_tables)

    batch, heads = 3, HEADS
    scale = random_array(8, (heads + 1,))

    def fn(q, k, p, head):
        return (q - k < p["w"][head]) & ((q - k).astype(jnp.float32) > p["x"][head + 1])

    mask = masks.Predicate(fn, {"w": WIDTHS, "x": scale})
    predicate = bsa.ResolvedMask(mask, q_len=200, kv_len=200, num_heads=heads).predicate()
    found = predicate_data(predicate, 64)
    assert found is not None
    function = data_terms(_term(closure_alibi), None, 64, with_gradients=False)
    cfg = LogitTerms(function=function.function, traced=function.traced, data=function.data,
                     reads=function.reads, **mask_terms(found))
    f_arrays = (stored(SLOPES, function.data[0]),)
    m_arrays = tuple(stored(x, leaf) for x, leaf in zip(found.arrays, found.leaves))
    floats, ints = read_tables(cfg, f_arrays, batch, heads, m_arrays)
    h = np.broadcast_to(np.arange(heads), (batch, heads))
    np.testing.assert_array_equal(np.asarray(floats[0]), np.asarray(SLOPES)[h])
    np.testing.assert_array_equal(np.asarray(ints[0]), np.asarray(WIDTHS)[h])
    np.testing.assert_array_equal(np.asarray(floats[1]),
                                  np.asarray(scale, np.float64)[h + 1].astype(np.float32))
    assert cfg.read_columns == ((True, 0), (False, 0), (True, 1))


def _gather_widths(q, k, widths, head):
    """Reads the widths at the keys' indices: a gather, not a scalar read."""
    return q - k < widths[k % HEADS]


def _corner_widths(q, k, widths, head):
    """Reads the widths at an index taken from the tile of queries."""
    return q - k < widths[q[0, 0] % HEADS]


def test_mask_reading_arrays_plan(hopper_host):
    """A per-head-widths `Predicate` is taken with no element map, at 256 tokens and at
    16k tokens and 16 heads (where its element maps would take 16 GiB). What the kernels
    cannot read in-kernel (a gather by the keys, an index from the tiles, a 16-bit array,
    too many elements) reads the element map where it fits and is declined past 4 GiB, in
    one line."""
    from eqx_bsattn.strategies.kernels.mosaic.kernel import mask_route

    kernel = MosaicBlockSparse()
    heads, long = 16, 16384
    widths = jnp.arange(8, 8 + 16 * heads, 16, dtype=jnp.int32)

    def judge(fn, data, length):
        resolved = bsa.ResolvedMask(masks.Predicate(fn, data), q_len=length, kv_len=length,
                                    num_heads=heads)
        features = bsa.Features(platform="gpu", dtype="bfloat16", head_dim=64, value_dim=64,
                                batch=1, num_heads=heads, num_kv_heads=heads, q_len=length,
                                kv_len=length)
        predicate = resolved.predicate()
        return kernel.decline_reason(resolved, features), mask_route(predicate, 64).reads

    assert judge(widths_by_head, widths, long) == (None, "data")
    assert judge(widths_by_head, widths, 256) == (None, "data")
    # The widths doubled whole before the read: folded before the launches, one array at
    # each launch's tile.
    doubled = lambda q, k, w, head: (k <= q) & (q - k < (2 * w)[head])  # noqa: E731
    assert judge(doubled, widths, long) == (None, "data")
    small = bsa.ResolvedMask(masks.Predicate(widths_by_head, widths), q_len=256, kv_len=256,
                             num_heads=heads).predicate()
    assert mask_route(small, 64).reads != "elements"
    others = ((_gather_widths, widths), (_corner_widths, widths),
              (widths_by_head, widths.astype(jnp.int16)),
              (widths_by_head, jnp.ones((70000,), jnp.int32)))
    for fn, data in others:
        why, reads = judge(fn, data, long)
        assert reads == "elements" and "\n" not in why, (fn, why)
        assert "element predicate reads an array; its element map would take 16.0 GiB" in why
        assert judge(fn, data, 256) == (None, "elements")


@pytest.mark.slow
@pytest.mark.extended
def test_mask_reading_arrays_in_cpu_interpreter(interpreted, launches):
    """The whole call in Pallas' CPU interpreter for Mosaic GPU with a mask predicate reading
    per-head widths in-kernel (no element map): a `Predicate`'s params within documents
    (segment ids) with grouped heads and ragged, unequal lengths (200 queries, 333 keys);
    and a closure's widths beside a score function reading traced slopes (symmetric ALiBi;
    both sets of reads in one call). Output and the gradients in q, k, v (and the slopes)
    against the float64 oracle."""
    heads, kv_heads, dim = 2, 1, 64
    widths = jnp.asarray([30, 120], jnp.int32)
    slopes = jnp.asarray([0.25, -0.1], jnp.float32)

    def closure(q, k, head):
        return (k <= q + 5) & (q - k < widths[head])

    documents = masks.Predicate(widths_by_head, widths) & masks.Document()
    for mask, q_len, kv_len, score in ((documents, 200, 333, False),
                                       (masks.Predicate(closure), 200, 200, True)):
        # Segment ids (documents of 70 and 110 tokens) in the first call only.
        q_seg, kv_seg = (np.arange(n, dtype=np.int32)[None] // (70 if n == q_len else 110)
                         for n in (q_len, kv_len))
        ids = {} if score else dict(q_segment_ids=jnp.asarray(q_seg),
                                    kv_segment_ids=jnp.asarray(kv_seg))
        q = random_array(1, (1, heads, q_len, dim)).astype(jnp.float16).astype(jnp.float32)
        k, v = (random_array(s, (1, kv_heads, kv_len, dim)).astype(jnp.float16).astype(
            jnp.float32) for s in (2, 3))
        cot = random_array(4, q.shape)

        def call(q, k, v, sl, mask=mask, score=score, ids=ids):
            fn = None if not score else scores.ScoreFunction(
                lambda s, h, qp, kp: symmetric_alibi(s, h, qp, kp, sl))
            attn = bsa.BlockSparseAttention(mask=mask, kernel=MosaicBlockSparse(), score=fn)
            return attn(*(x.astype(jnp.float16) for x in (q, k, v)), **ids).astype(
                jnp.float32)

        out, pullback = jax.vjp(call, q, k, v, slopes)
        got = pullback(cot)
        assert launches[-1][3] is None and launches[-1][0].mask_traced  # no element map
        q_pos, kv_pos = np.arange(q_len)[None], np.arange(kv_len)[None]
        # The predicate on NumPy index grids, per head (`np_visibility` takes no head).
        element = functools.partial(widths_by_head, widths=np.asarray(widths)) if not score \
            else closure
        visible = np.stack([np.asarray(element(q_pos[0, :, None], kv_pos[0, None, :],
                                               head=h), bool) for h in range(heads)])[None]
        if not score:
            visible = visible & (q_seg[0, :, None] == kv_seg[0, None, :])
        with jax.enable_x64(True):
            def oracle(q, k, v, sl, score=score, visible=visible, q_pos=q_pos,
                       kv_pos=kv_pos):
                def terms(s):
                    return score_f64(s, q_pos=q_pos, kv_pos=kv_pos,
                                     fn=lambda s, h, qp, kp: symmetric_alibi(s, h, qp, kp, sl))
                return jnp_attention_f64(q, k, v, visible, score=terms if score else None)

            f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, slopes)]
            want_out, oracle_pullback = jax.vjp(oracle, *f64)
            want = oracle_pullback(jnp.asarray(np.asarray(cot, np.float64)))
        assert rel_err(out, want_out) < 4e-3, q_len
        names = ("dq", "dk", "dv", "dslopes")[:4 if score else 3]
        for name, g, w in zip(names, got, want):
            assert rel_err(g, w) < 1e-2, (name, score)
