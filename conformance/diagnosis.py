"""Diagnosis: which known K-FAC pitfall (or which few, together) explains a disagreement.

When an output disagrees with the reference, the suite recomputes what the output *would*
be under known pitfalls and reports the explanation with the **fewest pitfalls** (at most
:data:`MAX_PITFALLS`, within :data:`SEARCH_BUDGET` comparisons).  The building blocks:

1. **undeclared conventions** — the reference converted with declared convention fields
   flipped (Kronecker order, bias position, mean/sum curvature, EMA debiasing, start and
   weight, damping parameterisation, conv style, empirical-Fisher scale, MSE variance ×2/÷2);
   for matrix–vector cases also the other Kronecker order applied to the *declared* vector
   (code written for the other layout);
2. **case alternatives** — what kfac_ref computes with the pitfall built in (π without the
   dimensions, unsplit damping, exact instead of factored damping, the empirical instead of the
   true Fisher, no zero-debias, expand instead of reduce, ...), stored with the case, also
   under flipped conventions;
3. **scalar factors** — N, N², |T|, |T|², N·|T|, 2 and their inverses, and the *structural
   ratios* of the case's sizes (√(d_A/d_G), d_A/d_G, C_in, kernel size), one pitfall each;
4. **structure** — transposed, symmetrised, negated.

A candidate **explains** the output when it passes the case's strict tolerance, or when it
leaves a small residual (≤ :data:`EXPLAIN_RTOL`) that is at least 1/:data:`EXPLAIN_REDUCTION`
times smaller than the plain reference's error; the residual is then reported ("up to 2e-09
relative remains (a small additive term?)": a safety epsilon on top of a pitfall).  This
looser criterion only names the cause of a failure — a pass still needs the strict tolerance.
Among explanations with the same number of pitfalls, a strict match beats a loose one, fewer
scalar factors beat more, and then the order above decides.

For a network's [P, P] curvature matrix that no single explanation covers, each layer's
diagonal block is diagnosed on its own (``per_layer:0=scale:1/N^2+scale:1/T,1=scale:1/N^2``);
off-diagonal blocks must match.  Otherwise the least-squares constant ``c`` (``scale``) when
``c·expected`` explains the output, else ``unexplained`` with the relative error.

Shape mismatches are diagnosed separately (transposed shape, other vec order).
"""

from __future__ import annotations

