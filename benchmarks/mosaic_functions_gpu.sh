#!/usr/bin/env bash
# Score functions in MosaicBlockSparse on one H200, from the repository root, with the
# wheels of ../shared/tools/gpu-wheels in ./.whl:
#
#   bash benchmarks/mosaic_functions_gpu.sh
#
# 1. installs the wheels and the project (offline);
# 2. runs the GPU tests of tests/kernels/mosaic: the score functions', per-call positions' and
#    declines' first (log: $OUT/tests.log), the rest after the timing, in the time left
#    ($OUT/tests_rest.log);
# 3. times B=2, H=16, L=16384, D=128, bfloat16, causal and causal + window 1024: no score,
#    built-in ALiBi, ALiBi written as a score function and per-call positions, forward and
#    forward+backward, wall and device times (benchmarks/score_terms_gpu.py; log
#    $OUT/bench.log, records $OUT/score_terms.json);
# 4. prints the device-time ratios last.
# Each stage has a time limit, so the whole run stays under 8 minutes.
set -u
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

# The new tests first, then the timing, then the rest of the GPU tests in the time left.
NEW="score_function or positions or declines"
timeout 190 python3 -m pytest -m gpu tests/kernels/mosaic -x -q -p no:cacheprovider -k "$NEW" \
    2>&1 | tee "$OUT/tests.log" | tail -25

timeout 170 python3 benchmarks/score_terms_gpu.py --kernel MosaicBlockSparse --no-flex \
    --scores none alibi function positions --reps 10 --rounds 2 --device-times \
    --out "$OUT/score_terms.json" > "$OUT/bench.log" 2>&1
echo "benchmark exit status: $?"

timeout 60 python3 -m pytest -m gpu tests/kernels/mosaic -x -q -p no:cacheprovider \
    -k "not ($NEW)" 2>&1 | tee "$OUT/tests_rest.log" | tail -5

grep -E "^\| (impl|ours)" "$OUT/bench.log" | grep -v "| fwd |\|| fwdbwd |" | head -20
sed -n '/^Device-time ratios/,$p' "$OUT/bench.log"
