r"""Reference K-FAC factors for your own PyTorch model, and a per-layer diagnosis of yours.

.. code-block:: python

    from conformance.own_model import check_torch_kfac

    result = check_torch_kfac(model, "cross_entropy", x, y, my_factors,
                              mode="fisher_exact")
    print(result)               # one line per layer and factor, with the diagnosis
    assert result.ok

``my_factors`` maps a module name of ``model.named_modules()`` to ``{"A": ..., "G": ...}``
(torch tensors or arrays) in the model's own layout, the bias's homogeneous coordinate
**last** in ``A`` when the layer has a bias:

* ``nn.Linear`` (weight ``[out, in]``): ``A`` is ``[in(+1), in(+1)]`` over the layer input,
  ``G`` is ``[out, out]``;
* ``nn.Conv2d`` (kernel OIHW, ``groups=1``, zero padding): ``A`` is ``[C·kh·kw(+1), …]``
  over the patch vectors in ``torch.nn.functional.unfold``'s order (channel slowest: index
  ``c·kh·kw + i·kw + j``, the order of ``weight.reshape(out, -1)``), ``G`` is
  ``[out, out]`` over the output channels.

The reference (Martens & Grosse 2015; for convolutions Grosse & Martens 2016 in the
KFAC-expand normalisation of Eschenhagen et al. 2023) is

.. math::

    A = \frac{1}{N|T|}\sum_{n=1}^{N}\sum_{t\in T} \bar a_{n,t} \bar a_{n,t}^\top, \qquad
    G = \frac{1}{N}\sum_{n=1}^{N}\sum_{t\in T}\sum_{k} g_{n,t,k}\, g_{n,t,k}^\top,
    \qquad F \approx A \otimes G ,

where :math:`t` runs over the :math:`|T|` output locations of a convolution (the patch
:math:`\bar a_{n,t} = [p_{n,t}, 1]` read by location :math:`t`, zero padding included) or
the shared positions of a ``nn.Linear`` applied to ``[N, S, d]`` (:math:`|T| = S`), and
:math:`|T| = 1` for a plain ``nn.Linear`` on ``[N, d]``.  :math:`g_{n,t,k}` are the
back-propagated output vectors of the per-example loss :math:`\ell_n` at location
:math:`t`:

* ``mode="fisher_exact"``: column :math:`k` of the loss's Fisher factor :math:`B_n`
  (:math:`B_n B_n^\top = F_n`, from :mod:`kfac_ref.losses`) — the true Fisher, which is
  the GGN for these losses;
* ``"fisher_empirical"``: the gradient at the data target (one vector);
* ``"fisher_sampled"``: :math:`M^{-1/2}\nabla_f \ell_n(\tilde y_{n,m})` for :math:`M`
  targets :math:`\tilde y_{n,m}` drawn from the model's predictive distribution (an
  explicit seed or :class:`numpy.random.Generator`, or the caller's draws; see
  :func:`sample_targets`), so :math:`G` is the Monte Carlo Fisher of exactly those draws.

This is curvlinops' KFAC-expand convention (``KFACLinearOperator``, ``kfac_approx="expand"``).
TF K-FAC's ``ConvKFCBasicFB`` (and kfac-jax) normalise *both* factors by :math:`N|T|`,
:math:`\Gamma = G/|T|` with :math:`F \approx |T|\,(A \otimes \Gamma)`: the same block, and
a ``G`` that this check reports as ``scale:1/T`` with that explanation.  BackPACK's
``A = Σ/N`` (:math:`|T|\cdot A`) reads as ``scale:T``.  With ``sharing="reduce"``
(KFAC-reduce): :math:`A = \frac1N\sum_n \bar{\bar a}_n \bar{\bar a}_n^\top` over the mean
input over :math:`T` and :math:`G = \frac1N\sum_{n,k} (\sum_t g_{n,t,k})(\sum_t g_{n,t,k})^\top`.

The statistics are computed by kfac_ref (:func:`kfac_ref.factors.fully_connected_kronecker_factor`,
:func:`kfac_ref.factors.conv_input_kronecker_factor` / ``conv_output_kronecker_factor`` in
their NHWC/HWIO patch order, then permuted into unfold's) from layer inputs and output
gradients captured with hooks.  The loss is ``"cross_entropy"`` (logits ``[N, C]``, integer
targets) or ``"mse"`` (:math:`\ell_n = \tfrac12\|f_n - y_n\|^2`); the model's output is
``[N, C]``.  torch is imported inside the functions: the suite does not depend on it.  The
JAX version is :mod:`conformance.own_model_jax`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import numpy as np

__all__ = ["reference_torch_kfac", "check_torch_kfac", "sample_targets", "output_vectors",
           "check_factors", "layer_alternatives", "torch_conv_padding",
           "conv_reference_factors", "dense_reference_factors", "check_mode_args", "as_rng",
           "check_samples", "model_output_vectors",
           "LayerCheck", "ModelCheck", "MODES", "LOSSES", "SHARING", "HINTS"]

MODES = ("fisher_exact", "fisher_empirical", "fisher_sampled")
LOSSES = ("cross_entropy", "mse")
SHARING = ("expand", "reduce")

#: what a named pitfall means for a hand-written K-FAC (appended to the diagnosis)
HINTS = {
    "patch_order": "patch vector ordered (kh, kw, C_in) with C_in fastest (TF/JAX HWC) "
                   "instead of unfold's (C_in, kh, kw) with the channel slowest",
    "bias_position": "the bias's homogeneous coordinate first instead of last",
    "scale:1/N^2": "gradients of the mean-reduced loss used as per-example gradients "
                   "(multiply them by N)",
    "scale:1/T": "normalised by N·|T| instead of N: TF ConvKFCBasicFB's Γ = G/|T| "
                 "(F = |T|·(A⊗Γ)), or the |T| factor of KFAC-expand missing",
    "scale:T": "normalised by N instead of N·|T| (BackPACK's Σ/N), or an extra |T|",
    "empirical_fisher": "the empirical Fisher (gradient at the data label) where the "
                        "Fisher of the model's own predictive distribution is asked",
    "true_fisher": "the exact (true) Fisher where another estimate is asked",
}


def _is_tensor(x):
    return hasattr(x, "detach") and hasattr(x, "cpu")


def _np(x, dtype=None):
    x = x.detach().cpu().numpy() if _is_tensor(x) else np.asarray(x)
    return x.astype(dtype) if dtype is not None else x


def _loss_object(loss, out, targets):
    from kfac_ref import losses

    if loss == "cross_entropy":
        return losses.CategoricalLogitsNegativeLogProbLoss(out, targets=targets)
    return losses.NormalMeanNegativeLogProbLoss(out, targets=targets, variance=1.0)


def _check_loss(fn, loss):
    if loss not in LOSSES:
        raise ValueError(f"{fn}: loss must be one of {LOSSES}; got {loss!r}.")


def as_rng(fn, rng):
    """``rng`` as a :class:`numpy.random.Generator` (an int seed is ``default_rng(seed)``)."""
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, numbers.Integral) and not isinstance(rng, bool) and rng >= 0:
        return np.random.default_rng(int(rng))
    raise TypeError(f"{fn}: rng must be a non-negative int seed or a numpy.random.Generator; "
                    f"got {rng!r:.60}.")


def sample_targets(loss, outputs, rng, mc_samples=1):
    r"""``[M, N]`` class indices (``"cross_entropy"``) or ``[M, N, C]`` targets (``"mse"``)
    drawn from the model's predictive distribution at ``outputs`` ``[N, C]``:

    .. math::

        \tilde y_{n,m} \sim \mathrm{softmax}(f_n) \quad\text{or}\quad
        \tilde y_{n,m} \sim \mathcal N(f_n, I), \qquad m = 1, \dots, M,

    from the explicit generator ``rng`` (an int seed or :class:`numpy.random.Generator`;
    Gumbel-max and standard normal draws of :mod:`kfac_ref.losses`, in float64 on the
    host).  Feed the same draws to your own MC-Fisher K-FAC and to
    ``check_torch_kfac(..., mode="fisher_sampled", samples=...)`` to compare them exactly.
    """
    fn = "sample_targets"
    _check_loss(fn, loss)
    gen = as_rng(fn, rng)
    if (not isinstance(mc_samples, numbers.Integral) or isinstance(mc_samples, bool)
            or mc_samples < 1):
        raise ValueError(f"{fn}: mc_samples must be a positive int; got {mc_samples!r}.")
    out = _np(outputs, np.float64)
    if out.ndim != 2:
        raise ValueError(f"{fn}: outputs must be [N, C]; got shape {out.shape}.")
    lo = _loss_object(loss, out, None)
    return np.stack([np.asarray(lo.sample(gen)) for _ in range(int(mc_samples))])


def check_samples(fn, loss, samples, out_shape):
    """The user's draws as ``[M, N]`` class indices or ``[M, N, C]`` float64 targets."""
    s = _np(samples)
    n, c = out_shape
    if loss == "cross_entropy":
        s = s[None] if s.ndim == 1 else s
        ok = s.ndim == 2 and s.shape[1] == n and np.issubdtype(s.dtype, np.integer) and (
            s.size == 0 or (s.min() >= 0 and s.max() < c))
        want = f"[M, {n}] (or [{n}]) class indices in 0..{c - 1}"
    else:
        s = s[None] if s.ndim == 2 else s
        ok = s.ndim == 3 and s.shape[1:] == (n, c) and np.issubdtype(s.dtype, np.floating)
        want = f"[M, {n}, {c}] (or [{n}, {c}]) real targets"
    if not ok or s.shape[0] < 1:
        raise ValueError(f"{fn}: samples must be {want}; got shape {s.shape}, dtype "
                         f"{s.dtype}.")
    return s if loss == "cross_entropy" else s.astype(np.float64)


