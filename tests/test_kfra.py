"""KFRA (Botev et al. 2017): :func:`kfac_ref.curvature.kfra_factors` against a brute-force
recursion over explicit per-example loops, and its exactness facts against K-FAC's exact-mode
factors and the dense GGN."""

from __future__ import annotations

import numpy as np
import pytest

import kfac_ref.curvature as C
import kfac_ref.nn as nn
from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref.curvature import BlockDiagonalCurvature
from kfac_ref.losses import (
    CategoricalLogitsNegativeLogProbLoss,
    MultiBernoulliNegativeLogProbLoss,
    NormalMeanNegativeLogProbLoss,
)

W_SQ, VAR_SQ = 2.0, 0.5  # the squared-error loss: weight and variance (H_n = w / v · I)


def ce(f, y):
    return CategoricalLogitsNegativeLogProbLoss(f, targets=y)


def sq(f, y):
    return NormalMeanNegativeLogProbLoss(f, targets=y, variance=VAR_SQ, weight=W_SQ)


def bern(f, y):
    return MultiBernoulliNegativeLogProbLoss(f, targets=y)


# -- the oracle: host float64, one example at a time ------------------------------------------
def _phi(kind, h):
    """Value and derivative of an activation, written out independently of kfac_ref."""
    if kind == "identity":
        return h, np.ones_like(h)
    if kind == "tanh":
        t = np.tanh(h)
        return t, 1.0 - t * t
    if kind == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-h))
        return s, s * (1.0 - s)
    if kind == "relu":
        return np.maximum(h, 0.0), (h > 0).astype(np.float64)
    s = 1.0 / (1.0 + np.exp(-h))  # softplus
    return np.log1p(np.exp(h)), s


def _loss_hessian(loss, f):
    """Per-example Hessian of the loss at one output vector ``f`` [D]."""
    if loss is ce:
        p = np.exp(f - f.max())
        p /= p.sum()
        return np.diag(p) - np.outer(p, p)
    if loss is sq:
        return W_SQ / VAR_SQ * np.eye(f.size)
    s = 1.0 / (1.0 + np.exp(-f))  # multi-Bernoulli
    return np.diag(s * (1.0 - s))


def kfra_oracle(net, host_params, host_x, loss):
    """KFRA by explicit loops over the examples: (A_l, G̃_l) for every dense layer."""
    n = host_x.shape[0]
    # per layer: the N per-example inputs and activation derivatives
    ins, derivs = [[] for _ in net.layers], [[] for _ in net.layers]
    outs = []
    for k in range(n):
        h = host_x[k]
        for i, (layer, p) in enumerate(zip(net.layers, host_params, strict=True)):
            ins[i].append(h)
            if isinstance(layer, nn.Dense):
                h = h @ p[0] + (p[1] if layer.use_bias else 0.0)
            else:
                h, d = _phi(layer.activation, h)
                derivs[i].append(d)
        outs.append(h)
    m = np.zeros((outs[0].size, outs[0].size))
    for k in range(n):
        m += _loss_hessian(loss, outs[k])
    m /= n
    pairs = {}
    for i in range(len(net.layers) - 1, -1, -1):
        layer = net.layers[i]
        if isinstance(layer, nn.Dense):
            a = np.zeros((layer.d_in + layer.use_bias,) * 2)
            for k in range(n):
                ab = np.append(ins[i][k], 1.0) if layer.use_bias else ins[i][k]
                a += np.outer(ab, ab)
            pairs[i] = (a / n, m)
            w = host_params[i][0]
            m = w @ m @ w.T
        else:
            s = np.zeros_like(m)
            for k in range(n):
                s += np.outer(derivs[i][k], derivs[i][k])
            m = m * (s / n)
    return [pairs[i] for i in net.parametric_layers]


# -- networks and data ------------------------------------------------------------------------
def mlp(act="tanh", use_bias=True):
    return nn.Sequential([("d1", nn.Dense(3, 4, use_bias)), ("a1", nn.Activation(act)),
                          ("d2", nn.Dense(4, 3, use_bias)), ("a2", nn.Activation(act)),
                          ("d3", nn.Dense(3, 2, use_bias))])


NETS = {
    "tanh": lambda: mlp("tanh"),
    "sigmoid": lambda: mlp("sigmoid"),
    "relu": lambda: mlp("relu"),
    "softplus-no-bias": lambda: mlp("softplus", use_bias=False),
    # an activation on the inputs and one at the output; two dense layers in a row
    "activations-at-the-ends": lambda: nn.Sequential([
        ("a0", nn.Activation("tanh")), ("d1", nn.Dense(3, 4)), ("d2", nn.Dense(4, 3)),
        ("a2", nn.Activation("sigmoid")), ("d3", nn.Dense(3, 2)),
        ("a3", nn.Activation("tanh"))]),
    "one-layer": lambda: nn.Sequential([("d", nn.Dense(3, 2))]),
}


