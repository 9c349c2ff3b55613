"""Loss functions: dense Fisher/GGN against textbook oracles, the factor identities
(B Bᵀ = F, ⟨Bu, v⟩ = ⟨u, Bᵀv⟩), matrix-free products against the dense matrices,
replicated one-hot columns, weights and masks — on every backend.

Tolerances: every quantity here is a handful of elementary operations on O(1) numbers (a
softmax over k = 4 classes, a sigmoid, a division), so the backward error is a small
multiple of eps and ``xp.rtol = 4096 eps`` (norm-wise) is ample; no test needs more.
"""

from __future__ import annotations

import math

import numpy as np
from conftest import assert_allclose_normwise
from hypothesis import given
from hypothesis import strategies as st
from losses_helpers import (
    WEIGHT,
    case_fixture,
    flat_cat,
    make_case,
    oracle_factor,
    oracle_fisher,
    random_vector,
    to_host_tuple,
)

from kfac_ref import losses as L

case = case_fixture()


def _dev(xp, host_tuple):
    return tuple(xp.asarray(xp.round_host(h)) for h in host_tuple)


def test_dense_fisher_matches_textbook_formula(xp, case):
    F = case.loss.fisher_matrix()
    xp.assert_close(F, WEIGHT * oracle_fisher(case))


def test_ggn_equals_fisher(xp, case):
    # Natural parameters: GGN = Fisher (Martens 2014 §9.2).  Mean-variance normal: GGN taken
    # at the natural-parameter split, which is again the Fisher (see its docstring and
    # test_losses_oracles.py::test_mean_variance_ggn_is_natural_parameter_gauss_newton).
    xp.assert_close(case.loss.ggn_matrix(), WEIGHT * oracle_fisher(case))
    xp.assert_close(case.loss.ggn_factor_matrix(), xp.to_numpy(case.loss.fisher_factor_matrix()))
    assert case.loss.ggn_factor_inner_shape == case.loss.fisher_factor_inner_shape


def test_dense_factor_matches_textbook_factor(xp, case):
    """The factor itself, not only B Bᵀ: categorical B = diag(√p) − p√pᵀ etc. (the docs page
    *Losses: output curvature and its factors*; kfac-jax's columns, which
    multiply_fisher_factor_replicated_one_hot returns)."""
    xp.assert_close(case.loss.fisher_factor_matrix(), np.sqrt(WEIGHT) * oracle_factor(case))


def test_dense_factor_times_transpose_is_fisher(xp, case):
    B = xp.to_numpy(case.loss.fisher_factor_matrix())
    n, d = case.n, oracle_fisher(case).shape[1]
    assert B.shape == (n, d, math.prod(case.loss.fisher_factor_inner_shape[1:]))
    np.testing.assert_allclose(B @ B.transpose(0, 2, 1), WEIGHT * oracle_fisher(case),
                               rtol=0, atol=xp.rtol * WEIGHT * np.abs(oracle_fisher(case)).max())


def test_matrix_free_fisher_matches_dense(xp, case, rng):
    v = random_vector(rng, case)
    vr = tuple(xp.round_host(x) for x in v)
    out = case.loss.multiply_fisher(_dev(xp, v))
    assert isinstance(out, tuple) and len(out) == len(case.inputs)
    for o, x in zip(out, case.inputs, strict=True):
        xp.check(o)
        assert tuple(o.shape) == x.shape
    got = flat_cat(to_host_tuple(xp, out), case.n)
    expected = np.einsum("nij,nj->ni", WEIGHT * oracle_fisher(case), flat_cat(vr, case.n))
    assert_allclose_normwise(got, expected, xp.rtol)
    # the GGN product is the same
    got_ggn = flat_cat(to_host_tuple(xp, case.loss.multiply_ggn(_dev(xp, v))), case.n)
    np.testing.assert_allclose(got_ggn, got, rtol=0, atol=xp.rtol * np.abs(expected).max())


