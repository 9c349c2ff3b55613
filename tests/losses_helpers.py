"""Shared test data for the loss-function tests: one small case per loss class, with
independent float64 NumPy oracles (written from the textbook formulas, not from the code
under test)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from scipy.special import expit, log_expit, log_softmax, softmax

from kfac_ref import losses as L

WEIGHT = 1.7


def ce(f, y):
    """Softmax cross-entropy of logits ``f`` with integer targets ``y`` (a curvature loss)."""
    return L.CategoricalLogitsNegativeLogProbLoss(f, targets=y)


def sq(f, y):
    """Squared error ``‖f − y‖²``: the Gaussian NLL with variance ½ (a curvature loss)."""
    return L.NormalMeanNegativeLogProbLoss(f, targets=y, variance=0.5)

CASES = ("categorical", "categorical_masked", "onehot", "bernoulli", "normal_mean",
         "normal_mean_sq", "mean_variance")


@dataclass
class Case:
    """A loss built on a backend plus the host (float64, backend-rounded) data."""

    name: str
    loss: Any
    inputs: tuple  # host inputs (rounded as the backend sees them)
    targets: Any  # host targets
    mask: Any = None
    extra: dict = field(default_factory=dict)

    @property
    def n(self):
        return self.inputs[0].shape[0]


def make_case(xp, name, rng, n=3, weight=WEIGHT):
    """Build the loss ``name`` on backend ``xp`` with fixed-seed host data."""
    if name in ("categorical", "categorical_masked", "onehot"):
        k = 4
        z = xp.round_host(rng.standard_normal((n, k)) * 1.5)
        y = rng.integers(0, k, size=n)
        mask = None
        if name == "categorical_masked":
            mask = np.array([1.0, 0.0, 1.0] + [1.0] * (n - 3))[:n]
        if name == "onehot":
            t_host = np.eye(k)[y]
            loss = L.OneHotCategoricalLogitsNegativeLogProbLoss(
                xp.asarray(z), xp.asarray(t_host), weight=weight)
        else:
            loss = L.CategoricalLogitsNegativeLogProbLoss(
                xp.asarray(z), xp.asarray(y), None if mask is None else xp.asarray(mask),
                weight=weight)
        return Case(name, loss, (z,), y, mask)
    if name == "bernoulli":
        z = xp.round_host(rng.standard_normal((n, 2, 2)) * 1.5)
        y = (rng.random((n, 2, 2)) < 0.5).astype(np.float64)
        loss = L.MultiBernoulliNegativeLogProbLoss(xp.asarray(z), xp.asarray(y), weight=weight)
        return Case(name, loss, (z,), y)
    if name in ("normal_mean", "normal_mean_sq"):
        mu = xp.round_host(rng.standard_normal((n, 3)))
        y = xp.round_host(mu + rng.standard_normal((n, 3)))
        var = 0.7 if name == "normal_mean" else 0.5
        loss = L.NormalMeanNegativeLogProbLoss(xp.asarray(mu), xp.asarray(y), variance=var,
                                               weight=weight)
        return Case(name, loss, (mu,), y, extra={"variance": var})
    if name == "mean_variance":
        mu = xp.round_host(rng.standard_normal((n, 2)))
        v = xp.round_host(rng.uniform(0.5, 2.0, size=(n, 2)))
        y = xp.round_host(mu + np.sqrt(v) * rng.standard_normal((n, 2)))
        loss = L.NormalMeanVarianceNegativeLogProbLoss(xp.asarray(mu), xp.asarray(v),
                                                       xp.asarray(y), weight=weight)
        return Case(name, loss, (mu, v), y)
    raise AssertionError(name)


# -- oracles (float64 NumPy, per example, unweighted) ---------------------------------------
def case_fixture():
    """The ``case`` fixture of the loss test modules (``case = case_fixture()``): each loss
    of ``CASES`` built on the test's backend."""

    @pytest.fixture(params=CASES)
    def case(request, xp, rng):
        return make_case(xp, request.param, rng)

    return case


