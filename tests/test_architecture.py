"""Structure rules of the library, checked on its source (ast), not by convention:

* no module reaches into another module's privates: no ``from .m import _name`` and no
  ``m._name`` on an imported kfac_ref module (shared internals go through a kernel,
  ``f.kernel``, or a module's documented internal API without a leading underscore).  A
  private *module* (``kfac_ref.blocks._math``) is private to its package: its siblings
  use it.  ``kfac_ref._backend`` is the internal validation API of the whole library;
* no single-letter aliases of modules (``import kfac_ref.linalg as L``);
* the only modules that import a backend library or ``array_api_compat`` directly are
  :mod:`kfac_ref._backend` (the glue) and the host-side NumPy users it documents.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kfac_ref"
SOURCES = sorted(ROOT.rglob("*.py"))
_SHARED_PRIVATE_MODULES = {"_backend"}  # the validation layer, private by design


def _modname(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(current: str, is_pkg: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = current.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split("."))
    return (ROOT.parent / rel).with_suffix(".py").exists() or (ROOT.parent / rel).is_dir()


def _allowed(me: str, target: str, name: str) -> bool:
    """May module ``me`` use the private ``name`` of module ``target``?"""
    if target.rsplit(".", 1)[-1] in _SHARED_PRIVATE_MODULES or me == target:
        return True
    if _is_module(f"{target}.{name}"):  # a private module: its package's own
        return me == target or me.startswith(target + ".")
    return False


def _violations(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    me = _modname(path)
    is_pkg = path.name == "__init__.py"
    module_aliases: dict[str, str] = {}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(me, is_pkg, node.module, node.level)
            if not target.startswith("kfac_ref"):
                continue
            for alias in node.names:
                if (alias.name.startswith("_") and not alias.name.startswith("__")
                        and not _allowed(me, target, alias.name)):
                    out.append(f"{path.name}:{node.lineno}: from {target} import {alias.name}")
                if alias.asname and len(alias.asname) == 1:
                    out.append(f"{path.name}:{node.lineno}: single-letter alias "
                               f"{alias.asname} for {alias.name}")
                module_aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and len(alias.asname) == 1:
                    out.append(f"{path.name}:{node.lineno}: single-letter alias "
                               f"{alias.asname} for {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            target = module_aliases.get(node.value.id)
            if target and _is_module(target) and not _allowed(me, target, node.attr):
                out.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return out


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reach_into_other_modules_privates(path):
    assert _violations(path) == []
