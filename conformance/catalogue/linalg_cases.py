"""Linear-algebra capabilities: covariances, Kronecker products and vec conventions, π,
damped matrix functions (factored and exact damping).

Tolerance derivations (budget = SAFETY · work · κ, rtol = budget · eps):

* covariance of n rows: each entry is a length-n dot product, error ≤ n·eps·Σ|x||y|;
  work = n, κ = 1 (the data are O(1) Gaussians, so Σ|x||y| ~ ‖XᵀY‖);
* Kronecker products: one product per entry, work = 1; Kronecker matvecs: two GEMMs of
  lengths p and q, work = p + q;
* damped powers (M + λI)^p through eigh: work = n, κ = cond(M + λI), times max(1, |p|)
  (the relative error of s^p is |p| times that of s);
* Kronecker damped inverse/powers: work = p + q, κ = cond of the damped Kronecker product
  (the product of the two damped factors' condition numbers, or cond(A⊗G + λI));
* π and damping splits: traces (work = p + q) under a square root, κ = 1.
"""

from __future__ import annotations

import math

import numpy as np

from ..conventions import Conventions, a_index, vec_index
from ..model import SAFETY, Capability, Case, Tolerance, rng_for
from ._data import cond, psd, spd, to_np

REQUIRES = ("kfac_ref.linalg",)


# -- conversions ----------------------------------------------------------------------------
def _kron_matrix(arr, case, conv: Conventions):
    idx = vec_index(case.meta["p"], case.meta["q"], conv, case.meta.get("bias", False))
    return arr[np.ix_(idx, idx)]


def _kron_vector(arr, case, conv: Conventions):
    idx = vec_index(case.meta["p"], case.meta["q"], conv, case.meta.get("bias", False))
    return arr[idx]


def _vector_inputs(inputs, case, conv):
    out = dict(inputs)
    out["v"] = _kron_vector(inputs["v"], case, conv)
    return out


def _damping_split(arr, case, conv):
    if conv.damping_per_factor == "lambda":
        # [π√λ, √λ/π] with λ² in place of λ: the reference's split times √λ
        return arr * math.sqrt(case.params["damping"])
    return arr


def _damped_vector(arr, case, conv):
    if conv.damping_per_factor == "lambda":
        if arr is not case.expected:
            raise NotImplementedError("damping_per_factor='lambda' is only available for the "
                                      "expected value")
        arr = case.alternatives["_damping_lambda"]
    return _kron_vector(arr, case, conv)


def _homog_cov(arr, case, conv):
    idx = a_index(arr.shape[0], conv.bias_position, True)
    return arr[np.ix_(idx, idx)]


