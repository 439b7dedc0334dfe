#!/usr/bin/env bash
# One H200 run, from the repository root, with the wheels of ../shared/tools/gpu-wheels in ./.whl:
#
#   bash benchmarks/mosaic_bias_gpu.sh [seconds]
#
# 1. installs the wheels and the project (offline);
# 2. runs tests/kernels/mosaic/test_mosaic_bias_gpu.py: a bias in MosaicBlockSparse, forward
#    and every gradient (the bias's too) against the float64 oracle, bit-identical gradients
#    over two runs, a constant bias and the single-pass mode ($OUT/bias_tests.log);
# 3. where they pass (5 of 5 on the H200 on 2026-12-06), times a [1, H, L, L] bias, constant
#    and learned, against no bias through MosaicBlockSparse and TritonBlockSparse (B=2, H=16, L=16384, D=128, bfloat16, causal;
#    fwd and fwd+bwd): $OUT/bias_bench.log, bias_bench.json.
# The whole run stays within `seconds` (default 330) after the install.
set -u
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
budget=${1:-330}
timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD
timeout 30 python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null 2>&1 || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
start=$SECONDS

timeout 170 python3 -m pytest -m gpu tests/kernels/mosaic/test_mosaic_bias_gpu.py -q \
    -p no:cacheprovider -rf --durations=6 2>&1 | tee "$OUT/bias_tests.log" | tail -20
status=${PIPESTATUS[0]}
echo "tests exit status: $status after $((SECONDS - start)) s"
[ "$status" -eq 0 ] || exit 1

left=$((budget - (SECONDS - start)))
timeout $left python3 benchmarks/mosaic_bias_gpu.py --length 16384 --batch 2 --heads 16 \
    --reps 10 --rounds 2 --kernels MosaicBlockSparse TritonBlockSparse \
    --out "$OUT/bias_bench.json" > "$OUT/bias_bench.log" 2>&1
echo "bias benchmark exit status: $? after $((SECONDS - start)) s"
tail -9 "$OUT/bias_bench.log"
