"""TF's Kronecker-product Fisher blocks: :class:`KroneckerProductFB` and its dense, conv,
embedding and multi-use subclasses.
"""

from __future__ import annotations

import math

from ... import factors
from ..._backend import (
    KFACValueError,
    check_array,
    check_bool,
    check_int,
    check_option,
    check_scalar,
    errors_named,
    eye_like,
    namespace_of,
)
from ..._support import capabilities
from ...linalg import (
    ZERO_FACTOR_FALLBACKS,
    kron,
    kron_factored_apply,
    kron_factored_cholesky_apply,
    kron_factored_powers,
)
from .._math import (
    check_factor,
    normalize_damping,
    validated_internals,
)
from ._base import (
    PI_TYPES,
    FisherBlock,
    Mat2dVector,
    check_conv_data,
    check_rows_data,
    compute_pi_adjusted_damping,
    cov_of,
    norm_of_pi_type,
    pi_split,
)


# --------------------------------------------------------------------------------------
# Kronecker-product blocks
# --------------------------------------------------------------------------------------
@capabilities(dask="yes")
class KroneckerProductFB(Mat2dVector, FisherBlock):
    r"""TF ``KroneckerProductFB``: :math:`c\,(A \otimes G)` with factored Tikhonov damping.

    .. math::

        \begin{aligned}
        \tilde F^{p} v &= c^{p}\,(A + \delta_A I)^{p} \otimes (G + \delta_G I)^{p}\, v,\\
        (\delta_A, \delta_G) &= \texttt{compute\_pi\_adjusted\_damping}\big(A, G,
        \sqrt{\lambda / k^{\rho}}\big)
        \end{aligned}

    (:func:`~kfac_ref.blocks.kronecker_block_matpower` with scale :math:`c` and damping
    :math:`c\lambda/k^{\rho}`).  TF uses :math:`k = c` (conv locations, uses) or no
    normalisation (:math:`k = 1`, :math:`c = 1`).  Any real power (TF's factors compute
    ``get_matpower`` for any exponent).

    Parameters
    ----------
    input_factor : array [p, p] (or diagonal [p]) or factor with ``get_cov()``
    output_factor : array [q, q] (or diagonal [q]) or factor with ``get_cov()``
    damping : float or callable
        :math:`\lambda`.
    kernel_shape : tuple of int
        Shape of the kernel parameter (its last entry is ``q``).
    has_bias : bool
    renorm_coeff : float
        :math:`c` (TF ``_renorm_coeff``).
    normalization : float or None
        :math:`k` (TF ``_setup_damping(damping, normalization)``).
    pi_type : {"tracenorm", "off", "avg_diag", "avg_fro", "2_norm", "1_norm"}
        TF's ``PI_TYPE`` (default ``"tracenorm"``) or a kfac-jax norm.
    normalize_damping_power : float
        :math:`\rho` (TF's ``NORMALIZE_DAMPING_POWER`` = 1).
    zero_factor_fallback : {"pi_one", "identity"}
        TF's π = 1 (default) or kfac-jax's damped block :math:`\lambda I`.
    """

    def __init__(self, input_factor, output_factor, damping, kernel_shape, has_bias=False, *,
                 renorm_coeff=1.0, normalization=None, pi_type="tracenorm",
                 normalize_damping_power=1.0, zero_factor_fallback="pi_one"):
        func = type(self).__name__
        self._a = cov_of(func, "input_factor", input_factor)
        self._g = cov_of(func, "output_factor", output_factor)
        namespace_of(func, input_factor=self._a, output_factor=self._g)
        check_factor(func, "input_factor", self._a)
        check_factor(func, "output_factor", self._g)
        self.has_bias = check_bool(func, "has_bias", has_bias)
        self.kernel_shape = tuple(check_int(func, "kernel_shape entry", k, minimum=1)
                                  for k in kernel_shape)
        p, q = self._a.shape[0], self._g.shape[0]
        if math.prod(self.kernel_shape[:-1]) + (1 if self.has_bias else 0) != p or \
                self.kernel_shape[-1] != q:
            raise KFACValueError(
                f"{func}: kernel_shape (and has_bias) must match the factors: input factor "
                f"dim {p} = prod(kernel_shape[:-1]) + has_bias, output factor dim {q} = "
                f"kernel_shape[-1]; got kernel_shape {self.kernel_shape}, has_bias "
                f"{self.has_bias}.")
        like = {"input_factor": self._a}  # the arrays each scalar meets
        self.renorm_coeff = check_scalar(func, "renorm_coeff", renorm_coeff, positive=True,
                                         like=like)
        self.normalization = None if normalization is None else check_scalar(
            func, "normalization", normalization, positive=True, like=like)
        self.pi_type = check_option(func, "pi_type", pi_type, PI_TYPES)
        self.normalize_damping_power = check_scalar(func, "normalize_damping_power",
                                                    normalize_damping_power, like=like)
        self.zero_factor_fallback = check_option(func, "zero_factor_fallback",
                                                 zero_factor_fallback, ZERO_FACTOR_FALLBACKS)
        self._keep_damping(func, damping, like)

    @property
    def input_factor(self):
        """The input-side statistic :math:`A`."""
        return self._a

    @property
    def output_factor(self):
        """The output-side statistic :math:`G`."""
        return self._g

    @property
    def damping(self):
        r"""The normalised damping :math:`\lambda / k^{\rho}` (TF's ``damping`` property)."""
        lam = self._given_damping()
        if self.normalization is None:
            return lam
        return normalize_damping(lam, self.normalization, self.normalize_damping_power)

    def factor_dampings(self):
        r"""TF's ``(input_damping_func(), output_damping_func())``.

        .. math:: (\delta_A, \delta_G) = (\pi\sqrt{\lambda_k},\ \sqrt{\lambda_k}/\pi)
        """
        return compute_pi_adjusted_damping(self._a, self._g, self.damping ** 0.5,
                                           self.pi_type)

    def multiply_matpower(self, vector, exp):
        r""":math:`c^{p}(A + \delta_A I)^{p} V (G + \delta_G I)^{p}` on the ``[W; b]`` matrix.

        .. math:: c^{p}\,(A + \delta_A I)^{p}\, V\, (G + \delta_G I)^{p}
        """
        func = f"{type(self).__name__}.multiply_matpower"
        xp, mat, back = self._to_mat2d(func, vector, self._a)
        p = self._exp(exp)
        c = self.renorm_coeff
        # the factors were validated at construction: the damped Kronecker kernel directly
        with errors_named(func):
            powers = kron_factored_powers(
                xp, self._a, self._g, p, c * self.damping, c, norm_of_pi_type(self.pi_type),
                self.zero_factor_fallback, second_moment=True)
            return back(kron_factored_apply(xp, powers, mat))

    def multiply_cholesky(self, vector, transpose=False):
        r"""TF ``KroneckerProductFB.multiply_cholesky``: a Kronecker Cholesky factor of the
        damped block.

        .. math::

            L = c^{1/2}\,L_A \otimes L_G, \quad L_A L_A^\top = A + \delta_A I, \quad
            L_G L_G^\top = G + \delta_G I, \qquad L L^\top = \tilde F;

            L v = c^{1/2}\,L_A V L_G^\top \ (\texttt{transpose=False}),

            L^\top v = c^{1/2}\,L_A^\top V L_G \ (\texttt{True})

        on the ``[W; b]`` matrix :math:`V`, with :math:`(\delta_A, \delta_G)` of
        :meth:`factor_dampings` (lower triangular factors; a diagonal factor's is its square
        root).  Only with ``zero_factor_fallback="pi_one"`` (TF's).
        """
        return self._cholesky_product("multiply_cholesky", vector, transpose, False)

    def multiply_cholesky_inverse(self, vector, transpose=False):
        r"""TF ``KroneckerProductFB.multiply_cholesky_inverse``.

        .. math::

            L^{-1} v = c^{-1/2}\,L_A^{-1} V L_G^{-\top} \ (\texttt{transpose=False}),

            L^{-\top} v = c^{-1/2}\,L_A^{-\top} V L_G^{-1} \ (\texttt{True})

        with :math:`L` of :meth:`multiply_cholesky`.
        """
        return self._cholesky_product("multiply_cholesky_inverse", vector, transpose, True)

    def _cholesky_product(self, method, vector, transpose, inverse):
        func = f"{type(self).__name__}.{method}"
        transpose = self._transpose(method, transpose)
        if self.zero_factor_fallback != "pi_one":
            raise KFACValueError(
                f"{func}: zero_factor_fallback must be 'pi_one' (TF's π = 1) for Cholesky "
                f"products; the kfac-jax fall-back has no Kronecker Cholesky factor; got "
                f"{self.zero_factor_fallback!r}.")
        xp, mat, back = self._to_mat2d(func, vector, self._a)
        with errors_named(func):
            # factor_dampings' split, without validating the factors again
            d_a, d_g = pi_split(xp, self._a, self._g, self.damping ** 0.5, self.pi_type)
            return back(kron_factored_cholesky_apply(xp, self._a, self._g, mat, d_a, d_g,
                                                     self.renorm_coeff, transpose=transpose,
                                                     inverse=inverse))

    def full_fisher_block(self):
        r"""The undamped block :math:`c\,(A \otimes G)` (1-D factors as diagonal matrices).

        .. math:: c\,(A \otimes G)
        """
        a, g = (eye_like(f, f.shape[0]) * f if f.ndim == 1 else f
                for f in (self._a, self._g))
        return self.renorm_coeff * kron(a, g)


