"""The reference K-FAC factors of one layer, in NumPy, from its inputs and back-propagated
output vectors, and the output vectors of each estimation mode (no torch, no JAX)."""

from __future__ import annotations

import numbers

import numpy as np

MODES = ("fisher_exact", "fisher_empirical", "fisher_sampled")
LOSSES = ("cross_entropy", "mse")
SHARING = ("expand", "reduce")

def _is_tensor(x):
    return hasattr(x, "detach") and hasattr(x, "cpu")


def _np(x, dtype=None):
    if _is_tensor(x):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":  # NumPy has no bfloat16: widen, exactly
            x = x.float()
        x = x.numpy()
    else:
        x = np.asarray(x)
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
    (:math:`\sum/(KN|T|)`), i.e. :math:`G = \frac1N\sum_{n,t,k} g g^\top`; KFAC-reduce: the
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
    ``[K, N, (S,) d_out]``; :math:`A = \frac{1}{NS}\sum_{n,s}\bar a\bar a^\top`,
    :math:`G = \frac1N\sum_{n,s,k} g g^\top` by
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


def _khw_to_chw(c_in, kernel):
    """Index map of an N-d patch: entry ``c·|Δ| + δ`` (channel slowest, the order of
    ``weight.reshape(out, -1)``) <- ``δ·C + c`` (kfac_ref's channels-last order)."""
    k = int(np.prod(kernel))
    return np.arange(k * c_in).reshape(k, c_in).T.ravel()


def conv_patches(x, *, kernel, padding, strides, dilation):
    r"""``[N, |T|, C·|Δ|]`` patches of an N-d convolution (``x``: ``[N, C, *spatial]``),
    channel slowest then the kernel offsets row-major (the order of
    ``weight.reshape(out, -1)``), zero padding ``((before, after), ...)`` per spatial axis,
    by :func:`kfac_ref.factors.conv_patch_matrix` (channels last, any rank):

    .. math:: p_{n,t} = \big(x^\text{pad}_{n,c,\,s\odot t + d\odot\delta}\big)_{c,\delta}
    """
    from kfac_ref.factors import conv_patch_matrix

    n, c = x.shape[:2]
    xl = np.moveaxis(x, 1, -1)  # channels last
    rows = np.asarray(conv_patch_matrix(
        xl, tuple(kernel) + (c, 1), tuple(tuple(int(q) for q in p) for p in padding),
        tuple(strides), tuple(dilation), data_format=None))
    rows = rows[:, _khw_to_chw(c, kernel)]
    return rows.reshape(n, -1, rows.shape[-1])


def grouped_reference_factors(p, g, *, groups, bias, sharing="expand"):
    r"""Reference ``(A, G)`` of a layer whose inputs ``p`` ``[N, P, d]`` (``P`` positions:
    uses × locations) and output vectors ``g`` ``[K, N, P, o]`` split into ``groups``
    contiguous blocks of ``d/g`` input and ``o/g`` output coordinates (a grouped
    convolution: group :math:`j` reads input channels :math:`jC/g \dots (j+1)C/g - 1` and
    writes output channels :math:`jO/g \dots`):

    .. math::

        A_j = \frac{1}{NP}\sum_{n,p}\bar a^{(j)}_{n,p}\bar a^{(j)\top}_{n,p}, \qquad
        G_j = \frac1N\sum_{n,p,k} g^{(j)}_{n,p,k} g^{(j)\top}_{n,p,k}

    (KFAC-expand; ``sharing="reduce"``: the mean input and the summed vectors over ``P``),
    by :func:`dense_reference_factors` per group.  ``groups == 1``: ``A`` ``[d(+1), d(+1)]``
    and ``G`` ``[o, o]``; otherwise stacked ``[g, d/g(+1), d/g(+1)]`` and ``[g, o/g, o/g]``."""
    if groups == 1:
        a, gg, _ = dense_reference_factors(p, g, bias=bias, sharing=sharing)
        return a, gg
    d, o = p.shape[-1] // groups, g.shape[-1] // groups
    fa, fg = [], []
    for j in range(groups):  # a loop over groups, not over examples or locations
        a, gg, _ = dense_reference_factors(p[..., j * d:(j + 1) * d], g[..., j * o:(j + 1) * o],
                                           bias=bias, sharing=sharing)
        fa.append(a)
        fg.append(gg)
    return np.stack(fa), np.stack(fg)


