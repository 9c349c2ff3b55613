"""`golden --check`: integrity is the sha256, "up to date" is agreement within each case's own
tolerance — tight enough that a difference beyond it is reported, loose enough that another
BLAS kernel's rounding is not (see conformance/GOLDEN_SPEC.md, "Up to date")."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from conformance.catalogue import build_catalogue, capabilities
from conformance.golden import check_golden, write_golden

CASE = "linalg.damped_inverse/spd_damping0"  # named in the bug report: its input 'm' differed
WITH_ALTERNATIVES = "linalg.factored_damped_inverse_matvec/p4_q3_damping0.01"


@pytest.fixture(scope="module")
def linalg_cases():
    cases, _ = build_catalogue(["linalg", "factors"])
    return cases


def _write_with(tmp_path, cases, cid, change):
    """Golden files of ``cases`` in which case ``cid`` was changed by ``change(case)``."""
    stored = [copy.deepcopy(c) for c in cases]
    (case,) = [c for c in stored if c.id == cid]
    change(case)
    write_golden(stored, capabilities(), tmp_path)
    return tmp_path


def _nudge(arr, factor, rtol, seed=0):
    """``arr`` moved by a random direction of Frobenius norm ``factor · rtol · ‖arr‖_F``."""
    e = np.random.default_rng(seed).standard_normal(arr.shape)
    return arr + e * (factor * rtol * np.linalg.norm(arr) / np.linalg.norm(e))


def test_unchanged_files_are_up_to_date(tmp_path, linalg_cases):
    write_golden(linalg_cases, capabilities(), tmp_path)
    assert check_golden(linalg_cases, tmp_path) == []


@pytest.mark.parametrize("factor, reported", [(0.5, False), (2.0, True)])
def test_an_input_is_compared_within_the_case_tolerance(tmp_path, linalg_cases, factor,
                                                        reported):
    (case,) = [c for c in linalg_cases if c.id == CASE]
    rtol = case.tolerance.rtol()

    def change(c):
        c.inputs["m"] = _nudge(c.inputs["m"], factor, rtol)

    problems = check_golden(linalg_cases, _write_with(tmp_path, linalg_cases, CASE, change))
    if reported:
        assert len(problems) == 1 and problems[0].startswith(f"{CASE}: input 'm' differs: ")
        assert f"> rtol {rtol:.3e}" in problems[0]
    else:  # not bit-equal, yet up to date: rounding is not a change
        assert problems == []


@pytest.mark.parametrize("factor, reported", [(0.5, False), (2.0, True)])
def test_an_expected_output_is_compared_within_the_case_tolerance(tmp_path, linalg_cases,
                                                                  factor, reported):
    (case,) = [c for c in linalg_cases if c.id == WITH_ALTERNATIVES]
    rtol = case.tolerance.rtol()

    def change(c):
        c.expected = _nudge(c.expected, factor, rtol, seed=1)
        name = sorted(c.alternatives)[0]
        c.alternatives[name] = _nudge(c.alternatives[name], factor, rtol, seed=2)

    golden = _write_with(tmp_path, linalg_cases, WITH_ALTERNATIVES, change)
    problems = check_golden(linalg_cases, golden)
    if reported:
        alt = sorted(case.alternatives)[0]
        assert [p.split(": ")[1] for p in problems] == [
            "expected differs", f"alternative {alt!r} differs"]
    else:
        assert problems == []


def test_integer_inputs_params_and_tolerances_must_match(tmp_path, linalg_cases):
    (emb,) = [c for c in linalg_cases if c.capability == "factors.embedding_input"][:1]
    pi = next(c for c in linalg_cases if c.capability == "linalg.pi_tracenorm")
    stored = [copy.deepcopy(c) for c in linalg_cases]
    by_id = {c.id: c for c in stored}
    by_id[emb.id].inputs["ids"] = by_id[emb.id].inputs["ids"][::-1].copy()
    by_id[CASE].params = {**by_id[CASE].params, "damping": 1.0}
    by_id[pi.id].tolerance = dataclasses.replace(pi.tolerance, budget=2 * pi.tolerance.budget)
    write_golden(stored, capabilities(), tmp_path)
    problems = check_golden(linalg_cases, tmp_path)
    assert f"{emb.id}: input 'ids' differs: integer entries differ" in problems
    assert any(p.startswith(f"{CASE}: params differ") for p in problems)
    assert any(p.startswith(f"{pi.id}: tolerance differs") for p in problems)
    assert len(problems) == 3


def test_a_corrupt_file_fails_the_sha256_check(tmp_path, linalg_cases):
    write_golden(linalg_cases, capabilities(), tmp_path)
    f = tmp_path / "linalg.npz"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit: the numbers might still agree, the digest does not
    f.write_bytes(bytes(raw))
    (problem,) = check_golden(linalg_cases, tmp_path)
    assert "is corrupt: sha256" in problem and "linalg.npz" in problem


def test_missing_and_extra_cases_are_reported(tmp_path, linalg_cases):
    write_golden(linalg_cases[1:], capabilities(), tmp_path)
    problems = check_golden(linalg_cases[:-1], tmp_path)
    assert problems == [
        f"{linalg_cases[0].id}: in the live catalogue but not in the golden files "
        "(regenerate with `python -m conformance golden --write`)",
        f"{linalg_cases[-1].id}: in the golden files but not in the live catalogue"]
