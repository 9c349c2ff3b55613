r"""KFRA: the Kronecker-factored recursive approximation of the expected GGN (Botev et al. 2017).

For a sequential network of dense layers :math:`h_l = \bar a_{l-1}^\top \bar W_l` (kfac_ref's
layout: :math:`\bar W_l = [W_l; b_l]` of shape ``[d_in + 1, d_out]``, :math:`\bar a = [a,
1]`) with elementwise activations :math:`a_l = \phi(h_l)` between them, the diagonal block of
the GGN of the mean loss belonging to layer :math:`l` is

.. math::

    G_l = \frac1N\sum_n (\bar a_{l-1,n}\bar a_{l-1,n}^\top)\otimes\mathcal G_{l,n},
    \qquad \mathcal G_{l,n} = J_{l,n}^\top H_n J_{l,n},

with :math:`J_{l,n} = \partial f_n/\partial h_{l,n}` and :math:`H_n` the loss's GGN matrix
at the output (its Hessian for every natural-parameter loss, weight :math:`w` included).
K-FAC's exact mode factorises the expectation, :math:`G_l \approx A_l\otimes
\frac1N\sum_n\mathcal G_{l,n}`.  KFRA keeps :math:`A_l` and replaces the per-example
pre-activation GGNs by a recursion over *batch-averaged* matrices, one backward sweep of
``d × d`` matrices instead of per-example Jacobians:

.. math::

    A_l &= \frac1N\sum_n \bar a_{l-1,n}\bar a_{l-1,n}^\top, \\
    \tilde G_L &= \frac1N\sum_n H_n, \\
    \tilde G_l &= \big(W_{l+1}\,\tilde G_{l+1}\,W_{l+1}^\top\big)\odot
        \Big(\frac1N\sum_n \phi'(h_{l,n})\,\phi'(h_{l,n})^\top\Big),

where :math:`W_{l+1}` is the kernel without its bias row (``[d_in, d_out]``, so this is the
paper's :math:`W^\top\tilde G W` for its ``[d_out, d_in]`` weights).  The block of layer
:math:`l` is :math:`A_l\otimes\tilde G_l` in kfac_ref's flat order (the row-major ``[W; b]``,
see the docs page *Conventions*).  In the network, each :class:`~kfac_ref.nn.Dense` layer
records the matrix that reaches its output and maps it back through its kernel
(:math:`M \leftarrow W M W^\top`); each :class:`~kfac_ref.nn.Activation` layer multiplies it
elementwise by the batch average :math:`\frac1N\sum_n \phi'(x_n)\phi'(x_n)^\top` of its own
input's derivative (:math:`M \leftarrow M\odot E[\phi'\phi'^\top]`).  Two Dense layers in a
row compose exactly; an Activation after the last Dense layer is one more Hadamard step
before the first :math:`\tilde G`.  Botev et al. start from the Hessian with respect to the
last pre-activation, an output nonlinearity folded into the loss (softmax into
cross-entropy); with a loss of :mod:`kfac_ref.losses` on the logits that is
:math:`\tilde G_L` here.

Where it is exact (the tests check each):

* :math:`\tilde G_L` equals K-FAC's exact-mode :math:`G` of the last layer when that layer
  is Dense and feeds the loss (both are :math:`\frac1N\sum_n H_n`);
* with one example (:math:`N = 1`) every :math:`\tilde G_l` equals K-FAC's exact-mode
  :math:`G_l` (the Hadamard product with :math:`\phi'\phi'^\top` *is* the per-example
  :math:`D W\,\cdot\,W^\top D`), so :math:`A_l\otimes\tilde G_l` is the exact GGN block;
* for a deep linear network (identity activations) the Jacobians :math:`J_{l,n}` do not
  depend on :math:`n`, and every :math:`\tilde G_l` equals K-FAC's exact-mode :math:`G_l`
  for any loss and any :math:`N`.

References
----------
A. Botev, H. Ritter and D. Barber, "Practical Gauss-Newton optimisation for deep learning",
ICML 2017 (KFRA, and the pre-activation recursion it approximates).
BackPACK's ``backpack.extensions.KFRA`` (Dangel, Kunstner and Hennig, ICLR 2020).
"""

from __future__ import annotations

from .._backend import KFACTypeError, KFACValueError, describe, kernel_of
from .._support import capabilities
from ..factors import fully_connected_kronecker_factor
from ..linalg import compute_cov
from ..nn import Activation, Dense, Sequential
from ._exact import evaluate_batch


