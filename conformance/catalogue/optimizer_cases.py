"""Optimiser capabilities: a few preconditioned K-FAC steps on the suite's small networks,
compared step by step.

``optimizer.kfac_steps`` runs ``K = params["steps"]`` steps of K-FAC with a moving average of
the curvature factors, an inverse refresh period, factored (π-split) Tikhonov damping, momentum
and a learning rate.  Step ``t = 0, …, K−1`` at parameters θ_t on the batch
``(x[t], targets[t])`` (the objective is the **mean** loss h_t of that batch), in this order:

1. **statistics**: every layer's batch factors Â_l, Ĝ_l (``params["mode"]``, K-FAC as in
   ``networks.kfac``) at θ_t;
2. **moving average**, zero-debiased: S_l ← d·S_l + Â_l, W ← d·W + 1, A_l = S_l / W (likewise
   G_l; S = W = 0 before step 0, d = ``params["decay"]``): kfac-jax's ``ema_old = d,
   ema_new = 1``, equal to TF's zero-debiased ``(d, 1 − d)``;
3. **inverse refresh** if ``t mod k = 0`` (k = ``params["inverse_period"]``, so step 0
   refreshes): from the averaged factors of step 2, per layer with block scale s_l (|T| for a
   convolution, 1 for a dense layer), λ' = λ/s_l and π_l = sqrt((tr A_l/dim A_l) /
   (tr G_l/dim G_l)) (π = 1 if a trace is 0)::

       P_l = (1/s_l) · (A_l + π_l √λ' I)⁻¹ ⊗ (G_l + √λ' / π_l I)⁻¹

   kept unchanged (stale) until the next refresh;
4. **direction** d_t = −P g_t with g_t = ∇h_t(θ_t) (flat, canonical order) and P the
   block-diagonal preconditioner of the last refresh;
5. **momentum** after preconditioning: v_t = μ v_{t−1} − d_t (v_{−1} = 0, μ =
   ``params["momentum"]``);
6. **step** θ_{t+1} = θ_t − η v_t (η = ``params["learning_rate"]``).

This is :class:`kfac_ref.optim.KFACOptimizer` with ``momentum_type="regular"``,
``curvature_update_period=1``, ``inverse_update_period=k``, ``exact_power=False``,
``ema_style="kfac_jax"``.  The adapter receives ``x`` [K, N, …], ``targets`` [K, N(, …)], the
initial parameters ``w{i}``, ``b{i}`` and the hyper-parameters, and returns an array
[K, 2, P]: ``out[t, 0]`` the direction d_t, ``out[t, 1]`` the parameters θ_{t+1}.

The expected values come from :func:`pitfall_steps` without a fault: a loop over kfac_ref's
batch factors and gradients (each tested against explicit sums elsewhere) with the moving
average, π split, inverses, momentum and step written out in NumPy, independent of
:class:`kfac_ref.optim.KFACOptimizer` (which the kfac_ref adapter runs,
:func:`conformance.adapters.kfac_ref_optimizer.kfac_optimizer_steps`, and which must agree
with it); the alternatives are the same loop with one pitfall built in.  Tolerance derivation: the
network budget (work = N·D + P, ×4 for the chain depth) times κ, the largest condition
number of a damped factor product at a refresh, times K (every step adds its rounding to
the parameters).
"""

from __future__ import annotations

import numpy as np

from ..conventions import vec_index
from ..model import SAFETY, Capability, Case, Tolerance, rng_for
from .networks_cases import (
    _dense,
    _small_conv,
    _tanh,
    build_net,
    draw_parameters,
    layer_factors,
    loss_fn,
    params_from_inputs,
)

REQUIRES = ("kfac_ref.nn", "kfac_ref.curvature", "kfac_ref.losses", "kfac_ref.optim")

#: faults :func:`pitfall_steps` can build in (the stored alternatives' names, and one control
#: that no pitfall explains)
FAULTS = ("exact_damping", "unsplit_damping", "identity_before_first_refresh",
          "refresh_before_update", "refresh_every_step", "momentum_before_preconditioning",
          "no_zero_debias", "lagged_statistics")


