"""Documented thresholds, each tested on both sides of its boundary and exactly at it.

* The Levenberg–Marquardt rule (:func:`kfac_ref.optim.adapt_damping`): the damping falls for
  ``ρ > 3/4`` and rises for ``ρ < 1/4`` (strict), unchanged in ``[1/4, 3/4]``.  The ratios
  are exact in binary: ``ρ = (new − 1)/(−1)`` with ``new = 1/4, 3/4`` (and their neighbours
  one ulp away), so the tests sit on the boundary itself.
* The singular rule (module docstring of :mod:`kfac_ref.linalg`): a damped matrix of order n
  is refused when ``σ_min ≤ n·ε·σ_max``.  A diagonal matrix ``diag(1, …, 1, s)`` has exactly
  these eigenvalues and, for ``s`` a power of two, exactly representable Cholesky pivots.
* The diagnosis' *explains* criterion (``conformance.diagnosis``): a candidate with residual
  ``r`` explains the numbers when ``r ≤ rtol``, or when ``r ≤ EXPLAIN_RTOL`` and
  ``r ≤ EXPLAIN_REDUCTION · e0`` (``e0`` the plain reference's error).
"""

from __future__ import annotations

import numpy as np
import pytest

from kfac_ref import KFACValueError, linalg, optim


# -- Levenberg–Marquardt --------------------------------------------------------------------
@pytest.mark.parametrize("rule", optim.DAMPING_RULES)
def test_lm_rule_is_strict_at_both_thresholds(xp, rule):
    def run(new_loss):
        a = [xp.asarray(np.array(v)) for v in (1.0, new_loss, -1.0)]
        lam, rho = optim.adapt_damping(1.0, *a, omega=0.5, rule=rule)
        return float(lam), float(rho)

    # ρ = 1 − new_loss; with d one ulp of 3/4 in the dtype, 3/4 ± d, 1/4 ± d and their
    # complements 1/4 ∓ d, 3/4 ∓ d are all representable, so ρ is exact
    d = float(np.spacing(np.float64(0.75) if xp.float64 else np.float32(0.75)))
    for rho, want in (
        (0.75, 1.0),        # ρ = 3/4 exactly: not > 3/4, unchanged
        (0.75 + d, 0.5),    # just above 3/4: falls (ω λ)
        (0.75 - d, 1.0),    # just below: unchanged
        (0.25, 1.0),        # ρ = 1/4 exactly: not < 1/4, unchanged
        (0.25 - d, 2.0),    # just below 1/4: rises (λ / ω)
        (0.25 + d, 1.0),    # just above: unchanged
    ):
        lam, got_rho = run(1.0 - rho)
        assert got_rho == rho, (got_rho, rho)
        assert lam == want, (rho, lam)


@pytest.mark.parametrize("rule", optim.DAMPING_RULES)
def test_lm_rule_custom_thresholds_and_clipping(xp, rule):
    def run(new_loss, **kw):
        a = [xp.asarray(np.array(v)) for v in (1.0, new_loss, -1.0)]
        return float(optim.adapt_damping(1.0, *a, omega=0.5, rule=rule, **kw)[0])

    # thresholds (0.5, 0.625): rho = 0.5 and 0.625 exactly sit on them
    kw = dict(lower_threshold=0.5, upper_threshold=0.625)
    assert run(0.5, **kw) == 1.0 and run(0.375, **kw) == 1.0
    assert run(0.25, **kw) == 0.5 and run(0.75, **kw) == 2.0
    # the clip bounds are inclusive: min_damping = ω λ and max_damping = λ / ω are reached
    assert run(0.0, min_damping=0.5) == 0.5 and run(0.0, min_damping=0.625) == 0.625
    assert run(1.0 - 0.125, max_damping=2.0) == 2.0 and run(0.875, max_damping=1.5) == 1.5


# -- the singular rule ------------------------------------------------------------------------
def test_singular_rule_boundary(xp):
    n = 4
    eps = xp.eps
    tol = n * eps  # σ_max = 1: the boundary is s = n·ε (a power of two)

    def mat(s):
        return xp.asarray(np.diag([1.0, 1.0, 1.0, s]))

    for s, refused in ((tol / 2, True), (tol, True), (2 * tol, False)):
        for call in (lambda m: linalg.damped_matpower(m, -1.0),
                     lambda m: linalg.damped_inverse(m),
                     lambda m: linalg.damped_cholesky(m)):
            if refused:
                with pytest.raises(KFACValueError, match="numerically singular"):
                    call(mat(s))
            else:
                xp.check(call(mat(s)))
    # the eigenvalue path also one ulp either side of the boundary
    t = np.float64(tol) if xp.float64 else np.float32(tol)
    with pytest.raises(KFACValueError, match="numerically singular"):
        linalg.damped_matpower(mat(float(t)), -1.0)
    above = float(np.nextafter(t, t.dtype.type(1)))
    out = xp.to_numpy(linalg.damped_matpower(mat(above), -1.0))
    assert out[-1, -1] == pytest.approx(1 / above, rel=xp.rtol)
    # damping moves a matrix across: σ_min = s + λ, σ_max = 1 + λ
    xp.check(linalg.damped_matpower(mat(0.0), -1.0, damping=4 * tol))
    with pytest.raises(KFACValueError, match="numerically singular"):
        linalg.damped_matpower(mat(0.0), -1.0, damping=0.0)
    # positive powers are not refused
    xp.check(linalg.damped_matpower(mat(0.0), 0.5))


# -- the diagnosis' explains criterion ---------------------------------------------------------
#: the documented values (conformance/DIAGNOSES.md, "Explains is looser than passes"): a
#: residual of at most 1e-6 that is at least 1000 times smaller than the plain error
DOC_EXPLAIN_RTOL, DOC_REDUCTION = 1e-6, 1e-3


def _search(e0, rtol):
    from conformance import diagnosis as D

    expected = np.ones(4)
    act = expected.copy()
    act[0] += 2 * e0  # ‖act − expected‖ / ‖expected‖ = 2e0 / 2
    s = D._Search(act, expected, rtol, 0.0, {})  # noqa: SLF001 - the criterion itself
    assert s.e0 == pytest.approx(e0, rel=1e-12)
    return s


def test_diagnosis_constants_are_the_documented_ones():
    from conformance import diagnosis as D

    assert (D.EXPLAIN_RTOL, D.EXPLAIN_REDUCTION) == (DOC_EXPLAIN_RTOL, DOC_REDUCTION)


@pytest.mark.parametrize("e0, binding", [(1.0, "rtol"), (1e-4, "reduction")])
def test_diagnosis_loose_clause_boundaries(e0, binding):
    # e0 = 1: 1e-6 < 1e-3·e0, EXPLAIN_RTOL binds; e0 = 1e-4: 1e-3·e0 = 1e-7 binds
    s = _search(e0, rtol=1e-12)
    lim = DOC_EXPLAIN_RTOL if binding == "rtol" else DOC_REDUCTION * s.e0
    assert lim == min(DOC_EXPLAIN_RTOL, DOC_REDUCTION * s.e0)
    assert s.explains(lim) and s.explains(lim / 2)
    assert not s.explains(np.nextafter(lim, 1.0)) and not s.explains(2 * lim)


def test_diagnosis_strict_clause_boundary():
    # e0 = 1e-8: the loose clause allows 1e-11, below rtol = 1e-10, so only r ≤ rtol explains
    s = _search(1e-8, rtol=1e-10)
    assert s.explains(1e-10) and s.explains(5e-11)
    assert not s.explains(np.nextafter(1e-10, 1.0)) and not s.explains(2e-10)
