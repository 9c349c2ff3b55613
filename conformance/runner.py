"""Run the catalogue against one adapter and collect per-case results."""

from __future__ import annotations

import contextvars
import datetime as _dt
import fnmatch
import platform
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .adapter import Adapter, AdapterUnavailable, CaseUnsupported
from .compare import compare
from .diagnosis import Diagnosis, diagnose
from .model import EPS32, EPS64, Case

__all__ = ["Result", "RunReport", "run_adapter", "read_pattern_file", "STATUSES",
           "DEFAULT_CASE_TIMEOUT", "CaseTimeout"]

#: statuses in report order; "fail" and "error" make the run fail
STATUSES = ("pass", "convention", "fail", "error", "xfail", "skip")

#: seconds one case may take (every adapter call of the case, the statistical route's many
#: seeded calls together); the slowest shipped cases take a few seconds
DEFAULT_CASE_TIMEOUT = 60.0


class CaseTimeout(Exception):
    """A case ran past the per-case time limit."""


@dataclass
class Result:
    case_id: str
    capability: str
    status: str
    message: str = ""
    rel_err: float = float("nan")
    rtol: float = float("nan")
    diagnosis: dict | None = None
    conventions: dict = field(default_factory=dict)  # declared non-canonical fields used
    duration_s: float = 0.0
    source: str = "live"
    description: str = ""

    def to_dict(self):
        d = dict(self.__dict__)
        for k in ("rel_err", "rtol"):
            if d[k] != d[k]:  # NaN is not JSON
                d[k] = None
        return d


@dataclass
class RunReport:
    adapter: dict
    results: list
    absent: dict  # families absent from the catalogue -> reason
    source: str
    environment: dict
    started: str
    duration_s: float
    unavailable: str = ""  # the adapter could not be set up (whole run skipped)
    #: the run was stopped (Ctrl-C) before every case ran: "" or how far it got
    interrupted: str = ""

    def counts(self, capability=None) -> dict:
        out = dict.fromkeys(STATUSES, 0)
        for r in self.results:
            if capability is None or r.capability == capability:
                out[r.status] += 1
        return out

    def capabilities(self) -> list:
        seen = []
        for r in self.results:
            if r.capability not in seen:
                seen.append(r.capability)
        return seen

    @property
    def ok(self) -> bool:
        """Passes when nothing failed or errored, at least one case was compared and the run
        was not interrupted."""
        c = self.counts()
        return (not self.unavailable and not self.interrupted and c["fail"] == 0
                and c["error"] == 0 and (c["pass"] + c["convention"]) > 0)

    def to_dict(self):
        return {
            "schema": "kfac_ref.conformance.report/1",
            "adapter": self.adapter,
            "source": self.source,
            "started": self.started,
            "duration_s": self.duration_s,
            "environment": self.environment,
            "unavailable": self.unavailable,
            "interrupted": self.interrupted,
            "absent_families": self.absent,
            "ok": self.ok,
            "counts": self.counts(),
            "capabilities": {c: self.counts(c) for c in self.capabilities()},
            "results": [r.to_dict() for r in self.results],
        }


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


def _match(patterns, case: Case):
    for pattern, reason in patterns or ():
        if fnmatch.fnmatchcase(case.id, pattern) or fnmatch.fnmatchcase(case.capability,
                                                                          pattern):
            return reason
    return None


def environment() -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "numpy": np.__version__}
    try:
        import kfac_ref

        env["kfac_ref"] = kfac_ref.__version__
    except ImportError:
        env["kfac_ref"] = None
    return env


