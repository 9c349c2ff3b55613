"""kfac_ref's conformance suite: check any K-FAC implementation against the reference.

Run it with ``python -m conformance`` (see README.md).  Programmatic use::

    from conformance import run, load_adapter
    report = run("kfac_ref_strict")          # or an Adapter instance, or None for the env var
    print(report.ok, report.counts())

Write an adapter by subclassing :class:`Adapter` and marking methods with
:func:`implements`; declare conventions with :class:`Conventions`.
"""

from .adapter import (
    ENV_VAR,
    Adapter,
    AdapterUnavailable,
    CaseUnsupported,
    implements,
    load_adapter,
)
from .conventions import CANONICAL, Conventions
from .suite import run, select_cases

__all__ = ["Adapter", "AdapterUnavailable", "CaseUnsupported", "CANONICAL", "Conventions",
           "ENV_VAR", "implements", "load_adapter", "run", "select_cases"]
