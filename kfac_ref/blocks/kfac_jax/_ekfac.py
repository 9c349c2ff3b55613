r"""The EKFAC block family (George et al. 2018): K-FAC's Kronecker eigenbasis with the
diagonal re-estimated from per-example gradients.

On the row-major ``[W; b]`` matrix ``X`` of shape ``[K, C]`` (input side, bias row last;
output side), the Kronecker factors :math:`A = Q_A \operatorname{diag}(s_A) Q_A^\top` and
:math:`G = Q_G \operatorname{diag}(s_G) Q_G^\top` give the Kronecker-factored eigenbasis
(KFE) :math:`Q = Q_A \otimes Q_G`, with :math:`Q^\top \mathrm{vec}_r(X) =
\mathrm{vec}_r(Q_A^\top X Q_G)`.  K-FAC is diagonal in it, :math:`A \otimes G = Q
\operatorname{diag}(s_A \otimes s_G) Q^\top`; EKFAC replaces that diagonal with the second
moment of the per-example gradients :math:`DW_n` projected into the basis:

.. math::

    B = Q \operatorname{diag}(s^*) Q^\top, \qquad
    s^*_{ij} = \frac1N \sum_n \big(Q_A^\top DW_n\, Q_G\big)_{ij}^2
             = \big(Q^\top F Q\big)_{(ij),(ij)}, \qquad
    F = \frac1N \sum_n \mathrm{vec}_r(DW_n)\,\mathrm{vec}_r(DW_n)^\top .

:math:`s^*` is the Frobenius-optimal diagonal in the KFE, so
:math:`\|F - B\|_F \le \|F - A\otimes G\|_F`.
"""

from __future__ import annotations

import math

from ... import factors
from ..._backend import KFACValueError, check_bool
from ..._support import DASK_NO_EIGH, capabilities
from ...linalg import append_homog, clipped_eigh, compute_cov, factor_norm, kron
from .._math import apply_diagonal
from ._base import CurvatureBlock, MatrixWorkingForm
from ._layers import ConvLayer, DenseLayer
from ._registry import register_layer_block


def _to_kfe(xp, q_a, q_g, x):
    """:math:`Q_A^\\top X Q_G` for ``x`` of shape ``[..., K, C]`` (the KFE coordinates)."""
    return xp.matmul(xp.matmul(xp.matrix_transpose(q_a), x), q_g)


def _from_kfe(xp, q_a, q_g, y):
    """:math:`Q_A Y Q_G^\\top` (inverse of :func:`_to_kfe`)."""
    return xp.matmul(xp.matmul(q_a, y), xp.matrix_transpose(q_g))


