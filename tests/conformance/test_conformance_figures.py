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

ROOT = Path(__file__).resolve().parents[2]


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


# -- Layout: nothing overlaps, for any number of columns ------------------------------------
# The figure's artists are measured in display units (pixels at the figure's dpi) after a
# draw: every text as its (possibly rotated) rectangle, every cell as its rectangle, every
# rule as a segment.  Two shapes "overlap" when they share more than a hair (TOL pixels).
TOL = 0.5


def _overlap(p, q, tol=TOL) -> bool:
    """Whether the convex polygons (or segments) ``p`` and ``q`` (lists of (x, y)) overlap
    by more than ``tol`` along every separating direction (separating-axis theorem)."""
    import numpy as np

    p, q = np.asarray(p, float), np.asarray(q, float)
    for poly in (p, q):
        edges = np.roll(poly, -1, axis=0) - poly
        for ex, ey in edges:
            n = np.array([-ey, ex])
            if not np.hypot(*n):
                continue
            n /= np.hypot(*n)
            a, b = p @ n, q @ n
            if a.max() <= b.min() + tol or b.max() <= a.min() + tol:
                return False
    return True


def _inside(inner, outer, tol=TOL) -> bool:
    """Whether the polygon ``inner`` lies within the axis-aligned box of ``outer``."""
    import numpy as np

    inner, outer = np.asarray(inner, float), np.asarray(outer, float)
    return bool((inner.min(0) >= outer.min(0) - tol).all()
                and (inner.max(0) <= outer.max(0) + tol).all())


def _text_polygon(text, renderer):
    """The four corners of a text's glyph box, rotated as drawn."""
    import numpy as np

    angle = text.get_rotation()
    if not angle:
        b = text.get_window_extent(renderer)
        return [(b.x0, b.y0), (b.x1, b.y0), (b.x1, b.y1), (b.x0, b.y1)]
    assert text.get_rotation_mode() == "anchor"
    text.set_rotation(0)
    b = text.get_window_extent(renderer)
    text.set_rotation(angle)
    ax, ay = text.get_transform().transform(text.get_position())
    c, s = np.cos(np.radians(angle)), np.sin(np.radians(angle))
    return [(ax + c * (x - ax) - s * (y - ay), ay + s * (x - ax) + c * (y - ay))
            for x, y in [(b.x0, b.y0), (b.x1, b.y0), (b.x1, b.y1), (b.x0, b.y1)]]


