r"""Linear algebra of K-FAC factors: covariances, damped matrix functions, π, Kronecker products.

Every function takes arrays from any array-API namespace (NumPy, CuPy, PyTorch, JAX,
array-api-strict) and returns arrays of the same namespace, device and floating dtype.
Scalars (damping, exponents, thresholds) are Python numbers, so they never change the
dtype of a result.

Vectorisation conventions (see the conventions page of the docs):

* ``vec_r`` (``order="C"``) flattens row-major; for ``X`` of shape ``[p, q]``
  :math:`(A \otimes B)\,\mathrm{vec}_r(X) = \mathrm{vec}_r(A X B^\top)`.
* ``vec_c`` (``order="F"``) flattens column-major; for ``X`` of shape ``[q, p]``
  :math:`(A \otimes B)\,\mathrm{vec}_c(X) = \mathrm{vec}_c(B X A^\top)`.

The K-FAC block of a dense layer whose combined parameter matrix ``[W; b]`` has shape
``[d_in + 1, d_out]`` (TF/JAX kernel layout) is ``kron(A, G)`` acting on the row-major
flattening of that matrix.

Negative powers of singular matrices
------------------------------------
Every function here that takes a negative power (or an inverse, or a Cholesky factor) of a
damped matrix :math:`S = M + \lambda I` of order :math:`n` applies one rule: :math:`S` is
numerically singular, and the call raises :class:`~kfac_ref.KFACValueError` asking for
damping, when

.. math::

    \sigma_{\min}(S) \le n\,\varepsilon\,\sigma_{\max}(S),

:math:`\varepsilon` the machine epsilon of the dtype — the tolerance below which NumPy's
``matrix_rank`` counts a singular value as zero.  The eigenvalue paths test the damped
eigenvalues; the Cholesky paths test the squared pivots :math:`L_{ii}^2`, which lie inside
:math:`[\sigma_{\min}, \sigma_{\max}]`, so a matrix refused by the pivots is refused by the
eigenvalues too.  Under factored damping each damped Kronecker factor is tested (orders
:math:`p` and :math:`q`); under exact damping :math:`A \otimes B + \lambda I` is tested as one
matrix of order :math:`pq`.  This is a value check: it is skipped for lazy arrays and under
``kfac_ref.value_checks(False)`` (the result is then whatever the arithmetic gives).  On a
lazy array whose factorisation runs block by block at compute time (a Dask array) a
Cholesky factorisation that fails, because :math:`S` is not positive definite, gives NaN
entries when the graph is computed, not an exception from inside the graph.

Missing linear algebra
----------------------
The eigendecompositions ``linalg.eigh`` and ``linalg.eigvalsh`` are an optional extension
of the array API standard that a namespace may lack (Dask's has neither).  A function that
would need one checks for it before any computation and raises
:class:`~kfac_ref.KFACTypeError` naming the argument and what its namespace lacks: the
eigenvalue paths (:func:`clipped_eigh`, :func:`damped_matpower` with :math:`p \ne 1`,
:func:`kron_damped_matpower_matvec`) and the ``"2_norm"`` of :func:`factor_norm`.  The
Cholesky functions need only the Cholesky factorisation.

One inverse: Cholesky, not ``eigh``
-----------------------------------
A single damped inverse :math:`(M + \lambda I)^{-1}` is computed from the Cholesky factor
:math:`L L^\top = M + \lambda I` and the backend's triangular kernels (LAPACK ``potri`` for
NumPy through SciPy when it is installed, ``torch.cholesky_inverse``, triangular solves for
CuPy and JAX; the array API itself has no triangular solve, so other namespaces, e.g.
array-api-strict, solve :math:`L X = I` with the general ``linalg.solve``).  This is TF
K-FAC's rule: Cholesky when one power :math:`-1` is needed, the eigendecomposition only when
other powers (or exact damping, which needs both factors' eigenbases) are requested.
:func:`damped_matpower` with ``power = -1`` takes the Cholesky path only when eigenvalue
clipping provably changes nothing beyond rounding: the Cholesky factorisation of
:math:`M - (c - \delta) I`, :math:`\delta = n\,\varepsilon \max_i |M_{ii}|`, must succeed,
i.e. every eigenvalue of :math:`M` exceeds :math:`c - \delta`; otherwise, and for lazy
arrays, it clips through ``eigh`` as for every other power.  The unchecked kernel takes
``second_moment=True`` from callers whose matrix is a second moment by construction (the
K-FAC factors, averages of :math:`X^\top X / n` with non-negative weights): with
:math:`c \le 0` such a matrix is positive semi-definite up to the rounding of its own
computation, so clipping changes it by no more than that rounding and the test (a second
factorisation as costly as the inverse) is skipped, for lazy arrays too.  kfac-jax's
``pi_adjusted_kronecker_inverse`` and TF K-FAC's ``posdef_inv`` invert such factors by
Cholesky without clipping.

One damped Kronecker kernel
---------------------------
A factored damped Kronecker product :math:`\big(s(A + \delta_A I)\otimes(B + \delta_B I)\big)^p`
is assembled in one place, the internal kernel ``kron_factored_powers`` /
``kron_factored_apply`` at the end of this module (the π split ``kron_factor_dampings``, then
one :func:`damped_matpower` kernel per factor; ``kron_factored_cholesky_apply`` for TF's
Cholesky products).  :func:`kron_damped_matpower_matvec`,
:func:`kfac_ref.blocks.kronecker_block_matpower` and the Kronecker blocks of
:mod:`kfac_ref.blocks.kfac_jax` and :mod:`kfac_ref.blocks.tf` all call it, so a block's
``multiply_inverse`` reads from the public method to LAPACK ``potrf`` in four files
(``tools/trace_calls.py`` prints the chain).  Kernels take no function name: they raise
messages that say what failed, and the public function puts its own name in front.
"""

from __future__ import annotations

import math

from ._backend import (
    KFACValueError,
    _triangular_kernels,
    check_array,
    check_namespace_has,
    check_option,
    check_scalar,
    check_square,
    check_symmetric,
    checks_values,
    cholesky_inverse,
    cholesky_lower,
    errors_named,
    eye_like,
    gram_is_exactly_symmetric,
    is_array,
    is_lazy,
    is_linalg_error,
    kernel_error,
    kernel_of,
    lower_triangular_inverse,
    namespace_of,
    one_like,
    ones_like_shape,
    optional_linalg,
    rare_branch,
    value_check,
)
from ._support import DASK_NO_EIGH, capabilities

__all__ = [
    "compute_cov",
    "append_homog",
    "clipped_eigh",
    "damped_matpower",
    "damped_inverse",
    "damped_cholesky",
    "damped_cholesky_inverse",
    "factor_norm",
    "FACTOR_NORMS",
    "pi_tracenorm",
    "pi_adjusted_damping",
    "kron",
    "kron_matvec",
    "kron_matmat",
    "kron_damped_matpower_matvec",
    "kron_damped_inverse_matvec",
    "kron_eigenbasis_matpower",
]

FACTOR_NORMS = ("avg_diag", "avg_fro", "2_norm", "1_norm")
"""Factor norms accepted by :func:`factor_norm` (kfac-jax's ``psd_matrix_norm`` names)."""

_KRON_DAMPING = ("factored", "exact")


