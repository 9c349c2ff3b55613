"""TF K-FAC-named Fisher blocks against dense oracles built in NumPy from the raw statistics."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ar1_series, assert_allclose_normwise, random_spd

from kfac_ref import KFACTypeError, KFACValueError, blocks
from kfac_ref.blocks import tf as T

POWERS = [-1.0, -0.5, 0.5, 1.0, 2.0]



# A cotangent off the output grid: wrong spatial size, or wrong C_out.
_WRONG_OUTPUT_GRID = (r"outputs_grad (must be an array of shape|must have the convolution.s "
                      r"output grid|and filter_shape must agree on out_channels)")

def dense_power(m, p):
    s, q = np.linalg.eigh((m + m.T) / 2)
    return (q * np.clip(s, 0, None) ** p) @ q.T


def mat(f):
    return np.diag(f) if f.ndim == 1 else f


def flat(xp, out):
    parts = out if isinstance(out, tuple) else (out,)
    return np.concatenate([xp.to_numpy(p).reshape(-1) for p in parts])


def tf_damped_dense(a, g, lam, c=1.0, k=None, pi_type="tracenorm"):
    """Oracle: c·(A + π√(λ/k) I) ⊗ (G + √(λ/k)/π I) with TF's compute_pi_tracenorm."""
    lam_k = lam if k is None else lam / k
    d = np.sqrt(lam_k)
    ta = np.trace(mat(a)) * g.shape[0]
    tg = np.trace(mat(g)) * a.shape[0]
    pi = 1.0 if pi_type == "off" or ta * tg == 0 else np.sqrt(ta / tg)
    return c * np.kron(mat(a) + pi * d * np.eye(a.shape[0]), mat(g) + d / pi * np.eye(g.shape[0]))


def kron_cases(rng):
    """(name, constructor(xp-arrays) -> block, host A, host G, kernel shape, bias, c, k)."""
    a5, g3 = random_spd(rng, 5, 0.5, 2.0), random_spd(rng, 3, 0.5, 2.0)
    da = rng.uniform(0.5, 2.0, 4)
    return [
        ("FullyConnectedKFACBasicFB", lambda A, G, lam: T.FullyConnectedKFACBasicFB(
            A, G, lam, has_bias=True), a5, g3, (4, 3), True, 1.0, None),
        ("FullyConnectedKFACBasicFB-diag-input", lambda A, G, lam: T.FullyConnectedKFACBasicFB(
            A, G, lam, has_bias=False), da, g3, (4, 3), False, 1.0, None),
        ("FullyConnectedMultiIndepFB", lambda A, G, lam: T.FullyConnectedMultiIndepFB(
            A, G, lam, num_uses=4, has_bias=True), a5, g3, (4, 3), True, 4.0, 4.0),
        ("ConvKFCBasicFB", lambda A, G, lam: T.ConvKFCBasicFB(
            A, G, lam, (2, 2, 1, 3), num_locations=9, has_bias=True), a5, g3, (2, 2, 1, 3),
         True, 9.0, 9.0),
        ("ConvKFCBasicMultiIndepFB", lambda A, G, lam: T.ConvKFCBasicMultiIndepFB(
            A, G, lam, (2, 2, 1, 3), num_locations=9, num_uses=2, has_bias=True), a5, g3,
         (2, 2, 1, 3), True, 18.0, 18.0),
        ("EmbeddingKFACFB", lambda A, G, lam: T.EmbeddingKFACFB(A, G, lam), da, g3, (4, 3),
         False, 1.0, None),
    ]


def make_vector(xp, rng, kernel_shape, has_bias):
    w = rng.standard_normal(kernel_shape)
    b = rng.standard_normal(kernel_shape[-1])
    rows = xp.round_host(w).reshape(-1, kernel_shape[-1])
    host = np.vstack([rows, xp.round_host(b)[None]]) if has_bias else rows
    vec = (xp.asarray(w), xp.asarray(b)) if has_bias else xp.asarray(w)
    return vec, host.reshape(-1)


