"""PyTorch versions of the fixed problems in :mod:`conformance.peers.common` (float64).

PyTorch layout: ``Linear.weight`` is ``Wᵀ`` ([out, in]); conv weights are OIHW, inputs NCHW,
and the dense layer after the conv reads the NCHW flatten, so its weight rows are permuted
from the canonical NHWC flatten with :func:`common.torch_flatten_perm`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from . import common as C

torch.set_default_dtype(torch.float64)


def t(x):
    return torch.as_tensor(np.asarray(x), dtype=torch.float64)


def mlp_model(p, bias=True):
    d0, d1 = p["W1"].shape
    d2 = p["W2"].shape[1]
    m = nn.Sequential(nn.Linear(d0, d1, bias=bias), nn.Tanh(), nn.Linear(d1, d2, bias=bias))
    with torch.no_grad():
        m[0].weight.copy_(t(p["W1"].T))
        m[2].weight.copy_(t(p["W2"].T))
        if bias:
            m[0].bias.copy_(t(p["b1"]))
            m[2].bias.copy_(t(p["b2"]))
    return m.double()


def conv_model(p, bias=True):
    kh, kw, c_in, c_out = p["K"].shape
    oh, ow = p["out_hw"]
    classes = p["W"].shape[1]
    m = nn.Sequential(
        nn.Conv2d(c_in, c_out, (kh, kw), bias=bias),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(oh * ow * c_out, classes, bias=bias),
    )
    perm = C.torch_flatten_perm(oh, ow, c_out)
    with torch.no_grad():
        m[0].weight.copy_(t(np.transpose(p["K"], (3, 2, 0, 1))))
        m[3].weight.copy_(t(p["W"][perm].T))
        if bias:
            m[0].bias.copy_(t(p["bc"]))
            m[3].bias.copy_(t(p["b"]))
    return m.double()


def inputs(p, conv=False):
    x = p["x"]
    if conv:
        x = np.transpose(x, (0, 3, 1, 2))
    return t(x)


def targets(p, loss):
    return t(p["y_reg"]) if loss == "mse" else torch.as_tensor(p["y_cls"], dtype=torch.long)


def mlp_settings(p):
    """The settings the MLP reproductions run, ``(bias, loss, targets)``: with and without
    biases, each for the squared error and the cross-entropy."""
    for bias in (True, False):
        for loss in ("mse", "ce"):
            yield bias, loss, targets(p, loss)


def conv_settings(p):
    """The settings the conv reproductions run, ``(loss, targets, reference)``: the squared
    error and the cross-entropy, each with the reference's type-2 K-FAC flavours of the CNN
    (with biases)."""
    for loss in ("mse", "ce"):
        yield loss, targets(p, loss), C.conv_reference(p, loss, "type2", True)


def per_layer_solve(ref, dims, vs, bias, solve):
    """A per-layer solve of the MLP's parameter vectors ``vs`` (PyTorch's, in parameter order:
    each layer's [out, in] weight, then its bias if ``bias``), flattened like PyTorch's
    parameters: ``solve(A, G, M)`` gets each layer's reference factors and the canonical
    [in(+1), out] matrix ``M`` (the bias as its last row)."""
    npl = 2 if bias else 1
    out = []
    for li, ((a, g), (d_in, _d_out)) in enumerate(zip(ref, dims, strict=False)):
        w = vs[li * npl]  # [out, in]
        m = w.T if not bias else np.concatenate([w.T, vs[li * npl + 1][None]], 0)
        res = solve(a, g, m)
        out.append(res[:d_in].T.ravel())
        if bias:
            out.append(res[d_in])
    return np.concatenate(out)


def loss_fn(loss, reduction="mean"):
    return (
        nn.MSELoss(reduction=reduction)
        if loss == "mse"
        else nn.CrossEntropyLoss(reduction=reduction)
    )


def check_forward(model, p, conv=False, bias=True):
    """The torch model reproduces the NumPy forward pass (guards the layout maps)."""
    f_np = (C.conv_forward(p, bias) if conv else C.mlp_forward(p, bias))[-1]
    with torch.no_grad():
        f_t = model(inputs(p, conv)).numpy()
    err = C.rel_err(f_t, f_np)
    assert err < 1e-13, f"torch model does not reproduce the NumPy forward pass: {err}"
    return err


def to_torch_a(a_canon, bias_in_a):
    """Canonical A (homogeneous coordinate last) is already PyTorch's [W b] column order."""
    return a_canon


