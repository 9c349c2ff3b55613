"""The own-model check's verdicts on synthetic references (NumPy only, so the README's test
command runs them): block verdicts and equivalent splits, declared conventions, optimiser
state (moving averages started at the identity or at zero), one scale term per factor, no
quiet passes, shapes that look like a known layout.  Every expected value is built here from
the definitions, not by the code under test."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.own_model import check_factors, layer_alternatives

N, T, K = 6, 4, 3


def _spd(rng, d):
    m = rng.standard_normal((d + 2, d))
    return m.T @ m / (d + 2)


def _layer(rng, p=5, q=3, t=T, kind="dense", bias=True):
    return {"A": _spd(rng, p), "G": _spd(rng, q), "N": N, "T": t, "K": K, "kind": kind,
            "bias": bias}


def _check(ref, user, **kw):
    alts = {name: layer_alternatives(name, r, {}, "fisher_exact", "expand")
            for name, r in ref.items()}
    return check_factors(ref, user, alts, "fisher_exact", **kw)


def _by(res):
    return {(c.layer, c.factor): c for c in res.checks}


def test_exact_factors_pass_at_block_and_factor_level():
    rng = np.random.default_rng(0)
    ref = {"L": _layer(rng)}
    res = _check(ref, {"L": {"A": ref["L"]["A"], "G": ref["L"]["G"]}})
    assert res.ok and [b.verdict for b in res.blocks] == ["ok"]
    assert "L: block ok" in str(res)


@pytest.mark.parametrize("c", [1 / T, T, 1 / N, 2.5])
def test_a_split_that_cancels_is_equivalent(c):
    """A·c ⊗ G/c is the reference block: the layer passes, the split is named, and the
    factor-level verdict still fails."""
    rng = np.random.default_rng(1)
    ref = {"L": _layer(rng)}
    user = {"L": {"A": c * ref["L"]["A"], "G": ref["L"]["G"] / c}}
    res = _check(ref, user)
    assert res.ok, str(res)
    (block,) = res.blocks
    assert block.verdict == "equivalent" and block.rel_err <= block.rtol
    if c == 1 / T:
        assert block.split == f"A × 1/|T| = 1/{T}, G × |T| = {T}"
    if c == 2.5:
        assert block.split == "A × 2.5, G × 0.4"
    assert not _check(ref, user, level="factors").ok
    assert "differs by" in str(res) and "equivalent" in str(res)


def test_block_error_is_the_dense_kronecker_error():
    """The block's relative error (computed without forming A ⊗ G) equals the dense one."""
    rng = np.random.default_rng(2)
    ref = {"L": _layer(rng, p=4, q=3)}
    a_u = ref["L"]["A"] * 1.3 + 1e-3 * _spd(rng, 4)
    g_u = ref["L"]["G"] / 1.2 + 1e-3 * _spd(rng, 3)
    res = _check(ref, {"L": {"A": a_u, "G": g_u}})
    dense_ref = np.kron(ref["L"]["A"], ref["L"]["G"])
    want = np.linalg.norm(np.kron(a_u, g_u) - dense_ref) / np.linalg.norm(dense_ref)
    assert res.blocks[0].rel_err == pytest.approx(want, rel=1e-10)
    assert res.blocks[0].verdict == "FAIL" and not res.ok


def test_a_missing_layer_or_factor_fails_with_the_list():
    rng = np.random.default_rng(3)
    ref = {"L1": _layer(rng), "L2": _layer(rng)}
    only_one = {"L1": {"A": ref["L1"]["A"], "G": ref["L1"]["G"]}}
    res = _check(ref, only_one)
    assert not res.ok and res.unchecked == ["L2"]
    assert "NOT CHECKED" in str(res) and "L2" in str(res).splitlines()[-1]
    assert _check(ref, only_one, layers=["L1"]).ok  # an explicit subset
    res = _check(ref, {"L1": {"A": ref["L1"]["A"]}, "L2": only_one["L1"] | {}})
    assert "L1.G" in res.unchecked
    assert _check(ref, {"L1": {"A": ref["L1"]["A"]}}, layers=["L1.A"]).ok
    with pytest.raises(ValueError, match=r"layers names 'L3'"):
        _check(ref, only_one, layers=["L3"])


