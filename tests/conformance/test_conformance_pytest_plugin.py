"""The pytest plugin: ``pytest --kfac-adapter=SPEC`` runs the catalogue as pytest items in
someone else's repository, with the suite's diagnoses in the failure messages.

Each run is a subprocess in an empty folder (a stand-in for the maintainer's repository),
with this checkout on ``PYTHONPATH``; the plugin comes in with ``-p`` or, as an installed
kfac_ref provides it, through a ``pytest11`` entry point of a throwaway ``*.dist-info``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "conformance.pytest_plugin"


def _entry_point_installed() -> bool:
    """Whether an installed distribution (kfac_ref installed with pip, say) already gives
    pytest the plugin through its pytest11 entry point; then ``-p`` would load it twice."""
    from importlib.metadata import entry_points

    return any(ep.value == PLUGIN for ep in entry_points(group="pytest11"))


def _pytest(tmp_path, *args, plugin=True, extra_path=()):
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *map(str, extra_path)]))
    env.pop("KFAC_CONFORMANCE_ADAPTER", None)
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEsx",
           *(["-p", PLUGIN] if plugin and not _entry_point_installed() else []), *args]
    p = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr


def test_pyproject_declares_the_plugin_entry_point():
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.entry-points.pytest11]\n", 1)[1].split("\n\n", 1)[0]
    assert f'kfac_conformance = "{PLUGIN}"' in section.splitlines()


def test_reference_adapter_passes_every_case(tmp_path):
    rc, out = _pytest(tmp_path, "--kfac-adapter=kfac_ref", "--kfac-report", "reports", "-v")
    assert rc == 0, out
    assert "kfac_ref conformance: adapter kfac_ref" in out  # the report header
    assert "conventions: canonical" in out
    assert " passed" in out and "failed" not in out and "skipped" not in out
    rep = json.loads((tmp_path / "repo" / "reports" / "kfac_ref" / "report.json").read_text())
    assert rep["ok"] and rep["counts"]["pass"] > 100 and rep["counts"]["fail"] == 0
    assert (tmp_path / "repo" / "reports" / "kfac_ref" / "report.html").exists()


def test_mutant_fails_with_the_diagnosis_in_the_message(tmp_path):
    rc, out = _pytest(tmp_path, "--kfac-adapter=mutant_kron_swapped", "--kfac-family=linalg")
    assert rc == 1, out
    assert "4 failed" in out
    assert "FAILED kfac_conformance[mutant_kron_swapped]::linalg.kron/p3_q2" in out
    block = out.split("linalg.kron/p3_q2 (linalg.kron) FAIL", 1)[1].split("____", 1)[0]
    assert "relative error" in block and "> rtol" in block
    assert "diagnosis: kron_order_swapped (Kronecker order swapped)" in block
    assert "matches the reference under kron_order='GA', but the adapter declares " \
           "kron_order='AG'" in block
    assert "formula: docs page Conventions › Vectorisation and the order of the Kronecker " \
           "factors" in block
    assert "conventions.html#vectorisation-and-the-order-of-the-kronecker-factors" in block
    assert "Traceback" not in block


def test_xfails_file_and_keyword_selection(tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "xfails.txt").write_text(
        "# known: we use the PyTorch layout without declaring it\n"
        "linalg.kron*   # kron order, issue #12\n")
    rc, out = _pytest(tmp_path, "--kfac-adapter=mutant_kron_swapped", "--kfac-family=linalg",
                      "--kfac-xfails=xfails.txt", "-k", "linalg.kron")
    assert rc == 0, out
    assert "4 xfailed" in out and "deselected" in out
    assert "kron order, issue #12" in out


def test_unsupported_capabilities_are_skips_with_the_reason(tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "only_kron.py").write_text(
        "import numpy as np\n"
        "from conformance.adapter import Adapter, implements\n\n"
        "class OnlyKron(Adapter):\n"
        "    name = 'only_kron'\n"
        "    unsupported = {'linalg.compute_cov': 'no covariances here'}\n\n"
        "    @implements('linalg.kron')\n"
        "    def kron(self, inputs, params):\n"
        "        return np.kron(inputs['a'], inputs['g'])\n\n"
        "ADAPTER = OnlyKron\n")
    rc, out = _pytest(tmp_path, "--kfac-adapter=only_kron.py", "--kfac-family=linalg")
    assert rc == 0, out
    assert "2 passed" in out and "skipped" in out
    assert "unsupported: no covariances here" in out
    assert "unsupported: only_kron does not implement linalg.cross_cov" in out


def test_plugin_is_found_through_its_entry_point_and_inactive_without_an_adapter(tmp_path):
    site = tmp_path / "site"
    info = site / "kfac_ref_plugin_only-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kfac-ref-plugin-only\n"
                                   "Version: 0.0\n")
    (info / "entry_points.txt").write_text(f"[pytest11]\nkfac_conformance = {PLUGIN}\n")
    rc, out = _pytest(tmp_path, "--kfac-adapter=mutant_kron_swapped", "--kfac-family=linalg",
                      "-k", "kron and not matvec", plugin=False, extra_path=[site])
    assert rc == 1 and "2 failed" in out and "diagnosis: kron_order_swapped" in out, out
    # without --kfac-adapter the plugin adds nothing: an empty repository runs no tests
    rc, out = _pytest(tmp_path, plugin=False, extra_path=[site])
    assert rc == 5 and "no tests ran" in out, out


def test_an_adapter_that_cannot_load_is_a_usage_error(tmp_path):
    rc, out = _pytest(tmp_path, "--kfac-adapter=no_such_module_xyz")
    assert rc == 4, out
    assert "--kfac-adapter: adapter 'no_such_module_xyz' is unavailable: cannot import " \
           "adapter module 'no_such_module_xyz'" in out


def test_a_case_that_exits_or_hangs_fails_alone(tmp_path):
    """An adapter's SystemExit is its case's failure, and --kfac-case-timeout ends a hanging
    case; the other items run."""
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "unruly.py").write_text(
        "import sys, time\n"
        "import numpy as np\n"
        "from conformance.adapter import Adapter, implements\n\n"
        "class Unruly(Adapter):\n"
        "    name = 'unruly'\n\n"
        "    @implements('linalg.kron')\n"
        "    def kron(self, inputs, params):\n"
        "        if inputs['a'].shape[0] == 3:\n"
        "            sys.exit(0)\n"
        "        return np.kron(inputs['a'], inputs['g'])\n\n"
        "    @implements('linalg.kron_matvec')\n"
        "    def kron_matvec(self, inputs, params):\n"
        "        time.sleep(60)\n\n"
        "ADAPTER = Unruly\n")
    rc, out = _pytest(tmp_path, "--kfac-adapter=unruly.py", "--kfac-family=linalg",
                      "--kfac-case-timeout=0.5", "-k", "kron")
    assert rc == 1, out
    assert "1 passed" in out and "3 failed" in out, out
    assert "the adapter raised: SystemExit: 0 (a BaseException that would have ended the run)" \
        in out
    assert "the adapter raised: timed out: the case ran longer than the per-case limit of 0.5 s" \
        in out


# -- the plugin is the suite's one runner ----------------------------------------------------
def test_the_command_line_and_run_adapter_run_the_plugins_items(monkeypatch):
    """``run_adapter`` (behind ``python -m conformance run`` and ``conformance.run``) runs the
    cases as this plugin's items with pytest.main, untouched by the caller's pytest settings:
    ``PYTEST_ADDOPTS`` (an option no plugin knows), an ini file and other installed plugins
    play no part, and the environment is restored afterwards."""
    from conformance import pytest_plugin
    from conformance.adapter import load_adapter
    from conformance.catalogue import build_catalogue, capabilities
    from conformance.runner import run_adapter

    cases = [c for c in build_catalogue(["linalg"])[0] if c.capability == "linalg.kron"]
    seen = []
    real = pytest_plugin.ConformanceItem.runtest

    def runtest(item):
        seen.append(item.nodeid)
        return real(item)

    monkeypatch.setattr(pytest_plugin.ConformanceItem, "runtest", runtest)
    monkeypatch.setenv("PYTEST_ADDOPTS", "--no-such-option-anywhere")
    autoload = os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    rep = run_adapter(load_adapter("kfac_ref"), cases, capabilities())
    assert rep.ok and [r.case_id for r in rep.results] == [c.id for c in cases]
    assert seen == [f"kfac_conformance[kfac_ref]::{c.id}" for c in cases]
    assert os.environ["PYTEST_ADDOPTS"] == "--no-such-option-anywhere"
    assert os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD") == autoload


def test_no_second_runner_loop():
    """Only the plugin's items evaluate cases: ``run_case`` has one caller."""
    callers = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "conformance").rglob("*.py")
                     if "run_case(" in p.read_text(encoding="utf-8").replace(
                         "def run_case(", ""))
    assert callers == ["conformance/pytest_plugin.py"]
