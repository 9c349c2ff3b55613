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

This plugin is the suite's one runner: ``python -m conformance run`` and
:func:`conformance.run` hand their cases to :func:`run_session`, which runs the same items
with ``pytest.main`` in the calling process, and every report is rendered from the
:class:`~conformance.results.CaseResult` records the items leave
(:mod:`conformance.results`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import time
from pathlib import Path

import pytest

__all__ = ["ConformanceSession", "ConformanceCollector", "ConformanceItem", "ConformanceFailure",
           "run_session", "failure_text"]


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
    """With ``--kfac-adapter``: load and set the adapter up, select the cases and register
    the :class:`ConformanceSession` that adds and runs the items."""
    spec = _spec(config)
    if not spec:
        return
    from .adapter import AdapterUnavailable, load_adapter
    from .catalogue import capabilities
    from .runner import DEFAULT_CASE_TIMEOUT, read_pattern_file
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
    timeout = config.getoption("kfac_case_timeout")
    config.pluginmanager.register(ConformanceSession(
        adapter, cases, capabilities(), absent=absent, source=label,
        skips=read_pattern_file(skips) if skips else None,
        xfails=read_pattern_file(xfails) if xfails else None, setup=False,
        case_timeout=DEFAULT_CASE_TIMEOUT if timeout is None else timeout,
        report_dir=config.getoption("kfac_report")), "kfac-conformance-session")


class ConformanceSession:
    """One adapter's run as a pytest plugin: it adds one :class:`ConformanceItem` per case,
    keeps the :class:`~conformance.results.CaseResult` each item leaves, and at the end of
    the session builds the :class:`~conformance.results.RunReport` (``self.report``) and,
    with ``report_dir``, writes its reports.

    ``setup=False`` when the adapter is set up already.  A setup that raises makes the run
    one error item (``AdapterUnavailable``: every case is a skip, the run unavailable).
    ``progress(case, result, index, total)`` is called after each case.  A Ctrl-C stops the
    session; the report holds the cases that ran and says it was interrupted.
    """

    def __init__(self, adapter, cases, capabilities, *, absent=None, source="live", skips=None,
                 xfails=None, progress=None, setup=True, case_timeout=None, report_dir=None):
        from .runner import DEFAULT_CASE_TIMEOUT

        self.adapter = adapter
        self.cases = list(cases)
        self.caps = capabilities
        self.absent = dict(absent or {})
        self.source = source
        self.skips, self.xfails = skips, xfails
        self.progress = progress
        self.setup = setup
        self.case_timeout = DEFAULT_CASE_TIMEOUT if case_timeout is None else case_timeout
        self.report_dir = report_dir
        self.results = []
        self.report = None
        self.paths = None
        self.interrupted = ""
        self.current = None
        self._ready = False

    # -- the adapter ------------------------------------------------------------------------
    def _set_up(self):
        """Set the adapter up (once): ``impl``, ``info``, ``unavailable``, ``setup_error``."""
        if self._ready:
            return
        from .adapter import AdapterUnavailable
        from .results import CaseResult
        from .runner import raised_text

        self._ready = True
        self.started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.t0 = time.perf_counter()
        adapter = self.adapter
        self.setup_error = None
        self.unavailable = ""
        fallback = {"name": adapter.name, "description": adapter.description, "version": "",
                    "dtype": adapter.dtype, "conventions": adapter.conventions.to_dict(),
                    "non_canonical_conventions": adapter.conventions.differences()}
        try:
            if self.setup:
                adapter.setup()
            self.impl = adapter.implementations()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - AdapterUnavailable, or a broken setup
            self.impl, self.info = {}, fallback
            if isinstance(exc, AdapterUnavailable):
                self.unavailable = str(exc)
            else:
                self.setup_error = CaseResult(
                    f"{adapter.name}/setup", "adapter.setup", "error",
                    f"the adapter could not be set up: {raised_text(exc)}")
            return
        try:
            self.info = adapter.info()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a version lookup is no reason to stop
            self.info = dict(fallback, version=f"unknown (version() raised {raised_text(exc)})")

    @property
    def total(self) -> int:
        return 1 if self.setup_error is not None else len(self.cases)

    def evaluate(self, case):
        """The result of one case (:func:`conformance.runner.run_case`)."""
        from .runner import run_case

        return run_case(self.adapter, self.impl, self.caps.get(case.capability), case,
                        skips=self.skips, xfails=self.xfails, unavailable=self.unavailable,
                        timeout=self.case_timeout)

    def record(self, case, result):
        self.results.append(result)
        if self.progress is not None and case is not None:
            self.progress(case, result, len(self.results), self.total)

    # -- pytest hooks ---------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session):
        self._set_up()

    def pytest_report_header(self, config):
        self._set_up()
        info = self.info
        conv = ", ".join(f"{k}={v!r}" for k, v in info["non_canonical_conventions"].items())
        return [f"kfac_ref conformance: adapter {info['name']} {info['version']} "
                f"(dtype {info['dtype']}; conventions: {conv or 'canonical'}); "
                f"{len(self.cases)} cases, expected values: {self.source}"]

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session, config, items):
        """Add the catalogue's items before ``-k``/``-m`` deselect (tryfirst)."""
        self._set_up()
        name = f"kfac_conformance[{self.info['name']}]"
        collector = ConformanceCollector.from_parent(session, name=name, nodeid=name,
                                                     run=self)
        items.extend(collector.collect())

    def pytest_keyboard_interrupt(self, excinfo):
        done, total = len(self.results), self.total
        where = f" at case {self.current.id}" if self.current is not None else ""
        self.interrupted = (f"interrupted (Ctrl-C){where}: {done} of {total} cases ran, "
                            f"{total - done} did not")

    def pytest_sessionfinish(self, session, exitstatus):
        from .results import RunReport, environment

        self._set_up()
        self.report = RunReport(self.info, list(self.results), self.absent, self.source,
                                environment(), self.started, time.perf_counter() - self.t0,
                                self.unavailable, self.interrupted)
        if self.report_dir and self.results:
            from .reports import write_reports

            self.paths = write_reports(self.report, os.fspath(self.report_dir))

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        if self.paths:
            terminalreporter.write_line("kfac_ref conformance reports: " +
                                        ", ".join(str(p) for p in self.paths.values()))