@capabilities(dask="yes")
class FullyConnectedKFACBasicFB(KroneckerProductFB):
    r"""TF ``FullyConnectedKFACBasicFB``: :math:`A \otimes G` of a dense layer.

    .. math::

        A = \tfrac1N \bar a^\top \bar a, \quad G = \tfrac1N g^\top g, \quad
        \tilde F = (A + \pi\sqrt\lambda I) \otimes (G + \sqrt\lambda/\pi\, I)

    (``c = 1``, no damping normalisation).  Either factor may be diagonal (1-D; TF's
    ``diagonal_approx_for_input/output``).  The kernel shape is read from the factors.
    """

    def __init__(self, input_factor, output_factor, damping, has_bias=False, **kwargs):
        func = type(self).__name__
        a = cov_of(func, "input_factor", input_factor)
        g = cov_of(func, "output_factor", output_factor)
        check_array(func, "input_factor", a, ndim=(1, 2))
        check_array(func, "output_factor", g, ndim=(1, 2))
        kernel = (a.shape[0] - (1 if check_bool(func, "has_bias", has_bias) else 0), g.shape[0])
        super().__init__(a, g, damping, kernel, has_bias, **kwargs)

    @classmethod
    def from_data(cls, inputs, outputs_grad, damping, has_bias=False, **kwargs):
        r"""Block from one batch (:func:`kfac_ref.factors.fully_connected_kronecker_factor`).

        .. math:: A = \tfrac1N \bar a^\top \bar a,\ G = \tfrac1N g^\top g
        """
        func = f"{cls.__name__}.from_data"
        check_rows_data(func, inputs=(inputs, 2), outputs_grad=(outputs_grad, 2))
        has_bias = check_bool(func, "has_bias", has_bias)
        with validated_internals():
            return cls(factors.fully_connected_kronecker_factor(inputs, has_bias),
                       factors.fully_connected_kronecker_factor(outputs_grad), damping,
                       has_bias, **kwargs)


@capabilities(dask="yes")
class FullyConnectedMultiIndepFB(KroneckerProductFB):
    r"""TF ``FullyConnectedMultiIndepFB``: a dense layer used :math:`T` times, independent uses.

    .. math::

        \tilde F = T\,(A + \pi\sqrt{\lambda/T} I) \otimes (G + \sqrt{\lambda/T}/\pi\, I),

    with :math:`A, G` averaged over uses and examples (``c = k = T``; Martens, Ba & Johnson 2018).
    """

    def __init__(self, input_factor, output_factor, damping, num_uses, has_bias=False,
                 **kwargs):
        func = type(self).__name__
        t = check_int(func, "num_uses", num_uses, minimum=1)
        a = cov_of(func, "input_factor", input_factor)
        g = cov_of(func, "output_factor", output_factor)
        check_array(func, "input_factor", a, ndim=(1, 2))
        check_array(func, "output_factor", g, ndim=(1, 2))
        kernel = (a.shape[0] - (1 if check_bool(func, "has_bias", has_bias) else 0), g.shape[0])
        self.num_uses = t
        super().__init__(a, g, damping, kernel, has_bias, renorm_coeff=float(t),
                         normalization=float(t), **kwargs)


@capabilities(dask="yes")
class ConvKFCBasicFB(KroneckerProductFB):
    r"""TF ``ConvKFCBasicFB``: KFC, :math:`|T|\,(\Omega \otimes \Gamma)`.

    .. math::

        \tilde F = |T|\,(\Omega + \pi\sqrt{\lambda/|T|}\,I) \otimes
        (\Gamma + \sqrt{\lambda/|T|}/\pi\, I),

    :math:`\Omega, \Gamma` normalised by :math:`N|T|` (``c = k = |T|``; Grosse & Martens 2016).

    Parameters
    ----------
    input_factor, output_factor, damping
    filter_shape : [kh, kw, C_in, C_out]
    num_locations : int
        :math:`|T|` (:func:`kfac_ref.patches.num_conv_locations`).
    has_bias : bool
    """

    def __init__(self, input_factor, output_factor, damping, filter_shape, num_locations,
                 has_bias=False, *, num_uses=1, **kwargs):
        func = type(self).__name__
        self.num_locations = check_int(func, "num_locations", num_locations, minimum=1)
        self.num_uses = check_int(func, "num_uses", num_uses, minimum=1)
        k = float(self.num_locations * self.num_uses)
        super().__init__(input_factor, output_factor, damping, filter_shape, has_bias,
                         renorm_coeff=k, normalization=k, **kwargs)

    @classmethod
    def from_data(cls, inputs, outputs_grad, damping, filter_shape, padding, strides=None,
                  dilation_rate=None, data_format="NHWC", has_bias=False, **kwargs):
        r"""Block from one batch (:func:`kfac_ref.factors.conv_input_kronecker_factor`,
        :func:`kfac_ref.factors.conv_output_kronecker_factor`).

        .. math:: \Omega = \tfrac{1}{N|T|}[[A]]_H^\top[[A]]_H,\ \Gamma = \tfrac{1}{N|T|}DS^\top DS
        """
        func = f"{cls.__name__}.from_data"
        t = check_conv_data(func, inputs, outputs_grad, filter_shape, strides, padding,
                             dilation_rate, data_format)
        has_bias = check_bool(func, "has_bias", has_bias)
        with validated_internals():
            return cls(factors.conv_input_kronecker_factor(inputs, filter_shape, padding,
                                                           strides, dilation_rate, data_format,
                                                           has_bias),
                       factors.conv_output_kronecker_factor(outputs_grad, data_format), damping,
                       filter_shape, t, has_bias, **kwargs)


@capabilities(dask="yes")
class ConvKFCBasicMultiIndepFB(ConvKFCBasicFB):
    r"""TF ``ConvKFCBasicMultiIndepFB``: KFC for a conv layer used :math:`U` times.

    .. math::

        \tilde F = |T|U\,(\Omega + \pi\sqrt{\lambda/(|T|U)}\,I) \otimes
        (\Gamma + \sqrt{\lambda/(|T|U)}/\pi\, I)

    (``c = k = |T|·U``).
    """

    def __init__(self, input_factor, output_factor, damping, filter_shape, num_locations,
                 num_uses, has_bias=False, **kwargs):
        super().__init__(input_factor, output_factor, damping, filter_shape, num_locations,
                         has_bias, num_uses=num_uses, **kwargs)


@capabilities(dask="yes")
class EmbeddingKFACFB(KroneckerProductFB):
    r"""TF ``EmbeddingKFACFB`` (≤ 2019; now ``approx="kron_in_diag"``): diagonal input factor.

    .. math::

        \tilde F = (\mathrm{diag}(d) + \pi\sqrt\lambda I) \otimes (G + \sqrt\lambda/\pi\, I),
        \qquad d_v = \tfrac1N\#\{\text{id} = v\},

    on the embedding table ``[vocab, out]`` (no bias).
    """

    def __init__(self, input_factor, output_factor, damping, **kwargs):
        func = type(self).__name__
        a = cov_of(func, "input_factor", input_factor)
        g = cov_of(func, "output_factor", output_factor)
        check_array(func, "input_factor", a, ndim=1, layout="[vocab] (diagonal)")
        check_array(func, "output_factor", g, ndim=2)
        super().__init__(a, g, damping, (a.shape[0], g.shape[0]), False, **kwargs)

    @classmethod
    def from_data(cls, input_ids, outputs_grad, vocab_size, damping, **kwargs):
        r"""Block from one batch (:func:`kfac_ref.factors.embedding_input_kronecker_factor`,
        :func:`kfac_ref.factors.fully_connected_kronecker_factor`).

        .. math:: d = \text{counts}/N,\ G = \tfrac1N g^\top g
        """
        func = f"{cls.__name__}.from_data"
        check_array(func, "outputs_grad", outputs_grad, ndim=2, layout="[N, out]")
        with validated_internals():
            return cls(factors.embedding_input_kronecker_factor(input_ids, vocab_size,
                                                                dtype=outputs_grad.dtype),
                       factors.fully_connected_kronecker_factor(outputs_grad), damping,
                       **kwargs)




@capabilities(dask="yes")
class EmbeddingKFACMultiIndepFB(EmbeddingKFACFB):
    r"""TF ``EmbeddingKFACMultiIndepFB`` (≤ 2019; now ``FullyConnectedMultiIndepFB`` with
    ``diagonal_approx_for_input``): an embedding used :math:`T` times, independent uses.

    .. math::

        \begin{aligned}
        \tilde F &= T\,(\mathrm{diag}(d) + \pi\sqrt{\lambda/T} I) \otimes
        (G + \sqrt{\lambda/T}/\pi\, I),\\
        d_v &= \tfrac{1}{TN}\#\{(t, n) : \text{id}_{t,n} = v\}, \quad
        G = \tfrac{1}{TN}\sum_{t,n} g_{t,n} g_{t,n}^\top
        \end{aligned}

    (``c = k = T``, as :class:`FullyConnectedMultiIndepFB`).
    """

    def __init__(self, input_factor, output_factor, damping, num_uses, **kwargs):
        t = check_int(type(self).__name__, "num_uses", num_uses, minimum=1)
        self.num_uses = t
        super().__init__(input_factor, output_factor, damping, renorm_coeff=float(t),
                         normalization=float(t), **kwargs)

    @classmethod
    def from_data(cls, input_ids, outputs_grad, vocab_size, damping, **kwargs):
        r"""Block from ids ``[T, N]`` and output gradients ``[T, N, out]`` (uses first).

        .. math:: d = \text{counts}/(TN),\ G = \tfrac{1}{TN}\sum_{t,n} g_{t,n} g_{t,n}^\top
        """
        func = f"{cls.__name__}.from_data"
        check_array(func, "input_ids", input_ids, ndim=2, dtype="integral", finite=False,
                    layout="[T, N]")
        check_array(func, "outputs_grad", outputs_grad, ndim=3, layout="[T, N, out]")
        if tuple(input_ids.shape) != tuple(outputs_grad.shape[:2]):
            raise KFACValueError(f"{func}: input_ids [T, N] and outputs_grad [T, N, out] must "
                                 f"agree on T and N; got {tuple(input_ids.shape)} and "
                                 f"{tuple(outputs_grad.shape)}.")
        xp = namespace_of(func, input_ids=input_ids, outputs_grad=outputs_grad)
        t, n, q = outputs_grad.shape
        with validated_internals():
            d = factors.embedding_input_kronecker_factor(xp.reshape(input_ids, (t * n,)),
                                                         vocab_size, dtype=outputs_grad.dtype)
            g = factors.fully_connected_kronecker_factor(xp.reshape(outputs_grad, (t * n, q)))
        return cls(d, g, damping, t, **kwargs)
