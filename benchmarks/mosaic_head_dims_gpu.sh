#!/usr/bin/env bash
# MosaicBlockSparse at head dim 256 and at the head dims it zero-pads (Dv != D, D outside
# 64 / 128 / 256) on one H200, from the repository root, with the wheels of
# ../shared/tools/gpu-wheels in ./.whl and `_HEAD_DIM_256_RUN_ON_GPU` and
# `_PADDED_HEAD_DIMS_RUN_ON_GPU` set to True in strategies/kernels/mosaic/kernel.py (they are
# False until this has passed once; the GPU tests switch them on themselves), and
# `_WIDE_HEADS_RUN_ON_GPU` in strategies/kernels/cudnn.py for the cuDNN column at 256:
#
#   bash benchmarks/mosaic_head_dims_gpu.sh [seconds]
#
# 1. installs the wheels and the project (offline);
# 2. runs the GPU tests of tests/kernels/mosaic/test_mosaic_head_dim_256.py (causal with
#    grouped heads, learned ALiBi in a window, documents, a predicate with a learned score
#    function, an ArrayMask with a bias) and test_mosaic_padded_head_dims.py (64 / 128,
#    128 / 64, 96 / 96, 80 / 96), every gradient against the float32 reference, and the
#    conformance suite's Mosaic cases at those head dims ($OUT/head_dims_tests.log);
# 3. times causal and a causal window of 1024 (B=2, H=16, L=16384, bfloat16) through
#    MosaicBlockSparse, CudnnDense and TritonBlockSparse, with jax.nn's cuDNN as the peer
#    where it takes the head dims: at 256 ($OUT/d256.log, d256.json), at 96
#    ($OUT/d96.log, d96.json) and at D = 64, Dv = 128 ($OUT/d64_dv128.log, d64_dv128.json).
# Each stage stays within what is left of `seconds` (default 300) after the install.
set -u
source benchmarks/gpu_setup.sh "${1:-300}"

XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$(left 150)" python3 -m pytest -m gpu --extended \
    tests/kernels/mosaic/test_mosaic_head_dim_256.py \
    tests/kernels/mosaic/test_mosaic_padded_head_dims.py tests/test_conformance.py \
    -k "not conformance or (mosaic and (head_dim or value_dim or everything))" -n 6 \
    -p no:cacheprovider -rA -q > "$OUT/head_dims_tests.log" 2>&1
echo "head dim tests exit status: $? after $((SECONDS - start)) s"
grep -E "^(FAILED|ERROR)" "$OUT/head_dims_tests.log" | head -20
tail -2 "$OUT/head_dims_tests.log"

for run in "d256 --dim 256" "d96 --dim 96" "d64_dv128 --dim 64 --value-dim 128"; do
    set -- $run
    name=$1
    shift
    timeout "$(left 100)" python3 -m eqx_bsattn.bench --lengths 16384 --patterns causal window \
        --batch 2 --heads 16 "$@" --dtype bfloat16 --window 1024 --reps 10 --platform gpu \
        --gqa-kv-heads 0 --kernels MosaicBlockSparse CudnnDense TritonBlockSparse \
        --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "$name benchmark exit status: $? after $((SECONDS - start)) s"
    grep -v '^{' "$OUT/$name.log" | tail -8
done