class _CatalogueOnly:
    """With :func:`run_session`: the session's items are the catalogue's, nothing is
    collected from files."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session):
        session.perform_collect([])
        return True


#: pytest's own plugins that :func:`run_session` leaves out: output, capture, caches and
#: process-wide handlers belong to the caller (the command line prints its own progress)
_BLOCKED = ("cacheprovider", "terminal", "capture", "faulthandler", "logging", "warnings",
            "junitxml", "doctest", "pastebin", "stepwise", "threadexception",
            "unraisableexception", "debugging")


@contextlib.contextmanager
def _plain_pytest_environment():
    """No plugins from entry points or ``PYTEST_PLUGINS`` and no ``PYTEST_ADDOPTS``: the
    suite's run is the same whatever else is installed (pytest-randomly would reorder it)."""
    saved = {k: os.environ.get(k) for k in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS",
                                            "PYTEST_DISABLE_PLUGIN_AUTOLOAD")}
    for k in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        os.environ.pop(k, None)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_session(run: ConformanceSession):
    """Run ``run``'s items with ``pytest.main`` in this process, with no configuration file,
    no file collection and none of the caller's pytest plugins, and return its
    :class:`~conformance.results.RunReport`."""
    args = ["-c", os.devnull, "--rootdir", str(Path(__file__).resolve().parent),
            "--assert=plain"]
    for name in _BLOCKED:
        args += ["-p", f"no:{name}"]
    with _plain_pytest_environment():
        code = pytest.main(args, plugins=[run, _CatalogueOnly()])
    if run.report is None:
        raise RuntimeError(f"pytest could not run the conformance cases (exit status {code})")
    return run.report


class ConformanceCollector(pytest.Collector):
    """The catalogue, against one adapter (:class:`ConformanceSession`)."""

    def __init__(self, *, run, **kwargs):
        super().__init__(**kwargs)
        self.run = run

    def collect(self):
        from .runner import match_pattern

        run = self.run
        if run.setup_error is not None:
            return [ConformanceItem.from_parent(self, name=run.setup_error.case_id, case=None,
                                                run=run)]
        out = []
        for case in run.cases:
            item = ConformanceItem.from_parent(self, name=case.id, case=case, run=run)
            reason = match_pattern(run.xfails, case)
            if reason is not None:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
            out.append(item)
        return out


class ConformanceFailure(AssertionError):
    """A case that disagrees with the reference (the message carries the diagnosis)."""


class ConformanceItem(pytest.Item):
    """One case of the catalogue (``case=None``: the adapter's setup, which raised)."""

    def __init__(self, *, case, run, **kwargs):
        super().__init__(**kwargs)
        self.case = case
        self.run = run
        if case is not None:
            self.user_properties.append(("capability", case.capability))

    def runtest(self):
        run = self.run
        run.current = self.case
        r = run.setup_error if self.case is None else run.evaluate(self.case)
        run.record(self.case, r)
        run.current = None
        self.user_properties.append(("status", r.status))
        if r.status == "skip":
            pytest.skip(r.message)
        if r.status == "convention":
            self.user_properties.append(("conventions", r.message))
        if r.status in ("fail", "error", "xfail"):
            raise ConformanceFailure(failure_text(r, self.case))

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        if self.case is None:
            return self.path, None, self.name
        return self.path, None, f"{self.case.capability}: {self.case.id}"


def failure_text(result, case) -> str:
    """The failure message of one case: what disagreed, by how much, the diagnosis and where
    the formula is documented."""
    from .diagnosis import PITFALLS, docs_link

    lines = [f"{result.case_id} ({result.capability}) {result.status.upper()}"]
    if result.description:
        lines.append(f"  case: {result.description}")
    if result.status == "error" or (result.status == "xfail" and not result.diagnosis):
        lines.append(f"  the adapter raised: {result.message}")
        return "\n".join(lines)
    detail, _, _ = result.message.partition("; diagnosis:")
    lines.append(f"  {detail}")
    derivation = f" ({case.tolerance.derivation})" if case is not None else ""
    lines.append(f"  tolerance: rtol {result.rtol:.2e}{derivation}")
    d = result.diagnosis or {}
    pid = d.get("pitfall", "unexplained")
    title = PITFALLS.get(pid.split("+")[0], ("",))[0]
    lines.append(f"  diagnosis: {pid}" + (f" ({title})" if title and title != pid else ""))
    lines.append(f"    {d.get('explanation', '')}")
    link = docs_link(pid)
    if link:
        lines.append(f"  formula: {link[0]} <{link[1]}>")
    return "\n".join(lines)
