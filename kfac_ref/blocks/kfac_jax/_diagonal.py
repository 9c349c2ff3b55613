r"""The diagonal block family: one diagonal per parameter (kfac-jax ``Diagonal`` and its
layer blocks)."""

from __future__ import annotations

import math

from ... import factors
from ..._backend import check_option, eye_like
from ..._support import capabilities
from ...linalg import factor_norm
from .._math import apply_diagonal
from ._base import CurvatureBlock
from ._layers import (
    SOURCE_REDUCTIONS,
    ConvLayer,
    DenseLayer,
    ParamsGradsSources,
    ScaleAndShiftLayer,
)
from ._registry import register_layer_block


@capabilities(dask="yes")
class Diagonal(CurvatureBlock):
    r"""Diagonal blocks (kfac-jax ``Diagonal``): one diagonal per parameter.

    .. math::

        (s\,\mathrm{diag}(d) + \lambda I)^{p} v = (s d + \lambda)^{\odot p} \odot v

    (:func:`~kfac_ref.blocks.diagonal_block_matpower`); exact and approximate coincide, any
    power.  The norm is that of the whole diagonal matrix (kfac-jax multiplies the norms of
    the per-parameter diagonals instead, which is not a norm of the block when there are two
    parameters; the two agree for one parameter).  Abstract: a subclass gives the batch
    statistic (``_batch_statistics``).
    """

    def _statistics_shapes(self):
        return self.parameters_shapes

    def _diagonals(self, state):
        return tuple(s.value for s in state.statistics)

    def _apply(self, xp, diagonals, vector, lam, power, s):
        return tuple(apply_diagonal(xp, d, v, power, lam, s)
                     for d, v in zip(diagonals, vector, strict=True))

    def _multiply_fresh(self, xp, state, vector, lam, power, exact):
        return self._apply(xp, self._diagonals(state), vector, lam, power,
                           self.scale(state, False))

    def _multiply_cached(self, xp, state, vector, lam, power, exact):
        return self._apply(xp, self._cache_get(state, "diagonals", "update_cache"),
                           vector, lam, power, self._cache_get(state, "scale", "update_cache"))

    def _build_cache(self, xp, state, lam, exact, approx, eigenvalues):
        out = {"diagonals": self._diagonals(state)}
        if eigenvalues:
            out["eigenvalues"] = self._eigenvalues(xp, state)
        return out

    def _flat_diagonal(self, xp, state):
        return self._flatten(xp, self._diagonals(state))

    def _eigenvalues(self, xp, state):
        return self.scale(state, False) * self._flat_diagonal(xp, state)

    def _dense_unscaled(self, xp, state):
        d = self._flat_diagonal(xp, state)
        return eye_like(d, self.dim) * d[None, :]

    def _norm_unscaled(self, xp, state, norm_type):
        return factor_norm.kernel(xp, self._flat_diagonal(xp, state), norm_type)


@capabilities(dask="yes")
class NaiveDiagonal(ParamsGradsSources, Diagonal):
    r"""kfac-jax ``NaiveDiagonal`` / TF ``NaiveDiagonalFB``: the "square of the sum".

    .. math::

        \begin{aligned}
        d &= \frac{1}{N} \sum_{s} \hat g_s \odot \hat g_s
            &&\text{(per\_source, default; TF)},\\
        d &= \frac{1}{N} \Big(\sum_s \hat g_s\Big)^{\odot 2} &&\text{(summed; kfac-jax)},
        \end{aligned}

    from ``estimation_data["params_grads"]``: per parameter, the gradient
    :math:`\hat g_s = \sum_n \hat g_{s,n}` of the summed (sampled) loss, shaped like the
    parameter, or ``[S, *shape]`` for :math:`S` sources (Monte-Carlo samples).  With one source
    the two agree.  The statistic is :func:`kfac_ref.factors.naive_diagonal_factor`.
    """

    def __init__(self, parameters_shapes, source_reduction="per_source", **kwargs):
        super().__init__(parameters_shapes, **kwargs)
        self.source_reduction = check_option(type(self).__name__, "source_reduction",
                                             source_reduction, SOURCE_REDUCTIONS)

    def _batch_statistics(self, xp, sources, batch_size):
        flat = self._naive_statistic(sources, batch_size, factors.naive_diagonal_factor)
        return self._unflatten(xp, flat)


