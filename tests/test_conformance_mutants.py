"""The suite's teeth: every deliberately wrong adapter must fail exactly the capabilities it
breaks, each with the designed diagnosis (``EXPECTED`` per capability, ``EXPECTED_CASES`` per
case where the fault shows differently), and pass everything else."""

from __future__ import annotations

import fnmatch

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


def designed(adapter, case):
    """The designed outcome of ``case`` for ``adapter``: a tuple of accepted pitfall ids,
    ``"pass"``, or ``None`` (the capability is not broken: the case must pass)."""
    for pattern, want in getattr(adapter, "EXPECTED_CASES", {}).items():
        if fnmatch.fnmatchcase(case.id, pattern):
            return want if want == "pass" else (want,)
    want = adapter.EXPECTED.get(case.capability)
    if want is None:
        return None
    want = (want,) if isinstance(want, str) else tuple(want)
    if all(p in case.meta.get("insensitive_to", ()) for p in want):
        return "pass"  # e.g. debiasing with decay 0 changes nothing: the mutant must pass
    return want


def mutant_results(name, cases, caps):
    adapter = load_adapter(name)
    # the families it breaks, plus linalg and averaging to check that the rest still passes
    families = {c.split(".")[0] for c in adapter.EXPECTED} | {"linalg", "averaging"}
    cases = [c for c in cases if c.family in families]
    return adapter, cases, run_adapter(adapter, cases, caps)


def test_there_are_mutants():
    assert len(MUTANTS) >= 20


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught_with_the_right_diagnosis(live, name):
    adapter, cases, report = mutant_results(name, *live)
    assert adapter.EXPECTED, f"{name} declares no expected diagnosis"
    assert not report.ok, f"{name} passed the suite"
    by_id = {c.id: c for c in cases}
    broken = dict.fromkeys(adapter.EXPECTED, 0)
    for r in report.results:
        want = designed(adapter, by_id[r.case_id])
        if want is None or want == "pass":
            assert r.status in ("pass", "convention"), f"{name} {r.case_id}: {r.message}"
            continue
        assert r.status == "fail", f"{r.case_id}: {r.status} {r.message}"
        assert r.diagnosis["pitfall"] in want, (
            f"{r.case_id}: diagnosed {r.diagnosis}, designed {want}")
        broken[r.capability] += 1
    present = {c.capability for c in cases}
    for cap, n in broken.items():
        if cap in present:
            assert n > 0, f"{name}: no case of {cap} was run"
