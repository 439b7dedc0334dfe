"""A small transformer on a CPU: `MultiheadBlockSparseAttention` against `eqx.nn.MultiheadAttention`.

The model is the training notebook's, with two blocks: token embedding, two pre-norm blocks
(attention and an MLP), a norm and a linear head; ``SIZE = 32`` channels, ``HEADS = 2``,
``BATCH = 8`` sequences, no rotary embedding (eqx.nn has none), trained by Adam. The only
difference between the two models is the attention layer: ours holds the mask as a strategy,
eqx.nn's gets the same mask as a boolean ``[L, L]`` array per call.

For each mask and length, in a fresh process per model (so neither reuses the other's caches):

- ``first``: the first training step, trace + lower + compile + run (what `eqx.filter_jit`
  does on a first call), and each stage apart (`jax.stages`: ``trace``, ``lower``,
  ``compile``);
- ``step``: the median of the next ``--steps`` steps;
- ``swap`` (ours only): the first step after ``swap_strategy`` replaces the mask (each mask
  gains a sliding window of 32: a new static mask, so a retrace), again by stage.

Masks: ``causal`` (``Causal()``), ``window`` (``Causal() & SlidingWindow(16, 0)``),
``documents`` (``Causal() & Document()``, documents of random lengths about L / 8, passed as
segment ids).

Run from the repository root::

    python benchmarks/cpu_small_model.py                      # every length and mask
    python benchmarks/cpu_small_model.py --lengths 128 --masks causal --profile 25
    python benchmarks/cpu_small_model.py --repeat 3    # each time the least of three runs

``--profile N`` prints the N most expensive functions (cumulative) of our model's trace, from
cProfile. Not a test: numbers depend on the machine and its load; compare ratios within a run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZE, HEADS, BATCH, VOCAB, DEPTH = 32, 2, 8, 24, 2
MASKS = ("causal", "window", "documents")
LENGTHS = (64, 128, 256, 512, 1024, 2048)


def _segments(key, length: int):
    """``[BATCH, L]`` ids of documents of random lengths (mean about L / 8)."""
    import jax
    import jax.numpy as jnp

    starts = jax.random.bernoulli(key, 8 / length, (BATCH, length)).at[:, 0].set(True)
    return jnp.cumsum(starts, axis=1).astype(jnp.int32) - 1


def _our_mask(name: str, swapped: bool = False):
    from eqx_bsattn import masks

    base = {"causal": masks.Causal(), "window": masks.Causal() & masks.SlidingWindow(16, 0),
            "documents": masks.Causal() & masks.Document()}[name]
    return base & masks.SlidingWindow(32, 0) if swapped else base


def _dense_mask(name: str, length: int, segments):
    """eqx.nn's boolean ``[L, L]`` mask for one sequence (`segments` ``[L]`` or None)."""
    import jax.numpy as jnp

    i = jnp.arange(length)
    visible = i[None, :] <= i[:, None]
    if name == "window":
        visible &= i[None, :] >= i[:, None] - 16
    if name == "documents":
        visible &= segments[:, None] == segments[None, :]
    return visible


