r"""TF K-FAC-named Fisher blocks over the formula functions of :mod:`kfac_ref.blocks`.

A TF ``FisherBlock`` owns factors and a damping and multiplies vectors by powers of the damped
block.  Here a block is immutable and is built from its factors' current statistics: either
arrays or factor objects with a ``get_cov()`` method (the TF-named factors of
:mod:`kfac_ref.factors`; the series block also reads ``get_cov_dt1()``).  Convenience
``from_data`` constructors compute the statistics with :mod:`kfac_ref.factors`.

.. math::

    \texttt{multiply\_matpower}(v, p) = \big(c\,(A + \delta_A I) \otimes (G + \delta_G I)
    \big)^{p} v, \qquad
    (\delta_A, \delta_G) = \texttt{compute\_pi\_adjusted\_damping}\big(A, G,
    \sqrt{\texttt{normalize\_damping}(\lambda, k)}\big),

for Kronecker blocks with renormalisation coefficient :math:`c` (TF ``_renorm_coeff``) and
damping normalisation :math:`k` (``_setup_damping(damping, normalization=k)``); diagonal and
full blocks use :math:`(F + \lambda I)^{p}`.

Vectors follow TF's ``layer_params_to_mat2d``: a kernel array, or a tuple ``(kernel, bias)``;
the kernel is reshaped to ``[-1, out]`` and the bias appended as the last row.  Full and
naive blocks take any tuple of arrays (flattened row-major and concatenated, TF's
``tensors_to_column``).  Results come back in the vector's structure.

Defaults are TF's: ``PI_TYPE = "tracenorm"``, ``NORMALIZE_DAMPING_POWER = 1``, π = 1 when a
trace is zero (``zero_factor_fallback="pi_one"``).  Each is an argument here instead of a
module global.
"""

from __future__ import annotations

import math

from .. import factors
from .._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_bool,
    check_int,
    check_option,
    check_scalar,
    describe,
    eye_like,
    is_array,
    namespace_of,
)
from ..linalg import FACTOR_NORMS, kron, pi_adjusted_damping, pi_tracenorm
from ._conv import check_conv_outputs_grad, conv_geometry
from ._math import (
    ZERO_FACTOR_FALLBACKS,
    check_factor,
    diagonal_block_matpower,
    flatten,
    from_mat2d,
    full_block_matpower,
    kronecker_block_matpower,
    normalize_damping,
    series_option1_multiply_inverse,
    series_option2_multiply_inverse,
    to_mat2d,
    unflatten,
    validated_internals,
)

__all__ = [
    "PI_TYPES",
    "compute_pi_tracenorm",
    "compute_pi_adjusted_damping",
    "normalize_damping",
    "FisherBlock",
    "FullFB",
    "NaiveFullFB",
    "DiagonalFB",
    "NaiveDiagonalFB",
    "FullyConnectedDiagonalFB",
    "ConvDiagonalFB",
    "KroneckerProductFB",
    "FullyConnectedKFACBasicFB",
    "ConvKFCBasicFB",
    "EmbeddingKFACFB",
    "FullyConnectedMultiIndepFB",
    "ConvKFCBasicMultiIndepFB",
    "FullyConnectedSeriesFB",
    "SeriesFBApproximation",
]

PI_TYPES = ("tracenorm", "off", *FACTOR_NORMS)
"""TF's ``PI_TYPE`` values (``"tracenorm"``, ``"off"``) plus kfac-jax's factor norms."""


def _norm_of_pi_type(pi_type):
    return "avg_diag" if pi_type == "tracenorm" else pi_type


# --------------------------------------------------------------------------------------
# TF module-level damping functions
# --------------------------------------------------------------------------------------
def compute_pi_tracenorm(left_cov, right_cov):
    r"""TF's ``compute_pi_tracenorm`` (:func:`kfac_ref.linalg.pi_tracenorm`).

    .. math::

        \pi = \sqrt{\frac{\operatorname{tr}(A)/\dim A}{\operatorname{tr}(B)/\dim B}},
        \qquad \pi = 1 \text{ if a trace is } 0 .

    1-D inputs are diagonals (TF's diagonal linear operators).
    """
    return pi_tracenorm(left_cov, right_cov)