def output_vectors(loss, outputs, targets, mode, *, samples=None):
    r"""``[K, N, C]`` output-space vectors whose back-propagation gives the :math:`g`'s of
    ``mode``: the :math:`K = C` columns of the Fisher factor :math:`B_n` (``fisher_exact``),
    the per-example gradient :math:`\nabla_f \ell_n(y_n)` (``fisher_empirical``, no 1/N),
    or :math:`M^{-1/2}\nabla_f \ell_n(\tilde y_{n,m})` for the ``[M, ...]`` ``samples``
    (``fisher_sampled``), so that :math:`\sum_k v_{n,k} v_{n,k}^\top` is the per-example
    curvature estimate of the mode.  ``outputs`` is a float64 ``[N, C]`` array."""
    lo = _loss_object(loss, outputs, targets)
    if mode == "fisher_empirical":
        return np.asarray(lo.grad_of_evaluate()[0])[None]  # per example: no 1/N
    if mode == "fisher_sampled":
        m = samples.shape[0]
        return np.stack([np.asarray(_loss_object(loss, outputs, s).grad_of_evaluate()[0])
                         for s in samples]) / np.sqrt(m)
    k = lo.fisher_factor_inner_shape[-1]
    cols = []
    for j in range(k):  # K = C output-space directions, not a loop over examples
        e = np.zeros(lo.fisher_factor_inner_shape)
        e[:, j] = 1.0
        cols.append(np.asarray(lo.multiply_fisher_factor(e)[0]))
    return np.stack(cols)


