#!/usr/bin/env bash
# The NCCL backend's GPU verification, in one command, from a checkout:
#
#   tests/gpu/run_gpu_suite.sh [OUTDIR]        (default: ./gpu-suite-out, or $OUT if set)
#
# Runs every test marked gpu (--require-gpu so that a broken CUDA setup fails
# instead of skipping), the NCCL CPU tests on the same machine, and a quick run of
# bench/nccl_overhead_bench.py; writes environment.txt, pytest.txt, junit.xml,
# bench.txt and bench.json to OUTDIR, and prints the row to add to
# docs/gpu-verification.md. Needs no network: CuPy, NCCL, pytest and numpy must be
# installed already (jax with CUDA and torch are used when present).
#
# GPU_SUITE_PARTS picks what runs (default "env gpu cpu bench"); GPU_SUITE_PYTEST
# adds pytest arguments to the gpu part (e.g. "-k reduction" or a path), so that a
# machine whose commands are time-limited can run the suite in slices:
#   GPU_SUITE_PARTS="env gpu" GPU_SUITE_PYTEST="tests/gpu -k 'not reduction'" tests/gpu/run_gpu_suite.sh OUT1
set -uo pipefail
OUTDIR="$(realpath -m "${1:-${OUT:-gpu-suite-out}}")"
cd "$(dirname "$0")/../.."
mkdir -p "$OUTDIR"
PARTS=" ${GPU_SUITE_PARTS:-env gpu cpu bench} "
rc=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_MULTI_RANK_GPU_ENABLE="${NCCL_MULTI_RANK_GPU_ENABLE:-1}"
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
PY="${PYTHON:-python}"

[[ "$PARTS" == *" env "* ]] && {
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  else
    echo "gpu: unknown (no nvidia-smi), unknown driver"
  fi
  "$PY" - <<'EOF'
import importlib, sys
print("python:", sys.version.split()[0])
for mod in ("numpy", "cupy", "jax", "jaxlib", "torch", "ml_dtypes", "pytest"):
    try:
        print(f"{mod}:", importlib.import_module(mod).__version__)
    except Exception as exc:
        print(f"{mod}: not available ({type(exc).__name__})")
try:
    import cupy
    print("cuda runtime:", cupy.cuda.runtime.runtimeGetVersion(), "driver:", cupy.cuda.runtime.driverGetVersion())
    from gpucoll._backends.nccl import lib as _nccl_lib
    lib = _nccl_lib.load()
    print("nccl:", ".".join(map(str, lib.version)), "at", lib.library_path, lib.shim_error)
    print("features:", lib.features.describe())
    print("reason unavailable:", _nccl_lib.unavailable_reason())
except Exception as exc:
    print("cupy/nccl probe failed:", type(exc).__name__, exc)
EOF
} 2>&1 | tee "$OUTDIR/environment.txt"

if [[ "$PARTS" == *" gpu "* ]]; then
  # Every test marked gpu, wherever it lives (tests/gpu, the bench, the array layer, ...).
  eval "set -- ${GPU_SUITE_PYTEST:-tests}"
  "$PY" -m pytest "$@" -m gpu --require-gpu -p no:cacheprovider -rA \
      --junitxml="$OUTDIR/junit.xml" 2>&1 | tee "$OUTDIR/pytest.txt"
  part=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] && rc=$part
fi
if [[ "$PARTS" == *" cpu "* ]]; then
  # The NCCL CPU-side tests again, against this machine's CuPy and NCCL.
  "$PY" -m pytest tests/nccl -p no:cacheprovider -q 2>&1 | tee -a "$OUTDIR/pytest.txt"
  part=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] && rc=$part
fi
if [[ "$PARTS" == *" bench "* ]]; then
  "$PY" bench/nccl_overhead_bench.py --quick --json "$OUTDIR/bench.json" 2>&1 | tee "$OUTDIR/bench.txt"
  part=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] && rc=$part
fi
[ -f "$OUTDIR/environment.txt" ] || exit "$rc"

"$PY" - "$OUTDIR" <<'EOF'
import re, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
env = open(f"{out}/environment.txt").read()
def field(key):
    m = re.search(rf"^{key}: (.*)$", env, re.M)
    return m.group(1).strip() if m else "?"
gpu = field("gpu").split(",")
try:
    suite = ET.parse(f"{out}/junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests, fails, errs, skips = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    counts = f"{tests - fails - errs - skips} passed, {fails + errs} failed, {skips} skipped"
except Exception as exc:
    counts = f"no junit.xml ({exc})"
print("\nRow for docs/gpu-verification.md:")
print(f"| {field('date')[:10]} | {gpu[0].strip()} | {gpu[1].strip() if len(gpu) > 1 else '?'} "
      f"| {field('cupy')} | {field('nccl').split()[0]} | {counts} | tests/gpu/run_gpu_suite.sh |")
EOF
exit "$rc"
