r"""Sampling estimation modes of the block-diagonal estimator: ``fisher_gradients``,
``fisher_curvature_prop`` and ``ggn_curvature_prop`` (kfac-jax's default).

``sampling.kfac`` is the block-diagonal K-FAC matrix (dense [P, P], as ``networks.kfac``) after
one estimator update in a sampling mode.  A sampling mode back-propagates per-example output
vectors :math:`u_n` drawn at random,

=========================  ===============================================================
``fisher_gradients``       :math:`u_n = \sqrt w\,\nabla_f\ell_n(\tilde y_n)`,
                           :math:`\tilde y_n \sim p(\cdot\mid f_n)` — the draws are the
                           sampled targets ``sampled_targets`` (class indices [N] for the
                           categorical loss, values [N, d] for the normal one)
``fisher_curvature_prop``  :math:`u_n = \sqrt w\,B_n r_n` with :math:`B_nB_n^\top = F_n`
``ggn_curvature_prop``     :math:`u_n = \sqrt w\,B_n r_n` with :math:`B_nB_n^\top = G_n`;
                           the draws are the Rademacher signs ``signs`` :math:`r` ±1 in the
                           loss's factor inner shape [N, K]
=========================  ===============================================================

and the output factor of every layer is :math:`G_l = \frac1N\sum_n h_{l,n}h_{l,n}^\top` with
:math:`h_{l,n}` the back-propagated image of :math:`u_n`; the input factors do not depend on
the draws.  The estimate is therefore *linear in* :math:`u_nu_n^\top` and, since
:math:`\mathbb E[u_nu_n^\top] = wF_n` (resp. :math:`wG_n`), its expectation is exactly the
K-FAC matrix of the exact mode (``fisher_exact``, resp. ``ggn_exact``): the sampled G factor
is an unbiased estimate of the exact-mode G, and ``A ⊗ G`` of it an unbiased estimate of the
exact-mode block (``A`` is fixed).

Two routes (:mod:`conformance.sampling`):

* **given draws** — an adapter that lists the capability in ``Adapter.accepts_draws`` gets the
  case's draws as inputs and must return the estimate *for these draws*: compared with the
  ordinary tight tolerance;
* **own draws** — any other adapter is called many times with ``params["seed"]`` and no draws;
  the median of group means is tested entry by entry against the exact expectation with a
  distribution-free false-alarm bound (:func:`conformance.sampling.statistical_check`).

The reference for given draws (:func:`kfac_given_draws`) uses that a mode's estimate depends on
the loss only through :math:`u`: it is the empirical-Fisher K-FAC of the surrogate loss
½‖f − y‖² at the targets :math:`y_n = f_n − u_n` (whose per-example gradient is :math:`u_n`).
The case also carries, as conversion data, the exact mean (``_mean``) and per-entry variance
(``_var``) of one draw's estimate under the mode's distribution (:func:`draw_moments`, exact:
enumeration of the classes, or the closed forms of quadratic forms in Rademacher and Gaussian
variables), which the own-draws route needs.
"""

from __future__ import annotations

import numpy as np

from ..model import SAFETY, Capability, Case, Tolerance, rng_for
from ._data import to_np
from .networks_cases import (
    _CONV,
    _dense,
    _kfac_matrix,
    _layer_geometry,
    _make_inputs,
    _tanh,
    build_net,
    kfac_matrix,
    loss_fn,
    one_update,
    params_from_inputs,
)

REQUIRES = ("kfac_ref.nn", "kfac_ref.curvature", "kfac_ref.losses")

SAMPLING_MODES = ("fisher_gradients", "fisher_curvature_prop", "ggn_curvature_prop")
#: input name of each mode's draws
DRAWS_INPUT = {"fisher_gradients": "sampled_targets", "fisher_curvature_prop": "signs",
               "ggn_curvature_prop": "signs"}
#: the exact mode whose K-FAC matrix each sampling mode estimates without bias
EXACT_MODE = {"fisher_gradients": "fisher_exact", "fisher_curvature_prop": "fisher_exact",
              "ggn_curvature_prop": "ggn_exact"}


def _loss(params, inputs, to_backend):
    net = build_net(params["net"])
    theta = params_from_inputs(params["net"], inputs, to_backend)
    f = net.forward(theta, to_backend(inputs["x"]))
    return net, theta, f, loss_fn(params)(f, to_backend(inputs["targets"]))


def output_vectors(params, inputs, to_backend=lambda v: v):
    """(net, θ, f, u): the mode's per-example output vectors u [N, D] for the case's draws."""
    net, theta, f, loss = _loss(params, inputs, to_backend)
    mode = params["mode"]
    if mode == "fisher_gradients":
        (u,) = loss.grad_of_evaluate(to_backend(inputs["sampled_targets"]), "sqrt")
    elif mode == "fisher_curvature_prop":
        (u,) = loss.multiply_fisher_factor(to_backend(inputs["signs"]))
    elif mode == "ggn_curvature_prop":
        (u,) = loss.multiply_ggn_factor(to_backend(inputs["signs"]))
    else:
        raise ValueError(f"sampling.kfac: params['mode'] must be one of {SAMPLING_MODES}; "
                         f"got {mode!r}")
    return net, theta, f, u


