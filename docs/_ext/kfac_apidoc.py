"""Sphinx extension: API pages generated from ``__all__`` and a check that every public
symbol is documented (with a formula where it computes something).

Configuration (``docs/conf.py``)
--------------------------------
``kfac_api_packages``
    Packages walked (``pkgutil.walk_packages``) to find every public module, i.e. every
    module none of whose dotted components starts with ``_``.
``kfac_api_modules``
    The order of the module pages.  A module listed here must exist.
``kfac_api_autodiscover``
    ``True`` (default): a public module that ``kfac_api_modules`` does not list gets its
    page anyway, placed after its siblings, so a new module needs no edit (one line here
    to choose its place).  ``False``: an unlisted public module fails the build.
``kfac_api_strict``
    Also enforce docstrings of constants, methods and properties (default ``False``).

What is generated (at ``builder-inited``, into ``docs/api/generated/``, git-ignored)
-----------------------------------------------------------------------------------
* ``<module>.rst``: the module docstring, a summary table of its ``__all__`` and a hidden
  toctree of the object pages;
* ``<module>.<name>.rst``: one page per public object that *lives* in that module;
* ``modules.inc``: the table and toctree of modules, included by ``docs/api/index.rst``.

A name that several modules export (``kfac_ref.compute_cov`` and
``kfac_ref.linalg.compute_cov``) is documented once, in the most specific module that exports the
same object; the others link to it.  Names re-exported from a private module
(``kfac_ref._backend.KFACValueError`` exported as ``kfac_ref.KFACValueError``) are
documented where they are exported.

Checks (warnings, so ``sphinx -W`` turns them into a failed build)
------------------------------------------------------------------
* every documented module imports and has ``__all__`` and a docstring, and every name of
  every ``__all__`` exists (with ``kfac_api_autodiscover = False`` also: every public
  module is listed);
* every public function and class has a docstring, and one that computes something
  contains ``.. math::`` or ``:math:``: exception classes, and objects whose
  ``@capabilities`` declaration says they compute nothing (``array_free=True`` unless
  ``formula=True``, or ``formula="<why not>"``), need a docstring, not a formula;
* with ``kfac_api_strict = True`` also: every public constant has a docstring (the string
  literal right after its assignment), and every public method and property that a public
  class defines has one (inherited docstrings count).  Without it these are reported as
  information only;
* after reading, every public object is present in the Python domain, i.e. it really has
  a rendered entry in the reference (``env-check-consistency``).

The same checks run without Sphinx: ``python docs/_ext/kfac_apidoc.py [--strict]`` (exit
status 1 on failure), which is quick enough for a pre-commit hook.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

FORMULA_MARKERS = (".. math::", ":math:`")
GENERATED = Path("api") / "generated"


# --------------------------------------------------------------------------------------
# Collecting the public API
# --------------------------------------------------------------------------------------
@dataclass
class Entry:
    """One public name: where it is documented and what it is."""

    module: str  # the module whose page documents it
    name: str
    obj: object
    kind: str  # "function", "class", "exception", "data", "module"
    exported_by: list = field(default_factory=list)  # all listed modules exporting it

    @property
    def fullname(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass
class ApiModel:
    modules: dict  # name -> module object (only those that imported)
    entries: dict  # (module, name) -> Entry  (canonical home only)
    exports: dict  # module -> list of (name, Entry) in __all__ order
    problems: list  # list of str


def _kind(obj) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if callable(obj):
        return "function"
    return "data"


def _public_modules(package_names, problems):
    found = []
    for pkg_name in package_names:
        try:
            pkg = importlib.import_module(pkg_name)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            problems.append(f"package {pkg_name} does not import: {type(exc).__name__}: {exc}")
            continue
        found.append(pkg_name)
        if not hasattr(pkg, "__path__"):
            continue

        def onerror(name, _problems=problems):
            _problems.append(f"module {name} does not import: {sys.exc_info()[1]!r}")

        for info in pkgutil.walk_packages(pkg.__path__, prefix=pkg_name + ".", onerror=onerror):
            if any(part.startswith("_") for part in info.name.split(".")):
                continue
            found.append(info.name)
    return found


def _insert_discovered(order: list[str], name: str) -> None:
    """Insert ``name`` after the last listed module of its parent package (or at the end)."""
    parent = name.rpartition(".")[0]
    position = len(order)
    for i, listed in enumerate(order):
        if listed == parent or listed.startswith(parent + "."):
            position = i + 1
    order.insert(position, name)


def collect(module_names, package_names, autodiscover=True) -> ApiModel:
    """Import the modules and decide where each public name is documented.

    ``module_names`` fixes the order of the API pages.  Public modules of
    ``package_names`` that it does not list are added after their siblings
    (``autodiscover=True``) or reported as problems (``autodiscover=False``).
    """
    problems: list[str] = []
    order = list(module_names)
    listed = set(order)
    for name in _public_modules(package_names, problems):
        if name in listed:
            continue
        if autodiscover:
            _insert_discovered(order, name)
            listed.add(name)
        else:
            problems.append(
                f"public module {name} is not in kfac_api_modules (docs/conf.py); add it there "
                "so its __all__ is documented"
            )

    modules = {}
    for name in order:
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"module {name} does not import: {type(exc).__name__}: {exc}")
            continue
        if not getattr(mod, "__all__", None):
            problems.append(f"module {name} has no __all__ (the API pages are built from it)")
            continue
        if not (mod.__doc__ or "").strip():
            problems.append(f"module {name} has no docstring")
        modules[name] = mod

    # For every (module, name): the most specific listed module exporting the same object.
    exporters: dict[tuple[str, int], list[str]] = {}
    for mod_name, mod in modules.items():
        for name in mod.__all__:
            if not hasattr(mod, name):
                problems.append(f"{mod_name}.__all__ names {name!r}, which does not exist")
                continue
            exporters.setdefault((name, id(getattr(mod, name))), []).append(mod_name)

    entries = {}
    exports = {}
    for mod_name, mod in modules.items():
        exports[mod_name] = []
        for name in mod.__all__:
            if not hasattr(mod, name):
                continue
            obj = getattr(mod, name)
            kind = _kind(obj)
            if kind == "module":
                if obj.__name__ not in listed:
                    problems.append(
                        f"{mod_name}.__all__ exports module {obj.__name__}, which "
                        "is not in kfac_api_modules"
                    )
                exports[mod_name].append((name, Entry(obj.__name__, "", obj, "module")))
                continue
            owners = exporters[(name, id(obj))]
            home = max(owners, key=lambda m: (m.count("."), len(m)))
            key = (home, name)
            if key not in entries:
                entries[key] = Entry(home, name, obj, kind, sorted(owners))
            exports[mod_name].append((name, entries[key]))
    return ApiModel(modules, entries, exports, problems)


# --------------------------------------------------------------------------------------
# Docstring checks
# --------------------------------------------------------------------------------------
def _attribute_doc(module_name, name):
    """The docstring of a module-level constant (the string literal after it)."""
    try:
        from sphinx.pycode import ModuleAnalyzer
    except ImportError:  # pragma: no cover - the standalone check needs Sphinx too
        return None
    try:
        analyzer = ModuleAnalyzer.for_module(module_name)
        docs = analyzer.find_attr_docs()
    except Exception:  # noqa: BLE001
        return None
    lines = docs.get(("", name))
    return "\n".join(lines) if lines else None


def _imported_from(module_name, name, depth=6):
    """The modules ``name`` is imported from in ``module_name``'s source (``from .x import
    name`` followed through re-exports, up to ``depth`` steps): where a re-exported constant,
    and its docstring, are defined."""
    import ast
    import importlib.util

    out = []
    for _ in range(depth):
        try:
            spec = importlib.util.find_spec(module_name)
            source = open(spec.origin, encoding="utf-8").read()  # noqa: SIM115
            tree = ast.parse(source)
        except Exception:  # noqa: BLE001 - no source: nothing to follow
            return out
        nxt = None
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == name and a.asname in
                                                          (None, name) for a in node.names):
                if node.level:
                    package = module_name if spec.submodule_search_locations else \
                        module_name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    nxt = f"{package}.{node.module}" if node.module else package
                else:
                    nxt = node.module
                break
        if not nxt or nxt in out:
            return out
        out.append(nxt)
        module_name = nxt
    return out


def _doc_of(entry: Entry) -> str:
    """The docstring of a public object; for a constant, the string literal after it (in
    its public module, or where that module imports it from)."""
    if entry.kind == "data":
        for candidate in [entry.module, *entry.exported_by]:
            for module in [candidate, *_imported_from(candidate, entry.name)]:
                doc = _attribute_doc(module, entry.name)
                if doc:
                    return doc
        return ""
    return inspect.getdoc(entry.obj) or ""


def _has_formula(doc: str) -> bool:
    return any(marker in doc for marker in FORMULA_MARKERS)


def _formula_required(obj) -> bool:
    """Whether ``obj`` must show a formula: it computes something.  Its ``@capabilities``
    declaration says so: objects that take no arrays (``array_free=True``: options,
    registries, shape arithmetic) and objects declared ``formula="<why not>"`` (a state
    container) are exempt, unless declared ``formula=True``.  Objects of packages without
    such declarations always need one."""
    try:
        from kfac_ref._support import requires_formula
    except ImportError:  # pragma: no cover - another package documented with this extension
        return True
    return requires_formula(obj)


def check_docstrings(model: ApiModel) -> tuple[list[str], list[str]]:
    """Return ``(problems, strict_problems)``.

    ``problems`` always fail the build: a public function or class without a docstring or
    without a formula.  ``strict_problems`` (a constant without a docstring, a public method
    or property without one) fail it only with ``kfac_api_strict = True``.
    """
    problems = []
    strict = []
    for entry in model.entries.values():
        full = entry.fullname
        if entry.kind == "data":
            # The constant may be defined in a private module and re-exported.
            if not _doc_of(entry).strip():
                strict.append(
                    f"{full}: public constant without a docstring (put a string "
                    "literal right after the assignment)"
                )
            continue
        doc = inspect.getdoc(entry.obj) or ""
        if not doc.strip():
            problems.append(f"{full}: public {entry.kind} without a docstring")
            continue
        if (entry.kind in ("function", "class") and not _has_formula(doc)
                and _formula_required(entry.obj)):
            problems.append(
                f"{full}: docstring has no formula (no '.. math::' block and no ':math:' "
                "role); an object that computes nothing says so in its @capabilities "
                "declaration (array_free=True, or formula='<why not>')"
            )
        if entry.kind in ("class", "exception"):
            for attr, value in vars(entry.obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(value, property):
                    doc = inspect.getdoc(value)
                elif inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod)):
                    # Through the class, so that a docstring of the overridden base-class
                    # method counts (inspect.getdoc follows the MRO).
                    doc = inspect.getdoc(getattr(entry.obj, attr))
                else:
                    continue
                if not (doc or "").strip():
                    strict.append(f"{full}.{attr}: public method or property without a docstring")
    return problems, strict


# --------------------------------------------------------------------------------------
# Page generation
# --------------------------------------------------------------------------------------
def _title(text: str, char: str = "=") -> str:
    return f"{text}\n{char * len(text)}\n"


_DIRECTIVE = {
    "function": "autofunction",
    "class": "autoclass",
    "exception": "autoexception",
    "data": "autodata",
}


def _object_page(entry: Entry) -> str:
    lines = [
        (
            ":html_theme.sidebar_secondary.remove: true\n"
            if entry.kind in ("function", "data")
            else ""
        ),
        _title(entry.name),
        f".. currentmodule:: {entry.module}\n",
        f".. {_DIRECTIVE[entry.kind]}:: {entry.name}",
    ]
    if entry.kind == "class":
        # Every public member, inherited ones included, so that a reference such as
        # :meth:`update_cov` on a subclass page resolves.
        lines.append("   :members:")
        lines.append("   :undoc-members:")
        lines.append("   :inherited-members:")
        lines.append("   :show-inheritance:")
    elif entry.kind == "exception":
        lines.append("   :show-inheritance:")
    others = [m for m in entry.exported_by if m != entry.module]
    if others:
        names = ", ".join(f"``{m}.{entry.name}``" for m in others)
        lines.append(f"\nAlso exported as {names}.")
    return "\n".join(line for line in lines if line != "") + "\n"


_ROLE = re.compile(r":(?!math:)[\w:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")


def _summary(doc) -> str:
    """First paragraph of a docstring, with cross-reference roles made literal.

    The summary is shown on another module's page, where relative references of the
    original docstring would not resolve; ``:math:`` is kept.
    """
    doc = doc or ""
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    return _ROLE.sub(lambda m: f"``{m.group(1).split('.')[-1]}``", first)


def _link_table(rows) -> str:
    """A two-column list-table: a cross-reference and the object's summary line."""
    out = [".. list-table::", "   :widths: 35 65", ""]
    for ref, doc in rows:
        out.append(f"   * - {ref}")
        out.append(f"     - {_summary(doc) or '—'}")
    return "\n".join(out) + "\n"


