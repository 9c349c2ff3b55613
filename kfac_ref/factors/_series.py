r"""Factors of a fully-connected layer used several times (RNN time steps): TF K-FAC's
``FullyConnectedMultiKF`` and the "series" quantities of its options 1 and 2.

Data of :math:`T` uses are folded time-major, ``[T·B, d]`` (row :math:`t B + b`), or given
as ``[T, B, d]``.  With the homogeneous coordinate appended (``has_bias``):

.. math::

    C_0 = \frac{1}{TB} \sum_{t,b} x_{t,b} x_{t,b}^\top, \qquad
    C_1 = \frac{1}{TB} \sum_{t=0}^{T-2} \sum_b x_{t+1,b}\, x_{t,b}^\top .

:math:`C_1` is normalised by :math:`TB`, not :math:`(T-1)B`: that is zero padding at the
sequence ends, which keeps the implied block-Toeplitz Fisher PSD (Martens, Ba & Johnson 2018,
App. B.2).  See the theory page *Layers used many times: recurrent networks* for how the
block uses :math:`(L, \psi)` and :math:`(P, K, \mu)`.
"""

from __future__ import annotations

from .._backend import (
    KFACValueError,
    check_array,
    check_int,
    check_namespace_has,
    check_option,
    check_scalar,
    check_square,
    check_symmetric,
    errors_named,
    kernel_of,
    namespace_of,
    optional_linalg,
)
from .._support import DASK_NO_EIGH, capabilities
from ..averaging import MovingAverageVariable
from ..linalg import append_homog, compute_cov, damped_matpower
from ._base import as_sources_towers, check_bool, check_equal_batches, damping_key, damping_value
from ._dense import FullyConnectedKroneckerFactor, fold_uses, fully_connected_kronecker_factor

OPTION1_EIG_METHODS = ("self_adjoint", "svd", "eigh")
"""How option 1 decomposes :math:`\\hat\\Psi`: TF's ``posdef_eig`` methods
(``"self_adjoint"``: eigh then :math:`|\\psi|`, TF's default; ``"svd"``: singular values and
left singular vectors) or ``"eigh"`` (signed eigenvalues, the option-1 math itself)."""


def _check_uses(func, tensor, num_uses, name="tensor"):
    check_array(func, name, tensor, ndim=(2, 3), layout="[T·B, d] or [T, B, d]")
    if tensor.ndim == 3 and tensor.shape[0] != num_uses:
        raise KFACValueError(f"{func}: {name} [T, B, d] must have T = num_uses = {num_uses}; "
                             f"got shape {tuple(tensor.shape)}.")
    rows = tensor.shape[0] * (tensor.shape[1] if tensor.ndim == 3 else 1)
    if rows == 0 or rows % num_uses:
        raise KFACValueError(
            f"{func}: the folded {name} must have a positive multiple of num_uses = "
            f"{num_uses} rows; got {rows}."
        )


@capabilities(dask="yes")
def fully_connected_multi_kf_cov_dt1(tensor, num_uses, has_bias=False):
    r"""Lag-one cross moment of a multiply-used dense layer's rows.

    .. math::

        C_1 = \frac{1}{T B}\, X_{[B:]}^\top X_{[:-B]}
            = \frac{1}{TB} \sum_{t=0}^{T-2} \sum_{b} \bar x_{t+1,b}\, \bar x_{t,b}^\top ,

    with rows folded time-major (row :math:`tB + b`), the homogeneous 1 appended last when
    ``has_bias``, and the normaliser :math:`TB` (zero padding; not symmetrised).

    Parameters
    ----------
    tensor : array [T·B, d] or [T, B, d]
    num_uses : int
        :math:`T \ge 1` (with :math:`T = 1` the result is zero).
    has_bias : bool

    Returns
    -------
    array [d(+1), d(+1)]
        ``future^T · present`` (not symmetric in general).

    Raises
    ------
    KFACValueError, KFACTypeError
        Row count not a multiple of ``num_uses``, wrong rank, non-finite input.

    References
    ----------
    Martens, Ba & Johnson (2018), §3 and App. B.2; TF K-FAC
    ``FullyConnectedMultiKF._compute_new_cov_dt1``.
    """
    func = "fully_connected_multi_kf_cov_dt1"
    xp = namespace_of(func, tensor=tensor)
    num_uses = check_int(func, "num_uses", num_uses, minimum=1)
    check_bool(func, "has_bias", has_bias)
    _check_uses(func, tensor, num_uses)
    return _fully_connected_multi_kf_cov_dt1(xp, tensor, num_uses, has_bias)


