r"""Spatially uncorrelated activations (SUA) for convolution input factors (KFC Theorem 4).

The SUA approximation of Grosse & Martens (2016, §4.2) treats the activations at different
spatial offsets as uncorrelated, each with the same channel covariance :math:`\Sigma` and mean
:math:`\mu`:

.. math::

    \Omega_{\text{SUA}} = I_{|\Delta|} \otimes \Sigma \ (\oplus\, 0_{\text{bias}}) + m m^\top,
    \qquad m = [\mathbf 1_{|\Delta|} \otimes \mu;\ 1_{\text{bias}}].

TF K-FAC master's ``ConvInputSUAKroneckerFactor``; the KFC factors are in
:class:`~kfac_ref.factors.ConvInputKroneckerFactor`.
"""

from __future__ import annotations

import math

from .._backend import (
    KFACValueError,
    check_array,
    check_bool,
    check_int,
    check_option,
    check_scalar,
    check_symmetric,
    device_of,
    errors_named,
    kernel_of,
    namespace_of,
)
from .._support import capabilities
from ..averaging import MovingAverageVariable
from ..conv_geometry import ConvGeometry, is_channels_last, to_channels_last
from ..linalg import append_homog, compute_cov, damped_inverse, kron
from ._base import (
    DenseSquareMatrixFactor,
    as_towers,
    check_equal_batches,
    damping_key,
    damping_value,
    exp_value,
)

# --------------------------------------------------------------------------------------
# Spatially uncorrelated activations (SUA): TF master's ConvInputSUAKroneckerFactor
# --------------------------------------------------------------------------------------
SUA_ORDERS = ("channel_fastest", "tf")
"""Layouts of the SUA factor: ``"channel_fastest"`` matches the patch order
``(k_1, ..., k_r, C_in)`` of every other conv factor here; ``"tf"`` reproduces TF master's
``LinearOperatorKronecker([Σ, I_K])`` and ``tile(μ, [1, K])`` (channel slowest)."""


@capabilities(dask="yes")
def conv_input_sua_statistics(inputs, data_format="NHWC", subtract_mean=True):
    r"""Per-location channel statistics of a conv layer's inputs (SUA, KFC Theorem 4).

    .. math::

        \mu = \frac{1}{N|L|} \sum_{n,\ell} x_{n,\ell}, \qquad
        \Sigma = \frac{1}{N|L|} \sum_{n,\ell} x_{n,\ell} x_{n,\ell}^\top - \mu\mu^\top ,

    over every example and input location :math:`\ell` (padding and boundary effects are
    ignored).  TF computes both from ``compute_cov`` of the homogeneous pixels
    ``[x, 1]``; with ``subtract_mean=False`` (TF's ``ASSUME_ZERO_MEAN_ACTIVATIONS`` together
    with ``SUBTRACT_MEAN_CONTRIB_FROM_COV = False``) :math:`\Sigma` is the uncentred moment.

    Parameters
    ----------
    inputs : array ``[N, *spatial, C]`` (or channels first)
    data_format : str or None
    subtract_mean : bool

    Returns
    -------
    (sigma, mu) : (array [C, C], array [C])

    References
    ----------
    Grosse & Martens (2016), §4.2, Theorem 4; TF K-FAC ``ConvInputSUAKroneckerFactor``.
    """
    func = "conv_input_sua_statistics"
    xp = namespace_of(func, inputs=inputs)
    channels_last = _check_sua_inputs(func, inputs, data_format)
    check_bool(func, "subtract_mean", subtract_mean)
    return _conv_input_sua_statistics(xp, inputs, channels_last, subtract_mean)


def _check_sua_inputs(func, inputs, data_format, name="inputs"):
    check_array(func, name, inputs, min_ndim=3, layout="[N, *spatial, C]")
    channels_last = is_channels_last(func, data_format, inputs.ndim, array_name=name)
    if math.prod(inputs.shape) == 0:
        raise KFACValueError(f"{func}: {name} must have at least one pixel; got shape "
                             f"{tuple(inputs.shape)}.")
    return channels_last


