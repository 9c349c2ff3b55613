"""The exact estimation modes (``fisher_exact`` / ``ggn_exact``) take their :math:`C` output
vectors :math:`u_{k,n} = \\sqrt w B_n e_k` from the loss's dense factor ``[N, D, K]`` in one
call: equal, on every loss and backend, to the per-vector path built independently from the
losses' public replicated one-hot products (one call per :math:`k`), at ``xp.rtol``
(tests/conftest.py: the two compute each entry from the same probabilities with one or two
roundings of difference).  A count test: one loss construction, one dense factor, no one-hot
product and a number of softmaxes that does not grow with :math:`C`.
"""

from __future__ import annotations

import numpy as np
import pytest

import kfac_ref.nn as nn
from kfac_ref import curvature
from kfac_ref import losses as L
from kfac_ref.curvature import BlockDiagonalCurvature

MASK = np.array([1.0, 0.0, 1.0, 1.0, 1.0])


def _cases(xp):
    """name -> (net, loss_fn(outputs, targets), host targets)."""
    rng = np.random.default_rng(11)
    dense = nn.Sequential([("d", nn.Dense(3, 4))])
    positive = nn.Sequential([("d", nn.Dense(3, 4)), ("s", nn.Activation("softplus"))])
    y = np.array([0, 3, 1, 2, 3])
    mask = xp.asarray(MASK)
    return {
        "categorical_masked": (dense, lambda f, t: L.CategoricalLogitsNegativeLogProbLoss(
            f, targets=t, mask=mask, weight=1.7), y),
        "onehot": (dense, lambda f, t: L.OneHotCategoricalLogitsNegativeLogProbLoss(
            f, targets=t, weight=0.6), np.eye(4)[y]),
        "bernoulli": (dense, lambda f, t: L.MultiBernoulliNegativeLogProbLoss(
            f, targets=t, weight=0.7), (rng.random((5, 4)) < 0.5) * 1.0),
        "normal_mean": (dense, lambda f, t: L.NormalMeanNegativeLogProbLoss(
            f, targets=t, variance=0.7, weight=1.3), rng.standard_normal((5, 4))),
        "mean_variance": (positive, lambda f, t: L.NormalMeanVarianceNegativeLogProbLoss(
            f[:, :2], f[:, 2:], t, weight=0.9), rng.standard_normal((5, 2))),
    }


@pytest.mark.parametrize("mode", ["fisher_exact", "ggn_exact"])
@pytest.mark.parametrize("name", ["categorical_masked", "onehot", "bernoulli", "normal_mean",
                                  "mean_variance"])
def test_batched_exact_vectors_equal_the_per_vector_path(xp, name, mode):
    net, loss_fn, host_t = _cases(xp)[name]
    rng = np.random.default_rng(5)
    params = tuple(tuple(xp.asarray(a) for a in p) for p in net.init_params(rng, np.zeros(1)))
    x = xp.asarray(rng.standard_normal((5, 3)))
    t = xp.asarray(host_t) if host_t.dtype.kind == "f" else xp.asarray(host_t)
    got = curvature.estimation_output_vectors(net, loss_fn, params, (x, t), mode)

    # the per-vector oracle: one public replicated one-hot product per inner index
    loss = loss_fn(net.forward(params, x), t)
    inner = (loss.fisher_factor_inner_shape if mode == "fisher_exact"
             else loss.ggn_factor_inner_shape)[1:]
    one_hot = (loss.multiply_fisher_factor_replicated_one_hot if mode == "fisher_exact"
               else loss.multiply_ggn_factor_replicated_one_hot)
    want = []
    for idx in np.ndindex(*inner):
        parts = [xp.to_numpy(p).reshape(5, -1) for p in one_hot(tuple(int(i) for i in idx))]
        want.append(np.concatenate(parts, axis=1))
    assert len(got) == len(want) == int(np.prod(inner))
    for g, w in zip(got, want, strict=True):
        xp.assert_close(g, w)


@pytest.mark.parametrize("outputs", [4, 8])
def test_exact_mode_update_calls_the_loss_once(monkeypatch, outputs):
    """A ``fisher_exact`` update of the block-diagonal estimator: one loss object, one dense
    factor, no per-vector product, two softmaxes (p and √p) whatever C is."""
    cls = L.CategoricalLogitsNegativeLogProbLoss
    counts = {"loss_fn": 0, "_factor_matrix": 0, "_factor_column": 0, "_log_probs": 0}
    for name in ("_factor_matrix", "_factor_column", "_log_probs"):
        original = getattr(cls, name)

        def counting(self, *a, _original=original, _name=name, **k):
            counts[_name] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(cls, name, counting)

    def loss_fn(f, t):
        counts["loss_fn"] += 1
        return cls(f, targets=t)

    rng = np.random.default_rng(2)
    net = nn.Sequential([("d1", nn.Dense(3, 5)), ("a", nn.Activation("tanh")),
                         ("d2", nn.Dense(5, outputs))])
    params = net.init_params(rng, np.zeros(1))
    batch = (rng.standard_normal((6, 3)), rng.integers(0, outputs, size=6))
    est = BlockDiagonalCurvature(net, loss_fn)
    st = est.init(None, (params, batch))
    for k in counts:
        counts[k] = 0
    est.update_curvature_matrix_estimate(st, 0.0, 1.0, 6, None, (params, batch), "fisher_exact")
    assert counts == {"loss_fn": 1, "_factor_matrix": 1, "_factor_column": 0,
                      "_log_probs": 2}