def kfac_given_draws(params, inputs, to_backend=lambda v: v, to_numpy=to_np):
    """Block-diagonal K-FAC (dense [P, P]) of one update in ``params["mode"]`` with the
    case's draws (kfac_ref): the empirical-Fisher K-FAC of ½‖f − y‖² at y = f − u."""
    from kfac_ref import losses
    from kfac_ref.curvature import BlockDiagonalCurvature

    net, theta, f, u = output_vectors(params, inputs, to_backend)
    est = BlockDiagonalCurvature(
        net, lambda out, y: losses.NormalMeanNegativeLogProbLoss(out, y, variance=1.0))
    batch = (to_backend(inputs["x"]), f - u)
    rng = np.random.default_rng(0)  # unused by the empirical mode
    st = est.init(rng, (theta, batch))
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, int(inputs["x"].shape[0]), rng,
                                              (theta, batch), "fisher_empirical")
    return to_numpy(est.to_dense_matrix(st))


def kfac_own_draws(params, inputs, seed, to_backend=lambda v: v, to_numpy=to_np):
    """One estimate with kfac_ref's own sampling (``numpy.random.default_rng(seed)``)."""
    est, st = one_update(params, inputs, to_backend, seed=seed)
    return to_numpy(est.to_dense_matrix(st))


def _with_draws(inputs, mode, draws):
    return {**inputs, DRAWS_INPUT[mode]: draws}


def draw_moments(params, inputs):
    r"""Exact mean and per-entry variance of one draw's estimate, [P, P] each.

    The estimate is a sum over examples of terms that depend on one example's draw only (the
    input factors are fixed, the output factors are sums over examples), so mean and
    variance are sums over examples:

    * categorical ``fisher_gradients``: :math:`\tilde y_n` takes each class c with probability
      :math:`p_{nc}`; with :math:`Z_{nc}` the estimate with example n's draw set to c (the
      others fixed), :math:`\mathrm{Var} = \sum_n \sum_c p_{nc}(Z_{nc} − \bar Z_n)^2`;
    * a quadratic form :math:`X = \sum_n z_n^\top T_n z_n` (per entry) in Rademacher signs
      (curvature propagation; :math:`\mathbb E X = \sum_n \mathrm{tr}\,T_n`,
      :math:`\mathrm{Var}\,X = 4\sum_n\sum_{a<b} T_{n,ab}^2`, the products
      :math:`r_ar_b` being pairwise uncorrelated with unit variance and :math:`r_a^2 = 1`) or
      in standard normal :math:`\varepsilon` (normal ``fisher_gradients``,
      :math:`\tilde y = f + \sqrt v\,\varepsilon`; :math:`\mathrm{Var}\,X = 2\sum_n\sum_{a,b}
      T_{n,ab}^2`); :math:`T_n` by polarisation, :math:`T_{n,aa} = X(e_{na})`,
      :math:`2T_{n,ab} = X(e_{na} + e_{nb}) − X(e_{na}) − X(e_{nb})`.
    """
    mode = params["mode"]
    _, _, f, loss = _loss(params, inputs, lambda v: v)
    f = np.asarray(f, dtype=np.float64)
    n = f.shape[0]
    if mode == "fisher_gradients" and params["loss"] == "categorical":
        z = f - f.max(axis=1, keepdims=True)
        prob = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        base = np.asarray(inputs["sampled_targets"])
        k0 = kfac_given_draws(params, inputs)
        mean, var = -(n - 1) * k0, np.zeros_like(k0)
        for i in range(n):
            zs = []
            for c in range(f.shape[1]):
                y = base.copy()
                y[i] = c
                zs.append(kfac_given_draws(params, _with_draws(inputs, mode, y)))
            zs = np.stack(zs)
            zbar = np.tensordot(prob[i], zs, axes=1)
            mean = mean + zbar
            var = var + np.tensordot(prob[i], (zs - zbar) ** 2, axes=1)
        return mean, var
    if mode == "fisher_gradients":  # normal mean: u = -ε/√v, X quadratic in ε
        sd = np.sqrt(params["variance"])

        def draw(e):
            return f + sd * e
        gaussian = True
        shape = f.shape
    else:
        def draw(e):
            return e
        gaussian = False
        shape = tuple(loss.ggn_factor_inner_shape if mode == "ggn_curvature_prop"
                      else loss.fisher_factor_inner_shape)

    def x_of(e):
        return kfac_given_draws(params, _with_draws(inputs, mode, draw(e)))

    d = int(np.prod(shape[1:]))
    mean, var = 0.0, 0.0
    for i in range(n):
        diag = []
        for a in range(d):
            e = np.zeros((n, d))
            e[i, a] = 1.0
            diag.append(x_of(e.reshape(shape)))
        for a in range(d):
            mean = mean + diag[a]
            if gaussian:
                var = var + 2.0 * diag[a] ** 2
            for b in range(a + 1, d):
                e = np.zeros((n, d))
                e[i, a] = e[i, b] = 1.0
                t_ab = (x_of(e.reshape(shape)) - diag[a] - diag[b]) / 2.0
                var = var + 4.0 * t_ab ** 2
    return mean, var


