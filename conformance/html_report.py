"""One self-contained HTML page per run (``report.html``, next to JSON, JUnit and Markdown).

The page needs no network and no files beside it: the styles are inline and the outcome
picture is an inline SVG (one row per capability, one square per case, coloured by outcome
with the colours of :data:`conformance.figures.OUTCOMES`; hover a square for the case id).
Above it: the verdict and counts, the declared conventions and every failing or erroring case
with its numbers (relative error against the tolerance), the diagnosis (pitfall, explanation)
and the docs section of the formula the pitfall gets wrong: a link to the built docs
(:func:`conformance.diagnosis.docs_link`) when they exist, else the section's text in the
page itself (:func:`section_text`), so the report needs no docs build; below it a table
per capability and the skip reasons.
"""

from __future__ import annotations

import html
from pathlib import Path

from .diagnosis import DOCS, DOCS_URL_VAR, PITFALLS, docs_link
from .figures import OUTCOMES
from .reports import _CIRCULAR
from .results import RunReport

#: the docs sources of a source checkout (absent from an installed suite)
_DOCS = Path(__file__).resolve().parent.parent / "docs"

__all__ = ["html_report", "outcome_svg"]

_CELL, _GAP, _LABEL_W = 11, 2, 300
#: the picture's legend: one square is one case
_LEGEND = {"pass": "pass", "convention": "pass under a declared convention", "fail": "fail",
           "error": "error", "xfail": "expected failure", "skip": "skip / unsupported"}


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def outcome_svg(report: dict) -> str:
    """Inline SVG: capabilities × cases, one square per case coloured by its status."""
    caps = list(report["capabilities"])
    by_cap = {c: [r for r in report["results"] if r["capability"] == c] for c in caps}
    most = max((len(v) for v in by_cap.values()), default=1)
    legend_w = sum(_CELL + 14 + 6 * len(label) for label in _LEGEND.values())
    width = max(_LABEL_W + most * (_CELL + _GAP) + 10, legend_w + 8)
    row_h = _CELL + 5
    legend_h = 26
    height = legend_h + len(caps) * row_h + 6
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="outcome of every case" '
           'font-family="sans-serif" font-size="11">']
    x = 4
    for status, label in _LEGEND.items():
        face = OUTCOMES[status][1]
        out.append(f'<rect x="{x}" y="6" width="{_CELL}" height="{_CELL}" fill="{face}" '
                   'stroke="#555" stroke-width="0.5"/>')
        out.append(f'<text x="{x + _CELL + 4}" y="{6 + _CELL - 1}">{_e(label)}</text>')
        x += _CELL + 14 + 6 * len(label)
    for i, cap in enumerate(caps):
        y = legend_h + i * row_h
        out.append(f'<text x="{_LABEL_W - 6}" y="{y + _CELL - 1}" text-anchor="end">'
                   f'{_e(cap)}</text>')
        for j, r in enumerate(by_cap[cap]):
            face = OUTCOMES.get(r["status"], OUTCOMES["skip"])[1]
            tip = f"{r['case_id']}: {r['status']}"
            if r.get("diagnosis"):
                tip += f" ({r['diagnosis']['pitfall']})"
            cx = _LABEL_W + j * (_CELL + _GAP)
            out.append(f'<a href="#{_anchor(r["case_id"])}"><rect x="{cx}" y="{y}" '
                       f'width="{_CELL}" height="{_CELL}" fill="{face}" stroke="#555" '
                       f'stroke-width="0.5"><title>{_e(tip)}</title></rect></a>')
    out.append("</svg>")
    return "".join(out)


def _anchor(case_id: str) -> str:
    return "case-" + "".join(ch if ch.isalnum() else "-" for ch in case_id)


_STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:1100px;
 padding:0 1em;color:#222;line-height:1.4}
h1{font-size:1.5em;margin-bottom:.2em} h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px
 solid #ddd} .meta{color:#555;font-size:.9em}
