#!/usr/bin/env bash
# The one proof command on a lent H200, from the repository root, with the wheels of
# ../shared/tools/gpu-wheels in ./.whl (carried): installs them and the project offline, then
# runs benchmarks/device_proofs.py (its docstring says what it proves and where the log goes)
# within `seconds` (default 560) after the install.
#
#   bash benchmarks/device_proofs.sh [seconds]
set -u
source benchmarks/gpu_setup.sh "${1:-560}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
PYTHONUNBUFFERED=1 python3 benchmarks/device_proofs.py --budget "$(left 560)"
