r"""Exact curvature of a network's mean loss: dense matrices and matrix-free products.

Objective and conventions
-------------------------
For a batch :math:`(x_n, y_n)_{n=1}^N`, a :class:`kfac_ref.nn.Sequential` network :math:`f`
and a loss object from :mod:`kfac_ref.losses` with weight :math:`w`, the objective is the
**mean** loss (kfac-jax's ``weight * sum(loss) / batch_size``)

.. math::

    \mathcal L(\theta) = \frac1N \sum_{n=1}^N w\,\ell_n\big(f(\theta, x_n)\big).

With :math:`J_n = \partial f(\theta, x_n)/\partial\theta` (``[D, P]``, the output of one example
flattened row-major) and the per-example matrices of the loss (which include :math:`w`):

.. math::

    G &= \frac1N \sum_n J_n^\top\, G_n\, J_n \quad \text{(GGN)}, \\
    F &= \frac1N \sum_n J_n^\top\, F_n\, J_n \quad \text{(Fisher)}, \\
    \mathrm{EF} &= \frac1N \sum_n \nabla\ell_n \nabla\ell_n^\top \quad \text{(empirical Fisher)}, \\
    H &= \nabla^2_\theta \mathcal L \quad \text{(Hessian)}.

Parameters are flat vectors of length :math:`P` in the canonical order of
:meth:`kfac_ref.nn.Sequential.flatten` (layers in forward order, ``[W; b]`` row-major, bias last).

The loss
--------
``loss_fn`` builds the loss object from the network output and the targets: either a loss
class (called as ``cls(outputs, targets=targets)``) or a callable
``loss_fn(outputs, targets) -> LossFunction``.  The loss's parameter dependants, each
flattened per example and concatenated in order, must be the network output flattened per
example (so a mean-variance normal takes ``(outputs[:, :d], outputs[:, d:])``).

Every computation is batched over examples (Jacobians by one backward pass per output
coordinate, not per example).

Validation
----------
Each public function validates its arguments once — the network, the parameters, the batch
and its own vectors — and builds the loss object through ``loss_fn`` (whose constructor
validates the outputs and the targets); every product with the loss then runs through the
loss's one unchecked private method for it (``_curvature_vp``, ``_factor_vp``, ...; see
:mod:`kfac_ref.losses`), and the second moments through
``kfac_ref.linalg.compute_cov.kernel``.  For modules that reuse the dense matrices
(the approximation report), ``evaluate_batch`` does the validation in the name of
the caller and ``ggn_matrix.kernel(b)``, ``fisher_matrix.kernel(b)`` and
``empirical_fisher_matrix.kernel(b, normalization)`` compute from its result.

References
----------
Martens (2014), "New insights and perspectives on the natural gradient method",
arXiv:1412.1193; Schraudolph (2002); Pearlmutter (1994); kfac-jax ``ImplicitExactCurvature``.
"""

from __future__ import annotations

import math

from .._backend import (
    KFACTypeError,
    KFACValueError,
    any_true,
    check_array,
    check_int,
    check_option,
    checks_values,
    describe,
    device_of,
    kernel_of,
    namespace_of,
    value_checks,
)
from .._random import check_random_source, draw_noise, split_source
from .._support import capabilities
from ..linalg import compute_cov
from ..losses import LossFunction, NegativeLogProbLoss
from ..nn._network import Sequential

ESTIMATION_MODES = ("fisher_gradients", "fisher_empirical", "fisher_curvature_prop",
                    "fisher_exact", "ggn_curvature_prop", "ggn_exact")
"""kfac-jax's estimation modes (see :func:`estimation_output_vectors`)."""

EMPIRICAL_FISHER_NORMALIZATIONS = ("mean", "kfac_jax")
r"""``"mean"``: :math:`\frac1N\sum_n g_n g_n^\top` (TF K-FAC, curvlinops, the default);
``"kfac_jax"``: kfac-jax's ``fisher_empirical``, an extra :math:`1/N`."""


