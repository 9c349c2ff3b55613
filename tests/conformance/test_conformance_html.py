"""The HTML report: one self-contained page per run with the outcome picture, every failing
case's numbers, diagnosis and docs link."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from conformance.diagnosis import docs_link
from conformance.html_report import html_report, outcome_svg
from conformance.reports import write_reports
from conformance.suite import run


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.attrs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.append((tag, dict(attrs)))


@pytest.fixture(scope="module")
def mutant_run(tmp_path_factory):
    report = run("mutant_kron_swapped", families=["linalg"], source="live")
    out = tmp_path_factory.mktemp("html")
    paths = write_reports(report, out)
    return report, paths


def test_written_next_to_the_other_reports(mutant_run):
    report, paths = mutant_run
    assert paths["html"].name == "report.html"
    assert paths["html"].parent == paths["json"].parent
    assert paths["html"].read_text(encoding="utf-8") == html_report(report.to_dict())


def test_self_contained(mutant_run):
    text = mutant_run[1]["html"].read_text(encoding="utf-8")
    p = _Collect()
    p.feed(text)
    assert "script" not in p.tags and "link" not in p.tags and "img" not in p.tags
    assert "svg" in p.tags and "style" in p.tags
    for tag, attrs in p.attrs:
        if tag == "a":  # links: docs pages (followed by the reader) or anchors in the page
            assert attrs["href"].startswith("#") or ".html#" in attrs["href"]
        assert "src" not in attrs


def test_failing_cases_with_numbers_diagnosis_and_docs_link(mutant_run):
    report, paths = mutant_run
    text = paths["html"].read_text(encoding="utf-8")
    assert '<span class="verdict FAILED">FAILED</span>' in text
    failed = [r for r in report.results if r.status == "fail"]
    assert len(failed) == 4
    _, url = docs_link("kron_order_swapped")
    for r in failed:
        block = text.split(f"<h3>FAIL {r.case_id}</h3>", 1)[1].split('<div class="case', 1)[0]
        assert f"relative error <b>{r.rel_err:.3e}</b> against the tolerance rtol " \
               f"{r.rtol:.3e}" in block
        assert "<code>kron_order_swapped</code> — Kronecker order swapped" in block
        assert f'<a href="{url}">docs page Conventions › Vectorisation and the order of the ' \
               "Kronecker factors</a>" in block
    # passing cases are not listed one by one
    assert "<h3>FAIL linalg.compute_cov" not in text


def test_outcome_picture_has_one_square_per_case_in_its_status_colour(mutant_run):
    report, _ = mutant_run
    svg = outcome_svg(report.to_dict())
    squares = re.findall(r'<a href="#case-[^"]+"><rect [^>]*fill="(#[0-9a-f]{6})"', svg)
    assert len(squares) == len(report.results)
    assert squares.count("#d6604d") == 4  # the failure colour of figures.OUTCOMES
    assert squares.count("#1b7837") == len(report.results) - 4
    # every square links to its case; failing cases have their anchor in the page
    text = html_report(report.to_dict())
    for r in report.results:
        if r.status == "fail":
            anchor = "case-" + "".join(c if c.isalnum() else "-" for c in r.case_id)
            assert f'id="{anchor}"' in text


def test_passing_run_and_escaping(tmp_path):
    report = run("kfac_ref", families=["averaging"], source="live")
    data = report.to_dict()
    data["adapter"]["description"] = "<b>x</b> & y"
    text = html_report(data)
    assert '<span class="verdict PASSED">PASSED</span>' in text
    assert "&lt;b&gt;x&lt;/b&gt; &amp; y" in text
    assert "Failures" not in text


def test_docs_base_from_the_environment(monkeypatch):
    monkeypatch.setenv("KFAC_REF_DOCS_URL", "https://docs.example.org/kfac_ref")
    assert docs_link("sum_vs_mean")[1] == \
        "https://docs.example.org/kfac_ref/theory/fisher_ggn.html#scale-mean-versus-sum"
