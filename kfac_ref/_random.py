r"""The random sources of the sampling estimators: a NumPy Generator or a JAX PRNG key.

A :class:`numpy.random.Generator` draws on the host in float64 and the draws are moved to
the inputs' device (``kfac_ref._backend.host_draw``): one seed, the same numbers on every
backend.  A JAX PRNG key (``jax.random.key(0)`` or a legacy ``jax.random.PRNGKey(0)``,
concrete or traced) draws with :mod:`jax.random` in the inputs' dtype, so a jitted function
that takes the key as an argument draws new numbers on every call; these numbers are not
the Generator's (another generator, another algorithm), only their distribution is the same.

.. math::

    \text{noise} \sim \text{Gumbel}(0, 1),\ \text{Logistic}(0, 1),\
    \mathcal N(0, 1)\ \text{or Rademacher, elementwise.}
"""

from __future__ import annotations

import sys

import numpy as np  # host-side random draws only

from ._backend import KFACTypeError, describe, host_draw

__all__ = ["check_random_source", "is_jax_key", "draw_noise", "split_source"]

NOISE_KINDS = ("gumbel", "logistic", "normal", "rademacher")

_HOST = {
    "gumbel": lambda shape: lambda r: r.gumbel(size=shape),
    "logistic": lambda shape: lambda r: r.logistic(size=shape),
    "normal": lambda shape: lambda r: r.standard_normal(shape),
    "rademacher": lambda shape: lambda r: r.choice(np.array([-1.0, 1.0]), size=shape),
}


def is_jax_key(rng) -> bool:
    """Whether ``rng`` is a JAX PRNG key: a typed key array (``jax.random.key``) or a raw
    ``uint32[2]`` key (``jax.random.PRNGKey``), concrete or traced."""
    jax = sys.modules.get("jax")
    if jax is None or not isinstance(rng, (jax.Array, jax.core.Tracer)):
        return False
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return rng.shape == ()
    return rng.dtype == np.uint32 and tuple(rng.shape) == (2,)


def check_random_source(func, name, rng, like=None):
    """A :class:`numpy.random.Generator` or a JAX PRNG key, returned unchanged; a key only
    next to JAX arrays (``like``, when given)."""
    if isinstance(rng, np.random.Generator):
        return rng
    if is_jax_key(rng):
        jax = sys.modules["jax"]
        if like is not None and not isinstance(like, (jax.Array, jax.core.Tracer)):
            raise KFACTypeError(f"{func}: {name} must be a numpy.random.Generator for "
                                f"arrays that are not JAX arrays (a JAX key draws JAX "
                                f"arrays); got a JAX key next to {describe(like)}.")
        return rng
    raise KFACTypeError(f"{func}: {name} must be a numpy.random.Generator (e.g. "
                        f"numpy.random.default_rng(0)) or a JAX PRNG key (e.g. "
                        f"jax.random.key(0)); got {describe(rng)}.")


def split_source(rng, n):
    """``n`` sources for ``n`` successive draws: the Generator itself ``n`` times (its state
    moves on with each draw), or ``n`` independent keys from ``jax.random.split``."""
    if isinstance(rng, np.random.Generator):
        return [rng] * n
    keys = sys.modules["jax"].random.split(rng, n)
    return [keys[i] for i in range(n)]


def draw_noise(rng, like, kind, shape):
    """Elementwise noise of ``kind`` (:data:`NOISE_KINDS`) of ``shape`` in the namespace,
    device and dtype of ``like``: host draws (float64, then converted) from a Generator,
    :mod:`jax.random` draws in ``like``'s dtype from a JAX key."""
    shape = tuple(shape)
    if isinstance(rng, np.random.Generator):
        return host_draw(rng, like, _HOST[kind](shape))
    random = sys.modules["jax"].random
    if kind == "gumbel":
        return random.gumbel(rng, shape, dtype=like.dtype)
    if kind == "logistic":
        return random.logistic(rng, shape, dtype=like.dtype)
    if kind == "normal":
        return random.normal(rng, shape, dtype=like.dtype)
    return random.rademacher(rng, shape, dtype=like.dtype)
