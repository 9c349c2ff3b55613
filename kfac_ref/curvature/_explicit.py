r"""The dense exact estimator (kfac-jax ``ExplicitExactCurvature``); documented in
:mod:`kfac_ref.curvature`."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

from .._backend import (
    KFACTypeError,
    KFACValueError,
    any_true,
    check_array,
    check_int,
    check_option,
    check_scalar,
    describe,
    device_of,
    errors_named,
    is_lazy,
    namespace_of,
    value_checks,
    zeros_like_shape,
)
from .._pytrees import ensure_for, frozen, join, split, state_class
from .._support import capabilities
from ..averaging import WeightedMovingAverage
from ..linalg import clipped_eigh, damped_matpower, kron_eigenbasis_matpower
from . import _exact as exact
from ._estimator_args import EstimatorBase, flat_or_structured, unpack_func_args


# ------------------------------------------------------------------------------------------
# Explicit exact curvature
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExplicitState:
    """State of :class:`ExplicitExactCurvature`: the dense average and a cache snapshot."""

    matrix: WeightedMovingAverage
    cache: Mapping


def _flatten_explicit(state):
    leaves, skeleton = split(state.cache)
    return (state.matrix, tuple(leaves)), skeleton


# A JAX pytree (kfac_ref._pytrees): the average and the cache's arrays are leaves.
state_class(ExplicitState, _flatten_explicit,
            lambda skeleton, children: frozen(ExplicitState, matrix=children[0],
                                              cache=join(skeleton, children[1])))


@contextlib.contextmanager
def _matrix_named(func, state):
    """A failure of a kernel on a non-finite ``state.matrix`` (a state built with value
    checks off: the matrix is scanned when it enters the state) becomes a
    :class:`KFACValueError` naming it, in place of the linear-algebra library's own error.
    The matrix is read only after a failure.  The kernels run after every static check, so
    a kfac_ref error inside is a value failure too (a NaN spectrum reads as singular)."""
    try:
        yield
    except Exception as exc:
        raw = state.matrix.raw
        xp = namespace_of(func, **{"state.matrix": raw})
        if is_lazy(raw) or not any_true(xp, ~xp.isfinite(raw)):
            raise
        raise KFACValueError(f"{func}: state.matrix must be finite (no NaN or Inf); got "
                             f"non-finite entries ({type(exc).__name__}: {exc}).") from exc


@capabilities(jit="yes", dask="yes")
class ExplicitExactCurvature(EstimatorBase):
    r"""Dense curvature over all parameters (kfac-jax ``ExplicitExactCurvature``).

    .. math::

        C \leftarrow \text{EMA}\Big(C,\ \frac1N\sum_c\sum_n (J_n^\top u_{c,n})
        (J_n^\top u_{c,n})^\top\Big),

    with the vectors of the estimation mode
    (:func:`kfac_ref.curvature.estimation_output_vectors`); ``fisher_exact`` (the
    default, as kfac-jax) and ``ggn_exact`` give the exact Fisher / GGN.  kfac-jax loops over
    examples; here the per-example Jacobian products are batched (same numbers).

    Parameters
    ----------
    net, loss_fn
        As :class:`ImplicitExactCurvature`.
    default_estimation_mode : str, optional
        ``"fisher_exact"`` when None.
    num_samples : int
        Samples per example for the stochastic modes.
    empirical_fisher_normalization : {"mean", "kfac_jax"}
        See :data:`kfac_ref.curvature.EMPIRICAL_FISHER_NORMALIZATIONS`.
    eigenvalue_clipping_threshold : float or 0-D array
        A 0-D array is checked against the state's matrix by each method that reads it.
    """

    def __init__(self, net, loss_fn, default_estimation_mode=None, num_samples=1,
                 empirical_fisher_normalization="mean", eigenvalue_clipping_threshold=0.0):
        func = "ExplicitExactCurvature"
        self.net, self.loss_fn = net, loss_fn
        self.default_estimation_mode = check_option(
            func, "default_estimation_mode", default_estimation_mode or "fisher_exact",
            exact.ESTIMATION_MODES)
        self.num_samples = check_int(func, "num_samples", num_samples, minimum=1)
        self.empirical_fisher_normalization = check_option(
            func, "empirical_fisher_normalization", empirical_fisher_normalization,
            exact.EMPIRICAL_FISHER_NORMALIZATIONS)
        self.eigenvalue_clipping_threshold = check_scalar(
            func, "eigenvalue_clipping_threshold", eigenvalue_clipping_threshold)

    @property
    def dim(self):
        r"""Number of parameters.

        .. math:: P
        """
        return self.net.num_params

    def init(self, rng, func_args, exact_powers_to_cache=None, approx_powers_to_cache=None,
             cache_eigenvalues=False):
        r"""Zero state :math:`C_0 = 0` (``rng`` is unused: nothing is random at init).

        .. math:: C_0 = 0 \in \mathbb R^{P\times P}

        ``func_args`` is checked as every later update will check it (the inputs ``x`` in
        the parameters' namespace, device and precision, of the shape the layers receive),
        so that a batch the state cannot be updated with is refused here.
        """
        func = "ExplicitExactCurvature.init"
        params, batch = unpack_func_args(func, func_args)
        x, _ = exact.unpack_batch(func, batch)
        params = self.net.check_params_and_input(func, params, x)
        like = params[self.net.parametric_layers[0]][0]
        ensure_for(like)  # a JAX state is a JAX pytree (kfac_ref.register_jax_pytrees)
        zero = zeros_like_shape(like, (self.dim, self.dim))
        return ExplicitState(WeightedMovingAverage.zeros_like(zero), {})

    def update_curvature_matrix_estimate(self, state, ema_old, ema_new, batch_size, rng,
                                         func_args, estimation_mode=None):
        r"""Average one batch's dense estimate into the state.

        .. math:: C \leftarrow \frac{\texttt{ema\_old}\,S + \texttt{ema\_new}\,\hat C}
                  {\texttt{ema\_old}\,W + \texttt{ema\_new}}
        """
        func = "ExplicitExactCurvature.update_curvature_matrix_estimate"
        mode = self._check_mode(func, estimation_mode)
        if not isinstance(state, ExplicitState):
            raise KFACTypeError(f"{func}: state must be an ExplicitState from init; got "
                                f"{describe(state)}.")
        ema_old, ema_new = self._check_ema(func, ema_old, ema_new,
                                           like={"state.matrix": state.matrix.raw})
        params, batch = unpack_func_args(func, func_args)
        x, _ = exact.unpack_batch(func, batch)
        # the inputs' shape is read before the batch is evaluated: static checks only (the
        # evaluation checks their values); integer inputs (ids) are allowed
        check_array(func, "x", x, dtype=None, finite=False, min_ndim=1)
        self._check_batch_size(func, batch_size, int(x.shape[0]))
        namespace_of(func, **{"state.matrix": state.matrix.raw}, x=x)
        est = exact.estimated_matrix(self.net, self.loss_fn, params, batch, mode, rng,
                                     self.num_samples, self.empirical_fisher_normalization)
        # the estimate has the parameters' precision, which x (integer ids) may not show
        namespace_of(func, **{"state.matrix": state.matrix.raw, "params": est})
        with value_checks(False):  # scanned below, in the state's name
            matrix = state.matrix.update(est, ema_old, ema_new)
        try:
            check_array(func, "the updated state.matrix", matrix.raw)
        except KFACValueError as exc:
            raise KFACValueError(f"{exc} The estimate of func_args overflowed "
                                 f"{matrix.raw.dtype}, or state held non-finite "
                                 f"statistics.") from None
        return ExplicitState(matrix, {})

    def to_dense_matrix(self, state):
        r"""The dense estimate ([P, P], canonical order).

        .. math:: C
        """
        return state.matrix.value

    def to_diagonal_block_dense_matrix(self, state):
        r"""``(C,)``: kfac-jax's explicit estimator has a single block.

        .. math:: (C,)
        """
        return (state.matrix.value,)

    def update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues,
                     pmap_axis_name=None, norm_to_scale_identity_weight_per_block=None):
        r"""Cache the clipped eigendecomposition of :math:`C` (powers are applied at product
        time, so every power and identity weight can use it).

        .. math:: C = Q\,\mathrm{diag}(\max(s, c))\,Q^\top
        """
        func = "ExplicitExactCurvature.update_cache"
        xp = self._check_state(func, state)
        # a refresh, not a product: the one place after the update where the matrix is read
        check_array(func, "state.matrix", state.matrix.raw)
        with _matrix_named(func, state), errors_named(func):
            s, q = clipped_eigh.kernel(xp, state.matrix.value,
                                       self.eigenvalue_clipping_threshold)
        return ExplicitState(state.matrix, {"eigen": (s, q)})

    def multiply_matpower(self, state, parameter_structured_vector, identity_weight, power,
                          exact_power=True, use_cached=False, pmap_axis_name=None,
                          norm_to_scale_identity_weight_per_block=None):
        r""":math:`(C + \lambda I)^p v` (always exact).

        .. math:: (C + \lambda I)^{p} v = Q\,(\max(s,c) + \lambda)^{\odot p} \odot Q^\top v

        The cached path applies the power through
        :func:`kfac_ref.linalg.kron_eigenbasis_matpower` (with a trivial ``1 × 1`` second
        factor), the uncached one through :func:`kfac_ref.linalg.damped_matpower`: one
        eigenvalue-power formula, the same error for a negative power of a singular
        :math:`C + \lambda I`.

        Raises
        ------
        KFACValueError
            ``use_cached`` before :meth:`update_cache`; a negative power of a singular
            :math:`C + \lambda I`; a negative ``identity_weight``.
        """
        func = "ExplicitExactCurvature.multiply_matpower"
        self._check_state(func, state)
        like = {"state.matrix": state.matrix.raw}
        lam = check_scalar(func, "identity_weight", identity_weight, nonnegative=True,
                           like=like)
        p = check_scalar(func, "power", power, like=like)
        flat, back = flat_or_structured(func, self.net, parameter_structured_vector, **like)
        # the state's matrix was scanned when it entered the state (its update), so the
        # products call the kernels: no scan of the [P, P] matrix per product
        if use_cached:
            if "eigen" not in state.cache:
                raise KFACValueError(f"{func}: use_cached needs update_cache first; got an "
                                     f"empty cache.")
            s, q = state.cache["eigen"]
            xp = namespace_of(func, **{"parameter_structured_vector": flat,
                                       "state.cache": q})
            one = xp.ones((1,), dtype=s.dtype, device=device_of(s))
            with errors_named(func):
                out = kron_eigenbasis_matpower.kernel(xp, s, q, one, None,
                                                      xp.reshape(flat, (-1, 1)), p, lam)
            return back(xp.reshape(out, (-1,)))
        xp = namespace_of(func, parameter_structured_vector=flat)
        with _matrix_named(func, state), errors_named(func):
            mat = damped_matpower.kernel(xp, state.matrix.value, p, lam,
                                         self.eigenvalue_clipping_threshold)
        return back(mat @ flat)

    def _check_state(self, func, state):
        if not isinstance(state, ExplicitState):
            raise KFACTypeError(f"{func}: state must be an ExplicitState from init; got "
                                f"{describe(state)}.")
        # the constructor's threshold (a 0-D array, or a number namespace_of passes over)
        # meets the matrix here: the constructor sees no array
        return namespace_of(func, **{"state.matrix": state.matrix.raw},
                            eigenvalue_clipping_threshold=self.eigenvalue_clipping_threshold)

    def eigenvalues(self, state, use_cached=False):
        r"""Eigenvalues of :math:`C` (clipped, ascending).

        .. math:: \operatorname{spec}(C)
        """
        func = "ExplicitExactCurvature.eigenvalues"
        xp = self._check_state(func, state)
        if use_cached and "eigen" in state.cache:
            return state.cache["eigen"][0]
        check_array(func, "state.matrix", state.matrix.raw)
        with _matrix_named(func, state), errors_named(func):
            return clipped_eigh.kernel(xp, state.matrix.value,
                                       self.eigenvalue_clipping_threshold)[0]

    def block_eigenvalues(self, state, use_cached=False):
        r"""``(eigenvalues,)`` (one block).

        .. math:: (\operatorname{spec} C,)
        """
        return (self.eigenvalues(state, use_cached),)


