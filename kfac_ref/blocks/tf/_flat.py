"""TF's full and diagonal Fisher blocks: flat parameter vectors (:class:`FullFB`,
:class:`DiagonalFB` and their naive variants) and layer-shaped diagonals
(:class:`FullyConnectedDiagonalFB`, :class:`ConvDiagonalFB`).
"""

from __future__ import annotations

import math

from ... import factors
from ..._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_bool,
    check_int,
    check_scalar,
    check_square,
    describe,
    errors_named,
    eye_like,
    is_array,
    namespace_of,
)
from ..._support import DASK_NO_EIGH, capabilities
from ...linalg import damped_cholesky, damped_cholesky_inverse
from .._math import (
    apply_diagonal,
    apply_full,
    flatten,
    normalize_damping,
    prepare_full,
    unflatten,
    validated_internals,
)
from ._base import (
    FisherBlock,
    Mat2dVector,
    check_conv_data,
    check_rows_data,
    cov_of,
    grads_tuple,
)


# --------------------------------------------------------------------------------------
# Full and diagonal blocks over a flat parameter vector
# --------------------------------------------------------------------------------------
class _FlatVector:
    """Tuple-of-arrays vectors flattened row-major and concatenated (``tensors_to_column``)."""

    def _flat(self, func, vector, like):
        single = is_array(vector)
        parts = (vector,) if single else vector
        if not isinstance(parts, (list, tuple)) or not parts:
            raise KFACTypeError(f"{func}: vector must be an array or a tuple of arrays; got "
                                f"{describe(vector)}.")
        for i, v in enumerate(parts):
            check_array(func, f"vector[{i}]", v)
        xp = namespace_of(func, like=like, **{f"vector[{i}]": v for i, v in enumerate(parts)})
        shapes = tuple(tuple(v.shape) for v in parts)
        if self.params_shapes is not None and shapes != self.params_shapes:
            raise KFACValueError(f"{func}: vector must have the parameter shapes "
                                 f"{self.params_shapes}; got {shapes}.")

        def back(y):
            out = unflatten(xp, y, shapes)
            return out[0] if single else out

        return xp, flatten(xp, parts), back

    def _set_damping(self, func, damping, like, params_shapes):
        """Keep the damping (:meth:`FisherBlock._keep_damping`) and the parameter shapes."""
        self._keep_damping(func, damping, like)
        self.params_shapes = _params_shapes(func, params_shapes)


def _params_shapes(func, params_shapes):
    if params_shapes is None:
        return None
    return tuple(tuple(check_int(func, "params_shapes entry", d, minimum=1) for d in s)
                 for s in params_shapes)


def _grads_and_shapes(func, params_grads):
    """The checked gradient(s) and their parameter shapes."""
    grads = grads_tuple(func, params_grads)
    return grads, [tuple(g.shape) for g in ((grads,) if is_array(grads) else grads)]


