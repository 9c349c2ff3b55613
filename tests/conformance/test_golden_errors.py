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


def _rewrite(golden, fname, change):
    """Rewrite one data file with ``change(arrays)`` applied and its digest updated, so that
    only the content checks can see the damage."""
    path = golden / fname
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    change(arrays)
    with zipfile.ZipFile(path, "w") as zf:
        for k, v in arrays.items():
            with zf.open(f"{k}.npy", "w") as fh:
                np.lib.format.write_array(fh, v, allow_pickle=v.dtype == object)
    m = _manifest(golden)
    m["files"][fname]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    _save(golden, m)


def _first_input(golden):
    m = _manifest(golden)
    case = m["cases"][0]
    return case["file"], next(iter(case["arrays"]["inputs"].values()))["key"]


@pytest.mark.parametrize("dtype, says", [(np.complex128, "dtype <c16, manifest says <f8"),
                                         (np.str_, "dtype <U"), (np.float32, "dtype <f4"),
                                         (object, "cannot be read as an .npz archive")])
def test_a_stored_array_of_another_type_is_corrupt_data(golden, cases, dtype, says):
    fname, key = _first_input(golden)

    def change(arrays):
        arrays[key] = arrays[key].astype(dtype)

    _rewrite(golden, fname, change)
    (problem,) = check_golden(cases, golden)
    assert fname in problem and says in problem and "corrupt data" in problem


def test_a_truncated_data_file_is_named(golden, cases):
    fname, _ = _first_input(golden)
    path = golden / fname
    path.write_bytes(path.read_bytes()[:300])
    m = _manifest(golden)
    m["files"][fname]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    _save(golden, m)
    (problem,) = check_golden(cases, golden)
    assert problem.startswith(f"golden file {path} cannot be read as an .npz archive")
    assert "BadZipFile" in problem and problem.endswith("corrupt data")


def test_a_manifest_that_is_not_utf8_is_named(golden, cases):
    path = golden / "manifest.json"
    path.write_bytes(b"\xff\xfe{" + path.read_bytes())
    (problem,) = check_golden(cases, golden)
    assert problem.startswith(f"{path}: not UTF-8 text (byte 0")


def test_a_file_outside_the_golden_directory_is_refused(golden, cases):
    m = _manifest(golden)
    m["files"]["../elsewhere.npz"] = {"sha256": "0" * 64, "bytes": 0}
    _save(golden, m)
    (problem,) = check_golden(cases, golden)
    assert "lists the file '../elsewhere.npz'; golden data files are .npz files in the " \
           "golden directory itself" in problem


def test_a_case_listed_twice_is_named(golden, cases):
    m = _manifest(golden)
    m["cases"].append(m["cases"][0])
    _save(golden, m)
    (problem,) = check_golden(cases, golden)
    assert problem.endswith(f"case {m['cases'][0]['id']} is listed twice")


def test_unlisted_arrays_and_other_files_are_reported(golden, cases):
    fname, _ = _first_input(golden)
    _rewrite(golden, fname, lambda arrays: arrays.update({"stray/x": np.zeros(2)}))
    (golden / "notes.txt").write_text("copied in")
    problems = check_golden(cases, golden)
    assert problems == [
        f"notes.txt: a file in {golden} that the manifest does not list (left over or copied "
        "in; remove it or regenerate)",
        f"{fname}: 1 array(s) that no case of the manifest lists, e.g. stray/x.npy (left over "
        "or copied in; regenerate)"]


def test_golden_check_prints_the_problem_and_fails(golden, cases, capsys):
    from conformance.__main__ import main

    path = golden / "manifest.json"
    path.write_text(path.read_text(encoding="utf-8")[:500], encoding="utf-8")
    assert main(["golden", "--check", "--dir", str(golden)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: not valid JSON") and out.endswith("1 problem(s)\n")
