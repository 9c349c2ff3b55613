"""kfac_ref.operators.CurvatureOperator: products, dense matrices, the SciPy view and the
spectral quantities of K-FAC, EKFAC, diagonal and full blocks, the block-diagonal estimator
and the exact curvature, against dense oracles built in NumPy.

Oracles.  Kronecker blocks: ``np.kron(A, G)`` of the factors (read from the state, or formed
from the data) in the row-major vec order of ``[W; b]``, damped exactly (``+ λI``) or with
the trace-norm π split (``(A + π√λ I) ⊗ (G + √λ/π I)``); EKFAC: ``Q diag(diag(Qᵀ F Q)) Qᵀ``,
``Q = Q_A ⊗ Q_G``, from per-example gradients; diagonal and full blocks: the second moment of
the per-example gradients; the exact GGN: :func:`kfac_ref.curvature.ggn_matrix`.  Spectral
quantities: ``np.trace``, ``np.linalg.slogdet``, ``np.linalg.eigvalsh`` of the oracle.

Tolerances: ``xp.rtol`` (the data are O(1) with N = 8 rows, so the factors' condition
numbers are small; float32 cells use ``16·xp.rtol`` for products that chain a network's
backward pass, as tests/test_curvature_block_diagonal.py derives); a log-determinant of a
``d × d`` matrix is compared with ``atol = d · xp.rtol`` (each logarithm carries the relative
error of its eigenvalue); the stochastic traces within 10 standard deviations of
Hutchinson's closed-form variance (Chebyshev: probability ≤ 1 %; fixed seeds).
"""

from __future__ import annotations

import numpy as np
import pytest

import kfac_ref.curvature as C
import kfac_ref.nn as nn
from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref.blocks import kfac_jax as kj
from kfac_ref.curvature import BlockDiagonalCurvature
from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss
from kfac_ref.operators import CurvatureOperator

N, D_IN, D_OUT = 8, 3, 3
LAM = 0.2


def tol(xp):
    return xp.rtol if xp.float64 else 16 * xp.rtol


def layer_data(xp, rng):
    a, g = rng.standard_normal((N, D_IN)), rng.standard_normal((N, D_OUT))
    ah, gh = xp.round_host(a), xp.round_host(g)
    ab = np.hstack([ah, np.ones((N, 1))])
    grads = (ab[:, :, None] * gh[:, None, :]).reshape(N, -1)
    return {"inputs": xp.asarray(a), "outputs_grad": xp.asarray(g)}, ab, gh, grads


def updated(block, xp, data):
    st = block.init(xp.asarray(np.zeros(1)))
    return block.update_curvature_matrix_estimate(st, data, 0.0, 1.0, N)


def skip_jax(xp):
    """JAX eager arrays compile every new small operation (seconds per cell for the
    per-column products here); the class is exercised on JAX by the full-block case of
    test_ekfac_diagonal_full_block_operators and by test_operator_errors."""
    if xp.name.startswith("jax"):
        pytest.skip("JAX eager: per-column products compile op by op (slow); the operator is "
                    "exercised on JAX by the full-block and error tests")


def factored(a, g, lam):
    pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
    r = np.sqrt(lam)
    return np.kron(a + pi * r * np.eye(a.shape[0]), g + r / pi * np.eye(g.shape[0]))


def check_spectral(xp, op, m, rtol=None):
    """trace, slogdet, logdet, det and eigenvalues of ``op`` against the dense oracle ``m``."""
    d = m.shape[0]
    xp.assert_close(op.trace(), np.trace(m), rtol=rtol)
    sign, logabs = op.slogdet()
    want_sign, want = np.linalg.slogdet(m)
    assert float(xp.to_numpy(sign)) == want_sign
    xp.assert_close(logabs, want, atol=d * (rtol or xp.rtol))
    xp.assert_close(op.logdet(), want, atol=d * (rtol or xp.rtol))
    xp.assert_close(op.det(), np.linalg.det(m), rtol=d * (rtol or xp.rtol))
    xp.assert_close(xp.xp.sort(op.eigenvalues()), np.linalg.eigvalsh(m), rtol=rtol)


