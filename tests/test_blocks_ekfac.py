"""EKFAC blocks (George et al. 2018): the facts, against dense oracles built in NumPy from
per-example gradients.

* In the Kronecker eigenbasis :math:`Q = Q_A \\otimes Q_G` the block is diagonal and its
  diagonal is the diagonal of :math:`Q^\\top F Q`, :math:`F` the exact block (dense and conv,
  block level and through BlockDiagonalCurvature for the true and the empirical Fisher).
* It is never further from :math:`F` than K-FAC in Frobenius norm (hypothesis), and
  :math:`\\operatorname{tr} B = \\operatorname{tr} F`.
* With one example it is the exact block's diagonal in that basis (for a dense layer: the
  exact block itself).
* Damping and power identities, cache, eigenvalues, norm, averaging, error paths.

Sizes: 3 output units (a 2×2 factor hides a transposed eigenbasis: LAPACK's 2×2
eigenvector matrix is symmetric), non-square layers (dense 3 → 3 with bias: A 4×4, G 3×3;
conv 2×2×1 → 3: A 5×5, G 3×3).

Tolerances: the oracle computes its own eigenbasis in float64, so the comparison of two
bases adds the eigenvector perturbation :math:`\\|\\delta Q\\| \\lesssim \\varepsilon
\\|A\\| / \\mathrm{gap}(A)` (Davis–Kahan); ``basis_tol`` multiplies ``xp.rtol`` by
:math:`\\max(1, \\|A\\|/\\mathrm{gap}_A, \\|G\\|/\\mathrm{gap}_G)` of the oracle factors.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_allclose_normwise, davis_kahan
from losses_helpers import ce

import kfac_ref.curvature as C
import kfac_ref.nn as nn
from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref.blocks import kfac_jax as kj
from kfac_ref.curvature import BlockDiagonalCurvature

N = 24
CONV_KW = dict(inputs_shape=(N, 3, 3, 1), kernel_shape=(2, 2, 1, 3), strides=1,
               padding="VALID")


# -- NumPy oracles --------------------------------------------------------------------------
def dense_grads(a, g, bias=True):
    """Per-example gradients vec_r([a; 1] gᵀ), [N, (d_in + 1)·d_out]."""
    ab = np.hstack([a, np.ones((a.shape[0], 1))]) if bias else a
    return (ab[:, :, None] * g[:, None, :]).reshape(a.shape[0], -1), ab


def conv_grads(x, g, kh=2, kw=2):
    """Loop oracle (VALID, stride 1, NHWC): patches p_{n,t} (bias 1 last) and
    DW_n = Σ_t p_{n,t} g_{n,t}ᵀ."""
    n_, h, w, c = x.shape
    grads, patches, outs = [], [], []
    for n in range(n_):
        dw = np.zeros((kh * kw * c + 1, g.shape[-1]))
        for i in range(h - kh + 1):
            for j in range(w - kw + 1):
                p = np.append(x[n, i:i + kh, j:j + kw, :].reshape(-1), 1.0)
                dw += np.outer(p, g[n, i, j])
                patches.append(p)
                outs.append(g[n, i, j])
        grads.append(dw.reshape(-1))
    return np.array(grads), np.array(patches), np.array(outs)


def oracle(grads, rows_a, rows_g):
    """(F, A, G, Q, EKFAC) from per-example gradients and the factors' rows."""
    f = grads.T @ grads / grads.shape[0]
    a = rows_a.T @ rows_a / rows_a.shape[0]
    g = rows_g.T @ rows_g / rows_g.shape[0]
    q = np.kron(np.linalg.eigh(a)[1], np.linalg.eigh(g)[1])
    s = np.diag(q.T @ f @ q)
    return f, a, g, q, (q * s) @ q.T


def basis_tol(xp, *factors):
    return xp.rtol * davis_kahan(*factors)


