"""Renderers of the result model (:mod:`conformance.results`): terminal progress and summary
table, JSON, JUnit XML, Markdown, a self-contained HTML page (:mod:`conformance.html_report`),
and the ecosystem matrix (implementation × capability) merged from runs' ``report.json``."""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from .diagnosis import PITFALLS
from .results import RunReport

__all__ = ["Progress", "terminal_summary", "legend", "write_reports", "write_matrix",
           "matrix_cell", "failure_text", "failure_details", "pitfall_title",
           "pitfall_meanings"]

_CHAR = {"pass": ".", "convention": "c", "fail": "F", "error": "E", "xfail": "x", "skip": "s"}


class Progress:
    """pytest-style progress: one character per case, a counter per capability line."""

    def __init__(self, stream=None, quiet=False):
        self.stream = stream or sys.stdout
        self.quiet = quiet
        self.current = None
        self.width = 0

    def __call__(self, case, result, index, total):
        if self.quiet:
            return
        if case.capability != self.current:
            if self.current is not None:
                self.stream.write("\n")
            self.current = case.capability
            label = f"{case.capability:<44.44}"
            self.stream.write(label + " ")
            self.width = 0
        self.stream.write(_CHAR[result.status])
        self.width += 1
        if index == total:
            self.stream.write(f"  [{index}/{total}]\n")
        self.stream.flush()


def _table(rows, headers):
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*headers), line.format(*("-" * w for w in widths))]
    out += [line.format(*map(str, r)) for r in rows]
    return "\n".join(out)


#: what the summary's columns, the progress symbols and the sources of expected values mean
LEGEND = """\
legend: pass = agrees with the reference within the case's tolerance; pass-declared = agrees
  once the reference is converted into the conventions the adapter declares (e.g. kron_order);
  fail = disagrees (diagnosis: the pitfall that reproduces the adapter's numbers); error = the
  adapter raised; xfail = an expected failure (--xfails), still diagnosed; skip = not compared
  (unsupported, --skips), never a pass.
progress: {symbols}
expected values: golden = the committed golden vectors (conformance/golden, sha256-checked);
  live = computed now by kfac_ref; golden+live = the golden vectors plus live cases they lack."""

#: column headers of the summary table, by status
_HEADERS = {"pass": "pass", "convention": "pass-declared", "fail": "fail", "error": "error",
            "xfail": "xfail", "skip": "skip"}


def legend() -> str:
    """The legend printed under the terminal summary."""
    symbols = "  ".join(f"{_CHAR[s]} {_HEADERS[s]}" for s in _CHAR)
    return LEGEND.format(symbols=symbols)


def terminal_summary(report: RunReport, with_legend: bool = True, verbose: bool = False) -> str:
    """The run as text: a table per capability, the legend, one line per failure in plain
    words (``verbose``: each failure in full, :func:`failure_details`), the verdict."""
    a = report.adapter
    lines = [f"\nkfac_ref conformance — adapter {a.get('name')} {a.get('version', '')} "
             f"(dtype {a.get('dtype')}; expected values: {report.source})"]
    nc = a.get("non_canonical_conventions") or {}
    if nc:
        lines.append("declared conventions: " + ", ".join(f"{k}={v!r}" for k, v in nc.items()))
    if report.unavailable:
        lines.append(f"ADAPTER UNAVAILABLE: {report.unavailable}")
    if report.interrupted:
        lines.append(f"RUN INTERRUPTED, INCOMPLETE: {report.interrupted}")
    rows = []
    for cap in report.capabilities():
        c = report.counts(cap)
        diags = sorted({r.diagnosis["pitfall"] for r in report.results
                        if r.capability == cap and r.diagnosis})
        rows.append([cap, *(c[s] for s in _HEADERS), ", ".join(diags)])
    tot = report.counts()
    rows.append(["TOTAL", *(tot[s] for s in _HEADERS), ""])
    lines.append(_table(rows, ["capability", *_HEADERS.values(), "diagnosis"]))
    if with_legend:
        lines.append(legend())
    bad = [r for r in report.results if r.status in ("fail", "error")]
    if bad:
        lines.append("\nFailures:")
        for r in bad:
            if verbose:
                lines += failure_details(r)
            else:
                lines.append(f"  {r.status.upper():5} {r.case_id}: {failure_text(r)}")
        meanings = pitfall_meanings(r.diagnosis["pitfall"] for r in bad if r.diagnosis)
        if meanings and not verbose:
            lines.append("What the diagnoses mean:")
            lines += [f"  {m}" for m in meanings]
    for fam, why in report.absent.items():
        lines.append(f"absent family {fam}: {why}")
    n_cmp = tot["pass"] + tot["convention"]
    verdict = "PASSED" if report.ok else "FAILED"
    if report.interrupted:
        verdict = "INTERRUPTED"
    elif n_cmp == 0 and not bad:
        verdict += " (nothing was compared: an empty run never passes)"
    lines.append(f"\n{verdict}: {tot['pass']} passed, {tot['convention']} passed under declared "
                 f"conventions, {tot['fail']} failed, {tot['error']} errors, {tot['xfail']} "
                 f"expected failures, {tot['skip']} skipped in {report.duration_s:.1f} s")
    return "\n".join(lines)