@capabilities(jit="yes", dask="yes")
class DenseDiagonal(DenseLayer, Diagonal):
    r"""kfac-jax ``DenseDiagonal`` / TF ``FullyConnectedDiagonalFB``: sum-of-squares diagonal.

    .. math::

        d_{ij} = \frac1N \sum_n (\bar a_{n,i}\, g_{n,j})^2
        = \tfrac1N\big[(\bar a\odot\bar a)^\top (g\odot g)\big]_{ij}

    (:func:`kfac_ref.factors.fully_connected_diagonal_factor`), split into the kernel rows and
    the bias row.

    Parameters
    ----------
    input_size, output_size : int
    has_bias : bool
    """

    def _batch_statistics(self, xp, data, batch_size):
        diag = factors.fully_connected_diagonal_factor.kernel(
            xp, data["inputs"], data["outputs_grad"], self.has_bias)
        d_in = self.parameters_shapes[0][0]
        return (diag[:d_in, :],) + ((diag[d_in, :],) if self.has_bias else ())


@capabilities(jit="yes", dask="yes")
class Conv2DDiagonal(ConvLayer, Diagonal):
    r"""kfac-jax ``Conv2DDiagonal`` / TF ``ConvDiagonalFB``: sum-of-squares diagonal.

    .. math::

        d = \frac1N \sum_n \Big(\sum_{t} \bar p_{n,t}\, g_{n,t}^\top\Big)^{\odot 2}

    (:func:`kfac_ref.factors.conv_diagonal_factor`), split into kernel ``[kh, kw, C_in, C_out]``
    and bias ``[C_out]``.  The scale is 1 and the damping is :math:`\lambda` (TF's
    ``|T|·normalize_damping(λ, |T|) = λ``).

    Parameters
    ----------
    inputs_shape : [N, H, W, C] (NHWC) or [N, C, H, W] (NCHW); the batch entry is ignored
    kernel_shape : [kh, kw, C_in, C_out] (HWIO)
    strides, padding, dilation_rate, data_format
        As :func:`kfac_ref.patches.extract_convolution_patches`.
    has_bias : bool
    """

    def _batch_statistics(self, xp, data, batch_size):
        diag = factors.conv_diagonal_factor.kernel(xp, data["inputs"], data["outputs_grad"],
                                                   self.geometry, self.has_bias)
        k = math.prod(self.kernel_shape[:3])
        new = (xp.reshape(diag[:k, :], self.kernel_shape),)
        return new + ((diag[k, :],) if self.has_bias else ())


@capabilities(dask="yes")
class ScaleAndShiftDiagonal(ScaleAndShiftLayer, Diagonal):
    r"""kfac-jax ``ScaleAndShiftDiagonal`` / TF ``ScaleAndShiftDiagonalFB``.

    .. math::

        \begin{aligned}
        y &= \gamma \odot x + \beta,\\
        d_\gamma &= \frac1N\sum_n \Big(\sum_{\text{bcast}} x_n \odot g_n\Big)^{\odot 2},\\
        d_\beta &= \frac1N\sum_n \Big(\sum_{\text{bcast}} g_n\Big)^{\odot 2}
        \end{aligned}

    (:func:`kfac_ref.factors.scale_and_shift_factor`, ``approx="diagonal"``; the sums run over
    the axes the parameter is broadcast along).

    Parameters
    ----------
    inputs_shape : tuple of int
        Per-example input shape (no batch axis).
    scale_shape, shift_shape : tuple of int or None
        Parameter shapes, broadcastable against ``inputs_shape`` (right-aligned).
    """

    def _batch_statistics(self, xp, data, batch_size):
        return self._unflatten(xp, self._statistic(xp, data, "diagonal"))


for _kind in ("dense", "conv2d", "scale_and_shift", "embedding"):
    register_layer_block(_kind, "naive_diagonal", NaiveDiagonal, default=_kind == "embedding")
register_layer_block("dense", "diagonal", DenseDiagonal)
register_layer_block("conv2d", "diagonal", Conv2DDiagonal)
register_layer_block("scale_and_shift", "diagonal", ScaleAndShiftDiagonal, default=True)
