r"""Parameter-order conversions between kfac_ref, PyTorch and kfac-jax (Haiku) conventions.

kfac_ref orders a network's parameters layer by layer in forward order, each layer's arrays in
:meth:`~kfac_ref.nn.Layer.param_names` order (bias last) and each array row-major in
kfac_ref's layout (dense ``W`` ``[d_in, d_out]``, conv kernels HWIO).

* **PyTorch** keeps forward order and ``weight`` before ``bias`` but stores dense weights as
  ``[d_out, d_in]`` and conv kernels as OIHW, so the flattened weight block is permuted.
* **kfac-jax** orders parameters by JAX pytree leaf order of a Haiku-style parameter dict
  ``{layer_name: {param_name: array}}``: dict keys are sorted, so layers come in sorted-name
  order and within a layer ``"b"`` precedes ``"w"`` (``"offset"`` precedes ``"scale"``).

Every conversion here is a permutation :math:`\pi` of ``range(P)`` computed on the host
(NumPy index arithmetic only): a vector in the other convention is ``v[π]`` and a matrix is
``M[π][:, π]`` (:func:`permute_vector`, :func:`permute_matrix`).
"""

from __future__ import annotations

import math

import numpy as np  # host-side index arithmetic only (permutations)

from .._backend import (
    KFACTypeError,
    KFACValueError,
    any_true,
    check_array,
    check_square,
    checks_values,
    describe,
    device_of,
    is_array,
    namespace_of,
)
from .._support import capabilities
from ._network import Sequential

HAIKU_NAMES = {
    "dense": {"w": "w", "b": "b"},
    "conv2d": {"w": "w", "b": "b"},
    "scale_and_shift": {"scale": "scale", "shift": "offset"},
    "embedding": {"embeddings": "embeddings"},
}
"""kfac_ref parameter name -> Haiku parameter name, per layer kind."""

# axes permutation taking a kfac_ref array to the PyTorch layout of the same parameter
_TORCH_AXES = {
    ("dense", "w"): (1, 0),
    ("conv2d", "w"): (3, 2, 0, 1),
}
_TORCH_NAMES = {"w": "weight", "b": "bias", "scale": "weight", "shift": "bias",
                "embeddings": "weight"}


def _check_net(func, net):
    if not isinstance(net, Sequential):
        from .._backend import KFACTypeError

        raise KFACTypeError(f"{func}: net must be a kfac_ref.nn.Sequential; got "
                            f"{type(net).__name__}.")


@capabilities(array_free=True, formula=True)
def torch_permutation(net):
    r"""Permutation from kfac_ref's parameter order to PyTorch's ``parameters()`` order.

    .. math::

        v_{\text{torch}} = v[\pi], \qquad
        \pi\big(\text{torch index of } W^\top_{ij}\big) = \text{kfac\_ref index of } W_{ji},

    i.e. within a dense layer ``weight`` is ``Wᵀ`` (``[d_out, d_in]``) flattened row-major,
    a conv ``weight`` is the OIHW transpose of the HWIO kernel, biases follow their weights.

    Returns
    -------
    numpy.ndarray of int64, shape [P]
    """
    _check_net("torch_permutation", net)
    perm, start = [], 0
    for layer in net.layers:
        for name, shape in zip(layer.param_names(), layer.param_shapes(), strict=True):
            size = math.prod(shape)
            idx = np.arange(start, start + size).reshape(shape)
            axes = _TORCH_AXES.get((layer.kind, name))
            perm.append((idx.transpose(axes) if axes else idx).reshape(-1))
            start += size
    return np.concatenate(perm) if perm else np.zeros(0, dtype=np.int64)


@capabilities(array_free=True, formula=True)
def kfac_jax_permutation(net):
    r"""Permutation from kfac_ref's order to kfac-jax's pytree order of Haiku-style params.

    .. math::

        v_{\text{kfac-jax}} = v[\pi], \qquad
        \text{leaves of } \{\text{layer}: \{\text{haiku name}: \text{array}\}\}
        \text{ in sorted-key order}.

    Arrays keep kfac_ref's layout (Haiku also uses ``[d_in, d_out]`` and HWIO); only the
    order of arrays changes (layers sorted by name; ``b`` before ``w``; ``offset`` before
    ``scale``).

    Returns
    -------
    numpy.ndarray of int64, shape [P]
    """
    _check_net("kfac_jax_permutation", net)
    pieces = {}
    start = 0
    for lname, layer in zip(net.names, net.layers, strict=True):
        for name, shape in zip(layer.param_names(), layer.param_shapes(), strict=True):
            size = math.prod(shape)
            pieces[(lname, HAIKU_NAMES[layer.kind][name])] = np.arange(start, start + size)
            start += size
    order = sorted(pieces)
    return np.concatenate([pieces[k] for k in order]) if order else np.zeros(0, dtype=np.int64)


