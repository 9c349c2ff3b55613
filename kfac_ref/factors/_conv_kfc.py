r"""Convolution layer factors of TF K-FAC (KFC): input/output Kronecker factors and the diagonal.

Conventions: inputs ``[N, *spatial, C_in]`` (``data_format`` channels last, default
``"NHWC"``) or ``[N, C_in, *spatial]`` (``"NCHW"`` etc.); kernels ``[k_1, ..., k_r, C_in,
C_out]``; patch vectors ordered ``(k_1, ..., k_r, C_in)`` with ``C_in`` fastest, bias
coordinate appended last (:mod:`kfac_ref.patches`).  Both Kronecker factors are normalised
by :math:`N|T|` (:math:`|T|` = number of output locations), so the KFC block is
:math:`|T|\,(\Omega \otimes \Gamma)` and a damping :math:`\lambda` reaches the factors as
:math:`\lambda/|T|` (TF ``ConvKFCBasicFB``, kfac-jax ``Conv2DTwoKroneckerFactored``).

Every public function validates its arguments once, builds one
:class:`kfac_ref.conv_geometry.ConvGeometry`, and calls its unchecked kernel
(``conv_per_example_gradients.kernel(xp, inputs, outputs_grad, geometry, has_bias)`` and so
on); the classes validate each tower once and call the kernels.  The spatially uncorrelated
(SUA) factors are in :class:`~kfac_ref.factors.ConvInputSUAKroneckerFactor`.
"""

from __future__ import annotations

import math

from .._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_bool,
    check_int,
    check_option,
    check_rng,
    check_scalar,
    describe,
    kernel_of,
    namespace_of,
)
from .._support import capabilities
from ..conv_geometry import ConvGeometry, is_channels_last, to_channels_last
from ..linalg import append_homog, compute_cov
from ..patches import (
    check_subsample_factor,
    example_chunks,
    extract_convolution_patches,
    extract_pointwise_conv2d_patches,
    num_subsampled_inputs,
    num_subsampled_patches,
    per_example_patch_products,
    subsample_rows,
    temporary_bytes_bound,
)
from ._base import (
    DenseSquareMatrixFactor,
    DiagonalFactor,
    as_sources_towers,
    as_towers,
    check_equal_batches,
    input_towers_and_sources,
)


def _chunk_bounds(xp, n, entries_per_example, max_temporary_bytes, like):
    """:func:`kfac_ref.patches.example_chunks` for arrays like ``like`` (the bound from
    :func:`temporary_bytes_bound`)."""
    return example_chunks(n, entries_per_example, xp.finfo(like.dtype).bits // 8,
                          temporary_bytes_bound(like, max_temporary_bytes))


EXTRACT_PATCHES_FNS = ("extract_convolution_patches", "extract_image_patches",
                       "extract_pointwise_conv2d_patches")
"""TF's ``extract_patches_fn`` choices (``None`` means the first)."""


def _check_extract_options(func, filter_shape, extract_patches_fn, patch_mask):
    """The patch options that need no data: TF's ``extract_patches_fn`` switch and the
    ``patch_mask`` (checked, with its one finiteness scan, here)."""
    if extract_patches_fn is not None:
        check_option(func, "extract_patches_fn", extract_patches_fn, EXTRACT_PATCHES_FNS)
    if extract_patches_fn == "extract_image_patches" and len(filter_shape) != 4:
        raise KFACValueError(f"{func}: extract_patches_fn='extract_image_patches' needs a 2-D "
                             f"convolution (4-D inputs); got filter_shape {filter_shape}.")
    if (extract_patches_fn == "extract_pointwise_conv2d_patches"
            and (len(filter_shape) != 4 or tuple(filter_shape[:2]) != (1, 1))):
        raise KFACValueError(f"{func}: extract_patches_fn='extract_pointwise_conv2d_patches' "
                             f"needs filter_shape [1, 1, C_in, C_out]; got {filter_shape}.")
    if patch_mask is not None:
        check_array(func, "patch_mask", patch_mask, shape=tuple(filter_shape[:-1]),
                    layout="[k_1, ..., k_r, C_in]")


def _check_extract_geometry(func, geo, extract_patches_fn):
    """The patch options that need the geometry (unit strides of the pointwise variant)."""
    if (extract_patches_fn == "extract_pointwise_conv2d_patches"
            and any(v != 1 for v in geo.strides)):
        raise KFACValueError(f"{func}: extract_pointwise_conv2d_patches needs unit strides; got "
                             f"{geo.strides}.")


def _inputs_geometry(func, inputs, filter_shape, padding, strides, dilation, data_format, *,
                     dilation_name="dilation_rate"):
    """Check ``inputs`` (its one finiteness scan) and build the convolution's geometry."""
    check_array(func, "inputs", inputs, min_ndim=3, layout="[N, *spatial, C_in]")
    return ConvGeometry.build(func, tuple(inputs.shape), filter_shape, strides=strides,
                              padding=padding, dilation=dilation, data_format=data_format,
                              dilation_name=dilation_name, input_name="inputs")


