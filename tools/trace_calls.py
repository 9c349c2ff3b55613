"""Trace a public kfac_ref call down to the backend's linear-algebra call.

Runs one public call under ``sys.setprofile`` and prints, for the first call into a backend
routine (LAPACK ``potrf`` through SciPy, or a namespace's ``linalg.cholesky``), the chain of
kfac_ref frames from the public method down to the frame that made the backend call, with
the number of files and of calls it crosses::

    python tools/trace_calls.py                # conv and dense Kronecker multiply_inverse
    python tools/trace_calls.py --target eigh  # the first eigendecomposition instead

``calls`` counts the call edges from the public method to the backend routine: one per
kfac_ref frame of the chain (the last one is the call into the backend).  LAPACK routines
from SciPy are compiled objects that the profiler does not see, so the trace wraps
``scipy.linalg.lapack.get_lapack_funcs`` for its duration: each routine it hands out is
called through a Python function named after it.

The bounds of ``tests/test_call_depth.py`` are checked with :func:`trace`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass

import numpy as np

_PACKAGE = os.path.dirname(os.path.abspath(__import__("kfac_ref").__file__))

BACKEND_CHOLESKY = ("potrf", "cholesky")
"""Names of the backend routines that factorise a matrix by Cholesky."""


@dataclass
class Chain:
    """The kfac_ref frames ``(relative file, line, function)`` from the public call to the
    one that called ``backend``."""

    frames: list
    backend: str

    @property
    def files(self) -> int:
        return len({f for f, _, _ in self.frames})

    @property
    def calls(self) -> int:
        return len(self.frames)

    def __str__(self) -> str:
        lines = [f"{i + 1:2d}. {f}:{line}  {name}" for i, (f, line, name)
                 in enumerate(self.frames)]
        lines.append(f"    -> backend {self.backend}")
        lines.append(f"files: {self.files}, calls: {self.calls}")
        return "\n".join(lines)


def _in_package(code) -> bool:
    return os.path.abspath(code.co_filename).startswith(_PACKAGE + os.sep)


def _chain(frame, stop):
    frames = []
    while frame is not None and frame is not stop:
        if _in_package(frame.f_code):
            rel = os.path.relpath(os.path.abspath(frame.f_code.co_filename),
                                  os.path.dirname(_PACKAGE))
            frames.append((rel, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames[::-1]


@contextlib.contextmanager
def _visible_lapack():
    """Hand out LAPACK routines wrapped in Python functions named after them."""
    try:
        from scipy.linalg import lapack
    except ImportError:
        yield
        return
    original = lapack.get_lapack_funcs

    def get_lapack_funcs(names, arrays=(), *args, **kwargs):
        funcs = original(names, arrays, *args, **kwargs)
        single = not isinstance(funcs, (tuple, list))
        wrapped = [_named(f) for f in ((funcs,) if single else funcs)]
        return wrapped[0] if single else tuple(wrapped)

    lapack.get_lapack_funcs = get_lapack_funcs
    try:
        yield
    finally:
        lapack.get_lapack_funcs = original


def _named(routine):
    # "dpotrf" (f2py says "function dpotrf") → "potrf": the routine without its type letter
    full = str(getattr(routine, "__name__", "lapack")).split()[-1]
    base = full[1:] if getattr(routine, "typecode", None) and len(full) > 1 else full

    def call(*args, **kwargs):
        return routine(*args, **kwargs)

    call.__name__ = call.__qualname__ = base
    call.__code__ = call.__code__.replace(co_name=base)
    return call


def trace(fn, *args, targets=BACKEND_CHOLESKY, **kwargs):
    """Run ``fn(*args, **kwargs)``; return the :class:`Chain` of its first call into a
    backend routine whose name is in ``targets`` (None if there is none) and the result."""
    found = []
    here = sys._getframe()

    def profile(frame, event, arg):
        if found:
            return
        if event == "call" and frame.f_code.co_name in targets and \
                not _in_package(frame.f_code):
            caller = frame.f_back
            if caller is not None and _in_package(caller.f_code):
                found.append(Chain(_chain(caller, here), frame.f_code.co_name))
        elif event == "c_call" and getattr(arg, "__name__", None) in targets and \
                _in_package(frame.f_code):
            found.append(Chain(_chain(frame, here), arg.__name__))

    with _visible_lapack():
        sys.setprofile(profile)
        try:
            result = fn(*args, **kwargs)
        finally:
            sys.setprofile(None)
    return (found[0] if found else None), result


def kronecker_inverse_chain(kind="conv", targets=BACKEND_CHOLESKY):
    """The chain of ``Conv2DTwoKroneckerFactored.multiply_inverse`` (``kind="conv"``) or
    ``DenseTwoKroneckerFactored.multiply_inverse`` (``"dense"``), approximate (factored π
    damping), uncached, on NumPy arrays."""
    from kfac_ref.blocks import kfac_jax as kj

    rng = np.random.default_rng(0)
    n = 8
    if kind == "conv":
        block = kj.Conv2DTwoKroneckerFactored((n, 5, 5, 2), (3, 3, 2, 4), padding="SAME")
        data = {"inputs": rng.standard_normal((n, 5, 5, 2)),
                "outputs_grad": rng.standard_normal((n, 5, 5, 4))}
    else:
        block = kj.DenseTwoKroneckerFactored(6, 4)
        data = {"inputs": rng.standard_normal((n, 6)),
                "outputs_grad": rng.standard_normal((n, 4))}
    state = block.init(np.zeros(()))
    state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, n)
    vector = tuple(rng.standard_normal(s) for s in block.parameters_shapes)
    chain, _ = trace(block.multiply_inverse, state, vector, 0.1, False, False, targets=targets)
    return chain


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append",
                        help="backend routine name to stop at (repeatable; default: "
                             + ", ".join(BACKEND_CHOLESKY) + ")")
    args = parser.parse_args(argv)
    targets = tuple(args.target) if args.target else BACKEND_CHOLESKY
    for kind, name in (("conv", "Conv2DTwoKroneckerFactored"),
                       ("dense", "DenseTwoKroneckerFactored")):
        print(f"{name}.multiply_inverse (approximate, uncached):")
        chain = kronecker_inverse_chain(kind, targets)
        print(chain if chain is not None else "    no backend call of " + ", ".join(targets))
        print()


if __name__ == "__main__":
    main()
