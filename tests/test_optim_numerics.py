"""kfac_ref.optim numerics: the quadratic model's singular and badly scaled systems, the norm
constraint at extreme scales, and a one-parameter model at zero damping.

Oracles, in float64 NumPy on the host values the backend sees:

* the minimum-norm solution of the Jacobi-scaled system, ``numpy.linalg.pinv`` /
  ``numpy.linalg.lstsq`` with a cut-off of ``sqrt(eps)`` of the cell's dtype (far above
  rounding noise, far below the smallest genuine eigenvalue of these systems), computed on
  the data divided by its scale, so that nothing overflows in the oracle either;
* identities that every minimiser satisfies (the update ``V w`` of a rank-1 system);
* Newton's iteration, which is what the quadratic model does to a one-parameter model whose
  GGN is its Hessian (linear model, canonical-link loss).
"""

from __future__ import annotations

import numpy as np
import pytest

from kfac_ref import curvature, losses, nn, optim
from kfac_ref.optim import KFACOptimizer


# ------------------------------------------------------------------------------------------
# oracles and systems
# ------------------------------------------------------------------------------------------
def min_norm_oracle(xp, a, d, b, lam):
    """w* of the Jacobi-scaled system by pinv, and the undamped model change, in float64."""
    m = (a + a.T) / 2 + lam * (d + d.T) / 2
    diag = np.abs(np.diag(m))
    s = np.where(diag > 0, np.sqrt(diag), 1.0)
    mt = m / np.outer(s, s)
    y = -np.linalg.pinv(mt, rcond=np.sqrt(xp.eps), hermitian=True) @ (b / s)
    w = y / s
    return w, 0.5 * w @ ((a + a.T) / 2) @ w + b @ w


def rank1_system(rng, c):
    """A = alpha u u^T, D = beta u u^T, b = gamma u with u = (1, c): the previous update is
    c times the preconditioned gradient."""
    alpha, beta = rng.uniform(0.5, 2.0, size=2)
    gamma = rng.standard_normal()
    u = np.array([1.0, c])
    return alpha * np.outer(u, u), beta * np.outer(u, u), gamma * u


def rank2_system(rng):
    v = rng.standard_normal((2, 5))
    cm = rng.standard_normal((5, 5))
    cm = cm @ cm.T
    return v @ cm @ v.T, v @ v.T, v @ rng.standard_normal(5)


def run_qm(xp, a, d, b, lam, **kw):
    (w0, w1), change = optim.quadratic_model(xp.asarray(a), xp.asarray(d), xp.asarray(b), lam,
                                             **kw)
    for r in (w0, w1, change):
        xp.check(r)
    return (w0, w1), change


def host(xp, *arrays):
    return tuple(xp.round_host(x) for x in arrays)


# ------------------------------------------------------------------------------------------
# rank-deficient systems
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("c", [2.0, -0.3], ids=["exact-rank1", "rounded-rank1"])
@pytest.mark.parametrize("lam", [0.0, 0.1])
def test_parallel_previous_update_gives_the_min_norm_solution(xp, rng, c, lam):
    a, d, b = host(xp, *rank1_system(rng, c))
    (w0, w1), change = run_qm(xp, a, d, b, lam)
    w_exp, change_exp = min_norm_oracle(xp, a, d, b, lam)
    xp.assert_close(w0, w_exp[0])
    xp.assert_close(w1, w_exp[1])
    xp.assert_close(change, change_exp)
    # every minimiser gives the same update V w = (w0 + c w1) v: -b_1 / M_11 along v
    m = a + lam * d
    xp.assert_close(w0 + c * w1, -b[0] / m[0, 0])
    # and the model is at its minimum -1/2 b^T M^+ b
    if lam == 0:
        xp.assert_close(change, -0.5 * b @ np.linalg.lstsq(a, b, rcond=np.sqrt(xp.eps))[0])


def test_rank1_split_is_even_in_the_scaled_variables(xp, rng):
    # the minimum-norm split of the scaled system: alpha s_1 = mu s_2 for c > 0
    a, d, b = host(xp, *rank1_system(rng, 4.0))
    (w0, w1), _ = run_qm(xp, a, d, b, 0.2)
    s = np.sqrt(np.diag(a + 0.2 * d))
    assert xp.to_numpy(w0) * s[0] == pytest.approx(xp.to_numpy(w1) * s[1], rel=xp.rtol)
    assert float(w0) != 0.0