.verdict{display:inline-block;padding:.2em .7em;border-radius:4px;color:#fff;font-weight:bold}
.PASSED{background:#1b7837} .FAILED{background:#d6604d}
table{border-collapse:collapse;font-size:.9em;margin:.5em 0} td,th{border:1px solid #ddd;
 padding:.25em .6em;text-align:left} th{background:#f4f4f4} td.n{text-align:right}
.case{border:1px solid #e3b1a8;border-left:6px solid #d6604d;border-radius:4px;
 padding:.6em 1em;margin:1em 0;background:#fffafa} .case.error{border-left-color:#762a83}
.case h3{margin:.1em 0 .4em;font-size:1em;font-family:monospace} .pit{font-weight:bold}
code{background:#f4f4f4;padding:0 .2em} .svg{overflow-x:auto}
details.formula pre{white-space:pre-wrap;background:#f8f8f8;border:1px solid #ddd;
 padding:.5em;font-size:.85em;overflow:auto}
"""


def html_report(report) -> str:
    """The HTML page of one run: a :class:`~conformance.results.RunReport` or its
    ``report.json`` form (:meth:`~conformance.results.RunReport.to_dict`)."""
    if isinstance(report, RunReport):
        report = report.to_dict()
    a = report["adapter"]
    verdict = "PASSED" if report.get("ok") else "FAILED"
    c = report.get("counts", {})
    env = report.get("environment", {})
    conv = a.get("non_canonical_conventions") or {}
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>kfac_ref conformance: {_e(a.get('name'))} — {verdict}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>kfac_ref conformance report: <code>{_e(a.get('name'))}</code> "
        f'<span class="verdict {verdict}">{verdict}</span></h1>',
        f'<p class="meta">{_e(a.get("description", ""))} — version '
        f'<code>{_e(a.get("version", ""))}</code>; dtype {_e(a.get("dtype"))}; expected '
        f'values: {_e(report.get("source"))}; started {_e(report.get("started"))} UTC, '
        f'{report.get("duration_s", 0):.1f} s; Python {_e(env.get("python"))}, NumPy '
        f'{_e(env.get("numpy"))}, kfac_ref {_e(env.get("kfac_ref"))}</p>',
        f"<p>{c.get('pass', 0)} passed, {c.get('convention', 0)} passed under declared "
        f"conventions, <b>{c.get('fail', 0)} failed</b>, {c.get('error', 0)} errors, "
        f"{c.get('xfail', 0)} expected failures, {c.get('skip', 0)} skipped.</p>",
        "<p>Declared conventions (where the implementation differs from the reference): " +
        (", ".join(f"<code>{_e(k)}={_e(repr(v))}</code>" for k, v in conv.items())
         or "none (canonical)") + "</p>",
    ]
    if report.get("unavailable"):
        parts.append(f"<p><b>Adapter unavailable:</b> {_e(report['unavailable'])}</p>")
    if report.get("interrupted"):
        parts.append(f"<p><b>Run interrupted, incomplete:</b> {_e(report['interrupted'])}</p>")
    bad = [r for r in report["results"] if r["status"] in ("fail", "error", "xfail")]
    if bad:
        parts.append("<h2>Failures, errors and expected failures</h2>")
    for r in bad:
        parts.append(_case_html(r))
    parts.append(_formulas_html(bad))
    parts += ["<h2>Outcome of every case</h2>", f'<div class="svg">{outcome_svg(report)}</div>',
              "<h2>By capability</h2>",
              "<table><tr><th>capability</th><th>pass</th><th>pass under declared "
              "convention</th><th>fail</th><th>error</th><th>xfail</th><th>skip</th>"
              "<th>diagnosis</th></tr>"]
    for cap, cc in report["capabilities"].items():
        diags = sorted({r["diagnosis"]["pitfall"] for r in report["results"]
                        if r["capability"] == cap and r.get("diagnosis")})
        parts.append(f"<tr><td><code>{_e(cap)}</code></td>" + "".join(
            f'<td class="n">{cc.get(s, 0)}</td>' for s in
            ("pass", "convention", "fail", "error", "xfail", "skip")) +
            f"<td>{_e(', '.join(diags))}</td></tr>")
    parts.append("</table>")
    skips = sorted({r["message"] for r in report["results"] if r["status"] == "skip"})
    if skips:
        parts.append("<h2>Skip reasons</h2><ul>" +
                     "".join(f"<li>{_e(m)}</li>" for m in skips) + "</ul>")
    if report.get("absent_families"):
        parts.append("<h2>Capability families absent from the catalogue</h2><ul>" + "".join(
            f"<li>{_e(k)}: {_e(v)}</li>" for k, v in report["absent_families"].items()) +
            "</ul>")
    parts.append('<p class="meta">Written by <code>python -m conformance</code>; the same '
                 "run is in report.json, junit.xml and report.md next to this file.</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _docs_built() -> bool:
    """Whether the docs links of :func:`conformance.diagnosis.docs_link` lead somewhere: a
    docs URL is set, or the pages of a source checkout are built."""
    import os

    return bool(os.environ.get(DOCS_URL_VAR)) or (_DOCS / "_build" / "html" / "index.html"
                                                  ).is_file()


def section_text(page: str, section: str) -> str | None:
    """The reStructuredText of the section titled ``section`` of ``docs/<page>.rst`` in a
    source checkout (up to the next title of the same or a higher level), or None."""
    path = _DOCS / f"{page}.rst"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None

    def underline(i):
        if i + 1 >= len(lines) or not lines[i].strip():
            return None
        u = lines[i + 1].strip()
        return u[0] if u and len(set(u)) == 1 and not u[0].isalnum() and \
            len(u) >= len(lines[i].strip()) else None

    start = next((i for i in range(len(lines)) if lines[i].strip() == section and underline(i)),
                 None)
    if start is None:
        return None
    order = list(dict.fromkeys(u for u in map(underline, range(len(lines))) if u))
    level = order.index(underline(start))  # title levels in order of first use, as docutils
    body = []
    for i in range(start + 2, len(lines)):
        u = underline(i)
        if u and order.index(u) <= level:
            break
        body.append(lines[i])
    return "\n".join(body).strip("\n")


def _formula_html(pid: str) -> str:
    """Where the formula a pitfall gets wrong is documented: a link to the docs section
    (:func:`conformance.diagnosis.docs_link`); when the docs are not built here (and no
    ``$KFAC_REF_DOCS_URL`` is set) a pointer to the section's text, which the page ships
    once (:func:`_formulas_html`), so that the report reads without a docs build."""
    link = docs_link(pid)
    if not link:
        return ""
    out = f'<div>formula: <a href="{_e(link[1])}">{_e(link[0])}</a></div>'
    if _docs_built():
        return out
    page, section = DOCS[pid.split("+")[0]]
    if section_text(page, section) is None:  # an installed suite without the docs sources
        return out[:-6] + (f" (not built here: set {DOCS_URL_VAR} to the documentation's "
                           "address)</div>")
    return out[:-6] + (f' (not built here: <a href="#{_formula_anchor(page, section)}">its '
                       "text is below</a>)</div>")


def _formula_anchor(page: str, section: str) -> str:
    return "formula-" + "".join(c if c.isalnum() else "-" for c in f"{page}-{section}")


def _formulas_html(results: list) -> str:
    """The docs sections the diagnoses of ``results`` refer to, each once, as text from the
    checkout's docs sources: only when the docs are not built here."""
    if _docs_built():
        return ""
    seen, parts = [], []
    for r in results:
        pid = (r.get("diagnosis") or {}).get("pitfall", "").split("+")[0]
        if pid not in DOCS or DOCS[pid] in seen:
            continue
        seen.append(DOCS[pid])
        page, section = DOCS[pid]
        text = section_text(page, section)
        if text is not None:
            parts.append(f'<details class="formula" id="{_formula_anchor(page, section)}" '
                         f"open><summary>{_e(section)} — from docs/{_e(page)}.rst</summary>"
                         f"<pre>{_e(text)}</pre></details>")
    if not parts:
        return ""
    return ("<h2>The formulas these diagnoses concern</h2><p class=\"meta\">From the "
            "documentation's sources (reStructuredText; the built docs are not here).</p>"
            + "".join(parts))


def _num(x) -> str:
    return "—" if x is None else f"{x:.3e}"


def _case_html(r: dict) -> str:
    kind = r["status"]
    out = [f'<div class="case {kind}" id="{_anchor(r["case_id"])}">',
           f"<h3>{kind.upper()} {_e(r['case_id'])}</h3>"]
    if r.get("description"):
        out.append(f"<div>case: {_e(r['description'])}</div>")
    out.append(f"<div>relative error <b>{_num(r.get('rel_err'))}</b> against the tolerance "
               f"rtol {_num(r.get('rtol'))}</div>")
    d = r.get("diagnosis")
    if d:
        pid = d["pitfall"]
        title = PITFALLS.get(pid.split("+")[0], ("",))[0]
        meaning = PITFALLS.get(pid.split("+")[0], ("", ""))[1]
        evidence = _CIRCULAR.sub("", d.get("explanation", "")).strip(" ,")
        text = meaning if pid != "unexplained" else ""
        if evidence:
            text = f"{text} ({evidence})" if text else evidence
        out.append(f'<div>diagnosis: <span class="pit"><code>{_e(pid)}</code>'
                   f"{' — ' + _e(title) if title and title != pid else ''}</span>: "
                   f"{_e(text)}</div>")
        out.append(_formula_html(pid))
    if not d:  # an error, or a failure without diagnosis: the message says what happened
        out.append(f'<div class="meta">{_e(r.get("message", ""))}</div>')
    out.append("</div>")
    return "".join(out)
