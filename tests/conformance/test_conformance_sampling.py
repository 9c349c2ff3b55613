"""The sampling estimation modes in the conformance suite (``sampling.kfac``): the given-draws
reference against kfac_ref's own sampling code, the exact moments against brute force and the
exact modes, the statistical route's false-alarm plan and its power against wrong estimators."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from conformance.adapter import load_adapter
from conformance.catalogue import build_catalogue, capabilities
from conformance.catalogue import sampling_cases as sc
from conformance.mutants import sampling_mutants as sm
from conformance.runner import run_adapter
from conformance.sampling import ALPHA, CHEBYSHEV_C, GROUP_SIZE, binomial_tail, plan


@pytest.fixture(scope="module")
def live():
    cases, _ = build_catalogue(["sampling"])
    return cases, capabilities()


def _own_inputs(case):
    return {k: v for k, v in case.inputs.items() if k not in ("signs", "sampled_targets")}


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_every_sampling_mode_has_cases(live):
    cases, _ = live
    assert {c.params["mode"] for c in cases} == set(sc.SAMPLING_MODES)
    assert {c.params["loss"] for c in cases} == {"categorical", "normal_mean"}


def test_given_draws_route_is_the_estimators_own_sampling(live, xp):
    """The reference for given draws (empirical-Fisher K-FAC of a surrogate loss) equals
    kfac_ref's estimator in the sampling mode fed the generator that produced the draws, on
    every backend cell (draws are made on the host, so every cell sees the same numbers)."""
    cases, _ = live
    to_b = xp.asarray
    for case in cases:
        inputs = _own_inputs(case)
        for seed in (0, 1):
            draws = sc.draws_from(np.random.default_rng(seed), case.params, inputs)
            given = sc.kfac_given_draws(case.params, {**inputs,
                                                      sc.DRAWS_INPUT[case.params["mode"]]: draws},
                                        to_b, xp.to_numpy)
            own = sc.kfac_own_draws(case.params, inputs, seed, to_b, xp.to_numpy)
            assert _rel(given, own) <= case.tolerance.rtol(xp.eps), case.id
        got = sc.kfac_given_draws(case.params, case.inputs, to_b, xp.to_numpy)
        assert _rel(got, case.expected) <= case.tolerance.rtol(xp.eps), case.id


def test_mean_is_the_exact_mode_kfac(live):
    """Unbiasedness: the exact mean of one draw's estimate (polarisation / enumeration of the
    draws, through the given-draws route) is the exact-mode K-FAC (kfac_ref's fisher_exact or
    ggn_exact, a different code path)."""
    cases, _ = live
    for case in cases:
        assert _rel(case.alternatives["_mean"], case.alternatives["_exact"]) <= 1e-13, case.id


def _small(mode, loss):
    tanh = {"kind": "activation", "fn": "tanh"}
    if loss == "categorical":
        spec, x_shape, lossp, n_out = [sc._dense(2, 3), tanh, sc._dense(3, 3)], (2, 2), \
            {"loss": "categorical"}, 3
    else:
        spec, x_shape, lossp, n_out = [sc._dense(2, 2), tanh, sc._dense(2, 2)], (2, 2), \
            {"loss": "normal_mean", "variance": 0.7}, 2
    inputs = sc._make_inputs(f"test/{mode}/{loss}", spec, x_shape, loss, n_out)
    params = {"net": spec, **lossp, "mode": mode}
    draws = sc.draws_from(np.random.default_rng(3), params, inputs)
    return params, {**inputs, sc.DRAWS_INPUT[mode]: draws}


@pytest.mark.parametrize("mode, loss", [("fisher_gradients", "categorical"),
                                        ("fisher_curvature_prop", "categorical"),
                                        ("ggn_curvature_prop", "categorical"),
                                        ("fisher_gradients", "normal_mean"),
                                        ("ggn_curvature_prop", "normal_mean")])
def test_moments_against_brute_force(mode, loss):
    """draw_moments against the full distribution of the draws of N = 2 examples: every
    class pair (probabilities from the softmax), every sign pattern, or Gauss-Hermite
    quadrature (3 nodes per coordinate: exact for the degree-4 polynomial X² in ε)."""
    params, inputs = _small(mode, loss)
    mean, var = sc.draw_moments(params, inputs)
    key = sc.DRAWS_INPUT[mode]
    _, _, f, _ = sc._loss(params, inputs, lambda v: v)
    f = np.asarray(f)
    vals, weights = [], []
    if mode == "fisher_gradients" and loss == "categorical":
        p = np.exp(f) / np.exp(f).sum(axis=1, keepdims=True)
        for ys in itertools.product(range(f.shape[1]), repeat=f.shape[0]):
            vals.append(sc.kfac_given_draws(params, {**inputs, key: np.array(ys)}))
            weights.append(np.prod([p[i, y] for i, y in enumerate(ys)]))
    elif mode == "fisher_gradients":
        nodes, w = np.polynomial.hermite_e.hermegauss(3)  # weight exp(-x²/2)
        w = w / w.sum()
        for idx in itertools.product(range(3), repeat=f.size):
            eps = nodes[list(idx)].reshape(f.shape)
            y = f + math.sqrt(params["variance"]) * eps
            vals.append(sc.kfac_given_draws(params, {**inputs, key: y}))
            weights.append(np.prod(w[list(idx)]))
    else:
        shape = inputs[key].shape
        for signs in itertools.product((-1.0, 1.0), repeat=int(np.prod(shape))):
            vals.append(sc.kfac_given_draws(params, {**inputs,
                                                     key: np.array(signs).reshape(shape)}))
            weights.append(0.5 ** len(signs))
    vals, weights = np.stack(vals), np.array(weights)
    bf_mean = np.tensordot(weights, vals, axes=1)
    bf_var = np.tensordot(weights, (vals - bf_mean) ** 2, axes=1)
    assert _rel(mean, bf_mean) <= 1e-12
    assert _rel(var, bf_var) <= 1e-10
    assert float(np.abs(var).max()) > 0  # a random estimate


def test_false_alarm_plan():
    """k groups make m · P(Bin(k, 1/c²) ≥ (k+1)/2) ≤ α, and k − 2 would not."""
    for m in (1, 400, 961):
        k = plan(m)
        assert k % 2 == 1
        assert m * binomial_tail(k, 1 / CHEBYSHEV_C ** 2) <= ALPHA
        if k > 1:
            assert m * binomial_tail(k - 2, 1 / CHEBYSHEV_C ** 2) > ALPHA
    assert plan(961) == 39
    assert binomial_tail(1, 0.3) == pytest.approx(0.3)
    assert binomial_tail(3, 0.5) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="need m"):
        plan(0)


def test_power_margins(live):
    """Every case can see the designed faults with power ≥ 1 − 10⁻⁶: some entry of the ×2
    estimate is off by more than c·σ/√n + c·2σ/√n, some entry of the empirical Fisher by more
    than c·σ/√n (module docstring of conformance.sampling)."""
    cases, _ = live
    z = CHEBYSHEV_C / math.sqrt(GROUP_SIZE)
    for case in cases:
        mu, sd = case.alternatives["_mean"], np.sqrt(case.alternatives["_var"])
        ef = case.alternatives["empirical_fisher"]
        with np.errstate(divide="ignore", invalid="ignore"):
            assert np.nanmax(np.abs(mu) / (3 * z * sd)) > 1.2, case.id
            assert np.nanmax(np.abs(ef - mu) / (z * sd)) > 1.2, case.id


def _own_draws(mutant):
    return type(f"OwnDraws{mutant.__name__}", (mutant,), {"accepts_draws": ()})()


@pytest.mark.slow
def test_kfac_ref_own_draws_passes_the_statistical_route(live):
    cases, caps = live
    rep = run_adapter(load_adapter("kfac_ref_own_draws"), cases, caps)
    bad = [f"{r.case_id}: {r.message}" for r in rep.results if r.status != "pass"]
    assert not bad, "\n".join(bad)
    assert all("statistical route" in r.message for r in rep.results)


#: one case per loss (the margins of every case: test_power_margins)
POWER_CASES = ("sampling.kfac/mlp_tanh_n8_ce_fisher_gradients",
               "sampling.kfac/deep_linear_n6_mse_ggn_curvature_prop")


@pytest.mark.slow
@pytest.mark.parametrize("mutant, want", [
    (sm.SampledScaled2, ("scale:2", "mse_factor_2")),
    (sm.SampledEmpirical, ("empirical_fisher",)),
])
def test_statistical_route_catches_wrong_estimators(live, mutant, want):
    """The ×2 estimate and the empirical Fisher drawing their own numbers fail, and the
    diagnosis of the estimated mean names the fault."""
    cases, caps = live
    rep = run_adapter(_own_draws(mutant), [c for c in cases if c.id in POWER_CASES], caps)
    assert len(rep.results) == len(POWER_CASES)
    for r in rep.results:
        assert r.status == "fail", f"{r.case_id}: {r.message}"
        assert "statistical route" in r.message
        assert r.diagnosis["pitfall"] in want, f"{r.case_id}: {r.diagnosis}"


@pytest.mark.slow
def test_unbiased_fault_needs_the_exact_route(live):
    """Sign vectors given to the wrong examples are still Rademacher: the estimator stays
    unbiased, the statistical route passes it, the exact route (mutant_sampled_draws_shifted)
    does not."""
    cases, caps = live
    sel = [c for c in cases if c.id == "sampling.kfac/mlp_tanh_n8_ce_ggn_curvature_prop"]
    rep = run_adapter(_own_draws(sm.SampledDrawsShifted), sel, caps)
    assert len(rep.results) == 1
    assert all(r.status == "pass" for r in rep.results), [r.message for r in rep.results]


def test_adapter_declares_accepted_draws():
    assert load_adapter("kfac_ref").info()["accepts_draws"] == ["sampling.kfac"]
    assert load_adapter("kfac_ref_own_draws").info()["accepts_draws"] == []


def test_both_routes_under_declared_conventions(live):
    """An adapter in the PyTorch layout with the curvature of the sum loss passes both routes
    as 'convention': the given draws' expectation and, in the statistical route, the exact
    mean and standard deviation are converted into its conventions."""
    from conformance.adapters.kfac_ref_adapter import KfacRefAdapter
    from conformance.conventions import Conventions

    cases, caps = live
    cap = caps["sampling.kfac"]
    conv = Conventions(kron_order="GA", curvature_of="sum", bias_position="first")

    class Torchy(KfacRefAdapter):
        name = "torchy"
        conventions = conv

        def sampling_kfac(self, inputs, params):  # the reference moved into its layout
            case = next(c for c in cases if c.params == {k: v for k, v in params.items()
                                                         if k != "seed"})
            canon = dict(inputs)
            if "seed" not in params:
                canon.update({k: case.inputs[k] for k in cap.draws if k in case.inputs})
            return cap.convert_output(super().sampling_kfac(canon, params), case, conv)

    Torchy.sampling_kfac._conformance_capabilities = ("sampling.kfac",)
    sel = [c for c in cases if c.id == "sampling.kfac/mlp_tanh_n8_ce_ggn_curvature_prop"]
    for accepts in (("sampling.kfac",), ()):
        ad = type("T", (Torchy,), {"accepts_draws": accepts})()
        rep = run_adapter(ad, sel, caps)
        assert [r.status for r in rep.results] == ["convention"], rep.results[0].message


def test_statistical_check_heavy_tails_and_a_shift():
    """No normality needed: Student-t (3 degrees of freedom, variance 3) estimates around the
    true mean pass; the same shifted by one standard deviation in one entry fail; an entry of
    variance 0 is held to the rounding tolerance; a wrong shape is an error."""
    from conformance.sampling import statistical_check

    mean = np.array([[1.0, -2.0], [0.5, 0.0]])
    var = np.array([[3.0, 3.0], [3.0, 0.0]])

    def draw(shift):
        def estimate(seed):
            t = np.random.default_rng(seed).standard_t(3, size=mean.shape)
            t[1, 1] = 0.0
            out = mean + t
            out[0, 1] += shift
            return out
        return estimate

    ok = statistical_check(draw(0.0), mean, var, 1e-12)
    assert ok.ok and ok.statistic <= 1.0 and ok.draws == ok.groups * 64
    bad = statistical_check(draw(np.sqrt(3.0)), mean, var, 1e-12)
    assert not bad.ok and bad.worst == (0, 1)
    with pytest.raises(ValueError, match="shape"):
        statistical_check(lambda seed: np.zeros(3), mean, var, 1e-12)
