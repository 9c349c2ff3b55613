"""Sphinx extension: the ecosystem matrix as a picture, and its table coloured by outcome.

At ``builder-inited`` the suite's ``matrix.json`` (``kfac_matrix_json``, relative to the
repository root) is drawn with :func:`conformance.figures.write_matrix_figures` into
``kfac_matrix_figures`` (a git-ignored folder under ``docs/``), so the page shows the runs
that are committed, never a stale copy.  Files are replaced only when their bytes change.

On the pages listed in ``kfac_matrix_pages``, every table cell whose text is a matrix cell
(``pass``, ``pass (convention: ...)``, ``FAIL k/n (...)``, ``skip (...)``, ...) or a verdict
(``PASSED``, ``FAILED``) gets the class ``kfac-cell-<outcome>``, which
``_static/kfac_ref.css`` colours like the picture.  A missing or unreadable matrix fails the
build.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from docutils import nodes
from sphinx.util import logging

logger = logging.getLogger(__name__)
_VERDICTS = {"PASSED": "pass", "FAILED": "fail"}


def _draw(app):
    from conformance.figures import write_matrix_figures

    root = Path(app.srcdir).parent
    src = root / app.config.kfac_matrix_json
    try:
        matrix = json.loads(src.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        logger.warning(f"kfac_matrix: cannot read {src}: {exc}", type="kfac_matrix")
        return
    out = Path(app.srcdir) / app.config.kfac_matrix_figures
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for path in write_matrix_figures(matrix, tmp):
            target = out / path.name
            if not target.exists() or target.read_bytes() != path.read_bytes():
                shutil.copyfile(path, target)


def _colour_cells(app, doctree):
    if app.env.docname not in app.config.kfac_matrix_pages:
        return
    from conformance.figures import classify_cell

    for entry in doctree.findall(nodes.entry):
        text = entry.astext().strip()
        outcome = _VERDICTS.get(text)
        if outcome is None:
            try:
                outcome = classify_cell(text)
            except ValueError:
                continue
        entry["classes"].append(f"kfac-cell-{outcome}")


def setup(app):
    app.add_config_value("kfac_matrix_json", "conformance/peers/reports/matrix.json", "env")
    app.add_config_value("kfac_matrix_figures", "conformance/generated", "env")
    app.add_config_value("kfac_matrix_pages", [], "env")
    app.connect("builder-inited", _draw)
    app.connect("doctree-read", _colour_cells)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
