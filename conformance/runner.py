"""Run the catalogue against one adapter and collect per-case results."""

from __future__ import annotations

import datetime as _dt
import fnmatch
import platform
import time
from dataclasses import dataclass, field

import numpy as np

from .adapter import Adapter, AdapterUnavailable, CaseUnsupported
from .compare import compare
from .diagnosis import diagnose
from .model import EPS32, EPS64, Case

__all__ = ["Result", "RunReport", "run_adapter", "read_pattern_file", "STATUSES"]

#: statuses in report order; "fail" and "error" make the run fail
STATUSES = ("pass", "convention", "fail", "error", "xfail", "skip")


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
        """Passes when nothing failed or errored and at least one case was compared."""
        c = self.counts()
        return (not self.unavailable and c["fail"] == 0 and c["error"] == 0
                and (c["pass"] + c["convention"]) > 0)

    def to_dict(self):
        return {
            "schema": "kfac_ref.conformance.report/1",
            "adapter": self.adapter,
            "source": self.source,
            "started": self.started,
            "duration_s": self.duration_s,
            "environment": self.environment,
            "unavailable": self.unavailable,
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
                skips=None, xfails=None, progress=None, setup=True) -> RunReport:
    """Run ``cases`` against ``adapter``.

    ``progress(case, result, index, total)`` is called after each case; ``setup=False`` when
    the caller has already called ``adapter.setup()`` (the command line does, to report an
    unavailable adapter before printing anything).
    """
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    try:
        if setup:
            adapter.setup()
        impl = adapter.implementations()
        info = adapter.info()
        unavailable = ""
    except Exception as exc:  # noqa: BLE001 - AdapterUnavailable, or a broken setup/version
        impl = {}
        unavailable = str(exc) if isinstance(exc, AdapterUnavailable) else \
            f"setup failed ({type(exc).__name__}: {exc})"
        info = {"name": adapter.name, "description": adapter.description, "version": "",
                "dtype": adapter.dtype, "conventions": adapter.conventions.to_dict(),
                "non_canonical_conventions": adapter.conventions.differences()}
    eps = EPS32 if adapter.dtype == "float32" else EPS64
    conv = adapter.conventions
    results = []
    total = len(cases)
    for i, case in enumerate(cases):
        cap = capabilities.get(case.capability)
        res = _run_one(adapter, impl, conv, cap, case, eps, skips, xfails, unavailable)
        res.source = case.source
        res.description = case.description
        results.append(res)
        if progress is not None:
            progress(case, res, i + 1, total)
    return RunReport(info, results, dict(absent or {}), source, environment(), started,
                     time.perf_counter() - t0, unavailable)


def _run_one(adapter, impl, conv, cap, case, eps, skips, xfails, unavailable) -> Result:
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
        return _run_statistical(r, fn, inputs, case, cap, conv, rtol, xfail_reason)
    try:
        t = time.perf_counter()
        actual = fn(inputs, dict(case.params))
        r.duration_s = time.perf_counter() - t
    except Exception as exc:  # noqa: BLE001 - an adapter error is a reported result
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
    r.message = f"{type(exc).__name__}: {exc}"
    if xfail_reason:
        r.message = f"expected failure ({xfail_reason}); {r.message}"
    return r


def _run_statistical(r, fn, inputs, case, cap, conv, rtol, xfail_reason) -> Result:
    """The own-draws route of a random capability (:mod:`conformance.sampling`): many seeded
    calls without the draws, a median-of-means test against the exact expectation."""
    from .model import Case
    from .sampling import GROUP_SIZE, statistical_check

    own = {k: v for k, v in inputs.items() if k not in cap.draws}
    mean = np.asarray(cap.convert_output(case.alternatives["_mean"], case, conv), np.float64)
    # the conversions are permutations and positive scalings: the standard deviation moves
    # like the output
    sd = np.abs(np.asarray(cap.convert_output(np.sqrt(case.alternatives["_var"]), case, conv),
                           np.float64))
    t = time.perf_counter()
    try:
        def estimate(seed):
            out = fn(own, dict(case.params, seed=seed))
            return out if cap.statistic is None else cap.statistic(out, case)

        st = statistical_check(estimate, mean, sd ** 2, rtol,
                               group_size=case.meta.get("group_size", GROUP_SIZE))
    except Exception as exc:  # noqa: BLE001 - an adapter error is a reported result
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
