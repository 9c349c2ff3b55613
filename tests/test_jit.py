"""``jax.jit``: the formula functions, every loss's Fisher and GGN factors and products, and the
exact curvature products run traced, and agree with the eager NumPy result.

Inside ``jax.jit`` the arguments are tracers: value checks (finite, 0/1 masks, target ranges,
positive variances) are skipped for them (``kfac_ref._backend.is_lazy``), static checks still
run, and a tracer's device is unknown (``None``), which ``namespace_of`` treats as compatible
with a concrete array the jitted function closes over.  Every test runs with float64 enabled
(``jax_enable_x64``, set by a fixture and restored afterwards) and compares with the same
computation on NumPy float64 arrays at the suite's float64 tolerance, ``4096 · eps``
(see tests/conftest.py): the two are the same formulas on the same numbers, different only by
the order of floating-point operations inside XLA's and NumPy's kernels.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import RTOL_FACTOR, assert_allclose_normwise

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import kfac_ref  # noqa: E402
import kfac_ref.curvature as C  # noqa: E402
import kfac_ref.nn as nn  # noqa: E402
from kfac_ref import KFACTypeError, averaging, linalg  # noqa: E402
from kfac_ref import losses as L  # noqa: E402
from kfac_ref._backend import namespace_of  # noqa: E402

RTOL = RTOL_FACTOR * float(np.finfo(np.float64).eps)


pytestmark = pytest.mark.usefixtures("jax_x64")  # float64 for every test


def _spd(rng, n):
    m = rng.standard_normal((n, n))
    return m @ m.T / n + np.eye(n)


def _check(jitted, eager):
    """A jitted JAX result (array or tuple) equals the eager NumPy one, in float64."""
    if isinstance(eager, tuple):
        assert isinstance(jitted, tuple) and len(jitted) == len(eager)
        for j, e in zip(jitted, eager, strict=True):
            _check(j, e)
        return
    assert isinstance(jitted, jax.Array) and jitted.dtype == jnp.float64
    assert_allclose_normwise(np.asarray(jitted), np.asarray(eager), RTOL)


def _run(fn, *host_args):
    """``jax.jit(fn)`` on JAX copies of the host arrays, and ``fn`` eagerly on NumPy."""
    jitted = jax.jit(fn)(*(jnp.asarray(a) for a in host_args))
    _check(jitted, fn(*host_args))


# -- the formula functions ---------------------------------------------------------------------
LINALG_CASES = {
    "compute_cov": lambda x, a, g, v: kfac_ref.compute_cov(x),
    "compute_cov_normalizer": lambda x, a, g, v: kfac_ref.compute_cov(x, x, normalizer=2.0),
    "damped_matpower": lambda x, a, g, v: linalg.damped_matpower(a, -0.5, 0.1),
    "damped_matpower_exact_inverse": lambda x, a, g, v: linalg.damped_matpower(a, -1.0, 0.1),
    "pi_tracenorm": lambda x, a, g, v: linalg.pi_tracenorm(a, g),
    "pi_adjusted_damping": lambda x, a, g, v: linalg.pi_adjusted_damping(a, g, 0.1),
    "pi_adjusted_damping_avg_fro": lambda x, a, g, v: linalg.pi_adjusted_damping(
        a, g, 0.1, "avg_fro"),
    "kron_damped_inverse_matvec": lambda x, a, g, v: linalg.kron_damped_inverse_matvec(
        a, g, v, 0.1),
    "kron_damped_inverse_matvec_exact_damping": lambda x, a, g, v:
        linalg.kron_damped_inverse_matvec(a, g, v, 0.1, damping_method="exact"),
    "weighted_accumulate": lambda x, a, g, v: averaging.weighted_accumulate(a, a * 2.0, 0.9,
                                                                            0.5),
}


@pytest.mark.parametrize("name", sorted(LINALG_CASES))
def test_formula_functions_under_jit(name, rng):
    args = (rng.standard_normal((6, 3)), _spd(rng, 3), _spd(rng, 2),
            rng.standard_normal((3, 2)))
    _run(LINALG_CASES[name], *args)


def test_compute_cov_with_a_closed_over_concrete_array(rng):
    """A tracer (device unknown) next to a concrete array on the CPU device is accepted."""
    x_host, right_host = rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    right = jnp.asarray(right_host)
    got = jax.jit(lambda x: kfac_ref.compute_cov(x, right))(jnp.asarray(x_host))
    _check(got, kfac_ref.compute_cov(x_host, right_host))


def test_namespace_of_treats_an_unknown_device_as_compatible():
    concrete = jnp.ones(3)
    seen = []

    def f(x):
        seen.append(namespace_of("f", x=x, concrete=concrete))
        return x

    jax.jit(f)(jnp.ones(3))
    assert seen and seen[0] is namespace_of("f", x=concrete)


# -- every loss ----------------------------------------------------------------------------------
def _loss_cases(rng):
    """name -> (build(inputs...) -> loss, host inputs); targets and masks are traced too."""
    z = rng.standard_normal((4, 3)) * 1.5
    y = np.array([0, 2, 1, 2])
    onehot = np.eye(3)[y]
    mask = np.array([1.0, 0.0, 1.0, 1.0])
    bern_t = (rng.random((4, 3)) < 0.5) * 1.0
    mu, var = rng.standard_normal((4, 2)), rng.uniform(0.5, 2.0, (4, 2))
    return {
        "categorical": (lambda z, y, m: L.CategoricalLogitsNegativeLogProbLoss(
            z, y, m, weight=1.7), (z, y, mask)),
        "onehot": (lambda z, t: L.OneHotCategoricalLogitsNegativeLogProbLoss(
            z, t, weight=0.6), (z, onehot)),
        "bernoulli": (lambda z, t: L.MultiBernoulliNegativeLogProbLoss(z, t, weight=0.7),
                      (z, bern_t)),
        "normal_mean": (lambda m, t: L.NormalMeanNegativeLogProbLoss(m, t, variance=0.7,
                                                                     weight=1.3), (z, z + 0.5)),
        "mean_variance": (lambda m, v, t: L.NormalMeanVarianceNegativeLogProbLoss(
            m, v, t, weight=0.9), (mu, var, mu - 0.3)),
    }


LOSS_METHODS = {
    "fisher_factor": lambda loss, u, v: loss.multiply_fisher_factor(u),
    "fisher_factor_unweighted": lambda loss, u, v: loss.multiply_fisher_factor_unweighted(u),
    "fisher_factor_transpose": lambda loss, u, v: loss.multiply_fisher_factor_transpose(v),
    "fisher_factor_one_hot": lambda loss, u, v: loss.multiply_fisher_factor_replicated_one_hot(
        (1,)),
    "fisher": lambda loss, u, v: loss.multiply_fisher(v),
    "ggn_factor": lambda loss, u, v: loss.multiply_ggn_factor(u),
    "ggn_factor_transpose": lambda loss, u, v: loss.multiply_ggn_factor_transpose(v),
    "ggn": lambda loss, u, v: loss.multiply_ggn(v),
    "fisher_factor_matrix": lambda loss, u, v: loss.fisher_factor_matrix(),
    "ggn_matrix": lambda loss, u, v: loss.ggn_matrix(),
    "hessian_matrix": lambda loss, u, v: loss.hessian_matrix(),
    "evaluate": lambda loss, u, v: loss.evaluate(),
    "grad_of_evaluate_sqrt": lambda loss, u, v: loss.grad_of_evaluate(None, "sqrt"),
}


@pytest.mark.parametrize("loss_name", ["categorical", "onehot", "bernoulli", "normal_mean",
                                       "mean_variance"])
def test_every_loss_product_under_jit(loss_name, rng):
    """One jitted function per loss returns every method's result (one compilation)."""
    build, inputs = _loss_cases(rng)[loss_name]
    probe = build(*inputs)
    u = rng.standard_normal(probe.fisher_factor_inner_shape)
    v = tuple(rng.standard_normal(p.shape) for p in probe.params)

    def fn(u, v, *inputs):
        loss = build(*inputs)
        return {name: call(loss, u, v) for name, call in LOSS_METHODS.items()}

    eager = fn(u, v, *inputs)
    jitted = jax.jit(fn)(jnp.asarray(u), tuple(jnp.asarray(a) for a in v),
                         *(jnp.asarray(a) for a in inputs))
    assert set(jitted) == set(LOSS_METHODS)
    for name in LOSS_METHODS:
        _check(jitted[name], eager[name])


