"""The command line guides a newcomer: the run filters in the top-level help, hints that name
a command that works from here, a ``list`` that fits a terminal (details behind
``list NAME``), capabilities that name the kfac_ref functions they check, failure lines in
plain words with a ``next:`` hint, and HTML reports that read without a docs build."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.__main__ import LIST_WIDTH, PROG, SCRIPT, command, main
from conformance.catalogue import FUNCTIONS, capabilities, describe_functions, functions_checked
from conformance.diagnosis import PITFALLS

ROOT = Path(__file__).resolve().parents[2]


def _resolve(dotted: str):
    """The object a dotted name (module path, then attributes) names."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_capability_names_the_public_functions_it_checks():
    caps = capabilities()
    assert set(FUNCTIONS) == set(caps)
    for name in caps:
        names = functions_checked(name)
        assert names, name
        for dotted in names:
            obj = _resolve(dotted)
            assert callable(obj), dotted
            # public: no private component in the path
            assert not any(p.startswith("_") for p in dotted.split(".")), dotted
        assert describe_functions(name).startswith(names[0])


@pytest.mark.parametrize(("capability", "function"), [
    ("linalg.homog_cov", "kfac_ref.linalg.append_homog"),
    ("linalg.factored_damped_inverse_matvec", "kfac_ref.linalg.kron_damped_inverse_matvec"),
    ("linalg.exact_damped_inverse_matvec", "kfac_ref.linalg.kron_damped_inverse_matvec"),
])
def test_capabilities_that_look_like_functions_name_the_real_ones(capability, function):
    assert function in functions_checked(capability)
    with pytest.raises(AttributeError):  # the capability's name is not a function
        _resolve("kfac_ref." + capability)


def _help(capsys, *argv, prog=SCRIPT):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"], prog=prog)
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_the_run_filters(capsys):
    text = _help(capsys)
    section = text[text.index("\nrun options"):text.index("\nadapters (")]
    for option in ("-c CAPABILITY", "--capability", "-k KEYWORD", "--out DIR", "--quiet, -q",
                   "--adapter NAME", "--verbose, -v", "--family"):
        assert option in section, option
    # and run --help has them too, without the block twice
    run_text = _help(capsys, "run")
    assert "-k KEYWORD" in run_text and "run options (" not in run_text