def embedding_reference_factors(ids, g, *, vocab, padding_idx=None, sharing="expand"):
    r"""Reference ``(A, G)`` of an embedding ``y = \mathrm{onehot}(i)\,W`` (``W``
    ``[V, D]``) from the ids ``[N, P]`` (``P`` positions: uses × locations) and the output
    vectors ``g`` ``[K, N, P, D]``.  KFAC-expand (TF K-FAC's ``EmbeddingKFACFB``):

    .. math::

        A = \frac{1}{NP}\,\mathrm{diag}(\mathrm{counts}), \qquad
        G = \frac1N\sum_{n,p,k} g_{n,p,k} g_{n,p,k}^\top,

    the counts by :func:`kfac_ref.factors.embedding_input_kronecker_factor`.  KFAC-reduce:
    :math:`A = \frac1N\sum_n m_n m_n^\top` with :math:`m_n = \mathrm{counts}_n / P` the mean
    one-hot of example :math:`n` (not diagonal in general) and :math:`G` over
    :math:`\sum_p g_{n,p,k}`.  Occurrences of ``padding_idx`` are not counted (PyTorch
    gives that row no gradient): its row and column of ``A`` are zero.  Returns ``A`` as a
    ``[V, V]`` matrix."""
    from kfac_ref.factors import embedding_input_kronecker_factor
    from kfac_ref.factors import fully_connected_kronecker_factor as fc

    n, p = ids.shape
    ids = ids.astype(np.int64)
    if sharing == "expand":
        d = np.asarray(embedding_input_kronecker_factor(ids.reshape(-1), vocab,
                                                        dtype="float64"))
        if padding_idx is not None:
            d[padding_idx] = 0.0
        a = np.diag(d)
        g2 = g.reshape(-1, g.shape[-1])
    else:
        m = (ids[:, :, None] == np.arange(vocab)).sum(axis=1) / float(p)  # [N, V]
        if padding_idx is not None:
            m[:, padding_idx] = 0.0
        a = np.asarray(fc(m))
        g2 = g.sum(axis=2).reshape(-1, g.shape[-1])
    return a, np.asarray(fc(g2)) * (g2.shape[0] / n)


def scale_shift_reference_factors(xhat, g, *, has_shift=True):
    r"""Reference ``(F, diag)`` of an elementwise scale-and-shift ``y = γ ⊙ x̂ + β``
    (LayerNorm / BatchNorm / GroupNorm affine) from the normalised input ``xhat``
    ``[N, P, q]`` (``P`` positions sharing :math:`γ, β` of ``q`` entries each) and the
    output vectors ``g`` ``[K, N, P, q]``: the per-example second moment of the parameter
    gradient, not a Kronecker product,

    .. math::

        u_{n,k} = \Big[\sum_p g_{n,p,k} \odot \hat x_{n,p} \;;\; \sum_p g_{n,p,k}\Big],
        \qquad F = \frac1N \sum_{n,k} u_{n,k} u_{n,k}^\top,

    :math:`γ` first, then :math:`β` (``named_parameters`` order), by
    :func:`kfac_ref.factors.scale_and_shift_factor` (kfac-jax's ``ScaleAndShiftFull`` and
    ``ScaleAndShiftDiagonal`` blocks); ``diag`` is the diagonal of ``F``."""
    from kfac_ref.factors import scale_and_shift_factor

    k, n = g.shape[:2]
    x = np.broadcast_to(xhat[None], g.shape).reshape(k * n, *g.shape[2:])
    gg = g.reshape(k * n, *g.shape[2:])
    kw = dict(broadcast_dims_scale=(1,), broadcast_dims_shift=(1,) if has_shift else None,
              has_shift=has_shift)
    f = np.asarray(scale_and_shift_factor(x, gg, approx="full", **kw)) * k
    d = np.asarray(scale_and_shift_factor(x, gg, approx="diagonal", **kw)) * k
    return f, d