import math
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
    "factor_transposed": (
        "factor transposed",
        "B_nᵀ applied where B_n is meant (or B_n for B_nᵀ): the categorical factor "
        "diag(√p) − p√pᵀ is not symmetric",
        "TF K-FAC `multiply_fisher_factor` / `_transpose` (loss_functions.py)"),
    "factor_weight_w": (
        "factor weighted by w instead of √w",
        "a factor B with B Bᵀ = w F must carry √w; w makes the curvature w² F",
        "kfac-jax `multiply_fisher_factor` (loss_functions.py)"),
    "no_sampling": (
        "the mode instead of a sample",
        "targets set to the most likely value (argmax class, logit > 0, the mean) instead of "
        "drawn from p(·|f): the sampled Fisher becomes a deterministic, biased matrix",
        "TF K-FAC `sample` (loss_functions.py)"),
    "variance_as_std": (
        "variance used as the standard deviation",
        "normal targets drawn as μ + v·ε instead of μ + √v·ε",
        "TF K-FAC `NormalMeanNegativeLogProbLoss.sample` (loss_functions.py)"),
    "not_draws": (
        "not draws",
        "a sampler returned something other than samples of its distribution: probabilities "
        "or expectations where draws are due, class "
        "indices that are no integers in [0, k), one-hot rows that are not 0/1 with a single "
        "1, Bernoulli entries other than 0 and 1, NaN/Inf, complex, text or object values; "
        "found before any statistics", ""),
    "kronecker_instead_of_exact": (
        "Kronecker-factored block where a full (or diagonal) block is asked",
        "A ⊗ G (or its diagonal) instead of the exact per-example second moment of the "
        "layer's parameter gradients (kfac-jax DenseFull / NaiveFull, or their diagonal)",
        "kfac-jax `DenseFull`, `NaiveFull`, `NaiveDiagonal` (curvature_blocks)"),
    "factored_instead_of_exact": (
        "factored Kronecker posterior where the exact one is asked",
        "log det of (√s A + √δ I) ⊗ (√s G + √δ I) (the prior added to each factor) instead of "
        "the exact posterior precision s·A ⊗ G + δI, whose eigenvalues are s·a_i·γ_j + δ",
        "Ritter, Botev & Barber (2018), eq. 7; laplace-torch `KronDecomposed(damping=True)`"),
    "exact_instead_of_factored": (
        "exact Kronecker posterior where the factored one is asked",
        "the damping of the factored posterior (√s A + √δ I) ⊗ (√s G + √δ I) dropped: the "
        "evidence of s·A ⊗ G + δI instead",
        "laplace-torch 0.3 `KronDecomposed.__mul__`/`__add__` drop `damping` "
        "(conformance/peers/LAPLACE_FINDINGS.md)"),
    "log_likelihood_untempered": (
        "log-likelihood not tempered",
        "ℓ instead of ℓ/T in the Laplace evidence (the temperature applied to the curvature "
        "only)", "laplace-torch `BaseLaplace.log_likelihood` leaves the Gaussian normaliser "
        "(a part of ℓ) untempered"),
    "curvature_untempered": (
        "curvature not tempered",
        "posterior precision H + P₀ instead of H/T + P₀ in the Laplace evidence or its "
        "prior-precision gradient",
        "Immer et al. (2021), eq. 4; laplace-torch `_H_factor` = 1/(σ²T)"),
    "fresh_instead_of_cached": (
        "cached product recomputed from the current statistics",
        "a cached product (use_cached=True) after a further update must use the inverse or "
        "eigenbases of the last update_cache (kfac-jax: stale by design); this one used the "
        "current statistics",
        "kfac-jax `KroneckerFactored._multiply_matpower_unscaled` (use_cached)"),
    "current_damping_in_cache": (
        "current identity weight in a cached approximate inverse",
        "kfac-jax's cached factored inverse keeps the identity weight given to update_cache; "
        "this one applied the current weight to the cached factors",
        "kfac-jax `KroneckerFactored._update_cache` (pi_adjusted_kronecker_inverse)"),
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
    "scale:sqrt(dA/dG)": ("scaled by √(d_A/d_G)", "the ratio π without the dimension "
                          "normalisation introduces (π computed from tr A / tr G)",
                          "Thrandis/EKFAC-pytorch#4"),
    "scale:sqrt(dG/dA)": ("scaled by √(d_G/d_A)", "the ratio 1/π without the dimension "
                          "normalisation introduces", "Thrandis/EKFAC-pytorch#4"),
    "scale:dA/dG": ("scaled by d_A/d_G", "a ratio of the factor sizes (traces instead of "
                    "averaged traces, squared)", "Thrandis/EKFAC-pytorch#4"),
    "scale:dG/dA": ("scaled by d_G/d_A", "a ratio of the factor sizes", ""),
    "scale:C": ("scaled by C_in", "C_in times too large: a sum over input channels where an "
                "average is meant", "tensorflow/kfac#41"),
    "scale:1/C": ("scaled by 1/C_in", "C_in times too small: an extra average over input "
                  "channels", "tensorflow/kfac#41"),
    "scale:kernel": ("scaled by the kernel size", "k_h·k_w times too large: a sum over kernel "
                     "offsets where an average is meant", "tensorflow/kfac#41"),
    "scale:1/kernel": ("scaled by 1/kernel size", "k_h·k_w times too small: patch statistics "
                       "averaged over the kernel offsets", "tensorflow/kfac#41"),
    "damping_parameterisation": (
        "damping parameterisation: λ per factor instead of √λ (or vice versa)",
        "(A + πλ I)⊗(G + λ/π I) where (A + π√λ I)⊗(G + √λ/π I) is declared (the damping "
        "given is each factor's, not the block's), or vice versa",
        "Martens & Grosse 2015"),
    "ema_first_statistic": (
        "moving average initialised at the first statistic",
        "m₁ = X₁, m_k = δm + wX_k (no zero start, no debiasing) where a zero-started average "
        "is declared; equal to the debiased average after one update only",
        "tensorflow/kfac#37"),
    "ema_zero_start": (
        "moving average started at zero where the first statistic is declared",
        "S₀ = 0 (debiased or raw) where m₁ = X₁ is declared", "tensorflow/kfac#37"),
    "ema_weight_tied": (
        "new-statistic weight tied to 1 − decay",
        "the average weights the new statistic by 1 − δ whatever weight is passed",
        "tensorflow/kfac#37"),
    "ema_weight_untied": (
        "new-statistic weight not tied to 1 − decay",
        "the passed weight is used where 1 − δ is declared", "tensorflow/kfac#37"),
    "ema_identity_init": (
        "moving average started at the identity",
        "m₀ = I, m_k = δ·m_{k−1} + (1 − δ)·X_k: after k updates the factor is δᵏ·I plus the "
        "average, an implicit damping that decays with the steps (decay recovered)",
        "n-gao/pytorch-kfac#6"),
    "ema_zero_init_no_debias": (
        "moving average started at zero and not debiased",
        "m = (1 − δ)·Σ δ^(k−i) X_i not divided by 1 − δᵏ: the early factors are too small "
        "(decay recovered)", "tensorflow/kfac#37"),
    "ema_decay": (
        "moving average with another decay",
        "a debiased average whose decay differs from the declared one (decay recovered)",
        "tensorflow/kfac#37"),
    "factors_swapped": (
        "A and G swapped", "the input factor is given where the output factor is expected "
        "and vice versa", "Martens & Grosse 2015"),
    "dilation_ignored": (
        "convolution dilation ignored",
        "patches read from adjacent pixels instead of every d-th: the input factor of the "
        "undilated convolution", "kfac-jax 0.0.8 conv patches (rhs_dilation dropped)"),
    "padding_ignored": (
        "convolution padding ignored",
        "patches read only at the valid locations (no zero padding)",
        "Grosse & Martens 2016"),
    "padding_split": (
        "'same' padding split the other way",
        "an odd total padding put before instead of after (TF and PyTorch put the extra row "
        "or column after)", "Grosse & Martens 2016"),
    "stride_ignored": (
        "convolution stride ignored",
        "patches read at every location instead of every s-th", "Grosse & Martens 2016"),
    "spurious_damping_normalisation": (
        "damping divided by |T| on a block without the scale",
        "λ/|T| split between the factors of a block A⊗G whose G already holds the |T| "
        "locations (KFAC-expand): TF's normalize_damping applied to factors that are not "
        "TF's Γ = G/|T|", "tensorflow/kfac#41"),
    "no_damping": (
        "damping not applied",
        "the inverse of the undamped A⊗G where a damped inverse is expected (λ dropped or "
        "never passed on)", "Martens & Grosse 2015"),
    "per_layer": (
        "a different fault in each layer",
        "the curvature matrix is block diagonal over layers and no single explanation "
        "covers all blocks: each layer's block is diagnosed on its own "
        "(per_layer:<layer>=<pitfall>,...; layers that match are not listed)", ""),
    "unexplained": ("unexplained", "no known pitfall, nor up to three of them together, "
                    "reconciles the numbers", ""),
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
    "theory/laplace": "Laplace evidence",
}