def compute_pi_adjusted_damping(left_cov, right_cov, damping, pi_type="tracenorm"):
    r"""TF's ``compute_pi_adjusted_damping``: split an (already square-rooted) damping.

    .. math::

        (\delta_A, \delta_G) = (\pi\,\delta,\ \delta/\pi), \qquad
        \pi = \begin{cases} \texttt{compute\_pi\_tracenorm}(A, G) & \texttt{"tracenorm"}\\
        1 & \texttt{"off"} \\ \sqrt{\|A\|/\|G\|} & \text{a kfac-jax norm name}\end{cases}

    TF's Kronecker blocks call it with :math:`\delta = \sqrt{\lambda / k}`.

    Raises
    ------
    KFACValueError
        Unknown ``pi_type``, negative damping.
    """
    func = "compute_pi_adjusted_damping"
    namespace_of(func, left_cov=left_cov, right_cov=right_cov)
    check_option(func, "pi_type", pi_type, PI_TYPES)
    d = check_scalar(func, "damping", damping, nonnegative=True)
    if pi_type == "off":
        return d, d
    # π itself is kfac_ref.linalg's (one formula, one place): the split of a unit damping is
    # (π·1, 1/π), with π = 1 where a factor norm is zero.
    pi, _ = pi_adjusted_damping(left_cov, right_cov, 1.0, _norm_of_pi_type(pi_type))
    return d * pi, d / pi


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------
def _cov(func, name, factor):
    """An array, or a factor object's ``get_cov()``."""
    if is_array(factor):
        return factor
    if hasattr(factor, "get_cov"):
        return factor.get_cov()
    raise KFACTypeError(f"{func}: {name} must be an array or a factor with get_cov(); got "
                        f"{describe(factor)}.")


def _damping(func, damping):
    value = damping() if callable(damping) else damping
    return check_scalar(func, "damping", value, nonnegative=True)


def _check_rows_data(func, **arrays):
    """One batch's arrays, given as ``name=(array, ndim)``: arrays of that rank in one
    namespace with one number of rows, each scanned once."""
    for name, (x, ndim) in arrays.items():
        check_array(func, name, x, ndim=ndim)
    namespace_of(func, **{name: x for name, (x, _) in arrays.items()})
    rows = {name: x.shape[0] for name, (x, _) in arrays.items()}
    if len(set(rows.values())) > 1:
        raise KFACValueError(f"{func}: {' and '.join(rows)} must have one number of rows "
                             f"(examples); got {rows}.")


def _check_conv_data(func, inputs, outputs_grad, filter_shape, strides, padding,
                     dilation_rate, data_format):
    """One conv batch: ``inputs`` 4-D, ``outputs_grad`` on the output grid; returns |T|."""
    _check_rows_data(func, inputs=(inputs, 4), outputs_grad=(outputs_grad, 4))
    if not isinstance(filter_shape, (list, tuple)) or len(filter_shape) != 4:
        raise KFACValueError(f"{func}: filter_shape must be [kh, kw, C_in, C_out]; got "
                             f"{describe(filter_shape)}.")
    geo = conv_geometry(func, tuple(inputs.shape), filter_shape, strides, padding,
                        dilation_rate, data_format, filter_name="filter_shape")
    check_conv_outputs_grad(func, outputs_grad, inputs.shape[0], geo)
    return geo.num_locations


def _grads_tuple(func, params_grads):
    """``params_grads`` as an array or a non-empty tuple of arrays, each checked once."""
    parts = (params_grads,) if is_array(params_grads) else params_grads
    if not isinstance(parts, (list, tuple)) or not parts:
        raise KFACTypeError(f"{func}: params_grads must be an array or a sequence of arrays; "
                            f"got {describe(params_grads)}.")
    for i, g in enumerate(parts):
        check_array(func, f"params_grads[{i}]", g)
    namespace_of(func, **{f"params_grads[{i}]": g for i, g in enumerate(parts)})
    return params_grads if is_array(params_grads) else tuple(parts)


class FisherBlock:
    r"""Base class of the TF-named blocks: powers of the damped block times a vector.

    .. math::

        \texttt{multiply}(v) = \texttt{multiply\_matpower}(v, 1), \qquad
        \texttt{multiply\_inverse}(v) = \texttt{multiply\_matpower}(v, -1).
    """

    def multiply_matpower(self, vector, exp):  # pragma: no cover - abstract
        raise NotImplementedError

    def multiply_inverse(self, vector):
        r"""The damped block's inverse times ``vector``.

        .. math:: \tilde F^{-1} v
        """
        return self.multiply_matpower(vector, -1.0)

    def multiply(self, vector):
        r"""The damped block times ``vector``.

        .. math:: \tilde F v
        """
        return self.multiply_matpower(vector, 1.0)

    def _exp(self, exp):
        return check_scalar(f"{type(self).__name__}.multiply_matpower", "exp", exp)


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