@kernel_of(fully_connected_multi_kf_cov_dt1)
def _fully_connected_multi_kf_cov_dt1(xp, tensor, num_uses, has_bias=False):
    """Unchecked kernel: ``X[B:]ᵀ X[:-B] / (TB)`` of the folded (homogeneous) rows."""
    x = fold_uses(xp, tensor)
    if has_bias:
        x = append_homog.kernel(xp, x)
    total = x.shape[0]
    b = total // num_uses
    return compute_cov.kernel(xp, x[b:, :], x[: total - b, :], total)


def _check_pair(func, cov, cov_dt1, damping, threshold):
    """Validate the series inputs under the public name, before any eigendecomposition."""
    xp = namespace_of(func, cov=cov, cov_dt1=cov_dt1)
    check_symmetric(func, "cov", cov)
    check_square(func, "cov_dt1", cov_dt1)
    if cov.shape != cov_dt1.shape:
        raise KFACValueError(f"{func}: cov and cov_dt1 must have the same shape; got "
                             f"{tuple(cov.shape)} and {tuple(cov_dt1.shape)}.")
    check_namespace_has(func, "cov", cov, "linalg.eigh",
                        "the inverse square root of the damped cov")
    like = {"cov": cov}
    damping = check_scalar(func, "damping", damping, nonnegative=True, like=like)
    threshold = check_scalar(func, "eigenvalue_clipping_threshold", threshold,
                             nonnegative=True, like=like)
    return xp, damping, threshold


def _inv_sqrt_c0(xp, cov, damping, threshold, func):
    """Symmetrised :math:`(C_0 + \\delta I)^{-1/2}` from the clipped eigendecomposition."""
    with errors_named(func):
        m = damped_matpower.kernel(xp, cov, -0.5, damping, threshold)
    return (m + m.T) / 2.0


@capabilities(dask=DASK_NO_EIGH)
def series_option1_quantities(cov, cov_dt1, damping, eig_method="self_adjoint",
                              eigenvalue_clipping_threshold=0.0):
    r"""Option-1 quantities :math:`(L, \psi)` of one factor (TF ``register_option1quants``).

    .. math::

        \begin{aligned}
        C_{0,\delta}^{-1/2} &= V \mathrm{diag}\big((\max(e,c) + \delta)^{-1/2}\big) V^\top,
            \qquad C_1^{s} = \tfrac12 (C_1 + C_1^\top), \\
        \hat\Psi &= C_{0,\delta}^{-1/2}\, C_1^{s}\, C_{0,\delta}^{-1/2}
            = U \mathrm{diag}(\psi) U^\top, \\
        L &= C_{0,\delta}^{-1/2} U,
        \end{aligned}

    so that :math:`L^\top (C_0 + \delta I) L = I` and
    :math:`L^\top C_1^{s} L = \mathrm{diag}(\psi)`.
    ``damping`` is the :math:`\delta` added to :math:`C_0` (the block has already divided
    :math:`\lambda` by :math:`T` and split it with π).

    Choices, as TF: :math:`C_1` is symmetrised (option 1 assumes :math:`V_1` symmetric);
    with ``eig_method="self_adjoint"`` (TF's default ``posdef_eig``) the returned
    :math:`\psi` are the **absolute values** of the eigenvalues, which differs from the
    option-1 math when :math:`\hat\Psi` is indefinite (Martens, Ba & Johnson 2018, §3.5);
    ``"eigh"`` keeps the signs; ``"svd"`` is TF's alternative (singular values, left
    singular vectors).

    Parameters
    ----------
    cov : array [n, n]
        :math:`C_0` (symmetric PSD).
    cov_dt1 : array [n, n]
        :math:`C_1`.
    damping : float
        :math:`\delta \ge 0`.
    eig_method : {"self_adjoint", "svd", "eigh"}
    eigenvalue_clipping_threshold : float
        :math:`c` for the eigenvalues of :math:`C_0`.

    Returns
    -------
    (L, psi) : (array [n, n], array [n])

    Raises
    ------
    KFACValueError, KFACTypeError
        Shape mismatch, non-symmetric ``cov``, negative damping or clipping threshold,
        non-finite or non-floating inputs, mixed namespaces, an unknown ``eig_method``.

    References
    ----------
    Martens, Ba & Johnson (2018), §3.5 (option 1); TF K-FAC
    ``FullyConnectedMultiKF.make_inverse_update_ops``.
    """
    func = "series_option1_quantities"
    xp, damping, c = _check_pair(func, cov, cov_dt1, damping, eigenvalue_clipping_threshold)
    check_option(func, "eig_method", eig_method, OPTION1_EIG_METHODS)
    return _series_option1_quantities(xp, cov, cov_dt1, damping, eig_method, c, func=func)