#: (docs page, section title) -> the pitfalls whose formula that section writes down
_SECTION_PITFALLS = {
    ("conventions", "Vectorisation and the order of the Kronecker factors"): (
        "kron_order_swapped", "vec_order", "transposed", "factors_swapped",
    ),
    ("conventions", "Parameter order in dense curvature matrices"): (
        "bias_position", "bias_separate",
    ),
    ("theory/fisher_ggn", "Scale: mean versus sum"): (
        "sum_vs_mean", "scale:N", "scale:1/N", "scale:N^2", "scale:1/N^2",
    ),
    ("conventions", "Moving averages"): (
        "no_zero_debias", "spurious_zero_debias", "identity_init", "last_batch_only",
        "ema_first_statistic", "ema_zero_start", "ema_weight_tied", "ema_weight_untied",
        "ema_identity_init", "ema_zero_init_no_debias", "ema_decay",
    ),
    ("theory/kfac_dense", "Statistics across steps"): ("average_of_products",),
    ("theory/kfc", "KFAC-expand and KFAC-reduce"): (
        "conv_style", "reduce_instead_of_expand", "expand_instead_of_reduce",
    ),
    ("conventions", "Convolutions"): (
        "patch_order", "dilation_ignored", "padding_ignored", "padding_split", "stride_ignored",
    ),
    ("theory/kfc", "KFC"): (
        "scale:T", "scale:1/T", "scale:T^2", "scale:1/T^2", "scale:NT", "scale:1/NT", "scale:C",
        "scale:1/C", "scale:kernel", "scale:1/kernel",
    ),
    ("theory/damping", "Layers used several times"): (
        "missing_block_scale", "damping_not_normalised", "spurious_damping_normalisation",
    ),
    ("theory/estimation", "Scaling conventions"): (
        "empirical_fisher_scale", "empirical_fisher_unit",
    ),
    ("theory/losses", "Squared error versus Gaussian likelihood"): (
        "mse_factor_2", "scale:2", "scale:1/2",
    ),
    ("theory/damping", "Choosing π"): (
        "pi_without_dimensions", "pi_squared", "pi_off", "scale:sqrt(dA/dG)", "scale:sqrt(dG/dA)",
        "scale:dA/dG", "scale:dG/dA",
    ),
    ("theory/damping", "Factored (Tikhonov) damping"): (
        "unsplit_damping", "damping_parameterisation", "no_damping",
    ),
    ("theory/damping", "Exact damping"): ("exact_damping", "factored_damping"),
    ("theory/fisher_ggn", "The empirical Fisher is something else"): (
        "empirical_fisher", "true_fisher",
    ),
    ("theory/losses", "Fisher, GGN and Hessian"): ("fisher_for_hessian",),
    ("theory/kfac_dense", "The approximation"): ("exact_block_diagonal",),
    ("theory/series", "Estimating the statistics"): ("symmetrised", "signed_eigenvalues"),
    ("theory/damping", "Eigenvalue clipping"): ("no_eigenvalue_clipping", "non_finite"),
    ("theory/laplace", "Log-determinants by eigenvalues"): (
        "factored_instead_of_exact", "exact_instead_of_factored",
    ),
    ("theory/laplace", "Temperature and the normaliser"): (
        "log_likelihood_untempered", "curvature_untempered",
    ),
}