CAPABILITIES = [
    Capability(
        "linalg.compute_cov",
        "Uncentred covariance of rows: C = XᵀX / n, [d, d].",
        "inputs: x [n, d]",
        ("symmetrised",),
    ),
    Capability(
        "linalg.cross_cov",
        "Uncentred cross moment C = XᵀY / n, [d, e] (not symmetrised).",
        "inputs: x [n, d], y [n, e]",
    ),
    Capability(
        "linalg.homog_cov",
        "Input factor of a dense layer with bias: Ā = ĀᵀĀ / n with Ā = [a, 1] (the "
        "homogeneous coordinate in the declared bias position), [d+1, d+1].",
        "inputs: a [n, d]",
        ("bias_position",),
        convert_output=_homog_cov,
    ),
    Capability(
        "linalg.kron",
        "Dense Kronecker block K-FAC uses for a [p, q] parameter matrix: kron(A, G) in the "
        "canonical order ([p·q, p·q]).",
        "inputs: a [p, p], g [q, q]",
        ("kron_order",),
        convert_output=_kron_matrix,
    ),
    Capability(
        "linalg.kron_matvec",
        "Block times vector: vec_r(A V Gᵀ) for V [p, q] given as its (declared) vec, flat "
        "[p·q].",
        "inputs: a [p, p], g [q, q], v [p·q]",
        ("kron_order",),
        convert_inputs=_vector_inputs,
        convert_output=_kron_vector,
    ),
    Capability(
        "linalg.damped_matpower",
        "(M + λI)^p through a clipped eigendecomposition (eigenvalues clipped at 0).",
        "inputs: m [n, n]; params: exp, damping",
    ),
    Capability(
        "linalg.damped_inverse",
        "(M + λI)⁻¹ (TF's posdef_inv / Cholesky path).",
        "inputs: m [n, n]; params: damping",
    ),
    Capability(
        "linalg.pi_tracenorm",
        "π = sqrt((tr A / dim A) / (tr G / dim G)), a 0-d array; π = 1 if a trace is 0.",
        "inputs: a [p, p], g [q, q]",
    ),
    Capability(
        "linalg.pi_adjusted_damping",
        "Factored Tikhonov damping split [π√λ, √λ/π] (array [2]) for (A + π√λ I)⊗(G + √λ/π I).",
        "inputs: a [p, p], g [q, q]; params: damping",
        ("damping_per_factor",),
        convert_output=_damping_split,
    ),
    Capability(
        "linalg.factored_damped_inverse_matvec",
        "[(A + π√λ I)⁻¹ ⊗ (G + √λ/π I)⁻¹] v, trace-norm π, flat [p·q].",
        "inputs: a [p, p], g [q, q], v [p·q]; params: damping",
        ("kron_order", "damping_per_factor"),
        convert_inputs=_vector_inputs,
        convert_output=_damped_vector,
    ),
    Capability(
        "linalg.exact_damped_inverse_matvec",
        "(A ⊗ G + λI)⁻¹ v (exact damping, via both eigendecompositions), flat [p·q].",
        "inputs: a [p, p], g [q, q], v [p·q]; params: damping",
        ("kron_order",),
        convert_inputs=_vector_inputs,
        convert_output=_kron_vector,
    ),
    Capability(
        "linalg.factored_damped_matpower_matvec",
        "[(A + π√λ I)^p ⊗ (G + √λ/π I)^p] v, trace-norm π, flat [p·q].",
        "inputs: a [p, p], g [q, q], v [p·q]; params: exp, damping",
        ("kron_order", "damping_per_factor"),
        convert_inputs=_vector_inputs,
        convert_output=_damped_vector,
    ),
    Capability(
        "linalg.factor_norm",
        "Scale of a PSD factor normalised so that ‖I‖ = 1 (avg_diag = tr/n, avg_fro = "
        "‖·‖_F/√n, 2_norm, 1_norm), a 0-d array.",
        "inputs: m [n, n]; params: norm_type",
    ),
]


def _operator(fn, n):
    """The linear map ``v ↦ fn(v)`` as an [n, n] matrix (canonical layout), stored as the
    conversion data ``_operator``: the diagnosis applies it in another Kronecker order's
    layout to the vector an implementation was handed (code written for the other order)."""
    return np.stack([to_np(fn(e)) for e in np.eye(n)], axis=1)


def _case(cid, cap, inputs, params, expected, tol, meta=None, alts=None, desc=""):
    return Case(cid, cap, inputs, params, to_np(expected), tol, dict(meta or {}),
                {k: to_np(v) for k, v in (alts or {}).items()}, desc)


