"""Naive ("square of the sum") factors against dense sums, sources summed, and errors."""

import numpy as np
import pytest

import kfac_ref.factors as F
from kfac_ref import KFACTypeError, KFACValueError


def test_naive_diagonal_and_full_dense_sums(xp, rng):
    w = xp.round_host(rng.standard_normal((3, 2)))
    b = xp.round_host(rng.standard_normal(2))
    v = np.concatenate([w.reshape(-1), b])  # row-major, parameters in the order given
    params = [xp.asarray(w), xp.asarray(b)]
    xp.assert_close(F.naive_diagonal_factor(params, 4), v**2 / 4)
    full = np.array([[v[i] * v[j] for j in range(8)] for i in range(8)]) / 4
    got = F.full_factor(params, 4)
    xp.assert_close(got, full)
    np.testing.assert_array_equal(xp.to_numpy(got), xp.to_numpy(got).T)
    xp.assert_close(F.params_grads_to_vector(params), v)
    xp.assert_close(F.naive_diagonal_factor(xp.asarray(w), 2), w.reshape(-1) ** 2 / 2)


def test_naive_estimator_is_square_of_sum(xp, rng):
    """With per-example gradients g_n the statistic is (Σ_n g_n)²/N, not Σ_n g_n²/N."""
    per_example = xp.round_host(rng.standard_normal((5, 3)))
    total = per_example.sum(axis=0)
    got = xp.to_numpy(F.naive_diagonal_factor(xp.asarray(total), 5))
    np.testing.assert_allclose(got, total**2 / 5, rtol=xp.rtol)
    assert not np.allclose(got, (per_example**2).mean(axis=0))


def test_naive_classes_sum_sources(xp, rng):
    srcs = [[xp.round_host(rng.standard_normal((2, 2))), xp.round_host(rng.standard_normal(3))]
            for _ in range(3)]
    vs = [np.concatenate([a.reshape(-1), b]) for a, b in srcs]
    data = [[xp.asarray(a), xp.asarray(b)] for a, b in srcs]
    fd = F.NaiveDiagonalFactor(6).update_cov(data, ema_decay=0.9)
    xp.assert_close(fd.cov, sum(v**2 for v in vs) / 6)
    ff = F.FullFactor(6).update_cov(data, ema_decay=0.9).register_inverse(0.5).update_inverses()
    full = sum(np.outer(v, v) for v in vs) / 6
    xp.assert_close(ff.cov, full)
    xp.assert_close(ff.get_inverse(0.5), np.linalg.inv(full + 0.5 * np.eye(7)))
    xp.assert_close(fd.get_inverse(0.5), 1 / (sum(v**2 for v in vs) / 6 + 0.5))
    assert F.NaiveFullFactor is F.FullFactor


def test_naive_errors(xp, rng):
    g = xp.asarray(rng.standard_normal(3))
    with pytest.raises(KFACValueError, match="positive"):
        F.naive_diagonal_factor(g, 0)
    with pytest.raises(KFACTypeError, match="real number"):
        F.full_factor(g, "4")
    with pytest.raises(KFACTypeError, match="params_grads must be"):
        F.naive_diagonal_factor([], 4)
    with pytest.raises(KFACTypeError, match="floating"):
        F.full_factor(xp.asarray(np.arange(3)), 4)
    bad = np.ones(3)
    bad[1] = np.nan
    with pytest.raises(KFACValueError, match=r"naive_diagonal_factor: params_grads\[1\] .*finite"):
        F.naive_diagonal_factor([g, xp.asarray(bad)], 4)  # errors under the public name
    with pytest.raises(KFACValueError, match=r"full_factor: params_grads\[0\] .*finite"):
        F.full_factor(xp.asarray(bad), 4)
    with pytest.raises(KFACValueError, match="same parameter shapes"):
        F.NaiveDiagonalFactor(2).update_cov([[g], [xp.asarray(rng.standard_normal(4))]],
                                            ema_decay=0.5)
