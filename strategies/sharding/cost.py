"""What a sharded call sends: the collectives of a compiled program, read from its HLO."""

import re
from typing import NamedTuple

_COLLECTIVES = ("all-to-all", "collective-permute", "all-gather", "all-reduce",
                "reduce-scatter")
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(_COLLECTIVES) + r")(?:-start)?\(")


def collective_bytes(hlo_text: str) -> dict[str, list[int]]:
    """``{op: [bytes of each instruction's result, ...]}`` for every collective in the text
    of a compiled program (`jax.jit(f).lower(...).compile().as_text()`), one device's view.

    Each instruction counts once, in program order, whatever loop holds it (a ring's
    ``collective-permute`` in its loop body is one step's transfer). An ``all-to-all``'s
    result is the device's whole shard, of which it keeps ``1 / n`` and sends the rest.

    ```python
    sent = collective_bytes(jax.jit(attn).lower(q, k, v).compile().as_text())
    sent["all-to-all"]   # e.g. [2048, 2048, 2048, 2048]: q, k, v in, the output back
    ```
    """
    found: dict[str, list[int]] = {}
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if match is None:
            continue
        total = 0
        for dtype, dims in _SHAPE.findall(match.group(1)):
            size = 1
            for d in filter(None, dims.split(",")):
                size *= int(d)
            total += size * _BYTES[dtype]
        found.setdefault(match.group(2), []).append(total)
    return found


class Cost(NamedTuple):
    """One strategy's modelled forward+backward attention per device and layer.

    - `compute_s`: seconds of kernel work (forward, backward; the ring's backward
      recomputes each step's forward: 3.5x the forward's FLOPs, else 2.5x).
    - `sent_bytes`: bytes one device sends (forward and backward together).
    - `comm_s`: seconds of those sends that the compute does not hide.
    - `time_s`: `compute_s` + `comm_s`.
    - `runs`: ``None`` where the strategy runs this call, else why not.
    """

    compute_s: float
    sent_bytes: float
    comm_s: float
    time_s: float
    runs: str | None = None


def _flops(batch, heads, length, dim, density, devices):
    # Two matmuls of 2 FLOPs per visible (query, key) pair and dim, shared by the devices.
    return 4.0 * batch * heads * length * length * dim * density / devices


