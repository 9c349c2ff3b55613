"""Layer adapters of the kfac-jax-named blocks: sizes, ``estimation_data`` checks and
construction from :mod:`kfac_ref.nn` layers, one mixin per layer kind.

The conv mixin :class:`ConvLayer` reads its geometry (output grid, :math:`|T|`, layout) from
:mod:`kfac_ref.blocks._conv`, which the TF-named conv blocks share.
"""

from __future__ import annotations

from collections.abc import Sequence

from ... import factors
from ..._backend import (
    KFACValueError,
    check_array,
    check_bool,
    check_int,
    describe,
    namespace_of,
)
from .._conv import check_conv_outputs_grad, conv_geometry
from ._base import check_rows


def check_layer_kind(cls, layer, kind):
    """Raise unless ``layer`` is a :mod:`kfac_ref.nn` layer of ``kind``."""
    if getattr(layer, "kind", None) != kind:
        raise KFACValueError(f"{cls.__name__}.from_layer: layer must be a {kind!r} layer; got "
                             f"{describe(layer)} of kind {getattr(layer, 'kind', None)!r}.")


# --------------------------------------------------------------------------------------
# Dense layers
# --------------------------------------------------------------------------------------
class DenseLayer:
    """A dense layer ``y = x W + b``: kernel ``[d_in, d_out]``, bias ``[d_out]``.  Mixed in
    before a block family, its constructor takes the layer's sizes and passes the parameter
    shapes on to the family's."""

    def __init__(self, input_size, output_size, has_bias=True, **kwargs):
        super().__init__(self._init_dense(type(self).__name__, input_size, output_size,
                                          has_bias), **kwargs)

    def _init_dense(self, func, input_size, output_size, has_bias):
        d_in = check_int(func, "input_size", input_size, minimum=1)
        d_out = check_int(func, "output_size", output_size, minimum=1)
        self.has_bias = check_bool(func, "has_bias", has_bias)
        return [(d_in, d_out)] + ([(d_out,)] if self.has_bias else [])

    @classmethod
    def from_layer(cls, layer, input_shape, *, weight_sharing="expand", **kwargs):
        """The block of a :class:`kfac_ref.nn.Dense` layer (sizes and bias from the layer)."""
        check_layer_kind(cls, layer, "dense")
        return cls(layer.d_in, layer.d_out, has_bias=layer.use_bias, **kwargs)

    def layer_estimation_data(self, layer, inputs, outputs_grad, params_grads, batch_size,
                              weight_sharing="expand"):
        """``[N, T, d]`` inputs: :math:`NT` rows (expand) or pooled rows (reduce)."""
        x, g, n = inputs, outputs_grad, batch_size
        if x.ndim != 3:
            return {"inputs": x, "outputs_grad": g}, n
        xp = namespace_of(f"{type(self).__name__}.layer_estimation_data", inputs=x)
        if weight_sharing == "expand":
            t = x.shape[1]
            return {"inputs": xp.reshape(x, (n * t, -1)),
                    "outputs_grad": xp.reshape(g, (n * t, -1))}, n * t
        return {"inputs": xp.mean(x, axis=1), "outputs_grad": xp.sum(g, axis=1)}, n

    def _check_estimation_arrays(self, func, state, arrays, batch_size):
        check_rows(func, state, arrays, batch_size)
        d_in, d_out = self.parameters_shapes[0][0], self.parameters_shapes[0][-1]
        check_array(func, "inputs", arrays["inputs"], shape=(None, d_in), layout="[N, d_in]")
        check_array(func, "outputs_grad", arrays["outputs_grad"], shape=(None, d_out),
                    layout="[N, d_out]")
        return arrays


