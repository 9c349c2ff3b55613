r"""The Kronecker-factored block family: :math:`s\,A\otimes G` on the row-major ``[W; b]``
matrix (kfac-jax ``TwoKroneckerFactored`` and its layer blocks)."""

from __future__ import annotations

import math
from functools import partial
from types import MappingProxyType
from typing import Any

from ... import factors
from ..._backend import (
    KFACValueError,
    check_array,
    check_bool,
    check_option,
    check_scalar,
    checks_values,
    is_array,
    kernel_error,
    namespace_of,
    reshape,
)
from ..._support import capabilities
from ...conv_geometry import to_channels_last
from ...linalg import (
    PI_NORMS,
    ZERO_FACTOR_FALLBACKS,
    append_homog,
    compute_cov,
    factor_norm,
    kron,
    kron_eigen,
    kron_factor_norms,
    kron_factored_apply,
    kron_factored_fold,
    kron_factored_powers,
    kron_zero_factor,
)
from .._conv import pooled_conv_data
from .._math import (
    apply_kron,
    kron_product_path,
    kron_spectrum,
    prepare_kron,
    validated_internals,
)
from ._base import BlockState, CurvatureBlock, MatrixWorkingForm
from ._layers import ConvLayer, DenseLayer, check_layer_kind
from ._registry import register_layer_block

KFAC_JAX_APPROX_POWERS = (-1.0, -0.5, 0.5, 1.0)
"""Powers kfac-jax's Kronecker blocks compute approximately (π-damped factors)."""


