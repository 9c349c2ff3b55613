r"""Convolution patch extraction: the matrix :math:`[[A]]` of KFC, in array-API code.

A convolution with kernel ``[k_1, ..., k_r, C_in, C_out]`` (TF's HWIO layout, generalised to
``r`` spatial dimensions) computes, at output location :math:`t` of example :math:`n`,

.. math::

    s_{n,t} = \sum_{\delta, c} W_{\delta, c, :}\; x_{n,\, o(t) + d \odot \delta,\, c},
    \qquad o(t) = s \odot t - p_{\text{lo}},

with strides :math:`s`, dilation :math:`d` and low-side padding :math:`p_{\text{lo}}`
(entries outside the image read as zero).  The *patch* of location :math:`t` is the vector
:math:`(x_{n, o(t) + d\odot\delta, c})_{\delta, c}`; stacked over examples and locations
the patches form KFC's expanded matrix :math:`[[A]] \in \mathbb{R}^{N|T| \times |\Delta| C}`
(Grosse & Martens 2016, eq. 14).

Conventions (the same in every function of this module)
-------------------------------------------------------
* **Patch order** ``(k_1, ..., k_r, C_in)`` with ``C_in`` fastest: a flattened patch lines
  up with the kernel reshaped row-major to ``[k_1·…·k_r·C_in, C_out]``.  This holds for
  channels-first (``NCHW``) inputs too: the layout switch only says how the *input* is stored.
* **Output layout** ``[N, o_1, ..., o_r, k_1, ..., k_r, C_in]`` (TF's
  ``extract_convolution_patches``); :func:`extract_image_patches` flattens the trailing
  ``k_1, k_2, C_in`` axes (TF's ``tf.image.extract_patches``).
* **Padding** ``"VALID"``, ``"SAME"`` (TF's split: the low side gets ``total // 2``, the high
  side the rest), or explicit ``(lo, hi)`` pairs per spatial dimension (or per dimension of
  the input, TF's explicit form, where the batch and channel pairs must be ``(0, 0)``).
* **Strides / dilation** as one int, one int per spatial dimension, or TF's full-rank form
  (``[1, s_1, ..., s_r, 1]`` channels-last, ``[1, 1, s_1, ..., s_r]`` channels-first).

Implementation: all index arithmetic is done on the host with NumPy (integers only); the
array work is one zero-padding ``concat`` and one ``take`` per spatial dimension, so no
Python loop runs over examples or locations.  Peak memory is that of the result,
:math:`N\,|T|\,|\Delta|\,C_{in}` entries.

Random subsampling of rows (TF's ``_SUB_SAMPLE_INPUTS`` / ``_SUB_SAMPLE_PATCHES``) draws
from an explicit :class:`numpy.random.Generator` on the host (:func:`subsample_rows`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np  # host-side index arithmetic and random draws only (no array math)

from ._backend import (
    KFACTypeError,
    KFACValueError,
    asarray_like,
    check_array,
    check_int,
    check_rng,
    check_scalar,
    describe,
    host_draw,
    namespace_of,
    zeros_like_shape,
)

__all__ = [
    "DATA_FORMATS",
    "conv_output_spatial_shape",
    "conv_padding_amounts",
    "num_conv_locations",
    "extract_convolution_patches",
    "extract_image_patches",
    "extract_pointwise_conv2d_patches",
    "subsample_rows",
    "num_subsampled_inputs",
    "num_subsampled_patches",
]

DATA_FORMATS = ("NWC", "NCW", "NHWC", "NCHW", "NDHWC", "NCDHW")
"""Accepted ``data_format`` strings (``None`` means channels last, any rank)."""


# --------------------------------------------------------------------------------------
# Host-side geometry (pure Python / NumPy integers)
# --------------------------------------------------------------------------------------
def _channels_last(func, data_format, ndim):
    """Validate ``data_format`` against an input rank; return True for channels-last."""
    if data_format is None:
        return True
    if not isinstance(data_format, str) or data_format not in DATA_FORMATS:
        raise KFACValueError(
            f"{func}: data_format must be None or one of "
            f"{', '.join(repr(d) for d in DATA_FORMATS)}; got {describe(data_format)}."
        )
    if ndim is not None and len(data_format) != ndim:
        raise KFACValueError(
            f"{func}: data_format {data_format!r} describes {len(data_format)}-D arrays; got a "
            f"{ndim}-D array."
        )
    return data_format.endswith("C")


def _is_int(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _spatial_ints(func, name, value, rank, channels_last, default):
    """Normalise strides / dilation to a tuple of ``rank`` positive ints."""
    if value is None:
        return (default,) * rank
    if _is_int(value):
        value = (value,) * rank
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(
        _is_int(v) for v in value
    ):
        raise KFACTypeError(
            f"{func}: {name} must be an int or a sequence of ints; got {describe(value)}."
        )
    value = tuple(int(v) for v in value)
    if len(value) == rank + 2:  # TF's full-rank form
        outer = (value[0], value[-1]) if channels_last else (value[0], value[1])
        if outer != (1, 1):
            raise KFACValueError(
                f"{func}: {name} in full-rank form must be 1 on the batch and channel axes; "
                f"got {value}."
            )
        value = value[1:-1] if channels_last else value[2:]
    if len(value) != rank:
        raise KFACValueError(
            f"{func}: {name} must have {rank} (spatial) or {rank + 2} (full-rank) entries; "
            f"got {value}."
        )
    if any(v < 1 for v in value):
        raise KFACValueError(f"{func}: {name} must be positive integers; got {value}.")
    return value


def _explicit_padding(func, padding, rank, channels_last):
    pairs = []
    for p in padding:
        if isinstance(p, np.ndarray):
            p = p.tolist()
        if (not isinstance(p, Sequence) or isinstance(p, str) or len(p) != 2
                or not all(_is_int(v) for v in p)):
            raise KFACValueError(
                f"{func}: padding must be 'SAME', 'VALID' or a sequence of (low, high) int "
                f"pairs; got {describe(padding)}."
            )
        pairs.append((int(p[0]), int(p[1])))
    if len(pairs) == rank + 2:
        outer = [pairs[0], pairs[-1]] if channels_last else [pairs[0], pairs[1]]
        if any(q != (0, 0) for q in outer):
            raise KFACValueError(
                f"{func}: explicit padding of the batch and channel axes must be (0, 0); got "
                f"{pairs}."
            )
        pairs = pairs[1:-1] if channels_last else pairs[2:]
    if len(pairs) != rank:
        raise KFACValueError(
            f"{func}: padding must have {rank} (spatial) or {rank + 2} (full-rank) (low, high) "
            f"pairs; got {len(pairs)}."
        )
    if any(v < 0 for q in pairs for v in q):
        raise KFACValueError(f"{func}: padding amounts must be non-negative; got {pairs}.")
    return tuple(pairs)


def _padding_kind(func, padding):
    if isinstance(padding, str):
        kind = padding.upper()
        if kind not in ("SAME", "VALID"):
            raise KFACValueError(
                f"{func}: padding must be 'SAME', 'VALID' or a sequence of (low, high) pairs; "
                f"got {padding!r}."
            )
        return kind
    if padding is None or not isinstance(padding, (Sequence, np.ndarray)):
        raise KFACValueError(
            f"{func}: padding must be 'SAME', 'VALID' or a sequence of (low, high) pairs; got "
            f"{describe(padding)}."
        )
    return "EXPLICIT"


def _geometry(func, spatial_in, kernel, strides, dilation, padding, channels_last):
    """Per spatial dimension: (out, pad_lo, pad_hi).  Host integers only."""
    rank = len(spatial_in)
    kind = _padding_kind(func, padding)
    pairs = (_explicit_padding(func, padding, rank, channels_last)
             if kind == "EXPLICIT" else None)
    geo = []
    for i in range(rank):
        n, k, s, d = spatial_in[i], kernel[i], strides[i], dilation[i]
        eff = (k - 1) * d + 1  # extent of the dilated kernel
        if kind == "SAME":
            out = -(-n // s)
            total = max((out - 1) * s + eff - n, 0)
            lo, hi = total // 2, total - total // 2  # TF: low side gets total // 2
        elif kind == "VALID":
            out = -(-(n - eff + 1) // s) if n >= eff else 0
            lo, hi = 0, 0
        else:
            lo, hi = pairs[i]
            span = n + lo + hi - eff
            out = span // s + 1 if span >= 0 else 0
        geo.append((out, lo, hi))
    return tuple(geo)


def _check_filter_shape(func, filter_shape, rank=None):
    if isinstance(filter_shape, np.ndarray):
        filter_shape = filter_shape.tolist()
    if (not isinstance(filter_shape, Sequence) or isinstance(filter_shape, str)
            or not all(_is_int(v) for v in filter_shape)):
        raise KFACTypeError(
            f"{func}: filter_shape must be a sequence of ints [k_1, ..., k_r, C_in, C_out]; got "
            f"{describe(filter_shape)}."
        )
    filter_shape = tuple(int(v) for v in filter_shape)
    if len(filter_shape) < 3 or (rank is not None and len(filter_shape) != rank + 2):
        want = f"{rank + 2}" if rank is not None else "at least 3"
        raise KFACValueError(
            f"{func}: filter_shape must have {want} entries [k_1, ..., k_r, C_in, C_out]; got "
            f"{filter_shape}."
        )
    if any(v < 1 for v in filter_shape):
        raise KFACValueError(f"{func}: filter_shape entries must be positive; got "
                             f"{filter_shape}.")
    return filter_shape


def _shape_tuple(func, name, shape):
    if isinstance(shape, np.ndarray):
        shape = shape.tolist()
    if (not isinstance(shape, Sequence) or isinstance(shape, str)
            or not all(_is_int(v) for v in shape)):
        raise KFACTypeError(f"{func}: {name} must be a sequence of ints; got {describe(shape)}.")
    shape = tuple(int(v) for v in shape)
    if any(v < 0 for v in shape):
        raise KFACValueError(f"{func}: {name} entries must be non-negative; got {shape}.")
    return shape


def conv_padding_amounts(input_shape, filter_shape, strides, padding, dilation_rate=None,
                         data_format=None):
    r"""Output size and the (low, high) zero padding of each spatial dimension.

    .. math::

        \text{SAME}:\ o = \lceil n / s \rceil,\
        P = \max\big((o - 1) s + (k - 1) d + 1 - n,\ 0\big),\
        p_{\text{lo}} = \lfloor P / 2 \rfloor,\ p_{\text{hi}} = P - p_{\text{lo}};
        \qquad
        \text{VALID}:\ o = \Big\lceil \frac{n - (k-1)d}{s} \Big\rceil;
        \qquad
        \text{explicit}:\ o = \Big\lfloor \frac{n + p_{\text{lo}} + p_{\text{hi}}
        - (k-1)d - 1}{s} \Big\rfloor + 1 .

    Parameters
    ----------
    input_shape : sequence of int
        ``[N, *spatial, C]`` (channels last) or ``[N, C, *spatial]`` (channels first).
    filter_shape : sequence of int
        ``[k_1, ..., k_r, C_in, C_out]``.
    strides, dilation_rate : int, sequence of int or None
        Spatial or TF full-rank form; ``None`` means 1.
    padding : {"SAME", "VALID"} or sequence of (int, int)
    data_format : str or None
        One of :data:`DATA_FORMATS`; ``None`` means channels last.

    Returns
    -------
    tuple of (out, lo, hi) per spatial dimension

    Raises
    ------
    KFACValueError, KFACTypeError
        Unknown padding or data format, non-positive strides/dilation, rank mismatch.

    References
    ----------
    TensorFlow ``tf.nn.convolution`` padding rules.
    """
    func = "conv_padding_amounts"
    input_shape = _shape_tuple(func, "input_shape", input_shape)
    channels_last = _channels_last(func, data_format, len(input_shape))
    rank = len(input_shape) - 2
    if rank < 1:
        raise KFACValueError(f"{func}: input_shape must have at least 3 entries; got "
                             f"{input_shape}.")
    filter_shape = _check_filter_shape(func, filter_shape, rank)
    spatial = input_shape[1:-1] if channels_last else input_shape[2:]
    strides = _spatial_ints(func, "strides", strides, rank, channels_last, 1)
    dilation = _spatial_ints(func, "dilation_rate", dilation_rate, rank, channels_last, 1)
    return _geometry(func, spatial, filter_shape[:-2], strides, dilation, padding,
                     channels_last)


def conv_output_spatial_shape(input_shape, filter_shape, strides, padding, dilation_rate=None,
                              data_format=None):
    r"""Spatial shape of a convolution's output.

    .. math::

        (o_1, \dots, o_r), \quad o_i \text{ as in } :func:`conv_padding_amounts`.

    Same arguments as :func:`conv_padding_amounts`.
    """
    return tuple(g[0] for g in conv_padding_amounts(input_shape, filter_shape, strides, padding,
                                                    dilation_rate, data_format))


def num_conv_locations(input_shape, filter_shape, strides, padding, dilation_rate=None,
                       data_format=None):
    r"""Number of output locations :math:`|T|` of a convolution.

    .. math::

        |T| = \prod_{i=1}^{r} o_i ,

    with :math:`o_i` the output size of spatial dimension :math:`i` (padding, stride and
    dilation rules of :func:`conv_padding_amounts`).

    Differences from TF K-FAC's ``utils.num_conv_locations``: that function needs TF's
    full-rank strides and ignores dilation (for a dilated ``VALID`` convolution it counts
    :math:`\lceil (n - k + 1)/s \rceil` locations instead of
    :math:`\lceil (n - (k-1)d)/s \rceil`); it only handles 1-D and 2-D convolutions.  Here
    strides may be spatial-only or full-rank, dilation is honoured and any rank works.  For
    undilated convolutions the two agree.

    Parameters
    ----------
    input_shape, filter_shape, strides, padding, dilation_rate, data_format
        As in :func:`conv_padding_amounts`.

    Returns
    -------
    int
    """
    out = conv_output_spatial_shape(input_shape, filter_shape, strides, padding, dilation_rate,
                                    data_format)
    return int(math.prod(out))


# --------------------------------------------------------------------------------------
# Patch extraction
# --------------------------------------------------------------------------------------
def _to_channels_last(xp, x, channels_last):
    if channels_last:
        return x
    return xp.permute_dims(x, (0, *range(2, x.ndim), 1))


def _patches_channels_last(xp, x, kernel, strides, dilation, geo):
    """``x`` [N, *spatial, C] -> [N, *out, *kernel, C] by zero padding and ``take``."""
    rank = len(kernel)
    for i in range(rank):
        axis = 1 + 2 * i  # axes already processed were split into (out, k)
        out, lo, hi = geo[i]
        if lo or hi:
            shp = list(x.shape)
            parts = []
            if lo:
                shp[axis] = lo
                parts.append(zeros_like_shape(x, shp))
            parts.append(x)
            if hi:
                shp[axis] = hi
                parts.append(zeros_like_shape(x, shp))
            x = xp.concat(parts, axis=axis)
        # Host-side index arithmetic: padded index of (output o, offset k) is o·s + k·d.
        idx = (np.arange(out)[:, None] * strides[i] + np.arange(kernel[i])[None, :] * dilation[i])
        idx = asarray_like(idx.reshape(-1), x, dtype=xp.int64)
        x = xp.take(x, idx, axis=axis)
        shp = list(x.shape)
        x = xp.reshape(x, (*shp[:axis], out, kernel[i], *shp[axis + 1:]))
    # [N, o1, k1, o2, k2, ..., C] -> [N, o1, ..., or, k1, ..., kr, C]
    perm = (0, *[1 + 2 * i for i in range(rank)], *[2 + 2 * i for i in range(rank)],
            1 + 2 * rank)
    return xp.permute_dims(x, perm)


def _validate_conv_inputs(func, inputs, filter_shape, data_format):
    check_array(func, "inputs", inputs, min_ndim=3, layout="[N, *spatial, C_in]")
    channels_last = _channels_last(func, data_format, inputs.ndim)
    rank = inputs.ndim - 2
    filter_shape = _check_filter_shape(func, filter_shape, rank)
    c_in = inputs.shape[-1] if channels_last else inputs.shape[1]
    if c_in != filter_shape[-2]:
        raise KFACValueError(
            f"{func}: inputs and filter_shape must agree on in_channels; inputs have {c_in} "
            f"channels (data_format {data_format or 'channels last'}) but filter_shape is "
            f"{filter_shape}."
        )
    return channels_last, rank, filter_shape


def extract_convolution_patches(inputs, filter_shape, padding, strides=None, dilation_rate=None,
                                data_format=None):
    r"""The inputs each output location of a convolution reads (N-D, any padding).

    .. math::

        P_{n, t, \delta, c} = x^{\text{pad}}_{n,\; s \odot t + d \odot \delta,\; c},
        \qquad t \in T,\ \delta \in \Delta = \textstyle\prod_i \{0, \dots, k_i - 1\},

    where :math:`x^{\text{pad}}` is the input zero-padded by :math:`p_{\text{lo}}` /
    :math:`p_{\text{hi}}` (:func:`conv_padding_amounts`).  Contracting ``P`` with the kernel
    over :math:`(\delta, c)` reproduces the convolution (no bias).

    TF K-FAC's ``utils.extract_convolution_patches`` (which convolves with an identity
    kernel and supports channels-last only).

    Parameters
    ----------
    inputs : array ``[N, *spatial, C_in]`` (channels last) or ``[N, C_in, *spatial]``
    filter_shape : sequence of int
        ``[k_1, ..., k_r, C_in, C_out]``.
    padding : {"SAME", "VALID"} or sequence of (int, int)
        TF's SAME split: the low side gets ``total // 2``.
    strides, dilation_rate : int, sequence of int or None
        Spatial (``r`` entries) or TF's full-rank form.
    data_format : str or None
        One of :data:`DATA_FORMATS`; ``None`` means channels last.  The *output* is always
        ``[N, *out, *kernel, C_in]`` with ``C_in`` fastest.

    Returns
    -------
    array [N, o_1, ..., o_r, k_1, ..., k_r, C_in]
        Same namespace, device and dtype as ``inputs``.  Memory:
        :math:`N\,|T|\,|\Delta|\,C_{in}` entries.

    Raises
    ------
    KFACValueError, KFACTypeError
        Rank below 3, non-floating or non-finite inputs, channel mismatch with
        ``filter_shape``, unknown padding or data format, non-positive strides or dilation.

    References
    ----------
    Grosse & Martens (2016), "A Kronecker-factored approximate Fisher matrix for convolution
    layers", eq. 14 (the expansion operator :math:`[[\cdot]]`).
    """
    func = "extract_convolution_patches"
    xp = namespace_of(func, inputs=inputs)
    channels_last, rank, filter_shape = _validate_conv_inputs(func, inputs, filter_shape,
                                                              data_format)
    strides = _spatial_ints(func, "strides", strides, rank, channels_last, 1)
    dilation = _spatial_ints(func, "dilation_rate", dilation_rate, rank, channels_last, 1)
    x = _to_channels_last(xp, inputs, channels_last)
    geo = _geometry(func, tuple(x.shape[1:-1]), filter_shape[:-2], strides, dilation, padding,
                    channels_last)
    return _patches_channels_last(xp, x, filter_shape[:-2], strides, dilation, geo)


def extract_image_patches(images, ksizes, strides, rates, padding, data_format=None):
    r"""TF's ``tf.image.extract_patches`` (2-D), flattened patches in (kh, kw, C) order.

    .. math::

        Q_{n, i, j, (a\,k_w + b)\,C + c}
        = x^{\text{pad}}_{n,\; s_h i + r_h a,\; s_w j + r_w b,\; c}.

    Parameters
    ----------
    images : array [N, H, W, C] (or [N, C, H, W] with ``data_format="NCHW"``)
    ksizes : sequence of int
        ``[1, k_h, k_w, 1]`` (TF form) or ``[k_h, k_w]``.
    strides, rates : sequence of int
        ``[1, s_h, s_w, 1]`` / ``[s_h, s_w]`` and likewise for the dilation rates.
    padding : {"SAME", "VALID"} or sequence of (int, int)
    data_format : {"NHWC", "NCHW", None}

    Returns
    -------
    array [N, o_h, o_w, k_h·k_w·C]

    Raises
    ------
    KFACValueError, KFACTypeError
        As :func:`extract_convolution_patches`; ``images`` must be 4-D.

    References
    ----------
    TensorFlow ``tf.image.extract_patches`` (formerly ``extract_image_patches``).
    """
    func = "extract_image_patches"
    namespace_of(func, images=images)
    check_array(func, "images", images, ndim=4, layout="[N, H, W, C]")
    channels_last = _channels_last(func, data_format, 4)
    ksizes = _spatial_ints(func, "ksizes", ksizes, 2, channels_last, 1)
    c = images.shape[-1] if channels_last else images.shape[1]
    patches = extract_convolution_patches(images, (*ksizes, c, 1), padding, strides, rates,
                                          data_format)
    xp = namespace_of(func, images=images)
    n, oh, ow = patches.shape[:3]
    return xp.reshape(patches, (n, oh, ow, ksizes[0] * ksizes[1] * c))


def extract_pointwise_conv2d_patches(inputs, filter_shape, data_format=None):
    r"""Patches of a 1×1 convolution: every pixel is its own patch.

    .. math::

        P_{n, h, w, 0, 0, c} = x_{n, h, w, c}.

    TF K-FAC's ``utils.extract_pointwise_conv2d_patches`` (stride 1, no padding).

    Parameters
    ----------
    inputs : array [N, H, W, C_in] (or [N, C_in, H, W] with ``data_format="NCHW"``)
    filter_shape : sequence of int
        ``[1, 1, C_in, C_out]``.
    data_format : {"NHWC", "NCHW", None}

    Returns
    -------
    array [N, H, W, 1, 1, C_in]

    Raises
    ------
    KFACValueError
        Non-4-D inputs, a filter that is not 1×1, a channel mismatch.
    """
    func = "extract_pointwise_conv2d_patches"
    xp = namespace_of(func, inputs=inputs)
    check_array(func, "inputs", inputs, ndim=4, layout="[N, H, W, C_in]")
    channels_last, _, filter_shape = _validate_conv_inputs(func, inputs, filter_shape,
                                                           data_format)
    if filter_shape[0] != 1 or filter_shape[1] != 1:
        raise KFACValueError(f"{func}: filter_shape must be [1, 1, C_in, C_out]; got "
                             f"{filter_shape}.")
    x = _to_channels_last(xp, inputs, channels_last)
    n, h, w, c = x.shape
    return xp.reshape(x, (n, h, w, 1, 1, c))


# --------------------------------------------------------------------------------------
# Subsampling (TF's _SUB_SAMPLE_INPUTS / _SUB_SAMPLE_PATCHES)
# --------------------------------------------------------------------------------------
def num_subsampled_inputs(batch_size, factor=0.2):
    r"""Number of examples kept when inputs are subsampled before patch extraction.

    .. math::

        N' = \lceil N \cdot f \rceil, \qquad f = \texttt{factor}
        \ (\text{TF's } \_INPUTS\_TO\_EXTRACT\_PATCHES\_FACTOR = 0.2).

    This is TF K-FAC master's rule.  The contrib-era seed used ``int(N * 0.5)`` (floor,
    factor 0.5); pass ``factor=0.5`` to get its value whenever :math:`N/2` is an integer.
    """
    func = "num_subsampled_inputs"
    batch_size = check_int(func, "batch_size", batch_size, minimum=0)
    if not isinstance(factor, numbers.Real) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise KFACValueError(f"{func}: factor must be in (0, 1]; got {describe(factor)}.")
    return int(math.ceil(batch_size * factor))


def num_subsampled_patches(total_patches, dimension, max_num_patches=10_000_000,
                           max_num_patches_per_dimension=3.0):
    r"""Number of patch rows kept when patches are subsampled (TF's ``_subsample_patches``).

    .. math::

        m = \min\Big(M_{\max},\ \big\lceil \rho\, D \big\rceil\Big), \qquad
        \text{kept} = \min(m, \text{total}),

    with :math:`D` the patch dimension, :math:`M_{\max}` = ``max_num_patches`` (TF 1e7) and
    :math:`\rho` = ``max_num_patches_per_dimension`` (TF 3.0).  This is TF K-FAC master's
    ``_subsample_patches``; the contrib-era seed's ``_subsample_for_cov_computation`` keeps
    ``int(1 * D)`` rows (``_MAX_NUM_OUTER_PRODUCTS_PER_COV_ROW = 1``, no absolute cap), i.e.
    ``max_num_patches_per_dimension=1.0`` with a large ``max_num_patches``.
    """
    func = "num_subsampled_patches"
    total_patches = check_int(func, "total_patches", total_patches, minimum=0)
    dimension = check_int(func, "dimension", dimension, minimum=1)
    max_num_patches = check_int(func, "max_num_patches", max_num_patches, minimum=1)
    max_num_patches_per_dimension = check_scalar(
        func, "max_num_patches_per_dimension", max_num_patches_per_dimension, positive=True)
    m = min(max_num_patches, int(math.ceil(max_num_patches_per_dimension * dimension)))
    return min(m, total_patches)


def subsample_rows(array, num_rows, rng):
    r"""A uniformly random subset of rows (without replacement), in random order.

    .. math::

        Y = X[\pi_{1:m}], \qquad \pi \sim \text{uniform permutation of } \{0, \dots, n-1\},

    TF K-FAC's ``_random_tensor_gather`` (``random_shuffle(range(n))[:m]`` then ``gather``),
    with the permutation drawn on the host from the explicit generator ``rng``
    (:func:`kfac_ref._backend.host_draw`) so every backend gathers the same rows.

    Parameters
    ----------
    array : array [n, ...]
    num_rows : int
        :math:`m`; values :math:`\ge n` return all rows (still permuted).
    rng : numpy.random.Generator

    Returns
    -------
    array [min(m, n), ...]
    """
    func = "subsample_rows"
    xp = namespace_of(func, array=array)
    check_array(func, "array", array, min_ndim=1, dtype=None, finite=False)
    num_rows = check_int(func, "num_rows", num_rows, minimum=0)
    check_rng(func, "rng", rng)
    n = array.shape[0]
    idx = host_draw(rng, array, lambda r: r.permutation(n)[: min(num_rows, n)],
                    dtype=xp.int64)
    return xp.take(array, idx, axis=0)
