"""Build the suite's portable network specs (``params["net"]``, see
``conformance/catalogue/networks_cases.py``) in each peer framework, float64.

Canonical spec semantics: dense ``s = x W + b`` on the last axis (inputs [N, d] or
weight-shared [N, S, d]); conv2d NHWC with an HWIO kernel (padding "VALID", "SAME" with TF's
split, or explicit pairs); ``activation`` tanh or relu; ``mean_pool`` over positions/locations;
``flatten`` in NHWC order; loss ``categorical`` (softmax cross-entropy, integer targets) or
``normal_mean`` (‖f − y‖²/(2v)); objective the mean over the N examples.

Nothing here imports a framework at module import time.
"""

from __future__ import annotations

import math

import numpy as np

from ..catalogue._data import block_diag as block_diag  # the adapters' nets.block_diag

__all__ = ["conv_pads", "parametric", "torch_build", "torch_loss"]


def parametric(spec):
    return [(i, s) for i, s in enumerate(spec) if s["kind"] in ("dense", "conv2d")]


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def conv_pads(s, hw):
    """((top, bottom), (left, right)) of a conv2d spec on spatial shape hw."""
    kh, kw = s["kernel"]
    sh, sw = _pair(s["stride"])
    dh, dw = _pair(s["dilation"])
    pad = s["padding"]
    if isinstance(pad, str):
        if pad.upper() == "VALID":
            return ((0, 0), (0, 0))
        out = []
        for n_in, k, st, d in ((hw[0], kh, sh, dh), (hw[1], kw, sw, dw)):
            o = math.ceil(n_in / st)
            total = max((o - 1) * st + (k - 1) * d + 1 - n_in, 0)
            out.append((total // 2, total - total // 2))
        return tuple(out)
    return tuple(tuple(int(v) for v in p) for p in pad)


# -- PyTorch ---------------------------------------------------------------------------------
def torch_build(spec, inputs):
    """(model, x, param_modules): an nn.Sequential in float64 taking NCHW (or [N, ...]) input.

    Conv kernels are moved HWIO → OIHW and padding becomes an explicit ``ZeroPad2d`` (so
    SAME with stride > 1 works); ``flatten`` permutes NCHW → NHWC first, so the weights of a
    following dense layer keep the canonical row order."""
    import torch
    from torch import nn

    class NHWCFlatten(nn.Module):
        def forward(self, x):
            if x.ndim == 4:
                x = x.permute(0, 2, 3, 1)
            return x.reshape(x.shape[0], -1)

    class MeanPool(nn.Module):
        def forward(self, x):
            return x.mean(dim=(2, 3)) if x.ndim == 4 else x.mean(dim=1)

    x = torch.as_tensor(np.asarray(inputs["x"], dtype=np.float64))
    if x.ndim == 4:
        x = x.permute(0, 3, 1, 2).contiguous()
    mods, pmods = [], []
    cur = x
    for i, s in enumerate(spec):
        k = s["kind"]
        if k == "dense":
            m = nn.Linear(s["d_in"], s["d_out"], bias=s["bias"]).double()
            with torch.no_grad():
                m.weight.copy_(torch.as_tensor(inputs[f"w{i}"].T))
                if s["bias"]:
                    m.bias.copy_(torch.as_tensor(inputs[f"b{i}"]))
            pmods.append(m)
            new = [m]
        elif k == "conv2d":
            (pt, pb), (pl, pr) = conv_pads(s, tuple(cur.shape[2:]))
            m = nn.Conv2d(
                s["c_in"],
                s["c_out"],
                tuple(s["kernel"]),
                stride=_pair(s["stride"]),
                dilation=_pair(s["dilation"]),
                bias=s["bias"],
            ).double()
            with torch.no_grad():
                m.weight.copy_(torch.as_tensor(np.transpose(inputs[f"w{i}"], (3, 2, 0, 1))))
                if s["bias"]:
                    m.bias.copy_(torch.as_tensor(inputs[f"b{i}"]))
            pmods.append(m)
            new = ([nn.ZeroPad2d((pl, pr, pt, pb))] if (pt, pb, pl, pr) != (0, 0, 0, 0) else []) + [
                m
            ]
        elif k == "activation":
            if s["fn"] not in ("tanh", "relu"):
                raise NotImplementedError(f"activation {s['fn']!r}")
            new = [nn.Tanh() if s["fn"] == "tanh" else nn.ReLU()]
        elif k == "mean_pool":
            # after a conv: a full-window AvgPool2d + Flatten (modules BackPACK and nngeometry
            # know); after a weight-shared dense layer: a mean over the positions
            new = (
                [nn.AvgPool2d(tuple(cur.shape[2:])), nn.Flatten()]
                if cur.ndim == 4
                else [MeanPool()]
            )
        elif k == "flatten":
            new = [NHWCFlatten()]
        else:
            raise NotImplementedError(f"layer kind {k!r}")
        for m in new:
            with torch.no_grad():
                cur = m(cur)
        mods += new
    return nn.Sequential(*mods), x, pmods


def torch_loss(params, reduction="sum"):
    """(loss module, variance of the Gaussian it corresponds to or None)."""
    from torch import nn

    if params["loss"] == "categorical":
        return nn.CrossEntropyLoss(reduction=reduction)
    if params["loss"] == "normal_mean":
        return nn.MSELoss(reduction=reduction)  # ‖f − y‖²: variance 0.5 (declared)
    raise NotImplementedError(params["loss"])


def torch_targets(params, inputs):
    import torch

    t = np.asarray(inputs["targets"])
    if params["loss"] == "categorical":
        return torch.as_tensor(t.astype(np.int64))
    return torch.as_tensor(t.astype(np.float64))


def unit_inputs(sizes, n, j):
    """Coordinate ``j`` of a loss's inputs concatenated along the last axis, split back into
    one [n, size] array per input of ``sizes``: the j-th unit vector, the same for every
    example (a column of the per-example curvature multiplies it)."""
    out, off = [], 0
    for sz in sizes:
        v = np.zeros((n, sz))
        if off <= j < off + sz:
            v[:, j - off] = 1.0
        out.append(v)
        off += sz
    return out


def check_forward_torch(model, x, spec, inputs):
    """Guard: the torch model reproduces a NumPy forward pass of the spec."""
    import torch

    with torch.no_grad():
        f_t = model(x).numpy()
    f_np = numpy_forward(spec, inputs)
    err = np.linalg.norm(f_t - f_np) / max(np.linalg.norm(f_np), 1e-300)
    if not err < 1e-12:
        raise AssertionError(f"torch model does not reproduce the spec's forward pass ({err:.2e})")


def numpy_forward(spec, inputs):
    cur = np.asarray(inputs["x"], dtype=np.float64)
    for i, s in enumerate(spec):
        k = s["kind"]
        if k == "dense":
            cur = cur @ inputs[f"w{i}"] + (inputs[f"b{i}"] if s["bias"] else 0.0)
        elif k == "conv2d":
            (pt, pb), (pl, pr) = conv_pads(s, cur.shape[1:3])
            xp = np.pad(cur, ((0, 0), (pt, pb), (pl, pr), (0, 0)))
            kk = inputs[f"w{i}"]
            kh, kw = s["kernel"]
            sh, sw = _pair(s["stride"])
            dh, dw = _pair(s["dilation"])
            oh = (xp.shape[1] - (kh - 1) * dh - 1) // sh + 1
            ow = (xp.shape[2] - (kw - 1) * dw - 1) // sw + 1
            out = np.zeros((cur.shape[0], oh, ow, kk.shape[-1]))
            for a in range(oh):
                for b in range(ow):
                    patch = xp[
                        :,
                        a * sh : a * sh + (kh - 1) * dh + 1 : dh,
                        b * sw : b * sw + (kw - 1) * dw + 1 : dw,
                        :,
                    ]
                    out[:, a, b, :] = np.einsum("nijc,ijco->no", patch, kk)
            cur = out + (inputs[f"b{i}"] if s["bias"] else 0.0)
        elif k == "activation":
            cur = np.tanh(cur) if s["fn"] == "tanh" else np.maximum(cur, 0.0)
        elif k == "mean_pool":
            cur = cur.mean(axis=(1, 2)) if cur.ndim == 4 else cur.mean(axis=1)
        elif k == "flatten":
            cur = cur.reshape(cur.shape[0], -1)
    return cur


def unsupported_reasons(implemented, reasons):
    """capability -> reason for every capability the suite knows and the adapter does not
    implement.  ``reasons``: family (or full capability name) -> reason."""
    from ..catalogue import capabilities

    out = {}
    for name in capabilities():
        if name in implemented:
            continue
        fam = name.split(".", 1)[0]
        out[name] = reasons.get(name) or reasons.get(fam) or "not mapped by this adapter"
    return out


# -- JAX / kfac-jax ---------------------------------------------------------------------------
def jax_build(spec, inputs, params):
    """(loss_fn(theta, batch), theta, batch) with every layer and the loss registered through
    kfac-jax's tag functions; theta is a list (per parametric layer) of [w] or [w, b] so the
    pytree order puts the bias after the weight (bias last)."""
    import jax
    import jax.numpy as jnp
    import kfac_jax
    from jax import lax

    theta = []
    for i, s in parametric(spec):
        theta.append(
            [jnp.asarray(inputs[f"w{i}"])] + ([jnp.asarray(inputs[f"b{i}"])] if s["bias"] else [])
        )
    x = jnp.asarray(inputs["x"])
    t = np.asarray(inputs["targets"])
    y = jnp.asarray(t.astype(np.int64) if params["loss"] == "categorical" else t)
    shapes = []  # spatial input shape seen by each conv (static)
    cur = np.asarray(inputs["x"])
    for i, s in enumerate(spec):  # static shape walk (numpy forward, one layer at a time)
        if s["kind"] == "conv2d":
            shapes.append(cur.shape[1:3])
        cur = numpy_forward([s], {"x": cur, **_layer_inputs(i, s, inputs)})

    def loss_fn(th, batch):
        xx, yy = batch
        cur, k, c = xx, 0, 0
        for s in spec:
            kind = s["kind"]
            if kind == "dense":
                w = th[k][0]
                b = th[k][1] if s["bias"] else None
                out = cur @ w + (b if b is not None else 0.0)
                # a weight-shared dense layer ([N, S, d] inputs) is kfac-jax's repeated_dense
                reg = kfac_jax.register_dense if cur.ndim == 2 else _repeated_dense()
                out = reg(out, cur, w, b) if b is not None else reg(out, cur, w)
                cur, k = out, k + 1
            elif kind == "conv2d":
                w = th[k][0]
                b = th[k][1] if s["bias"] else None
                pads = conv_pads(s, shapes[c])
                dn = lax.conv_dimension_numbers(cur.shape, w.shape, ("NHWC", "HWIO", "NHWC"))
                st, dl = _pair(s["stride"]), _pair(s["dilation"])
                out = lax.conv_general_dilated(
                    cur, w, st, pads, rhs_dilation=dl, dimension_numbers=dn
                )
                if b is not None:
                    out = out + b
                kw = dict(
                    window_strides=st,
                    padding=pads,
                    lhs_dilation=(1, 1),
                    rhs_dilation=dl,
                    dimension_numbers=dn,
                    feature_group_count=1,
                    batch_group_count=1,
                    precision=None,
                    preferred_element_type=None,
                )
                out = (
                    kfac_jax.register_conv2d(out, cur, w, b, **kw)
                    if b is not None
                    else kfac_jax.register_conv2d(out, cur, w, **kw)
                )
                cur, k, c = out, k + 1, c + 1
            elif kind == "activation":
                cur = jnp.tanh(cur) if s["fn"] == "tanh" else jax.nn.relu(cur)
            elif kind == "mean_pool":
                cur = cur.mean(axis=(1, 2)) if cur.ndim == 4 else cur.mean(axis=1)
            elif kind == "flatten":
                cur = cur.reshape(cur.shape[0], -1)
        n = xx.shape[0]
        if params["loss"] == "categorical":
            kfac_jax.register_softmax_cross_entropy_loss(cur, yy)
            return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(cur), yy[:, None], 1)) / n
        v = float(params["variance"])
        kfac_jax.register_normal_predictive_distribution(cur, yy, variance=v)
        return jnp.sum((cur - yy) ** 2) / (2 * v) / n

    return loss_fn, theta, (x, y)


def _repeated_dense():
    from kfac_jax._src.layers_and_loss_tags import register_repeated_dense

    return register_repeated_dense


def _layer_inputs(i, s, inputs):
    """Layer i's parameters renamed as the only layer of a one-layer spec."""
    out = {}
    if s["kind"] in ("dense", "conv2d"):
        out["w0"] = inputs[f"w{i}"]
        if s["bias"]:
            out["b0"] = inputs[f"b{i}"]
    return out
