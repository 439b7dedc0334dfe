"""A score function that is ALiBi, found in its jaxpr and run as ALiBi's slopes.

The most common hand-written score function is ALiBi, ``score + slopes[head] * (k_pos -
q_pos)`` with the slopes closed over or in `params`. Run as a function, every kernel
evaluates the whole term on every logit (and reads the slopes as data); as `ScoreTerms.slopes`
it is built-in ALiBi, which the kernels split into a row's and a column's part. `as_alibi`
reads the function's jaxpr on a small tile and, where that jaxpr *proves* that the result is
``score + c(head) * (k_pos - q_pos)`` with ``c`` independent of the logits, the positions and
the batch index, replaces the function by the slopes ``c(h)``: the function itself evaluated
at ``score = 0``, ``q_pos = 0``, ``k_pos = 1`` for every head, in JAX, so its arrays and
`params` get their gradients from JAX's own autodiff of that evaluation.

The proof is an abstract evaluation of the jaxpr (`_Interpreter`). Each value is a sum
``a_1 + a_s s + a_q q + a_k k`` over the logit `s` and the positions `q`, `k`, as a function
of the element's coordinates (head, query row, key column; broadcast like NumPy). The
coefficients are polynomials with rational coefficients in *atoms*: values that depend on
none of ``s``, ``q``, ``k`` (the head, the batch index, the arrays and whatever is computed
from them alone), each named by what computed it, so that the same read twice is one atom.
Sums, differences, negation, products with and quotients by such a value, widening casts and
broadcasts that keep the NumPy alignment keep the form; anything else applied to a value that
depends on ``s``, ``q`` or ``k`` (a maximum, a `where`, an absolute value, a transpose, a cast
to a narrower float) ends the proof, and the function runs as written. The result is ALiBi when
``a_s = 1``, ``a_q + a_k = 0`` and ``a_1 = 0`` as polynomials, and ``a_k`` is one value per
head: its atoms do not depend on the batch index and do not vary along the tile's rows or
columns. Loops and calls with derivative rules of their own end the proof too.

The proof reads one trace, on one tile; so a proven function is also run on random values at
two other tiles (`agrees_on_tiles`) and must equal the rewrite there.
"""

import functools
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from ._score_data import CALLS, CUSTOM_RULES

#: A polynomial: monomial (sorted atom ids) -> nonzero rational coefficient.
Poly = dict[tuple[int, ...], Fraction]
#: A value's form: basis ("1", "s", "q", "k") -> nonzero coefficient polynomial; ``None`` is
#: a value of no such form.
Form = dict[str, Poly] | None

#: Primitives that keep each element's value and move it by NumPy's alignment at most.
_RESHAPES = frozenset({"broadcast_in_dim", "reshape", "squeeze"})
_COPIES = frozenset({"copy", "copy_p"})


def _add_term(poly: Poly, mono: tuple[int, ...], c: Fraction) -> None:
    """``poly += c * mono`` in place, keeping only nonzero coefficients."""
    total = poly.get(mono, 0) + c
    if total:
        poly[mono] = total
    else:
        poly.pop(mono, None)


def _padd(a: Poly, b: Poly, sign: int = 1) -> Poly:
    out = dict(a)
    for mono, c in b.items():
        _add_term(out, mono, sign * c)
    return out


def _pmul(a: Poly, b: Poly) -> Poly:
    out: Poly = {}
    for ma, ca in a.items():
        for mb, cb in b.items():
            _add_term(out, tuple(sorted(ma + mb)), ca * cb)
    return out


def _fadd(a: dict, b: dict, sign: int = 1) -> dict:
    out = {}
    for basis in set(a) | set(b):
        poly = _padd(a.get(basis, {}), b.get(basis, {}), sign)
        if poly:
            out[basis] = poly
    return out


def _fscale(form: dict, poly: Poly) -> dict:
    out = {}
    for basis, coef in form.items():
        scaled = _pmul(coef, poly)
        if scaled:
            out[basis] = scaled
    return out


def _is_free(form: Form) -> bool:
    """Whether a value depends on none of ``s``, ``q``, ``k``."""
    return form is not None and set(form) <= {"1"}


def _aligned(in_shape, out_shape) -> bool:
    """Whether `out_shape` has `in_shape`'s trailing axes where NumPy would put them (leading
    axes added or dropped, each kept axis either equal or broadcast from 1)."""
    a, b = list(in_shape), list(out_shape)
    while a and a[0] == 1 and len(a) > len(b):
        a.pop(0)
    if len(a) > len(b):
        return False
    return all(x == y or x == 1 for x, y in zip(a, b[len(b) - len(a):]))


