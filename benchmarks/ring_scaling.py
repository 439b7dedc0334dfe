"""What one `RingAttention` step costs at scale: a model, not a measurement of a ring.

For 8 to 1024 devices at 1M and 10M tokens (causal, zig-zag order: every device does the same
work per step, half of each (query shard, kv shard) pair visible), it prints per ring step:

- the bytes one device sends: the K and V shards in the forward ring; K, V and their float32
  dK / dV accumulators in the backward ring;
- the compute time of one step, from measured single-GPU kernel rates (effective TFLOP/s
  counting visible pairs; the backward step recomputes the step's forward and runs the
  kernel's backward: 3.5x the forward's FLOPs at the forward+backward rate);
- the time of one hop at the stated link bandwidths, and whether it hides behind the step's
  compute (the ring issues the next transfer before the current compute);
- the memory one device holds for the ring (bytes of the arrays, from the ring's design).

Rates: ``--rates FILE`` reads ``{"forward_tflops": ..., "forward_backward_tflops": ...,
"source": ...}``; without it the script reads ``benchmarks/kernel_rates.json`` if present, else
it uses `TritonBlockSparse` on one H200 (bfloat16, D=128, causal, L=16384; the low end of four
runs on four days in docs/triton.md, "Over four runs on four days": 450 / 416 TFLOP/s).

Run from the repository root::

    python benchmarks/ring_scaling.py                 # the table in docs/sharding.md
    python benchmarks/ring_scaling.py --heads 32 --kv-heads 8 --dim 128
    python benchmarks/ring_scaling.py --strategies --heads 64 --kv-heads 8   # ring, all-to-all, hybrid
"""

import argparse
import json
import math
import os

#: Bytes per second one device sends to one neighbour (one direction), as assumed here.
LINKS = {
    # NVLink 4 (H100 / H200): 18 links of 25 GB/s per direction.
    "NVLink": 450e9,
    # InfiniBand NDR: 400 Gb/s, one NIC per GPU.
    "IB": 50e9,
    # TPU v5p ICI: 4800 Gb/s per chip over 6 links, one link to a ring neighbour.
    "ICI": 100e9,
}

#: docs/triton.md, "Over four runs on four days" (H200, bfloat16, D=128, causal, L=16384).
DEFAULT_RATES = {"forward_tflops": 450.0, "forward_backward_tflops": 416.0,
                 "source": "docs/triton.md: TritonBlockSparse, H200, bf16, causal, L=16384, "
                           "low end of four runs"}

HERE = os.path.dirname(os.path.abspath(__file__))


def load_rates(path: str | None) -> dict:
    if path is None:
        path = os.path.join(HERE, "kernel_rates.json")
        if not os.path.exists(path):
            return dict(DEFAULT_RATES)
    with open(path) as f:
        rates = json.load(f)
    rates.setdefault("source", path)
    return rates


def ring_step(tokens: int, devices: int, *, heads: int, kv_heads: int, dim: int,
              rates: dict, itemsize: int = 2, density: float = 0.5) -> dict:
    """The model of one ring step for one device; times in seconds, sizes in bytes."""
    shard = tokens // devices
    kv_shard = 2 * kv_heads * shard * dim * itemsize  # K and V
    flops = 4.0 * heads * shard * shard * dim * density  # one step's visible pairs
    fwd_s = flops / (rates["forward_tflops"] * 1e12)
    bwd_s = 3.5 * flops / (rates["forward_backward_tflops"] * 1e12)
    sent_fwd = kv_shard
    sent_bwd = kv_shard + 2 * kv_heads * shard * dim * 4  # K, V and float32 dK, dV
    q_shard = heads * shard * dim * itemsize
    # Forward residuals: q, k, v, o, the log-sum-exp and the kv shards held at the farthest
    # hop each way. Backward working set: K / V held and arriving, the dK / dV accumulators
    # held and arriving (float32), dq (float32) and dO.
    residuals = 2 * q_shard + kv_shard + heads * shard * 4 + 2 * kv_shard
    working = 2 * kv_shard + 2 * (2 * kv_heads * shard * dim * 4) + heads * shard * dim * 4 \
        + q_shard
    row = {"devices": devices, "tokens": tokens, "shard": shard, "sent_fwd": sent_fwd,
           "sent_bwd": sent_bwd, "fwd_s": fwd_s, "bwd_s": bwd_s,
           "memory": residuals + working}
    for name, bandwidth in LINKS.items():
        row[f"hop_fwd_{name}"] = sent_fwd / bandwidth
        row[f"hop_bwd_{name}"] = sent_bwd / bandwidth
    return row


def hide_threshold(*, heads: int, kv_heads: int, rates: dict, bandwidth: float,
                   itemsize: int = 2, density: float = 0.5) -> float:
    """The shortest shard (tokens) whose forward step's compute covers its K / V hop."""
    # 4 H s^2 D rho / R >= 2 Hkv s D itemsize / BW  <=>  s >= Hkv itemsize R / (2 H rho BW)
    rate = rates["forward_tflops"] * 1e12
    return kv_heads * itemsize * rate / (2 * heads * density * bandwidth)


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g}"


def _gb(b: float) -> str:
    return f"{b / 1e9:.3g}"


