"""kfac_ref: the reference implementation of K-FAC mathematics on the Python array API.

The public API is curated here: the foundation (linear algebra, moving averages, errors) at
the top level, every K-FAC family in its submodule.

* :mod:`kfac_ref.linalg` — covariances, damped matrix functions, π, Kronecker products;
* :mod:`kfac_ref.averaging` — TF K-FAC and kfac-jax moving averages, shard sync;
* :mod:`kfac_ref.patches` — convolution patch extraction;
* :mod:`kfac_ref.factors` — TF K-FAC's Fisher factors;
* :mod:`kfac_ref.losses` — loss functions with their Fisher/GGN factor products;
* :mod:`kfac_ref.blocks` — TF K-FAC Fisher blocks and kfac-jax curvature blocks;
* :mod:`kfac_ref.nn` — reference layers and networks with explicit derivatives;
* :mod:`kfac_ref.curvature` — exact curvature and the block-diagonal estimator;
* :mod:`kfac_ref.optim` — the reference K-FAC optimiser step (kfac-jax and TF K-FAC rules);
* :mod:`kfac_ref.operators` — curvature as a linear operator (SciPy view on NumPy);
* :mod:`kfac_ref.spectral` — traces, log-determinants, eigenvalues, trace estimators.

All functions accept arrays of any array-API library (NumPy, CuPy, PyTorch, JAX,
array-api-strict) and return arrays of the same library, device and floating dtype.
"""

from . import (
    averaging,
    blocks,
    curvature,
    factors,
    linalg,
    losses,
    nn,
    operators,
    optim,
    patches,
    spectral,
)
from ._backend import KFACInputError, KFACTypeError, KFACValueError, value_checks
from ._pytrees import register_jax_pytrees
from .averaging import (
    MovingAverageVariable,
    WeightedMovingAverage,
    sync_statistics,
    weighted_accumulate,
)
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
    kron_eigenbasis_matpower,
    kron_matmat,
    kron_matvec,
    pi_adjusted_damping,
    pi_tracenorm,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "averaging",
    "blocks",
    "curvature",
    "factors",
    "linalg",
    "losses",
    "nn",
    "optim",
    "patches",
    "operators",
    "spectral",
    "KFACInputError",
    "KFACTypeError",
    "KFACValueError",
    "value_checks",
    "register_jax_pytrees",
    "MovingAverageVariable",
    "WeightedMovingAverage",
    "weighted_accumulate",
    "sync_statistics",
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
    "kron_eigenbasis_matpower",
    "kron_matmat",
    "kron_matvec",
    "pi_adjusted_damping",
    "pi_tracenorm",
]

from . import capabilities  # noqa: E402, F401  (kfac_ref.capabilities reads the modules above)