@capabilities(dask=DASK_NO_EIGH)
class FullFB(_FlatVector, FisherBlock):
    r"""TF ``FullFB``: a full matrix over all of the block's parameters.

    .. math::

        \texttt{multiply\_matpower}(v, p) = (F + \lambda I)^{p}\, v

    (:func:`~kfac_ref.blocks.full_block_matpower`, eigendecomposition for :math:`p \ne 1`).

    Parameters
    ----------
    factor : array [n, n] or factor with ``get_cov()``
    damping : float or zero-argument callable
    params_shapes : sequence of shapes, optional
        If given, vectors must have exactly these shapes.
    """

    def __init__(self, factor, damping, params_shapes=None):
        func = type(self).__name__
        self._cov = cov_of(func, "factor", factor)
        namespace_of(func, factor=self._cov)
        check_square(func, "factor", self._cov)
        self._set_damping(func, damping, {"factor": self._cov}, params_shapes)

    def multiply_matpower(self, vector, exp):
        r""":math:`(F + \lambda I)^{p} v`.

        .. math:: (F + \lambda I)^{p} v
        """
        func = f"{type(self).__name__}.multiply_matpower"
        xp, flat, back = self._flat(func, vector, self._cov)
        if flat.shape != (self._cov.shape[0],):
            raise KFACValueError(f"{func}: vector must have {self._cov.shape[0]} entries in "
                                 f"all; got {flat.shape[0]}.")
        p = self._exp(exp)
        # the covariance was validated at construction: the formula's kernel directly
        with errors_named(func):
            eig = None if p == 1.0 else prepare_full(xp, self._cov, 0.0)
            return back(apply_full(xp, self._cov, eig, flat, p, self.damping, 1.0))

    def multiply_cholesky(self, vector, transpose=False):
        r"""TF ``FullFB.multiply_cholesky``: the lower Cholesky factor of the damped block.

        .. math::

            L v \ (\texttt{transpose=False}), \qquad L^\top v \ (\texttt{True}),

            L L^\top = F + \lambda I, \ L \text{ lower triangular}

        (:func:`kfac_ref.linalg.damped_cholesky`).
        """
        return self._triangular_product("multiply_cholesky", vector, transpose,
                                        damped_cholesky)

    def multiply_cholesky_inverse(self, vector, transpose=False):
        r"""TF ``FullFB.multiply_cholesky_inverse``: the inverse lower Cholesky factor.

        .. math::

            L^{-1} v \ (\texttt{transpose=False}), \qquad L^{-\top} v \ (\texttt{True}),
            \qquad L L^\top = F + \lambda I

        (:func:`kfac_ref.linalg.damped_cholesky_inverse`).
        """
        return self._triangular_product("multiply_cholesky_inverse", vector, transpose,
                                        damped_cholesky_inverse)

    def _triangular_product(self, method, vector, transpose, triangular_of):
        func = f"{type(self).__name__}.{method}"
        transpose = self._transpose(method, transpose)
        xp, flat, back = self._flat(func, vector, self._cov)
        n = self._cov.shape[0]
        if flat.shape != (n,):
            raise KFACValueError(f"{func}: vector must have {n} entries in all; got "
                                 f"{flat.shape[0]}.")
        m = triangular_of(self._cov, self.damping)
        return back((m.T if transpose else m) @ flat)

    def full_fisher_block(self):
        r"""The undamped block :math:`F` (TF's ``full_fisher_block``).

        .. math:: F
        """
        return self._cov


@capabilities(dask=DASK_NO_EIGH)
class NaiveFullFB(FullFB):
    r"""TF ``NaiveFullFB``: :class:`FullFB` over the naive "square of the sum" estimate.

    .. math:: F = \frac1N \hat g\hat g^\top, \qquad \hat g = \sum_n \hat g_n
    """

    @classmethod
    def from_grads(cls, params_grads, batch_size, damping):
        r"""Block from the gradient(s) of the summed loss
        (:func:`kfac_ref.factors.full_factor`).

        .. math:: F = \hat g \hat g^\top / N
        """
        grads, shapes = _grads_and_shapes(f"{cls.__name__}.from_grads", params_grads)
        with validated_internals():
            return cls(factors.full_factor(grads, batch_size), damping, shapes)


