#!/usr/bin/env bash
# GPU check in one go (< 8 minutes on one modern GPU): the CuPy cells of the test matrix, then
# the benchmark suite on CuPy arrays (the hand baseline runs on CuPy too, so both sides are on
# the device; every row synchronises the device before and after it is timed).
#
#   bash benchmarks/gpu_check.sh [OUTDIR]     # default OUTDIR: benchmark-results/gpu
#
# Needs CuPy (pip install -e ".[test,gpu]") and a CUDA device; exits non-zero on a test
# failure or a baseline disagreement.  The torch CUDA run is optional (set TORCH=1): kfac_ref
# on torch CUDA tensors against the hand baseline on CuPy is not a like-for-like pair, so it is
# reported separately and not run by default (torch tensors go to CUDA when it is available).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmark-results/gpu}
mkdir -p "$out"
python -c "import cupy; n = cupy.cuda.runtime.getDeviceCount(); assert n > 0, 'no CUDA device'; \
print('GPU:', cupy.cuda.runtime.getDeviceProperties(0)['name'].decode())"

# 1. the CuPy cells of the test matrix (tests/conftest.py selects cells by id prefix); the
#    hypothesis example count is CI-sized.  Budget: ~4 minutes.
start=$(date +%s)
KFAC_REF_BACKENDS=cupy timeout 300 python -m pytest -q -p no:cacheprovider -x \
    --junitxml="$out/cupy-tests.xml" tests 2>&1 | tee "$out/cupy-tests.log" | tail -n 5
echo "cupy tests: $(( $(date +%s) - start )) s"

# 2. the benchmark suite on CuPy, float32 and float64 (exact and stochastic modes; the
#    fisher_* modes repeat the ggn_* work for softmax cross-entropy).  Budget: ~3 minutes.
start=$(date +%s)
timeout 240 python -m benchmarks --backend cupy --repeats 5 \
    --modes ggn_exact fisher_gradients fisher_empirical ggn_curvature_prop --out "$out"
echo "cupy benchmarks: $(( $(date +%s) - start )) s"
if [ "${TORCH:-0}" = 1 ]; then
    timeout 120 python -m benchmarks --backend torch --repeats 3 --dtypes float32 \
        --modes ggn_exact fisher_gradients --no-memory --out "$out/torch"
fi
echo "gpu_check: results in $out"
