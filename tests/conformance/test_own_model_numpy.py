"""The own-model reference maths (``conformance.own_model``) against NumPy loops, with no
torch and no JAX, so that the README's test command checks it.

Oracles: patches built by hand (explicit loops over examples, output locations and kernel
taps, zero padding, TF's "SAME" split with the low side ``total // 2``, strides, dilation),
the patch vector in unfold's ``(C, kh, kw)`` order or kfac_ref's ``(kh, kw, C)`` order with
the bias coordinate last, and explicit sums of outer products:
``A = (1/(N|T|)) Σ_{n,t} ā āᵀ``, ``G = (1/N) Σ_{n,t,k} g gᵀ`` (KFAC-expand) or the mean
patch and the summed vectors per example (KFAC-reduce).  Both sides are float64 sums of at
most a few hundred terms of size O(1): ``rtol = 4096·eps`` (tests/conftest.py).

``check_factors``' tolerance is tested at its exact value ``16 (N|T|K + d) ε`` and on both
sides of it.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_allclose_normwise

from conformance.own_model import (
    check_factors,
    conv_reference_factors,
    dense_reference_factors,
    layer_alternatives,
)

RTOL = 4096 * np.finfo(np.float64).eps
EPS64 = float(np.finfo(np.float64).eps)
EPS32 = float(np.finfo(np.float32).eps)


def outer_mean(rows, n):
    return sum(np.outer(r, r) for r in rows) / n


# -- dense -------------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("bias", [True, False])
def test_dense_reference_factors_against_loops(shared, sharing, bias):
    rng = np.random.default_rng(3)
    n, s, d_in, d_out, k = 3, 4, 3, 5, 2
    a = rng.standard_normal((n, s, d_in) if shared else (n, d_in))
    g = rng.standard_normal((k, n, s, d_out) if shared else (k, n, d_out))
    fa, fg, t = dense_reference_factors(a, g, bias=bias, sharing=sharing)

    def hom(v):
        return np.append(v, 1.0) if bias else v

    if not shared:
        want_a = outer_mean([hom(a[i]) for i in range(n)], n)
        want_g = outer_mean([g[j, i] for j in range(k) for i in range(n)], n)
        want_t = 1
    elif sharing == "expand":
        want_a = outer_mean([hom(a[i, u]) for i in range(n) for u in range(s)], n * s)
        want_g = outer_mean([g[j, i, u] for j in range(k) for i in range(n) for u in range(s)],
                            n)
        want_t = s
    else:
        want_a = outer_mean([hom(a[i].mean(axis=0)) for i in range(n)], n)
        want_g = outer_mean([g[j, i].sum(axis=0) for j in range(k) for i in range(n)], n)
        want_t = s
    assert t == want_t
    assert fa.shape == (d_in + bias, d_in + bias) and fg.shape == (d_out, d_out)
    assert_allclose_normwise(fa, want_a, RTOL)
    assert_allclose_normwise(fg, want_g, RTOL)


# -- conv --------------------------------------------------------------------------------
def _pads(size, k, stride, dil, padding, axis):
    eff = dil * (k - 1) + 1
    if padding == "VALID":
        return 0, 0
    if padding == "SAME":
        out = -(-size // stride)
        total = max((out - 1) * stride + eff - size, 0)
        return total // 2, total - total // 2
    return padding[axis]


def loop_patches(x_nhwc, kernel, padding, strides, dilation, bias, order):
    """[N, |T|, K] patches from explicit loops (zero padding), and the output grid."""
    n, h, w, c = x_nhwc.shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilation
    pt, pb = _pads(h, kh, sh, dh, padding, 0)
    pl, pr = _pads(w, kw, sw, dw, padding, 1)
    ho = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    wo = (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((n, ho * wo, kh * kw * c + bias))
    for e in range(n):
        for i in range(ho):
            for j in range(wo):
                vec = np.zeros(kh * kw * c + bias)
                for di in range(kh):
                    for dj in range(kw):
                        r, q = i * sh - pt + di * dh, j * sw - pl + dj * dw
                        for ch in range(c):
                            val = x_nhwc[e, r, q, ch] if 0 <= r < h and 0 <= q < w else 0.0
                            idx = (ch * kh * kw + di * kw + dj if order == "chw"
                                   else (di * kw + dj) * c + ch)
                            vec[idx] = val
                if bias:
                    vec[-1] = 1.0
                out[e, i * wo + j] = vec
    return out, (ho, wo)


CONV_CASES = [  # (data_format, padding, strides, dilation, bias, sharing, order)
    ("NHWC", "VALID", (1, 1), (1, 1), True, "expand", "chw"),
    ("NCHW", "SAME", (2, 2), (1, 1), True, "expand", "hwc"),
    ("NHWC", ((1, 0), (0, 2)), (1, 2), (2, 1), False, "reduce", "chw"),
    ("NCHW", "SAME", (1, 1), (1, 2), True, "reduce", "hwc"),
]


@pytest.mark.parametrize("case", range(len(CONV_CASES)))
def test_conv_reference_factors_against_loops(case):
    fmt, padding, strides, dilation, bias, sharing, order = CONV_CASES[case]
    rng = np.random.default_rng(case)
    n, h, w, c, o, k, kernel = 2, 5, 4, 2, 3, 2, (2, 3)
    x = rng.standard_normal((n, h, w, c))
    patches, (ho, wo) = loop_patches(x, kernel, padding, strides, dilation, bias, order)
    g = rng.standard_normal((k, n, ho, wo, o))
    xin = x if fmt == "NHWC" else x.transpose(0, 3, 1, 2)
    gin = g if fmt == "NHWC" else g.transpose(0, 1, 4, 2, 3)
    fa, fg, t = conv_reference_factors(xin, gin, kernel=kernel, padding=padding,
                                       strides=strides, dilation=dilation, bias=bias,
                                       sharing=sharing, data_format=fmt, order=order)
    assert t == ho * wo
    gt = g.reshape(k, n, ho * wo, o)
    if sharing == "expand":
        want_a = outer_mean(patches.reshape(-1, patches.shape[-1]), n * t)
        want_g = outer_mean(gt.reshape(-1, o), n)
    else:
        want_a = outer_mean(patches.mean(axis=1), n)
        want_g = outer_mean([gt[j, e].sum(axis=0) for j in range(k) for e in range(n)], n)
    assert_allclose_normwise(fa, want_a, RTOL)
    assert_allclose_normwise(fg, want_g, RTOL)


# -- alternatives --------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["chw", "hwc"])
def test_layer_alternatives_against_hand_permutations(order):
    rng = np.random.default_rng(5)
    c, kernel = 2, (2, 3)
    x = rng.standard_normal((3, 4, 5, c))
    patches, (ho, wo) = loop_patches(x, kernel, "VALID", (1, 1), (1, 1), True, order)
    other_order = "hwc" if order == "chw" else "chw"
    other, _ = loop_patches(x, kernel, "VALID", (1, 1), (1, 1), True, other_order)
    a = outer_mean(patches.reshape(-1, patches.shape[-1]), 3 * ho * wo)
    a_other = outer_mean(other.reshape(-1, other.shape[-1]), 3 * ho * wo)
    ref = {"A": a, "G": np.eye(3), "N": 3, "T": ho * wo, "K": 1, "kind": "conv2d",
           "kernel": kernel, "c_in": c, "bias": True, "order": order}
    others = {"empirical_fisher": {"L": {"G": 2 * np.eye(3)}},
              "sharing": {"L": {"A": 3 * a, "G": 4 * np.eye(3)}}}
    alts = layer_alternatives("L", ref, others, "fisher_exact", "expand")
    first = np.r_[a.shape[0] - 1, 0:a.shape[0] - 1]  # the bias coordinate moved first
    assert_allclose_normwise(alts["A"]["bias_position"], a[np.ix_(first, first)], 0)
    assert_allclose_normwise(alts["A"]["patch_order"], a_other, RTOL)
    assert_allclose_normwise(alts["A"]["patch_order+bias_position"],
                             a_other[np.ix_(first, first)], RTOL)
    assert_allclose_normwise(alts["G"]["empirical_fisher"], 2 * np.eye(3), 0)
    assert "true_fisher" not in alts["G"]
    assert_allclose_normwise(alts["A"]["reduce_instead_of_expand"], 3 * a, 0)
    assert_allclose_normwise(alts["G"]["reduce_instead_of_expand"], 4 * np.eye(3), 0)
    # a dense layer without bias has no bias or patch alternative; |T| = 1 no sharing one
    dense = {"A": a[:-1, :-1], "G": np.eye(3), "N": 3, "T": 1, "K": 1, "kind": "dense",
             "bias": False}
    assert layer_alternatives("L", dense, others, "fisher_exact", "expand")["A"] == {}


# -- check_factors' tolerance ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_check_factors_tolerance_is_the_documented_formula(dtype):
    rng = np.random.default_rng(9)
    n, t, k = 4, 3, 5
    a, g = rng.standard_normal((7, 4)), rng.standard_normal((6, 3))
    a, g = a.T @ a, g.T @ g  # 4×4 and 3×3
    ref = {"L": {"A": a, "G": g, "N": n, "T": t, "K": k, "kind": "dense", "bias": True}}
    alts = {"L": {"A": {}, "G": {}}}
    eps = EPS32 if dtype == np.float32 else EPS64
    want = {"A": 16 * (n * t * 1 + 4) * eps, "G": 16 * (n * t * k + 3) * eps}
    # exact factors pass, with the tolerance of the formula
    res = check_factors(ref, {"L": {"A": a.astype(dtype), "G": g.astype(dtype)}}, alts,
                        "fisher_exact")
    assert res.ok
    for chk in res.checks:
        assert chk.rtol == pytest.approx(want[chk.factor], rel=1e-12)
    # both sides of the boundary: a relative Frobenius error of 0.9·rtol passes, 1.1·rtol
    # fails (the perturbation is a multiple of the factor, so the error is that multiple;
    # rounding to float32 adds at most eps32 ≈ 1.2e-7, below 0.1·rtol ≥ 0.1·16·16·eps32)
    for fac, m in (("A", a), ("G", g)):
        for f, ok in ((0.9, True), (1.1, False)):
            user = {"L": {fac: (m * (1 + f * want[fac])).astype(dtype)}}
            got = check_factors(ref, user, alts, "fisher_exact").checks[0]
            assert got.ok is ok, (fac, f, got.rel_err, want[fac])