# --------------------------------------------------------------------------------------
# Covariances
# --------------------------------------------------------------------------------------
@capabilities(jit="yes", vmap="yes", dask="yes")
def compute_cov(tensor, tensor_right=None, normalizer=None):
    r"""Uncentred second moment of the rows of a 2-D array.

    .. math::

        C = \tfrac12\Big(\frac{X^\top X}{n} + \big(\frac{X^\top X}{n}\big)^\top\Big),
        \qquad
        C_{XY} = \frac{X^\top Y}{n} \ \text{(with ``tensor_right``, not symmetrised)}.

    The statistic is *uncentred* (no mean is subtracted), as K-FAC requires.  The result is
    exactly symmetric: the symmetrisation matches TF K-FAC's ``compute_cov`` and removes the
    rounding asymmetry of a GEMM; on NumPy, whose ``X.T @ X`` is BLAS ``syrk`` (one triangle,
    mirrored) and so already exactly symmetric, it is skipped.  kfac-jax does not symmetrise
    (the two differ only by rounding).

    Parameters
    ----------
    tensor : array [n, d]
        Rows are samples.
    tensor_right : array [n, e], optional
        Second factor of the cross moment.
    normalizer : float, optional
        The :math:`n` of the formula; defaults to the number of rows.  Must be positive.

    Returns
    -------
    array [d, d] (or [d, e])

    Raises
    ------
    KFACValueError, KFACTypeError
        Non-2-D or non-floating input, NaN/Inf, row counts that differ, non-positive
        ``normalizer``.

    References
    ----------
    Martens & Grosse (2015), §3.

    Examples
    --------
    >>> import numpy as np
    >>> from kfac_ref import compute_cov
    >>> compute_cov(np.array([[1.0, 2.0], [3.0, 4.0]]))
    array([[ 5.,  7.],
           [ 7., 10.]])
    """
    func = "compute_cov"
    xp = namespace_of(func, tensor=tensor, tensor_right=tensor_right)
    check_array(func, "tensor", tensor, ndim=2, layout="[n, d]")
    if tensor_right is not None:
        check_array(func, "tensor_right", tensor_right, ndim=2, layout="[n, e]")
        if tensor_right.shape[0] != tensor.shape[0]:
            raise KFACValueError(
                f"{func}: tensor_right must have as many rows as tensor ({tensor.shape[0]}); "
                f"got shape {tuple(tensor_right.shape)}."
            )
    if normalizer is None:
        normalizer = tensor.shape[0]
        if normalizer == 0:
            raise KFACValueError(f"{func}: tensor must have at least one row; got shape "
                                 f"{tuple(tensor.shape)}.")
    normalizer = check_scalar(func, "normalizer", normalizer, positive=True,
                              like={"tensor": tensor})
    return _compute_cov(xp, tensor, tensor_right, normalizer)


@kernel_of(compute_cov)
def _compute_cov(xp, tensor, tensor_right=None, normalizer=None):
    if normalizer is None:
        normalizer = tensor.shape[0]
    cov = tensor.T @ (tensor if tensor_right is None else tensor_right)
    # the product is this function's own fresh array: divided where it lies, one pass and
    # one d×d temporary fewer (JAX and Dask, without in-place arithmetic, make a new array)
    cov /= normalizer
    if tensor_right is None and not gram_is_exactly_symmetric(xp):
        cov = (cov + cov.T) / 2.0
    return cov


@capabilities(jit="yes", vmap="yes", dask="yes")
def append_homog(tensor, homog_value=1.0):
    r"""Append a constant (homogeneous) coordinate to the last axis.

    .. math::

        \bar a = [a_1, \dots, a_d, c], \qquad c = \texttt{homog\_value}.

    This is how the bias enters the input factor: :math:`\bar a \bar a^\top` has the bias
    row/column LAST (kfac_ref, TF K-FAC and kfac-jax all put it there).

    Parameters
    ----------
    tensor : array [..., d]
    homog_value : float
        Value of the appended coordinate (1 for a bias).

    Returns
    -------
    array [..., d + 1]
    """
    func = "append_homog"
    xp = namespace_of(func, tensor=tensor)
    check_array(func, "tensor", tensor, min_ndim=1, layout="[..., d]")
    homog_value = check_scalar(func, "homog_value", homog_value, like={"tensor": tensor})
    return _append_homog(xp, tensor, homog_value)


@kernel_of(append_homog)
def _append_homog(xp, tensor, homog_value=1.0):
    column = ones_like_shape(tensor, (*tensor.shape[:-1], 1))
    if not (isinstance(homog_value, (int, float)) and homog_value == 1.0):  # a bias: ones
        column = column * homog_value
    return xp.concat([tensor, column], axis=-1)


# --------------------------------------------------------------------------------------
# Matrix functions of symmetric PSD matrices
# --------------------------------------------------------------------------------------
@capabilities(dask=DASK_NO_EIGH)
def clipped_eigh(matrix, eigenvalue_clipping_threshold=0.0):
    r"""Eigendecomposition of a symmetric matrix with eigenvalues clipped from below.

    .. math::

        M = Q \,\mathrm{diag}(s)\, Q^\top, \qquad s_i \leftarrow \max(s_i, c).

    Clipping at :math:`c = 0` (TF K-FAC's ``EIGENVALUE_CLIPPING_THRESHOLD``, kfac-jax's
    ``safe_psd_eigh``) removes the small negative eigenvalues that rounding gives a PSD
    matrix, so fractional and negative powers stay real and finite once damping is added.

    Parameters
    ----------
    matrix : array [n, n], symmetric
    eigenvalue_clipping_threshold : float
        Lower bound :math:`c` for the eigenvalues.

    Returns
    -------
    (s, Q) : (array [n], array [n, n])
        Eigenvalues (ascending before clipping) and orthonormal eigenvectors (columns).
    """
    func = "clipped_eigh"
    xp = namespace_of(func, matrix=matrix)
    check_namespace_has(func, "matrix", matrix, "linalg.eigh", _EIGH_WHY)
    check_symmetric(func, "matrix", matrix)
    c = check_scalar(func, "eigenvalue_clipping_threshold", eigenvalue_clipping_threshold,
                     like={"matrix": matrix})
    return _clipped_eigh(xp, matrix, c)


@kernel_of(clipped_eigh)
def _clipped_eigh(xp, matrix, threshold=0.0):
    # Symmetrise before eigh: backends read different triangles, and the input is only
    # symmetric up to rounding.
    s, q = optional_linalg(xp, "eigh")((matrix + matrix.T) / 2.0)
    return xp.clip(s, min=threshold), q


_EIGH_WHY = "an eigendecomposition"


def _check_exponent(func, power, like):
    return check_scalar(func, "power", power, like=like)


def _singular_tolerance(xp, spectrum, order):
    """``n·eps·max|σ|``: the value at or below which an eigenvalue (or squared Cholesky
    pivot) of a matrix of order ``n`` counts as zero (see the module docstring)."""
    eps = xp.finfo(spectrum.dtype).eps
    return order * eps * xp.max(xp.abs(spectrum))


def power_of_eigenvalues(xp, s, power, *, order=None):
    r"""``s**power`` for the (clipped, damped) eigenvalues ``s`` of a symmetric matrix.

    .. math::

        s_i \mapsto s_i^{p}, \qquad \text{refused for } p < 0 \text{ when }
        \min_i s_i \le n\,\varepsilon \max_i |s_i| .

    The one place where eigenvalues are raised to a power.  A negative ``power`` refuses a
    numerically singular spectrum (``n = order``, default ``s.size``) and a fractional one a
    negative eigenvalue (a :func:`~kfac_ref._backend.kernel_error`: the public caller names
    itself with ``errors_named``); both are value checks (skipped for lazy arrays and when
    value checks are off).  ``s`` may have any shape (an outer product of two spectra for a
    Kronecker product).  Internal kernel: its callers have validated their arguments.
    """
    if math.prod(s.shape) == 0:
        return s
    if checks_values(s):
        n = math.prod(s.shape) if order is None else order

        def singular():
            raise kernel_error(
                f"matrix + damping·I must be positive definite for the negative "
                f"exponent {power}; its smallest eigenvalue after clipping and damping is "
                f"{float(xp.min(s)):.3g}, at most n·eps·max = "
                f"{float(_singular_tolerance(xp, s, n)):.3g} (numerically singular). "
                "Add damping."
            )

        def negative():
            raise kernel_error(
                f"matrix + damping·I must be positive semi-definite for the "
                f"fractional exponent {power}; its smallest eigenvalue is "
                f"{float(xp.min(s)):.3g}."
            )

        if power < 0:
            value_check(xp.min(s) > _singular_tolerance(xp, s, n), singular)
        if not float(power).is_integer():
            value_check(xp.min(s) >= 0, negative)
    if power == 1.0:
        return s
    return s**power