@capabilities(dask="yes")
class DiagonalFB(_FlatVector, FisherBlock):
    r"""TF ``DiagonalFB``: a diagonal block, stored as a flat diagonal.

    .. math::

        \texttt{multiply\_matpower}(v, p) = (d + \lambda)^{\odot p} \odot v

    (:func:`~kfac_ref.blocks.diagonal_block_matpower`).
    """

    def __init__(self, factor, damping, params_shapes=None):
        func = type(self).__name__
        cov = cov_of(func, "factor", factor)
        xp = namespace_of(func, factor=cov)
        check_array(func, "factor", cov)
        self._diag = xp.reshape(cov, (-1,))
        self._set_damping(func, damping, {"factor": cov}, params_shapes)

    def multiply_matpower(self, vector, exp):
        r""":math:`(d + \lambda)^{\odot p} \odot v`.

        .. math:: (d + \lambda)^{\odot p} \odot v
        """
        return self._matpower("multiply_matpower", vector, self._exp(exp))

    def _matpower(self, method, vector, exp):
        func = f"{type(self).__name__}.{method}"
        xp, flat, back = self._flat(func, vector, self._diag)
        if flat.shape != self._diag.shape:
            raise KFACValueError(f"{func}: vector must have {self._diag.shape[0]} entries in "
                                 f"all; got {flat.shape[0]}.")
        with errors_named(func):
            return back(apply_diagonal(xp, self._diag, flat, exp, self.damping, 1.0))

    def multiply_cholesky(self, vector, transpose=False):
        r"""TF ``DiagonalFB.multiply_cholesky``: the square root of the damped diagonal
        (``transpose`` changes nothing: the factor is diagonal).

        .. math:: L v = (d + \lambda)^{\odot 1/2} \odot v, \qquad L L^\top = \mathrm{diag}(d)
            + \lambda I
        """
        self._transpose("multiply_cholesky", transpose)
        return self._matpower("multiply_cholesky", vector, 0.5)

    def multiply_cholesky_inverse(self, vector, transpose=False):
        r"""TF ``DiagonalFB.multiply_cholesky_inverse`` (``transpose`` changes nothing).

        .. math:: L^{-1} v = (d + \lambda)^{\odot -1/2} \odot v
        """
        self._transpose("multiply_cholesky_inverse", transpose)
        return self._matpower("multiply_cholesky_inverse", vector, -0.5)

    def full_fisher_block(self):
        r"""The undamped block :math:`\mathrm{diag}(d)` as a dense matrix.

        .. math:: \mathrm{diag}(d)
        """
        return eye_like(self._diag, self._diag.shape[0]) * self._diag


@capabilities(dask="yes")
class NaiveDiagonalFB(DiagonalFB):
    r"""TF ``NaiveDiagonalFB``: :class:`DiagonalFB` over the naive diagonal.

    .. math:: d = \frac1N \hat g \odot \hat g, \qquad \hat g = \sum_n \hat g_n
    """

    @classmethod
    def from_grads(cls, params_grads, batch_size, damping):
        r"""Block from the gradient(s) of the summed loss
        (:func:`kfac_ref.factors.naive_diagonal_factor`).

        .. math:: d = \hat g^{\odot 2} / N
        """
        grads, shapes = _grads_and_shapes(f"{cls.__name__}.from_grads", params_grads)
        with validated_internals():
            return cls(factors.naive_diagonal_factor(grads, batch_size), damping, shapes)


