"""The result model of a conformance run: one record per case, one report per run.

Every way the suite runs (``python -m conformance run``, ``pytest --kfac-adapter``,
:func:`conformance.run`) produces these records, and every report is a rendering of them:
the terminal summary, ``report.json``, ``junit.xml`` and ``report.md``
(:mod:`conformance.reports`), ``report.html`` (:mod:`conformance.html_report`) and the
ecosystem matrix.  ``report.json`` is :meth:`RunReport.to_dict`, and
:meth:`RunReport.from_dict` reads it back.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field, fields

import numpy as np

__all__ = ["CaseResult", "RunReport", "STATUSES", "SCHEMA", "environment"]

#: statuses in report order; "fail" and "error" make the run fail
STATUSES = ("pass", "convention", "fail", "error", "xfail", "skip")

#: the ``schema`` field of ``report.json``
SCHEMA = "kfac_ref.conformance.report/1"


@dataclass
class CaseResult:
    """The outcome of one case against one adapter.

    ``status`` is one of :data:`STATUSES`; ``rel_err`` is the largest relative error of the
    adapter's output against the expected value (the quantity compared with the tolerance)
    and ``rtol`` the case's tolerance, both NaN when nothing was compared; ``diagnosis`` is
    :meth:`conformance.diagnosis.Diagnosis.to_dict` of a disagreement; ``conventions`` the
    adapter's declared non-canonical conventions the case used; ``duration_s`` the time of
    the adapter's calls; ``source`` where the expected value came from (golden or live).
    """

    case_id: str
    capability: str
    status: str
    message: str = ""
    rel_err: float = float("nan")
    rtol: float = float("nan")
    diagnosis: dict | None = None
    conventions: dict = field(default_factory=dict)
    duration_s: float = 0.0
    source: str = "live"
    description: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("rel_err", "rtol"):
            if d[k] != d[k]:  # NaN is not JSON
                d[k] = None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CaseResult:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        for k in ("rel_err", "rtol"):
            if kw.get(k) is None:
                kw[k] = float("nan")
        return cls(**kw)


@dataclass
class RunReport:
    """One adapter's run: its :class:`CaseResult` s and what the run was."""

    adapter: dict  # name, description, version, dtype, conventions, non_canonical_conventions
    results: list  # of CaseResult, in run order
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

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
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

    @classmethod
    def from_dict(cls, d: dict) -> RunReport:
        """A report read back from ``report.json`` (:meth:`to_dict`)."""
        return cls(dict(d["adapter"]), [CaseResult.from_dict(r) for r in d["results"]],
                   dict(d.get("absent_families") or {}), d.get("source", ""),
                   dict(d.get("environment") or {}), d.get("started", ""),
                   float(d.get("duration_s") or 0.0), d.get("unavailable") or "",
                   d.get("interrupted") or "")


def as_report(report) -> RunReport:
    """``report`` as a :class:`RunReport` (a ``report.json`` dict is read back)."""
    return report if isinstance(report, RunReport) else RunReport.from_dict(report)


def environment() -> dict:
    """Where the run happened: Python, platform, NumPy and kfac_ref versions."""
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "numpy": np.__version__}
    try:
        import kfac_ref

        env["kfac_ref"] = kfac_ref.__version__
    except ImportError:
        env["kfac_ref"] = None
    return env
