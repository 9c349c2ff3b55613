"""Hand-written baselines: the same K-FAC maths as kfac_ref, written directly in NumPy.

Every function takes ``hp``, a NumPy-compatible module (``numpy``, or ``cupy`` on a GPU), and
host or device arrays of that module.  The backward pass stacks every output vector of an
estimation mode into one batch (``[C·N, ...]``), so each Kronecker factor is one GEMM; the
input factors are computed once per update.  These functions are what kfac_ref is timed
against; :mod:`benchmarks.suite` checks that their numbers agree with kfac_ref's to rounding
before any timing is reported.
"""

from __future__ import annotations

import math

# --------------------------------------------------------------------------------------
# Output vectors of the estimation modes (softmax cross-entropy)
# --------------------------------------------------------------------------------------
EXACT_MODES = ("fisher_exact", "ggn_exact")


def softmax(hp, f):
    z = f - hp.max(f, axis=-1, keepdims=True)
    e = hp.exp(z)
    return e / hp.sum(e, axis=-1, keepdims=True)


def output_vectors(hp, f, y, mode, rng):
    r"""Stacked output cotangents ``U [C, N, D]`` with :math:`\hat C = \frac1N\sum_{c,n}
    J_n^\top u_{c,n} u_{c,n}^\top J_n` for softmax cross-entropy (loss Hessian
    :math:`H = \mathrm{diag}(p) - p p^\top = B B^\top`, :math:`B = \mathrm{diag}(\sqrt p)
    - p \sqrt p^\top`)."""
    p = softmax(hp, f)
    n, d = p.shape
    if mode in EXACT_MODES:  # u_k = B e_k = sqrt(p_k) (e_k - p), for every k
        eye = hp.eye(d, dtype=p.dtype)
        return hp.sqrt(p).T[:, :, None] * (eye[:, None, :] - p[None, :, :])
    if mode == "fisher_empirical":
        return (p - _one_hot(hp, y, d, p.dtype))[None]
    if mode == "fisher_gradients":  # gradient at a label drawn from the model
        u = rng.random((n, 1))
        cdf = hp.cumsum(hp.asarray(p), axis=-1)
        draw = hp.minimum(hp.sum(cdf < hp.asarray(u, dtype=p.dtype), axis=-1), d - 1)
        return (p - _one_hot(hp, draw, d, p.dtype))[None]
    # curvature propagation: u = B r, r Rademacher
    r = hp.asarray(rng.integers(0, 2, size=(n, d)) * 2.0 - 1.0, dtype=p.dtype)
    sp = hp.sqrt(p)
    return (sp * r - p * hp.sum(sp * r, axis=-1, keepdims=True))[None]


def _one_hot(hp, y, d, dtype):
    return (hp.asarray(y)[:, None] == hp.arange(d)[None, :]).astype(dtype)


def _with_ones(hp, x):
    return hp.concatenate([x, hp.ones((*x.shape[:-1], 1), dtype=x.dtype)], axis=-1)


def _cov(m, rows):
    """``mᵀ m / rows`` for a 2-D ``m``: one GEMM."""
    return (m.T @ m) / rows


# --------------------------------------------------------------------------------------
# MLP: dense / tanh
# --------------------------------------------------------------------------------------
def mlp_update(hp, params, x, y, mode, rng, vectors=None):
    """Kronecker factors ``[(A_l, G_l)]`` of a tanh MLP (dense layers; tanh between them)
    from one batch: forward, the mode's output vectors, one stacked backward pass."""
    n = x.shape[0]
    inputs, acts = [x], []
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = hp.tanh(h)
            acts.append(h)
            inputs.append(h)
    u = output_vectors(hp, h, y, mode, rng) if vectors is None else vectors
    g = hp.reshape(u, (-1, u.shape[-1]))  # [C·N, D]
    out = []
    for i in range(len(params) - 1, -1, -1):
        a = _with_ones(hp, inputs[i])
        out.append((_cov(a, n), _cov(g, n)))
        if i:
            deriv = 1.0 - acts[i - 1] ** 2  # tanh'
            g = ((g @ params[i][0].T).reshape(u.shape[0], n, -1) * deriv[None]).reshape(
                g.shape[0], -1)
    return out[::-1]


# --------------------------------------------------------------------------------------
# CNN: conv SAME -> relu -> conv stride 2 SAME -> relu -> mean pool -> dense
# --------------------------------------------------------------------------------------
def same_padding(size, k, s):
    """TF "SAME": output ``ceil(size / s)``, padding split low ``total // 2``."""
    out = -(-size // s)
    total = max((out - 1) * s + k - size, 0)
    return out, (total // 2, total - total // 2)


def im2col(hp, x, k, s):
    """Patches ``[N, Ho, Wo, k·k·C]`` of an NHWC input, ordered (kh, kw, C), C fastest."""
    n, hgt, wid, c = x.shape
    ho, (pt, pb) = same_padding(hgt, k, s)
    wo, (pl, pr) = same_padding(wid, k, s)
    xpad = hp.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))
    cols = [xpad[:, a:a + s * (ho - 1) + 1:s, b:b + s * (wo - 1) + 1:s, :]
            for a in range(k) for b in range(k)]
    return hp.stack(cols, axis=3).reshape(n, ho, wo, k * k * c)


