r"""Spectral quantities of curvature: traces, log-determinants and eigenvalues.

Exact identities for Kronecker-factored blocks (Martens & Grosse 2015, §6.3; the identities
laplace-torch's ``KronDecomposed`` and curvlinops' K-FAC operator use), with
:math:`A = Q_A\operatorname{diag}(a)Q_A^\top` (:math:`d_A \times d_A`) and
:math:`G = Q_G\operatorname{diag}(\gamma)Q_G^\top` (:math:`d_G \times d_G`):

.. math::

    \begin{aligned}
    \operatorname{tr}(A\otimes G) &= \operatorname{tr}A\,\operatorname{tr}G,\\
    \log\det(A\otimes G) &= d_G\log\det A + d_A\log\det G,\\
    \operatorname{spec}(A\otimes G) &= \{a_i\gamma_j\},
    \end{aligned}

for the exactly damped block :math:`sA\otimes G + \lambda I` (eigenvalues
:math:`s a_i\gamma_j + \lambda`) and the factored, π-damped block
:math:`s(A + \delta_A I)\otimes(G + \delta_G I)` (eigenvalues
:math:`s(a_i + \delta_A)(\gamma_j + \delta_G)`, :math:`\delta_A = \pi\sqrt{\lambda/s}`,
:math:`\delta_G = \sqrt{\lambda/s}/\pi`): :func:`kron_eigenvalues`, :func:`kron_trace`,
:func:`kron_slogdet`.

Stochastic trace estimators for matrix-free operators, on explicit probe arrays:
Hutchinson's (:func:`hutchinson_trace`) and Hutch++ (Meyer et al. 2021,
:func:`hutchpp_trace`).  :class:`kfac_ref.operators.CurvatureOperator` applies all of these
to a block, the block-diagonal estimator or the exact curvature, drawing the Rademacher
probes from an explicit ``numpy.random.Generator``.

Every quantity is returned as a 0-D array (eigenvalues as a 1-D array) in the namespace,
device and dtype of the inputs.
"""

from __future__ import annotations

import math

from ._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_bool,
    check_namespace_has,
    check_option,
    check_scalar,
    check_symmetric,
    describe,
    is_array,
    kernel_of,
    namespace_of,
)
from ._support import DASK_NO_EIGH, capabilities
from .blocks import PI_NORMS, ZERO_FACTOR_FALLBACKS
from .linalg import clipped_eigh, kron_factor_dampings, kron_factor_norms

__all__ = [
    "kron_eigenvalues",
    "kron_trace",
    "kron_slogdet",
    "hutchinson_trace",
    "hutchpp_trace",
]


# --------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------
def _check_factor(func, name, f, eigenvalues):
    check_array(func, name, f, ndim=(1, 2), layout="[n, n] or diagonal [n]")
    if f.ndim == 2:
        check_symmetric(func, name, f)
        if eigenvalues:
            check_namespace_has(func, name, f, "linalg.eigh", "the factor's eigenvalues")
    return f


def _check_kron_args(func, a, g, damping, scale, exact, norm_type, zero_factor_fallback,
                     threshold, *, eigenvalues=True):
    """The validated arguments, in the order the ``kron_*_kernel`` functions take them."""
    xp = namespace_of(func, a=a, g=g)
    _check_factor(func, "a", a, eigenvalues)
    _check_factor(func, "g", g, eigenvalues)
    like = {"a": a}
    damping = check_scalar(func, "damping", damping, nonnegative=True, like=like)
    scale = check_scalar(func, "scale", scale, positive=True, like=like)
    exact = check_bool(func, "exact", exact)
    check_option(func, "norm_type", norm_type, PI_NORMS)
    check_option(func, "zero_factor_fallback", zero_factor_fallback, ZERO_FACTOR_FALLBACKS)
    if norm_type == "2_norm" and not exact:
        for name, f in (("a", a), ("g", g)):
            if f.ndim == 2:
                check_namespace_has(func, name, f, "linalg.eigvalsh",
                                    "the largest eigenvalue of the 2_norm of the π split")
    threshold = check_scalar(func, "eigenvalue_clipping_threshold", threshold, like=like)
    return xp, a, g, damping, scale, exact, norm_type, zero_factor_fallback, threshold