def test_traced_weight_and_variance(rng):
    z, t = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    u = rng.standard_normal((3, 4))

    def fn(z, t, w, var, u):
        loss = L.NormalMeanNegativeLogProbLoss(z, t, variance=var, weight=w)
        return loss.multiply_fisher_factor(u), loss.evaluate()

    eager = fn(z, t, np.asarray(1.7), np.asarray(0.8), u)
    jitted = jax.jit(fn)(jnp.asarray(z), jnp.asarray(t), jnp.asarray(1.7), jnp.asarray(0.8),
                         jnp.asarray(u))
    _check(jitted, eager)


def test_static_checks_still_run_under_jit():
    with pytest.raises(kfac_ref.KFACValueError, match="logits must be a 2-D array"):
        jax.jit(lambda z: L.CategoricalLogitsNegativeLogProbLoss(z).fisher_matrix())(
            jnp.ones(3))


# -- the exact curvature of a small network -------------------------------------------------------
def _net_case(rng):
    net = nn.Sequential([("d1", nn.Dense(3, 4)), ("a", nn.Activation("tanh")),
                         ("d2", nn.Dense(4, 3))])
    params = net.init_params(rng, np.zeros(1))
    x = rng.standard_normal((5, 3))
    y = np.array([0, 2, 1, 1, 0])
    vec = rng.standard_normal(net.num_params)
    return net, params, x, y, vec