# --------------------------------------------------------------------------------------
# Convolutions
# --------------------------------------------------------------------------------------
class ConvLayer:
    """Layer options shared by the conv blocks (TF/kfac_ref conventions, see
    :mod:`kfac_ref.patches`).  Mixed in before a block family, its constructor takes the
    layer's geometry and passes the parameter shapes on to the family's."""

    def __init__(self, inputs_shape, kernel_shape, strides=1, padding="VALID", dilation_rate=1,
                 data_format="NHWC", has_bias=True, **kwargs):
        super().__init__(self._init_conv(type(self).__name__, inputs_shape, kernel_shape,
                                         strides, padding, dilation_rate, data_format,
                                         has_bias), **kwargs)

    def _init_conv(self, func, inputs_shape, kernel_shape, strides, padding, dilation_rate,
                   data_format, has_bias):
        if not isinstance(kernel_shape, Sequence) or len(kernel_shape) != 4:
            raise KFACValueError(f"{func}: kernel_shape must be [kh, kw, C_in, C_out] (HWIO); "
                                 f"got {describe(kernel_shape)}.")
        self.kernel_shape = tuple(check_int(func, "kernel_shape entry", k, minimum=1)
                                  for k in kernel_shape)
        if not isinstance(inputs_shape, Sequence) or len(inputs_shape) != 4:
            raise KFACValueError(f"{func}: inputs_shape must be a 4-entry shape [N, H, W, C] "
                                 f"(NHWC) or [N, C, H, W] (NCHW), batch entry ignored; got "
                                 f"{describe(inputs_shape)}.")
        self.inputs_shape = tuple(int(v) for v in inputs_shape)
        self.strides, self.padding = strides, padding
        self.dilation_rate, self.data_format = dilation_rate, data_format
        self.has_bias = check_bool(func, "has_bias", has_bias)
        self.geometry = conv_geometry(func, self.inputs_shape, self.kernel_shape, strides,
                                      padding, dilation_rate, data_format)
        self.num_locations = self.geometry.num_locations
        self.output_spatial_shape = self.geometry.output_spatial_shape
        return [self.kernel_shape] + ([(self.kernel_shape[3],)] if self.has_bias else [])

    @staticmethod
    def layer_geometry(layer, input_shape):
        """Constructor arguments of a conv block for a :class:`kfac_ref.nn.Conv2D` layer."""
        padding = layer.padding if isinstance(layer.padding, str) else list(layer.padding)
        return dict(inputs_shape=tuple(input_shape), kernel_shape=layer.filter_shape,
                    strides=layer.stride, padding=padding, dilation_rate=layer.dilation,
                    data_format=layer.data_format, has_bias=layer.use_bias)

    @classmethod
    def from_layer(cls, layer, input_shape, *, weight_sharing="expand", **kwargs):
        """The block of a :class:`kfac_ref.nn.Conv2D` layer for its input shape."""
        check_layer_kind(cls, layer, "conv2d")
        return cls(**cls.layer_geometry(layer, input_shape), **kwargs)

    @property
    def channels_first(self):
        """Whether the layout is NCHW (else NHWC)."""
        return not self.geometry.channels_last

    def _check_estimation_arrays(self, func, state, arrays, batch_size):
        check_rows(func, state, arrays, batch_size)
        x, g = arrays["inputs"], arrays["outputs_grad"]
        check_array(func, "inputs", x, ndim=4, shape=(None, *self.inputs_shape[1:]))
        check_conv_outputs_grad(func, g, None, self.geometry)
        return arrays

    def _grads_channels_last(self, xp, g):
        return self.geometry.to_channels_last(xp, g)

    def _patches(self, x):
        xp = namespace_of("patches", x=x)
        return factors.conv_patch_matrix.kernel(xp, x, self.geometry, self.has_bias)

    def _per_example_grads(self, xp, x, g):
        """Per-example weight gradients :math:`DW_n = \\sum_t \\bar p_{n,t} g_{n,t}^\\top`,
        flattened ``[N, (K + 1)·C_out]`` (kernel rows then the bias row)."""
        dw = factors.conv_per_example_gradients.kernel(xp, x, g, self.geometry, self.has_bias)
        return xp.reshape(dw, (x.shape[0], -1))


