"""kfac_ref.optim: the reference optimiser step.

Oracles are computed here in float64 NumPy from the same inputs: least squares for Newton's
step, ``numpy.linalg.solve`` of the 2x2 quadratic model built with the exact GGN from
:func:`kfac_ref.curvature.ggn_matrix` (a Jacobian-based path, not the matrix-free products the
optimiser uses), and the estimator's dense matrix for the preconditioner.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kfac_ref import KFACTypeError, KFACValueError, curvature, losses, nn, optim
from kfac_ref.optim import KFACOptimizer, OptimizerState


def gaussian(outputs, targets):
    return losses.NormalMeanNegativeLogProbLoss(outputs, targets, variance=1.0)


def linear_problem(xp, rng, n=12, d_in=3, d_out=2):
    net = nn.Sequential([("dense", nn.Dense(d_in, d_out))])
    x = rng.standard_normal((n, d_in))
    y = rng.standard_normal((n, d_out))
    params = net.init_params(rng, xp.asarray(np.zeros(1)))
    return net, params, (xp.asarray(x), xp.asarray(y)), x, y


def mlp_problem(xp, rng, n=10):
    net = nn.Sequential([("d1", nn.Dense(3, 4)), ("act", nn.Activation("tanh")),
                         ("d2", nn.Dense(4, 2))])
    x = rng.standard_normal((n, 3))
    y = rng.standard_normal((n, 2))
    params = net.init_params(rng, xp.asarray(np.zeros(1)))
    return net, params, (xp.asarray(x), xp.asarray(y))


def flat_np(xp, net, params):
    return xp.to_numpy(net.flatten(params))


def kfac(net, mode="ggn_exact"):
    return curvature.BlockDiagonalCurvature(net, gaussian, default_estimation_mode=mode)


def exact(net, mode="ggn_exact"):
    return curvature.ExplicitExactCurvature(net, gaussian, default_estimation_mode=mode)


# ------------------------------------------------------------------------------------------
# Newton's method on a convex quadratic
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", [exact, kfac], ids=["exact", "kfac"])
def test_one_step_is_newton_on_a_convex_quadratic(xp, rng, estimator):
    # linear model + squared error: h is quadratic, its Hessian is the GGN, and K-FAC of one
    # dense layer under a unit-variance Gaussian is exact (G = I), so one step with
    # learning rate 1, no damping and no momentum lands on the least-squares minimiser.
    net, params, batch, x, y = linear_problem(xp, rng)
    opt = KFACOptimizer(net, gaussian, estimator(net), learning_rate=1.0, damping=0.0,
                        curvature_ema=0.0)
    state = opt.init(params, batch)
    new_params, state = opt.step(state, params, batch)
    xr, yr = xp.round_host(x), xp.round_host(y)
    coef, *_ = np.linalg.lstsq(np.hstack([xr, np.ones((len(xr), 1))]), yr, rcond=None)
    xp.assert_close(new_params[0][0], coef[:-1], rtol=xp.rtol)
    xp.assert_close(new_params[0][1], coef[-1], rtol=xp.rtol)
    assert state.step == 1 and state.stats.updated_inverse and state.stats.updated_curvature


def test_qmodel_first_step_on_quadratic_is_newton(xp, rng):
    net, params, batch, x, y = linear_problem(xp, rng)
    opt = KFACOptimizer(net, gaussian, exact(net), momentum_type="qmodel", damping=0.0,
                        curvature_ema=0.0)
    new_params, state = opt.step(opt.init(params, batch), params, batch)
    coef, *_ = np.linalg.lstsq(np.hstack([xp.round_host(x), np.ones((len(x), 1))]),
                               xp.round_host(y), rcond=None)
    xp.assert_close(new_params[0][0], coef[:-1], rtol=xp.rtol)
    assert abs(float(state.stats.learning_rate) - 1.0) < xp.rtol
    assert float(state.stats.momentum) == 0.0


# ------------------------------------------------------------------------------------------
# the quadratic model
# ------------------------------------------------------------------------------------------
def test_quadratic_model_matches_closed_form(xp, rng):
    v = rng.standard_normal((2, 5))
    c = rng.standard_normal((5, 5))
    c = c @ c.T
    g = rng.standard_normal(5)
    lam = 0.3
    a, d, b = v @ c @ v.T, v @ v.T, v @ g
    ax, dx, bx = xp.asarray(a), xp.asarray(d), xp.asarray(b)
    a, d, b = xp.round_host(a), xp.round_host(d), xp.round_host(b)
    w_exp = -np.linalg.solve(a + lam * d, b)
    (w0, w1), change = optim.quadratic_model(ax, dx, bx, lam)
    xp.assert_close(w0, w_exp[0])
    xp.assert_close(w1, w_exp[1])
    xp.assert_close(change, 0.5 * w_exp @ a @ w_exp + b @ w_exp)
    (_, _), change_d = optim.quadratic_model(ax, dx, bx, lam, include_damping_in_change=True)
    xp.assert_close(change_d, 0.5 * w_exp @ b)  # value of the damped model at its minimum
    # fixed momentum: alpha minimises M given mu
    mu = 0.4
    (w0, w1), _ = optim.quadratic_model(ax, dx, bx, lam, fixed_coefficients=(None, mu))
    m = a + lam * d
    xp.assert_close(w0, -(b[0] + m[0, 1] * mu) / m[0, 0])
    assert float(w1) == pytest.approx(mu)
    # zero previous update: the 1x1 solution and mu = 0
    z = np.zeros((2, 2))
    z[0, 0] = a[0, 0]
    zd = np.zeros((2, 2))
    zd[0, 0] = d[0, 0]
    (w0, w1), _ = optim.quadratic_model(xp.asarray(z), xp.asarray(zd),
                                        xp.asarray(np.array([b[0], 0.0])), lam)
    xp.assert_close(w0, -b[0] / (a[0, 0] + lam * d[0, 0]))
    assert float(w1) == 0.0


def test_qmodel_alpha_mu_equal_the_2x2_solution(xp, rng):
    net, params0, batch = mlp_problem(xp, rng)
    lam = 0.1
    est = kfac(net)
    opt = KFACOptimizer(net, gaussian, est, momentum_type="qmodel", damping=lam,
                        inverse_update_period=1)
    state = opt.init(params0, batch)
    params1, state = opt.step(state, params0, batch)
    params2, state = opt.step(state, params1, batch)

    g = xp.to_numpy(curvature.loss_value_and_grad(net, gaussian, params1, batch)[1])
    k_hat = xp.to_numpy(est.to_dense_matrix(state.preconditioner_state))
    p = np.linalg.solve(k_hat + lam * np.eye(len(g)), g)
    delta0 = flat_np(xp, net, params1) - flat_np(xp, net, params0)
    big_g = xp.to_numpy(curvature.ggn_matrix(net, gaussian, params1, batch))
    vs = np.stack([p, delta0])
    m = vs @ big_g @ vs.T + lam * vs @ vs.T
    alpha, mu = -np.linalg.solve(m, vs @ g)
    tol = xp.rtol
    assert float(state.stats.learning_rate) == pytest.approx(-alpha, rel=tol)
    assert float(state.stats.momentum) == pytest.approx(mu, rel=tol)
    step = flat_np(xp, net, params2) - flat_np(xp, net, params1)
    np.testing.assert_allclose(step, alpha * p + mu * delta0, rtol=0,
                               atol=tol * np.max(np.abs(step)))
    change = 0.5 * np.array([alpha, mu]) @ (vs @ big_g @ vs.T) @ np.array([alpha, mu]) + (
        np.array([alpha, mu]) @ vs @ g)
    assert float(state.stats.quad_model_change) == pytest.approx(change, rel=tol)


# ------------------------------------------------------------------------------------------
# damping adaptation
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", optim.DAMPING_RULES)
def test_adapt_damping_thresholds(xp, rule):
    def run(loss, new_loss, quad, lam=1.0, **kw):
        a = [xp.asarray(np.array(v)) for v in (loss, new_loss, quad)]
        new, rho = optim.adapt_damping(lam, *a, omega=0.5, rule=rule, **kw)
        return float(new), float(rho)

    assert run(1.0, 0.9, -1.0) == pytest.approx((2.0, 0.1))   # rho < 1/4: rises by 1/omega
    assert run(1.0, 0.1, -1.0) == pytest.approx((0.5, 0.9))   # rho > 3/4: falls by omega
    assert run(1.0, 0.5, -1.0) == pytest.approx((1.0, 0.5))   # in between: unchanged
    assert run(1.0, 1.2, -1.0) == pytest.approx((2.0, -0.2))  # loss went up: rises
    assert run(1.0, 0.9, -1.0, max_damping=1.5)[0] == pytest.approx(1.5)
    assert run(1.0, 0.1, -1.0, min_damping=0.8)[0] == pytest.approx(0.8)
    # loss fell although the model predicted a rise: TF lowers the damping, kfac-jax raises it
    assert run(1.0, 0.9, 1.0)[0] == pytest.approx(0.5 if rule == "tf" else 2.0)
    # NaN rho (zero model change): kfac-jax raises the damping, TF keeps it
    assert run(1.0, 1.0, 0.0)[0] == pytest.approx(2.0 if rule == "kfac_jax" else 1.0)


def test_damping_falls_when_the_model_is_exact(xp, rng):
    # on a quadratic with the exact curvature the quadratic model is the loss: rho = 1
    net, params, batch, _, _ = linear_problem(xp, rng)
    opt = KFACOptimizer(net, gaussian, exact(net), learning_rate=1.0, damping=0.5,
                        adapt_damping=True, damping_adaptation_interval=1, curvature_ema=0.0)
    _, state = opt.step(opt.init(params, batch), params, batch)
    assert float(state.stats.rho) == pytest.approx(1.0, rel=xp.rtol)
    assert float(state.damping) == pytest.approx(0.5 * 0.9, rel=xp.rtol)  # omega = 0.9^1


def test_damping_rises_when_the_step_overshoots(xp, rng):
    net, params, batch = mlp_problem(xp, rng)
    # an undamped K-FAC step on a tanh network: the model predicts a decrease, the loss rises
    opt = KFACOptimizer(net, gaussian, kfac(net), learning_rate=1.0, damping=1e-3,
                        adapt_damping=True, damping_adaptation_interval=1,
                        damping_adaptation_decay=0.95, damping_rule="tf")
    _, state = opt.step(opt.init(params, batch), params, batch)
    assert float(state.stats.quad_model_change) < 0 < float(state.stats.new_loss - state.stats.loss)
    assert float(state.stats.rho) < 0.25
    assert float(state.damping) == pytest.approx(1e-3 / 0.95, rel=xp.rtol)


def test_damping_adapts_only_at_the_end_of_each_interval(rng):
    import array_api_compat.numpy as anp

    net, params, batch = mlp_problem(_NumpyCell(anp), rng)
    opt = KFACOptimizer(net, gaussian, kfac(net), learning_rate=30.0, damping=1e-3,
                        adapt_damping=True, damping_adaptation_interval=3)
    state = opt.init(params, batch)
    adapted = []
    for _ in range(6):
        params, state = opt.step(state, params, batch)
        adapted.append(state.stats.rho is not None)
    assert adapted == [False, False, True, False, False, True]  # (t + 1) % 3 == 0


class _NumpyCell:
    def __init__(self, ns):
        self.ns = ns

    def asarray(self, x):
        return self.ns.asarray(x)


# ------------------------------------------------------------------------------------------
# norm constraint, direction, periods, weight decay, momentum
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("c", [1e-4, 1e3], ids=["active", "inactive"])
def test_norm_constraint(xp, rng, c):
    net, params, batch = mlp_problem(xp, rng)
    lam, lr = 0.05, 0.7
    est = kfac(net)
    opt = KFACOptimizer(net, gaussian, est, learning_rate=lr, damping=lam, norm_constraint=c)
    new_params, state = opt.step(opt.init(params, batch), params, batch)
    k_hat = xp.to_numpy(est.to_dense_matrix(state.preconditioner_state)) + lam * np.eye(
        net.num_params)
    g = xp.to_numpy(curvature.loss_value_and_grad(net, gaussian, params, batch)[1])
    p = np.linalg.solve(k_hat, g)
    step = flat_np(xp, net, new_params) - flat_np(xp, net, params)
    sq = lr ** 2 * p @ g
    assert float(state.stats.scaled_grad_norm_sq) == pytest.approx(sq, rel=xp.rtol)
    if c < sq:  # active: holds with equality
        assert float(state.stats.clip_coefficient) < 1
        assert step @ k_hat @ step == pytest.approx(c, rel=xp.rtol)
    else:
        assert float(state.stats.clip_coefficient) == 1.0
        np.testing.assert_allclose(step, -lr * p, rtol=0, atol=xp.rtol * np.abs(step).max())


def test_norm_constraint_coefficient_function(xp, rng):
    p, g = rng.standard_normal(4), rng.standard_normal(4)
    g = p * 2.0 + 0.1 * g  # p^T g > 0
    nu, sq = optim.norm_constraint_coefficient(xp.asarray(p), xp.asarray(g), 0.5, 0.01)
    pr, gr = xp.round_host(p), xp.round_host(g)
    xp.assert_close(sq, 0.25 * pr @ gr)
    xp.assert_close(nu, np.sqrt(0.01 / (0.25 * pr @ gr)))


def test_preconditioned_direction(xp, rng):
    net, params, batch = mlp_problem(xp, rng)
    est = kfac(net)
    s = est.init(None, (params, batch))
    s = est.update_curvature_matrix_estimate(s, 0.0, 1.0, 10, None, (params, batch))
    g = curvature.loss_value_and_grad(net, gaussian, params, batch)[1]
    d = optim.preconditioned_direction(est, s, g, 0.2)
    k_hat = xp.to_numpy(est.to_dense_matrix(s))
    xp.assert_close(d, -np.linalg.solve(k_hat + 0.2 * np.eye(len(k_hat)), xp.to_numpy(g)),
                    rtol=xp.rtol)


def test_update_periods_stale_inverse_until_refresh(xp, rng):
    net, params, batch = mlp_problem(xp, rng)
    lam, lr = 0.1, 0.5
    est = kfac(net)
    opt = KFACOptimizer(net, gaussian, est, learning_rate=lr, damping=lam, curvature_ema=0.5,
                        curvature_update_period=2, inverse_update_period=3)
    state = opt.init(params, batch)
    flags, snaps, est_states = [], [], []
    for _ in range(4):
        before = params
        params, state = opt.step(state, params, batch)
        flags.append((state.stats.updated_curvature, state.stats.updated_inverse))
        snaps.append(state.preconditioner_state)
        est_states.append(state.estimator_state)
        if len(flags) == 2:  # step t = 1 uses the inverse of t = 0, not the fresh statistics
            g = xp.to_numpy(curvature.loss_value_and_grad(net, gaussian, before, batch)[1])
            k0 = xp.to_numpy(est.to_dense_matrix(snaps[0]))
            step = flat_np(xp, net, params) - flat_np(xp, net, before)
            expected = -lr * np.linalg.solve(k0 + lam * np.eye(len(g)), g)
            np.testing.assert_allclose(step, expected, rtol=0,
                                       atol=xp.rtol * np.abs(expected).max())
    assert flags == [(True, True), (False, False), (True, False), (False, True)]
    assert snaps[1] is snaps[0] and snaps[2] is snaps[0] and snaps[3] is not snaps[0]
    assert est_states[1] is est_states[0] and est_states[2] is not est_states[1]
    # the refreshed inverse at t = 3 uses the statistics updated at t = 2
    k2, k3 = est.to_dense_matrix(est_states[2]), est.to_dense_matrix(snaps[3])
    np.testing.assert_array_equal(xp.to_numpy(k2), xp.to_numpy(k3))
    assert not np.allclose(xp.to_numpy(k3), xp.to_numpy(est.to_dense_matrix(snaps[0])))


def test_weight_decay_and_momentum_types(xp, rng):
    net, params, batch = mlp_problem(xp, rng)
    base = dict(learning_rate=0.3, damping=0.1, inverse_update_period=1)
    plain = KFACOptimizer(net, gaussian, kfac(net), **base)
    decayed = KFACOptimizer(net, gaussian, kfac(net), weight_decay=0.2, **base)
    p1, _ = plain.step(plain.init(params, batch), params, batch)
    p2, _ = decayed.step(decayed.init(params, batch), params, batch)
    theta = flat_np(xp, net, params)
    diff = flat_np(xp, net, p2) - flat_np(xp, net, p1)
    np.testing.assert_allclose(diff, -0.3 * 0.2 * theta, rtol=0, atol=xp.rtol)

    # regular: v <- mu v + p, delta = -lr v;  adam: v <- mu v + g, delta = -lr (K + lam)^-1 v
    for mt in ("regular", "adam"):
        est = kfac(net)
        opt = KFACOptimizer(net, gaussian, est, momentum_type=mt, momentum=0.5,
                            curvature_ema=0.0, **base)
        st = opt.init(params, batch)
        q1, st = opt.step(st, params, batch)
        g0 = xp.to_numpy(curvature.loss_value_and_grad(net, gaussian, params, batch)[1])
        k0 = xp.to_numpy(est.to_dense_matrix(st.preconditioner_state)) + 0.1 * np.eye(len(g0))
        q2, st = opt.step(st, q1, batch)
        g1 = xp.to_numpy(curvature.loss_value_and_grad(net, gaussian, q1, batch)[1])
        k1 = xp.to_numpy(est.to_dense_matrix(st.preconditioner_state)) + 0.1 * np.eye(len(g0))
        if mt == "regular":
            expected = -0.3 * (0.5 * np.linalg.solve(k0, g0) + np.linalg.solve(k1, g1))
        else:
            expected = -0.3 * np.linalg.solve(k1, 0.5 * g0 + g1)
        step = flat_np(xp, net, q2) - flat_np(xp, net, q1)
        np.testing.assert_allclose(step, expected, rtol=0,
                                   atol=xp.rtol * np.abs(expected).max())


def test_state_is_immutable_and_inputs_untouched(xp, rng):
    net, params, batch = mlp_problem(xp, rng)
    before = flat_np(xp, net, params)
    opt = KFACOptimizer(net, gaussian, kfac(net), momentum_type="qmodel", damping=0.1,
                        adapt_damping=True, damping_adaptation_interval=1)
    state = opt.init(params, batch)
    new, state2 = opt.step(state, params, batch)
    np.testing.assert_array_equal(flat_np(xp, net, params), before)
    assert state.step == 0 and state.stats is None and state2.step == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        state2.step = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        state2.stats.loss = 0.0
    for layer in new:
        for a in layer:
            xp.check(a)
    xp.check(state2.damping)
    xp.check(state2.velocity)


def test_stochastic_estimation_uses_the_given_generator(rng):
    net, params, batch = mlp_problem(_NumpyCell(__import__("array_api_compat").numpy), rng)
    opt = KFACOptimizer(net, gaussian, kfac(net, "fisher_gradients"), learning_rate=0.1)
    runs = []
    for _ in range(2):
        p, st = opt.step(opt.init(params, batch), params, batch, np.random.default_rng(7))
        runs.append(net.flatten(p))
    np.testing.assert_array_equal(runs[0], runs[1])


# ------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "exc", "text"), [
    (dict(learning_rate=0.1, damping=-1.0), KFACValueError, "damping must be non-negative"),
    (dict(learning_rate=0.1, momentum_type="nesterov"), KFACValueError, "momentum_type"),
    (dict(momentum_type="qmodel", learning_rate=0.1), KFACValueError, "learning_rate must be None"),
    (dict(momentum_type="qmodel", momentum=0.9), KFACValueError, "momentum must be None"),
    (dict(momentum_type="qmodel_fixedmu"), KFACValueError, "momentum must be a number"),
    (dict(), KFACValueError, "learning_rate must be a positive number"),
    (dict(learning_rate=-0.1), KFACValueError, "learning_rate must be positive"),
    (dict(learning_rate=0.1, momentum=1.0), KFACValueError, "momentum must be in [0, 1)"),
    (dict(momentum_type="qmodel", norm_constraint=1.0), KFACValueError, "norm_constraint"),
    (dict(learning_rate=0.1, inverse_update_period=0), KFACValueError, "inverse_update_period"),
    (dict(learning_rate=0.1, curvature_update_period=1.5), (KFACTypeError, KFACValueError),
     "curvature_update_period"),
    (dict(learning_rate=0.1, adapt_damping=True, damping=0.0), KFACValueError,
     "damping must be positive with adapt_damping"),
    (dict(learning_rate=0.1, adapt_damping="yes"), KFACTypeError, "adapt_damping"),
    (dict(learning_rate=0.1, damping_rule="paper"), KFACValueError, "damping_rule"),
    (dict(learning_rate=0.1, damping_adaptation_decay=1.5), KFACValueError,
     "damping_adaptation_decay must be in (0, 1]"),
    (dict(learning_rate=0.1, max_damping=1e-9), KFACValueError, "max_damping"),
    (dict(learning_rate=0.1, curvature_ema=1.2), KFACValueError, "curvature_ema"),
    (dict(learning_rate=0.1, quad_model_matrix="hessian"), KFACValueError,
     "quad_model_matrix"),
    (dict(learning_rate=0.1, weight_decay=-0.1), KFACValueError, "weight_decay"),
])
def test_bad_options_are_rejected(rng, kwargs, exc, text):
    net = nn.Sequential([("dense", nn.Dense(2, 2))])
    with pytest.raises(exc) as info:
        KFACOptimizer(net, gaussian, kfac(net), **kwargs)
    assert str(info.value).startswith("KFACOptimizer: ") and text in str(info.value)


def test_bad_arguments_are_rejected(rng):
    import array_api_compat.numpy as anp

    net, params, batch = mlp_problem(_NumpyCell(anp), rng)
    with pytest.raises(KFACTypeError, match="KFACOptimizer: net must be"):
        KFACOptimizer("net", gaussian, kfac(net), learning_rate=0.1)
    with pytest.raises(KFACTypeError, match="KFACOptimizer: estimator must be"):
        KFACOptimizer(net, gaussian, object(), learning_rate=0.1)
    opt = KFACOptimizer(net, gaussian, kfac(net), learning_rate=0.1)
    state = opt.init(params, batch)
    with pytest.raises(KFACTypeError, match="KFACOptimizer.step: state must be"):
        opt.step({"step": 0}, params, batch)
    with pytest.raises(KFACTypeError, match="KFACOptimizer.step: rng"):
        opt.step(state, params, batch, rng=7)
    with pytest.raises(KFACValueError, match="KFACOptimizer.step: batch must be"):
        opt.step(state, params, batch[0])
    with pytest.raises(KFACValueError, match="KFACOptimizer.step: params"):
        opt.step(state, params[:1], batch)
    stale = OptimizerState(step=1, damping=state.damping, velocity=state.velocity,
                           estimator_state=state.estimator_state)
    with pytest.raises(KFACValueError, match="preconditioner"):
        opt.step(stale, params, batch)
    a = anp.asarray(np.eye(2))
    with pytest.raises(KFACValueError, match="quadratic_model: grad_products"):
        optim.quadratic_model(a, a, anp.asarray(np.ones(3)), 0.1)
    with pytest.raises(KFACValueError, match="quadratic_model: damping must be non-negative"):
        optim.quadratic_model(a, a, anp.asarray(np.ones(2)), -0.1)
    with pytest.raises(KFACValueError, match="adapt_damping: omega must be in"):
        one = anp.asarray(1.0)
        optim.adapt_damping(1.0, one, one, one, omega=2.0)
    with pytest.raises(KFACValueError, match="preconditioned_direction: damping"):
        optim.preconditioned_direction(kfac(net), state.estimator_state,
                                       net.flatten(params), -1.0)
    with pytest.raises(KFACValueError, match="norm_constraint_coefficient: norm_constraint"):
        optim.norm_constraint_coefficient(anp.ones(2), anp.ones(2), 0.1, 0.0)
