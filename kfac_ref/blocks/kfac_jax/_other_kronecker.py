r"""Kronecker families other than K-FAC's :math:`E[\bar a\bar a^\top]\otimes E[gg^\top]`:
TNT, FOOF and the nearest Kronecker product (KPSVD).

Each is a :class:`TwoKroneckerFactored` whose statistics differ from K-FAC's; the products,
caching, π-damping and spectra are the family's, i.e. the one damped Kronecker kernel of
:mod:`kfac_ref.linalg`.  In the flat order of the block (the row-major ``[W; b]`` matrix
:math:`X`, ``[d_in (+1), d_out]``), :math:`(A\otimes G)\,\mathrm{vec}_r X =
\mathrm{vec}_r(A X G)`, and the per-example gradient of a dense layer is
:math:`\nabla W_n = \bar a_n g_n^\top`, so :math:`\mathrm{vec}_r \nabla W_n = \bar a_n\otimes
g_n` and the exact (empirical) block is

.. math::

    F = \frac1N\sum_n (\bar a_n\bar a_n^\top)\otimes(g_n g_n^\top).

* TNT (Ren & Goldfarb 2021; kfac-jax ``DenseTNT``, ``Conv2DTNT``): the factors are the
  contractions of the per-example gradient with itself over all axes but one,
  :math:`A = E[\nabla W\,\nabla W^\top]`, :math:`G = E[\nabla W^\top\nabla W]`, and the block
  is scaled by :math:`(\operatorname{tr}A\,\operatorname{tr}G)^{-1/2}` (kfac-jax's
  ``tnt_scale``), which makes :math:`\operatorname{tr}(sA\otimes G) = \operatorname{tr}F`.
* FOOF (Benzing 2022): :math:`A\otimes I`, the input factor only (``DenseFOOF``; for a
  convolution ``Conv2DFOOF``, KFC's :math:`|T|\,\Omega\otimes I`, or KFAC-reduce's pooled
  input factor :math:`\otimes I`).
* KPSVD (Van Loan & Pitsianis 1993; Koroko et al. 2022): the pair minimising
  :math:`\|F - A\otimes G\|_F`, by power iteration on the rearranged :math:`\mathcal R(F)`
  built from the per-example factors (never :math:`F` or :math:`\mathcal R(F)` densely).
"""

from __future__ import annotations

from array_api_compat import device as _device

from ... import factors
from ..._backend import (
    KFACValueError,
    check_array,
    check_bool,
    check_int,
    check_option,
    errors_named,
    kernel_of,
    namespace_of,
)
from ..._support import capabilities
from ...linalg import append_homog, compute_cov
from ._base import CurvatureBlock
from ._kronecker import (
    Conv2DTwoKroneckerFactored,
    DenseTwoKroneckerFactored,
    ReducedConv2DTwoKroneckerFactored,
    TwoKroneckerFactored,
)
from ._layers import SOURCE_REDUCTIONS, ParamsGradsSources, check_layer_kind
from ._registry import register_layer_block


@capabilities(dask="yes")
def tnt_scale(a, g):
    r"""kfac-jax's TNT scale of a factor pair: the inverse geometric mean of the traces.

    .. math::

        s = \begin{cases}(\operatorname{tr}A\,\operatorname{tr}G)^{-1/2} &
        \min(\operatorname{tr}A, \operatorname{tr}G) > 0,\\ 1 & \text{otherwise.}\end{cases}

    Both traces estimate :math:`E\|\nabla W\|_F^2`, so :math:`\operatorname{tr}(sA\otimes G)
    = \operatorname{tr}A = \operatorname{tr}G`.  Returns a 0-D array of ``a``'s namespace.
    """
    xp = namespace_of("tnt_scale", a=a, g=g)
    for name, m in (("a", a), ("g", g)):
        check_array("tnt_scale", name, m, ndim=2)
        if m.shape[0] != m.shape[1]:
            raise KFACValueError(f"tnt_scale: {name} must be a square matrix; got shape "
                                 f"{tuple(m.shape)}.")
    return _tnt_scale(xp, a, g)


