"""The suite's teeth: every deliberately wrong adapter must fail exactly the capabilities it
breaks, each with the designed diagnosis (``EXPECTED`` per capability, ``EXPECTED_CASES`` per
case where the fault shows differently), and pass everything else."""

from __future__ import annotations

import fnmatch

import pytest

from conformance.adapter import load_adapter
from conformance.adapters import mutants
from conformance.adapters.kfac_ref_adapter import KfacRefAdapter
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


def reference_code(adapter, capability):
    """Whether ``adapter`` computes ``capability`` with the reference adapter's own code: the
    same function, and no helper of the reference adapter overridden (so on the same case and
    seeds it returns the reference's numbers)."""
    fn = adapter.implementations().get(capability)
    ref = KfacRefAdapter().implementations().get(capability)
    if fn is None or ref is None or getattr(fn, "__func__", fn) is not ref.__func__:
        return False
    own = set()
    for klass in type(adapter).__mro__:
        if klass is KfacRefAdapter:
            break
        own |= set(vars(klass))
    return not (own & {a for a in vars(KfacRefAdapter) if a.startswith("_")
                       and not a.startswith("__")})


def mutant_results(name, cases, caps):
    adapter = load_adapter(name)
    # the families it breaks, plus linalg and averaging to check that the rest still passes;
    # a sampler's statistical cases (thousands of seeded calls each) only where the mutant
    # runs its own code for them: elsewhere its numbers are the reference's, which pass in
    # tests/conformance/test_conformance_suite.py
    families = {c.split(".")[0] for c in adapter.EXPECTED} | {"linalg", "averaging"}
    cases = [c for c in cases if c.family in families
             and (caps[c.capability].statistic is None
                  or not reference_code(adapter, c.capability))]
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


def test_reference_code_is_told_apart():
    """The statistical cases left out above are exactly those of inherited, unchanged code."""
    assert reference_code(load_adapter("mutant_factor_weight_w"), "losses.sample")
    assert not reference_code(load_adapter("mutant_sample_mode"), "losses.sample")
    assert not reference_code(load_adapter("mutant_sample_variance_as_std"), "losses.sample")

    class Helper(KfacRefAdapter):  # a changed helper changes every capability that uses it
        def _loss(self, inputs, params):
            return super()._loss(inputs, params)

    assert not reference_code(Helper(), "losses.sample")