# ------------------------------------------------------------------------------------------
# evaluation of one batch (internal)
# ------------------------------------------------------------------------------------------
class _Batch:
    """Forward pass of one batch with the loss object built on its output."""

    def __init__(self, func, net, loss_fn, params, batch, layer_taps=None):
        if not isinstance(net, Sequential):
            raise KFACTypeError(f"{func}: net must be a kfac_ref.nn.Sequential; got "
                                f"{type(net).__name__}.")
        x, y = _unpack_batch(func, batch)
        params = net.check_params_and_input(func, params, x, targets=y)
        if x.shape[0] == 0:  # every curvature is a mean over the examples
            raise KFACValueError(f"{func}: x must hold at least one example (a batch axis of "
                                 f"size N >= 1); got {describe(x)}.")
        self.xp = namespace_of(func, x=x, targets=y)
        self.net, self.params, self.x, self.targets = net, params, x, y
        # the taps that marked layers' forward passes compute for the blocks
        taps = None if layer_taps is None else layer_taps(net.input_shapes(tuple(x.shape)))
        with value_checks(False):  # (params, x) were validated above in the name of func
            self.forward = net.forward_pass(params, x, taps)
        self.out, self.inputs, self.taps = (self.forward.output, self.forward.inputs,
                                            self.forward.taps)
        self._vjp_caches = None
        self.n = int(self.out.shape[0])
        self.d = math.prod(self.out.shape[1:])
        self.loss = None if loss_fn is None else _make_loss(func, loss_fn, self.out, y)
        deps = (self.out,) if self.loss is None else self.loss.parameter_dependants
        self.dep_shapes = tuple(tuple(a.shape) for a in deps)
        sizes = [math.prod(s[1:]) for s in self.dep_shapes]
        if any(s[0] != self.n for s in self.dep_shapes) or sum(sizes) != self.d:
            raise KFACValueError(
                f"{func}: loss_fn must return a loss whose inputs, flattened per example and "
                f"concatenated, have the network's {self.d} outputs per example for "
                f"{self.n} examples; got input shapes {self.dep_shapes}."
            )
        self.dep_sizes = sizes
        self.func = func
        # a loss built on the output array itself passes it unchanged (no values to read)
        unchanged = len(deps) == 1 and deps[0] is self.out
        if (self.loss is not None and not unchanged and checks_values(self.out) and any_true(
                self.xp, self.flat(deps) != self.xp.reshape(self.out, (self.n, self.d)))):
            raise KFACValueError(
                f"{func}: loss_fn must pass the network outputs to the loss unchanged (split "
                f"into its inputs in order, each flattened per example); got loss inputs that "
                f"differ from the outputs (put any transformation into the network)."
            )

    # conversions between the loss's tuple of inputs and flat per-example vectors [N, D]
    def flat(self, vectors):
        xp = self.xp
        return xp.concat([xp.reshape(v, (self.n, -1)) for v in vectors], axis=1)

    def as_tuple(self, flat):
        xp, out, start = self.xp, [], 0
        for shape, size in zip(self.dep_shapes, self.dep_sizes, strict=True):
            out.append(xp.reshape(flat[:, start:start + size], shape))
            start += size
        return tuple(out)

    def as_output(self, flat):
        return self.xp.reshape(flat, tuple(self.out.shape))

    # network maps
    # network maps: the network's tap protocol on this batch's forward pass; the vectors
    # were validated by the public function (check_flat_vector) or derive from validated
    # arrays, so only the static checks of the passes run
    def jvp_flat(self, v):
        """J v per example, [N, D]."""
        with value_checks(False):
            dout, _ = self.net.jvp_pass(self.forward, v)
        return self.xp.reshape(dout, (self.n, self.d))

    def vjp(self, u_flat, per_example=False):
        """Σ_n J_nᵀ u_n ([P]) or [J_nᵀ u_n]_n ([N, P])."""
        with value_checks(False):
            grads, _ = self.net.backward_pass(self.forward, self.as_output(u_flat),
                                              per_example, caches=self.vjp_caches)
        return self.net.flatten(grads, per_example=per_example)

    @property
    def vjp_caches(self):
        """The layers' backward caches, formed once for every backward pass of this batch."""
        if self._vjp_caches is None:
            self._vjp_caches = self.net.vjp_caches(self.forward)
        return self._vjp_caches

    def jacobian(self):
        """[N, D, P], one batched backward pass per output coordinate."""
        xp = self.xp
        eye = xp.eye(self.d, dtype=self.out.dtype, device=device_of(self.out))
        cols = []
        for k in range(self.d):  # loop over output coordinates, batched over examples
            u = xp.broadcast_to(eye[k:k + 1, :], (self.n, self.d))
            cols.append(self.vjp(u, per_example=True))
        return xp.stack(cols, axis=1)


