"""PyTorch tensors that require gradients: kfac_ref's results are differentiable torch
operations of them (documented on the docs page *Backend support*)."""

from __future__ import annotations

import numpy as np
import pytest

import kfac_ref
from kfac_ref import factors

torch = pytest.importorskip("torch")


def test_results_carry_the_autograd_graph():
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((10, 3)), requires_grad=True)
    a = factors.fully_connected_kronecker_factor(x, has_bias=True)
    assert a.requires_grad
    # d/dx of sum(A) with A = [x 1]ᵀ[x 1]/N: independent oracle by hand
    a.sum().backward()
    xb = np.c_[x.detach().numpy(), np.ones(10)]
    expected = (2.0 / 10) * np.repeat(xb.sum(axis=1, keepdims=True), 3, axis=1)
    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-12)


def test_damped_inverse_gradient_matches_the_matrix_calculus_identity():
    """d tr((M+λI)⁻¹) / dM = -((M+λI)⁻²)ᵀ."""
    rng = np.random.default_rng(1)
    b = rng.standard_normal((6, 4))
    m = torch.tensor(b.T @ b / 6, requires_grad=True)
    kfac_ref.damped_inverse(m, 0.1).trace().backward()
    inv = np.linalg.inv(b.T @ b / 6 + 0.1 * np.eye(4))
    np.testing.assert_allclose(m.grad.numpy(), -(inv @ inv).T, rtol=1e-10, atol=1e-12)
