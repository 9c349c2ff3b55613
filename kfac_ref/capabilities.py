r"""Declared capabilities: which backends, transformations and lazy arrays each public
function and class supports — declared on each object's definition, read here by the docs
and the tests.

Every public object of kfac_ref has a :class:`Support` with one state per column: "yes",
"no", "untested" or "n/a", for the columns numpy, array_api_strict, torch, jax, cupy, jit,
vmap and dask.

* **yes** — supported, and the test matrix exercises it (a test fails when a "yes" of an
  eager backend was not exercised by a full run of the suite on that backend's cells, and
  the ``jax.jit``/``jax.vmap``/Dask tests are generated from the "yes" entries);
* **no** — not supported, with the reason; calling it that way raises a clear
  :class:`~kfac_ref.KFACInputError` (tested);
* **untested** — may work, but nothing checks it;
* **n/a** — the object takes no arrays (shapes, options, registries, Python numbers), so
  the array library does not matter.

The eager columns are the array libraries (array-api-strict stands for "any library that
follows the standard", including its restricted devices and its float32-only device).  The
``cupy`` column is exercised only on a machine with a CUDA GPU.  ``jit`` is ``jax.jit`` of
the call with every array argument traced; ``vmap`` is ``jax.vmap`` over a leading batch
of independent problems; ``dask`` is a Dask array chunked along the batch axis, computed
chunk by chunk (value checks are skipped for lazy arrays, see :func:`kfac_ref.value_checks`).

Where it is declared: a decorator on the definition of each function and class (inside
kfac_ref, ``@capabilities(jit="yes", dask=("no", reason))``, ``@capabilities(array_free=True)``);
an object without one supports the eager libraries ("yes") and nothing else is tested.
:func:`support_table` collects the declarations of every public object; the docs page
*Backend support* shows all rows and each object's API page ends with its own row (added
when the docs are built: the docstrings themselves are not changed).
"""

from __future__ import annotations

import importlib
import pkgutil

from ._backend import KFACValueError, describe
from ._support import (
    COLUMNS,
    EAGER_BACKENDS,
    Support,
    capabilities,
    declared_objects,
    declared_support,
    unknown_name,
)

__all__ = ["COLUMNS", "EAGER_BACKENDS", "Support", "support_of", "support_table"]


def _public_modules():
    import kfac_ref

    yield kfac_ref
    for info in pkgutil.walk_packages(kfac_ref.__path__, "kfac_ref."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            yield importlib.import_module(info.name)


def _canonical_names() -> dict[int, tuple[str, object]]:
    """id(object) → (dotted name in its home module, object), for every public function and
    class: the one public module other than the top level whose ``__all__`` lists it (the
    module its docs page lives in); the top level for what only the top level exports."""
    found: dict[int, tuple[str, object]] = {}
    for mod in _public_modules():
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name, None)
            if not callable(obj) or isinstance(obj, type) and issubclass(obj, BaseException):
                continue
            dotted = f"{mod.__name__}.{name}"
            old = found.get(id(obj))
            # its home (a module other than the top level that exports it), under its own
            # name where it also has an alias there
            if (old is None or old[0].count(".") == 1 and dotted.count(".") > 1
                    or old[0].rsplit(".", 1)[0] == mod.__name__
                    and name == getattr(obj, "__name__", None)):
                found[id(obj)] = (dotted, obj)
    return found


_TABLE: dict[str, Support] | None = None


def _unwrapped(obj):
    seen = set()
    while id(obj) not in seen and getattr(obj, "__dict__", {}).get("__wrapped__") is not None:
        seen.add(id(obj))
        obj = obj.__dict__["__wrapped__"]
    return obj


@capabilities(array_free=True)
def support_table() -> dict[str, Support]:
    """Every public function and class, by the dotted name of its documentation page,
    with the :class:`Support` declared on its definition (the default, every eager array
    library and nothing else tested, where it declares none)."""
    global _TABLE
    if _TABLE is None:
        _TABLE = {dotted: declared_support(obj)
                  for dotted, obj in sorted(_canonical_names().values())}
    return _TABLE


def _unknown_declarations() -> list[str]:
    """Objects with a ``@capabilities`` declaration that are not public functions or
    classes (a private helper, an object no public module exports): their declaration
    would reach no table, docs page or test.  The test suite requires this to be empty."""
    public = {id(_unwrapped(obj)) for _, obj in _canonical_names().values()}
    return sorted(f"{obj.__module__}.{obj.__qualname__}" for obj in declared_objects()
                  if obj.__module__.partition(".")[0] == "kfac_ref"
                  and id(_unwrapped(obj)) not in public)


@capabilities(array_free=True)
def support_of(obj) -> Support:
    """The declared :class:`Support` of a public function or class (or of its dotted
    name): its row of :func:`support_table`."""
    table = support_table()
    if isinstance(obj, str):
        if obj not in table:
            raise unknown_name("support_of", "obj", obj, tuple(table),
                               "the dotted name of a public function or class of kfac_ref")
        return table[obj]
    entry = _canonical_names().get(id(obj))
    if entry is None:
        raise KFACValueError(f"support_of: obj must be a public function or class of kfac_ref "
                             f"or its dotted name; got {describe(obj)}.")
    return table[entry[0]]
