"""High-level entry points: select cases, run an adapter (through the pytest plugin, the
suite's one runner: :func:`conformance.runner.run_adapter`)."""

from __future__ import annotations

import fnmatch

from .adapter import load_adapter
from .catalogue import build_catalogue, capabilities
from .golden import GOLDEN_DIR, GoldenError, load_golden
from .runner import DEFAULT_CASE_TIMEOUT, run_adapter

__all__ = ["select_cases", "run", "SOURCES"]

SOURCES = ("auto", "live", "golden")


def select_cases(source="auto", families=None, capability=None, keyword=None,
                 golden_dir=GOLDEN_DIR):
    """Return (cases, absent_families, source_label).

    ``auto``: the golden cases (integrity-checked) plus live cases whose ids the golden files
    do not have yet; ``live``: computed now by kfac_ref; ``golden``: the files only.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}; got {source!r}")
    cases, absent = [], {}
    if source in ("auto", "golden"):
        try:
            cases = load_golden(golden_dir)
        except GoldenError:
            if source == "golden":
                raise
            if (golden_dir / "manifest.json").exists():
                raise  # corrupt files are an error, never a silent fallback
            cases = []
    if source in ("auto", "live"):
        live, absent = build_catalogue(families)
        have = {c.id for c in cases}
        cases = cases + [c for c in live if c.id not in have]
    label = source
    if source == "auto":
        kinds = {c.source for c in cases}
        label = "+".join(sorted(kinds)) or "none"
    if families:
        cases = [c for c in cases if c.family in families]
    if capability:
        cases = [c for c in cases if any(fnmatch.fnmatchcase(c.capability, p)
                                         for p in capability)]
    if keyword:
        cases = [c for c in cases if keyword in c.id]
    # stable report order: family order of the catalogue, then capability, then id
    from .catalogue import FAMILY_MODULES

    order = {f: i for i, f in enumerate(FAMILY_MODULES)}
    cases.sort(key=lambda c: (order.get(c.family, 99), c.capability, c.id))
    return cases, absent, label


def run(adapter=None, source="auto", families=None, capability=None, keyword=None,
        skips=None, xfails=None, progress=None, cases=None, setup=True,
        case_timeout=DEFAULT_CASE_TIMEOUT):
    """Run one adapter (an :class:`~conformance.adapter.Adapter`, a spec string or ``None``
    for ``$KFAC_CONFORMANCE_ADAPTER``) and return its :class:`~conformance.runner.RunReport`
    (``setup=False``: the adapter is an instance already set up; ``case_timeout``: seconds
    each case may take, ``None`` or 0 for no limit).
    """
    if adapter is None or isinstance(adapter, str):
        adapter = load_adapter(adapter)  # AdapterUnavailable propagates
    absent, label = {}, source
    if cases is None:
        cases, absent, label = select_cases(source, families, capability, keyword)
    return run_adapter(adapter, cases, capabilities(), absent=absent, source=label,
                       skips=skips, xfails=xfails, progress=progress, setup=setup,
                       case_timeout=case_timeout)
