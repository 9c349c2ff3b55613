"""Sphinx extension: the backend support, generated from the ``@capabilities`` declarations
(read through :mod:`kfac_ref.capabilities`).

``.. kfac-support-table::`` renders one table per module: every public function and class
(linked to its API page) against the columns of :data:`kfac_ref.capabilities.COLUMNS`,
each cell "yes", "no" (with the reason as a footnote-like note) or "–" (not tested).
Each object's API page ends with its own row, appended at ``autodoc-process-docstring``
(nothing rewrites a docstring at import).  The pages therefore cannot disagree with the
declarations the tests check.
"""

from __future__ import annotations

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

_HEAD = {"array_api_strict": "strict"}
_CELL = {"yes": "yes", "no": "no", "untested": "–", "n/a": "n/a"}


def _rst(table, columns):
    by_module: dict[str, list] = {}
    for dotted, sup in table.items():
        by_module.setdefault(dotted.rsplit(".", 1)[0], []).append((dotted, sup))
    lines = []
    for mod, rows in by_module.items():
        lines += [f".. rubric:: :mod:`{mod}`", "", ".. list-table::", "   :header-rows: 1",
                  "   :class: kfac-support", ""]
        lines.append("   * - object")
        lines += [f"     - {_HEAD.get(c, c)}" for c in columns]
        for dotted, sup in rows:
            lines.append(f"   * - :py:obj:`~{dotted}`")
            for c in columns:
                cell = _CELL[sup.state(c)]
                if cell == "no":
                    cell = f"no ({sup.reasons.get(c, '')})"
                lines.append(f"     - {cell}")
        lines.append("")
    return lines


def support_row(support, columns) -> list[str]:
    """The reST lines of one object's support, appended to its API page: the columns it is
    supported and tested on, each "no" with its reason, the untested ones."""
    groups = {s: [c for c in columns if support.state(c) == s] for s in _CELL}
    lines = [".. rubric:: Backend support", ""]
    if groups["yes"]:
        lines.append("Supported and tested: " + ", ".join(
            "cupy (on a CUDA GPU)" if c == "cupy" else c for c in groups["yes"]) + ".")
    for col in groups["no"]:
        lines.append(f"Not supported: {col} ({support.reasons.get(col, 'see the docs')}).")
    if groups["untested"]:
        lines.append("Not tested: " + ", ".join(groups["untested"]) + ".")
    if groups["n/a"]:
        lines.append("Takes no arrays: any array library.")
    lines.append("See the docs page *Backend support*.")
    return lines


class SupportTable(SphinxDirective):
    has_content = False

    def run(self):
        from kfac_ref import capabilities

        container = nodes.container()
        self.state.nested_parse(StringList(_rst(capabilities.support_table(),
                                                capabilities.COLUMNS)),
                                self.content_offset, container)
        return container.children


def _append_support_row(app, what, name, obj, options, lines):
    """The object's row of the support table, appended to its API page when the docs are
    built (after numpydoc, as its own block after the rendered sections).  The docstrings
    themselves carry no support row: the declarations live in the ``@capabilities``
    decorators, and ``help(obj)`` does not show them."""
    if what not in ("function", "class", "decorator"):
        return
    from kfac_ref import KFACValueError, capabilities

    support = capabilities.support_table().get(name)
    if support is None:  # an alias documented under its own name (NaiveFullFactor)
        try:
            support = capabilities.support_of(obj)
        except KFACValueError:  # not a kfac_ref object
            return
    lines += ["", *support_row(support, capabilities.COLUMNS)]


def setup(app):
    app.add_directive("kfac-support-table", SupportTable)
    # numpydoc rewrites docstrings at the default priority (500)
    app.connect("autodoc-process-docstring", _append_support_row, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