def _check_patch_args(func, inputs, filter_shape, padding, strides, dilation, data_format,
                      has_bias, extract_patches_fn, patch_mask):
    """``(xp, geometry)``: the checked arguments of the patch-matrix functions."""
    xp = namespace_of(func, inputs=inputs, patch_mask=patch_mask)
    geo = _inputs_geometry(func, inputs, filter_shape, padding, strides, dilation, data_format)
    check_bool(func, "has_bias", has_bias)
    _check_extract_options(func, geo.filter_shape, extract_patches_fn, patch_mask)
    _check_extract_geometry(func, geo, extract_patches_fn)
    return xp, geo


@capabilities(dask="yes")
def conv_patch_matrix(inputs, filter_shape, padding, strides=None, dilation_rate=None,
                      data_format="NHWC", has_bias=False, *, extract_patches_fn=None,
                      patch_mask=None):
    r"""KFC's expanded matrix :math:`[[A]]_H`: one row per (example, output location).

    .. math::

        [[A]]_H = \big[\, P \;\; \mathbf 1 \,\big]
        \in \mathbb{R}^{N|T| \times (|\Delta| C_{in} + 1)},
        \qquad P_{(n,t),(\delta,c)} = x^{\text{pad}}_{n,\, s\odot t + d\odot\delta,\, c},

    rows ordered example-major then location (row-major over the output grid), columns
    ``(k_1, …, k_r, C_in)`` with ``C_in`` fastest, the ones column (``has_bias``) last.  A
    ``patch_mask`` ``[k_1, …, k_r, C_in]`` multiplies every patch (TF master).

    Parameters
    ----------
    inputs, filter_shape, padding, strides, dilation_rate, data_format
        As :func:`kfac_ref.patches.extract_convolution_patches` (``data_format`` defaults
        to ``"NHWC"``; pass ``None`` for channels last at any rank).
    has_bias : bool
    extract_patches_fn : {None, "extract_convolution_patches", "extract_image_patches",
        "extract_pointwise_conv2d_patches"}
        TF's switch; all three give the same patches where they apply (the image variant
        is 2-D only, the pointwise one needs a 1×1 kernel and unit strides).
    patch_mask : array, optional

    Returns
    -------
    array ``[N·|T|, |Δ|·C_in (+1)]``
        Peak memory: :math:`N\,|T|\,|\Delta|\,C_{in}` entries.

    References
    ----------
    Grosse & Martens (2016), eq. 14; TF K-FAC ``ConvInputKroneckerFactor._compute_new_cov``.
    """
    func = "conv_patch_matrix"
    xp, geo = _check_patch_args(func, inputs, filter_shape, padding, strides, dilation_rate,
                                data_format, has_bias, extract_patches_fn, patch_mask)
    return _conv_patch_matrix(xp, inputs, geo, has_bias, extract_patches_fn=extract_patches_fn,
                              patch_mask=patch_mask)


@kernel_of(conv_patch_matrix)
def _conv_patch_matrix(xp, inputs, geo, has_bias=False, *, extract_patches_fn=None,
                       patch_mask=None):
    """Unchecked kernel: ``inputs`` in ``geo``'s layout (any batch size) -> ``[[A]]_H``."""
    if extract_patches_fn == "extract_pointwise_conv2d_patches":
        patches = extract_pointwise_conv2d_patches.kernel(xp, inputs, geo)
    else:  # the image variant gives the same patches as the general one
        patches = extract_convolution_patches.kernel(xp, inputs, geo)
    return patch_rows(xp, patches, geo.patch_size, has_bias, patch_mask)


def patch_rows(xp, patches, patch_size, has_bias=False, patch_mask=None):
    r"""Unchecked kernel: extracted patches (any leading shape, the patch entries last or
    last three) → the rows :math:`[\![A]\!]_H` ``[rows, K (+1)]`` of the KFC input factor.

    .. math:: \bar p_{n,t} = (p_{n,t} \odot m,\ 1)

    (mask :math:`m` when given, the homogeneous 1 with a bias).  Shared by the factor's own
    patch extraction and by callers that already hold the patches (a conv layer's forward
    pass, :func:`conv_input_factor_tap`).
    """
    rows = xp.reshape(patches, (-1, patch_size))
    if patch_mask is not None:
        rows = rows * xp.reshape(patch_mask, (patch_size,))
    if has_bias:
        rows = append_homog.kernel(xp, rows)
    return rows