# -- geometry ---------------------------------------------------------------------------------
def geometry(spec, x_shape):
    """(p, q, has_bias, patch, s) of every parametric layer: the factor sizes, the patch
    layout of a convolution and its block scale s (|T| output locations; 1 for dense)."""
    out, shape = [], tuple(x_shape[1:])
    for s in spec:
        if s["kind"] == "dense":
            out.append((s["d_in"] + s["bias"], s["d_out"], bool(s["bias"]), None, 1))
            shape = shape[:-1] + (s["d_out"],)
        elif s["kind"] == "conv2d":
            if s["padding"] != "VALID" or s["stride"] != 1 or s["dilation"] != 1:
                raise ValueError("optimizer cases use VALID, stride-1, undilated convolutions")
            kh, kw = s["kernel"]
            ho, wo = shape[0] - kh + 1, shape[1] - kw + 1
            out.append((kh * kw * s["c_in"] + s["bias"], s["c_out"], bool(s["bias"]),
                        (tuple(s["kernel"]), s["c_in"]), ho * wo))
            shape = (ho, wo, s["c_out"])
        elif s["kind"] == "mean_pool":
            shape = shape[-1:]
    return out


def param_index(spec, x_shape, conv):
    """Index map of the flat parameter vector from canonical into declared conventions."""
    idx, off = [], 0
    for p, q, b, patch, _ in geometry(spec, x_shape):
        idx.append(off + vec_index(p, q, conv, b, patch))
        off += p * q
    return np.concatenate(idx)


# -- the reference: kfac_ref's optimiser --------------------------------------------------------
def _inv(m, shift):
    s, q = np.linalg.eigh((m + m.T) / 2)
    return (q / (np.maximum(s, 0.0) + shift)) @ q.T


def _pi(a, g):
    ta, tg = float(np.trace(a)), float(np.trace(g))
    if ta == 0 or tg == 0:
        return 1.0
    return float(np.sqrt((ta / a.shape[0]) / (tg / g.shape[0])))


def _layer_inverse(a, g, s, lam, how):
    """The damped inverse of s·(A⊗G) as a function V [p, q] -> [p, q]."""
    lam_s = lam / s
    if how == "exact_damping":  # (s A⊗G + λI)⁻¹ through both eigenbases
        ea, qa = np.linalg.eigh(a)
        eg, qg = np.linalg.eigh(g)
        den = s * np.outer(np.maximum(ea, 0), np.maximum(eg, 0)) + lam
        return lambda v: qa @ ((qa.T @ v @ qg) / den) @ qg.T
    if how == "unsplit_damping":  # λ' on both factors, no π split
        ai, gi = _inv(a, lam_s), _inv(g, lam_s)
    else:
        pi, root = _pi(a, g), float(np.sqrt(lam_s))
        ai, gi = _inv(a, pi * root), _inv(g, root / pi)
    return lambda v: (ai @ v @ gi) / s


def _with_params(spec, net, flat, base):
    out = dict(base)
    for i, layer in zip([i for i, s in enumerate(spec) if s["kind"] in ("dense", "conv2d")],
                        [p for p in net.unflatten(flat) if p], strict=True):
        out[f"w{i}"] = np.asarray(layer[0])
        if spec[i]["bias"]:
            out[f"b{i}"] = np.asarray(layer[1])
    return out