def table(*, heads: int, kv_heads: int, dim: int, rates: dict, lengths, devices) -> str:
    links = list(LINKS)
    head = ["tokens", "devices", "shard", "sent fwd / bwd (MB)", "compute fwd / bwd (ms)"]
    head += [f"hop {name} fwd / bwd (ms)" for name in links]
    head += ["hides (fwd, bwd) " + " / ".join(links), "memory (GB)"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for tokens in lengths:
        for n in devices:
            r = ring_step(tokens, n, heads=heads, kv_heads=kv_heads, dim=dim, rates=rates)
            cells = [f"{tokens:,}", str(n), f"{r['shard']:,}",
                     f"{r['sent_fwd'] / 1e6:.4g} / {r['sent_bwd'] / 1e6:.4g}",
                     f"{_ms(r['fwd_s'])} / {_ms(r['bwd_s'])}"]
            hides = []
            for name in links:
                fwd, bwd = r[f"hop_fwd_{name}"], r[f"hop_bwd_{name}"]
                cells.append(f"{_ms(fwd)} / {_ms(bwd)}")
                hides.append("".join("y" if hop <= c else "n"
                                     for hop, c in ((fwd, r["fwd_s"]), (bwd, r["bwd_s"]))))
            cells += [" / ".join(hides), _gb(r["memory"])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def advice(*, heads: int, kv_heads: int, rates: dict) -> str:
    out = []
    for name, bandwidth in LINKS.items():
        s = hide_threshold(heads=heads, kv_heads=kv_heads, rates=rates, bandwidth=bandwidth)
        out.append(f"- {name} ({bandwidth / 1e9:.0f} GB/s): the forward hop hides behind a "
                   f"step once a shard holds {math.ceil(s):,} tokens or more.")
    out.append(
        f"- Head sharding (`ShardMap` over heads) sends nothing during attention: prefer it "
        f"while the devices are no more than the kv heads ({kv_heads}); each device then "
        "holds every token of its heads, the same bytes as a ring shard of every head.")
    out.append(
        "- A 2-D mesh (sequence x heads): keep the ring's shards above the threshold of the "
        "slowest link on the ring and split the rest of the devices over heads.")
    return "\n".join(out)


def strategies_table(*, heads: int, kv_heads: int, dim: int, rates: dict, lengths, devices,
                     group: int = 8, density: float = 0.5) -> str:
    """Per layer and device, forward+backward: the ring, the all-to-all and the hybrid
    (all-to-all over `group` devices on NVLink, the ring over the rest on InfiniBand), from
    the cost model of `eqx_bsattn.sharding` (`choose_sequence_sharding`)."""
    from eqx_bsattn.strategies.sharding import cost

    flops_s = rates["forward_backward_tflops"] * 1e12
    head = ["tokens", "devices", "ring (IB)", "all-to-all (IB)", f"hybrid ({group} NVLink x ring IB)",
            "picked"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for tokens in lengths:
        for n in devices:
            common = dict(batch=1, heads=heads, kv_heads=kv_heads, length=tokens, dim=dim,
                          density=density, flops_s=flops_s)
            costs = {
                "ring": cost.ring_cost(devices=n, link_bytes_s=LINKS["IB"], **common),
                "all-to-all": cost.all_to_all_cost(devices=n, link_bytes_s=LINKS["IB"],
                                                   **common),
            }
            if n > group:
                costs["hybrid"] = cost.hybrid_cost(
                    heads_devices=group, ring_devices=n // group,
                    heads_link_bytes_s=LINKS["NVLink"], ring_link_bytes_s=LINKS["IB"], **common)
            cells = [f"{tokens:,}", str(n)]
            for name in ("ring", "all-to-all", "hybrid"):
                c = costs.get(name)
                if c is None or c.runs is not None:
                    cells.append("cannot run" if c is not None else "-")
                else:
                    cells.append(f"{_ms(c.time_s)} ms ({_ms(c.comm_s)} exposed, "
                                 f"{c.sent_bytes / 1e9:.3g} GB)")
            ok = {k: c for k, c in costs.items() if c.runs is None}
            cells.append(min(ok, key=lambda k: ok[k].time_s))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rates", help="JSON with forward_tflops, forward_backward_tflops")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2**20, 10 * 2**20])
    parser.add_argument("--devices", type=int, nargs="+",
                        default=[8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--strategies", action="store_true",
                        help="the ring, the all-to-all and the hybrid per layer instead")
    args = parser.parse_args(argv)
    rates = load_rates(args.rates)
    if args.strategies:
        print(f"B=1, H={args.heads}, Hkv={args.kv_heads}, D={args.dim}, bfloat16, causal "
              f"(density 0.5); forward+backward per layer and device at "
              f"{rates['forward_backward_tflops']} TFLOP/s; IB {LINKS['IB'] / 1e9:.0f} GB/s, "
              f"NVLink {LINKS['NVLink'] / 1e9:.0f} GB/s.\n")
        print(strategies_table(heads=args.heads, kv_heads=args.kv_heads, dim=args.dim,
                               rates=rates, lengths=args.lengths, devices=args.devices))
        return
    print(f"B=1, H={args.heads}, Hkv={args.kv_heads}, D={args.dim}, bfloat16, causal "
          f"(zig-zag), per device and ring step. Rates: {rates['forward_tflops']} / "
          f"{rates['forward_backward_tflops']} TFLOP/s forward / forward+backward "
          f"({rates['source']}). Links: "
          + ", ".join(f"{k} {v / 1e9:.0f} GB/s" for k, v in LINKS.items()) + ".\n")
    print(table(heads=args.heads, kv_heads=args.kv_heads, dim=args.dim, rates=rates,
                lengths=args.lengths, devices=args.devices))
    print()
    print(advice(heads=args.heads, kv_heads=args.kv_heads, rates=rates))


if __name__ == "__main__":
    main()
