"""TF's series (RNN) Fisher block :class:`FullyConnectedSeriesFB` (Martens, Ba & Johnson
2018).
"""

from __future__ import annotations

from ... import factors
from ..._backend import (
    KFACValueError,
    check_array,
    check_bool,
    check_int,
    check_option,
    describe,
    namespace_of,
)
from ..._support import DASK_NO_EIGH, capabilities
from .._math import (
    check_factor,
    normalize_damping,
    series_option1_kernel,
    series_option2_kernel,
)
from ._base import (
    PI_TYPES,
    FisherBlock,
    Mat2dVector,
    compute_pi_adjusted_damping,
    cov_of,
    pi_split,
)


# --------------------------------------------------------------------------------------
# Series (RNN) block
# --------------------------------------------------------------------------------------
@capabilities(array_free=True)
class SeriesFBApproximation:
    r"""TF's option names for :class:`FullyConnectedSeriesFB`.

    ``option1``: finite :math:`T`, symmetric :math:`V_1` (:math:`F_T`); ``option2``:
    :math:`T \to \infty` (:math:`F_\infty`).
    """

    option1 = 1
    option2 = 2


@capabilities(dask=DASK_NO_EIGH)
class FullyConnectedSeriesFB(Mat2dVector, FisherBlock):
    r"""TF ``FullyConnectedSeriesFB``: a dense layer used over :math:`T` time steps (RNN).

    .. math::

        \text{option 1: } F_T^{-1} v, \qquad \text{option 2: } F_\infty^{-1} v

    (:func:`~kfac_ref.blocks.series_option1_multiply_inverse`,
    :func:`~kfac_ref.blocks.series_option2_multiply_inverse`), with the per-factor quantities
    of :func:`kfac_ref.factors.series_option1_quantities` /
    :func:`kfac_ref.factors.series_option2_quantities` computed with the damping
    :math:`(\delta_A, \delta_G)` = π split of :math:`\lambda/T` (π from :math:`C_0^A, C_0^G`).
    Only the power :math:`-1` exists (TF raises ``NotImplementedError`` for others).

    Parameters
    ----------
    input_factor, output_factor : arrays [n, n] (:math:`C_0`) or factors with ``get_cov()``
        and ``get_cov_dt1()`` (:class:`kfac_ref.factors.FullyConnectedMultiKF`).
    damping : float or callable
    num_uses : int
        :math:`T`.
    has_bias : bool
    option : {1, 2}
        Default 2, as TF.
    input_cov_dt1, output_cov_dt1 : arrays [n, n], optional
        :math:`C_1` when the factors are given as arrays.
    option1_eig_method : {"self_adjoint", "eigh", "svd"}
        TF's ``posdef_eig`` (default, takes :math:`|\psi|`) or the signed eigenvalues.
    pi_type : str
    """

    def __init__(self, input_factor, output_factor, damping, num_uses, has_bias=False,
                 option=SeriesFBApproximation.option2, *, input_cov_dt1=None,
                 output_cov_dt1=None, option1_eig_method="self_adjoint", pi_type="tracenorm"):
        func = type(self).__name__
        self._a0 = cov_of(func, "input_factor", input_factor)
        self._g0 = cov_of(func, "output_factor", output_factor)
        self._a1 = input_cov_dt1 if input_cov_dt1 is not None else _cov_dt1(
            func, "input_factor", input_factor)
        self._g1 = output_cov_dt1 if output_cov_dt1 is not None else _cov_dt1(
            func, "output_factor", output_factor)
        namespace_of(func, input_factor=self._a0, output_factor=self._g0,
                     input_cov_dt1=self._a1, output_cov_dt1=self._g1)
        for name, m in (("input_factor", self._a0), ("output_factor", self._g0)):
            check_factor(func, name, m)
            if m.ndim != 2:
                raise KFACValueError(f"{func}: {name} must be a 2-D matrix; got "
                                     f"{describe(m)}.")
        check_array(func, "input_cov_dt1", self._a1, shape=tuple(self._a0.shape))
        check_array(func, "output_cov_dt1", self._g1, shape=tuple(self._g0.shape))
        self.num_uses = check_int(func, "num_uses", num_uses, minimum=1)
        self.has_bias = check_bool(func, "has_bias", has_bias)
        self.kernel_shape = (self._a0.shape[0] - (1 if self.has_bias else 0), self._g0.shape[0])
        if option not in (1, 2):
            raise KFACValueError(f"{func}: option must be 1 or 2 (SeriesFBApproximation); got "
                                 f"{option!r}.")
        self.option = option
        self.option1_eig_method = check_option(func, "option1_eig_method", option1_eig_method,
                                               factors.OPTION1_EIG_METHODS)
        self.pi_type = check_option(func, "pi_type", pi_type, PI_TYPES)
        self._keep_damping(func, damping, {"input_factor": self._a0})

    @property
    def damping(self):
        r"""The normalised damping :math:`\lambda / T`."""
        return normalize_damping(self._given_damping(),
                                 self.num_uses)

    def factor_dampings(self):
        r"""The π split of :math:`\lambda/T` between the factors.

        .. math:: (\delta_A, \delta_G) = (\pi\sqrt{\lambda/T},\ \sqrt{\lambda/T}/\pi)
        """
        return compute_pi_adjusted_damping(self._a0, self._g0, self.damping ** 0.5,
                                           self.pi_type)

    def multiply_matpower(self, vector, exp):
        r""":math:`\tilde F^{-1} v` (``exp`` must be −1).

        .. math:: F_T^{-1} v \ \text{or}\ F_\infty^{-1} v
        """
        func = f"{type(self).__name__}.multiply_matpower"
        exp = self._exp(exp)
        if exp != -1.0:
            raise KFACValueError(f"{func}: exp must be -1 (FullyConnectedSeriesFB only supports "
                                 f"inverse multiplications); got {exp}.")
        xp, mat, back = self._to_mat2d(func, vector, self._a0)
        # the statistics were validated at construction: kernels only, errors named here
        d_a, d_g = pi_split(xp, self._a0, self._g0, self.damping ** 0.5, self.pi_type)
        t = self.num_uses
        if self.option == 1:
            quantities = factors.series_option1_quantities.kernel
            l_a, psi_a = quantities(xp, self._a0, self._a1, d_a, self.option1_eig_method,
                                    func=func)
            l_g, psi_g = quantities(xp, self._g0, self._g1, d_g, self.option1_eig_method,
                                    func=func)
            return back(series_option1_kernel(xp, l_a, psi_a, l_g, psi_g, t, mat))
        quantities = factors.series_option2_quantities.kernel
        p_a, k_a, mu_a = quantities(xp, self._a0, self._a1, d_a, func=func)
        p_g, k_g, mu_g = quantities(xp, self._g0, self._g1, d_g, func=func)
        return back(series_option2_kernel(xp, p_a, k_a, mu_a, p_g, k_g, mu_g, t, mat))

    def multiply_cholesky(self, vector, transpose=False):
        r"""Not defined by TF (``NotImplementedError``); raises.  The block has no Kronecker
        Cholesky factor: :math:`F_T \ne (L_A \otimes L_G)(L_A \otimes L_G)^\top`.
        """
        raise KFACValueError(f"{type(self).__name__}.multiply_cholesky: the series block has "
                             "no Cholesky factor (TF raises NotImplementedError); use "
                             "multiply_inverse.")

    def multiply_cholesky_inverse(self, vector, transpose=False):
        r"""Not defined by TF (``NotImplementedError``); raises (see
        :meth:`multiply_cholesky`).

        .. math:: L^{-1} \ \text{undefined}
        """
        raise KFACValueError(f"{type(self).__name__}.multiply_cholesky_inverse: the series "
                             "block has no Cholesky factor (TF raises NotImplementedError); "
                             "use multiply_inverse.")

    def full_fisher_block(self):
        r"""Not defined by TF (``_renorm_coeff`` asserts); raises.  The block exists only
        through its inverse,

        .. math:: F_T^{-1} = V_0^{-1/2}\,\gamma_T(\hat\Psi)\,V_0^{-1/2}
        """
        raise KFACValueError(f"{type(self).__name__}.full_fisher_block: the series block has "
                             "no Kronecker form (TF asserts); use multiply_inverse.")


def _cov_dt1(func, name, factor):
    if hasattr(factor, "get_cov_dt1"):
        return factor.get_cov_dt1()
    raise KFACValueError(f"{func}: {name.replace('factor', 'cov_dt1')} must be given when "
                         f"{name} is an array (or pass a factor with get_cov_dt1()); got "
                         "none.")