@capabilities(dask="yes")
def conv_input_factor_tap(geometry, has_bias=False):
    r"""The KFC input factor :math:`\Omega` as a tap of a convolution's forward pass: a
    function of the patches of a chunk of examples whose sum over the chunks of a batch is
    :func:`conv_input_kronecker_factor` of the batch.

    .. math::

        \operatorname{tap}(P_c) = \frac{1}{N|T|}\sum_{n \in c,\ t \in T}
            \bar p_{n,t}\bar p_{n,t}^\top, \qquad
        \sum_c \operatorname{tap}(P_c) = \Omega,

    with :math:`\bar p = (p, 1)` with a bias and :math:`N` the batch size of ``geometry``.
    For :meth:`kfac_ref.nn.Layer.forward_with_tap` (and the ``taps`` of
    :meth:`kfac_ref.nn.Sequential.forward_pass`): :class:`kfac_ref.nn.Conv2D` hands it the
    ``[B, Ho, Wo, kh·kw·C_in]`` patches of each chunk while they are alive, so the factor
    needs no second patch extraction.

    Parameters
    ----------
    geometry : kfac_ref.conv_geometry.ConvGeometry
        The convolution on the whole batch (``geometry.input_shape[0]`` is :math:`N`), e.g.
        :meth:`kfac_ref.nn.Conv2D.geometry` of the layer's input shape.
    has_bias : bool

    Returns
    -------
    callable
        ``tap(patches) -> [K (+1), K (+1)]``, ``K = kh·kw·C_in``.
    """
    func = "conv_input_factor_tap"
    if not isinstance(geometry, ConvGeometry):
        raise KFACTypeError(f"{func}: geometry must be a kfac_ref.conv_geometry.ConvGeometry; got "
                            f"{type(geometry).__name__}.")
    has_bias = check_bool(func, "has_bias", has_bias)
    rows, size = geometry.input_shape[0] * geometry.num_locations, geometry.patch_size

    def tap(patches):
        xp = namespace_of(func, patches=patches)
        check_array(func, "patches", patches, min_ndim=1, layout="[..., kh·kw·C_in]")
        if patches.shape[-1] != size and math.prod(patches.shape[-3:]) != size:
            raise KFACValueError(f"{func}: patches must end in the geometry's {size} patch "
                                 f"entries (last axis, or the last three); got "
                                 f"{describe(patches)}.")
        return compute_cov.kernel(xp, patch_rows(xp, patches, size, has_bias), None, rows)

    return tap


@capabilities(dask="yes")
def conv_input_kronecker_factor(inputs, filter_shape, padding, strides=None, dilation_rate=None,
                                data_format="NHWC", has_bias=False, *, extract_patches_fn=None,
                                patch_mask=None, sub_sample_inputs=False,
                                sub_sample_patches=False, rng=None,
                                inputs_to_extract_patches_factor=0.2,
                                max_num_patches=10_000_000, max_num_patches_per_dimension=3.0,
                                max_temporary_bytes=None):
    r"""KFC input factor :math:`\Omega`: second moment of the patch vectors over examples
    *and* locations.

    .. math::

        \Omega = \frac{1}{N |T|} \sum_{n=1}^{N} \sum_{t \in T} \bar p_{n,t}\, \bar p_{n,t}^\top
               = \frac{1}{N|T|}\, [[A]]_H^\top [[A]]_H ,
        \qquad \bar p_{n,t} = [p_{n,t}, 1]\ (\texttt{has\_bias}),

    where :math:`p_{n,t}` is the patch read by output location :math:`t` (zero padding
    included; the homogeneous 1 is present at every location, so the bias corner is 1).
    This is TF K-FAC's normalisation, :math:`\hat\Omega/|T|` in the KFC paper's notation;
    the block multiplies by :math:`|T|`.

    Memory: the examples are processed in chunks of :math:`B` examples, the most for which
    the chunk's temporaries — three copies of its patch matrix,
    :math:`B\,|T|\,(|\Delta| C_{in} + 1)` entries each, and two of its padded input
    (:meth:`kfac_ref.conv_geometry.ConvGeometry.temporary_entries_per_example`) — times the
    dtype size stay within ``max_temporary_bytes`` (at least one example per chunk); each chunk
    is one GEMM, accumulated as :math:`\Omega = \sum_c [[A]]_c^\top [[A]]_c / (N|T|)`, so the
    chunked and the one-shot result agree to rounding.  The loop runs over chunks only.
    With ``sub_sample_patches`` the whole patch matrix is materialised (rows are drawn from
    all of it, as TF does).

    Subsampling (TF's ``_SUB_SAMPLE_INPUTS`` / ``_SUB_SAMPLE_PATCHES``, both off by default)
    draws from the explicit generator ``rng`` on the host (:func:`kfac_ref.patches.subsample_rows`):
    ``sub_sample_inputs`` keeps :math:`\lceil f N \rceil` random examples before patch
    extraction; ``sub_sample_patches`` keeps :math:`\min(M_{\max}, \lceil \rho D \rceil)` random
    patch rows (:math:`D` the patch dimension without bias) before the bias is appended.  The
    normaliser is then the number of rows kept.

    Parameters
    ----------
    inputs : array ``[N, *spatial, C_in]`` or channels first
    filter_shape : sequence of int
        ``[k_1, ..., k_r, C_in, C_out]``.
    padding : {"SAME", "VALID"} or sequence of (int, int)
    strides, dilation_rate : int, sequence or None
        Spatial or TF's full-rank form.
    data_format : str or None
        ``"NHWC"`` (default), ``"NCHW"``, other :data:`kfac_ref.conv_geometry.DATA_FORMATS`, or
        ``None`` (channels last, any rank).
    has_bias : bool
    extract_patches_fn, patch_mask
        See :func:`conv_patch_matrix`.
    sub_sample_inputs, sub_sample_patches : bool
    rng : numpy.random.Generator
        Required when subsampling.
    inputs_to_extract_patches_factor, max_num_patches, max_num_patches_per_dimension
        TF's constants (0.2, 1e7, 3.0).
    max_temporary_bytes : int, optional
        Bound on the patch temporaries of one chunk (default :func:`temporary_bytes_bound`:
        64 MiB for host arrays, a share of free GPU memory): a chunk of :math:`B` examples
        counts three copies of its patch matrix,
        :math:`B\,|T|\,(|\Delta| C_{in} + 1)` entries each, and two of its padded input
        (:meth:`kfac_ref.conv_geometry.ConvGeometry.temporary_entries_per_example`).

    Returns
    -------
    array ``[|Δ|·C_in (+1), |Δ|·C_in (+1)]``

    Raises
    ------
    KFACValueError, KFACTypeError
        Channel mismatch between ``inputs`` and ``filter_shape``, wrong rank for the data
        format, unknown padding, non-positive strides/dilation, missing ``rng`` when
        subsampling, an empty output grid.

    References
    ----------
    Grosse & Martens (2016), §3.1; TF K-FAC ``ConvInputKroneckerFactor``.
    """
    func = "conv_input_kronecker_factor"
    # Everything is validated before the generator is drawn from or patches are built.
    xp, geo = _check_patch_args(func, inputs, filter_shape, padding, strides, dilation_rate,
                                data_format, has_bias, extract_patches_fn, patch_mask)
    subsampling = _check_subsampling(func, sub_sample_inputs, sub_sample_patches, rng,
                                     inputs_to_extract_patches_factor, max_num_patches,
                                     max_num_patches_per_dimension)
    if max_temporary_bytes is not None:
        max_temporary_bytes = check_int(func, "max_temporary_bytes", max_temporary_bytes,
                                        minimum=1)
    geo.check_nonempty(func)
    return _conv_input_kronecker_factor(xp, inputs, geo, has_bias,
                                        extract_patches_fn=extract_patches_fn,
                                        patch_mask=patch_mask,
                                        max_temporary_bytes=max_temporary_bytes, **subsampling)


