"""TF K-FAC blocks: Cholesky products, scale-and-shift, multi-use embedding and depthwise
blocks, against dense NumPy oracles built from the raw statistics."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_allclose_normwise, random_spd
from test_blocks_tf import dense_power, flat, kron_cases, tf_damped_dense

from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref.blocks import tf as T


def _vector(xp, host_flat, shapes, single):
    parts, k = [], 0
    for s in shapes:
        n = int(np.prod(s))
        parts.append(xp.asarray(host_flat[k:k + n].reshape(s)))
        k += n
    return parts[0] if single else tuple(parts)


def densify(xp, op, shapes, single):
    """The matrix of ``op`` on the row-major concatenation of the vector's parts."""
    n = sum(int(np.prod(s)) for s in shapes)
    cols = [flat(xp, op(_vector(xp, np.eye(n)[k], shapes, single))) for k in range(n)]
    return np.stack(cols, axis=1)


def layer_shapes(kshape, bias):
    return ((tuple(kshape), (kshape[-1],)) if bias else (tuple(kshape),)), not bias


def cholesky_cases(xp, rng, damping):
    """(name, block, vector shapes, single array?, dense damped block on the host)."""
    cases = []
    for name, ctor, a, g, kshape, bias, c, k in kron_cases(rng):
        blk = ctor(xp.asarray(a), xp.asarray(g), damping)
        m = tf_damped_dense(xp.round_host(a), xp.round_host(g), damping, c, k)
        cases.append((name, blk, *layer_shapes(kshape, bias), m))
    da, g3 = rng.uniform(0.5, 2.0, 4), random_spd(rng, 3, 0.5, 2.0)
    cases.append(("EmbeddingKFACMultiIndepFB",
                  T.EmbeddingKFACMultiIndepFB(xp.asarray(da), xp.asarray(g3), damping, 3),
                  ((4, 3),), True,
                  tf_damped_dense(xp.round_host(da), xp.round_host(g3), damping, 3.0, 3.0)))
    full = random_spd(rng, 12, 0.5, 2.0)
    mfull = xp.round_host(full) + damping * np.eye(12)
    for cls in (T.FullFB, T.NaiveFullFB):
        cases.append((cls.__name__, cls(xp.asarray(full), damping, [(3, 3), (3,)]),
                      ((3, 3), (3,)), False, mfull))
    ss = random_spd(rng, 6, 0.5, 2.0)
    cases.append(("ScaleAndShiftFullFB", T.ScaleAndShiftFullFB(xp.asarray(ss), damping),
                  ((3,), (3,)), False, xp.round_host(ss) + damping * np.eye(6)))
    d = rng.uniform(0.5, 2.0, (4, 3))
    mdiag = np.diag(xp.round_host(d).reshape(-1) + damping)
    for cls in (T.DiagonalFB, T.NaiveDiagonalFB):
        cases.append((cls.__name__, cls(xp.asarray(d.reshape(-1)), damping, [(3, 3), (3,)]),
                      ((3, 3), (3,)), False, mdiag))
    cases.append(("ScaleAndShiftDiagonalFB",
                  T.ScaleAndShiftDiagonalFB(xp.asarray(d.reshape(-1)), damping),
                  ((6,), (6,)), False, mdiag))
    cases.append(("FullyConnectedDiagonalFB",
                  T.FullyConnectedDiagonalFB(xp.asarray(d), damping, has_bias=True),
                  ((3, 3), (3,)), False, mdiag))
    cases.append(("ConvDiagonalFB",
                  T.ConvDiagonalFB(xp.asarray(d), damping, (1, 3, 1, 3), has_bias=True,
                                   num_locations=4),
                  ((1, 3, 1, 3), (3,)), False, mdiag))
    return cases


N_CASES = 15