def evaluate_batch(func, net, loss_fn, params, batch, layer_taps=None):
    """Validate ``(net, loss_fn, params, batch)`` once, in the name of the public function
    ``func``, run the forward pass (:meth:`kfac_ref.nn.Sequential.forward_pass`, kept as
    ``b.forward``) and build the loss on its output: the evaluated batch that the kernels of
    this module take (``ggn_matrix.kernel(b)`` ...).  ``layer_taps``, when given, maps the
    batch's layer input shapes (:meth:`~kfac_ref.nn.Sequential.input_shapes`) to the taps of
    the forward pass (one entry per layer, ``None`` for none); their values are ``b.taps``.
    Internal API of :mod:`kfac_ref.curvature`."""
    return _Batch(func, net, loss_fn, params, batch, layer_taps)


def unpack_batch(func, batch):
    """``(inputs, targets)`` of a batch pair, or a clear error naming ``func``."""
    return _unpack_batch(func, batch)


def _unpack_batch(func, batch):
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise KFACValueError(f"{func}: batch must be a pair (inputs, targets) (targets may be "
                             f"None); got {type(batch).__name__}.")
    return batch[0], batch[1]


def _make_loss(func, loss_fn, outputs, targets):
    if isinstance(loss_fn, type) and issubclass(loss_fn, LossFunction):
        loss = loss_fn(outputs, targets=targets)
    elif callable(loss_fn):
        loss = loss_fn(outputs, targets)
    else:
        raise KFACTypeError(f"{func}: loss_fn must be a kfac_ref.losses class or a callable "
                            f"(outputs, targets) -> LossFunction; got {type(loss_fn).__name__}.")
    if not isinstance(loss, LossFunction):
        raise KFACTypeError(f"{func}: loss_fn must return a kfac_ref.losses.LossFunction; got "
                            f"{type(loss).__name__}.")
    return loss


def require_negative_log_prob(func, b, what):
    """Internal API (the estimators): raise unless the batch's loss is a predictive
    distribution, which ``what`` needs."""
    if not isinstance(b.loss, NegativeLogProbLoss):
        raise KFACTypeError(f"{func}: {what} needs a NegativeLogProbLoss (a predictive "
                            f"distribution); got {type(b.loss).__name__}.")


def _need_targets(func, b):
    if b.loss.targets is None:
        raise KFACValueError(f"{func}: batch targets must be given for this quantity; got None.")


def check_flat_vector(func, b, v, name="vector"):
    """Internal API (the estimators): ``v`` is a flat parameter vector ``[P]`` of the
    batch's namespace, device and precision."""
    namespace_of(func, x=b.out, **{name: v})
    check_array(func, name, v, shape=(b.net.num_params,), layout="[P]")
    return v


def _factor_columns(b, kind):
    """Per-example factor columns as flat vectors: [N, D, K] (weight included, sqrt w)."""
    return b.loss._factor_matrix()  # B_n of the Fisher = of the GGN for every loss


# ------------------------------------------------------------------------------------------
# Jacobian products
# ------------------------------------------------------------------------------------------
@capabilities(dask="yes")
def jacobian(net, params, x):
    r"""Per-example Jacobian of the network output with respect to the parameters.

    .. math::

        J_{n, d, p} = \frac{\partial\, \mathrm{vec}_r f(\theta, x_n)_d}{\partial \theta_p},
        \qquad J \in \mathbb R^{N \times D \times P}.

    Built from :math:`D` batched backward passes (one per output coordinate), each giving
    :math:`J_n^\top e_d` for every example at once.

    Returns
    -------
    array [N, D, P]
    """
    b = _Batch("jacobian", net, None, params, (x, None))
    return b.jacobian()


@capabilities(dask="yes")
def jacobian_vector_product(net, params, x, vector):
    r"""Jacobian-vector product :math:`J_n v` for every example.

    .. math::

        (J v)_n = \frac{d}{d\epsilon} f(\theta + \epsilon v, x_n)\Big|_{\epsilon=0}.

    Parameters
    ----------
    vector : array [P]

    Returns
    -------
    array, the output's shape [N, ...]
    """
    func = "jacobian_vector_product"
    b = _Batch(func, net, None, params, (x, None))
    check_flat_vector(func, b, vector)
    return b.as_output(b.jvp_flat(vector))


@capabilities(dask="yes")
def jacobian_transpose_vector_product(net, params, x, output_vectors):
    r"""Transposed-Jacobian product summed over examples (backpropagation).

    .. math::

        J^\top u = \sum_{n=1}^{N} J_n^\top u_n \qquad (\text{no } 1/N).

    Parameters
    ----------
    output_vectors : array of the output's shape [N, ...]

    Returns
    -------
    array [P]
    """
    func = "jacobian_transpose_vector_product"
    b = _Batch(func, net, None, params, (x, None))
    namespace_of(func, x=b.out, output_vectors=output_vectors)
    check_array(func, "output_vectors", output_vectors, shape=tuple(b.out.shape))
    return b.vjp(b.xp.reshape(output_vectors, (b.n, b.d)))


