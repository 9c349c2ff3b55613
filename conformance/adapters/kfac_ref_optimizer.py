"""kfac_ref's implementation of the optimiser capabilities, mixed into the kfac_ref adapters.

``optimizer.kfac_steps`` runs :class:`kfac_ref.optim.KFACOptimizer` (``momentum_type=
"regular"``, ``exact_power=False``, ``inverse_update_period = params["inverse_period"]``) on
the adapter's backend arrays; the semantics are specified in
:mod:`conformance.catalogue.optimizer_cases`.  The module defines no adapter of its own.
"""

from __future__ import annotations

from ..adapter import implements

__all__ = ["KfacRefOptimizerMixin"]


class KfacRefOptimizerMixin:
    """``optimizer.*`` capabilities through kfac_ref's optimiser; needs the host adapter's
    ``to_backend`` and ``to_numpy``."""

    @implements("optimizer.kfac_steps")
    def opt_kfac_steps(self, inputs, params):
        from ..catalogue.optimizer_cases import reference_steps

        return reference_steps(params, inputs, self.to_backend, self.to_numpy)
