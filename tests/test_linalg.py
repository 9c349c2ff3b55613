"""kfac_ref.linalg against independent oracles (explicit sums, np.kron, scipy matrix functions)
and algebraic identities (hypothesis), on every backend; plus every error path."""

import math

import numpy as np
import pytest
import scipy.linalg as sla
from conftest import assert_allclose_normwise, random_psd, random_spd
from hypothesis import given
from hypothesis import strategies as st

import kfac_ref as K
from kfac_ref import KFACInputError, KFACTypeError, KFACValueError

seeds = st.integers(0, 2**32 - 1)
dims = st.integers(1, 5)
POWERS = [-1.0, -0.5, 0.5, 1.0, 2.0]


def frac_power(m, p):
    """scipy's Schur–Padé fractional power (independent of eigh), real part."""
    return np.real(sla.fractional_matrix_power(m, p))


# --------------------------------------------------------------------------------------
# compute_cov / append_homog
# --------------------------------------------------------------------------------------
def test_compute_cov_matches_explicit_sum(xp, rng):
    x = xp.round_host(rng.standard_normal((7, 4)))
    expected = sum(np.outer(row, row) for row in x) / 7
    xp.assert_close(K.compute_cov(xp.asarray(x)), expected)


def test_compute_cov_right_and_normalizer(xp, rng):
    x = xp.round_host(rng.standard_normal((6, 3)))
    y = xp.round_host(rng.standard_normal((6, 2)))
    expected = sum(np.outer(a, b) for a, b in zip(x, y, strict=True)) / 2.5
    xp.assert_close(K.compute_cov(xp.asarray(x), xp.asarray(y), normalizer=2.5), expected)


@pytest.mark.parametrize("normalizer", [None, 2.5])
def test_compute_cov_leaves_its_inputs_and_keeps_their_dtype(xp, rng, normalizer):
    """The moment is divided in place, on the product the function made itself: the
    arguments are unchanged (also a square X used as both factors), and the result has
    their dtype with a Python normaliser."""
    x = xp.asarray(xp.round_host(rng.standard_normal((6, 3))))
    y = xp.asarray(xp.round_host(rng.standard_normal((6, 3))))
    sq = xp.asarray(xp.round_host(rng.standard_normal((3, 3))))
    before = [xp.to_numpy(a).copy() for a in (x, y, sq)]
    for args in ((x,), (x, y), (sq, sq)):
        out = K.compute_cov(*args, normalizer=normalizer)
        xp.check(out)
    for a, b in zip((x, y, sq), before, strict=True):
        np.testing.assert_array_equal(xp.to_numpy(a), b)


def test_compute_cov_right_is_not_symmetrised(rng):
    x = rng.standard_normal((5, 3))
    y = rng.standard_normal((5, 3))
    c = K.compute_cov(x, y)
    np.testing.assert_allclose(c, x.T @ y / 5, rtol=1e-14)
    assert not np.allclose(c, c.T)


@given(seed=seeds, n=st.integers(1, 8), d=dims)
def test_compute_cov_symmetric_psd(xp, seed, n, d):
    x = np.random.default_rng(seed).standard_normal((n, d))
    c = xp.to_numpy(K.compute_cov(xp.asarray(x)))
    np.testing.assert_array_equal(c, c.T)  # exactly symmetric by construction
    scale = max(np.abs(c).max(), 1e-30)
    assert np.linalg.eigvalsh(c).min() >= -d * 8 * xp.eps * scale


def test_append_homog(xp, rng):
    x = xp.round_host(rng.standard_normal((2, 3, 4)))
    out = K.append_homog(xp.asarray(x), homog_value=2.0)
    expected = np.concatenate([x, np.full((2, 3, 1), 2.0)], axis=-1)
    xp.assert_close(out, expected, rtol=0)


# --------------------------------------------------------------------------------------
# Matrix functions
# --------------------------------------------------------------------------------------
def test_clipped_eigh_reconstructs_and_clips(xp, rng):
    m = xp.round_host(random_psd(rng, 5, 2))  # rank 2: three (numerically) zero eigenvalues
    s, q = K.clipped_eigh(xp.asarray(m), eigenvalue_clipping_threshold=0.0)
    s, q = xp.to_numpy(s), xp.to_numpy(q)
    assert s.min() >= 0.0
    xp.assert_close(K.clipped_eigh(xp.asarray(m))[1], q)
    assert_allclose_normwise((q * s) @ q.T, m, xp.rtol)
    s2, _ = K.clipped_eigh(xp.asarray(m), eigenvalue_clipping_threshold=0.5)
    assert xp.to_numpy(s2).min() >= 0.5


@pytest.mark.parametrize("power", POWERS)
@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_damped_matpower_against_scipy(xp, rng, power, damping):
    m = xp.round_host(random_spd(rng, 5))
    expected = frac_power(m + damping * np.eye(5), power)
    xp.assert_close(K.damped_matpower(xp.asarray(m), power, damping), expected)


