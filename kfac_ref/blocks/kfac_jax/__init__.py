r"""kfac-jax-named curvature blocks with explicit, immutable state.

A block is built from parameter shapes and layer options (no tracing), or from a
:mod:`kfac_ref.nn` layer with its ``from_layer`` classmethod, and is stateless itself:
:meth:`CurvatureBlock.init` returns a :class:`BlockState`, and every update returns a new
state.  The products are the formula functions of :mod:`kfac_ref.blocks._math`:

.. math::

    \texttt{multiply\_matpower}(v) = (s\,B + \lambda I)^{p}\, v ,

with :math:`B` the unscaled block (Kronecker :math:`A \otimes G`, diagonal or full), :math:`s`
its scale (:meth:`~CurvatureBlock.scale`) and :math:`\lambda` the ``identity_weight``
(optionally multiplied by the block's norm, kfac-jax's ``norm_to_scale_identity_weight_per_block``).

The families live in one module each, as kfac-jax's ``_src/curvature_blocks/``: the scaled
identity, diagonal blocks, full blocks and Kronecker-factored blocks, and the Kronecker
families with other statistics (TNT, FOOF, the nearest Kronecker product); layer adapters (dense,
convolution, scale-and-shift, naive gradient sources) are mixins shared by the families.  A
new family is one module (its classes implement the hooks of :class:`CurvatureBlock` and
register themselves with :func:`register_layer_block`) and one import line here.

``estimation_data``
-------------------
A mapping with the per-example, back-propagated quantities of one mini-batch (no ``1/N``:
gradients of the per-example loss terms, the convention of the docs page *Conventions*):

* ``"inputs"``: the layer input ``[N, d_in]`` (dense), ``[N, H, W, C]`` / ``[N, C, H, W]``
  (conv), ``[N, *feature]`` (scale-and-shift);
* ``"outputs_grad"``: the back-propagated vector at the layer output, same layout;
* ``"params_grads"``: for :class:`NaiveDiagonal` / :class:`NaiveFull` only, a sequence (one
  entry per parameter) of gradients of the *batch-summed* (sampled) loss, each shaped like
  its parameter or ``[S, *param_shape]`` for :math:`S` sources (Monte-Carlo samples).  They
  are not per-example gradients: an ``[N, *param_shape]`` array would be read as N sources,
  which turns the naive estimator into the sum-of-squares one.

The statistics come from :mod:`kfac_ref.factors`; they are averaged into the state with
kfac-jax's weighted moving average (``ema_old``, ``ema_new``;
:class:`kfac_ref.averaging.WeightedMovingAverage`).  Each input array is validated once, by
the method the user called.  A caller that holds many blocks checks their products' arguments
once for all of them — :meth:`CurvatureBlock.check_state_structure`,
:meth:`CurvatureBlock.check_product_options` (or, with the scalar options checked,
:meth:`CurvatureBlock.check_approx_power`), one namespace check over the vector and every
state — and then calls :meth:`CurvatureBlock.multiply_matpower_kernel`, which checks nothing
but what depends on the cache (as :class:`kfac_ref.curvature.BlockDiagonalCurvature` does).

Vectors
-------
A vector is a tuple of arrays, one per parameter, shaped like ``parameters_shapes`` (kernel
first, then bias/shift).  The flat order of :meth:`~CurvatureBlock.to_dense_matrix` is the
concatenation of the row-major flattened parameters in that order, which for dense and conv
layers is the row-major flattening of ``[W; b]`` (bias row last).  kfac-jax orders by pytree
leaf order instead (a Haiku ``{"b", "w"}`` dict puts the bias first): a documented permutation.

Caching, and how kfac-jax's cache fault is avoided
--------------------------------------------------
kfac-jax's estimator computes the per-block, norm-scaled identity weight in
``update_cache`` and then passes the *unscaled* weight to the block, so cached inverses are
built for a different damping than uncached ones (kfac-jax's ``block_diagonal.py``,
``update_cache``; see the docs page *Findings*).  Here both paths
call one method, :meth:`CurvatureBlock.effective_identity_weight`; the cache stores the
statistics snapshot it was built from (scale, norm, eigendecompositions, damped factor powers
*with the weight they were built for*), and the cached product runs the same code as the
uncached one.  A cached product asked for a baked-in weight other than the one cached raises
:class:`~kfac_ref.KFACValueError` (``strict_cache=False`` reproduces kfac-jax, which silently
uses the cached weight).
"""

from ._base import BlockState, CurvatureBlock
from ._diagonal import (
    Conv2DDiagonal,
    DenseDiagonal,
    Diagonal,
    NaiveDiagonal,
    ScaleAndShiftDiagonal,
)
from ._ekfac import Conv2DEKFAC, DenseEKFAC, EigenbasisKroneckerFactored
from ._full import Conv2DFull, DenseFull, Full, NaiveFull, ScaleAndShiftFull
from ._identity import ScaledIdentity
from ._kronecker import (
    KFAC_JAX_APPROX_POWERS as KFAC_JAX_APPROX_POWERS,
)
from ._kronecker import (
    Conv2DTwoKroneckerFactored,
    DenseTwoKroneckerFactored,
    ReducedConv2DTwoKroneckerFactored,
    TwoKroneckerFactored,
)
from ._other_kronecker import (
    Conv2DFOOF,
    Conv2DTNT,
    DenseFOOF,
    DenseKPSVD,
    DenseTNT,
    NaiveTNT,
    ReducedConv2DFOOF,
    nearest_kronecker_factors,
    tnt_scale,
)
from ._registry import (
    default_layer_to_block,
    layer_block,
    register_layer_block,
    registered_layer_blocks,
)

__all__ = [
    "BlockState",
    "CurvatureBlock",
    "ScaledIdentity",
    "Diagonal",
    "Full",
    "TwoKroneckerFactored",
    "NaiveDiagonal",
    "NaiveFull",
    "DenseDiagonal",
    "DenseFull",
    "DenseTwoKroneckerFactored",
    "Conv2DDiagonal",
    "Conv2DFull",
    "Conv2DTwoKroneckerFactored",
    "ReducedConv2DTwoKroneckerFactored",
    "EigenbasisKroneckerFactored",
    "DenseEKFAC",
    "Conv2DEKFAC",
    "ScaleAndShiftDiagonal",
    "ScaleAndShiftFull",
    "NaiveTNT",
    "DenseTNT",
    "Conv2DTNT",
    "DenseFOOF",
    "Conv2DFOOF",
    "ReducedConv2DFOOF",
    "DenseKPSVD",
    "tnt_scale",
    "nearest_kronecker_factors",
    "register_layer_block",
    "layer_block",
    "registered_layer_blocks",
    "default_layer_to_block",
]
