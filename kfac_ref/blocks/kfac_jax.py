r"""kfac-jax-named curvature blocks with explicit, immutable state.

A block is built from parameter shapes and layer options (no tracing) and is stateless
itself: :meth:`CurvatureBlock.init` returns a :class:`BlockState`, and every update returns a
new state.  The products are the formula functions of :mod:`kfac_ref.blocks._math`:

.. math::

    \texttt{multiply\_matpower}(v) = (s\,B + \lambda I)^{p}\, v ,

with :math:`B` the unscaled block (Kronecker :math:`A \otimes G`, diagonal or full), :math:`s`
its scale (:meth:`~CurvatureBlock.scale`) and :math:`\lambda` the ``identity_weight``
(optionally multiplied by the block's norm, kfac-jax's ``norm_to_scale_identity_weight_per_block``).

``estimation_data``
-------------------
A mapping with the per-example, back-propagated quantities of one mini-batch (no ``1/N``:
gradients of the per-example loss terms, as DESIGN.md's canonical convention):

* ``"inputs"``: the layer input ``[N, d_in]`` (dense), ``[N, H, W, C]`` / ``[N, C, H, W]``
  (conv), ``[N, *feature]`` (scale-and-shift);
* ``"outputs_grad"``: the back-propagated vector at the layer output, same layout;
* ``"params_grads"``: for :class:`NaiveDiagonal` / :class:`NaiveFull` only, a sequence (one
  entry per parameter) of gradients of the *batch-summed* (sampled) loss, each shaped like
  its parameter or ``[S, *param_shape]`` for :math:`S` sources (Monte-Carlo samples).  They
  are not per-example gradients: an ``[N, *param_shape]`` array would be read as N sources,
  which turns the naive estimator into the sum-of-squares one.

The statistics come from :mod:`kfac_ref.factors`; they are averaged into the state with
kfac-jax's weighted moving average (``ema_old``, ``ema_new``;
:class:`kfac_ref.averaging.WeightedMovingAverage`).

Vectors
-------
A vector is a tuple of arrays, one per parameter, shaped like ``parameters_shapes`` (kernel
first, then bias/shift).  The flat order of :meth:`~CurvatureBlock.to_dense_matrix` is the
concatenation of the row-major flattened parameters in that order, which for dense and conv
layers is the row-major flattening of ``[W; b]`` (bias row last).  kfac-jax orders by pytree
leaf order instead (a Haiku ``{"b", "w"}`` dict puts the bias first): a documented permutation.

Caching, and how kfac-jax's cache fault is avoided
--------------------------------------------------
kfac-jax's estimator computes the per-block, norm-scaled identity weight in
``update_cache`` and then passes the *unscaled* weight to the block, so cached inverses are
built for a different damping than uncached ones (PEERS.md).  Here both paths call one
method, :meth:`CurvatureBlock.effective_identity_weight`; the cache stores the statistics
snapshot it was built from (scale, norm, eigendecompositions, damped factor powers *with the
weight they were built for*), and the cached product runs the same ``_apply`` code as the
uncached one.  A cached product asked for a baked-in weight other than the one cached raises
:class:`~kfac_ref.KFACValueError` (``strict_cache=False`` reproduces kfac-jax, which silently
uses the cached weight).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_int,
    check_option,
    check_scalar,
    describe,
    eye_like,
    namespace_of,
    ones_like_shape,
    zeros_like_shape,
)
from ..averaging import WeightedMovingAverage
from ..linalg import FACTOR_NORMS, append_homog, clipped_eigh, compute_cov, factor_norm, kron
from . import _math as M

__all__ = [
    "BlockState",
    "CurvatureBlock",
    "ScaledIdentity",
    "Diagonal",
    "Full",
    "TwoKroneckerFactored",
    "NaiveDiagonal",
    "NaiveFull",
    "DenseDiagonal",
    "DenseFull",
    "DenseTwoKroneckerFactored",
    "Conv2DDiagonal",
    "Conv2DFull",
    "Conv2DTwoKroneckerFactored",
    "ScaleAndShiftDiagonal",
    "ScaleAndShiftFull",
]

KFAC_JAX_APPROX_POWERS = (-1.0, -0.5, 0.5, 1.0)
"""Powers kfac-jax's Kronecker blocks compute approximately (π-damped factors)."""


def _factors():
    # Imported lazily: kfac_ref.factors sits below blocks in the dependency order but is
    # written concurrently; a lazy import keeps this module importable on its own.
    from .. import factors

    return factors


# --------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockState:
    r"""Immutable state of a curvature block.

    .. math::

        \text{statistics}_i = \text{WeightedMovingAverage of the block's statistics},

    Attributes
    ----------
    statistics : tuple of WeightedMovingAverage
        Kronecker blocks: ``(A, G)`` (kfac-jax ``factors``); diagonal blocks: one diagonal per
        parameter (``diagonal_factors``); full blocks: ``(matrix,)``; scaled identity: ``()``.
    cache : Mapping
        Read-only snapshot written by :meth:`CurvatureBlock.update_cache` (see the module
        docstring); empty until then.
    like : array
        A 0-D array fixing the namespace, device and dtype of the block.
    """

    statistics: tuple
    cache: Mapping = field(default_factory=lambda: MappingProxyType({}))
    like: Any = None

    @property
    def factors(self):
        """kfac-jax's name for the Kronecker factors' averages."""
        return self.statistics

    @property
    def diagonal_factors(self):
        """kfac-jax's name for the diagonal blocks' averages."""
        return self.statistics

    @property
    def matrix(self):
        """kfac-jax's name for the full block's average."""
        return self.statistics[0]


def _powers_set(func, name, powers):
    if powers is None:
        return ()
    if isinstance(powers, (int, float)) and not isinstance(powers, bool):
        powers = (powers,)
    if not isinstance(powers, Sequence):
        raise KFACTypeError(f"{func}: {name} must be a number, a sequence of numbers or None; "
                            f"got {describe(powers)}.")
    return tuple(sorted({check_scalar(func, name, p) for p in powers}))


def _check_norm(func, norm_type):
    if norm_type is None or norm_type == "none":
        return None
    return check_option(func, "norm_to_scale_identity_weight", norm_type,
                        (*FACTOR_NORMS, "none"))