@kernel_of(series_option1_quantities)
def _series_option1_quantities(xp, cov, cov_dt1, damping, eig_method="self_adjoint",
                               threshold=0.0, *, func="series_option1_quantities"):
    inv_sqrt = _inv_sqrt_c0(xp, cov, damping, threshold, func)
    c1 = (cov_dt1 + cov_dt1.T) / 2.0
    hpsi = inv_sqrt @ c1 @ inv_sqrt
    if eig_method == "svd":
        u, psi, _ = optional_linalg(xp, "svd")(hpsi)
    else:
        psi, u = optional_linalg(xp, "eigh")((hpsi + hpsi.T) / 2.0)
        if eig_method == "self_adjoint":
            psi = xp.abs(psi)
    return inv_sqrt @ u, psi


@capabilities(dask=DASK_NO_EIGH)
def series_option2_quantities(cov, cov_dt1, damping, eigenvalue_clipping_threshold=0.0):
    r"""Option-2 quantities :math:`(P, K, \mu)` of one factor (TF ``register_option2quants``).

    .. math::

        \begin{aligned}
        \hat\Psi &= C_{0,\delta}^{-1/2} C_1 C_{0,\delta}^{-1/2}
            = W \mathrm{diag}(\sqrt\mu) E^\top \quad (\text{SVD}), \qquad
            \mu \leftarrow \min(\mu, 1), \\
        P &= C_1^\top C_{0,\delta}^{-1}, \qquad K = C_{0,\delta}^{-1/2} E,
        \end{aligned}

    so that :math:`K^\top (C_0 + \delta I) K = I` and
    :math:`K^\top C_1^\top (C_0 + \delta I)^{-1} C_1 K = \mathrm{diag}(\mu)` (before
    clipping).  :math:`C_1` is used **unsymmetrised** and :math:`P` is the time-reversed AR
    coefficient (TF's choice; it gives the same Fisher: Martens, Ba & Johnson 2018, App. B).
    :math:`\mu` is clipped at 1, as TF does, because inconsistent or noisy :math:`C_0, C_1`
    can push it above.

    Parameters
    ----------
    cov, cov_dt1 : array [n, n]
    damping : float
        :math:`\delta \ge 0` added to :math:`C_0`.
    eigenvalue_clipping_threshold : float

    Returns
    -------
    (P, K, mu) : (array [n, n], array [n, n], array [n])

    Raises
    ------
    KFACValueError
        As :func:`series_option1_quantities`.

    References
    ----------
    Martens, Ba & Johnson (2018), §3.5 (option 2); TF K-FAC
    ``FullyConnectedMultiKF.make_inverse_update_ops``.
    """
    func = "series_option2_quantities"
    xp, damping, c = _check_pair(func, cov, cov_dt1, damping, eigenvalue_clipping_threshold)
    return _series_option2_quantities(xp, cov, cov_dt1, damping, c, func=func)


