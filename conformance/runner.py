"""One case against one adapter: the evaluation behind every pytest item of the suite.

:func:`run_case` calls the adapter on a case's inputs (isolated: a per-case time limit, and
whatever the adapter raises becomes the case's result), compares with the expected value and
diagnoses a disagreement; its :class:`~conformance.results.CaseResult` is the record every
report renders.  Runs of many cases are pytest runs (:mod:`conformance.pytest_plugin`, the
suite's one runner); :func:`run_adapter` is the programmatic door to it.
"""

from __future__ import annotations

import contextvars
import fnmatch
import threading
import time

import numpy as np

from .adapter import Adapter, CaseUnsupported
from .compare import compare
from .diagnosis import Diagnosis, diagnose
from .model import EPS32, EPS64, Case
from .results import STATUSES, CaseResult, RunReport

__all__ = ["run_adapter", "run_case", "read_pattern_file", "match_pattern", "STATUSES",
           "DEFAULT_CASE_TIMEOUT", "CaseTimeout", "raised_text", "case_eps"]

#: seconds one case may take (every adapter call of the case, the statistical route's many
#: seeded calls together); the slowest shipped cases take a few seconds
DEFAULT_CASE_TIMEOUT = 60.0
#: longest single wait for a case's thread: how late a Ctrl-C received by another thread is
#: handled
_JOIN_SLICE_S = 0.25


class CaseTimeout(Exception):
    """A case ran past the per-case time limit."""


def case_eps(adapter) -> float:
    """The machine epsilon of the adapter's dtype (tolerances scale with it)."""
    return EPS32 if adapter.dtype == "float32" else EPS64


def read_pattern_file(path) -> list[tuple[str, str]]:
    """Read a skips/xfails file: one fnmatch pattern of case ids (or capability names) per
    line, an optional ``# reason`` after it; blank lines and ``#`` lines are ignored."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            body, _, reason = line.partition("#")
            pattern = body.strip()
            if pattern:
                out.append((pattern, reason.strip() or f"listed in {path}"))
    return out


def match_pattern(patterns, case: Case):
    """The reason of the first ``(pattern, reason)`` whose fnmatch pattern matches the case's
    id or capability, else ``None``."""
    for pattern, reason in patterns or ():
        if fnmatch.fnmatchcase(case.id, pattern) or fnmatch.fnmatchcase(case.capability,
                                                                          pattern):
            return reason
    return None


def run_adapter(adapter: Adapter, cases, capabilities, *, absent=None, source="live",
                skips=None, xfails=None, progress=None, setup=True,
                case_timeout=DEFAULT_CASE_TIMEOUT) -> RunReport:
    """Run ``cases`` against ``adapter`` as pytest items and return the :class:`RunReport`.

    A thin wrapper: pytest runs the items of :class:`conformance.pytest_plugin.
    ConformanceSession` (:func:`conformance.pytest_plugin.run_session`), the one runner of
    the suite, in this process.  ``progress(case, result, index, total)`` is called after
    each case; ``setup=False`` when the caller has already called ``adapter.setup()`` (the
    command line does, to report an unavailable adapter before printing anything).
    ``case_timeout``: seconds each case may take (``None`` or 0: no limit; see
    :func:`_isolated`).

    Whatever the adapter raises is a result: an exception of its setup makes the run one
    error (``AdapterUnavailable``: the run is skipped as unavailable), any exception of a case
    — ``SystemExit`` and other ``BaseException`` s included — that case's error.  Only a
    ``KeyboardInterrupt`` (Ctrl-C) stops the run: the report holds the cases run so far and
    says it was interrupted.
    """
    from .pytest_plugin import ConformanceSession, run_session

    return run_session(ConformanceSession(
        adapter, cases, capabilities, absent=absent, source=source, skips=skips,
        xfails=xfails, progress=progress, setup=setup, case_timeout=case_timeout))


def raised_text(exc) -> str:
    """An exception as a message; a ``BaseException`` that is not an ``Exception`` (an adapter
    calling ``sys.exit``, a stray ``GeneratorExit``) says that it would have ended the run."""
    text = f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, Exception):
        text += " (a BaseException that would have ended the run)"
    return text


class _Unreadable(Exception):
    """The adapter's output cannot be read as an array."""


def _host(x):
    """The adapter's output as a NumPy array (``None`` stays ``None``).  Reading a tensor runs
    the adapter's library code, so it happens inside the isolated call."""
    if x is None or isinstance(x, np.ndarray):
        return x
    try:
        if hasattr(x, "detach"):  # torch tensors that require grad
            x = x.detach()
        if hasattr(x, "cpu"):
            x = x.cpu()
        return np.asarray(x)
    except Exception as exc:  # noqa: BLE001 - reported as this case's error
        raise _Unreadable(f"its output ({type(x).__name__}) cannot be read as an array: "
                          f"{type(exc).__name__}: {exc}") from None


