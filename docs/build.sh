#!/usr/bin/env bash
# Build the documentation as CI does: offline, warnings as errors, nitpicky references,
# every public symbol checked for a docstring with a formula (docs/_ext/kfac_apidoc.py),
# tutorials executed (sphinx-gallery), and every >>> example run (doctest builder).
#
#   bash docs/build.sh [OUTDIR]        # default OUTDIR: docs/_build
#
# -E rebuilds the environment so that warnings of unchanged pages are reported again.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/_build}
python -m sphinx -E -W --keep-going -n -b html docs "$out/html"
python -m sphinx -E -W --keep-going -n -b doctest docs "$out/doctest"
echo "docs: HTML in $out/html/index.html"
