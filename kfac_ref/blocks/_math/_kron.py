"""Kronecker-factored block products (exact eigenbasis and factored π damping paths)."""

from __future__ import annotations

from ..._backend import (
    KFACValueError,
    check_array,
    check_option,
    check_scalar,
    checks_values,
    namespace_of,
)
from ...linalg import (
    clipped_eigh,
    damped_cholesky,
    damped_cholesky_inverse,
    damped_matpower,
    factor_norm,
    kron_eigenbasis_matpower,
    pi_adjusted_damping,
)
from ._common import (
    PI_NORMS,
    ZERO_FACTOR_FALLBACKS,
    check_common,
    check_factor,
    elementwise_power,
)


def factor_norms(xp, a, g, norm_type):
    """``(‖A‖, ‖G‖)`` for π and the zero-factor test (``"off"``: the trace norms)."""
    return _factor_norms(xp, a, g, norm_type)


def _factor_norms(xp, a, g, norm_type):
    # The norms that set π; kfac-jax tests the same norms for its zero-factor special case,
    # so both uses share them.  kfac_ref.linalg.factor_norm is the one home of the factor
    # norms; for a PSD factor every one of them is zero exactly when the factor is zero.
    kind = "avg_diag" if norm_type == "off" else norm_type
    return factor_norm.kernel(xp, a, kind), factor_norm.kernel(xp, g, kind)


# --------------------------------------------------------------------------------------
# Kronecker-factored blocks
# --------------------------------------------------------------------------------------
def prepare_kron_eigen(func, xp, a, g, threshold):
    """Eigendecompositions of both factors (a diagonal factor is its own eigenbasis)."""
    out = []
    for f in (a, g):
        if f.ndim == 1:
            out.append((xp.clip(f, min=threshold), None))
        else:
            out.append(clipped_eigh.kernel(xp, f, threshold))
    return out[0][0], out[0][1], out[1][0], out[1][1]


def apply_kron_eigen(func, xp, eig, x, power, damping, scale):
    r"""``(s·A⊗G + λI)^p vec_r(X)`` from the factors' eigendecompositions."""
    s_a, q_a, s_g, q_g = eig
    return kron_eigenbasis_matpower.kernel(xp, s_a, q_a, s_g, q_g, x, power, damping, scale,
                                            func=func)


def apply_kron_direct(xp, a, g, x, damping, scale):
    """``(s·A⊗G + λI) vec_r(X) = vec_r(s·A X Gᵀ + λX)`` (power 1, no eigendecomposition)."""
    left = a[:, None] * x if a.ndim == 1 else a @ x
    prod = left * g[None, :] if g.ndim == 1 else left @ xp.matrix_transpose(g)
    return scale * prod + damping * x


def _factor_power(func, xp, f, power, delta, threshold):
    """``(F + δI)^p`` of one factor: a matrix, or a vector for a diagonal factor.  The factors
    are second moments, so an inverse with clipping at ``threshold <= 0`` is one Cholesky
    inverse (see :mod:`kfac_ref.linalg`)."""
    if f.ndim == 1:
        return elementwise_power(func, xp, xp.clip(f, min=threshold) + delta, power)
    try:
        return damped_matpower.kernel(xp, f, power, delta, threshold, func=func,
                                      second_moment=True)
    except KFACValueError as exc:
        raise KFACValueError(f"{func}: a damped Kronecker factor is singular for the power "
                             f"{power} ({exc}). Add damping.") from None


def zero_factor(xp, norms):
    """kfac-jax's zero-factor test ``‖A‖ = 0 or ‖G‖ = 0`` from :func:`factor_norms`: a
    Python bool read on the host when value checks run on concrete arrays, else the 0-D
    boolean array (inside a trace, or with value checks off: both branches are computed and
    selected, the same numbers without a read and without the error of a singular zero
    block)."""
    flag = xp.logical_or(norms[0] == 0.0, norms[1] == 0.0)
    return bool(flag) if checks_values(flag) else flag


