"""Backend glue: array namespaces, devices, dtypes, host-side randomness and input validation.

This is the one module of :mod:`kfac_ref` that talks to ``array_api_compat`` and
``array_api_extra`` directly and the one place where NumPy is imported by library code
(for host-side random draws, see :func:`host_draw`).  Everything else receives the
namespace ``xp`` of its inputs from :func:`namespace_of` and calls only the array API
standard through it.

Error conventions
-----------------
Every public function validates its inputs before computing anything.  The messages
produced here all have the form::

    <function>: <argument> must be <expectation>; got <what was given>.

Shape and value problems raise :class:`ValueError`; wrong types and dtypes raise
:class:`TypeError`.  Both are subclasses of :class:`KFACInputError` as well, so callers
can catch "bad input to kfac_ref" in one clause.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import array_api_compat
import array_api_extra as xpx
import numpy as np  # host-side random draws only (see host_draw)

__all__ = [
    "KFACInputError",
    "KFACValueError",
    "KFACTypeError",
    "namespace_of",
    "describe",
    "is_array",
    "size_of",
    "device_of",
    "check_array",
    "check_square",
    "check_symmetric",
    "check_scalar",
    "check_option",
    "check_bool",
    "check_int",
    "check_rng",
    "result_float_dtype",
    "eye_like",
    "zeros_like_shape",
    "ones_like_shape",
    "asarray_like",
    "host_draw",
    "expand_dims_to",
    "xpx",
]


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------
class KFACInputError(Exception):
    """Base class of the errors raised for bad input to a kfac_ref function."""


class KFACValueError(KFACInputError, ValueError):
    """A shape, rank or value does not meet the function's contract."""


class KFACTypeError(KFACInputError, TypeError):
    """A type, dtype, namespace or device does not meet the function's contract."""


def _fail(func: str, name: str, expected: str, got: str, kind: type = KFACValueError):
    raise kind(f"{func}: {name} must be {expected}; got {got}.")


def describe(x: Any) -> str:
    """Short human description of ``x`` for error messages (type, dtype, shape)."""
    if is_array(x):
        shape = tuple(x.shape)
        return f"a {len(shape)}-D {x.dtype} array of shape {shape}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of length {len(x)}"
    return f"{x!r} ({type(x).__name__})"


def device_of(x: Any):
    """The device of an array (``array_api_compat.device``), for device-preserving code."""
    return array_api_compat.device(x)


def size_of(x: Any) -> int:
    """Number of elements of an array (``x.size`` is a method on PyTorch tensors)."""
    return math.prod(x.shape)


def is_array(x: Any) -> bool:
    """True for an array of an array-API-compatible library (not a Python/NumPy scalar)."""
    return array_api_compat.is_array_api_obj(x) and not isinstance(x, (numbers.Number, bool))



# --------------------------------------------------------------------------------------
# Namespaces and devices
# --------------------------------------------------------------------------------------
def _namespace_name(xp: Any) -> str:
    return getattr(xp, "__name__", repr(xp))


def namespace_of(func: str, **arrays: Any):
    """Return the array namespace shared by the named array arguments.

    ``None`` values and Python scalars are ignored.  Raises :class:`KFACTypeError` when an
    argument is not an array, when two arguments come from different namespaces (NumPy and
    PyTorch, say) or live on different devices.

    Parameters
    ----------
    func : str
        Name of the calling public function, used in error messages.
    **arrays
        The array arguments, by name.
    """
    found: list[tuple[str, Any, Any, Any]] = []
    for name, x in arrays.items():
        if x is None or isinstance(x, (numbers.Number, bool)):
            continue
        if not is_array(x):
            _fail(func, name, "an array of an array-API-compatible library", describe(x),
                  KFACTypeError)
        xp = array_api_compat.array_namespace(x)
        found.append((name, x, xp, array_api_compat.device(x)))
    if not found:
        raise KFACTypeError(f"{func}: expected at least one array argument; got none.")
    name0, _, xp0, dev0 = found[0]
    for name, _, xp, dev in found[1:]:
        if xp is not xp0:
            raise KFACTypeError(
                f"{func}: all arrays must come from one array namespace; {name0} is from "
                f"{_namespace_name(xp0)} but {name} is from {_namespace_name(xp)}."
            )
        if dev != dev0:
            raise KFACTypeError(
                f"{func}: all arrays must live on one device; {name0} is on {dev0!r} but "
                f"{name} is on {dev!r}."
            )
    return xp0