def make(xp, rng, kind, n=N, bias=True):
    """(block, data (backend arrays), oracle (F, A, G, Q, EKFAC) on the rounded host data)."""
    if kind == "dense":
        a, g = rng.standard_normal((n, 3)), rng.standard_normal((n, 3))
        block = kj.DenseEKFAC(3, 3, has_bias=bias)
        a, g = xp.round_host(a), xp.round_host(g)
        grads, ab = dense_grads(a, g, bias)
        orc = oracle(grads, ab, g)
        data = {"inputs": xp.asarray(a), "outputs_grad": xp.asarray(g)}
    else:
        x, g = rng.standard_normal((n, 3, 3, 1)), rng.standard_normal((n, 2, 2, 3))
        block = kj.Conv2DEKFAC(**{**CONV_KW, "inputs_shape": (n, 3, 3, 1)})
        x, g = xp.round_host(x), xp.round_host(g)
        grads, patches, outs = conv_grads(x, g)
        orc = oracle(grads, patches, outs)
        data = {"inputs": xp.asarray(x), "outputs_grad": xp.asarray(g)}
    return block, data, orc


def updated(xp, block, data, n=N, ema_old=0.0, ema_new=1.0, state=None):
    state = block.init(xp.asarray(np.zeros(()))) if state is None else state
    return block.update_curvature_matrix_estimate(state, data, ema_old, ema_new, n)


def flat(xp, vec):
    return np.concatenate([xp.to_numpy(v).reshape(-1) for v in vec])


def random_vector(xp, rng, block):
    return tuple(xp.asarray(rng.standard_normal(s)) for s in block.parameters_shapes)


# -- the facts ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_diagonal_in_the_eigenbasis_is_the_exact_blocks(xp, rng, kind):
    block, data, (f, a, g, q, ekfac) = make(xp, rng, kind)
    state = updated(xp, block, data)
    m = block.to_dense_matrix(state)
    xp.check(m)
    m = xp.to_numpy(m)
    tol = basis_tol(xp, a, g)
    in_basis = q.T @ m @ q
    assert_allclose_normwise(np.diag(in_basis), np.diag(q.T @ f @ q), tol)
    off = in_basis - np.diag(np.diag(in_basis))
    assert np.abs(off).max() <= tol * np.abs(in_basis).max()  # diagonal in the KFE
    assert_allclose_normwise(m, ekfac, tol)
    # the trace is F's: Q is orthogonal
    assert abs(np.trace(m) - np.trace(f)) <= tol * np.trace(f)


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_one_example(xp, rng, kind):
    block, data, (f, a, g, q, ekfac) = make(xp, rng, kind, n=1)
    m = xp.to_numpy(block.to_dense_matrix(updated(xp, block, data, n=1)))
    if kind == "dense":
        # F = (ā⊗g)(ā⊗g)ᵀ is diagonal in every eigenbasis of A = āāᵀ and G = ggᵀ
        assert_allclose_normwise(m, f, xp.rtol)
        return
    tol = basis_tol(xp, a, g)
    assert_allclose_normwise(np.diag(q.T @ m @ q), np.diag(q.T @ f @ q), tol)
    assert_allclose_normwise(m, ekfac, tol)


def _frobenius_case(kind, seed, n, d_in, d_out):
    rng = np.random.default_rng(seed)
    if kind == "dense":
        a, g = rng.standard_normal((n, d_in)), rng.standard_normal((n, d_out))
        a = a * rng.uniform(0.1, 3.0, size=d_in)  # anisotropic inputs
        data = {"inputs": a, "outputs_grad": g}
        blocks = (kj.DenseEKFAC(d_in, d_out), kj.DenseTwoKroneckerFactored(d_in, d_out))
        f = oracle(*(lambda gr, ab: (gr, ab, g))(*dense_grads(a, g)))[0]
    else:
        x = rng.standard_normal((n, 3, 3, d_in))
        g = rng.standard_normal((n, 2, 2, d_out))
        data = {"inputs": x, "outputs_grad": g}
        kw = dict(inputs_shape=(n, 3, 3, d_in), kernel_shape=(2, 2, d_in, d_out))
        blocks = (kj.Conv2DEKFAC(**kw), kj.Conv2DTwoKroneckerFactored(**kw))
        f = oracle(*conv_grads(x, g))[0]
    mats = []
    for b in blocks:
        st = b.update_curvature_matrix_estimate(b.init(np.zeros(())), data, 0.0, 1.0, n)
        mats.append(b.to_dense_matrix(st))
    return f, mats[0], mats[1]


