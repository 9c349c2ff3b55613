r"""Parameter-order conversions between kfac_ref, PyTorch and kfac-jax (Haiku) conventions.

kfac_ref orders a network's parameters layer by layer in forward order, each layer's arrays in
:meth:`~kfac_ref.nn.layers.Layer.param_names` order (bias last) and each array row-major in
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

from .._backend import check_array, device_of, namespace_of
from .network import Sequential

__all__ = [
    "torch_permutation",
    "kfac_jax_permutation",
    "permute_vector",
    "permute_matrix",
    "to_torch_parameters",
    "to_kfac_jax_params",
    "HAIKU_NAMES",
]

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


def permute_vector(vec, perm):
    r"""Reorder a vector (or the last axis of a batch of vectors).

    .. math::

        w_i = v_{\pi(i)} .
    """
    func = "permute_vector"
    xp = namespace_of(func, vec=vec)
    check_array(func, "vec", vec, min_ndim=1)
    idx = xp.asarray(np.asarray(perm, dtype=np.int64), device=device_of(vec))
    return xp.take(vec, idx, axis=vec.ndim - 1)


def permute_matrix(mat, perm):
    r"""Reorder rows and columns of a square matrix.

    .. math::

        M'_{ij} = M_{\pi(i)\pi(j)} \quad (M' = \Pi M \Pi^\top).
    """
    func = "permute_matrix"
    xp = namespace_of(func, mat=mat)
    check_array(func, "mat", mat, ndim=2)
    idx = xp.asarray(np.asarray(perm, dtype=np.int64), device=device_of(mat))
    return xp.take(xp.take(mat, idx, axis=0), idx, axis=1)


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


def to_kfac_jax_params(net, params):
    r"""Parameters as a Haiku-style nested dict ``{layer_name: {haiku_name: array}}``.

    .. math::

        \{\text{dense}: \{w: W, b: b\},\ \text{scale\_and\_shift}: \{\text{scale}: s,
        \ \text{offset}: t\},\ \dots\}

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
