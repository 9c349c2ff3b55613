r"""Laplace-evidence capabilities: the log marginal likelihood of a Laplace approximation with
a Kronecker-factored, EKFAC, diagonal or full curvature, and its gradient in the prior
precision (MacKay 1992; Immer et al. 2021, eq. 4; Daxberger et al. 2021, laplace-torch).

The formula.  Parameters in groups g (one tensor each, n_g entries θ_g), prior N(μ, P₀⁻¹)
with P₀ = diag(δ_g I), log-likelihood ℓ = log p(D | θ) at the mode, temperature T, curvature
H_g of the negative log-likelihood *summed* over the data:

    log p(D) ≈ ℓ/T − ½ Σ_g [ δ_g ‖θ_g − μ_g‖² + Σ_k log λ_{g,k} − n_g log δ_g ],

λ_{g,k} the eigenvalues of the group's posterior precision, by structure (s = 1/T):

* ``kron`` (A_g ⊗ G_g, or a full block H_g): λ_ij = s·a_i·γ_j + δ_g  (sH + P₀ exactly);
* ``kron_factored`` (the same inputs): λ_ij = (√s·a_i + √δ_g)(√s·γ_j + √δ_g), the factored
  posterior (√s A + √δ I) ⊗ (√s G + √δ I) of Ritter, Botev & Barber (2018), eq. 7, with the
  factors used exactly as given (a full block H_g: s·h_k + δ_g);
* ``ekfac`` ((Q_A, Q_G, S), H_g = (Q_A ⊗ Q_G) diag(vec S) (Q_A ⊗ Q_G)ᵀ): λ = s·S_ij + δ_g;
* ``diagonal`` (d_g): λ_k = s·d_k + δ_g;
* ``full`` (H_g, n_g × n_g): λ_k = s·spec(H_g)_k + δ_g.

``laplace.prior_precision_grad`` is ∂ log p(D)/∂δ_g with θ held at the mode:

    −½ [ ‖θ_g − μ_g‖² + Σ_k (∂λ_{g,k}/∂δ_g)/λ_{g,k} − n_g/δ_g ],

an array [n_groups] for a per-group prior precision and the sum over the groups (0-d) for a
shared one.  Both are :func:`kfac_ref.laplace.laplace_log_marginal_likelihood` and
:func:`kfac_ref.laplace.laplace_log_marginal_likelihood_grad`; the docs page *Theory →
Laplace evidence* derives them.

The adapter contract.  ``params``: ``structure`` (one of the five above), ``n_groups`` (int),
``log_likelihood`` (ℓ, a float: the whole log-likelihood, normaliser included — the
implementation divides it by T as a whole), ``temperature`` (T > 0).  ``inputs`` (float64),
for g = 0 … n_groups − 1:

* ``theta_{g}`` [n_g] — the mode's parameters of group g, flat; ``mu_{g}`` [n_g] — the prior
  mean (the evidence depends on θ_g − μ_g only through its norm, so the order of the entries
  need not match any vectorisation of the curvature);
* ``prior_precision`` — [] (one δ shared by all groups) or [n_groups] (one per group);
* the curvature of group g: ``kron``/``kron_factored``: ``A_{g}`` [p, p] and ``G_{g}``
  [q, q] (p·q = n_g), or ``H_{g}`` [n_g, n_g] for a group that is one full block (a bias);
  ``ekfac``: ``QA_{g}`` [p, p], ``QG_{g}`` [q, q] (orthogonal) and ``S_{g}`` [p, q];
  ``diagonal``: ``d_{g}`` [n_g]; ``full``: ``H_{g}`` [n_g, n_g].

The adapter returns the evidence as a 0-d array, or the gradient in the shape of
``prior_precision``.

Alternatives (what a known mistake gives, computed with kfac_ref):
``log_likelihood_untempered`` (ℓ instead of ℓ/T), ``curvature_untempered`` (P = H + P₀, the
1/T left off the curvature), and for the Kronecker structures the other posterior:
``factored_instead_of_exact`` for ``kron`` and ``exact_instead_of_factored`` for
``kron_factored`` (the damping of the factored posterior dropped).

Tolerances.  Let κ_g = cond(P_g) (the group's posterior precision, formed densely on the
host) and M the sum of the magnitudes of the evidence's terms, |ℓ/T| + ½ Σ_g (δ_g‖θ_g − μ_g‖²
+ Σ_k |log λ_{g,k}| + n_g |log δ_g|), at least 1.  A backward-stable eigensolver moves each
eigenvalue of P_g by ≲ n_g·eps·‖P_g‖, i.e. log λ by ≲ n_g·κ_g·eps, so the log-determinants
carry ≲ Σ_g n_g²κ_g·eps and the sums over the n = Σ n_g terms n·eps·M: budget = SAFETY·(n +
Σ_g n_g²κ_g) with the floor scale = M (cancellation between ℓ/T and the penalty is bounded by
the terms' magnitudes, not by the result).  The gradient's terms 1/λ_{g,k} have relative
error ≲ n_g κ_g eps, so with scale = ½ Σ_g (‖θ_g − μ_g‖² + Σ_k |∂λ/∂δ|/λ + n_g/δ_g):
budget = SAFETY·(n + max_g n_g κ_g).
"""

