"""Curvature blocks: TF K-FAC Fisher blocks and kfac-jax curvature blocks on one set of formulas.

* here: the formula functions (one home each; implemented in the private
  ``kfac_ref.blocks._math``);
* :mod:`kfac_ref.blocks.kfac_jax` — the block classes, kfac-jax names, explicit immutable
  state (their one home);
* :mod:`kfac_ref.blocks.tf` — TF K-FAC's Fisher block names and argument names, on the same
  formulas (their one home).
"""

from . import kfac_jax, tf  # the block classes: kfac-jax names and TF K-FAC names
from ._math import (
    PI_NORMS,
    ZERO_FACTOR_FALLBACKS,
    block_tridiagonal_multiply_inverse,
    diagonal_block_matpower,
    full_block_matpower,
    kronecker_block_eigenvalues,
    kronecker_block_matpower,
    kronecker_difference_inverse,
    normalize_damping,
    scaled_identity_matpower,
    series_gamma,
    series_option1_multiply_inverse,
    series_option2_multiply_inverse,
)

__all__ = [
    "kfac_jax",
    "tf",
    # formula functions
    "PI_NORMS",
    "ZERO_FACTOR_FALLBACKS",
    "diagonal_block_matpower",
    "full_block_matpower",
    "kronecker_block_eigenvalues",
    "kronecker_block_matpower",
    "normalize_damping",
    "scaled_identity_matpower",
    "series_gamma",
    "series_option1_multiply_inverse",
    "series_option2_multiply_inverse",
    "kronecker_difference_inverse",
    "block_tridiagonal_multiply_inverse",
]
