"""Reference K-FAC factors for your own PyTorch model, and a per-layer diagnosis of yours.

.. code-block:: python

    from conformance.own_model import check_torch_kfac

    result = check_torch_kfac(model, "cross_entropy", x, y, my_factors,
                              mode="fisher_exact")
    print(result)               # one line per layer and factor, with the diagnosis
    assert result.ok

``my_factors`` maps a module name of ``model.named_modules()`` to ``{"A": ..., "G": ...}``
(torch tensors or arrays) in the model's own layout: for ``nn.Linear`` (weight
``[out, in]``) ``A`` is ``[in(+1), in(+1)]`` over the layer input with the bias's homogeneous
coordinate **last** when the layer has a bias, ``G`` is ``[out, out]``.  The reference is

.. math::

    A = \\frac{1}{N}\\sum_n \\bar a_n \\bar a_n^\\top, \\qquad
    G = \\frac{1}{N}\\sum_n \\sum_k g_{n,k} g_{n,k}^\\top

(Martens & Grosse 2015), with :math:`g_{n,k}` the back-propagated output vectors of the
per-example loss :math:`\\ell_n`: for ``mode="fisher_exact"`` column :math:`k` of the
loss's Fisher factor :math:`B_n` (:math:`B_n B_n^\\top = F_n`, from
:mod:`kfac_ref.losses`), for ``"fisher_empirical"`` the gradient at the data target.  The
statistics are computed by :func:`kfac_ref.factors.fully_connected_kronecker_factor` from
layer inputs and output gradients captured with hooks.  A ``nn.Linear`` applied to
``[N, S, d]`` (weight sharing) follows KFAC-expand (:math:`A` over the :math:`NS` rows,
:math:`G = \\frac1N\\sum_{n,s} g g^\\top`) or, with ``sharing="reduce"``, KFAC-reduce
(Eschenhagen et al. 2023).

The loss is ``"cross_entropy"`` (logits ``[N, C]``, integer targets) or ``"mse"``
(:math:`\\ell_n = \\tfrac12\\|f_n - y_n\\|^2`); the model's output is ``[N, C]``.  Only
``nn.Linear`` layers are checked here (``nn.Conv2d`` is not supported yet).  torch is
imported inside the functions: the suite does not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["reference_torch_kfac", "check_torch_kfac", "LayerCheck", "ModelCheck", "MODES"]

MODES = ("fisher_exact", "fisher_empirical")
LOSSES = ("cross_entropy", "mse")
SHARING = ("expand", "reduce")


def _loss_object(loss, out, targets):
    from kfac_ref import losses

    if loss == "cross_entropy":
        return losses.CategoricalLogitsNegativeLogProbLoss(out, targets=targets)
    return losses.NormalMeanNegativeLogProbLoss(out, targets=targets, variance=1.0)


def _output_vectors(loss, out, targets, mode):
    """[K, N, C] output-space vectors whose back-propagation gives the g's of ``mode``."""
    lo = _loss_object(loss, out, targets)
    if mode == "fisher_empirical":
        return np.asarray(lo.grad_of_evaluate()[0])[None]  # per example: no 1/N
    k = lo.fisher_factor_inner_shape[-1]
    cols = []
    for j in range(k):  # K = C output-space directions, not a loop over examples
        e = np.zeros(lo.fisher_factor_inner_shape)
        e[:, j] = 1.0
        cols.append(np.asarray(lo.multiply_fisher_factor(e)[0]))
    return np.stack(cols)


def _check_args(fn, model, loss, mode, sharing):
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module; got {type(model).__name__}.")
    if loss not in LOSSES:
        raise ValueError(f"{fn}: loss must be one of {LOSSES}; got {loss!r}.")
    if mode not in MODES:
        raise ValueError(f"{fn}: mode must be one of {MODES}; got {mode!r}.")
    if sharing not in SHARING:
        raise ValueError(f"{fn}: sharing must be one of {SHARING}; got {sharing!r}.")


