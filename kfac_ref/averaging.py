r"""Moving averages of curvature statistics: TF K-FAC's and kfac-jax's, on one formula.

Both libraries keep a weighted sum and its total weight,

.. math::

    S_k = \delta_k S_{k-1} + w_k X_k, \qquad W_k = \delta_k W_{k-1} + w_k,
    \qquad \bar X_k = S_k / W_k ,

with :math:`S_0 = 0, W_0 = 0`.  TF K-FAC calls :math:`\delta` the decay and :math:`w` the
weight and reports :math:`\bar X_k` ("zero-debiased", ``ZERO_DEBIAS = True``) or the raw
:math:`S_k` (``ZERO_DEBIAS = False``); TF's contrib-era ``assign_moving_average`` is the
special case :math:`w = 1 - \delta`, where :math:`W_k = 1 - \delta^k`.  kfac-jax's
``WeightedMovingAverage`` calls them ``ema_old`` and ``ema_new`` and always reports
:math:`\bar X_k`.  With ``decay = ema_old`` and ``weight = ema_new`` the zero-debiased TF
average and the kfac-jax average are the same number.

States are immutable: ``update`` returns a new object.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from ._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_bool,
    check_scalar,
    is_array,
    is_lazy,
    kernel_of,
    namespace_of,
    zeros_like_shape,
)
from ._support import capabilities

__all__ = [
    "weighted_accumulate",
    "MovingAverageVariable",
    "WeightedMovingAverage",
    "sync_statistics",
]


@capabilities(jit="yes", dask="yes")
def weighted_accumulate(old, new, old_weight, new_weight):
    r"""One step of a weighted moving sum.

    .. math::

        S \leftarrow \delta\, S + w\, X

    where ``old`` is :math:`S`, ``new`` is :math:`X`, ``old_weight`` :math:`\delta \ge 0`
    and ``new_weight`` :math:`w \ge 0`.  Both :class:`MovingAverageVariable` and
    :class:`WeightedMovingAverage` update their sum and their total weight with this.
    ``old`` and ``new`` are two arrays of one shape, namespace, device and dtype, or two
    real numbers.

    Raises
    ------
    KFACValueError, KFACTypeError
        Non-finite or mismatched arrays, an array next to a number, negative or
        non-finite weights.
    """
    func = "weighted_accumulate"
    like = None
    if is_array(old) or is_array(new):
        _check_same_arrays(func, ("old", old), ("new", new))
        like = {"old": old}
    else:
        old = check_scalar(func, "old", old)
        new = check_scalar(func, "new", new)
    old_weight = check_scalar(func, "old_weight", old_weight, nonnegative=True, like=like)
    new_weight = check_scalar(func, "new_weight", new_weight, nonnegative=True, like=like)
    return _weighted_accumulate(old, new, old_weight, new_weight)


@kernel_of(weighted_accumulate)
def _weighted_accumulate(old, new, old_weight, new_weight):
    # Weights of exactly 0 or 1 (the first update, ema_old = 0 and ema_new = 1) skip their
    # products: 0·S = 0 and 1·X = X exactly for the finite sums kept here.  Only Python
    # numbers are compared, so a traced weight takes the general formula.
    keep_old = not (_is_number(old_weight) and old_weight == 0)
    scaled_new = new if _is_number(new_weight) and new_weight == 1 else new_weight * new
    return old_weight * old + scaled_new if keep_old else scaled_new


def _accumulate_sum_and_weight(raw, total, x, old_weight, new_weight):
    r"""One update of an average's sum and weight (unchecked):
    :math:`(\delta S + w X,\ \delta W + w)`."""
    return (_weighted_accumulate(raw, x, old_weight, new_weight),
            _weighted_accumulate(total, 1.0, old_weight, new_weight))


def _is_number(w):
    return isinstance(w, numbers.Real)


def _check_same_arrays(func, reference, other):
    """Two finite real floating arrays of one namespace, device, dtype and shape."""
    (ref_name, ref), (name, x) = reference, other
    namespace_of(func, **{ref_name: ref, name: x})
    check_array(func, ref_name, ref)
    check_array(func, name, x)
    if tuple(x.shape) != tuple(ref.shape):
        raise KFACValueError(
            f"{func}: {name} must have the shape of {ref_name} {tuple(ref.shape)}; got shape "
            f"{tuple(x.shape)}."
        )


def _check_state(func, raw, weight_name, weight):
    """The stored sum of an average: a finite real floating array; its weight ≥ 0."""
    namespace_of(func, raw=raw)
    check_array(func, "raw", raw)
    return check_scalar(func, weight_name, weight, nonnegative=True, like={"raw": raw})


def _check_update(func, raw, x, old_weight, new_weight, names):
    # The stored sum was validated when the average was built; only the new value is read.
    namespace_of(func, value=raw, x=x)
    check_array(func, "x", x)
    if tuple(x.shape) != tuple(raw.shape):
        raise KFACValueError(
            f"{func}: x must have the averaged shape {tuple(raw.shape)}; got shape "
            f"{tuple(x.shape)}."
        )
    like = {"value": raw}
    old_weight = check_scalar(func, names[0], old_weight, nonnegative=True, like=like)
    new_weight = check_scalar(func, names[1], new_weight, nonnegative=True, like=like)
    return old_weight, new_weight


def _unchecked(cls, **fields):
    """A frozen average built from already-validated fields (no second scan of ``raw``)."""
    obj = object.__new__(cls)
    for key, value in fields.items():
        object.__setattr__(obj, key, value)
    return obj


@capabilities(dask="yes")
@dataclass(frozen=True)
class MovingAverageVariable:
    r"""TF K-FAC's moving average with optional zero-debiasing.

    .. math::

        S \leftarrow \delta S + w X,\quad W \leftarrow \delta W + w,\quad
        \text{value} = \begin{cases} S / W & \text{zero\_debias} \\ S & \text{otherwise}
        \end{cases}

    With ``zero_debias=True`` two updates with batch statistics :math:`c_1, c_2`, decay
    :math:`d` and weight 1 give :math:`(d c_1 + c_2)/(d + 1)`.  Before the first update the
    value is the initial sum (zeros unless ``initial_value`` is given to :meth:`zeros_like`).

    Attributes
    ----------
    raw : array
        The weighted sum :math:`S`.
    total_weight : float
        :math:`W`.
    zero_debias : bool
        TF's ``ZERO_DEBIAS``.
    """

    raw: Any
    total_weight: float = 0.0
    zero_debias: bool = True

    def __post_init__(self):
        func = "MovingAverageVariable"
        weight = _check_state(func, self.raw, "total_weight", self.total_weight)
        object.__setattr__(self, "total_weight", weight)
        check_bool(func, "zero_debias", self.zero_debias)

    @classmethod
    def zeros_like(cls, like, zero_debias=True, initial_value=None):
        r"""A fresh average shaped like ``like``: :math:`S_0 = 0` (or ``initial_value``),
        :math:`W_0 = 0`.

        A non-zero ``initial_value`` (TF's ``INIT_COVARIANCES_AT_ZERO = False`` starts
        covariances at :math:`I`) only makes sense without zero-debiasing, where it decays
        as :math:`\delta^k S_0`; with debiasing it is rejected.
        """
        func = "MovingAverageVariable.zeros_like"
        namespace_of(func, like=like, initial_value=initial_value)
        check_array(func, "like", like)
        check_bool(func, "zero_debias", zero_debias)
        if initial_value is None:
            return _unchecked(cls, raw=zeros_like_shape(like, like.shape), total_weight=0.0,
                              zero_debias=zero_debias)
        if zero_debias:
            raise KFACValueError(f"{func}: initial_value must be None when zero_debias=True "
                                 "(the debiased value ignores S_0 only if S_0 = 0); got an "
                                 "array.")
        check_array(func, "initial_value", initial_value, shape=tuple(like.shape))
        return _unchecked(cls, raw=initial_value, total_weight=0.0, zero_debias=False)

    def update(self, x, decay, weight=1.0):
        r"""Return the average after :math:`S \leftarrow \delta S + w X`,
        :math:`W \leftarrow \delta W + w`.

        ``decay`` is :math:`\delta \ge 0` and ``weight`` is :math:`w \ge 0` (TF's
        estimator passes ``ema_weight = 1``; the contrib-era factor passes
        :math:`1 - \delta`).
        """
        decay, weight = _check_update("MovingAverageVariable.update", self.raw, x, decay,
                                      weight, ("decay", "weight"))
        raw, total = _accumulate_sum_and_weight(self.raw, self.total_weight, x, decay, weight)
        return _unchecked(MovingAverageVariable, raw=raw, total_weight=total,
                          zero_debias=self.zero_debias)

    @property
    def value(self):
        r"""The average: :math:`S/W` with zero-debiasing (S before any update), else
        :math:`S`."""
        if self.zero_debias and self.total_weight > 0:
            return self.raw / self.total_weight
        return self.raw


@capabilities(dask="yes")
@dataclass(frozen=True)
class WeightedMovingAverage:
    r"""kfac-jax's weighted moving average (``ema_old``, ``ema_new``).

    .. math::

        S \leftarrow \texttt{ema\_old}\; S + \texttt{ema\_new}\; X, \quad
        W \leftarrow \texttt{ema\_old}\; W + \texttt{ema\_new}, \quad
        \text{value} = S / W .

    ``ema_old = 0, ema_new = 1`` replaces the value by the new statistic; ``ema_old = 1,
    ema_new = 1`` accumulates a running mean of all statistics seen.  The same numbers as
    :class:`MovingAverageVariable` with ``zero_debias=True``, ``decay = ema_old``,
    ``weight = ema_new``.  Before the first update the value is zero.
    """

    raw: Any
    weight: float = 0.0

    def __post_init__(self):
        weight = _check_state("WeightedMovingAverage", self.raw, "weight", self.weight)
        object.__setattr__(self, "weight", weight)

    @classmethod
    def zeros_like(cls, like):
        """A fresh average shaped like ``like`` (:math:`S_0 = 0`, :math:`W_0 = 0`)."""
        func = "WeightedMovingAverage.zeros_like"
        namespace_of(func, like=like)
        check_array(func, "like", like)
        return _unchecked(cls, raw=zeros_like_shape(like, like.shape), weight=0.0)

    def update(self, x, ema_old, ema_new):
        r"""Return the average after one update with :math:`X`
        (:math:`S \leftarrow \texttt{ema\_old}\,S + \texttt{ema\_new}\,X`)."""
        ema_old, ema_new = _check_update("WeightedMovingAverage.update", self.raw, x, ema_old,
                                         ema_new, ("ema_old", "ema_new"))
        raw, weight = _accumulate_sum_and_weight(self.raw, self.weight, x, ema_old, ema_new)
        return _unchecked(WeightedMovingAverage, raw=raw, weight=weight)

    @property
    def value(self):
        r"""The average :math:`S / W` (zeros before any update)."""
        if is_array(self.weight) and is_lazy(positive := self.weight > 0):
            # inside jax.jit (W traced, or closed over and staged out): no host branch
            xp = namespace_of("WeightedMovingAverage.value", raw=self.raw)
            return self.raw / xp.where(positive, self.weight, 1.0)
        if self.weight > 0:
            return self.raw if self.weight == 1 else self.raw / self.weight
        return self.raw


@capabilities(dask="yes")
def sync_statistics(values, batch_sizes=None):
    r"""The statistics of several shards combined exactly, weighted by their batch sizes.

    .. math::

        \bar X = \sum_{k=1}^{K} \frac{n_k}{n}\, X_k, \qquad n = \sum_k n_k;
        \qquad
        S = \sum_k \frac{n_k}{n} S_k,\quad W = \sum_k \frac{n_k}{n} W_k
        \ \text{(moving averages)} .

    A batch statistic that is a mean over examples (a Kronecker factor
    :math:`\frac1n\sum_i x_i x_i^\top`, a diagonal, a full second moment) is the
    :math:`n_k`-weighted mean of its shards' statistics, and a moving-average update is
    linear in the statistic: shards that start from one synced average and are updated with
    the same ``ema_old``, ``ema_new`` on their own :math:`n_k` examples sync to the average
    the whole batch gives.  kfac-jax's ``sync`` (``pmean`` over the devices of a
    ``pmap_axis_name``) is the case of equal shards, the default here.

    Parameters
    ----------
    values : sequence
        One entry per shard, all of one kind: arrays of one shape (the same namespace,
        device and dtype), real numbers, or :class:`WeightedMovingAverage` /
        :class:`MovingAverageVariable` objects (the same ``zero_debias``) of one shape.
    batch_sizes : sequence of int, optional
        :math:`n_k \ge 1`, one per shard; ``None`` weights the shards equally.

    Returns
    -------
    array, float or the averages' class
        :math:`\bar X` (an average: its sum :math:`S` and weight :math:`W` combined).

    Raises
    ------
    KFACValueError, KFACTypeError
        No shards, mixed kinds, mismatched shapes or namespaces, a length of
        ``batch_sizes`` other than the number of shards, a batch size below 1.
    """
    func = "sync_statistics"
    if not isinstance(values, (list, tuple)) or not values:
        raise KFACValueError(f"{func}: values must be a non-empty list or tuple (one entry per "
                             f"shard); got {type(values).__name__}.")
    fractions = _shard_fractions(func, len(values), batch_sizes)
    first = values[0]
    if isinstance(first, (WeightedMovingAverage, MovingAverageVariable)):
        cls = type(first)
        for k, v in enumerate(values):
            if type(v) is not cls:
                raise KFACTypeError(f"{func}: values[{k}] must be a {cls.__name__} like "
                                    f"values[0]; got {type(v).__name__}.")
            if cls is MovingAverageVariable and v.zero_debias != first.zero_debias:
                raise KFACValueError(f"{func}: values[{k}].zero_debias must equal values[0]'s "
                                     f"({first.zero_debias}); got {v.zero_debias}.")
        _check_shards(func, [v.raw for v in values], "values[{}].raw")
    elif is_array(first):
        _check_shards(func, values, "values[{}]")
    else:
        for k, v in enumerate(values):
            check_scalar(func, f"values[{k}]", v)
    return _sync_statistics(values, fractions)


def _shard_fractions(func, count, batch_sizes):
    if batch_sizes is None:
        return (1.0 / count,) * count
    if not isinstance(batch_sizes, (list, tuple)) or len(batch_sizes) != count:
        raise KFACValueError(f"{func}: batch_sizes must be None or one size per shard "
                             f"({count}); got {batch_sizes!r}.")
    sizes = []
    for k, n in enumerate(batch_sizes):
        n = check_scalar(func, f"batch_sizes[{k}]", n, integer=True)
        if n < 1:
            raise KFACValueError(f"{func}: batch_sizes[{k}] must be an integer >= 1; got {n}.")
        sizes.append(n)
    total = sum(sizes)
    return tuple(n / total for n in sizes)


def _check_shards(func, arrays, name):
    named = {name.format(k): a for k, a in enumerate(arrays)}
    namespace_of(func, **named)
    (ref_name, ref), *rest = named.items()
    check_array(func, ref_name, ref)
    for k, a in rest:
        if not is_array(a):
            raise KFACTypeError(f"{func}: {k} must be an array like {ref_name}; got "
                                f"{type(a).__name__}.")
        check_array(func, k, a)
        if tuple(a.shape) != tuple(ref.shape):
            raise KFACValueError(f"{func}: {k} must have the shape of {ref_name} "
                                 f"{tuple(ref.shape)}; got shape {tuple(a.shape)}.")


@kernel_of(sync_statistics)
def _sync_statistics(values, fractions):
    first = values[0]
    if isinstance(first, WeightedMovingAverage):
        return _unchecked(WeightedMovingAverage,
                          raw=_sync_statistics([v.raw for v in values], fractions),
                          weight=_sync_statistics([v.weight for v in values], fractions))
    if isinstance(first, MovingAverageVariable):
        return _unchecked(MovingAverageVariable,
                          raw=_sync_statistics([v.raw for v in values], fractions),
                          total_weight=_sync_statistics([v.total_weight for v in values],
                                                        fractions),
                          zero_debias=first.zero_debias)
    total = fractions[0] * first
    for f, v in zip(fractions[1:], values[1:], strict=True):
        total = total + f * v
    return total
