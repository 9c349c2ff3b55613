r"""Convolution layer factors of TF K-FAC: the KFC factors (:mod:`~kfac_ref.factors.conv_kfc`)
and the SUA input factor (:mod:`~kfac_ref.factors.conv_sua`), re-exported under one name.

.. math::

    \Omega = \frac{1}{N|T|}[[A]]_H^\top[[A]]_H, \qquad
    \Gamma = \frac{1}{N|T|} DS^\top DS, \qquad
    \Omega_{\text{SUA}} = I_{|\Delta|} \otimes \Sigma + m m^\top .

``kfac_ref.factors.conv.X`` and ``kfac_ref.factors.X`` name the same objects.
"""

from .conv_kfc import (
    EXTRACT_PATCHES_FNS,
    ConvDiagonalFactor,
    ConvInputKroneckerFactor,
    ConvInputMultiKF,
    ConvOutputKroneckerFactor,
    ConvOutputMultiKF,
    conv_diagonal_factor,
    conv_input_factor_tap,
    conv_input_kronecker_factor,
    conv_output_kronecker_factor,
    conv_patch_matrix,
    conv_per_example_gradients,
)
from .conv_sua import (
    SUA_ORDERS,
    ConvInputSUAKroneckerFactor,
    conv_input_sua_factor,
    conv_input_sua_inverse,
    conv_input_sua_statistics,
)

__all__ = [
    "EXTRACT_PATCHES_FNS",
    "conv_patch_matrix",
    "conv_per_example_gradients",
    "conv_input_kronecker_factor",
    "conv_input_factor_tap",
    "conv_output_kronecker_factor",
    "conv_diagonal_factor",
    "ConvInputKroneckerFactor",
    "ConvOutputKroneckerFactor",
    "ConvDiagonalFactor",
    "ConvInputMultiKF",
    "ConvOutputMultiKF",
    "SUA_ORDERS",
    "conv_input_sua_statistics",
    "conv_input_sua_factor",
    "conv_input_sua_inverse",
    "ConvInputSUAKroneckerFactor",
]
