"""`PallasTpuBlockSparse` against the float64 oracle, forward and every gradient (q, k, v,
sinks, ALiBi slopes, the relative-position table), in Pallas' interpret mode on the CPU and
compiled on a TPU (float32 inputs, products at the highest precision); its visit lists and
the selector. The conformance suite runs it over its own cases too."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn import kernels, masks, scores
from eqx_bsattn._score_alibi import as_alibi
from eqx_bsattn.strategies.kernels.pallas_tpu.common import (FULL, PARTIAL, SKIP, TileMath,
                                                            visits)
from eqx_bsattn.strategies.kernels.pallas_tpu.function import mask_data
from tests.conftest import jnp_attention_f64, np_visibility, score_f64, sorted_segments

ON_TPU = jax.default_backend() == "tpu"
#: Relative error in norm, float32 inputs. On a TPU v5e exp, log and tanh agree with float64 to
#: four or five digits even at the highest matmul precision: the backward's probabilities
#: exp(s - lse) carry that error (2.5e-5 to 5.3e-5 measured on the gradients; the forward's
#: normalisation cancels most of it in the output).
TOL = 1e-4 if ON_TPU else 2e-5
#: The ALiBi slopes' gradient, ``sum dS (k - q)`` over every visible pair, is a covariance of
#: dP and the distance under P, summed as products whose terms cancel: each dS is ``P (dP -
#: delta)``, rounded at float32 and, on a TPU, through exp's four or five digits, and the
#: distances (hundreds) amplify that rounding where the sum is small. Float32 XLA has the
#: same conditioning: interpreted on the CPU, `array_documents_positions` has the dense float32
#: reference at 2.5e-5 and XlaBlockSparse at 1.9e-4 against float64 (this kernel 3.7e-5); on
#: a v5e `causal_gqa_alibi_sinks_cap` measured 5.1e-4 with the q, k, v gradients at 5e-5.
SLOPES_TOL = 1e-3 if ON_TPU else 5e-5
TILES = kernels.PallasTpuConfig(block_q=128, block_kv=128)


def scaled_distance(s, head, q, k):
    """A score function that is not additive: its derivative in the logits is not one."""
    return s * (1.0 + 0.25 * head) - 0.1 * jnp.sqrt(jnp.abs(q - k))


def by_batch(s, head, q, k, *, batch):
    """A score function that reads the batch index."""
    return s + (0.5 - 0.75 * batch) * jnp.tanh(0.05 * (k - q).astype(jnp.float32)) + 0.1 * head


FUNCTIONS = {"function": scaled_distance, "function_batch": by_batch}


def window_by_head(q, k, head):
    """A mask that varies by head: a causal window 40 + 50 * head wide."""
    return (k <= q) & (q - k < 40 + 50 * head)


def window_by_width(q, k, widths, head):
    """A causal window whose width per head is read from `params` (``widths[head]``)."""
    return (k <= q) & (q - k < widths[head])


#: Per-head widths, as a `Predicate`'s params.
WIDTHS = np.asarray([30, 75, 140, 260], np.int32)


def odd_diagonals(q, k):
    """A mask without terms: keys 3 or more before the query at odd distances."""
    return (k <= q - 3) & ((q - k) % 2 == 1)


#: A per-head element mask with a row that sees nothing (``[4, 300, 300]``).
KEEP = np.random.default_rng(7).random((4, 300, 300)) < 0.4
KEEP[:, 5] = False


@dataclasses.dataclass(frozen=True)
class Case:
    mask: object
    batch: int = 1
    heads: int = 4
    kv_heads: int = 2
    q_len: int = 300
    kv_len: int = 300
    dim: int = 64
    value_dim: int = 64
    score: str | None = None  # "alibi", "table", "function"
    soft_cap: float | None = None
    sinks: bool = False
    documents: int = 0
    positions: bool = False
    #: NumPy visibility ``(head, q_pos [n, 1], k_pos [1, m]) -> bool`` where `np_visibility`
    #: has none (masks that read the head or an array).
    reference: object = None
    tiles: object = TILES


CASES = {
    # The default tier: few and small (interpreted on two CPU cores).
    "causal_gqa_alibi_sinks_cap": Case(masks.Causal(), score="alibi", soft_cap=4.0, sinks=True),
    "documents_table": Case(masks.Causal(), batch=2, heads=2, kv_heads=1, score="table",
                            documents=3),
    "window_cross_function": Case(masks.Causal(bottom_right=True) & masks.SlidingWindow(90, 0),
                                  heads=2, q_len=200, kv_len=330, score="function"),
    "fully_masked_rows": Case(masks.Causal(offset=-150), heads=2, kv_heads=1, q_len=260,
                              kv_len=256),
    # The extended tier.
    "positions_alibi": Case(masks.Causal(), heads=2, positions=True, score="alibi"),
    "chunked_mqa": Case(masks.ChunkedCausal(100), heads=4, kv_heads=1, value_dim=128),
    "prefix_table_cap": Case(masks.PrefixLM(70), heads=2, score="table", soft_cap=3.0),
    "full_function_sinks": Case(masks.Full(), heads=2, kv_heads=2, q_len=140, kv_len=260,
                                score="function", sinks=True),
    "window_function_batch": Case(masks.SlidingWindow(60, 20), batch=2, heads=2, kv_heads=1,
                                  q_len=200, kv_len=200, score="function_batch"),
}
# Masks without in-kernel terms: traced into the kernels, or (an array) read as element tiles.
CASES.update({
    # Tiles of 2 x 2 and 2 x 1 pieces: near tiles with pieces in a far bucket and pieces not.
    "table_pieces_cross": Case(masks.Full(), heads=2, kv_heads=1, q_len=260, kv_len=300,
                               dim=32, value_dim=32, score="table",
                               tiles=kernels.PallasTpuConfig(256, 256, 256, 128)),
    "predicate_head_table": Case(masks.Predicate(window_by_head), score="table",
                                 reference=lambda h, q, k: window_by_head(q, k, h)),
    # Its params read in the kernels from scalar memory, at the head (no element map).
    "predicate_params_alibi": Case(masks.Predicate(window_by_width, jnp.asarray(WIDTHS)),
                                   score="alibi",
                                   reference=lambda h, q, k: window_by_width(q, k, WIDTHS, h)),
    "dilated_or_global_cross": Case((masks.Dilated(2) & masks.Causal(bottom_right=True))
                                    | masks.GlobalTokens(8), heads=2, kv_heads=1, q_len=200,
                                    kv_len=330, score="alibi"),
    "array_mask_gqa": Case(masks.ArrayMask(KEEP), soft_cap=4.0,
                           reference=lambda h, q, k: KEEP[h][q, k]),
    "not_window_rows": Case(masks.Causal() & ~masks.SlidingWindow(20, 0), heads=2, kv_heads=1,
                            q_len=260, kv_len=256),
    "predicate_positions": Case(masks.Predicate(odd_diagonals), heads=2, positions=True,
                                score="function"),
    "predicate_documents": Case(masks.Predicate(odd_diagonals), batch=2, heads=2, kv_heads=1,
                                documents=3, score="table"),
    "array_documents_positions": Case(masks.ArrayMask(KEEP[:1]), batch=2, heads=2,
                                      kv_heads=1, documents=2, positions=True, score="alibi",
                                      reference=lambda h, q, k: KEEP[0][q, k]),
})
#: The quick tier's cases (interpreted on two CPU cores, seconds each): a predicate reading
#: per-head params in scalar memory with learned ALiBi and grouped heads, and a union of
#: masks without terms traced into the kernels, across lengths. The conformance suite's quick
#: cases for this kernel take sinks, a soft cap, documents and the table; the log-sum-exp
#: test takes rows that see no key.
QUICK = {"predicate_params_alibi", "dilated_or_global_cross"}
#: The rest of the default tier's cases, the full tier (`slow`): tens of seconds to minutes
#: each, interpreted here.
FULL_CASES = {"causal_gqa_alibi_sinks_cap", "documents_table", "window_cross_function",
              "fully_masked_rows", "predicate_head_table", "array_mask_gqa"}


def _score(case: Case, arrays: dict):
    if case.score == "alibi":
        return scores.ALiBi(arrays["slopes"], learned=True)
    if case.score == "table":
        return scores.RelativePositionBias(arrays["table"])
    if case.score in FUNCTIONS:
        return scores.ScoreFunction(FUNCTIONS[case.score])
    return None


def _build(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    b, h, hkv = case.batch, case.heads, case.kv_heads
    args = {"q": normal(b, h, case.q_len, case.dim), "k": normal(b, hkv, case.kv_len, case.dim),
            "v": normal(b, hkv, case.kv_len, case.value_dim)}
    if case.sinks:
        args["sinks"] = normal(h, 2)
    if case.score == "alibi":
        args["slopes"] = 0.3 * normal(h)
    if case.score == "table":
        args["table"] = 0.3 * normal(h, 32)
    data, truth = {}, {}
    if case.documents:
        ids = sorted_segments(rng, b, case.q_len, case.documents, pad=7)
        data.update(q_segment_ids=ids, kv_segment_ids=ids)
        truth.update(q_seg=ids, kv_seg=ids)
    if case.positions:
        qp = np.sort(rng.choice(case.q_len + case.kv_len, size=(b, case.q_len)), -1)
        kp = np.stack([np.arange(case.kv_len)] * b)
        data.update(q_positions=qp.astype(np.int32), kv_positions=kp.astype(np.int32))
        truth.update(q_pos=qp, kv_pos=kp)
    mask = case.mask & masks.Document() if case.documents else case.mask
    if case.reference is None:
        visible = np_visibility(mask, batch=b, heads=h, q_len=case.q_len, kv_len=case.kv_len,
                                **truth)
    else:
        visible = _reference_visibility(case, truth)
    cot = normal(b, h, case.q_len, case.value_dim)
    return mask, args, {n: jnp.asarray(x) for n, x in data.items()}, truth, visible, cot


def _reference_visibility(case: Case, truth: dict) -> np.ndarray:
    """`Case.reference` on every (batch, head, query, key), with the documents' rule and
    the call's positions (an array mask reads the token indices instead)."""
    b, h, lq, lk = case.batch, case.heads, case.q_len, case.kv_len
    index = isinstance(case.mask, masks.ArrayMask)
    qp = truth.get("q_pos") if not index else None
    kp = truth.get("kv_pos") if not index else None
    qp = np.broadcast_to(np.arange(lq), (b, lq)) if qp is None else qp
    kp = np.broadcast_to(np.arange(lk), (b, lk)) if kp is None else kp
    out = np.stack([np.stack([np.broadcast_to(case.reference(hh, qp[bb][:, None],
                                                             kp[bb][None, :]), (lq, lk))
                              for hh in range(h)]) for bb in range(b)])
    if case.documents:
        qs, ks = truth["q_seg"], truth["kv_seg"]
        out = out & ((qs[:, None, :, None] == ks[:, None, None, :])
                     & (qs[:, None, :, None] >= 0))
    return out


