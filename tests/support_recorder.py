"""Which public objects the test run called, on which backend — the evidence behind the
"yes" entries of :mod:`kfac_ref.capabilities`.

At the start of the session every public function and class of kfac_ref is wrapped once
(every module attribute that exports it gets the same wrapper, so identities hold): a
call records ``(dotted name, backend)`` for the first array among its arguments, where the
backend is the array library (``numpy``, ``array_api_strict``, ``torch``, ``jax``,
``cupy``, ``dask``).  Calls made from inside kfac_ref count too; kfac_ref's own code calls
kernels, not public functions, so these are rare.  ``tests/test_zz_support_claims.py``
compares the record with the declarations at the end of a full run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil

import array_api_compat

CALLS: set[tuple[str, str]] = set()


def _backend(x):
    if array_api_compat.is_dask_array(x):
        return "dask"
    if array_api_compat.is_jax_array(x):
        return "jax"
    if array_api_compat.is_torch_array(x):
        return "torch"
    if array_api_compat.is_cupy_array(x):
        return "cupy"
    if array_api_compat.is_numpy_array(x):
        return "numpy"
    if array_api_compat.is_array_api_obj(x):
        ns = array_api_compat.array_namespace(x)
        if array_api_compat.is_array_api_strict_namespace(ns):
            return "array_api_strict"
    return None


def _first_backend(args, kwargs):
    stack = list(args) + list(kwargs.values())
    # arrays inside tuples, lists and dicts (params, vectors) and inside states (frozen
    # dataclasses: an estimator's state holds block states, which hold moving averages)
    for _ in range(6):
        nested = []
        for a in stack:
            b = _backend(a)
            if b is not None:
                return b
            if isinstance(a, (tuple, list)):
                nested.extend(a)
            elif isinstance(a, dict):
                nested.extend(a.values())
            elif dataclasses.is_dataclass(a) and not isinstance(a, type):
                nested.extend(getattr(a, f.name) for f in dataclasses.fields(a))
        stack = nested
    return None


def _wrap_function(dotted, fn):
    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        b = _first_backend(args, kwargs)
        if b is not None:
            CALLS.add((dotted, b))
        out = fn(*args, **kwargs)
        # a factory of a function of arrays (a forward-pass tap): the product's calls are
        # the factory's evidence, since the factory itself takes no arrays
        return _wrap_function(dotted, out) if inspect.isfunction(out) else out

    return recorded


def _wrap_method(names_of_class, method):
    @functools.wraps(method)
    def recorded(self, *args, **kwargs):
        name = names_of_class.get(type(self))
        b = _first_backend(args, kwargs)
        if name is not None and b is not None:
            CALLS.add((name, b))
        return method(self, *args, **kwargs)

    recorded._kfac_recorded = True
    return recorded


def _wrap_class(names_of_class, cls):
    """Record construction and every public method call with array arguments, under the
    class of ``self`` (so subclasses count as themselves; blocks are built from shapes and
    see arrays only in their methods)."""
    for attr, value in list(vars(cls).items()):
        if not (attr == "__init__" or not attr.startswith("_")):
            continue
        if inspect.isfunction(value) and not getattr(value, "_kfac_recorded", False):
            setattr(cls, attr, _wrap_method(names_of_class, value))


def install():
    """Wrap every public object; returns the dotted names that are recorded."""
    import kfac_ref
    from kfac_ref import capabilities

    names = {id(obj): (dotted, obj) for dotted, obj in capabilities._canonical_names().values()}
    classes = {obj: dotted for dotted, obj in names.values() if isinstance(obj, type)}
    for cls in classes:  # every class in the MRO that defines __init__ records its own type
        for base in cls.__mro__:
            if base.__module__.startswith("kfac_ref"):
                _wrap_class(classes, base)
    wrappers = {i: _wrap_function(d, o) for i, (d, o) in names.items()
                if not isinstance(o, type)}
    mods = [kfac_ref] + [importlib.import_module(m.name) for m in pkgutil.walk_packages(
        kfac_ref.__path__, "kfac_ref.")]
    for mod in mods:
        for attr, value in list(vars(mod).items()):
            w = wrappers.get(id(value))
            if w is not None:
                setattr(mod, attr, w)
    return {d for d, _ in names.values()}


_CELL_TO_COLUMN = {"numpy": "numpy", "strict": "array_api_strict", "torch-cpu": "torch",
                   "torch-cuda": "torch", "jax": "jax", "cupy": "cupy"}


def unexercised_claims(cells, calls):
    """The declared "yes" entries of eager backends among ``cells`` (the matrix cells that
    ran) that no call in ``calls`` exercised, sorted ``(name, column)`` pairs.  A base class
    counts as exercised through its public subclasses.  Used by
    ``tests/test_zz_support_claims.py`` and, under pytest-xdist, by the controller on the
    records of all workers merged (``tests/conftest.py``)."""
    from kfac_ref import capabilities

    ran = {_CELL_TO_COLUMN[c] for c in cells if c in _CELL_TO_COLUMN}
    calls = {tuple(c) for c in calls}
    objects = {name: obj for name, obj in capabilities._canonical_names().values()}
    inherited = set()
    for name, obj in objects.items():
        if inspect.isclass(obj):
            for sub_name, sub in objects.items():
                if inspect.isclass(sub) and sub is not obj and issubclass(sub, obj):
                    inherited |= {(name, b) for n, b in calls if n == sub_name}
    calls |= inherited
    return sorted(
        (name, col)
        for name, sup in capabilities.support_table().items()
        for col in capabilities.EAGER_BACKENDS
        if col in ran and sup.state(col) == "yes" and (name, col) not in calls
    )


def unexercised_message(missing):
    return (f"{len(missing)} declared 'yes' entries were not exercised by the suite (declare "
            f"them 'untested' or add a test): {missing[:40]}")
