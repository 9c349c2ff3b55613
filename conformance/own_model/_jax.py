r"""Reference K-FAC factors for a JAX function of parameters, and a per-layer diagnosis.

For kfac-jax, Flax and hand-written JAX K-FAC code.  The model is an explicit function

.. code-block:: python

    def model(params, x, perturbations):
        a1 = x
        s1 = a1 @ params["w1"] + params["b1"] + perturbations.get("fc1", 0.0)
        h = jnp.tanh(s1)
        s2 = h @ params["w2"] + perturbations.get("fc2", 0.0)
        return s2, {"fc1": (a1, s1), "fc2": (h, s2)}   # outputs, taps

that adds ``perturbations[name]`` (when present) to each layer's output and returns the
model's outputs ``[N, C]`` with the *taps*: per layer, its input and its (perturbed) output —
or, for a layer used several times in one forward pass (tied weights), a list of
``(input, output)`` pairs, one per use, with ``perturbations[name]`` a list of the same
length.  The back-propagated output vectors are the derivatives with respect to the
perturbations (the perturbation trick of kfac-jax), taken with one :func:`jax.vjp` and one
vector–Jacobian product per loss Fisher-factor column.  ``layers`` says what each tapped
layer is (JAX's layouts; the uses of a layer are more shared positions, KFAC-expand):

* ``{"kind": "dense", "bias": bool}``: weight ``[in, out]`` (``x @ w``), input
  ``[N, (S...,) in]``; ``A`` is ``[in(+1), in(+1)]``, ``G`` is ``[out, out]``;
* ``{"kind": "conv1d" | "conv2d" | "conv3d", "kernel": (k_1, ...), "strides": ...,
  "padding": "SAME" | "VALID" | ((lo, hi), ...), "dilation": ..., "bias": bool,
  "groups": 1}``: channels-last input, kernel ``[*k, C_in/groups, C_out]`` (JAX's and
  kfac-jax's layout); ``A`` is over the patches in ``(k_1, ..., C_in)`` order, ``C_in``
  fastest (index ``(i·kw + j)·C + c`` in 2-D, the order of ``kernel.reshape(-1, out)``);
  with ``groups > 1`` ``A`` is ``[g, d, d]`` over each group's patches (its ``C_in/g``
  channels) and ``G`` ``[g, O/g, O/g]``;
* ``{"kind": "embedding", "vocab": V}``: input the integer ids ``[N, (S...)]``, output
  ``[N, (S...,) D]``; ``A`` the diagonal ``[V, V]`` of token counts (a ``[V]`` vector is
  accepted), ``G`` ``[D, D]``;
* ``{"kind": "scale_shift", "bias": bool}``: ``y = γ ⊙ x̂ + β`` (a layer norm's affine
  part, ``γ`` over the last axis); tap ``(x̂, y)``; ``F`` ``[2q, 2q]`` the second moment of
  the per-example :math:`(γ, β)` gradient (or its diagonal ``"diag"``).

The bias's homogeneous coordinate is last.  The reference is the one of
:mod:`conformance.own_model`'s PyTorch check (KFAC-expand, curvlinops' normalisation):

.. math::

    A = \frac{1}{N|T|}\sum_{n,t} \bar a_{n,t} \bar a_{n,t}^\top, \qquad
    G = \frac{1}{N}\sum_{n,t,k} g_{n,t,k}\, g_{n,t,k}^\top ;

kfac-jax's ``Conv2DTwoKroneckerFactored`` and TF's ``ConvKFCBasicFB`` normalise ``G`` by
:math:`N|T|` as well, which the check names (``scale:1/T``).  jax is imported inside the
functions; the suite does not depend on it.
"""

from __future__ import annotations

import numpy as np

from kfac_ref.conv_geometry import ConvGeometry

from ._reference import (
    check_mode_args,
    conv_reference_factors,
    model_output_vectors,
)

__all__ = ["reference_jax_kfac", "check_jax_kfac", "KINDS"]

KINDS = ("dense", "conv1d", "conv2d", "conv3d", "embedding", "scale_shift")