def _params_shapes(func, params_shapes):
    if params_shapes is None:
        return None
    return tuple(tuple(check_int(func, "params_shapes entry", d, minimum=1) for d in s)
                 for s in params_shapes)


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
        self._cov = _cov(func, "factor", factor)
        self._damping_arg = damping
        _damping(func, damping)
        self.params_shapes = _params_shapes(func, params_shapes)

    @property
    def damping(self):
        """The damping :math:`\\lambda` added to the block."""
        return _damping(type(self).__name__, self._damping_arg)

    def multiply_matpower(self, vector, exp):
        r""":math:`(F + \lambda I)^{p} v`.

        .. math:: (F + \lambda I)^{p} v
        """
        func = f"{type(self).__name__}.multiply_matpower"
        xp, flat, back = self._flat(func, vector, self._cov)
        return back(full_block_matpower(self._cov, flat, self._exp(exp), self.damping))

    def full_fisher_block(self):
        r"""The undamped block :math:`F` (TF's ``full_fisher_block``).

        .. math:: F
        """
        return self._cov


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
        grads = _grads_tuple(f"{cls.__name__}.from_grads", params_grads)
        shapes = [tuple(g.shape) for g in ((grads,) if is_array(grads) else grads)]
        with validated_internals():
            return cls(factors.full_factor(grads, batch_size), damping, shapes)


class DiagonalFB(_FlatVector, FisherBlock):
    r"""TF ``DiagonalFB``: a diagonal block, stored as a flat diagonal.

    .. math::

        \texttt{multiply\_matpower}(v, p) = (d + \lambda)^{\odot p} \odot v

    (:func:`~kfac_ref.blocks.diagonal_block_matpower`).
    """

    def __init__(self, factor, damping, params_shapes=None):
        func = type(self).__name__
        cov = _cov(func, "factor", factor)
        xp = namespace_of(func, factor=cov)
        check_array(func, "factor", cov)
        self._diag = xp.reshape(cov, (-1,))
        self._damping_arg = damping
        _damping(func, damping)
        self.params_shapes = _params_shapes(func, params_shapes)

    @property
    def damping(self):
        """The damping :math:`\\lambda` added to the diagonal."""
        return _damping(type(self).__name__, self._damping_arg)

    def multiply_matpower(self, vector, exp):
        r""":math:`(d + \lambda)^{\odot p} \odot v`.

        .. math:: (d + \lambda)^{\odot p} \odot v
        """
        func = f"{type(self).__name__}.multiply_matpower"
        xp, flat, back = self._flat(func, vector, self._diag)
        if flat.shape != self._diag.shape:
            raise KFACValueError(f"{func}: vector must have {self._diag.shape[0]} entries in "
                                 f"all; got {flat.shape[0]}.")
        return back(diagonal_block_matpower(self._diag, flat, self._exp(exp), self.damping))

    def full_fisher_block(self):
        r"""The undamped block :math:`\mathrm{diag}(d)` as a dense matrix.

        .. math:: \mathrm{diag}(d)
        """
        return eye_like(self._diag, self._diag.shape[0]) * self._diag


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
        grads = _grads_tuple(f"{cls.__name__}.from_grads", params_grads)
        shapes = [tuple(g.shape) for g in ((grads,) if is_array(grads) else grads)]
        with validated_internals():
            return cls(factors.naive_diagonal_factor(grads, batch_size), damping, shapes)


# --------------------------------------------------------------------------------------
# Layer-shaped vectors: TF's layer_params_to_mat2d
# --------------------------------------------------------------------------------------
class _Mat2d:
    """``(kernel, bias)`` or ``kernel`` ↔ ``[rows, out]`` with the bias as the last row."""

    def _to_mat2d(self, func, vector, like):
        single = is_array(vector)
        parts = (vector,) if single else vector
        if not isinstance(parts, (list, tuple)) or len(parts) not in (1, 2):
            raise KFACTypeError(f"{func}: vector must be a kernel array or a (kernel, bias) "
                                f"tuple; got {describe(vector)}.")
        for i, v in enumerate(parts):
            check_array(func, f"vector[{i}]", v)
        xp = namespace_of(func, like=like, **{f"vector[{i}]": v for i, v in enumerate(parts)})
        expected = (self.kernel_shape,) + (((self.kernel_shape[-1],),) if self.has_bias else ())
        shapes = tuple(tuple(v.shape) for v in parts)
        if shapes != expected:
            raise KFACValueError(f"{func}: vector must have the parameter shapes {expected} "
                                 f"({'kernel, bias' if self.has_bias else 'kernel'}); got "
                                 f"{shapes}.")
        mat = to_mat2d(xp, parts[0], parts[1] if self.has_bias else None, self.kernel_shape[-1])

        def back(y):
            w, b = from_mat2d(xp, y, self.kernel_shape, self.has_bias)
            if not self.has_bias:
                return w if single else (w,)
            return (w, b)

        return xp, mat, back


