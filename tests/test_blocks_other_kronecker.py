"""TNT, FOOF and nearest-Kronecker (KPSVD) blocks against their dense definitions, built by
brute force from per-example (per-location) gradient matrices."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import RTOL_FACTOR, assert_allclose_normwise

from kfac_ref import KFACTypeError, KFACValueError, nn
from kfac_ref.blocks import kfac_jax as kj

N = 24
LAM = 0.3


def _fill(xp, block, data, batch=N, **init_kw):
    st = block.init(xp.asarray(np.zeros(1)), **init_kw)
    return block.update_curvature_matrix_estimate(
        st, {k: xp.asarray(v) for k, v in data.items()}, 0.0, 1.0, batch)


def _homog(a, has_bias):
    return np.hstack([a, np.ones((a.shape[0], 1))]) if has_bias else a


def _flat(xp, vec):
    return np.concatenate([xp.to_numpy(v).reshape(-1) for v in vec])


def _vector(xp, rng, block):
    host = [rng.standard_normal(s) for s in block.parameters_shapes]
    return (tuple(xp.asarray(h) for h in host),
            np.concatenate([xp.round_host(h).reshape(-1) for h in host]))


def _pi_damped(a, g, s, lam):
    """π-damped Kronecker block (trace-norm π) from its factors: the oracle of the
    approximate products."""
    pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
    r = np.sqrt(lam / s)
    return s * np.kron(a + pi * r * np.eye(a.shape[0]), g + r / pi * np.eye(g.shape[0]))


def _check_products(xp, rng, block, state, dense_block, a, g, s):
    """Exact inverse against a dense solve of the damped dense block; approximate inverse
    against the π-damped factors; the block's own dense matrix against the definition."""
    xp.assert_close(block.to_dense_matrix(state), dense_block)
    vec, vh = _vector(xp, rng, block)
    out = block.multiply_inverse(state, vec, LAM, True, False)
    for o in out:
        xp.check(o)
    exact = np.linalg.solve(dense_block + LAM * np.eye(block.dim), vh)
    assert_allclose_normwise(_flat(xp, out), exact, xp.rtol)
    out = block.multiply_inverse(state, vec, LAM, False, False)
    assert_allclose_normwise(_flat(xp, out), np.linalg.solve(_pi_damped(a, g, s, LAM), vh),
                             xp.rtol)


# --------------------------------------------------------------------------------------
# TNT
# --------------------------------------------------------------------------------------
def _tnt_oracle(grads):
    """(A, G, s) from gradient matrices [M, d_in, d_out]: E[∇W∇Wᵀ], E[∇Wᵀ∇W], tnt scale."""
    m = grads.shape[0]
    a = sum(grads[i] @ grads[i].T for i in range(m)) / m
    g = sum(grads[i].T @ grads[i] for i in range(m)) / m
    return a, g, 1.0 / np.sqrt(np.trace(a) * np.trace(g))


@pytest.mark.parametrize("has_bias", [True, False])
def test_dense_tnt_vs_per_example_gradients(xp, rng, has_bias):
    x, dy = rng.standard_normal((N, 3)), rng.standard_normal((N, 2))
    block = kj.DenseTNT(3, 2, has_bias=has_bias)
    state = _fill(xp, block, {"inputs": x, "outputs_grad": dy})
    xa, gh = _homog(xp.round_host(x), has_bias), xp.round_host(dy)
    grads = np.einsum("ni,nj->nij", xa, gh)  # per-example ∇W_n of [W; b]
    a, g, s = _tnt_oracle(grads)
    xp.assert_close(state.statistics[0].value, a)
    xp.assert_close(state.statistics[1].value, g)
    assert_allclose_normwise(np.asarray(xp.to_numpy(block.scale(state))), s, xp.rtol)
    _check_products(xp, rng, block, state, s * np.kron(a, g), a, g, s)
    # the scale makes the trace that of the exact empirical block E[vec ∇W vec ∇Wᵀ]
    flat = grads.reshape(N, -1)
    assert_allclose_normwise(np.trace(xp.to_numpy(block.to_dense_matrix(state))),
                             np.trace(flat.T @ flat / N), xp.rtol)


