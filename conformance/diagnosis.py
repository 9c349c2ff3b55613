"""Diagnosis: which known K-FAC pitfall explains a disagreement.

When an output disagrees with the reference, the suite recomputes what the output *would*
be under each known pitfall and reports the first one that reconciles the numbers (within the
case's own tolerance).  Candidates, in this order:

1. **undeclared conventions** — the reference converted with one declared convention field
   flipped (Kronecker order, bias position, mean/sum curvature, EMA debiasing, conv style,
   empirical-Fisher scale, MSE variance ×2/÷2);
2. **case alternatives** — what kfac_ref computes with the pitfall built in (π without the
   dimensions, unsplit damping, exact instead of factored damping, the empirical instead of the
   true Fisher, no zero-debias, expand instead of reduce, ...), stored with the case;
3. **scalar factors** — N, N², 1/N, 1/N², |T|, 1/|T|, 2, 1/2 (from the case's N and |T|);
4. **structure** — transposed, symmetrised, negated;
5. **pairs**: two undeclared conventions together (e.g. Kronecker order *and* sum loss),
   then a scalar factor on top of a candidate of 1–2;
6. otherwise, the least-squares constant ``c`` if ``c·expected`` fits ("off by a constant
   factor c"), else "unexplained" with the relative error.

Shape mismatches are diagnosed separately (transposed shape, other vec order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .compare import as_float64, compare
from .conventions import FIELDS

__all__ = ["Diagnosis", "PITFALLS", "DOCS", "DOCS_PAGES", "diagnose", "docs_link", "section_id"]


@dataclass(frozen=True)
class Diagnosis:
    pitfall: str  # stable id (see PITFALLS); "unexplained" when nothing fits
    explanation: str  # plain words, with the numbers that identify it
    rel_err: float = float("nan")  # error of the matching candidate

    def to_dict(self):
        return {"pitfall": self.pitfall, "explanation": self.explanation,
                "rel_err": self.rel_err}


#: pitfall id -> (title, what it means, evidence)
PITFALLS = {
    "kron_order_swapped": (
        "Kronecker order swapped",
        "the block is kron(G, A) where kron(A, G) is declared (or vice versa): a row-major "
        "flattening of a [d_out, d_in] weight read as the [d_in, d_out] convention",
        "f-dangel/curvlinops#182",
    ),
    "bias_position": (
        "bias (homogeneous coordinate) in the wrong position",
        "the bias row/column of the input factor sits first where last is declared (or vice "
        "versa)", "kfac-jax `block_permuted`; TF K-FAC `mat2d` (bias last)",
    ),
    "sum_vs_mean": (
        "curvature of the sum instead of the mean loss (or vice versa)",
        "the result is N times (or 1/N times) the declared normalisation",
        "Martens & Grosse 2015",
    ),
    "no_zero_debias": (
        "moving average not zero-debiased",
        "the value is the raw weighted sum S_k instead of S_k/W_k",
        "tensorflow/kfac#37, n-gao/pytorch-kfac#6",
    ),
    "spurious_zero_debias": (
        "moving average debiased where the raw sum is declared",
        "the value is S_k/W_k where the raw weighted sum is declared", "tensorflow/kfac#37",
    ),
    "identity_init": (
        "moving average started at the identity without debiasing",
        "the first estimates are dominated by I (an implicit decaying damping)",
        "n-gao/pytorch-kfac#6",
    ),
    "conv_style": (
        "convolution factors in another style (KFC/expand/reduce/hybrid)",
        "the factors match a different weight-sharing approximation than declared",
        "Eschenhagen et al. 2023; tensorflow/kfac#41",
    ),
    "empirical_fisher_scale": (
        "empirical-Fisher scale convention",
        "an extra 1/N (kfac-jax fisher_empirical) present or missing",
        "kfac-jax `fisher_empirical` (kfac_jax/_src/loss_functions.py)",
    ),
    "empirical_fisher_unit": (
        "empirical Fisher per loss term instead of per example (or vice versa)",
        "outer products over every loss term (n, s) of a per-position loss "
        "(curvlinops' EFLinearOperator) where per-example gradients (the positions summed "
        "inside ℓ_n) are declared, or vice versa", "conformance/peers/FINDINGS.md (curvlinops)",
    ),
    "mse_factor_2": (
        "squared-error factor 2",
        "the loss curvature is 2I where I is declared (‖f−y‖² vs ½‖f−y‖²) or vice versa",
        "f-dangel/curvlinops#82",
    ),
    "patch_order": (
        "patch vector in another order",
        "convolution patches ordered with the channel slowest (PyTorch unfold) where (kh, kw, "
        "C_in) with C_in fastest is declared, or vice versa",
        "torch.nn.functional.unfold; TF K-FAC `extract_image_patches`",
    ),
    "pi_without_dimensions": (
        "π without the dimension normalisation",
        "π = sqrt(tr A / tr G) instead of sqrt((tr A/dim A)/(tr G/dim G))",
        "Thrandis/EKFAC-pytorch#4",
    ),
    "pi_squared": ("π squared", "π² used where π is meant", "Thrandis/EKFAC-pytorch#4"),
    "unsplit_damping": (
        "damping added to both factors without the π split",
        "(A + λI)⊗(G + λI) instead of (A + π√λI)⊗(G + √λ/πI)",
        "f-dangel/curvlinops#92, f-dangel/singd#17",
    ),
    "pi_off": (
        "π = 1 (√λ on both factors)", "the damping split ignores the factor scales",
        "Martens & Grosse 2015",
    ),
    "exact_damping": (
        "exact damping where factored damping is expected",
        "(A⊗G + λI)⁻¹ instead of (A + π√λI)⁻¹⊗(G + √λ/πI)⁻¹",
        "Martens & Grosse 2015",
    ),
    "factored_damping": (
        "factored damping where exact damping is expected",
        "(A + π√λI)⁻¹⊗(G + √λ/πI)⁻¹ instead of (A⊗G + λI)⁻¹",
        "Martens & Grosse 2015",
    ),
    "empirical_fisher": (
        "empirical instead of true Fisher",
        "the statistics use the data labels instead of targets from the model",
        "gpauloski/kfac-pytorch#109",
    ),
    "true_fisher": (
        "true instead of empirical Fisher",
        "the statistics use model targets where data labels are expected",
        "Kunstner et al. 2019",
    ),
    "symmetrised": (
        "symmetrised a non-symmetric quantity",
        "the output is (C + Cᵀ)/2 of the expected cross moment",
        "Martens, Ba & Johnson 2018",
    ),
    "fisher_for_hessian": (
        "Fisher where the Hessian is asked",
        "the expected (label-free) curvature instead of the Hessian at the data targets",
        "Martens 2020",
    ),
    "bias_separate": (
        "bias treated as a separate block",
        "the weight–bias cross terms of the input factor are dropped (separate bias block) "
        "where a joint [W; b] block is declared", "Martens & Grosse 2015",
    ),
    "exact_block_diagonal": (
        "exact curvature blocks instead of Kronecker-factored ones",
        "the output is the block diagonal of the exact GGN/empirical Fisher, not K-FAC",
        "Martens & Grosse 2015",
    ),
    "reduce_instead_of_expand": (
        "KFAC-reduce where KFAC-expand is asked",
        "weight-shared layer: location-averaged inputs and summed gradients instead of "
        "per-location statistics", "Eschenhagen et al. 2023",
    ),
    "expand_instead_of_reduce": (
        "KFAC-expand where KFAC-reduce is asked",
        "weight-shared layer: per-location statistics instead of pooled ones",
        "Eschenhagen et al. 2023",
    ),
    "average_of_products": (
        "average of per-batch K-FAC matrices instead of K-FAC of averaged factors",
        "the moving average was taken over Kronecker products, not over the factors",
        "aleximmer/Laplace (laplace/curvature/curvlinops.py)",
    ),
    "last_batch_only": (
        "moving average ignored",
        "the estimate holds only the latest batch (ema_old treated as 0)",
        "tensorflow/kfac#37",
    ),
    "missing_block_scale": (
        "block scale |T| (or T) missing",
        "the block is A⊗G where s·(A⊗G) is meant (s = |T| conv locations or T uses)",
        "tensorflow/kfac#41, tfjgeorge/nngeometry#75",
    ),
    "damping_not_normalised": (
        "damping not normalised by the block scale",
        "λ is split between the factors instead of λ/s (TF normalize_damping)",
        "tensorflow/kfac#41",
    ),
    "signed_eigenvalues": (
        "signed instead of absolute option-1 eigenvalues",
        "TF's posdef_eig ('self_adjoint') takes |ψ|; the signed eigenvalues give other numbers",
        "Martens, Ba & Johnson 2018",
    ),
    "transposed": ("transposed", "the output is the transpose of the expected matrix", ""),
    "negated": ("sign flipped", "the output is −expected", ""),
    "no_eigenvalue_clipping": (
        "no eigenvalue clipping",
        "negative round-off eigenvalues were not clipped before taking powers",
        "google-deepmind/kfac-jax#183",
    ),
    "vec_order": (
        "column-major instead of row-major vec (or vice versa)",
        "the output has the right entries in the other flattening order",
        "f-dangel/curvlinops#182",
    ),
    "non_finite": ("non-finite output", "NaN or Inf in the output never passes",
                   "google-deepmind/kfac-jax#183"),
    "shape": ("wrong shape", "the output's shape differs from the expected one", ""),
    "scale": ("constant scale factor", "the output is a constant multiple of the expected one "
              "that is no known factor", ""),
    "scale:N": ("scaled by N", "N times too large: curvature of the sum loss, or a missing "
                "1/N", "wiseodd/natural-gradients#2"),
    "scale:1/N": ("scaled by 1/N", "N times too small: an extra 1/N (e.g. kfac-jax's "
                  "empirical-Fisher scale, or per-example gradients of the mean loss in one "
                  "factor)", "wiseodd/natural-gradients#2"),
    "scale:N^2": ("scaled by N²", "N² times too large", "wiseodd/natural-gradients#2"),
    "scale:1/N^2": ("scaled by 1/N²", "gradients of the mean loss used as per-example "
                    "gradients: G carries 1/N²", "wiseodd/natural-gradients#2"),
    "scale:T": ("scaled by |T|", "|T| times too large: the location bookkeeping of a "
                "weight-shared layer", "tensorflow/kfac#41"),
    "scale:1/T": ("scaled by 1/|T|", "|T| times too small: a missing |T| (block scale or "
                  "factor normalisation)", "tensorflow/kfac#41"),
    "scale:T^2": ("scaled by |T|²", "|T|² times too large", "tensorflow/kfac#41"),
    "scale:1/T^2": ("scaled by 1/|T|²", "|T|² times too small", "tensorflow/kfac#41"),
    "scale:NT": ("scaled by N·|T|", "normalised by neither N nor |T|", "tensorflow/kfac#41"),
    "scale:1/NT": ("scaled by 1/(N·|T|)", "normalised twice", "tensorflow/kfac#41"),
    "scale:2": ("scaled by 2", "twice the reference (squared-error factor 2, a doubled "
                "symmetrisation)", "f-dangel/curvlinops#82"),
    "scale:1/2": ("scaled by 1/2", "half the reference", "f-dangel/curvlinops#82"),
    "unexplained": ("unexplained", "no known pitfall reconciles the numbers", ""),
}

#: docs pages, by path in the built documentation (without ``.html``) -> title
DOCS_PAGES = {
    "conventions": "Conventions",
    "theory/fisher_ggn": "The Fisher matrix and the generalised Gauss–Newton matrix",
    "theory/kfac_dense": "K-FAC for dense layers",
    "theory/kfc": "Convolutions: KFC, KFAC-expand and KFAC-reduce",
    "theory/series": "Layers used many times: recurrent networks",
    "theory/losses": "Losses: output curvature and its factors",
    "theory/estimation": "Estimation modes",
    "theory/damping": "Damping and the π split",
}

_VEC = ("conventions", "Vectorisation and the order of the Kronecker factors")
_PARAMS = ("conventions", "Parameter order in dense curvature matrices")
_SCALE = ("theory/fisher_ggn", "Scale: mean versus sum")
_EMA = ("conventions", "Moving averages")
_EXPAND = ("theory/kfc", "KFAC-expand and KFAC-reduce")
_SPLIT = ("theory/damping", "Factored (Tikhonov) damping")
_PI = ("theory/damping", "Choosing π")
_EXACT = ("theory/damping", "Exact damping")
_SHARED = ("theory/damping", "Layers used several times")
_EF = ("theory/fisher_ggn", "The empirical Fisher is something else")
_EFSCALE = ("theory/estimation", "Scaling conventions")
_CLIP = ("theory/damping", "Eigenvalue clipping")
_SERIES = ("theory/series", "Estimating the statistics")

#: pitfall id -> (docs page, section title): where the formula the pitfall gets wrong is
#: written down (see :func:`docs_link`)
DOCS = {
    "kron_order_swapped": _VEC, "vec_order": _VEC, "transposed": _VEC,
    "bias_position": _PARAMS, "bias_separate": _PARAMS,
    "sum_vs_mean": _SCALE, "scale:N": _SCALE, "scale:1/N": _SCALE, "scale:N^2": _SCALE,
    "scale:1/N^2": _SCALE,
    "no_zero_debias": _EMA, "spurious_zero_debias": _EMA, "identity_init": _EMA,
    "last_batch_only": _EMA,
    "average_of_products": ("theory/kfac_dense", "Statistics across steps"),
    "conv_style": _EXPAND, "reduce_instead_of_expand": _EXPAND,
    "expand_instead_of_reduce": _EXPAND,
    "patch_order": ("conventions", "Convolutions"),
    "scale:T": ("theory/kfc", "KFC"), "scale:1/T": ("theory/kfc", "KFC"),
    "scale:T^2": ("theory/kfc", "KFC"), "scale:1/T^2": ("theory/kfc", "KFC"),
    "scale:NT": ("theory/kfc", "KFC"), "scale:1/NT": ("theory/kfc", "KFC"),
    "missing_block_scale": _SHARED, "damping_not_normalised": _SHARED,
    "empirical_fisher_scale": _EFSCALE, "empirical_fisher_unit": _EFSCALE,
    "mse_factor_2": ("theory/losses", "Squared error versus Gaussian likelihood"),
    "scale:2": ("theory/losses", "Squared error versus Gaussian likelihood"),
    "scale:1/2": ("theory/losses", "Squared error versus Gaussian likelihood"),
    "pi_without_dimensions": _PI, "pi_squared": _PI, "pi_off": _PI,
    "unsplit_damping": _SPLIT, "exact_damping": _EXACT, "factored_damping": _EXACT,
    "empirical_fisher": _EF, "true_fisher": _EF,
    "fisher_for_hessian": ("theory/losses", "Fisher, GGN and Hessian"),
    "exact_block_diagonal": ("theory/kfac_dense", "The approximation"),
    "symmetrised": _SERIES, "signed_eigenvalues": _SERIES,
    "no_eigenvalue_clipping": _CLIP, "non_finite": _CLIP,
}

#: environment variable: where the built documentation lives (a URL or a directory); links in
#: the HTML report point there
DOCS_URL_VAR = "KFAC_REF_DOCS_URL"


def section_id(title: str) -> str:
    """The HTML anchor Sphinx gives a section title (docutils' ``make_id``: ASCII letters and
    digits kept, lower-cased, every other run of characters one hyphen)."""
    import re
    import unicodedata

    ascii_title = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    return re.sub(r"[^a-z0-9]+", "-", ascii_title.lower()).strip("-")


def _local_docs() -> str:
    """The built pages of a source checkout as a ``file://`` URL when they exist, else the
    relative folder ``bash docs/build.sh`` writes them to."""
    from pathlib import Path

    built = Path(__file__).resolve().parent.parent / "docs" / "_build" / "html"
    return built.as_uri() + "/" if (built / "index.html").exists() else "docs/_build/html/"


def docs_link(pitfall: str, base: str | None = None) -> tuple[str, str] | None:
    """``(label, url)`` of the docs section for ``pitfall`` (``a+b`` pairs: the first one), or
    ``None``.  ``base`` (default ``$KFAC_REF_DOCS_URL``, else the pages ``bash docs/build.sh``
    writes to ``docs/_build/html/``) is a URL or a directory of the built pages."""
    import os

    key = pitfall.split("+")[0]
    if key not in DOCS:
        return None
    page, section = DOCS[key]
    base = base or os.environ.get(DOCS_URL_VAR) or _local_docs()
    if not base.endswith("/"):
        base += "/"
    label = f"docs page {DOCS_PAGES[page]} › {section}"
    return label, f"{base}{page}.html#{section_id(section)}"


# convention field -> pitfall id for a flip of that field
_FLIP_PITFALL = {
    "kron_order": "kron_order_swapped",
    "bias_position": "bias_position",
    "curvature_of": "sum_vs_mean",
    "conv_style": "conv_style",
    "empirical_fisher_scale": "empirical_fisher_scale",
    "mse_variance": "mse_factor_2",
}


def _flip_values(cap, case, conv):
    """(field, value, pitfall id) for every undeclared value of each relevant field."""
    out = []
    for field in cap.conventions:
        if field == "symmetrised":
            continue
        declared = getattr(conv, field)
        if field == "mse_variance":
            base = declared if declared is not None else case.params.get("variance", 1.0)
            values = (base * 2.0, base / 2.0)
        else:
            values = [v for v in FIELDS[field][0] if v != declared]
        for value in values:
            if field == "ema_style":
                pid = "no_zero_debias" if value == "raw" else "spurious_zero_debias"
            else:
                pid = _FLIP_PITFALL.get(field, field)
            out.append((field, value, pid))
    return out


def _pair_flip_candidates(cap, case, conv):
    flips = _flip_values(cap, case, conv)
    for i, (f1, v1, p1) in enumerate(flips):
        for f2, v2, p2 in flips[i + 1:]:
            if f1 == f2:
                continue
            try:
                cand = cap.convert_output(case.expected, case, conv.with_(**{f1: v1, f2: v2}))
            except Exception:  # noqa: BLE001
                continue
            yield (f"{p1}+{p2}", f"matches the reference under {f1}={v1!r} and {f2}={v2!r} "
                                 f"(declared {f1}={getattr(conv, f1)!r}, "
                                 f"{f2}={getattr(conv, f2)!r})",
                   np.asarray(cand, dtype=np.float64))


def _flip_candidates(cap, case, conv):
    for field in cap.conventions:
        if field == "symmetrised":
            continue  # only rounding differs
        declared = getattr(conv, field)
        if field == "mse_variance":
            base = declared if declared is not None else case.params.get("variance", 1.0)
            values = (base * 2.0, base / 2.0)
        else:
            values = [v for v in FIELDS[field][0] if v != declared]
        for value in values:
            try:
                cand = cap.convert_output(case.expected, case, conv.with_(**{field: value}))
            except Exception:  # noqa: BLE001 - a conversion that needs absent data
                continue
            if field == "ema_style":
                pid = "no_zero_debias" if value == "raw" else "spurious_zero_debias"
            else:
                pid = _FLIP_PITFALL.get(field, field)
            yield (pid, f"matches the reference under {field}={value!r}, but the adapter "
                        f"declares {field}={declared!r}", np.asarray(cand, dtype=np.float64))


def _alt_candidates(cap, case, conv):
    for name, alt in case.alternatives.items():
        if name.startswith("_"):
            continue  # conversion data for a convention (e.g. '_conv_hybrid'), not a pitfall
        try:
            cand = cap.convert_output(alt, case, conv)
        except Exception:  # noqa: BLE001
            continue
        yield name, f"matches what the reference computes with the pitfall '{name}'", \
            np.asarray(cand, dtype=np.float64)


def _scalar_factors(case):
    """(pitfall id, label, factor) for the scalar pitfalls that the case's N and |T| allow."""
    out = []
    n, t = case.meta.get("N"), case.meta.get("T")
    if n and n > 1:
        out += [("scale:N", f"N = {n}", n), ("scale:1/N", f"1/N = 1/{n}", 1 / n),
                ("scale:N^2", f"N² = {n * n}", n * n),
                ("scale:1/N^2", f"1/N² = 1/{n * n}", 1 / (n * n))]
    if t and t > 1:
        out += [("scale:T", f"|T| = {t}", t), ("scale:1/T", f"1/|T| = 1/{t}", 1 / t),
                ("scale:T^2", f"|T|² = {t * t}", t * t),
                ("scale:1/T^2", f"1/|T|² = 1/{t * t}", 1 / (t * t))]
        if n and n > 1:
            out += [("scale:NT", f"N·|T| = {n * t}", n * t),
                    ("scale:1/NT", f"1/(N·|T|) = 1/{n * t}", 1 / (n * t))]
    out += [("scale:2", "2", 2.0), ("scale:1/2", "1/2", 0.5)]
    seen, uniq = set(), []
    for pid, label, c in out:  # the catalogue avoids coincidences; keep the first name
        key = round(float(c), 12)
        if key not in seen:
            seen.add(key)
            uniq.append((pid, label, float(c)))
    return uniq


