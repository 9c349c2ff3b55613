"""Mutants of the linear-algebra and moving-average capabilities (one pitfall each)."""

from __future__ import annotations

import math

import numpy as np

from ..adapter import implements
from ._base import AlteredReference, Mutant

_M = "conformance.mutants.linalg_mutants"

#: the capabilities the split of a factored damping shows in: the damping pair, the damped
#: inverse and the damped power
DAMPED_SPLIT = ("linalg.pi_adjusted_damping", "linalg.factored_damped_inverse_matvec",
                "linalg.factored_damped_matpower_matvec")


def _pi_no_dims(a, g):
    ta, tg = float(np.trace(a)), float(np.trace(g))
    return math.sqrt(ta / tg) if ta and tg else 1.0


def _inv_pow(m, exp, damping):
    s, q = np.linalg.eigh(m)
    return (q * (np.maximum(s, 0) + damping) ** exp) @ q.T


class KronSwapped(Mutant):
    name = "mutant_kron_swapped"
    pitfall = "row-major vec of the [out, in] weight read as kron(A, G): returns kron(G, A)"
    EXPECTED = {"linalg.kron": "kron_order_swapped", "linalg.kron_matvec": "kron_order_swapped"}

    @implements("linalg.kron")
    def kron(self, inputs, params):
        return np.kron(inputs["g"], inputs["a"])

    @implements("linalg.kron_matvec")
    def kron_matvec(self, inputs, params):
        return np.kron(inputs["g"], inputs["a"]) @ inputs["v"]


class BiasFirst(Mutant):
    name = "mutant_bias_first"
    pitfall = "homogeneous coordinate prepended instead of appended"
    EXPECTED = {"linalg.homog_cov": "bias_position"}

    @implements("linalg.homog_cov")
    def homog_cov(self, inputs, params):
        a = inputs["a"]
        ab = np.concatenate([np.ones((a.shape[0], 1)), a], axis=1)
        return ab.T @ ab / a.shape[0]


class MeanLossGradients(Mutant):
    name = "mutant_mean_loss_gradients"
    pitfall = ("rows are gradients of the mean loss (g/N), so the covariance carries 1/N² "
               "(wiseodd/natural-gradients#2)")
    EXPECTED = {"linalg.compute_cov": "scale:1/N^2", "linalg.cross_cov": "scale:1/N^2"}

    @implements("linalg.compute_cov")
    def compute_cov(self, inputs, params):
        x = inputs["x"] / inputs["x"].shape[0]
        return x.T @ x / x.shape[0]

    @implements("linalg.cross_cov")
    def cross_cov(self, inputs, params):
        n = inputs["x"].shape[0]
        return (inputs["x"] / n).T @ (inputs["y"] / n) / n


class _WrongSplit(Mutant):
    """Factored damping ``(A + d_A I) ⊗ (G + d_G I)`` with the wrong split
    ``(d_A, d_G) = _split(A, G, λ)``: the damping pair, the damped inverse and (where a
    subclass declares it) the damped power all use it."""

    def _split(self, a, g, damping):
        raise NotImplementedError

    @implements("linalg.pi_adjusted_damping")
    def pi_adjusted_damping(self, inputs, params):
        return np.array(self._split(inputs["a"], inputs["g"], params["damping"]))

    def _apply(self, inputs, exp, damping):
        a, g, v = inputs["a"], inputs["g"], inputs["v"]
        d_a, d_g = self._split(a, g, damping)
        return np.kron(_inv_pow(a, exp, d_a), _inv_pow(g, exp, d_g)) @ v

    @implements("linalg.factored_damped_inverse_matvec")
    def factored_inverse(self, inputs, params):
        return self._apply(inputs, -1.0, params["damping"])


class _WrongPi(_WrongSplit):
    """The π-split ``(π√λ, √λ/π)`` with a wrong ``π = _pi(A, G)``, reported as the trace-norm
    π too."""

    @staticmethod
    def _pi(a, g):
        raise NotImplementedError

    def _split(self, a, g, damping):
        pi, root = self._pi(a, g), math.sqrt(damping)
        return pi * root, root / pi

    @implements("linalg.pi_tracenorm")
    def pi_tracenorm(self, inputs, params):
        return np.asarray(self._pi(inputs["a"], inputs["g"]))


class _WrongSplitPower(_WrongSplit):
    """A :class:`_WrongSplit` whose damped power uses the wrong split too."""

    @implements("linalg.factored_damped_matpower_matvec")
    def factored_matpower(self, inputs, params):
        return self._apply(inputs, params["exp"], params["damping"])


class PiWithoutDimensions(_WrongPi, _WrongSplitPower):
    name = "mutant_pi_without_dimensions"
    pitfall = "π = sqrt(tr A / tr G), without dividing the traces by the dimensions"
    EXPECTED = dict.fromkeys(("linalg.pi_tracenorm", *DAMPED_SPLIT), "pi_without_dimensions")
    _pi = staticmethod(_pi_no_dims)