def model_output_vectors(fn, loss, out_np, targets, mode, *, samples=None, rng=None,
                         mc_samples=1):
    r"""The :func:`output_vectors` of a model's float64 outputs ``out_np`` (``[N, C]``,
    checked here), with the targets as the loss takes them and, for ``fisher_sampled``, the
    given ``samples`` or targets drawn from ``rng`` (:func:`sample_targets`): the one
    preamble of the torch and JAX reference factors.

    .. math:: v_{n,k} \text{ with } \textstyle\sum_k v_{n,k} v_{n,k}^\top
              \text{ the per-example curvature estimate of the mode}
    """
    if out_np.ndim != 2:
        raise ValueError(f"{fn}: the model's output must be [N, C]; got shape "
                         f"{out_np.shape}.")
    y = _np(targets)
    if loss == "mse":
        y = y.astype(np.float64)
    if mode == "fisher_sampled":
        if samples is None:
            samples = sample_targets(loss, out_np, as_rng(fn, rng), mc_samples)
        samples = check_samples(fn, loss, samples, out_np.shape)
    return output_vectors(loss, out_np, y, mode, samples=samples)


def check_mode_args(fn, loss, mode, sharing, rng, samples):
    """Validate ``loss``, ``mode``, ``sharing`` and the sampling arguments of ``fn``: for
    ``mode="fisher_sampled"`` exactly one of ``rng`` (seed or Generator) and ``samples``,
    otherwise neither."""
    _check_loss(fn, loss)
    if mode not in MODES:
        raise ValueError(f"{fn}: mode must be one of {MODES}; got {mode!r}.")
    if sharing not in SHARING:
        raise ValueError(f"{fn}: sharing must be one of {SHARING}; got {sharing!r}.")
    if mode == "fisher_sampled":
        if (rng is None) == (samples is None):
            raise ValueError(f"{fn}: mode='fisher_sampled' needs exactly one of rng (a seed "
                             f"or numpy.random.Generator) and samples (the draws); got "
                             f"{'both' if rng is not None else 'neither'}.")
        if rng is not None:
            as_rng(fn, rng)
    elif rng is not None or samples is not None:
        raise ValueError(f"{fn}: rng and samples are used only with mode='fisher_sampled'; "
                         f"got mode={mode!r}.")