from __future__ import annotations

import numpy as np

from ..model import SAFETY, Capability, Case, Tolerance, rng_for
from ._data import cond, spd

REQUIRES = ("kfac_ref.laplace",)

STRUCTURES = ("kron", "kron_factored", "ekfac", "diagonal", "full")

_SIGNATURE = ("inputs: theta_{g} [n_g], mu_{g} [n_g], prior_precision [] or [n_groups], "
              "the structure's curvature per group (kron, kron_factored: A_{g} [p, p] and "
              "G_{g} [q, q], or H_{g} [n_g, n_g]; ekfac: QA_{g}, QG_{g}, S_{g} [p, q]; "
              "diagonal: d_{g} [n_g]; full: H_{g} [n_g, n_g]); params: structure, n_groups, "
              "log_likelihood, temperature")

CAPABILITIES = [
    Capability(
        "laplace.log_marginal_likelihood",
        "Laplace evidence ℓ/T − ½ Σ_g [δ_g‖θ_g − μ_g‖² + log det P_g − n_g log δ_g], a 0-d "
        "array; P_g = H_g/T + δ_g I by params['structure'] (kron: spec = a_iγ_j/T + δ; "
        "kron_factored: (a_i/√T + √δ)(γ_j/√T + √δ); ekfac: S/T + δ; diagonal; full), H the "
        "curvature of the summed negative log-likelihood, ℓ tempered as a whole.",
        _SIGNATURE,
    ),
    Capability(
        "laplace.prior_precision_grad",
        "Gradient of laplace.log_marginal_likelihood in the prior precision at a fixed mode, "
        "−½[‖θ_g − μ_g‖² + Σ_k (∂λ_{g,k}/∂δ_g)/λ_{g,k} − n_g/δ_g]: [n_groups] for a "
        "per-group prior precision, the sum over the groups (0-d) for a shared one.",
        _SIGNATURE,
    ),
]

#: the groups of every case: a dense layer's weight (p = 3 inputs, q = 4 outputs), its bias
#: (one full block, as laplace-torch's bias blocks) and a second weight (p = 4, q = 2)
_GROUPS = (("kron", 3, 4), ("block", 1, 4), ("kron", 4, 2))

#: (variant, prior precision, temperature, random prior mean)
_VARIANTS = (
    ("shared_T1", 0.7, 1.0, False),
    ("per_group_T0.5", (0.3, 1.1, 2.0), 0.5, True),
    ("shared_T2", 1.3, 2.0, True),
)


