"""The suite's teeth: every deliberately wrong adapter must fail exactly the capabilities it
breaks, each with the expected diagnosis, and pass everything else."""

from __future__ import annotations

import pytest

from conformance.adapter import load_adapter
from conformance.adapters import mutants
from conformance.catalogue import build_catalogue, capabilities
from conformance.runner import run_adapter

MUTANTS = sorted(mutants())


@pytest.fixture(scope="module")
def live():
    cases, _ = build_catalogue()
    return cases, capabilities()


def test_there_are_mutants():
    assert len(MUTANTS) >= 10


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught_with_the_right_diagnosis(live, name):
    cases, caps = live
    adapter = load_adapter(name)
    assert adapter.EXPECTED, f"{name} declares no expected diagnosis"
    # the families it breaks, plus linalg and averaging to check that the rest still passes
    families = {c.split(".")[0] for c in adapter.EXPECTED} | {"linalg", "averaging"}
    cases = [c for c in cases if c.family in families]
    report = run_adapter(adapter, cases, caps)
    assert not report.ok, f"{name} passed the suite"
    broken = {cap: 0 for cap in adapter.EXPECTED}
    expected = {cap: (v,) if isinstance(v, str) else tuple(v)
                for cap, v in adapter.EXPECTED.items()}
    by_id = {c.id: c for c in cases}
    for r in report.results:
        if r.capability in adapter.EXPECTED:
            insensitive = by_id[r.case_id].meta.get("insensitive_to", ())
            if all(p in insensitive for p in expected[r.capability]):
                # e.g. debiasing with decay 0 changes nothing: the mutant must pass there
                assert r.status == "pass", f"{r.case_id}: {r.status} {r.message}"
                continue
            assert r.status == "fail", f"{r.case_id}: {r.status} {r.message}"
            assert r.diagnosis["pitfall"] in expected[r.capability], (
                f"{r.case_id}: diagnosed {r.diagnosis}, expected "
                f"{adapter.EXPECTED[r.capability]}")
            broken[r.capability] += 1
        else:
            assert r.status == "pass", f"{name} broke {r.case_id}: {r.message}"
    present = {c.capability for c in cases}
    for cap, n in broken.items():
        if cap in present:
            assert n > 0, f"{name}: no case of {cap} was run"
