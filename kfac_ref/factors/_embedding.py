r"""Diagonal Kronecker factors of TF K-FAC: embedding (one-hot) inputs and dense diagonals.

For an embedding lookup the layer input is the one-hot (n-hot) vector of the ids, so the
input second moment :math:`E[x x^\top]` is diagonal when each example holds one id, and its
diagonal is the id frequency: "a diagonal approximation is exact for input factors" (TF).
With several ids per example (summed embeddings) the co-occurrence off-diagonals are
dropped and a repeated id counts :math:`c` times (not :math:`c^2`), as in TF.
"""

from __future__ import annotations

from .._backend import (
    KFACTypeError,
    KFACValueError,
    asarray_like,
    check_array,
    check_index_range,
    check_int,
    describe,
    device_of,
    kernel_of,
    namespace_of,
)
from .._support import capabilities
from ._base import (
    DiagonalFactor,
    as_sources_towers,
    as_towers,
    check_bool,
    check_dense_rows,
    check_equal_batches,
)


def _float_dtype(func, xp, like, dtype):
    """The explicit ``dtype``, else the float of the ids' width: float64 for 64-bit ids where
    the device has it, float32 otherwise (never the namespace's default dtype, which JAX
    and PyTorch set globally)."""
    dev = device_of(like)
    info = xp.__array_namespace_info__()
    available = info.dtypes(device=dev, kind="real floating")
    if dtype is None:
        wide = xp.iinfo(like.dtype).bits >= 64 and "float64" in available
        return xp.float64 if wide else xp.float32
    if isinstance(dtype, str):
        if dtype not in available:
            raise KFACTypeError(f"{func}: dtype must be a real floating dtype available on the "
                                f"device ({', '.join(available)}); got {dtype!r}.")
        return available[dtype]
    if dtype not in available.values():
        raise KFACTypeError(f"{func}: dtype must be a real floating dtype available on the "
                            f"device ({', '.join(available)}); got {dtype!r}.")
    return dtype


def _id_counts(xp, flat_ids, vocab_size, dtype):
    """Occurrences of each id in ``flat_ids`` (sort + searchsorted; O(M log M + V log M))."""
    ids_sorted = xp.sort(flat_ids)
    vocab = xp.arange(vocab_size, dtype=flat_ids.dtype, device=device_of(flat_ids))
    hi = xp.searchsorted(ids_sorted, vocab, side="right")
    lo = xp.searchsorted(ids_sorted, vocab, side="left")
    return xp.astype(hi - lo, dtype)


def _check_ids(func, xp, input_ids, vocab_size, ndim):
    check_array(func, "input_ids", input_ids, ndim=ndim, dtype="integral")
    check_index_range(func, "input_ids", input_ids, vocab_size, "vocab_size")


@capabilities(dask="yes")
def embedding_input_kronecker_factor(input_ids, vocab_size, dtype=None):
    r"""Diagonal input factor of an embedding layer: id frequencies.

    .. math::

        d_v = \frac{1}{N} \sum_{n=1}^{N} \sum_{j} [\,\mathrm{id}_{n,j} = v\,]
            = \frac{1}{N} \sum_n \mathrm{nhot}(\mathrm{id}_n)_v^2 \ \text{(one id per row)},
        \qquad v = 0, \dots, V-1 .

    The counts are computed by sorting the ids (no ``N × V`` one-hot matrix).

    Parameters
    ----------
    input_ids : integer array [N] or [N, S]
        Ids into a ``[V, embedding_dim]`` table; :math:`N` is the first axis.
    vocab_size : int
        :math:`V \ge 1`.
    dtype : dtype or str, optional
        Floating dtype of the result.  Default: the float of the ids' width — float64 for
        64-bit ids where the device has it, float32 for narrower ids (or without float64) —
        never the namespace's global default dtype.

    Returns
    -------
    array [V]
        The diagonal (not a diagonal matrix), on the ids' device.

    Raises
    ------
    KFACTypeError
        Non-integer ids, a non-floating ``dtype``.
    KFACValueError
        Rank other than 1 or 2, ids outside ``[0, vocab_size)``, an empty batch.

    References
    ----------
    TF K-FAC ``EmbeddingInputKroneckerFactor`` (seed) / ``DiagonalKroneckerFactor`` with
    sparse inputs (master); the docs page *Conventions* (embedding layers).
    """
    func = "embedding_input_kronecker_factor"
    xp = namespace_of(func, input_ids=input_ids)
    vocab_size = check_int(func, "vocab_size", vocab_size, minimum=1)
    _check_ids(func, xp, input_ids, vocab_size, (1, 2))
    out_dtype = _float_dtype(func, xp, input_ids, dtype)
    if input_ids.shape[0] == 0:
        raise KFACValueError(f"{func}: input_ids must have at least one row; got shape "
                             f"{tuple(input_ids.shape)}.")
    return _embedding_input_kronecker_factor(xp, input_ids, vocab_size, out_dtype)