def _check_subsampling(func, sub_sample_inputs, sub_sample_patches, rng, factor,
                       max_num_patches, max_num_patches_per_dimension):
    """TF's subsampling options, checked before any draw; the kernel's keyword arguments."""
    check_bool(func, "sub_sample_inputs", sub_sample_inputs)
    check_bool(func, "sub_sample_patches", sub_sample_patches)
    if sub_sample_inputs or sub_sample_patches:
        check_rng(func, "rng", rng)
    # the constants are checked whether or not subsampling is on (a bad value is a bug)
    factor = check_subsample_factor(func, "inputs_to_extract_patches_factor", factor)
    max_num_patches = check_int(func, "max_num_patches", max_num_patches, minimum=1)
    max_num_patches_per_dimension = float(check_scalar(
        func, "max_num_patches_per_dimension", max_num_patches_per_dimension, positive=True))
    return dict(sub_sample_inputs=sub_sample_inputs, sub_sample_patches=sub_sample_patches,
                rng=rng, inputs_to_extract_patches_factor=factor,
                max_num_patches=max_num_patches,
                max_num_patches_per_dimension=max_num_patches_per_dimension)


def _sum_over_chunks(bounds, moment):
    """``Σ moment(start, stop)`` over the chunks; a chunk's temporaries live only inside
    ``moment``, so they are freed before the next chunk's are made (the memory bound counts
    one chunk's)."""
    total = None
    for start, stop in bounds:
        part = moment(start, stop)
        total = part if total is None else total + part
    return total


@kernel_of(conv_input_kronecker_factor)
def _conv_input_kronecker_factor(xp, inputs, geo, has_bias=False, *, extract_patches_fn=None,
                                 patch_mask=None, sub_sample_inputs=False,
                                 sub_sample_patches=False, rng=None,
                                 inputs_to_extract_patches_factor=0.2,
                                 max_num_patches=10_000_000, max_num_patches_per_dimension=3.0,
                                 max_temporary_bytes=None):
    """Unchecked kernel of :func:`conv_input_kronecker_factor` (options normalised)."""
    if sub_sample_inputs:
        keep = num_subsampled_inputs.kernel(inputs.shape[0], inputs_to_extract_patches_factor)
        inputs = subsample_rows.kernel(xp, inputs, keep, rng)
    if not sub_sample_patches:  # chunks of examples, one GEMM each
        n = inputs.shape[0]
        bounds = _chunk_bounds(xp, n, geo.temporary_entries_per_example(int(has_bias)),
                               max_temporary_bytes, inputs)
        def moment(start, stop):
            p = _conv_patch_matrix(xp, inputs[start:stop, ...], geo, has_bias,
                                   extract_patches_fn=extract_patches_fn,
                                   patch_mask=patch_mask)
            return compute_cov.kernel(xp, p, None, n * geo.num_locations)

        return _sum_over_chunks(bounds, moment)
    patches = _conv_patch_matrix(xp, inputs, geo, False, extract_patches_fn=extract_patches_fn,
                                 patch_mask=patch_mask)
    if sub_sample_patches:
        keep = num_subsampled_patches.kernel(patches.shape[0], patches.shape[1],
                                             max_num_patches, max_num_patches_per_dimension)
        if keep < patches.shape[0]:
            patches = subsample_rows.kernel(xp, patches, keep, rng)
    if has_bias:
        patches = append_homog.kernel(xp, patches)
    return compute_cov.kernel(xp, patches)


