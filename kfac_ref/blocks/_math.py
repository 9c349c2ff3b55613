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
  paths (direct power 1, eigenbasis, factored π damping) a product takes;
* ``to_mat2d`` / ``from_mat2d`` and ``flatten`` / ``unflatten`` are the vector maps
  ``(kernel, bias)`` ↔ ``[W; b]`` and tuple of arrays ↔ flat vector shared by all blocks;
* ``check_factor`` validates a Kronecker factor;
* ``validated_internals()`` is the context in which a public block method, after validating
  its inputs once, runs functions of :mod:`kfac_ref.factors` and
  :mod:`kfac_ref.averaging` (they still run their static checks, but no second scan of data
  already checked).
"""

from __future__ import annotations

import math

from array_api_compat import array_namespace as xp_of

from .._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_option,
    check_scalar,
    check_symmetric,
    describe,
    eye_like,
    namespace_of,
    size_of,
    value_checks,
)
from ..linalg import (
    FACTOR_NORMS,
    clipped_eigh,
    damped_matpower,
    factor_norm,
    kron_eigenbasis_matpower,
    pi_adjusted_damping,
    power_of_eigenvalues,
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

PI_NORMS = (*FACTOR_NORMS, "off")
"""Norms accepted for the π damping split: :data:`kfac_ref.linalg.FACTOR_NORMS` plus
``"off"`` (π = 1, TF's ``PI_TYPE = "off"``)."""

ZERO_FACTOR_FALLBACKS = ("pi_one", "identity")
"""What factored damping does when a factor has zero norm: ``"pi_one"`` (TF K-FAC: π = 1, the
factors are damped with :math:`\\sqrt\\lambda` each) or ``"identity"`` (kfac-jax's
``special_case_zero_inv``: the damped block is :math:`\\lambda I`)."""


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


def _check_common(func, power, damping, scale, threshold=0.0):
    power = check_scalar(func, "power", power)
    damping = check_scalar(func, "damping", damping, nonnegative=True)
    scale = check_scalar(func, "scale", scale, positive=True)
    threshold = check_scalar(func, "eigenvalue_clipping_threshold", threshold)
    return power, damping, scale, threshold


def _elementwise_power(func, xp, s, power):
    """``s**power`` with clear errors (one implementation: kfac_ref.linalg's)."""
    return power_of_eigenvalues(xp, s, power, func=func)


def _factor_norm_is_zero(f, norm_type):
    # The norm that sets π (kfac-jax tests the same norms for its zero-factor special case);
    # kfac_ref.linalg.factor_norm is the one home of the factor norms.  For a PSD factor every
    # one of them is zero exactly when the factor is zero.
    return bool(factor_norm.kernel(xp_of(f), f, "avg_diag" if norm_type == "off"
                                   else norm_type) == 0.0)


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
    """``(F + δI)^p`` of one factor: a matrix, or a vector for a diagonal factor."""
    if f.ndim == 1:
        return _elementwise_power(func, xp, xp.clip(f, min=threshold) + delta, power)
    try:
        return damped_matpower.kernel(xp, f, power, delta, threshold, func=func)
    except KFACValueError as exc:
        raise KFACValueError(f"{func}: a damped Kronecker factor is singular for the power "
                             f"{power} ({exc}). Add damping.") from None


def prepare_kron_factored(func, xp, a, g, power, damping, scale, norm_type, zero_factor_fallback,
                           threshold):
    r"""Factor powers of the π-damped block.

    Returns ``(a_pow, g_pow, coeff)`` with
    :math:`(s (A + \delta_A I) \otimes (G + \delta_G I))^p = c\, A_p \otimes G_p`; for the
    kfac-jax zero-factor case ``a_pow = g_pow = None`` and the block is :math:`c I`.
    """
    lam = damping / scale
    zero = _factor_norm_is_zero(a, norm_type) or _factor_norm_is_zero(g, norm_type)
    if zero and zero_factor_fallback == "identity":
        # kfac-jax: every damped factor is (λ/s)^(1/2) I, so the damped block is λ I.
        if power < 0 and damping == 0.0:
            raise KFACValueError(
                f"{func}: a Kronecker factor is zero and damping is 0, so the block is singular "
                f"for the power {power}. Add damping."
            )
        return None, None, damping**power
    if norm_type == "off":
        delta_a = delta_g = math.sqrt(lam)
    else:
        delta_a, delta_g = pi_adjusted_damping.kernel(xp, a, g, lam, norm_type)
    a_pow = _factor_power(func, xp, a, power, delta_a, threshold)
    g_pow = _factor_power(func, xp, g, power, delta_g, threshold)
    return a_pow, g_pow, scale**power


def apply_kron_factored(xp, prepared, x):
    a_pow, g_pow, coeff = prepared
    if a_pow is None:
        return coeff * x
    left = a_pow[:, None] * x if a_pow.ndim == 1 else a_pow @ x
    prod = left * g_pow[None, :] if g_pow.ndim == 1 else left @ g_pow
    return coeff * prod


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
                 threshold):
    """The statistics-only part of a Kronecker product on ``path`` (None for "direct")."""
    if path == "direct":
        return None
    if path == "eigen":
        return prepare_kron_eigen(func, xp, a, g, threshold)
    return prepare_kron_factored(func, xp, a, g, power, damping, scale, norm_type,
                                 zero_factor_fallback, threshold)


