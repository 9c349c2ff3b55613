"""The built wheel carries every file that the suite's messages and the README point to, and an
installed (non-editable) suite writes its reports under the current directory.

Builds the wheel once (a few seconds; offline when setuptools >= 68 is installed, otherwise
pip fetches the build backend as for any install).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import kfac_ref
from conformance.adapter import AdapterUnavailable, load_adapter
from conformance.adapters import shipped

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"conformance/[\w./-]*\w/?")
pytestmark = pytest.mark.slow


def _offline_backend() -> bool:
    try:
        return int(metadata.version("setuptools").split(".")[0]) >= 68 and bool(
            metadata.version("wheel"))
    except metadata.PackageNotFoundError:
        return False


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "conformance-reports")
    for name in ("kfac_ref", "conformance"):
        shutil.copytree(ROOT / name, src / name, ignore=junk)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)]
    if _offline_backend():
        cmd.insert(4, "--no-build-isolation")
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    (whl,) = out.glob("kfac_ref-*.whl")
    return whl


def _unavailable_messages() -> list[str]:
    out = []
    for name in shipped():
        try:
            load_adapter(name).setup()
        except AdapterUnavailable as exc:
            out.append(str(exc))
    return out


def _pointed_to() -> set[str]:
    """``conformance/...`` paths named by messages and by the README's conformance section."""
    texts = _unavailable_messages()
    # the messages as written, whether or not the peer is installed here
    texts += [p.read_text(encoding="utf-8") for p in (
        *sorted((ROOT / "conformance" / "adapters").glob("*.py")),
        ROOT / "conformance" / "peers" / "torch_adapter.py",
        ROOT / "conformance" / "__main__.py")]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## The conformance suite"):]
    texts.append(section[:section.index("\n## ", 3)])
    # conformance/README.md links relative to its folder
    suite_readme = (ROOT / "conformance" / "README.md").read_text(encoding="utf-8")
    texts += ["conformance/" + m for m in re.findall(r"(?<![\w/])peers/[\w./-]*\w", suite_readme)]
    texts += ["conformance/GOLDEN_SPEC.md"] if "GOLDEN_SPEC.md" in suite_readme else []
    return {m for t in texts for m in PATH.findall(t)}


def test_wheel_has_every_file_messages_and_readme_point_to(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    wanted = _pointed_to()
    # the files the bug report found missing are among those checked
    assert {"conformance/peers/jax.txt", "conformance/peers/torchpeers.txt",
            "conformance/peers/FINDINGS.md", "conformance/peers/reports/matrix.md",
            "conformance/peers/README.md", "conformance/golden/"} <= wanted
    missing = sorted(p for p in wanted if not any(
        n == p or n.startswith(p.rstrip("/") + "/") for n in names))  # a file or a folder
    assert not missing, f"not in {wheel.name}: {missing}"
    for name in ("tf", "jax", "torchpeers"):  # every recipe with its constraints
        assert {f"conformance/peers/{name}.txt",
                f"conformance/peers/{name}-constraints.txt"} <= set(names)


def test_wheel_metadata_has_the_one_version_and_the_console_script(wheel):
    z = zipfile.ZipFile(wheel)
    info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    assert f"\nVersion: {kfac_ref.__version__}\n" in z.read(info).decode()
    eps = z.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert "kfac-conformance = conformance.__main__:script" in eps


def test_installed_suite_writes_reports_under_the_current_directory(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, capture_output=True)
    before = sorted(p for p in site.rglob("*") if "__pycache__" not in p.parts)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("KFAC_CONFORMANCE_ADAPTER", None)
    run = subprocess.run([sys.executable, "-m", "conformance", "-q", "--family", "averaging"],
                         cwd=work, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (work / "conformance-reports" / "kfac_ref" / "report.json").is_file()
    after = sorted(p for p in site.rglob("*") if "__pycache__" not in p.parts)
    assert after == before  # nothing written into the installed package
    # the console script calls itself by its name
    script = subprocess.run([str(site / "bin" / "kfac-conformance"), "--help"], cwd=work,
                            env=env, capture_output=True, text=True, check=True).stdout
    assert script.startswith("usage: kfac-conformance [run] [options]")
    assert "  kfac-conformance --adapter NAME " in script
    # an unavailable peer names its recipe where the install put it
    probe = subprocess.run([sys.executable, "-m", "conformance", "--adapter", "tf_kfac"],
                           cwd=work, env={**env, "PYTHONNOUSERSITE": "1"},
                           capture_output=True, text=True)
    if probe.returncode == 2:  # TF K-FAC is not installed here (the usual case)
        assert probe.stdout == ""
        recipe = site.resolve() / "conformance" / "peers" / "tf.txt"
        assert f"conformance/peers/tf.txt is {recipe}" in probe.stderr
