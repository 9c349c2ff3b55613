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

__all__ = ["OUTCOMES", "classify_cell", "outcome_grid", "write_matrix_figures"]

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


def write_matrix_figures(matrix: dict, out_dir) -> list[Path]:
    """Draw the matrix dict (``matrix.json``) as ``matrix.png`` and ``matrix.svg`` in
    ``out_dir``; return the two paths.

    Raises ModuleNotFoundError when matplotlib is not installed.
    """
    impls, caps, grid = outcome_grid(matrix)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    cells = matrix["cells"]
    infos = matrix.get("implementations") or {}
    n_rows, n_cols = len(caps), len(impls)
    # Columns of kfac_ref's own backends, then a gap, then the peers.
    own = [n.startswith("kfac_ref") for n in impls]
    gap = 0.35 if any(own) and not all(own) else 0.0
    xs = [j + (gap if gap and not own[j] else 0.0) for j in range(n_cols)]
    width = n_cols + gap

    # Sizes in inches, from the label lengths (DejaVu: mono 0.6 em, sans about 0.6 em).
    row_h, col_w, pt = 0.26, 0.48, 1 / 72
    label_w = 0.25 + 0.6 * 8.5 * pt * max(len(c) for c in caps)
    slant = [0.6 * 9 * pt * len(n) for n in impls]  # column labels at 40 degrees
    right = max(0.15, max((xs[j] + 0.45) * col_w + 0.77 * slant[j] for j in range(n_cols))
                - width * col_w + 0.1)
    head_h = 0.45 + 0.3 + 0.64 * max(slant)  # title, verdicts, slanted labels
    foot_h = 0.85
    fig_w = label_w + width * col_w + right
    fig_h = head_h + n_rows * row_h + foot_h
    with plt.rc_context({"svg.hashsalt": "kfac_ref-matrix", "svg.fonttype": "path",
                         "font.family": "DejaVu Sans", "font.size": 8}):
        fig = plt.figure(figsize=(fig_w, fig_h))
        ax = fig.add_axes((label_w / fig_w, foot_h / fig_h, width * col_w / fig_w,
                           n_rows * row_h / fig_h))
        ax.set_xlim(0, width)
        ax.set_ylim(n_rows, 0)
        ax.set_axis_off()
        for i, cap in enumerate(caps):
            for j, name in enumerate(impls):
                outcome = grid[i][j]
                _, face, ink = OUTCOMES[outcome]
                # The id names the cell in the SVG: cell-<row>-<column>-<outcome>.
                ax.add_patch(Rectangle((xs[j] + 0.04, i + 0.06), 0.92, 0.88, facecolor=face,
                                       edgecolor="none", gid=f"cell-{i}-{j}-{outcome}"))
                mark = _mark(outcome, cells[name].get(cap, ""))
                if mark:
                    ax.text(xs[j] + 0.5, i + 0.52, mark, ha="center", va="center",
                            color=ink, fontsize=7.5 if len(mark) > 3 else 9,
                            fontweight="bold")
            ax.text(-0.12, i + 0.5, cap, ha="right", va="center", family="DejaVu Sans Mono",
                    fontsize=8.5)
            family = cap.split(".")[0]
            if i and caps[i - 1].split(".")[0] != family:  # a rule between families
                ax.plot([-label_w / col_w + 0.1, width], [i, i], color="#999999", lw=0.6,
                        clip_on=False)
        for j, name in enumerate(impls):
            text, colour = _verdict(infos.get(name))
            if text:
                ax.text(xs[j] + 0.5, -0.3, text, ha="center", va="bottom", fontsize=7,
                        color=colour, fontweight="bold")
            ax.text(xs[j] + 0.45, -1.15, name, ha="left", va="bottom", rotation=40,
                    rotation_mode="anchor", fontsize=9)
        if gap:
            ax.plot([sum(own) + gap / 2] * 2, [0, n_rows], color="#999999", lw=0.6)
        title = "K-FAC ecosystem conformance matrix"
        if matrix.get("date"):
            title += f" (runs of {str(matrix['date'])[:10]})"
        fig.text(0.1 / fig_w, 1 - 0.12 / fig_h, title, ha="left", va="top", fontsize=11,
                 fontweight="bold")
        present = [o for o in OUTCOMES if o != "xfail" or any("xfail" in r for r in grid)]
        handles = [Patch(facecolor=OUTCOMES[o][1], edgecolor="#999999", linewidth=0.4,
                         label=f"{_mark(o, '') or ' '}  {OUTCOMES[o][0]}".strip())
                   for o in present]
        legend = fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False,
                   bbox_to_anchor=(0.5, 0.05 / fig_h), fontsize=8.5, handlelength=1.4,
                   columnspacing=1.5)
        legend.set_gid("legend")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "matrix.png", out / "matrix.svg"]
        fig.savefig(paths[0], dpi=150, metadata={"Software": None})
        fig.savefig(paths[1], metadata={"Date": None, "Creator": None})
        plt.close(fig)
    return paths
