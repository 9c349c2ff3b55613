"""Sphinx extension: the backend support table, generated from kfac_ref.capabilities.

``.. kfac-support-table::`` renders one table per module: every public function and class
(linked to its API page) against the columns of :data:`kfac_ref.capabilities.COLUMNS`,
each cell "yes", "no" (with the reason as a footnote-like note) or "–" (not tested).
The page therefore cannot disagree with the declarations the tests check.
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


class SupportTable(SphinxDirective):
    has_content = False

    def run(self):
        from kfac_ref import capabilities

        container = nodes.container()
        self.state.nested_parse(StringList(_rst(capabilities.support_table(),
                                                capabilities.COLUMNS)),
                                self.content_offset, container)
        return container.children


_RUBRIC = ".. rubric:: Backend support"
_STASH: dict[str, list[str]] = {}


def _lift_support_rows(app, what, name, obj, options, lines):
    """Before numpydoc: take the backend-support rubric that
    ``kfac_ref.capabilities.annotate_docstrings`` appends to every public docstring out of
    the docstring, so that numpydoc does not read it as part of the last section (it would
    show ``.. rubric:: Backend support`` as a parameter name)."""
    for i, line in enumerate(lines):
        if line.strip() == _RUBRIC:
            _STASH[name] = list(lines[i:])
            del lines[i:]
            while lines and not lines[-1].strip():
                lines.pop()
            return


def _restore_support_rows(app, what, name, obj, options, lines):
    """After numpydoc: put the rubric back, as its own block after the rendered sections."""
    block = _STASH.pop(name, None)
    if block:
        lines += ["", *block]


def setup(app):
    app.add_directive("kfac-support-table", SupportTable)
    # numpydoc rewrites docstrings at the default priority (500)
    app.connect("autodoc-process-docstring", _lift_support_rows, priority=100)
    app.connect("autodoc-process-docstring", _restore_support_rows, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