@pytest.mark.parametrize("case", range(6))
@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_kronecker_blocks_vs_dense(xp, rng, case, damping):
    name, ctor, a, g, kshape, bias, c, k = kron_cases(rng)[case]
    ah, gh = xp.round_host(a), xp.round_host(g)
    block = ctor(xp.asarray(a), xp.asarray(g), damping)
    xp.assert_close(block.full_fisher_block(), c * np.kron(mat(ah), mat(gh)))
    m = tf_damped_dense(ah, gh, damping, c, k)
    for power in POWERS:
        vec, vh = make_vector(xp, rng, kshape, bias)
        out = block.multiply_matpower(vec, power)
        parts = out if isinstance(out, tuple) else (out,)
        for p_ in parts:
            xp.check(p_)
        assert type(out) is type(vec)
        assert_allclose_normwise(flat(xp, out), dense_power(m, power) @ vh, xp.rtol)
    # TF's damping property is the normalised damping λ/k
    assert block.damping == pytest.approx(damping if k is None else damping / k)


def test_pi_off_and_pi_functions(xp, rng):
    a, g = random_spd(rng, 5, 0.5, 2.0), random_spd(rng, 3, 0.5, 4.0)
    A, G = xp.asarray(a), xp.asarray(g)
    ah, gh = xp.round_host(a), xp.round_host(g)
    pi = np.sqrt((np.trace(ah) / 5) / (np.trace(gh) / 3))
    assert float(T.compute_pi_tracenorm(A, G)) == pytest.approx(pi, rel=xp.rtol)
    da, dg = T.compute_pi_adjusted_damping(A, G, 0.5)
    assert (float(da), float(dg)) == pytest.approx((0.5 * pi, 0.5 / pi), rel=xp.rtol)
    assert T.compute_pi_adjusted_damping(A, G, 0.5, pi_type="off") == (0.5, 0.5)
    zero = xp.asarray(np.zeros((3, 3)))
    assert float(T.compute_pi_tracenorm(A, zero)) == 1.0
    assert blocks.normalize_damping(0.9, 3) == pytest.approx(0.3)
    with pytest.raises(KFACValueError, match="pi_type must be one of"):
        T.compute_pi_adjusted_damping(A, G, 0.5, pi_type="trace")
    block = T.FullyConnectedKFACBasicFB(A, G, 0.25, has_bias=True, pi_type="off")
    vec, vh = make_vector(xp, rng, (4, 3), True)
    m = tf_damped_dense(ah, gh, 0.25, pi_type="off")
    assert_allclose_normwise(flat(xp, block.multiply_inverse(vec)), np.linalg.solve(m, vh),
                             xp.rtol)
    assert tuple(map(float, block.factor_dampings())) == pytest.approx((0.5, 0.5))
    # kfac-jax's norms as pi_type: π = sqrt(‖A‖/‖G‖) with numpy's norms (independent oracle),
    # and π = 1 when a factor norm is zero.
    norms = {
        "avg_fro": lambda m: np.linalg.norm(m, "fro") / np.sqrt(m.shape[0]),
        "2_norm": lambda m: np.linalg.eigvalsh(m).max(),
        "1_norm": lambda m: np.abs(m).sum(0).max(),
    }
    for name, nrm in norms.items():
        p = np.sqrt(nrm(ah) / nrm(gh))
        got = T.compute_pi_adjusted_damping(A, G, 0.5, pi_type=name)
        assert tuple(map(float, got)) == pytest.approx((0.5 * p, 0.5 / p), rel=xp.rtol)
        got_zero = T.compute_pi_adjusted_damping(A, zero, 0.5, pi_type=name)
        assert tuple(map(float, got_zero)) == (0.5, 0.5)