@capabilities(dask="yes")
class TwoKroneckerFactored(MatrixWorkingForm, CurvatureBlock):
    r"""Kronecker-factored blocks (kfac-jax ``TwoKroneckerFactored``), :math:`s\,A\otimes G`.

    .. math::

        \begin{aligned}
        \text{exact: }&(sA\otimes G + \lambda I)^{p},\\
        \text{approximate: }&\big(s(A + \pi\sqrt{\lambda/s}\,I)\otimes
            (G + \sqrt{\lambda/s}/\pi\,I)\big)^{p}
        \end{aligned}

    (:func:`~kfac_ref.blocks.kronecker_block_matpower`) on the row-major ``[W; b]`` matrix
    ``[K (+1), C_out]`` built from the vector ``(kernel, bias)``.  Abstract: a subclass gives
    the batch statistics (``_batch_statistics``).

    Options where TF and kfac-jax differ (defaults are kfac-jax's, except ``symmetrize``):

    * ``approx_power_one``: ``"factored"`` (kfac-jax and TF: the approximate power 1 is the
      π-damped product) or ``"exact"`` (:math:`sA\otimes G + \lambda I`);
    * ``restrict_approx_powers``: ``True`` allows only kfac-jax's approximate powers
      (−1, −0.5, 0.5, 1) and raises for others; ``False`` allows any real power (TF);
    * ``zero_factor_fallback``: ``"identity"`` (kfac-jax: damped block :math:`\lambda I`) or
      ``"pi_one"`` (TF: π = 1);
    * ``norm_type``: the factor norm for π (``"avg_diag"`` = trace norm; ``"off"`` is TF's
      ``PI_TYPE="off"``);
    * ``symmetrize``: statistics symmetrised (TF; the default here) or not (kfac-jax); they
      differ by rounding only.
    """

    semidefinite_statistics = (0, 1)  # A and G: averages of outer products

    def __init__(self, parameters_shapes, *, approx_power_one="factored",
                 restrict_approx_powers=True, zero_factor_fallback="identity",
                 norm_type="avg_diag", symmetrize=True, **kwargs):
        super().__init__(parameters_shapes, **kwargs)
        func = type(self).__name__
        self.approx_power_one = check_option(func, "approx_power_one", approx_power_one,
                                             ("factored", "exact"))
        self.restrict_approx_powers = check_bool(func, "restrict_approx_powers",
                                                 restrict_approx_powers)
        self.zero_factor_fallback = check_option(func, "zero_factor_fallback",
                                                 zero_factor_fallback, ZERO_FACTOR_FALLBACKS)
        self.norm_type = check_option(func, "norm_type", norm_type, PI_NORMS)
        self.symmetrize = check_bool(func, "symmetrize", symmetrize)
        kernel = self.parameters_shapes[0]
        self.output_size = kernel[-1]
        self.input_size = math.prod(kernel[:-1]) + (1 if len(self.parameters_shapes) == 2 else 0)
        if len(self.parameters_shapes) == 2 and self.parameters_shapes[1] != (kernel[-1],):
            raise KFACValueError(f"{func}: the bias shape must be ({kernel[-1]},) for a kernel "
                                 f"of shape {kernel}; got {self.parameters_shapes[1]}.")

    def _statistics_shapes(self):
        return ((self.input_size, self.input_size), (self.output_size, self.output_size))

    def check_approx_power(self, func, power):
        if self.restrict_approx_powers and power not in KFAC_JAX_APPROX_POWERS:
            raise KFACValueError(
                f"{func}: power must be one of {KFAC_JAX_APPROX_POWERS} for an approximate "
                f"(exact_power=False) Kronecker power (kfac-jax); got {power}. Use "
                f"exact_power=True or restrict_approx_powers=False.")
        return power

    # -- the one product path: kfac_ref.linalg's damped Kronecker kernel ------------------
    def _prepare(self, path, xp, a, g, power, lam, s, norms=None, zero=None):
        return prepare_kron(path, xp, a, g, power, lam, s, self.norm_type,
                            self.zero_factor_fallback, self.eigenvalue_clipping_threshold,
                            norms, zero)

    def _multiply_fresh(self, xp, state, vector, lam, power, exact):
        a, g = (f.value for f in state.statistics)
        s = self.scale(state, False)
        path = kron_product_path(power, exact, self.approx_power_one)
        if path == "factored":  # the kernel itself, so an inverse is few calls from LAPACK
            powers = kron_factored_powers(
                xp, a, g, power, lam, s, self.norm_type, self.zero_factor_fallback,
                self.eigenvalue_clipping_threshold, second_moment=True)
            return kron_factored_apply(xp, powers, vector)
        prepared = self._prepare(path, xp, a, g, power, lam, s)
        return apply_kron(path, xp, a, g, prepared, vector, power, lam, s)

    def _multiply_cached(self, xp, state, vector, lam, power, exact):
        path = kron_product_path(power, exact, self.approx_power_one)
        if path == "factored" and power != 1.0:  # the cached factor powers, nothing else
            return kron_factored_apply(xp, self._cached_factor_powers(state, lam, power),
                                       vector)
        a, g = self._cache_get(state, "factors", "update_cache")
        s = self._cache_get(state, "scale", "update_cache")
        prepared = None
        if path == "eigen":
            prepared = self._cache_get(state, "eigen", "update_cache with exact_powers")
        elif path == "factored":  # power one: the damped factors themselves
            prepared = self._prepare(path, xp, a, g, power, lam, s)
        return apply_kron(path, xp, a, g, prepared, vector, power, lam, s)

    def _cached_factor_powers(self, state, lam, power):
        """The cached factor powers of the approximate ``power`` (the factored path), or
        the kernel's error: a power not cached, or (``strict_cache``) a weight other than
        the one they were built with."""
        approx = self._cache_get(state, "approx", "update_cache with approx_powers")
        if power not in approx:
            raise kernel_error(
                f"power must be one of the cached approximate powers "
                f"{tuple(approx)}; got {power}. Declare it in init and call update_cache.")
        lam_cached, prepared = approx[power]
        if self.strict_cache and _differ(lam_cached, lam):
            raise kernel_error(
                f"identity_weight (effective {float(lam)}) must equal the one the "
                f"cached approximate power {power} was built with ({float(lam_cached)}); call "
                f"update_cache, or pass strict_cache=False for kfac-jax's behaviour "
                f"(cached weight used).")
        return prepared

    def cached_flat_product(self, xp, state, identity_weight, power, exact_power):
        # the factored path's cached factor powers (the common preconditioner); every other
        # branch stays with the kernel
        if kron_product_path(power, exact_power, self.approx_power_one) != "factored" or (
                power == 1.0):
            return None
        prepared = self._cached_factor_powers(state, identity_weight, power)
        return partial(_flat_factored_apply, xp, prepared, (self.input_size, self.output_size))

    def _build_cache(self, xp, state, lam, exact, approx, eigenvalues):
        a, g = (f.value for f in state.statistics)
        s = self.scale(state, False)
        out = {"factors": (a, g)}
        if exact or eigenvalues:
            out["eigen"] = kron_eigen(xp, a, g, self.eigenvalue_clipping_threshold)
        if eigenvalues:
            out["eigenvalues"] = kron_spectrum(xp, out["eigen"][0], out["eigen"][2], s)
        # the π norms and the zero-factor test (one host read) once for every cached power
        identity = self.zero_factor_fallback == "identity"
        norms = (kron_factor_norms(xp, a, g, self.norm_type)
                 if approx and (identity or self.norm_type != "off") else None)
        zero = kron_zero_factor(xp, norms) if approx and identity else None
        out["approx"] = MappingProxyType({
            p: (lam, kron_factored_fold(xp, self._prepare("factored", xp, a, g, p, lam, s,
                                                          norms, zero), a, g))
            for p in approx})
        return out

    def _eigenvalues(self, xp, state):
        a, g = (f.value for f in state.statistics)
        s_a, _, s_g, _ = kron_eigen(xp, a, g, self.eigenvalue_clipping_threshold)
        return kron_spectrum(xp, s_a, s_g, self.scale(state, False))

    def _dense_unscaled(self, xp, state):
        a, g = (f.value for f in state.statistics)
        return kron.kernel(xp, a, g)

    def _norm_unscaled(self, xp, state, norm_type):
        a, g = (f.value for f in state.statistics)
        return factor_norm.kernel(xp, a, norm_type) * factor_norm.kernel(xp, g, norm_type)

    # -- one update from several back-propagated vectors ------------------------------------
    def _layer_rows(self, layer, inputs, outputs_grads, batch_size, weight_sharing):
        """``(input rows, [output-gradient rows per vector], rows)`` of one layer: the input
        rows are taken once (they do not depend on the vector)."""
        datas = [self.layer_estimation_data(layer, inputs, g, None, batch_size, weight_sharing)
                 for g in outputs_grads]
        (first, rows) = datas[0]
        return first["inputs"], [d["outputs_grad"] for d, _ in datas], rows

    def update_from_output_vectors(self, state, layer, inputs, outputs_grads, batch_size,
                                   weight_sharing, ema_old, ema_new, layer_tap=None):
        r"""One moving-average update from the :math:`C` back-propagated vectors of a batch
        (used by :class:`kfac_ref.curvature.BlockDiagonalCurvature`).

        .. math::

            \begin{aligned}
            A &\leftarrow \texttt{ema\_old}\,A + \texttt{ema\_new}\,\hat A(x),\\
            G &\leftarrow \texttt{ema\_old}\,G + \texttt{ema\_new}\,
            \frac{1}{CR}\sum_{c=1}^{C}\sum_{r=1}^{R} g_{c,r} g_{c,r}^\top ,
            \end{aligned}

        with :math:`R` rows per vector: :math:`\hat A` is computed once and :math:`G` from
        the :math:`C R` stacked rows in one GEMM.  This equals :math:`C` calls of
        :meth:`update_curvature_matrix_estimate`, the first with ``ema_old`` and the others
        with 1, each with the weight ``ema_new / C``, up to rounding.  ``layer_tap``: see
        :meth:`~kfac_ref.blocks.kfac_jax.CurvatureBlock.update_from_output_vectors`.
        """
        func = f"{type(self).__name__}.update_from_output_vectors"
        if not outputs_grads:
            raise KFACValueError(f"{func}: outputs_grads must hold at least one back-propagated "
                                 f"vector; got none.")
        xp = self._check_state(func, state)
        ema_old = check_scalar(func, "ema_old", ema_old, nonnegative=True)
        ema_new = check_scalar(func, "ema_new", ema_new, nonnegative=True)
        self._check_scalars(func, state, ema_old=ema_old, ema_new=ema_new)
        a, gs, rows = self._layer_rows(layer, inputs, outputs_grads, batch_size, weight_sharing)
        data = self._check_estimation_arrays(func, state, {"inputs": a, "outputs_grad": gs[0]},
                                             rows)
        for g in gs[1:]:  # same shapes as the first (one backward pass each): finiteness
            check_array(func, "outputs_grad", g)
        g = gs[0] if len(gs) == 1 else xp.concat(gs, axis=0)
        stats_data = {"inputs": data["inputs"], "outputs_grad": g}
        if layer_tap is not None and self.uses_layer_tap(layer, tuple(inputs.shape)):
            stats_data["input_factor"] = layer_tap
        with validated_internals():
            new = self._batch_statistics(xp, stats_data, rows)
            stats = tuple(s.update(x, ema_old, ema_new)
                          for s, x in zip(state.statistics, new, strict=True))
        return BlockState(stats, state.cache, state.like)

    def _second_moment(self, xp, x):
        """:math:`X^\\top X / n` of rows, symmetrised (TF) or not (kfac-jax)."""
        if self.symmetrize:
            return compute_cov.kernel(xp, x)
        return compute_cov.kernel(xp, x, x)


