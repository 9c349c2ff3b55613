"""Every :class:`kfac_ref.optim.KFACOptimizer` option against an independent NumPy optimiser.

The problem: one dense layer (``d_in = 3``, 3 classes, bias) under the softmax cross-entropy,
a new batch at every step.  Everything the optimiser needs has a closed form in NumPy, so the
oracle (:func:`numpy_kfac`) shares no code with kfac_ref:

* ``h = (1/N) Σ_n -log softmax(W̃ᵀ ā_n)_{y_n}``, ``∇h = vec_r(Āᵀ(P − Y)/N)``;
* the K-FAC block of the ``ggn_exact`` mode: ``A = ĀᵀĀ/N``, ``G = (1/N) Σ_n H_n`` with the
  softmax Hessian ``H_n = diag(p_n) − p_n p_nᵀ``, ``Ĉ = kron(Ā_avg, G_avg)`` of the
  normalised moving averages ``S ← d S + new, W ← d W + 1`` (kfac-jax) or
  ``S ← d S + (1 − d) new, W ← d W + (1 − d)`` (TF);
* the exact GGN (= the Fisher: the loss is the negative log-likelihood of an exponential
  family in its natural parameters) ``C = (1/N) Σ_n kron(ā_n ā_nᵀ, H_n)``;
* the step, the quadratic model (a 2×2 ``numpy.linalg.solve``), the Levenberg–Marquardt rule
  and the norm constraint written out from their docstring formulas.

The oracle also covers the update periods (a stale snapshot of the averaged factors), the
approximate (π-damped) power with the damping of its refresh, the empirical Fisher's
``G = (1/N) Σ_n r_n r_nᵀ`` (``r_n = p_n − e_{y_n}``), and the damping decay ``ω = d^T``.

K-FAC differs from the exact GGN here (``G`` is an average of non-identity ``H_n``), and the
moving average differs from the last batch, so every option changes the trajectory; each test
also checks that the option's effect is visible (the trajectory without it differs).

Tolerance: each step solves with ``Ĉ + λ_p I`` (eigenvalues in [λ_p, ~3]) and a 2×2 model;
the test asserts the condition numbers ``κ`` it meets stay below 256, so the conftest budget
``rtol = 4096·eps`` covers ``n·κ`` for ``n ≤ 16``; four steps compound the rounding of the
parameters at most additively, hence ``4·xp.rtol`` on the trajectory.
"""

from __future__ import annotations

import numpy as np
import pytest

from kfac_ref import curvature, losses, nn
from kfac_ref.optim import KFACOptimizer

N, D_IN, K, STEPS = 6, 3, 3, 4


def ce(outputs, targets):
    return losses.CategoricalLogitsNegativeLogProbLoss(outputs, targets=targets)


def data(rng):
    xs = rng.standard_normal((STEPS, N, D_IN))
    ys = rng.integers(0, K, size=(STEPS, N))
    w0 = rng.standard_normal((D_IN, K)) / 2
    b0 = 0.3 * rng.standard_normal(K)
    return xs, ys, w0, b0


# -- the NumPy optimiser ----------------------------------------------------------------------
def _softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _problem(theta, x, y, empirical=False):
    """(loss, grad, A, G, exact GGN) at theta = vec_r([W; b]) on the batch."""
    ab = np.hstack([x, np.ones((len(x), 1))])
    w = theta.reshape(D_IN + 1, K)
    p = _softmax(ab @ w)
    loss = float(np.mean(-np.log(p[np.arange(len(y)), y])))
    grad = (ab.T @ (p - np.eye(K)[y]) / len(x)).reshape(-1)
    hs = [np.diag(pn) - np.outer(pn, pn) for pn in p]
    a = ab.T @ ab / len(x)
    if empirical:  # G of the per-example gradients at the data targets
        r = p - np.eye(K)[y]
        g = r.T @ r / len(x)
    else:
        g = sum(hs) / len(x)
    ggn = sum(np.kron(np.outer(an, an), hn) for an, hn in zip(ab, hs, strict=True)) / len(x)
    return loss, grad, a, g, ggn


