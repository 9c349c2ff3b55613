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
def test_diagnosis_explains_criterion_boundaries():
    from conformance import diagnosis as D

    expected = np.ones(4)
    act = expected.copy()
    act[0] += 4e-2  # e0 = 0.04 / 2 = 0.02
    rtol = 1e-10
    s = D._Search(act, expected, rtol, 0.0, {})  # noqa: SLF001 - the criterion itself
    e0 = np.linalg.norm(act - expected) / np.linalg.norm(expected)
    assert s.e0 == pytest.approx(e0, rel=1e-15)
    # r <= rtol: explained, at the boundary and below
    assert s.explains(rtol) and s.explains(rtol / 2)
    # the loose clause: r <= min(EXPLAIN_RTOL, EXPLAIN_REDUCTION · e0), inclusive
    lim = min(D.EXPLAIN_RTOL, D.EXPLAIN_REDUCTION * e0)
    assert s.explains(lim)
    assert not s.explains(np.nextafter(lim, 1.0))
    # with a larger e0 the EXPLAIN_RTOL clause binds, with a smaller one the reduction
    for bump in (1.0, 1e-4):
        act2 = expected.copy()
        act2[0] += 2 * bump
        s2 = D._Search(act2, expected, rtol, 0.0, {})  # noqa: SLF001
        lim2 = min(D.EXPLAIN_RTOL, D.EXPLAIN_REDUCTION * s2.e0)
        assert lim2 == (D.EXPLAIN_RTOL if bump == 1.0 else D.EXPLAIN_REDUCTION * s2.e0)
        assert s2.explains(lim2) and not s2.explains(np.nextafter(lim2, 1.0))
        assert s2.explains(rtol)
    # a residual above rtol but below the reduction when EXPLAIN_RTOL is smaller: refused
    s3 = D._Search(act, expected, 1e-12, 0.0, {})  # noqa: SLF001
    assert not s3.explains(2 * D.EXPLAIN_RTOL)
