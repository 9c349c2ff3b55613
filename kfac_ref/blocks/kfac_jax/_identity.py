r"""The scaled-identity block family (kfac-jax ``ScaledIdentity``)."""

from __future__ import annotations

from ..._backend import check_scalar, eye_like, ones_like_shape
from ..._support import capabilities
from .._math import scaled_identity_matpower
from ._base import CurvatureBlock


@capabilities(dask="yes")
class ScaledIdentity(CurvatureBlock):
    r"""kfac-jax ``ScaledIdentity``: the block is :math:`sI`.

    .. math::

        (sI + \lambda I)^{p} v = (s + \lambda)^{p} v .

    ``update_curvature_matrix_estimate`` changes nothing (there are no statistics).
    """

    estimation_keys = ()

    def __init__(self, parameters_shapes, scale=1.0, **kwargs):
        super().__init__(parameters_shapes, **kwargs)
        self._scale = check_scalar(type(self).__name__, "scale", scale, nonnegative=True)

    def fixed_scale(self):
        return self._scale

    def _scalar_options(self):
        return {**super()._scalar_options(), "scale": self._scale}

    def _statistics_shapes(self):
        return ()

    def _batch_statistics(self, xp, data, batch_size):
        return ()

    def _apply(self, vector, lam, power, s):
        return tuple(scaled_identity_matpower(v, power, lam, scale=s) for v in vector)

    def _multiply_fresh(self, xp, state, vector, lam, power, exact):
        return self._apply(vector, lam, power, self.scale(state, False))

    def _multiply_cached(self, xp, state, vector, lam, power, exact):
        return self._apply(vector, lam, power, self._cache_get(state, "scale", "update_cache"))

    def _build_cache(self, xp, state, lam, exact, approx, eigenvalues):
        return {"eigenvalues": self._eigenvalues(xp, state)} if eigenvalues else {}

    def _eigenvalues(self, xp, state):
        return self.scale(state, False) * ones_like_shape(state.like, (self.dim,))

    def _dense_unscaled(self, xp, state):
        return eye_like(state.like, self.dim)

    def _norm_unscaled(self, xp, state, norm_type):
        return 1.0
