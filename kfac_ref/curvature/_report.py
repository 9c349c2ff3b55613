r"""How far each block approximation is from the exact block: per-layer relative Frobenius errors.

.. math::

    e_{l,a} = \frac{\|\hat C^{(a)}_{l} - C_{ll}\|_F}{\|C_{ll}\|_F},

where :math:`C_{ll}` is layer :math:`l`'s diagonal block of the exact dense curvature (GGN,
Fisher or empirical Fisher, :mod:`kfac_ref.curvature`) and :math:`\hat C^{(a)}_l` the
block that approximation :math:`a` (a :class:`~kfac_ref.curvature.BlockDiagonalCurvature`
configuration) estimates from the same batch with the matching exact estimation mode, so the
error is the block structure's alone (no sampling noise).  For teaching and for the docs' plots.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from .._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_eager,
    check_option,
    device_of,
    kernel_of,
    namespace_of,
    size_of,
)
from .._support import capabilities
from ..blocks.kfac_jax import NaiveDiagonal, NaiveFull
from ._block_diagonal import BlockDiagonalCurvature
from ._exact import (
    empirical_fisher_matrix,
    evaluate_batch,
    fisher_matrix,
    ggn_matrix,
    unpack_batch,
)

_CURVATURES = {"ggn": ("ggn_exact", ggn_matrix),
               "fisher": ("fisher_exact", fisher_matrix),
               "empirical_fisher": ("fisher_empirical", empirical_fisher_matrix)}


@capabilities(jit="yes", dask="yes")
def relative_frobenius_error(approx, exact):
    r"""Relative Frobenius error, as a 0-D array.

    .. math::

        e = \frac{\|\hat C - C\|_F}{\|C\|_F}\quad(0 \text{ if both vanish, } \infty
        \text{ if only } C \text{ does}).

    Both norms are taken of the arrays divided by :math:`s = \max(\max|\hat C - C|,
    \max|C|)`, which leaves the ratio unchanged and keeps the sums of squares from
    overflowing or underflowing.  The result is a 0-D array in the inputs' namespace,
    device and dtype (``float(e)`` reads it), so the function runs under ``jax.jit``.

    Raises
    ------
    KFACValueError, KFACTypeError
        Arrays of different shapes (no broadcasting), non-floating or non-finite entries,
        mixed namespaces, devices or precisions.
    """
    func = "relative_frobenius_error"
    xp = namespace_of(func, approx=approx, exact=exact)
    check_array(func, "exact", exact, min_ndim=1)
    check_array(func, "approx", approx, shape=tuple(exact.shape))
    return relative_frobenius_error.kernel(xp, approx, exact)


@kernel_of(relative_frobenius_error)
def _relative_frobenius_error(xp, approx, exact):
    zero = xp.zeros((), dtype=exact.dtype, device=device_of(exact))
    if size_of(exact) == 0:
        return zero
    diff = approx - exact
    s = xp.maximum(xp.max(xp.abs(diff)), xp.max(xp.abs(exact)))
    s = xp.where(s > zero, s, xp.ones_like(s))
    num = xp.sqrt(xp.sum((diff / s) ** 2))
    den = xp.sqrt(xp.sum((exact / s) ** 2))
    vanishes = den == zero
    ratio = num / xp.where(vanishes, xp.ones_like(den), den)
    only_exact = xp.where(num == zero, zero, xp.full_like(den, math.inf))
    return xp.where(vanishes, only_exact, ratio)


@capabilities(array_free=True)
def default_approximations(net, input_shape):
    r"""The approximations compared by default.

    .. math::

        \text{kfac}: A\otimes G,\quad \text{diagonal}: \mathrm{diag}(C_{ll}),\quad
        \text{full}: C_{ll}\ (\text{error } 0,\ \text{a sanity check})

    ``"kfac"`` uses the default block map (KFAC-expand for weight-shared dense layers) and
    ``"kfac_reduce"`` is added when the network has a convolution or a dense layer that sees
    ``[N, T, d]`` inputs for a batch of ``input_shape``.
    ``"diagonal"`` and ``"full"`` feed per-example parameter gradients to ``NaiveDiagonal`` /
    ``NaiveFull``, which makes them the exact diagonal and the exact block.
    """
    kinds = {layer.kind for layer in net.layers}
    diag = {k: NaiveDiagonal for k in kinds}
    full = {k: NaiveFull for k in kinds}
    out = {"kfac": {}, "diagonal": {"layer_to_block": diag},
           "full": {"layer_to_block": full}}
    shape = tuple(input_shape)
    shared = False
    for layer in net.layers:
        shared = shared or (layer.kind == "dense" and len(shape) == 3) or layer.kind == "conv2d"
        shape = layer.output_shape(shape)
    if shared:
        out["kfac_reduce"] = {"weight_sharing": "reduce"}
    return out


@capabilities(jit=("no", "it reads values to build its report; call it on concrete arrays"),
              dask=("no", "it reads values to build its report; call it on concrete arrays"))
def approximation_report(net, loss_fn, params, batch, approximations=None, curvature="ggn"):
    r"""Per-layer relative Frobenius errors of block approximations against the exact blocks.

    .. math::

        e_{l,a} = \|\hat C^{(a)}_l - C_{ll}\|_F \,/\, \|C_{ll}\|_F .

    Parameters
    ----------
    net : kfac_ref.nn.Sequential
    loss_fn : loss class or callable ``(outputs, targets) -> LossFunction``
    params : parameter structure
    batch : (inputs, targets)
    approximations : mapping name -> dict, optional
        Keyword arguments of :class:`BlockDiagonalCurvature` for each approximation (e.g.
        ``{"layer_to_block": {...}, "weight_sharing": "reduce"}``); default
        :func:`default_approximations`.
    curvature : {"ggn", "fisher", "empirical_fisher"}
        The exact matrix; the approximations use the matching exact mode (``ggn_exact``,
        ``fisher_exact``, ``fisher_empirical``).

    Returns
    -------
    dict
        ``{layer_name: {approximation_name: error}}`` for every parametric layer, errors as
        Python floats.

    Raises
    ------
    KFACValueError, KFACTypeError
        Unknown ``curvature``, a batch that is not ``(inputs, targets)``, approximations that
        are not a non-empty mapping of keyword mappings, and everything the exact curvature
        and :class:`BlockDiagonalCurvature` reject.
    """
    func = "approximation_report"
    check_option(func, "curvature", curvature, tuple(_CURVATURES))
    mode, dense_fn = _CURVATURES[curvature]
    x, y = unpack_batch(func, batch)
    leaves = {f"params[{i}][{j}]": a for i, p in enumerate(params or ())
              for j, a in enumerate(p if isinstance(p, (tuple, list)) else (p,))}
    check_eager(func, "it builds estimators and returns Python floats",
                **leaves, **{"batch[0]": x, "batch[1]": y})
    check_array(func, "batch[0]", x, dtype=None, finite=False)  # the network checks more
    if approximations is None:
        approximations = default_approximations(net, tuple(x.shape))
    if not isinstance(approximations, Mapping) or not all(
            isinstance(k, str) and isinstance(v, Mapping) for k, v in approximations.items()):
        raise KFACTypeError(f"{func}: approximations must be a mapping name -> keyword "
                            f"arguments of BlockDiagonalCurvature; got {approximations!r:.80}.")
    if not approximations:
        raise KFACValueError(f"{func}: approximations must name at least one approximation; "
                             f"got an empty mapping.")
    b = evaluate_batch(func, net, loss_fn, params, batch)
    dense = (dense_fn.kernel(b, "mean") if curvature == "empirical_fisher"
             else dense_fn.kernel(b))
    slices = net.layer_slices()
    exact = {net.names[i]: dense[slices[i], slices[i]] for i in net.parametric_layers}
    n = int(batch[0].shape[0])
    report = {name: {} for name in exact}
    for aname, kwargs in approximations.items():
        est = BlockDiagonalCurvature(net, loss_fn, **dict(kwargs))
        state = est.init(None, (params, batch))
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, n, None, (params, batch),
                                                     mode)
        for i, block in zip(net.parametric_layers, est.to_diagonal_block_dense_matrix(state),
                            strict=True):
            lname = net.names[i]
            xp = namespace_of(func, block=block, exact=exact[lname])
            report[lname][aname] = float(relative_frobenius_error.kernel(xp, block,
                                                                        exact[lname]))
    return report