def _check_outputs_grad(func, outputs_grad, data_format, *, name="outputs_grad",
                        layout="[N, *spatial, C_out]"):
    """Check an output-shaped array and its layout; return True for channels last."""
    check_array(func, name, outputs_grad, min_ndim=2, layout=layout)
    return is_channels_last(func, data_format, outputs_grad.ndim, array_name=name)


@capabilities(dask="yes")
def conv_output_kronecker_factor(outputs_grad, data_format="NHWC", *,
                                 max_temporary_bytes=None):
    r"""KFC output factor :math:`\Gamma`: second moment of the back-propagated vectors over
    examples and locations.

    .. math::

        \Gamma = \frac{1}{N|T|} \sum_{n} \sum_{t \in T} g_{n,t}\, g_{n,t}^\top
               = \frac{1}{N|T|}\, DS^\top DS, \qquad DS = \mathrm{reshape}(g, [N|T|, C_{out}]).

    Parameters
    ----------
    outputs_grad : array ``[N, *spatial, C_out]`` or ``[N, C_out, *spatial]``
        Per-example gradients of the summed loss w.r.t. the pre-activations.
    data_format : str or None
        ``"NHWC"`` (default), ``"NCHW"``, other :data:`kfac_ref.conv_geometry.DATA_FORMATS`, or
        ``None`` (channels last, any rank ≥ 2).
    max_temporary_bytes : int, optional
        Bound on the temporaries of one chunk of examples (a channels-first input is
        transposed chunk by chunk); default :func:`temporary_bytes_bound`.

    Returns
    -------
    array [C_out, C_out]

    Raises
    ------
    KFACValueError, KFACTypeError
        Rank mismatch with ``data_format``, non-finite input, no rows.

    References
    ----------
    Grosse & Martens (2016), §3.1; TF K-FAC ``ConvOutputKroneckerFactor``.
    """
    func = "conv_output_kronecker_factor"
    xp = namespace_of(func, outputs_grad=outputs_grad)
    channels_last = _check_outputs_grad(func, outputs_grad, data_format)
    if math.prod(outputs_grad.shape) == 0:
        raise KFACValueError(f"{func}: outputs_grad must have at least one location; got shape "
                             f"{tuple(outputs_grad.shape)}.")
    if max_temporary_bytes is not None:
        max_temporary_bytes = check_int(func, "max_temporary_bytes", max_temporary_bytes,
                                        minimum=1)
    return _conv_output_kronecker_factor(xp, outputs_grad, channels_last,
                                         max_temporary_bytes=max_temporary_bytes)


@kernel_of(conv_output_kronecker_factor)
def _conv_output_kronecker_factor(xp, outputs_grad, channels_last=True, *,
                                  max_temporary_bytes=None):
    """Unchecked kernel: ``DSᵀDS / (N|T|)`` of an output-shaped array, by chunks."""
    n = outputs_grad.shape[0]
    per_example = math.prod(outputs_grad.shape[1:])
    rows = math.prod(outputs_grad.shape) // outputs_grad.shape[-1 if channels_last else 1]
    def moment(start, stop):
        g = to_channels_last(xp, outputs_grad[start:stop, ...], channels_last)
        return compute_cov.kernel(xp, xp.reshape(g, (-1, g.shape[-1])), None, rows)

    return _sum_over_chunks(_chunk_bounds(xp, n, per_example, max_temporary_bytes,
                                          outputs_grad), moment)


@capabilities(dask="yes")
def conv_per_example_gradients(inputs, outputs_grad, filter_shape, strides, padding,
                               data_format="NHWC", dilations=None, has_bias=False, *,
                               patch_mask=None):
    r"""Per-example weight gradients of a convolution, summed over locations.

    .. math::

        DW_n = \sum_{t \in T} \bar p_{n,t}\, g_{n,t}^\top \in
        \mathbb{R}^{(|\Delta| C_{in} (+1)) \times C_{out}},

    with :math:`\bar p_{n,t}` the patch at location :math:`t` (order ``(kh, kw, C_in)``, bias
    coordinate last) and :math:`g_{n,t}` the back-propagated vector there (no 1/N).  One
    batched GEMM over the patch tensor; the statistic of :func:`conv_diagonal_factor` and the
    per-example gradients of the full convolution blocks.  Arguments and errors as
    :func:`conv_diagonal_factor`.

    Returns
    -------
    array [N, D, C_out]
        With ``D = kh·kw·C_in`` (plus one with ``has_bias``).
    """
    func = "conv_per_example_gradients"
    xp, geo = _check_conv_pair(func, inputs, outputs_grad, filter_shape, strides, padding,
                               data_format, dilations, has_bias, patch_mask)
    return _conv_per_example_gradients(xp, inputs, outputs_grad, geo, has_bias,
                                       patch_mask=patch_mask)