def _param_key(value) -> Any:
    """A hashable stand-in for an equation's parameter, equal where the parameters are, or a
    fresh object for one that cannot be hashed (no two equations then share a result)."""
    try:
        hash(value)
    except TypeError:
        return object()
    return type(value), value


class _Interpreter:
    """One abstract evaluation: the atoms it named, by key, and which read the batch index."""

    def __init__(self):
        self.ids: dict[Any, int] = {}
        self.shapes: list[tuple[int, ...]] = []
        self.batch: set[int] = set()

    def atom(self, key, shape, reads_batch: bool = False) -> dict:
        """The form of the atom named `key`, of `shape` (a fresh one for a fresh key)."""
        if key not in self.ids:
            self.ids[key] = len(self.ids)
            self.shapes.append(tuple(shape))
            if reads_batch:
                self.batch.add(self.ids[key])
        return {"1": {(self.ids[key],): Fraction(1)}}

    def fresh(self, shape) -> dict:
        return self.atom(object(), shape)

    def atoms(self, form: dict):
        return {i for poly in form.values() for mono in poly for i in mono}

    def reads_batch(self, form: dict) -> bool:
        return bool(self.atoms(form) & self.batch)

    def per_head(self, form: dict) -> bool:
        """Whether every atom of `form` is one value per head: a shape that broadcasts
        against the probe's ``[2, 1, 1]`` without varying along the rows or the columns."""
        return all(len(shape) <= 3 and all(n == 1 for n in shape[-2:])
                   and (len(shape) < 3 or shape[0] in (1, 2))
                   for shape in (self.shapes[i] for i in self.atoms(form)))

    def literal(self, value) -> dict:
        value = np.asarray(value)
        if value.ndim == 0 and value.dtype.kind in "biuf" and np.isfinite(value):
            c = Fraction(float(value)) if value.dtype.kind == "f" else Fraction(int(value))
            return {"1": {(): c}} if c else {}
        return self.fresh(value.shape)

    def evaluate(self, jaxpr, forms: list) -> list:
        env = dict(zip(jaxpr.invars, forms))
        for v in jaxpr.constvars:
            env[v] = self.fresh(v.aval.shape)

        def read(v):
            if isinstance(v, jex_core.Literal):
                return self.literal(v.val)
            return env[v]

        for eqn in jaxpr.eqns:
            outs = self.step(eqn, [read(v) for v in eqn.invars])
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def step(self, eqn, ins: list) -> list:
        n_out = len(eqn.outvars)
        name = eqn.primitive.name
        inner = inner_jaxpr(eqn)
        # A call with a derivative rule of its own is not read through: the slopes' gradient
        # would not follow the rule. On values free of s, q and k it is an atom (below).
        if inner is not None and name not in CUSTOM_RULES:
            return self.evaluate(inner, ins)
        if any(f is None for f in ins):
            return [None] * n_out
        in_avals = [v.aval for v in eqn.invars]
        out_aval = eqn.outvars[0].aval
        if name in ("add", "add_any", "sub"):
            return [_fadd(ins[0], ins[1], -1 if name == "sub" else 1)]
        if name == "neg":
            return [_fscale(ins[0], {(): Fraction(-1)})]
        if name == "mul" and (_is_free(ins[0]) or _is_free(ins[1])):
            free, other = (ins[0], ins[1]) if _is_free(ins[0]) else (ins[1], ins[0])
            return [_fscale(other, free.get("1", {}))]
        if (name == "div" and _is_free(ins[1]) and not _is_free(ins[0])
                and jnp.issubdtype(out_aval.dtype, jnp.floating)):
            divisor = ins[1].get("1", {})
            if not divisor:
                return [None]
            if set(divisor) == {()}:
                inverse = {(): 1 / divisor[()]}
            else:
                inverse = self.atom(("inverse", _frozen(divisor)), in_avals[1].shape,
                                    self.reads_batch(ins[1]))["1"]
            return [_fscale(ins[0], inverse)]
        if name in _COPIES:
            return [ins[0]]
        if name == "convert_element_type" and _widens(in_avals[0].dtype, out_aval.dtype):
            return [ins[0]]
        if name in _RESHAPES and _keeps_alignment(eqn):
            return [ins[0]]
        if all(_is_free(f) for f in ins):
            key = (name, tuple(sorted((k, _param_key(v)) for k, v in eqn.params.items())),
                   tuple(_frozen(f.get("1", {})) for f in ins),
                   tuple((a.shape, a.dtype) for a in in_avals),
                   tuple((v.aval.shape, v.aval.dtype) for v in eqn.outvars))
            batch = any(self.reads_batch(f) for f in ins)
            return [self.atom((key, i), v.aval.shape, batch)
                    for i, v in enumerate(eqn.outvars)]
        return [None] * n_out