# ------------------------------------------------------------------------------------------
# loss, dense curvature matrices
# ------------------------------------------------------------------------------------------
@capabilities(dask="yes")
def loss_value_and_grad(net, loss_fn, params, batch):
    r"""Mean loss and its gradient.

    .. math::

        \mathcal L = \frac1N\sum_n w\,\ell_n, \qquad
        \nabla_\theta\mathcal L = \frac1N \sum_n J_n^\top \nabla_f (w\,\ell_n).

    Returns
    -------
    (array [], array [P])
    """
    func = "loss_value_and_grad"
    b = _Batch(func, net, loss_fn, params, batch)
    _need_targets(func, b)
    xp = b.xp
    value = xp.sum(b.loss._evaluate()) / b.n
    g = b.flat(b.loss._grad()) / b.n
    return value, b.vjp(g)


def _second_moment(xp, rows, normalizer):
    """(1/normalizer) Σ_rows r rᵀ for rows [R, P]: the one uncentred second-moment formula,
    :func:`kfac_ref.linalg.compute_cov` (symmetrised, so the result is exactly symmetric)."""
    return compute_cov.kernel(xp, rows, None, normalizer)


def _factor_based(b, kind):
    net = b.net
    xp = b.xp
    jac = b.jacobian()  # [N, D, P]
    fac = _factor_columns(b, kind)  # [N, D, K]
    c = xp.permute_dims(fac, (0, 2, 1)) @ jac  # [N, K, P]  (B_nᵀ J_n)
    c = xp.reshape(c, (-1, net.num_params))
    return _second_moment(xp, c, b.n)


@capabilities(jit="yes", dask="yes")
def ggn_matrix(net, loss_fn, params, batch):
    r"""Dense generalised Gauss-Newton matrix of the mean loss.

    .. math::

        G = \frac1N\sum_{n=1}^N J_n^\top G_n J_n
          = \frac1N\sum_{n=1}^N (B_n^\top J_n)^\top (B_n^\top J_n),\qquad B_n B_n^\top = G_n,

    computed as one GEMM of the stacked :math:`B_n^\top J_n` (``loss.ggn_factor_matrix()``).

    Parameters
    ----------
    net : kfac_ref.nn.Sequential
    loss_fn : loss class or callable (outputs, targets) -> LossFunction
    params : parameter structure of ``net``
    batch : (inputs, targets)
        Targets may be None (the GGN of these losses does not use them).

    Returns
    -------
    array [P, P], symmetric PSD
    """
    return ggn_matrix.kernel(_Batch("ggn_matrix", net, loss_fn, params, batch))


@kernel_of(ggn_matrix)
def _ggn_matrix(b):
    return _factor_based(b, "ggn")


@capabilities(dask="yes")
def fisher_matrix(net, loss_fn, params, batch):
    r"""Dense (true, exact) Fisher of the mean loss, targets from the model's distribution.

    .. math::

        F = \frac1N\sum_n J_n^\top F_n J_n, \qquad
        w F_n = \mathbb E_{y\sim p(\cdot\mid f_n)}
        \big[\nabla_f (\sqrt w\ell_n)\,\nabla_f(\sqrt w\ell_n)^\top\big] .

    (With weight :math:`w` the per-example Fisher of :math:`w\ell_n` is :math:`w F_n`, as in
    kfac-jax.)  For natural-parameter losses it equals :func:`ggn_matrix`.

    Returns
    -------
    array [P, P]
    """
    func = "fisher_matrix"
    b = _Batch(func, net, loss_fn, params, batch)
    require_negative_log_prob(func, b, "the Fisher")
    return fisher_matrix.kernel(b)


@kernel_of(fisher_matrix)
def _fisher_matrix(b):
    return _factor_based(b, "fisher")