def _differ(cached, given):
    """Whether two identity weights differ: a value check when either is an array (read on
    the host only while value checks run; inside a trace, or with value checks off, it
    passes like the other value checks)."""
    if type(cached) is float and type(given) is float:  # the common case, no probes
        return cached != given
    differ = cached != given
    if is_array(differ):
        return checks_values(differ) and bool(differ)
    return bool(differ)


@capabilities(jit="yes", dask="yes")
class DenseTwoKroneckerFactored(DenseLayer, TwoKroneckerFactored):
    r"""kfac-jax ``DenseTwoKroneckerFactored`` (TF ``FullyConnectedKFACBasicFB`` statistics).

    .. math::

        A = \frac1N \sum_n \bar a_n \bar a_n^\top, \qquad G = \frac1N \sum_n g_n g_n^\top,
        \qquad B = A \otimes G \ \text{on } \mathrm{vec}_r([W; b])

    (:func:`kfac_ref.factors.fully_connected_kronecker_factor`; with ``symmetrize=False`` the
    unsymmetrised :func:`kfac_ref.linalg.compute_cov` cross form).  From a layer on
    ``[N, T, d]`` inputs with KFAC-expand the block is :math:`T\,A\otimes G` (``fixed_scale()
    = T``, Eschenhagen et al. 2023).

    Parameters
    ----------
    input_size, output_size : int
    has_bias : bool
    **kwargs
        Options of :class:`TwoKroneckerFactored`.
    """

    @classmethod
    def from_layer(cls, layer, input_shape, *, weight_sharing="expand", **kwargs):
        """The block of a dense layer; :math:`T\\,A\\otimes G` for KFAC-expand on
        ``[N, T, d]`` inputs."""
        block_cls = cls
        if len(input_shape) == 3 and weight_sharing == "expand":
            block_cls = _repeated(cls, input_shape[1])
        return super(DenseTwoKroneckerFactored, block_cls).from_layer(layer, input_shape,
                                                                      **kwargs)

    def _batch_statistics(self, xp, data, batch_size):
        a, g = data["inputs"], data["outputs_grad"]
        if self.symmetrize:
            return (factors.fully_connected_kronecker_factor.kernel(xp, a, self.has_bias),
                    factors.fully_connected_kronecker_factor.kernel(xp, g))
        return (self._second_moment(xp, append_homog.kernel(xp, a) if self.has_bias else a),
                self._second_moment(xp, g))


