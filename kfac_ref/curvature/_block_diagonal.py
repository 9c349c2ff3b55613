r"""The block-diagonal K-FAC estimator (kfac-jax ``BlockDiagonalCurvature``); documented in
:mod:`kfac_ref.curvature`."""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._backend import (
    KFACTypeError,
    KFACValueError,
    any_true,
    array_namespace,
    check_array,
    check_bool,
    check_int,
    check_option,
    check_scalar,
    check_scalars_with,
    check_square,
    describe,
    errors_named,
    is_lazy,
    kernel_of,
    namespace_of,
    read_checks_once,
    value_checks,
    value_checks_enabled,
    zeros_like_shape,
)
from .._pytrees import frozen, state_class
from .._support import capabilities
from ..blocks.kfac_jax import CurvatureBlock, layer_block, registered_layer_blocks
from . import _exact as exact
from ._estimator_args import EstimatorBase, flat_or_structured, unpack_func_args

WEIGHT_SHARING_MODES = ("expand", "reduce")
"""KFAC-expand and KFAC-reduce (Eschenhagen et al. 2023) for dense layers on ``[N, T, d]``."""


# ------------------------------------------------------------------------------------------
# Block-diagonal curvature
# ------------------------------------------------------------------------------------------
@capabilities(dask="yes", formula="a state container: one block state per layer")
@dataclass(frozen=True)
class BlockDiagonalState:
    r"""Immutable state of :class:`BlockDiagonalCurvature`: one block state per parametric
    layer, in the network's layer order (a JAX pytree whose children are the block states).

    .. math::

        \text{state} = (s_1, \dots, s_L), \qquad
        \hat C = \operatorname{blockdiag}(\hat C_1(s_1), \dots, \hat C_L(s_L))

    Attributes
    ----------
    blocks_states : tuple of BlockState
        The state of each layer's block (:class:`kfac_ref.blocks.kfac_jax.BlockState`).
    """

    blocks_states: tuple


# A JAX pytree (kfac_ref._pytrees): the blocks' states are its children.
state_class(BlockDiagonalState, lambda st: ((st.blocks_states,), None),
            lambda aux, children: frozen(BlockDiagonalState, blocks_states=children[0]))


