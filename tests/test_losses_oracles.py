"""Loss functions against the definitions: gradients by finite differences of an independent
loss oracle; Hessian = Fisher for natural parameters by finite differences of
``grad_of_evaluate``; F = E_y[∇ℓ ∇ℓᵀ] by exact enumeration (categorical, Bernoulli), exact
Gauss-Hermite quadrature and Monte Carlo (normals); the mean-variance GGN as the
natural-parameter Gauss-Newton matrix; sampling; stability at |logits| ≈ 100.  Every
tolerance is derived in a comment."""

from __future__ import annotations

import itertools
import math

import array_api_compat.numpy as anp
import numpy as np
import pytest
from conftest import assert_allclose_normwise
from losses_helpers import (
    CASES,
    WEIGHT,
    case_fixture,
    flat_cat,
    make_case,
    oracle_fisher,
    oracle_loss,
    to_host_tuple,
)
from scipy.special import log_expit, logsumexp, softmax

from kfac_ref import losses as L

case = case_fixture()


def _targets_dev(xp, case, host=None):
    t = case.targets if host is None else host
    if case.name == "onehot" and t.ndim == 1:
        t = np.eye(case.inputs[0].shape[1])[t]
    return xp.asarray(t)


# -- gradients ------------------------------------------------------------------------------
def test_grad_of_evaluate_matches_finite_differences_of_oracle(xp, case):
    """Central differences of the float64 oracle loss, step h = 1e-6.  Truncation error
    h²/6·|ℓ'''| with |ℓ'''| <= 1 for softmax/sigmoid, 0 for the fixed-variance normal and
    <= 3r²/v⁴ + 1/v³ <= 1e3 for the mean-variance data (v >= 0.5, |r| < 4): <= 2e-10;
    rounding 2·eps·|ℓ|/(2h) <= 2.2e-16·20/1e-6 ≈ 5e-9.  So 1e-8 bounds the oracle's error;
    the backend's own rounding adds xp.rtol·max|g|."""
    h = 1e-6
    t_host = case.targets
    grads = to_host_tuple(xp, case.loss.grad_of_evaluate(None, "off"))
    for a, x in enumerate(case.inputs):
        fd = np.zeros_like(x)
        for idx in np.ndindex(*x.shape[1:]):
            plus = [np.array(y) for y in case.inputs]
            minus = [np.array(y) for y in case.inputs]
            plus[a][(slice(None), *idx)] += h
            minus[a][(slice(None), *idx)] -= h
            fd[(slice(None), *idx)] = (oracle_loss(case, plus, t_host)
                                       - oracle_loss(case, minus, t_host)) / (2 * h)
        assert_allclose_normwise(grads[a], fd, 0.0, atol=1e-8 + xp.rtol * np.abs(fd).max())


def test_evaluate_matches_oracle(xp, case):
    xp.assert_close(case.loss.evaluate(), WEIGHT * oracle_loss(case, case.inputs, case.targets))
    # explicit targets override the stored ones
    got = case.loss.evaluate(_targets_dev(xp, case), "off")
    xp.assert_close(got, oracle_loss(case, case.inputs, case.targets))


def _third_derivative_bound(case, h):
    """Bound on |∂³ℓ/∂x_j³| along the finite-difference directions (see the caller)."""
    if case.name in ("normal_mean", "normal_mean_sq"):
        return 0.0  # the gradient is linear in the mean
    if case.name == "mean_variance":
        mu, v = case.inputs
        r = np.abs(case.targets - mu)
        vmin = v - h  # the step never leaves [v - h, v + h]
        return float(max((6 * r / vmin**4).max(), (3 / vmin**4 + 12 * r**2 / vmin**5).max()))
    return 1.0  # derivatives of softmax/sigmoid probabilities are bounded by 1 (loosely)