def col2im(hp, dp, in_shape, k, s):
    """Transpose of :func:`im2col`: ``k·k`` strided adds into the padded input."""
    m, ho, wo, _ = dp.shape
    hgt, wid, c = in_shape
    _, (pt, pb) = same_padding(hgt, k, s)
    _, (pl, pr) = same_padding(wid, k, s)
    out = hp.zeros((m, hgt + pt + pb, wid + pl + pr, c), dtype=dp.dtype)
    dp = dp.reshape(m, ho, wo, k, k, c)
    for a in range(k):
        for b in range(k):
            out[:, a:a + s * (ho - 1) + 1:s, b:b + s * (wo - 1) + 1:s, :] += dp[:, :, :, a, b, :]
    return out[:, pt:pt + hgt, pl:pl + wid, :]


def conv_input_factor(hp, x, k, s):
    """KFC input factor ``Ω = P̄ᵀP̄ / (N |T|)`` (bias column last)."""
    p = im2col(hp, x, k, s)
    rows = math.prod(p.shape[:-1])
    return _cov(_with_ones(hp, p.reshape(rows, -1)), rows)


def cnn_update(hp, params, x, y, mode, rng, vectors=None, k=3):
    """KFC factors ``[(Ω_1, Γ_1), (Ω_2, Γ_2), (A_3, G_3)]`` of the benchmark CNN."""
    (k1, b1), (k2, b2), (w3, b3) = params
    n = x.shape[0]
    p1 = im2col(hp, x, k, 1)
    t1 = p1.shape[1] * p1.shape[2]
    h1 = hp.maximum(p1 @ k1.reshape(-1, k1.shape[-1]) + b1, 0)
    p2 = im2col(hp, h1, k, 2)
    t2 = p2.shape[1] * p2.shape[2]
    h2 = hp.maximum(p2 @ k2.reshape(-1, k2.shape[-1]) + b2, 0)
    pooled = h2.mean(axis=(1, 2))
    f = pooled @ w3 + b3
    u = output_vectors(hp, f, y, mode, rng) if vectors is None else vectors
    c = u.shape[0]
    g3 = hp.reshape(u, (c * n, -1))
    # pool and relu: dh2[c, n, t, :] = (g3 W3ᵀ)[c, n, :] / |T| where h2 > 0
    dh2 = (g3 @ w3.T).reshape(c, n, 1, 1, -1) / t2 * (h2 > 0)[None]
    dh2 = dh2.reshape(c * n, *h2.shape[1:])
    dp2 = dh2 @ k2.reshape(-1, k2.shape[-1]).T
    da1 = col2im(hp, dp2, h1.shape[1:], k, 2)
    dh1 = (da1.reshape(c, n, *h1.shape[1:]) * (h1 > 0)[None]).reshape(c * n, *h1.shape[1:])
    return [
        (_cov(_with_ones(hp, p1.reshape(n * t1, -1)), n * t1),
         _cov(dh1.reshape(-1, dh1.shape[-1]), n * t1)),
        (_cov(_with_ones(hp, p2.reshape(n * t2, -1)), n * t2),
         _cov(dh2.reshape(-1, dh2.shape[-1]), n * t2)),
        (_cov(_with_ones(hp, pooled), n), _cov(g3, n)),
    ]


# --------------------------------------------------------------------------------------
# Damped inverses (π split, Cholesky) and cached products
# --------------------------------------------------------------------------------------
def spd_inverse(hp, m):
    """``m⁻¹`` of a symmetric positive definite matrix through LAPACK Cholesky
    (``potrf`` + ``potri``); CuPy: Cholesky and one triangular solve."""
    if hp.__name__ == "numpy":
        from scipy.linalg import lapack

        potrf, potri = lapack.get_lapack_funcs(("potrf", "potri"), (m,))
        c, info = potrf(m, lower=True, clean=False, overwrite_a=False)
        if info:
            raise ValueError(f"potrf failed ({info})")
        inv, info = potri(c, lower=True, overwrite_c=True)
        if info:
            raise ValueError(f"potri failed ({info})")
        low = hp.tril(inv)
        return low + hp.tril(inv, -1).T
    from cupyx.scipy.linalg import solve_triangular

    low = hp.linalg.cholesky(m)
    linv = solve_triangular(low, hp.eye(m.shape[0], dtype=m.dtype), lower=True)
    return linv.T @ linv


def pi_damped_factors(hp, factors, damping, scales):
    r"""``[(1/s, A + π√(λ/s) I, G + √(λ/s)/π I)]`` with the trace-norm π
    (:math:`\pi^2 = (\operatorname{tr}A/p)/(\operatorname{tr}G/q)`)."""
    out = []
    for (a, g), s in zip(factors, scales, strict=True):
        lam = damping / s
        pi = math.sqrt(float(hp.trace(a)) / a.shape[0] / (float(hp.trace(g)) / g.shape[0]))
        da, dg = pi * math.sqrt(lam), math.sqrt(lam) / pi
        out.append((1.0 / s, a + da * hp.eye(a.shape[0], dtype=a.dtype),
                    g + dg * hp.eye(g.shape[0], dtype=g.dtype)))
    return out


def pi_damped_inverses(hp, factors, damping, scales):
    """``[(1/s, (A + π√(λ/s) I)⁻¹, (G + √(λ/s)/π I)⁻¹)]``: two Cholesky inverses a block."""
    return [(c, spd_inverse(hp, a), spd_inverse(hp, g))
            for c, a, g in pi_damped_factors(hp, factors, damping, scales)]


def cached_product(hp, inverses, vector):
    """Block-wise ``c · A⁻¹ X G⁻¹`` on the flat vector (each block's ``[W; b]`` row-major)."""
    outs, start = [], 0
    for coeff, ainv, ginv in inverses:
        p, q = ainv.shape[0], ginv.shape[0]
        x = vector[start:start + p * q].reshape(p, q)
        outs.append((coeff * (ainv @ x @ ginv)).reshape(-1))
        start += p * q
    return hp.concatenate(outs)
