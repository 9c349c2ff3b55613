"""Dense-layer factors against dense sums over examples, and the stateful machinery shared
by every factor class: zero-debiased moving average (closed form after two updates),
sources summed / towers averaged, registered powers / Cholesky / inverse Cholesky per
damping, TF's eigendecomposition threshold rule, eigenvalue clipping, stale caches,
immutability, and the error paths."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kfac_ref.factors as F
from kfac_ref import KFACTypeError, KFACValueError


def outer_mean(rows):
    return sum(np.outer(r, r) for r in rows) / len(rows)


def with_ones(x):
    return np.concatenate([x, np.ones((*x.shape[:-1], 1))], axis=-1)


# --------------------------------------------------------------------------------------
# Formula functions
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("has_bias", [False, True])
def test_fc_kronecker_factor_dense_sum(xp, rng, has_bias):
    x = xp.round_host(rng.standard_normal((7, 4)))
    rows = with_ones(x) if has_bias else x
    xp.assert_close(F.fully_connected_kronecker_factor(xp.asarray(x), has_bias),
                    outer_mean(rows))


def test_fc_kronecker_factor_multi_use_folds(xp, rng):
    x = xp.round_host(rng.standard_normal((3, 5, 2)))  # [T, N, d]
    expected = outer_mean([with_ones(x)[t, n] for t in range(3) for n in range(5)])
    xp.assert_close(F.fully_connected_kronecker_factor(xp.asarray(x), True), expected)


@pytest.mark.parametrize("has_bias", [False, True])
def test_fc_diagonal_factor_dense_sum(xp, rng, has_bias):
    a = xp.round_host(rng.standard_normal((6, 3)))
    g = xp.round_host(rng.standard_normal((6, 2)))
    ab = with_ones(a) if has_bias else a
    # per-example gradient outer(ā_n, g_n), squared, averaged
    expected = sum(np.outer(ab[n], g[n]) ** 2 for n in range(6)) / 6
    xp.assert_close(F.fully_connected_diagonal_factor(xp.asarray(a), xp.asarray(g), has_bias),
                    expected)


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6), d=st.integers(1, 5),
       t=st.integers(1, 3), has_bias=st.booleans())
def test_fc_factor_property(xp, seed, n, d, t, has_bias):
    """Shape d(+1), exact symmetry, PSD up to rounding, and folding [T, N, d] == [T·N, d]."""
    x = np.random.default_rng(seed).standard_normal((t, n, d))
    a = xp.to_numpy(F.fully_connected_kronecker_factor(xp.asarray(x), has_bias))
    b = xp.to_numpy(F.fully_connected_kronecker_factor(xp.asarray(x.reshape(t * n, d)),
                                                       has_bias))
    assert a.shape == (d + has_bias,) * 2
    np.testing.assert_array_equal(a, a.T)
    np.testing.assert_allclose(a, b, rtol=xp.rtol, atol=0)
    assert np.linalg.eigvalsh(a).min() >= -(d + 1) * 16 * xp.eps * np.abs(a).max()


# --------------------------------------------------------------------------------------
# Moving average, sources and towers
# --------------------------------------------------------------------------------------
def test_zero_debias_closed_form_after_two_updates(xp, rng):
    x1 = xp.round_host(rng.standard_normal((5, 3)))
    x2 = xp.round_host(rng.standard_normal((5, 3)))
    c1, c2, d = outer_mean(x1), outer_mean(x2), 0.9
    f0 = F.FullyConnectedKroneckerFactor()
    f1 = f0.update_cov(xp.asarray(x1), ema_decay=d)
    f2 = f1.update_cov(xp.asarray(x2), ema_decay=d)
    xp.assert_close(f1.cov, c1)  # one update: the batch statistic
    xp.assert_close(f2.cov, (d * c1 + c2) / (d + 1))
    # TF's contrib-era weight 1 - decay gives the same debiased value
    f2b = f0.update_cov(xp.asarray(x1), ema_decay=d, ema_weight=1 - d).update_cov(
        xp.asarray(x2), ema_decay=d, ema_weight=1 - d)
    xp.assert_close(f2b.cov, (d * c1 + c2) / (d + 1))
    # without zero-debiasing: the raw sum d·c1 + c2
    f2c = F.FullyConnectedKroneckerFactor(zero_debias=False).update_cov(
        xp.asarray(x1), ema_decay=d).update_cov(xp.asarray(x2), ema_decay=d)
    xp.assert_close(f2c.cov, d * c1 + c2)
    # the weight is honoured: unequal weights w1 = 1, w2 = 3 debias to (d·c1 + 3·c2)/(d + 3),
    # and the contrib-era weight 1 - d without debiasing is the plain EMA (1-d)(d·c1 + c2)
    f2d = f0.update_cov(xp.asarray(x1), ema_decay=d).update_cov(
        xp.asarray(x2), ema_decay=d, ema_weight=3.0)
    xp.assert_close(f2d.cov, (d * c1 + 3 * c2) / (d + 3))
    f2e = F.FullyConnectedKroneckerFactor(zero_debias=False).update_cov(
        xp.asarray(x1), ema_decay=d, ema_weight=1 - d).update_cov(
        xp.asarray(x2), ema_decay=d, ema_weight=1 - d)
    xp.assert_close(f2e.cov, (1 - d) * (d * c1 + c2))


def test_sources_summed_towers_averaged(xp, rng):
    data = [[xp.round_host(rng.standard_normal((4, 3))) for _ in range(2)] for _ in range(3)]
    f = F.FullyConnectedKroneckerFactor(has_bias=True).update_cov(
        [[xp.asarray(t) for t in src] for src in data], ema_decay=0.3)
    expected = sum(outer_mean(with_ones(t)) for src in data for t in src) / 2
    xp.assert_close(f.cov, expected)

    a = [xp.round_host(rng.standard_normal((4, 3))) for _ in range(2)]
    gs = [[xp.round_host(rng.standard_normal((4, 2))) for _ in range(2)] for _ in range(2)]
    fd = F.FullyConnectedDiagonalFactor().update_cov(
        [xp.asarray(v) for v in a], [[xp.asarray(g) for g in src] for src in gs],
        ema_decay=0.0)
    expected = sum((a[t] ** 2).T @ gs[s][t] ** 2 / 4 for s in range(2) for t in range(2)) / 2
    xp.assert_close(fd.cov, expected)


def test_factor_is_immutable(xp, rng):
    f = F.FullyConnectedKroneckerFactor()
    f1 = f.update_cov(xp.asarray(rng.standard_normal((4, 2))), ema_decay=0.5)
    assert not f.num_updates_seen and f1.num_updates_seen
    with pytest.raises(AttributeError, match="immutable"):
        f1.has_bias = True
    with pytest.raises(KFACValueError, match="updated at least once"):
        _ = f.cov
    g = f1.register_inverse(0.1)
    assert g is not f1
    with pytest.raises(KFACValueError, match="registered"):
        f1.get_inverse(0.1)


# --------------------------------------------------------------------------------------
# Registered matrix functions
# --------------------------------------------------------------------------------------
def make_factor(xp, rng, n=4, **kwargs):
    x = xp.round_host(rng.standard_normal((12, n)))
    f = F.FullyConnectedKroneckerFactor(**kwargs).update_cov(xp.asarray(x), ema_decay=0.0)
    return f, outer_mean(x)


def test_eigendecomposition_threshold_rule(xp, rng):
    f, _ = make_factor(xp, rng)
    for lam in (0.1, 0.2, 0.3):
        f = f.register_inverse(lam)
    assert not f.uses_eigendecomposition  # 3 < TF master's 4
    assert f.register_inverse(0.4).uses_eigendecomposition
    assert f.register_matpower(-0.5, 0.1).uses_eigendecomposition  # any other power
    assert not f.register_matpower(1, 0.1).uses_eigendecomposition  # power 1 is not cached
    g, _ = make_factor(xp, rng, eigenvalue_decomposition_threshold=2)  # tf.contrib.kfac's
    assert g.register_inverse(0.1).register_inverse(0.2).uses_eigendecomposition


@pytest.mark.parametrize("n_inverses", [3, 4])
def test_threshold_rule_is_observable_through_clipping(xp, rng, n_inverses):
    """Only the eigen path clips eigenvalues, so the path the rule picks shows in the numbers:
    a rank-2 factor with clipping threshold c = 0.5 gives V diag(1/(max(e, c) + λ)) Vᵀ on the
    eigen path (≥ 4 registered inverses) and the plain (C + λI)⁻¹ on the Cholesky path (< 4).
    The two differ by O(1) (1/(0.5 + λ) against 1/λ on the null space)."""
    rows = xp.round_host(rng.standard_normal((2, 4)))
    f = F.FullyConnectedKroneckerFactor(eigenvalue_clipping_threshold=0.5).update_cov(
        xp.asarray(rows), ema_decay=0.0)
    lams = [0.1, 0.2, 0.3, 0.4][:n_inverses]
    for lam in lams:
        f = f.register_inverse(lam)
    f = f.update_inverses()
    c = outer_mean(rows)
    e, v = np.linalg.eigh(c)
    for lam in lams:
        if n_inverses >= 4:  # TF master's EIGENVALUE_DECOMPOSITION_THRESHOLD
            expected = (v / (np.maximum(e, 0.5) + lam)) @ v.T
        else:
            expected = np.linalg.inv(c + lam * np.eye(4))
        xp.assert_close(f.get_inverse(lam), expected)


@pytest.mark.parametrize("n_inverses", [1, 4])
def test_inverses_cholesky_and_eigen_paths(xp, rng, n_inverses):
    f, c = make_factor(xp, rng)
    lams = [0.1, 0.2, 0.3, 0.4][:n_inverses]
    for lam in lams:
        f = f.register_inverse(lam)
    f = f.update_inverses()
    assert f.uses_eigendecomposition == (n_inverses == 4)
    for lam in lams:
        xp.assert_close(f.get_inverse(lam), np.linalg.inv(c + lam * np.eye(4)))


def test_matpower_cholesky_and_inverse_cholesky(xp, rng):
    f, c = make_factor(xp, rng)
    f = (f.register_matpower(-0.5, 0.2).register_matpower(2, 0.2).register_cholesky(0.3)
         .register_cholesky_inverse(0.3).register_cholesky_inverse(0.5).update_inverses())
    m = xp.to_numpy(f.get_matpower(-0.5, 0.2))
    damped = c + 0.2 * np.eye(4)
    # identity oracle: (M^{-1/2})² (C + λI) = I, and M^{-1/2} symmetric
    np.testing.assert_allclose(m @ m @ damped, np.eye(4), atol=xp.rtol * 10)
    xp.assert_close(f.get_matpower(2, 0.2), damped @ damped)
    xp.assert_close(f.get_matpower(1, 0.7), c + 0.7 * np.eye(4))  # fresh, unregistered ok
    chol = xp.to_numpy(f.get_cholesky(0.3))
    np.testing.assert_array_equal(chol, np.tril(chol))
    xp.assert_close(f.get_cholesky(0.3), np.linalg.cholesky(c + 0.3 * np.eye(4)))
    for lam in (0.3, 0.5):
        xp.assert_close(f.get_cholesky_inverse(lam),
                        np.linalg.inv(np.linalg.cholesky(c + lam * np.eye(4))))
    with pytest.raises(KFACValueError, match="registered"):
        f.get_cholesky(0.5)


def test_eigenvalue_clipping(xp, rng):
    """A rank-deficient factor: clipped eigenvalues make the square root finite."""
    rows = xp.round_host(rng.standard_normal((2, 4)))  # rank-2 covariance
    f = F.FullyConnectedKroneckerFactor().update_cov(xp.asarray(rows), ema_decay=0.0)
    f = f.register_matpower(0.5, 0.0).update_inverses()
    r = xp.to_numpy(f.get_matpower(0.5, 0.0))
    assert np.all(np.isfinite(r))
    cov = outer_mean(rows)
    # r² = V max(e, 0) Vᵀ differs from C only by the clipped rounding-level eigenvalues
    np.testing.assert_allclose(r @ r, cov, atol=64 * xp.eps * np.abs(cov).max())
    s, _ = f.get_eigendecomp()
    assert xp.to_numpy(s).min() >= 0.0
    f2 = F.FullyConnectedKroneckerFactor(eigenvalue_clipping_threshold=0.5).update_cov(
        xp.asarray(rows), ema_decay=0.0)
    assert xp.to_numpy(f2.get_eigendecomp()[0]).min() >= 0.5


def test_cached_values_are_stale_until_update_inverses(xp, rng):
    f, c1 = make_factor(xp, rng)
    f = f.register_inverse(0.1)
    xp.assert_close(f.get_inverse(0.1), np.zeros((4, 4)))  # TF initialises inverses at zero
    f = f.update_inverses()
    x2 = xp.round_host(rng.standard_normal((12, 4)))
    g = f.update_cov(xp.asarray(x2), ema_decay=0.0)
    xp.assert_close(g.get_inverse(0.1), np.linalg.inv(c1 + 0.1 * np.eye(4)))  # stale
    xp.assert_close(g.get_matpower(1, 0.1), outer_mean(x2) + 0.1 * np.eye(4))  # fresh
    xp.assert_close(g.update_inverses().get_inverse(0.1),
                    np.linalg.inv(outer_mean(x2) + 0.1 * np.eye(4)))


def test_callable_damping_is_evaluated_at_update_inverses(xp, rng):
    f, c = make_factor(xp, rng)
    box = {"lam": 0.1}

    def damping():
        return box["lam"]

    f = f.register_inverse(damping)
    f1 = f.update_inverses()
    box["lam"] = 0.5
    f2 = f.update_inverses()
    xp.assert_close(f1.get_inverse(damping), np.linalg.inv(c + 0.1 * np.eye(4)))
    xp.assert_close(f2.get_inverse(damping), np.linalg.inv(c + 0.5 * np.eye(4)))


def test_diagonal_factor_powers(xp, rng):
    a = xp.round_host(rng.standard_normal((5, 3)))
    g = xp.round_host(rng.standard_normal((5, 2)))
    f = F.FullyConnectedDiagonalFactor(has_bias=True).update_cov(xp.asarray(a), xp.asarray(g),
                                                                 ema_decay=0.9)
    diag = (with_ones(a) ** 2).T @ g**2 / 5
    assert f.register_inverse(0.1) is f and f.update_inverses() is f
    xp.assert_close(f.get_matpower(-1, 0.1), 1 / (diag + 0.1))
    xp.assert_close(f.get_cholesky(0.2), np.sqrt(diag + 0.2))
    xp.assert_close(f.get_cholesky_inverse(0.2), 1 / np.sqrt(diag + 0.2))
    z = F.FullyConnectedDiagonalFactor().update_cov(
        xp.asarray(np.zeros((2, 3))), xp.asarray(np.ones((2, 2))), ema_decay=0.5)
    with pytest.raises(KFACValueError, match="Add damping"):
        z.get_inverse(0.0)


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------
def test_dense_factor_errors(xp, rng):
    x = xp.asarray(rng.standard_normal((4, 3)))
    with pytest.raises(KFACValueError, match="2-D or 3-D"):
        F.fully_connected_kronecker_factor(xp.asarray(rng.standard_normal(4)))
    with pytest.raises(KFACValueError, match="at least one row"):
        F.fully_connected_kronecker_factor(xp.asarray(np.zeros((0, 3))))
    with pytest.raises(KFACTypeError, match="has_bias must be a bool"):
        F.fully_connected_kronecker_factor(x, has_bias="yes")
    with pytest.raises(KFACTypeError, match="floating"):
        F.fully_connected_kronecker_factor(xp.asarray(np.ones((3, 2), dtype=np.int64)))
    bad = rng.standard_normal((4, 3))
    bad[1, 1] = np.inf
    with pytest.raises(KFACValueError, match="finite"):
        F.fully_connected_kronecker_factor(xp.asarray(bad))
    with pytest.raises(KFACValueError, match="same batch size"):
        F.fully_connected_diagonal_factor(x, xp.asarray(rng.standard_normal((5, 2))))
    with pytest.raises(KFACValueError, match="2-D"):
        F.fully_connected_diagonal_factor(x, xp.asarray(rng.standard_normal((4, 2, 1))))
    with pytest.raises(KFACTypeError, match="sources"):
        F.FullyConnectedKroneckerFactor().update_cov([x, x], ema_decay=0.9)
    with pytest.raises(KFACValueError, match="same number of towers"):
        F.FullyConnectedKroneckerFactor().update_cov([[x, x], [x]], ema_decay=0.9)
    with pytest.raises(KFACValueError, match="same batch size"):
        F.FullyConnectedKroneckerFactor().update_cov(
            [[x, xp.asarray(rng.standard_normal((5, 3)))]], ema_decay=0.9)
    with pytest.raises(KFACValueError, match="non-negative"):
        F.FullyConnectedKroneckerFactor().update_cov(x, ema_decay=-0.1)
    f = F.FullyConnectedKroneckerFactor().update_cov(x, ema_decay=0.5)
    with pytest.raises(KFACValueError, match="non-negative"):
        f.register_inverse(-1.0)
    with pytest.raises(KFACTypeError, match="real number"):
        f.register_matpower("half", 0.1)
    with pytest.raises(KFACValueError, match="one array per input tower"):
        F.FullyConnectedDiagonalFactor().update_cov([x, x], [[x]], ema_decay=0.5)


def test_identity_initialised_average_without_debiasing(xp, rng):
    """TF's INIT_COVARIANCES_AT_ZERO = False (needs ZERO_DEBIAS = False): S₁ = δ·I + c₁."""
    x = xp.round_host(rng.standard_normal((5, 3)))
    f = F.FullyConnectedKroneckerFactor(zero_debias=False, init_covariances_at_zero=False)
    xp.assert_close(f.update_cov(xp.asarray(x), ema_decay=0.9).cov,
                    0.9 * np.eye(3) + outer_mean(x))
    g = xp.round_host(rng.standard_normal((5, 2)))
    fd = F.FullyConnectedDiagonalFactor(zero_debias=False, init_covariances_at_zero=False)
    xp.assert_close(fd.update_cov(xp.asarray(x), xp.asarray(g), ema_decay=0.5).cov,
                    0.5 + (x**2).T @ g**2 / 5)
    with pytest.raises(KFACValueError, match="init_covariances_at_zero must be True"):
        F.FullyConnectedKroneckerFactor(init_covariances_at_zero=False)


def test_mixed_namespaces_and_devices_are_rejected(xp, rng):
    import array_api_compat.numpy as anp

    a = xp.asarray(rng.standard_normal((4, 3)))
    other = anp.asarray(rng.standard_normal((4, 2)))
    if xp.xp is anp:
        pytest.skip("needs a second namespace")
    with pytest.raises(KFACTypeError, match="one array namespace"):
        F.fully_connected_diagonal_factor(a, other)
