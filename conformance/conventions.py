"""Conventions an implementation declares, and how the suite moves the reference into them.

The reference (kfac_ref) has one canonical convention for everything (see ``CANONICAL``).
An adapter declares where its implementation differs; the suite converts the reference's
expected outputs (and, where a layout is involved, the inputs it hands over) into the declared
conventions before comparing.  A difference that a declared convention explains therefore
passes, and the report says which declaration explained it.

Each field below is documented in :data:`FIELDS` (allowed values and meaning); the README's
"Conventions" table is generated from the same text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import numpy as np

__all__ = ["Conventions", "CANONICAL", "FIELDS", "kron_index", "vec_index", "a_index",
           "patch_index"]


@dataclass(frozen=True)
class Conventions:
    """Conventions of an implementation under test (defaults are the reference's)."""

    kron_order: str = "AG"
    bias_position: str = "last"
    curvature_of: str = "mean"
    mse_variance: float | None = None
    conv_style: str = "kfc"
    patch_order: str = "hwc"
    symmetrised: bool = True
    ema_style: str = "zero_debias"
    empirical_fisher_scale: str = "per_example"
    empirical_fisher_unit: str = "example"
    damping_per_factor: str = "sqrt"
    ema_init: str = "zero"
    ema_weight: str = "given"

    def __post_init__(self):
        for f in fields(self):
            allowed = FIELDS[f.name][0]
            value = getattr(self, f.name)
            if allowed is not None and value not in allowed:
                raise ValueError(
                    f"Conventions: {f.name} must be one of {allowed}; got {value!r}."
                )
        if self.mse_variance is not None and not (
                isinstance(self.mse_variance, (int, float)) and self.mse_variance > 0):
            raise ValueError(
                "Conventions: mse_variance must be None or a positive number; got "
                f"{self.mse_variance!r}."
            )

    def differences(self, relevant=None) -> dict:
        """Fields that differ from :data:`CANONICAL` (restricted to ``relevant`` names)."""
        out = {}
        for f in fields(self):
            if relevant is not None and f.name not in relevant:
                continue
            if getattr(self, f.name) != getattr(CANONICAL, f.name):
                out[f.name] = getattr(self, f.name)
        return out

    def with_(self, **changes) -> Conventions:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> Conventions:
        return cls(**d)


#: field -> (allowed values or None, meaning)
FIELDS = {
    "kron_order": (
        ("AG", "GA"),
        "'AG': the dense block is kron(A, G) acting on the row-major flattening of the "
        "[d_in+1, d_out] matrix [W; b] (TF, kfac-jax, kfac_ref). 'GA': kron(G, A) acting on "
        "the row-major flattening of the [d_out, d_in+1] matrix (PyTorch weight layout: "
        "curvlinops, BackPACK, ASDL, nngeometry). Vectors handed to the implementation and "
        "matrices expected from it are permuted accordingly (a perfect shuffle).",
    ),
    "bias_position": (
        ("last", "first", "separate"),
        "Where the homogeneous coordinate (the bias) sits in the input factor A and in the "
        "parameter vector of a layer: 'last' (kfac_ref, TF, kfac-jax with a list pytree), "
        "'first' (e.g. a {'b','w'} dict pytree), or 'separate': the bias is its own block "
        "after the weight (PyTorch's [W.flatten(), b]; curvlinops' default "
        "separate_weight_and_bias=True, BackPACK, ASDL), so input factors come without the "
        "homogeneous coordinate, parameter vectors are [weight (in kron_order); bias], and a "
        "K-FAC block loses its weight–bias cross terms (block-diagonal over W and b).",
    ),
    "curvature_of": (
        ("mean", "sum"),
        "Curvature of the mean loss (1/N)Σℓ_n (reference; G = (1/N)Σ g gᵀ with g the "
        "per-example gradient) or of the sum loss Σℓ_n (G, blocks and curvature matrices N "
        "times larger; curvlinops/BackPACK with reduction='sum').",
    ),
    "mse_variance": (
        None,
        "None (reference): the implementation takes the Gaussian variance v of a normal-mean "
        "(squared-error) loss from the case parameters. A number: the implementation's "
        "squared-error loss always corresponds to that variance, whatever the case asks, and "
        "its output-space curvature is I/v: 1.0 means ½‖f−y‖² (ASDL, nngeometry), 0.5 means "
        "‖f−y‖² (PyTorch MSELoss(reduction='sum'): curvlinops, BackPACK; kfac-jax's "
        "register_squared_error_loss). The reference is rescaled by v_case / v for "
        "curvatures and by (v_case / v)² for empirical-Fisher quantities (outer products of "
        "gradients at the data targets).",
    ),
    "conv_style": (
        ("kfc", "expand", "reduce", "hybrid"),
        "Convolution factors: 'kfc' A=ΣāāᵀN⁻¹|T|⁻¹, G=ΣggᵀN⁻¹|T|⁻¹, block |T|·A⊗G (TF, "
        "kfac-jax, reference); 'expand' the same block with A=Σāāᵀ/(N|T|), G=Σggᵀ/N "
        "(curvlinops 'expand'); 'reduce' KFAC-reduce (location-averaged inputs, "
        "location-summed gradients); 'hybrid' A of expand times |T| with G of reduce "
        "(BackPACK; its conv bias block is G of reduce). Reduce and hybrid are reference "
        "alternatives computed by kfac_ref (factors, networks.kfac and the network factors).",
    ),
    "patch_order": (
        ("hwc", "chw"),
        "Order of a convolution patch vector (and of the kernel's input dimension): 'hwc' "
        "(kh, kw, C_in) with C_in fastest (TF, kfac-jax, reference); 'chw' C_in slowest "
        "(PyTorch unfold: c·kh·kw + i·kw + j). The bias coordinate stays where bias_position "
        "puts it.",
    ),
    "symmetrised": (
        (True, False),
        "Whether covariances are explicitly symmetrised ((XᵀX + (XᵀX)ᵀ)/2, TF) or not "
        "(kfac-jax). Only rounding differs; recorded for the report, never converted.",
    ),
    "ema_style": (
        ("zero_debias", "raw"),
        "Moving averages: 'zero_debias' reports S_k/W_k (TF ZERO_DEBIAS=True, kfac-jax "
        "WeightedMovingAverage, reference); 'raw' reports the weighted sum S_k (TF "
        "ZERO_DEBIAS=False).",
    ),
    "empirical_fisher_scale": (
        ("per_example", "kfac_jax"),
        "Empirical Fisher statistics: 'per_example' (1/N)Σ∇ℓ_n∇ℓ_nᵀ (TF, curvlinops, "
        "reference) or 'kfac_jax' with the extra 1/N of kfac-jax's fisher_empirical.",
    ),
    "empirical_fisher_unit": (
        ("example", "loss_term"),
        "What one outer product of the empirical Fisher is taken over: 'example' (reference, "
        "TF, kfac-jax) (1/N)Σ_n∇ℓ_n∇ℓ_nᵀ with ℓ_n summing an example's per-position losses; "
        "'loss_term' (curvlinops' EFLinearOperator) (1/N)Σ_{n,s}∇ℓ_{ns}∇ℓ_{ns}ᵀ over every "
        "loss term (n, s) of a per-position loss. They differ only for outputs with "
        "positions ([N, S, C]).",
    ),
    "damping_per_factor": (
        ("sqrt", "lambda"),
        "How the damping λ an implementation is given reaches the two factors: 'sqrt' "
        "(reference, TF, kfac-jax) λ is the block's damping, each factor receives √λ "
        "(scaled by π and 1/π): (A + π√λ I)⊗(G + √λ/π I); 'lambda' the value given is each "
        "factor's damping: (A + πλ I)⊗(G + λ/π I) (or A + λI, G + λI without π) — the "
        "reference with damping λ². The suite converts the reference's split (×√λ) and the "
        "factored damped products (a stored reference alternative computed with λ²).",
    ),
    "ema_init": (
        ("zero", "first"),
        "Start of a moving average: 'zero' (reference, TF, kfac-jax) S₀ = 0 (then debiased "
        "or raw, see ema_style); 'first' the average is initialised at the first statistic, "
        "m₁ = X₁, m_k = decay·m_{k−1} + w·X_k, with no debiasing (equal to the debiased "
        "average after one update only). The suite recomputes the declared recursion from "
        "the statistics behind the reference's values (averaging.ema).",
    ),
    "ema_weight": (
        ("given", "one_minus_decay"),
        "Weight w of the new statistic in a moving average: 'given' (reference, TF "
        "ema_weight, kfac-jax ema_new) the value the caller passes; 'one_minus_decay' w is "
        "tied to 1 − decay whatever is passed (PyTorch-style running averages). A zero-"
        "debiased average does not depend on w; raw sums and averages started at the first "
        "statistic do (averaging.ema).",
    ),
}

CANONICAL = Conventions()


# -- index maps (host-side, numpy) ---------------------------------------------------------
def patch_index(kernel_hw, c_in: int, patch_order: str) -> np.ndarray:
    """Index map of a patch vector (without bias): declared position -> canonical index.

    Canonical order is (k_1, ..., k_r, C_in) with C_in fastest; 'chw' puts C_in slowest."""
    k = int(np.prod(kernel_hw))
    canon = np.arange(k * c_in).reshape(k, c_in)  # [spatial offset, channel]
    if patch_order == "chw":
        return canon.T.reshape(-1)
    return canon.reshape(-1)


def a_index(p: int, bias_position: str, has_bias: bool = True, patch=None,
            patch_order: str = "hwc") -> np.ndarray:
    """Index map for the A side (length p): entry j of the declared layout is entry
    ``a_index[j]`` of the canonical layout.  ``patch = (kernel_spatial_shape, C_in)`` for
    convolution inputs (then ``patch_order`` applies to the non-bias part)."""
    core = p - 1 if has_bias else p
    idx = np.arange(core)
    if patch is not None:
        idx = patch_index(patch[0], patch[1], patch_order)
    if has_bias:
        if bias_position == "first":
            return np.concatenate([[core], idx])
        if bias_position == "separate":
            return idx  # the factor comes without the homogeneous coordinate
        return np.concatenate([idx, [core]])
    return idx


def vec_index(p: int, q: int, conv: Conventions, has_bias: bool = False,
              patch=None) -> np.ndarray:
    """Index map from the canonical row-major vec of a [p, q] matrix (A side rows, G side
    columns) to the declared vec: ``v_declared = v_canonical[vec_index(...)]``."""
    ai = a_index(p, conv.bias_position, has_bias, patch, conv.patch_order)
    grid = ai[:, None] * q + np.arange(q)[None, :]  # [p, q], rows permuted
    if conv.kron_order == "GA":
        grid = grid.T  # the declared vector is the row-major vec of the [q, p] transpose
    flat = grid.reshape(-1)
    if has_bias and conv.bias_position == "separate":
        flat = np.concatenate([flat, (p - 1) * q + np.arange(q)])  # [weight; bias]
    return flat


def kron_index(p: int, q: int, conv: Conventions, has_bias: bool = False,
               patch=None) -> np.ndarray:
    """Alias of :func:`vec_index`, applied to both rows and columns of a block matrix."""
    return vec_index(p, q, conv, has_bias, patch)
