"""pytest plugin: the conformance catalogue as pytest items in your own test suite.

Installed with kfac_ref (entry point ``pytest11``), the plugin does nothing until an adapter
is chosen::

    pytest --kfac-adapter=mypkg.kfac_adapter            # a module[:attr], a file.py or a name
    pytest --kfac-adapter=mypkg.kfac_adapter --kfac-xfails=conformance-xfails.txt -k kron

(or ``kfac_adapter = mypkg.kfac_adapter`` in the ``[pytest]`` ini section).  Every case of
the catalogue becomes one item, ``kfac_conformance[ADAPTER]::CASE_ID`` (so ``-k`` selects
cases by id or capability); capabilities the adapter does not implement or lists as
unsupported are skips with the reason; a failure's message is the suite's: the relative error
against the tolerance, the diagnosed pitfall with its numbers and the docs section of the
formula it gets wrong.  The files of ``--kfac-skips`` / ``--kfac-xfails`` hold one fnmatch
pattern of case ids or capability names a line, an optional ``# reason`` after it (the
format of ``python -m conformance --skips/--xfails``); listed cases are skipped / marked
``xfail`` (non-strict: an XPASS is reported, not failed).  ``--kfac-case-timeout SECONDS``
is the time limit of one case (default 60, 0 = none; a case past it fails as timed out, its call
runs on in the background).  ``--kfac-report DIR`` writes the suite's reports (JSON, JUnit,
Markdown, HTML) of the items that ran.

An adapter that cannot be loaded or set up here is a usage error (exit status 4), as on the
command line.
"""

from __future__ import annotations

import os

import pytest

__all__ = ["ConformanceCollector", "ConformanceItem", "ConformanceFailure"]

_STATE = pytest.StashKey[dict]()


def pytest_addoption(parser):
    group = parser.getgroup("kfac-conformance", "kfac_ref conformance suite")
    group.addoption("--kfac-adapter", default=None, metavar="SPEC",
                    help="run the kfac_ref conformance catalogue against this adapter (a "
                         "name, module[:attr] or file.py); without it the plugin is inactive")
    group.addoption("--kfac-source", default="auto", choices=("auto", "live", "golden"),
                    help="expected values: golden vectors, live kfac_ref or both (default "
                         "auto)")
    group.addoption("--kfac-family", action="append", default=None, metavar="FAMILY",
                    help="restrict to a capability family (repeatable)")
    group.addoption("--kfac-capability", action="append", default=None, metavar="PATTERN",
                    help="restrict to capabilities (fnmatch, repeatable)")
    group.addoption("--kfac-skips", default=None, metavar="FILE",
                    help="file of case-id/capability patterns to skip")
    group.addoption("--kfac-xfails", default=None, metavar="FILE",
                    help="file of case-id/capability patterns expected to fail")
    group.addoption("--kfac-case-timeout", default=None, type=float, metavar="SECONDS",
                    help="time limit of one case (default 60; 0 = no limit): a case past it "
                         "fails as timed out (its call runs on in the background)")
    group.addoption("--kfac-report", default=None, metavar="DIR",
                    help="write the suite's reports (JSON, JUnit, Markdown, HTML) here")
    parser.addini("kfac_adapter", "default for --kfac-adapter", default="")


def _spec(config):
    return config.getoption("kfac_adapter") or config.getini("kfac_adapter") or None


def pytest_configure(config):
    spec = _spec(config)
    if not spec:
        return
    from .adapter import AdapterUnavailable, load_adapter
    from .catalogue import capabilities
    from .runner import read_pattern_file
    from .suite import select_cases

    try:
        adapter = load_adapter(spec)
        adapter.setup()
    except AdapterUnavailable as exc:
        raise pytest.UsageError(f"--kfac-adapter: adapter {spec!r} is unavailable: {exc}") \
            from exc
    except Exception as exc:
        raise pytest.UsageError(f"--kfac-adapter: cannot load adapter {spec!r}: "
                                f"{type(exc).__name__}: {exc}") from exc
    try:
        cases, absent, label = select_cases(config.getoption("kfac_source"),
                                            config.getoption("kfac_family"),
                                            config.getoption("kfac_capability"))
    except Exception as exc:
        raise pytest.UsageError(f"--kfac-source: {exc}") from exc
    skips = config.getoption("kfac_skips")
    xfails = config.getoption("kfac_xfails")
    config.stash[_STATE] = {
        "adapter": adapter, "impl": adapter.implementations(), "info": adapter.info(),
        "caps": capabilities(), "cases": cases, "absent": absent, "source": label,
        "skips": read_pattern_file(skips) if skips else None,
        "xfails": read_pattern_file(xfails) if xfails else None, "results": {},
    }


