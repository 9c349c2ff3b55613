"""Every kfac-jax-style block family's products against dense matrices built here, in NumPy,
from the block's *definition* and the raw data (never from ``to_dense_matrix`` or another
product of the block).

Sizes are chosen so that transposes, orders and scalings show: every square factor is at
least 3×3 and no layer is square (``d_in + 1 != d_out``):

* dense layers ``d_in = 4, d_out = 3``: ``A`` is 5×5, ``G`` 3×3 (a 2×2 ``G`` hides a
  transposed eigenbasis: LAPACK's 2×2 eigenvector matrix is symmetric);
* conv layers ``[N, 3, 3, 1]`` inputs, kernel ``2×2×1×3`` (VALID, stride 1): patches of 4 + 1
  coordinates (``A`` 5×5), ``G`` 3×3, ``|T| = 4`` locations.

Oracles (per docs page *Conventions*):

* per-example gradients ``DW_n = Σ_t p_{n,t} g_{n,t}ᵀ`` from explicit loops over examples and
  locations; ``F = (1/N) Σ_n vec_r(DW_n) vec_r(DW_n)ᵀ`` (the exact block, ``*Full``) and its
  diagonal (``*Diagonal``);
* ``A = (1/(N|T|)) Σ p pᵀ``, ``G = (1/(N|T|)) Σ g gᵀ``, Kronecker block ``|T|·kron(A, G)``;
  the approximate (π-damped) power ``(|T|(A + π r I) ⊗ (G + r/π I))^p`` with
  ``r = sqrt(λ/|T|)``, ``π = sqrt((tr A/5)/(tr G/3))``;
* EKFAC ``Q diag(diag(Qᵀ F Q)) Qᵀ`` with ``Q = kron(Q_A, Q_G)`` from ``numpy.linalg.eigh``;
* matrix powers through ``eigh`` of the damped dense matrix.

Tolerance: ``xp.rtol`` (conftest: dense size ≤ 16, condition ≤ 256 with damping 0.3) times,
for EKFAC, the Davis–Kahan factor ``max(1, ‖A‖/gap_A, ‖G‖/gap_G)`` of the oracle's factors
(the oracle's eigenbasis is computed separately from the block's).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_allclose_normwise, davis_kahan

from kfac_ref.blocks import kfac_jax as kj

N = 6
LAM = 0.3
D_IN, D_OUT = 4, 3
CONV = dict(inputs_shape=(N, 3, 3, 1), kernel_shape=(2, 2, 1, D_OUT), strides=1,
            padding="VALID")


def rows(xp, rng, kind):
    """(estimation data (backend), patches [N, |T|, K], cotangents [N, |T|, C], |T|), the
    host arrays rounded as the backend sees them."""
    if kind == "dense":
        a = xp.round_host(rng.standard_normal((N, D_IN)))
        g = xp.round_host(rng.standard_normal((N, D_OUT)))
        patches = np.hstack([a, np.ones((N, 1))])[:, None, :]
        return {"inputs": xp.asarray(a), "outputs_grad": xp.asarray(g)}, patches, g[:, None], 1
    x = xp.round_host(rng.standard_normal((N, 3, 3, 1)))
    g = xp.round_host(rng.standard_normal((N, 2, 2, D_OUT)))
    patches = np.zeros((N, 4, 5))
    outs = np.zeros((N, 4, D_OUT))
    for n in range(N):
        for i in range(2):
            for j in range(2):
                t = 2 * i + j
                patches[n, t] = np.append(x[n, i:i + 2, j:j + 2, :].reshape(-1), 1.0)
                outs[n, t] = g[n, i, j]
    return {"inputs": xp.asarray(x), "outputs_grad": xp.asarray(g)}, patches, outs, 4


def definition(patches, outs):
    """(F, A, G) of the layer from explicit sums over examples and locations."""
    n, t = patches.shape[:2]
    grads = []
    for k in range(n):
        dw = sum(np.outer(patches[k, s], outs[k, s]) for s in range(t))
        grads.append(dw.reshape(-1))
    grads = np.array(grads)
    f = grads.T @ grads / n
    p2, o2 = patches.reshape(n * t, -1), outs.reshape(n * t, -1)
    return f, p2.T @ p2 / (n * t), o2.T @ o2 / (n * t)


def power(m, p):
    s, q = np.linalg.eigh(m)
    return (q * s ** p) @ q.T


def vector(xp, rng, block):
    host = [xp.round_host(rng.standard_normal(s)) for s in block.parameters_shapes]
    return tuple(xp.asarray(h) for h in host), np.concatenate([h.reshape(-1) for h in host])


def flat(xp, out):
    for o in out:
        xp.check(o)
    return np.concatenate([xp.to_numpy(o).reshape(-1) for o in out])


def fitted(xp, block, data):
    state = block.init(xp.asarray(np.zeros(())), exact_powers_to_cache=(-1.0,))
    return block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, N)


def make(kind, family):
    cls = {("dense", "kron"): kj.DenseTwoKroneckerFactored,
           ("conv", "kron"): kj.Conv2DTwoKroneckerFactored,
           ("dense", "ekfac"): kj.DenseEKFAC, ("conv", "ekfac"): kj.Conv2DEKFAC,
           ("dense", "full"): kj.DenseFull, ("conv", "full"): kj.Conv2DFull,
           ("dense", "diagonal"): kj.DenseDiagonal, ("conv", "diagonal"): kj.Conv2DDiagonal,
           }[(kind, family)]
    return cls(D_IN, D_OUT) if kind == "dense" else cls(**CONV)


@pytest.mark.parametrize("kind", ["dense", "conv"])
@pytest.mark.parametrize("family", ["kron", "ekfac", "full", "diagonal"])
def test_products_equal_the_dense_definition(xp, rng, kind, family):
    data, patches, outs, t = rows(xp, rng, kind)
    block = make(kind, family)
    state = fitted(xp, block, data)
    f, a, g = definition(patches, outs)
    assert a.shape[0] >= 3 and g.shape[0] >= 3 and a.shape[0] != g.shape[0]
    tol = xp.rtol
    if family == "kron":
        dense = t * np.kron(a, g)
    elif family == "ekfac":
        q = np.kron(np.linalg.eigh(a)[1], np.linalg.eigh(g)[1])
        dense = (q * np.diag(q.T @ f @ q)) @ q.T
        tol = xp.rtol * davis_kahan(a, g)
    elif family == "full":
        dense = f
    else:
        dense = np.diag(np.diag(f))
    eye = np.eye(dense.shape[0])
    for p in (-1.0, 0.5, 1.0):
        vec, vh = vector(xp, rng, block)
        out = block.multiply_matpower(state, vec, LAM, p, True, False)
        assert_allclose_normwise(flat(xp, out), power(dense + LAM * eye, p) @ vh, tol)
    if family == "kron":  # the approximate inverse: π-damped factors, damping λ/|T| each
        r = np.sqrt(LAM / t)
        pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
        approx = t * np.kron(a + pi * r * np.eye(a.shape[0]), g + r / pi * np.eye(g.shape[0]))
        vec, vh = vector(xp, rng, block)
        out = block.multiply_matpower(state, vec, LAM, -1.0, False, False)
        assert_allclose_normwise(flat(xp, out), np.linalg.solve(approx, vh), tol)
    # the cached product: the same oracle
    cached = block.update_cache(state, LAM, (-1.0,), (), False)
    vec, vh = vector(xp, rng, block)
    out = block.multiply_matpower(cached, vec, LAM, -1.0, True, True)
    assert_allclose_normwise(flat(xp, out), np.linalg.solve(dense + LAM * eye, vh), tol)


def test_ekfac_basis_is_not_transposed(rng):
    """A regression guard for the known hole: with a 3×3 G a Q_G used where Q_Gᵀ is meant
    changes the product by O(1) (at 2×2 it would not: LAPACK's 2×2 eigenvectors are
    symmetric)."""
    a = rng.standard_normal((N, D_IN))
    g = rng.standard_normal((N, D_OUT))
    q_g = np.linalg.eigh(g.T @ g / N)[1]
    assert np.abs(q_g - q_g.T).max() > 0.1  # the data make the transpose visible
    block = kj.DenseEKFAC(D_IN, D_OUT)
    state = block.update_curvature_matrix_estimate(block.init(np.zeros(())),
                                                   {"inputs": a, "outputs_grad": g}, 0.0, 1.0, N)
    patches = np.hstack([a, np.ones((N, 1))])[:, None, :]
    f, fa, fg = definition(patches, g[:, None])
    qa, qg = np.linalg.eigh(fa)[1], np.linalg.eigh(fg)[1]
    x = rng.standard_normal((D_IN + 1, D_OUT))
    vec = (x[:-1], x[-1])
    got = np.concatenate([o.reshape(-1) for o in block.multiply_matpower(state, vec, LAM, -1.0,
                                                                          True, False)])
    q = np.kron(qa, qg)
    right = (q / (np.diag(q.T @ f @ q) + LAM)) @ q.T @ x.reshape(-1)
    q_wrong = np.kron(qa, qg.T)
    wrong = (q_wrong / (np.diag(q_wrong.T @ f @ q_wrong) + LAM)) @ q_wrong.T @ x.reshape(-1)
    assert np.abs(right - wrong).max() > 1e-2 * np.abs(right).max()
    assert_allclose_normwise(got, right, 4096 * np.finfo(float).eps * davis_kahan(fa, fg))


# -- scale-and-shift, naive (parameter-gradient) and scaled-identity blocks -----------------
SAS_IN, SAS_SCALE, SAS_SHIFT = (3, 4), (1, 4), (4,)


def _sas_definition(x, g):
    """F of y = scale·x + shift: per-example gradients (Σ over the broadcast axis of x·g
    for the [1, 4] scale, of g for the [4] shift), their second moment."""
    grads = np.array([np.concatenate([(x[n] * g[n]).sum(axis=0), g[n].sum(axis=0)])
                      for n in range(len(x))])
    return grads.T @ grads / len(x)


@pytest.mark.parametrize("family", ["full", "diagonal"])
def test_scale_and_shift_products_equal_the_definition(xp, rng, family):
    x = xp.round_host(rng.standard_normal((N, *SAS_IN)))
    g = xp.round_host(rng.standard_normal((N, *SAS_IN)))
    cls = kj.ScaleAndShiftFull if family == "full" else kj.ScaleAndShiftDiagonal
    block = cls(SAS_IN, SAS_SCALE, SAS_SHIFT)
    state = fitted(xp, block, {"inputs": xp.asarray(x), "outputs_grad": xp.asarray(g)})
    f = _sas_definition(x, g)
    dense = f if family == "full" else np.diag(np.diag(f))
    for p in (-1.0, 0.5):
        vec, vh = vector(xp, rng, block)
        out = block.multiply_matpower(state, vec, LAM, p, True, False)
        assert_allclose_normwise(flat(xp, out), power(dense + LAM * np.eye(8), p) @ vh,
                                 xp.rtol)


@pytest.mark.parametrize("reduction", ["per_source", "summed"])
@pytest.mark.parametrize("family", ["full", "diagonal"])
def test_naive_products_equal_the_definition(xp, rng, family, reduction):
    s_count, shapes = 3, [(4, 3), (3,)]
    grads = [xp.round_host(rng.standard_normal((s_count, *sh))) for sh in shapes]
    cls = kj.NaiveFull if family == "full" else kj.NaiveDiagonal
    block = cls(shapes, source_reduction=reduction)
    state = fitted(xp, block, {"params_grads": tuple(xp.asarray(a) for a in grads)})
    rows = np.hstack([a.reshape(s_count, -1) for a in grads])  # ĝ_s, flat
    if reduction == "summed":
        rows = rows.sum(axis=0, keepdims=True)
    f = rows.T @ rows / N  # F = (1/N) Σ_s ĝ_s ĝ_sᵀ (or of the summed source)
    dense = f if family == "full" else np.diag(np.diag(f))
    vec, vh = vector(xp, rng, block)
    out = block.multiply_matpower(state, vec, LAM, -1.0, True, False)
    assert_allclose_normwise(flat(xp, out), np.linalg.solve(dense + LAM * np.eye(15), vh),
                             xp.rtol)


def test_scaled_identity_product(xp, rng):
    block = kj.ScaledIdentity([(4, 3), (3,)], scale=1.7)
    state = block.init(xp.asarray(np.zeros(())))
    vec, vh = vector(xp, rng, block)
    for p in (-1.0, 0.5, 2.0):
        out = block.multiply_matpower(state, vec, LAM, p, True, False)
        assert_allclose_normwise(flat(xp, out), (1.7 + LAM) ** p * vh, xp.rtol)
