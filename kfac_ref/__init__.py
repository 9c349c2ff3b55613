"""kfac_ref: the reference implementation of K-FAC mathematics on the Python array API.

The public API is curated here.  Submodules:

* :mod:`kfac_ref.linalg` — covariances, damped matrix functions, π, Kronecker products;
* :mod:`kfac_ref.averaging` — TF K-FAC and kfac-jax moving averages.

All functions accept arrays of any array-API library (NumPy, CuPy, PyTorch, JAX,
array-api-strict) and return arrays of the same library, device and floating dtype.
"""

from . import averaging, linalg
from ._backend import KFACInputError, KFACTypeError, KFACValueError
from .averaging import MovingAverageVariable, WeightedMovingAverage, weighted_accumulate
from .linalg import (
    FACTOR_NORMS,
    append_homog,
    clipped_eigh,
    compute_cov,
    damped_cholesky,
    damped_cholesky_inverse,
    damped_inverse,
    damped_matpower,
    factor_norm,
    kron,
    kron_damped_inverse_matvec,
    kron_damped_matpower_matvec,
    kron_matmat,
    kron_matvec,
    pi_adjusted_damping,
    pi_tracenorm,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "averaging",
    "linalg",
    "KFACInputError",
    "KFACTypeError",
    "KFACValueError",
    "MovingAverageVariable",
    "WeightedMovingAverage",
    "weighted_accumulate",
    "FACTOR_NORMS",
    "append_homog",
    "clipped_eigh",
    "compute_cov",
    "damped_cholesky",
    "damped_cholesky_inverse",
    "damped_inverse",
    "damped_matpower",
    "factor_norm",
    "kron",
    "kron_damped_inverse_matvec",
    "kron_damped_matpower_matvec",
    "kron_matmat",
    "kron_matvec",
    "pi_adjusted_damping",
    "pi_tracenorm",
]