def _check_layers(fn, layers):
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{fn}: layers must be a non-empty dict of layer name -> "
                         f"{{'kind': 'dense' | 'conv2d' | ..., 'bias': bool, ...}}; got "
                         f"{layers!r:.80}.")
    for name, spec in layers.items():
        if not isinstance(spec, dict) or spec.get("kind") not in KINDS:
            raise ValueError(f"{fn}: layers[{name!r}] must be a dict with 'kind' one of "
                             f"{KINDS}; got {spec!r:.80}.")
        kind = spec["kind"]
        if kind != "embedding" and not isinstance(spec.get("bias"), bool):
            raise ValueError(f"{fn}: layers[{name!r}]['bias'] must be True or False; got "
                             f"{spec.get('bias')!r}.")
        if kind.startswith("conv"):
            nd = int(kind[4])
            k = spec.get("kernel")
            if (not isinstance(k, (tuple, list)) or len(k) != nd
                    or not all(isinstance(v, int) and v > 0 for v in k)):
                raise ValueError(f"{fn}: layers[{name!r}]['kernel'] must be {nd} positive "
                                 f"ints; got {k!r}.")
            groups = spec.get("groups", 1)
            if not (isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1):
                raise ValueError(f"{fn}: layers[{name!r}]['groups'] must be a positive int; "
                                 f"got {groups!r}.")
        if kind == "embedding":
            v = spec.get("vocab")
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"{fn}: layers[{name!r}]['vocab'] must be the number of "
                                 f"embeddings, a positive int; got {v!r}.")


def _uses(tap):
    """A tap is ``(input, output)`` or a list of them (a layer used several times)."""
    return list(tap) if isinstance(tap, list) else [tap]


def _taps(fn, model, params, inputs, perturbations, layers):
    res = model(params, inputs, perturbations)
    if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[1], dict)):
        raise ValueError(f"{fn}: model(params, inputs, perturbations) must return (outputs, "
                         f"{{layer name: (layer input, layer output)}}); got "
                         f"{type(res).__name__}.")
    missing = sorted(set(layers) - set(res[1]))
    if missing:
        raise ValueError(f"{fn}: the model's taps must include every layer of layers; "
                         f"missing {', '.join(missing)}.")
    return res


def reference_jax_kfac(model, params, inputs, targets, layers, *, loss="cross_entropy",
                       mode="fisher_exact", sharing="expand", rng=None, samples=None,
                       mc_samples=1, _fn="reference_jax_kfac"):
    r"""Reference K-FAC factors of every layer in ``layers`` of the JAX function ``model``
    (module docstring for its signature and the layouts), in float64:

    .. math::

        A = \frac{1}{N|T|}\sum_{n,t} \bar a_{n,t} \bar a_{n,t}^\top, \qquad
        G = \frac{1}{N}\sum_{n,t,k} g_{n,t,k}\, g_{n,t,k}^\top,
        \qquad g_{\cdot,k} = \Big(\frac{\partial f}{\partial \epsilon}\Big)^{\!\top} v_k ,

    :math:`v_k` the output vectors of the mode (:func:`conformance.own_model.output_vectors`)
    and :math:`\epsilon` the layer's output perturbation.  Returns the dict of
    :func:`conformance.own_model.reference_torch_kfac` (``order="hwc"`` for conv layers).
    """
    import jax
    import jax.numpy as jnp

    check_mode_args(_fn, loss, mode, sharing, rng, samples)
    _check_layers(_fn, layers)
    _, taps0 = _taps(_fn, model, params, inputs, {}, layers)
    zeros = {name: (jnp.zeros_like(taps0[name][1]) if not isinstance(taps0[name], list)
                    else [jnp.zeros_like(u[1]) for u in taps0[name]]) for name in layers}

    def f(eps):
        return _taps(_fn, model, params, inputs, eps, layers)

    out, vjp, taps = jax.vjp(f, zeros, has_aux=True)
    out_np = np.asarray(out, dtype=np.float64)
    vecs = model_output_vectors(_fn, loss, out_np, targets, mode, samples=samples, rng=rng,
                                mc_samples=mc_samples)
    rows = {name: [] for name in layers}
    for v in vecs:
        (g,) = vjp(jnp.asarray(v, dtype=out.dtype))
        for name in layers:
            rows[name].append([np.asarray(u, dtype=np.float64) for u in _uses(g[name])])
    n = out_np.shape[0]
    res = {}
    for name, spec in layers.items():
        uses = [(np.asarray(a), np.asarray(s_)) for a, s_ in _uses(taps[name])]
        gs = [np.stack([r[u] for r in rows[name]]) for u in range(len(uses))]
        entry = _entry(_fn, name, spec, uses, gs, n, sharing)
        entry.update(N=n, K=len(vecs), uses=len(uses), dtype=str(np.dtype(out.dtype)))
        entry.setdefault("groups", 1)
        res[name] = entry
    return res


