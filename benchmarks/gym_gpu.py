"""The attention-gym catalogue (`benchmarks/gym_catalogue.py`, the functions
tests/test_flex_catalogue.py checks) at full size: our module against FlexAttention on the same
call, forward and forward+backward, on a GPU.

    python benchmarks/gym_gpu.py [--length 8192] [--batch 2] [--heads 16] [--dim 128]
        [--dtype bfloat16] [--reps 10] [--cases causal document ...] [--from-flex]
        [--case-timeout 60] [--budget 300] [--no-flex] [--out gym.json]

For each case, our `BlockSparseAttention` (the built-in form where one says the same as the
function, else `masks.from_flex` / `scores.from_flex`; with `--from-flex` the from_flex form
always), with the kernel the selector picks (printed), jitted; and `torch.compile`d
`flex_attention` with the same mask_mod / score_mod in torch (`benchmarks/flex_gym_peer.py`,
in a process of its own, its block mask made by `create_block_mask` outside the timed calls).
Both take ``[B, H, L, D]``; forward+backward is the gradients of q, k and v. Each time is the
median of `--reps` calls after two warm-up calls. TF/s count the visible pairs only (the
case's mask evaluated on the host, once per case): ``4 B H D pairs`` forward and 2.5 times
that more for the backward.

The sizes follow `--length`: windows of ``L / 8`` keys, 16 documents, a ``2^k x 2^k`` canvas
(the largest with ``4^k <= L``) for the neighbourhood masks, a 128-query decoding step, ...
(`cases`); each row says its lengths. The cases run in turn, each on both sides; a case that
fails prints its error and the run goes on; past `--case-timeout` seconds (checked when a call
returns) a case stops, and no case starts past `--budget` seconds. On a CPU,
``--length 256 --no-flex`` runs our side end to end.
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import eqx_bsattn as bsa
from eqx_bsattn import masks, scores
from eqx_bsattn.bench import document_segment_ids, environment, visible_pairs
from eqx_bsattn.timing import median_ms

HERE = pathlib.Path(__file__).resolve().parent
TARGET = 1.3  # FlexAttention's forward+backward time over ours
DECODE_QUERIES = 128
ROPE_DIM = 64
SOFT_CAP = 20.0


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gym = _load("gym_catalogue")


@dataclasses.dataclass(frozen=True)
class Case:
    """One catalogue function at full size. `args` (ints) and `arrays` (NumPy) are what the
    torch side rebuilds the same function from (`flex_gym_peer.py`); `mask_mod` / `score_mod`
    are the JAX functions, `params` what `from_flex` passes them; `ours` the built-in form
    (module fields), ``None`` where only from_flex says it; `call` the call's extra
    arguments."""

    q_len: int
    kv_len: int
    mask_mod: Callable | None = None
    score_mod: Callable | None = None
    params: Any = None
    ours: dict | None = None
    call: dict = dataclasses.field(default_factory=dict)
    args: dict = dataclasses.field(default_factory=dict)
    arrays: dict = dataclasses.field(default_factory=dict)
    score_params: bool = False  # params go to the score_mod (else to the mask_mod)


def _side(length: int) -> int:
    """The side of the largest power-of-two square canvas within `length` tokens."""
    return 2 ** (int(np.log2(length)) // 2)


def cases(length: int, batch: int, heads: int) -> dict[str, Callable[[], Case]]:
    """Every catalogue case at `length`, built on demand (a case's arrays only when it runs)."""
    L, window, side = length, max(length // 8, 16), _side(length)
    kernel = side // 4 + 1  # an odd neighbourhood: 17 x 17 on a 64 x 64 canvas
    tile = max(side // 8, 1)
    text = max(length // 64, 8)
    prompt, frames = max(length // 32, 8), 8
    per_frame = (length - prompt) // frames
    dq = min(DECODE_QUERIES, length)
    doc = document_segment_ids(length)
    segments = {"q_segment_ids": np.stack([doc] * batch), "kv_segment_ids": np.stack([doc] * batch)}
    causal = dict(mask=masks.Causal())

    def document():
        return Case(L, L, gym.document_causal, params=jnp.asarray(doc), call=segments,
                    ours=dict(mask=masks.Document() & masks.Causal()), arrays={"doc": doc})

    def nested():
        offsets = np.concatenate([[0], np.cumsum(np.bincount(doc))]).astype(np.int32)
        return Case(L, L, gym.nested_causal, call=segments,
                    params={"seq": jnp.asarray(doc), "offsets": jnp.asarray(offsets)},
                    ours=dict(mask=masks.Document() & masks.Causal()),
                    arrays={"seq": doc, "offsets": offsets})

    def canvas(fn, extra=()):
        return lambda: Case(side * side, side * side, fn(side, side, kernel, kernel, *extra),
                            args={"side": side, "kernel": kernel, "extra": list(extra)})

    def sta(canvas_shape, kernel_shape, tile_shape):
        vision = int(np.prod(canvas_shape))
        return lambda: Case(vision + text, vision + text,
                            gym.sta(canvas_shape, kernel_shape, tile_shape, text),
                            args={"canvas": canvas_shape, "kernel": kernel_shape,
                                  "tile": tile_shape, "text": text})

    def vision_cross():
        n, image = 8, L // 8
        starts = np.arange(n) * image
        ends = starts + np.where(np.arange(n) < n - 1, image, image // 2)  # rows that see none
        intervals = np.stack([starts, ends], -1).astype(np.int32)
        image_of = np.repeat(np.arange(n, dtype=np.int32), image)
        return Case(L, n * image, gym.vision_cross_attention,
                    params={"intervals": jnp.asarray(intervals), "image": jnp.asarray(image_of)},
                    arrays={"intervals": intervals, "image": image_of})

    def rope():
        keys = jax.random.split(jax.random.key(9), 2)
        q_rope, k_rope = (np.asarray(0.5 * jax.random.normal(kk, (batch, heads, L, ROPE_DIM)))
                          for kk in keys)
        return Case(L, L, gym.causal, gym.rope_latent(1, 0.5), score_params=True,
                    params=(jnp.asarray(q_rope), jnp.asarray(k_rope)),
                    arrays={"q_rope": q_rope, "k_rope": k_rope})

    alibi_causal = dict(mask=masks.Causal(), score=scores.ALiBi())
    sta_3d = (4, side, length // (4 * side))
    return {
        "causal": lambda: Case(L, L, gym.causal, ours=causal),
        "noop": lambda: Case(L, L, gym.noop_mask, ours=dict(mask=masks.Full())),
        "sliding_window": lambda: Case(L, L, gym.sliding_window(window), args={"width": window},
                                       ours=dict(mask=masks.Causal()
                                                 & masks.SlidingWindow(window, 0))),
        "prefix_lm": lambda: Case(L, L, gym.prefix_lm(L // 4), args={"prefix": L // 4},
                                  ours=dict(mask=masks.PrefixLM(L // 4))),
        "prefix_lm_inclusive": lambda: Case(L, L, gym.prefix_lm(L // 4, True),
                                            args={"prefix": L // 4, "inclusive": True},
                                            ours=dict(mask=masks.PrefixLM(L // 4 + 1))),
        "decode_offset": lambda: Case(dq, L, gym.decode_offset(L - dq), args={"offset": L - dq},
                                      ours=dict(mask=masks.Causal(offset=L - dq))),
        "document": document,
        "nested_jagged": nested,
        "dilated_sliding_window": lambda: Case(
            L, L, gym.dilated_window(window, 3), args={"width": window, "dilation": 3},
            ours=dict(mask=masks.SlidingWindow(window, window) & masks.Dilated(3))),
        "batchify_causal": lambda: Case(L, L, gym.batchify_causal(window), args={"size": window},
                                        ours=dict(mask=masks.ChunkedCausal(window))),
        "natten": canvas(gym.natten),
        "tiled_natten": canvas(gym.tiled_natten, (tile, tile)),
        "morton_natten": canvas(gym.morton_natten),
        "sasa": lambda: Case(side * side, side * side, gym.sasa(side, kernel // 2),
                             args={"side": side, "window": kernel // 2}),
        "sta_2d": sta((side, length // side), (3 * tile, 3 * tile), (tile, tile)),
        "sta_3d": sta(sta_3d, (2, 3 * tile, 3 * tile), (1, tile, tile)),
        "svg_spatial": lambda: Case(
            prompt + frames * per_frame, prompt + frames * per_frame,
            gym.svg_spatial(prompt, per_frame, 1, True, max(per_frame // 16, 1)),
            args={"prompt": prompt, "per_frame": per_frame, "width": 1, "sink": True,
                  "round_to": max(per_frame // 16, 1)}),
        "svg_temporal": lambda: Case(
            prompt + frames * per_frame, prompt + frames * per_frame,
            gym.svg_temporal(prompt, frames, per_frame, 2),
            args={"prompt": prompt, "frames": frames, "per_frame": per_frame, "width": 2}),
        "vision_cross_attention": vision_cross,
        "alibi": lambda: Case(L, L, gym.causal, gym.alibi(heads), args={"heads": heads},
                              ours=alibi_causal),
        "tanh_softcap": lambda: Case(L, L, None, gym.tanh_softcap(SOFT_CAP),
                                     args={"cap": SOFT_CAP},
                                     ours=dict(logits_soft_cap=SOFT_CAP)),
        "relative_bias": lambda: Case(L, L, None, gym.relative_bias),
        "head_bias": lambda: Case(L, L, None, gym.head_bias),
        "checkerboard": lambda: Case(L, L, None, gym.checkerboard),
        "causal_bias": lambda: Case(L, L, None, gym.causal_bias, ours=causal),
        "alibi_and_causal": lambda: Case(L, L, None, gym.alibi_and_causal(heads),
                                         args={"heads": heads}, ours=alibi_causal),
        "noop_score": lambda: Case(L, L, None, gym.noop_score, ours={}),
        "rope_latent": rope,
        "decode_offset_score": lambda: Case(
            dq, L, None, gym.relative_bias_offset(L - dq), args={"offset": L - dq},
            ours=dict(score=scores.from_flex(gym.relative_bias)),
            call={"q_positions": np.broadcast_to(np.arange(dq, dtype=np.int32) + L - dq,
                                                 (batch, dq))}),
    }


#: The case names, in the catalogue's order.
NAMES = tuple(cases(256, 1, 1))


def flex_form(case: Case) -> dict:
    """The module's fields through `from_flex`."""
    fields = {}
    if case.mask_mod is not None:
        fields["mask"] = masks.from_flex(case.mask_mod, None if case.score_params else case.params)
    if case.score_mod is not None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # causal_bias: a mask in disguise, warned of
            fields["score"] = scores.from_flex(case.score_mod,
                                               case.params if case.score_params else None)
    return fields


def pairs(case: Case) -> int:
    """The visible (query, key) pairs of one (batch, head): the built-in form's mask where
    there is one, else the from_flex mask (all pairs where neither has a mask)."""
    mask = (case.ours if case.ours is not None else flex_form(case)).get("mask")
    if mask is None:
        return case.q_len * case.kv_len
    ids = case.call.get("q_segment_ids")
    return visible_pairs(mask, case.q_len, case.kv_len, None if ids is None else ids[0])


class CaseTimeout(Exception):
    pass


def _alarm(seconds: int):
    def handler(signum, frame):
        raise CaseTimeout(f"past --case-timeout {seconds} s")
    signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)


def time_ours(case: Case, args) -> dict:
    """Our kernel's name and median forward / forward+backward milliseconds for `case`."""
    import equinox as eqx

    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (args.batch, args.heads, case.q_len, args.dim), dtype)
    k, v = (jax.random.normal(kk, (args.batch, args.heads, case.kv_len, args.dim), dtype)
            for kk in keys[1:3])
    do = jax.random.normal(keys[3], q.shape, dtype)
    fields = flex_form(case) if args.from_flex or case.ours is None else case.ours
    attn = bsa.BlockSparseAttention(**fields)
    call = {name: jnp.asarray(x) for name, x in case.call.items()}
    kernel = type(attn.plan(q, k, v, **call).kernel).__name__
    leaves, static = eqx.partition(attn, eqx.is_array)

    def attend(leaves, q, k, v, call):
        return eqx.combine(leaves, static)(q, k, v, **call)

    fwd = jax.jit(attend)
    fwdbwd = jax.jit(lambda leaves, q, k, v, call, do: jax.vjp(
        lambda q, k, v: attend(leaves, q, k, v, call), q, k, v)[1](do))
    return {"kernel": kernel, "form": "from_flex" if fields is not case.ours else "built-in",
            "fwd_ms": median_ms(fwd, (leaves, q, k, v, call), args.reps, warmup=2),
            "fwdbwd_ms": median_ms(fwdbwd, (leaves, q, k, v, call, do), args.reps, warmup=2)}


class FlexPeer:
    """`flex_gym_peer.py` in a process of its own, asked for one case at a time (it rebuilds
    the case from the sizes and arrays each request sends); a thread reads its output lines
    into a queue. Restarted after a case that outlives its time."""

    def __init__(self, args, folder: str):
        self.args, self.folder, self.process, self.lines = args, folder, None, None

    def _start(self):
        a = self.args
        command = [sys.executable, str(HERE / "flex_gym_peer.py"), "--batch", str(a.batch),
                   "--heads", str(a.heads), "--dim", str(a.dim), "--dtype", a.dtype,
                   "--reps", str(a.reps), "--case-timeout", str(a.case_timeout)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines = queue.Queue()

        def read(stream, lines):
            for line in stream:
                lines.put(line)
            lines.put(None)  # the peer exited

        threading.Thread(target=read, args=(self.process.stdout, self.lines),
                         daemon=True).start()

    def close(self):
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def time(self, name: str, case: Case) -> dict:
        if self.process is None or self.process.poll() is not None:
            self._start()
        path = os.path.join(self.folder, f"{name}.npz")
        np.savez(path, **case.arrays)
        request = {"name": name, "q_len": case.q_len, "kv_len": case.kv_len,
                   "args": case.args, "arrays": path}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        deadline, tail = time.time() + self.args.case_timeout + 30, []
        while (left := deadline - time.time()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            if line.startswith("RECORD "):
                return json.loads(line[len("RECORD "):])
            tail = (tail + [line.rstrip()])[-3:]
        self.close()
        return {"error": f"flex_gym_peer.py gave no record: {' / '.join(tail)[:200]}"}


def tflops(record: dict, key: str, b: int, h: int, d: int) -> float:
    work = 4 * b * h * d * record["pairs"] * (1.0 if key == "fwd" else 3.5)
    return work / (record[f"{key}_ms"] * 1e-3) / 1e12


def row(r: dict, args) -> str:
    def ms(side, key):
        return f"{r[side][f'{key}_ms']:.2f}" if f"{key}_ms" in r.get(side, {}) else "-"

    def rate(side, key):
        if f"{key}_ms" not in r.get(side, {}):
            return "-"
        work = {**r[side], "pairs": r["pairs"]}
        return f"{tflops(work, key, args.batch, args.heads, args.dim):.3g}"

    ours, flex = r.get("ours", {}), r.get("flex", {})
    ratio = {key: (f"{flex[f'{key}_ms'] / ours[f'{key}_ms']:.2f}"
                   if f"{key}_ms" in ours and f"{key}_ms" in flex else "-")
             for key in ("fwd", "fwdbwd")}
    errors = "; ".join(f"{side}: {r[side]['error']}" for side in ("ours", "flex")
                       if "error" in r.get(side, {}))
    return (f"| {r['case']} | {r['q_len']}x{r['kv_len']} | {r['density']:.3f} | "
            f"{ours.get('kernel', '-')} ({ours.get('form', '-')}) | {ms('ours', 'fwd')} / "
            f"{ms('ours', 'fwdbwd')} | {ms('flex', 'fwd')} / {ms('flex', 'fwdbwd')} | "
            f"{ratio['fwd']} / {ratio['fwdbwd']} | {rate('ours', 'fwd')} / "
            f"{rate('ours', 'fwdbwd')} | {rate('flex', 'fwd')} / {rate('flex', 'fwdbwd')} | "
            f"{errors} |")


def table(records: list[dict], args) -> str:
    lines = ["| case | Lq x Lk | visible | our kernel (form) | ours ms fwd / fwd+bwd | "
             "Flex ms fwd / fwd+bwd | Flex / ours fwd / fwd+bwd | ours TF/s | Flex TF/s | "
             "errors |", "| --- " * 10 + "|"]
    lines += [row(r, args) for r in records]
    ratios = [r["flex"]["fwdbwd_ms"] / r["ours"]["fwdbwd_ms"] for r in records
              if "fwdbwd_ms" in r.get("ours", {}) and "fwdbwd_ms" in r.get("flex", {})]
    if ratios:
        lines.append(f"\nFlex / ours forward+backward: {sum(x >= TARGET for x in ratios)} of "
                     f"{len(ratios)} cases at or above {TARGET}; geometric mean "
                     f"{float(np.exp(np.mean(np.log(ratios)))):.2f}.")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=8192, help="tokens (the cases' scale)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--reps", type=int, default=10, help="timed calls per measurement")
    p.add_argument("--cases", nargs="+", default=list(NAMES), choices=NAMES, metavar="CASE",
                   help=f"default: all ({', '.join(NAMES)})")
    p.add_argument("--from-flex", action="store_true",
                   help="our from_flex form in every case (default: the built-in where one is)")
    p.add_argument("--case-timeout", type=int, default=60, help="seconds per case and side")
    p.add_argument("--budget", type=float, default=300, help="no case starts after this many s")
    p.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peer")
    p.add_argument("--out", default=None, help="write the records to this JSON file")
    return p.parse_args(argv)


def _flex_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def run(args) -> list[dict]:
    start, records = time.time(), []
    builders = cases(args.length, args.batch, args.heads)
    use_flex = not args.no_flex and _flex_available()
    if not args.no_flex and not use_flex:
        print("FlexAttention skipped: torch with CUDA does not import here.", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        peer = FlexPeer(args, folder) if use_flex else None
        try:
            for name in args.cases:
                if time.time() - start > args.budget:
                    print(f"{name}: not run (past --budget {args.budget} s)", flush=True)
                    continue
                record = {"case": name}
                try:
                    case = builders[name]()
                    record.update(q_len=case.q_len, kv_len=case.kv_len, pairs=pairs(case))
                    record["density"] = record["pairs"] / (case.q_len * case.kv_len)
                except Exception as e:  # noqa: BLE001 - a case that fails is a row
                    print(f"{name}: {type(e).__name__}: {e}", flush=True)
                    continue
                if peer is not None:
                    record["flex"] = peer.time(name, case)
                _alarm(args.case_timeout)
                try:
                    record["ours"] = time_ours(case, args)
                except Exception as e:  # noqa: BLE001 - a case that fails is a row
                    record["ours"] = {"error": f"{type(e).__name__}: "
                                               f"{(str(e).splitlines() or [''])[0][:200]}"}
                finally:
                    signal.alarm(0)
                jax.clear_caches()  # the compiled programs of past cases free their memory
                records.append(record)
                print(json.dumps(record), flush=True)
        finally:
            if peer is not None:
                peer.close()
    return records


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.no_flex:
        # JAX and the peer share the GPU: JAX takes half its memory, not the default three
        # quarters (read when JAX first uses the device, which nothing before here does).
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    records = run(args)
    print(f"\nB={args.batch} H={args.heads} D={args.dim} {args.dtype}, scale L={args.length}; "
          f"{jax.devices()[0].device_kind}; median of {args.reps} calls after 2 warm-up calls; "
          "TF/s of the visible pairs (forward+backward: 3.5 times the forward's work)\n")
    print(table(records, args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "environment": environment(), "records": records}, f,
                      indent=1)


if __name__ == "__main__":
    main()