def oracle_fisher(case):
    """Dense per-example Fisher [N, D, D] from the textbook formulas (unweighted, masked)."""
    if case.name in ("categorical", "categorical_masked", "onehot"):
        p = softmax(case.inputs[0], axis=-1)
        f = np.stack([np.diag(pi) - np.outer(pi, pi) for pi in p])
        if case.mask is not None:
            f = f * case.mask[:, None, None]
        return f
    if case.name == "bernoulli":
        p = expit(case.inputs[0].reshape(case.n, -1))
        return np.stack([np.diag(pi * (1 - pi)) for pi in p])
    if case.name in ("normal_mean", "normal_mean_sq"):
        d = case.inputs[0].reshape(case.n, -1).shape[1]
        return np.stack([np.eye(d) / case.extra["variance"]] * case.n)
    if case.name == "mean_variance":
        v = case.inputs[1]
        return np.stack([np.diag(np.concatenate([1 / vi, 1 / (2 * vi**2)])) for vi in v])
    raise AssertionError(case.name)


def oracle_factor(case):
    """Dense per-example factor [N, D, K] as on the docs page *Losses: output curvature and its
    factors* (kfac-jax's / TF's choice of B with B Bᵀ = F; unweighted, masked).  B Bᵀ = F
    alone leaves B free up to B Q, Q orthogonal."""
    if case.name in ("categorical", "categorical_masked", "onehot"):
        p = softmax(case.inputs[0], axis=-1)
        b = np.stack([np.diag(np.sqrt(pi)) - np.outer(pi, np.sqrt(pi)) for pi in p])
        if case.mask is not None:
            b = b * case.mask[:, None, None]
        return b
    if case.name == "bernoulli":
        p = expit(case.inputs[0].reshape(case.n, -1))
        return np.stack([np.diag(np.sqrt(pi * (1 - pi))) for pi in p])
    if case.name in ("normal_mean", "normal_mean_sq"):
        d = case.inputs[0].reshape(case.n, -1).shape[1]
        return np.stack([np.eye(d) / np.sqrt(case.extra["variance"])] * case.n)
    if case.name == "mean_variance":
        v = case.inputs[1]
        return np.stack([np.diag(np.concatenate([1 / np.sqrt(vi), 1 / (np.sqrt(2) * vi)]))
                         for vi in v])
    raise AssertionError(case.name)


def oracle_loss(case, inputs, targets):
    """Per-example unweighted loss [N] (float64) at host inputs/targets."""
    if case.name in ("categorical", "categorical_masked", "onehot"):
        t = targets if case.name != "onehot" or targets.ndim == 1 else targets.argmax(-1)
        lp = log_softmax(inputs[0], axis=-1)
        val = -lp[np.arange(case.n), t]
        return val if case.mask is None else val * case.mask
    if case.name == "bernoulli":
        z = inputs[0].reshape(case.n, -1)
        y = targets.reshape(case.n, -1)
        return -(y * log_expit(z) + (1 - y) * log_expit(-z)).sum(-1)
    if case.name in ("normal_mean", "normal_mean_sq"):
        var = case.extra["variance"]
        r = (targets - inputs[0]).reshape(case.n, -1)
        return (r**2).sum(-1) / (2 * var) + 0.5 * r.shape[1] * np.log(2 * np.pi * var)
    if case.name == "mean_variance":
        mu, v = inputs
        r = targets - mu
        return (r**2 / (2 * v) + 0.5 * np.log(2 * np.pi * v)).sum(-1)
    raise AssertionError(case.name)


def random_vector(rng, case):
    """Host tuple shaped like the inputs."""
    return tuple(rng.standard_normal(x.shape) for x in case.inputs)


def flat_cat(xs, n):
    """Tuple of [N, ...] host arrays -> [N, D] (row-major per example, blocks in order)."""
    return np.concatenate([np.asarray(x).reshape(n, -1) for x in xs], axis=-1)


def to_host_tuple(xp, t):
    assert isinstance(t, tuple), f"expected a tuple, got {type(t)}"
    return tuple(xp.to_numpy(x) for x in t)