@capabilities(dask="yes")
def empirical_fisher_matrix(net, loss_fn, params, batch, normalization="mean"):
    r"""Dense empirical Fisher from the data targets.

    .. math::

        \mathrm{EF} = \frac{1}{N}\sum_n \nabla_\theta (w\ell_n) \nabla_\theta (w\ell_n)^\top
        \quad(\texttt{"mean"}), \qquad
        \frac{1}{N^2}\sum_n \dots \quad(\texttt{"kfac\_jax"}).

    ``"mean"`` (default) is TF K-FAC's and curvlinops' scale; ``"kfac_jax"`` reproduces
    kfac-jax's ``fisher_empirical``, whose back-propagated vectors are divided by
    :math:`\sqrt N` (see the docs page *Estimation modes*).

    Raises
    ------
    KFACValueError
        Missing targets, unknown normalization.
    """
    func = "empirical_fisher_matrix"
    check_option(func, "normalization", normalization, EMPIRICAL_FISHER_NORMALIZATIONS)
    b = _Batch(func, net, loss_fn, params, batch)
    _need_targets(func, b)
    return empirical_fisher_matrix.kernel(b, normalization)


@kernel_of(empirical_fisher_matrix)
def _empirical_fisher_matrix(b, normalization):
    g = b.vjp(b.flat(b.loss._grad()), per_example=True)  # [N, P]
    scale = b.n if normalization == "mean" else b.n * b.n
    return _second_moment(b.xp, g, scale)


@capabilities(dask="yes")
def monte_carlo_fisher_matrix(net, loss_fn, params, batch, rng, num_samples=1):
    r"""Monte-Carlo Fisher from targets sampled from the model (unbiased, rank :math:`\le NM`).

    .. math::

        \begin{aligned}
        \hat F &= \frac{1}{NM}\sum_{n=1}^N\sum_{m=1}^M \hat g_{nm}\hat g_{nm}^\top, \\
        \hat g_{nm} &= J_n^\top \sqrt{w}\,\nabla_f \ell_n(\tilde y_{nm}), \qquad
        \tilde y_{nm} \sim p(\cdot\mid f_n),
        \end{aligned}

    so :math:`\mathbb E\hat F = F` (:func:`fisher_matrix`) and each entry's standard deviation
    falls like :math:`1/\sqrt{NM}`.  This is :func:`estimated_matrix` with
    ``estimation_mode="fisher_gradients"`` (one implementation; the same draws).

    Parameters
    ----------
    rng : numpy.random.Generator or JAX PRNG key
        A key only for JAX arrays (drawn with :mod:`jax.random`: not the Generator's
        numbers, the same distribution).
    num_samples : int
        :math:`M \ge 1`.
    """
    func = "monte_carlo_fisher_matrix"
    check_random_source(func, "rng", rng)
    m = check_int(func, "num_samples", num_samples, minimum=1)
    b = _Batch(func, net, loss_fn, params, batch)
    require_negative_log_prob(func, b, "the Monte-Carlo Fisher")
    return _estimated(func, b, "fisher_gradients", rng, m, "mean")


@capabilities(dask="yes")
def hessian_matrix(net, loss_fn, params, batch):
    r"""Dense Hessian of the mean loss, column by column from exact Hessian-vector products.

    .. math::

        \begin{aligned}
        H e_p &= \nabla^2_\theta \mathcal L\, e_p \qquad (p = 1..P), \\
        H &= G + \frac1N\sum_n \sum_d \frac{\partial (w\ell_n)}{\partial f_{n,d}}\,
        \nabla^2_\theta f_{n,d},
        \end{aligned}

    each column by the R-operator pass of :func:`hessian_vector_product`.  The result is
    symmetrised, :math:`(H + H^\top)/2`, which only removes rounding.

    Returns
    -------
    array [P, P]
    """
    func = "hessian_matrix"
    b = _Batch(func, net, loss_fn, params, batch)
    _need_targets(func, b)
    xp = b.xp
    eye = xp.eye(net.num_params, dtype=b.out.dtype, device=device_of(b.out))
    cols = [_hvp(b, eye[p, :]) for p in range(net.num_params)]
    h = xp.stack(cols, axis=1)
    return (h + h.T) / 2.0


# ------------------------------------------------------------------------------------------
# matrix-free products
# ------------------------------------------------------------------------------------------
def _output_tangent(func, net, loss_fn, params, batch, vector, kind, fisher_name):
    """``(batch, J v)``: the checked batch (a Fisher needs a negative-log-probability loss)
    and the outputs' tangent along the flat parameter vector ``vector``."""
    b = _Batch(func, net, loss_fn, params, batch)
    check_flat_vector(func, b, vector)
    if kind == "fisher":
        require_negative_log_prob(func, b, fisher_name)
    return b, b.as_tuple(b.jvp_flat(vector))


def _curvature_vp(func, net, loss_fn, params, batch, vector, kind):
    b, jv = _output_tangent(func, net, loss_fn, params, batch, vector, kind, "the Fisher")
    prod = b.loss._curvature_vp(jv)
    return b.vjp(b.flat(prod)) / b.n


