#!/usr/bin/env bash
# Every GPU test of MosaicBlockSparse on one H200, then its timings, from the repository root,
# with the wheels of ../shared/tools/gpu-wheels in ./.whl:
#
#   bash benchmarks/mosaic_masks_gpu.sh [workers] [seconds]
#
# 1. installs the wheels and the project (offline);
# 2. runs the GPU tests of tests/kernels/mosaic and the conformance suite's Mosaic cases, in
#    `workers` pytest processes (default 12) sharing the GPU; compiling is most of each test's
#    time, and it runs on the host's cores ($OUT/tests.log, with every test's outcome);
# 3. times, each stage within what is left of `seconds` (default 520) after the install:
#    - a learned T5 table against no term, causal, through Mosaic and Triton
#      (benchmarks/score_terms_gpu.py; $OUT/table_bench.log, table_bench.json);
#    - ALiBi as built-in slopes, as hand-written functions (which plan as built-in ALiBi) and
#      as symmetric ALiBi (a function evaluated in the kernel), fixed and learned, causal,
#      through Mosaic (benchmarks/mosaic_data_gpu.py; $OUT/data_bench.log, data_bench.json);
#    - a [1, H, L, L] bias, constant and learned, against none, through Mosaic
#      (benchmarks/mosaic_bias_gpu.py; $OUT/bias_bench.log, bias_bench.json);
#    - a causal window and a dilated window as built-in masks, Predicates and ArrayMasks,
#      through Mosaic and Triton (benchmarks/mosaic_masks_gpu.py; $OUT/masks.log, masks.json).
# All at B=2, H=16, L=16384, D=128, bfloat16, in one process each.
set -u
workers=${1:-12}
source benchmarks/gpu_setup.sh "${2:-520}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

# Each process takes GPU memory as it needs it, not the default 75% at its start.
# (the features awaiting a GPU run have their own: benchmarks/device_proofs.sh)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$(left 300)" python3 -m pytest -m gpu --extended \
    tests/kernels/mosaic tests/test_conformance.py -k "mosaic or Mosaic or not conformance" \
    --ignore tests/kernels/mosaic/test_mosaic_head_dim_256.py \
    --ignore tests/kernels/mosaic/test_mosaic_padded_head_dims.py \
    -n "$workers" -p no:cacheprovider -rA --durations=10 -q > "$OUT/tests.log" 2>&1
echo "tests exit status: $? after $((SECONDS - start)) s"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
tail -3 "$OUT/tests.log"

timeout "$(left 100)" python3 benchmarks/score_terms_gpu.py \
    --kernel MosaicBlockSparse TritonBlockSparse --masks causal --scores none relative \
    --no-flex --reps 10 --rounds 2 --out "$OUT/table_bench.json" > "$OUT/table_bench.log" 2>&1
echo "table benchmark exit status: $? after $((SECONDS - start)) s"
tail -8 "$OUT/table_bench.log"

timeout "$(left 100)" python3 benchmarks/mosaic_data_gpu.py --reps 10 --rounds 2 \
    --out "$OUT/data_bench.json" > "$OUT/data_bench.log" 2>&1
echo "data benchmark exit status: $? after $((SECONDS - start)) s"
tail -8 "$OUT/data_bench.log"

timeout "$(left 90)" python3 benchmarks/mosaic_bias_gpu.py --reps 10 --rounds 2 \
    --kernels MosaicBlockSparse --out "$OUT/bias_bench.json" > "$OUT/bias_bench.log" 2>&1
echo "bias benchmark exit status: $? after $((SECONDS - start)) s"
tail -6 "$OUT/bias_bench.log"

timeout "$(left 150)" python3 benchmarks/mosaic_masks_gpu.py --reps 10 --rounds 2 \
    --out "$OUT/masks.json" > "$OUT/masks.log" 2>&1
echo "mask benchmark exit status: $? after $((SECONDS - start)) s"
tail -9 "$OUT/masks.log"
