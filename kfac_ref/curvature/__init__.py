r"""Exact curvature of a network's mean loss and the block-diagonal K-FAC estimator.

.. math::

    \mathcal L(\theta) = \frac1N\sum_n w\,\ell_n(f(\theta, x_n)), \qquad
    G = \frac1N\sum_n J_n^\top G_n J_n,\quad F = \frac1N\sum_n J_n^\top F_n J_n .

Four groups, one name each: the exact curvature (dense matrices and matrix-free products of
the GGN, Fisher, empirical Fisher and Hessian), the kfac-jax-named estimator classes, the
per-layer approximation report, and KFRA's recursive Kronecker factors
(:func:`kfra_factors`, Botev et al. 2017).

The kfac-jax-named curvature estimators over a :class:`kfac_ref.nn.Sequential` network:

* :class:`ImplicitExactCurvature` — matrix-free exact products (Hessian, GGN, Fisher, their
  factors, Jacobians);
* :class:`ExplicitExactCurvature` — one dense matrix over all parameters, estimated with any
  estimation mode and averaged with kfac-jax's weighted moving average;
* :class:`BlockDiagonalCurvature` — one :mod:`kfac_ref.blocks` block per parametric layer,
  driven by the layer inputs and back-propagated vectors of an estimation mode.

kfac-jax traces a loss function and finds layers and losses by their tags; here the network
and the loss are explicit: the estimators take ``(net, loss_fn)`` and ``func_args =
(params, batch)`` with ``batch = (inputs, targets)``.  Parameter vectors are flat arrays in
the canonical order (:meth:`kfac_ref.nn.Sequential.flatten`); a parameter structure is also
accepted and returned as given.

Scaling of the estimation modes (mean loss :math:`\frac1N\sum_n w\ell_n`):

================================  ==========================================================
mode                              curvature estimated (all three libraries agree unless noted)
================================  ==========================================================
``fisher_gradients``              MC Fisher, :math:`\mathbb E = F` (TF "gradients"/"empirical"
                                  with sampled targets; kfac-jax)
``fisher_curvature_prop``         :math:`\mathbb E = F` (Rademacher × Fisher factor)
``ggn_curvature_prop``            :math:`\mathbb E = G`
``fisher_exact`` / ``ggn_exact``  :math:`F` / :math:`G` (TF "exact"; kfac-jax)
``fisher_empirical``              :math:`\mathrm{EF} = \frac1N\sum g_n g_n^\top` by default
                                  (TF K-FAC, curvlinops);
                                  ``empirical_fisher_normalization="kfac_jax"`` gives
                                  kfac-jax's :math:`\mathrm{EF}/N`
================================  ==========================================================

(:func:`kfac_ref.curvature.estimation_output_vectors` defines the vectors.)
"""

from ._block_diagonal import (
    WEIGHT_SHARING_MODES,
    BlockDiagonalCurvature,
    BlockDiagonalState,
    block_diag,
)
from ._exact import (
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
from ._explicit import ExplicitExactCurvature
from ._implicit import ImplicitExactCurvature
from ._kfra import kfra_factors
from ._report import approximation_report, default_approximations, relative_frobenius_error

__all__ = [
    "WEIGHT_SHARING_MODES",
    "BlockDiagonalCurvature",
    "BlockDiagonalState",
    "ExplicitExactCurvature",
    "ImplicitExactCurvature",
    "approximation_report",
    "block_diag",
    "default_approximations",
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
    "kfra_factors",
    "loss_value_and_grad",
    "monte_carlo_fisher_matrix",
]