#: pitfall id -> (docs page, section title): where the formula the pitfall gets wrong is
#: written down (see :func:`docs_link`)
DOCS = {pid: section for section, pids in _SECTION_PITFALLS.items() for pid in pids}

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
    "damping_per_factor": "damping_parameterisation",
    "ema_init": "ema_first_statistic",
    "ema_weight": "ema_weight_tied",
}

#: a candidate *explains* an output when it leaves at most this relative error ...
EXPLAIN_RTOL = 1e-6
#: ... and reduces the error of the plain reference by at least this factor (three orders of
#: magnitude).  A pass still needs the case's strict tolerance; this looser criterion only
#: names a pitfall behind a disagreement (a safety epsilon on top of a pitfall leaves a small
#: residual, which is reported).
EXPLAIN_REDUCTION = 1e-3
#: at most this many pitfalls are composed in one diagnosis (fewest preferred)
MAX_PITFALLS = 3
#: at most this many candidate comparisons per search (whole output or one layer)
SEARCH_BUDGET = 20000


def _flip_pid(field, value):
    if field == "ema_style":
        return "no_zero_debias" if value == "raw" else "spurious_zero_debias"
    if field == "ema_init":
        return "ema_first_statistic" if value == "first" else "ema_zero_start"
    if field == "ema_weight":
        return "ema_weight_tied" if value == "one_minus_decay" else "ema_weight_untied"
    if field == "damping_per_factor":
        return "damping_parameterisation"
    return _FLIP_PITFALL.get(field, field)


def _flip_values(cap, case, conv):
    """(field, value, pitfall id) for every undeclared value of each relevant field."""
    out = []
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
            out.append((field, value, _flip_pid(field, value)))
    return out


def _convert(cap, arr, case, conv):
    try:
        return np.asarray(cap.convert_output(arr, case, conv), dtype=np.float64)
    except Exception:  # noqa: BLE001 - a conversion that needs absent data
        return None


def _flip_candidates(cap, case, conv):
    for field, value, pid in _flip_values(cap, case, conv):
        cand = _convert(cap, case.expected, case, conv.with_(**{field: value}))
        if cand is not None:
            yield (pid, f"matches the reference under {field}={value!r}, but the adapter "
                        f"declares {field}={getattr(conv, field)!r}", cand)


