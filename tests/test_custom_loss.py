"""A user's own loss (:class:`kfac_ref.losses.CustomLoss`, ``CustomNegativeLogProbLoss``,
``AutodiffLoss``).

Oracles: the built-in fixed-variance normal, reimplemented through the three user
functions, must give the built-in's numbers in every estimation mode of the block-diagonal
estimator, in the exact GGN and Fisher, and in one optimiser step (same noise draws, so
equal to rounding); a Huber loss's exact GGN must equal
:math:`\\frac1N\\sum_n J_n^\\top H_n J_n` with :math:`J_n` from central differences of the
network and :math:`H_n` from central differences of the Huber gradient (piecewise linear:
exact away from the kinks); the autodiff square root (torch.func and JAX) must give the
same GGN as the hand-written one.  Bad user functions raise errors naming the function.
"""

from __future__ import annotations

import math

import array_api_compat
import numpy as np
import pytest

import kfac_ref.nn as nn
from kfac_ref import KFACTypeError, KFACValueError, curvature
from kfac_ref import losses as L
from kfac_ref.curvature import ESTIMATION_MODES, BlockDiagonalCurvature
from kfac_ref.optim import KFACOptimizer

VARIANCE, WEIGHT, DELTA = 0.7, 1.3, 0.5


def _normal_functions(n, d):
    """value, gradient, hessian_sqrt and sample of the fixed-variance normal (natural
    parameters: the Hessian is I / v), written as a user would, in the outputs' namespace."""

    def value(f, y):
        xp = array_api_compat.array_namespace(f)
        r = xp.reshape(y - f, (f.shape[0], -1))
        return (xp.sum(r * r, axis=-1) / (2.0 * VARIANCE)
                + 0.5 * r.shape[1] * math.log(2.0 * math.pi * VARIANCE))

    def gradient(f, y):
        return (f - y) / VARIANCE

    def hessian_sqrt(f, y):
        xp = array_api_compat.array_namespace(f)
        eye = xp.eye(d, dtype=f.dtype, device=array_api_compat.device(f))
        return xp.ones((n, 1, 1), dtype=f.dtype, device=array_api_compat.device(f)) * (
            eye / math.sqrt(VARIANCE))

    def sample(f, rng):
        xp = array_api_compat.array_namespace(f)
        z = xp.asarray(rng.standard_normal(tuple(f.shape)), dtype=f.dtype,
                       device=array_api_compat.device(f))
        return f + math.sqrt(VARIANCE) * z

    return value, gradient, hessian_sqrt, sample


def _custom_normal(f, t):
    value, gradient, hessian_sqrt, sample = _normal_functions(*f.shape)
    return L.CustomNegativeLogProbLoss(f, t, value=value, gradient=gradient,
                                       hessian_sqrt=hessian_sqrt, sample=sample,
                                       weight=WEIGHT)


def _builtin_normal(f, t):
    return L.NormalMeanNegativeLogProbLoss(f, t, variance=VARIANCE, weight=WEIGHT)


def _huber_value(f, y):
    xp = array_api_compat.array_namespace(f)
    r = f - y
    a = xp.abs(r)
    return xp.sum(xp.where(a <= DELTA, 0.5 * r * r, DELTA * (a - 0.5 * DELTA)), axis=-1)


def _huber_gradient(f, y):
    xp = array_api_compat.array_namespace(f)
    return xp.clip(f - y, min=-DELTA, max=DELTA)


def _huber_hessian_sqrt(f, y):
    # H_n = diag(1{|r| <= δ}) is its own square root.
    xp = array_api_compat.array_namespace(f)
    inside = xp.astype(xp.abs(f - y) <= DELTA, f.dtype)
    eye = xp.eye(f.shape[1], dtype=f.dtype, device=array_api_compat.device(f))
    return inside[:, :, None] * eye[None, :, :]


def _huber(f, t, weight=1.0):
    return L.CustomLoss(f, t, value=_huber_value, gradient=_huber_gradient,
                        hessian_sqrt=_huber_hessian_sqrt, weight=weight)


class _NumpyBackend:
    """The ``asarray`` of the xp fixture, for the NumPy-only tests."""

    @staticmethod
    def asarray(host):
        return np.asarray(host)


_NP = _NumpyBackend()