def pitfall_steps(params, inputs, fault=None, return_kappa=False):
    """[K, 2, P] as the module docstring specifies, computed from kfac_ref's batch factors
    (``networks_cases.layer_factors``: one estimator update) and gradients
    (``loss_value_and_grad``) with the moving average, π split, inverses, momentum and step
    in NumPy, optionally with one of :data:`FAULTS` built in:

    * ``exact_damping`` — λ added to the product: (s A⊗G + λI)⁻¹ instead of the π split;
    * ``unsplit_damping`` — (A + λ'I)⁻¹ ⊗ (G + λ'I)⁻¹ (λ' = λ/s on each factor, no π);
    * ``identity_before_first_refresh`` — inverses start as the identity and refresh when
      (t + 1) mod k = 0 (the step counter incremented before the test);
    * ``refresh_before_update`` — the refresh inverts the factors before this step's
      statistics (at step 0 the zero-initialised ones: P = I/λ);
    * ``refresh_every_step`` — the period ignored (k = 1);
    * ``momentum_before_preconditioning`` — u_t = μu_{t−1} + g_t, d_t = −P u_t,
      θ_{t+1} = θ_t + η d_t (TF's "adam" momentum);
    * ``no_zero_debias`` — S ← d·S + (1 − d)·Â without dividing by the weight;
    * ``lagged_statistics`` — the statistics of step t taken at θ_{t−1} (the control that no
      pitfall explains).

    With ``return_kappa`` also the largest condition number of a damped factor product at a
    refresh (for the tolerance)."""
    from kfac_ref.curvature import loss_value_and_grad

    if fault is not None and fault not in FAULTS:
        raise ValueError(f"pitfall_steps: fault must be None or one of {FAULTS}; got {fault!r}")
    spec = params["net"]
    net = build_net(spec)
    xs, ys = inputs["x"], inputs["targets"]
    geo = geometry(spec, xs.shape[1:])
    d, lam, k = params["decay"], params["damping"], params["inverse_period"]
    lr, mu = params["learning_rate"], params["momentum"]
    theta = np.asarray(net.flatten(params_from_inputs(spec, inputs)), dtype=np.float64)
    prev_theta = theta
    sums, weight = None, 0.0
    values = [(np.zeros((p, p)), np.zeros((q, q))) for p, q, _, _, _ in geo]
    inverses = None
    vel = np.zeros_like(theta)
    kappa, rows = 1.0, []
    for t in range(int(params["steps"])):
        at = prev_theta if fault == "lagged_statistics" else theta
        stats_in = _with_params(spec, net, at, dict(inputs, x=xs[t], targets=ys[t]))
        batch = layer_factors(params, stats_in)
        before = values
        if fault == "no_zero_debias":
            sums = batch if sums is None else [(d * sa + (1 - d) * a, d * sg + (1 - d) * g)
                                               for (sa, sg), (a, g) in zip(sums, batch,
                                                                           strict=True)]
            if t == 0:
                sums = [((1 - d) * a, (1 - d) * g) for a, g in batch]
            values = sums
        else:
            sums = batch if sums is None else [(d * sa + a, d * sg + g) for (sa, sg), (a, g)
                                               in zip(sums, batch, strict=True)]
            weight = d * weight + 1.0
            values = [(sa / weight, sg / weight) for sa, sg in sums]
        theta_struct = net.unflatten(theta)
        _, grad = loss_value_and_grad(net, loss_fn(params), theta_struct, (xs[t], ys[t]))
        grad = np.asarray(grad, dtype=np.float64)
        if fault == "refresh_every_step":
            refresh = True
        elif fault == "identity_before_first_refresh":
            refresh = (t + 1) % k == 0
        else:
            refresh = t % k == 0
        if refresh:
            facs = before if fault == "refresh_before_update" else values
            how = fault if fault in ("exact_damping", "unsplit_damping") else "factored"
            inverses = [_layer_inverse(a, g, s, lam, how)
                        for (a, g), (_, _, _, _, s) in zip(facs, geo, strict=True)]
            for (a, g), (_, _, _, _, s) in zip(facs, geo, strict=True):
                pi, root = _pi(a, g), np.sqrt(lam / s)
                ca = np.linalg.eigvalsh(a).clip(0)
                cg = np.linalg.eigvalsh(g).clip(0)
                kappa = max(kappa, float((ca.max() + pi * root) / (ca.min() + pi * root)
                                         * (cg.max() + root / pi) / (cg.min() + root / pi)))

        def precondition(vec, inverses=inverses):
            if inverses is None:  # identity before the first refresh
                return vec
            out, off = [], 0
            for (p, q, _, _, _), inv in zip(geo, inverses, strict=True):
                out.append(inv(vec[off:off + p * q].reshape(p, q)).reshape(-1))
                off += p * q
            return np.concatenate(out)

        if fault == "momentum_before_preconditioning":
            vel = mu * vel + grad
            direction = -precondition(vel)
            step = lr * direction
        else:
            direction = -precondition(grad)
            vel = mu * vel - direction
            step = -lr * vel
        prev_theta, theta = theta, theta + step
        rows.append(np.stack([direction, theta]))
    out = np.stack(rows)
    return (out, kappa) if return_kappa else out


# -- conversions -----------------------------------------------------------------------------
def _steps_output(arr, case, conv):
    if conv.curvature_of != "mean" or conv.bias_position == "separate" or (
            conv.mse_variance is not None and case.params.get("loss") == "normal_mean"
            and conv.mse_variance != case.params.get("variance")):
        # another objective scale or variance changes the damping's relative size (and a
        # separate bias block is another approximation): no conversion of a whole trajectory
        raise NotImplementedError(
            "optimizer.kfac_steps is only converted for permutation conventions (kron_order, "
            "bias_position first/last, patch_order); declare curvature_of='mean', the case's "
            "variance and a joint bias")
    idx = param_index(case.params["net"], case.inputs["x"].shape[1:], conv)
    return np.asarray(arr)[..., idx]


_SIG = ("inputs: x [K, N, …], targets [K, N(, …)], w{i}, b{i} (initial parameters); params: "
        "net (layer list), loss, variance, mode, steps K, learning_rate η, momentum μ, "
        "damping λ, decay d, inverse_period k")