@kernel_of(conv_input_sua_statistics)
def _conv_input_sua_statistics(xp, inputs, channels_last=True, subtract_mean=True):
    """Unchecked kernel: ``(Σ, μ)`` from the homogeneous pixels of ``inputs``."""
    x = to_channels_last(xp, inputs, channels_last)
    pixels = xp.reshape(x, (-1, x.shape[-1]))
    c = compute_cov.kernel(xp, append_homog.kernel(xp, pixels))
    mu = c[:-1, -1]
    sigma = c[:-1, :-1]
    if subtract_mean:
        sigma = sigma - mu[:, None] * mu[None, :]
    return sigma, mu


def _sua_mean_vector(xp, mu, k, has_bias, order, homog_value=1.0):
    if order == "channel_fastest":  # 1_K ⊗ μ
        m = xp.reshape(xp.broadcast_to(mu[None, :], (k, mu.shape[0])), (-1,))
    else:  # TF: tile(μ, [1, K]).reshape(-1) = μ ⊗ 1_K
        m = xp.reshape(xp.broadcast_to(mu[:, None], (mu.shape[0], k)), (-1,))
    if has_bias:
        m = xp.concat([m, homog_value * xp.ones_like(m[:1])], axis=0)
    return m


def _sua_block(xp, block, k, order):
    eye_k = xp.eye(k, dtype=block.dtype, device=device_of(block))
    # channel_fastest: I_K ⊗ B; TF's order: B ⊗ I_K (the one Kronecker product, linalg.kron)
    if order == "channel_fastest":
        return kron.kernel(xp, eye_k, block)
    return kron.kernel(xp, block, eye_k)


def _check_sua(func, sigma, mu, num_offsets, has_bias, damping, order):
    xp = namespace_of(func, sigma=sigma, mu=mu)
    check_symmetric(func, "sigma", sigma)  # a covariance; a transposed/garbled one is an error
    if mu is not None:
        check_array(func, "mu", mu, shape=(sigma.shape[0],), layout="[C]")
    num_offsets = check_int(func, "num_offsets", num_offsets, minimum=1)
    check_bool(func, "has_bias", has_bias)
    damping = check_scalar(func, "damping", damping, nonnegative=True, like={"sigma": sigma})
    check_option(func, "order", order, SUA_ORDERS)
    return xp, num_offsets, damping


@capabilities(dask="yes")
def conv_input_sua_factor(sigma, mu, num_offsets, has_bias=False, damping=0.0,
                          order="channel_fastest"):
    r"""Dense SUA input factor (KFC Theorem 4), damped.

    .. math::

        \Omega_{\text{SUA}} + \delta I = \big(I_{|\Delta|} \otimes (\Sigma + \delta I)\big)
            \oplus [\delta]_{\text{bias}} + m m^\top, \qquad
        m = [\mathbf 1_{|\Delta|} \otimes \mu;\ 1_{\text{bias}}],

    i.e. spatial offsets uncorrelated, every offset sharing the channel covariance
    :math:`\Sigma` and the mean :math:`\mu`; the homogeneous coordinate has second moment
    1 and cross moments :math:`\mu`.  ``mu=None`` drops the rank-one term (TF's
    ``ASSUME_ZERO_MEAN_ACTIVATIONS``).  With ``order="tf"`` the channel index is the slow
    one (:math:`(\Sigma + \delta I) \otimes I_{|\Delta|}`, :math:`\mu \otimes \mathbf 1`), as TF
    master builds it; that does not match the ``(k_h, k_w, C_{in})`` patch layout of the
    kernel (see the theory page *Convolutions: KFC, KFAC-expand and KFAC-reduce*), so TF's
    SUA block permutes the rows.

    Parameters
    ----------
    sigma : array [C, C]
    mu : array [C] or None
    num_offsets : int
        :math:`|\Delta| = \prod_i k_i`.
    has_bias : bool
    damping : float
    order : {"channel_fastest", "tf"}

    Returns
    -------
    array ``[|Δ|·C (+1), |Δ|·C (+1)]``

    References
    ----------
    Grosse & Martens (2016), §4.2, Theorem 4; TF K-FAC master
    ``ConvInputSUAKroneckerFactor._make_cov_linear_operator``.
    """
    func = "conv_input_sua_factor"
    xp, k, damping = _check_sua(func, sigma, mu, num_offsets, has_bias, damping, order)
    return _conv_input_sua_factor(xp, sigma, mu, k, has_bias, damping, order)