_REPEATED: dict[Any, type] = {}


def _repeated(base, repeats):
    """``base`` (a dense Kronecker block class) with ``fixed_scale() = T`` (KFAC-expand)."""
    key = (base, int(repeats))
    if key not in _REPEATED:
        def fixed_scale(self):
            return float(self.num_repeats)

        _REPEATED[key] = type(f"Repeated{base.__name__}", (base,), {
            "num_repeats": int(repeats), "fixed_scale": fixed_scale, "__module__": __name__,
            "__doc__": f"{base.__name__} with fixed_scale() = T = {int(repeats)} (KFAC-expand)."})
    return _REPEATED[key]


@capabilities(jit="yes", dask="yes")
class Conv2DTwoKroneckerFactored(ConvLayer, TwoKroneckerFactored):
    r"""kfac-jax ``Conv2DTwoKroneckerFactored`` (TF ``ConvKFCBasicFB``): KFC.

    .. math::

        \begin{aligned}
        B &= |T|\,(\Omega \otimes \Gamma),\\
        \Omega &= \frac{1}{N|T|}\sum_{n,t}\bar p_{n,t}\bar p_{n,t}^\top,\qquad
        \Gamma = \frac{1}{N|T|}\sum_{n,t} g_{n,t}g_{n,t}^\top,
        \end{aligned}

    ``fixed_scale() = |T|`` (``num_locations``), so factored damping splits
    :math:`\lambda/|T|` (Grosse & Martens 2016, §3.1).  Statistics:
    :func:`kfac_ref.factors.conv_input_kronecker_factor`,
    :func:`kfac_ref.factors.conv_output_kronecker_factor`.  Layer parameters as
    :class:`Conv2DDiagonal`, options as :class:`TwoKroneckerFactored`.  From a layer with
    ``weight_sharing="reduce"`` the block is KFAC-reduce: a dense Kronecker block on the
    location-averaged patches and location-summed output gradients.
    """

    @classmethod
    def from_layer(cls, layer, input_shape, *, weight_sharing="expand", **kwargs):
        """The KFC block of a conv layer, or its KFAC-reduce block (``"reduce"``)."""
        if weight_sharing != "reduce":
            return super().from_layer(layer, input_shape, **kwargs)
        check_layer_kind(cls, layer, "conv2d")
        # same flat order: HWIO kernel row-major = [kh·kw·C_in, C_out], bias last
        return ReducedConv2DTwoKroneckerFactored(layer.patch_size, layer.c_out,
                                                 has_bias=layer.use_bias, **kwargs)

    def uses_layer_tap(self, layer, input_shape):
        r"""Whether ``layer``'s forward tap is this block's :math:`\Omega`: a
        :class:`kfac_ref.nn.Conv2D` whose patches for ``input_shape`` are this block's
        patches (same geometry and bias), with ``symmetrize`` (the KFC factor).

        .. math:: \tau = \Omega = \frac{1}{N|T|}\sum_{n,t}\bar p_{n,t}\bar p_{n,t}^\top
        """
        if not (self.symmetrize and getattr(layer, "kind", None) == "conv2d"):
            return False
        mine, its = self.geometry, layer.geometry(tuple(input_shape))
        same = ("filter_shape", "strides", "dilation", "padding", "channels_last",
                "output_spatial_shape")
        return (mine.input_shape[1:] == its.input_shape[1:]
                and all(getattr(mine, f) == getattr(its, f) for f in same)
                and getattr(layer, "use_bias", None) == self.has_bias)

    def layer_tap(self, layer, input_shape):
        r""":func:`kfac_ref.factors.conv_input_factor_tap` of ``layer``'s geometry on inputs
        of shape ``input_shape`` when :meth:`uses_layer_tap`, else ``None``.

        .. math:: \tau = \Omega = \frac{1}{N|T|}\sum_{n,t}\bar p_{n,t}\bar p_{n,t}^\top
        """
        if not self.uses_layer_tap(layer, input_shape):
            return None
        return factors.conv_input_factor_tap(layer.geometry(tuple(input_shape)), self.has_bias)

    def fixed_scale(self):
        return float(self.num_locations)

    def _batch_statistics(self, xp, data, batch_size):
        x, g = data["inputs"], data["outputs_grad"]
        # the layer's forward pass computed Ω from its patches (layer_tap, forward_with_tap):
        # the same statistic, summed over the forward's chunks
        tap = data.get("input_factor")
        if self.symmetrize:
            a = tap if tap is not None else factors.conv_input_kronecker_factor.kernel(
                xp, x, self.geometry, self.has_bias)
            return (a, factors.conv_output_kronecker_factor.kernel(
                xp, g, self.geometry.channels_last))
        gl = self._grads_channels_last(xp, g)
        return (self._second_moment(xp, self._patches(x)),
                self._second_moment(xp, xp.reshape(gl, (-1, gl.shape[-1]))))