def check_products(xp, rng, op, m, rtol=None):
    d = m.shape[0]
    assert op.shape == (d, d) and op.dtype == xp.dtype and op.symmetric
    v = rng.standard_normal(d)
    x = rng.standard_normal((d, 2))
    vh, xh = xp.round_host(v), xp.round_host(x)
    xp.assert_close(op.matvec(xp.asarray(v)), m @ vh, rtol=rtol)
    xp.assert_close(op.rmatvec(xp.asarray(v)), m.T @ vh, rtol=rtol)
    xp.assert_close(op.matmat(xp.asarray(x)), m @ xh, rtol=rtol)
    xp.assert_close(op @ xp.asarray(v), m @ vh, rtol=rtol)
    xp.assert_close(op.to_dense(), m, rtol=rtol)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "factored"])
def test_kronecker_block_operator(xp, rng, exact):
    skip_jax(xp)
    data, ab, gh, _ = layer_data(xp, rng)
    block = kj.DenseTwoKroneckerFactored(D_IN, D_OUT)
    st = updated(block, xp, data)
    a, g = ab.T @ ab / N, gh.T @ gh / N
    m = (np.kron(a, g) + LAM * np.eye(a.shape[0] * g.shape[0]) if exact
         else factored(a, g, LAM))
    op = CurvatureOperator.from_block(block, st, LAM, exact_power=exact)
    check_products(xp, rng, op, m)
    check_spectral(xp, op, m)
    inv = CurvatureOperator.from_block(block, st, LAM, power=-1.0, exact_power=exact)
    xp.assert_close(inv.to_dense(), np.linalg.inv(m), rtol=16 * xp.rtol)
    xp.assert_close(inv.logdet(), -np.linalg.slogdet(m)[1], atol=m.shape[0] * xp.rtol)
    if not exact:  # kfac-jax's approximate power one may be the exact product
        exact_one = kj.DenseTwoKroneckerFactored(D_IN, D_OUT, approx_power_one="exact")
        op = CurvatureOperator.from_block(exact_one, updated(exact_one, xp, data), LAM,
                                          exact_power=False)
        m = np.kron(a, g) + LAM * np.eye(a.shape[0] * g.shape[0])
        xp.assert_close(op.to_dense(), m)
        check_spectral(xp, op, m)


@pytest.mark.parametrize("family", ["ekfac", "diagonal", "full"])
def test_ekfac_diagonal_full_block_operators(xp, rng, family):
    if family != "full":
        skip_jax(xp)
    data, ab, gh, grads = layer_data(xp, rng)
    f = grads.T @ grads / N
    if family == "ekfac":
        block = kj.DenseEKFAC(D_IN, D_OUT)
        q = np.kron(np.linalg.eigh(ab.T @ ab / N)[1], np.linalg.eigh(gh.T @ gh / N)[1])
        b = (q * np.diag(q.T @ f @ q)) @ q.T
    elif family == "diagonal":
        block, b = kj.DenseDiagonal(D_IN, D_OUT), np.diag(np.diag(f))
    else:
        block, b = kj.DenseFull(D_IN, D_OUT), f
    m = b + LAM * np.eye(b.shape[0])
    op = CurvatureOperator.from_block(block, updated(block, xp, data), LAM)
    rtol = 16 * xp.rtol if family == "ekfac" else None  # two eigenbases compared
    check_products(xp, rng, op, m, rtol)
    check_spectral(xp, op, m, rtol)


def small_net():
    return nn.Sequential([("d1", nn.Dense(3, 3)), ("a1", nn.Activation("tanh")),
                          ("d2", nn.Dense(3, 2))])


def net_data(xp, rng, net):
    x = rng.standard_normal((N, 3))
    y = rng.integers(0, 2, size=N)
    params = tuple(tuple(xp.asarray(a) for a in p) for p in net.init_params(rng, np.zeros(1)))
    return params, (xp.asarray(x), xp.asarray(y))


def test_estimator_operator(xp, rng):
    """The block-diagonal K-FAC operator: the Kronecker blocks of the state's factors, per
    block weights; trace and log-determinant are sums over blocks."""
    skip_jax(xp)
    net = small_net()
    params, batch = net_data(xp, rng, net)
    est = BlockDiagonalCurvature(net, CategoricalLogitsNegativeLogProbLoss)
    st = est.init(None, (params, batch))
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, N, None, (params, batch),
                                              "ggn_exact")
    lams = (0.1, 0.3)
    blocks = []
    for bs, lam in zip(st.blocks_states, lams, strict=True):
        a, g = (xp.to_numpy(s.value) for s in bs.statistics)
        blocks.append(np.kron(a, g) + lam * np.eye(a.shape[0] * g.shape[0]))
    m = np.zeros((est.dim, est.dim))
    start = 0
    for blk in blocks:
        m[start:start + len(blk), start:start + len(blk)] = blk
        start += len(blk)
    op = CurvatureOperator.from_estimator(est, st, lams)
    check_products(xp, rng, op, m, tol(xp))
    check_spectral(xp, op, m, tol(xp))