def _isolated(fn, timeout):
    """``fn()``, guarded by the per-case time limit: run in a worker thread (with a copy of
    the caller's ``contextvars`` context, so settings made with context variables hold) that
    the runner waits for at most ``timeout`` seconds; its result is returned and whatever it
    raised, ``BaseException`` s included, is raised here.  Past the limit :class:`CaseTimeout`
    is raised.  A thread cannot be stopped from outside, so the timed-out call goes on in the
    background (a daemon thread, ended with the process) and may slow later cases down or
    keep a lock they need; the run itself goes on.  ``timeout`` ``None`` or 0: ``fn()`` runs
    here, without a limit."""
    if not timeout:
        return fn()
    box = {}
    ctx = contextvars.copy_context()

    def target():
        try:
            box["value"] = ctx.run(fn)
        except BaseException as exc:  # noqa: BLE001 - handed to the runner's thread
            box["error"] = exc

    worker = threading.Thread(target=target, name="conformance-case", daemon=True)
    worker.start()
    # wait in slices: the kernel may deliver a Ctrl-C to any thread of the process (the
    # worker, a BLAS thread); Python then handles it only when the main thread next runs
    # bytecode, which a single long join would postpone to the end of the limit
    deadline = time.monotonic() + timeout
    while worker.is_alive() and (left := deadline - time.monotonic()) > 0:
        worker.join(min(left, _JOIN_SLICE_S))
    if worker.is_alive():
        raise CaseTimeout(f"timed out: the case ran longer than the per-case limit of "
                          f"{timeout:g} s (--case-timeout); its call could not be stopped and "
                          "was left running in the background")
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_case(adapter, impl, cap, case, *, skips=None, xfails=None, unavailable="",
             timeout=DEFAULT_CASE_TIMEOUT) -> CaseResult:
    """The result of ``case`` against ``adapter`` (``impl``: its ``implementations()``;
    ``cap``: the case's capability, ``None`` when this suite does not know it).  Skips
    (``--skips``, the adapter's ``skip_cases``, unsupported capabilities) and expected
    failures (``--xfails``) are applied here; the adapter's calls run under
    :func:`_isolated` with ``timeout`` seconds.  Only a ``KeyboardInterrupt`` propagates."""
    conv, eps = adapter.conventions, case_eps(adapter)
    r = CaseResult(case.id, case.capability, "skip", source=case.source,
                   description=case.description)
    if unavailable:
        r.message = f"adapter unavailable: {unavailable}"
        return r
    if cap is None:
        r.message = "capability unknown to this version of the suite"
        return r
    reason = match_pattern(skips, case)
    if reason is None:
        reason = match_pattern(list(getattr(adapter, "skip_cases", {}).items()), case)
    if reason is not None:
        r.message = f"skipped: {reason}"
        return r
    if case.capability in adapter.unsupported:
        r.message = f"unsupported: {adapter.unsupported[case.capability]}"
        return r
    fn = impl.get(case.capability)
    if fn is None:
        r.message = f"unsupported: {adapter.name} does not implement {case.capability}"
        return r
    rtol = case.tolerance.rtol(eps, adapter.hyperparameter_rtol)
    r.rtol = rtol
    declared = conv.differences(cap.conventions)
    r.conventions = declared
    xfail_reason = match_pattern(xfails, case)
    try:
        inputs = cap.inputs_for(case, conv)
        expected = cap.expected_for(case, conv)
    except NotImplementedError as exc:
        r.message = f"skipped: the suite cannot convert this case into the declared " \
                    f"conventions ({exc})"
        return r
    if cap.random and (cap.statistic is not None
                       or case.capability not in getattr(adapter, "accepts_draws", ())):
        return _run_statistical(r, fn, inputs, case, cap, conv, rtol, xfail_reason, timeout)
    t = time.perf_counter()
    try:
        actual = _isolated(lambda: _host(fn(inputs, dict(case.params))), timeout)
        r.duration_s = time.perf_counter() - t
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - whatever the adapter raised is a result
        r.duration_s = time.perf_counter() - t
        return _adapter_raised(r, exc, xfail_reason)
    c = compare(actual, expected, rtol, case.tolerance.scale)
    r.rel_err = c.rel_err
    if c.ok:
        if xfail_reason:
            r.message = f"XPASS: listed as expected failure ({xfail_reason}) but passes"
        if declared and not np.array_equal(expected, np.asarray(case.expected)):
            r.status = "convention"
            r.message = (r.message + "; " if r.message else "") + \
                "passes under declared convention(s) " + \
                ", ".join(f"{k}={v!r}" for k, v in declared.items())
        else:
            r.status = "pass"
        return r
    d = diagnose(actual, case, cap, conv, rtol)
    r.diagnosis = d.to_dict()
    r.status = "xfail" if xfail_reason else "fail"
    r.message = f"{c.detail}; diagnosis: {d.pitfall}: {d.explanation}"
    if xfail_reason:
        r.message = f"expected failure ({xfail_reason}); {r.message}"
    return r


