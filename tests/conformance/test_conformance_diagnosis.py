"""The diagnosis on messy outputs: the other Kronecker order in a declared layout, a safety
epsilon on top of a pitfall (the looser *explains* criterion, with the residual reported),
structural ratios before an unnamed scale, compositions, and the new convention fields
honoured by the comparison (an honest adapter that declares them passes)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conformance.catalogue import build_catalogue, capabilities
from conformance.conventions import CANONICAL, FIELDS, Conventions
from conformance.diagnosis import EXPLAIN_RTOL, PITFALLS, diagnose
from conformance.mutants.diagnosis_mutants import (
    DampingPerFactor,
    EmaFirstStatistic,
    EmaWeightTied,
)
from conformance.runner import run_adapter


@pytest.fixture(scope="module")
def live():
    cases, _ = build_catalogue(["linalg", "averaging", "blocks"])
    return {c.id: c for c in cases}, capabilities()


def _diag(live, cid, actual, conv=CANONICAL, rtol=None):
    cases, caps = live
    c = cases[cid]
    return diagnose(actual, c, caps[c.capability], conv, rtol or c.tolerance.rtol())


def test_swapped_order_is_tried_in_the_declared_layout(live):
    cases, _ = live
    c = cases["linalg.kron_matvec/p4_q3"]
    ga = Conventions(kron_order="GA")
    v_ga = capabilities()[c.capability].inputs_for(c, ga)["v"]
    # code written for kron(A, G) on the [p, q] layout, handed the GA vector
    d = _diag(live, c.id, np.kron(c.inputs["a"], c.inputs["g"]) @ v_ga, ga)
    assert d.pitfall == "kron_order_swapped", d
    # and code written for kron(G, A), declared as the canonical AG layout
    d = _diag(live, c.id, np.kron(c.inputs["g"], c.inputs["a"]) @ c.inputs["v"])
    assert d.pitfall == "kron_order_swapped", d


def test_an_epsilon_on_top_of_a_pitfall_is_still_named_with_its_residual(live):
    cases, _ = live
    c = cases["linalg.pi_tracenorm/p4_q2_scales1_1"]
    a, g = c.inputs["a"], c.inputs["g"]
    pi = math.sqrt(np.trace(a) / np.trace(g) + 1e-8)
    d = _diag(live, c.id, np.asarray(pi))
    assert d.pitfall == "pi_without_dimensions", d
    assert c.tolerance.rtol() < d.rel_err <= EXPLAIN_RTOL
    assert "up to" in d.explanation and "small additive term" in d.explanation
    # a pass still needs the strict tolerance: the same output with the epsilon alone fails
    pi_eps = math.sqrt(np.trace(a) / 4 / (np.trace(g) / 2) + 1e-8)
    assert abs(pi_eps - float(c.expected)) / float(c.expected) > c.tolerance.rtol()


def test_a_large_perturbation_is_not_explained_loosely(live):
    cases, _ = live
    c = cases["linalg.pi_tracenorm/p4_q2_scales1_1"]
    d = _diag(live, c.id, c.alternatives["pi_without_dimensions"] * (1 + 1e-4))
    assert d.pitfall == "scale", d  # 1.0001·√2 is no known factor


def test_structural_ratios_before_an_unnamed_scale(live):
    cases, _ = live
    c = cases["blocks.kron_matpower/p-1_damping0.1_scale1_exact"]  # p = 4, q = 3
    d = _diag(live, c.id, c.expected * math.sqrt(4 / 3))
    assert d.pitfall == "scale:sqrt(dA/dG)", d
    assert "π without the dimension normalisation" in d.explanation
    d = _diag(live, c.id, c.expected * math.sqrt(4 / 3) / 2)
    assert d.pitfall == "scale:1/2+scale:sqrt(dA/dG)", d


def test_three_scalars_at_most(live):
    cases, _ = live
    c = cases["linalg.kron/p3_q2"]
    d = _diag(live, c.id, -c.expected * 0.5 * 1.5)
    assert d.pitfall == "negated+scale:1/2+scale:dA/dG", d
    d = _diag(live, c.id, -c.expected * 0.5 * 1.5 * math.sqrt(1.5))
    assert d.pitfall == "scale", d  # four pitfalls: beyond the search


@pytest.mark.parametrize("field", ["damping_per_factor", "ema_init", "ema_weight"])
def test_new_fields_are_documented_and_canonical(field):
    allowed, meaning = FIELDS[field]
    assert getattr(CANONICAL, field) == allowed[0] and len(meaning) > 80
    with pytest.raises(ValueError, match=field):
        Conventions(**{field: "bogus"})


@pytest.mark.parametrize("mutant, declared", [
    (DampingPerFactor, Conventions(damping_per_factor="lambda")),
    (EmaFirstStatistic, Conventions(ema_init="first", ema_weight="one_minus_decay")),
    (EmaWeightTied, Conventions(ema_style="raw", ema_weight="one_minus_decay")),
])
def test_declaring_the_convention_makes_the_same_code_pass(live, mutant, declared):
    cases, caps = live
    honest = type("Honest", (mutant,), {"conventions": declared, "name": "honest"})()
    sel = [c for c in cases.values() if c.capability in mutant.EXPECTED]
    report = run_adapter(honest, sel, caps)
    assert report.ok, [r.message for r in report.results if r.status not in
                       ("pass", "convention")]
    assert any(r.status == "convention" for r in report.results)


def test_every_new_pitfall_has_a_title():
    for pid in ("damping_parameterisation", "ema_first_statistic", "ema_weight_tied",
                "scale:sqrt(dA/dG)", "scale:kernel", "per_layer"):
        assert pid in PITFALLS
