r"""Reference K-FAC factors for your own PyTorch model, and a per-layer diagnosis of yours.

.. code-block:: python

    from conformance.own_model import check_torch_kfac

    result = check_torch_kfac(model, "cross_entropy", x, y, my_factors,
                              mode="fisher_exact")
    print(result)               # one line per layer and factor, with the diagnosis
    assert result.ok

``my_factors`` maps a module name of ``model.named_modules()`` to ``{"A": ..., "G": ...}``
(torch tensors or arrays) in the model's own layout, the bias's homogeneous coordinate
**last** in ``A`` when the layer has a bias:

* ``nn.Linear`` (weight ``[out, in]``): ``A`` is ``[in(+1), in(+1)]`` over the layer input,
  ``G`` is ``[out, out]``;
* ``nn.Conv2d`` (kernel OIHW, zero padding): ``A`` is ``[C·kh·kw(+1), …]``
  over the patch vectors in ``torch.nn.functional.unfold``'s order (channel slowest: index
  ``c·kh·kw + i·kw + j``, the order of ``weight.reshape(out, -1)``), ``G`` is
  ``[out, out]`` over the output channels; ``nn.Conv1d``, ``nn.Conv3d`` likewise (channel
  slowest, then the kernel offsets row-major); ``groups = g > 1``: ``A`` ``[g, d, d]`` over
  each group's input patches, ``G`` ``[g, out/g, out/g]``;
* ``nn.MultiheadAttention`` ``name``: dense layers ``name.in_proj`` (self-attention,
  ``in_proj_weight`` ``[3E, E]``) or ``name.q_proj``, ``name.k_proj``, ``name.v_proj``
  (cross-attention), and ``name.out_proj``, as ``nn.Linear``;
* ``nn.Embedding`` (``[V, D]``): ``A`` ``[V, V]`` = ``diag(counts)/(N·U·|T|)`` over the ids
  (``padding_idx`` not counted), ``G`` ``[D, D]``;
* affine ``nn.LayerNorm`` / ``nn.BatchNorm{1,2,3}d`` / ``nn.GroupNorm``: not Kronecker,
  ``{"F": ...}`` = :math:`\frac1N\sum_{n,k} u_{n,k}u_{n,k}^\top`,
  :math:`u = [\sum_t g\odot\hat x;\ \sum_t g]` (γ then β), or its diagonal ``"diag"``.

A module called :math:`U` times in the forward pass adds its uses as shared positions.

The reference (Martens & Grosse 2015; for convolutions Grosse & Martens 2016 in the
KFAC-expand normalisation of Eschenhagen et al. 2023) is

.. math::

    A = \frac{1}{N|T|}\sum_{n=1}^{N}\sum_{t\in T} \bar a_{n,t} \bar a_{n,t}^\top, \qquad
    G = \frac{1}{N}\sum_{n=1}^{N}\sum_{t\in T}\sum_{k} g_{n,t,k}\, g_{n,t,k}^\top,
    \qquad F \approx A \otimes G ,

where :math:`t` runs over the :math:`|T|` output locations of a convolution (the patch
:math:`\bar a_{n,t} = [p_{n,t}, 1]` read by location :math:`t`, zero padding included) or
the shared positions of a ``nn.Linear`` applied to ``[N, S, d]`` (:math:`|T| = S`), and
:math:`|T| = 1` for a plain ``nn.Linear`` on ``[N, d]``.  :math:`g_{n,t,k}` are the
back-propagated output vectors of the per-example loss :math:`\ell_n` at location
:math:`t`:

* ``mode="fisher_exact"``: column :math:`k` of the loss's Fisher factor :math:`B_n`
  (:math:`B_n B_n^\top = F_n`, from :mod:`kfac_ref.losses`) — the true Fisher, which is
  the GGN for these losses;
* ``"fisher_empirical"``: the gradient at the data target (one vector);
* ``"fisher_sampled"``: :math:`M^{-1/2}\nabla_f \ell_n(\tilde y_{n,m})` for :math:`M`
  targets :math:`\tilde y_{n,m}` drawn from the model's predictive distribution (an
  explicit seed or :class:`numpy.random.Generator`, or the caller's draws; see
  :func:`sample_targets`), so :math:`G` is the Monte Carlo Fisher of exactly those draws.

This is curvlinops' KFAC-expand convention (``KFACLinearOperator``, ``kfac_approx="expand"``).
TF K-FAC's ``ConvKFCBasicFB`` (and kfac-jax) normalise *both* factors by :math:`N|T|`,
:math:`\Gamma = G/|T|` with :math:`F \approx |T|\,(A \otimes \Gamma)`: the same block, and
a ``G`` that this check reports as ``scale:1/T`` with that explanation.  BackPACK's
``A = Σ/N`` (:math:`|T|\cdot A`) reads as ``scale:T``.  With ``sharing="reduce"``
(KFAC-reduce): :math:`A = \frac1N\sum_n \bar{\bar a}_n \bar{\bar a}_n^\top` over the mean
input over :math:`T` and :math:`G = \frac1N\sum_{n,k} (\sum_t g_{n,t,k})(\sum_t g_{n,t,k})^\top`.

The statistics are computed by kfac_ref (:func:`kfac_ref.factors.fully_connected_kronecker_factor`,
:func:`kfac_ref.factors.conv_input_kronecker_factor` / ``conv_output_kronecker_factor`` in
their NHWC/HWIO patch order, then permuted into unfold's) from layer inputs and output
gradients captured with hooks.  The loss is ``"cross_entropy"`` (logits ``[N, C]``, integer
targets) or ``"mse"`` (:math:`\ell_n = \tfrac12\|f_n - y_n\|^2`); the model's output is
``[N, C]``.  torch is imported inside the functions: the suite does not depend on it.  The
JAX version is :func:`check_jax_kfac` / :func:`reference_jax_kfac` (the same reference for a JAX
function of parameters with per-layer taps; jax is imported inside them).
"""

from __future__ import annotations

from ._check import HINTS, LayerCheck, ModelCheck, check_factors, layer_alternatives
from ._jax import check_jax_kfac, reference_jax_kfac
from ._precond import check_torch_preconditioner
from ._reference import (
    LOSSES,
    MODES,
    SHARING,
    as_rng,
    check_mode_args,
    check_samples,
    conv_patches,
    conv_reference_factors,
    dense_reference_factors,
    embedding_reference_factors,
    grouped_reference_factors,
    model_output_vectors,
    output_vectors,
    sample_targets,
    scale_shift_reference_factors,
)
from ._torch import reference_torch_kfac, torch_conv_padding, torch_conv_padding_nd
from ._torch_check import check_torch_kfac

__all__ = ["reference_torch_kfac", "check_torch_kfac", "check_torch_preconditioner",
           "reference_jax_kfac", "check_jax_kfac",
           "sample_targets", "output_vectors",
           "check_factors", "layer_alternatives", "torch_conv_padding",
           "conv_reference_factors", "dense_reference_factors", "check_mode_args", "as_rng",
           "check_samples", "model_output_vectors", "torch_conv_padding_nd", "conv_patches",
           "grouped_reference_factors", "embedding_reference_factors",
           "scale_shift_reference_factors",
           "LayerCheck", "ModelCheck", "MODES", "LOSSES", "SHARING", "HINTS"]