def _ours(case: Case, mask, args, data, cot):
    def loss(args):
        arrays = {n: args[n] for n in ("slopes", "table") if n in args}
        attn = bsa.BlockSparseAttention(mask=mask, score=_score(case, arrays),
                                        logits_soft_cap=case.soft_cap,
                                        kernel=kernels.PallasTpuBlockSparse(),
                                        tiling=case.tiles)
        out = attn(args["q"], args["k"], args["v"], sinks=args.get("sinks"), **data)
        return jnp.vdot(out, cot), out

    with jax.default_matmul_precision("highest"):
        grads, out = jax.jit(jax.grad(loss, has_aux=True))(args)
    return out, grads


def _oracle(case: Case, args, truth, visible, cot):
    b = case.batch
    q_pos = truth.get("q_pos", np.broadcast_to(np.arange(case.q_len), (b, case.q_len)))
    kv_pos = truth.get("kv_pos", np.broadcast_to(np.arange(case.kv_len), (b, case.kv_len)))
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        a = {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in args.items()}

        def loss(a):
            score = lambda s: score_f64(  # noqa: E731
                s, q_pos=q_pos, kv_pos=kv_pos, slopes=a.get("slopes"), table=a.get("table"),
                fn=_oracle_function(case))
            out = jnp_attention_f64(a["q"], a["k"], a["v"], visible, sinks=a.get("sinks"),
                                    soft_cap=case.soft_cap, score=score)
            return jnp.vdot(out, jnp.asarray(np.asarray(cot, np.float64))), out

        grads, out = jax.grad(loss, has_aux=True)(a)
        return np.asarray(out), {n: np.asarray(g) for n, g in grads.items()}


