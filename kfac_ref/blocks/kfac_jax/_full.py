r"""The full block family: one dense symmetric PSD matrix over the block's parameters
(kfac-jax ``Full`` and its layer blocks)."""

from __future__ import annotations

from ... import factors
from ..._backend import check_option
from ..._support import DASK_NO_EIGH, capabilities
from ...linalg import append_homog, clipped_eigh, compute_cov, factor_norm
from .._math import apply_full, prepare_full
from ._base import CurvatureBlock
from ._layers import (
    SOURCE_REDUCTIONS,
    ConvLayer,
    DenseLayer,
    ParamsGradsSources,
    ScaleAndShiftLayer,
)
from ._registry import register_layer_block


@capabilities(dask=DASK_NO_EIGH)
class Full(CurvatureBlock):
    r"""Full (dense) blocks (kfac-jax ``Full``): one symmetric PSD matrix.

    .. math::

        (sF + \lambda I)^{p} v = Q\,(s\sigma + \lambda)^{\odot p} \odot Q^\top v,
        \qquad F = Q\,\mathrm{diag}(\sigma)\,Q^\top

    (:func:`~kfac_ref.blocks.full_block_matpower`); exact and approximate coincide, any power.
    The cache stores the eigendecomposition, so the identity weight is applied at product time
    (kfac-jax caches damped inverses below its eigendecomposition threshold instead).
    Abstract: a subclass gives the batch statistic (``_batch_statistics``).
    """

    semidefinite_statistics = (0,)  # the second moment of the per-example gradients

    def _statistics_shapes(self):
        return ((self.dim, self.dim),)

    # the working form is the flat vector, the order of the dense matrix
    def _to_working_form(self, xp, vector):
        return self._flatten(xp, vector)

    def _from_working_form(self, xp, work):
        return self._unflatten(xp, work)

    def _flat_to_working_form(self, xp, flat):
        return flat

    def _working_form_to_flat(self, xp, work):
        return work

    def _product(self, xp, matrix, eig, flat, lam, power, s):
        return apply_full(xp, matrix, eig, flat, power, lam, s)

    def _multiply_fresh(self, xp, state, vector, lam, power, exact):
        matrix = state.statistics[0].value
        eig = None if power == 1.0 else prepare_full(xp, matrix,
                                                     self.eigenvalue_clipping_threshold)
        return self._product(xp, matrix, eig, vector, lam, power, self.scale(state, False))

    def _multiply_cached(self, xp, state, vector, lam, power, exact):
        matrix = self._cache_get(state, "matrix", "update_cache")
        eig = None if power == 1.0 else self._cache_get(
            state, "eigen", "update_cache with a power declared in init")
        return self._product(xp, matrix, eig, vector, lam, power,
                             self._cache_get(state, "scale", "update_cache"))

    def _build_cache(self, xp, state, lam, exact, approx, eigenvalues):
        matrix = state.statistics[0].value
        out = {"matrix": matrix}
        if exact or approx or eigenvalues:
            out["eigen"] = prepare_full(xp, matrix, self.eigenvalue_clipping_threshold)
        if eigenvalues:
            out["eigenvalues"] = self.scale(state, False) * out["eigen"][0]
        return out

    def _eigenvalues(self, xp, state):
        s, _ = clipped_eigh.kernel(xp, state.statistics[0].value,
                                   self.eigenvalue_clipping_threshold)
        return self.scale(state, False) * s

    def _dense_unscaled(self, xp, state):
        return state.statistics[0].value

    def _norm_unscaled(self, xp, state, norm_type):
        return factor_norm.kernel(xp, state.statistics[0].value, norm_type)


