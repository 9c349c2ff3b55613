"""Tests of the ecosystem-matrix picture (conformance/figures.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance.figures import OUTCOMES, classify_cell, outcome_grid, write_matrix_figures
from conformance.reports import matrix_cell, write_matrix

ROOT = Path(__file__).resolve().parents[1]


def _result(status, pitfall=None, conventions=None, message=""):
    r = {"capability": "cap", "status": status, "message": message,
         "conventions": conventions or {}}
    if pitfall:
        r["diagnosis"] = {"pitfall": pitfall}
    return r


# Cells as the suite writes them (conformance.reports.matrix_cell), with the outcome each
# must be drawn as.
SUITE_CELLS = [
    (matrix_cell({"pass": 3}, [_result("pass")] * 3), "pass"),
    (matrix_cell({"pass": 1, "convention": 2},
                 [_result("convention", conventions={"kron_order": "GA"})]), "convention"),
    (matrix_cell({"pass": 8, "fail": 2}, [_result("fail", pitfall="scale:T")]), "fail"),
    (matrix_cell({"pass": 8, "fail": 1}, [_result("fail", pitfall="unexplained")]), "fail"),
    (matrix_cell({"pass": 4, "error": 1}, [_result("error")]), "error"),
    (matrix_cell({"pass": 2, "xfail": 1}, [_result("xfail", pitfall="kron_order")]), "xfail"),
    (matrix_cell({"skip": 3}, [_result("skip", message="unsupported: no moving averages")]),
     "skip"),
    (matrix_cell({"skip": 1}, [_result("skip")]), "skip"),
]


@pytest.mark.parametrize(("cell", "outcome"), SUITE_CELLS)
def test_classify_cell_reads_the_cells_the_suite_writes(cell, outcome):
    assert classify_cell(cell) == outcome


@pytest.mark.parametrize(("cell", "outcome"), [
    ("skip (not in this run)", "skip"),
    ("skip (adapter unavailable)", "skip"),
    ("unsupported: not mapped", "skip"),
    ("error 1/3", "error"),
    ("  Pass ", "pass"),
    ("FAIL 2/10 (conv_style)", "fail"),
    ("FAIL 1/5 (error)", "error"),
])
def test_classify_cell_variants(cell, outcome):
    assert classify_cell(cell) == outcome


@pytest.mark.parametrize("cell", ["", "passed?", "ok", "n/a"])
def test_classify_cell_rejects_unknown_cells(cell):
    with pytest.raises(ValueError, match=r"classify_cell: cell must start with"):
        classify_cell(cell)


def test_classify_cell_rejects_non_strings():
    with pytest.raises(TypeError, match=r"classify_cell: cell must be a str; got int"):
        classify_cell(3)


TINY = {
    "date": "2030-01-02T03:04:05+00:00",
    "implementations": {"kfac_ref": {"ok": True, "unavailable": ""},
                        "peer_a": {"ok": False, "unavailable": ""},
                        "peer_b": {"ok": None, "unavailable": "no module named peer_b"}},
    "capabilities": ["linalg.kron", "factors.dense_input", "networks.kfac"],
    "cells": {
        "kfac_ref": {"linalg.kron": "pass", "factors.dense_input": "pass",
                     "networks.kfac": "pass"},
        "peer_a": {"linalg.kron": "skip (unsupported: private)",
                   "factors.dense_input": "pass (convention: kron_order=GA)",
                   "networks.kfac": "FAIL 2/6 (scale:T)", "losses.extra": "FAIL 1/1 (error)"},
        "peer_b": {"linalg.kron": "skip (adapter unavailable)"},
    },
}
# Rows: capabilities (the listed ones, then one only a cell names); columns: implementations.
TINY_GRID = [
    ["pass", "skip", "skip"],
    ["pass", "convention", "skip"],
    ["pass", "fail", "skip"],
    ["skip", "error", "skip"],
]


def test_outcome_grid_of_a_hand_made_matrix():
    impls, caps, grid = outcome_grid(TINY)
    assert impls == ["kfac_ref", "peer_a", "peer_b"]
    assert caps == ["linalg.kron", "factors.dense_input", "networks.kfac", "losses.extra"]
    assert grid == TINY_GRID


def test_outcome_grid_without_capabilities_key_uses_the_cells_order():
    m = {"cells": {"x": {"b": "pass", "a": "skip"}, "y": {"c": "FAIL 1/2 (unexplained)"}}}
    impls, caps, grid = outcome_grid(m)
    assert (impls, caps) == (["x", "y"], ["b", "a", "c"])
    assert grid == [["pass", "skip"], ["skip", "skip"], ["skip", "fail"]]


@pytest.mark.parametrize("bad", [{}, {"cells": {}}, {"cells": []}, [], None])
def test_outcome_grid_rejects_a_matrix_without_cells(bad):
    with pytest.raises(ValueError, match=r"outcome_grid: matrix must be a dict"):
        outcome_grid(bad)


def test_outcome_grid_reads_the_matrix_write_matrix_writes(tmp_path):
    reports = [
        {"adapter": {"name": "ref"}, "ok": True, "counts": {"pass": 2},
         "capabilities": {"linalg.kron": {"pass": 1}, "losses.fisher": {"pass": 1}},
         "results": [{"capability": "linalg.kron", "status": "pass"},
                     {"capability": "losses.fisher", "status": "pass"}]},
        {"adapter": {"name": "peer"}, "ok": False, "counts": {"fail": 1, "skip": 1},
         "capabilities": {"linalg.kron": {"skip": 1}, "losses.fisher": {"fail": 1}},
         "results": [{"capability": "linalg.kron", "status": "skip", "message": "private"},
                     {"capability": "losses.fisher", "status": "fail",
                      "diagnosis": {"pitfall": "scale:N"}}]},
    ]
    data = write_matrix(reports, tmp_path, date="2030-01-01")
    stored = json.loads((tmp_path / "matrix.json").read_text(encoding="utf-8"))
    assert stored == data
    assert outcome_grid(stored) == (["ref", "peer"], ["linalg.kron", "losses.fisher"],
                                    [["pass", "skip"], ["pass", "fail"]])


def test_importing_the_module_does_not_import_matplotlib():
    code = ("import sys, conformance, conformance.figures; "
            "sys.exit('matplotlib' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def _svg_cells(svg: Path) -> dict:
    """{(row, column): (outcome, fill colour)} of the cells drawn in the SVG."""
    cells = {}
    for g in ET.parse(svg).getroot().iter("{http://www.w3.org/2000/svg}g"):
        m = re.fullmatch(r"cell-(\d+)-(\d+)-(\w+)", g.get("id", ""))
        if m:
            (path,) = list(g)
            fill = re.search(r"fill:\s*(#[0-9a-f]{6})", path.get("style")).group(1)
            cells[int(m[1]), int(m[2])] = (m[3], fill)
    return cells


def test_write_matrix_figures_draws_each_cell_in_its_outcome_colour(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_matrix_figures(TINY, tmp_path / "out")
    assert [p.name for p in paths] == ["matrix.png", "matrix.svg"]
    assert all(p.is_file() and p.stat().st_size > 1000 for p in paths)
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cells = _svg_cells(paths[1])
    assert cells == {(i, j): (o, OUTCOMES[o][1]) for i, row in enumerate(TINY_GRID)
                     for j, o in enumerate(row)}
    # One colour per outcome.
    assert len({c for _, c, _ in OUTCOMES.values()}) == len(OUTCOMES)
    assert 'id="legend"' in paths[1].read_text(encoding="utf-8")


def test_write_matrix_figures_is_deterministic_and_has_no_timestamp(tmp_path):
    pytest.importorskip("matplotlib")
    a = write_matrix_figures(TINY, tmp_path / "a")
    b = write_matrix_figures(TINY, tmp_path / "b")
    for pa, pb in zip(a, b, strict=True):
        assert pa.read_bytes() == pb.read_bytes()
    svg = a[1].read_text(encoding="utf-8")
    assert "<dc:date>" not in svg and "matplotlib" not in svg.lower()
    assert b"matplotlib" not in a[0].read_bytes().lower()


def test_the_committed_matrix_fits_a_docs_column(tmp_path):
    pytest.importorskip("matplotlib")
    image = pytest.importorskip("matplotlib.image")
    matrix = json.loads((ROOT / "conformance/peers/reports/matrix.json")
                        .read_text(encoding="utf-8"))
    png, svg = write_matrix_figures(matrix, tmp_path)
    height, width = image.imread(png).shape[:2]
    # 150 dpi: at most 9 inches, i.e. about 860 CSS pixels at 96 per inch.
    assert 600 <= width <= 9 * 150
    m = re.search(r'<svg[^>]* width="([\d.]+)pt"', svg.read_text(encoding="utf-8"))
    assert float(m[1]) / 72 * 96 <= 900
    impls, caps, grid = outcome_grid(matrix)
    cells = _svg_cells(svg)
    assert len(cells) == len(impls) * len(caps)
    assert all(cells[i, j][0] == grid[i][j] for i in range(len(caps))
               for j in range(len(impls)))