def _structure_candidates(expected):
    if expected.ndim == 2 and expected.shape[0] == expected.shape[1]:
        if not np.allclose(expected, expected.T, rtol=1e-10, atol=0):
            yield "transposed", "equals the transpose of the expected matrix", expected.T
            yield "symmetrised", "equals the symmetric part of the expected matrix", \
                (expected + expected.T) / 2
    yield "negated", "equals −expected", -expected


def diagnose(actual, case, cap, conv, rtol) -> Diagnosis:
    """Name the pitfall that reconciles ``actual`` with the reference, if any."""
    expected = cap.expected_for(case, conv)
    act = as_float64(actual)
    scale = case.tolerance.scale
    if act is None:
        return Diagnosis("shape", f"the output is not a real array ({type(actual).__name__})")
    if act.shape != expected.shape:
        # an undeclared convention can change the layout (e.g. a transposed parameter
        # matrix): try the convention candidates that have the output's shape first
        if np.all(np.isfinite(act)):
            shaped = [x for x in list(_flip_candidates(cap, case, conv)) +
                      list(_pair_flip_candidates(cap, case, conv)) if x[2].shape == act.shape]
            factors = [("", "", 1.0)] + _scalar_factors(case)
            for spid, label, f in factors:  # exact conventions first, then with a factor
                for pid, text, cand in shaped:
                    c = compare(act, f * cand, rtol, scale)
                    if c.ok:
                        if spid:
                            return Diagnosis(f"{pid}+{spid}", f"{text}, times {label}",
                                             c.rel_err)
                        return Diagnosis(pid, text, c.rel_err)
        if act.size == expected.size and expected.ndim >= 1:
            if act.shape == expected.T.shape and compare(act.T, expected, rtol, scale).ok:
                return Diagnosis("transposed", f"shape {act.shape} is the transpose of "
                                               f"{expected.shape} and the values match")
            if compare(act.reshape(expected.shape), expected, rtol, scale).ok:
                return Diagnosis("shape", f"shape {act.shape} instead of {expected.shape}; "
                                          "the values match after a row-major reshape")
            if compare(act.reshape(expected.shape, order="F"), expected, rtol, scale).ok:
                return Diagnosis("vec_order", f"shape {act.shape} instead of "
                                              f"{expected.shape}; the values match after a "
                                              "column-major reshape")
        return Diagnosis("shape", f"shape {act.shape} != expected {expected.shape}")
    if not np.all(np.isfinite(act)):
        bad = int(np.sum(~np.isfinite(act)))
        extra = ""
        if "no_eigenvalue_clipping" in case.alternatives:
            extra = "; eigenvalue clipping is the usual cause"
        return Diagnosis("non_finite", f"{bad} of {act.size} entries are NaN/Inf{extra}")

    primary = list(_flip_candidates(cap, case, conv)) + list(_alt_candidates(cap, case, conv))
    for pid, text, cand in primary:
        c = compare(act, cand, rtol, scale)
        if c.ok:
            return Diagnosis(pid, text, c.rel_err)
    factors = _scalar_factors(case)
    for spid, label, f in factors:
        c = compare(act, f * expected, rtol, scale)
        if c.ok:
            return Diagnosis(spid, f"output = {label} × expected", c.rel_err)
    for pid, text, cand in _structure_candidates(expected):
        c = compare(act, cand, rtol, scale)
        if c.ok:
            return Diagnosis(pid, text, c.rel_err)
    for pid, text, cand in _pair_flip_candidates(cap, case, conv):
        c = compare(act, cand, rtol, scale)
        if c.ok:
            return Diagnosis(pid, text, c.rel_err)
    for pid, text, cand in primary:
        for spid, label, f in factors:
            c = compare(act, f * cand, rtol, scale)
            if c.ok:
                return Diagnosis(f"{pid}+{spid}", f"{text}, times {label}", c.rel_err)
    denom = float(np.vdot(expected, expected))
    if denom > 0:
        coef = float(np.vdot(expected, act)) / denom
        c = compare(act, coef * expected, rtol, scale)
        if c.ok and coef != 0:
            return Diagnosis("scale", f"output = {coef:.6g} × expected (no known factor of "
                                      "N, |T| or 2)", c.rel_err)
    rel = compare(act, expected, rtol, scale).rel_err
    return Diagnosis("unexplained", f"relative error {rel:.3e} (rtol {rtol:.1e}); no known "
                                    "pitfall reconciles the numbers", rel)