def test_damped_matpower_integer_powers(xp, rng):
    m = xp.round_host(random_spd(rng, 4, 0.5, 2.0))
    xp.assert_close(K.damped_matpower(xp.asarray(m), 3, 0.1),
                    np.linalg.matrix_power(m + 0.1 * np.eye(4), 3))
    xp.assert_close(K.damped_matpower(xp.asarray(m), 0), np.eye(4))
    xp.assert_close(K.damped_matpower(xp.asarray(m), -2),
                    np.linalg.matrix_power(np.linalg.inv(m), 2))


def test_damped_matpower_exp_one_is_direct_without_clipping(xp):
    # An indefinite symmetric matrix: power = 1 must not clip its negative eigenvalue.
    m = np.array([[0.0, 1.0], [1.0, 0.0]])
    xp.assert_close(K.damped_matpower(xp.asarray(m), 1, 0.5), m + 0.5 * np.eye(2), rtol=0)
    # whereas power = 2 goes through the clipped eigendecomposition (eigenvalue -1 -> 0)
    expected = np.array([[0.5, 0.5], [0.5, 0.5]])
    xp.assert_close(K.damped_matpower(xp.asarray(m), 2), expected)


def test_damped_matpower_clipping_threshold(xp, rng):
    m = xp.round_host(random_psd(rng, 4, 1))
    s, q = np.linalg.eigh(m)
    expected = (q * (np.maximum(s, 0.25) + 0.1) ** -0.5) @ q.T
    xp.assert_close(K.damped_matpower(xp.asarray(m), -0.5, 0.1, 0.25), expected)


@given(seed=seeds, n=dims, p=st.sampled_from(POWERS), q=st.sampled_from(POWERS))
def test_matpower_semigroup(xp, seed, n, p, q):
    """M^p M^q = M^(p+q) for SPD M (damped)."""
    m = xp.asarray(random_spd(np.random.default_rng(seed), n))
    mp = K.damped_matpower(m, p, 0.05)
    mq = K.damped_matpower(m, q, 0.05)
    mpq = K.damped_matpower(m, p + q, 0.05)
    # Each power has relative error <= rtol; κ(M + λI) <= 100 so powers |p| <= 2 stay in range.
    assert_allclose_normwise(xp.to_numpy(mp @ mq), xp.to_numpy(mpq), 4 * xp.rtol)


@given(seed=seeds, n=dims, damping=st.floats(0.0, 5.0))
def test_damped_inverse_times_damped_matrix_is_identity(xp, seed, n, damping):
    m_host = random_spd(np.random.default_rng(seed), n)
    m = xp.asarray(m_host)
    damped = xp.asarray(xp.round_host(m_host) + damping * np.eye(n))
    for inv in (K.damped_matpower(m, -1, damping), K.damped_inverse(m, damping)):
        xp.check(inv)
        assert_allclose_normwise(xp.to_numpy(inv @ damped), np.eye(n), xp.rtol)


def test_damped_cholesky_and_inverse(xp, rng):
    m = xp.round_host(random_psd(rng, 5, 3))  # singular: damping makes it PD
    damped = m + 0.2 * np.eye(5)
    l_factor = K.damped_cholesky(xp.asarray(m), 0.2)
    xp.assert_close(l_factor, np.linalg.cholesky(damped))
    linv = K.damped_cholesky_inverse(xp.asarray(m), 0.2)
    xp.assert_close(linv, np.linalg.inv(np.linalg.cholesky(damped)))
    linv_h = xp.to_numpy(linv)
    np.testing.assert_array_equal(np.triu(linv_h, 1), 0.0)
    assert_allclose_normwise(linv_h.T @ linv_h, np.linalg.inv(damped), xp.rtol)
    xp.assert_close(K.damped_inverse(xp.asarray(m), 0.2), np.linalg.inv(damped))


# --------------------------------------------------------------------------------------
# One inverse through Cholesky (TF K-FAC's rule), the others through eigh
# --------------------------------------------------------------------------------------
def eigh_inverse(m, damping, threshold=0.0):
    """Oracle: (max(s, c) + λ)^-1 in the eigenbasis, host float64 (NumPy's eigh)."""
    s, q = np.linalg.eigh(m)
    return (q / (np.maximum(s, threshold) + damping)) @ q.T


@pytest.mark.parametrize("rank", [None, 2])  # positive definite, and PSD of low rank
def test_damped_matpower_inverse_cholesky_path_agrees_with_eigh(xp, rng, rank):
    n = 7
    m = xp.round_host(random_spd(rng, n, 0.5, 5.0) if rank is None else random_psd(rng, n, rank))
    a = xp.asarray(m)
    assert K.linalg._clipping_is_void(xp.xp, a, 0.0)
    got = K.damped_matpower(a, -1, 0.3)
    xp.check(got)
    # both are backward stable: they agree to κ(M + λI)·eps, κ <= 50 here
    xp.assert_close(got, eigh_inverse(m, 0.3))
    xp.assert_close(K.damped_inverse(a, 0.3), eigh_inverse(m, 0.3))
    h = xp.to_numpy(K.damped_inverse(a, 0.3))
    np.testing.assert_array_equal(h, h.T)  # exactly symmetric by construction


