"""`golden --check` on damaged golden files: every problem is a message that names the file
and what is wrong — a truncated manifest, a manifest entry without a field, a NaN planted in a
stored array (with its digest updated, so only the value check can see it), an unlisted
.npz — never a raw JSONDecodeError or KeyError."""

from __future__ import annotations

import hashlib
import json
import zipfile

import numpy as np
import pytest

from conformance.catalogue import build_catalogue, capabilities
from conformance.golden import check_golden, write_golden


@pytest.fixture(scope="module")
def cases():
    built, _ = build_catalogue(["linalg"])
    return built


@pytest.fixture
def golden(tmp_path, cases):
    write_golden(cases, capabilities(), tmp_path)
    assert check_golden(cases, tmp_path) == []
    return tmp_path


def _manifest(golden):
    return json.loads((golden / "manifest.json").read_text(encoding="utf-8"))


def _save(golden, manifest):
    (golden / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


def test_a_truncated_manifest_is_named(golden, cases):
    path = golden / "manifest.json"
    path.write_text(path.read_text(encoding="utf-8")[:500], encoding="utf-8")
    (problem,) = check_golden(cases, golden)
    assert str(path) in problem and "not valid JSON" in problem and "line" in problem


def test_a_manifest_that_is_no_object_is_named(golden, cases):
    (golden / "manifest.json").write_text("[1, 2]", encoding="utf-8")
    (problem,) = check_golden(cases, golden)
    assert "'files'" in problem and "'cases'" in problem


def test_an_entry_without_a_field_is_named(golden, cases):
    m = _manifest(golden)
    cid = m["cases"][0]["id"]
    del m["cases"][0]["capability"]
    _save(golden, m)
    (problem,) = check_golden(cases, golden)
    assert f"case {cid}: the entry has no 'capability'" in problem
    assert "manifest.json" in problem


def test_a_planted_nan_is_corrupt_data(golden, cases):
    m = _manifest(golden)
    entry = m["cases"][0]["arrays"]["expected"]
    fname = m["cases"][0]["file"]
    path = golden / fname
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    bad = arrays[entry["key"]].astype(np.float64).copy()
    bad.flat[0] = np.nan
    arrays[entry["key"]] = bad
    with zipfile.ZipFile(path, "w") as zf:  # rewrite the archive (allow_pickle-free .npy)
        for k, v in arrays.items():
            with zf.open(f"{k}.npy", "w") as fh:
                np.lib.format.write_array(fh, v, allow_pickle=False)
    m["files"][fname]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    _save(golden, m)
    (problem,) = check_golden(cases, golden)
    assert f"golden file {fname}" in problem and entry["key"] in problem
    assert "1 NaN/Inf entries: corrupt data" in problem


def test_an_unlisted_npz_is_reported(golden, cases):
    np.savez(golden / "stray.npz", x=np.zeros(2))
    problems = check_golden(cases, golden)
    assert len(problems) == 1 and problems[0].startswith("stray.npz: a .npz file in ")
    assert "does not list" in problems[0]
