"""``check_torch_kfac``: the own-model check of a PyTorch model's K-FAC factors."""

from __future__ import annotations

import numpy as np

from ._check import ModelCheck, check_batches
from ._reference import _np
from ._torch import _check_args, reference_torch_kfac


def check_torch_kfac(model, loss, inputs, targets, factors, *, mode="fisher_exact",
                     sharing="expand", rng=None, samples=None, mc_samples=1,
                     conventions=None, level="block", layers=None, earlier=None,
                     decay=None) -> ModelCheck:
    r"""Compare a user's K-FAC factors of ``model`` with the reference, per layer — each
    factor and the layer's block :math:`A\otimes G` — and name the pitfall behind each
    disagreement.

    .. math::

        \frac{\|A_\text{user} - A\|_F}{\|A\|_F} \le \text{rtol}, \qquad
        \frac{\|A_\text{user}\otimes G_\text{user} - A\otimes G\|_F}
             {\|A\otimes G\|_F} \le \text{rtol}_A + \text{rtol}_G

    with :math:`A, G` of :func:`reference_torch_kfac` (module docstring for the
    normalisation) in the declared ``conventions`` and the tolerances of
    :func:`check_factors`.  ``result.ok`` is the block verdict (a pair whose scalars cancel
    is ``equivalent``), or every factor's with ``level="factors"``.  ``factors``:
    ``{module name: {"A": ..., "G": ...}}``, copied before anything runs; every supported
    layer must be given unless ``layers`` names the subset to check.  Optimiser state:
    ``earlier`` lists the ``(inputs, targets)`` of the earlier statistics updates (oldest
    first; the model unchanged), averaged with ``decay`` (the weight of the old average) as
    ``conventions["ema_init"]`` / ``["ema_style"]`` declare; an average started at the
    identity or not debiased is named with its fitted decay.  For
    ``mode="fisher_sampled"`` pass ``rng`` (and ``mc_samples``; with ``earlier``, each
    batch's draws come from it in order) or the ``samples`` your K-FAC used
    (:func:`sample_targets`).  The diagnosis tries: powers of N, |T| and 2 as one scale
    term per factor, the bias coordinate at the other end, the other patch order, the
    dilation, padding or stride ignored, the empirical instead of the true or sampled
    Fisher (and vice versa), expand instead of reduce (and vice versa), moving averages
    started at the identity or zero, and combinations of up to four of these.
    """
    fn = "check_torch_kfac"
    _check_args(fn, model, loss, mode, sharing, rng, samples)
    if earlier is not None and not isinstance(earlier, (list, tuple)):
        raise TypeError(f"{fn}: earlier must be a list of (inputs, targets) pairs; got "
                        f"{earlier!r:.80}.")

    def reference(x, y, mode_, sharing_, samples_):
        return reference_torch_kfac(model, loss, x, y, mode=mode_, sharing=sharing_,
                                    samples=samples_, _fn=fn)

    def outputs(x):
        import torch

        with torch.no_grad():
            return _np(model(x), np.float64)

    return check_batches(fn, factors, list(earlier or []) + [(inputs, targets)], mode,
                         reference=reference, outputs=outputs, loss=loss, sharing=sharing,
                         rng=rng, samples=samples, mc_samples=mc_samples,
                         conventions=conventions, level=level, layers=layers, decay=decay)