@capabilities(jit="yes", dask=DASK_NO_EIGH)
def damped_matpower(matrix, power, damping=0.0, eigenvalue_clipping_threshold=0.0):
    r"""Power of a damped symmetric PSD matrix.

    .. math::

        (M + \lambda I)^{p} = Q\, \mathrm{diag}\big((\max(s, c) + \lambda)^{p}\big)\, Q^\top,
        \qquad M = Q\,\mathrm{diag}(s)\,Q^\top .

    For :math:`p = 1` the result is computed directly as :math:`M + \lambda I` (no
    eigendecomposition, no clipping), as TF K-FAC does.  For :math:`p = -1` it is the
    Cholesky inverse :math:`L^{-\top}L^{-1}`, :math:`LL^\top = M + \lambda I`, whenever
    clipping changes nothing beyond rounding (every eigenvalue of :math:`M` above
    :math:`c - n\varepsilon\max_i|M_{ii}|`, tested by a Cholesky factorisation; see the
    module docstring).  Every other exponent, integer or fractional, and an inverse that
    clipping would change, goes through :func:`clipped_eigh`.  A negative power of a numerically
    singular damped matrix raises (the rule is in the module docstring).

    Parameters
    ----------
    matrix : array [n, n], symmetric
    power : float
        The exponent :math:`p`.
    damping : float
        :math:`\lambda \ge 0`, added after clipping.
    eigenvalue_clipping_threshold : float
        :math:`c`; eigenvalues below it are raised to it before damping is added.

    Raises
    ------
    KFACValueError
        Non-symmetric or non-square matrix, negative damping, a negative exponent of a
        numerically singular damped matrix.
    """
    func = "damped_matpower"
    xp = namespace_of(func, matrix=matrix)
    check_symmetric(func, "matrix", matrix)
    like = {"matrix": matrix}
    power = _check_exponent(func, power, like)
    if power != 1.0:  # p = 1 is M + λI; every other power may take the eigenvalues
        check_namespace_has(func, "matrix", matrix, "linalg.eigh", _EIGH_WHY)
    damping = check_scalar(func, "damping", damping, nonnegative=True, like=like)
    c = check_scalar(func, "eigenvalue_clipping_threshold", eigenvalue_clipping_threshold,
                     like=like)
    with errors_named(func):
        return _damped_matpower(xp, matrix, power, damping, c)


def add_to_diagonal(xp, matrix, damping):
    r""":math:`M + \lambda I` without forming :math:`I` (internal API of the damped kernels).

    .. math:: (M + \lambda I)_{ij} = M_{ij} + \lambda\,\delta_{ij}

    NumPy and CuPy add :math:`\lambda` to the diagonal of a fresh copy (a strided view of
    ``n`` entries), PyTorch to the diagonal view of a fresh clone; the input is never
    written.  JAX (XLA fuses ``M + λ·eye`` into one pass), lazy arrays and other libraries
    take ``M + λ·eye``.  Same numbers either way: :math:`M_{ij} + 0` is :math:`M_{ij}`.
    """
    n = matrix.shape[0]
    kind = _triangular_kernels(xp) if not is_lazy(matrix) else None
    if kind in ("scipy", "cupy"):
        out = matrix.copy()
        out.reshape(-1)[:: n + 1] += damping
        return out
    if kind == "torch":
        out = matrix.clone()
        out.diagonal().add_(damping)
        return out
    return matrix + damping * eye_like(matrix, n)


@kernel_of(damped_matpower)
def _damped_matpower(xp, matrix, power, damping=0.0, threshold=0.0, *, second_moment=False):
    if power == 1.0:
        return add_to_diagonal(xp, matrix, damping)
    void = (second_moment and threshold <= 0.0) or _clipping_is_void(xp, matrix, threshold)
    if power == -1.0 and void:
        try:
            # the inverse from the Cholesky factor here, not through _damped_inverse: one
            # call fewer between a block's multiply_inverse and LAPACK
            return cholesky_inverse(xp, _damped_cholesky(xp, matrix, damping))
        except KFACValueError:
            pass  # near-singular by the pivots: let the eigenvalues decide (and word the error)
    s, q = _clipped_eigh(xp, matrix, threshold)
    powers = power_of_eigenvalues(xp, s + damping, power)
    return (q * powers) @ q.T


def _cholesky_succeeds(xp, matrix):
    """Whether ``matrix`` has a finite Cholesky factor (backends raise or return NaN)."""
    try:
        low = cholesky_lower(xp, matrix)
    except Exception:  # backends raise their own LinAlgError types
        return False
    return bool(xp.all(xp.isfinite(xp.linalg.diagonal(low))))


def _clipping_is_void(xp, matrix, threshold):
    """Whether clipping the eigenvalues of ``matrix`` at ``threshold`` changes it by at most
    rounding: ``matrix − (threshold − δ) I`` is positive definite, ``δ = n·eps·max|M_ii|``
    (see the module docstring).  Always False for lazy arrays (no value-dependent branch)."""
    n = matrix.shape[0]
    if n == 0 or not checks_values(matrix):
        return False
    diag = xp.linalg.diagonal(matrix)
    delta = n * xp.finfo(matrix.dtype).eps * float(xp.max(xp.abs(diag)))
    shifted = add_to_diagonal(xp, matrix, -(threshold - delta))
    return _cholesky_succeeds(xp, (shifted + shifted.T) / 2.0)


@capabilities(jit="yes", dask="yes")
def damped_inverse(matrix, damping=0.0):
    r"""Inverse of a damped symmetric positive definite matrix through Cholesky.

    .. math::

        (M + \lambda I)^{-1} = L^{-\top} L^{-1}, \qquad L L^\top = M + \lambda I .

    TF K-FAC's ``posdef_inv``: the path a factor takes when only inverses are registered
    (fewer than ``EIGENVALUE_DECOMPOSITION_THRESHOLD`` of them).  No eigenvalue clipping is
    applied, so an indefinite :math:`M + \lambda I` raises, and so does a numerically
    singular one (the rule is in the module docstring).
    """
    func = "damped_inverse"
    xp = namespace_of(func, matrix=matrix)
    damping = _check_cholesky_args(func, matrix, damping)
    with errors_named(func):
        return _damped_inverse(xp, matrix, damping)


@kernel_of(damped_inverse)
def _damped_inverse(xp, matrix, damping=0.0):
    return cholesky_inverse(xp, _damped_cholesky(xp, matrix, damping))


def _check_cholesky_args(func, matrix, damping):
    check_symmetric(func, "matrix", matrix)
    return check_scalar(func, "damping", damping, nonnegative=True, like={"matrix": matrix})


@capabilities(dask="yes")
def damped_cholesky(matrix, damping=0.0):
    r"""Lower Cholesky factor of a damped symmetric positive definite matrix.

    .. math::

        L L^\top = M + \lambda I, \qquad L \ \text{lower triangular}, \ L_{ii} > 0 .

    Raises
    ------
    KFACValueError
        When :math:`M + \lambda I` is not numerically positive definite (the rule is in the
        module docstring).
    """
    func = "damped_cholesky"
    xp = namespace_of(func, matrix=matrix)
    damping = _check_cholesky_args(func, matrix, damping)
    with errors_named(func):
        return _damped_cholesky(xp, matrix, damping)