@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_diagonal_and_full_blocks_vs_dense(xp, rng, damping):
    d = rng.uniform(0.5, 2.0, (4, 3))
    dh = xp.round_host(d)
    fc = T.FullyConnectedDiagonalFB(xp.asarray(d), damping, has_bias=True)
    conv = T.ConvDiagonalFB(xp.asarray(d), damping, (1, 3, 1, 3), has_bias=True,
                            num_locations=4)
    conv_rho = T.ConvDiagonalFB(xp.asarray(d), damping, (1, 3, 1, 3), has_bias=True,
                                num_locations=4, normalize_damping_power=0.5)
    naive = T.NaiveDiagonalFB(xp.asarray(d.reshape(-1)), damping, [(3, 3), (3,)])
    full = random_spd(rng, 12, 0.5, 2.0)
    fb = T.FullFB(xp.asarray(full), damping, [(3, 3), (3,)])
    xp.assert_close(fc.full_fisher_block(), np.diag(dh.reshape(-1)))
    xp.assert_close(fb.full_fisher_block(), xp.round_host(full))
    for power in POWERS:
        vec, vh = make_vector(xp, rng, (3, 3), True)
        exp_diag = (dh.reshape(-1) + damping) ** power * vh
        for blk in (fc, naive):
            assert_allclose_normwise(flat(xp, blk.multiply_matpower(vec, power)), exp_diag,
                                     xp.rtol)
        cvec = (xp.xp.reshape(vec[0], (1, 3, 1, 3)), vec[1])
        assert_allclose_normwise(flat(xp, conv.multiply_matpower(cvec, power)), exp_diag,
                                 xp.rtol)
        # ρ = 1/2: damping |T|·λ/|T|^½ = 2λ
        assert_allclose_normwise(flat(xp, conv_rho.multiply_matpower(cvec, power)),
                                 (dh.reshape(-1) + 2 * damping) ** power * vh, xp.rtol)
        expected = dense_power(xp.round_host(full) + damping * np.eye(12), power) @ vh
        assert_allclose_normwise(flat(xp, fb.multiply_matpower(vec, power)), expected, xp.rtol)


def test_from_data_constructors(xp, rng):
    """from_data builds the factors through kfac_ref.factors; check against explicit sums."""
    a = rng.standard_normal((10, 3))
    g = rng.standard_normal((10, 2))
    ah, gh = xp.round_host(a), xp.round_host(g)
    abar = np.hstack([ah, np.ones((10, 1))])
    blk = T.FullyConnectedKFACBasicFB.from_data(xp.asarray(a), xp.asarray(g), 0.1, has_bias=True)
    xp.assert_close(blk.full_fisher_block(), np.kron(abar.T @ abar / 10, gh.T @ gh / 10))
    diag = T.FullyConnectedDiagonalFB.from_data(xp.asarray(a), xp.asarray(g), 0.1, True)
    xp.assert_close(diag.full_fisher_block(),
                    np.diag(((abar**2).T @ (gh**2) / 10).reshape(-1)))
    grads = (rng.standard_normal((3, 2)), rng.standard_normal(2))
    nf = T.NaiveFullFB.from_grads(tuple(xp.asarray(v) for v in grads), 10, 0.2)
    gv = np.concatenate([xp.round_host(v).reshape(-1) for v in grads])
    xp.assert_close(nf.full_fisher_block(), np.outer(gv, gv) / 10)
    nd = T.NaiveDiagonalFB.from_grads(tuple(xp.asarray(v) for v in grads), 10, 0.2)
    xp.assert_close(nd.full_fisher_block(), np.diag(gv**2 / 10))
    # conv: |T| from the geometry, factors normalised by N·|T|
    x = rng.standard_normal((3, 4, 4, 1))
    dy = rng.standard_normal((3, 3, 3, 2))
    cb = T.ConvKFCBasicFB.from_data(xp.asarray(x), xp.asarray(dy), 0.3, (2, 2, 1, 2), "VALID",
                                    has_bias=True)
    assert cb.num_locations == 9 and cb.renorm_coeff == 9.0
    assert cb.damping == pytest.approx(0.3 / 9)
    xh, dyh = xp.round_host(x), xp.round_host(dy)
    rows = np.array([np.append(xh[n, i:i + 2, j:j + 2, 0].reshape(-1), 1.0)
                     for n in range(3) for i in range(3) for j in range(3)])
    om = rows.T @ rows / 27
    ga = dyh.reshape(-1, 2).T @ dyh.reshape(-1, 2) / 27
    xp.assert_close(cb.full_fisher_block(), 9 * np.kron(om, ga))
    # a gradient on another grid (or with other channels) would give Γ normalised by a |T|
    # other than the block's 9: rejected before computing
    for bad in ((3, 4, 4, 2), (3, 3, 3, 3), (3, 1, 9, 2)):
        with pytest.raises(KFACValueError, match=_WRONG_OUTPUT_GRID):
            T.ConvKFCBasicFB.from_data(xp.asarray(x), xp.asarray(np.ones(bad)), 0.3,
                                       (2, 2, 1, 2), "VALID", has_bias=True)
    # embedding: diagonal input factor of id frequencies
    ids = np.array([0, 2, 2, 3, 0])
    ge = rng.standard_normal((5, 2))
    eb = T.EmbeddingKFACFB.from_data(xp.asarray(ids), xp.asarray(ge), 4, 0.1)
    geh = xp.round_host(ge)
    xp.assert_close(eb.full_fisher_block(),
                    np.kron(np.diag([2, 0, 2, 1]) / 5, geh.T @ geh / 5))