def _positions(fn, what, arr, n, trailing):
    """``arr`` as ``[N, P, *trailing]`` (positions flattened)."""
    if arr.ndim < 1 + trailing or arr.shape[0] != n:
        raise ValueError(f"{fn}: the tap of {what} must be [N, ...] with N = {n}; got shape "
                         f"{arr.shape}.")
    tail = arr.shape[arr.ndim - trailing:] if trailing else ()
    return arr.reshape(n, -1, *tail)


def _t_of(fn, what, parts):
    ts = {p.shape[1] for p in parts}
    if len(ts) != 1:
        raise ValueError(f"{fn}: the uses of {what} must have the same number of positions; "
                         f"got {sorted(ts)}.")
    return ts.pop()  # per call; the entry's "uses" counts the calls


def _hwc_group_index(kernel, c_in, groups):
    """Columns of a channels-last patch (index δ·C + c) reordered group by group, each
    group's own (δ, c_local) order: the layout a grouped kernel [*k, C/g, O] reads."""
    k = int(np.prod(kernel))
    cg = c_in // groups
    grid = np.arange(k * c_in).reshape(k, groups, cg)  # [δ, group, c_local]
    return grid.transpose(1, 0, 2).reshape(-1)


def _entry(fn, name, spec, uses, gs, n, sharing):
    """One layer's reference entry from its per-use (input, output) taps and output vectors
    ``gs`` (``[K, N, ...]`` per use)."""
    from kfac_ref.factors import conv_patch_matrix

    from ._reference import (
        embedding_reference_factors,
        grouped_reference_factors,
        scale_shift_reference_factors,
    )

    kind, bias = spec["kind"], spec.get("bias", False)
    what = f"{kind} layer {name!r}"
    if kind == "dense":
        a = [_positions(fn, what, np.asarray(x, dtype=np.float64), n, 1) for x, _ in uses]
        g = [gi.reshape(gi.shape[0], n, -1, gi.shape[-1]) for gi in gs]
        fa, fg = grouped_reference_factors(np.concatenate(a, 1), np.concatenate(g, 2),
                                           groups=1, bias=bias, sharing=sharing)
        return {"A": fa, "G": fg, "T": _t_of(fn, what, a), "kind": "dense", "bias": bias}
    if kind == "embedding":
        ids = [_positions(fn, what, np.asarray(x), n, 0) for x, _ in uses]
        g = [gi.reshape(gi.shape[0], n, -1, gi.shape[-1]) for gi in gs]
        fa, fg = embedding_reference_factors(np.concatenate(ids, 1), np.concatenate(g, 2),
                                             vocab=spec["vocab"], sharing=sharing)
        t = _t_of(fn, what, ids)
        return {"A": fa, "G": fg, "T": t, "kind": "embedding", "bias": False,
                "A_diagonal": sharing == "expand" or t == 1}
    if kind == "scale_shift":
        xh = [_positions(fn, what, np.asarray(x, dtype=np.float64), n, 1) for x, _ in uses]
        g = [gi.reshape(gi.shape[0], n, -1, gi.shape[-1]) for gi in gs]
        f, d = scale_shift_reference_factors(np.concatenate(xh, 1), np.concatenate(g, 2),
                                             has_shift=bias)
        return {"F": f, "diag": d, "T": _t_of(fn, what, xh), "kind": "scale_shift",
                "bias": bias}
    nd = int(kind[4])
    groups = spec.get("groups", 1)
    pad = spec.get("padding", "VALID")
    pad = pad.upper() if isinstance(pad, str) else pad
    strides = (spec.get("strides", 1),) * nd if isinstance(spec.get("strides", 1), int) \
        else tuple(spec["strides"])
    dilation = (spec.get("dilation", 1),) * nd if isinstance(spec.get("dilation", 1), int) \
        else tuple(spec["dilation"])
    xs = [np.asarray(x, dtype=np.float64) for x, _ in uses]
    for x in xs:
        if x.ndim != nd + 2 or x.shape[0] != n:
            raise ValueError(f"{fn}: the input of {what} must be [N, {'*' * nd}, C] "
                             f"({nd + 2}-D, channels last); got shape {x.shape}.")
    c_in, c_out = xs[0].shape[-1], gs[0].shape[-1]
    geo = ConvGeometry.from_shapes(xs[0].shape, (*spec["kernel"], c_in, c_out),
                                   strides=strides, padding=pad, dilation=dilation)
    entry = {"kind": kind, "bias": bias, "kernel": list(spec["kernel"]), "c_in": c_in,
             "order": "hwc", "padding": tuple(geo.padding), "strides": tuple(geo.strides),
             "dilation": tuple(geo.dilation), "groups": groups}
    if kind == "conv2d" and groups == 1 and len(uses) == 1:
        g = gs[0]
        fa, fg, t = conv_reference_factors(
            xs[0], g, kernel=tuple(spec["kernel"]), padding=pad, strides=strides,
            dilation=dilation, bias=bias, sharing=sharing, data_format="NHWC", order="hwc")
        entry.update(A=fa, G=fg, T=t, _x=xs[0], _g=g)  # the data, for geometry alternatives
        return entry
    filt = (*spec["kernel"], c_in, 1)
    p = [np.asarray(conv_patch_matrix(x, filt, tuple(geo.padding), tuple(geo.strides),
                                      tuple(geo.dilation), data_format=None)) for x in xs]
    p = [pi[:, _hwc_group_index(spec["kernel"], c_in, groups)].reshape(n, -1, pi.shape[-1])
         for pi in p]
    g = [gi.reshape(gi.shape[0], n, -1, gi.shape[-1]) for gi in gs]
    fa, fg = grouped_reference_factors(np.concatenate(p, 1), np.concatenate(g, 2),
                                       groups=groups, bias=bias, sharing=sharing)
    entry.update(A=fa, G=fg, T=_t_of(fn, what, p))
    return entry


