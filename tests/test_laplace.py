"""kfac_ref.laplace: the Laplace log marginal likelihood and its prior-precision gradient
against dense oracles.

The oracle builds the dense posterior precision :math:`P` of every structure in NumPy
(``np.kron`` of the factors, the EKFAC eigenbasis times its scalings, the diagonal, the
full blocks; block diagonal over the groups), takes ``np.linalg.slogdet`` and evaluates the
evidence formula term by term; the gradient is checked against central finite differences
of the evaluated function, against torch autograd through it, and against the identity
"the gradient of a shared prior precision is the sum of the per-group gradients".

Tolerances.  Factors and blocks have eigenvalues in [0.5, 2] and the prior precisions are
O(1), so :math:`P` is well conditioned (κ ≤ 20).  The evidence sums :math:`n` logarithms of
eigenvalues, each with an absolute error at most the relative error of its eigenvalue
(``xp.rtol``), so it is compared with ``atol = n · xp.rtol``; the gradient sums :math:`n`
reciprocals of eigenvalues ≥ 0.5, compared the same way.  The central difference with step
``h = 1e-4`` has truncation error :math:`h^2 |f'''|/6 \\le 10^{-8}\\,n` here (each log term has
:math:`|\\partial_\\delta^3 \\log\\lambda| \\le 2/\\lambda^3 \\le 16`) and rounding error
:math:`\\epsilon |f| / h \\approx 10^{-11}`, so ``atol = 1e-7 · n`` is a bound, not a fit.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_spd

from kfac_ref import KFACTypeError, KFACValueError, laplace, losses

STRUCTURES = laplace.LAPLACE_STRUCTURES
LOGLIK = -7.25
SHAPES = ((3, 2), (2, 4))  # two groups: W [p, q], p·q parameters


def random_orthogonal(rng, n):
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    return q


def problem(rng, structure):
    """Host data of one problem: per-group MAP parameters and curvature, and each group's
    dense curvature block (the oracle's H_g)."""
    params, curv, dense = [], [], []
    for p, q in SHAPES:
        params.append(rng.standard_normal((p, q)))
        if structure in ("kron", "kron_factored"):
            a, g = random_spd(rng, p, 0.5, 2.0), random_spd(rng, q, 0.5, 2.0)
            curv.append((a, g))
            dense.append(np.kron(a, g))
        elif structure == "ekfac":
            qa, qg = random_orthogonal(rng, p), random_orthogonal(rng, q)
            s = rng.uniform(0.5, 2.0, size=(p, q))
            curv.append((qa, qg, s))
            qk = np.kron(qa, qg)
            dense.append(qk @ np.diag(s.reshape(-1)) @ qk.T)
        elif structure == "diagonal":
            d = rng.uniform(0.5, 2.0, size=(p, q))
            curv.append(d)
            dense.append(np.diag(d.reshape(-1)))
        else:
            h = random_spd(rng, p * q, 0.5, 2.0)
            curv.append(h)
            dense.append(h)
    return params, curv, dense


def dense_precision(structure, curv, dense, deltas, temperature):
    """The dense posterior precision, block diagonal over the groups."""
    s = 1.0 / temperature
    blocks = []
    for c, h, d in zip(curv, dense, deltas, strict=True):
        if structure == "kron_factored":
            a, g = c
            blocks.append(np.kron(np.sqrt(s) * a + np.sqrt(d) * np.eye(len(a)),
                                  np.sqrt(s) * g + np.sqrt(d) * np.eye(len(g))))
        else:
            blocks.append(s * h + d * np.eye(len(h)))
    n = sum(len(b) for b in blocks)
    out, i = np.zeros((n, n)), 0
    for b in blocks:
        out[i:i + len(b), i:i + len(b)] = b
        i += len(b)
    return out


def dense_evidence(structure, params, curv, dense, deltas, temperature, loglik=LOGLIK,
                   means=None):
    """ℓ/T − ½[(θ−μ)ᵀP₀(θ−μ) + log det P − log det P₀] from dense matrices."""
    theta = np.concatenate([p.reshape(-1) for p in params])
    mu = (np.zeros_like(theta) if means is None
          else np.concatenate([m.reshape(-1) for m in means]))
    p0 = np.diag(np.concatenate([np.full(p.size, d) for p, d in
                                 zip(params, deltas, strict=True)]))
    post = dense_precision(structure, curv, dense, deltas, temperature)
    sign, logdet = np.linalg.slogdet(post)
    assert sign == 1.0
    r = theta - mu
    return loglik / temperature - 0.5 * (r @ p0 @ r + logdet - np.linalg.slogdet(p0)[1])


def to_backend(xp, params, curv):
    ps = [xp.asarray(p) for p in params]
    cs = [tuple(xp.asarray(f) for f in c) if isinstance(c, tuple) else xp.asarray(c)
          for c in curv]
    return ps, cs


def n_params():
    return sum(p * q for p, q in SHAPES)


# --------------------------------------------------------------------------------------
# value against the dense oracle, every structure, every backend
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("per_group", [False, True], ids=["scalar", "per_group"])
def test_evidence_against_dense(xp, rng, structure, per_group):
    params, curv, dense = problem(rng, structure)
    deltas = [0.7, 1.9] if per_group else [0.7, 0.7]
    temperature = 1.5
    ps, cs = to_backend(xp, params, curv)
    prior = xp.asarray(np.array(deltas)) if per_group else 0.7
    got = laplace.laplace_log_marginal_likelihood(
        LOGLIK, ps, cs, prior, structure=structure, temperature=temperature)
    want = dense_evidence(structure, [xp.round_host(p) for p in params],
                          [tuple(xp.round_host(f) for f in c) if isinstance(c, tuple)
                           else xp.round_host(c) for c in curv],
                          [xp.round_host(h) for h in dense], deltas, temperature)
    xp.assert_close(got, want, atol=n_params() * xp.rtol)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_gradient_against_dense_trace(xp, rng, structure):
    """∂/∂δ_g = −½[‖θ_g‖² + tr(P_g⁻¹ ∂P_g/∂δ_g) − n_g/δ_g] with the dense P_g."""
    params, curv, dense = problem(rng, structure)
    deltas, temperature = [0.6, 1.3], 0.8
    ps, cs = to_backend(xp, params, curv)
    got = laplace.laplace_log_marginal_likelihood_grad(
        ps, cs, xp.asarray(np.array(deltas)), structure=structure, temperature=temperature)
    want = []
    s = 1.0 / temperature
    for p, c, h, d in zip(params, curv, dense, deltas, strict=True):
        if structure == "kron_factored":
            a, g = c
            ua = np.sqrt(s) * a + np.sqrt(d) * np.eye(len(a))
            ug = np.sqrt(s) * g + np.sqrt(d) * np.eye(len(g))
            post = np.kron(ua, ug)
            dpost = (np.kron(np.eye(len(a)), ug) + np.kron(ua, np.eye(len(g)))) / (
                2 * np.sqrt(d))
        else:
            post = s * h + d * np.eye(len(h))
            dpost = np.eye(len(h))
        trace = np.trace(np.linalg.solve(post, dpost))
        want.append(-0.5 * (np.sum(p * p) + trace - p.size / d))
    xp.assert_close(got, np.array(want), atol=n_params() * xp.rtol)


# --------------------------------------------------------------------------------------
# gradient: finite differences, autograd, sum over groups (float64 NumPy)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("structure", STRUCTURES)
def test_gradient_finite_differences(rng, structure):
    params, curv, _ = problem(rng, structure)
    deltas, temperature, h = np.array([0.6, 1.3]), 2.0, 1e-4

    def f(d):
        return float(laplace.laplace_log_marginal_likelihood(
            LOGLIK, params, curv, d, structure=structure, temperature=temperature))

    grad = laplace.laplace_log_marginal_likelihood_grad(
        params, curv, deltas, structure=structure, temperature=temperature)
    fd = [(f(deltas + h * e) - f(deltas - h * e)) / (2 * h) for e in np.eye(2)]
    np.testing.assert_allclose(grad, fd, rtol=0, atol=1e-7 * n_params())
    # a shared precision: the gradient is the sum over the groups
    shared = laplace.laplace_log_marginal_likelihood_grad(
        params, curv, 0.9, structure=structure, temperature=temperature)
    per = laplace.laplace_log_marginal_likelihood_grad(
        params, curv, np.array([0.9, 0.9]), structure=structure, temperature=temperature)
    assert shared.shape == ()
    np.testing.assert_allclose(shared, np.sum(per), rtol=1e-14 * n_params(), atol=0)
    fd0 = (f(0.9 + h) - f(0.9 - h)) / (2 * h)
    np.testing.assert_allclose(shared, fd0, rtol=0, atol=1e-7 * n_params())


@pytest.mark.parametrize("structure", STRUCTURES)
def test_gradient_matches_torch_autograd(rng, structure):
    """The formula's gradient equals autograd through the evaluated evidence (torch)."""
    torch = pytest.importorskip("torch")
    params, curv, _ = problem(rng, structure)
    ps = [torch.asarray(p) for p in params]
    cs = [tuple(torch.asarray(f) for f in c) if isinstance(c, tuple) else torch.asarray(c)
          for c in curv]
    prior = torch.tensor([0.6, 1.3], dtype=torch.float64, requires_grad=True)
    value = laplace.laplace_log_marginal_likelihood(LOGLIK, ps, cs, prior, structure=structure,
                                                    temperature=0.7)
    (auto,) = torch.autograd.grad(value, prior)
    grad = laplace.laplace_log_marginal_likelihood_grad(ps, cs, prior.detach(),
                                                        structure=structure, temperature=0.7)
    np.testing.assert_allclose(grad.numpy(), auto.numpy(), rtol=1e-12, atol=0)


# --------------------------------------------------------------------------------------
# identities and conventions
# --------------------------------------------------------------------------------------
def test_structures_agree_where_they_coincide(rng):
    """One curvature in four forms: A⊗G as "kron", as its dense block ("full"), as EKFAC
    with its Kronecker eigenbasis and S = a γᵀ, and a diagonal A⊗G as "diagonal"."""
    p, q = SHAPES[0]
    a, g = random_spd(rng, p, 0.5, 2.0), random_spd(rng, q, 0.5, 2.0)
    theta = [rng.standard_normal((p, q))]
    la, qa = np.linalg.eigh(a)
    lg, qg = np.linalg.eigh(g)
    kw = dict(temperature=1.3)
    kron = laplace.laplace_log_marginal_likelihood(LOGLIK, theta, [(a, g)], 0.8, **kw)
    full = laplace.laplace_log_marginal_likelihood(LOGLIK, theta, [np.kron(a, g)], 0.8,
                                                   structure="full", **kw)
    ekfac = laplace.laplace_log_marginal_likelihood(
        LOGLIK, theta, [(qa, qg, np.outer(la, lg))], 0.8, structure="ekfac", **kw)
    tol = 1e-13 * p * q
    np.testing.assert_allclose(full, kron, rtol=0, atol=tol)
    np.testing.assert_allclose(ekfac, kron, rtol=0, atol=tol)
    da, dg = np.diag(la), np.diag(lg)
    kron_d = laplace.laplace_log_marginal_likelihood(LOGLIK, theta, [(da, dg)], 0.8, **kw)
    diag = laplace.laplace_log_marginal_likelihood(LOGLIK, theta, [np.outer(la, lg)], 0.8,
                                                   structure="diagonal", **kw)
    np.testing.assert_allclose(diag, kron_d, rtol=0, atol=tol)
    # a full block inside a Kronecker structure (laplace-torch's bias blocks)
    mixed = laplace.laplace_log_marginal_likelihood(LOGLIK, theta, [np.kron(a, g)], 0.8, **kw)
    np.testing.assert_allclose(mixed, kron, rtol=0, atol=tol)


def test_zero_curvature_is_the_prior(rng):
    """H = 0: P = P₀, the log-determinants cancel and the evidence is ℓ/T − ½δ‖θ‖²."""
    theta = [rng.standard_normal(SHAPES[0])]
    p, q = SHAPES[0]
    for structure, c in (("kron", (np.zeros((p, p)), np.zeros((q, q)))),
                         ("diagonal", np.zeros((p, q))), ("full", np.zeros((p * q,) * 2))):
        got = laplace.laplace_log_marginal_likelihood(LOGLIK, theta, [c], 1.7,
                                                      structure=structure, temperature=2.0)
        np.testing.assert_allclose(got, LOGLIK / 2.0 - 0.5 * 1.7 * np.sum(theta[0] ** 2),
                                   rtol=1e-14, atol=0)


def test_prior_mean_shifts_the_scatter(rng):
    params, curv, dense = problem(rng, "kron")
    means = [rng.standard_normal(p.shape) for p in params]
    got = laplace.laplace_log_marginal_likelihood(LOGLIK, params, curv, np.array([0.5, 1.5]),
                                                  prior_mean=means)
    want = dense_evidence("kron", params, curv, dense, [0.5, 1.5], 1.0, means=means)
    np.testing.assert_allclose(got, want, rtol=0, atol=n_params() * 1e-13)
    got = laplace.laplace_log_marginal_likelihood(LOGLIK, params, curv, 0.5, prior_mean=0.25)
    want = dense_evidence("kron", params, curv, dense, [0.5, 0.5], 1.0,
                          means=[np.full(p.shape, 0.25) for p in params])
    np.testing.assert_allclose(got, want, rtol=0, atol=n_params() * 1e-13)


def test_log_likelihood_from_a_loss(xp, rng):
    """A categorical loss gives ℓ = Σ_n log softmax(z_n)[y_n] (weight ignored)."""
    params, curv, dense = problem(rng, "diagonal")
    z, y = rng.standard_normal((5, 3)), rng.integers(0, 3, size=5)
    loss = losses.CategoricalLogitsNegativeLogProbLoss(
        xp.asarray(z), targets=xp.asarray(y, dtype=xp.xp.int64 if xp.float64
                                          else xp.xp.int32), weight=0.2)
    ps, cs = to_backend(xp, params, curv)
    got = laplace.laplace_log_marginal_likelihood(loss, ps, cs, 0.9, structure="diagonal",
                                                  temperature=1.2)
    zh = xp.round_host(z)
    logp = zh - np.log(np.sum(np.exp(zh), axis=1, keepdims=True))
    loglik = float(np.sum(logp[np.arange(5), y]))
    want = dense_evidence("diagonal", [xp.round_host(p) for p in params],
                          [xp.round_host(c) for c in curv], [xp.round_host(h) for h in dense],
                          [0.9, 0.9], 1.2, loglik=loglik)
    xp.assert_close(got, want, atol=n_params() * xp.rtol)


def test_float32_keeps_dtype_and_matches(rng):
    params, curv, dense = problem(rng, "kron")
    p32 = [p.astype(np.float32) for p in params]
    c32 = [tuple(f.astype(np.float32) for f in c) for c in curv]
    got = laplace.laplace_log_marginal_likelihood(LOGLIK, p32, c32, 0.8, temperature=1.1)
    grad = laplace.laplace_log_marginal_likelihood_grad(p32, c32, 0.8, temperature=1.1)
    assert got.dtype == np.float32 and grad.dtype == np.float32
    want = dense_evidence("kron", [p.astype(np.float64) for p in p32],
                          [tuple(f.astype(np.float64) for f in c) for c in c32],
                          [np.kron(*[f.astype(np.float64) for f in c]) for c in c32],
                          [0.8, 0.8], 1.1)
    eps = float(np.finfo(np.float32).eps)
    np.testing.assert_allclose(got, want, rtol=0, atol=n_params() * 16 * eps * abs(want))


# --------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------
def _ok(rng):
    params, curv, _ = problem(rng, "kron")
    return params, curv


@pytest.mark.parametrize("case, err, match", [
    (lambda p, c: dict(structure="blockwise"), KFACValueError, "structure must be one of"),
    (lambda p, c: dict(params=p[0]), KFACTypeError, "params must be a non-empty list"),
    (lambda p, c: dict(curvature=c[:1]), KFACValueError, "curvature must be a list or tuple "
                                                         "of 2 entries"),
    (lambda p, c: dict(curvature=[c[1], c[0]]), KFACValueError, r"curvature\[0\] must be"),
    (lambda p, c: dict(curvature=[c[0][0], c[1]]), KFACValueError,
     r"curvature\[0\] must be a \[6, 6\] block"),
    (lambda p, c: dict(curvature=[(c[0][0], c[0][1], c[0][1]), c[1]]), KFACTypeError,
     r"curvature\[0\] must be a pair"),
    (lambda p, c: dict(curvature=[(c[0][0], c[0][1] + np.triu(np.ones((2, 2)), 1)), c[1]]),
     KFACValueError, r"curvature\[0\]\[1\] must be a symmetric matrix"),
    (lambda p, c: dict(prior_precision=0.0), KFACValueError, "prior_precision must be "
                                                             "positive"),
    (lambda p, c: dict(prior_precision=np.array([1.0, -1.0])), KFACValueError,
     "prior_precision must be positive"),
    (lambda p, c: dict(prior_precision=np.ones(3)), KFACValueError,
     r"prior_precision must be an array of shape \(2\)"),
    (lambda p, c: dict(temperature=-1.0), KFACValueError, "temperature must be positive"),
    (lambda p, c: dict(prior_precision=[1.0, 2.0]), KFACTypeError,
     r"prior_precision must be a positive number, a 0-D array or a 1-D array \[2\]"),
    (lambda p, c: dict(prior_mean=[p[0]]), KFACValueError, "prior_mean must be a list"),
    (lambda p, c: dict(log_likelihood="nll"), KFACTypeError, "log_likelihood must be a real"),
    (lambda p, c: dict(params=[p[0], np.full(p[1].shape, np.nan)]), KFACValueError,
     r"params\[1\] must be finite"),
])
def test_validation_errors(rng, case, err, match):
    params, curv = _ok(rng)
    kw = dict(log_likelihood=LOGLIK, params=params, curvature=curv, prior_precision=1.0,
              structure="kron", temperature=1.0, prior_mean=0.0)
    kw.update(case(params, curv))
    with pytest.raises(err, match=match):
        laplace.laplace_log_marginal_likelihood(**kw)


def test_validation_errors_other_structures(rng):
    params, curv, _ = problem(rng, "ekfac")
    bad = [(curv[0][0], curv[0][1], curv[0][2].T), curv[1]]
    with pytest.raises(KFACValueError, match=r"curvature\[0\]\[2\] must be an array of shape"):
        laplace.laplace_log_marginal_likelihood_grad(params, bad, structure="ekfac")
    with pytest.raises(KFACValueError, match=r"curvature\[1\] must be an array of 8 entries"):
        laplace.laplace_log_marginal_likelihood_grad(
            params, [np.ones(6), np.ones(7)], structure="diagonal")
    with pytest.raises(KFACValueError, match=r"curvature\[0\] must be a \[6, 6\] block"):
        laplace.laplace_log_marginal_likelihood_grad(
            params, [np.eye(5), np.eye(8)], structure="full")


def test_mixed_namespaces_are_refused(rng):
    torch = pytest.importorskip("torch")
    params, curv = _ok(rng)
    with pytest.raises(KFACTypeError, match="one array namespace"):
        laplace.laplace_log_marginal_likelihood(
            LOGLIK, [params[0], torch.asarray(params[1])], curv)
    loss = losses.CategoricalLogitsNegativeLogProbLoss(torch.zeros((2, 3), dtype=torch.float64),
                                                       targets=torch.tensor([0, 1]))
    with pytest.raises(KFACTypeError, match="one array namespace"):
        laplace.laplace_log_marginal_likelihood(loss, params, curv)