@pytest.mark.parametrize("option", [1, 2])
def test_series_block_vs_dense_system(xp, rng, option):
    """FullyConnectedSeriesFB against F_T (option 1, signed eigenvalues) and F_∞ (option 2)
    built densely from the damped statistics (Martens, Ba & Johnson 2018)."""
    steps, batch, lam = 5, 30, 0.2
    xa = ar1_series(rng, steps, batch, 2)
    xg = ar1_series(rng, steps, batch, 2)
    stats = []
    for x, bias in ((xa, True), (xg, False)):
        f = x.reshape(steps * batch, -1)
        if bias:
            f = np.hstack([f, np.ones((f.shape[0], 1))])
        c0 = f.T @ f / (steps * batch)
        c1 = f[batch:].T @ f[:-batch] / (steps * batch)
        stats.append((c0, c1))
    (a0, a1), (g0, g1) = stats
    block = T.FullyConnectedSeriesFB(xp.asarray(a0), xp.asarray(g0), lam, steps, has_bias=True,
                                     option=option, input_cov_dt1=xp.asarray(a1),
                                     output_cov_dt1=xp.asarray(g1), option1_eig_method="eigh")
    a0, a1, g0, g1 = (xp.round_host(v) for v in (a0, a1, g0, g1))
    pi = np.sqrt((np.trace(a0) / 3) / (np.trace(g0) / 2))
    d = np.sqrt(lam / steps)
    a0d, g0d = a0 + pi * d * np.eye(3), g0 + d / pi * np.eye(2)
    v0 = np.kron(a0d, g0d)
    if option == 1:
        v1 = np.kron((a1 + a1.T) / 2, (g1 + g1.T) / 2)
        psi = v1 @ np.linalg.inv(v0)
        f = steps * v0
        for k in range(1, steps):
            pk = np.linalg.matrix_power(psi, k)
            f = f + (steps - k) * (pk @ v0 + v0 @ pk.T)
    else:
        pk = np.kron(a1.T @ np.linalg.inv(a0d), g1.T @ np.linalg.inv(g0d))
        ip = np.linalg.inv(np.eye(6) - pk)
        f = steps * ip @ (v0 - pk @ v0 @ pk.T) @ ip.T
    vec, vh = make_vector(xp, rng, (2, 2), True)
    got = block.multiply_inverse(vec)
    # float32 statistics rounded once: error ~ n·eps·κ(F) with n = 6, κ(F) < 1e2, below the
    # fixture's 4096·eps (measured: within xp.rtol / 20).
    rtol = xp.rtol
    assert_allclose_normwise(flat(xp, got), np.linalg.solve(f, vh), rtol)
    with pytest.raises(KFACValueError, match="exp must be -1"):
        block.multiply_matpower(vec, 0.5)
    with pytest.raises(KFACValueError, match="no Kronecker form"):
        block.full_fisher_block()