@capabilities(dask=DASK_NO_EIGH)
class EigenbasisKroneckerFactored(MatrixWorkingForm, CurvatureBlock):
    r"""EKFAC blocks (George et al. 2018): :math:`s\,Q\operatorname{diag}(s^*)Q^\top` in the
    eigenbasis :math:`Q = Q_A \otimes Q_G` of the Kronecker factors.

    .. math::

        \begin{aligned}
        (sB + \lambda I)^{p} \mathrm{vec}_r(X) &= \mathrm{vec}_r\Big(Q_A
            \big[(s\,S^* + \lambda)^{\odot p} \odot (Q_A^\top X Q_G)\big] Q_G^\top\Big),\\
        S^*_{ij} &= \big(Q^\top \bar F Q\big)_{(ij),(ij)}
        \end{aligned}

    for any real power :math:`p` (exact and approximate powers coincide: the damping is exact
    in the eigenbasis, :math:`\lambda` is added to :math:`s^*`), with :math:`S^*` clipped
    below at ``eigenvalue_clipping_threshold``.

    Statistics (each a kfac-jax weighted moving average, :meth:`update_curvature_matrix_estimate`):
    the factors :math:`\bar A, \bar G` of the Kronecker block and the second moment
    :math:`\bar F` of the per-example gradients (the exact block, as ``DenseFull`` /
    ``Conv2DFull``).  The eigenbasis and :math:`S^*` are computed from the averages when a
    product (or :meth:`update_cache`) needs them, so :math:`S^*` is always taken in the basis
    it is used in, whatever the averaging weights and however many updates one batch is
    split into (the estimator's exact and multi-sample modes).  With a fixed basis this is
    the moving average of the per-batch :math:`s^*` of George et al.; when the factors move,
    it is the EKFAC of the averaged statistics (George et al. average :math:`s^*` in a basis
    refreshed only periodically).  Memory is that of the full block, :math:`O(\dim^2)`: a
    reference for checking EKFAC implementations on small networks.

    Within a degenerate eigenspace of :math:`A` or :math:`G` the basis is the one ``eigh``
    returns (the EKFAC of George et al. depends on that choice there; K-FAC does not).
    Abstract: a subclass gives the batch statistics (``_batch_statistics``).
    """

    semidefinite_statistics = (0, 1, 2)  # A, G and the gradients' second moment

    def __init__(self, parameters_shapes, *, symmetrize=True, **kwargs):
        super().__init__(parameters_shapes, **kwargs)
        func = type(self).__name__
        self.symmetrize = check_bool(func, "symmetrize", symmetrize)
        kernel = self.parameters_shapes[0]
        self.output_size = kernel[-1]
        self.input_size = math.prod(kernel[:-1]) + (1 if len(self.parameters_shapes) == 2 else 0)

    def _statistics_shapes(self):
        k, c = self.input_size, self.output_size
        return ((k, k), (c, c), (k * c, k * c))

    # -- the eigenbasis and the scalings -------------------------------------------------
    def _kfe(self, xp, a, g, f):
        r"""``(Q_A, Q_G, S*)`` with :math:`S^*_{ij} = (Q^\top F Q)_{(ij),(ij)}`, ``[K, C]``."""
        k, c = self.input_size, self.output_size
        _, q_a = clipped_eigh.kernel(xp, a)
        _, q_g = clipped_eigh.kernel(xp, g)
        # (F Q)[r, (i, j)] = (Q_A^T F_r Q_G)_{ij}, F_r = row r of F as a [K, C] matrix
        fq = xp.reshape(_to_kfe(xp, q_a, q_g, xp.reshape(f, (k * c, k, c))), (k, c, k, c))
        # S*_{ij} = sum_{(k, c)} Q[(k, c), (i, j)] (F Q)[(k, c), (i, j)]
        s_star = xp.sum(q_a[:, None, :, None] * q_g[None, :, None, :] * fq, axis=(0, 1))
        return q_a, q_g, xp.clip(s_star, min=self.eigenvalue_clipping_threshold)

    def _fresh_kfe(self, xp, state):
        a, g, f = (s.value for s in state.statistics)
        return self._kfe(xp, a, g, f)

    # -- products -------------------------------------------------------------------------
    def _product(self, xp, kfe, x, lam, power, s):
        q_a, q_g, s_star = kfe
        return _from_kfe(xp, q_a, q_g,
                         apply_diagonal(xp, s_star, _to_kfe(xp, q_a, q_g, x), power, lam, s))

    def _multiply_fresh(self, xp, state, vector, lam, power, exact):
        return self._product(xp, self._fresh_kfe(xp, state), vector, lam, power,
                             self.scale(state, False))

    def _multiply_cached(self, xp, state, vector, lam, power, exact):
        return self._product(xp, self._cache_get(state, "kfe", "update_cache"), vector,
                             lam, power, self._cache_get(state, "scale", "update_cache"))

    def _build_cache(self, xp, state, lam, exact, approx, eigenvalues):
        out = {"kfe": self._fresh_kfe(xp, state)}
        if eigenvalues:
            out["eigenvalues"] = self.scale(state, False) * xp.reshape(out["kfe"][2], (-1,))
        return out

    def _eigenvalues(self, xp, state):
        return self.scale(state, False) * xp.reshape(self._fresh_kfe(xp, state)[2], (-1,))

    def _dense_unscaled(self, xp, state):
        q_a, q_g, s_star = self._fresh_kfe(xp, state)
        q = kron.kernel(xp, q_a, q_g)
        return (q * xp.reshape(s_star, (1, -1))) @ xp.matrix_transpose(q)

    def _norm_unscaled(self, xp, state, norm_type):
        return factor_norm.kernel(xp, self._dense_unscaled(xp, state), norm_type)

    # -- statistics -----------------------------------------------------------------------
    def _second_moment(self, xp, x):
        """:math:`X^\\top X / n` of rows, symmetrised (TF) or not (kfac-jax)."""
        if self.symmetrize:
            return compute_cov.kernel(xp, x)
        return compute_cov.kernel(xp, x, x)


