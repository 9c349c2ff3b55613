"""Mutants for the diagnosis itself: the other Kronecker order in a declared layout, a small
epsilon on top of a pitfall, structural ratios, compositions of two and three pitfalls, a
different fault per layer, the damping and moving-average conventions, and a fault that no
pitfall explains (which must stay ``unexplained``).

``EXPECTED`` maps each broken capability to its pitfall id(s); ``EXPECTED_CASES`` (case-id
pattern -> pitfall id, or ``"pass"``) pins the exact diagnosis case by case where a mutant's
fault shows differently in different cases (e.g. a factor 1/N² that is 1 when N = 1).
"""

from __future__ import annotations

import math

import numpy as np

from ..adapter import implements
from ..conventions import Conventions
from ._base import AlteredReference, Mutant
from .linalg_mutants import DAMPED_SPLIT, _inv_pow, _WrongPi

_M = "conformance.mutants.diagnosis_mutants"


class KronSwappedDeclaredGA(Mutant):
    name = "mutant_kron_swapped_ga"
    pitfall = ("code written for kron(A, G) on the [d_in+1, d_out] layout, declared as the "
               "PyTorch layout kron_order='GA' (p ≠ q)")
    conventions = Conventions(kron_order="GA")
    EXPECTED = {c: "kron_order_swapped" for c in (
        "linalg.kron", "linalg.kron_matvec", "linalg.factored_damped_inverse_matvec",
        "linalg.exact_damped_inverse_matvec", "linalg.factored_damped_matpower_matvec")}


def _pi_eps(a, g, eps=1e-8):
    return math.sqrt(float(np.trace(a)) / float(np.trace(g)) + eps)


class PiWithoutDimensionsEpsilon(_WrongPi):
    name = "mutant_pi_without_dimensions_eps"
    pitfall = "π = sqrt(tr A / tr G + 1e-8): no dimension normalisation, plus a safety epsilon"
    EXPECTED = dict.fromkeys(("linalg.pi_tracenorm", "linalg.pi_adjusted_damping",
                              "linalg.factored_damped_inverse_matvec"), "pi_without_dimensions")
    _pi = staticmethod(_pi_eps)


class ConvInputKernelAverage(AlteredReference):
    name = "mutant_conv_input_kernel_average"
    pitfall = "conv input factor averaged over the kernel offsets (divided by k_h·k_w)"
    EXPECTED = {"factors.conv_input": "scale:1/kernel"}
    # a 3×3 kernel divides by 9 = N²: the numbers cannot tell the two apart, and the
    # diagnosis names the more common cause first
    EXPECTED_CASES = {"factors.conv_input/same_*": "scale:1/N^2"}

    def alter(self, reference, inputs, params):
        k = params["filter_shape"][0] * params["filter_shape"][1]
        return np.asarray(reference(inputs, params)) / k


def _kfac(self, inputs, params, mode=None):
    return np.asarray(super(type(self), self).net_kfac(
        inputs, dict(params, mode=mode or params["mode"])))


class EmpiricalMeanLoss(Mutant):
    name = "mutant_empirical_mean_loss"
    pitfall = ("K-FAC from the data labels with gradients of the mean loss as per-example "
               "gradients: empirical Fisher and 1/N² together")
    EXPECTED = {"networks.kfac": "empirical_fisher+scale:1/N^2"}
    EXPECTED_CASES = {"networks.kfac/*_fisher_empirical": "pass",
                      "networks.kfac/mlp_tanh_n1_ce_*": "empirical_fisher"}

    @implements("networks.kfac")
    def net_kfac(self, inputs, params):
        if params["mode"] == "fisher_empirical":
            return _kfac(self, inputs, params)
        n = inputs["x"].shape[0]
        return _kfac(self, inputs, params, "fisher_empirical") / n ** 2


class EmpiricalMeanLossTorchLayout(Mutant):
    name = "mutant_empirical_mean_loss_torch_layout"
    pitfall = ("empirical Fisher, 1/N² and the PyTorch parameter layout (kron(G, A)) while "
               "declaring the reference's: three pitfalls together")
    EXPECTED = {"networks.kfac": "empirical_fisher+kron_order_swapped+scale:1/N^2"}
    EXPECTED_CASES = {"networks.kfac/mlp_tanh_n1_ce_fisher_empirical": "kron_order_swapped",
                      "networks.kfac/mlp_tanh_n1_ce_*": "empirical_fisher+kron_order_swapped",
                      "networks.kfac/*_fisher_empirical": "kron_order_swapped+scale:1/N^2"}

    @implements("networks.kfac")
    def net_kfac(self, inputs, params):
        from ..catalogue.networks_cases import _param_index

        n = inputs["x"].shape[0]
        k = _kfac(self, inputs, params, "fisher_empirical") / n ** 2
        idx = _param_index(params["net"], Conventions(kron_order="GA"))
        return k[np.ix_(idx, idx)]


