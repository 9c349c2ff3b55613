r"""Convolution geometry, normalised once: :class:`ConvGeometry`.

A convolution of an input ``[N, n_1, ..., n_r, C_in]`` (channels last) or
``[N, C_in, n_1, ..., n_r]`` (channels first) with a kernel ``[k_1, ..., k_r, C_in, C_out]``
(TF's HWIO layout, generalised to ``r`` spatial dimensions) is described by its strides
:math:`s`, dilation :math:`d` and zero padding :math:`(p_{\text{lo}}, p_{\text{hi}})` per
spatial dimension.  Its output grid has, per spatial dimension,

.. math::

    o = \Big\lfloor \frac{n + p_{\text{lo}} + p_{\text{hi}} - (k - 1)\,d - 1}{s} \Big\rfloor + 1

locations, and :math:`|T| = \prod_i o_i` locations in all.  :class:`ConvGeometry` holds the
normalised form of these arguments — built once from the user's spelling by
:meth:`ConvGeometry.build` (or the public :meth:`ConvGeometry.from_shapes`) — and is what
:mod:`kfac_ref.patches`, :mod:`kfac_ref.factors` and :class:`kfac_ref.nn.Conv2D` compute
with.  Everything here is host-side integer arithmetic; no array is read.

Accepted spellings
------------------
* **data_format** one of :data:`DATA_FORMATS`, or ``None`` (channels last, any rank).
* **strides / dilation** one int, one int per spatial dimension, or TF's full-rank form
  (``[1, s_1, ..., s_r, 1]`` channels last, ``[1, 1, s_1, ..., s_r]`` channels first);
  ``None`` means 1.
* **padding** ``"VALID"``, ``"SAME"`` (any case; TF's split: the low side gets
  ``total // 2``), or explicit ``(lo, hi)`` pairs per spatial dimension (or per dimension of
  the input, TF's explicit form, with ``(0, 0)`` on the batch and channel axes).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import numpy as np  # host-side integer arguments only (np.ndarray shapes are accepted)

from ._backend import KFACTypeError, KFACValueError, check_array, describe
from ._support import capabilities

__all__ = [
    "DATA_FORMATS",
    "PADDING_MODES",
    "ConvGeometry",
    "PATCH_TEMPORARY_COPIES",
    "is_channels_last",
    "to_channels_last",
    "from_channels_last",
]

DATA_FORMATS = ("NWC", "NCW", "NHWC", "NCHW", "NDHWC", "NCDHW")
"""Accepted ``data_format`` strings (``None`` means channels last, any rank)."""

PADDING_MODES = ("SAME", "VALID", "EXPLICIT")
"""Values of :attr:`ConvGeometry.padding_mode`."""

PATCH_TEMPORARY_COPIES = 3
"""Patch-sized temporaries alive at once while one chunk's patches are formed and used (the
gathered patches, one reshape or bias-column copy, and the product or cotangent formed from
them): :meth:`ConvGeometry.temporary_entries_per_example` counts this many copies of an
example's patches, plus two of its padded input (the padding copy and the first gather)."""


# --------------------------------------------------------------------------------------
# Layout: the one data_format check and the one layout conversion
# --------------------------------------------------------------------------------------
@capabilities(array_free=True)
def is_channels_last(func, data_format, ndim=None, *, name="data_format", array_name=None):
    r"""Validate ``data_format`` (against an array rank ``ndim`` when given) and say whether
    it stores channels last.  ``array_name`` names the argument whose rank ``ndim`` is, for
    the message.

    Raises
    ------
    KFACValueError
        An unknown data format, or one of another rank than ``ndim``.
    """
    if data_format is None:
        return True
    if not isinstance(data_format, str) or data_format not in DATA_FORMATS:
        raise KFACValueError(
            f"{func}: {name} must be None or one of "
            f"{', '.join(repr(d) for d in DATA_FORMATS)}; got {describe(data_format)}."
        )
    if ndim is not None and len(data_format) != ndim:
        r = len(data_format)
        if array_name is None:
            raise KFACValueError(f"{func}: {name} {data_format!r} describes {r}-D arrays; "
                                 f"got a {ndim}-D array.")
        what, got = ((f"have {r} entries", f"{ndim} entries") if array_name.endswith("shape")
                     else (f"be a {r}-D array", f"a {ndim}-D array"))
        raise KFACValueError(f"{func}: {array_name} must {what} ({name} {data_format!r} "
                             f"describes {r}-D arrays); got {got}.")
    return data_format.endswith("C")


