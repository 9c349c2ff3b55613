"""Blocks validate once: finiteness scans per update, strict booleans, errors that name the
function the user called."""

from __future__ import annotations

import numpy as np
import pytest

from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref.blocks import kfac_jax as kj
from kfac_ref.blocks import tf as T

N = 8
CONV_KW = dict(inputs_shape=(N, 5, 5, 2), kernel_shape=(2, 2, 2, 3))


def _data(rng, conv):
    if conv:
        return {"inputs": rng.standard_normal((N, 5, 5, 2)),
                "outputs_grad": rng.standard_normal((N, 4, 4, 3))}
    return {"inputs": rng.standard_normal((N, 3)), "outputs_grad": rng.standard_normal((N, 2))}


@pytest.mark.parametrize("make,conv", [
    (lambda: kj.DenseTwoKroneckerFactored(3, 2), False),
    (lambda: kj.DenseTwoKroneckerFactored(3, 2, symmetrize=False), False),
    (lambda: kj.DenseDiagonal(3, 2), False),
    (lambda: kj.DenseFull(3, 2), False),
    (lambda: kj.Conv2DDiagonal(**CONV_KW), True),
    (lambda: kj.Conv2DTwoKroneckerFactored(**CONV_KW), True),
    (lambda: kj.Conv2DTwoKroneckerFactored(**CONV_KW, symmetrize=False), True),
    (lambda: kj.Conv2DFull(**CONV_KW), True),
])
def test_update_scans_each_input_once(finite_scans, make, conv):
    block = make()
    state = block.init(np.zeros(()))
    data = _data(np.random.default_rng(0), conv)
    finite_scans.clear()
    new = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, N)
    assert finite_scans[id(data["inputs"])] == 1
    assert finite_scans[id(data["outputs_grad"])] == 1
    assert sum(finite_scans.values()) == 2  # nothing computed from them is scanned again
    assert all(np.all(np.isfinite(s.value)) for s in new.statistics)


def test_update_still_rejects_non_finite_inputs():
    block = kj.Conv2DDiagonal(**CONV_KW)
    data = _data(np.random.default_rng(0), True)
    data["inputs"][0, 0, 0, 0] = np.nan
    with pytest.raises(KFACValueError, match="Conv2DDiagonal.update_curvature_matrix_estimate: "
                                             "inputs must be finite"):
        block.update_curvature_matrix_estimate(block.init(np.zeros(())), data, 0.0, 1.0, N)


@pytest.mark.parametrize("make", [
    lambda v: kj.DenseTwoKroneckerFactored(3, 2, has_bias=v),
    lambda v: kj.DenseDiagonal(3, 2, has_bias=v),
    lambda v: kj.DenseFull(3, 2, has_bias=v),
    lambda v: kj.Conv2DDiagonal(**CONV_KW, has_bias=v),
    lambda v: kj.Conv2DTwoKroneckerFactored(**CONV_KW, has_bias=v),
    lambda v: kj.DenseTwoKroneckerFactored(3, 2, symmetrize=v),
    lambda v: kj.DenseTwoKroneckerFactored(3, 2, restrict_approx_powers=v),
    lambda v: kj.NaiveDiagonal([(3,)], strict_cache=v),
    lambda v: T.FullyConnectedKFACBasicFB(np.eye(4), np.eye(2), 0.1, has_bias=v),
    lambda v: T.KroneckerProductFB(np.eye(3), np.eye(2), 0.1, (3, 2), has_bias=v),
    lambda v: T.FullyConnectedDiagonalFB(np.ones((4, 2)), 0.1, has_bias=v),
])
@pytest.mark.parametrize("bad", ["no", None, 1])
def test_boolean_options_are_strict(make, bad):
    with pytest.raises(KFACTypeError, match="must be a bool"):
        make(bad)


@pytest.mark.parametrize("bad", ["no", None])
def test_exact_power_is_strict(bad):
    block = kj.DenseTwoKroneckerFactored(3, 2)
    state = block.init(np.zeros(()))
    v = (np.ones((3, 2)), np.ones(2))
    with pytest.raises(KFACTypeError, match="multiply_matpower: exact_power must be a bool"):
        block.multiply_matpower(state, v, 0.1, -1.0, bad, False)
    with pytest.raises(KFACTypeError, match="use_cached must be a bool"):
        block.multiply_matpower(state, v, 0.1, -1.0, True, bad)


@pytest.mark.parametrize("arg", ["inputs", "outputs_grad"])
@pytest.mark.parametrize("bad", [np.full((4, 3), np.nan), np.ones((4, 3, 1)), None])
def test_from_data_errors_name_the_method_and_argument(arg, bad):
    args = {"inputs": np.ones((4, 3)), "outputs_grad": np.ones((4, 2))}
    args[arg] = bad if arg == "inputs" or bad is None else (
        np.full((4, 2), np.nan) if bad.ndim == 2 else np.ones((4, 2, 1)))
    with pytest.raises((KFACValueError, KFACTypeError),
                       match=f"FullyConnectedKFACBasicFB.from_data: {arg} must be"):
        T.FullyConnectedKFACBasicFB.from_data(args["inputs"], args["outputs_grad"], 0.1)


def test_multiply_with_a_missing_part_is_a_kfac_error():
    block = T.FullyConnectedKFACBasicFB(np.eye(4), np.eye(2), 0.1, has_bias=True)
    with pytest.raises(KFACTypeError, match=r"vector\[0\] must be an array; got None"):
        block.multiply_inverse((None, np.ones(2)))
    full = T.FullFB(np.eye(3), 0.1)
    with pytest.raises(KFACTypeError, match=r"vector\[1\] must be an array"):
        full.multiply_inverse((np.ones(2), None))


@pytest.mark.parametrize("cls", [T.NaiveDiagonalFB, T.NaiveFullFB])
def test_naive_from_grads_rejects_nested_lists(cls):
    with pytest.raises(KFACTypeError, match=rf"{cls.__name__}.from_grads: params_grads\[0\] "
                                            "must be an array"):
        cls.from_grads([[np.ones(3)]], 4, 0.1)
    with pytest.raises(KFACTypeError, match="params_grads must be an array or a sequence"):
        cls.from_grads(None, 4, 0.1)


def test_conv_diagonal_from_data_is_its_own():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 4, 1))
    g = rng.standard_normal((3, 3, 3, 2))
    block = T.ConvDiagonalFB.from_data(x, g, 0.1, (2, 2, 1, 2), "VALID", has_bias=True)
    assert block.kernel_shape == (2, 2, 1, 2) and block.num_locations == 9
    # oracle: per-example gradients by explicit loops over locations
    dw = np.zeros((3, 5, 2))
    for n in range(3):
        for i in range(3):
            for j in range(3):
                p = np.concatenate([x[n, i:i + 2, j:j + 2, :].reshape(-1), [1.0]])
                dw[n] += np.outer(p, g[n, i, j])
    expected = np.mean(dw**2, axis=0)
    np.testing.assert_allclose(block.full_fisher_block(), np.diag(expected.reshape(-1)),
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(KFACValueError, match="ConvDiagonalFB.from_data: outputs_grad must have the "
                                             "convolution's output grid"):
        T.ConvDiagonalFB.from_data(x, rng.standard_normal((3, 4, 4, 2)), 0.1, (2, 2, 1, 2),
                                   "VALID")
    with pytest.raises(KFACValueError, match="ConvDiagonalFB.from_data: inputs must be a 4-D"):
        T.ConvDiagonalFB.from_data(x[0], g, 0.1, (2, 2, 1, 2), "VALID")