# --------------------------------------------------------------------------------------
# helpers of the kernels (internal API, shared with kfac_ref.operators)
# --------------------------------------------------------------------------------------
def factor_eigenvalues(xp, f, threshold):
    """Clipped eigenvalues of one factor (a 1-D factor is a diagonal).  Internal API."""
    if f.ndim == 1:
        return xp.clip(f, min=threshold)
    return clipped_eigh.kernel(xp, f, threshold)[0]


def _factor_trace(xp, f):
    return xp.sum(f) if f.ndim == 1 else xp.sum(xp.linalg.diagonal(f))


def factored_split(xp, a, g, damping, scale, norm_type, zero_factor_fallback):
    r"""``(δ_A, δ_G, identity)`` of the factored block :math:`s(A+\delta_A I)\otimes
    (G+\delta_G I)`: the π split of :math:`\lambda/s` (π = 1 for ``norm_type="off"``), and
    ``identity`` (a 0-D bool array, or ``False``) where kfac-jax's zero-factor fall-back makes
    the damped block :math:`\lambda I`.  The same rule as the blocks' factored products
    (:func:`kfac_ref.blocks.kronecker_block_matpower`): the damped Kronecker kernel's split
    (``kfac_ref.linalg.kron_factor_dampings``).  Internal API."""
    norms = kron_factor_norms(xp, a, g, norm_type)
    delta_a, delta_g = kron_factor_dampings(xp, a, g, damping / scale, norm_type, norms=norms)
    identity = False
    if zero_factor_fallback == "identity":
        identity = xp.logical_or(norms[0] == 0.0, norms[1] == 0.0)
    return delta_a, delta_g, identity


def slogdet_of_eigenvalues(xp, ev):
    r"""``(sign, log|det|)`` of a matrix from its eigenvalues:
    :math:`(\prod_i \operatorname{sign}\mu_i,\ \sum_i \log|\mu_i|)`, ``-inf`` when one is
    zero.  Internal API."""
    sign = xp.prod(xp.sign(ev))
    nonzero = ev != 0
    logs = xp.log(xp.where(nonzero, xp.abs(ev), xp.ones_like(ev)))
    logabs = xp.sum(logs)
    return sign, xp.where(sign == 0, -xp.ones_like(logabs) * math.inf, logabs)


def _select(xp, identity, if_identity, otherwise):
    if identity is False:
        return otherwise
    return xp.where(identity, if_identity, otherwise)


# --------------------------------------------------------------------------------------
# public formula functions: Kronecker blocks
# --------------------------------------------------------------------------------------
@capabilities(dask=DASK_NO_EIGH)
def kron_eigenvalues(a, g, damping=0.0, *, scale=1.0, exact=True, norm_type="avg_diag",
                     zero_factor_fallback="pi_one", eigenvalue_clipping_threshold=0.0):
    r"""Eigenvalues of a damped Kronecker-factored block, from the factors' eigenvalues.

    .. math::

        \text{exact: } \{ s\,a_i\gamma_j + \lambda \}, \qquad
        \text{factored: } \{ s\,(a_i + \delta_A)(\gamma_j + \delta_G) \},

    with :math:`a, \gamma` the clipped eigenvalues of :math:`A, G` (ascending), returned in
    the order :math:`\mathrm{vec}_r` of the :math:`[p, q]` array (:math:`i` major), as
    :func:`kfac_ref.blocks.kronecker_block_eigenvalues`.  kfac-jax's zero-factor fall-back
    (``"identity"``) gives :math:`\lambda` everywhere.

    Parameters
    ----------
    a : array [p, p] or [p]
        Input-side factor :math:`A` (symmetric PSD; a 1-D array is a diagonal factor).
    g : array [q, q] or [q]
        Output-side factor :math:`G`.
    damping : float
        :math:`\lambda \ge 0`.
    scale : float
        :math:`s > 0` (:math:`|T|` for KFC).
    exact : bool
        Exact damping :math:`sA\otimes G + \lambda I` (default) or factored π damping
        :math:`s(A + \delta_A I)\otimes(G + \delta_G I)`, :math:`\delta_A = \pi\sqrt{\lambda/s}`,
        :math:`\delta_G = \sqrt{\lambda/s}/\pi`, as
        :func:`kfac_ref.blocks.kronecker_block_matpower`.
    norm_type : {"avg_diag", "avg_fro", "2_norm", "1_norm", "off"}
        Norm for π (factored damping only; ``"off"``: π = 1).
    zero_factor_fallback : {"pi_one", "identity"}
        Factored damping when a factor is zero: TF's π = 1 or kfac-jax's :math:`\lambda I`.
    eigenvalue_clipping_threshold : float
        The factors' eigenvalues are clipped below at this value (:func:`kfac_ref.clipped_eigh`).

    Returns
    -------
    array [p q]
    """
    args = _check_kron_args("kron_eigenvalues", a, g, damping, scale, exact, norm_type,
                            zero_factor_fallback, eigenvalue_clipping_threshold)
    return _kron_eigenvalues(*args)