def test_damped_matpower_inverse_still_clips_an_indefinite_matrix(xp, rng):
    # eigenvalues (-0.3, 1, 2): clipping at 0 changes the inverse, so eigh decides
    q, _ = np.linalg.qr(rng.standard_normal((3, 3)))
    m = xp.round_host((q * np.array([-0.3, 1.0, 2.0])) @ q.T)
    m = (m + m.T) / 2
    a = xp.asarray(m)
    assert not K.linalg._clipping_is_void(xp.xp, a, 0.0)
    xp.assert_close(K.damped_matpower(a, -1, 0.5), eigh_inverse(m, 0.5))
    # a threshold above the smallest eigenvalue of a positive definite matrix clips too
    spd = xp.round_host(random_spd(rng, 4, 0.5, 2.0))
    assert not K.linalg._clipping_is_void(xp.xp, xp.asarray(spd), 1.0)
    xp.assert_close(K.damped_matpower(xp.asarray(spd), -1, 0.1, 1.0),
                    eigh_inverse(spd, 0.1, 1.0))


@pytest.mark.parametrize("rank", [None, 2])
def test_second_moment_kernel_skips_the_clipping_test(xp, rng, rank):
    """The kernel's second_moment=True (K-FAC factors: Gram matrices) inverts by Cholesky
    without the test factorisation; on a PSD matrix of low rank (eigenvalues at 0 up to
    rounding, where clipping at 0 changes nothing beyond rounding) it agrees with the clipped
    eigh oracle, and with a positive threshold it still clips."""
    n = 7
    m = xp.round_host(random_spd(rng, n, 0.5, 5.0) if rank is None else random_psd(rng, n, rank))
    a = xp.asarray(m)
    got = K.linalg.damped_matpower.kernel(xp.xp, a, -1.0, 0.3, 0.0, second_moment=True)
    xp.check(got)
    xp.assert_close(got, eigh_inverse(m, 0.3))
    clipped = K.linalg.damped_matpower.kernel(xp.xp, a, -1.0, 0.3, 1.0, second_moment=True)
    xp.assert_close(clipped, eigh_inverse(m, 0.3, 1.0))


@pytest.mark.parametrize(("p", "q"), [(5, 3), (3, 5), (4, 4)])
def test_a_folded_coefficient_gives_the_same_product(xp, rng, p, q):
    """kron_factored_fold multiplies c = s^p into the factor power with fewer entries; the
    product is the dense oracle's s^p (A + δ_A I)^p ⊗ (G + δ_G I)^p vec(X)."""
    a, g = (xp.round_host(random_spd(rng, n)) for n in (p, q))
    x = xp.round_host(rng.standard_normal((p, q)))
    fa, fg = xp.asarray(a), xp.asarray(g)
    powers = K.linalg.kron_factored_powers(xp.xp, fa, fg, -1.0, 0.3, 4.0, second_moment=True)
    folded = K.linalg.kron_factored_fold(xp.xp, powers, fa, fg)
    assert folded[2] is None
    smaller = 0 if p <= q else 1
    xp.assert_close(folded[smaller], powers[2] * xp.to_numpy(powers[smaller]))
    assert folded[1 - smaller] is powers[1 - smaller]
    got = K.linalg.kron_factored_apply(xp.xp, folded, xp.asarray(x))
    xp.check(got)
    da, dg = K.linalg.kron_factor_dampings(np, a, g, 0.3 / 4.0)
    dense = 4.0 * np.kron(a + da * np.eye(p), g + dg * np.eye(q))
    want = np.linalg.solve(dense, x.reshape(-1)).reshape(p, q)
    xp.assert_close(got, want)


@pytest.mark.parametrize("diagonal", [False, True])
@pytest.mark.parametrize("zero", [False, True])
def test_every_folded_form_has_one_structure_and_the_unfolded_product(xp, rng, zero, diagonal):
    """The zero-factor identity λ^p I and the lazy zero-factor form (both branches, a flag)
    fold into the same two arrays and None as the ordinary powers (one pytree structure for
    a cache built eagerly and inside jax.jit), with the product of the unfolded form: the
    dense oracle's λ^p X for a zero factor (kfac-jax's fall-back)."""
    p, q = 3, 4
    a = np.zeros((p, p)) if zero else random_spd(rng, p)
    g = random_spd(rng, q)
    fa = xp.asarray(np.diag(a).copy() if diagonal else a)
    fg = xp.asarray(g)
    x = xp.asarray(rng.standard_normal((p, q)))
    eager = K.linalg.kron_factored_powers(xp.xp, fa, fg, -1.0, 0.3, 2.0,
                                          zero_factor_fallback="identity")
    assert (eager[0] is None) == zero
    flag = xp.xp.asarray(zero, device=xp.device)  # the form a trace gets
    lazy = K.linalg.kron_factored_powers(xp.xp, fa, fg, -1.0, 0.3, 2.0,
                                         zero_factor_fallback="identity", zero=flag)
    assert len(lazy) == 5
    want = K.linalg.kron_factored_apply(xp.xp, eager, x)
    for form in (eager, lazy):
        folded = K.linalg.kron_factored_fold(xp.xp, form, fa, fg)
        assert len(folded) == 3 and folded[2] is None
        assert all(xp.xp.isdtype(f.dtype, "real floating") for f in folded[:2])
        assert tuple(folded[0].shape) == tuple(fa.shape)
        assert tuple(folded[1].shape) == tuple(fg.shape)
        got = K.linalg.kron_factored_apply(xp.xp, folded, x)
        xp.check(got)
        xp.assert_close(got, xp.to_numpy(want))
    if zero:
        xp.assert_close(want, xp.to_numpy(x) / 0.3)