@kernel_of(series_option2_quantities)
def _series_option2_quantities(xp, cov, cov_dt1, damping, threshold=0.0, *,
                               func="series_option2_quantities"):
    inv_sqrt = _inv_sqrt_c0(xp, cov, damping, threshold, func)
    inv_sqrt_c1 = inv_sqrt @ cov_dt1
    hpsi = inv_sqrt_c1 @ inv_sqrt
    _, sqrt_mu, e_t = optional_linalg(xp, "svd")(hpsi)
    mu = xp.minimum(sqrt_mu * sqrt_mu, xp.ones_like(sqrt_mu))
    p = inv_sqrt_c1.T @ inv_sqrt
    k = inv_sqrt @ e_t.T
    return p, k, mu


@capabilities(dask="yes")
class FullyConnectedMultiKF(FullyConnectedKroneckerFactor):
    r"""TF K-FAC's ``FullyConnectedMultiKF``: a dense factor for ``num_uses`` uses, with the
    optional lag-one moment and the option-1/2 series quantities.

    .. math::

        \text{cov} = \mathrm{EMA}[C_0], \qquad \text{cov\_dt1} = \mathrm{EMA}[C_1]
        \ (\text{same decay, weight and debiasing}).

    :meth:`register_cov_dt1` turns the :math:`C_1` average on (TF needs it registered
    before the variables exist; here it starts at the next :meth:`update_cov`).
    :meth:`register_option1quants` / :meth:`register_option2quants` register
    :func:`series_option1_quantities` / :func:`series_option2_quantities` per damping; they
    are recomputed (from the current ``cov``/``cov_dt1``) by :meth:`update_inverses` and
    served stale in between.  When any are registered the factor's matrix powers also take
    the eigen path (TF computes the eigendecomposition for them first).  Unlike TF, option
    1 and option 2 with the same damping do not clash and option 2 always sees the
    unsymmetrised :math:`C_1` (PEERS: TF's variable-name clash / shared symmetrised C1).

    Data for :meth:`update_cov`: ``tensors``, an array or sources × towers of
    ``[T·B, d]`` / ``[T, B, d]`` arrays.

    Parameters
    ----------
    num_uses : int
    has_bias : bool
    option1_eig_method : {"self_adjoint", "svd", "eigh"}
    zero_debias, eigenvalue_decomposition_threshold, eigenvalue_clipping_threshold
    """

    def __init__(self, num_uses, has_bias=False, option1_eig_method="self_adjoint", **kwargs):
        super().__init__(has_bias=has_bias, **kwargs)
        func = type(self).__name__
        self._set(num_uses=check_int(func, "num_uses", num_uses, minimum=1),
                  option1_eig_method=check_option(func, "option1_eig_method",
                                                  option1_eig_method, OPTION1_EIG_METHODS),
                  _make_cov_dt1=False, _cov_dt1_avg=None,
                  _option1_regs=(), _option2_regs=())

    def _checked(self, func, tensors):
        """``tensors`` as sources × towers, each tensor checked once."""
        st = as_sources_towers(func, "tensors", tensors)
        for src in st:
            check_equal_batches(func, "tensors", src, axis=src[0].ndim - 2)
            for t in src:
                namespace_of(func, tensors=t)
                _check_uses(func, t, self.num_uses, "tensors")
        return st

    def _contributions(self, tensors, _checked=None):
        st = self._checked(f"{self.name}.update_cov", tensors) if _checked is None else _checked
        return tuple(tuple(fully_connected_kronecker_factor.kernel(
            namespace_of(self.name, tensors=t), t, self.has_bias) for t in src) for src in st)

    def _new_cov_dt1(self, st):
        total = None
        for src in st:
            for t in src:
                c = _fully_connected_multi_kf_cov_dt1(namespace_of(self.name, tensors=t), t,
                                                      self.num_uses, self.has_bias)
                total = c if total is None else total + c
        return total / float(len(st[0]))

    def compute_new_cov_dt1(self, tensors):
        r"""Batch :math:`C_1`: sources summed, towers averaged.

        .. math:: \frac{1}{n_{\text{towers}}} \sum_s \sum_t C_1(s, t)
        """
        return self._new_cov_dt1(self._checked(f"{self.name}.compute_new_cov_dt1", tensors))

    def register_cov_dt1(self):
        """Return a factor that also averages :math:`C_1`."""
        return self._evolve(_make_cov_dt1=True)

    def update_cov(self, tensors, *, ema_decay, ema_weight=1.0):
        st = self._checked(f"{self.name}.update_cov", tensors)  # each tensor checked once
        with_c1 = self
        if self._make_cov_dt1:  # C_1's average first, then the base class's of C_0
            c1 = self._new_cov_dt1(st)
            avg = self._cov_dt1_avg
            if avg is None:
                avg = MovingAverageVariable.zeros_like(c1, zero_debias=self.zero_debias)
            with_c1 = self._evolve(_cov_dt1_avg=avg.update(c1, ema_decay, ema_weight))
        return super(FullyConnectedMultiKF, with_c1).update_cov(
            tensors, ema_decay=ema_decay, ema_weight=ema_weight, _checked=st)

    update_cov.__doc__ = FullyConnectedKroneckerFactor.update_cov.__doc__

    @property
    def cov_dt1(self):
        """The moving average of :math:`C_1`."""
        return self._average_value(
            "cov_dt1", self._cov_dt1_avg, "register_cov_dt1() and update_cov() must have "
            "been called; got a factor without C1 statistics")

    def get_cov_dt1(self):
        """Alias of :attr:`cov_dt1`."""
        return self.cov_dt1

    def register_option1quants(self, damping):
        """Return a factor that maintains :func:`series_option1_quantities` for ``damping``."""
        key = damping_key(f"{self.name}.register_option1quants", damping)
        return self._registered("_option1_regs", key)

    def register_option2quants(self, damping):
        """Return a factor that maintains :func:`series_option2_quantities` for ``damping``."""
        key = damping_key(f"{self.name}.register_option2quants", damping)
        return self._registered("_option2_regs", key)

    @property
    def _needs_eigendecomp(self):
        return bool(self._option1_regs or self._option2_regs)

    def _inverse_cache(self):
        cache = super()._inverse_cache()
        if self._option1_regs or self._option2_regs:
            func = f"{self.name}.update_inverses"
            cov, c1 = self.cov, self.cov_dt1
            xp = namespace_of(func, cov=cov, cov_dt1=c1)
            for key in self._option1_regs:
                cache[("option1", None, key)] = _series_option1_quantities(
                    xp, cov, c1, damping_value(func, key, cov), self.option1_eig_method,
                    self.eigenvalue_clipping_threshold, func=func)
            for key in self._option2_regs:
                cache[("option2", None, key)] = _series_option2_quantities(
                    xp, cov, c1, damping_value(func, key, cov), self.eigenvalue_clipping_threshold,
                    func=func)
        return cache

    def _get_quants(self, func, kind, damping, regs):
        key = damping_key(func, damping)
        if key not in regs:
            raise KFACValueError(f"{func}: the damping must be registered first; got an "
                                 f"unregistered damping {key[1]!r}.")
        value = self._cache.get((kind, None, key))
        if value is None:
            raise KFACValueError(f"{func}: update_inverses() must run before the quantities "
                                 "are read; got a factor that never ran it.")
        return value

    def get_option1quants(self, damping):
        r"""The cached :math:`(L, \psi)` for ``damping`` (stale until :meth:`update_inverses`)."""
        return self._get_quants(f"{self.name}.get_option1quants", "option1", damping,
                                self._option1_regs)

    def get_option2quants(self, damping):
        r"""The cached :math:`(P, K, \mu)` for ``damping``."""
        return self._get_quants(f"{self.name}.get_option2quants", "option2", damping,
                                self._option2_regs)
