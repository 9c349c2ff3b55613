"""The conformance suite as part of the test suite: the adapter named by
``KFAC_CONFORMANCE_ADAPTER`` (default: kfac_ref) against every case (golden files plus live
cases they lack), through the suite's one runner (the pytest plugin, run in this process by
:func:`conformance.runner.run_adapter`), e.g.::

    KFAC_CONFORMANCE_ADAPTER=kfac_ref_strict \
        python -m pytest tests/conformance/test_conformance_suite.py

A failing case is listed with the suite's diagnosis.  ``python -m conformance`` runs the same
cases with reports, and ``pytest --kfac-adapter=NAME`` as one pytest item per case.
"""

from __future__ import annotations

import pytest

from conformance.adapter import AdapterUnavailable, load_adapter
from conformance.catalogue import capabilities
from conformance.pytest_plugin import failure_text
from conformance.runner import run_adapter
from conformance.suite import select_cases

_CASES, _ABSENT, _SOURCE = select_cases("auto")


def test_catalogue_is_not_empty():
    assert _CASES, "the conformance catalogue is empty: nothing would be compared"


def test_every_case():
    try:
        adapter = load_adapter()
        adapter.setup()
    except AdapterUnavailable as exc:
        pytest.skip(f"adapter unavailable: {exc}")
    caps = capabilities()
    report = run_adapter(adapter, _CASES, caps, setup=False)
    assert [r.case_id for r in report.results] == [c.id for c in _CASES]
    by_id = {c.id: c for c in _CASES}
    bad = [failure_text(r, by_id[r.case_id]) for r in report.results
           if r.status not in ("pass", "convention", "skip", "xfail")]
    assert not bad, "\n".join(bad)
    assert report.ok
    for r in report.results:
        if caps[r.capability].statistic is not None and r.status != "skip":  # a sampler
            assert r.message.startswith("statistical route"), r.message
