"""Curvature-block capabilities: powers of damped Kronecker-factored, diagonal and series
(RNN) blocks (TF K-FAC fisher_blocks, kfac-jax curvature blocks).

A Kronecker block is ``s·(A ⊗ G)`` acting on the row-major flattening of the parameter
matrix ``X`` [p, q] (p = input side, bias row last); ``s`` is the block scale (|T| for KFC
convolutions, T for layers used T times) and the damping λ is added to the *scaled* block, so
factored damping splits λ/s with π.  Inputs and outputs are parameter-shaped matrices (for
kron_order GA the suite hands over and expects Xᵀ [q, p]).

Tolerance derivation: eigendecompositions/solves of both factors and GEMMs: work = p + q,
κ = condition number of the damped block (for power p: times max(1, |p|)); the undamped
power 1 has κ = 1.  Series blocks: work = p + q, κ = product of the damped C₀ condition
numbers and 1/(1 − max|ψ|) bounds (taken from the data, times 4).
"""

from __future__ import annotations

import math

import numpy as np

from ..conventions import a_index
from ..model import SAFETY, Capability, Case, Tolerance, rng_for
from ._data import cond, spd, to_np

REQUIRES = ("kfac_ref.blocks", "kfac_ref.factors")


def _rows(case, conv):
    # parameter-shaped [p, q] arrays keep a *separate* bias as their last row
    pos = "last" if conv.bias_position == "separate" else conv.bias_position
    return a_index(case.meta["p"], pos, case.meta.get("bias", False))


def _param_matrix(arr, case, conv):
    out = arr[_rows(case, conv), :]
    return out.T if conv.kron_order == "GA" else out


def _block_output(arr, case, conv):
    if conv.bias_position == "separate" and "bias_separate" in case.alternatives:
        # a separate bias block drops the weight-bias cross terms of A (another approximation)
        arr = case.alternatives["bias_separate"]
    return _param_matrix(arr, case, conv)


def _x_input(inputs, case, conv):
    out = dict(inputs)
    out["x"] = _param_matrix(inputs["x"], case, conv)
    return out


def _a_input(inputs, case, conv, names=("a",)):
    out = _x_input(inputs, case, conv)
    idx = _rows(case, conv)
    for n in names:
        if n in out and out[n].ndim == 2:
            out[n] = out[n][np.ix_(idx, idx)]
    return out


def _series_input(inputs, case, conv):
    return _a_input(inputs, case, conv, ("a_cov", "a_cov_dt1"))


def _diag_input(inputs, case, conv):
    out = _x_input(inputs, case, conv)
    out["diagonal"] = _param_matrix(inputs["diagonal"], case, conv)
    return out


_SIG = "inputs: a [p, p], g [q, q], x [p, q]; params: power, damping, scale, exact, norm_type"

def _cache_input(inputs, case, conv):
    return _a_input(inputs, case, conv, names=("a0", "a1"))


CAPABILITIES = [
    Capability(
        "blocks.kron_matpower",
        "(s·(A⊗G) + λI)^power applied to X [p, q]: exact=True through both eigenbases, "
        "exact=False with factored π damping of λ/s (norm_type 'avg_diag' = trace norm, 'off' "
        "= π 1); returns [p, q].", _SIG,
        ("kron_order", "bias_position"), convert_inputs=_a_input,
        convert_output=_block_output),
    Capability(
        "blocks.kron_eigenvalues",
        "Eigenvalues of the undamped block s·(A⊗G), sorted ascending, [p·q].",
        "inputs: a [p, p], g [q, q]; params: scale"),
    Capability(
        "blocks.diagonal_matpower",
        "(s·D + λ)^power ∘ X for a diagonal block D given in parameter shape [p, q].",
        "inputs: diagonal [p, q], x [p, q]; params: power, damping, scale",
        ("kron_order", "bias_position"), convert_inputs=_diag_input,
        convert_output=_param_matrix),
    Capability(
        "blocks.series_inverse",
        "Inverse of TF's FullyConnectedSeriesFB (a dense layer used T times) applied to X "
        "[p, q]: option 1 (finite T, symmetrised C₁, TF's posdef_eig |ψ|) or option 2 (T → ∞); "
        "damping λ/T split with π from C₀.",
        "inputs: a_cov, a_cov_dt1 [p, p], g_cov, g_cov_dt1 [q, q], x [p, q]; params: "
        "num_timesteps, damping, option, has_bias",
        ("kron_order", "bias_position"), convert_inputs=_series_input,
        convert_output=_param_matrix),
    Capability(
        "blocks.kron_cached_inverse",
        "Cache semantics of a Kronecker block (kfac-jax KroneckerFactored): statistics "
        "A₀, G₀, update_cache(identity weight λ_c), a further update with statistics A₁, G₁ "
        "(ema_old = decay, ema_new = 1), then the cached inverse product at identity weight λ "
        "applied to X [p, q] (no bias).  kfac-jax's cached product is stale by design: "
        "exact=False uses the factored π-damped inverses built at update_cache, "
        "[(A₀ + π₀√λ_c I)⁻¹ ⊗ (G₀ + √λ_c/π₀ I)⁻¹] x (λ ignored); exact=True the cached "
        "eigenbases of A₀, G₀ with the current λ, (A₀⊗G₀ + λI)⁻¹ x; returns [p, q].",
        "inputs: a0, a1 [p, p], g0, g1 [q, q], x [p, q]; params: decay, damping_cached, "
        "damping, exact",
        ("kron_order",), convert_inputs=_cache_input, convert_output=_param_matrix),
]


