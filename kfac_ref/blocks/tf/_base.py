"""The base of the TF-named Fisher blocks: :class:`FisherBlock`, TF's module-level damping
functions and the input helpers shared by the block families of :mod:`kfac_ref.blocks.tf`.
"""

from __future__ import annotations

from ..._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_bool,
    check_option,
    check_scalar,
    describe,
    is_array,
    namespace_of,
)
from ..._support import capabilities
from ...linalg import FACTOR_NORMS, check_norm_argument, kron_factor_dampings, pi_tracenorm
from .._conv import check_conv_outputs_grad, conv_geometry
from .._math import (
    from_mat2d,
    to_mat2d,
)

PI_TYPES = ("tracenorm", "off", *FACTOR_NORMS)
# Documented where it is exported, kfac_ref.blocks.tf.


def norm_of_pi_type(pi_type):
    return "avg_diag" if pi_type == "tracenorm" else pi_type


# --------------------------------------------------------------------------------------
# TF module-level damping functions
# --------------------------------------------------------------------------------------
@capabilities(dask="yes")
def compute_pi_tracenorm(left_cov, right_cov):
    r"""TF's ``compute_pi_tracenorm`` (:func:`kfac_ref.linalg.pi_tracenorm`).

    .. math::

        \pi = \sqrt{\frac{\operatorname{tr}(A)/\dim A}{\operatorname{tr}(B)/\dim B}},
        \qquad \pi = 1 \text{ if a trace is } 0 .

    1-D inputs are diagonals (TF's diagonal linear operators).
    """
    return pi_tracenorm(left_cov, right_cov)


@capabilities(dask="yes")
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
    xp = namespace_of(func, left_cov=left_cov, right_cov=right_cov)
    check_option(func, "pi_type", pi_type, PI_TYPES)
    d = check_scalar(func, "damping", damping, nonnegative=True, like={"left_cov": left_cov})
    if pi_type != "off":
        check_norm_argument(func, "left_cov", left_cov)
        check_norm_argument(func, "right_cov", right_cov)
    return pi_split(xp, left_cov, right_cov, d, pi_type)


def pi_split(xp, left, right, root_damping, pi_type):
    """The unchecked kernel of :func:`compute_pi_adjusted_damping`: ``(δ·π, δ/π)``, π the
    damped Kronecker kernel's (``kfac_ref.linalg.kron_factor_dampings`` of a unit damping:
    ``(π·1, 1/π)``, π = 1 where a factor norm is zero)."""
    if pi_type == "off":
        return root_damping, root_damping
    pi, _ = kron_factor_dampings(xp, left, right, 1.0, norm_of_pi_type(pi_type))
    return root_damping * pi, root_damping / pi


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------
def cov_of(func, name, factor):
    """An array, or a factor object's ``get_cov()``."""
    if is_array(factor):
        return factor
    if hasattr(factor, "get_cov"):
        return factor.get_cov()
    raise KFACTypeError(f"{func}: {name} must be an array or a factor with get_cov(); got "
                        f"{describe(factor)}.")


def damping_value(func, damping, like):
    """A block's damping (a number, a 0-D array like the arrays in ``like``, or a
    zero-argument callable giving one), checked."""
    value = damping() if callable(damping) else damping
    return check_scalar(func, "damping", value, nonnegative=True, like=like)


def check_rows_data(func, **arrays):
    """One batch's arrays, given as ``name=(array, ndim)``: arrays of that rank in one
    namespace with one number of rows, each scanned once."""
    for name, (x, ndim) in arrays.items():
        check_array(func, name, x, ndim=ndim)
    namespace_of(func, **{name: x for name, (x, _) in arrays.items()})
    rows = {name: x.shape[0] for name, (x, _) in arrays.items()}
    if len(set(rows.values())) > 1:
        raise KFACValueError(f"{func}: {' and '.join(rows)} must have one number of rows "
                             f"(examples); got {rows}.")