def test_zero_curvature_direction_gets_a_zero_coefficient(xp):
    # lambda = 0 and no curvature along the second vector: the model is unbounded along it;
    # the least-squares (minimum-norm) solution of M w = -b leaves it out
    a = np.array([[2.0, 0.0], [0.0, 0.0]])
    b = np.array([1.0, 3.0])
    (w0, w1), change = run_qm(xp, a, np.zeros((2, 2)), b, 0.0)
    w_ls = np.linalg.lstsq(a, -b, rcond=None)[0]
    xp.assert_close(w0, w_ls[0])
    assert float(w1) == 0.0
    # one vector, no curvature: no step
    (w,), change1 = optim.quadratic_model(xp.asarray(np.zeros((1, 1))),
                                          xp.asarray(np.zeros((1, 1))),
                                          xp.asarray(np.array([1.0])), 0.0)
    assert float(w) == 0.0 and float(change1) == 0.0


@pytest.mark.parametrize("fixed", [(None, None), (None, 0.9), (0.5, None)])
def test_zero_gradient_gives_a_zero_step(xp, rng, fixed):
    # g = 0: p = 0 (first row and column of A, D vanish) and b = 0
    v = rng.standard_normal(4)
    cm = rng.standard_normal((4, 4))
    cm = cm @ cm.T
    a = np.zeros((2, 2))
    a[1, 1] = v @ cm @ v
    dm = np.zeros((2, 2))
    dm[1, 1] = v @ v
    (w0, w1), change = run_qm(xp, a, dm, np.zeros(2), 0.1, fixed_coefficients=fixed)
    assert np.isfinite(float(w0)) and np.isfinite(float(w1)) and np.isfinite(float(change))
    # an adapted coefficient minimises M given the other one: 0 along p = 0 (no curvature
    # and no gradient there), -(b_2 + M_21 w_1) / M_22 = 0 along the previous update, since
    # M_21 = 0 and b_2 = 0
    for i, w in ((0, w0), (1, w1)):
        assert float(w) == (0.0 if fixed[i] is None else pytest.approx(fixed[i]))
    # a nonsingular system with b = 0 also gives w = 0
    a2, d2, _ = host(xp, *rank2_system(rng))
    (w0, w1), change = run_qm(xp, a2, d2, np.zeros(2), 0.1)
    assert float(w0) == 0.0 and float(w1) == 0.0 and float(change) == 0.0


def test_all_zero_system(xp):
    (w0, w1), change = run_qm(xp, np.zeros((2, 2)), np.zeros((2, 2)), np.zeros(2), 0.0)
    assert float(w0) == 0.0 and float(w1) == 0.0 and float(change) == 0.0


# ------------------------------------------------------------------------------------------
# scale
# ------------------------------------------------------------------------------------------
# the reported eta^2 p^T g of 1e±160-scaled vectors overflows, as its value does
_OVERFLOW_OK = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _big(xp):
    return 1e160 if xp.float64 else 1e20


@pytest.mark.parametrize("kind", ["rank2", "rank1"])
@pytest.mark.parametrize("sign", [1, -1], ids=["large", "small"])
def test_extreme_scales(xp, rng, kind, sign):
    # the whole system times 1e±160 (float64) or 1e±20 (float32): the determinant of the
    # unscaled system over- or underflows, the Jacobi-scaled one does not
    scale = _big(xp) ** sign
    a, d, b = rank2_system(rng) if kind == "rank2" else rank1_system(rng, -0.3)
    a, d, b = host(xp, a * scale, d * scale, b * scale)
    (w0, w1), change = run_qm(xp, a, d, b, 0.1)
    # oracle on the rescaled data (the solution is invariant under scaling the system)
    w_exp, change_exp = min_norm_oracle(xp, a / scale, d / scale, b / scale, 0.1)
    xp.assert_close(w0, w_exp[0])
    xp.assert_close(w1, w_exp[1])
    got = xp.to_numpy(change) / scale
    np.testing.assert_allclose(got, change_exp, rtol=xp.rtol)


@pytest.mark.parametrize("kind", ["rank2", "rank1"])
def test_solution_invariant_under_scaling_the_system(xp, rng, kind):
    a, d, b = host(xp, *(rank2_system(rng) if kind == "rank2" else rank1_system(rng, 2.0)))
    (w0, w1), change = run_qm(xp, a, d, b, 0.3)
    for c in (2.0 ** -40, 2.0 ** 40):  # powers of two: the scaled data is exact
        (v0, v1), change_c = run_qm(xp, c * a, c * d, c * b, 0.3)
        xp.assert_close(v0, xp.to_numpy(w0))
        xp.assert_close(v1, xp.to_numpy(w1))
        xp.assert_close(change_c, c * xp.to_numpy(change))