@pytest.mark.parametrize("case", range(N_CASES))
@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_cholesky_products_vs_dense(xp, rng, case, damping):
    """L is the (unique, lower, positive-diagonal) Cholesky factor of the damped block in the
    vec_r([W; b]) order: a Kronecker product of lower triangles is lower triangular, so TF's
    L = c^½ L_A ⊗ L_G must equal numpy's cholesky of the dense damped block; Lᵀ, L⁻¹, L⁻ᵀ
    follow, and the two products invert each other."""
    cases = cholesky_cases(xp, rng, damping)
    assert len(cases) == N_CASES
    name, blk, shapes, single, m = cases[case]
    chol = np.linalg.cholesky(m)
    n = m.shape[0]
    dense = {}
    for method in ("multiply_cholesky", "multiply_cholesky_inverse"):
        fn = getattr(blk, method)
        for tr in (False, True):
            dense[method, tr] = densify(xp, lambda v, f=fn, t=tr: f(v, transpose=t), shapes,
                                        single)
    kappa = np.linalg.cond(m)
    rtol = xp.rtol * max(1.0, kappa)
    assert_allclose_normwise(dense["multiply_cholesky", False], chol, rtol)
    assert_allclose_normwise(dense["multiply_cholesky", True], chol.T, rtol)
    inv = np.linalg.inv(chol)
    assert_allclose_normwise(dense["multiply_cholesky_inverse", False], inv, rtol)
    assert_allclose_normwise(dense["multiply_cholesky_inverse", True], inv.T, rtol)
    # L Lᵀ = damped block; L⁻¹ L = I; the products keep the vector's structure and backend
    lo = dense["multiply_cholesky", False]
    assert_allclose_normwise(lo @ lo.T, m, rtol)
    assert_allclose_normwise(dense["multiply_cholesky_inverse", False] @ lo, np.eye(n), rtol)
    v = _vector(xp, rng.standard_normal(n), shapes, single)
    out = blk.multiply_cholesky_inverse(blk.multiply_cholesky(v, transpose=True),
                                        transpose=True)
    assert type(out) is type(v)
    for p_ in (out if isinstance(out, tuple) else (out,)):
        xp.check(p_)
    assert_allclose_normwise(flat(xp, out), flat(xp, v), rtol)


def test_cholesky_refusals(xp, rng):
    a, g = xp.asarray(random_spd(rng, 5)), xp.asarray(random_spd(rng, 3))
    blk = T.FullyConnectedKFACBasicFB(a, g, 0.1, has_bias=True)
    v = (xp.asarray(np.ones((4, 3))), xp.asarray(np.ones(3)))
    with pytest.raises(KFACTypeError, match="transpose must be a bool"):
        blk.multiply_cholesky(v, transpose="yes")
    with pytest.raises(KFACTypeError, match="transpose must be a bool"):
        T.DiagonalFB(xp.asarray(np.ones(4)), 0.1).multiply_cholesky_inverse(
            xp.asarray(np.ones(4)), transpose=1)
    with pytest.raises(KFACValueError, match=r"NaiveDiagonalFB.multiply_cholesky: vector must "
                                             r"have 4 entries"):
        T.NaiveDiagonalFB(xp.asarray(np.ones(4)), 0.1).multiply_cholesky(xp.asarray(np.ones(3)))
    with pytest.raises(KFACValueError, match=r"ConvDiagonalFB.multiply_cholesky_inverse: vector "
                                             r"must have the parameter shapes"):
        T.ConvDiagonalFB(xp.asarray(np.ones((3, 2))), 0.1, (1, 3, 1, 2)).\
            multiply_cholesky_inverse(xp.asarray(np.ones((3, 2))))
    ident = T.FullyConnectedKFACBasicFB(a, g, 0.1, has_bias=True,
                                        zero_factor_fallback="identity")
    with pytest.raises(KFACValueError, match="zero_factor_fallback must be 'pi_one'"):
        ident.multiply_cholesky(v)
    with pytest.raises(KFACValueError, match="positive definite"):
        T.FullFB(xp.asarray(np.zeros((4, 4))), 0.0).multiply_cholesky(xp.asarray(np.ones(4)))
    with pytest.raises(KFACValueError, match="4 entries"):
        T.FullFB(xp.asarray(np.eye(4)), 0.1).multiply_cholesky(xp.asarray(np.ones(3)))
    ser = T.FullyConnectedSeriesFB(a, g, 0.1, 3, True, input_cov_dt1=a, output_cov_dt1=g)
    for method in ("multiply_cholesky", "multiply_cholesky_inverse"):
        with pytest.raises(KFACValueError, match="no Cholesky factor"):
            getattr(ser, method)(v)


