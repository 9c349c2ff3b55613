"""Hyper-parameters given as 0-D arrays (a damping, a scale, a weight kept on the device or
traced): one of the arrays' own namespace and precision gives the numbers of the Python
float, in their dtype; one of the other precision or of another namespace is refused at the
boundary, with the public function or method and the argument named, instead of turning a
float32 result into float64 or failing inside the array library (``check_scalar(...,
like=...)``).  The math layer (linalg, spectral, block formulas, averaging, factors, TF
blocks) and the models (optimiser, Laplace evidence, losses, exact curvature estimator).

A scalar given to a constructor (``KFACOptimizer``'s options, the estimator's clipping
threshold, a TF block's damping) meets the arrays at the first call that has them, and is
refused there."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from scalar_kinds import REFUSALS, other_namespace, other_precision, own

from kfac_ref import (
    KFACTypeError,
    averaging,
    blocks,
    curvature,
    factors,
    laplace,
    linalg,
    losses,
    nn,
    optim,
    spectral,
)
from kfac_ref.blocks import kfac_jax, tf


# -- the math layer: linalg, spectral, block formulas, averaging, factors, TF blocks ---------
def _spd(n, seed):
    r = np.random.default_rng(seed)
    x = r.standard_normal((n, n))
    return x @ x.T / n + np.eye(n)


_R = np.random.default_rng(3)
_ROWS, _VEC, _X = _R.standard_normal((4, 3)), _R.standard_normal(6), _R.standard_normal((3, 2))
_A, _G, _M, _D = _spd(3, 1), _spd(2, 2), _spd(6, 4), 1.0 + _R.random(6)

# (id, call(xp, s) with s the scalar, scalar value, argument, name of the public function
# or method in the message)
MATH_CALLS = [
    ("damped_matpower", lambda xp, s: linalg.damped_matpower(xp.asarray(_A), -0.5, s), 0.1,
     "damping", "damped_matpower"),
    ("damped_matpower.threshold",
     lambda xp, s: linalg.damped_matpower(xp.asarray(_A), -0.5, 0.1,
                                          eigenvalue_clipping_threshold=s),
     0.01, "eigenvalue_clipping_threshold", "damped_matpower"),
    ("damped_inverse", lambda xp, s: linalg.damped_inverse(xp.asarray(_A), s), 0.1, "damping",
     "damped_inverse"),
    ("damped_cholesky", lambda xp, s: linalg.damped_cholesky(xp.asarray(_A), s), 0.1,
     "damping", "damped_cholesky"),
    ("compute_cov", lambda xp, s: linalg.compute_cov(xp.asarray(_ROWS), normalizer=s), 4.0,
     "normalizer", "compute_cov"),
    ("append_homog", lambda xp, s: linalg.append_homog(xp.asarray(_ROWS), s), 1.0,
     "homog_value", "append_homog"),
    ("pi_adjusted_damping",
     lambda xp, s: linalg.pi_adjusted_damping(xp.asarray(_A), xp.asarray(_G), s)[0], 0.1,
     "damping", "pi_adjusted_damping"),
    ("kron_damped_inverse_matvec",
     lambda xp, s: linalg.kron_damped_inverse_matvec(xp.asarray(_A), xp.asarray(_G),
                                                     xp.asarray(_X), s),
     0.1, "damping", "kron_damped_inverse_matvec"),
    ("kron_eigenvalues",
     lambda xp, s: spectral.kron_eigenvalues(xp.asarray(_A), xp.asarray(_G), s), 0.1,
     "damping", "kron_eigenvalues"),
    ("kron_eigenvalues.scale",
     lambda xp, s: spectral.kron_eigenvalues(xp.asarray(_A), xp.asarray(_G), 0.1, scale=s),
     2.0, "scale", "kron_eigenvalues"),
    ("kronecker_block_matpower",
     lambda xp, s: blocks.kronecker_block_matpower(xp.asarray(_A), xp.asarray(_G),
                                                   xp.asarray(_X), -1.0, s),
     0.1, "damping", "kronecker_block_matpower"),
    ("diagonal_block_matpower",
     lambda xp, s: blocks.diagonal_block_matpower(xp.asarray(_D), xp.asarray(_VEC), -1.0, s),
     0.1, "damping", "diagonal_block_matpower"),
    ("full_block_matpower",
     lambda xp, s: blocks.full_block_matpower(xp.asarray(_M), xp.asarray(_VEC), -1.0, 0.1,
                                              scale=s),
     2.0, "scale", "full_block_matpower"),
    ("scaled_identity_matpower",
     lambda xp, s: blocks.scaled_identity_matpower(xp.asarray(_VEC), -1.0, s), 0.1, "damping",
     "scaled_identity_matpower"),
    ("weighted_accumulate",
     lambda xp, s: averaging.weighted_accumulate(xp.asarray(_A), xp.asarray(_A), s, 1.0), 0.5,
     "old_weight", "weighted_accumulate"),
    ("WeightedMovingAverage.update",
     lambda xp, s: averaging.WeightedMovingAverage.zeros_like(xp.asarray(_A)).update(
         xp.asarray(_A), 0.0, s).value,
     0.5, "ema_new", "WeightedMovingAverage.update"),
    ("naive_diagonal_factor",
     lambda xp, s: factors.naive_diagonal_factor(xp.asarray(_VEC), s), 4.0, "batch_size",
     "naive_diagonal_factor"),
    ("conv_input_sua_factor",
     lambda xp, s: factors.conv_input_sua_factor(xp.asarray(_A), xp.asarray(_A[0]), 4,
                                                 damping=s),
     0.1, "damping", "conv_input_sua_factor"),
    ("FullFB", lambda xp, s: tf.FullFB(xp.asarray(_M), s).multiply_inverse(xp.asarray(_VEC)),
     0.1, "damping", "FullFB"),
    ("FullFB.callable",
     lambda xp, s: tf.FullFB(xp.asarray(_M), lambda: s).multiply_inverse(xp.asarray(_VEC)),
     0.1, "damping", "FullFB"),
    ("KroneckerProductFB",
     lambda xp, s: tf.KroneckerProductFB(xp.asarray(_A), xp.asarray(_G), s,
                                         (3, 2)).multiply_inverse(xp.asarray(_X)),
     0.1, "damping", "KroneckerProductFB"),
    ("KroneckerProductFB.renorm_coeff",
     lambda xp, s: tf.KroneckerProductFB(xp.asarray(_A), xp.asarray(_G), 0.1, (3, 2),
                                         renorm_coeff=s).multiply_inverse(xp.asarray(_X)),
     2.0, "renorm_coeff", "KroneckerProductFB"),
    ("FullFactor.callable", lambda xp, s: _full_factor_inverse(xp, lambda: s), 0.1,
     r"damping_func\(\)", "FullFactor"),
    ("FullFactor.threshold",
     lambda xp, s: factors.FullFactor(4.0, eigenvalue_clipping_threshold=s).update_cov(
         [xp.asarray(_VEC)], ema_decay=0.0).register_matpower(-0.5, 0.1).update_inverses(
         ).get_matpower(-0.5, 0.1),
     0.01, "eigenvalue_clipping_threshold", "FullFactor"),
    ("compute_pi_adjusted_damping",
     lambda xp, s: tf.compute_pi_adjusted_damping(xp.asarray(_A), xp.asarray(_G), s)[0], 0.1,
     "damping", "compute_pi_adjusted_damping"),
    ("FullFB.exp",
     lambda xp, s: tf.FullFB(xp.asarray(_M), 0.1).multiply_matpower(xp.asarray(_VEC), s),
     -0.5, "exp", "FullFB"),
]


# -- the models: optimiser, Laplace evidence, losses, exact curvature estimator -------------
_R2 = np.random.default_rng(5)
_V = _R2.standard_normal((2, 4))
_CG = _V @ _V.T + np.eye(2)  # a 2x2 curvature Gram matrix
_GRAM = _V @ _V.T
_B = _R2.standard_normal(2)
_PRECOND, _GRAD = _R2.standard_normal(6), _R2.standard_normal(6)
_THETA = (_R2.standard_normal((2, 3)), _R2.standard_normal(4))
_FA, _FG = _R2.standard_normal((3, 3)), _R2.standard_normal((2, 2))
_KRON = ((_FA @ _FA.T + np.eye(3)), (_FG @ _FG.T + np.eye(2)))
_DIAG = 1.0 + _R2.random(4)
_LOGITS = _R2.standard_normal((3, 4))


def _gaussian(outputs, targets):
    return losses.NormalMeanNegativeLogProbLoss(outputs, targets, variance=1.0)


def _problem(xp):
    """``(net, params, batch)``: a dense layer and a batch, in the cell's namespace (one
    layer: eager JAX compiles every operation of a step on first use)."""
    rng = np.random.default_rng(0)
    net = nn.Sequential([("d", nn.Dense(3, 2))])
    params = net.init_params(rng, xp.asarray(np.zeros(1)))
    batch = (xp.asarray(rng.standard_normal((6, 3))), xp.asarray(rng.standard_normal((6, 2))))
    return net, params, batch


_BUILT = {}


def _once(xp, build):
    """``build(xp)``, built once per cell (estimates are slow to build on eager JAX; the
    estimators and their states are not changed by the calls under test)."""
    key = (xp.name, build.__name__)
    if key not in _BUILT:
        _BUILT[key] = build(xp)
    return _BUILT[key]


def _explicit(xp, threshold=0.0):
    """``(estimator, state, vector)``: an exact GGN estimate of the dense layer."""
    net, params, batch = _problem(xp)
    est = curvature.ExplicitExactCurvature(net, _gaussian, "ggn_exact",
                                           eigenvalue_clipping_threshold=threshold)
    st = est.init(None, (params, batch))
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, 6, None, (params, batch))
    return est, st, net.flatten(params)


def _kfac(xp):
    net, params, batch = _problem(xp)
    est = curvature.BlockDiagonalCurvature(net, _gaussian, default_estimation_mode="ggn_exact")
    st = est.init(None, (params, batch))
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, 6, None, (params, batch))
    return est, st, net.flatten(params)


def _direction(xp, estimator, damping):
    est, st, g = _once(xp, estimator)
    return optim.preconditioned_direction(est, st, g, damping)


def _update(xp, ema_old, ema_new):
    net, params, batch = _problem(xp)
    est = curvature.ExplicitExactCurvature(net, _gaussian, "ggn_exact")
    st = est.init(None, (params, batch))
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, 6, None, (params, batch))
    st = est.update_curvature_matrix_estimate(st, ema_old, ema_new, 6, None, (params, batch))
    return est.to_dense_matrix(st)


def _adapt(xp, **kw):
    # rho = 4 > 3/4: the damping falls to omega * damping, then the clipping applies
    args = dict(damping=0.1, loss=xp.asarray(1.0), new_loss=xp.asarray(0.6),
                quad_change=xp.asarray(-0.1), omega=0.5, min_damping=0.01)
    args.update(kw)
    return optim.adapt_damping(**args)[0]


def _groups(xp):
    """Two parameter groups: Kronecker factors for the first, a full block for the second."""
    return ([xp.asarray(t) for t in _THETA],
            [tuple(xp.asarray(f) for f in _KRON), xp.asarray(np.diag(_DIAG))])


def _evidence(xp, log_likelihood=-3.0, prior_precision=0.5, temperature=1.0, prior_mean=0.0):
    """The evidence and its gradient in the prior precision."""
    params, curv = _groups(xp)
    ll, pp, t, m = log_likelihood, prior_precision, temperature, prior_mean
    value = laplace.laplace_log_marginal_likelihood(ll, params, curv, pp, temperature=t,
                                                    prior_mean=m)
    grad = laplace.laplace_log_marginal_likelihood_grad(params, curv, pp, temperature=t,
                                                        prior_mean=m)
    return xp.xp.stack([value, grad])


MODEL_CALLS = [
    ("quadratic_model.damping",
     lambda xp, s: optim.quadratic_model(xp.asarray(_CG), xp.asarray(_GRAM), xp.asarray(_B),
                                         s)[0][0], 0.3, "damping", "quadratic_model"),
    ("quadratic_model.fixed",
     lambda xp, s: optim.quadratic_model(xp.asarray(_CG), xp.asarray(_GRAM), xp.asarray(_B),
                                         0.3, fixed_coefficients=(None, s))[0][0], 0.5,
     r"fixed_coefficients\[1\]", "quadratic_model"),
    ("adapt_damping.damping", lambda xp, s: _adapt(xp, damping=s), 0.1, "damping",
     "adapt_damping"),
    ("adapt_damping.omega", lambda xp, s: _adapt(xp, omega=s), 0.5, "omega", "adapt_damping"),
    ("adapt_damping.upper_threshold", lambda xp, s: _adapt(xp, upper_threshold=s), 0.75,
     "upper_threshold", "adapt_damping"),
    ("adapt_damping.min_damping", lambda xp, s: _adapt(xp, min_damping=s), 0.08,
     "min_damping", "adapt_damping"),
    ("adapt_damping.max_damping", lambda xp, s: _adapt(xp, damping=1.0, max_damping=s), 0.2,
     "max_damping", "adapt_damping"),
    ("norm_constraint_coefficient.learning_rate",
     lambda xp, s: optim.norm_constraint_coefficient(xp.asarray(_PRECOND), xp.asarray(_GRAD), s,
                                                     0.01)[0], 0.5, "learning_rate",
     "norm_constraint_coefficient"),
    ("norm_constraint_coefficient.norm_constraint",
     lambda xp, s: optim.norm_constraint_coefficient(xp.asarray(_PRECOND), xp.asarray(_GRAD), 0.5,
                                                     s)[0], 0.01, "norm_constraint",
     "norm_constraint_coefficient"),
    ("preconditioned_direction.exact", lambda xp, s: _direction(xp, _explicit, s), 0.1,
     "damping", "preconditioned_direction"),
    ("preconditioned_direction.kfac", lambda xp, s: _direction(xp, _kfac, s), 0.1,
     "damping", "preconditioned_direction"),
    ("laplace.prior_precision", lambda xp, s: _evidence(xp, prior_precision=s), 0.5,
     "prior_precision", "laplace_log_marginal_likelihood"),
    ("laplace.temperature", lambda xp, s: _evidence(xp, temperature=s), 2.0, "temperature",
     "laplace_log_marginal_likelihood"),
    ("laplace.prior_mean", lambda xp, s: _evidence(xp, prior_mean=s), 0.3, "prior_mean",
     "laplace_log_marginal_likelihood"),
    ("laplace.log_likelihood", lambda xp, s: _evidence(xp, log_likelihood=s), -3.0,
     "log_likelihood", "laplace_log_marginal_likelihood"),
    ("ExplicitExactCurvature.identity_weight",
     lambda xp, s: (lambda e, st, v: e.multiply_matpower(st, v, s, -1.0))(
         *_once(xp, _explicit)),
     0.1, "identity_weight", "ExplicitExactCurvature.multiply_matpower"),
    ("ExplicitExactCurvature.power",
     lambda xp, s: (lambda e, st, v: e.multiply_matpower(st, v, 0.1, s))(
         *_once(xp, _explicit)),
     -0.5, "power", "ExplicitExactCurvature.multiply_matpower"),
    ("ExplicitExactCurvature.threshold",
     lambda xp, s: (lambda e, st, v: e.multiply_matpower(st, v, 0.0, -1.0))(
         *_explicit(xp, threshold=s)), 0.5, "eigenvalue_clipping_threshold",
     "ExplicitExactCurvature.multiply_matpower"),
    ("ExplicitExactCurvature.ema_old", lambda xp, s: _update(xp, s, 1.0), 0.5, "ema_old",
     "ExplicitExactCurvature.update_curvature_matrix_estimate"),
    ("ExplicitExactCurvature.ema_new", lambda xp, s: _update(xp, 0.5, s), 2.0, "ema_new",
     "ExplicitExactCurvature.update_curvature_matrix_estimate"),
    ("CategoricalLogits.weight",
     lambda xp, s: losses.CategoricalLogitsNegativeLogProbLoss(
         xp.asarray(_LOGITS), weight=s).multiply_ggn((xp.asarray(_LOGITS),))[0], 1.7,
     "weight", "CategoricalLogitsNegativeLogProbLoss"),
    ("NormalMean.variance",
     lambda xp, s: losses.NormalMeanNegativeLogProbLoss(
         xp.asarray(_LOGITS), xp.asarray(_LOGITS + 1.0), variance=s).evaluate(), 0.8,
     "variance", "NormalMeanNegativeLogProbLoss"),
]


CALLS = MATH_CALLS + MODEL_CALLS
_IDS = [case[0] for case in CALLS]


@pytest.mark.parametrize(("case", "call", "value", "arg", "func"), CALLS, ids=_IDS)
def test_a_0d_scalar_of_the_arrays_kind_gives_the_numbers_of_the_float(xp, case, call, value,
                                                                       arg, func):
    want = call(xp, value)
    got = call(xp, own(xp, value))
    assert got.dtype == want.dtype == xp.dtype
    np.testing.assert_allclose(xp.to_numpy(got), xp.to_numpy(want),
                               rtol=1e-12 if xp.float64 else 1e-5)


@pytest.mark.parametrize("kind", sorted(REFUSALS))
@pytest.mark.parametrize(("case", "call", "value", "arg", "func"), CALLS, ids=_IDS)
def test_a_0d_scalar_of_another_kind_is_refused(xp, kind, case, call, value, arg, func):
    make, message = REFUSALS[kind]
    with pytest.raises(KFACTypeError, match=rf"^{func}[.:].*" + message.format(arg=arg)):
        call(xp, make(xp, value))


def _full_factor_inverse(xp, s):
    """A TF-style factor's registered damped inverse, the damping a 0-D array."""
    f = factors.FullFactor(4.0).update_cov([xp.asarray(_VEC)], ema_decay=0.0)
    return f.register_inverse(s).update_inverses().get_inverse(s)


