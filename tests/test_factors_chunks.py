"""Memory-bounded conv statistics: examples are processed in chunks whose temporaries stay
within max_temporary_bytes; chunked and one-shot results agree to rounding."""

import numpy as np
import pytest

from kfac_ref import KFACTypeError, KFACValueError, factors, patches

ONE_SHOT = 2**62


@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("budget", [1, 3000, 20000])
def test_chunked_equals_one_shot(xp, rng, data_format, budget):
    x = rng.standard_normal((5, 6, 6, 3))
    g = rng.standard_normal((5, 3, 3, 4))
    if data_format == "NCHW":
        x, g = np.moveaxis(x, -1, 1), np.moveaxis(g, -1, 1)
    x, g = xp.asarray(x), xp.asarray(g)
    conv = dict(filter_shape=(3, 3, 3, 4), padding="SAME", strides=2, data_format=data_format)
    for has_bias in (False, True):
        one = factors.conv_input_kronecker_factor(x, **conv, has_bias=has_bias,
                                                  max_temporary_bytes=ONE_SHOT)
        xp.assert_close(factors.conv_input_kronecker_factor(
            x, **conv, has_bias=has_bias, max_temporary_bytes=budget), xp.to_numpy(one))
        one = factors.conv_diagonal_factor(x, g, (3, 3, 3, 4), 2, "SAME", data_format,
                                           has_bias=has_bias, max_temporary_bytes=ONE_SHOT)
        xp.assert_close(factors.conv_diagonal_factor(
            x, g, (3, 3, 3, 4), 2, "SAME", data_format, has_bias=has_bias,
            max_temporary_bytes=budget), xp.to_numpy(one))
    one = factors.conv_output_kronecker_factor(g, data_format, max_temporary_bytes=ONE_SHOT)
    xp.assert_close(factors.conv_output_kronecker_factor(
        g, data_format, max_temporary_bytes=budget), xp.to_numpy(one))


def test_chunk_sizes_respect_the_bound():
    # 100 examples of 1000 entries of 8 bytes: a 64 kB budget holds 8 per chunk
    bounds = patches.example_chunks(100, 1000, 8, 64_000)
    assert bounds[0] == (0, 8) and all(hi - lo == 8 for lo, hi in bounds[:-1])
    assert bounds[-1] == (96, 100)  # the last chunk is clipped at N
    assert [lo for lo, _ in bounds] == list(range(0, 100, 8))
    assert patches.example_chunks(100, 1000, 4, 64_000)[0] == (0, 16)  # float32: twice as many
    assert patches.example_chunks(3, 10**9, 8, 1) == [(0, 1), (1, 2), (2, 3)]  # >= 1 example
    assert patches.example_chunks(3, 1, 8, 2**40) == [(0, 3)]  # never more than N
    assert patches.MAX_TEMPORARY_BYTES == 64 * 2**20


def _conv_layer_passes(layer, params, x, dparams, dx, g, rg):
    """Every Conv2D pass on one input: forward, jvp, vjp_input, summed and per-example
    parameter gradients, rvjp."""
    r_params, r_x = layer.rvjp(params, x, dparams, dx, g, rg)
    return [layer.forward(params, x), layer.jvp(params, x, dparams, dx),
            layer.vjp_input(params, x, g), *layer.param_grads(params, x, g),
            *layer.param_grads(params, x, g, per_example=True), *r_params, r_x]


@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("budget", [1, 3000, 20000])
def test_conv2d_layer_chunked_equals_one_shot(xp, rng, data_format, budget):
    """nn.Conv2D runs every pass over chunks of examples (one example per chunk at budget 1);
    the results equal the one-shot passes to rounding."""
    from kfac_ref import nn

    kw = dict(stride=2, padding="SAME", dilation=(1, 2), data_format=data_format)
    one_shot = nn.Conv2D(3, 4, (3, 2), **kw, max_temporary_bytes=ONE_SHOT)
    chunked = nn.Conv2D(3, 4, (3, 2), **kw, max_temporary_bytes=budget)
    x = rng.standard_normal((5, 7, 6, 3))
    dx = rng.standard_normal(x.shape)
    out = one_shot.output_shape((5, 7, 6, 3))
    g = rng.standard_normal((out[0], out[1], out[2], 4))
    rg = rng.standard_normal(g.shape)
    if data_format == "NCHW":
        x, dx, g, rg = (np.moveaxis(a, -1, 1) for a in (x, dx, g, rg))
    params = (xp.asarray(rng.standard_normal((3, 2, 3, 4))), xp.asarray(rng.standard_normal(4)))
    dparams = (xp.asarray(rng.standard_normal((3, 2, 3, 4))), xp.asarray(rng.standard_normal(4)))
    x, dx, g, rg = (xp.asarray(a) for a in (x, dx, g, rg))
    if budget == 1:  # the bound really splits the batch (one example per chunk)
        assert len(chunked._chunks(xp.xp, x, x.shape)) == 5
    for got, exp in zip(_conv_layer_passes(chunked, params, x, dparams, dx, g, rg),
                        _conv_layer_passes(one_shot, params, x, dparams, dx, g, rg), strict=True):
        xp.check(got)
        xp.assert_close(got, xp.to_numpy(exp))


