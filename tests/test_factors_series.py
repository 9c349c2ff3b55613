"""Multi-use (RNN series) factor: C1 against an explicit sum over time steps, the option-1/2
quantities against their defining identities and against the explicit series Fisher
inverses F_T⁻¹ (option 1) and F_∞⁻¹ (option 2) built with np.kron, and the stateful
FullyConnectedMultiKF."""

import numpy as np
import pytest
from conftest import random_spd
from hypothesis import given
from hypothesis import strategies as st

import kfac_ref.factors as F
from kfac_ref import KFACTypeError, KFACValueError


def with_ones(x):
    return np.concatenate([x, np.ones((*x.shape[:-1], 1))], axis=-1)


def outer_mean(rows):
    return sum(np.outer(r, r) for r in rows) / len(rows)


def c1_loop(x, has_bias):
    """C1 = Σ_{t<T-1} Σ_b x̄_{t+1,b} x̄_{t,b}ᵀ / (T·B) for x [T, B, d], one outer product at a
    time (normaliser T·B: zero padding, not (T-1)·B)."""
    t_uses, b, d = x.shape
    xb = with_ones(x) if has_bias else x
    acc = np.zeros((d + has_bias,) * 2)
    for t in range(t_uses - 1):
        for j in range(b):
            acc += np.outer(xb[t + 1, j], xb[t, j])
    return acc / (t_uses * b)


@pytest.mark.parametrize("has_bias", [False, True])
def test_cov_dt1_explicit_time_sum(xp, rng, has_bias):
    t_uses, b, d = 4, 3, 2
    x = xp.round_host(rng.standard_normal((t_uses, b, d)))
    expected = c1_loop(x, has_bias)
    xp.assert_close(F.fully_connected_multi_kf_cov_dt1(xp.asarray(x), t_uses, has_bias),
                    expected)
    folded = xp.asarray(x.reshape(t_uses * b, d))  # time-major rows t·B + b
    xp.assert_close(F.fully_connected_multi_kf_cov_dt1(folded, t_uses, has_bias), expected)


def c0_c1(rng, n, scale=0.4, symmetric=False):
    c0 = random_spd(rng, n, 0.5, 4.0)
    c1 = scale * rng.standard_normal((n, n))
    return c0, ((c1 + c1.T) / 2 if symmetric else c1)


def test_option1_identities(xp, rng):
    c0, c1 = (xp.round_host(m) for m in c0_c1(rng, 4))
    delta = 0.3
    c0d, c1s = c0 + delta * np.eye(4), (c1 + c1.T) / 2
    lm, psi = F.series_option1_quantities(xp.asarray(c0), xp.asarray(c1), delta, "eigh")
    xp.check(lm)
    lm, psi = xp.to_numpy(lm), xp.to_numpy(psi)
    # C0 has eigenvalues in [0.5, 4] (κ ≤ 8, n = 4) and the identities chain three products
    # of O(1) matrices: 10 · 4096·eps covers n·κ·eps with room for the chained rounding.
    tol = xp.rtol * 10
    np.testing.assert_allclose(lm.T @ c0d @ lm, np.eye(4), atol=tol)
    np.testing.assert_allclose(lm.T @ c1s @ lm, np.diag(psi), atol=tol)
    # TF's default posdef_eig returns |ψ| (pitfall R1b): same L, absolute eigenvalues
    lm2, psi2 = F.series_option1_quantities(xp.asarray(c0), xp.asarray(c1), delta)
    np.testing.assert_allclose(xp.to_numpy(psi2), np.abs(psi), atol=tol)
    np.testing.assert_allclose(xp.to_numpy(lm2), lm, atol=tol)
    # svd variant: singular values of Ψ̂ = |ψ| (sorted descending), L orthonormalises C0
    lm3, psi3 = F.series_option1_quantities(xp.asarray(c0), xp.asarray(c1), delta, "svd")
    np.testing.assert_allclose(xp.to_numpy(psi3), np.sort(np.abs(psi))[::-1], atol=tol)
    lm3 = xp.to_numpy(lm3)
    np.testing.assert_allclose(lm3.T @ c0d @ lm3, np.eye(4), atol=tol)