def test_a_factor_registers_an_array_damping_as_a_callable(xp):
    # registrations are keys compared by value: a bare array is refused, with the remedy
    f = factors.FullFactor(4.0).update_cov([xp.asarray(_VEC)], ema_decay=0.0)
    with pytest.raises(KFACTypeError, match=r"^FullFactor\.register_matpower: damping must be "
                                            r"a real number or a zero-argument callable; got "
                                            r"a 0-D .*\(lambda: damping\)"):
        f.register_inverse(xp.asarray(np.asarray(0.1)))


@pytest.mark.usefixtures("jax_x64")
def test_a_python_number_traced_by_jit_takes_the_arrays_precision():
    # inside jax.jit a Python-number argument is a weakly typed float64 tracer: like the
    # number, it adopts the float32 arrays' precision, so it is not refused
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(_A, dtype=jnp.float32)
    got = jax.jit(lambda d: linalg.damped_inverse(a, d))(0.1)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(linalg.damped_inverse(a, 0.1)),
                               rtol=1e-5)
    with pytest.raises(KFACTypeError, match=r"^damped_inverse: damping must have the floating "
                                            r"dtype of matrix \(float32\); got float64"):
        jax.jit(lambda d: linalg.damped_inverse(a, d))(jnp.asarray(0.1, dtype=jnp.float64))


