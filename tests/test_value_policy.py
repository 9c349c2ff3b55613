"""One policy for bad values that are not checked (value checks off, traced or lazy arrays):
NaN/Inf results, on the eigendecomposition, SVD and Cholesky paths alike — never a linear
algebra library's own error, never a kfac_ref value check that was switched off, never
finite numbers from a NaN input.  (Sampling from NaN parameters: test_losses_validation.)"""

from __future__ import annotations

import numpy as np
import pytest

import kfac_ref
from kfac_ref import KFACValueError, blocks, factors, linalg, spectral


def _spd(rng, n):
    m = rng.standard_normal((n, n + 2))
    return m @ m.T / n + 0.1 * np.eye(n)


def _with_nan(a):
    a = np.array(a, copy=True)
    a[0, 0] = np.nan
    return a


def _all_nan(xp, *arrays):
    return all(np.isnan(xp.to_numpy(a)).all() for a in arrays)


@pytest.fixture
def data():
    rng = np.random.default_rng(4)
    return _spd(rng, 4), _spd(rng, 3), rng.standard_normal((4, 3))


def test_decompositions_of_a_nan_matrix_are_nan(xp, data):
    """LAPACK raises on a NaN matrix, PyTorch and JAX may return finite eigenvalues: every
    output of an eigendecomposition (eigh, eigvalsh) and an SVD is NaN instead."""
    a, b, _ = data
    bad = xp.asarray(_with_nan(a))
    with kfac_ref.value_checks(False):
        s, q = linalg.clipped_eigh(bad)
        assert _all_nan(xp, s, q)
        assert _all_nan(xp, linalg.damped_matpower(bad, -0.5, 0.1))
        assert _all_nan(xp, linalg.factor_norm(bad, "2_norm"))  # eigvalsh
        assert _all_nan(xp, spectral.kron_eigenvalues(bad, xp.asarray(b), 0.1))
        # the option-2 quantities go through an SVD of the damped factor
        for out in factors.series_option2_quantities(bad, xp.asarray(a), 0.1):
            assert np.isnan(xp.to_numpy(out)).any()


def test_the_same_matrix_with_value_checks_on_is_refused_at_the_door(xp, data):
    a, _, _ = data
    with pytest.raises(KFACValueError, match=r"clipped_eigh: matrix must be finite"):
        linalg.clipped_eigh(xp.asarray(_with_nan(a)))


def test_a_finite_matrix_is_decomposed_as_before(xp, data):
    """The policy's guard adds nothing to a finite matrix: A = Q diag(s) Qᵀ still holds."""
    a, _, _ = data
    s, q = linalg.clipped_eigh(xp.asarray(a))
    s, q = xp.to_numpy(s), xp.to_numpy(q)
    np.testing.assert_allclose(q @ np.diag(s) @ q.T, xp.round_host(a),
                               rtol=0, atol=50 * xp.eps)


def test_cholesky_and_eigh_paths_agree_on_nan(xp, data):
    """The inverse (Cholesky) and the inverse square root (eigendecomposition) of a NaN
    factor are both NaN with value checks off, neither an error."""
    a, _, _ = data
    bad = xp.asarray(_with_nan(a))
    with kfac_ref.value_checks(False):
        assert np.isnan(xp.to_numpy(linalg.damped_inverse(bad, 0.1))).any()
        assert _all_nan(xp, linalg.damped_matpower(bad, -0.5, 0.1))


def test_switched_off_checks_of_diagonal_and_tridiagonal_inverses(xp, data):
    """The positivity checks of a diagonal factor's power and of the block-tridiagonal
    inverse are value checks: with value checks off a NaN gives NaN, not their error."""
    a, b, x = data
    rng = np.random.default_rng(5)
    inputs, grads = rng.standard_normal((6, 2)), rng.standard_normal((6, 2))
    inputs[0, 0] = np.nan
    with kfac_ref.value_checks(False):
        factor = factors.FullyConnectedDiagonalFactor(has_bias=False).update_cov(
            xp.asarray(inputs), xp.asarray(grads), ema_decay=0.0)
        assert np.isnan(xp.to_numpy(factor.get_matpower(-1, 0.1))).any()
        out = blocks.kronecker_difference_inverse(
            xp.asarray(_with_nan(a)), xp.asarray(b), xp.asarray(0.1 * a),
            xp.asarray(0.1 * b), xp.asarray(x))
    assert _all_nan(xp, out)
    with pytest.raises(KFACValueError, match="finite"):
        blocks.kronecker_difference_inverse(xp.asarray(_with_nan(a)), xp.asarray(b),
                                            xp.asarray(0.1 * a), xp.asarray(0.1 * b),
                                            xp.asarray(x))


def test_nan_matrix_under_jit_gives_nan():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    a = _with_nan(_spd(np.random.default_rng(4), 4)).astype(np.float32)
    s, q = jax.jit(linalg.clipped_eigh)(jnp.asarray(a))
    assert np.isnan(np.asarray(s)).all() and np.isnan(np.asarray(q)).all()