@kernel_of(tnt_scale)
def _tnt_scale(xp, a, g):
    ta, tg = xp.sum(xp.linalg.diagonal(a)), xp.sum(xp.linalg.diagonal(g))
    positive = (ta > 0) & (tg > 0)
    one = xp.ones_like(ta)
    return xp.where(positive, one / xp.sqrt(xp.where(positive, ta * tg, one)), one)


class _StackedRows:
    """One update from :math:`C` back-propagated vectors of a dense layer: the statistic of
    the :math:`CR` stacked (input row, output-gradient row) pairs.  For statistics that are
    not a product of an input-only and an output-only average (TNT's weights, KPSVD's power
    iteration) this is the statistic of the :math:`C`-sample average."""

    def update_from_output_vectors(self, state, layer, inputs, outputs_grads, batch_size,
                                   weight_sharing, ema_old, ema_new, layer_tap=None):
        r"""One moving-average update from :math:`C` back-propagated vectors: the batch
        statistic of the :math:`CR` stacked pairs :math:`(\bar a_r, g_{c,r})`.

        .. math::

            S \leftarrow \texttt{ema\_old}\,S + \texttt{ema\_new}\,
            \hat S\big(\{(\bar a_r, g_{c,r})\}_{c,r}\big)
        """
        if not outputs_grads:
            return super().update_from_output_vectors(
                state, layer, inputs, outputs_grads, batch_size, weight_sharing, ema_old,
                ema_new, layer_tap)
        a, gs, rows = self._layer_rows(layer, inputs, outputs_grads, batch_size,
                                       weight_sharing)
        xp = namespace_of(f"{type(self).__name__}.update_from_output_vectors", inputs=a)
        c = len(gs)
        data = {"inputs": a if c == 1 else xp.concat([a] * c, axis=0),
                "outputs_grad": gs[0] if c == 1 else xp.concat(gs, axis=0)}
        return self.update_curvature_matrix_estimate(state, data, ema_old, ema_new, rows * c)


# --------------------------------------------------------------------------------------
# TNT
# --------------------------------------------------------------------------------------
class _TNTScale:
    """The state-dependent TNT scale, kept as a 0-D array (no host read, so the block can
    run inside a trace)."""

    def state_dependent_scale(self, state):
        r""":math:`(\operatorname{tr}A\,\operatorname{tr}G)^{-1/2}` of the averaged factors
        (:func:`tnt_scale`)."""
        xp = namespace_of(f"{type(self).__name__}.state_dependent_scale",
                          **{"state.like": state.like})
        a, g = (f.value for f in state.statistics)
        return _tnt_scale(xp, a, g)

    def scale(self, state, use_cache=False):
        r"""Total pre-factor :math:`s = \texttt{fixed\_scale}\cdot(\operatorname{tr}A\,
        \operatorname{tr}G)^{-1/2}` (a 0-D array); the cached snapshot's when
        ``use_cache``."""
        if use_cache:
            with errors_named(f"{type(self).__name__}.scale"):
                return self._cache_get(state, "scale", "update_cache")
        return float(self.fixed_scale()) * self.state_dependent_scale(state)

    def uses_layer_tap(self, layer, input_shape):
        """False: the forward tap is K-FAC's unweighted input factor, not TNT's."""
        return False

    def layer_tap(self, layer, input_shape):
        """None (see :meth:`uses_layer_tap`)."""
        return None

    def _weighted_second_moments(self, xp, x, g, wx, wg):
        """``(E[wg · x xᵀ], E[wx · g gᵀ])`` over the rows of ``x``, ``g`` with per-row
        weights (squared norms): the weights enter as square roots of the rows, so each
        statistic is one GEMM."""
        return (self._second_moment(xp, x * xp.sqrt(wg)[:, None]),
                self._second_moment(xp, g * xp.sqrt(wx)[:, None]))