def _module_page(mod_name, model: ApiModel) -> str:
    own = []
    reexported = []
    submodules = []
    for _name, entry in model.exports[mod_name]:
        if entry.kind == "module":
            submodules.append(entry.module)
        elif entry.module == mod_name:
            own.append(entry)
        else:
            reexported.append(entry)
    out = [
        _title(f"``{mod_name}``"),
        f".. automodule:: {mod_name}\n   :no-members:\n",
    ]
    groups = [
        ("Functions", [e for e in own if e.kind == "function"]),
        ("Classes", [e for e in own if e.kind == "class"]),
        ("Exceptions", [e for e in own if e.kind == "exception"]),
        ("Constants", [e for e in own if e.kind == "data"]),
    ]
    for heading, items in groups:
        if not items:
            continue
        out.append(_title(heading, "-"))
        out.append(f".. currentmodule:: {mod_name}\n")
        out.append(".. autosummary::\n")
        out.extend(f"   {e.name}" for e in items)
        out.append("")
    if reexported:
        out.append(_title("Re-exported names", "-"))
        out.append(
            f"These names are importable from ``{mod_name}`` and documented in the "
            "module that defines them.\n"
        )
        prefix = mod_name + "."
        out.append(
            _link_table(
                [
                    (f":obj:`{e.fullname.removeprefix(prefix)} <{e.fullname}>`", _doc_of(e))
                    for e in reexported
                ]
            )
        )
    if submodules:
        out.append(_title("Submodules", "-"))
        out.append(
            _link_table([(f":mod:`{m}`", importlib.import_module(m).__doc__) for m in submodules])
        )
    if own:
        out.append(".. toctree::\n   :hidden:\n")
        out.extend(f"   {e.fullname}" for e in own)
        out.append("")
    return "\n".join(out) + "\n"