def ring_cost(*, devices: int, batch: int, heads: int, kv_heads: int, length: int, dim: int,
              density: float = 1.0, dtype_bytes: int = 2, link_bytes_s: float,
              flops_s: float, steps: int | None = None) -> Cost:
    """`RingAttention` over `devices`: `steps` ring steps (default every device's kv shard;
    fewer where the mask leaves steps empty), each sending one kv shard ``2 B Hkv (L / n) D``
    (and in the backward with its float32 dk/dv, ``+ 8 B Hkv (L / n) D``), each hop hidden
    behind the step's compute when it takes no longer."""
    n = devices
    steps = n if steps is None else steps
    shard = batch * kv_heads * (length // n) * dim
    fwd_hop, bwd_hop = 2 * shard * dtype_bytes, 2 * shard * (dtype_bytes + 4)
    flops = _flops(batch, heads, length, dim, density, n)
    fwd_s, bwd_s = flops / flops_s, 3.5 * flops / flops_s
    hops = max(steps - 1, 0)
    exposed = sum(hops * max(0.0, hop / link_bytes_s - step / steps)
                  for hop, step in ((fwd_hop, fwd_s), (bwd_hop, bwd_s)))
    return Cost(fwd_s + bwd_s, hops * (fwd_hop + bwd_hop), exposed, fwd_s + bwd_s + exposed)


def all_to_all_cost(*, devices: int, batch: int, heads: int, kv_heads: int, length: int,
                    dim: int, density: float = 1.0, dtype_bytes: int = 2,
                    link_bytes_s: float, flops_s: float) -> Cost:
    """`AllToAll` over `devices`: the forward's all-to-alls of q, k, v (kv heads replicated
    to ``n`` where fewer) and of the output, the backward's of the output's cotangent and of
    dq, dk, dv; each device sends ``(n - 1) / n`` of each ``[B, H, L / n, D]`` shard, and
    nothing overlaps the compute."""
    n = devices
    runs = None
    if heads % n:
        runs = f"the query heads ({heads}) are not a multiple of the devices ({n})"
    elif kv_heads % n and n % kv_heads:
        runs = f"the kv heads ({kv_heads}) and the devices ({n}) do not divide one another"
    kv = kv_heads if kv_heads % n == 0 else n
    shard = batch * (length // n) * dim * dtype_bytes
    moved = 2 * (heads + 2 * kv + heads) * shard * (n - 1) / n  # forward and backward
    flops = _flops(batch, heads, length, dim, density, n)
    compute = 3.5 * flops / flops_s  # forward 1x, backward 2.5x
    comm = moved / link_bytes_s
    return Cost(compute, moved, comm, compute + comm, runs)


def hybrid_cost(*, heads_devices: int, ring_devices: int, batch: int, heads: int,
                kv_heads: int, length: int, dim: int, density: float = 1.0,
                dtype_bytes: int = 2, heads_link_bytes_s: float, ring_link_bytes_s: float,
                flops_s: float) -> Cost:
    """`AllToAllRing`: the all-to-all over `heads_devices` (at their link's bandwidth) around
    a ring of `ring_devices` whose devices each hold ``H / heads_devices`` heads."""
    a2a = all_to_all_cost(devices=heads_devices, batch=batch, heads=heads, kv_heads=kv_heads,
                          length=length // ring_devices, dim=dim, dtype_bytes=dtype_bytes,
                          link_bytes_s=heads_link_bytes_s, flops_s=flops_s)
    ring = ring_cost(devices=ring_devices, batch=batch, heads=heads // heads_devices,
                     kv_heads=max(kv_heads // heads_devices, 1), length=length, dim=dim,
                     density=density, dtype_bytes=dtype_bytes, link_bytes_s=ring_link_bytes_s,
                     flops_s=flops_s)
    return Cost(ring.compute_s, a2a.sent_bytes + ring.sent_bytes, a2a.comm_s + ring.comm_s,
                ring.time_s + a2a.comm_s, a2a.runs)


class SequenceChoice(NamedTuple):
    """What `choose_sequence_sharding` picked (`sharding`), the modelled `costs` of each
    strategy, and `explain()`: the choice and why, in a few lines."""

    sharding: object
    costs: dict
    picked: str

    def explain(self) -> str:
        lines = [f"picked {self.picked}: the least modelled time per layer (forward and "
                 "backward) among the strategies that run this call"]
        for name, c in self.costs.items():
            if c.runs is not None:
                lines.append(f"  {name}: cannot run: {c.runs}")
                continue
            lines.append(f"  {name}: {c.time_s * 1e3:.3g} ms = compute {c.compute_s * 1e3:.3g} "
                         f"ms + exposed communication {c.comm_s * 1e3:.3g} ms "
                         f"({c.sent_bytes / 1e6:.4g} MB sent per device)")
        return "\n".join(lines)


def choose_sequence_sharding(mesh, seq_axis: str, *, heads: int, kv_heads: int, length: int,
                             dim: int, batch: int = 1, density: float = 1.0,
                             dtype_bytes: int = 2, heads_axis: str | None = None,
                             link_bytes_s: float = 50e9, heads_link_bytes_s: float = 450e9,
                             flops_s: float = 400e12) -> SequenceChoice:
    """The sequence-parallel strategy the cost model (docs/sharding.md) prefers for a call
    of these sizes: `RingAttention` or `AllToAll` over `seq_axis`, and with `heads_axis`
    also `AllToAllRing` (all-to-all over `heads_axis` at `heads_link_bytes_s`, the ring
    over `seq_axis` at `link_bytes_s`). `density`: the fraction of (query, key) pairs the
    mask leaves visible; `flops_s`: the kernel's rate on one device.

    ```python
    choice = choose_sequence_sharding(mesh, "seq", heads=32, kv_heads=8, length=131072,
                                      dim=128, density=0.5)
    print(choice.explain())
    attn = BlockSparseAttention(mask=masks.Causal(), sharding=choice.sharding)
    ```
    """
    from .all_to_all import AllToAll, AllToAllRing
    from .ring import RingAttention

    n = mesh.shape[seq_axis]
    common = dict(batch=batch, heads=heads, kv_heads=kv_heads, length=length, dim=dim,
                  density=density, dtype_bytes=dtype_bytes, flops_s=flops_s)
    costs = {
        "RingAttention": ring_cost(devices=n, link_bytes_s=link_bytes_s, **common),
        "AllToAll": all_to_all_cost(devices=n, link_bytes_s=link_bytes_s, **common),
    }
    make = {"RingAttention": lambda: RingAttention(mesh, seq_axis),
            "AllToAll": lambda: AllToAll(mesh, seq_axis)}
    if heads_axis is not None:
        costs["AllToAllRing"] = hybrid_cost(
            heads_devices=mesh.shape[heads_axis], ring_devices=n,
            heads_link_bytes_s=heads_link_bytes_s, ring_link_bytes_s=link_bytes_s, **common)
        make["AllToAllRing"] = lambda: AllToAllRing(mesh, heads_axis, seq_axis)
    runnable = {k: c for k, c in costs.items() if c.runs is None}
    picked = min(runnable, key=lambda k: runnable[k].time_s)
    return SequenceChoice(make[picked](), costs, picked)