def _problem(xp, n=6):
    rng = np.random.default_rng(3)
    net = nn.Sequential([("d1", nn.Dense(3, 5)), ("a", nn.Activation("tanh")),
                         ("d2", nn.Dense(5, 4))])
    params = net.init_params(rng, xp.asarray(np.zeros(1)))
    batch = (xp.asarray(rng.standard_normal((n, 3))), xp.asarray(rng.standard_normal((n, 4))))
    return net, params, batch


# ------------------------------------------------------------------------------------------
# a custom loss equal to a built-in one
# ------------------------------------------------------------------------------------------
def test_custom_normal_products_equal_the_builtin(xp):
    rng = np.random.default_rng(0)
    f, y = xp.asarray(rng.standard_normal((5, 3))), xp.asarray(rng.standard_normal((5, 3)))
    u = xp.asarray(rng.standard_normal((5, 3)))
    c, b = _custom_normal(f, y), _builtin_normal(f, y)
    for name in ("multiply_fisher", "multiply_ggn", "multiply_fisher_unweighted"):
        xp.assert_close(getattr(c, name)((u,))[0], xp.to_numpy(getattr(b, name)((u,))[0]))
    for name in ("multiply_fisher_factor", "multiply_ggn_factor_unweighted"):
        xp.assert_close(getattr(c, name)(u)[0], xp.to_numpy(getattr(b, name)(u)[0]))
    xp.assert_close(c.multiply_ggn_factor_transpose((u,)),
                    xp.to_numpy(b.multiply_ggn_factor_transpose((u,))))
    xp.assert_close(c.multiply_fisher_factor_replicated_one_hot([1])[0],
                    xp.to_numpy(b.multiply_fisher_factor_replicated_one_hot([1])[0]))
    for name in ("fisher_matrix", "ggn_factor_matrix", "hessian_matrix", "evaluate"):
        xp.assert_close(getattr(c, name)(), xp.to_numpy(getattr(b, name)()))
    xp.assert_close(c.grad_of_evaluate(None, "sqrt")[0],
                    xp.to_numpy(b.grad_of_evaluate(None, "sqrt")[0]))
    value, gradient, hessian_sqrt, _ = _normal_functions(5, 3)
    ggn_only = L.CustomLoss(f, y, value=value, gradient=gradient, hessian_sqrt=hessian_sqrt,
                            weight=WEIGHT)
    xp.assert_close(ggn_only.multiply_ggn((u,))[0], xp.to_numpy(b.multiply_ggn((u,))[0]))
    xp.assert_close(ggn_only.ggn_matrix(), xp.to_numpy(b.ggn_matrix()))


@pytest.mark.parametrize("mode", ESTIMATION_MODES)
def test_custom_normal_matches_builtin_in_every_estimation_mode(mode):
    net, params, batch = _problem(_NP)
    dense = []
    for loss_fn in (_custom_normal, _builtin_normal):
        est = BlockDiagonalCurvature(net, loss_fn)
        st = est.init(None, (params, batch))
        st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, 6, np.random.default_rng(7),
                                                  (params, batch), mode)
        dense.append(np.asarray(est.to_dense_matrix(st)))
    np.testing.assert_allclose(dense[0], dense[1], rtol=1e-12, atol=1e-14)
    assert np.abs(dense[1]).max() > 0.0


def test_custom_normal_exact_curvature_and_optimiser_step_equal_the_builtin():
    net, params, batch = _problem(_NP)
    for quantity in (curvature.ggn_matrix, curvature.fisher_matrix, curvature.hessian_matrix):
        np.testing.assert_allclose(quantity(net, _custom_normal, params, batch),
                                   quantity(net, _builtin_normal, params, batch),
                                   rtol=1e-12, atol=1e-14)
    stepped = []
    for loss_fn in (_custom_normal, _builtin_normal):
        est = BlockDiagonalCurvature(net, loss_fn, default_estimation_mode="fisher_gradients")
        opt = KFACOptimizer(net, loss_fn, est, learning_rate=0.5, damping=1e-2,
                            curvature_ema=0.0)
        state = opt.init(params, batch, rng=np.random.default_rng(5))
        new_params, _ = opt.step(state, params, batch, rng=np.random.default_rng(5))
        stepped.append(np.asarray(net.flatten(new_params)))
    np.testing.assert_allclose(stepped[0], stepped[1], rtol=1e-12, atol=1e-14)
    assert np.abs(stepped[0] - np.asarray(net.flatten(params))).max() > 1e-6