_CIRCULAR = re.compile(r"matches what the reference computes with the pitfall '[^']*'(, )?")


def _pitfall_ids(pitfall: str) -> list[str]:
    """The known pitfall ids a diagnosis names (``a+b`` pairs, ``per_layer:...``)."""
    if pitfall.startswith("per_layer"):
        return ["per_layer"]
    return [p for p in pitfall.split("+") if p in PITFALLS] or [pitfall]


def pitfall_title(pitfall: str) -> str:
    """A diagnosis's pitfall id in plain words (``a+b``: both titles)."""
    return " + ".join(PITFALLS.get(p, (p,))[0] for p in _pitfall_ids(pitfall))


def pitfall_meanings(pitfalls) -> list[str]:
    """``title (id): what it means`` for each distinct pitfall named in ``pitfalls``."""
    seen = []
    for pid in pitfalls:
        seen += [p for p in _pitfall_ids(pid)
                 if p in PITFALLS and p != "unexplained" and p not in seen]
    return [f"{PITFALLS[p][0]} ({p}): {PITFALLS[p][1]}" for p in seen]


def failure_text(result) -> str:
    """One failing or erroring :class:`~conformance.results.CaseResult` in plain words: the
    numbers, then the pitfall's title and the diagnosis's evidence (without the circular
    "matches what the reference computes with the pitfall ..." when the title already says
    it)."""
    message, diagnosis = result.message, result.diagnosis
    if not diagnosis:
        return message
    detail = message.split("; diagnosis: ", 1)[0]
    pid = diagnosis["pitfall"]
    evidence = _CIRCULAR.sub("", diagnosis.get("explanation", "")).strip(" ,")
    if pid == "unexplained":
        return f"{detail}; not explained by any known pitfall (nor up to three together)"
    text = f"{detail} — diagnosis: {pitfall_title(pid)}"
    return text + (f" ({evidence})" if evidence else "")


def failure_details(result) -> list[str]:
    """One failing or erroring result in full, as indented lines: the case, its numbers, the
    diagnosis in plain words with its evidence, and the documented formula it concerns."""
    from .diagnosis import DOCS, DOCS_PAGES, docs_link
    from .html_report import _DOCS, _docs_built

    r = result
    out = [f"  {r.status.upper():5} {r.case_id}"]
    if getattr(r, "description", ""):
        out.append(f"        case: {r.description}")
    d = r.diagnosis
    if not d:
        return out + [f"        {r.message}"]
    out.append("        " + r.message.split("; diagnosis: ", 1)[0])
    pid = d["pitfall"]
    for p in _pitfall_ids(pid):
        if p in PITFALLS:
            title, meaning, evidence = PITFALLS[p]
            out.append(f"        diagnosis: {title} ({p}): {meaning}")
            if evidence and p != "unexplained":
                out.append(f"        reported in: {evidence}")
            if p in DOCS:
                page, section = DOCS[p]
                where = ""
                if _docs_built():
                    where = f" ({docs_link(p)[1]})"
                elif (_DOCS / f"{page}.rst").is_file():
                    where = f" ({_DOCS / page}.rst)"
                out.append(f"        formula: docs page {DOCS_PAGES[page]} › {section}{where}")
    explanation = _CIRCULAR.sub("", d.get("explanation", "")).strip(" ,")
    if explanation:
        out.append(f"        evidence: {explanation}")
    return out


def _junit(report: RunReport) -> bytes:
    suites = ET.Element("testsuites", name=f"kfac_ref-conformance-{report.adapter.get('name')}")
    for cap in report.capabilities():
        c = report.counts(cap)
        rs = [r for r in report.results if r.capability == cap]
        suite = ET.SubElement(suites, "testsuite", name=cap, tests=str(len(rs)),
                              failures=str(c["fail"]), errors=str(c["error"]),
                              skipped=str(c["skip"] + c["xfail"]),
                              time=f"{sum(r.duration_s for r in rs):.6f}")
        for r in rs:
            tc = ET.SubElement(suite, "testcase", classname=cap, name=r.case_id,
                               time=f"{r.duration_s:.6f}")
            if r.status == "fail":
                ET.SubElement(tc, "failure", message=r.message,
                              type=(r.diagnosis or {}).get("pitfall", "value")).text = r.message
            elif r.status == "error":
                ET.SubElement(tc, "error", message=r.message).text = r.message
            elif r.status in ("skip", "xfail"):
                ET.SubElement(tc, "skipped", message=r.message)
            elif r.message:
                ET.SubElement(tc, "system-out").text = r.message
    ET.indent(suites)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True)


