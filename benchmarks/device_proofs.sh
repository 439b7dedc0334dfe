#!/usr/bin/env bash
# The one proof command on a lent device, from the repository root: installs the carried
# wheels and the project offline, then runs benchmarks/device_proofs.py (its docstring says
# what it proves and where the log goes) within `seconds` (default 560) after the install.
#
#   bash benchmarks/device_proofs.sh gpu [seconds] [--commit HASH]   # H200; ./.whl carried
#   bash benchmarks/device_proofs.sh tpu [seconds] [--commit HASH]   # TPU v5e; ./.whl-tpu
#
# ./.whl: ../shared/tools/gpu-wheels. ./.whl-tpu: benchmarks/tpu_run.sh says how to fetch it.
set -u
device=${1:-gpu}
budget=${2:-560}
shift $(( $# < 2 ? $# : 2 ))
if [ "$device" = gpu ]; then
    source benchmarks/gpu_setup.sh "$budget"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    budget=$(left "$budget")
else
    source benchmarks/tpu_setup.sh
fi
export OUT
PYTHONUNBUFFERED=1 python3 benchmarks/device_proofs.py --device "$device" --budget "$budget" "$@"