def _inputs(rng, structure, prior, mean):
    """Host inputs of one case and the kfac_ref curvature list built from them."""
    inputs, curvature = {}, []
    for g, (kind, p, q) in enumerate(_GROUPS):
        n = p * q
        inputs[f"theta_{g}"] = rng.standard_normal(n)
        inputs[f"mu_{g}"] = 0.3 * rng.standard_normal(n) if mean else np.zeros(n)
        # curvature of a summed loss over ~8 examples: eigenvalues O(1)–O(10)
        if structure in ("kron", "kron_factored") and kind == "kron":
            a, gg = spd(rng, p, 0.2, 3.0), spd(rng, q, 0.5, 4.0, scale=2.0)
            inputs[f"A_{g}"], inputs[f"G_{g}"] = a, gg
            curvature.append((a, gg))
        elif structure == "ekfac":
            qa = np.linalg.qr(rng.standard_normal((p, p)))[0]
            qg = np.linalg.qr(rng.standard_normal((q, q)))[0]
            s = rng.uniform(0.0, 8.0, size=(p, q))
            inputs[f"QA_{g}"], inputs[f"QG_{g}"], inputs[f"S_{g}"] = qa, qg, s
            curvature.append((qa, qg, s))
        elif structure == "diagonal":
            d = rng.uniform(0.0, 8.0, size=n)
            inputs[f"d_{g}"] = d
            curvature.append(d)
        else:  # full, or a Kronecker structure's full block
            h = spd(rng, n, 0.1, 8.0)
            inputs[f"H_{g}"] = h
            curvature.append(h)
    inputs["prior_precision"] = np.asarray(prior, dtype=np.float64)
    return inputs, curvature


def curvature_from_inputs(structure, inputs, n_groups):
    """The kfac_ref ``curvature`` list of a case's inputs (see the module docstring)."""
    out = []
    for g in range(n_groups):
        if structure == "ekfac":
            out.append((inputs[f"QA_{g}"], inputs[f"QG_{g}"], inputs[f"S_{g}"]))
        elif structure == "diagonal":
            out.append(inputs[f"d_{g}"])
        elif f"A_{g}" in inputs:
            out.append((inputs[f"A_{g}"], inputs[f"G_{g}"]))
        else:
            out.append(inputs[f"H_{g}"])
    return out


def _dense_precisions(structure, curvature, deltas, t):
    """Each group's posterior precision formed densely on the host (for κ_g only)."""
    s, out = 1.0 / t, []
    for block, d in zip(curvature, deltas, strict=True):
        if structure == "ekfac":
            qa, qg, sc = block
            q = np.kron(qa, qg)
            h = (q * sc.reshape(-1)) @ q.T
        elif structure == "diagonal":
            h = np.diag(block)
        elif isinstance(block, tuple):
            a, g = block
            if structure == "kron_factored":
                ra, rg = np.sqrt(s) * a, np.sqrt(s) * g
                out.append(np.kron(ra + np.sqrt(d) * np.eye(len(a)),
                                   rg + np.sqrt(d) * np.eye(len(g))))
                continue
            h = np.kron(a, g)
        else:
            h = block
        out.append(s * h + d * np.eye(len(h)))
    return out


