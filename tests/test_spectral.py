"""kfac_ref.spectral: traces, log-determinants and eigenvalues of Kronecker blocks against
dense oracles (``np.kron`` in the row-major vec order, ``np.linalg.slogdet``,
``np.linalg.eigvalsh``), and the stochastic trace estimators (Hutchinson, Hutch++).

Tolerances.  The factors have eigenvalues in [0.5, 2] (κ ≤ 4 each, κ ≤ 16 for the block,
within the budget of ``xp.rtol``).  A log-determinant sums ``pq`` logarithms, each with an
absolute error of at most the relative error of its eigenvalue (``xp.rtol``), so it is
compared with ``atol = pq · xp.rtol``.  The stochastic estimators are compared with the
exact trace within 10 standard deviations (Chebyshev: a deviation that large has probability
at most 1 %; the seed is fixed, so the test is deterministic), the standard deviation from
the closed-form variance of Hutchinson's estimator with Rademacher probes,
:math:`\\operatorname{Var} = \\frac2m(\\|M\\|_F^2 - \\sum_i M_{ii}^2)`.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import assert_allclose_normwise, random_spd

from kfac_ref import KFACTypeError, KFACValueError, spectral

P, Q = 3, 4  # factor sizes


def skip_jax(xp):
    """JAX eager arrays compile each new small operation (seconds per test); the functions
    are exercised on JAX by the exactly damped case of test_kron_identities_against_dense and the
    trace-estimator tests."""
    if xp.name.startswith("jax"):
        pytest.skip("JAX eager compiles op by op (slow); covered on JAX by the exactly "
                    "damped identities and the trace-estimator tests")


def factors(rng):
    return random_spd(rng, P, 0.5, 2.0), random_spd(rng, Q, 0.5, 2.0)


def dense(a, g, lam, s, exact, pi=None):
    """The damped block in NumPy: exact s·A⊗G + λI or factored s(A + π√(λ/s) I)⊗(G + ...)."""
    if exact:
        return s * np.kron(a, g) + lam * np.eye(a.shape[0] * g.shape[0])
    pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0])) if pi is None else pi
    r = np.sqrt(lam / s)
    return s * np.kron(a + pi * r * np.eye(a.shape[0]), g + r / pi * np.eye(g.shape[0]))


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "factored"])
@pytest.mark.parametrize("lam", [0.0, 0.3])
def test_kron_identities_against_dense(xp, rng, exact, lam):
    if lam == 0.0 or not exact:
        skip_jax(xp)
    a, g = factors(rng)
    s = 2.0
    a_d, g_d = xp.asarray(a), xp.asarray(g)
    a_h, g_h = xp.round_host(a), xp.round_host(g)
    m = dense(a_h, g_h, lam, s, exact)
    kw = dict(scale=s, exact=exact)
    xp.assert_close(spectral.kron_trace(a_d, g_d, lam, **kw), np.trace(m))
    sign, logabs = spectral.kron_slogdet(a_d, g_d, lam, **kw)
    want_sign, want = np.linalg.slogdet(m)
    xp.check(sign)
    assert float(xp.to_numpy(sign)) == want_sign
    xp.assert_close(logabs, want, atol=P * Q * xp.rtol)
    ev = spectral.kron_eigenvalues(a_d, g_d, lam, **kw)
    xp.assert_close(xp.xp.sort(ev), np.linalg.eigvalsh(m))


def test_kron_logdet_identity_and_order(xp, rng):
    """logdet(A⊗G) = d_G logdet A + d_A logdet G, and the eigenvalues come in the order
    vec_r(a γᵀ) of the factors' ascending eigenvalues."""
    skip_jax(xp)
    a, g = factors(rng)
    a_h, g_h = xp.round_host(a), xp.round_host(g)
    _, logabs = spectral.kron_slogdet(xp.asarray(a), xp.asarray(g))
    want = Q * np.linalg.slogdet(a_h)[1] + P * np.linalg.slogdet(g_h)[1]
    xp.assert_close(logabs, want, atol=P * Q * xp.rtol)
    ev = spectral.kron_eigenvalues(xp.asarray(a), xp.asarray(g))
    xp.assert_close(ev, np.outer(np.linalg.eigvalsh(a_h), np.linalg.eigvalsh(g_h)).ravel())


def test_kron_zero_factor_fallbacks_and_diagonal_factor(xp, rng):
    """kfac-jax's fall-back: a zero factor makes the damped block λI; TF's: π = 1.  A 1-D
    factor is a diagonal."""
    skip_jax(xp)
    _, g = factors(rng)
    g_h = xp.round_host(g)
    zero = xp.asarray(np.zeros((P, P)))
    lam = 0.25
    kw = dict(exact=False, zero_factor_fallback="identity")
    xp.assert_close(spectral.kron_trace(zero, xp.asarray(g), lam, **kw), lam * P * Q)
    xp.assert_close(spectral.kron_slogdet(zero, xp.asarray(g), lam, **kw)[1],
                    P * Q * np.log(lam), atol=P * Q * xp.rtol)
    xp.assert_close(spectral.kron_eigenvalues(zero, xp.asarray(g), lam, **kw),
                    np.full(P * Q, lam))
    pi_one = dense(np.zeros((P, P)), g_h, lam, 1.0, False, pi=1.0)
    xp.assert_close(spectral.kron_trace(zero, xp.asarray(g), lam, exact=False), np.trace(pi_one))
    d = np.array([0.5, 1.0, 2.0])
    m = dense(np.diag(d), g_h, lam, 1.0, False)
    got = spectral.kron_slogdet(xp.asarray(d), xp.asarray(g), lam, exact=False)[1]
    xp.assert_close(got, np.linalg.slogdet(m)[1], atol=P * Q * xp.rtol)