def pytest_report_header(config):
    state = config.stash.get(_STATE, None)
    if state is None:
        return None
    info = state["info"]
    conv = ", ".join(f"{k}={v!r}" for k, v in info["non_canonical_conventions"].items())
    return [f"kfac_ref conformance: adapter {info['name']} {info['version']} "
            f"(dtype {info['dtype']}; conventions: {conv or 'canonical'}); "
            f"{len(state['cases'])} cases, expected values: {state['source']}"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Add the catalogue's items before ``-k``/``-m`` deselect (tryfirst)."""
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    name = f"kfac_conformance[{state['info']['name']}]"
    collector = ConformanceCollector.from_parent(session, name=name, nodeid=name)
    items.extend(collector.collect())


class ConformanceCollector(pytest.Collector):
    """The catalogue, against the adapter chosen by ``--kfac-adapter``."""

    def collect(self):
        from .runner import _match

        state = self.config.stash[_STATE]
        out = []
        for case in state["cases"]:
            item = ConformanceItem.from_parent(self, name=case.id, case=case)
            reason = _match(state["xfails"], case)
            if reason is not None:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
            out.append(item)
        return out


class ConformanceFailure(AssertionError):
    """A case that disagrees with the reference (the message carries the diagnosis)."""


class ConformanceItem(pytest.Item):
    """One case of the catalogue."""

    def __init__(self, *, case, **kwargs):
        super().__init__(**kwargs)
        self.case = case
        self.user_properties.append(("capability", case.capability))

    def runtest(self):
        from .model import EPS32, EPS64
        from .runner import DEFAULT_CASE_TIMEOUT, _run_one

        state = self.config.stash[_STATE]
        adapter = state["adapter"]
        eps = EPS32 if adapter.dtype == "float32" else EPS64
        timeout = self.config.getoption("kfac_case_timeout")
        r = _run_one(adapter, state["impl"], adapter.conventions,
                     state["caps"].get(self.case.capability), self.case, eps, state["skips"],
                     None, "", timeout=DEFAULT_CASE_TIMEOUT if timeout is None else timeout)
        r.source = self.case.source
        r.description = self.case.description
        state["results"][self.case.id] = r
        self.user_properties.append(("status", r.status))
        if r.status == "skip":
            pytest.skip(r.message)
        if r.status == "convention":
            self.user_properties.append(("conventions", r.message))
        if r.status in ("fail", "error"):
            raise ConformanceFailure(failure_text(r, self.case))

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.case.capability}: {self.case.id}"


def failure_text(result, case) -> str:
    """The failure message of one case: what disagreed, by how much, the diagnosis and where
    the formula is documented."""
    from .diagnosis import PITFALLS, docs_link

    lines = [f"{case.id} ({case.capability}) {result.status.upper()}"]
    if case.description:
        lines.append(f"  case: {case.description}")
    if result.status == "error":
        lines.append(f"  the adapter raised: {result.message}")
        return "\n".join(lines)
    detail, _, _ = result.message.partition("; diagnosis:")
    lines.append(f"  {detail}")
    lines.append(f"  tolerance: rtol {result.rtol:.2e} ({case.tolerance.derivation})")
    d = result.diagnosis or {}
    pid = d.get("pitfall", "unexplained")
    title = PITFALLS.get(pid.split("+")[0], ("",))[0]
    lines.append(f"  diagnosis: {pid}" + (f" ({title})" if title and title != pid else ""))
    lines.append(f"    {d.get('explanation', '')}")
    link = docs_link(pid)
    if link:
        lines.append(f"  formula: {link[0]} <{link[1]}>")
    return "\n".join(lines)


def pytest_sessionfinish(session, exitstatus):
    state = session.config.stash.get(_STATE, None)
    out = session.config.getoption("kfac_report", None) if state else None
    if not out or not state["results"]:
        return
    import datetime as _dt

    from .reports import write_reports
    from .runner import RunReport, environment

    results = [state["results"][c.id] for c in state["cases"] if c.id in state["results"]]
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    report = RunReport(state["info"], results, state["absent"], state["source"], environment(),
                       started, sum(r.duration_s for r in results))
    paths = write_reports(report, os.fspath(out))
    session.config._kfac_report_paths = paths  # for the terminal summary


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    paths = getattr(config, "_kfac_report_paths", None)
    if paths:
        terminalreporter.write_line("kfac_ref conformance reports: " +
                                    ", ".join(str(p) for p in paths.values()))
