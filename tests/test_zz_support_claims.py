"""The declared capabilities (kfac_ref.capabilities) against what the run exercised.

Runs last (file order).  After a full run of the suite on the whole matrix, every "yes"
of an eager backend whose cells ran must have been exercised: some test called the object
with that library's arrays (recorded by tests/support_recorder.py).  On a partial run
(-k, -m, a file list, KFAC_REF_BACKENDS) the comparison is skipped, saying so.
"""

from __future__ import annotations

import inspect

import conftest
import pytest
import support_recorder

from kfac_ref import capabilities

_CELL_TO_COLUMN = {"numpy": "numpy", "strict": "array_api_strict", "torch-cpu": "torch",
                   "torch-cuda": "torch", "jax": "jax", "cupy": "cupy"}


def test_no_stale_declarations():
    assert capabilities.unknown_declarations() == []


def test_every_public_object_has_a_row():
    table = capabilities.support_table()
    assert set(table) == conftest.RECORDED
    assert all(isinstance(s, capabilities.Support) for s in table.values())


def test_every_eager_claim_was_exercised():
    if not conftest.FULL_RUN["value"]:
        pytest.skip("partial run: the claims are compared after a full run only")
    ran = {_CELL_TO_COLUMN[c] for c in conftest.FULL_RUN["cells"] if c in _CELL_TO_COLUMN}
    calls = set(support_recorder.CALLS)
    # a base class is exercised through its public subclasses
    objects = {name: obj for name, obj in capabilities._canonical_names().values()}
    for name, obj in objects.items():
        if inspect.isclass(obj):
            for sub_name, sub in objects.items():
                if inspect.isclass(sub) and sub is not obj and issubclass(sub, obj):
                    calls |= {(name, b) for n, b in support_recorder.CALLS if n == sub_name}
    missing = sorted(
        (name, col)
        for name, sup in capabilities.support_table().items()
        for col in capabilities.EAGER_BACKENDS
        if col in ran and sup.state(col) == "yes" and (name, col) not in calls
    )
    assert not missing, (
        f"{len(missing)} declared 'yes' entries were not exercised by the suite (declare "
        f"them 'untested' or add a test): {missing[:40]}")