@kernel_of(conv_input_sua_factor)
def _conv_input_sua_factor(xp, sigma, mu, k, has_bias=False, damping=0.0,
                           order="channel_fastest"):
    """Unchecked kernel of :func:`conv_input_sua_factor`."""
    c = sigma.shape[0]
    block = _sua_block(xp, sigma + damping * xp.eye(c, dtype=sigma.dtype, device=device_of(sigma)),
                       k, order)
    if has_bias:
        col = xp.zeros((k * c, 1), dtype=sigma.dtype, device=device_of(sigma))
        corner = damping * xp.ones((1, 1), dtype=sigma.dtype, device=device_of(sigma))
        block = xp.concat([xp.concat([block, col], axis=1),
                           xp.concat([col.T, corner], axis=1)], axis=0)
    if mu is None:
        return block
    m = _sua_mean_vector(xp, mu, k, has_bias, order)
    return block + m[:, None] * m[None, :]


@capabilities(dask="yes")
def conv_input_sua_inverse(sigma, mu, num_offsets, has_bias=False, damping=0.0,
                           order="channel_fastest"):
    r"""Inverse of the damped SUA factor by Sherman–Morrison (TF master's formula).

    .. math::

        (B + m m^\top)^{-1} = B^{-1} - \frac{B^{-1} m\, m^\top B^{-1}}{1 + m^\top B^{-1} m},
        \qquad B^{-1} = \big(I_{|\Delta|} \otimes (\Sigma+\delta I)^{-1}\big) \oplus [1/\delta],

    with :math:`m^\top B^{-1} m = |\Delta|\, \mu^\top(\Sigma+\delta I)^{-1}\mu\ (+ 1/\delta)`.
    Only the :math:`C \times C` matrix is inverted (Cholesky,
    :func:`kfac_ref.linalg.damped_inverse`); the result is returned dense for reference use.

    Parameters
    ----------
    As :func:`conv_input_sua_factor`; ``damping`` must be positive when ``has_bias``.

    Returns
    -------
    array ``[|Δ|·C (+1), |Δ|·C (+1)]``

    Raises
    ------
    KFACValueError
        Zero damping with a bias (the bias block is :math:`\delta`), a singular damped
        :math:`\Sigma`.
    """
    func = "conv_input_sua_inverse"
    xp, k, damping = _check_sua(func, sigma, mu, num_offsets, has_bias, damping, order)
    if has_bias and damping <= 0:
        raise KFACValueError(f"{func}: damping must be positive when has_bias (the bias block "
                             f"of B is δ); got {damping}.")
    with errors_named(func):
        sigma_inv = damped_inverse.kernel(xp, (sigma + sigma.T) / 2.0, damping)
    return _sua_inverse_from_parts(xp, sigma_inv, mu, k, has_bias, damping, order)


def _sua_inverse_from_parts(xp, sigma_inv, mu, k, has_bias, damping, order):
    c = sigma_inv.shape[0]
    b_inv = _sua_block(xp, sigma_inv, k, order)
    if has_bias:
        col = xp.zeros((k * c, 1), dtype=sigma_inv.dtype, device=device_of(sigma_inv))
        corner = (1.0 / damping) * xp.ones((1, 1), dtype=sigma_inv.dtype,
                                           device=device_of(sigma_inv))
        b_inv = xp.concat([xp.concat([b_inv, col], axis=1),
                           xp.concat([col.T, corner], axis=1)], axis=0)
    if mu is None:
        return b_inv
    # B⁻¹m = [1_K ⊗ Σ⁻¹μ ; 1/δ]: the same structured vector with Σ⁻¹μ and homog 1/δ
    s_mu = sigma_inv @ mu
    b_inv_m = _sua_mean_vector(xp, s_mu, k, has_bias, order,
                               homog_value=(1.0 / damping) if has_bias else 1.0)
    quad = k * xp.sum(mu * s_mu) + ((1.0 / damping) if has_bias else 0.0)  # 0-d, no sync
    return b_inv - b_inv_m[:, None] * b_inv_m[None, :] / (1.0 + quad)


