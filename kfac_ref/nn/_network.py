r"""A sequential network of named reference layers, with flattening and exact derivative passes.

Parameter order (the docs page *Conventions*): layers in forward order; within a layer its
parameter arrays in :meth:`~kfac_ref.nn.Layer.param_names` order, each flattened
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

The tap protocol
----------------
Curvature estimators need more than a gradient: every layer's input, the cotangent at every
layer's output, many backward passes of one forward pass, and forward-mode tangents.
:class:`Sequential` exposes them as documented methods on a :class:`ForwardPass`, the
record of one validated forward pass (:meth:`Sequential.forward_pass`), so that the
parameters and the input are validated once, at that door, and the passes that follow
check only their own arguments:

* :meth:`Sequential.forward_pass` — every layer's input :math:`x_{l-1}` and, for the layers
  given a ``tap``, the tap's statistic of what the layer's weight multiplies
  (:meth:`~kfac_ref.nn.Layer.forward_with_tap`);
* :meth:`Sequential.jvp_pass` — the output tangent and every layer's input tangent;
* :meth:`Sequential.backward_pass` — every layer's output cotangent :math:`g_l` and the
  (summed or per-example) parameter gradients;
* :meth:`Sequential.stacked_backward_pass` — the cotangents of :math:`C` output
  cotangents stacked on a leading axis, one batched call per layer;
* :meth:`Sequential.r_backward_pass` — the R-operator backward pass;
* :meth:`Sequential.vjp_caches` — what the backward passes of one forward pass share.

The network computes no curvature statistic: a tap is a function handed in by the caller
(the K-FAC factors define them, e.g. :func:`kfac_ref.factors.conv_input_factor_tap`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_bool,
    check_rng,
    check_shape,
    describe,
    namespace_of,
    read_checks_once,
    value_checks,
    zeros_like_shape,
)
from .._support import capabilities
from ._layers import Layer


@capabilities(dask="yes")
class ForwardPass:
    r"""The record of one validated forward pass of a :class:`Sequential` network.

    .. math::

        x_0 = x, \qquad x_l = f_l(\theta_l, x_{l-1}), \qquad
        \tau_l = \textstyle\sum_{\text{chunks } c} \operatorname{tap}_l(u_{l,c})

    Made by :meth:`Sequential.forward_pass` only; the derivative passes of the tap protocol
    (:meth:`Sequential.jvp_pass`, :meth:`Sequential.backward_pass`, ...) take it in place of
    ``(params, x)``, so those are validated once.  Read-only.

    Attributes
    ----------
    network : Sequential
        The network that made it.
    params : tuple of tuples of arrays
        The validated parameters, one tuple per layer.
    output : array
        :math:`x_L = f(\theta, x)`.
    inputs : tuple of arrays
        Every layer's input :math:`(x_0, \dots, x_{L-1})`; ``inputs[0]`` is ``x``.
    taps : tuple
        Per layer, the value :math:`\tau_l` of the tap it was given
        (:meth:`kfac_ref.nn.Layer.forward_with_tap`), ``None`` for the others.
    """

    __slots__ = ("network", "params", "output", "inputs", "taps")

    def __init__(self, network, params, output, inputs, taps):
        for name, value in (("network", network), ("params", params), ("output", output),
                            ("inputs", tuple(inputs)), ("taps", tuple(taps))):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"ForwardPass is read-only; cannot set {name!r}.")

    def __repr__(self):
        return (f"ForwardPass(output shape {tuple(self.output.shape)}, "
                f"{len(self.inputs)} layer inputs)")


@capabilities(dask="yes")
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
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
            raise KFACTypeError(f"{func}: layers must be a non-empty sequence of (name, layer) "
                                f"pairs; got {describe(layers)}.")
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
        # the layers' unchecked maps: a call is validated once, at the network's door
        self._kernels = tuple(layer.kernel for layer in objs)
        self._layer_sizes = tuple(layer.num_params for layer in self.layers)
        self._param_shapes = tuple(s for layer in objs for s in layer.param_shapes())
        # (per-example input shape, dtype, array type) whose probes every later layer took
        self._fitting_inputs = set()

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
        func = "Sequential.init_params"
        check_rng(func, "rng", rng)
        check_array(func, "like", like, finite=False)  # only its namespace, device and dtype
        return tuple(k.init_params(rng, like) for k in self._kernels)

    def output_shape(self, input_shape):
        r"""Output shape for an input shape (both with the batch axis).

        .. math:: f(\theta, x) \in \mathbb R^{\text{output\_shape}}
        """
        shape = self._check_shape("Sequential.output_shape", input_shape)
        for k in self._kernels:
            shape = k.output_shape(shape)
        return shape

    def _check_shape(self, func, input_shape):
        rank = 2 if self.layers[0].input_dtype == "real floating" else 1
        return check_shape(func, "input_shape", input_shape, min_ndim=rank)

    def input_shapes(self, input_shape):
        r"""Shape of every layer's input for a network input of shape ``input_shape`` (both
        with the batch axis).

        .. math:: (\operatorname{shape} x_0, \dots, \operatorname{shape} x_{L-1})
        """
        shapes, shape = [], self._check_shape("Sequential.input_shapes", input_shape)
        for k in self._kernels:
            shapes.append(shape)
            shape = k.output_shape(shape)
        return tuple(shapes)

    # -- validation ---------------------------------------------------------------------------
    def check_params(self, func, params, name="params"):
        r"""Validate the parameter structure (one tuple per layer, right shapes, real
        floating dtype, one namespace, device and precision, finite values).

        .. math:: \theta = (\theta_1, \dots, \theta_L)

        ``name`` names the structure in messages (``params``, ``dparams``, ...); an array
        is named ``name[l][i] (<layer name>.<parameter name>)``.
        """
        return self._check_params(func, params, name)

    def _check_params(self, func, params, name="params", arrays=None):
        """:meth:`check_params`; ``arrays``, the structure's named arrays whose namespace
        the caller has checked already (with others), skips the second namespace check."""
        if not isinstance(params, (tuple, list)) or len(params) != len(self.layers):
            raise KFACValueError(
                f"{func}: {name} must be a tuple of {len(self.layers)} per-layer tuples; got "
                f"{describe(params)}."
            )
        for i, (lname, layer, p) in enumerate(zip(self.names, self.layers, params,
                                                  strict=True)):
            if not isinstance(p, (tuple, list)) or len(p) != len(layer.param_shapes()):
                layer.check_params(func, p, f"{name}[{i}]", lname)  # raises, naming arrays
        if arrays is None:
            arrays = self._named_arrays(name, params)
            if arrays:
                namespace_of(func, **arrays)
        for (label, a), shape in zip(arrays.items(), self._param_shapes, strict=True):
            check_array(func, label, a, shape=shape)
        return tuple(tuple(p) for p in params)

    def _named_arrays(self, name, params):
        """``{message name: array}`` of a parameter structure (well-formed or not)."""
        if not isinstance(params, (tuple, list)):
            return {}
        out = {}
        for i, (lname, layer, p) in enumerate(zip(self.names, self.layers, params,
                                                  strict=False)):
            if isinstance(p, (tuple, list)):
                pnames = layer.param_names()  # the names Layer.check_params gives them
                out.update({f"{name}[{i}][{j}]" + (f" ({lname}.{pnames[j]})" if j < len(pnames)
                                                   else ""): a for j, a in enumerate(p)})
        return out

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
        # the probes depend on shapes and the dtype only: an input like one that fitted
        # allocates none (each probe is a kernel launch on a device)
        key = (tuple(x.shape[1:]), like.dtype, type(like))
        try:
            if key in self._fitting_inputs:
                return x
        except TypeError:  # a dtype that is not hashable: probe every time
            key = None
        from .._backend import KFACInputError

        shape = self._kernels[0].output_shape(tuple(x.shape))
        later = zip(self.names[1:], self.layers[1:], self._kernels[1:], strict=True)
        for name, layer, kernel in later:
            probe = zeros_like_shape(like, (1, *shape[1:]))
            try:
                with value_checks(False):  # a zero probe: only its shape is checked
                    layer.check_input(func, probe)
            except KFACInputError as exc:
                raise type(exc)(
                    f"{func}: layer {name!r} must receive the shape its predecessor produces "
                    f"(per example {tuple(shape[1:])}); {exc}"
                ) from None
            shape = kernel.output_shape(shape)
        if key is not None:
            if len(self._fitting_inputs) >= 64:  # bounded: a few shapes are the rule
                self._fitting_inputs.clear()
            self._fitting_inputs.add(key)
        return x

    def check_params_and_input(self, func, params, x, **others):
        r"""Validate ``(params, x)`` of a call in the name of ``func``: one namespace,
        device and floating precision for the parameters, ``x`` and the named ``others``
        (arrays or parameter structures; ``None`` entries are skipped), the parameter
        structure (:meth:`check_params`) and ``x`` with the shape
        every layer receives (:meth:`check_input`, probed in the parameters' dtype).

        .. math:: \theta = (\theta_1, \dots, \theta_L), \qquad x_0 = x

        Returns
        -------
        tuple
            The validated parameters, one tuple per layer.
        """
        arrays = self._named_arrays("params", params)
        named = dict(arrays)
        for name, v in others.items():
            named.update(self._named_arrays(name, v) if isinstance(v, (tuple, list))
                         else {name: v})
        xp = namespace_of(func, **named, x=x)

        def check():
            checked = self._check_params(func, params, arrays=arrays)
            self.check_input(func, x, next((p[0] for p in checked if p), None))
            return checked

        # the finiteness scans of the parameters and x read back once, before any
        # computation (on the host: each at once)
        return read_checks_once(xp, check, func)

    def check_param_tangent(self, func, name, v):
        r"""Validate a vector of parameter space, given flat (``[P]``, the canonical order) or
        in the parameter structure, and return it in the structure (``None`` stays ``None``,
        the zero tangent).

        .. math:: \dot\theta = (\dot\theta_1, \dots, \dot\theta_L), \qquad
            \dot\theta_l = \mathrm{vec}_r^{-1}(\dot\theta[\text{slice}_l])
        """
        if v is None:
            return None
        if isinstance(v, (tuple, list)):
            return self.check_params(func, v, name)
        check_array(func, name, v, shape=(self.num_params,), layout="[P]")
        return self._unflatten(namespace_of(func, **{name: v}), v)

    # -- flattening -------------------------------------------------------------------------------
    def flatten(self, params, per_example=False):
        r"""Flat vector of a parameter structure in the canonical order.

        .. math::

            \theta = [\mathrm{vec}_r\theta_{1,1}; \mathrm{vec}_r\theta_{1,2}; \dots] .

        With ``per_example=True`` every array has a leading batch axis and the result is
        ``[N, P]``.
        """
        func = "Sequential.flatten"
        per_example = check_bool(func, "per_example", per_example)
        self._check_has_params(func)
        if not isinstance(params, (tuple, list)) or len(params) != len(self.layers):
            raise KFACValueError(f"{func}: params must be a tuple of {len(self.layers)} "
                                 f"per-layer tuples; got {describe(params)}.")
        for i, (layer, p) in enumerate(zip(self.layers, params, strict=True)):
            if not isinstance(p, (tuple, list)) or len(p) != len(layer.param_shapes()):
                layer.check_params(func, p, f"params[{i}]", self.names[i])  # raises
        arrays = self._named_arrays("params", params)
        xp = namespace_of(func, **arrays)
        # static checks only: a reshape and a concatenation pass NaN through unchanged, and
        # the library flattens gradients it computed (no scan of its own results)
        for (name, a), shape in zip(arrays.items(), self._param_shapes, strict=True):
            check_array(func, name, a, shape=(None, *shape) if per_example else shape,
                        finite=False)
        if per_example and len({a.shape[0] for a in arrays.values()}) > 1:
            raise KFACValueError(f"{func}: params must share one leading batch axis N with "
                                 f"per_example=True; got sizes "
                                 f"{sorted({a.shape[0] for a in arrays.values()})}.")
        return self._flatten(xp, params, per_example)

    def _flatten(self, xp, params, per_example=False):
        # sizes spelled out: an empty batch (N = 0) has no -1 to infer
        pieces = [xp.reshape(a, (a.shape[0], math.prod(a.shape[1:]))) if per_example
                  else xp.reshape(a, (-1,)) for layer_params in params for a in layer_params]
        return xp.concat(pieces, axis=-1)

    def unflatten(self, vec):
        r"""Inverse of :meth:`flatten` for a flat vector ``[P]``.

        .. math:: \theta_l = \mathrm{vec}_r^{-1}(\theta[\text{slice}_l])
        """
        func = "Sequential.unflatten"
        xp = namespace_of(func, vec=vec)
        check_array(func, "vec", vec, shape=(self.num_params,), layout="[P]")
        return self._unflatten(xp, vec)

    def _unflatten(self, xp, vec):
        out, start = [], 0
        for layer in self.layers:
            arrs = []
            for shape in layer.param_shapes():
                size = math.prod(shape)
                arrs.append(xp.reshape(vec[start:start + size], shape))
                start += size
            out.append(tuple(arrs))
        return tuple(out)

    # -- passes: the unchecked kernels of the public passes below ------------------------
    def _forward(self, params, x, taps=None):
        """``(output, inputs of every layer, tap values)``: each layer given a tap (``taps``,
        one entry per layer, ``None`` for none) runs
        :meth:`~kfac_ref.nn.Layer.forward_with_tap`, the others :meth:`Layer.forward` (the
        layers' unchecked kernels, :attr:`~kfac_ref.nn.Layer.kernel`)."""
        inputs, kept = [], []
        h = x
        for j, (layer, p) in enumerate(zip(self._kernels, params, strict=False)):
            inputs.append(h)
            tap = None if taps is None else taps[j]
            if tap is not None:
                h, value = layer.forward_with_tap(p, h, tap)
            else:
                h, value = layer.forward(p, h), None
            kept.append(value)
        return h, inputs, tuple(kept)

    def _jvp(self, params, inputs, dparams, dx=None):
        dins = []
        dh = dx
        for i, (layer, p, xin) in enumerate(zip(self._kernels, params, inputs, strict=True)):
            dins.append(dh)
            dp = None if dparams is None or not p else dparams[i]
            dh = layer.jvp(p, xin, dp, dh)
        return dh, dins

    def _vjp_caches(self, params, inputs, output):
        outputs = (*inputs[1:], output)  # each layer's output is the next one's input
        return tuple(layer.vjp_cache_given_output(p, xin, y) for layer, p, xin, y
                     in zip(self._kernels, params, inputs, outputs, strict=True))

    def _backward(self, params, inputs, g, per_example=False, param_grads=True, caches=None):
        n = len(self.layers)
        grads = [None] * n
        cots = [None] * n
        for i in range(n - 1, -1, -1):
            layer, p, xin = self._kernels[i], params[i], inputs[i]
            cots[i] = g
            grads[i] = layer.param_grads(p, xin, g, per_example) if p and param_grads else ()
            if i > 0:
                cache = None if caches is None else caches[i]
                g = (layer.vjp_input(p, xin, g) if cache is None
                     else layer.vjp_input(p, xin, g, cache=cache))
        return tuple(grads), cots

    def _backward_stacked(self, params, inputs, g, caches=None):
        cots = [None] * len(self.layers)
        for i in range(len(self.layers) - 1, -1, -1):
            cots[i] = g
            if i > 0:
                cache = None if caches is None else caches[i]
                g = self._kernels[i].vjp_input_stacked(params[i], inputs[i], g, cache)
        return cots

    def _r_backward(self, params, inputs, dparams, dins, g, rg):
        n = len(self.layers)
        rgrads = [None] * n
        for i in range(n - 1, -1, -1):
            layer, p, xin = self._kernels[i], params[i], inputs[i]
            dp = dparams[i] if p else None
            r_p, r_x = layer.rvjp(p, xin, dp, dins[i], g, rg)
            rgrads[i] = r_p
            if i > 0:
                g, rg = layer.vjp_input(p, xin, g), r_x
        return tuple(rgrads)

    # -- the tap protocol: passes on one validated forward pass ------------------------------
    def forward_pass(self, params, x, taps=None):
        r"""Validate ``(params, x)`` once and run the forward pass that the other passes of
        the tap protocol reuse.

        .. math::

            x_0 = x,\qquad x_l = f_l(\theta_l, x_{l-1}),\qquad
            \tau_l = \textstyle\sum_{\text{chunks } c}\operatorname{tap}_l(u_{l,c}),

        with :math:`u_l` what layer :math:`l`'s weight multiplies (its input :math:`x_{l-1}`,
        a convolution's patches), chunk by chunk as the layer forms it
        (:meth:`kfac_ref.nn.Layer.forward_with_tap`).

        Parameters
        ----------
        params : tuple of per-layer tuples of arrays
        x : array, the network input (batch axis first)
        taps : sequence of callables or None, optional
            One entry per layer: ``None``, or a function of the layer's :math:`u` for a
            chunk of examples whose sum over the chunks is the statistic wanted (e.g.
            :func:`kfac_ref.factors.conv_input_factor_tap`).

        Returns
        -------
        ForwardPass
            ``output``, ``inputs`` (every layer's input), ``taps`` (per layer, the tap's
            value or ``None``) and the validated ``params``.
        """
        func = "Sequential.forward_pass"
        params = self.check_params_and_input(func, params, x)
        if taps is not None:
            if (not isinstance(taps, (tuple, list)) or len(taps) != len(self.layers)
                    or not all(t is None or callable(t) for t in taps)):
                raise KFACTypeError(
                    f"{func}: taps must be None or a sequence of {len(self.layers)} entries, "
                    f"each None or a callable; got {taps!r:.80}.")
            if all(t is None for t in taps):
                taps = None
        out, inputs, values = self._forward(params, x, taps)
        return ForwardPass(self, params, out, inputs, values)

    def _check_has_params(self, func):
        """Derivatives with respect to the parameters need parameters: without them a
        tangent would be ``None`` and a gradient an empty concatenation."""
        if not self.num_params:
            raise KFACValueError(f"{func}: the network must have parameters (P > 0) for a "
                                 f"derivative with respect to them; got none (layers "
                                 f"{', '.join(self.names)}).")

    def _check_direction(self, func, forward, dparams):
        """The direction of a pass: a flat ``[P]`` array or a parameter structure (never
        ``None``) in the namespace, device and precision of ``forward``."""
        if dparams is None:
            raise KFACTypeError(f"{func}: dparams must be a flat array [P] or a parameter "
                                f"structure (the direction); got None.")
        arrays = (self._named_arrays("dparams", dparams) if isinstance(dparams, (tuple, list))
                  else {"dparams": dparams})
        namespace_of(func, output=forward.output, **arrays)
        return self.check_param_tangent(func, "dparams", dparams)

    def _output_shape(self, input_shape):
        shape = tuple(input_shape)
        for k in self._kernels:
            shape = k.output_shape(shape)
        return shape

    def _check_pass(self, func, forward):
        if not isinstance(forward, ForwardPass) or forward.network is not self:
            raise KFACTypeError(f"{func}: forward must be the ForwardPass of this network's "
                                f"forward_pass; got {type(forward).__name__}.")
        return forward

    def _check_cotangent(self, func, name, forward, g, stacked=False):
        namespace_of(func, output=forward.output, **{name: g})
        shape = tuple(forward.output.shape)
        lay = "[C, *output_shape]" if stacked else "[*output_shape]"
        check_array(func, name, g, shape=(None, *shape) if stacked else shape, layout=lay)
        return g

    def _check_caches(self, func, forward, caches):
        if caches is None:
            return None
        if not isinstance(caches, tuple) or len(caches) != len(self.layers):
            raise KFACTypeError(f"{func}: caches must be None or the tuple of vjp_caches "
                                f"({len(self.layers)} entries); got {describe(caches)}.")
        # static checks only: vjp_caches computed them from the validated forward pass, and
        # a scan here would be repeated by every backward pass that shares them
        namespace_of(func, output=forward.output,
                     **{f"caches[{i}]": c for i, c in enumerate(caches)})
        for i, (c, layer, xin) in enumerate(zip(caches, self.layers, forward.inputs,
                                                strict=True)):
            if c is not None:
                if not layer.has_vjp_cache:
                    raise KFACValueError(f"{func}: caches[{i}] must be None (layer "
                                         f"{self.names[i]!r} keeps no vjp_cache); got "
                                         f"{describe(c)}.")
                check_array(func, f"caches[{i}]", c, shape=tuple(xin.shape), finite=False)
        return caches

    def vjp_caches(self, forward):
        r"""What every backward pass of one forward pass reuses: each layer's
        :meth:`~kfac_ref.nn.Layer.vjp_cache` (e.g. an activation's derivative
        :math:`\sigma'(x_{l-1})`; ``None`` where a layer keeps nothing).

        .. math:: c_l = \text{cache}_l(\theta_l, x_{l-1})

        Pass the result as ``caches`` to :meth:`backward_pass` and
        :meth:`stacked_backward_pass`.
        """
        forward = self._check_pass("Sequential.vjp_caches", forward)
        return self._vjp_caches(forward.params, forward.inputs, forward.output)

    def jvp_pass(self, forward, dparams):
        r"""Forward-mode pass for a parameter tangent: the output tangent and every layer's
        input tangent.

        .. math::

            \dot x_0 = 0,\qquad
            \dot x_l = \partial_\theta f_l\,\dot\theta_l + \partial_x f_l\,\dot x_{l-1},
            \qquad \dot x_L = J\dot\theta .

        Parameters
        ----------
        forward : ForwardPass
        dparams : flat array [P] or parameter structure
            The direction :math:`\dot\theta`.

        Returns
        -------
        (output_tangent, input_tangents)
            :math:`\dot x_L` (the output's shape) and :math:`(\dot x_0, \dots, \dot
            x_{L-1})` (``None`` for zero), the tangents :meth:`r_backward_pass` reads.
        """
        func = "Sequential.jvp_pass"
        self._check_has_params(func)
        forward = self._check_pass(func, forward)
        dparams = self._check_direction(func, forward, dparams)
        out, dins = self._jvp(forward.params, forward.inputs, dparams)
        return out, tuple(dins)

    def backward_pass(self, forward, g_out, per_example=False, param_grads=True, caches=None):
        r"""Backward pass of one output cotangent: every layer's output cotangent and the
        parameter gradients.

        .. math::

            g_L = g_{out},\qquad g_{l-1} = (\partial_x f_l)^\top g_l,\qquad
            \nabla_{\theta_l} = (\partial_\theta f_l)^\top g_l
            \ \big(\textstyle\sum_n \text{ or per example}\big).

        With ``g_out`` the per-example loss gradient (no :math:`1/N`), ``cotangents[l]`` is
        the back-propagated vector :math:`g` of K-FAC at layer :math:`l`'s output.

        Parameters
        ----------
        forward : ForwardPass
        g_out : array of the output's shape
        per_example : bool
            Parameter gradients per example (leading axis ``N``) instead of summed.
        param_grads : bool
            ``False`` skips the parameter gradients (each layer's entry is ``()``).
        caches : tuple, optional
            :meth:`vjp_caches` of ``forward``, shared by many backward passes.

        Returns
        -------
        (grads, cotangents)
            Per layer, the parameter gradients (a tuple of arrays, ``()`` without
            parameters) and :math:`g_l`.
        """
        func = "Sequential.backward_pass"
        forward = self._check_pass(func, forward)
        self._check_cotangent(func, "g_out", forward, g_out)
        per_example = check_bool(func, "per_example", per_example)
        param_grads = check_bool(func, "param_grads", param_grads)
        caches = self._check_caches(func, forward, caches)
        grads, cots = self._backward(forward.params, forward.inputs, g_out, per_example,
                                     param_grads, caches)
        return grads, tuple(cots)

    def stacked_backward_pass(self, forward, g_out, caches=None):
        r"""Backward pass of :math:`C` output cotangents stacked on a leading axis: every
        layer's output cotangents, one batched call per layer
        (:meth:`~kfac_ref.nn.Layer.vjp_input_stacked`; one GEMM for a dense layer) instead
        of :math:`C` passes.  No parameter gradients.

        .. math::

            g_{L,c} = g_{out,c},\qquad g_{l-1,c} = (\partial_x f_l)^\top g_{l,c},
            \qquad c = 1, \dots, C .

        Parameters
        ----------
        forward : ForwardPass
        g_out : array ``[C, *output_shape]``
        caches : tuple, optional
            :meth:`vjp_caches` of ``forward``.

        Returns
        -------
        tuple of arrays
            Per layer, :math:`g_{l,\cdot}` as ``[C, *layer_output_shape]``.
        """
        func = "Sequential.stacked_backward_pass"
        forward = self._check_pass(func, forward)
        self._check_cotangent(func, "g_out", forward, g_out, stacked=True)
        caches = self._check_caches(func, forward, caches)
        return tuple(self._backward_stacked(forward.params, forward.inputs, g_out, caches))

    def r_backward_pass(self, forward, dparams, input_tangents, g_out, rg_out):
        r"""R-operator backward pass (Pearlmutter 1994): the directional derivative of the
        backward pass when :math:`\theta` moves along :math:`\dot\theta`.

        .. math::

            R\{\nabla_{\theta_l}\} = (\partial_\theta f_l)^\top R\{g_l\}
            + R\{\partial_\theta f_l\}^\top g_l,

            R\{g_{l-1}\} = (\partial_x f_l)^\top R\{g_l\} + R\{\partial_x f_l\}^\top g_l,

        layer by layer with :meth:`~kfac_ref.nn.Layer.rvjp`, from :math:`g_L` = ``g_out``
        and :math:`R\{g_L\}` = ``rg_out``.

        Parameters
        ----------
        forward : ForwardPass
        dparams : flat array [P] or parameter structure
            The direction :math:`\dot\theta`.
        input_tangents : sequence
            :meth:`jvp_pass`'s input tangents for ``dparams``.
        g_out, rg_out : arrays of the output's shape

        Returns
        -------
        tuple
            Per layer, :math:`R\{\nabla_{\theta_l}\}` (``()`` without parameters).
        """
        func = "Sequential.r_backward_pass"
        self._check_has_params(func)
        forward = self._check_pass(func, forward)
        dparams = self._check_direction(func, forward, dparams)
        if not isinstance(input_tangents, (tuple, list)) or len(input_tangents) != len(
                self.layers):
            raise KFACTypeError(f"{func}: input_tangents must be the {len(self.layers)} input "
                                f"tangents of jvp_pass; got {describe(input_tangents)}.")
        namespace_of(func, output=forward.output,
                     **{f"input_tangents[{i}]": t for i, t in enumerate(input_tangents)})
        for i, (t, xin) in enumerate(zip(input_tangents, forward.inputs, strict=True)):
            if t is not None:
                check_array(func, f"input_tangents[{i}]", t, shape=tuple(xin.shape))
        self._check_cotangent(func, "g_out", forward, g_out)
        self._check_cotangent(func, "rg_out", forward, rg_out)
        return self._r_backward(forward.params, forward.inputs, dparams, input_tangents, g_out,
                                rg_out)

    # -- one-call passes ---------------------------------------------------------------------
    def forward(self, params, x):
        r"""Network output :math:`f(\theta, x)` for a batch ``x``.

        .. math::

            f(\theta, x) = f_L(\theta_L, \dots f_1(\theta_1, x)).
        """
        params = self.check_params_and_input("Sequential.forward", params, x)
        return self._forward(params, x)[0]

    def forward_with_inputs(self, params, x):
        r"""Output and the list of every layer's input (``inputs[0]`` is ``x``).

        .. math:: (x_L, [x_0, \dots, x_{L-1}])
        """
        params = self.check_params_and_input("Sequential.forward_with_inputs", params, x)
        return self._forward(params, x)[:2]

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
        self._check_has_params(func)
        if dparams is None:
            raise KFACTypeError(f"{func}: dparams must be a flat array [P] or a parameter "
                                f"structure (the direction); got None.")
        params = self.check_params_and_input(func, params, x, dparams=dparams)
        dparams = self.check_param_tangent(func, "dparams", dparams)
        _, inputs, _ = self._forward(params, x)
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
        self._check_has_params(func)
        per_example = check_bool(func, "per_example", per_example)
        params = self.check_params_and_input(func, params, x, g_out=g_out)
        check_array(func, "g_out", g_out, shape=self._output_shape(x.shape),
                    layout="[*output_shape]")
        _, inputs, _ = self._forward(params, x)
        grads, _ = self._backward(params, inputs, g_out, per_example)
        return self._flatten(namespace_of(func, x=g_out), grads, per_example)

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
        params = self.check_params_and_input(func, params, x, g_out=g_out)
        check_array(func, "g_out", g_out, shape=self._output_shape(x.shape),
                    layout="[*output_shape]")
        _, inputs, _ = self._forward(params, x)
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
        self._check_has_params(func)
        if dparams is None:
            raise KFACTypeError(f"{func}: dparams must be a flat array [P] or a parameter "
                                f"structure (the direction); got None.")
        if not callable(output_cotangents):
            raise KFACTypeError(f"{func}: output_cotangents must be a callable (f, f_dot) -> "
                                f"(g, r_g); got {describe(output_cotangents)}.")
        params = self.check_params_and_input(func, params, x, dparams=dparams)
        dparams = self.check_param_tangent(func, "dparams", dparams)
        out, inputs, _ = self._forward(params, x)
        f_dot, dins = self._jvp(params, inputs, dparams)
        cots = output_cotangents(out, f_dot)
        if not isinstance(cots, (tuple, list)) or len(cots) != 2:
            raise KFACTypeError(f"{func}: output_cotangents must return a pair (g, r_g); got "
                                f"{describe(cots)}.")
        g, rg = cots
        xp = namespace_of(func, output=out, g=g, r_g=rg)
        check_array(func, "g", g, shape=tuple(out.shape), layout="[*output_shape]")
        check_array(func, "r_g", rg, shape=tuple(out.shape), layout="[*output_shape]")
        return self._flatten(xp, self._r_backward(params, inputs, dparams, dins, g, rg))