def test_conv_kfc_convention_declared_passes_undeclared_is_named():
    """G normalised by N|T| (Γ = G/|T|): named per factor when undeclared, passes when
    declared; the block with |T|·(A ⊗ Γ) is the reference's."""
    rng = np.random.default_rng(4)
    ref = {"conv": _layer(rng, kind="conv2d", bias=False) | {"kernel": [1, 1], "c_in": 5,
                                                              "order": "chw"}}
    user = {"conv": {"A": ref["conv"]["A"], "G": ref["conv"]["G"] / T}}
    res = _check(ref, user)
    assert not res.ok
    g = _by(res)["conv", "G"]
    assert g.diagnosis == "scale:1/T" and "Γ = G/|T|" in g.explanation
    declared = _check(ref, user, conventions={"conv_style": "kfc"})
    assert declared.ok and "conv_style='kfc'" in str(declared)


def test_separate_bias_layout_is_accepted_when_declared_and_named_when_not():
    rng = np.random.default_rng(5)
    ref = {"L": _layer(rng, p=5)}
    user = {"L": {"A": ref["L"]["A"][:-1, :-1], "G": ref["L"]["G"]}}
    res = _check(ref, user)
    a = _by(res)["L", "A"]
    assert a.diagnosis == "bias_separate" and "no bias coordinate" in a.explanation
    assert "then it agrees" in a.explanation
    assert _check(ref, user, conventions={"bias_position": "separate"}).ok
    first = np.r_[4, 0:4]
    user_first = {"L": {"A": ref["L"]["A"][np.ix_(first, first)], "G": ref["L"]["G"]}}
    assert _by(_check(ref, user_first))["L", "A"].diagnosis == "bias_position"
    assert _check(ref, user_first, conventions={"bias_position": "first"}).ok


def test_swapped_factors_are_named():
    rng = np.random.default_rng(6)
    ref = {"L": _layer(rng, p=5, q=3)}
    res = _check(ref, {"L": {"A": ref["L"]["G"], "G": ref["L"]["A"]}})
    assert {c.diagnosis for c in res.checks} == {"factors_swapped"}


def test_one_scale_term_per_factor_with_causes_for_that_factor():
    rng = np.random.default_rng(7)
    ref = {"L": _layer(rng)}
    user = {"L": {"A": ref["L"]["A"] * T, "G": ref["L"]["G"] / (N ** 2 * T ** 3)}}
    by = _by(_check(ref, user))
    assert by["L", "A"].diagnosis == "scale:T" and "BackPACK" in by["L", "A"].explanation
    g = by["L", "G"]
    assert g.diagnosis == "scale:1/(N^2·T^3)", g.explanation
    assert "mean-reduced loss" in g.explanation and "|T|" in g.explanation
    assert "BackPACK" not in g.explanation  # the A-side text is not printed for G
    by = _by(_check(ref, {"L": {"A": ref["L"]["A"], "G": ref["L"]["G"] * N}}))
    assert by["L", "G"].diagnosis == "scale:N" and "summed loss" in by["L", "G"].explanation


def test_squared_error_without_the_half_is_4_in_the_empirical_fisher():
    rng = np.random.default_rng(8)
    ref = {"L": _layer(rng, t=1)}
    alts = {"L": {"A": {}, "G": {}}}
    res = check_factors(ref, {"L": {"A": ref["L"]["A"], "G": 4 * ref["L"]["G"]}}, alts,
                        "fisher_empirical", loss="mse")
    g = _by(res)["L", "G"]
    assert g.diagnosis == "scale:4" and "without the ½" in g.explanation
    ok = check_factors(ref, {"L": {"A": ref["L"]["A"], "G": 4 * ref["L"]["G"]}}, alts,
                       "fisher_empirical", loss="mse", conventions={"mse_variance": 0.5})
    assert ok.ok, str(ok)


