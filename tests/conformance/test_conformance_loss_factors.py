"""losses.fisher_factor / fisher_factor_transpose / ggn_factor: the factor products of the
five losses against dense oracles (B Bᵀ = F, adjointness, the closed-form categorical
factor) and on every backend cell."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.catalogue import build_catalogue
from conformance.catalogue.losses_cases import build_loss, factor_product

CAPS = ("losses.fisher_factor", "losses.fisher_factor_transpose", "losses.ggn_factor")


@pytest.fixture(scope="module")
def cases():
    return [c for c in build_catalogue(["losses"])[0] if c.capability in CAPS]


def _loss(case, to_b=lambda v: v):
    import kfac_ref.losses as L

    return build_loss(L, case.inputs, case.params, to_b)


def _dense_factor(case, kind="fisher_factor"):
    loss = _loss(case)
    n, k = loss.fisher_factor_inner_shape
    return np.stack([factor_product(loss, kind, np.tile(np.eye(k)[j], (n, 1)))
                     for j in range(k)], axis=-1)  # [N, D, K]


def test_every_loss_has_factor_cases(cases):
    for cap in CAPS:
        assert {c.params["loss"] for c in cases if c.capability == cap} == {
            "categorical", "onehot_categorical", "multi_bernoulli", "normal_mean",
            "normal_mean_variance"}


def test_factor_gram_is_the_fisher_and_adjoint(cases):
    for c in [c for c in cases if c.capability == "losses.fisher_factor"]:
        b = _dense_factor(c)
        fisher = np.asarray(_loss(c).fisher_matrix())
        assert np.abs(b @ b.transpose(0, 2, 1) - fisher).max() <= 1e-14 * np.abs(fisher).max()
        assert np.abs(np.einsum("ndk,nk->nd", b, c.inputs["u"]) - c.expected).max() <= 1e-14
        g = _dense_factor(c, "ggn_factor")
        ggn = np.asarray(_loss(c).ggn_matrix())
        assert np.abs(g @ g.transpose(0, 2, 1) - ggn).max() <= 1e-14 * np.abs(ggn).max()
    for c in [c for c in cases if c.capability == "losses.fisher_factor_transpose"]:
        b = _dense_factor(c)
        assert np.abs(np.einsum("ndk,nd->nk", b, c.inputs["v"]) - c.expected).max() <= 1e-14


def test_categorical_factor_closed_form(cases):
    """√w (diag(√p) − p √pᵀ) u, masked examples zero."""
    for c in [c for c in cases if c.capability == "losses.fisher_factor"
              and c.params["loss"] == "categorical"]:
        z = c.inputs["logits"]
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p = p / p.sum(axis=1, keepdims=True)
        u = c.inputs["u"]
        want = np.sqrt(p) * u - p * np.sum(np.sqrt(p) * u, axis=1, keepdims=True)
        want = want * np.sqrt(c.params["weight"]) * c.inputs.get("mask", 1.0)[..., None] \
            if "mask" in c.inputs else want * np.sqrt(c.params["weight"])
        assert np.abs(want - c.expected).max() <= 1e-14


def test_factor_products_on_every_backend(cases, xp):
    for c in cases:
        vec = c.inputs["v" if c.capability.endswith("transpose") else "u"]
        got = factor_product(_loss(c, xp.asarray), c.capability.split(".")[1], vec,
                             xp.asarray, xp.to_numpy)
        err = np.linalg.norm(got - c.expected) / np.linalg.norm(c.expected)
        assert err <= c.tolerance.rtol(xp.eps), c.id


# -- losses.sample (statistical route) ---------------------------------------------------------
@pytest.fixture(scope="module")
def sample_cases():
    return [c for c in build_catalogue(["losses"])[0] if c.capability == "losses.sample"]


def test_sample_moments_by_enumeration_and_quadrature(sample_cases):
    """The exact mean/variance of T(y): enumeration of the classes / of {0, 1}, Gauss-Hermite
    quadrature (3 nodes: exact for the degree-4 moments of (y − μ)²) for the normal losses."""
    from conformance.catalogue.losses_cases import sample_statistic

    assert {c.params["loss"] for c in sample_cases} == {
        "categorical", "onehot_categorical", "multi_bernoulli", "normal_mean",
        "normal_mean_variance"}
    for c in sample_cases:
        kind, i = c.params["loss"], c.inputs
        mean, var = c.alternatives["_mean"], c.alternatives["_var"]
        if kind in ("categorical", "onehot_categorical"):
            z = i["logits"]
            p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
            k = z.shape[1]
            outs = [sample_statistic(np.full(z.shape[0], j) if kind == "categorical"
                                     else np.tile(np.eye(k)[j], (z.shape[0], 1)), c)
                    for j in range(k)]
            w = [p[:, j:j + 1] for j in range(k)]
        elif kind == "multi_bernoulli":
            p = 1 / (1 + np.exp(-i["logits"]))
            outs = [sample_statistic(np.zeros_like(p), c), sample_statistic(np.ones_like(p), c)]
            w = [1 - p, p]
        else:
            nodes, wq = np.polynomial.hermite_e.hermegauss(3)
            wq = wq / wq.sum()
            v = i["variance"] if kind == "normal_mean_variance" else c.params["variance"]
            outs = [sample_statistic(i["mean"] + np.sqrt(v) * x, c) for x in nodes]
            w = list(wq)
        if kind == "multi_bernoulli" or kind.startswith("normal"):
            wt = [np.broadcast_to(np.concatenate([x, x], -1) if kind.startswith("normal")
                                  and np.ndim(x) else x, mean.shape) for x in w]
        else:
            wt = [np.broadcast_to(x, mean.shape) for x in w]
        m = sum(a * b for a, b in zip(wt, outs, strict=True))
        s2 = sum(a * (b - m) ** 2 for a, b in zip(wt, outs, strict=True))
        assert np.abs(m - mean).max() <= 1e-12 and np.abs(s2 - var).max() <= 1e-12, c.id


def test_sample_power(sample_cases):
    """The two sampler mutants are seen with power ≥ 1 − 10⁻⁶: some entry is off by more than
    c·σ_e/√n + c·σ'_e/√n (σ' = 0 for the mode; for μ + v·ε, σ' of (y − μ)² is √2·v²)."""
    from conformance.sampling import CHEBYSHEV_C

    for c in sample_cases:
        z = CHEBYSHEV_C / np.sqrt(c.meta["group_size"])
        mu, sd = c.alternatives["_mean"], np.sqrt(c.alternatives["_var"])
        assert np.max(np.abs(c.alternatives["no_sampling"] - mu) / (z * sd)) > 1.2, c.id
        alt = c.alternatives.get("variance_as_std")
        if alt is not None:  # absent (insensitive) when v = 1
            d = mu.shape[-1] // 2
            sd_alt = np.concatenate([np.sqrt(mu[..., d:]) ** 2, np.sqrt(2) * mu[..., d:] ** 2],
                                    axis=-1)
            assert np.max(np.abs(alt - mu) / (z * (sd + sd_alt))) > 1.2, c.id