def _oracle_function(case: Case):
    """The case's score function as `score_f64` calls it (the batch index broadcast)."""
    if case.score == "function_batch":
        batch = jnp.arange(case.batch)[:, None, None, None]
        return lambda s, h, q, k: by_batch(s, h, q, k, batch=batch)
    return FUNCTIONS.get(case.score)


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all()
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[] if n in QUICK else [pytest.mark.slow] if n in FULL_CASES
                 else [pytest.mark.slow, pytest.mark.extended])
    for n in CASES])
def test_matches_the_oracle(name):
    case = CASES[name]
    mask, args, data, truth, visible, cot = _build(case)
    out, grads = _ours(case, mask, args, data, cot)
    want_out, want_grads = _oracle(case, args, truth, visible, cot)
    errors = {"out": _rel(out, want_out)}
    errors.update({n: _rel(grads[n], want_grads[n]) for n in args})
    assert set(errors) >= {"out", "q", "k", "v"}
    bad = {n: e for n, e in errors.items() if e > (SLOPES_TOL if n == "slopes" else TOL)}
    assert not bad, errors
    dead = ~visible.any(-1)  # rows that see no key: exact zeros, output and dq
    if dead.any():
        assert (np.asarray(out)[dead] == 0).all() and (np.asarray(grads["q"])[dead] == 0).all()
    if name == "fully_masked_rows":
        assert dead.any()