@capabilities(dask="yes")
class NaiveTNT(ParamsGradsSources, _TNTScale, TwoKroneckerFactored):
    r"""TNT from gradients of the summed loss (kfac-jax ``NaiveTNT``), on the ``[W; b]``
    matrix.

    .. math::

        \begin{aligned}
        A &= \frac1N\sum_s X_s X_s^\top,\qquad G = \frac1N\sum_s X_s^\top X_s
            &&\text{(per\_source, default)},\\
        A &= \frac1N X X^\top,\qquad G = \frac1N X^\top X,\quad X = \sum_s X_s
            &&\text{(summed; kfac-jax)},\\
        B &= s\,A\otimes G,\qquad s = (\operatorname{tr}A\,\operatorname{tr}G)^{-1/2},
        \end{aligned}

    with :math:`X_s` the ``[K (+1), C_out]`` matrix (kernel reshaped row-major to
    ``[-1, C_out]``, bias row last) of ``estimation_data["params_grads"]`` source :math:`s`
    (see :mod:`kfac_ref.blocks.kfac_jax`; per-example gradients as :math:`N` sources give
    :class:`DenseTNT`'s factors).  kfac-jax contracts every axis of the parameter array
    with the others (one factor per axis); here the kernel is matricised to two factors as
    in :class:`TwoKroneckerFactored`.  Each statistic is one GEMM over the stacked sources.

    Parameters
    ----------
    parameters_shapes : sequence of tuple of int
        ``(kernel_shape,)`` or ``(kernel_shape, (C_out,))``.
    source_reduction : {"per_source", "summed"}
    **kwargs
        Options of :class:`TwoKroneckerFactored`.
    """

    def __init__(self, parameters_shapes, source_reduction="per_source", **kwargs):
        super().__init__(parameters_shapes, **kwargs)
        self.source_reduction = check_option(type(self).__name__, "source_reduction",
                                             source_reduction, SOURCE_REDUCTIONS)

    # refuses output vectors: it reads parameter gradients
    update_from_output_vectors = CurvatureBlock.update_from_output_vectors

    def _batch_statistics(self, xp, sources, batch_size):
        q = self.output_size
        kernels = xp.stack([xp.reshape(src[0], (-1, q)) for src in sources])
        mats = kernels if len(self.parameters_shapes) == 1 else xp.concat(
            [kernels, xp.stack([xp.reshape(src[1], (1, q)) for src in sources])], axis=1)
        if self.source_reduction == "summed":
            mats = xp.sum(mats, axis=0, keepdims=True)
        s_count, rows = mats.shape[0], mats.shape[1]
        # Σ_s X_s X_sᵀ = Y Yᵀ with Y = [X_1 … X_S]; Σ_s X_sᵀ X_s = Zᵀ Z with Z = [X_1; …; X_S]
        y_t = xp.reshape(xp.permute_dims(mats, (0, 2, 1)), (s_count * q, rows))
        z = xp.reshape(mats, (s_count * rows, q))
        if self.symmetrize:
            return (compute_cov.kernel(xp, y_t, normalizer=batch_size),
                    compute_cov.kernel(xp, z, normalizer=batch_size))
        return (compute_cov.kernel(xp, y_t, y_t, normalizer=batch_size),
                compute_cov.kernel(xp, z, z, normalizer=batch_size))