def _check_args(fn, model, loss, mode, sharing, rng, samples):
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module; got {type(model).__name__}.")
    check_mode_args(fn, loss, mode, sharing, rng, samples)


def torch_conv_padding(module, name=None):
    """``((top, bottom), (left, right))`` zero padding of an ``nn.Conv2d``, with PyTorch's
    split of ``padding='same'``: total :math:`d(k-1)` per axis, ``total // 2`` before and
    the rest (one more, when the total is odd) after; ``'valid'`` is no padding.
    Raises ``ValueError`` naming the module for ``groups != 1`` or a padding mode other
    than ``'zeros'`` (``name``: the module's name in the model, for the message)."""
    name = type(module).__name__ if name is None else name
    if module.groups != 1:
        raise ValueError(f"own-model check: nn.Conv2d {name!r} must have groups=1; got "
                         f"groups={module.groups}.")
    if module.padding_mode != "zeros":
        raise ValueError(f"own-model check: nn.Conv2d {name!r} must have padding_mode="
                         f"'zeros'; got {module.padding_mode!r}.")
    pad = module.padding
    if pad == "valid":
        return ((0, 0), (0, 0))
    if pad == "same":
        out = []
        for k, d in zip(module.kernel_size, module.dilation, strict=True):
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))
        return tuple(out)
    return tuple((int(p), int(p)) for p in pad)


def _hwc_to_chw(c_in, kh, kw, bias):
    """Index map: entry ``c·kh·kw + i·kw + j`` (unfold) <- ``(i·kw + j)·C + c`` (kfac_ref)."""
    perm = np.arange(kh * kw * c_in).reshape(kh, kw, c_in).transpose(2, 0, 1).ravel()
    return np.r_[perm, kh * kw * c_in] if bias else perm