# --------------------------------------------------------------------------------------
# Base class
# --------------------------------------------------------------------------------------
class CurvatureBlock:
    r"""Base class: a curvature block over a group of parameters, kfac-jax API.

    .. math::

        \texttt{multiply\_matpower}(v) = (s\,B + \lambda I)^{p} v,\quad
        s = \texttt{fixed\_scale} \cdot \texttt{state\_dependent\_scale},\quad
        \lambda = w \cdot \|s B\|_{\text{norm}} \ \text{(or } w\text{)}.

    Parameters
    ----------
    parameters_shapes : sequence of tuple of int
        Shapes of the block's parameters, in vector order.
    name : str, optional
    eigenvalue_clipping_threshold : float
        Eigenvalues are clipped below at this value before powers (kfac-jax ``safe_psd_eigh``
        clips at 0).
    strict_cache : bool
        Raise when a cached product is asked for an identity weight other than the one it was
        cached with (default); ``False`` uses the cached weight as kfac-jax does.
    """

    _kind = "abstract"

    def __init__(self, parameters_shapes, *, name=None, eigenvalue_clipping_threshold=0.0,
                 strict_cache=True):
        func = type(self).__name__
        if not isinstance(parameters_shapes, Sequence) or not parameters_shapes:
            raise KFACTypeError(f"{func}: parameters_shapes must be a non-empty sequence of "
                                f"shapes; got {describe(parameters_shapes)}.")
        shapes = []
        for s in parameters_shapes:
            if not isinstance(s, Sequence) or isinstance(s, str):
                raise KFACTypeError(f"{func}: parameters_shapes entries must be sequences of "
                                    f"int; got {describe(s)}.")
            shapes.append(tuple(check_int(func, "parameters_shapes entry", d, minimum=1)
                                for d in s))
        self.parameters_shapes = tuple(shapes)
        self.name = name if name is not None else func
        self.eigenvalue_clipping_threshold = check_scalar(
            func, "eigenvalue_clipping_threshold", eigenvalue_clipping_threshold)
        self.strict_cache = bool(strict_cache)

    # -- sizes and scales ----------------------------------------------------------------
    @property
    def number_of_parameters(self):
        """Number of parameter arrays."""
        return len(self.parameters_shapes)

    @property
    def dim(self):
        r"""Number of scalar parameters, :math:`\sum_i \prod \text{shape}_i`."""
        return sum(math.prod(s) for s in self.parameters_shapes)

    def fixed_scale(self):
        """Constant pre-factor of the block (1; :math:`|T|` for conv Kronecker blocks)."""
        return 1.0

    def state_dependent_scale(self, state):
        """Pre-factor computed from the state (1 for every block here)."""
        return 1.0

    def scale(self, state, use_cache=False):
        r"""Total pre-factor :math:`s`: the cached snapshot's when ``use_cache``."""
        if use_cache:
            return self._cache_get(state, "scale", "update_cache")
        return float(self.fixed_scale()) * float(self.state_dependent_scale(state))

    # -- state ---------------------------------------------------------------------------
    def init(self, like, exact_powers_to_cache=None, approx_powers_to_cache=None,
             cache_eigenvalues=False):
        r"""Initial state: zero statistics, empty cache.

        .. math::

            S_0 = 0, \quad W_0 = 0 .

        ``like`` (any array) fixes namespace, device and floating dtype (kfac-jax's ``rng``
        has no use here: nothing is random).  The powers to cache are recorded and checked
        by :meth:`update_cache`.
        """
        func = f"{type(self).__name__}.init"
        namespace_of(func, like=like)
        check_array(func, "like", like)
        like0 = zeros_like_shape(like, ())
        exact = _powers_set(func, "exact_powers_to_cache", exact_powers_to_cache)
        approx = _powers_set(func, "approx_powers_to_cache", approx_powers_to_cache)
        for p in approx:
            self._check_approx_power(func, p)
        stats = tuple(WeightedMovingAverage.zeros_like(zeros_like_shape(like, shape))
                      for shape in self._statistics_shapes())
        cache = {"declared": (exact, approx, bool(cache_eigenvalues))}
        return BlockState(stats, MappingProxyType(cache), like0)

    def _statistics_shapes(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _check_state(self, func, state):
        if not isinstance(state, BlockState):
            raise KFACTypeError(f"{func}: state must be a BlockState from {type(self).__name__}"
                                f".init; got {describe(state)}.")
        shapes = tuple(tuple(s.raw.shape) for s in state.statistics)
        if shapes != tuple(self._statistics_shapes()):
            raise KFACValueError(f"{func}: state must hold statistics of shapes "
                                 f"{tuple(self._statistics_shapes())}; got {shapes}.")
        return state

    def _update_stats(self, func, state, new_stats, ema_old, ema_new):
        ema_old = check_scalar(func, "ema_old", ema_old, nonnegative=True)
        ema_new = check_scalar(func, "ema_new", ema_new, nonnegative=True)
        stats = tuple(s.update(x, ema_old, ema_new) for s, x in zip(state.statistics, new_stats,
                                                                      strict=True))
        return BlockState(stats, state.cache, state.like)

    def _check_estimation_data(self, func, state, estimation_data, batch_size, keys):
        self._check_state(func, state)
        if not isinstance(estimation_data, Mapping):
            raise KFACTypeError(f"{func}: estimation_data must be a mapping with keys "
                                f"{keys}; got {describe(estimation_data)}.")
        missing = [k for k in keys if k not in estimation_data]
        if missing:
            raise KFACValueError(f"{func}: estimation_data must have the keys {keys}; got "
                                 f"keys {tuple(estimation_data)}.")
        batch_size = check_int(func, "batch_size", batch_size, minimum=1)
        arrays = {k: estimation_data[k] for k in keys}
        flat = {}
        for k, v in arrays.items():
            if isinstance(v, (list, tuple)):
                for i, a in enumerate(v):
                    flat[f"{k}[{i}]"] = a
            else:
                flat[k] = v
        namespace_of(func, like=state.like, **flat)
        for k, v in flat.items():
            check_array(func, k, v, min_ndim=1)
            if v.shape[0] != batch_size:
                raise KFACValueError(f"{func}: {k} must have batch_size = {batch_size} rows "
                                     f"(axis 0); got shape {tuple(v.shape)}.")
        return arrays

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new,
                                         batch_size):  # pragma: no cover - abstract
        raise NotImplementedError

    # -- vectors -------------------------------------------------------------------------
    def _check_vector(self, func, state, vector):
        if not isinstance(vector, (list, tuple)):
            raise KFACTypeError(
                f"{func}: vector must be a tuple of {self.number_of_parameters} arrays of shapes "
                f"{self.parameters_shapes}; got {describe(vector)}.")
        if len(vector) != self.number_of_parameters:
            raise KFACValueError(
                f"{func}: vector must have {self.number_of_parameters} arrays of shapes "
                f"{self.parameters_shapes}; got {len(vector)}.")
        namespace_of(func, like=state.like, **{f"vector[{i}]": v for i, v in enumerate(vector)})
        for i, (v, shape) in enumerate(zip(vector, self.parameters_shapes, strict=True)):
            check_array(func, f"vector[{i}]", v, shape=shape)
        return tuple(vector)

    def _flatten(self, xp, vector):
        return xp.concat([xp.reshape(v, (-1,)) for v in vector])

    def _unflatten(self, xp, flat):
        out, i = [], 0
        for shape in self.parameters_shapes:
            n = math.prod(shape)
            out.append(xp.reshape(flat[i:i + n], shape))
            i += n
        return tuple(out)

    # -- damping -------------------------------------------------------------------------
    def effective_identity_weight(self, state, identity_weight, norm_to_scale_identity_weight=None,
                                  use_cached=False):
        r"""The :math:`\lambda` actually added: :math:`w` or :math:`w\,\|sB\|`.

        .. math::

            \lambda = \begin{cases} w & \text{norm} = \text{None (TF; kfac-jax default)} \\
            w \cdot \texttt{norm}(\text{state}, \text{norm}) &
            \text{kfac-jax } \texttt{norm\_to\_scale\_identity\_weight\_per\_block}
            \end{cases}

        With ``use_cached`` the norm is the cached snapshot's, so a cached product and the
        :meth:`update_cache` call that built it agree by construction.
        """
        func = f"{type(self).__name__}.effective_identity_weight"
        w = check_scalar(func, "identity_weight", identity_weight, nonnegative=True)
        norm_type = _check_norm(func, norm_to_scale_identity_weight)
        if norm_type is None:
            return w
        if use_cached:
            cached = self._cache_get(state, "norms", "update_cache")
            if norm_type not in cached:
                raise KFACValueError(
                    f"{func}: norm_to_scale_identity_weight must be one the cache was built "
                    f"with ({tuple(cached)}); got {norm_type!r}. Call update_cache with it.")
            return w * cached[norm_type]
        return w * self.norm(state, norm_type)

    # -- products ------------------------------------------------------------------------
    def _check_approx_power(self, func, power):
        return power

    def multiply_matpower(self, state, vector, identity_weight, power, exact_power, use_cached,
                          norm_to_scale_identity_weight=None):
        r""":math:`(s B + \lambda I)^{p}\, v` for a parameter-shaped vector.

        .. math::

            (s B + \lambda I)^{p} v ,

        exact (eigendecompositions) or approximate (block-dependent: factored π damping for
        Kronecker blocks; diagonal and full blocks are always exact).  ``use_cached`` runs the
        same arithmetic on the snapshot of the last :meth:`update_cache`.

        Raises
        ------
        KFACValueError, KFACTypeError
            A vector whose structure differs from ``parameters_shapes``, a power the block
            cannot do approximately, an unknown norm name, a cached product that was not
            cached, a negative power of a singular damped block.
        """
        func = f"{type(self).__name__}.multiply_matpower"
        self._check_state(func, state)
        xp = namespace_of(func, like=state.like)
        vector = self._check_vector(func, state, vector)
        power = check_scalar(func, "power", power)
        if not exact_power:
            self._check_approx_power(func, power)
        lam = self.effective_identity_weight(state, identity_weight,
                                             norm_to_scale_identity_weight, use_cached)
        if use_cached:
            return self._multiply_cached(func, xp, state, vector, lam, power, bool(exact_power))
        return self._multiply_fresh(func, xp, state, vector, lam, power, bool(exact_power))

    def multiply(self, state, vector, identity_weight, exact_power, use_cached,
                 norm_to_scale_identity_weight=None):
        r""":math:`(sB + \lambda I)\, v` (:meth:`multiply_matpower` with :math:`p = 1`).

        .. math:: (sB + \lambda I)\, v
        """
        return self.multiply_matpower(state, vector, identity_weight, 1.0, exact_power,
                                      use_cached, norm_to_scale_identity_weight)

    def multiply_inverse(self, state, vector, identity_weight, exact_power, use_cached,
                         norm_to_scale_identity_weight=None):
        r""":math:`(sB + \lambda I)^{-1} v` (:meth:`multiply_matpower` with :math:`p = -1`).

        .. math:: (sB + \lambda I)^{-1} v
        """
        return self.multiply_matpower(state, vector, identity_weight, -1.0, exact_power,
                                      use_cached, norm_to_scale_identity_weight)

    # -- cache ---------------------------------------------------------------------------
    def _cache_get(self, state, key, what):
        if key not in state.cache:
            raise KFACValueError(
                f"{type(self).__name__}: the cache must hold {key!r} for this call; got a cache "
                f"without it. Declare the power in init and call {what} first.")
        return state.cache[key]

    def update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues,
                     norm_to_scale_identity_weight=None):
        r"""Snapshot the quantities the cached products need.

        .. math::

            \text{cache} = \{ s,\ \|sB\|,\ \text{eigendecompositions},\
            (\lambda, \text{damped factor powers})_{p \in \text{approx}} \}

        with :math:`\lambda` from :meth:`effective_identity_weight` (the same method the
        uncached product uses).  Powers must have been declared in :meth:`init`.
        """
        func = f"{type(self).__name__}.update_cache"
        self._check_state(func, state)
        xp = namespace_of(func, like=state.like)
        exact = _powers_set(func, "exact_powers", exact_powers)
        approx = _powers_set(func, "approx_powers", approx_powers)
        d_exact, d_approx, _ = state.cache.get("declared", ((), (), False))
        for p in exact:
            if p not in d_exact:
                raise KFACValueError(f"{func}: exact_powers must be declared in init "
                                     f"({d_exact}); got {p}.")
        for p in approx:
            self._check_approx_power(func, p)
            if p not in d_approx:
                raise KFACValueError(f"{func}: approx_powers must be declared in init "
                                     f"({d_approx}); got {p}.")
        norm_type = _check_norm(func, norm_to_scale_identity_weight)
        w = check_scalar(func, "identity_weight", identity_weight, nonnegative=True)
        cache = {"declared": state.cache.get("declared", ((), (), False)),
                 "scale": self.scale(state, False), "norms": {}}
        lam = w
        if norm_type is not None:
            cache["norms"] = {norm_type: self.norm(state, norm_type)}
            lam = w * cache["norms"][norm_type]
        cache.update(self._build_cache(func, xp, state, lam, exact, approx, bool(eigenvalues)))
        return BlockState(state.statistics, MappingProxyType(cache), state.like)

    def eigenvalues(self, state, use_cached=False):
        r"""Eigenvalues of :math:`sB` (length :attr:`dim`).

        .. math:: \operatorname{spec}(s B)
        """
        func = f"{type(self).__name__}.eigenvalues"
        self._check_state(func, state)
        xp = namespace_of(func, like=state.like)
        if use_cached:
            return self._cache_get(state, "eigenvalues", "update_cache(eigenvalues=True)")
        return self._eigenvalues(func, xp, state)

    def to_dense_matrix(self, state):
        r"""Dense :math:`sB` in the module's flat parameter order.

        .. math:: s B \in \mathbb{R}^{\dim \times \dim}
        """
        func = f"{type(self).__name__}.to_dense_matrix"
        self._check_state(func, state)
        xp = namespace_of(func, like=state.like)
        return self.scale(state, False) * self._dense_unscaled(xp, state)

    def norm(self, state, norm_type):
        r"""Norm of :math:`sB` (:func:`kfac_ref.linalg.factor_norm` names).

        .. math::

            \|sB\| = s\,\|B\|, \qquad \|A \otimes G\| = \|A\|\,\|G\|
            \ \text{(all four norms are multiplicative over } \otimes).
        """
        func = f"{type(self).__name__}.norm"
        self._check_state(func, state)
        check_option(func, "norm_type", norm_type, FACTOR_NORMS)
        xp = namespace_of(func, like=state.like)
        return self.scale(state, False) * self._norm_unscaled(xp, state, norm_type)