def _markdown(report: RunReport) -> str:
    a = report.adapter
    out = [f"# kfac_ref conformance report: `{a.get('name')}`", "",
           f"- implementation: {a.get('description', '')} — version `{a.get('version', '')}`",
           f"- dtype: {a.get('dtype')}; expected values: {report.source} (golden = the committed "
           "golden vectors, live = computed by kfac_ref)",
           f"- started {report.started} UTC, {report.duration_s:.1f} s; "
           f"Python {report.environment.get('python')}, NumPy {report.environment.get('numpy')}"
           f", kfac_ref {report.environment.get('kfac_ref')}",
           f"- verdict: **{'PASSED' if report.ok else 'FAILED'}**", ""]
    nc = a.get("non_canonical_conventions") or {}
    if nc:
        out.append("Declared conventions (differences from the reference): " +
                   ", ".join(f"`{k}={v!r}`" for k, v in nc.items()))
        out.append("")
    if report.unavailable:
        out += [f"**Adapter unavailable**: {report.unavailable}", ""]
    if report.interrupted:
        out += [f"**Run interrupted, incomplete**: {report.interrupted}", ""]
    out += ["| capability | pass | pass under declared convention | fail | error | xfail | skip "
            "| diagnosis |",
            "|---|---|---|---|---|---|---|---|"]
    for cap in report.capabilities():
        c = report.counts(cap)
        diags = sorted({r.diagnosis["pitfall"] for r in report.results
                        if r.capability == cap and r.diagnosis})
        out.append(f"| `{cap}` | {c['pass']} | {c['convention']} | {c['fail']} | {c['error']} | "
                   f"{c['xfail']} | {c['skip']} | {', '.join(diags)} |")
    bad = [r for r in report.results if r.status in ("fail", "error", "xfail")]
    if bad:
        out += ["", "## Failures and expected failures", ""]
        for r in bad:
            out.append(f"- **{r.status}** `{r.case_id}`: {r.message}")
            if r.diagnosis:
                title = PITFALLS.get(r.diagnosis["pitfall"].split("+")[0], ("",))[0]
                if title:
                    out.append(f"  - pitfall: {title}")
    skipped = sorted({r.message for r in report.results if r.status == "skip"})
    if skipped:
        out += ["", "## Skip reasons", ""] + [f"- {m}" for m in skipped]
    if report.absent:
        out += ["", "## Capability families absent from the catalogue", ""]
        out += [f"- {k}: {v}" for k, v in report.absent.items()]
    return "\n".join(out) + "\n"


def write_reports(report: RunReport, out_dir) -> dict:
    """Write report.json, junit.xml, report.md and report.html under ``out_dir/<adapter>/``."""
    from .html_report import html_report

    d = Path(out_dir) / str(report.adapter.get("name"))
    d.mkdir(parents=True, exist_ok=True)
    paths = {"json": d / "report.json", "junit": d / "junit.xml", "markdown": d / "report.md",
             "html": d / "report.html"}
    paths["json"].write_text(json.dumps(report.to_dict(), indent=1, ensure_ascii=False) + "\n",
                             encoding="utf-8")
    paths["html"].write_text(html_report(report), encoding="utf-8")
    paths["junit"].write_bytes(_junit(report))
    paths["markdown"].write_text(_markdown(report), encoding="utf-8")
    return paths


# -- ecosystem matrix --------------------------------------------------------------------
def matrix_cell(counts: dict, results: list) -> str:
    """One cell: pass / fail (diagnosis) / skip / convention, from a capability's results."""
    if counts.get("fail") or counts.get("error"):
        diags = sorted({r["diagnosis"]["pitfall"] for r in results if r.get("diagnosis")})
        n = counts.get("fail", 0) + counts.get("error", 0)
        tot = sum(counts.values()) - counts.get("skip", 0)
        return f"FAIL {n}/{tot}" + (f" ({', '.join(diags)})" if diags else " (error)")
    if counts.get("xfail"):
        diags = sorted({r["diagnosis"]["pitfall"] for r in results if r.get("diagnosis")})
        return "xfail" + (f" ({', '.join(diags)})" if diags else "")
    if counts.get("convention"):
        convs = sorted({f"{k}={v}" for r in results for k, v in (r.get("conventions") or
                                                                  {}).items()})
        return "pass (convention: " + ", ".join(convs) + ")"
    if counts.get("pass"):
        return "pass"
    reasons = sorted({r.get("message", "") for r in results if r["status"] == "skip"})
    return "skip" + (f" ({_shorten(reasons[0], 90)})" if reasons else "")


