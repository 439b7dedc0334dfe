# Sourced by the GPU run scripts, from the repository root: `source benchmarks/gpu_setup.sh
# SECONDS_BUDGET`. Installs the wheels of ../shared/tools/gpu-wheels (in ./.whl) and the project
# offline, sets OUT (default ./bench_out) and PYTHONPATH, and defines `left N`: the seconds left
# of the budget after the install, at most N (at least 1).
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
budget=$1
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null 2>&1 || exit 1
start=$SECONDS

left() {
    local rest=$((budget - (SECONDS - start)))
    echo $((rest < $1 ? (rest > 1 ? rest : 1) : $1))
}
