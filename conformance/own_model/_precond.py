r"""``check_torch_preconditioner``: the own-model check of a PyTorch K-FAC preconditioner —
the damped inverse product a K-FAC optimiser applies to a batch's gradient.

Per ``nn.Linear`` / ``nn.Conv2d`` layer the gradient of the **mean** loss is the
``[out, in(+1)]`` matrix :math:`\Gamma = [\nabla W, \nabla b]` (``weight.reshape(out, -1)``,
the bias column last: the own-model layout of the factors, :mod:`conformance.own_model`),
and the reference preconditioned gradient is, with factored Tikhonov damping and the
trace-norm π (Martens & Grosse 2015, §6.3),

.. math::

    P = \big(G + \tfrac{\sqrt\lambda}{\pi} I\big)^{-1}\, \Gamma\,
        \big(A + \pi\sqrt\lambda\, I\big)^{-1}, \qquad
    \pi = \sqrt{\frac{\operatorname{tr}A / \dim A}{\operatorname{tr}G / \dim G}}
    \quad (\pi = 1 \text{ if a trace is } 0),

i.e. :math:`\mathrm{vec}_r(P) = [(G + \tfrac{\sqrt\lambda}{\pi}I) \otimes (A + \pi\sqrt\lambda
I)]^{-1}\mathrm{vec}_r(\Gamma)` — equivalently :math:`(A_\lambda \otimes G_\lambda)^{-1}`
on the column-major vec — or with exact damping :math:`(A\otimes G + \lambda I)^{-1}` on the
column-major vec, through both eigendecompositions.  Both are computed by
:func:`kfac_ref.linalg.kron_damped_inverse_matvec`; the alternatives by
:func:`kfac_ref.linalg.pi_tracenorm`, :func:`~kfac_ref.linalg.pi_adjusted_damping` and
:func:`~kfac_ref.linalg.damped_inverse`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from ._check import verdict
from ._reference import _is_tensor, _np, check_mode_args, check_samples
from ._torch import reference_torch_kfac, torch_conv_padding

DAMPING_STYLES = ("factored", "exact")

_FN = "check_torch_preconditioner"


# --------------------------------------------------------------------------------------
# NumPy reference (no torch)
# --------------------------------------------------------------------------------------
def preconditioner_reference(a, g, grad, damping, damping_style="factored"):
    r"""The reference damped K-FAC product of one layer, in the torch layout.

    ``a`` ``[d_A, d_A]``, ``g`` ``[d_G, d_G]``, ``grad`` ``[d_G, d_A]`` (float64 arrays);
    returns ``[d_G, d_A]``:

    .. math::

        P = (G + \tfrac{\sqrt\lambda}{\pi}I)^{-1}\,\Gamma\,(A + \pi\sqrt\lambda I)^{-1}
        \quad\text{or}\quad
        \mathrm{vec}_c(P) = (A\otimes G + \lambda I)^{-1}\mathrm{vec}_c(\Gamma)

    (``damping_style`` ``"factored"`` or ``"exact"``): kfac_ref's
    :func:`~kfac_ref.linalg.kron_damped_inverse_matvec` with ``a`` as its left factor and
    ``order="F"`` (:math:`X = \Gamma` read as ``[q, p]``, result :math:`B X A^\top`)."""
    from kfac_ref.linalg import kron_damped_inverse_matvec

    return np.asarray(kron_damped_inverse_matvec(a, g, grad, damping=damping,
                                                 damping_method=damping_style, order="F"))


def preconditioner_alternatives(a, g, grad, damping, damping_style="factored", t=1):
    r"""What a preconditioner with each damping or layout pitfall would return for one
    layer (``{pitfall id: [d_G, d_A] array}``), computed with kfac_ref:

    * ``exact_damping`` / ``factored_damping``: the other damping style;
    * ``pi_off`` (π = 1), ``pi_without_dimensions``
      (:math:`\pi' = \sqrt{\operatorname{tr}A/\operatorname{tr}G}`), ``pi_squared``,
      ``unsplit_damping`` (:math:`(A+\lambda I)\otimes(G+\lambda I)`),
      ``damping_parameterisation`` (λ per factor: :math:`(A+\pi\lambda I)\otimes
      (G+\tfrac\lambda\pi I)`): factored dampings, so under ``damping_style="exact"``
      each is named with ``factored_damping+`` in front (e.g.
      ``factored_damping+unsplit_damping``: λ added to both factors where
      :math:`A\otimes G + \lambda I` is declared);
    * ``t > 1`` (a convolution's or a shared layer's |T|): ``damping_not_normalised``
      (λ·|T|: TF's Γ = G/|T| with its block scale |T| but λ not divided by |T|) and
      ``spurious_damping_normalisation`` (λ/|T| on a block A⊗G that holds no scale);
      each also in the other damping style, and
      ``pi_without_dimensions+damping_not_normalised`` (both at once);
    * ``no_damping``: the undamped inverse (left out where a factor is singular);
    * ``kron_order_swapped``: the damped inverses applied in the other Kronecker order to
      the row-major vec of Γ, :math:`\mathrm{vec}_r(\Gamma)` read as a ``[d_A, d_G]``
      matrix :math:`X`, :math:`A_\lambda^{-1} X G_\lambda^{-1}` read back as ``[d_G, d_A]``
      (on a square layer, :math:`d_A = d_G`, the G-side inverse on the input side).
    """
    from kfac_ref import KFACValueError
    from kfac_ref.linalg import (
        damped_inverse,
        kron_damped_inverse_matvec,
        pi_adjusted_damping,
        pi_tracenorm,
    )

    lam = float(damping)
    root = math.sqrt(lam)
    d_a, d_g = a.shape[0], g.shape[0]
    pi = float(pi_tracenorm(a, g))
    alts = {}

    def add(name, compute):
        try:
            alts[name] = np.asarray(compute(), dtype=np.float64)
        except KFACValueError:  # a singular (undamped or under-damped) factor: no candidate
            pass

    def split(left, right, x=grad):
        return np.asarray(damped_inverse(g, right)) @ x @ np.asarray(damped_inverse(a, left))

    def styled(lam_, style=damping_style):
        return preconditioner_reference(a, g, grad, lam_, style)

    other = "exact" if damping_style == "factored" else "factored"
    other_id = "exact_damping" if damping_style == "factored" else "factored_damping"
    add(other_id, lambda: styled(lam, other))
    # the factored family; under exact damping each is also the factored_damping fault
    fam = "" if damping_style == "factored" else "factored_damping+"
    zero_trace = float(np.trace(a)) == 0.0 or float(np.trace(g)) == 0.0
    pi_nd = 1.0 if zero_trace else pi * math.sqrt(d_a / d_g)  # sqrt(tr A / tr G)
    add(f"{fam}pi_off", lambda: split(root, root))
    add(f"{fam}pi_without_dimensions", lambda: split(pi_nd * root, root / pi_nd))
    add(f"{fam}pi_squared", lambda: split(pi * pi * root, root / (pi * pi)))
    add(f"{fam}unsplit_damping", lambda: split(lam, lam))
    add(f"{fam}damping_parameterisation", lambda: split(pi * lam, lam / pi))
    if t > 1:
        add("damping_not_normalised", lambda: styled(lam * t))
        add("spurious_damping_normalisation", lambda: styled(lam / t))
        add(f"{other_id}+damping_not_normalised", lambda: styled(lam * t, other))
        add(f"{other_id}+spurious_damping_normalisation", lambda: styled(lam / t, other))
        full = math.sqrt(lam * t)  # both at once: common in hand-written conv K-FAC
        add(f"{fam}pi_without_dimensions+damping_not_normalised",
            lambda: split(pi_nd * full, full / pi_nd))
    add("no_damping", lambda: split(0.0, 0.0))
    x_swapped = grad.reshape(d_a, d_g)  # vec_r(Γ) read in the other order's layout

    def swapped():
        if damping_style == "exact":
            y = kron_damped_inverse_matvec(a, g, x_swapped, damping=lam,
                                           damping_method="exact", order="C")
        else:
            left, right = (float(v) for v in pi_adjusted_damping(a, g, lam))
            y = np.asarray(damped_inverse(a, left)) @ x_swapped @ np.asarray(
                damped_inverse(g, right))
        return np.asarray(y).reshape(d_g, d_a)

    add("kron_order_swapped", swapped)
    return alts


def damped_condition(a, g, damping, damping_style="factored"):
    r"""``(κ_factors, κ_block)``: how much the damped inverse product amplifies relative
    errors of the factors and of the gradient (see :func:`check_torch_preconditioner`'s
    tolerance).  Factored damping (:math:`A_\lambda = A + \pi\sqrt\lambda I`,
    :math:`G_\lambda = G + \tfrac{\sqrt\lambda}{\pi} I`): :math:`\kappa(A_\lambda) +
    \kappa(G_\lambda)` and :math:`\kappa(A_\lambda)\,\kappa(G_\lambda) =
    \kappa(A_\lambda\otimes G_\lambda)`; exact damping: :math:`\kappa(A\otimes G +
    \lambda I)` for both.  From the eigenvalues of the (symmetric) factors; ``inf`` when
    the damped block is not positive definite."""
    from kfac_ref.linalg import pi_adjusted_damping

    s_a, s_g = np.linalg.eigvalsh(a), np.linalg.eigvalsh(g)
    if damping_style == "factored":
        left, right = (float(v) for v in pi_adjusted_damping(a, g, float(damping)))
        if s_a[0] + left <= 0 or s_g[0] + right <= 0:
            return math.inf, math.inf
        k_a = float((s_a[-1] + left) / (s_a[0] + left))
        k_g = float((s_g[-1] + right) / (s_g[0] + right))
        return k_a + k_g, k_a * k_g
    prods = np.outer(s_a, s_g)
    lo, hi = float(prods.min()) + damping, float(prods.max()) + damping
    k = hi / lo if lo > 0 else math.inf
    return k, k


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------
@dataclass
class PreconditionerLayerCheck:
    """One layer's preconditioned gradient against the reference: agreement, or the
    diagnosed pitfall; ``kappa`` is the damped block's condition number κ_B (see the
    tolerance of :func:`check_torch_preconditioner`)."""

    layer: str
    shape: tuple
    ok: bool
    rel_err: float
    rtol: float
    kappa: float
    diagnosis: str = ""
    explanation: str = ""

    def line(self) -> str:
        d_g, d_a = self.shape
        return f"{self.layer} [{d_g}×{d_a}, κ_B {self.kappa:.1e}]: " + verdict(self)


@dataclass
class PreconditionerCheck:
    """Every :class:`PreconditionerLayerCheck` of a model, and the supported layers that
    were not checked (``missing``: no preconditioned gradient given).  ``ok`` when at least
    one layer was checked, every checked layer agrees and none is missing."""

    mode: str
    damping: float
    damping_style: str
    factors: str  # "reference" or "your"
    checks: list = field(default_factory=list)
    missing: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and not self.missing and all(c.ok for c in self.checks)

    def __str__(self) -> str:
        verdict = "all agree" if self.ok else "DISAGREE"
        lines = [f"K-FAC preconditioned gradient against the reference ({self.damping_style} "
                 f"damping λ = {self.damping:g}, {self.factors} factors, mode {self.mode}): "
                 f"{verdict}"]
        lines += ["  " + c.line() for c in self.checks]
        if self.missing:
            lines.append("  FAIL not checked (no preconditioned gradient given): "
                         + ", ".join(self.missing))
        if not self.checks:
            lines.append("  FAIL no layer was compared")
        from ._check import _wrap

        return "\n".join(_wrap(line, 90) for line in lines)


# --------------------------------------------------------------------------------------
# The torch check
# --------------------------------------------------------------------------------------
def _layers(model):
    """``{name: module}`` of the ``nn.Linear`` and ``nn.Conv2d`` layers (``groups=1``, zero
    padding: :func:`torch_conv_padding` refuses others, naming the module), less the
    projections inside an ``nn.MultiheadAttention``."""
    import torch

    layers, attention = {}, []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.MultiheadAttention):
            attention.append(name + ".")  # its out_proj is a Linear it never calls
        elif any(name.startswith(prefix) for prefix in attention):
            continue
        elif isinstance(m, torch.nn.Conv2d):
            torch_conv_padding(m, name)
            layers[name] = m
        elif isinstance(m, torch.nn.Linear):
            layers[name] = m
    if not layers:
        raise ValueError(f"{_FN}: model must contain an nn.Linear or nn.Conv2d layer; got "
                         "none.")
    return layers


def _layer_dims(mod):
    """(d_G, d_A, weight shape, has bias) of a supported layer."""
    w = tuple(mod.weight.shape)
    bias = mod.bias is not None
    return w[0], int(np.prod(w[1:])) + bias, w, bias


def _block_damping(lam, damping_style, conventions):
    """The block's damping λ from the given ``damping`` and the declared ``conventions``
    (only ``damping_per_factor``: ``"sqrt"``, the default, gives λ to the block and √λ to
    each factor; ``"lambda"`` gives the value to each factor, the block's λ being its
    square — :data:`conformance.conventions.FIELDS`)."""
    if conventions is None:
        return lam
    if not isinstance(conventions, dict):
        raise TypeError(f"{_FN}: conventions must be a dict of field -> value; got "
                        f"{type(conventions).__name__}.")
    for key, value in conventions.items():
        if key != "damping_per_factor":
            raise ValueError(f"{_FN}: conventions has no field {key!r} here; the "
                             "preconditioner takes 'damping_per_factor' (the factors' "
                             "conventions go to check_torch_kfac).")
        if value not in ("sqrt", "lambda"):
            raise ValueError(f"{_FN}: conventions['damping_per_factor'] must be one of "
                             f"('sqrt', 'lambda'); got {value!r}.")
        if value == "lambda" and damping_style != "factored":
            raise ValueError(f"{_FN}: conventions['damping_per_factor']='lambda' needs "
                             "damping_style='factored' (exact damping has one λ).")
    return lam * lam if conventions.get("damping_per_factor") == "lambda" else lam


def _check_damping(damping, damping_style, flat):
    if (isinstance(damping, bool) or not isinstance(damping, numbers.Real)
            or not math.isfinite(float(damping)) or float(damping) <= 0):
        raise ValueError(f"{_FN}: damping must be a finite real number λ > 0; got "
                         f"{damping!r:.60}.")
    if damping_style not in DAMPING_STYLES:
        raise ValueError(f"{_FN}: damping_style must be one of {DAMPING_STYLES}; got "
                         f"{damping_style!r}.")
    if not isinstance(flat, bool):
        raise TypeError(f"{_FN}: flat must be True or False; got {flat!r:.60}.")


def _as_float_array(x, what):
    """A NumPy copy of a real floating tensor or array (the user's buffers are not kept)."""
    if isinstance(x, (dict, list, tuple, str)) or x is None:
        raise TypeError(f"{_FN}: {what} must be a tensor or array; got "
                        f"{type(x).__name__}.")
    if _is_tensor(x) and str(x.dtype) not in ("torch.float32", "torch.float64"):
        raise TypeError(f"{_FN}: {what} must be a float32 or float64 tensor or array; got "
                        f"dtype {x.dtype}.")
    arr = np.array(_np(x), copy=True)
    if arr.dtype not in (np.float32, np.float64):
        raise TypeError(f"{_FN}: {what} must be a float32 or float64 tensor or array; got "
                        f"dtype {arr.dtype}.")
    return arr


def _shape_error(what, want, got, extra=""):
    hint = ""
    if len(want) == 2 and tuple(got) == tuple(want)[::-1] and want[0] != want[1]:
        hint = " (the transpose of the expected shape)"
    return ValueError(f"{_FN}: {what} must have shape {tuple(want)}{extra}; got "
                      f"{tuple(got)}{hint}.")


def _user_matrix(name, entry, mod, flat, source):
    """The user's preconditioned gradient of layer ``name`` as a float ``[d_G, d_A]`` matrix
    (weight reshaped ``[out, -1]``, bias column last), validated and copied."""
    d_g, d_a, w_shape, bias = _layer_dims(mod)
    what = f"{source}[{name!r}]"
    if flat:
        v = _as_float_array(entry, what)
        n_w = int(np.prod(w_shape))
        if v.shape != (n_w + d_g * bias,):
            raise _shape_error(what, (n_w + d_g * bias,), v.shape,
                               " (flat=True: [weight.flatten(), bias])")
        w, b = v[:n_w].reshape(d_g, -1), v[n_w:]
    else:
        want = {"weight", "bias"} if bias else {"weight"}
        if not isinstance(entry, dict) or set(entry) != want:
            keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(f"{_FN}: {what} must be a dict with keys "
                             f"{sorted(want)} (the layer's parameters); got {keys}.")
        w = _as_float_array(entry["weight"], f"{what}['weight']")
        if w.shape != w_shape:
            raise _shape_error(f"{what}['weight']", w_shape, w.shape, " (the weight's)")
        w = w.reshape(d_g, -1)
        b = None
        if bias:
            b = _as_float_array(entry["bias"], f"{what}['bias']")
            if b.shape != (d_g,):
                raise _shape_error(f"{what}['bias']", (d_g,), b.shape, " (the bias's)")
    dtype = np.result_type(w.dtype, b.dtype) if b is not None and b.size else w.dtype
    mat = np.concatenate([w.astype(np.float64), b.astype(np.float64)[:, None]], axis=1) \
        if bias else w.astype(np.float64)
    return mat, dtype


def _user_outputs(out, layers, checked, flat, source):
    if not isinstance(out, dict):
        raise TypeError(f"{_FN}: {source} must be a dict of layer name -> "
                        f"{'flat vector' if flat else '{weight, bias}'}; got "
                        f"{type(out).__name__}.")
    unknown = sorted(str(k) for k in set(out) - set(layers))
    if unknown:
        raise ValueError(f"{_FN}: {source} must name supported layers of the model "
                         f"({', '.join(layers)}); got {', '.join(unknown)}.")
    return {name: _user_matrix(name, out[name], layers[name], flat, source)
            for name in checked if name in out}


def _user_factors(factors, layers, checked):
    """The user's ``{"A", "G"}`` per checked layer, validated (shape, finite, symmetric to
    the square root of their type's ε) and copied as float64 (symmetrised)."""
    if not isinstance(factors, dict):
        raise TypeError(f"{_FN}: factors must be a dict of layer name -> {{'A': ..., "
                        f"'G': ...}}; got {type(factors).__name__}.")
    unknown = sorted(str(k) for k in set(factors) - set(layers))
    if unknown:
        raise ValueError(f"{_FN}: factors must name supported layers of the model "
                         f"({', '.join(layers)}); got {', '.join(unknown)}.")
    missing = [n for n in checked if n not in factors]
    if missing:
        raise ValueError(f"{_FN}: factors must hold every checked layer (the "
                         f"preconditioner's own factors; leave factors=None for the "
                         f"reference's); missing {', '.join(missing)}.")
    out = {}
    for name in checked:
        entry = factors[name]
        if not isinstance(entry, dict) or set(entry) != {"A", "G"}:
            keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(f"{_FN}: factors[{name!r}] must be a dict with keys ['A', "
                             f"'G']; got {keys}.")
        d_g, d_a, _, _ = _layer_dims(layers[name])
        pair = {}
        for fac, d in (("A", d_a), ("G", d_g)):
            what = f"factors[{name!r}][{fac!r}]"
            x = _as_float_array(entry[fac], what)
            if x.shape != (d, d):
                raise _shape_error(what, (d, d), x.shape)
            if not np.all(np.isfinite(x)):
                raise ValueError(f"{_FN}: {what} must be finite; got "
                                 f"{int(np.sum(~np.isfinite(x)))} NaN/Inf entries.")
            x64 = x.astype(np.float64)
            scale = max(float(np.max(np.abs(x64))), np.finfo(np.float64).tiny)
            asym = float(np.max(np.abs(x64 - x64.T)))
            if asym > math.sqrt(np.finfo(x.dtype).eps) * scale:
                raise ValueError(f"{_FN}: {what} must be symmetric; got max|X − Xᵀ| = "
                                 f"{asym:.3g} for max|X| = {scale:.3g}.")
            pair[fac] = (x64 + x64.T) / 2.0
            pair[f"{fac}_dtype"] = x.dtype
        out[name] = pair
    return out


def _mean_loss(loss, out, targets):
    import torch

    if out.ndim != 2:
        raise ValueError(f"{_FN}: the model's output must be [N, C]; got shape "
                         f"{tuple(out.shape)}.")
    y = _np(targets)
    n, c = out.shape
    if loss == "cross_entropy":
        if y.shape != (n,) or not np.issubdtype(y.dtype, np.integer) or (
                y.size and (y.min() < 0 or y.max() >= c)):
            raise ValueError(f"{_FN}: targets must be [{n}] class indices in 0..{c - 1} for "
                             f"loss='cross_entropy'; got shape {y.shape}, dtype {y.dtype}.")
        y = torch.as_tensor(y, device=out.device).long()
        return torch.nn.functional.cross_entropy(out, y)  # mean over the batch
    if y.shape != (n, c):
        raise ValueError(f"{_FN}: targets must be [{n}, {c}] for loss='mse'; got shape "
                         f"{y.shape}.")
    y = torch.as_tensor(y, device=out.device).to(out.dtype)
    return 0.5 * ((out - y) ** 2).sum(dim=1).mean()  # mean of ½‖f_n − y_n‖²


def _abs_gradient(mod, x, g):
    """``Σ_{n,t} |g_{n,t}| |ā_{n,t}|ᵀ`` ``[d_G, d_A]``: the sum of absolute contributions to
    the layer's gradient (the bound of the rounding of the sum that forms it)."""
    import torch

    x, g = x.abs().to(torch.float64), g.abs().to(torch.float64)
    if isinstance(mod, torch.nn.Conv2d):
        (top, bottom), (left, right) = torch_conv_padding(mod)
        xp = torch.nn.functional.pad(x, (left, right, top, bottom))
        patches = torch.nn.functional.unfold(xp, mod.kernel_size, dilation=mod.dilation,
                                             stride=mod.stride)  # [N, C·kh·kw, T]
        g = g.reshape(g.shape[0], g.shape[1], -1)  # [N, O, T]
        bound = torch.einsum("not,nkt->ok", g, patches)
        cols = [bound, g.sum(dim=(0, 2))[:, None]] if mod.bias is not None else [bound]
    else:
        a2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        cols = [g2.T @ a2, g2.sum(dim=0)[:, None]] if mod.bias is not None else [g2.T @ a2]
    return torch.cat(cols, dim=1).cpu().numpy()


def _gradients(model, loss, inputs, targets, layers, checked):
    """Mean-loss gradients of the checked layers: ``({name: Γ [d_G, d_A] float64}, {name:
    {"weight", "bias"} torch tensors}, {name: |T|}, {name: c_Γ}, output shape [N, C],
    output dtype)`` with c_Γ = ‖Σ|g||ā|ᵀ‖_F / ‖Γ‖_F (≥ 1, the cancellation in the sum
    over N·|T| terms)."""
    import torch

    ins, outs, hooks = {}, {}, []
    for name in checked:
        def hook(m, args, output, name=name):
            if name in outs:
                raise ValueError(f"{_FN}: layer {name!r} is called more than once in the "
                                 "forward pass; check_torch_preconditioner takes layers "
                                 "called once.")
            ins[name], outs[name] = args[0].detach(), output
        hooks.append(layers[name].register_forward_hook(hook))
    try:
        out = model(inputs)
    finally:
        for h in hooks:
            h.remove()
    unused = [k for k in checked if k not in outs]
    if unused:
        raise ValueError(f"{_FN}: every checked layer must be called in the forward pass; "
                         f"not called: {', '.join(unused)} (leave it out with layers=).")
    total = _mean_loss(loss, out, targets)
    params = []
    for name in checked:
        mod = layers[name]
        params += [mod.weight] + ([mod.bias] if mod.bias is not None else [])
    grads = torch.autograd.grad(total, params + [outs[k] for k in checked])
    gp, go = list(grads[:len(params)]), grads[len(params):]
    mats, tensors, ts, cancel = {}, {}, {}, {}
    for name, g_out in zip(checked, go, strict=True):
        mod = layers[name]
        w = gp.pop(0)
        b = gp.pop(0) if mod.bias is not None else None
        d_g = w.shape[0]
        tensors[name] = {"weight": w.detach().clone()}
        cols = [_np(w, np.float64).reshape(d_g, -1)]
        if b is not None:
            tensors[name]["bias"] = b.detach().clone()
            cols.append(_np(b, np.float64)[:, None])
        mats[name] = np.concatenate(cols, axis=1)
        ts[name] = int(np.prod(g_out.shape[2:])) if isinstance(mod, torch.nn.Conv2d) \
            else int(np.prod(g_out.shape[1:-1]))
        norm = float(np.linalg.norm(mats[name]))
        bound = float(np.linalg.norm(_abs_gradient(mod, ins[name], g_out.detach())))
        cancel[name] = max(1.0, bound / norm) if norm > 0 else 1.0
    return mats, tensors, ts, cancel, tuple(out.shape), out.dtype


def _k_of_mode(loss, mode, out_shape, samples):
    """Vectors per example of ``mode``: C (the loss's Fisher factor columns), 1, or M."""
    if mode == "fisher_empirical":
        return 1
    if mode == "fisher_sampled":
        if samples is None:
            return 1  # rng: one draw per example
        return int(check_samples(_FN, loss, samples, out_shape).shape[0])
    return int(out_shape[1])


#: what a scalar pitfall means for a preconditioned gradient (P is linear in Γ, and a
#: constant on the whole damped block scales P by its inverse)
HINTS = {
    "scale:N": "the gradient of the summed loss where the mean loss's is expected",
    "scale:1/N": "the mean-loss gradient divided by N once more",
    "scale:T": "the block |T| times too small: TF's Γ = G/|T| (with λ/|T|) used without "
               "its block scale |T|",
    "scale:1/T": "the whole damped block |T| times too large (a block scale |T| on "
                 "factors that already hold it, damping included)",
    "scale:2": "twice the reference: a gradient doubled (a squared error without the ½)",
    "scale:1/2": "half the reference: a gradient halved",
}


def _describe(pitfall, explanation):
    from ..diagnosis import PITFALLS

    parts = []
    for p in pitfall.split("+"):
        if p in HINTS:
            parts.append(HINTS[p])
        elif p in PITFALLS and not p.startswith("scale") and p != "unexplained":
            parts.append(f"{PITFALLS[p][0]}: {PITFALLS[p][1]}")
    import re

    # the plain words replace the suite's "matches what the reference computes with the
    # pitfall 'x'"; what the diagnosis adds after it (a scale, a residual) stays
    rest = re.sub(r"^matches what the reference computes with the pitfall '[^']*'(, )?", "",
                  explanation)
    words = "; ".join(parts)
    if not words:
        return explanation
    return words + (f" ({rest})" if rest else "")


def check_torch_preconditioner(model, loss, inputs, targets, preconditioned, *, damping,
                               mode="fisher_exact", factors=None, damping_style="factored",
                               sharing="expand", rng=None, samples=None, layers=None,
                               flat=False, conventions=None) -> PreconditionerCheck:
    r"""Compare a user's K-FAC preconditioned gradient of ``model`` on one batch with the
    reference damped inverse product, per layer, and name the pitfall behind each
    disagreement.

    The reference (module docstring) applies, to the gradient :math:`\Gamma` ``[out,
    in(+1)]`` of the **mean** loss (``"cross_entropy"`` or ``"mse"``, ½‖f − y‖², as in
    :func:`check_torch_kfac`), the inverse of the K-FAC block :math:`A\otimes G` damped with
    ``damping`` λ > 0:

    .. math::

        P = (G + \tfrac{\sqrt\lambda}{\pi} I)^{-1}\,\Gamma\,(A + \pi\sqrt\lambda I)^{-1},
        \quad \pi = \sqrt{\tfrac{\operatorname{tr}A/\dim A}{\operatorname{tr}G/\dim G}}
        \qquad (\texttt{damping\_style="factored"}),

    or :math:`\mathrm{vec}_c(P) = (A\otimes G + \lambda I)^{-1}\mathrm{vec}_c(\Gamma)`
    (``"exact"``).  :math:`A, G` are ``factors`` (``{layer: {"A", "G"}}`` in the own-model
    layout: give the factors your preconditioner used, so that a factor bug does not mask
    a damping check) or, when ``factors`` is None, the reference factors of
    :func:`reference_torch_kfac` (``mode``, ``sharing``, ``rng``/``samples`` as there;
    KFAC-expand: the block is :math:`A\otimes G` with no extra |T|).

    ``preconditioned`` is either

    * a dict ``{layer: {"weight": ..., "bias": ...}}`` shaped like the parameters (torch
      tensors or arrays; ``"bias"`` exactly when the layer has one): your preconditioned
      mean-loss gradient for this batch, or
    * a callable taking ``{layer: {"weight", "bias"}}`` torch tensors (the mean-loss
      gradients, in the model's dtype) and returning that dict: your inverse product.

    With ``flat=True`` each layer's entry (given or passed) is the flat vector
    ``[weight.flatten(), bias]`` instead.  Every supported layer (``nn.Linear``,
    ``nn.Conv2d`` with ``groups=1``, each called once), or each of ``layers`` when given,
    must be present: a missing one is reported and fails.  Other layer kinds (attention,
    normalisation, embeddings, other convolutions) are not checked by this function.
    The user's tensors are copied to NumPy before anything runs; a
    callable is called once, after the one forward and backward pass that forms the
    gradients and before the reference's passes (whose forward passes fire any hooks the
    model carries: give a callable that does not update its statistics, or its factors).
    Every pass must compute the same function of the batch: no dropout (``model.eval()``
    or ``p=0``).

    **Tolerance.**  Per layer,
    :math:`\|P_\text{user} - P\|_F / \|P\|_F \le \text{rtol}` with

    .. math::

        \text{rtol} = 16\,\varepsilon\,\big[\kappa_F\,(N|T|K + d_A + d_G)
                      + \kappa_B\,N|T|\,c_\Gamma\big],

    :math:`\kappa_F = \kappa(A_\lambda) + \kappa(G_\lambda)`, :math:`\kappa_B =
    \kappa(A_\lambda)\kappa(G_\lambda)` for factored damping (:math:`A_\lambda = A +
    \pi\sqrt\lambda I`, :math:`G_\lambda = G + \tfrac{\sqrt\lambda}\pi I`),
    :math:`\kappa_F = \kappa_B = \kappa(A\otimes G + \lambda I)` for exact damping
    (:func:`damped_condition`); :math:`\varepsilon` is the machine epsilon of the coarsest
    of the model's, the user's output's and the user's factors' floating types, and
    :math:`K` the vectors per example of ``mode``.  Derivation, to first order:

    * a perturbation :math:`\Delta A` of :math:`A_\lambda` changes
      :math:`P = G_\lambda^{-1}\Gamma A_\lambda^{-1}` by :math:`-P\,\Delta A\,
      A_\lambda^{-1}`, so :math:`\|\Delta P\|_F/\|P\|_F \le \kappa(A_\lambda)\,
      \|\Delta A\|_2/\|A_\lambda\|_2`; the same for :math:`G_\lambda`.  Under exact
      damping :math:`M = A\otimes G + \lambda I` moves by :math:`\|\Delta A\otimes G +
      A\otimes\Delta G\| \le (\delta_A + \delta_G)\|M\|`, and the bound of a linear
      system (Higham, *Accuracy and Stability of Numerical Algorithms*, Thm. 7.2) gives
      :math:`\kappa(M)(\delta_A + \delta_G)`;
    * the factors' relative errors: each is a sum of :math:`N|T|K` outer products,
      :math:`\delta \le (N|T|K + d)\,\varepsilon` as in ``check_factors``; the trace
      ratio π (relative :math:`(d_A + d_G)\varepsilon`) perturbs the damped factors by no
      more, and a backward-stable solve (Cholesky or ``eigh``) adds a backward error of
      :math:`O(d\,\varepsilon)` — together the :math:`\kappa_F` term;
    * a perturbation :math:`\Delta\Gamma` changes :math:`P` by
      :math:`G_\lambda^{-1}\Delta\Gamma A_\lambda^{-1}`, and :math:`\|\Gamma\|_F \le
      \|G_\lambda\|_2\|A_\lambda\|_2\|P\|_F`, so relative errors of :math:`\Gamma` grow by
      at most :math:`\kappa_B` (:math:`\kappa(M)` under exact damping).  The gradient is a
      sum of :math:`N|T|` terms :math:`g_{n,t}\bar a_{n,t}^\top`, whose rounding is at
      most :math:`N|T|\,\varepsilon\sum|g_{n,t}||\bar a_{n,t}|^\top`:
      :math:`\delta_\Gamma \le N|T|\,\varepsilon\,c_\Gamma`,
      :math:`c_\Gamma = \|\sum_{n,t}|g_{n,t}||\bar a_{n,t}|^\top\|_F/\|\Gamma\|_F \ge 1`
      (computed here; large when the batch gradient cancels).  A callable is handed the
      check's own gradient, so that term is dropped for it.

    The constant 16 (the suite's ``SAFETY``) covers the constants of the GEMMs,
    factorisations and norm equivalences.  :math:`\kappa_B` is printed per layer: choose
    λ so that the damped factors are well conditioned, or the check cannot tell the damping
    conventions apart.

    **Diagnosis** of a disagreement (:func:`conformance.diagnosis.diagnose`, up to three
    pitfalls composed): the alternatives of :func:`preconditioner_alternatives` (the other
    damping style, π = 1, π without dimensions, π², unsplit λ, λ per factor, λ·|T| and
    λ/|T| on a layer with |T| > 1, no damping, the Kronecker order swapped), each also
    times the scalar pitfalls of N, N², |T| and 2 (e.g. the sum-loss gradient: ``scale:N``).

    ``conventions={"damping_per_factor": "lambda"}`` declares that ``damping`` is each
    factor's (:math:`(A + \pi\lambda I)\otimes(G + \lambda/\pi I)`, the reference with
    the block damping :math:`\lambda^2`); the factors' own conventions are
    :func:`check_torch_kfac`'s.

    Returns a :class:`PreconditionerCheck` (printable per-layer table, ``.ok``).
    """
    import torch

    from ..compare import compare
    from ..diagnosis import diagnose
    from ..model import SAFETY, Capability, Case, Tolerance

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_FN}: model must be a torch.nn.Module; got {type(model).__name__}.")
    check_mode_args(_FN, loss, mode, sharing, rng, samples)
    _check_damping(damping, damping_style, flat)
    lam = _block_damping(float(damping), damping_style, conventions)
    if not (callable(preconditioned) or isinstance(preconditioned, dict)):
        raise TypeError(f"{_FN}: preconditioned must be a dict of layer name -> "
                        f"{{'weight', 'bias'}} or a callable returning one; got "
                        f"{type(preconditioned).__name__}.")
    supported = _layers(model)
    if layers is None:
        checked = list(supported)
    else:
        if isinstance(layers, str) or not all(isinstance(n, str) for n in layers):
            raise TypeError(f"{_FN}: layers must be a list of layer names; got "
                            f"{layers!r:.80}.")
        checked = list(dict.fromkeys(layers))
        unknown = [n for n in checked if n not in supported]
        if unknown or not checked:
            raise ValueError(f"{_FN}: layers must name supported layers of the model "
                             f"({', '.join(supported)}); got "
                             f"{', '.join(unknown) if unknown else 'none'}.")
    # the user's numbers are copied before any forward pass runs
    mine = None if factors is None else _user_factors(factors, supported, checked)
    given = None
    if isinstance(preconditioned, dict):
        given = _user_outputs(preconditioned, supported, checked, flat, "preconditioned")
    mats, tensors, ts, cancel, out_shape, out_dtype = _gradients(model, loss, inputs, targets,
                                                         supported, checked)
    if given is None:
        feed = tensors
        if flat:
            feed = {k: torch.cat([v["weight"].reshape(-1)]
                                 + ([v["bias"]] if "bias" in v else [])) for k, v in
                    tensors.items()}
        given = _user_outputs(preconditioned(feed), supported, checked, flat,
                              "preconditioned(gradients)")
    if mine is None:
        ref = reference_torch_kfac(model, loss, inputs, targets, mode=mode, sharing=sharing,
                                   rng=rng, samples=samples, _fn=_FN)
        fac = {k: {"A": ref[k]["A"], "G": ref[k]["G"], "A_dtype": np.float64,
                   "G_dtype": np.float64} for k in checked}
        k_vec = ref[checked[0]]["K"]
    else:
        fac = mine
        k_vec = _k_of_mode(loss, mode, out_shape, samples)
    cap = Capability("own_model.preconditioner",
                     "a K-FAC preconditioned gradient of the user's model", "")
    result = PreconditionerCheck(mode, lam, damping_style,
                                 "reference" if mine is None else "your")
    for name in checked:
        if name not in given:
            result.missing.append(name)
            continue
        act, dtype = given[name]
        a, g, grad = fac[name]["A"], fac[name]["G"], mats[name]
        from kfac_ref import KFACValueError

        try:
            expected = preconditioner_reference(a, g, grad, lam, damping_style)
        except KFACValueError as e:
            raise ValueError(f"{_FN}: the damped block of layer {name!r} is numerically "
                             f"singular with damping {lam:g} ({e}); give a larger damping "
                             "or positive semi-definite factors.") from e
        k_fac, k_block = damped_condition(a, g, lam, damping_style)
        eps = max(float(torch.finfo(out_dtype).eps), float(np.finfo(dtype).eps),
                  float(np.finfo(fac[name]["A_dtype"]).eps),
                  float(np.finfo(fac[name]["G_dtype"]).eps))
        t, n = ts[name], out_shape[0]
        d_g, d_a = grad.shape
        factor_work = n * t * k_vec + d_a + d_g
        grad_work = 0.0 if callable(preconditioned) else n * t * cancel[name]
        budget = k_fac * factor_work + k_block * grad_work
        tol = Tolerance(SAFETY * budget,
                        f"κ_F = {k_fac:.3g} × (N|T|K + d_A + d_G = {factor_work}) + κ_B = "
                        f"{k_block:.3g} × N|T|·c_Γ = {grad_work:.4g}: the damped inverse "
                        "of factors that are sums of N|T|K outer products, applied to a "
                        "sum of N|T| gradient terms")
        rtol = tol.rtol(eps)
        alts = preconditioner_alternatives(a, g, grad, lam, damping_style, t)
        alts = {k: v for k, v in alts.items() if compare(v, expected, rtol).rel_err > rtol}
        meta = {"N": n, "T": t}
        case = Case(f"{name}.P", cap.name, {}, {}, expected, tol, meta=meta,
                    alternatives=alts)
        c = compare(act, expected, rtol)
        check = PreconditionerLayerCheck(name, (d_g, d_a), c.ok, c.rel_err, rtol, k_block)
        if not c.ok:
            d = diagnose(act, case, cap, None, rtol)
            check.diagnosis = d.pitfall
            check.explanation = _describe(d.pitfall, d.explanation)
        result.checks.append(check)
    return result