@pytest.mark.parametrize("sign, shape, q0, k0", [
    pytest.param(-1, (256, 384), 300, 0, marks=pytest.mark.slow), (1, (256, 128), 300, 0)])
def test_table_pieces_and_diagonal_sums(sign, shape, q0, k0):
    """A near tile's table term, formed piece by piece (far pieces as one scalar, the others
    by diagonals), is the entry of each pair's bucket; a piece's diagonal sums are those of
    its pairs by ``c - r``. Tiles along queries (``sign = -1``) and along keys."""
    table = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32)), jnp.float32)
    buckets = scores.RelativePositionBias(table).buckets
    math = TileMath(terms=None, kv_len=1000, scale=1.0, soft_cap=None, buckets=buckets)
    rows, cols = shape
    far = (math.far_tile(q0, k0, rows, cols) if sign < 0
           else math.far_tile(q0, k0, cols, rows, q_rows=False))
    assert not far[0] and not far[1]
    pieces = math.pieces(far, shape)
    assert {(bool(a), bool(b)) for *_, a, b in pieces} >= {(False, False), (True, False)}
    x = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.float32)

    @jax.jit
    def run(x):
        sums = [math.diagonal_sums(x[r, c]) for r, c, *_ in pieces]
        return math.table_near(table, 1, far, shape), sums

    got, sums = run(x)
    r, c = np.arange(rows)[:, None], np.arange(cols)[None, :]
    bucket = np.asarray(buckets.bucket(jnp.asarray(far[2] + sign * (c - r))))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(table)[1][bucket])
    for (rs, cs, *_), got_sums in zip(pieces, sums):
        width = got_sums.shape[1]
        diag = (c[:, cs] - cs.start) - (r[rs] - rs.start)
        piece = np.asarray(x)[rs, cs]
        for row, offset in ((0, 0), (1, -width)):
            want = [piece[diag == j + offset].sum() for j in range(width)]
            np.testing.assert_allclose(np.asarray(got_sums)[row], want, atol=1e-4)


