"""Test matrix: one session-scoped ``xp`` fixture over every available backend.

Each parameter is a :class:`Backend`: the array namespace, the device and the floating dtype
a test should build its inputs in, plus helpers to move host (NumPy) data in and results
out.  Tests build inputs on the host with an explicit ``numpy.random.Generator``, convert
them with ``xp.asarray``, call kfac_ref, check with ``xp.check(result)`` that the result
stayed in the backend's namespace, device and dtype, and compare ``xp.to_numpy(result)``
with an oracle computed in float64 NumPy from the *same* (possibly float32-rounded) inputs.

Tolerances (``xp.rtol``)
------------------------
Comparisons are norm-wise: ``max|r - e| <= rtol * max|e|``.  For a backward-stable
computation on an ``n × n`` problem with condition number ``κ`` the relative error is
bounded by ``c · n · κ · eps``.  The test matrices here have ``n <= 16`` and are built with
``κ <= 256`` (eigenvalues in a bounded range, or damping), so ``n · κ <= 4096`` and
``rtol = 4096 · eps`` covers ``c`` of order one:

* float64: ``4096 · 2.2e-16 ≈ 9.1e-13``;
* float32: ``4096 · 1.19e-7 ≈ 4.9e-4``.

A test whose computation is worse conditioned than that (finite differences, Monte-Carlo)
derives its own tolerance and says how.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import array_api_compat
import numpy as np
import pytest

try:  # hypothesis profile: deterministic, CI-sized
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "kfac_ref",
        max_examples=int(os.environ.get("KFAC_REF_HYPOTHESIS_EXAMPLES", "25")),
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture,
                               HealthCheck.differing_executors],
    )
    settings.load_profile("kfac_ref")
except ImportError:  # pragma: no cover
    pass

import support_recorder  # noqa: E402  (tests/ is on sys.path for its conftest)

RTOL_FACTOR = 4096.0

# Every public kfac_ref object records the backends it is called with (see
# tests/support_recorder.py and tests/test_zz_support_claims.py).
RECORDED = support_recorder.install()
FULL_RUN = {"value": False, "cells": ()}
# test files skipped whole at collection (a peer's importorskip): part of a full run
_SKIPPED_FILES = set()


def pytest_collectreport(report):
    if report.skipped and report.nodeid.endswith(".py"):
        _SKIPPED_FILES.add(report.nodeid.rsplit("/", 1)[-1])


def pytest_collection_finish(session):
    """Note whether this run is the whole suite on the whole matrix: only then can the
    support claims be compared with what was exercised."""
    import pathlib

    tests_dir = pathlib.Path(__file__).parent
    # the library's tests and the conformance harness's (tests/conformance/)
    files = {p.name for p in tests_dir.rglob("test_*.py")}
    seen = {pathlib.Path(str(item.fspath)).name for item in session.items} | _SKIPPED_FILES
    opt = session.config.option
    FULL_RUN["value"] = (files <= seen and not opt.keyword and not opt.markexpr
                         and not os.environ.get("KFAC_REF_BACKENDS")
                         and not getattr(opt, "lf", False)
                         and not getattr(opt, "deselect", None))
    FULL_RUN["cells"] = tuple(p.id for p in _backends()
                              if not any(m.name == "skip" for m in p.marks))


def pytest_sessionfinish(session, exitstatus):
    """KFAC_REF_SUPPORT_DUMP=path writes what the run exercised (object, backend) as JSON,
    the evidence for editing the ``@capabilities`` declarations on the objects' definitions.

    Under pytest-xdist each worker hands its record to the controller, which merges them and
    compares the support claims with the merged record (what
    ``test_every_eager_claim_was_exercised`` does in a run without workers), failing the run
    when a claim was not exercised; with KFAC_REF_SUPPORT_DUMP the controller writes the
    merged record to ``path`` and each worker its own to ``path.<worker id>``."""
    import json

    path = os.environ.get("KFAC_REF_SUPPORT_DUMP")
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker
        workeroutput["kfac_ref_support"] = json.dumps(
            {"calls": sorted(support_recorder.CALLS), "full": FULL_RUN["value"],
             "cells": list(FULL_RUN["cells"])})
        if path:
            worker = session.config.workerinput["workerid"]
            with open(f"{path}.{worker}", "w", encoding="utf-8") as f:
                json.dump(sorted(support_recorder.CALLS), f, indent=0)
        return
    records = _WORKER_RECORDS
    calls = set(support_recorder.CALLS)
    for rec in records:
        calls |= {tuple(c) for c in rec["calls"]}
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(sorted(calls), f, indent=0)
    stopped_early = exitstatus not in (0, 1) or (exitstatus == 1 and session.config.option.maxfail)
    if records and all(r["full"] for r in records) and not stopped_early:
        missing = support_recorder.unexercised_claims(records[0]["cells"], calls)
        _SUPPORT_VERDICT.append((len(records), missing))
        if missing:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- pytest-xdist: the default run uses the CPUs when xdist is installed -----------------------
#: the support records the workers handed back (controller only)
_WORKER_RECORDS: list = []
#: (number of workers, unexercised claims) once the controller compared them
_SUPPORT_VERDICT: list = []
#: at most this many workers (each imports every backend and builds its own fixtures)
MAX_WORKERS = 8


def _cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config):
    """The whole suite (``pytest`` with no paths, as the README runs it) is spread over
    min(CPUs, 8) pytest-xdist workers when xdist is installed (the ``test`` extra installs
    it) and the command line does not choose: ``-n 0`` or ``-p no:xdist`` runs in one
    process, ``-n N`` / ``--dist`` choose for themselves, and a run of named files or tests
    stays in one process (no start-up cost for a quick check)."""
    opt = config.option
    if (config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and getattr(opt, "numprocesses", 0) is None and getattr(opt, "dist", "") == "no"
            and not getattr(opt, "tx", None) and not opt.usepdb and not opt.collectonly
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS):
        n = min(_cpus(), MAX_WORKERS)
        if n > 1:
            opt.numprocesses = n
    return (yield)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist (controller): keep the support record a worker handed back."""
    import json

    rec = getattr(node, "workeroutput", {}).get("kfac_ref_support")
    if rec is not None:
        _WORKER_RECORDS.append(json.loads(rec))


