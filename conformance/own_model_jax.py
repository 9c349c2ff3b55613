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
model's outputs ``[N, C]`` with the *taps*: per layer, its input and its (perturbed) output.
The back-propagated output vectors are the derivatives with respect to the perturbations
(the perturbation trick of kfac-jax), taken with one :func:`jax.vjp` and one vector–Jacobian
product per loss Fisher-factor column.  ``layers`` says what each tapped layer is:

* ``{"kind": "dense", "bias": bool}``: weight ``[in, out]`` (``x @ w``), input
  ``[N, (S,) in]``; ``A`` is ``[in(+1), in(+1)]``, ``G`` is ``[out, out]``;
* ``{"kind": "conv2d", "kernel": (kh, kw), "strides": ..., "padding": "SAME" | "VALID" |
  ((t, b), (l, r)), "dilation": ..., "bias": bool}``: NHWC input, HWIO kernel (JAX's and
  kfac-jax's layout); ``A`` is over the patches in ``(kh, kw, C_in)`` order, ``C_in``
  fastest (index ``(i·kw + j)·C + c``, the order of ``kernel.reshape(-1, out)``).

The bias's homogeneous coordinate is last.  The reference is the one of
:mod:`conformance.own_model` (KFAC-expand, curvlinops' normalisation):

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

from .own_model import (
    as_rng,
    check_factors,
    check_mode_args,
    conv_reference_factors,
    dense_reference_factors,
    layer_alternatives,
    model_output_vectors,
    sample_targets,
)

__all__ = ["reference_jax_kfac", "check_jax_kfac", "KINDS"]

KINDS = ("dense", "conv2d")


def _check_layers(fn, layers):
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{fn}: layers must be a non-empty dict of layer name -> "
                         f"{{'kind': 'dense' | 'conv2d', 'bias': bool, ...}}; got "
                         f"{layers!r:.80}.")
    for name, spec in layers.items():
        if not isinstance(spec, dict) or spec.get("kind") not in KINDS:
            raise ValueError(f"{fn}: layers[{name!r}] must be a dict with 'kind' one of "
                             f"{KINDS}; got {spec!r:.80}.")
        if not isinstance(spec.get("bias"), bool):
            raise ValueError(f"{fn}: layers[{name!r}]['bias'] must be True or False; got "
                             f"{spec.get('bias')!r}.")
        if spec["kind"] == "conv2d":
            k = spec.get("kernel")
            if (not isinstance(k, (tuple, list)) or len(k) != 2
                    or not all(isinstance(v, int) and v > 0 for v in k)):
                raise ValueError(f"{fn}: layers[{name!r}]['kernel'] must be (kh, kw), "
                                 f"positive ints; got {k!r}.")


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


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
    zeros = {name: jnp.zeros_like(taps0[name][1]) for name in layers}

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
            rows[name].append(np.asarray(g[name], dtype=np.float64))
    n = out_np.shape[0]
    res = {}
    for name, spec in layers.items():
        a = np.asarray(taps[name][0], dtype=np.float64)
        g = np.stack(rows[name])
        bias = spec["bias"]
        if spec["kind"] == "conv2d":
            if a.ndim != 4:
                raise ValueError(f"{_fn}: the input of conv2d layer {name!r} must be "
                                 f"[N, H, W, C]; got shape {a.shape}.")
            pad = spec.get("padding", "VALID")
            fa, fg, t = conv_reference_factors(
                a, g, kernel=tuple(spec["kernel"]),
                padding=pad.upper() if isinstance(pad, str) else pad,
                strides=_pair(spec.get("strides", 1)), dilation=_pair(spec.get("dilation", 1)),
                bias=bias, sharing=sharing, data_format="NHWC", order="hwc")
            geo = ConvGeometry.from_shapes(
                a.shape, (*spec["kernel"], a.shape[-1], g.shape[-1]),
                strides=_pair(spec.get("strides", 1)),
                padding=pad.upper() if isinstance(pad, str) else pad,
                dilation=_pair(spec.get("dilation", 1)))
            res[name] = {"A": fa, "G": fg, "N": n, "T": t, "K": g.shape[0], "kind": "conv2d",
                         "kernel": list(spec["kernel"]), "c_in": a.shape[-1], "order": "hwc",
                         "padding": tuple(geo.padding), "strides": tuple(geo.strides),
                         "dilation": tuple(geo.dilation), "_x": a, "_g": g}
        else:
            fa, fg, t = dense_reference_factors(a, g, bias=bias, sharing=sharing)
            res[name] = {"A": fa, "G": fg, "N": n, "T": t, "K": g.shape[0], "kind": "dense"}
        res[name]["bias"] = bias
        res[name]["dtype"] = str(np.dtype(out.dtype))
    return res


def _batch_references(args, mode, samples, loss, sharing, fn):
    kw = dict(loss=loss, sharing=sharing, _fn=fn)
    ref = reference_jax_kfac(*args, mode=mode, samples=samples, **kw)
    others = {}
    if mode != "fisher_empirical":
        others["empirical_fisher"] = reference_jax_kfac(*args, mode="fisher_empirical", **kw)
    if mode != "fisher_exact":
        others["true_fisher"] = reference_jax_kfac(*args, mode="fisher_exact", **kw)
    if any(r["T"] > 1 for r in ref.values()):
        others["sharing"] = reference_jax_kfac(
            *args, mode=mode, samples=samples, loss=loss, _fn=fn,
            sharing="reduce" if sharing == "expand" else "expand")
    alts = {name: layer_alternatives(name, ref[name], others, mode, sharing) for name in ref}
    return ref, alts


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
    from .own_model._check import copy_factors, declared_conventions, resolve_sharing

    fn = "check_jax_kfac"
    check_mode_args(fn, loss, mode, sharing, rng, samples)
    _check_layers(fn, layers)
    factors = copy_factors(fn, factors)
    sharing = resolve_sharing(fn, sharing, declared_conventions(fn, conventions))
    if earlier and samples is not None:
        raise ValueError(f"{fn}: with earlier batches, give rng (draws for every batch), "
                         "not samples.")
    gen = as_rng(fn, rng) if rng is not None else None
    history = []
    for x_i, y_i in list(earlier or []) + [(inputs, targets)]:
        s_i = samples
        if mode == "fisher_sampled" and samples is None:  # one set of draws per batch
            out, _ = _taps(fn, model, params, x_i, {}, layers)
            s_i = sample_targets(loss, np.asarray(out, dtype=np.float64), gen, mc_samples)
        history.append(_batch_references((model, params, x_i, y_i, layers), mode, s_i, loss,
                                         sharing, fn))
    ref, alts = history[-1]
    return check_factors(ref, factors, alts, mode, fn, conventions=conventions, level=level,
                         layers=check_layers, earlier=history[:-1], decay=decay, loss=loss)
