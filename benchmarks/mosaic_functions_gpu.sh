#!/usr/bin/env bash
# Score functions in MosaicBlockSparse on one H200, from the repository root, with the
# wheels of ../shared/tools/gpu-wheels in ./.whl:
#
#   bash benchmarks/mosaic_functions_gpu.sh
#
# 1. installs the wheels and the project (offline);
# 2. runs the GPU tests of tests/kernels/mosaic (log: $OUT/tests.log);
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

timeout 240 python3 -m pytest -m gpu tests/kernels/mosaic -x -q -p no:cacheprovider \
    2>&1 | tee "$OUT/tests.log" | tail -25

timeout 180 python3 benchmarks/score_terms_gpu.py --kernel MosaicBlockSparse --no-flex \
    --scores none alibi function positions --reps 10 --rounds 2 --device-times \
    --out "$OUT/score_terms.json" > "$OUT/bench.log" 2>&1
echo "benchmark exit status: $?"
grep -E "^\| (impl|ours)" "$OUT/bench.log" | grep -v "| fwd |\|| fwdbwd |" | head -20
sed -n '/^Device-time ratios/,$p' "$OUT/bench.log"