CAPABILITIES = [
    Capability(
        "optimizer.kfac_steps",
        "K preconditioned K-FAC steps, out[t, 0] = direction d_t = −P g_t, out[t, 1] = θ_{t+1} "
        "([K, 2, P]); step t: batch factors at θ_t → zero-debiased EMA (S ← dS + Â, "
        "W ← dW + 1, A = S/W) → inverse refresh if t mod k = 0, P = ⊕_l (1/s_l)(A_l + "
        "π_l√(λ/s_l) I)⁻¹ ⊗ (G_l + √(λ/s_l)/π_l I)⁻¹ (stale in between) → d_t = −P ∇h_t(θ_t) "
        "→ momentum after preconditioning v_t = μv_{t−1} − d_t → θ_{t+1} = θ_t − η v_t.",
        _SIG, ("kron_order", "bias_position", "patch_order", "curvature_of", "mse_variance"),
        convert_output=_steps_output, requires=REQUIRES),
]


# -- cases -------------------------------------------------------------------------------------
def _make_inputs(cid, spec, x_shape, steps, loss, n_out):
    r = rng_for(cid)
    inputs = {"x": r.standard_normal((steps,) + tuple(x_shape))}
    inputs.update(draw_parameters(r, spec))
    n = x_shape[0]
    if loss == "categorical":
        inputs["targets"] = r.integers(0, n_out, size=(steps, n)).astype(np.int64)
    else:
        inputs["targets"] = r.standard_normal((steps, n, n_out))
    return inputs


#: pitfalls stored as alternatives of every case
PITFALLS = ("exact_damping", "unsplit_damping", "identity_before_first_refresh",
            "refresh_before_update", "refresh_every_step", "momentum_before_preconditioning",
            "no_zero_debias")


def build_cases() -> list[Case]:
    conv, tanh = _small_conv(), _tanh()
    # (name, spec, x shape per batch, loss params, outputs, hyper-parameters, description)
    nets = [
        ("mlp_tanh_n4_ce", [_dense(3, 4), tanh, _dense(4, 3)], (4, 3),
         {"loss": "categorical"}, 3,
         {"steps": 4, "inverse_period": 2, "momentum": 0.5, "learning_rate": 0.5,
          "damping": 0.1, "decay": 0.9},
         "MLP, cross-entropy: 4 steps, inverses refreshed at steps 0 and 2, momentum 0.5"),
        ("deep_linear_n5_mse", [_dense(3, 3), _dense(3, 2)], (5, 3),
         {"loss": "normal_mean", "variance": 0.5}, 2,
         {"steps": 4, "inverse_period": 3, "momentum": 0.0, "learning_rate": 0.3,
          "damping": 0.5, "decay": 0.8},
         "deep linear network, squared error: 4 steps, refresh at 0 and 3, no momentum"),
        ("cnn_pool_n3_mse", [conv, tanh, {"kind": "mean_pool"}, _dense(2, 2)], (3, 5, 4, 2),
         {"loss": "normal_mean", "variance": 1.0}, 2,
         {"steps": 5, "inverse_period": 2, "momentum": 0.7, "learning_rate": 0.2,
          "damping": 0.2, "decay": 0.95},
         "conv → tanh → mean pool → dense (KFC block, s = |T| = 12): 5 steps, refresh at "
         "0, 2, 4, momentum 0.7"),
    ]
    cases = []
    for name, spec, x_shape, lossp, n_out, hyper, desc in nets:
        cid = f"optimizer.kfac_steps/{name}"
        inputs = _make_inputs(cid, spec, x_shape, hyper["steps"], lossp["loss"], n_out)
        params = {"net": spec, **lossp, "mode": "ggn_exact", **hyper}
        # the expected trajectory is the NumPy loop (independent of KFACOptimizer, which
        # tests/conformance/test_conformance_optimizer.py checks against it on every backend)
        expected, kappa = pitfall_steps(params, inputs, return_kappa=True)
        alts = {f: pitfall_steps(params, inputs, f) for f in PITFALLS}
        n = x_shape[0]
        p_total = int(expected.shape[-1])
        work = n * n_out + p_total
        steps = hyper["steps"]
        tol = Tolerance(SAFETY * 4 * work * kappa * steps,
                        f"network GEMMs: work = N·D + P = {work}, ×4 for the chain depth, × κ "
                        f"= {kappa:.3g} (largest condition number of a damped factor product "
                        f"at a refresh), × K = {steps} steps")
        meta = {"N": n, "steps": steps}
        cases.append(Case(cid, "optimizer.kfac_steps", inputs, params, expected, tol, meta,
                          alts, desc))
    return cases
