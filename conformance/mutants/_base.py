"""The base of the mutants: kfac_ref's adapter with one pitfall built in."""

from __future__ import annotations

from ..adapters.kfac_ref_adapter import KfacRefAdapter


class Mutant(KfacRefAdapter):
    """Base: kfac_ref with one pitfall; ``EXPECTED`` = capability -> pitfall id."""

    EXPECTED: dict = {}
    pitfall = ""

    @property
    def description(self):
        return f"MUTANT ({self.pitfall}): kfac_ref with a deliberate bug"

