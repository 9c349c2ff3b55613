"""ConvGeometry: the one normalised description of a convolution (host integers)."""

import dataclasses
import math

import numpy as np
import pytest

from kfac_ref import KFACTypeError, KFACValueError, nn
from kfac_ref import conv_geometry as G
from kfac_ref import patches as P
from kfac_ref.conv_geometry import ConvGeometry


def test_fields_are_normalised_once():
    g = ConvGeometry.from_shapes((2, 7, 6, 3), (3, 2, 3, 4), strides=[1, 2, 1, 1],
                                 padding="same", dilation=(2, 1))
    assert g.strides == (2, 1) and g.dilation == (2, 1)
    assert g.padding_mode == "SAME" and g.channels_last
    # SAME: o = ceil(n/s); P = max((o-1)s + (k-1)d + 1 - n, 0), low side P // 2
    assert g.output_spatial_shape == (4, 6)
    assert g.padding == ((2, 2), (0, 1))
    assert g.num_locations == 24 == math.prod(g.output_spatial_shape)
    assert (g.kernel_shape, g.in_channels, g.out_channels) == ((3, 2), 3, 4)
    assert (g.num_offsets, g.patch_size, g.batch_size) == (6, 18, 2)
    assert g.padded_spatial_shape == (11, 7)
    assert g.output_shape() == (2, 4, 6, 4) and g.output_shape(5) == (5, 4, 6, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.strides = (1, 1)


def test_channels_first_and_explicit_padding():
    g = ConvGeometry.from_shapes((1, 3, 5, 5), (3, 3, 3, 2), padding=[(0, 0), (0, 0), (1, 0),
                                                                      (2, 1)],
                                 data_format="NCHW")
    assert not g.channels_last and g.padding == ((1, 0), (2, 1)) and g.padding_mode == "EXPLICIT"
    # explicit: o = floor((n + lo + hi - (k-1)d - 1)/s) + 1
    assert g.output_spatial_shape == (4, 6)
    assert g.output_shape() == (1, 2, 4, 6)


def test_agrees_with_the_public_geometry_functions(rng):
    for n, k, s, d, pad in [(7, 3, 2, 1, "VALID"), (8, 2, 3, 2, "SAME"), (5, 5, 1, 1, "VALID"),
                            (4, 3, 1, 3, "VALID")]:
        shape, fs = (1, n, n + 1, 2), (k, k, 2, 1)
        g = ConvGeometry.from_shapes(shape, fs, s, pad, d)
        assert g.output_spatial_shape == P.conv_output_spatial_shape(shape, fs, s, pad, d)
        assert g.num_locations == P.num_conv_locations(shape, fs, s, pad, d)
        layer = nn.Conv2D(2, 1, k, stride=s, padding=pad, dilation=d)
        assert layer.geometry(shape).output_spatial_shape == g.output_spatial_shape


def test_layout_conversion_round_trips(xp, rng):
    host = rng.standard_normal((2, 3, 4, 5))
    x = xp.asarray(host)
    y = G.to_channels_last(xp.xp, x, False)
    xp.assert_close(y, np.moveaxis(xp.round_host(host), 1, -1))
    xp.assert_close(G.from_channels_last(xp.xp, y, False), xp.round_host(host))
    assert G.to_channels_last(xp.xp, x, True) is x


def test_checks_name_the_function_and_argument():
    with pytest.raises(KFACValueError, match="ConvGeometry.from_shapes: dilation must be "
                       "positive"):
        ConvGeometry.from_shapes((1, 5, 5, 3), (3, 3, 3, 4), dilation=0)
    with pytest.raises(KFACTypeError, match="ConvGeometry.from_shapes: filter_shape must be"):
        ConvGeometry.from_shapes((1, 5, 5, 3), None)
    with pytest.raises(KFACValueError, match="data_format must be None or one of"):
        G.is_channels_last("f", "NHCW")
    with pytest.raises(KFACValueError, match="describes 4-D arrays"):
        G.is_channels_last("f", "NCHW", 3)
    g = ConvGeometry.from_shapes((2, 5, 5, 3), (3, 3, 3, 4))
    g.check_output_grid("f", "g", (2, 3, 3, 4))
    for shape, match in [((2, 9, 4), "4-D array"), ((2, 3, 3, 5), "agree on out_channels"),
                         ((1, 3, 3, 4), "same batch size"), ((2, 3, 4, 4), "output grid")]:
        with pytest.raises(KFACValueError, match=match):
            g.check_output_grid("f", "g", shape)
    with pytest.raises(KFACValueError, match="at least one example and one output location"):
        ConvGeometry.from_shapes((2, 2, 2, 3), (3, 3, 3, 4)).check_nonempty("f")
    with pytest.raises(KFACValueError, match="agree on in_channels"):
        ConvGeometry.from_shapes((2, 5, 5, 2), (3, 3, 3, 4))


def test_numpy_integer_arguments_are_accepted():
    g = ConvGeometry.from_shapes(np.array([1, 5, 5, 3]), np.array([3, 3, 3, 4]),
                                 np.array([1, 1]))
    assert g.output_spatial_shape == (3, 3) and isinstance(g.strides[0], int)