def test_hessian_by_finite_differences_of_grad(xp, case):
    """H[:, j] ≈ (g(x + h e_j) - g(x - h e_j)) / (x⁺_j - x⁻_j) with the *rounded* step the
    backend actually sees.  Error <= h²/6·M3 (truncation, M3 from _third_derivative_bound)
    + 2·c·eps·G/(2h) (rounding of g, c = 16 flops' worth, G = max|g| + 1), h = eps^(1/3).
    For natural parameters the Hessian must equal the (y-free) Fisher; for the mean-variance
    normal it is the pointwise Hessian, compared with ``hessian_matrix``."""
    eps = xp.eps
    h = eps ** (1 / 3)
    loss = case.loss
    t = _targets_dev(xp, case)
    n = case.n
    sizes = [int(np.prod(x.shape[1:])) for x in case.inputs]
    cols = []
    g0 = flat_cat(to_host_tuple(xp, loss.grad_of_evaluate(t, "off")), n)
    for a, x in enumerate(case.inputs):
        for idx in np.ndindex(*x.shape[1:]):
            plus = [np.array(y) for y in case.inputs]
            minus = [np.array(y) for y in case.inputs]
            plus[a][(slice(None), *idx)] += h
            minus[a][(slice(None), *idx)] -= h
            plus = [xp.round_host(y) for y in plus]
            minus = [xp.round_host(y) for y in minus]
            step = plus[a][(slice(None), *idx)] - minus[a][(slice(None), *idx)]  # [N]
            gp = loss.copy_with_different_inputs(tuple(xp.asarray(y) for y in plus))
            gm = loss.copy_with_different_inputs(tuple(xp.asarray(y) for y in minus))
            dg = (flat_cat(to_host_tuple(xp, gp.grad_of_evaluate(t, "off")), n)
                  - flat_cat(to_host_tuple(xp, gm.grad_of_evaluate(t, "off")), n))
            cols.append(dg / step[:, None])
    fd = np.stack(cols, axis=-1)  # [N, D, D]
    assert fd.shape[1] == sum(sizes)
    tol = h**2 / 6 * _third_derivative_bound(case, h) + 16 * eps * (np.abs(g0).max() + 1) / h
    hess = xp.to_numpy(loss.hessian_matrix(t)) / WEIGHT
    assert_allclose_normwise(hess, fd, 0.0, atol=tol)
    if case.name != "mean_variance":
        np.testing.assert_allclose(hess, xp.to_numpy(loss.fisher_matrix()) / WEIGHT, rtol=0,
                                   atol=xp.rtol)
        np.testing.assert_allclose(hess, xp.to_numpy(loss.ggn_matrix()) / WEIGHT, rtol=0,
                                   atol=xp.rtol)


def test_mean_variance_hessian_is_not_the_fisher_pointwise(xp, rng):
    """(μ, v) are not natural parameters: at a target with r² < v/2 the Hessian has a
    negative variance-variance entry, while the Fisher is positive definite."""
    mu = np.array([[0.0]])
    v = np.array([[1.0]])
    y = np.array([[0.1]])  # r² = 0.01 < v/2
    loss = L.NormalMeanVarianceNegativeLogProbLoss(xp.asarray(mu), xp.asarray(v),
                                                   xp.asarray(y))
    hess = xp.to_numpy(loss.hessian_matrix())[0]
    # closed form: [[1/v, r/v²], [r/v², r²/v³ - 1/(2v²)]]
    xp.assert_close(loss.hessian_matrix(), np.array([[[1.0, 0.1], [0.1, 0.01 - 0.5]]]))
    assert np.linalg.eigvalsh(hess).min() < 0
    xp.assert_close(loss.fisher_matrix(), np.array([[[1.0, 0.0], [0.0, 0.5]]]))


# -- F = E_y[∇ℓ ∇ℓᵀ]: exact enumeration and quadrature --------------------------------------
def _expected_outer(xp, case, targets_and_probs):
    """Σ_y P(y) g(y) g(y)ᵀ per example, with g from the library's grad_of_evaluate."""
    acc = 0.0
    total = 0.0
    for t_dev, prob in targets_and_probs:
        g = flat_cat(to_host_tuple(xp, case.loss.grad_of_evaluate(t_dev, "off")), case.n)
        acc = acc + prob[:, None, None] * g[:, :, None] * g[:, None, :]
        total = total + prob
    np.testing.assert_allclose(total, 1.0, rtol=1e-12)  # the enumeration is complete
    return acc


@pytest.mark.parametrize("name", ["categorical", "categorical_masked", "onehot"])
def test_categorical_fisher_is_expected_score_outer_product(xp, rng, name):
    """Exact: the expectation is a finite sum over the k classes."""
    case = make_case(xp, name, rng)
    z = case.inputs[0]
    k = z.shape[1]
    p = softmax(z, axis=-1)
    items = []
    for c in range(k):
        y = np.full(case.n, c)
        items.append((_targets_dev(xp, case, y), p[:, c]))
    expected = _expected_outer(xp, case, items)
    xp.assert_close(case.loss.fisher_matrix(), WEIGHT * expected)


