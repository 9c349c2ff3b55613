"""pytest entry point of the conformance suite: one test per catalogue case.

Runs the implementation named by ``KFAC_CONFORMANCE_ADAPTER`` (default: kfac_ref) against
every case (golden files plus live cases they lack), e.g.::

    KFAC_CONFORMANCE_ADAPTER=kfac_ref_strict python -m pytest tests/test_conformance_suite.py

A failing case fails with the suite's diagnosis; an unsupported capability is a skip with the
adapter's reason.  ``python -m conformance`` runs the same cases with reports.
"""

from __future__ import annotations

import pytest

from conformance.adapter import AdapterUnavailable, load_adapter
from conformance.catalogue import capabilities
from conformance.runner import run_adapter
from conformance.suite import select_cases

_CASES, _ABSENT, _SOURCE = select_cases("auto")


@pytest.fixture(scope="module")
def adapter():
    try:
        ad = load_adapter()
        ad.setup()
    except AdapterUnavailable as exc:
        pytest.skip(f"adapter unavailable: {exc}")
    return ad


@pytest.fixture(scope="module")
def caps():
    return capabilities()


def test_catalogue_is_not_empty():
    assert _CASES, "the conformance catalogue is empty: nothing would be compared"


@pytest.mark.parametrize("case", _CASES, ids=[c.id for c in _CASES])
def test_case(adapter, caps, case):
    report = run_adapter(adapter, [case], caps)
    (res,) = report.results
    if res.status == "skip":
        pytest.skip(res.message)
    if res.status == "xfail":
        pytest.xfail(res.message)
    assert res.status in ("pass", "convention"), f"{res.status}: {res.message}"
    if caps[case.capability].statistic is not None:  # a sampler: many seeded calls
        assert res.message.startswith("statistical route"), res.message
