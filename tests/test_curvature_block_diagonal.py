"""BlockDiagonalCurvature: exact modes with Full blocks reproduce the dense block-diagonal GGN /
Fisher / empirical Fisher; the exactness facts (Eschenhagen et al. 2023) with the
default Kronecker blocks at tight tolerances; negative controls (the settings where K-FAC is
not exact must show an error); stochastic modes agree draw-for-draw with the dense estimate
(whose convergence rate is tested in test_curvature_exact.py); products, cache, eigenvalues.

Tolerances: the block statistics and the dense oracle are both backward-stable sums of
products of the same O(1) numbers, so the float64 comparisons use ``xp.rtol`` (4096·eps);
float32 cells use ``16·xp.rtol`` because a three-layer backward pass plus the covariance GEMMs
chain more roundings than the conftest's single-matrix derivation assumes.  A non-exact
setting must differ by more than ``1e-3`` relative, far above both.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_allclose_normwise
from losses_helpers import ce, sq

import kfac_ref.curvature as C
import kfac_ref.nn as nn
from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref.blocks import kfac_jax as B
from kfac_ref.curvature import BlockDiagonalCurvature, block_diag


def tol(xp):
    return xp.rtol if xp.float64 else 16 * xp.rtol


FULL = {"dense": B.NaiveFull, "conv2d": B.Conv2DFull, "scale_and_shift": B.ScaleAndShiftFull,
        "embedding": B.NaiveFull}


def make_data(xp, rng, net, loss, n, in_shape, int_inputs=None):
    if int_inputs is not None:
        host_x = rng.integers(0, int_inputs, size=(n, *in_shape))
    else:
        host_x = rng.standard_normal((n, *in_shape))
    host_p = net.init_params(rng, np.zeros(1))
    out_shape = net.output_shape(host_x.shape)
    host_y = (rng.integers(0, out_shape[-1], size=n) if loss is ce
              else rng.standard_normal(out_shape))
    bp = tuple(tuple(xp.asarray(a) for a in p) for p in host_p)
    return bp, (xp.asarray(host_x), xp.asarray(host_y))


def run(net, loss, bp, batch, mode, rng=None, **kw):
    est = BlockDiagonalCurvature(net, loss, **kw)
    st = est.init(None, (bp, batch))
    n = int(batch[0].shape[0])
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, n, rng, (bp, batch), mode)
    return est, st


def exact_blocks(xp, net, dense):
    """Diagonal blocks of a dense [P, P] matrix, by parametric layer (host float64)."""
    d = xp.to_numpy(dense)
    return [d[net.layer_slices()[i], net.layer_slices()[i]] for i in net.parametric_layers]


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def mlp(act="tanh"):
    return nn.Sequential([("d1", nn.Dense(3, 4)), ("a1", nn.Activation(act)),
                          ("d2", nn.Dense(4, 3)), ("a2", nn.Activation(act)),
                          ("d3", nn.Dense(3, 2))])


def convnet():
    return nn.Sequential([("c", nn.Conv2D(2, 2, (2, 2), padding="SAME", data_format="NCHW")),
                          ("a", nn.Activation("tanh")), ("f", nn.Flatten()),
                          ("s", nn.ScaleAndShift(18)), ("d", nn.Dense(18, 3))])


def embnet():
    return nn.Sequential([("e", nn.Embedding(5, 3)), ("f", nn.Flatten()), ("d", nn.Dense(6, 2))])


# ---------------------------------------------------------------------------------------------
# exact modes with full blocks reproduce the dense block-diagonal matrices
# ---------------------------------------------------------------------------------------------
NETS = [("mlp", mlp, ce, (3,), None), ("conv", convnet, ce, (2, 3, 3), None),
        ("shared", lambda: nn.Sequential([("d1", nn.Dense(3, 4)), ("a", nn.Activation("tanh")),
                                          ("d2", nn.Dense(4, 2))]), sq, (3, 3), None),
        ("embedding", embnet, ce, (2,), 5)]


@pytest.mark.parametrize("case", NETS, ids=[c[0] for c in NETS])
def test_exact_modes_with_full_blocks(xp, rng, case):
    _, make, loss, shape, ints = case
    net = make()
    bp, batch = make_data(xp, rng, net, loss, 3, shape, ints)
    g = C.ggn_matrix(net, loss, bp, batch)
    for mode, dense in (("ggn_exact", g), ("fisher_exact", g),
                        ("fisher_empirical", C.empirical_fisher_matrix(net, loss, bp, batch))):
        est, st = run(net, loss, bp, batch, mode, layer_to_block=FULL)
        blocks = est.to_diagonal_block_dense_matrix(st)
        for got, exp in zip(blocks, exact_blocks(xp, net, dense), strict=True):
            xp.assert_close(got, exp, rtol=tol(xp))
        full = est.to_dense_matrix(st)
        xp.check(full)
        mask = block_diag([xp.xp.ones_like(b) for b in blocks])
        xp.assert_close(full, xp.to_numpy(dense) * xp.to_numpy(mask), rtol=tol(xp))
    # kfac-jax's empirical-Fisher scale: an extra 1/N
    est, st = run(net, loss, bp, batch, "fisher_empirical", layer_to_block=FULL,
                  empirical_fisher_normalization="kfac_jax")
    ef = exact_blocks(xp, net, C.empirical_fisher_matrix(net, loss, bp, batch))
    for got, exp in zip(est.to_diagonal_block_dense_matrix(st), ef, strict=True):
        xp.assert_close(got, exp / 3, rtol=tol(xp))


def test_default_embedding_block_is_exact_diagonal(xp, rng):
    # embedding -> NaiveDiagonal fed per-example gradients: the exact diagonal of the block
    net = embnet()
    bp, batch = make_data(xp, rng, net, ce, 3, (2,), 5)
    est, st = run(net, ce, bp, batch, "ggn_exact")
    emb = est.to_diagonal_block_dense_matrix(st)[0]
    exp = exact_blocks(xp, net, C.ggn_matrix(net, ce, bp, batch))[0]
    xp.assert_close(emb, np.diag(np.diag(exp)), rtol=tol(xp))


# ---------------------------------------------------------------------------------------------
# exactness facts with the default Kronecker blocks
# ---------------------------------------------------------------------------------------------
def kfac_vs_exact(xp, rng, net, loss, n, shape, mode="ggn_exact", dense_fn=C.ggn_matrix, **kw):
    bp, batch = make_data(xp, rng, net, loss, n, shape)
    est, st = run(net, loss, bp, batch, mode, **kw)
    exact = exact_blocks(xp, net, dense_fn(net, loss, bp, batch))
    return est.to_diagonal_block_dense_matrix(st), exact


def test_single_example_every_layer_exact(xp, rng):
    # N = 1, nonlinear MLP, cross-entropy: type-2 K-FAC = GGN block, K-FAC-empirical = EF block
    net = mlp()
    got, exp = kfac_vs_exact(xp, rng, net, ce, 1, (3,))
    for g, e in zip(got, exp, strict=True):
        xp.assert_close(g, e, rtol=tol(xp))
    got, exp = kfac_vs_exact(xp, rng, net, ce, 1, (3,), "fisher_empirical",
                             C.empirical_fisher_matrix)
    for g, e in zip(got, exp, strict=True):
        xp.assert_close(g, e, rtol=tol(xp))
    # negative controls: with N = 3 neither is exact, and K-FAC-empirical is not the EF block
    # even for a deep linear network with squared error (Martens & Grosse 2015, §3)
    got, exp = kfac_vs_exact(xp, rng, net, ce, 3, (3,))
    assert rel_err(xp.to_numpy(got[0]), exp[0]) > 1e-3
    got, exp = kfac_vs_exact(xp, rng, mlp("identity"), sq, 3, (3,), "fisher_empirical",
                             C.empirical_fisher_matrix)
    assert rel_err(xp.to_numpy(got[0]), exp[0]) > 1e-3


def test_deep_linear_squared_error_every_layer_exact(xp, rng):
    net = mlp("identity")
    got, exp = kfac_vs_exact(xp, rng, net, sq, 5, (3,))
    for g, e in zip(got, exp, strict=True):
        xp.assert_close(g, e, rtol=tol(xp))
    # negative controls: cross-entropy, or a nonlinearity in the first layers, is not exact
    got, exp = kfac_vs_exact(xp, rng, net, ce, 5, (3,))
    assert rel_err(xp.to_numpy(got[0]), exp[0]) > 1e-3
    got, exp = kfac_vs_exact(xp, rng, mlp("tanh"), sq, 5, (3,))
    assert rel_err(xp.to_numpy(got[0]), exp[0]) > 1e-3
    # ... but the last layer of a tanh MLP with squared error is
    xp.assert_close(got[-1], exp[-1], rtol=tol(xp))


def shared_net(pool):
    layers = [("d1", nn.Dense(3, 4)), ("d2", nn.Dense(4, 3))]
    if pool:
        layers.insert(1, ("pool", nn.MeanPool()))
    return nn.Sequential(layers)


def test_expand_setting(xp, rng):
    # per-position squared error on [N, T, k] outputs of a deep linear weight-sharing net:
    # KFAC-expand exact for every layer, KFAC-reduce not
    net = shared_net(pool=False)
    got, exp = kfac_vs_exact(xp, rng, net, sq, 3, (4, 3), weight_sharing="expand")
    for g, e in zip(got, exp, strict=True):
        xp.assert_close(g, e, rtol=tol(xp))
    got, exp = kfac_vs_exact(xp, rng, net, sq, 3, (4, 3), weight_sharing="reduce")
    assert rel_err(xp.to_numpy(got[0]), exp[0]) > 1e-3
    # a per-layer mapping: named layers take their mode, the others stay on expand
    got, exp = kfac_vs_exact(xp, rng, net, sq, 3, (4, 3), weight_sharing={"d2": "reduce"})
    xp.assert_close(got[0], exp[0], rtol=tol(xp))
    assert rel_err(xp.to_numpy(got[1]), exp[1]) > 1e-3


def test_reduce_setting(xp, rng):
    # mean over positions before the loss: KFAC-reduce exact for the weight-shared layer,
    # KFAC-expand not; the layer after the pool is an ordinary deep-linear layer (exact)
    net = shared_net(pool=True)
    got, exp = kfac_vs_exact(xp, rng, net, sq, 3, (4, 3), weight_sharing="reduce")
    for g, e in zip(got, exp, strict=True):
        xp.assert_close(g, e, rtol=tol(xp))
    got, exp = kfac_vs_exact(xp, rng, net, sq, 3, (4, 3), weight_sharing={"d1": "expand"})
    assert rel_err(xp.to_numpy(got[0]), exp[0]) > 1e-3
    xp.assert_close(got[1], exp[1], rtol=tol(xp))


@pytest.mark.parametrize("padding", ["VALID", "SAME"])
def test_single_conv_channels_last_squared_error_exact(xp, rng, padding):
    # KFC (= expand) is exact for one conv layer with a per-location squared error (NHWC)
    net = nn.Sequential([("c", nn.Conv2D(2, 2, (2, 2), stride=1, padding=padding))])
    got, exp = kfac_vs_exact(xp, rng, net, sq, 2, (3, 3, 2))
    xp.assert_close(got[0], exp[0], rtol=tol(xp))
    # negative control: cross-entropy on the flattened conv output is not exact
    net = nn.Sequential([("c", nn.Conv2D(2, 1, (2, 2), padding=padding)), ("f", nn.Flatten())])
    got, exp = kfac_vs_exact(xp, rng, net, ce, 2, (3, 3, 2))
    assert rel_err(xp.to_numpy(got[0]), exp[0]) > 1e-3


def test_conv_pool_dense_reduce_exact(xp, rng):
    # conv -> global average pool -> dense, squared error, no nonlinearity: KFAC-reduce is
    # exact for the conv layer, KFC (expand) is not
    net = nn.Sequential([("c", nn.Conv2D(2, 2, (2, 2), padding="SAME")), ("p", nn.MeanPool()),
                         ("d", nn.Dense(2, 2))])
    shape = (3, 3, 2)
    got, exp = kfac_vs_exact(xp, rng, net, sq, 3, shape, weight_sharing="reduce")
    for g, e in zip(got, exp, strict=True):
        xp.assert_close(g, e, rtol=tol(xp))
    got, exp = kfac_vs_exact(xp, rng, net, sq, 3, shape, weight_sharing="expand")
    assert rel_err(xp.to_numpy(got[0]), exp[0]) > 1e-3


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_conv_block_does_not_depend_on_layout(xp, rng, sharing):
    # the same function written NHWC and NCHW (the dense layer after the flatten takes its
    # rows in the other order) has the same conv block, in KFC (expand) and KFAC-reduce form:
    # the reduce path must sum the NCHW output gradients over locations, not over channels
    h = w = 3
    c_in, c_out = 2, 2
    nets, params, batches = {}, {}, {}
    x = rng.standard_normal((3, h, w, c_in))
    y = rng.integers(0, 3, size=3)
    host = None
    for fmt in ("NHWC", "NCHW"):
        nets[fmt] = nn.Sequential([("c", nn.Conv2D(c_in, c_out, (2, 2), padding="SAME",
                                                   data_format=fmt)),
                                   ("a", nn.Activation("tanh")), ("f", nn.Flatten()),
                                   ("d", nn.Dense(h * w * c_out, 3))])
        if host is None:
            host = nets[fmt].init_params(rng, np.zeros(1))
            p = host
            xin = x
        else:  # NCHW flatten order (c, h, w): rows of the NHWC (h, w, c) dense kernel
            rows = np.arange(h * w * c_out).reshape(h, w, c_out).transpose(2, 0, 1).ravel()
            p = (host[0], (), (), (host[3][0][rows], host[3][1]))
            xin = x.transpose(0, 3, 1, 2)
        params[fmt] = tuple(tuple(xp.asarray(a) for a in q) for q in p)
        batches[fmt] = (xp.asarray(xin), xp.asarray(y))
    blocks = {}
    for fmt in nets:
        est, st = run(nets[fmt], ce, params[fmt], batches[fmt], "ggn_exact",
                      weight_sharing=sharing)
        blocks[fmt] = est.to_diagonal_block_dense_matrix(st)[0]
    xp.assert_close(blocks["NCHW"], xp.to_numpy(blocks["NHWC"]), rtol=tol(xp))
    # and the layouts give the same function: same dense GGN conv block
    g = {fmt: exact_blocks(xp, nets[fmt], C.ggn_matrix(nets[fmt], ce, params[fmt],
                                                        batches[fmt]))[0] for fmt in nets}
    assert_allclose_normwise(g["NCHW"], g["NHWC"], tol(xp))


# ---------------------------------------------------------------------------------------------
# stochastic modes, EMA, products
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fisher_gradients", "fisher_curvature_prop",
                                  "ggn_curvature_prop"])
def test_stochastic_modes_match_dense_estimate_draw_for_draw(xp, rng, mode):
    # the same generator state gives the same vectors, so the full blocks equal the diagonal
    # blocks of the dense estimate (whose convergence is tested in test_curvature_exact.py)
    net = mlp()
    bp, batch = make_data(xp, rng, net, ce, 3, (3,))
    est, st = run(net, ce, bp, batch, mode, rng=np.random.default_rng(3), layer_to_block=FULL,
                  num_samples=3)
    dense = C.estimated_matrix(net, ce, bp, batch, mode, rng=np.random.default_rng(3),
                               num_samples=3)
    for got, exp in zip(est.to_diagonal_block_dense_matrix(st), exact_blocks(xp, net, dense),
                        strict=True):
        xp.assert_close(got, exp, rtol=tol(xp))


@pytest.mark.parametrize("mode", ["fisher_gradients", "ggn_curvature_prop"])
def test_stochastic_modes_kronecker_blocks_draw_for_draw(xp, rng, mode):
    # default Kronecker blocks with M = 3 samples: A = (1/N) Σ ā āᵀ and
    # G = (1/N) Σ_m Σ_n g_mn g_mnᵀ with the vectors u_m/√M of the mode (same seed), so the
    # block is kron(A, G) of the sample average, whatever the per-sample update weighting
    net = mlp()
    bp, batch = make_data(xp, rng, net, ce, 3, (3,))
    est, st = run(net, ce, bp, batch, mode, rng=np.random.default_rng(4), num_samples=3)
    vectors = C.estimation_output_vectors(net, ce, bp, batch, mode,
                                          rng=np.random.default_rng(4), num_samples=3)
    assert len(vectors) == 3
    cots = [net.backward_with_cotangents(bp, batch[0], u) for u in vectors]
    inputs = cots[0][0]
    for k, i in enumerate(net.parametric_layers):
        a = np.concatenate([xp.to_numpy(inputs[i]), np.ones((3, 1))], axis=1)
        a_fac = a.T @ a / 3
        gs = [xp.to_numpy(c[1][i]) for c in cots]
        g_fac = sum(g.T @ g for g in gs) / 3
        xp.assert_close(est.to_diagonal_block_dense_matrix(st)[k], np.kron(a_fac, g_fac),
                        rtol=tol(xp))


def test_moving_average_and_products(xp, rng):
    net = mlp()
    bp, batch = make_data(xp, rng, net, ce, 3, (3,))
    fa = (bp, batch)
    est = BlockDiagonalCurvature(net, ce)
    st = est.init(None, fa)
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, 3, None, fa, "ggn_exact")
    st2 = est.update_curvature_matrix_estimate(st, 1.0, 1.0, 3, None, fa, "fisher_empirical")
    _, st_ef = run(net, ce, bp, batch, "fisher_empirical")
    # factors average separately: A is unchanged, G is the mean of the two G's
    a1, g1 = (s.value for s in st.blocks_states[0].factors)
    a2, g2 = (s.value for s in st2.blocks_states[0].factors)
    _, g_ef = (s.value for s in st_ef.blocks_states[0].factors)
    xp.assert_close(a2, xp.to_numpy(a1), rtol=tol(xp))
    xp.assert_close(g2, (xp.to_numpy(g1) + xp.to_numpy(g_ef)) / 2, rtol=tol(xp))

    dense = [xp.to_numpy(b) for b in est.to_diagonal_block_dense_matrix(st)]
    v = rng.standard_normal(net.num_params)
    rv = xp.round_host(v)
    lam = (0.2, 0.5, 1.0)
    got = est.multiply_matpower(st, xp.asarray(v), lam, -1.0, True, False)
    sl = [net.layer_slices()[i] for i in net.parametric_layers]
    exp = np.concatenate([np.linalg.solve(d + w * np.eye(len(d)), rv[s])
                          for d, w, s in zip(dense, lam, sl, strict=True)])
    xp.assert_close(got, exp, rtol=64 * tol(xp))
    # norm-scaled identity weights: λ_l = w · ‖C_l‖ (avg_diag = tr/dim)
    got = est.multiply_matpower(st, xp.asarray(v), 0.3, 1.0, True, False,
                                norm_to_scale_identity_weight_per_block="avg_diag")
    exp = np.concatenate([d @ rv[s] + 0.3 * np.trace(d) / len(d) * rv[s]
                          for d, s in zip(dense, sl, strict=True)])
    xp.assert_close(got, exp, rtol=tol(xp))
    # cached products equal uncached ones, including with a norm-scaled weight
    st_c = est.init(None, fa, exact_powers_to_cache=-1.0, approx_powers_to_cache=-1.0,
                    cache_eigenvalues=True)
    st_c = est.update_curvature_matrix_estimate(st_c, 0.0, 1.0, 3, None, fa, "ggn_exact")
    st_c = est.update_cache(st_c, 0.3, -1.0, -1.0, True,
                            norm_to_scale_identity_weight_per_block="avg_diag")
    for exact_power in (True, False):
        fresh = est.multiply_matpower(st_c, xp.asarray(v), 0.3, -1.0, exact_power, False,
                                      norm_to_scale_identity_weight_per_block="avg_diag")
        cached = est.multiply_matpower(st_c, xp.asarray(v), 0.3, -1.0, exact_power, True,
                                       norm_to_scale_identity_weight_per_block="avg_diag")
        xp.assert_close(cached, xp.to_numpy(fresh), rtol=tol(xp))
    # structured vectors round-trip
    out = est.multiply_matpower(st, net.unflatten(xp.asarray(v)), 0.1, 1.0, True, False)
    xp.assert_close(net.flatten(out),
                    xp.to_numpy(est.multiply_matpower(st, xp.asarray(v), 0.1, 1.0, True, False)))
    # eigenvalues: per block, concatenated
    ev = est.eigenvalues(st)
    exp = np.concatenate([np.sort(np.linalg.eigvalsh(d)) for d in dense])
    got = np.concatenate([np.sort(xp.to_numpy(e)) for e in est.block_eigenvalues(st)])
    assert_allclose_normwise(got, exp, 64 * tol(xp))
    assert ev.shape == (net.num_params,)


def test_errors(xp, rng):
    net = mlp()
    bp, batch = make_data(xp, rng, net, ce, 3, (3,))
    est = BlockDiagonalCurvature(net, ce)
    with pytest.raises(KFACValueError, match="init"):
        est.update_curvature_matrix_estimate(None, 0.0, 1.0, 3, None, (bp, batch))
    st = est.init(None, (bp, batch))
    with pytest.raises(KFACValueError, match="estimation_mode"):
        est.update_curvature_matrix_estimate(st, 0.0, 1.0, 3, None, (bp, batch), "magic")
    with pytest.raises(KFACValueError, match="batch_size"):
        est.update_curvature_matrix_estimate(st, 0.0, 1.0, 4, None, (bp, batch), "ggn_exact")
    with pytest.raises(KFACValueError, match="ema_old"):
        est.update_curvature_matrix_estimate(st, -1.0, 1.0, 3, None, (bp, batch), "ggn_exact")
    with pytest.raises(KFACTypeError, match="Generator"):
        est.update_curvature_matrix_estimate(st, 0.0, 1.0, 3, None, (bp, batch),
                                             "fisher_gradients")
    with pytest.raises(KFACValueError, match="weight_sharing"):
        BlockDiagonalCurvature(net, ce, weight_sharing="mean")
    # a weight-shared layer's block carries init's T: a batch with another T is refused
    shared = nn.Sequential([("d", nn.Dense(3, 2))])
    sp, sb = make_data(xp, rng, shared, sq, 2, (4, 3))
    est_s = BlockDiagonalCurvature(shared, sq)
    st_s = est_s.init(None, (sp, sb))
    _, sb5 = make_data(xp, rng, shared, sq, 2, (5, 3))
    with pytest.raises(KFACValueError, match="input shape it had at init"):
        est_s.update_curvature_matrix_estimate(st_s, 0.0, 1.0, 2, None, (sp, sb5), "ggn_exact")
    with pytest.raises(KFACValueError, match="identity_weight"):
        est.multiply_matpower(st, xp.asarray(np.zeros(net.num_params)), (0.1, 0.2), -1.0, True,
                              False)
    with pytest.raises(KFACTypeError, match="state"):
        est.to_dense_matrix(None)


def cached_mlp(xp, rng):
    """``(net, data, estimator, state cached for the power −1 at weight 0.1, vector)``."""
    net = mlp()
    bp, batch = make_data(xp, rng, net, ce, 3, (3,))
    est = BlockDiagonalCurvature(net, ce)
    st = est.init(None, (bp, batch), approx_powers_to_cache=-1.0)
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, 3, None, (bp, batch), "ggn_exact")
    st = est.update_cache(st, 0.1, None, -1.0, False)
    return net, (bp, batch), est, st, xp.asarray(rng.standard_normal(net.num_params))


def test_product_checks_once_for_all_blocks(xp, rng, monkeypatch):
    # the estimator checks its arguments once (one finiteness scan of the flat vector, one
    # namespace check over it and every block state) and runs the blocks' unchecked kernels;
    # each bad argument is still refused, naming what is wrong
    from kfac_ref import _backend

    net, _, est, st, v = cached_mlp(xp, rng)
    scanned = []
    real = _backend.all_finite
    monkeypatch.setattr(_backend, "all_finite", lambda ns, x: scanned.append(x) or real(ns, x))
    for use_cached in (False, True):
        scanned.clear()
        est.multiply_matpower(st, v, 0.1, -1.0, False, use_cached)
        assert [x is v for x in scanned] == [True]
    monkeypatch.undo()
    with pytest.raises(KFACValueError, match="parameter_structured_vector.*finite"):
        est.multiply_matpower(st, xp.asarray(np.full(net.num_params, np.nan)), 0.1, -1.0, False,
                              True)
    states = st.blocks_states
    swapped = C.BlockDiagonalState((states[1], states[0]) + states[2:])
    with pytest.raises(KFACValueError, match="statistics of shapes"):
        est.multiply_matpower(swapped, v, 0.1, -1.0, False, True)
    # another precision (float32 next to float64), or NumPy next to a float32-only device
    like = (xp.xp.asarray(np.zeros(()), dtype=xp.xp.float32, device=xp.device) if xp.float64
            else np.zeros((), dtype=np.float64))
    odd = B.BlockState(states[1].statistics, states[1].cache, like)
    with pytest.raises(KFACTypeError, match=r"state\.blocks_states\[1\] (must have the "
                                            r"floating dtype|is from)"):
        est.multiply_matpower(C.BlockDiagonalState(
            (states[0], odd) + states[2:]), v, 0.1, -1.0, False, True)
    with pytest.raises(KFACValueError, match="power must be one of"):
        est.multiply_matpower(st, v, 0.1, 0.25, False, False)
    with pytest.raises(KFACValueError, match="cached approximate powers"):
        est.multiply_matpower(st, v, 0.1, -0.5, False, True)
    with pytest.raises(KFACValueError, match="norm_to_scale_identity_weight"):
        est.multiply_matpower(st, v, 0.1, -1.0, False, True,
                              norm_to_scale_identity_weight_per_block="frobenius")


def test_a_state_is_walked_once(xp, rng, monkeypatch):
    # a product walks a state's block states (structure, one namespace across them) the first
    # time it meets the state object; states the estimator made are not walked at all;
    # a state that failed is not remembered; the vector is still checked against the states
    net, (bp, batch), est, st, v = cached_mlp(xp, rng)
    walked = []
    real = B.CurvatureBlock.check_state_structure
    monkeypatch.setattr(B.CurvatureBlock, "check_state_structure",
                        lambda self, func, state: walked.append(state) or real(self, func, state))
    want = est.multiply_matpower(st, v, 0.1, -1.0, False, True)
    assert walked == []  # made by update_cache
    rebuilt = C.BlockDiagonalState(tuple(st.blocks_states))
    for walks in (len(est.blocks), 0):
        walked.clear()
        got = est.multiply_matpower(rebuilt, v, 0.1, -1.0, False, True)
        assert len(walked) == walks
        assert_allclose_normwise(xp.to_numpy(got), xp.to_numpy(want), 0.0)
    states = st.blocks_states
    swapped = C.BlockDiagonalState((states[1], states[0]) + states[2:])
    for _ in range(2):
        with pytest.raises(KFACValueError, match="statistics of shapes"):
            est.multiply_matpower(swapped, v, 0.1, -1.0, False, True)
    # a list can change in place after a check: walked every time
    listed = C.BlockDiagonalState(list(states))
    for _ in range(2):
        walked.clear()
        est.multiply_matpower(listed, v, 0.1, -1.0, False, True)
        assert len(walked) == len(est.blocks)
    listed.blocks_states[0], listed.blocks_states[1] = states[1], states[0]
    with pytest.raises(KFACValueError, match="statistics of shapes"):
        est.multiply_matpower(listed, v, 0.1, -1.0, False, True)
    # nor is a state the estimator made from block states holding lists (shared, not copied)
    made = est.update_cache(C.BlockDiagonalState(tuple(
        B.BlockState(list(s.statistics), s.cache, s.like) for s in states)), 0.1, None, -1.0,
        False)
    walked.clear()
    est.multiply_matpower(made, v, 0.1, -1.0, False, True)
    assert len(walked) == len(est.blocks)
    other = (xp.xp.asarray(np.zeros(net.num_params), dtype=xp.xp.float32, device=xp.device)
             if xp.float64 else np.zeros(net.num_params))
    with pytest.raises(KFACTypeError, match="parameter_structured_vector"):
        est.multiply_matpower(rebuilt, other, 0.1, -1.0, False, True)
    # init makes new blocks: the states checked against the old ones are walked again
    est.layer_to_block = {"dense": B.DenseDiagonal}
    est.init(None, (bp, batch))
    with pytest.raises(KFACValueError, match="statistics of shapes"):
        est.multiply_matpower(rebuilt, v, 0.1, -1.0, False, True)


def test_an_estimator_pickles_without_the_states_it_remembers(rng):
    import pickle
    import types

    _, _, est, st, v = cached_mlp(types.SimpleNamespace(asarray=np.asarray), rng)
    twin = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(twin.multiply_matpower(st, v, 0.1, -1.0, False, True),
                                  est.multiply_matpower(st, v, 0.1, -1.0, False, True))


def test_factory_must_return_a_curvature_block(xp, rng):
    net = mlp()
    bp, batch = make_data(xp, rng, net, ce, 3, (3,))
    est = BlockDiagonalCurvature(net, ce, layer_to_block={"dense": lambda layer, shape: object()})
    with pytest.raises(KFACTypeError, match="factory .* must return .*CurvatureBlock; got object"):
        est.init(None, (bp, batch))


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_kronecker_factors_computed_once_per_update(xp, rng, monkeypatch, sharing):
    # an exact mode has C = 3 output vectors: every Kronecker block computes its input factor
    # once and its output factor once, from the C·N stacked rows (not once per vector)
    from kfac_ref import factors

    calls = {"dense": [], "conv_in": 0, "conv_out": [], "tap": 0}
    dense_k = factors.fully_connected_kronecker_factor.kernel
    conv_in_k = factors.conv_input_kronecker_factor.kernel
    conv_out_k = factors.conv_output_kronecker_factor.kernel

    def dense(xp_, x, *a, **k):
        calls["dense"].append(int(x.shape[0]))
        return dense_k(xp_, x, *a, **k)

    def conv_in(*a, **k):
        calls["conv_in"] += 1
        return conv_in_k(*a, **k)

    def conv_out(xp_, g, *a, **k):
        calls["conv_out"].append(int(g.shape[0]))
        return conv_out_k(xp_, g, *a, **k)

    monkeypatch.setattr(factors.fully_connected_kronecker_factor, "kernel", dense)
    monkeypatch.setattr(factors.conv_input_kronecker_factor, "kernel", conv_in)
    monkeypatch.setattr(factors.conv_output_kronecker_factor, "kernel", conv_out)
    make_tap = factors.conv_input_factor_tap

    def counted_tap(*a, **k):  # counts the calls of the tap, one per chunk of the forward
        tap = make_tap(*a, **k)

        def counted(patches):
            calls["tap"] += 1
            return tap(patches)

        return counted

    monkeypatch.setattr(factors, "conv_input_factor_tap", counted_tap)
    net = convnet()  # conv (Kronecker), scale-and-shift (diagonal), dense (Kronecker)
    n, c = 4, 3
    bp, batch = make_data(xp, rng, net, ce, n, (2, 3, 3))
    run(net, ce, bp, batch, "ggn_exact", weight_sharing=sharing)
    if sharing == "expand":  # the dense layer's A and G; the conv layer's Γ, and its Ω
        # once, in the forward pass (the patches it reads are the forward's own)
        assert sorted(calls["dense"]) == [n, c * n]
        assert calls["conv_out"] == [c * n]
        assert calls["conv_in"] == 0 and calls["tap"] == 1
    else:  # the reduced conv block is a dense Kronecker block on pooled rows
        assert sorted(calls["dense"]) == [n, n, c * n, c * n]
        assert calls["conv_in"] == 0 and calls["conv_out"] == [] and calls["tap"] == 0


STACKED_NETS = [("mlp", mlp, (3,)), ("conv", convnet, (2, 3, 3)),
                ("conv_chunked", lambda: tapnet("NHWC", True, 1), (4, 5, 2))]


@pytest.mark.parametrize("case", STACKED_NETS, ids=[c[0] for c in STACKED_NETS])
@pytest.mark.parametrize("mode", ["ggn_exact", "fisher_exact"])
def test_stacked_backward_equals_one_backward_pass_per_vector(xp, rng, monkeypatch, case, mode):
    # with Kronecker and diagonal-of-layer blocks only, the C output vectors of an exact
    # mode are back-propagated stacked, in one pass; the statistics must equal those of C
    # separate passes (the network's own per-vector backward, stacked afterwards)
    _, make, in_shape = case
    net = make()
    bp, batch = make_data(xp, rng, net, ce, 3, in_shape)
    calls = {"n": 0}
    stacked = nn.Sequential.stacked_backward_pass

    def counted(self, *a, **k):
        calls["n"] += 1
        return stacked(self, *a, **k)

    monkeypatch.setattr(nn.Sequential, "stacked_backward_pass", counted)
    _, one_pass = run(net, ce, bp, batch, mode)
    assert calls["n"] == 1

    def per_vector(self, forward, g, caches=None):
        passes = [self.backward_pass(forward, g[j, ...], param_grads=False,
                                     caches=caches)[1] for j in range(g.shape[0])]
        return [xp.xp.stack([p[i] for p in passes], axis=0) for i in range(len(passes[0]))]

    monkeypatch.setattr(nn.Sequential, "stacked_backward_pass", per_vector)
    _, separate = run(net, ce, bp, batch, mode)
    for one, two in zip(one_pass.blocks_states, separate.blocks_states, strict=True):
        for s1, s2 in zip(one.statistics, two.statistics, strict=True):
            xp.assert_close(s1.value, xp.to_numpy(s2.value), rtol=tol(xp))


# every block family: the estimator's flat products (the blocks' flat kernels, which take
# the [W; b] matrix of a Kronecker block as a reshape of the flat slice), fresh and cached,
# exact and approximate, against a dense block-diagonal matrix built here in NumPy from each
# block's statistics (the factor values, tested against loops elsewhere) by the family's
# definition: s·kron(A, G) (π-damped factors for the approximate power), EKFAC's
# Q diag(diag(Qᵀ F Q)) Qᵀ with Q = kron(Q_A, Q_G), the full F, the diagonal.  Sizes: the conv
# layer has 3 output channels (G 3×3, A 9×9), the dense layer 12 → 4 (A 13×13, G 4×4).
FAMILIES = {"kronecker": {}, "ekfac": {"dense": "ekfac", "conv2d": "ekfac"},
            "full": {"dense": "full", "conv2d": "full", "scale_and_shift": "full"},
            "diagonal": {"dense": "diagonal", "conv2d": "diagonal"},
            "kronecker_reduce": {"conv2d": "kronecker_reduce"}}


def _block_oracle(bl, bs, lam, exact_power):
    """(s·B + λI)⁻¹ of one block from its statistics (host float64)."""
    stats = [np.asarray(st.value, dtype=np.float64) for st in bs.statistics]
    name = type(bl).__name__
    s = float(bl.scale(bs))
    if "TwoKronecker" in name:
        a, g = stats
        if exact_power:
            return np.linalg.inv(s * np.kron(a, g) + lam * np.eye(a.shape[0] * g.shape[0]))
        r = np.sqrt(lam / s)
        pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
        return np.linalg.inv(s * np.kron(a + pi * r * np.eye(a.shape[0]),
                                         g + r / pi * np.eye(g.shape[0])))
    if "EKFAC" in name:
        a, g, f = stats
        q = np.kron(np.linalg.eigh(a)[1], np.linalg.eigh(g)[1])
        return (q / (s * np.diag(q.T @ f @ q) + lam)) @ q.T
    if "Full" in name:
        (f,) = stats
        return np.linalg.inv(s * f + lam * np.eye(f.shape[0]))
    assert "Diagonal" in name, name
    d = np.concatenate([st.reshape(-1) for st in stats])
    return np.diag(1.0 / (s * d + lam))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_flat_products_against_the_blocks_statistics(xp, rng, family):
    net = nn.Sequential([("c", nn.Conv2D(2, 3, (2, 2), padding="VALID", data_format="NCHW")),
                         ("a", nn.Activation("tanh")), ("f", nn.Flatten()),
                         ("s", nn.ScaleAndShift(12)), ("d", nn.Dense(12, 4))])
    bp, batch = make_data(xp, rng, net, ce, 3, (2, 3, 3))
    fa = (bp, batch)
    est = BlockDiagonalCurvature(net, ce, layer_to_block=FAMILIES[family])
    st = est.init(None, fa, exact_powers_to_cache=-1.0, approx_powers_to_cache=-1.0)
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, 3, None, fa, "ggn_exact")
    st = est.update_cache(st, 0.3, -1.0, -1.0, False)
    v = xp.round_host(rng.standard_normal(net.num_params))
    host_states = [type(bs)(tuple(type(x)(raw=xp.to_numpy(x.raw), weight=x.weight)
                                  for x in bs.statistics), bs.cache, bs.like)
                   for bs in st.blocks_states]
    for exact_power in (True, False):
        dense = [_block_oracle(bl, hs, 0.3, exact_power)
                 for bl, hs in zip(est.blocks, host_states, strict=True)]
        expected = np.concatenate([m @ v[net.layer_slices()[i]] for m, i in
                                   zip(dense, net.parametric_layers, strict=True)])
        # Davis–Kahan for EKFAC's separately computed basis (see tests/test_blocks_ekfac.py)
        ratio = 1.0
        if family == "ekfac":
            for hs in host_states:
                for m in [np.asarray(x.value) for x in hs.statistics[:2]]:
                    if m.ndim == 2:
                        ev = np.linalg.eigvalsh(m)
                        ratio = max(ratio, np.abs(ev).max() / np.diff(ev).min())
        for use_cached in (False, True):
            got = est.multiply_matpower(st, xp.asarray(v), 0.3, -1.0, exact_power, use_cached)
            xp.assert_close(got, expected, rtol=tol(xp) * ratio)


# the conv layer's forward pass hands its KFC input factor Ω to the Kronecker block
# (Conv2D.forward_with_tap): the update equals the one that recomputes Ω from the inputs
def tapnet(fmt, use_bias, max_bytes):
    extra = {} if max_bytes is None else {"max_temporary_bytes": max_bytes}
    return nn.Sequential([
        ("c1", nn.Conv2D(2, 3, (2, 2), padding="SAME", data_format=fmt, use_bias=use_bias,
                         **extra)),
        ("a1", nn.Activation("tanh")),
        ("c2", nn.Conv2D(3, 2, (2, 1), stride=(2, 1), dilation=(1, 2), data_format=fmt,
                         use_bias=not use_bias, **extra)),
        ("f", nn.Flatten()), ("d", nn.Dense(20, 3))])


@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("max_bytes", [None, 1])  # one chunk; one example per chunk
@pytest.mark.parametrize("mode", ["ggn_exact", "fisher_empirical"])
def test_conv_forward_tap_update_equals_recomputing_the_input_factor(xp, rng, monkeypatch, fmt,
                                                                     use_bias, max_bytes, mode):
    net = tapnet(fmt, use_bias, max_bytes)
    in_shape = (4, 5, 2) if fmt == "NHWC" else (2, 4, 5)
    bp, batch = make_data(xp, rng, net, ce, 3, in_shape)
    est, tapped = run(net, ce, bp, batch, mode)
    assert est._taps == (True, False, True, False, False)
    monkeypatch.setattr(B.Conv2DTwoKroneckerFactored, "uses_layer_tap",
                        lambda self, layer, shape: False)
    est2, recomputed = run(net, ce, bp, batch, mode)
    assert not any(est2._taps)
    for one, two in zip(tapped.blocks_states, recomputed.blocks_states, strict=True):
        for s1, s2 in zip(one.statistics, two.statistics, strict=True):
            xp.assert_close(s1.value, xp.to_numpy(s2.value), rtol=tol(xp))


def test_a_conv_block_reads_the_tap_only_of_a_layer_with_its_own_patches(xp):
    layer = nn.Conv2D(2, 3, (2, 2), padding="SAME")
    shape = (5, 4, 4, 2)
    block = B.Conv2DTwoKroneckerFactored.from_layer(layer, shape)
    assert block.uses_layer_tap(layer, shape)
    assert block.uses_layer_tap(layer, (7, 4, 4, 2))  # Ω does not depend on N
    assert not block.uses_layer_tap(layer, (5, 6, 4, 2))  # other locations T
    for other in (nn.Conv2D(2, 3, (2, 2), padding="VALID"),
                  nn.Conv2D(2, 3, (2, 2), padding="SAME", stride=2),
                  nn.Conv2D(2, 3, (2, 2), padding="SAME", use_bias=False),
                  nn.Conv2D(2, 3, (2, 2), padding="SAME", data_format="NCHW"),
                  nn.Dense(2, 3)):
        assert not block.uses_layer_tap(other, shape)
    unsym = B.Conv2DTwoKroneckerFactored.from_layer(layer, shape, symmetrize=False)
    assert not unsym.uses_layer_tap(layer, shape)  # its A is not the symmetrised Ω
    assert not B.Conv2DFull.from_layer(layer, shape).uses_layer_tap(layer, shape)


def test_a_user_block_that_takes_no_tap_is_updated_without_one(xp, rng):
    class OldSignature(B.Conv2DTwoKroneckerFactored):  # an override written before taps
        def uses_layer_tap(self, layer, input_shape):
            return False

        def update_from_output_vectors(self, state, layer, inputs, outputs_grads, batch_size,
                                       weight_sharing, ema_old, ema_new):
            return super().update_from_output_vectors(state, layer, inputs, outputs_grads,
                                                      batch_size, weight_sharing, ema_old,
                                                      ema_new)

    net = convnet()
    bp, batch = make_data(xp, rng, net, ce, 3, (2, 3, 3))
    _, got = run(net, ce, bp, batch, "ggn_exact", layer_to_block={"c": OldSignature})
    _, want = run(net, ce, bp, batch, "ggn_exact")
    for s1, s2 in zip(got.blocks_states[0].statistics, want.blocks_states[0].statistics,
                      strict=True):
        xp.assert_close(s1.value, xp.to_numpy(s2.value), rtol=tol(xp))


_SEMIDEFINITE_NETS = {  # a network with a layer of each kind, and its inputs
    "dense": (lambda: nn.Sequential([("d1", nn.Dense(3, 4)), ("a", nn.Activation("tanh")),
                                     ("d2", nn.Dense(4, 3))]),
              lambda rng, n: rng.standard_normal((n, 3))),
    "conv2d": (lambda: nn.Sequential([("c", nn.Conv2D(2, 2, (2, 2))),
                                      ("a", nn.Activation("tanh")), ("f", nn.Flatten()),
                                      ("d", nn.Dense(8, 3))]),
               lambda rng, n: rng.standard_normal((n, 3, 3, 2))),
    "scale_and_shift": (lambda: nn.Sequential([("d1", nn.Dense(3, 4)),
                                               ("s", nn.ScaleAndShift(4)),
                                               ("a", nn.Activation("tanh")),
                                               ("d2", nn.Dense(4, 3))]),
                        lambda rng, n: rng.standard_normal((n, 3))),
    "embedding": (lambda: nn.Sequential([("e", nn.Embedding(5, 3)), ("f", nn.Flatten()),
                                         ("d", nn.Dense(6, 3))]),
                  lambda rng, n: rng.integers(0, 5, size=(n, 2))),
}


def test_every_layer_kind_is_in_the_semidefinite_check():
    assert set(_SEMIDEFINITE_NETS) == set(B.registered_layer_blocks())


@pytest.mark.parametrize("kind,name", [
    (kind, name) for kind in _SEMIDEFINITE_NETS
    for name, cls in B.registered_layer_blocks()[kind].items() if cls.semidefinite_statistics])
def test_declared_semidefinite_statistics_are_semidefinite(rng, kind, name):
    """A block's ``semidefinite_statistics`` lets the estimator scan only their diagonals:
    the declaration must hold (every eigenvalue ≥ −rounding, symmetric) for each family
    that makes it, after two updates from random data."""
    make_net, make_x = _SEMIDEFINITE_NETS[kind]
    net = make_net()
    params = net.init_params(rng, np.zeros(1))
    n = 7
    batch = (make_x(rng, n), rng.integers(0, 3, size=n))
    est = BlockDiagonalCurvature(net, ce, layer_to_block={kind: name})
    state = est.init(None, (params, batch))
    for mode in ("fisher_empirical", "fisher_gradients"):
        state = est.update_curvature_matrix_estimate(state, 0.5, 0.5, n, rng, (params, batch),
                                                     mode)
    for block, st in zip(est.blocks, state.blocks_states, strict=True):
        for i in block.semidefinite_statistics:
            s = np.asarray(st.statistics[i].value)
            assert s.ndim == 2 and s.shape[0] == s.shape[1]
            scale = max(float(np.max(np.abs(s))), 1e-300)
            np.testing.assert_allclose(s, s.T, rtol=0, atol=1e-13 * scale)
            assert np.linalg.eigvalsh((s + s.T) / 2).min() >= -1e-12 * scale, (name, i)
            assert np.abs(s).max() <= np.sqrt(np.outer(np.diag(s), np.diag(s))).max() * (
                1 + 1e-12)


def test_an_update_scans_the_diagonal_of_a_semidefinite_statistic(monkeypatch):
    """The statistics entering the state: a Kronecker factor's diagonal (n entries) is
    scanned, not the factor (n² entries); a statistic without the declaration in full."""
    import kfac_ref._backend as backend

    rng = np.random.default_rng(4)
    net = _SEMIDEFINITE_NETS["dense"][0]()
    params = net.init_params(rng, np.zeros(1))
    batch = (rng.standard_normal((6, 3)), rng.integers(0, 3, size=6))
    sizes = {}
    real = backend.all_finite
    for name in ("kronecker", "kpsvd"):
        est = BlockDiagonalCurvature(net, ce, layer_to_block={"dense": name})
        state = est.init(None, (params, batch))
        scanned = []
        monkeypatch.setattr(backend, "all_finite",
                            lambda ns, x, seen=scanned: seen.append(x.shape) or real(ns, x))
        est.update_curvature_matrix_estimate(state, 0.0, 1.0, 6, rng, (params, batch),
                                             "ggn_exact")
        monkeypatch.undo()
        sizes[name] = scanned[-4:]  # the four statistics, scanned last
    assert sizes["kronecker"] == [(4,), (4,), (5,), (3,)]
    assert sizes["kpsvd"] == [(4, 4), (4, 4), (5, 5), (3, 3)]
