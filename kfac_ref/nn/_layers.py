r"""Reference layers with explicit forward, Jacobian-vector, vector-Jacobian and R-operator maps.

Every layer is a small immutable object that holds its hyper-parameters (sizes, strides, ...)
and no arrays.  Parameters are passed explicitly as a tuple of arrays, in the order given by
:meth:`Layer.param_names`.  Each layer provides

* ``forward(params, x)`` — the map :math:`y = f(\theta, x)`;
* ``jvp(params, x, dparams, dx)`` — the forward-mode tangent
  :math:`\dot y = \partial_\theta f\,\dot\theta + \partial_x f\,\dot x`;
* ``vjp_input(params, x, g)`` — :math:`(\partial_x f)^\top g` (with ``vjp_cache(params, x)``,
  what it reuses across the cotangents of one forward pass, e.g. an activation's derivative);
* ``param_grads(params, x, g, per_example)`` — :math:`(\partial_\theta f)^\top g`, summed over the
  batch or kept per example (leading axis ``N``);
* ``rvjp(params, x, dparams, dx, g, rg)`` — Pearlmutter's R-operator applied to the backward pass:
  the directional derivative of ``(param_grads, vjp_input)`` when :math:`\theta, x, g` move along
  :math:`\dot\theta, \dot x, \dot g` (``rg``).  This is the second-order piece that turns a
  backward pass into an exact Hessian-vector product.

Each public map validates its arguments once (structure and shapes of ``params``, ``x``,
tangents and cotangents; real floating arrays, integer ids for :class:`Embedding`; one
namespace, device and precision; finite values while value checks are on and the arrays
are eager), then runs the layer's unchecked kernel.  Code that has validated already — a
:class:`~kfac_ref.nn.Sequential` network at its own door — calls the kernels through
:attr:`Layer.kernel`, so no array is scanned twice.

Conventions (see the docs page *Conventions*): batch axis first; dense kernels ``W`` are
``[d_in, d_out]`` with ``y = x W + b``; convolution kernels are HWIO; the bias is the last
parameter of a layer.  A ``None`` tangent or cotangent stands for zero.

References
----------
Pearlmutter, B. A. (1994). Fast exact multiplication by the Hessian. Neural Computation 6(1).
Schraudolph, N. N. (2002). Fast curvature matrix-vector products for second-order gradient
descent. Neural Computation 14(7).
"""

from __future__ import annotations

import math

import array_api_extra as xpx

from .._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_bool,
    check_index_range,
    check_int,
    check_option,
    check_rng,
    check_shape,
    describe,
    device_of,
    kernel_of,
    namespace_of,
    zeros_like_shape,
)
from .._support import capabilities
from ..conv_geometry import ConvGeometry, from_channels_last, to_channels_last
from ..patches import (
    example_chunks,
    extract_convolution_patches,
    per_example_patch_products,
    temporary_bytes_bound,
)

_ABSENT = object()  # an argument the validated method does not take

ACTIVATIONS = ("identity", "tanh", "sigmoid", "relu", "softplus")
"""Names of the elementwise activations of :class:`Activation`."""


def _add(a, b):
    """Sum of two tangents where ``None`` means zero."""
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _zeros_if_none(xp, t, like):
    return xp.zeros_like(like) if t is None else t


