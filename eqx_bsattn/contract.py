"""The contract between masks and kernels, in public names: what a plug-in imports.

A **mask** subclasses `AbstractMask`: it declares `reads_segment_ids` and `varies_by_head`,
implements `elements` (on `TokenCoords`), and for speed `terms` (a `MaskTerms` AND that GPU
and TPU kernels evaluate in place). A mask that classifies blocks from their ranges subclasses
`AbstractBlockMask` instead, which adds `blocks` (on `BlockCoords`, with `classify`).

A **kernel** subclasses `AbstractKernel`: it declares `name`, `platforms` and `reads` (a
`MaskReads`), implements `priority` and `decline_reason`, and its ``__call__`` receives the
`CompiledMask` the plan built for it (a `BlockLayout` per pass, the canonical `MaskTerms`,
element bitmaps where the mask has no terms, and the element predicate `CompiledMask.visible`),
the call's `AttentionInputs`, its `Features` and its config. Its config subclasses
`AbstractKernelConfig` (the tiles of each pass, `PassBlocks`, and what else it tunes); `Tiling`
is the kernel-independent one. Its `decline_reason` and `default_tiling` see the `ResolvedMask`
(the terms, and layouts on demand) before the config is fixed. It never imports a mask class.
A kernel that also returns each row's log-sum-exp (what sequence sharding merges by)
subclasses `AbstractLseKernel`; one that reads a bias with its size-1 axes kept (``[bb, hb,
Lq or 1, Lk or 1]``) subclasses `AbstractBroadcastBiasKernel`.

Every class is abstract (`is_abstract`, named ``AbstractX``) or final (never subclassed), as
in equinox: only abstract methods and class variables are defined in a subclass.

A **sharding** subclasses `AbstractSharding`; `layout_from_classes` rebuilds the block
lists of the part of a layout one device sees.

The core also defines the few strategies it uses itself: the masks `Full` (the module's
default) and `Document` (added when a call passes segment ids), the algebra `And`, `Or`, `Not`,
and the sharding `Unsharded` (the module's default); `eqx_bsattn.masks` and
`eqx_bsattn.sharding` re-export them.

```python
from eqx_bsattn.contract import AbstractKernel, CompiledMask
```

One helper lives here, shared by kernels that evaluate a mask's element predicate on their
tiles with the arrays it reads taken as scalars (`mask_data`: a user predicate's per-head
widths).

`docs/custom_mask.md` and `docs/custom_kernel.md` walk through one of each.
"""

import dataclasses
from typing import NamedTuple as _NamedTuple

import jax
import jax.numpy as jnp

from ._compile import (
    CompiledMask as CompiledMask,
    MaskReads as MaskReads,
    ResolvedMask as ResolvedMask,
    describe_terms as describe_terms,
)
from ._inputs import AttentionInputs as AttentionInputs, POSITION_LIMIT as POSITION_LIMIT
from ._kernel import (
    AbstractBroadcastBiasKernel as AbstractBroadcastBiasKernel,
    AbstractKernel as AbstractKernel,
    AbstractLseKernel as AbstractLseKernel,
    Features as Features,
    ScoreParams as ScoreParams,
    add_sinks as add_sinks,
    first_gpu as first_gpu,
    pad_axis as pad_axis,
    refuse_forward_mode as refuse_forward_mode,
    refuse_second_order as refuse_second_order,
    sink_logsumexp as sink_logsumexp,
)
from ._layout import BlockLayout as BlockLayout, build_layout as build_layout
from ._lse import (
    LN2 as LN2,
    backward_delta as backward_delta,
    public_lse as public_lse,
    zero_cotangent as zero_cotangent,
)
from ._mask import (
    EMPTY as EMPTY,
    FULL as FULL,
    PARTIAL as PARTIAL,
    AbstractBinaryMask as AbstractBinaryMask,
    AbstractBlockMask as AbstractBlockMask,
    AbstractMask as AbstractMask,
    And as And,
    BlockCoords as BlockCoords,
    Document as Document,
    Full as Full,
    MaskTerms as MaskTerms,
    NonPaddingKeys as NonPaddingKeys,
    Not as Not,
    Or as Or,
    TokenCoords as TokenCoords,
    classify as classify,
)
from ._score import (
    AbstractScore as AbstractScore,
    RelativeBuckets as RelativeBuckets,
    ScoreTerm as ScoreTerm,
    ScoreTerms as ScoreTerms,
    far_splits as far_splits,
)
from ._score_data import (
    DataLeaf as DataLeaf,
    FunctionData as FunctionData,
    Reads as Reads,
    TracedFunction as TracedFunction,
    UnsupportedRead as UnsupportedRead,
    array_read_decline as array_read_decline,
    evaluate_function as evaluate_function,
    fold_constants as fold_constants,
    function_data as function_data,
    reads_traced as reads_traced,
    recording_reads as recording_reads,
    replaying_reads as replaying_reads,
    slotted as slotted,
    trace_function as trace_function,
    unsupported_read as unsupported_read,
)
from ._sharding import (
    AbstractSharding as AbstractSharding,
    Unsharded as Unsharded,
    layout_from_classes as layout_from_classes,
    mesh_in_context as mesh_in_context,
    typed_like as typed_like,
)
from ._signature import (
    check_flex as check_flex,
    fits as fits,
    params_tree as params_tree,
    read_signature as read_signature,
)
from ._strategy import AbstractStrategy as AbstractStrategy, is_abstract as is_abstract
from ._tiling import (
    AbstractKernelConfig as AbstractKernelConfig,
    AbstractTiling as AbstractTiling,
    AutoTiling as AutoTiling,
    PassBlocks as PassBlocks,
    Tiling as Tiling,
    blocks_text as blocks_text,
    chained_blocks as chained_blocks,
    check_fields as check_fields,
)


