"""Backend glue: array namespaces, devices, dtypes, host-side randomness and input validation.

This is the one module of :mod:`kfac_ref` that talks to ``array_api_compat`` directly.
Everything else receives the namespace ``xp`` of its inputs from :func:`namespace_of` and
calls only the array API standard through it.  NumPy is imported by library code only for
host-side work — random draws (:func:`host_draw`) and index arithmetic (patch indices,
permutations) — and each such import says so.  Where the standard lacks an operation that
every library has — triangular solves — the library's own kernel is called here
(:func:`lower_triangular_inverse`, :func:`cholesky_inverse`), with a standard fallback.

Validation policy
-----------------
A public function validates its arguments once, at its boundary, then calls unchecked
kernels; code inside kfac_ref calls kernels, never public functions (a public function
``f`` whose computation other modules reuse exposes it as ``f.kernel``, see
:func:`kernel_of`).  Two kinds of checks exist:

* **static checks** — type, rank, shape, dtype, namespace, device, options, Python scalars —
  read only metadata, cost nothing on any device and always run;
* **value checks** — every entry finite (:func:`all_finite`), symmetry, positive
  definiteness — read the data.  They run on eager arrays, are skipped for lazy arrays
  (JAX tracers inside ``jax.jit``/``jax.vmap``, Dask arrays, ``torch.func`` transforms; see
  :func:`is_lazy`) and can be switched off with :func:`value_checks`, as SciPy's
  ``check_finite=False`` does.  Each is one reduction and one device→host read.

Mixed floating precisions are rejected, never promoted: a reference library does not change
a user's precision behind their back (:func:`namespace_of`).

Precision policy: float32 and float64 only.  A real floating array of fewer than 32 bits
(float16, and bfloat16 where the library has it) is refused by :func:`check_array` — the
one dtype check every public function goes through — with a :class:`KFACTypeError` that
names the argument: LAPACK, which every eigendecomposition, Cholesky factor and solve of
kfac_ref calls, has no half precision, so such input would either fail deep inside a kernel
or come back silently promoted to float32.  Cast to float32 first.

Error conventions
-----------------
The messages produced here all have the form::

    <function>: <argument> must be <expectation>; got <what was given>.

Shape and value problems raise :class:`ValueError`; wrong types and dtypes raise
:class:`TypeError`.  Both are subclasses of :class:`KFACInputError` as well, so callers
can catch "bad input to kfac_ref" in one clause.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import array_api_compat
import numpy as np  # glue: host_draw, LinAlgError, NumPy fast paths (all_finite, reshape, ...)

from ._support import capabilities

__all__ = [
    "KFACInputError",
    "KFACValueError",
    "KFACTypeError",
    "namespace_of",
    "value_checks",
    "value_checks_enabled",
    "is_lazy",
    "checks_values",
    "all_finite",
    "any_true",
    "check_eager",
    "check_namespace_has",
    "optional_linalg",
    "kernel_of",
    "kernel_error",
    "errors_named",
    "describe",
    "is_array",
    "size_of",
    "one_like",
    "reshape",
    "device_of",
    "check_array",
    "check_square",
    "check_symmetric",
    "check_scalar",
    "check_scalars_with",
    "check_index_range",
    "check_option",
    "check_bool",
    "check_int",
    "check_shape",
    "check_rng",
    "eye_like",
    "zeros_like_shape",
    "ones_like_shape",
    "asarray_like",
    "host_draw",
    "lower_triangular_inverse",
    "cholesky_inverse",
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


def kernel_error(message: str) -> KFACValueError:
    """The error an unchecked kernel raises: its message says what failed, not who was
    called (kernels take no function name); :func:`errors_named` at the public boundary
    puts the name of the function the user called in front."""
    exc = KFACValueError(message)
    exc.unnamed = True
    return exc


class errors_named:  # noqa: N801 (used as a function: ``with errors_named(func):``)
    """Reword a kernel's :func:`kernel_error` as ``"<func>: <message>"``, ``func`` the public
    function or method the user called (other errors pass unchanged).

    With ``inner=True`` the errors of the public objects ``func`` calls on the user's
    behalf (an optimiser's estimator, say) are put under ``func`` too, the inner name kept:
    ``"KFACOptimizer.step: BlockDiagonalCurvature.update_cache: ..."`` — the user called
    ``func``, not the inner method.  ``arguments`` maps the inner call's argument names to
    the user's (``{"parameter_structured_vector": "grad"}``), so the message names what the
    user passed.  Errors already under ``func`` pass unchanged.  ``context`` (with
    ``inner``) says which part of ``func``'s work failed, after its name:
    ``"BlockDiagonalCurvature.update_cache: block 1 (layer 'd2'): ..."``; an error already
    under ``func`` gets the context too.

    A class rather than a generator context manager: it wraps every public call, and its
    enter and exit cost a tenth of a generator's."""

    __slots__ = ("func", "inner", "arguments", "context")

    def __init__(self, func: str, *, inner: bool = False,
                 arguments: dict[str, str] | None = None, context: str | None = None):
        self.func, self.inner, self.arguments, self.context = func, inner, arguments, context

    def __enter__(self):
        return None

    def __exit__(self, kind, exc, tb):
        if kind is None or not issubclass(kind, (KFACValueError, KFACTypeError)):
            return False
        func = self.func
        unnamed = getattr(exc, "unnamed", False)
        message = str(exc)
        if not unnamed and message.startswith(f"{func}:"):
            if not (self.inner and self.context) or message.startswith(
                    f"{func}: {self.context}:"):
                return False
            message = message[len(func) + 2:]  # under func already: the context goes after
        elif not (unnamed or self.inner):
            return False
        for theirs, ours in (self.arguments or {}).items():
            # whole names only (not inside another name or after a dot)
            message = re.sub(rf"(?<![\w.]){re.escape(theirs)}(?![\w])", ours, message)
        where = f"{self.context}: " if self.context else ""
        raise type(exc)(f"{func}: {where}{message}") from None


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
    if type(x) is np.ndarray:  # the common case, without array_api_compat's probes
        return "cpu"
    return array_api_compat.device(x)


def reshape(xp: Any, x: Any, shape: tuple) -> Any:
    """``xp.reshape(x, shape)``.  A NumPy array's own method skips NumPy's function dispatch
    (0.2 µs against 0.9 µs): a Kronecker block's product reshapes twice."""
    if type(x) is np.ndarray:
        return x.reshape(shape)
    return xp.reshape(x, shape)


def one_like(xp: Any, x: Any) -> Any:
    """A 1 in the namespace, device and dtype of the array ``x``, to fill a ``where``.  For
    NumPy a scalar of ``x``'s dtype (0.2 µs against 2.5 µs for ``ones_like`` through
    ``array_api_compat``; π and the scale-safe norms take one a factor); a Python ``1.0``
    would make a float32 ``where`` float64 on NumPy < 2."""
    if type(x) is np.ndarray or isinstance(x, np.generic):
        return x.dtype.type(1)
    return xp.ones_like(x)


def size_of(x: Any) -> int:
    """Number of elements of an array (``x.size`` is a method on PyTorch tensors)."""
    return math.prod(x.shape)


def is_array(x: Any) -> bool:
    """True for an array of an array-API-compatible library (not a Python/NumPy scalar)."""
    if type(x) in (float, int, bool):  # Python numbers, without array_api_compat's probes
        return False
    return array_api_compat.is_array_api_obj(x) and not isinstance(x, (numbers.Number, bool))


# array_api_compat.array_namespace probes a dozen libraries per call (~1 µs, a tenth of a
# small block's product); its answer depends only on the array's type and, for JAX's
# float0 arrays, its dtype, so it is looked up once per (type, dtype).
_NAMESPACES: dict[tuple[type, Any], Any] = {}
_FLOATING: dict[tuple[Any, Any], bool] = {}
_HALF: dict[tuple[Any, Any], bool] = {}


def array_namespace(x: Any):
    """``array_api_compat.array_namespace(x)`` for one array, remembered per (type, dtype)."""
    try:
        return _NAMESPACES[type(x), x.dtype]
    except (KeyError, AttributeError, TypeError):  # new pair, no dtype, unhashable dtype
        pass
    xp = array_api_compat.array_namespace(x)
    if is_array(x):  # never remember a scalar type (NumPy scalars have a dtype)
        try:
            _NAMESPACES[type(x), x.dtype] = xp
        except TypeError:
            pass
    return xp


def _known_array_namespace(x: Any):
    """The namespace of ``x`` when an array of its type and dtype was seen before, else
    None (then :func:`is_array` decides)."""
    try:
        return _NAMESPACES.get((type(x), x.dtype))
    except (AttributeError, TypeError):
        return None


def is_half(xp: Any, dtype: Any) -> bool:
    """Whether a real floating ``dtype`` has fewer than 32 bits (float16, bfloat16): refused
    by :func:`check_array` (the precision policy in this module's docstring)."""
    try:
        return _HALF[xp, dtype]
    except KeyError:
        out = _HALF[xp, dtype] = int(xp.finfo(dtype).bits) < 32
        return out
    except TypeError:  # unhashable dtype
        return int(xp.finfo(dtype).bits) < 32


def is_floating(xp: Any, dtype: Any) -> bool:
    """``xp.isdtype(dtype, "real floating")``, remembered per (namespace, dtype)."""
    try:
        return _FLOATING[xp, dtype]
    except KeyError:
        out = _FLOATING[xp, dtype] = bool(xp.isdtype(dtype, "real floating"))
        return out
    except TypeError:  # unhashable dtype
        return bool(xp.isdtype(dtype, "real floating"))



# --------------------------------------------------------------------------------------
# Value checks: the switch, lazy arrays, the one finiteness scan
# --------------------------------------------------------------------------------------
_VALUE_CHECKS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kfac_ref_value_checks", default=True)


@capabilities(array_free=True)
@contextlib.contextmanager
def value_checks(enabled: bool = True) -> Iterator[None]:
    r"""Switch kfac_ref's value checks on or off inside a ``with`` block.

    Value checks read the data of an argument — every entry finite, a matrix symmetric, a
    damped matrix positive definite before a negative power — and cost one reduction each
    and a device→host read.  Where a call has several, they are read back together: the
    parameters and input of a network call in one read, the statistics an estimator update
    stores in one, all the checks of a cache refresh in one; when that read fails, the
    checks run again one by one and the error names the argument (on NumPy, where a read
    is free, each is read at once).  Static checks (type, rank, shape, dtype, namespace, device,
    options, scalars) are not affected and always run.  The setting is per thread and per
    ``contextvars`` context, and nests.

    Parameters
    ----------
    enabled : bool
        ``False`` skips value checks inside the block (as SciPy's ``check_finite=False``);
        bad values then give NaN/Inf results instead of errors, on the eigendecomposition,
        SVD and Cholesky paths alike (never the linear-algebra library's own error), and
        samples drawn from NaN parameters are marked (class −1 or NaN), as for traced and
        lazy arrays (see :ref:`backends`).

    Examples
    --------
    >>> import numpy as np
    >>> import kfac_ref
    >>> x = np.array([[np.nan, 1.0]])
    >>> with kfac_ref.value_checks(False):
    ...     kfac_ref.compute_cov(x).shape
    (2, 2)
    """
    if not isinstance(enabled, bool):
        _fail("value_checks", "enabled", "a bool", describe(enabled), KFACTypeError)
    token = _VALUE_CHECKS.set(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def value_checks_enabled() -> bool:
    """Whether value checks are on in the current context (see :func:`value_checks`)."""
    return _VALUE_CHECKS.get()


_DEFERRED = contextvars.ContextVar("kfac_ref_deferred_value_checks", default=None)


@contextlib.contextmanager
def deferred_value_checks(xp):
    r"""Run the value checks called inside on the device and read them back once, at the
    end (a block's ``update_cache``, the argument checks of a network call, the statistics
    of an update).

    .. math:: \text{ok} = \textstyle\bigwedge_k \text{flag}_k
        \;\wedge\; \operatorname{isfinite}\big(\textstyle\sum_j s_j\big)
        \quad \text{(one read)}

    Each check inside (a Cholesky pivot, the spectrum of a negative or fractional power)
    leaves a 0-D boolean flag instead of reading it, and each finiteness scan of
    :func:`all_finite` its sum :math:`s_j`; at the exit one ``all`` of the stacked flags and
    of the total's finiteness is read into the yielded ``status["ok"]``.  The caller discards
    what it computed when it is false and computes again outside this context, where the
    failing check raises the error (and takes the fall-back) it always did; so the numbers
    and errors are the eager ones, and a success costs one read.  Nested uses collect into
    the outermost: their own status stays true, and ``status["nested"]`` tells the caller
    that an error raised inside is the outermost caller's to handle (it computes everything
    again, so the first failing check raises first).  NumPy arrays are on the host, where a
    read costs nothing: their checks read at once, a failing one raises its own error inside
    (or takes its fall-back), and ``status["at_once"]`` tells the caller that this error is
    the one to raise, with nothing to compute again.  :func:`read_checks_once` is the
    caller's side.
    """
    status = {"ok": True, "at_once": False, "nested": False, "pending": False}
    if _DEFERRED.get() is not None:
        status["nested"] = True
        yield status
        return
    if array_api_compat.is_numpy_namespace(xp):
        status["at_once"] = True
        yield status
        return
    pending = {"flags": [], "sums": []}
    token = _DEFERRED.set(pending)
    try:
        # warnings of arithmetic on failing numbers are held back; shown only on success
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield status
    finally:
        _DEFERRED.reset(token)
        # whether checks were left unread (also for an error raised inside: read_checks_once)
        status["pending"] = bool(pending["flags"] or pending["sums"])
    if status["pending"]:
        status["ok"] = _read_pending(xp, pending)
    if status["ok"]:
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _read_pending(xp, pending):
    """The one read of :func:`deferred_value_checks`: every pending flag true and the total
    of the pending finiteness sums (:func:`all_finite`) finite.  A total of finite sums
    can overflow: then the caller computes again with each check read at once, which
    passes."""
    flags = [xp.reshape(f, ()) for f in pending["flags"]]
    sums = pending["sums"]
    if sums:
        total = sums[0] if len(sums) == 1 else (
            sums[0] + sums[1] if len(sums) == 2 else xp.sum(xp.stack(sums)))
        if not flags:  # the sums alone: the finiteness test on the host, no kernel
            return math.isfinite(host_float(total))
        flags.append(xp.isfinite(total))
    return bool(flags[0] if len(flags) == 1 else xp.all(xp.stack(flags)))


def read_checks_once(xp, compute, func):
    """``compute()`` with its value checks read back once (:func:`deferred_value_checks`);
    when one fails, ``compute()`` again with each check read at once, where the failing
    check raises its own error (or takes its fall-back), in the name of ``func``
    (:func:`errors_named`): the numbers and errors of an eager run at the cost of one read.
    A value error raised inside is re-raised in that name when it is already the eager
    one (NumPy), and as it is when it is an enclosing call's to handle (nested).  Any other
    error raised while checks are pending (a library's own error on the numbers of a check
    that failed unread: a singular factor's inverse) runs ``compute()`` again with each
    check read at once, which raises the check's error first, or the same error again.  A
    type error passes unchanged when no value check is pending (it comes before any of
    them in an eager run too); one raised after pending checks (a later argument's dtype)
    runs ``compute()`` again, where a failing earlier check raises first, as it does
    eagerly."""
    status = None
    try:
        with deferred_value_checks(xp) as status:
            out = compute()
    except Exception as exc:
        if status is None or status["nested"]:
            raise
        if status["at_once"]:
            if isinstance(exc, KFACValueError):
                with errors_named(func):
                    raise
            raise
        if isinstance(exc, KFACTypeError) and not status["pending"]:
            raise
        with errors_named(func):
            return compute()
    if status["ok"]:
        return out
    with errors_named(func):
        return compute()


def value_check(flag, fail):
    """``fail()`` (which raises) unless the 0-D boolean ``flag``: read now, or at the end
    of :func:`deferred_value_checks`."""
    pending = _DEFERRED.get()
    if pending is None:
        if not bool(flag):
            fail()
    else:
        pending["flags"].append(flag)


def rare_branch(xp, flag) -> bool:
    """Whether to take a rare branch that the host decides (the 0-D boolean ``flag``): read
    now, or, inside :func:`deferred_value_checks`, taken as false without a read, with
    ``not flag`` joining the one read of the checks.  When the flag was true, that read
    fails and the caller computes again with every read at once, which takes the branch:
    the results of an eager run, without a read of its own on the common path."""
    pending = _DEFERRED.get()
    if pending is None:
        return bool(_detached(flag))
    pending["flags"].append(xp.logical_not(flag))
    return False


def is_lazy(x: Any) -> bool:
    """True for an array whose values cannot be read now without tracing errors or forcing
    a computation: a JAX tracer (inside ``jax.jit``, ``jax.vmap``, ``jax.grad``), a Dask
    array, a tensor inside a ``torch.func`` transform (``vmap``, ``grad``), or an array of
    an unknown namespace that ``array_api_compat.is_lazy_array`` calls lazy.

    Eager JAX arrays are not lazy here (``array_api_compat.is_lazy_array`` says they may
    be): outside a transformation their values are concrete, and they are checked.
    """
    if isinstance(x, (np.ndarray, np.generic)):  # the common case, without the probes below
        return False
    if array_api_compat.is_jax_array(x):
        jax = sys.modules.get("jax")
        return jax is not None and isinstance(x, jax.core.Tracer)
    if array_api_compat.is_torch_array(x):
        functorch = getattr(getattr(sys.modules.get("torch"), "_C", None), "_functorch", None)
        return functorch is not None and bool(functorch.is_functorch_wrapped_tensor(x))
    if array_api_compat.is_dask_array(x):
        return True
    if (array_api_compat.is_numpy_array(x) or array_api_compat.is_cupy_array(x)
            or array_api_compat.is_array_api_strict_namespace(array_namespace(x))):
        return False
    return bool(array_api_compat.is_lazy_array(x))


def checks_values(*arrays: Any) -> bool:
    """Whether value checks run for these arrays: switched on and none of them lazy."""
    if not _VALUE_CHECKS.get():
        return False
    for a in arrays:  # a loop, not any(genexpr): every checked argument passes here
        if a is not None and is_lazy(a):
            return False
    return True


def all_finite(xp, x) -> bool:
    r"""The one finiteness scan of kfac_ref: ``all(isfinite(x))`` read back to the host.

    Every NaN/Inf check of an argument goes through here (tests count the scans of a
    call by wrapping it), and only :func:`check_array` calls it.  Inside a trace
    (``jax.jit``) even a concrete array's reduction is staged out; its answer cannot be
    read, and the check passes as it does for a lazy argument.

    On PyTorch, CuPy and JAX the scan is one sum: a NaN or Inf entry makes :math:`\sum_i
    x_i` non-finite, so a finite sum proves every entry finite, and only a non-finite sum (a
    non-finite entry, or an overflow of finite ones) is re-checked entry-wise.  The sum is
    read back and tested on the host (one kernel launch, not the four of a 0-D ``isfinite``
    on PyTorch); inside :func:`deferred_value_checks` it is not read but added to the
    others, and their total is read once at the end (the scans of a call's arguments, the
    statistics of an update).  The sum needs no boolean temporary (PyTorch on CPU: 12 µs
    against 210 µs for ``all(isfinite)`` of 2·10⁵ floats).  A contiguous native-endian
    float32/float64 NumPy array is scanned by one BLAS dot product :math:`x^\top x`
    (``numpy.vdot``, which raises no floating-point warning): its terms are non-negative, so
    no Inf − Inf can cancel, a NaN propagates, and again only a non-finite result is
    re-checked entry-wise (on 2·10⁴ to 2·10⁶ floats, 1.3–3× faster than NumPy's fused
    ``isfinite``, which NumPy-backed arrays of other dtypes and layouts keep; NumPy's
    pairwise sum is slower than both).
    """
    if type(x) is np.ndarray:
        if x.dtype.char in "fd" and x.dtype.isnative and x.flags.forc and math.isfinite(
                np.vdot(flat := x if x.ndim == 1 else x.ravel(order="K"), flat)):
            return True
    else:
        pending = _DEFERRED.get()
        if _sum_scan(xp):
            total = xp.sum(x)
            if is_lazy(total):  # staged out by a trace: cannot be read
                return True
            if pending is not None:  # read with the others at the end (one read)
                pending["sums"].append(total)
                return True
            if math.isfinite(host_float(total)):  # tested on the host: one kernel
                return True
        elif pending is not None:
            flag = xp.all(xp.isfinite(x))
            if not is_lazy(flag):
                pending["flags"].append(flag)
            return True
    # all(isfinite) is one pass fewer than any(~isfinite); an unreadable flag passes
    return _read_flag(xp.all(xp.isfinite(x)), when_lazy=True)


_SUM_SCAN: dict[Any, bool] = {}


def _sum_scan(xp) -> bool:
    try:
        return _SUM_SCAN[xp]
    except KeyError:
        out = _SUM_SCAN[xp] = (array_api_compat.is_torch_namespace(xp)
                               or array_api_compat.is_cupy_namespace(xp)
                               or array_api_compat.is_jax_namespace(xp))
        return out


def any_true(xp, condition) -> bool:
    """Whether some entry of a boolean array from a value check is true, read back to the
    host.

    Returns ``False`` when the answer cannot be read now — the reduction is lazy, as it is
    inside ``jax.jit`` even for a concrete array the traced function closes over — so a
    value check that cannot run passes, like one on a lazy argument (see :func:`is_lazy`).
    """
    return _read_flag(xp.any(condition), when_lazy=False)


def check_index_range(func: str, name: str, x: Any, size: int, size_name: str) -> None:
    """Refuse integer ids of ``x`` outside ``[0, size)`` (``size`` called ``size_name``),
    naming ``name`` and the range found: a value check, skipped for lazy ids and under
    ``value_checks(False)``; inside ``jax.jit`` even ids the traced function closes over
    cannot be read, and the check passes (:func:`any_true`)."""
    if not math.prod(x.shape) or not checks_values(x):
        return
    xp = array_namespace(x)
    if any_true(xp, (x < 0) | (x >= size)):
        raise KFACValueError(f"{func}: {name} must lie in [0, {size_name}) = [0, {size}); got "
                             f"ids in [{int(xp.min(x))}, {int(xp.max(x))}].")


def _read_flag(flag, when_lazy):
    """The one device→host read of a value check; ``when_lazy`` when it cannot be read."""
    return when_lazy if is_lazy(flag) else bool(_detached(flag))


def _detached(x: Any) -> Any:
    """``x`` without its autograd history when it is a torch tensor (a host read of a tensor
    that requires grad warns in torch), else ``x`` itself."""
    detach = getattr(x, "detach", None)
    return detach() if detach is not None and array_api_compat.is_torch_array(x) else x


def host_float(x: Any) -> float:
    """A 0-D array (or number) read back to the host as a Python float: the host read of
    the value checks, from a detached view of a torch tensor, so that an argument that
    requires grad reads without torch's "Converting a tensor with requires_grad=True to a
    scalar" warning."""
    return float(_detached(x))


def check_eager(func: str, why: str, **arrays: Any) -> None:
    """Reject lazy arrays (JAX tracers inside ``jax.jit``, Dask arrays, ``torch.func``
    transforms; see :func:`is_lazy`) for a function that must read values on the host.

    Raises :class:`KFACTypeError` "``<func>: cannot run under jax.jit or on lazy arrays
    (<why>); <name> must be an eager array; got ...``" for the first lazy argument.
    """
    for name, x in arrays.items():
        if x is not None and is_array(x) and is_lazy(x):
            raise KFACTypeError(
                f"{func}: cannot run under jax.jit or on lazy arrays ({why}); {name} must be "
                f"an eager array; got {describe(x)} (lazy).")


_MISSING: dict[tuple[Any, str], bool] = {}


def check_namespace_has(func: str, name: str, x: Any, needs: str, why: str) -> None:
    """Reject, before any computation, an array whose namespace lacks a function the
    computation needs: an optional extension of the array API standard that a library may
    leave out (``linalg.eigh``, ``linalg.eigvalsh``, ``linalg.slogdet``).

    Raises :class:`KFACTypeError` "``<func>: <name> must be an array whose namespace has
    <needs> (<why>); got ... of <namespace>, which has no <needs>.``" — without the check
    the call would fail part-way with the namespace's own ``AttributeError``.
    """
    xp = array_namespace(x)
    try:
        missing = _MISSING[xp, needs]
    except KeyError:
        obj = xp
        for part in needs.split("."):
            obj = getattr(obj, part, None)
        missing = _MISSING[xp, needs] = obj is None
    if missing:
        _fail(func, name, f"an array whose namespace has {needs} ({why})",
              f"{describe(x)} of {_namespace_name(xp)}, which has no {needs}", KFACTypeError)


def optional_linalg(xp: Any, name: str) -> Callable:
    """``xp.linalg.<name>`` of a function that a namespace may lack (an optional extension
    of the standard: ``eigh``, ``eigvalsh``, ``slogdet``), for a kernel.

    Public functions reject such a namespace at their boundary
    (:func:`check_namespace_has`); this is the guard of the paths that reach a kernel
    without that check: a :class:`KFACTypeError` that says what is missing, worded like a
    :func:`kernel_error` (the public boundary's :func:`errors_named` puts the function's name
    in front), never the namespace's ``AttributeError``."""
    fn = getattr(getattr(xp, "linalg", None), name, None)
    if fn is None:
        exc = KFACTypeError(
            f"the array namespace {_namespace_name(xp)} has no linalg.{name}, which this "
            f"computation needs; pass arrays of a library that has it (NumPy, PyTorch, JAX, "
            f"CuPy).")
        exc.unnamed = True
        raise exc
    if name not in _DECOMPOSITIONS:
        return fn
    return lambda matrix: _decomposition(xp, name, fn, matrix)


def is_linalg_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an array library's linear-algebra failure (NumPy's and CuPy's
    ``LinAlgError``, PyTorch's ``torch.linalg.LinAlgError``), recognised by class name so
    that no backend is imported."""
    return any("LinAlgError" in c.__name__ for c in type(exc).__mro__)


#: the decompositions whose outputs follow the bad-values policy of :func:`_decomposition`
_DECOMPOSITIONS = ("eigh", "eigvalsh", "svd")


def _decomposition(xp: Any, name: str, fn: Callable, matrix: Any):
    """``xp.linalg.<name>(matrix)`` under kfac_ref's policy for bad values: a matrix with a
    NaN or Inf entry gives NaN outputs on every backend.  Libraries differ here: LAPACK
    (NumPy, array-api-strict) raises ``LinAlgError``, PyTorch and JAX can return finite
    eigenvalues of a NaN matrix.  The test is on the device (no host read; also under a
    trace and with value checks off); with value checks on, a non-finite matrix (one not
    scanned at a door: a stored statistic) is a :func:`kernel_error`, read at once or with
    the other checks of :func:`deferred_value_checks`.  A ``LinAlgError`` of a finite matrix
    (no convergence) gives NaN outputs."""
    try:
        out = fn(matrix)
    except Exception as exc:  # noqa: BLE001 - only the libraries' LinAlgError is handled
        if not is_linalg_error(exc):
            raise
        out = None
    finite = xp.all(xp.isfinite(matrix), axis=(-2, -1))
    if checks_values(matrix):
        def nonfinite():
            raise kernel_error(f"the matrix of linalg.{name} must be finite (no NaN or Inf); "
                               f"got non-finite entries in {describe(matrix)}.")

        value_check(xp.all(finite), nonfinite)
    if out is None:
        return _nan_outputs(xp, name, matrix)
    if name == "eigvalsh":
        return xp.where(finite[..., None], out, xp.nan)
    return tuple(xp.where(xp.reshape(finite, finite.shape + (1,) * (part.ndim - finite.ndim)),
                          part, xp.nan) for part in out)


def _nan_outputs(xp: Any, name: str, matrix: Any):
    """NaN arrays shaped as ``xp.linalg.<name>(matrix)``'s outputs (``svd`` with full
    matrices, the standard's default)."""
    *batch, m, n = matrix.shape

    def nan(*shape):
        return xp.full((*batch, *shape), xp.nan, dtype=matrix.dtype, device=device_of(matrix))

    if name == "eigvalsh":
        return nan(n)
    if name == "eigh":
        return nan(n), nan(n, n)
    return nan(m, m), nan(min(m, n)), nan(n, n)


def kernel_of(public: Callable) -> Callable[[Callable], Callable]:
    """Register the decorated function as the unchecked kernel of ``public``.

    The kernel does the computation of ``public`` without validating; code inside kfac_ref
    that has already validated its inputs calls ``public.kernel(...)`` instead of
    ``public(...)``, so each argument is checked once, by the function the user called.
    The kernel's signature is its own (it usually takes the namespace ``xp`` first and
    already-normalised options).
    """

    def register(kernel: Callable) -> Callable:
        public.kernel = kernel
        return kernel

    return register


# --------------------------------------------------------------------------------------
# Namespaces, devices and precision
# --------------------------------------------------------------------------------------
def _namespace_name(xp: Any) -> str:
    return getattr(xp, "__name__", repr(xp))


def namespace_of(func: str, **arrays: Any):
    """Return the array namespace shared by the named array arguments.

    ``None`` values and Python scalars are ignored.  Raises :class:`KFACTypeError` when an
    argument is not an array, when two arguments come from different namespaces (NumPy and
    PyTorch, say), live on different devices, or are floating arrays of different
    precisions (float32 next to float64): kfac_ref never promotes one precision to another
    behind the caller's back.  Integer and boolean arrays (ids, labels, masks) may sit next
    to floating arrays of any precision, and so may weakly typed arrays (JAX's Python
    numbers traced into a jitted function), which take the other operand's precision.

    An array whose device is unknown (``array_api_compat.device`` returns ``None``: a JAX
    tracer inside ``jax.jit``, whose placement is decided when the computation is compiled)
    is compatible with every device; the arrays whose devices are known must agree.  So a
    jitted function may combine its traced arguments with concrete arrays it closes over.

    Parameters
    ----------
    func : str
        Name of the calling public function, used in error messages.
    **arrays
        The array arguments, by name.
    """
    found: list[tuple[str, Any, Any, Any]] = []
    for name, x in arrays.items():
        if x is None:
            continue
        xp = _known_array_namespace(x)  # a known array type skips the scalar probes
        if xp is None:
            if isinstance(x, (numbers.Number, bool)):
                continue
            if not is_array(x):
                _fail(func, name, "an array of an array-API-compatible library", describe(x),
                      KFACTypeError)
            xp = array_namespace(x)
        found.append((name, x, xp, device_of(x)))
    if not found:
        if arrays:  # name the argument the caller got wrong, not "no arrays"
            name, value = next(iter(arrays.items()))
            _fail(func, name, "an array", describe(value), KFACTypeError)
        raise KFACTypeError(f"{func}: expected at least one array argument; got none.")
    name0, x0, xp0, dev0 = found[0]
    for _, x, xp, dev in found[1:]:
        if xp is not xp0 or dev != dev0 or x.dtype != x0.dtype:
            break
    else:  # the common case: one namespace, device and dtype
        return xp0
    known = [(name, dev) for name, _, _, dev in found if dev is not None]
    for name, _, xp, _ in found[1:]:
        if xp is not xp0:
            raise KFACTypeError(
                f"{func}: all arrays must come from one array namespace; {name0} is from "
                f"{_namespace_name(xp0)} but {name} is from {_namespace_name(xp)}."
            )
    for name, dev in known[1:]:
        if dev != known[0][1]:
            raise KFACTypeError(
                f"{func}: all arrays must live on one device; {known[0][0]} is on "
                f"{known[0][1]!r} but {name} is on {dev!r}."
            )
    # a weakly typed array (JAX's, for a Python number traced into a jitted function) takes
    # the other operand's precision, as a Python number does
    floats = [(name, x.dtype) for name, x, _, _ in found
              if is_floating(xp0, x.dtype) and not getattr(x, "weak_type", False)]
    for name, dtype in floats[1:]:
        if dtype != floats[0][1]:
            raise KFACTypeError(
                f"{func}: {name} must have the floating dtype of {floats[0][0]} "
                f"({floats[0][1]}); got {dtype}. kfac_ref does not mix precisions: cast one "
                "of them explicitly."
            )
    return xp0


# --------------------------------------------------------------------------------------
# Triangular kernels: the array API standard has none, so each library's own is used
# --------------------------------------------------------------------------------------
_KERNELS_OF: dict = {}


def _triangular_kernels(xp):
    """The backend's name for its triangular kernels: ``"scipy"``, ``"torch"``, ``"cupy"``,
    ``"jax"``, ``"blocks"`` or ``None`` (the array API has no triangular solve).

    ``"blocks"`` is a lazy library that runs an eager library's kernels on the blocks of its
    arrays (Dask): the factorisations run on the matrix as one block, through the eager
    kernels of the block's own namespace (:func:`_on_one_block`).  Looked up once per
    namespace module (a damped inverse asks three times per factor)."""
    if not isinstance(xp, types.ModuleType):  # any object may be a namespace: not cached
        return _find_triangular_kernels(xp)
    kind = _KERNELS_OF.get(xp, False)
    if kind is False:
        kind = _KERNELS_OF[xp] = _find_triangular_kernels(xp)
    return kind


def _find_triangular_kernels(xp):
    if array_api_compat.is_dask_namespace(xp):
        return "blocks"
    if array_api_compat.is_numpy_namespace(xp):
        try:
            import scipy.linalg  # noqa: F401
        except ImportError:
            return None
        return "scipy"
    for name in ("torch", "cupy", "jax"):
        if getattr(array_api_compat, f"is_{name}_namespace")(xp):
            return name
    return None


def gram_is_exactly_symmetric(xp):
    """Whether ``x.T @ x`` is exactly symmetric on this backend without a symmetrisation.

    NumPy's ``matmul`` recognises an array times its own transpose and calls BLAS ``syrk``,
    which computes one triangle and mirrors it; without BLAS (non-aligned strides) each entry
    is one dot product in a fixed order, and ``a·b = b·a`` in floating point.  GEMM kernels
    (PyTorch, CuPy, JAX) may block the two triangles differently, so they are symmetrised."""
    return array_api_compat.is_numpy_namespace(xp)


def _on_one_block(kernel, matrix):
    """``kernel(xp_block, block)`` applied lazily to ``matrix`` gathered into one block, for
    a library whose arrays are graphs of blocks computed by an eager library (kind
    ``"blocks"`` of :func:`_triangular_kernels`).

    A factorisation's kernel signals a matrix that is not positive definite by raising, and
    a lazy graph would raise it at compute time, far from kfac_ref's call and in the block
    library's words.  The block kernel turns that failure into a block of NaN instead: the
    lazy-array policy (value checks never run on lazy arrays; a bad value gives NaN, as a
    Cholesky factor inside ``jax.jit`` does).  The matrices factored here are ``d × d``
    curvature factors, results of a reduction over the batch, so one block holds them."""

    def run(block):
        bxp = array_namespace(block)
        if size_of(block) == 0:  # the library probes the kernel with empty blocks
            return block
        try:
            return kernel(bxp, block)
        except (np.linalg.LinAlgError, ValueError):  # not positive definite, NaN input
            return bxp.full(block.shape, math.nan, dtype=block.dtype)

    whole = matrix.rechunk({0: -1, 1: -1})
    return whole.map_blocks(run, dtype=matrix.dtype)


def _lapack(name, array):
    """SciPy's LAPACK routine ``name`` for ``array``'s dtype (the NumPy kernels)."""
    from scipy.linalg import lapack  # backend glue: this library's own kernel

    (routine,) = lapack.get_lapack_funcs((name,), (array,))
    return routine


def cholesky_lower(xp, matrix):
    """Lower Cholesky factor ``L`` of a symmetric matrix (``L Lᵀ = matrix``).

    On NumPy this is LAPACK ``potrf`` through SciPy, so that the factorisation and the
    inverse that usually follows (``potri``, :func:`cholesky_inverse`) run in one BLAS
    library: NumPy and SciPy ship separate OpenBLAS builds whose thread pools, used in
    alternation, spin against each other.  NumPy and PyTorch read the lower triangle;
    other libraries factor :math:`(M + M^\top)/2` (JAX symmetrises its input itself), the
    same matrix for a symmetric input.  Raises :class:`numpy.linalg.LinAlgError` when the
    matrix is not positive definite, as ``numpy.linalg.cholesky`` does (on eager arrays; a
    lazy blocked array gets NaN at compute time, see :func:`_on_one_block`).  PyTorch's
    ``cholesky_ex`` reports the failure without a read of its own
    (:func:`_factor_unless_failed`): inside :func:`deferred_value_checks` it joins the
    one read of the checks.

    A namespace may hand back the *upper* factor ``Lᵀ`` of the library it wraps instead of
    the standard's lower one (array-api-compat's Dask wrapper does, as blocked Cholesky
    codes often do); on namespaces without kernels of their own the result is folded into
    ``L`` without reading values (:func:`_lower_of_either_factor`)."""
    kind = _triangular_kernels(xp)
    if kind == "blocks":
        return _on_one_block(cholesky_lower, matrix)
    if kind == "scipy":
        potrf = _lapack("potrf", matrix)
        # the transpose of a C-ordered symmetric matrix is itself, in the Fortran order
        # LAPACK reads, so no copy is made
        low, info = potrf(matrix.T, lower=True, clean=True)
        if info:
            raise np.linalg.LinAlgError(_not_positive_definite(info))
        return low  # SciPy's LAPACK wrappers return NumPy arrays: the namespace's own
    if kind == "torch":
        import torch  # backend glue: this library's own kernel

        # cholesky_ex reports a failure in `info` instead of reading it back (which
        # linalg.cholesky does on a GPU); it reads the lower triangle
        low, info = torch.linalg.cholesky_ex(matrix)
        return _factor_unless_failed(xp, low, info)
    if kind == "jax":  # jax.numpy symmetrises its input itself
        return xp.linalg.cholesky(matrix)
    factor = xp.linalg.cholesky((matrix + xp.matrix_transpose(matrix)) / 2.0)
    if kind is None:
        return _lower_of_either_factor(xp, factor)
    return factor  # CuPy: the standard's lower factor (checked by the tests)


def _not_positive_definite(info) -> str:
    return f"potrf: leading minor {info} is not positive"


def _factor_unless_failed(xp, low, info):
    """The factor of a factorisation that reports failure in a 0-D integer ``info``
    (nonzero: the order of the first minor that is not positive definite) instead of
    raising: a :class:`numpy.linalg.LinAlgError` where value checks read now, as LAPACK's
    wrappers raise; inside :func:`deferred_value_checks` ``info == 0`` joins the one read;
    where values are not read (value checks off, lazy arrays) a failed factor is NaN, the
    policy of unchecked values."""
    if not checks_values(info):
        return xp.where(info == 0, low, xp.asarray(math.nan, dtype=low.dtype,
                                                   device=device_of(low)))

    def fail():
        raise np.linalg.LinAlgError(_not_positive_definite(int(_detached(info))))

    value_check(info == 0, fail)
    return low


def _lower_of_either_factor(xp, factor):
    r"""``L`` from a triangular Cholesky factor that is either ``L`` or ``Lᵀ``.

    .. math:: L = \operatorname{tril}(F) + \operatorname{triu}_{1}(F)^\top

    For ``F = L`` the strictly upper part is zero and this is ``L``; for ``F = Lᵀ`` the
    lower part is the diagonal and the transposed strictly upper part fills in the rest.
    No value is read, so it holds for lazy arrays, and the sum adds exact zeros."""
    return xp.tril(factor) + xp.matrix_transpose(xp.triu(factor, k=1))


def lower_triangular_inverse(xp, l_factor):
    """``L⁻¹`` of a lower triangular ``L`` (lower triangular), with the backend's
    triangular kernel where it has one (the array API has no triangular solve)."""
    n = l_factor.shape[0]
    kind = _triangular_kernels(xp)
    if kind == "blocks":
        return _on_one_block(lower_triangular_inverse, l_factor)
    if kind == "scipy":
        inv, _ = _lapack("trtri", l_factor)(l_factor, lower=True)
        return xp.tril(inv)
    eye = eye_like(l_factor, n)
    if kind == "torch":
        import torch  # backend glue: this library's own kernel

        return torch.linalg.solve_triangular(l_factor, eye, upper=False)
    if kind == "cupy":
        from cupyx.scipy.linalg import solve_triangular  # backend glue: this library's own kernel

        return solve_triangular(l_factor, eye, lower=True)
    if kind == "jax":
        from jax.scipy.linalg import solve_triangular  # backend glue: this library's own kernel

        return solve_triangular(l_factor, eye, lower=True)
    # No triangular solve in the array API: a general solve against I (exact enough for the
    # well-conditioned damped factors K-FAC works with, and it stays on device).
    return xp.tril(xp.linalg.solve(l_factor, eye))


def cholesky_inverse(xp, l_factor):
    """``(L Lᵀ)⁻¹`` from the lower Cholesky factor (lower triangular: zeros above the
    diagonal, as :func:`cholesky_lower` returns it), exactly symmetric, with the backend's
    kernel where it has one (LAPACK ``potri`` through SciPy, ``torch.cholesky_inverse``,
    ``jax.scipy.linalg.cho_solve``)."""
    kind = _triangular_kernels(xp)
    if kind == "blocks":
        return _on_one_block(cholesky_inverse, l_factor)
    if kind == "scipy":
        # the lower triangle of (L Lᵀ)⁻¹, written over a copy of L: potri leaves the zeros
        # above L's diagonal alone
        low, _ = _lapack("potri", l_factor)(l_factor, lower=True)
        # the mirror is X + Xᵀ with the diagonal counted once: one strided pass and no
        # index mask (a `where` over the triangle mask takes 2-3x as long at n ~ 300)
        out = low + low.T
        np.fill_diagonal(out, np.diagonal(low))
        return out
    if kind == "torch":
        import torch  # backend glue: this library's own kernel

        out = torch.cholesky_inverse(l_factor, upper=False)
        return (out + out.mT) / 2.0
    if kind == "jax":
        from jax.scipy.linalg import cho_solve  # backend glue: this library's own kernel

        out = cho_solve((l_factor, True), eye_like(l_factor, l_factor.shape[0]))
        return (out + out.T) / 2.0
    linv = lower_triangular_inverse(xp, l_factor)
    return xp.matrix_transpose(linv) @ linv


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------
def _static_size(x: Any) -> int | None:
    """Number of elements when every dimension is known (Dask may not know chunk sizes)."""
    if type(x) is np.ndarray:
        return x.size
    if any(d is None or (isinstance(d, float) and math.isnan(d)) for d in x.shape):
        return None
    return math.prod(x.shape)


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

    Static checks (type, rank, shape, dtype) always run; the finiteness check is a value
    check (see :func:`value_checks`).

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
        Require every entry to be finite (no NaN or Inf).  Only checked for floating dtypes,
        on eager arrays, while value checks are on.
    min_ndim : int, optional
        Minimum rank.
    layout : str, optional
        A layout description such as ``"[N, d]"`` used in the message.
    """
    xp = _known_array_namespace(x)
    if xp is None:
        if not is_array(x):
            _fail(func, name, "an array", describe(x), KFACTypeError)
        xp = array_namespace(x)
    what = f" {layout}" if layout else ""
    if ndim is not None:
        ranks = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.ndim not in ranks:
            exp = " or ".join(f"{r}-D" for r in ranks)
            _fail(func, name, f"a {exp} array{what}", describe(x))
    if min_ndim is not None and x.ndim < min_ndim:
        _fail(func, name, f"an array of at least {min_ndim} dimensions{what}", describe(x))
    if shape is not None and tuple(shape) != tuple(x.shape):  # else: None entries, or wrong
        ok = len(shape) == x.ndim and all(
            s is None or s == t for s, t in zip(shape, x.shape, strict=False)
        )
        if not ok:
            exp = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            _fail(func, name, f"an array of shape {exp}{what}", describe(x))
    floating = is_floating(xp, x.dtype)
    if dtype is not None and not (floating if dtype == "real floating"
                                  else xp.isdtype(x.dtype, dtype)):
        _fail(func, name, f"an array of {dtype} dtype", describe(x), KFACTypeError)
    if floating and dtype in ("real floating", "numeric") and is_half(xp, x.dtype):
        _fail(func, name, "a float32 or float64 array (half precision is not supported: "
              "LAPACK has no half precision; cast to float32)", describe(x), KFACTypeError)
    if (finite and floating and _static_size(x) != 0
            and checks_values(x) and not all_finite(xp, x)):
        n_bad = int(xp.sum(xp.astype(~xp.isfinite(x), xp.int32)))
        _fail(func, name, "finite (no NaN or Inf)",
              f"{n_bad} non-finite entries in {describe(x)}")
    return x


def check_array_like(func: str, name: str, x: Any, like_name: str, like: Any, *,
                     shape: Sequence[int], layout: str | None = None):
    """:func:`check_array` (real floating, ``shape``, finite) and :func:`namespace_of`
    against ``like``, a checked array of a state (a real floating array of float32 or
    float64), in one call; returns ``x`` unchanged.

    When ``x`` has ``like``'s array type, dtype and device and the expected shape, the type,
    dtype, precision and namespace checks hold already and only the finiteness scan runs
    (the products of a cached state pay these checks on every call); anything else takes
    :func:`check_array`, then :func:`namespace_of`, whose messages name the argument.
    """
    if (type(x) is type(like) and x.dtype == like.dtype and x.shape == tuple(shape)
            and device_of(x) == device_of(like)):
        if not checks_values(x) or _static_size(x) == 0 or all_finite(array_namespace(x), x):
            return x
    check_array(func, name, x, shape=shape, layout=layout)
    namespace_of(func, **{name: x, like_name: like})
    return x


def check_square(func: str, name: str, x: Any, *, layout: str = "[n, n]"):
    """Validate a finite, real floating, square 2-D array."""
    check_array(func, name, x, ndim=2, layout=layout)
    if x.shape[0] != x.shape[1]:
        _fail(func, name, f"a square matrix {layout}", describe(x))
    return x


def check_symmetric(func: str, name: str, x: Any, *, rtol: float | None = None):
    """Validate a square matrix that is symmetric up to rounding (a value check, see
    :func:`value_checks`; the squareness check always runs).

    The test is ``max|M - Mᵀ| <= rtol * max(max|M|, tiny)`` with ``rtol`` defaulting to
    ``sqrt(eps)`` of the dtype: loose enough for matrices that are symmetric in exact
    arithmetic but were computed in floating point, tight enough to catch a transposed or
    non-symmetric argument.
    """
    check_square(func, name, x)
    xp = array_namespace(x)
    if rtol is None:
        rtol = math.sqrt(float(xp.finfo(x.dtype).eps))
    if _static_size(x) == 0 or not checks_values(x):
        return x
    asym_arr = xp.max(xp.abs(x - x.T))
    if is_lazy(asym_arr):  # staged out by a trace: cannot be read (see any_true)
        return x
    asym = host_float(asym_arr)
    scale = max(host_float(xp.max(xp.abs(x))), float(xp.finfo(x.dtype).smallest_normal))
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
    like: dict | None = None,
):
    """Validate a real scalar: a Python/NumPy number, returned as ``float`` (or ``int``),
    or — for real (non-integer) scalars — a 0-D real floating array, returned unchanged so
    that a hyper-parameter can live on the device or be traced (``jax.jit``).  The finite
    and sign checks of an array are value checks (skipped for lazy arrays and when value
    checks are off).  ``like`` names the arrays the scalar meets (``{"matrix": matrix}``):
    a 0-D array must share their namespace, device and precision (:func:`namespace_of`),
    so that it neither fails inside the array library nor promotes a float32 result to
    float64; a Python number takes their dtype."""
    if type(value) is float and not integer:  # the common case, before the type probes
        _check_scalar_value(func, name, value, value, nonnegative, positive)
        return value
    if value is None and allow_none:
        return None
    if not integer and is_array(value):
        xp = array_namespace(value)
        if value.ndim != 0 or not is_floating(xp, value.dtype):
            _fail(func, name, "a real number or a 0-D real floating array", describe(value),
                  KFACTypeError)
        if like:
            namespace_of(func, **like, **{name: value})
        if checks_values(value):
            _check_scalar_value(func, name, host_float(value), value, nonnegative, positive)
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = "an integer" if integer else "a real number"
        _fail(func, name, kind, describe(value), KFACTypeError)
    if integer and not float(value).is_integer():
        _fail(func, name, "an integer", describe(value))
    v = int(value) if integer else float(value)
    _check_scalar_value(func, name, v, value, nonnegative, positive)
    return v


def check_scalars_with(func: str, arrays: dict, **scalars: Any) -> None:
    """Check the 0-D arrays among ``scalars`` (values :func:`check_scalar` returned) against
    the named ``arrays``: one namespace, device and precision (:func:`namespace_of`).

    A hyper-parameter kept on the device must be on the state's device and in its
    precision.  Otherwise it would fail inside the array library, or turn a float32 result
    into float64 without a word.  Python numbers pass: they take the arrays' dtype."""
    named = {k: v for k, v in scalars.items() if v is not None and type(v) not in (float, int)}
    if named:
        namespace_of(func, **arrays, **named)


def _check_scalar_value(func, name, v, value, nonnegative, positive):
    if not math.isfinite(v):
        _fail(func, name, "finite", describe(value))
    if positive and not v > 0:
        _fail(func, name, "positive", describe(value))
    if nonnegative and not v >= 0:
        _fail(func, name, "non-negative", describe(value))


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


def check_shape(func: str, name: str, shape: Any, *, min_ndim: int = 0):
    """Validate an array shape given as a tuple or list of at least ``min_ndim``
    non-negative integers (not bools); return it as a tuple of ints."""
    if not isinstance(shape, (tuple, list)) or len(shape) < min_ndim:
        _fail(func, name, f"a tuple of at least {min_ndim} non-negative integers",
              describe(shape), KFACTypeError if not isinstance(shape, (tuple, list))
              else KFACValueError)
    return tuple(check_int(func, name, s, minimum=0) for s in shape)


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
    xp = array_namespace(x)
    return xp.eye(n, dtype=x.dtype if dtype is None else dtype,
                  device=array_api_compat.device(x))


def zeros_like_shape(x: Any, shape: Sequence[int], dtype=None):
    """Zeros of ``shape`` in the namespace, device and (default) dtype of ``x``."""
    xp = array_namespace(x)
    return xp.zeros(tuple(shape), dtype=x.dtype if dtype is None else dtype,
                    device=array_api_compat.device(x))


def ones_like_shape(x: Any, shape: Sequence[int], dtype=None):
    """Ones of ``shape`` in the namespace, device and (default) dtype of ``x``."""
    xp = array_namespace(x)
    return xp.ones(tuple(shape), dtype=x.dtype if dtype is None else dtype,
                   device=array_api_compat.device(x))


def asarray_like(value: Any, x: Any, dtype=None):
    """Convert host data (Python scalars, lists, NumPy arrays) to the namespace and device
    of ``x``, in ``x``'s dtype unless ``dtype`` is given."""
    xp = array_namespace(x)
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
