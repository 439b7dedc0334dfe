"""A score function's arrays inside the kernels.

A `ScoreFunction` may read arrays it closes over (``slopes[head]`` with ``slopes`` a jnp
array): a Pallas kernel cannot capture them (Pallas refuses captured constants), so they
become kernel inputs. The function is traced once per tile shape (`trace`) into a jaxpr whose
constants are those arrays (`jax.closure_convert` hoists only the ones that may be
differentiated; the kernels need them all); each array goes whole into scalar memory (32-bit,
flattened), and the kernel evaluates the jaxpr (`evaluate`) with every read of an array at
scalar indices (``a[i]``, ``a[i, j]``, a one-element array) turned into a scalar load at that
index. Mosaic TPU gathers from neither a vector nor scalar memory by a traced index on a
vector value, so a function that uses an array otherwise (a gather by the positions, a
product with the whole array) is declined at plan time (`decline`).

Gradients: where such an array is traced (the caller differentiates with respect to it), each
dq program sums, over its tiles, the cotangent of every scalar it read (`jax.vjp` of the
function in those scalars) into its own float32 block at the element's place; the blocks are
added up after the launch in a fixed order (no atomics: deterministic).
"""

import dataclasses
import functools
import math as pymath
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from .config import LANES, SUBLANES

#: The most elements of the arrays a function reads (scalar memory, and a gradient block per
#: dq program of at most this many float32 elements).
DATA_LIMIT = 8192
#: Calls followed into: their jaxpr runs on their operands one for one.
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "checkpoint",
                    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
#: Elementwise operations of one operand an array may go through before it is indexed
#: (``slopes.astype(jnp.float32)[head]``): applied to the scalar read instead (integer and
#: sign arithmetic only; write others after the indexing, ``jnp.exp(log_slopes[head])``).
_UNARY = frozenset({"convert_element_type", "neg", "abs", "sign", "floor", "ceil", "round",
                    "integer_pow", "square", "not", "copy", "copy_p"})


class Unsupported(Exception):
    """The function uses an array in a way the kernels do not lower."""