def _check_conv_pair(func, inputs, outputs_grad, filter_shape, strides, padding, data_format,
                     dilations, has_bias, patch_mask):
    """Validate (inputs, outputs_grad) of one convolution once: each array scanned once."""
    xp = namespace_of(func, inputs=inputs, outputs_grad=outputs_grad, patch_mask=patch_mask)
    geo = _inputs_geometry(func, inputs, filter_shape, padding, strides, dilations, data_format,
                           dilation_name="dilations")
    check_array(func, "outputs_grad", outputs_grad, ndim=inputs.ndim,
                layout="[N, *out_spatial, C_out]")
    geo.check_output_grid(func, "outputs_grad", outputs_grad.shape)
    check_bool(func, "has_bias", has_bias)
    _check_extract_options(func, geo.filter_shape, None, patch_mask)
    geo.check_nonempty(func)
    return xp, geo


@kernel_of(conv_per_example_gradients)
def _conv_per_example_gradients(xp, inputs, outputs_grad, geo, has_bias=False, *,
                                patch_mask=None):
    r"""Unchecked kernel, the one home of :math:`DW_n = \sum_t \bar p_{n,t} g_{n,t}^\top`:
    ``inputs`` and ``outputs_grad`` in ``geo``'s layout -> ``[N, D(+1), C_out]``."""
    n = inputs.shape[0]
    patches = _conv_patch_matrix(xp, inputs, geo, has_bias, patch_mask=patch_mask)
    g = geo.to_channels_last(xp, outputs_grad)
    p = xp.reshape(patches, (n, geo.num_locations, patches.shape[1]))
    gg = xp.reshape(g, (n, geo.num_locations, geo.out_channels))
    return per_example_patch_products(xp, p, gg)  # [N, D(+1), C_out] = Σ_t p̄ gᵀ


@capabilities(dask="yes")
def conv_diagonal_factor(inputs, outputs_grad, filter_shape, strides, padding,
                         data_format="NHWC", dilations=None, has_bias=False, *,
                         patch_mask=None, max_temporary_bytes=None):
    r"""Exact diagonal of the per-example second moment of a convolution's gradient.

    .. math::

        F = \frac{1}{N} \sum_{n=1}^{N}
            \Big(\sum_{t \in T} \bar p_{n,t}\, g_{n,t}^\top\Big)^{\odot 2},
        \qquad F \in \mathbb{R}^{(|\Delta| C_{in} + 1) \times C_{out}},

    the "sum of squares" estimator: each example's weight gradient :math:`DW_n` (summed over
    locations, one batched GEMM) is squared elementwise and averaged over examples.

    Parameters
    ----------
    inputs : array ``[N, *spatial, C_in]`` (or channels first)
    outputs_grad : array ``[N, *out_spatial, C_out]`` (same data format)
    filter_shape : sequence of int
        ``[k_1, ..., k_r, C_in, C_out]``.
    strides : int, sequence or None
        Spatial or TF's full-rank form (TF requires the 4-element form).
    padding : {"SAME", "VALID"} or sequence of (int, int)
    data_format : str or None
    dilations : int, sequence or None
    has_bias : bool
    patch_mask : array [k_1, ..., k_r, C_in], optional
    max_temporary_bytes : int
        Bound on the temporaries of one chunk of :math:`B` examples — its patch tensor
        (:meth:`kfac_ref.conv_geometry.ConvGeometry.temporary_entries_per_example`) and
        per-example gradients, :math:`B\,C_{out}(|\Delta| C_{in} + 1)` entries (at least one
        example per chunk); default :func:`temporary_bytes_bound`.

    Returns
    -------
    array ``[|Δ|·C_in (+1), C_out]``
        In the shape of the kernel reshaped to 2-D with the bias row last; the squares are
        summed chunk by chunk (one batched GEMM per chunk, no loop over examples).

    Raises
    ------
    KFACValueError, KFACTypeError
        Channel mismatches (inputs vs ``filter_shape[-2]``, outputs_grad vs
        ``filter_shape[-1]``), batch or output-grid mismatch, bad padding/strides.

    References
    ----------
    TF K-FAC ``ConvDiagonalFactor`` (einsum ``bijk,bijl->bkl``).
    """
    func = "conv_diagonal_factor"
    xp, geo = _check_conv_pair(func, inputs, outputs_grad, filter_shape, strides, padding,
                               data_format, dilations, has_bias, patch_mask)
    if max_temporary_bytes is not None:
        max_temporary_bytes = check_int(func, "max_temporary_bytes", max_temporary_bytes,
                                        minimum=1)
    return _conv_diagonal_factor(xp, inputs, outputs_grad, geo, has_bias, patch_mask=patch_mask,
                                 max_temporary_bytes=max_temporary_bytes)