@capabilities(dask="yes")
def to_channels_last(xp, x, channels_last):
    r"""``[N, C, *spatial] -> [N, *spatial, C]`` unless ``x`` already stores channels last.

    .. math:: y_{n, \ell, c} = x_{n, c, \ell}

    A layout move of any dtype (entries are moved, not computed with): the checks are static.
    """
    check_array("to_channels_last", "x", x, min_ndim=3, dtype=None, finite=False)
    if channels_last:
        return x
    return xp.permute_dims(x, (0, *range(2, x.ndim), 1))


@capabilities(dask="yes")
def from_channels_last(xp, y, channels_last):
    r"""Inverse of :func:`to_channels_last`: ``[N, *spatial, C] -> [N, C, *spatial]`` for a
    channels-first layout.

    .. math:: x_{n, c, \ell} = y_{n, \ell, c}

    A layout move of any dtype (entries are moved, not computed with): the checks are static.
    """
    check_array("from_channels_last", "y", y, min_ndim=3, dtype=None, finite=False)
    if channels_last:
        return y
    return xp.permute_dims(y, (0, y.ndim - 1, *range(1, y.ndim - 1)))


# --------------------------------------------------------------------------------------
# Normalisers (host integers only)
# --------------------------------------------------------------------------------------
def _is_int(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _int_tuple(func, name, value, what):
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if (not isinstance(value, Sequence) or isinstance(value, str)
            or not all(_is_int(v) for v in value)):
        raise KFACTypeError(f"{func}: {name} must be {what}; got {describe(value)}.")
    return tuple(int(v) for v in value)


def _spatial_part(func, name, value, rank, channels_last, trivial, rule, entries="entries"):
    """The ``rank`` spatial entries of ``value``: as given, or taken from TF's full-rank
    form (``rank + 2`` entries, ``trivial`` on the batch and channel axes of the layout)."""
    if len(value) == rank + 2:
        outer = (value[0], value[-1]) if channels_last else (value[0], value[1])
        if any(v != trivial for v in outer):
            raise KFACValueError(f"{func}: {rule}; got {value}.")
        value = value[1:-1] if channels_last else value[2:]
    if len(value) != rank:
        raise KFACValueError(
            f"{func}: {name} must have {rank} (spatial) or {rank + 2} (full-rank) {entries}; "
            f"got {value}."
        )
    return value


def spatial_ints(func, name, value, rank, channels_last=True):
    r"""Strides, dilation or kernel sizes as a tuple of ``rank`` positive ints.

    .. math:: v \mapsto (v_1, \dots, v_r), \quad v_i \ge 1

    Accepts one int, ``rank`` ints or TF's full-rank form (``rank + 2`` ints, 1 on the batch
    and channel axes of the layout); ``None`` means 1.  Part of kfac_ref's internal API
    (used by :meth:`ConvGeometry.build`).
    """
    if value is None:
        return (1,) * rank
    if _is_int(value):
        value = (value,) * rank
    value = _int_tuple(func, name, value, "an int or a sequence of ints")
    value = _spatial_part(func, name, value, rank, channels_last, 1,
                          f"{name} in full-rank form must be 1 on the batch and channel axes")
    if any(v < 1 for v in value):
        raise KFACValueError(f"{func}: {name} must be positive integers; got {value}.")
    return value


_PADDING_EXPECTED = "'SAME', 'VALID' or a sequence of (low, high) int pairs"


def _padding(func, padding, rank, channels_last):
    """``(mode, pairs)``: the mode and, for explicit padding, the spatial (lo, hi) pairs."""
    if isinstance(padding, str):
        mode = padding.upper()
        if mode not in ("SAME", "VALID"):
            raise KFACValueError(f"{func}: padding must be {_PADDING_EXPECTED}; got "
                                 f"{padding!r}.")
        return mode, None
    if isinstance(padding, np.ndarray):
        padding = padding.tolist()
    if not isinstance(padding, Sequence):
        raise KFACValueError(f"{func}: padding must be {_PADDING_EXPECTED}; got "
                             f"{describe(padding)}.")
    pairs = []
    for p in padding:
        if isinstance(p, np.ndarray):
            p = p.tolist()
        if (not isinstance(p, Sequence) or isinstance(p, str) or len(p) != 2
                or not all(_is_int(v) for v in p)):
            raise KFACValueError(f"{func}: padding must be {_PADDING_EXPECTED}; got "
                                 f"{describe(padding)}.")
        pairs.append((int(p[0]), int(p[1])))
    pairs = _spatial_part(func, "padding", pairs, rank, channels_last, (0, 0),
                          "explicit padding of the batch and channel axes must be (0, 0)",
                          "(low, high) pairs")
    if any(v < 0 for q in pairs for v in q):
        raise KFACValueError(f"{func}: padding amounts must be non-negative; got {pairs}.")
    return "EXPLICIT", tuple(pairs)


def _filter_shape(func, filter_shape, rank=None, *, name="filter_shape"):
    if filter_shape is None:
        raise KFACTypeError(
            f"{func}: {name} must be a sequence of ints [k_1, ..., k_r, C_in, C_out]; got "
            f"{describe(filter_shape)}."
        )
    filter_shape = _int_tuple(func, name, filter_shape,
                              "a sequence of ints [k_1, ..., k_r, C_in, C_out]")
    if len(filter_shape) < 3 or (rank is not None and len(filter_shape) != rank + 2):
        want = f"{rank + 2}" if rank is not None else "at least 3"
        raise KFACValueError(
            f"{func}: {name} must have {want} entries [k_1, ..., k_r, C_in, C_out]; got "
            f"{filter_shape}."
        )
    if any(v < 1 for v in filter_shape):
        raise KFACValueError(f"{func}: {name} entries must be positive; got {filter_shape}.")
    return filter_shape


def _input_shape(func, name, shape):
    shape = _int_tuple(func, name, shape, "a sequence of ints")
    if any(v < 0 for v in shape):
        raise KFACValueError(f"{func}: {name} entries must be non-negative; got {shape}.")
    if len(shape) < 3:
        raise KFACValueError(f"{func}: {name} must have at least 3 entries [N, *spatial, C]; "
                             f"got {shape}.")
    return shape


# --------------------------------------------------------------------------------------
# The geometry
# --------------------------------------------------------------------------------------
@capabilities(dask="yes")
@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    r"""The normalised geometry of one convolution (frozen; host integers only).

    .. math::

        o_i = \Big\lfloor \frac{n_i + p_{\text{lo},i} + p_{\text{hi},i}
              - (k_i - 1)\,d_i - 1}{s_i} \Big\rfloor + 1,
        \qquad |T| = \prod_{i=1}^{r} o_i, \qquad |\Delta| = \prod_{i=1}^{r} k_i,

    with the padding amounts of each mode

    .. math::

        &\text{SAME}:\ o = \lceil n / s \rceil,\quad
        P = \max\big((o - 1) s + (k - 1) d + 1 - n,\ 0\big),

        &\phantom{\text{SAME}:\ } p_{\text{lo}} = \lfloor P / 2 \rfloor,\quad
        p_{\text{hi}} = P - p_{\text{lo}};

        &\text{VALID}:\ p_{\text{lo}} = p_{\text{hi}} = 0,\quad
        o = \Big\lceil \frac{n - (k - 1) d}{s} \Big\rceil \ (0 \text{ if } n < (k-1)d + 1).

    Build one with :meth:`from_shapes` (public) or :meth:`build` (inside kfac_ref, with the
    calling function's name for error messages); fields are already normalised and every
    argument check has run.

    Attributes
    ----------
    input_shape : tuple of int
        The full input shape, in the layout of ``data_format``.
    filter_shape : tuple of int
        ``(k_1, ..., k_r, C_in, C_out)``.
    strides, dilation : tuple of int
        One positive int per spatial dimension.
    padding : tuple of (int, int)
        The ``(p_lo, p_hi)`` zero padding of each spatial dimension.
    padding_mode : {"SAME", "VALID", "EXPLICIT"}
    data_format : str or None
        As given (``None``: channels last).
    channels_last : bool
    output_spatial_shape : tuple of int
        :math:`(o_1, \dots, o_r)`.
    """

    input_shape: tuple[int, ...]
    filter_shape: tuple[int, ...]
    strides: tuple[int, ...]
    dilation: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    padding_mode: str
    data_format: str | None
    channels_last: bool
    output_spatial_shape: tuple[int, ...]

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def from_shapes(cls, input_shape, filter_shape, strides=None, padding="VALID",
                    dilation=None, data_format=None):
        r"""The geometry of a convolution of an input of shape ``input_shape`` with a kernel
        of shape ``filter_shape``.

        .. math::

            (\text{input\_shape}, \text{filter\_shape}, s, p, d, \text{layout})
            \mapsto (s, d, p_{\text{lo}}, p_{\text{hi}}, o, |T|)

        Parameters
        ----------
        input_shape : sequence of int
            ``[N, *spatial, C_in]`` (channels last) or ``[N, C_in, *spatial]``.
        filter_shape : sequence of int
            ``[k_1, ..., k_r, C_in, C_out]``.
        strides, dilation : int, sequence of int or None
            Spatial or TF's full-rank form; ``None`` means 1.
        padding : {"SAME", "VALID"} or sequence of (int, int)
        data_format : str or None
            One of :data:`DATA_FORMATS`; ``None`` means channels last.

        Raises
        ------
        KFACValueError, KFACTypeError
            Unknown padding or data format, non-positive strides or dilation, a rank or
            channel mismatch between ``input_shape`` and ``filter_shape``.

        Examples
        --------
        >>> from kfac_ref.conv_geometry import ConvGeometry
        >>> g = ConvGeometry.from_shapes((2, 5, 5, 3), (3, 3, 3, 4), strides=2, padding="SAME")
        >>> g.output_spatial_shape, g.padding, g.num_locations
        ((3, 3), ((1, 1), (1, 1)), 9)
        """
        return cls.build("ConvGeometry.from_shapes", input_shape, filter_shape,
                         strides=strides, padding=padding, dilation=dilation,
                         data_format=data_format, dilation_name="dilation")

    @classmethod
    def build(cls, func, input_shape, filter_shape, *, strides=None, padding="VALID",
              dilation=None, data_format=None, strides_name="strides",
              dilation_name="dilation_rate", filter_name="filter_shape",
              input_name="input_shape", check_channels=True):
        r"""Validate and normalise convolution arguments (kfac_ref's internal constructor).

        .. math::

            o_i = \Big\lfloor \frac{n_i + p_{\text{lo},i} + p_{\text{hi},i}
                  - (k_i - 1)\,d_i - 1}{s_i} \Big\rfloor + 1

        ``func`` and the ``*_name`` arguments name the public function and the arguments the
        user passed, so that messages read "<func>: <argument> must be ...".
        ``check_channels=False`` skips the ``C_in`` agreement check (for callers that check
        channels against their own message).
        """
        input_shape = _input_shape(func, input_name, input_shape)
        channels_last = is_channels_last(func, data_format, len(input_shape),
                                         array_name=input_name)
        rank = len(input_shape) - 2
        filter_shape = _filter_shape(func, filter_shape, rank, name=filter_name)
        c_in = input_shape[-1] if channels_last else input_shape[1]
        if check_channels and c_in != filter_shape[-2]:
            raise KFACValueError(
                f"{func}: inputs and {filter_name} must agree on in_channels; inputs have "
                f"{c_in} channels (data_format {data_format or 'channels last'}) but "
                f"{filter_name} is {filter_shape}."
            )
        strides = spatial_ints(func, strides_name, strides, rank, channels_last)
        dilation = spatial_ints(func, dilation_name, dilation, rank, channels_last)
        mode, pairs = _padding(func, padding, rank, channels_last)
        spatial = input_shape[1:-1] if channels_last else input_shape[2:]
        outs, pads = [], []
        for i in range(rank):
            n, k, s, d = spatial[i], filter_shape[i], strides[i], dilation[i]
            eff = (k - 1) * d + 1  # extent of the dilated kernel
            if mode == "SAME":
                out = -(-n // s)
                total = max((out - 1) * s + eff - n, 0)
                lo, hi = total // 2, total - total // 2  # TF: low side gets total // 2
            elif mode == "VALID":
                out = -(-(n - eff + 1) // s) if n >= eff else 0
                lo, hi = 0, 0
            else:
                lo, hi = pairs[i]
                span = n + lo + hi - eff
                out = span // s + 1 if span >= 0 else 0
            outs.append(out)
            pads.append((lo, hi))
        return cls(input_shape=input_shape, filter_shape=filter_shape, strides=strides,
                   dilation=dilation, padding=tuple(pads), padding_mode=mode,
                   data_format=data_format, channels_last=channels_last,
                   output_spatial_shape=tuple(outs))

    @staticmethod
    def check_options(func, filter_shape, *, strides=None, padding="VALID", dilation=None,
                      data_format=None, strides_name="strides", dilation_name="dilation_rate",
                      filter_name="filter_shape"):
        r"""Validate convolution options without an input shape (for constructors that
        receive data later); returns the normalised ``filter_shape``.

        .. math:: r = \mathrm{len}(\text{filter\_shape}) - 2 \ \text{spatial dimensions}
        """
        filter_shape = _filter_shape(func, filter_shape, name=filter_name)
        rank = len(filter_shape) - 2
        channels_last = is_channels_last(func, data_format)
        if data_format is not None and len(data_format) != rank + 2:
            raise KFACValueError(
                f"{func}: data_format {data_format!r} describes {len(data_format) - 2}-D "
                f"convolutions; got a {filter_name} with {rank} spatial dimensions "
                f"{filter_shape}."
            )
        spatial_ints(func, strides_name, strides, rank, channels_last)
        spatial_ints(func, dilation_name, dilation, rank, channels_last)
        _padding(func, padding, rank, channels_last)
        return filter_shape

    # -- derived sizes ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """Number of spatial dimensions :math:`r`."""
        return len(self.filter_shape) - 2

    @property
    def kernel_shape(self) -> tuple[int, ...]:
        """Spatial kernel sizes :math:`(k_1, \\dots, k_r)`."""
        return self.filter_shape[:-2]

    @property
    def in_channels(self) -> int:
        """:math:`C_{in}`."""
        return self.filter_shape[-2]

    @property
    def out_channels(self) -> int:
        """:math:`C_{out}`."""
        return self.filter_shape[-1]

    @property
    def batch_size(self) -> int:
        """:math:`N` of :attr:`input_shape`."""
        return self.input_shape[0]

    @property
    def input_spatial_shape(self) -> tuple[int, ...]:
        """:math:`(n_1, \\dots, n_r)`."""
        return self.input_shape[1:-1] if self.channels_last else self.input_shape[2:]

    @property
    def padded_spatial_shape(self) -> tuple[int, ...]:
        """:math:`(n_i + p_{\\text{lo},i} + p_{\\text{hi},i})_i`."""
        return tuple(n + lo + hi for n, (lo, hi) in zip(self.input_spatial_shape,
                                                        self.padding, strict=True))

    @property
    def num_locations(self) -> int:
        """:math:`|T| = \\prod_i o_i`."""
        return math.prod(self.output_spatial_shape)

    @property
    def num_offsets(self) -> int:
        """:math:`|\\Delta| = \\prod_i k_i`."""
        return math.prod(self.kernel_shape)

    @property
    def patch_size(self) -> int:
        """Length of one patch, :math:`|\\Delta|\\,C_{in}`."""
        return self.num_offsets * self.in_channels

    def temporary_entries_per_example(self, extra_columns=0) -> int:
        r"""Entries one example adds to the temporaries of patch extraction and use, the
        count :func:`kfac_ref.patches.example_chunks` sizes chunks by.

        .. math::

            e = c\,|T|\,(|\Delta| C_{in} + b) + 2\, C_{in} \prod_i (n_i + p_{\text{lo},i}
                + p_{\text{hi},i}),

        with :math:`c` = :data:`PATCH_TEMPORARY_COPIES` and :math:`b` = ``extra_columns``
        (1 for the bias column).
        """
        padded = math.prod(self.padded_spatial_shape) * self.in_channels
        return (PATCH_TEMPORARY_COPIES * self.num_locations * (self.patch_size + extra_columns)
                + 2 * padded)

    def output_shape(self, batch_size=None) -> tuple[int, ...]:
        """Shape of the output ``[N, *out, C_out]`` (or ``[N, C_out, *out]``)."""
        n = self.batch_size if batch_size is None else batch_size
        if self.channels_last:
            return (n, *self.output_spatial_shape, self.out_channels)
        return (n, self.out_channels, *self.output_spatial_shape)

    # -- layout ----------------------------------------------------------------------------
    def to_channels_last(self, xp, x):
        """:func:`to_channels_last` in this geometry's layout."""
        return to_channels_last(xp, x, self.channels_last)

    def from_channels_last(self, xp, y):
        """:func:`from_channels_last` in this geometry's layout."""
        return from_channels_last(xp, y, self.channels_last)

    # -- checks ----------------------------------------------------------------------------
    def check_nonempty(self, func, name="inputs"):
        """Raise unless the convolution has at least one example and one output location."""
        if self.batch_size == 0 or self.num_locations == 0:
            raise KFACValueError(
                f"{func}: {name} must give at least one example and one output location; got "
                f"input shape {self.input_shape}, output grid {self.output_spatial_shape}."
            )

    def check_output_grid(self, func, name, shape, *, batch_size=None,
                          filter_name="filter_shape"):
        """Check that an output-shaped array (a cotangent, say) of shape ``shape`` has this
        convolution's rank, batch size, output grid and ``C_out`` — the one output-grid
        check of kfac_ref.  ``filter_name`` is the caller's name of the kernel argument
        (``kernel_shape`` for the kfac-jax blocks), used in the messages."""
        shape = tuple(shape)
        want = self.output_shape(self.batch_size if batch_size is None else batch_size)
        if shape == want:
            return
        lay = "[N, *out, C_out]" if self.channels_last else "[N, C_out, *out]"
        if len(shape) != len(want):
            raise KFACValueError(f"{func}: {name} must be a {len(want)}-D array {lay}; got shape "
                                 f"{shape}.")
        c_out = shape[-1] if self.channels_last else shape[1]
        if c_out != self.out_channels:
            raise KFACValueError(
                f"{func}: {name} and {filter_name} must agree on out_channels; {name} has "
                f"{c_out} but {filter_name} is {self.filter_shape}."
            )
        if shape[0] != want[0]:
            raise KFACValueError(f"{func}: inputs and {name} must have the same batch size; got "
                                 f"{want[0]} and {shape[0]}.")
        spatial = shape[1:-1] if self.channels_last else shape[2:]
        raise KFACValueError(
            f"{func}: {name} must have the convolution's output grid "
            f"{self.output_spatial_shape} ({self.num_locations} locations); got spatial shape "
            f"{spatial}."
        )