@kernel_of(damped_cholesky)
def _damped_cholesky(xp, matrix, damping=0.0):
    damped = add_to_diagonal(xp, matrix, damping)
    try:
        l_factor = cholesky_lower(xp, damped)
    except Exception as exc:  # backends raise their own LinAlgError types
        if is_linalg_error(exc) and not checks_values(damped):
            return xp.full_like(damped, xp.nan)  # the policy of unchecked values: NaN
        raise kernel_error(
            f"matrix + damping·I must be positive definite; the Cholesky "
            f"factorisation failed ({type(exc).__name__}: {exc}). Add damping."
        ) from None
    n = matrix.shape[0]
    if n and checks_values(l_factor):
        # Some backends (JAX) return NaN instead of raising.  The squared pivots d² must
        # exceed n·eps·max d²: for the positive pivots of a factor that is
        # min d > sqrt(n·eps)·max d, and a NaN or non-positive pivot fails it too, so one
        # comparison (one host read, or none of its own inside deferred_value_checks)
        # decides; the message is worked out only when it fails.
        diag = xp.linalg.diagonal(l_factor)

        def fail():
            pivots = diag**2
            tol = _singular_tolerance(xp, pivots, n)
            if not bool(xp.all(xp.isfinite(pivots))):
                raise kernel_error(
                    "matrix + damping·I must be positive definite; the Cholesky "
                    "factor has non-finite entries. Add damping."
                )
            if float(xp.min(diag)) < 0.0:  # a factorisation that stopped without raising
                raise kernel_error(
                    "matrix + damping·I must be positive definite; the Cholesky "
                    "factorisation stopped at a negative pivot. Add damping."
                )
            raise kernel_error(
                f"matrix + damping·I must be positive definite; its smallest squared "
                f"Cholesky pivot is {float(xp.min(pivots)):.3g}, at most n·eps·max = "
                f"{float(tol):.3g} (numerically singular). Add damping."
            )

        value_check(xp.min(diag) > math.sqrt(n * xp.finfo(diag.dtype).eps) * xp.max(diag),
                    fail)
    return l_factor


@capabilities(dask="yes")
def damped_cholesky_inverse(matrix, damping=0.0):
    r"""Inverse of the lower Cholesky factor of a damped matrix (TF's ``cholesky_inverse``).

    .. math::

        L^{-1}, \qquad L L^\top = M + \lambda I, \qquad
        (M + \lambda I)^{-1} = L^{-\top} L^{-1}.

    The result is lower triangular.  A numerically singular :math:`M + \lambda I` raises
    (the rule is in the module docstring).
    """
    func = "damped_cholesky_inverse"
    xp = namespace_of(func, matrix=matrix)
    damping = _check_cholesky_args(func, matrix, damping)
    with errors_named(func):
        return _damped_cholesky_inverse(xp, matrix, damping)


@kernel_of(damped_cholesky_inverse)
def _damped_cholesky_inverse(xp, matrix, damping=0.0):
    return lower_triangular_inverse(xp, _damped_cholesky(xp, matrix, damping))


# --------------------------------------------------------------------------------------
# Factor norms and the π damping split
# --------------------------------------------------------------------------------------
@capabilities(jit="yes", dask="yes")
def factor_norm(matrix, norm_type="avg_diag"):
    r"""Scale of a PSD Kronecker factor, normalised so that the identity has norm 1.

    .. math::

        \|M\|_{\text{avg\_diag}} = \frac{\operatorname{tr} M}{n}, \quad
        \|M\|_{\text{avg\_fro}} = \frac{\|M\|_F}{\sqrt n}, \quad
        \|M\|_{\text{2\_norm}} = \lambda_{\max}(M), \quad
        \|M\|_{\text{1\_norm}} = \max_j \sum_i |M_{ij}| .

    These are kfac-jax's ``psd_matrix_norm`` choices; ``"avg_diag"`` is the trace norm of
    TF K-FAC's :func:`pi_tracenorm`.  A 1-D input is read as the diagonal of a diagonal
    matrix and a 0-D input as a 1×1 matrix.  The sums are computed on :math:`M / \max|M|`
    and scaled back, so no norm overflows or underflows where :math:`\max|M|` itself is
    representable (``1e30·I`` in float32 has ``avg_fro`` norm ``1e30``, not ``inf``).

    Parameters
    ----------
    matrix : array [n, n], [n] or []
    norm_type : {"avg_diag", "avg_fro", "2_norm", "1_norm"}

    Returns
    -------
    array []
        A 0-D array in the namespace, device and dtype of ``matrix`` (no host round trip).
    """
    func = "factor_norm"
    xp = namespace_of(func, matrix=matrix)
    check_option(func, "norm_type", norm_type, FACTOR_NORMS)
    check_norm_argument(func, "matrix", matrix, norm_type)
    return _factor_norm(xp, matrix, norm_type)


def check_norm_argument(func, name, matrix, norm_type="avg_diag"):
    """Validate a factor-norm argument: 0-, 1- or 2-D (square), not empty, finite, and a
    namespace with ``linalg.eigvalsh`` for the ``"2_norm"`` of a matrix (internal API: the
    checks of :func:`factor_norm` and the π functions)."""
    check_array(func, name, matrix, ndim=(0, 1, 2))
    if matrix.ndim == 2:
        check_square(func, name, matrix)
        if norm_type == "2_norm":
            check_namespace_has(func, name, matrix, "linalg.eigvalsh",
                                "the largest eigenvalue of the 2_norm")
    if matrix.ndim and matrix.shape[0] == 0:
        raise KFACValueError(f"{func}: {name} must not be empty; got shape "
                             f"{tuple(matrix.shape)}.")


@kernel_of(factor_norm)
def _factor_norm(xp, matrix, norm_type="avg_diag"):
    if matrix.ndim == 0:
        return xp.abs(matrix)
    if norm_type == "2_norm" and matrix.ndim == 1:
        return xp.max(xp.abs(matrix))
    # Every sum, and the symmetrisation of the 2_norm, is taken on M / max|M|: float32
    # squares overflow above ~1e19 and underflow below ~1e-19, a sum of entries near the
    # largest float overflows, and halving the smallest subnormals gives 0.  A zero matrix
    # keeps the scale 1 (its norm is 0).
    n = matrix.shape[0]
    if norm_type == "avg_diag":  # only the diagonal is read: scale it by its own max
        diag = matrix if matrix.ndim == 1 else xp.linalg.diagonal(matrix)
        unit = _nonzero_peak(xp, diag)
        return unit * (xp.sum(diag / unit) / n)
    unit = _nonzero_peak(xp, matrix)
    m = matrix / unit
    if norm_type == "2_norm":
        return unit * xp.max(xp.abs(optional_linalg(xp, "eigvalsh")((m + m.T) / 2.0)))
    if norm_type == "avg_fro":
        return unit * (xp.sqrt(xp.sum(m * m)) / math.sqrt(n))
    if m.ndim == 1:  # 1-norm of a diagonal matrix
        return unit * xp.max(xp.abs(m))
    return unit * xp.max(xp.sum(xp.abs(m), axis=0))


def _nonzero_peak(xp, x):
    """``max|x|``, at least the smallest normal number (a zero matrix: its norm is 0 in any
    unit): the unit a norm's sum is taken in.  Dividing by a power of two, as that floor
    is, is exact, so a subnormal matrix keeps every bit."""
    return xp.clip(xp.max(xp.abs(x)), min=float(xp.finfo(x.dtype).smallest_normal))


