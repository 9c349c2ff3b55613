"""Backend support declared at the definition (the ``@capabilities`` decorator of
``kfac_ref._support``): the table of :mod:`kfac_ref.capabilities`, the docs page and the API
pages are read from the decorators; nothing rewrites a docstring at import; the docs build
requires a formula only where the declaration says the object computes something."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import sys
import textwrap

import pytest

from kfac_ref import capabilities
from kfac_ref._support import DEFAULT, declared_support, requires_formula
from kfac_ref._support import capabilities as declare

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS_EXT = ROOT / "docs" / "_ext"


def _unwrap(obj):
    while "__wrapped__" in getattr(obj, "__dict__", {}):
        obj = obj.__dict__["__wrapped__"]
    return obj


def _public_objects():
    return sorted(capabilities._canonical_names().values(), key=lambda e: e[0])


# -- the decorator -------------------------------------------------------------------------
def test_decorator_records_support_and_returns_the_object_unchanged():
    def f(x):
        """Doc."""
        return x

    g = declare(jit="yes", dask=("no", "a reason"))(f)
    assert g is f and f.__doc__ == "Doc."
    sup = declared_support(f)
    assert sup.state("numpy") == "yes" and sup.state("jit") == "yes"
    assert sup.state("dask") == "no" and sup.reasons == {"dask": "a reason"}
    assert sup.state("vmap") == "untested"


def test_array_free_marks_every_eager_column_not_applicable():
    @declare(array_free=True)
    def f():
        """Doc."""

    sup = declared_support(f)
    assert [sup.state(c) for c in capabilities.EAGER_BACKENDS] == ["n/a"] * 5
    assert sup.state("jit") == "untested"


@pytest.mark.parametrize("kwargs, match", [
    ({"jit": "no"}, r"needs a reason"),
    ({"jit": ("yes", "why")}, r"a tuple is \('no', reason\)"),
    ({"jitt": "yes"}, r"unknown column 'jitt'"),
    ({"jit": "maybe"}, r"state of 'jit' must be one of"),
    ({"formula": False}, r"say why it computes nothing"),
])
def test_bad_declarations_are_refused_at_the_definition(kwargs, match):
    with pytest.raises(ValueError, match=match):
        declare(**kwargs)


def test_a_declaration_is_the_class_own_not_inherited():
    @declare(jit="yes", dask="yes")
    class Base:
        """Doc."""

    class Sub(Base):
        """Doc."""

    assert declared_support(Base).state("jit") == "yes"
    assert declared_support(Sub) is DEFAULT
    with pytest.raises(ValueError, match="declared twice"):
        declare(jit="yes")(Base)


def test_formula_rule_follows_the_declaration():
    @declare(array_free=True)
    def options():
        """Doc."""

    @declare(array_free=True, formula=True)
    def shape_arithmetic():
        """Doc."""

    @declare(formula="a state container")
    class State:
        """Doc."""

    def undeclared():
        """Doc."""

    assert not requires_formula(options)
    assert requires_formula(shape_arithmetic)
    assert not requires_formula(State)
    assert requires_formula(undeclared)


# -- the table is the decorators -----------------------------------------------------------
def test_table_rows_are_the_declarations_on_the_objects():
    table = capabilities.support_table()
    objects = _public_objects()
    assert [d for d, _ in objects] == sorted(table)
    for dotted, obj in objects:
        assert table[dotted] == declared_support(obj), dotted
        assert capabilities.support_of(obj) == table[dotted]
    assert capabilities._unknown_declarations() == []
    assert not hasattr(capabilities, "_DECLARED")  # no table of names beside the objects


def test_no_dotted_name_strings_declare_support():
    """Declarations are decorators on the definitions, not strings naming the objects."""
    names = set(capabilities.support_table())
    names |= {n.removeprefix("kfac_ref.") for n in names if n.count(".") >= 2}
    for path in sorted((ROOT / "kfac_ref").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        named = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                 and isinstance(n.value, str) and n.value in names]
        assert named == [], path


def test_a_declaration_on_a_private_object_is_reported():
    mod = importlib.import_module("kfac_ref.linalg")

    @declare(jit="yes")
    def _helper():
        """Doc."""

    _helper.__module__ = mod.__name__
    try:
        assert capabilities._unknown_declarations() == ["kfac_ref.linalg." + _helper.__qualname__]
    finally:
        from kfac_ref import _support

        _support._DECLARED.remove(_helper)


# -- the docs read the same declarations ----------------------------------------------------
@pytest.fixture(scope="module")
def docs_ext():
    pytest.importorskip("sphinx")
    sys.path.insert(0, str(DOCS_EXT))
    try:
        yield importlib.import_module("kfac_support"), importlib.import_module("kfac_apidoc")
    finally:
        sys.path.remove(str(DOCS_EXT))


def test_docs_table_agrees_with_the_declarations(docs_ext):
    kfac_support, _ = docs_ext
    rows = {}
    lines = kfac_support._rst(capabilities.support_table(), capabilities.COLUMNS)
    ncol = len(capabilities.COLUMNS)
    for i, line in enumerate(lines):
        if line.startswith("   * - :py:obj:`~"):
            name = line.split("~", 1)[1].rstrip("`")
            rows[name] = [c.removeprefix("     - ") for c in lines[i + 1:i + 1 + ncol]]
    objects = _public_objects()
    assert set(rows) == {d for d, _ in objects}
    cell = {"yes": "yes", "untested": "–", "n/a": "n/a"}
    for dotted, obj in objects:
        sup = declared_support(obj)
        expected = [f"no ({sup.reasons[c]})" if sup.state(c) == "no" else cell[sup.state(c)]
                    for c in capabilities.COLUMNS]
        assert rows[dotted] == expected, dotted


def _row_states(lines):
    """Column -> state as an API page's support lines state them."""
    states = {}
    for line in lines:
        head, _, rest = line.partition(": ")
        kind = {"Supported and tested": "yes", "Not tested": "untested",
                "Not supported": "no"}.get(head)
        if kind == "no":
            states[rest.split(" (", 1)[0]] = "no"
        elif kind:
            for col in rest.rstrip(".").split(", "):
                states[col.removesuffix(" (on a CUDA GPU)")] = kind
    return states


