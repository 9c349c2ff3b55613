"""Mutants of the optimiser capability (``optimizer.kfac_steps``): kfac_ref's K-FAC steps with
one of the usual mistakes built in — damping added to the wrong matrix, stale or identity
inverses before the first refresh, the refresh period ignored, momentum before
preconditioning, a moving average without debiasing — and one fault that no pitfall explains
(statistics taken at the previous parameters), which must stay ``unexplained``.

Each mutant's steps are :func:`conformance.catalogue.optimizer_cases.pitfall_steps` with its
fault; ``EXPECTED`` maps ``optimizer.kfac_steps`` to the pitfall name the diagnosis must print
(the case alternatives of the same name, see conformance/DIAGNOSES.md).
"""

from __future__ import annotations

from ..adapter import implements
from ._base import Mutant

_M = "conformance.mutants.optimizer_mutants"


class OptimizerMutant(Mutant):
    """kfac_ref with one optimiser fault (``fault``, a name of ``optimizer_cases.FAULTS``)."""

    fault = ""

    @implements("optimizer.kfac_steps")
    def opt_kfac_steps(self, inputs, params):
        from ..catalogue.optimizer_cases import pitfall_steps

        return pitfall_steps(params, inputs, self.fault)


def _mutant(cls_name, fault, pitfall, expected=None):
    return type(cls_name, (OptimizerMutant,), {
        "__module__": __name__, "name": f"mutant_opt_{fault}", "fault": fault,
        "pitfall": pitfall,
        "EXPECTED": {"optimizer.kfac_steps": expected or fault}})


ExactDamping = _mutant(
    "ExactDamping", "exact_damping",
    "λ added to the product: (s·A⊗G + λI)⁻¹ instead of the π-split factored damping")
UnsplitDamping = _mutant(
    "UnsplitDamping", "unsplit_damping",
    "λ/s added to both factors without the π split: (A + λ'I)⁻¹ ⊗ (G + λ'I)⁻¹")
IdentityBeforeFirstRefresh = _mutant(
    "IdentityBeforeFirstRefresh", "identity_before_first_refresh",
    "inverses initialised to the identity, first refresh at the end of the first period "
    "((t + 1) mod k = 0)")
RefreshBeforeUpdate = _mutant(
    "RefreshBeforeUpdate", "refresh_before_update",
    "inverses refreshed from the factors before this step's statistics (step 0: the zero "
    "factors, P = I/λ)")
RefreshEveryStep = _mutant(
    "RefreshEveryStep", "refresh_every_step",
    "inverses recomputed every step, the refresh period ignored")
MomentumBeforePreconditioning = _mutant(
    "MomentumBeforePreconditioning", "momentum_before_preconditioning",
    "momentum accumulated on the gradient, then preconditioned: d = −P(μu + g)")
NoZeroDebias = _mutant(
    "NoZeroDebias", "no_zero_debias",
    "factor average S ← dS + (1 − d)Â started at zero, not divided by its weight")
LaggedStatistics = _mutant(
    "LaggedStatistics", "lagged_statistics",
    "curvature statistics of step t taken at the parameters of step t − 1 (no pitfall "
    "explains it)", expected="unexplained")

MUTANTS = [ExactDamping, UnsplitDamping, IdentityBeforeFirstRefresh, RefreshBeforeUpdate,
           RefreshEveryStep, MomentumBeforePreconditioning, NoZeroDebias, LaggedStatistics]
ADAPTERS = {m.name: f"{_M}:{m.__name__}" for m in MUTANTS}
