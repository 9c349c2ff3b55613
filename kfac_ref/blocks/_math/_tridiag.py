"""Block-tridiagonal K-FAC inverse, Martens & Grosse (2015)."""

from __future__ import annotations

from ..._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_namespace_has,
    check_scalar,
    check_symmetric,
    checks_values,
    describe,
    errors_named,
    eye_like,
    kernel_error,
    namespace_of,
    optional_linalg,
    size_of,
)
from ..._support import DASK_NO_EIGH, capabilities
from ...linalg import (
    damped_matpower,
    pi_adjusted_damping,
)


# --------------------------------------------------------------------------------------
# Block-tridiagonal inverse, Martens & Grosse (2015) §4.3 and Appendix B
# --------------------------------------------------------------------------------------
@capabilities(dask=DASK_NO_EIGH)
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
    check_namespace_has(func, "a", a, "linalg.eigh", "an eigendecomposition")
    with errors_named(func):
        return _kron_difference_inverse(xp, a, b, c, d, x)


def _kron_difference_inverse(xp, a, b, c, d, x):
    ks, ss = [], []
    for name, big, small in (("a", a, c), ("b", b, d)):
        try:
            r = damped_matpower.kernel(xp, big, -0.5)
        except KFACValueError:
            raise kernel_error(f"{name} must be positive definite; its inverse square root "
                               "does not exist.") from None
        m = r @ small @ r
        # no clipping: C may be indefinite in general (Appendix B needs only symmetry)
        s, e = optional_linalg(xp, "eigh")((m + xp.matrix_transpose(m)) / 2.0)
        ks.append(r @ e)
        ss.append(s)
    denom = 1.0 - ss[0][:, None] * ss[1][None, :]
    # a value check (skipped with value checks off and for lazy arrays: NaN/Inf out)
    if size_of(denom) and checks_values(denom) and not bool(xp.min(denom) > 0):
        raise kernel_error(f"A⊗B - C⊗D must be positive definite; got "
                           f"min(1 - s1 s2ᵀ) = {float(xp.min(denom)):.3g}.")
    k1, k2 = ks
    y = (xp.matrix_transpose(k1) @ x @ k2) / denom
    return k1 @ y @ xp.matrix_transpose(k2)


@capabilities(dask=DASK_NO_EIGH)
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
    damping = check_scalar(func, "damping", damping, nonnegative=True, like=arrays)
    for i in range(n):
        check_symmetric(func, f"a_diag[{i}]", a_diag[i])
        check_symmetric(func, f"g_diag[{i}]", g_diag[i])
    for i in range(n):
        p, q = a_diag[i].shape[0], g_diag[i].shape[0]
        check_array(func, f"xs[{i}]", xs[i], ndim=2, shape=(p, q), layout=f"[{p}, {q}]")
        if i < n - 1:
            check_array(func, f"a_off[{i}]", a_off[i], shape=(p, a_diag[i + 1].shape[0]))
            check_array(func, f"g_off[{i}]", g_off[i], shape=(q, g_diag[i + 1].shape[0]))
    check_namespace_has(func, "a_diag[0]", a_diag[0], "linalg.eigh", "an eigendecomposition")
    with errors_named(func):
        return _block_tridiagonal_multiply_inverse(xp, a_diag, g_diag, a_off, g_off, xs,
                                                   damping)


def _block_tridiagonal_multiply_inverse(xp, a_diag, g_diag, a_off, g_off, xs, damping):
    n = len(a_diag)
    A, G = [], []
    for i in range(n):
        da, dg = pi_adjusted_damping.kernel(xp, a_diag[i], g_diag[i], damping)
        A.append(a_diag[i] + da * eye_like(a_diag[i], a_diag[i].shape[0]))
        G.append(g_diag[i] + dg * eye_like(g_diag[i], g_diag[i].shape[0]))
    inv = [(_spd_power(xp, A[i], -1.0), _spd_power(xp, G[i], -1.0)) for i in range(n)]
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
        ys.append(_kron_difference_inverse(xp, A[i], G[i], c, d, u))
    out = [ys[0]]
    for i in range(1, n):
        pa, pg = psi[i - 1]
        out.append(ys[i] - xp.matrix_transpose(pa) @ ys[i - 1] @ pg)
    return tuple(out)


def _spd_power(xp, m, power):
    try:
        return damped_matpower.kernel(xp, m, power)
    except KFACValueError:
        raise kernel_error("a damped diagonal factor is singular. Add damping.") from None