def _modules_include(model: ApiModel) -> str:
    names = list(model.modules)
    out = [_link_table([(f":mod:`{m}`", model.modules[m].__doc__) for m in names])]
    out.append(".. toctree::\n   :hidden:\n")
    out.extend(f"   generated/{m}" for m in names)
    return "\n".join(out) + "\n"


def write_pages(model: ApiModel, outdir: Path) -> None:
    """Write the generated pages; rewrite only changed files, remove stale ones."""
    outdir.mkdir(parents=True, exist_ok=True)
    pages = {"modules.inc": _modules_include(model)}
    for mod_name in model.modules:
        pages[f"{mod_name}.rst"] = _module_page(mod_name, model)
    for entry in model.entries.values():
        pages[f"{entry.fullname}.rst"] = _object_page(entry)
    for path in outdir.iterdir():
        if path.is_file() and path.name not in pages:
            path.unlink()
    for name, text in pages.items():
        path = outdir / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------------------
# Sphinx glue
# --------------------------------------------------------------------------------------
def _logger():
    from sphinx.util import logging

    return logging.getLogger("kfac_apidoc")


def _warn(msg: str) -> None:
    _logger().warning(msg, type="kfac_apidoc", subtype="undocumented")


def _builder_inited(app):
    model = collect(
        app.config.kfac_api_modules, app.config.kfac_api_packages, app.config.kfac_api_autodiscover
    )
    problems, strict = check_docstrings(model)
    for problem in model.problems + problems:
        _warn(problem)
    for problem in strict:
        if app.config.kfac_api_strict:
            _warn(problem)
        else:
            _logger().info(f"kfac_apidoc (not enforced, kfac_api_strict = False): {problem}")
    write_pages(model, Path(app.srcdir) / GENERATED)
    app.kfac_api_model = model
    app.kfac_api_aliases = {
        f"{module}.{entry.name}": entry.fullname
        for entry in model.entries.values()
        for module in entry.exported_by
        if module != entry.module
    }