class PerLayerScales(Mutant):
    name = "mutant_per_layer_scales"
    pitfall = ("true-Fisher K-FAC with per-example gradients of the mean loss (1/N²) in every "
               "block, and the conv block normalised by |T| once more: conv × 1/(N²·|T|) next "
               "to dense × 1/N²")
    EXPECTED = {"networks.kfac": "scale:1/N^2"}
    EXPECTED_CASES = {
        "networks.kfac/*_fisher_empirical": "pass",
        "networks.kfac/cnn_pool_n3_mse_*": "per_layer:0=scale:1/N^2+scale:1/T,1=scale:1/N^2",
        "networks.kfac/mlp_tanh_n1_ce_*": "pass"}

    @implements("networks.kfac")
    def net_kfac(self, inputs, params):
        from ..catalogue.networks_cases import _layer_geometry

        k = _kfac(self, inputs, params).copy()
        if params["mode"] == "fisher_empirical":
            return k  # (there the extra 1/N would also read as kfac-jax's empirical scale)
        n = inputs["x"].shape[0]
        specs = [s for s in params["net"] if s["kind"] in ("dense", "conv2d")]
        for s, (off, p, q, _, _) in zip(specs, _layer_geometry(params["net"]), strict=True):
            sl = slice(off, off + p * q)
            f = 1.0 / n ** 2
            if s["kind"] == "conv2d":
                x = inputs["x"]
                kh, kw = s["kernel"]
                f /= (x.shape[1] - kh + 1) * (x.shape[2] - kw + 1)  # |T| of a VALID conv
            k[sl, :] *= math.sqrt(f)
            k[:, sl] *= math.sqrt(f)
        return k


class PiWithoutDimensionsConvDamping(Mutant):
    name = "mutant_pi_without_dimensions_conv_damping"
    pitfall = ("a conv block's factored damped power with π = sqrt(tr A / tr G) (no dimension "
               "normalisation) and the damping λ not divided by |T| (λ for λ/|T|)")
    EXPECTED = {"blocks.kron_matpower": "pi_without_dimensions+damping_not_normalised"}
    EXPECTED_CASES = {  # |T| = 1: only the π fault shows; exact damping and p = 1 have no π
        "blocks.kron_matpower/*_scale1_factored": "pi_without_dimensions",
        "blocks.kron_matpower/*_exact": "pass",
        "blocks.kron_matpower/p1_*": "pass",
    }

    @implements("blocks.kron_matpower")
    def kron_matpower(self, inputs, params):
        p, lam, s = params["power"], params["damping"], params["scale"]
        if params["exact"] or p == 1.0 or lam == 0.0:
            return super().kron_matpower(inputs, params)
        a, g, x = (np.asarray(inputs[k], dtype=np.float64) for k in ("a", "g", "x"))
        pi = math.sqrt(float(np.trace(a)) / float(np.trace(g)))
        root = math.sqrt(lam)
        return s ** p * _inv_pow(a, p, pi * root) @ x @ _inv_pow(g, p, root / pi)


class UnexplainedFactor(Mutant):
    name = "mutant_unexplained"
    pitfall = ("a wrong input factor (A + 0.01·E for a fixed E): no known pitfall explains it, "
               "so the diagnosis must not name one")
    EXPECTED = {"linalg.kron": "unexplained", "linalg.kron_matvec": "unexplained"}

    @staticmethod
    def _bad(a):
        e = np.cos(np.arange(a.size, dtype=np.float64)).reshape(a.shape)
        return a + 0.01 * (e + e.T)

    @implements("linalg.kron")
    def kron(self, inputs, params):
        return np.kron(self._bad(inputs["a"]), inputs["g"])

    @implements("linalg.kron_matvec")
    def kron_matvec(self, inputs, params):
        return np.kron(self._bad(inputs["a"]), inputs["g"]) @ inputs["v"]


class DampingPerFactor(AlteredReference):
    name = "mutant_damping_per_factor"
    pitfall = "the damping given is added to each factor (π·λ, λ/π) where √λ is declared"
    EXPECTED = dict.fromkeys(DAMPED_SPLIT, "damping_parameterisation")

    def alter(self, reference, inputs, params):
        return reference(inputs, dict(params, damping=params["damping"] ** 2))


class _TiedEma(Mutant):
    """The running average ``m ← δm + (1 − δ)X`` (the new statistic's weight tied to the
    decay), from ``m = 0``, or from ``m₁ = X₁`` where ``first`` is set."""

    first = False

    @implements("averaging.ema")
    def ema(self, inputs, params):
        d, xs = params["decay"], inputs["xs"]
        out, m = [], np.zeros_like(xs[0])
        for i, x in enumerate(xs):
            m = x if self.first and i == 0 else d * m + (1.0 - d) * x
            out.append(m)
        return np.stack(out)


class EmaFirstStatistic(_TiedEma):
    name = "mutant_ema_first_statistic"
    pitfall = ("running average m₁ = X₁, m ← δm + (1 − δ)X (PyTorch style), declared as the "
               "zero-debiased average")
    EXPECTED = {"averaging.ema": "ema_first_statistic+ema_weight_tied"}
    EXPECTED_CASES = {"averaging.ema/k5_decay0.95_weight0.05": "ema_first_statistic",
                      "averaging.ema/k3_decay0_weight1": "pass"}
    first = True


class EmaWeightTied(_TiedEma):
    name = "mutant_ema_weight_tied"
    pitfall = ("raw moving sum declared (ema_style='raw') but the new statistic weighted by "
               "1 − δ instead of the weight passed")
    conventions = Conventions(ema_style="raw")
    EXPECTED = {"averaging.ema": "ema_weight_tied"}
    EXPECTED_CASES = {"averaging.ema/k4_decay0.9_weight1": "ema_weight_tied",
                      "averaging.ema/k5_decay0.95_weight0.05": "pass",
                      "averaging.ema/k3_decay0_weight1": "pass"}


MUTANTS = [KronSwappedDeclaredGA, PiWithoutDimensionsEpsilon, ConvInputKernelAverage,
           EmpiricalMeanLoss, EmpiricalMeanLossTorchLayout, PerLayerScales, UnexplainedFactor,
           DampingPerFactor, EmaFirstStatistic, EmaWeightTied, PiWithoutDimensionsConvDamping]
ADAPTERS = {m.name: f"{_M}:{m.__name__}" for m in MUTANTS}
