#!/usr/bin/env bash
# GPU check in one go (budget: under 8 minutes on one modern GPU):
#
#   1. the GPU cells of the test matrix: CuPy float64 and float32, torch CUDA float64 and
#      float32 (tests/conftest.py adds them when a CUDA device is visible), with the record of
#      which public objects each cell exercised (KFAC_REF_SUPPORT_DUMP, merged into one file);
#   2. the benchmark suite on CuPy arrays, the hand baseline on CuPy too, every estimation mode,
#      float32 and float64 (every row synchronises the device before and after it is timed);
#   3. the same rows with kfac_ref on torch CUDA tensors and the hand baseline on CuPy, on the
#      same GPU (two array libraries, so a comparison of libraries as much as of code);
#   4. the full update against the peers on the GPU: kfac_ref on torch CUDA tensors against
#      curvlinops on the same GPU, and kfac-jax on JAX's default backend, where installed;
#      the MLP, the CNN and the CNN at N=512 (cnn-large), float32;
#   5. a CNN with N=512 under the device-aware conv chunk bound against the old 64 MiB
#      bound, and the exact modes' updates on the benchmark MLP (CuPy, torch CUDA);
#   6. the jit tests on a JAX GPU backend, where one is installed.
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
timeout "${BENCH_TIMEOUT:-150}" "$py" -m benchmarks --backend cupy --repeats 5 --no-peers --out "$out" \
  > "$out/bench-cupy.log" 2>&1 || status=1
tail -n 4 "$out/bench-cupy.log"

# 3. kfac_ref on torch CUDA tensors against the hand baseline on CuPy
if "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  log "3. benchmarks: kfac_ref on torch CUDA, hand baseline on CuPy"
  timeout "${BENCH_TIMEOUT:-150}" "$py" -m benchmarks --backend torch --repeats 5 --no-peers \
    --no-memory --out "$out" > "$out/bench-torch.log" 2>&1 || status=1
  tail -n 4 "$out/bench-torch.log"
fi

# 4. the peers on the GPU (a peer that is not installed is listed as skipped)
if "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  log "4. benchmarks: full update against the peers, kfac_ref on torch CUDA"
  # one workload a call, so that a slow one loses only its own rows; JAX (kfac-jax) takes
  # GPU memory as it needs it, not three quarters of it up front
  for wl in mlp cnn cnn-large; do
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${PEERS_TIMEOUT:-100}" "$py" -m benchmarks \
      --backend torch --peers-only --dtypes float32 --repeats 3 --workloads "$wl" \
      --out "$out/peers-$wl" > "$out/bench-peers-$wl.log" 2>&1 || status=1
    grep -E "^\| (mlp|cnn)|^- " "$out/bench-peers-$wl.log"
  done
fi

# 5. what the suite does not time: a CNN out of the overhead regime (32x32, conv 3->64 ->
#    128/2, N=512) with the device-aware chunk bound against the old 64 MiB one, and the
#    exact modes (one batched loss call) on the benchmark MLP; CuPy and torch CUDA, float32,
#    median of 5 synchronised runs after one warm-up.
log "5. large CNN (device-aware chunk bound vs 64 MiB) and exact-mode MLP updates"
timeout "${BENCH_TIMEOUT:-150}" "$py" - > "$out/large-cnn.log" 2>&1 <<'EOF' || status=1
import os, statistics, time
import numpy as np
import kfac_ref.nn as nn
from kfac_ref import patches
from kfac_ref.curvature import BlockDiagonalCurvature
from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss as CE

libs = os.environ.get("GPU_CHECK_LIBS", "cupy,torch").split(",")
small = bool(os.environ.get("GPU_CHECK_SMALL"))  # a CPU dry run of this script's logic