@pytest.mark.parametrize("kind", ["rank2", "rank1"])
def test_update_invariant_under_scaling_one_vector(xp, rng, kind):
    # v_2 -> c v_2 scales row/column 2 of A and D and b_2 by c; the update V w is unchanged,
    # so mu -> mu / c and alpha stays (for the rank-1 system too: the minimum-norm solution
    # of the unscaled system would move with c)
    a, d, b = host(xp, *(rank2_system(rng) if kind == "rank2" else rank1_system(rng, 2.0)))
    (w0, w1), change = run_qm(xp, a, d, b, 0.3)
    for c in (2.0 ** -20, 2.0 ** 20):
        sc = np.diag([1.0, c])
        (v0, v1), change_c = run_qm(xp, sc @ a @ sc, sc @ d @ sc, sc @ b, 0.3)
        xp.assert_close(v0, xp.to_numpy(w0))
        xp.assert_close(v1, xp.to_numpy(w1) / c)
        xp.assert_close(change_c, xp.to_numpy(change))


# ------------------------------------------------------------------------------------------
# the norm constraint
# ------------------------------------------------------------------------------------------
@_OVERFLOW_OK
@pytest.mark.parametrize("sign", [1, -1], ids=["large", "small"])
def test_norm_constraint_at_extreme_scales(xp, rng, sign):
    p = rng.standard_normal(6)
    g = 2.0 * p + 0.1 * rng.standard_normal(6)  # p^T g > 0
    scale = _big(xp) ** sign
    pr, gr = host(xp, p * scale, g * scale)
    lr, c = 0.5, 0.01
    nu, sq = optim.norm_constraint_coefficient(xp.asarray(pr), xp.asarray(gr), lr, c)
    xp.check(nu)
    # oracle on the rescaled vectors: eta^2 p^T g = scale^2 * eta^2 (p/scale)^T (g/scale)
    inner = lr ** 2 * (pr / scale) @ (gr / scale)
    nu_exp = min(1.0, np.sqrt(c / inner) / scale)
    xp.assert_close(nu, nu_exp)
    if sign == 1:
        assert 0 < float(nu) < 1
        # the true eta^2 p^T g lies beyond the dtype's range
        assert float(sq) == np.inf
    else:
        assert float(nu) == 1.0
        np.testing.assert_allclose(xp.to_numpy(sq), inner * scale ** 2, rtol=xp.rtol,
                                   atol=float(np.finfo(np.float64 if xp.float64 else
                                                       np.float32).smallest_normal))


def test_norm_constraint_mixed_scales_and_zero(xp, rng):
    p = rng.standard_normal(5)
    g = p + 0.1 * rng.standard_normal(5)
    big = _big(xp)
    pr, gr = host(xp, p * big, g / big)  # p^T g is of order one; p alone is huge
    nu, sq = optim.norm_constraint_coefficient(xp.asarray(pr), xp.asarray(gr), 2.0, 0.5)
    inner = 4.0 * (pr / big) @ (gr * big)
    xp.assert_close(sq, inner)
    xp.assert_close(nu, min(1.0, np.sqrt(0.5 / inner)))
    # p = 0: nothing to rescale
    nu0, sq0 = optim.norm_constraint_coefficient(xp.asarray(np.zeros(5)), xp.asarray(gr), 2.0,
                                                 0.5)
    assert float(nu0) == 1.0 and float(sq0) == 0.0


# ------------------------------------------------------------------------------------------
# one-parameter models at zero damping: the previous update is always parallel to p
# ------------------------------------------------------------------------------------------
def _one_param_data(rng, n=16):
    x = rng.standard_normal((n, 1))
    return x


