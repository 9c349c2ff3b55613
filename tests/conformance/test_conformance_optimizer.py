"""The optimiser capability ``optimizer.kfac_steps``: its reference (kfac_ref's KFACOptimizer)
checked against independent computations (a hand-written NumPy loop, Newton's method on a
convex quadratic, the loop of kfac_ref pieces that builds the alternatives), on every backend
cell; the mutants' diagnoses; and peers without the capability reported as skips."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.adapter import Adapter, AdapterUnavailable, load_adapter
from conformance.adapters.kfac_ref_optimizer import kfac_optimizer_steps
from conformance.catalogue import build_catalogue, capabilities
from conformance.catalogue.optimizer_cases import FAULTS, PITFALLS, pitfall_steps
from conformance.conventions import Conventions
from conformance.model import EPS32, EPS64
from conformance.runner import run_adapter

CASES, _ABSENT = build_catalogue(["optimizer"])
CAPS = capabilities()
IDS = [c.id for c in CASES]


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


def test_the_family_is_present():
    assert not _ABSENT, _ABSENT
    assert len(CASES) == 3
    for c in CASES:
        k = c.params["steps"]
        assert c.expected.shape == (k, 2, c.expected.shape[-1])
        # every step moves, and every pitfall changes the numbers by more than the case's
        # tolerance even at float32 precision (so a float32 implementation cannot hide one)
        assert np.all(np.linalg.norm(c.expected[:, 0], axis=1) > 0)
        for name, alt in c.alternatives.items():
            assert _rel(alt, c.expected) > 4 * c.tolerance.rtol(EPS32), (c.id, name)


def test_momentum_pitfall_is_insensitive_without_momentum():
    # μ = 0: momentum before or after preconditioning is the same update, so the case must
    # not diagnose it (and the mutant must pass it)
    (c,) = [c for c in CASES if c.params["momentum"] == 0.0]
    assert "momentum_before_preconditioning" in c.meta["insensitive_to"]
    others = [c for c in CASES if c.params["momentum"] > 0]
    assert others and all("momentum_before_preconditioning" in c.alternatives for c in others)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reference_on_every_backend(xp, case):
    """kfac_ref's optimiser on every backend cell agrees with the float64 NumPy expectation
    within the case's own budget at the cell's precision."""
    got = kfac_optimizer_steps(case.params, case.inputs, xp.asarray, xp.to_numpy)
    assert got.shape == case.expected.shape
    assert _rel(got, case.expected) <= case.tolerance.rtol(xp.eps)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_pieces_loop_equals_the_optimiser(case):
    """Two implementations: KFACOptimizer vs the loop over kfac_ref's batch factors and
    gradients with EMA, π split, inverses, momentum and step in NumPy (the case's expected
    value), within the case's own budget (its derivation is in optimizer_cases.py)."""
    assert _rel(kfac_optimizer_steps(case.params, case.inputs), case.expected) <= (
        case.tolerance.rtol(EPS64))


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("fault, options", [
    ("exact_damping", {"exact_power": True}),
    ("refresh_every_step", {"inverse_update_period": 1}),
    ("momentum_before_preconditioning", {"momentum_type": "adam"}),
])
def test_pitfalls_equal_the_optimisers_own_options(case, fault, options):
    """Three built-in faults are options of KFACOptimizer: exact damping, period 1, TF's
    'adam' momentum (momentum on the gradient, then preconditioned)."""
    ref = kfac_optimizer_steps(case.params, case.inputs, **options)
    # the case's own budget (derived in optimizer_cases.py) at float64
    assert _rel(pitfall_steps(case.params, case.inputs, fault), ref) <= case.tolerance.rtol(EPS64)