# --------------------------------------------------------------------------------------
# Scale and shift
# --------------------------------------------------------------------------------------
class ScaleAndShiftLayer:
    """Shapes and statistics of ``y = scale * x + shift`` (broadcast, batch axis first).
    Mixed in before a block family, its constructor takes the shapes and passes the
    parameter shapes on to the family's."""

    def __init__(self, inputs_shape, scale_shape=None, shift_shape=None, **kwargs):
        super().__init__(self._init_sas(type(self).__name__, inputs_shape, scale_shape,
                                        shift_shape), **kwargs)

    def _init_sas(self, func, inputs_shape, scale_shape, shift_shape):
        if scale_shape is None and shift_shape is None:
            raise KFACValueError(f"{func}: scale_shape or shift_shape must be given; got "
                                 "neither.")
        self.inputs_shape = tuple(check_int(func, "inputs_shape entry", d, minimum=1)
                                  for d in inputs_shape)
        shapes = []
        for name, s in (("scale_shape", scale_shape), ("shift_shape", shift_shape)):
            if s is None:
                continue
            s = tuple(check_int(func, name, d, minimum=1) for d in s)
            tail = self.inputs_shape[len(self.inputs_shape) - len(s):]
            if len(s) > len(self.inputs_shape) or any(
                    d not in (1, f) for d, f in zip(s, tail, strict=True)):
                raise KFACValueError(f"{func}: {name} must broadcast against the per-example "
                                     f"input shape {self.inputs_shape}; got {s}.")
            shapes.append(s)
        self.has_scale = scale_shape is not None
        self.has_shift = shift_shape is not None
        return shapes

    @classmethod
    def from_layer(cls, layer, input_shape, *, weight_sharing="expand", **kwargs):
        """The block of a :class:`kfac_ref.nn.ScaleAndShift` layer (per-channel parameters)."""
        check_layer_kind(cls, layer, "scale_and_shift")
        c = (layer.num_channels,)
        return cls(tuple(input_shape[1:]), c if layer.has_scale else None,
                   c if layer.has_shift else None, **kwargs)

    def _broadcast_axes(self, shape):
        """Axes of ``[N, *inputs_shape]`` a parameter of ``shape`` is broadcast along."""
        lead = len(self.inputs_shape) - len(shape)
        pairs = zip(shape, self.inputs_shape[lead:], strict=True)
        return tuple(range(1, 1 + lead)) + tuple(
            1 + lead + i for i, (d, f) in enumerate(pairs) if d == 1 and f != 1)

    def _check_estimation_arrays(self, func, state, arrays, batch_size):
        check_rows(func, state, arrays, batch_size)
        check_array(func, "inputs", arrays["inputs"], shape=(None, *self.inputs_shape))
        check_array(func, "outputs_grad", arrays["outputs_grad"],
                    shape=(None, *self.inputs_shape))
        return arrays

    def _statistic(self, xp, data, approx):
        """:func:`kfac_ref.factors.scale_and_shift_factor` of one batch (flat order: scale,
        then shift).  A shift-only layer is the factor's scale part with :math:`x = 1`."""
        x, dy = data["inputs"], data["outputs_grad"]
        shapes = list(self.parameters_shapes)
        f = factors.scale_and_shift_factor
        if not self.has_scale:  # ∑ 1·g over the shift's axes is the shift gradient
            return f(xp.ones_like(dy), dy, self._broadcast_axes(shapes[0]), has_shift=False,
                     approx=approx)
        shift_axes = self._broadcast_axes(shapes[1]) if self.has_shift else None
        return f(x, dy, self._broadcast_axes(shapes[0]), shift_axes, has_shift=self.has_shift,
                 approx=approx)


# --------------------------------------------------------------------------------------
# Gradients of the summed loss as sources (naive blocks)
# --------------------------------------------------------------------------------------
SOURCE_REDUCTIONS = ("per_source", "summed")


class ParamsGradsSources:
    """``estimation_data["params_grads"]``: per parameter, a gradient of the summed loss
    shaped like the parameter or ``[S, *shape]`` for S sources."""

    estimation_keys = ("params_grads",)

    def _check_estimation_arrays(self, func, state, arrays, batch_size):
        """``params_grads`` as a tuple over sources of per-parameter tuples."""
        grads = arrays["params_grads"]
        shapes = self.parameters_shapes
        if not isinstance(grads, (list, tuple)) or len(grads) != len(shapes):
            raise KFACValueError(f"{func}: params_grads must be a sequence of {len(shapes)} "
                                 f"gradient arrays of shapes {shapes} (optionally with a "
                                 f"leading sources axis); got {describe(grads)}.")
        namespace_of(func, **{"state.like": state.like},
                     **{f"params_grads[{i}]": g for i, g in enumerate(grads)})
        with_sources = None
        for i, (g, s) in enumerate(zip(grads, shapes, strict=True)):
            has = tuple(g.shape) != s
            check_array(func, f"params_grads[{i}]", g,
                        shape=(None, *s) if has else s,
                        layout=f"{list(s)} or [S, {', '.join(map(str, s))}]")
            if with_sources is not None and has != with_sources:
                raise KFACValueError(f"{func}: params_grads must all have a sources axis or "
                                     f"none; got mixed shapes {[tuple(x.shape) for x in grads]}.")
            with_sources = has
        if not with_sources:
            return (tuple(grads),)
        n_src = grads[0].shape[0]
        if any(g.shape[0] != n_src for g in grads):
            raise KFACValueError(f"{func}: params_grads must have one number of sources; got "
                                 f"shapes {[tuple(x.shape) for x in grads]}.")
        return tuple(tuple(g[k, ...] for g in grads) for k in range(n_src))

    def _naive_statistic(self, sources, batch_size, factor_fn):
        """Σ over sources of ``factor_fn(grads_s, N)`` (per_source) or
        ``factor_fn(Σ_s grads_s, N)`` (summed)."""
        if self.source_reduction == "summed":
            summed = tuple(sum(src[i] for src in sources) for i in range(len(sources[0])))
            return factor_fn(summed, batch_size)
        out = factor_fn(sources[0], batch_size)
        for src in sources[1:]:
            out = out + factor_fn(src, batch_size)
        return out
