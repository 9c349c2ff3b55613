r"""The base of the kfac-jax-named blocks: :class:`BlockState` and :class:`CurvatureBlock`.

:class:`CurvatureBlock` validates the arguments of every public method once and then calls
the hooks a block family implements (each an :func:`abc.abstractmethod`, contract in
:class:`CurvatureBlock`'s docstring).  The hooks receive validated arguments and call
unchecked kernels (:mod:`kfac_ref.blocks._math`, the ``.kernel`` of :mod:`kfac_ref.linalg`).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_bool,
    check_int,
    check_option,
    check_scalar,
    check_scalars_with,
    describe,
    errors_named,
    kernel_error,
    namespace_of,
    read_checks_once,
    reshape,
    zeros_like_shape,
)
from ..._pytrees import ensure_for, frozen, join, split, state_class
from ..._support import capabilities
from ...averaging import WeightedMovingAverage
from ...linalg import FACTOR_NORMS
from .._math import flatten, from_mat2d, to_mat2d, unflatten, validated_internals


@capabilities(jit="yes", dask="yes",
              formula="a state container: the block's moving averages and cache")
@dataclass(frozen=True)
class BlockState:
    r"""Immutable state of a curvature block.

    Attributes
    ----------
    statistics : tuple of WeightedMovingAverage
        Kronecker blocks: ``(A, G)`` (kfac-jax ``factors``); diagonal blocks: one diagonal per
        parameter (``diagonal_factors``); full blocks: ``(matrix,)``; scaled identity: ``()``.
    cache : Mapping
        Read-only snapshot written by :meth:`CurvatureBlock.update_cache` (see the module
        docstring of :mod:`kfac_ref.blocks.kfac_jax`); empty until then.
    like : array
        A 0-D array fixing the namespace, device and dtype of the block.
    """

    statistics: tuple
    cache: Mapping = field(default_factory=lambda: MappingProxyType({}))
    like: Any = None

    @property
    def factors(self):
        """kfac-jax's name for the averages of a Kronecker block's factors (``factors``) and
        of a diagonal block's diagonals (``diagonal_factors``)."""
        return self.statistics

    diagonal_factors = factors

    @property
    def matrix(self):
        """kfac-jax's name for the full block's average."""
        return self.statistics[0]


def _flatten_state(state):
    cache_leaves, cache_skeleton = split(state.cache)
    return (state.statistics, state.like, tuple(cache_leaves)), cache_skeleton


def _unflatten_state(cache_skeleton, children):
    statistics, like, cache_leaves = children
    return frozen(BlockState, statistics=statistics, cache=join(cache_skeleton, cache_leaves),
                  like=like)


# A JAX pytree (kfac_ref._pytrees): statistics, ``like`` and the cache's arrays are leaves.
state_class(BlockState, _flatten_state, _unflatten_state)


def powers_set(func, name, powers):
    """A power, a sequence of powers or None as a sorted tuple of floats."""
    if powers is None:
        return ()
    if isinstance(powers, (int, float)) and not isinstance(powers, bool):
        powers = (powers,)
    if not isinstance(powers, Sequence):
        raise KFACTypeError(f"{func}: {name} must be a number, a sequence of numbers or None; "
                            f"got {describe(powers)}.")
    return tuple(sorted({check_scalar(func, name, p) for p in powers}))


def _check_norm(func, norm_type, name="norm_to_scale_identity_weight"):
    if norm_type is None or norm_type == "none":
        return None
    return check_option(func, name, norm_type, (*FACTOR_NORMS, "none"))


def check_rows(func, state, arrays, batch_size):
    """Static checks of the ``estimation_data`` arrays: one namespace with the state, at
    least 1-D, ``batch_size`` rows.  Returns the flat ``{name: array}`` mapping."""
    flat = {}
    for k, v in arrays.items():
        if isinstance(v, (list, tuple)):
            for i, a in enumerate(v):
                flat[f"{k}[{i}]"] = a
        else:
            flat[k] = v
    namespace_of(func, **{"state.like": state.like}, **flat)
    for k, v in flat.items():
        check_array(func, k, v, min_ndim=1, finite=False)
        if v.shape[0] != batch_size:
            raise KFACValueError(f"{func}: {k} must have batch_size = {batch_size} rows "
                                 f"(axis 0); got shape {tuple(v.shape)}.")
    return flat


