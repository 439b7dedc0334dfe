#!/usr/bin/env bash
# Head dims over 128 through CudnnDense on one H200, from the repository root, with the wheels
# of ../shared/tools/gpu-wheels in ./.whl and `_WIDE_HEADS_RUN_ON_GPU` set to True in
# strategies/kernels/cudnn.py (it is False until this has passed once):
#
#   bash benchmarks/cudnn_wide_heads_gpu.sh [seconds]
#
# 1. installs the wheels and the project (offline);
# 2. runs the GPU tests of tests/kernels/cudnn and the conformance suite's cuDNN cases (head
#    dims 192 and 256 among them) against the references ($OUT/cudnn_tests.log);
# 3. times causal and a causal window of 1024 at head dim 256 (B=2, H=16, L=16384, bfloat16)
#    through CudnnDense and TritonBlockSparse, with jax.nn's cuDNN as the peer
#    ($OUT/wide_heads.log, wide_heads.json).
# Each stage stays within what is left of `seconds` (default 200) after the install.
set -u
source benchmarks/gpu_setup.sh "${1:-200}"

XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$(left 100)" python3 -m pytest -m gpu --extended \
    tests/kernels/cudnn tests/test_conformance.py -k "cudnn or not conformance" -n 4 \
    -p no:cacheprovider -rA -q > "$OUT/cudnn_tests.log" 2>&1
echo "cuDNN tests exit status: $? after $((SECONDS - start)) s"
grep -E "^(FAILED|ERROR)" "$OUT/cudnn_tests.log" | head -20
tail -2 "$OUT/cudnn_tests.log"

timeout "$(left 120)" python3 -m eqx_bsattn.bench --lengths 16384 --patterns causal window \
    --batch 2 --heads 16 --dim 256 --dtype bfloat16 --window 1024 --reps 10 --platform gpu \
    --kernels CudnnDense TritonBlockSparse --out "$OUT/wide_heads.json" > "$OUT/wide_heads.log" 2>&1
echo "head dim 256 benchmark exit status: $? after $((SECONDS - start)) s"
grep -v '^{' "$OUT/wide_heads.log" | tail -12
