"""`AllToAll`: sequence parallelism by heads; one all-to-all gives each device every token of
its share of the heads, any kernel runs there, and one all-to-all brings the output back."""

from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from eqx_bsattn.contract import AbstractSharding, mesh_in_context

from ._local import (
    Operands,
    axis_size,
    check_divides,
    check_mesh,
    place,
    unsplit_like_query,
)
from .ring import RingAttention
from .shard_map import head_shard_call


#: What a refusal suggests, per strategy: `AllToAll` can give way to a ring over the same
#: axis; `AllToAllRing` already runs one, so its `heads_axis` devices move to `ring_axis`.
_WAY_OUT = {
    "AllToAll": "use RingAttention, or a smaller axis",
    "AllToAllRing": "give `heads_axis` fewer devices, a number that fits the heads, and "
                    "`ring_axis` the rest",
}


def kv_replication(heads: int, kv_heads: int, n: int, strategy: str = "AllToAll") -> int:
    """How many copies of each kv head the all-to-all sends so that each of `n` devices gets
    whole kv heads for its ``heads / n`` query heads: 1 when `n` divides the kv heads, else
    ``n / kv_heads`` (fewer kv heads than devices: each group's kv head goes to every device
    holding query heads of that group). Raises a one-line `ValueError` naming `strategy`
    (``"AllToAll"`` or ``"AllToAllRing"``) for a layout that cannot be split."""
    if heads % n:
        raise ValueError(
            f"{strategy} over {n} devices gives each device heads / {n} query heads: the query "
            f"heads ({heads}) must be a multiple of {n} ({_WAY_OUT[strategy]})."
        )
    if kv_heads % n == 0:
        return 1
    if n % kv_heads == 0:
        return n // kv_heads
    raise ValueError(
        f"{strategy} over {n} devices cannot split {kv_heads} key/value heads: their number "
        f"and {n} must divide one another (each device's {heads // n} query heads read whole "
        f"kv heads; {_WAY_OUT[strategy]})."
    )


class AllToAll(AbstractSharding):
    """Sequence parallelism over heads (DeepSpeed-Ulysses style): the inputs arrive split on
    the sequence over `seq_axis`; one all-to-all gives each of its ``n`` devices every token
    of ``H / n`` query heads (and their kv heads), the kernel runs there on a whole
    attention problem, and one all-to-all returns the output ``[B, H, Lq, Dv]`` split on the
    sequence again.

    Any kernel runs inside (the selector chooses as for an unsharded call: cuDNN, Splash
    and Mosaic too), since every device holds whole sequences. Segment ids and positions
    are given whole to every device (``O(L)`` integers), the bias and sinks by the device's
    heads, the score terms' slopes and table by its heads (a score function gets the call's
    head ids), and a per-head mask's layouts by its heads, so everything means what it means
    unsharded. With fewer kv heads than devices each kv head is replicated to the devices
    that hold its query heads (the all-to-all sends ``n / Hkv`` copies); the query heads must
    be a multiple of ``n``, and ``n`` and the kv heads must divide one another. Each device
    sends and receives ``(n - 1) / n`` of its q, k, v shards forward (and of its output
    shard back); the backward moves the cotangents the same way.

    **Arguments:**

    - `mesh`: a `jax.sharding.Mesh`.
    - `seq_axis`: the mesh axis the sequence arrives split over (and the heads are split
      over inside).
    - `batch_axis`: a mesh axis that splits the batch, or ``None``.

    ```python
    mesh = jax.make_mesh((8,), ("seq",))
    attn = BlockSparseAttention(mask=masks.Causal(), sharding=sharding.AllToAll(mesh, "seq"))
    out = jax.jit(attn)(q, k, v)   # q [1, 32, 131072, 128] split on the sequence
    ```
    """

    mesh: Mesh = eqx.field(static=True)
    seq_axis: str = eqx.field(static=True)
    batch_axis: str | None = eqx.field(default=None, static=True)

    needs_lse: ClassVar[bool] = False
    passes_positions: ClassVar[bool] = False
    passes_score: ClassVar[bool] = True
    loops_kernel: ClassVar[bool] = False
    keeps_bias_axes: ClassVar[bool] = True

    def __check_init__(self):
        if not isinstance(self.seq_axis, str):
            raise TypeError(f"`seq_axis` must be a mesh axis name; got {self.seq_axis!r}.")
        check_mesh(self.mesh, {"seq_axis": self.seq_axis, "batch_axis": self.batch_axis})

    def wrap(self, fn: Callable) -> Callable:
        s_axis, b_axis = self.seq_axis, self.batch_axis

        def run(query, key, value, inputs, mask):
            mesh = mesh_in_context(self.mesh)
            n = axis_size(mesh, s_axis)
            batch, heads, q_len = query.shape[:3]
            kv_heads, kv_len = key.shape[1:3]
            check_divides("the batch", batch, mesh, b_axis, "batch_axis")
            copies = kv_replication(heads, kv_heads, n)
            for what, length in (("query length", q_len), ("key/value length", kv_len)):
                check_divides(f"the {what}", length, mesh, s_axis, "seq_axis")
            ops = Operands(mesh)
            seq_spec = P(b_axis, None, s_axis, None)
            q_slot, k_slot, v_slot = (ops.add(x, seq_spec) for x in (query, key, value))
            call = head_shard_call(ops, inputs, mask, batch=batch, heads=heads,
                                   batch_axis=b_axis, head_axis=s_axis)

            def to_heads(x):  # [b, h, L / n, d] -> [b, h / n, L, d]
                return jax.lax.all_to_all(x, s_axis, 1, 2, tiled=True)

            def body(*local):
                read = ops.reader(list(local))
                q, k, v = read(q_slot), read(k_slot), read(v_slot)
                if copies > 1:
                    k, v = (jnp.repeat(x, copies, axis=1) for x in (k, v))
                out = call(read, fn, *map(to_heads, (q, k, v)))
                return jax.lax.all_to_all(out, s_axis, 2, 1, tiled=True)

            out = jax.shard_map(body, mesh=mesh, in_specs=tuple(ops.specs),
                                 out_specs=P(b_axis, None, s_axis, None))(*ops.inputs())
            return unsplit_like_query(out, mesh)

        return run