@capabilities(dask="yes")
def permute_vector(vec, perm):
    r"""Reorder a vector (or the last axis of a batch of vectors).

    .. math::

        w_i = v_{\pi(i)} .

    ``perm`` is a permutation of ``range(vec.shape[-1])``: a sequence or NumPy array of
    integers (as :func:`torch_permutation` returns), or an integer array of ``vec``'s
    namespace and device.
    """
    func = "permute_vector"
    xp = namespace_of(func, vec=vec)
    check_array(func, "vec", vec, min_ndim=1)
    idx = _check_perm(func, xp, perm, vec.shape[-1], "vec", vec)
    return xp.take(vec, idx, axis=vec.ndim - 1)


@capabilities(dask="yes")
def permute_matrix(mat, perm):
    r"""Reorder rows and columns of a square matrix.

    .. math::

        M'_{ij} = M_{\pi(i)\pi(j)} \quad (M' = \Pi M \Pi^\top).

    ``mat`` is square ``[n, n]``; ``perm`` a permutation of ``range(n)``, given as for
    :func:`permute_vector`.
    """
    func = "permute_matrix"
    xp = namespace_of(func, mat=mat)
    check_square(func, "mat", mat)
    idx = _check_perm(func, xp, perm, mat.shape[0], "mat", mat)
    return xp.take(xp.take(mat, idx, axis=0), idx, axis=1)


def _check_perm(func, xp, perm, n, like_name, like):
    """``perm`` as an index array on ``like``'s device, after checking that it is a
    permutation of ``range(n)``: a host sequence or NumPy array of integers (checked on the
    host, where the permutations of this module are made), or an integer array of
    ``like``'s namespace and device (the check is then a value check)."""
    want = f"a permutation of range({n}) (each of 0, ..., {n - 1} once)"
    if is_array(perm) and not isinstance(perm, np.ndarray):
        namespace_of(func, **{like_name: like}, perm=perm)
        check_array(func, "perm", perm, shape=(n,), dtype="integral", layout=f"[{n}]")
        if n and checks_values(perm):
            ref = xp.arange(n, dtype=perm.dtype, device=device_of(perm))
            if any_true(xp, xp.sort(perm) != ref):
                raise KFACValueError(f"{func}: perm must be {want}; got an integer array "
                                     f"with repeated or out-of-range entries.")
        return perm
    if not isinstance(perm, (np.ndarray, list, tuple, range)):
        raise KFACTypeError(f"{func}: perm must be a sequence or an array of integers "
                            f"({want}); got {describe(perm)}.")
    try:
        host = np.asarray(perm) if len(perm) else np.zeros(0, dtype=np.int64)
    except ValueError:  # ragged nesting
        host = None
    if host is None or host.ndim != 1 or host.shape[0] != n:
        got = describe(perm) if host is None else f"shape {host.shape}"
        raise KFACValueError(f"{func}: perm must be {want}, of length {n}; got {got}.")
    if not np.issubdtype(host.dtype, np.integer):  # bools and floats are refused
        raise KFACTypeError(f"{func}: perm must hold integers ({want}); got dtype "
                            f"{host.dtype}.")
    # a value check like any other (switched off by value_checks(False)), on the host
    if checks_values() and not np.array_equal(np.sort(host), np.arange(n)):
        bad = sorted(set(host[(host < 0) | (host >= n)].tolist()))
        values, counts = np.unique(host, return_counts=True)
        dup = values[counts > 1].tolist()
        raise KFACValueError(f"{func}: perm must be {want}; got "
                             + (f"out-of-range entries {bad[:5]}" if bad
                                else f"repeated entries {dup[:5]}") + ".")
    return xp.asarray(host.astype(np.int64), device=device_of(like))


@capabilities(dask="yes")
def to_torch_parameters(net, params):
    r"""Parameters in PyTorch layouts, as an ordered dict ``{"<layer>.<weight|bias>": array}``.

    .. math::

        \text{dense: } W_{\text{torch}} = W^\top, \qquad
        \text{conv: } K_{\text{torch}}[o, i, a, b] = K[a, b, i, o].

    Iterating the dict gives PyTorch's ``named_parameters()`` order; flattening its values
    reproduces :func:`torch_permutation` applied to ``net.flatten(params)``.
    """
    func = "to_torch_parameters"
    _check_net(func, net)
    params = net.check_params(func, params)
    out = {}
    for lname, layer, p in zip(net.names, net.layers, params, strict=True):
        for name, a in zip(layer.param_names(), p, strict=True):
            xp = namespace_of(func, a=a)
            axes = _TORCH_AXES.get((layer.kind, name))
            out[f"{lname}.{_TORCH_NAMES[name]}"] = xp.permute_dims(a, axes) if axes else a
    return out


@capabilities(dask="yes",
              formula="a re-arrangement: the same arrays in a nested dict, nothing computed")
def to_kfac_jax_params(net, params):
    r"""Parameters as a Haiku-style nested dict ``{layer_name: {haiku_name: array}}``.

    Arrays keep kfac_ref's layout; parameter-free layers are omitted.  The pytree leaf order
    of the result is :func:`kfac_jax_permutation`.
    """
    func = "to_kfac_jax_params"
    _check_net(func, net)
    params = net.check_params(func, params)
    out = {}
    for lname, layer, p in zip(net.names, net.layers, params, strict=True):
        if p:
            out[lname] = {HAIKU_NAMES[layer.kind][n]: a
                          for n, a in zip(layer.param_names(), p, strict=True)}
    return out