# ------------------------------------------------------------------------------------------
# Huber: exact GGN against a dense finite-difference oracle
# ------------------------------------------------------------------------------------------
def _central(fn, x, h):
    """Central differences of fn: R^m -> R^k at x: [k, m]."""
    cols = []
    for j in range(x.size):
        e = np.zeros_like(x)
        e[j] = h
        cols.append((fn(x + e) - fn(x - e)) / (2.0 * h))
    return np.stack(cols, axis=-1)


def test_huber_exact_ggn_matches_finite_differences():
    net, params, (x, y) = _problem(_NP)
    f = np.asarray(net.forward(params, x))
    r = np.abs(f - y)
    assert np.all(np.abs(r - DELTA) > 1e-3)  # away from the kinks
    assert 0 < np.sum(r <= DELTA) < r.size  # both pieces of the loss occur
    theta = np.asarray(net.flatten(params))

    def outputs(t):
        return np.asarray(net.forward(net.unflatten(t), x)).reshape(-1)

    jac = _central(outputs, theta, 1e-6).reshape(6, 4, -1)  # [N, D, P]
    hess = np.stack([_central(lambda fn, yn=yn: _huber_gradient(fn, yn), fn, 1e-6)
                     for fn, yn in zip(f, y, strict=True)])  # [N, D, D]
    oracle = np.einsum("ndp,nde,neq->pq", jac, hess, jac) * 0.8 / 6
    got = curvature.ggn_matrix(net, lambda f, t: _huber(f, t, weight=0.8), params, (x, y))
    np.testing.assert_allclose(got, oracle, rtol=1e-7, atol=1e-9 * np.abs(oracle).max())
    vec = np.random.default_rng(1).standard_normal(theta.size)
    np.testing.assert_allclose(
        curvature.ggn_vector_product(net, lambda f, t: _huber(f, t, weight=0.8), params, (x, y),
                                 vec), got @ vec, rtol=1e-10)


def test_huber_kfac_of_one_example_is_the_exact_ggn():
    # One example through one dense layer: A = ā āᵀ and G = B Bᵀ-weighted g gᵀ sums are
    # exact, so the ggn_exact K-FAC block is the exact GGN (Martens & Grosse 2015, §3).
    rng = np.random.default_rng(8)
    net = nn.Sequential([("d", nn.Dense(3, 4))])
    params = net.init_params(rng, np.zeros(1))
    x, y = rng.standard_normal((1, 3)), rng.standard_normal((1, 4))
    est = BlockDiagonalCurvature(net, _huber)
    st = est.init(None, (params, (x, y)))
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, 1, None, (params, (x, y)),
                                              "ggn_exact")
    want = curvature.ggn_matrix(net, _huber, params, (x, y))
    assert np.abs(want).max() > 0.0
    np.testing.assert_allclose(np.asarray(est.to_dense_matrix(st)), want, rtol=1e-12,
                               atol=1e-14)


