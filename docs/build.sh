#!/usr/bin/env bash
# Build the documentation as CI does: offline, warnings as errors, nitpicky references,
# every public symbol checked for a docstring with a formula (docs/_ext/kfac_apidoc.py),
# tutorials executed (sphinx-gallery), every >>> example run (doctest builder), and the key
# pages measured in headless Chromium: the build fails when something sticks out of the main
# column at 1280 px; screenshots go to OUTDIR/screenshots (docs/_ext/kfac_pagecheck.py; the
# check is skipped, with a message, when no Chromium is installed).
#
#   bash docs/build.sh [OUTDIR]        # default OUTDIR: docs/_build
#
# -E rebuilds the environment so that warnings of unchanged pages are reported again.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/_build}
python -m sphinx -E -W --keep-going -n -b html docs "$out/html"
python docs/_ext/kfac_pagecheck.py "$out/html" --screenshots "$out/screenshots"
python -m sphinx -E -W --keep-going -n -b doctest docs "$out/doctest"
echo "docs: HTML in $out/html/index.html"