def test_option2_identities_and_clip(xp, rng):
    c0, c1 = (xp.round_host(m) for m in c0_c1(rng, 4))
    delta = 0.2
    c0d = c0 + delta * np.eye(4)
    p, k, mu = (xp.to_numpy(m) for m in F.series_option2_quantities(
        xp.asarray(c0), xp.asarray(c1), delta))
    tol = xp.rtol * 10
    np.testing.assert_allclose(p, c1.T @ np.linalg.inv(c0d), atol=tol)
    np.testing.assert_allclose(k.T @ c0d @ k, np.eye(4), atol=tol)
    assert mu.max() < 1  # no clipping in this case, so the identity is exact
    np.testing.assert_allclose(k.T @ c1.T @ np.linalg.inv(c0d) @ c1 @ k, np.diag(mu),
                               atol=tol)
    # inconsistent C0/C1 (C1 much larger than C0 allows): μ is clipped at 1
    big = xp.asarray(xp.round_host(5.0 * rng.standard_normal((4, 4))))
    mu_big = xp.to_numpy(F.series_option2_quantities(xp.asarray(c0), big, 0.0)[2])
    assert mu_big.max() == 1.0


def test_series_quantities_use_the_clipped_c0(xp, rng):
    """Both options whiten with the clipped C0: for a rank-2 C0 (n = 4) and threshold c = 0.5,
    Lᵀ (C0_c + δI) L = I and Kᵀ (C0_c + δI) K = I with C0_c = V diag(max(e, c)) Vᵀ, both as
    formula functions and through FullyConnectedMultiKF(eigenvalue_clipping_threshold=c).
    Without clipping the identity would hold for C0 + δI instead, off by O(1) on the null
    space.  κ(C0_c + δI) ≤ (max e + 0.6)/0.6, a few units, so 10·4096·eps covers it."""
    rows = xp.round_host(rng.standard_normal((2, 4)))
    c0 = outer_mean(rows)
    c1 = xp.round_host(0.1 * rng.standard_normal((4, 4)))
    delta, c = 0.1, 0.5
    e, v = np.linalg.eigh(c0)
    c0c = (v * (np.maximum(e, c) + delta)) @ v.T
    tol = xp.rtol * 10
    lm, _ = F.series_option1_quantities(xp.asarray(c0), xp.asarray(c1), delta, "eigh", c)
    _, k, _ = F.series_option2_quantities(xp.asarray(c0), xp.asarray(c1), delta, c)
    for m in (xp.to_numpy(lm), xp.to_numpy(k)):
        np.testing.assert_allclose(m.T @ c0c @ m, np.eye(4), atol=tol)
    x = xp.asarray(np.stack([rows, rows[::-1]]))  # [T = 2, B = 2, d = 4]; C0 = outer_mean(rows)
    f = F.FullyConnectedMultiKF(2, eigenvalue_clipping_threshold=c).register_cov_dt1()
    f = f.register_option1quants(delta).register_option2quants(delta)
    f = f.update_cov(x, ema_decay=0.0).update_inverses()
    lm, _ = f.get_option1quants(delta)
    _, k, _ = f.get_option2quants(delta)
    for m in (xp.to_numpy(lm), xp.to_numpy(k)):
        np.testing.assert_allclose(m.T @ c0c @ m, np.eye(4), atol=tol)


def gamma(x, t):
    return (1 - x) ** 2 / (t * (1 - x**2) - 2 * x * (1 - x**t))


def test_option1_gives_explicit_finite_t_inverse(rng):
    """(L_A⊗L_G) diag(γ_T(ψ_A⊗ψ_G)) (L_A⊗L_G)ᵀ = F_T⁻¹ with
    F_T = T V0 + Σ_{d=1}^{T-1} (T-d)(Ψ^d V0 + V0 Ψᵀ^d), V0 = A0⊗G0, Ψ = (A1⊗G1) V0⁻¹."""
    t = 5
    a0, a1 = c0_c1(rng, 2, 0.3, symmetric=True)
    g0, g1 = c0_c1(rng, 3, 0.3, symmetric=True)
    la, pa = F.series_option1_quantities(a0, a1, 0.0, "eigh")
    lg, pg = F.series_option1_quantities(g0, g1, 0.0, "eigh")
    approx_inv = np.kron(la, lg) @ np.diag(gamma(np.kron(pa, pg), t)) @ np.kron(la, lg).T
    v0, v1 = np.kron(a0, g0), np.kron(a1, g1)
    psi = v1 @ np.linalg.inv(v0)
    ft = t * v0
    for d in range(1, t):
        pd = np.linalg.matrix_power(psi, d)
        ft += (t - d) * (pd @ v0 + v0 @ pd.T)
    np.testing.assert_allclose(approx_inv, np.linalg.inv(ft), rtol=1e-10, atol=1e-12)