def check_conv_data(func, inputs, outputs_grad, filter_shape, strides, padding,
                     dilation_rate, data_format):
    """One conv batch: ``inputs`` 4-D, ``outputs_grad`` on the output grid; returns |T|."""
    check_rows_data(func, inputs=(inputs, 4), outputs_grad=(outputs_grad, 4))
    if not isinstance(filter_shape, (list, tuple)) or len(filter_shape) != 4:
        raise KFACValueError(f"{func}: filter_shape must be [kh, kw, C_in, C_out]; got "
                             f"{describe(filter_shape)}.")
    geo = conv_geometry(func, tuple(inputs.shape), filter_shape, strides, padding,
                        dilation_rate, data_format, filter_name="filter_shape")
    check_conv_outputs_grad(func, outputs_grad, inputs.shape[0], geo, filter_name="filter_shape")
    return geo.num_locations


def grads_tuple(func, params_grads):
    """``params_grads`` as an array or a non-empty tuple of arrays, each checked once."""
    parts = (params_grads,) if is_array(params_grads) else params_grads
    if not isinstance(parts, (list, tuple)) or not parts:
        raise KFACTypeError(f"{func}: params_grads must be an array or a sequence of arrays; "
                            f"got {describe(params_grads)}.")
    for i, g in enumerate(parts):
        check_array(func, f"params_grads[{i}]", g)
    namespace_of(func, **{f"params_grads[{i}]": g for i, g in enumerate(parts)})
    return params_grads if is_array(params_grads) else tuple(parts)


@capabilities(dask="yes")
class FisherBlock:
    r"""Base class of the TF-named blocks: powers of the damped block times a vector.

    .. math::

        \begin{aligned}
        \texttt{multiply}(v) &= \texttt{multiply\_matpower}(v, 1),\\
        \texttt{multiply\_inverse}(v) &= \texttt{multiply\_matpower}(v, -1).
        \end{aligned}
    """

    def multiply_matpower(self, vector, exp):  # pragma: no cover - abstract
        r"""The damped block's power ``exp`` times ``vector`` (each block defines it).

        .. math:: (F + \lambda I)^{p} v

        for the block's damped curvature :math:`F + \lambda I` (a Kronecker block damps
        its factors instead: :class:`KroneckerProductFB`); ``vector`` in the block's
        structure (a kernel array, ``(kernel, bias)`` or a tuple of arrays).
        """
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

    def multiply_cholesky(self, vector, transpose=False):  # pragma: no cover - abstract
        r"""A Cholesky factor of the damped block times ``vector`` (TF semantics).

        .. math:: L v \ \text{or}\ L^\top v, \qquad L L^\top = \tilde F
        """
        raise NotImplementedError

    def multiply_cholesky_inverse(self, vector, transpose=False):  # pragma: no cover
        r"""The inverse of a Cholesky factor of the damped block times ``vector``.

        .. math:: L^{-1} v \ \text{or}\ L^{-\top} v, \qquad L L^\top = \tilde F
        """
        raise NotImplementedError

    def _keep_damping(self, func, damping, like):
        """Keep the damping (a value or a zero-argument callable, checked now and at each
        read) and the block's arrays it meets (``{"factor": cov}``)."""
        self._damping_arg, self._damping_like = damping, like
        damping_value(func, damping, like)

    def _given_damping(self):
        """The damping given (the callable's value at this read), checked."""
        return damping_value(type(self).__name__, self._damping_arg, self._damping_like)

    @property
    def damping(self):
        """The damping :math:`\\lambda` added to the block (to the diagonal of a diagonal
        block): the value given, or the zero-argument callable's value at this read."""
        return self._given_damping()

    def _exp(self, exp):
        return check_scalar(f"{type(self).__name__}.multiply_matpower", "exp", exp,
                            like=self._damping_like)

    def _transpose(self, method, transpose):
        return check_bool(f"{type(self).__name__}.{method}", "transpose", transpose)



# --------------------------------------------------------------------------------------
# Layer-shaped vectors: TF's layer_params_to_mat2d
# --------------------------------------------------------------------------------------
class Mat2dVector:
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