def _keeps_alignment(eqn) -> bool:
    """Whether a broadcast, reshape or squeeze keeps each element where NumPy's alignment
    (trailing axes) puts it."""
    in_shape, out_shape = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
    if eqn.primitive.name == "broadcast_in_dim":
        trailing = tuple(range(len(out_shape) - len(in_shape), len(out_shape)))
        if tuple(eqn.params["broadcast_dimensions"]) != trailing:
            return False
    if eqn.primitive.name == "reshape" and eqn.params.get("dimensions") is not None:
        return False
    return _aligned(in_shape, out_shape)


def inner_jaxpr(eqn):
    """The jaxpr an equation calls once with its own inputs and outputs, one for one (``jit``,
    ``custom_jvp_call``, ``custom_vjp_call``, ``remat``), or ``None`` (a loop, a branch, a
    `shard_map` and every other primitive)."""
    if eqn.primitive.name not in CALLS | CUSTOM_RULES:
        return None
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(name)
        inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
        if (isinstance(inner, jex_core.Jaxpr)
                and len(inner.invars) == len(eqn.invars)
                and len(inner.outvars) == len(eqn.outvars)):
            return inner
    return None


def _frozen(poly: Poly) -> tuple:
    return tuple(sorted(poly.items()))


def _widens(source, target) -> bool:
    """Whether a cast from `source` to `target` keeps every value. An integer to float32 is
    taken as exact (it is below 2**24): the rewrite subtracts the positions as integers,
    which is exact where a function that casts them first rounds positions past 2**24."""
    source, target = np.dtype(source), np.dtype(target)
    if source == target:
        return True
    if target.kind == "f" and target.itemsize >= 4:
        return source.kind in "biu" or (source.kind == "f" and source.itemsize <= target.itemsize)
    if target.kind in "iu" and source.kind in "biu":
        return target.itemsize > source.itemsize or source.kind == "b"
    return False


#: The probe tile both plan-time reads of a score function trace it on (`is_alibi`, and
#: `_score.check_function`): 8 x 8 logits of two heads.
PROBE = 8


def probe_params(params) -> tuple:
    """``(treedef, avals)`` of a score function's `params`: the cache key of a probe trace
    (the same for concrete and traced params of one shape)."""
    leaves, treedef = jax.tree.flatten(params)
    return treedef, tuple(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
                          for x in leaves)


@functools.lru_cache(maxsize=256)
def is_alibi(term, treedef, avals: tuple) -> bool:
    """Whether the `ScoreTerm` `term`, with `params` of `treedef` and leaves `avals`, is
    proven to compute ``score + c(head) * (k_pos - q_pos)``, ``c`` one value per head (free
    of the batch index, not varying along a tile's rows or columns).

    Read from its jaxpr on the probe tile (cached per function and params' shapes); a
    function that does not trace there is not proven.
    """
    n = PROBE
    args = (jax.ShapeDtypeStruct((2, n, n), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((2, 1, 1), jnp.int32), jax.ShapeDtypeStruct((n, 1), jnp.int32),
            jax.ShapeDtypeStruct((1, n), jnp.int32), jax.tree.unflatten(treedef, avals))
    try:
        closed = jax.make_jaxpr(term)(*args)
    except Exception:  # noqa: BLE001  (the call itself raises the function's error)
        return False
    jaxpr = closed.jaxpr
    if len(jaxpr.outvars) != 1 or closed.out_avals[0].shape != (2, n, n):
        return False
    interp = _Interpreter()
    one = Fraction(1)
    forms = [{"s": {(): one}}, interp.atom("batch", (), reads_batch=True),
             interp.atom("head", (2, 1, 1)), {"q": {(): one}}, {"k": {(): one}}]
    forms += [interp.atom(("params", i), v.aval.shape) for i, v in enumerate(jaxpr.invars[5:])]
    (out,) = interp.evaluate(jaxpr, forms)
    if out is None or set(out) - {"s", "q", "k"}:
        return False
    slope = {"1": out.get("k", {})}
    return (out.get("s") == {(): one}
            and bool(slope["1"])  # not ``score`` alone: nothing to gain, `kinds` would change
            and not _padd(out.get("q", {}), slope["1"])
            and not interp.reads_batch(slope) and interp.per_head(slope))


#: The numeric check's positions are drawn below this (`agrees_on_tiles`), where float32
#: holds ``c * k`` and ``c * q`` to within ``2**-12 c``.
_CHECK_POSITIONS = 4096
#: Its tile: another shape than the probe's, so that a function reading its tile's shape (or
#: reducing over it) is seen to change.
_CHECK_TILE = (5, 3)


def _slope_point(num_heads: int) -> tuple:
    """``(score, batch, head, q_pos, k_pos)`` at which a proven function's value is its
    slopes: ``score = 0``, ``q_pos = 0``, ``k_pos = 1`` for every head (``[H, 1, 1]``)."""
    return (np.zeros((num_heads, 1, 1), np.float32), np.int32(0),
            np.arange(num_heads, dtype=np.int32)[:, None, None], np.zeros((1, 1), np.int32),
            np.ones((1, 1), np.int32))


def _stand_in(shape, dtype):
    """A value for an array the check cannot read (a traced one): floats in [0.5, 1.5)
    drawn from its shape (the same array gets the same values in every trace), other
    types zero."""
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        return np.zeros(shape, dtype)
    rng = np.random.default_rng([len(shape), *shape])
    return rng.uniform(0.5, 1.5, shape).astype(dtype)


def _evaluated(term, args) -> np.ndarray:
    """`term` on the concrete `args` (its params last), float64: traced once at their shapes
    and run there and then, even inside a `jax.jit` trace, with stand-ins for traced arrays
    it closes over."""
    closed = jax.make_jaxpr(term)(*args)
    consts = [_stand_in(c.aval.shape, c.aval.dtype) if isinstance(c, jax.core.Tracer) else c
              for c in closed.consts]
    run = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(closed.jaxpr, consts))
    with jax.ensure_compile_time_eval():
        (out,) = run(*jax.tree.leaves(args))
    return np.asarray(out, np.float64)