def _patches(x, kh, kw):
    """[N, |T|, kh·kw·C] VALID stride-1 NHWC patches (HWIO order), by loops."""
    n, h, w, _ = x.shape
    rows = [[x[i, r:r + kh, c:c + kw, :].reshape(-1) for r in range(h - kh + 1)
             for c in range(w - kw + 1)] for i in range(n)]
    return np.array(rows)


@pytest.mark.parametrize("per_location", [True, False])
def test_conv_tnt_vs_per_location_gradients(xp, rng, per_location):
    x, dy = rng.standard_normal((N, 3, 3, 1)), rng.standard_normal((N, 2, 2, 2))
    block = kj.Conv2DTNT((N, 3, 3, 1), (2, 2, 1, 2), weighting_per_location=per_location)
    state = _fill(xp, block, {"inputs": x, "outputs_grad": dy})
    p = _patches(xp.round_host(x), 2, 2)
    p = np.concatenate([p, np.ones(p.shape[:2] + (1,))], axis=2)  # [N, T, K + 1]
    gl = xp.round_host(dy).reshape(N, 4, 2)
    grads = np.einsum("nti,ntj->ntij", p, gl)  # per-location ∇W_{n,t}
    if per_location:
        a, g, s = _tnt_oracle(grads.reshape(N * 4, 5, 2))
    else:  # per-example squared norms, location-independent factors
        wg = (gl**2).sum(axis=(1, 2))
        wp = (p**2).sum(axis=(1, 2))
        a = np.einsum("n,nti,ntj->ij", wg, p, p) / (N * 4)
        g = np.einsum("n,nti,ntj->ij", wp, gl, gl) / (N * 4)
        s = 1.0 / np.sqrt(np.trace(a) * np.trace(g))
    xp.assert_close(state.statistics[0].value, a)
    xp.assert_close(state.statistics[1].value, g)
    _check_products(xp, rng, block, state, 4 * s * np.kron(a, g), a, g, 4 * s)


def test_tnt_scale_zero_factor_and_cache(xp, rng):
    z = xp.asarray(np.zeros((3, 3)))
    one = xp.asarray(np.eye(2))
    assert float(xp.to_numpy(kj.tnt_scale(z, one))) == 1.0
    a = rng.standard_normal((5, 3))
    assert_allclose_normwise(np.asarray(xp.to_numpy(kj.tnt_scale(xp.asarray(a.T @ a), one))),
                             1 / np.sqrt(np.trace(xp.round_host(a).T @ xp.round_host(a)) * 2),
                             xp.rtol)
    # cached products run the same code with the snapshot's scale
    block = kj.DenseTNT(3, 2)
    state = _fill(xp, block, {"inputs": rng.standard_normal((N, 3)),
                              "outputs_grad": rng.standard_normal((N, 2))},
                  exact_powers_to_cache=[-1.0], approx_powers_to_cache=[-1.0])
    state = block.update_cache(state, LAM, [-1.0], [-1.0], False)
    vec, _ = _vector(xp, rng, block)
    for exact in (True, False):
        assert_allclose_normwise(
            _flat(xp, block.multiply_inverse(state, vec, LAM, exact, True)),
            _flat(xp, block.multiply_inverse(state, vec, LAM, exact, False)), xp.rtol)


def test_tnt_from_output_vectors_is_the_average(xp, rng):
    """C back-propagated vectors: the statistics of the C-sample average."""
    layer = nn.Dense(3, 2)
    x = rng.standard_normal((N, 3))
    gs = [rng.standard_normal((N, 2)) for _ in range(2)]
    for block in (kj.DenseTNT(3, 2), kj.Conv2DTNT((N, 3, 3, 1), (2, 2, 1, 2))):
        if isinstance(block, kj.Conv2DTNT):
            layer, x = nn.Conv2D(1, 2, (2, 2)), rng.standard_normal((N, 3, 3, 1))
            gs = [rng.standard_normal((N, 2, 2, 2)) for _ in range(2)]
        st = block.init(xp.asarray(np.zeros(1)))
        st = block.update_from_output_vectors(st, layer, xp.asarray(x),
                                              [xp.asarray(g) for g in gs], N, "expand",
                                              0.0, 1.0)
        singles = [_fill(xp, block, {"inputs": x, "outputs_grad": g}) for g in gs]
        for i in range(2):
            expected = sum(xp.to_numpy(s.statistics[i].value) for s in singles) / 2
            xp.assert_close(st.statistics[i].value, expected)