def prepare_kron_factored(func, xp, a, g, power, damping, scale, norm_type, zero_factor_fallback,
                           threshold, norms=None, zero=None):
    r"""Factor powers of the π-damped block.

    Returns ``(a_pow, g_pow, coeff)`` (and, for traced arrays, the zero-factor flag and the
    identity coefficient, selected by :func:`apply_kron_factored`) with
    :math:`(s (A + \delta_A I) \otimes (G + \delta_G I))^p = c\, A_p \otimes G_p`; for the
    kfac-jax zero-factor case ``a_pow = g_pow = None`` and the block is :math:`c I`.
    ``norms``: :func:`factor_norms` of ``(a, g, norm_type)`` and ``zero``: their
    :func:`zero_factor` test, when the caller has them (a cache of several powers computes
    them once).
    """
    lam = damping / scale
    if norms is None and (zero_factor_fallback == "identity" or norm_type != "off"):
        norms = _factor_norms(xp, a, g, norm_type)
    if zero_factor_fallback != "identity":
        zero = None
    elif zero is None:
        # inside a trace the flag is lazy even for factors the traced function closes over
        zero = zero_factor(xp, norms)
    if isinstance(zero, bool):  # eager: decided on the host, as kfac-jax's Python branch does
        if zero:
            # kfac-jax: every damped factor is (λ/s)^(1/2) I, so the damped block is λ I.
            if power < 0 and damping == 0.0:
                raise KFACValueError(
                    f"{func}: a Kronecker factor is zero and damping is 0, so the block is "
                    f"singular for the power {power}. Add damping."
                )
            return None, None, damping**power
        zero = None
    if norm_type == "off":
        delta_a = delta_g = lam**0.5
    else:
        delta_a, delta_g = pi_adjusted_damping.kernel(xp, a, g, lam, norm_type, norms=norms)
    a_pow = _factor_power(func, xp, a, power, delta_a, threshold)
    g_pow = _factor_power(func, xp, g, power, delta_g, threshold)
    if zero is not None:  # traced: both branches, selected per call (jnp.where semantics)
        return a_pow, g_pow, scale**power, zero, damping**power
    return a_pow, g_pow, scale**power


def apply_kron_factored(xp, prepared, x):
    a_pow, g_pow, coeff = prepared[:3]
    if a_pow is None:
        return coeff * x
    left = a_pow[:, None] * x if a_pow.ndim == 1 else a_pow @ x
    prod = left * g_pow[None, :] if g_pow.ndim == 1 else left @ g_pow
    if len(prepared) == 5:  # traced zero-factor test: the identity block where it holds
        zero, identity_coeff = prepared[3:]
        return xp.where(zero, identity_coeff * x, coeff * prod)
    return coeff * prod


def _factor_triangle(func, xp, f, delta, inverse):
    """Lower Cholesky factor of ``F + δI`` (or its inverse); the diagonal's square root
    (inverse square root) for a diagonal factor."""
    if f.ndim == 1:
        return elementwise_power(func, xp, f + delta, -0.5 if inverse else 0.5)
    kernel = damped_cholesky_inverse.kernel if inverse else damped_cholesky.kernel
    return kernel(xp, f, delta, func=func)


