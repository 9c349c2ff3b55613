"""The suite's shipped text cites what its readers have: the docs pages, papers, issues and
the peers' own source files; every docs section a diagnosis links to exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conformance.diagnosis import DOCS, DOCS_PAGES, PITFALLS, docs_link, section_id

ROOT = Path(__file__).resolve().parents[2]
UNSHIPPED = re.compile(r"FORMULAS|DESIGN\.md|PEERS\.md")


def _shipped_text_files():
    for base in (ROOT / "conformance", ROOT / "tests"):
        for path in base.rglob("*"):
            if path.suffix in (".py", ".md", ".json", ".txt") and path.is_file():
                if base.name == "tests" and not path.name.startswith("test_conformance"):
                    continue
                yield path


def test_no_citation_of_files_users_do_not_have():
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _shipped_text_files()
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if UNSHIPPED.search(line) and p.name != Path(__file__).name]
    assert hits == []


def _headings(rst: str) -> list[str]:
    lines = rst.splitlines()
    return [a.strip() for a, b in zip(lines, lines[1:], strict=False)
            if a.strip() and re.fullmatch(r"([=\-~^])\1{2,}", b.strip())]


@pytest.mark.parametrize("pitfall", sorted(DOCS))
def test_docs_link_targets_a_section_of_a_docs_page(pitfall):
    assert pitfall in PITFALLS
    page, section = DOCS[pitfall]
    src = ROOT / "docs" / f"{page}.rst"
    if not src.exists():
        pytest.skip("docs sources not present (installed package)")
    heads = _headings(src.read_text(encoding="utf-8"))
    assert heads[0] == DOCS_PAGES[page]
    assert section in heads
    label, url = docs_link(pitfall, base="https://example.org/docs")
    assert url == f"https://example.org/docs/{page}.html#{section_id(section)}"
    assert DOCS_PAGES[page] in label and section in label


def test_section_id_follows_docutils():
    docutils_nodes = pytest.importorskip("docutils.nodes")
    for page, section in set(DOCS.values()):
        assert section_id(section) == docutils_nodes.make_id(section), (page, section)


def test_docs_link_of_unknown_and_paired_pitfalls():
    assert docs_link("unexplained") is None
    assert docs_link("kron_order_swapped+scale:N")[1].endswith(
        "conventions.html#vectorisation-and-the-order-of-the-kronecker-factors")
