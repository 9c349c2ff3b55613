"""Mutants of the losses' factor products (the transposed factor, the weight w where √w
belongs) and samplers (the mode instead of a sample, the variance used as the standard
deviation; tested by the statistical route)."""

from __future__ import annotations

import numpy as np

from ..adapter import implements
from ._base import AlteredReference, Mutant

_M = "conformance.mutants.loss_mutants"


class FactorTransposed(Mutant):
    name = "mutant_factor_transposed"
    pitfall = "B_nᵀ u applied for B_n u and B_n v for B_nᵀ v (the categorical factor is not "\
        "symmetric)"
    EXPECTED = {"losses.fisher_factor": "factor_transposed",
                "losses.fisher_factor_transpose": "factor_transposed"}

    @implements("losses.fisher_factor")
    def loss_fisher_factor(self, inputs, params):
        return super().loss_fisher_factor_t({**inputs, "v": inputs["u"]}, params)

    @implements("losses.fisher_factor_transpose")
    def loss_fisher_factor_t(self, inputs, params):
        return super().loss_fisher_factor({**inputs, "u": inputs["v"]}, params)


class FactorWeightW(AlteredReference):
    name = "mutant_factor_weight_w"
    pitfall = "factor products scaled by the loss weight w instead of √w"
    EXPECTED = dict.fromkeys(("losses.fisher_factor", "losses.fisher_factor_transpose",
                              "losses.ggn_factor"), "factor_weight_w")
    # w = 2 with v = 1: √2 is also exactly the squared-error convention v = 1/2 (named first)
    EXPECTED_CASES = {"losses.*factor*/normal_mean_weight2_variance1": "mse_factor_2"}

    def alter(self, reference, inputs, params):
        return np.sqrt(params["weight"]) * reference(inputs, params)


class SampleMode(Mutant):
    name = "mutant_sample_mode"
    pitfall = "sample() returns the mode (argmax class, logit > 0, the mean): no randomness"
    EXPECTED = {"losses.sample": "no_sampling"}

    @implements("losses.sample")
    def loss_sample(self, inputs, params):
        from ..catalogue.losses_cases import _mode

        return _mode(params["loss"], inputs, params)


class SampleVarianceAsStd(Mutant):
    name = "mutant_sample_variance_as_std"
    pitfall = "normal targets drawn as μ + v·ε (the variance used as the standard deviation)"
    EXPECTED = {"losses.sample": "variance_as_std"}
    # the categorical and Bernoulli samplers are untouched
    EXPECTED_CASES = {"losses.sample/*categorical*": "pass",
                      "losses.sample/multi_bernoulli*": "pass"}

    @implements("losses.sample")
    def loss_sample(self, inputs, params):
        kind = params["loss"]
        if not kind.startswith("normal"):
            return super().loss_sample(inputs, params)
        v = inputs["variance"] if kind == "normal_mean_variance" else params["variance"]
        eps = np.random.default_rng(params["seed"]).standard_normal(inputs["mean"].shape)
        return inputs["mean"] + v * eps


MUTANTS = [FactorTransposed, FactorWeightW, SampleMode, SampleVarianceAsStd]
ADAPTERS = {m.name: f"{_M}:{m.__name__}" for m in MUTANTS}