@capabilities(dask="yes")
class FullyConnectedDiagonalFB(Mat2dVector, FisherBlock):
    r"""TF ``FullyConnectedDiagonalFB``: sum-of-squares diagonal ``[in (+1), out]``.

    .. math::

        \texttt{multiply\_matpower}(v, p) = (D + \lambda)^{\odot p} \odot V, \qquad
        D = \tfrac1N(\bar a\odot\bar a)^\top(g\odot g)

    on the ``[W; b]`` matrix :math:`V` (:func:`~kfac_ref.blocks.diagonal_block_matpower`).

    Parameters
    ----------
    factor : array [in (+1), out] or factor with ``get_cov()``
    damping : float or callable
    has_bias : bool
    """

    def __init__(self, factor, damping, has_bias=False):
        func = type(self).__name__
        self._diag = cov_of(func, "factor", factor)
        check_array(func, "factor", self._diag, ndim=2, layout="[in (+1), out]")
        self.has_bias = check_bool(func, "has_bias", has_bias)
        rows, out = self._diag.shape
        self.kernel_shape = (rows - (1 if self.has_bias else 0), out)
        self._keep_damping(func, damping, {"factor": self._diag})

    @classmethod
    def from_data(cls, inputs, outputs_grad, damping, has_bias=False):
        r"""Block from one batch (:func:`kfac_ref.factors.fully_connected_diagonal_factor`).

        .. math:: D = \tfrac1N(\bar a\odot\bar a)^\top(g\odot g)
        """
        func = f"{cls.__name__}.from_data"
        check_rows_data(func, inputs=(inputs, 2), outputs_grad=(outputs_grad, 2))
        has_bias = check_bool(func, "has_bias", has_bias)
        with validated_internals():
            return cls(factors.fully_connected_diagonal_factor(inputs, outputs_grad, has_bias),
                       damping, has_bias)

    def _effective_damping(self):
        return self.damping

    def multiply_matpower(self, vector, exp):
        r""":math:`(D + \lambda)^{\odot p} \odot V`.

        .. math:: (D + \lambda)^{\odot p} \odot V
        """
        return self._matpower("multiply_matpower", vector, self._exp(exp))

    def _matpower(self, method, vector, exp):
        func = f"{type(self).__name__}.{method}"
        xp, mat, back = self._to_mat2d(func, vector, self._diag)
        with errors_named(func):
            return back(apply_diagonal(xp, self._diag, mat, exp, self._effective_damping(),
                                       1.0))

    def multiply_cholesky(self, vector, transpose=False):
        r"""TF ``DiagonalFB.multiply_cholesky`` on the ``[W; b]`` matrix (``transpose``
        changes nothing: the factor is diagonal).

        .. math:: L V = (D + \lambda)^{\odot 1/2} \odot V, \qquad
            L L^\top = \mathrm{diag}(\mathrm{vec}_r D) + \lambda I
        """
        self._transpose("multiply_cholesky", transpose)
        return self._matpower("multiply_cholesky", vector, 0.5)

    def multiply_cholesky_inverse(self, vector, transpose=False):
        r"""TF ``DiagonalFB.multiply_cholesky_inverse`` on the ``[W; b]`` matrix.

        .. math:: L^{-1} V = (D + \lambda)^{\odot -1/2} \odot V
        """
        self._transpose("multiply_cholesky_inverse", transpose)
        return self._matpower("multiply_cholesky_inverse", vector, -0.5)

    def full_fisher_block(self):
        r"""The undamped diagonal block as a dense matrix in ``vec_r([W; b])`` order.

        .. math:: \mathrm{diag}(\mathrm{vec}_r(D))
        """
        xp = namespace_of("full_fisher_block", d=self._diag)
        d = xp.reshape(self._diag, (-1,))
        return eye_like(d, d.shape[0]) * d


@capabilities(dask="yes")
class ConvDiagonalFB(FullyConnectedDiagonalFB):
    r"""TF ``ConvDiagonalFB``: sum-of-squares diagonal of a convolution.

    .. math::

        D = \frac1N\sum_n \Big(\sum_t \bar p_{n,t} g_{n,t}^\top\Big)^{\odot 2},
        \qquad \text{damping } |T|\cdot\texttt{normalize\_damping}(\lambda, |T|) = \lambda

    (:func:`kfac_ref.factors.conv_diagonal_factor`).  With
    ``normalize_damping_power`` :math:`\rho \ne 1` the added damping is
    :math:`|T|^{1-\rho}\lambda` (TF's ``NORMALIZE_DAMPING_POWER``).

    Parameters
    ----------
    factor : array [kh·kw·C_in (+1), C_out] or factor with ``get_cov()``
    damping : float or callable
    filter_shape : [kh, kw, C_in, C_out]
    has_bias : bool
    num_locations : int
        :math:`|T|` (only matters when ``normalize_damping_power != 1``).
    normalize_damping_power : float
    """

    def __init__(self, factor, damping, filter_shape, has_bias=False, num_locations=1,
                 normalize_damping_power=1.0):
        super().__init__(factor, damping, has_bias)
        func = type(self).__name__
        filter_shape = tuple(check_int(func, "filter_shape entry", k, minimum=1)
                             for k in filter_shape)
        if math.prod(filter_shape[:-1]) != self.kernel_shape[0] or \
                filter_shape[-1] != self.kernel_shape[1]:
            raise KFACValueError(f"{func}: filter_shape must match the factor's shape "
                                 f"{tuple(self._diag.shape)}; got {filter_shape}.")
        self.kernel_shape = filter_shape
        self.num_locations = check_int(func, "num_locations", num_locations, minimum=1)
        self.normalize_damping_power = check_scalar(func, "normalize_damping_power",
                                                    normalize_damping_power,
                                                    like={"factor": self._diag})

    @classmethod
    def from_data(cls, inputs, outputs_grad, damping, filter_shape, padding, strides=None,
                  dilation_rate=None, data_format="NHWC", has_bias=False,
                  normalize_damping_power=1.0):
        r"""Block from one conv batch (:func:`kfac_ref.factors.conv_diagonal_factor`).

        .. math:: D = \frac1N\sum_n \Big(\sum_t \bar p_{n,t} g_{n,t}^\top\Big)^{\odot 2}

        ``inputs`` ``[N, H, W, C]`` (NHWC) or ``[N, C, H, W]`` (NCHW), ``outputs_grad`` on the
        convolution's output grid; ``num_locations`` is computed from the geometry.
        """
        func = f"{cls.__name__}.from_data"
        t = check_conv_data(func, inputs, outputs_grad, filter_shape, strides, padding,
                             dilation_rate, data_format)
        has_bias = check_bool(func, "has_bias", has_bias)
        with validated_internals():
            diag = factors.conv_diagonal_factor(inputs, outputs_grad, filter_shape, strides,
                                                padding, data_format, dilation_rate, has_bias)
        return cls(diag, damping, filter_shape, has_bias, t, normalize_damping_power)

    def _effective_damping(self):
        t = self.num_locations
        return t * normalize_damping(self.damping, t, self.normalize_damping_power)




