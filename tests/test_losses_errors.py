"""Loss functions: bad input raises a clear KFACValueError / KFACTypeError naming the
argument, on every backend."""

from __future__ import annotations

import numpy as np
import pytest

from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref import losses as L

CAT = L.CategoricalLogitsNegativeLogProbLoss
ONEHOT = L.OneHotCategoricalLogitsNegativeLogProbLoss
BERN = L.MultiBernoulliNegativeLogProbLoss
NORMAL = L.NormalMeanNegativeLogProbLoss
MV = L.NormalMeanVarianceNegativeLogProbLoss


def _z(xp, shape=(3, 4), seed=0):
    return xp.asarray(np.random.default_rng(seed).standard_normal(shape))


def _ints(xp, values):
    return xp.asarray(np.asarray(values, dtype=np.int64))


def test_categorical_constructor_errors(xp):
    z = _z(xp)
    with pytest.raises(KFACValueError, match=r"CategoricalLogitsNegativeLogProbLoss: logits "
                       r"must be a 2-D array \[N, k\]; got a 1-D"):
        CAT(_z(xp, (4,)))
    with pytest.raises(KFACValueError, match="logits must be a 2-D array"):
        CAT(_z(xp, (2, 3, 4)))
    with pytest.raises(KFACValueError, match=r"logits must have at least one class"):
        CAT(_z(xp, (2, 0)))
    with pytest.raises(KFACTypeError, match="logits must be an array of real floating dtype"):
        CAT(_ints(xp, [[1, 2], [3, 4]]))
    with pytest.raises(KFACValueError, match="logits must be finite"):
        CAT(xp.asarray(np.array([[0.0, np.nan]])))
    with pytest.raises(KFACValueError, match=r"targets must be an array of shape \(3\)"):
        CAT(z, _ints(xp, [[0], [1], [2]]))
    with pytest.raises(KFACValueError, match=r"targets must be an array of shape \(3\)"):
        CAT(z, _ints(xp, [0, 1]))
    with pytest.raises(KFACTypeError, match="targets must be an array of integral dtype"):
        CAT(z, xp.asarray(np.array([0.0, 1.0, 2.0])))
    with pytest.raises(KFACValueError, match=r"targets must be class indices in \[0, 4\); "
                       r"got values in \[0, 4\]"):
        CAT(z, _ints(xp, [0, 4, 1]))
    with pytest.raises(KFACValueError, match=r"class indices in \[0, 4\); got values in \[-1"):
        CAT(z, _ints(xp, [0, -1, 1]))
    with pytest.raises(KFACValueError, match=r"mask must be an array of shape \(3\)"):
        CAT(z, mask=xp.asarray(np.ones(4)))
    with pytest.raises(KFACValueError, match=r"mask must be an array of shape \(3\)"):
        CAT(z, mask=xp.asarray(np.ones((3, 1))))
    with pytest.raises(KFACValueError, match="mask must hold only 0 and 1; got 1 other value"):
        CAT(z, mask=xp.asarray(np.array([1.0, 0.5, 0.0])))
    with pytest.raises(KFACValueError, match="mask must be finite"):
        CAT(z, mask=xp.asarray(np.array([1.0, np.nan, 0.0])))
    with pytest.raises(KFACValueError, match="weight must be non-negative; got -1"):
        CAT(z, weight=-1.0)
    with pytest.raises(KFACTypeError, match="weight must be a real number"):
        CAT(z, weight="1")
    with pytest.raises(KFACValueError, match="weight must be finite"):
        CAT(z, weight=float("nan"))


def test_onehot_target_errors(xp):
    z = _z(xp, (2, 3))
    with pytest.raises(KFACValueError, match=r"targets must be an array of shape \(2, 3\)"):
        ONEHOT(z, _ints(xp, [0, 1]))
    with pytest.raises(KFACValueError, match="targets must be one-hot rows"):
        ONEHOT(z, xp.asarray(np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])))
    with pytest.raises(KFACValueError, match="targets must be one-hot rows"):
        ONEHOT(z, xp.asarray(np.array([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])))
    with pytest.raises(KFACValueError, match="targets must be one-hot rows"):
        ONEHOT(z, xp.asarray(np.zeros((2, 3))))