@kernel_of(kron_eigenvalues)
def _kron_eigenvalues(xp, a, g, damping, scale, exact, norm_type, zero_factor_fallback,
                      threshold):
    """Unchecked kernel of :func:`kron_eigenvalues`."""
    ea = factor_eigenvalues(xp, a, threshold)
    eg = factor_eigenvalues(xp, g, threshold)
    if exact:
        return xp.reshape(scale * (ea[:, None] * eg[None, :]) + damping, (-1,))
    da, dg, identity = factored_split(xp, a, g, damping, scale, norm_type,
                                      zero_factor_fallback)
    ev = xp.reshape(scale * ((ea + da)[:, None] * (eg + dg)[None, :]), (-1,))
    return _select(xp, identity, ev * 0.0 + damping, ev)


@capabilities(dask="yes")
def kron_trace(a, g, damping=0.0, *, scale=1.0, exact=True, norm_type="avg_diag",
               zero_factor_fallback="pi_one"):
    r"""Trace of a damped Kronecker-factored block, from the factors' traces.

    .. math::

        \operatorname{tr}(sA\otimes G + \lambda I) = s\operatorname{tr}A\operatorname{tr}G
        + \lambda\,pq, \qquad
        \operatorname{tr}\big(s(A+\delta_A I)\otimes(G+\delta_G I)\big)
        = s\,(\operatorname{tr}A + p\,\delta_A)(\operatorname{tr}G + q\,\delta_G)

    (:math:`\lambda pq` under kfac-jax's zero-factor fall-back).  No eigendecomposition, no
    clipping: the trace of the matrix the blocks' power-one products apply.

    Parameters
    ----------
    a, g, damping, scale, exact, norm_type, zero_factor_fallback
        As :func:`kron_eigenvalues`.

    Returns
    -------
    array []
    """
    *args, _ = _check_kron_args("kron_trace", a, g, damping, scale, exact, norm_type,
                                zero_factor_fallback, 0.0, eigenvalues=False)
    return _kron_trace(*args)  # no clipping threshold: no eigenvalues


@kernel_of(kron_trace)
def _kron_trace(xp, a, g, damping, scale, exact, norm_type, zero_factor_fallback):
    """Unchecked kernel of :func:`kron_trace`."""
    p, q = a.shape[0], g.shape[0]
    tr_a, tr_g = _factor_trace(xp, a), _factor_trace(xp, g)
    if exact:
        return scale * tr_a * tr_g + damping * (p * q)
    da, dg, identity = factored_split(xp, a, g, damping, scale, norm_type,
                                      zero_factor_fallback)
    tr = scale * (tr_a + p * da) * (tr_g + q * dg)
    return _select(xp, identity, tr * 0.0 + damping * (p * q), tr)