@kernel_of(conv_diagonal_factor)
def _conv_diagonal_factor(xp, inputs, outputs_grad, geo, has_bias=False, *, patch_mask=None,
                          max_temporary_bytes=None):
    """Unchecked kernel: mean over examples of the squared per-example gradients, by chunks."""
    n = inputs.shape[0]
    d = geo.patch_size + has_bias
    # the per-example gradients and their square: two [C_out·d] arrays per example
    bounds = _chunk_bounds(xp, n, geo.temporary_entries_per_example(int(has_bias))
                           + 2 * geo.out_channels * d, max_temporary_bytes, inputs)

    def moment(start, stop):
        per_example = _conv_per_example_gradients(
            xp, inputs[start:stop, ...], outputs_grad[start:stop, ...], geo,
            has_bias, patch_mask=patch_mask)
        return xp.sum(per_example * per_example, axis=0)

    return _sum_over_chunks(bounds, moment) / float(n)


# --------------------------------------------------------------------------------------
# Stateful classes
# --------------------------------------------------------------------------------------
@capabilities(dask="yes")
class ConvInputKroneckerFactor(DenseSquareMatrixFactor):
    r"""TF K-FAC's ``ConvInputKroneckerFactor``: moving average of
    :func:`conv_input_kronecker_factor`.

    .. math::

        \text{new\_cov} = \frac{1}{n_{\text{towers}}} \sum_{t}
            \frac{1}{N|T|}\, [[A_t]]_H^\top [[A_t]]_H \quad (\text{one source}).

    Data for :meth:`update_cov`: ``inputs`` (an array or a sequence over towers); pass
    ``rng=`` (a :class:`numpy.random.Generator`) when subsampling is on.

    Parameters
    ----------
    filter_shape, padding, strides, dilation_rate, data_format, has_bias
        As :func:`conv_input_kronecker_factor`.
    extract_patches_fn, sub_sample_inputs, sub_sample_patches, patch_mask
        TF's options (subsampling off by default).
    zero_debias, eigenvalue_decomposition_threshold, eigenvalue_clipping_threshold
        See :class:`~kfac_ref.factors.DenseSquareMatrixFactor`.
    """

    def __init__(self, filter_shape, padding, strides=None, dilation_rate=None,
                 data_format="NHWC", extract_patches_fn=None, has_bias=False,
                 sub_sample_inputs=False, sub_sample_patches=False, patch_mask=None, **kwargs):
        super().__init__(**kwargs)
        func = type(self).__name__
        filter_shape = ConvGeometry.check_options(func, filter_shape, strides=strides,
                                                  padding=padding, dilation=dilation_rate,
                                                  data_format=data_format)
        _check_extract_options(func, filter_shape, extract_patches_fn, patch_mask)
        self._set(filter_shape=filter_shape, padding=padding,
                  strides=strides, dilation_rate=dilation_rate, data_format=data_format,
                  extract_patches_fn=extract_patches_fn,
                  has_bias=check_bool(func, "has_bias", has_bias),
                  sub_sample_inputs=check_bool(func, "sub_sample_inputs", sub_sample_inputs),
                  sub_sample_patches=check_bool(func, "sub_sample_patches", sub_sample_patches),
                  patch_mask=patch_mask)

    def _contributions(self, inputs, rng=None):
        func = f"{self.name}.update_cov"
        towers = as_towers(func, "inputs", inputs)
        check_equal_batches(func, "inputs", towers)
        subsampling = _check_subsampling(func, self.sub_sample_inputs, self.sub_sample_patches,
                                         rng, 0.2, 10_000_000, 3.0)
        covs = []
        for x in towers:
            xp = namespace_of(func, inputs=x, patch_mask=self.patch_mask)
            geo = _inputs_geometry(func, x, self.filter_shape, self.padding, self.strides,
                                   self.dilation_rate, self.data_format)
            _check_extract_geometry(func, geo, self.extract_patches_fn)
            geo.check_nonempty(func)
            covs.append(_conv_input_kronecker_factor(
                xp, x, geo, self.has_bias, extract_patches_fn=self.extract_patches_fn,
                patch_mask=self.patch_mask, **subsampling))
        return (tuple(covs),)


@capabilities(dask="yes")
class ConvOutputKroneckerFactor(DenseSquareMatrixFactor):
    r"""TF K-FAC's ``ConvOutputKroneckerFactor``: moving average of
    :func:`conv_output_kronecker_factor`.

    .. math::

        \text{new\_cov} = \frac{1}{n_{\text{towers}}} \sum_{s} \sum_{t}
            \frac{1}{N|T|}\, DS_{s,t}^\top DS_{s,t} .

    Data for :meth:`update_cov`: ``outputs_grads``, an array or sources × towers.
    (TF rejects channels-first data; here ``data_format="NCHW"`` is accepted.)
    """

    def __init__(self, data_format="NHWC", **kwargs):
        super().__init__(**kwargs)
        is_channels_last(type(self).__name__, data_format)
        self._set(data_format=data_format)

    def _contributions(self, outputs_grads):
        func = f"{self.name}.update_cov"
        st = as_sources_towers(func, "outputs_grads", outputs_grads)
        for src in st:
            check_equal_batches(func, "outputs_grads", src)
        out = []
        for src in st:
            covs = []
            for g in src:
                xp = namespace_of(func, outputs_grads=g)
                channels_last = _check_outputs_grad(func, g, self.data_format,
                                                    name="outputs_grads")
                if math.prod(g.shape) == 0:
                    raise KFACValueError(f"{func}: outputs_grads must have at least one "
                                         f"location; got shape {tuple(g.shape)}.")
                covs.append(_conv_output_kronecker_factor(xp, g, channels_last))
            out.append(tuple(covs))
        return tuple(out)