@kernel_of(embedding_input_kronecker_factor)
def _embedding_input_kronecker_factor(xp, input_ids, vocab_size, dtype):
    """Unchecked kernel: id counts over the rows, in the (resolved) float ``dtype``."""
    counts = _id_counts(xp, xp.reshape(input_ids, (-1,)), vocab_size, dtype)
    return counts / float(input_ids.shape[0])


@capabilities(dask="yes")
def diagonal_kronecker_factor(tensor, has_bias=False):
    r"""Diagonal Kronecker factor of dense inputs (TF master's ``DiagonalKroneckerFactor``).

    .. math::

        d = \frac{1}{M} \sum_{m=1}^{M} x_m \odot x_m, \qquad
        \bar d = [d, 1] \ (\texttt{has\_bias}),

    the diagonal of :func:`~kfac_ref.factors.fully_connected_kronecker_factor`.  A
    multi-use input ``[T, N, d]`` is folded to ``[T·N, d]`` (TF's ``DiagonalMultiKF``).  The
    bias entry is the homogeneous coordinate's second moment, 1.

    Parameters
    ----------
    tensor : array [N, d] or [T, N, d]
    has_bias : bool

    Returns
    -------
    array [d(+1)]

    Raises
    ------
    KFACValueError, KFACTypeError
        Rank other than 2 or 3, empty batch, non-finite input.

    References
    ----------
    TF K-FAC master ``DiagonalKroneckerFactor`` (dense branch).
    """
    func = "diagonal_kronecker_factor"
    xp = check_dense_rows(func, "tensor", tensor)
    check_bool(func, "has_bias", has_bias)
    return _diagonal_kronecker_factor(xp, tensor, has_bias)


@kernel_of(diagonal_kronecker_factor)
def _diagonal_kronecker_factor(xp, tensor, has_bias=False):
    """Unchecked kernel: mean of the squared rows (bias entry 1 last), in ``tensor``'s dtype."""
    x = xp.reshape(tensor, (-1, tensor.shape[-1]))
    d = xp.sum(x * x, axis=0) / float(x.shape[0])
    if has_bias:
        d = xp.concat([d, asarray_like([1.0], d)], axis=0)
    return d


@capabilities(dask="yes")
class EmbeddingInputKroneckerFactor(DiagonalFactor):
    r"""TF K-FAC's ``EmbeddingInputKroneckerFactor``: moving average of
    :func:`embedding_input_kronecker_factor`, averaged over towers.

    .. math::

        \text{new\_cov} = \frac{1}{n_{\text{towers}}} \sum_t \frac{\mathrm{counts}_t}{N} .

    Data for :meth:`update_cov`: ``input_ids`` (an integer array or a sequence over towers).

    Parameters
    ----------
    vocab_size : int
    dtype : dtype or str, optional
    zero_debias : bool
    """

    def __init__(self, vocab_size, dtype=None, **kwargs):
        super().__init__(**kwargs)
        self._set(vocab_size=check_int(type(self).__name__, "vocab_size", vocab_size,
                                       minimum=1), dtype=dtype)

    def _contributions(self, input_ids):
        func = f"{self.name}.update_cov"
        towers = as_towers(func, "input_ids", input_ids)
        check_equal_batches(func, "input_ids", towers)
        out = []
        for ids in towers:
            xp = namespace_of(func, input_ids=ids)
            _check_ids(func, xp, ids, self.vocab_size, (1, 2))
            if ids.shape[0] == 0:
                raise KFACValueError(f"{func}: input_ids must have at least one row; got shape "
                                     f"{tuple(ids.shape)}.")
            out.append(_embedding_input_kronecker_factor(
                xp, ids, self.vocab_size, _float_dtype(func, xp, ids, self.dtype)))
        return (tuple(out),)


