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

Geometry: every function here normalises its arguments once into a frozen
:class:`~kfac_ref.conv_geometry.ConvGeometry` — padding amounts,
strides, dilation, layout, output grid and :math:`|T|` — and the unchecked kernels
(``extract_convolution_patches.kernel(xp, inputs, geometry)``) compute from it.

Implementation: all index arithmetic is done on the host with NumPy (integers only); the
array work is one zero-padding ``concat`` and one ``take`` per spatial dimension, so no
Python loop runs over examples or locations.  Peak memory is that of the result,
:math:`N\,|T|\,|\Delta|\,C_{in}` entries.

Random subsampling of rows (TF's ``_SUB_SAMPLE_INPUTS`` / ``_SUB_SAMPLE_PATCHES``) draws
from an explicit :class:`numpy.random.Generator` on the host (:func:`subsample_rows`).
"""

from __future__ import annotations

import itertools
import math
import sys

import array_api_extra as xpx

from ._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_int,
    check_rng,
    check_scalar,
    describe,
    host_draw,
    kernel_of,
    namespace_of,
)
from ._support import capabilities
from .conv_geometry import (
    ConvGeometry,
    is_channels_last,
    spatial_ints,
)

__all__ = [
    "conv_output_spatial_shape",
    "conv_padding_amounts",
    "num_conv_locations",
    "extract_convolution_patches",
    "extract_image_patches",
    "extract_pointwise_conv2d_patches",
    "subsample_rows",
    "num_subsampled_inputs",
    "num_subsampled_patches",
    "example_chunks",
    "MAX_TEMPORARY_BYTES",
    "DEVICE_MEMORY_SHARE",
    "set_max_temporary_bytes",
    "temporary_bytes_bound",
]


# --------------------------------------------------------------------------------------
# Geometry (host integers; see kfac_ref.conv_geometry)
# --------------------------------------------------------------------------------------
@capabilities(array_free=True, formula=True)
def conv_padding_amounts(input_shape, filter_shape, strides, padding, dilation_rate=None,
                         data_format=None):
    r"""Output size and the (low, high) zero padding of each spatial dimension.

    .. math::

        \begin{aligned}
        \text{SAME}:\quad & o = \lceil n / s \rceil, \qquad
            P = \max\big((o - 1) s + (k - 1) d + 1 - n,\ 0\big), \\
            & p_{\text{lo}} = \lfloor P / 2 \rfloor, \qquad p_{\text{hi}} = P - p_{\text{lo}}; \\
        \text{VALID}:\quad & o = \Big\lceil \frac{n - (k-1)d}{s} \Big\rceil; \\
        \text{explicit}:\quad & o = \Big\lfloor \frac{n + p_{\text{lo}} + p_{\text{hi}}
            - (k-1)d - 1}{s} \Big\rfloor + 1 .
        \end{aligned}

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
        :attr:`ConvGeometry.output_spatial_shape` and :attr:`ConvGeometry.padding` zipped.

    Raises
    ------
    KFACValueError, KFACTypeError
        Unknown padding or data format, non-positive strides/dilation, rank mismatch.

    References
    ----------
    TensorFlow ``tf.nn.convolution`` padding rules.
    """
    geo = ConvGeometry.build("conv_padding_amounts", input_shape, filter_shape,
                             strides=strides, padding=padding, dilation=dilation_rate,
                             data_format=data_format, check_channels=False)
    return tuple((o, lo, hi) for o, (lo, hi) in zip(geo.output_spatial_shape, geo.padding,
                                                    strict=True))


@capabilities(array_free=True, formula=True)
def conv_output_spatial_shape(input_shape, filter_shape, strides, padding, dilation_rate=None,
                              data_format=None):
    r"""Spatial shape of a convolution's output.

    .. math::

        (o_1, \dots, o_r), \qquad
        o_i = \Big\lfloor \frac{n_i + p_{\text{lo},i} + p_{\text{hi},i} - (k_i-1)d_i - 1}{s_i}
        \Big\rfloor + 1 .

    Same arguments as :func:`conv_padding_amounts` (padding amounts from its rules).
    """
    return ConvGeometry.build("conv_output_spatial_shape", input_shape, filter_shape,
                              strides=strides, padding=padding, dilation=dilation_rate,
                              data_format=data_format,
                              check_channels=False).output_spatial_shape


@capabilities(array_free=True, formula=True)
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
    return ConvGeometry.build("num_conv_locations", input_shape, filter_shape,
                              strides=strides, padding=padding, dilation=dilation_rate,
                              data_format=data_format, check_channels=False).num_locations


# --------------------------------------------------------------------------------------
# Patch extraction
# --------------------------------------------------------------------------------------
def _patches_channels_last(xp, x, geo):
    """``x`` [N, *spatial, C] -> [N, *out, *kernel, C]: zero padding, then one strided slice
    per kernel offset δ (``x_pad[:, d⊙δ :: s]``), stacked in one copy that is already in the
    returned order (no gather, no copying transpose)."""
    kernel = geo.kernel_shape
    rank = len(kernel)
    if any(lo or hi for lo, hi in geo.padding):
        # one call: the library's own pad where it has one (one kernel on a device)
        x = xpx.pad(x, [(0, 0), *geo.padding, (0, 0)], xp=xp)
    views = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        # output o of axis i reads padded index o·s + δ·d (an empty slice when no output)
        index = tuple(slice(o * d, o * d + (s * (out - 1) + 1 if out else 0), s)
                      for o, d, s, out in zip(offset, geo.dilation, geo.strides,
                                              geo.output_spatial_shape, strict=True))
        views.append(x[(slice(None), *index, slice(None))])
    stacked = xp.stack(views, axis=1 + rank)  # [N, *out, Π kernel, C], kernel offsets row-major
    return xp.reshape(stacked, (*stacked.shape[:1 + rank], *kernel, stacked.shape[-1]))


@capabilities(dask="yes")
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
    check_array(func, "inputs", inputs, min_ndim=3, layout="[N, *spatial, C_in]")
    geo = ConvGeometry.build(func, tuple(inputs.shape), filter_shape, strides=strides,
                             padding=padding, dilation=dilation_rate, data_format=data_format,
                             input_name="inputs")
    return _extract_convolution_patches(xp, inputs, geo)


@kernel_of(extract_convolution_patches)
def _extract_convolution_patches(xp, inputs, geo):
    """Unchecked kernel: ``inputs`` in ``geo``'s layout -> ``[N, *out, *kernel, C_in]``
    (``geo`` a :class:`ConvGeometry`; the batch size is read from ``inputs``)."""
    return _patches_channels_last(xp, geo.to_channels_last(xp, inputs), geo)


def _four(func, name, value):
    """ksizes / strides / rates of extract_image_patches: None is not a default there."""
    if value is None:
        raise KFACTypeError(
            f"{func}: {name} must be an int, a pair [a, b] or TF's form [1, a, b, 1]; got "
            f"{describe(value)}."
        )
    return value


@capabilities(dask="yes")
def extract_image_patches(images, ksizes, strides, rates, padding, data_format=None):
    r"""TF's ``tf.image.extract_patches`` (2-D), flattened patches in (kh, kw, C) order.

    .. math::

        Q_{n, i, j, (a\,k_w + b)\,C + c}
        = x^{\text{pad}}_{n,\; s_h i + r_h a,\; s_w j + r_w b,\; c}.

    Parameters
    ----------
    images : array [N, H, W, C] (or [N, C, H, W] with ``data_format="NCHW"``)
    ksizes : int or sequence of int
        ``[1, k_h, k_w, 1]`` (TF form) or ``[k_h, k_w]``; required (TF has no default).
    strides, rates : int or sequence of int
        ``[1, s_h, s_w, 1]`` / ``[s_h, s_w]`` and likewise for the dilation rates; required.
    padding : {"SAME", "VALID"} or sequence of (int, int)
    data_format : {"NHWC", "NCHW", None}

    Returns
    -------
    array [N, o_h, o_w, k_h·k_w·C]

    Raises
    ------
    KFACValueError, KFACTypeError
        As :func:`extract_convolution_patches`, naming ``ksizes`` / ``rates``; ``images``
        must be 4-D; ``ksizes``, ``strides`` and ``rates`` must be given.

    References
    ----------
    TensorFlow ``tf.image.extract_patches`` (formerly ``extract_image_patches``).
    """
    func = "extract_image_patches"
    xp = namespace_of(func, images=images)
    check_array(func, "images", images, ndim=4, layout="[N, H, W, C]")
    channels_last = is_channels_last(func, data_format, 4)
    ksizes = _four(func, "ksizes", ksizes)
    strides = _four(func, "strides", strides)
    rates = _four(func, "rates", rates)
    c = images.shape[-1] if channels_last else images.shape[1]
    kernel = spatial_ints(func, "ksizes", ksizes, 2, channels_last)
    geo = ConvGeometry.build(func, tuple(images.shape), (*kernel, c, 1), strides=strides,
                             padding=padding, dilation=rates, data_format=data_format,
                             dilation_name="rates", input_name="images")
    patches = _extract_convolution_patches(xp, images, geo)
    n, oh, ow = patches.shape[:3]
    return xp.reshape(patches, (n, oh, ow, geo.patch_size))


@capabilities(dask="yes")
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
    geo = ConvGeometry.build(func, tuple(inputs.shape), filter_shape, padding="VALID",
                             data_format=data_format)
    if geo.kernel_shape != (1, 1):
        raise KFACValueError(f"{func}: filter_shape must be [1, 1, C_in, C_out]; got "
                             f"{geo.filter_shape}.")
    return _extract_pointwise_conv2d_patches(xp, inputs, geo)


@kernel_of(extract_pointwise_conv2d_patches)
def _extract_pointwise_conv2d_patches(xp, inputs, geo):
    """Unchecked kernel: every pixel of ``inputs`` (``geo``'s layout) as a 1×1 patch."""
    x = geo.to_channels_last(xp, inputs)
    n, h, w, c = x.shape
    return xp.reshape(x, (n, h, w, 1, 1, c))


# --------------------------------------------------------------------------------------
# Subsampling (TF's _SUB_SAMPLE_INPUTS / _SUB_SAMPLE_PATCHES)
# --------------------------------------------------------------------------------------
def check_subsample_factor(func, name, factor):
    r"""Validate the fraction of examples kept by input subsampling, :math:`f \in (0, 1]`.

    .. math:: 0 < f \le 1

    Part of kfac_ref's internal API: :func:`num_subsampled_inputs` and
    :func:`kfac_ref.factors.conv_input_kronecker_factor` check their own argument with it.
    """
    factor = check_scalar(func, name, factor, positive=True)
    if not float(factor) <= 1.0:
        raise KFACValueError(f"{func}: {name} must be in (0, 1]; got {describe(factor)}.")
    return float(factor)


@capabilities(array_free=True, formula=True)
def num_subsampled_inputs(batch_size, factor=0.2):
    r"""Number of examples kept when inputs are subsampled before patch extraction.

    .. math::

        N' = \lceil N \cdot f \rceil, \qquad f = \texttt{factor}
        \ (\text{TF's } \_INPUTS\_TO\_EXTRACT\_PATCHES\_FACTOR = 0.2).

    This is TF K-FAC master's rule.  TF K-FAC's older ``tf.contrib.kfac`` used
    ``int(N * 0.5)`` (floor, factor 0.5); pass ``factor=0.5`` to get its value whenever
    :math:`N/2` is an integer.
    """
    func = "num_subsampled_inputs"
    batch_size = check_int(func, "batch_size", batch_size, minimum=0)
    factor = check_subsample_factor(func, "factor", factor)
    return _num_subsampled_inputs(batch_size, factor)


@kernel_of(num_subsampled_inputs)
def _num_subsampled_inputs(batch_size, factor):
    return int(math.ceil(batch_size * factor))


@capabilities(array_free=True, formula=True)
def num_subsampled_patches(total_patches, dimension, max_num_patches=10_000_000,
                           max_num_patches_per_dimension=3.0):
    r"""Number of patch rows kept when patches are subsampled (TF's ``_subsample_patches``).

    .. math::

        m = \min\Big(M_{\max},\ \big\lceil \rho\, D \big\rceil\Big), \qquad
        \text{kept} = \min(m, \text{total}),

    with :math:`D` the patch dimension, :math:`M_{\max}` = ``max_num_patches`` (TF 1e7) and
    :math:`\rho` = ``max_num_patches_per_dimension`` (TF 3.0).  This is TF K-FAC master's
    ``_subsample_patches``; the older ``tf.contrib.kfac`` ``_subsample_for_cov_computation``
    keeps ``int(1 * D)`` rows (``_MAX_NUM_OUTER_PRODUCTS_PER_COV_ROW = 1``, no absolute cap),
    i.e. ``max_num_patches_per_dimension=1.0`` with a large ``max_num_patches``.
    """
    func = "num_subsampled_patches"
    total_patches = check_int(func, "total_patches", total_patches, minimum=0)
    dimension = check_int(func, "dimension", dimension, minimum=1)
    max_num_patches = check_int(func, "max_num_patches", max_num_patches, minimum=1)
    max_num_patches_per_dimension = float(check_scalar(
        func, "max_num_patches_per_dimension", max_num_patches_per_dimension, positive=True))
    return _num_subsampled_patches(total_patches, dimension, max_num_patches,
                                   max_num_patches_per_dimension)


@kernel_of(num_subsampled_patches)
def _num_subsampled_patches(total_patches, dimension, max_num_patches,
                            max_num_patches_per_dimension):
    m = min(max_num_patches, int(math.ceil(max_num_patches_per_dimension * dimension)))
    return min(m, total_patches)


@capabilities(dask="yes")
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
    return _subsample_rows(xp, array, num_rows, rng)


@kernel_of(subsample_rows)
def _subsample_rows(xp, array, num_rows, rng):
    n = array.shape[0]
    idx = host_draw(rng, array, lambda r: r.permutation(n)[: min(num_rows, n)],
                    dtype=xp.int64)
    return xp.take(array, idx, axis=0)


# --------------------------------------------------------------------------------------
# Chunks of examples under a memory bound
# --------------------------------------------------------------------------------------
MAX_TEMPORARY_BYTES = 64 * 2**20
"""Default bound (64 MiB) on the patch temporaries of one chunk of examples for host arrays
in the convolution statistics (:func:`kfac_ref.factors.conv_input_kronecker_factor`,
:func:`kfac_ref.factors.conv_output_kronecker_factor`,
:func:`kfac_ref.factors.conv_diagonal_factor`) and :class:`kfac_ref.nn.Conv2D` (keyword
``max_temporary_bytes``); GPU arrays get :func:`temporary_bytes_bound`'s share of free
device memory."""

DEVICE_MEMORY_SHARE = 0.25
"""Share of the free memory of a GPU that the patch temporaries of one chunk may take by
default (:func:`temporary_bytes_bound`)."""

_USER_BOUND = {"bytes": None}


@capabilities(array_free=True)
def set_max_temporary_bytes(nbytes):
    r"""Set, once for the process, the bound on the patch temporaries of one chunk of
    examples that every convolution statistic and :class:`kfac_ref.nn.Conv2D` uses when
    its ``max_temporary_bytes`` is not given (``None`` restores the device-aware default).

    Returns the previous setting (``None``: the device-aware default).
    """
    if nbytes is not None:
        nbytes = check_int("set_max_temporary_bytes", "nbytes", nbytes, minimum=1)
    previous, _USER_BOUND["bytes"] = _USER_BOUND["bytes"], nbytes
    return previous


@capabilities(dask="yes")
def temporary_bytes_bound(like, max_temporary_bytes=None):
    r"""The bound :math:`M` (bytes) on the patch temporaries of one chunk of examples for
    arrays like ``like``: the one place the chunk bound is decided.

    .. math::

        M = \begin{cases}
        \texttt{max\_temporary\_bytes} & \text{when given},\\
        \text{the bound of } \texttt{set\_max\_temporary\_bytes} & \text{when set},\\
        \max(64\,\text{MiB},\ \rho\cdot\text{free device memory}) &
            \text{CuPy arrays, torch CUDA tensors},\\
        64\,\text{MiB} & \text{otherwise (host arrays, lazy arrays)},
        \end{cases}

    with :math:`\rho` = :data:`DEVICE_MEMORY_SHARE` (0.25) and the free memory queried
    from the library (``cupy.cuda.Device.mem_info``, ``torch.cuda.mem_get_info``) at the
    call.  Chunking changes only the order of the sums, so any bound gives the same
    statistics up to rounding.
    """
    if max_temporary_bytes is not None:
        return max_temporary_bytes
    if _USER_BOUND["bytes"] is not None:
        return _USER_BOUND["bytes"]
    free = _free_device_bytes(like)
    if free is None:
        return MAX_TEMPORARY_BYTES
    return max(MAX_TEMPORARY_BYTES, int(DEVICE_MEMORY_SHARE * free))


def _free_device_bytes(like):
    """Free memory of the GPU that holds ``like`` (CuPy, torch CUDA), else None.  Not
    exercised without a GPU."""
    module = type(like).__module__.split(".")[0]
    try:
        if module == "cupy":
            return int(like.device.mem_info[0])
        if module == "torch" and getattr(like, "is_cuda", False):
            return int(sys.modules["torch"].cuda.mem_get_info(like.device)[0])
    except Exception:  # a query the driver refuses: the host default
        return None
    return None


@capabilities(array_free=True, formula=True)
def example_chunks(num_examples, entries_per_example, itemsize, max_temporary_bytes):
    r"""Chunks of examples whose temporaries stay within a memory bound, as a list of
    ``(start, stop)`` pairs that cover every example in order.

    .. math::

        b = \max\Big(1,\ \min\Big(N,\ \Big\lfloor \frac{M}{e\, s} \Big\rfloor\Big)\Big),
        \qquad \text{chunks } [kb,\ \min((k+1)b, N)),

    with :math:`N` = ``num_examples``, :math:`e` = ``entries_per_example`` (the entries one
    example adds to the largest temporary, e.g. :math:`|T|\,|\Delta|\,C_{in}` for its
    patches), :math:`s` = ``itemsize`` in bytes and :math:`M` = ``max_temporary_bytes``.  A
    single example that exceeds :math:`M` still forms a chunk of its own, so the bound is
    :math:`\max(M, e\,s)`.  Host integers only (shapes are static); callers loop over the
    chunks, one GEMM-shaped step each, never over examples.
    """
    size = max(1, min(num_examples, max_temporary_bytes // max(1, entries_per_example * itemsize)))
    return [(start, min(start + size, num_examples)) for start in range(0, num_examples, size)]


def per_example_patch_products(xp, patch_rows, outputs_grad_rows):
    r"""Internal kernel, the one home of a convolution's per-example weight gradient summed
    over locations: ``[N, |T|, D]`` patch rows and ``[N, |T|, C_out]`` back-propagated
    vectors (channels last) → ``[N, D, C_out]``.

    .. math:: DW_n = \sum_{t \in T} \bar p_{n,t}\, g_{n,t}^\top

    One batched GEMM.  Used by :func:`kfac_ref.factors.conv_per_example_gradients` (with
    the bias coordinate and patch mask in the rows) and by
    :meth:`kfac_ref.nn.Conv2D.param_grads` (``per_example=True``).
    """
    return xp.matrix_transpose(patch_rows) @ outputs_grad_rows
