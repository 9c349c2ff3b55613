"""The README's first steps work as a user meets them: the two Quickstart lines make and use a
virtual environment (system Pythons under PEP 668 refuse ``pip install``), torch is optional
and its CPU build is named correctly, and CI runs what the README promises.  ``.ci/run``
executes the Quickstart lines verbatim; these tests pin what they must contain."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def _quickstart() -> list[str]:
    section = README[README.index("## Quickstart"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return block.strip().splitlines()


def test_quickstart_is_two_lines_in_a_virtual_environment():
    first, second = _quickstart()
    make, *rest = first.split(" && ")
    assert re.fullmatch(r"python3 -m venv (\S+)", make)
    venv = make.split()[-1]
    py = f"{venv}/bin/python"
    assert rest == [f'{py} -m pip install -e ".[test]"', f"{py} -m conformance"]
    assert second == f"{py} -m pytest"
    # nothing installs into the interpreter that made the environment
    assert not re.search(r"(^|&& )(python3?|pip3?) -m pip install|(^|&& )pip3? install", first)


def test_torch_is_optional_and_its_cpu_build_comes_from_the_cpu_index():
    assert "torch" not in _quickstart()[0]
    assert f"pip install torch==2.13.0 {CPU_INDEX}" in README
    assert "optional" in README[README.index("PyTorch is optional"):][:40]
    for path in ("README.md", "pyproject.toml", "noxfile.py", ".ci/run"):
        text = (ROOT / path).read_text(encoding="utf-8")
        assert "is the CPU wheel" not in text, path  # from PyPI the pin is the CUDA build
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    deps = pyproject[pyproject.index("dependencies = ["):pyproject.index("]", pyproject.index(
        "dependencies = ["))]
    test_extra = pyproject[pyproject.index("test = ["):pyproject.index("]", pyproject.index(
        "test = ["))]
    assert "torch" not in deps and "torch" not in test_extra
    nox = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    assert '"--index-url", "https://download.pytorch.org/whl/cpu"' in nox
    assert ".[test,torch]" not in nox


def test_ci_runs_the_quickstart_golden_kernels_lint_docs_and_oldest_python():
    assert 'eval "$main_job"' in CI and 'eval "$test_cmd"' in CI
    assert "/^## Quickstart/" in CI
    for core in ("Haswell", "Sandybridge"):
        assert re.search(rf"for core in .*\b{core}:", CI)
    assert "python -m conformance golden --check" in CI
    assert ("tests/conformance/test_conformance.py::"
            "test_golden_files_are_intact_and_up_to_date") in CI
    assert "ruff check kfac_ref tests benchmarks noxfile.py conformance docs/_ext" in CI
    assert "bash docs/build.sh" in CI
    assert "python3.10" in CI and ".venv-ci310/bin/python -m pytest" in CI
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'requires-python = ">=3.10"' in pyproject
