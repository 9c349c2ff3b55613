r"""Diagnosis of one K-FAC factor of a user's model: which pitfalls, on *this* factor, turn
the reference into the user's numbers.

A candidate is a *base* (the reference in the declared conventions, or what kfac_ref
computes with a structural pitfall built in: the bias coordinate first, the other patch
order, the dilation, padding or stride ignored, the empirical instead of the true Fisher, a
moving average started at the identity, ...) times **one scale term**
:math:`c = N^a\,|T|^b\,2^e` with small integer exponents.  The scale term is one pitfall id
(``scale:1/(N^2·T^3)``) whose explanation names the cause of each power *for the factor it is
on* (``A`` or ``G``): a power of :math:`N` in ``G`` is a loss-reduction fault, in ``A`` a
normalisation fault.  Each structural pitfall and each non-zero exponent counts as one
cause; at most :data:`MAX_CAUSES` causes, fewest first.  A candidate *explains* the factor
by the suite's criterion (:data:`conformance.diagnosis.EXPLAIN_RTOL`,
:data:`conformance.diagnosis.EXPLAIN_REDUCTION`).

Moving averages of an optimiser's state are *fitted*: given the per-batch reference
statistics :math:`X_1, \dots, X_k` (oldest first) the decay :math:`\delta` of

.. math::

    m_k = \delta^k I + (1-\delta)\sum_{i=1}^k \delta^{k-i} X_i \quad\text{(started at } I),
    \qquad m_k = (1-\delta)\sum_{i=1}^k \delta^{k-i} X_i \quad\text{(at 0, not debiased)},

(and the first-statistic start, and a debiased average with another decay) is the minimiser
of :math:`\|M - m_k(\delta)\|_F` over :math:`\delta \in (0, 1)`, found exactly from the
roots of the derivative of that polynomial in :math:`\delta`.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..diagnosis import EXPLAIN_REDUCTION, EXPLAIN_RTOL, Diagnosis

__all__ = ["MAX_CAUSES", "diagnose_factor", "scale_id", "state_candidates"]

#: at most this many causes (structural pitfalls + powers of N, |T| and 2) in one diagnosis
MAX_CAUSES = 4
_EXP_N = range(-2, 3)
_EXP_T = range(-3, 4)
_EXP_2 = range(-1, 3)


# -- the scale term ------------------------------------------------------------------------
def _power(sym, k):
    return sym if k == 1 else f"{sym}^{k}"


def scale_id(a, b, e):
    """The pitfall id of :math:`N^a |T|^b 2^e`: ``scale:N``, ``scale:1/(N^2·T)``,
    ``scale:T/N``, ``scale:4`` ..."""
    up, down = [], []
    for sym, k in (("N", a), ("T", b)):
        if k > 0:
            up.append(_power(sym, k))
        elif k < 0:
            down.append(_power(sym, -k))
    if e > 0:
        up.insert(0, str(2 ** e))
    elif e < 0:
        down.insert(0, str(2 ** -e))
    num = "·".join(up) or "1"
    if not down:
        return f"scale:{num}"
    den = down[0] if len(down) == 1 else "(" + "·".join(down) + ")"
    if len(up) > 1:
        num = f"({num})"
    return f"scale:{num}/{den}"


def _scale_label(a, b, e, n, t):
    parts = []
    for sym, k, v in (("N", a, n), ("|T|", b, t)):
        if k:
            sup = {1: "", 2: "²", 3: "³"}.get(abs(k), f"^{abs(k)}")
            parts.append(f"{sym}{sup} = {v ** abs(k)}" if k > 0 else
                         f"1/{sym}{sup} = 1/{v ** abs(k)}")
    if e:
        parts.append(str(2 ** e) if e > 0 else f"1/{2 ** -e}")
    return " × ".join(parts)


def _cause(factor, sym, k, loss):
    """Plain words for a power ``k`` of ``sym`` (N, T or 2) in the factor ``factor``."""
    if sym == "N":
        if factor == "G":
            return {
                -2: "G carries 1/N²: gradients of the mean-reduced loss (each g has a 1/N) "
                    "used as per-example gradients — multiply g by N",
                -1: "G carries an extra 1/N: normalised by N², or the empirical-Fisher scale "
                    "with kfac-jax's extra 1/N (declare conventions={'empirical_fisher_scale':"
                    " 'kfac_jax'} if meant)",
                1: "G is N times too large: the curvature of the summed loss "
                   "(reduction='sum'; declare conventions={'curvature_of': 'sum'} if meant), "
                   "or the 1/N of the average missing",
                2: "G is N² times too large: gradients of the summed loss, multiplied by N "
                   "again",
            }.get(k, f"G is N^{k} times the reference")
        return {
            -1: "A is normalised by N² (or by N twice)",
            1: "A is not normalised by N (a sum over examples)",
        }.get(k, f"A is N^{k} times the reference: a normalisation by the batch size")
    if sym == "T":
        if factor == "G":
            return {
                -1: "G is normalised by N·|T| instead of N: TF ConvKFCBasicFB's / kfac-jax's "
                    "Γ = G/|T| (F = |T|·(A⊗Γ)); correct only if the block (or the damping) "
                    "carries the |T|: declare conventions={'conv_style': 'kfc'}",
                1: "G carries an extra |T|: the |T| of the block put into G on top of the "
                   "N-normalisation",
            }.get(k, f"G is |T|^{k} times the reference: location bookkeeping of a "
                     "weight-shared layer")
        return {
            1: "A is normalised by N instead of N·|T| (a sum over the |T| locations, "
               "BackPACK's Σ/N)",
            -1: "A is normalised by N·|T|² (the locations averaged twice)",
        }.get(k, f"A is |T|^{k} times the reference: location bookkeeping of a weight-shared "
                 "layer")
    if k == 1:
        return ("twice the reference: the squared error ‖f−y‖² without the ½ (Hessian 2I; "
                "declare conventions={'mse_variance': 0.5} if meant)" if loss == "mse" else
                "twice the reference: a doubled symmetrisation (M + Mᵀ without the ½)")
    if k == 2:
        return ("4 × the reference: the squared error ‖f−y‖² without the ½ in an outer "
                "product of gradients (2(f−y) twice)" if loss == "mse" else
                "4 × the reference")
    return f"{2 ** k} × the reference" if k > 0 else f"1/{2 ** -k} of the reference"


def _scales(n, t):
    """(a, b, e, value, causes) for every scale term, fewest causes first."""
    out = []
    for a, b, e in itertools.product(_EXP_N, _EXP_T if t > 1 else (0,), _EXP_2):
        if n <= 1 and a:
            continue
        causes = (a != 0) + (b != 0) + (e != 0)
        out.append((causes, abs(a) + abs(b) + abs(e), a, b, e, float(n) ** a * float(t) ** b
                    * 2.0 ** e))
    out.sort()
    return out


def _rel(x, cand):
    den = max(float(np.linalg.norm(cand)), np.finfo(np.float64).tiny)
    return float(np.linalg.norm(x - cand)) / den


# -- optimiser state ------------------------------------------------------------------------
def _poly_min(x, coefs):
    """δ in (0, 1) minimising ‖x − Σ_j δ^j C_j‖_F (``coefs`` [J, ...]), or None."""
    c = coefs.reshape(len(coefs), -1)
    xv = x.reshape(-1)
    gram = c @ c.T
    lin = c @ xv
    deg = len(coefs) - 1
    # f(δ) = Σ_{j,l} δ^{j+l} gram[j,l] − 2 Σ_j δ^j lin[j]: coefficients by power
    f = np.zeros(2 * deg + 1)
    for j in range(deg + 1):
        f[j] -= 2 * lin[j]
        for ll in range(deg + 1):
            f[j + ll] += gram[j, ll]
    df = np.polynomial.polynomial.polyder(f)
    roots = np.polynomial.polynomial.polyroots(df) if np.any(df) else np.array([])
    cands = [r.real for r in np.atleast_1d(roots) if abs(r.imag) < 1e-9 and 0 < r.real < 1]
    if not cands:
        return None
    vals = [np.polynomial.polynomial.polyval(d, f) for d in cands]
    return float(cands[int(np.argmin(vals))])


def _ema_poly(hist, start):
    """Coefficients [J, ...] in δ of the k-step average of ``hist`` (oldest first) started at
    ``start`` ("identity", "zero", "first")."""
    k = len(hist)
    shape = hist[0].shape
    coefs = np.zeros((k + 1, *shape))
    first = 1 if start == "first" else 0
    for i, x in enumerate(hist[first:], first):  # weight (1−δ) δ^{k−1−i}
        m = k - 1 - i
        coefs[m] += x
        coefs[m + 1] -= x
    if start == "identity":
        coefs[k] += (np.ones(shape) if len(shape) == 1 else
                     np.broadcast_to(np.eye(shape[-1]), shape))  # I (per group)
    elif start == "first":
        coefs[k - 1] += hist[0]
    return coefs


def ema_value(hist, decay, start="zero", debias=True):
    r"""The k-step moving average of the statistics ``hist`` (oldest first) with decay
    :math:`\delta`: :math:`m_i = \delta m_{i-1} + (1-\delta) X_i` from :math:`m_0 = 0`
    (``start="zero"``; divided by :math:`1-\delta^k` when ``debias``), :math:`m_0 = I`
    (``"identity"``) or :math:`m_1 = X_1` (``"first"``)."""
    k = len(hist)
    if start == "zero" and debias:
        w = np.array([decay ** (k - 1 - i) for i in range(k)])
        return sum(wi * x for wi, x in zip(w, hist, strict=True)) / w.sum()
    coefs = _ema_poly(hist, start)
    return sum(decay ** j * c for j, c in enumerate(coefs))


def state_candidates(x, hist, decay=None):
    """(pid, text, candidate) for the moving-average pitfalls that a fitted decay explains
    best: started at the identity, and (k ≥ 2 batches) debiased with another decay, started
    at zero without debiasing, or started at the first statistic.  (After one update a
    zero start without debiasing is the constant 1 − δ: :func:`diagnose_factor` names it
    only when no power of N, |T| or 2 is that constant.)"""
    k = len(hist)
    out = []
    square = x.ndim == 2 and x.shape[0] == x.shape[1]
    if k >= 2:
        w_poly = np.zeros((k, *x.shape))  # x·Σδ^{k−1−i} − Σ δ^{k−1−i} X_i, linearised
        for i, xi in enumerate(hist):
            w_poly[k - 1 - i] += xi - x
        d = _poly_min(np.zeros_like(x), w_poly)
        if d is not None and (decay is None or abs(d - decay) > 1e-6):
            out.append(("ema_decay", f"a debiased moving average with decay δ = {d:.6g}"
                        + (f" (declared {decay:g})" if decay is not None else ""),
                        ema_value(hist, d)))
    for start, pid in (("identity", "ema_identity_init"), ("zero", "ema_zero_init_no_debias"),
                       ("first", "ema_first_statistic")):
        if (start == "identity" and not square) or (start != "identity" and k < 2):
            continue  # after one update a zero start is a constant factor (see below)
        d = _poly_min(x, _ema_poly(hist, start))
        if d is None:
            continue
        cand = ema_value(hist, d, start, debias=False)
        if start == "identity":
            if k == 1:
                steps = ""
                if decay is not None and 0 < decay < 1:
                    s = math.log(d) / math.log(decay)
                    if abs(s - round(s)) < 1e-3 and round(s) >= 1:
                        steps = f": decay {decay:g} after {round(s)} updates"
                steps = steps or " (δ the decay, k the number of updates)"
                text = (f"a moving average started at the identity, m₀ = I: the factor is "
                        f"c·I + (1 − c)·X with c = δᵏ = {d:.6g}{steps}")
            else:
                text = (f"a moving average started at the identity, m₀ = I, "
                        f"mᵢ = δ·mᵢ₋₁ + (1 − δ)·Xᵢ: decay δ = {d:.6g} over the {k} batches")
        elif start == "zero":
            text = (f"a moving average started at zero and not debiased "
                    f"(m = (1 − δ)·Σ δ^(k−i) Xᵢ, not divided by 1 − δᵏ): decay δ = {d:.6g}"
                    + (f" after {k} updates" if k > 1 else " after one update"))
        else:
            text = (f"a moving average started at the first statistic (m₁ = X₁, no zero "
                    f"start): decay δ = {d:.6g} over the {k} batches")
        out.append((pid, text, cand))
    return out


# -- the search -----------------------------------------------------------------------------
def diagnose_factor(x, expected, bases, *, factor, n, t, rtol, loss="cross_entropy",
                    coef_rtol=1e-3):
    """The fewest causes that reconcile ``x`` with ``expected``: ``bases`` is a list of
    ``(pid, text, array)`` structural candidates (``pid`` may join several causes with
    ``+``); each base, and the plain reference, is tried times every scale term of
    :func:`scale_id`.  Returns a :class:`conformance.diagnosis.Diagnosis`, ``unexplained``
    (with the least-squares constant when a multiple of the reference fits) otherwise."""
    e0 = _rel(x, expected)

    def explains(r):
        return r <= rtol or (r <= EXPLAIN_RTOL and r <= EXPLAIN_REDUCTION * e0)

    scales = _scales(n, t)
    best = None
    for order, (pid, text, base) in enumerate([("", "", expected)] + list(bases)):
        if base is None or base.shape != x.shape or not np.all(np.isfinite(base)):
            continue
        nstruct = len(pid.split("+")) if pid else 0
        if nstruct > MAX_CAUSES:
            continue
        denom = float(np.vdot(base, base))
        if denom <= 0:
            continue
        coef = float(np.vdot(base, x)) / denom
        if not np.isfinite(coef) or coef == 0:
            continue
        for causes, size, a, b, e, v in scales:
            if nstruct + causes > MAX_CAUSES or (nstruct == 0 and causes == 0):
                continue
            if abs(v / coef - 1.0) > coef_rtol and not (causes == 0):
                continue
            r = _rel(x, v * base)
            if not explains(r):
                continue
            # a fitted moving average explains any constant: named powers come first
            fitted = pid.startswith("ema_")
            key = (nstruct + causes, 0 if r <= rtol else 1, fitted, size, order, r)
            if best is None or key < best[0]:
                best = (key, pid, text, (a, b, e), r)
    if best is None:
        return _unexplained(x, expected, e0, rtol)
    _, pid, text, (a, b, e), r = best
    ids = [pid] if pid else []
    words = [text] if text else []
    if (a, b, e) != (0, 0, 0):
        ids.append(scale_id(a, b, e))
        causes = [_cause(factor, sym, k, loss) for sym, k in (("N", a), ("T", b), ("2", e))
                  if k]
        label = _scale_label(a, b, e, n, t)
        words.append(f"{'times' if words else 'output ='} {label}"
                     f"{'' if words else ' × expected'} [{'; '.join(causes)}]")
    msg = ", ".join(words)
    if r > rtol:
        msg += f"; up to {r:.1g} relative remains (a small additive term?)"
    return Diagnosis("+".join(ids), msg, r)


def _unexplained(x, expected, e0, rtol):
    denom = float(np.vdot(expected, expected))
    coef = float(np.vdot(expected, x)) / denom if denom > 0 else float("nan")
    if np.isfinite(coef) and 0 < coef < 1 and _rel(x, coef * expected) <= EXPLAIN_RTOL:
        return Diagnosis("ema_zero_init_no_debias",
                         f"output = {coef:.6g} × expected: a moving average started at zero "
                         f"and not debiased, after one update with decay δ = {1 - coef:.6g} "
                         "(m = (1 − δ)·X, not divided by 1 − δ), or a constant factor",
                         _rel(x, coef * expected))
    if np.isfinite(coef) and coef != 0 and _rel(x, coef * expected) <= EXPLAIN_RTOL:
        return Diagnosis("scale", f"output = {coef:.6g} × expected (no power of N, |T| or 2, "
                                  "and no moving-average start explains it)",
                         _rel(x, coef * expected))
    return Diagnosis("unexplained", f"relative error {e0:.3e} (rtol {rtol:.1e}); no known "
                                    f"pitfall, nor up to {MAX_CAUSES} causes together, "
                                    "reconciles the numbers", e0)
