"""The runner isolates adapters: whatever an adapter raises (``SystemExit`` and other
``BaseException`` s included) is an error of that case, a case past ``--case-timeout`` is an
error and the run goes on, Ctrl-C stops the run with partial reports marked interrupted (exit
status 130), a sampler's output must be draws, and adapter modules that cannot be imported are
reported, never dropped.  Each behaviour with a tiny fake adapter."""

from __future__ import annotations

import json
import re
import sys
import threading

import numpy as np
import pytest

import conformance.adapters as adapters_pkg
from conformance import __main__ as cli
from conformance.adapter import Adapter, AdapterUnavailable, implements, load_adapter
from conformance.adapters import broken, shipped
from conformance.catalogue import build_catalogue, capabilities
from conformance.runner import DEFAULT_CASE_TIMEOUT, run_adapter

KRON = ["-c", "linalg.kron", "--source", "live", "-q"]


def _write(tmp_path, body, name="fake_adapter.py"):
    path = tmp_path / name
    path.write_text("import numpy as np\n"
                    "from conformance.adapter import Adapter, implements\n" + body)
    return str(path)


def _report(out, name):
    return json.loads((out / name / "report.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def kron_cases():
    cases, _ = build_catalogue(["linalg"])
    return [c for c in cases if c.capability == "linalg.kron"]


# -- BaseExceptions are errors of their case -----------------------------------------------
@pytest.mark.parametrize("raised", ["SystemExit(0)", "SystemExit(3)", "GeneratorExit()",
                                    "type('Stop', (BaseException,), {})('stop here')"])
def test_a_base_exception_is_an_error_of_its_case(tmp_path, capsys, raised):
    path = _write(tmp_path,
                  "class A(Adapter):\n"
                  "    name = 'exiter'\n"
                  "    @implements('linalg.kron')\n"
                  "    def kron(self, inputs, params):\n"
                  "        if inputs['a'].shape[0] == 3:\n"
                  f"            raise {raised}\n"
                  "        return np.kron(inputs['a'], inputs['g'])\n"
                  "ADAPTER = A()\n")
    out = tmp_path / "out"
    assert cli.main(["--adapter", path, "--out", str(out), *KRON]) == 1
    printed = capsys.readouterr().out
    assert "FAILED: 1 passed" in printed and "1 errors" in printed
    rep = _report(out, "exiter")
    statuses = sorted(r["status"] for r in rep["results"])
    assert statuses == ["error", "pass"]  # the run went on after the raising case
    (err,) = [r for r in rep["results"] if r["status"] == "error"]
    name = raised.split("(")[0] if not raised.startswith("type") else "Stop"
    assert err["message"].startswith(f"{name}: ")
    assert "a BaseException that would have ended the run" in err["message"]
    for f in ("junit.xml", "report.md", "report.html"):
        assert (out / "exiter" / f).is_file()


def test_an_adapter_module_that_exits_on_import_is_a_load_error(tmp_path, capsys):
    path = tmp_path / "exits_on_import.py"
    path.write_text("import sys\nsys.exit(0)\n")
    assert cli.main(["--adapter", str(path), "--out", str(tmp_path / "out"), *KRON]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot load adapter {str(path)!r}: SystemExit: 0" in err


def test_a_setup_that_raises_is_an_error_not_an_unavailable_adapter(kron_cases):
    class Broken(Adapter):
        name = "broken_setup"

        def setup(self):
            raise SystemExit("setup gave up")

    rep = run_adapter(Broken(), kron_cases, capabilities())
    assert not rep.ok and rep.unavailable == ""
    (row,) = rep.results
    assert (row.case_id, row.capability, row.status) == ("broken_setup/setup", "adapter.setup",
                                                         "error")
    assert row.message.startswith("the adapter could not be set up: SystemExit: setup gave up")

    class NoVersion(Adapter):  # metadata that cannot be read is no reason to stop
        name = "no_version"

        def version(self):
            raise LookupError("no distribution metadata")

        @implements("linalg.kron")
        def kron(self, inputs, params):
            return np.kron(inputs["a"], inputs["g"])

    rep = run_adapter(NoVersion(), kron_cases, capabilities())
    assert rep.ok and rep.adapter["version"] == (
        "unknown (version() raised LookupError: no distribution metadata)")

    class Missing(Adapter):  # a missing implementation stays "unavailable" (a skip)
        name = "missing"

        def setup(self):
            raise AdapterUnavailable("libfoo is not installed")

    rep = run_adapter(Missing(), kron_cases, capabilities())
    assert rep.unavailable == "libfoo is not installed"
    assert all(r.status == "skip" for r in rep.results)


# -- the per-case time limit ---------------------------------------------------------------
def test_a_hanging_case_times_out_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(sys.modules[__name__], "HANG", release, raising=False)
    path = _write(tmp_path,
                  f"import {__name__} as t\n"
                  "class A(Adapter):\n"
                  "    name = 'hanger'\n"
                  "    @implements('linalg.kron')\n"
                  "    def kron(self, inputs, params):\n"
                  "        if inputs['a'].shape[0] == 3:\n"
                  "            t.HANG.wait(600)\n"
                  "        return np.kron(inputs['a'], inputs['g'])\n"
                  "ADAPTER = A()\n")
    out = tmp_path / "out"
    try:
        assert cli.main(["--adapter", path, "--out", str(out), "--case-timeout", "0.3",
                         *KRON]) == 1
    finally:
        release.set()  # let the abandoned call end
    rep = _report(out, "hanger")
    (late,) = [r for r in rep["results"] if r["status"] == "error"]
    assert late["message"].startswith("timed out: the case ran longer than the per-case "
                                      "limit of 0.3 s (--case-timeout)")
    assert 0.3 <= late["duration_s"] < 30
    assert [r["status"] for r in rep["results"]].count("pass") == 1
    assert "timed out" in (out / "hanger" / "report.md").read_text(encoding="utf-8")


def test_the_time_limit_keeps_the_callers_context_variables(kron_cases):
    import contextvars

    flag = contextvars.ContextVar("flag", default="unset")

    class Reads(Adapter):
        name = "reads_context"

        @implements("linalg.kron")
        def kron(self, inputs, params):
            assert flag.get() == "set in setup"
            return np.kron(inputs["a"], inputs["g"])

    flag.set("set in setup")
    rep = run_adapter(Reads(), kron_cases, capabilities(), case_timeout=5)
    assert [r.status for r in rep.results] == ["pass", "pass"]


@pytest.mark.parametrize("value", ["-1", "abc", "inf", "nan"])
def test_case_timeout_must_be_seconds(capsys, value):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--case-timeout", value])
    assert exc.value.code == 2
    assert "expected a number of seconds >= 0 (0: no limit)" in capsys.readouterr().err


def test_the_default_time_limit_is_documented_once():
    assert cli.DEFAULT_CASE_TIMEOUT == DEFAULT_CASE_TIMEOUT
    assert cli._parser().parse_args(["run"]).case_timeout == DEFAULT_CASE_TIMEOUT


# -- Ctrl-C ----------------------------------------------------------------------------------
@pytest.mark.parametrize("timeout", ["0", "5"])
def test_ctrl_c_stops_the_run_with_partial_reports(tmp_path, capsys, timeout):
    """A KeyboardInterrupt in the adapter's code (where Ctrl-C lands while a case runs; with a
    time limit it is handed over from the case's thread) stops the run."""
    path = _write(tmp_path,
                  "class A(Adapter):\n"
                  "    name = 'interrupted'\n"
                  "    @implements('linalg.kron')\n"
                  "    def kron(self, inputs, params):\n"
                  "        if inputs['a'].shape[0] == 4:\n"
                  "            raise KeyboardInterrupt\n"
                  "        return np.kron(inputs['a'], inputs['g'])\n"
                  "ADAPTER = A()\n")
    out = tmp_path / "out"
    assert cli.main(["--adapter", path, "--out", str(out), "--case-timeout", timeout,
                     *KRON]) == cli.EXIT_INTERRUPTED == 130
    cap = capsys.readouterr()
    assert "RUN INTERRUPTED, INCOMPLETE: interrupted (Ctrl-C) at case linalg.kron/p4_q3: 1 of " \
           "2 cases ran, 1 did not" in cap.out
    assert "\nINTERRUPTED: 1 passed" in cap.out
    assert "the reports hold the cases that ran" in cap.err
    rep = _report(out, "interrupted")
    assert rep["ok"] is False and rep["interrupted"].startswith("interrupted (Ctrl-C)")
    assert [r["case_id"] for r in rep["results"]] == ["linalg.kron/p3_q2"]
    assert "Run interrupted, incomplete" in (out / "interrupted" / "report.md").read_text(
        encoding="utf-8")
    assert "Run interrupted, incomplete" in (out / "interrupted" / "report.html").read_text(
        encoding="utf-8")


@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGINT")
def test_a_real_ctrl_c_while_a_case_hangs(tmp_path):
    """SIGINT while the runner waits for a hanging case's thread: the wait is interrupted, the
    reports are written and the exit status is 130."""
    import signal
    import subprocess
    from pathlib import Path

    path = _write(tmp_path,
                  "import time\n"
                  "class A(Adapter):\n"
                  "    name = 'sigint'\n"
                  "    @implements('linalg.kron')\n"
                  "    def kron(self, inputs, params):\n"
                  "        if inputs['a'].shape[0] == 4:\n"
                  "            print('HANGING', flush=True)\n"
                  "            time.sleep(600)\n"
                  "        return np.kron(inputs['a'], inputs['g'])\n"
                  "ADAPTER = A()\n")
    out = tmp_path / "out"
    # the child handles Ctrl-C as Python in a terminal does, wherever the tests run: a shell
    # starts background jobs with SIGINT ignored, and Python then installs no handler
    start = ("import runpy, signal, sys; "
             "signal.signal(signal.SIGINT, signal.default_int_handler); "
             "sys.argv[0] = 'conformance'; runpy.run_module('conformance', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", start, "--adapter", path,
                             "--out", str(out), *KRON[:-1]],
                            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "HANGING" in line:
                break
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "RUN INTERRUPTED, INCOMPLETE: interrupted (Ctrl-C) at case linalg.kron/p4_q3" in stdout
    rep = _report(out, "sigint")
    assert rep["interrupted"] and [r["status"] for r in rep["results"]] == ["pass"]


@pytest.mark.skipif(not hasattr(__import__("signal"), "pthread_kill"), reason="POSIX threads")
def test_a_ctrl_c_received_by_the_cases_thread_stops_the_wait():
    """The kernel may hand a process's SIGINT to any of its threads.  One received by the
    case's own thread still interrupts the runner's wait while the case goes on (the wait
    is not held to the end of the per-case limit)."""
    import signal
    import time

    from conformance.runner import _isolated

    release = threading.Event()
    finished = threading.Event()

    def case():
        time.sleep(0.5)  # the runner is waiting by then
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        release.wait(30)
        finished.set()

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _isolated(case, DEFAULT_CASE_TIMEOUT)
        assert not finished.is_set(), "the wait ended only when the case did"
    finally:
        release.set()
        signal.signal(signal.SIGINT, previous)


# -- a sampler's output must be draws -------------------------------------------------------
@pytest.fixture(scope="module")
def sample_cases():
    cases, _ = build_catalogue(["losses"])
    return [c for c in cases if c.capability == "losses.sample"]


def _softmax(z):
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def _draw(kind, inputs, rng):
    if kind == "categorical":
        p = _softmax(inputs["logits"])
        return (rng.random((p.shape[0], 1)) > np.cumsum(p, axis=-1)).sum(axis=-1)
    if kind == "onehot_categorical":
        return np.eye(inputs["logits"].shape[-1])[_draw("categorical", inputs, rng)]
    if kind == "multi_bernoulli":
        return (rng.random(inputs["logits"].shape) < 1 / (1 + np.exp(-inputs["logits"]))
                ).astype(np.float64)
    return inputs["mean"] + rng.standard_normal(inputs["mean"].shape)


class Sampler(Adapter):
    """Draws of the right distribution, then spoiled as ``mode`` says."""

    name = "sampler"

    def __init__(self, mode):
        self.mode = mode

    @implements("losses.sample")
    def sample(self, inputs, params):
        kind = params["loss"]
        y = _draw(kind, inputs, np.random.default_rng(params["seed"]))
        if self.mode == "probabilities":  # the distribution's mean instead of a draw
            return (_softmax(inputs["logits"]) if kind != "multi_bernoulli"
                    else 1 / (1 + np.exp(-inputs["logits"])))
        if self.mode == "complex":
            return y + 0j
        if self.mode == "strings":
            return y.astype(str)
        if self.mode == "objects":
            return y.astype(object)
        if self.mode == "fractional_classes":
            return y + 0.5
        if self.mode == "nan":
            return np.where(np.arange(y.size).reshape(y.shape) == 0, np.nan, y)
        return y


@pytest.mark.parametrize("mode, kinds, says", [
    ("probabilities", ("categorical", "onehot_categorical", "multi_bernoulli"),
     ("(probabilities?)", "holds 0 and 1 only")),
    ("complex", None, ("dtype complex128",)),
    ("strings", None, ("dtype <U",)),
    ("objects", None, ("dtype object",)),
    ("fractional_classes", ("categorical",), ("integer class indices in [0, 3)",)),
    ("nan", ("normal_mean", "normal_mean_variance"), ("NaN/Inf",)),
])
def test_a_sampler_must_return_draws(sample_cases, mode, kinds, says):
    cases = [c for c in sample_cases if kinds is None or c.params["loss"] in kinds]
    assert {c.params["loss"] for c in cases} >= set(kinds or ("categorical", "normal_mean"))
    rep = run_adapter(Sampler(mode), cases, capabilities())
    assert len(rep.results) == len(cases)
    for r in rep.results:
        assert r.status == "fail", (r.case_id, r.message)
        assert r.diagnosis["pitfall"] == "not_draws"
        assert any(s in r.diagnosis["explanation"] for s in says), r.diagnosis
        assert "diagnosis: not_draws: " in r.message


def test_true_draws_pass(sample_cases):
    rep = run_adapter(Sampler("draws"), [c for c in sample_cases
                                         if c.params["loss"] in ("categorical",
                                                                 "multi_bernoulli")],
                      capabilities())
    assert {r.status for r in rep.results} == {"pass"}, [r.message for r in rep.results]


# -- broken adapter modules are reported ---------------------------------------------------
@pytest.fixture
def broken_module(tmp_path, monkeypatch):
    """A module in the shipped adapters' package that cannot be imported."""
    folder = tmp_path / "extra_adapters"
    folder.mkdir()
    (folder / "peer_zz_broken.py").write_text("import numpy\nraise ImportError('libzz is "
                                               "missing at import time')\n")
    monkeypatch.setattr(adapters_pkg, "__path__", [*adapters_pkg.__path__, str(folder)])
    yield "conformance.adapters.peer_zz_broken"
    sys.modules.pop("conformance.adapters.peer_zz_broken", None)


def test_a_broken_adapter_module_is_named_with_its_exception(broken_module, capsys):
    assert broken() == {broken_module: "ImportError: libzz is missing at import time"}
    assert "kfac_ref" in shipped()  # the others are still there
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^  peer_zz_broken +\(module {re.escape(broken_module)} cannot be "
                     r"imported: ImportError: libzz is missing at import time\)$", out, re.M)
    with pytest.raises(AdapterUnavailable, match="cannot be imported and may define it: "
                                                 f"{broken_module} \\(ImportError: libzz"):
        load_adapter("zz")


def test_all_adapters_reports_a_broken_module_as_an_error(broken_module, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["--all-adapters", "--out", str(out), "-q", "--source", "live",
                     "--family", "linalg", "-k", "linalg.kron/p3_q2"])
    assert code == 1
    rep = _report(out, "peer_zz_broken")
    (row,) = rep["results"]
    assert row["status"] == "error" and row["capability"] == "adapter.setup"
    assert f"adapter module {broken_module} cannot be imported: ImportError: libzz is " \
           "missing at import time" in row["message"]
    matrix = json.loads((out / "matrix.json").read_text(encoding="utf-8"))
    assert matrix["implementations"]["peer_zz_broken"]["ok"] is False