@capabilities(jit="yes", dask="yes")
def pi_tracenorm(left_cov, right_cov):
    r"""The trace-norm π that splits damping between two Kronecker factors.

    .. math::

        \pi = \sqrt{\frac{\operatorname{tr}(L)/\dim L}{\operatorname{tr}(R)/\dim R}},
        \qquad \pi = 1 \text{ if either trace is } 0 .

    It minimises the trace of the residual of factored Tikhonov damping,
    :math:`\operatorname{tr}\big(\pi\gamma\, I\otimes R + \tfrac{\gamma}{\pi} L\otimes I\big)`
    (Martens & Grosse 2015, §6.3).  The fall-back π = 1 for a zero trace is TF K-FAC's.
    1-D inputs are diagonals (diagonal factors such as the embedding input factor).

    Parameters
    ----------
    left_cov, right_cov : array [n, n] or [n]

    Returns
    -------
    array []
        A 0-D array in the inputs' namespace, device and dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from kfac_ref import pi_tracenorm
    >>> float(pi_tracenorm(np.diag([4.0, 4.0]), np.eye(3)))   # sqrt((8/2) / (3/3))
    2.0
    """
    func = "pi_tracenorm"
    xp = _check_pi_args(func, left_cov, right_cov, "avg_diag")
    return _pi(xp, left_cov, right_cov, "avg_diag")


def _check_pi_args(func, left, right, norm_type):
    xp = namespace_of(func, left_cov=left, right_cov=right)
    check_option(func, "norm_type", norm_type, FACTOR_NORMS)
    check_norm_argument(func, "left_cov", left, norm_type)
    check_norm_argument(func, "right_cov", right, norm_type)
    return xp


@kernel_of(pi_tracenorm)
def _pi(xp, left, right, norm_type="avg_diag", *, norms=None, nonzero=False):
    """π = sqrt(‖L‖/‖R‖), 1 when either norm is 0 (any norm of :func:`factor_norm`);
    ``norms``: the pair ``(‖L‖, ‖R‖)`` when the caller has computed it already;
    ``nonzero``: the caller has found both norms non-zero (no guard needed)."""
    left_norm, right_norm = norms if norms is not None else (
        _factor_norm(xp, left, norm_type), _factor_norm(xp, right, norm_type))
    if nonzero:
        return xp.sqrt(left_norm) / xp.sqrt(right_norm)
    zero = (left_norm == 0) | (right_norm == 0)
    one = one_like(xp, left_norm)
    # sqrt of each norm, then the ratio: the ratio of two float32 norms can overflow.  A
    # zero norm replaces both by 1, so the ratio is then 1 itself.
    return xp.sqrt(xp.where(zero, one, left_norm)) / xp.sqrt(xp.where(zero, one, right_norm))


@capabilities(jit="yes", dask="yes")
def pi_adjusted_damping(left_cov, right_cov, damping, norm_type="avg_diag"):
    r"""Split a damping λ between two Kronecker factors with π.

    .. math::

        (L + \pi\sqrt\lambda\, I) \otimes (R + \tfrac{\sqrt\lambda}{\pi} I)
        = L \otimes R + \lambda I + \pi\sqrt\lambda\, I \otimes R
          + \tfrac{\sqrt\lambda}{\pi}\, L \otimes I,
        \qquad
        \pi = \sqrt{\|L\| / \|R\|} .

    With ``norm_type="avg_diag"`` π is :func:`pi_tracenorm` (TF K-FAC's
    ``compute_pi_adjusted_damping``, kfac-jax's default); other norms are kfac-jax's
    alternatives (:func:`factor_norm`).

    Returns
    -------
    (left_damping, right_damping) : (array [], array [])
        :math:`(\pi\sqrt\lambda,\ \sqrt\lambda/\pi)`, 0-D arrays in the inputs' namespace,
        device and dtype.
    """
    func = "pi_adjusted_damping"
    xp = _check_pi_args(func, left_cov, right_cov, norm_type)
    damping = check_scalar(func, "damping", damping, nonnegative=True,
                           like={"left_cov": left_cov})
    return _pi_adjusted_damping(xp, left_cov, right_cov, damping, norm_type)


@kernel_of(pi_adjusted_damping)
def _pi_adjusted_damping(xp, left, right, damping, norm_type="avg_diag", *, norms=None,
                         nonzero=False):
    pi = _pi(xp, left, right, norm_type, norms=norms, nonzero=nonzero)
    # an array λ (a norm-scaled identity weight) stays on the device: no host read, and
    # under jax.jit a traced λ cannot become a Python float (sqrt is correctly rounded in
    # both, so the numbers are the same)
    root = xp.sqrt(damping) if is_array(damping) else math.sqrt(damping)
    return pi * root, root / pi


# --------------------------------------------------------------------------------------
# Kronecker products
# --------------------------------------------------------------------------------------
@capabilities(dask="yes")
def kron(a, b):
    r"""Dense Kronecker product.

    .. math::

        (A \otimes B)_{(i k),(j l)} = A_{ij} B_{kl}, \qquad
        \text{row index } i\,q + k,\ \text{column index } j\,q' + l,

    for :math:`A` of shape ``[p, p']`` and :math:`B` of shape ``[q, q']``.  Use it as an
    oracle and for teaching; K-FAC products never form it (see :func:`kron_matvec`).
    """
    func = "kron"
    xp = namespace_of(func, a=a, b=b)
    _check_kron_pair(func, a, b)
    return _kron(xp, a, b)


@kernel_of(kron)
def _kron(xp, a, b):
    p, pp = a.shape
    q, qq = b.shape
    prod = a[:, None, :, None] * b[None, :, None, :]
    return xp.reshape(prod, (p * q, pp * qq))


def _check_kron_pair(func, a, b):
    check_array(func, "a", a, ndim=2)
    check_array(func, "b", b, ndim=2)


def _check_kron_vector(func, x, order, in_shape):
    """``x`` is a flat vector of length p'q' or a (batched) matrix in ``order``'s layout."""
    p_in, q_in = in_shape
    check_array(func, "x", x, min_ndim=1)
    if x.ndim == 1:
        if x.shape[0] != p_in * q_in:
            raise KFACValueError(
                f"{func}: x must be a flat vector of length {p_in * q_in} (= {p_in}·{q_in}); "
                f"got shape {tuple(x.shape)}."
            )
    elif order == "C" and tuple(x.shape[-2:]) != (p_in, q_in):
        raise KFACValueError(
            f"{func}: x must be [..., {p_in}, {q_in}] for order='C' (X with A X Bᵀ); "
            f"got shape {tuple(x.shape)}."
        )
    elif order == "F" and tuple(x.shape[-2:]) != (q_in, p_in):
        raise KFACValueError(
            f"{func}: x must be [..., {q_in}, {p_in}] for order='F' (X with B X Aᵀ); "
            f"got shape {tuple(x.shape)}."
        )


def _as_row_major_matrix(xp, x, order, in_shape):
    """Read ``x`` as the row-major matrix ``X`` [..., p', q'] of the C convention.

    Returns the matrix and a function mapping a result [..., p, q] back to ``x``'s layout.
    """
    if x.ndim == 1:
        # Both vec conventions give kron(A, B) @ x for a flat x: vec_c of the [q', p']
        # matrix is the row-major flattening of its transpose.
        return xp.reshape(x, in_shape), lambda y: xp.reshape(y, (-1,))
    if order == "C":
        return x, lambda y: y
    return xp.matrix_transpose(x), xp.matrix_transpose