@capabilities(dask="yes")
class ReducedConv2DTwoKroneckerFactored(DenseTwoKroneckerFactored):
    r"""KFAC-reduce for a convolution (Eschenhagen et al. 2023): a dense Kronecker block on
    :math:`\bar{\bar p}_n = \frac1{|T|}\sum_t \bar p_{n,t}` and :math:`\hat g_n = \sum_t g_{n,t}`.

    .. math::

        B = \Big(\frac1N\sum_n \bar{\bar p}_n\bar{\bar p}_n^\top\Big)\otimes
        \Big(\frac1N\sum_n \hat g_n\hat g_n^\top\Big)

    Built by :meth:`Conv2DTwoKroneckerFactored.from_layer` with ``weight_sharing="reduce"``;
    parameters as :class:`DenseTwoKroneckerFactored` with ``input_size = kh·kw·C_in``.
    """

    @classmethod
    def from_layer(cls, layer, input_shape, *, weight_sharing="reduce", **kwargs):
        """The KFAC-reduce block of a conv layer."""
        return Conv2DTwoKroneckerFactored.from_layer(layer, input_shape, weight_sharing="reduce",
                                                     **kwargs)

    def layer_estimation_data(self, layer, inputs, outputs_grad, params_grads, batch_size,
                              weight_sharing="reduce"):
        """Location-averaged patches and location-summed output gradients, N rows."""
        return pooled_conv_data(layer, inputs, outputs_grad, batch_size), batch_size

    def _layer_rows(self, layer, inputs, outputs_grads, batch_size, weight_sharing):
        """The pooled patches once, the location-summed gradients of every vector."""
        data = pooled_conv_data(layer, inputs, outputs_grads[0], batch_size)
        xp = namespace_of(f"{type(self).__name__}.update_curvature_matrix_estimate",
                          inputs=inputs)
        gs = [data["outputs_grad"]]
        for g in outputs_grads[1:]:
            gl = to_channels_last(xp, g, layer.data_format == "NHWC")
            gs.append(xp.sum(xp.reshape(gl, (batch_size, -1, layer.c_out)), axis=1))
        return data["inputs"], gs, batch_size


register_layer_block("dense", "kronecker", DenseTwoKroneckerFactored, default=True)
register_layer_block("conv2d", "kronecker", Conv2DTwoKroneckerFactored, default=True)
register_layer_block("conv2d", "kronecker_reduce", ReducedConv2DTwoKroneckerFactored)


def _flat_factored_apply(xp, prepared, shape, flat):
    """:func:`~kfac_ref.linalg.kron_factored_apply` on a flat ``[W; b]`` slice, flat out."""
    return reshape(xp, kron_factored_apply(xp, prepared, reshape(xp, flat, shape)), (-1,))
