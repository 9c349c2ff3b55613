r"""The own-model check for PyTorch ``nn.Module``\ s: layer inputs and output cotangents
captured with hooks, the reference factors, the per-layer check.

Each K-FAC layer is a list of *uses* (one per call of the module in the forward pass), each
use an input tensor (detached) and the output tensor the output vectors are
back-propagated to.  ``nn.MultiheadAttention`` is recomputed by its forward hook with plain
torch ops (the hook's output replaces the module's, after a numerical check that they
agree), so its projections' inputs and pre-activations are tensors of the graph."""

from __future__ import annotations

import math

import numpy as np

from ._reference import (
    _np,
    check_mode_args,
    conv_patches,
    conv_reference_factors,
    embedding_reference_factors,
    grouped_reference_factors,
    model_output_vectors,
    scale_shift_reference_factors,
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
    than ``'zeros'`` (``name``: the module's name in the model, for the message).  Any
    convolution, grouped or not, of any rank: :func:`torch_conv_padding_nd`."""
    name = type(module).__name__ if name is None else name
    if module.groups != 1:
        raise ValueError(f"own-model check: nn.Conv2d {name!r} must have groups=1; got "
                         f"groups={module.groups}.")
    return torch_conv_padding_nd(module, name)


def torch_conv_padding_nd(module, name=None):
    """``((before, after), ...)`` zero padding per spatial axis of an ``nn.Conv1d``,
    ``nn.Conv2d`` or ``nn.Conv3d`` (PyTorch's split of ``'same'`` as in
    :func:`torch_conv_padding`); ``ValueError`` naming the module for a padding mode other
    than ``'zeros'``."""
    kind = type(module).__name__
    name = kind if name is None else name
    if module.padding_mode != "zeros":
        raise ValueError(f"own-model check: nn.{kind} {name!r} must have padding_mode="
                         f"'zeros'; got {module.padding_mode!r}.")
    pad = module.padding
    if pad == "valid":
        return tuple((0, 0) for _ in module.kernel_size)
    if pad == "same":
        out = []
        for k, d in zip(module.kernel_size, module.dilation, strict=True):
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))
        return tuple(out)
    return tuple((int(p), int(p)) for p in pad)


_NORMS = ("LayerNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "GroupNorm")


def _kind(m):
    """The K-FAC kind of a module, or None."""
    import torch.nn as nn

    if isinstance(m, nn.MultiheadAttention):
        return "mha"
    if isinstance(m, nn.Linear):
        return "dense"
    for d, cls in ((1, nn.Conv1d), (2, nn.Conv2d), (3, nn.Conv3d)):
        if isinstance(m, cls):
            return f"conv{d}d"
    if isinstance(m, nn.Embedding):
        return "embedding"
    if isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)):
        return "scale_shift" if getattr(m, "weight", None) is not None else None
    return None


def _supported_layers(fn, model):
    """``{module name: (kind, module)}`` of the K-FAC layers of ``model`` (the modules inside
    an ``nn.MultiheadAttention`` belong to it), each checked for what the reference
    supports."""
    layers, inside = {}, []
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        kind = _kind(m)
        if kind is None:
            continue
        what = f"nn.{type(m).__name__} {name!r}"
        if kind.startswith("conv"):
            torch_conv_padding_nd(m, name)
        elif kind == "mha":
            inside.append(name)
            if m.bias_k is not None or m.add_zero_attn:
                raise ValueError(f"{fn}: {what} must have add_bias_kv=False and "
                                 f"add_zero_attn=False; got add_bias_kv="
                                 f"{m.bias_k is not None}, add_zero_attn={m.add_zero_attn}.")
        elif kind == "embedding":
            if m.max_norm is not None or m.scale_grad_by_freq:
                raise ValueError(f"{fn}: {what} must have max_norm=None and "
                                 f"scale_grad_by_freq=False (the layer must be "
                                 f"onehot(ids) @ weight); got max_norm={m.max_norm}, "
                                 f"scale_grad_by_freq={m.scale_grad_by_freq}.")
        layers[name] = (kind, m)
    if not layers:
        raise ValueError(f"{fn}: model must contain a K-FAC layer (nn.Linear, nn.Conv1d/2d/3d, "
                         "nn.MultiheadAttention, nn.Embedding, an affine LayerNorm, "
                         "BatchNorm or GroupNorm); got none.")
    return layers


def _close(ours, theirs):
    """Whether a recomputation agrees with the module's output to its floating type."""
    import torch

    eps = torch.finfo(theirs.dtype).eps
    scale = float(theirs.detach().abs().nan_to_num(0.0).max()) if theirs.numel() else 0.0
    return bool(torch.allclose(ours, theirs, rtol=0.0, atol=1e3 * eps * max(scale, 1.0),
                               equal_nan=True))


def _mha_hook(fn, name, sites):
    """Forward hook (``with_kwargs``) of an ``nn.MultiheadAttention``: the attention recomputed
    with its projections as graph tensors, checked against the module's output and returned
    in its place."""
    import torch
    import torch.nn.functional as F

    keys = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
            "average_attn_weights", "is_causal")

    def hook(m, args, kwargs, output):
        what = f"nn.MultiheadAttention {name!r}"
        if m.training and m.dropout > 0:
            raise ValueError(f"{fn}: {what} must not drop out: call model.eval() or set "
                             f"dropout=0; got training mode with dropout={m.dropout}.")
        call = dict(key_padding_mask=None, need_weights=True, attn_mask=None,
                    average_attn_weights=True, is_causal=False)
        call.update(zip(keys, args, strict=False))
        call.update(kwargs)
        q_in, k_in, v_in = call["query"], call["key"], call["value"]
        if q_in.dim() != 3:
            raise ValueError(f"{fn}: {what} must be called on batched inputs (3-D); got "
                             f"query of shape {tuple(q_in.shape)}.")
        fused = q_in is k_in and k_in is v_in and m._qkv_same_embed_dim
        if not m.batch_first:
            q_in, k_in, v_in = (t.transpose(0, 1) for t in (q_in, k_in, v_in))
        n, lq, e = q_in.shape
        s_len, h = k_in.shape[1], m.num_heads
        hd = e // h
        b = m.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:e], b[e:2 * e], b[2 * e:])
        if fused:
            s = F.linear(q_in, m.in_proj_weight, b)
            sites[f"{name}.in_proj"].append((q_in.detach(), s))
            q, k, v = s.split(e, dim=-1)
        else:
            if m._qkv_same_embed_dim:
                w = m.in_proj_weight
                wq, wk, wv = w[:e], w[e:2 * e], w[2 * e:]
            else:
                wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
            q, k, v = (F.linear(t, wt, bt) for t, wt, bt in
                       ((q_in, wq, bq), (k_in, wk, bk), (v_in, wv, bv)))
            for part, t, o in (("q", q_in, q), ("k", k_in, k), ("v", v_in, v)):
                sites[f"{name}.{part}_proj"].append((t.detach(), o))
        q = q.reshape(n, lq, h, hd).transpose(1, 2)
        k = k.reshape(n, s_len, h, hd).transpose(1, 2)
        v = v.reshape(n, s_len, h, hd).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)  # [N, h, L, S]
        for mask, shape in ((call["attn_mask"], (-1, h, lq, s_len)),
                            (call["key_padding_mask"], (n, 1, 1, s_len))):
            if mask is None:
                continue
            mask = mask.reshape(shape) if mask.dim() == 3 or shape[1] == 1 else mask
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(mask, float("-inf"))
            else:
                scores = scores + mask.to(scores.dtype)
        wts = torch.softmax(scores, dim=-1)
        c = (wts @ v).transpose(1, 2).reshape(n, lq, e)
        o = F.linear(c, m.out_proj.weight, m.out_proj.bias)
        sites[f"{name}.out_proj"].append((c.detach(), o))
        out = o if m.batch_first else o.transpose(0, 1)
        if not _close(out, output[0]):
            raise ValueError(f"{fn}: {what}: the reference's recomputation of the attention "
                             f"does not match the module's output (max difference "
                             f"{float((out - output[0]).detach().abs().max()):.3e}); the call's "
                             f"arguments are not supported.")
        if not call["need_weights"]:
            return out, None
        aw = wts.mean(dim=1) if call["average_attn_weights"] else wts
        return out, aw

    return hook