@dataclasses.dataclass(frozen=True)
class DataLeaf:
    """What the kernels know of one array the function reads: its shape and dtype, and
    whether its gradient is formed (`diff`: a float array that is traced)."""

    shape: tuple[int, ...]
    dtype: Any
    diff: bool

    @property
    def size(self) -> int:
        return pymath.prod(self.shape)

    @property
    def stored(self):
        """Its dtype in scalar memory: float32, or int32 (integers and booleans)."""
        return jnp.float32 if jnp.issubdtype(self.dtype, jnp.floating) else jnp.int32

    @property
    def rows(self) -> int:
        """Rows of its gradient block ``[rows, 128]``: element ``e`` at ``(e // 128, e %
        128)``, whole sublanes."""
        rows = max(-(-self.size // LANES), 1)
        return -(-rows // SUBLANES) * SUBLANES

    def value(self, x):
        """A scalar read from scalar memory (`stored`) in the array's own dtype."""
        return x != 0 if self.dtype == jnp.bool_ else x.astype(self.dtype)

    @staticmethod
    def of(x) -> "DataLeaf":
        dtype = jnp.result_type(x)
        diff = isinstance(x, jax.core.Tracer) and jnp.issubdtype(dtype, jnp.floating)
        return DataLeaf(tuple(np.shape(x)), dtype, diff)


@dataclasses.dataclass(frozen=True, eq=False)
class Traced:
    """The function traced at one tile shape, less what depends on its constants only
    (computed before the kernels: `fold`): `eqns` run on `invars` ``(s, batch, head, q_pos,
    k_pos)`` and `constvars`, the arrays it reads, ``constvars[c]`` being data leaf
    ``slots[c]``; its result is ``outvars[0]``."""

    invars: tuple
    constvars: tuple
    eqns: tuple
    outvars: tuple
    slots: tuple[int, ...]


class _Array(NamedTuple):
    """An array leaf in the evaluation, not loaded: `ops` are the elementwise operations
    (`_UNARY` equations) applied to it so far."""

    slot: int
    shape: tuple[int, ...]
    ops: tuple = ()


def _tile_args(shape):
    """Stand-ins for ``(s, batch, head, q_pos, k_pos)`` on a tile of `shape`."""
    f32, i32 = (jax.ShapeDtypeStruct(shape, t) for t in (jnp.float32, jnp.int32))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return f32, scalar, scalar, i32, i32


def trace(function: Callable, shape: tuple[int, int]):
    """``jax.make_jaxpr`` of ``function(s, batch, head, q_pos, k_pos, None)`` (a `ScoreTerm`)
    on a float32 tile of `shape`, int32 batch and head scalars and int32 position tiles."""
    return jax.make_jaxpr(lambda s, b, h, qp, kp: function(s, b, h, qp, kp, None))(
        *_tile_args(shape))


class FunctionData(NamedTuple):
    """A call's score function at its tile shapes: `traced` ``((shape, Traced), ...)``, and
    the arrays its kernel part reads (`arrays`, each once) with what the kernels know of
    them (`leaves`)."""

    traced: tuple
    arrays: tuple
    leaves: tuple[DataLeaf, ...]


def fold(closed) -> tuple[list, list, list, list]:
    """``(eqns, outvars, constvars, values)`` of a traced function (a `jax.make_jaxpr`
    result): the equations that depend on the constants alone are run here, outside the
    kernels (any operation, differentiable by JAX: ``jnp.exp(log_slopes)``, a sharding's
    ``axis_index``); `constvars` are their results (and the constants) that the rest reads,
    with their `values`. An equation whose result is larger than its array operands (a
    broadcast to the tile) stays, and so do equations of literals only and equations with
    effects."""
    jaxpr = closed.jaxpr
    known = dict(zip(jaxpr.constvars, closed.consts))

    def size(v):
        return pymath.prod(getattr(v.aval, "shape", ()))

    eqns = []
    for eqn in jaxpr.eqns:
        operands = [v for v in eqn.invars if not isinstance(v, jex_core.Literal)]
        largest = max((size(v) for v in operands), default=1)
        # Named-axis effects (`axis_index`) only: their values are known outside the kernels.
        pure = all(type(e).__name__ == "NamedAxisEffect" for e in eqn.effects)
        if (pure and all(v in known for v in operands)
                and (operands or eqn.primitive.name == "axis_index")
                and all(size(v) <= largest for v in eqn.outvars)):
            ins = [v.val if isinstance(v, jex_core.Literal) else known[v] for v in eqn.invars]
            if (not operands or eqn.primitive.name == "pvary"
                    or any(isinstance(x, jax.core.Tracer) for x in ins)):
                # `axis_index` and `pvary` bind where the call runs (inside `shard_map`).
                values = _bind(eqn, ins)
            else:  # concrete in, concrete out (also under `jit`): a constant stays one
                with jax.ensure_compile_time_eval():
                    values = _bind(eqn, ins)
            known.update((v, x) for v, x in zip(eqn.outvars, values)
                         if not isinstance(v, jex_core.DropVar))
        else:
            eqns.append(eqn)
    read = [v for eqn in eqns for v in eqn.invars] + list(jaxpr.outvars)
    constvars = [v for v in dict.fromkeys(v for v in read if not isinstance(v, jex_core.Literal))
                 if v in known]
    return eqns, list(jaxpr.outvars), constvars, [known[v] for v in constvars]


def function_data(function: Callable, shapes) -> FunctionData:
    """The function traced at each tile shape of `shapes` (`trace`, `fold`), and the arrays
    its kernel part reads (those of any of the traces, each once by identity)."""
    arrays, ids, traced = [], {}, []
    for shape in dict.fromkeys(shapes):
        closed = trace(function, shape)
        eqns, outvars, constvars, values = fold(closed)
        slots = []
        for c in values:
            if id(c) not in ids:
                ids[id(c)] = len(arrays)
                arrays.append(c)
            slots.append(ids[id(c)])
        traced.append((shape, Traced(tuple(closed.jaxpr.invars), tuple(constvars),
                                     tuple(eqns), tuple(outvars), tuple(slots))))
    return FunctionData(tuple(traced), tuple(arrays), tuple(map(DataLeaf.of, arrays)))


def stored(x, leaf: DataLeaf):
    """An array as scalar memory holds it: flattened, 32-bit."""
    return jnp.ravel(jnp.asarray(x)).astype(leaf.stored)


def evaluate(traced: Traced, args, read: Callable):
    """The traced function on ``args = (s, batch, head, q_pos, k_pos)``, each read of an
    array (data leaf ``slot``) at scalar indices taken from ``read(slot, flat)`` (`flat`
    the int32 index into the flattened array; a 0-d value of the array's dtype). Raises
    `Unsupported` where the function uses an array otherwise."""
    env = dict(zip(traced.invars, args))
    env.update({v: _Array(slot, tuple(v.aval.shape)) for v, slot in
                zip(traced.constvars, traced.slots)})
    (out,) = _run(traced, env, read)
    if isinstance(out, _Array):
        raise Unsupported("it returns an array it reads whole")
    return out


def _run(jaxpr, env: dict, read: Callable) -> list:
    """Run the equations of `jaxpr` (anything with ``eqns`` and ``outvars``) on `env`."""
    def get(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        if eqn.primitive.name == "pvary":
            # A type cast inside `shard_map` (the kernels see no mesh axes): the values.
            outs = ins
        elif any(isinstance(x, _Array) for x in ins):
            outs = _with_array(eqn, ins, read)
        else:
            outs = _bind(eqn, ins)
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jex_core.DropVar):
                env[v] = x
    return [get(v) for v in jaxpr.outvars]


def _bind(eqn, ins) -> list:
    """The equation's primitive on `ins` (as `jax.core.eval_jaxpr` binds it): its outputs."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = ()
    if isinstance(params, tuple):  # releases that return (subfuns, params)
        subfuns, params = params
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*subfuns, *ins, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _shaped(x, shape):
    """A scalar `x` in `shape` (one element): as it is where that is a scalar's."""
    return x if tuple(shape) == () else jnp.reshape(x, shape)


def _load(a: _Array, idx, read: Callable):
    """Element `idx` of `a` (indices clamped into range, as `dynamic_slice` clamps) with its
    pending operations applied: a 0-d value."""
    flat = jnp.int32(0)
    for i, n in zip(idx, a.shape):
        flat = flat * n + jnp.clip(jnp.asarray(i, jnp.int32), 0, n - 1)
    x = read(a.slot, flat)
    for eqn in a.ops:
        (x,) = _bind(eqn, [x])
    return x


def _with_array(eqn, ins, read: Callable) -> list:
    """One equation that reads an array leaf (`_Array`)."""
    name = eqn.primitive.name
    a = ins[0]
    if name == "dynamic_slice" and isinstance(a, _Array) and all(
            n == 1 for n in eqn.params["slice_sizes"]) and not any(
            isinstance(x, _Array) for x in ins[1:]):
        return [_shaped(_load(a, ins[1:], read), (1,) * len(a.shape))]
    if name == "slice" and isinstance(a, _Array) and all(
            hi - lo == 1 for lo, hi in zip(eqn.params["start_indices"],
                                           eqn.params["limit_indices"])):
        # One element (whatever the strides): the one at the start.
        return [_shaped(_load(a, eqn.params["start_indices"], read), (1,) * len(a.shape))]
    if name in _UNARY and len(ins) == 1:
        return [a._replace(ops=a.ops + (eqn,))]
    if name in _CALLS:
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        closed = inner if hasattr(inner, "consts") else None
        inner = getattr(inner, "jaxpr", inner)
        if inner is not None and len(inner.invars) == len(ins):
            env = dict(zip(inner.invars, ins))
            env.update(zip(inner.constvars, closed.consts if closed is not None else ()))
            return _run(inner, env, read)
    arrays = [x for x in ins if isinstance(x, _Array)]
    if all(pymath.prod(x.shape) == 1 for x in arrays):
        # A one-element array: its value, in its shape.
        ins = [_shaped(_load(x, (0,) * len(x.shape), read), x.shape)
               if isinstance(x, _Array) else x for x in ins]
        return _bind(eqn, ins)
    raise Unsupported(f"it applies `{name}` to an array it reads (of shape "
                      f"{arrays[0].shape}) other than at scalar indices")


class Reads(NamedTuple):
    """The scalars one evaluation read: ``(slot, flat index, value)`` each, in order."""

    items: list


def recording(read: Callable):
    """``(read', reads)``: `read` that also records each read in `reads`."""
    reads = Reads([])

    def wrapped(slot, flat):
        value = read(slot, flat)
        reads.items.append((slot, flat, value))
        return value

    return wrapped, reads


def replaying(values):
    """A `read` that returns `values` in order (the scalars of a recorded evaluation, or
    stand-ins for them to differentiate by)."""
    it = iter(values)
    return lambda slot, flat: next(it)


def reads_traced(function) -> bool:
    """Whether the score function's kernel part reads a float array that is traced (whose
    gradient the kernels would form): traced on a small tile, where the call is planned."""
    try:
        data = function_data(function, [(SUBLANES, LANES)])
    except Exception:  # noqa: BLE001 - the call raises it where it runs
        return False
    return any(leaf.diff for leaf in data.leaves)


@functools.lru_cache(maxsize=256)
def decline(function) -> str | None:
    """Why the kernels cannot evaluate the score function `function` (a `ScoreTerm`) with
    the arrays it reads, or ``None``: each must be 32-bit (or bool), all of them at most
    `DATA_LIMIT` elements, each read only at scalar indices. Traced once on a small tile;
    cached per function. A function that does not trace is left to the kernel's call (which
    raises the function's own error)."""
    shape = (SUBLANES, LANES)
    try:
        data = function_data(function, [shape])
    except Exception:  # noqa: BLE001 - the call raises it where it runs
        return None
    for leaf in data.leaves:
        if not (jnp.dtype(leaf.dtype).itemsize == 4 or leaf.dtype == jnp.bool_):
            return (f"the score function reads an array of {jnp.dtype(leaf.dtype).name} "
                    f"(shape {leaf.shape}): the TPU kernels read 32-bit or bool arrays.")
    total = sum(leaf.size for leaf in data.leaves)
    if total > DATA_LIMIT:
        return (f"the score function reads arrays of {total} elements (at most "
                f"{DATA_LIMIT}, in scalar memory).")
    (_, traced), = data.traced

    def run(*args):
        return evaluate(traced, args, lambda slot, flat: jnp.zeros((), data.leaves[slot].dtype))

    try:
        jax.make_jaxpr(run)(*_tile_args(shape))
    except Unsupported as e:
        return (f"the score function reads an array only as the TPU kernels cannot: {e} "
                f"(read arrays at scalar indices, e.g. slopes[head]).")
    return None