try:
    from hypothesis import given
    from hypothesis import strategies as st

    @given(kind=st.sampled_from(["dense", "conv"]), seed=st.integers(0, 2**32 - 1),
           n=st.integers(1, 12), d_in=st.integers(1, 3), d_out=st.integers(1, 3))
    def test_never_further_from_the_exact_block_than_kfac(kind, seed, n, d_in, d_out):
        f, ekfac, kfac = _frobenius_case(kind, seed, n, d_in, d_out)
        err_e, err_k = np.linalg.norm(f - ekfac), np.linalg.norm(f - kfac)
        # both sides are float64 sums of O(‖F‖) terms: rounding slack 4096·eps·‖F‖
        assert err_e <= err_k + 4096 * np.finfo(float).eps * np.linalg.norm(f)
        assert abs(np.trace(ekfac) - np.trace(f)) <= 4096 * np.finfo(float).eps * np.trace(f)
except ImportError:  # pragma: no cover
    pass


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_pythagoras_in_the_eigenbasis(kind):
    # both are diagonal in the KFE and EKFAC's diagonal is F's there, so
    # ‖F − KFAC‖² = ‖F − EKFAC‖² + ‖EKFAC − KFAC‖² (strictly closer unless they agree)
    f, ekfac, kfac = _frobenius_case(kind, 3, 10, 3, 3)
    lhs = np.linalg.norm(f - kfac) ** 2
    rhs = np.linalg.norm(f - ekfac) ** 2 + np.linalg.norm(ekfac - kfac) ** 2
    assert abs(lhs - rhs) <= 1e-12 * lhs
    assert np.linalg.norm(ekfac - kfac) > 1e-3 * np.linalg.norm(kfac)


# -- products -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("power", [-1.0, -0.5, 0.5, 1.0, 2.0])
def test_damped_powers(xp, rng, kind, power):
    block, data, (f, a, g, q, ekfac) = make(xp, rng, kind)
    state = updated(xp, block, data)
    lam = 0.3
    m = xp.to_numpy(block.to_dense_matrix(state))
    ev, vecs = np.linalg.eigh(m + lam * np.eye(block.dim))
    dense = (vecs * ev ** power) @ vecs.T
    vec = random_vector(xp, rng, block)
    for exact in (True, False):  # exact and approximate coincide
        out = block.multiply_matpower(state, vec, lam, power, exact, False)
        for o in out:
            xp.check(o)
        assert_allclose_normwise(flat(xp, out), dense @ flat(xp, vec), xp.rtol)
    # the damping is added to s*: (s* + λ)^p in the oracle's basis
    s = np.diag(q.T @ ekfac @ q)
    assert_allclose_normwise(flat(xp, block.multiply_matpower(state, vec, lam, power, True,
                                                               False)),
                             (q * (s + lam) ** power) @ q.T @ flat(xp, vec), basis_tol(xp, a, g))


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_inverse_undoes_multiply_and_cache(xp, rng, kind):
    block, data, _ = make(xp, rng, kind)
    st = block.init(xp.asarray(np.zeros(())), exact_powers_to_cache=(-1.0,),
                    cache_eigenvalues=True)
    st = block.update_curvature_matrix_estimate(st, data, 0.0, 1.0, N)
    vec = random_vector(xp, rng, block)
    back = block.multiply_inverse(st, block.multiply(st, vec, 0.1, True, False), 0.1, True, False)
    assert_allclose_normwise(flat(xp, back), flat(xp, vec), xp.rtol)
    cached = block.update_cache(st, 0.1, (-1.0,), (), True)
    for p in (-1.0, 0.5, 1.0):  # the cache holds the basis and s*: any power, any weight
        assert_allclose_normwise(
            flat(xp, block.multiply_matpower(cached, vec, 0.2, p, True, True)),
            flat(xp, block.multiply_matpower(st, vec, 0.2, p, True, False)), xp.rtol)
    ev = xp.to_numpy(block.eigenvalues(cached, use_cached=True))
    m = xp.to_numpy(block.to_dense_matrix(st))
    assert_allclose_normwise(np.sort(ev), np.linalg.eigvalsh(m), xp.rtol)
    assert_allclose_normwise(np.sort(xp.to_numpy(block.eigenvalues(st))), np.linalg.eigvalsh(m),
                             xp.rtol)
    for norm, exp in (("avg_diag", np.trace(m) / block.dim),
                      ("avg_fro", np.linalg.norm(m) / np.sqrt(block.dim)),
                      ("2_norm", np.linalg.norm(m, 2)), ("1_norm", np.linalg.norm(m, 1))):
        got = float(xp.to_numpy(block.norm(st, norm)))
        assert abs(got - exp) <= xp.rtol * exp
    # the norm-scaled weight reaches the product as w·‖B‖
    w = 0.05
    lam = w * np.trace(m) / block.dim
    out = block.multiply_matpower(st, vec, w, -1.0, True, False, "avg_diag")
    assert_allclose_normwise(flat(xp, out), np.linalg.solve(m + lam * np.eye(block.dim),
                                                            flat(xp, vec)), xp.rtol)