def _missing_reference(app, env, node, contnode):
    """Resolve references to re-exported, relative and private names.

    ``kfac_ref.factors.X`` (a re-export) resolves to the page of ``kfac_ref.factors.X``
    where it is documented; ``Layer.rvjp`` resolves when exactly one documented object's
    full name ends with it.  A reference to a private object (a dotted component starting
    with ``_``), which the reference deliberately does not document, is rendered as plain
    code instead of failing the nitpicky build.
    """
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    aliases = getattr(app, "kfac_api_aliases", {})
    canonical = aliases.get(target)
    if canonical is None:
        # A member of a re-exported class: kfac_ref.factors.X.method.
        head, _, tail = target.rpartition(".")
        if head in aliases:
            canonical = f"{aliases[head]}.{tail}"
    domain = env.get_domain("py")
    if canonical is None and target and not target.startswith("kfac_ref"):
        # A name relative to another module of the package (``Layer.rvjp`` written in
        # kfac_ref.nn for kfac_ref.nn.Layer.rvjp): resolve it when exactly
        # one documented object ends with it.
        matches = [name for name in domain.objects if name.endswith("." + target)]
        if len(matches) == 1:
            canonical = matches[0]
    if canonical is not None:
        return domain.resolve_xref(
            env, node["refdoc"], app.builder, node["reftype"], canonical, node, contnode
        )
    if any(part.startswith("_") and not part.startswith("__") for part in target.split(".")):
        return contnode
    return None