# --------------------------------------------------------------------------------------
# Scaled identity
# --------------------------------------------------------------------------------------
class ScaledIdentity(CurvatureBlock):
    r"""kfac-jax ``ScaledIdentity``: the block is :math:`sI`.

    .. math::

        (sI + \lambda I)^{p} v = (s + \lambda)^{p} v .

    ``update_curvature_matrix_estimate`` changes nothing (there are no statistics).
    """

    def __init__(self, parameters_shapes, scale=1.0, **kwargs):
        super().__init__(parameters_shapes, **kwargs)
        self._scale = check_scalar(type(self).__name__, "scale", scale, nonnegative=True)

    def fixed_scale(self):
        return self._scale

    def _statistics_shapes(self):
        return ()

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new,
                                         batch_size):
        r"""No-op (the state has no statistics).

        .. math:: \text{state} \mapsto \text{state}
        """
        self._check_state("ScaledIdentity.update_curvature_matrix_estimate", state)
        return state

    def _multiply_fresh(self, func, xp, state, vector, lam, power, exact):
        s = self.scale(state, False)
        return tuple(M.scaled_identity_matpower(v, power, lam, scale=s) for v in vector)

    def _multiply_cached(self, func, xp, state, vector, lam, power, exact):
        s = self._cache_get(state, "scale", "update_cache")
        return tuple(M.scaled_identity_matpower(v, power, lam, scale=s) for v in vector)

    def _build_cache(self, func, xp, state, lam, exact, approx, eigenvalues):
        out = {}
        if eigenvalues:
            out["eigenvalues"] = self._eigenvalues(func, xp, state)
        return out

    def _eigenvalues(self, func, xp, state):
        return self.scale(state, False) * ones_like_shape(state.like, (self.dim,))

    def _dense_unscaled(self, xp, state):
        return eye_like(state.like, self.dim)

    def _norm_unscaled(self, xp, state, norm_type):
        return 1.0


# --------------------------------------------------------------------------------------
# Diagonal blocks
# --------------------------------------------------------------------------------------
class Diagonal(CurvatureBlock):
    r"""Diagonal blocks (kfac-jax ``Diagonal``): one diagonal per parameter.

    .. math::

        (s\,\mathrm{diag}(d) + \lambda I)^{p} v = (s d + \lambda)^{\odot p} \odot v

    (:func:`~kfac_ref.blocks.diagonal_block_matpower`); exact and approximate coincide, any
    power.  The norm is that of the whole diagonal matrix (kfac-jax multiplies the norms of
    the per-parameter diagonals instead, which is not a norm of the block when there are two
    parameters; the two agree for one parameter).
    """

    def _statistics_shapes(self):
        return self.parameters_shapes

    def _diagonals(self, state):
        return tuple(s.value for s in state.statistics)

    def _apply(self, func, xp, diagonals, vector, lam, power, s):
        return tuple(M._apply_diagonal(func, xp, d, v, power, lam, s)
                     for d, v in zip(diagonals, vector, strict=True))

    def _multiply_fresh(self, func, xp, state, vector, lam, power, exact):
        return self._apply(func, xp, self._diagonals(state), vector, lam, power,
                           self.scale(state, False))

    def _multiply_cached(self, func, xp, state, vector, lam, power, exact):
        diagonals = self._cache_get(state, "diagonals", "update_cache")
        return self._apply(func, xp, diagonals, vector, lam, power,
                           self._cache_get(state, "scale", "update_cache"))

    def _build_cache(self, func, xp, state, lam, exact, approx, eigenvalues):
        out = {"diagonals": self._diagonals(state)}
        if eigenvalues:
            out["eigenvalues"] = self._eigenvalues(func, xp, state)
        return out

    def _flat_diagonal(self, xp, state):
        return self._flatten(xp, self._diagonals(state))

    def _eigenvalues(self, func, xp, state):
        return self.scale(state, False) * self._flat_diagonal(xp, state)

    def _dense_unscaled(self, xp, state):
        d = self._flat_diagonal(xp, state)
        return eye_like(d, self.dim) * d[None, :]

    def _norm_unscaled(self, xp, state, norm_type):
        return factor_norm(self._flat_diagonal(xp, state), norm_type)