def conv_reference_factors(x, g, *, kernel, padding, strides, dilation, bias,
                           sharing="expand", data_format="NCHW", order="chw"):
    r"""Reference ``(A, G, |T|)`` of one 2-D convolution from its input and the
    back-propagated output vectors, by kfac_ref's conv factor functions.

    ``x``: ``[N, C, H, W]`` (``data_format="NCHW"``) or ``[N, H, W, C]`` (``"NHWC"``);
    ``g``: ``[K, N, O, H', W']`` or ``[K, N, H', W', O]``; ``padding``: ``"SAME"``,
    ``"VALID"`` or ``((top, bottom), (left, right))``.  KFAC-expand:
    :math:`A = \Omega` of :func:`kfac_ref.factors.conv_input_kronecker_factor`
    (:math:`\sum/(N|T|)`), :math:`G = K|T|\,\Gamma` with :math:`\Gamma` of
    :func:`kfac_ref.factors.conv_output_kronecker_factor` over the :math:`KN` rows
    (:math:`\sum/(KN|T|)`), i.e. :math:`G = rac1N\sum_{n,t,k} g g^	op`; KFAC-reduce: the
    mean patch and the summed vectors per example.  ``order="chw"`` permutes ``A`` from
    kfac_ref's ``(kh, kw, C)`` into unfold's ``(C, kh, kw)`` patch order (bias last in
    both); ``"hwc"`` keeps it."""
    from kfac_ref.factors import (
        conv_input_kronecker_factor,
        conv_output_kronecker_factor,
        conv_patch_matrix,
    )
    from kfac_ref.factors import fully_connected_kronecker_factor as fc

    channels_last = data_format == "NHWC"
    c_in = x.shape[-1] if channels_last else x.shape[1]
    o = g.shape[-1] if channels_last else g.shape[2]
    kh, kw = kernel
    n, k = x.shape[0], g.shape[0]
    t = g.shape[2] * g.shape[3] if channels_last else g.shape[3] * g.shape[4]
    geo = dict(filter_shape=(kh, kw, c_in, o), padding=padding, strides=tuple(strides),
               dilation_rate=tuple(dilation), data_format=data_format)
    perm = _hwc_to_chw(c_in, kh, kw, bias) if order == "chw" else slice(None)
    if sharing == "expand":
        a = np.asarray(conv_input_kronecker_factor(x, has_bias=bias, **geo))  # Σ/(N|T|)
        gam = np.asarray(conv_output_kronecker_factor(
            g.reshape(k * n, *g.shape[2:]), data_format=data_format))  # Σ/(K·N·|T|)
        return a[perm][:, perm], gam * (k * t), t
    p = np.asarray(conv_patch_matrix(x, **geo)).reshape(n, t, -1).mean(axis=1)
    a = np.asarray(fc(p, has_bias=bias))
    gs = g.sum(axis=(2, 3) if channels_last else (3, 4)).reshape(k * n, o)
    return a[perm][:, perm], np.asarray(fc(gs)) * k, t


def dense_reference_factors(a, g, *, bias, sharing="expand"):
    r"""Reference ``(A, G, |T|)`` of one dense layer: ``a`` ``[N, (S,) d_in]``, ``g``
    ``[K, N, (S,) d_out]``; :math:`A = rac{1}{NS}\sum_{n,s}ar aar a^	op`,
    :math:`G = rac1N\sum_{n,s,k} g g^	op` by
    :func:`kfac_ref.factors.fully_connected_kronecker_factor` (KFAC-expand; with
    ``sharing="reduce"`` the mean input and the summed vectors over S)."""
    from kfac_ref.factors import fully_connected_kronecker_factor as fc

    n = a.shape[0]
    t = a.shape[1] if a.ndim == 3 else 1
    if a.ndim == 3 and sharing == "reduce":
        a, g = a.mean(axis=1), g.sum(axis=2)
    a2 = a.reshape(-1, a.shape[-1])
    g2 = g.reshape(-1, g.shape[-1])
    # fc divides by the number of rows: K·N·S for G, N·S for A (expand), N (reduce)
    return np.asarray(fc(a2, has_bias=bias)), np.asarray(fc(g2)) * (g2.shape[0] / n), t


def _supported_layers(fn, model):
    import torch

    layers = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d):
            torch_conv_padding(m, name)  # refuses groups > 1 and other padding modes
            layers[name] = m
        elif isinstance(m, torch.nn.Linear):
            layers[name] = m
    if not layers:
        raise ValueError(f"{fn}: model must contain an nn.Linear or nn.Conv2d layer; got "
                         "none.")
    return layers


