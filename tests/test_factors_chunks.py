"""Memory-bounded conv statistics: examples are processed in chunks whose temporaries stay
within max_temporary_bytes; chunked and one-shot results agree to rounding."""

import numpy as np
import pytest

from kfac_ref import KFACTypeError, KFACValueError, factors
from kfac_ref.factors import conv_kfc

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


def test_chunk_sizes_respect_the_bound(xp):
    # 100 examples of 1000 entries of 8 (or 4) bytes: a 64 kB budget holds 8 (or 16) per chunk
    starts, size = conv_kfc._chunks(xp.xp, 100, 1000, 64_000, xp.dtype)
    itemsize = 8 if xp.float64 else 4
    assert size == 64_000 // (1000 * itemsize) and size * 1000 * itemsize <= 64_000
    assert list(starts) == list(range(0, 100, size))
    assert conv_kfc._chunks(xp.xp, 100, 10**9, 1, xp.dtype)[1] == 1  # at least one example
    assert conv_kfc._chunks(xp.xp, 3, 1, 2**40, xp.dtype)[1] == 3  # never more than N
    assert factors.MAX_TEMPORARY_BYTES == 64 * 2**20


def test_max_temporary_bytes_is_checked(xp, rng):
    x = xp.asarray(rng.standard_normal((2, 5, 5, 3)))
    with pytest.raises(KFACValueError, match="conv_input_kronecker_factor: "
                       "max_temporary_bytes must be an integer >= 1"):
        factors.conv_input_kronecker_factor(x, (3, 3, 3, 4), "SAME", max_temporary_bytes=0)
    with pytest.raises(KFACTypeError, match="conv_output_kronecker_factor: "
                       "max_temporary_bytes must be an integer"):
        factors.conv_output_kronecker_factor(x, max_temporary_bytes=1.5)