class NaiveDiagonal(Diagonal):
    r"""kfac-jax ``NaiveDiagonal`` / TF ``NaiveDiagonalFB``: the "square of the sum".

    .. math::

        d = \frac{1}{N} \sum_{s} \hat g_s \odot \hat g_s \ \text{(per\_source, default; TF)},
        \qquad
        d = \frac{1}{N} \Big(\sum_s \hat g_s\Big)^{\odot 2} \ \text{(summed; kfac-jax)},

    from ``estimation_data["params_grads"]``: per parameter, the gradient
    :math:`\hat g_s = \sum_n \hat g_{s,n}` of the summed (sampled) loss, shaped like the
    parameter, or ``[S, *shape]`` for :math:`S` sources (Monte-Carlo samples).  With one source
    the two agree.  The statistic is :func:`kfac_ref.factors.naive_diagonal_factor`.
    """

    def __init__(self, parameters_shapes, source_reduction="per_source", **kwargs):
        super().__init__(parameters_shapes, **kwargs)
        self.source_reduction = check_option(type(self).__name__, "source_reduction",
                                             source_reduction, ("per_source", "summed"))

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new,
                                         batch_size):
        r"""Average one batch's naive diagonal into the state.

        .. math:: d \leftarrow \text{EMA}\big(d,\ \tfrac1N \textstyle\sum_s \hat g_s^{\odot 2}\big)
        """
        func = f"{type(self).__name__}.update_curvature_matrix_estimate"
        grads = _params_grads_sources(self, func, state, estimation_data, batch_size)
        xp = namespace_of(func, like=state.like)
        flat = _naive_statistic(xp, grads, batch_size, self.source_reduction,
                                _factors().naive_diagonal_factor)
        return self._update_stats(func, state, self._unflatten(xp, flat), ema_old, ema_new)


def _params_grads_sources(block, func, state, estimation_data, batch_size):
    """``estimation_data["params_grads"]`` as a tuple over sources of per-parameter tuples."""
    block._check_state(func, state)
    if not isinstance(estimation_data, Mapping) or "params_grads" not in estimation_data:
        raise KFACValueError(f"{func}: estimation_data must be a mapping with the key "
                             f"'params_grads'; got {describe(estimation_data)}.")
    check_int(func, "batch_size", batch_size, minimum=1)
    grads = estimation_data["params_grads"]
    shapes = block.parameters_shapes
    if not isinstance(grads, (list, tuple)) or len(grads) != len(shapes):
        raise KFACValueError(f"{func}: params_grads must be a sequence of {len(shapes)} "
                             f"gradient arrays of shapes {shapes} (optionally with a leading "
                             f"sources axis); got {describe(grads)}.")
    namespace_of(func, like=state.like, **{f"params_grads[{i}]": g for i, g in enumerate(grads)})
    with_sources = None
    for i, (g, s) in enumerate(zip(grads, shapes, strict=True)):
        check_array(func, f"params_grads[{i}]", g)
        has = tuple(g.shape) != s
        if has:
            check_array(func, f"params_grads[{i}]", g, shape=(None, *s),
                        layout=f"{list(s)} or [S, {', '.join(map(str, s))}]")
        if with_sources is not None and has != with_sources:
            raise KFACValueError(f"{func}: params_grads must all have a sources axis or none; "
                                 f"got mixed shapes {[tuple(x.shape) for x in grads]}.")
        with_sources = has
    if not with_sources:
        return (tuple(grads),)
    n_src = grads[0].shape[0]
    if any(g.shape[0] != n_src for g in grads):
        raise KFACValueError(f"{func}: params_grads must have one number of sources; got "
                             f"shapes {[tuple(x.shape) for x in grads]}.")
    return tuple(tuple(g[k, ...] for g in grads) for k in range(n_src))


def _naive_statistic(xp, sources, batch_size, source_reduction, factor_fn):
    """Σ over sources of ``factor_fn(grads_s, N)`` (per_source) or ``factor_fn(Σ_s grads_s)``."""
    if source_reduction == "summed":
        summed = tuple(sum(src[i] for src in sources) for i in range(len(sources[0])))
        return factor_fn(summed, batch_size)
    out = factor_fn(sources[0], batch_size)
    for src in sources[1:]:
        out = out + factor_fn(src, batch_size)
    return out


class DenseDiagonal(Diagonal):
    r"""kfac-jax ``DenseDiagonal`` / TF ``FullyConnectedDiagonalFB``: sum-of-squares diagonal.

    .. math::

        d_{ij} = \frac1N \sum_n (\bar a_{n,i}\, g_{n,j})^2
        = \tfrac1N\big[(\bar a\odot\bar a)^\top (g\odot g)\big]_{ij}

    (:func:`kfac_ref.factors.fully_connected_diagonal_factor`), split into the kernel rows and
    the bias row.

    Parameters
    ----------
    input_size, output_size : int
    has_bias : bool
    """

    def __init__(self, input_size, output_size, has_bias=True, **kwargs):
        func = type(self).__name__
        d_in = check_int(func, "input_size", input_size, minimum=1)
        d_out = check_int(func, "output_size", output_size, minimum=1)
        self.has_bias = bool(has_bias)
        shapes = [(d_in, d_out)] + ([(d_out,)] if self.has_bias else [])
        super().__init__(shapes, **kwargs)

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new,
                                         batch_size):
        r"""Average one batch's sum-of-squares diagonal into the state.

        .. math:: d \leftarrow \text{EMA}\big(d, \tfrac1N(\bar a\odot\bar a)^\top(g\odot g)\big)
        """
        func = f"{type(self).__name__}.update_curvature_matrix_estimate"
        data = self._check_estimation_data(func, state, estimation_data, batch_size,
                                           ("inputs", "outputs_grad"))
        diag = _factors().fully_connected_diagonal_factor(data["inputs"], data["outputs_grad"],
                                                          has_bias=self.has_bias)
        d_in = self.parameters_shapes[0][0]
        new = (diag[:d_in, :],) + ((diag[d_in, :],) if self.has_bias else ())
        return self._update_stats(func, state, new, ema_old, ema_new)


