"""The ecosystem matrix as a picture: capabilities × implementations, one colour per outcome.

:func:`write_matrix_figures` draws ``matrix.png`` and ``matrix.svg`` from the dict that
``python -m conformance matrix`` stores in ``matrix.json``.  One row per capability (grouped
by family: ``linalg``, ``factors``, ``networks``, ...), one column per implementation
(kfac_ref's own backends first, then the peers), and above each column the run's verdict.
A cell's colour is the outcome of that capability's cases:

========================  ===========  ===================================================
outcome                   cell mark    meaning
========================  ===========  ===================================================
pass                      ✓            agrees with the reference within the tolerance
pass under a convention   c            agrees once its declared conventions are applied
fail                      F k/n        k of n cases disagree (a diagnosis names why)
error                     E k/n        k of n cases raised instead of returning numbers
expected failure          x            a known disagreement listed as expected
skip / unsupported        (blank)      not compared: never a pass
========================  ===========  ===================================================

The picture is a summary: the reasons for skips, the diagnoses of failures and the declared
conventions are in the full table (``matrix.md``) and in each run's ``report.md``.

Schema relied on (keys of ``matrix.json``; anything else is ignored):

* ``cells``: ``{implementation: {capability: cell}}`` where ``cell`` is the string written by
  :func:`conformance.reports.matrix_cell`: ``pass``, ``pass (convention: ...)``,
  ``FAIL k/n (diagnoses)`` (``FAIL k/n (error)`` when the cases raised and no diagnosis was
  made), ``xfail ...`` or ``skip ...``.  Matched on the leading word, case-insensitively;
  ``error ...`` and ``unsupported ...`` are read as error and skip.
* ``capabilities``: the row order (optional; default: the order of the first
  implementation's cells, then any others).
* ``implementations``: ``{implementation: {"ok": bool, "unavailable": str}}`` for the
  verdicts (optional; a column without it gets no verdict).  Column order is that of
  ``cells``.
* ``date``: the date of the latest run, shown in the title (optional).

matplotlib is imported inside :func:`write_matrix_figures` (it is in the ``docs`` extra, not
a dependency of the suite), with the Agg backend; the files carry no timestamp or version, so
equal matrices give equal files.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["OUTCOMES", "classify_cell", "column_order", "matrix_figure", "outcome_grid",
           "write_matrix_figures"]

# outcome -> (legend label, face colour, mark colour).  Colours from ColorBrewer's PRGn
# (green: agreement, purple: error) plus a red for failures; readable in grey scale through
# the marks.
OUTCOMES = {
    "pass": ("pass", "#1b7837", "white"),
    "convention": ("pass under a declared convention", "#a6dba0", "#00441b"),
    "fail": ("fail (k of n cases)", "#d6604d", "white"),
    "error": ("error (k of n cases)", "#762a83", "white"),
    "xfail": ("expected failure", "#f4a582", "#67001f"),
    "skip": ("skip / unsupported", "#e8e8e8", "#e8e8e8"),
}
_COUNT = re.compile(r"(\d+)\s*/\s*(\d+)")


def classify_cell(cell: str) -> str:
    """The outcome (a key of :data:`OUTCOMES`) of one matrix cell string."""
    if not isinstance(cell, str):
        raise TypeError(f"classify_cell: cell must be a str; got {type(cell).__name__}.")
    text = cell.strip().lower()
    word = re.match(r"[a-z]*", text).group(0)
    if word == "pass":
        return "convention" if text.startswith("pass (convention") else "pass"
    if word == "fail":
        return "error" if text.endswith("(error)") else "fail"
    if word in ("error", "xfail", "skip"):
        return word
    if word == "unsupported":
        return "skip"
    raise ValueError(
        "classify_cell: cell must start with pass, fail, error, xfail, skip or unsupported; "
        f"got {cell!r}."
    )


def _mark(outcome: str, cell: str) -> str:
    if outcome in ("fail", "error"):
        m = _COUNT.search(cell)
        return ("F " if outcome == "fail" else "E ") + (f"{m[1]}/{m[2]}" if m else "")
    return {"pass": "✓", "convention": "c", "xfail": "x"}.get(outcome, "")


def outcome_grid(matrix: dict) -> tuple[list[str], list[str], list[list[str]]]:
    """``(implementations, capabilities, grid)`` with ``grid[i][j]`` the outcome of
    capability ``i`` for implementation ``j`` (``skip`` where the matrix has no cell)."""
    cells = matrix.get("cells") if isinstance(matrix, dict) else None
    if not isinstance(cells, dict) or not cells:
        raise ValueError("outcome_grid: matrix must be a dict with a non-empty 'cells' "
                         "mapping {implementation: {capability: cell}}; got "
                         f"{type(matrix).__name__} without one.")
    impls = list(cells)
    caps = list(matrix.get("capabilities") or [])
    for per_impl in cells.values():
        caps += [c for c in per_impl if c not in caps]
    grid = [[classify_cell(cells[n][c]) if c in cells[n] else "skip" for n in impls]
            for c in caps]
    return impls, caps, grid


def _verdict(info) -> tuple[str, str]:
    """(text, colour) of an implementation's verdict from its ``implementations`` entry."""
    if not isinstance(info, dict):
        return "", "black"
    if info.get("unavailable"):
        return "unavailable", "#555555"
    if info.get("ok") is True:
        return "PASSED", OUTCOMES["pass"][1]
    if info.get("ok") is False:
        return "FAILED", OUTCOMES["fail"][1]
    return "", "black"