def run_adapter(adapter: Adapter, cases, capabilities, *, absent=None, source="live",
                skips=None, xfails=None, progress=None, setup=True,
                case_timeout=DEFAULT_CASE_TIMEOUT) -> RunReport:
    """Run ``cases`` against ``adapter``.

    ``progress(case, result, index, total)`` is called after each case; ``setup=False`` when
    the caller has already called ``adapter.setup()`` (the command line does, to report an
    unavailable adapter before printing anything).  ``case_timeout``: seconds each case may
    take (``None`` or 0: no limit; see :func:`_isolated`).

    Whatever the adapter raises is a result: an exception of its setup makes the run one
    error (``AdapterUnavailable``: the run is skipped as unavailable), any exception of a case
    — ``SystemExit`` and other ``BaseException`` s included — that case's error.  Only a
    ``KeyboardInterrupt`` (Ctrl-C) stops the run: the report holds the cases run so far and
    says it was interrupted.
    """
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    setup_error = None
    fallback = {"name": adapter.name, "description": adapter.description, "version": "",
                "dtype": adapter.dtype, "conventions": adapter.conventions.to_dict(),
                "non_canonical_conventions": adapter.conventions.differences()}
    try:
        if setup:
            adapter.setup()
        impl = adapter.implementations()
        unavailable = ""
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - AdapterUnavailable, or a broken setup
        impl, info = {}, fallback
        unavailable = str(exc) if isinstance(exc, AdapterUnavailable) else ""
        if not unavailable:
            setup_error = Result(f"{adapter.name}/setup", "adapter.setup", "error",
                                 f"the adapter could not be set up: {_raised(exc)}")
    else:
        try:
            info = adapter.info()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a version lookup is no reason to stop
            info = dict(fallback, version=f"unknown (version() raised {_raised(exc)})")
    eps = EPS32 if adapter.dtype == "float32" else EPS64
    conv = adapter.conventions
    results = [] if setup_error is None else [setup_error]
    total = len(cases) if setup_error is None else 0
    interrupted = ""
    done = 0
    for i, case in enumerate(cases[:total]):
        try:
            cap = capabilities.get(case.capability)
            res = _run_one(adapter, impl, conv, cap, case, eps, skips, xfails, unavailable,
                           timeout=case_timeout)
            res.source = case.source
            res.description = case.description
            results.append(res)
            done += 1
            if progress is not None:
                progress(case, res, i + 1, total)
        except KeyboardInterrupt:
            interrupted = (f"interrupted (Ctrl-C) at case {case.id}: {done} of {total} cases "
                           f"ran, {total - done} did not")
            break
    return RunReport(info, results, dict(absent or {}), source, environment(), started,
                     time.perf_counter() - t0, unavailable, interrupted)


def _raised(exc) -> str:
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
    worker.join(timeout)
    if worker.is_alive():
        raise CaseTimeout(f"timed out: the case ran longer than the per-case limit of "
                          f"{timeout:g} s (--case-timeout); its call could not be stopped and "
                          "was left running in the background")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _run_one(adapter, impl, conv, cap, case, eps, skips, xfails, unavailable, *,
             timeout=DEFAULT_CASE_TIMEOUT) -> Result:
    r = Result(case.id, case.capability, "skip")
    if unavailable:
        r.message = f"adapter unavailable: {unavailable}"
        return r
    if cap is None:
        r.message = "capability unknown to this version of the suite"
        return r
    reason = _match(skips, case)
    if reason is None:
        reason = _match(list(getattr(adapter, "skip_cases", {}).items()), case)
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
    xfail_reason = _match(xfails, case)
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


def _adapter_raised(r, exc, xfail_reason) -> Result:
    """The result of a case whose adapter raised: a skip for :class:`CaseUnsupported`, else an
    error (an expected failure when the case is listed in the xfails)."""
    if isinstance(exc, CaseUnsupported):
        r.status = "skip"
        r.message = f"unsupported: {exc}"
        return r
    r.status = "xfail" if xfail_reason else "error"
    r.message = str(exc) if isinstance(exc, (CaseTimeout, _Unreadable)) else _raised(exc)
    if xfail_reason:
        r.message = f"expected failure ({xfail_reason}); {r.message}"
    return r


def _run_statistical(r, fn, inputs, case, cap, conv, rtol, xfail_reason,
                     timeout=DEFAULT_CASE_TIMEOUT) -> Result:
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