def test_kron_singular_block(xp):
    """A singular undamped block: sign 0, log|det| = -inf (numpy.linalg.slogdet's answer)."""
    skip_jax(xp)
    a = xp.asarray(np.diag([0.0, 1.0, 2.0]))
    sign, logabs = spectral.kron_slogdet(a, xp.asarray(np.eye(2)))
    assert float(xp.to_numpy(sign)) == 0.0
    assert float(xp.to_numpy(logabs)) == -np.inf


def test_kron_errors(xp, rng):
    skip_jax(xp)
    a, g = factors(rng)
    a_d, g_d = xp.asarray(a), xp.asarray(g)
    with pytest.raises(KFACValueError, match="kron_trace: damping"):
        spectral.kron_trace(a_d, g_d, -1.0)
    with pytest.raises(KFACValueError, match="kron_slogdet: a must be"):
        spectral.kron_slogdet(xp.asarray(np.ones((2, 3))), g_d)
    with pytest.raises(KFACValueError, match="kron_eigenvalues: norm_type"):
        spectral.kron_eigenvalues(a_d, g_d, 0.1, norm_type="fro")
    with pytest.raises(KFACValueError, match="kron_trace: scale"):
        spectral.kron_trace(a_d, g_d, scale=0.0)


def _hutchinson_std(m, num):
    return np.sqrt(2.0 * (np.sum(m * m) - np.sum(np.diag(m) ** 2)) / num)


def test_hutchinson_exact_over_all_sign_vectors(xp, rng):
    """Averaged over all 2^d Rademacher vectors the estimate is the trace (unbiasedness,
    exactly: Σ_z z zᵀ = 2^d I)."""
    d = 5
    m = rng.standard_normal((d, d))
    m = m + m.T
    m_d = xp.asarray(m)
    probes = np.array(list(itertools.product([-1.0, 1.0], repeat=d))).T
    got = spectral.hutchinson_trace(lambda x: m_d @ x, xp.asarray(probes))
    xp.assert_close(got, np.trace(xp.round_host(m)), atol=d * xp.rtol * np.abs(m).max())


def test_hutchinson_and_hutchpp_variance(xp, rng):
    """With fixed seeds both estimates lie within 10 standard deviations of the trace; Hutch++
    is Hutchinson on the deflated P M P."""
    d, num = 8, 60
    m = random_spd(rng, d, 0.5, 2.0)
    m_d = xp.asarray(m)
    m_h = xp.round_host(m)
    z = rng.choice([-1.0, 1.0], size=(d, num))
    got = float(xp.to_numpy(spectral.hutchinson_trace(lambda x: m_d @ x, xp.asarray(z))))
    assert abs(got - np.trace(m_h)) <= 10 * _hutchinson_std(m_h, num)
    s = rng.choice([-1.0, 1.0], size=(d, 2))
    q, _ = np.linalg.qr(m_h @ s)
    proj = np.eye(d) - q @ q.T
    pmp = proj @ m_h @ proj
    est = spectral.hutchpp_trace(lambda x: m_d @ x, xp.asarray(s), xp.asarray(z))
    xp.check(est)
    # given S the estimate is tr(QᵀMQ) + Hutchinson(PMP): the latter exactly reproduced here
    want = np.trace(q.T @ m_h @ q) + np.sum(z * (pmp @ z)) / num
    assert_allclose_normwise(xp.to_numpy(est), want, 10 * xp.rtol)
    assert abs(float(xp.to_numpy(est)) - np.trace(m_h)) <= 10 * _hutchinson_std(pmp, num)


def test_hutchpp_exact_for_low_rank(xp, rng):
    """rank M ≤ k sketch columns: Q spans the range of M, P M P = 0, the estimate is exact."""
    d, r = 9, 2
    u = rng.standard_normal((d, r))
    m = u @ u.T
    m_d = xp.asarray(m)
    s = rng.choice([-1.0, 1.0], size=(d, 3))
    z = rng.choice([-1.0, 1.0], size=(d, 2))
    got = spectral.hutchpp_trace(lambda x: m_d @ x, xp.asarray(s), xp.asarray(z))
    # the residual term is PMP applied to probes: of order eps·‖M‖ per entry
    xp.assert_close(got, np.trace(xp.round_host(m)), atol=d * xp.rtol * np.abs(m).max())


def test_trace_estimator_errors(xp):
    z = xp.asarray(np.ones((4, 2)))
    with pytest.raises(KFACTypeError, match="hutchinson_trace: matmat"):
        spectral.hutchinson_trace("not callable", z)
    with pytest.raises(KFACValueError, match="hutchinson_trace: probes"):
        spectral.hutchinson_trace(lambda x: x, xp.asarray(np.ones(4)))
    with pytest.raises(KFACValueError, match="hutchinson_trace: matmat must return"):
        spectral.hutchinson_trace(lambda x: x[:2, :], z)
    with pytest.raises(KFACValueError, match="hutchpp_trace: probes"):
        spectral.hutchpp_trace(lambda x: x, z, xp.asarray(np.ones((3, 2))))
    with pytest.raises(KFACValueError, match="hutchpp_trace: sketch"):
        spectral.hutchpp_trace(lambda x: x, xp.asarray(np.ones((2, 3))),
                               xp.asarray(np.ones((2, 1))))