def test_every_api_page_gets_its_support_row(docs_ext):
    """The API pages document each function and class under the name the table uses, so
    the build-time hook appends every object's row (and only to functions and classes)."""
    kfac_support, kfac_apidoc = docs_ext
    sys.path.insert(0, str(ROOT / "docs"))
    namespace = {"__file__": str(ROOT / "docs" / "conf.py")}
    conf = (ROOT / "docs" / "conf.py").read_text(encoding="utf-8")
    cwd = pathlib.Path.cwd()
    try:
        import os

        os.chdir(ROOT / "docs")
        exec(compile(conf, "conf.py", "exec"), namespace)
    finally:
        os.chdir(cwd)
        sys.path.remove(str(ROOT / "docs"))
    model = kfac_apidoc.collect(namespace["kfac_api_modules"], namespace["kfac_api_packages"])
    documented = {e.fullname: e for e in model.entries.values()
                  if e.kind in ("function", "class")}
    table = capabilities.support_table()
    assert set(documented) >= set(table)  # and the aliases (NaiveFullFactor) besides
    for name, entry in documented.items():
        lines = ["Doc."]
        kfac_support._append_support_row(None, entry.kind, name, entry.obj, {}, lines)
        expected = table[name] if name in table else capabilities.support_of(entry.obj)
        assert lines[1:4] == ["", ".. rubric:: Backend support", ""], name
        assert lines[-1] == "See the docs page *Backend support*.", name
        assert _row_states(lines[4:-1]) == {c: expected.state(c) for c in capabilities.COLUMNS
                                            if expected.state(c) != "n/a"}, name
        assert ("Takes no arrays: any array library." in lines) == any(
            expected.state(c) == "n/a" for c in capabilities.COLUMNS), name
        for col in capabilities.COLUMNS:
            if expected.state(col) == "no":
                assert f"Not supported: {col} ({expected.reasons[col]})." in lines, name
    lines = ["Doc."]
    kfac_support._append_support_row(None, "method", "kfac_ref.linalg.kron.x", None, {}, lines)
    assert lines == ["Doc."]


def test_formula_check_exempts_only_declared_non_computing_objects(docs_ext):
    _, kfac_apidoc = docs_ext
    objects = dict(_public_objects())
    exempt = sorted(d for d, o in objects.items() if not kfac_apidoc._formula_required(o))
    # objects that take no arrays, and the state containers and re-arrangements that say so
    assert "kfac_ref.linalg.compute_cov" not in exempt
    for dotted in exempt:
        sup = declared_support(objects[dotted])
        array_free = all(sup.state(c) == "n/a" for c in capabilities.EAGER_BACKENDS)
        assert array_free or "__kfac_formula__" in vars(_unwrap(objects[dotted])), dotted

    def computes(x):
        """Returns the mean of x (no formula)."""

    entry = kfac_apidoc.Entry("kfac_ref.linalg", "computes", computes, "function")
    model = kfac_apidoc.ApiModel({}, {("kfac_ref.linalg", "computes"): entry}, {}, [])
    problems, _ = kfac_apidoc.check_docstrings(model)
    assert len(problems) == 1 and "has no formula" in problems[0]
    declare(array_free=True)(computes)
    assert kfac_apidoc.check_docstrings(model)[0] == []


# -- no docstring is rewritten at import -----------------------------------------------------
def _source_docstring(obj):
    obj = _unwrap(obj)
    source = textwrap.dedent(inspect.getsource(obj))
    node = ast.parse(source).body[0]
    return ast.get_docstring(node, clean=False)


def test_docstrings_are_the_source_docstrings_after_import():
    """Every public docstring after ``import kfac_ref`` (and after reading the support
    table) is the string literal of its definition: nothing appends a support row."""
    capabilities.support_table()
    for dotted, obj in _public_objects():
        src = _source_docstring(obj)
        assert obj.__doc__ == src, dotted
        assert "Backend support" not in (obj.__doc__ or ""), dotted


def _outside_class_bodies(tree):
    """The nodes of ``tree`` except the statements of class bodies (a class body may give a
    method its docstring at the definition, e.g. ``f.__doc__ = Base.f.__doc__``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.ClassDef):
            children = [c for c in children if c not in node.body]
        stack.extend(children)


def test_no_module_assigns_a_docstring():
    """No code that runs after a definition (module level, a function) sets a
    ``__doc__``: no import-time docstring rewriting."""
    offenders = []
    for path in sorted((ROOT / "kfac_ref").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _outside_class_bodies(tree):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            if any(isinstance(t, ast.Attribute) and t.attr == "__doc__" for t in targets):
                offenders.append(f"{path.name}:{node.lineno}")
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value == "__doc__"):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []
