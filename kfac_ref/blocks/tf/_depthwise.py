r"""TF's depthwise-convolution Fisher blocks: :class:`DepthwiseConvDiagonalFB` and
:class:`DepthwiseConvKFCBasicFB`.

TF expresses ``depthwise_conv2d`` with a kernel :math:`w` of shape ``[kh, kw, C, M]`` as a
``conv2d`` with the block-diagonal kernel :math:`S(w)` of shape ``[kh, kw, C, C·M]``,

.. math::

    S(w)_{i, j, c, c' M + m} = [c = c']\, w_{i, j, c, m},

(output channel :math:`cM + m`, the order of ``depthwise_conv2d``), builds the ordinary conv
block :math:`\tilde F` of that kernel shape, and multiplies a depthwise vector by

.. math:: \texttt{op}_{\mathrm{dw}}(v) = S^\top\, \texttt{op}(S v)

for every product ``op`` (matrix power, Cholesky factor, its inverse): :math:`S^\top` keeps
the diagonal blocks :math:`c = c'` (TF's ``conv2d_filter_to_depthwise_conv2d_filter``).  This
is TF's arithmetic, not a power of :math:`S^\top\tilde F S`: for :math:`p \ne 1`,
:math:`S^\top \tilde F^{p} S \ne (S^\top \tilde F S)^{p}` in general.
"""

from __future__ import annotations

from ... import factors
from ..._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_int,
    describe,
    eye_like,
    is_array,
    namespace_of,
)
from ..._support import capabilities
from .._math import validated_internals
from ._base import check_conv_data
from ._flat import ConvDiagonalFB
from ._kronecker import ConvKFCBasicFB


def _depthwise_shape(func, filter_shape):
    if not isinstance(filter_shape, (list, tuple)) or len(filter_shape) != 4:
        raise KFACValueError(f"{func}: filter_shape must be the depthwise kernel shape "
                             f"[kh, kw, C_in, channel_multiplier]; got {describe(filter_shape)}.")
    return tuple(check_int(func, "filter_shape entry", k, minimum=1) for k in filter_shape)


def _check_depthwise_data(func, inputs, outputs_grad, filter_shape, strides, padding,
                          dilation_rate, data_format):
    """``(conv filter shape, |T|)`` of a depthwise conv's checked batch."""
    conv_shape = conv_filter_shape(_depthwise_shape(func, filter_shape))
    return conv_shape, check_conv_data(func, inputs, outputs_grad, conv_shape, strides,
                                       padding, dilation_rate, data_format)


def conv_filter_shape(depthwise_shape):
    """``[kh, kw, C, M]`` → ``[kh, kw, C, C·M]``, the shape of :math:`S(w)`."""
    kh, kw, c, m = depthwise_shape
    return (kh, kw, c, c * m)


def depthwise_to_conv_kernel(xp, w):
    r""":math:`S(w)`: ``[kh, kw, C, M]`` → ``[kh, kw, C, C·M]``, zero off the diagonal blocks."""
    kh, kw, c, m = w.shape
    mask = eye_like(w, c)[None, None, :, :, None]
    return xp.reshape(w[:, :, :, None, :] * mask, (kh, kw, c, c * m))


def conv_to_depthwise_kernel(xp, w, channel_multiplier):
    r""":math:`S^\top`: the diagonal blocks of a ``[kh, kw, C, C·M]`` kernel, ``[kh, kw, C, M]``."""
    kh, kw, c, _ = w.shape
    blocks = xp.reshape(w, (kh, kw, c, c, channel_multiplier))
    return xp.sum(blocks * eye_like(w, c)[None, None, :, :, None], axis=3)


class _DepthwiseVector:
    """Depthwise kernels ``[kh, kw, C, M]`` (no bias, as TF): :math:`S` in, :math:`S^\\top`
    out, around the conv block's ``[W; b]`` map."""

    def _to_mat2d(self, func, vector, like):
        single = is_array(vector)
        parts = (vector,) if single else vector
        if not isinstance(parts, (list, tuple)) or len(parts) != 1:
            raise KFACTypeError(f"{func}: vector must be a depthwise kernel array of shape "
                                f"{self.depthwise_shape} (TF's depthwise blocks take no "
                                f"bias); got {describe(vector)}.")
        check_array(func, "vector", parts[0], shape=self.depthwise_shape,
                    layout="[kh, kw, C_in, channel_multiplier]")
        xp = namespace_of(func, like=like, vector=parts[0])
        _, mat, back = super()._to_mat2d(func, depthwise_to_conv_kernel(xp, parts[0]), like)
        m = self.depthwise_shape[-1]

        def back_depthwise(y):
            w = conv_to_depthwise_kernel(xp, back(y), m)
            return w if single else (w,)

        return xp, mat, back_depthwise


