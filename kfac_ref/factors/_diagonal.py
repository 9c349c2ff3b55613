r"""Naive ("square of the sum") factors of TF K-FAC: the diagonal and the full matrix.

These take the gradient of the *summed* (sampled) loss with respect to the parameters,
:math:`\hat g = \sum_n \hat g_n`, and estimate the Fisher of the per-example average as
:math:`\hat g \hat g^\top / N`.  For targets sampled from the model the per-example
gradients have zero mean and are independent, so the estimator is unbiased; its variance
does not shrink with :math:`N`.  With data targets (empirical Fisher) it is biased by
:math:`(N-1)\,\bar g \bar g^\top` (see the theory page *Diagonal, naive and embedding
estimators*).  kfac-jax's ``NaiveDiagonal``/``NaiveFull``
use the same batch-summed gradient.
"""

from __future__ import annotations

from .._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_scalar,
    check_scalars_with,
    describe,
    kernel_of,
    namespace_of,
)
from .._support import capabilities
from ._base import (
    DenseSquareMatrixFactor,
    DiagonalFactor,
    is_array,
)


def _as_param_list(func, params_grads):
    if is_array(params_grads):
        return (params_grads,)
    if (isinstance(params_grads, (list, tuple)) and params_grads
            and all(is_array(p) for p in params_grads)):
        return tuple(params_grads)
    raise KFACTypeError(
        f"{func}: params_grads must be an array or a non-empty sequence of arrays (one per "
        f"parameter); got {describe(params_grads)}."
    )


@capabilities(dask="yes")
def params_grads_to_vector(params_grads):
    r"""Concatenate parameter-shaped arrays into one vector (TF's ``tensors_to_column``).

    .. math::

        v = \big[\mathrm{vec}_r(\hat g^{(1)});\ \dots;\ \mathrm{vec}_r(\hat g^{(k)})\big]

    Each array is flattened row-major, arrays in the order given.

    Parameters
    ----------
    params_grads : array or sequence of arrays

    Returns
    -------
    array [Σ sizes]
    """
    return _to_vector("params_grads_to_vector", params_grads)


def _to_vector(func, params_grads):
    """:func:`params_grads_to_vector`, reporting errors under the caller's name."""
    grads = _as_param_list(func, params_grads)
    xp = namespace_of(func, **{f"params_grads[{i}]": g for i, g in enumerate(grads)})
    for i, g in enumerate(grads):
        check_array(func, f"params_grads[{i}]", g)
    return xp.concat([xp.reshape(g, (-1,)) for g in grads], axis=0)


def _batch_size(func, batch_size, like=None):
    return check_scalar(func, "batch_size", batch_size, positive=True, like=like)


def _checked_vector(func, params_grads, batch_size):
    """``(xp, ĝ, N)``: the checked flat gradient vector and batch size of a naive factor."""
    v = _to_vector(func, params_grads)
    n = _batch_size(func, batch_size, {"params_grads": v})
    return namespace_of(func, params_grads=v), v, n


@capabilities(dask="yes")
def naive_diagonal_factor(params_grads, batch_size):
    r"""Naive diagonal Fisher estimate from the gradient of the summed loss.

    .. math::

        d = \frac{\hat g \odot \hat g}{N}, \qquad \hat g = \sum_n \hat g_n .

    Parameters
    ----------
    params_grads : array or sequence of arrays
        Gradient(s) of the summed (sampled) loss, one array per parameter.
    batch_size : int or float
        :math:`N > 0`.

    Returns
    -------
    array [Σ sizes]
        The diagonal, flattened as :func:`params_grads_to_vector` (``tf.contrib.kfac``
        returns it as a column ``[size, 1]``; TF master keeps the parameter's shape for a
        single parameter).

    Raises
    ------
    KFACValueError, KFACTypeError
        Non-positive batch size, non-finite or non-floating gradients, mixed namespaces.

    References
    ----------
    TF K-FAC ``NaiveDiagonalFactor`` / ``NaiveDiagonalFB``.
    """
    return _naive_diagonal_factor(*_checked_vector("naive_diagonal_factor", params_grads,
                                                   batch_size))


