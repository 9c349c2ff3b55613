"""Series (RNN) block inverses, Martens, Ba & Johnson (2018)."""

from __future__ import annotations

from ..._backend import (
    check_array,
    check_scalar,
    namespace_of,
)
from ..._support import capabilities


# --------------------------------------------------------------------------------------
# Series (RNN) blocks, Martens, Ba & Johnson (2018)
# --------------------------------------------------------------------------------------
@capabilities(dask="yes")
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
    return _series_gamma(xp, x, t)


def _series_gamma(xp, x, t):
    one = x == 1.0
    safe = xp.where(one, xp.zeros_like(x), x)
    gamma = (1.0 - safe) ** 2 / (t * (1.0 - safe**2) - 2.0 * safe * (1.0 - safe**t))
    return xp.where(one, xp.full_like(x, 1.0 / t**2), gamma)


def _check_series_x(func, x, p, q):
    check_array(func, "x", x, ndim=2, shape=(p, q), layout=f"[{p}, {q}] (row-major [W; b])")


@capabilities(dask="yes")
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
    t = check_scalar(func, "num_timesteps", num_timesteps, positive=True, integer=True)
    return series_option1_kernel(xp, l_a, psi_a, l_g, psi_g, t, x)


def series_option1_kernel(xp, l_a, psi_a, l_g, psi_g, num_timesteps, x):
    """The unchecked kernel of :func:`series_option1_multiply_inverse`."""
    y = xp.matrix_transpose(l_a) @ x @ l_g
    y = y * _series_gamma(xp, psi_a[:, None] * psi_g[None, :], num_timesteps)
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


@capabilities(dask="yes")
def series_option2_multiply_inverse(p_a, k_a, mu_a, p_g, k_g, mu_g, num_timesteps, x):
    r"""Option-2 (:math:`T\to\infty`) inverse of the series block, TF ``FullyConnectedSeriesFB``.

    Per factor (``series_option2_quantities`` of :mod:`kfac_ref.factors`):
    :math:`P = C_1^\top\tilde C_0^{-1}` (time-reversed AR coefficient),
    :math:`\hat\Psi = \tilde C_0^{-1/2}C_1\tilde C_0^{-1/2}`,
    :math:`\hat\Psi^\top\hat\Psi = E\,\mathrm{diag}(\mu)E^\top`, :math:`K = \tilde C_0^{-1/2}E`.
    With :math:`\mathcal P = P_A\otimes P_G` and :math:`V_0 = \tilde A_0\otimes\tilde G_0`:

    .. math::

        \begin{aligned}
        F_\infty^{-1} &= \tfrac1T (I - \mathcal P^\top)(V_0 - \mathcal P V_0\mathcal P^\top)^{-1}
        (I - \mathcal P),\\
        (V_0 - \mathcal P V_0\mathcal P^\top)^{-1}
        &= (K_A\otimes K_G)\,\mathrm{diag}\big(1/(1 - \mu_A\otimes\mu_G)\big)(K_A\otimes K_G)^\top,
        \end{aligned}

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
    return series_option2_kernel(xp, p_a, k_a, mu_a, p_g, k_g, mu_g, t, x)


def series_option2_kernel(xp, p_a, k_a, mu_a, p_g, k_g, mu_g, t, x):
    """The unchecked kernel of :func:`series_option2_multiply_inverse`."""
    y = x - p_a @ x @ xp.matrix_transpose(p_g)
    y = xp.matrix_transpose(k_a) @ y @ k_g
    denom = 1.0 - mu_a[:, None] * mu_g[None, :]
    denom = xp.where(denom == 0.0, xp.ones_like(denom), denom)
    y = y / denom
    y = k_a @ y @ xp.matrix_transpose(k_g)
    y = y - xp.matrix_transpose(p_a) @ y @ p_g
    return y / t