@pytest.fixture
def v5e_lowering(monkeypatch):
    """The Mosaic modules of the TPU kernels a program lowers to, as text, lowered for a TPU
    v5e on this host (Pallas lowers TPU kernels in Python; Mosaic compiles them on the
    chip): ``lower(fn, *args)`` returns ``{kernel name: module text}``."""
    from jax._src import tpu_custom_call
    from jax._src.pallas.mosaic import tpu_info

    modules = []
    serialize = tpu_custom_call._lower_mosaic_module_to_asm

    def capture(module, **kwargs):
        modules.append(str(module))
        return serialize(module, **kwargs)

    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    monkeypatch.setattr(tpu_custom_call, "_lower_mosaic_module_to_asm", capture)

    def lower(fn, *args):
        modules.clear()
        jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
        return {re.search(r"func\.func @(\w+)", m).group(1): m for m in modules}

    yield lower
    tpu_info.get_tpu_info.cache_clear()  # it cached the v5e's description


def test_strided_rolls_fit_a_v5e_register(v5e_lowering):
    """Mosaic rotates a strided lane roll one 8-row register at a time and requires the span
    of shifts inside one, ``(base mod 128) + 7 * stride``, not to exceed 128 (a stride meant
    as -1 mod 128 spans 889 and does not compile). The relative-position table's diagonals
    (forward, and their sums in the dq pass) stay inside it."""
    table = jnp.asarray(np.random.default_rng(0).standard_normal((1, 32)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 1, 256, 64)), jnp.float32)

    def loss(q, k, v, table):
        attn = bsa.BlockSparseAttention(
            mask=masks.Causal(), score=scores.RelativePositionBias(table),
            kernel=kernels.PallasTpuBlockSparse(interpret=False), tiling=TILES)
        return attn(q, k, v).sum()

    modules = v5e_lowering(jax.grad(loss, argnums=(0, 1, 2, 3)), x, x, x, table)
    assert set(modules) == {"pallas_tpu_forward", "pallas_tpu_dq", "pallas_tpu_dkv"}
    rotate = re.compile(r"tpu\.dynamic_rotate \S+ by %c(\d+)_i32\S* dim 1 \{stride = (\d+) "
                        r": si32, stride_dimension = 0 : si32\} : vector<(\d+)x(\d+)x")
    for name, text in modules.items():
        strided = [line for line in text.splitlines() if "stride =" in line]
        found = [rotate.search(line) for line in strided]
        assert strided and all(found), (name, strided)
        for amount, stride, rows, width in (map(int, m.groups()) for m in found):
            spans = [(8 * i * stride + amount) % width % 128 + 7 * stride
                     for i in range(rows // 8)]
            assert max(spans) <= 128, (name, amount, stride, rows, width)


def test_visit_lists_put_full_blocks_first_and_repeat_the_last():
    layout = bsa.build_layout(masks.Causal(), q_len=300, kv_len=300, num_heads=1,
                              block_q=128, block_kv=128)
    v = visits(layout, transposed=False, rows=4)
    block, kind = (np.asarray(x).reshape(4, v.width) for x in (v.block, v.kind))
    assert v.width == 3
    assert kind.tolist() == [[PARTIAL, SKIP, SKIP], [FULL, PARTIAL, SKIP],
                             [FULL, FULL, PARTIAL], [SKIP, SKIP, SKIP]]
    assert block.tolist()[:3] == [[0, 0, 0], [0, 1, 1], [0, 1, 2]]
    t = visits(layout, transposed=True, rows=3)
    t_kind = np.asarray(t.kind).reshape(3, t.width)
    assert t_kind.tolist() == [[FULL, FULL, PARTIAL], [FULL, PARTIAL, SKIP],
                               [PARTIAL, SKIP, SKIP]]


TPU = dict(platform="tpu", q_len=8192, kv_len=8192, num_heads=16, num_kv_heads=16,
           head_dim=128, value_dim=128, dtype="bfloat16")


@pytest.mark.parametrize("extra, mask, want", [
    ({}, masks.Causal(), "splash"),
    ({"score": ("alibi",)}, masks.Causal(), "pallas_tpu"),
    ({"score": ("relative_bias",)}, masks.Causal(), "pallas_tpu"),
    ({"score": ("function",)}, masks.SlidingWindow(1024, 0), "pallas_tpu"),
    ({"positions": True}, masks.Causal(), "pallas_tpu"),
    ({"bias": True}, masks.Causal(), "xla"),
    ({"dtype": "float16"}, masks.Causal(), "xla"),
    ({"score": ("alibi",)}, masks.Dilated(2) | masks.Causal(), "pallas_tpu"),
    ({"positions": True}, masks.Predicate(odd_diagonals), "pallas_tpu"),
])
def test_selector_on_tpu(extra, mask, want):
    choice = bsa.select_kernel(mask, "tpu", bsa.Features(**{**TPU, **extra}))
    assert choice.kernel.name == want, choice.explain()


def test_declines_name_the_reason():
    kernel = kernels.PallasTpuBlockSparse()
    resolved = bsa.ResolvedMask(masks.Causal(), q_len=256, kv_len=256, num_heads=2)
    assert kernel.decline_reason(resolved, bsa.Features(**{**TPU, "bias": True})) == (
        "a bias has not yet run on a TPU.")
    assert "float16" in kernel.decline_reason(resolved, bsa.Features(**{**TPU,
                                                                        "dtype": "float16"}))
    union = bsa.ResolvedMask(masks.Dilated(2) | masks.Causal(), q_len=256, kv_len=256,
                             num_heads=2)
    assert kernel.decline_reason(union, bsa.Features(**TPU)) is None
    # Gathering by the positions: an element map, which would be too large at 64k tokens.
    indexing = masks.Predicate(lambda q, k, w: q - k < w[q % 2], jnp.asarray([9, 4]))
    long = {**TPU, "q_len": 65536, "kv_len": 65536}
    big = bsa.ResolvedMask(indexing, q_len=65536, kv_len=65536, num_heads=16)
    assert kernel.decline_reason(big, bsa.Features(**long)) == (
        "the mask's element predicate indexes an array, so it would read an element map of "
        "8.0 GiB per call (at most 4 GiB).")
    # Reading it at a scalar index: in scalar memory, no element map at any length.
    scalar = masks.Predicate(lambda q, k, w: q - k < w[0], jnp.asarray([9]))
    assert kernel.decline_reason(bsa.ResolvedMask(scalar, q_len=65536, kv_len=65536,
                                                  num_heads=16), bsa.Features(**long)) is None
    small = bsa.ResolvedMask(indexing, q_len=8192, kv_len=8192, num_heads=16)
    assert kernel.decline_reason(small, bsa.Features(**TPU)) is None
    assert kernel.decline_reason(resolved, bsa.Features(**TPU)) is None
    assert kernels.PallasTpuBlockSparse.priority("cpu") is None


@pytest.mark.parametrize("mask, traced", [
    (masks.Predicate(window_by_head), True),
    (masks.Causal() & ~masks.SlidingWindow(20, 0), True),
    (masks.Dilated(2) | masks.GlobalTokens(8), True),
    (masks.ArrayMask(KEEP), False),
    (masks.Predicate(lambda q, k, w: q - k < w[0], jnp.asarray([9])), False),
])
def test_masks_without_terms_are_traced_unless_they_index_an_array(mask, traced):
    """A predicate that only computes on the coordinates runs inside the kernels; one that
    reads an array (indexed by traced values, or per-call params) comes as element tiles."""
    resolved = bsa.ResolvedMask(mask, q_len=300, kv_len=300, num_heads=4)
    compiled = resolved.compile(TILES, kernels.PallasTpuBlockSparse.reads)
    assert compiled.terms is None
    assert compiled.without_layouts().traces_on_tiles((8, 128)) is traced
    assert resolved.predicate().traces_on_tiles((8, 128)) is traced


@pytest.mark.parametrize("mask, in_kernel", [
    (masks.Predicate(window_by_width, jnp.asarray(WIDTHS)), True),
    (masks.Predicate(lambda q, k, w: q - k < w[0], jnp.asarray([9])), True),
    (masks.Predicate(window_by_width, jnp.asarray(WIDTHS, jnp.int16)), False),
    (masks.ArrayMask(KEEP), False),
])
def test_predicates_reading_arrays_at_scalar_indices_run_in_the_kernels(mask, in_kernel):
    """A predicate that indexes an array only at scalar indices (the head) is evaluated on the
    tiles with the array in scalar memory (`function.mask_data`); one that gathers by the
    positions (`ArrayMask`) or reads a 16-bit array reads the element map."""
    resolved = bsa.ResolvedMask(mask, q_len=300, kv_len=300, num_heads=4)
    predicate = resolved.predicate()
    assert not predicate.traces_on_tiles((8, 128))
    assert (mask_data(predicate, [(8, 128), (128, 8)], False) is not None) is in_kernel


def test_predicate_params_lower_for_a_tpu(v5e_lowering):
    """``interpret=False``: `jax.grad` through a `Predicate` with per-head widths lowers for a
    v5e with the widths in scalar memory and no element map among the kernels' inputs."""
    x = jax.ShapeDtypeStruct((1, 4, 256, 128), jnp.float32)

    def loss(q, k, v):
        attn = bsa.BlockSparseAttention(
            mask=masks.Predicate(window_by_width, jnp.asarray(WIDTHS)),
            kernel=kernels.PallasTpuBlockSparse(interpret=False), tiling=TILES)
        return attn(q, k, v).sum()

    modules = v5e_lowering(jax.grad(loss, argnums=(0, 1, 2)), x, x, x)
    assert set(modules) == {"pallas_tpu_forward", "pallas_tpu_dq", "pallas_tpu_dkv"}
    for name, text in modules.items():
        assert "memref<4xi32, #tpu.memory_space<smem>>" in text, name
        assert "xi8" not in text, name  # no element map's int8 tiles


def test_element_map_is_the_predicate_per_head_and_batch():
    ids = jnp.asarray([[0] * 5 + [1] * 4 + [-1], [0] * 10], jnp.int32)
    mask = masks.ArrayMask(KEEP[:2, :10, :10]) & masks.Document()
    attn = bsa.BlockSparseAttention(mask=mask, kernel=kernels.PallasTpuBlockSparse())
    q = jnp.ones((2, 2, 10, 8))
    plan = attn.plan(q, q, q, q_segment_ids=ids, kv_segment_ids=ids)
    emap = np.asarray(plan.mask.element_map(plan.inputs, 16, 12))
    assert emap.shape == (2, 2, 16, 12) and emap.dtype == np.int8
    same = np.asarray(ids)[:, :, None] == np.asarray(ids)[:, None, :]
    want = KEEP[None, :2, :10, :10] & same[:, None] & (np.asarray(ids) >= 0)[:, None, :, None]
    assert (emap[:, :, :10, :10] == want).all()
    assert not emap[:, :, 10:].any() and not emap[:, :, :, 10:].any()


def test_tiles_are_whole_lanes_on_a_tpu_only():
    kernel = kernels.PallasTpuBlockSparse()
    tpu = bsa.Features(platform="tpu", q_len=300, kv_len=1000)
    assert kernel.adapt_tiling(bsa.Tiling(block_q=16, block_kv=200), tpu).blocks.forward == (
        128, 256)
    assert kernel.default_tiling(tpu, None) == kernels.PallasTpuConfig(512, 512)
    cpu = bsa.Features(platform="cpu", q_len=300, kv_len=1000)
    assert kernel.adapt_tiling(bsa.Tiling(block_q=16, block_kv=32), cpu).blocks.forward == (
        16, 32)


def test_pallas_platform_takes_score_terms_through_the_selector():
    """``platform="pallas"`` plans for a TPU: a call with ALiBi goes to this kernel
    (interpreted off a TPU) and matches the reference."""
    keys = jax.random.split(jax.random.key(4), 3)
    q, k, v = (jax.random.normal(key, (1, 2, 64, 16)) for key in keys)
    kw = dict(causal=True, sliding_window=20, score=scores.ALiBi())
    with jax.default_matmul_precision("highest"):
        got = bsa.blocksparse_attention(q, k, v, platform="pallas", **kw)
        want = bsa.blocksparse_attention(q, k, v, platform="dense", **kw)
    assert _rel(got, want) < TOL
    plan = bsa.BlockSparseAttention(mask=masks.Causal(), score=scores.ALiBi()).plan(
        q, k, v, platform="tpu")
    assert plan.kernel.name == "pallas_tpu"


def test_log_sum_exp_and_its_gradient():
    """`attention_with_lse`: the log-sum-exp (-inf on rows that see no key) and the
    gradients of a loss on the output and the log-sum-exp, against float64 (what
    `RingAttention` merges shards by)."""
    b, h, hkv, lq, lk, d = 1, 2, 1, 150, 140, 16
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((b, h, lq, d), (b, hkv, lk, d), (b, hkv, lk, d)))
    w_out, w_lse = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                    for s in ((b, h, lq, d), (b, h, lq)))
    mask = masks.Causal(offset=-9)
    visible = np_visibility(mask, batch=b, heads=1, q_len=lq, kv_len=lk)
    seen = visible.any(-1)

    def ours(q, k, v):
        attn = bsa.BlockSparseAttention(mask=mask, kernel=kernels.PallasTpuBlockSparse(),
                                        tiling=TILES)
        plan = attn.plan(q, k, v)
        return plan.kernel.attention_with_lse(
            q, k, v, mask=plan.mask, inputs=plan.inputs, features=plan.features,
            tiling=plan.tiling, softmax_scale=plan.softmax_scale, logits_soft_cap=None)

    def oracle(q, k, v):
        k, v = jnp.repeat(k, h // hkv, axis=1), jnp.repeat(v, h // hkv, axis=1)
        s = jnp.where(visible, jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(d), -jnp.inf)
        lse = jax.nn.logsumexp(jnp.where(seen[..., None], s, 0.0), axis=-1)
        out = jnp.einsum("bhqk,bhkd->bhqd", jnp.exp(s - lse[..., None]), v)
        return jnp.where(seen[..., None], out, 0.0), jnp.where(seen, lse, -jnp.inf)

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(seen, lse, 0.0) * w_lse)

    with jax.default_matmul_precision("highest"):
        out, lse = jax.jit(ours)(q, k, v)
        grads = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))(q, k, v)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        want_out, want_lse = oracle(*f64)
        want_grads = jax.grad(lambda *a: loss(oracle, *a), argnums=(0, 1, 2))(*f64)
    rows = np.broadcast_to(seen, lse.shape)
    assert lse.dtype == jnp.float32 and np.isneginf(np.asarray(lse)[~rows]).all()
    assert _rel(np.asarray(lse)[rows], np.asarray(want_lse)[rows]) < TOL / 10
    assert _rel(out, want_out) < TOL
    for g, w in zip(grads, want_grads):
        assert _rel(g, w) < TOL


