# Sourced by the TPU run scripts, from the repository root: `source benchmarks/tpu_setup.sh`.
# Installs the wheels of ./.whl-tpu (offline, into $SITE, appended to PYTHONPATH so the
# machine's JAX stays first; benchmarks/tpu_run.sh says how to fetch them) and sets OUT
# (default ./tpu_out). The project is not installed: a link inside the package maps the
# top-level strategies/ folder to eqx_bsattn.strategies, as the install does.
OUT=${OUT:-$PWD/tpu_out}
SITE=${SITE:-${TMPDIR:-/tmp}/site}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .whl-tpu/*.whl > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE:$PWD
[ -e eqx_bsattn/strategies ] || ln -s ../strategies eqx_bsattn/strategies