# --------------------------------------------------------------------------------------
# Scale-and-shift and multi-use embedding blocks from data
# --------------------------------------------------------------------------------------
def test_scale_and_shift_blocks_from_data(xp, rng):
    """inputs [N, H, C], per-channel scale and shift broadcast along H: per-example
    v_n = [Σ_h x⊙g ; Σ_h g], F = mean v vᵀ (full) or mean v⊙v (diagonal)."""
    x = rng.standard_normal((7, 4, 3))
    gy = rng.standard_normal((7, 4, 3))
    xh, gh = xp.round_host(x), xp.round_host(gy)
    vn = np.hstack([(xh * gh).sum(1), gh.sum(1)])
    lam = 0.2
    full = T.ScaleAndShiftFullFB.from_data(xp.asarray(x), xp.asarray(gy), lam, (1,), (1,))
    diag = T.ScaleAndShiftDiagonalFB.from_data(xp.asarray(x), xp.asarray(gy), lam, (1,), (1,))
    f = vn.T @ vn / 7
    xp.assert_close(full.full_fisher_block(), f)
    xp.assert_close(diag.full_fisher_block(), np.diag(np.diag(f)))
    vec_h = rng.standard_normal(6)
    vec = (xp.asarray(vec_h[:3]), xp.asarray(vec_h[3:]))
    vh = xp.round_host(vec_h)
    for p in (-1.0, 0.5, 1.0):
        assert_allclose_normwise(flat(xp, full.multiply_matpower(vec, p)),
                                 dense_power(f + lam * np.eye(6), p) @ vh, xp.rtol)
        assert_allclose_normwise(flat(xp, diag.multiply_matpower(vec, p)),
                                 (np.diag(f) + lam) ** p * vh, xp.rtol)
    # scale only
    only = T.ScaleAndShiftDiagonalFB.from_data(xp.asarray(x), xp.asarray(gy), lam, (1,),
                                               has_shift=False)
    xp.assert_close(only.full_fisher_block(), np.diag(np.diag(f)[:3]))


def test_embedding_multi_indep_from_data(xp, rng):
    ids = np.array([[0, 2, 2], [3, 0, 1]])  # T = 2 uses, N = 3
    gy = rng.standard_normal((2, 3, 2))
    blk = T.EmbeddingKFACMultiIndepFB.from_data(xp.asarray(ids), xp.asarray(gy), 5, 0.4)
    assert blk.num_uses == 2 and blk.renorm_coeff == 2.0
    assert blk.damping == pytest.approx(0.2)
    gh = xp.round_host(gy).reshape(6, 2)
    d = np.array([2, 1, 2, 1, 0]) / 6
    gcov = gh.T @ gh / 6
    xp.assert_close(blk.full_fisher_block(), 2 * np.kron(np.diag(d), gcov))
    m = tf_damped_dense(d, gcov, 0.4, 2.0, 2.0)
    v_h = rng.standard_normal(10)
    v = xp.asarray(v_h.reshape(5, 2))
    assert_allclose_normwise(flat(xp, blk.multiply_inverse(v)),
                             np.linalg.solve(m, xp.round_host(v_h)), xp.rtol)
    with pytest.raises(KFACValueError, match="must agree on T and N"):
        T.EmbeddingKFACMultiIndepFB.from_data(xp.asarray(ids), xp.asarray(gy[:, :2]), 5, 0.4)
    with pytest.raises(KFACValueError, match="num_uses"):
        T.EmbeddingKFACMultiIndepFB(xp.asarray(d), xp.asarray(gcov), 0.4, 0)


# --------------------------------------------------------------------------------------
# Depthwise convolution blocks
# --------------------------------------------------------------------------------------
def selection(kh, kw, c, m):
    """Dense S: vec_r of the depthwise kernel [kh,kw,C,M] → vec_r of [kh,kw,C,C·M]."""
    s = np.zeros((kh * kw * c * c * m, kh * kw * c * m))
    for i in range(kh):
        for j in range(kw):
            for ch in range(c):
                for mm in range(m):
                    dst = ((i * kw + j) * c + ch) * (c * m) + ch * m + mm
                    src = ((i * kw + j) * c + ch) * m + mm
                    s[dst, src] = 1.0
    return s


def depthwise_data(rng, n=3, h=5, w=5, c=2, m=2, kh=2, kw=3):
    """VALID stride-1 depthwise conv: inputs, output gradients [N, H', W', C·M], per-example
    depthwise kernel gradients [N, kh, kw, C, M] by brute force."""
    x = rng.standard_normal((n, h, w, c))
    ho, wo = h - kh + 1, w - kw + 1
    gy = rng.standard_normal((n, ho, wo, c * m))
    return x, gy


def brute_depthwise_grads(x, gy, kh, kw, m):
    n, h, w, c = x.shape
    ho, wo = gy.shape[1:3]
    grads = np.zeros((n, kh, kw, c, m))
    for i in range(kh):
        for j in range(kw):
            patch = x[:, i:i + ho, j:j + wo, :]  # [N, H', W', C]
            for mm in range(m):
                grads[:, i, j, :, mm] = np.einsum("nabc,nabc->nc", patch,
                                                  gy[:, :, :, mm::m])
    return grads