def test_bernoulli_fisher_is_expected_score_outer_product(xp, rng):
    """Exact: the expectation is a finite sum over the 2^4 target patterns of a [2, 2] event."""
    case = make_case(xp, "bernoulli", rng)
    z = case.inputs[0]
    items = []
    for bits in itertools.product((0.0, 1.0), repeat=4):
        y = np.broadcast_to(np.array(bits).reshape(1, 2, 2), z.shape)
        logp = (y * log_expit(z) + (1 - y) * log_expit(-z)).reshape(case.n, -1).sum(-1)
        items.append((xp.asarray(np.ascontiguousarray(y)), np.exp(logp)))
    expected = _expected_outer(xp, case, items)
    xp.assert_close(case.loss.fisher_matrix(), WEIGHT * expected)


@pytest.mark.parametrize("name", ["normal_mean", "normal_mean_sq", "mean_variance"])
def test_normal_fisher_by_exact_gauss_hermite_quadrature(xp, rng, name):
    """E over y ~ N(μ, v) of g gᵀ: the entries are polynomials of degree <= 4 in each
    standardised coordinate, and 3-point Gauss-Hermite quadrature is exact up to degree 5,
    so the tensor-product rule gives the expectation exactly (up to rounding).  For the
    mean-variance loss the same rule gives E[Hessian] = F (degree <= 2)."""
    case = make_case(xp, name, rng)
    nodes, weights = np.polynomial.hermite_e.hermegauss(3)
    weights = weights / math.sqrt(2 * math.pi)
    mu = case.inputs[0]
    sd = np.sqrt(case.inputs[1] if name == "mean_variance" else case.extra["variance"])
    d = mu.shape[1]
    items, hess = [], 0.0
    for pick in itertools.product(range(3), repeat=d):
        x = nodes[list(pick)]
        y = xp.asarray(xp.round_host(mu + sd * x[None, :]))
        prob = np.full(case.n, np.prod(weights[list(pick)]))
        items.append((y, prob))
        if name == "mean_variance":
            hess = hess + prob[:, None, None] * xp.to_numpy(case.loss.hessian_matrix(y))
    expected = _expected_outer(xp, case, items)
    xp.assert_close(case.loss.fisher_matrix(), WEIGHT * expected)
    np.testing.assert_allclose(WEIGHT * expected, WEIGHT * oracle_fisher(case), rtol=0,
                               atol=xp.rtol * np.abs(oracle_fisher(case)).max() * WEIGHT)
    if name == "mean_variance":
        xp.assert_close(case.loss.fisher_matrix(), hess)


@pytest.mark.parametrize("name", ["normal_mean", "mean_variance"])
def test_normal_fisher_by_monte_carlo(xp, name):
    """Monte Carlo with sampled targets, M = 20000 per example, coefficient "sqrt" (so the
    outer products carry w).  Each entry's standard error is sqrt(Var[g_i g_j]/M) <=
    (E g_i⁴ · E g_j⁴)^{1/4}/√M (Cauchy-Schwarz), with the unweighted fourth moments
    E g_μ⁴ = 3/v² and E g_v⁴ = E[(1 - z²)⁴]/(16 v⁴) = 60/(16 v⁴).  Tolerance 5 standard
    errors (times w): a two-sided normal tail of 5.7e-7 per entry, < 1e-4 for all entries
    together (union bound); the seed is fixed, so the test is deterministic."""
    m_samples = 20000
    rng = np.random.default_rng(7)
    n, d = 2, 2
    mu = xp.round_host(rng.standard_normal((n, d)))
    if name == "normal_mean":
        var = 0.7
        var_arr = np.full((n, d), var)
        big = L.NormalMeanNegativeLogProbLoss(xp.asarray(np.tile(mu, (m_samples, 1))),
                                              variance=var, weight=WEIGHT)
        small = L.NormalMeanNegativeLogProbLoss(xp.asarray(mu), variance=var, weight=WEIGHT)
        fourth = [3 / var_arr**2]
    else:
        var_arr = xp.round_host(rng.uniform(0.5, 2.0, size=(n, d)))
        big = L.NormalMeanVarianceNegativeLogProbLoss(
            xp.asarray(np.tile(mu, (m_samples, 1))), xp.asarray(np.tile(var_arr, (m_samples, 1))),
            weight=WEIGHT)
        small = L.NormalMeanVarianceNegativeLogProbLoss(xp.asarray(mu), xp.asarray(var_arr),
                                                        weight=WEIGHT)
        fourth = [3 / var_arr**2, 60 / (16 * var_arr**4)]
    g = flat_cat(to_host_tuple(xp, big.grad_of_evaluate_on_sample(rng, "sqrt")), n * m_samples)
    g = g.reshape(m_samples, n, -1)
    estimate = np.einsum("mni,mnj->nij", g, g) / m_samples
    f4 = np.concatenate(fourth, axis=-1)  # [n, D]
    se = (f4[:, :, None] * f4[:, None, :]) ** 0.25 / math.sqrt(m_samples)
    exact = xp.to_numpy(small.fisher_matrix())
    assert np.all(np.abs(estimate - exact) <= 5 * WEIGHT * se), (
        f"max |MC - F| / se = {np.max(np.abs(estimate - exact) / (WEIGHT * se)):.2f}")