@capabilities(jit="yes", dask="yes")
def ggn_vector_product(net, loss_fn, params, batch, vector):
    r"""Matrix-free GGN product.

    .. math::

        G v = \frac1N\sum_n J_n^\top \big(G_n (J_n v)\big)

    (one Jacobian-vector pass, the loss's ``multiply_ggn``, one backward pass).

    Returns
    -------
    array [P]
    """
    return _curvature_vp("ggn_vector_product", net, loss_fn, params, batch, vector, "ggn")


@capabilities(jit="yes", dask="yes")
def fisher_vector_product(net, loss_fn, params, batch, vector):
    r"""Matrix-free exact Fisher product.

    .. math::

        F v = \frac1N\sum_n J_n^\top \big(F_n (J_n v)\big).

    Returns
    -------
    array [P]
    """
    return _curvature_vp("fisher_vector_product", net, loss_fn, params, batch, vector,
                         "fisher")


@capabilities(dask="yes")
def empirical_fisher_vector_product(net, loss_fn, params, batch, vector, normalization="mean"):
    r"""Matrix-free empirical-Fisher product from per-example gradients.

    .. math::

        \mathrm{EF}\, v = \frac1N \sum_n \nabla(w\ell_n)\,\big(\nabla(w\ell_n)^\top v\big)
        \quad (\texttt{"mean"};\ \texttt{"kfac\_jax"} \text{ divides by } N^2).

    Returns
    -------
    array [P]
    """
    func = "empirical_fisher_vector_product"
    check_option(func, "normalization", normalization, EMPIRICAL_FISHER_NORMALIZATIONS)
    b = _Batch(func, net, loss_fn, params, batch)
    _need_targets(func, b)
    check_flat_vector(func, b, vector)
    g = b.vjp(b.flat(b.loss._grad()), per_example=True)
    scale = b.n if normalization == "mean" else b.n * b.n
    return (g.T @ (g @ vector)) / scale


def _hvp(b, vector):
    xp = b.xp
    grad = b.flat(b.loss._grad()) / b.n  # [N, D]
    hess = b.loss._hessian_matrix() / b.n  # [N, D, D]

    def cot(out, f_dot):
        fd = xp.reshape(f_dot, (b.n, b.d, 1))
        return b.as_output(grad), b.as_output(xp.reshape(hess @ fd, (b.n, b.d)))

    with value_checks(False):  # the vector was validated by the public function
        vs = b.net.check_param_tangent(b.func, "vector", vector)
        f_dot, dins = b.net.jvp_pass(b.forward, vs)
        g, rg = cot(b.out, f_dot)
        return b.net.flatten(b.net.r_backward_pass(b.forward, vs, dins, g, rg))


@capabilities(jit="yes", dask="yes")
def hessian_vector_product(net, loss_fn, params, batch, vector):
    r"""Exact Hessian-vector product of the mean loss (Pearlmutter's R-operator).

    .. math::

        H v = R_v\{\nabla_\theta\mathcal L\}
            = \frac1N\sum_n \Big(J_n^\top \nabla_f^2(w\ell_n)\,J_n v
              + \big(R_v\{J_n\}\big)^\top \nabla_f (w\ell_n)\Big),

    from one forward, one tangent and one R-backward pass
    (:meth:`kfac_ref.nn.Sequential.second_order_backward`); the loss Hessian comes from
    ``loss.hessian_matrix(targets)``.

    Returns
    -------
    array [P]
    """
    func = "hessian_vector_product"
    b = _Batch(func, net, loss_fn, params, batch)
    _need_targets(func, b)
    check_flat_vector(func, b, vector)
    return _hvp(b, vector)


def _factor_t(func, net, loss_fn, params, batch, vector, kind):
    b, jv = _output_tangent(func, net, loss_fn, params, batch, vector, kind,
                            "the Fisher factor")
    out = b.loss._factor_t_vp(jv)
    return out / math.sqrt(b.n)


def _factor(func, net, loss_fn, params, batch, inner, kind):
    b = _Batch(func, net, loss_fn, params, batch)
    if kind == "fisher":
        require_negative_log_prob(func, b, "the Fisher factor")
    shape = (b.loss.fisher_factor_inner_shape if kind == "fisher"
             else b.loss.ggn_factor_inner_shape)
    namespace_of(func, x=b.out, loss_inner_vectors=inner)
    check_array(func, "loss_inner_vectors", inner, shape=tuple(shape),
                layout="like the loss's factor inner shape")
    out = b.loss._factor_vp(inner)
    return b.vjp(b.flat(out)) / math.sqrt(b.n)