def test_matrix_free_factor_matches_dense_factor(xp, case, rng):
    inner = case.loss.fisher_factor_inner_shape
    u = rng.standard_normal(inner)
    ur = xp.round_host(u)
    B = xp.to_numpy(case.loss.fisher_factor_matrix())
    out = case.loss.multiply_fisher_factor(xp.asarray(u))
    assert isinstance(out, tuple) and len(out) == len(case.inputs)
    got = flat_cat(to_host_tuple(xp, out), case.n)
    expected = np.einsum("nik,nk->ni", B, ur.reshape(case.n, -1))
    np.testing.assert_allclose(got, expected, rtol=0, atol=xp.rtol * np.abs(expected).max())
    # transpose: one array of the inner shape
    v = random_vector(rng, case)
    vr = tuple(xp.round_host(x) for x in v)
    bt = case.loss.multiply_fisher_factor_transpose(_dev(xp, v))
    xp.check(bt)
    assert tuple(bt.shape) == tuple(inner)
    expected_t = np.einsum("nik,ni->nk", B, flat_cat(vr, case.n)).reshape(inner)
    xp.assert_close(bt, expected_t)


def test_factor_identities_matrix_free(xp, case, rng):
    """B Bᵀ v = F v and ⟨B u, v⟩ = ⟨u, Bᵀ v⟩, using only the matrix-free products."""
    loss = case.loss
    v = _dev(xp, random_vector(rng, case))
    u = xp.asarray(rng.standard_normal(loss.fisher_factor_inner_shape))
    bbt = to_host_tuple(xp, loss.multiply_fisher_factor(loss.multiply_fisher_factor_transpose(v)))
    fv = to_host_tuple(xp, loss.multiply_fisher(v))
    scale = max(np.abs(flat_cat(fv, case.n)).max(), 1e-300)
    np.testing.assert_allclose(flat_cat(bbt, case.n), flat_cat(fv, case.n), rtol=0,
                               atol=xp.rtol * scale)
    bu = flat_cat(to_host_tuple(xp, loss.multiply_fisher_factor(u)), case.n)
    btv = xp.to_numpy(loss.multiply_fisher_factor_transpose(v)).reshape(case.n, -1)
    vh = flat_cat(to_host_tuple(xp, v), case.n)
    uh = xp.to_numpy(u).reshape(case.n, -1)
    lhs, rhs = np.sum(bu * vh), np.sum(uh * btv)
    # both sides are sums of N·D·K products of O(1) numbers: error <= rtol · Σ|terms|
    assert abs(lhs - rhs) <= xp.rtol * (np.sum(np.abs(bu * vh)) + np.sum(np.abs(uh * btv)))
    # and the same for the GGN
    bbt_g = to_host_tuple(xp, loss.multiply_ggn_factor(loss.multiply_ggn_factor_transpose(v)))
    np.testing.assert_allclose(flat_cat(bbt_g, case.n), flat_cat(fv, case.n), rtol=0,
                               atol=xp.rtol * scale)


def test_replicated_one_hot_is_factor_of_replicated_one_hot(xp, case):
    loss = case.loss
    inner = loss.fisher_factor_inner_shape
    for index in np.ndindex(*inner[1:]):
        e = np.zeros(inner)
        e[(slice(None), *index)] = 1.0
        expected = to_host_tuple(xp, loss.multiply_fisher_factor(xp.asarray(e)))
        got = loss.multiply_fisher_factor_replicated_one_hot(index)
        assert isinstance(got, tuple) and len(got) == len(case.inputs)
        for g, ex in zip(got, expected, strict=True):
            xp.check(g)
            np.testing.assert_allclose(xp.to_numpy(g), ex, rtol=0,
                                       atol=xp.rtol * max(np.abs(ex).max(), 1.0))
        got_u = loss.multiply_ggn_factor_replicated_one_hot_unweighted(index)
        for g, ex in zip(got_u, expected, strict=True):
            np.testing.assert_allclose(xp.to_numpy(g) * math.sqrt(WEIGHT), ex, rtol=0,
                                       atol=xp.rtol * max(np.abs(ex).max(), 1.0))


def test_weight_scales_fisher_by_w_and_factors_by_sqrt_w(xp, case, rng):
    loss = case.loss
    v = _dev(xp, random_vector(rng, case))
    u = xp.asarray(rng.standard_normal(loss.fisher_factor_inner_shape))
    sw = math.sqrt(WEIGHT)
    pairs = [
        (loss.multiply_fisher(v), loss.multiply_fisher_unweighted(v), WEIGHT),
        (loss.multiply_ggn(v), loss.multiply_ggn_unweighted(v), WEIGHT),
        (loss.multiply_fisher_factor(u), loss.multiply_fisher_factor_unweighted(u), sw),
        (loss.multiply_ggn_factor(u), loss.multiply_ggn_factor_unweighted(u), sw),
        ((loss.multiply_fisher_factor_transpose(v),),
         (loss.multiply_fisher_factor_transpose_unweighted(v),), sw),
        ((loss.multiply_ggn_factor_transpose(v),),
         (loss.multiply_ggn_factor_transpose_unweighted(v),), sw),
        (loss.multiply_fisher_factor_replicated_one_hot([0] * (u.ndim - 1)),
         loss.multiply_fisher_factor_replicated_one_hot_unweighted([0] * (u.ndim - 1)), sw),
    ]
    for weighted, unweighted, c in pairs:
        for a, b in zip(weighted, unweighted, strict=True):
            xp.check(a)
            bh = xp.to_numpy(b)
            np.testing.assert_allclose(xp.to_numpy(a), c * bh, rtol=0,
                                       atol=xp.rtol * max(np.abs(bh).max(), 1e-300))