def test_prior_arrays_of_the_other_precision_are_refused(xp):
    # the per-group prior precision and prior means enter the same sums as the scalars
    params, curv = _groups(xp)
    with pytest.raises(KFACTypeError, match=r"^laplace_log_marginal_likelihood_grad: "
                                            r"prior_precision must have the floating dtype"):
        laplace.laplace_log_marginal_likelihood_grad(
            params, curv, other_precision(xp, [0.5, 2.0]))
    means = [xp.asarray(np.zeros(t.shape)) for t in _THETA]
    means[1] = other_precision(xp, np.zeros(4))
    with pytest.raises(KFACTypeError, match=r"^laplace_log_marginal_likelihood_grad: "
                                            r"prior_mean\[1\] must have the floating dtype"):
        laplace.laplace_log_marginal_likelihood_grad(params, curv, 0.5, prior_mean=means)


# -- KFACOptimizer: the constructor's options meet the parameters at init and step ----------
_REGULAR = dict(learning_rate=0.3, momentum=0.5, damping=0.2, adapt_damping=True,
                damping_adaptation_interval=1, damping_adaptation_decay=0.9,
                damping_lower_threshold=0.2, damping_upper_threshold=0.8, min_damping=1e-3,
                max_damping=10.0, precon_damping_mult=1.5, norm_constraint=0.01,
                weight_decay=1e-3, curvature_ema=0.9)