def check_jax_kfac(model, params, inputs, targets, layers, factors, *, loss="cross_entropy",
                   mode="fisher_exact", sharing="expand", rng=None, samples=None,
                   mc_samples=1, conventions=None, level="block", check_layers=None,
                   earlier=None, decay=None):
    r"""Compare a user's K-FAC factors of the JAX function ``model`` with the reference of
    :func:`reference_jax_kfac`, per layer — each factor and the layer's block — and name
    the pitfall behind each disagreement (as :func:`conformance.own_model.check_torch_kfac`,
    with the same ``conventions``, ``level``, ``earlier`` and ``decay``; the subset to check
    is ``check_layers``, since ``layers`` describes the model's layers here; the other
    patch order is unfold's ``(C, kh, kw)``).

    .. math::

        \frac{\|A_\text{user}\otimes G_\text{user} - A\otimes G\|_F}
             {\|A\otimes G\|_F} \le \text{rtol}_A + \text{rtol}_G

    ``factors``: ``{layer name: {"A": ..., "G": ...}}`` (JAX or NumPy arrays), copied
    first; ``earlier``: the ``(inputs, targets)`` of earlier statistics updates, oldest
    first.
    """
    from ._check import check_batches

    fn = "check_jax_kfac"
    check_mode_args(fn, loss, mode, sharing, rng, samples)
    _check_layers(fn, layers)
    if earlier is not None and not isinstance(earlier, (list, tuple)):
        raise TypeError(f"{fn}: earlier must be a list of (inputs, targets) pairs; got "
                        f"{earlier!r:.80}.")

    def reference(x, y, mode_, sharing_, samples_):
        return reference_jax_kfac(model, params, x, y, layers, loss=loss, mode=mode_,
                                  sharing=sharing_, samples=samples_, _fn=fn)

    def outputs(x):
        return np.asarray(_taps(fn, model, params, x, {}, layers)[0], dtype=np.float64)

    return check_batches(fn, factors, list(earlier or []) + [(inputs, targets)], mode,
                         reference=reference, outputs=outputs, loss=loss, sharing=sharing,
                         rng=rng, samples=samples, mc_samples=mc_samples,
                         conventions=conventions, level=level, layers=check_layers,
                         decay=decay)