@capabilities(jit="yes", vmap="yes", dask="yes")
def kron_matvec(a, b, x, order="C"):
    r"""Kronecker matrix–vector product without forming the Kronecker product.

    .. math::

        \begin{aligned}
        (A \otimes B)\,\mathrm{vec}_r(X) &= \mathrm{vec}_r(A X B^\top)
        &&(\texttt{order="C"},\ X \in \mathbb{R}^{p' \times q'}),\\
        (A \otimes B)\,\mathrm{vec}_c(X) &= \mathrm{vec}_c(B X A^\top)
        &&(\texttt{order="F"},\ X \in \mathbb{R}^{q' \times p'}).
        \end{aligned}

    Parameters
    ----------
    a : array [p, p']
    b : array [q, q']
    x : array
        Either a flat vector of length :math:`p' q'` — then the result is
        ``kron(a, b) @ x`` whatever ``order`` is, because ``order`` only says how a vector
        is read as a matrix — or a (batched) matrix ``[..., p', q']`` for ``order="C"``
        / ``[..., q', p']`` for ``order="F"``, in which case the product is returned in the
        same matrix layout (``A X Bᵀ`` resp. ``B X Aᵀ``), batched over leading axes.
    order : {"C", "F"}

    Returns
    -------
    array
        Flat ``[p q]`` or matrix ``[..., p, q]`` (C) / ``[..., q, p]`` (F).

    Examples
    --------
    The flat product equals the dense one in either order; a matrix is read per ``order``:

    >>> import numpy as np
    >>> from kfac_ref import kron, kron_matvec
    >>> a = np.array([[2.0, 1.0], [1.0, 3.0]]); b = np.diag([1.0, 10.0])
    >>> x = np.arange(4.0)
    >>> bool(np.allclose(kron_matvec(a, b, x), kron(a, b) @ x))
    True
    >>> kron_matvec(a, b, x.reshape(2, 2), order="C")   # A X Bᵀ
    array([[  2.,  50.],
           [  6., 100.]])
    """
    func = "kron_matvec"
    xp = namespace_of(func, a=a, b=b, x=x)
    _check_kron_pair(func, a, b)
    check_option(func, "order", order, ("C", "F"))
    _check_kron_vector(func, x, order, (a.shape[1], b.shape[1]))
    return _kron_matvec(xp, a, b, x, order)


@kernel_of(kron_matvec)
def _kron_matvec(xp, a, b, x, order="C"):
    mat, back = _as_row_major_matrix(xp, x, order, (a.shape[1], b.shape[1]))
    return back(a @ mat @ xp.matrix_transpose(b))


@capabilities(jit="yes", dask="yes")
def kron_matmat(a, b, x):
    r"""Kronecker product times a matrix of column vectors, without forming the product.

    .. math::

        (A \otimes B)\, X, \qquad
        \big[(A \otimes B) X\big]_{:, k} = \mathrm{vec}_r\big(A\, X_k\, B^\top\big),

    where :math:`X_k` is column :math:`k` of :math:`X` read row-major as a
    :math:`p' \times q'` matrix.  The batch of columns is one GEMM-shaped contraction.

    Parameters
    ----------
    a : array [p, p']
    b : array [q, q']
    x : array [p' q', k]

    Returns
    -------
    array [p q, k]
    """
    func = "kron_matmat"
    xp = namespace_of(func, a=a, b=b, x=x)
    _check_kron_pair(func, a, b)
    p_in, q_in = a.shape[1], b.shape[1]
    check_array(func, "x", x, ndim=2, shape=(p_in * q_in, None),
                layout=f"[{p_in}·{q_in}, k]")
    return _kron_matmat(xp, a, b, x)


@kernel_of(kron_matmat)
def _kron_matmat(xp, a, b, x):
    p_in, q_in = a.shape[1], b.shape[1]
    k = x.shape[1]
    cols = xp.permute_dims(xp.reshape(x, (p_in, q_in, k)), (2, 0, 1))  # [k, p', q']
    out = a @ cols @ b.T  # [k, p, q]
    return xp.reshape(xp.permute_dims(out, (1, 2, 0)), (a.shape[0] * b.shape[0], k))


@capabilities(dask=DASK_NO_EIGH)
def kron_damped_matpower_matvec(
    a,
    b,
    x,
    power=-1.0,
    damping=0.0,
    damping_method="factored",
    order="C",
    norm_type="avg_diag",
    eigenvalue_clipping_threshold=0.0,
):
    r"""Power of a damped Kronecker product applied to a vector, in two damping styles.

    Factored (π-split) damping, ``damping_method="factored"``:

    .. math::

        \big[(A + \pi\sqrt\lambda I) \otimes (B + \tfrac{\sqrt\lambda}{\pi} I)\big]^{p} x
        = \big[(A + \pi\sqrt\lambda I)^{p} \otimes (B + \tfrac{\sqrt\lambda}{\pi} I)^{p}\big] x ,

    with π from :func:`pi_adjusted_damping` (``norm_type``).  Exact damping,
    ``damping_method="exact"``, through both eigendecompositions
    :math:`A = Q_A \mathrm{diag}(s_A) Q_A^\top`, :math:`B = Q_B \mathrm{diag}(s_B) Q_B^\top`:

    .. math::

        (A \otimes B + \lambda I)^{p}\, \mathrm{vec}_r(X)
        = \mathrm{vec}_r\Big(Q_A \big[(Q_A^\top X Q_B) \odot
          (s_A s_B^\top + \lambda)^{\odot p}\big] Q_B^\top\Big).

    Eigenvalues are clipped below at ``eigenvalue_clipping_threshold`` in both styles.  The
    inverse (``power=-1``) is :func:`kron_damped_inverse_matvec`.

    Parameters
    ----------
    a : array [p, p], symmetric PSD
    b : array [q, q], symmetric PSD
    x : array
        A flat vector of length :math:`pq` or a matrix as in :func:`kron_matvec`.
    power : float
        The power :math:`p` (any real; negative powers need a positive definite result).
    damping : float
        :math:`\lambda \ge 0`.
    damping_method : {"factored", "exact"}
    order : {"C", "F"}
        How ``x`` is read when it is a matrix (see :func:`kron_matvec`).
    norm_type : str
        Factor norm for π (factored damping only), see :func:`factor_norm`.
    eigenvalue_clipping_threshold : float

    References
    ----------
    Martens & Grosse (2015) §6.3 (factored); George et al. (2018) and Grosse et al. (2023)
    (exact damping in the Kronecker eigenbasis).
    """
    return _checked_kron_damped_matpower_matvec(
        "kron_damped_matpower_matvec", a, b, x, power, damping, damping_method, order, norm_type,
        eigenvalue_clipping_threshold,
    )


def _checked_kron_damped_matpower_matvec(func, a, b, x, power, damping, damping_method, order,
                                         norm_type, eigenvalue_clipping_threshold):
    xp = namespace_of(func, a=a, b=b, x=x)
    check_symmetric(func, "a", a)
    check_symmetric(func, "b", b)
    check_option(func, "damping_method", damping_method, _KRON_DAMPING)
    check_option(func, "order", order, ("C", "F"))
    check_option(func, "norm_type", norm_type, FACTOR_NORMS)
    _check_kron_vector(func, x, order, (a.shape[0], b.shape[0]))
    like = {"a": a}
    power = _check_exponent(func, power, like)
    if power != 1.0 or damping_method == "exact":  # factored p = 1 is A + δI, B + δI
        check_namespace_has(func, "a", a, "linalg.eigh", _EIGH_WHY)
    damping = check_scalar(func, "damping", damping, nonnegative=True, like=like)
    c = check_scalar(func, "eigenvalue_clipping_threshold", eigenvalue_clipping_threshold,
                     like=like)
    with errors_named(func):
        return _kron_damped_matpower_matvec(xp, a, b, x, power, damping, damping_method, order,
                                            norm_type, c)


@kernel_of(kron_damped_matpower_matvec)
def _kron_damped_matpower_matvec(xp, a, b, x, power, damping=0.0, damping_method="factored",
                                 order="C", norm_type="avg_diag", threshold=0.0):
    mat, back = _as_row_major_matrix(xp, x, order, (a.shape[0], b.shape[0]))
    if damping_method == "factored":
        powers = kron_factored_powers(xp, a, b, power, damping, 1.0, norm_type, "pi_one",
                                      threshold)
        return back(kron_factored_apply(xp, powers, mat))
    s_a, q_a = _clipped_eigh(xp, a, threshold)
    s_b, q_b = _clipped_eigh(xp, b, threshold)
    return back(_kron_eigenbasis_matpower(xp, s_a, q_a, s_b, q_b, mat, power, damping, 1.0))