_QMODEL = dict(momentum_type="qmodel_fixedmu", momentum=0.5, damping=0.2)
_OPTIONS = [k for k, v in _REGULAR.items() if type(v) is float]


def _steps(xp, options, n=2):
    """The parameters and damping after ``n`` steps of the dense layer's optimiser."""
    net, params, batch = _problem(xp)
    opt = optim.KFACOptimizer(net, _gaussian, curvature.ExplicitExactCurvature(
        net, _gaussian, "ggn_exact"), inverse_update_period=1, **options)
    state = opt.init(params, batch)
    for _ in range(n):
        params, state = opt.step(state, params, batch)
    return net.flatten(params), state.damping


@pytest.mark.parametrize("options", [_REGULAR, _QMODEL], ids=["regular", "qmodel_fixedmu"])
def test_optimizer_options_as_0d_arrays_give_the_steps_of_the_floats(xp, options):
    want = _steps(xp, options)
    got = _steps(xp, {k: own(xp, v) if type(v) is float else v for k, v in options.items()})
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == xp.dtype
        np.testing.assert_allclose(xp.to_numpy(g), xp.to_numpy(w),
                                   rtol=1e-10 if xp.float64 else 1e-4)


@pytest.mark.parametrize("option", _OPTIONS)
@pytest.mark.parametrize("other", ["precision", "namespace"])
def test_an_optimizer_option_of_another_kind_is_refused_at_init(xp, option, other):
    s = (other_precision if other == "precision" else other_namespace)(xp, _REGULAR[option])
    net, params, batch = _problem(xp)
    opt = optim.KFACOptimizer(net, _gaussian, curvature.ExplicitExactCurvature(
        net, _gaussian, "ggn_exact"), **{**_REGULAR, option: s})
    want = (rf"{option} must have the floating dtype of params" if other == "precision" else
            rf"all arrays must come from one array namespace; .* but {option} is from")
    with pytest.raises(KFACTypeError, match=rf"^KFACOptimizer\.init: .*{want}"):
        opt.init(params, batch)