class AllToAllRing(AbstractSharding):
    """Sequence parallelism on a 2-D mesh: an all-to-all over `heads_axis`, the ring over
    `ring_axis`.

    The sequence arrives split over both axes (``P(batch, None, (ring_axis, heads_axis),
    None)``: the ``n_ring x n_heads`` devices hold consecutive slices, `heads_axis` the minor
    one). One all-to-all over `heads_axis` gives each device ``H / n_heads`` heads of the
    ``n_ring``-th of the sequence that its row of the ring holds; a `RingAttention` over
    `ring_axis` (with `heads_axis` as its head axis and `order`) runs there, and one
    all-to-all returns the output split like the input. The all-to-all stays within a group
    of `heads_axis` devices (one host, say) while the ring's hops cross the other axis. GQA
    with fewer kv heads than `heads_axis` devices replicates each kv head to the devices of
    its group, as `AllToAll` does; everything else follows `RingAttention` (an
    `AbstractLseKernel`, lengths that split into the ring's slices, score terms, segment
    ids, positions and every mask keep their meaning).

    **Arguments:**

    - `mesh`: a `jax.sharding.Mesh`.
    - `heads_axis`: the mesh axis of the all-to-all (the heads are split over it inside).
    - `ring_axis`: the mesh axis of the ring.
    - `batch_axis`: a mesh axis that splits the batch, or ``None``.
    - `order`: the ring's order, as `RingAttention`'s.

    ```python
    mesh = jax.make_mesh((4, 8), ("ring", "heads"))   # 4 hosts of 8 GPUs
    attn = BlockSparseAttention(mask=masks.Causal(),
                                sharding=sharding.AllToAllRing(mesh, "heads", "ring"))
    ```
    """

    mesh: Mesh = eqx.field(static=True)
    heads_axis: str = eqx.field(static=True)
    ring_axis: str = eqx.field(static=True)
    batch_axis: str | None = eqx.field(default=None, static=True)
    order: str = eqx.field(default="auto", static=True)

    needs_lse: ClassVar[bool] = True
    passes_positions: ClassVar[bool] = True
    passes_score: ClassVar[bool] = True
    loops_kernel: ClassVar[bool] = True
    keeps_bias_axes: ClassVar[bool] = True

    def __check_init__(self):
        for arg in ("heads_axis", "ring_axis"):
            if not isinstance(getattr(self, arg), str):
                raise TypeError(f"`{arg}` must be a mesh axis name; got {getattr(self, arg)!r}.")
        check_mesh(self.mesh, {"heads_axis": self.heads_axis, "ring_axis": self.ring_axis,
                               "batch_axis": self.batch_axis})
        self.ring  # noqa: B018  (checks `order`)

    @property
    def ring(self) -> RingAttention:
        """The ring that runs between the two all-to-alls."""
        return RingAttention(self.mesh, self.ring_axis, batch_axis=self.batch_axis,
                             head_axis=self.heads_axis, order=self.order)

    def fit_tiling(self, tiling, kernel, features):
        return self.ring.fit_tiling(tiling, kernel, features)

    def kernel_decline(self, kernel, mask, features):
        return self.ring.kernel_decline(kernel, mask, features)

    def wrap(self, fn: Callable) -> Callable:
        h_axis, r_axis, b_axis = self.heads_axis, self.ring_axis, self.batch_axis
        ring_call = self.ring.wrap(fn)

        def run(query, key, value, inputs, mask):
            mesh = mesh_in_context(self.mesh)
            n = axis_size(mesh, h_axis)
            heads, kv_heads = query.shape[1], key.shape[1]
            copies = kv_replication(heads, kv_heads, n, "AllToAllRing")
            if copies > 1:  # each kv head once per device of its group after the all-to-all
                key, value = (jnp.repeat(x, copies, axis=1) for x in (key, value))
            flat = P(b_axis, None, (r_axis, h_axis), None)
            split = P(b_axis, h_axis, r_axis, None)

            def exchange(x, spec_in, spec_out, split_axis, concat_axis):
                body = lambda x: jax.lax.all_to_all(  # noqa: E731
                    x, h_axis, split_axis, concat_axis, tiled=True)
                return jax.shard_map(body, mesh=mesh, in_specs=spec_in,
                                     out_specs=spec_out)(place(x, mesh, spec_in))

            q, k, v = (exchange(x, flat, split, 1, 2) for x in (query, key, value))
            out = ring_call(q, k, v, inputs, mask)
            return unsplit_like_query(exchange(out, split, flat, 2, 1), mesh)

        return run