def test_identity_started_average_after_one_batch_gives_the_decay_power():
    """m₀ = I, mₖ = δ mₖ₋₁ + (1 − δ) X after k updates on one batch: c·I + (1 − c)·X with
    c = δᵏ; with the decay declared the step count is recovered."""
    rng = np.random.default_rng(9)
    ref = {"L": _layer(rng)}
    a, g = ref["L"]["A"], ref["L"]["G"]
    d, k = 0.9, 3
    m_a, m_g = np.eye(5), np.eye(3)
    for _ in range(k):  # the optimiser's recursion, by hand
        m_a, m_g = d * m_a + (1 - d) * a, d * m_g + (1 - d) * g
    res = _check(ref, {"L": {"A": m_a, "G": m_g}}, layers=["L"], decay=None)
    by = _by(res)
    assert by["L", "A"].diagnosis == "ema_identity_init", str(res)
    assert f"{d ** k:.6g}" in by["L", "A"].explanation
    res = check_factors(ref, {"L": {"A": m_a, "G": m_g}}, {"L": {"A": {}, "G": {}}},
                        "fisher_exact", decay=d, conventions={"ema_init": "zero"})
    assert "decay 0.9 after 3 updates" in _by(res)["L", "G"].explanation
    # declared, with the right decay and one batch of statistics: a k-step identity start
    # is the declared average only for k = 1
    m1_a, m1_g = d * np.eye(5) + (1 - d) * a, d * np.eye(3) + (1 - d) * g
    ok = check_factors(ref, {"L": {"A": m1_a, "G": m1_g}}, {"L": {"A": {}, "G": {}}},
                       "fisher_exact", decay=d, conventions={"ema_init": "identity"})
    assert ok.ok, str(ok)


def test_identity_started_average_over_two_batches_recovers_the_decay():
    rng = np.random.default_rng(10)
    ref1, ref2 = {"L": _layer(rng)}, {"L": _layer(rng)}
    d = 0.8
    user = {}
    for fac, dim in (("A", 5), ("G", 3)):
        m = np.eye(dim)
        for r in (ref1, ref2):
            m = d * m + (1 - d) * r["L"][fac]
        user[fac] = m
    alts = {"L": {"A": {}, "G": {}}}
    res = check_factors(ref2, {"L": user}, alts, "fisher_exact", earlier=[(ref1, alts)],
                        decay=0.95)
    for fac in ("A", "G"):
        c = _by(res)["L", fac]
        assert c.diagnosis == "ema_identity_init", str(res)
        assert "decay δ = 0.8 " in c.explanation
    declared = check_factors(ref2, {"L": user}, alts, "fisher_exact", earlier=[(ref1, alts)],
                             decay=d, conventions={"ema_init": "identity"})
    assert declared.ok, str(declared)
    # the zero-debiased average of the two batches is the default declaration
    w = np.array([d, 1.0]) / (1 + d)
    debiased = {f: w[0] * ref1["L"][f] + w[1] * ref2["L"][f] for f in ("A", "G")}
    assert check_factors(ref2, {"L": debiased}, alts, "fisher_exact",
                         earlier=[(ref1, alts)], decay=d).ok
    res = check_factors(ref2, {"L": debiased}, alts, "fisher_exact",
                        earlier=[(ref1, alts)], decay=0.5)
    assert _by(res)["L", "A"].diagnosis == "ema_decay" and "0.8" in _by(res)["L", "A"].explanation


def test_zero_started_average_without_debiasing_is_named():
    rng = np.random.default_rng(11)
    ref1, ref2 = {"L": _layer(rng)}, {"L": _layer(rng)}
    d = 0.7
    raw = {f: (1 - d) * (d * ref1["L"][f] + ref2["L"][f]) for f in ("A", "G")}
    alts = {"L": {"A": {}, "G": {}}}
    res = check_factors(ref2, {"L": raw}, alts, "fisher_exact", earlier=[(ref1, alts)],
                        decay=d)
    assert {c.diagnosis for c in res.checks} == {"ema_zero_init_no_debias"}, str(res)
    assert check_factors(ref2, {"L": raw}, alts, "fisher_exact", earlier=[(ref1, alts)],
                         decay=d, conventions={"ema_style": "raw"}).ok


def test_float64_factors_of_a_float32_model_get_the_models_tolerance():
    rng = np.random.default_rng(12)
    ref = {"L": _layer(rng) | {"dtype": "float32"}}
    noisy = ref["L"]["A"] * (1 + 1e-7)  # float32 rounding, reported by a float64 array
    res = _check(ref, {"L": {"A": noisy, "G": ref["L"]["G"]}})
    assert res.ok and all(c.rtol > 1e-6 for c in res.checks)