def apply_kron_cholesky(func, xp, a, g, x, delta_a, delta_g, scale, *, transpose=False,
                        inverse=False):
    r"""TF's Cholesky products of a factored-damped Kronecker block on ``X`` ``[p, q]``.

    .. math::

        L = s^{1/2}\, L_A \otimes L_G, \quad L_A L_A^\top = A + \delta_A I, \quad
        L_G L_G^\top = G + \delta_G I, \qquad L L^\top = s\,(A + \delta_A I) \otimes
        (G + \delta_G I);

        L\,\mathrm{vec}_r X = s^{1/2}\mathrm{vec}_r(L_A X L_G^\top), \quad
        L^\top\mathrm{vec}_r X = s^{1/2}\mathrm{vec}_r(L_A^\top X L_G), \quad
        L^{-1}\mathrm{vec}_r X = s^{-1/2}\mathrm{vec}_r(L_A^{-1} X L_G^{-\top}), \quad
        L^{-\top}\mathrm{vec}_r X = s^{-1/2}\mathrm{vec}_r(L_A^{-\top} X L_G^{-1})

    (TF ``KroneckerProductFB.multiply_cholesky`` / ``multiply_cholesky_inverse``: the factors'
    ``get_cholesky`` / ``get_cholesky_inverse`` with their π-split dampings).  A diagonal
    (1-D) factor's triangle is :math:`(f + \delta)^{\odot \pm 1/2}`.  Internal: the caller
    validated its arguments.
    """
    l_a = _factor_triangle(func, xp, a, delta_a, inverse)
    l_g = _factor_triangle(func, xp, g, delta_g, inverse)
    if l_a.ndim == 1:
        left = l_a[:, None] * x
    else:
        left = (xp.matrix_transpose(l_a) if transpose else l_a) @ x
    if l_g.ndim == 1:
        prod = left * l_g[None, :]
    else:
        prod = left @ (l_g if transpose else xp.matrix_transpose(l_g))
    return (scale ** (-0.5 if inverse else 0.5)) * prod


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


def prepare_kron(path, func, xp, a, g, power, damping, scale, norm_type, zero_factor_fallback,
                 threshold, norms=None, zero=None):
    """The statistics-only part of a Kronecker product on ``path`` (None for "direct");
    ``norms`` and ``zero`` as in :func:`prepare_kron_factored`."""
    if path == "direct":
        return None
    if path == "eigen":
        return prepare_kron_eigen(func, xp, a, g, threshold)
    return prepare_kron_factored(func, xp, a, g, power, damping, scale, norm_type,
                                 zero_factor_fallback, threshold, norms, zero)


def apply_kron(path, func, xp, a, g, prepared, x, power, damping, scale):
    """The vector part of a Kronecker product on ``path`` (``prepared`` from
    :func:`prepare_kron`, computed now or read from a cache)."""
    if path == "direct":
        return apply_kron_direct(xp, a, g, x, damping, scale)
    if path == "eigen":
        return apply_kron_eigen(func, xp, prepared, x, power, damping, scale)
    return apply_kron_factored(xp, prepared, x)



def _check_kron_inputs(func, a, g, x):
    xp = namespace_of(func, a=a, g=g, x=x)
    check_factor(func, "a", a)
    check_factor(func, "g", g)
    p, q = a.shape[0], g.shape[0]
    check_array(func, "x", x, ndim=2, shape=(p, q), layout=f"[{p}, {q}] (row-major [W; b])")
    return xp


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
    power, damping, scale, c = check_common(func, power, damping, scale,
                                             eigenvalue_clipping_threshold)
    check_option(func, "norm_type", norm_type, PI_NORMS)
    check_option(func, "zero_factor_fallback", zero_factor_fallback, ZERO_FACTOR_FALLBACKS)
    path = kron_product_path(power, exact)
    prepared = prepare_kron(path, func, xp, a, g, power, damping, scale, norm_type,
                            zero_factor_fallback, c)
    return apply_kron(path, func, xp, a, g, prepared, x, power, damping, scale)


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
    scale = check_scalar(func, "scale", scale, positive=True)
    c = check_scalar(func, "eigenvalue_clipping_threshold", eigenvalue_clipping_threshold)
    s_a, _, s_g, _ = prepare_kron_eigen(func, xp, a, g, c)
    return kron_spectrum(xp, s_a, s_g, scale)


def kron_spectrum(xp, s_a, s_g, scale):
    return xp.reshape(scale * (s_a[:, None] * s_g[None, :]), (-1,))