def make_data(xp, rng, net, loss, n):
    host_x = rng.standard_normal((n, net.layers[0].d_in if isinstance(net.layers[0], nn.Dense)
                                  else 3))
    host_p = net.init_params(rng, np.zeros(1))
    d_out = net.output_shape(host_x.shape)[-1]
    if loss is ce:
        host_y = rng.integers(0, d_out, size=n)
    elif loss is bern:
        host_y = rng.integers(0, 2, size=(n, d_out)).astype(np.float64)
    else:
        host_y = rng.standard_normal((n, d_out))
    params = tuple(tuple(xp.asarray(a) for a in p) for p in host_p)
    rounded = tuple(tuple(xp.round_host(a) for a in p) for p in host_p)
    return params, (xp.asarray(host_x), xp.asarray(host_y)), rounded, xp.round_host(host_x)


def kfac_exact_factors(net, loss, params, batch):
    """K-FAC's exact-mode (ggn_exact) factors (A, G) of every dense layer."""
    est = BlockDiagonalCurvature(net, loss)
    st = est.init(None, (params, batch))
    n = int(batch[0].shape[0])
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, n, None, (params, batch),
                                              "ggn_exact")
    return [tuple(s.value for s in bs.factors) for bs in st.blocks_states]


def kfra_and_kfac(xp, rng, act, loss, n):
    """An MLP with activation ``act``, one random batch of ``n`` examples, and its KFRA
    factors next to K-FAC's exact-mode factors."""
    net = mlp(act)
    params, batch, _, _ = make_data(xp, rng, net, loss, n)
    kfra = C.kfra_factors(net, loss, params, batch)
    return net, params, batch, kfra, kfac_exact_factors(net, loss, params, batch)


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# -- the brute-force oracle --------------------------------------------------------------------
@pytest.mark.parametrize("loss", [ce, sq, bern], ids=["ce", "sq", "bernoulli"])
@pytest.mark.parametrize("name", sorted(NETS))
def test_against_the_per_example_loops(xp, rng, name, loss):
    net = NETS[name]()
    params, batch, host_p, host_x = make_data(xp, rng, net, loss, 6)
    got = C.kfra_factors(net, loss, params, batch)
    want = kfra_oracle(net, host_p, host_x, loss)
    assert len(got) == len(want) == len(net.parametric_layers)
    for (a, g), (ea, eg) in zip(got, want, strict=True):
        xp.assert_close(a, ea)
        xp.assert_close(g, eg)
        gh = xp.to_numpy(g)
        assert np.array_equal(gh, gh.T)  # symmetrised
        assert np.linalg.eigvalsh(eg).min() >= -xp.rtol * np.abs(eg).max()  # PSD


def test_the_recursion_is_not_the_per_example_average(xp, rng):
    # negative control for the oracle: a per-example recursion (K-FAC's exact G) differs
    _, _, _, got, kfac = kfra_and_kfac(xp, rng, "tanh", ce, 6)
    assert rel_err(xp.to_numpy(got[0][1]), xp.to_numpy(kfac[0][1])) > 1e-3
    assert rel_err(xp.to_numpy(got[1][1]), xp.to_numpy(kfac[1][1])) > 1e-3


# -- exactness facts ---------------------------------------------------------------------------
@pytest.mark.parametrize("loss", [ce, sq], ids=["ce", "sq"])
def test_last_layer_and_input_factors_equal_kfac_exact_mode(xp, rng, loss):
    # G̃_L = (1/N) Σ H_n = K-FAC's exact-mode G of the last layer, for any N; A_l is K-FAC's
    _, _, _, got, kfac = kfra_and_kfac(xp, rng, "tanh", loss, 5)
    for (a, _), (ka, _) in zip(got, kfac, strict=True):
        xp.assert_close(a, xp.to_numpy(ka))
    xp.assert_close(got[-1][1], xp.to_numpy(kfac[-1][1]))


@pytest.mark.parametrize("loss", [ce, sq, bern], ids=["ce", "sq", "bernoulli"])
def test_one_example_every_layer_exact(xp, rng, loss):
    # N = 1: the Hadamard product with φ'φ'ᵀ is D W G̃ Wᵀ D, K-FAC's per-example recursion,
    # and A ⊗ G̃ is the exact GGN block
    net, params, batch, got, kfac = kfra_and_kfac(xp, rng, "tanh", loss, 1)
    dense = xp.to_numpy(C.ggn_matrix(net, loss, params, batch))
    slices = net.layer_slices()
    for (a, g), (_, kg), i in zip(got, kfac, net.parametric_layers, strict=True):
        xp.assert_close(g, xp.to_numpy(kg))
        exact = dense[slices[i], slices[i]]
        block = np.kron(xp.to_numpy(a), xp.to_numpy(g))
        assert np.abs(block - exact).max() <= xp.rtol * np.abs(exact).max()