# --------------------------------------------------------------------------------------
# Full blocks
# --------------------------------------------------------------------------------------
class Full(CurvatureBlock):
    r"""Full (dense) blocks (kfac-jax ``Full``): one symmetric PSD matrix.

    .. math::

        (sF + \lambda I)^{p} v = Q\,(s\sigma + \lambda)^{\odot p} \odot Q^\top v,
        \qquad F = Q\,\mathrm{diag}(\sigma)\,Q^\top

    (:func:`~kfac_ref.blocks.full_block_matpower`); exact and approximate coincide, any power.
    The cache stores the eigendecomposition, so the identity weight is applied at product time
    (kfac-jax caches damped inverses below its eigendecomposition threshold instead).
    """

    def _statistics_shapes(self):
        return ((self.dim, self.dim),)

    def _apply(self, func, xp, matrix, eig, flat, lam, power, s):
        if power == 1.0:
            return s * (matrix @ flat) + lam * flat
        return M._apply_full_eigen(func, xp, eig, flat, power, lam, s)

    def _multiply_fresh(self, func, xp, state, vector, lam, power, exact):
        matrix = state.statistics[0].value
        eig = None if power == 1.0 else M._prepare_full(func, xp, matrix,
                                                        self.eigenvalue_clipping_threshold)
        out = self._apply(func, xp, matrix, eig, self._flatten(xp, vector), lam, power,
                          self.scale(state, False))
        return self._unflatten(xp, out)

    def _multiply_cached(self, func, xp, state, vector, lam, power, exact):
        matrix = self._cache_get(state, "matrix", "update_cache")
        eig = None if power == 1.0 else self._cache_get(
            state, "eigen", "update_cache with a power declared in init")
        out = self._apply(func, xp, matrix, eig, self._flatten(xp, vector), lam, power,
                          self._cache_get(state, "scale", "update_cache"))
        return self._unflatten(xp, out)

    def _build_cache(self, func, xp, state, lam, exact, approx, eigenvalues):
        matrix = state.statistics[0].value
        out = {"matrix": matrix}
        if exact or approx or eigenvalues:
            out["eigen"] = M._prepare_full(func, xp, matrix, self.eigenvalue_clipping_threshold)
        if eigenvalues:
            out["eigenvalues"] = self.scale(state, False) * out["eigen"][0]
        return out

    def _eigenvalues(self, func, xp, state):
        s, _ = clipped_eigh(state.statistics[0].value, self.eigenvalue_clipping_threshold)
        return self.scale(state, False) * s

    def _dense_unscaled(self, xp, state):
        return state.statistics[0].value

    def _norm_unscaled(self, xp, state, norm_type):
        return factor_norm(state.statistics[0].value, norm_type)

    def _update_with_tangents(self, func, state, tangents, ema_old, ema_new):
        """Average :math:`\\frac1N \\sum_n t_n t_n^\\top` of per-example tangents [N, dim]."""
        return self._update_stats(func, state, (compute_cov(tangents),), ema_old, ema_new)


class NaiveFull(Full):
    r"""kfac-jax ``NaiveFull`` / TF ``NaiveFullFB``: rank-one "square of the sum" estimate.

    .. math::

        F = \frac1N \sum_s \hat g_s \hat g_s^\top \ \text{(per\_source, default; TF, and
        kfac-jax's extra leading axis)}, \qquad
        F = \frac1N \Big(\sum_s \hat g_s\Big)\Big(\sum_s \hat g_s\Big)^\top \ \text{(summed)},

    with ``estimation_data["params_grads"]`` as in :class:`NaiveDiagonal`
    (:func:`kfac_ref.factors.full_factor`).
    """

    def __init__(self, parameters_shapes, source_reduction="per_source", **kwargs):
        super().__init__(parameters_shapes, **kwargs)
        self.source_reduction = check_option(type(self).__name__, "source_reduction",
                                             source_reduction, ("per_source", "summed"))

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new,
                                         batch_size):
        r"""Average one batch's naive full matrix into the state.

        .. math::

            F \leftarrow \text{EMA}\big(F,\ \tfrac1N\textstyle\sum_s \hat g_s\hat g_s^\top\big)
        """
        func = f"{type(self).__name__}.update_curvature_matrix_estimate"
        grads = _params_grads_sources(self, func, state, estimation_data, batch_size)
        xp = namespace_of(func, like=state.like)
        new = _naive_statistic(xp, grads, batch_size, self.source_reduction,
                               _factors().full_factor)
        return self._update_stats(func, state, (new,), ema_old, ema_new)


def _dense_sizes(func, input_size, output_size, has_bias):
    d_in = check_int(func, "input_size", input_size, minimum=1)
    d_out = check_int(func, "output_size", output_size, minimum=1)
    return d_in, d_out, bool(has_bias)


class DenseFull(Full):
    r"""kfac-jax ``DenseFull``: exact second moment of a dense layer's per-example gradients.

    .. math::

        F = \frac1N \sum_n \mathrm{vec}_r(\bar a_n g_n^\top)\,
            \mathrm{vec}_r(\bar a_n g_n^\top)^\top,
        \qquad \mathrm{vec}_r(\bar a g^\top) = \bar a \otimes g,

    ordered as ``(kernel [d_in, d_out] row-major, bias [d_out])``
    (:func:`kfac_ref.linalg.compute_cov` of the per-example tangents).
    """

    def __init__(self, input_size, output_size, has_bias=True, **kwargs):
        d_in, d_out, self.has_bias = _dense_sizes(type(self).__name__, input_size, output_size,
                                                  has_bias)
        super().__init__([(d_in, d_out)] + ([(d_out,)] if self.has_bias else []), **kwargs)

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new,
                                         batch_size):
        r"""Average one batch's per-example-gradient second moment into the state.

        .. math:: F \leftarrow \text{EMA}\big(F,\ \tfrac1N\textstyle\sum_n (\bar a_n\otimes g_n)
                  (\bar a_n\otimes g_n)^\top\big)
        """
        func = f"{type(self).__name__}.update_curvature_matrix_estimate"
        data = self._check_estimation_data(func, state, estimation_data, batch_size,
                                           ("inputs", "outputs_grad"))
        xp = namespace_of(func, like=state.like)
        a, g = _dense_data(func, self, data)
        if self.has_bias:
            a = append_homog(a)
        tangents = xp.reshape(a[:, :, None] * g[:, None, :], (a.shape[0], -1))
        return self._update_with_tangents(func, state, tangents, ema_old, ema_new)


def _dense_data(func, block, data):
    d_in = block.parameters_shapes[0][0]
    d_out = block.parameters_shapes[0][-1]
    a, g = data["inputs"], data["outputs_grad"]
    check_array(func, "inputs", a, shape=(None, d_in), layout="[N, d_in]")
    check_array(func, "outputs_grad", g, shape=(None, d_out), layout="[N, d_out]")
    return a, g


# --------------------------------------------------------------------------------------
# Conv helpers
# --------------------------------------------------------------------------------------
class _ConvGeometry:
    """Layer options shared by the conv blocks (TF/kfac_ref conventions, see patches)."""

    def _init_conv(self, func, inputs_shape, kernel_shape, strides, padding, dilation_rate,
                   data_format, has_bias):
        if not isinstance(kernel_shape, Sequence) or len(kernel_shape) != 4:
            raise KFACValueError(f"{func}: kernel_shape must be [kh, kw, C_in, C_out] (HWIO); "
                                 f"got {describe(kernel_shape)}.")
        self.kernel_shape = tuple(check_int(func, "kernel_shape entry", k, minimum=1)
                                  for k in kernel_shape)
        if not isinstance(inputs_shape, Sequence) or len(inputs_shape) != 4:
            raise KFACValueError(f"{func}: inputs_shape must be a 4-entry shape [N, H, W, C] "
                                 f"(NHWC) or [N, C, H, W] (NCHW), batch entry ignored; got "
                                 f"{describe(inputs_shape)}.")
        self.inputs_shape = tuple(int(v) for v in inputs_shape)
        self.strides, self.padding = strides, padding
        self.dilation_rate, self.data_format = dilation_rate, data_format
        self.has_bias = bool(has_bias)
        from .. import patches

        self.num_locations = int(patches.num_conv_locations(
            self.inputs_shape, self.kernel_shape, strides, padding, dilation_rate, data_format))
        self.output_spatial_shape = tuple(int(o) for o in patches.conv_output_spatial_shape(
            self.inputs_shape, self.kernel_shape, strides, padding, dilation_rate, data_format))
        k = math.prod(self.kernel_shape[:3])
        return [self.kernel_shape] + ([(self.kernel_shape[3],)] if self.has_bias else []), k

    def _conv_data(self, func, data):
        x, g = data["inputs"], data["outputs_grad"]
        check_array(func, "inputs", x, ndim=4, shape=(None, *self.inputs_shape[1:]))
        # The output grid and channels of this layer: a gradient on another grid would give
        # statistics normalised by the wrong number of locations |T|.
        c_out, grid = self.kernel_shape[3], self.output_spatial_shape
        channels_first = self.data_format is not None and \
            str(self.data_format).upper().startswith("NC")
        if channels_first:
            check_array(func, "outputs_grad", g, shape=(None, c_out, *grid),
                        layout="[N, C_out, H_out, W_out] (NCHW)")
        else:
            check_array(func, "outputs_grad", g, shape=(None, *grid, c_out),
                        layout="[N, H_out, W_out, C_out] (NHWC)")
        return x, g

    def _grads_channels_last(self, xp, g):
        if self.data_format is not None and str(self.data_format).upper().startswith("NC"):
            return xp.permute_dims(g, (0, 2, 3, 1))
        return g

    def _patches(self, x):
        return _factors().conv_patch_matrix(x, self.kernel_shape, self.padding, self.strides,
                                            self.dilation_rate, self.data_format, self.has_bias)

    def _per_example_grads(self, xp, x, g):
        """Per-example weight gradients :math:`DW_n = \\sum_t \\bar p_{n,t} g_{n,t}^\\top`,
        flattened ``[N, (K + 1)·C_out]`` (kernel rows then the bias row)."""
        dw = _factors().conv_per_example_gradients(
            x, g, self.kernel_shape, self.strides, self.padding, self.data_format,
            self.dilation_rate, self.has_bias)
        return xp.reshape(dw, (x.shape[0], -1))