def reference_torch_kfac(model, loss, inputs, targets, *, mode="fisher_exact",
                         sharing="expand", rng=None, samples=None, mc_samples=1,
                         _fn="reference_torch_kfac"):
    r"""Reference K-FAC factors of every ``nn.Linear`` and ``nn.Conv2d`` of ``model``, in
    its own layout (module docstring: unfold patch order, bias coordinate last).

    .. math::

        A = \frac{1}{N|T|}\sum_{n,t} \bar a_{n,t} \bar a_{n,t}^\top, \qquad
        G = \frac{1}{N}\sum_{n,t,k} g_{n,t,k} g_{n,t,k}^\top

    ``mode="fisher_sampled"`` takes ``rng`` (seed or Generator, with ``mc_samples`` draws
    per example, see :func:`sample_targets`) or ``samples`` (the draws themselves).
    Returns ``{module name: {"A", "G", "N", "T", "K", "kind"}}`` in float64 (``T`` = number
    of output locations or shared positions, ``K`` = vectors per example, ``kind`` =
    ``"dense"`` or ``"conv2d"``; conv layers also carry ``"kernel"`` and ``"c_in"``).
    """
    import torch

    _check_args(_fn, model, loss, mode, sharing, rng, samples)
    layers = _supported_layers(_fn, model)
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
    out_np = _np(out, np.float64)
    vecs = model_output_vectors(_fn, loss, out_np, targets, mode, samples=samples, rng=rng,
                                mc_samples=mc_samples)
    n = out_np.shape[0]
    g_rows = {name: [] for name in layers}
    for v in vecs:
        gv = torch.as_tensor(v, dtype=out.dtype, device=out.device)
        grads = torch.autograd.grad(out, [outs[k] for k in layers], grad_outputs=gv,
                                    retain_graph=True)
        for name, g in zip(layers, grads, strict=True):
            g_rows[name].append(_np(g, np.float64))
    res = {}
    for name, mod in layers.items():
        a, g = ins[name].cpu().numpy(), np.stack(g_rows[name])
        if isinstance(mod, torch.nn.Conv2d):
            if a.ndim != 4:
                raise ValueError(f"{_fn}: the input of nn.Conv2d {name!r} must be "
                                 f"[N, C, H, W]; got shape {a.shape}.")
            fa, fg, t = conv_reference_factors(
                a, g, kernel=mod.kernel_size, padding=torch_conv_padding(mod),
                strides=mod.stride, dilation=mod.dilation, bias=mod.bias is not None,
                sharing=sharing)
            res[name] = {"A": fa, "G": fg, "N": n, "T": t, "K": g.shape[0], "kind": "conv2d",
                         "kernel": list(mod.kernel_size), "c_in": mod.in_channels,
                         "order": "chw"}
        else:
            fa, fg, t = dense_reference_factors(a, g, bias=mod.bias is not None,
                                                sharing=sharing)
            res[name] = {"A": fa, "G": fg, "N": n, "T": t, "K": g.shape[0], "kind": "dense"}
        res[name]["bias"] = mod.bias is not None
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


def layer_alternatives(name, ref, others, mode, sharing):
    """What each pitfall would give for layer ``name``: ``{"A": {pitfall: array}, "G": ...}``.

    ``ref`` is the layer's reference entry, ``others`` maps ``"empirical_fisher"``,
    ``"true_fisher"`` and ``"sharing"`` to whole-model references computed the other way
    (any may be missing).  A conv layer adds the kfac_ref (HWC) patch order, alone and with
    the bias first."""
    alts = {"A": {}, "G": {}}
    a = ref["A"]
    bias = ref.get("bias", True)
    if bias and a.shape[0] > 1:
        perm = np.r_[a.shape[0] - 1, 0:a.shape[0] - 1]  # homogeneous coordinate first
        alts["A"]["bias_position"] = a[np.ix_(perm, perm)]
    if ref.get("kind") == "conv2d":
        kh, kw = ref["kernel"]
        chw = _hwc_to_chw(ref["c_in"], kh, kw, bias)  # chw entry <- hwc index
        idx = chw if ref.get("order", "chw") == "hwc" else np.argsort(chw)
        other = a[np.ix_(idx, idx)]  # A in the other patch order
        if not np.allclose(other, a, rtol=1e-12, atol=0):
            alts["A"]["patch_order"] = other
            if bias:
                p = np.r_[a.shape[0] - 1, 0:a.shape[0] - 1]
                alts["A"]["patch_order+bias_position"] = other[np.ix_(p, p)]
    for key in ("empirical_fisher", "true_fisher"):
        if key in others:
            alts["G"][key] = others[key][name]["G"]
    other_sh = others.get("sharing")
    if other_sh is not None and ref["T"] > 1:
        key = f"{'reduce' if sharing == 'expand' else 'expand'}_instead_of_{sharing}"
        alts["A"][key] = other_sh[name]["A"]
        alts["G"][key] = other_sh[name]["G"]
    return alts


