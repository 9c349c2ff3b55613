r"""kfac-jax-named curvature estimators over a :class:`kfac_ref.nn.Sequential` network.

* :class:`ImplicitExactCurvature` — matrix-free exact products (Hessian, GGN, Fisher, their
  factors, Jacobians);
* :class:`ExplicitExactCurvature` — one dense matrix over all parameters, estimated with any
  estimation mode and averaged with kfac-jax's weighted moving average;
* :class:`BlockDiagonalCurvature` — one :mod:`kfac_ref.blocks` block per parametric layer,
  driven by the layer inputs and back-propagated vectors of an estimation mode.

kfac-jax traces a loss function and finds layers and losses by their tags; here the network
and the loss are explicit: the estimators take ``(net, loss_fn)`` and ``func_args =
(params, batch)`` with ``batch = (inputs, targets)``.  Parameter vectors are flat arrays in
the canonical order (:meth:`kfac_ref.nn.Sequential.flatten`); a parameter structure is also
accepted and returned as given.

Scaling of the estimation modes (mean loss :math:`\frac1N\sum_n w\ell_n`):

================================  ==========================================================
mode                              curvature estimated (all three libraries agree unless noted)
================================  ==========================================================
``fisher_gradients``              MC Fisher, :math:`\mathbb E = F` (TF "gradients"/"empirical"
                                  with sampled targets; kfac-jax)
``fisher_curvature_prop``         :math:`\mathbb E = F` (Rademacher × Fisher factor)
``ggn_curvature_prop``            :math:`\mathbb E = G`
``fisher_exact`` / ``ggn_exact``  :math:`F` / :math:`G` (TF "exact"; kfac-jax)
``fisher_empirical``              :math:`\mathrm{EF} = \frac1N\sum g_n g_n^\top` by default
                                  (TF K-FAC, curvlinops, the seed's wording);
                                  ``empirical_fisher_normalization="kfac_jax"`` gives
                                  kfac-jax's :math:`\mathrm{EF}/N`
================================  ==========================================================

(:func:`kfac_ref.curvature.exact.estimation_output_vectors` defines the vectors.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_int,
    check_option,
    check_scalar,
    device_of,
    namespace_of,
    zeros_like_shape,
)
from ..averaging import WeightedMovingAverage
from ..blocks.kfac_jax import (
    CurvatureBlock,
    default_layer_to_block,
    layer_block,
    registered_layer_blocks,
)
from ..linalg import clipped_eigh, damped_matpower, kron_eigenbasis_matpower
from . import exact as E

__all__ = [
    "ImplicitExactCurvature",
    "ExplicitExactCurvature",
    "BlockDiagonalCurvature",
    "WEIGHT_SHARING_MODES",
    "default_layer_to_block",
]

WEIGHT_SHARING_MODES = ("expand", "reduce")
"""KFAC-expand and KFAC-reduce (Eschenhagen et al. 2023) for dense layers on ``[N, T, d]``."""


def _unpack_func_args(func, func_args):
    if not (isinstance(func_args, (tuple, list)) and len(func_args) == 2):
        raise KFACValueError(f"{func}: func_args must be (params, batch) with batch = "
                             f"(inputs, targets); got {type(func_args).__name__}.")
    return func_args[0], func_args[1]


def _flat_or_structured(func, net, vector):
    """(flat vector, restore) for a flat [P] vector or a parameter structure."""
    if isinstance(vector, (tuple, list)):
        vector = net.check_params(func, vector)
        return net.flatten(vector), net.unflatten
    check_array(func, "parameter_structured_vector", vector, shape=(net.num_params,),
                layout="[P]")
    return vector, lambda v: v


# ------------------------------------------------------------------------------------------
# Implicit exact curvature
# ------------------------------------------------------------------------------------------
class ImplicitExactCurvature:
    r"""Matrix-free exact curvature products (kfac-jax ``ImplicitExactCurvature``).

    .. math::

        Hv,\quad Gv = \tfrac1N\textstyle\sum_n J_n^\top G_n J_n v,\quad
        Fv = \tfrac1N\textstyle\sum_n J_n^\top F_n J_n v,\quad
        \mathcal B u = \tfrac{1}{\sqrt N}\textstyle\sum_n J_n^\top B_n u_n,\quad
        \mathcal B^\top v = [\tfrac{1}{\sqrt N} B_n^\top J_n v]_n .

    A thin class over :mod:`kfac_ref.curvature.exact`.

    Parameters
    ----------
    net : kfac_ref.nn.Sequential
    loss_fn : loss class or callable ``(outputs, targets) -> LossFunction``
    """

    def __init__(self, net, loss_fn):
        self.net = net
        self.loss_fn = loss_fn

    def _call(self, name, fn, func_args, vector, *extra):
        params, batch = _unpack_func_args(f"ImplicitExactCurvature.{name}", func_args)
        flat, back = _flat_or_structured(f"ImplicitExactCurvature.{name}", self.net, vector)
        return back(fn(self.net, self.loss_fn, params, batch, flat, *extra))

    def batch_size(self, func_args):
        r"""Number of examples of the batch (``inputs.shape[0]``).

        .. math:: N
        """
        _, batch = _unpack_func_args("ImplicitExactCurvature.batch_size", func_args)
        return int(batch[0].shape[0])

    def multiply_hessian(self, func_args, parameter_structured_vector):
        r"""Exact Hessian product (R-operator; :func:`.exact.hessian_vector_product`).

        .. math:: \nabla^2_\theta\mathcal L\, v
        """
        return self._call("multiply_hessian", E.hessian_vector_product, func_args,
                          parameter_structured_vector)

    def multiply_ggn(self, func_args, parameter_structured_vector):
        r"""GGN product.

        .. math:: Gv = \frac1N\sum_n J_n^\top G_n J_n v
        """
        return self._call("multiply_ggn", E.ggn_vector_product, func_args,
                          parameter_structured_vector)

    def multiply_fisher(self, func_args, parameter_structured_vector):
        r"""Exact Fisher product.

        .. math:: Fv = \frac1N\sum_n J_n^\top F_n J_n v
        """
        return self._call("multiply_fisher", E.fisher_vector_product, func_args,
                          parameter_structured_vector)

    def multiply_fisher_factor_transpose(self, func_args, parameter_structured_vector):
        r"""Transposed Fisher factor (returns ``(array,)``: one entry per loss, as kfac-jax).

        .. math:: \mathcal B^\top v = [B_n^\top J_n v/\sqrt N]_n,\qquad
            \mathcal B\mathcal B^\top = F
        """
        params, batch = _unpack_func_args("multiply_fisher_factor_transpose", func_args)
        flat, _ = _flat_or_structured("multiply_fisher_factor_transpose", self.net,
                                      parameter_structured_vector)
        return (E.fisher_factor_transpose_product(self.net, self.loss_fn, params, batch, flat),)

    def multiply_ggn_factor_transpose(self, func_args, parameter_structured_vector):
        r"""Transposed GGN factor (a 1-tuple).

        .. math:: \mathcal B^\top v,\qquad \mathcal B\mathcal B^\top = G
        """
        params, batch = _unpack_func_args("multiply_ggn_factor_transpose", func_args)
        flat, _ = _flat_or_structured("multiply_ggn_factor_transpose", self.net,
                                      parameter_structured_vector)
        return (E.ggn_factor_transpose_product(self.net, self.loss_fn, params, batch, flat),)

    def _inner(self, func, loss_inner_vectors):
        if isinstance(loss_inner_vectors, (tuple, list)):
            if len(loss_inner_vectors) != 1:
                raise KFACValueError(f"{func}: loss_inner_vectors must hold one array (one "
                                     f"loss); got {len(loss_inner_vectors)}.")
            return loss_inner_vectors[0]
        return loss_inner_vectors

    def multiply_fisher_factor(self, func_args, loss_inner_vectors):
        r"""Fisher factor times loss-inner vectors (flat [P]).

        .. math:: \mathcal B u = \frac{1}{\sqrt N}\sum_n J_n^\top B_n u_n
        """
        func = "ImplicitExactCurvature.multiply_fisher_factor"
        params, batch = _unpack_func_args(func, func_args)
        return E.fisher_factor_product(self.net, self.loss_fn, params, batch,
                                       self._inner(func, loss_inner_vectors))

    def multiply_ggn_factor(self, func_args, loss_inner_vectors):
        r"""GGN factor times loss-inner vectors (flat [P]).

        .. math:: \mathcal B u,\qquad \mathcal B\mathcal B^\top = G
        """
        func = "ImplicitExactCurvature.multiply_ggn_factor"
        params, batch = _unpack_func_args(func, func_args)
        return E.ggn_factor_product(self.net, self.loss_fn, params, batch,
                                    self._inner(func, loss_inner_vectors))

    def multiply_jacobian(self, func_args, parameter_structured_vector,
                          return_loss_objects=False):
        r""":math:`J v` as the loss's inputs: ``((dep_1, ...),)`` (one tuple per loss).

        .. math:: (J v)_n = J_n v
        """
        func = "ImplicitExactCurvature.multiply_jacobian"
        params, batch = _unpack_func_args(func, func_args)
        flat, _ = _flat_or_structured(func, self.net, parameter_structured_vector)
        b = E._Batch(func, self.net, self.loss_fn, params, batch)
        E._check_vec(func, b, flat)
        out = (b.as_tuple(b.jvp_flat(flat)),)
        return (out, (b.loss,)) if return_loss_objects else out

    def multiply_jacobian_transpose(self, func_args, loss_input_vectors,
                                    return_loss_objects=False):
        r""":math:`J^\top u = \sum_n J_n^\top u_n` for ``loss_input_vectors = ((dep_1, ...),)``.

        .. math:: J^\top u = \textstyle\sum_n J_n^\top u_n \quad(\text{no } 1/N)
        """
        func = "ImplicitExactCurvature.multiply_jacobian_transpose"
        params, batch = _unpack_func_args(func, func_args)
        b = E._Batch(func, self.net, self.loss_fn, params, batch)
        if not (isinstance(loss_input_vectors, (tuple, list)) and len(loss_input_vectors) == 1
                and isinstance(loss_input_vectors[0], (tuple, list))
                and len(loss_input_vectors[0]) == len(b.dep_shapes)):
            raise KFACValueError(f"{func}: loss_input_vectors must be ((v_1, ...),) with one "
                                 f"array per loss input {b.dep_shapes}; got "
                                 f"{type(loss_input_vectors).__name__}.")
        vecs = loss_input_vectors[0]
        for i, (v, s) in enumerate(zip(vecs, b.dep_shapes, strict=True)):
            namespace_of(func, x=b.out, **{f"loss_input_vectors[0][{i}]": v})
            check_array(func, f"loss_input_vectors[0][{i}]", v, shape=s)
        out = b.vjp(b.flat(vecs))
        return (out, (b.loss,)) if return_loss_objects else out

    def get_loss_inner_vector_shapes_and_batch_size(self, func_args, mode):
        r"""``((inner_shape,), N)`` for ``mode`` in {"fisher", "ggn"}.

        .. math:: u \in \mathbb R^{N \times K\dots},\quad B_n \in \mathbb R^{D\times K}
        """
        func = "ImplicitExactCurvature.get_loss_inner_vector_shapes_and_batch_size"
        check_option(func, "mode", mode, ("fisher", "ggn"))
        params, batch = _unpack_func_args(func, func_args)
        b = E._Batch(func, self.net, self.loss_fn, params, batch)
        if mode == "fisher":
            E._need_nll(func, b, "the Fisher factor")
        shape = (b.loss.fisher_factor_inner_shape if mode == "fisher"
                 else b.loss.ggn_factor_inner_shape)
        return (tuple(shape),), b.n

    def get_loss_input_shapes_and_batch_size(self, func_args):
        r"""``((shapes of the loss inputs,),), N``.

        .. math:: f_n \in \mathbb R^{D}
        """
        func = "ImplicitExactCurvature.get_loss_input_shapes_and_batch_size"
        params, batch = _unpack_func_args(func, func_args)
        b = E._Batch(func, self.net, self.loss_fn, params, batch)
        return (b.dep_shapes,), b.n


# ------------------------------------------------------------------------------------------
# Explicit exact curvature
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExplicitState:
    """State of :class:`ExplicitExactCurvature`: the dense average and a cache snapshot."""

    matrix: WeightedMovingAverage
    cache: Mapping


class _EstimatorBase:
    def _check_mode(self, func, mode):
        mode = self.default_estimation_mode if mode is None else mode
        return check_option(func, "estimation_mode", mode, E.ESTIMATION_MODES)

    def _check_ema(self, func, ema_old, ema_new):
        return (check_scalar(func, "ema_old", ema_old, nonnegative=True),
                check_scalar(func, "ema_new", ema_new, nonnegative=True))

    def _check_batch_size(self, func, batch_size, n):
        bs = check_int(func, "batch_size", batch_size, minimum=1)
        if bs != n:
            raise KFACValueError(f"{func}: batch_size must equal the number of examples in "
                                 f"func_args ({n}); got {bs}.")
        return bs


class ExplicitExactCurvature(_EstimatorBase):
    r"""Dense curvature over all parameters (kfac-jax ``ExplicitExactCurvature``).

    .. math::

        C \leftarrow \text{EMA}\Big(C,\ \frac1N\sum_c\sum_n (J_n^\top u_{c,n})
        (J_n^\top u_{c,n})^\top\Big),

    with the vectors of the estimation mode
    (:func:`kfac_ref.curvature.exact.estimation_output_vectors`); ``fisher_exact`` (the
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
        See :data:`kfac_ref.curvature.exact.EMPIRICAL_FISHER_NORMALIZATIONS`.
    eigenvalue_clipping_threshold : float
    """

    def __init__(self, net, loss_fn, default_estimation_mode=None, num_samples=1,
                 empirical_fisher_normalization="mean", eigenvalue_clipping_threshold=0.0):
        func = "ExplicitExactCurvature"
        self.net, self.loss_fn = net, loss_fn
        self.default_estimation_mode = check_option(
            func, "default_estimation_mode", default_estimation_mode or "fisher_exact",
            E.ESTIMATION_MODES)
        self.num_samples = check_int(func, "num_samples", num_samples, minimum=1)
        self.empirical_fisher_normalization = check_option(
            func, "empirical_fisher_normalization", empirical_fisher_normalization,
            E.EMPIRICAL_FISHER_NORMALIZATIONS)
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
        """
        func = "ExplicitExactCurvature.init"
        params, _ = _unpack_func_args(func, func_args)
        params = self.net.check_params(func, params)
        like = params[self.net.parametric_layers[0]][0]
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
        ema_old, ema_new = self._check_ema(func, ema_old, ema_new)
        params, batch = _unpack_func_args(func, func_args)
        self._check_batch_size(func, batch_size, int(batch[0].shape[0]))
        est = E.estimated_matrix(self.net, self.loss_fn, params, batch, mode, rng,
                                 self.num_samples, self.empirical_fisher_normalization)
        return ExplicitState(state.matrix.update(est, ema_old, ema_new), {})

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
        s, q = clipped_eigh(state.matrix.value, self.eigenvalue_clipping_threshold)
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
        lam = check_scalar(func, "identity_weight", identity_weight, nonnegative=True)
        p = check_scalar(func, "power", power)
        flat, back = _flat_or_structured(func, self.net, parameter_structured_vector)
        if use_cached:
            if "eigen" not in state.cache:
                raise KFACValueError(f"{func}: use_cached needs update_cache first; got an "
                                     f"empty cache.")
            s, q = state.cache["eigen"]
            xp = namespace_of(func, vector=flat, q=q)
            one = xp.ones((1,), dtype=s.dtype, device=device_of(s))
            out = kron_eigenbasis_matpower(s, q, one, None, xp.reshape(flat, (-1, 1)), p, lam)
            return back(xp.reshape(out, (-1,)))
        mat = damped_matpower(state.matrix.value, p, lam, self.eigenvalue_clipping_threshold)
        return back(mat @ flat)

    def eigenvalues(self, state, use_cached=False):
        r"""Eigenvalues of :math:`C` (clipped, ascending).

        .. math:: \operatorname{spec}(C)
        """
        if use_cached and "eigen" in state.cache:
            return state.cache["eigen"][0]
        return clipped_eigh(state.matrix.value, self.eigenvalue_clipping_threshold)[0]

    def block_eigenvalues(self, state, use_cached=False):
        r"""``(eigenvalues,)`` (one block).

        .. math:: (\operatorname{spec} C,)
        """
        return (self.eigenvalues(state, use_cached),)


# ------------------------------------------------------------------------------------------
# Block-diagonal curvature
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockDiagonalState:
    """State of :class:`BlockDiagonalCurvature`: one block state per parametric layer."""

    blocks_states: tuple


class BlockDiagonalCurvature(_EstimatorBase):
    r"""Block-diagonal curvature estimator (kfac-jax ``BlockDiagonalCurvature``).

    .. math::

        C \approx \mathrm{diag}(C_1, \dots, C_L), \qquad
        C_l = \text{block}_l\big(\{x_{l-1,n}\}, \{g_{l,c,n}\}\big),\quad
        g_{l,c,n} = \frac{\partial}{\partial s_l} \langle u_{c,n}, f(\theta, x_n)\rangle,

    where :math:`x_{l-1}` is layer :math:`l`'s input, :math:`s_l` its output and
    :math:`u_{c,n}` the output vectors of the estimation mode
    (:func:`kfac_ref.curvature.exact.estimation_output_vectors`).  When a mode has several
    vectors (``*_exact``: one per output coordinate; ``num_samples > 1``) every block is
    updated once per vector with the vectors scaled by :math:`\sqrt C` and the weight
    ``ema_new / C`` (``ema_old`` only on the first), as kfac-jax does for its exact modes:
    input statistics are averaged over the vectors, output statistics summed.  For
    ``num_samples = M > 1`` the same weighting averages the M samples; kfac-jax's sample loop
    instead adds every sample with the full ``ema_new``, which agrees when ``ema_old = 0`` and
    otherwise gives the new batch M times the weight.

    Dense layers on ``[N, T, d]`` inputs (weight sharing) use KFAC-expand or KFAC-reduce
    (Eschenhagen et al. 2023, FORMULAS.md §2.3), chosen by ``weight_sharing``:

    .. math::

        \text{expand: } T\cdot\Big(\frac{1}{NT}\sum_{n,t}\bar x_{n,t}\bar x_{n,t}^\top\Big)
        \otimes\Big(\frac{1}{NT}\sum_{n,t} g_{n,t}g_{n,t}^\top\Big),\qquad
        \text{reduce: } \Big(\frac1N\sum_n \bar{\bar x}_n\bar{\bar x}_n^\top\Big)\otimes
        \Big(\frac1N\sum_n \hat g_n\hat g_n^\top\Big),

    with :math:`\bar{\bar x}_n = [\frac1T\sum_t x_{n,t}; 1]` and :math:`\hat g_n=\sum_t g_{n,t}`.
    Expand is fed to the block as :math:`NT` rows with the scale :math:`T` carried by the
    block (like KFC's :math:`|T|`); reduce as :math:`N` pooled rows.  ``DenseFull`` /
    ``DenseDiagonal`` on ``[N, T, d]`` inputs see the same rows (an approximation, without the
    :math:`T` scale); ``NaiveFull`` / ``NaiveDiagonal`` receive per-example gradients and are
    exact in every case.  Convolutions use KFC (= KFAC-expand) by default; with
    ``weight_sharing="reduce"`` (for that layer) a ``Conv2DTwoKroneckerFactored`` entry becomes
    a dense Kronecker block on the location-averaged patches :math:`\frac1{|T|}\sum_t \bar p_{n,t}`
    and the location-summed gradients :math:`\sum_t g_{n,t}` (KFAC-reduce).

    Parameters
    ----------
    net : kfac_ref.nn.Sequential
    loss_fn : loss class or callable ``(outputs, targets) -> LossFunction``
    default_estimation_mode : str, optional
        ``"ggn_curvature_prop"`` when None (kfac-jax's default).
    layer_to_block : mapping, optional
        Overrides of :func:`default_layer_to_block`, keyed by layer name (first) or layer
        kind; values are block classes of :mod:`kfac_ref.blocks.kfac_jax` or factories
        ``factory(layer, input_shape) -> block``.  ``Naive*`` / ``Full`` / ``Diagonal`` blocks
        receive per-example parameter gradients as their sources, which makes ``NaiveFull``
        the exact block.
    weight_sharing : {"expand", "reduce"} or mapping name -> mode
        For dense layers on ``[N, T, d]`` inputs and convolutions (default ``"expand"``).
    num_samples : int
        Samples per example for the stochastic modes.
    empirical_fisher_normalization : {"mean", "kfac_jax"}
        ``"mean"`` (default): the empirical Fisher :math:`\frac1N\sum g g^\top`; ``"kfac_jax"``:
        kfac-jax's extra :math:`1/N`.
    block_kwargs : mapping, optional
        Extra keyword arguments for every block constructor (e.g. ``symmetrize=False``).
    """

    def __init__(self, net, loss_fn, default_estimation_mode=None, layer_to_block=None,
                 weight_sharing="expand", num_samples=1, empirical_fisher_normalization="mean",
                 block_kwargs=None):
        func = "BlockDiagonalCurvature"
        self.net, self.loss_fn = net, loss_fn
        self.default_estimation_mode = check_option(
            func, "default_estimation_mode", default_estimation_mode or "ggn_curvature_prop",
            E.ESTIMATION_MODES)
        self.layer_to_block = dict(layer_to_block or {})
        if isinstance(weight_sharing, str):
            check_option(func, "weight_sharing", weight_sharing, WEIGHT_SHARING_MODES)
        elif isinstance(weight_sharing, Mapping):
            for k, v in weight_sharing.items():
                check_option(func, f"weight_sharing[{k!r}]", v, WEIGHT_SHARING_MODES)
        else:
            raise KFACTypeError(f"{func}: weight_sharing must be 'expand', 'reduce' or a "
                                f"mapping layer name -> mode; got {type(weight_sharing).__name__}.")
        self.weight_sharing = weight_sharing
        self.num_samples = check_int(func, "num_samples", num_samples, minimum=1)
        self.empirical_fisher_normalization = check_option(
            func, "empirical_fisher_normalization", empirical_fisher_normalization,
            E.EMPIRICAL_FISHER_NORMALIZATIONS)
        self.block_kwargs = dict(block_kwargs or {})
        self._blocks = None
        self._input_shapes = None

    # -- structure ------------------------------------------------------------------------------
    @property
    def layer_indices(self):
        r"""Indices (in ``net.layers``) of the layers that own a block, in forward order.

        .. math:: \{l : P_l > 0\}
        """
        return self.net.parametric_layers

    @property
    def blocks(self):
        r"""The block objects (after :meth:`init`).

        .. math:: (\text{block}_l)_{l : P_l > 0}
        """
        if self._blocks is None:
            raise KFACValueError("BlockDiagonalCurvature: blocks must be created by init "
                                 "first; got an estimator that was not initialised.")
        return self._blocks

    @property
    def block_dims(self):
        r"""Number of parameters of each block.

        .. math:: (P_l)_{l : P_l > 0}
        """
        return tuple(self.net.layer_sizes[i] for i in self.layer_indices)

    @property
    def dim(self):
        r"""Number of parameters.

        .. math:: P
        """
        return self.net.num_params

    def _sharing(self, name):
        if isinstance(self.weight_sharing, str):
            return self.weight_sharing
        return self.weight_sharing.get(name, "expand")

    def _make_block(self, i, input_shape):
        layer, name = self.net.layers[i], self.net.names[i]
        ctor = self.layer_to_block.get(name, self.layer_to_block.get(layer.kind))
        if ctor is None or isinstance(ctor, str):
            try:
                ctor = layer_block(layer.kind, ctor)
            except KFACValueError:
                raise KFACValueError(
                    f"BlockDiagonalCurvature: layer_to_block must give a block for layer "
                    f"{name!r} of kind {layer.kind!r} (a block class, a factory or one of "
                    f"{tuple(registered_layer_blocks().get(layer.kind, {}))}); got "
                    f"{ctor!r}.") from None
        if isinstance(ctor, type) and issubclass(ctor, CurvatureBlock):
            kw = dict(self.block_kwargs)
            kw.setdefault("name", name)
            return ctor.from_layer(layer, tuple(input_shape),
                                   weight_sharing=self._sharing(name), **kw)
        if callable(ctor) and not isinstance(ctor, type):
            return ctor(layer, input_shape)
        raise KFACTypeError(f"BlockDiagonalCurvature: the block for layer {name!r} must be a "
                            f"kfac_ref.blocks.kfac_jax block class, a registered name or a "
                            f"factory; got {ctor!r}.")

    # -- state ------------------------------------------------------------------------------------
    def init(self, rng, func_args, exact_powers_to_cache=None, approx_powers_to_cache=None,
             cache_eigenvalues=False):
        r"""Create the blocks from the layers' input shapes and return zero statistics.

        .. math:: C_{l,0} = 0 \quad \text{for every block}

        ``rng`` is accepted for kfac-jax parity and unused.
        """
        func = "BlockDiagonalCurvature.init"
        params, batch = _unpack_func_args(func, func_args)
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        params = self.net.check_params(func, params)
        self.net.check_input(func, x, self.net._like(params))
        shapes, shape = [], tuple(x.shape)
        for layer in self.net.layers:
            shapes.append(shape)
            shape = layer.output_shape(shape)
        self._input_shapes = tuple(shapes)
        self._blocks = tuple(self._make_block(i, shapes[i]) for i in self.layer_indices)
        like = params[self.layer_indices[0]][0]
        return BlockDiagonalState(tuple(
            b.init(like, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues)
            for b in self._blocks))

    def update_curvature_matrix_estimate(self, state, ema_old, ema_new, batch_size, rng,
                                         func_args, estimation_mode=None):
        r"""Update every block from one batch (kfac-jax semantics, see the class docstring).

        .. math::

            C_l \leftarrow \text{EMA}\Big(C_l,\ \frac1C\sum_{c=1}^{C}
            \text{stat}_l\big(x, \sqrt C\, g_c\big)\Big)
        """
        func = "BlockDiagonalCurvature.update_curvature_matrix_estimate"
        mode = self._check_mode(func, estimation_mode)
        ema_old, ema_new = self._check_ema(func, ema_old, ema_new)
        params, batch = _unpack_func_args(func, func_args)
        if self._blocks is None:
            raise KFACValueError(f"{func}: the estimator must be initialised with init first; "
                                 f"got an uninitialised estimator.")
        self._check_state(func, state)
        b = E._Batch(func, self.net, self.loss_fn, params, batch)
        self._check_batch_size(func, batch_size, b.n)
        for i in self.layer_indices:  # blocks were built for init's shapes (T, |T|, ...)
            got, want = tuple(b.inputs[i].shape[1:]), tuple(self._input_shapes[i][1:])
            if got != want:
                raise KFACValueError(
                    f"{func}: func_args must give layer {self.net.names[i]!r} the per-example "
                    f"input shape it had at init {want} (its block depends on it); got {got}.")
        vectors = E._estimation_vectors(func, b, mode, rng, self.num_samples,
                                        self.empirical_fisher_normalization)
        c = len(vectors)
        root = math.sqrt(c)
        if c > 1 and mode not in ("fisher_exact", "ggn_exact"):
            root = 1.0  # stochastic vectors already carry 1/sqrt(M): undo it, average by EMA
            vectors = [v * math.sqrt(c) for v in vectors]
        states = list(state.blocks_states)
        need_grads = any(bl.uses_params_grads for bl in self._blocks)
        for j, u in enumerate(vectors):
            u = u * root if root != 1.0 else u
            grads, cots = self.net._backward(b.params, b.inputs, b.as_output(u),
                                             per_example=need_grads)
            old = ema_old if j == 0 else 1.0
            for k, (i, block) in enumerate(zip(self.layer_indices, self._blocks, strict=True)):
                data, rows = block.layer_estimation_data(
                    self.net.layers[i], b.inputs[i], cots[i], grads[i], b.n,
                    self._sharing(self.net.names[i]))
                states[k] = block.update_curvature_matrix_estimate(states[k], data, old,
                                                                   ema_new / c, rows)
        return BlockDiagonalState(tuple(states))

    def _check_state(self, func, state):
        if not isinstance(state, BlockDiagonalState) or len(state.blocks_states) != len(
                self.blocks):
            raise KFACTypeError(f"{func}: state must be a BlockDiagonalState from init with "
                                f"{len(self.blocks)} blocks; got {type(state).__name__}.")

    def _weights(self, func, identity_weight):
        if isinstance(identity_weight, Sequence) and not isinstance(identity_weight, str):
            if len(identity_weight) != len(self.blocks):
                raise KFACValueError(f"{func}: identity_weight must be a scalar or one value per "
                                     f"block ({len(self.blocks)}); got {len(identity_weight)}.")
            return tuple(check_scalar(func, "identity_weight", w, nonnegative=True)
                         for w in identity_weight)
        w = check_scalar(func, "identity_weight", identity_weight, nonnegative=True)
        return (w,) * len(self.blocks)

    def update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues,
                     pmap_axis_name=None, norm_to_scale_identity_weight_per_block=None):
        r"""Update every block's cache with its (possibly norm-scaled) identity weight.

        .. math:: \lambda_l = w_l \ \text{or}\ w_l\,\|C_l\|_{\text{norm}}

        Unlike kfac-jax (PEERS.md: its ``update_cache`` drops the per-block norm scaling), the
        norm scaling is passed to the blocks, so cached and uncached products agree.
        """
        func = "BlockDiagonalCurvature.update_cache"
        self._check_state(func, state)
        ws = self._weights(func, identity_weight)
        return BlockDiagonalState(tuple(
            bl.update_cache(st, w, exact_powers, approx_powers, eigenvalues,
                            norm_to_scale_identity_weight_per_block)
            for bl, st, w in zip(self.blocks, state.blocks_states, ws, strict=True)))

    def _split(self, xp, flat):
        """Flat [P] -> per block, a tuple of arrays of the block's ``parameters_shapes``."""
        out = []
        for i, bl in zip(self.layer_indices, self.blocks, strict=True):
            start = self.net.layer_slices()[i].start
            arrays = []
            for shape in bl.parameters_shapes:
                size = math.prod(shape)
                arrays.append(xp.reshape(flat[start:start + size], shape))
                start += size
            out.append(tuple(arrays))
        return out

    def multiply_matpower(self, state, parameter_structured_vector, identity_weight, power,
                          exact_power, use_cached, pmap_axis_name=None,
                          norm_to_scale_identity_weight_per_block=None):
        r"""Block-wise :math:`(C_l + \lambda_l I)^p v_l`.

        .. math:: \big[(C_l + \lambda_l I)^{p} v_l\big]_l

        ``identity_weight`` is a scalar or one value per block; with
        ``norm_to_scale_identity_weight_per_block`` each is multiplied by its block's norm.
        """
        func = "BlockDiagonalCurvature.multiply_matpower"
        self._check_state(func, state)
        flat, back = _flat_or_structured(func, self.net, parameter_structured_vector)
        xp = namespace_of(func, vector=flat)
        ws = self._weights(func, identity_weight)
        outs = []
        for bl, st, v, w in zip(self.blocks, state.blocks_states, self._split(xp, flat), ws,
                                strict=True):
            r = bl.multiply_matpower(st, v, w, power, exact_power, use_cached,
                                     norm_to_scale_identity_weight_per_block)
            outs.append(xp.concat([xp.reshape(a, (-1,)) for a in r]))
        return back(xp.concat(outs))

    def block_eigenvalues(self, state, use_cached=False):
        r"""Eigenvalues of each block, in block order.

        .. math:: (\operatorname{spec} C_l)_l
        """
        self._check_state("BlockDiagonalCurvature.block_eigenvalues", state)
        return tuple(bl.eigenvalues(st, use_cached)
                     for bl, st in zip(self.blocks, state.blocks_states, strict=True))

    def eigenvalues(self, state, use_cached=False):
        r"""All eigenvalues, block after block (not sorted globally).

        .. math:: \operatorname{spec}\,\mathrm{diag}(C_1,\dots,C_L)
        """
        ev = self.block_eigenvalues(state, use_cached)
        xp = namespace_of("BlockDiagonalCurvature.eigenvalues", e=ev[0])
        return xp.concat([xp.reshape(e, (-1,)) for e in ev])

    def to_diagonal_block_dense_matrix(self, state):
        r"""Dense matrix of each block (flat order: the layer's canonical order).

        .. math:: (C_1, \dots, C_L)
        """
        self._check_state("BlockDiagonalCurvature.to_diagonal_block_dense_matrix", state)
        return tuple(bl.to_dense_matrix(st)
                     for bl, st in zip(self.blocks, state.blocks_states, strict=True))

    def to_dense_matrix(self, state):
        r"""The block-diagonal matrix over all parameters (canonical order; parameter-free
        layers own no rows).

        .. math:: \mathrm{diag}(C_1, \dots, C_L) \in \mathbb R^{P\times P}
        """
        return block_diag(self.to_diagonal_block_dense_matrix(state))


def block_diag(blocks):
    r"""Block-diagonal matrix from square blocks (array-API concatenation, no mutation).

    .. math:: \mathrm{diag}(B_1, \dots, B_L)
    """
    func = "block_diag"
    xp = namespace_of(func, **{f"b{i}": b for i, b in enumerate(blocks)})
    sizes = [int(b.shape[0]) for b in blocks]
    total = sum(sizes)
    rows, start = [], 0
    for b, s in zip(blocks, sizes, strict=True):
        parts = []
        if start:
            parts.append(zeros_like_shape(b, (s, start)))
        parts.append(b)
        if total - start - s:
            parts.append(zeros_like_shape(b, (s, total - start - s)))
        rows.append(xp.concat(parts, axis=1))
        start += s
    return xp.concat(rows, axis=0)