@kernel_of(naive_diagonal_factor)
def _naive_diagonal_factor(xp, vector, batch_size):
    """Unchecked kernel on the flat gradient vector."""
    return vector * vector / batch_size


@capabilities(dask="yes")
def full_factor(params_grads, batch_size):
    r"""Naive full Fisher estimate (rank one) from the gradient of the summed loss.

    .. math::

        F = \frac{\hat g\, \hat g^\top}{N}, \qquad \hat g = \sum_n \hat g_n .

    Parameters
    ----------
    params_grads : array or sequence of arrays
    batch_size : int or float

    Returns
    -------
    array [Σ sizes, Σ sizes]
        Exactly symmetric (an outer product).

    Raises
    ------
    KFACValueError, KFACTypeError
        As :func:`naive_diagonal_factor`.

    References
    ----------
    TF K-FAC ``FullFactor`` (seed) / ``NaiveFullFactor`` (master), ``NaiveFullFB``.
    """
    return _full_factor(*_checked_vector("full_factor", params_grads, batch_size))


@kernel_of(full_factor)
def _full_factor(xp, vector, batch_size):
    """Unchecked kernel on the flat gradient vector."""
    return vector[:, None] * vector[None, :] / batch_size


def _sources(func, params_grads):
    """TF: a sequence over sources, each a gradient or a sequence of gradients."""
    if is_array(params_grads):
        return ((params_grads,),)
    if isinstance(params_grads, (list, tuple)) and params_grads:
        out = tuple(_as_param_list(func, src) for src in params_grads)
        shapes = {tuple(tuple(g.shape) for g in src) for src in out}
        if len(shapes) != 1:
            raise KFACValueError(f"{func}: every source in params_grads must have the same "
                                 f"parameter shapes; got {sorted(shapes)}.")
        return out
    raise KFACTypeError(f"{func}: params_grads must be an array or a sequence over sources; "
                        f"got {describe(params_grads)}.")


def _per_source(func, params_grads, batch_size, kernel):
    """``(kernel(xp, ĝ_s, N),)`` for each source's flat gradient ĝ_s, all sources checked
    first."""
    vecs = [_to_vector(func, src) for src in _sources(func, params_grads)]
    check_scalars_with(func, {"params_grads": vecs[0]}, batch_size=batch_size)
    return tuple((kernel(namespace_of(func, params_grads=v), v, batch_size),) for v in vecs)


class _PerSourceMixin:
    """The update of the two naive factors: ``batch_size`` held from construction, one
    statistic ``_kernel(xp, ĝ_s, N)`` per source (:func:`_per_source`)."""

    _kernel = None

    def __init__(self, batch_size, **kwargs):
        super().__init__(**kwargs)
        self._set(batch_size=_batch_size(type(self).__name__, batch_size))

    def _contributions(self, params_grads):
        return _per_source(f"{self.name}.update_cov", params_grads, self.batch_size,
                           self._kernel)


@capabilities(dask="yes")
class NaiveDiagonalFactor(_PerSourceMixin, DiagonalFactor):
    r"""TF K-FAC's ``NaiveDiagonalFactor``: moving average of :func:`naive_diagonal_factor`
    summed over sources.

    .. math::

        \text{new\_cov} = \sum_{s} \frac{\hat g_s \odot \hat g_s}{N} .

    Data for :meth:`update_cov`: ``params_grads``, an array (one source, one parameter) or a
    sequence over sources whose items are an array or a sequence of per-parameter arrays.

    Parameters
    ----------
    batch_size : int or float
    zero_debias : bool
    """

    _kernel = staticmethod(_naive_diagonal_factor)


@capabilities(dask="yes")
class FullFactor(_PerSourceMixin, DenseSquareMatrixFactor):
    r"""TF K-FAC's ``FullFactor`` (``NaiveFullFactor`` in master): moving average of
    :func:`full_factor` summed over sources.

    .. math::

        \text{new\_cov} = \sum_{s} \frac{\hat g_s \hat g_s^\top}{N} .

    Data for :meth:`update_cov`: as :class:`NaiveDiagonalFactor`.
    """

    _kernel = staticmethod(_full_factor)


NaiveFullFactor = FullFactor
"""TF master's name for :class:`FullFactor`."""