@capabilities(jit="yes", dask="yes")
class BlockDiagonalCurvature(EstimatorBase):
    r"""Block-diagonal curvature estimator (kfac-jax ``BlockDiagonalCurvature``).

    .. math::

        &C \approx \mathrm{diag}(C_1, \dots, C_L), \qquad
        C_l = \text{block}_l\big(\{x_{l-1,n}\}, \{g_{l,c,n}\}\big),

        &g_{l,c,n} = \frac{\partial}{\partial s_l} \langle u_{c,n}, f(\theta, x_n)\rangle,

    where :math:`x_{l-1}` is layer :math:`l`'s input, :math:`s_l` its output and
    :math:`u_{c,n}` the output vectors of the estimation mode
    (:func:`kfac_ref.curvature.estimation_output_vectors`).  When a mode has several
    vectors (``*_exact``: one per output coordinate; ``num_samples > 1``) every block is
    updated once per vector with the vectors scaled by :math:`\sqrt C` and the weight
    ``ema_new / C`` (``ema_old`` only on the first), as kfac-jax does for its exact modes:
    input statistics are averaged over the vectors, output statistics summed.  For
    ``num_samples = M > 1`` the same weighting averages the M samples; kfac-jax's sample loop
    instead adds every sample with the full ``ema_new``, which agrees when ``ema_old = 0`` and
    otherwise gives the new batch M times the weight.

    Kronecker blocks take these C updates as one: with :math:`S` a factor's running sum and
    :math:`W` its weight, the C updates give
    :math:`S \leftarrow \texttt{ema\_old}\,S + \frac{\texttt{ema\_new}}{C}\sum_c \hat S_c`,
    :math:`W \leftarrow \texttt{ema\_old}\,W + \texttt{ema\_new}`, i.e. one update with
    ``ema_old``, ``ema_new`` and the statistic :math:`\frac1C\sum_c \hat S_c`.  For
    :math:`A` every :math:`\hat S_c` is the same :math:`\hat A(x)`, computed once; for
    :math:`G` the mean over vectors of :math:`\frac1R\sum_r (\sqrt C g_{c,r})(\sqrt C
    g_{c,r})^\top` (:math:`R` rows per vector) is the second moment of the :math:`CR`
    stacked rows, one GEMM.  Other blocks are updated once per vector as above.  A block
    that reads a statistic its layer's forward pass computes
    (:meth:`~kfac_ref.blocks.kfac_jax.CurvatureBlock.layer_tap`: the KFC input factor
    :math:`\Omega` of a :class:`kfac_ref.nn.Conv2D`, from the patches of the forward's own
    chunks, :meth:`kfac_ref.nn.Conv2D.forward_with_tap`) is handed it, so a convolution's
    patches are extracted once per update for the forward pass and :math:`\Omega` together.

    Dense layers on ``[N, T, d]`` inputs (weight sharing) use KFAC-expand or KFAC-reduce
    (Eschenhagen et al. 2023), chosen by ``weight_sharing``:

    .. math::

        \text{expand: } &T\cdot\Big(\frac{1}{NT}\sum_{n,t}\bar x_{n,t}\bar x_{n,t}^\top\Big)
        \otimes\Big(\frac{1}{NT}\sum_{n,t} g_{n,t}g_{n,t}^\top\Big),

        \text{reduce: } &\Big(\frac1N\sum_n \bar{\bar x}_n\bar{\bar x}_n^\top\Big)\otimes
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
        ``factory(layer, input_shape) -> block`` returning a
        :class:`~kfac_ref.blocks.kfac_jax.CurvatureBlock`.  ``Naive*`` / ``Full`` /
        ``Diagonal`` blocks receive per-example parameter gradients as their sources, which
        makes ``NaiveFull`` the exact block.
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
            exact.ESTIMATION_MODES)
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
            exact.EMPIRICAL_FISHER_NORMALIZATIONS)
        self.block_kwargs = dict(block_kwargs or {})
        self._blocks = None
        self._input_shapes = None
        self._forget_states()

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
            block = ctor(layer, input_shape)
            if not isinstance(block, CurvatureBlock):
                raise KFACTypeError(
                    f"BlockDiagonalCurvature: the factory for layer {name!r} must return a "
                    f"kfac_ref.blocks.kfac_jax.CurvatureBlock; got {type(block).__name__}.")
            return block
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
        params, batch = unpack_func_args(func, func_args)
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        params = self.net.check_params_and_input(func, params, x)
        shapes = self.net.input_shapes(tuple(x.shape))
        blocks = tuple(self._make_block(i, shapes[i]) for i in self.layer_indices)
        like = params[self.layer_indices[0]][0]
        # the blocks' states before any attribute changes: an option a block refuses leaves
        # the estimator as it was, and the error is this method's, with the block named
        states = []
        for k, b in enumerate(blocks):
            with errors_named(func, inner=True, context=self._block_label(k)):
                states.append(b.init(like, exact_powers_to_cache, approx_powers_to_cache,
                                     cache_eigenvalues))
        self._input_shapes, self._blocks = shapes, blocks
        slices = self.net.layer_slices()
        self._block_slices = tuple(slices[i] for i in self.layer_indices)
        # the layers whose forward pass computes a statistic their block reads (Conv2D's Ω)
        wants = {i: not bl.uses_params_grads and bl.uses_layer_tap(self.net.layers[i], shapes[i])
                 for i, bl in zip(self.layer_indices, self._blocks, strict=True)}
        self._taps = tuple(wants.get(i, False) for i in range(len(self.net.layers)))
        self._forget_states()  # checked against the old blocks
        return self._checked(BlockDiagonalState(tuple(states)))

    def _block_label(self, k):
        """How an error names block ``k``: its index and its layer's name."""
        return f"block {k} (layer {self.net.names[self.layer_indices[k]]!r})"

    def _per_block(self, func, state, call):
        """``call(k, block, block_state)`` for every block, in order; an error of block
        ``k`` is put under ``func`` with the block named (:meth:`_block_label`)."""
        out = []
        for k, (bl, st) in enumerate(zip(self.blocks, state.blocks_states, strict=True)):
            with errors_named(func, inner=True, context=self._block_label(k)):
                out.append(call(k, bl, st))
        return tuple(out)

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
        params, batch = unpack_func_args(func, func_args)
        if self._blocks is None:
            raise KFACValueError(f"{func}: the estimator must be initialised with init first; "
                                 f"got an uninitialised estimator.")
        likes = self._state_like(func, state)
        check_scalars_with(func, likes, ema_old=ema_old, ema_new=ema_new)
        # the state against the parameters, in the user's names (the blocks would name their
        # own internal arguments), before the forward pass
        first = self.layer_indices[0]
        if (isinstance(params, (tuple, list)) and len(params) > first
                and isinstance(params[first], (tuple, list)) and params[first]):
            namespace_of(func, **{f"params[{first}][0]": params[first][0]}, **likes)
        taps = self._layer_taps if any(self._taps) else None

        def evaluate():
            return exact.evaluate_batch(func, self.net, self.loss_fn, params, batch,
                                        layer_taps=taps)

        # the scans of the parameters, the input and the network output (the loss's inputs)
        # read back together, after the loss is built (a loss reads its targets' range at
        # once: they index the outputs); a failure evaluates again with each read at once
        b = (read_checks_once(array_namespace(*likes.values()), evaluate, func) if likes
             else evaluate())
        self._check_batch_size(func, batch_size, b.n)
        for i in self.layer_indices:  # blocks were built for init's shapes (T, |T|, ...)
            got, want = tuple(b.inputs[i].shape[1:]), tuple(self._input_shapes[i][1:])
            if got != want:
                raise KFACValueError(
                    f"{func}: func_args must give layer {self.net.names[i]!r} the per-example "
                    f"input shape it had at init {want} (its block depends on it); got {got}.")
        # [C, N, D]: the exact modes' C vectors from one call of the loss's dense factor
        vectors = exact.draw_estimation_stack(func, b, mode, rng, self.num_samples,
                                              self.empirical_fisher_normalization)
        c = int(vectors.shape[0])
        root = math.sqrt(c)
        if c > 1 and mode not in ("fisher_exact", "ggn_exact"):
            root = 1.0  # stochastic vectors already carry 1/sqrt(M): undo it, average by EMA
            vectors = vectors * math.sqrt(c)
        states = list(state.blocks_states)
        layers = tuple(zip(range(len(states)), self.layer_indices, self._blocks, strict=True))
        # blocks of layer quantities take one update from all vectors (Kronecker: A once, G
        # from the stacked rows); those of parameter gradients are updated once per vector
        # with ema_old first, then 1, weight ema_new/C
        stacked = {k: [] for k, _, bl in layers if not bl.uses_params_grads}
        need_grads = any(bl.uses_params_grads for bl in self._blocks)
        with value_checks(False):  # the blocks' data come from the arrays checked above
            states = self._update_blocks(b, vectors, root, states, layers, stacked, need_grads,
                                         ema_old, ema_new)
        # Finite inputs can still give non-finite statistics (their squares overflow), and a
        # state may have been built with value checks off: the statistics are scanned here,
        # where they enter the state, so that no product or cache refresh meets them later
        # (the scans of all blocks read back once)
        read_checks_once(b.xp, lambda: self._check_statistics(func, states), func)
        return self._checked(BlockDiagonalState(tuple(states)))

    def _check_statistics(self, func, states):
        for k, (st, block) in enumerate(zip(states, self.blocks, strict=True)):
            for i, average in enumerate(st.statistics):
                name = (f"the updated state.blocks_states[{k}].statistics[{i}] (layer "
                        f"{self.net.names[self.layer_indices[k]]!r})")
                raw = average.raw
                if i in block.semidefinite_statistics and getattr(raw, "ndim", None) == 2:
                    # a finite diagonal bounds every entry of a semidefinite statistic
                    # (CurvatureBlock.semidefinite_statistics): n entries scanned, not n²
                    name = f"the diagonal of {name}"
                    raw = array_namespace(raw).linalg.diagonal(raw)
                if isinstance(raw, (int, float)) and not isinstance(raw, bool):
                    # a family may keep a scalar statistic (NumPy reductions give
                    # numpy.float64, a float): only its finiteness is checked
                    if value_checks_enabled() and not math.isfinite(raw):
                        raise KFACValueError(f"{func}: {name} must be finite; got {raw!r}. "
                                             f"The statistics of func_args overflowed, or "
                                             f"state held non-finite statistics.")
                    continue
                try:
                    check_array(func, name, raw)
                except KFACValueError as exc:
                    raise KFACValueError(
                        f"{exc} The statistics of func_args overflowed "
                        f"{raw.dtype}, or state held non-finite statistics."
                    ) from None

    def _layer_taps(self, input_shapes):
        """The taps of a batch's forward pass: each marked layer's block's
        :meth:`~kfac_ref.blocks.kfac_jax.CurvatureBlock.layer_tap` for the layer's input
        shape in this batch (``None`` for the other layers)."""
        taps = [None] * len(self.net.layers)
        for i, block in zip(self.layer_indices, self._blocks, strict=True):
            if self._taps[i]:
                taps[i] = block.layer_tap(self.net.layers[i], input_shapes[i])
        return tuple(taps)

    def _update_blocks(self, b, vectors, root, states, layers, stacked, need_grads, ema_old,
                       ema_new):
        c = int(vectors.shape[0])
        if not need_grads and c > 1:
            # every block reads layer cotangents only: back-propagate the C vectors stacked,
            # one batched call per layer (Sequential.stacked_backward_pass); each block gets
            # its layer's C cotangents as views of the stacked result
            u = b.xp.reshape(vectors, (c, *b.out.shape))
            cots = self.net.stacked_backward_pass(b.forward, u * root if root != 1.0 else u,
                                                  caches=b.vjp_caches)
            for k, i, _ in layers:
                stacked[k] = [cots[i][j, ...] for j in range(c)]
            c_loop = 0
        else:
            c_loop = c
        for j in range(c_loop):
            u = vectors[j, ...]
            u = u * root if root != 1.0 else u
            grads, cots = self.net.backward_pass(b.forward, b.as_output(u),
                                                 per_example=need_grads,
                                                 param_grads=need_grads, caches=b.vjp_caches)
            old = ema_old if j == 0 else 1.0
            for k, i, block in layers:
                if k in stacked:
                    stacked[k].append(cots[i])
                    continue
                data, rows = block.layer_estimation_data(
                    self.net.layers[i], b.inputs[i], cots[i], grads[i], b.n,
                    self._sharing(self.net.names[i]))
                states[k] = block.update_curvature_matrix_estimate(states[k], data, old,
                                                                   ema_new / c, rows)
        for k, i, block in layers:
            if k in stacked:
                # only blocks that asked for a tap (uses_layer_tap) are given one
                tap = {} if b.taps[i] is None else {"layer_tap": b.taps[i]}
                states[k] = block.update_from_output_vectors(
                    states[k], self.net.layers[i], b.inputs[i], stacked[k], b.n,
                    self._sharing(self.net.names[i]), ema_old, ema_new, **tap)
        return states

    def _check_state(self, func, state):
        if not isinstance(state, BlockDiagonalState) or len(state.blocks_states) != len(
                self.blocks):
            raise KFACTypeError(f"{func}: state must be a BlockDiagonalState from init with "
                                f"{len(self.blocks)} blocks; got {type(state).__name__}.")

    def _state_like(self, func, state):
        """``{"state.blocks_states[0]": like}`` (empty without blocks) after checking
        ``state`` against the blocks: its type, each block state's structure, and one
        namespace, device and precision across the block states, so that an argument checked
        against the first block state's ``like`` agrees with all of them.

        A state is immutable: one that passed, or that this estimator made (``init``,
        ``update_curvature_matrix_estimate``, ``update_cache``), is remembered by identity,
        weakly, and not walked again; ``init`` makes new blocks and forgets them.  A state
        built on lists (which can change in place) is walked every time.
        """
        if state is None or self._checked_states.get(id(state)) is not state:
            self._check_state(func, state)
            likes = {}
            for k, (bl, st) in enumerate(zip(self.blocks, state.blocks_states, strict=True)):
                bl.check_state_structure(func, st)
                likes[f"state.blocks_states[{k}]"] = st.like
            if likes:
                namespace_of(func, **likes)
            self._checked(state)
        if not state.blocks_states:
            return {}
        return {"state.blocks_states[0]": state.blocks_states[0].like}

    def __getstate__(self):
        # the remembered states and plan are weak references to this process's objects
        return {k: v for k, v in self.__dict__.items()
                if k not in ("_checked_states", "_plan")}

    def __setstate__(self, attributes):
        self.__dict__.update(attributes)
        self._forget_states()

    def _forget_states(self):
        """Forget the states checked against the blocks and the product plan."""
        self._checked_states = weakref.WeakValueDictionary()
        self._plan = None

    def _checked(self, state):
        """``state``, remembered as checked against the blocks (see :meth:`_state_like`)
        when it is immutable down to the frozen averages: tuples, not lists."""
        if type(state.blocks_states) is tuple and all(
                type(st.statistics) is tuple for st in state.blocks_states):
            self._checked_states[id(state)] = state
        return state

    def _weights(self, func, identity_weight, likes):
        """One checked identity weight per block, from a scalar or a sequence; 0-D arrays
        checked against the state's ``likes`` (one namespace, device and precision)."""
        if type(identity_weight) is float:  # the common case, before the type probes
            return (check_scalar(func, "identity_weight", identity_weight, nonnegative=True),
                    ) * len(self.blocks)
        if isinstance(identity_weight, Sequence) and not isinstance(identity_weight, str):
            if len(identity_weight) != len(self.blocks):
                raise KFACValueError(f"{func}: identity_weight must be a scalar or one value per "
                                     f"block ({len(self.blocks)}); got {len(identity_weight)}.")
            ws = tuple(check_scalar(func, f"identity_weight[{k}]", w, nonnegative=True)
                       for k, w in enumerate(identity_weight))
            check_scalars_with(func, likes, **{f"identity_weight[{k}]": w
                                               for k, w in enumerate(ws)})
            return ws
        if type(identity_weight) is not float and getattr(identity_weight, "ndim", 0) != 0:
            raise KFACTypeError(f"{func}: identity_weight must be a scalar or a list or tuple "
                                f"of one scalar per block ({len(self.blocks)}); got "
                                f"{describe(identity_weight)}.")
        w = check_scalar(func, "identity_weight", identity_weight, nonnegative=True)
        check_scalars_with(func, likes, identity_weight=w)
        return (w,) * len(self.blocks)

    def update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues,
                     pmap_axis_name=None, norm_to_scale_identity_weight_per_block=None):
        r"""Update every block's cache with its (possibly norm-scaled) identity weight.

        .. math:: \lambda_l = w_l \ \text{or}\ w_l\,\|C_l\|_{\text{norm}}

        Unlike kfac-jax (its ``block_diagonal.py`` ``update_cache`` drops the per-block norm
        scaling; docs page *Findings*), the
        norm scaling is passed to the blocks, so cached and uncached products agree.

        The value checks of every block's refresh (Cholesky pivots, spectra) are read back
        to the host once for all the blocks; when one fails, the refresh runs again with
        each check read at once, which raises that check's own error.
        """
        func = "BlockDiagonalCurvature.update_cache"
        _check_pmap_axis_name(func, pmap_axis_name)
        likes = self._state_like(func, state)
        ws = self._weights(func, identity_weight, likes)
        norm = norm_to_scale_identity_weight_per_block
        if self.blocks:  # the options in this method's names; whether a power was declared
            # in init is each block's to say (under this method, the block named)
            exact_powers, approx_powers, eigenvalues, norm = self.blocks[0].check_cache_options(
                func, exact_powers, approx_powers, eigenvalues, norm,
                "norm_to_scale_identity_weight_per_block")

        def refresh():
            return self._per_block(func, state, lambda k, bl, st: bl.update_cache(
                st, ws[k], exact_powers, approx_powers, eigenvalues, norm))

        # a kernel's unnamed error (a namespace without linalg.eigh) in this method's name
        with errors_named(func), _statistics_named(func, state):
            # the blocks' own deferred checks collect into this one (one read for all)
            states = (read_checks_once(array_namespace(*likes.values()), refresh, func)
                      if likes else refresh())
            return self._checked(BlockDiagonalState(states))

    def multiply_matpower(self, state, parameter_structured_vector, identity_weight, power,
                          exact_power, use_cached, pmap_axis_name=None,
                          norm_to_scale_identity_weight_per_block=None):
        r"""Block-wise :math:`(C_l + \lambda_l I)^p v_l`.

        .. math:: \big[(C_l + \lambda_l I)^{p} v_l\big]_l

        ``identity_weight`` is a scalar or one value per block; with
        ``norm_to_scale_identity_weight_per_block`` each is multiplied by its block's norm.
        The arguments are checked once here (the state's structure and one namespace over
        its block states, then the vector against them and one finiteness scan of the
        vector); the blocks then run their unchecked product kernels.  A state this
        estimator made or checked before is not walked again (states are immutable).

        A cached product without norm scaling, with a Python float ``identity_weight`` and
        ``power``, keeps a plan for its state: each block's cached product bound to the
        state and the options
        (:meth:`~kfac_ref.blocks.kfac_jax.CurvatureBlock.cached_flat_product`).
        The next products of that state with equal options check the vector and run the
        plan, without the options' checks and the dispatch to each block (the state's
        blocks must all have one).  One plan is kept, for the last state, and dropped with
        it; none is kept for traced or lazy arrays, or for a state built on lists.
        """
        func = "BlockDiagonalCurvature.multiply_matpower"
        _check_pmap_axis_name(func, pmap_axis_name)
        # the vector (every member of a structured one) against the states: one namespace,
        # device and precision, before anything is concatenated
        likes = self._state_like(func, state)
        flat, back = flat_or_structured(func, self.net, parameter_structured_vector, **likes)
        key = _plan_key(identity_weight, power, exact_power, use_cached,
                        norm_to_scale_identity_weight_per_block, flat, likes)
        plan = self._plan
        if key is not None and plan is not None and plan[0]() is state and plan[1] == key:
            # options that passed with this state before: the blocks' bound products
            with _statistics_named(func, state):
                return back(array_namespace(flat).concat([f(flat[sl]) for f, sl in plan[2]]))
        ws = self._weights(func, identity_weight, likes)
        # the scalar options once, then whether each block takes an approximate power
        blocks = self.blocks
        opts = blocks[0].check_product_options(
            func, power, exact_power, use_cached, norm_to_scale_identity_weight_per_block,
            "norm_to_scale_identity_weight_per_block")
        check_scalars_with(func, likes, power=opts[0])
        if not opts[1]:
            for bl in blocks[1:]:
                bl.check_approx_power(func, opts[0])
        xp = array_namespace(flat)  # checked with the states above
        outs = []
        with _statistics_named(func, state):
            try:  # not errors_named per block: its enter and exit would cost every product
                for bl, st, sl, w in zip(blocks, state.blocks_states, self._block_slices, ws,
                                         strict=True):
                    outs.append(bl.multiply_matpower_flat_kernel(func, xp, st, flat[sl], w,
                                                                 *opts))
            except KFACValueError:  # a block's values (a type error concerns them all)
                with errors_named(func, inner=True, context=self._block_label(len(outs))):
                    raise
            except KFACTypeError:  # a kernel's (a namespace without linalg.eigh, say)
                with errors_named(func):
                    raise
        if key is not None:
            self._remember_plan(xp, state, key, ws, opts)
        return back(xp.concat(outs))

    def _remember_plan(self, xp, state, key, ws, opts):
        """Keep the blocks' cached products bound to ``state`` and these options (see
        :meth:`~kfac_ref.blocks.kfac_jax.CurvatureBlock.cached_flat_product`) for the next
        products, when every block has one: one plan, for the last state, weakly (it is
        dropped with the state).  Only for a state remembered as immutable
        (:meth:`_checked`)."""
        if self._checked_states.get(id(state)) is not state:
            return
        fns = []
        for bl, st, sl, w in zip(self.blocks, state.blocks_states, self._block_slices, ws,
                                 strict=True):
            f = bl.cached_flat_product(xp, st, w, opts[0], opts[1])
            if f is None:
                return
            fns.append((f, sl))
        self._plan = (weakref.ref(state, self._forget_plan), key, tuple(fns))

    def _forget_plan(self, ref):
        if self._plan is not None and self._plan[0] is ref:
            self._plan = None

    def block_eigenvalues(self, state, use_cached=False):
        r"""Eigenvalues of each block, in block order.

        .. math:: (\operatorname{spec} C_l)_l
        """
        return self._block_eigenvalues("BlockDiagonalCurvature.block_eigenvalues", state,
                                       use_cached)

    def _block_eigenvalues(self, func, state, use_cached):
        self._state_like(func, state)
        check_bool(func, "use_cached", use_cached)
        with _statistics_named(func, state):
            return self._per_block(func, state,
                                   lambda k, bl, st: bl.eigenvalues(st, use_cached))

    def eigenvalues(self, state, use_cached=False):
        r"""All eigenvalues, block after block (not sorted globally).

        .. math:: \operatorname{spec}\,\mathrm{diag}(C_1,\dots,C_L)
        """
        ev = self._block_eigenvalues("BlockDiagonalCurvature.eigenvalues", state, use_cached)
        xp = array_namespace(ev[0])  # one namespace: the block states were checked together
        return xp.concat([xp.reshape(e, (-1,)) for e in ev])

    def to_diagonal_block_dense_matrix(self, state):
        r"""Dense matrix of each block (flat order: the layer's canonical order).

        .. math:: (C_1, \dots, C_L)
        """
        return self._block_dense_matrices(
            "BlockDiagonalCurvature.to_diagonal_block_dense_matrix", state)

    def _block_dense_matrices(self, func, state):
        self._state_like(func, state)
        with _statistics_named(func, state):
            return self._per_block(func, state, lambda k, bl, st: bl.to_dense_matrix(st))

    def to_dense_matrix(self, state):
        r"""The block-diagonal matrix over all parameters (canonical order; parameter-free
        layers own no rows).

        .. math:: \mathrm{diag}(C_1, \dots, C_L) \in \mathbb R^{P\times P}
        """
        blocks = self._block_dense_matrices("BlockDiagonalCurvature.to_dense_matrix", state)
        return block_diag.kernel(array_namespace(blocks[0]), blocks)

    def sync(self, state, pmap_axis_name=None, *, batch_sizes=None):
        r"""The states of several shards combined into one (kfac-jax ``sync``; does not sync
        the cache).

        .. math::

            S_{l,i} = \sum_{k=1}^{K}\frac{n_k}{n}\,S^{(k)}_{l,i}, \qquad
            W_{l,i} = \sum_{k}\frac{n_k}{n}\,W^{(k)}_{l,i}, \qquad n = \sum_k n_k,

        for every statistic :math:`i` of every block :math:`l`
        (:func:`kfac_ref.averaging.sync_statistics`).  ``state`` is one
        ``BlockDiagonalState`` (one shard: returned unchanged, as kfac-jax on one
        device) or a list or tuple of them, one per shard, each updated from the same synced
        state with the same ``ema_old``, ``ema_new`` and estimation mode on its own
        :math:`n_k` examples; ``batch_sizes`` are the :math:`n_k` (``None``: equal shards,
        kfac-jax's ``pmean``).  Then the result equals the update on the whole batch, up to
        rounding, for every block whose statistics are means over examples (all blocks of
        :mod:`kfac_ref.blocks.kfac_jax`, in the deterministic modes ``*_exact`` and
        ``fisher_empirical`` with the ``"mean"`` normalisation; the stochastic modes agree in
        distribution; kfac-jax's ``"kfac_jax"`` empirical normalisation :math:`1/n^2` is not
        a mean and does not sync exactly).  ``pmap_axis_name`` is accepted for kfac-jax
        parity and ignored: the shards are passed explicitly.  The combined state keeps the
        first shard's cache.
        """
        from ..averaging import sync_statistics
        from ..blocks.kfac_jax import BlockState

        func = "BlockDiagonalCurvature.sync"
        _check_pmap_axis_name(func, pmap_axis_name)
        shards = state if isinstance(state, (list, tuple)) else (state,)
        if not shards:
            raise KFACValueError(f"{func}: state must be a BlockDiagonalState or a non-empty "
                                 f"list of them (one per shard); got an empty sequence.")
        # each shard checked as a state (once per state object), then the shards together
        namespace_of(func, **{f"state[{k}].blocks_states[0]": like
                              for k, st in enumerate(shards)
                              for like in self._state_like(f"{func} (state[{k}])", st).values()})
        if batch_sizes is not None:
            if not isinstance(batch_sizes, (list, tuple)) or len(batch_sizes) != len(shards):
                raise KFACValueError(f"{func}: batch_sizes must be None or one size per shard "
                                     f"({len(shards)}); got {batch_sizes!r}.")
            batch_sizes = [check_int(func, f"batch_sizes[{k}]", n, minimum=1)
                           for k, n in enumerate(batch_sizes)]
        if len(shards) == 1:
            return shards[0]
        total = sum(batch_sizes) if batch_sizes is not None else len(shards)
        fractions = tuple((n / total for n in batch_sizes) if batch_sizes is not None
                          else (1.0 / total,) * len(shards))
        out = []
        for j, first in enumerate(shards[0].blocks_states):
            stats = tuple(
                sync_statistics.kernel([st.blocks_states[j].statistics[i] for st in shards],
                                       fractions)
                for i in range(len(first.statistics)))
            out.append(BlockState(stats, first.cache, first.like))
        return BlockDiagonalState(tuple(out))