@capabilities(jit="yes", dask="yes")
class DenseTNT(_TNTScale, _StackedRows, DenseTwoKroneckerFactored):
    r"""TNT for a dense layer (Ren & Goldfarb 2021; kfac-jax ``DenseTNT``).

    .. math::

        \begin{aligned}
        A &= \frac1N\sum_n \nabla W_n\nabla W_n^\top = \frac1N\sum_n\|g_n\|^2\,
            \bar a_n\bar a_n^\top,\\
        G &= \frac1N\sum_n \nabla W_n^\top\nabla W_n = \frac1N\sum_n\|\bar a_n\|^2\,
            g_n g_n^\top,\\
        B &= s\,A\otimes G,\qquad s = (\operatorname{tr}A\,\operatorname{tr}G)^{-1/2}
        \end{aligned}

    with :math:`\nabla W_n = \bar a_n g_n^\top` the per-example gradient of ``[W; b]``
    (:math:`\bar a_n` with a trailing 1 when ``has_bias``).  :math:`s` is computed from the
    averaged factors (:meth:`state_dependent_scale`), as kfac-jax does; products, caching
    and π-damping are :class:`TwoKroneckerFactored`'s.  Each statistic is one GEMM of
    norm-weighted rows.  Parameters as :class:`DenseTwoKroneckerFactored`.
    """

    def _batch_statistics(self, xp, data, batch_size):
        a, g = data["inputs"], data["outputs_grad"]
        if self.has_bias:
            a = append_homog.kernel(xp, a)
        return self._weighted_second_moments(xp, a, g, xp.sum(a * a, axis=1),
                                             xp.sum(g * g, axis=1))


