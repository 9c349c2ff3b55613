r"""Reference layers and sequential networks with explicit forward, JVP, VJP and R-operator maps.

.. math::

    f(\theta, x) = f_L(\theta_L, \dots f_1(\theta_1, x)), \qquad
    \theta = [\mathrm{vec}_r\theta_1; \dots; \mathrm{vec}_r\theta_L] \ (\text{bias last per layer}).

Layers, the sequential network with its tap protocol (the passes the estimator reads), and the
parameter conversions to kfac-jax's and PyTorch's layouts.
"""

from ._convert import (
    HAIKU_NAMES,
    kfac_jax_permutation,
    permute_matrix,
    permute_vector,
    to_kfac_jax_params,
    to_torch_parameters,
    torch_permutation,
)
from ._layers import (
    ACTIVATIONS,
    Activation,
    Conv2D,
    Dense,
    Embedding,
    Flatten,
    Layer,
    MeanPool,
    ScaleAndShift,
    activation_derivatives,
)
from ._network import ForwardPass, Sequential

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "Conv2D",
    "Dense",
    "Embedding",
    "Flatten",
    "ForwardPass",
    "HAIKU_NAMES",
    "Layer",
    "MeanPool",
    "ScaleAndShift",
    "Sequential",
    "activation_derivatives",
    "kfac_jax_permutation",
    "permute_matrix",
    "permute_vector",
    "to_kfac_jax_params",
    "to_torch_parameters",
    "torch_permutation",
]