def test_moving_average_of_factors_and_second_moment(rng):
    block = kj.DenseEKFAC(3, 3)
    batches = [{"inputs": rng.standard_normal((N, 3)), "outputs_grad": rng.standard_normal((N, 3))}
               for _ in range(2)]
    st = block.init(np.zeros(()))
    st = block.update_curvature_matrix_estimate(st, batches[0], 0.0, 1.0, N)
    st = block.update_curvature_matrix_estimate(st, batches[1], 0.9, 0.1, N)
    # kfac-jax's weights: weight = 0.9·1 + 0.1 = 1; value = 0.9·old + 0.1·new
    per = [oracle(*(lambda gr, ab, g: (gr, ab, g))(*dense_grads(b["inputs"], b["outputs_grad"]),
                                                   b["outputs_grad"])) for b in batches]
    f, a, g = (0.9 * per[0][i] + 0.1 * per[1][i] for i in range(3))
    q = np.kron(np.linalg.eigh(a)[1], np.linalg.eigh(g)[1])
    exp = (q * np.diag(q.T @ f @ q)) @ q.T
    assert_allclose_normwise(block.to_dense_matrix(st), exp, 1e-12 * davis_kahan(a, g))
    # an update with ema_old = 0 forgets the past: the EKFAC of that batch alone
    st2 = block.update_curvature_matrix_estimate(st, batches[1], 0.0, 1.0, N)
    assert_allclose_normwise(block.to_dense_matrix(st2), per[1][4], 1e-12 * davis_kahan(
        per[1][1], per[1][2]))


def test_no_bias_and_unsymmetrised_statistics(rng):
    a, g = rng.standard_normal((N, 3)), rng.standard_normal((N, 4))
    block = kj.DenseEKFAC(3, 4, has_bias=False, symmetrize=False)
    st = block.update_curvature_matrix_estimate(block.init(np.zeros(())),
                                                {"inputs": a, "outputs_grad": g}, 0.0, 1.0, N)
    grads, ab = dense_grads(a, g, bias=False)
    _, fa, fg, _, exp = oracle(grads, ab, g)
    assert block.parameters_shapes == ((3, 4),)
    assert_allclose_normwise(block.to_dense_matrix(st), exp, 1e-12 * davis_kahan(fa, fg))


# -- through the estimator ------------------------------------------------------------------
@pytest.mark.parametrize("mode,dense_fn", [("fisher_exact", C.fisher_matrix),
                                           ("fisher_empirical", C.empirical_fisher_matrix)])
def test_estimator_builds_ekfac_by_name(xp, rng, mode, dense_fn):
    net = nn.Sequential([("c", nn.Conv2D(2, 2, (2, 2))), ("a", nn.Activation("tanh")),
                         ("f", nn.Flatten()), ("d", nn.Dense(8, 3))])
    host_p = net.init_params(rng, np.zeros(1))
    n = 12
    host_x = xp.round_host(rng.standard_normal((n, 3, 3, 2)))
    bp = tuple(tuple(xp.asarray(xp.round_host(a)) for a in p) for p in host_p)
    batch = (xp.asarray(host_x), xp.asarray(rng.integers(0, 3, size=n)))
    states = {}
    for name, l2b in (("ekfac", {"dense": "ekfac", "conv2d": "ekfac"}), ("kfac", None)):
        est = BlockDiagonalCurvature(net, ce, layer_to_block=l2b)
        st = est.init(None, (bp, batch))
        states[name] = (est, est.update_curvature_matrix_estimate(st, 0.0, 1.0, n, None,
                                                                  (bp, batch), mode))
    est, st = states["ekfac"]
    assert [type(b) for b in est.blocks] == [kj.Conv2DEKFAC, kj.DenseEKFAC]
    exact = xp.to_numpy(dense_fn(net, ce, bp, batch))
    kest, kst = states["kfac"]
    for i, blk, bst, kblk, kbst in zip(net.parametric_layers, est.blocks, st.blocks_states,
                                       kest.blocks, kst.blocks_states, strict=True):
        sl = net.layer_slices()[i]
        f = exact[sl, sl]
        a, g = (xp.to_numpy(s.value) for s in kbst.statistics)  # K-FAC's factors: the basis
        q = np.kron(np.linalg.eigh(a)[1], np.linalg.eigh(g)[1])
        m = xp.to_numpy(blk.to_dense_matrix(bst))
        tol = 16 * basis_tol(xp, a, g)  # a backward pass chains more roundings (see above)
        assert_allclose_normwise(m, (q * np.diag(q.T @ f @ q)) @ q.T, tol)
        kfac = xp.to_numpy(kblk.to_dense_matrix(kbst))
        assert np.linalg.norm(f - m) <= np.linalg.norm(f - kfac) + tol * np.linalg.norm(f)
    assert kj.layer_block("dense", "ekfac") is kj.DenseEKFAC
    assert kj.layer_block("conv2d", "ekfac") is kj.Conv2DEKFAC


