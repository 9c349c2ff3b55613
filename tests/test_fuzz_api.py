"""The argument fuzzer (``tools/fuzz_api.py``) over the corpus of valid public calls
(``tests/api_calls.py``): no corrupted argument gives an unclear error or a silent result.

The whole corpus is fuzzed, but each call's arrays are corrupted at most 16 at a time
(``--max-indices 16``: 16 arrays spread evenly, first and last included; only the
estimator, operator, estimated-matrix, Laplace and optimiser calls have more), which keeps
the run near 40 s on two cores; ``python tools/fuzz_api.py`` corrupts every array
(about 100 s).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from kfac_ref import KFACValueError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
import fuzz_api  # noqa: E402


def test_no_unclear_or_silent_case_over_the_corpus():
    cases = fuzz_api.fuzz(max_indices=16)
    bad = [c for c in cases if c.cls in ("unclear", "silent")]
    assert not bad, fuzz_api.table(bad)
    # the corpus reaches every part of the public API the issue names
    entries = {c.entry for c in cases}
    for part in ("kfac_ref.blocks.kfac_jax.DenseEKFAC", "kfac_ref.blocks.kfac_jax.DenseFull",
                 "kfac_ref.blocks.tf.FullFB", "kfac_ref.curvature.BlockDiagonalCurvature",
                 "kfac_ref.optim.KFACOptimizer", "kfac_ref.nn.Sequential",
                 "kfac_ref.losses.CategoricalLogitsNegativeLogProbLoss"):
        assert part in entries or any(e.startswith(part) for e in entries), part
    assert sum(c.cls == "clear" for c in cases) > 5000


def test_every_allowed_case_is_reached():
    """An allow-list entry that no case uses is stale: it would hide nothing, but says
    something the code no longer does."""
    names = sorted({entry for entry, _, _ in fuzz_api.ALLOWED})
    cases = fuzz_api.fuzz(names)
    used = {(c.entry, c.index, c.corruption) for c in cases if c.detail.startswith("allowed")}
    assert set(fuzz_api.ALLOWED) == used, set(fuzz_api.ALLOWED) - used


# --------------------------------------------------------------------------------------
# The classifier can fail: planted functions with each fault
# --------------------------------------------------------------------------------------
def _accepts_nan(x, y):
    """Validates nothing: NaN and every wrong type go through."""
    return np.asarray(x) + np.asarray(y)


def _raises_value_error(x, y):
    if not np.all(np.isfinite(x)):
        raise ValueError("bad input")
    return x + y


def _kfac_error_without_argument(x, y):
    if not np.all(np.isfinite(x)):
        raise KFACValueError("planted: something is wrong")
    return x + y


def _clear(x, y):
    from kfac_ref._backend import check_array, namespace_of

    namespace_of("planted", x=x, y=y)
    check_array("planted", "x", x, shape=(3,))
    check_array("planted", "y", y, shape=(3,))
    return x + y


_HOST = np.random.default_rng(5).uniform(0.5, 1.5, 3)  # not representable in float32


def _one(fn):
    host = _HOST
    return {(c.index, c.corruption): c for c in fuzz_api.fuzz_entry(
        "planted", lambda f: fn(f(host), f(host + 1.0)), allowed={})}


def test_a_function_that_accepts_nan_is_silent():
    cases = _one(_accepts_nan)
    for key in [(0, "nan"), (0, "inf"), (1, "int64"), (0, "bool"), (1, "complex"),
                (0, "list")]:
        assert cases[key].cls == "silent", cases[key]
    assert "precision mix" in cases[0, "float32"].detail
    assert cases[0, "float32"].cls == "silent"


def test_a_namespace_mix_and_wrong_numbers_are_silent():
    def mixes(x, y):  # takes y's values whatever its namespace
        return x + np.asarray(y)

    cases = _one(mixes)
    assert cases[1, "strict"].cls == "silent" and "namespace mix" in cases[1, "strict"].detail

    wrong = {(c.index, c.corruption): c for c in fuzz_api.fuzz_entry(
        "wrong numbers", lambda f: (lambda x: x * 2.0 if isinstance(x, np.ndarray)
                                    else x * 3.0)(f(_HOST)), allowed={})}
    assert wrong[0, "strict"].cls == "silent"
    assert "differ" in wrong[0, "strict"].detail


def test_a_foreign_error_is_unclear():
    cases = _one(_raises_value_error)
    assert cases[0, "nan"].cls == "unclear"
    assert cases[0, "nan"].detail.startswith("ValueError: bad input")


def test_a_kfac_error_naming_no_argument_is_unclear():
    cases = _one(_kfac_error_without_argument)
    assert cases[0, "nan"].cls == "unclear"


def test_a_checked_function_is_clear():
    cases = _one(_clear)
    assert {c.cls for c in cases.values()} <= {"clear", "accepted"}, [
        c for c in cases.values() if c.cls != "clear"]
    assert cases[0, "nan"].cls == "clear" and cases[1, "strict"].cls == "clear"


def test_the_allow_list_accepts_only_its_own_case():
    host = _HOST
    allowed = {("planted", 0, "nan"): "a planted reason"}
    cases = {(c.index, c.corruption): c for c in fuzz_api.fuzz_entry(
        "planted", lambda f: _accepts_nan(f(host), f(host)), allowed=allowed)}
    assert cases[0, "nan"].cls == "accepted"
    assert cases[1, "nan"].cls == "silent" and cases[0, "inf"].cls == "silent"


@pytest.mark.parametrize("argv", [["--only", "kfac_ref.linalg.kron_matvec"]])
def test_the_command_line_exits_zero_when_clean(argv, capsys, tmp_path):
    out = tmp_path / "cases.json"
    assert fuzz_api.main([*argv, "--json", str(out)]) == 0
    assert "clear" in capsys.readouterr().out
    assert out.read_text().startswith("[")


# --------------------------------------------------------------------------------------
# The policy for unchecked values (value checks off): a NaN gives a result, not an error
# --------------------------------------------------------------------------------------
def test_value_checks_off_no_nan_gives_an_exception_over_the_corpus():
    cases = fuzz_api.fuzz(value_checks_off=True)
    bad = [c for c in cases if c.cls == "unclear"]
    assert not bad, fuzz_api.table(bad)
    assert sum(c.cls == "clear" for c in cases) > 500  # most NaNs reach a result


def _lapack_on_nan(x, y):
    """A decomposition left to the library: LAPACK raises on NaN even with checks off."""
    return np.linalg.eigh(np.asarray(x) @ np.asarray(x).T)[0] + np.sum(y)


def _switched_off_check_ignored(x, y):
    """A value check that ignores the switch."""
    if not np.all(np.isfinite(x)):
        raise KFACValueError("f: x must be finite; got NaN.")
    return x + y


@pytest.mark.parametrize("func", [_lapack_on_nan, _switched_off_check_ignored])
def test_the_value_policy_classifier_fails_an_exception(func):
    cases = fuzz_api.policy_entry("planted", lambda f: func(f(np.ones((3, 3))),
                                                            f(np.ones((3, 3)))))
    assert {c.cls for c in cases if c.index == 0} == {"unclear"}


def test_the_value_policy_classifier_passes_nan_out():
    cases = fuzz_api.policy_entry("planted", lambda f: f(np.ones(3)) + f(np.ones(3)))
    assert [c.cls for c in cases] == ["clear", "clear"]