def result_float_dtype(xp, *arrays):
    """Floating dtype of a computation on ``arrays`` (array API type promotion)."""
    return xp.result_type(*[a for a in arrays if a is not None])


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------
def check_array(
    func: str,
    name: str,
    x: Any,
    *,
    ndim: int | Sequence[int] | None = None,
    shape: Sequence[int | None] | None = None,
    dtype: str | None = "real floating",
    finite: bool = True,
    min_ndim: int | None = None,
    layout: str | None = None,
):
    """Validate one array argument and return it unchanged.

    Parameters
    ----------
    func, name : str
        Calling function and argument name, for the message.
    ndim : int or sequence of int, optional
        Accepted ranks.
    shape : sequence of int or None, optional
        Expected shape; ``None`` entries accept any size.
    dtype : {"real floating", "integral", "bool", "numeric", None}
        Accepted dtype kind (``None`` accepts any dtype).
    finite : bool
        Require every entry to be finite (no NaN or Inf).  Only checked for floating dtypes.
    min_ndim : int, optional
        Minimum rank.
    layout : str, optional
        A layout description such as ``"[N, d]"`` used in the message.
    """
    if not is_array(x):
        _fail(func, name, "an array", describe(x), KFACTypeError)
    xp = array_api_compat.array_namespace(x)
    what = f" {layout}" if layout else ""
    if ndim is not None:
        ranks = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.ndim not in ranks:
            exp = " or ".join(f"{r}-D" for r in ranks)
            _fail(func, name, f"a {exp} array{what}", describe(x))
    if min_ndim is not None and x.ndim < min_ndim:
        _fail(func, name, f"an array of at least {min_ndim} dimensions{what}", describe(x))
    if shape is not None:
        ok = len(shape) == x.ndim and all(
            s is None or s == t for s, t in zip(shape, x.shape, strict=False)
        )
        if not ok:
            exp = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            _fail(func, name, f"an array of shape {exp}{what}", describe(x))
    if dtype is not None and not xp.isdtype(x.dtype, dtype):
        _fail(func, name, f"an array of {dtype} dtype", describe(x), KFACTypeError)
    if finite and xp.isdtype(x.dtype, "real floating") and size_of(x) != 0:
        if not bool(xp.all(xp.isfinite(x))):
            n_bad = int(xp.sum(xp.astype(~xp.isfinite(x), xp.int32)))
            _fail(func, name, "finite (no NaN or Inf)",
                  f"{n_bad} non-finite entries in {describe(x)}")
    return x


def check_square(func: str, name: str, x: Any, *, layout: str = "[n, n]"):
    """Validate a finite, real floating, square 2-D array."""
    check_array(func, name, x, ndim=2, layout=layout)
    if x.shape[0] != x.shape[1]:
        _fail(func, name, f"a square matrix {layout}", describe(x))
    return x


def check_symmetric(func: str, name: str, x: Any, *, rtol: float | None = None):
    """Validate a square matrix that is symmetric up to rounding.

    The test is ``max|M - Mᵀ| <= rtol * max(max|M|, tiny)`` with ``rtol`` defaulting to
    ``sqrt(eps)`` of the dtype: loose enough for matrices that are symmetric in exact
    arithmetic but were computed in floating point, tight enough to catch a transposed or
    non-symmetric argument.
    """
    check_square(func, name, x)
    xp = array_api_compat.array_namespace(x)
    if rtol is None:
        rtol = math.sqrt(float(xp.finfo(x.dtype).eps))
    if size_of(x) == 0:
        return x
    asym = float(xp.max(xp.abs(x - x.T)))
    scale = max(float(xp.max(xp.abs(x))), float(xp.finfo(x.dtype).smallest_normal))
    if asym > rtol * scale:
        _fail(func, name, "a symmetric matrix",
              f"max|M - Mᵀ| = {asym:.3g} for max|M| = {scale:.3g}")
    return x


