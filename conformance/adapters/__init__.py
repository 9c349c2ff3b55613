"""Shipped adapters.

Every module in this package that does not start with ``_`` is an adapter module: it defines
``ADAPTERS`` (a dict name -> ``"module:attr"`` spec or class) or a single ``ADAPTER``.  The
registry is discovered, so a new adapter is a new file here; modules must import their
implementation lazily (in ``Adapter.setup``), so that discovery stays cheap and works where the
implementation is not installed.
"""

from __future__ import annotations

import importlib
import pkgutil

__all__ = ["registry", "shipped", "mutants"]


def _collect(package):
    out = {}
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        modname = f"{package}.{info.name}"
        try:
            mod = importlib.import_module(modname)
        except Exception:  # noqa: BLE001 - a broken adapter module must not hide the others
            continue
        if hasattr(mod, "ADAPTERS"):
            for name, target in mod.ADAPTERS.items():
                out[name] = target if isinstance(target, str) else f"{modname}:{target.__name__}"
        elif hasattr(mod, "ADAPTER"):
            out[getattr(mod.ADAPTER, "name", info.name)] = modname
    return out


def shipped() -> dict:
    """Adapters for real implementations: name -> spec."""
    return _collect("conformance.adapters")


def mutants() -> dict:
    """Deliberately wrong adapters (one pitfall each): name -> spec."""
    return _collect("conformance.mutants")


def registry() -> dict:
    out = dict(shipped())
    out.update(mutants())
    return out