class Conv2DDiagonal(_ConvGeometry, Diagonal):
    r"""kfac-jax ``Conv2DDiagonal`` / TF ``ConvDiagonalFB``: sum-of-squares diagonal.

    .. math::

        d = \frac1N \sum_n \Big(\sum_{t} \bar p_{n,t}\, g_{n,t}^\top\Big)^{\odot 2}

    (:func:`kfac_ref.factors.conv_diagonal_factor`), split into kernel ``[kh, kw, C_in, C_out]``
    and bias ``[C_out]``.  The scale is 1 and the damping is :math:`\lambda` (TF's
    ``|T|·normalize_damping(λ, |T|) = λ``).

    Parameters
    ----------
    inputs_shape : [N, H, W, C] (NHWC) or [N, C, H, W] (NCHW); the batch entry is ignored
    kernel_shape : [kh, kw, C_in, C_out] (HWIO)
    strides, padding, dilation_rate, data_format
        As :func:`kfac_ref.patches.extract_convolution_patches`.
    has_bias : bool
    """

    def __init__(self, inputs_shape, kernel_shape, strides=1, padding="VALID", dilation_rate=1,
                 data_format="NHWC", has_bias=True, **kwargs):
        shapes, _ = self._init_conv(type(self).__name__, inputs_shape, kernel_shape, strides,
                                    padding, dilation_rate, data_format, has_bias)
        super().__init__(shapes, **kwargs)

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new,
                                         batch_size):
        r"""Average one batch's sum-of-squares diagonal into the state.

        .. math:: d \leftarrow \text{EMA}\big(d, \tfrac1N\textstyle\sum_n DW_n^{\odot 2}\big)
        """
        func = f"{type(self).__name__}.update_curvature_matrix_estimate"
        data = self._check_estimation_data(func, state, estimation_data, batch_size,
                                           ("inputs", "outputs_grad"))
        x, g = self._conv_data(func, data)
        xp = namespace_of(func, like=state.like)
        diag = _factors().conv_diagonal_factor(x, g, self.kernel_shape, self.strides,
                                               self.padding, self.data_format,
                                               self.dilation_rate, self.has_bias)
        k = math.prod(self.kernel_shape[:3])
        new = (xp.reshape(diag[:k, :], self.kernel_shape),)
        if self.has_bias:
            new = new + (diag[k, :],)
        return self._update_stats(func, state, new, ema_old, ema_new)


class Conv2DFull(_ConvGeometry, Full):
    r"""kfac-jax ``Conv2DFull``: exact second moment of a conv layer's per-example gradients.

    .. math::

        F = \frac1N \sum_n \mathrm{vec}_r(DW_n)\,\mathrm{vec}_r(DW_n)^\top,
        \qquad DW_n = \sum_t \bar p_{n,t}\, g_{n,t}^\top \in \mathbb{R}^{(K+1)\times C_{out}},

    patches from :func:`kfac_ref.factors.conv_patch_matrix`, ordered (kernel row-major, bias).
    Parameters as :class:`Conv2DDiagonal`.
    """

    def __init__(self, inputs_shape, kernel_shape, strides=1, padding="VALID", dilation_rate=1,
                 data_format="NHWC", has_bias=True, **kwargs):
        shapes, _ = self._init_conv(type(self).__name__, inputs_shape, kernel_shape, strides,
                                    padding, dilation_rate, data_format, has_bias)
        super().__init__(shapes, **kwargs)

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new,
                                         batch_size):
        r"""Average one batch's per-example-gradient second moment into the state.

        .. math:: F \leftarrow \text{EMA}\big(F, \tfrac1N\textstyle\sum_n \mathrm{vec}_r(DW_n)
                  \mathrm{vec}_r(DW_n)^\top\big)
        """
        func = f"{type(self).__name__}.update_curvature_matrix_estimate"
        data = self._check_estimation_data(func, state, estimation_data, batch_size,
                                           ("inputs", "outputs_grad"))
        x, g = self._conv_data(func, data)
        xp = namespace_of(func, like=state.like)
        return self._update_with_tangents(func, state, self._per_example_grads(xp, x, g),
                                          ema_old, ema_new)