def _shorten(text: str, width: int) -> str:
    """``text`` cut at a word boundary to at most ``width`` characters (… when cut)."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    cut = text[:width - 1].rsplit(" ", 1)[0].rstrip(" ,;:(")
    return cut + "…"


def _md_cell(text) -> str:
    """A Markdown table cell: pipes (e.g. in |T|) escaped."""
    return str(text).replace("|", "\\|")


def write_matrix(reports: list, out_dir, date: str | None = None) -> dict:
    """Write matrix.md and matrix.json from runs: :class:`~conformance.results.RunReport` s or
    their ``report.json`` (:meth:`~conformance.results.RunReport.to_dict`, loaded)."""
    reports = [r.to_dict() if isinstance(r, RunReport) else r for r in reports]
    caps = []
    for rep in reports:
        for c in rep["capabilities"]:
            if c not in caps:
                caps.append(c)
    cells = {}
    for rep in reports:
        name = rep["adapter"]["name"]
        cells[name] = {}
        for cap in caps:
            rs = [r for r in rep["results"] if r["capability"] == cap]
            counts = rep["capabilities"].get(cap, {})
            cells[name][cap] = matrix_cell(counts, rs) if rs else "skip (not in this run)"
            if rep.get("unavailable"):
                cells[name][cap] = "skip (adapter unavailable)"
    data = {
        "schema": "kfac_ref.conformance.matrix/1",
        "date": date or max((rep.get("started", "") for rep in reports), default=""),
        "implementations": {rep["adapter"]["name"]: {
            "version": rep["adapter"].get("version", ""),
            "dtype": rep["adapter"].get("dtype"),
            "conventions": rep["adapter"].get("non_canonical_conventions", {}),
            "ok": rep.get("ok"), "unavailable": rep.get("unavailable", ""),
            "counts": rep.get("counts", {})} for rep in reports},
        "capabilities": caps,
        "cells": cells,
    }
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "matrix.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n",
                                   encoding="utf-8")
    names = list(cells)
    md = ["# K-FAC ecosystem conformance matrix", "",
          f"Generated by `python -m conformance` on {data['date']} (latest run; one run per "
          "implementation, merged with `python -m conformance matrix`). Cells: `pass`; "
          "`pass (convention: …)` = agrees once the declared convention is applied; "
          "`FAIL k/n (diagnosis)` = k of the n compared cases disagree, with the pitfall the "
          "diagnosis named; `skip (reason)` = not compared (never a pass).", "",
          "| implementation | version | declared conventions | cases: pass / convention / "
          "fail / error / skip | verdict |", "|---|---|---|---|---|"]
    for name, info in data["implementations"].items():
        conv = ", ".join(f"{k}={v}" for k, v in info["conventions"].items()) or "canonical"
        verdict = ("unavailable: " + info["unavailable"]) if info["unavailable"] else (
            "PASSED" if info["ok"] else "FAILED")
        c = info.get("counts") or {}
        counts = " / ".join(str(c.get(k, 0)) for k in
                            ("pass", "convention", "fail", "error", "skip"))
        md.append("| " + " | ".join(_md_cell(x) for x in (
            name, info["version"], conv, counts, verdict)) + " |")
    md += ["", "| capability | " + " | ".join(names) + " |",
           "|---|" + "---|" * len(names)]
    for cap in caps:
        md.append(f"| `{cap}` | " + " | ".join(_md_cell(cells[n][cap]) for n in names) + " |")
    (d / "matrix.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    _matrix_figures(data, d)
    return data


def _matrix_figures(data: dict, out_dir: Path) -> list:
    """The matrix as pictures (matrix.png, matrix.svg) when matplotlib is installed (the docs
    extra); otherwise one line says why they were skipped."""
    try:
        from .figures import write_matrix_figures

        paths = write_matrix_figures(data, out_dir)
    except ImportError as exc:
        print(f"matrix figures skipped: {exc} (they need matplotlib: "
              'pip install "kfac_ref[docs]")')
        return []
    print("matrix figures: " + ", ".join(str(p) for p in paths))
    return paths