# -- validation -----------------------------------------------------------------------------
def test_update_scans_each_input_once(finite_scans, rng):
    for block, data in ((kj.DenseEKFAC(3, 2), {"inputs": rng.standard_normal((N, 3)),
                                               "outputs_grad": rng.standard_normal((N, 2))}),
                        (kj.Conv2DEKFAC(**CONV_KW),
                         {"inputs": rng.standard_normal((N, 3, 3, 1)),
                          "outputs_grad": rng.standard_normal((N, 2, 2, 3))})):
        state = block.init(np.zeros(()))
        finite_scans.clear()
        block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, N)
        assert finite_scans[id(data["inputs"])] == 1 and finite_scans[id(data["outputs_grad"])] == 1
        assert sum(finite_scans.values()) == 2


def test_bad_inputs(rng):
    block = kj.DenseEKFAC(3, 2)
    st = block.init(np.zeros(()))
    good = {"inputs": rng.standard_normal((N, 3)), "outputs_grad": rng.standard_normal((N, 2))}
    with pytest.raises(KFACValueError, match=r"DenseEKFAC.update_curvature_matrix_estimate: "
                                             r"inputs must be an array of shape \(\*, 3\)"):
        block.update_curvature_matrix_estimate(st, {**good, "inputs": good["inputs"][:, :2]},
                                               0.0, 1.0, N)
    bad = {**good, "outputs_grad": good["outputs_grad"].copy()}
    bad["outputs_grad"][0, 0] = np.inf
    with pytest.raises(KFACValueError, match="outputs_grad must be finite"):
        block.update_curvature_matrix_estimate(st, bad, 0.0, 1.0, N)
    st = block.update_curvature_matrix_estimate(st, good, 0.0, 1.0, N)
    vec = (np.ones((3, 2)), np.ones(2))
    with pytest.raises(KFACValueError, match="DenseEKFAC.multiply_matpower: vector must have 2"):
        block.multiply_matpower(st, vec[:1], 0.1, -1.0, True, False)
    with pytest.raises(KFACValueError, match="the cache must hold 'kfe'"):
        block.multiply_matpower(st, vec, 0.1, -1.0, True, True)
    with pytest.raises(KFACValueError, match="positive definite"):  # singular, undamped
        kj.DenseEKFAC(3, 2).multiply_inverse(
            kj.DenseEKFAC(3, 2).update_curvature_matrix_estimate(
                kj.DenseEKFAC(3, 2).init(np.zeros(())),
                {"inputs": good["inputs"][:1], "outputs_grad": good["outputs_grad"][:1]},
                0.0, 1.0, 1), vec, 0.0, True, False)
    with pytest.raises(KFACTypeError, match="DenseEKFAC: symmetrize must be"):
        kj.DenseEKFAC(3, 2, symmetrize="yes")
    with pytest.raises(KFACValueError, match=r"DenseEKFAC.from_layer: input_shape must be "
                                             r"\[N, d_in\]"):
        kj.DenseEKFAC.from_layer(nn.Dense(3, 2), (4, 5, 3))
    with pytest.raises(KFACValueError, match="Conv2DEKFAC.from_layer: layer must be a 'conv2d'"):
        kj.Conv2DEKFAC.from_layer(nn.Dense(3, 2), (4, 3))
    with pytest.raises(KFACTypeError, match="state must be a BlockState"):
        block.to_dense_matrix(None)
