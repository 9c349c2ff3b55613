"""PyTorch autograd as an independent oracle: gradient and Hessian-vector product of the mean
cross-entropy of a conv/scale-shift/dense network, compared after the documented permutation to
PyTorch's parameter order (kfac_ref.nn.torch_permutation).  Runs on the numpy backend only: it
checks the formulas and the permutation, not array-API portability (the other tests do that).
Tolerance: both sides are float64 sums of the same O(1) products in different orders, so they
agree to a few hundred eps; xp.rtol (4096 eps) is used."""

from __future__ import annotations

import numpy as np
import pytest

import kfac_ref.curvature as C
import kfac_ref.nn as nn
from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss

torch = pytest.importorskip("torch")


def test_grad_and_hvp_match_torch_autograd(xp, rng):
    if xp.name != "numpy":
        pytest.skip("autograd oracle: numpy backend only (formulas and ordering, not portability)")
    f = torch.nn.functional
    net = nn.Sequential([
        ("conv", nn.Conv2D(2, 3, (2, 2), stride=1, padding="VALID", data_format="NCHW")),
        ("act", nn.Activation("tanh")),
        ("flat", nn.Flatten()),
        ("norm", nn.ScaleAndShift(12)),
        ("act2", nn.Activation("softplus")),
        ("fc", nn.Dense(12, 3)),
    ])
    x = rng.standard_normal((4, 2, 3, 3))
    y = rng.integers(0, 3, size=4)
    params = net.init_params(rng, x)
    tp = {k: torch.tensor(np.asarray(v), requires_grad=True)
          for k, v in nn.to_torch_parameters(net, params).items()}

    def torch_loss(p):
        h = f.conv2d(torch.tensor(x), p["conv.weight"], p["conv.bias"])
        h = torch.tanh(h).flatten(1)
        h = f.softplus(h * p["norm.weight"] + p["norm.bias"])
        logits = f.linear(h, p["fc.weight"], p["fc.bias"])
        return f.cross_entropy(logits, torch.tensor(y), reduction="mean")

    names = list(tp)
    loss = torch_loss(tp)
    grads = torch.autograd.grad(loss, [tp[k] for k in names], create_graph=True)
    perm = nn.torch_permutation(net)
    v = rng.standard_normal(net.num_params)
    v_t = torch.tensor(v[perm])
    flat_g = torch.cat([g.reshape(-1) for g in grads])
    hv_t = torch.autograd.grad(flat_g @ v_t, [tp[k] for k in names])
    hv_t = torch.cat([h.reshape(-1) for h in hv_t]).detach().numpy()

    value, grad = C.loss_value_and_grad(net, CategoricalLogitsNegativeLogProbLoss, params, (x, y))
    assert abs(float(value) - loss.item()) <= xp.rtol * abs(loss.item())
    xp.assert_close(nn.permute_vector(grad, perm), flat_g.detach().numpy())
    hv = C.hessian_vector_product(net, CategoricalLogitsNegativeLogProbLoss, params, (x, y), v)
    xp.assert_close(nn.permute_vector(hv, perm), hv_t)