def reference_torch_kfac(model, loss, inputs, targets, *, mode="fisher_exact",
                         sharing="expand", _fn="reference_torch_kfac"):
    r"""Reference K-FAC factors of every ``nn.Linear`` of ``model``, in its own layout.

    .. math::

        A = \frac{1}{N}\sum_n \bar a_n \bar a_n^\top, \qquad
        G = \frac{1}{N}\sum_n \sum_k g_{n,k} g_{n,k}^\top

    Returns ``{module name: {"A": ndarray, "G": ndarray, "N": int, "T": int}}`` in float64
    (``T`` = the shared dimension S of a layer applied to ``[N, S, d]``, else 1).
    """
    import torch

    _check_args(_fn, model, loss, mode, sharing)
    from kfac_ref.factors import fully_connected_kronecker_factor as fc

    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if not layers:
        raise ValueError(f"{_fn}: model must contain an nn.Linear layer; got none.")
    ins, outs, hooks = {}, {}, []
    for name, mod in layers.items():
        def hook(m, args, output, name=name):
            ins[name] = args[0].detach().to(torch.float64)
            outs[name] = output
        hooks.append(mod.register_forward_hook(hook))
    try:
        out = model(inputs)
    finally:
        for h in hooks:
            h.remove()
    out_np = out.detach().to(torch.float64).cpu().numpy()
    y = targets.detach().cpu().numpy() if torch.is_tensor(targets) else np.asarray(targets)
    if loss == "mse":
        y = y.astype(np.float64)
    vecs = _output_vectors(loss, out_np, y, mode)
    n = out_np.shape[0]
    g_rows = {name: [] for name in layers}
    for v in vecs:
        gv = torch.as_tensor(v, dtype=out.dtype, device=out.device)
        grads = torch.autograd.grad(out, [outs[k] for k in layers], grad_outputs=gv,
                                    retain_graph=True)
        for name, g in zip(layers, grads, strict=True):
            g_rows[name].append(g.detach().to(torch.float64).cpu().numpy())
    res = {}
    for name, mod in layers.items():
        a = ins[name].cpu().numpy()
        g = np.stack(g_rows[name])  # [K, N, (S,) d_out]
        bias = mod.bias is not None
        t = a.shape[1] if a.ndim == 3 else 1
        if a.ndim == 3 and sharing == "reduce":
            a, g = a.mean(axis=1), g.sum(axis=2)
        k = g.shape[0]
        a2 = a.reshape(-1, a.shape[-1])
        g2 = g.reshape(-1, g.shape[-1])
        # fc divides by the number of rows: K·N·S for G, N·S for A (expand), N (reduce)
        scale_g = g2.shape[0] / n
        res[name] = {"A": np.asarray(fc(a2, has_bias=bias)),
                     "G": np.asarray(fc(g2)) * scale_g, "N": n, "T": t, "K": k}
    return res


@dataclass
class LayerCheck:
    """One factor of one layer: agreement with the reference, or the diagnosed pitfall."""

    layer: str
    factor: str
    ok: bool
    rel_err: float
    rtol: float
    diagnosis: str = ""
    explanation: str = ""

    def line(self) -> str:
        head = f"{self.layer}.{self.factor}: "
        if self.ok:
            return head + f"ok (relative error {self.rel_err:.1e} <= {self.rtol:.1e})"
        return head + (f"FAIL relative error {self.rel_err:.3e} > {self.rtol:.1e}; "
                       f"diagnosis: {self.diagnosis}: {self.explanation}")


@dataclass
class ModelCheck:
    """Every :class:`LayerCheck` of a model; ``ok`` when every factor agrees."""

    mode: str
    checks: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def __str__(self) -> str:
        lines = [f"K-FAC factors against the reference (mode {self.mode}): "
                 f"{'all agree' if self.ok else 'DISAGREE'}"]
        return "\n".join(lines + ["  " + c.line() for c in self.checks])


