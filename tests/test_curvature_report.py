"""Approximation report: exact blocks give zero error, the diagonal approximation's error equals
the off-diagonal mass of the exact block (computed here from the dense GGN), the exactness facts
show up as zeros, and the expand/reduce pair is reported for weight-shared dense layers.
Tolerances as in test_curvature_block_diagonal.py (errors are relative, so an exact block
gives an error of a few eps · condition, below ``tol``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from losses_helpers import ce, sq

import kfac_ref.curvature as C
import kfac_ref.nn as nn
from kfac_ref import KFACTypeError, KFACValueError


def tol(xp):
    return xp.rtol if xp.float64 else 16 * xp.rtol


def data(xp, rng, net, shape, loss, n=3):
    x = rng.standard_normal((n, *shape))
    out = net.output_shape(x.shape)
    y = rng.integers(0, out[-1], size=n) if loss is ce else rng.standard_normal(out)
    p = net.init_params(rng, np.zeros(1))
    return tuple(tuple(xp.asarray(a) for a in q) for q in p), (xp.asarray(x), xp.asarray(y))


def test_report_nonlinear_cross_entropy(xp, rng):
    net = nn.Sequential([("c", nn.Conv2D(1, 2, 2)), ("a", nn.Activation("tanh")),
                         ("s", nn.ScaleAndShift(2)), ("p", nn.MeanPool()), ("d", nn.Dense(2, 3))])
    bp, batch = data(xp, rng, net, (3, 3, 1), ce)
    rep = C.approximation_report(net, ce, bp, batch)
    assert set(rep) == {"c", "s", "d"}
    g = xp.to_numpy(C.ggn_matrix(net, ce, bp, batch))
    for i in net.parametric_layers:
        name = net.names[i]
        blk = g[net.layer_slices()[i], net.layer_slices()[i]]
        off = np.linalg.norm(blk - np.diag(np.diag(blk))) / np.linalg.norm(blk)
        assert set(rep[name]) == {"kfac", "diagonal", "full", "kfac_reduce"}
        assert rep[name]["full"] <= tol(xp)
        assert abs(rep[name]["diagonal"] - off) <= tol(xp) * max(off, 1.0)
    assert rep["c"]["kfac"] > 1e-3  # conv + tanh + CE with N = 3: not exact
    assert rep["d"]["kfac_reduce"] == rep["d"]["kfac"]  # an unshared layer: same block


def test_report_exactness_zeros_and_weight_sharing(xp, rng):
    net = nn.Sequential([("d1", nn.Dense(3, 4)), ("d2", nn.Dense(4, 2))])
    bp, batch = data(xp, rng, net, (4, 3), sq)  # [N, T, d]: expand setting, deep linear
    rep = C.approximation_report(net, sq, bp, batch)
    for name in ("d1", "d2"):
        assert rep[name]["kfac"] <= tol(xp)  # KFAC-expand exact
    assert rep["d1"]["kfac_reduce"] > 1e-3  # reduce is not
    emp = C.approximation_report(net, sq, bp, batch, {"kfac": {}}, curvature="empirical_fisher")
    assert set(emp["d1"]) == {"kfac"} and emp["d1"]["kfac"] >= 0


def test_relative_error_edge_cases_and_errors(xp, rng):
    z = xp.asarray(np.zeros((2, 2)))
    o = xp.asarray(np.eye(2))
    assert C.relative_frobenius_error(z, z) == 0.0
    assert C.relative_frobenius_error(o, z) == math.inf
    assert abs(C.relative_frobenius_error(2 * o, o) - 1.0) <= tol(xp)
    net = nn.Sequential([("d", nn.Dense(2, 2))])
    bp, batch = data(xp, rng, net, (2,), ce)
    with pytest.raises(KFACValueError, match="curvature"):
        C.approximation_report(net, ce, bp, batch, curvature="hessian")
    with pytest.raises(KFACValueError, match="batch"):
        C.approximation_report(net, ce, bp, batch[0])
    with pytest.raises(KFACTypeError, match="approximations"):
        C.approximation_report(net, ce, bp, batch, {"kfac": "reduce"})
    with pytest.raises(KFACValueError, match="approximations"):
        C.approximation_report(net, ce, bp, batch, {})
    # no silent broadcasting: a [2, 1] block against a [2, 2] one is an error
    with pytest.raises(KFACValueError, match="shape"):
        C.relative_frobenius_error(xp.asarray(np.ones((2, 1))), o)