def _inputs(inputs, case, conv):
    from ..conventions import CANONICAL

    if (case.params["loss"] == "normal_mean" and case.params["mode"] == "fisher_gradients"
            and "sampled_targets" in inputs and conv.mse_variance != CANONICAL.mse_variance):
        raise NotImplementedError("sampled targets of a normal loss drawn under another "
                                  "variance convention are not the same draws")
    return dict(inputs)


CAPABILITIES = [
    Capability(
        "sampling.kfac",
        "Block-diagonal K-FAC (dense [P, P], as networks.kfac) after one estimator update in "
        "the sampling mode params['mode'] (fisher_gradients: sampled targets; "
        "fisher_curvature_prop / ggn_curvature_prop: Rademacher signs through the Fisher / GGN "
        "factor).  Adapters in accepts_draws get the draws (inputs sampled_targets or signs) "
        "and are compared exactly; others are called with params['seed'] and tested "
        "statistically against the exact-mode K-FAC (the estimate's expectation).",
        "inputs: x, targets, w{i}, b{i} and, for adapters that accept draws, sampled_targets "
        "[N] / [N, d] or signs [N, K]; params: net, loss, variance, mode (+ seed without draws)",
        _CONV, convert_inputs=_inputs, convert_output=_kfac_matrix,
        draws=("sampled_targets", "signs")),
]


def draws_from(r, params, inputs):
    """Draws of the mode's distribution from the generator ``r``, consumed as kfac_ref's
    estimator consumes its ``rng``: signs ``r.choice([-1, 1], size=inner shape)``; categorical
    targets by Gumbel-max ``argmax(f + r.gumbel(size=f.shape))``; normal targets
    ``f + √v · r.standard_normal(f.shape)``."""
    mode = params["mode"]
    _, _, f, loss = _loss(params, inputs, lambda v: v)
    f = np.asarray(f, dtype=np.float64)
    if mode != "fisher_gradients":
        shape = tuple(loss.ggn_factor_inner_shape if mode == "ggn_curvature_prop"
                      else loss.fisher_factor_inner_shape)
        return r.choice(np.array([-1.0, 1.0]), size=shape)
    if params["loss"] == "categorical":  # Gumbel-max: argmax(f + g) ~ softmax(f)
        return np.argmax(f + r.gumbel(size=f.shape), axis=1).astype(np.int64)
    return f + np.sqrt(params["variance"]) * r.standard_normal(f.shape)


def build_cases() -> list[Case]:
    tanh = _tanh()
    nets = [
        ("mlp_tanh_n8_ce", [_dense(3, 4), tanh, _dense(4, 3)], (8, 3), {"loss": "categorical"},
         3, SAMPLING_MODES),
        ("deep_linear_n6_mse", [_dense(3, 3), _dense(3, 2)], (6, 3),
         {"loss": "normal_mean", "variance": 0.5}, 2, ("fisher_gradients", "ggn_curvature_prop")),
    ]
    cases = []
    for name, spec, x_shape, lossp, n_out, modes in nets:
        base = _make_inputs(f"sampling/{name}", spec, x_shape, lossp["loss"], n_out)
        p_total = sum(p * q for _, p, q, _, _ in _layer_geometry(spec))
        work = x_shape[0] * int(n_out) + p_total
        for mode in modes:
            cid = f"sampling.kfac/{name}_{mode}"
            params = {"net": spec, **lossp, "mode": mode}
            inputs = _with_draws(base, mode, draws_from(rng_for(cid + "/draws"), params, base))
            expected = kfac_given_draws(params, inputs)
            mean, var = draw_moments(params, inputs)
            exact = kfac_matrix(dict(params, mode=EXACT_MODE[mode]), inputs)
            alts = {"_mean": mean, "_var": var, "_exact": exact,
                    "empirical_fisher": kfac_matrix(params, inputs, mode="fisher_empirical")}
            cases.append(Case(
                cid, "sampling.kfac", inputs, params, expected,
                Tolerance(SAFETY * 4 * work, f"Jacobian products and factor GEMMs: work = N·D + "
                                             f"P = {work}, κ = 1, ×4 for the chain depth"),
                {"N": x_shape[0], "draws": DRAWS_INPUT[mode],
                 "expectation": EXACT_MODE[mode]}, alts,
                f"{mode}, {lossp['loss']}: given draws exact; own draws: expectation = "
                f"{EXACT_MODE[mode]} K-FAC"))
    return cases
