"""Embedding (one-hot id) and dense diagonal Kronecker factors against explicit counts and
dense sums; dtype handling; the bad-id error paths."""

import numpy as np
import pytest

import kfac_ref.factors as F
from kfac_ref import KFACTypeError, KFACValueError


def count_loop(ids, vocab):
    ids = np.asarray(ids)
    out = np.zeros(vocab)
    for row in ids.reshape(ids.shape[0], -1):
        for i in row:
            out[i] += 1.0
    return out / ids.shape[0]


def test_embedding_factor_counts(xp, rng):
    ids = rng.integers(0, 6, size=(7,))
    got = F.embedding_input_kronecker_factor(xp.asarray(ids), 9)
    expected_dtype = xp.xp.float64 if xp.float64 else xp.dtype
    xp.check(got, dtype=expected_dtype)
    np.testing.assert_allclose(xp.to_numpy(got), count_loop(ids, 9), rtol=xp.rtol)
    # equals the diagonal of the dense FC factor of the one-hot inputs (exact for one id/row)
    onehot = np.eye(9)[ids]
    np.testing.assert_allclose(xp.to_numpy(got), np.diag(onehot.T @ onehot / 7), rtol=xp.rtol)


def test_embedding_factor_several_ids_per_row(xp, rng):
    ids = np.array([[1, 1, 3], [0, 3, 3]])  # a repeated id counts c, not c²
    got = F.embedding_input_kronecker_factor(xp.asarray(ids), 5)
    np.testing.assert_allclose(xp.to_numpy(got), [0.5, 1.0, 0.0, 1.5, 0.0], rtol=xp.rtol)
    got32 = F.embedding_input_kronecker_factor(xp.asarray(ids), 5, dtype="float32")
    xp.check(got32, dtype=xp.xp.float32)


@pytest.mark.parametrize("has_bias", [False, True])
def test_diagonal_kronecker_factor_dense(xp, rng, has_bias):
    x = xp.round_host(rng.standard_normal((6, 3)))
    full = xp.to_numpy(F.fully_connected_kronecker_factor(xp.asarray(x), has_bias))
    got = F.diagonal_kronecker_factor(xp.asarray(x), has_bias)
    xp.assert_close(got, np.diag(full))  # the diagonal of the dense factor; bias entry 1
    x3 = xp.round_host(rng.standard_normal((2, 4, 3)))
    xp.assert_close(F.diagonal_kronecker_factor(xp.asarray(x3), has_bias),
                    np.append((x3.reshape(8, 3) ** 2).mean(0), [1.0] * has_bias))


def test_embedding_classes(xp, rng):
    towers = [rng.integers(0, 4, size=(5, 2)) for _ in range(2)]
    f = F.EmbeddingInputKroneckerFactor(4).update_cov([xp.asarray(t) for t in towers],
                                                      ema_decay=0.7)
    np.testing.assert_allclose(xp.to_numpy(f.cov),
                               (count_loop(towers[0], 4) + count_loop(towers[1], 4)) / 2,
                               rtol=xp.rtol)
    inv = xp.to_numpy(f.get_inverse(0.1))
    np.testing.assert_allclose(inv, 1 / (xp.to_numpy(f.cov) + 0.1), rtol=xp.rtol)

    ids = rng.integers(0, 4, size=(6,))
    g = F.DiagonalKroneckerFactor(has_bias=True, vocab_size=4).update_cov(xp.asarray(ids),
                                                                         ema_decay=0.0)
    np.testing.assert_allclose(xp.to_numpy(g.cov), np.append(count_loop(ids, 4), 1.0),
                               rtol=xp.rtol)
    m = F.DiagonalMultiKF(3, vocab_size=4).update_cov(xp.asarray(ids.reshape(3, 2)),
                                                      ema_decay=0.0)
    np.testing.assert_allclose(xp.to_numpy(m.cov), count_loop(ids, 4), rtol=xp.rtol)
    x = xp.round_host(rng.standard_normal((3, 2, 4)))
    md = F.DiagonalMultiKF(3).update_cov(xp.asarray(x), ema_decay=0.0)
    xp.assert_close(md.cov, (x.reshape(6, 4) ** 2).mean(0))


def test_embedding_errors(xp, rng):
    with pytest.raises(KFACTypeError, match="integral"):
        F.embedding_input_kronecker_factor(xp.asarray(np.array([0.0, 1.0])), 3)
    with pytest.raises(KFACValueError, match=r"\[0, vocab_size\)"):
        F.embedding_input_kronecker_factor(xp.asarray(np.array([0, 3])), 3)
    with pytest.raises(KFACValueError, match=r"\[0, vocab_size\)"):
        F.embedding_input_kronecker_factor(xp.asarray(np.array([-1, 2])), 3)
    with pytest.raises(KFACValueError, match="1-D or 2-D"):
        F.embedding_input_kronecker_factor(xp.asarray(np.zeros((2, 2, 2), dtype=np.int64)), 3)
    with pytest.raises(KFACValueError, match="integer >= 1"):
        F.embedding_input_kronecker_factor(xp.asarray(np.array([0])), 0)
    with pytest.raises(KFACTypeError, match="an integer"):
        F.embedding_input_kronecker_factor(xp.asarray(np.array([0])), 3.5)
    with pytest.raises(KFACTypeError, match="dtype must be"):
        F.embedding_input_kronecker_factor(xp.asarray(np.array([0])), 3, dtype="int32")
    with pytest.raises(KFACValueError, match="at least one row"):
        F.embedding_input_kronecker_factor(xp.asarray(np.zeros((0,), dtype=np.int64)), 3)
    with pytest.raises(KFACValueError, match="1-D"):
        F.DiagonalKroneckerFactor(vocab_size=3).update_cov(
            xp.asarray(np.zeros((2, 2), dtype=np.int64)), ema_decay=0.5)
    with pytest.raises(KFACValueError, match="2-D or 3-D"):
        F.diagonal_kronecker_factor(xp.asarray(rng.standard_normal(3)))