@capabilities(dask="yes")
class CurvatureBlock(abc.ABC):
    r"""Base class: a curvature block over a group of parameters, kfac-jax API.

    .. math::

        \begin{aligned}
        \texttt{multiply\_matpower}(v) &= (s\,B + \lambda I)^{p} v,\\
        s &= \texttt{fixed\_scale} \cdot \texttt{state\_dependent\_scale},\\
        \lambda &= w \cdot \|s B\|_{\text{norm}} \ \text{(or } w\text{)}.
        \end{aligned}

    The public methods validate their arguments once and call the hooks below, which a
    block family implements.  A product hook receives validated arguments (``xp``: the
    namespace of the state) and must not validate them again; it takes no function name:
    an error it raises is a :func:`~kfac_ref._backend.kernel_error`, which the public
    method names (the validation hooks ``_check_*`` take ``func``).

    * ``_statistics_shapes()``: shapes of the statistics in :attr:`BlockState.statistics`.
    * ``_batch_statistics(xp, data, batch_size)``: one batch's statistics (a tuple matching
      ``_statistics_shapes``) from ``data``, the output of ``_check_estimation_arrays``;
      :meth:`update_curvature_matrix_estimate` averages them into the state.
    * ``_multiply_fresh(xp, state, vector, lam, power, exact)`` and
      ``_multiply_cached(...)``: :math:`(sB + \lambda I)^p v` for ``vector`` in the
      family's working form (a tuple of parameter-shaped arrays unless the family
      overrides the working-form hooks below), from the statistics or from the snapshot
      of ``_build_cache``; both run the same product code.
    * ``_build_cache(xp, state, lam, exact, approx, eigenvalues)``: the mapping the
      cached products need (powers in ``exact``/``approx``, ``lam`` the effective weight).
    * ``_eigenvalues(xp, state)``: :math:`\operatorname{spec}(sB)`, length :attr:`dim`.
    * ``_dense_unscaled(xp, state)``: :math:`B` as a ``[dim, dim]`` array.
    * ``_norm_unscaled(xp, state, norm_type)``: :math:`\|B\|` as a 0-D array or a number.

    Optional hooks: the working form of a vector, ``_to_working_form(xp, vector)`` /
    ``_from_working_form(xp, work)`` and ``_flat_to_working_form(xp, flat)`` /
    ``_working_form_to_flat(xp, work)`` (the Kronecker families work on the ``[W; b]``
    matrix, which is the block's flat slice reshaped, so a flat product copies nothing),
    ``_check_estimation_arrays`` (the checks of ``estimation_data``),
    :meth:`check_approx_power`, :meth:`from_layer`, :meth:`layer_estimation_data` and
    :meth:`update_from_output_vectors` (one update from several back-propagated vectors).

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

    estimation_keys = ("inputs", "outputs_grad")
    """The keys of ``estimation_data`` the block reads."""

    semidefinite_statistics = ()
    r"""Indices of the statistics that are non-negatively weighted averages of outer
    products :math:`v v^\top` (so positive semidefinite): for those
    :math:`|S_{ij}| \le \sqrt{S_{ii} S_{jj}}` (Cauchy–Schwarz), and a NaN or Inf in the
    averaged data reaches the diagonal as a sum of squares, so a finite diagonal proves
    every entry finite.  :class:`~kfac_ref.curvature.BlockDiagonalCurvature` scans only
    their diagonals when an update enters the state (a length-:math:`n` scan instead of
    :math:`n^2`)."""

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
        self.strict_cache = check_bool(func, "strict_cache", strict_cache)

    # -- construction from a layer -------------------------------------------------------
    @classmethod
    def from_layer(cls, layer, input_shape, *, weight_sharing="expand", **kwargs):
        r"""The block of this class for a :mod:`kfac_ref.nn` layer.

        .. math:: \text{block} = \texttt{cls}(\text{layer's parameter shapes})

        ``input_shape`` is the layer's input shape (batch axis first) and ``weight_sharing``
        the KFAC-expand/-reduce choice of :class:`kfac_ref.curvature.BlockDiagonalCurvature`;
        the layer families override this (a dense, conv or scale-and-shift block reads the
        layer's sizes and options).  ``kwargs`` go to the constructor.
        """
        return cls(layer.param_shapes(), **kwargs)

    def layer_estimation_data(self, layer, inputs, outputs_grad, params_grads, batch_size,
                              weight_sharing="expand"):
        r"""``(estimation_data, rows)`` of this block from one layer's batch quantities.

        .. math::

            \text{data} = \{\texttt{inputs}: x,\ \texttt{outputs\_grad}: g\}
            \ \text{or}\ \{\texttt{params\_grads}: (\nabla_{\theta} \ell_n)_n\}

        ``inputs``/``outputs_grad`` are the layer input and the back-propagated vector at its
        output, ``params_grads`` the per-example parameter gradients (or None when no block
        of the estimator reads them).  Dense and conv blocks override this for weight
        sharing (KFAC-expand feeds :math:`NT` rows).
        """
        if self.uses_params_grads:
            return {"params_grads": tuple(params_grads)}, batch_size
        return {"inputs": inputs, "outputs_grad": outputs_grad}, batch_size

    def update_from_output_vectors(self, state, layer, inputs, outputs_grads, batch_size,
                                   weight_sharing, ema_old, ema_new, layer_tap=None):
        r"""One moving-average update from the :math:`C` back-propagated output vectors of a
        batch (:class:`kfac_ref.curvature.BlockDiagonalCurvature` calls this once per update).

        .. math::

            S \leftarrow \texttt{ema\_old}\, S + \frac{\texttt{ema\_new}}{C}
            \sum_{c=1}^{C} \hat S\big(x, g_c\big)

        ``outputs_grads`` holds the :math:`C` vectors :math:`g_c` at the layer's output,
        ``inputs`` the layer input :math:`x`.  The default runs :math:`C` calls of
        :meth:`update_curvature_matrix_estimate`, the first with ``ema_old``, the others with
        1, each with the weight ``ema_new / C`` (the same average); Kronecker blocks override
        it to form the input factor once and the output factor from the stacked vectors in
        one GEMM.  Only for blocks that read layer quantities, not per-example parameter
        gradients (:attr:`uses_params_grads` false).  ``layer_tap`` is what the layer's
        forward pass kept (:meth:`kfac_ref.nn.Layer.forward_with_tap`; ``None`` when it kept
        nothing); a block that can use it instead of recomputing it from ``inputs`` does
        (the KFC input factor from a convolution's patches), the others ignore it.
        """
        if self.uses_params_grads:
            raise KFACValueError(
                f"{type(self).__name__}.update_from_output_vectors: the block must read layer "
                f"inputs and output gradients; this one reads per-example parameter gradients "
                f"(use update_curvature_matrix_estimate with params_grads).")
        if not outputs_grads:
            raise KFACValueError(
                f"{type(self).__name__}.update_from_output_vectors: outputs_grads must hold at "
                f"least one back-propagated vector; got none.")
        c = len(outputs_grads)
        for j, g in enumerate(outputs_grads):
            data, rows = self.layer_estimation_data(layer, inputs, g, None, batch_size,
                                                    weight_sharing)
            state = self.update_curvature_matrix_estimate(
                state, data, ema_old if j == 0 else 1.0, ema_new / c, rows)
        return state

    def uses_layer_tap(self, layer, input_shape):
        r"""Whether this block reads the tap of ``layer``'s forward pass for inputs of shape
        ``input_shape`` (:meth:`kfac_ref.nn.Layer.forward_with_tap`): then
        :class:`kfac_ref.curvature.BlockDiagonalCurvature` hands the layer the tap of
        :meth:`layer_tap` and passes its value to :meth:`update_from_output_vectors` as
        ``layer_tap``.

        .. math:: \tau(\theta, x) \text{ is one of the block's statistics }\hat S(x, g)

        ``False`` here; :class:`~kfac_ref.blocks.kfac_jax.Conv2DTwoKroneckerFactored`
        reads the KFC input factor :math:`\Omega` of a :class:`kfac_ref.nn.Conv2D` of its
        own geometry and bias.
        """
        return False

    def layer_tap(self, layer, input_shape):
        r"""The tap this block wants from ``layer``'s forward pass on inputs of shape
        ``input_shape`` (batch axis included), or ``None``: a function of what the layer's
        weight multiplies, chunk by chunk, whose sum is one of the block's statistics
        (:meth:`kfac_ref.nn.Layer.forward_with_tap`).

        .. math:: \tau = \textstyle\sum_c \operatorname{tap}(u_c) = \hat S(x)

        ``None`` here and wherever :meth:`uses_layer_tap` is false;
        :class:`~kfac_ref.blocks.kfac_jax.Conv2DTwoKroneckerFactored` returns
        :func:`kfac_ref.factors.conv_input_factor_tap` of the layer's geometry.
        """
        return None

    @property
    def uses_params_grads(self):
        """Whether :meth:`layer_estimation_data` needs per-example parameter gradients."""
        return "params_grads" in self.estimation_keys

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
            with errors_named(f"{type(self).__name__}.scale"):
                return self._cache_get(state, "scale", "update_cache")
        return float(self.fixed_scale()) * float(self.state_dependent_scale(state))

    # -- hooks ---------------------------------------------------------------------------
    @abc.abstractmethod
    def _statistics_shapes(self):
        """Shapes of the statistics (see the class docstring)."""

    @abc.abstractmethod
    def _batch_statistics(self, xp, data, batch_size):
        """One batch's statistics from validated ``data`` (see the class docstring)."""

    @abc.abstractmethod
    def _multiply_fresh(self, xp, state, vector, lam, power, exact):
        """:math:`(sB + \\lambda I)^p v` from the statistics."""

    @abc.abstractmethod
    def _multiply_cached(self, xp, state, vector, lam, power, exact):
        """:math:`(sB + \\lambda I)^p v` from the cache snapshot."""

    @abc.abstractmethod
    def _build_cache(self, xp, state, lam, exact, approx, eigenvalues):
        """The cache entries of this family."""

    @abc.abstractmethod
    def _eigenvalues(self, xp, state):
        """:math:`\\operatorname{spec}(sB)`."""

    @abc.abstractmethod
    def _dense_unscaled(self, xp, state):
        """The unscaled block as a dense matrix."""

    @abc.abstractmethod
    def _norm_unscaled(self, xp, state, norm_type):
        """The norm of the unscaled block."""

    def _check_estimation_arrays(self, func, state, arrays, batch_size):
        """Validate ``estimation_data`` (static checks, then one finiteness scan each)."""
        flat = check_rows(func, state, arrays, batch_size)
        for k, v in flat.items():
            check_array(func, k, v)
        return arrays

    def check_approx_power(self, func, power):
        """Return ``power`` when the block has an approximate (``exact_power=False``)
        product for it; raise :class:`~kfac_ref.KFACValueError` otherwise.  Every power here;
        the Kronecker families take kfac-jax's powers only, unless
        ``restrict_approx_powers=False``."""
        return power

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
        # the constructor saw no array: its 0-D options meet the state's kind here, once
        check_scalars_with(func, {"like": like}, **self._scalar_options())
        ensure_for(like)  # a JAX state is a JAX pytree (kfac_ref.register_jax_pytrees)
        like0 = zeros_like_shape(like, ())
        exact = powers_set(func, "exact_powers_to_cache", exact_powers_to_cache)
        approx = powers_set(func, "approx_powers_to_cache", approx_powers_to_cache)
        for p in approx:
            self.check_approx_power(func, p)
        cache_eigenvalues = check_bool(func, "cache_eigenvalues", cache_eigenvalues)
        stats = tuple(WeightedMovingAverage.zeros_like(zeros_like_shape(like, shape))
                      for shape in self._statistics_shapes())
        cache = {"declared": (exact, approx, cache_eigenvalues)}
        return BlockState(stats, MappingProxyType(cache), like0)

    def _scalar_options(self):
        """The constructor's real options, by name (a 0-D array must be like the state)."""
        return {"eigenvalue_clipping_threshold": self.eigenvalue_clipping_threshold}

    def check_state_structure(self, func, state):
        """Check that ``state`` is a :class:`BlockState` of this block's statistic shapes.

        Structure only (type and shapes; no array is read), for callers that check the
        namespace of many blocks' states at once
        (:class:`~kfac_ref.curvature.BlockDiagonalCurvature`) before calling
        :meth:`multiply_matpower_kernel`.
        """
        if not isinstance(state, BlockState):
            raise KFACTypeError(f"{func}: state must be a BlockState from {type(self).__name__}"
                                f".init; got {describe(state)}.")
        shapes = tuple(tuple(s.raw.shape) for s in state.statistics)
        if shapes != tuple(self._statistics_shapes()):
            raise KFACValueError(f"{func}: state must hold statistics of shapes "
                                 f"{tuple(self._statistics_shapes())}; got {shapes}.")

    def _check_state(self, func, state):
        self.check_state_structure(func, state)
        return namespace_of(func, **{"state.like": state.like})

    def _check_scalars(self, func, state, **scalars):
        """The checked scalars that are 0-D arrays against the state: one namespace, device
        and precision (:func:`~kfac_ref._backend.check_scalars_with`)."""
        check_scalars_with(func, {"state.like": state.like}, **scalars)

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new,
                                         batch_size):
        r"""Average one batch's statistics into the state (kfac-jax's weighted average).

        .. math::

            S \leftarrow \texttt{ema\_old}\,S + \texttt{ema\_new}\,\hat S(\text{data}),\qquad
            W \leftarrow \texttt{ema\_old}\,W + \texttt{ema\_new}

        with :math:`\hat S` the family's batch statistic (see the class's docstring).
        ``estimation_data`` holds :attr:`estimation_keys` (see the module docstring of
        :mod:`kfac_ref.blocks.kfac_jax`); every array is checked once.
        """
        func = f"{type(self).__name__}.update_curvature_matrix_estimate"
        xp = self._check_state(func, state)
        keys = self.estimation_keys
        if keys and (not isinstance(estimation_data, Mapping)
                     or any(k not in estimation_data for k in keys)):
            if not isinstance(estimation_data, Mapping):
                raise KFACTypeError(f"{func}: estimation_data must be a mapping with keys "
                                    f"{keys}; got {describe(estimation_data)}.")
            raise KFACValueError(f"{func}: estimation_data must have the keys {keys}; got "
                                 f"keys {tuple(estimation_data)}.")
        batch_size = check_int(func, "batch_size", batch_size, minimum=1)
        ema_old = check_scalar(func, "ema_old", ema_old, nonnegative=True)
        ema_new = check_scalar(func, "ema_new", ema_new, nonnegative=True)
        self._check_scalars(func, state, ema_old=ema_old, ema_new=ema_new)
        if not self._statistics_shapes():
            return state
        data = self._check_estimation_arrays(func, state, {k: estimation_data[k] for k in keys},
                                             batch_size)
        with validated_internals():
            new = self._batch_statistics(xp, data, batch_size)
            stats = tuple(s.update(x, ema_old, ema_new)
                          for s, x in zip(state.statistics, new, strict=True))
        return BlockState(stats, state.cache, state.like)

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
        namespace_of(func, **{"state.like": state.like},
                     **{f"vector[{i}]": v for i, v in enumerate(vector)})
        for i, (v, shape) in enumerate(zip(vector, self.parameters_shapes, strict=True)):
            check_array(func, f"vector[{i}]", v, shape=shape)
        return tuple(vector)

    def _flatten(self, xp, vector):
        return flatten(xp, vector)

    def _unflatten(self, xp, flat):
        return unflatten(xp, flat, self.parameters_shapes)

    # -- damping -------------------------------------------------------------------------
    def effective_identity_weight(self, state, identity_weight, norm_to_scale_identity_weight=None,
                                  use_cached=False):
        r"""The :math:`\lambda` actually added: :math:`w` or :math:`w\,\|sB\|`.

        .. math::

            \lambda = \begin{cases} w & \text{norm} = \text{None}
            \quad \text{(TF; kfac-jax default)}, \\
            w \cdot \texttt{norm}(\text{state}, \text{norm}) & \text{otherwise: kfac-jax's}
            \\ & \texttt{norm\_to\_scale\_identity\_weight\_per\_block}.
            \end{cases}

        With ``use_cached`` the norm is the cached snapshot's, so a cached product and the
        :meth:`update_cache` call that built it agree by construction.
        """
        func = f"{type(self).__name__}.effective_identity_weight"
        xp = self._check_state(func, state)
        return self._effective_weight(func, xp, state, identity_weight,
                                      norm_to_scale_identity_weight, use_cached)

    def _effective_weight(self, func, xp, state, identity_weight, norm_type, use_cached):
        w = check_scalar(func, "identity_weight", identity_weight, nonnegative=True)
        self._check_scalars(func, state, identity_weight=w)
        return self._damping(func, xp, state, w, _check_norm(func, norm_type), use_cached)

    def _damping(self, func, xp, state, w, norm_type, use_cached):
        r""":math:`\lambda` from a checked weight and norm name (see
        :meth:`effective_identity_weight`)."""
        if norm_type is None:
            return w
        if use_cached:
            with errors_named(func):
                cached = self._cache_get(state, "norms", "update_cache")
            if norm_type not in cached:
                raise KFACValueError(
                    f"{func}: norm_to_scale_identity_weight must be one the cache was built "
                    f"with ({tuple(cached)}); got {norm_type!r}. Call update_cache with it.")
            return w * cached[norm_type]
        return w * self._norm(xp, state, norm_type)

    # -- products ------------------------------------------------------------------------
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
        xp, work, lam, power, exact, cached = self._checked_product(
            func, state, vector, identity_weight, power, exact_power, use_cached,
            norm_to_scale_identity_weight)
        with errors_named(func):
            work = (self._multiply_cached if cached else self._multiply_fresh)(
                xp, state, work, lam, power, exact)
        return self._from_working_form(xp, work)

    def _checked_product(self, func, state, vector, identity_weight, power, exact_power,
                         use_cached, norm_type):
        """The validation of :meth:`multiply_matpower` (and of :meth:`multiply`,
        :meth:`multiply_inverse`, which call the family's product hook themselves: a product
        is one call from the public method to the family's formula):
        ``(xp, working form of the vector, λ, power, exact, use_cached)``."""
        xp = self._check_state(func, state)
        vector = self._check_vector(func, state, vector)
        w = check_scalar(func, "identity_weight", identity_weight, nonnegative=True)
        power, exact, use_cached, norm_type = self.check_product_options(
            func, power, exact_power, use_cached, norm_type)
        self._check_scalars(func, state, identity_weight=w, power=power)
        lam = self._damping(func, xp, state, w, norm_type, use_cached)
        return xp, self._to_working_form(xp, vector), lam, power, exact, use_cached

    def check_product_options(self, func, power, exact_power, use_cached, norm_type=None,
                              norm_name="norm_to_scale_identity_weight"):
        """The checked scalar options of :meth:`multiply_matpower`:
        ``(power, exact_power, use_cached, norm_type)``, with ``norm_type`` None or a name of
        :data:`~kfac_ref.linalg.FACTOR_NORMS` (called ``norm_name`` in a message).  An
        approximate power the block cannot do is refused here."""
        power = check_scalar(func, "power", power)
        exact = check_bool(func, "exact_power", exact_power)
        use_cached = check_bool(func, "use_cached", use_cached)
        if not exact:
            self.check_approx_power(func, power)
        return power, exact, use_cached, _check_norm(func, norm_type, norm_name)

    def multiply_matpower_kernel(self, func, xp, state, vector, identity_weight, power,
                                 exact_power, use_cached, norm_type):
        r"""The unchecked kernel of :meth:`multiply_matpower`: :math:`(sB + \lambda I)^p v`.

        .. math:: (s B + \lambda I)^{p} v, \qquad \lambda = w \ \text{or}\ w\,\|sB\|

        For a caller that has validated the arguments once for many blocks: ``state``
        passed :meth:`check_state_structure`, ``state.like`` and ``vector`` share the
        namespace ``xp``, ``vector`` is a tuple of arrays of ``parameters_shapes``
        already scanned for non-finite values, ``identity_weight`` is a checked
        non-negative number and the options come from :meth:`check_product_options`.  What
        depends on the cache's contents (a power or norm it was not built with) is still
        refused here, as a :func:`~kfac_ref._backend.kernel_error` that the caller names
        once for all its blocks (``with errors_named(func):``).
        """
        work = self._multiply_working_form(func, xp, state, self._to_working_form(xp, vector),
                                           identity_weight, power, exact_power, use_cached,
                                           norm_type)
        return self._from_working_form(xp, work)

    def multiply_matpower_flat_kernel(self, func, xp, state, flat, identity_weight, power,
                                      exact_power, use_cached, norm_type):
        r""":meth:`multiply_matpower_kernel` on the block's flat slice ``[dim]`` (the
        row-major flattenings of ``parameters_shapes``, concatenated); returns the flat
        product.

        .. math:: \mathrm{vec}\big((s B + \lambda I)^{p} v\big)

        Same contract as :meth:`multiply_matpower_kernel`, with ``flat`` checked and
        scanned by the caller.  For a family whose working form is a reshape of the flat
        slice (the Kronecker ``[W; b]`` matrix) no vector is copied on the way in or out.
        """
        work = self._multiply_working_form(func, xp, state,
                                           self._flat_to_working_form(xp, flat),
                                           identity_weight, power, exact_power, use_cached,
                                           norm_type)
        return self._working_form_to_flat(xp, work)

    def cached_flat_product(self, xp, state, identity_weight, power, exact_power):
        r"""The cached product of :meth:`multiply_matpower_flat_kernel` with
        ``use_cached=True`` and no norm scaling, bound to ``state`` and these checked
        options, as a function of the flat slice alone; ``None`` when this family has none
        for these options.  Called after that product succeeded with the same arguments, so
        its errors do not arise here.

        .. math:: v \mapsto \mathrm{vec}\big((s B + \lambda I)^{p} v\big)

        For a caller that makes many products with one immutable state and the same
        options (:meth:`kfac_ref.curvature.BlockDiagonalCurvature.multiply_matpower` keeps
        one per state): the branch choices and cache look-ups are made once here, not per
        product.  The function computes what the kernel computes, with the kernel's own
        formula.
        """
        return None

    def _multiply_working_form(self, func, xp, state, work, identity_weight, power,
                               exact_power, use_cached, norm_type):
        # kernel errors come out unnamed: the caller names them once for all its blocks
        lam = (identity_weight if norm_type is None
               else self._damping(func, xp, state, identity_weight, norm_type, use_cached))
        if use_cached:
            return self._multiply_cached(xp, state, work, lam, power, exact_power)
        return self._multiply_fresh(xp, state, work, lam, power, exact_power)

    # -- the working form of a vector: the parameter tuple unless a family overrides it --
    def _to_working_form(self, xp, vector):
        return vector

    def _from_working_form(self, xp, work):
        return work

    def _flat_to_working_form(self, xp, flat):
        return self._to_working_form(xp, unflatten(xp, flat, self.parameters_shapes))

    def _working_form_to_flat(self, xp, work):
        return flatten(xp, self._from_working_form(xp, work))

    def multiply(self, state, vector, identity_weight, exact_power, use_cached,
                 norm_to_scale_identity_weight=None):
        r""":math:`(sB + \lambda I)\, v` (:meth:`multiply_matpower` with :math:`p = 1`).

        .. math:: (sB + \lambda I)\, v
        """
        func = f"{type(self).__name__}.multiply"
        xp, work, lam, power, exact, cached = self._checked_product(
            func, state, vector, identity_weight, 1.0, exact_power, use_cached,
            norm_to_scale_identity_weight)
        with errors_named(func):
            work = (self._multiply_cached if cached else self._multiply_fresh)(
                xp, state, work, lam, power, exact)
        return self._from_working_form(xp, work)

    def multiply_inverse(self, state, vector, identity_weight, exact_power, use_cached,
                         norm_to_scale_identity_weight=None):
        r""":math:`(sB + \lambda I)^{-1} v` (:meth:`multiply_matpower` with :math:`p = -1`).

        .. math:: (sB + \lambda I)^{-1} v
        """
        func = f"{type(self).__name__}.multiply_inverse"
        xp, work, lam, power, exact, cached = self._checked_product(
            func, state, vector, identity_weight, -1.0, exact_power, use_cached,
            norm_to_scale_identity_weight)
        with errors_named(func):
            work = (self._multiply_cached if cached else self._multiply_fresh)(
                xp, state, work, lam, power, exact)
        return self._from_working_form(xp, work)

    # -- cache ---------------------------------------------------------------------------
    def _cache_get(self, state, key, what):
        """A cache entry; a missing one is a :func:`~kfac_ref._backend.kernel_error` that
        the calling method's ``errors_named`` names."""
        if key not in state.cache:
            raise kernel_error(
                f"the cache must hold {key!r} for this call; got a {type(self).__name__} "
                f"cache without it. Declare the power in init and call {what} first.")
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
        xp = self._check_state(func, state)
        exact, approx, eigenvalues, norm_type = self.check_cache_options(
            func, exact_powers, approx_powers, eigenvalues, norm_to_scale_identity_weight)
        d_exact, d_approx, _ = state.cache.get("declared", ((), (), False))
        for p in exact:
            if p not in d_exact:
                raise KFACValueError(f"{func}: exact_powers must be declared in init "
                                     f"({d_exact}); got {p}.")
        for p in approx:
            self.check_approx_power(func, p)
            if p not in d_approx:
                raise KFACValueError(f"{func}: approx_powers must be declared in init "
                                     f"({d_approx}); got {p}.")
        w = check_scalar(func, "identity_weight", identity_weight, nonnegative=True)
        self._check_scalars(func, state, identity_weight=w)
        # the value checks of the whole refresh (pivots, spectra) are read back once; when
        # one fails the refresh runs again with checks read at once, which raises the error
        # (or takes the fall-back) of the failing check as it always did
        cache = read_checks_once(xp, lambda: self._cache_entries(
            xp, state, w, norm_type, exact, approx, eigenvalues), func)
        return BlockState(state.statistics, MappingProxyType(cache), state.like)

    def check_cache_options(self, func, exact_powers, approx_powers, eigenvalues, norm_type,
                            norm_name="norm_to_scale_identity_weight"):
        """The checked options of :meth:`update_cache`: ``(exact_powers, approx_powers,
        eigenvalues, norm_type)``, the powers as sorted tuples and ``norm_type`` None or a
        name of :data:`~kfac_ref.linalg.FACTOR_NORMS` (called ``norm_name`` in a message).
        Whether the powers were declared in ``init`` is the state's to say, not checked
        here."""
        return (powers_set(func, "exact_powers", exact_powers),
                powers_set(func, "approx_powers", approx_powers),
                check_bool(func, "eigenvalues", eigenvalues),
                _check_norm(func, norm_type, norm_name))

    def _cache_entries(self, xp, state, w, norm_type, exact, approx, eigenvalues):
        cache = {"declared": state.cache.get("declared", ((), (), False)),
                 "scale": self.scale(state, False), "norms": {}}
        lam = w
        if norm_type is not None:
            cache["norms"] = {norm_type: self._norm(xp, state, norm_type)}
            lam = w * cache["norms"][norm_type]
        cache.update(self._build_cache(xp, state, lam, exact, approx, eigenvalues))
        return cache

    def eigenvalues(self, state, use_cached=False):
        r"""Eigenvalues of :math:`sB` (length :attr:`dim`).

        .. math:: \operatorname{spec}(s B)
        """
        func = f"{type(self).__name__}.eigenvalues"
        xp = self._check_state(func, state)
        use_cached = check_bool(func, "use_cached", use_cached)
        with errors_named(func):
            if use_cached:
                return self._cache_get(state, "eigenvalues", "update_cache(eigenvalues=True)")
            return self._eigenvalues(xp, state)

    def to_dense_matrix(self, state):
        r"""Dense :math:`sB` in the module's flat parameter order.

        .. math:: s B \in \mathbb{R}^{\dim \times \dim}
        """
        xp = self._check_state(f"{type(self).__name__}.to_dense_matrix", state)
        return self.scale(state, False) * self._dense_unscaled(xp, state)

    def norm(self, state, norm_type):
        r"""Norm of :math:`sB` (:func:`kfac_ref.linalg.factor_norm` names).

        .. math::

            \|sB\| = s\,\|B\|, \qquad \|A \otimes G\| = \|A\|\,\|G\|

        (all four norms are multiplicative over :math:`\otimes`).
        """
        func = f"{type(self).__name__}.norm"
        xp = self._check_state(func, state)
        check_option(func, "norm_type", norm_type, FACTOR_NORMS)
        return self._norm(xp, state, norm_type)

    def _norm(self, xp, state, norm_type):
        return self.scale(state, False) * self._norm_unscaled(xp, state, norm_type)


class MatrixWorkingForm:
    r"""Working form of the Kronecker families: the row-major ``[W; b]`` matrix
    ``[K (+1), C_out]`` (kernel reshaped to ``[-1, C_out]``, bias as the last row).

    .. math:: X = \begin{bmatrix} W \\ b^\top \end{bmatrix}, \qquad
              \mathrm{vec}_r X = (\mathrm{vec}_r W, b)

    The block's flat slice is :math:`\mathrm{vec}_r X`, so the flat forms are reshapes.
    Needs ``input_size`` and ``output_size`` on the block."""

    def _to_working_form(self, xp, vector):
        return to_mat2d(xp, vector[0], vector[1] if len(vector) == 2 else None,
                        self.output_size)

    def _from_working_form(self, xp, work):
        has_bias = len(self.parameters_shapes) == 2
        kernel, bias = from_mat2d(xp, work, self.parameters_shapes[0], has_bias)
        return (kernel, bias) if has_bias else (kernel,)

    def _flat_to_working_form(self, xp, flat):
        return reshape(xp, flat, (self.input_size, self.output_size))

    def _working_form_to_flat(self, xp, work):
        return reshape(xp, work, (-1,))