# --------------------------------------------------------------------------------------
# FOOF
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("has_bias", [True, False])
def test_foof_vs_dense_definition(xp, rng, has_bias):
    x, dy = rng.standard_normal((N, 3)), rng.standard_normal((N, 2))
    block = kj.DenseFOOF(3, 2, has_bias=has_bias)
    state = _fill(xp, block, {"inputs": x, "outputs_grad": dy})
    xa = _homog(xp.round_host(x), has_bias)
    a = xa.T @ xa / N
    xp.assert_close(state.statistics[1].value, np.eye(2))
    _check_products(xp, rng, block, state, np.kron(a, np.eye(2)), a, np.eye(2), 1.0)
    # the update (A + λI)⁻¹ X on the [W; b] matrix X: FOOF's gradient-descent-on-neurons step
    vec, vh = _vector(xp, rng, block)
    out = block.multiply_inverse(state, vec, LAM, True, False)
    mat = vh.reshape(a.shape[0], 2)
    assert_allclose_normwise(_flat(xp, out),
                             np.linalg.solve(a + LAM * np.eye(a.shape[0]), mat).reshape(-1),
                             xp.rtol)


@pytest.mark.parametrize("has_bias", [True, False])
def test_conv_foof_vs_dense_definition(xp, rng, has_bias):
    """|T| Ω ⊗ I from looped patches; the update (|T|Ω + λI)⁻¹ X on the kernel matrix."""
    x, dy = rng.standard_normal((N, 3, 3, 1)), rng.standard_normal((N, 2, 2, 2))
    block = kj.Conv2DFOOF((N, 3, 3, 1), (2, 2, 1, 2), has_bias=has_bias)
    state = _fill(xp, block, {"inputs": x, "outputs_grad": dy})
    p = _patches(xp.round_host(x), 2, 2).reshape(N * 4, 4)  # [N|T|, K]
    p = _homog(p, has_bias)
    omega = p.T @ p / (N * 4)
    xp.assert_close(state.statistics[0].value, omega)
    xp.assert_close(state.statistics[1].value, np.eye(2))
    assert block.fixed_scale() == 4.0
    _check_products(xp, rng, block, state, 4 * np.kron(omega, np.eye(2)), omega, np.eye(2),
                    4.0)
    vec, vh = _vector(xp, rng, block)
    out = block.multiply_inverse(state, vec, LAM, True, False)
    k = omega.shape[0]
    assert_allclose_normwise(
        _flat(xp, out),
        np.linalg.solve(p.T @ p / N + LAM * np.eye(k), vh.reshape(k, 2)).reshape(-1), xp.rtol)


@pytest.mark.parametrize("has_bias", [True, False])
def test_conv_foof_reduce_vs_dense_definition(xp, rng, has_bias):
    """weight_sharing="reduce": (1/N Σ_n p̄̄ p̄̄ᵀ) ⊗ I of the location-averaged patches."""
    layer = nn.Conv2D(1, 2, (2, 2), use_bias=has_bias)
    block = kj.Conv2DFOOF.from_layer(layer, (N, 3, 3, 1), weight_sharing="reduce")
    assert type(block) is kj.ReducedConv2DFOOF and block.fixed_scale() == 1.0
    assert type(kj.ReducedConv2DFOOF.from_layer(layer, (N, 3, 3, 1))) is kj.ReducedConv2DFOOF
    x, dy = rng.standard_normal((N, 3, 3, 1)), rng.standard_normal((N, 2, 2, 2))
    data, rows = block.layer_estimation_data(layer, xp.asarray(x), xp.asarray(dy), None, N)
    state = block.update_curvature_matrix_estimate(block.init(xp.asarray(np.zeros(1))), data,
                                                   0.0, 1.0, rows)
    pm = _homog(_patches(xp.round_host(x), 2, 2).mean(axis=1), has_bias)  # [N, K (+1)]
    a = pm.T @ pm / N
    _check_products(xp, rng, block, state, np.kron(a, np.eye(2)), a, np.eye(2), 1.0)


