"""Adapters outside the package: found through the entry-point group, shown by ``list`` with
their declared conventions, run by ``--all-adapters`` and in the matrix; ``new-adapter``
writes a skeleton that loads and skips everything.

The throwaway distribution is a ``*.dist-info`` folder with ``entry_points.txt`` next to its
package on ``PYTHONPATH`` of a subprocess: what ``pip install`` leaves in site-packages,
without installing anything into the environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.__main__ import main
from conformance.adapter import load_adapter
from conformance.adapters import ENTRY_POINT_GROUP
from conformance.catalogue import capabilities
from conformance.conventions import FIELDS
from conformance.skeleton import adapter_skeleton, check_name

ROOT = Path(__file__).resolve().parents[2]

ADAPTER_SRC = '''
import numpy as np

from conformance.adapter import Adapter, implements
from conformance.conventions import Conventions


class ThrowawayAdapter(Adapter):
    name = "throwaway"
    description = "a throwaway Kronecker product (NumPy, PyTorch weight layout)"
    conventions = Conventions(kron_order="GA")

    def version(self):
        return "0.1"

    @implements("linalg.kron")
    def kron(self, inputs, params):
        # kron_order 'GA': the suite hands over canonical factors and expects kron(G, A)
        return np.kron(inputs["g"], inputs["a"])
'''


def _dist(tmp_path) -> Path:
    site = tmp_path / "site"
    pkg = site / "throwaway_kfac"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "adapter.py").write_text(ADAPTER_SRC)
    info = site / "throwaway_kfac-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: throwaway-kfac\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nthrowaway = throwaway_kfac.adapter:ThrowawayAdapter\n")
    return site


def _run(site, *args, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(site)]))
    env.pop("KFAC_CONFORMANCE_ADAPTER", None)
    return subprocess.run([sys.executable, "-m", "conformance", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_entry_point_adapter_is_listed_with_its_conventions(tmp_path):
    p = _run(_dist(tmp_path), "list")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    i = next(k for k, line in enumerate(lines) if line.lstrip().startswith("throwaway "))
    assert "a throwaway Kronecker product" in lines[i]
    assert f"[entry point {ENTRY_POINT_GROUP} of throwaway-kfac 0.1]" in lines[i]
    assert lines[i + 1].strip() == "conventions: kron_order='GA'"
    # the shipped adapters show theirs too
    j = next(k for k, line in enumerate(lines) if line.lstrip().startswith("kfac_ref "))
    assert lines[j + 1].strip() == "conventions: canonical"


def test_entry_point_adapter_runs_by_name_and_in_all_adapters(tmp_path):
    site = _dist(tmp_path)
    out = tmp_path / "out"
    p = _run(site, "--adapter", "throwaway", "-c", "linalg.kron", "-q", "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "passed under declared" in p.stdout
    p = _run(site, "--all-adapters", "-c", "linalg.kron", "-q", "--out", str(out))
    assert "== adapter throwaway:" in p.stdout, p.stdout
    assert p.returncode == 0, p.stdout + p.stderr
    matrix = json.loads((out / "matrix.json").read_text())
    assert "throwaway" in matrix["cells"]
    assert matrix["cells"]["throwaway"]["linalg.kron"] == "pass (convention: kron_order=GA)"
    assert matrix["implementations"]["throwaway"]["conventions"] == {"kron_order": "GA"}
    assert "| throwaway |" in (out / "matrix.md").read_text()


def test_entry_point_cannot_take_a_shipped_name(tmp_path):
    site = _dist(tmp_path)
    ep = site / "throwaway_kfac-0.1.dist-info" / "entry_points.txt"
    ep.write_text(f"[{ENTRY_POINT_GROUP}]\nkfac_ref = throwaway_kfac.adapter:ThrowawayAdapter\n")
    p = _run(site, "list")
    assert "throwaway" not in p.stdout
    assert "kfac_ref on NumPy arrays" in p.stdout


def test_new_adapter_writes_a_loadable_skeleton(tmp_path, capsys):
    path = tmp_path / "mykfac_adapter.py"
    assert main(["new-adapter", "mykfac", "--out", str(path)]) == 0
    assert "every capability is listed as unsupported" in capsys.readouterr().out
    text = path.read_text()
    compile(text, str(path), "exec")
    for field, (_, meaning) in FIELDS.items():
        assert f"        {field}=" in text
        assert meaning.split()[0] in text
    assert f'[project.entry-points."{ENTRY_POINT_GROUP}"]' in text
    assert 'mykfac = "mypkg.mykfac_adapter:MykfacAdapter"' in text
    adapter = load_adapter(str(path))
    assert adapter.name == "mykfac"
    assert set(adapter.unsupported) == set(capabilities())
    assert adapter.implementations() == {}
    for cap in capabilities():
        assert f'# @implements("{cap}")' in text
    # a second write refuses to overwrite, --force overwrites
    assert main(["new-adapter", "mykfac", "--out", str(path)]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["new-adapter", "mykfac", "--out", str(path), "--force"]) == 0


def test_new_adapter_skeleton_skips_every_case(tmp_path, capsys):
    path = tmp_path / "numpy_adapter.py"  # `import numpy` succeeds: the setup passes
    main(["new-adapter", "numpy", "--out", str(path)])
    capsys.readouterr()
    assert main(["--adapter", str(path), "--family", "linalg", "-q",
                 "--out", str(tmp_path / "o")]) == 1  # nothing compared never passes
    out = capsys.readouterr().out
    assert "0 passed" in out and "nothing was compared" in out


@pytest.mark.parametrize("bad", ["My-Adapter", "1abc", "class", ""])
def test_new_adapter_rejects_bad_names(bad, capsys):
    with pytest.raises(ValueError, match="new-adapter: NAME must be"):
        check_name(bad)
    assert main(["new-adapter", bad, "--out", "-"]) == 2
    assert "error: new-adapter: NAME must be" in capsys.readouterr().err


def test_new_adapter_to_stdout(capsys):
    assert main(["new-adapter", "abc", "--out", "-"]) == 0
    assert capsys.readouterr().out == adapter_skeleton("abc")
    assert textwrap.dedent(adapter_skeleton("abc")).startswith('"""Conformance adapter for abc')
