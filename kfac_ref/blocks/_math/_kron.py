"""Kronecker-factored block products (exact eigenbasis and factored π damping paths)."""

from __future__ import annotations

from ..._backend import (
    check_array,
    check_namespace_has,
    check_option,
    check_scalar,
    errors_named,
    namespace_of,
)
from ..._support import DASK_NO_EIGH, capabilities
from ...linalg import (
    PI_NORMS,
    ZERO_FACTOR_FALLBACKS,
    kron_eigen,
    kron_eigenbasis_matpower,
    kron_factored_apply,
    kron_factored_powers,
)
from ._common import check_common, check_factor


# --------------------------------------------------------------------------------------
# Kronecker-factored blocks: the path choice and the direct (power 1) product; the
# factored and eigenbasis products are kfac_ref.linalg's damped Kronecker kernel
# --------------------------------------------------------------------------------------
def apply_kron_direct(xp, a, g, x, damping, scale):
    """``(s·A⊗G + λI) vec_r(X) = vec_r(s·A X Gᵀ + λX)`` (power 1, no eigendecomposition)."""
    left = a[:, None] * x if a.ndim == 1 else a @ x
    prod = left * g[None, :] if g.ndim == 1 else left @ xp.matrix_transpose(g)
    return scale * prod + damping * x


KRON_PATHS = ("direct", "eigen", "factored")
"""The three ways a Kronecker product is computed (see :func:`kron_product_path`)."""


def kron_product_path(power, exact, approx_power_one="factored"):
    r"""Which computation a Kronecker product :math:`(sA\otimes G + \lambda I)^p` takes.

    .. math::

        \begin{aligned}
        \text{direct}: &\quad p = 1 \text{ and (exact or power-one exact)}:
            \ s A X G^\top + \lambda X,\\
        \text{eigen}: &\quad \text{exact otherwise (both eigendecompositions)},\\
        \text{factored}: &\quad \text{approximate otherwise (π-damped factor powers)}.
        \end{aligned}

    The one place the path is chosen: :func:`kronecker_block_matpower` and the Kronecker
    blocks (cached or not) all call it.
    """
    if power == 1.0 and (exact or approx_power_one == "exact"):
        return "direct"
    return "eigen" if exact else "factored"


def prepare_kron(path, xp, a, g, power, damping, scale, norm_type, zero_factor_fallback,
                 threshold, norms=None, zero=None):
    """The statistics-only part of a Kronecker product on ``path`` (None for "direct"):
    :func:`kfac_ref.linalg.kron_eigen` or :func:`kfac_ref.linalg.kron_factored_powers` (the
    factors are second moments); ``norms`` and ``zero`` as there."""
    if path == "direct":
        return None
    if path == "eigen":
        return kron_eigen(xp, a, g, threshold)
    return kron_factored_powers(xp, a, g, power, damping, scale, norm_type,
                                zero_factor_fallback, threshold, second_moment=True,
                                norms=norms, zero=zero)


def check_kron_linalg(func, path, a, g, power, threshold, norm_type):
    """Reject, before computing, factors whose namespace lacks the eigendecomposition that
    ``path`` would take: the eigen path, and a factored power other than 1 and other than
    the Cholesky inverse of a second moment (:math:`p = -1`, no clipping); ``"2_norm"`` π
    takes the largest eigenvalue."""
    cholesky_only = power == 1.0 or (power == -1.0 and threshold <= 0.0)
    for name, f in (("a", a), ("g", g)):
        if f.ndim != 2:
            continue
        if path == "eigen" or (path == "factored" and not cholesky_only):
            check_namespace_has(func, name, f, "linalg.eigh", "an eigendecomposition")
        if path == "factored" and norm_type == "2_norm":
            check_namespace_has(func, name, f, "linalg.eigvalsh",
                                "the largest eigenvalue of the 2_norm of the π split")


def apply_kron(path, xp, a, g, prepared, x, power, damping, scale):
    """The vector part of a Kronecker product on ``path`` (``prepared`` from
    :func:`prepare_kron`, computed now or read from a cache)."""
    if path == "direct":
        return apply_kron_direct(xp, a, g, x, damping, scale)
    if path == "eigen":
        s_a, q_a, s_g, q_g = prepared
        return kron_eigenbasis_matpower.kernel(xp, s_a, q_a, s_g, q_g, x, power, damping, scale)
    return kron_factored_apply(xp, prepared, x)


def _check_kron_inputs(func, a, g, x):
    xp = namespace_of(func, a=a, g=g, x=x)
    check_factor(func, "a", a)
    check_factor(func, "g", g)
    p, q = a.shape[0], g.shape[0]
    check_array(func, "x", x, ndim=2, shape=(p, q), layout=f"[{p}, {q}] (row-major [W; b])")
    return xp


