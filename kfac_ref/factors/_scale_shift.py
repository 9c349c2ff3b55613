r"""Scale-and-shift (elementwise affine, e.g. layer-norm gain/bias) factors of TF K-FAC master.

A layer :math:`y = s \odot x + b` whose scale :math:`s` and shift :math:`b` are broadcast
along some axes has per-example parameter gradients

.. math::

    \nabla_s \ell_n = \sum_{\text{broadcast axes of } s} x_n \odot g_n, \qquad
    \nabla_b \ell_n = \sum_{\text{broadcast axes of } b} g_n ,

and the factor is the per-example ("sum of squares") second moment of the concatenated
gradient :math:`v_n = [\mathrm{vec}_r \nabla_s \ell_n;\ \mathrm{vec}_r \nabla_b \ell_n]`: the
full matrix :math:`\frac1N\sum_n v_n v_n^\top` or its diagonal.  Its variance shrinks like
:math:`1/N` (unlike the naive square-of-the-sum factors).
"""

from __future__ import annotations

from .._backend import (
    KFACValueError,
    check_array,
    check_bool,
    check_option,
    describe,
    kernel_of,
    namespace_of,
)
from .._support import capabilities
from ..linalg import compute_cov
from ._base import (
    DenseSquareMatrixFactor,
    DiagonalFactor,
    input_towers_and_sources,
    per_source_and_tower,
)

SCALE_AND_SHIFT_APPROX = ("full", "diagonal")
"""The two estimates of a scale-and-shift layer's curvature (``approx=``): ``"full"`` (the
whole sum-of-squares matrix of the scale and shift gradients, TF's ``ScaleAndShiftFullFB``)
and ``"diagonal"`` (its diagonal, TF's ``ScaleAndShiftDiagonalFB``)."""


def _axes(func, name, dims, ndim):
    if isinstance(dims, int) and not isinstance(dims, bool):
        dims = (dims,)
    if (not isinstance(dims, (list, tuple))
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims)):
        raise KFACValueError(f"{func}: {name} must be a sequence of axis indices; got "
                             f"{describe(dims)}.")
    dims = tuple(d + ndim if d < 0 else d for d in dims)
    if any(not 1 <= d < ndim for d in dims) or len(set(dims)) != len(dims):
        raise KFACValueError(f"{func}: {name} must be distinct non-batch axes in [1, {ndim}); "
                             f"got {dims}.")
    return dims


@capabilities(dask="yes")
def scale_and_shift_factor(inputs, outputs_grad, broadcast_dims_scale, broadcast_dims_shift=None,
                           has_shift=True, approx="full"):
    r"""Per-example second moment of a scale-and-shift layer's parameter gradient.

    .. math::

        v_n = \Big[\mathrm{vec}_r \sum_{a \in B_s} (x_n \odot g_n)\ ;\
                  \mathrm{vec}_r \sum_{a \in B_b} g_n\Big], \qquad
        F = \frac{1}{N} \sum_n v_n v_n^\top \ (\text{full}) \quad\text{or}\quad
        \frac{1}{N} \sum_n v_n \odot v_n \ (\text{diagonal}),

    where :math:`B_s` (:math:`B_b`) are the axes along which the scale (shift) is
    broadcast; the summed axes are kept out of the parameter vector, the others are
    flattened row-major.  ``inputs`` broadcasts against ``outputs_grad`` (array-API rules).

    Parameters
    ----------
    inputs : array [N, ...]
        :math:`x`, the input multiplied by the scale.
    outputs_grad : array [N, ...]
        :math:`g`, same rank as ``inputs``.
    broadcast_dims_scale, broadcast_dims_shift : sequence of int
        Non-batch axes summed over (``broadcast_dims_shift`` required when ``has_shift``).
    has_shift : bool
    approx : {"full", "diagonal"}

    Returns
    -------
    array [P, P] (full) or [P] (diagonal)
        :math:`P` = scale size (+ shift size).

    Raises
    ------
    KFACValueError, KFACTypeError
        Rank or batch mismatch, bad axes, missing shift axes, unknown ``approx``.

    References
    ----------
    TF K-FAC master ``ScaleAndShiftFactor`` (``ScaleAndShiftFullFactor``,
    ``ScaleAndShiftDiagonalFactor``).
    """
    func = "scale_and_shift_factor"
    xp = namespace_of(func, inputs=inputs, outputs_grad=outputs_grad)
    check_array(func, "inputs", inputs, min_ndim=2, layout="[N, ...]")
    check_bool(func, "has_shift", has_shift)
    check_option(func, "approx", approx, SCALE_AND_SHIFT_APPROX)
    ds, db = _check_ss(func, inputs, outputs_grad, broadcast_dims_scale, broadcast_dims_shift,
                       has_shift)
    return _scale_and_shift_factor(xp, inputs, outputs_grad, ds, db, approx)