@capabilities(dask="yes")
class ConvDiagonalFactor(DiagonalFactor):
    r"""TF K-FAC's ``ConvDiagonalFactor``: moving average of :func:`conv_diagonal_factor`.

    .. math::

        \text{new\_cov} = \frac{1}{n_{\text{towers}}} \sum_{s} \sum_{t}
            \frac{1}{N} \sum_n
            \big(\textstyle\sum_{\tau} \bar p_{n,\tau} g_{s,n,\tau}^\top\big)^{\odot 2} .

    Data for :meth:`update_cov`: ``inputs`` (array or towers) and ``outputs_grads`` (array or
    sources × towers).
    """

    def __init__(self, filter_shape, strides, padding, data_format="NHWC", dilations=None,
                 has_bias=False, patch_mask=None, **kwargs):
        super().__init__(**kwargs)
        func = type(self).__name__
        filter_shape = ConvGeometry.check_options(func, filter_shape, strides=strides,
                                                  padding=padding, dilation=dilations,
                                                  data_format=data_format,
                                                  dilation_name="dilations")
        _check_extract_options(func, filter_shape, None, patch_mask)
        self._set(filter_shape=filter_shape, strides=strides,
                  padding=padding, data_format=data_format, dilations=dilations,
                  has_bias=check_bool(func, "has_bias", has_bias), patch_mask=patch_mask)

    def _contributions(self, inputs, outputs_grads):
        func = f"{self.name}.update_cov"
        towers, st = input_towers_and_sources(func, inputs, outputs_grads)
        check_equal_batches(func, "inputs", towers)
        geos = []  # each input tower checked once, whatever the number of sources
        for x in towers:
            namespace_of(func, inputs=x, patch_mask=self.patch_mask)
            geos.append(_inputs_geometry(func, x, self.filter_shape, self.padding, self.strides,
                                         self.dilations, self.data_format,
                                         dilation_name="dilations"))
        out = []
        for src in st:
            diags = []
            for x, g, geo in zip(towers, src, geos, strict=True):
                xp = namespace_of(func, inputs=x, outputs_grads=g)
                check_array(func, "outputs_grads", g, ndim=x.ndim,
                            layout="[N, *out_spatial, C_out]")
                geo.check_output_grid(func, "outputs_grads", g.shape)
                geo.check_nonempty(func)
                diags.append(_conv_diagonal_factor(xp, x, g, geo, self.has_bias,
                                                   patch_mask=self.patch_mask))
            out.append(tuple(diags))
        return tuple(out)


@capabilities(dask="yes")
class ConvInputMultiKF(ConvInputKroneckerFactor):
    r"""TF master's ``ConvInputMultiKF``: a conv input factor for a layer used ``num_uses``
    times, with the uses folded into the batch axis (``[num_uses·N, ...]``).

    .. math::

        \text{new\_cov} = \frac{1}{T N |L|} \sum_{u,n,\ell} \bar p\, \bar p^\top ,

    i.e. the same statistic as :class:`ConvInputKroneckerFactor` on the folded batch (TF
    changes only its batch-size bookkeeping, :meth:`batch_size`).
    """

    def __init__(self, filter_shape, padding, num_uses, *args, **kwargs):
        super().__init__(filter_shape, padding, *args, **kwargs)
        self._set(num_uses=check_int(type(self).__name__, "num_uses", num_uses, minimum=1))

    def batch_size(self, inputs):
        """Examples per use: the folded batch divided by ``num_uses``."""
        return as_towers(f"{self.name}.batch_size", "inputs", inputs)[0].shape[0] // self.num_uses


@capabilities(dask="yes")
class ConvOutputMultiKF(ConvOutputKroneckerFactor):
    r"""TF master's ``ConvOutputMultiKF``: :class:`ConvOutputKroneckerFactor` for a layer
    used ``num_uses`` times (uses folded into the batch axis).

    .. math::

        \text{new\_cov} = \frac{1}{T N |L|} \sum_{u,n,\ell} g\, g^\top .
    """

    def __init__(self, num_uses, data_format="NHWC", **kwargs):
        super().__init__(data_format=data_format, **kwargs)
        self._set(num_uses=check_int(type(self).__name__, "num_uses", num_uses, minimum=1))

    def batch_size(self, outputs_grads):
        """Examples per use: the folded batch divided by ``num_uses``."""
        st = as_sources_towers(f"{self.name}.batch_size", "outputs_grads", outputs_grads)
        return st[0][0].shape[0] // self.num_uses