class UnsplitDamping(_WrongSplitPower):
    name = "mutant_unsplit_damping"
    pitfall = "the same λ added to both factors: (A + λI) ⊗ (G + λI)"
    EXPECTED = dict.fromkeys(DAMPED_SPLIT, "unsplit_damping")

    def _split(self, a, g, damping):
        return damping, damping


class ExactForFactored(Mutant):
    name = "mutant_exact_for_factored"
    pitfall = "exact damping (A⊗G + λI)⁻¹ where factored Tikhonov damping is asked for"
    EXPECTED = {"linalg.factored_damped_inverse_matvec": "exact_damping",
                "networks.kfac_inverse_matvec": ("exact_damping", "factored_damping")}

    @implements("networks.kfac_inverse_matvec")
    def net_kfac_inverse(self, inputs, params):
        return super().net_kfac_inverse(inputs, dict(params, exact=not params["exact"]))

    @implements("linalg.factored_damped_inverse_matvec")
    def factored_inverse(self, inputs, params):
        a, g, v = inputs["a"], inputs["g"], inputs["v"]
        return np.linalg.solve(np.kron(a, g) + params["damping"] * np.eye(v.size), v)


class NoZeroDebias(Mutant):
    name = "mutant_no_zero_debias"
    pitfall = "moving average reported as the raw weighted sum (not zero-debiased)"
    EXPECTED = {"averaging.ema": "no_zero_debias"}

    @implements("averaging.ema")
    def ema(self, inputs, params):
        s, out = np.zeros_like(inputs["xs"][0]), []
        for x in inputs["xs"]:
            s = params["decay"] * s + params["weight"] * x
            out.append(s)
        return np.stack(out)


class SymmetrisedCross(Mutant):
    name = "mutant_symmetrised_cross_cov"
    pitfall = "a cross moment XᵀY/n symmetrised as if it were a covariance"
    EXPECTED = {"linalg.cross_cov": "symmetrised"}

    @implements("linalg.cross_cov")
    def cross_cov(self, inputs, params):
        c = inputs["x"].T @ inputs["y"] / inputs["x"].shape[0]
        return (c + c.T) / 2


class NaNOutput(AlteredReference):
    name = "mutant_nan"
    pitfall = "returns NaN where a power of a singular matrix is taken without clipping"
    EXPECTED = {"linalg.damped_matpower": "non_finite"}

    def alter(self, reference, inputs, params):
        out = np.asarray(reference(inputs, params))
        return np.where(np.eye(out.shape[0]) > 0, np.nan, out)


class EmptyOutput(Mutant):
    name = "mutant_empty"
    pitfall = "returns an empty array (an empty comparison must never pass)"
    EXPECTED = {"linalg.kron": "shape"}

    @implements("linalg.kron")
    def kron(self, inputs, params):
        return np.zeros((0,))


MUTANTS = [KronSwapped, BiasFirst, MeanLossGradients, PiWithoutDimensions, UnsplitDamping,
           ExactForFactored, NoZeroDebias, SymmetrisedCross, NaNOutput, EmptyOutput]
ADAPTERS = {m.name: f"{_M}:{m.__name__}" for m in MUTANTS}


# -- blocks ------------------------------------------------------------------------------------
class MissingBlockScale(AlteredReference):
    name = "mutant_missing_block_scale"
    pitfall = "conv/multi-use block without its |T| (T) multiplier"
    EXPECTED = dict.fromkeys(("blocks.kron_matpower", "blocks.kron_eigenvalues",
                              "blocks.diagonal_matpower"), "missing_block_scale")

    def alter(self, reference, inputs, params):
        return reference(inputs, dict(params, scale=1.0))


class DampingNotNormalised(AlteredReference):
    name = "mutant_damping_not_normalised"
    pitfall = "λ split between the factors of s·(A⊗G) without dividing it by s"
    EXPECTED = {"blocks.kron_matpower": "damping_not_normalised"}

    def alter(self, reference, inputs, params):
        return reference(inputs, dict(params, damping=params["damping"] * params["scale"]))


class SeriesSignedEigenvalues(Mutant):
    name = "mutant_series_signed_eigenvalues"
    pitfall = "option-1 series inverse with signed ψ where TF's posdef_eig takes |ψ|"
    EXPECTED = {"blocks.series_inverse": "signed_eigenvalues"}

    @implements("blocks.series_inverse")
    def series_inverse(self, inputs, params):
        from kfac_ref.blocks.tf import FullyConnectedSeriesFB

        from ..catalogue.blocks_cases import series_apply

        fb = FullyConnectedSeriesFB(
            inputs["a_cov"], inputs["g_cov"], params["damping"], params["num_timesteps"],
            has_bias=params["has_bias"], option=params["option"],
            input_cov_dt1=inputs["a_cov_dt1"], output_cov_dt1=inputs["g_cov_dt1"],
            option1_eig_method="eigh")
        return series_apply(fb, inputs["x"])


MUTANTS += [MissingBlockScale, DampingNotNormalised, SeriesSignedEigenvalues]
ADAPTERS = {m.name: f"{_M}:{m.__name__}" for m in MUTANTS}