@capabilities(dask="yes")
def kron_eigenbasis_matpower(s_a, q_a, s_b, q_b, x, power, damping=0.0, scale=1.0):
    r"""Power of a damped, scaled Kronecker product given the factors' eigendecompositions.

    .. math::

        \big(c\,A \otimes B + \lambda I\big)^{p}\, \mathrm{vec}_r(X)
        = \mathrm{vec}_r\Big(Q_A \big[(Q_A^\top X Q_B) \odot
          (c\, s_A s_B^\top + \lambda)^{\odot p}\big] Q_B^\top\Big),

    with :math:`A = Q_A \mathrm{diag}(s_A) Q_A^\top`, :math:`B = Q_B \mathrm{diag}(s_B)
    Q_B^\top`.  This is the exact-damping product of :func:`kron_damped_matpower_matvec`
    split from the eigendecompositions, so that a caller that caches them (the curvature
    blocks) runs the same arithmetic as one that does not.  ``q_a`` or ``q_b`` may be
    ``None`` for a diagonal factor (its eigenbasis is the identity and ``s`` its diagonal).

    Parameters
    ----------
    s_a : array [p]
    q_a : array [p, p] or None
    s_b : array [q]
    q_b : array [q, q] or None
    x : array [..., p, q]
        Row-major matrix form of the vector(s).
    power, damping, scale : float
        :math:`p`, :math:`\lambda \ge 0`, :math:`c > 0`.
    """
    func = "kron_eigenbasis_matpower"
    xp = namespace_of(func, s_a=s_a, q_a=q_a, s_b=s_b, q_b=q_b, x=x)
    check_array(func, "s_a", s_a, ndim=1)
    check_array(func, "s_b", s_b, ndim=1)
    p, q = s_a.shape[0], s_b.shape[0]
    if q_a is not None:
        check_array(func, "q_a", q_a, shape=(p, p))
    if q_b is not None:
        check_array(func, "q_b", q_b, shape=(q, q))
    check_array(func, "x", x, min_ndim=2)
    if tuple(x.shape[-2:]) != (p, q):
        raise KFACValueError(f"{func}: x must be [..., {p}, {q}]; got shape {tuple(x.shape)}.")
    like = {"s_a": s_a}
    power = _check_exponent(func, power, like)
    damping = check_scalar(func, "damping", damping, nonnegative=True, like=like)
    scale = check_scalar(func, "scale", scale, positive=True, like=like)
    with errors_named(func):
        return _kron_eigenbasis_matpower(xp, s_a, q_a, s_b, q_b, x, power, damping, scale)


@kernel_of(kron_eigenbasis_matpower)
def _kron_eigenbasis_matpower(xp, s_a, q_a, s_b, q_b, x, power, damping=0.0, scale=1.0):
    y = x if q_a is None else xp.matrix_transpose(q_a) @ x
    y = y if q_b is None else y @ q_b
    spectrum = scale * (s_a[:, None] * s_b[None, :]) + damping
    y = y * power_of_eigenvalues(xp, spectrum, power)
    y = y if q_a is None else q_a @ y
    return y if q_b is None else y @ xp.matrix_transpose(q_b)


@capabilities(jit="yes", dask=DASK_NO_EIGH)
def kron_damped_inverse_matvec(
    a, b, x, damping=0.0, damping_method="factored", order="C", norm_type="avg_diag",
    eigenvalue_clipping_threshold=0.0,
):
    r"""Damped Kronecker inverse applied to a vector: :func:`kron_damped_matpower_matvec`
    with ``power = -1``.

    .. math::

        \big[(A + \pi\sqrt\lambda I)^{-1} \otimes (B + \tfrac{\sqrt\lambda}{\pi} I)^{-1}\big] x
        \quad\text{or}\quad (A \otimes B + \lambda I)^{-1} x .
    """
    return _checked_kron_damped_matpower_matvec(
        "kron_damped_inverse_matvec", a, b, x, -1.0, damping, damping_method, order, norm_type,
        eigenvalue_clipping_threshold,
    )


# --------------------------------------------------------------------------------------
# The damped Kronecker kernel (internal API: the one assembly of a factored damped
# Kronecker product, used by the public functions above and by every Kronecker block)
# --------------------------------------------------------------------------------------
PI_NORMS = (*FACTOR_NORMS, "off")
"""Norms accepted for the π damping split: :data:`FACTOR_NORMS` plus ``"off"`` (π = 1,
TF's ``PI_TYPE = "off"``)."""

ZERO_FACTOR_FALLBACKS = ("pi_one", "identity")
"""What factored damping does when a factor has zero norm: ``"pi_one"`` (TF K-FAC: π = 1, the
factors are damped with :math:`\\sqrt\\lambda` each) or ``"identity"`` (kfac-jax's
``special_case_zero_inv``: the damped block is :math:`\\lambda I`)."""


def kron_factor_norms(xp, a, b, norm_type):
    """``(‖A‖, ‖B‖)`` for π and the zero-factor test (``"off"``: the trace norms; for a PSD
    factor every norm of :func:`factor_norm` is zero exactly when the factor is)."""
    kind = "avg_diag" if norm_type == "off" else norm_type
    return _factor_norm(xp, a, kind), _factor_norm(xp, b, kind)


def kron_zero_factor(xp, norms):
    """kfac-jax's zero-factor test ``‖A‖ = 0 or ‖B‖ = 0``: a Python bool decided on the host
    when value checks run on concrete arrays (inside a cache refresh's one read of its
    checks, without a read of its own: :func:`~kfac_ref._backend.rare_branch`), else the
    0-D boolean array (inside a trace, or with value checks off: both branches are
    computed and selected, the same numbers without a read and without the error of a
    singular zero block)."""
    flag = xp.logical_or(norms[0] == 0.0, norms[1] == 0.0)
    return rare_branch(xp, flag) if checks_values(flag) else flag


def kron_factor_dampings(xp, a, b, damping, norm_type="avg_diag", *, norms=None,
                         nonzero=False):
    r"""The π split :math:`(\delta_A, \delta_B) = (\pi\sqrt\lambda, \sqrt\lambda/\pi)` of
    :math:`\lambda`, with π = 1 for ``norm_type="off"``; ``nonzero``: both factor norms
    are known to be non-zero."""
    if norm_type == "off":
        return damping**0.5, damping**0.5
    return _pi_adjusted_damping(xp, a, b, damping, norm_type, norms=norms, nonzero=nonzero)