def _alternatives(name, ref, others, mode, sharing):
    """What each pitfall would give, per factor: A, G -> {pitfall: array}."""
    alts = {"A": {}, "G": {}}
    a = ref["A"]
    if a.shape[0] > 1:
        perm = np.r_[a.shape[0] - 1, 0:a.shape[0] - 1]  # homogeneous coordinate first
        alts["A"]["bias_position"] = a[np.ix_(perm, perm)]
    other_mode = others.get("mode")
    if other_mode is not None:
        key = "true_fisher" if mode == "fisher_empirical" else "empirical_fisher"
        alts["G"][key] = other_mode[name]["G"]
    other_sh = others.get("sharing")
    if other_sh is not None and ref["T"] > 1:
        key = f"{'reduce' if sharing == 'expand' else 'expand'}_instead_of_{sharing}"
        alts["A"][key] = other_sh[name]["A"]
        alts["G"][key] = other_sh[name]["G"]
    return alts


def check_torch_kfac(model, loss, inputs, targets, factors, *, mode="fisher_exact",
                     sharing="expand") -> ModelCheck:
    r"""Compare a user's K-FAC factors of ``model`` with the reference, per layer and factor,
    and name the pitfall behind each disagreement.

    .. math::

        \frac{\|A_\text{user} - A\|_F}{\|A\|_F} \le \text{rtol}, \qquad
        \frac{\|G_\text{user} - G\|_F}{\|G\|_F} \le \text{rtol}

    ``factors``: ``{module name: {"A": ..., "G": ...}}`` (either may be missing); the
    tolerance is that of the factor's floating type (float32 factors get float32's).  The
    diagnosis tries the suite's pitfalls: scalar factors of N, |S| and 2, the bias coordinate
    first, transposes, the empirical instead of the true Fisher (and vice versa), expand
    instead of reduce (and vice versa).
    """
    from .compare import compare
    from .diagnosis import diagnose
    from .model import EPS32, EPS64, SAFETY, Capability, Case, Tolerance

    fn = "check_torch_kfac"
    ref = reference_torch_kfac(model, loss, inputs, targets, mode=mode, sharing=sharing,
                               _fn=fn)
    if not isinstance(factors, dict) or not factors:
        raise ValueError(f"{fn}: factors must be a non-empty dict of module name -> "
                         f"{{'A': ..., 'G': ...}}; got {factors!r:.80}.")
    unknown = sorted(set(factors) - set(ref))
    if unknown:
        raise ValueError(f"{fn}: factors must name nn.Linear modules of the model "
                         f"({', '.join(ref)}); got {', '.join(unknown)}.")
    other_mode = "fisher_empirical" if mode == "fisher_exact" else "fisher_exact"
    others = {"mode": reference_torch_kfac(model, loss, inputs, targets, mode=other_mode,
                                           sharing=sharing, _fn=fn)}
    if any(r["T"] > 1 for r in ref.values()):
        others["sharing"] = reference_torch_kfac(
            model, loss, inputs, targets, mode=mode,
            sharing="reduce" if sharing == "expand" else "expand", _fn=fn)
    cap = Capability("own_model.factor", "a K-FAC factor of the user's model", "")
    result = ModelCheck(mode)
    for name, user in factors.items():
        alts = _alternatives(name, ref[name], others, mode, sharing)
        for fac in ("A", "G"):
            if fac not in user:
                continue
            x = user[fac]
            x = x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
            eps = EPS32 if x.dtype == np.float32 else EPS64
            exp = ref[name][fac]
            rows = ref[name]["N"] * ref[name]["T"] * (ref[name]["K"] if fac == "G" else 1)
            tol = Tolerance(SAFETY * (rows + exp.shape[0]),
                            "one sum of N·S·K outer products per entry, and the forward and "
                            "backward passes of the model")
            rtol = tol.rtol(eps)
            case = Case(f"{name}.{fac}", cap.name, {}, {}, exp, tol,
                        meta={"N": ref[name]["N"], "T": ref[name]["T"]},
                        alternatives=alts[fac])
            c = compare(x.astype(np.float64), exp, rtol)
            check = LayerCheck(name, fac, c.ok, c.rel_err, rtol)
            if not c.ok:
                d = diagnose(x, case, cap, None, rtol)
                check.diagnosis, check.explanation = d.pitfall, d.explanation
            result.checks.append(check)
    return result
