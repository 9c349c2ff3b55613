"""Convolution factors (KFC input/output, diagonal) against explicit loops over examples and
output locations, for padding/stride/dilation combinations and both data formats; the
stateful classes (towers averaged, sources summed), subsampling with an explicit generator,
and the error paths."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_patches import oracle_pads, oracle_patches, spatial_tuple, to_channels_first

import kfac_ref.factors as F
from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref.patches import num_conv_locations

GEOMETRIES = [
    # (H, W, kh, kw, strides, dilation, padding)
    (5, 5, 3, 3, 1, 1, "SAME"),
    (6, 5, 3, 2, 2, 1, "VALID"),
    (6, 6, 2, 3, (2, 1), 2, "SAME"),
    (5, 6, 3, 2, 1, (1, 2), [(1, 0), (2, 1)]),
]


def loop_patches(x, kh, kw, s, d, padding):
    """[N, |T|, kh·kw·C] patches by the loop oracle, plus |T|."""
    s2, d2 = spatial_tuple(s, 2), spatial_tuple(d, 2)
    pads = oracle_pads(x.shape[1:3], (kh, kw), s2, d2, padding)
    p = oracle_patches(x, (kh, kw), s2, d2, pads)
    n, oh, ow = p.shape[:3]
    return p.reshape(n, oh * ow, -1), oh * ow, (oh, ow)


def omega_loop(x, kh, kw, s, d, padding, has_bias):
    """Ω = Σ_n Σ_t p̄ p̄ᵀ / (N |T|), accumulated one outer product at a time."""
    p, t, _ = loop_patches(x, kh, kw, s, d, padding)
    dim = p.shape[-1] + has_bias
    acc = np.zeros((dim, dim))
    for n, loc in itertools.product(range(p.shape[0]), range(t)):
        v = np.append(p[n, loc], 1.0) if has_bias else p[n, loc]
        acc += np.outer(v, v)
    return acc / (p.shape[0] * t)


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("geo", GEOMETRIES)
def test_conv_input_factor_matches_loops(xp, rng, geo, data_format, has_bias):
    h, w, kh, kw, s, d, padding = geo
    x = xp.round_host(rng.standard_normal((2, h, w, 3)))
    arr = xp.asarray(x if data_format == "NHWC" else to_channels_first(x))
    got = F.conv_input_kronecker_factor(arr, (kh, kw, 3, 4), padding, s, d, data_format,
                                        has_bias)
    xp.assert_close(got, omega_loop(x, kh, kw, s, d, padding, has_bias))


def test_conv_input_factor_bias_corner_and_row(xp, rng):
    """The homogeneous 1 sits at every location: corner 1, bias row = mean patch."""
    x = xp.round_host(rng.standard_normal((3, 5, 4, 2)))
    got = xp.to_numpy(F.conv_input_kronecker_factor(xp.asarray(x), (2, 2, 2, 1), "SAME",
                                                    has_bias=True))
    p, _, _ = loop_patches(x, 2, 2, 1, 1, "SAME")
    assert got[-1, -1] == pytest.approx(1.0, rel=xp.rtol)
    np.testing.assert_allclose(got[-1, :-1], p.reshape(-1, 8).mean(axis=0), rtol=xp.rtol,
                               atol=xp.rtol)


def test_conv_input_factor_nd_and_patch_fns(xp, rng):
    x1 = xp.round_host(rng.standard_normal((2, 7, 2)))  # 1-D conv
    p = oracle_patches(x1, (3,), (2,), (1,), oracle_pads((7,), (3,), (2,), (1,), "SAME"))
    pm = p.reshape(-1, 6)
    xp.assert_close(F.conv_input_kronecker_factor(xp.asarray(x1), (3, 2, 5), "SAME", 2,
                                                  data_format=None), pm.T @ pm / pm.shape[0])
    x = xp.asarray(rng.standard_normal((2, 5, 5, 3)))
    base = xp.to_numpy(F.conv_input_kronecker_factor(x, (3, 3, 3, 2), "SAME", 2, 1))
    img = F.conv_input_kronecker_factor(x, (3, 3, 3, 2), "SAME", (1, 2, 2, 1), (1, 1, 1, 1),
                                        extract_patches_fn="extract_image_patches")
    xp.assert_close(img, base)
    pw = F.conv_input_kronecker_factor(x, (1, 1, 3, 2), "VALID",
                                       extract_patches_fn="extract_pointwise_conv2d_patches")
    xn = xp.to_numpy(x).reshape(-1, 3)
    xp.assert_close(pw, xn.T @ xn / xn.shape[0])


def test_conv_input_factor_patch_mask(xp, rng):
    x = xp.round_host(rng.standard_normal((2, 4, 4, 2)))
    mask = xp.round_host(rng.uniform(0, 1, size=(2, 2, 2)))
    p, _, _ = loop_patches(x, 2, 2, 1, 1, "VALID")
    pm = p.reshape(-1, 8) * mask.reshape(-1)
    got = F.conv_input_kronecker_factor(xp.asarray(x), (2, 2, 2, 1), "VALID",
                                        patch_mask=xp.asarray(mask))
    xp.assert_close(got, pm.T @ pm / pm.shape[0])


def test_conv_input_factor_subsampling_uses_the_generator(xp, rng):
    x = xp.round_host(rng.standard_normal((10, 4, 4, 2)))
    arr = xp.asarray(x)
    got = F.conv_input_kronecker_factor(arr, (2, 2, 2, 1), "VALID", sub_sample_inputs=True,
                                        rng=np.random.default_rng(3))
    keep = np.random.default_rng(3).permutation(10)[:2]  # ceil(0.2 · 10) examples
    xp.assert_close(got, omega_loop(x[keep], 2, 2, 1, 1, "VALID", False))
    got = F.conv_input_kronecker_factor(arr, (2, 2, 2, 1), "VALID", sub_sample_inputs=True,
                                        rng=np.random.default_rng(3),
                                        inputs_to_extract_patches_factor=0.5)
    keep = np.random.default_rng(3).permutation(10)[:5]  # ceil(0.5 · 10) examples
    xp.assert_close(got, omega_loop(x[keep], 2, 2, 1, 1, "VALID", False))
    # patch subsampling: ceil(3.0 · 8) = 24 of the 90 patch rows, bias appended after
    got = F.conv_input_kronecker_factor(arr, (2, 2, 2, 1), "VALID", has_bias=True,
                                        sub_sample_patches=True, rng=np.random.default_rng(4))
    p, _, _ = loop_patches(x, 2, 2, 1, 1, "VALID")
    rows = p.reshape(-1, 8)[np.random.default_rng(4).permutation(90)[:24]]
    rows = np.concatenate([rows, np.ones((24, 1))], axis=1)
    xp.assert_close(got, rows.T @ rows / 24)


@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
def test_conv_output_factor_matches_loops(xp, rng, data_format):
    g = xp.round_host(rng.standard_normal((3, 4, 5, 6)))
    acc = np.zeros((6, 6))
    for n, i, j in itertools.product(range(3), range(4), range(5)):
        acc += np.outer(g[n, i, j], g[n, i, j])
    arr = xp.asarray(g if data_format == "NHWC" else to_channels_first(g))
    xp.assert_close(F.conv_output_kronecker_factor(arr, data_format), acc / 60)


def _loop_conv_case(xp, rng, geo, data_format, has_bias):
    """Two examples of ``geo`` (3 → 4 channels): the inputs and output gradients in
    ``data_format`` on the backend, the remaining arguments of the conv functions, and the
    per-example gradients DW_n = Σ_t p̄_{n,t} g_{n,t}ᵀ summed one location at a time."""
    h, w, kh, kw, s, d, padding = geo
    x = xp.round_host(rng.standard_normal((2, h, w, 3)))
    p, t, (oh, ow) = loop_patches(x, kh, kw, s, d, padding)
    g = xp.round_host(rng.standard_normal((2, oh, ow, 4)))
    dw = np.zeros((2, kh * kw * 3 + has_bias, 4))
    for n in range(2):
        for loc in range(t):
            v = np.append(p[n, loc], 1.0) if has_bias else p[n, loc]
            dw[n] += np.outer(v, g[n].reshape(t, 4)[loc])
    cf = (lambda a: a) if data_format == "NHWC" else to_channels_first
    args = ((kh, kw, 3, 4), s, padding, data_format, d, has_bias)
    return xp.asarray(cf(x)), xp.asarray(cf(g)), args, dw


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("geo", GEOMETRIES)
def test_conv_diagonal_factor_matches_loops(xp, rng, geo, data_format, has_bias):
    """The diagonal factor is the mean over examples of DW_n², DW_n from the loops."""
    x, g, args, dw = _loop_conv_case(xp, rng, geo, data_format, has_bias)
    xp.assert_close(F.conv_diagonal_factor(x, g, *args), (dw**2).mean(axis=0))


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("geo", GEOMETRIES)
def test_conv_per_example_gradients_match_loops(xp, rng, geo, data_format, has_bias):
    """DW_n = Σ_t p̄_{n,t} g_{n,t}ᵀ for each example, one location at a time."""
    x, g, args, dw = _loop_conv_case(xp, rng, geo, data_format, has_bias)
    xp.assert_close(F.conv_per_example_gradients(x, g, *args), dw)
    with pytest.raises(KFACValueError, match="conv_per_example_gradients: inputs and "
                       "outputs_grad must have the same batch"):
        F.conv_per_example_gradients(x, g[:1, ...], *args)


@given(seed=st.integers(0, 2**32 - 1), h=st.integers(2, 5), w=st.integers(2, 5),
       k=st.integers(1, 3), s=st.integers(1, 2), c=st.integers(1, 3),
       padding=st.sampled_from(["SAME", "VALID"]), has_bias=st.booleans())
def test_conv_factor_shapes_property(xp, seed, h, w, k, s, c, padding, has_bias):
    """Shapes, symmetry and PSD of Ω and Γ for random geometries."""
    r = np.random.default_rng(seed)
    x = xp.asarray(r.standard_normal((2, h, w, c)))
    if num_conv_locations(x.shape, (k, k, c, 2), s, padding) == 0:
        with pytest.raises(KFACValueError, match="at least one"):
            F.conv_input_kronecker_factor(x, (k, k, c, 2), padding, s, has_bias=has_bias)
        return
    om = xp.to_numpy(F.conv_input_kronecker_factor(x, (k, k, c, 2), padding, s,
                                                   has_bias=has_bias))
    assert om.shape == (k * k * c + has_bias,) * 2
    np.testing.assert_array_equal(om, om.T)
    assert np.linalg.eigvalsh(om).min() >= -om.shape[0] * 16 * xp.eps * np.abs(om).max()


# --------------------------------------------------------------------------------------
# Stateful classes
# --------------------------------------------------------------------------------------
def test_conv_classes_towers_averaged_sources_summed(xp, rng):
    xs = [xp.round_host(rng.standard_normal((2, 5, 5, 2))) for _ in range(2)]
    gs = [[xp.round_host(rng.standard_normal((2, 5, 5, 3))) for _ in range(2)]
          for _ in range(2)]  # [source][tower]
    fin = F.ConvInputKroneckerFactor((3, 3, 2, 3), "SAME", has_bias=True)
    fin = fin.update_cov([xp.asarray(v) for v in xs], ema_decay=0.5)
    expected = (omega_loop(xs[0], 3, 3, 1, 1, "SAME", True)
                + omega_loop(xs[1], 3, 3, 1, 1, "SAME", True)) / 2
    xp.assert_close(fin.cov, expected)

    fout = F.ConvOutputKroneckerFactor().update_cov(
        [[xp.asarray(g) for g in src] for src in gs], ema_decay=0.5)
    gam = [[g.reshape(-1, 3).T @ g.reshape(-1, 3) / 50 for g in src] for src in gs]
    xp.assert_close(fout.cov, (gam[0][0] + gam[0][1] + gam[1][0] + gam[1][1]) / 2)

    fd = F.ConvDiagonalFactor((3, 3, 2, 3), (1, 1, 1, 1), "SAME", has_bias=False)
    fd = fd.update_cov([xp.asarray(v) for v in xs], [[xp.asarray(g) for g in src]
                                                      for src in gs], ema_decay=0.5)
    one = [[xp.to_numpy(F.conv_diagonal_factor(xp.asarray(xs[t]), xp.asarray(gs[s_][t]),
                                               (3, 3, 2, 3), 1, "SAME"))
            for t in range(2)] for s_ in range(2)]
    xp.assert_close(fd.cov, (one[0][0] + one[0][1] + one[1][0] + one[1][1]) / 2)
    inv = xp.to_numpy(fd.get_matpower(-1, 0.1))
    np.testing.assert_allclose(inv, 1 / (xp.to_numpy(fd.cov) + 0.1), rtol=xp.rtol)


def test_conv_multi_kf_same_statistics(xp, rng):
    x = xp.asarray(rng.standard_normal((6, 4, 4, 2)))  # 3 uses × 2 examples, folded
    a = F.ConvInputMultiKF((2, 2, 2, 1), "VALID", 3).update_cov(x, ema_decay=0.0)
    b = F.ConvInputKroneckerFactor((2, 2, 2, 1), "VALID").update_cov(x, ema_decay=0.0)
    xp.assert_close(a.cov, xp.to_numpy(b.cov))
    assert a.batch_size(x) == 2
    g = xp.asarray(rng.standard_normal((6, 3, 3, 2)))
    c = F.ConvOutputMultiKF(3).update_cov(g, ema_decay=0.0)
    assert c.batch_size(g) == 2
    xp.assert_close(c.cov, xp.to_numpy(F.conv_output_kronecker_factor(g)))


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------
def test_conv_input_factor_validates_before_drawing(xp, rng):
    """Bad options are rejected before the generator is touched or patches are built."""
    x = xp.asarray(rng.standard_normal((4, 5, 5, 3)))
    bad_calls = [
        (KFACValueError, "padding must be", dict(padding="FULL")),
        (KFACTypeError, "has_bias must be a bool", dict(has_bias=1)),
        (KFACValueError, "agree on in_channels", dict(filter_shape=(3, 3, 2, 4))),
        (KFACValueError, "strides must be positive", dict(strides=(1, 0))),
        (KFACValueError, "extract_patches_fn", dict(extract_patches_fn="im2col")),
        (KFACValueError, "patch_mask", dict(patch_mask=xp.asarray(np.ones((3, 3, 2))))),
        (KFACValueError, "max_num_patches_per_dimension",
         dict(sub_sample_patches=True, max_num_patches_per_dimension=0.0)),
    ]
    for err, match, kwargs in bad_calls:
        r = np.random.default_rng(0)
        state = r.bit_generator.state
        args = dict(filter_shape=(3, 3, 3, 4), padding="SAME", sub_sample_inputs=True, rng=r)
        args.update(kwargs)
        with pytest.raises(err, match=match):
            F.conv_input_kronecker_factor(x, **args)
        assert r.bit_generator.state == state, match


def test_conv_classes_validate_options_at_construction():
    with pytest.raises(KFACValueError, match="padding must be"):
        F.ConvInputKroneckerFactor((3, 3, 3, 4), "FULL")
    with pytest.raises(KFACValueError, match="strides must be positive"):
        F.ConvInputKroneckerFactor((3, 3, 3, 4), "SAME", strides=(1, 0))
    with pytest.raises(KFACValueError, match="extract_patches_fn"):
        F.ConvInputKroneckerFactor((3, 3, 3, 4), "SAME", extract_patches_fn="im2col")
    with pytest.raises(KFACValueError, match="data_format must be None or one of"):
        F.ConvInputKroneckerFactor((3, 3, 3, 4), "SAME", data_format="NHCW")
    with pytest.raises(KFACValueError, match="describes 2-D convolutions"):
        F.ConvInputKroneckerFactor((3, 3, 4), "SAME")  # 1-D filter, default "NHWC"
    with pytest.raises(KFACValueError, match="pairs"):
        F.ConvInputMultiKF((3, 3, 3, 4), [(1, 1)], 2)
    with pytest.raises(KFACValueError, match="data_format must be None or one of"):
        F.ConvOutputKroneckerFactor(data_format="HWNC")
    with pytest.raises(KFACValueError, match="dilations must be positive"):
        F.ConvDiagonalFactor((3, 3, 3, 4), 1, "SAME", dilations=0)
    with pytest.raises(KFACValueError, match="describes 5-D arrays"):
        F.ConvInputSUAKroneckerFactor((3, 3, 3, 4), data_format="NCDHW")


def test_conv_factor_errors(xp, rng):
    x = xp.asarray(rng.standard_normal((2, 5, 5, 3)))
    g = xp.asarray(rng.standard_normal((2, 5, 5, 4)))
    with pytest.raises(KFACValueError, match="agree on in_channels"):
        F.conv_input_kronecker_factor(x, (3, 3, 2, 4), "SAME")
    with pytest.raises(KFACValueError, match="agree on out_channels"):
        F.conv_diagonal_factor(x, g, (3, 3, 3, 5), 1, "SAME")
    with pytest.raises(KFACValueError, match="agree on in_channels"):
        F.conv_diagonal_factor(x, g, (3, 3, 2, 4), 1, "SAME")
    with pytest.raises(KFACValueError, match="output grid"):
        F.conv_diagonal_factor(x, g, (3, 3, 3, 4), 2, "SAME")
    with pytest.raises(KFACValueError, match="same batch size"):
        F.conv_diagonal_factor(x, xp.asarray(rng.standard_normal((3, 5, 5, 4))),
                               (3, 3, 3, 4), 1, "SAME")
    with pytest.raises(KFACValueError, match="padding must be"):
        F.conv_input_kronecker_factor(x, (3, 3, 3, 4), "REFLECT")
    with pytest.raises(KFACValueError, match="strides must be positive"):
        F.conv_input_kronecker_factor(x, (3, 3, 3, 4), "SAME", strides=(1, -2))
    # each formula reports a bad option under its own name
    with pytest.raises(KFACValueError, match="conv_patch_matrix: padding must be"):
        F.conv_patch_matrix(x, (3, 3, 3, 4), "FULL")
    with pytest.raises(KFACValueError, match="conv_diagonal_factor: dilations must be positive"):
        F.conv_diagonal_factor(x, g, (3, 3, 3, 4), 1, "SAME", dilations=0)
    with pytest.raises(KFACTypeError, match="conv_diagonal_factor: has_bias must be a bool"):
        F.conv_diagonal_factor(x, g, (3, 3, 3, 4), 1, "SAME", has_bias="no")
    with pytest.raises(KFACValueError, match="describes 4-D arrays"):
        F.conv_input_kronecker_factor(xp.asarray(rng.standard_normal((2, 5, 3))),
                                      (3, 3, 4), "SAME")
    with pytest.raises(KFACValueError, match="describes 4-D arrays"):
        F.conv_output_kronecker_factor(xp.asarray(rng.standard_normal((2, 5, 3))))
    with pytest.raises(KFACValueError, match="-D array"):
        F.conv_diagonal_factor(x, xp.asarray(rng.standard_normal((2, 25, 4))), (3, 3, 3, 4),
                               1, "SAME")
    with pytest.raises(KFACTypeError, match="Generator"):
        F.conv_input_kronecker_factor(x, (3, 3, 3, 4), "SAME", sub_sample_inputs=True)
    with pytest.raises(KFACValueError, match="extract_patches_fn"):
        F.conv_input_kronecker_factor(x, (3, 3, 3, 4), "SAME", extract_patches_fn="im2col")
    with pytest.raises(KFACValueError, match="unit strides"):
        F.conv_input_kronecker_factor(x, (1, 1, 3, 4), "SAME", 2,
                                      extract_patches_fn="extract_pointwise_conv2d_patches")
    with pytest.raises(KFACTypeError, match="has_bias must be a bool"):
        F.conv_input_kronecker_factor(x, (3, 3, 3, 4), "SAME", has_bias=1)
    with pytest.raises(KFACTypeError, match="sources"):
        F.ConvOutputKroneckerFactor().update_cov([g, g], ema_decay=0.9)
    with pytest.raises(KFACValueError, match="one array per input tower"):
        F.ConvDiagonalFactor((3, 3, 3, 4), 1, "SAME").update_cov([x, x], [[g]], ema_decay=0.9)
    with pytest.raises(KFACValueError, match="same batch size"):
        F.ConvInputKroneckerFactor((3, 3, 3, 4), "SAME").update_cov(
            [x, xp.asarray(rng.standard_normal((3, 5, 5, 3)))], ema_decay=0.9)