def _layout(matrix):
    """Draw ``matrix``; return (texts, cells, rules, figure box) in display pixels: texts
    and cells as {gid or label: polygon}, rules as {gid: segment}."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle
    from matplotlib.text import Text

    from conformance.figures import matrix_figure

    fig = matrix_figure(matrix)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        texts = {}
        for k, t in enumerate(fig.findobj(Text)):
            if t.get_visible() and t.get_text().strip():
                texts[t.get_gid() or f"text-{k}:{t.get_text()}"] = _text_polygon(t, renderer)
        cells = {r.get_gid(): [tuple(v) for v in r.get_verts()[:4]]
                 for r in fig.findobj(Rectangle) if (r.get_gid() or "").startswith("cell-")}
        rules = {}
        for line in fig.findobj(Line2D):
            if (line.get_gid() or "").endswith(tuple("0123456789")):
                xy = line.get_transform().transform(line.get_xydata())
                rules[line.get_gid()] = [tuple(xy[0]), tuple(xy[-1])]
        w, h = fig.canvas.get_width_height()
        frame = [(0, 0), (w, 0), (w, h), (0, h)]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return texts, cells, rules, frame


def _synthetic(n_cols: int, interleave: bool = True) -> dict:
    """A matrix with ``n_cols`` implementations, kfac_ref's runs and peers interleaved in
    ``cells`` (as an alphabetical merge gives them), long names, every outcome, wide marks
    and every kind of verdict."""
    names = []
    for j in range(n_cols):
        own = (j % 2 == 1) if interleave else True
        names.append(f"kfac_ref_backend_{j}" if own else f"peer_{'x' * (j % 5)}{j}")
    caps = ["linalg.a_rather_long_capability_name", "factors.b", "networks.kfac",
            "losses.d"]
    kinds = ["pass", "pass (convention: kron_order=GA)", "FAIL 12/120 (scale:N)",
             "FAIL 3/7 (error)", "xfail 1/2", "skip (unsupported)"]
    cells = {n: {c: kinds[(i + j) % len(kinds)] for i, c in enumerate(caps)}
             for j, n in enumerate(names)}
    verdicts = [{"ok": True, "unavailable": ""}, {"ok": False, "unavailable": ""},
                {"ok": None, "unavailable": "no module named it"}]
    return {"date": "2030-01-01", "capabilities": caps, "cells": cells,
            "implementations": {n: verdicts[j % 3] for j, n in enumerate(names)}}


def _committed_matrix() -> dict:
    return json.loads((ROOT / "conformance/peers/reports/matrix.json")
                      .read_text(encoding="utf-8"))


LAYOUTS = {
    "committed": _committed_matrix,
    "tiny": lambda: TINY,
    **{f"{n}-columns": (lambda n=n: _synthetic(n)) for n in (1, 2, 3, 7, 16)},
    "own-only": lambda: _synthetic(4, interleave=False),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_matrix_figure_labels_cells_and_rules_do_not_overlap(name):
    pytest.importorskip("matplotlib")
    matrix = LAYOUTS[name]()
    texts, cells, rules, frame = _layout(matrix)
    impls, caps, grid = outcome_grid(matrix)
    assert len(cells) == len(impls) * len(caps)
    clashes = []
    items = list(texts.items())
    for a, (ka, pa) in enumerate(items):
        if not _inside(pa, frame):
            clashes.append(f"{ka} runs off the figure")
        clashes += [f"{ka} overlaps {kb}" for kb, pb in items[a + 1:] if _overlap(pa, pb)]
        for kc, pc in cells.items():
            own_cell = ka.startswith("mark-") and kc.startswith(ka.replace("mark", "cell") + "-")
            if own_cell:
                if not _inside(pa, pc):
                    clashes.append(f"{ka} is not inside its cell {kc}")
            elif _overlap(pa, pc):
                clashes.append(f"{ka} overlaps {kc}")
        clashes += [f"{ka} is crossed by {kr}" for kr, pr in rules.items() if _overlap(pa, pr)]
    boxes = list(cells.items())
    for a, (ka, pa) in enumerate(boxes):
        clashes += [f"{ka} overlaps {kb}" for kb, pb in boxes[a + 1:] if _overlap(pa, pb)]
        clashes += [f"{ka} is crossed by {kr}" for kr, pr in rules.items() if _overlap(pa, pr)]
    assert not clashes, f"{len(clashes)} overlaps, e.g. " + "; ".join(clashes[:8])


@pytest.mark.parametrize("name", ["committed", "7-columns", "16-columns"])
def test_matrix_figure_draws_kfac_ref_runs_first_then_a_rule_then_the_peers(name):
    pytest.importorskip("matplotlib")
    matrix = LAYOUTS[name]()
    texts, cells, rules, _ = _layout(matrix)
    impls, caps, _ = outcome_grid(matrix)
    left = {j: min(x for x, _ in cells[next(k for k in cells if k.startswith(f"cell-0-{j}-"))])
            for j in range(len(impls))}
    own = sorted(left[j] for j, n in enumerate(impls) if n.startswith("kfac_ref"))
    peers = sorted(left[j] for j, n in enumerate(impls) if not n.startswith("kfac_ref"))
    assert own and peers and own[-1] < peers[0]
    # Columns keep their relative order within each group, one column width apart.
    assert [left[j] for j, n in enumerate(impls) if n.startswith("kfac_ref")] == own
    (rule,) = [r for k, r in rules.items() if k.startswith("group-rule")]
    assert rule[0][0] == pytest.approx(rule[1][0])  # vertical
    right_of_own = max(x for k, p in cells.items() for x, _ in p
                       if impls[int(k.split("-")[2])].startswith("kfac_ref"))
    assert right_of_own < rule[0][0] < peers[0]
    # Each name and verdict sits over its own column.
    for j, n in enumerate(impls):
        col = next(p for k, p in cells.items() if k.startswith(f"cell-0-{j}-"))
        x0, x1 = min(x for x, _ in col), max(x for x, _ in col)
        if f"verdict-{j}" in texts:
            xs = [x for x, _ in texts[f"verdict-{j}"]]
            assert x0 - TOL <= min(xs) and max(xs) <= x1 + TOL, n
        name_x = min(x for x, _ in texts[f"name-{j}"])
        assert x0 <= name_x <= x1, n


def test_column_order_puts_kfac_ref_runs_first():
    from conformance.figures import column_order

    assert column_order(["asdl", "kfac_jax", "kfac_ref", "kfac_ref_torch", "tf_kfac"]) == [
        2, 3, 0, 1, 4]
    assert column_order(["a", "b"]) == [0, 1]
    assert column_order(["kfac_ref"]) == [0]
