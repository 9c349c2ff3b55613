"""The adapter protocol: how an implementation under test plugs into the suite.

An adapter is a Python object (usually a subclass of :class:`Adapter`) that

* says who it is (``name``, :meth:`Adapter.version`),
* declares its conventions (``conventions``, a :class:`~conformance.conventions.Conventions`),
  the floating type it computes in (``dtype``) and any extra relative error its
  hyper-parameter handling adds (``hyperparameter_rtol`` with a reason),
* maps capabilities to functions ``fn(inputs, params) -> array`` with :func:`implements`,
  where ``inputs`` is a dict of float64 NumPy arrays already converted into the declared
  conventions and ``params`` a dict of Python scalars/strings; the function returns anything
  ``numpy.asarray`` can read (NumPy, CPU torch tensors, JAX arrays, ...),
* lists in ``accepts_draws`` the random capabilities (``Capability.draws``: the sampling
  estimation modes) for which it takes the case's draws — sampled targets, sign vectors —
  as inputs and returns the estimate for exactly those draws; those are compared with the
  tight tolerance.  For the others the suite calls the function with ``params["seed"]``
  (an int, a different one per call) and no draws, and tests the mean of many calls
  statistically (:mod:`conformance.sampling`),
* lists capabilities it cannot provide in ``unsupported`` (capability -> reason); a
  capability that is neither implemented nor listed is skipped with a generic reason; a
  capability function may raise :class:`CaseUnsupported` for a single case it cannot express.

Heavy imports (torch, jax, tensorflow) belong in :meth:`Adapter.setup`, which raises
:class:`AdapterUnavailable` when the implementation is not installed; the suite then skips the
whole adapter with that reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from .conventions import CANONICAL, Conventions

__all__ = ["Adapter", "AdapterUnavailable", "CaseUnsupported", "implements", "load_adapter",
           "ENV_VAR"]

ENV_VAR = "KFAC_CONFORMANCE_ADAPTER"


class AdapterUnavailable(RuntimeError):
    """The implementation behind an adapter cannot be imported or set up here."""


class CaseUnsupported(Exception):
    """Raised by a capability function for a case the implementation cannot express (a loss
    it lacks, a padding mode it does not have): the case is skipped with this reason.  Use it
    only for genuinely missing features, never for a wrong number."""


def implements(*capabilities):
    """Decorator: mark an adapter method as the implementation of ``capabilities``."""

    def mark(fn):
        fn._conformance_capabilities = tuple(capabilities)
        return fn

    return mark


class Adapter:
    """Base class of adapters (see the module docstring for the protocol)."""

    name: str = "unnamed"
    description: str = ""
    conventions: Conventions = CANONICAL
    dtype: str = "float64"
    hyperparameter_rtol: float = 0.0
    hyperparameter_rtol_reason: str = ""
    unsupported: dict = {}
    #: random capabilities (``Capability.draws``) whose draws the adapter takes as inputs:
    #: compared exactly; any other random capability is called with ``params["seed"]`` and
    #: tested statistically
    accepts_draws: tuple = ()
    #: fnmatch pattern of case ids (or capability names) -> reason: cases the implementation
    #: cannot express; skipped with the reason in every run, including --all-adapters
    skip_cases: dict = {}

    def setup(self) -> None:
        """Import the implementation; raise :class:`AdapterUnavailable` if it is missing."""

    def version(self) -> str:
        return ""

    def implementations(self) -> dict:
        """capability name -> bound function, collected from :func:`implements` marks."""
        out = {}
        for klass in reversed(type(self).__mro__):
            for attr, value in vars(klass).items():
                caps = getattr(value, "_conformance_capabilities", None)
                if caps:
                    fn = getattr(self, attr)
                    for cap in caps:
                        out[cap] = fn
        return out

    def info(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "version": self.version(),
            "dtype": self.dtype,
            "conventions": self.conventions.to_dict(),
            "non_canonical_conventions": self.conventions.differences(),
            "hyperparameter_rtol": self.hyperparameter_rtol,
            "hyperparameter_rtol_reason": self.hyperparameter_rtol_reason,
            "accepts_draws": list(self.accepts_draws),
        }


def _from_module(mod, attr):
    if attr:
        obj = getattr(mod, attr)
    elif hasattr(mod, "ADAPTER"):
        obj = mod.ADAPTER
    elif hasattr(mod, "get_adapter"):
        obj = mod.get_adapter
    else:
        raise AdapterUnavailable(f"module {mod.__name__} defines no ADAPTER or get_adapter()")
    if isinstance(obj, type):
        return obj()
    if callable(obj) and not isinstance(obj, Adapter):
        return obj()
    return obj


def load_adapter(spec: str | None = None) -> Adapter:
    """Resolve an adapter from a name, ``package.module[:attr]`` or ``path/to/file.py[:attr]``.

    ``None`` reads the :data:`ENV_VAR` environment variable (default ``kfac_ref``).  Names
    are those of :func:`conformance.adapters.registry` (shipped adapters and mutants).
    """
    from .adapters import registry

    spec = spec or os.environ.get(ENV_VAR) or "kfac_ref"
    reg = registry()
    if spec in reg:
        spec = reg[spec]
    path, _, attr = spec.partition(":") if not os.path.exists(spec) else (spec, "", "")
    if path.endswith(".py") or os.path.sep in path:
        name = f"_conformance_adapter_{abs(hash(path))}"
        mod_spec = importlib.util.spec_from_file_location(name, path)
        if mod_spec is None or mod_spec.loader is None:
            raise AdapterUnavailable(f"cannot load adapter file {path}")
        mod = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = mod
        mod_spec.loader.exec_module(mod)
    else:
        try:
            mod = importlib.import_module(path)
        except ImportError as exc:
            from .adapters import broken

            bad = broken()
            note = ("; these adapter modules of the suite cannot be imported and may define "
                    "it: " + "; ".join(f"{m} ({why})" for m, why in bad.items())) if (
                "." not in path and bad) else ""
            raise AdapterUnavailable(f"cannot import adapter module {path!r}: {exc}{note}") \
                from exc
    return _from_module(mod, attr)