@functools.lru_cache(maxsize=256)
def agrees_on_tiles(term, treedef, avals: tuple, num_heads: int) -> bool:
    """Whether `term`, run as written, equals ``score + c(head) * (k_pos - q_pos)`` with ``c``
    its slopes (`as_alibi`'s evaluation), on random logits and positions (params: stand-ins
    of their shapes), to float32's rounding: on a ``[H, 5, 3]`` tile of every head with a
    row of positions and a batch index each (as `XlaBlockSparse` calls it), and on ``[5, 3]``
    tiles of one scalar head and batch index (as the Mosaic, Triton and Pallas TPU kernels
    do).

    `is_alibi` proves the form on the probe's jaxpr; this sees what that proof cannot: a
    function whose value depends on its tile's shape or reduces over the heads it is given,
    a loop, and a difference its float32 arithmetic does not keep (``(k + 1e6) - (q + 1e6)``).
    """
    rng = np.random.default_rng(0)
    params = jax.tree.unflatten(treedef, [_stand_in(a.shape, a.dtype) for a in avals])
    point = _slope_point(num_heads)
    heads = point[2]
    try:
        c = _evaluated(term, (*point, params))[:, 0, 0]
        rows, cols = _CHECK_TILE
        cases = [(heads, np.asarray(heads % 2, np.int32), (num_heads, rows, cols))]
        cases += [(np.int32(h), np.int32(1), (rows, cols))
                  for h in sorted({0, num_heads // 2, num_heads - 1})]
        for head, batch, shape in cases:
            s = rng.standard_normal(shape).astype(np.float32)
            q = rng.integers(0, _CHECK_POSITIONS, shape[:-1] + (1,), dtype=np.int32)
            k = rng.integers(0, _CHECK_POSITIONS, shape[:-2] + (1, cols), dtype=np.int32)
            got = _evaluated(term, (s, batch, head, q, k, params))
            slope = c[head]
            want = s + slope * (k - q)
            scale = np.abs(s) + np.abs(slope) * (np.abs(k) + np.abs(q)) + 1.0
            if got.shape != want.shape or not np.all(np.abs(got - want) <= 1e-5 * scale):
                return False
    except Exception:  # noqa: BLE001  (runs as written; the call raises its own error)
        return False
    return True


def as_alibi(terms, num_heads: int):
    """`terms` (`ScoreTerms`) with a score function that `is_alibi` proves to be ALiBi
    replaced by its slopes ``[num_heads]`` float32 (added to slopes the terms already have),
    or `terms` unchanged.

    The slopes are the function at ``score = 0``, ``q_pos = 0``, ``k_pos = 1`` for each head:
    ``c(h)`` exactly. They are computed in JAX, so `params` (and traced arrays the function
    closes over) get their gradients through them.

    ```python
    fn = lambda s, head, q, k: s + slopes[head] * (k - q)
    as_alibi(ScoreTerms(function=fn), 8).slopes   # == slopes, [8]
    ```
    """
    term = terms.function
    if term is None:
        return terms
    key = probe_params(terms.params)
    if not (is_alibi(term, *key) and agrees_on_tiles(term, *key, num_heads)):
        return terms
    point = (jnp.asarray(x) for x in _slope_point(num_heads))
    slopes = term(*point, terms.params)[:, 0, 0]
    if terms.slopes is not None:
        slopes = terms.slopes.astype(jnp.float32) + slopes
    return type(terms)(slopes, terms.table, terms.buckets, alibi_from=term.__name__)
