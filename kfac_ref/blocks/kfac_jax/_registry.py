r"""Which block a :mod:`kfac_ref.nn` layer gets: a registry of layer kind → named blocks.

:class:`kfac_ref.curvature.BlockDiagonalCurvature` reads it; a new block family registers
itself here (one line in its module) and needs no change to the estimator.
"""

from __future__ import annotations

from ..._backend import KFACTypeError, KFACValueError, check_bool, describe
from ..._support import capabilities
from ._base import CurvatureBlock

_REGISTRY: dict[str, dict[str, type]] = {}
_DEFAULTS: dict[str, str] = {}


@capabilities(array_free=True)
def register_layer_block(kind, approximation, block_class, *, default=False):
    r"""Register ``block_class`` as the block named ``approximation`` for layers of ``kind``.

    ``block_class`` must be a :class:`~kfac_ref.blocks.kfac_jax.CurvatureBlock` subclass; the
    estimator builds it with its ``from_layer`` classmethod.  ``default=True`` makes it the
    block of ``kind`` when ``layer_to_block`` names none.  Registering a name again replaces
    the entry.  Returns ``block_class`` (usable as a class decorator through
    ``functools.partial``).
    """
    func = "register_layer_block"
    for name, v in (("kind", kind), ("approximation", approximation)):
        if not isinstance(v, str) or not v:
            raise KFACTypeError(f"{func}: {name} must be a non-empty str; got {describe(v)}.")
    if not (isinstance(block_class, type) and issubclass(block_class, CurvatureBlock)):
        raise KFACTypeError(f"{func}: block_class must be a CurvatureBlock subclass; got "
                            f"{describe(block_class)}.")
    _REGISTRY.setdefault(kind, {})[approximation] = block_class
    if check_bool(func, "default", default):
        _DEFAULTS[kind] = approximation
    return block_class


@capabilities(array_free=True)
def layer_block(kind, approximation=None):
    r"""The block class registered for ``kind`` under ``approximation`` (the default when
    None).

    Raises
    ------
    KFACValueError
        Nothing registered under that name (the message lists what is).
    """
    name = _DEFAULTS.get(kind) if approximation is None else approximation
    found = _REGISTRY.get(kind, {}).get(name)
    if found is None:
        raise KFACValueError(
            f"layer_block: approximation must be one registered for layer kind {kind!r} "
            f"({', '.join(repr(k) for k in _REGISTRY.get(kind, {})) or 'none'}); got "
            f"{approximation!r}.")
    return found


@capabilities(array_free=True)
def registered_layer_blocks():
    """A copy of the registry: ``{kind: {approximation: block class}}``."""
    return {k: dict(v) for k, v in _REGISTRY.items()}


@capabilities(array_free=True)
def default_layer_to_block():
    r"""The default layer-kind → block-class map (kfac-jax's defaults).

    .. math::

        \text{dense} \mapsto A\otimes G,\quad \text{conv2d} \mapsto |T|\,\Omega\otimes\Gamma,
        \quad \text{scale\_and\_shift},\ \text{embedding} \mapsto \text{diagonal}.

    ``{"dense": DenseTwoKroneckerFactored, "conv2d": Conv2DTwoKroneckerFactored,
    "scale_and_shift": ScaleAndShiftDiagonal, "embedding": NaiveDiagonal}`` (kfac-jax maps
    its "generic" tag to ``NaiveDiagonal``; here it is fed per-example gradients, so it is the
    exact diagonal of the per-example second moment).
    """
    return {kind: _REGISTRY[kind][name] for kind, name in _DEFAULTS.items()}