def _adapter_raised(r, exc, xfail_reason) -> CaseResult:
    """The result of a case whose adapter raised: a skip for :class:`CaseUnsupported`, else an
    error (an expected failure when the case is listed in the xfails)."""
    if isinstance(exc, CaseUnsupported):
        r.status = "skip"
        r.message = f"unsupported: {exc}"
        return r
    r.status = "xfail" if xfail_reason else "error"
    r.message = str(exc) if isinstance(exc, (CaseTimeout, _Unreadable)) else raised_text(exc)
    if xfail_reason:
        r.message = f"expected failure ({xfail_reason}); {r.message}"
    return r


def _run_statistical(r, fn, inputs, case, cap, conv, rtol, xfail_reason,
                     timeout=DEFAULT_CASE_TIMEOUT) -> CaseResult:
    """The own-draws route of a random capability (:mod:`conformance.sampling`): many seeded
    calls without the draws, a median-of-means test against the exact expectation.  A
    sampler's output (``cap.statistic`` set) must be draws: real numbers in the form the
    statistic names (:class:`~conformance.sampling.NotDraws`, a failure diagnosed
    ``not_draws``); an estimate must be real numbers."""
    from .model import Case
    from .sampling import GROUP_SIZE, NotDraws, statistical_check

    own = {k: v for k, v in inputs.items() if k not in cap.draws}
    mean = np.asarray(cap.convert_output(case.alternatives["_mean"], case, conv), np.float64)
    # the conversions are permutations and positive scalings: the standard deviation moves
    # like the output
    sd = np.abs(np.asarray(cap.convert_output(np.sqrt(case.alternatives["_var"]), case, conv),
                           np.float64))

    def estimate(seed):
        out = _host(fn(own, dict(case.params, seed=seed)))
        kind = np.asarray(out).dtype.kind if out is not None else "O"
        if kind not in "biuf":  # complex, strings, objects: never read as numbers
            what = "None" if out is None else f"an array of dtype {np.asarray(out).dtype}"
            if cap.statistic is not None:
                raise NotDraws(f"the sample for seed {seed} is {what}: draws are real "
                               "numbers")
            raise ValueError(f"the estimate for seed {seed} is {what}, not real numbers")
        return out if cap.statistic is None else cap.statistic(out, case)

    t = time.perf_counter()
    try:
        st = _isolated(lambda: statistical_check(
            estimate, mean, sd ** 2, rtol, group_size=case.meta.get("group_size", GROUP_SIZE)),
            timeout)
    except KeyboardInterrupt:
        raise
    except NotDraws as exc:
        r.duration_s = time.perf_counter() - t
        r.diagnosis = Diagnosis("not_draws", str(exc)).to_dict()
        r.status = "xfail" if xfail_reason else "fail"
        r.message = f"statistical route (own draws): diagnosis: not_draws: {exc}"
        if xfail_reason:
            r.message = f"expected failure ({xfail_reason}); {r.message}"
        return r
    except BaseException as exc:  # noqa: BLE001 - whatever the adapter raised is a result
        r.duration_s = time.perf_counter() - t
        return _adapter_raised(r, exc, xfail_reason)
    r.duration_s = time.perf_counter() - t
    r.rel_err, r.rtol = st.rel_err, st.rel_tol
    if st.ok:
        r.status = "convention" if r.conventions else "pass"
        r.message = f"statistical route (own draws): {st.detail}"
        if xfail_reason:
            r.message = f"XPASS: listed as expected failure ({xfail_reason}) but passes; " + \
                r.message
        return r
    # diagnose the estimated mean against the expectation and the alternatives' expectations
    shadow = Case(case.id, case.capability, case.inputs, case.params, case.alternatives["_mean"],
                  case.tolerance, case.meta,
                  {k: v for k, v in case.alternatives.items() if k not in ("_mean", "_var")},
                  case.description, case.source)
    d = diagnose(st.mean_all, shadow, cap, conv, st.rel_tol, coef_rtol=max(1e-3, st.scale_tol))
    r.diagnosis = d.to_dict()
    r.status = "xfail" if xfail_reason else "fail"
    r.message = (f"statistical route (own draws): {st.detail} > 1; diagnosis: {d.pitfall}: "
                 f"{d.explanation}")
    if xfail_reason:
        r.message = f"expected failure ({xfail_reason}); {r.message}"
    return r
