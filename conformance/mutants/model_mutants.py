"""Mutants of the factor, loss and network capabilities (one pitfall each)."""

from __future__ import annotations

import numpy as np

from ..adapter import implements
from ._base import AlteredReference, Mutant

_M = "conformance.mutants.model_mutants"


class MeanLossFactor(Mutant):
    name = "mutant_mean_loss_factor"
    pitfall = ("output factors from gradients of the MEAN loss (g/N): G carries 1/N² "
               "(wiseodd/natural-gradients#2, curvlinops#107)")
    EXPECTED = {"factors.dense_output": "scale:1/N^2", "factors.conv_output": "scale:1/N^2"}

    @implements("factors.dense_output")
    def dense_output(self, inputs, params):
        g = inputs["g"] / inputs["g"].shape[-2]
        return super().dense_output({"g": g}, params)

    @implements("factors.conv_output")
    def conv_output(self, inputs, params):
        return super().conv_output({"g": inputs["g"] / inputs["g"].shape[0]}, params)


class ConvExpandUndeclared(Mutant):
    name = "mutant_conv_expand_undeclared"
    pitfall = ("conv output factor summed over locations (curvlinops 'expand' G = Σ_t) while "
               "declaring TF's KFC normalisation")
    EXPECTED = {"factors.conv_output": "conv_style"}

    @implements("factors.conv_output")
    def conv_output(self, inputs, params):
        g = inputs["g"]
        t = int(np.prod(g.shape[2:] if params["data_format"] == "NCHW" else g.shape[1:-1]))
        return t * np.asarray(super().conv_output(inputs, params))


def unfold_patches(inputs, params):
    """The patch matrix [N·|T|, kh·kw·C] of a ``factors.conv_input`` case in PyTorch's
    ``unfold`` order (channel slowest), without a bias column."""
    from kfac_ref import factors

    fs = params["filter_shape"]
    p = np.asarray(factors.conv_patch_matrix(
        inputs["x"], fs, params["padding"], params["strides"], params["dilation"],
        params["data_format"]))
    kk, c = fs[0] * fs[1], fs[2]
    return p.reshape(-1, kk, c).transpose(0, 2, 1).reshape(-1, kk * c)


class PatchOrderCHW(Mutant):
    name = "mutant_patch_order_chw"
    pitfall = "patch vectors in PyTorch unfold order (channel slowest) declared as (kh, kw, C)"
    EXPECTED = {"factors.conv_input": "patch_order"}

    @implements("factors.conv_input")
    def conv_input(self, inputs, params):
        p = unfold_patches(inputs, params)
        if params["has_bias"]:
            p = np.concatenate([p, np.ones((p.shape[0], 1))], axis=1)
        return p.T @ p / p.shape[0]


class MSEFactor2(AlteredReference):
    name = "mutant_mse_factor_2"
    pitfall = "squared error ‖f − y‖² used for a unit-variance Gaussian NLL (curvature 2I)"
    EXPECTED = dict.fromkeys(("losses.fisher", "losses.gradient", "losses.hessian"),
                             "mse_factor_2")

    def alter(self, reference, inputs, params):
        out = np.asarray(reference(inputs, params))
        return 2.0 * out if params["loss"] == "normal_mean" else out


class EmpiricalForTrue(AlteredReference):
    name = "mutant_empirical_for_true_fisher"
    pitfall = ("K-FAC statistics from the data labels where the type-2/true Fisher is asked, "
               "and vice versa (gpauloski/kfac-pytorch#109)")
    EXPECTED = {"networks.kfac": ("empirical_fisher", "true_fisher")}

    def alter(self, reference, inputs, params):
        swapped = "ggn_exact" if params["mode"] == "fisher_empirical" else "fisher_empirical"
        return reference(inputs, dict(params, mode=swapped))


class KfacJaxEmpiricalScale(AlteredReference):
    name = "mutant_kfac_jax_empirical_scale"
    pitfall = "empirical Fisher with kfac-jax's extra 1/N, declared as the per-example average"
    EXPECTED = {"networks.empirical_fisher": "empirical_fisher_scale"}

    def alter(self, reference, inputs, params):
        return np.asarray(reference(inputs, params)) / inputs["x"].shape[0]


class ExactBlocksForKfac(Mutant):
    name = "mutant_exact_blocks_for_kfac"
    pitfall = "returns the exact curvature's diagonal blocks instead of their K-FAC approximation"
    EXPECTED = {"networks.kfac": "exact_block_diagonal"}

    @implements("networks.kfac")
    def net_kfac(self, inputs, params):
        from ..catalogue.networks_cases import _block_diagonal, exact_matrix

        kind = "ef" if params["mode"] == "fisher_empirical" else "ggn"
        return _block_diagonal(exact_matrix(params, inputs, kind), params["net"])


MUTANTS = [MeanLossFactor, ConvExpandUndeclared, PatchOrderCHW, MSEFactor2, EmpiricalForTrue,
           KfacJaxEmpiricalScale, ExactBlocksForKfac]
ADAPTERS = {m.name: f"{_M}:{m.__name__}" for m in MUTANTS}


class AverageOfProducts(Mutant):
    name = "mutant_average_of_products"
    pitfall = ("moving average over per-batch K-FAC matrices instead of over the factors "
               "(Kronecker products do not commute with averaging)")
    EXPECTED = {"estimator.kfac_ema": "average_of_products"}

    @implements("estimator.kfac_ema")
    def est_kfac_ema(self, inputs, params):
        from ..catalogue.networks_cases import kfac_matrix

        d = params["decay"]
        k = [kfac_matrix(params, {**inputs, "x": inputs[f"x{i}"],
                                  "targets": inputs[f"targets{i}"]}) for i in range(2)]
        return (d * k[0] + k[1]) / (d + 1.0)


MUTANTS.append(AverageOfProducts)
ADAPTERS = {m.name: f"{_M}:{m.__name__}" for m in MUTANTS}
