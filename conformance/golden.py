"""Golden vectors: the catalogue as portable files (see GOLDEN_SPEC.md).

Layout of ``conformance/golden/``:

* ``manifest.json`` — schema version, canonical conventions, capabilities, and per case its
  capability, parameters, metadata, tolerance (with derivation), and the keys of its arrays;
  the sha256 and size of every data file;
* ``<family>.npz`` — an uncompressed ZIP of ``.npy`` (format 1.0) arrays, little-endian
  float64, one entry per array named ``<case id>/<role>[/<name>].npy``; written with fixed
  timestamps so regeneration is byte-for-byte reproducible for identical numbers.

Loading verifies the schema version and every file's sha256 before reading it with
``allow_pickle=False``.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import numpy as np

from .compare import compare
from .conventions import CANONICAL, FIELDS
from .model import Case, Tolerance

__all__ = ["GOLDEN_DIR", "SCHEMA", "SCHEMA_VERSION", "write_golden", "load_golden",
           "check_golden", "GoldenError"]

GOLDEN_DIR = Path(__file__).parent / "golden"
SCHEMA = "kfac_ref.conformance.golden"
SCHEMA_VERSION = 1
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


class GoldenError(RuntimeError):
    """The golden files are missing, corrupt or of an unknown schema."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _portable(arr):
    """float64 for real data, int64 for integer data (ids), little-endian, C order."""
    arr = np.asarray(arr)
    dtype = "<i8" if arr.dtype.kind in "iub" else "<f8"
    return np.array(arr, dtype=dtype, order="C", copy=True)  # keeps 0-d arrays 0-d


def _npy_bytes(arr) -> bytes:
    buf = io.BytesIO()
    arr = _portable(arr)
    np.lib.format.write_array(buf, arr, version=(1, 0), allow_pickle=False)
    return buf.getvalue()


def _json_clean(obj):
    if isinstance(obj, dict):
        return {str(k): _json_clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_clean(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer, np.bool_)):
        return obj.item()
    return obj


def write_golden(cases, capabilities, directory=GOLDEN_DIR, extra=None) -> dict:
    """Write ``cases`` (live, from kfac_ref) to ``directory``; return the manifest."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    by_family: dict[str, list[Case]] = {}
    for case in cases:
        by_family.setdefault(case.family, []).append(case)
    manifest_cases, files = [], {}
    for old in directory.glob("*.npz"):
        old.unlink()
    for family, fcases in by_family.items():
        fname = f"{family}.npz"
        path = directory / fname
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:

            def put(key, arr, zf=zf):
                info = zipfile.ZipInfo(key + ".npy", date_time=_ZIP_DATE)
                info.external_attr = 0o644 << 16
                zf.writestr(info, _npy_bytes(arr))
                a = _portable(arr)
                return {"key": key, "shape": list(a.shape), "dtype": a.dtype.str}

            for case in fcases:
                arrays = {
                    "inputs": {n: put(f"{case.id}/inputs/{n}", a) for n, a in
                               case.inputs.items()},
                    "expected": put(f"{case.id}/expected", case.expected),
                    "alternatives": {n: put(f"{case.id}/alternatives/{n}", a) for n, a in
                                     case.alternatives.items()},
                }
                manifest_cases.append({
                    "id": case.id, "capability": case.capability, "file": fname,
                    "description": case.description, "params": _json_clean(case.params),
                    "meta": _json_clean(case.meta), "tolerance": case.tolerance.to_dict(),
                    "arrays": arrays,
                })
        files[fname] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
    manifest = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "generated_by": "python -m conformance golden --write",
        "generator": _json_clean(extra or {}),
        "conventions": {"canonical": CANONICAL.to_dict(),
                        "meaning": {k: v[1] for k, v in FIELDS.items()}},
        "comparison": ("norm-wise: ||actual - expected||_F <= rtol * max(||expected||_F, "
                       "tolerance.scale), rtol = tolerance.budget * eps(dtype) (+ declared "
                       "hyper-parameter precision); NaN/Inf or a shape mismatch fails"),
        "capabilities": {name: {"summary": cap.summary, "signature": cap.signature,
                                "conventions": list(cap.conventions)}
                         for name, cap in capabilities.items()
                         if any(c.capability == name for c in cases)},
        "files": files,
        "cases": manifest_cases,
    }
    (directory / "manifest.json").write_text(
        json.dumps(manifest, indent=1, ensure_ascii=False, sort_keys=False) + "\n",
        encoding="utf-8")
    return manifest


def read_manifest(directory=GOLDEN_DIR) -> dict:
    path = Path(directory) / "manifest.json"
    if not path.exists():
        raise GoldenError(f"no golden manifest at {path}; run `python -m conformance golden "
                          "--write`")
    if not path.is_file():
        raise GoldenError(f"{path}: not a file; restore it or run `python -m conformance "
                          "golden --write`")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise GoldenError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}): corrupt; "
                          "restore it or run `python -m conformance golden --write`") from None
    except json.JSONDecodeError as exc:
        raise GoldenError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column "
                          f"{exc.colno}): truncated or edited; restore it or run `python -m "
                          "conformance golden --write`") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or (
            not isinstance(manifest.get("cases"), list)):
        raise GoldenError(f"{path}: a manifest is a JSON object with 'files' (an object) and "
                          "'cases' (a list); this one is not")
    if manifest.get("schema") != SCHEMA or manifest.get("schema_version") != SCHEMA_VERSION:
        raise GoldenError(f"{path}: schema {manifest.get('schema')!r} version "
                          f"{manifest.get('schema_version')!r}; this suite reads {SCHEMA!r} "
                          f"version {SCHEMA_VERSION}")
    return manifest


def load_golden(directory=GOLDEN_DIR) -> list[Case]:
    """Load and integrity-check the golden cases (raises :class:`GoldenError`)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    mpath = directory / "manifest.json"
    data = {}
    for fname, meta in manifest["files"].items():
        if not fname.endswith(".npz") or Path(fname).name != fname:
            raise GoldenError(f"{mpath}: lists the file {fname!r}; golden data files are .npz "
                              "files in the golden directory itself")
        path = directory / fname
        if not path.exists():
            raise GoldenError(f"golden file {path} is missing")
        if not path.is_file():
            raise GoldenError(f"golden file {path} is not a file")
        digest = _sha256(path)
        if not isinstance(meta, dict) or "sha256" not in meta:
            raise GoldenError(f"{mpath}: the entry of file {fname!r} has no 'sha256'")
        if digest != meta["sha256"]:
            raise GoldenError(f"golden file {path} is corrupt: sha256 {digest} != manifest "
                              f"{meta['sha256']}")
        data[fname] = _read_npz(path)
    cases, seen = [], set()
    for i, c in enumerate(manifest["cases"]):
        cid = c.get("id", f"#{i}") if isinstance(c, dict) else f"#{i}"
        try:
            case = _case(c, data)
        except KeyError as exc:
            raise GoldenError(f"{mpath}: case {cid}: the entry has no {exc.args[0]!r} (a "
                              "truncated or hand-edited manifest)") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise GoldenError(f"{mpath}: case {cid}: malformed entry ({exc})") from None
        if case.id in seen:
            raise GoldenError(f"{mpath}: case {cid} is listed twice")
        seen.add(case.id)
        cases.append(case)
    return cases


