"""kfac_ref.patches against explicit-loop oracles over examples, output locations and kernel
offsets (padding, strides, dilation, NHWC/NCHW, 1-D/2-D/3-D), hand-computed TF padding
splits, and every error path.  Patch extraction only copies entries, so results must agree
exactly on every backend (float32 included)."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kfac_ref import KFACInputError, KFACTypeError, KFACValueError
from kfac_ref.patches import (
    conv_output_spatial_shape,
    conv_padding_amounts,
    extract_convolution_patches,
    extract_image_patches,
    extract_pointwise_conv2d_patches,
    num_conv_locations,
    num_subsampled_inputs,
    num_subsampled_patches,
    subsample_rows,
)


# --------------------------------------------------------------------------------------
# Oracles (host NumPy, explicit loops; shared with the conv factor tests)
# --------------------------------------------------------------------------------------
def oracle_pads(spatial, kernel, strides, dilation, padding):
    """(lo, hi) per spatial dim, from the TF documentation of SAME/VALID padding."""
    if not isinstance(padding, str):
        return [tuple(p) for p in padding]
    pads = []
    for n, k, s, d in zip(spatial, kernel, strides, dilation, strict=True):
        if padding == "VALID":
            pads.append((0, 0))
            continue
        out = math.ceil(n / s)
        total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
        pads.append((total // 2, total - total // 2))
    return pads


def oracle_patches(x, kernel, strides, dilation, pads):
    """Patches of a channels-last input by explicit loops over every example, output
    location and kernel offset: [N, *out, *kernel, C]."""
    n_ex, spatial, c = x.shape[0], x.shape[1:-1], x.shape[-1]
    out = []
    for n_i, k, s, d, (lo, hi) in zip(spatial, kernel, strides, dilation, pads, strict=True):
        span = n_i + lo + hi - ((k - 1) * d + 1)
        out.append(span // s + 1 if span >= 0 else 0)
    res = np.zeros((n_ex, *out, *kernel, c))
    for n in range(n_ex):
        for t in itertools.product(*[range(o) for o in out]):
            for delta in itertools.product(*[range(k) for k in kernel]):
                idx = [t[i] * strides[i] + delta[i] * dilation[i] - pads[i][0]
                       for i in range(len(kernel))]
                if all(0 <= idx[i] < spatial[i] for i in range(len(kernel))):
                    res[(n, *t, *delta)] = x[(n, *idx)]
    return res


def to_channels_first(x):
    return np.moveaxis(x, -1, 1)


def spatial_tuple(v, rank):
    return (v,) * rank if isinstance(v, int) else tuple(v)


CASES_2D = [
    # (H, W, kh, kw, strides, dilation, padding)
    (5, 6, 3, 2, 1, 1, "SAME"),
    (5, 6, 3, 2, 1, 1, "VALID"),
    (7, 6, 3, 3, 2, 1, "SAME"),
    (7, 6, 3, 3, (2, 3), 1, "VALID"),
    (6, 7, 2, 3, 1, 2, "SAME"),
    (6, 7, 2, 3, (1, 2), (2, 1), "VALID"),
    (5, 5, 3, 2, 2, 2, [(1, 2), (0, 3)]),
    (4, 4, 4, 1, 3, 1, "SAME"),  # kernel as large as the input
]


# --------------------------------------------------------------------------------------
# Padding arithmetic, hand-computed
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "k", "s", "d", "expected"),
    [
        (5, 3, 2, 1, (3, 1, 1)),  # out ceil(5/2)=3, total 2*2+3-5 = 2 -> 1/1
        (4, 3, 2, 1, (2, 0, 1)),  # total 2+3-4 = 1 -> TF puts the odd pixel on the HIGH side
        (4, 2, 1, 1, (4, 0, 1)),
        (6, 3, 1, 2, (6, 2, 2)),  # dilated extent 5, total 4
        (7, 1, 3, 1, (3, 0, 0)),
    ],
)
def test_same_padding_split_matches_tf_rule(n, k, s, d, expected):
    geo = conv_padding_amounts((1, n, 1), (k, 1, 1), s, "SAME", d, data_format="NWC")
    assert geo == (expected,)


@pytest.mark.parametrize(
    ("n", "k", "s", "d", "out"),
    [(5, 3, 1, 1, 3), (5, 3, 2, 1, 2), (7, 3, 2, 2, 2), (4, 5, 1, 1, 0), (6, 2, 4, 3, 1)],
)
def test_valid_output_size(n, k, s, d, out):
    assert conv_output_spatial_shape((2, n, 3), (k, 3, 1), s, "VALID", d, "NWC") == (out,)


def test_num_conv_locations_forms_and_dilation():
    shp, flt = (2, 9, 8, 3), (3, 3, 3, 5)
    assert num_conv_locations(shp, flt, (2, 2), "SAME") == 5 * 4
    assert num_conv_locations(shp, flt, (1, 2, 2, 1), "SAME") == 5 * 4  # TF 4-element form
    assert num_conv_locations(shp, flt, None, "VALID") == 7 * 6
    # dilation 2: extent 5 -> 5 x 4 (TF's num_conv_locations ignores dilation: 7 x 6)
    assert num_conv_locations(shp, flt, 1, "VALID", dilation_rate=2) == 5 * 4
    assert num_conv_locations(shp, flt, 1, [(1, 1), (0, 2)]) == 9 * 8
    assert num_conv_locations((2, 3, 9, 8), flt, 1, "VALID", data_format="NCHW") == 7 * 6


# --------------------------------------------------------------------------------------
# Patches against the loop oracle
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("case", CASES_2D)
def test_patches_match_loop_oracle_2d(xp, rng, case, data_format):
    h, w, kh, kw, s, d, padding = case
    x = xp.round_host(rng.standard_normal((2, h, w, 3)))
    s2, d2 = spatial_tuple(s, 2), spatial_tuple(d, 2)
    expected = oracle_patches(x, (kh, kw), s2, d2, oracle_pads((h, w), (kh, kw), s2, d2,
                                                                 padding))
    arr = xp.asarray(x if data_format == "NHWC" else to_channels_first(x))
    got = extract_convolution_patches(arr, (kh, kw, 3, 4), padding, s, d, data_format)
    xp.check(got)
    np.testing.assert_array_equal(xp.to_numpy(got), expected)


@pytest.mark.parametrize(
    ("spatial", "kernel", "strides", "dilation", "padding", "fmt"),
    [
        ((7,), (3,), (2,), (1,), "SAME", "NWC"),
        ((7,), (2,), (1,), (3,), [(2, 1)], "NCW"),
        ((4, 3, 5), (2, 2, 3), (1, 2, 2), (1, 1, 1), "SAME", "NDHWC"),
        ((4, 5, 3), (3, 2, 2), (2, 1, 1), (1, 2, 1), "VALID", "NCDHW"),
    ],
)
def test_patches_match_loop_oracle_nd(xp, rng, spatial, kernel, strides, dilation, padding,
                                      fmt):
    x = xp.round_host(rng.standard_normal((2, *spatial, 2)))
    expected = oracle_patches(x, kernel, strides, dilation,
                              oracle_pads(spatial, kernel, strides, dilation, padding))
    arr = xp.asarray(x if fmt.endswith("C") else to_channels_first(x))
    got = extract_convolution_patches(arr, (*kernel, 2, 3), padding, strides, dilation, fmt)
    np.testing.assert_array_equal(xp.to_numpy(xp.check(got)), expected)


def test_patches_times_kernel_is_the_convolution(xp, rng):
    """Σ_{δ,c} P[n,t,δ,c] W[δ,c,o] equals the convolution written as a loop over outputs."""
    x = xp.round_host(rng.standard_normal((2, 6, 5, 3)))
    wk = xp.round_host(rng.standard_normal((3, 2, 3, 4)))
    s, d, pads = (2, 1), (1, 2), [(1, 1), (2, 0)]
    p = xp.to_numpy(extract_convolution_patches(xp.asarray(x), wk.shape, pads, s, d))
    got = p.reshape(*p.shape[:3], -1) @ wk.reshape(-1, 4)
    xpad = np.pad(x, ((0, 0), (1, 1), (2, 0), (0, 0)))
    oh, ow = got.shape[1:3]
    conv = np.zeros((2, oh, ow, 4))
    for n, i, j in itertools.product(range(2), range(oh), range(ow)):
        for a, b in itertools.product(range(3), range(2)):
            conv[n, i, j] += xpad[n, i * s[0] + a * d[0], j * s[1] + b * d[1]] @ wk[a, b]
    np.testing.assert_allclose(got, conv, rtol=1e-12 if xp.float64 else 1e-5, atol=1e-12)


def test_full_rank_strides_and_dilation_forms(xp, rng):
    x = xp.asarray(rng.standard_normal((1, 7, 6, 2)))
    a = extract_convolution_patches(x, (3, 2, 2, 1), "SAME", (2, 1), (1, 2))
    b = extract_convolution_patches(x, (3, 2, 2, 1), "SAME", (1, 2, 1, 1), (1, 1, 2, 1))
    np.testing.assert_array_equal(xp.to_numpy(a), xp.to_numpy(b))
    xc = xp.asarray(to_channels_first(xp.to_numpy(x)))
    c = extract_convolution_patches(xc, (3, 2, 2, 1), "SAME", (1, 1, 2, 1), (1, 1, 1, 2),
                                    "NCHW")
    np.testing.assert_array_equal(xp.to_numpy(a), xp.to_numpy(c))
    e = extract_convolution_patches(x, (3, 2, 2, 1), [(0, 0), (1, 1), (0, 1), (0, 0)], 1, 1)
    f = extract_convolution_patches(x, (3, 2, 2, 1), [(1, 1), (0, 1)], 1, 1)
    np.testing.assert_array_equal(xp.to_numpy(e), xp.to_numpy(f))
    # channels first: the full-rank pairs are (N, C, H, W), so the spatial ones are the last two
    g = extract_convolution_patches(xc, (3, 2, 2, 1), [(0, 0), (0, 0), (1, 1), (0, 1)], 1, 1,
                                    "NCHW")
    np.testing.assert_array_equal(xp.to_numpy(g), xp.to_numpy(f))


def test_image_patches_and_pointwise(xp, rng):
    x = xp.round_host(rng.standard_normal((2, 5, 4, 3)))
    arr = xp.asarray(x)
    conv = xp.to_numpy(extract_convolution_patches(arr, (2, 3, 3, 1), "SAME", (2, 1), (1, 1)))
    img = extract_image_patches(arr, (1, 2, 3, 1), (1, 2, 1, 1), (1, 1, 1, 1), "SAME")
    xp.check(img)
    np.testing.assert_array_equal(xp.to_numpy(img), conv.reshape(2, 3, 4, 18))
    pw = extract_pointwise_conv2d_patches(arr, (1, 1, 3, 7))
    np.testing.assert_array_equal(xp.to_numpy(pw), x.reshape(2, 5, 4, 1, 1, 3))
    pw_c = extract_pointwise_conv2d_patches(xp.asarray(to_channels_first(x)), (1, 1, 3, 7),
                                            "NCHW")
    np.testing.assert_array_equal(xp.to_numpy(pw_c), x.reshape(2, 5, 4, 1, 1, 3))


@given(
    seed=st.integers(0, 2**32 - 1),
    h=st.integers(1, 6), w=st.integers(1, 6), kh=st.integers(1, 3), kw=st.integers(1, 3),
    s=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    d=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    padding=st.one_of(st.sampled_from(["SAME", "VALID"]),
                      st.tuples(st.tuples(st.integers(0, 2), st.integers(0, 2)),
                                st.tuples(st.integers(0, 2), st.integers(0, 2)))),
)
def test_patches_property_shapes_and_values(seed, h, w, kh, kw, s, d, padding):
    """Random geometries (NumPy only; the backends run the fixed grid above): the output grid
    has num_conv_locations cells and every entry matches the loop oracle."""
    x = np.random.default_rng(seed).standard_normal((2, h, w, 2))
    pads = oracle_pads((h, w), (kh, kw), s, d, padding)
    expected = oracle_patches(x, (kh, kw), s, d, pads)
    got = np.asarray(extract_convolution_patches(x, (kh, kw, 2, 1), padding, s, d))
    assert got.shape == expected.shape
    assert math.prod(got.shape[1:3]) == num_conv_locations(x.shape, (kh, kw, 2, 1), s,
                                                           padding, d)
    np.testing.assert_array_equal(got, expected)


# --------------------------------------------------------------------------------------
# Subsampling
# --------------------------------------------------------------------------------------
def test_subsample_rows_is_tf_shuffle_then_slice(xp, rng):
    x = xp.round_host(rng.standard_normal((9, 3)))
    got = subsample_rows(xp.asarray(x), 4, np.random.default_rng(5))
    perm = np.random.default_rng(5).permutation(9)[:4]
    np.testing.assert_array_equal(xp.to_numpy(xp.check(got)), x[perm])
    assert xp.to_numpy(subsample_rows(xp.asarray(x), 20, np.random.default_rng(1))).shape == (
        9, 3)


def test_subsample_counts():
    assert num_subsampled_inputs(10, 0.2) == 2
    assert num_subsampled_inputs(11, 0.2) == 3  # ceil
    assert num_subsampled_patches(1000, 7) == 21  # ceil(3 * 7)
    assert num_subsampled_patches(10, 7) == 10
    assert num_subsampled_patches(1000, 7, max_num_patches=5) == 5


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------
def test_patch_errors(xp, rng):
    x = xp.asarray(rng.standard_normal((2, 5, 5, 3)))
    ok = dict(filter_shape=(3, 3, 3, 4), padding="SAME")
    with pytest.raises(KFACValueError, match="padding must be 'SAME', 'VALID'"):
        extract_convolution_patches(x, (3, 3, 3, 4), "FULL")
    with pytest.raises(KFACValueError, match="padding must be"):
        extract_convolution_patches(x, (3, 3, 3, 4), None)
    with pytest.raises(KFACValueError, match="strides must be positive"):
        extract_convolution_patches(x, **ok, strides=(-1, 1))
    with pytest.raises(KFACValueError, match="dilation_rate must be positive"):
        extract_convolution_patches(x, **ok, dilation_rate=0)
    with pytest.raises(KFACTypeError, match="strides must be an int or a sequence"):
        extract_convolution_patches(x, **ok, strides=1.5)
    with pytest.raises(KFACValueError, match="strides must have 2 .* or 4"):
        extract_convolution_patches(x, **ok, strides=(1, 1, 1))
    with pytest.raises(KFACValueError, match="batch and channel axes"):
        extract_convolution_patches(x, **ok, strides=(2, 1, 1, 1))
    with pytest.raises(KFACValueError, match="agree on in_channels"):
        extract_convolution_patches(x, (3, 3, 4, 4), "SAME")
    with pytest.raises(KFACValueError, match="in_channels"):
        extract_convolution_patches(x, (3, 3, 3, 4), "SAME", data_format="NCHW")
    with pytest.raises(KFACValueError, match="filter_shape must have 4 entries"):
        extract_convolution_patches(x, (3, 3, 4), "SAME")
    with pytest.raises(KFACValueError, match="at least 3 dimensions"):
        extract_convolution_patches(xp.asarray(rng.standard_normal((2, 3))), (3, 3, 4), "SAME")
    with pytest.raises(KFACValueError, match="data_format must be None or one of"):
        extract_convolution_patches(x, **ok, data_format="NHCW")
    with pytest.raises(KFACValueError, match="describes 3-D arrays"):
        extract_convolution_patches(x, **ok, data_format="NWC")
    with pytest.raises(KFACValueError, match="non-negative"):
        extract_convolution_patches(x, (3, 3, 3, 4), [(1, -1), (0, 0)])
    with pytest.raises(KFACValueError, match="pairs"):
        extract_convolution_patches(x, (3, 3, 3, 4), [(1, 1)])
    with pytest.raises(KFACValueError, match=r"must be \(0, 0\)"):
        extract_convolution_patches(x, (3, 3, 3, 4), [(0, 0), (1, 1), (1, 1), (1, 0)])
    with pytest.raises(KFACValueError, match="filter_shape must be"):
        extract_pointwise_conv2d_patches(x, (3, 3, 3, 4))
    with pytest.raises(KFACValueError, match="4-D"):
        extract_image_patches(xp.asarray(rng.standard_normal((2, 5, 3))), (1, 2, 2, 1), 1, 1,
                              "SAME")
    bad = rng.standard_normal((2, 5, 5, 3))
    bad[0, 1, 1, 1] = np.nan
    with pytest.raises(KFACValueError, match="finite"):
        extract_convolution_patches(xp.asarray(bad), **ok)
    with pytest.raises(KFACTypeError, match="Generator"):
        subsample_rows(x, 2, 0)
    with pytest.raises(KFACInputError):
        num_conv_locations((2, 5, 5, 3), (3, 3, 3, 4), 0, "SAME")
    for rho in (float("inf"), True, 0.0, float("nan")):
        with pytest.raises(KFACInputError, match="max_num_patches_per_dimension"):
            num_subsampled_patches(10, 3, 5, rho)