class FullyConnectedDiagonalFB(_Mat2d, FisherBlock):
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
        self._diag = _cov(func, "factor", factor)
        check_array(func, "factor", self._diag, ndim=2, layout="[in (+1), out]")
        self.has_bias = check_bool(func, "has_bias", has_bias)
        rows, out = self._diag.shape
        self.kernel_shape = (rows - (1 if self.has_bias else 0), out)
        self._damping_arg = damping
        _damping(func, damping)

    @classmethod
    def from_data(cls, inputs, outputs_grad, damping, has_bias=False):
        r"""Block from one batch (:func:`kfac_ref.factors.fully_connected_diagonal_factor`).

        .. math:: D = \tfrac1N(\bar a\odot\bar a)^\top(g\odot g)
        """
        func = f"{cls.__name__}.from_data"
        _check_rows_data(func, inputs=(inputs, 2), outputs_grad=(outputs_grad, 2))
        has_bias = check_bool(func, "has_bias", has_bias)
        with validated_internals():
            return cls(factors.fully_connected_diagonal_factor(inputs, outputs_grad, has_bias),
                       damping, has_bias)

    @property
    def damping(self):
        """The damping :math:`\\lambda` added to the diagonal."""
        return _damping(type(self).__name__, self._damping_arg)

    def _effective_damping(self):
        return self.damping

    def multiply_matpower(self, vector, exp):
        r""":math:`(D + \lambda)^{\odot p} \odot V`.

        .. math:: (D + \lambda)^{\odot p} \odot V
        """
        func = f"{type(self).__name__}.multiply_matpower"
        xp, mat, back = self._to_mat2d(func, vector, self._diag)
        return back(diagonal_block_matpower(self._diag, mat, self._exp(exp),
                                              self._effective_damping()))

    def full_fisher_block(self):
        r"""The undamped diagonal block as a dense matrix in ``vec_r([W; b])`` order.

        .. math:: \mathrm{diag}(\mathrm{vec}_r(D))
        """
        xp = namespace_of("full_fisher_block", d=self._diag)
        d = xp.reshape(self._diag, (-1,))
        return eye_like(d, d.shape[0]) * d


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
                                                    normalize_damping_power)

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
        t = _check_conv_data(func, inputs, outputs_grad, filter_shape, strides, padding,
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
# Kronecker-product blocks
# --------------------------------------------------------------------------------------
class KroneckerProductFB(_Mat2d, FisherBlock):
    r"""TF ``KroneckerProductFB``: :math:`c\,(A \otimes G)` with factored Tikhonov damping.

    .. math::

        \tilde F^{p} v = c^{p}\,(A + \delta_A I)^{p} \otimes (G + \delta_G I)^{p}\, v,
        \qquad (\delta_A, \delta_G) = \texttt{compute\_pi\_adjusted\_damping}\big(A, G,
        \sqrt{\lambda / k^{\rho}}\big)

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
        self._a = _cov(func, "input_factor", input_factor)
        self._g = _cov(func, "output_factor", output_factor)
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
        self.renorm_coeff = check_scalar(func, "renorm_coeff", renorm_coeff, positive=True)
        self.normalization = None if normalization is None else check_scalar(
            func, "normalization", normalization, positive=True)
        self.pi_type = check_option(func, "pi_type", pi_type, PI_TYPES)
        self.normalize_damping_power = check_scalar(func, "normalize_damping_power",
                                                    normalize_damping_power)
        self.zero_factor_fallback = check_option(func, "zero_factor_fallback",
                                                 zero_factor_fallback, ZERO_FACTOR_FALLBACKS)
        self._damping_arg = damping
        _damping(func, damping)

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
        lam = _damping(type(self).__name__, self._damping_arg)
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
        c = self.renorm_coeff
        out = kronecker_block_matpower(
            self._a, self._g, mat, self._exp(exp), c * self.damping, scale=c, exact=False,
            norm_type=_norm_of_pi_type(self.pi_type),
            zero_factor_fallback=self.zero_factor_fallback)
        return back(out)

    def full_fisher_block(self):
        r"""The undamped block :math:`c\,(A \otimes G)` (1-D factors as diagonal matrices).

        .. math:: c\,(A \otimes G)
        """
        a, g = (eye_like(f, f.shape[0]) * f if f.ndim == 1 else f
                for f in (self._a, self._g))
        return self.renorm_coeff * kron(a, g)


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
        a = _cov(func, "input_factor", input_factor)
        g = _cov(func, "output_factor", output_factor)
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
        _check_rows_data(func, inputs=(inputs, 2), outputs_grad=(outputs_grad, 2))
        has_bias = check_bool(func, "has_bias", has_bias)
        with validated_internals():
            return cls(factors.fully_connected_kronecker_factor(inputs, has_bias),
                       factors.fully_connected_kronecker_factor(outputs_grad), damping,
                       has_bias, **kwargs)


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
        a = _cov(func, "input_factor", input_factor)
        g = _cov(func, "output_factor", output_factor)
        check_array(func, "input_factor", a, ndim=(1, 2))
        check_array(func, "output_factor", g, ndim=(1, 2))
        kernel = (a.shape[0] - (1 if check_bool(func, "has_bias", has_bias) else 0), g.shape[0])
        self.num_uses = t
        super().__init__(a, g, damping, kernel, has_bias, renorm_coeff=float(t),
                         normalization=float(t), **kwargs)


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
        t = _check_conv_data(func, inputs, outputs_grad, filter_shape, strides, padding,
                             dilation_rate, data_format)
        has_bias = check_bool(func, "has_bias", has_bias)
        with validated_internals():
            return cls(factors.conv_input_kronecker_factor(inputs, filter_shape, padding,
                                                           strides, dilation_rate, data_format,
                                                           has_bias),
                       factors.conv_output_kronecker_factor(outputs_grad, data_format), damping,
                       filter_shape, t, has_bias, **kwargs)


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


class EmbeddingKFACFB(KroneckerProductFB):
    r"""TF ``EmbeddingKFACFB`` (≤ 2019; now ``approx="kron_in_diag"``): diagonal input factor.

    .. math::

        \tilde F = (\mathrm{diag}(d) + \pi\sqrt\lambda I) \otimes (G + \sqrt\lambda/\pi\, I),
        \qquad d_v = \tfrac1N\#\{\text{id} = v\},

    on the embedding table ``[vocab, out]`` (no bias).
    """

    def __init__(self, input_factor, output_factor, damping, **kwargs):
        func = type(self).__name__
        a = _cov(func, "input_factor", input_factor)
        g = _cov(func, "output_factor", output_factor)
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


# --------------------------------------------------------------------------------------
# Series (RNN) block
# --------------------------------------------------------------------------------------
class SeriesFBApproximation:
    r"""TF's option names for :class:`FullyConnectedSeriesFB`.

    ``option1``: finite :math:`T`, symmetric :math:`V_1` (:math:`F_T`); ``option2``:
    :math:`T \to \infty` (:math:`F_\infty`).
    """

    option1 = 1
    option2 = 2


class FullyConnectedSeriesFB(_Mat2d, FisherBlock):
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
        self._a0 = _cov(func, "input_factor", input_factor)
        self._g0 = _cov(func, "output_factor", output_factor)
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
        self._damping_arg = damping
        _damping(func, damping)

    @property
    def damping(self):
        r"""The normalised damping :math:`\lambda / T`."""
        return normalize_damping(_damping(type(self).__name__, self._damping_arg),
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
        d_a, d_g = self.factor_dampings()
        t = self.num_uses
        if self.option == 1:
            l_a, psi_a = factors.series_option1_quantities(self._a0, self._a1, d_a,
                                                     self.option1_eig_method)
            l_g, psi_g = factors.series_option1_quantities(self._g0, self._g1, d_g,
                                                     self.option1_eig_method)
            return back(series_option1_multiply_inverse(l_a, psi_a, l_g, psi_g, t, mat))
        p_a, k_a, mu_a = factors.series_option2_quantities(self._a0, self._a1, d_a)
        p_g, k_g, mu_g = factors.series_option2_quantities(self._g0, self._g1, d_g)
        return back(series_option2_multiply_inverse(p_a, k_a, mu_a, p_g, k_g, mu_g, t, mat))

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