def cached_inverse_ref(a0, g0, a1, g1, x, params, fresh=False, current_damping=False):
    """The kfac-jax cached inverse product (functional form, kfac_ref); ``fresh``: computed
    from the current (averaged) statistics instead (the pitfall), ``current_damping``: the
    stale factors with the current weight."""
    from kfac_ref import blocks as B

    d = params["decay"]
    if fresh:
        a, g, lam = (d * a0 + a1) / (d + 1.0), (d * g0 + g1) / (d + 1.0), params["damping"]
    else:
        a, g = a0, g0
        lam = params["damping"] if (params["exact"] or current_damping) else \
            params["damping_cached"]
    return to_np(B.kronecker_block_matpower(a, g, x, -1.0, lam, exact=params["exact"]))


def cached_inverse_block(inputs, params, to_backend=lambda v: v, to_numpy=to_np):
    """The same through kfac_ref's stateful kfac-jax block (init, update, update_cache,
    update, cached multiply_matpower; strict_cache=False = kfac-jax's cached weight).  The
    statistics are fed as rows R with RᵀR/n equal to the given factor."""
    from kfac_ref.blocks import kfac_jax as kj

    a0, g0 = np.asarray(inputs["a0"]), np.asarray(inputs["g0"])
    p, q = a0.shape[0], g0.shape[0]
    n = max(p, q)

    def rows(m):
        out = np.zeros((n, m.shape[0]))
        out[:m.shape[0]] = math.sqrt(n) * np.linalg.cholesky(m).T
        return out

    def data(a, g):
        return {"inputs": to_backend(rows(np.asarray(a))),
                "outputs_grad": to_backend(rows(np.asarray(g)))}

    block = kj.DenseTwoKroneckerFactored(p, q, has_bias=False, strict_cache=False)
    st = block.init(to_backend(np.zeros(1)), exact_powers_to_cache=[-1.0],
                    approx_powers_to_cache=[-1.0])
    st = block.update_curvature_matrix_estimate(st, data(a0, g0), 0.0, 1.0, n)
    st = block.update_cache(st, params["damping_cached"], [-1.0], [-1.0], False)
    st = block.update_curvature_matrix_estimate(st, data(inputs["a1"], inputs["g1"]),
                                                params["decay"], 1.0, n)
    (y,) = block.multiply_matpower(st, (to_backend(np.asarray(inputs["x"])),),
                                   params["damping"], -1.0, params["exact"], True)
    return to_numpy(y)


def series_apply(fb, x, to_backend=lambda v: v, to_numpy=to_np):
    """FullyConnectedSeriesFB⁻¹ on a [d_in + 1, d_out] matrix (TF's (kernel, bias) pair)."""
    x = np.asarray(x)
    kernel, bias = fb.multiply_matpower((to_backend(x[:-1]), to_backend(x[-1])), -1.0)
    return np.concatenate([to_numpy(kernel), to_numpy(bias)[None, :]], axis=0)


