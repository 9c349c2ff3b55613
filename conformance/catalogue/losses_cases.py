"""Loss-function capabilities: per-example Fisher, gradient and Hessian of the five
negative log-likelihood losses of TF K-FAC / kfac-jax, with masks and weights.

Loss names (``params["loss"]``) and inputs:

* ``categorical``: logits [N, k], integer targets [N], optional 0/1 mask [N];
* ``onehot_categorical``: logits [N, k], one-hot targets [N, k];
* ``multi_bernoulli``: logits [N, k], 0/1 targets [N, k];
* ``normal_mean``: mean [N, d], targets [N, d], ``params["variance"]`` (a float);
* ``normal_mean_variance``: mean [N, d], variance [N, d], targets [N, d]; the output
  coordinates are [mean, variance] (D = 2d).

Every quantity is per example (no 1/N) and carries the loss weight ``params["weight"]``.

Tolerance derivation: closed forms with softmax/sigmoid (work = k, κ = 1) or divisions by
the variance (κ = max v / min v over the case, at most 4 here).
"""

from __future__ import annotations

import numpy as np

from ..model import SAFETY, Capability, Case, Tolerance, rng_for
from ._data import to_np

REQUIRES = ("kfac_ref.losses",)

LOSSES = ("categorical", "onehot_categorical", "multi_bernoulli", "normal_mean",
          "normal_mean_variance")


def build_loss(L, inputs, params, to_backend=lambda x: x):
    """The kfac_ref loss object for a case (shared by the catalogue and the kfac_ref
    adapter)."""
    kind, w = params["loss"], params.get("weight", 1.0)
    t = to_backend(inputs["targets"]) if "targets" in inputs else None
    if kind == "categorical":
        mask = to_backend(inputs["mask"]) if "mask" in inputs else None
        return L.CategoricalLogitsNegativeLogProbLoss(to_backend(inputs["logits"]), t, mask, w)
    if kind == "onehot_categorical":
        return L.OneHotCategoricalLogitsNegativeLogProbLoss(to_backend(inputs["logits"]), t,
                                                            weight=w)
    if kind == "multi_bernoulli":
        return L.MultiBernoulliNegativeLogProbLoss(to_backend(inputs["logits"]), t, w)
    if kind == "normal_mean":
        return L.NormalMeanNegativeLogProbLoss(to_backend(inputs["mean"]), t,
                                               params["variance"], w)
    if kind == "normal_mean_variance":
        return L.NormalMeanVarianceNegativeLogProbLoss(
            to_backend(inputs["mean"]), to_backend(inputs["variance"]), t, w)
    raise ValueError(f"unknown loss {kind!r}")


def _variance_scale(arr, case, conv):
    # Fisher, Hessian and gradient of a normal-mean loss are all ∝ 1/v.
    if case.params["loss"] == "normal_mean" and conv.mse_variance is not None:
        return arr * (case.params["variance"] / conv.mse_variance)
    return arr


_SIG = ("inputs: logits [N, k] | mean [N, d] (+ variance [N, d]), targets, optional mask [N]; "
        "params: loss (one of " + ", ".join(LOSSES) + "), weight, variance (normal_mean)")

CAPABILITIES = [
    Capability("losses.fisher",
               "Per-example Fisher w·F_n of the loss w.r.t. its output(s), [N, D, D] "
               "(label-free).", _SIG, ("mse_variance",), convert_output=_variance_scale),
    Capability("losses.gradient",
               "Per-example gradient of w·ℓ_n(y_n) w.r.t. the output(s) at the data targets "
               "(no 1/N; mean-variance: [∂μ, ∂v] concatenated), [N, D].", _SIG,
               ("mse_variance",), convert_output=_variance_scale),
    Capability("losses.hessian",
               "Per-example Hessian w·∇²ℓ_n(y_n) at the data targets, [N, D, D] (= Fisher for "
               "natural parameters).", _SIG, ("mse_variance",), convert_output=_variance_scale),
]


def _inputs(kind, cid, n=4, k=3):
    r = rng_for(cid)
    if kind in ("categorical", "onehot_categorical", "multi_bernoulli"):
        logits = 1.5 * r.standard_normal((n, k))
        if kind == "categorical":
            return {"logits": logits, "targets": r.integers(0, k, size=n).astype(np.int64)}
        if kind == "onehot_categorical":
            return {"logits": logits, "targets": np.eye(k)[r.integers(0, k, size=n)]}
        return {"logits": logits, "targets": (r.random((n, k)) < 0.5).astype(np.float64)}
    out = {"mean": r.standard_normal((n, k)), "targets": r.standard_normal((n, k))}
    if kind == "normal_mean_variance":
        out["variance"] = r.uniform(0.5, 2.0, size=(n, k))
    return out


def build_cases() -> list[Case]:
    import kfac_ref.losses as L

    variants = [
        ("categorical", {"weight": 1.0}, None),
        ("categorical", {"weight": 0.7}, "mask"),
        ("onehot_categorical", {"weight": 1.0}, None),
        ("multi_bernoulli", {"weight": 1.0}, None),
        ("normal_mean", {"weight": 1.0, "variance": 0.5}, None),
        ("normal_mean", {"weight": 2.0, "variance": 1.0}, None),
        ("normal_mean_variance", {"weight": 1.0}, None),
    ]
    cases = []
    for kind, extra, opt in variants:
        tag = kind + "".join(f"_{k}{v:g}" for k, v in extra.items()) + (f"_{opt}" if opt else "")
        inputs = _inputs(kind, tag)
        if opt == "mask":
            inputs["mask"] = np.array([1.0, 0.0, 1.0, 1.0])
        params = {"loss": kind, **extra}
        loss = build_loss(L, inputs, params)
        n, k = 4, 3
        kappa = 4.0 if kind.startswith("normal") else 1.0
        tol = Tolerance(SAFETY * k * kappa, f"closed form over k = {k} outputs: work = {k}, "
                                            f"κ = {kappa:g} (variance range)")
        meta = {"N": n}
        desc = "masked example 1" if opt == "mask" else ""
        cases.append(Case(f"losses.fisher/{tag}", "losses.fisher", inputs, params,
                          to_np(loss.fisher_matrix()), tol, meta, description=desc))
        grads = [to_np(x) for x in loss.grad_of_evaluate()]
        cases.append(Case(f"losses.gradient/{tag}", "losses.gradient", inputs, params,
                          np.concatenate(grads, axis=-1), tol, meta, description=desc))
        if kind in ("categorical", "normal_mean", "normal_mean_variance"):
            alts = {}
            if kind == "normal_mean_variance":
                alts["fisher_for_hessian"] = to_np(loss.fisher_matrix())
            cases.append(Case(f"losses.hessian/{tag}", "losses.hessian", inputs, params,
                              to_np(loss.hessian_matrix()), tol, meta, alts, desc))
    return cases