# -- the end of the run: skips counted per reason, the merged support claims -----------------
def _reason(rep):
    longrepr = rep.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(getattr(rep, "wasxfail", "") or longrepr)
    return reason.removeprefix("Skipped: ").strip()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Skips and xfails in a few lines, counted per reason (``-rs`` lists each one), and,
    under pytest-xdist, the support claims compared on the workers' merged records."""
    tr = terminalreporter
    for verdict in _SUPPORT_VERDICT:
        workers, missing = verdict
        if missing:
            tr.write_sep("=", "support claims (merged records of the xdist workers)", red=True)
            tr.write_line("FAILED " + support_recorder.unexercised_message(missing))
        else:
            tr.write_line(f"support claims: every declared 'yes' of the cells that ran was "
                          f"exercised (records of {workers} xdist workers merged)")
    chars = getattr(config.option, "reportchars", "") or ""
    for key, what, char in (("skipped", "skipped", "s"), ("xfailed", "xfailed", "x")):
        if char in chars or "a" in chars or "A" in chars:
            continue  # listed one by one already
        reports = tr.stats.get(key, [])
        if not reports:
            continue
        counts = {}
        for rep in reports:
            reason = _reason(rep)
            counts[reason] = counts.get(reason, 0) + 1
        top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        tr.write_sep("-", f"{len(reports)} {what}, by reason (-r{char} lists each)")
        shown = top[:10]
        width = len(str(shown[0][1]))
        for reason, n in shown:
            line = f"{n:>{width}}  {reason}"
            tr.write_line(line if len(line) <= 160 else line[:157] + "...")
        rest = top[10:]
        if rest:
            tr.write_line(f"{sum(n for _, n in rest):>{width}}  in {len(rest)} other reasons")


