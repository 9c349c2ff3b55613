"""Exact curvature: Hessian/Jacobian products against finite differences, GGN = Jᵀ H_ℓ J densely
from independent loss Hessians, Fisher = GGN for natural-parameter losses, empirical Fisher from
a loop over single-example batches, factor identities, Monte-Carlo convergence with a derived
bound, the Implicit/Explicit estimator classes, error paths.

Finite-difference tolerances
----------------------------
Central differences ``(F(θ + h v) − F(θ − h v)) / 2h`` of float64 maps have error
``h²/6 · max|F'''| + eps64 · max|F| / h``.  With ``h = 1e-4`` and the O(1)-scaled networks here
(third derivatives of tanh/sigmoid/softmax compositions below ~10·|F| per unit direction),
this is ``≲ 2e-8 · max|F|``; ``FD_RTOL = 1e-6`` (norm-wise, relative) leaves a factor ≳ 50.  The
oracles are always float64; a float32 cell's own rounding dominates its error: a forward /
backward / R-pass of depth ≤ 5 and width ≤ 6 chains ~(depth · width) roundings of O(1) numbers
per entry, so ``16 · xp.rtol`` (16 · 4096 · eps32 ≈ 8e-3) bounds it with a wide margin.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import assert_allclose_normwise
from losses_helpers import ce, sq

import kfac_ref.curvature as C
import kfac_ref.nn as nn
from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref.curvature import ExplicitExactCurvature, ImplicitExactCurvature
from kfac_ref.losses import (
    CategoricalLogitsNegativeLogProbLoss,
    MultiBernoulliNegativeLogProbLoss,
    NormalMeanVarianceNegativeLogProbLoss,
)

FD_H = 1e-4
FD_RTOL = 1e-6


def rtol_for(xp, base=None):
    base = xp.rtol if base is None else base
    return base if xp.float64 else max(FD_RTOL, 16 * xp.rtol)


def bern(f, y):
    return MultiBernoulliNegativeLogProbLoss(f, targets=y, weight=0.7)


def mlp(acts=("tanh", "sigmoid")):
    return nn.Sequential([("d1", nn.Dense(3, 4)), ("a1", nn.Activation(acts[0])),
                          ("d2", nn.Dense(4, 4)), ("a2", nn.Activation(acts[1])),
                          ("d3", nn.Dense(4, 3))])


def convnet():
    return nn.Sequential([("c", nn.Conv2D(2, 2, (2, 2), padding="SAME")),
                          ("a", nn.Activation("softplus")), ("s", nn.ScaleAndShift(2)),
                          ("p", nn.MeanPool()), ("d", nn.Dense(2, 3))])


def setup(xp, rng, net, loss, n=4, in_shape=(3,)):
    """Host data, backend data and the float64 rounded host copies."""
    host_x = rng.standard_normal((n, *in_shape))
    host_p = net.init_params(rng, np.zeros(1))
    out_shape = net.output_shape(host_x.shape)
    if loss is ce:
        host_y = rng.integers(0, out_shape[-1], size=n)
    elif loss is bern:
        host_y = rng.integers(0, 2, size=out_shape).astype(np.float64)
    else:
        host_y = rng.standard_normal(out_shape)
    bx, by = xp.asarray(host_x), xp.asarray(host_y)
    bp = tuple(tuple(xp.asarray(a) for a in p) for p in host_p)
    rp = tuple(tuple(xp.round_host(a) for a in p) for p in host_p)
    ry = xp.round_host(host_y) if host_y.dtype.kind == "f" else host_y
    return (bp, bx, by), (rp, xp.round_host(host_x), ry)


def np_loss_hessian(loss, out, y):
    """Independent per-example loss Hessians [N, D, D] for the test losses."""
    n = out.shape[0]
    if loss is ce:
        z = out - out.max(axis=1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        return np.stack([np.diag(p[i]) - np.outer(p[i], p[i]) for i in range(n)])
    if loss is bern:
        s = 1 / (1 + np.exp(-out.reshape(n, -1)))
        return np.stack([0.7 * np.diag(s[i] * (1 - s[i])) for i in range(n)])
    d = out[0].size
    return np.stack([np.eye(d) / 0.5] * n)


CASES = [("mlp_ce", mlp, ce, (3,)), ("mlp_bern", lambda: mlp(("softplus", "tanh")), bern, (3,)),
         ("conv_sq", convnet, sq, (3, 3, 2))]


def fd_along(f, net, params, v):
    """Central difference ``(f(θ + h v) − f(θ − h v)) / 2h`` (h = ``FD_H``) at the flat
    parameters θ of ``params``, ``f`` a host function of (unflattened) parameters."""
    th = np.asarray(net.flatten(params))
    return (f(net.unflatten(th + FD_H * v)) - f(net.unflatten(th - FD_H * v))) / (2 * FD_H)


def loss_gradient(net, loss, x, y):
    """The host function params -> ∇_θ of the loss on (x, y)."""
    return lambda p: np.asarray(C.loss_value_and_grad(net, loss, p, (x, y))[1])


def setup_case(xp, rng, case):
    """A case's net and loss, its data (``setup``), and a random parameter direction v with
    its backend-rounded host copy."""
    _, make, loss, shape = case
    net = make()
    backend, host = setup(xp, rng, net, loss, in_shape=shape)
    v = rng.standard_normal(net.num_params)
    return net, loss, backend, host, v, xp.round_host(v)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_jacobian_and_products_against_fd(xp, rng, case):
    net, loss, (bp, bx, by), (rp, rx, ry), v, rv = setup_case(xp, rng, case)
    fd = fd_along(lambda p: np.asarray(net.forward(p, rx)).reshape(rx.shape[0], -1), net, rp, rv)
    jac = C.jacobian(net, bp, bx)
    xp.check(jac)
    jv = C.jacobian_vector_product(net, bp, bx, xp.asarray(v))
    xp.assert_close(xp.xp.reshape(jv, (rx.shape[0], -1)), fd, rtol=rtol_for(xp, FD_RTOL))
    jnp_ = xp.to_numpy(jac)
    assert_allclose_normwise(jnp_ @ rv, fd, rtol_for(xp, FD_RTOL))
    u = rng.standard_normal(jv.shape)
    jtu = C.jacobian_transpose_vector_product(net, bp, bx, xp.asarray(u))
    ru = xp.round_host(u).reshape(rx.shape[0], -1)
    xp.assert_close(jtu, np.einsum("ndp,nd->p", jnp_, ru), rtol=rtol_for(xp))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hvp_against_fd_of_gradient(xp, rng, case):
    net, loss, (bp, bx, by), (rp, rx, ry), v, rv = setup_case(xp, rng, case)
    fd = fd_along(loss_gradient(net, loss, rx, ry), net, rp, rv)
    hv = C.hessian_vector_product(net, loss, bp, (bx, by), xp.asarray(v))
    xp.assert_close(hv, fd, rtol=rtol_for(xp, FD_RTOL))
    if xp.name == "numpy":  # dense Hessian: P columns of the same pass; symmetric
        h = np.asarray(C.hessian_matrix(net, loss, bp, (bx, by)))
        assert_allclose_normwise(h @ rv, fd, FD_RTOL)
        assert_allclose_normwise(h, h.T, 0)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_ggn_fisher_dense_and_products(xp, rng, case):
    _, make, loss, shape = case
    net = make()
    (bp, bx, by), (rp, rx, ry) = setup(xp, rng, net, loss, in_shape=shape)
    batch = (bx, by)
    jac = np.asarray(C.jacobian(net, rp, rx))  # float64 host Jacobian (FD-checked above)
    out = np.asarray(net.forward(rp, rx))
    hl = np_loss_hessian(loss, out, ry)
    n = rx.shape[0]
    oracle = np.einsum("ndp,nde,neq->pq", jac, hl, jac) / n  # GGN = (1/N) Σ Jᵀ H_ℓ J
    g = C.ggn_matrix(net, loss, *[bp], batch)
    f = C.fisher_matrix(net, loss, bp, batch)
    xp.assert_close(g, oracle, rtol=rtol_for(xp))
    xp.assert_close(f, oracle, rtol=rtol_for(xp))  # natural parameters: F = GGN
    v = rng.standard_normal(net.num_params)
    rv = xp.round_host(v)
    bv = xp.asarray(v)
    xp.assert_close(C.ggn_vector_product(net, loss, bp, batch, bv), oracle @ rv,
                    rtol=rtol_for(xp))
    xp.assert_close(C.fisher_vector_product(net, loss, bp, batch, bv), oracle @ rv,
                    rtol=rtol_for(xp))
    # factors: 𝓑 𝓑ᵀ v = F v, and (𝓑ᵀv)·u = v·(𝓑u)
    for fac, fac_t in ((C.fisher_factor_product, C.fisher_factor_transpose_product),
                       (C.ggn_factor_product, C.ggn_factor_transpose_product)):
        bt = fac_t(net, loss, bp, batch, bv)
        xp.assert_close(fac(net, loss, bp, batch, bt), oracle @ rv, rtol=rtol_for(xp))
        u = rng.standard_normal(bt.shape)
        lhs = float(np.sum(xp.to_numpy(bt) * xp.round_host(u)))
        rhs = float(xp.to_numpy(fac(net, loss, bp, batch, xp.asarray(u))) @ rv)
        assert abs(lhs - rhs) <= rtol_for(xp) * (abs(lhs) + np.abs(rv).sum() * 10)
    # the exact estimation modes reproduce the dense matrices
    xp.assert_close(C.estimated_matrix(net, loss, bp, batch, "ggn_exact"), oracle,
                    rtol=rtol_for(xp))
    xp.assert_close(C.estimated_matrix(net, loss, bp, batch, "fisher_exact"), oracle,
                    rtol=rtol_for(xp))


def test_empirical_fisher_against_single_example_loop(xp, rng):
    net = mlp()
    (bp, bx, by), (rp, rx, ry) = setup(xp, rng, net, ce)
    n = rx.shape[0]
    grads = np.stack([np.asarray(C.loss_value_and_grad(net, ce, rp, (rx[i:i + 1], ry[i:i + 1]))[1])
                      for i in range(n)])
    oracle = grads.T @ grads / n
    ef = C.empirical_fisher_matrix(net, ce, bp, (bx, by))
    xp.assert_close(ef, oracle, rtol=rtol_for(xp))
    xp.assert_close(C.empirical_fisher_matrix(net, ce, bp, (bx, by), normalization="kfac_jax"),
                    oracle / n, rtol=rtol_for(xp))
    xp.assert_close(C.estimated_matrix(net, ce, bp, (bx, by), "fisher_empirical"), oracle,
                    rtol=rtol_for(xp))
    v = rng.standard_normal(net.num_params)
    xp.assert_close(C.empirical_fisher_vector_product(net, ce, bp, (bx, by), xp.asarray(v)),
                    oracle @ xp.round_host(v), rtol=rtol_for(xp))
    xp.assert_close(C.empirical_fisher_vector_product(net, ce, bp, (bx, by), xp.asarray(v),
                                                      normalization="kfac_jax"),
                    oracle @ xp.round_host(v) / n, rtol=rtol_for(xp))
    # the mean-loss gradient is the average of the single-example gradients
    _, g = C.loss_value_and_grad(net, ce, bp, (bx, by))
    xp.assert_close(g, grads.mean(axis=0), rtol=rtol_for(xp))


def test_single_dense_layer_hessian_equals_ggn(xp, rng):
    # f linear in θ ⇒ ∇²f = 0 ⇒ H = GGN exactly (any loss)
    net = nn.Sequential([("d", nn.Dense(3, 4))])
    (bp, bx, by), _ = setup(xp, rng, net, ce)
    h = C.hessian_matrix(net, ce, bp, (bx, by))
    xp.assert_close(h, xp.to_numpy(C.ggn_matrix(net, ce, bp, (bx, by))), rtol=rtol_for(xp))


def test_mean_variance_loss_hessian_and_fisher(xp, rng):
    # a two-input loss: the output [N, 2] is split into mean and variance (softplus > 0)
    net = nn.Sequential([("d1", nn.Dense(2, 3)), ("a", nn.Activation("tanh")),
                         ("d2", nn.Dense(3, 2)), ("sp", nn.Activation("softplus"))])

    def mv(f, y):
        return NormalMeanVarianceNegativeLogProbLoss(f[:, :1], f[:, 1:], targets=y)

    host_x = rng.standard_normal((3, 2))
    host_y = rng.standard_normal((3, 1))
    host_p = net.init_params(rng, np.zeros(1))
    bp = tuple(tuple(xp.asarray(a) for a in p) for p in host_p)
    rp = tuple(tuple(xp.round_host(a) for a in p) for p in host_p)
    rx, ry = xp.round_host(host_x), xp.round_host(host_y)
    batch = (xp.asarray(host_x), xp.asarray(host_y))
    v = rng.standard_normal(net.num_params)
    fd = fd_along(loss_gradient(net, mv, rx, ry), net, rp, xp.round_host(v))
    xp.assert_close(C.hessian_vector_product(net, mv, bp, batch, xp.asarray(v)), fd,
                    rtol=rtol_for(xp, FD_RTOL))
    # Fisher of N(μ, σ²) in (μ, σ²): diag(1/σ², 1/(2σ⁴))
    jac = np.asarray(C.jacobian(net, rp, rx))
    out = np.asarray(net.forward(rp, rx))
    fn = np.stack([np.diag([1 / o[1], 1 / (2 * o[1] ** 2)]) for o in out])
    oracle = np.einsum("ndp,nde,neq->pq", jac, fn, jac) / 3
    xp.assert_close(C.fisher_matrix(net, mv, bp, batch), oracle, rtol=rtol_for(xp))
    # a loss_fn that transforms the outputs instead of splitting them is rejected
    with pytest.raises(KFACValueError, match="unchanged"):
        C.fisher_matrix(net, lambda f, y: NormalMeanVarianceNegativeLogProbLoss(
            f[:, :1], 2.0 * f[:, 1:], targets=y), bp, batch)


# ---------------------------------------------------------------------------------------------
# Monte-Carlo convergence (numpy + one strict backend only: the draws are host-side and
# identical on every backend, the arithmetic is the code path tested above, and the M-sample
# loops are the slowest tests here)
# ---------------------------------------------------------------------------------------------
def _mc_backend(xp):
    if xp.name not in ("numpy", "strict"):
        pytest.skip("Monte-Carlo convergence runs on numpy and strict only (host-side draws "
                    "are identical on every backend; the arithmetic is tested elsewhere)")


@pytest.mark.parametrize("mode", ["fisher_gradients", "fisher_curvature_prop",
                                  "ggn_curvature_prop"])
def test_monte_carlo_modes_converge_at_derived_rate(xp, rng, mode):
    """Chebyshev bound with the exact variance.  One sample per example gives
    ĝ_n = J_nᵀ u_n with E ĝ_nĝ_nᵀ = F̄_n := J_nᵀ F_n J_n, and M independent samples give
    E‖F̂_M − F‖²_F = σ²/M,  σ² = (1/N²) Σ_n E‖ĝ_nĝ_nᵀ − F̄_n‖²_F,
    where the expectation is a finite sum, enumerated here independently of the library:
    sampled classes y with probability p_y, u = p − e_y (fisher_gradients), or Rademacher
    r ∈ {±1}^K with probability 2^-K, u = B r, B = diag(√p) − p√pᵀ (kfac-jax's factor; the
    variance depends on the factor chosen).  P(‖F̂_M − F‖_F > σ/√(δM)) ≤ δ = 0.01; the seed is
    fixed.  At M = 400 the bound is below ‖F‖_F / 2, so a wrong scale (a missing 1/N or 1/√M,
    or w instead of √w: the loss weight is w = 1/4, so that scales F̂ by 1/4) fails."""
    _mc_backend(xp)
    net = mlp()
    w = 0.25

    def wce(f, y):
        return CategoricalLogitsNegativeLogProbLoss(f, targets=y, weight=w)

    (bp, bx, by), (rp, rx, ry) = setup(xp, rng, net, ce, n=3)
    jac = np.asarray(C.jacobian(net, rp, rx))
    out = np.asarray(net.forward(rp, rx))
    hl = w * np_loss_hessian(ce, out, ry)  # the weighted per-example Fisher w·F_n
    n, k = out.shape
    exact = np.einsum("ndp,nde,neq->pq", jac, hl, jac) / n
    z = out - out.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    var = 0.0
    for i in range(n):
        fi = jac[i].T @ hl[i] @ jac[i]
        if mode == "fisher_gradients":
            terms = [(p[i, y], np.sqrt(w) * (p[i] - np.eye(k)[y])) for y in range(k)]
        else:
            b = np.sqrt(w) * (np.diag(np.sqrt(p[i])) - np.outer(p[i], np.sqrt(p[i])))
            terms = [(2.0**-k, b @ np.array(r)) for r in itertools.product([-1.0, 1.0], repeat=k)]
        var += sum(pr * np.linalg.norm(np.outer(jac[i].T @ u, jac[i].T @ u) - fi) ** 2
                   for pr, u in terms)
    var /= n**2
    delta = 0.01
    tile = xp.xp.concat
    for m, copies, per in ((8, 1, 8), (25, 25, 1), (400, 100, 4)):
        # M = copies · per samples per example: the batch is repeated `copies` times (the
        # copies' samples are independent) and each copy draws `per` samples (num_samples)
        batch = (tile([bx] * copies, axis=0), tile([by] * copies, axis=0))
        gen = np.random.default_rng(7)
        if mode == "fisher_gradients" and m == 400:
            est = C.monte_carlo_fisher_matrix(net, wce, bp, batch, gen, per)
        else:
            est = C.estimated_matrix(net, wce, bp, batch, mode, rng=gen, num_samples=per)
        err = float(np.linalg.norm(xp.to_numpy(est) - exact))
        bound = np.sqrt(var / (delta * m))
        assert err <= bound, (m, err, bound)
    assert np.sqrt(var / (delta * 400)) < 0.5 * np.linalg.norm(exact)


@pytest.mark.parametrize("mode", ["fisher_curvature_prop", "ggn_curvature_prop"])
def test_curvature_prop_draws_are_rademacher(xp, rng, mode):
    """For a normal mean with variance v the loss factor is I/√v, so the output vectors times
    √v are the raw draws r: every entry must be exactly ±1 (E rrᵀ = I needs |r| = 1) and their
    mean over K = 1200 entries must be near 0: Var(mean) = 1/K, so by Chebyshev
    P(|mean| > 1/√(δK)) ≤ δ = 0.01 (seed fixed).  A {−1, 0, 1} or {0, 1} draw fails."""
    _mc_backend(xp)
    net = mlp(("identity", "identity"))
    (bp, bx, by), _ = setup(xp, rng, net, sq, n=400)
    (u,) = C.estimation_output_vectors(net, sq, bp, (bx, by), mode,
                                       rng=np.random.default_rng(5))
    r = xp.to_numpy(u) * np.sqrt(0.5)
    assert r.shape == (400, 3)
    np.testing.assert_array_equal(np.abs(r), 1.0)
    assert abs(r.mean()) <= 1 / np.sqrt(0.01 * r.size)


# ---------------------------------------------------------------------------------------------
# estimator classes
# ---------------------------------------------------------------------------------------------
def test_implicit_exact_curvature_matches_functions(xp, rng):
    net = mlp()
    (bp, bx, by), _ = setup(xp, rng, net, ce)
    fa = (bp, (bx, by))
    imp = ImplicitExactCurvature(net, ce)
    v = xp.asarray(rng.standard_normal(net.num_params))
    assert imp.batch_size(fa) == 4
    g = C.ggn_matrix(net, ce, bp, (bx, by))
    xp.assert_close(imp.multiply_ggn(fa, v), xp.to_numpy(g @ v), rtol=rtol_for(xp))
    xp.assert_close(imp.multiply_fisher(fa, v), xp.to_numpy(g @ v), rtol=rtol_for(xp))
    xp.assert_close(imp.multiply_hessian(fa, v),
                    xp.to_numpy(C.hessian_vector_product(net, ce, bp, (bx, by), v)))
    (bt,) = imp.multiply_fisher_factor_transpose(fa, v)
    xp.assert_close(imp.multiply_fisher_factor(fa, (bt,)), xp.to_numpy(g @ v), rtol=rtol_for(xp))
    (gt,) = imp.multiply_ggn_factor_transpose(fa, v)
    xp.assert_close(imp.multiply_ggn_factor(fa, gt), xp.to_numpy(g @ v), rtol=rtol_for(xp))
    ((jv,),) = imp.multiply_jacobian(fa, v)
    xp.assert_close(imp.multiply_jacobian_transpose(fa, ((jv,),)),
                    xp.to_numpy(C.jacobian_transpose_vector_product(net, bp, bx, jv)))
    structured = net.unflatten(v)
    out = imp.multiply_ggn(fa, structured)
    xp.assert_close(net.flatten(out), xp.to_numpy(g @ v), rtol=rtol_for(xp))
    assert imp.get_loss_inner_vector_shapes_and_batch_size(fa, "fisher") == (((4, 3),), 4)
    assert imp.get_loss_input_shapes_and_batch_size(fa) == ((((4, 3),),), 4)


def test_explicit_exact_curvature(xp, rng):
    net = mlp()
    (bp, bx, by), _ = setup(xp, rng, net, ce)
    fa = (bp, (bx, by))
    est = ExplicitExactCurvature(net, ce)
    st = est.init(None, fa)
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, 4, None, fa)
    f = xp.to_numpy(C.fisher_matrix(net, ce, bp, (bx, by)))
    xp.assert_close(est.to_dense_matrix(st), f, rtol=rtol_for(xp))
    # a second update with ema_old = ema_new = 1 averages EF and F
    st2 = est.update_curvature_matrix_estimate(st, 1.0, 1.0, 4, None, fa, "fisher_empirical")
    ef = xp.to_numpy(C.empirical_fisher_matrix(net, ce, bp, (bx, by)))
    xp.assert_close(est.to_dense_matrix(st2), (f + ef) / 2, rtol=rtol_for(xp))
    v = rng.standard_normal(net.num_params)
    lam = 0.3
    w, q = np.linalg.eigh(f)
    oracle = q @ ((np.maximum(w, 0) + lam) ** -1 * (q.T @ xp.round_host(v)))
    got = est.multiply_matpower(st, xp.asarray(v), lam, -1.0)
    xp.assert_close(got, oracle, rtol=rtol_for(xp, 64 * xp.rtol))
    st = est.update_cache(st, lam, None, None, True)
    xp.assert_close(est.multiply_matpower(st, xp.asarray(v), lam, -1.0, use_cached=True),
                    oracle, rtol=rtol_for(xp, 64 * xp.rtol))
    xp.assert_close(est.eigenvalues(st), np.maximum(w, 0), rtol=rtol_for(xp, 64 * xp.rtol))
    # F has rank <= N·(K - 1) = 8 < P: the undamped inverse does not exist, and the cached
    # product must say so as the uncached one does (not return inf/NaN)
    for cached in (False, True):
        with pytest.raises(KFACValueError, match="positive definite"):
            est.multiply_matpower(st, xp.asarray(v), 0.0, -1.0, use_cached=cached)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
def test_errors(xp, rng):
    net = mlp()
    (bp, bx, by), _ = setup(xp, rng, net, ce)
    v = xp.asarray(rng.standard_normal(net.num_params))
    with pytest.raises(KFACValueError, match=r"\[P\]"):
        C.ggn_vector_product(net, ce, bp, (bx, by), xp.asarray(np.zeros(3)))
    with pytest.raises(KFACValueError, match="batch"):
        C.ggn_matrix(net, ce, bp, bx)
    with pytest.raises(KFACValueError, match="targets"):
        C.empirical_fisher_matrix(net, ce, bp, (bx, None))
    with pytest.raises(KFACValueError, match="normalization"):
        C.empirical_fisher_matrix(net, ce, bp, (bx, by), normalization="sum")
    with pytest.raises(KFACTypeError, match="Generator"):
        C.monte_carlo_fisher_matrix(net, ce, bp, (bx, by), rng=0)
    with pytest.raises(KFACValueError, match="num_samples"):
        C.monte_carlo_fisher_matrix(net, ce, bp, (bx, by), rng, num_samples=0)
    with pytest.raises(KFACValueError, match="estimation_mode"):
        C.estimated_matrix(net, ce, bp, (bx, by), "fisher_magic")
    with pytest.raises(KFACTypeError, match="loss_fn"):
        C.ggn_matrix(net, 3, bp, (bx, by))
    with pytest.raises(KFACValueError, match="outputs per example"):
        C.ggn_matrix(net, lambda f, y: sq(f[:, :2], None), bp, (bx, by))
    with pytest.raises(KFACTypeError, match="Sequential"):
        C.jacobian("net", bp, bx)
    with pytest.raises(KFACValueError, match="batch_size"):
        est = ExplicitExactCurvature(net, ce)
        est.update_curvature_matrix_estimate(est.init(None, (bp, (bx, by))), 0.0, 1.0, 5, None,
                                             (bp, (bx, by)))
    with pytest.raises(KFACTypeError, match="Generator"):
        C.estimated_matrix(net, ce, bp, (bx, by), "fisher_gradients", rng=None)
    assert v.shape == (net.num_params,)


# ---------------------------------------------------------------------------------------------
# hypothesis: identities on random small networks
# ---------------------------------------------------------------------------------------------
def test_property_identities(xp):
    """For random widths, batch sizes, activations and weight sharing: the Hessian is
    symmetric through the R-operator (wᵀ H v = vᵀ H w), the GGN is PSD (vᵀ G v ≥ 0) and equals
    its factor product (𝓑 𝓑ᵀ v = G v).  Full 25 examples on numpy; 6 on the other backends
    (their arithmetic is covered by the oracle tests above; this checks the identities on
    shapes the fixed tests do not reach).  Tolerance: every quantity is a sum of O(P·D) products
    of O(1) numbers, so the bound is rtol_for(xp) times the sum of absolute terms."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=25 if xp.name == "numpy" else 6)
    @given(d_in=st.integers(1, 3), hidden=st.integers(1, 3), n=st.integers(1, 3),
           t=st.integers(0, 2), act=st.sampled_from(nn.ACTIVATIONS[:3] + ("softplus",)),
           seed=st.integers(0, 2**16))
    def check(d_in, hidden, n, t, act, seed):
        r = np.random.default_rng(seed)
        net = nn.Sequential([("d1", nn.Dense(d_in, hidden)), ("a", nn.Activation(act)),
                             ("d2", nn.Dense(hidden, 2))])
        shape = (n, t, d_in) if t else (n, d_in)
        x = xp.asarray(r.standard_normal(shape))
        y = xp.asarray(r.standard_normal((*shape[:-1], 2)))
        params = net.init_params(r, x)
        v = xp.asarray(r.standard_normal(net.num_params))
        w = xp.asarray(r.standard_normal(net.num_params))
        hv = xp.to_numpy(C.hessian_vector_product(net, sq, params, (x, y), v))
        hw = xp.to_numpy(C.hessian_vector_product(net, sq, params, (x, y), w))
        vn, wn = xp.to_numpy(v), xp.to_numpy(w)
        scale = np.abs(wn) @ np.abs(hv) + np.abs(vn) @ np.abs(hw) + 1e-300
        assert abs(wn @ hv - vn @ hw) <= rtol_for(xp) * scale
        gv = xp.to_numpy(C.ggn_vector_product(net, sq, params, (x, y), v))
        assert vn @ gv >= -rtol_for(xp) * (np.abs(vn) @ np.abs(gv))
        bt = C.ggn_factor_transpose_product(net, sq, params, (x, y), v)
        bbt = xp.to_numpy(C.ggn_factor_product(net, sq, params, (x, y), bt))
        assert_allclose_normwise(bbt, gv, rtol_for(xp), atol=rtol_for(xp) * 1e-8)

    check()
