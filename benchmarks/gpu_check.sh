#!/usr/bin/env bash
# GPU check in one go (budget: under 8 minutes on one modern GPU):
#
#   1. the GPU cells of the test matrix: CuPy float64 and float32, torch CUDA float64 and
#      float32 (tests/conftest.py adds them when a CUDA device is visible), with the record of
#      which public objects each cell exercised (KFAC_REF_SUPPORT_DUMP, merged into one file);
#   2. the benchmark suite on CuPy arrays, the hand baseline on CuPy too, every estimation mode,
#      float32 and float64 (every row synchronises the device before and after it is timed);
#   3. the same rows with kfac_ref on torch CUDA tensors and the hand baseline on CuPy, on the
#      same GPU (two array libraries, so a comparison of libraries as much as of code).
#
#   bash benchmarks/gpu_check.sh [OUTDIR]     # default OUTDIR: benchmark-results/gpu
#
# Needs CuPy (pip install -e ".[test,gpu]"), optionally torch with CUDA, and a CUDA device.
# Every step runs even when an earlier one fails; the exit status is non-zero when a test
# failed, a step ran out of time, or a hand baseline disagreed with kfac_ref.  PYTHON names
# the interpreter (default: python); JOBS the pytest-xdist workers when xdist is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmark-results/gpu}
py=${PYTHON:-python}
mkdir -p "$out"
status=0
log() { echo "gpu_check: [$SECONDS s] $*"; }

"$py" - <<'EOF' || exit 2
import platform, numpy, cupy, array_api_compat
n = cupy.cuda.runtime.getDeviceCount()
assert n > 0, "no CUDA device"
props = cupy.cuda.runtime.getDeviceProperties(0)
print(f"GPU: {props['name'].decode()}, {props['totalGlobalMem'] / 2**30:.0f} GiB; "
      f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}; CuPy {cupy.__version__}; "
      f"NumPy {numpy.__version__}; array-api-compat {array_api_compat.__version__}; "
      f"Python {platform.python_version()}")
try:
    import torch
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
except ImportError:
    print("torch not installed: its CUDA cells skip")
EOF

# 1. the GPU cells of the test matrix
xdist=()
if "$py" -c "import xdist" 2>/dev/null; then xdist=(-n "${JOBS:-8}"); fi
log "1. tests: the cupy and torch-cuda cells ${xdist[*]}"
KFAC_REF_BACKENDS=cupy,torch-cuda KFAC_REF_SUPPORT_DUMP="$out/support.json" \
  timeout "${TEST_TIMEOUT:-300}" "$py" -m pytest -q -p no:cacheprovider "${xdist[@]}" \
  -k "cupy or torch-cuda" tests > "$out/gpu-tests.log" 2>&1 || status=1
grep -E "^(FAILED|ERROR)" "$out/gpu-tests.log" | head -n 60
tail -n 3 "$out/gpu-tests.log"
"$py" - "$out/support.json" <<'EOF' || status=1
import glob, json, sys
path = sys.argv[1]
calls = set()
for part in sorted(glob.glob(path + "*")):
    calls |= {tuple(c) for c in json.load(open(part))}
    if part != path:
        __import__("os").remove(part)
json.dump(sorted(calls), open(path, "w"), indent=0)
print(f"support record: {len(calls)} (object, library) pairs -> {path}")
EOF

# 2. the benchmark suite on CuPy arrays against the hand baseline on CuPy
log "2. benchmarks: kfac_ref on CuPy, hand baseline on CuPy"
timeout "${BENCH_TIMEOUT:-150}" "$py" -m benchmarks --backend cupy --repeats 5 --out "$out" \
  > "$out/bench-cupy.log" 2>&1 || status=1
tail -n 4 "$out/bench-cupy.log"

# 3. kfac_ref on torch CUDA tensors against the hand baseline on CuPy
if "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  log "3. benchmarks: kfac_ref on torch CUDA, hand baseline on CuPy"
  timeout "${BENCH_TIMEOUT:-150}" "$py" -m benchmarks --backend torch --repeats 5 --no-peers \
    --no-memory --out "$out" > "$out/bench-torch.log" 2>&1 || status=1
  tail -n 4 "$out/bench-torch.log"
fi
log "done (status $status); results in $out"
exit "$status"