def build_cases() -> list[Case]:
    import kfac_ref.linalg as L

    cases = []

    # covariances ------------------------------------------------------------------------
    for n, d in ((7, 4), (3, 6)):
        cid = f"linalg.compute_cov/n{n}_d{d}"
        x = rng_for(cid).standard_normal((n, d))
        cases.append(_case(
            cid, "linalg.compute_cov", {"x": x}, {}, L.compute_cov(x),
            Tolerance(SAFETY * n, f"length-{n} dot products: work = n = {n}, κ = 1"),
            {"N": n}, desc="rank-deficient" if n < d else ""))
    cid = "linalg.cross_cov/n6_d4"
    r = rng_for(cid)
    x, y = r.standard_normal((6, 4)), r.standard_normal((6, 4))
    c = L.compute_cov(x, y)
    cases.append(_case(
        cid, "linalg.cross_cov", {"x": x, "y": y}, {}, c,
        Tolerance(SAFETY * 6, "length-6 dot products: work = 6, κ = 1"),
        {"N": 6}, {"symmetrised": (to_np(c) + to_np(c).T) / 2, "transposed": to_np(c).T}))
    for n, d in ((5, 3), (2, 4)):
        cid = f"linalg.homog_cov/n{n}_d{d}"
        a = rng_for(cid).standard_normal((n, d))
        cases.append(_case(
            cid, "linalg.homog_cov", {"a": a}, {}, L.compute_cov(L.append_homog(a)),
            Tolerance(SAFETY * n, f"length-{n} dot products: work = {n}, κ = 1"),
            {"N": n, "p": d + 1, "bias": True}))

    # Kronecker products and vec conventions -------------------------------------------
    for p, q in ((3, 2), (4, 3)):
        cid = f"linalg.kron/p{p}_q{q}"
        r = rng_for(cid)
        a, g = spd(r, p), spd(r, q)
        cases.append(_case(cid, "linalg.kron", {"a": a, "g": g}, {}, L.kron(a, g),
                           Tolerance(SAFETY, "one product per entry: work = 1, κ = 1"),
                           {"p": p, "q": q}))
        cid = f"linalg.kron_matvec/p{p}_q{q}"
        r = rng_for(cid)
        a, g, v = spd(r, p), spd(r, q), r.standard_normal(p * q)
        cases.append(_case(cid, "linalg.kron_matvec", {"a": a, "g": g, "v": v}, {},
                           L.kron_matvec(a, g, v),
                           Tolerance(SAFETY * (p + q),
                                     f"two GEMMs of lengths p, q: work = {p + q}, κ = 1"),
                           {"p": p, "q": q},
                           {"kron_order_swapped": L.kron_matvec(g, a, v),
                            "_operator": _operator(lambda e, a=a, g=g: L.kron_matvec(a, g, e),
                                                   p * q)}))

    # damped matrix functions ------------------------------------------------------------
    n = 5
    for exp, lam, kind in ((-1.0, 0.1, "spd"), (-0.5, 0.1, "spd"), (0.5, 0.0, "spd"),
                           (2.0, 0.3, "spd"), (-1.0, 0.05, "psd_rank2"),
                           (-0.5, 0.05, "psd_rank2")):
        cid = f"linalg.damped_matpower/{kind}_exp{exp:g}_damping{lam:g}"
        r = rng_for(cid)
        m = spd(r, n) if kind == "spd" else psd(r, n, 2)
        kappa = cond(m + lam * np.eye(n)) if kind == "spd" or lam > 0 else 1.0
        budget = SAFETY * n * kappa * max(1.0, abs(exp))
        cases.append(_case(
            cid, "linalg.damped_matpower", {"m": m}, {"exp": exp, "damping": lam},
            L.damped_matpower(m, exp, lam),
            Tolerance(budget, f"eigh of n = {n}: work = {n}, κ = cond(M + λI) = {kappa:.3g}, "
                              f"× |p| = {abs(exp):g}"),
            {"n": n}, desc="rank-deficient PSD: eigenvalue clipping matters"
            if kind != "spd" else ""))
    for lam in (0.0, 0.2):
        cid = f"linalg.damped_inverse/spd_damping{lam:g}"
        m = spd(rng_for(cid), n)
        kappa = cond(m + lam * np.eye(n))
        cases.append(_case(
            cid, "linalg.damped_inverse", {"m": m}, {"damping": lam},
            L.damped_inverse(m, lam),
            Tolerance(SAFETY * n * kappa, f"Cholesky/solve of n = {n}: work = {n}, "
                                          f"κ = {kappa:.3g}"), {"n": n}))

    # π and the damping split -----------------------------------------------------------
    p, q = 4, 2
    for scale_a, scale_g in ((10.0, 0.1), (1.0, 1.0)):
        cid = f"linalg.pi_tracenorm/p{p}_q{q}_scales{scale_a:g}_{scale_g:g}"
        r = rng_for(cid)
        a, g = spd(r, p, scale=scale_a), spd(r, q, scale=scale_g)
        pi = L.pi_tracenorm(a, g)
        cases.append(_case(
            cid, "linalg.pi_tracenorm", {"a": a, "g": g}, {}, pi,
            Tolerance(SAFETY * (p + q), f"two traces: work = p + q = {p + q}, κ = 1"),
            {"p": p, "q": q},
            {"pi_without_dimensions": pi * math.sqrt(p / q), "pi_squared": pi ** 2}))
    for lam in (0.1, 1e-3):
        cid = f"linalg.pi_adjusted_damping/p{p}_q{q}_damping{lam:g}"
        r = rng_for(cid)
        a, g = spd(r, p, scale=10.0), spd(r, q, scale=0.1)
        da, dg = L.pi_adjusted_damping(a, g, lam)
        pi = L.pi_tracenorm(a, g)
        pi_nd = pi * math.sqrt(p / q)
        root = math.sqrt(lam)
        cases.append(_case(
            cid, "linalg.pi_adjusted_damping", {"a": a, "g": g}, {"damping": lam},
            np.array([da, dg]),
            Tolerance(SAFETY * (p + q), f"two traces under a square root: work = {p + q}"),
            {"p": p, "q": q},
            {"pi_without_dimensions": [pi_nd * root, root / pi_nd],
             "unsplit_damping": [lam, lam], "pi_off": [root, root]}))

    # damped Kronecker inverses and powers -----------------------------------------------
    for p, q, lam in ((3, 2, 0.1), (4, 3, 0.01)):
        r = rng_for(f"linalg.damped_kron/p{p}_q{q}_damping{lam:g}")
        a, g = spd(r, p, scale=10.0), spd(r, q, scale=0.1)
        v = r.standard_normal(p * q)
        pi = L.pi_tracenorm(a, g)
        root = math.sqrt(lam)

        def split(da, dg, exp=-1.0, a=a, g=g, v=v):
            return L.kron_matvec(L.damped_matpower(a, exp, da), L.damped_matpower(g, exp, dg), v)

        pi_nd = pi * math.sqrt(p / q)
        exact = L.kron_damped_inverse_matvec(a, g, v, lam, damping_method="exact")
        fact = L.kron_damped_inverse_matvec(a, g, v, lam, damping_method="factored")
        k_fact = cond(a + pi * root * np.eye(p)) * cond(g + root / pi * np.eye(q))
        k_exact = cond(np.kron(a, g) + lam * np.eye(p * q))
        meta = {"p": p, "q": q}

        def inverse(method, a=a, g=g, lam=lam):
            return lambda e: L.kron_damped_inverse_matvec(a, g, e, lam, damping_method=method)

        # (method, expected, κ and what it is, the work, alternatives the diagnosis tries)
        for method, expected, kappa, kappa_is, work, alternatives in (
                ("factored", fact, k_fact, "product of the damped factors' condition numbers",
                 "two damped inverses and GEMMs",
                 {"pi_without_dimensions": split(pi_nd * root, root / pi_nd),
                  "unsplit_damping": split(lam, lam), "pi_off": split(root, root),
                  "exact_damping": exact,
                  "_damping_lambda": L.kron_damped_inverse_matvec(
                      a, g, v, lam ** 2, damping_method="factored")}),
                ("exact", exact, k_exact, "cond(A⊗G + λI)", "eigh of both factors and GEMMs",
                 {"factored_damping": fact, "unsplit_damping": split(lam, lam)})):
            name = f"linalg.{method}_damped_inverse_matvec"
            cases.append(_case(
                f"{name}/p{p}_q{q}_damping{lam:g}", name, {"a": a, "g": g, "v": v},
                {"damping": lam}, expected,
                Tolerance(SAFETY * (p + q) * kappa,
                          f"{work}: work = {p + q}, κ = {kappa_is} = {kappa:.3g}"), meta,
                {**alternatives, "_operator": _operator(inverse(method), p * q)}))
        exp = -0.5
        powv = L.kron_damped_matpower_matvec(a, g, v, exp, lam, damping_method="factored")
        cases.append(_case(
            f"linalg.factored_damped_matpower_matvec/p{p}_q{q}_exp-0.5_damping{lam:g}",
            "linalg.factored_damped_matpower_matvec", {"a": a, "g": g, "v": v},
            {"exp": exp, "damping": lam}, powv,
            Tolerance(SAFETY * (p + q) * k_fact,
                      f"two damped powers and GEMMs: work = {p + q}, κ = {k_fact:.3g}"), meta,
            {"pi_without_dimensions": split(pi_nd * root, root / pi_nd, exp),
             "unsplit_damping": split(lam, lam, exp), "pi_off": split(root, root, exp),
             "_damping_lambda": L.kron_damped_matpower_matvec(a, g, v, exp, lam ** 2,
                                                              damping_method="factored"),
             "_operator": _operator(
                 lambda e, a=a, g=g, exp=exp, lam=lam: L.kron_damped_matpower_matvec(
                     a, g, e, exp, lam, damping_method="factored"), p * q)}))

    # factor norms ---------------------------------------------------------------------
    m = spd(rng_for("linalg.factor_norm"), 4)
    for norm in L.FACTOR_NORMS:
        cases.append(_case(
            f"linalg.factor_norm/{norm}", "linalg.factor_norm", {"m": m}, {"norm_type": norm},
            L.factor_norm(m, norm),
            Tolerance(SAFETY * 4 * cond(m), f"norm of a 4×4 matrix: work = 4, κ = {cond(m):.3g}"
                      " (the 2-norm goes through eigvalsh)"), {"n": 4}))
    return cases