# --------------------------------------------------------------------------------------
# Nearest Kronecker product (KPSVD)
# --------------------------------------------------------------------------------------
def _rearranged(f, m, n):
    """Van Loan–Pitsianis rearrangement: R(A ⊗ G) = vec A vec Gᵀ for A m×m, G n×n."""
    return f.reshape(m, n, m, n).transpose(0, 2, 1, 3).reshape(m * m, n * n)


def _empirical(a, g):
    rows = np.einsum("ni,nj->nij", a, g).reshape(a.shape[0], -1)
    return rows.T @ rows / a.shape[0]


def _svd_oracle(f, m, n):
    u, s, vt = np.linalg.svd(_rearranged(f, m, n))
    return s[0] * np.outer(u[:, 0], vt[0]), s


@pytest.mark.parametrize("has_bias", [True, False])
def test_kpsvd_vs_svd_of_rearranged_matrix(xp, rng, has_bias):
    x, dy = rng.standard_normal((N, 3)), rng.standard_normal((N, 2))
    block = kj.DenseKPSVD(3, 2, has_bias=has_bias, power_iterations=100)
    state = _fill(xp, block, {"inputs": x, "outputs_grad": dy})
    xa, gh = _homog(xp.round_host(x), has_bias), xp.round_host(dy)
    m = xa.shape[1]
    best, sv = _svd_oracle(_empirical(xa, gh), m, 2)
    # power iteration on R Rᵀ: error ∝ (σ₂/σ₁)^(2k), below 0.8^200 ≈ 4e-20 for k = 100
    assert sv[1] < 0.8 * sv[0], "test data must have a spectral gap"
    a, g = (xp.to_numpy(f.value) for f in state.statistics)
    assert_allclose_normwise(np.outer(a.reshape(-1), g.reshape(-1)), best, xp.rtol)
    assert_allclose_normwise(np.linalg.norm(a), np.linalg.norm(g), xp.rtol)
    for f in (a, g):
        assert np.linalg.eigvalsh(f).min() >= -xp.rtol * np.abs(f).max()
    _check_products(xp, rng, block, state, np.kron(a, g), a, g, 1.0)


def test_kpsvd_recovers_an_exact_kronecker_product(xp, rng):
    """A batch of all (a_i, g_j) pairs has F = E[aaᵀ] ⊗ E[ggᵀ]: one step recovers it."""
    ai, gj = rng.standard_normal((4, 3)), rng.standard_normal((5, 2))
    a = np.repeat(ai, 5, axis=0)
    g = np.tile(gj, (4, 1))
    af, gf = kj.nearest_kronecker_factors(xp.asarray(a), xp.asarray(g), iterations=1)
    ah, gh = xp.round_host(ai), xp.round_host(gj)
    exact = np.kron(ah.T @ ah / 4, gh.T @ gh / 5)
    xp.check(af)
    xp.check(gf)
    assert_allclose_normwise(np.kron(xp.to_numpy(af), xp.to_numpy(gf)), exact, xp.rtol)


def test_kpsvd_is_nearer_than_kfac(xp, rng):
    x, dy = rng.standard_normal((N, 3)), rng.standard_normal((N, 2))
    data = {"inputs": x, "outputs_grad": dy}
    kp, kf = kj.DenseKPSVD(3, 2), kj.DenseTwoKroneckerFactored(3, 2)
    f = _empirical(_homog(xp.round_host(x), True), xp.round_host(dy))
    err = [np.linalg.norm(f - xp.to_numpy(b.to_dense_matrix(_fill(xp, b, data))))
           for b in (kp, kf)]
    assert err[0] <= err[1]
    # and the optimum: no rank-1 of R(F) is nearer than the SVD's
    best, sv = _svd_oracle(f, 4, 2)
    assert_allclose_normwise(err[0], np.sqrt(np.sum(sv[1:] ** 2)), xp.rtol)


