"""Convolution geometry of the blocks, in one place: output grid, :math:`|T|`, layout and
the output-gradient check, used by the conv mixin of the kfac-jax-named blocks
(``ConvLayer`` in :mod:`kfac_ref.blocks.kfac_jax`) and by the TF-named conv blocks.
"""

from __future__ import annotations

from .. import patches
from .._backend import (
    check_array,
    namespace_of,
)

__all__ = ["conv_locations", "check_conv_outputs_grad", "is_channels_first",
           "pooled_conv_data"]


def is_channels_first(data_format):
    """Whether ``data_format`` is a channels-first (NCHW) layout."""
    return data_format is not None and str(data_format).upper().startswith("NC")


def conv_locations(inputs_shape, kernel_shape, strides, padding, dilation_rate, data_format):
    """``(|T|, (H_out, W_out))`` of a convolution (:mod:`kfac_ref.patches`)."""
    t = int(patches.num_conv_locations(tuple(inputs_shape), kernel_shape, strides, padding,
                                       dilation_rate, data_format))
    grid = tuple(int(o) for o in patches.conv_output_spatial_shape(
        tuple(inputs_shape), kernel_shape, strides, padding, dilation_rate, data_format))
    return t, grid


def check_conv_outputs_grad(func, g, batch, grid, c_out, channels_first):
    """``outputs_grad`` on the convolution's output grid and channels (``batch`` rows, or
    any when None): on another grid the statistics would be normalised by a wrong
    :math:`|T|`."""
    if channels_first:
        check_array(func, "outputs_grad", g, shape=(batch, c_out, *grid),
                    layout="[N, C_out, H_out, W_out] (NCHW)")
    else:
        check_array(func, "outputs_grad", g, shape=(batch, *grid, c_out),
                    layout="[N, H_out, W_out, C_out] (NHWC)")
    return g


def pooled_conv_data(layer, inputs, outputs_grad, batch_size):
    """KFAC-reduce rows of a conv layer: the mean patch over locations and the output
    gradient summed over locations (``[N, kh·kw·C_in]``, ``[N, C_out]``)."""
    xp = namespace_of("pooled_conv_data", inputs=inputs, outputs_grad=outputs_grad)
    n = batch_size
    p = layer.patches(inputs)  # [N, Ho, Wo, K]
    g = outputs_grad if layer.data_format == "NHWC" else xp.permute_dims(outputs_grad,
                                                                           (0, 2, 3, 1))
    return {"inputs": xp.mean(xp.reshape(p, (n, -1, layer.patch_size)), axis=1),
            "outputs_grad": xp.sum(xp.reshape(g, (n, -1, layer.c_out)), axis=1)}
