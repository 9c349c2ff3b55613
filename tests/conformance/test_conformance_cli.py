"""The command line explains itself: help text, version, exit status, where reports go, the
summary's legend, and an unavailable adapter reported before anything else is printed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kfac_ref
from conformance.__main__ import DEFAULT_OUT, SCRIPT, locate, main
from conformance.adapter import load_adapter
from conformance.adapters import shipped
from conformance.reports import write_matrix

ROOT = Path(__file__).resolve().parents[2]


def _help(capsys, *argv, prog=SCRIPT):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"], prog=prog)
    assert exc.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", [(), ("run",)])
def test_help_lists_adapters_environment_reports_and_exit_status(capsys, command):
    text = _help(capsys, *command)
    assert text.startswith(f"usage: {SCRIPT}")
    for name in shipped():
        desc = load_adapter(name).description
        assert re.search(rf"^  {re.escape(name)} +{re.escape(desc)}$", text, re.M), name
    assert "KFAC_CONFORMANCE_ADAPTER  the adapter to run when --adapter is not given" in text
    assert "report.md and report.html (one self-contained page)\n" \
        f"  in {DEFAULT_OUT}/<adapter>/ under the current directory" in text
    assert "The default run is a self-check: kfac_ref against its own golden vectors" in text
    assert f"  {SCRIPT} list " in text and f"  {SCRIPT} --adapter NAME " in text
    status = text[text.index("exit status:"):]
    for code in "012":
        assert re.search(rf"^  {code}  \S", status, re.M), code
    if not command:
        assert "--version" in text


def test_prog_is_how_the_suite_was_invoked(capsys):
    assert _help(capsys, prog="python -m conformance").startswith("usage: python -m conformance")
    out = subprocess.run([sys.executable, "-m", "conformance", "run", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("usage: python -m conformance run")
    # the console script passes its own name
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'kfac-conformance = "conformance.__main__:script"' in pyproject
    assert SCRIPT == "kfac-conformance"


def test_version_is_the_project_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"], prog=SCRIPT)
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"{SCRIPT} {kfac_ref.__version__}"
    # one source: the package metadata reads kfac_ref.__version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]$', pyproject, re.M)
    assert 'version = { attr = "kfac_ref.__version__" }' in pyproject
    assert not re.search(r'^version = "', pyproject, re.M)  # no second, static version


def test_exit_status(tmp_path, capsys):
    out = ["--out", str(tmp_path), "-q"]
    assert main([*out, "--family", "averaging"]) == 0
    assert main([*out, "--adapter", "mutant_no_zero_debias", "--family", "averaging"]) == 1
    assert main([*out, "-k", "no-case-has-this-id"]) == 1
    assert main([*out, "--adapter", "no_such_module_xyz"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["--no-such-option"])
    assert exc.value.code == 2
    bad = tmp_path / "golden"
    bad.mkdir()
    (bad / "manifest.json").write_text("{}")
    assert main(["golden", "--check", "--dir", str(bad)]) == 1


def test_unavailable_adapter_is_an_error_before_any_table(tmp_path, capsys, monkeypatch):
    path = tmp_path / "missing_adapter.py"
    path.write_text(
        "from conformance.adapter import Adapter, AdapterUnavailable\n"
        "class Missing(Adapter):\n"
        "    name = 'missing'\n"
        "    def setup(self):\n"
        "        raise AdapterUnavailable('libfoo is not installed; see "
        "conformance/peers/jax.txt')\n"
        "ADAPTER = Missing()\n")
    monkeypatch.chdir(tmp_path)  # not the repository: the recipe's location is spelled out
    assert main(["--adapter", str(path), "--out", str(tmp_path / "out")]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""  # no progress, no table of skips
    first = cap.err.splitlines()[0]
    assert first.startswith(f"error: adapter {str(path)!r} is unavailable: libfoo is not "
                            "installed; see conformance/peers/jax.txt (conformance/peers/"
                            "jax.txt is ")
    assert Path(first.rsplit(" is ", 1)[1].rstrip(")")).is_file()
    assert "list` shows the adapters" in cap.err
    assert not (tmp_path / "out").exists()


def test_locate_names_installed_files_only_when_not_under_the_current_directory(
        tmp_path, monkeypatch):
    msg = "see conformance/peers/torchpeers.txt"
    monkeypatch.chdir(ROOT)
    assert locate(msg) == msg
    monkeypatch.chdir(tmp_path)
    where = locate(msg)[len(msg):]
    assert where.startswith(" (conformance/peers/torchpeers.txt is ")
    assert Path(where[len(" (conformance/peers/torchpeers.txt is "):-1]).is_file()
    assert locate("see conformance/peers/no-such-file.txt").endswith("no-such-file.txt")


def test_summary_has_unambiguous_columns_and_a_legend(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--family", "linalg"], prog=SCRIPT) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("capability "))
    assert header.split() == ["capability", "pass", "pass-declared", "fail", "error", "xfail",
                              "skip", "diagnosis"]
    assert "expected values: golden)" in out
    legend = out[out.index("legend: "):]
    assert "pass-declared = agrees\n  once the reference is converted into the conventions" \
           in legend
    assert "progress: . pass  c pass-declared  F fail  E error  x xfail  s skip" in legend
    assert "expected values: golden = the committed golden vectors" in legend
    # the default run says what it is and what to run next
    assert "== adapter kfac_ref: 31 cases (self-check: kfac_ref against its own golden " \
           "vectors) ==" in out
    nxt = out[out.index("next: "):]
    assert f"\n  {SCRIPT} list " in nxt and f"\n  {SCRIPT} --adapter NAME " in nxt


def test_another_adapter_is_not_called_a_self_check(tmp_path, capsys):
    main(["--out", str(tmp_path), "-q", "--adapter", "mutant_kron_swapped", "--family",
          "linalg"])
    out = capsys.readouterr().out
    assert "self-check" not in out and "next: " not in out and "legend: " in out


def test_reports_default_to_a_folder_under_the_current_directory(tmp_path, capsys,
                                                                 monkeypatch):
    assert not DEFAULT_OUT.is_absolute()
    monkeypatch.chdir(tmp_path)
    assert main(["-q", "--family", "averaging"]) == 0
    assert json.loads((tmp_path / DEFAULT_OUT / "kfac_ref" / "report.json").read_text())["ok"]
    assert "reports: conformance-reports/kfac_ref/report.json" in capsys.readouterr().out


def test_matrix_figures_are_skipped_with_one_line_without_matplotlib(tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setitem(sys.modules, "conformance.figures", None)  # import fails
    rep = {"adapter": {"name": "x"}, "capabilities": {"linalg.kron": {"pass": 1}},
           "results": [{"capability": "linalg.kron", "status": "pass"}], "ok": True}
    data = write_matrix([rep], tmp_path)
    assert data["cells"] == {"x": {"linalg.kron": "pass"}}
    assert (tmp_path / "matrix.json").exists() and not (tmp_path / "matrix.png").exists()
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("matrix figures skipped: ") and "matplotlib" in line