def _pair_flip_candidates(cap, case, conv):
    flips = _flip_values(cap, case, conv)
    for i, (f1, v1, p1) in enumerate(flips):
        for f2, v2, p2 in flips[i + 1:]:
            if f1 == f2:
                continue
            cand = _convert(cap, case.expected, case, conv.with_(**{f1: v1, f2: v2}))
            if cand is not None:
                yield (f"{p1}+{p2}", f"matches the reference under {f1}={v1!r} and {f2}={v2!r} "
                                     f"(declared {f1}={getattr(conv, f1)!r}, "
                                     f"{f2}={getattr(conv, f2)!r})", cand)


def _alt_candidates(cap, case, conv):
    for name, alt in case.alternatives.items():
        if name.startswith("_"):
            continue  # conversion data for a convention (e.g. '_conv_hybrid'), not a pitfall
        cand = _convert(cap, alt, case, conv)
        if cand is not None:
            yield name, f"matches what the reference computes with the pitfall '{name}'", cand


def _swapped_in_declared_layout(cap, case, conv):
    """The other Kronecker order applied to the *same* (declared) vector.

    Matrix–vector cases store their linear map as ``_operator`` (canonical layout).  Code
    written for the other order computes that map in the other order's layout, applied to the
    vector it was handed in the declared layout: ``K[i, i] x`` with ``i`` the other order's
    index map.  (Converting the reference's output from canonical into the declared layout
    is not the same thing unless p = q.)"""
    op = case.alternatives.get("_operator")
    if op is None or "kron_order" not in cap.conventions or "p" not in case.meta:
        return
    from .conventions import vec_index

    p, q, bias = case.meta["p"], case.meta["q"], case.meta.get("bias", False)
    other = "GA" if conv.kron_order == "AG" else "AG"
    try:
        x = cap.inputs_for(case, conv)["v"]
        idx = vec_index(p, q, conv.with_(kron_order=other), bias)
        cand = np.asarray(op)[np.ix_(idx, idx)] @ np.asarray(x, dtype=np.float64)
    except Exception:  # noqa: BLE001
        return
    yield ("kron_order_swapped", f"the Kronecker product in the other order (kron_order="
                                 f"{other!r}) applied to the vector given in the declared "
                                 f"kron_order={conv.kron_order!r} layout", cand)


def _scalar_factors(case, meta=None):
    """(pitfall id, label, factor) for the scalar pitfalls that the case's N and |T| allow,
    and the structural ratios of its sizes (√(d_A/d_G), d_A/d_G, C_in, kernel size)."""
    m = case.meta if meta is None else meta
    out = []
    n, t = m.get("N"), m.get("T")
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
    p, q = m.get("p"), m.get("q")
    if p and q and p != q:
        out += [("scale:sqrt(dA/dG)", f"√(d_A/d_G) = √({p}/{q}) (π without the dimension "
                                      "normalisation)", math.sqrt(p / q)),
                ("scale:sqrt(dG/dA)", f"√(d_G/d_A) = √({q}/{p}) (1/π without the dimension "
                                      "normalisation)", math.sqrt(q / p)),
                ("scale:dA/dG", f"d_A/d_G = {p}/{q}", p / q),
                ("scale:dG/dA", f"d_G/d_A = {q}/{p}", q / p)]
    c_in = m.get("c_in")
    if c_in and c_in > 1:
        out += [("scale:C", f"C_in = {c_in}", c_in), ("scale:1/C", f"1/C_in = 1/{c_in}",
                                                        1 / c_in)]
    kernel = m.get("kernel")
    if kernel:
        k = int(np.prod(kernel))
        if k > 1:
            out += [("scale:kernel", f"kernel size = {k}", k),
                    ("scale:1/kernel", f"1/kernel size = 1/{k}", 1 / k)]
    seen, uniq = set(), []
    for pid, label, c in out:  # the catalogue avoids coincidences; keep the first name
        key = round(float(c), 12)
        if key not in seen:
            seen.add(key)
            uniq.append((pid, label, float(c)))
    return uniq