def test_damped_matpower_inverse_of_singular_matrix_still_raises(xp):
    m = xp.asarray(np.diag([1.0, 0.0]))
    with pytest.raises(KFACValueError, match="damped_matpower: matrix \\+ damping·I must be "
                       "positive definite for the negative exponent -1"):
        K.damped_matpower(m, -1)


def test_cholesky_kernels_match_the_fallback(rng):
    """The backend kernels (LAPACK potri/trtri through SciPy for NumPy) and the array-API
    fallback (a general solve against I) give the same inverses to rounding."""
    import array_api_strict as xs

    m = random_spd(rng, 9, 0.2, 4.0)
    fast = K.damped_inverse(m, 0.1)
    slow = np.asarray(K.damped_inverse(xs.asarray(m), 0.1))
    assert_allclose_normwise(fast, slow, 1e-12)
    assert_allclose_normwise(K.damped_cholesky_inverse(m, 0.1),
                             np.asarray(K.damped_cholesky_inverse(xs.asarray(m), 0.1)), 1e-12)
    assert K._backend._triangular_kernels(K._backend.namespace_of("t", m=m)) == "scipy"
    assert K._backend._triangular_kernels(xs) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 2, 33])
def test_the_lapack_inverse_mirrors_its_triangle_exactly(rng, n, dtype):
    """potri writes one triangle; the mirrored matrix is exactly symmetric, keeps the
    dtype and is the inverse (against NumPy's LU inverse in float64)."""
    m = random_spd(rng, n, 0.5, 3.0).astype(dtype)
    got = K.damped_inverse(m, 0.1)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, got.T)
    want = np.linalg.inv(m.astype(np.float64) + 0.1 * np.eye(n))
    assert_allclose_normwise(got, want, 50 * np.finfo(dtype).eps)


class _UpperCholeskyNamespace:
    """An array API namespace whose ``linalg.cholesky`` returns the upper factor ``Lᵀ``
    (as array-api-compat's wrapper of a blocked-Cholesky library does); everything else is
    array-api-strict's."""

    def __init__(self, xs):
        import types

        self._xs = xs
        self.linalg = types.SimpleNamespace(
            cholesky=lambda m: xs.linalg.matrix_transpose(xs.linalg.cholesky(m)))

    def __getattr__(self, name):
        return getattr(self._xs, name)


@pytest.mark.parametrize("upper", [False, True], ids=["lower-convention", "upper-convention"])
def test_cholesky_glue_returns_the_lower_factor_for_either_convention(rng, upper):
    """The generic Cholesky path gives the lower factor whichever triangle the namespace's
    ``linalg.cholesky`` returns (oracle: numpy.linalg.cholesky)."""
    import array_api_strict as xs

    m = random_spd(rng, 7, 0.2, 4.0)
    ns = _UpperCholeskyNamespace(xs) if upper else xs
    if upper:  # the stand-in really returns the upper factor
        raw = np.asarray(ns.linalg.cholesky(xs.asarray(m)))
        assert np.allclose(np.tril(raw, -1), 0.0) and not np.allclose(np.triu(raw, 1), 0.0)
    low = np.asarray(K._backend.cholesky_lower(ns, xs.asarray(m)))
    assert_allclose_normwise(low, np.linalg.cholesky(m), 1e-12)


# --------------------------------------------------------------------------------------
# Norms and π
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_type", K.FACTOR_NORMS)
def test_factor_norm(xp, rng, norm_type):
    m = xp.round_host(random_spd(rng, 4))
    expected = {
        "avg_diag": np.trace(m) / 4,
        "avg_fro": np.linalg.norm(m, "fro") / 2,
        "2_norm": np.linalg.norm(m, 2),
        "1_norm": np.linalg.norm(m, 1),
    }[norm_type]
    got = K.factor_norm(xp.asarray(m), norm_type)
    xp.check(got)  # a 0-D array on the input's device: no host round trip
    assert got.shape == ()
    assert math.isclose(float(got), expected, rel_tol=xp.rtol)
    d = xp.round_host(rng.uniform(0.1, 2, size=3))
    assert math.isclose(float(K.factor_norm(xp.asarray(d), norm_type)),
                        float(K.factor_norm(xp.asarray(np.diag(d)), norm_type)),
                        rel_tol=xp.rtol)
    assert float(K.factor_norm(xp.asarray(np.array(2.5)), norm_type)) == 2.5
    # every norm is normalised so that the identity has norm 1
    assert math.isclose(float(K.factor_norm(xp.asarray(np.eye(5)), norm_type)), 1.0,
                        rel_tol=xp.rtol)


@pytest.mark.parametrize("norm_type", K.FACTOR_NORMS)
@pytest.mark.parametrize("scale", [1e30, 1e-30, 3e38, float(np.finfo(np.float32).max),
                                   float(np.finfo(np.float32).smallest_subnormal)])