@capabilities(dask=DASK_NO_EIGH)
def kron_slogdet(a, g, damping=0.0, *, scale=1.0, exact=True, norm_type="avg_diag",
                 zero_factor_fallback="pi_one", eigenvalue_clipping_threshold=0.0):
    r"""Sign and log-absolute-determinant of a damped Kronecker-factored block.

    .. math::

        \log\det\big(s(A+\delta_A I)\otimes(G+\delta_G I)\big)
        = pq\log s + q\log\det(A+\delta_A I) + p\log\det(G+\delta_G I),

    the factored case and the undamped exact case (:math:`\delta = 0`) from the factors'
    eigenvalues alone (:math:`O(p + q)` logarithms); the exactly damped block from its
    eigenvalues, :math:`\sum_{ij}\log(s\,a_i\gamma_j + \lambda)`.  The sign is
    :math:`\operatorname{sign}(\det A')^{q}\operatorname{sign}(\det G')^{p}` (0 with
    :math:`\log|\det| = -\infty` for a singular block), as :func:`numpy.linalg.slogdet`;
    :math:`\det = \text{sign}\cdot e^{\log|\det|}` and :math:`\log\det = \log|\det|` for the
    positive definite blocks of K-FAC.

    Parameters
    ----------
    a, g, damping, scale, exact, norm_type, zero_factor_fallback, eigenvalue_clipping_threshold
        As :func:`kron_eigenvalues`.

    Returns
    -------
    (sign, logabsdet) : (array [], array [])
    """
    args = _check_kron_args("kron_slogdet", a, g, damping, scale, exact, norm_type,
                            zero_factor_fallback, eigenvalue_clipping_threshold)
    return _kron_slogdet(*args)


@kernel_of(kron_slogdet)
def _kron_slogdet(xp, a, g, damping, scale, exact, norm_type, zero_factor_fallback,
                  threshold):
    """Unchecked kernel of :func:`kron_slogdet`: from the factors' eigenvalues, except for
    the exactly damped block (from its own eigenvalues)."""
    p, q = a.shape[0], g.shape[0]
    undamped = isinstance(damping, (int, float)) and damping == 0.0
    if exact and not undamped:
        return slogdet_of_eigenvalues(xp, _kron_eigenvalues(
            xp, a, g, damping, scale, True, norm_type, zero_factor_fallback, threshold))
    ea = factor_eigenvalues(xp, a, threshold)
    eg = factor_eigenvalues(xp, g, threshold)
    identity = False
    if not exact:
        da, dg, identity = factored_split(xp, a, g, damping, scale, norm_type,
                                          zero_factor_fallback)
        ea, eg = ea + da, eg + dg
    sign_a, log_a = slogdet_of_eigenvalues(xp, ea)
    sign_g, log_g = slogdet_of_eigenvalues(xp, eg)
    sign = sign_a**q * sign_g**p
    logabs = (p * q) * math.log(scale) + q * log_a + p * log_g
    if identity is False:
        return sign, logabs
    lam = log_a * 0.0 + damping
    sign_i, log_i = slogdet_of_eigenvalues(xp, xp.reshape(lam, (1,)))
    return (xp.where(identity, sign_i**(p * q), sign),
            xp.where(identity, (p * q) * log_i, logabs))


# --------------------------------------------------------------------------------------
# stochastic trace estimators
# --------------------------------------------------------------------------------------
def _check_probes(func, name, z, dim=None):
    check_array(func, name, z, ndim=2, layout="[d, m] (one probe vector per column)")
    if z.shape[1] < 1 or (dim is not None and z.shape[0] != dim):
        want = f"[{dim}, m]" if dim is not None else "[d, m]"
        raise KFACValueError(f"{func}: {name} must have shape {want} with m >= 1 columns; got "
                             f"shape {tuple(z.shape)}.")
    return z


def _checked_matmat(func, matmat):
    """``matmat`` with each result checked as an argument: an array of its input's shape,
    namespace, device and precision, finite (a value check).  The kernels take it as any
    other ``matmat``."""
    if not callable(matmat):
        raise KFACTypeError(f"{func}: matmat must be a callable X [d, k] -> M X [d, k]; got "
                            f"{describe(matmat)}.")

    def checked(x):
        y = matmat(x)
        if not is_array(y) or tuple(y.shape) != tuple(x.shape):
            raise KFACValueError(f"{func}: matmat must return an array of the shape of its "
                                 f"input {tuple(x.shape)}; got {describe(y)}.")
        namespace_of(func, **{"matmat's input": x, "matmat's result": y})
        check_array(func, "matmat's result", y)
        return y

    return checked