# -- the mean-variance GGN ----------------------------------------------------------------
def test_mean_variance_ggn_is_natural_parameter_gauss_newton(xp, rng):
    """G = J_ηᵀ ∇²_η ℓ J_η with η = (μ/v, -1/(2v)) per coordinate.  ∇²_η ℓ = ∇²A(η),
    A(η) = -η₁²/(4η₂) - ½ log(-2η₂), is computed by second-order central differences
    (h = 1e-4) of A alone; J_η analytically.  Error of the differences: h²/12·|A''''| +
    4 eps |A| / h² <= 1e-8·1e3 + 4·2.2e-16·10/1e-8 ≈ 1e-5 (|A''''| <= 1e3 for v in
    [0.5, 2], |μ| < 3), so 1e-5 relative to the largest entry bounds the oracle."""
    case = make_case(xp, "mean_variance", rng)
    mu, v = case.inputs
    n, d = mu.shape

    def A(e1, e2):
        return -(e1**2) / (4 * e2) - 0.5 * np.log(-2 * e2)

    h = 1e-4
    G = np.zeros((n, 2 * d, 2 * d))
    for i in range(n):
        for j in range(d):
            m_, v_ = mu[i, j], v[i, j]
            eta = np.array([m_ / v_, -1 / (2 * v_)])
            H = np.zeros((2, 2))
            for a in range(2):
                for b in range(2):
                    ea, eb = np.eye(2)[a] * h, np.eye(2)[b] * h
                    H[a, b] = (A(*(eta + ea + eb)) - A(*(eta + ea - eb))
                               - A(*(eta - ea + eb)) + A(*(eta - ea - eb))) / (4 * h * h)
            J = np.array([[1 / v_, -m_ / v_**2], [0.0, 1 / (2 * v_**2)]])
            g = J.T @ H @ J
            idx = [j, d + j]
            G[np.ix_([i], idx, idx)] = g
    assert_allclose_normwise(xp.to_numpy(case.loss.ggn_matrix()) / WEIGHT, G, 1e-5 + xp.rtol)


# -- sampling -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_same_seed_same_samples_on_every_backend(xp, name):
    host_case = make_case(_NumpyBackend, name, np.random.default_rng(3))
    case = make_case(xp, name, np.random.default_rng(3))
    ref = np.asarray(host_case.loss.sample(np.random.default_rng(11)))
    got = case.loss.sample(np.random.default_rng(11))
    got_h = xp.to_numpy(got)
    assert got_h.shape == ref.shape
    if ref.dtype.kind in "iu" or name in ("onehot", "bernoulli"):
        np.testing.assert_array_equal(got_h, ref)
    else:  # normal draws: same numbers up to the backend's rounding
        assert_allclose_normwise(got_h, ref, xp.rtol)
    # a sample is a valid target
    case.loss.evaluate(got)