# -- independent oracles -------------------------------------------------------------------
def _softmax_loop(x, y, w, b, hyper):
    """Hand-written K-FAC steps for one dense layer + softmax cross-entropy (NumPy only):
    A = ĀᵀĀ/N, G = (1/N)Σ(diag p − ppᵀ) (exact GGN factor), gradient Āᵀ(p − e_y)/N."""
    lam, d, k = hyper["damping"], hyper["decay"], hyper["inverse_period"]
    lr, mu = hyper["learning_rate"], hyper["momentum"]
    theta = np.concatenate([w, b[None, :]])  # [W; b], bias row last
    sa = sg = 0.0
    wt, vel, rows = 0.0, np.zeros_like(theta), []
    for t in range(hyper["steps"]):
        ab = np.concatenate([x[t], np.ones((x[t].shape[0], 1))], axis=1)
        z = ab @ theta
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        n = ab.shape[0]
        a_hat = ab.T @ ab / n
        g_hat = (np.diag(p.sum(axis=0)) - p.T @ p) / n
        sa, sg, wt = d * sa + a_hat, d * sg + g_hat, d * wt + 1.0
        a, g = sa / wt, sg / wt
        onehot = np.eye(theta.shape[1])[y[t]]
        grad = ab.T @ (p - onehot) / n
        if t % k == 0:
            pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
            ai = np.linalg.inv(a + pi * np.sqrt(lam) * np.eye(a.shape[0]))
            gi = np.linalg.inv(g + np.sqrt(lam) / pi * np.eye(g.shape[0]))
        direction = -(ai @ grad @ gi)
        vel = mu * vel - direction
        theta = theta - lr * vel
        rows.append(np.stack([direction.reshape(-1), theta.reshape(-1)]))
    return np.stack(rows)


def test_one_layer_softmax_against_a_hand_written_loop():
    rng = np.random.default_rng(7)
    hyper = {"steps": 5, "inverse_period": 2, "momentum": 0.6, "learning_rate": 0.4,
             "damping": 0.05, "decay": 0.85}
    params = {"net": [{"kind": "dense", "d_in": 3, "d_out": 4, "bias": True}],
              "loss": "categorical", "mode": "ggn_exact", **hyper}
    inputs = {"x": rng.standard_normal((5, 6, 3)), "targets": rng.integers(0, 4, (5, 6)),
              "w0": rng.standard_normal((3, 4)) / 2, "b0": 0.3 * rng.standard_normal(4)}
    want = _softmax_loop(inputs["x"], inputs["targets"], inputs["w0"], inputs["b0"], hyper)
    assert _rel(kfac_optimizer_steps(params, inputs), want) <= 1e-12
    # the stale inverse matters: refreshing every step gives other numbers
    assert _rel(kfac_optimizer_steps(params, inputs, inverse_update_period=1), want) > 1e-3


def test_one_step_on_a_convex_quadratic_is_newton():
    """Linear layer + squared error: K-FAC with exact curvature is the Hessian A ⊗ I/v, so
    one undamped step with η = 1 lands on the least-squares solution."""
    rng = np.random.default_rng(3)
    n, d_in, d_out = 9, 3, 2
    x, y = rng.standard_normal((1, n, d_in)), rng.standard_normal((1, n, d_out))
    params = {"net": [{"kind": "dense", "d_in": d_in, "d_out": d_out, "bias": True}],
              "loss": "normal_mean", "variance": 0.7, "mode": "ggn_exact", "steps": 1,
              "inverse_period": 1, "momentum": 0.0, "learning_rate": 1.0, "damping": 0.0,
              "decay": 0.9}
    inputs = {"x": x, "targets": y, "w0": rng.standard_normal((d_in, d_out)),
              "b0": rng.standard_normal(d_out)}
    out = kfac_optimizer_steps(params, inputs)
    ab = np.concatenate([x[0], np.ones((n, 1))], axis=1)
    star = np.linalg.lstsq(ab, y[0], rcond=None)[0].reshape(-1)
    assert _rel(out[0, 1], star) <= 1e-12
    theta0 = np.concatenate([inputs["w0"], inputs["b0"][None]]).reshape(-1)
    assert _rel(out[0, 0], star - theta0) <= 1e-12  # the direction is the Newton step


