#!/usr/bin/env bash
# PallasTpuBlockSparse on a TPU v5e chip: its tests compiled on the chip (float32 compared
# at the highest matmul precision), then forward and forward+backward times beside
# SplashBlockSparse (B=1, H=16, L=8192 then 32768, D=128, bfloat16: causal, window 1024, 16
# documents, a window and a dilated window written as Predicates) and with ALiBi, a 32-bucket
# T5 table and ALiBi as a ScoreFunction; a short table after each length (32768 only when
# the rest took under 5.5 minutes).
#
# Run from the repository root with the folder .whl-tpu (equinox, jaxtyping, beartype,
# wadler_lindig, platformdirs, tqdm, typing_extensions for Python 3.11) beside it:
#   bash benchmarks/tpu_run.sh            # extra arguments go to benchmarks/splash_tpu.py
# Fetch the wheels on a machine with a registry (the TPU machine has none):
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl-tpu equinox==0.13.8 jaxtyping==0.3.11 beartype==0.23.1 wadler_lindig==0.1.8 \
#     platformdirs==4.14.9 tqdm==4.70.1 typing_extensions==4.16.0
# It installs those wheels only (offline, into $TMPDIR/site, appended to PYTHONPATH so the
# machine's JAX stays first), and runs everything in one process (one program at a time
# can hold the chip). Logs go to $OUT (default ./tpu_out).
# benchmarks/tpu_long.py (the first jit(grad) call's time at L=8192; memory and fit at 16k to
# 128k tokens) is not run here; after the same setup (SITE a folder), in a process of its own:
#   python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl-tpu/*.whl
#   [ -e eqx_bsattn/strategies ] || ln -s ../strategies eqx_bsattn/strategies
#   PYTHONPATH=$SITE:$PWD python3 benchmarks/tpu_long.py 2>&1 | tee $OUT/tpu_long.log
set -u
source benchmarks/tpu_setup.sh
python3 - "$@" 2>&1 <<'PY' | tee "$OUT/tpu_run.log"
import runpy
import sys
import time

import jax
import pytest

start = time.time()
print(jax.__version__, jax.devices(), flush=True)
rc = pytest.main(["-p", "no:xdist", "-p", "no:cacheprovider", "-q", "--extended",
                  "tests/kernels/pallas_tpu"])
print(f"tests: exit code {int(rc)} after {time.time() - start:.0f} s", flush=True)
for extra in (["--reps", "10"], ["--length", "32768", "--reps", "5"]):
    if extra[0] == "--length" and time.time() - start > 330:
        # The whole run stays within about 8 minutes: 32k takes about two of them.
        print(f"32768 skipped: {time.time() - start:.0f} s spent", flush=True)
        continue
    sys.argv = ["splash_tpu.py", "--skip-errors", "--skip-splash", "--pallas", *extra,
                *sys.argv[1:]]
    runpy.run_path("benchmarks/splash_tpu.py", run_name="__main__")
print(f"total {time.time() - start:.0f} s", flush=True)
PY
