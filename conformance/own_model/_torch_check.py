"""``check_torch_kfac``: the own-model check of a PyTorch model's K-FAC factors."""

from __future__ import annotations

import numpy as np

from ._check import ModelCheck, check_factors, layer_alternatives, positions
from ._reference import _np, as_rng, sample_targets
from ._torch import _check_args, reference_torch_kfac


def _batch_references(model, loss, inputs, targets, mode, sharing, samples, fn):
    """The reference of one batch and its alternatives (the other estimate, the other
    weight-sharing approximation, the geometry faults), per layer."""
    kw = dict(sharing=sharing, _fn=fn)
    ref = reference_torch_kfac(model, loss, inputs, targets, mode=mode, samples=samples, **kw)
    others = {}
    if mode != "fisher_empirical":
        others["empirical_fisher"] = reference_torch_kfac(
            model, loss, inputs, targets, mode="fisher_empirical", **kw)
    if mode != "fisher_exact":
        others["true_fisher"] = reference_torch_kfac(
            model, loss, inputs, targets, mode="fisher_exact", **kw)
    if any(positions(r) > 1 for r in ref.values()):
        others["sharing"] = reference_torch_kfac(
            model, loss, inputs, targets, mode=mode, samples=samples, _fn=fn,
            sharing="reduce" if sharing == "expand" else "expand")
    alts = {name: layer_alternatives(name, ref[name], others, mode, sharing) for name in ref}
    return ref, alts


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
    from ._check import copy_factors, declared_conventions, resolve_sharing

    fn = "check_torch_kfac"
    _check_args(fn, model, loss, mode, sharing, rng, samples)
    factors = copy_factors(fn, factors)  # before any forward pass can fire the user's hooks
    conv = declared_conventions(fn, conventions)
    sharing = resolve_sharing(fn, sharing, conv)
    if earlier is not None and (not isinstance(earlier, (list, tuple)) or not all(
            isinstance(b, (list, tuple)) and len(b) == 2 for b in earlier)):
        raise TypeError(f"{fn}: earlier must be a list of (inputs, targets) pairs; got "
                        f"{earlier!r:.80}.")
    if earlier and samples is not None:
        raise ValueError(f"{fn}: with earlier batches, give rng (draws for every batch), "
                         "not samples.")
    gen = as_rng(fn, rng) if rng is not None else None
    history = []
    for x_i, y_i in list(earlier or []) + [(inputs, targets)]:
        s_i = samples
        if mode == "fisher_sampled" and samples is None:  # one set of draws per batch
            import torch

            with torch.no_grad():
                out = model(x_i)
            s_i = sample_targets(loss, _np(out, np.float64), gen, mc_samples)
        history.append(_batch_references(model, loss, x_i, y_i, mode, sharing, s_i, fn))
    ref, alts = history[-1]
    return check_factors(ref, factors, alts, mode, fn, conventions=conventions, level=level,
                         layers=layers, earlier=history[:-1], decay=decay, loss=loss)