def _scalar_products(scalars, most):
    """(count, ids, labels, value) for products of up to ``most`` distinct named scalars,
    fewest first (and, for equal counts, the earliest names); one entry per value."""
    import itertools

    combos = []
    for k in range(1, most + 1):
        for combo in itertools.combinations(range(len(scalars)), k):
            v = 1.0
            for i in combo:
                v *= scalars[i][2]
            combos.append((k, sum(combo), combo, v))
    combos.sort(key=lambda e: (e[0], e[1]))
    out, seen = [], set()
    for k, _, combo, v in combos:
        key = round(math.log(v), 9)
        if abs(key) < 1e-9 or key in seen:
            continue  # x·(1/x) is not a pitfall; one name per value (the simplest)
        seen.add(key)
        out.append((k, tuple(scalars[i][0] for i in combo),
                    tuple(scalars[i][1] for i in combo), v))
    return out


def _structure_candidates(expected):
    if expected.ndim == 2 and expected.shape[0] == expected.shape[1]:
        if not np.allclose(expected, expected.T, rtol=1e-10, atol=0):
            yield "transposed", "equals the transpose of the expected matrix", expected.T
            yield "symmetrised", "equals the symmetric part of the expected matrix", \
                (expected + expected.T) / 2
    yield "negated", "equals −expected", -expected


def _bases(cap, case, conv):
    """Candidate outputs by the number of pitfalls in them: levels 1, 2, 3 (lists of
    (ids, text, array)); scalar factors are added on top of these by the search."""
    flips = _flip_values(cap, case, conv)
    alts = [(n, a) for n, a in case.alternatives.items() if not n.startswith("_")]
    lvl1 = [((pid,), text, arr) for pid, text, arr in _flip_candidates(cap, case, conv)]
    lvl1 += [((pid,), text, arr) for pid, text, arr in _alt_candidates(cap, case, conv)]
    lvl1 += [((pid,), text, arr) for pid, text, arr in
             _swapped_in_declared_layout(cap, case, conv)]
    lvl1 += [((pid,), text, arr) for pid, text, arr in _structure_candidates(
        cap.expected_for(case, conv))]

    def lvl2():
        out = [(tuple(pid.split("+")), text, arr)
               for pid, text, arr in _pair_flip_candidates(cap, case, conv)]
        for name, alt in alts:
            for field, value, pid in flips:
                cand = _convert(cap, alt, case, conv.with_(**{field: value}))
                if cand is not None:
                    out.append(((name, pid), f"matches what the reference computes with the "
                                             f"pitfall '{name}', under {field}={value!r} "
                                             f"(declared {getattr(conv, field)!r})", cand))
        for ids, text, arr in lvl1:
            if ids[0] not in ("negated", "transposed", "symmetrised"):
                out.append((ids + ("negated",), f"{text}, with the sign flipped", -arr))
        return out

    def lvl3():
        out = []
        for i, (f1, v1, p1) in enumerate(flips):
            for j, (f2, v2, p2) in enumerate(flips[i + 1:], i + 1):
                if f1 == f2:
                    continue
                for f3, v3, p3 in flips[j + 1:]:
                    if f3 in (f1, f2):
                        continue
                    cand = _convert(cap, case.expected, case,
                                    conv.with_(**{f1: v1, f2: v2, f3: v3}))
                    if cand is not None:
                        out.append(((p1, p2, p3), f"matches the reference under {f1}={v1!r}, "
                                                  f"{f2}={v2!r} and {f3}={v3!r}", cand))
        for name, alt in alts:
            for i, (f1, v1, p1) in enumerate(flips):
                for f2, v2, p2 in flips[i + 1:]:
                    if f1 == f2:
                        continue
                    cand = _convert(cap, alt, case, conv.with_(**{f1: v1, f2: v2}))
                    if cand is not None:
                        out.append(((name, p1, p2), f"matches what the reference computes "
                                                    f"with the pitfall '{name}', under "
                                                    f"{f1}={v1!r} and {f2}={v2!r}", cand))
        return out

    return [lvl1, lvl2, lvl3]


def _rel(act, cand, scale):
    den = max(float(np.linalg.norm(cand)), float(scale), np.finfo(np.float64).tiny)
    return float(np.linalg.norm(act - cand)) / den