def test_unexplained_g_in_an_exact_mode_suggests_the_sampled_mode():
    rng = np.random.default_rng(13)
    ref = {"L": _layer(rng)}
    noisy = ref["L"]["G"] + 0.05 * _spd(rng, 3)
    res = _check(ref, {"L": {"A": ref["L"]["A"], "G": noisy}})
    g = _by(res)["L", "G"]
    assert g.diagnosis == "unexplained" and "mode='fisher_sampled'" in g.explanation


def test_bad_conventions_and_levels_are_refused():
    rng = np.random.default_rng(14)
    ref = {"L": _layer(rng)}
    user = {"L": {"A": ref["L"]["A"], "G": ref["L"]["G"]}}
    with pytest.raises(ValueError, match=r"conventions has no field 'bias'"):
        _check(ref, user, conventions={"bias": "last"})
    with pytest.raises(ValueError, match=r"conventions\['conv_style'\] must be one of"):
        _check(ref, user, conventions={"conv_style": "tf"})
    with pytest.raises(ValueError, match=r"concerns the preconditioner"):
        _check(ref, user, conventions={"kron_order": "GA"})
    with pytest.raises(ValueError, match=r"level must be one of"):
        _check(ref, user, level="layer")
    with pytest.raises(ValueError, match=r"decay must be the moving average's decay"):
        _check(ref, user, conventions={"ema_init": "identity"})
    with pytest.raises(TypeError, match=r"must be a real floating array"):
        _check(ref, {"L": {"A": np.eye(5, dtype=int), "G": ref["L"]["G"]}})


def test_zero_started_average_after_one_update_is_named_when_no_power_explains():
    rng = np.random.default_rng(15)
    ref = {"L": _layer(rng)}
    user = {"L": {"A": ref["L"]["A"], "G": 0.05 * ref["L"]["G"]}}  # δ = 0.95
    g = _by(_check(ref, user))["L", "G"]
    assert g.diagnosis == "ema_zero_init_no_debias" and "δ = 0.95" in g.explanation
    # a power of N is named first: 1/N is no moving average
    g = _by(_check(ref, {"L": {"A": ref["L"]["A"], "G": ref["L"]["G"] / N}}))["L", "G"]
    assert g.diagnosis == "scale:1/N"


def test_first_statistic_start_over_three_batches_is_named():
    rng = np.random.default_rng(16)
    refs = [{"L": _layer(rng)} for _ in range(3)]
    d = 0.6
    user = {}
    for fac in ("A", "G"):
        m = refs[0]["L"][fac]  # m₁ = X₁, then mᵢ = δ mᵢ₋₁ + (1 − δ) Xᵢ
        for r in refs[1:]:
            m = d * m + (1 - d) * r["L"][fac]
        user[fac] = m
    alts = {"L": {"A": {}, "G": {}}}
    earlier = [(r, alts) for r in refs[:2]]
    res = check_factors(refs[2], {"L": user}, alts, "fisher_exact", earlier=earlier, decay=d)
    assert {c.diagnosis for c in res.checks} == {"ema_first_statistic"}, str(res)
    assert check_factors(refs[2], {"L": user}, alts, "fisher_exact", earlier=earlier, decay=d,
                         conventions={"ema_init": "first"}).ok


@pytest.mark.parametrize("field, value, mode, scale_g", [
    ("curvature_of", "sum", "fisher_exact", N),
    ("empirical_fisher_scale", "kfac_jax", "fisher_empirical", 1 / N),
])
def test_declared_loss_scalings_pass_and_are_named_when_undeclared(field, value, mode,
                                                                   scale_g):
    rng = np.random.default_rng(17)
    ref = {"L": _layer(rng, t=1)}
    alts = {"L": {"A": {}, "G": {}}}
    user = {"L": {"A": ref["L"]["A"], "G": scale_g * ref["L"]["G"]}}
    assert check_factors(ref, user, alts, mode, conventions={field: value}).ok
    res = check_factors(ref, user, alts, mode)
    assert _by(res)["L", "G"].diagnosis == ("scale:N" if scale_g == N else "scale:1/N")
    assert field in _by(res)["L", "G"].explanation  # the explanation names the declaration
