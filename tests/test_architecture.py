"""Structure rules of the library, checked on its source (ast), not by convention:

* no module reaches into another module's privates: no ``from .m import _name`` and no
  ``m._name`` on an imported kfac_ref module (shared internals go through a kernel,
  ``f.kernel``, or a module's documented internal API without a leading underscore).  A
  private *module* (``kfac_ref.blocks._math``) is private to its package: its siblings
  use it.  ``kfac_ref._backend`` is the internal validation API of the whole library;
* no module touches another module's private *attributes*: an access ``obj._name`` (load,
  store or delete) where ``obj`` is not ``self``/``cls`` and ``_name`` is defined by another
  kfac_ref module and not by this one (a method, a class attribute, an ``obj._name = ...``
  assignment, a keyword of an ``_evolve(_name=...)``-style copy, a module-level name) —
  e.g. curvature calling ``net._forward`` of :class:`kfac_ref.nn.Sequential` instead of its
  public tap protocol.  ``_ATTRIBUTE_ALLOWED`` lists the exceptions, each with its reason;
* no single-letter aliases of modules (``import kfac_ref.linalg as L``);
* layers do not know curvature: :mod:`kfac_ref.nn` imports no statistics (factors, losses),
  blocks or curvature modules (a statistic of a layer's forward pass is a tap the caller
  hands in, :meth:`kfac_ref.nn.Layer.forward_with_tap`);
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


# -- private attributes across modules ---------------------------------------------------
# (module, attribute) -> why the access is allowed.  Keep it short: fix instead of listing.
_ATTRIBUTE_ALLOWED: dict[tuple[str, str], str] = {}

# The exact curvature validates the network's output and targets once, at its public
# entry point, then calls each loss formula's unchecked kernel (the loss's public methods
# would scan the same arrays again per product; "validate once, one door").
_LOSS_KERNEL_REASON = (
    "the exact curvature (kfac_ref.curvature) has validated the output and targets at its "
    "public entry point and calls the loss formula's unchecked kernel (kfac_ref.losses)")
_ATTRIBUTE_ALLOWED.update({
    ("kfac_ref.curvature._exact", name): _LOSS_KERNEL_REASON
    for name in ("_evaluate", "_grad", "_sample", "_factor_vp", "_factor_t_vp",
                 "_factor_matrix", "_hessian_matrix")})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_privates(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, assigned names and
    attributes (``x._a = ...``, ``self._a = ...``, class bodies), keyword arguments (the
    attributes of ``_evolve(_a=...)``-style copies) and ``__slots__`` entries."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif (isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets)):
            names.update(c.value for c in ast.walk(node.value)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return {n for n in names if _private(n)}


_TREES = {_modname(p): ast.parse(p.read_text(encoding="utf-8")) for p in SOURCES}
_DEFINED = {m: _defined_privates(t) for m, t in _TREES.items()}


def _attribute_violations(me: str) -> list[str]:
    others: dict[str, list[str]] = {}
    for module, names in _DEFINED.items():
        if module != me:
            for name in names:
                others.setdefault(name, []).append(module)
    out = []
    for node in ast.walk(_TREES[me]):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if node.attr in _DEFINED[me] or node.attr not in others:
            continue
        if (me, node.attr) in _ATTRIBUTE_ALLOWED:
            continue
        out.append(f"{me}:{node.lineno}: {ast.unparse(node)} (defined in "
                   f"{', '.join(sorted(others[node.attr]))})")
    return out


@pytest.mark.parametrize("module", sorted(_TREES))
def test_no_private_attribute_access_across_modules(module):
    assert _attribute_violations(module) == []


def test_the_attribute_scan_catches_a_reach_into_another_module():
    """The scan must be able to fail: an estimator calling the network's private pass."""
    tree = ast.parse("def update(net, params, x):\n    return net._forward(params, x)\n")
    _TREES["kfac_ref.curvature._probe"], _DEFINED["kfac_ref.curvature._probe"] = tree, set()
    try:
        found = _attribute_violations("kfac_ref.curvature._probe")
    finally:
        del _TREES["kfac_ref.curvature._probe"], _DEFINED["kfac_ref.curvature._probe"]
    assert len(found) == 1 and "net._forward" in found[0] and "kfac_ref.nn._network" in found[0]


