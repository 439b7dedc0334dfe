#!/usr/bin/env bash
# One H200 run, from the repository root, with the wheels of ../shared/tools/gpu-wheels in ./.whl:
#
#   bash benchmarks/mosaic_data_gpu.sh
#
# 1. installs the wheels and the project (offline);
# 2. runs tests/kernels/mosaic/test_mosaic_data_gpu.py: score functions that read arrays (a
#    closure's symmetric-ALiBi slopes, learned slopes in params, an int32 table per head) in
#    MosaicBlockSparse, forward and every gradient against the float64 oracle in both backward
#    modes, and bit-identical gradients over two runs ($OUT/data_tests.log): 9 of 9 on the
#    H200 on 2026-12-06;
# 3. times built-in ALiBi against the same ALiBi as a closure and as params (both planned as
#    built-in ALiBi) and as symmetric ALiBi (evaluated in the kernel) through
#    MosaicBlockSparse (B=2, H=16, L=16384, D=128, bfloat16, causal; fwd and fwd+bwd):
#    $OUT/data_bench.log, data_bench.json.
# The whole run stays under 8 minutes: each stage has a time limit.
set -u
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD
timeout 30 python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null 2>&1 || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
start=$SECONDS

timeout 230 python3 -m pytest -m gpu tests/kernels/mosaic/test_mosaic_data_gpu.py -q \
    -p no:cacheprovider -rf --durations=10 2>&1 | tee "$OUT/data_tests.log" | tail -25
echo "tests exit status: ${PIPESTATUS[0]} after $((SECONDS - start)) s"

left=$((390 - (SECONDS - start)))
timeout $left python3 benchmarks/mosaic_data_gpu.py --length 16384 --batch 2 --heads 16 \
    --dim 128 --reps 10 --rounds 2 --out "$OUT/data_bench.json" > "$OUT/data_bench.log" 2>&1
echo "benchmark exit status: $? after $((SECONDS - start)) s"
tail -8 "$OUT/data_bench.log"
