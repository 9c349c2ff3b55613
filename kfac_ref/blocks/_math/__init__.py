r"""Formula functions of curvature blocks: one place for each block product.

Every block of :mod:`kfac_ref.blocks` (TF K-FAC's Fisher blocks and kfac-jax's curvature blocks)
multiplies a vector by a power of a damped block through one of the functions below.  The
classes only hold statistics and options; the arithmetic is here.

Conventions
-----------
* A Kronecker block acts on the **row-major** flattening of the combined parameter matrix
  ``X`` of shape ``[p, q]`` (``p`` = input side, bias row last; ``q`` = output side):
  :math:`(A \otimes G)\,\mathrm{vec}_r(X) = \mathrm{vec}_r(A X G^\top)`.
* A factor given as a 1-D array is the diagonal of a diagonal factor (TF's
  ``DiagonalKroneckerFactor``, the embedding input factor).
* ``scale`` is the block's multiplier :math:`s` (TF's ``_renorm_coeff``, kfac-jax's
  ``scale``): the block is :math:`s\,(A \otimes G)`, e.g. :math:`s = |T|` for KFC convolutions
  and :math:`s = T` for layers used :math:`T` times.
* ``damping`` is the weight :math:`\lambda` of the identity added to the *scaled* block.
  Factored damping therefore splits :math:`\lambda / s` between the factors (TF's
  ``normalize_damping`` with ``NORMALIZE_DAMPING_POWER = 1``, kfac-jax's
  ``identity_weight / scale``).

Internal API
------------
The block classes of :mod:`kfac_ref.blocks.kfac_jax` and :mod:`kfac_ref.blocks.tf` call these
unchecked helpers (not in ``__all__``; their arguments are validated by the public method the
user called):

* ``prepare_*`` / ``apply_*`` pairs split each product into the part that depends only on the
  statistics (what a cache stores) and the part that touches the vector, so a cached product
  and an uncached one run the same arithmetic;
* :func:`kron_product_path` decides, once for every Kronecker product, which of the three
  paths (direct power 1, eigenbasis, factored π damping) a product takes; the eigenbasis
  and factored products themselves are :mod:`kfac_ref.linalg`'s damped Kronecker kernel
  (``kron_eigen``, ``kron_factored_powers`` / ``kron_factored_apply``), written once;
* ``to_mat2d`` / ``from_mat2d`` and ``flatten`` / ``unflatten`` are the vector maps
  ``(kernel, bias)`` ↔ ``[W; b]`` and tuple of arrays ↔ flat vector shared by all blocks;
* ``check_factor`` validates a Kronecker factor;
* ``validated_internals()`` is the context in which a public block method, after validating
  its inputs once, runs functions of :mod:`kfac_ref.factors` and
  :mod:`kfac_ref.averaging` (they still run their static checks, but no second scan of data
  already checked).
"""

# ``name as name``: the internal API above, re-exported for the block classes (not in __all__).
from ._common import (
    PI_NORMS,
    ZERO_FACTOR_FALLBACKS,
    normalize_damping,
)
from ._common import check_factor as check_factor
from ._common import flatten as flatten
from ._common import from_mat2d as from_mat2d
from ._common import to_mat2d as to_mat2d
from ._common import unflatten as unflatten
from ._common import validated_internals as validated_internals
from ._diagonal_full import apply_diagonal as apply_diagonal
from ._diagonal_full import apply_full as apply_full
from ._diagonal_full import apply_full_eigen as apply_full_eigen
from ._diagonal_full import (
    diagonal_block_matpower,
    full_block_matpower,
    scaled_identity_matpower,
)
from ._diagonal_full import prepare_full as prepare_full
from ._kron import KRON_PATHS as KRON_PATHS
from ._kron import apply_kron as apply_kron
from ._kron import apply_kron_direct as apply_kron_direct
from ._kron import kron_product_path as kron_product_path
from ._kron import kron_spectrum as kron_spectrum
from ._kron import (
    kronecker_block_eigenvalues,
    kronecker_block_matpower,
)
from ._kron import prepare_kron as prepare_kron
from ._series import (
    series_gamma,
    series_option1_multiply_inverse,
    series_option2_multiply_inverse,
)
from ._series import series_option1_kernel as series_option1_kernel
from ._series import series_option2_kernel as series_option2_kernel
from ._tridiag import (
    block_tridiagonal_multiply_inverse,
    kronecker_difference_inverse,
)

__all__ = [
    "PI_NORMS",
    "ZERO_FACTOR_FALLBACKS",
    "kronecker_block_matpower",
    "kronecker_block_eigenvalues",
    "diagonal_block_matpower",
    "full_block_matpower",
    "scaled_identity_matpower",
    "normalize_damping",
    "series_gamma",
    "series_option1_multiply_inverse",
    "series_option2_multiply_inverse",
    "kronecker_difference_inverse",
    "block_tridiagonal_multiply_inverse",
]