def test_weight_zero_gives_zero_curvature(xp, rng):
    z = xp.asarray(rng.standard_normal((2, 3)))
    loss = L.CategoricalLogitsNegativeLogProbLoss(z, weight=0)
    assert loss.weight == 0.0
    assert np.all(xp.to_numpy(loss.fisher_matrix()) == 0.0)
    assert np.all(xp.to_numpy(loss.multiply_fisher_factor(z)[0]) == 0.0)


def test_evaluate_coefficient_modes(xp, case):
    loss = case.loss
    off = xp.to_numpy(loss.evaluate(coefficient_mode="off"))
    assert off.shape == (case.n,)
    xp.check(loss.evaluate())
    np.testing.assert_allclose(xp.to_numpy(loss.evaluate()), WEIGHT * off, rtol=xp.rtol)
    np.testing.assert_allclose(xp.to_numpy(loss.evaluate(coefficient_mode="sqrt")),
                               math.sqrt(WEIGHT) * off, rtol=xp.rtol)
    g_off = to_host_tuple(xp, loss.grad_of_evaluate(None, "off"))
    g_sqrt = to_host_tuple(xp, loss.grad_of_evaluate(None, "sqrt"))
    g_reg = to_host_tuple(xp, loss.grad_of_evaluate())
    for a, b, c in zip(g_off, g_sqrt, g_reg, strict=True):
        np.testing.assert_allclose(b, math.sqrt(WEIGHT) * a, rtol=xp.rtol, atol=0)
        np.testing.assert_allclose(c, WEIGHT * a, rtol=xp.rtol, atol=0)


def test_mask_zeroes_masked_examples_and_matches_unmasked_rows(xp, rng):
    case = make_case(xp, "categorical_masked", rng)
    z = case.inputs[0]
    unmasked = L.CategoricalLogitsNegativeLogProbLoss(xp.asarray(z), xp.asarray(case.targets),
                                                      weight=WEIGHT)
    m = case.mask
    keep = m == 1.0
    v = (xp.asarray(rng.standard_normal(z.shape)),)
    u = xp.asarray(rng.standard_normal(z.shape))
    outs = [
        (lambda loss: loss.evaluate()),
        (lambda loss: loss.grad_of_evaluate()[0]),
        (lambda loss: loss.multiply_fisher(v)[0]),
        (lambda loss: loss.multiply_fisher_factor(u)[0]),
        (lambda loss: loss.multiply_fisher_factor_transpose(v)),
        (lambda loss: loss.multiply_fisher_factor_replicated_one_hot((1,))[0]),
        (lambda loss: loss.multiply_ggn(v)[0]),
        (lambda loss: loss.fisher_matrix()),
        (lambda loss: loss.fisher_factor_matrix()),
        (lambda loss: loss.hessian_matrix()),
    ]
    for f in outs:
        a = xp.to_numpy(f(case.loss))
        b = xp.to_numpy(f(unmasked))
        assert np.all(a[~keep] == 0.0)
        np.testing.assert_allclose(a[keep], b[keep], rtol=0,
                                   atol=xp.rtol * max(np.abs(b).max(), 1e-300))
    # mask given as bool and as integers means the same
    for mask in (xp.asarray(keep), xp.asarray(m.astype(np.int64))):
        other = L.CategoricalLogitsNegativeLogProbLoss(xp.asarray(z), xp.asarray(case.targets),
                                                       mask, weight=WEIGHT)
        np.testing.assert_array_equal(xp.to_numpy(other.evaluate()),
                                      xp.to_numpy(case.loss.evaluate()))