def kron_factored_powers(xp, a, b, power, damping, scale=1.0, norm_type="avg_diag",
                         zero_factor_fallback="pi_one", threshold=0.0, *, second_moment=False,
                         norms=None, zero=None):
    r"""The factor powers of a π-damped, scaled Kronecker product (the statistics-only half;
    :func:`kron_factored_apply` is the vector half).

    .. math::

        \big(s\,(A + \delta_A I) \otimes (B + \delta_B I)\big)^{p}
        = s^{p}\,(A + \delta_A I)^{p} \otimes (B + \delta_B I)^{p},
        \qquad (\delta_A, \delta_B) = (\pi\sqrt{\lambda/s},\ \sqrt{\lambda/s}/\pi).

    Returns ``(a_pow, b_pow, coeff)`` with :math:`c = s^p`; for kfac-jax's zero-factor case
    (``zero_factor_fallback="identity"`` and a zero factor) ``a_pow = b_pow = None`` and the
    product is :math:`\lambda^p I`; for lazy arrays under that fall-back also the
    zero-factor flag and :math:`\lambda^p` (selected per call by the apply half).  A 1-D
    factor is the diagonal of a diagonal factor.  Each damped factor's power is one
    :func:`damped_matpower` kernel call (``second_moment``: the factors are second moments,
    so an inverse is one Cholesky inverse).  ``norms`` / ``zero``: :func:`kron_factor_norms`
    and :func:`kron_zero_factor`, when a caller caching several powers has them.  Unchecked;
    errors are :func:`~kfac_ref._backend.kernel_error` s.
    """
    lam = damping / scale
    if norms is None and (zero_factor_fallback == "identity" or norm_type != "off"):
        norms = kron_factor_norms(xp, a, b, norm_type)
    if zero_factor_fallback != "identity":
        zero = None
    elif zero is None:
        # inside a trace the flag is lazy even for factors the traced function closes over
        zero = kron_zero_factor(xp, norms)
    nonzero = isinstance(zero, bool)
    if nonzero:  # eager: decided on the host, as kfac-jax's Python branch does
        if zero:
            # kfac-jax: every damped factor is (λ/s)^(1/2) I, so the damped block is λ I.
            if power < 0 and damping == 0.0:
                raise kernel_error(
                    f"a Kronecker factor is zero and damping is 0, so the block is singular "
                    f"for the power {power}. Add damping.")
            return None, None, damping**power
        zero = None  # both norms non-zero: π needs no guard
    delta_a, delta_b = kron_factor_dampings(xp, a, b, lam, norm_type, norms=norms,
                                            nonzero=nonzero)
    try:
        # written out per factor (no helper) so that an inverse reaches the Cholesky call in
        # two frames: damped_matpower's kernel, then damped_cholesky's
        if a.ndim == 1:
            a_pow = power_of_eigenvalues(xp, xp.clip(a, min=threshold) + delta_a, power)
        else:
            a_pow = _damped_matpower(xp, a, power, delta_a, threshold,
                                     second_moment=second_moment)
        if b.ndim == 1:
            b_pow = power_of_eigenvalues(xp, xp.clip(b, min=threshold) + delta_b, power)
        else:
            b_pow = _damped_matpower(xp, b, power, delta_b, threshold,
                                     second_moment=second_moment)
    except KFACValueError as exc:
        raise kernel_error(f"a damped Kronecker factor is singular for the power {power} "
                           f"({exc}). Add damping.") from None
    if zero is not None:  # traced: both branches, selected per call (jnp.where semantics)
        return a_pow, b_pow, scale**power, zero, damping**power
    return a_pow, b_pow, scale**power


def kron_factored_apply(xp, powers, x):
    r""":math:`c\,A_p X B_p` (row-major :math:`X` ``[..., p, q]``; a symmetric :math:`B_p`
    needs no transpose) from :func:`kron_factored_powers`; :math:`c X` for the zero-factor
    identity; :math:`A_p X B_p` when :math:`c` is None (folded into a factor by
    :func:`kron_factored_fold`)."""
    a_pow, b_pow, coeff = powers[:3]
    if a_pow is None:
        return coeff * x
    left = a_pow[:, None] * x if a_pow.ndim == 1 else a_pow @ x
    prod = left * b_pow[None, :] if b_pow.ndim == 1 else left @ b_pow
    if len(powers) == 5:  # traced zero-factor test: the identity block where it holds
        zero, identity_coeff = powers[3:]
        return xp.where(zero, identity_coeff * x, coeff * prod)
    return prod if coeff is None else coeff * prod


def kron_factored_fold(xp, powers, a, b):
    r"""``(c A_p, B_p, None)`` or ``(A_p, c B_p, None)`` from :func:`kron_factored_powers`'
    ``(A_p, B_p, c)`` of the factors ``a``, ``b``: the coefficient multiplied into the factor
    power with fewer entries.

    .. math:: c\,A_p X B_p = (c A_p)\, X B_p \quad\text{or}\quad A_p X\, (c B_p)

    For powers that are cached: each product then skips a pass over :math:`X`, and every
    form has the same structure (two arrays and ``None``), so that a state cached eagerly
    and one cached inside ``jax.jit`` are the same pytree.  The zero-factor identity
    :math:`\lambda^p I` becomes :math:`(\lambda^p I, I)`, and the lazy zero-factor form
    selects between both per entry of the factor powers, once, instead of per product:

    .. math:: (A', B') = \begin{cases} (\lambda^p I,\ I) & \text{a zero factor} \\
              (c A_p,\ B_p) & \text{otherwise} \end{cases}

    (``I`` a vector of ones for a diagonal factor given as its diagonal).
    """
    a_pow, b_pow, coeff = powers[:3]
    a_first = math.prod(a.shape) <= math.prod(b.shape)  # the factor the coefficient goes to
    if a_pow is None:
        identity = coeff  # λ^p: the damped block is λ I
        a_pow, b_pow = _identity_like(xp, a), _identity_like(xp, b)
        return (identity * a_pow, b_pow, None) if a_first else (a_pow, identity * b_pow, None)
    folded = (coeff * a_pow, b_pow) if a_first else (a_pow, coeff * b_pow)
    if len(powers) == 5:  # traced zero-factor test: both forms, selected once here
        zero, identity = powers[3:]
        ones = (identity * _identity_like(xp, a), _identity_like(xp, b)) if a_first else (
            _identity_like(xp, a), identity * _identity_like(xp, b))
        folded = tuple(xp.where(zero, i, f) for i, f in zip(ones, folded, strict=True))
    return (*folded, None)


def _identity_like(xp, factor):
    """The identity of a factor's shape: ``I`` for a matrix, ones for a diagonal."""
    return xp.ones_like(factor) if factor.ndim == 1 else eye_like(factor, factor.shape[0])


def kron_factored_cholesky_apply(xp, a, b, x, delta_a, delta_b, scale, *, transpose=False,
                                 inverse=False):
    r"""Cholesky products of a factored-damped Kronecker product on ``X`` ``[p, q]``.

    .. math::

        L = s^{1/2}\, L_A \otimes L_B, \quad L_A L_A^\top = A + \delta_A I, \quad
        L_B L_B^\top = B + \delta_B I;

        L\,\mathrm{vec}_r X = s^{1/2}\mathrm{vec}_r(L_A X L_B^\top), \quad
        L^\top\mathrm{vec}_r X = s^{1/2}\mathrm{vec}_r(L_A^\top X L_B), \quad
        L^{-1}\mathrm{vec}_r X = s^{-1/2}\mathrm{vec}_r(L_A^{-1} X L_B^{-\top}), \quad
        L^{-\top}\mathrm{vec}_r X = s^{-1/2}\mathrm{vec}_r(L_A^{-\top} X L_B^{-1})

    (TF ``KroneckerProductFB.multiply_cholesky`` / ``multiply_cholesky_inverse``).  A
    diagonal (1-D) factor's triangle is :math:`(f + \delta)^{\odot \pm 1/2}`.
    """
    half = -0.5 if inverse else 0.5
    triangle = _damped_cholesky_inverse if inverse else _damped_cholesky
    l_a = (power_of_eigenvalues(xp, a + delta_a, half) if a.ndim == 1
           else triangle(xp, a, delta_a))
    l_b = (power_of_eigenvalues(xp, b + delta_b, half) if b.ndim == 1
           else triangle(xp, b, delta_b))
    if l_a.ndim == 1:
        left = l_a[:, None] * x
    else:
        left = (xp.matrix_transpose(l_a) if transpose else l_a) @ x
    if l_b.ndim == 1:
        prod = left * l_b[None, :]
    else:
        prod = left @ (l_b if transpose else xp.matrix_transpose(l_b))
    return (scale ** half) * prod


def kron_eigen(xp, a, b, threshold=0.0):
    """``(s_A, Q_A, s_B, Q_B)``: both factors' clipped eigendecompositions (a diagonal
    factor is its own eigenbasis, ``Q = None``)."""
    if a.ndim == 1:
        s_a, q_a = xp.clip(a, min=threshold), None
    else:
        s_a, q_a = _clipped_eigh(xp, a, threshold)
    if b.ndim == 1:
        s_b, q_b = xp.clip(b, min=threshold), None
    else:
        s_b, q_b = _clipped_eigh(xp, b, threshold)
    return s_a, q_a, s_b, q_b
