r"""kfac_ref's state classes as JAX pytrees, registered without importing JAX at import time.

A state (:class:`~kfac_ref.blocks.kfac_jax.BlockState`,
:class:`~kfac_ref.curvature.BlockDiagonalState`,
:class:`~kfac_ref.curvature.ExplicitState`,
:class:`~kfac_ref.averaging.WeightedMovingAverage`, :class:`~kfac_ref.optim.OptimizerState`
and its :class:`~kfac_ref.optim.StepStats`) is a JAX pytree once
:func:`register_jax_pytrees` has run, so it can be passed into, returned from and closed over
by ``jax.jit`` (and ``jax.tree_util`` maps over its arrays).  Registration is lazy: each state
class declares here how it splits into arrays and static data
(:func:`state_class`); JAX itself is imported only by :func:`register_jax_pytrees`, which
runs

* when ``kfac_ref.curvature`` is imported after JAX was (``"jax" in sys.modules``),
* when an ``init`` (a block's or an estimator's) receives a JAX array
  (:func:`ensure_for`), which is how every JAX state is born,
* or when the user calls it (e.g. before ``jax.tree_util.tree_map(jnp.asarray, state)`` on a
  state built from NumPy arrays).

The split of a state's nested containers (tuples, lists, mappings such as the read-only
cache snapshot) is: every array is a leaf (traced under ``jax.jit``), everything else —
Python numbers, booleans, ``None``, strings: the declared powers, the scale of a block, a
Python-number damping — is static (part of the tree's structure, so a jitted function is
compiled again when one of them changes); a state that JAX rebuilt (the result of a
jitted function or of ``jax.tree_util.tree_map``) keeps the structure it was rebuilt with,
whatever its leaves now hold.  The weight :math:`W` of a
:class:`~kfac_ref.averaging.WeightedMovingAverage` is a leaf even as a Python number, so a
jitted step with ``ema_old < 1`` compiles once while :math:`W` changes.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import MappingProxyType

from ._support import capabilities
from .averaging import WeightedMovingAverage

__all__ = ["register_jax_pytrees", "state_class", "ensure_for", "split", "join", "frozen"]

_CLASSES: dict[type, tuple] = {}   # class -> (flatten, unflatten), in declaration order
_REGISTERED: set[type] = set()
_LEAF = "<array>"
_REBUILT_FROM = "_pytree_rebuilt_from"  # (children, aux) of a state JAX rebuilt


def state_class(cls, flatten, unflatten):
    """Declare ``cls`` a pytree with ``flatten(obj) -> (children, aux)`` and
    ``unflatten(aux, children) -> obj``; registered with JAX now if JAX pytrees are on.

    A state that JAX rebuilt remembers the children and static data it was rebuilt from and
    flattens to them again: which entries of a container are leaves is decided by value only
    for a state built by kfac_ref, so ``tree_map(lambda _: 0, state)`` (leaves that are
    Python numbers) keeps the state's structure, as it does for any JAX pytree.  States are
    frozen, so the remembered split stays the state's own.
    """
    def flatten_remembered(obj):
        remembered = obj.__dict__.get(_REBUILT_FROM)
        return flatten(obj) if remembered is None else remembered

    def unflatten_remembering(aux, children):
        children = tuple(children)
        obj = unflatten(aux, children)
        object.__setattr__(obj, _REBUILT_FROM, (children, aux))
        return obj

    _CLASSES[cls] = (flatten_remembered, unflatten_remembering)
    if _REGISTERED or "jax" in sys.modules:
        register_jax_pytrees()
    return cls


@capabilities(array_free=True)
def register_jax_pytrees():
    r"""Register kfac_ref's state classes as JAX pytrees (idempotent; imports JAX).

    After this call every block state, estimator state, optimiser state and weighted
    moving average can
    cross a ``jax.jit`` boundary (argument, result or closure) and be mapped over with
    ``jax.tree_util``.  kfac_ref calls it itself when a block's or an estimator's ``init``
    receives a JAX array, and when it is imported after JAX; a user calls it to map over
    a state built from another library's arrays.  Arrays are the leaves; Python numbers,
    booleans, ``None`` and strings inside a state (declared powers, a block's scale, a
    Python-number damping) are static, except the weight of a moving average, which is a
    leaf.

    Returns
    -------
    tuple of type
        The classes registered (all of them, including earlier calls').
    """
    import jax

    for cls, (flatten, unflatten) in _CLASSES.items():
        if cls not in _REGISTERED:
            jax.tree_util.register_pytree_node(cls, flatten, unflatten)
            _REGISTERED.add(cls)
    return tuple(_CLASSES)


def ensure_for(like):
    """Register the pytrees when ``like`` is a JAX array (JAX is then imported already)."""
    if len(_REGISTERED) < len(_CLASSES) and "jax" in sys.modules:
        jax = sys.modules["jax"]
        if isinstance(like, jax.Array) or isinstance(like, jax.core.Tracer):
            register_jax_pytrees()


# -- nested containers: arrays out, the rest kept as a hashable skeleton ----------------------
def split(obj):
    """``(leaves, skeleton)``: the arrays of a nested tuple/list/mapping in order, and a
    hashable description of the rest (:func:`join` rebuilds the object)."""
    leaves = []
    return leaves, _skeleton(obj, leaves)


def _skeleton(obj, leaves):
    if isinstance(obj, Mapping):
        kind = "proxy" if isinstance(obj, MappingProxyType) else "dict"
        return (kind, tuple((k, _skeleton(v, leaves)) for k, v in obj.items()))
    if isinstance(obj, (tuple, list)):
        return ("tuple" if isinstance(obj, tuple) else "list",
                tuple(_skeleton(v, leaves) for v in obj))
    if obj is None or isinstance(obj, (bool, int, float, str, complex)):
        return ("const", obj)
    # an array (concrete or traced), or whatever JAX put in a leaf's place while it maps
    # over a tree (None, object() sentinels): a leaf
    leaves.append(obj)
    return _LEAF


def join(skeleton, leaves):
    """Inverse of :func:`split`."""
    it = iter(leaves)
    return _build(skeleton, it)


def _build(sk, it):
    if sk == _LEAF:
        return next(it)
    kind, body = sk
    if kind == "const":
        return body
    if kind in ("dict", "proxy"):
        d = {k: _build(v, it) for k, v in body}
        return MappingProxyType(d) if kind == "proxy" else d
    items = [_build(v, it) for v in body]
    return tuple(items) if kind == "tuple" else items


def frozen(cls, **fields):
    """An instance of the frozen dataclass ``cls`` from ``fields``, without ``__init__``
    (an unflattened state holds whatever JAX put in its leaves: tracers, sentinels)."""
    obj = object.__new__(cls)
    for key, value in fields.items():
        object.__setattr__(obj, key, value)
    return obj


state_class(WeightedMovingAverage,
            lambda avg: ((avg.raw, avg.weight), None),
            lambda aux, children: frozen(WeightedMovingAverage, raw=children[0],
                                         weight=children[1]))