@pytest.mark.parametrize("library", ["torch", "jax"])
def test_autodiff_huber_equals_the_hand_written_one(library):
    rng = np.random.default_rng(4)
    f_np, y_np = rng.standard_normal((5, 3)), rng.standard_normal((5, 3))
    if library == "torch":
        torch = pytest.importorskip("torch")
        f, y = torch.asarray(f_np), torch.asarray(y_np)

        def huber(o, t):
            r = o - t
            a = torch.abs(r)
            return torch.sum(torch.where(a <= DELTA, 0.5 * r * r, DELTA * (a - 0.5 * DELTA)))
    else:
        jax = pytest.importorskip("jax")
        jax.config.update("jax_enable_x64", True)
        jnp = jax.numpy
        f, y = jnp.asarray(f_np), jnp.asarray(y_np)

        def huber(o, t):
            r = o - t
            a = jnp.abs(r)
            return jnp.sum(jnp.where(a <= DELTA, 0.5 * r * r, DELTA * (a - 0.5 * DELTA)))
    auto, hand = L.AutodiffLoss(f, y, loss=huber, weight=1.5), _huber(f, y, weight=1.5)
    for name in ("ggn_matrix", "evaluate"):
        np.testing.assert_allclose(np.asarray(getattr(auto, name)()),
                                   np.asarray(getattr(hand, name)()), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(np.asarray(auto.grad_of_evaluate()[0]),
                               np.asarray(hand.grad_of_evaluate()[0]), rtol=1e-12)
    u = rng.standard_normal((5, 3))
    np.testing.assert_allclose(np.asarray(auto.multiply_ggn((_as(f, u),))[0]),
                               np.asarray(hand.multiply_ggn((_as(f, u),))[0]),
                               rtol=1e-12, atol=1e-15)


def _as(like, host):
    xp = array_api_compat.array_namespace(like)
    return xp.asarray(host, dtype=like.dtype)


def test_autodiff_loss_in_the_exact_ggn():
    torch = pytest.importorskip("torch")
    net, params, (x, y) = _problem(_NP)
    tparams = [tuple(torch.asarray(np.asarray(p)) for p in layer) for layer in params]
    tbatch = (torch.asarray(np.asarray(x)), torch.asarray(np.asarray(y)))

    def huber(o, t):
        r = o - t
        a = torch.abs(r)
        return torch.sum(torch.where(a <= DELTA, 0.5 * r * r, DELTA * (a - 0.5 * DELTA)))

    got = curvature.ggn_matrix(net, lambda f, t: L.AutodiffLoss(f, t, loss=huber), tparams,
                           tbatch)
    want = curvature.ggn_matrix(net, _huber, params, (x, y))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------
def _good():
    return dict(value=_huber_value, gradient=_huber_gradient, hessian_sqrt=_huber_hessian_sqrt)


def test_bad_user_functions_give_clear_errors():
    rng = np.random.default_rng(0)
    f, y = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    with pytest.raises(KFACTypeError, match="hessian_sqrt must be a callable"):
        L.CustomLoss(f, y, **{**_good(), "hessian_sqrt": np.eye(3)})
    with pytest.raises(KFACValueError, match=r"hessian_sqrt\(outputs, targets\) must be an "
                                             r"array of shape \(4, 3, \*\)"):
        L.CustomLoss(f, y, **{**_good(), "hessian_sqrt": lambda o, t: np.ones((4, 2, 3))})
    with pytest.raises(KFACValueError, match=r"hessian_sqrt\(outputs, targets\) must be finite"):
        L.CustomLoss(f, y, **{**_good(),
                              "hessian_sqrt": lambda o, t: np.full((4, 3, 2), np.inf)})
    with pytest.raises(KFACTypeError, match=r"hessian_sqrt\(outputs, targets\) must return "
                                            r"an array"):
        L.CustomLoss(f, y, **{**_good(), "hessian_sqrt": lambda o, t: [[1.0]]})
    with pytest.raises(KFACTypeError, match="dtype"):
        L.CustomLoss(f, y, **{**_good(), "hessian_sqrt":
                              lambda o, t: np.ones((4, 3, 1), dtype=np.float32)})
    with pytest.raises(KFACValueError, match="K >= 1"):
        L.CustomLoss(f, y, **{**_good(), "hessian_sqrt": lambda o, t: np.ones((4, 3, 0))})
    loss = L.CustomLoss(f, y, **{**_good(), "value": lambda o, t: o,
                                 "gradient": lambda o, t: np.nan * o})
    with pytest.raises(KFACValueError, match=r"CustomLoss.evaluate: value\(outputs, targets\) "
                                             r"must be an array of shape \(4\)"):
        loss.evaluate()
    with pytest.raises(KFACValueError, match=r"gradient\(outputs, targets\) must be finite"):
        loss.grad_of_evaluate()
    with pytest.raises(KFACValueError, match="targets must have the batch size 4"):
        L.CustomLoss(f, y[:3], **_good())
    with pytest.raises(KFACTypeError, match="sample must be a callable"):
        L.CustomNegativeLogProbLoss(f, y, **_good(), sample=None)
    with pytest.raises(KFACTypeError, match="needs a NegativeLogProbLoss"):
        net, params, batch = _problem(_NP)
        curvature.fisher_matrix(net, _huber, params, batch)


def test_autodiff_loss_rejects_a_nonconvex_loss_and_other_arrays():
    torch = pytest.importorskip("torch")
    f = torch.asarray(np.random.default_rng(0).standard_normal((4, 3)))
    with pytest.raises(KFACValueError, match="positive semi-definite"):
        L.AutodiffLoss(f, None, loss=lambda o, t: -torch.sum(o * o))
    with pytest.raises(KFACTypeError, match="torch tensor or a JAX array"):
        L.AutodiffLoss(np.zeros((4, 3)), None, loss=lambda o, t: o.sum())
    with pytest.raises(KFACTypeError, match="loss must be a callable"):
        L.AutodiffLoss(f, None, loss=3)