@pytest.mark.parametrize("loss", [ce, sq], ids=["ce", "sq"])
def test_deep_linear_every_layer_equals_kfac_exact_mode(xp, rng, loss):
    # identity activations: J_{l,n} does not depend on n, so the average of J H_n Jᵀ is
    # J (average H) Jᵀ, for any loss and any N
    net, params, batch, got, kfac = kfra_and_kfac(xp, rng, "identity", loss, 5)
    for (_, g), (_, kg) in zip(got, kfac, strict=True):
        xp.assert_close(g, xp.to_numpy(kg))
    if loss is sq:  # ... and with squared error A ⊗ G̃ is the exact GGN block (K-FAC's theorem)
        dense = xp.to_numpy(C.ggn_matrix(net, loss, params, batch))
        slices = net.layer_slices()
        for (a, g), i in zip(got, net.parametric_layers, strict=True):
            exact = dense[slices[i], slices[i]]
            block = np.kron(xp.to_numpy(a), xp.to_numpy(g))
            assert np.abs(block - exact).max() <= xp.rtol * np.abs(exact).max()


def test_results_stay_in_the_inputs_namespace_device_and_dtype(xp, rng):
    net = mlp("relu")
    params, batch, _, _ = make_data(xp, rng, net, ce, 4)
    for a, g in C.kfra_factors(net, ce, params, batch):
        xp.check(a)
        xp.check(g)


def test_each_array_is_scanned_once(xp, rng, monkeypatch):
    # validate once: the door checks the parameters and the batch; the recursion scans nothing
    import kfac_ref._backend as B

    seen = []
    real = B.all_finite
    monkeypatch.setattr(B, "all_finite", lambda ns, a: seen.append(id(a)) or real(ns, a))
    net = mlp("tanh")
    params, batch, _, _ = make_data(xp, rng, net, sq, 4)
    C.kfra_factors(net, sq, params, batch)
    arrays = [a for p in params for a in p] + list(batch)
    assert [seen.count(id(a)) for a in arrays] == [1] * len(arrays)


# -- errors ------------------------------------------------------------------------------------
def _params(net):
    return net.init_params(np.random.default_rng(0), np.zeros(1))


@pytest.mark.parametrize("layer", [
    nn.Conv2D(1, 2, (2, 2)), nn.Flatten(), nn.MeanPool(), nn.ScaleAndShift(3),
    nn.Embedding(4, 3)], ids=lambda layer: type(layer).__name__)
def test_other_layers_are_refused_naming_the_layer(layer):
    net = nn.Sequential([("first", nn.Dense(3, 3)), ("odd", layer), ("last", nn.Dense(3, 2))])
    # refused before the parameters and the batch are looked at (None for both)
    with pytest.raises(KFACTypeError, match=r"kfra_factors: .*layer 'odd' is "
                       + type(layer).__name__):
        C.kfra_factors(net, ce, None, None)


def test_a_network_without_dense_layers_is_refused():
    net = nn.Sequential([("a", nn.Activation("tanh"))])
    with pytest.raises(KFACValueError, match="kfra_factors: net must have at least one Dense"):
        C.kfra_factors(net, ce, ((),), (np.zeros((2, 3)), None))


def test_a_position_axis_is_refused():
    net = nn.Sequential([("d1", nn.Dense(3, 2))])
    x = np.zeros((2, 4, 3))
    with pytest.raises(KFACValueError, match=r"kfra_factors: x must be \[N, d_in\].*'d1'"):
        C.kfra_factors(net, sq, _params(net), (x, np.zeros((2, 4, 2))))


def test_bad_arguments_are_named():
    net = mlp()
    p = _params(net)
    x, y = np.zeros((2, 3)), np.array([0, 1])
    with pytest.raises(KFACTypeError, match="kfra_factors: net must be a kfac_ref.nn.Seq"):
        C.kfra_factors([("d", nn.Dense(3, 2))], ce, p, (x, y))
    with pytest.raises(KFACValueError, match="kfra_factors: batch must be a pair"):
        C.kfra_factors(net, ce, p, x)
    with pytest.raises(KFACTypeError, match="kfra_factors: loss_fn must"):
        C.kfra_factors(net, "ce", p, (x, y))
    with pytest.raises(KFACValueError, match="kfra_factors: params"):
        C.kfra_factors(net, ce, p[:2], (x, y))
    with pytest.raises(KFACValueError, match="kfra_factors: x"):
        C.kfra_factors(net, ce, p, (np.full((2, 3), np.nan), y))
    with pytest.raises(KFACValueError, match="kfra_factors: x must hold at least one example"):
        C.kfra_factors(net, ce, p, (np.zeros((0, 3)), np.zeros(0, dtype=np.int64)))


# -- jax.jit ----------------------------------------------------------------------------------
def test_under_jax_jit(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    net = mlp("tanh")
    host_p = net.init_params(rng, np.zeros(1))
    host_x, host_y = rng.standard_normal((5, 3)), rng.integers(0, 2, size=5)
    params = jax.tree_util.tree_map(jnp.asarray, host_p)
    x, y = jnp.asarray(host_x), jnp.asarray(host_y)
    jitted = jax.jit(lambda p, x, y: C.kfra_factors(net, ce, p, (x, y)))
    want = kfra_oracle(net, host_p, host_x, ce)
    for (a, g), (ea, eg) in zip(jitted(params, x, y), want, strict=True):
        for got, exp in ((a, ea), (g, eg)):
            assert np.abs(np.asarray(got) - exp).max() <= 4096 * 2.2e-16 * np.abs(exp).max()