def numpy_kfac(xs, ys, w0, b0, *, learning_rate=None, momentum=None, momentum_type="regular",
               damping=1e-3, adapt_damping=False, damping_adaptation_interval=5,
               damping_adaptation_decay=None, damping_lower_threshold=0.25,
               damping_upper_threshold=0.75, min_damping=1e-8, max_damping=None,
               damping_rule="kfac_jax", include_damping_in_quad_change=False,
               damping_quad_model="approximate", quad_model_matrix="ggn",
               precon_damping_mult=1.0, norm_constraint=None, weight_decay=0.0,
               curvature_ema=0.95, ema_style="kfac_jax", curvature_update_period=1,
               inverse_update_period=1, exact_power=True, estimation_mode="ggn_exact",
               kappas=None, rhos=None):
    """Parameters after each step and the damping after each step ([STEPS, P], [STEPS]).

    The preconditioner is the snapshot of the averaged factors at the last refresh
    (``t mod inverse_update_period = 0``) with the current damping (``exact_power``:
    ``(A⊗G + λ_p I)⁻¹``) or the damping of that refresh (π-damped factors
    ``(A + π√λ_r I)⁻¹ ⊗ (G + √λ_r/π I)⁻¹``, π the trace norm)."""
    del quad_model_matrix  # Fisher = GGN for this loss: one matrix serves both
    theta = np.concatenate([w0, b0[None]]).reshape(-1)
    eye = np.eye(theta.size)
    lam = damping
    decay = damping_adaptation_decay
    if decay is None:
        decay = 0.9 if damping_rule == "kfac_jax" else 0.95
    omega = decay ** damping_adaptation_interval
    d = curvature_ema
    new_w = 1.0 if ema_style == "kfac_jax" else 1.0 - d
    sa = sg = 0.0
    wt = 0.0
    snap = None
    vel = np.zeros_like(theta)
    mu = 0.0 if momentum is None else momentum
    thetas, lams = [], []
    for t in range(len(xs)):
        x, y = xs[t], ys[t]
        loss, g, a_new, g_new, ggn = _problem(theta, x, y, estimation_mode == "fisher_empirical")
        if t % curvature_update_period == 0:
            sa, sg, wt = d * sa + new_w * a_new, d * sg + new_w * g_new, d * wt + new_w
        c_hat = np.kron(sa / wt, sg / wt)  # the current statistics (approximate model)
        lam_p = lam * precon_damping_mult
        if t % inverse_update_period == 0:
            snap = (sa / wt, sg / wt, lam_p)
        a_r, g_r, lam_r = snap
        if exact_power:
            m = np.kron(a_r, g_r) + lam_p * eye
        else:
            pi = np.sqrt((np.trace(a_r) / a_r.shape[0]) / (np.trace(g_r) / g_r.shape[0]))
            r = np.sqrt(lam_r)
            m = np.kron(a_r + pi * r * np.eye(a_r.shape[0]), g_r + r / pi * np.eye(K))
        if kappas is not None:
            kappas.append(np.linalg.cond(m))
        quad = None
        if momentum_type in ("regular", "adam"):
            src = g if momentum_type == "regular" else mu * vel + g
            p = np.linalg.solve(m, src)
            if norm_constraint is not None:
                sq = learning_rate ** 2 * p @ src
                if sq > norm_constraint:
                    p = np.sqrt(norm_constraint / sq) * p
            if momentum_type == "regular":
                vel = mu * vel + p
                delta = -learning_rate * vel
            else:
                vel = src
                delta = -learning_rate * p
            eta = learning_rate
        else:
            p = np.linalg.solve(m, g)
            prev = vel
            vs = np.stack([p, prev])
            a2, d2, b2 = vs @ ggn @ vs.T, vs @ vs.T, vs @ g
            mm = a2 + lam * d2
            if not prev.any():
                w = np.array([-b2[0] / mm[0, 0], 0.0])
            elif momentum_type == "qmodel":
                w = -np.linalg.solve(mm, b2)
            else:
                w = np.array([-(b2[0] + mm[0, 1] * mu) / mm[0, 0], mu])
            quad = 0.5 * w @ (mm if include_damping_in_quad_change else a2) @ w + b2 @ w
            delta = vs.T @ w
            vel = delta
            eta = 1.0
        new_theta = theta + delta - eta * weight_decay * theta
        if adapt_damping and (t + 1) % damping_adaptation_interval == 0:
            if quad is None:
                cm = ggn if damping_quad_model == "exact" else c_hat
                quad = 0.5 * delta @ cm @ delta + g @ delta
                if include_damping_in_quad_change:
                    quad += 0.5 * lam * delta @ delta
            new_loss = _problem(new_theta, x, y)[0]
            rho = (new_loss - loss) / quad
            if rhos is not None:  # ρ and its cancellation factor |h| / |h_new − h|
                rhos.append((rho, abs(loss) / abs(new_loss - loss)))
            if damping_rule == "kfac_jax":
                fall = rho > damping_upper_threshold
            else:
                fall = (new_loss < loss and quad > 0) or rho > damping_upper_threshold
            if fall:
                lam = lam * omega
            elif rho < damping_lower_threshold:
                lam = lam / omega
            lam = max(lam, min_damping)
            if max_damping is not None:
                lam = min(lam, max_damping)
        theta = new_theta
        thetas.append(theta)
        lams.append(lam)
    return np.array(thetas), np.array(lams)


