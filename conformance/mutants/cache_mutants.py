"""Mutants of the cache semantics (``blocks.kron_cached_inverse``: a cached product
recomputed from the current statistics, a cached factored inverse re-damped with the current
identity weight) and of the kfac-jax full and naive blocks (``estimator.full_blocks``: K-FAC
where the exact block is asked)."""

from __future__ import annotations

from ..adapter import implements
from ._base import Mutant

_M = "conformance.mutants.cache_mutants"


def _args(inputs):
    return [inputs[k] for k in ("a0", "g0", "a1", "g1", "x")]


class CacheFresh(Mutant):
    name = "mutant_cache_fresh"
    pitfall = "use_cached=True ignored: the product is recomputed from the current statistics"
    EXPECTED = {"blocks.kron_cached_inverse": "fresh_instead_of_cached"}

    @implements("blocks.kron_cached_inverse")
    def kron_cached_inverse(self, inputs, params):
        from ..catalogue.blocks_cases import cached_inverse_ref

        return cached_inverse_ref(*_args(inputs), params, fresh=True)


class CacheCurrentDamping(Mutant):
    name = "mutant_cache_current_damping"
    pitfall = "cached factored inverse rebuilt with the identity weight of the product call"
    EXPECTED = {"blocks.kron_cached_inverse": "current_damping_in_cache"}
    # the exact cached path adds the current weight by design: nothing to get wrong there
    EXPECTED_CASES = {"blocks.kron_cached_inverse/*_exact": "pass"}

    @implements("blocks.kron_cached_inverse")
    def kron_cached_inverse(self, inputs, params):
        from ..catalogue.blocks_cases import cached_inverse_ref

        return cached_inverse_ref(*_args(inputs), params, current_damping=True)


MUTANTS = [CacheFresh, CacheCurrentDamping]
ADAPTERS = {m.name: f"{_M}:{m.__name__}" for m in MUTANTS}


class FullBlocksKronecker(Mutant):
    name = "mutant_full_blocks_kronecker"
    pitfall = "DenseFull / NaiveFull (and the diagonal blocks) computed as K-FAC A ⊗ G (or its "\
        "diagonal)"
    EXPECTED = {"estimator.full_blocks": "kronecker_instead_of_exact"}

    @implements("estimator.full_blocks")
    def est_full_blocks(self, inputs, params):
        import numpy as np

        k = np.asarray(self.net_kfac(inputs, params))
        return np.diag(np.diag(k)) if "Diagonal" in params["block"] else k


MUTANTS.append(FullBlocksKronecker)
ADAPTERS = {m.name: f"{_M}:{m.__name__}" for m in MUTANTS}
