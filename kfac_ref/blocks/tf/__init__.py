r"""TF K-FAC-named Fisher blocks over the formula functions of :mod:`kfac_ref.blocks`.

A TF ``FisherBlock`` owns factors and a damping and multiplies vectors by powers of the damped
block.  Here a block is immutable and is built from its factors' current statistics: either
arrays or factor objects with a ``get_cov()`` method (the TF-named factors of
:mod:`kfac_ref.factors`; the series block also reads ``get_cov_dt1()``).  Convenience
``from_data`` constructors compute the statistics with :mod:`kfac_ref.factors`.

.. math::

    \begin{aligned}
    \texttt{multiply\_matpower}(v, p) &= \big(c\,(A + \delta_A I) \otimes (G + \delta_G I)
    \big)^{p} v,\\
    (\delta_A, \delta_G) &= \texttt{compute\_pi\_adjusted\_damping}\big(A, G,\\
    &\qquad \sqrt{\texttt{normalize\_damping}(\lambda, k)}\big),
    \end{aligned}

for Kronecker blocks with renormalisation coefficient :math:`c` (TF ``_renorm_coeff``) and
damping normalisation :math:`k` (``_setup_damping(damping, normalization=k)``); diagonal and
full blocks use :math:`(F + \lambda I)^{p}`.

Vectors follow TF's ``layer_params_to_mat2d``: a kernel array, or a tuple ``(kernel, bias)``;
the kernel is reshaped to ``[-1, out]`` and the bias appended as the last row.  Full and
naive blocks take any tuple of arrays (flattened row-major and concatenated, TF's
``tensors_to_column``).  Results come back in the vector's structure.

Defaults are TF's: ``PI_TYPE = "tracenorm"``, ``NORMALIZE_DAMPING_POWER = 1``, π = 1 when a
trace is zero (``zero_factor_fallback="pi_one"``).  Each is an argument here instead of a
module global.
"""

from . import _base
from ._base import FisherBlock, compute_pi_adjusted_damping, compute_pi_tracenorm
from ._depthwise import DepthwiseConvDiagonalFB, DepthwiseConvKFCBasicFB
from ._flat import (
    ConvDiagonalFB,
    DiagonalFB,
    FullFB,
    FullyConnectedDiagonalFB,
    NaiveDiagonalFB,
    NaiveFullFB,
    ScaleAndShiftDiagonalFB,
    ScaleAndShiftFullFB,
)
from ._kronecker import (
    ConvKFCBasicFB,
    ConvKFCBasicMultiIndepFB,
    EmbeddingKFACFB,
    EmbeddingKFACMultiIndepFB,
    FullyConnectedKFACBasicFB,
    FullyConnectedMultiIndepFB,
    KroneckerProductFB,
)
from ._series import FullyConnectedSeriesFB, SeriesFBApproximation

PI_TYPES = _base.PI_TYPES
"""TF's ``PI_TYPE`` values (``"tracenorm"``, ``"off"``) plus kfac-jax's factor norms."""

__all__ = [
    "PI_TYPES",
    "compute_pi_tracenorm",
    "compute_pi_adjusted_damping",
    "FisherBlock",
    "FullFB",
    "NaiveFullFB",
    "DiagonalFB",
    "NaiveDiagonalFB",
    "FullyConnectedDiagonalFB",
    "ConvDiagonalFB",
    "ScaleAndShiftFullFB",
    "ScaleAndShiftDiagonalFB",
    "DepthwiseConvDiagonalFB",
    "KroneckerProductFB",
    "FullyConnectedKFACBasicFB",
    "ConvKFCBasicFB",
    "EmbeddingKFACFB",
    "EmbeddingKFACMultiIndepFB",
    "DepthwiseConvKFCBasicFB",
    "FullyConnectedMultiIndepFB",
    "ConvKFCBasicMultiIndepFB",
    "FullyConnectedSeriesFB",
    "SeriesFBApproximation",
]
