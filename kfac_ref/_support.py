"""Backend support declared at the definition: the :func:`capabilities` decorator.

Every public function and class of kfac_ref states, with a decorator on its definition,
what it supports beyond the default (every eager array library "yes", ``jit``, ``vmap``
and ``dask`` "untested")::

    @capabilities(jit="yes", dask=("no", "eigendecompositions: ..."))
    def damped_matpower(...): ...

    @capabilities(array_free=True)        # takes no arrays: every eager column is "n/a"
    def conv_padding_amounts(...): ...

The decorator records a :class:`Support` on the object (the attribute ``__kfac_support__``)
and returns the object itself: no wrapper, no change to ``__doc__``.  The public reader is
:mod:`kfac_ref.capabilities` (the table, one row per public object), which the docs page
*Backend support*, the per-object support rows of the API pages and the tests' generated
``jax.jit``/``jax.vmap``/Dask cases read.

``formula`` says whether the docs build requires a formula (``.. math::`` or ``:math:``)
in the object's docstring: by default yes, except for objects that take no arrays; a string
exempts an object that takes arrays but computes nothing (a state container), and says
why.

This module imports nothing from kfac_ref at import time, so that every module (the
validation layer included) can declare its objects without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

__all__ = ["COLUMNS", "DASK_NO_EIGH", "DEFAULT", "EAGER_BACKENDS", "Support", "capabilities",
           "declared_objects", "declared_support", "requires_formula"]

EAGER_BACKENDS = ("numpy", "array_api_strict", "torch", "jax", "cupy")
"""The array libraries of the eager columns."""

COLUMNS = EAGER_BACKENDS + ("jit", "vmap", "dask")
"""Every column of the support table, in order."""

STATES = ("yes", "no", "untested", "n/a")

ATTRIBUTE = "__kfac_support__"
_FORMULA_ATTRIBUTE = "__kfac_formula__"


@dataclass(frozen=True)
class Support:
    """The declared support of one public object: a state per column of
    :data:`COLUMNS`, with the reason of every "no".

    Attributes
    ----------
    states : dict
        Column name → ``"yes"``, ``"no"``, ``"untested"`` or ``"n/a"``.
    reasons : dict
        Column name → why it is ``"no"`` (shown in the docs and raised in the error).
    """

    states: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict)

    def __post_init__(self):
        for col, state in self.states.items():
            if col not in COLUMNS:
                raise ValueError(f"Support: unknown column {col!r}; the columns are {COLUMNS}.")
            if state not in STATES:
                raise ValueError(f"Support: state of {col!r} must be one of {STATES}; "
                                 f"got {state!r}.")
        for col in self.reasons:
            if self.states.get(col) != "no":
                raise ValueError(f"Support: a reason is given for {col!r}, which is not 'no'.")

    def state(self, column: str) -> str:
        """The state of ``column`` (``"untested"`` when not declared).

        Raises
        ------
        KFACValueError
            When ``column`` is not one of :data:`COLUMNS` (a misspelt backend would
            otherwise read as "untested").
        """
        if column not in COLUMNS:
            raise unknown_name("Support.state", "column", column, COLUMNS,
                               "a column of the support table (a backend or a transformation)")
        return self.states.get(column, "untested")

    def with_states(self, reasons=None, **states) -> Support:
        """A copy with the given columns set (and reasons for the ``"no"`` ones)."""
        return replace(self, states={**self.states, **states},
                       reasons={**self.reasons, **(reasons or {})})


DEFAULT = Support({b: "yes" for b in EAGER_BACKENDS})
"""The support of an object without a declaration: every eager array library (the suite
runs each test on every cell of the matrix: numpy, array-api-strict on three devices,
torch float64/float32, jax float64/float32, cupy where a GPU is present)."""

_DECLARED: list = []  # every decorated object, in definition order


def capabilities(*, array_free: bool = False, formula: bool | str | None = None, **columns):
    """Declare the backend support of the decorated function or class.

    Parameters
    ----------
    array_free : bool
        The object takes no arrays (shapes, options, registries, Python numbers): every
        eager column is "n/a", and its docstring needs no formula unless ``formula=True``.
    formula : bool, str or None
        Whether the docs build requires a formula in the docstring.  ``None`` (default):
        required unless ``array_free``; ``True``: required; a string: not required, and
        the string says why (the object takes arrays but computes nothing).
    **columns
        A column of :data:`COLUMNS` → ``"yes"``, ``"untested"``, ``"n/a"`` or
        ``("no", reason)``.  ``jit``, ``vmap`` and ``dask`` say "yes" only where the tests
        run the object that way (tests/test_jit.py, tests/test_transforms.py,
        tests/test_dask.py read these declarations).

    The decorator records the :class:`Support` (the default with the given columns) on the
    object and returns the object unchanged.
    """
    states = {b: "n/a" for b in EAGER_BACKENDS} if array_free else {}
    reasons = {}
    for col, value in columns.items():
        if isinstance(value, tuple):
            if len(value) != 2 or value[0] != "no":
                raise ValueError(f"capabilities: {col}={value!r}: a tuple is ('no', reason).")
            states[col], reasons[col] = value
        else:
            if value == "no":
                raise ValueError(f"capabilities: {col}='no' needs a reason: ('no', reason).")
            states[col] = value
    if formula is False or formula == "":
        raise ValueError("capabilities: formula=<reason> exempts an object from the "
                         "formula rule; say why it computes nothing.")
    support = DEFAULT.with_states(reasons, **states)
    needs_formula = not array_free if formula is None else formula is True

    def decorate(obj):
        if ATTRIBUTE in getattr(obj, "__dict__", {}):
            raise ValueError(f"capabilities: {obj.__qualname__} is declared twice.")
        setattr(obj, ATTRIBUTE, support)
        setattr(obj, _FORMULA_ATTRIBUTE, needs_formula)
        _DECLARED.append(obj)
        return obj

    return decorate


def _own(obj, attribute):
    """``obj``'s own value of ``attribute`` (not a base class's), through wrappers made
    with :func:`functools.wraps`."""
    seen = set()
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        own = getattr(obj, "__dict__", None) or {}
        if attribute in own:
            return own[attribute]
        obj = own.get("__wrapped__")
    return None


def declared_support(obj) -> Support:
    """The :class:`Support` declared on ``obj`` (a class's own, never its base class's),
    or :data:`DEFAULT` when it has none."""
    return _own(obj, ATTRIBUTE) or DEFAULT


def requires_formula(obj) -> bool:
    """Whether the docs build requires a formula in ``obj``'s docstring (see
    :func:`capabilities`); ``True`` for an undeclared object."""
    needs = _own(obj, _FORMULA_ATTRIBUTE)
    return True if needs is None else needs


def declared_objects() -> tuple:
    """Every object a :func:`capabilities` decorator was applied to (in the modules
    imported so far)."""
    return tuple(_DECLARED)


def unknown_name(func, name, value, known, expected):
    """The error for a name that is not in ``known``: the closest known names (by
    ``difflib``'s similarity ratio; for a dotted name in a known module, the closest names
    of that module) are suggested, and the known names are listed when they are few (for a
    dotted name without a close match, those of its module)."""
    import difflib

    from ._backend import KFACValueError  # here: _backend declares its objects with this module

    module, _, leaf = value.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if module and k.startswith(module + ".")}
    if siblings:  # a known module: the closest names in it, compared by their last part
        close = [siblings[c] for c in difflib.get_close_matches(leaf, siblings, n=3,
                                                                 cutoff=0.6)]
    else:
        close = difflib.get_close_matches(value, known, n=3, cutoff=0.6)
    hint = " Did you mean " + " or ".join(repr(c) for c in close) + "?" if close else ""
    if len(known) <= 12:
        hint += " The known names are " + ", ".join(repr(k) for k in known) + "."
    elif siblings and not close:
        hint += f" The names in {module} are " + ", ".join(sorted(siblings)) + "."
    elif not close:
        hint += " support_table() lists every name."
    return KFACValueError(f"{func}: {name} must be {expected}; got {value!r}.{hint}")


capabilities(array_free=True)(Support)

DASK_NO_EIGH = ("no", "eigendecompositions: the namespace of a Dask array has no linalg.eigh")
"""The "dask" declaration of what needs an eigendecomposition: Dask's array API namespace
has no ``linalg.eigh``, and the call raises :class:`~kfac_ref.KFACTypeError` naming it."""
