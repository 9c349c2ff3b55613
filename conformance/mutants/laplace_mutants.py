"""Mutants of the Laplace-evidence capabilities (one pitfall each)."""

from __future__ import annotations

from ..adapter import implements
from ._base import Mutant

_M = "conformance.mutants.laplace_mutants"
_LML = "laplace.log_marginal_likelihood"
_GRAD = "laplace.prior_precision_grad"


class _Mutant(Mutant):
    """A Laplace mutant: the evidence and its gradient with keyword overrides."""

    def _evidence(self, inputs, params, loglik, **override):
        from kfac_ref.laplace import laplace_log_marginal_likelihood

        theta, curvature, prior, kw = self._laplace_args(inputs, params)
        return self.to_numpy(laplace_log_marginal_likelihood(
            loglik, theta, curvature, prior, **{**kw, **override}))

    def _gradient(self, inputs, params, **override):
        from kfac_ref.laplace import laplace_log_marginal_likelihood_grad

        theta, curvature, prior, kw = self._laplace_args(inputs, params)
        return self.to_numpy(laplace_log_marginal_likelihood_grad(
            theta, curvature, prior, **{**kw, **override}))


class LaplaceUntemperedLogLikelihood(_Mutant):
    name = "mutant_laplace_untempered_loglik"
    pitfall = "the temperature applied to the curvature only: ℓ in place of ℓ/T"
    EXPECTED = {_LML: "log_likelihood_untempered"}

    @implements(_LML)
    def laplace_lml(self, inputs, params):
        # ℓ·T divided by T inside is ℓ
        return self._evidence(inputs, params, params["log_likelihood"] * params["temperature"])


class LaplaceUntemperedCurvature(_Mutant):
    name = "mutant_laplace_untempered_curvature"
    pitfall = "posterior precision H + P₀: the 1/T left off the curvature"
    EXPECTED = {_LML: "curvature_untempered", _GRAD: "curvature_untempered"}

    @implements(_LML)
    def laplace_lml(self, inputs, params):
        t = params["temperature"]
        return self._evidence(inputs, params, params["log_likelihood"] / t, temperature=1.0)

    @implements(_GRAD)
    def laplace_grad(self, inputs, params):
        return self._gradient(inputs, params, temperature=1.0)


class _StructureSwap(_Mutant):
    """Evaluates one Kronecker structure as the other: ``SWAP = (given, used)``."""

    SWAP: tuple = ()

    def _structure(self, params):
        given, used = self.SWAP
        return used if params["structure"] == given else params["structure"]

    @implements(_LML)
    def laplace_lml(self, inputs, params):
        return self._evidence(inputs, params, params["log_likelihood"],
                              structure=self._structure(params))

    @implements(_GRAD)
    def laplace_grad(self, inputs, params):
        return self._gradient(inputs, params, structure=self._structure(params))


class LaplaceDampingDropped(_StructureSwap):
    name = "mutant_laplace_damping_dropped"
    pitfall = ("the factored (damped) Kronecker posterior evaluated as the exact one "
               "(a damping flag lost on the way)")
    SWAP = ("kron_factored", "kron")
    EXPECTED = {_LML: "exact_instead_of_factored", _GRAD: "exact_instead_of_factored"}
    EXPECTED_CASES = {"laplace.*/kron_factored_*": "exact_instead_of_factored",
                      "laplace.*": "pass"}


class LaplaceFactoredForExact(_StructureSwap):
    name = "mutant_laplace_factored_for_exact"
    pitfall = ("the exact Kronecker posterior s·A⊗G + δI evaluated as the factored one "
               "(√s A + √δ I)⊗(√s G + √δ I)")
    SWAP = ("kron", "kron_factored")
    EXPECTED = {_LML: "factored_instead_of_exact", _GRAD: "factored_instead_of_exact"}
    EXPECTED_CASES = {"laplace.*/kron_shared_*": "factored_instead_of_exact",
                      "laplace.*/kron_per_group_*": "factored_instead_of_exact",
                      "laplace.*": "pass"}


MUTANTS = [LaplaceUntemperedLogLikelihood, LaplaceUntemperedCurvature, LaplaceDampingDropped,
           LaplaceFactoredForExact]
ADAPTERS = {m.name: f"{_M}:{m.__name__}" for m in MUTANTS}