# -- the suite around it -------------------------------------------------------------------
def _run(name):
    adapter = load_adapter(name)
    try:
        adapter.setup()
    except AdapterUnavailable as exc:
        pytest.skip(f"{name} unavailable: {exc}")
    return run_adapter(adapter, CASES, CAPS)


@pytest.mark.parametrize("name", ["kfac_ref", "kfac_ref_strict", "kfac_ref_torch",
                                  "kfac_ref_float32", "kfac_ref_cupy"])
def test_kfac_ref_adapters_pass_every_case(name):
    report = _run(name)
    assert [r.status for r in report.results] == ["pass"] * len(CASES), [
        (r.case_id, r.status, r.message) for r in report.results]


MUTANT_TABLE = {f"mutant_opt_{f}": (f if f != "lagged_statistics" else "unexplained")
                for f in FAULTS}


@pytest.mark.parametrize("name", sorted(MUTANT_TABLE))
def test_mutant_gets_its_diagnosis(name):
    report = _run(name)
    by_id = {c.id: c for c in CASES}
    want = MUTANT_TABLE[name]
    failed = 0
    for r in report.results:
        if want in by_id[r.case_id].meta.get("insensitive_to", ()):
            assert r.status == "pass", (r.case_id, r.message)
            continue
        assert r.status == "fail", (r.case_id, r.status, r.message)
        assert r.diagnosis["pitfall"] == want, (r.case_id, r.diagnosis)
        failed += 1
    assert failed >= 2


def test_every_stored_pitfall_has_a_mutant():
    assert set(PITFALLS) <= set(FAULTS)
    assert {f"mutant_opt_{p}" for p in PITFALLS} <= set(MUTANT_TABLE)


class _Peer(Adapter):
    name = "peer_without_optimizer"


class _SumPeer(Adapter):
    name = "peer_sum_loss"
    conventions = Conventions(curvature_of="sum")

    def opt(self, inputs, params):  # never called: the case cannot be converted
        raise AssertionError("called")


def test_a_peer_without_the_capability_is_skipped_not_failed():
    report = run_adapter(_Peer(), CASES, CAPS)
    assert [r.status for r in report.results] == ["skip"] * len(CASES)


def test_peer_adapters_do_not_implement_it():
    from conformance.adapters import shipped

    for name in shipped():
        has = "optimizer.kfac_steps" in load_adapter(name).implementations()
        assert has == name.startswith("kfac_ref"), name


def test_a_declared_sum_loss_is_skipped_with_the_reason():
    from conformance.adapter import implements

    _SumPeer.opt = implements("optimizer.kfac_steps")(_SumPeer.opt)
    report = run_adapter(_SumPeer(), CASES, CAPS)
    assert [r.status for r in report.results] == ["skip"] * len(CASES)
    assert all("curvature_of='mean'" in r.message for r in report.results)


def test_a_declared_permutation_is_converted():
    """kron_order='GA' and bias first: kfac_ref's steps permuted into that layout pass, the
    canonical ones fail with both conventions named."""
    from conformance.adapters.kfac_ref_adapter import KfacRefAdapter
    from conformance.catalogue.optimizer_cases import param_index

    conv = Conventions(kron_order="GA", bias_position="first")

    class Permuted(KfacRefAdapter):
        name = "permuted"
        conventions = conv

        def opt_kfac_steps(self, inputs, params):
            out = super().opt_kfac_steps(inputs, params)
            return out[..., param_index(params["net"], inputs["x"].shape[1:], conv)]

    class Unpermuted(KfacRefAdapter):
        name = "unpermuted"
        conventions = conv

    assert {r.status for r in run_adapter(Permuted(), CASES, CAPS).results} == {"convention"}
    bad = run_adapter(Unpermuted(), CASES, CAPS).results
    assert {r.status for r in bad} == {"fail"}
    assert {r.diagnosis["pitfall"] for r in bad} == {"kron_order_swapped+bias_position"}


def test_bad_fault_is_refused():
    with pytest.raises(ValueError, match="fault must be None or one of"):
        pitfall_steps(CASES[0].params, CASES[0].inputs, "typo")