@pytest.mark.parametrize("n", [4, 10])
def test_factor_norm_is_scale_safe_in_float32(norm_type, scale, n):
    """Squares of 1e±30 overflow/underflow float32, a sum of entries near the largest float
    overflows (also a sum of n entries each divided by n first, rounded up), and halving
    the smallest subnormal gives 0; the norm of scale·I is still scale."""
    m = np.eye(n, dtype=np.float32) * np.float32(scale)
    got = K.factor_norm(m, norm_type)
    assert got.dtype == np.float32
    assert math.isclose(float(got), float(np.float32(scale)), rel_tol=1e-6)
    assert math.isclose(float(K.factor_norm(np.diag(m), norm_type)), float(np.float32(scale)),
                        rel_tol=1e-6)


def test_pi_and_damped_inverse_are_scale_safe_in_float32():
    """π of 1e30·I against 1e-30·I is 1e30, and the π-damped inverse stays accurate."""
    a = np.eye(3, dtype=np.float32) * np.float32(1e30)
    g = np.eye(2, dtype=np.float32) * np.float32(1e-30)
    assert math.isclose(float(K.pi_tracenorm(a, g)), 1e30, rel_tol=1e-6)
    left, right = K.pi_adjusted_damping(a, g, 1e-4)
    assert math.isclose(float(left), 1e28, rel_tol=1e-6)
    assert math.isclose(float(right), 1e-32, rel_tol=1e-5)
    x = np.ones(6, dtype=np.float32)
    got = K.kron_damped_inverse_matvec(a, g, x, 1e-4)
    expected = np.ones(6) / ((1e30 + 1e28) * (1e-30 + 1e-32))
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=1e-5)


def test_pi_tracenorm(xp, rng):
    a = xp.round_host(random_spd(rng, 3))
    g = xp.round_host(random_spd(rng, 5))
    expected = math.sqrt((np.trace(a) / 3) / (np.trace(g) / 5))
    pi = K.pi_tracenorm(xp.asarray(a), xp.asarray(g))
    xp.check(pi)  # a 0-D array on the input's device: no host round trip
    assert math.isclose(float(pi), expected, rel_tol=xp.rtol)
    zero = xp.asarray(np.zeros((3, 3)))
    assert float(K.pi_tracenorm(zero, xp.asarray(g))) == 1.0
    assert float(K.pi_tracenorm(xp.asarray(g), zero)) == 1.0
    # a diagonal factor given by its diagonal
    d = xp.round_host(rng.uniform(0.5, 2, size=3))
    assert math.isclose(float(K.pi_tracenorm(xp.asarray(d), xp.asarray(g))),
                        math.sqrt((d.sum() / 3) / (np.trace(g) / 5)), rel_tol=xp.rtol)


@given(seed=seeds, da=dims, dg=dims, damping=st.floats(1e-3, 10.0),
       factor=st.floats(0.2, 5.0))
def test_pi_minimises_residual_trace(seed, da, dg, damping, factor):
    """tr of the damping residual πγ I⊗G + (γ/π) A⊗I is minimal at the trace-norm π."""
    r = np.random.default_rng(seed)
    a, g = random_spd(r, da), random_spd(r, dg)
    gamma = math.sqrt(damping)

    def residual_trace(pi):
        res = pi * gamma * np.kron(np.eye(da), g) + gamma / pi * np.kron(a, np.eye(dg))
        return np.trace(res)

    pi = float(K.pi_tracenorm(a, g))
    assert residual_trace(pi) <= residual_trace(pi * factor) * (1 + 1e-12)


def test_pi_adjusted_damping(xp, rng):
    a = xp.round_host(random_spd(rng, 3))
    g = xp.round_host(random_spd(rng, 4))
    left, right = K.pi_adjusted_damping(xp.asarray(a), xp.asarray(g), 0.09)
    xp.check(left), xp.check(right)
    left, right = float(left), float(right)
    pi = float(K.pi_tracenorm(xp.asarray(a), xp.asarray(g)))
    # π·√λ and √λ/π are each a few roundings in the inputs' dtype from exact
    assert math.isclose(left * right, 0.09, rel_tol=8 * xp.eps)
    assert math.isclose(left / right, pi**2, rel_tol=8 * xp.eps)
    # the expansion (A + l I)⊗(G + r I) = A⊗G + λI + l I⊗G + r A⊗I (dense check)
    lhs = np.kron(a + left * np.eye(3), g + right * np.eye(4))
    rhs = (np.kron(a, g) + left * right * np.eye(12) + left * np.kron(np.eye(3), g)
           + right * np.kron(a, np.eye(4)))
    assert_allclose_normwise(lhs, rhs, 1e-13)
    two = K.pi_adjusted_damping(xp.asarray(a), xp.asarray(g), 0.09, norm_type="2_norm")
    pi2 = math.sqrt(np.linalg.norm(a, 2) / np.linalg.norm(g, 2))
    assert math.isclose(float(two[0]), pi2 * 0.3, rel_tol=xp.rtol)


# --------------------------------------------------------------------------------------
# Kronecker products
# --------------------------------------------------------------------------------------
def test_kron_against_numpy_rectangular(xp, rng):
    a = xp.round_host(rng.standard_normal((2, 3)))
    b = xp.round_host(rng.standard_normal((4, 1)))
    xp.assert_close(K.kron(xp.asarray(a), xp.asarray(b)), np.kron(a, b))


