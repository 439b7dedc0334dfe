#!/usr/bin/env bash
# Masks without in-kernel terms in MosaicBlockSparse on one H200, from the repository root,
# with the wheels of ../shared/tools/gpu-wheels in ./.whl:
#
#   bash benchmarks/mosaic_masks_gpu.sh
#
# 1. installs the wheels and the project (offline);
# 2. runs the GPU tests of tests/kernels/mosaic: the masks' (predicates, element maps) and the
#    declines first ($OUT/tests_new.log), then the rest ($OUT/tests_rest.log);
# 3. times a causal window and a dilated window as built-in masks, Predicates and ArrayMasks,
#    through Mosaic and Triton (benchmarks/mosaic_masks_gpu.py; $OUT/masks.log, masks.json);
# 4. times three attention-gym cases that only a Predicate expresses against FlexAttention
#    (benchmarks/gym_gpu.py; $OUT/gym.log, gym.json).
# Each stage has a time limit, so the whole run stays under 10 minutes.
set -u
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null 2>&1 || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

NEW="predicate or dilated or not_window or array or declines or bit_identical"
timeout 150 python3 -m pytest -m gpu tests/kernels/mosaic/test_mosaic_gpu.py -q -p no:cacheprovider \
    -k "$NEW" 2>&1 | tee "$OUT/tests_new.log" | tail -12
timeout 110 python3 -m pytest -m gpu tests/kernels/mosaic/test_mosaic_gpu.py -q -p no:cacheprovider \
    -k "not ($NEW)" 2>&1 | tee "$OUT/tests_rest.log" | tail -6

timeout 150 python3 benchmarks/mosaic_masks_gpu.py --reps 10 --rounds 3 --out "$OUT/masks.json" \
    > "$OUT/masks.log" 2>&1
echo "mask benchmark exit status: $?"
tail -9 "$OUT/masks.log"

timeout 120 python3 benchmarks/gym_gpu.py --length 8192 --batch 2 --heads 16 --reps 10 \
    --case-timeout 50 --budget 80 --out "$OUT/gym.json" --cases natten sta_2d svg_temporal \
    > "$OUT/gym.log" 2>&1
echo "gym benchmark exit status: $?"
grep -v '^{' "$OUT/gym.log" | grep -v "^\s*$" | tail -8