def _check_pmap_axis_name(func, pmap_axis_name):
    """kfac-jax's ``pmap_axis_name``: accepted for parity and ignored, so None or a str."""
    if pmap_axis_name is not None and not isinstance(pmap_axis_name, str):
        raise KFACTypeError(f"{func}: pmap_axis_name must be None or a str (ignored); got "
                            f"{describe(pmap_axis_name)}.")


def _plan_key(identity_weight, power, exact_power, use_cached, norm, flat, likes):
    """The key of a product plan (:meth:`BlockDiagonalCurvature._remember_plan`), or None
    for a call that takes none: a cached product without norm scaling, with a Python float
    weight and power and a bool ``exact_power`` (whose equal values passed the same checks),
    on eager arrays (a plan kept across a trace would keep its tracers).  Whether value
    checks run is part of the key: a cache built with an array weight is compared with the
    given one only while they do (``strict_cache``)."""
    if not (use_cached is True and norm is None and type(identity_weight) is float
            and type(power) is float and type(exact_power) is bool) or is_lazy(flat):
        return None
    for like in likes.values():
        if is_lazy(like):
            return None
    return (identity_weight, power, exact_power, value_checks_enabled())


class _statistics_named:  # noqa: N801 (used as a function, like errors_named)
    """Turn a failure of the blocks' kernels on a state with non-finite statistics (one
    built with value checks off: the statistics are scanned when they enter a state, see
    :meth:`BlockDiagonalCurvature.update_curvature_matrix_estimate`) into a
    :class:`KFACValueError` naming the statistic, in place of a kernel's unnamed error (the
    NaN spectrum of a non-finite factor refused by a negative power) or a library's own.
    The scan runs only after a failure; a failure of a finite state passes unchanged.  A
    class for the cost of its enter and exit, as :func:`~kfac_ref._backend.errors_named`."""

    __slots__ = ("func", "state")

    def __init__(self, func, state):
        self.func, self.state = func, state

    def __enter__(self):
        return None

    def __exit__(self, kind, exc, tb):
        if kind is None or not issubclass(kind, Exception) or issubclass(kind, KFACTypeError):
            return False  # a KFACTypeError is not about values: already named
        bad = _nonfinite_statistic(self.state)
        if bad is None:
            return False
        raise KFACValueError(f"{self.func}: state.{bad} must be finite (no NaN or Inf); got "
                             f"non-finite entries ({kind.__name__}: {exc}).") from exc


