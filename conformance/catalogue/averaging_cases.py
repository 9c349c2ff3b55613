"""Moving-average capabilities (TF's zero-debiased MovingAverageVariable, kfac-jax's
WeightedMovingAverage: one formula, S ← δS + wX, W ← δW + w, value = S/W).

Tolerance: after k updates each entry is a weighted sum of k statistics divided by the total
weight, work = 2k (sum and division), κ = 1 (the weights are positive, so no cancellation).
"""

from __future__ import annotations

import numpy as np

from ..model import SAFETY, Capability, Case, Tolerance, rng_for
from ._data import psd, to_np

REQUIRES = ("kfac_ref.averaging",)


def _total_weights(k, decay, weight):
    w, out = 0.0, []
    for _ in range(k):
        w = decay * w + weight
        out.append(w)
    return np.array(out)


def _ema_output(arr, case, conv):
    decay, weight = case.params["decay"], case.params["weight"]
    if conv.ema_init == "zero" and conv.ema_style == "zero_debias":
        return arr  # S_k/W_k does not depend on the weight of the new statistic
    # the statistics behind the (zero-debiased) values: S_k = value_k·W_k and
    # X_k = (S_k − δ S_{k−1}) / w (host arithmetic)
    k = arr.shape[0]
    w_tot = _total_weights(k, decay, weight).reshape((-1,) + (1,) * (arr.ndim - 1))
    s = arr * w_tot
    xs = np.concatenate([s[:1], s[1:] - decay * s[:-1]]) / weight
    w = weight if conv.ema_weight == "given" else 1.0 - decay
    out, m, tot = [], np.zeros_like(xs[0]), 0.0
    for i, x in enumerate(xs):
        if conv.ema_init == "first" and i == 0:
            m, tot = x, 1.0
        else:
            m, tot = decay * m + w * x, decay * tot + w
        if conv.ema_init == "first" or conv.ema_style == "raw":
            out.append(m)
        else:
            out.append(m / tot)
    return np.stack(out)


CAPABILITIES = [
    Capability(
        "averaging.ema",
        "Moving average of a sequence of statistics X_1..X_k ([k, d, d]) started at zero: "
        "S ← decay·S + weight·X, W ← decay·W + weight; returns the value after every update "
        "([k, d, d]) — S/W when zero-debiased (TF ZERO_DEBIAS, kfac-jax ema_old=decay, "
        "ema_new=weight).",
        "inputs: xs [k, d, d]; params: decay, weight",
        ("ema_style", "ema_init", "ema_weight"),
        convert_output=_ema_output,
    ),
]


def build_cases() -> list[Case]:
    from kfac_ref.averaging import MovingAverageVariable

    cases = []
    for k, decay, weight in ((4, 0.9, 1.0), (5, 0.95, 0.05), (3, 0.0, 1.0)):
        cid = f"averaging.ema/k{k}_decay{decay:g}_weight{weight:g}"
        r = rng_for(cid)
        d = 3
        xs = np.stack([psd(r, d, d, scale=1.0 + i) for i in range(k)])
        ema = MovingAverageVariable.zeros_like(xs[0], zero_debias=True)
        raw = MovingAverageVariable.zeros_like(xs[0], zero_debias=False)
        ident = MovingAverageVariable.zeros_like(xs[0], zero_debias=False,
                                                 initial_value=np.eye(d))
        vals, raws, idents = [], [], []
        for x in xs:
            ema, raw, ident = ema.update(x, decay, weight), raw.update(x, decay, weight), \
                ident.update(x, decay, weight)
            vals.append(to_np(ema.value))
            raws.append(to_np(raw.value))
            idents.append(to_np(ident.value))
        # (finalize() moves alternatives equal to the expected value to insensitive_to)
        alts = {"no_zero_debias": np.stack(raws), "identity_init": np.stack(idents)}
        cases.append(Case(
            cid, "averaging.ema", {"xs": xs}, {"decay": decay, "weight": weight},
            np.stack(vals),
            Tolerance(SAFETY * 2 * k, f"weighted sums of k = {k} PSD statistics and one "
                                      "division: work = 2k, κ = 1 (positive weights)"),
            {"k": k}, alts,
            "decay 0: the value is the latest statistic" if decay == 0 else ""))
    return cases
