#!/usr/bin/env bash
# Build the documentation as CI does: offline, warnings as errors, nitpicky references,
# every public symbol checked for a docstring with a formula (docs/_ext/kfac_apidoc.py),
# tutorials executed (sphinx-gallery), every >>> example run (doctest builder), and every
# page measured in headless Chromium: the build fails when something sticks out of the main
# column at 1280 px; screenshots of the key pages go to OUTDIR/screenshots
# (docs/_ext/kfac_pagecheck.py; the check is skipped, with a message, when no Chromium is
# installed).
#
#   bash docs/build.sh [OUTDIR]        # default OUTDIR: docs/_build
#
# Needs the docs extra: pip install -e ".[docs]".  The Python is $PYTHON, else the
# project's .venv when it exists and no virtual environment is active, else `python`.
# The log shows warnings and errors only (sphinx -q), one line per step, and the page
# check's failures and counts.
#
# -E rebuilds the environment so that warnings of unchanged pages are reported again.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/_build}
if [ -n "${PYTHON:-}" ]; then
  py=$PYTHON
elif [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
  py=.venv/bin/python
else
  py=python
fi
if ! "$py" -c "import sphinx, myst_parser, numpydoc, sphinx_gallery, pydata_sphinx_theme" \
    2>/dev/null; then
  echo "docs: the documentation tools are not installed for $py ($(command -v "$py" || echo "$py"))."
  echo "docs: install the docs extra into the project's environment, then rerun:"
  echo "        $py -m pip install -e \".[docs]\""
  echo "docs: (the page layout check also needs Chromium, e.g. apt-get install chromium"
  echo "       fonts-dejavu-core; without it that check is skipped with a message)"
  exit 1
fi
echo "docs: 1/3 HTML (sphinx, warnings as errors) -> $out/html"
"$py" -m sphinx -q -E -W --keep-going -n -b html docs "$out/html"
echo "docs: 2/3 page layout at 1280 px (headless Chromium)"
"$py" docs/_ext/kfac_pagecheck.py "$out/html" --screenshots "$out/screenshots"
echo "docs: 3/3 doctest (every >>> example of the pages and docstrings)"
"$py" -m sphinx -q -E -W --keep-going -n -b doctest docs "$out/doctest"
echo "docs: HTML in $out/html/index.html"