def test_a_state_damping_of_another_kind_is_refused_at_step(xp):
    net, params, batch = _problem(xp)
    opt = optim.KFACOptimizer(net, _gaussian, curvature.ExplicitExactCurvature(
        net, _gaussian, "ggn_exact"), learning_rate=0.1)
    state = opt.init(params, batch)
    with pytest.raises(KFACTypeError, match=r"^KFACOptimizer\.step: state\.damping must have "
                                            r"the floating dtype of params"):
        opt.step(dataclasses.replace(state, damping=other_precision(xp, 0.1)), params, batch)
    with pytest.raises(KFACTypeError, match=r"^KFACOptimizer\.step: all arrays must come from "
                                            r"one array namespace; .* but "
                                            r"state\.preconditioner_damping is from"):
        opt.step(dataclasses.replace(state, preconditioner_damping=other_namespace(xp, 0.1)),
                 params, batch)


@pytest.mark.parametrize("kind", sorted(REFUSALS))
@pytest.mark.parametrize(("make", "arg"), [
    (lambda s: kfac_jax.DenseFull(3, 2, eigenvalue_clipping_threshold=s),
     "eigenvalue_clipping_threshold"),
    (lambda s: kfac_jax.ScaledIdentity([(3,)], scale=s), "scale"),
], ids=["threshold", "scaled_identity_scale"])
def test_a_kfac_jax_blocks_0d_option_meets_the_state_at_init(xp, kind, make, arg):
    # the constructor sees no array; init, which fixes the state's kind, checks the option
    like = xp.asarray(np.zeros(()))
    block = make(own(xp, 0.5))
    assert block.init(like).like.dtype == like.dtype
    make_scalar, message = REFUSALS[kind]
    block = make(make_scalar(xp, 0.5))
    with pytest.raises(KFACTypeError, match=rf"^{type(block).__name__}\.init: "
                                            + message.format(arg=arg)):
        block.init(like)


def test_normalize_damping_takes_0d_arrays_of_one_kind(xp):
    # no arrays to meet: the 0-D scalars must agree with each other
    got = blocks.normalize_damping(own(xp, 0.8), 4.0, own(xp, 1.0))
    assert got.dtype == xp.dtype
    np.testing.assert_allclose(float(xp.to_numpy(got)), 0.2, rtol=1e-6)
    for make, message in REFUSALS.values():
        with pytest.raises(KFACTypeError, match=r"^normalize_damping: .*"
                                                + message.format(arg="num_replications")):
            blocks.normalize_damping(own(xp, 0.8), make(xp, 4.0))

