"""kfac_ref's implementation of the optimiser capabilities, mixed into the kfac_ref adapters.

``optimizer.kfac_steps`` runs :class:`kfac_ref.optim.KFACOptimizer` (``momentum_type=
"regular"``, ``exact_power=False``, ``inverse_update_period = params["inverse_period"]``) on
the adapter's backend arrays; the semantics are specified in
:mod:`conformance.catalogue.optimizer_cases`.  The module defines no adapter of its own.
"""

from __future__ import annotations

import numpy as np

from ..adapter import implements
from ..catalogue._data import to_np
from ..catalogue.networks_cases import build_net, loss_fn, params_from_inputs

__all__ = ["KfacRefOptimizerMixin", "kfac_optimizer_steps"]


def kfac_optimizer_steps(params, inputs, to_backend=lambda v: v, to_numpy=to_np,
                         **options):
    """[K, 2, P] directions and parameters of kfac_ref's ``KFACOptimizer`` (``options``
    override its keyword arguments, e.g. ``exact_power=True``)."""
    from kfac_ref.curvature import BlockDiagonalCurvature
    from kfac_ref.optim import KFACOptimizer

    spec = params["net"]
    net = build_net(spec)
    theta = params_from_inputs(spec, inputs, to_backend)
    est = BlockDiagonalCurvature(net, loss_fn(params))
    kwargs = dict(learning_rate=params["learning_rate"], momentum=params["momentum"],
                  momentum_type="regular", damping=params["damping"],
                  curvature_ema=params["decay"], ema_style="kfac_jax",
                  curvature_update_period=1, inverse_update_period=params["inverse_period"],
                  exact_power=False, estimation_mode=params["mode"])
    kwargs.update(options)
    opt = KFACOptimizer(net, loss_fn(params), est, **kwargs)
    xs, ys = inputs["x"], inputs["targets"]
    rng = np.random.default_rng(0)  # unused by the exact and empirical modes
    state = opt.init(theta, (to_backend(xs[0]), to_backend(ys[0])), rng)
    lr, mu = float(kwargs["learning_rate"]), float(kwargs["momentum"])
    flat, rows = to_numpy(net.flatten(theta)), []
    for t in range(int(params["steps"])):
        old_v, old_flat = to_numpy(state.velocity), flat
        theta, state = opt.step(state, theta, (to_backend(xs[t]), to_backend(ys[t])), rng)
        flat = to_numpy(net.flatten(theta))
        if kwargs["momentum_type"] == "adam":  # velocity = μv + g, δ = −ηp: d_t = δ/η
            direction = (flat - old_flat) / lr
        else:  # v_t = μ v_{t−1} + p_t, d_t = −p_t
            direction = -(to_numpy(state.velocity) - mu * old_v)
        rows.append((direction, flat))
    return np.stack([np.stack(r) for r in rows])


# -- the same steps from kfac_ref's pieces, with a pitfall built in -----------------------------


class KfacRefOptimizerMixin:
    """``optimizer.*`` capabilities through kfac_ref's optimiser; needs the host adapter's
    ``to_backend`` and ``to_numpy``."""

    @implements("optimizer.kfac_steps")
    def opt_kfac_steps(self, inputs, params):
        return kfac_optimizer_steps(params, inputs, self.to_backend, self.to_numpy)