def test_bernoulli_errors(xp):
    z = _z(xp, (2, 3))
    with pytest.raises(KFACValueError, match=r"logits must be an array of at least 2 dim"):
        BERN(_z(xp, (3,)))
    with pytest.raises(KFACValueError, match=r"targets must be an array of shape \(2, 3\)"):
        BERN(z, xp.asarray(np.zeros((3, 2))))
    with pytest.raises(KFACValueError, match=r"targets must lie in \[0, 1\]; got values in "
                       r"\[0.0, 2.0\]"):
        BERN(z, xp.asarray(np.array([[0.0, 1.0, 2.0], [0.0, 0.0, 0.0]])))
    with pytest.raises(KFACValueError, match=r"targets must lie in \[0, 1\]"):
        BERN(z, _ints(xp, [[0, 1, -1], [0, 0, 0]]))
    with pytest.raises(KFACValueError, match="targets must be finite"):
        BERN(z, xp.asarray(np.array([[0.0, 1.0, np.inf], [0.0, 0.0, 0.0]])))


def test_bernoulli_float_target_dtype_must_match(xp):
    if not xp.float64:
        pytest.skip("needs a float64 and a float32 array on one device")
    z = _z(xp, (2, 3))
    t32 = xp.xp.asarray(np.zeros((2, 3)), dtype=xp.xp.float32, device=xp.device)
    with pytest.raises(KFACTypeError, match="targets must have the floating dtype of logits"):
        BERN(z, t32)
    m32 = xp.xp.asarray(np.zeros((2, 3)), dtype=xp.xp.float32, device=xp.device)
    with pytest.raises(KFACTypeError, match="variance must have the floating dtype of mean"):
        MV(z, m32 + 1.0)
    loss = CAT(z)
    with pytest.raises(KFACTypeError, match=r"vector\[0\] must have the floating dtype of"):
        loss.multiply_fisher((m32,))


def test_normal_errors(xp):
    m = _z(xp, (2, 3))
    for bad in (0.0, -1.0):
        with pytest.raises(KFACValueError, match="NormalMeanNegativeLogProbLoss: variance must "
                           "be positive"):
            NORMAL(m, variance=bad)
    with pytest.raises(KFACValueError, match="variance must be finite"):
        NORMAL(m, variance=float("inf"))
    with pytest.raises(KFACTypeError, match="variance must be a real number"):
        NORMAL(m, variance=None)
    with pytest.raises(KFACValueError, match=r"mean must be an array of at least 2 dim"):
        NORMAL(_z(xp, (3,)))
    with pytest.raises(KFACValueError, match=r"targets must be an array of shape \(2, 3\)"):
        NORMAL(m, _z(xp, (2, 2)))
    with pytest.raises(KFACTypeError, match="normalize_log_prob must be a bool"):
        NORMAL(m, normalize_log_prob=1)


def test_mean_variance_errors(xp):
    m = _z(xp, (2, 3))
    v = xp.asarray(np.ones((2, 3)))
    with pytest.raises(KFACValueError, match=r"variance must be strictly positive; got "
                       r"minimum 0.0"):
        MV(m, xp.asarray(np.array([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])))
    with pytest.raises(KFACValueError, match=r"variance must be strictly positive; got "
                       r"minimum -2"):
        MV(m, xp.asarray(np.array([[1.0, -2.0, 1.0], [1.0, 1.0, 1.0]])))
    with pytest.raises(KFACValueError, match=r"variance must be an array of shape \(2, 3\)"):
        MV(m, xp.asarray(np.ones((2, 2))))
    with pytest.raises(KFACValueError, match="variance must be finite"):
        MV(m, xp.asarray(np.array([[1.0, np.nan, 1.0], [1.0, 1.0, 1.0]])))
    with pytest.raises(KFACValueError, match=r"mean must be a 2-D array \[N, d\]"):
        MV(_z(xp, (2, 3, 1)), xp.asarray(np.ones((2, 3, 1))))
    with pytest.raises(KFACValueError, match=r"targets must be an array of shape \(2, 3\)"):
        MV(m, v, _z(xp, (3, 2)))
    loss = MV(m, v)
    with pytest.raises(KFACValueError, match="hessian_matrix: targets must be given"):
        loss.hessian_matrix()