def _normalised(fn, name, m, x, y):
    """``x̂`` of a LayerNorm / BatchNorm / GroupNorm from its input ``x`` by the module's own
    normalisation (batch statistics in training mode or without running statistics), checked
    against its output ``y = γ ⊙ x̂ + β``; returned as ``[N, P, q]`` (``P`` positions sharing
    the ``q`` parameters)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    x = x.detach()
    what = f"nn.{type(m).__name__} {name!r}"
    with torch.no_grad():
        if isinstance(m, nn.LayerNorm):
            xh = F.layer_norm(x, m.normalized_shape, None, None, m.eps)
            q = math.prod(m.normalized_shape)
            gam = m.weight
            beta = m.bias
        else:
            if isinstance(m, nn.GroupNorm):
                xh = F.group_norm(x, m.num_groups, None, None, m.eps)
            elif m.training or m.running_mean is None:
                xh = F.batch_norm(x, None, None, None, None, True, 0.0, m.eps)
            else:
                xh = F.batch_norm(x, m.running_mean, m.running_var, None, None, False, 0.0,
                                  m.eps)
            shape = (1, -1) + (1,) * (x.dim() - 2)
            gam = m.weight.reshape(shape)
            beta = None if m.bias is None else m.bias.reshape(shape)
        yh = xh * gam if beta is None else xh * gam + beta
        if not _close(yh, y):
            raise ValueError(f"{fn}: {what}: γ ⊙ x̂ + β recomputed from its input does not "
                             f"match its output (max difference "
                             f"{float((yh - y).abs().max()):.3e}).")
    if isinstance(m, nn.LayerNorm):
        return xh.reshape(x.shape[0], -1, q)
    return xh.movedim(1, -1).reshape(x.shape[0], -1, x.shape[1])


def _positions(fn, what, arr, n, trailing):
    """``arr`` ``[N, ..., *trailing-dims]`` as ``[N, P, ...]`` (``trailing`` kept dims)."""
    if arr.ndim < 1 + trailing or arr.shape[0] != n:
        raise ValueError(f"{fn}: the input of {what} must have the batch axis first "
                         f"([N, ...] with N = {n}, the model output's); got shape "
                         f"{arr.shape}.")
    return arr.reshape(n, -1, *arr.shape[arr.ndim - trailing:])


def _uses(fn, what, shapes):
    """The one location count ``T`` of the per-use ``[N, T, ...]`` ``shapes`` (a module
    called on inputs with different numbers of locations is refused)."""
    ts = {p[1] for p in shapes}
    if len(ts) != 1:
        raise ValueError(f"{fn}: {what} must see the same number of locations in each of "
                         f"its calls; got {sorted(ts)}.")
    return ts.pop()


def reference_torch_kfac(model, loss, inputs, targets, *, mode="fisher_exact",
                         sharing="expand", rng=None, samples=None, mc_samples=1,
                         _fn="reference_torch_kfac"):
    r"""Reference K-FAC factors of every K-FAC layer of ``model``, in its own layout (module
    docstring: unfold patch order, bias coordinate last).

    .. math::

        A = \frac{1}{N U |T|}\sum_{n,u,t} \bar a_{n,u,t} \bar a_{n,u,t}^\top, \qquad
        G = \frac{1}{N}\sum_{n,u,t,k} g_{n,u,t,k} g_{n,u,t,k}^\top

    over the :math:`U` calls of the module and its :math:`|T|` locations (KFAC-expand;
    ``sharing="reduce"``: the mean input and the summed vectors over uses × locations per
    example).  ``mode="fisher_sampled"`` takes ``rng`` (seed or Generator, with
    ``mc_samples`` draws per example, see :func:`sample_targets`) or ``samples``.

    Returns ``{layer name: entry}`` in float64; every entry has ``"N"``, ``"T"`` (locations
    or shared positions per call), ``"K"`` (vectors per example), ``"uses"`` (calls of the
    module), ``"groups"``, ``"kind"``, ``"bias"`` and ``"dtype"`` (the model output's
    floating type), and

    * ``"dense"`` (``nn.Linear``; the projections of ``nn.MultiheadAttention``:
      ``"{name}.in_proj"`` for self-attention, else ``"{name}.q_proj"``, ``"k_proj"``,
      ``"v_proj"``, and ``"{name}.out_proj"``): ``"A"``, ``"G"``;
    * ``"conv1d"``, ``"conv2d"``, ``"conv3d"``: ``"A"``, ``"G"`` (``[g, d, d]`` and
      ``[g, O/g, O/g]`` with ``groups = g > 1``), ``"kernel"``, ``"c_in"``, ``"order"``,
      ``"padding"``, ``"strides"``, ``"dilation"``, and for a 2-D convolution with one group
      called once the captured input and output vectors ``"_x"``, ``"_g"``;
    * ``"embedding"``: ``"A"`` ``[V, V]`` (diagonal for KFAC-expand: ``"A_diagonal"``),
      ``"G"`` ``[D, D]``, ``"padding_idx"``;
    * ``"scale_shift"`` (affine LayerNorm, BatchNorm, GroupNorm): ``"F"`` (the full
      per-example second moment of the :math:`(γ, β)` gradient) and ``"diag"``.

    Modules not called in the forward pass have no entry.  The model's buffers (BatchNorm
    running statistics) are restored after the forward pass.
    """
    import torch

    _check_args(_fn, model, loss, mode, sharing, rng, samples)
    layers = _supported_layers(_fn, model)
    sites, hooks = {}, []
    for name, (kind, mod) in layers.items():
        if kind == "mha":
            for part in ("in_proj", "q_proj", "k_proj", "v_proj", "out_proj"):
                sites[f"{name}.{part}"] = []
            hooks.append(mod.register_forward_hook(_mha_hook(_fn, name, sites),
                                                   with_kwargs=True))
            continue
        sites[name] = []

        def hook(m, args, output, name=name):
            sites[name].append((args[0].detach(), output))
        hooks.append(mod.register_forward_hook(hook))
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        try:
            out = model(inputs)
        finally:
            for h in hooks:
                h.remove()
        return _reference(_fn, layers, sites, out, loss, targets, mode, samples, rng,
                          mc_samples, sharing)
    finally:  # the running statistics the forward pass moved (after every backward pass)
        with torch.no_grad():
            for b, v in saved:
                if not torch.equal(b, v):
                    b.copy_(v)


def _reference(_fn, layers, sites, out, loss, targets, mode, samples, rng, mc_samples,
               sharing):
    """The entries of :func:`reference_torch_kfac` from the captured uses ``sites``."""
    import torch

    sites = {k: v for k, v in sites.items() if v}
    out_np = _np(out, np.float64)
    vecs = model_output_vectors(_fn, loss, out_np, targets, mode, samples=samples, rng=rng,
                                mc_samples=mc_samples)
    n = out_np.shape[0]
    flat = [(name, u) for name, uses in sites.items() for u in range(len(uses))]
    g_rows = {key: [] for key in flat}
    for v in vecs:  # one backward pass per output vector, every layer and use at once
        gv = torch.as_tensor(v, dtype=out.dtype, device=out.device)
        grads = torch.autograd.grad(out, [sites[nm][u][1] for nm, u in flat], grad_outputs=gv,
                                    retain_graph=True, allow_unused=True)
        for key, g in zip(flat, grads, strict=True):
            s = sites[key[0]][key[1]][1]
            g_rows[key].append(np.zeros(s.shape) if g is None else _np(g, np.float64))
    res = {}
    for name, uses in sites.items():
        owner = name if name in layers else name.rsplit(".", 1)[0]
        kind, mod = layers[owner]
        what = f"nn.{type(mod).__name__} {owner!r}"
        gs = [np.stack(g_rows[(name, u)]) for u in range(len(uses))]
        entry = _entry(_fn, what, kind, mod, name, uses, gs, n, sharing)
        entry.update(K=len(vecs), uses=len(uses), N=n,
                     dtype=str(out.dtype).removeprefix("torch."))
        entry.setdefault("groups", 1)
        res[name] = entry
    return res


def _bn_gn():
    import torch.nn as nn

    return (nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


def _entry(fn, what, kind, mod, name, uses, gs, n, sharing):
    """One layer's reference entry from its per-use (input, output) tensors ``uses`` and
    output vectors ``gs`` (``[K, N, ...]`` arrays)."""
    import torch

    xs = [u[0] for u in uses]
    if kind == "mha":  # a projection of an attention: [N, L, E] inputs, dense
        kind = "dense"
        proj_bias = mod.out_proj.bias if name.endswith(".out_proj") else mod.in_proj_bias
        bias = proj_bias is not None
    else:
        bias = getattr(mod, "bias", None) is not None
    if kind == "dense":
        a = [_positions(fn, what, x.to(torch.float64).cpu().numpy(), n, 1) for x in xs]
        g = [gi.reshape(gi.shape[0], n, -1, gi.shape[-1]) for gi in gs]
        t = _uses(fn, what, [ai.shape for ai in a])
        fa, fg = grouped_reference_factors(np.concatenate(a, 1), np.concatenate(g, 2),
                                           groups=1, bias=bias, sharing=sharing)
        return {"A": fa, "G": fg, "T": t, "kind": "dense", "bias": bias}
    if kind == "embedding":
        ids = [_positions(fn, what, x.cpu().numpy(), n, 0) for x in xs]
        g = [gi.reshape(gi.shape[0], n, -1, gi.shape[-1]) for gi in gs]
        t = _uses(fn, what, [i.shape for i in ids])
        fa, fg = embedding_reference_factors(
            np.concatenate(ids, 1), np.concatenate(g, 2), vocab=mod.num_embeddings,
            padding_idx=mod.padding_idx, sharing=sharing)
        return {"A": fa, "G": fg, "T": t, "kind": "embedding", "bias": False,
                "A_diagonal": sharing == "expand" or len(xs) * t == 1,
                "padding_idx": mod.padding_idx}
    if kind == "scale_shift":
        xh = [_normalised(fn, name, mod, x, y).cpu().numpy().astype(np.float64)
              for x, y in uses]
        g = [gi.reshape(gi.shape[0], *xi.shape) if not isinstance(mod, _bn_gn())
             else np.moveaxis(gi, 2, -1).reshape(gi.shape[0], *xi.shape)
             for gi, xi in zip(gs, xh, strict=True)]
        t = _uses(fn, what, [xi.shape for xi in xh])
        f, d = scale_shift_reference_factors(np.concatenate(xh, 1), np.concatenate(g, 2),
                                             has_shift=bias)
        return {"F": f, "diag": d, "T": t, "kind": "scale_shift", "bias": bias}
    # convolutions
    nd = int(kind[4])
    pad = torch_conv_padding_nd(mod, name)
    geo = dict(kernel=tuple(mod.kernel_size), padding=pad, strides=tuple(mod.stride),
               dilation=tuple(mod.dilation))
    for x in xs:
        if x.dim() != nd + 2 or x.shape[0] != n:
            raise ValueError(f"{fn}: the input of {what} must be [N, C, {'*' * nd}] "
                             f"({nd + 2}-D with N = {n}); got shape {tuple(x.shape)}.")
    entry = {"kind": kind, "bias": bias, "kernel": list(mod.kernel_size),
             "c_in": mod.in_channels, "order": "chw", "padding": pad,
             "strides": tuple(mod.stride), "dilation": tuple(mod.dilation),
             "groups": mod.groups}
    if kind == "conv2d" and mod.groups == 1 and len(xs) == 1:
        a, g = xs[0].to(torch.float64).cpu().numpy(), gs[0]
        fa, fg, t = conv_reference_factors(a, g, **geo, bias=bias, sharing=sharing)
        entry.update(A=fa, G=fg, T=t, _x=a, _g=g)  # the layer's data, for geometry alternatives
        return entry
    p = [conv_patches(x.to(torch.float64).cpu().numpy(), **geo) for x in xs]
    g = [gi.reshape(gi.shape[0], n, gi.shape[2], -1).transpose(0, 1, 3, 2) for gi in gs]
    t = _uses(fn, what, [pi.shape for pi in p])
    fa, fg = grouped_reference_factors(np.concatenate(p, 1), np.concatenate(g, 2),
                                       groups=mod.groups, bias=bias, sharing=sharing)
    entry.update(A=fa, G=fg, T=t)
    return entry
