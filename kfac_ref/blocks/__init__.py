"""Curvature blocks: TF K-FAC Fisher blocks and kfac-jax curvature blocks on one set of formulas.

* :mod:`kfac_ref.blocks._math` — the formula functions (re-exported here);
* :mod:`kfac_ref.blocks.kfac_jax` — kfac-jax-named blocks with explicit immutable state;
* :mod:`kfac_ref.blocks.tf` — TF K-FAC-named Fisher blocks.
"""

from ._math import (
    PI_NORMS,
    ZERO_FACTOR_FALLBACKS,
    diagonal_block_matpower,
    full_block_matpower,
    kronecker_block_eigenvalues,
    kronecker_block_matpower,
    normalize_damping,
    scaled_identity_matpower,
    series_gamma,
    series_option1_multiply_inverse,
    series_option2_multiply_inverse,
)

__all__ = [
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
]
