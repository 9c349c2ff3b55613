"""Mutants of the sampling estimation modes (``sampling.kfac``): an estimate scaled by 2, the
empirical Fisher (data targets) instead of the sampled one, and a fault no pitfall explains
(every example's draw applied to another example), which must stay ``unexplained``.

Each accepts the case's draws (the exact route, like kfac_ref); with ``accepts_draws = ()``
the same code is tested by the statistical route (tests/conformance/test_conformance_sampling.py).
"""

from __future__ import annotations

import numpy as np

from ..adapter import implements
from ._base import Mutant


def _own(inputs, params):
    from ..catalogue.sampling_cases import DRAWS_INPUT, draws_from

    if "seed" not in params:
        return inputs
    rng = np.random.default_rng(params["seed"])
    return {**inputs, DRAWS_INPUT[params["mode"]]: draws_from(rng, params, inputs)}


class SampledScaled2(Mutant):
    name = "mutant_sampled_x2"
    pitfall = "sampled K-FAC estimate doubled (the square of a √2-scaled vector)"
    EXPECTED = {"sampling.kfac": "scale:2"}
    # with a squared error, ×2 is exactly the squared-error factor 2 (the numbers cannot tell
    # them apart; the diagnosis names the specific cause)
    EXPECTED_CASES = {"sampling.kfac/deep_linear_*": "mse_factor_2"}

    @implements("sampling.kfac")
    def sampling_kfac(self, inputs, params):
        from ..catalogue.sampling_cases import kfac_given_draws

        return 2.0 * kfac_given_draws(params, _own(inputs, params))


class SampledEmpirical(Mutant):
    name = "mutant_sampled_empirical"
    pitfall = "gradients at the data targets instead of sampled targets / sign vectors"
    EXPECTED = {"sampling.kfac": "empirical_fisher"}

    @implements("sampling.kfac")
    def sampling_kfac(self, inputs, params):
        from ..catalogue.networks_cases import kfac_matrix

        return kfac_matrix(params, inputs, mode="fisher_empirical")


class SampledDrawsShifted(Mutant):
    name = "mutant_sampled_draws_shifted"
    pitfall = ("example n's draw applied to example n + 1 (a fault no pitfall explains; with "
               "sign vectors the estimate stays unbiased, so only the exact route sees it)")
    EXPECTED = {"sampling.kfac": "unexplained"}
    # a deep linear network with a squared error has the same Jacobians and the same factor
    # B_n = I/σ for every example: which example gets which sign vector changes nothing
    EXPECTED_CASES = {"sampling.kfac/deep_linear_n6_mse_ggn_curvature_prop": "pass"}

    @implements("sampling.kfac")
    def sampling_kfac(self, inputs, params):
        from ..catalogue.sampling_cases import DRAWS_INPUT, kfac_given_draws

        inputs = _own(inputs, params)
        key = DRAWS_INPUT[params["mode"]]
        return kfac_given_draws(params, {**inputs, key: np.roll(inputs[key], 1, axis=0)})


_M = "conformance.mutants.sampling_mutants"
MUTANTS = [SampledScaled2, SampledEmpirical, SampledDrawsShifted]
ADAPTERS = {m.name: f"{_M}:{m.__name__}" for m in MUTANTS}