def apply_kron(path, func, xp, a, g, prepared, x, power, damping, scale):
    """The vector part of a Kronecker product on ``path`` (``prepared`` from
    :func:`prepare_kron`, computed now or read from a cache)."""
    if path == "direct":
        return apply_kron_direct(xp, a, g, x, damping, scale)
    if path == "eigen":
        return apply_kron_eigen(func, xp, prepared, x, power, damping, scale)
    return apply_kron_factored(xp, prepared, x)


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

        \big(s\,(A + \pi\sqrt{\lambda/s}\,I) \otimes (G + \tfrac{1}{\pi}\sqrt{\lambda/s}\,I)
        \big)^{p}\,\mathrm{vec}_r(X)
        = s^{p}\,\mathrm{vec}_r\big((A + \delta_A I)^{p}\, X\, (G + \delta_G I)^{p}\big),
        \qquad \pi = \sqrt{\|A\| / \|G\|}.

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
    power, damping, scale, c = _check_common(func, power, damping, scale,
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


# --------------------------------------------------------------------------------------
# Diagonal, full and scaled-identity blocks
# --------------------------------------------------------------------------------------
def apply_diagonal(func, xp, diagonal, x, power, damping, scale):
    return _elementwise_power(func, xp, scale * diagonal + damping, power) * x


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
    power, damping, scale, _ = _check_common(func, power, damping, scale)
    return apply_diagonal(func, xp, diagonal, x, power, damping, scale)


def prepare_full(func, xp, matrix, threshold):
    """Clipped eigendecomposition of a full block (what its cache stores)."""
    return clipped_eigh.kernel(xp, matrix, threshold)


def apply_full(func, xp, matrix, eig, x, power, damping, scale):
    """``(sF + λI)^p x``: directly for :math:`p = 1`, else from the eigendecomposition."""
    if power == 1.0:
        return scale * (matrix @ x) + damping * x
    return apply_full_eigen(func, xp, eig, x, power, damping, scale)


def apply_full_eigen(func, xp, eig, x, power, damping, scale):
    s, q = eig
    coeff = _elementwise_power(func, xp, scale * s + damping, power)
    return q @ (coeff * (xp.matrix_transpose(q) @ x))


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
    power, damping, scale, c = _check_common(func, power, damping, scale,
                                             eigenvalue_clipping_threshold)
    eig = None if power == 1.0 else prepare_full(func, xp, matrix, c)
    return apply_full(func, xp, matrix, eig, x, power, damping, scale)


def scaled_identity_matpower(x, power, damping=0.0, *, scale=1.0):
    r"""Power of a damped scaled identity block (kfac-jax ``ScaledIdentity``).

    .. math::

        (s I + \lambda I)^{p}\, x = (s + \lambda)^{p}\, x .
    """
    func = "scaled_identity_matpower"
    namespace_of(func, x=x)
    check_array(func, "x", x)
    power = check_scalar(func, "power", power)
    damping = check_scalar(func, "damping", damping, nonnegative=True)
    scale = check_scalar(func, "scale", scale, nonnegative=True)
    base = scale + damping
    if power < 0 and base == 0.0:
        raise KFACValueError(f"{func}: scale + damping must be positive for the negative power "
                             f"{power}; got 0.")
    return (base**power) * x


# --------------------------------------------------------------------------------------
# Damping bookkeeping for replicated parameters
# --------------------------------------------------------------------------------------
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
    if rho:
        return damping / k**rho
    return damping


# --------------------------------------------------------------------------------------
# Series (RNN) blocks, Martens, Ba & Johnson (2018)
# --------------------------------------------------------------------------------------
def series_gamma(x, num_timesteps):
    r"""Option-1 spectral function :math:`\gamma_T = 1/\zeta_T` of the series block.

    .. math::

        \zeta_T(x) = T + 2\sum_{d=1}^{T-1}(T-d)\,x^{d}
                   = \frac{T(1-x^2) - 2x(1-x^{T})}{(1-x)^2},
        \qquad \gamma_T(x) = \frac{(1-x)^2}{T(1-x^2) - 2x(1-x^{T})},

    elementwise, with the limit :math:`\gamma_T(1) = 1/T^2` substituted where :math:`x = 1`
    exactly.  :math:`\gamma_T(0) = 1/T`.
    """
    func = "series_gamma"
    xp = namespace_of(func, x=x)
    check_array(func, "x", x)
    t = check_scalar(func, "num_timesteps", num_timesteps, positive=True, integer=True)
    one = x == 1.0
    safe = xp.where(one, xp.zeros_like(x), x)
    gamma = (1.0 - safe) ** 2 / (t * (1.0 - safe**2) - 2.0 * safe * (1.0 - safe**t))
    return xp.where(one, xp.full_like(x, 1.0 / t**2), gamma)


def _check_series_x(func, x, p, q):
    check_array(func, "x", x, ndim=2, shape=(p, q), layout=f"[{p}, {q}] (row-major [W; b])")


def series_option1_multiply_inverse(l_a, psi_a, l_g, psi_g, num_timesteps, x):
    r"""Option-1 inverse of the series (RNN) block, TF ``FullyConnectedSeriesFB`` option 1.

    With damped :math:`\tilde C_0 = C_0 + \delta I`, the symmetrised lag-1 statistic
    :math:`\bar C_1 = (C_1 + C_1^\top)/2`,
    :math:`\hat\Psi = \tilde C_0^{-1/2}\bar C_1\tilde C_0^{-1/2} = U\mathrm{diag}(\psi)U^\top`
    and :math:`L = \tilde C_0^{-1/2} U` per factor (``series_option1_quantities`` of
    :mod:`kfac_ref.factors`), the block
    :math:`F_T = V_0^{1/2}\zeta_T(\hat\Psi)V_0^{1/2}`, :math:`V_0 = \tilde A_0\otimes\tilde G_0`,
    :math:`\hat\Psi = \hat\Psi_A\otimes\hat\Psi_G`, is inverted as

    .. math::

        F_T^{-1}\mathrm{vec}_r(X) = \mathrm{vec}_r\Big(L_A\big[(L_A^\top X L_G) \odot
        \gamma_T(\psi_A\psi_G^\top)\big]L_G^\top\Big)

    (no extra :math:`1/T`: :math:`\gamma_T(0) = 1/T` carries it).  ``X`` is ``[p, q]``
    row-major (input side first); TF's ``[out, in]`` algebra is the transpose.
    """
    func = "series_option1_multiply_inverse"
    xp = namespace_of(func, l_a=l_a, psi_a=psi_a, l_g=l_g, psi_g=psi_g, x=x)
    p, q = _check_series_pairs(func, ("l_a", l_a, "psi_a", psi_a), ("l_g", l_g, "psi_g", psi_g))
    _check_series_x(func, x, p, q)
    y = xp.matrix_transpose(l_a) @ x @ l_g
    y = y * series_gamma(psi_a[:, None] * psi_g[None, :], num_timesteps)
    return l_a @ y @ xp.matrix_transpose(l_g)


def _check_series_pairs(func, *pairs):
    dims = []
    for mname, m, vname, v in pairs:
        check_array(func, mname, m, ndim=2)
        n = m.shape[0]
        check_array(func, mname, m, shape=(n, n), layout="[n, n]")
        check_array(func, vname, v, ndim=1, shape=(n,), layout=f"[{n}]")
        dims.append(n)
    return dims


def series_option2_multiply_inverse(p_a, k_a, mu_a, p_g, k_g, mu_g, num_timesteps, x):
    r"""Option-2 (:math:`T\to\infty`) inverse of the series block, TF ``FullyConnectedSeriesFB``.

    Per factor (``series_option2_quantities`` of :mod:`kfac_ref.factors`):
    :math:`P = C_1^\top\tilde C_0^{-1}` (time-reversed AR coefficient),
    :math:`\hat\Psi = \tilde C_0^{-1/2}C_1\tilde C_0^{-1/2}`,
    :math:`\hat\Psi^\top\hat\Psi = E\,\mathrm{diag}(\mu)E^\top`, :math:`K = \tilde C_0^{-1/2}E`.
    With :math:`\mathcal P = P_A\otimes P_G` and :math:`V_0 = \tilde A_0\otimes\tilde G_0`:

    .. math::

        F_\infty^{-1} = \tfrac1T (I - \mathcal P^\top)(V_0 - \mathcal P V_0\mathcal P^\top)^{-1}
        (I - \mathcal P), \qquad
        (V_0 - \mathcal P V_0\mathcal P^\top)^{-1}
        = (K_A\otimes K_G)\,\mathrm{diag}\big(1/(1 - \mu_A\otimes\mu_G)\big)(K_A\otimes K_G)^\top,

    computed on ``X`` [p, q] (row-major) as
    :math:`X \leftarrow X - P_A X P_G^\top`, :math:`X \leftarrow K_A^\top X K_G`,
    :math:`X \leftarrow X \oslash (1 - \mu_A\mu_G^\top)` (exact zeros of the denominator
    replaced by 1, as TF does), :math:`X \leftarrow K_A X K_G^\top`,
    :math:`X \leftarrow X - P_A^\top X P_G`, :math:`X \leftarrow X/T`.
    """
    func = "series_option2_multiply_inverse"
    xp = namespace_of(func, p_a=p_a, k_a=k_a, mu_a=mu_a, p_g=p_g, k_g=k_g, mu_g=mu_g, x=x)
    p, q = _check_series_pairs(func, ("k_a", k_a, "mu_a", mu_a), ("k_g", k_g, "mu_g", mu_g))
    check_array(func, "p_a", p_a, shape=(p, p), layout=f"[{p}, {p}]")
    check_array(func, "p_g", p_g, shape=(q, q), layout=f"[{q}, {q}]")
    _check_series_x(func, x, p, q)
    t = check_scalar(func, "num_timesteps", num_timesteps, positive=True, integer=True)
    y = x - p_a @ x @ xp.matrix_transpose(p_g)
    y = xp.matrix_transpose(k_a) @ y @ k_g
    denom = 1.0 - mu_a[:, None] * mu_g[None, :]
    denom = xp.where(denom == 0.0, xp.ones_like(denom), denom)
    y = y / denom
    y = k_a @ y @ xp.matrix_transpose(k_g)
    y = y - xp.matrix_transpose(p_a) @ y @ p_g
    return y / t


# --------------------------------------------------------------------------------------
# Block-tridiagonal inverse, Martens & Grosse (2015) §4.3 and Appendix B
# --------------------------------------------------------------------------------------
def kronecker_difference_inverse(a, b, c, d, x):
    r"""Inverse of a difference of Kronecker products times a matrix (M&G 2015, App. B).

    For symmetric positive definite :math:`A` [p, p], :math:`B` [q, q] and symmetric
    :math:`C` [p, p], :math:`D` [q, q] with :math:`A\otimes B - C\otimes D` positive definite:

    .. math::

        A^{-1/2} C A^{-1/2} = E_1 S_1 E_1^\top,\quad
        B^{-1/2} D B^{-1/2} = E_2 S_2 E_2^\top,\quad K_1 = A^{-1/2}E_1,\ K_2 = B^{-1/2}E_2,

        (A\otimes B - C\otimes D)^{-1}\,\mathrm{vec}_r(X)
        = \mathrm{vec}_r\Big(K_1\big[(K_1^\top X K_2) \oslash (\mathbf 1\mathbf 1^\top
          - s_1 s_2^\top)\big]K_2^\top\Big),

    because :math:`A\otimes B - C\otimes D = (K_1\otimes K_2)^{-\top}(I - S_1\otimes S_2)
    (K_1\otimes K_2)^{-1}`.  ``X`` is ``[p, q]`` row-major.

    Raises
    ------
    KFACValueError
        Shape mismatches, non-symmetric inputs, singular :math:`A`/:math:`B`, or
        :math:`1 - s_1 s_2^\top` with a non-positive entry (the difference is not positive
        definite).
    """
    func = "kronecker_difference_inverse"
    xp = namespace_of(func, a=a, b=b, c=c, d=d, x=x)
    for name, m in (("a", a), ("b", b), ("c", c), ("d", d)):
        check_symmetric(func, name, m)
    p, q = a.shape[0], b.shape[0]
    check_array(func, "c", c, shape=(p, p))
    check_array(func, "d", d, shape=(q, q))
    check_array(func, "x", x, ndim=2, shape=(p, q), layout=f"[{p}, {q}]")
    return _kron_difference_inverse(func, xp, a, b, c, d, x)


def _kron_difference_inverse(func, xp, a, b, c, d, x):
    ks, ss = [], []
    for name, big, small in (("a", a, c), ("b", b, d)):
        try:
            r = damped_matpower(big, -0.5)
        except KFACValueError:
            raise KFACValueError(f"{func}: {name} must be positive definite; its inverse square "
                                 "root does not exist.") from None
        m = r @ small @ r
        s, e = xp.linalg.eigh((m + xp.matrix_transpose(m)) / 2.0)  # no clipping: C may be
        # indefinite in general (Appendix B needs only symmetry)
        ks.append(r @ e)
        ss.append(s)
    denom = 1.0 - ss[0][:, None] * ss[1][None, :]
    if size_of(denom) and not bool(xp.min(denom) > 0):
        raise KFACValueError(f"{func}: A⊗B - C⊗D must be positive definite; got "
                             f"min(1 - s1 s2ᵀ) = {float(xp.min(denom)):.3g}.")
    k1, k2 = ks
    y = (xp.matrix_transpose(k1) @ x @ k2) / denom
    return k1 @ y @ xp.matrix_transpose(k2)


def block_tridiagonal_multiply_inverse(a_diag, g_diag, a_off, g_off, xs, damping=0.0):
    r"""Block-tridiagonal K-FAC inverse :math:`\hat F^{-1} v` over a chain of layers.

    Layer :math:`i` has the block :math:`\tilde F_{i,i} = A_i \otimes G_i` (input factor
    :math:`A_i = \bar A_{i-1,i-1}`, output factor :math:`G_i`) and neighbours couple through
    :math:`\tilde F_{i,i+1} = A_{i,i+1}\otimes G_{i,i+1}`.  :math:`\hat F` agrees with
    :math:`\tilde F` on the tridiagonal blocks and has a block-tridiagonal inverse:

    .. math::

        \Psi_{i} = \Psi^A_i\otimes\Psi^G_i,\quad \Psi^A_i = A_{i,i+1}A_{i+1}^{-1},\
        \Psi^G_i = G_{i,i+1}G_{i+1}^{-1},

        \Sigma_{i|i+1} = A_i\otimes G_i - (\Psi^A_i A_{i+1}\Psi^{A\top}_i)\otimes
        (\Psi^G_i G_{i+1}\Psi^{G\top}_i),\qquad \Sigma_\ell = A_\ell\otimes G_\ell,

        \hat F^{-1} = \Xi^\top\Lambda\,\Xi,\quad \Lambda = \mathrm{diag}(\Sigma_{1|2}^{-1},
        \dots, \Sigma_\ell^{-1}),\quad \Xi = I - \mathrm{superdiag}(\Psi_1,\dots,\Psi_{\ell-1}),

    applied per layer on row-major ``[p_i, q_i]`` matrices:
    :math:`U_i = X_i - \Psi^A_i X_{i+1}\Psi^{G\top}_i`,
    :math:`Y_i = \Sigma_{i|i+1}^{-1}U_i` (:func:`kronecker_difference_inverse`),
    :math:`Z_i = Y_i - \Psi^{A\top}_{i-1}Y_{i-1}\Psi^G_{i-1}`.

    Damping: factored Tikhonov damping with the trace-norm π of each *diagonal* pair,
    :math:`A_i + \pi_i\sqrt\lambda I`, :math:`G_i + \sqrt\lambda/\pi_i I`, used everywhere
    (in :math:`\Psi` and :math:`\Sigma`); the off-diagonal factors stay undamped (a reading
    of Martens & Grosse 2015, §6.3).

    Parameters
    ----------
    a_diag, g_diag : sequences of :math:`\ell` symmetric PSD arrays [p_i, p_i], [q_i, q_i]
    a_off, g_off : sequences of :math:`\ell - 1` arrays [p_i, p_{i+1}], [q_i, q_{i+1}]
    xs : sequence of :math:`\ell` arrays [p_i, q_i]
    damping : float

    Returns
    -------
    tuple of arrays [p_i, q_i]

    Raises
    ------
    KFACValueError, KFACTypeError
        Mismatched lengths or shapes, singular damped factors, a conditional covariance that
        is not positive definite.

    References
    ----------
    Martens & Grosse (2015), §4.3 and Appendix B.
    """
    func = "block_tridiagonal_multiply_inverse"
    seqs = {"a_diag": a_diag, "g_diag": g_diag, "a_off": a_off, "g_off": g_off, "xs": xs}
    for name, seq in seqs.items():
        if not isinstance(seq, (list, tuple)):
            raise KFACTypeError(f"{func}: {name} must be a sequence of arrays; got "
                                f"{describe(seq)}.")
    n = len(a_diag)
    if n == 0 or len(g_diag) != n or len(xs) != n or len(a_off) != n - 1 or len(g_off) != n - 1:
        raise KFACValueError(
            f"{func}: a_diag, g_diag and xs must have one entry per layer and a_off, g_off one "
            f"per neighbouring pair; got lengths {len(a_diag)}, {len(g_diag)}, {len(xs)}, "
            f"{len(a_off)}, {len(g_off)}.")
    arrays = {f"{k}[{i}]": v for k, seq in seqs.items() for i, v in enumerate(seq)}
    xp = namespace_of(func, **arrays)
    damping = check_scalar(func, "damping", damping, nonnegative=True)
    A, G = [], []
    for i in range(n):
        check_symmetric(func, f"a_diag[{i}]", a_diag[i])
        check_symmetric(func, f"g_diag[{i}]", g_diag[i])
        p, q = a_diag[i].shape[0], g_diag[i].shape[0]
        check_array(func, f"xs[{i}]", xs[i], ndim=2, shape=(p, q), layout=f"[{p}, {q}]")
        if i < n - 1:
            check_array(func, f"a_off[{i}]", a_off[i], shape=(p, a_diag[i + 1].shape[0]))
            check_array(func, f"g_off[{i}]", g_off[i], shape=(q, g_diag[i + 1].shape[0]))
        da, dg = pi_adjusted_damping(a_diag[i], g_diag[i], damping)
        A.append(a_diag[i] + da * eye_like(a_diag[i], p))
        G.append(g_diag[i] + dg * eye_like(g_diag[i], q))
    inv = [(_spd_power(func, A[i], -1.0), _spd_power(func, G[i], -1.0)) for i in range(n)]
    psi = [(a_off[i] @ inv[i + 1][0], g_off[i] @ inv[i + 1][1]) for i in range(n - 1)]
    ys = []
    for i in range(n):
        if i == n - 1:
            ys.append(inv[i][0] @ xs[i] @ inv[i][1])
            continue
        pa, pg = psi[i]
        u = xs[i] - pa @ xs[i + 1] @ xp.matrix_transpose(pg)
        c = pa @ A[i + 1] @ xp.matrix_transpose(pa)
        d = pg @ G[i + 1] @ xp.matrix_transpose(pg)
        c = (c + xp.matrix_transpose(c)) / 2
        d = (d + xp.matrix_transpose(d)) / 2
        ys.append(_kron_difference_inverse(func, xp, A[i], G[i], c, d, u))
    out = [ys[0]]
    for i in range(1, n):
        pa, pg = psi[i - 1]
        out.append(ys[i] - xp.matrix_transpose(pa) @ ys[i - 1] @ pg)
    return tuple(out)


def _spd_power(func, m, power):
    try:
        return damped_matpower(m, power)
    except KFACValueError:
        raise KFACValueError(f"{func}: a damped diagonal factor is singular. Add damping.") \
            from None