# --------------------------------------------------------------------------------------
# Kronecker-factored blocks
# --------------------------------------------------------------------------------------
class TwoKroneckerFactored(CurvatureBlock):
    r"""Kronecker-factored blocks (kfac-jax ``TwoKroneckerFactored``), :math:`s\,A\otimes G`.

    .. math::

        \text{exact: } (sA\otimes G + \lambda I)^{p}, \qquad
        \text{approximate: } \big(s(A + \pi\sqrt{\lambda/s}I)\otimes(G + \sqrt{\lambda/s}/\pi\,
        I)\big)^{p}

    (:func:`~kfac_ref.blocks.kronecker_block_matpower`) on the row-major ``[W; b]`` matrix
    ``[K (+1), C_out]`` built from the vector ``(kernel, bias)``.

    Options where TF and kfac-jax differ (defaults are kfac-jax's, except ``symmetrize``):

    * ``approx_power_one``: ``"factored"`` (kfac-jax and TF: the approximate power 1 is the
      π-damped product) or ``"exact"`` (:math:`sA\otimes G + \lambda I`);
    * ``restrict_approx_powers``: ``True`` allows only kfac-jax's approximate powers
      (−1, −0.5, 0.5, 1) and raises for others; ``False`` allows any real power (TF);
    * ``zero_factor_fallback``: ``"identity"`` (kfac-jax: damped block :math:`\lambda I`) or
      ``"pi_one"`` (TF: π = 1);
    * ``pi_norm``: the factor norm for π (``"avg_diag"`` = trace norm; ``"off"`` is TF's
      ``PI_TYPE="off"``);
    * ``symmetrize``: statistics symmetrised (TF; the default here) or not (kfac-jax); they
      differ by rounding only.
    """

    def __init__(self, parameters_shapes, *, approx_power_one="factored",
                 restrict_approx_powers=True, zero_factor_fallback="identity",
                 pi_norm="avg_diag", symmetrize=True, **kwargs):
        super().__init__(parameters_shapes, **kwargs)
        func = type(self).__name__
        self.approx_power_one = check_option(func, "approx_power_one", approx_power_one,
                                             ("factored", "exact"))
        self.restrict_approx_powers = bool(restrict_approx_powers)
        self.zero_factor_fallback = check_option(func, "zero_factor_fallback",
                                                 zero_factor_fallback, M.ZERO_FACTOR_FALLBACKS)
        self.pi_norm = check_option(func, "pi_norm", pi_norm, M.PI_NORMS)
        self.symmetrize = bool(symmetrize)
        kernel = self.parameters_shapes[0]
        self.output_size = kernel[-1]
        self.input_size = math.prod(kernel[:-1]) + (1 if len(self.parameters_shapes) == 2 else 0)
        if len(self.parameters_shapes) == 2 and self.parameters_shapes[1] != (kernel[-1],):
            raise KFACValueError(f"{func}: the bias shape must be ({kernel[-1]},) for a kernel "
                                 f"of shape {kernel}; got {self.parameters_shapes[1]}.")

    def _statistics_shapes(self):
        return ((self.input_size, self.input_size), (self.output_size, self.output_size))

    def _check_approx_power(self, func, power):
        if self.restrict_approx_powers and power not in KFAC_JAX_APPROX_POWERS:
            raise KFACValueError(
                f"{func}: power must be one of {KFAC_JAX_APPROX_POWERS} for an approximate "
                f"(exact_power=False) Kronecker power (kfac-jax); got {power}. Use "
                f"exact_power=True or restrict_approx_powers=False.")
        return power

    # vector <-> [W; b]
    def _to_matrix(self, xp, vector):
        q = self.output_size
        parts = [xp.reshape(vector[0], (-1, q))]
        if len(vector) == 2:
            parts.append(xp.reshape(vector[1], (1, q)))
        return xp.concat(parts, axis=0) if len(parts) == 2 else parts[0]

    def _from_matrix(self, xp, mat):
        k = math.prod(self.parameters_shapes[0][:-1])
        out = (xp.reshape(mat[:k, :], self.parameters_shapes[0]),)
        if len(self.parameters_shapes) == 2:
            out = out + (mat[k, :],)
        return out

    def _product(self, func, xp, a, g, eig, approx_entry, x, lam, power, exact, s):
        if power == 1.0 and (exact or self.approx_power_one == "exact"):
            return M._apply_kron_exact_one(xp, a, g, x, lam, s)
        if exact:
            return M._apply_kron_eigen(func, xp, eig, x, power, lam, s)
        return M._apply_kron_factored(xp, approx_entry, x)

    def _prepare_factored(self, func, xp, a, g, power, lam, s):
        return M._prepare_kron_factored(func, xp, a, g, power, lam, s, self.pi_norm,
                                        self.zero_factor_fallback,
                                        self.eigenvalue_clipping_threshold)

    def _multiply_fresh(self, func, xp, state, vector, lam, power, exact):
        a, g = (f.value for f in state.statistics)
        s = self.scale(state, False)
        x = self._to_matrix(xp, vector)
        eig = entry = None
        if power != 1.0 or not (exact or self.approx_power_one == "exact"):
            if exact:
                eig = M._prepare_kron_eigen(func, xp, a, g, self.eigenvalue_clipping_threshold)
            else:
                entry = self._prepare_factored(func, xp, a, g, power, lam, s)
        return self._from_matrix(xp, self._product(func, xp, a, g, eig, entry, x, lam, power,
                                                   exact, s))

    def _multiply_cached(self, func, xp, state, vector, lam, power, exact):
        a, g = self._cache_get(state, "factors", "update_cache")
        s = self._cache_get(state, "scale", "update_cache")
        x = self._to_matrix(xp, vector)
        eig = entry = None
        if power != 1.0 or not (exact or self.approx_power_one == "exact"):
            if exact:
                eig = self._cache_get(state, "eigen", "update_cache with exact_powers")
            elif power == 1.0:
                entry = self._prepare_factored(func, xp, a, g, power, lam, s)
            else:
                approx = self._cache_get(state, "approx", "update_cache with approx_powers")
                if power not in approx:
                    raise KFACValueError(
                        f"{func}: power must be one of the cached approximate powers "
                        f"{tuple(approx)}; got {power}. Declare it in init and call "
                        f"update_cache.")
                lam_cached, entry = approx[power]
                if self.strict_cache and lam_cached != lam:
                    raise KFACValueError(
                        f"{func}: identity_weight (effective {lam!r}) must equal the one the "
                        f"cached approximate power {power} was built with ({lam_cached!r}); "
                        f"call update_cache, or pass strict_cache=False for kfac-jax's "
                        f"behaviour (cached weight used).")
        return self._from_matrix(xp, self._product(func, xp, a, g, eig, entry, x, lam, power,
                                                   exact, s))

    def _build_cache(self, func, xp, state, lam, exact, approx, eigenvalues):
        a, g = (f.value for f in state.statistics)
        s = self.scale(state, False)
        out = {"factors": (a, g)}
        if exact or eigenvalues:
            out["eigen"] = M._prepare_kron_eigen(func, xp, a, g,
                                                 self.eigenvalue_clipping_threshold)
        if eigenvalues:
            out["eigenvalues"] = M._kron_spectrum(xp, out["eigen"][0], out["eigen"][2], s)
        out["approx"] = MappingProxyType({
            p: (lam, self._prepare_factored(func, xp, a, g, p, lam, s)) for p in approx})
        return out

    def _eigenvalues(self, func, xp, state):
        a, g = (f.value for f in state.statistics)
        s_a, _, s_g, _ = M._prepare_kron_eigen(func, xp, a, g, self.eigenvalue_clipping_threshold)
        return M._kron_spectrum(xp, s_a, s_g, self.scale(state, False))

    def _dense_unscaled(self, xp, state):
        a, g = (f.value for f in state.statistics)
        return kron(a, g)

    def _norm_unscaled(self, xp, state, norm_type):
        a, g = (f.value for f in state.statistics)
        return factor_norm(a, norm_type) * factor_norm(g, norm_type)

    def _second_moment(self, x):
        """:math:`X^\\top X / n` of rows, symmetrised (TF) or not (kfac-jax)."""
        if self.symmetrize:
            return compute_cov(x)
        return compute_cov(x, x)


class DenseTwoKroneckerFactored(TwoKroneckerFactored):
    r"""kfac-jax ``DenseTwoKroneckerFactored`` (TF ``FullyConnectedKFACBasicFB`` statistics).

    .. math::

        A = \frac1N \sum_n \bar a_n \bar a_n^\top, \qquad G = \frac1N \sum_n g_n g_n^\top,
        \qquad B = A \otimes G \ \text{on } \mathrm{vec}_r([W; b])

    (:func:`kfac_ref.factors.fully_connected_kronecker_factor`; with ``symmetrize=False`` the
    unsymmetrised :func:`kfac_ref.linalg.compute_cov` cross form).

    Parameters
    ----------
    input_size, output_size : int
    has_bias : bool
    **kwargs
        Options of :class:`TwoKroneckerFactored`.
    """

    def __init__(self, input_size, output_size, has_bias=True, **kwargs):
        d_in, d_out, has_bias = _dense_sizes(type(self).__name__, input_size, output_size,
                                             has_bias)
        self.has_bias = has_bias
        super().__init__([(d_in, d_out)] + ([(d_out,)] if has_bias else []), **kwargs)

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new,
                                         batch_size):
        r"""Average one batch's factors into the state.

        .. math:: A \leftarrow \text{EMA}(A, \tfrac1N \bar a^\top \bar a),\quad
                  G \leftarrow \text{EMA}(G, \tfrac1N g^\top g)
        """
        func = f"{type(self).__name__}.update_curvature_matrix_estimate"
        data = self._check_estimation_data(func, state, estimation_data, batch_size,
                                           ("inputs", "outputs_grad"))
        a, g = _dense_data(func, self, data)
        if self.symmetrize:
            f = _factors()
            new = (f.fully_connected_kronecker_factor(a, has_bias=self.has_bias),
                   f.fully_connected_kronecker_factor(g))
        else:
            new = (self._second_moment(append_homog(a) if self.has_bias else a),
                   self._second_moment(g))
        return self._update_stats(func, state, new, ema_old, ema_new)