@capabilities(jit="yes", dask="yes")
class Conv2DTNT(_TNTScale, Conv2DTwoKroneckerFactored):
    r"""TNT for a 2-D convolution (kfac-jax ``Conv2DTNT``), with location independence.

    .. math::

        \begin{aligned}
        A &= \frac{1}{N|T|}\sum_{n,t} w^g_{n,t}\,\bar p_{n,t}\bar p_{n,t}^\top,\qquad
        G = \frac{1}{N|T|}\sum_{n,t} w^p_{n,t}\,g_{n,t}g_{n,t}^\top,\\
        B &= |T|\,s\,A\otimes G,\qquad s = (\operatorname{tr}A\,\operatorname{tr}G)^{-1/2},
        \end{aligned}

    with :math:`(w^g, w^p)_{n,t} = (\|g_{n,t}\|^2, \|\bar p_{n,t}\|^2)` when
    ``weighting_per_location`` (the default: the contractions of the per-location gradients
    :math:`\bar p_{n,t} g_{n,t}^\top`) and the per-example sums :math:`(\sum_{t'}
    \|g_{n,t'}\|^2, \sum_{t'}\|\bar p_{n,t'}\|^2)` otherwise (kfac-jax's mixture).
    ``fixed_scale() = |T|`` as :class:`Conv2DTwoKroneckerFactored` (kfac-jax's ``Conv2DTNT``
    inherits it).  Layer parameters and options as :class:`Conv2DTwoKroneckerFactored`.
    """

    def __init__(self, *args, weighting_per_location=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.weighting_per_location = check_bool(type(self).__name__, "weighting_per_location",
                                                 weighting_per_location)

    # C vectors: C calls of the update (statistics linear in the rows)
    update_from_output_vectors = CurvatureBlock.update_from_output_vectors

    @classmethod
    def from_layer(cls, layer, input_shape, *, weight_sharing="expand", **kwargs):
        """The TNT block of a conv layer (KFAC-expand statistics only)."""
        if weight_sharing == "reduce":
            raise KFACValueError(
                f"{cls.__name__}.from_layer: weight_sharing must be 'expand' for a TNT conv "
                f"block (its statistics are per location); got 'reduce'.")
        return super().from_layer(layer, input_shape, weight_sharing=weight_sharing,
                                  **kwargs)

    def _batch_statistics(self, xp, data, batch_size):
        x, g = data["inputs"], data["outputs_grad"]
        p = self._patches(x)  # [N|T|, K (+1)], example-major rows
        gl = self._grads_channels_last(xp, g)
        g = xp.reshape(gl, (-1, gl.shape[-1]))
        wp, wg = xp.sum(p * p, axis=1), xp.sum(g * g, axis=1)
        if not self.weighting_per_location:
            n = x.shape[0]
            ones = xp.ones((1, self.num_locations), dtype=p.dtype, device=_device(p))
            wp = xp.reshape(xp.sum(xp.reshape(wp, (n, -1)), axis=1)[:, None] * ones, (-1,))
            wg = xp.reshape(xp.sum(xp.reshape(wg, (n, -1)), axis=1)[:, None] * ones, (-1,))
        return self._weighted_second_moments(xp, p, g, wp, wg)


# --------------------------------------------------------------------------------------
# FOOF
# --------------------------------------------------------------------------------------
@capabilities(jit="yes", dask="yes")
class DenseFOOF(DenseTwoKroneckerFactored):
    r"""FOOF, "gradient descent on neurons" (Benzing 2022): the input factor only.

    .. math::

        B = A\otimes I,\qquad A = \frac1N\sum_n\bar a_n\bar a_n^\top,\qquad
        (B + \lambda I)^{-1}\mathrm{vec}_r X = \mathrm{vec}_r\big((A+\lambda I)^{-1}X\big)

    for the ``[W; b]`` matrix :math:`X` (``[d_in (+1), d_out]``): the update
    :math:`(A+\lambda I)^{-1}\nabla_{[W;b]}` is FOOF's :math:`\nabla W\,(A+\lambda I)^{-1}`
    in the layout :math:`y = Wx` of the paper.  The second statistic is the identity, so
    ``exact_power=True`` gives FOOF's damping :math:`A\otimes I + \lambda I` exactly;
    ``exact_power=False`` is the π-damped :math:`(A + \pi\sqrt\lambda I)\otimes(1 +
    \sqrt\lambda/\pi) I` of :class:`TwoKroneckerFactored`.  Parameters as
    :class:`DenseTwoKroneckerFactored`; ``outputs_grad`` is checked but not read.
    """

    def _batch_statistics(self, xp, data, batch_size):
        a = data["inputs"]
        stat = (factors.fully_connected_kronecker_factor.kernel(xp, a, self.has_bias)
                if self.symmetrize else
                self._second_moment(xp, append_homog.kernel(xp, a) if self.has_bias else a))
        return stat, xp.eye(self.output_size, dtype=a.dtype, device=_device(a))


@capabilities(dask="yes")
class Conv2DFOOF(Conv2DTwoKroneckerFactored):
    r"""FOOF for a 2-D convolution: KFC's input factor with the identity for the output
    factor.

    .. math::

        B = |T|\,\Omega\otimes I = \Big(\frac1N\sum_{n,t}\bar p_{n,t}\bar p_{n,t}^\top\Big)
        \otimes I,\qquad \Omega = \frac{1}{N|T|}\sum_{n,t}\bar p_{n,t}\bar p_{n,t}^\top

    on the row-major ``[kh·kw·C_in (+1), C_out]`` kernel-and-bias matrix :math:`X`, so
    :math:`(B + \lambda I)^{-1}\mathrm{vec}_r X = \mathrm{vec}_r\big((|T|\Omega +
    \lambda I)^{-1}X\big)`.  :math:`\Omega` is :class:`Conv2DTwoKroneckerFactored`'s
    (:func:`kfac_ref.factors.conv_input_kronecker_factor`, or the layer's forward tap), and
    ``fixed_scale() = |T|`` as there: the block is the KFAC-expand block with
    :math:`\Gamma` replaced by :math:`I` (as :class:`DenseFOOF` on ``[N, T, d]`` inputs is
    :math:`T\,A\otimes I`).  With ``weight_sharing="reduce"``, :meth:`from_layer` gives
    :class:`DenseFOOF`'s block on the location-averaged patches :math:`\bar{\bar p}_n`,
    :math:`B = \frac1N\sum_n\bar{\bar p}_n\bar{\bar p}_n^\top\otimes I`.  Layer
    parameters and options as :class:`Conv2DTwoKroneckerFactored`; ``outputs_grad`` is
    checked but not read.
    """

    @classmethod
    def from_layer(cls, layer, input_shape, *, weight_sharing="expand", **kwargs):
        r"""The FOOF block of a conv layer: KFC's :math:`\Omega` (``"expand"``) or the pooled
        patches' second moment (``"reduce"``), each :math:`\otimes I`."""
        if weight_sharing != "reduce":
            return super().from_layer(layer, input_shape, **kwargs)
        check_layer_kind(cls, layer, "conv2d")
        return ReducedConv2DFOOF(layer.patch_size, layer.c_out, has_bias=layer.use_bias,
                                 **kwargs)

    def _batch_statistics(self, xp, data, batch_size):
        x = data["inputs"]
        tap = data.get("input_factor")
        if self.symmetrize:
            a = tap if tap is not None else factors.conv_input_kronecker_factor.kernel(
                xp, x, self.geometry, self.has_bias)
        else:
            a = self._second_moment(xp, self._patches(x))
        return a, xp.eye(self.output_size, dtype=a.dtype, device=_device(a))


@capabilities(dask="yes")
class ReducedConv2DFOOF(DenseFOOF, ReducedConv2DTwoKroneckerFactored):
    r"""FOOF with KFAC-reduce for a convolution: :class:`DenseFOOF` on the
    location-averaged patches :math:`\bar{\bar p}_n = \frac1{|T|}\sum_t\bar p_{n,t}`.

    .. math::

        B = \Big(\frac1N\sum_n\bar{\bar p}_n\bar{\bar p}_n^\top\Big)\otimes I

    Built by :meth:`Conv2DFOOF.from_layer` with ``weight_sharing="reduce"``; parameters as
    :class:`DenseTwoKroneckerFactored` with ``input_size = kh·kw·C_in``.
    """

    @classmethod
    def from_layer(cls, layer, input_shape, *, weight_sharing="reduce", **kwargs):
        """The KFAC-reduce FOOF block of a conv layer."""
        return Conv2DFOOF.from_layer(layer, input_shape, weight_sharing="reduce", **kwargs)


# --------------------------------------------------------------------------------------
# Nearest Kronecker product (KPSVD)
# --------------------------------------------------------------------------------------
@capabilities(dask="yes")
def nearest_kronecker_factors(inputs, outputs_grads, iterations=20):
    r"""The Kronecker pair nearest, in Frobenius norm, to the empirical block of per-example
    outer products (Van Loan & Pitsianis 1993; KPSVD, Koroko et al. 2022).

    .. math::

        (A, G) = \operatorname*{arg\,min}_{A, G}\Big\|\frac1N\sum_n (a_n a_n^\top)\otimes
        (g_n g_n^\top) - A\otimes G\Big\|_F ,

    i.e. :math:`\mathrm{vec}A\,\mathrm{vec}G^\top` is the best rank-1 approximation of the
    rearrangement :math:`\mathcal R(F) = \frac1N\sum_n \mathrm{vec}(a_na_n^\top)
    \mathrm{vec}(g_ng_n^\top)^\top`.  ``iterations`` steps of power iteration, started from
    :math:`G_0 = \frac1N\sum_n g_ng_n^\top`, each two GEMMs of weighted rows:

    .. math::

        A \propto \mathcal R(F)\,\mathrm{vec}\,G = \frac1N\sum_n (g_n^\top G g_n)\,
        a_na_n^\top,\qquad G \propto \mathcal R(F)^\top\mathrm{vec}\,A = \frac1N\sum_n
        (a_n^\top A a_n)\,g_ng_n^\top ;

    the returned :math:`A` is the least-squares optimum for the returned :math:`G`, and the
    pair is balanced, :math:`\|A\|_F = \|G\|_F`.  Both stay positive semi-definite.  When
    :math:`F` is a Kronecker product one step recovers it exactly.

    Parameters
    ----------
    inputs : array ``[N, d_a]``
    outputs_grads : array ``[N, d_g]``
    iterations : int
        At least 1.
    """
    func = "nearest_kronecker_factors"
    xp = namespace_of(func, inputs=inputs, outputs_grads=outputs_grads)
    check_array(func, "inputs", inputs, ndim=2)
    check_array(func, "outputs_grads", outputs_grads, ndim=2, shape=(inputs.shape[0], None))
    iterations = check_int(func, "iterations", iterations, minimum=1)
    return _nearest_kronecker_factors(xp, inputs, outputs_grads, iterations)


def _frobenius_normalised(xp, m):
    nrm = xp.sqrt(xp.sum(m * m))
    return m / xp.where(nrm > 0, nrm, xp.ones_like(nrm)), nrm


@kernel_of(nearest_kronecker_factors)
def _nearest_kronecker_factors(xp, a, g, iterations, symmetrize=True):
    def weighted(rows, w):  # (1/N) Σ w_n r_n r_nᵀ, one GEMM
        return compute_cov.kernel(xp, rows * xp.sqrt(w)[:, None]) if symmetrize else \
            compute_cov.kernel(xp, rows * w[:, None], rows)

    def quad(rows, m):  # r_nᵀ M r_n for every row
        return xp.sum((rows @ m) * rows, axis=1)

    gm, _ = _frobenius_normalised(xp, compute_cov.kernel(xp, g))
    for _ in range(iterations - 1):
        am, _ = _frobenius_normalised(xp, weighted(a, quad(g, gm)))
        gm, _ = _frobenius_normalised(xp, weighted(g, quad(a, am)))
    am = weighted(a, quad(g, gm))  # R(F) vec G with ‖G‖_F = 1: the least-squares A
    _, nrm = _frobenius_normalised(xp, am)
    c = xp.sqrt(nrm)
    return am / xp.where(c > 0, c, xp.ones_like(c)), gm * c


@capabilities(jit="yes", dask="yes")
class DenseKPSVD(_StackedRows, DenseTwoKroneckerFactored):
    r"""The nearest Kronecker product of a dense layer's per-example Fisher block (KPSVD,
    Koroko et al. 2022; Van Loan & Pitsianis 1993).

    .. math::

        (A, G) = \operatorname*{arg\,min}\Big\|\frac1N\sum_n(\bar a_n\bar a_n^\top)\otimes
        (g_ng_n^\top) - A\otimes G\Big\|_F,\qquad B = A\otimes G

    per batch by :func:`nearest_kronecker_factors` (``power_iterations`` steps, GEMM-shaped,
    from the per-example factors :math:`\bar a_n, g_n`); the per-batch pairs are averaged
    into the state by the moving average like K-FAC's factors.  K-FAC's pair
    (:class:`DenseTwoKroneckerFactored`) is the iteration's starting :math:`G` and is never
    nearer to :math:`F` in Frobenius norm.  Parameters as
    :class:`DenseTwoKroneckerFactored`, plus ``power_iterations`` (int, default 20).
    """

    # the power iteration's pairs are not declared semidefinite: rounding in its weights
    # can leave them indefinite, where a finite diagonal bounds nothing; scanned in full
    semidefinite_statistics = ()

    def __init__(self, *args, power_iterations=20, **kwargs):
        super().__init__(*args, **kwargs)
        self.power_iterations = check_int(type(self).__name__, "power_iterations",
                                          power_iterations, minimum=1)

    def _batch_statistics(self, xp, data, batch_size):
        a, g = data["inputs"], data["outputs_grad"]
        if self.has_bias:
            a = append_homog.kernel(xp, a)
        return _nearest_kronecker_factors(xp, a, g, self.power_iterations, self.symmetrize)


register_layer_block("dense", "tnt", DenseTNT)
register_layer_block("conv2d", "tnt", Conv2DTNT)
register_layer_block("dense", "foof", DenseFOOF)
register_layer_block("conv2d", "foof", Conv2DFOOF)
register_layer_block("dense", "kpsvd", DenseKPSVD)