@given(seed=seeds, p=dims, q=dims, order=st.sampled_from(["C", "F"]))
def test_kron_matvec_flat_is_dense_product_in_both_orders(xp, seed, p, q, order):
    r = np.random.default_rng(seed)
    a, b = xp.round_host(r.standard_normal((p, p))), xp.round_host(r.standard_normal((q, q)))
    x = xp.round_host(r.standard_normal(p * q))
    out = K.kron_matvec(xp.asarray(a), xp.asarray(b), xp.asarray(x), order=order)
    xp.assert_close(out, np.kron(a, b) @ x, rtol=(p + q) * 4 * xp.eps * 16)


@given(seed=seeds, p=dims, q=dims)
def test_kron_identities_both_vec_conventions(xp, seed, p, q):
    """row-major: (A⊗B) vec_r(X) = vec_r(A X Bᵀ), X [p, q];
    column-major: (A⊗B) vec_c(X) = vec_c(B X Aᵀ), X [q, p]."""
    r = np.random.default_rng(seed)
    a, b = xp.round_host(r.standard_normal((p, p))), xp.round_host(r.standard_normal((q, q)))
    tol = (p + q) * 64 * xp.eps
    xc = xp.round_host(r.standard_normal((p, q)))
    out_c = K.kron_matvec(xp.asarray(a), xp.asarray(b), xp.asarray(xc), order="C")
    xp.assert_close(out_c, (np.kron(a, b) @ xc.reshape(-1)).reshape(p, q), rtol=tol)
    xf = xp.round_host(r.standard_normal((q, p)))
    out_f = K.kron_matvec(xp.asarray(a), xp.asarray(b), xp.asarray(xf), order="F")
    dense_f = np.kron(a, b) @ xf.reshape(-1, order="F")
    xp.assert_close(out_f, dense_f.reshape(q, p, order="F"), rtol=tol)


def test_kron_matvec_batched_matrices(xp, rng):
    a, b = xp.round_host(rng.standard_normal((3, 2))), xp.round_host(rng.standard_normal((4, 5)))
    x = xp.round_host(rng.standard_normal((6, 2, 5)))
    out = K.kron_matvec(xp.asarray(a), xp.asarray(b), xp.asarray(x))
    expected = np.stack([(np.kron(a, b) @ xi.reshape(-1)).reshape(3, 4) for xi in x])
    xp.assert_close(out, expected)


def test_kron_matmat(xp, rng):
    a, b = xp.round_host(rng.standard_normal((3, 2))), xp.round_host(rng.standard_normal((4, 5)))
    x = xp.round_host(rng.standard_normal((10, 7)))
    xp.assert_close(K.kron_matmat(xp.asarray(a), xp.asarray(b), xp.asarray(x)),
                    np.kron(a, b) @ x)


@pytest.mark.parametrize("power", POWERS)
@pytest.mark.parametrize("damping", [0.0, 0.2])
@pytest.mark.parametrize("method", ["factored", "exact"])
def test_kron_damped_matpower_against_dense(xp, rng, power, damping, method):
    a = xp.round_host(random_spd(rng, 3))
    b = xp.round_host(random_spd(rng, 4))
    x = xp.round_host(rng.standard_normal(12))
    if method == "factored":
        pi = math.sqrt((np.trace(a) / 3) / (np.trace(b) / 4))
        g = math.sqrt(damping)
        dense = np.kron(frac_power(a + pi * g * np.eye(3), power),
                        frac_power(b + g / pi * np.eye(4), power))
    else:
        dense = frac_power(np.kron(a, b) + damping * np.eye(12), power)
    out = K.kron_damped_matpower_matvec(xp.asarray(a), xp.asarray(b), xp.asarray(x), power,
                                        damping, method)
    xp.assert_close(out, dense @ x)


@pytest.mark.parametrize("method", ["factored", "exact"])
def test_kron_damped_inverse_undoes_damped_product(xp, rng, method):
    """Inverse times the damped matrix is the identity (matrix form, both orders)."""
    a = xp.round_host(random_spd(rng, 3))
    b = xp.round_host(random_spd(rng, 2))
    lam = 0.5
    if method == "exact":
        damped = np.kron(a, b) + lam * np.eye(6)
    else:
        left, right = K.pi_adjusted_damping(a, b, lam)
        damped = np.kron(a + left * np.eye(3), b + right * np.eye(2))
    for order, shape in (("C", (3, 2)), ("F", (2, 3))):
        v = xp.round_host(rng.standard_normal(shape))
        vec = v.reshape(-1, order=order)
        y = xp.to_numpy(K.kron_damped_inverse_matvec(
            xp.asarray(a), xp.asarray(b), xp.asarray(v), lam, method, order=order))
        assert y.shape == shape
        assert_allclose_normwise(damped @ y.reshape(-1, order=order), vec, xp.rtol)


