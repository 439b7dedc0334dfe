#!/usr/bin/env bash
# One H200 run for a T5 table in MosaicBlockSparse, from the repository root, with the wheels
# of ../shared/tools/gpu-wheels in ./.whl:
#
#   bash benchmarks/mosaic_table_gpu.sh
#
# 1. installs the wheels and the project (offline);
# 2. runs tests/kernels/mosaic/test_mosaic_table_gpu.py: forward and every gradient (the
#    table's too) against the float64 oracle, bit-identical gradients over two runs, a
#    constant table and the single-pass mode ($OUT/table_tests.log);
# 3. where they pass, times a causal call with no term, a learned T5 table, and the table
#    with learned ALiBi slopes, through MosaicBlockSparse and TritonBlockSparse (B=2, H=16,
#    L=16384, D=128, bfloat16; fwd and fwd+bwd; benchmarks/score_terms_gpu.py:
#    $OUT/table_bench.log, table_bench.json).
# Each stage has a time limit, so the whole run stays under 10 minutes.
set -u
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null 2>&1 || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
start=$SECONDS

XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -m gpu \
    tests/kernels/mosaic/test_mosaic_table_gpu.py -n 5 -q -p no:cacheprovider -rA \
    --durations=6 > "$OUT/table_tests.log" 2>&1
status=$?
echo "tests exit status: $status after $((SECONDS - start)) s"
grep -E "^(PASSED|FAILED|ERROR)" "$OUT/table_tests.log"
tail -3 "$OUT/table_tests.log"
[ "$status" -eq 0 ] || exit 1

timeout 280 python3 benchmarks/score_terms_gpu.py --kernel MosaicBlockSparse TritonBlockSparse \
    --masks causal --scores none relative both --no-flex --reps 10 --rounds 2 \
    --out "$OUT/table_bench.json" > "$OUT/table_bench.log" 2>&1
echo "table benchmark exit status: $? after $((SECONDS - start)) s"
tail -14 "$OUT/table_bench.log"