def test_method_argument_errors(xp):
    z = _z(xp)
    loss = CAT(z)
    name = "CategoricalLogitsNegativeLogProbLoss"
    with pytest.raises(KFACValueError, match=fr"{name}.evaluate: targets must be given"):
        loss.evaluate()
    with pytest.raises(KFACValueError, match=fr"{name}.grad_of_evaluate: targets must be given"):
        loss.grad_of_evaluate()
    with pytest.raises(KFACValueError, match="coefficient_mode must be one of 'regular', "
                       "'sqrt', 'off'; got 'half'"):
        loss.evaluate(_ints(xp, [0, 1, 2]), coefficient_mode="half")
    with pytest.raises(KFACValueError, match=r"targets must be class indices"):
        loss.evaluate(_ints(xp, [0, 1, 9]))
    # vectors: tuples of the right length, shape and dtype
    with pytest.raises(KFACValueError, match=fr"{name}.multiply_fisher: vector must be a tuple "
                       r"of 1 array\(s\) of shape\(s\) \(3, 4\); got a 2-D"):
        loss.multiply_fisher(z)
    with pytest.raises(KFACValueError, match=r"vector must be a tuple of 1 array\(s\).*got a "
                       r"tuple of length 2"):
        loss.multiply_ggn((z, z))
    with pytest.raises(KFACValueError, match=r"vector\[0\] must be an array of shape \(3, 4\)"):
        loss.multiply_fisher_factor_transpose((_z(xp, (3, 3)),))
    with pytest.raises(KFACValueError, match=r"vector\[0\] must be finite"):
        loss.multiply_fisher((xp.asarray(np.full((3, 4), np.nan)),))
    with pytest.raises(KFACTypeError, match=r"multiply_fisher_factor: vector must be an array.*; "
                       r"got a tuple"):
        loss.multiply_fisher_factor((z,))
    with pytest.raises(KFACValueError, match=r"vector must be an array of shape \(3, 4\)"):
        loss.multiply_ggn_factor(_z(xp, (3, 5)))
    # replicated one-hot indices
    with pytest.raises(KFACValueError, match=r"index\[0\] must be in \[0, 4\); got 4"):
        loss.multiply_fisher_factor_replicated_one_hot((4,))
    with pytest.raises(KFACValueError, match=r"index must be a sequence of 1 integer"):
        loss.multiply_ggn_factor_replicated_one_hot((0, 1))
    with pytest.raises(KFACValueError, match=r"index must be a sequence of 1 integer"):
        loss.multiply_fisher_factor_replicated_one_hot((1.5,))
    with pytest.raises(KFACValueError, match=r"index must be a sequence of 1 integer"):
        loss.multiply_fisher_factor_replicated_one_hot(True)
    # randomness must be an explicit Generator
    with pytest.raises(KFACTypeError, match=r"sample: rng must be a numpy.random.Generator"):
        loss.sample(0)
    with pytest.raises(KFACTypeError, match=r"rng must be a numpy.random.Generator"):
        loss.grad_of_evaluate_on_sample(np.random.RandomState(0))
    with pytest.raises(KFACValueError, match=r"copy_with_different_inputs: parameter_dependants "
                       r"must be a sequence of 1 array"):
        loss.copy_with_different_inputs((z, z))
    with pytest.raises(KFACValueError, match="logits must be a 2-D array"):
        loss.copy_with_different_inputs((_z(xp, (3,)),))


def test_mean_variance_vector_errors(xp):
    m = _z(xp, (2, 3))
    loss = MV(m, xp.asarray(np.ones((2, 3))))
    with pytest.raises(KFACValueError, match=r"vector must be a tuple of 2 array\(s\) of "
                       r"shape\(s\) \(2, 3\), \(2, 3\); got a tuple of length 1"):
        loss.multiply_fisher((m,))
    with pytest.raises(KFACValueError, match=r"vector\[1\] must be an array of shape \(2, 3\)"):
        loss.multiply_ggn_factor_transpose((m, _z(xp, (2, 6))))
    with pytest.raises(KFACValueError, match=r"vector must be an array of shape \(2, 6\)"):
        loss.multiply_fisher_factor(m)
    with pytest.raises(KFACValueError, match=r"index\[0\] must be in \[0, 6\); got -1"):
        loss.multiply_fisher_factor_replicated_one_hot([-1])


def test_mixed_namespaces_and_devices_are_rejected():
    import array_api_strict as xs

    z = np.zeros((2, 3))
    with pytest.raises(KFACTypeError, match="all arrays must come from one array namespace"):
        CAT(z, mask=xs.ones(2, dtype=xs.float64))
    with pytest.raises(KFACTypeError, match="all arrays must come from one array namespace"):
        CAT(z).multiply_fisher((xs.zeros((2, 3), dtype=xs.float64),))
    zs = xs.zeros((2, 3), dtype=xs.float64)
    other = xs.zeros((2, 3), dtype=xs.float64, device=xs.Device("device1"))
    with pytest.raises(KFACTypeError, match="all arrays must live on one device"):
        MV(zs, other + 1.0)
    with pytest.raises(KFACTypeError, match="all arrays must live on one device"):
        NORMAL(zs).multiply_fisher_factor(other)
    with pytest.raises(KFACTypeError, match="all arrays must live on one device"):
        CAT(zs).evaluate(xs.zeros(2, dtype=xs.int64, device=xs.Device("device1")))