@capabilities(jit="yes", dask="yes")
def fisher_factor_transpose_product(net, loss_fn, params, batch, vector):
    r"""Transposed Fisher factor times a parameter vector.

    .. math::

        \mathcal B^\top v = \Big[\tfrac{1}{\sqrt N} B_n^\top J_n v\Big]_{n=1}^N,\qquad
        \mathcal B\mathcal B^\top = F = \frac1N\sum_n J_n^\top B_n B_n^\top J_n .

    Returns
    -------
    array of the loss's ``fisher_factor_inner_shape`` [N, K...]
    """
    return _factor_t("fisher_factor_transpose_product", net, loss_fn, params, batch, vector,
                     "fisher")


@capabilities(dask="yes")
def fisher_factor_product(net, loss_fn, params, batch, loss_inner_vectors):
    r"""Fisher factor times loss-inner vectors.

    .. math::

        \mathcal B u = \frac{1}{\sqrt N}\sum_n J_n^\top B_n u_n .

    Parameters
    ----------
    loss_inner_vectors : array of ``fisher_factor_inner_shape`` [N, K...]

    Returns
    -------
    array [P]
    """
    return _factor("fisher_factor_product", net, loss_fn, params, batch, loss_inner_vectors,
                   "fisher")


@capabilities(dask="yes")
def ggn_factor_transpose_product(net, loss_fn, params, batch, vector):
    r"""Transposed GGN factor: :math:`[\tfrac{1}{\sqrt N} B_n^\top J_n v]_n` with
    :math:`B_nB_n^\top = G_n`.

    .. math::

        \mathcal B^\top v, \qquad \mathcal B\mathcal B^\top = G.
    """
    return _factor_t("ggn_factor_transpose_product", net, loss_fn, params, batch, vector, "ggn")


@capabilities(dask="yes")
def ggn_factor_product(net, loss_fn, params, batch, loss_inner_vectors):
    r"""GGN factor times loss-inner vectors.

    .. math::

        \mathcal B u = \frac{1}{\sqrt N}\sum_n J_n^\top B_n u_n,\qquad B_nB_n^\top = G_n.
    """
    return _factor("ggn_factor_product", net, loss_fn, params, batch, loss_inner_vectors,
                   "ggn")


# ------------------------------------------------------------------------------------------
# estimation modes
# ------------------------------------------------------------------------------------------
def draw_estimation_vectors(func, b, mode, rng, num_samples, empirical_normalization):
    """List of per-example output cotangents U_c [N, D] with estimate (1/N) Σ_c Σ_n ĝ ĝᵀ."""
    stack = draw_estimation_stack(func, b, mode, rng, num_samples, empirical_normalization)
    return [stack[c, ...] for c in range(stack.shape[0])]


def draw_estimation_stack(func, b, mode, rng, num_samples, empirical_normalization):
    r"""The vectors of :func:`draw_estimation_vectors` stacked, ``[C, N, D]``.

    The exact modes take all :math:`C = K` vectors :math:`u_{k,n} = \sqrt w B_n e_k` from
    one call of the loss's dense factor (``[N, D, K]``, one softmax for a categorical loss);
    the sampling modes draw from ``rng``: a ``numpy.random.Generator`` (host draws) or a
    JAX PRNG key (:mod:`jax.random`, one key per sample from ``jax.random.split``).
    """
    loss = b.loss
    xp = b.xp
    if mode in ("fisher_gradients", "fisher_curvature_prop", "fisher_exact"):
        require_negative_log_prob(func, b, f"estimation mode {mode!r}")
    if mode in ("fisher_gradients", "fisher_curvature_prop", "ggn_curvature_prop"):
        check_random_source(func, "rng", rng, b.out)
    if mode == "fisher_empirical":
        _need_targets(func, b)
        g = b.flat(loss._grad(None, "regular"))
        if empirical_normalization == "kfac_jax":
            g = g / math.sqrt(b.n)
        return g[None, ...]
    if mode in ("fisher_exact", "ggn_exact"):
        fac = _factor_columns(b, "fisher" if mode == "fisher_exact" else "ggn")  # [N, D, K]
        return xp.permute_dims(fac, (2, 0, 1))
    scale = 1.0 / math.sqrt(num_samples)
    out = []
    for key in split_source(rng, num_samples):
        if mode == "fisher_gradients":
            u = b.flat(loss._grad(loss._sample(key), "sqrt"))
        elif mode == "fisher_curvature_prop":
            sign = draw_noise(key, b.out, "rademacher", loss.fisher_factor_inner_shape)
            u = b.flat(loss._factor_vp(sign))
        else:
            sign = draw_noise(key, b.out, "rademacher", loss.ggn_factor_inner_shape)
            u = b.flat(loss._factor_vp(sign))
        out.append(u * scale if num_samples > 1 else u)
    return out[0][None, ...] if num_samples == 1 else xp.stack(out, axis=0)