def symmetric_alibi(s, head, q, k, slopes):
    """``s - slopes[head] * |k - q|``: ALiBi on the causal pairs, with `params` the slopes,
    and not ALiBi's affine form, so it runs as a function (`as_alibi` would make the affine
    ``s + slopes[head] * (k - q)`` built-in ALiBi)."""
    return s - slopes[head] * jnp.abs(k - q)


@pytest.mark.slow  # params as a dict run in the kernels quick: test_pallas_tpu_function_data.py
def test_a_score_function_whose_params_are_one_array_runs():
    """`params` a bare array (no dict): read in the kernels at the head, as the reference
    reads it (forward; the gradients are tested in test_pallas_tpu_function_data.py)."""
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 2, 32, 8)), jnp.float32) for _ in range(3))
    slopes = jnp.asarray([0.5, -0.25], jnp.float32)
    score = scores.ScoreFunction(symmetric_alibi, slopes)
    assert as_alibi(score.compile(2), 2).function is not None  # not run as built-in ALiBi
    with jax.default_matmul_precision("highest"):  # on a TPU both sides in float32
        outs = [bsa.BlockSparseAttention(mask=masks.Causal(), score=score, kernel=kernel,
                                         tiling=tiling)(q, k, v)
                for kernel, tiling in ((kernels.PallasTpuBlockSparse(), TILES),
                                       (kernels.DenseReference(), None))]
    assert _rel(outs[0], outs[1]) < TOL
