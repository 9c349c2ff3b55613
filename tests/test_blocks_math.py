"""Formula functions of kfac_ref.blocks against dense NumPy oracles (eigh of explicit kron)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_allclose_normwise, random_spd
from hypothesis import given
from hypothesis import strategies as st

from kfac_ref import KFACTypeError, KFACValueError, blocks, kron_damped_matpower_matvec

POWERS = [-1.0, -0.5, 0.5, 1.0, 2.0]


def dense_power(m, p):
    """Oracle: power of a symmetric PSD matrix through numpy eigh."""
    s, q = np.linalg.eigh((m + m.T) / 2)
    return (q * np.clip(s, 0, None) ** p) @ q.T


def pi_split(a, g, lam):
    """Oracle π split with the trace norm (1-D inputs are diagonals)."""
    ta = np.sum(a) if a.ndim == 1 else np.trace(a)
    tg = np.sum(g) if g.ndim == 1 else np.trace(g)
    pi = 1.0 if ta == 0 or tg == 0 else np.sqrt((ta / a.shape[0]) / (tg / g.shape[0]))
    return pi * np.sqrt(lam), np.sqrt(lam) / pi


def as_mat(f):
    return np.diag(f) if f.ndim == 1 else f


# Conditioning: factor eigenvalues in [0.5, 2] ⇒ kron condition number <= 16; dense size <= 12;
# powers |p| <= 2 at most square the condition number (256), so n·κ <= 12·256 < 4096 = the
# fixture's rtol factor.
@pytest.mark.parametrize("power", POWERS)
@pytest.mark.parametrize("damping", [0.0, 0.3])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("diag", ["none", "a", "g"])
def test_kronecker_block_matpower_vs_dense(xp, rng, power, damping, exact, diag):
    p, q, scale = 4, 3, 2.5
    a = random_spd(rng, p, 0.5, 2.0)
    g = random_spd(rng, q, 0.5, 2.0)
    if diag == "a":
        a = rng.uniform(0.5, 2.0, p)
    if diag == "g":
        g = rng.uniform(0.5, 2.0, q)
    x = rng.standard_normal((p, q))
    ah, gh, xh = xp.round_host(a), xp.round_host(g), xp.round_host(x)
    got = blocks.kronecker_block_matpower(xp.asarray(a), xp.asarray(g), xp.asarray(x), power,
                                          damping, scale=scale, exact=exact)
    if exact:
        dense = scale * np.kron(as_mat(ah), as_mat(gh)) + damping * np.eye(p * q)
    else:
        da, dg = pi_split(ah, gh, damping / scale)
        dense = scale * np.kron(as_mat(ah) + da * np.eye(p), as_mat(gh) + dg * np.eye(q))
    expected = (dense_power(dense, power) @ xh.reshape(-1)).reshape(p, q)
    xp.assert_close(got, expected)


@pytest.mark.parametrize("power", [-1.0, 0.5, 2.0])
@pytest.mark.parametrize("method", ["factored", "exact"])
def test_kronecker_matches_linalg_primitive(xp, rng, power, method):
    """Second oracle: scale 1 agrees with linalg.kron_damped_matpower_matvec."""
    a, g = random_spd(rng, 3, 0.5, 2.0), random_spd(rng, 4, 0.5, 2.0)
    x = rng.standard_normal((3, 4))
    A, G, X = xp.asarray(a), xp.asarray(g), xp.asarray(x)
    got = blocks.kronecker_block_matpower(A, G, X, power, 0.2, exact=method == "exact")
    ref = kron_damped_matpower_matvec(A, G, X, power, 0.2, damping_method=method)
    xp.assert_close(got, xp.to_numpy(ref))


def test_conv_scale_bookkeeping(xp, rng):
    """|T|·kron(A, G) with λ/|T| split by π of the normalised factors (Grosse & Martens 2016)."""
    T, lam = 9, 0.4
    a, g = random_spd(rng, 5, 0.5, 2.0), random_spd(rng, 2, 0.5, 2.0)
    x = rng.standard_normal((5, 2))
    ah, gh, xh = xp.round_host(a), xp.round_host(g), xp.round_host(x)
    got = blocks.kronecker_block_matpower(xp.asarray(a), xp.asarray(g), xp.asarray(x), 1.0, lam,
                                          scale=T, exact=False)
    pi = np.sqrt((np.trace(ah) / 5) / (np.trace(gh) / 2))
    d = np.sqrt(lam / T)
    expected = T * (ah + pi * d * np.eye(5)) @ xh @ (gh + d / pi * np.eye(2))
    xp.assert_close(got, expected)
    # expansion: T A⊗G + λ I + residual (Grosse & Martens 2016)
    resid = T * (pi * d * xh @ gh + d / pi * ah @ xh)
    assert_allclose_normwise(xp.to_numpy(got), T * ah @ xh @ gh + lam * xh + resid, xp.rtol)


@pytest.mark.parametrize("norm_type", ["avg_fro", "2_norm", "1_norm", "off"])
def test_kronecker_norm_types(xp, rng, norm_type):
    a, g = random_spd(rng, 3, 0.5, 2.0), random_spd(rng, 2, 0.5, 4.0)
    x = rng.standard_normal((3, 2))
    ah, gh, xh = xp.round_host(a), xp.round_host(g), xp.round_host(x)
    got = blocks.kronecker_block_matpower(xp.asarray(a), xp.asarray(g), xp.asarray(x), -1.0, 0.5,
                                          norm_type=norm_type)
    norms = {
        "avg_fro": lambda m: np.linalg.norm(m, "fro") / np.sqrt(m.shape[0]),
        "2_norm": lambda m: np.max(np.linalg.eigvalsh(m)),
        "1_norm": lambda m: np.max(np.abs(m).sum(0)),
        "off": lambda m: 1.0,
    }[norm_type]
    pi = np.sqrt(norms(ah) / norms(gh))
    r = np.sqrt(0.5)
    expected = np.linalg.solve(ah + pi * r * np.eye(3), xh) @ np.linalg.inv(gh + r / pi * np.eye(2))
    xp.assert_close(got, expected)


def test_zero_factor_fallbacks(xp, rng):
    a = random_spd(rng, 3, 0.5, 2.0)
    g = np.zeros((2, 2))
    x = rng.standard_normal((3, 2))
    ah, xh = xp.round_host(a), xp.round_host(x)
    A, G, X = xp.asarray(a), xp.asarray(g), xp.asarray(x)
    lam = 0.25
    # TF: π = 1, factors damped with √λ each: (A + √λ)⁻¹ X (√λ I)⁻¹
    got = blocks.kronecker_block_matpower(A, G, X, -1.0, lam, zero_factor_fallback="pi_one")
    xp.assert_close(got, np.linalg.solve(ah + 0.5 * np.eye(3), xh) / 0.5)
    # kfac-jax: the damped block is λ I
    got = blocks.kronecker_block_matpower(A, G, X, -1.0, lam, zero_factor_fallback="identity")
    xp.assert_close(got, xh / lam)
    with pytest.raises(KFACValueError, match="zero_factor_fallback"):
        blocks.kronecker_block_matpower(A, G, X, -1.0, lam, zero_factor_fallback="nope")
    with pytest.raises(KFACValueError, match="singular"):
        blocks.kronecker_block_matpower(A, G, X, -1.0, 0.0, zero_factor_fallback="identity")


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("power", [-1.0, 0.5])
def test_kronecker_clipping_threshold_reaches_diagonal_factors(xp, rng, exact, power):
    """eigenvalue_clipping_threshold c raises a diagonal factor's entries (its eigenvalues) to
    c, as it raises a matrix factor's eigenvalues; π is computed from the unclipped factors
    (as for matrix factors: kfac_ref.linalg.pi_adjusted_damping sees the raw statistics)."""
    c, lam, scale = 0.3, 0.2, 2.0
    a = np.array([0.1, 0.2, 1.0, 1.5])  # two entries below c
    g = random_spd(rng, 3, 0.5, 2.0)  # eigenvalues above c: unchanged by clipping
    x = rng.standard_normal((4, 3))
    ah, gh, xh = xp.round_host(a), xp.round_host(g), xp.round_host(x)
    got = blocks.kronecker_block_matpower(xp.asarray(a), xp.asarray(g), xp.asarray(x), power, lam,
                                          scale=scale, exact=exact, eigenvalue_clipping_threshold=c)
    a_clip = np.diag(np.maximum(ah, c))
    if exact:
        dense = scale * np.kron(a_clip, gh) + lam * np.eye(12)
    else:
        da, dg = pi_split(ah, gh, lam / scale)
        dense = scale * np.kron(a_clip + da * np.eye(4), gh + dg * np.eye(3))
    xp.assert_close(got, (dense_power(dense, power) @ xh.reshape(-1)).reshape(4, 3))


def test_kronecker_eigenvalues(xp, rng):
    a, g = random_spd(rng, 3, 0.5, 2.0), random_spd(rng, 4, 0.5, 2.0)
    ev = blocks.kronecker_block_eigenvalues(xp.asarray(a), xp.asarray(g), scale=3.0)
    dense = 3.0 * np.kron(xp.round_host(a), xp.round_host(g))
    xp.check(ev)
    assert_allclose_normwise(np.sort(xp.to_numpy(ev)), np.linalg.eigvalsh(dense), xp.rtol)


def test_kronecker_bad_inputs(xp, rng):
    a, g = xp.asarray(random_spd(rng, 3)), xp.asarray(random_spd(rng, 2))
    with pytest.raises(KFACValueError, match=r"x must be an array of shape \(3, 2\)"):
        blocks.kronecker_block_matpower(a, g, xp.asarray(np.ones((2, 3))), 1.0)
    with pytest.raises(KFACValueError, match="norm_type must be one of"):
        blocks.kronecker_block_matpower(a, g, xp.asarray(np.ones((3, 2))), 1.0, norm_type="trace")
    with pytest.raises(KFACValueError, match="damping must be non-negative"):
        blocks.kronecker_block_matpower(a, g, xp.asarray(np.ones((3, 2))), 1.0, -1.0)
    with pytest.raises(KFACValueError, match="symmetric"):
        blocks.kronecker_block_matpower(xp.asarray(np.triu(np.ones((3, 3)))), g,
                                        xp.asarray(np.ones((3, 2))), 1.0)
    with pytest.raises(KFACValueError, match="positive definite"):
        blocks.kronecker_block_matpower(xp.asarray(np.zeros((3, 3))), g,
                                        xp.asarray(np.ones((3, 2))), -1.0, exact=True)
    with pytest.raises(KFACTypeError, match="power must be a real number"):
        blocks.kronecker_block_matpower(a, g, xp.asarray(np.ones((3, 2))), "1")


@pytest.mark.parametrize("power", POWERS)
@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_diagonal_and_full_and_identity(xp, rng, power, damping):
    d = rng.uniform(0.5, 2.0, (3, 2))
    x = rng.standard_normal((3, 2))
    dh, xh = xp.round_host(d), xp.round_host(x)
    got = blocks.diagonal_block_matpower(xp.asarray(d), xp.asarray(x), power, damping, scale=2.0)
    dense = np.diag(2.0 * dh.reshape(-1) + damping)
    xp.assert_close(got, (dense_power(dense, power) @ xh.reshape(-1)).reshape(3, 2))

    m = random_spd(rng, 5, 0.5, 2.0)
    v = rng.standard_normal(5)
    mh, vh = xp.round_host(m), xp.round_host(v)
    got = blocks.full_block_matpower(xp.asarray(m), xp.asarray(v), power, damping, scale=1.5)
    xp.assert_close(got, dense_power(1.5 * mh + damping * np.eye(5), power) @ vh)

    got = blocks.scaled_identity_matpower(xp.asarray(v), power, damping, scale=1.5)
    xp.assert_close(got, (1.5 + damping) ** power * vh)


def test_diagonal_full_bad_inputs(xp, rng):
    with pytest.raises(KFACValueError, match="x must be an array of shape"):
        blocks.diagonal_block_matpower(xp.asarray(np.ones((3, 2))), xp.asarray(np.ones(6)), 1.0)
    with pytest.raises(KFACValueError, match="positive definite"):
        blocks.diagonal_block_matpower(xp.asarray(np.zeros((3, 2))),
                                       xp.asarray(np.ones((3, 2))), -1.0)
    with pytest.raises(KFACValueError, match=r"x must be an array of shape \(4\)"):
        blocks.full_block_matpower(xp.asarray(np.eye(4)), xp.asarray(np.ones(3)), 1.0)
    with pytest.raises(KFACValueError, match="positive"):
        blocks.scaled_identity_matpower(xp.asarray(np.ones(3)), -1.0, 0.0, scale=0.0)


def test_normalize_damping():
    assert blocks.normalize_damping(0.6, 3) == pytest.approx(0.2)
    assert blocks.normalize_damping(0.6, 4, 0.5) == pytest.approx(0.3)
    assert blocks.normalize_damping(0.6, 4, 0.0) == 0.6
    with pytest.raises(KFACValueError, match="num_replications must be positive"):
        blocks.normalize_damping(0.6, 0)


# --------------------------------------------------------------------------------------
# Series (RNN) block: option 1 and option 2 against the defining dense systems (MBJ 2018)
# --------------------------------------------------------------------------------------
def _sym_inv_sqrt(m):
    s, q = np.linalg.eigh(m)
    return (q / np.sqrt(s)) @ q.T


def _series_stats(rng, n, T=5, B=40, rho=0.5):
    """Time-correlated data, folded time-major: C0 and the lag-1 C1 = future^T present/(T·B)."""
    x = np.empty((T, B, n))
    mix = rng.standard_normal((n, n)) / np.sqrt(n) * rho
    x[0] = rng.standard_normal((B, n))
    for t in range(1, T):
        x[t] = x[t - 1] @ mix + rng.standard_normal((B, n))
    flat = x.reshape(T * B, n)
    c0 = flat.T @ flat / (T * B)
    c1 = flat[B:].T @ flat[:-B] / (T * B)
    return c0, c1


def _damped_series_stats(rng, T, p, q, delta):
    """(C0 + δI, C1) of the inputs (size p), then of the output gradients (size q)."""
    stats = [_series_stats(rng, p, T), _series_stats(rng, q, T)]
    return [(c0 + delta * np.eye(c0.shape[0]), c1) for c0, c1 in stats]


def test_series_gamma(xp):
    x = np.array([0.0, 0.3, -0.7, 1.0, 0.999])
    T = 4
    expected = 1.0 / np.array([T + 2 * sum((T - d) * v**d for d in range(1, T)) for v in x])
    xp.assert_close(blocks.series_gamma(xp.asarray(x), T), expected, rtol=max(xp.rtol, 1e-9))


@pytest.mark.parametrize("delta", [0.0, 0.1])
def test_series_option1_vs_dense(xp, rng, delta):
    T, p, q = 5, 3, 2
    quants = []
    for c0d, c1 in _damped_series_stats(rng, T, p, q, delta):
        c1s = (c1 + c1.T) / 2
        r = _sym_inv_sqrt(c0d)
        psi, u = np.linalg.eigh(r @ c1s @ r)
        quants.append((r @ u, psi, c0d, c1s))
    (l_a, psi_a, a0d, a1s), (l_g, psi_g, g0d, g1s) = quants
    x = rng.standard_normal((p, q))
    got = blocks.series_option1_multiply_inverse(
        *(xp.asarray(v) for v in (l_a, psi_a, l_g, psi_g)), T, xp.asarray(x))
    # Dense F_T = T V0 + Σ_d (T−d)(Ψ^d V0 + V0 Ψ^{dT}), Ψ = V1 V0⁻¹ (Martens, Ba & Johnson 2018).
    v0, v1 = np.kron(a0d, g0d), np.kron(a1s, g1s)
    psi = v1 @ np.linalg.inv(v0)
    f = T * v0
    for d in range(1, T):
        pd = np.linalg.matrix_power(psi, d)
        f = f + (T - d) * (pd @ v0 + v0 @ pd.T)
    expected = np.linalg.solve(f, x.reshape(-1)).reshape(p, q)
    # float32: the quantities are rounded once, error ~ n·eps·κ(F_T) with n <= 6 and κ < 1e2
    # here, below the fixture's 4096·eps (measured: within xp.rtol / 20).
    xp.assert_close(got, expected, rtol=xp.rtol)


@pytest.mark.parametrize("delta", [0.0, 0.1])
def test_series_option2_vs_dense(xp, rng, delta):
    T, p, q = 6, 3, 2
    quants = []
    for c0d, c1 in _damped_series_stats(rng, T, p, q, delta):
        r = _sym_inv_sqrt(c0d)
        psih = r @ c1 @ r
        mu, e = np.linalg.eigh(psih.T @ psih)
        quants.append((c1.T @ np.linalg.inv(c0d), r @ e, mu, c0d))
    (p_a, k_a, mu_a, a0d), (p_g, k_g, mu_g, g0d) = quants
    x = rng.standard_normal((p, q))
    got = blocks.series_option2_multiply_inverse(
        *(xp.asarray(v) for v in (p_a, k_a, mu_a, p_g, k_g, mu_g)), T, xp.asarray(x))
    # Dense F_∞ = T (I−P)⁻¹ (V0 − P V0 Pᵀ) (I−Pᵀ)⁻¹ with P = P_A ⊗ P_G (Martens, Ba & Johnson 2018).
    v0, pk = np.kron(a0d, g0d), np.kron(p_a, p_g)
    eye = np.eye(p * q)
    ip = np.linalg.inv(eye - pk)
    f = T * ip @ (v0 - pk @ v0 @ pk.T) @ ip.T
    expected = np.linalg.solve(f, x.reshape(-1)).reshape(p, q)
    xp.assert_close(got, expected, rtol=xp.rtol)  # as option 1


def test_series_option2_zero_denominator_replaced_by_one(xp):
    """TF replaces exact zeros of 1 − μ_A μ_Gᵀ by 1 (a unit-modulus AR coefficient would make
    V_0 − P V_0 Pᵀ singular).  With P = 0 and K = I the option-2 inverse is X ⊘ D / T, so
    the entry with μ_A μ_G = 1 is X / T and the others X / ((1 − μ_A μ_G) T)."""
    T = 3
    mu_a, mu_g = np.array([1.0, 0.5]), np.array([1.0, 0.25, 0.5])
    x = np.arange(1.0, 7.0).reshape(2, 3)
    zero2, zero3 = xp.asarray(np.zeros((2, 2))), xp.asarray(np.zeros((3, 3)))
    got = blocks.series_option2_multiply_inverse(zero2, xp.asarray(np.eye(2)), xp.asarray(mu_a),
                                                 zero3, xp.asarray(np.eye(3)), xp.asarray(mu_g), T,
                                                 xp.asarray(x))
    denom = 1.0 - np.outer(mu_a, mu_g)
    denom[0, 0] = 1.0
    xp.assert_close(got, x / denom / T)


def test_series_bad_inputs(xp):
    e = xp.asarray(np.eye(3))
    v = xp.asarray(np.ones(3))
    with pytest.raises(KFACValueError, match=r"x must be an array of shape \(3, 3\)"):
        blocks.series_option1_multiply_inverse(e, v, e, v, 4, xp.asarray(np.ones((3, 2))))
    with pytest.raises(KFACValueError, match="psi_g must be an array of shape"):
        blocks.series_option1_multiply_inverse(e, v, e, xp.asarray(np.ones(2)), 4,
                                               xp.asarray(np.ones((3, 3))))
    with pytest.raises(KFACValueError, match="num_timesteps must be"):
        blocks.series_option2_multiply_inverse(e, e, v, e, e, v, 0, xp.asarray(np.ones((3, 3))))


# --------------------------------------------------------------------------------------
# Hypothesis properties: (B + λI)^p (B + λI)^q = (B + λI)^(p+q) for both damping styles
# --------------------------------------------------------------------------------------
@given(seed=st.integers(0, 2**31 - 1), p=st.sampled_from([-1.0, -0.5, 0.5, 1.0]),
       q=st.sampled_from([-0.5, 0.5, 1.0]), exact=st.booleans(),
       lam=st.floats(0.05, 2.0), scale=st.floats(0.5, 8.0))
def test_power_composition_property(xp, seed, p, q, exact, lam, scale):
    r = np.random.default_rng(seed)
    a = random_spd(r, 3, 0.5, 2.0)
    g = r.uniform(0.5, 2.0, 2) if seed % 2 else random_spd(r, 2, 0.5, 2.0)
    x = r.standard_normal((3, 2))
    A, G = xp.asarray(a), xp.asarray(g)
    kw = dict(scale=scale, exact=exact)
    inner = blocks.kronecker_block_matpower(A, G, xp.asarray(x), q, lam, **kw)
    both = blocks.kronecker_block_matpower(A, G, inner, p, lam, **kw)
    direct = blocks.kronecker_block_matpower(A, G, xp.asarray(x), p + q, lam, **kw)
    # both sides are products of at most two well-conditioned (κ <= 4·(2+λ)/λ·…) powers; the
    # fixture's rtol (4096 eps) covers it.
    xp.assert_close(both, xp.to_numpy(direct))


# --------------------------------------------------------------------------------------
# Block-tridiagonal inverse (Martens & Grosse 2015, §4.3) against the dense Ξᵀ Λ Ξ
# --------------------------------------------------------------------------------------
def _chain_stats(rng, dims, n=200):
    """Jointly sampled vectors of neighbouring layers ⇒ consistent A_ii, A_{i,i+1}."""
    xs = [rng.standard_normal((n, dims[0]))]
    for d in dims[1:]:
        mix = rng.standard_normal((xs[-1].shape[1], d)) * 0.6
        xs.append(xs[-1] @ mix + rng.standard_normal((n, d)))
    diag = [x.T @ x / n for x in xs]
    off = [xs[i].T @ xs[i + 1] / n for i in range(len(xs) - 1)]
    return diag, off


@pytest.mark.parametrize("damping", [0.0, 0.2])
def test_block_tridiagonal_inverse_vs_dense(xp, rng, damping):
    a_diag, a_off = _chain_stats(rng, [3, 2, 3])
    g_diag, g_off = _chain_stats(rng, [2, 3, 2])
    xs = [rng.standard_normal((a.shape[0], g.shape[0]))
          for a, g in zip(a_diag, g_diag, strict=True)]
    to = lambda seq: [xp.asarray(v) for v in seq]  # noqa: E731
    got = blocks.block_tridiagonal_multiply_inverse(to(a_diag), to(g_diag), to(a_off), to(g_off),
                                                    to(xs), damping)
    r = xp.round_host
    A, G = [], []
    for a, g in zip(a_diag, g_diag, strict=True):
        a, g = r(a), r(g)
        da, dg = pi_split(a, g, damping)
        A.append(a + da * np.eye(a.shape[0]))
        G.append(g + dg * np.eye(g.shape[0]))
    sizes = [a.shape[0] * g.shape[0] for a, g in zip(A, G, strict=True)]
    offs = np.cumsum([0] + sizes)
    L = len(A)
    F = [[None] * L for _ in range(L)]
    for i in range(L):
        F[i][i] = np.kron(A[i], G[i])
    for i in range(L - 1):
        F[i][i + 1] = np.kron(r(a_off[i]), r(g_off[i]))
    xi = np.eye(offs[-1])
    lam = np.zeros((offs[-1], offs[-1]))
    for i in range(L):
        s = slice(offs[i], offs[i + 1])
        if i < L - 1:
            psi = F[i][i + 1] @ np.linalg.inv(F[i + 1][i + 1])
            xi[s, offs[i + 1]:offs[i + 2]] = -psi
            sigma = F[i][i] - psi @ F[i + 1][i + 1] @ psi.T
        else:
            sigma = F[i][i]
        lam[s, s] = np.linalg.inv(sigma)
    fhat_inv = xi.T @ lam @ xi
    # the oracle itself: F̂ agrees with F̃ on the tridiagonal blocks (Martens & Grosse 2015, §4.3)
    fhat = np.linalg.inv(fhat_inv)
    for i in range(L):
        si = slice(offs[i], offs[i + 1])
        assert_allclose_normwise(fhat[si, si], F[i][i], 1e-10)
        if i < L - 1:
            assert_allclose_normwise(fhat[si, offs[i + 1]:offs[i + 2]], F[i][i + 1], 1e-10)
    v = np.concatenate([r(x).reshape(-1) for x in xs])
    expected = fhat_inv @ v
    assert np.linalg.cond(fhat) < 1e3  # the conditioning the float32 tolerance assumes
    # Conditioning: factors from 200 Gaussian rows, κ(F̂) ≲ 1e3 here, so float32 needs a
    # looser bound than the fixture's 4096·eps (n·κ ≈ 18e3 > 4096): 8·n·κ·eps.
    rtol = xp.rtol if xp.float64 else 8 * 18 * 1e3 * xp.eps
    assert_allclose_normwise(np.concatenate([xp.to_numpy(y).reshape(-1) for y in got]),
                             expected, rtol)


def test_kronecker_difference_inverse_and_errors(xp, rng):
    a, b = random_spd(rng, 3, 1.0, 2.0), random_spd(rng, 2, 1.0, 2.0)
    c, d = random_spd(rng, 3, 0.1, 0.5), random_spd(rng, 2, 0.1, 0.5)
    x = rng.standard_normal((3, 2))
    r = xp.round_host
    got = blocks.kronecker_difference_inverse(*(xp.asarray(m) for m in (a, b, c, d, x)))
    dense = np.kron(r(a), r(b)) - np.kron(r(c), r(d))
    xp.assert_close(got, np.linalg.solve(dense, r(x).reshape(-1)).reshape(3, 2))
    with pytest.raises(KFACValueError, match="positive definite"):
        blocks.kronecker_difference_inverse(*(xp.asarray(m) for m in (c, d, a, b, x)))
    with pytest.raises(KFACValueError, match="one entry per layer"):
        blocks.block_tridiagonal_multiply_inverse([xp.asarray(a)], [xp.asarray(b)],
                                                  [xp.asarray(a)], [], [xp.asarray(x)])
    with pytest.raises(KFACValueError, match=r"xs\[0\] must be an array of shape \(3, 2\)"):
        blocks.block_tridiagonal_multiply_inverse([xp.asarray(a)], [xp.asarray(b)], [], [],
                                                  [xp.asarray(x.T)])
