"""A score function's arrays inside a kernel: the kernel-agnostic interpreter.

A `ScoreFunction` may read arrays: those it closes over (``slopes[head]`` with ``slopes`` a
jnp array) and its `params`. A Pallas kernel cannot capture them (Pallas refuses captured
constants), so they become kernel inputs. The function is traced once per tile shape
(`trace_function`) into a jaxpr whose constants are those arrays (`jax.closure_convert`
hoists only the ones that may be differentiated; a kernel needs them all); the part that
depends on the constants alone runs before the kernel (`fold_constants`); a kernel keeps each
remaining array in a memory of its choosing and evaluates the jaxpr (`evaluate_function`)
with every read of an array at scalar indices (``a[i]``, ``a[i, j]``, a one-element array)
turned into a call of its own ``read(slot, flat)`` (a scalar load). A function that uses an
array otherwise (a gather by the positions, a product with the whole array) raises
`UnsupportedRead`, which a kernel turns into a decline at plan time (`unsupported_read`).

Gradients: where an array is traced (`DataLeaf.diff`), a kernel records the scalars one
evaluation read (`recording_reads`) and differentiates the function in them by replaying
them (`replaying_reads`): ``jax.vjp`` of the function in those scalars gives each one's
cotangent, which the kernel adds to its own gradient block at the element's place.

Where a function that uses arrays no kernel of this kind lowers may be traced at all, these
helpers raise the function's own errors; a kernel's plan catches them and leaves them to the
call.
"""

import dataclasses
import math as pymath
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

#: Calls followed into: their jaxpr runs once on their operands, one for one, and its
#: derivative is the call's.
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat", "remat2",
                   "checkpoint"})
#: Calls whose derivative is a rule of their own, not their jaxpr's: an array they take whole
#: is not read through them (the kernels would differentiate the jaxpr, not the rule).
CUSTOM_RULES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
#: Elementwise operations of one operand an array may go through before it is indexed
#: (``slopes.astype(jnp.float32)[head]``): applied to the scalar read instead (integer and
#: sign arithmetic only; write others after the indexing, ``jnp.exp(log_slopes[head])``).
_UNARY = frozenset({"convert_element_type", "neg", "abs", "sign", "floor", "ceil", "round",
                    "integer_pow", "square", "not", "copy", "copy_p"})


class UnsupportedRead(Exception):
    """The score function uses an array other than at scalar indices (`evaluate_function`)."""


@dataclasses.dataclass(frozen=True)
class DataLeaf:
    """What a kernel knows of one array the score function reads: its `shape` and `dtype`,
    and whether its gradient is formed (`diff`: a float array that is traced)."""

    shape: tuple[int, ...]
    dtype: Any
    diff: bool

    @property
    def size(self) -> int:
        return pymath.prod(self.shape)

    @staticmethod
    def of(x) -> "DataLeaf":
        """The leaf of array `x` (a jnp or NumPy array, or a tracer)."""
        dtype = jnp.result_type(x)
        diff = isinstance(x, jax.core.Tracer) and jnp.issubdtype(dtype, jnp.floating)
        return DataLeaf(tuple(np.shape(x)), dtype, diff)


@dataclasses.dataclass(frozen=True, eq=False)
class TracedFunction:
    """The function traced at one tile shape, less what depends on its constants only
    (computed before the kernels: `fold_constants`): `eqns` run on `invars` ``(s, batch,
    head, q_pos, k_pos)`` and `constvars`, the arrays it reads, ``constvars[c]`` being data
    leaf ``slots[c]``; its result is ``outvars[0]``."""

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


def trace_function(function: Callable, shape: tuple[int, int], params=None):
    """``jax.make_jaxpr`` of ``function(s, batch, head, q_pos, k_pos, params)`` (a
    `ScoreTerm`) on a float32 tile of `shape`, int32 batch and head scalars and int32
    position tiles. The arrays it closes over and the leaves of `params` are the jaxpr's
    constants (tracers where they are traced)."""
    return jax.make_jaxpr(lambda s, b, h, qp, kp: function(s, b, h, qp, kp, params))(
        *_tile_args(shape))


class FunctionData(NamedTuple):
    """A call's score function at its tile shapes: `traced` ``((shape, TracedFunction),
    ...)``, and the arrays its kernel part reads (`arrays`, each once) with what a kernel
    knows of them (`leaves`)."""

    traced: tuple
    arrays: tuple
    leaves: tuple[DataLeaf, ...]


