r"""Exact curvature of a network's mean loss and the block-diagonal K-FAC estimator.

.. math::

    \mathcal L(\theta) = \frac1N\sum_n w\,\ell_n(f(\theta, x_n)), \qquad
    G = \frac1N\sum_n J_n^\top G_n J_n,\quad F = \frac1N\sum_n J_n^\top F_n J_n .

See :mod:`kfac_ref.curvature.exact` (dense matrices and matrix-free products) and
:mod:`kfac_ref.curvature.estimators` (kfac-jax-named estimator classes) and
:mod:`kfac_ref.curvature.report` (per-layer approximation errors).
"""

from .estimators import (
    WEIGHT_SHARING_MODES,
    BlockDiagonalCurvature,
    ExplicitExactCurvature,
    ImplicitExactCurvature,
    block_diag,
    default_layer_to_block,
)
from .exact import (
    EMPIRICAL_FISHER_NORMALIZATIONS,
    ESTIMATION_MODES,
    empirical_fisher_matrix,
    empirical_fisher_vector_product,
    estimated_matrix,
    estimation_output_vectors,
    fisher_factor_product,
    fisher_factor_transpose_product,
    fisher_matrix,
    fisher_vector_product,
    ggn_factor_product,
    ggn_factor_transpose_product,
    ggn_matrix,
    ggn_vector_product,
    hessian_matrix,
    hessian_vector_product,
    jacobian,
    jacobian_transpose_vector_product,
    jacobian_vector_product,
    loss_value_and_grad,
    monte_carlo_fisher_matrix,
)
from .report import approximation_report, default_approximations, relative_frobenius_error

__all__ = [
    "WEIGHT_SHARING_MODES",
    "BlockDiagonalCurvature",
    "ExplicitExactCurvature",
    "ImplicitExactCurvature",
    "approximation_report",
    "block_diag",
    "default_approximations",
    "default_layer_to_block",
    "relative_frobenius_error",
    "EMPIRICAL_FISHER_NORMALIZATIONS",
    "ESTIMATION_MODES",
    "empirical_fisher_matrix",
    "empirical_fisher_vector_product",
    "estimated_matrix",
    "estimation_output_vectors",
    "fisher_factor_product",
    "fisher_factor_transpose_product",
    "fisher_matrix",
    "fisher_vector_product",
    "ggn_factor_product",
    "ggn_factor_transpose_product",
    "ggn_matrix",
    "ggn_vector_product",
    "hessian_matrix",
    "hessian_vector_product",
    "jacobian",
    "jacobian_transpose_vector_product",
    "jacobian_vector_product",
    "loss_value_and_grad",
    "monte_carlo_fisher_matrix",
]
