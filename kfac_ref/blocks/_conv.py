"""Convolution geometry of the blocks: a :class:`kfac_ref.conv_geometry.ConvGeometry` built once
per block (output grid, :math:`|T|`, layout, the output-gradient check), used by the conv
mixin of the kfac-jax-named blocks (``ConvLayer`` in :mod:`kfac_ref.blocks.kfac_jax`) and by
the TF-named conv blocks.
"""

from __future__ import annotations

from .._backend import check_array, namespace_of
from ..conv_geometry import ConvGeometry, to_channels_last


def conv_geometry(func, inputs_shape, kernel_shape, strides, padding, dilation_rate,
                  data_format, *, filter_name="kernel_shape"):
    """The :class:`~kfac_ref.conv_geometry.ConvGeometry` of a block's convolution (errors name
    ``func`` and the block's argument names)."""
    return ConvGeometry.build(func, tuple(inputs_shape), tuple(kernel_shape), strides=strides,
                              padding=padding, dilation=dilation_rate, data_format=data_format,
                              filter_name=filter_name)


def check_conv_outputs_grad(func, g, batch, geo, *, filter_name="kernel_shape"):
    """``outputs_grad`` on the convolution's output grid and channels (``batch`` rows, or
    any when None): on another grid the statistics would be normalised by a wrong
    :math:`|T|`.  ``filter_name`` names the block's kernel argument in the messages."""
    check_array(func, "outputs_grad", g, ndim=geo.rank + 2)
    geo.check_output_grid(func, "outputs_grad", g.shape,
                          batch_size=g.shape[0] if batch is None else batch,
                          filter_name=filter_name)
    return g


def pooled_conv_data(layer, inputs, outputs_grad, batch_size):
    """KFAC-reduce rows of a conv layer: the mean patch over locations and the output
    gradient summed over locations (``[N, kh·kw·C_in]``, ``[N, C_out]``)."""
    xp = namespace_of("pooled_conv_data", inputs=inputs, outputs_grad=outputs_grad)
    n = batch_size
    p = layer.kernel.patches(inputs)  # [N, Ho, Wo, K]; checked by the caller
    g = to_channels_last(xp, outputs_grad, layer.data_format == "NHWC")
    return {"inputs": xp.mean(xp.reshape(p, (n, -1, layer.patch_size)), axis=1),
            "outputs_grad": xp.sum(xp.reshape(g, (n, -1, layer.c_out)), axis=1)}