def test_kron_damped_matpower_clipping_prevents_nan(xp, rng):
    """A rank-deficient factor with tiny damping and power -0.5: clipped eigenvalues keep
    the result finite (TF K-FAC clips at EIGENVALUE_CLIPPING_THRESHOLD for this reason)."""
    a = xp.round_host(random_psd(rng, 4, 1))
    b = xp.round_host(random_spd(rng, 2))
    x = xp.asarray(rng.standard_normal(8))
    if not xp.float64:
        # λ = 1e-6 is below n·eps·σ_max ≈ 3e-5 of float32: the eigenvalue noise of A is as
        # large as the damping, so the singular-matrix rule refuses the power.
        with pytest.raises(KFACValueError, match="numerically singular"):
            K.kron_damped_matpower_matvec(xp.asarray(a), xp.asarray(b), x, -0.5, 1e-6, "exact")
        return
    out = K.kron_damped_matpower_matvec(xp.asarray(a), xp.asarray(b), x, -0.5, 1e-6, "exact")
    xp.check(out)
    assert np.all(np.isfinite(xp.to_numpy(out)))


# --------------------------------------------------------------------------------------
# Error paths
# --------------------------------------------------------------------------------------
def test_error_paths(xp):
    m = xp.asarray(random_spd(np.random.default_rng(0), 3))
    v = xp.asarray(np.ones(6))
    bad = [
        (lambda: K.compute_cov(xp.asarray(np.ones((2, 3, 1)))), KFACValueError,
         r"compute_cov: tensor must be a 2-D array \[n, d\]; got a 3-D"),
        (lambda: K.compute_cov(xp.asarray(np.ones((3, 2))), xp.asarray(np.ones((2, 2)))),
         KFACValueError, r"compute_cov: tensor_right must have as many rows as tensor \(3\)"),
        (lambda: K.compute_cov(xp.asarray(np.ones((3, 2))), normalizer=0), KFACValueError,
         "compute_cov: normalizer must be positive"),
        (lambda: K.compute_cov(xp.asarray(np.ones((0, 2)))), KFACValueError, "at least one row"),
        (lambda: K.compute_cov(xp.asarray(np.array([[np.nan]]))), KFACValueError, "finite"),
        (lambda: K.append_homog(xp.asarray(np.array(1.0))), KFACValueError, "at least 1 dim"),
        (lambda: K.append_homog(xp.asarray(np.ones(2)), homog_value="1"), KFACTypeError,
         "homog_value must be a real number"),
        (lambda: K.clipped_eigh(xp.asarray(np.ones((2, 3)))), KFACValueError, "square"),
        (lambda: K.damped_matpower(xp.asarray(np.array([[1.0, 2.0], [0.0, 1.0]])), -1),
         KFACValueError, "damped_matpower: matrix must be a symmetric matrix"),
        (lambda: K.damped_matpower(m, -1, damping=-0.1), KFACValueError,
         "damped_matpower: damping must be non-negative"),
        (lambda: K.damped_matpower(m, "inv"), KFACTypeError, "power must be a real number"),
        (lambda: K.damped_matpower(xp.asarray(np.zeros((2, 2))), -1), KFACValueError,
         "must be positive definite for the negative exponent"),
        (lambda: K.damped_cholesky(xp.asarray(-np.eye(2))), KFACValueError,
         "damped_cholesky: matrix \\+ damping·I must be positive definite"),
        (lambda: K.damped_cholesky_inverse(m, -1.0), KFACValueError, "non-negative"),
        (lambda: K.damped_inverse(xp.asarray(np.zeros((2, 2)))), KFACValueError,
         "positive definite"),
        (lambda: K.factor_norm(m, "trace"), KFACValueError,
         "factor_norm: norm_type must be one of 'avg_diag', 'avg_fro', '2_norm', '1_norm'"),
        (lambda: K.factor_norm(xp.asarray(np.ones((2, 2, 2)))), KFACValueError, "0-D or 1-D or"),
        (lambda: K.factor_norm(xp.asarray(np.ones(0))), KFACValueError, "must not be empty"),
        (lambda: K.pi_tracenorm(m, xp.asarray(np.ones((2, 3)))), KFACValueError, "square"),
        (lambda: K.pi_adjusted_damping(m, m, -1.0), KFACValueError, "non-negative"),
        (lambda: K.kron(m, xp.asarray(np.ones(2))), KFACValueError, "kron: b must be a 2-D"),
        (lambda: K.kron_matvec(m, m, xp.asarray(np.ones(8))), KFACValueError,
         r"kron_matvec: x must be a flat vector of length 9 \(= 3·3\)"),
        (lambda: K.kron_matvec(m, m, xp.asarray(np.ones((3, 2))), order="C"), KFACValueError,
         r"x must be \[..., 3, 3\] for order='C'"),
        (lambda: K.kron_matvec(m, m, v, order="K"), KFACValueError, "order must be one of"),
        (lambda: K.kron_matmat(m, m, xp.asarray(np.ones((8, 2)))), KFACValueError,
         r"kron_matmat: x must be an array of shape \(9, \*\)"),
        (lambda: K.kron_damped_matpower_matvec(m, m, xp.asarray(np.ones(9)),
                                               damping_method="unsplit"),
         KFACValueError, "damping_method must be one of 'factored', 'exact'"),
        (lambda: K.kron_damped_inverse_matvec(m, m, xp.asarray(np.ones(9)), -1.0),
         KFACValueError, "kron_damped_inverse_matvec: damping must be non-negative"),
        (lambda: K.kron_damped_inverse_matvec(m, m, xp.asarray(np.ones(9)), norm_type="fro"),
         KFACValueError, "norm_type must be one of"),
    ]
    for call, exc, message in bad:
        with pytest.raises(exc, match=message):
            call()


