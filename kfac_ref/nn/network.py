r"""A sequential network of named reference layers, with flattening and exact derivative passes.

Parameter order (the docs page *Conventions*): layers in forward order; within a layer its
parameter arrays in :meth:`~kfac_ref.nn.layers.Layer.param_names` order, each flattened
row-major.  For dense and convolution layers this is the row-major flattening of the combined
``[W; b]`` matrix (``[d_in + 1, d_out]``, resp. ``[kh·kw·C_in + 1, C_out]``), so the bias is the
last ``d_out`` entries of the layer.

The derivative passes are batched over examples (no loop over examples):

* forward pass, storing every layer's input :math:`x_l`;
* Jacobian-vector pass (forward mode) :math:`\dot x_{l+1} = \partial_\theta f_l \dot\theta_l +
  \partial_x f_l \dot x_l`;
* backward pass :math:`g_l = (\partial_x f_{l+1})^\top g_{l+1}` with per-layer parameter
  cotangents, summed over the batch or per example;
* the R-operator backward pass (Pearlmutter 1994) for exact Hessian-vector products.
"""

from __future__ import annotations

import math

from .._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_rng,
    namespace_of,
    value_checks,
    zeros_like_shape,
)
from .layers import Layer

__all__ = ["Sequential"]


class Sequential:
    r"""A chain of named layers :math:`f = f_L \circ \dots \circ f_1`.

    .. math::

        x_0 = x, \qquad x_{l} = f_l(\theta_l, x_{l-1}), \qquad f(\theta, x) = x_L,
        \qquad \theta = [\mathrm{vec}_r\theta_1; \dots; \mathrm{vec}_r\theta_L].

    Parameters
    ----------
    layers : sequence of (str, Layer)
        Names must be unique non-empty strings.

    Notes
    -----
    ``params`` is always a tuple with one tuple of arrays per layer (empty for
    parameter-free layers).  Tangents and cotangents of parameters are accepted either in
    that structure or as a flat vector of length :attr:`num_params` (the canonical order).

    Raises
    ------
    KFACTypeError, KFACValueError
        Non-layer entries, duplicate or empty names.
    """

    def __init__(self, layers):
        func = "Sequential"
        entries = list(layers)
        if not entries:
            raise KFACValueError(f"{func}: layers must be a non-empty sequence of (name, layer) "
                                 f"pairs; got none.")
        names, objs = [], []
        for item in entries:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], Layer)):
                raise KFACTypeError(f"{func}: each entry must be a (name, Layer) pair; got "
                                    f"{item!r:.80}.")
            if not item[0] or item[0] in names:
                raise KFACValueError(f"{func}: layer names must be unique non-empty strings; "
                                     f"got {item[0]!r} twice or empty.")
            names.append(item[0])
            objs.append(item[1])
        self.names = tuple(names)
        self.layers = tuple(objs)
        self._layer_sizes = tuple(layer.num_params for layer in self.layers)

    # -- structure --------------------------------------------------------------------------
    def __len__(self):
        return len(self.layers)

    def __repr__(self):
        pairs = zip(self.names, self.layers, strict=True)
        inner = ", ".join(f"({n!r}, {layer!r})" for n, layer in pairs)
        return f"Sequential([{inner}])"

    @property
    def layer_sizes(self) -> tuple[int, ...]:
        r"""Number of parameters of each layer (0 for parameter-free layers).

        .. math:: (P_1, \dots, P_L)
        """
        return self._layer_sizes

    @property
    def num_params(self) -> int:
        r"""Total number of parameters.

        .. math:: P = \textstyle\sum_l P_l
        """
        return sum(self._layer_sizes)

    def layer_slices(self) -> tuple[slice, ...]:
        r"""Slice of each layer in the flat parameter vector.

        .. math:: \theta_l = \theta[\textstyle\sum_{k<l} P_k : \sum_{k\le l} P_k]
        """
        out, start = [], 0
        for size in self.layer_sizes:
            out.append(slice(start, start + size))
            start += size
        return tuple(out)

    @property
    def parametric_layers(self) -> tuple[int, ...]:
        r"""Indices of the layers that have parameters (the blocks of a block-diagonal curvature).

        .. math:: \{l : P_l > 0\}
        """
        return tuple(i for i, s in enumerate(self.layer_sizes) if s > 0)

    def init_params(self, rng, like):
        r"""Random parameters drawn on the host with ``rng`` and placed like ``like``.

        .. math:: W \sim \mathcal N(0, 1/\text{fan\_in})

        Dense/conv kernels :math:`\mathcal N(0, 1/\text{fan\_in})`, biases
        :math:`\mathcal N(0, 0.25)`, scales :math:`1 + \mathcal N(0, 0.09)`.
        """
        check_rng("Sequential.init_params", "rng", rng)
        return tuple(layer.init_params(rng, like) for layer in self.layers)

    def output_shape(self, input_shape):
        r"""Output shape for an input shape (both with the batch axis).

        .. math:: f(\theta, x) \in \mathbb R^{\text{output\_shape}}
        """
        shape = tuple(input_shape)
        for layer in self.layers:
            shape = layer.output_shape(shape)
        return shape

    # -- validation ---------------------------------------------------------------------------
    def check_params(self, func, params):
        r"""Validate the parameter structure (one tuple per layer, right shapes, finite).

        .. math:: \theta = (\theta_1, \dots, \theta_L)
        """
        if not isinstance(params, (tuple, list)) or len(params) != len(self.layers):
            raise KFACValueError(
                f"{func}: params must be a tuple of {len(self.layers)} per-layer tuples; got "
                f"{type(params).__name__} of length "
                f"{len(params) if isinstance(params, (tuple, list)) else '?'}."
            )
        pairs = zip(self.layers, params, strict=True)
        return tuple(layer.check_params(func, p) for layer, p in pairs)

    def check_input(self, func, x, like=None):
        r"""Validate ``x`` against the first layer (rank, sizes, dtype, finite values) and the
        shape every later layer receives (a one-example zero probe in ``like``'s dtype).

        .. math:: x_0 = x,\qquad x_l \in \mathbb R^{\text{output\_shape}_l}

        Raises
        ------
        KFACValueError, KFACTypeError
            Naming the first layer whose input shape does not fit.
        """
        self.layers[0].check_input(func, x)
        if like is None or len(self.layers) == 1:
            return x
        from .._backend import KFACInputError

        shape = self.layers[0].output_shape(tuple(x.shape))
        for name, layer in zip(self.names[1:], self.layers[1:], strict=True):
            probe = zeros_like_shape(like, (1, *shape[1:]))
            try:
                with value_checks(False):  # a zero probe: only its shape is checked
                    layer.check_input(func, probe)
            except KFACInputError as exc:
                raise type(exc)(
                    f"{func}: layer {name!r} must receive the shape its predecessor produces "
                    f"(per example {tuple(shape[1:])}); {exc}"
                ) from None
            shape = layer.output_shape(shape)
        return x

    def _like(self, params):
        for p in params:
            if p:
                return p[0]
        return None

    def _arrays(self, params):
        return {f"p{i}_{j}": a for i, p in enumerate(params) for j, a in enumerate(p)}

    def _xp(self, func, params, x, **others):
        return namespace_of(func, **self._arrays(params), x=x, **others)

    # -- flattening -------------------------------------------------------------------------------
    def flatten(self, params, per_example=False):
        r"""Flat vector of a parameter structure in the canonical order.

        .. math::

            \theta = [\mathrm{vec}_r\theta_{1,1}; \mathrm{vec}_r\theta_{1,2}; \dots] .

        With ``per_example=True`` every array has a leading batch axis and the result is
        ``[N, P]``.
        """
        xp = None
        pieces = []
        for layer_params in params:
            for a in layer_params:
                if xp is None:
                    xp = namespace_of("Sequential.flatten", a=a)
                pieces.append(xp.reshape(a, (a.shape[0], -1)) if per_example
                              else xp.reshape(a, (-1,)))
        if xp is None:
            raise KFACValueError("Sequential.flatten: the network has no parameters; got none.")
        return xp.concat(pieces, axis=-1)

    def unflatten(self, vec):
        r"""Inverse of :meth:`flatten` for a flat vector ``[P]``.

        .. math:: \theta_l = \mathrm{vec}_r^{-1}(\theta[\text{slice}_l])
        """
        func = "Sequential.unflatten"
        xp = namespace_of(func, vec=vec)
        check_array(func, "vec", vec, shape=(self.num_params,), layout="[P]")
        out, start = [], 0
        for layer in self.layers:
            arrs = []
            for shape in layer.param_shapes():
                size = math.prod(shape)
                arrs.append(xp.reshape(vec[start:start + size], shape))
                start += size
            out.append(tuple(arrs))
        return tuple(out)

    def _as_structured(self, func, name, v):
        if v is None:
            return None
        if isinstance(v, (tuple, list)):
            return self.check_params(func, v)
        check_array(func, name, v, shape=(self.num_params,), layout="[P]")
        return self.unflatten(v)

    # -- passes (unvalidated internals) ---------------------------------------------------
    def _forward(self, params, x, taps=None):
        """``(output, inputs of every layer)``; with ``taps`` (one bool per layer) also the
        :meth:`~kfac_ref.nn.Layer.forward_with_tap` tap of each layer it marks (``None``
        for the others and where a layer has none)."""
        inputs, kept = [], []
        h = x
        for j, (layer, p) in enumerate(zip(self.layers, params, strict=False)):
            inputs.append(h)
            if taps is not None and taps[j]:
                h, tap = layer.forward_with_tap(p, h)
            else:
                h, tap = layer.forward(p, h), None
            kept.append(tap)
        return (h, inputs) if taps is None else (h, inputs, tuple(kept))

    def _jvp(self, params, inputs, dparams, dx=None):
        dins = []
        dh = dx
        for i, (layer, p, xin) in enumerate(zip(self.layers, params, inputs, strict=True)):
            dins.append(dh)
            dp = None if dparams is None or not p else dparams[i]
            dh = layer.jvp(p, xin, dp, dh)
        return dh, dins

    def _vjp_caches(self, params, inputs):
        """Each layer's :meth:`~kfac_ref.nn.Layer.vjp_cache` for one forward pass: what a
        backward pass reuses for every cotangent (``None`` where a layer has nothing)."""
        return tuple(layer.vjp_cache(p, xin)
                     for layer, p, xin in zip(self.layers, params, inputs, strict=True))

    def _backward(self, params, inputs, g, per_example=False, param_grads=True, caches=None):
        """Cotangents of every layer's output and, when ``param_grads``, the (summed or
        per-example) parameter gradients; without them a layer's gradient is ``()`` (the
        Kronecker-factored estimators read only the cotangents).  ``caches`` (from
        :meth:`_vjp_caches`) lets many backward passes of one forward share the layers'
        derivatives."""
        n = len(self.layers)
        grads = [None] * n
        cots = [None] * n
        for i in range(n - 1, -1, -1):
            layer, p, xin = self.layers[i], params[i], inputs[i]
            cots[i] = g
            grads[i] = layer.param_grads(p, xin, g, per_example) if p and param_grads else ()
            if i > 0:
                cache = None if caches is None else caches[i]
                g = (layer.vjp_input(p, xin, g) if cache is None
                     else layer.vjp_input(p, xin, g, cache=cache))
        return tuple(grads), cots

    def _backward_stacked(self, params, inputs, g, caches=None):
        """Cotangents of every layer's output for :math:`C` output cotangents stacked on a
        leading axis (``g``: ``[C, *output_shape]``; each result ``[C, *layer_output]``):
        one pass through :meth:`~kfac_ref.nn.Layer.vjp_input_stacked`, so each layer runs
        one batched call (one GEMM for a dense layer) instead of :math:`C`.  No parameter
        gradients.  ``caches``: as in :meth:`_backward`."""
        cots = [None] * len(self.layers)
        for i in range(len(self.layers) - 1, -1, -1):
            cots[i] = g
            if i > 0:
                cache = None if caches is None else caches[i]
                g = self.layers[i].vjp_input_stacked(params[i], inputs[i], g, cache)
        return cots

    def _r_backward(self, params, inputs, dparams, dins, g, rg):
        n = len(self.layers)
        rgrads = [None] * n
        for i in range(n - 1, -1, -1):
            layer, p, xin = self.layers[i], params[i], inputs[i]
            dp = dparams[i] if p else None
            r_p, r_x = layer.rvjp(p, xin, dp, dins[i], g, rg)
            rgrads[i] = r_p
            if i > 0:
                g, rg = layer.vjp_input(p, xin, g), r_x
        return tuple(rgrads)

    # -- public passes --------------------------------------------------------------------
    def forward(self, params, x):
        r"""Network output :math:`f(\theta, x)` for a batch ``x``.

        .. math::

            f(\theta, x) = f_L(\theta_L, \dots f_1(\theta_1, x)).
        """
        func = "Sequential.forward"
        self._xp(func, params, x)
        params = self.check_params(func, params)
        self.check_input(func, x, self._like(params))
        return self._forward(params, x)[0]

    def forward_with_inputs(self, params, x):
        r"""Output and the list of every layer's input (``inputs[0]`` is ``x``).

        .. math:: (x_L, [x_0, \dots, x_{L-1}])
        """
        func = "Sequential.forward_with_inputs"
        self._xp(func, params, x)
        params = self.check_params(func, params)
        self.check_input(func, x, self._like(params))
        return self._forward(params, x)

    def jvp(self, params, x, dparams):
        r"""Jacobian-vector product with respect to the parameters, batched over examples.

        .. math::

            \dot f_n = J_n \dot\theta, \qquad J_n = \frac{\partial f(\theta, x_n)}{\partial\theta}.

        Parameters
        ----------
        dparams : flat array [P] or parameter structure

        Returns
        -------
        array, the output's shape [N, ...]
        """
        func = "Sequential.jvp"
        self._xp(func, params, x, dparams=dparams if not isinstance(dparams, (tuple, list))
                 else None)
        params = self.check_params(func, params)
        self.check_input(func, x, self._like(params))
        dparams = self._as_structured(func, "dparams", dparams)
        _, inputs = self._forward(params, x)
        return self._jvp(params, inputs, dparams)[0]

    def vjp(self, params, x, g_out, per_example=False):
        r"""Vector-Jacobian product (backpropagation) with respect to the parameters.

        .. math::

            \sum_n J_n^\top g_n \quad (\text{flat } [P]), \qquad
            \text{or } [J_n^\top g_n]_n \quad (\texttt{per\_example=True}, [N, P]).

        Parameters
        ----------
        g_out : array of the output's shape [N, ...]
        """
        func = "Sequential.vjp"
        self._xp(func, params, x, g_out=g_out)
        params = self.check_params(func, params)
        self.check_input(func, x, self._like(params))
        out, inputs = self._forward(params, x)
        check_array(func, "g_out", g_out, shape=tuple(out.shape))
        grads, _ = self._backward(params, inputs, g_out, per_example)
        return self.flatten(grads, per_example=per_example)

    def backward_with_cotangents(self, params, x, g_out):
        r"""Backward pass returning every layer's input and output cotangent.

        .. math::

            g_l = \frac{\partial \langle g_{out}, f\rangle}{\partial x_l}
                = (\partial_x f_{l+1})^\top \cdots (\partial_x f_L)^\top g_{out} .

        These are the per-example "backpropagated vectors" :math:`g` of K-FAC: with
        ``g_out`` the per-example loss gradient (no :math:`1/N`), ``cotangents[l]`` is
        :math:`\partial\ell_n/\partial s_l` for every example.

        Returns
        -------
        (inputs, cotangents) : lists over layers of ``x_{l-1}`` and ``g_l``
        """
        func = "Sequential.backward_with_cotangents"
        self._xp(func, params, x, g_out=g_out)
        params = self.check_params(func, params)
        self.check_input(func, x, self._like(params))
        out, inputs = self._forward(params, x)
        check_array(func, "g_out", g_out, shape=tuple(out.shape))
        _, cots = self._backward(params, inputs, g_out, param_grads=False)
        return inputs, cots

    def second_order_backward(self, params, x, dparams, output_cotangents):
        r"""R-operator backward pass: the directional derivative of the gradient.

        For a scalar objective :math:`E(\theta) = \sum_n e(f(\theta, x_n))` with
        :math:`g = \nabla_f e` and :math:`R\{g\} = \nabla_f^2 e\; J \dot\theta`,

        .. math::

            \nabla_\theta^2 E\,\dot\theta = R\Big\{\sum_n J_n^\top g_n\Big\}
            = \sum_n \big(J_n^\top R\{g_n\} + (R\{J_n\})^\top g_n\big),

        computed layer by layer with :meth:`Layer.rvjp` (Pearlmutter 1994).

        Parameters
        ----------
        dparams : flat [P] or parameter structure
            The direction :math:`\dot\theta`.
        output_cotangents : callable
            ``output_cotangents(f, f_dot) -> (g, r_g)``, both of the output's shape: the
            gradient of the objective w.r.t. the output and its directional derivative.

        Returns
        -------
        array [P]
        """
        func = "Sequential.second_order_backward"
        self._xp(func, params, x, dparams=dparams if not isinstance(dparams, (tuple, list))
                 else None)
        params = self.check_params(func, params)
        self.check_input(func, x, self._like(params))
        dparams = self._as_structured(func, "dparams", dparams)
        out, inputs = self._forward(params, x)
        f_dot, dins = self._jvp(params, inputs, dparams)
        g, rg = output_cotangents(out, f_dot)
        return self.flatten(self._r_backward(params, inputs, dparams, dins, g, rg))