@pytest.mark.parametrize("name", ["categorical", "onehot", "bernoulli"])
def test_sample_frequencies(xp, name):
    """M = 20000 draws per example; each frequency has standard deviation
    sqrt(p(1-p)/M) <= 0.0036; tolerance 5 of them (tail 5.7e-7 per entry)."""
    m_samples = 20000
    rng = np.random.default_rng(5)
    if name == "bernoulli":
        z = xp.round_host(rng.standard_normal((1, 3)) * 2)
        loss = L.MultiBernoulliNegativeLogProbLoss(xp.asarray(np.tile(z, (m_samples, 1))))
        s = xp.to_numpy(loss.sample(rng))
        p = 1 / (1 + np.exp(-z[0]))
        freq = s.mean(0)
    else:
        z = xp.round_host(rng.standard_normal((1, 4)) * 2)
        cls = (L.CategoricalLogitsNegativeLogProbLoss if name == "categorical"
               else L.OneHotCategoricalLogitsNegativeLogProbLoss)
        loss = cls(xp.asarray(np.tile(z, (m_samples, 1))))
        s = xp.to_numpy(loss.sample(rng))
        if name == "categorical":
            assert s.dtype.kind in "iu"
            s = np.eye(4)[s]
        assert np.all(s.sum(-1) == 1.0)
        p = softmax(z[0])
        freq = s.mean(0)
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / m_samples))


def test_grad_of_evaluate_on_sample_is_grad_at_the_sample(xp, case):
    loss = case.loss
    y = loss.sample(np.random.default_rng(2))
    expected = to_host_tuple(xp, loss.grad_of_evaluate(y, "sqrt"))
    got = to_host_tuple(xp, loss.grad_of_evaluate_on_sample(np.random.default_rng(2), "sqrt"))
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


# -- numerical stability ----------------------------------------------------------------------
def test_categorical_stable_at_large_logits(xp):
    # |z| ≈ 100 as asked, plus a row at ±800 where exp(z) overflows even in float64
    z = np.array([[100.0, -100.0, 0.0, 90.0], [-100.0, -100.0, -100.0, 100.0],
                  [800.0, -800.0, 0.0, 0.0]])
    y = np.array([1, 0, 1])  # the improbable classes: loss ≈ 200, 200, 1600
    loss = L.CategoricalLogitsNegativeLogProbLoss(xp.asarray(z), xp.asarray(y))
    expected = logsumexp(z, axis=-1) - z[np.arange(3), y]
    xp.assert_close(loss.evaluate(), expected)
    p = softmax(z, axis=-1)
    g = xp.to_numpy(loss.grad_of_evaluate()[0])
    assert_allclose_normwise(g, p - np.eye(4)[y], xp.rtol)
    F = xp.to_numpy(loss.fisher_matrix())
    B = xp.to_numpy(loss.fisher_factor_matrix())
    assert np.all(np.isfinite(F)) and np.all(np.isfinite(B))
    oracle = np.stack([np.diag(pi) - np.outer(pi, pi) for pi in p])
    np.testing.assert_allclose(F, oracle, rtol=0, atol=xp.rtol)
    np.testing.assert_allclose(B @ B.transpose(0, 2, 1), oracle, rtol=0, atol=xp.rtol)
    for out in (loss.multiply_fisher((xp.asarray(z),))[0],
                loss.multiply_fisher_factor(xp.asarray(z))[0],
                loss.multiply_fisher_factor_transpose((xp.asarray(z),)),
                loss.multiply_fisher_factor_replicated_one_hot((1,))[0]):
        assert np.all(np.isfinite(xp.to_numpy(out)))
    s = xp.to_numpy(loss.sample(np.random.default_rng(0)))
    np.testing.assert_array_equal(s, [0, 3, 0])  # overwhelmingly likely classes


def _flushes_subnormals(xp):
    """Whether the backend's float32 arithmetic flushes subnormal results to zero (XLA on
    CPU does; NumPy, PyTorch and array-api-strict keep them): 2^-120 · 2^-10 = 2^-130 is a
    float32 subnormal."""
    a = xp.asarray(np.array([2.0**-120]), dtype=xp.dtype)
    b = xp.asarray(np.array([2.0**-10]), dtype=xp.dtype)
    return bool(xp.to_numpy(a * b)[0] == 0.0)


