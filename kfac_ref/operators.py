r"""Curvature as a linear operator on the array API, with a SciPy ``LinearOperator`` view.

.. math::

    \begin{aligned}
    M &= (sB + \lambda I)^{p} && \text{(a block)},\\
    M &= \mathrm{diag}\big((C_l + \lambda_l I)^{p}\big)_l && \text{(the block-diagonal
    estimator)},\\
    M &\in \{G, F, \mathrm{EF}, H\} && \text{(the exact curvature)},
    \end{aligned}

as :class:`CurvatureOperator`: ``shape``, ``dtype``, ``matvec``, ``rmatvec``, ``matmat``,
``to_dense``, ``to_scipy`` and the spectral quantities of :mod:`kfac_ref.spectral`.  The
products are the blocks' own (:meth:`kfac_ref.blocks.kfac_jax.CurvatureBlock.multiply_matpower`)
and the exact curvature's matrix-free products (:mod:`kfac_ref.curvature`); this
module only arranges them.  Peers: curvlinops' ``KFACLinearOperator``, ``EKFACLinearOperator``,
``GGNLinearOperator``; laplace-torch's ``Kron``/``KronDecomposed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np  # host side only: Rademacher draws (host_draw) and the SciPy view

from . import curvature as exact_curvature
from ._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_bool,
    check_int,
    check_option,
    check_rng,
    check_scalar,
    check_scalars_with,
    describe,
    device_of,
    errors_named,
    eye_like,
    host_draw,
    namespace_of,
    optional_linalg,
)
from ._support import capabilities
from .blocks.kfac_jax import (
    BlockState,
    CurvatureBlock,
    Diagonal,
    EigenbasisKroneckerFactored,
    Full,
    ScaledIdentity,
    TwoKroneckerFactored,
)
from .curvature import BlockDiagonalCurvature
from .linalg import power_of_eigenvalues
from .nn import Sequential
from .spectral import (
    hutchinson_trace,
    hutchpp_trace,
    kron_eigenvalues,
    kron_slogdet,
    kron_trace,
    slogdet_of_eigenvalues,
)

__all__ = ["CurvatureOperator", "EXACT_CURVATURES"]

EXACT_CURVATURES = ("ggn", "fisher", "empirical_fisher", "hessian")
"""The exact curvatures :meth:`CurvatureOperator.from_exact` wraps: the GGN, the Fisher, the
empirical Fisher (``"mean"`` normalisation) and the Hessian of the mean loss."""

# Families whose exact and approximate powers coincide and whose eigenvalues() is the
# spectrum of sB: (sB + λI)^p has the eigenvalues (μ + λ)^p.
_EIGENVALUE_FAMILIES = (Diagonal, Full, EigenbasisKroneckerFactored, ScaledIdentity)


class _BlockPart:
    """One block of an operator: the block, its state, the checked identity weight and the
    checked product options ``(power, exact_power, use_cached, norm_type)``, and its slice
    of the flat vector."""

    def __init__(self, block, state, weight, options, start):
        self.block, self.state, self.weight, self.options = block, state, weight, options
        self.start, self.stop = start, start + block.dim


@capabilities(dask="yes")
class CurvatureOperator:
    r"""A square curvature matrix :math:`M` (``[dim, dim]``) as a linear operator.

    .. math::

        v \mapsto Mv, \qquad v \mapsto M^\top v, \qquad X \mapsto MX, \qquad
        M = \big[M e_1, \dots, M e_{\dim}\big]

    Build it with :meth:`from_block` (a kfac-jax-named block and its state),
    :meth:`from_estimator` (a :class:`~kfac_ref.curvature.BlockDiagonalCurvature` and its
    state), :meth:`from_exact` (the exact GGN, Fisher, empirical Fisher or Hessian), or
    directly from a matrix-vector function.  Vectors are flat ``[dim]`` arrays in the
    canonical parameter order (the blocks' flat order: kernel row-major, bias last, layers in
    forward order).  Arguments are validated once per call; products keep the namespace,
    device and dtype of the operator (``like``).

    Parameters
    ----------
    matvec : callable
        ``v [dim] -> M v [dim]``.
    like : array
        Any array of the operator's namespace, device and floating dtype.
    dim : int
        :math:`\dim`.
    symmetric : bool
        Whether :math:`M = M^\top` (then ``rmatvec`` is ``matvec``).
    rmatvec : callable, optional
        ``v -> M^\top v``; required when ``symmetric`` is false.
    """

    def __init__(self, matvec, like, dim, *, symmetric=True, rmatvec=None):
        func = "CurvatureOperator"
        namespace_of(func, like=like)
        check_array(func, "like", like)
        if not callable(matvec):
            raise KFACTypeError(f"{func}: matvec must be a callable v [dim] -> M v [dim]; got "
                                f"{describe(matvec)}.")
        symmetric = check_bool(func, "symmetric", symmetric)
        if rmatvec is not None and not callable(rmatvec):
            raise KFACTypeError(f"{func}: rmatvec must be a callable or None; got "
                                f"{describe(rmatvec)}.")
        if not symmetric and rmatvec is None:
            raise KFACValueError(f"{func}: rmatvec must be given for a non-symmetric operator; "
                                 f"got None.")
        self._setup(like, check_int(func, "dim", dim, minimum=1), symmetric)
        self._matvec_fn, self._rmatvec_fn = matvec, rmatvec

    def _setup(self, like, dim, symmetric):
        self._xp = namespace_of("CurvatureOperator", like=like)
        self._like = self._xp.reshape(like, (-1,))[:0]
        self._dim, self._symmetric = dim, symmetric
        self._parts = None
        self._matvec_fn = self._rmatvec_fn = None

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def from_block(cls, block, state, identity_weight=0.0, *, power=1.0, exact_power=True,
                   norm_to_scale_identity_weight=None):
        r"""The operator :math:`(sB + \lambda I)^{p}` of one kfac-jax-named block.

        .. math:: M v = \texttt{block.multiply\_matpower}(\text{state}, v, w, p,
                  \texttt{exact\_power})

        ``identity_weight`` :math:`w` (times the block's norm with
        ``norm_to_scale_identity_weight``,
        :meth:`~kfac_ref.blocks.kfac_jax.CurvatureBlock.effective_identity_weight`),
        ``power`` and ``exact_power`` as the block's
        :meth:`~kfac_ref.blocks.kfac_jax.CurvatureBlock.multiply_matpower`; the products are
        that method's, on the statistics of ``state`` (not a cache).
        """
        func = "CurvatureOperator.from_block"
        part = _make_part(func, block, state, identity_weight, power, exact_power,
                          norm_to_scale_identity_weight, 0)
        op = cls.__new__(cls)
        op._setup(state.like, block.dim, True)
        op._parts = (part,)
        return op

    @classmethod
    def from_estimator(cls, estimator, state, identity_weight=0.0, *, power=1.0,
                       exact_power=True, norm_to_scale_identity_weight_per_block=None):
        r"""The operator :math:`\mathrm{diag}\big((C_l + \lambda_l I)^{p}\big)_l` of a
        :class:`~kfac_ref.curvature.BlockDiagonalCurvature` (after its ``init``).

        .. math:: (Mv)_l = (C_l + \lambda_l I)^{p} v_l

        ``identity_weight`` is a scalar or one value per block, as the estimator's
        :meth:`~kfac_ref.curvature.BlockDiagonalCurvature.multiply_matpower`; each block's
        products are the block's own.
        """
        func = "CurvatureOperator.from_estimator"
        if not isinstance(estimator, BlockDiagonalCurvature):
            raise KFACTypeError(f"{func}: estimator must be a kfac_ref.curvature."
                                f"BlockDiagonalCurvature; got {describe(estimator)}.")
        blocks = estimator.blocks
        states = getattr(state, "blocks_states", None)
        if not isinstance(states, tuple) or len(states) != len(blocks):
            raise KFACTypeError(f"{func}: state must be a BlockDiagonalState of the estimator "
                                f"({len(blocks)} blocks); got {describe(state)}.")
        if isinstance(identity_weight, Sequence) and not isinstance(identity_weight, str):
            if len(identity_weight) != len(blocks):
                raise KFACValueError(f"{func}: identity_weight must be a scalar or one value "
                                     f"per block ({len(blocks)}); got {len(identity_weight)}.")
            weights = tuple(identity_weight)
        else:
            weights = (identity_weight,) * len(blocks)
        slices = estimator.net.layer_slices()
        parts = tuple(
            _make_part(func, bl, st, w, power, exact_power,
                       norm_to_scale_identity_weight_per_block, slices[i].start)
            for bl, st, w, i in zip(blocks, states, weights, estimator.layer_indices,
                                    strict=True))
        namespace_of(func, **{f"state.blocks_states[{k}]": p.state.like
                              for k, p in enumerate(parts)})
        op = cls.__new__(cls)
        op._setup(parts[0].state.like, estimator.dim, True)
        op._parts = parts
        return op

    @classmethod
    def from_exact(cls, net, loss_fn, params, batch, curvature="ggn"):
        r"""The exact curvature of the mean loss, matrix-free.

        .. math::

            \begin{aligned}
            Gv &= \tfrac1N\textstyle\sum_n J_n^\top G_n J_n v, \quad
            Fv = \tfrac1N\textstyle\sum_n J_n^\top F_n J_n v,\\
            \mathrm{EF}\,v &= \tfrac1N\textstyle\sum_n \nabla\ell_n\nabla\ell_n^\top v, \quad
            Hv
            \end{aligned}

        (:func:`kfac_ref.curvature.ggn_vector_product`,
        :func:`~kfac_ref.curvature.fisher_vector_product`,
        :func:`~kfac_ref.curvature.empirical_fisher_vector_product`,
        :func:`~kfac_ref.curvature.hessian_vector_product`; every product validates its
        batch and runs its own forward pass).  ``curvature`` is one of
        :data:`EXACT_CURVATURES`.
        """
        func = "CurvatureOperator.from_exact"
        check_option(func, "curvature", curvature, EXACT_CURVATURES)
        if not isinstance(net, Sequential):
            raise KFACTypeError(f"{func}: net must be a kfac_ref.nn.Sequential; got "
                                f"{describe(net)}.")
        product = {"ggn": exact_curvature.ggn_vector_product,
                   "fisher": exact_curvature.fisher_vector_product,
                   "empirical_fisher": exact_curvature.empirical_fisher_vector_product,
                   "hessian": exact_curvature.hessian_vector_product}[curvature]
        arrays = [a for p in (params or ()) for a in p]
        if not arrays:
            raise KFACValueError(f"{func}: params must hold the network's parameter arrays; "
                                 f"got none.")
        net.check_params(func, params)

        def matvec(v):
            return product(net, loss_fn, params, batch, v)

        return cls(matvec, arrays[0], net.num_params, symmetric=True)

    # -- attributes -----------------------------------------------------------------------
    @property
    def shape(self):
        r"""``(dim, dim)``.

        .. math:: M \in \mathbb R^{\dim\times\dim}
        """
        return (self._dim, self._dim)

    @property
    def dtype(self):
        """The floating dtype of the operator's arrays (that of ``like``)."""
        return self._like.dtype

    @property
    def device(self):
        """The device of the operator's arrays."""
        return device_of(self._like)

    @property
    def symmetric(self):
        r"""Whether :math:`M = M^\top`."""
        return self._symmetric

    # -- products -------------------------------------------------------------------------
    def _check_vector(self, func, v, ndim):
        namespace_of(func, like=self._like, vector=v)
        shape = (self._dim,) if ndim == 1 else (self._dim, None)
        check_array(func, "vector" if ndim == 1 else "matrix", v, shape=shape,
                    layout="[dim]" if ndim == 1 else "[dim, k]")
        return v

    def _mv(self, func, v, transpose=False):
        """One product; ``func``: the public method that names a block's kernel error."""
        xp = self._xp
        if self._parts is None:
            fn = self._rmatvec_fn if transpose and not self._symmetric else self._matvec_fn
            out = fn(v)
            if tuple(getattr(out, "shape", ())) != (self._dim,):
                raise KFACValueError(f"CurvatureOperator: the matvec function must return an "
                                     f"array of shape ({self._dim},); got {describe(out)}.")
            # static checks only (one product per column: no host read per product)
            namespace_of("CurvatureOperator", like=self._like, **{"matvec's result": out})
            check_array("CurvatureOperator", "matvec's result", out, finite=False)
            return out
        outs = []
        with errors_named(func):
            for p in self._parts:
                outs.append(p.block.multiply_matpower_flat_kernel(
                    func, xp, p.state, v[p.start:p.stop], p.weight, *p.options))
        return outs[0] if len(outs) == 1 else xp.concat(outs)

    def _mm(self, func, x, transpose=False):
        cols = [self._mv(func, x[:, j], transpose) for j in range(x.shape[1])]
        return self._xp.stack(cols, axis=1)

    def _estimator_matmat(self, func):
        """The products a trace estimator takes: a user's matvec's results scanned once per
        product matrix for NaN/Inf (its per-product checks are static, see :meth:`_mv`);
        the blocks' own products as they are."""
        if self._parts is not None:
            return lambda x: self._mm(func, x)

        def scanned(x):
            return check_array(func, "matmat's result", self._mm(func, x))

        return scanned

    def matvec(self, vector):
        r""":math:`Mv` for a flat vector ``[dim]``.

        .. math:: v \mapsto M v
        """
        func = "CurvatureOperator.matvec"
        return self._mv(func, self._check_vector(func, vector, 1))

    def rmatvec(self, vector):
        r""":math:`M^\top v` (:math:`= Mv` for the symmetric curvature matrices).

        .. math:: v \mapsto M^\top v
        """
        func = "CurvatureOperator.rmatvec"
        return self._mv(func, self._check_vector(func, vector, 1), True)

    def matmat(self, matrix):
        r""":math:`MX` for ``X`` of shape ``[dim, k]`` (one product per column).

        .. math:: X \mapsto MX = [M x_1, \dots, M x_k]
        """
        func = "CurvatureOperator.matmat"
        return self._mm(func, self._check_vector(func, matrix, 2))

    def rmatmat(self, matrix):
        r""":math:`M^\top X` for ``X`` of shape ``[dim, k]``.

        .. math:: X \mapsto M^\top X
        """
        func = "CurvatureOperator.rmatmat"
        return self._mm(func, self._check_vector(func, matrix, 2), True)

    def __matmul__(self, other):
        if getattr(other, "ndim", None) == 1:
            return self.matvec(other)
        return self.matmat(other)

    def to_dense(self):
        r"""The dense matrix from the products with the unit vectors.

        .. math:: M = M I = [M e_1, \dots, M e_{\dim}]

        :math:`\dim` products: for checking and small problems.
        """
        return self._mm("CurvatureOperator.to_dense", eye_like(self._like, self._dim))

    def to_scipy(self):
        r"""A ``scipy.sparse.linalg.LinearOperator`` view (NumPy operators only).

        .. math:: \texttt{A @ v} = M v, \qquad \texttt{A.H @ v} = M^\top v

        SciPy is imported here (it is not a dependency of the rest of kfac_ref).  The view
        calls :meth:`matvec`/:meth:`rmatvec`/:meth:`matmat`, so it can be handed to
        ``scipy.sparse.linalg.cg``, ``eigsh`` or ``lsqr``.

        Raises
        ------
        KFACTypeError
            The operator's arrays are not NumPy arrays.
        """
        if not isinstance(self._like, np.ndarray):
            raise KFACTypeError(f"CurvatureOperator.to_scipy: the operator's arrays must be "
                                f"NumPy arrays for a SciPy LinearOperator; got "
                                f"{describe(self._like)}. Convert the state to NumPy first.")
        from scipy.sparse.linalg import LinearOperator

        def as_vector(v):
            return self.matvec(np.asarray(v, dtype=self.dtype).reshape(-1))

        def as_rvector(v):
            return self.rmatvec(np.asarray(v, dtype=self.dtype).reshape(-1))

        def as_matrix(x):
            return self.matmat(np.asarray(x, dtype=self.dtype))

        return LinearOperator(self.shape, matvec=as_vector, rmatvec=as_rvector,
                              matmat=as_matrix, dtype=self.dtype)

    # -- spectral quantities ------------------------------------------------------------------
    def _dense_eigenvalues(self, dense):
        xp = self._xp
        if not self._symmetric:
            raise KFACValueError("CurvatureOperator.eigenvalues: the operator must be "
                                 "symmetric for its eigenvalues; got symmetric=False.")
        return optional_linalg(xp, "eigvalsh")((dense + xp.matrix_transpose(dense)) / 2.0)

    def _part_eigenvalues(self, p):
        xp, block, state = self._xp, p.block, p.state
        power, exact, _, norm_type = p.options
        lam = block.effective_identity_weight(state, p.weight, norm_type)
        if isinstance(block, TwoKroneckerFactored):
            a, g = (f.value for f in state.statistics)
            ev = kron_eigenvalues.kernel(xp, a, g, lam, block.scale(state),
                                         _exact_damping(block, power, exact), block.norm_type,
                                         block.zero_factor_fallback,
                                         block.eigenvalue_clipping_threshold)
        elif isinstance(block, _EIGENVALUE_FAMILIES):
            ev = block.eigenvalues(state) + lam
        else:  # another family: the spectrum of its products (power included)
            return self._dense_eigenvalues(self._part_dense(p))
        with errors_named("CurvatureOperator.eigenvalues"):
            return power_of_eigenvalues(xp, ev, power)

    def _part_dense(self, p):
        eye = eye_like(self._like, p.stop - p.start)
        with errors_named("CurvatureOperator.to_dense"):
            cols = [p.block.multiply_matpower_flat_kernel(
                "CurvatureOperator.to_dense", self._xp, p.state, eye[:, j], p.weight,
                *p.options) for j in range(p.stop - p.start)]
        return self._xp.stack(cols, axis=1)

    def eigenvalues(self):
        r"""Eigenvalues of :math:`M`, block after block (not sorted across blocks).

        .. math::

            \begin{aligned}
            \operatorname{spec}(sA\otimes G + \lambda I)^{p}
            &= \{(s a_i\gamma_j + \lambda)^p\},\\
            \operatorname{spec}\big(s(A+\delta_A I)\otimes(G+\delta_G I)\big)^p
            &= \{s^p (a_i+\delta_A)^p(\gamma_j+\delta_G)^p\},\\
            \operatorname{spec}(sB+\lambda I)^p &= \{(\mu_k + \lambda)^p\}
            \end{aligned}

        Kronecker blocks from their factors' clipped eigenvalues
        (:func:`kfac_ref.spectral.kron_eigenvalues`, exact or factored damping as the
        product), diagonal, full, EKFAC and scaled-identity blocks from the block's
        :meth:`~kfac_ref.blocks.kfac_jax.CurvatureBlock.eigenvalues` :math:`\mu_k`; other
        operators (the exact curvature, a matvec function) from ``eigvalsh`` of
        :meth:`to_dense` (symmetric operators only).
        """
        # a namespace without linalg.eigh/eigvalsh (Dask's) is refused in this method's name
        with errors_named("CurvatureOperator.eigenvalues"):
            if self._parts is None:
                return self._dense_eigenvalues(self.to_dense())
            evs = [self._part_eigenvalues(p) for p in self._parts]
        return evs[0] if len(evs) == 1 else self._xp.concat(evs)

    def trace(self):
        r"""Trace of :math:`M`, summed over blocks.

        .. math::

            \operatorname{tr}(sA\otimes G + \lambda I) = s\operatorname{tr}A
            \operatorname{tr}G + \lambda\,d_A d_G, \qquad
            \operatorname{tr} M = \textstyle\sum_l \operatorname{tr} M_l

        Kronecker blocks at power 1 by the factor identity
        (:func:`kfac_ref.spectral.kron_trace`); every other block as the sum of its
        eigenvalues (:meth:`eigenvalues`); a matrix-free operator as
        :math:`\sum_i e_i^\top M e_i` (:math:`\dim` products; see
        :meth:`hutchinson_trace` and :meth:`hutchpp_trace` for estimates).
        """
        with errors_named("CurvatureOperator.trace"):
            return self._trace()

    def _trace(self):
        xp = self._xp
        if self._parts is None:
            return xp.sum(xp.linalg.diagonal(self.to_dense()))
        total = None
        for p in self._parts:
            power, exact, _, norm_type = p.options
            if isinstance(p.block, TwoKroneckerFactored) and power == 1.0:
                a, g = (f.value for f in p.state.statistics)
                lam = p.block.effective_identity_weight(p.state, p.weight, norm_type)
                t = kron_trace.kernel(xp, a, g, lam, p.block.scale(p.state),
                                      _exact_damping(p.block, power, exact), p.block.norm_type,
                                      p.block.zero_factor_fallback)
            else:
                t = xp.sum(self._part_eigenvalues(p))
            total = t if total is None else total + t
        return total

    def slogdet(self):
        r"""``(sign, log|det M|)``, combined over blocks.

        .. math::

            \begin{aligned}
            \log\det\big(s(A+\delta_A I)\otimes(G+\delta_G I)\big) &= d_A d_G\log s
            + d_G\log\det(A+\delta_A I)\\ &\quad + d_A\log\det(G+\delta_G I),\\
            \log|\det M| = \textstyle\sum_l \log|\det M_l|, &\quad
            \operatorname{sign}\det M = \textstyle\prod_l \operatorname{sign}\det M_l
            \end{aligned}

        Kronecker blocks at power 1 by :func:`kfac_ref.spectral.kron_slogdet`, every other
        block from its eigenvalues; a matrix-free operator from ``eigvalsh`` of
        :meth:`to_dense` (``slogdet`` of it when not symmetric).  A singular :math:`M` gives
        sign 0 and :math:`-\infty`, as :func:`numpy.linalg.slogdet`.
        """
        with errors_named("CurvatureOperator.slogdet"):
            return self._slogdet()

    def _slogdet(self):
        xp = self._xp
        if self._parts is None:
            dense = self.to_dense()
            if not self._symmetric:
                return tuple(optional_linalg(xp, "slogdet")(dense))
            return slogdet_of_eigenvalues(xp, self._dense_eigenvalues(dense))
        sign = logabs = None
        for p in self._parts:
            power, exact, _, norm_type = p.options
            if isinstance(p.block, TwoKroneckerFactored) and power == 1.0:
                a, g = (f.value for f in p.state.statistics)
                lam = p.block.effective_identity_weight(p.state, p.weight, norm_type)
                s, la = kron_slogdet.kernel(xp, a, g, lam, p.block.scale(p.state),
                                            _exact_damping(p.block, power, exact),
                                            p.block.norm_type, p.block.zero_factor_fallback,
                                            p.block.eigenvalue_clipping_threshold)
            else:
                s, la = slogdet_of_eigenvalues(xp, self._part_eigenvalues(p))
            sign = s if sign is None else sign * s
            logabs = la if logabs is None else logabs + la
        return sign, logabs

    def logdet(self):
        r""":math:`\log\det M` (NaN for a negative determinant, :math:`-\infty` for a
        singular :math:`M`), from :meth:`slogdet`.

        .. math:: \log\det M = \log|\det M| \quad (\det M > 0)
        """
        sign, logabs = self.slogdet()
        return self._xp.where(sign < 0, logabs * math.nan, logabs)

    def det(self):
        r""":math:`\det M = \text{sign}\cdot e^{\log|\det M|}` (may overflow: prefer
        :meth:`slogdet`).

        .. math:: \det M = \operatorname{sign} \cdot \exp(\log|\det M|)
        """
        sign, logabs = self.slogdet()
        return sign * self._xp.exp(logabs)

    def _rademacher(self, rng, columns):
        return host_draw(rng, self._like,
                         lambda r: r.choice(np.array([-1.0, 1.0]), size=(self._dim, columns)))

    def hutchinson_trace(self, num_queries, rng):
        r"""Hutchinson's estimate of :math:`\operatorname{tr}M` from ``num_queries``
        Rademacher probes drawn from ``rng`` (on the host, then moved to the device).

        .. math::

            \widehat{\operatorname{tr}} = \frac1m\sum_{k=1}^m z_k^\top M z_k, \qquad
            \operatorname{Var} = \frac2m\Big(\|M\|_F^2 - \sum_i M_{ii}^2\Big)

        (:func:`kfac_ref.spectral.hutchinson_trace`).
        """
        func = "CurvatureOperator.hutchinson_trace"
        m = check_int(func, "num_queries", num_queries, minimum=1)
        check_rng(func, "rng", rng)
        return hutchinson_trace.kernel(self._xp, self._estimator_matmat(func),
                                       self._rademacher(rng, m))

    def hutchpp_trace(self, num_queries, rng):
        r"""Hutch++ estimate of :math:`\operatorname{tr}M` (Meyer et al. 2021) with
        ``num_queries`` products: a sketch of :math:`k = \lfloor m/3\rfloor` Rademacher
        columns (drawn first), then :math:`m - 2k` Hutchinson probes, both from ``rng``.

        .. math::

            \widehat{\operatorname{tr}} = \operatorname{tr}(Q^\top M Q) + \frac{1}{m-2k}
            \operatorname{tr}\big(G^\top(I-QQ^\top)M(I-QQ^\top)G\big), \quad
            Q = \operatorname{qr}(MS)

        (:func:`kfac_ref.spectral.hutchpp_trace`); exact when :math:`\operatorname{rank}
        M \le k`.  The sketch needs :math:`k \le \dim`.
        """
        func = "CurvatureOperator.hutchpp_trace"
        m = check_int(func, "num_queries", num_queries, minimum=3)
        check_rng(func, "rng", rng)
        k = m // 3
        if k > self._dim:
            raise KFACValueError(f"{func}: num_queries must be at most 3·dim = {3 * self._dim} "
                                 f"(a sketch of at most dim columns); got {m}.")
        sketch = self._rademacher(rng, k)
        probes = self._rademacher(rng, m - 2 * k)
        return hutchpp_trace.kernel(self._xp, self._estimator_matmat(func), sketch, probes)


def _exact_damping(block, power, exact):
    """Whether a Kronecker block's product at ``power`` uses exact damping: exact powers,
    and the power one of a block with ``approx_power_one="exact"`` (the path rule of the
    blocks' Kronecker products)."""
    return exact or (power == 1.0 and block.approx_power_one == "exact")


def _make_part(func, block, state, identity_weight, power, exact_power, norm_type, start):
    if not isinstance(block, CurvatureBlock):
        raise KFACTypeError(f"{func}: block must be a kfac_ref.blocks.kfac_jax.CurvatureBlock; "
                            f"got {describe(block)}.")
    if not isinstance(state, BlockState):
        raise KFACTypeError(f"{func}: state must be a BlockState from {type(block).__name__}"
                            f".init; got {describe(state)}.")
    block.check_state_structure(func, state)
    namespace_of(func, **{"state.like": state.like})
    w = check_scalar(func, "identity_weight", identity_weight, nonnegative=True)
    options = block.check_product_options(func, power, exact_power, False, norm_type)
    check_scalars_with(func, {"state.like": state.like}, identity_weight=w, power=options[0])
    return _BlockPart(block, state, w, options, start)
