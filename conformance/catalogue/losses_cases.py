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


def sample_statistic(y, case):
    """Sufficient statistic T(y) of one sample whose mean the statistical route tests: one-hot
    classes (categorical), the 0/1 values (one-hot, Bernoulli), (y, (y − μ)²) (normal).

    ``y`` must be draws (:class:`~conformance.sampling.NotDraws` otherwise): integer class
    indices in [0, k) of shape [N] (categorical), 0/1 rows with a single 1 (one-hot), 0/1
    entries (Bernoulli), finite real values (normal), each in the shape of the parameters."""
    from ..sampling import NotDraws

    kind, inputs = case.params["loss"], case.inputs
    raw = np.asarray(y)
    if raw.dtype.kind not in "biuf":
        raise NotDraws(f"a sample is real numbers; got an array of dtype {raw.dtype}")
    y = raw.astype(np.float64)
    if kind == "categorical":
        k = inputs["logits"].shape[-1]
        if y.shape != inputs["logits"].shape[:-1] or not np.all(np.isin(y, np.arange(k))):
            raise NotDraws(f"a categorical sample must be integer class indices in [0, {k}) "
                           f"of shape {inputs['logits'].shape[:-1]}; got shape {y.shape}"
                           + (" (probabilities?)" if y.shape == inputs["logits"].shape
                              else ""))
        return np.eye(k)[y.astype(np.int64)]
    shape = inputs["logits" if "logits" in inputs else "mean"].shape
    if y.shape != shape:
        raise NotDraws(f"a {kind} sample has the shape of its parameters, {shape}; got "
                       f"{y.shape}")
    if not np.all(np.isfinite(y)):
        raise NotDraws(f"a {kind} sample holds {int(np.sum(~np.isfinite(y)))} NaN/Inf "
                       "values")
    if kind in ("onehot_categorical", "multi_bernoulli"):
        if not np.all((y == 0) | (y == 1)):
            bad = y[(y != 0) & (y != 1)]
            raise NotDraws(f"a {kind} sample holds 0 and 1 only; got {bad.size} other "
                           f"value(s), e.g. {bad.flat[0]:.4g} (probabilities instead of "
                           "draws?)")
        if kind == "onehot_categorical" and not np.all(y.sum(axis=-1) == 1):
            raise NotDraws("a onehot_categorical sample has exactly one 1 per row")
        return y
    return np.concatenate([y, (y - inputs["mean"]) ** 2], axis=-1)


def sample_moments(kind, inputs, params):
    """Exact mean and variance of :func:`sample_statistic` (closed forms)."""
    if kind in ("categorical", "onehot_categorical"):
        z = inputs["logits"]
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p = p / p.sum(axis=-1, keepdims=True)
        return p, p * (1.0 - p)
    if kind == "multi_bernoulli":
        p = 1.0 / (1.0 + np.exp(-inputs["logits"]))
        return p, p * (1.0 - p)
    v = inputs["variance"] if kind == "normal_mean_variance" else \
        np.full(inputs["mean"].shape, float(params["variance"]))
    # y ~ N(μ, v): E y = μ, Var y = v; E (y−μ)² = v, Var (y−μ)² = 2v²
    return (np.concatenate([inputs["mean"], v], axis=-1),
            np.concatenate([v, 2.0 * v ** 2], axis=-1))


def _sample_inputs(inputs, case, conv):
    if case.params["loss"] == "normal_mean" and conv.mse_variance is not None:
        raise NotImplementedError("an implementation whose squared error fixes the variance "
                                  "samples with that variance, not the case's")
    return dict(inputs)


def _sqrt_variance_scale(arr, case, conv):
    # a factor of a normal-mean loss is ∝ 1/√v
    if case.params["loss"] == "normal_mean" and conv.mse_variance is not None:
        return arr * np.sqrt(case.params["variance"] / conv.mse_variance)
    return arr


def factor_product(loss, kind, vector, to_backend=lambda x: x, to_numpy=to_np):
    """kfac_ref's factor products as one array: ``kind`` is ``fisher_factor``,
    ``fisher_factor_transpose`` or ``ggn_factor``; outputs of a tuple concatenated."""
    if kind == "fisher_factor_transpose":
        parts = _split_outputs(loss, vector)
        return to_numpy(loss.multiply_fisher_factor_transpose(tuple(map(to_backend, parts))))
    fn = loss.multiply_fisher_factor if kind == "fisher_factor" else loss.multiply_ggn_factor
    return np.concatenate([to_numpy(x) for x in fn(to_backend(vector))], axis=-1)