@capabilities(dask="yes")
def kfra_factors(net, loss_fn, params, batch):
    r"""KFRA's Kronecker factors :math:`(A_l, \tilde G_l)` of every dense layer of a
    sequential network of Dense and elementwise Activation layers (Botev et al. 2017).

    .. math::

        A_l = \frac1N\sum_n \bar a_{l-1,n}\bar a_{l-1,n}^\top,\qquad
        \tilde G_L = \frac1N\sum_n H_n,\qquad
        \tilde G_l = \big(W_{l+1}\tilde G_{l+1}W_{l+1}^\top\big)\odot
        \frac1N\sum_n \phi'(h_{l,n})\,\phi'(h_{l,n})^\top,

    with :math:`\bar a = [a, 1]` (no homogeneous coordinate for a layer without bias),
    :math:`H_n` the loss's per-example GGN at the network output (``loss.ggn_matrix()``,
    weight included; the Hessian of the loss for every natural-parameter loss) and
    :math:`W_{l+1}` the next dense layer's kernel without its bias (``[d_in, d_out]``).  The
    scaling is that of the mean loss :math:`\frac1N\sum_n w\ell_n`, as for K-FAC's factors
    (:math:`\frac1N` once, in the averages): :math:`\tilde G_L` is K-FAC's exact-mode
    :math:`G` of a last dense layer, and :math:`A_l\otimes\tilde G_l` approximates layer
    :math:`l`'s diagonal block of :func:`ggn_matrix` in kfac_ref's flat order (the
    row-major ``[W; b]``, bias last).  :math:`A_l` is K-FAC's input factor
    (:func:`kfac_ref.factors.fully_connected_kronecker_factor`).  Every :math:`\tilde G_l`
    is symmetrised, :math:`\frac12(M + M^\top)`, and PSD.

    The recursion runs layer by layer from the output: an Activation layer multiplies the
    matrix at its output elementwise by the batch average of :math:`\phi'\phi'^\top` of its
    input, a Dense layer records the matrix at its output as its :math:`\tilde G` and maps
    it back, :math:`M \leftarrow W M W^\top`.  No loop over examples (one GEMM per average).

    Parameters
    ----------
    net : kfac_ref.nn.Sequential
        Only :class:`~kfac_ref.nn.Dense` layers (on ``[N, d]`` inputs) and elementwise
        :class:`~kfac_ref.nn.Activation` layers, at least one Dense layer.
    loss_fn : loss class or callable (outputs, targets) -> LossFunction
        As for :func:`ggn_matrix`; the loss's inputs must be the network output.
    params : parameter structure of ``net``
    batch : (inputs, targets)
        ``inputs`` ``[N, d_in]``; targets may be None (the GGN of the losses does not use
        them).

    Returns
    -------
    tuple of (A, G) pairs
        One pair per Dense layer, in forward order (``net.parametric_layers``): ``A``
        ``[d_in (+1), d_in (+1)]``, ``G`` ``[d_out, d_out]``, in the parameters' namespace,
        device and dtype.

    Raises
    ------
    KFACTypeError
        ``net`` not a Sequential, or with a layer other than Dense and Activation (the
        message names the layer); the errors of :func:`ggn_matrix` for ``loss_fn``,
        ``params`` and ``batch``.
    KFACValueError
        No Dense layer; inputs of rank other than 2 (a Dense layer over a position axis);
        the errors of :func:`ggn_matrix`.

    Notes
    -----
    BackPACK's ``KFRA`` (Dangel et al. 2020) runs the same recursion module by module; it
    keeps the weight and the bias as two parameters (blocks :math:`\tilde G\otimes A_W` and
    :math:`\tilde G` in its column-major order, with :math:`A_W` the weight-only input
    moment), which are the ``[W]`` and ``[b]`` diagonal sub-blocks of
    :math:`A_l\otimes\tilde G_l` here.  Its loss matrix is the Hessian of the PyTorch loss
    summed over the batch: for ``reduction="mean"`` that is :math:`\frac1N\sum_n H_n` for
    cross-entropy, and :math:`\frac{2}{D} I` for ``MSELoss``, whose mean also divides by the
    output dimension :math:`D`.

    References
    ----------
    Botev, Ritter & Barber (2017), "Practical Gauss-Newton optimisation for deep learning",
    ICML (KFRA).
    """
    func = "kfra_factors"
    if isinstance(net, Sequential):
        _check_kfra_network(func, net)
    b = evaluate_batch(func, net, loss_fn, params, batch)  # network, params, batch, loss
    if b.x.ndim != 2:
        first = net.names[net.parametric_layers[0]]
        raise KFACValueError(
            f"{func}: x must be [N, d_in] (KFRA's recursion is over per-example vectors; "
            f"Dense layer {first!r} would receive a position axis); got {describe(b.x)}.")
    return kfra_factors.kernel(b.xp, b.net, b.forward, b.loss)


def _check_kfra_network(func, net):
    """Only Dense and Activation layers, at least one Dense layer."""
    for name, layer in zip(net.names, net.layers, strict=True):
        if not isinstance(layer, (Dense, Activation)):
            raise KFACTypeError(
                f"{func}: net must be a sequence of Dense layers with elementwise Activation "
                f"layers between them (KFRA, Botev et al. 2017); layer {name!r} is "
                f"{type(layer).__name__}.")
    if not net.parametric_layers:
        raise KFACValueError(f"{func}: net must have at least one Dense layer; got layers "
                             f"{', '.join(net.names)}.")


@kernel_of(kfra_factors)
def _kfra_factors(xp, net, forward, loss):
    """Unchecked kernel: the backward recursion over the validated forward pass of ``net``
    (Dense and Activation layers only) and the loss built on its output."""
    params, inputs = forward.params, forward.inputs
    n = int(forward.output.shape[0])
    caches = net.vjp_caches(forward)  # φ'(x) of every Activation layer's input
    h = loss.ggn_matrix()  # w H_n, [N, D, D]
    m = xp.sum(h, axis=0) / n  # the batch-averaged loss curvature, G̃ at the output
    first = net.parametric_layers[0]
    pairs = {}
    for i in range(len(net.layers) - 1, first - 1, -1):
        layer = net.layers[i]
        if isinstance(layer, Dense):
            pairs[i] = (fully_connected_kronecker_factor.kernel(xp, inputs[i], layer.use_bias),
                        m)
            if i > first:
                w = params[i][0]
                wm = w @ m @ w.T
                m = 0.5 * (wm + wm.T)
        else:  # an elementwise Activation: M ⊙ (1/N) Σ_n φ'(x_n) φ'(x_n)ᵀ
            m = m * compute_cov.kernel(xp, caches[i], None, n)
    return tuple(pairs[i] for i in net.parametric_layers)