def fold_constants(closed, with_keys: bool = False) -> tuple:
    """``(eqns, outvars, constvars, values)`` of a traced function (a `jax.make_jaxpr`
    result): the equations that depend on the constants alone are run here, outside the
    kernels (any operation, differentiable by JAX: ``jnp.exp(log_slopes)``, a sharding's
    ``axis_index``); `constvars` are their results (and the constants) that the rest reads,
    with their `values`. An equation whose result is larger than its array operands (a
    broadcast to the tile) stays, and so do equations of literals only and equations with
    effects.

    `with_keys` adds a fifth item, each value's `provenance`: equal for the same
    computation on the same constants in another trace of the function (another tile),
    where the folded values are new arrays."""
    jaxpr = closed.jaxpr
    known = dict(zip(jaxpr.constvars, closed.consts))
    keys = {v: ("constant", id(c)) for v, c in known.items()}

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
            made = [v for v in eqn.outvars if not isinstance(v, jex_core.DropVar)]
            known.update((v, x) for v, x in zip(eqn.outvars, values) if v in made)
            named = [u if isinstance(u, jex_core.Literal) else keys[u] for u in eqn.invars]
            keys.update((v, provenance(eqn, named, i))
                        for i, v in enumerate(eqn.outvars) if v in made)
        else:
            eqns.append(eqn)
    read = [v for eqn in eqns for v in eqn.invars] + list(jaxpr.outvars)
    constvars = [v for v in dict.fromkeys(v for v in read if not isinstance(v, jex_core.Literal))
                 if v in known]
    folded = (eqns, list(jaxpr.outvars), constvars, [known[v] for v in constvars])
    return folded + ([keys[v] for v in constvars],) if with_keys else folded


def provenance(eqn, ins: list, index: int):
    """A hashable name of output `index` of `eqn` run on inputs named `ins` (provenances,
    or literals): equal where the primitive, its parameters and its inputs are. A parameter
    that cannot be hashed names the output afresh."""
    def named(x):
        if isinstance(x, jex_core.Literal):
            value = np.asarray(x.val)
            return ("literal", value.dtype.str, value.shape, value.tobytes())
        return x

    try:
        params = tuple(sorted(eqn.params.items()))
        hash(params)
    except TypeError:
        return object()
    return (eqn.primitive.name, params, tuple(named(x) for x in ins), index)


def slotted(values, keys, arrays: list, slots_of: dict, first_slot: int = 0) -> tuple:
    """The data slots of a trace's folded `values` (with their `keys`, `fold_constants`),
    adding to `arrays` each value not yet seen in an earlier trace (`slots_of`: key ->
    slot, updated)."""
    slots = []
    for value, key in zip(values, keys):
        if key not in slots_of:
            slots_of[key] = first_slot + len(arrays)
            arrays.append(value)
        slots.append(slots_of[key])
    return tuple(slots)


def function_data(function: Callable, shapes, params=None) -> FunctionData:
    """The function traced at each tile shape of `shapes` (`trace_function` with `params`,
    `fold_constants`), and the arrays its kernel part reads (those of any of the traces,
    each once: a constant, or a value folded from the same constants the same way)."""
    arrays, slots_of, traced = [], {}, []
    for shape in dict.fromkeys(shapes):
        closed = trace_function(function, shape, params)
        eqns, outvars, constvars, values, keys = fold_constants(closed, with_keys=True)
        slots = slotted(values, keys, arrays, slots_of)
        traced.append((shape, TracedFunction(tuple(closed.jaxpr.invars), tuple(constvars),
                                             tuple(eqns), tuple(outvars), slots)))
    return FunctionData(tuple(traced), tuple(arrays), tuple(map(DataLeaf.of, arrays)))