def build(impl: str, mask: str, length: int):
    """``(model, opt, step_fn, batch)``: ``step_fn(params, opt_state, *batch)`` with the model's
    static part closed over, for `jax.jit`."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_bsattn as bsa

    class Block(eqx.Module):
        norm1: eqx.nn.LayerNorm
        attention: eqx.Module
        norm2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            ka, km = jax.random.split(key)
            self.norm1 = eqx.nn.LayerNorm(SIZE)
            if impl != "eqx.nn":
                kernel = {"ours": None, "ours-dense": bsa.kernels.DenseReference(),
                          "ours-xla": bsa.kernels.XlaBlockSparse()}[impl]
                self.attention = bsa.MultiheadBlockSparseAttention(
                    HEADS, SIZE, mask=_our_mask(mask), kernel=kernel, key=ka)
            else:
                self.attention = eqx.nn.MultiheadAttention(HEADS, SIZE, key=ka)
            self.norm2 = eqx.nn.LayerNorm(SIZE)
            self.mlp = eqx.nn.MLP(SIZE, SIZE, 4 * SIZE, depth=1, activation=jax.nn.gelu, key=km)

        def __call__(self, x, segments):
            h = jax.vmap(self.norm1)(x)
            if impl != "eqx.nn":
                ids = {} if segments is None else dict(q_segment_ids=segments,
                                                       kv_segment_ids=segments)
                x = x + self.attention(h, h, h, **ids)
            else:
                x = x + self.attention(h, h, h, mask=_dense_mask(mask, length, segments))
            return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))

    class Model(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: tuple
        norm: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            ke, kh, *kb = jax.random.split(key, 2 + DEPTH)
            self.embed = eqx.nn.Embedding(VOCAB, SIZE, key=ke)
            self.blocks = tuple(Block(k) for k in kb)
            self.norm = eqx.nn.LayerNorm(SIZE)
            self.head = eqx.nn.Linear(SIZE, VOCAB, key=kh)

        def __call__(self, tokens, segments):
            x = jax.vmap(self.embed)(tokens)
            for block in self.blocks:
                x = block(x, segments)
            return jax.vmap(self.head)(jax.vmap(self.norm)(x))

    model = Model(jax.random.key(0))
    opt = optax.adam(1e-3)
    kt, ks = jax.random.split(jax.random.key(1))
    tokens = jax.random.randint(kt, (BATCH, length), 0, VOCAB)
    segments = _segments(ks, length) if mask == "documents" else None

    def make_step(static):
        def step(params, opt_state, tokens, segments):
            def loss_fn(params):
                m = eqx.combine(params, static)
                logits = jax.vmap(m)(tokens, segments)[:, :-1]
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits, tokens[:, 1:]).mean()

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return step

    return model, opt, make_step, (tokens, segments)


def _stages(make_step, model, opt_state, batch, profile: int = 0) -> tuple[dict, object]:
    """Trace, lower, compile and one run of a fresh `jax.jit` of the step, each timed."""
    import equinox as eqx
    import jax

    params, static = eqx.partition(model, eqx.is_array)
    fn = jax.jit(make_step(static))
    times = {}
    t0 = time.perf_counter()
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
    traced = fn.trace(params, opt_state, *batch)
    if profile:
        prof.disable()
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    out = compiled(params, opt_state, *batch)
    jax.block_until_ready(out)
    t4 = time.perf_counter()
    times.update(trace=t1 - t0, lower=t2 - t1, compile=t3 - t2, run=t4 - t3, first=t4 - t0)
    text = lowered.as_text()
    times["hlo_lines"] = text.count("\n")
    if profile:
        stats = pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative")
        stats.print_stats(profile)
    return times, (compiled, params)


def worker(impl: str, mask: str, length: int, steps: int, profile: int) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import eqx_bsattn as bsa

    jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.ones(3)))  # the backend's one-off start
    model, opt, make_step, batch = build(impl, mask, length)
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    first, (compiled, params) = _stages(make_step, model, opt_state, batch, profile)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, *batch)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t)
    result = dict(impl=impl, mask=mask, length=length, first=first,
                  step_ms=1e3 * statistics.median(times))
    if impl != "eqx.nn":
        model = eqx.combine(params, eqx.partition(model, eqx.is_array)[1])
        where = lambda m: tuple(b.attention.attention.mask for b in m.blocks)  # noqa: E731
        new = tuple(_our_mask(mask, swapped=True) for _ in range(DEPTH))
        model, opt_state = bsa.swap_strategy(where, model, new, opt_state)
        result["swap"], _ = _stages(make_step, model, opt_state, batch,
                                    profile if profile < 0 else 0)
        layer = model.blocks[0].attention.attention
        heads = jnp.zeros((HEADS, length, SIZE // HEADS))
        ids = {} if batch[1] is None else dict(q_segment_ids=batch[1][0],
                                               kv_segment_ids=batch[1][0])
        result["kernel"] = layer.plan(heads, heads, heads, **ids).kernel.name
    return result


def _run(impl, mask, length, steps, profile) -> dict:
    command = [sys.executable, __file__, "--worker", impl, mask, str(length),
               "--steps", str(steps), "--profile", str(profile)]
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"{impl} {mask} L={length} failed")
    if done.stderr and profile:
        sys.stderr.write(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _least(runs: list[dict]) -> dict:
    """Each time's least over repeated runs of one model: on a shared machine, the figure
    least disturbed by the load (each stage's least apart, so ``first`` may exceed their sum)."""
    best = dict(runs[0])
    for key in ("first", "swap"):
        if key in best:
            best[key] = {k: min(r[key][k] for r in runs) for k in best[key]}
    best["step_ms"] = min(r["step_ms"] for r in runs)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--masks", nargs="+", default=MASKS, choices=MASKS)
    parser.add_argument("--impls", nargs="+", default=("ours", "eqx.nn"),
                        choices=("ours", "eqx.nn", "ours-dense", "ours-xla"),
                        help="ours-dense / ours-xla: our layer with DenseReference / "
                        "XlaBlockSparse named (ours: the kernel the selector picks)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each model this many times, interleaved; report each "
                        "time's least (a loaded machine)")
    parser.add_argument("--profile", type=int, default=0,
                        help="print the N costliest functions of our first trace (cProfile)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, mask, length = args.worker
        print(json.dumps(worker(impl, mask, int(length), args.steps, args.profile)))
        return

    import jax

    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, jax {jax.__version__}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; B={BATCH}, H={HEADS}, "
          f"C={SIZE}, {DEPTH} blocks, Adam; times in s, step in ms; least of {args.repeat} "
          "run(s)")
    header = (f"{'mask':<10}{'L':>6}  {'impl':<11}{'kernel':<10}{'first':>7}{'trace':>7}"
              f"{'lower':>7}{'compile':>8}{'step ms':>9}{'swap':>7}{'hlo':>7}")
    print(header)
    results = []
    for mask in args.masks:
        for length in args.lengths:
            runs = {impl: [] for impl in args.impls}
            for rep in range(args.repeat):  # interleaved, each order in turn
                for impl in (args.impls if rep % 2 == 0 else args.impls[::-1]):
                    runs[impl].append(_run(impl, mask, length, args.steps,
                                           args.profile if impl == "ours" and not rep else 0))
            rows = {impl: _least(runs[impl]) for impl in args.impls}
            for impl, r in rows.items():
                f = r["first"]
                swap = f"{r['swap']['first']:7.2f}" if "swap" in r else f"{'':>7}"
                print(f"{mask:<10}{length:>6}  {impl:<11}{r.get('kernel', ''):<10.10}"
                      f"{f['first']:7.2f}{f['trace']:7.2f}{f['lower']:7.2f}{f['compile']:8.2f}"
                      f"{r['step_ms']:9.1f}{swap}{f['hlo_lines']:7d}", flush=True)
            if "ours" in rows and "eqx.nn" in rows:
                ours, ref = rows["ours"], rows["eqx.nn"]
                print(f"{'':<16}ratio ours / eqx.nn: first "
                      f"{ours['first']['first'] / ref['first']['first']:.2f}, step "
                      f"{ours['step_ms'] / ref['step_ms']:.2f}, swap / eqx.nn first "
                      f"{ours['swap']['first'] / ref['first']['first']:.2f}", flush=True)
            results.extend(rows.values())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
