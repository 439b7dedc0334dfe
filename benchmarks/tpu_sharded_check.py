"""`PallasTpuBlockSparse` compiled under a sharding on a TPU: `ShardMap` on a mesh of the
chip's one device (axes ``b`` and ``h``, both of size 1), causal, with ALiBi's learned slopes,
ALiBi written as a `ScoreFunction` that closes over its slopes (differentiated through the
closure), and the T5 table; `RingAttention` and `AllToAll` on the same device with ALiBi. Each
call's output and gradients (q, k, v and the score array) against the unsharded call of the
same kernel and against `XlaBlockSparse` (for the closure: `ALiBi` with the same slopes);
prints each one's relative error in norm and largest absolute error, and PASS or FAIL.
A `ScoreFunction` with `params`: PASS where the kernel declines it by name and the selector
runs another kernel. Exit status 1 if any check fails.

On the TPU machine (Python 3.11, JAX installed, no registry), from the repository root with
the wheels of benchmarks/tpu_run.sh's header in ``.whl-tpu``:

    python3 benchmarks/tpu_sharded_check.py 2>&1 | tee tpu_sharded_check.log

It installs those wheels itself where equinox is missing (offline, into $SITE, default
$TMPDIR/site, after the machine's JAX on the path) and links the package's strategies folder,
as benchmarks/tpu_run.sh does. Off a TPU it runs interpreted (``--length 256`` keeps that
short); its probe lines (PROBE) say whether a path that has not run on a TPU compiles there,
and do not set the exit status.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bootstrap():
    """Make `eqx_bsattn` importable on a machine with JAX alone (benchmarks/tpu_run.sh's
    steps): the wheels of ``.whl-tpu`` installed into $SITE, appended to ``sys.path`` (the
    machine's JAX stays first), the repository on the path, its strategies folder linked
    into the package (an install maps it; a checkout needs the link)."""
    sys.path.insert(0, str(ROOT))
    try:
        import equinox  # noqa: F401
    except ImportError:
        site = os.environ.get("SITE") or os.path.join(tempfile.gettempdir(), "site")
        wheels = sorted(str(p) for p in (ROOT / ".whl-tpu").glob("*.whl"))
        if not wheels:
            sys.exit("equinox is missing and .whl-tpu holds no wheels: see "
                     "benchmarks/tpu_run.sh's header for how to fetch them.")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--no-cache-dir", "--upgrade", "--target", site,
                        *wheels], check=True)
        sys.path.append(site)
    try:
        import eqx_bsattn.strategies  # noqa: F401  (an install maps the folder)
    except ImportError:
        (ROOT / "eqx_bsattn" / "strategies").symlink_to(Path("..") / "strategies")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--dim", type=int, default=128)
    return p.parse_args(argv)


#: Relative errors in norm, float32 at the highest matmul precision: the same kernel sharded
#: and not (one device: the same programs); against XlaBlockSparse (on a v5e the kernels' exp
#: agrees with float64 to four or five digits; the slopes' gradient, a sum whose terms
#: cancel, measured 5.1e-4 against float64 there, docs/splash.md).
TOL_SAME = 1e-5
TOL_XLA = 2e-4
TOL_XLA_ARRAY = 2e-3


def main(argv=None) -> int:
    args = parse_args(argv)
    bootstrap()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType

    import eqx_bsattn as bsa
    from eqx_bsattn import kernels, masks, scores, sharding

    on_tpu = jax.default_backend() == "tpu"
    print(jax.__version__, jax.devices(), "" if on_tpu else "(interpreted: not a TPU)",
          flush=True)
    device = jax.devices()[:1]
    mesh2 = jax.make_mesh((1, 1), ("b", "h"), axis_types=(AxisType.Auto,) * 2, devices=device)
    mesh1 = jax.make_mesh((1,), ("s",), axis_types=(AxisType.Auto,), devices=device)
    b, h, hkv, length, d = args.batch, args.heads, args.kv_heads, args.length, args.dim
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (b, h, length, d), jnp.float32)
    k = jax.random.normal(keys[1], (b, hkv, length, d), jnp.float32)
    v = jax.random.normal(keys[2], (b, hkv, length, d), jnp.float32)
    cot = jax.random.normal(keys[3], (b, h, length, d), jnp.float32)
    slopes = jax.random.uniform(keys[4], (h,), jnp.float32, -0.3, 0.3)
    table = 0.5 * jax.random.normal(keys[5], (h, 32), jnp.float32)
    pallas = kernels.PallasTpuBlockSparse(interpret=False if on_tpu else None)
    xla = kernels.XlaBlockSparse()

    def closure_alibi(slopes):
        return lambda score, head, q_pos, k_pos: score + slopes[head] * (k_pos - q_pos)

    scored = {
        "alibi": (lambda x: scores.ALiBi(x, learned=True), slopes),
        "closure_alibi": (lambda x: scores.ScoreFunction(closure_alibi(x)), slopes),
        "t5_table": (lambda x: scores.RelativePositionBias(x), table),
    }

    def run(kernel, score_of, array, shard=None):
        """Output and the gradients of ``vdot(out, cot)`` in q, k, v and the score array."""
        def loss(q, k, v, array):
            attn = bsa.BlockSparseAttention(
                mask=masks.Causal(), score=score_of(array), kernel=kernel,
                **({} if shard is None else {"sharding": shard}))
            out = attn(q, k, v)
            return jnp.vdot(out, cot), out

        with jax.default_matmul_precision("highest"):
            grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
                q, k, v, array)
        return [np.asarray(x, np.float64) for x in (out, *grads)]

    def errors(got, want):
        rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
        return float(rel), float(np.max(np.abs(got - want)))

    names = ("out", "dq", "dk", "dv", "d_array")
    failed = []

    def compare(label, got, want, tol, tol_array):
        ok = True
        for name, g, w in zip(names, got, want):
            rel, worst = errors(g, w)
            limit = tol_array if name == "d_array" else tol
            good = bool(np.isfinite(g).all()) and rel <= limit
            ok &= good
            print(f"  {label:28s} {name:8s} rel {rel:.2e}  max abs {worst:.2e}  "
                  f"(<= {limit:.0e}) {'PASS' if good else 'FAIL'}", flush=True)
        return ok

    def check(label, body):
        print(label, flush=True)
        try:
            ok = body()
        except Exception as e:  # noqa: BLE001 - a check that raises fails, with its reason
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(f"  FAIL: {type(e).__name__}: {first}", flush=True)
            traceback.print_exc(limit=-3)
            ok = False
        print(f"{label}: {'PASS' if ok else 'FAIL'}", flush=True)
        if not ok:
            failed.append(label)

    shardings = {
        "ShardMap(b, h), 1 device": lambda: sharding.ShardMap(mesh2, "b", "h"),
        "RingAttention, 1 device": lambda: sharding.RingAttention(mesh1, "s"),
        "AllToAll, 1 device": lambda: sharding.AllToAll(mesh1, "s"),
    }
    for shard_name, make in shardings.items():
        for score_name, (score_of, array) in scored.items():
            if shard_name != "ShardMap(b, h), 1 device" and score_name != "alibi":
                continue
            if score_name == "closure_alibi" and shard_name.startswith("Ring"):
                continue  # declined inside the ring's loop (a traced closure)

            def body(make=make, score_of=score_of, array=array, score_name=score_name):
                plan = bsa.BlockSparseAttention(mask=masks.Causal(), score=score_of(array),
                                                sharding=make()).plan(
                    q, k, v, platform="tpu")
                picked = plan.kernel.name == "pallas_tpu"
                print(f"  the selector picks {plan.kernel.name} "
                      f"{'PASS' if picked else 'FAIL (want pallas_tpu)'}", flush=True)
                sharded = run(pallas, score_of, array, make())
                ok = compare("sharded vs unsharded", sharded, run(pallas, score_of, array),
                             TOL_SAME, TOL_SAME)
                # XlaBlockSparse cannot differentiate a closure: ALiBi is the same score.
                reference = scored["alibi"][0] if score_name == "closure_alibi" else score_of
                return picked & ok & compare("sharded vs XlaBlockSparse", sharded,
                                             run(xla, reference, array), TOL_XLA,
                                             TOL_XLA_ARRAY)

            check(f"{shard_name}, {score_name}", body)

    def params_declined():
        score = scores.ScoreFunction(
            lambda s, hh, qp, kp, p: s + p["slopes"][hh] * (kp - qp), {"slopes": slopes})
        plan = bsa.BlockSparseAttention(mask=masks.Causal(), score=score,
                                        sharding=sharding.ShardMap(mesh2, "b", "h")).plan(
            q, k, v, platform="tpu")
        why = dict(plan.choice.declined).get("pallas_tpu")
        print(f"  runs on {plan.kernel.name}; pallas_tpu declined: {why}", flush=True)
        return plan.kernel.name != "pallas_tpu" and why is not None

    check("ShardMap(b, h), 1 device, a ScoreFunction with params", params_declined)

    # Probes: paths that lower for a v5e on the CPU but have not run on a TPU.
    def probe(label, fn):
        try:
            run(pallas, lambda x: scores.ScoreFunction(fn(x)), slopes,
                sharding.ShardMap(mesh2, "b", "h"))
            print(f"PROBE {label}: compiles and runs", flush=True)
        except Exception as e:  # noqa: BLE001
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(f"PROBE {label}: failed: {type(e).__name__}: {first}", flush=True)

    probe("a scalar exp of a closed-over slope (exp(log_slopes[head]))",
          lambda x: lambda s, hh, qp, kp: s + jnp.exp(x[hh]) * (kp - qp))

    print("FAILED: " + ", ".join(failed) if failed else "ALL PASS", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