def build_cases() -> list[Case]:
    from kfac_ref import blocks as B
    from kfac_ref import factors as F
    from kfac_ref import linalg as L
    from kfac_ref.blocks.tf import FullyConnectedSeriesFB

    cases = []
    p, q = 4, 3  # p = d_in + 1 (bias last)
    configs = [  # power, damping, scale, exact
        (-1.0, 0.1, 1.0, False), (-1.0, 0.1, 1.0, True), (-1.0, 0.3, 6.0, False),
        (-1.0, 0.3, 6.0, True), (-0.5, 0.05, 6.0, False), (1.0, 0.0, 6.0, False),
        (1.0, 0.2, 1.0, True), (2.0, 0.1, 1.0, True),
    ]
    for power, lam, s, exact in configs:
        cid = (f"blocks.kron_matpower/p{power:g}_damping{lam:g}_scale{s:g}_"
               f"{'exact' if exact else 'factored'}")
        r = rng_for(cid)
        a, g = spd(r, p, scale=5.0), spd(r, q, scale=0.2)
        x = r.standard_normal((p, q))

        def run(a=a, g=g, x=x, power=power, lam=lam, s=s, exact=exact, **kw):
            args = dict(scale=s, exact=exact)
            args.update(kw)
            return to_np(B.kronecker_block_matpower(a, g, x, power, lam, **args))

        expected = run()
        alts = {"exact_damping" if not exact else "factored_damping":
                run(exact=not exact)} if lam > 0 else {}
        a_sep = a.copy()
        a_sep[:-1, -1] = a_sep[-1, :-1] = 0.0
        alts["bias_separate"] = run(a=a_sep)
        alts["missing_block_scale"] = run(s=1.0)  # equal to expected when s = 1
        alts["damping_not_normalised"] = run(lam=lam * s)
        if not exact and lam > 0:
            alts["pi_off"] = run(norm_type="off")
            # π without dimensions and unsplit damping, from the reference's damped powers
            pi = L.pi_tracenorm(a, g)
            pi_nd, root = pi * math.sqrt(p / q), math.sqrt(lam / s)

            def split(da, dg, a=a, g=g, x=x, power=power, s=s):
                return s ** power * to_np(L.damped_matpower(a, power, da)) @ x @ to_np(
                    L.damped_matpower(g, power, dg))

            alts["pi_without_dimensions"] = split(pi_nd * root, root / pi_nd)
            alts["unsplit_damping"] = split(lam, lam)
            if s != 1.0:  # both faults at once, common in hand-written conv K-FAC
                full = math.sqrt(lam)
                alts["pi_without_dimensions+damping_not_normalised"] = split(
                    pi_nd * full, full / pi_nd)
        if power == 1.0 and lam == 0.0:
            kappa = 1.0
        else:
            kappa = cond(np.kron(a, g) * s + lam * np.eye(p * q))
        tol = Tolerance(SAFETY * (p + q) * kappa * max(1.0, abs(power)),
                        f"eigh/solves of the factors and GEMMs: work = {p + q}, κ = cond(sA⊗G"
                        f" + λI) = {kappa:.3g}, × max(1, |power|)")
        cases.append(Case(cid, "blocks.kron_matpower", {"a": a, "g": g, "x": x},
                          {"power": power, "damping": lam, "scale": s, "exact": exact,
                           "norm_type": "avg_diag"},
                          expected, tol, {"p": p, "q": q, "bias": True,
                                          **({"T": int(s)} if s != 1.0 else {})}, alts,
                          "scale 6 = |T| of a conv layer" if s != 1.0 else ""))

    cid = "blocks.kron_eigenvalues/p4_q3_scale6"
    r = rng_for(cid)
    a, g = spd(r, p), spd(r, q)
    ev = np.sort(to_np(B.kronecker_block_eigenvalues(a, g, scale=6.0)))
    cases.append(Case(cid, "blocks.kron_eigenvalues", {"a": a, "g": g}, {"scale": 6.0}, ev,
                      Tolerance(SAFETY * (p + q) * cond(a) * cond(g),
                                f"eigh of both factors: work = {p + q}, κ = cond(A)·cond(G)"),
                      {"T": 6}, {"missing_block_scale": ev / 6.0}))

    for power, lam, s in ((-1.0, 0.1, 1.0), (-0.5, 0.2, 6.0)):
        cid = f"blocks.diagonal_matpower/p{power:g}_damping{lam:g}_scale{s:g}"
        r = rng_for(cid)
        d, x = r.uniform(0.1, 2.0, size=(p, q)), r.standard_normal((p, q))
        cases.append(Case(cid, "blocks.diagonal_matpower", {"diagonal": d, "x": x},
                          {"power": power, "damping": lam, "scale": s},
                          to_np(B.diagonal_block_matpower(d, x, power, lam, scale=s)),
                          Tolerance(SAFETY * max(1.0, abs(power)), "elementwise power: work "
                                    "= 1, × |power|"),
                          {"p": p, "q": q, "bias": True, **({"T": int(s)} if s != 1 else {})},
                          {"missing_block_scale": to_np(B.diagonal_block_matpower(
                              d, x, power, lam, scale=1.0))}))

    # series (RNN) blocks: statistics of a layer used T = 3 times on B = 4 sequences
    t, nb, d_in, d_out = 3, 4, 2, 2
    for option in (1, 2):
        cid = f"blocks.series_inverse/option{option}_t{t}"
        r = rng_for(cid)
        # sequences that flip sign each step (plus noise): C₁ is far from zero and
        # indefinite, so option 1's |ψ| (TF posdef_eig) differs from the signed ψ
        sign = np.array([1.0, -1.0, 1.0])[:, None, None]
        xa = sign * r.standard_normal((1, nb, d_in)) + 0.3 * r.standard_normal((t, nb, d_in))
        xg = sign * r.standard_normal((1, nb, d_out)) + 0.3 * r.standard_normal((t, nb, d_out))
        a0 = to_np(F.fully_connected_kronecker_factor(xa, has_bias=True))
        a1 = to_np(F.fully_connected_multi_kf_cov_dt1(xa, t, has_bias=True))
        g0 = to_np(F.fully_connected_kronecker_factor(xg))
        g1 = to_np(F.fully_connected_multi_kf_cov_dt1(xg, t))
        x = r.standard_normal((d_in + 1, d_out))
        lam = 0.1
        fb = FullyConnectedSeriesFB(a0, g0, lam, t, has_bias=True, option=option,
                                    input_cov_dt1=a1, output_cov_dt1=g1)
        expected = series_apply(fb, x)
        alts = {}
        if True:  # option 2 does not use the eigenvalue method: finalize() marks it insensitive
            fb_signed = FullyConnectedSeriesFB(a0, g0, lam, t, has_bias=True, option=option,
                                               input_cov_dt1=a1, output_cov_dt1=g1,
                                               option1_eig_method="eigh")
            alts["signed_eigenvalues"] = series_apply(fb_signed, x)
        kappa = cond(a0 + lam * np.eye(d_in + 1)) * cond(g0 + lam * np.eye(d_out))
        cases.append(Case(
            cid, "blocks.series_inverse",
            {"a_cov": a0, "a_cov_dt1": a1, "g_cov": g0, "g_cov_dt1": g1, "x": x},
            {"num_timesteps": t, "damping": lam, "option": option, "has_bias": True},
            expected, Tolerance(SAFETY * 4 * (d_in + 1 + d_out) * kappa,
                                f"eigh/SVD of damped C₀, C₁ per factor: work = "
                                f"{d_in + 1 + d_out}, κ ≈ 4·{kappa:.3g}"),
            {"p": d_in + 1, "q": d_out, "bias": True, "N": nb}, alts,
            "TF FullyConnectedSeriesFB option " + str(option)))

    # cache semantics: a cached product after a further update (kfac-jax: stale by design)
    pc, qc = 3, 2
    for exact in (False, True):
        cid = f"blocks.kron_cached_inverse/p{pc}_q{qc}_{'exact' if exact else 'factored'}"
        r = rng_for(cid)
        ins = {"a0": spd(r, pc, scale=2.0), "g0": spd(r, qc, scale=0.5),
               "a1": spd(r, pc, scale=6.0), "g1": spd(r, qc, scale=0.1),
               "x": r.standard_normal((pc, qc))}
        prm = {"decay": 0.5, "damping_cached": 0.3, "damping": 0.05, "exact": exact}
        args = [ins[k] for k in ("a0", "g0", "a1", "g1", "x")]
        expected = cached_inverse_ref(*args, prm)
        alts = {"fresh_instead_of_cached": cached_inverse_ref(*args, prm, fresh=True)}
        if not exact:
            alts["current_damping_in_cache"] = cached_inverse_ref(*args, prm,
                                                                  current_damping=True)
        kappa = max(cond(np.kron(ins["a0"], ins["g0"]) + lam * np.eye(pc * qc))
                    for lam in (prm["damping"], prm["damping_cached"]))
        cases.append(Case(
            cid, "blocks.kron_cached_inverse", ins, prm, expected,
            Tolerance(SAFETY * 2 * (pc + qc) * kappa,
                      f"eigh/solves of the cached factors and GEMMs: work = {pc + qc}, κ = "
                      f"cond(A₀⊗G₀ + λI) = {kappa:.3g}, ×2 for the factors built from rows"),
            {"p": pc, "q": qc, "bias": False}, alts,
            "kfac-jax: cached products use the inverse (or eigenbases) of the last "
            "update_cache"))
    return cases