@capabilities(dask="yes")
def kronecker_block_matpower(a, g, x, power, damping=0.0, *, scale=1.0, exact=False,
                             norm_type="avg_diag", zero_factor_fallback="pi_one",
                             eigenvalue_clipping_threshold=0.0):
    r"""Power of a damped, scaled Kronecker-factored block times a parameter matrix.

    The block is :math:`B = s\,(A \otimes G)` on :math:`\mathrm{vec}_r(X)`, ``X`` of shape
    ``[p, q]``.  Exact power (``exact=True``), through both eigendecompositions
    :math:`A = Q_A \mathrm{diag}(a) Q_A^\top`, :math:`G = Q_G \mathrm{diag}(\gamma) Q_G^\top`:

    .. math::

        (B + \lambda I)^{p}\,\mathrm{vec}_r(X) = \mathrm{vec}_r\!\Big(Q_A\big[(Q_A^\top X Q_G)
        \odot (s\,a\gamma^\top + \lambda)^{\odot p}\big] Q_G^\top\Big),

    (for :math:`p = 1` computed directly as :math:`s A X G^\top + \lambda X`).  Approximate
    power (``exact=False``), factored Tikhonov damping with the π split of :math:`\lambda/s`:

    .. math::

        \begin{aligned}
        \big(s\,(A + \pi\sqrt{\lambda/s}\,I) \otimes (G + \tfrac{1}{\pi}\sqrt{\lambda/s}\,I)
        \big)^{p}\,\mathrm{vec}_r(X)
        &= s^{p}\,\mathrm{vec}_r\big((A + \delta_A I)^{p}\, X\, (G + \delta_G I)^{p}\big),\\
        \pi &= \sqrt{\|A\| / \|G\|}.
        \end{aligned}

    For :math:`s = |T|` this is TF's ``ConvKFCBasicFB`` and kfac-jax's
    ``Conv2DTwoKroneckerFactored`` (damping :math:`\lambda/|T|` reaches the factors).

    Parameters
    ----------
    a : array [p, p] or [p]
        Input-side factor (a 1-D array is a diagonal factor, e.g. the embedding input factor).
    g : array [q, q] or [q]
        Output-side factor.
    x : array [p, q]
        The parameter-shaped vector (bias row last for dense layers).
    power : float
        Any real power (negative powers need a positive definite damped block).
    damping : float
        :math:`\lambda \ge 0`, the weight of the identity added to :math:`B`.
    scale : float
        :math:`s > 0`.
    exact : bool
        Exact damping (eigendecompositions) or factored π damping.
    norm_type : {"avg_diag", "avg_fro", "2_norm", "1_norm", "off"}
        Norm for π (:func:`kfac_ref.linalg.factor_norm`); ``"avg_diag"`` is the trace norm
        (TF ``PI_TYPE="tracenorm"``, kfac-jax); ``"off"`` sets π = 1 (TF ``PI_TYPE="off"``).
    zero_factor_fallback : {"pi_one", "identity"}
        Factored damping of a zero factor: TF's π = 1 (default) or kfac-jax's :math:`\lambda I`.
    eigenvalue_clipping_threshold : float
        Eigenvalues (diagonal entries of diagonal factors) are raised to at least this value.

    Returns
    -------
    array [p, q]

    Raises
    ------
    KFACValueError, KFACTypeError
        Non-symmetric factors, ``x`` not of shape ``[p, q]``, negative damping, non-positive
        scale, unknown ``norm_type``/``zero_factor_fallback``, a negative power of a singular
        damped block.

    References
    ----------
    Martens & Grosse (2015) §6.3; Grosse & Martens (2016) eq. 23 (the :math:`|T|` scale);
    George et al. (2018) (eigenbasis damping).
    """
    func = "kronecker_block_matpower"
    xp = _check_kron_inputs(func, a, g, x)
    power, damping, scale, c = check_common(func, {"a": a}, power, damping, scale,
                                             eigenvalue_clipping_threshold)
    check_option(func, "norm_type", norm_type, PI_NORMS)
    check_option(func, "zero_factor_fallback", zero_factor_fallback, ZERO_FACTOR_FALLBACKS)
    path = kron_product_path(power, exact)
    check_kron_linalg(func, path, a, g, power, c, norm_type)
    with errors_named(func):
        prepared = prepare_kron(path, xp, a, g, power, damping, scale, norm_type,
                                zero_factor_fallback, c)
        return apply_kron(path, xp, a, g, prepared, x, power, damping, scale)


@capabilities(dask=DASK_NO_EIGH)
def kronecker_block_eigenvalues(a, g, *, scale=1.0, eigenvalue_clipping_threshold=0.0):
    r"""Eigenvalues of the undamped block :math:`s\,(A \otimes G)`.

    .. math::

        \operatorname{spec}(s\,A \otimes G) = \{ s\, a_i \gamma_j \},
        \qquad \text{returned as } \mathrm{vec}_r(s\, a \gamma^\top)\ \text{(length } pq),

    with :math:`a, \gamma` the (clipped) eigenvalues of :math:`A, G` in ascending order.
    """
    func = "kronecker_block_eigenvalues"
    xp = namespace_of(func, a=a, g=g)
    check_factor(func, "a", a)
    check_factor(func, "g", g)
    scale = check_scalar(func, "scale", scale, positive=True, like={"a": a})
    c = check_scalar(func, "eigenvalue_clipping_threshold", eigenvalue_clipping_threshold,
                     like={"a": a})
    check_kron_linalg(func, "eigen", a, g, 0.0, c, "avg_diag")
    s_a, _, s_g, _ = kron_eigen(xp, a, g, c)
    return kron_spectrum(xp, s_a, s_g, scale)


def kron_spectrum(xp, s_a, s_g, scale):
    return xp.reshape(scale * (s_a[:, None] * s_g[None, :]), (-1,))