@dataclass(frozen=True)
class Backend:
    """One cell of the test matrix."""

    name: str
    xp: Any  # the array namespace
    device: Any
    dtype: Any
    float64: bool  # whether the dtype under test is float64

    # -- moving data ---------------------------------------------------------------
    def asarray(self, host, dtype=None):
        """Host data -> backend array on ``device`` in ``dtype`` (default: the float dtype
        under test; pass an integer dtype of the namespace for ids)."""
        host = np.array(host)  # a writable copy: torch warns on read-only NumPy views
        if dtype is None:
            dtype = self.dtype if host.dtype.kind in "fc" else None
        if dtype is None:
            if host.dtype.kind == "b":
                dtype = self.xp.bool
            elif host.dtype.kind in "iu":
                dtype = self.xp.int64 if self.float64 else self.xp.int32
        return self.xp.asarray(host, dtype=dtype, device=self.device)

    def round_host(self, host):
        """The host value the backend actually sees (float32 rounding on float32 cells)."""
        host = np.asarray(host)
        if host.dtype.kind == "f":
            return host.astype(np.float64 if self.float64 else np.float32).astype(np.float64)
        return host

    def to_numpy(self, arr):
        """Backend array -> float64 (or integer) NumPy array, for comparison."""
        if self.name.startswith("strict"):
            # array-api-strict refuses __array__ off its CPU device; go via a copy to CPU.
            import array_api_strict

            arr = self.xp.asarray(arr, copy=True, device=array_api_strict.Device("CPU_DEVICE"))
            out = np.asarray(arr._array)  # noqa: SLF001 - test-only host read-back
        elif self.name.startswith("torch"):
            out = arr.detach().cpu().numpy()
        elif self.name.startswith("cupy"):
            out = arr.get()
        else:
            out = np.asarray(arr)
        return out.astype(np.float64) if out.dtype.kind == "f" else out

    # -- checks ------------------------------------------------------------------
    @property
    def eps(self) -> float:
        return float(np.finfo(np.float64 if self.float64 else np.float32).eps)

    @property
    def rtol(self) -> float:
        return RTOL_FACTOR * self.eps

    def check(self, arr, dtype=None):
        """Assert ``arr`` is of this backend's namespace, device and (float) dtype."""
        assert array_api_compat.array_namespace(arr) is self.xp, (
            f"result left the namespace: {type(arr)}"
        )
        assert array_api_compat.device(arr) == self.device, (
            f"result left the device: {array_api_compat.device(arr)} != {self.device}"
        )
        assert arr.dtype == (self.dtype if dtype is None else dtype), (
            f"result dtype {arr.dtype} != {self.dtype if dtype is None else dtype}"
        )
        return arr

    def assert_close(self, result, expected, rtol=None, atol=0.0):
        """Check namespace/device/dtype of ``result`` and compare it norm-wise with the
        float64 NumPy oracle ``expected``."""
        self.check(result)
        got = self.to_numpy(result)
        assert_allclose_normwise(got, expected, self.rtol if rtol is None else rtol, atol)

    def __repr__(self) -> str:
        return self.name


def assert_allclose_normwise(got, expected, rtol, atol=0.0):
    """``max|got - expected| <= rtol * max|expected| + atol``; shapes must match, NaN fails."""
    got = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape, f"shape {got.shape} != expected {expected.shape}"
    assert np.all(np.isfinite(got)), "result has NaN/Inf"
    if got.size == 0:
        return
    err = float(np.max(np.abs(got - expected)))
    scale = float(np.max(np.abs(expected)))
    assert err <= rtol * scale + atol, (
        f"max abs error {err:.3e} > rtol {rtol:.1e} * scale {scale:.3e} + atol {atol:.1e}"
    )


def _backends():
    params = []
    import array_api_compat.numpy as anp

    params.append(pytest.param(("numpy", anp, "cpu", anp.float64, True), id="numpy"))
    try:
        import array_api_strict as xs

        params.append(pytest.param(("strict", xs, xs.Device("CPU_DEVICE"), xs.float64, True),
                                   id="strict"))
        params.append(pytest.param(("strict-device1", xs, xs.Device("device1"), xs.float64,
                                    True), id="strict-device1"))
        params.append(pytest.param(("strict-no_float64", xs, xs.Device("no_float64"),
                                    xs.float32, False), id="strict-no_float64"))
    except ImportError:
        params.append(pytest.param(None, id="strict",
                                   marks=pytest.mark.skip(reason="array-api-strict not installed")))
    try:
        import array_api_compat.torch as atorch
        import torch

        params.append(pytest.param(("torch-cpu", atorch, torch.device("cpu"), torch.float64,
                                    True), id="torch-cpu"))
        params.append(pytest.param(("torch-cpu-float32", atorch, torch.device("cpu"),
                                    torch.float32, False), id="torch-cpu-float32"))
        if torch.cuda.is_available():
            # the device an array reports is cuda:0; torch.device("cuda") (index None)
            # would not compare equal to it
            cuda = torch.device("cuda", 0)
            params.append(pytest.param(("torch-cuda", atorch, cuda, torch.float64, True),
                                       id="torch-cuda"))
            params.append(pytest.param(("torch-cuda-float32", atorch, cuda, torch.float32,
                                        False), id="torch-cuda-float32"))
        else:
            params.append(pytest.param(None, id="torch-cuda", marks=pytest.mark.skip(
                reason="torch CUDA tensors need a CUDA GPU")))
    except ImportError:
        params.append(pytest.param(None, id="torch-cpu",
                                   marks=pytest.mark.skip(reason="torch not installed")))
    try:
        import jax

        # float64 JAX arrays need x64 mode, switched on for the whole session before any
        # array exists; the float32 cell asks for float32 explicitly.
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp

        cpu = jax.devices("cpu")[0]
        params.append(pytest.param(("jax", jnp, cpu, jnp.float64, True), id="jax"))
        params.append(pytest.param(("jax-float32", jnp, cpu, jnp.float32, False),
                                   id="jax-float32"))
    except ImportError:
        params.append(pytest.param(None, id="jax",
                                   marks=pytest.mark.skip(reason="jax not installed")))
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no GPU")
        import array_api_compat.cupy as acp

        params.append(pytest.param(("cupy", acp, cupy.cuda.Device(0), acp.float64, True),
                                   id="cupy"))
        params.append(pytest.param(("cupy-float32", acp, cupy.cuda.Device(0), acp.float32,
                                    False), id="cupy-float32"))
    except Exception as exc:  # ImportError, or CUDA errors on a machine without a GPU
        params.append(pytest.param(None, id="cupy", marks=pytest.mark.skip(
            reason=f"CuPy needs a CUDA GPU ({type(exc).__name__}: {exc})")))
    return params