def _read_npz(path: Path) -> dict:
    """The arrays of one golden data file (raises :class:`GoldenError` when it is not an
    archive of plain ``.npy`` arrays: truncated, another format, pickled objects)."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            if not isinstance(npz, np.lib.npyio.NpzFile):
                raise ValueError("a single .npy array, not an .npz archive")
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise GoldenError(f"golden file {path} cannot be read as an .npz archive of .npy "
                          f"arrays ({type(exc).__name__}: {exc}): corrupt data") from None


def _case(c, data) -> Case:
    """One manifest entry and its arrays as a :class:`Case` (raises ``KeyError`` for a
    missing entry, :class:`GoldenError` for an array that is missing, misshapen or not
    finite)."""
    cid, fname = c["id"], c["file"]
    if fname not in data:
        raise GoldenError(f"case {cid}: its file {fname!r} is not listed in the manifest")
    arrays = data[fname]

    def get(entry):
        try:
            arr = arrays[entry["key"]]
        except KeyError:
            raise GoldenError(f"case {cid}: array {entry['key']} missing from its file "
                              f"{fname}") from None
        if list(arr.shape) != list(entry["shape"]):
            raise GoldenError(f"case {cid}: array {entry['key']} has shape "
                              f"{arr.shape}, manifest says {entry['shape']}")
        if arr.dtype.str not in ("<f8", "<i8") or arr.dtype.str != entry.get("dtype",
                                                                             arr.dtype.str):
            raise GoldenError(f"golden file {fname}: array {entry['key']} of case {cid} has "
                              f"dtype {arr.dtype.str}"
                              + (f", manifest says {entry['dtype']}" if "dtype" in entry else "")
                              + ": corrupt data (golden arrays are little-endian float64 "
                              "'<f8' or int64 '<i8')")
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            bad = int(np.sum(~np.isfinite(arr)))
            raise GoldenError(f"golden file {fname}: array {entry['key']} of case {cid} holds "
                              f"{bad} NaN/Inf entries: corrupt data (the generator stores "
                              "finite values only)")
        return arr

    a = c["arrays"]
    return Case(
        cid, c["capability"], {n: get(e) for n, e in a["inputs"].items()},
        dict(c["params"]), get(a["expected"]), Tolerance.from_dict(c["tolerance"]),
        dict(c["meta"]), {n: get(e) for n, e in a["alternatives"].items()},
        c.get("description", ""), source="golden")


def _unlisted_arrays(directory, manifest) -> list[str]:
    """Entries of the listed data files that no case of the manifest refers to."""
    keys: dict[str, set] = {}
    for c in manifest["cases"]:
        a = c["arrays"]
        entries = [*a["inputs"].values(), a["expected"], *a["alternatives"].values()]
        keys.setdefault(c["file"], set()).update(e["key"] + ".npy" for e in entries)
    out = []
    for fname in sorted(manifest["files"]):
        with zipfile.ZipFile(Path(directory) / fname) as zf:
            extra = sorted(set(zf.namelist()) - keys.get(fname, set()))
        if extra:
            out.append(f"{fname}: {len(extra)} array(s) that no case of the manifest lists, "
                       f"e.g. {extra[0]} (left over or copied in; regenerate)")
    return out


def _disagreement(stored, live, rtol, scale=0.0) -> str:
    """Why a regenerated array does not match its stored value ("" when it does).

    Integer arrays (embedding ids, class labels) come from the random generator, not from
    floating-point arithmetic, and must be equal.  Floating arrays pass the suite's own
    norm-wise rule, ``‖live − stored‖_F ≤ rtol · max(‖stored‖_F, scale)``
    (:func:`conformance.compare.compare`): BLAS and LAPACK builds pick different kernels per
    CPU and round differently, so regenerated numbers agree within rounding, never bit for bit.
    """
    stored, live = np.asarray(stored), np.asarray(live)
    if stored.shape != live.shape:
        return f"shape {live.shape} != stored {stored.shape}"
    if stored.dtype.kind in "iub" or live.dtype.kind in "iub":
        return "" if np.array_equal(stored, live) else "integer entries differ"
    if stored.size == 0:
        return ""
    c = compare(live, stored, rtol, scale)
    return "" if c.ok else c.detail


#: relative agreement asked of a regenerated tolerance budget: the budget is derived from the
#: condition number of the generated inputs, so it carries their rounding; a changed
#: derivation changes it by O(1).
_BUDGET_RTOL = 1e-6


def check_golden(live_cases, directory=GOLDEN_DIR) -> list[str]:
    """Compare the golden files with a freshly built catalogue; return problems (empty = ok).

    Integrity is the sha256 of every file (checked by :func:`load_golden`).  "Up to date"
    means that the regenerated catalogue agrees with the stored one: the same case ids,
    parameters and tolerance derivations, and every input, expected output and alternative
    within that case's own tolerance ``budget · eps(float64)`` (see :func:`_disagreement`).
    """
    problems = []
    try:
        golden = {c.id: c for c in load_golden(directory)}
    except GoldenError as exc:
        return [str(exc)]
    manifest = read_manifest(directory)
    listed = set(manifest["files"])
    for extra in sorted(p.name for p in Path(directory).iterdir()):
        if extra not in listed and extra != "manifest.json" and not extra.startswith("."):
            problems.append(f"{extra}: a {'.npz ' if extra.endswith('.npz') else ''}file in "
                            f"{directory} that the manifest does not list (left over or copied "
                            "in; remove it or regenerate)")
    problems += _unlisted_arrays(directory, manifest)
    live = {c.id: c for c in live_cases}
    for cid in sorted(set(live) - set(golden)):
        problems.append(f"{cid}: in the live catalogue but not in the golden files "
                        "(regenerate with `python -m conformance golden --write`)")
    for cid in sorted(set(golden) - set(live)):
        problems.append(f"{cid}: in the golden files but not in the live catalogue")
    for cid in sorted(set(golden) & set(live)):
        g, v = golden[cid], live[cid]
        rtol = g.tolerance.rtol()
        arrays = [(f"input {n!r}", g.inputs.get(n), v.inputs.get(n), 0.0)
                  for n in sorted(set(g.inputs) | set(v.inputs))]
        arrays.append(("expected", g.expected, v.expected, g.tolerance.scale))
        arrays += [(f"alternative {n!r}", g.alternatives.get(n), v.alternatives.get(n),
                    g.tolerance.scale) for n in sorted(set(g.alternatives) | set(v.alternatives))]
        for what, stored, regenerated, scale in arrays:
            if stored is None or regenerated is None:
                where = "golden files" if stored is None else "live catalogue"
                problems.append(f"{cid}: {what} missing from the {where}")
                continue
            why = _disagreement(stored, regenerated, rtol, scale)
            if why:
                problems.append(f"{cid}: {what} differs: {why}")
        if g.params != v.params:
            problems.append(f"{cid}: params differ {g.params} != {v.params}")
        gt, vt = g.tolerance, v.tolerance
        if (gt.derivation, gt.scale) != (vt.derivation, vt.scale) or not (
                abs(gt.budget - vt.budget) <= _BUDGET_RTOL * gt.budget):
            problems.append(f"{cid}: tolerance differs ({gt.to_dict()} != {vt.to_dict()})")
    return problems