def test_option2_gives_explicit_infinite_t_inverse(rng):
    """(1/T)(I−Pᵀ) K diag(1/(1−μ_A⊗μ_G)) Kᵀ (I−P) = F_∞⁻¹
    = (1/T)(I−Ψᵀ)(V0 − Ψ V0 Ψᵀ)⁻¹(I−Ψ), Ψ = V1 V0⁻¹ (general, unsymmetric V1)."""
    t = 7
    a0, a1 = c0_c1(rng, 2, 0.3)
    g0, g1 = c0_c1(rng, 3, 0.3)
    pa, ka, ma = F.series_option2_quantities(a0, a1, 0.0)
    pg, kg, mg = F.series_option2_quantities(g0, g1, 0.0)
    p, k = np.kron(pa, pg), np.kron(ka, kg)
    eye = np.eye(6)
    approx_inv = (eye - p.T) @ k @ np.diag(1 / (1 - np.kron(ma, mg))) @ k.T @ (eye - p) / t
    v0, v1 = np.kron(a0, g0), np.kron(a1, g1)
    psi = v1 @ np.linalg.inv(v0)
    exact = (eye - psi.T) @ np.linalg.inv(v0 - psi @ v0 @ psi.T) @ (eye - psi) / t
    np.testing.assert_allclose(approx_inv, exact, rtol=1e-10, atol=1e-12)


def test_multi_kf_sources_summed_towers_averaged(xp, rng):
    """TF: C0 and C1 contributions are summed over sources and averaged over towers."""
    t_uses, b, d = 3, 2, 2
    xs = [[xp.round_host(rng.standard_normal((t_uses, b, d))) for _ in range(2)]
          for _ in range(2)]  # [source][tower]
    f = F.FullyConnectedMultiKF(t_uses, has_bias=True).register_cov_dt1()
    f = f.update_cov([[xp.asarray(v) for v in src] for src in xs], ema_decay=0.0)
    c0 = sum(outer_mean(with_ones(v).reshape(-1, d + 1)) for src in xs for v in src) / 2
    c1 = sum(c1_loop(v, True) for src in xs for v in src) / 2
    xp.assert_close(f.cov, c0)
    xp.assert_close(f.cov_dt1, c1)


def test_multi_kf_class(xp, rng):
    t_uses, b, d = 3, 4, 2
    x1 = xp.round_host(rng.standard_normal((t_uses, b, d)))
    x2 = xp.round_host(rng.standard_normal((t_uses, b, d)))
    f = F.FullyConnectedMultiKF(t_uses, has_bias=True).register_cov_dt1()
    f = f.register_option1quants(0.1).register_option2quants(0.1).register_inverse(0.1)
    assert f.uses_eigendecomposition  # option quantities force the eigen path
    f1 = f.update_cov(xp.asarray(x1), ema_decay=0.8)
    with pytest.raises(KFACValueError, match="update_inverses"):
        f1.get_option1quants(0.1)
    f1 = f1.update_inverses()
    f2 = f1.update_cov(xp.asarray(x2), ema_decay=0.8)
    c0 = [xp.to_numpy(F.fully_connected_kronecker_factor(xp.asarray(x), True))
          for x in (x1, x2)]
    c1 = [xp.to_numpy(F.fully_connected_multi_kf_cov_dt1(xp.asarray(x), t_uses, True))
          for x in (x1, x2)]
    xp.assert_close(f2.cov, (0.8 * c0[0] + c0[1]) / 1.8)
    xp.assert_close(f2.cov_dt1, (0.8 * c1[0] + c1[1]) / 1.8)
    # stale until update_inverses: still the quantities of the first statistics
    lm_stale, _ = f2.get_option1quants(0.1)
    lm_first, _ = F.series_option1_quantities(xp.asarray(c0[0]), xp.asarray(c1[0]), 0.1)
    xp.assert_close(lm_stale, xp.to_numpy(lm_first))
    f3 = f2.update_inverses()
    for got, want in zip(f3.get_option2quants(0.1),
                         F.series_option2_quantities(f2.cov, f2.cov_dt1, 0.1), strict=True):
        xp.assert_close(got, xp.to_numpy(want))
    xp.assert_close(f3.get_inverse(0.1), np.linalg.inv(xp.to_numpy(f2.cov) + 0.1 * np.eye(3)))
    with pytest.raises(KFACValueError, match="registered"):
        f3.get_option2quants(0.2)