@capabilities(jit="yes", dask=DASK_NO_EIGH)
class DenseEKFAC(DenseLayer, EigenbasisKroneckerFactored):
    r"""EKFAC of a dense layer ``y = x W + b`` (George et al. 2018).

    .. math::

        \begin{aligned}
        A &= \frac1N \sum_n \bar a_n \bar a_n^\top, \quad
        G = \frac1N \sum_n g_n g_n^\top, \quad DW_n = \bar a_n g_n^\top,\\
        s^*_{ij} &= \frac1N \sum_n (Q_A^\top \bar a_n)_i^2\, (Q_G^\top g_n)_j^2
        \end{aligned}

    with :math:`\bar a_n = [a_n; 1]` (bias) and :math:`g_n` the back-propagated vector of
    example :math:`n` (no :math:`1/N`; the docs page *Conventions*).  Factors as
    ``DenseTwoKroneckerFactored``, second moment as ``DenseFull``.

    Parameters
    ----------
    input_size, output_size : int
    has_bias : bool
    symmetrize : bool
        Symmetrised statistics (default) or kfac-jax's unsymmetrised product.
    """

    @classmethod
    def from_layer(cls, layer, input_shape, *, weight_sharing="expand", **kwargs):
        """The EKFAC block of a :class:`kfac_ref.nn.Dense` layer on ``[N, d_in]`` inputs."""
        if len(input_shape) != 2:
            raise KFACValueError(
                f"{cls.__name__}.from_layer: input_shape must be [N, d_in] (EKFAC of a dense "
                f"layer on [N, T, d] inputs is not implemented); got {tuple(input_shape)}.")
        return super().from_layer(layer, input_shape, **kwargs)

    def _batch_statistics(self, xp, data, batch_size):
        a, g = data["inputs"], data["outputs_grad"]
        a_bar = append_homog.kernel(xp, a) if self.has_bias else a
        grads = xp.reshape(a_bar[:, :, None] * g[:, None, :], (a.shape[0], -1))
        if self.symmetrize:
            fa = factors.fully_connected_kronecker_factor(a, has_bias=self.has_bias)
            fg = factors.fully_connected_kronecker_factor(g)
        else:
            fa, fg = self._second_moment(xp, a_bar), self._second_moment(xp, g)
        return fa, fg, self._second_moment(xp, grads)


@capabilities(dask=DASK_NO_EIGH)
class Conv2DEKFAC(ConvLayer, EigenbasisKroneckerFactored):
    r"""EKFAC of a 2-D convolution (George et al. 2018) in the eigenbasis of KFC's factors.

    .. math::

        \begin{aligned}
        \Omega &= \frac{1}{N|T|}\sum_{n,t}\bar p_{n,t}\bar p_{n,t}^\top,\quad
        \Gamma = \frac{1}{N|T|}\sum_{n,t} g_{n,t}g_{n,t}^\top,\quad
        DW_n = \sum_t \bar p_{n,t}\, g_{n,t}^\top,\\
        s^*_{ij} &= \frac1N \sum_n \big(Q_\Omega^\top DW_n\, Q_\Gamma\big)_{ij}^2
        \end{aligned}

    The per-example gradient is summed over the locations before it is squared (the
    location-summed gradient of example :math:`n`), so :math:`s^* = \operatorname{diag}
    (Q^\top F Q)` for the exact block :math:`F` of ``Conv2DFull``; the scale is 1 (K-FAC's
    :math:`|T|` is part of :math:`s^*`).  The basis is KFC's for every ``weight_sharing``.
    Layer parameters as ``Conv2DTwoKroneckerFactored``.
    """

    def _batch_statistics(self, xp, data, batch_size):
        x, g = data["inputs"], data["outputs_grad"]
        grads = self._per_example_grads(xp, x, g)
        if self.symmetrize:
            fa = factors.conv_input_kronecker_factor(x, self.kernel_shape, self.padding,
                                                     self.strides, self.dilation_rate,
                                                     self.data_format, self.has_bias)
            fg = factors.conv_output_kronecker_factor(g, self.data_format)
        else:
            gl = self._grads_channels_last(xp, g)
            fa = self._second_moment(xp, self._patches(x))
            fg = self._second_moment(xp, xp.reshape(gl, (-1, gl.shape[-1])))
        return fa, fg, self._second_moment(xp, grads)


register_layer_block("dense", "ekfac", DenseEKFAC)
register_layer_block("conv2d", "ekfac", Conv2DEKFAC)