def _check_consistency(app, env):
    model = getattr(app, "kfac_api_model", None)
    if model is None:
        return
    objects = env.get_domain("py").objects
    for entry in model.entries.values():
        if entry.fullname not in objects:
            _warn(f"{entry.fullname}: public object has no entry in the rendered API reference")
    for mod_name in model.modules:
        if mod_name not in objects:
            _warn(f"{mod_name}: module has no entry in the rendered API reference")


def setup(app):
    app.add_config_value("kfac_api_modules", [], "env")
    app.add_config_value("kfac_api_packages", [], "env")
    app.add_config_value("kfac_api_strict", False, "env")
    app.add_config_value("kfac_api_autodiscover", True, "env")
    # Before autosummary (priority 500) so that its tables see the generated pages.
    app.connect("builder-inited", _builder_inited, priority=400)
    app.connect("env-check-consistency", _check_consistency)
    app.connect("missing-reference", _missing_reference)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}


# --------------------------------------------------------------------------------------
# Standalone check
# --------------------------------------------------------------------------------------
def _standalone(argv) -> int:
    docs = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(docs.parent))
    namespace: dict = {"__file__": str(docs / "conf.py")}
    cwd = os.getcwd()
    try:
        os.chdir(docs)
        exec(compile((docs / "conf.py").read_text(), str(docs / "conf.py"), "exec"), namespace)
    finally:
        os.chdir(cwd)
    model = collect(
        namespace["kfac_api_modules"],
        namespace["kfac_api_packages"],
        namespace.get("kfac_api_autodiscover", True),
    )
    problems, strict = check_docstrings(model)
    problems = model.problems + problems
    enforce_strict = namespace.get("kfac_api_strict", False) or "--strict" in argv
    for problem in problems:
        print(f"kfac_apidoc: {problem}")
    for problem in strict:
        tag = "" if enforce_strict else " (not enforced)"
        print(f"kfac_apidoc{tag}: {problem}")
    failing = len(problems) + (len(strict) if enforce_strict else 0)
    print(
        f"kfac_apidoc: {len(model.entries)} public objects in {len(model.modules)} modules, "
        f"{len(problems)} problem(s), {len(strict)} strict-mode problem(s)"
        + ("" if enforce_strict else " (not enforced)")
    )
    return 1 if failing else 0


if __name__ == "__main__":
    raise SystemExit(_standalone(sys.argv[1:]))
