r"""TF K-FAC's Fisher factors: formula functions and thin immutable stateful classes.

Formula functions compute one batch statistic from arrays of any array-API library.
Classes named as in TF K-FAC hold hyper-parameters and state (moving averages, registered
damped matrix functions) and call the formula functions; every "update" returns a new
object.

.. math::

    A = \frac{1}{N}\sum_n \bar a_n \bar a_n^\top, \quad
    G = \frac{1}{N}\sum_n g_n g_n^\top, \quad
    \Omega = \frac{1}{N|T|}[[A]]_H^\top[[A]]_H, \quad
    \Gamma = \frac{1}{N|T|} DS^\top DS .

Every factor lives here, one name each: the state machinery (``FisherFactor``,
``DenseSquareMatrixFactor``, ``DiagonalFactor``), the fully connected, convolution (KFC and
SUA), diagonal and full, embedding, series (multi-use) and scale-and-shift factors.  The chunk
bound on convolution temporaries is :mod:`kfac_ref.patches`'s.
"""

from ._base import (
    EIGENVALUE_CLIPPING_THRESHOLD,
    EIGENVALUE_DECOMPOSITION_THRESHOLD,
    DenseSquareMatrixFactor,
    DiagonalFactor,
    FisherFactor,
)
from ._conv_kfc import (
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
from ._conv_sua import (
    SUA_ORDERS,
    ConvInputSUAKroneckerFactor,
    conv_input_sua_factor,
    conv_input_sua_inverse,
    conv_input_sua_statistics,
)
from ._dense import (
    FullyConnectedDiagonalFactor,
    FullyConnectedKroneckerFactor,
    fully_connected_diagonal_factor,
    fully_connected_kronecker_factor,
)
from ._diagonal import (
    FullFactor,
    NaiveDiagonalFactor,
    NaiveFullFactor,
    full_factor,
    naive_diagonal_factor,
    params_grads_to_vector,
)
from ._embedding import (
    DiagonalKroneckerFactor,
    DiagonalMultiKF,
    EmbeddingInputKroneckerFactor,
    diagonal_kronecker_factor,
    embedding_input_kronecker_factor,
)
from ._scale_shift import (
    SCALE_AND_SHIFT_APPROX,
    ScaleAndShiftDiagonalFactor,
    ScaleAndShiftFullFactor,
    scale_and_shift_factor,
)
from ._series import (
    OPTION1_EIG_METHODS,
    FullyConnectedMultiKF,
    fully_connected_multi_kf_cov_dt1,
    series_option1_quantities,
    series_option2_quantities,
)

__all__ = [
    "EIGENVALUE_CLIPPING_THRESHOLD",
    "EIGENVALUE_DECOMPOSITION_THRESHOLD",
    "EXTRACT_PATCHES_FNS",
    "OPTION1_EIG_METHODS",
    "FisherFactor",
    "DenseSquareMatrixFactor",
    "DiagonalFactor",
    "fully_connected_kronecker_factor",
    "fully_connected_diagonal_factor",
    "FullyConnectedKroneckerFactor",
    "FullyConnectedDiagonalFactor",
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
    "params_grads_to_vector",
    "naive_diagonal_factor",
    "full_factor",
    "NaiveDiagonalFactor",
    "FullFactor",
    "NaiveFullFactor",
    "embedding_input_kronecker_factor",
    "diagonal_kronecker_factor",
    "EmbeddingInputKroneckerFactor",
    "DiagonalKroneckerFactor",
    "DiagonalMultiKF",
    "SCALE_AND_SHIFT_APPROX",
    "scale_and_shift_factor",
    "ScaleAndShiftFullFactor",
    "ScaleAndShiftDiagonalFactor",
    "fully_connected_multi_kf_cov_dt1",
    "series_option1_quantities",
    "series_option2_quantities",
    "FullyConnectedMultiKF",
]
