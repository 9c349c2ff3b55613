"""The declared capabilities (kfac_ref.capabilities) against what the run exercised.

Runs last (file order).  After a full run of the suite on the whole matrix, every "yes" of an
eager backend whose cells ran must have been exercised: some test called the object with that
library's arrays (recorded by tests/support_recorder.py).  On a partial run (-k, -m, a file
list, KFAC_REF_BACKENDS) the comparison is skipped, saying so.  Under pytest-xdist no worker
sees the whole record: the last test skips in the worker and the controller makes the same
comparison on the workers' records merged, failing the run when a claim was not exercised
(tests/conftest.py, ``pytest_sessionfinish``).
"""

from __future__ import annotations

import conftest
import pytest
import support_recorder

from kfac_ref import capabilities


def test_no_stale_declarations():
    assert capabilities._unknown_declarations() == []


def test_every_public_object_has_a_row():
    table = capabilities.support_table()
    assert set(table) == conftest.RECORDED
    assert all(isinstance(s, capabilities.Support) for s in table.values())


def test_every_eager_claim_was_exercised(pytestconfig):
    if hasattr(pytestconfig, "workerinput"):  # a pytest-xdist worker
        pytest.skip("pytest-xdist: each worker sees only its own calls; the controller "
                    "compares the claims with the merged record at the end of the run")
    if not conftest.FULL_RUN["value"]:
        pytest.skip("partial run: the claims are compared after a full run only")
    missing = support_recorder.unexercised_claims(conftest.FULL_RUN["cells"],
                                                  support_recorder.CALLS)
    assert not missing, support_recorder.unexercised_message(missing)