def _to_jax(tree):
    if isinstance(tree, (tuple, list)):
        return type(tree)(_to_jax(t) for t in tree)
    return jnp.asarray(tree)


EXACT_CASES = {
    "ggn_vector_product": lambda net, p, x, y, v: C.ggn_vector_product(
        net, L.CategoricalLogitsNegativeLogProbLoss, p, (x, y), v),
    "fisher_vector_product": lambda net, p, x, y, v: C.fisher_vector_product(
        net, L.CategoricalLogitsNegativeLogProbLoss, p, (x, y), v),
    "ggn_matrix": lambda net, p, x, y, v: C.ggn_matrix(
        net, L.CategoricalLogitsNegativeLogProbLoss, p, (x, y)),
    "fisher_factor_transpose_product": lambda net, p, x, y, v:
        C.fisher_factor_transpose_product(net, L.CategoricalLogitsNegativeLogProbLoss, p,
                                          (x, y), v),
    "hessian_vector_product": lambda net, p, x, y, v: C.hessian_vector_product(
        net, L.CategoricalLogitsNegativeLogProbLoss, p, (x, y), v),
}


@pytest.mark.parametrize("name", sorted(EXACT_CASES))
def test_exact_curvature_under_jit(name, rng):
    net, params, x, y, vec = _net_case(rng)
    fn = EXACT_CASES[name]
    eager = fn(net, params, x, y, vec)
    jitted = jax.jit(lambda p, x, y, v: fn(net, p, x, y, v))(
        _to_jax(params), jnp.asarray(x), jnp.asarray(y), jnp.asarray(vec))
    _check(jitted, eager)


def test_relative_frobenius_error_under_jit(rng):
    a, b = rng.standard_normal((3, 3)), rng.standard_normal((3, 3))
    _run(C.relative_frobenius_error, a, b)


def test_approximation_report_says_it_cannot_run_under_jit(rng):
    net, params, x, y, _ = _net_case(rng)
    with pytest.raises(KFACTypeError, match=r"^approximation_report: cannot run under "
                                            r"jax\.jit"):
        jax.jit(lambda x: C.approximation_report(
            net, L.CategoricalLogitsNegativeLogProbLoss, params, (x, jnp.asarray(y))))(
            jnp.asarray(x))


# What this module runs under jax.jit, by the names of kfac_ref.capabilities (the
# declarations' "jit" column is checked against these and tests/test_transforms.py).
JIT_EXERCISED = {
    "kfac_ref.losses.CategoricalLogitsNegativeLogProbLoss",
    "kfac_ref.losses.OneHotCategoricalLogitsNegativeLogProbLoss",
    "kfac_ref.losses.MultiBernoulliNegativeLogProbLoss",
    "kfac_ref.losses.NormalMeanNegativeLogProbLoss",
    "kfac_ref.losses.NormalMeanVarianceNegativeLogProbLoss",
    "kfac_ref.curvature.ggn_vector_product",
    "kfac_ref.curvature.fisher_vector_product",
    "kfac_ref.curvature.ggn_matrix",
    "kfac_ref.curvature.fisher_factor_transpose_product",
    "kfac_ref.curvature.hessian_vector_product",
    "kfac_ref.curvature.relative_frobenius_error",
}
JIT_REFUSED = {"kfac_ref.curvature.approximation_report"}

