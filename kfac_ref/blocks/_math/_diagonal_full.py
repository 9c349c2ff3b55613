"""Diagonal, full and scaled-identity block products."""

from __future__ import annotations

from ..._backend import (
    KFACValueError,
    check_array,
    check_namespace_has,
    check_scalar,
    check_symmetric,
    errors_named,
    namespace_of,
)
from ..._support import DASK_NO_EIGH, capabilities
from ...linalg import (
    clipped_eigh,
)
from ._common import (
    check_common,
    elementwise_power,
)


# --------------------------------------------------------------------------------------
# Diagonal, full and scaled-identity blocks
# --------------------------------------------------------------------------------------
def apply_diagonal(xp, diagonal, x, power, damping, scale):
    return elementwise_power(xp, scale * diagonal + damping, power) * x


@capabilities(dask="yes")
def diagonal_block_matpower(diagonal, x, power, damping=0.0, *, scale=1.0):
    r"""Power of a damped diagonal block times a vector of the same shape.

    .. math::

        (s\,\mathrm{diag}(d) + \lambda I)^{p}\, x = (s\, d + \lambda)^{\odot p} \odot x .

    Exact and approximate powers coincide (TF ``DiagonalFB``, kfac-jax ``Diagonal``).

    Parameters
    ----------
    diagonal : array, any shape
        The block's diagonal laid out like the parameter (e.g. ``[in + 1, out]``).
    x : array, same shape as ``diagonal``
    power, damping, scale : float

    Raises
    ------
    KFACValueError
        Shape mismatch, negative damping, a negative power of a zero damped entry.
    """
    func = "diagonal_block_matpower"
    xp = namespace_of(func, diagonal=diagonal, x=x)
    check_array(func, "diagonal", diagonal)
    check_array(func, "x", x, shape=tuple(diagonal.shape))
    power, damping, scale, _ = check_common(func, {"diagonal": diagonal}, power, damping,
                                            scale)
    with errors_named(func):
        return apply_diagonal(xp, diagonal, x, power, damping, scale)


def prepare_full(xp, matrix, threshold):
    """Clipped eigendecomposition of a full block (what its cache stores)."""
    return clipped_eigh.kernel(xp, matrix, threshold)


def apply_full(xp, matrix, eig, x, power, damping, scale):
    """``(sF + λI)^p x``: directly for :math:`p = 1`, else from the eigendecomposition."""
    if power == 1.0:
        return scale * (matrix @ x) + damping * x
    return apply_full_eigen(xp, eig, x, power, damping, scale)


def apply_full_eigen(xp, eig, x, power, damping, scale):
    s, q = eig
    coeff = elementwise_power(xp, scale * s + damping, power)
    return q @ (coeff * (xp.matrix_transpose(q) @ x))


@capabilities(dask=DASK_NO_EIGH)
def full_block_matpower(matrix, x, power, damping=0.0, *, scale=1.0,
                        eigenvalue_clipping_threshold=0.0):
    r"""Power of a damped full (dense) block times a flat vector.

    .. math::

        (s\,F + \lambda I)^{p}\, x = Q\,\big((s\,\sigma + \lambda)^{\odot p} \odot Q^\top x\big),
        \qquad F = Q\,\mathrm{diag}(\sigma)\,Q^\top,

    with :math:`\sigma` clipped below at the threshold; :math:`p = 1` is computed directly as
    :math:`sFx + \lambda x`.  Exact and approximate powers coincide (TF ``FullFB``, kfac-jax
    ``Full``).

    Parameters
    ----------
    matrix : array [n, n], symmetric PSD
    x : array [n]
        The concatenation of the flattened parameters.
    power, damping, scale, eigenvalue_clipping_threshold : float

    Raises
    ------
    KFACValueError
        Shape mismatch, non-symmetric matrix, a negative power of a singular damped block.
    """
    func = "full_block_matpower"
    xp = namespace_of(func, matrix=matrix, x=x)
    check_symmetric(func, "matrix", matrix)
    n = matrix.shape[0]
    check_array(func, "x", x, ndim=1, shape=(n,), layout=f"[{n}]")
    power, damping, scale, c = check_common(func, {"matrix": matrix}, power, damping, scale,
                                             eigenvalue_clipping_threshold)
    if power != 1.0:
        check_namespace_has(func, "matrix", matrix, "linalg.eigh", "an eigendecomposition")
    eig = None if power == 1.0 else prepare_full(xp, matrix, c)
    with errors_named(func):
        return apply_full(xp, matrix, eig, x, power, damping, scale)


@capabilities(dask="yes")
def scaled_identity_matpower(x, power, damping=0.0, *, scale=1.0):
    r"""Power of a damped scaled identity block (kfac-jax ``ScaledIdentity``).

    .. math::

        (s I + \lambda I)^{p}\, x = (s + \lambda)^{p}\, x .
    """
    func = "scaled_identity_matpower"
    namespace_of(func, x=x)
    check_array(func, "x", x)
    like = {"x": x}
    power = check_scalar(func, "power", power, like=like)
    damping = check_scalar(func, "damping", damping, nonnegative=True, like=like)
    scale = check_scalar(func, "scale", scale, nonnegative=True, like=like)
    base = scale + damping
    if power < 0 and base == 0.0:
        raise KFACValueError(f"{func}: scale + damping must be positive for the negative power "
                             f"{power}; got 0.")
    return (base**power) * x