@capabilities(dask="yes")
class Layer:
    r"""Base class of the reference layers.

    A layer is the map :math:`y = f(\theta, x)` applied independently to every example of
    the batch (no mixing across the batch axis), so every Jacobian is block diagonal over
    examples:

    .. math::

        \frac{\partial y_n}{\partial x_m} = 0 \quad (n \ne m).

    Subclasses set ``kind`` (the name the block map of the curvature estimator keys on)
    and implement the maps listed in the module docstring.
    """

    kind = "layer"

    # -- parameters -------------------------------------------------------------------
    def param_names(self) -> tuple[str, ...]:
        r"""Names of the parameter arrays, in the layer's canonical order (bias last).

        .. math:: \theta_l = (\theta_{l,1}, \dots, \theta_{l,k}) \quad (\text{bias} = \theta_{l,k})
        """
        return ()

    def param_shapes(self) -> tuple[tuple[int, ...], ...]:
        r"""Shapes of the parameter arrays, in :meth:`param_names` order.

        .. math:: \theta_{l,i} \in \mathbb R^{\text{shape}_i}
        """
        return ()

    @property
    def num_params(self) -> int:
        r"""Number of scalar parameters.

        .. math:: P_l = \textstyle\sum_i \prod \text{shape}_i
        """
        return sum(math.prod(s) for s in self.param_shapes())

    def init_params(self, rng, like):
        r"""Random parameters drawn on the host with ``rng`` and placed like ``like``.

        .. math:: W \sim \mathcal N(0, 1/\text{fan\_in}),\quad b \sim \mathcal N(0, 1/4)

        ``rng`` is a ``numpy.random.Generator``; ``like`` a real floating array whose
        namespace, device and dtype the parameters take (its values are not read).
        """
        func = self._name("init_params")
        check_rng(func, "rng", rng)
        check_array(func, "like", like, finite=False)
        return self._init_params(rng, like)

    def _init_params(self, rng, like):
        return ()

    def check_params(self, func: str, params, label: str = "params",
                     owner: str | None = None) -> tuple:
        r"""Validate a parameter tuple against :meth:`param_shapes` (shapes, real floating
        dtype, one namespace, device and precision, finite values).

        .. math:: \theta_{l,i}.\text{shape} = \text{shape}_i

        ``label`` names the tuple in messages; its arrays are named by :meth:`param_names`
        (``label[i] (name)`` unless ``label`` is ``"params"``; ``label[i] (owner.name)``
        when the layer's ``owner`` name in a network is given).

        Raises
        ------
        KFACValueError, KFACTypeError
        """
        shapes = self.param_shapes()
        if not isinstance(params, (tuple, list)) or len(params) != len(shapes):
            raise KFACValueError(
                f"{func}: {label} of a {type(self).__name__} layer must be a tuple of "
                f"{len(shapes)} arrays {self.param_names()}; got {describe(params)}."
            )
        names = self._arg_names(label, owner)
        if params:  # one namespace, device and precision (static: metadata only)
            namespace_of(func, **dict(zip(names, params, strict=True)))
        for name, p, s in zip(names, params, shapes, strict=True):
            check_array(func, name, p, shape=s)
        return tuple(params)

    def _arg_names(self, label, owner=None):
        """Message names of the arrays of a parameter-shaped tuple called ``label``."""
        if label == "params" and owner is None:
            return self.param_names()
        prefix = "" if owner is None else f"{owner}."
        return tuple(f"{label}[{j}] ({prefix}{n})" for j, n in enumerate(self.param_names()))

    # -- shapes -----------------------------------------------------------------------
    def output_shape(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        r"""Output shape for an input shape (both include the batch axis ``N``).

        .. math:: y = f(\theta, x) \in \mathbb R^{\text{output\_shape}}

        ``input_shape`` is a sequence of non-negative integers: the batch axis and, but for
        the ids of an :class:`Embedding`, at least one more.
        """
        rank = 2 if self.input_dtype == "real floating" else 1
        return self._output_shape(check_shape(self._name("output_shape"), "input_shape",
                                              input_shape, min_ndim=rank))

    def _output_shape(self, input_shape):
        return tuple(input_shape)

    def check_input(self, func: str, x) -> None:
        r"""Validate the input array (rank, trailing sizes, dtype, finite values).

        .. math:: x \in \mathbb R^{N \times \dots}

        Raises
        ------
        KFACValueError, KFACTypeError
        """
        check_array(func, "x", x, min_ndim=2)

    # -- validation of the public maps ---------------------------------------------------
    input_dtype = "real floating"
    """dtype kind of the layer's input: real floating (``"integral"`` for ids)."""

    has_vjp_cache = False
    """Whether :meth:`vjp_cache` returns an array (``cache`` of :meth:`vjp_input`)."""

    def _tangent_arrays(self, label, tangent):
        """``{message name: array}`` of a parameter-shaped tuple, for the namespace check
        (a malformed one is reported by :meth:`check_params`)."""
        if tangent is None or not isinstance(tangent, (tuple, list)):
            return {} if tangent is None else {label: tangent}
        return dict(zip(self._arg_names(label), tangent, strict=False))

    def _check_call(self, func, params, x, *, dparams=None, dx=None, g=_ABSENT, rg=None,
                    cache=None, stacked=False, per_example=None):
        """Validate a call of a public map once: one namespace, device and precision for
        every array, the parameters (:meth:`check_params`), the input (:meth:`check_input`),
        and the tangents and cotangents on the shapes the input implies.  Returns the
        parameters and ``dparams`` as tuples."""
        for label, tup in (("params", params), ("dparams", dparams)):
            if tup is not None and (not isinstance(tup, (tuple, list))
                                    or len(tup) != len(self.param_shapes())):
                self.check_params(func, tup, label)  # raises, naming the structure wanted
        differentiable = self.input_dtype == "real floating"
        if dx is not None and not differentiable:
            raise KFACValueError(f"{func}: dx must be None for a {type(self).__name__} layer "
                                 f"(its integer input has no tangent); got {describe(dx)}.")
        if cache is not None and not self.has_vjp_cache:
            raise KFACValueError(f"{func}: cache must be None for a {type(self).__name__} "
                                 f"layer (it keeps no vjp_cache); got {describe(cache)}.")
        xname = "x" if differentiable else "ids"
        namespace_of(func, **self._tangent_arrays("params", params), **{xname: x},
                     **self._tangent_arrays("dparams", dparams), dx=dx,
                     g=None if g is _ABSENT else g, rg=rg, cache=cache)
        params = self.check_params(func, params)
        self.check_input(func, x)
        if dparams is not None:
            dparams = self.check_params(func, dparams, "dparams")
        if dx is not None:
            check_array(func, "dx", dx, shape=tuple(x.shape), layout="[*x.shape]")
        if cache is not None:
            check_array(func, "cache", cache, shape=tuple(x.shape), layout="[*x.shape]")
        if g is not _ABSENT or rg is not None:
            out = tuple(self._output_shape(tuple(x.shape)))
            if g is not _ABSENT:  # required where given: None is refused
                check_array(func, "g", g, shape=(None, *out) if stacked else out,
                            layout="[C, *output_shape]" if stacked else "[*output_shape]")
            if rg is not None:
                check_array(func, "rg", rg, shape=out, layout="[*output_shape]")
        if per_example is not None:
            check_bool(func, "per_example", per_example)
        return params, dparams

    def _name(self, method):
        return f"{type(self).__name__}.{method}"

    @property
    def kernel(self):
        """The unchecked maps of this layer (``forward``, ``forward_with_tap``, ``jvp``,
        ``vjp_input``, ``vjp_input_stacked``, ``vjp_cache``, ``vjp_cache_given_output``
        (the same cache, given the layer's output too), ``param_grads``, ``rvjp``,
        ``init_params``, ``output_shape``; ``patches`` for :class:`Conv2D`), for code that
        has validated their arguments already: :class:`kfac_ref.nn.Sequential` validates a
        call once at its door and runs every layer through its kernel, so no array is
        checked twice.  Same arguments and results as the public methods, no checks."""
        return _LayerKernel(self)

    # -- maps (public: validate, then run the unchecked kernel) ------------------------------
    def forward(self, params, x):
        r"""The layer map, batched over examples.

        .. math:: y_n = f(\theta, x_n)

        Raises
        ------
        KFACValueError, KFACTypeError
            Parameters or input of the wrong structure, shape, dtype (real floating arrays
            only; integer ids for :class:`Embedding`), mixed namespaces, devices or
            precisions, or non-finite entries (a value check).
        """
        params, _ = self._check_call(self._name("forward"), params, x)
        return self._forward(params, x)

    def forward_with_tap(self, params, x, tap):
        r"""The layer map and a caller's statistic of what the layer's weight multiplies,
        taken while the pass holds it.

        .. math::

            (y, \tau) = \Big(f(\theta, x),\ \sum_{\text{chunks } c} \operatorname{tap}(u_c)\Big)

        :math:`u` is what the weight multiplies: the input :math:`x` here (one chunk, the
        whole batch); a :class:`Conv2D` hands its patches :math:`P(x)` chunk by chunk as
        its forward pass forms them.  ``tap`` must be additive over examples (its value on
        a batch is the sum of its values on the batch's chunks), as any sum over examples
        with a fixed normalisation is; ``None`` gives :math:`\tau` = ``None``.  The layer
        computes no statistic of its own: the K-FAC input factor of a convolution is
        :func:`kfac_ref.factors.conv_input_factor_tap`, which a Kronecker block asks for
        (:meth:`kfac_ref.blocks.kfac_jax.CurvatureBlock.layer_tap`) so the patches are
        extracted once per update.
        """
        func = self._name("forward_with_tap")
        params, _ = self._check_call(func, params, x)
        if tap is not None and not callable(tap):
            raise KFACTypeError(f"{func}: tap must be None or a callable; got {describe(tap)}.")
        return self._forward_with_tap(params, x, tap)

    def _forward_with_tap(self, params, x, tap):
        return self._forward(params, x), (None if tap is None else tap(x))

    def jvp(self, params, x, dparams, dx):
        r"""Forward-mode tangent (``None`` tangents are zero; returns ``None`` if both are).

        .. math:: \dot y = \partial_\theta f\,\dot\theta + \partial_x f\,\dot x

        ``dparams`` is ``None`` or a tuple shaped like ``params``; ``dx`` is ``None`` or an
        array of ``x``'s shape (``None`` for the integer ids of an :class:`Embedding`).
        """
        params, dparams = self._check_call(self._name("jvp"), params, x, dparams=dparams,
                                           dx=dx)
        return self._jvp(params, x, dparams, dx)

    def vjp_input(self, params, x, g, cache=None):
        r"""Input cotangent (``None`` for integer inputs).

        .. math:: \bar x = (\partial_x f)^\top g

        ``g`` has the layer's output shape; ``cache`` is :meth:`vjp_cache`'s result where
        the layer has one (``None`` otherwise).
        """
        params, _ = self._check_call(self._name("vjp_input"), params, x, g=g, cache=cache)
        return (self._vjp_input(params, x, g) if cache is None
                else self._vjp_input(params, x, g, cache=cache))

    def vjp_input_stacked(self, params, x, g, cache=None):
        r"""Input cotangents of :math:`C` output cotangents stacked on a leading axis.

        .. math:: \bar x_c = (\partial_x f)^\top g_c, \qquad c = 1, \dots, C

        ``g`` is ``[C, *output_shape]`` (``output_shape`` with the batch axis); the result is
        ``[C, *x.shape]``.  The base class runs :meth:`vjp_input` once per cotangent and
        stacks the results; the reference layers override it with one batched call (a
        curvature estimate back-propagates all :math:`C` vectors of an estimation mode in
        one pass, :class:`kfac_ref.curvature.BlockDiagonalCurvature`).  ``cache`` is the
        layer's :meth:`vjp_cache`, where it has one.
        """
        params, _ = self._check_call(self._name("vjp_input_stacked"), params, x, g=g,
                                     cache=cache, stacked=True)
        return self._vjp_input_stacked(params, x, g, cache)

    def _vjp_input_stacked(self, params, x, g, cache=None):
        xp = namespace_of(f"{type(self).__name__}.vjp_input_stacked", x=x, g=g)
        kw = {} if cache is None else {"cache": cache}
        outs = [self._vjp_input(params, x, g[c, ...], **kw) for c in range(g.shape[0])]
        return None if outs[0] is None else xp.stack(outs, axis=0)

    def vjp_cache(self, params, x):
        r"""What :meth:`vjp_input` reuses for every cotangent of one forward pass, or ``None``.

        .. math:: c = c(\theta, x), \qquad \bar x = (\partial_x f)^\top g = V(c, g)

        A backward pass for many cotangents (``C`` output vectors of a curvature estimate)
        forms ``c`` once; a layer that returns a cache takes it as ``vjp_input``'s ``cache``
        keyword.  The base class has none.
        """
        params, _ = self._check_call(self._name("vjp_cache"), params, x)
        return self._vjp_cache(params, x)

    def _vjp_cache(self, params, x):
        return None

    def _vjp_cache_given_output(self, params, x, y):
        """:meth:`vjp_cache` inside a forward pass that has the layer's output ``y`` as well
        (a layer whose cache is cheaper to form from ``y`` overrides this)."""
        return self._vjp_cache(params, x)

    def param_grads(self, params, x, g, per_example=False):
        r"""Parameter cotangents, summed over the batch or per example (leading ``N``).

        .. math:: \bar\theta = \sum_n (\partial_\theta f_n)^\top g_n
            \quad\text{or}\quad \big[(\partial_\theta f_n)^\top g_n\big]_n

        Empty for parameter-free layers.  ``g`` has the layer's output shape.
        """
        params, _ = self._check_call(self._name("param_grads"), params, x, g=g,
                                     per_example=per_example)
        return self._param_grads(params, x, g, per_example)

    def _param_grads(self, params, x, g, per_example=False):
        return ()

    def rvjp(self, params, x, dparams, dx, g, rg):
        r"""R-operator of the backward pass: ``(R{param_grads}, R{vjp_input})``.

        .. math::

            R\{\bar\theta\} = \frac{d}{d\epsilon}\sum_n (\partial_\theta f_n)^\top g_n
            \Big|_{(\theta, x, g) + \epsilon(\dot\theta, \dot x, \dot g)},\quad
            R\{\bar x\} = \frac{d}{d\epsilon}(\partial_x f)^\top g\Big|_{\dots}

        ``dparams``, ``dx`` and ``rg`` may be ``None`` (zero); ``g`` and ``rg`` have the
        layer's output shape.
        """
        params, dparams = self._check_call(self._name("rvjp"), params, x, dparams=dparams,
                                           dx=dx, g=g, rg=rg)
        return self._rvjp(params, x, dparams, dx, g, rg)

    def _forward(self, params, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def _jvp(self, params, x, dparams, dx):  # pragma: no cover - abstract
        raise NotImplementedError

    def _vjp_input(self, params, x, g):  # pragma: no cover - abstract
        raise NotImplementedError

    def _rvjp(self, params, x, dparams, dx, g, rg):  # pragma: no cover - abstract
        raise NotImplementedError

    def _bilinear_rvjp(self, func, params, x, dparams, dx, g, rg):
        r"""R-backward of a layer bilinear in its kernel and input (Dense, Conv2D), from its
        parameter gradients :math:`\partial_\theta(x, g)` and input gradient
        :math:`\partial_x(W, g)`.

        .. math::

            R\{\partial_W\} = \partial_W(x, Rg) + \partial_W(\dot x, g), \quad
            R\{\partial_b\} = \partial_b(Rg), \quad
            R\{\partial_x\} = \partial_x(W, Rg) + \partial_x(\dot W, g)
        """
        xp = namespace_of(func, x=x, g=g)
        rg = _zeros_if_none(xp, rg, g)
        r_params = self._param_grads(params, x, rg)
        if dx is not None:
            r_w = r_params[0] + self._param_grads(params, dx, g)[0]
            r_params = (r_w, *r_params[1:])
        r_x = self._vjp_input(params, x, rg)
        if dparams is not None:
            r_x = r_x + self._vjp_input(dparams, x, g)
        return r_params, r_x

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _LayerKernel:
    """The unchecked maps of one layer (:attr:`Layer.kernel`), bound to it."""

    __slots__ = ("forward", "forward_with_tap", "jvp", "vjp_input", "vjp_input_stacked",
                 "vjp_cache", "vjp_cache_given_output", "param_grads", "rvjp", "init_params",
                 "output_shape", "patches")

    def __init__(self, layer):
        for name in self.__slots__:
            if hasattr(layer, "_" + name):  # patches: convolutions only
                setattr(self, name, getattr(layer, "_" + name))


def _normal_init(rng, like, shape, scale):
    import numpy as np  # host-side random draws only

    from .._backend import host_draw

    return host_draw(rng, like, lambda r: scale * r.standard_normal(shape).astype(np.float64))


# ----------------------------------------------------------------------------------------
# Dense
# ----------------------------------------------------------------------------------------
@capabilities(dask="yes")
class Dense(Layer):
    r"""Fully connected layer, optionally applied to every position of ``[N, T, d]`` inputs.

    .. math::

        y_{n,t} = x_{n,t} W + b, \qquad W \in \mathbb{R}^{d_{in} \times d_{out}},\;
        b \in \mathbb{R}^{d_{out}},

    with the optional position axis ``t`` (weight sharing, Eschenhagen et al. 2023).  The
    parameter cotangents sum over positions:
    :math:`\partial W = \sum_t x_{n,t}^\top g_{n,t}`, :math:`\partial b = \sum_t g_{n,t}`.
    Flattened, the layer's parameters are the row-major ``[W; b]`` of shape
    ``[d_in + 1, d_out]`` (bias last).

    Parameters
    ----------
    d_in, d_out : int
    use_bias : bool

    Raises
    ------
    KFACValueError
        Non-positive sizes; inputs whose last axis is not ``d_in`` or whose rank is not 2 or 3.
    """

    kind = "dense"

    def __init__(self, d_in: int, d_out: int, use_bias: bool = True):
        self.d_in = check_int("Dense", "d_in", d_in, minimum=1)
        self.d_out = check_int("Dense", "d_out", d_out, minimum=1)
        self.use_bias = check_bool("Dense", "use_bias", use_bias)

    def param_names(self):
        return ("w", "b") if self.use_bias else ("w",)

    def param_shapes(self):
        w = (self.d_in, self.d_out)
        return (w, (self.d_out,)) if self.use_bias else (w,)

    def _init_params(self, rng, like):
        w = _normal_init(rng, like, (self.d_in, self.d_out), 1.0 / math.sqrt(self.d_in))
        if not self.use_bias:
            return (w,)
        return (w, _normal_init(rng, like, (self.d_out,), 0.5))

    def _output_shape(self, input_shape):
        return (*input_shape[:-1], self.d_out)

    def check_input(self, func, x):
        check_array(func, "x", x, ndim=(2, 3), layout="[N, d_in] or [N, T, d_in]")
        if x.shape[-1] != self.d_in:
            raise KFACValueError(
                f"{func}: x must have last axis d_in = {self.d_in}; got shape {tuple(x.shape)}."
            )

    def _forward(self, params, x):
        y = x @ params[0]
        return y + params[1] if self.use_bias else y

    def _jvp(self, params, x, dparams, dx):
        out = None
        if dparams is not None:
            out = x @ dparams[0]
            if self.use_bias:
                out = out + dparams[1]
        if dx is not None:
            out = _add(out, dx @ params[0])
        return out

    def _vjp_input(self, params, x, g):
        return g @ params[0].T

    def _vjp_input_stacked(self, params, x, g, cache=None):
        # one 2-D GEMM over every leading axis (a stacked matmul runs one GEMM per vector)
        xp = namespace_of("Dense.vjp_input_stacked", x=x, g=g)
        out = xp.reshape(g, (-1, g.shape[-1])) @ params[0].T
        return xp.reshape(out, (*g.shape[:-1], out.shape[-1]))

    def _param_grads(self, params, x, g, per_example=False):
        xp = namespace_of("Dense.param_grads", x=x, g=g)
        if per_example:
            if x.ndim == 2:
                gw = x[:, :, None] * g[:, None, :]
                gb = g
            else:
                gw = xp.permute_dims(x, (0, 2, 1)) @ g
                gb = xp.sum(g, axis=1)
        else:
            x2 = xp.reshape(x, (-1, self.d_in))
            g2 = xp.reshape(g, (-1, self.d_out))
            gw = x2.T @ g2
            gb = xp.sum(g2, axis=0)
        return (gw, gb) if self.use_bias else (gw,)

    def _rvjp(self, params, x, dparams, dx, g, rg):
        # R{x^T g} = dx^T g + x^T rg ; R{sum g} = sum rg ; R{g W^T} = rg W^T + g dW^T
        return self._bilinear_rvjp("Dense.rvjp", params, x, dparams, dx, g, rg)

    def __repr__(self):
        return f"Dense({self.d_in}, {self.d_out}, use_bias={self.use_bias})"


# ----------------------------------------------------------------------------------------
# Conv2D
# ----------------------------------------------------------------------------------------
@capabilities(dask="yes")
class Conv2D(Layer):
    r"""2-D convolution computed as patch extraction followed by one GEMM.

    .. math::

        y_{n,t} = P(x)_{n,t}\, K + b, \qquad
        K \in \mathbb{R}^{(k_h k_w C_{in}) \times C_{out}},

    where :math:`P(x)_{n,t}` is the patch of example ``n`` at output location ``t``, ordered
    ``(kh, kw, C_in)`` with ``C_in`` fastest (:func:`kfac_ref.patches.extract_convolution_patches`),
    and ``K`` is the HWIO kernel ``[kh, kw, C_in, C_out]`` reshaped row-major.  The input
    cotangent is the transpose of patch extraction applied to :math:`g K^\top`:

    .. math::

        \partial x = P^\top\!\big(g K^\top\big), \qquad
        \partial K = \sum_t P(x)_{n,t}^\top g_{n,t}, \qquad \partial b = \sum_t g_{n,t}.

    :math:`P^\top` is the patch-transpose scatter ("col2im"): the patch entry of kernel offset
    :math:`(a, b)` at output location :math:`(i, j)` is added to padded pixel
    :math:`(i s_h + a d_h,\ j s_w + b d_w)`, then the padding is cropped,

    .. math::

        \partial x^{\text{pad}}_{n,u,v,c} = \sum_{a,b}\ \sum_{(i,j):\,
            i s_h + a d_h = u,\ j s_w + b d_w = v} (g K^\top)_{n,(i,j),(a,b,c)},

    computed axis by axis (rows, then columns): writing the padded row as
    :math:`u = q s_h + r`, offset :math:`a` reaches phase :math:`r = a d_h \bmod s_h` at
    :math:`q = i + (a d_h - r)/s_h`, so each phase is a sum of shifted slices of the patch
    cotangent and the phases interleave by one stack (no scatter, no gather, no dense
    :math:`[HW, |T| k_h k_w]` selection matrix, nothing written in place).  Every
    pass runs over chunks of examples whose patch temporaries stay within
    ``max_temporary_bytes``.  Padding amounts, output grid and
    layout come from one :class:`kfac_ref.conv_geometry.ConvGeometry` (:meth:`geometry`), the
    geometry the patch extractor and the conv factors use; the per-example weight gradient
    is the patches' per-example product (``kfac_ref.patches.per_example_patch_products``).

    Parameters
    ----------
    c_in, c_out : int
    kernel_size : int or (int, int)
    stride, dilation : int or (int, int)
    padding : "VALID", "SAME" or ((top, bottom), (left, right))
        "SAME" splits as TF does (low side gets ``total // 2``).
    data_format : {"NHWC", "NCHW"}
        Layout of inputs and outputs; the kernel is always HWIO.
    use_bias : bool
    max_temporary_bytes : int, optional
        Bound on the patch-sized temporaries of every pass (default
        :func:`kfac_ref.patches.temporary_bytes_bound` of the arrays of each call: 64 MiB on
        the host, a share of free GPU memory on a GPU): the forward, jvp, input
        cotangent and weight gradient run over chunks of examples
        (:func:`kfac_ref.patches.example_chunks`), each holding at most this many bytes of
        patches (one example at least), and concatenate (outputs, cotangents) or sum
        (weight gradients) the chunks' results; a chunk's temporaries are counted by
        :meth:`kfac_ref.conv_geometry.ConvGeometry.temporary_entries_per_example`.  Peak
        memory is then about this bound plus twice the output (the chunks' results and their
        concatenation).  Outputs are unchanged up to the rounding of the chunked sums.
        :meth:`forward_with_tap` runs the same chunks and sums its tap over them (for
        the KFC input factor, a :math:`(K+b)^2` accumulator).

    Raises
    ------
    KFACValueError
        Bad sizes, unknown layouts, inputs of the wrong rank or channel count.
    """

    kind = "conv2d"

    def __init__(self, c_in, c_out, kernel_size, stride=1, padding="VALID", dilation=1,
                 data_format="NHWC", use_bias=True, max_temporary_bytes=None):
        func = "Conv2D"
        self.c_in = check_int(func, "c_in", c_in, minimum=1)
        self.c_out = check_int(func, "c_out", c_out, minimum=1)
        self.kernel_size = _pair(func, "kernel_size", kernel_size)
        self.stride = _pair(func, "stride", stride)
        self.dilation = _pair(func, "dilation", dilation)
        if isinstance(padding, str):
            check_option(func, "padding", padding, ("VALID", "SAME"))
            self.padding = padding
        else:
            try:
                (pt, pb), (pl, pr) = padding
            except (TypeError, ValueError):
                raise KFACValueError(
                    f"{func}: padding must be 'VALID', 'SAME' or ((top, bottom), (left, right)); "
                    f"got {padding!r}."
                ) from None
            # integers >= 0 (no silent truncation of 1.5 to 1)
            pt, pb, pl, pr = (check_int(func, "padding", v, minimum=0) for v in (pt, pb, pl, pr))
            self.padding = ((pt, pb), (pl, pr))
        self.data_format = check_option(func, "data_format", data_format, ("NHWC", "NCHW"))
        self.use_bias = check_bool(func, "use_bias", use_bias)
        self.max_temporary_bytes = (None if max_temporary_bytes is None else check_int(
            func, "max_temporary_bytes", max_temporary_bytes, minimum=1))

    # -- geometry ------------------------------------------------------------------------
    @property
    def patch_size(self) -> int:
        r"""Length of one patch.

        .. math:: k_h k_w C_{in}
        """
        return self.kernel_size[0] * self.kernel_size[1] * self.c_in

    @property
    def filter_shape(self) -> tuple[int, int, int, int]:
        r"""HWIO kernel shape ``(kh, kw, C_in, C_out)``.

        .. math:: K \in \mathbb R^{k_h \times k_w \times C_{in} \times C_{out}}
        """
        return (*self.kernel_size, self.c_in, self.c_out)

    def _padding_arg(self):
        return self.padding if isinstance(self.padding, str) else list(self.padding)

    def geometry(self, input_shape):
        r"""The :class:`kfac_ref.conv_geometry.ConvGeometry` of this layer on inputs of shape
        ``input_shape`` (in the layer's ``data_format``).

        .. math:: o = \lfloor (n + p_{lo} + p_{hi} - (k-1)d - 1)/s \rfloor + 1
        """
        return ConvGeometry.build("Conv2D", tuple(input_shape), self.filter_shape,
                                  strides=self.stride, padding=self._padding_arg(),
                                  dilation=self.dilation, data_format=self.data_format,
                                  strides_name="stride", dilation_name="dilation",
                                  check_channels=False)

    def spatial_output(self, input_shape):
        r"""Output spatial size ``(Ho, Wo)`` (:attr:`ConvGeometry.output_spatial_shape`).

        .. math:: o = \lfloor (n + p_{lo} + p_{hi} - (k-1)d - 1)/s \rfloor + 1
        """
        return self.geometry(input_shape).output_spatial_shape

    def _output_shape(self, input_shape):
        ho, wo = self.spatial_output(input_shape)
        n = input_shape[0]
        return (n, ho, wo, self.c_out) if self.data_format == "NHWC" else (n, self.c_out, ho, wo)

    def check_input(self, func, x):
        lay = "[N, H, W, C_in]" if self.data_format == "NHWC" else "[N, C_in, H, W]"
        check_array(func, "x", x, ndim=4, layout=lay)
        c = x.shape[3] if self.data_format == "NHWC" else x.shape[1]
        if c != self.c_in:
            raise KFACValueError(
                f"{func}: x must have C_in = {self.c_in} channels {lay}; got shape "
                f"{tuple(x.shape)}."
            )
        ho, wo = self.spatial_output(tuple(x.shape))
        if ho < 1 or wo < 1:
            raise KFACValueError(
                f"{func}: x must be large enough for the kernel (output size >= 1); got shape "
                f"{tuple(x.shape)} for kernel {self.kernel_size}, dilation {self.dilation}, "
                f"padding {self.padding!r}."
            )

    # -- parameters ------------------------------------------------------------------------
    def param_names(self):
        return ("w", "b") if self.use_bias else ("w",)

    def param_shapes(self):
        w = (*self.kernel_size, self.c_in, self.c_out)
        return (w, (self.c_out,)) if self.use_bias else (w,)

    def _init_params(self, rng, like):
        w = _normal_init(rng, like, self.param_shapes()[0], 1.0 / math.sqrt(self.patch_size))
        if not self.use_bias:
            return (w,)
        return (w, _normal_init(rng, like, (self.c_out,), 0.5))

    # -- layout helpers ----------------------------------------------------------------------
    def _to_nhwc(self, xp, x):
        return to_channels_last(xp, x, self.data_format == "NHWC")

    def _from_nhwc(self, xp, y):
        return from_channels_last(xp, y, self.data_format == "NHWC")

    def patches(self, x):
        r"""Patches of ``x`` as ``[N, Ho, Wo, kh·kw·C_in]`` (locations in NHWC order).

        .. math::

            P(x)_{n,(i,j)} = \big[x^{\text{pad}}_{n,\, i s_h + a d_h,\; j s_w + b d_w,\; c}
            \big]_{(a, b, c)}, \quad c \text{ fastest}.

        The kernel of :func:`kfac_ref.patches.extract_convolution_patches` on the layer's
        :meth:`geometry`; ``x`` is validated as :meth:`forward` validates it (code that has
        validated ``x`` already calls ``layer.kernel.patches``, :attr:`Layer.kernel`).
        """
        func = "Conv2D.patches"
        namespace_of(func, x=x)
        self.check_input(func, x)
        return self._patches(x)

    def _patches(self, x):
        xp = namespace_of("Conv2D.patches", x=x)
        p = extract_convolution_patches.kernel(xp, x, self.geometry(tuple(x.shape)))
        return xp.reshape(p, (*p.shape[:3], self.patch_size))

    def _kernel_matrix(self, xp, w):
        return xp.reshape(w, (self.patch_size, self.c_out))

    def _chunks(self, xp, like, spatial_in, extra_columns=0):
        """``(start, stop)`` chunks of examples whose patch temporaries
        (:meth:`kfac_ref.conv_geometry.ConvGeometry.temporary_entries_per_example` entries
        per example) fit in :attr:`max_temporary_bytes`."""
        if like.shape[0] == 0:  # an empty batch is one empty chunk: empty outputs, zero sums
            return [(0, 0)]
        entries = self.geometry(tuple(spatial_in)).temporary_entries_per_example(extra_columns)
        return example_chunks(like.shape[0], entries, xp.finfo(like.dtype).bits // 8,
                              temporary_bytes_bound(like, self.max_temporary_bytes))

    @staticmethod
    def _concat_chunks(xp, fn, bounds, *arrays):
        """``fn`` on each chunk of examples of ``arrays``, results concatenated (axis 0)."""
        if len(bounds) == 1:
            return fn(*arrays)
        return xp.concat([fn(*(a[lo:hi, ...] for a in arrays)) for lo, hi in bounds], axis=0)

    @staticmethod
    def _adjoint_along_axis(xp, g, k, stride, dil, start, length):
        r"""Adjoint of patch extraction along one spatial axis, by stride phases.

        ``g`` is ``[*lead, O, B, k, R]`` (``O`` output positions, ``k`` kernel offsets);
        returns ``[*lead, length, B, R]``.  Padded input position ``h^p = h + start``
        receives :math:`\sum_a g_{i,a}` over the offsets with :math:`h^p = i s + a d`.
        Writing :math:`h^p = q s + r`, offset ``a`` lands in phase :math:`r = a d \bmod s`
        at row :math:`q = i + (a d - r)/s`: each phase is a sum of shifted slices of ``g``
        (zero rows padded on, no scatter), and the phases interleave by one stack and a
        free reshape.  No array is written in place.
        """
        *lead, o, b, _, r = g.shape
        q = -(-(start + length) // stride)  # phase rows that cover the padded [0, start+length)
        axis = len(lead)

        def zeros(rows):
            return zeros_like_shape(g, (*lead, rows, b, r))

        phases = []
        for phase in range(stride):
            total = None
            for a in range(k):
                if (a * dil) % stride != phase:
                    continue
                shift = (a * dil - phase) // stride
                keep = min(o, q - shift)  # rows of this offset that land inside [0, q)
                if keep <= 0:
                    continue
                term = g[..., :keep, :, a, :]
                after = q - shift - keep
                placed = term if not (shift or after) else xpx.pad(
                    term, [(0, 0)] * axis + [(shift, after), (0, 0), (0, 0)], xp=xp)
                total = placed if total is None else total + placed
            phases.append(zeros(q) if total is None else total)
        inter = phases[0] if stride == 1 else xp.reshape(
            xp.stack(phases, axis=axis + 1), (*lead, q * stride, b, r))
        return inter[..., start:start + length, :, :]

    def _transpose_patches(self, xp, gp, hw):
        r"""Adjoint of patch extraction (col2im): gp ``[N, Ho, Wo, kh·kw·C_in]`` →
        ``[N, H, W, C_in]`` (NHWC).

        .. math::

            \bar x_{n,h,w,c} = \sum_{a,b} [\,h^{p} - a d_h = i s_h,\ w^{p} - b d_w = j s_w\,]\;
            \bar P_{n,(i,j),(a,b,c)}

        Rows, then columns (:meth:`_adjoint_along_axis`): shifted slices summed per stride
        phase, no gather, no zero insertion, no copying transpose.
        """
        geo = self.geometry((1, *hw, self.c_in) if self.data_format == "NHWC"
                            else (1, self.c_in, *hw))
        (ho, wo), ((top, _), (left, _)) = geo.output_spatial_shape, geo.padding
        kh, kw = self.kernel_size
        (sh, sw), (dh, dw) = self.stride, self.dilation
        n, c = gp.shape[0], self.c_in
        g = xp.reshape(gp, (n, ho, wo, kh, kw * c))  # rows: O = Ho, B = Wo, k = kh
        rows = self._adjoint_along_axis(xp, g, kh, sh, dh, top, hw[0])  # [N, H, Wo, kw·C]
        g = xp.reshape(rows, (n, hw[0], wo, 1, kw, c))  # columns: O = Wo, B = 1, k = kw
        full = self._adjoint_along_axis(xp, g, kw, sw, dw, left, hw[1])  # [N, H, W, 1, C]
        return xp.reshape(full, (n, hw[0], hw[1], c))

    # -- maps --------------------------------------------------------------------------------
    def _conv(self, xp, x, w, b):
        k = self._kernel_matrix(xp, w)

        def conv(xc):
            y = self._patches(xc) @ k
            return y if b is None else y + b

        return self._from_nhwc(xp, self._concat_chunks(xp, conv, self._chunks(xp, x, x.shape),
                                                      x))

    def _forward(self, params, x):
        xp = namespace_of("Conv2D.forward", x=x)
        return self._conv(xp, x, params[0], params[1] if self.use_bias else None)

    def _forward_with_tap(self, params, x, tap):
        r"""The output and ``tap`` summed over the patches of the chunks it was computed
        from.

        .. math::

            y = P(x) K + b, \qquad
            \tau = \sum_{\text{chunks } c} \operatorname{tap}\big(P(x_c)\big),

        with :math:`P(x_c)` the ``[B, Ho, Wo, kh·kw·C_in]`` patches of a chunk of :math:`B`
        examples (:meth:`patches`), handed over while they are alive, so a statistic of the
        patches (:func:`kfac_ref.factors.conv_input_factor_tap`, the KFC input factor
        :math:`\Omega`) needs no second patch extraction.  The chunks hold at most
        ``max_temporary_bytes`` of patches, as in :meth:`forward` (counted with one
        homogeneous column when the layer has a bias).
        """
        if tap is None:
            return self._forward(params, x), None
        xp = namespace_of("Conv2D.forward_with_tap", x=x)
        k = self._kernel_matrix(xp, params[0])
        bias = params[1] if self.use_bias else None
        outs, total = [], None
        for lo, hi in self._chunks(xp, x, x.shape, int(self.use_bias)):
            p = self._patches(x if (lo, hi) == (0, x.shape[0]) else x[lo:hi, ...])
            y = p @ k
            outs.append(y if bias is None else y + bias)
            part = tap(p)
            total = part if total is None else total + part
        y = outs[0] if len(outs) == 1 else xp.concat(outs, axis=0)
        return self._from_nhwc(xp, y), total

    def _jvp(self, params, x, dparams, dx):
        xp = namespace_of("Conv2D.jvp", x=x)
        out = None
        if dparams is not None:
            out = self._conv(xp, x, dparams[0], dparams[1] if self.use_bias else None)
        if dx is not None:
            out = _add(out, self._conv(xp, dx, params[0], None))
        return out

    def _vjp_input(self, params, x, g):
        xp = namespace_of("Conv2D.vjp_input", x=x, g=g)
        return self._vjp_input_rows(xp, params, tuple(x.shape), g)

    def _vjp_input_stacked(self, params, x, g, cache=None):
        # the input cotangent does not read x: the C·N stacked cotangents are one batch
        xp = namespace_of("Conv2D.vjp_input_stacked", x=x, g=g)
        c = g.shape[0]
        rows = xp.reshape(g, (c * g.shape[1], *g.shape[2:]))
        out = self._vjp_input_rows(xp, params, tuple(x.shape), rows)
        return xp.reshape(out, (c, *x.shape))

    def _vjp_input_rows(self, xp, params, x_shape, g):
        """Input cotangents of the rows of ``g`` (any number of examples) for inputs of
        shape ``x_shape``, chunked within :attr:`max_temporary_bytes`."""
        g = self._to_nhwc(xp, g)
        kt = self._kernel_matrix(xp, params[0]).T
        hw = x_shape[1:3] if self.data_format == "NHWC" else x_shape[2:4]

        def cotangent(gc):  # the patch cotangent g Kᵀ is the chunk's largest temporary
            return self._transpose_patches(xp, gc @ kt, hw)

        return self._from_nhwc(xp, self._concat_chunks(xp, cotangent,
                                                      self._chunks(xp, g, x_shape), g))

    def _param_grads(self, params, x, g, per_example=False):
        xp = namespace_of("Conv2D.param_grads", x=x, g=g)
        kshape = self.param_shapes()[0]
        n = x.shape[0]
        bounds = self._chunks(xp, x, x.shape)
        if per_example:  # Σ_t p gᵀ per example, one batched GEMM per chunk
            def per_example_weight(xc, gc):
                p = _location_rows(xp, self._patches(xc))
                return per_example_patch_products(
                    xp, p, _location_rows(xp, self._to_nhwc(xp, gc)))

            gw = xp.reshape(self._concat_chunks(xp, per_example_weight, bounds, x, g),
                            (n, *kshape))
            gb = xp.sum(_location_rows(xp, self._to_nhwc(xp, g)), axis=1)
        else:  # Σ over chunks of Pᵀ g: one GEMM per chunk
            def chunk_weight_grad(lo, hi):  # a chunk's patches die before the next's
                p2 = xp.reshape(self._patches(x[lo:hi, ...]), (-1, self.patch_size))
                g2 = xp.reshape(self._to_nhwc(xp, g[lo:hi, ...]), (-1, self.c_out))
                return p2.T @ g2

            gw = None
            for lo, hi in bounds:
                part = chunk_weight_grad(lo, hi)
                gw = part if gw is None else gw + part
            gw = xp.reshape(gw, kshape)
            gb = xp.sum(xp.reshape(self._to_nhwc(xp, g), (-1, self.c_out)), axis=0)
        return (gw, gb) if self.use_bias else (gw,)

    def _rvjp(self, params, x, dparams, dx, g, rg):
        return self._bilinear_rvjp("Conv2D.rvjp", params, x, dparams, dx, g, rg)

    def __repr__(self):
        return (f"Conv2D({self.c_in}, {self.c_out}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding!r}, dilation={self.dilation}, "
                f"data_format={self.data_format!r}, use_bias={self.use_bias})")


def _location_rows(xp, a):
    """``[N, Ho, Wo, K]`` → ``[N, Ho·Wo, K]`` (sizes spelled out: an empty batch has no
    ``-1`` to infer)."""
    return xp.reshape(a, (a.shape[0], a.shape[1] * a.shape[2], a.shape[3]))


def _pair(func, name, v):
    if isinstance(v, int) and not isinstance(v, bool):
        v = (v, v)
    try:
        a, b = v
    except (TypeError, ValueError):
        raise KFACValueError(f"{func}: {name} must be an int or a pair of ints; got {v!r}.") \
            from None
    return (check_int(func, name, a, minimum=1), check_int(func, name, b, minimum=1))


# ----------------------------------------------------------------------------------------
# Scale and shift
# ----------------------------------------------------------------------------------------
@capabilities(dask="yes")
class ScaleAndShift(Layer):
    r"""Per-channel scale and shift on the last axis (the affine part of a normalisation layer).

    .. math::

        y_{n,\dots,c} = x_{n,\dots,c}\, s_c + t_c, \qquad
        \partial s_c = \sum_{\dots} g_{n,\dots,c}\, x_{n,\dots,c}, \quad
        \partial t_c = \sum_{\dots} g_{n,\dots,c}.

    Flattened parameters: ``[s; t]`` (shift last), matching kfac-jax's
    ``ScaleAndShiftDiagonal`` (scale then shift).

    Parameters
    ----------
    num_channels : int
    has_scale, has_shift : bool
        At least one must be true.
    """

    kind = "scale_and_shift"

    def __init__(self, num_channels, has_scale=True, has_shift=True):
        self.num_channels = check_int("ScaleAndShift", "num_channels", num_channels, minimum=1)
        self.has_scale = check_bool("ScaleAndShift", "has_scale", has_scale)
        self.has_shift = check_bool("ScaleAndShift", "has_shift", has_shift)
        if not (self.has_scale or self.has_shift):
            raise KFACValueError("ScaleAndShift: has_scale or has_shift must be true; got both "
                                 "False.")

    def param_names(self):
        return (("scale",) if self.has_scale else ()) + (("shift",) if self.has_shift else ())

    def param_shapes(self):
        return tuple((self.num_channels,) for _ in self.param_names())

    def _init_params(self, rng, like):
        out = []
        if self.has_scale:
            import numpy as np  # host-side random draws only

            from .._backend import host_draw

            out.append(host_draw(rng, like,
                                 lambda r: 1.0 + 0.3 * r.standard_normal(self.num_channels)
                                 .astype(np.float64)))
        if self.has_shift:
            out.append(_normal_init(rng, like, (self.num_channels,), 0.5))
        return tuple(out)

    def check_input(self, func, x):
        check_array(func, "x", x, min_ndim=2, layout="[N, ..., C]")
        if x.shape[-1] != self.num_channels:
            raise KFACValueError(
                f"{func}: x must have last axis C = {self.num_channels}; got shape "
                f"{tuple(x.shape)}."
            )

    def _split(self, params):
        s = params[0] if self.has_scale else None
        t = params[-1] if self.has_shift else None
        return s, t

    def _forward(self, params, x):
        s, t = self._split(params)
        y = x * s if s is not None else x
        return y + t if t is not None else y

    def _jvp(self, params, x, dparams, dx):
        xp = namespace_of("ScaleAndShift.jvp", x=x)
        s, _ = self._split(params)
        out = None
        if dparams is not None:
            ds, dt = self._split(dparams)
            out = x * ds if ds is not None else None
            out = _add(out, None if dt is None else xp.broadcast_to(dt, x.shape))
        if dx is not None:
            out = _add(out, dx * s if s is not None else dx)
        return out

    def _vjp_input(self, params, x, g):
        s, _ = self._split(params)
        return g * s if s is not None else g

    def _vjp_input_stacked(self, params, x, g, cache=None):
        return self._vjp_input(params, x, g)  # the per-channel scale broadcasts

    def _param_grads(self, params, x, g, per_example=False):
        xp = namespace_of("ScaleAndShift.param_grads", x=x, g=g)
        n, s = x.shape[0], math.prod(x.shape[1:-1])  # no -1: an empty batch has none
        c = self.num_channels
        out = []
        if per_example:
            if self.has_scale:
                out.append(xp.sum(xp.reshape(g * x, (n, s, c)), axis=1))
            if self.has_shift:
                out.append(xp.sum(xp.reshape(g, (n, s, c)), axis=1))
        else:
            if self.has_scale:
                out.append(xp.sum(xp.reshape(g * x, (-1, c)), axis=0))
            if self.has_shift:
                out.append(xp.sum(xp.reshape(g, (-1, c)), axis=0))
        return tuple(out)

    def _rvjp(self, params, x, dparams, dx, g, rg):
        xp = namespace_of("ScaleAndShift.rvjp", x=x, g=g)
        rg = _zeros_if_none(xp, rg, g)
        r_params = self._param_grads(params, x, rg)
        if dx is not None and self.has_scale:
            r_params = (r_params[0] + xp.sum(xp.reshape(g * dx, (-1, self.num_channels)),
                                             axis=0), *r_params[1:])
        r_x = self._vjp_input(params, x, rg)
        if dparams is not None and self.has_scale:
            r_x = r_x + g * dparams[0]
        return r_params, r_x

    def __repr__(self):
        return (f"ScaleAndShift({self.num_channels}, has_scale={self.has_scale}, "
                f"has_shift={self.has_shift})")


# ----------------------------------------------------------------------------------------
# Embedding
# ----------------------------------------------------------------------------------------
@capabilities(dask="yes")
class Embedding(Layer):
    r"""Embedding lookup of integer ids, a dense layer on one-hot inputs without bias.

    .. math::

        y_{n,t} = E_{i_{n,t}} = \mathrm{onehot}(i_{n,t})^\top E, \qquad
        \partial E = \sum_{n,t} \mathrm{onehot}(i_{n,t})\, g_{n,t}^\top ,

    with ``E`` of shape ``[vocab_size, dim]``.  Ids ``[N]`` or ``[N, T]`` are integers and are
    not differentiable (``vjp_input`` returns ``None``); an embedding is therefore the first
    layer of a network.

    Parameters
    ----------
    vocab_size, dim : int
    """

    kind = "embedding"
    input_dtype = "integral"

    def __init__(self, vocab_size, dim):
        self.vocab_size = check_int("Embedding", "vocab_size", vocab_size, minimum=1)
        self.dim = check_int("Embedding", "dim", dim, minimum=1)

    def param_names(self):
        return ("embeddings",)

    def param_shapes(self):
        return ((self.vocab_size, self.dim),)

    def _init_params(self, rng, like):
        return (_normal_init(rng, like, (self.vocab_size, self.dim), 1.0),)

    def _output_shape(self, input_shape):
        return (*input_shape, self.dim)

    def check_input(self, func, x):
        check_array(func, "ids", x, ndim=(1, 2), dtype="integral", layout="[N] or [N, T]")
        namespace_of(func, ids=x)
        check_index_range(func, "ids", x, self.vocab_size, "vocab_size")

    def one_hot(self, ids, dtype):
        r"""``[..., vocab_size]`` one-hot encoding of ``ids`` in ``dtype``.

        .. math:: \mathrm{onehot}(i)_v = [v = i]
        """
        xp = namespace_of("Embedding.one_hot", ids=ids)
        classes = xp.arange(self.vocab_size, dtype=ids.dtype, device=device_of(ids))
        return xp.astype(ids[..., None] == classes, dtype)

    def _forward(self, params, x):
        xp = namespace_of("Embedding.forward", ids=x, params=params[0])
        flat = xp.reshape(x, (-1,))
        y = xp.take(params[0], flat, axis=0)
        return xp.reshape(y, (*x.shape, self.dim))

    def _jvp(self, params, x, dparams, dx):
        if dparams is None:
            return None
        return self._forward(dparams, x)

    def _vjp_input(self, params, x, g):
        return None

    def _param_grads(self, params, x, g, per_example=False):
        xp = namespace_of("Embedding.param_grads", g=g)
        oh = self.one_hot(x, g.dtype)
        if per_example:
            if x.ndim == 1:
                return (oh[:, :, None] * g[:, None, :],)
            return (xp.permute_dims(oh, (0, 2, 1)) @ g,)
        return (xp.reshape(oh, (-1, self.vocab_size)).T @ xp.reshape(g, (-1, self.dim)),)

    def _rvjp(self, params, x, dparams, dx, g, rg):
        xp = namespace_of("Embedding.rvjp", g=g)
        rg = _zeros_if_none(xp, rg, g)
        return self._param_grads(params, x, rg), None

    def __repr__(self):
        return f"Embedding({self.vocab_size}, {self.dim})"


# ----------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------
def _sigmoid(xp, x):
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@capabilities(dask="yes")
def activation_derivatives(kind, x):
    r"""Value, first and second derivative of an elementwise activation.

    .. math::

        \begin{aligned}
        \tanh:&\ \sigma' = 1 - \sigma^2,\ \sigma'' = -2\sigma(1 - \sigma^2);\\
        \mathrm{sigmoid}:&\ \sigma' = \sigma(1-\sigma),\ \sigma'' = \sigma(1-\sigma)(1-2\sigma);\\
        \mathrm{relu}:&\ \sigma' = [x > 0],\ \sigma'' = 0;\\
        \mathrm{softplus}:&\ \sigma = \log(1 + e^x),\ \sigma' = \mathrm{sigmoid}(x),\
            \sigma'' = \mathrm{sigmoid}(x)(1 - \mathrm{sigmoid}(x));\\
        \mathrm{identity}:&\ \sigma' = 1,\ \sigma'' = 0.
        \end{aligned}

    The relu derivative at 0 is taken as 0.

    Parameters
    ----------
    kind : {"identity", "tanh", "sigmoid", "relu", "softplus"}
    x : array

    Returns
    -------
    (value, first, second) : arrays of ``x``'s shape
    """
    func = "activation_derivatives"
    check_option(func, "kind", kind, ACTIVATIONS)
    xp = namespace_of(func, x=x)
    check_array(func, "x", x)
    return _activation_kernel(xp, kind, x, 2)


@kernel_of(activation_derivatives)
def _activation_kernel(xp, kind, x, order):
    """``(σ, σ', σ'')[:order + 1]`` of ``x``, unchecked; only the requested orders are formed
    (the forward pass needs ``σ``, a backward pass ``σ'``)."""
    if kind == "identity":
        out = (x, xp.ones_like(x), xp.zeros_like(x))
    elif kind == "tanh":
        t = xp.tanh(x)
        if order == 0:
            return (t,)
        d1 = _derivative_from_value(xp, kind, t)
        out = (t, d1, -2.0 * t * d1)
    elif kind == "sigmoid":
        s = _sigmoid(xp, x)
        if order == 0:
            return (s,)
        d1 = _derivative_from_value(xp, kind, s)
        out = (s, d1, d1 * (1.0 - 2.0 * s))
    elif kind == "relu":
        # maximum and a cast rather than `where`, which NumPy runs ~20× slower on floats
        zero = xp.zeros_like(x)
        val = xp.maximum(x, zero)
        if order == 0:
            return (val,)
        out = (val, _derivative_from_value(xp, kind, val), zero)
    else:  # softplus: max(x, 0) + log1p(exp(-|x|)), stable for large |x|
        val = xp.maximum(x, xp.zeros_like(x)) + xp.log1p(xp.exp(-xp.abs(x)))
        if order == 0:
            return (val,)
        s = _sigmoid(xp, x)
        out = (val, s, s * (1.0 - s))
    return out[:order + 1]


#: the activations whose first derivative is a function of their value
#: (:func:`_derivative_from_value`)
_DERIVATIVE_FROM_VALUE = ("tanh", "sigmoid", "relu")


def _derivative_from_value(xp, kind, y):
    r""":math:`\sigma'` from the value :math:`y = \sigma(x)`: :math:`1 - y^2` (tanh),
    :math:`y(1 - y)` (sigmoid), :math:`[y > 0]` (ReLU, where :math:`y > 0 \iff x > 0`)."""
    if kind == "tanh":
        return 1.0 - y * y
    if kind == "sigmoid":
        return y * (1.0 - y)
    return xp.astype(y > 0, y.dtype)


@capabilities(dask="yes")
class Activation(Layer):
    r"""Elementwise activation :math:`y = \sigma(x)`.

    .. math::

        \dot y = \sigma'(x)\,\dot x, \qquad \partial x = \sigma'(x)\, g, \qquad
        R\{\partial x\} = \sigma'(x)\, R\{g\} + \sigma''(x)\, \dot x\, g .

    Parameters
    ----------
    kind : {"identity", "tanh", "sigmoid", "relu", "softplus"}
        See :func:`activation_derivatives`.
    """

    kind = "activation"
    has_vjp_cache = True

    def __init__(self, kind):
        self.activation = check_option("Activation", "kind", kind, ACTIVATIONS)

    def _derivs(self, x, order):
        return _activation_kernel(namespace_of("Activation", x=x), self.activation, x, order)

    def _forward(self, params, x):
        return self._derivs(x, 0)[0]

    def _jvp(self, params, x, dparams, dx):
        if dx is None:
            return None
        return self._derivs(x, 1)[1] * dx

    def _vjp_cache(self, params, x):
        r"""The derivative :math:`\sigma'(x)`, formed once per forward pass."""
        return self._derivs(x, 1)[1]

    def _vjp_cache_given_output(self, params, x, y):
        """From the output where the derivative is a function of it: the same numbers as
        from ``x``, without evaluating the activation again."""
        if self.activation in _DERIVATIVE_FROM_VALUE:
            return _derivative_from_value(namespace_of("Activation", y=y), self.activation, y)
        return self._vjp_cache(params, x)

    def _vjp_input(self, params, x, g, cache=None):
        return (self._vjp_cache(params, x) if cache is None else cache) * g

    def _vjp_input_stacked(self, params, x, g, cache=None):
        return self._vjp_input(params, x, g, cache)  # σ'(x) [N, ...] broadcasts over C

    def _rvjp(self, params, x, dparams, dx, g, rg):
        _, d1, d2 = self._derivs(x, 2)
        out = None if rg is None else d1 * rg
        if dx is not None:
            out = _add(out, d2 * dx * g)
        return (), out

    def __repr__(self):
        return f"Activation({self.activation!r})"


# ----------------------------------------------------------------------------------------
# Parameter-free linear reshaping layers
# ----------------------------------------------------------------------------------------
@capabilities(dask="yes")
class MeanPool(Layer):
    r"""Mean over the non-batch, non-channel axes (tokens or spatial locations).

    .. math::

        y_{n,c} = \frac{1}{S} \sum_{s} x_{n,s,c}, \qquad \partial x_{n,s,c} = g_{n,c}/S,

    for inputs ``[N, S..., C]`` (channels last).  This is the pooling of the KFAC-reduce
    setting (Eschenhagen et al. 2023).
    """

    kind = "pool"

    def _output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])

    def check_input(self, func, x):
        check_array(func, "x", x, min_ndim=3, layout="[N, S..., C]")

    def _forward(self, params, x):
        xp = namespace_of("MeanPool.forward", x=x)
        s = math.prod(x.shape[1:-1])  # spelled out: an empty batch has no -1 to infer
        return xp.mean(xp.reshape(x, (x.shape[0], s, x.shape[-1])), axis=1)

    def _jvp(self, params, x, dparams, dx):
        return None if dx is None else self._forward(params, dx)

    def _vjp_input(self, params, x, g):
        xp = namespace_of("MeanPool.vjp_input", x=x, g=g)
        s = math.prod(x.shape[1:-1])
        shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1],)
        return xp.broadcast_to(xp.reshape(g / s, shape), x.shape)

    def _vjp_input_stacked(self, params, x, g, cache=None):
        xp = namespace_of("MeanPool.vjp_input_stacked", x=x, g=g)
        s = math.prod(x.shape[1:-1])
        shape = (g.shape[0], x.shape[0]) + (1,) * (x.ndim - 2) + (x.shape[-1],)
        return xp.broadcast_to(xp.reshape(g / s, shape), (g.shape[0], *x.shape))

    def _rvjp(self, params, x, dparams, dx, g, rg):
        return (), None if rg is None else self._vjp_input(params, x, rg)


@capabilities(dask="yes")
class Flatten(Layer):
    r"""Flatten every non-batch axis (row-major).

    .. math::

        y_n = \mathrm{vec}_r(x_n), \qquad \partial x_n = \mathrm{vec}_r^{-1}(g_n).
    """

    kind = "flatten"

    def _output_shape(self, input_shape):
        return (input_shape[0], math.prod(input_shape[1:]))

    def _forward(self, params, x):
        xp = namespace_of("Flatten.forward", x=x)
        return xp.reshape(x, (x.shape[0], math.prod(x.shape[1:])))

    def _jvp(self, params, x, dparams, dx):
        return None if dx is None else self._forward(params, dx)

    def _vjp_input(self, params, x, g):
        xp = namespace_of("Flatten.vjp_input", g=g)
        return xp.reshape(g, x.shape)

    def _vjp_input_stacked(self, params, x, g, cache=None):
        xp = namespace_of("Flatten.vjp_input_stacked", g=g)
        return xp.reshape(g, (g.shape[0], *x.shape))

    def _rvjp(self, params, x, dparams, dx, g, rg):
        return (), None if rg is None else self._vjp_input(params, x, rg)
