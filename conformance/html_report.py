"""One self-contained HTML page per run (``report.html``, next to JSON, JUnit and Markdown).

The page needs no network and no files beside it: the styles are inline and the outcome
picture is an inline SVG (one row per capability, one square per case, coloured by outcome
with the colours of :data:`conformance.figures.OUTCOMES`; hover a square for the case id).
Above it: the verdict and counts, the declared conventions and every failing or erroring case
with its numbers (relative error against the tolerance), the diagnosis (pitfall, explanation)
and a link to the docs section of the formula the pitfall gets wrong
(:func:`conformance.diagnosis.docs_link`); below it a table per capability and the skip
reasons.
"""

from __future__ import annotations

import html

from .diagnosis import PITFALLS, docs_link
from .figures import OUTCOMES

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
"""


def html_report(report: dict) -> str:
    """The HTML page of one run (``report`` = ``RunReport.to_dict()``)."""
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
    bad = [r for r in report["results"] if r["status"] in ("fail", "error", "xfail")]
    if bad:
        parts.append("<h2>Failures, errors and expected failures</h2>")
    for r in bad:
        parts.append(_case_html(r))
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
        out.append(f'<div>diagnosis: <span class="pit"><code>{_e(pid)}</code>'
                   f"{' — ' + _e(title) if title and title != pid else ''}</span>: "
                   f"{_e(d.get('explanation', ''))}</div>")
        link = docs_link(pid)
        if link:
            out.append(f'<div>formula: <a href="{_e(link[1])}">{_e(link[0])}</a></div>')
    if not d:  # an error, or a failure without diagnosis: the message says what happened
        out.append(f'<div class="meta">{_e(r.get("message", ""))}</div>')
    out.append("</div>")
    return "".join(out)
