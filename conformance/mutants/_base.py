"""The base of the mutants: kfac_ref's adapter with one pitfall built in."""

from __future__ import annotations

import functools

from ..adapters.kfac_ref_adapter import KfacRefAdapter


class Mutant(KfacRefAdapter):
    """Base: kfac_ref with one pitfall; ``EXPECTED`` = capability -> pitfall id."""

    EXPECTED: dict = {}
    pitfall = ""

    @property
    def description(self):
        return f"MUTANT ({self.pitfall}): kfac_ref with a deliberate bug"



class AlteredReference(Mutant):
    """A mutant that runs kfac_ref's own code for every capability in ``EXPECTED``, altered the
    same way for each: :meth:`alter` gets kfac_ref's implementation of the capability
    (``reference(inputs, params)``) and returns the mutant's result."""

    def alter(self, reference, inputs, params):
        raise NotImplementedError

    def implementations(self):
        out = super().implementations()
        for capability in self.EXPECTED:
            out[capability] = functools.partial(self.alter, out[capability])
        return out
