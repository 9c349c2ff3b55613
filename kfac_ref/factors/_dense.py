r"""Fully-connected (dense) layer factors of TF K-FAC: Kronecker and diagonal.

Conventions: inputs :math:`a` are ``[N, d_in]``, back-propagated vectors :math:`g` are
``[N, d_out]`` (per-example gradients of the *summed* loss, no :math:`1/N`), the bias is a
homogeneous coordinate appended LAST to :math:`a`, statistics are averaged over examples.
"""

from __future__ import annotations

from .._backend import KFACValueError, check_array, check_bool, kernel_of, namespace_of
from .._support import capabilities
from ..linalg import append_homog, compute_cov
from ._base import (
    DenseSquareMatrixFactor,
    DiagonalFactor,
    as_sources_towers,
    check_dense_rows,
    check_equal_batches,
    input_towers_and_sources,
    per_source_and_tower,
)


def fold_uses(xp, tensor):
    """[T, N, d] -> [T·N, d] (time-major rows t·N + n); [N, d] unchanged."""
    if tensor.ndim == 3:
        return xp.reshape(tensor, (tensor.shape[0] * tensor.shape[1], tensor.shape[2]))
    return tensor


@capabilities(jit="yes", dask="yes")
def fully_connected_kronecker_factor(tensor, has_bias=False):
    r"""Kronecker factor of a dense layer: second moment of (homogeneous) rows.

    .. math::

        C = \frac{1}{M} \sum_{m=1}^{M} \bar x_m \bar x_m^\top,
        \qquad \bar x_m = [x_m, 1] \ (\texttt{has\_bias}) \text{ or } x_m ,

    symmetrised as :func:`kfac_ref.linalg.compute_cov` does.  Applied to the layer inputs
    it is the input factor :math:`A`; applied to the back-propagated vectors it is the
    output factor :math:`G`.  A multi-use input ``[T, N, d]`` (RNN time steps, TF's
    ``FullyConnectedMultiKF``) is folded time-major to ``[T·N, d]``, so :math:`M = T N`
    and the statistic is averaged over uses too.

    Parameters
    ----------
    tensor : array [N, d] or [T, N, d]
    has_bias : bool
        Append the homogeneous coordinate 1 last (bias row/column last).

    Returns
    -------
    array [d(+1), d(+1)]
        Symmetric PSD, same namespace/device/dtype as ``tensor``.

    Raises
    ------
    KFACValueError, KFACTypeError
        Rank other than 2 or 3, empty batch, non-floating or non-finite input, non-bool
        ``has_bias``.

    References
    ----------
    Martens & Grosse (2015), §3; TF K-FAC ``FullyConnectedKroneckerFactor``.
    """
    func = "fully_connected_kronecker_factor"
    xp = check_dense_rows(func, "tensor", tensor)
    check_bool(func, "has_bias", has_bias)
    return _fully_connected_kronecker_factor(xp, tensor, has_bias)


@kernel_of(fully_connected_kronecker_factor)
def _fully_connected_kronecker_factor(xp, tensor, has_bias=False):
    """Unchecked kernel: second moment of the (folded, homogeneous) rows."""
    x = fold_uses(xp, tensor)
    if has_bias:
        x = append_homog.kernel(xp, x)
    return compute_cov.kernel(xp, x)


@capabilities(dask="yes")
def fully_connected_diagonal_factor(inputs, outputs_grad, has_bias=False):
    r"""Exact diagonal of the per-example second moment of a dense layer's gradient.

    .. math::

        F_{ij} = \frac{1}{N} \sum_{n} (\bar a_{n,i}\, g_{n,j})^2
               = \frac{1}{N} \big[(\bar a \odot \bar a)^\top (g \odot g)\big]_{ij},

    the "sum of squares" estimator: the squared outer product of each example's gradient,
    summed in one GEMM (squares of an outer product are the outer product of squares).

    Parameters
    ----------
    inputs : array [N, d_in]
    outputs_grad : array [N, d_out]
    has_bias : bool
        Append the homogeneous 1 to the inputs (bias row last).

    Returns
    -------
    array [d_in(+1), d_out]
        The diagonal in the shape of the combined parameter ``[W; b]``; its row-major
        flattening is the diagonal of the block in kfac_ref's vec order.

    Raises
    ------
    KFACValueError, KFACTypeError
        Wrong ranks, different batch sizes, non-finite input.

    References
    ----------
    TF K-FAC ``FullyConnectedDiagonalFactor`` / ``FullyConnectedDiagonalFB``.
    """
    func = "fully_connected_diagonal_factor"
    xp = namespace_of(func, inputs=inputs, outputs_grad=outputs_grad)
    check_array(func, "inputs", inputs, ndim=2, layout="[N, d_in]")
    _check_pair(func, inputs, outputs_grad)
    check_bool(func, "has_bias", has_bias)
    return _fully_connected_diagonal_factor(xp, inputs, outputs_grad, has_bias)


