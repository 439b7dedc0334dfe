"""FlexAttention (torch) on the attention-gym cases of `gym_gpu.py`, in a process of its own
(torch's compiler and JAX's kernels do not share one process cleanly): the same mask_mods and
score_mods written in torch, by the names of `benchmarks/gym_catalogue.py`.

    python benchmarks/flex_gym_peer.py --batch 2 --heads 16 --dim 128 --dtype bfloat16
        --reps 10 --case-timeout 60   < requests

Reads one JSON request a line, ``{"name", "q_len", "kv_len", "args", "arrays"}`` (`args`: the
case's sizes; `arrays`: an .npz of its arrays: document ids, intervals, rotary parts), and
answers each with one line ``RECORD {json}``: the median forward and forward+backward
milliseconds of `torch.compile`d `flex_attention` (gradients of q, k, v; ``[B, H, L, D]``;
the block mask from `create_block_mask`, made before the timed calls; none where the case
has no mask_mod), or an error. Needs torch with CUDA; imports neither JAX nor eqx_bsattn.
"""

import argparse
import json
import signal
import sys

import numpy as np

from flex_peer import median_ms


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("batch", "heads", "dim", "reps", "case-timeout"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    return p.parse_args(argv)


def functions(torch, name: str, a: dict, arrays: dict):
    """``(mask_mod, score_mod)`` of case `name` in torch (either ``None``), from its sizes `a`
    and its arrays (on the device)."""

    def causal(b, h, q, kv):
        return q >= kv

    def clamped_window(qx, qy, kx, ky, w, h_, kw, kh):
        cx = torch.clamp(qx, kw // 2, w - 1 - kw // 2)
        cy = torch.clamp(qy, kh // 2, h_ - 1 - kh // 2)
        return ((cx - kx).abs() <= kw // 2) & ((cy - ky).abs() <= kh // 2)

    def tile_window(q_tile, kv_tile, tiles, kernel_tiles):
        left, right = kernel_tiles // 2, kernel_tiles // 2 + kernel_tiles % 2 - 1
        centre = torch.clamp(q_tile, left, tiles - 1 - right)
        return (kv_tile >= centre - left) & (kv_tile <= centre + right)

    def gather_bits(code):
        code = code & 0x55555555
        for shift, keep in ((1, 0x33333333), (2, 0x0F0F0F0F), (4, 0x00FF00FF), (8, 0x0000FFFF)):
            code = (code | (code >> shift)) & keep
        return code

    def relative_bias(score, b, h, q, kv):
        return score + 0.1 * (q - kv)

    def alibi(score, b, h, q, kv):
        return score + (kv - q) * torch.exp2(-(h + 1) * 8.0 / a["heads"])

    if name == "causal":
        return causal, None
    if name in ("noop", "noop_score"):
        return None, (lambda score, b, h, q, kv: score) if name == "noop_score" else None
    if name == "sliding_window":
        return (lambda b, h, q, kv: (q >= kv) & (q - kv <= a["width"])), None
    if name in ("prefix_lm", "prefix_lm_inclusive"):
        def prefix(b, h, q, kv):
            seen = kv <= a["prefix"] if a.get("inclusive") else kv < a["prefix"]
            return seen | (q >= kv)
        return prefix, None
    if name == "decode_offset":
        return (lambda b, h, q, kv: q + a["offset"] >= kv), None
    if name == "document":
        doc = arrays["doc"]
        return (lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)), None
    if name == "nested_jagged":
        seq, offsets = arrays["seq"], arrays["offsets"]

        def nested(b, h, q, kv):
            q_local, kv_local = q - offsets[seq[q]], kv - offsets[seq[kv]]
            return (seq[q] == seq[kv]) & (q_local >= kv_local)
        return nested, None
    if name == "dilated_sliding_window":
        def dilated(b, h, q, kv):
            gap = (q - kv).abs()
            return (gap <= a["width"]) & (gap % a["dilation"] == 0)
        return dilated, None
    if name == "batchify_causal":
        size = a["size"]
        return (lambda b, h, q, kv: (q // size == kv // size) & (q % size >= kv % size)), None
    if name in ("natten", "tiled_natten", "morton_natten"):
        side, k = a["side"], a["kernel"]
        if name == "natten":
            def coords(idx):
                return idx // side, idx % side
        elif name == "tiled_natten":
            tw, th = a["extra"]

            def coords(idx):
                tile, inner = idx // (tw * th), idx % (tw * th)
                tiles_x = side // tw
                return (tile % tiles_x) * tw + inner % tw, (tile // tiles_x) * th + inner // tw
        else:
            def coords(idx):
                return gather_bits(idx), gather_bits(idx >> 1)

        def neighbourhood(b, h, q, kv):
            return clamped_window(*coords(q), *coords(kv), side, side, k, k)
        return neighbourhood, None
    if name == "sasa":
        side, window = a["side"], a["window"]
        return (lambda b, h, q, kv: ((q // side - kv // side).abs() <= window)
                & ((q % side - kv % side).abs() <= window)), None
    if name in ("sta_2d", "sta_3d"):
        tiles = [c // t for c, t in zip(a["canvas"], a["tile"])]
        kernel_tiles = [k // t for k, t in zip(a["kernel"], a["tile"])]
        vision, text, tile_size = int(np.prod(a["canvas"])), a["text"], int(np.prod(a["tile"]))

        def tile_coords(idx):
            tile_id, out = idx // tile_size, []
            for n in reversed(tiles):
                out.append(tile_id % n)
                tile_id = tile_id // n
            return out[::-1]

        def sta(b, h, q, kv):
            near = (q < vision) & (kv < vision)
            for q_t, kv_t, n, k in zip(tile_coords(q), tile_coords(kv), tiles, kernel_tiles):
                near = near & tile_window(q_t, kv_t, n, k)
            to_text = (q < vision) & (kv >= vision) & (kv < vision + text)
            return near | to_text | ((q >= vision) & (kv < vision + text))
        return sta, None
    if name == "svg_spatial":
        band = (a["width"] * a["per_frame"]) // a["round_to"] * a["round_to"]
        first = a["prompt"] + a["per_frame"] if a["sink"] else a["prompt"]
        return (lambda b, h, q, kv: (kv < first) | (q < a["prompt"])
                | ((q - kv).abs() < band)), None
    if name == "svg_temporal":
        band, prompt, per_frame = (a["width"] * a["per_frame"]) // a["frames"], a["prompt"], \
            a["per_frame"]
        return (lambda b, h, q, kv: (kv < prompt) | (q < prompt)
                | (((q - prompt) % per_frame - (kv - prompt) % per_frame).abs() < band)), None
    if name == "vision_cross_attention":
        intervals, image = arrays["intervals"], arrays["image"]
        return (lambda b, h, q, kv: (q >= intervals[image[kv], 0])
                & (q < intervals[image[kv], 1])), None
    if name == "alibi":
        return causal, alibi
    if name == "tanh_softcap":
        return None, lambda score, b, h, q, kv: a["cap"] * torch.tanh(score / a["cap"])
    if name == "relative_bias":
        return None, relative_bias
    if name == "head_bias":
        return None, lambda score, b, h, q, kv: score + 2 * h
    if name == "checkerboard":
        return None, lambda score, b, h, q, kv: torch.where(
            (kv - q).abs() % 2 == 1, score * 0.5, score * 2.0)
    if name == "causal_bias":
        return None, lambda score, b, h, q, kv: torch.where(q >= kv, score, -float("inf"))
    if name == "alibi_and_causal":
        return None, lambda score, b, h, q, kv: torch.where(
            q >= kv, alibi(score, b, h, q, kv), -float("inf"))
    if name == "rope_latent":
        q_rope, k_rope = arrays["q_rope"], arrays["k_rope"]
        return causal, lambda score, b, h, q, kv: score + 0.5 * (
            q_rope[b, h, q] * k_rope[b, h, kv]).sum(-1)
    if name == "decode_offset_score":
        return None, lambda score, b, h, q, kv: relative_bias(score, b, h, q + a["offset"], kv)
    raise ValueError(f"no torch form of case {name!r}")


class CaseTimeout(Exception):
    pass


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not torch.cuda.is_available():
        raise SystemExit("flex_gym_peer.py: torch sees no CUDA device.")
    dev, dtype = "cuda", getattr(torch, args.dtype)
    gen = torch.Generator(device=dev).manual_seed(0)

    def sync(x):
        torch.cuda.synchronize()
        return x

    def on_alarm(signum, frame):
        raise CaseTimeout(f"past --case-timeout {args.case_timeout} s")

    signal.signal(signal.SIGALRM, on_alarm)

    def timed(request):
        q_len, kv_len = request["q_len"], request["kv_len"]
        arrays = {n: torch.as_tensor(x, device=dev) for n, x in np.load(request["arrays"]).items()}
        mask_mod, score_mod = functions(torch, request["name"], request["args"], arrays)
        # A fresh compile each case: past torch's recompile limit a compiled function runs
        # eagerly and forms every score.
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention)
        block_mask = None if mask_mod is None else create_block_mask(
            mask_mod, None, None, q_len, kv_len, device=dev)
        shape = (args.batch, args.heads)
        q = torch.randn(*shape, q_len, args.dim, device=dev, dtype=dtype, generator=gen,
                        requires_grad=True)
        k, v = (torch.randn(*shape, kv_len, args.dim, device=dev, dtype=dtype, generator=gen,
                            requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)

        def fwd():
            with torch.no_grad():
                return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)

        def fwdbwd():
            out = compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
            return torch.autograd.grad(out, (q, k, v), do)

        return {"fwd_ms": median_ms(fwd, args.reps, sync),
                "fwdbwd_ms": median_ms(fwdbwd, args.reps, sync)}

    for line in sys.stdin:
        request = json.loads(line)
        record = {"impl": "flex_attention", "case": request["name"]}
        signal.alarm(args.case_timeout)
        try:
            record.update(timed(request))
        except Exception as e:  # noqa: BLE001 - one failed case is a row, not a crash
            record["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        finally:
            signal.alarm(0)
        print("RECORD " + json.dumps(record), flush=True)
        torch.cuda.empty_cache()  # a failed case's buffers do not crowd the next one


if __name__ == "__main__":
    main()