# --------------------------------------------------------------------------------------
# Scale-and-shift blocks
# --------------------------------------------------------------------------------------
@capabilities(dask=DASK_NO_EIGH)
class ScaleAndShiftFullFB(FullFB):
    r"""TF ``ScaleAndShiftFullFB``: :class:`FullFB` over the sum-of-squares estimate of a
    scale-and-shift layer ``y = scale * x + shift``.

    .. math::

        \begin{aligned}
        \texttt{multiply\_matpower}(v, p) &= (F + \lambda I)^{p} v, \qquad
        F = \frac1N\sum_n v_n v_n^\top,\\
        v_n &= \Big[\mathrm{vec}_r \sum_{B_s} x_n \odot g_n;\ \mathrm{vec}_r \sum_{B_b} g_n\Big]
        \end{aligned}

    (:func:`kfac_ref.factors.scale_and_shift_factor`, ``approx="full"``); vectors are
    ``scale`` or ``(scale, shift)``, flattened and concatenated.
    """

    @classmethod
    def from_data(cls, inputs, outputs_grad, damping, broadcast_dims_scale,
                  broadcast_dims_shift=None, has_shift=True):
        r"""Block from one batch (:func:`kfac_ref.factors.scale_and_shift_factor`).

        .. math:: F = \frac1N\sum_n v_n v_n^\top
        """
        return cls(factors.scale_and_shift_factor(inputs, outputs_grad, broadcast_dims_scale,
                                                  broadcast_dims_shift, has_shift, "full"),
                   damping)


@capabilities(dask="yes")
class ScaleAndShiftDiagonalFB(DiagonalFB):
    r"""TF ``ScaleAndShiftDiagonalFB``: :class:`DiagonalFB` over the sum-of-squares diagonal
    of a scale-and-shift layer.

    .. math::

        \texttt{multiply\_matpower}(v, p) = (d + \lambda)^{\odot p} \odot v, \qquad
        d = \frac1N\sum_n v_n \odot v_n

    (:func:`kfac_ref.factors.scale_and_shift_factor`, ``approx="diagonal"``; :math:`v_n` as
    in :class:`ScaleAndShiftFullFB`).
    """

    @classmethod
    def from_data(cls, inputs, outputs_grad, damping, broadcast_dims_scale,
                  broadcast_dims_shift=None, has_shift=True):
        r"""Block from one batch (:func:`kfac_ref.factors.scale_and_shift_factor`).

        .. math:: d = \frac1N\sum_n v_n \odot v_n
        """
        return cls(factors.scale_and_shift_factor(inputs, outputs_grad, broadcast_dims_scale,
                                                  broadcast_dims_shift, has_shift,
                                                  "diagonal"),
                   damping)
