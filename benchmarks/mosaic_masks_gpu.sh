#!/usr/bin/env bash
# Every GPU test of MosaicBlockSparse on one H200, then its mask benchmark, from the repository
# root, with the wheels of ../shared/tools/gpu-wheels in ./.whl:
#
#   bash benchmarks/mosaic_masks_gpu.sh [workers]
#
# 1. installs the wheels and the project (offline);
# 2. runs the GPU tests of tests/kernels/mosaic and the conformance suite's Mosaic cases, in
#    `workers` pytest processes (default 12) sharing the GPU; compiling is most of each test's
#    time, and it runs on the host's cores ($OUT/tests.log, with every test's outcome);
# 3. times a causal window and a dilated window as built-in masks, Predicates and ArrayMasks,
#    through Mosaic and Triton (benchmarks/mosaic_masks_gpu.py; $OUT/masks.log, masks.json).
# Each stage has a time limit, so the whole run stays under 10 minutes.
set -u
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
workers=${1:-12}
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null 2>&1 || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
start=$SECONDS

# Each process takes GPU memory as it needs it, not the default 75% at its start.
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 330 python3 -m pytest -m gpu --full \
    tests/kernels/mosaic tests/test_conformance.py -k "mosaic or Mosaic or not conformance" \
    -n "$workers" -p no:cacheprovider -rA --durations=10 -q 2>&1 > "$OUT/tests.log"
echo "tests exit status: $? after $((SECONDS - start)) s"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
tail -3 "$OUT/tests.log"

timeout 150 python3 benchmarks/mosaic_masks_gpu.py --reps 10 --rounds 3 --out "$OUT/masks.json" \
    > "$OUT/masks.log" 2>&1
echo "mask benchmark exit status: $? after $((SECONDS - start)) s"
tail -9 "$OUT/masks.log"
