#!/usr/bin/env bash
# Re-run every peer adapter, its standalone reproduction and the reference's own columns,
# then merge the ecosystem matrix (conformance/peers/reports/matrix.{md,json}).
#
#   TF_PY=/path/to/tf/venv/bin/python JAX_PY=... TORCHPEERS_PY=... REF_PY=... \
#       bash conformance/peers/rerun.sh
#
# Each *_PY is the python of the environment built from the recipe of the same name
# (tf.txt, jax.txt, torchpeers.txt; laplace.txt for LAPLACE_PY; REF_PY:
# any environment with kfac_ref, torch for the kfac_ref_torch column).  A peer whose variable
# is unset is not re-run and keeps its committed report.  Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=conformance/peers/reports
run() {  # python adapter
  echo "rerun: $2"
  "$1" -m conformance --adapter "$2" --out "$out" > /dev/null || true  # a FAILED peer exits 1
}
repro() {  # python peer
  echo "rerun: repro_$2"
  "$1" -m "conformance.peers.repro_$2" --json "$out/repro_$2.json" > /dev/null
}
if [ -n "${TF_PY:-}" ]; then run "$TF_PY" tf_kfac; repro "$TF_PY" tf_kfac; fi
if [ -n "${JAX_PY:-}" ]; then run "$JAX_PY" kfac_jax; repro "$JAX_PY" kfac_jax; fi
if [ -n "${LAPLACE_PY:-}" ]; then run "$LAPLACE_PY" laplace_torch; repro "$LAPLACE_PY" laplace_torch; fi
if [ -n "${TORCHPEERS_PY:-}" ]; then
  for p in curvlinops backpack asdl nngeometry; do run "$TORCHPEERS_PY" "$p"; repro "$TORCHPEERS_PY" "$p"; done
fi
ref=${REF_PY:-python}
for a in kfac_ref kfac_ref_strict kfac_ref_torch kfac_ref_float32 kfac_ref_own_draws; do run "$ref" "$a"; done
"$ref" -m conformance matrix "$out"/*/report.json --out "$out"