@capabilities(dask="yes")
def estimation_output_vectors(net, loss_fn, params, batch, estimation_mode, rng=None,
                              num_samples=1, empirical_fisher_normalization="mean"):
    r"""The per-example output cotangents each estimation mode back-propagates.

    Every mode yields vectors :math:`u_{c,n}` at the network output (no :math:`1/N`) such
    that the curvature it estimates is

    .. math::

        C = \frac1N \sum_c \sum_n J_n^\top u_{c,n} u_{c,n}^\top J_n ,

    and a block's statistics are built from their back-propagated images:

    ============================  ==========================================================
    ``fisher_gradients``          :math:`u_{m,n} = \sqrt{w}\nabla_f\ell_n(\tilde y_{mn})/\sqrt M`,
                                  :math:`\tilde y\sim p(\cdot|f_n)`: :math:`\mathbb E C = F`
    ``fisher_empirical``          :math:`u_n = w\nabla_f\ell_n(y_n)`, :math:`C=\mathrm{EF}`
                                  (``"kfac_jax"``: :math:`u_n/\sqrt N`, :math:`C=\mathrm{EF}/N`)
    ``fisher_curvature_prop``     :math:`u_{m,n} = \sqrt w B_n r_{mn}/\sqrt M`, Rademacher
                                  :math:`r`: :math:`\mathbb E C = F`
    ``ggn_curvature_prop``        the same with the GGN factor: :math:`\mathbb E C = G`
    ``fisher_exact``              :math:`u_{k,n} = \sqrt w B_n e_k` for every inner index
                                  :math:`k`: :math:`C = F`
    ``ggn_exact``                 the same with the GGN factor: :math:`C = G`
    ============================  ==========================================================

    Returns
    -------
    list of arrays [N, D]
    """
    func = "estimation_output_vectors"
    check_option(func, "estimation_mode", estimation_mode, ESTIMATION_MODES)
    check_option(func, "empirical_fisher_normalization", empirical_fisher_normalization,
                 EMPIRICAL_FISHER_NORMALIZATIONS)
    m = check_int(func, "num_samples", num_samples, minimum=1)
    b = _Batch(func, net, loss_fn, params, batch)
    return draw_estimation_vectors(func, b, estimation_mode, rng, m, empirical_fisher_normalization)


@capabilities(dask="yes")
def estimated_matrix(net, loss_fn, params, batch, estimation_mode, rng=None, num_samples=1,
                     empirical_fisher_normalization="mean"):
    r"""Dense full curvature that an estimation mode estimates, from its output vectors.

    .. math::

        C = \frac1N \sum_c \sum_n (J_n^\top u_{c,n})(J_n^\top u_{c,n})^\top

    with :math:`u_{c,n}` from :func:`estimation_output_vectors`.  ``fisher_exact`` /
    ``ggn_exact`` give :func:`fisher_matrix` / :func:`ggn_matrix` exactly.

    Returns
    -------
    array [P, P]
    """
    func = "estimated_matrix"
    check_option(func, "estimation_mode", estimation_mode, ESTIMATION_MODES)
    check_option(func, "empirical_fisher_normalization", empirical_fisher_normalization,
                 EMPIRICAL_FISHER_NORMALIZATIONS)
    m = check_int(func, "num_samples", num_samples, minimum=1)
    b = _Batch(func, net, loss_fn, params, batch)
    return _estimated(func, b, estimation_mode, rng, m, empirical_fisher_normalization)


def _estimated(func, b, mode, rng, num_samples, empirical_fisher_normalization):
    """(1/N) Σ_c Σ_n (J_nᵀ u_{c,n})(J_nᵀ u_{c,n})ᵀ: loop over the mode's vectors, batched
    over examples."""
    rows = [b.vjp(u, per_example=True)
            for u in draw_estimation_vectors(func, b, mode, rng, num_samples,
                                         empirical_fisher_normalization)]
    return _second_moment(b.xp, b.xp.concat(rows, axis=0), b.n)