def test_series_errors(xp, rng):
    x = xp.asarray(rng.standard_normal((7, 2)))
    with pytest.raises(KFACValueError, match="multiple of num_uses"):
        F.fully_connected_multi_kf_cov_dt1(x, 3)
    with pytest.raises(KFACValueError, match="T = num_uses"):
        F.fully_connected_multi_kf_cov_dt1(xp.asarray(rng.standard_normal((2, 3, 2))), 3)
    with pytest.raises(KFACValueError, match="integer >= 1"):
        F.fully_connected_multi_kf_cov_dt1(x, 0)
    c0 = xp.asarray(random_spd(rng, 3))
    with pytest.raises(KFACValueError, match="same shape"):
        F.series_option1_quantities(c0, xp.asarray(np.eye(2)), 0.1)
    with pytest.raises(KFACValueError, match="non-negative"):
        F.series_option2_quantities(c0, c0, -0.1)
    with pytest.raises(KFACValueError, match="eig_method"):
        F.series_option1_quantities(c0, c0, 0.1, eig_method="qr")
    nonsym = xp.asarray(rng.standard_normal((3, 3)))
    with pytest.raises(KFACValueError, match="series_option1_quantities: cov must be .*symmetric"):
        F.series_option1_quantities(nonsym, c0, 0.1)
    with pytest.raises(KFACValueError, match="series_option2_quantities: cov must be .*symmetric"):
        F.series_option2_quantities(nonsym, c0, 0.1)
    with pytest.raises(KFACValueError, match="eigenvalue_clipping_threshold must be non-neg"):
        F.series_option1_quantities(c0, c0, 0.1, "eigh", -0.5)
    with pytest.raises(KFACValueError, match="eigenvalue_clipping_threshold must be non-neg"):
        F.series_option2_quantities(c0, c0, 0.1, -0.5)
    with pytest.raises(KFACValueError, match="register_cov_dt1"):
        _ = F.FullyConnectedMultiKF(7).update_cov(x, ema_decay=0.5).cov_dt1
    with pytest.raises(KFACTypeError, match="sources"):
        F.FullyConnectedMultiKF(7).update_cov([x, x], ema_decay=0.5)


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5),
       delta=st.sampled_from([0.0, 0.1, 1.0]))
def test_series_identities_property(xp, seed, n, delta):
    """For random SPD C0 (eigenvalues in [0.5, 4]) and random C1: Lᵀ C0_δ L = I,
    Lᵀ sym(C1) L = diag(ψ) (signed ψ), Kᵀ C0_δ K = I, P C0_δ = C1ᵀ, 0 ≤ μ ≤ 1."""
    r = np.random.default_rng(seed)
    c0, c1 = (xp.round_host(m) for m in c0_c1(r, n))
    c0d = c0 + delta * np.eye(n)
    lm, psi = (xp.to_numpy(m) for m in F.series_option1_quantities(
        xp.asarray(c0), xp.asarray(c1), delta, "eigh"))
    p, k, mu = (xp.to_numpy(m) for m in F.series_option2_quantities(
        xp.asarray(c0), xp.asarray(c1), delta))
    tol = xp.rtol * 10  # κ(C0_δ) ≤ 8 and three chained products, as in the fixed cases
    np.testing.assert_allclose(lm.T @ c0d @ lm, np.eye(n), atol=tol)
    np.testing.assert_allclose(lm.T @ ((c1 + c1.T) / 2) @ lm, np.diag(psi), atol=tol)
    np.testing.assert_allclose(k.T @ c0d @ k, np.eye(n), atol=tol)
    np.testing.assert_allclose(p @ c0d, c1.T, atol=tol * np.abs(c0d).max())
    assert mu.min() >= 0 and mu.max() <= 1