def test_integer_input_rejected(xp):
    ints = xp.asarray(np.ones((2, 2), dtype=np.int64))
    with pytest.raises(KFACTypeError, match="compute_cov: tensor must be an array of real "
                       "floating dtype"):
        K.compute_cov(ints)


def test_mixed_namespaces_and_devices_rejected():
    import array_api_strict as xs

    with pytest.raises(KFACTypeError, match="one array namespace"):
        K.kron_matvec(np.eye(2), xs.eye(2), np.ones(4))
    with pytest.raises(KFACTypeError, match="one device"):
        K.kron_matvec(xs.eye(2), xs.eye(2, device=xs.Device("device1")), xs.ones(4))
    with pytest.raises(KFACInputError):
        K.compute_cov([[1.0, 2.0]])


@pytest.mark.parametrize("diagonal_b", [False, True])
def test_kron_eigenbasis_matpower_against_dense(xp, rng, diagonal_b):
    """(c A⊗B + λI)^p from eigendecompositions; a diagonal factor passes q = None."""
    a = xp.round_host(random_spd(rng, 3))
    b = xp.round_host(np.diag(rng.uniform(0.5, 2.0, 2)) if diagonal_b else random_spd(rng, 2))
    x = xp.round_host(rng.standard_normal((4, 3, 2)))  # a batch of matrices
    s_a, q_a = np.linalg.eigh(a)
    s_b, q_b = (np.diag(b), None) if diagonal_b else np.linalg.eigh(b)
    out = K.kron_eigenbasis_matpower(
        xp.asarray(s_a), xp.asarray(q_a), xp.asarray(s_b),
        None if q_b is None else xp.asarray(q_b), xp.asarray(x), -0.5, 0.3, 2.5)
    dense = frac_power(2.5 * np.kron(a, b) + 0.3 * np.eye(6), -0.5)
    expected = np.stack([(dense @ xi.reshape(-1)).reshape(3, 2) for xi in x])
    xp.assert_close(out, expected)
    with pytest.raises(KFACValueError, match=r"kron_eigenbasis_matpower: x must be \[..., 3, 2\]"):
        K.kron_eigenbasis_matpower(xp.asarray(s_a), xp.asarray(q_a), xp.asarray(s_b), None,
                                   xp.asarray(np.ones((2, 3))), 1.0)
    with pytest.raises(KFACValueError, match="scale must be positive"):
        K.kron_eigenbasis_matpower(xp.asarray(s_a), None, xp.asarray(s_b), None,
                                   xp.asarray(np.ones((3, 2))), 1.0, scale=0.0)


# --------------------------------------------------------------------------------------
# One rule for negative powers of numerically singular matrices
# --------------------------------------------------------------------------------------
def _rank2(n=4):
    x = np.random.default_rng(3).standard_normal((2, n))
    m = x.T @ x
    return (m + m.T) / 2


@pytest.mark.parametrize("call", [
    lambda m: K.damped_matpower(m, -1.0),
    lambda m: K.damped_matpower(m, -0.5),
    lambda m: K.damped_inverse(m),
    lambda m: K.damped_cholesky(m),
    lambda m: K.damped_cholesky_inverse(m),
    lambda m: K.kron_damped_inverse_matvec(m, np.eye(2), np.ones(8)),
    lambda m: K.kron_damped_inverse_matvec(m, np.eye(2), np.ones(8), damping_method="exact"),
    lambda m: K.kron_damped_matpower_matvec(m, np.eye(2), np.ones(8), -0.5),
    lambda m: K.kron_eigenbasis_matpower(*np.linalg.eigh(m), np.ones(2), None,
                                         np.ones((4, 2)), -1.0),
], ids=["matpower-1", "matpower-0.5", "inverse", "cholesky", "cholesky_inverse",
        "kron_factored", "kron_exact", "kron_matpower", "kron_eigenbasis"])
def test_negative_powers_of_singular_matrices_all_raise(call):
    """A rank-2 PSD 4×4 matrix at damping 0: every function refuses it with one rule (its
    rounding-level eigenvalues once gave damped_matpower 3e16 silently)."""
    with pytest.raises(KFACValueError, match="positive definite.*Add damping"):
        call(_rank2())


def test_singular_rule_is_relative_and_damping_clears_it():
    m = _rank2()
    # the same matrix scaled by 1e-20 is just as singular: the threshold is relative
    with pytest.raises(KFACValueError, match="numerically singular"):
        K.damped_matpower(1e-20 * m, -1.0)
    # a small damping well above n·eps·σ_max makes every path accept it and agree
    lam = 1e-6
    expected = np.linalg.inv(m + lam * np.eye(4))
    for got in (K.damped_matpower(m, -1.0, lam), K.damped_inverse(m, lam)):
        assert_allclose_normwise(got, expected, 1e-6)
    # value checks off: the rule is a value check, the arithmetic runs
    with K.value_checks(False), np.errstate(divide="ignore"):
        out = K.damped_matpower(m, -1.0)
    assert out.shape == (4, 4)