def evaluate_function(traced: TracedFunction, args, read: Callable):
    """The traced function on ``args = (s, batch, head, q_pos, k_pos)``, each read of an
    array (data leaf ``slot``) at scalar indices taken from ``read(slot, flat)`` (`flat`
    the int32 index into the flattened array; a 0-d value of the array's dtype). Raises
    `UnsupportedRead` where the function uses an array otherwise."""
    env = dict(zip(traced.invars, args))
    env.update({v: _Array(slot, tuple(v.aval.shape)) for v, slot in
                zip(traced.constvars, traced.slots)})
    (out,) = _run(traced, env, read)
    if isinstance(out, _Array):
        raise UnsupportedRead("it returns an array it reads whole")
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
    if name in CALLS:
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        closed = inner if hasattr(inner, "consts") else None
        inner = getattr(inner, "jaxpr", inner)
        if inner is not None and len(inner.invars) == len(ins):
            env = dict(zip(inner.invars, ins))
            env.update(zip(inner.constvars, closed.consts if closed is not None else ()))
            return _run(inner, env, read)
    arrays = [x for x in ins if isinstance(x, _Array)]
    if name in CUSTOM_RULES:
        raise UnsupportedRead(f"it passes an array it reads (of shape {arrays[0].shape}) "
                              f"whole to a function with a derivative rule of its own "
                              f"(`{name}`); index it first and pass the scalar")
    if all(pymath.prod(x.shape) == 1 for x in arrays):
        # A one-element array: its value, in its shape.
        ins = [_shaped(_load(x, (0,) * len(x.shape), read), x.shape)
               if isinstance(x, _Array) else x for x in ins]
        return _bind(eqn, ins)
    raise UnsupportedRead(f"it applies `{name}` to an array it reads (of shape "
                          f"{arrays[0].shape}) other than at scalar indices")


class Reads(NamedTuple):
    """The scalars one evaluation read: ``(slot, flat index, value)`` each, in order."""

    items: list


def recording_reads(read: Callable):
    """``(read', reads)``: `read` that also records each read in `reads` (`Reads`)."""
    reads = Reads([])

    def wrapped(slot, flat):
        value = read(slot, flat)
        reads.items.append((slot, flat, value))
        return value

    return wrapped, reads


def replaying_reads(values):
    """A `read` that returns `values` in order (the scalars of a recorded evaluation, or
    stand-ins for them to differentiate by)."""
    it = iter(values)
    return lambda slot, flat: next(it)


def reads_traced(function: Callable, shape: tuple[int, int], params=None) -> bool:
    """Whether the score function's kernel part reads a float array that is traced (whose
    gradient a kernel would form), traced on a tile of `shape` with `params`. ``False``
    where the function does not trace (the call raises its error where it runs)."""
    try:
        data = function_data(function, [shape], params)
    except Exception:  # noqa: BLE001 - the call raises it where it runs
        return False
    return any(leaf.diff for leaf in data.leaves)


def array_read_decline(data: FunctionData, kernels: str, limit: int,
                 limit_note: str = "") -> str | None:
    """Why kernels that hold a score function's arrays whole in 32-bit memory and read them at
    scalar indices cannot take `data` (`function_data`'s result), in one line naming them
    (`kernels`: "the TPU kernels"), or ``None``: an array neither 32-bit nor bool, more than
    `limit` elements in all (`limit_note` added to the bound: ", in scalar memory"), or a
    read other than at scalar indices (`unsupported_read`)."""
    for leaf in data.leaves:
        if not (jnp.dtype(leaf.dtype).itemsize == 4 or leaf.dtype == jnp.bool_):
            return (f"the score function reads an array of {jnp.dtype(leaf.dtype).name} "
                    f"(shape {leaf.shape}): {kernels} read 32-bit or bool arrays.")
    total = sum(leaf.size for leaf in data.leaves)
    if total > limit:
        return (f"the score function reads arrays of {total} elements (at most "
                f"{limit}{limit_note}).")
    why = unsupported_read(data)
    if why is not None:
        return (f"the score function reads an array only as {kernels} cannot: {why} "
                f"(read arrays at scalar indices, e.g. slopes[head]).")
    return None


def unsupported_read(data: FunctionData) -> str | None:
    """The `UnsupportedRead` message of evaluating each of `data`'s traces with stand-in
    reads (zeros, under `jax.make_jaxpr`: no FLOPs), or ``None`` where every one evaluates."""

    def zeros(slot, flat):
        return jnp.zeros((), data.leaves[slot].dtype)

    for shape, traced in data.traced:
        try:
            jax.make_jaxpr(lambda *args: evaluate_function(traced, args, zeros))(
                *_tile_args(shape))
        except UnsupportedRead as e:
            return str(e)
    return None