def test_depthwise_diagonal_block(xp, rng):
    """Its diagonal is the exact diagonal of the depthwise layer's Fisher (per-example
    depthwise gradients by brute force), damped by |T|·λ/|T|; Cholesky products follow."""
    kh, kw, c, m = 2, 3, 2, 2
    x, gy = depthwise_data(rng, c=c, m=m, kh=kh, kw=kw)
    lam = 0.3
    blk = T.DepthwiseConvDiagonalFB.from_data(xp.asarray(x), xp.asarray(gy), lam,
                                              (kh, kw, c, m), "VALID")
    assert blk.num_locations == 12
    grads = brute_depthwise_grads(xp.round_host(x), xp.round_host(gy), kh, kw, m)
    d = (grads.reshape(3, -1) ** 2).mean(0)
    v_h = rng.standard_normal(kh * kw * c * m)
    v = xp.asarray(v_h.reshape(kh, kw, c, m))
    vh = xp.round_host(v_h)
    for p in (-1.0, -0.5, 0.5, 1.0):
        out = blk.multiply_matpower(v, p)
        xp.check(out)
        assert tuple(out.shape) == (kh, kw, c, m)
        assert_allclose_normwise(flat(xp, out), (d + lam) ** p * vh, xp.rtol)
    assert_allclose_normwise(flat(xp, blk.multiply_cholesky(v, transpose=True)),
                             (d + lam) ** 0.5 * vh, xp.rtol)
    assert_allclose_normwise(flat(xp, blk.multiply_cholesky_inverse((v,))),
                             (d + lam) ** -0.5 * vh, xp.rtol)


def test_depthwise_kfc_block(xp, rng):
    """op_dw = Sᵀ op(S v) with the conv block of the expanded kernel: Ω from the inputs'
    patches, Γ from the C·M-channel output gradients (both / N|T|), c = k = |T|."""
    kh, kw, c, m = 2, 3, 2, 2
    x, gy = depthwise_data(rng, c=c, m=m, kh=kh, kw=kw)
    lam = 0.3
    blk = T.DepthwiseConvKFCBasicFB.from_data(xp.asarray(x), xp.asarray(gy), lam,
                                              (kh, kw, c, m), "VALID")
    xh, gh = xp.round_host(x), xp.round_host(gy)
    ho, wo = gh.shape[1:3]
    rows = np.array([xh[n, i:i + kh, j:j + kw, :].reshape(-1)
                     for n in range(3) for i in range(ho) for j in range(wo)])
    t = ho * wo
    om = rows.T @ rows / (3 * t)
    ga = gh.reshape(-1, c * m).T @ gh.reshape(-1, c * m) / (3 * t)
    xp.assert_close(blk.full_fisher_block(), t * np.kron(om, ga))
    big = tf_damped_dense(om, ga, lam, float(t), float(t))
    s = selection(kh, kw, c, m)
    v_h = rng.standard_normal(kh * kw * c * m)
    v = xp.asarray(v_h.reshape(kh, kw, c, m))
    vh = xp.round_host(v_h)
    kappa = np.linalg.cond(big)
    rtol = xp.rtol * kappa
    for p in (-1.0, 0.5, 1.0):
        out = blk.multiply_matpower(v, p)
        xp.check(out)
        assert_allclose_normwise(flat(xp, out), s.T @ dense_power(big, p) @ s @ vh, rtol)
    chol = np.linalg.cholesky(big)
    assert_allclose_normwise(flat(xp, blk.multiply_cholesky(v)), s.T @ chol @ s @ vh, rtol)
    assert_allclose_normwise(flat(xp, blk.multiply_cholesky(v, transpose=True)),
                             s.T @ chol.T @ s @ vh, rtol)
    assert_allclose_normwise(flat(xp, blk.multiply_cholesky_inverse(v)),
                             s.T @ np.linalg.inv(chol) @ s @ vh, rtol)


def test_depthwise_bad_inputs(xp, rng):
    d = xp.asarray(np.ones((6, 4)))
    with pytest.raises(KFACValueError, match="filter_shape must be the depthwise kernel"):
        T.DepthwiseConvDiagonalFB(d, 0.1, (1, 3, 2))
    with pytest.raises(KFACValueError, match="filter_shape must match"):
        T.DepthwiseConvDiagonalFB(d, 0.1, (1, 3, 2, 3))
    blk = T.DepthwiseConvDiagonalFB(d, 0.1, (1, 3, 2, 2))
    w = xp.asarray(np.ones((1, 3, 2, 2)))
    with pytest.raises(KFACTypeError, match="no bias"):
        blk.multiply((w, xp.asarray(np.ones(4))))
    with pytest.raises(KFACValueError, match=r"vector must be an array of shape"):
        blk.multiply(xp.asarray(np.ones((1, 3, 2, 4))))
    x = xp.asarray(rng.standard_normal((2, 4, 4, 2)))
    with pytest.raises(KFACValueError, match="outputs_grad"):
        T.DepthwiseConvKFCBasicFB.from_data(x, xp.asarray(np.ones((2, 2, 2, 2))), 0.1,
                                            (1, 3, 2, 2), "VALID")