def test_properties_and_copy(xp, case):
    loss = case.loss
    assert loss.weight == WEIGHT
    assert loss.parameter_dependants == loss.params
    assert loss.num_parameter_dependants == len(case.inputs)
    assert loss.dtype == xp.dtype
    assert loss.batch_size == case.n
    assert loss.targets is not None
    assert loss.num_parameter_independants == len(loss.parameter_independants)
    new_inputs = tuple(x * 1.5 for x in loss.parameter_dependants)
    other = loss.copy_with_different_inputs(new_inputs)
    assert type(other) is type(loss)
    assert other.params[0] is new_inputs[0]
    assert other.weight == loss.weight
    # same targets, new inputs: losses differ, shapes agree
    assert tuple(other.evaluate().shape) == (case.n,)
    expected_inner = {"mean_variance": (case.n, 4)}.get(case.name,
                                                          tuple(case.inputs[0].shape))
    assert loss.fisher_factor_inner_shape == expected_inner


def test_normal_mean_default_variance_is_squared_error(xp, rng):
    """v = 0.5: loss = ‖y − μ‖² (+ const), curvature 2I — the factor-2 pitfall pinned."""
    mu = xp.round_host(rng.standard_normal((2, 3)))
    y = xp.round_host(rng.standard_normal((2, 3)))
    loss = L.NormalMeanNegativeLogProbLoss(xp.asarray(mu), xp.asarray(y),
                                           normalize_log_prob=False)
    assert loss.variance == 0.5
    xp.assert_close(loss.evaluate(), ((y - mu) ** 2).sum(-1))
    xp.assert_close(loss.fisher_matrix(), np.stack([2 * np.eye(3)] * 2))
    unit = L.NormalMeanNegativeLogProbLoss(xp.asarray(mu), xp.asarray(y), variance=1.0,
                                           normalize_log_prob=False)
    xp.assert_close(unit.evaluate(), 0.5 * ((y - mu) ** 2).sum(-1))
    xp.assert_close(unit.fisher_matrix(), np.stack([np.eye(3)] * 2))


# -- hypothesis: the identities over random shapes and logit scales ------------------------
def _fisher_and_factor(xp, loss_cls, shape, scale, seed):
    """Logits ``scale·z`` (z standard normal from ``seed``, backend-rounded), and the dense
    Fisher and Fisher factor of ``loss_cls`` at them, on the host."""
    z = xp.round_host(scale * np.random.default_rng(seed).standard_normal(shape))
    loss = loss_cls(xp.asarray(z))
    return z, xp.to_numpy(loss.fisher_matrix()), xp.to_numpy(loss.fisher_factor_matrix())


@given(n=st.integers(1, 3), k=st.integers(1, 6), scale=st.floats(0.0, 40.0),
       seed=st.integers(0, 2**31 - 1))
def test_categorical_factor_identities_property(xp, n, k, scale, seed):
    z, F, B = _fisher_and_factor(xp, L.CategoricalLogitsNegativeLogProbLoss, (n, k), scale,
                                 seed)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    oracle = np.stack([np.diag(pi) - np.outer(pi, pi) for pi in p])
    np.testing.assert_allclose(F, oracle, rtol=0, atol=xp.rtol)
    np.testing.assert_allclose(B @ B.transpose(0, 2, 1), oracle, rtol=0, atol=xp.rtol)
    # F annihilates constant shifts of the logits; F is PSD
    np.testing.assert_allclose(F @ np.ones(k), 0.0, atol=xp.rtol)
    assert np.linalg.eigvalsh(F).min() >= -xp.rtol


@given(n=st.integers(1, 3), d=st.integers(1, 4), scale=st.floats(0.0, 40.0),
       seed=st.integers(0, 2**31 - 1))
def test_bernoulli_factor_identities_property(xp, n, d, scale, seed):
    z, F, B = _fisher_and_factor(xp, L.MultiBernoulliNegativeLogProbLoss, (n, d), scale, seed)
    p = 1.0 / (1.0 + np.exp(-z))
    oracle = np.stack([np.diag(pi * (1 - pi)) for pi in p])
    # p(1 - p) near 0 is computed relatively accurately by kfac_ref; the oracle's 1 - p
    # cancels, so compare with an absolute tolerance at the scale of max F (<= 1/4).
    np.testing.assert_allclose(F, oracle, rtol=0, atol=xp.rtol / 4)
    np.testing.assert_allclose(B @ B.transpose(0, 2, 1), F, rtol=0, atol=xp.rtol / 4)
