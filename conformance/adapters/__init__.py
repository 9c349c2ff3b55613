"""Shipped adapters.

Every module in this package that does not start with ``_`` is an adapter module: it defines
``ADAPTERS`` (a dict name -> ``"module:attr"`` spec or class) or a single ``ADAPTER``.  The
registry is discovered, so a new adapter is a new file here; modules must import their
implementation lazily (in ``Adapter.setup``), so that discovery stays cheap and works where the
implementation is not installed.

Adapters outside this package join through the entry-point group :data:`ENTRY_POINT_GROUP`
(``kfac_ref.conformance_adapters``): a distribution that declares, in its ``pyproject.toml``,

.. code-block:: toml

    [project.entry-points."kfac_ref.conformance_adapters"]
    mykfac = "mypkg.kfac_adapter:MyAdapter"

is listed by ``python -m conformance list``, runs with ``--adapter mykfac`` and takes part in
``--all-adapters`` and the ecosystem matrix.  ``python -m conformance new-adapter NAME``
writes a commented skeleton to start from.

A module here that cannot be imported (a syntax error, a top-level import of a missing
library) is not dropped: :func:`broken` names it with its exception, ``list`` shows it and
``--all-adapters`` reports it as an error.
"""

from __future__ import annotations

import importlib
import pkgutil

__all__ = ["registry", "shipped", "mutants", "external", "broken", "ENTRY_POINT_GROUP"]

#: entry-point group through which installed distributions contribute adapters
ENTRY_POINT_GROUP = "kfac_ref.conformance_adapters"


def _collect(package):
    """The adapters of ``package``'s modules: (name -> spec, module -> why it cannot be
    imported).  A broken module must not hide the others, nor disappear."""
    out, bad = {}, {}
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        modname = f"{package}.{info.name}"
        try:
            mod = importlib.import_module(modname)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit at import time included
            bad[modname] = f"{type(exc).__name__}: {exc}"
            continue
        if hasattr(mod, "ADAPTERS"):
            for name, target in mod.ADAPTERS.items():
                out[name] = target if isinstance(target, str) else f"{modname}:{target.__name__}"
        elif hasattr(mod, "ADAPTER"):
            out[getattr(mod.ADAPTER, "name", info.name)] = modname
    return out, bad


def shipped() -> dict:
    """Adapters for real implementations: name -> spec."""
    return _collect("conformance.adapters")[0]


def mutants() -> dict:
    """Deliberately wrong adapters (one pitfall each): name -> spec."""
    return _collect("conformance.mutants")[0]


def broken() -> dict:
    """Adapter modules of this suite (shipped adapters and mutants) that cannot be imported:
    module name -> ``"ExceptionType: message"``.  Their adapters are missing from
    :func:`shipped` and :func:`mutants`; ``list`` and ``--all-adapters`` report them."""
    out = dict(_collect("conformance.adapters")[1])
    out.update(_collect("conformance.mutants")[1])
    return out


def external() -> dict:
    """Adapters of installed distributions (entry-point group :data:`ENTRY_POINT_GROUP`):
    name -> ``"module[:attr]"`` spec.  Nothing is imported here; a shipped adapter's name
    cannot be taken over."""
    from importlib.metadata import entry_points

    taken = set(shipped()) | set(mutants())
    out = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in taken and ep.name not in out:
            out[ep.name] = ep.value
    return out


def distribution_of(name: str) -> str:
    """``"dist version"`` of the distribution that contributes the external adapter ``name``
    (empty when it is not an external adapter)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            dist = getattr(ep, "dist", None)
            return f"{dist.name} {dist.version}" if dist is not None else ""
    return ""


def registry() -> dict:
    """Every adapter name: shipped, mutants and external (installed through entry points)."""
    out = dict(external())
    out.update(shipped())
    out.update(mutants())
    return out