def test_kpsvd_from_output_vectors_is_nearest_to_the_average(xp, rng):
    layer = nn.Dense(3, 2)
    x = rng.standard_normal((N, 3))
    gs = [rng.standard_normal((N, 2)) for _ in range(2)]
    block = kj.DenseKPSVD(3, 2, power_iterations=100)
    st = block.init(xp.asarray(np.zeros(1)))
    st = block.update_from_output_vectors(st, layer, xp.asarray(x),
                                          [xp.asarray(g) for g in gs], N, "expand", 0.0, 1.0)
    xa = _homog(xp.round_host(x), True)
    f = sum(_empirical(xa, xp.round_host(g)) for g in gs) / 2
    best, sv = _svd_oracle(f, 4, 2)
    assert sv[1] < 0.8 * sv[0], "test data must have a spectral gap"
    a, g = (xp.to_numpy(s.value) for s in st.statistics)
    assert_allclose_normwise(np.outer(a.reshape(-1), g.reshape(-1)), best, xp.rtol)


# --------------------------------------------------------------------------------------
# Registry and errors
# --------------------------------------------------------------------------------------
def test_registry_names_and_defaults_unchanged():
    assert kj.layer_block("dense", "tnt") is kj.DenseTNT
    assert kj.layer_block("conv2d", "tnt") is kj.Conv2DTNT
    assert kj.layer_block("dense", "foof") is kj.DenseFOOF
    assert kj.layer_block("conv2d", "foof") is kj.Conv2DFOOF
    assert kj.layer_block("dense", "kpsvd") is kj.DenseKPSVD
    defaults = kj.default_layer_to_block()
    assert defaults["dense"] is kj.DenseTwoKroneckerFactored
    assert defaults["conv2d"] is kj.Conv2DTwoKroneckerFactored
    block = kj.DenseTNT.from_layer(nn.Dense(3, 2), (N, 5, 3))
    assert isinstance(block, kj.DenseTNT) and block.fixed_scale() == 5.0


def test_bad_inputs(xp, rng):
    with pytest.raises(KFACValueError, match=r"Conv2DTNT.from_layer: weight_sharing must be "
                                             r"'expand'.*got 'reduce'"):
        kj.Conv2DTNT.from_layer(nn.Conv2D(1, 2, (2, 2)), (N, 3, 3, 1), weight_sharing="reduce")
    with pytest.raises(KFACTypeError, match="Conv2DTNT: weighting_per_location must be"):
        kj.Conv2DTNT((N, 3, 3, 1), (2, 2, 1, 2), weighting_per_location="yes")
    with pytest.raises(KFACValueError, match="DenseKPSVD: power_iterations must be"):
        kj.DenseKPSVD(3, 2, power_iterations=0)
    a, g = xp.asarray(rng.standard_normal((4, 3))), xp.asarray(rng.standard_normal((5, 2)))
    with pytest.raises(KFACValueError, match="nearest_kronecker_factors: outputs_grads must"):
        kj.nearest_kronecker_factors(a, g)
    with pytest.raises(KFACValueError, match="tnt_scale: a must"):
        kj.tnt_scale(xp.asarray(np.zeros(3)), xp.asarray(np.eye(2)))
    with pytest.raises(KFACValueError, match=r"DenseTNT.update_curvature_matrix_estimate: "
                                             r"inputs must"):
        _fill(xp, kj.DenseTNT(3, 2), {"inputs": rng.standard_normal((N, 4)),
                                      "outputs_grad": rng.standard_normal((N, 2))})


@pytest.mark.parametrize("name,cls", [("tnt", kj.DenseTNT), ("foof", kj.DenseFOOF),
                                      ("kpsvd", kj.DenseKPSVD)])
