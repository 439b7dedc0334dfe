#!/usr/bin/env bash
# Head dim 256 through MosaicBlockSparse on one H200, from the repository root, with the wheels
# of ../shared/tools/gpu-wheels in ./.whl and `_HEAD_DIM_256_RUN_ON_GPU` set to True in
# strategies/kernels/mosaic/kernel.py (it is False until this has passed once; its GPU tests
# switch it on themselves), and `_WIDE_HEADS_RUN_ON_GPU` in strategies/kernels/cudnn.py for the
# cuDNN column:
#
#   bash benchmarks/mosaic_head_dim_256_gpu.sh [seconds]
#
# 1. installs the wheels and the project (offline);
# 2. runs tests/kernels/mosaic/test_mosaic_head_dim_256.py's GPU tests (causal with grouped
#    heads, learned ALiBi in a window, documents, a predicate with a learned score function,
#    an ArrayMask with a bias; every gradient against the float32 reference) and the
#    conformance suite's Mosaic cases at head dim 256 ($OUT/d256_tests.log);
# 3. times causal and a causal window of 1024 at head dim 256 (B=2, H=16, L=16384, bfloat16)
#    through MosaicBlockSparse, CudnnDense and TritonBlockSparse, with jax.nn's cuDNN as the
#    peer ($OUT/d256.log, d256.json).
# Each stage stays within what is left of `seconds` (default 240) after the install.
set -u
source benchmarks/gpu_setup.sh "${1:-240}"

XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$(left 120)" python3 -m pytest -m gpu --extended \
    tests/kernels/mosaic/test_mosaic_head_dim_256.py tests/test_conformance.py \
    -k "not conformance or (mosaic and head_dim_256)" -n 6 -p no:cacheprovider -rA -q \
    > "$OUT/d256_tests.log" 2>&1
echo "head dim 256 tests exit status: $? after $((SECONDS - start)) s"
grep -E "^(FAILED|ERROR)" "$OUT/d256_tests.log" | head -20
tail -2 "$OUT/d256_tests.log"

timeout "$(left 120)" python3 -m eqx_bsattn.bench --lengths 16384 --patterns causal window \
    --batch 2 --heads 16 --dim 256 --dtype bfloat16 --window 1024 --reps 10 --platform gpu \
    --kernels MosaicBlockSparse CudnnDense TritonBlockSparse --out "$OUT/d256.json" \
    > "$OUT/d256.log" 2>&1
echo "head dim 256 benchmark exit status: $? after $((SECONDS - start)) s"
grep -v '^{' "$OUT/d256.log" | tail -14