def test_hint_command_is_this_interpreter_when_python_on_path_is_another(monkeypatch, tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    monkeypatch.setenv("PATH", str(fake_bin))  # no python on the PATH
    monkeypatch.chdir(tmp_path)
    cmd = command(PROG)
    assert cmd.endswith(" -m conformance") and cmd != PROG
    exe = cmd.removesuffix(" -m conformance")
    assert os.path.samefile(exe, sys.executable)


def test_hint_command_is_python_when_it_is_this_environment(monkeypatch, tmp_path):
    wrapper = tmp_path / "python"  # e.g. an activated environment's python
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert command(PROG) == "python -m conformance"
    assert command(SCRIPT) == SCRIPT  # not run as the console script: its name


def test_unavailable_adapter_hint_names_a_working_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # python on the PATH is not this one
    assert main(["--adapter", "no_such_module_xyz", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    hint = next(line for line in err.splitlines() if line.startswith("hint: "))
    assert f"`{command(PROG)} list`" in hint and "`python -m conformance list`" not in hint


def _list(capsys, *argv):
    code = main(["list", *argv], prog=SCRIPT)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_list_fits_a_terminal_with_one_line_per_capability(capsys):
    code, out, _ = _list(capsys)
    assert code == 0
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= LIST_WIDTH
    for name in capabilities():
        (line,) = [x for x in lines if x.split()[:1] == [name]]
        # the line names what the capability checks
        short = functions_checked(name)[0].split(".")[-1]
        assert short in line, (name, line)
    assert "list NAME" in out


@pytest.mark.parametrize(("name", "expect"), [
    ("linalg.homog_cov", ["checks:", "kfac_ref.linalg.append_homog", "returns:", "inputs:",
                          "cases (2):", "linalg.homog_cov/n5_d3"]),
    ("linalg.exact_damped_inverse_matvec", ["kfac_ref.linalg.kron_damped_inverse_matvec",
                                            'damping_method="exact"']),
    ("averaging", ["averaging.ema", "MovingAverageVariable.update"]),
    ("mutant_kron_swapped", ["pitfall:", "expected:", "kron_order_swapped",
                             f"{SCRIPT} --adapter mutant_kron_swapped"]),
    ("kfac_ref", ["conventions: canonical"]),
])
def test_list_name_shows_one_in_full(capsys, name, expect):
    code, out, _ = _list(capsys, name)
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= LIST_WIDTH
    for text in expect:
        assert text in out, text


def test_list_of_an_unknown_name_suggests_close_ones(capsys):
    code, out, err = _list(capsys, "linalg.homog_co")
    assert code == 2 and out == ""
    assert "no capability, family, adapter or mutant is called 'linalg.homog_co'" in err
    assert "did you mean linalg.homog_cov" in err


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reports")
    proc = subprocess.run(
        [sys.executable, "-m", "conformance", "--adapter", "mutant_pi_without_dimensions",
         "-c", "linalg.pi_tracenorm", "-q", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k != "KFAC_CONFORMANCE_ADAPTER"})
    return proc, out


def test_failure_lines_use_the_pitfalls_plain_words(failing_run):
    proc, _ = failing_run
    assert proc.returncode == 1
    title, meaning, _ = PITFALLS["pi_without_dimensions"]
    failures = proc.stdout[proc.stdout.index("Failures:"):]
    lines = [x for x in failures.splitlines() if x.startswith("  FAIL ")]
    assert len(lines) == 2
    for line in lines:
        assert f"diagnosis: {title}" in line
        assert "matches what the reference computes" not in line
    assert f"{title} (pi_without_dimensions): {meaning}" in failures


def test_a_failure_ends_with_a_next_hint(failing_run):
    proc, out = failing_run
    err = proc.stderr
    assert err.startswith("next: 2 case(s) failed")
    rerun = err.splitlines()[1].split()
    assert rerun[-3:] == ["-k", "linalg.pi_tracenorm/p4_q2_scales10_0.1", "-v"]
    i = rerun.index("--adapter")
    assert rerun[i + 1] == "mutant_pi_without_dimensions"
    assert rerun[:i] == command(PROG).split()
    assert str(out / "mutant_pi_without_dimensions" / "report.html") in err


def test_verbose_shows_the_failure_in_full(tmp_path, capsys):
    assert main(["--adapter", "mutant_pi_without_dimensions", "-k",
                 "linalg.pi_tracenorm/p4_q2_scales10_0.1", "-v", "-q", "--out",
                 str(tmp_path)]) == 1
    out = capsys.readouterr().out
    block = out[out.index("Failures:"):]
    title, meaning, evidence = PITFALLS["pi_without_dimensions"]
    assert f"diagnosis: {title} (pi_without_dimensions): {meaning}" in block
    assert f"reported in: {evidence}" in block
    assert "formula: docs page Damping and the π split › Choosing π" in block


def test_html_report_ships_the_formula_text_without_a_docs_build(tmp_path, monkeypatch):
    import conformance.html_report as H

    monkeypatch.delenv("KFAC_REF_DOCS_URL", raising=False)
    monkeypatch.setattr(H, "_docs_built", lambda: False)
    anchor = H._formula_anchor("theory/damping", "Choosing π")
    assert f'(not built here: <a href="#{anchor}">its text is below</a>)' in \
        H._formula_html("pi_without_dimensions")
    results = [{"diagnosis": {"pitfall": "pi_without_dimensions"}}] * 3
    shipped = H._formulas_html(results)
    assert shipped.count("<details") == 1  # each section once, however many cases
    assert f'<details class="formula" id="{anchor}" open><summary>Choosing π — from ' \
        "docs/theory/damping.rst</summary>" in shipped
    assert r"\pi" in shipped  # the section's formula, as written in the docs source
    # without the docs sources (an installed suite): the page is named, no text
    monkeypatch.setattr(H, "_DOCS", tmp_path)
    assert "KFAC_REF_DOCS_URL" in H._formula_html("pi_without_dimensions")
    assert H._formulas_html(results) == ""
    # with the docs built: the link alone
    monkeypatch.setattr(H, "_docs_built", lambda: True)
    assert "not built here" not in H._formula_html("pi_without_dimensions")
    assert H._formulas_html(results) == ""


def test_html_report_diagnosis_is_in_plain_words(tmp_path):
    from conformance.html_report import html_report
    from conformance.suite import run

    report = run("mutant_pi_without_dimensions", families=["linalg"], source="live")
    text = html_report(report.to_dict())
    title, meaning, _ = PITFALLS["pi_without_dimensions"]
    assert f"— {title}</span>: " in text
    assert "matches what the reference computes" not in text


def test_section_text_stops_at_the_next_section_of_the_same_level():
    from conformance.html_report import section_text

    text = section_text("conventions", "Vectorisation and the order of the Kronecker factors")
    assert text and "vec" in text
    assert "\nMoving averages\n" not in text
    assert section_text("conventions", "No such section") is None
    assert section_text("no_such_page", "x") is None