def _text_width(text: str, size: float, family: str = "DejaVu Sans",
                weight: str = "normal") -> float:
    """Width in inches of ``text`` set in the given font (measured on the glyphs)."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    prop = FontProperties(family=family, size=size, weight=weight)
    return TextToPath().get_text_width_height_descent(text, prop, ismath=False)[0] / 72


def column_order(implementations) -> list[int]:
    """Display order of the columns: kfac_ref's own runs (names starting with ``kfac_ref``)
    first, then the peers, each group in its given order; indices into ``implementations``."""
    names = list(implementations)
    own = [j for j, n in enumerate(names) if n.startswith("kfac_ref")]
    return own + [j for j, n in enumerate(names) if not n.startswith("kfac_ref")]


def matrix_figure(matrix: dict):
    """The matrix dict (``matrix.json``) drawn as a matplotlib figure (not saved).

    Layout, in inches: the capability labels on the left, one column per implementation
    (kfac_ref's own runs, a gap and a rule, then the peers: :func:`column_order`), above each
    column its verdict and its name slanted at 40 degrees, the legend below.  Column width
    and margins are measured on the glyphs of the labels, marks and verdicts they hold, so
    nothing overlaps for any number of columns or length of names.  The cell of capability
    ``i`` and implementation ``j`` (``j`` indexes the matrix's ``cells``, not the display
    order) carries the SVG id ``cell-<i>-<j>-<outcome>``.

    Raises ModuleNotFoundError when matplotlib is not installed.
    """
    impls, caps, grid = outcome_grid(matrix)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    cells = matrix["cells"]
    infos = matrix.get("implementations") or {}
    n_rows = len(caps)
    order = column_order(impls)
    own = [impls[j].startswith("kfac_ref") for j in order]
    # x (in column widths) of each displayed column: a gap where the group changes.
    gap = 0.25
    xs, x = [], 0.0
    for k in range(len(order)):
        if k and own[k] != own[k - 1]:
            x += gap
        xs.append(x)
        x += 1.0
    width = x  # in column widths
    boundaries = [xs[k] - gap / 2 for k in range(1, len(order)) if own[k] != own[k - 1]]

    # Sizes in inches, measured on the glyphs (DejaVu, the fonts the figure is set in).
    marks = [_mark(grid[i][j], cells[impls[j]].get(caps[i], ""))
             for i in range(n_rows) for j in range(len(impls))]
    verdicts = [_verdict(infos.get(n))[0] for n in impls]
    widest = max([_text_width(m, 7.5 if len(m) > 3 else 9, weight="bold") for m in marks]
                 + [_text_width(v, 7, weight="bold") for v in verdicts])
    col_w = max(0.46, (widest + 0.04) / 0.92)  # 0.92 of a column is the cell
    row_h = 0.26
    label_w = 0.2 + max(_text_width(c, 7.5, "DejaVu Sans Mono") for c in caps)
    # Column names at 40 degrees from the point 0.45 of a column in, above the verdicts.
    cos40, sin40 = 0.766, 0.643
    name_h = 0.16  # the height of a line of 9-point text, in inches
    slant = [_text_width(n, 9) for n in impls]
    right = max(0.15, max((xs[k] + 0.45) * col_w + cos40 * slant[j]
                          for k, j in enumerate(order)) - width * col_w + 0.1)
    head_h = 0.45 + 0.3 + sin40 * max(slant) + cos40 * name_h  # title, verdicts, names
    fig_w = label_w + width * col_w + right
    # The legend: as many of 3 columns as fit the figure's width, else the figure widens.
    present = [o for o in OUTCOMES if o != "xfail" or any("xfail" in r for r in grid)]
    labels = [f"{_mark(o, '') or ' '}  {OUTCOMES[o][0]}".strip() for o in present]
    em = 8.5 / 72
    for ncol in (3, 2, 1):
        rows = -(-len(labels) // ncol)
        cols = [labels[c * rows:(c + 1) * rows] for c in range(ncol)]
        legend_w = (sum(2.2 * em + max(_text_width(t, 8.5) for t in col) for col in cols if col)
                    + 1.5 * em * (ncol - 1) + 0.8 * em + 0.2)
        if legend_w <= fig_w:
            break
    title = "K-FAC ecosystem conformance matrix"
    if matrix.get("date"):
        title += f" (runs of {str(matrix['date'])[:10]})"
    fig_w = max(fig_w, legend_w, 0.2 + _text_width(title, 11, weight="bold"))
    foot_h = 0.45 + 0.2 * rows
    fig_h = head_h + n_rows * row_h + foot_h
    # Axes units: x in column widths, y in rows; a y offset in inches is dy / row_h.
    with plt.rc_context({"svg.hashsalt": "kfac_ref-matrix", "svg.fonttype": "path",
                         "font.family": "DejaVu Sans", "font.size": 8}):
        fig = plt.figure(figsize=(fig_w, fig_h))
        ax = fig.add_axes((label_w / fig_w, foot_h / fig_h, width * col_w / fig_w,
                           n_rows * row_h / fig_h))
        ax.set_xlim(0, width)
        ax.set_ylim(n_rows, 0)
        ax.set_axis_off()
        for i, cap in enumerate(caps):
            for k, j in enumerate(order):
                outcome = grid[i][j]
                _, face, ink = OUTCOMES[outcome]
                # The id names the cell in the SVG: cell-<row>-<column>-<outcome>.
                ax.add_patch(Rectangle((xs[k] + 0.04, i + 0.06), 0.92, 0.88, facecolor=face,
                                       edgecolor="none", gid=f"cell-{i}-{j}-{outcome}"))
                mark = _mark(outcome, cells[impls[j]].get(cap, ""))
                if mark:
                    ax.text(xs[k] + 0.5, i + 0.52, mark, ha="center", va="center",
                            color=ink, fontsize=7.5 if len(mark) > 3 else 9,
                            fontweight="bold", gid=f"mark-{i}-{j}")
            ax.text(-0.12 * 0.48 / col_w, i + 0.5, cap, ha="right", va="center",
                    family="DejaVu Sans Mono", fontsize=7.5, gid=f"capability-{i}")
            family = cap.split(".")[0]
            if i and caps[i - 1].split(".")[0] != family:  # a rule between families
                ax.plot([-(label_w - 0.05) / col_w, width], [i, i], color="#999999",
                        lw=0.6, clip_on=False, gid=f"family-rule-{i}")
        for k, j in enumerate(order):
            text, colour = _verdict(infos.get(impls[j]))
            if text:
                ax.text(xs[k] + 0.5, -0.3, text, ha="center", va="bottom",
                        fontsize=7, color=colour, fontweight="bold", gid=f"verdict-{j}")
            ax.text(xs[k] + 0.45, -1.15, impls[j], ha="left", va="bottom",
                    rotation=40, rotation_mode="anchor", fontsize=9, gid=f"name-{j}")
        for b, x_rule in enumerate(boundaries):  # between kfac_ref's runs and the peers
            ax.plot([x_rule] * 2, [0, n_rows], color="#999999", lw=0.6,
                    gid=f"group-rule-{b}")
        fig.text(0.1 / fig_w, 1 - 0.12 / fig_h, title, ha="left", va="top", fontsize=11,
                 fontweight="bold", gid="title")
        handles = [Patch(facecolor=OUTCOMES[o][1], edgecolor="#999999", linewidth=0.4,
                         label=label) for o, label in zip(present, labels, strict=True)]
        legend = fig.legend(handles=handles, loc="lower center", ncol=ncol, frameon=False,
                            bbox_to_anchor=(0.5, 0.05 / fig_h), fontsize=8.5,
                            handlelength=1.4, columnspacing=1.5)
        legend.set_gid("legend")
    return fig


def write_matrix_figures(matrix: dict, out_dir) -> list[Path]:
    """Draw the matrix dict (``matrix.json``) as ``matrix.png`` and ``matrix.svg`` in
    ``out_dir`` (:func:`matrix_figure`); return the two paths.

    Raises ModuleNotFoundError when matplotlib is not installed.
    """
    fig = matrix_figure(matrix)
    import matplotlib.pyplot as plt

    with plt.rc_context({"svg.hashsalt": "kfac_ref-matrix", "svg.fonttype": "path"}):
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "matrix.png", out / "matrix.svg"]
        fig.savefig(paths[0], dpi=150, metadata={"Software": None})
        fig.savefig(paths[1], metadata={"Date": None, "Creator": None})
        plt.close(fig)
    return paths