def conv_a_torch(a_canon, kh, kw, c_in, bias):
    """Canonical conv A (patch order (i, j, c) + bias last) → unfold order (c, i, j) + bias last."""
    perm = C.torch_conv_perm(kh, kw, c_in)
    if bias:
        perm = np.concatenate([perm, [kh * kw * c_in]])
    return a_canon[np.ix_(perm, perm)]


def conv_exactness_settings(p):
    """Settings where one conv K-FAC flavour is exact (Eschenhagen et al. 2023), with the exact
    GGN of the conv weight written out in NumPy for the loss MSELoss(reduction='sum'):

    * "per-location": linear conv → flatten → MSE: f_{n,t} = W p_{n,t}, so the GGN of the
      PyTorch weight [out, (c, i, j)] is 2 Σ_{n,t} I ⊗ p pᵀ (kron(G, A) order) — expand is exact;
    * "pooled": linear conv → average pool over all locations → MSE: f_n = W p̄_n, so the GGN
      is 2 Σ_n I ⊗ p̄ p̄ᵀ — reduce is exact.

    Yields (setting, model, x, y, exact_block)."""
    n = p["x"].shape[0]
    kh, kw, c_in, c_out = p["K"].shape
    x = inputs(p, conv=True)
    perm = C.torch_conv_perm(kh, kw, c_in)
    pt = C.conv_patches(p)[:, :, perm]  # [N, T, P] in unfold order
    oh, ow = p["out_hw"]
    for setting in ("per-location", "pooled"):
        conv = nn.Conv2d(c_in, c_out, (kh, kw), bias=False).double()
        with torch.no_grad():
            conv.weight.copy_(t(np.transpose(p["K"], (3, 2, 0, 1))))
        if setting == "per-location":
            model = nn.Sequential(conv, nn.Flatten())
            y = torch.as_tensor(np.random.default_rng(4).standard_normal((n, c_out * oh * ow)))
            exact = 2.0 * np.kron(np.eye(c_out), np.einsum("ntp,ntq->pq", pt, pt))
        else:
            model = nn.Sequential(conv, nn.AvgPool2d((oh, ow)), nn.Flatten())
            y = torch.as_tensor(np.random.default_rng(4).standard_normal((n, c_out)))
            pm = pt.mean(1)
            exact = 2.0 * np.kron(np.eye(c_out), pm.T @ pm)
        yield setting, model, x, y, exact


def torch_param_perm(d_in, d_out, bias):
    """Entry j of PyTorch's [W.flatten() (o, i), b (o)] is entry perm[j] of canonical
    vec_r([W; b]) with [W; b] of shape [d_in (+1), d_out]."""
    perm = [i * d_out + o for o in range(d_out) for i in range(d_in)]
    if bias:
        perm += [d_in * d_out + o for o in range(d_out)]
    return np.array(perm)


def expected_dense(ref, dims, bias, separate):
    """Block-diagonal reference in PyTorch parameter order."""
    blocks = []
    for (a, g), (d_in, d_out) in zip(ref, dims, strict=False):
        if bias and separate:
            aw = a[:d_in, :d_in]
            blk = np.zeros((d_in * d_out + d_out,) * 2)
            blk[: d_in * d_out, : d_in * d_out] = np.kron(g, aw)  # kron(G, A) on vec_r(W_torch)
            blk[d_in * d_out :, d_in * d_out :] = g
            blocks.append(blk)
        else:
            k = np.kron(a, g)
            perm = torch_param_perm(d_in, d_out, bias)
            blocks.append(k[np.ix_(perm, perm)])
    n = sum(b.shape[0] for b in blocks)
    out = np.zeros((n, n))
    o = 0
    for b in blocks:
        out[o : o + b.shape[0], o : o + b.shape[0]] = b
        o += b.shape[0]
    return out