def test_exact_operator_scipy_and_trace_estimates(xp, rng):
    """The exact GGN matrix-free; the SciPy view (NumPy); Hutchinson and Hutch++ through the
    operator with probes drawn from a Generator."""
    skip_jax(xp)
    net = small_net()
    params, batch = net_data(xp, rng, net)
    loss = CategoricalLogitsNegativeLogProbLoss
    ggn = xp.to_numpy(C.ggn_matrix(net, loss, params, batch))
    op = CurvatureOperator.from_exact(net, loss, params, batch, "ggn")
    check_products(xp, rng, op, ggn, tol(xp))
    xp.assert_close(op.trace(), np.trace(ggn), rtol=tol(xp))
    num = 30
    got = float(xp.to_numpy(op.hutchinson_trace(num, np.random.default_rng(1))))
    std = np.sqrt(2 * (np.sum(ggn**2) - np.sum(np.diag(ggn) ** 2)) / num)
    assert abs(got - np.trace(ggn)) <= 10 * std
    # the GGN of a 2-class softmax over 8 examples has rank <= 8: a sketch of 8 columns is
    # exact (its range is the GGN's), whatever the probes
    est = op.hutchpp_trace(3 * 8, np.random.default_rng(2))
    xp.assert_close(est, np.trace(ggn), rtol=16 * tol(xp))
    if xp.name != "numpy":
        with pytest.raises(KFACTypeError, match="to_scipy: the operator's arrays must be NumPy"):
            op.to_scipy()
        return
    from scipy.sparse.linalg import cg

    damped = CurvatureOperator.from_block(kj.ScaledIdentity([(4,)], scale=2.0),
                                          kj.ScaledIdentity([(4,)]).init(np.zeros(1)), 0.5)
    lin = damped.to_scipy()
    assert lin.shape == (4, 4)
    np.testing.assert_allclose(lin @ np.ones(4), 2.5 * np.ones(4))
    lin = op.to_scipy()
    v = rng.standard_normal(op.shape[0])
    np.testing.assert_allclose(lin.matvec(v), ggn @ v, rtol=0, atol=xp.rtol * np.abs(ggn).max()
                               * np.abs(v).sum())
    np.testing.assert_allclose(lin.rmatvec(v), ggn @ v, rtol=0,
                               atol=xp.rtol * np.abs(ggn).max() * np.abs(v).sum())
    reg = CurvatureOperator.from_exact(net, loss, params, batch, "hessian").to_scipy()
    assert reg.shape == op.shape
    x, info = cg(CurvatureOperator(lambda u: op.matvec(u) + u, params[0][0], op.shape[0])
                 .to_scipy(), v, rtol=1e-12)
    assert info == 0
    np.testing.assert_allclose(ggn @ x + x, v, atol=1e-9)


def test_matvec_operator_low_rank_hutchpp(xp, rng):
    skip_jax(xp)
    d, r = 7, 2
    u = rng.standard_normal((d, r))
    m = xp.round_host(u @ u.T)
    m_d = xp.asarray(m)
    op = CurvatureOperator(lambda v: m_d @ v, m_d, d)
    check_spectral(xp, CurvatureOperator(lambda v: m_d @ v + v, m_d, d), m + np.eye(d))
    got = op.hutchpp_trace(3 * r, np.random.default_rng(3))
    xp.assert_close(got, np.trace(m), atol=d * xp.rtol * np.abs(m).max())
    nonsym = xp.asarray(np.triu(m) + np.eye(d))
    op_ns = CurvatureOperator(lambda v: nonsym @ v, m_d, d, symmetric=False,
                              rmatvec=lambda v: xp.xp.matrix_transpose(nonsym) @ v)
    v = rng.standard_normal(d)
    xp.assert_close(op_ns.rmatvec(xp.asarray(v)),
                    (np.triu(m) + np.eye(d)).T @ xp.round_host(v))
    with pytest.raises(KFACValueError, match="eigenvalues: the operator must be symmetric"):
        op_ns.eigenvalues()


