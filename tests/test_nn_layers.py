"""Reference layers: forward against explicit loops, JVP/VJP/R-operator against finite differences
and adjoint identities, parameter orderings against PyTorch/Haiku layouts, error paths.

Finite-difference tolerances
----------------------------
The oracles are central differences ``(F(θ + h v) − F(θ − h v)) / (2h)`` of the float64 NumPy
forward map (itself checked against explicit loops below).  Their error is
``h²/6 · max|F'''| + eps64 · max|F| / h``.  With ``h = 1e-4`` and the small, O(1)-scaled
networks used here (|F'''| ≲ 10 for tanh/sigmoid/softplus compositions, |F| ≲ 10) this is
``≲ 2e-8 + 2e-11``, so ``FD_RTOL = 1e-6`` (relative to the max entry, itself O(1)) leaves a
safety factor ≳ 50.  For maps that are at most quadratic in the step (dense and conv layers are
bilinear in (θ, x) and linear in g) the central difference is exact up to rounding.  Float32
cells compare with ``max(FD_RTOL, xp.rtol)``: their own rounding (4096·eps32 ≈ 5e-4) dominates.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import assert_allclose_normwise

import kfac_ref.nn as nn
from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref.factors import conv_input_factor_tap

FD_H = 1e-4
FD_RTOL = 1e-6


def _np_tuple(params, f):
    return tuple(tuple(f(a) for a in p) for p in params)


def _rtol(xp):
    return max(FD_RTOL, xp.rtol)


# ---------------------------------------------------------------------------------------------
# explicit-loop oracles
# ---------------------------------------------------------------------------------------------
def conv_oracle(x, w, b, stride, pads, dilation):
    """Direct 2-D convolution, NHWC input, HWIO kernel, explicit ((t, b), (l, r)) padding."""
    n, h, wd, c = x.shape
    kh, kw, _, co = w.shape
    xp_ = np.zeros((n, h + pads[0][0] + pads[0][1], wd + pads[1][0] + pads[1][1], c))
    xp_[:, pads[0][0]:pads[0][0] + h, pads[1][0]:pads[1][0] + wd] = x
    ho = (xp_.shape[1] - (kh - 1) * dilation[0] - 1) // stride[0] + 1
    wo = (xp_.shape[2] - (kw - 1) * dilation[1] - 1) // stride[1] + 1
    y = np.zeros((n, ho, wo, co))
    for i, j, a, bb in itertools.product(range(ho), range(wo), range(kh), range(kw)):
        row, col = i * stride[0] + a * dilation[0], j * stride[1] + bb * dilation[1]
        y[:, i, j] += xp_[:, row, col] @ w[a, bb]
    return y + (0 if b is None else b)


def same_pads(size, k, s, d):
    out = -(-size // s)
    total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
    return (total // 2, total - total // 2)


def case_pads(case):
    """((top, bottom), (left, right)) of a CONV_CASES row: TF's SAME split, zero for VALID,
    the explicit padding as given."""
    h, w, _, _, k, s, pad, d, _ = case
    if pad == "SAME":
        return (same_pads(h, k[0], s[0], d[0]), same_pads(w, k[1], s[1], d[1]))
    return ((0, 0), (0, 0)) if pad == "VALID" else pad


CONV_CASES = [
    # (H, W, c_in, c_out, kernel, stride, padding, dilation, fmt)
    (5, 4, 2, 3, (3, 2), (1, 1), "VALID", (1, 1), "NHWC"),
    (6, 5, 2, 2, (3, 3), (2, 1), "SAME", (1, 2), "NHWC"),
    (5, 5, 1, 2, (2, 3), (2, 2), ((1, 0), (2, 1)), (1, 1), "NCHW"),
    (7, 6, 2, 3, (3, 2), (1, 2), "SAME", (2, 1), "NCHW"),
    (6, 7, 2, 2, (2, 2), (3, 2), "VALID", (1, 1), "NHWC"),  # last row and column never read
    # the adjoint sums per stride phase: every offset in one phase (d = s), then each offset
    # in its own phase with shifts (d = 3, s = 2), and padding wider than the kernel reach
    (8, 7, 1, 2, (3, 3), (2, 2), "SAME", (2, 2), "NHWC"),
    (9, 8, 2, 1, (3, 2), (2, 2), ((3, 1), (0, 2)), (3, 3), "NCHW"),
]


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_forward_matches_loop(xp, rng, case):
    h, w, ci, co, k, s, pad, d, fmt = case
    layer = nn.Conv2D(ci, co, k, stride=s, padding=pad, dilation=d, data_format=fmt)
    x = rng.standard_normal((2, h, w, ci))
    kern = rng.standard_normal((*k, ci, co))
    b = rng.standard_normal(co)
    pads = case_pads(case)
    xin = x if fmt == "NHWC" else x.transpose(0, 3, 1, 2)
    out = layer.forward((xp.asarray(kern), xp.asarray(b)), xp.asarray(xin))
    exp = conv_oracle(xp.round_host(x), xp.round_host(kern), xp.round_host(b), s, pads, d)
    if fmt == "NCHW":
        exp = exp.transpose(0, 3, 1, 2)
    assert tuple(out.shape) == layer.output_shape(xin.shape)
    xp.assert_close(out, exp)


def kfc_input_factor_oracle(x, k, stride, pads, dilation, use_bias):
    """Ω = Σ_{n,t} p̄ p̄ᵀ / (N|T|) from patches read by explicit loops (NHWC input; the
    patch is ordered (kernel row, kernel column, channel), the HWIO kernel's row order)."""
    n, h, wd, c = x.shape
    xp_ = np.zeros((n, h + pads[0][0] + pads[0][1], wd + pads[1][0] + pads[1][1], c))
    xp_[:, pads[0][0]:pads[0][0] + h, pads[1][0]:pads[1][0] + wd] = x
    ho = (xp_.shape[1] - (k[0] - 1) * dilation[0] - 1) // stride[0] + 1
    wo = (xp_.shape[2] - (k[1] - 1) * dilation[1] - 1) // stride[1] + 1
    rows = []
    for i, j in itertools.product(range(ho), range(wo)):
        p = np.concatenate([xp_[:, i * stride[0] + a * dilation[0], j * stride[1] + b * dilation[1]]
                            for a, b in itertools.product(range(k[0]), range(k[1]))], axis=1)
        rows.append(np.concatenate([p, np.ones((n, 1))], axis=1) if use_bias else p)
    rows = np.concatenate(rows, axis=0)
    return rows.T @ rows / rows.shape[0]


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("max_bytes", [None, 1])  # one chunk; one example per chunk
def test_conv_forward_tap_is_the_kfc_input_factor_of_the_forwards_patches(xp, rng, case,
                                                                          use_bias, max_bytes):
    h, w, ci, co, k, s, pad, d, fmt = case
    extra = {} if max_bytes is None else {"max_temporary_bytes": max_bytes}
    layer = nn.Conv2D(ci, co, k, stride=s, padding=pad, dilation=d, data_format=fmt,
                      use_bias=use_bias, **extra)
    x = rng.standard_normal((3, h, w, ci))
    params = (xp.asarray(rng.standard_normal((*k, ci, co))),)
    if use_bias:
        params += (xp.asarray(rng.standard_normal(co)),)
    pads = case_pads(case)
    xin = xp.asarray(x if fmt == "NHWC" else x.transpose(0, 3, 1, 2))
    tap = conv_input_factor_tap(layer.geometry(tuple(xin.shape)), use_bias)
    out, omega = layer.forward_with_tap(params, xin, tap)
    xp.assert_close(out, xp.to_numpy(layer.forward(params, xin)))
    xp.assert_close(omega, kfc_input_factor_oracle(xp.round_host(x), k, s, pads, d, use_bias))
    chunks = []  # the tap sees the patches of each chunk, every example once, in order
    layer.forward_with_tap(params, xin, lambda p: chunks.append(int(p.shape[0])) or 0.0)
    assert sum(chunks) == 3 and (max_bytes is None) == (chunks == [3])


def test_a_layer_taps_its_input_or_nothing(xp, rng):
    layer = nn.Dense(3, 2)
    params = tuple(xp.asarray(a) for a in layer.init_params(rng, np.zeros(1)))
    x = xp.asarray(rng.standard_normal((4, 3)))
    out, tap = layer.forward_with_tap(params, x, None)
    assert tap is None
    xp.assert_close(out, xp.to_numpy(layer.forward(params, x)))
    out, tap = layer.forward_with_tap(params, x, lambda u: u.T @ u)  # tap(x): one chunk
    xp.assert_close(tap, xp.to_numpy(x).T @ xp.to_numpy(x))
    xp.assert_close(out, xp.to_numpy(layer.forward(params, x)))


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_vjp_input_is_transpose_of_loop_convolution(xp, rng, case):
    """vjp_input(g) = J_xᵀ g with J_x assembled column by column from the explicit-loop
    convolution of unit images (no bias: the map is linear in x).  Independent of the
    library's patch extractor, so it checks the backward geometry (padding, stride, dilation,
    layout) entry by entry."""
    h, w, ci, co, k, s, pad, d, fmt = case
    layer = nn.Conv2D(ci, co, k, stride=s, padding=pad, dilation=d, data_format=fmt,
                      use_bias=False)
    pads = case_pads(case)
    kern = rng.standard_normal((*k, ci, co))
    rk = xp.round_host(kern)
    basis = np.eye(h * w * ci).reshape(-1, h, w, ci)  # NHWC unit images
    jac = conv_oracle(basis, rk, None, s, pads, d).reshape(h * w * ci, -1)  # [HWC, HoWoCo]
    out_shape = (2, *conv_oracle(basis[:1], rk, None, s, pads, d).shape[1:])
    g = rng.standard_normal(out_shape)  # NHWC cotangent
    exp = (g.reshape(2, -1) @ xp.round_host(jac).T).reshape(2, h, w, ci)
    xin = np.zeros((2, h, w, ci))
    if fmt == "NCHW":
        exp, xin, g = exp.transpose(0, 3, 1, 2), xin.transpose(0, 3, 1, 2), g.transpose(0, 3, 1, 2)
    got = layer.vjp_input((xp.asarray(kern),), xp.asarray(xin), xp.asarray(g))
    xp.check(got)
    xp.assert_close(got, exp)


def test_dense_scale_shift_embedding_forward(xp, rng):
    x = rng.standard_normal((3, 4, 5))
    w, b = rng.standard_normal((5, 2)), rng.standard_normal(2)
    out = nn.Dense(5, 2).forward((xp.asarray(w), xp.asarray(b)), xp.asarray(x))
    rx, rw, rb = xp.round_host(x), xp.round_host(w), xp.round_host(b)
    exp = np.array([[rx[n, t] @ rw + rb for t in range(4)] for n in range(3)])
    xp.assert_close(out, exp)

    s, t = rng.standard_normal(5), rng.standard_normal(5)
    out = nn.ScaleAndShift(5).forward((xp.asarray(s), xp.asarray(t)), xp.asarray(x))
    xp.assert_close(out, rx * xp.round_host(s) + xp.round_host(t))

    e = rng.standard_normal((7, 3))
    ids = rng.integers(0, 7, size=(4, 2))
    out = nn.Embedding(7, 3).forward((xp.asarray(e),), xp.asarray(ids))
    exp = np.array([[xp.round_host(e)[ids[n, j]] for j in range(2)] for n in range(4)])
    xp.assert_close(out, exp)


@pytest.mark.parametrize("kind", nn.ACTIVATIONS)
def test_activation_derivatives_match_formulas(xp, rng, kind):
    x = rng.standard_normal((4, 5)) * 3
    x[0, 0] = 40.0  # overflow guard for sigmoid/softplus
    x[0, 1] = -40.0
    v, d1, d2 = nn.activation_derivatives(kind, xp.asarray(x))
    r = xp.round_host(x)
    sig = 1 / (1 + np.exp(-r))
    ref = {
        "identity": (r, np.ones_like(r), np.zeros_like(r)),
        "tanh": (np.tanh(r), 1 - np.tanh(r) ** 2, -2 * np.tanh(r) * (1 - np.tanh(r) ** 2)),
        "sigmoid": (sig, sig * (1 - sig), sig * (1 - sig) * (1 - 2 * sig)),
        "relu": (np.maximum(r, 0), (r > 0).astype(float), np.zeros_like(r)),
        "softplus": (np.logaddexp(0, r), sig, sig * (1 - sig)),
    }[kind]
    for got, exp in zip((v, d1, d2), ref, strict=False):
        xp.assert_close(got, exp)
    # first and second derivative against central differences of the host formula
    if kind != "relu":
        f = {"identity": lambda z: z, "tanh": np.tanh, "sigmoid": lambda z: 1 / (1 + np.exp(-z)),
             "softplus": lambda z: np.logaddexp(0, z)}[kind]
        r2 = r[1:]
        fd1 = (f(r2 + FD_H) - f(r2 - FD_H)) / (2 * FD_H)
        fd2 = (f(r2 + FD_H) - 2 * f(r2) + f(r2 - FD_H)) / FD_H**2  # error h²/12 f'''' + 4 eps/h²
        assert_allclose_normwise(ref[1][1:], fd1, FD_RTOL)
        assert_allclose_normwise(ref[2][1:], fd2, 1e-4)


@pytest.mark.parametrize("kind", nn.ACTIVATIONS)
def test_a_forward_pass_forms_the_activation_cache_from_its_output_to_the_bit(xp, rng, kind):
    """Sequential.vjp_caches forms σ' from the layer's output where σ' is a function of it
    (tanh, sigmoid, ReLU): the same numbers, bit for bit, as the layer's own vjp_cache from
    its input (zeros and ReLU's kink included)."""
    x = rng.standard_normal((4, 3)) * 3
    x[0, :] = 0.0  # the first row's pre-activations are the bias: 0 and saturating values
    net = nn.Sequential([("d", nn.Dense(3, 5)), ("a", nn.Activation(kind)),
                         ("o", nn.Dense(5, 2))])
    init = net.init_params(rng, np.zeros((1, 3)))
    bias = np.array([0.0, 40.0, -40.0, 1.0, -1.0])
    params = tuple(tuple(xp.asarray(a) for a in p) for p in ((init[0][0], bias), (), init[2]))
    fwd = net.forward_pass(params, xp.asarray(x))
    cache = net.vjp_caches(fwd)[1]
    own = net.layers[1].vjp_cache((), fwd.inputs[1])
    np.testing.assert_array_equal(xp.to_numpy(cache), xp.to_numpy(own))
    assert cache.dtype == own.dtype


# ---------------------------------------------------------------------------------------------
# derivative maps of single layers
# ---------------------------------------------------------------------------------------------
def _layer_cases():
    return [
        ("dense2", nn.Dense(4, 3), (5, 4)),
        ("dense3", nn.Dense(4, 3), (2, 3, 4)),
        ("dense_nobias", nn.Dense(4, 3, use_bias=False), (5, 4)),
        ("conv_nhwc", nn.Conv2D(2, 3, (3, 2), stride=(2, 1), padding="SAME", dilation=(1, 2)),
         (2, 5, 6, 2)),
        ("conv_nchw", nn.Conv2D(2, 2, (2, 2), stride=1, padding=((1, 0), (0, 1)),
                                data_format="NCHW"), (2, 2, 4, 3)),
        ("scale_shift", nn.ScaleAndShift(3), (4, 2, 3)),
        ("scale_only", nn.ScaleAndShift(3, has_shift=False), (4, 3)),
        ("tanh", nn.Activation("tanh"), (3, 4)),
        ("sigmoid", nn.Activation("sigmoid"), (3, 4)),
        ("softplus", nn.Activation("softplus"), (3, 4)),
        ("relu", nn.Activation("relu"), (3, 4)),
        ("pool", nn.MeanPool(), (3, 2, 2, 4)),
        ("flatten", nn.Flatten(), (3, 2, 2)),
    ]


LAYER_CASES = _layer_cases()


@pytest.mark.parametrize("case", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_layer_jvp_vjp_rvjp(xp, rng, case):
    _, layer, shape = case
    x = rng.standard_normal(shape)
    if layer.kind == "activation" and layer.activation == "relu":
        x = np.sign(x) * (0.5 + np.abs(x))  # keep away from the kink by more than FD_H
    params = layer.init_params(rng, np.zeros(1))
    params = tuple(np.asarray(p) for p in params)
    dparams = tuple(rng.standard_normal(p.shape) for p in params)
    dx = rng.standard_normal(shape)
    y = np.asarray(layer.forward(params, x))
    g = rng.standard_normal(y.shape)
    rg = rng.standard_normal(y.shape)
    # host float64 oracles from the rounded inputs
    rp = tuple(xp.round_host(p) for p in params)
    rdp = tuple(xp.round_host(p) for p in dparams)
    rx, rdx, rgh, rrg = (xp.round_host(a) for a in (x, dx, g, rg))

    def fwd(p, z):
        return np.asarray(layer.forward(p, z))

    def shift(p, dp, eps):
        return tuple(a + eps * b for a, b in zip(p, dp, strict=False))

    fd_jvp = (fwd(shift(rp, rdp, FD_H), rx + FD_H * rdx)
              - fwd(shift(rp, rdp, -FD_H), rx - FD_H * rdx)) / (2 * FD_H)

    bp = tuple(xp.asarray(p) for p in params)
    bdp = tuple(xp.asarray(p) for p in dparams)
    bx, bdx, bg, brg = (xp.asarray(a) for a in (x, dx, g, rg))
    xp.assert_close(layer.jvp(bp, bx, bdp if params else None, bdx), fd_jvp, rtol=_rtol(xp))

    # VJP: adjoint identity <g, J v> = <Jᵀ g, v> against the float64 FD of <g, f>
    def obj(p, z):
        return float(np.sum(rgh * fwd(p, z)))

    gx = layer.vjp_input(bp, bx, bg)
    gp = layer.param_grads(bp, bx, bg)
    gp_ex = layer.param_grads(bp, bx, bg, per_example=True)
    lhs = sum(float(np.sum(xp.to_numpy(a) * d)) for a, d in zip(gp, rdp, strict=False)) + float(
        np.sum(xp.to_numpy(gx) * rdx))
    fd = (obj(shift(rp, rdp, FD_H), rx + FD_H * rdx)
          - obj(shift(rp, rdp, -FD_H), rx - FD_H * rdx)) / (2 * FD_H)
    scale = float(np.sum(np.abs(rgh * fd_jvp))) + 1.0
    assert abs(lhs - fd) <= _rtol(xp) * scale * 10, (lhs, fd)
    for a, b in zip(gp, gp_ex, strict=False):
        xp.assert_close(xp.xp.sum(b, axis=0), xp.to_numpy(a))
    # per-example cotangents: row n is the summed cotangent of the one-example batch n (a sum
    # check alone cannot see examples swapped or mixed)
    for i in range(shape[0]):
        single = layer.param_grads(bp, bx[i:i + 1, ...], bg[i:i + 1, ...])
        for a, b in zip(single, gp_ex, strict=True):
            xp.assert_close(b[i, ...], xp.to_numpy(a))

    # R-operator: directional derivative of the backward map along (dθ, dx, rg)
    def back(p, z, gg):
        gpp = layer.param_grads(p, z, gg)
        gxx = layer.vjp_input(p, z, gg)
        return [np.asarray(a) for a in gpp] + [np.asarray(gxx)]

    plus = back(shift(rp, rdp, FD_H), rx + FD_H * rdx, rgh + FD_H * rrg)
    minus = back(shift(rp, rdp, -FD_H), rx - FD_H * rdx, rgh - FD_H * rrg)
    fd_r = [(a - b) / (2 * FD_H) for a, b in zip(plus, minus, strict=False)]
    r_params, r_x = layer.rvjp(bp, bx, bdp if params else None, bdx, bg, brg)
    for got, exp in zip([*r_params, r_x], fd_r, strict=False):
        xp.assert_close(got, exp, rtol=_rtol(xp))


class _NoStackedOverride(nn.Activation):
    """A layer that relies on the base class's per-vector vjp_input_stacked."""

    def vjp_input_stacked(self, params, x, g, cache=None):
        return nn.Layer.vjp_input_stacked(self, params, x, g, cache)


@pytest.mark.parametrize("case", [*LAYER_CASES, ("base_default", _NoStackedOverride("tanh"),
                                                 (3, 4))],
                         ids=[c[0] for c in LAYER_CASES] + ["base_default"])
@pytest.mark.parametrize("cached", [False, True])
def test_stacked_vjp_is_the_per_vector_vjp(xp, rng, case, cached):
    """vjp_input_stacked on C stacked cotangents [C, *out] = the C calls of vjp_input,
    stacked: row c of the result is vector c's input cotangent (a sum or mean over C, or
    vectors mixed with examples, would not match)."""
    _, layer, shape = case
    c = 3
    params = tuple(xp.asarray(np.asarray(p)) for p in layer.init_params(rng, np.zeros(1)))
    x = xp.asarray(rng.standard_normal(shape))
    out_shape = tuple(layer.forward(tuple(np.asarray(xp.to_numpy(p)) for p in params),
                                    rng.standard_normal(shape)).shape)
    g = rng.standard_normal((c, *out_shape))
    cache = layer.vjp_cache(params, x) if cached else None
    got = layer.vjp_input_stacked(params, x, xp.asarray(g), cache)
    for j in range(c):
        want = layer.vjp_input(params, x, xp.asarray(g[j]))
        xp.assert_close(got[j, ...], xp.to_numpy(want))
    assert tuple(got.shape) == (c, *shape)


@pytest.mark.parametrize("case", CONV_CASES[:4])
def test_conv_stacked_vjp_chunks_the_stacked_examples(xp, rng, case):
    """With one example per chunk the stacked C·N examples run in C·N chunks and still give
    each vector's cotangent (the chunk bound counts stacked examples, not N)."""
    h, w, c_in, c_out, kernel, stride, padding, dilation, fmt = case
    layer = nn.Conv2D(c_in, c_out, kernel, stride=stride, padding=padding, dilation=dilation,
                      data_format=fmt, max_temporary_bytes=1)
    whole = nn.Conv2D(c_in, c_out, kernel, stride=stride, padding=padding, dilation=dilation,
                      data_format=fmt)
    shape = (2, h, w, c_in) if fmt == "NHWC" else (2, c_in, h, w)
    x = rng.standard_normal(shape)
    params = tuple(np.asarray(p) for p in layer.init_params(rng, np.zeros(1)))
    y = np.asarray(layer.forward(params, x))
    g = rng.standard_normal((3, *y.shape))
    bp = tuple(xp.asarray(p) for p in params)
    got = layer.vjp_input_stacked(bp, xp.asarray(x), xp.asarray(g))
    for j in range(3):
        want = whole.vjp_input(bp, xp.asarray(x), xp.asarray(g[j]))
        xp.assert_close(got[j, ...], xp.to_numpy(want))


def test_embedding_param_grads_and_rvjp(xp, rng):
    layer = nn.Embedding(6, 3)
    ids = rng.integers(0, 6, size=(5, 4))
    g = rng.standard_normal((5, 4, 3))
    e = xp.asarray(rng.standard_normal((6, 3)))
    (ge,) = layer.param_grads((e,), xp.asarray(ids), xp.asarray(g))
    exp = np.zeros((6, 3))
    rg = xp.round_host(g)
    for n in range(5):
        for t in range(4):
            exp[ids[n, t]] += rg[n, t]
    xp.assert_close(ge, exp)
    (gex,) = layer.param_grads((e,), xp.asarray(ids), xp.asarray(g), per_example=True)
    xp.assert_close(xp.xp.sum(gex, axis=0), exp)
    for n in range(5):
        exp_n = np.zeros((6, 3))
        for t in range(4):
            exp_n[ids[n, t]] += rg[n, t]
        xp.assert_close(gex[n, ...], exp_n)
    (rge,), rx = layer.rvjp((e,), xp.asarray(ids), None, None, xp.asarray(g), xp.asarray(g))
    assert rx is None
    xp.assert_close(rge, exp)


# ---------------------------------------------------------------------------------------------
# networks: flattening and conversions
# ---------------------------------------------------------------------------------------------
def small_net():
    return nn.Sequential([
        ("conv", nn.Conv2D(2, 2, (2, 2), padding="SAME")),
        ("act", nn.Activation("tanh")),
        ("norm", nn.ScaleAndShift(2)),
        ("flat", nn.Flatten()),
        ("a_dense", nn.Dense(2 * 3 * 3, 3)),
    ])


def test_flatten_order_and_roundtrip(xp, rng):
    net = small_net()
    params = net.init_params(rng, xp.asarray(np.zeros(1)))
    vec = net.flatten(params)
    assert vec.shape == (net.num_params,)
    host = _np_tuple(params, xp.to_numpy)
    # canonical order: per layer [W; b] row-major, bias last
    exp = np.concatenate([np.concatenate([host[0][0].reshape(-1, 2), host[0][1][None]]).ravel(),
                          np.concatenate([host[2][0], host[2][1]]),
                          np.concatenate([host[4][0], host[4][1][None]]).ravel()])
    xp.assert_close(vec, exp)
    back = net.unflatten(vec)
    for p, q in zip(params, back, strict=False):
        for a, b in zip(p, q, strict=False):
            xp.assert_close(b, xp.to_numpy(a))


def test_torch_and_kfac_jax_orders(xp, rng):
    net = small_net()
    params = net.init_params(rng, xp.asarray(np.zeros(1)))
    vec = net.flatten(params)
    tp = nn.to_torch_parameters(net, params)
    assert list(tp) == ["conv.weight", "conv.bias", "norm.weight", "norm.bias",
                        "a_dense.weight", "a_dense.bias"]
    host = _np_tuple(params, xp.to_numpy)
    assert tp["conv.weight"].shape == (2, 2, 2, 2)
    xp.assert_close(tp["a_dense.weight"], host[4][0].T)
    xp.assert_close(tp["conv.weight"], host[0][0].transpose(3, 2, 0, 1))
    flat_t = np.concatenate([xp.to_numpy(a).ravel() for a in tp.values()])
    xp.assert_close(nn.permute_vector(vec, nn.torch_permutation(net)), flat_t)
    # kfac-jax: layers sorted by name ("a_dense" < "conv" < "norm"); b before w, offset before scale
    kj = nn.to_kfac_jax_params(net, params)
    leaves = [kj[k1][k2] for k1 in sorted(kj) for k2 in sorted(kj[k1])]
    flat_j = np.concatenate([xp.to_numpy(a).ravel() for a in leaves])
    xp.assert_close(nn.permute_vector(vec, nn.kfac_jax_permutation(net)), flat_j)
    # the Haiku names and the resulting order, spelled out (independent of HAIKU_NAMES)
    assert {k: sorted(v) for k, v in kj.items()} == {
        "a_dense": ["b", "w"], "conv": ["b", "w"], "norm": ["offset", "scale"]}
    spelled = np.concatenate([host[4][1], host[4][0].ravel(), host[0][1], host[0][0].ravel(),
                              host[2][1], host[2][0]])
    xp.assert_close(nn.permute_vector(vec, nn.kfac_jax_permutation(net)), spelled)
    # matrices: Π M Πᵀ
    m = rng.standard_normal((net.num_params, net.num_params))
    perm = nn.torch_permutation(net)
    xp.assert_close(nn.permute_matrix(xp.asarray(m), perm), xp.round_host(m)[np.ix_(perm, perm)])


def test_network_jvp_vjp_adjoint_and_per_example(xp, rng):
    net = small_net()
    x = rng.standard_normal((3, 3, 3, 2))
    params = net.init_params(rng, xp.asarray(np.zeros(1)))
    v = rng.standard_normal(net.num_params)
    u = rng.standard_normal((3, 3))
    jv = net.jvp(params, xp.asarray(x), xp.asarray(v))
    jtu = net.vjp(params, xp.asarray(x), xp.asarray(u))
    per = net.vjp(params, xp.asarray(x), xp.asarray(u), per_example=True)
    assert per.shape == (3, net.num_params)
    xp.assert_close(xp.xp.sum(per, axis=0), xp.to_numpy(jtu))
    lhs = float(np.sum(xp.round_host(u) * xp.to_numpy(jv)))
    rhs = float(xp.to_numpy(jtu) @ xp.round_host(v))
    scale = float(np.sum(np.abs(xp.round_host(u) * xp.to_numpy(jv)))) + 1
    assert abs(lhs - rhs) <= xp.rtol * scale


def _dot(xp, a, b):
    """<a, b> of two host arrays and the scale of its rounding error."""
    prod = np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64)
    return float(np.sum(prod)), float(np.sum(np.abs(prod))) + 1.0


def test_tap_protocol_passes_satisfy_their_identities(xp, rng):
    """The public passes on one forward pass: the JVP and the backward pass are adjoint
    (<u, J v> = <Jᵀu, v>), the stacked backward is the per-vector backward, the R-backward
    with g = 0 is the backward of R{g}, and the Hessian of E = ½Σ‖f‖² (g = f, R{g} = Jv) it
    gives is symmetric (<w, H v> = <v, H w>)."""
    net = small_net()
    x = xp.asarray(rng.standard_normal((3, 3, 3, 2)))
    params = net.init_params(rng, xp.asarray(np.zeros(1)))
    host_v, host_w = rng.standard_normal(net.num_params), rng.standard_normal(net.num_params)
    v, w = xp.asarray(host_v), xp.asarray(host_w)
    us = rng.standard_normal((2, 3, 3))
    fwd = net.forward_pass(params, x)
    xp.assert_close(fwd.output, xp.to_numpy(net.forward(params, x)))
    assert fwd.inputs[0] is x and fwd.taps == (None,) * len(net)
    caches = net.vjp_caches(fwd)
    jv, dins = net.jvp_pass(fwd, v)
    assert len(dins) == len(net) and dins[0] is None
    grads, cots = net.backward_pass(fwd, xp.asarray(us[0]), caches=caches)
    jtu = xp.to_numpy(net.flatten(grads))
    lhs, scale = _dot(xp, xp.round_host(us[0]), xp.to_numpy(jv))
    assert abs(lhs - float(jtu @ xp.round_host(host_v))) <= xp.rtol * scale
    stacked = net.stacked_backward_pass(fwd, xp.asarray(us), caches=caches)
    for j in range(2):
        _, one = net.backward_pass(fwd, xp.asarray(us[j]), param_grads=False)
        for layer_stack, layer_one in zip(stacked, one, strict=True):
            xp.assert_close(layer_stack[j, ...], xp.to_numpy(layer_one))
    zero = xp.asarray(np.zeros(us[0].shape))
    r_only = net.r_backward_pass(fwd, v, dins, zero, xp.asarray(us[0]))
    xp.assert_close(net.flatten(r_only), jtu)

    def hvp(direction):
        f_dot, tangents = net.jvp_pass(fwd, direction)
        return xp.to_numpy(net.flatten(net.r_backward_pass(fwd, direction, tangents,
                                                           fwd.output, f_dot)))

    lhs, scale = _dot(xp, xp.round_host(host_w), hvp(v))
    rhs, _ = _dot(xp, xp.round_host(host_v), hvp(w))
    assert abs(lhs - rhs) <= 10 * xp.rtol * scale


def test_forward_pass_runs_each_tap_on_its_layer(xp, rng):
    net = small_net()
    x = xp.asarray(rng.standard_normal((3, 3, 3, 2)))
    params = net.init_params(rng, xp.asarray(np.zeros(1)))
    taps = [None] * len(net)
    taps[4] = lambda u: u.T @ u  # the dense layer's input
    fwd = net.forward_pass(params, x, taps)
    assert fwd.taps[:4] == (None,) * 4
    a = xp.to_numpy(fwd.inputs[4])
    xp.assert_close(fwd.taps[4], a.T @ a)
    with pytest.raises(AttributeError, match="read-only"):
        fwd.output = x


def test_tap_protocol_errors(xp, rng):
    net = small_net()
    x = xp.asarray(rng.standard_normal((3, 3, 3, 2)))
    params = net.init_params(rng, xp.asarray(np.zeros(1)))
    with pytest.raises(KFACTypeError, match="Sequential.forward_pass: taps must be"):
        net.forward_pass(params, x, [None])
    with pytest.raises(KFACTypeError, match="Sequential.forward_pass: taps must be"):
        net.forward_pass(params, x, [None, None, None, None, "tap"])
    fwd = net.forward_pass(params, x)
    other = small_net()
    with pytest.raises(KFACTypeError, match="Sequential.backward_pass: forward must be"):
        other.backward_pass(fwd, xp.asarray(np.zeros((3, 3))))
    with pytest.raises(KFACTypeError, match="Sequential.jvp_pass: forward must be"):
        net.jvp_pass((fwd.output, fwd.inputs), xp.asarray(np.zeros(net.num_params)))
    with pytest.raises(KFACValueError, match="Sequential.backward_pass: g_out"):
        net.backward_pass(fwd, xp.asarray(np.zeros((3, 2))))
    with pytest.raises(KFACValueError, match="Sequential.stacked_backward_pass: g_out"):
        net.stacked_backward_pass(fwd, xp.asarray(np.zeros((3, 3))))
    with pytest.raises(KFACValueError, match=r"Sequential.jvp_pass: dparams .*\[P\]"):
        net.jvp_pass(fwd, xp.asarray(np.zeros(net.num_params + 1)))
    with pytest.raises(KFACTypeError, match="Sequential.backward_pass: caches"):
        net.backward_pass(fwd, xp.asarray(np.zeros((3, 3))), caches=(None,))
    jv, dins = net.jvp_pass(fwd, xp.asarray(np.zeros(net.num_params)))
    with pytest.raises(KFACTypeError, match="Sequential.r_backward_pass: input_tangents"):
        net.r_backward_pass(fwd, xp.asarray(np.zeros(net.num_params)), dins[1:], jv, jv)
    bad = np.zeros((3, 3))
    bad[0, 0] = np.nan
    with pytest.raises(KFACValueError, match="Sequential.backward_pass: g_out .*finite"):
        net.backward_pass(fwd, xp.asarray(bad))


# ---------------------------------------------------------------------------------------------
# error paths
# ---------------------------------------------------------------------------------------------
def test_errors(xp, rng):
    with pytest.raises(KFACValueError, match="d_in"):
        nn.Dense(0, 3)
    with pytest.raises(KFACValueError, match="padding"):
        nn.Conv2D(1, 1, 2, padding="FULL")
    with pytest.raises(KFACTypeError, match="padding"):
        nn.Conv2D(1, 1, 2, padding=((1.5, 0), (0, 0)))
    with pytest.raises(KFACValueError, match="padding"):
        nn.Conv2D(1, 1, 2, padding=((1, -1), (0, 0)))
    with pytest.raises(KFACValueError, match="padding"):
        nn.Conv2D(1, 1, 2, padding=(1, 0))
    with pytest.raises(KFACValueError, match="data_format"):
        nn.Conv2D(1, 1, 2, data_format="CHWN")
    with pytest.raises(KFACValueError, match="kind"):
        nn.Activation("gelu")
    with pytest.raises(KFACValueError, match="unique"):
        nn.Sequential([("a", nn.Dense(2, 2)), ("a", nn.Dense(2, 2))])
    with pytest.raises(KFACTypeError, match="Layer"):
        nn.Sequential([("a", 3)])
    net = nn.Sequential([("d", nn.Dense(3, 2))])
    params = net.init_params(rng, xp.asarray(np.zeros(1)))
    with pytest.raises(KFACValueError, match="d_in"):
        net.forward(params, xp.asarray(np.zeros((2, 4))))
    bad = np.zeros((2, 3))
    bad[0, 0] = np.nan
    with pytest.raises(KFACValueError, match="finite"):
        net.forward(params, xp.asarray(bad))
    with pytest.raises(KFACValueError, match="shape"):
        net.forward(((xp.asarray(np.zeros((2, 2))), params[0][1]),), xp.asarray(np.zeros((2, 3))))
    with pytest.raises(KFACValueError, match=r"\[P\]"):
        net.jvp(params, xp.asarray(np.zeros((2, 3))), xp.asarray(np.zeros(5)))
    mism = nn.Sequential([("d", nn.Dense(3, 2)), ("a", nn.Activation("tanh")),
                          ("bad", nn.Dense(3, 1))])
    with pytest.raises(KFACValueError, match="layer 'bad'"):
        mism.forward(mism.init_params(rng, xp.asarray(np.zeros(1))), xp.asarray(np.zeros((2, 3))))
    with pytest.raises(KFACValueError, match="ids"):
        nn.Embedding(3, 2).check_input("f", xp.asarray(np.array([0, 3])))
    with pytest.raises(KFACValueError, match="channels"):
        nn.Conv2D(2, 1, 2).check_input("f", xp.asarray(np.zeros((1, 3, 3, 1))))