def _check_ss(func, inputs, outputs_grad, broadcast_dims_scale, broadcast_dims_shift,
              has_shift, name="outputs_grad"):
    """``outputs_grad`` against checked ``inputs``; the normalised axes (``db`` None without
    a shift)."""
    check_array(func, name, outputs_grad, ndim=inputs.ndim, layout="[N, ...]")
    n = outputs_grad.shape[0]
    if inputs.shape[0] != n or n == 0:
        raise KFACValueError(f"{func}: inputs and {name} must share a positive batch "
                             f"size; got {inputs.shape[0]} and {n}.")
    for i in range(1, inputs.ndim):
        if inputs.shape[i] not in (1, outputs_grad.shape[i]):
            raise KFACValueError(f"{func}: inputs must broadcast against {name}; got "
                                 f"shapes {tuple(inputs.shape)} and {tuple(outputs_grad.shape)}.")
    ds = _axes(func, "broadcast_dims_scale", broadcast_dims_scale, inputs.ndim)
    db = None
    if has_shift:
        if broadcast_dims_shift is None:
            raise KFACValueError(f"{func}: broadcast_dims_shift must be given when has_shift; "
                                 "got None.")
        db = _axes(func, "broadcast_dims_shift", broadcast_dims_shift, inputs.ndim)
    return ds, db


@kernel_of(scale_and_shift_factor)
def _scale_and_shift_factor(xp, inputs, outputs_grad, ds, db=None, approx="full"):
    """Unchecked kernel (axes normalised; ``db=None``: no shift)."""
    n = outputs_grad.shape[0]
    grads = xp.sum(inputs * outputs_grad, axis=ds) if ds else inputs * outputs_grad
    parts = [xp.reshape(grads, (n, -1))]
    if db is not None:
        shift = xp.sum(outputs_grad, axis=db) if db else outputs_grad
        parts.append(xp.reshape(shift, (n, -1)))
    v = xp.concat(parts, axis=1) if len(parts) > 1 else parts[0]
    if approx == "full":
        return compute_cov.kernel(xp, v)
    return xp.sum(v * v, axis=0) / float(n)


class _ScaleAndShiftMixin:
    def _init_ss(self, broadcast_dims_scale, broadcast_dims_shift, has_shift):
        func = type(self).__name__
        self._set(broadcast_dims_scale=broadcast_dims_scale,
                  broadcast_dims_shift=broadcast_dims_shift,
                  has_shift=check_bool(func, "has_shift", has_shift))

    def _contributions(self, inputs, outputs_grads):
        func = f"{self.name}.update_cov"
        towers, st = input_towers_and_sources(func, inputs, outputs_grads)
        for x in towers:  # each input tower checked once, whatever the number of sources
            check_array(func, "inputs", x, min_ndim=2, layout="[N, ...]")

        def statistic(x, g):
            xp = namespace_of(func, inputs=x, outputs_grads=g)
            ds, db = _check_ss(func, x, g, self.broadcast_dims_scale, self.broadcast_dims_shift,
                               self.has_shift, name="outputs_grads")
            return _scale_and_shift_factor(xp, x, g, ds, db, self._approx)

        return per_source_and_tower(st, towers, statistic)


@capabilities(dask="yes")
class ScaleAndShiftFullFactor(_ScaleAndShiftMixin, DenseSquareMatrixFactor):
    r"""TF master's ``ScaleAndShiftFullFactor``: moving average of the full
    :func:`scale_and_shift_factor` (sources summed, towers averaged).

    .. math:: \text{new\_cov} = \frac{1}{n_{\text{towers}}}\sum_{s,t} \frac1N \sum_n v_n v_n^\top

    Data for :meth:`update_cov`: ``inputs`` (array or towers), ``outputs_grads`` (array or
    sources × towers).
    """

    _approx = "full"

    def __init__(self, broadcast_dims_scale, broadcast_dims_shift=None, has_shift=True,
                 **kwargs):
        super().__init__(**kwargs)
        self._init_ss(broadcast_dims_scale, broadcast_dims_shift, has_shift)


@capabilities(dask="yes")
class ScaleAndShiftDiagonalFactor(_ScaleAndShiftMixin, DiagonalFactor):
    r"""TF master's ``ScaleAndShiftDiagonalFactor``: moving average of the diagonal
    :func:`scale_and_shift_factor`.

    .. math:: \text{new\_cov} = \frac{1}{n_{\text{towers}}}\sum_{s,t} \frac1N \sum_n v_n \odot v_n
    """

    _approx = "diagonal"

    def __init__(self, broadcast_dims_scale, broadcast_dims_shift=None, has_shift=True,
                 **kwargs):
        super().__init__(**kwargs)
        self._init_ss(broadcast_dims_scale, broadcast_dims_shift, has_shift)