class _Search:
    """Fewest-pitfall search: candidates of 0–3 pitfalls (bases of :func:`_bases`, times
    products of named scalars), judged by the *explains* criterion."""

    def __init__(self, act, expected, rtol, scale, scalars, budget=SEARCH_BUDGET,
                 coef_rtol=1e-3):
        self.act, self.expected, self.rtol, self.scale = act, expected, rtol, scale
        self.coef_rtol = coef_rtol
        self.e0 = _rel(act, expected, scale)
        self.products = _scalar_products(scalars, MAX_PITFALLS)
        self.budget = budget
        self.best = None  # (key, ids, text, residual)
        self.unnamed = None
        self.order = 0

    def explains(self, r):
        return r <= self.rtol or (r <= EXPLAIN_RTOL and r <= EXPLAIN_REDUCTION * self.e0)

    def _consider(self, ids, text, r, rank):
        self.order += 1
        if not self.explains(r):
            return
        strict = r <= self.rtol
        key = (len(ids), 0 if strict else 1, rank, self.order if strict else r)
        if self.best is None or key < self.best[0]:
            self.best = (key, ids, text, r)

    def try_base(self, ids, text, cand, rank=0):
        if self.budget <= 0 or cand.shape != self.act.shape or not np.all(np.isfinite(cand)):
            return
        self.budget -= 1
        if ids:
            self._consider(ids, text, _rel(self.act, cand, self.scale), rank)
        room = MAX_PITFALLS - len(ids)
        if room <= 0:
            return
        denom = float(np.vdot(cand, cand))
        if denom <= 0:
            return
        coef = float(np.vdot(cand, self.act)) / denom
        if not np.isfinite(coef) or coef == 0:
            return
        rc = _rel(self.act, coef * cand, self.scale)
        if not self.explains(rc):
            return
        named = False
        for k, sids, labels, v in self.products:
            if k > room:
                break
            if abs(v / coef - 1.0) > self.coef_rtol:
                continue
            self.budget -= 1
            r = _rel(self.act, v * cand, self.scale)
            if self.explains(r):
                named = True
                where = f"{text}, times " if text else "output = "
                tail = "" if text else " × expected"
                self._consider(ids + sids, where + " × ".join(labels) + tail, r, rank + k)
        if not named and not ids and self.unnamed is None:
            self.unnamed = (coef, rc)

    def run(self, levels):
        self.try_base((), "", self.expected)
        for level, bases in enumerate(levels, 1):
            if self.best is not None and self.best[0][0] < level:
                break
            for ids, text, cand in (bases() if callable(bases) else bases):
                self.try_base(ids, text, cand, 2 if ids[-1] in ("negated", "transposed",
                                                                "symmetrised") else 0)
                if self.budget <= 0:
                    break
        return self

    def diagnosis(self):
        if self.best is None:
            return None
        _, ids, text, r = self.best
        if r > self.rtol:
            text += f"; up to {r:.1g} relative remains (a small additive term?)"
        return Diagnosis("+".join(ids), text, r)


def _layer_blocks(case, cap, act):
    """(index, kind, slice, meta) of every parametric layer of a network case whose output
    is a [P, P] curvature matrix (declared layouts permute within a layer only)."""
    net = case.params.get("net") if isinstance(case.params, dict) else None
    if not net or act.ndim != 2 or act.shape[0] != act.shape[1]:
        return []
    out, off, i = [], 0, 0
    for s in net:
        if s.get("kind") == "dense":
            p, q, extra = s["d_in"] + s["bias"], s["d_out"], {}
        elif s.get("kind") == "conv2d":
            p = s["kernel"][0] * s["kernel"][1] * s["c_in"] + s["bias"]
            q = s["c_out"]
            extra = {"T": case.meta.get("T"), "kernel": list(s["kernel"]), "c_in": s["c_in"]}
        else:
            continue
        meta = {"N": case.meta.get("N"), "p": p, "q": q, **extra}
        if s.get("kind") == "dense" and case.meta.get("T") and not any(
                x.get("kind") == "conv2d" for x in net):
            meta["T"] = case.meta["T"]  # a weight-shared dense layer
        out.append((i, s["kind"], slice(off, off + p * q), meta))
        off += p * q
        i += 1
    return out if off == act.shape[0] and len(out) > 1 else []