def kfac_ref_run(xp, xs, ys, w0, b0, rhos=None, **options):
    net = nn.Sequential([("dense", nn.Dense(D_IN, K))])
    est = curvature.BlockDiagonalCurvature(net, ce, default_estimation_mode="ggn_exact")
    options = {"curvature_update_period": 1, "inverse_update_period": 1, "exact_power": True,
               **options}
    opt = KFACOptimizer(net, ce, est, **options)
    params = ((xp.asarray(w0), xp.asarray(b0)),)
    batch = (xp.asarray(xs[0]), xp.asarray(ys[0]))
    state = opt.init(params, batch)
    thetas, lams = [], []
    for t in range(len(xs)):
        params, state = opt.step(state, params, (xp.asarray(xs[t]), xp.asarray(ys[t])))
        thetas.append(xp.to_numpy(net.flatten(params)))
        lams.append(float(xp.to_numpy(state.damping)))
        if rhos is not None and state.stats.rho is not None:
            rhos.append(float(xp.to_numpy(state.stats.rho)))
    return np.array(thetas), np.array(lams)


# (options, the option's neutral value: the trajectory with it must differ)
CASES = {
    "precon_damping_mult": (dict(learning_rate=0.5, momentum=0.3, damping=0.05,
                                 precon_damping_mult=4.0), dict(precon_damping_mult=1.0)),
    # rho with the damping term in the model: [1.07, 1.12, 0.72, 0.37], without: [0.95, 0.97,
    # 0.63, 0.33]: an upper threshold of 1 makes the damping fall only with it
    "include_damping_in_quad_change": (
        dict(learning_rate=1.0, damping=0.05, adapt_damping=True, damping_adaptation_interval=1,
             include_damping_in_quad_change=True, curvature_ema=0.9,
             damping_upper_threshold=1.0),
        dict(include_damping_in_quad_change=False)),
    "damping_quad_model_exact": (
        dict(learning_rate=1.0, damping=0.05, adapt_damping=True, damping_adaptation_interval=1,
             damping_quad_model="exact", curvature_ema=0.5),
        dict(damping_quad_model="approximate")),
    "qmodel_fixedmu": (dict(momentum_type="qmodel_fixedmu", momentum=0.4, damping=0.2,
                            adapt_damping=True, damping_adaptation_interval=2),
                       dict(momentum_type="qmodel", momentum=None)),
    "qmodel_include_damping": (dict(momentum_type="qmodel", damping=0.05, adapt_damping=True,
                                    damping_adaptation_interval=1, curvature_ema=0.0,
                                    include_damping_in_quad_change=True,
                                    damping_upper_threshold=1.0, damping_lower_threshold=0.2),
                               dict(include_damping_in_quad_change=False)),
    "adam_tf_rule": (dict(momentum_type="adam", learning_rate=0.8, momentum=0.5, damping=0.2,
                          adapt_damping=True, damping_adaptation_interval=1, damping_rule="tf",
                          norm_constraint=0.05, weight_decay=0.1, max_damping=1.0),
                     dict(damping_rule="kfac_jax", norm_constraint=None)),
    "periods_stale_inverse": (dict(learning_rate=0.6, damping=0.1, curvature_ema=0.5,
                                   curvature_update_period=2, inverse_update_period=3,
                                   adapt_damping=True, damping_adaptation_interval=2),
                              dict(curvature_update_period=1, inverse_update_period=1)),
    "approximate_power": (dict(learning_rate=0.6, damping=0.1, exact_power=False,
                               inverse_update_period=2, adapt_damping=True,
                               damping_adaptation_interval=1),
                          dict(exact_power=True)),
    "decay_and_min_damping": (dict(learning_rate=1.0, damping=0.1, adapt_damping=True,
                                   damping_adaptation_interval=2, damping_adaptation_decay=0.8,
                                   min_damping=0.08),
                              dict(damping_adaptation_decay=None, min_damping=1e-8)),
    "empirical_fisher": (dict(learning_rate=0.5, damping=0.1,
                              estimation_mode="fisher_empirical"),
                         dict(estimation_mode="ggn_exact")),
    "ema_style_tf": (dict(learning_rate=0.7, damping=0.1, curvature_ema=0.6, ema_style="tf"),
                     dict(curvature_ema=0.0, ema_style="kfac_jax")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_option_against_the_numpy_optimiser(xp, rng, case):
    options, neutral = CASES[case]
    xs, ys, w0, b0 = (xp.round_host(a) for a in data(rng))
    ys = ys.astype(np.int64)
    kappas, rhos = [], []
    want, want_lam = numpy_kfac(xs, ys, w0, b0, kappas=kappas, rhos=rhos, **options)
    assert max(kappas) < 256  # the conftest budget (see the module docstring)
    # the damping decisions are robust to rounding: every rho is at least 1 % away from a
    # threshold (float32's budget 4096·eps ≈ 5e-4 is far below)
    for thr in (options.get("damping_lower_threshold", 0.25),
                options.get("damping_upper_threshold", 0.75)):
        assert all(abs(r - thr) > 1e-2 * thr for r, _ in rhos), (rhos, thr)
    got_rhos = []
    got, got_lam = kfac_ref_run(xp, xs, ys, w0, b0, rhos=got_rhos, **options)
    tol = STEPS * xp.rtol
    # ρ divides a loss difference by the model change: rounding of the losses is amplified
    # by the cancellation factor |h| / |h_new − h| (below 100 here, asserted)
    if rhos:
        cancel = max(c for _, c in rhos)
        assert cancel < 100
        np.testing.assert_allclose(got_rhos, [r for r, _ in rhos], rtol=cancel * tol)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= tol * scale, np.abs(got - want).max() / scale
    np.testing.assert_allclose(got_lam, want_lam, rtol=tol)
    # the option is not inert: without it the oracle's trajectory differs
    other, other_lam = numpy_kfac(xs, ys, w0, b0, **{**options, **neutral})
    assert (np.abs(other - want).max() > 1e-3 * scale
            or np.abs(other_lam - want_lam).max() > 1e-3 * want_lam.max())


@pytest.mark.parametrize("style", ["kfac_jax", "tf"])
@pytest.mark.parametrize("matrix", ["ggn", "fisher"])
def test_equivalent_options_ema_style_and_quad_model_matrix(rng, style, matrix):
    """``ema_style`` and ``quad_model_matrix`` are equivalent choices (documented in the
    class docstring): the estimator normalises its moving average by its weight, so
    ``(d, 1)`` and ``(d, 1 − d)`` give the same average, and every shipped loss is the
    negative log-likelihood of an exponential family in its natural parameters, so its
    Fisher equals its GGN.  Both runs equal the NumPy optimiser, which has one average and
    one matrix."""
    import array_api_compat.numpy as anp

    class Host:
        def asarray(self, a):
            return anp.asarray(a)

        def to_numpy(self, a):
            return np.asarray(a, dtype=np.float64)

    xs, ys, w0, b0 = data(rng)
    options = dict(momentum_type="qmodel", damping=0.2, curvature_ema=0.7, ema_style=style,
                   quad_model_matrix=matrix, adapt_damping=True, damping_adaptation_interval=1)
    got, got_lam = kfac_ref_run(Host(), xs, ys, w0, b0, **options)
    want, want_lam = numpy_kfac(xs, ys, w0, b0, **options)
    tol = STEPS * 4096 * np.finfo(float).eps  # as in the module docstring, float64
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    np.testing.assert_allclose(got_lam, want_lam, rtol=tol)