class MaskData(_NamedTuple):
    """A mask's element predicate traced on a kernel's tiles where it reads arrays at scalar
    indices (a user predicate's per-head widths, ``widths[head]``): `traced` ``((shape,
    TracedFunction), ...)`` on the arguments ``(head, qi, ki, qp, kp[, qs, ks])``, reading
    data slots from `first_slot` on; `arrays` and their `leaves` (never differentiated: a
    mask has no gradient)."""

    traced: tuple
    arrays: tuple
    leaves: tuple


def mask_data(predicate, shapes, segment_ids: bool, first_slot: int = 0,
              room: int | None = None) -> MaskData | None:
    """The element predicate of `predicate` (a `CompiledMask` without layouts; its
    `visible_at`) traced on int32 tiles of each shape of `shapes` (`segment_ids`: with the
    tiles' segment ids) with `fold_constants`, its arrays as data slots `first_slot`, ...;
    ``None`` where it reads no array, does not trace, reads an array other than at scalar
    indices, one not 32-bit or bool, or more than `room` elements in all (``None``: no
    bound). A kernel then reads an element map. Where an index comes from is the kernel's to
    check (`evaluate_function` with a recording read)."""
    scalar = jax.ShapeDtypeStruct((), jnp.int32)

    def body(head, qi, ki, qp, kp, qs, ks):
        return predicate.visible_at(head, TokenCoords(qi, qp, qs, predicate.q_len),
                                    TokenCoords(ki, kp, ks, predicate.kv_len))

    arrays, slots_of, traced = [], {}, []
    try:
        for shape in dict.fromkeys(tuple(s) for s in shapes):
            tile = jax.ShapeDtypeStruct(shape, jnp.int32)
            seg = tile if segment_ids else None
            closed = jax.make_jaxpr(body)(scalar, tile, tile, tile, tile, seg, seg)
            eqns, outvars, constvars, values, keys = fold_constants(closed, with_keys=True)
            slots = slotted(values, keys, arrays, slots_of, first_slot)
            traced.append((shape, TracedFunction(tuple(closed.jaxpr.invars), tuple(constvars),
                                                 tuple(eqns), tuple(outvars), slots)))
    except Exception:  # noqa: BLE001 - the element map evaluates it (or raises its error)
        return None
    leaves = tuple(dataclasses.replace(DataLeaf.of(a), diff=False) for a in arrays)
    if not leaves or (room is not None and sum(leaf.size for leaf in leaves) > room) or not all(
            jnp.dtype(leaf.dtype).itemsize == 4 or leaf.dtype == jnp.bool_ for leaf in leaves):
        return None

    def zeros(slot, flat):
        return jnp.zeros((), leaves[slot - first_slot].dtype)

    for shape, t in traced:
        tile = jax.ShapeDtypeStruct(shape, jnp.int32)
        args = (scalar,) + (tile,) * (6 if segment_ids else 4)
        try:
            out = jax.eval_shape(lambda *a, t=t: evaluate_function(t, a, zeros), *args)
        except UnsupportedRead:
            return None
        if out.dtype != jnp.bool_:
            return None
    return MaskData(tuple(traced), tuple(arrays), leaves)