def test_estimator_uses_the_registered_family(name, cls):
    """BlockDiagonalCurvature with layer_to_block naming the family: its blocks, and its
    damped inverse is each block's dense damped solve."""
    from kfac_ref.curvature import BlockDiagonalCurvature
    from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss

    rng = np.random.default_rng(3)
    net = nn.Sequential([("d1", nn.Dense(3, 4)), ("a", nn.Activation("tanh")),
                         ("d2", nn.Dense(4, 3))])
    params = net.init_params(rng, np.zeros(1))
    batch = (rng.standard_normal((6, 3)), rng.integers(0, 3, size=6))
    est = BlockDiagonalCurvature(
        net, lambda f, y: CategoricalLogitsNegativeLogProbLoss(f, targets=y),
        layer_to_block={"dense": name})
    st = est.init(None, (params, batch))
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, 6, None, (params, batch),
                                              "ggn_exact")
    assert [type(b) for b in est.blocks] == [cls, cls]
    v = rng.standard_normal(est.dim)
    out = np.asarray(est.multiply_matpower(st, v, 0.5, -1.0, True, False))
    start = 0
    for blk, bst in zip(est.blocks, st.blocks_states, strict=True):
        dense = np.asarray(blk.to_dense_matrix(bst)) + 0.5 * np.eye(blk.dim)
        seg = slice(start, start + blk.dim)
        assert_allclose_normwise(out[seg], np.linalg.solve(dense, v[seg]),
                                 RTOL_FACTOR * np.finfo(np.float64).eps)
        start += blk.dim


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_estimator_conv_foof(sharing):
    """layer_to_block={"conv2d": "foof"}: the conv block (its Ω from the layer's forward tap
    with "expand") is |T| Ω ⊗ I, or the pooled patches' moment ⊗ I with "reduce"."""
    from kfac_ref.curvature import BlockDiagonalCurvature
    from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss

    rng = np.random.default_rng(5)
    net = nn.Sequential([("c", nn.Conv2D(1, 2, (2, 2))), ("a", nn.Activation("tanh")),
                         ("f", nn.Flatten()), ("d", nn.Dense(8, 3))])
    x = rng.standard_normal((6, 3, 3, 1))
    params = net.init_params(rng, x)
    batch = (x, rng.integers(0, 3, size=6))
    est = BlockDiagonalCurvature(
        net, lambda f, y: CategoricalLogitsNegativeLogProbLoss(f, targets=y),
        layer_to_block={"conv2d": "foof"}, weight_sharing=sharing)
    st = est.init(None, (params, batch))
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, 6, None, (params, batch),
                                              "ggn_exact")
    want = kj.Conv2DFOOF if sharing == "expand" else kj.ReducedConv2DFOOF
    assert type(est.blocks[0]) is want
    p = _homog(_patches(x, 2, 2).reshape(24, 4), True).reshape(6, 4, 5)
    if sharing == "expand":
        expected = np.kron(np.einsum("nti,ntj->ij", p, p) / 6, np.eye(2))
    else:
        expected = np.kron(p.mean(axis=1).T @ p.mean(axis=1) / 6, np.eye(2))
    assert_allclose_normwise(np.asarray(est.blocks[0].to_dense_matrix(st.blocks_states[0])),
                             expected, RTOL_FACTOR * np.finfo(np.float64).eps)


@pytest.mark.parametrize("reduction", ["per_source", "summed"])
def test_naive_tnt_vs_dense_definition(xp, rng, reduction):
    kern, bias = rng.standard_normal((3, 3, 2)), rng.standard_normal((3, 2))  # 3 sources
    block = kj.NaiveTNT([(3, 2), (2,)], source_reduction=reduction)
    st = block.init(xp.asarray(np.zeros(1)))
    st = block.update_curvature_matrix_estimate(
        st, {"params_grads": (xp.asarray(kern), xp.asarray(bias))}, 0.0, 1.0, N)
    mats = np.concatenate([xp.round_host(kern), xp.round_host(bias)[:, None, :]], axis=1)
    if reduction == "summed":
        mats = mats.sum(axis=0, keepdims=True)
    a = sum(m @ m.T for m in mats) / N
    g = sum(m.T @ m for m in mats) / N
    s = 1.0 / np.sqrt(np.trace(a) * np.trace(g))
    xp.assert_close(st.statistics[0].value, a)
    xp.assert_close(st.statistics[1].value, g)
    _check_products(xp, rng, block, st, s * np.kron(a, g), a, g, s)