@capabilities(dask="yes")
class ConvInputSUAKroneckerFactor(DenseSquareMatrixFactor):
    r"""TF master's ``ConvInputSUAKroneckerFactor``: the SUA input factor from moving
    averages of the channel covariance :math:`\Sigma` and mean :math:`\mu`.

    .. math::

        \text{cov} = \mathrm{EMA}[\Sigma], \quad \text{mu} = \mathrm{EMA}[\mu], \quad
        \Omega_{\text{SUA}} = I_{|\Delta|} \otimes \text{cov} \ (\oplus 0) + m m^\top .

    Only the inverse (power :math:`-1`) can be registered; it is computed at
    :meth:`update_inverses` by Sherman–Morrison from the cached
    :math:`(\text{cov} + \delta I)^{-1}` and the mean at that time (stale in between), and
    served dense by :meth:`get_matpower`.  Power 1 is fresh.  Cholesky factors are not
    supported (TF raises too).

    Parameters
    ----------
    filter_shape : sequence of int
    has_bias : bool
    data_format : str or None
    assume_zero_mean_activations : bool
        TF's ``ASSUME_ZERO_MEAN_ACTIVATIONS`` (default False: the mean is tracked).
    subtract_mean_contrib_from_cov : bool
        TF's ``SUBTRACT_MEAN_CONTRIB_FROM_COV`` (used only with zero-mean activations).
    order : {"channel_fastest", "tf"}
        Layout, see :func:`conv_input_sua_factor` (TF's order is available to reproduce it).
    zero_debias : bool
    """

    def __init__(self, filter_shape, has_bias=False, data_format="NHWC",
                 assume_zero_mean_activations=False, subtract_mean_contrib_from_cov=True,
                 order="channel_fastest", **kwargs):
        super().__init__(**kwargs)
        func = type(self).__name__
        filter_shape = ConvGeometry.check_options(func, filter_shape)
        is_channels_last(func, data_format, len(filter_shape))
        check_option(func, "order", order, SUA_ORDERS)
        self._set(filter_shape=filter_shape, num_offsets=math.prod(filter_shape[:-2]),
                  in_channels=filter_shape[-2], has_bias=check_bool(func, "has_bias", has_bias),
                  data_format=data_format,
                  assume_zero_mean_activations=check_bool(
                      func, "assume_zero_mean_activations", assume_zero_mean_activations),
                  subtract_mean_contrib_from_cov=check_bool(
                      func, "subtract_mean_contrib_from_cov", subtract_mean_contrib_from_cov),
                  order=order, _mu_avg=None)

    def _stats(self, inputs):
        func = f"{self.name}.update_cov"
        towers = as_towers(func, "inputs", inputs)
        check_equal_batches(func, "inputs", towers)
        subtract = (not self.assume_zero_mean_activations
                    or self.subtract_mean_contrib_from_cov)
        stats = []
        for x in towers:
            xp = namespace_of(func, inputs=x)
            channels_last = _check_sua_inputs(func, x, self.data_format)
            c = x.shape[-1] if channels_last else x.shape[1]
            if c != self.in_channels:
                raise KFACValueError(f"{func}: inputs and filter_shape must agree on "
                                     f"in_channels; got {c} and {self.filter_shape}.")
            stats.append(_conv_input_sua_statistics(xp, x, channels_last, subtract))
        return stats

    def _contributions(self, inputs):
        return (tuple(s for s, _ in self._stats(inputs)),)

    def update_cov(self, inputs, *, ema_decay, ema_weight=1.0):
        r"""Update the averages of :math:`\Sigma` and (unless zero-mean) :math:`\mu`, both
        averaged over towers first.

        .. math::

            \Sigma \leftarrow \mathrm{EMA}\big[\tfrac{1}{n_t}\textstyle\sum_t \Sigma_t\big], \quad
            \mu \leftarrow \mathrm{EMA}\big[\tfrac{1}{n_t}\textstyle\sum_t \mu_t\big]
        """
        stats = self._stats(inputs)
        sigma, mu = stats[0]
        for s_t, m_t in stats[1:]:  # towers averaged
            sigma, mu = sigma + s_t, mu + m_t
        sigma, mu = sigma / float(len(stats)), mu / float(len(stats))
        cov_avg = self._cov_avg if self._cov_avg is not None else self._fresh_average(sigma)
        changes = {"_cov_avg": cov_avg.update(sigma, ema_decay, ema_weight)}
        if not self.assume_zero_mean_activations:
            avg = self._mu_avg
            if avg is None:
                avg = MovingAverageVariable.zeros_like(mu, zero_debias=self.zero_debias)
            changes["_mu_avg"] = avg.update(mu, ema_decay, ema_weight)
        return self._evolve(**changes)

    @property
    def mu(self):
        """The moving average of :math:`\\mu` (``None`` with zero-mean activations)."""
        if self.assume_zero_mean_activations:
            return None
        return None if self._mu_avg is None else self._mu_avg.value

    def register_matpower(self, exp, damping):
        """Only ``exp = -1`` (and the uncached 1) are supported."""
        if exp_value(f"{self.name}.register_matpower", exp) not in (1.0, -1.0):
            raise KFACValueError(f"{self.name}.register_matpower: exp must be -1 (SUA supports "
                                 f"only inverses); got {exp}.")
        return super().register_matpower(exp, damping)

    def register_cholesky(self, damping):
        r"""Not supported: the SUA factor is used through its inverse (TF raises too).

        .. math:: L L^\top = \Omega_{\text{SUA}} + \delta I \ \text{(not maintained)}
        """
        raise KFACValueError(f"{self.name}.register_cholesky: the SUA factor must be used "
                             "through its inverse; got a Cholesky request (TF raises too).")

    register_cholesky_inverse = register_cholesky

    @property
    def uses_eigendecomposition(self):
        return False

    def _inverse_cache(self):
        func = f"{self.name}.update_inverses"
        cache = {}
        cov = self.cov
        for exp, key in self._matpower_regs:
            lam = damping_value(func, key, cov)
            with errors_named(func):
                sigma_inv = damped_inverse.kernel(namespace_of(func, cov=cov), cov, lam)
            cache[("matpower", exp, key)] = (sigma_inv, self.mu, lam)
        return cache

    def get_matpower(self, exp, damping):
        r"""Dense :math:`\Omega_{\text{SUA}} + \delta I` (power 1, fresh) or its cached
        Sherman–Morrison inverse (power −1)."""
        func = f"{self.name}.get_matpower"
        cov = self.cov
        xp = namespace_of(func, cov=cov)
        if exp_value(func, exp) == 1.0:
            lam = damping_value(func, damping_key(func, damping), cov)
            return _conv_input_sua_factor(xp, cov, self.mu, self.num_offsets, self.has_bias,
                                          lam, self.order)
        cached = super().get_matpower(exp, damping)
        if not isinstance(cached, tuple):  # registered but never updated: zeros
            dim = self.num_offsets * self.in_channels + self.has_bias
            return xp.zeros((dim, dim), dtype=self.cov.dtype, device=device_of(self.cov))
        sigma_inv, mu, lam = cached
        if self.has_bias and lam <= 0:
            raise KFACValueError(f"{func}: damping must be positive with a bias; got {lam}.")
        return _sua_inverse_from_parts(xp, sigma_inv, mu, self.num_offsets, self.has_bias,
                                       lam, self.order)
