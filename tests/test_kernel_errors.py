"""Kernels take no function name; the public function or method the user called names the
error a kernel raises (``kernel_error`` + ``errors_named``)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from kfac_ref import KFACValueError, linalg, spectral
from kfac_ref.blocks import kfac_jax as kj
from kfac_ref.blocks import kronecker_block_matpower
from kfac_ref.blocks import tf as T

KERNELS = [
    linalg.power_of_eigenvalues, linalg.damped_matpower.kernel, linalg.damped_inverse.kernel,
    linalg.damped_cholesky.kernel, linalg.damped_cholesky_inverse.kernel,
    linalg.kron_damped_matpower_matvec.kernel, linalg.kron_eigenbasis_matpower.kernel,
    linalg.kron_factored_powers, linalg.kron_factored_apply, linalg.kron_factored_fold,
    linalg.kron_factored_cholesky_apply, linalg.kron_factor_dampings, linalg.kron_eigen,
    spectral.kron_eigenvalues.kernel, spectral.kron_trace.kernel, spectral.kron_slogdet.kernel,
    spectral.hutchinson_trace.kernel, spectral.hutchpp_trace.kernel,
]
HOOKS = ["_multiply_fresh", "_multiply_cached", "_build_cache", "_eigenvalues"]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_linalg_kernels_take_no_function_name(kernel):
    assert "func" not in inspect.signature(kernel).parameters


@pytest.mark.parametrize("cls", [kj.TwoKroneckerFactored, kj.Diagonal, kj.Full,
                                 kj.ScaledIdentity, kj.DenseEKFAC])
@pytest.mark.parametrize("hook", HOOKS)
def test_block_product_hooks_take_no_function_name(cls, hook):
    assert "func" not in inspect.signature(getattr(cls, hook)).parameters


def _singular():
    return np.diag([1.0, 0.0, 1.0])


def test_linalg_public_function_names_the_kernel_error():
    with pytest.raises(KFACValueError,
                       match=r"^kron_damped_inverse_matvec: a damped Kronecker factor is "
                             r"singular for the power -1\.0 \(matrix \+ damping·I"):
        linalg.kron_damped_inverse_matvec(_singular(), np.eye(2), np.ones(6))
    with pytest.raises(KFACValueError, match=r"^damped_matpower: matrix \+ damping·I must be "
                                             r"positive definite"):
        linalg.damped_matpower(_singular(), -0.5)


def test_formula_function_names_the_kernel_error():
    with pytest.raises(KFACValueError, match=r"^kronecker_block_matpower: a Kronecker factor "
                                             r"is zero and damping is 0"):
        kronecker_block_matpower(np.zeros((3, 3)), np.eye(2), np.ones((3, 2)), -1.0, 0.0,
                                 zero_factor_fallback="identity")


@pytest.mark.parametrize("method", ["multiply_inverse", "multiply_matpower"])
def test_block_method_names_the_kernel_error(method):
    block = kj.DenseTwoKroneckerFactored(2, 2)
    state = block.init(np.zeros(()))  # zero statistics: the kfac-jax zero-factor case
    vec = tuple(np.ones(s) for s in block.parameters_shapes)
    args = (0.0, False, False) if method == "multiply_inverse" else (0.0, -1.0, False, False)
    with pytest.raises(KFACValueError, match=rf"^DenseTwoKroneckerFactored\.{method}: a "
                                             r"Kronecker factor is zero and damping is 0"):
        getattr(block, method)(state, vec, *args)


def test_tf_block_names_the_kernel_error():
    a = np.diag([1.0, 1.0, 0.0])
    block = T.FullyConnectedKFACBasicFB(a, np.eye(2), 0.0, has_bias=True)
    with pytest.raises(KFACValueError, match=r"^FullyConnectedKFACBasicFB\.multiply_matpower: "
                                             r"a damped Kronecker factor is singular"):
        block.multiply_inverse((np.ones((2, 2)), np.ones(2)))