def check_scalar(
    func: str,
    name: str,
    value: Any,
    *,
    nonnegative: bool = False,
    positive: bool = False,
    integer: bool = False,
    allow_none: bool = False,
):
    """Validate a real Python (or NumPy) scalar and return it as ``float`` (or ``int``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = "an integer" if integer else "a real number"
        _fail(func, name, kind, describe(value), KFACTypeError)
    if integer and not float(value).is_integer():
        _fail(func, name, "an integer", describe(value))
    v = int(value) if integer else float(value)
    if not math.isfinite(v):
        _fail(func, name, "finite", describe(value))
    if positive and not v > 0:
        _fail(func, name, "positive", describe(value))
    if nonnegative and not v >= 0:
        _fail(func, name, "non-negative", describe(value))
    return v


def check_bool(func: str, name: str, value: Any):
    """Validate a Python bool flag (``has_bias`` and friends)."""
    if not isinstance(value, bool):
        _fail(func, name, "a bool", describe(value), KFACTypeError)
    return value


def check_int(func: str, name: str, value: Any, *, minimum: int | None = None):
    """Validate an integer (not bool) scalar, optionally at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(func, name, "an integer", describe(value), KFACTypeError)
    if minimum is not None and value < minimum:
        _fail(func, name, f"an integer >= {minimum}", describe(value))
    return int(value)


def check_option(func: str, name: str, value: Any, allowed: Sequence[str]):
    """Validate a string option against the allowed spellings."""
    if not isinstance(value, str) or value not in allowed:
        _fail(func, name, "one of " + ", ".join(repr(a) for a in allowed), describe(value))
    return value


def check_rng(func: str, name: str, rng: Any):
    """Validate an explicit ``numpy.random.Generator``."""
    if not isinstance(rng, np.random.Generator):
        _fail(func, name, "a numpy.random.Generator (e.g. numpy.random.default_rng(0))",
              describe(rng), KFACTypeError)
    return rng


# --------------------------------------------------------------------------------------
# Device-preserving constructors
# --------------------------------------------------------------------------------------
def eye_like(x: Any, n: int, dtype=None):
    """``n × n`` identity in the namespace, device and (default) dtype of ``x``."""
    xp = array_api_compat.array_namespace(x)
    return xp.eye(n, dtype=x.dtype if dtype is None else dtype,
                  device=array_api_compat.device(x))


def zeros_like_shape(x: Any, shape: Sequence[int], dtype=None):
    """Zeros of ``shape`` in the namespace, device and (default) dtype of ``x``."""
    xp = array_api_compat.array_namespace(x)
    return xp.zeros(tuple(shape), dtype=x.dtype if dtype is None else dtype,
                    device=array_api_compat.device(x))


def ones_like_shape(x: Any, shape: Sequence[int], dtype=None):
    """Ones of ``shape`` in the namespace, device and (default) dtype of ``x``."""
    xp = array_api_compat.array_namespace(x)
    return xp.ones(tuple(shape), dtype=x.dtype if dtype is None else dtype,
                   device=array_api_compat.device(x))


def asarray_like(value: Any, x: Any, dtype=None):
    """Convert host data (Python scalars, lists, NumPy arrays) to the namespace and device
    of ``x``, in ``x``'s dtype unless ``dtype`` is given."""
    xp = array_api_compat.array_namespace(x)
    dtype = x.dtype if dtype is None else dtype
    dev = array_api_compat.device(x)
    return xp.asarray(value, dtype=dtype, device=dev)


def host_draw(rng: np.random.Generator, like: Any, draw, dtype=None):
    """Draw random numbers on the host and move them to the device of ``like``.

    ``draw`` is a callable ``draw(rng) -> numpy.ndarray``.  Draws are made in NumPy, in
    float64 (or int64), *then* converted, so every backend and dtype sees the same numbers
    for the same generator state (the float32 path sees them rounded once).  This is the
    only place randomness enters kfac_ref.
    """
    sample = np.asarray(draw(rng))
    return asarray_like(sample, like, dtype=dtype)


def expand_dims_to(xp, x, ndim: int):
    """Prepend singleton axes until ``x`` has ``ndim`` dimensions (for broadcasting)."""
    while x.ndim < ndim:
        x = xp.expand_dims(x, axis=0)
    return x