def _check_pair(func, inputs, outputs_grad, name="outputs_grad"):
    """``outputs_grad`` against already-checked ``inputs`` (batch sizes, no empty batch)."""
    check_array(func, name, outputs_grad, ndim=2, layout="[N, d_out]")
    if inputs.shape[0] != outputs_grad.shape[0]:
        raise KFACValueError(
            f"{func}: inputs and {name} must have the same batch size; got "
            f"{inputs.shape[0]} and {outputs_grad.shape[0]}."
        )
    if inputs.shape[0] == 0:
        raise KFACValueError(f"{func}: inputs must have at least one row; got shape "
                             f"{tuple(inputs.shape)}.")


@kernel_of(fully_connected_diagonal_factor)
def _fully_connected_diagonal_factor(xp, inputs, outputs_grad, has_bias=False):
    """Unchecked kernel: ``(ā ⊙ ā)ᵀ (g ⊙ g) / N``."""
    a = append_homog.kernel(xp, inputs) if has_bias else inputs
    n = inputs.shape[0]
    return xp.matrix_transpose(a * a) @ (outputs_grad * outputs_grad) / float(n)


@capabilities(dask="yes")
class FullyConnectedKroneckerFactor(DenseSquareMatrixFactor):
    r"""TF K-FAC's ``FullyConnectedKroneckerFactor``: moving average of
    :func:`fully_connected_kronecker_factor`.

    .. math::

        \text{new\_cov} = \frac{1}{n_{\text{towers}}} \sum_{s} \sum_{t}
            \frac{1}{N}\, \bar X_{s,t}^\top \bar X_{s,t} .

    Data for :meth:`update_cov`: ``tensors``, an array (one source, one tower) or a
    sequence over sources of sequences over towers of ``[N, d]`` (or ``[T, N, d]``) arrays.

    Parameters
    ----------
    has_bias : bool
    zero_debias, eigenvalue_decomposition_threshold, eigenvalue_clipping_threshold
        See :class:`~kfac_ref.factors.DenseSquareMatrixFactor`.

    Raises
    ------
    KFACValueError, KFACTypeError
        Bad nesting, towers of different batch sizes, and the errors of the formula.
    """

    def __init__(self, has_bias=False, **kwargs):
        super().__init__(**kwargs)
        self._set(has_bias=check_bool(type(self).__name__, "has_bias", has_bias))

    def _contributions(self, tensors):
        func = f"{self.name}.update_cov"
        st = as_sources_towers(func, "tensors", tensors)
        for src in st:
            check_equal_batches(func, "tensors", src, axis=src[0].ndim - 2)
        out = []
        for src in st:
            covs = []
            for t in src:
                xp = check_dense_rows(func, "tensors", t)
                covs.append(_fully_connected_kronecker_factor(xp, t, self.has_bias))
            out.append(tuple(covs))
        return tuple(out)


@capabilities(dask="yes")
class FullyConnectedDiagonalFactor(DiagonalFactor):
    r"""TF K-FAC's ``FullyConnectedDiagonalFactor``: moving average of
    :func:`fully_connected_diagonal_factor`.

    .. math::

        \text{new\_cov} = \frac{1}{n_{\text{towers}}} \sum_{s} \sum_{t}
            \frac{1}{N} (\bar a_t \odot \bar a_t)^\top (g_{s,t} \odot g_{s,t}) .

    Data for :meth:`update_cov`: ``inputs`` (an array or a sequence over towers) and
    ``outputs_grads`` (an array or sources × towers).

    Parameters
    ----------
    has_bias : bool
    zero_debias : bool
    """

    def __init__(self, has_bias=False, **kwargs):
        super().__init__(**kwargs)
        self._set(has_bias=check_bool(type(self).__name__, "has_bias", has_bias))

    def _contributions(self, inputs, outputs_grads):
        func = f"{self.name}.update_cov"
        towers, st = input_towers_and_sources(func, inputs, outputs_grads)
        check_equal_batches(func, "inputs", towers)
        for a in towers:  # each input tower checked once, whatever the number of sources
            check_array(func, "inputs", a, ndim=2, layout="[N, d_in]")

        def diagonal(a, g):
            xp = namespace_of(func, inputs=a, outputs_grads=g)
            _check_pair(func, a, g, name="outputs_grads")
            return _fully_connected_diagonal_factor(xp, a, g, self.has_bias)

        return per_source_and_tower(st, towers, diagonal)