def _selected(params):
    """Restrict the matrix with KFAC_REF_BACKENDS=numpy,strict,... (prefix match on the ids);
    the nox sessions tests-numpy / tests-strict / tests-torch use it."""
    wanted = [w.strip() for w in os.environ.get("KFAC_REF_BACKENDS", "").split(",") if w.strip()]
    if not wanted:
        return params
    return [p for p in params if any(p.id == w or p.id.startswith(w + "-") for w in wanted)]


@pytest.fixture(scope="session", params=_selected(_backends()))
def xp(request) -> Backend:
    """The backend under test (namespace, device, dtype and host conversions)."""
    name, ns, device, dtype, f64 = request.param
    return Backend(name, ns, device, dtype, f64)


@pytest.fixture
def jax_x64():
    """JAX's float64 mode on for one test, the previous setting restored afterwards; a file
    whose every test needs it says ``pytestmark = pytest.mark.usefixtures("jax_x64")``."""
    jax = pytest.importorskip("jax")
    previous = bool(jax.config.read("jax_enable_x64"))
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


@pytest.fixture
def finite_scans(monkeypatch):
    """How often kfac_ref's finiteness check scans each array (a Counter by ``id``) while the
    test runs."""
    import collections

    import kfac_ref._backend as backend

    seen = collections.Counter()
    original = backend.all_finite

    def counting(xp, x):
        seen[id(x)] += 1
        return original(xp, x)

    monkeypatch.setattr(backend, "all_finite", counting)
    return seen


@pytest.fixture
def rng():
    """A fresh, fixed-seed host generator for each test."""
    return np.random.default_rng(20261202)


# -- host-side helpers for building well-conditioned test data ------------------------
def ar1_series(rng, steps, batch, n, rho=0.5):
    """``[steps, batch, n]`` rows of an AR(1) process, ``x_t = x_{t-1} M + noise`` with a
    random mixing matrix of scale ``rho`` (data for the series blocks' C1 statistics)."""
    x = np.empty((steps, batch, n))
    mix = rng.standard_normal((n, n)) / np.sqrt(n) * rho
    x[0] = rng.standard_normal((batch, n))
    for t in range(1, steps):
        x[t] = x[t - 1] @ mix + rng.standard_normal((batch, n))
    return x


def random_spd(rng, n, low=0.1, high=10.0):
    """Symmetric positive definite ``n × n`` matrix with eigenvalues in [low, high]
    (condition number <= high/low)."""
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    s = rng.uniform(low, high, size=n)
    m = (q * s) @ q.T
    return (m + m.T) / 2


def davis_kahan(*factors):
    """max over the symmetric ``factors`` of max|λ| / (smallest eigengap), at least 1: by
    Davis–Kahan the factor by which a perturbation can move a factor's eigenvectors, so the
    growth of rounding errors in anything built on their eigenbasis."""
    ratio = 1.0
    for m in factors:
        ev = np.linalg.eigvalsh(m)
        gap = np.min(np.diff(ev)) if ev.size > 1 else np.inf
        ratio = max(ratio, np.max(np.abs(ev)) / gap)
    return ratio


def random_psd(rng, n, rank):
    """Symmetric PSD ``n × n`` matrix of the given rank."""
    x = rng.standard_normal((rank, n))
    m = x.T @ x / max(rank, 1)
    return (m + m.T) / 2
