"""``check_torch_kfac``: the own-model check of a PyTorch model's K-FAC factors."""

from __future__ import annotations

import numpy as np

from ._check import ModelCheck, check_factors, layer_alternatives
from ._reference import _np, as_rng, sample_targets
from ._torch import _check_args, reference_torch_kfac


def check_torch_kfac(model, loss, inputs, targets, factors, *, mode="fisher_exact",
                     sharing="expand", rng=None, samples=None, mc_samples=1) -> ModelCheck:
    r"""Compare a user's K-FAC factors of ``model`` with the reference, per layer and factor,
    and name the pitfall behind each disagreement.

    .. math::

        \frac{\|A_\text{user} - A\|_F}{\|A\|_F} \le \text{rtol}, \qquad
        \frac{\|G_\text{user} - G\|_F}{\|G\|_F} \le \text{rtol}

    with :math:`A, G` of :func:`reference_torch_kfac` (module docstring for the
    normalisation) and the tolerance of :func:`check_factors`.  ``factors``:
    ``{module name: {"A": ..., "G": ...}}`` (either may be missing).  The diagnosis tries
    the suite's pitfalls: scalar factors of N, |T| and 2 (the mean-reduced loss's 1/N², TF's
    G/|T|), the bias coordinate first, the HWC patch order (alone and with the bias first),
    transposes, the empirical instead of the true or sampled Fisher (and vice versa),
    expand instead of reduce (and vice versa).  For ``mode="fisher_sampled"`` pass ``rng``
    (and ``mc_samples``) or the ``samples`` your K-FAC used (:func:`sample_targets`).
    """
    fn = "check_torch_kfac"
    _check_args(fn, model, loss, mode, sharing, rng, samples)
    if mode == "fisher_sampled" and samples is None:  # one set of draws for every reference
        import torch

        with torch.no_grad():
            out = model(inputs)
        samples = sample_targets(loss, _np(out, np.float64), as_rng(fn, rng), mc_samples)
    kw = dict(sharing=sharing, _fn=fn)
    ref = reference_torch_kfac(model, loss, inputs, targets, mode=mode, samples=samples, **kw)
    others = {}
    if mode != "fisher_empirical":
        others["empirical_fisher"] = reference_torch_kfac(
            model, loss, inputs, targets, mode="fisher_empirical", **kw)
    if mode != "fisher_exact":
        others["true_fisher"] = reference_torch_kfac(
            model, loss, inputs, targets, mode="fisher_exact", **kw)
    if any(r["T"] > 1 for r in ref.values()):
        others["sharing"] = reference_torch_kfac(
            model, loss, inputs, targets, mode=mode, samples=samples, _fn=fn,
            sharing="reduce" if sharing == "expand" else "expand")
    alts = {name: layer_alternatives(name, ref[name], others, mode, sharing) for name in ref}
    return check_factors(ref, factors, alts, mode, fn)