class Conv2DTwoKroneckerFactored(_ConvGeometry, TwoKroneckerFactored):
    r"""kfac-jax ``Conv2DTwoKroneckerFactored`` (TF ``ConvKFCBasicFB``): KFC.

    .. math::

        B = |T|\,(\Omega \otimes \Gamma), \quad
        \Omega = \frac{1}{N|T|}\sum_{n,t}\bar p_{n,t}\bar p_{n,t}^\top, \quad
        \Gamma = \frac{1}{N|T|}\sum_{n,t} g_{n,t}g_{n,t}^\top,

    ``fixed_scale() = |T|`` (``num_locations``), so factored damping splits
    :math:`\lambda/|T|` (FORMULAS §2.2).  Statistics:
    :func:`kfac_ref.factors.conv_input_kronecker_factor`,
    :func:`kfac_ref.factors.conv_output_kronecker_factor`.  Layer parameters as
    :class:`Conv2DDiagonal`, options as :class:`TwoKroneckerFactored`.
    """

    def __init__(self, inputs_shape, kernel_shape, strides=1, padding="VALID", dilation_rate=1,
                 data_format="NHWC", has_bias=True, **kwargs):
        shapes, _ = self._init_conv(type(self).__name__, inputs_shape, kernel_shape, strides,
                                    padding, dilation_rate, data_format, has_bias)
        super().__init__(shapes, **kwargs)

    def fixed_scale(self):
        return float(self.num_locations)

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new,
                                         batch_size):
        r"""Average one batch's KFC factors into the state.

        .. math:: \Omega \leftarrow \text{EMA}(\Omega, \cdot),\quad
                  \Gamma \leftarrow \text{EMA}(\Gamma, \cdot)
        """
        func = f"{type(self).__name__}.update_curvature_matrix_estimate"
        data = self._check_estimation_data(func, state, estimation_data, batch_size,
                                           ("inputs", "outputs_grad"))
        x, g = self._conv_data(func, data)
        xp = namespace_of(func, like=state.like)
        f = _factors()
        if self.symmetrize:
            new = (f.conv_input_kronecker_factor(x, self.kernel_shape, self.padding, self.strides,
                                                 self.dilation_rate, self.data_format,
                                                 self.has_bias),
                   f.conv_output_kronecker_factor(g, self.data_format))
        else:
            gl = self._grads_channels_last(xp, g)
            new = (self._second_moment(self._patches(x)),
                   self._second_moment(xp.reshape(gl, (-1, gl.shape[-1]))))
        return self._update_stats(func, state, new, ema_old, ema_new)


# --------------------------------------------------------------------------------------
# Scale and shift
# --------------------------------------------------------------------------------------
class _ScaleAndShift:
    """Shapes and statistics of ``y = scale * x + shift`` (broadcast, batch axis first)."""

    def _init_sas(self, func, inputs_shape, scale_shape, shift_shape):
        if scale_shape is None and shift_shape is None:
            raise KFACValueError(f"{func}: scale_shape or shift_shape must be given; got "
                                 "neither.")
        self.inputs_shape = tuple(check_int(func, "inputs_shape entry", d, minimum=1)
                                  for d in inputs_shape)
        shapes = []
        for name, s in (("scale_shape", scale_shape), ("shift_shape", shift_shape)):
            if s is None:
                continue
            s = tuple(check_int(func, name, d, minimum=1) for d in s)
            tail = self.inputs_shape[len(self.inputs_shape) - len(s):]
            if len(s) > len(self.inputs_shape) or any(
                    d not in (1, f) for d, f in zip(s, tail, strict=True)):
                raise KFACValueError(f"{func}: {name} must broadcast against the per-example "
                                     f"input shape {self.inputs_shape}; got {s}.")
            shapes.append(s)
        self.has_scale = scale_shape is not None
        self.has_shift = shift_shape is not None
        return shapes

    def _broadcast_axes(self, shape):
        """Axes of ``[N, *inputs_shape]`` a parameter of ``shape`` is broadcast along."""
        lead = len(self.inputs_shape) - len(shape)
        pairs = zip(shape, self.inputs_shape[lead:], strict=True)
        return tuple(range(1, 1 + lead)) + tuple(
            1 + lead + i for i, (d, f) in enumerate(pairs) if d == 1 and f != 1)

    def _statistic(self, func, xp, data, approx):
        """:func:`kfac_ref.factors.scale_and_shift_factor` of one batch (flat order: scale,
        then shift).  A shift-only layer is the factor's scale part with :math:`x = 1`."""
        x, dy = data["inputs"], data["outputs_grad"]
        check_array(func, "inputs", x, shape=(None, *self.inputs_shape))
        check_array(func, "outputs_grad", dy, shape=(None, *self.inputs_shape))
        shapes = list(self.parameters_shapes)
        f = _factors().scale_and_shift_factor
        if not self.has_scale:  # ∑ 1·g over the shift's axes is the shift gradient
            return f(xp.ones_like(dy), dy, self._broadcast_axes(shapes[0]), has_shift=False,
                     approx=approx)
        shift_axes = self._broadcast_axes(shapes[1]) if self.has_shift else None
        return f(x, dy, self._broadcast_axes(shapes[0]), shift_axes, has_shift=self.has_shift,
                 approx=approx)


class ScaleAndShiftDiagonal(_ScaleAndShift, Diagonal):
    r"""kfac-jax ``ScaleAndShiftDiagonal`` / TF ``ScaleAndShiftDiagonalFB``.

    .. math::

        y = \gamma \odot x + \beta,\quad
        d_\gamma = \frac1N\sum_n \Big(\sum_{\text{bcast}} x_n \odot g_n\Big)^{\odot 2},\quad
        d_\beta = \frac1N\sum_n \Big(\sum_{\text{bcast}} g_n\Big)^{\odot 2}

    (:func:`kfac_ref.factors.scale_and_shift_factor`, ``approx="diagonal"``; the sums run over
    the axes the parameter is broadcast along).

    Parameters
    ----------
    inputs_shape : tuple of int
        Per-example input shape (no batch axis).
    scale_shape, shift_shape : tuple of int or None
        Parameter shapes, broadcastable against ``inputs_shape`` (right-aligned).
    """

    def __init__(self, inputs_shape, scale_shape=None, shift_shape=None, **kwargs):
        super().__init__(self._init_sas(type(self).__name__, inputs_shape, scale_shape,
                                        shift_shape), **kwargs)

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new,
                                         batch_size):
        r"""Average one batch's diagonal into the state.

        .. math:: d \leftarrow \text{EMA}\big(d, \tfrac1N\textstyle\sum_n t_n^{\odot 2}\big)
        """
        func = f"{type(self).__name__}.update_curvature_matrix_estimate"
        data = self._check_estimation_data(func, state, estimation_data, batch_size,
                                           ("inputs", "outputs_grad"))
        xp = namespace_of(func, like=state.like)
        diag = self._statistic(func, xp, data, "diagonal")
        return self._update_stats(func, state, self._unflatten(xp, diag), ema_old, ema_new)


class ScaleAndShiftFull(_ScaleAndShift, Full):
    r"""kfac-jax ``ScaleAndShiftFull`` / TF ``ScaleAndShiftFullFB``.

    .. math::

        F = \frac1N\sum_n t_n t_n^\top, \qquad
        t_n = \Big[\mathrm{vec}_r\big(\textstyle\sum_{\text{bcast}} x_n\odot g_n\big);\
        \mathrm{vec}_r\big(\textstyle\sum_{\text{bcast}} g_n\big)\Big]

    (:func:`kfac_ref.factors.scale_and_shift_factor`, ``approx="full"``).  Parameters as
    :class:`ScaleAndShiftDiagonal`.
    """

    def __init__(self, inputs_shape, scale_shape=None, shift_shape=None, **kwargs):
        super().__init__(self._init_sas(type(self).__name__, inputs_shape, scale_shape,
                                        shift_shape), **kwargs)

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new,
                                         batch_size):
        r"""Average one batch's second moment into the state.

        .. math:: F \leftarrow \text{EMA}\big(F, \tfrac1N\textstyle\sum_n t_n t_n^\top\big)
        """
        func = f"{type(self).__name__}.update_curvature_matrix_estimate"
        data = self._check_estimation_data(func, state, estimation_data, batch_size,
                                           ("inputs", "outputs_grad"))
        xp = namespace_of(func, like=state.like)
        return self._update_stats(func, state, (self._statistic(func, xp, data, "full"),),
                                  ema_old, ema_new)