def test_series_block_from_factor_objects(xp, rng):
    """TF-named multi-use factors feed the series block (get_cov / get_cov_dt1)."""
    from kfac_ref.factors import FullyConnectedMultiKF

    steps, batch = 4, 8
    xa = xp.asarray(ar1_series(rng, steps, batch, 2))
    xg = xp.asarray(ar1_series(rng, steps, batch, 2))
    fa = FullyConnectedMultiKF(steps, has_bias=True).register_cov_dt1()
    fg = FullyConnectedMultiKF(steps).register_cov_dt1()
    fa = fa.update_cov(xa, ema_decay=0.0)
    fg = fg.update_cov(xg, ema_decay=0.0)
    block = T.FullyConnectedSeriesFB(fa, fg, 0.1, steps, has_bias=True)
    ref = T.FullyConnectedSeriesFB(fa.get_cov(), fg.get_cov(), 0.1, steps, has_bias=True,
                                   input_cov_dt1=fa.get_cov_dt1(),
                                   output_cov_dt1=fg.get_cov_dt1())
    vec, _ = make_vector(xp, rng, (2, 2), True)
    xp.assert_close(block.multiply_inverse(vec)[0], xp.to_numpy(ref.multiply_inverse(vec)[0]))


def test_bad_inputs(xp, rng):
    a, g = xp.asarray(random_spd(rng, 5)), xp.asarray(random_spd(rng, 3))
    block = T.FullyConnectedKFACBasicFB(a, g, 0.1, has_bias=True)
    w = xp.asarray(np.ones((4, 3)))
    with pytest.raises(KFACValueError, match="parameter shapes"):
        block.multiply(w)  # bias missing
    with pytest.raises(KFACValueError, match="parameter shapes"):
        block.multiply((xp.asarray(np.ones((3, 4))), xp.asarray(np.ones(3))))
    with pytest.raises(KFACTypeError, match="kernel array or a"):
        block.multiply([w, w, w])
    with pytest.raises(KFACValueError, match="kernel_shape"):
        T.ConvKFCBasicFB(a, g, 0.1, (2, 2, 2, 3), num_locations=4, has_bias=True)
    with pytest.raises(KFACValueError, match="pi_type must be one of"):
        T.FullyConnectedKFACBasicFB(a, g, 0.1, has_bias=True, pi_type="frobenius")
    with pytest.raises(KFACValueError, match="damping must be non-negative"):
        T.FullyConnectedKFACBasicFB(a, g, -0.1, has_bias=True)
    with pytest.raises(KFACTypeError, match="get_cov"):
        T.FullyConnectedKFACBasicFB("A", g, 0.1)
    with pytest.raises(KFACValueError, match="cov_dt1 must be given"):
        T.FullyConnectedSeriesFB(a, g, 0.1, 3, has_bias=True)
    with pytest.raises(KFACValueError, match="option1_eig_method must be one of"):
        T.FullyConnectedSeriesFB(a, g, 0.1, 3, True, 1, input_cov_dt1=a, output_cov_dt1=g,
                                 option1_eig_method="qr")
    with pytest.raises(KFACValueError, match="option must be 1 or 2"):
        T.FullyConnectedSeriesFB(a, g, 0.1, 3, True, 3, input_cov_dt1=a, output_cov_dt1=g)
    fb = T.FullFB(xp.asarray(np.eye(4)), 0.1, [(4,)])
    with pytest.raises(KFACValueError, match="parameter shapes"):
        fb.multiply(xp.asarray(np.ones(3)))
    nd = T.NaiveDiagonalFB(xp.asarray(np.ones(4)), 0.0)
    with pytest.raises(KFACValueError, match="4 entries"):
        nd.multiply(xp.asarray(np.ones(3)))
    with pytest.raises(KFACValueError, match="positive definite"):
        T.NaiveDiagonalFB(xp.asarray(np.zeros(4)), 0.0).multiply_inverse(xp.asarray(np.ones(4)))