def _per_layer(act, expected, case, cap, conv, rtol, levels):
    blocks = _layer_blocks(case, cap, act)
    if not blocks:
        return None
    mask = np.ones(act.shape, dtype=bool)
    for _, _, sl, _ in blocks:
        mask[sl, sl] = False
    den = max(float(np.linalg.norm(expected)), case.tolerance.scale, 1e-300)
    if float(np.linalg.norm((act - expected)[mask])) / den > rtol:
        return None  # the off-diagonal blocks differ: not a per-layer fault
    flat = [[(ids, text, arr) for ids, text, arr in lvl] if not callable(lvl) else lvl()
            for lvl in levels]
    parts, texts, worst = [], [], 0.0
    for i, kind, sl, meta in blocks:
        sub_act, sub_exp = act[sl, sl], expected[sl, sl]
        scale = case.tolerance.scale
        if _rel(sub_act, sub_exp, scale) <= rtol:
            texts.append(f"layer {i} ({kind}): matches")
            continue
        sub_levels = [[(ids, text, arr[sl, sl]) for ids, text, arr in lvl
                       if arr.shape == act.shape] for lvl in flat]
        s = _Search(sub_act, sub_exp, rtol, scale, _scalar_factors(case, meta)).run(sub_levels)
        d = s.diagnosis()
        if d is None:
            return None
        parts.append(f"{i}={d.pitfall}")
        texts.append(f"layer {i} ({kind}, parameters {sl.start}:{sl.stop}): {d.pitfall}: "
                     f"{d.explanation}")
        worst = max(worst, d.rel_err)
    if not parts:
        return None
    return Diagnosis("per_layer:" + ",".join(parts), "; ".join(texts), worst)


def diagnose(actual, case, cap, conv, rtol, coef_rtol=1e-3) -> Diagnosis:
    """Name the pitfall (or the fewest pitfalls, up to three) that reconcile ``actual`` with
    the reference, if any; for a network's curvature matrix, per layer when no single
    explanation covers all of it.  ``coef_rtol``: how far the fitted scale may be from a
    named scalar (1e-3; larger for a Monte-Carlo estimate, whose scale is uncertain)."""
    expected = cap.expected_for(case, conv)
    act = as_float64(actual)
    scale = case.tolerance.scale
    if act is None:
        return Diagnosis("shape", f"the output is not a real array ({type(actual).__name__})")
    if act.shape != expected.shape:
        return _diagnose_shape(act, expected, case, cap, conv, rtol)
    if not np.all(np.isfinite(act)):
        bad = int(np.sum(~np.isfinite(act)))
        extra = ""
        if "no_eigenvalue_clipping" in case.alternatives:
            extra = "; eigenvalue clipping is the usual cause"
        return Diagnosis("non_finite", f"{bad} of {act.size} entries are NaN/Inf{extra}")

    levels = _bases(cap, case, conv)
    search = _Search(act, expected, rtol, scale, _scalar_factors(case),
                     coef_rtol=coef_rtol).run(levels)
    d = search.diagnosis()
    if d is not None:
        return d
    layered = _per_layer(act, expected, case, cap, conv, rtol, levels)
    if layered is not None:
        return layered
    if search.unnamed is not None:
        coef, rc = search.unnamed
        return Diagnosis("scale", f"output = {coef:.6g} × expected (no known factor of N, |T|, "
                                  "2 or the factor sizes)", rc)
    rel = compare(act, expected, rtol, scale).rel_err
    return Diagnosis("unexplained", f"relative error {rel:.3e} (rtol {rtol:.1e}); no known "
                                    f"pitfall, nor up to {MAX_PITFALLS} of them together, "
                                    "reconciles the numbers", rel)


def _diagnose_shape(act, expected, case, cap, conv, rtol):
    scale = case.tolerance.scale
    # an undeclared convention can change the layout (e.g. a transposed parameter matrix):
    # try the convention candidates that have the output's shape first
    if np.all(np.isfinite(act)):
        shaped = [x for x in list(_flip_candidates(cap, case, conv)) +
                  list(_pair_flip_candidates(cap, case, conv)) if x[2].shape == act.shape]
        factors = [("", "", 1.0)] + _scalar_factors(case)
        for spid, label, f in factors:  # exact conventions first, then with a factor
            for pid, text, cand in shaped:
                c = compare(act, f * cand, rtol, scale)
                if c.ok:
                    if spid:
                        return Diagnosis(f"{pid}+{spid}", f"{text}, times {label}", c.rel_err)
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