def _hint(pitfall):
    parts = [HINTS[p] for p in pitfall.split("+") if p in HINTS]
    return f" [{'; '.join(parts)}]" if parts else ""


def check_factors(ref, factors, alternatives, mode, fn="check_factors") -> ModelCheck:
    r"""Compare ``factors`` (``{layer: {"A": ..., "G": ...}}``) with the reference ``ref``
    (as :func:`reference_torch_kfac` returns) per layer and factor,

    .. math::

        \frac{\|X_\text{user} - X\|_F}{\|X\|_F} \le \text{rtol}
        = 16\,(N|T|K + d)\,\varepsilon ,

    (:math:`K = 1` for ``A``, :math:`d` the factor's size, :math:`\varepsilon` the unit
    roundoff of the user's floating type) and diagnose each disagreement with
    :func:`conformance.diagnosis.diagnose` against ``alternatives`` (as
    :func:`layer_alternatives` returns, per layer) and the scalar pitfalls of N and |T|."""
    from .compare import compare
    from .diagnosis import diagnose
    from .model import EPS32, EPS64, SAFETY, Capability, Case, Tolerance

    if not isinstance(factors, dict) or not factors:
        raise ValueError(f"{fn}: factors must be a non-empty dict of layer name -> "
                         f"{{'A': ..., 'G': ...}}; got {factors!r:.80}.")
    unknown = sorted(set(factors) - set(ref))
    if unknown:
        raise ValueError(f"{fn}: factors must name supported layers of the model "
                         f"({', '.join(ref)}); got {', '.join(map(str, unknown))}.")
    cap = Capability("own_model.factor", "a K-FAC factor of the user's model", "")
    result = ModelCheck(mode)
    for name, user in factors.items():
        if not isinstance(user, dict) or not set(user) <= {"A", "G"}:
            raise ValueError(f"{fn}: factors[{name!r}] must be a dict with keys 'A' and/or "
                             f"'G'; got {user!r:.80}.")
        r = ref[name]
        meta = {"N": r["N"], "T": r["T"]}
        if r.get("kind") == "conv2d":
            meta.update(kernel=r["kernel"], c_in=r["c_in"])
        for fac in ("A", "G"):
            if fac not in user:
                continue
            x = _np(user[fac])
            exp = r[fac]
            if x.shape != exp.shape:
                raise ValueError(f"{fn}: factors[{name!r}][{fac!r}] must have shape "
                                 f"{exp.shape} (the model's layout); got {x.shape}.")
            eps = EPS32 if x.dtype in (np.float32, np.float16) else EPS64
            rows = r["N"] * r["T"] * (r["K"] if fac == "G" else 1)
            tol = Tolerance(SAFETY * (rows + exp.shape[0]),
                            "one sum of N·|T|·K outer products per entry, and the forward "
                            "and backward passes of the model")
            rtol = tol.rtol(eps)
            case = Case(f"{name}.{fac}", cap.name, {}, {}, exp, tol, meta=meta,
                        alternatives=alternatives[name][fac])
            c = compare(x.astype(np.float64), exp, rtol)
            check = LayerCheck(name, fac, c.ok, c.rel_err, rtol)
            if not c.ok:
                d = diagnose(x, case, cap, None, rtol)
                check.diagnosis = d.pitfall
                check.explanation = d.explanation + _hint(d.pitfall)
            result.checks.append(check)
    return result


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