@capabilities(dask="yes")
class DepthwiseConvDiagonalFB(_DepthwiseVector, ConvDiagonalFB):
    r"""TF ``DepthwiseConvDiagonalFB``: :class:`ConvDiagonalFB` of the block-diagonal kernel.

    .. math::

        \begin{aligned}
        \texttt{op}_{\mathrm{dw}}(v) &= S^\top\,\texttt{op}(S v),\\
        \texttt{multiply\_matpower}&: \ S^\top\big((D + \lambda)^{\odot p} \odot S(v)\big),
        \end{aligned}

    with :math:`D` ``[kh·kw·C, C·M]`` the sum-of-squares diagonal of the conv with kernel
    :math:`S(w)` (:func:`kfac_ref.factors.conv_diagonal_factor` with ``filter_shape =
    [kh, kw, C, C·M]``).  Only the diagonal blocks of :math:`D` matter: this is the exact
    diagonal of the depthwise layer's Fisher, each input channel a conv of its own.
    ``full_fisher_block`` is the conv block's (``[kh·kw·C·C·M]`` square), as TF's.

    Parameters
    ----------
    factor : array [kh·kw·C, C·M] or factor with ``get_cov()``
    damping : float or callable
    filter_shape : [kh, kw, C_in, channel_multiplier]
        The depthwise kernel shape.
    num_locations : int
    normalize_damping_power : float
    """

    def __init__(self, factor, damping, filter_shape, num_locations=1,
                 normalize_damping_power=1.0):
        self.depthwise_shape = _depthwise_shape(type(self).__name__, filter_shape)
        super().__init__(factor, damping, conv_filter_shape(self.depthwise_shape), False,
                         num_locations, normalize_damping_power)

    @classmethod
    def from_data(cls, inputs, outputs_grad, damping, filter_shape, padding, strides=None,
                  dilation_rate=None, data_format="NHWC", normalize_damping_power=1.0):
        r"""Block from one batch of a depthwise conv (``outputs_grad`` has ``C·M`` channels,
        channel :math:`cM + m`).

        .. math:: D = \frac1N\sum_n \Big(\sum_t \bar p_{n,t} g_{n,t}^\top\Big)^{\odot 2}
        """
        func = f"{cls.__name__}.from_data"
        conv_shape, t = _check_depthwise_data(func, inputs, outputs_grad, filter_shape,
                                              strides, padding, dilation_rate, data_format)
        with validated_internals():
            diag = factors.conv_diagonal_factor(inputs, outputs_grad, conv_shape, strides,
                                                padding, data_format, dilation_rate, False)
        return cls(diag, damping, filter_shape, t, normalize_damping_power)


@capabilities(dask="yes")
class DepthwiseConvKFCBasicFB(_DepthwiseVector, ConvKFCBasicFB):
    r"""TF ``DepthwiseConvKFCBasicFB``: :class:`ConvKFCBasicFB` of the block-diagonal kernel.

    .. math::

        \begin{aligned}
        \texttt{op}_{\mathrm{dw}}(v) &= S^\top\,\texttt{op}(S v),\\
        \texttt{multiply\_matpower}&: \ S^\top\big(|T|^{p}(\Omega + \delta_\Omega I)^{p}\,
        S(v)\,(\Gamma + \delta_\Gamma I)^{p}\big),
        \end{aligned}

    :math:`\Omega` ``[kh·kw·C]`` from the input patches, :math:`\Gamma` ``[C·M]`` from the
    output gradients, both normalised by :math:`N|T|`, damping :math:`\lambda/|T|` split by π
    (as :class:`ConvKFCBasicFB`).  Not a power of :math:`S^\top\tilde F S` (TF's arithmetic;
    see the module docstring).

    Parameters
    ----------
    input_factor : array [kh·kw·C, kh·kw·C] or factor
    output_factor : array [C·M, C·M] or factor
    damping : float or callable
    filter_shape : [kh, kw, C_in, channel_multiplier]
    num_locations : int
    **kwargs
        ``pi_type``, ``normalize_damping_power``, ``zero_factor_fallback`` of
        :class:`KroneckerProductFB`.
    """

    def __init__(self, input_factor, output_factor, damping, filter_shape, num_locations,
                 **kwargs):
        self.depthwise_shape = _depthwise_shape(type(self).__name__, filter_shape)
        super().__init__(input_factor, output_factor, damping,
                         conv_filter_shape(self.depthwise_shape), num_locations, False,
                         **kwargs)

    @classmethod
    def from_data(cls, inputs, outputs_grad, damping, filter_shape, padding, strides=None,
                  dilation_rate=None, data_format="NHWC", **kwargs):
        r"""Block from one batch of a depthwise conv
        (:func:`kfac_ref.factors.conv_input_kronecker_factor` with ``filter_shape =
        [kh, kw, C, C·M]``, :func:`kfac_ref.factors.conv_output_kronecker_factor`).

        .. math:: \Omega = \tfrac{1}{N|T|}[[A]]_H^\top[[A]]_H,\ \Gamma = \tfrac{1}{N|T|}DS^\top DS
        """
        func = f"{cls.__name__}.from_data"
        conv_shape, t = _check_depthwise_data(func, inputs, outputs_grad, filter_shape,
                                              strides, padding, dilation_rate, data_format)
        with validated_internals():
            omega = factors.conv_input_kronecker_factor(inputs, conv_shape, padding, strides,
                                                        dilation_rate, data_format, False)
            gamma = factors.conv_output_kronecker_factor(outputs_grad, data_format)
        return cls(omega, gamma, damping, filter_shape, t, **kwargs)