def test_naive_tnt_on_per_example_gradients_is_dense_tnt(xp, rng):
    x, dy = rng.standard_normal((N, 3)), rng.standard_normal((N, 2))
    dense = _fill(xp, kj.DenseTNT(3, 2), {"inputs": x, "outputs_grad": dy})
    naive = kj.NaiveTNT([(3, 2), (2,)])
    st = naive.init(xp.asarray(np.zeros(1)))
    per_example = (np.einsum("ni,nj->nij", x, dy), dy)
    st = naive.update_curvature_matrix_estimate(
        st, {"params_grads": tuple(xp.asarray(v) for v in per_example)}, 0.0, 1.0, N)
    for got, want in zip(st.statistics, dense.statistics, strict=True):
        xp.assert_close(got.value, xp.to_numpy(want.value))
    with pytest.raises(KFACValueError, match="NaiveTNT.update_from_output_vectors: the block "
                                             "must read layer inputs"):
        naive.update_from_output_vectors(st, nn.Dense(3, 2), xp.asarray(x), [xp.asarray(dy)],
                                         N, "expand", 0.0, 1.0)


def test_conv_tnt_same_for_nchw_and_nhwc(xp, rng):
    x, dy = rng.standard_normal((N, 3, 3, 1)), rng.standard_normal((N, 2, 2, 2))
    nhwc = _fill(xp, kj.Conv2DTNT((N, 3, 3, 1), (2, 2, 1, 2)), {"inputs": x, "outputs_grad": dy})
    nchw = _fill(xp, kj.Conv2DTNT((N, 1, 3, 3), (2, 2, 1, 2), data_format="NCHW"),
                 {"inputs": x.transpose(0, 3, 1, 2), "outputs_grad": dy.transpose(0, 3, 1, 2)})
    for got, want in zip(nchw.statistics, nhwc.statistics, strict=True):
        xp.assert_close(got.value, xp.to_numpy(want.value))


def test_kpsvd_of_zero_gradients_is_the_damped_identity(xp, rng):
    block = kj.DenseKPSVD(3, 2)
    st = _fill(xp, block, {"inputs": rng.standard_normal((N, 3)),
                           "outputs_grad": np.zeros((N, 2))})
    for f in st.statistics:
        xp.assert_close(f.value, np.zeros(tuple(f.value.shape)))
    vec, vh = _vector(xp, rng, block)
    for exact in (True, False):
        assert_allclose_normwise(_flat(xp, block.multiply_inverse(st, vec, LAM, exact, False)),
                                 vh / LAM, xp.rtol)


def test_more_bad_inputs(xp, rng):
    a, g = xp.asarray(rng.standard_normal((4, 3))), xp.asarray(rng.standard_normal((4, 2)))
    with pytest.raises(KFACValueError, match=r"tnt_scale: g must be a square matrix; got "
                                             r"shape \(4, 2\)"):
        kj.tnt_scale(xp.asarray(np.eye(3)), g)
    with pytest.raises(KFACValueError, match="nearest_kronecker_factors: iterations must"):
        kj.nearest_kronecker_factors(a, g, iterations=0)
    with pytest.raises(KFACTypeError, match="nearest_kronecker_factors: iterations must"):
        kj.nearest_kronecker_factors(a, g, iterations=1.5)
    with pytest.raises(KFACValueError, match="NaiveTNT: source_reduction must be one of"):
        kj.NaiveTNT([(3, 2), (2,)], source_reduction="mean")
    with pytest.raises(KFACValueError, match=r"NaiveTNT.update_curvature_matrix_estimate: "
                                             r"params_grads must be a sequence of 2"):
        block = kj.NaiveTNT([(3, 2), (2,)])
        block.update_curvature_matrix_estimate(block.init(xp.asarray(np.zeros(1))),
                                               {"params_grads": (a,)}, 0.0, 1.0, N)