def test_conv2d_max_temporary_bytes_is_checked():
    from kfac_ref import nn

    with pytest.raises(KFACValueError, match="Conv2D: max_temporary_bytes must be an integer >= 1"):
        nn.Conv2D(1, 1, 2, max_temporary_bytes=0)


def test_max_temporary_bytes_is_checked(xp, rng):
    x = xp.asarray(rng.standard_normal((2, 5, 5, 3)))
    with pytest.raises(KFACValueError, match="conv_input_kronecker_factor: "
                       "max_temporary_bytes must be an integer >= 1"):
        factors.conv_input_kronecker_factor(x, (3, 3, 3, 4), "SAME", max_temporary_bytes=0)
    with pytest.raises(KFACTypeError, match="conv_output_kronecker_factor: "
                       "max_temporary_bytes must be an integer"):
        factors.conv_output_kronecker_factor(x, max_temporary_bytes=1.5)


def test_conv_peak_memory_is_bounded():
    """NumPy's allocations (tracemalloc): with a 3 MB bound every Conv2D pass and the conv
    factors of a 32-example 3×3 conv peak below the bound (plus, for the passes that return
    an input-sized array, two outputs: the chunks' results and their concatenation), where
    the one-shot passes hold the whole 9.4 MB patch matrix (so the check can fail)."""
    import tracemalloc

    from kfac_ref import nn

    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((32, 16, 16, 16)), rng.standard_normal((32, 16, 16, 16))
    params = (rng.standard_normal((3, 3, 16, 16)), rng.standard_normal(16))
    patch_bytes = 32 * 16 * 16 * 3 * 3 * 16 * 8
    budget = 3_000_000
    for bound, expect_small in ((ONE_SHOT, False), (budget, True)):
        layer = nn.Conv2D(16, 16, 3, padding="SAME", max_temporary_bytes=bound)
        calls = ((layer.forward, (params, x), {}), (layer.vjp_input, (params, x, g), {}),
                 (layer.param_grads, (params, x, g), {}),
                 (layer.param_grads, (params, x, g), {"per_example": True}),
                 (factors.conv_input_kronecker_factor, (x, (3, 3, 16, 16), "SAME"),
                  {"has_bias": True, "max_temporary_bytes": bound}),
                 (factors.conv_diagonal_factor, (x, g, (3, 3, 16, 16), 1, "SAME"),
                  {"has_bias": True, "max_temporary_bytes": bound}),
                 # stride 2: the padded input is a larger share of the temporaries
                 (factors.conv_input_kronecker_factor, (x, (3, 3, 16, 16), "SAME"),
                  {"strides": 2, "has_bias": True, "max_temporary_bytes": bound}))
        for fn, args, kwargs in calls:
            tracemalloc.start()
            try:
                fn(*args, **kwargs)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            if expect_small:
                # only forward and vjp_input return (and concatenate) input-sized arrays;
                # the other results are kernel-sized, so their peak is the bound itself
                outputs = 2 * x.nbytes if fn in (layer.forward, layer.vjp_input) else 0
                assert peak <= budget + outputs, (fn.__name__, peak)
            elif kwargs.get("strides") is None:
                assert peak >= patch_bytes, (fn.__name__, peak)


def test_temporary_entries_per_example():
    """Three copies of an example's patches (bias column included) and two of its padded
    input: a 3×3 SAME conv of a 16×16×16 input, stride 2."""
    from kfac_ref.conv_geometry import PATCH_TEMPORARY_COPIES, ConvGeometry

    geo = ConvGeometry.from_shapes((4, 16, 16, 16), (3, 3, 16, 8), strides=2, padding="SAME")
    assert PATCH_TEMPORARY_COPIES == 3
    assert geo.padded_spatial_shape == (17, 17)  # SAME, stride 2: total 1, split (0, 1)
    assert geo.temporary_entries_per_example(1) == 3 * 64 * (144 + 1) + 2 * 17 * 17 * 16