def test_the_attribute_allow_list_is_current():
    """Every allowed entry still names an access that exists (no stale exceptions)."""
    for (module, attr), reason in _ATTRIBUTE_ALLOWED.items():
        assert reason, (module, attr)
        assert any(isinstance(n, ast.Attribute) and n.attr == attr
                   for n in ast.walk(_TREES[module])), (module, attr)


_NN_MAY_NOT_IMPORT = ("kfac_ref.factors", "kfac_ref.losses", "kfac_ref.blocks",
                      "kfac_ref.curvature", "kfac_ref.optim", "kfac_ref.operators")


def _kfac_imports(module: str) -> set[str]:
    path = next(p for p in SOURCES if _modname(p) == module)
    out = set()
    for node in ast.walk(_TREES[module]):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(module, path.name == "__init__.py", node.module, node.level)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("kfac_ref")}


@pytest.mark.parametrize("module", sorted(m for m in _TREES if m.startswith("kfac_ref.nn")))
def test_layers_do_not_know_statistics_or_curvature(module):
    bad = sorted(m for m in _kfac_imports(module)
                 if any(m == b or m.startswith(b + ".") for b in _NN_MAY_NOT_IMPORT))
    assert bad == [], f"{module} imports {bad}"


# -- one home per public object -----------------------------------------------------------
# A public module is one with no dotted component starting with "_"; what it exports is its
# __all__ (its documented API; its other attributes are its own imports).  The top level may
# re-export; any other second public module exporting the same object is a second door.
_NAME_MAP = Path(__file__).resolve().parents[1] / "docs" / "name_map_blocks.rst"


def _public_exports():
    import importlib
    import pkgutil

    import kfac_ref

    modules = [kfac_ref] + [
        importlib.import_module(info.name)
        for info in pkgutil.walk_packages(kfac_ref.__path__, "kfac_ref.")
        if not any(part.startswith("_") for part in info.name.split("."))]
    exports: dict[int, list[str]] = {}
    for mod in modules:
        assert hasattr(mod, "__all__"), f"public module {mod.__name__} has no __all__"
        for name in mod.__all__:
            obj = getattr(mod, name)
            if isinstance(obj, (bool, int, float, str)) or obj is None:
                continue  # equal immutable scalars may share an id without being one object
            exports.setdefault(id(obj), []).append(f"{mod.__name__}.{name}")
    return exports


def _documented_aliases() -> dict[str, str]:
    text = _NAME_MAP.read_text(encoding="utf-8").split(".. _one-home:", 1)[1]
    rows = [line.split("``") for line in text.splitlines() if line.lstrip().startswith(
        ("* - ``", "- ``"))]
    names = [r[1] for r in rows]
    return dict(zip(names[0::2], names[1::2], strict=True))


def test_every_public_object_has_one_home():
    """No object is exported by two public modules (the top level aside)."""
    doors = {tuple(sorted(names)) for names in _public_exports().values()
             if len({n.rsplit(".", 1)[0] for n in names} - {"kfac_ref"}) > 1}
    assert sorted(doors) == []


def test_the_alias_table_lists_every_alias():
    """Two names of one object in its home module are an alias, listed on the name map page
    (docs/name_map_blocks.rst, "One home per name") with the object's name."""
    found = {}
    for names in _public_exports().values():
        homes = sorted(n for n in names if n.rsplit(".", 1)[0] != "kfac_ref")
        for alias in homes[1:] if len(homes) > 1 else ():
            found[alias] = homes[0]
    documented = _documented_aliases()
    assert {frozenset(p) for p in found.items()} == {frozenset(p) for p in documented.items()}


def test_the_one_home_check_can_fail(monkeypatch):
    """A second public module exporting a factor class is caught."""
    import kfac_ref.patches as patches
    from kfac_ref.factors import FullyConnectedKroneckerFactor

    monkeypatch.setattr(patches, "__all__", [*patches.__all__, "Dup"], raising=True)
    monkeypatch.setattr(patches, "Dup", FullyConnectedKroneckerFactor, raising=False)
    doors = [sorted(names) for names in _public_exports().values()
             if len({n.rsplit(".", 1)[0] for n in names} - {"kfac_ref"}) > 1]
    assert doors == [["kfac_ref.factors.FullyConnectedKroneckerFactor", "kfac_ref.patches.Dup"]]
