r"""kfac-jax-named curvature estimators over a :class:`kfac_ref.nn.Sequential` network.

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

(:func:`kfac_ref.curvature.exact.estimation_output_vectors` defines the vectors.)

The classes live in one module each (implicit, explicit and block-diagonal estimators) and
are documented and importable here.
"""

from __future__ import annotations

from ..blocks.kfac_jax import default_layer_to_block
from ._block_diagonal import (
    WEIGHT_SHARING_MODES,
    BlockDiagonalCurvature,
)
from ._block_diagonal import BlockDiagonalState as BlockDiagonalState
from ._block_diagonal import block_diag as block_diag
from ._explicit import ExplicitExactCurvature
from ._explicit import ExplicitState as ExplicitState
from ._implicit import ImplicitExactCurvature

__all__ = [
    "ImplicitExactCurvature",
    "ExplicitExactCurvature",
    "BlockDiagonalCurvature",
    "WEIGHT_SHARING_MODES",
    "default_layer_to_block",
]

# Documented (and pickled, and shown in reprs) under this module, where they always lived.
for _obj in (ImplicitExactCurvature, ExplicitExactCurvature, ExplicitState,
             BlockDiagonalCurvature, BlockDiagonalState, block_diag):
    _obj.__module__ = __name__
del _obj