@capabilities(dask="yes")
class DiagonalKroneckerFactor(DiagonalFactor):
    r"""TF master's ``DiagonalKroneckerFactor``: dense inputs or one-hot ids.

    .. math::

        \text{dense: } \frac{1}{N}\sum_n x_n \odot x_n, \qquad
        \text{ids: } \frac{\mathrm{counts}}{N}, \qquad
        \text{then } [\,\cdot\,, 1] \text{ if } \texttt{has\_bias};

    sources summed, towers averaged.  Pass ``vocab_size`` to treat the data as ids (TF
    marks sparse tensors with a ``one_hot_depth`` attribute; TF requires ids to be 1-D).

    Data for :meth:`update_cov`: ``tensors``, an array or sources × towers.

    Parameters
    ----------
    has_bias : bool
    vocab_size : int, optional
        One-hot depth for integer ids (``None``: dense inputs).
    dtype : dtype or str, optional
        Result dtype for ids.
    zero_debias : bool
    """

    def __init__(self, has_bias=False, vocab_size=None, dtype=None, **kwargs):
        super().__init__(**kwargs)
        func = type(self).__name__
        if vocab_size is not None:
            vocab_size = check_int(func, "vocab_size", vocab_size, minimum=1)
        self._set(has_bias=check_bool(func, "has_bias", has_bias), vocab_size=vocab_size,
                  dtype=dtype)

    def _one(self, func, tensor):
        if self.vocab_size is None:
            return _diagonal_kronecker_factor(check_dense_rows(func, "tensors", tensor), tensor,
                                              self.has_bias)
        xp = namespace_of(func, tensors=tensor)
        if tensor.ndim != 1:
            raise KFACValueError(f"{func}: id tensors must be 1-D (fold uses first); got "
                                 f"{describe(tensor)}.")
        _check_ids(func, xp, tensor, self.vocab_size, 1)
        if tensor.shape[0] == 0:
            raise KFACValueError(f"{func}: tensors must have at least one row; got shape "
                                 f"{tuple(tensor.shape)}.")
        d = _embedding_input_kronecker_factor(xp, tensor, self.vocab_size,
                                              _float_dtype(func, xp, tensor, self.dtype))
        if self.has_bias:
            d = xp.concat([d, asarray_like([1.0], d)], axis=0)
        return d

    def _fold(self, func, tensor):
        return tensor

    def _contributions(self, tensors):
        func = f"{self.name}.update_cov"
        st = as_sources_towers(func, "tensors", tensors)
        for src in st:
            check_equal_batches(func, "tensors", [self._fold(func, t) for t in src])
        return tuple(tuple(self._one(func, self._fold(func, t)) for t in src) for src in st)


@capabilities(dask="yes")
class DiagonalMultiKF(DiagonalKroneckerFactor):
    r"""TF master's ``DiagonalMultiKF``: :class:`DiagonalKroneckerFactor` for a layer used
    ``num_uses`` times; ``[T, N, d]`` (dense) or ``[T, N]`` (ids) data are folded to
    ``[T·N, ...]`` first, so statistics average over uses as well.

    .. math::

        \text{new\_cov} = \frac{1}{T N} \sum_{t, n} x_{t,n} \odot x_{t,n}\ (\text{+ bias } 1).
    """

    def __init__(self, num_uses, has_bias=False, vocab_size=None, dtype=None, **kwargs):
        super().__init__(has_bias=has_bias, vocab_size=vocab_size, dtype=dtype, **kwargs)
        self._set(num_uses=check_int(type(self).__name__, "num_uses", num_uses, minimum=1))

    def _fold(self, func, tensor):
        xp = namespace_of(func, tensors=tensor)
        if self.vocab_size is not None and tensor.ndim == 2:
            return xp.reshape(tensor, (-1,))
        return tensor