def test_operator_errors(xp, rng):
    data, *_ = layer_data(xp, rng)
    block = kj.DenseTwoKroneckerFactored(D_IN, D_OUT)
    st = updated(block, xp, data)
    with pytest.raises(KFACTypeError, match="from_block: block must be"):
        CurvatureOperator.from_block("block", st)
    with pytest.raises(KFACValueError, match="from_block: identity_weight"):
        CurvatureOperator.from_block(block, st, -1.0)
    with pytest.raises(KFACValueError, match="from_block: power"):
        CurvatureOperator.from_block(block, st, 0.1, power=0.25, exact_power=False)
    op = CurvatureOperator.from_block(block, st, LAM)
    with pytest.raises(KFACValueError, match="matvec: vector"):
        op.matvec(xp.asarray(np.ones(5)))
    with pytest.raises(KFACValueError, match="matmat: matrix"):
        op.matmat(xp.asarray(np.ones(12)))
    with pytest.raises(KFACValueError, match="hutchpp_trace: num_queries"):
        op.hutchpp_trace(2, np.random.default_rng(0))
    with pytest.raises(KFACTypeError, match="hutchinson_trace: rng"):
        op.hutchinson_trace(3, 0)
    with pytest.raises(KFACValueError, match="rmatvec must be given"):
        CurvatureOperator(lambda v: v, xp.asarray(np.ones(2)), 2, symmetric=False)
    with pytest.raises(KFACValueError, match="from_exact: curvature"):
        CurvatureOperator.from_exact(small_net(), None, (), None, "gauss")
    with pytest.raises(KFACTypeError, match="from_exact: net must be"):
        CurvatureOperator.from_exact("net", None, (), None)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "factored"])
def test_conv_block_scale_and_norm_scaled_damping(xp, rng, exact):
    """KFC (scale |T| = 4) with the identity weight scaled by the block's trace norm,
    λ = w·|T|·(tr Ω/d_Ω)(tr Γ/d_Γ); the factored split of λ/|T| (Grosse & Martens 2016)."""
    skip_jax(xp)
    block = kj.Conv2DTwoKroneckerFactored(inputs_shape=(N, 3, 3, 1), kernel_shape=(2, 2, 1, 2),
                                          strides=1, padding="VALID")
    data = {"inputs": xp.asarray(rng.standard_normal((N, 3, 3, 1))),
            "outputs_grad": xp.asarray(rng.standard_normal((N, 2, 2, 2)))}
    st = updated(block, xp, data)
    om, ga = (xp.to_numpy(s.value) for s in st.statistics)
    t, w = 4.0, 0.05
    lam = w * t * (np.trace(om) / om.shape[0]) * (np.trace(ga) / ga.shape[0])
    m = (t * np.kron(om, ga) + lam * np.eye(om.shape[0] * ga.shape[0]) if exact
         else t * factored(om, ga, lam / t))
    op = CurvatureOperator.from_block(block, st, w, exact_power=exact,
                                      norm_to_scale_identity_weight="avg_diag")
    check_products(xp, rng, op, m)
    check_spectral(xp, op, m)


@pytest.mark.parametrize("exact", [False, True], ids=["factored", "exact"])
def test_a_blocks_kernel_error_is_named_by_the_operator(exact):
    """The blocks' product kernels raise unnamed errors; the operator's matvec and to_dense
    put their own name in front, as the block's public method does."""
    block = kj.DenseTwoKroneckerFactored(2, 2, has_bias=False)
    state = block.init(np.zeros(1))  # zero statistics: singular without damping
    op = CurvatureOperator.from_block(block, state, 0.0, power=-1.0, exact_power=exact)
    for call, name in ((lambda: op.matvec(np.ones(4)), "matvec"),
                       (op.to_dense, "to_dense")):
        with pytest.raises(KFACValueError, match=rf"^CurvatureOperator\.{name}: .*singular"):
            call()
    with pytest.raises(KFACValueError,
                       match=r"^DenseTwoKroneckerFactored\.multiply_matpower: .*singular"):
        block.multiply_matpower(state, (np.ones((2, 2)),), 0.0, -1.0, exact, False)