def _nonfinite_statistic(state):
    """The field name of the first statistic of ``state`` with a non-finite entry, or None
    (also when the entries cannot be read now: a lazy array)."""
    for k, st in enumerate(state.blocks_states):
        for i, average in enumerate(st.statistics):
            raw = average.raw
            if is_lazy(raw):
                continue
            xp = namespace_of("BlockDiagonalCurvature", raw=raw)
            if any_true(xp, ~xp.isfinite(raw)):
                return f"blocks_states[{k}].statistics[{i}]"
    return None


@capabilities(dask="yes")
def block_diag(blocks):
    r"""Block-diagonal matrix from square blocks (array-API concatenation, no mutation).

    .. math:: \mathrm{diag}(B_1, \dots, B_L)
    """
    func = "block_diag"
    if not isinstance(blocks, (list, tuple)) or not blocks:
        raise KFACTypeError(f"{func}: blocks must be a non-empty list of square matrices; "
                            f"got {describe(blocks)}.")
    xp = namespace_of(func, **{f"blocks[{i}]": b for i, b in enumerate(blocks)})
    for i, b in enumerate(blocks):
        check_square(func, f"blocks[{i}]", b)
    return _block_diag(xp, blocks)


@kernel_of(block_diag)
def _block_diag(xp, blocks):
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