@capabilities(dask="yes")
def hutchinson_trace(matmat, probes):
    r"""Hutchinson's trace estimate of a matrix-free operator :math:`M` (``d × d``).

    .. math::

        \widehat{\operatorname{tr}}(M) = \frac1m\sum_{k=1}^{m} z_k^\top M z_k
        = \frac1m \operatorname{sum}\big(Z \odot MZ\big), \qquad
        \mathbb E\,\widehat{\operatorname{tr}} = \operatorname{tr}M, \qquad
        \operatorname{Var}\widehat{\operatorname{tr}} = \frac2m\Big(\|M\|_F^2 -
        \sum_i M_{ii}^2\Big)

    for Rademacher probes :math:`z_k` (independent :math:`\pm1` entries; the variance is
    that of a symmetric :math:`M`).  Averaged over all :math:`2^d` sign vectors the estimate
    is exact.  Hutchinson (1990); curvlinops' ``HutchinsonTraceEstimator``.

    Parameters
    ----------
    matmat : callable
        ``X [d, k] -> M X [d, k]`` (e.g. :meth:`kfac_ref.operators.CurvatureOperator.matmat`).
    probes : array [d, m]
        The probe vectors :math:`Z` as columns (draw them with an explicit
        ``numpy.random.Generator``, as
        :meth:`kfac_ref.operators.CurvatureOperator.hutchinson_trace` does).

    Returns
    -------
    array []
    """
    func = "hutchinson_trace"
    xp = namespace_of(func, probes=probes)
    checked = _checked_matmat(func, matmat)
    _check_probes(func, "probes", probes)
    return _hutchinson_trace(xp, checked, probes)


@kernel_of(hutchinson_trace)
def _hutchinson_trace(xp, matmat, probes):
    """Unchecked kernel of :func:`hutchinson_trace`."""
    return xp.sum(probes * matmat(probes)) / probes.shape[1]


@capabilities(dask="yes")
def hutchpp_trace(matmat, sketch, probes):
    r"""Hutch++ trace estimate (Meyer, Musco, Musco & Woodruff 2021, Algorithm 1).

    .. math::

        \widehat{\operatorname{tr}}(M) = \operatorname{tr}(Q^\top M Q)
        + \frac1m\operatorname{tr}\big(G^\top (I - QQ^\top) M (I - QQ^\top) G\big),
        \qquad Q = \operatorname{qr}(M S),

    with :math:`S` (``[d, k]``) the sketch and :math:`G` (``[d, m]``) the Hutchinson probes
    (Rademacher): :math:`2k + m` products with :math:`M`.  The first term is the trace of
    :math:`M` on the range of :math:`MS`, exact; the second is Hutchinson's estimate of the
    rest, unbiased given :math:`S`, with variance
    :math:`\frac2m(\|PMP\|_F^2 - \sum_i (PMP)_{ii}^2)`, :math:`P = I - QQ^\top`.  When
    :math:`\operatorname{rank} M \le k` (and :math:`S` is generic) :math:`PMP = 0` and the
    estimate is exact.  Meyer et al. take :math:`k = m = \text{budget}/3`.

    Parameters
    ----------
    matmat : callable
        ``X [d, k] -> M X [d, k]`` for a symmetric :math:`M`.
    sketch : array [d, k]
        :math:`S`.
    probes : array [d, m]
        :math:`G`.

    Returns
    -------
    array []
    """
    func = "hutchpp_trace"
    xp = namespace_of(func, sketch=sketch, probes=probes)
    checked = _checked_matmat(func, matmat)
    _check_probes(func, "sketch", sketch)
    _check_probes(func, "probes", probes, dim=sketch.shape[0])
    if sketch.shape[1] > sketch.shape[0]:
        raise KFACValueError(f"{func}: sketch must have at most d = {sketch.shape[0]} columns "
                             f"(a QR basis of its range); got {sketch.shape[1]}.")
    return _hutchpp_trace(xp, checked, sketch, probes)


@kernel_of(hutchpp_trace)
def _hutchpp_trace(xp, matmat, sketch, probes):
    """Unchecked kernel of :func:`hutchpp_trace`."""
    q, _ = xp.linalg.qr(matmat(sketch))
    low_rank = xp.sum(q * matmat(q))
    residual = probes - q @ (xp.matrix_transpose(q) @ probes)
    projected = matmat(residual)
    projected = projected - q @ (xp.matrix_transpose(q) @ projected)
    return low_rank + xp.sum(residual * projected) / probes.shape[1]