def test_bernoulli_stable_at_large_logits(xp):
    # |z| ≈ 100 as asked, plus ±800 where exp(-z) overflows even in float64
    z = np.array([[100.0, -100.0, 30.0, -30.0, 800.0, -800.0]])
    y = np.array([[0.0, 1.0, 1.0, 1.0, 0.0, 1.0]])
    loss = L.MultiBernoulliNegativeLogProbLoss(xp.asarray(z), xp.asarray(y))
    expected = -(y * log_expit(z) + (1 - y) * log_expit(-z)).sum(-1)  # ≈ 1830
    xp.assert_close(loss.evaluate(), expected)
    g = xp.to_numpy(loss.grad_of_evaluate()[0])
    assert_allclose_normwise(g, np.exp(log_expit(z)) - y, xp.rtol)
    # p(1-p) = exp(log σ(z) + log σ(-z)): float64 keeps e^-100 to full relative accuracy.
    log_var = (log_expit(z) + log_expit(-z))[0]
    var = np.exp(log_var)
    F = np.diagonal(xp.to_numpy(loss.fisher_matrix())[0])
    assert np.all(np.isfinite(F)) and np.all(F >= 0)
    if xp.float64:
        np.testing.assert_allclose(F, var, rtol=1e-13)
    else:
        # float32: the entries at |z| = 30 (e^-30 ≈ 9.4e-14) are normal numbers and must be
        # relatively accurate — the unstable p·(1 - p) gives 0 there, as 1 - σ(30) rounds to
        # 0.  The entries at |z| = 100 (e^-100 ≈ 3.7e-44) lie below the smallest normal
        # float32 (1.2e-38): IEEE arithmetic returns them as subnormals (granularity
        # 2^-149 ≈ 1.4e-45, so compared absolutely), while XLA on CPU (JAX) flushes subnormal
        # results to zero, which is measured here, not assumed.
        tiny = float(np.finfo(np.float32).tiny)
        normal, sub = var >= tiny, (var > 0.0) & (var < tiny)
        assert normal.sum() == 2 and sub.sum() == 2
        np.testing.assert_allclose(F[normal], var[normal], rtol=1e-6)
        if _flushes_subnormals(xp):
            np.testing.assert_array_equal(F[sub], 0.0)
        else:
            np.testing.assert_allclose(F[sub], var[sub], rtol=1e-6, atol=1e-44)
        np.testing.assert_array_equal(F[var == 0.0], 0.0)  # e^-800: zero in any float32
    b = xp.to_numpy(loss.multiply_fisher_factor(xp.asarray(np.ones((1, 6))))[0])[0]
    sqrt_var = np.exp(0.5 * log_var)  # e^-400 is a float64 normal number; in float32 it is 0
    if xp.float64:
        np.testing.assert_allclose(b, sqrt_var, rtol=xp.rtol)
    else:
        np.testing.assert_allclose(b, sqrt_var, rtol=xp.rtol, atol=1e-44)


def test_gradients_relatively_accurate_for_confident_predictions(xp):
    """When the target is the likely outcome the gradient is tiny; kfac_ref computes it
    without cancellation (σ(z) - 1 = -σ(-z); p_y - 1 = -Σ_{c≠y} p_c), so it is accurate
    to a few eps *relative to its own size*, not just absolutely."""
    z = np.array([[30.0, -30.0, 12.0]])
    y = np.array([[1.0, 0.0, 1.0]])
    g = xp.to_numpy(L.MultiBernoulliNegativeLogProbLoss(xp.asarray(z), xp.asarray(y))
                    .grad_of_evaluate()[0])
    expected = np.where(y == 1.0, -np.exp(log_expit(-z)), np.exp(log_expit(z)))
    np.testing.assert_allclose(g, expected, rtol=16 * xp.eps)
    zc = np.array([[25.0, 0.0, -1.0, 2.0]])
    gc = xp.to_numpy(L.CategoricalLogitsNegativeLogProbLoss(xp.asarray(zc), xp.asarray(
        np.array([0]))).grad_of_evaluate()[0])
    p = softmax(zc, axis=-1)
    expected_c = np.concatenate([[-p[0, 1:].sum()], p[0, 1:]])[None, :]
    np.testing.assert_allclose(gc, expected_c, rtol=16 * xp.eps)


class _NumpyBackendCls:
    """Minimal stand-in for the numpy cell of the ``xp`` fixture (the cross-backend
    reference); float64, CPU."""

    xp = anp
    float64 = True

    @staticmethod
    def round_host(host):
        return np.asarray(host, dtype=np.float64) if np.asarray(host).dtype.kind == "f" \
            else np.asarray(host)

    @staticmethod
    def asarray(host):
        host = np.asarray(host)
        return anp.asarray(host, dtype=anp.float64 if host.dtype.kind == "f" else None)


_NumpyBackend = _NumpyBackendCls()