def test_one_parameter_least_squares_at_zero_damping(xp, rng):
    # linear model, unit-variance Gaussian: K-FAC and the GGN are exact, the first qmodel step
    # is Newton's and lands on the least-squares solution; later steps (p ~ 0, previous update
    # parallel to it) must stay there, finite
    net = nn.Sequential([("d", nn.Dense(1, 1, use_bias=False))])
    x = _one_param_data(rng)
    y = 1.7 * x[:, 0:1] + 0.3 * rng.standard_normal((len(x), 1))
    batch = (xp.asarray(x), xp.asarray(y))

    def gaussian(outputs, targets):
        return losses.NormalMeanNegativeLogProbLoss(outputs, targets, variance=1.0)

    est = curvature.BlockDiagonalCurvature(net, gaussian, default_estimation_mode="ggn_exact")
    params = net.init_params(rng, xp.asarray(np.zeros(1)))
    xr, yr = host(xp, x, y)
    coef = np.linalg.lstsq(xr, yr, rcond=None)[0]
    for mt, mu in (("qmodel", None), ("qmodel_fixedmu", 0.5)):
        opt = KFACOptimizer(net, gaussian, est, momentum_type=mt, momentum=mu, damping=0.0,
                            curvature_ema=0.0, inverse_update_period=1)
        state, p = opt.init(params, batch), params
        for _ in range(4):
            p, state = opt.step(state, p, batch)
            assert np.isfinite(float(state.stats.learning_rate))
            assert np.isfinite(float(state.stats.momentum))
        if mt == "qmodel":
            xp.assert_close(p[0][0], coef)


def test_one_parameter_logistic_regression_follows_newton(xp, rng):
    # linear logit + Bernoulli (canonical link): the GGN is the Hessian, the model along the
    # one direction is exact to second order, so every qmodel step at zero damping is
    # Newton's step, whatever split between p and the previous update the solver returns
    net = nn.Sequential([("d", nn.Dense(1, 1, use_bias=False))])
    x = _one_param_data(rng, 24)
    y = (rng.uniform(size=(len(x), 1)) < 1 / (1 + np.exp(-0.8 * x))).astype(np.float64)
    batch = (xp.asarray(x), xp.asarray(y))
    loss = losses.MultiBernoulliNegativeLogProbLoss
    est = curvature.BlockDiagonalCurvature(net, loss, default_estimation_mode="ggn_exact")
    params = ((xp.asarray(np.array([[0.1]])),),)
    opt = KFACOptimizer(net, loss, est, momentum_type="qmodel", damping=0.0, curvature_ema=0.0,
                        inverse_update_period=1)
    state, p = opt.init(params, batch), params
    xr = xp.round_host(x)[:, 0]
    theta = float(xp.round_host(0.1))
    for _ in range(4):
        p, state = opt.step(state, p, batch)
        sig = 1 / (1 + np.exp(-theta * xr))
        grad = np.mean((sig - y[:, 0]) * xr)
        hess = np.mean(sig * (1 - sig) * xr ** 2)
        theta = theta - grad / hess
        xp.assert_close(p[0][0], np.array([[theta]]))


# ------------------------------------------------------------------------------------------
# traced
# ------------------------------------------------------------------------------------------
@_OVERFLOW_OK
def test_quadratic_model_and_norm_constraint_under_jit(rng):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    import array_api_compat.numpy as anp

    previous = bool(jax.config.read("jax_enable_x64"))
    jax.config.update("jax_enable_x64", True)
    try:
        systems = [rank1_system(rng, -0.3), rank2_system(rng),
                   tuple(x * 1e160 for x in rank2_system(rng))]
        z = np.zeros((2, 2))
        z[1, 1] = 1.0
        systems.append((z, z, np.zeros(2)))  # zero gradient
        f = jax.jit(lambda a, d, b: optim.quadratic_model(a, d, b, 0.1))
        for a, d, b in systems:
            (j0, j1), jc = f(jnp.asarray(a), jnp.asarray(d), jnp.asarray(b))
            (e0, e1), ec = optim.quadratic_model(anp.asarray(a), anp.asarray(d),
                                                 anp.asarray(b), 0.1)
            got, exp = np.array([j0, j1, jc]), np.array([e0, e1, ec], dtype=np.float64)
            np.testing.assert_allclose(got, exp, rtol=4096 * np.finfo(np.float64).eps)
        p = rng.standard_normal(4) * 1e160
        nu = jax.jit(lambda p, g: optim.norm_constraint_coefficient(p, g, 0.5, 0.01)[0])(
            jnp.asarray(p), jnp.asarray(p))
        nu_e = optim.norm_constraint_coefficient(anp.asarray(p), anp.asarray(p), 0.5, 0.01)[0]
        assert 0 < float(nu) < 1
        np.testing.assert_allclose(float(nu), float(nu_e), rtol=4096 * np.finfo(float).eps)
    finally:
        jax.config.update("jax_enable_x64", previous)