@capabilities(dask=DASK_NO_EIGH)
class NaiveFull(ParamsGradsSources, Full):
    r"""kfac-jax ``NaiveFull`` / TF ``NaiveFullFB``: rank-one "square of the sum" estimate.

    .. math::

        \begin{aligned}
        F &= \frac1N \sum_s \hat g_s \hat g_s^\top
            &&\text{(per\_source, default; TF,}\\
          & &&\ \text{and kfac-jax's extra leading axis)},\\
        F &= \frac1N \Big(\sum_s \hat g_s\Big)\Big(\sum_s \hat g_s\Big)^\top
            &&\text{(summed)},
        \end{aligned}

    with ``estimation_data["params_grads"]`` as in :class:`NaiveDiagonal`
    (:func:`kfac_ref.factors.full_factor`).
    """

    def __init__(self, parameters_shapes, source_reduction="per_source", **kwargs):
        super().__init__(parameters_shapes, **kwargs)
        self.source_reduction = check_option(type(self).__name__, "source_reduction",
                                             source_reduction, SOURCE_REDUCTIONS)

    def _batch_statistics(self, xp, sources, batch_size):
        return (self._naive_statistic(sources, batch_size, factors.full_factor),)


@capabilities(jit="yes", dask=DASK_NO_EIGH)
class DenseFull(DenseLayer, Full):
    r"""kfac-jax ``DenseFull``: exact second moment of a dense layer's per-example gradients.

    .. math::

        F = \frac1N \sum_n \mathrm{vec}_r(\bar a_n g_n^\top)\,
            \mathrm{vec}_r(\bar a_n g_n^\top)^\top,
        \qquad \mathrm{vec}_r(\bar a g^\top) = \bar a \otimes g,

    ordered as ``(kernel [d_in, d_out] row-major, bias [d_out])``
    (:func:`kfac_ref.linalg.compute_cov` of the per-example tangents).

    Parameters
    ----------
    input_size, output_size : int
    has_bias : bool
    """

    def _batch_statistics(self, xp, data, batch_size):
        a, g = data["inputs"], data["outputs_grad"]
        if self.has_bias:
            a = append_homog.kernel(xp, a)
        tangents = xp.reshape(a[:, :, None] * g[:, None, :], (a.shape[0], -1))
        return (compute_cov.kernel(xp, tangents),)


@capabilities(jit="yes", dask=DASK_NO_EIGH)
class Conv2DFull(ConvLayer, Full):
    r"""kfac-jax ``Conv2DFull``: exact second moment of a conv layer's per-example gradients.

    .. math::

        \begin{aligned}
        F &= \frac1N \sum_n \mathrm{vec}_r(DW_n)\,\mathrm{vec}_r(DW_n)^\top,\\
        DW_n &= \sum_t \bar p_{n,t}\, g_{n,t}^\top \in \mathbb{R}^{(K+1)\times C_{out}},
        \end{aligned}

    patches from :func:`kfac_ref.factors.conv_patch_matrix`, ordered (kernel row-major, bias).
    Parameters as :class:`Conv2DDiagonal`.
    """

    def _batch_statistics(self, xp, data, batch_size):
        tangents = self._per_example_grads(xp, data["inputs"], data["outputs_grad"])
        return (compute_cov.kernel(xp, tangents),)


@capabilities(dask=DASK_NO_EIGH)
class ScaleAndShiftFull(ScaleAndShiftLayer, Full):
    r"""kfac-jax ``ScaleAndShiftFull`` / TF ``ScaleAndShiftFullFB``.

    .. math::

        \begin{aligned}
        F &= \frac1N\sum_n t_n t_n^\top,\\
        t_n &= \Big[\mathrm{vec}_r\big(\textstyle\sum_{\text{bcast}} x_n\odot g_n\big);\
            \mathrm{vec}_r\big(\textstyle\sum_{\text{bcast}} g_n\big)\Big]
        \end{aligned}

    (:func:`kfac_ref.factors.scale_and_shift_factor`, ``approx="full"``).  Parameters as
    :class:`ScaleAndShiftDiagonal`.
    """

    def _batch_statistics(self, xp, data, batch_size):
        return (self._statistic(xp, data, "full"),)


for _kind in ("dense", "conv2d", "scale_and_shift", "embedding"):
    register_layer_block(_kind, "naive_full", NaiveFull)
register_layer_block("dense", "full", DenseFull)
register_layer_block("conv2d", "full", Conv2DFull)
register_layer_block("scale_and_shift", "full", ScaleAndShiftFull)