def _split_outputs(loss, v):
    if len(loss.parameter_dependants) == 1:
        return [v]
    d = v.shape[-1] // 2
    return [v[..., :d], v[..., d:]]


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
    Capability("losses.fisher_factor",
               "Per-example Fisher factor product √w·B_n u_n with B_n B_nᵀ = F_n, for u [N, K] "
               "in the factor's inner shape, [N, D] (TF K-FAC / kfac-jax factors: categorical "
               "B = diag(√p) − p √pᵀ, K = k; Bernoulli diag(√(p(1−p))); normal I/√v; "
               "mean-variance diag(1/√v, 1/(√2·v)), K = D).", _SIG + "; inputs: u [N, K]",
               ("mse_variance",), convert_output=_sqrt_variance_scale),
    Capability("losses.fisher_factor_transpose",
               "Per-example transposed Fisher factor product √w·B_nᵀ v_n for v [N, D] (the "
               "factors of losses.fisher_factor), [N, K].", _SIG + "; inputs: v [N, D]",
               ("mse_variance",), convert_output=_sqrt_variance_scale),
    Capability("losses.ggn_factor",
               "Per-example GGN factor product √w·C_n u_n with C_n C_nᵀ = G_n (the loss's "
               "output-space curvature; for the five losses here G_n = F_n and the factors are "
               "those of losses.fisher_factor), u [N, K] → [N, D].",
               _SIG + "; inputs: u [N, K]", ("mse_variance",),
               convert_output=_sqrt_variance_scale),
    Capability("losses.sample",
               "One sample of targets from the predictive distribution p(·|f_n), in the form "
               "the loss takes targets (class indices [N]; one-hot or 0/1 [N, k]; values "
               "[N, d]), drawn with params['seed'].  Random: tested statistically on the mean "
               "of T(y) = one-hot(y) (mean softmax(z)), y (Bernoulli: σ(z)), (y, (y − μ)²) "
               "(normal: (μ, v)) over many seeds; the expected output is that mean.",
               "inputs: logits [N, k] | mean [N, d] (+ variance [N, d]); params: loss, "
               "weight, variance (normal_mean), seed", ("mse_variance",),
               convert_inputs=_sample_inputs, statistic=sample_statistic),
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


def _mode(kind, inputs, params):
    """The mode of the predictive distribution (what a sampler without noise returns)."""
    if kind == "categorical":
        return np.argmax(inputs["logits"], axis=-1)
    if kind == "onehot_categorical":
        return np.eye(inputs["logits"].shape[-1])[np.argmax(inputs["logits"], axis=-1)]
    if kind == "multi_bernoulli":
        return (inputs["logits"] > 0).astype(np.float64)
    return inputs["mean"]


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
        r = rng_for(f"losses.factors/{tag}")
        inner = tuple(loss.fisher_factor_inner_shape)
        u = r.standard_normal(inner)
        v = r.standard_normal((n, sum(int(x.shape[-1]) for x in loss.parameter_dependants)))
        sqrt_w = float(np.sqrt(extra["weight"]))
        for cap, vec, name in (("fisher_factor", u, "u"), ("fisher_factor_transpose", v, "v"),
                               ("ggn_factor", u, "u")):
            exp = factor_product(loss, cap, vec)
            alts = {"factor_weight_w": exp * sqrt_w}  # w instead of √w (equal when w = 1)
            if cap != "ggn_factor":
                other = "fisher_factor_transpose" if cap == "fisher_factor" else "fisher_factor"
                if vec.shape == u.shape == v.shape:  # Bᵀ applied for B (or B for Bᵀ)
                    alts["factor_transposed"] = factor_product(loss, other, vec)
            cases.append(Case(f"losses.{cap}/{tag}", f"losses.{cap}",
                              {**inputs, name: vec}, params, exp, tol, meta, alts, desc))
        if opt is None:
            mean, var = sample_moments(kind, inputs, params)
            own = {k: v for k, v in inputs.items() if k != "targets"}
            alts = {"_mean": mean, "_var": var, "no_sampling": sample_statistic(
                _mode(kind, own, params), Case("", "", own, params, mean, tol))}
            if kind.startswith("normal"):  # the variance used as the standard deviation
                m2 = mean.copy()
                d = m2.shape[-1] // 2
                m2[..., d:] = m2[..., d:] ** 2
                alts["variance_as_std"] = m2
            # draws are cheap: 512 per group makes t_e = 3σ_e/√512 ≈ 0.13σ_e, enough to see
            # the variance used as the standard deviation at v = 1/2 (test_sample_power)
            cases.append(Case(f"losses.sample/{tag}", "losses.sample", own, params, mean,
                              tol, {**meta, "group_size": 512}, alts,
                              "statistical: mean of T(y) over seeded samples"))
        if kind in ("categorical", "normal_mean", "normal_mean_variance"):
            alts = {}
            if kind == "normal_mean_variance":
                alts["fisher_for_hessian"] = to_np(loss.fisher_matrix())
            cases.append(Case(f"losses.hessian/{tag}", "losses.hessian", inputs, params,
                              to_np(loss.hessian_matrix()), tol, meta, alts, desc))
    return cases