def build_cases() -> list[Case]:
    from kfac_ref.laplace import (
        laplace_log_marginal_likelihood as lml,
    )
    from kfac_ref.laplace import (
        laplace_log_marginal_likelihood_grad as lml_grad,
    )

    cases = []
    n_groups = len(_GROUPS)
    sizes = [p * q for _, p, q in _GROUPS]
    n = sum(sizes)
    for structure in STRUCTURES:
        for variant, prior, t, mean in _VARIANTS:
            stem = f"{structure}_{variant}"
            # one draw per (structure, variant), shared by the evidence and its gradient
            r = rng_for(f"laplace/{stem}")
            loglik = float(-20.0 * r.uniform(0.5, 1.5))
            inputs, curv = _inputs(r, structure, prior, mean)
            params = [inputs[f"theta_{g}"] for g in range(n_groups)]
            mus = [inputs[f"mu_{g}"] for g in range(n_groups)]
            pp = inputs["prior_precision"]
            deltas = np.broadcast_to(pp, (n_groups,))
            kw = dict(structure=structure, temperature=t, prior_mean=mus)
            precisions = _dense_precisions(structure, curv, deltas, t)
            kappas = [cond(m) for m in precisions]
            lams = [np.linalg.eigvalsh(m) for m in precisions]
            scatters = [float(np.sum((th - mu) ** 2)) for th, mu in zip(params, mus, strict=True)]
            meta = {"n_groups": n_groups, "sizes": sizes, "structure": structure,
                    "kappa": [float(k) for k in kappas]}
            case_params = {"structure": structure, "n_groups": n_groups,
                           "log_likelihood": loglik, "temperature": t}

            # -- evidence
            mag = abs(loglik / t) + 0.5 * sum(
                d * sc + float(np.sum(np.abs(np.log(lam)))) + ng * abs(np.log(d))
                for d, sc, lam, ng in zip(deltas, scatters, lams, sizes, strict=True))
            # a magnitude: 4 significant digits, so that BLAS rounding cannot change it
            scale = float(f"{max(mag, 1.0):.4g}")
            logdet_work = sum(ng * ng * k for ng, k in zip(sizes, kappas, strict=True))
            tol = Tolerance(
                SAFETY * (n + logdet_work),
                f"eigenvalues of {n_groups} posterior precisions (n_g = {sizes}, κ_g ≤ "
                f"{max(kappas):.3g}): log-determinant error ≤ Σ n_g²κ_g·eps = "
                f"{logdet_work:.4g}·eps, plus n = {n} summed terms; scale = the terms' "
                f"magnitudes (≥ 1)", scale)
            expected = np.asarray(lml(loglik, params, curv, pp, **kw), dtype=np.float64)
            alts = {
                "log_likelihood_untempered": lml(loglik * t, params, curv, pp, **kw),
                "curvature_untempered": lml(loglik / t, params, curv, pp,
                                            **{**kw, "temperature": 1.0}),
            }
            if structure == "kron":
                alts["factored_instead_of_exact"] = lml(
                    loglik, params, curv, pp, **{**kw, "structure": "kron_factored"})
            elif structure == "kron_factored":
                alts["exact_instead_of_factored"] = lml(
                    loglik, params, curv, pp, **{**kw, "structure": "kron"})
            cases.append(Case(
                f"laplace.log_marginal_likelihood/{stem}", "laplace.log_marginal_likelihood",
                inputs, case_params, expected, tol, dict(meta),
                {k: np.asarray(v, dtype=np.float64) for k, v in alts.items()},
                f"{structure} curvature, {n_groups} groups (a weight, its bias as a full "
                f"block, a weight), T = {t:g}, prior precision {prior}"))

            # -- gradient in the prior precision
            if structure == "kron_factored":
                dlog = []
                for block, d, lam in zip(curv, deltas, lams, strict=True):
                    if isinstance(block, tuple):
                        ea, eg = np.linalg.eigvalsh(block[0]), np.linalg.eigvalsh(block[1])
                        u = np.sqrt(1.0 / t) * ea + np.sqrt(d)
                        v = np.sqrt(1.0 / t) * eg + np.sqrt(d)
                        dlog.append(float((len(eg) * np.sum(1 / u) + len(ea) * np.sum(1 / v))
                                          / (2 * np.sqrt(d))))
                    else:
                        dlog.append(float(np.sum(1.0 / lam)))
            else:
                dlog = [float(np.sum(1.0 / lam)) for lam in lams]
            gmag = 0.5 * sum(sc + dl + ng / d for sc, dl, ng, d in
                             zip(scatters, dlog, sizes, deltas, strict=True))
            gscale = float(f"{gmag:.4g}")
            gwork = max(ng * k for ng, k in zip(sizes, kappas, strict=True))
            gtol = Tolerance(
                SAFETY * (n + gwork),
                f"traces of inverse posterior precisions: each 1/λ to n_g·κ_g·eps, max "
                f"n_g·κ_g = {gwork:.4g}, plus n = {n} summed terms; scale = the terms' "
                "magnitudes", gscale)
            gexp = np.asarray(lml_grad(params, curv, pp, **kw), dtype=np.float64)
            galts = {"curvature_untempered": lml_grad(params, curv, pp,
                                                      **{**kw, "temperature": 1.0})}
            if structure == "kron":
                galts["factored_instead_of_exact"] = lml_grad(
                    params, curv, pp, **{**kw, "structure": "kron_factored"})
            elif structure == "kron_factored":
                galts["exact_instead_of_factored"] = lml_grad(
                    params, curv, pp, **{**kw, "structure": "kron"})
            cases.append(Case(
                f"laplace.prior_precision_grad/{stem}", "laplace.prior_precision_grad",
                dict(inputs), dict(case_params), gexp, gtol, dict(meta),
                {k: np.asarray(v, dtype=np.float64) for k, v in galts.items()},
                f"{structure} curvature, T = {t:g}, prior precision {prior}"))
    return cases
