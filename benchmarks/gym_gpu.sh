#!/usr/bin/env bash
# One H200 run of a group of the attention-gym cases against FlexAttention, from the repository
# root, with the wheels of ../shared/tools/gpu-wheels in ./.whl:
#
#   bash benchmarks/gym_gpu.sh GROUP        # GROUP: 1, 2 or 3 (the cases not yet timed)
#
# 1. installs the wheels and the project (offline);
# 2. runs benchmarks/gym_gpu.py on the group's cases at B=2, H=16, L=16384, D=128, bfloat16,
#    each on both sides (ours with the selector's kernel; FlexAttention torch.compile'd with its
#    own block mask, in a process of its own), no case starting after 450 s:
#    $OUT/gym_GROUP.log, gym_GROUP.json.
# Each group fits one ten-minute call.
set -u
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
group=${1:?which group: 1, 2 or 3}
case "$group" in
    1) cases="noop prefix_lm_inclusive decode_offset nested_jagged batchify_causal tiled_natten morton_natten sasa" ;;
    2) cases="sta_2d sta_3d svg_spatial svg_temporal vision_cross_attention tanh_softcap relative_bias" ;;
    3) cases="head_bias checkerboard causal_bias alibi_and_causal noop_score rope_latent decode_offset_score" ;;
    *) echo "GROUP must be 1, 2 or 3; got $group" >&2; exit 2 ;;
esac
timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD
timeout 30 python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null 2>&1 || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# shellcheck disable=SC2086  # the case names are words
timeout 540 python3 benchmarks/gym_gpu.py --length 16384 --batch 2 --heads 16 --dim 128 \
    --cases $cases --budget 450 --out "$OUT/gym_$group.json" > "$OUT/gym_$group.log" 2>&1
echo "gym group $group exit status: $?"
tail -20 "$OUT/gym_$group.log"