def backend(name):
    """(float array, integer array, synchronise) constructors of one library."""
    if name == "cupy":
        import cupy
        return (lambda a: cupy.asarray(a, dtype=cupy.float32),
                lambda a: cupy.asarray(a, dtype=cupy.int64), cupy.cuda.Device().synchronize)
    if name == "torch":
        import torch
        if not torch.cuda.is_available():
            return None
        return (lambda a: torch.as_tensor(a, dtype=torch.float32, device="cuda"),
                lambda a: torch.as_tensor(a, dtype=torch.int64, device="cuda"),
                torch.cuda.synchronize)
    return (lambda a: np.asarray(a, dtype=np.float32), lambda a: np.asarray(a, dtype=np.int64),
            lambda: None)


def median_s(fn, sync, repeats=5):
    fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def update(net, x, y, mode, to, to_int):
    params = tuple(tuple(to(a) for a in p)
                   for p in net.init_params(np.random.default_rng(0), np.zeros(1)))
    batch = (to(x), to_int(y))
    est = BlockDiagonalCurvature(net, CE)
    st = est.init(None, (params, batch))
    gen = np.random.default_rng(1)
    return lambda: est.update_curvature_matrix_estimate(st, 0.0, 1.0, x.shape[0], gen,
                                                        (params, batch), mode)


size, c1, c2, n = (8, 4, 8, 16) if small else (32, 64, 128, 512)
cnn = nn.Sequential([("c1", nn.Conv2D(3, c1, 3, padding="SAME")), ("r1", nn.Activation("relu")),
                     ("c2", nn.Conv2D(c1, c2, 3, stride=2, padding="SAME")),
                     ("r2", nn.Activation("relu")), ("pool", nn.MeanPool()),
                     ("d", nn.Dense(c2, 10))])
d_in, h, m = (16, 32, 8) if small else (784, 1000, 256)
mlp = nn.Sequential([("d1", nn.Dense(d_in, h)), ("a1", nn.Activation("tanh")),
                     ("d2", nn.Dense(h, h)), ("a2", nn.Activation("tanh")),
                     ("d3", nn.Dense(h, 10))])
rng = np.random.default_rng(2)
xc, yc = rng.standard_normal((n, size, size, 3)), rng.integers(0, 10, n)
xm, ym = rng.standard_normal((m, d_in)), rng.integers(0, 10, m)
print(f"CNN {size}x{size}, conv 3->{c1}->{c2}/2, N={n}; MLP {d_in}->{h}->{h}->10, N={m}")
for lib in libs:
    b = backend(lib)
    if b is None:
        print(f"{lib}: no CUDA device, skipped")
        continue
    to, to_int, sync = b
    print(f"{lib}: device-aware bound {patches.temporary_bytes_bound(to(np.zeros(1)))} bytes")
    for mode in ("fisher_gradients", "ggn_exact"):
        row = {}
        for label, bound in (("device-aware", None), ("64 MiB", patches.MAX_TEMPORARY_BYTES)):
            patches.set_max_temporary_bytes(bound)
            row[label] = median_s(update(cnn, xc, yc, mode, to, to_int), sync)
        patches.set_max_temporary_bytes(None)
        print(f"  CNN {mode:17s} device-aware {row['device-aware'] * 1e3:8.2f} ms   "
              f"64 MiB {row['64 MiB'] * 1e3:8.2f} ms   "
              f"speed-up {row['64 MiB'] / row['device-aware']:.2f}x")
    for mode in ("fisher_exact", "ggn_exact", "fisher_empirical"):
        t = median_s(update(mlp, xm, ym, mode, to, to_int), sync)
        print(f"  MLP {mode:17s} {t * 1e3:8.2f} ms")
EOF
tail -n 12 "$out/large-cnn.log"

# 6. the jit tests (states across jax.jit, a JAX key) on a JAX GPU backend, where installed
if "$py" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
  log "6. jit tests on JAX's GPU backend"
  timeout "${TEST_TIMEOUT:-300}" "$py" -m pytest -q -p no:cacheprovider tests/test_jit_states.py \
    tests/test_transforms.py > "$out/jit-gpu.log" 2>&1 || status=1
  tail -n 3 "$out/jit-gpu.log"
fi
log "done (status $status); results in $out"
exit "$status"
