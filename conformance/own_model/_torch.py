r"""The own-model check for PyTorch ``nn.Module``\ s: layer inputs and output cotangents
captured with hooks, the reference factors, the per-layer check."""

from __future__ import annotations

import numpy as np

from ._reference import (
    _np,
    check_mode_args,
    conv_reference_factors,
    dense_reference_factors,
    model_output_vectors,
)


def _check_args(fn, model, loss, mode, sharing, rng, samples):
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module; got {type(model).__name__}.")
    check_mode_args(fn, loss, mode, sharing, rng, samples)


def torch_conv_padding(module, name=None):
    """``((top, bottom), (left, right))`` zero padding of an ``nn.Conv2d``, with PyTorch's
    split of ``padding='same'``: total :math:`d(k-1)` per axis, ``total // 2`` before and
    the rest (one more, when the total is odd) after; ``'valid'`` is no padding.
    Raises ``ValueError`` naming the module for ``groups != 1`` or a padding mode other
    than ``'zeros'`` (``name``: the module's name in the model, for the message)."""
    name = type(module).__name__ if name is None else name
    if module.groups != 1:
        raise ValueError(f"own-model check: nn.Conv2d {name!r} must have groups=1; got "
                         f"groups={module.groups}.")
    if module.padding_mode != "zeros":
        raise ValueError(f"own-model check: nn.Conv2d {name!r} must have padding_mode="
                         f"'zeros'; got {module.padding_mode!r}.")
    pad = module.padding
    if pad == "valid":
        return ((0, 0), (0, 0))
    if pad == "same":
        out = []
        for k, d in zip(module.kernel_size, module.dilation, strict=True):
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))
        return tuple(out)
    return tuple((int(p), int(p)) for p in pad)


def _supported_layers(fn, model):
    import torch

    layers = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d):
            torch_conv_padding(m, name)  # refuses groups > 1 and other padding modes
            layers[name] = m
        elif isinstance(m, torch.nn.Linear):
            layers[name] = m
    if not layers:
        raise ValueError(f"{fn}: model must contain an nn.Linear or nn.Conv2d layer; got "
                         "none.")
    return layers


def reference_torch_kfac(model, loss, inputs, targets, *, mode="fisher_exact",
                         sharing="expand", rng=None, samples=None, mc_samples=1,
                         _fn="reference_torch_kfac"):
    r"""Reference K-FAC factors of every ``nn.Linear`` and ``nn.Conv2d`` of ``model``, in
    its own layout (module docstring: unfold patch order, bias coordinate last).

    .. math::

        A = \frac{1}{N|T|}\sum_{n,t} \bar a_{n,t} \bar a_{n,t}^\top, \qquad
        G = \frac{1}{N}\sum_{n,t,k} g_{n,t,k} g_{n,t,k}^\top

    ``mode="fisher_sampled"`` takes ``rng`` (seed or Generator, with ``mc_samples`` draws
    per example, see :func:`sample_targets`) or ``samples`` (the draws themselves).
    Returns ``{module name: {"A", "G", "N", "T", "K", "kind"}}`` in float64 (``T`` = number
    of output locations or shared positions, ``K`` = vectors per example, ``kind`` =
    ``"dense"`` or ``"conv2d"``, ``dtype`` = the model output's floating type; conv layers
    also carry their geometry ``"kernel"``, ``"c_in"``, ``"padding"``, ``"strides"``,
    ``"dilation"``, and the captured input and output vectors as ``"_x"``, ``"_g"``).
    """
    import torch

    _check_args(_fn, model, loss, mode, sharing, rng, samples)
    layers = _supported_layers(_fn, model)
    ins, outs, hooks = {}, {}, []
    for name, mod in layers.items():
        def hook(m, args, output, name=name):
            ins[name] = args[0].detach().to(torch.float64)
            outs[name] = output
        hooks.append(mod.register_forward_hook(hook))
    try:
        out = model(inputs)
    finally:
        for h in hooks:
            h.remove()
    out_np = _np(out, np.float64)
    vecs = model_output_vectors(_fn, loss, out_np, targets, mode, samples=samples, rng=rng,
                                mc_samples=mc_samples)
    n = out_np.shape[0]
    g_rows = {name: [] for name in layers}
    for v in vecs:
        gv = torch.as_tensor(v, dtype=out.dtype, device=out.device)
        grads = torch.autograd.grad(out, [outs[k] for k in layers], grad_outputs=gv,
                                    retain_graph=True)
        for name, g in zip(layers, grads, strict=True):
            g_rows[name].append(_np(g, np.float64))
    res = {}
    for name, mod in layers.items():
        a, g = ins[name].cpu().numpy(), np.stack(g_rows[name])
        if isinstance(mod, torch.nn.Conv2d):
            if a.ndim != 4:
                raise ValueError(f"{_fn}: the input of nn.Conv2d {name!r} must be "
                                 f"[N, C, H, W]; got shape {a.shape}.")
            fa, fg, t = conv_reference_factors(
                a, g, kernel=mod.kernel_size, padding=torch_conv_padding(mod),
                strides=mod.stride, dilation=mod.dilation, bias=mod.bias is not None,
                sharing=sharing)
            res[name] = {"A": fa, "G": fg, "N": n, "T": t, "K": g.shape[0], "kind": "conv2d",
                         "kernel": list(mod.kernel_size), "c_in": mod.in_channels,
                         "order": "chw", "padding": torch_conv_padding(mod),
                         "strides": tuple(mod.stride), "dilation": tuple(mod.dilation),
                         "_x": a, "_g": g}  # the layer's data, for geometry alternatives
        else:
            fa, fg, t = dense_reference_factors(a, g, bias=mod.bias is not None,
                                                sharing=sharing)
            res[name] = {"A": fa, "G": fg, "N": n, "T": t, "K": g.shape[0], "kind": "dense"}
        res[name]["bias"] = mod.bias is not None
        res[name]["dtype"] = str(out.dtype).removeprefix("torch.")
    return res
