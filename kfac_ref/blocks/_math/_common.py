"""Shared parts of the formula functions of :mod:`kfac_ref.blocks._math`: the option tuples,
input checks, the vector maps of the blocks and damping normalisation.
"""

from __future__ import annotations

import math

from ..._backend import (
    check_array,
    check_scalar,
    check_scalars_with,
    check_symmetric,
    value_checks,
)
from ..._support import capabilities
from ...linalg import (
    PI_NORMS,
    ZERO_FACTOR_FALLBACKS,
    power_of_eigenvalues,
)

__all__ = ["PI_NORMS", "ZERO_FACTOR_FALLBACKS"]  # re-exported: their home is kfac_ref.linalg


# --------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------
def validated_internals():
    """Context for the computation after a public method validated its inputs (see the
    module docstring)."""
    return value_checks(False)


def check_factor(func, name, f):
    """A Kronecker factor: symmetric [n, n] or a diagonal [n]."""
    check_array(func, name, f, ndim=(1, 2), layout="[n, n] or diagonal [n]")
    if f.ndim == 2:
        check_symmetric(func, name, f)
    return f


def check_common(func, like, power, damping, scale, threshold=0.0):
    """The block's scalars, each a number or a 0-D array like the arrays named in ``like``."""
    power = check_scalar(func, "power", power, like=like)
    damping = check_scalar(func, "damping", damping, nonnegative=True, like=like)
    scale = check_scalar(func, "scale", scale, positive=True, like=like)
    threshold = check_scalar(func, "eigenvalue_clipping_threshold", threshold, like=like)
    return power, damping, scale, threshold


def elementwise_power(xp, s, power):
    """``s**power`` with clear errors (one implementation: kfac_ref.linalg's)."""
    return power_of_eigenvalues(xp, s, power)



# --------------------------------------------------------------------------------------
# Vector maps shared by the blocks
# --------------------------------------------------------------------------------------
def to_mat2d(xp, kernel, bias, q):
    r"""``(kernel, bias)`` → ``[W; b]`` of shape ``[K (+1), q]``: the kernel reshaped
    row-major to ``[-1, q]``, the bias (or None) appended as the last row."""
    mat = xp.reshape(kernel, (-1, q))
    if bias is None:
        return mat
    return xp.concat([mat, xp.reshape(bias, (1, q))], axis=0)


def from_mat2d(xp, mat, kernel_shape, has_bias):
    """``[W; b]`` → ``(kernel, bias)`` (bias None without a bias row); inverse of
    :func:`to_mat2d`."""
    k = math.prod(kernel_shape[:-1])
    kernel = xp.reshape(mat[:k, :], tuple(kernel_shape))
    return kernel, (mat[k, :] if has_bias else None)


def flatten(xp, arrays):
    """A tuple of arrays → their row-major flattenings, concatenated (TF's
    ``tensors_to_column``, the flat order of the kfac-jax blocks)."""
    return xp.concat([xp.reshape(v, (-1,)) for v in arrays])


def unflatten(xp, flat, shapes):
    """A flat vector → a tuple of arrays of ``shapes``; inverse of :func:`flatten`."""
    out, i = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(xp.reshape(flat[i:i + n], tuple(shape)))
        i += n
    return tuple(out)



# --------------------------------------------------------------------------------------
# Damping bookkeeping for replicated parameters
# --------------------------------------------------------------------------------------
@capabilities(array_free=True, formula=True)
def normalize_damping(damping, num_replications, normalize_damping_power=1.0):
    r"""Damping per replication of a parameter used :math:`k` times (TF ``normalize_damping``).

    .. math::

        \lambda_k = \lambda / k^{\,\rho}, \qquad \rho = \texttt{normalize\_damping\_power}
        \ (\text{TF's } \texttt{NORMALIZE\_DAMPING\_POWER} = 1),

    with :math:`\rho = 0` meaning no normalisation.  For a block :math:`k\,(A\otimes G)`
    (:math:`k = |T|` conv locations, :math:`T` time steps) factored damping with
    :math:`\lambda_k` gives :math:`k A\otimes G + \lambda I` + a residual (see the docs
    page *Convolutions: KFC, KFAC-expand and KFAC-reduce*; Grosse & Martens 2016).
    """
    func = "normalize_damping"
    damping = check_scalar(func, "damping", damping, nonnegative=True)
    k = check_scalar(func, "num_replications", num_replications, positive=True)
    rho = check_scalar(func, "normalize_damping_power", normalize_damping_power)
    # no arrays here: the 0-D ones among the three must agree with each other
    check_scalars_with(func, {}, damping=damping, num_replications=k,
                       normalize_damping_power=rho)
    if rho:
        return damping / k**rho
    return damping


