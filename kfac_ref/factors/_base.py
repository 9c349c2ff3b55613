r"""Stateful machinery shared by the TF K-FAC factor classes (immutable states).

A TF K-FAC ``FisherFactor`` owns a moving average of a curvature statistic and, for dense
factors, cached functions of it (matrix powers, Cholesky factors, their inverses) that are
refreshed only when the inverse update is run.  Here the same life cycle is expressed with
immutable objects: every "update" returns a new factor and leaves the old one untouched.

.. math::

    \begin{aligned}
    \text{new\_cov} &= \frac{1}{n_{\text{towers}}}
        \sum_{\text{sources } s} \sum_{\text{towers } t} C(s, t), \\
    S &\leftarrow \delta S + w\,\text{new\_cov}, \qquad W \leftarrow \delta W + w, \\
    \text{cov} &= S / W \quad (\text{zero-debiased}).
    \end{aligned}

Life cycle (TF name → kfac_ref method)

* ``make_covariance_update_op(ema_decay, ema_weight)`` → :meth:`FisherFactor.update_cov`
  (data are passed in, as ``sources × towers`` nested sequences);
* ``register_matpower / register_cholesky / register_cholesky_inverse`` → same names, each
  returning a new factor;
* ``make_inverse_update_ops()`` → :meth:`DenseSquareMatrixFactor.update_inverses`;
* ``get_matpower / get_cholesky / get_cholesky_inverse / get_eigendecomp`` → same names.

Cached inverses are *stale*: they reflect the covariance at the last
:meth:`~DenseSquareMatrixFactor.update_inverses`, exactly as TF's inverse variables do, and
are zero before the first one (TF's ``INIT_INVERSES_AT_ZERO``).  ``get_matpower(1, λ)`` and
:meth:`~DenseSquareMatrixFactor.get_eigendecomp` are always fresh.

Damping is a non-negative Python number or a zero-argument callable returning one (TF's
``damping_func``); registrations are keyed by the number's value or by the callable's
identity, and callables are evaluated at :meth:`~DenseSquareMatrixFactor.update_inverses`.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Sequence

from .._backend import (
    KFACTypeError,
    KFACValueError,
    check_array,
    check_bool,
    check_int,
    check_namespace_has,
    check_scalar,
    check_scalars_with,
    checks_values,
    describe,
    errors_named,
    eye_like,
    is_array,
    namespace_of,
    ones_like_shape,
    zeros_like_shape,
)
from .._support import capabilities
from ..averaging import MovingAverageVariable
from ..linalg import (
    clipped_eigh,
    damped_cholesky,
    damped_cholesky_inverse,
    damped_inverse,
    damped_matpower,
)

EIGENVALUE_DECOMPOSITION_THRESHOLD = 4
"""TF K-FAC master's threshold: with at least this many registered inverses (or any other
registered power) the inverses come from one eigendecomposition (TF K-FAC's older
``tf.contrib.kfac`` used 2)."""

EIGENVALUE_CLIPPING_THRESHOLD = 0.0
"""Eigenvalues below this are raised to it before powers are taken (TF K-FAC's value)."""


# --------------------------------------------------------------------------------------
# Nested data helpers
# --------------------------------------------------------------------------------------
def as_towers(func, name, value):
    """``value`` as a tuple over towers: a bare array is one tower."""
    if is_array(value):
        return (value,)
    if isinstance(value, Sequence) and not isinstance(value, str) and value and all(
        is_array(v) for v in value
    ):
        return tuple(value)
    raise KFACTypeError(
        f"{func}: {name} must be an array or a non-empty sequence of arrays (one per tower); "
        f"got {describe(value)}."
    )


def as_sources_towers(func, name, value):
    """``value`` as a tuple (sources) of tuples (towers).

    A bare array is one source on one tower.  Otherwise the nesting must be explicit, as in
    TF K-FAC: a sequence over sources of sequences over towers.  A flat sequence of arrays is
    rejected because it could mean either.
    """
    if is_array(value):
        return ((value,),)
    if isinstance(value, Sequence) and not isinstance(value, str) and value:
        out = []
        for src in value:
            if isinstance(src, Sequence) and not isinstance(src, str) and src and all(
                is_array(v) for v in src
            ):
                out.append(tuple(src))
            else:
                break
        else:
            n_towers = {len(s) for s in out}
            if len(n_towers) != 1:
                raise KFACValueError(
                    f"{func}: every source in {name} must have the same number of towers; got "
                    f"{[len(s) for s in out]}."
                )
            return tuple(out)
    raise KFACTypeError(
        f"{func}: {name} must be an array or a sequence (sources) of sequences (towers) of "
        f"arrays, e.g. [[g]] for one source on one tower; got {describe(value)}."
    )


def input_towers_and_sources(func, inputs, outputs_grads):
    """``(towers, sources)`` of a two-argument factor's ``update_cov``: the input towers and,
    per source, one output-gradient array per input tower."""
    towers = as_towers(func, "inputs", inputs)
    sources = as_sources_towers(func, "outputs_grads", outputs_grads)
    if len(sources[0]) != len(towers):
        raise KFACValueError(
            f"{func}: outputs_grads must have one array per input tower ({len(towers)}); "
            f"got {len(sources[0])}."
        )
    return towers, sources


def per_source_and_tower(sources, towers, pair_stat):
    """A two-argument factor's contributions: per source, ``pair_stat(x, g)`` for each input
    tower :math:`x` and that source's output gradient :math:`g` on it."""
    return tuple(tuple(pair_stat(x, g) for x, g in zip(towers, src, strict=True))
                 for src in sources)


def check_dense_rows(func, name, tensor):
    """A dense layer's input ``[N, d]`` (``[T, N, d]`` for several uses) with at least one
    row; returns its namespace."""
    xp = namespace_of(func, **{name: tensor})
    check_array(func, name, tensor, ndim=(2, 3), layout="[N, d] or [T, N, d]")
    if math.prod(tensor.shape[:-1]) == 0:
        raise KFACValueError(f"{func}: {name} must have at least one row; got shape "
                             f"{tuple(tensor.shape)}.")
    return xp


def check_equal_batches(func, name, arrays, axis=0):
    """All towers/sources must share the batch size (TF's ``check_partial_batch_sizes``:
    per-tower statistics are averaged, which is only right for equal tower batches)."""
    sizes = [a.shape[axis] if 0 <= axis < a.ndim else None for a in arrays]
    if len(set(sizes)) > 1:
        raise KFACValueError(
            f"{func}: all arrays in {name} must have the same batch size (towers are averaged); "
            f"got sizes {sizes}."
        )


# --------------------------------------------------------------------------------------
# Damping registrations (internal API of the factor modules)
# --------------------------------------------------------------------------------------
def damping_key(func, damping):
    """Registration key of a damping: ``("value", λ)`` for a checked non-negative number,
    ``("func", f)`` for a zero-argument callable (keyed by identity)."""
    if callable(damping):
        return ("func", damping)
    if is_array(damping):  # a key is compared by value, and an array's == is elementwise
        raise KFACTypeError(
            f"{func}: damping must be a real number or a zero-argument callable; got "
            f"{describe(damping)}. A registered damping is a key: give an array as a "
            f"callable (lambda: damping), evaluated at each use.")
    v = check_scalar(func, "damping", damping, nonnegative=True)
    return ("value", v)


def damping_value(func, key, cov):
    """The damping of a registration key (a callable is evaluated and checked now), checked
    against the covariance it is added to (a 0-D array: one namespace, device, precision)."""
    kind, d = key
    if kind == "func":
        return check_scalar(func, "damping_func()", d(), nonnegative=True, like={"cov": cov})
    check_scalars_with(func, {"cov": cov}, damping=d)
    return d


def exp_value(func, exp):
    """A checked real exponent."""
    return check_scalar(func, "exp", exp)


# --------------------------------------------------------------------------------------
# Base classes
# --------------------------------------------------------------------------------------
@capabilities(dask="yes")
class FisherFactor:
    r"""Base of every factor: the moving average of a batch statistic.

    .. math::

        \begin{aligned}
        \text{new\_cov} &= \frac{1}{n_{\text{towers}}} \sum_{s} \sum_{t} C(s, t), \\
        \text{cov} &= \frac{\sum_k \delta^{K-k} w_k\, \text{new\_cov}_k}
                           {\sum_k \delta^{K-k} w_k} \quad (\text{zero\_debias}),
        \end{aligned}

    i.e. statistics of different *sources* (e.g. several sampled targets) are summed and
    those of different *towers* (data shards) are averaged, then fed to
    :class:`kfac_ref.averaging.MovingAverageVariable`.  After two updates with statistics
    :math:`c_1, c_2`, decay :math:`d` and weight 1 the value is
    :math:`(d\,c_1 + c_2)/(d + 1)`.

    Objects are immutable: every method that "changes" a factor returns a new one.

    Parameters
    ----------
    zero_debias : bool
        TF's ``ZERO_DEBIAS`` (default True).
    init_covariances_at_zero : bool
        TF's ``INIT_COVARIANCES_AT_ZERO`` (default True).  ``False`` starts the average at
        the identity (dense factors) or at ones (diagonal factors), which decays as
        :math:`\delta^k S_0`; it requires ``zero_debias=False``.

    Raises
    ------
    KFACValueError
        Reading :attr:`cov` before the first :meth:`update_cov`; an identity start with
        zero-debiasing.

    References
    ----------
    TF K-FAC ``fisher_factors.FisherFactor``.
    """

    _cov_kind = "dense"

    def __init__(self, *, zero_debias=True, init_covariances_at_zero=True):
        func = type(self).__name__
        zero_debias = check_bool(func, "zero_debias", zero_debias)
        init_at_zero = check_bool(func, "init_covariances_at_zero", init_covariances_at_zero)
        if zero_debias and not init_at_zero:
            raise KFACValueError(
                f"{func}: init_covariances_at_zero must be True when zero_debias=True (the "
                "debiased value ignores the start only if it is zero); got False."
            )
        self._set(_cov_avg=None, zero_debias=zero_debias,
                  init_covariances_at_zero=init_at_zero)

    # -- immutability ------------------------------------------------------------------
    def _set(self, **attrs):
        for k, v in attrs.items():
            object.__setattr__(self, k, v)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable; methods return new objects.")

    def _evolve(self, **changes):
        new = copy.copy(self)
        new._set(**changes)
        return new

    @property
    def name(self):
        """The class name (TF's variable scope has no meaning here)."""
        return type(self).__name__

    # -- statistics --------------------------------------------------------------------
    def _contributions(self, *data, **kwargs):  # pragma: no cover - abstract
        """Return a nested tuple ``[source][tower]`` of batch statistics."""
        raise NotImplementedError

    def compute_new_cov(self, *data, **kwargs):
        r"""The batch statistic: sources summed, towers averaged (TF's
        ``_compute_total_new_cov``).

        .. math:: \frac{1}{n_{\text{towers}}} \sum_s \sum_t C(s, t)
        """
        contribs = self._contributions(*data, **kwargs)
        n_towers = len(contribs[0])
        total = None
        for src in contribs:
            for c in src:
                total = c if total is None else total + c
        return total / float(n_towers)

    def update_cov(self, *data, ema_decay, ema_weight=1.0, **kwargs):
        r"""Return the factor after one moving-average update with the batch statistic.

        .. math::

            S \leftarrow \delta S + w\,\text{new\_cov}, \quad W \leftarrow \delta W + w .

        Parameters
        ----------
        *data
            The factor's data (see the subclass), nested ``sources × towers`` where TF does.
        ema_decay : float
            :math:`\delta \ge 0`.
        ema_weight : float
            :math:`w \ge 0`; TF K-FAC's estimator passes 1 (``tf.contrib.kfac``'s factor used
            :math:`1 - \delta`; with zero-debiasing both give the same value).
        """
        new_cov = self.compute_new_cov(*data, **kwargs)
        avg = self._cov_avg
        if avg is None:
            avg = self._fresh_average(new_cov)
        return self._evolve(_cov_avg=avg.update(new_cov, ema_decay, ema_weight))

    def _fresh_average(self, like):
        if self.init_covariances_at_zero:
            return MovingAverageVariable.zeros_like(like, zero_debias=self.zero_debias)
        if self._cov_kind == "dense":
            start = eye_like(like, like.shape[0])
        else:
            start = ones_like_shape(like, like.shape)
        return MovingAverageVariable.zeros_like(like, zero_debias=False, initial_value=start)

    @property
    def cov(self):
        """The current (moving-average) statistic."""
        return self._average_value(
            "cov", self._cov_avg, "the factor must have been updated at least once (call "
            "update_cov); got a factor with no statistics")

    def _average_value(self, attribute, average, missing):
        """The value of the moving average behind ``attribute``; ``missing`` explains a
        ``None`` average (no statistics yet)."""
        if average is None:
            raise KFACValueError(f"{self.name}.{attribute}: {missing}.")
        return average.value

    def get_cov(self):
        """Alias of :attr:`cov` (TF's ``get_cov``)."""
        return self.cov

    @property
    def num_updates_seen(self):
        """Whether statistics exist (``False`` before the first :meth:`update_cov`)."""
        return self._cov_avg is not None


_EIGH_WHY = ("an eigendecomposition: a registered power other than -1, or at least "
             "eigenvalue_decomposition_threshold inverses")


@capabilities(dask="yes")
class DenseSquareMatrixFactor(FisherFactor):
    r"""A factor stored as a dense symmetric PSD matrix, with cached damped functions of it.

    .. math::

        \begin{aligned}
        (C + \lambda I)^{p} &= V\,\mathrm{diag}\big((\max(e, c) + \lambda)^{p}\big)\,V^\top
            && \text{(eigen path)}, \\
        (C + \lambda I)^{-1} &= L^{-\top} L^{-1} && \text{(Cholesky path)},
        \end{aligned}

    with :math:`C = V \mathrm{diag}(e) V^\top` and clipping threshold :math:`c`.

    **Eigendecomposition rule** (TF K-FAC): the eigen path is used when any power other
    than :math:`-1` is registered, or when at least ``eigenvalue_decomposition_threshold``
    inverses are registered (4 in TF master, 2 in ``tf.contrib.kfac``), or when a subclass
    needs the eigendecomposition anyway (the series quantities of
    :class:`~kfac_ref.factors.FullyConnectedMultiKF`); otherwise each inverse is a Cholesky
    solve.  Cholesky factors and their inverses are always computed by Cholesky.

    Parameters
    ----------
    zero_debias, init_covariances_at_zero : bool
        See :class:`FisherFactor`.
    eigenvalue_decomposition_threshold : int
    eigenvalue_clipping_threshold : float

    Raises
    ------
    KFACValueError
        Asking for a quantity that was not registered; negative damping.

    References
    ----------
    TF K-FAC ``fisher_factors.DenseSquareMatrixFactor``.
    """

    def __init__(self, *, zero_debias=True, init_covariances_at_zero=True,
                 eigenvalue_decomposition_threshold=EIGENVALUE_DECOMPOSITION_THRESHOLD,
                 eigenvalue_clipping_threshold=EIGENVALUE_CLIPPING_THRESHOLD):
        super().__init__(zero_debias=zero_debias,
                         init_covariances_at_zero=init_covariances_at_zero)
        func = type(self).__name__
        self._set(
            eigenvalue_decomposition_threshold=check_int(
                func, "eigenvalue_decomposition_threshold", eigenvalue_decomposition_threshold,
                minimum=1),
            eigenvalue_clipping_threshold=check_scalar(
                func, "eigenvalue_clipping_threshold", eigenvalue_clipping_threshold,
                nonnegative=True),
            _matpower_regs=(),  # ((exp, damping_key), ...) in registration order
            _cholesky_regs=(),
            _cholesky_inverse_regs=(),
            _cache={},  # (kind, exp, damping_key) -> array
        )

    # -- registrations -----------------------------------------------------------------
    def _registered(self, field, key):
        """This factor when ``key`` is in its registration tuple ``field`` already, else a
        copy with ``key`` appended (registration order is kept)."""
        regs = getattr(self, field)
        if key in regs:
            return self
        return self._evolve(**{field: (*regs, key)})

    def register_matpower(self, exp, damping):
        r"""Return a factor that also maintains :math:`(C + \lambda I)^{p}`.

        ``exp == 1`` is not cached (it is served fresh), as in TF.
        """
        func = f"{self.name}.register_matpower"
        exp = exp_value(func, exp)
        if exp == 1.0:
            return self
        key = (exp, damping_key(func, damping))
        return self._registered("_matpower_regs", key)

    def register_inverse(self, damping):
        r"""``register_matpower(-1, damping)``: :math:`(C + \lambda I)^{-1}`."""
        return self.register_matpower(-1, damping)

    def register_cholesky(self, damping):
        r"""Return a factor that also maintains :math:`L`, :math:`L L^\top = C + \lambda I`."""
        key = damping_key(f"{self.name}.register_cholesky", damping)
        return self._registered("_cholesky_regs", key)

    def register_cholesky_inverse(self, damping):
        r"""Return a factor that also maintains :math:`L^{-1}`."""
        key = damping_key(f"{self.name}.register_cholesky_inverse", damping)
        return self._registered("_cholesky_inverse_regs", key)

    # -- inverse update ------------------------------------------------------------------
    @property
    def _needs_eigendecomp(self):
        return False

    @property
    def uses_eigendecomposition(self):
        """Whether :meth:`update_inverses` takes the eigen path (TF's ``use_eig``)."""
        num_inverses = sum(1 for exp, _ in self._matpower_regs if exp == -1.0)
        other = len(self._matpower_regs) - num_inverses
        return (self._needs_eigendecomp or other >= 1
                or num_inverses >= self.eigenvalue_decomposition_threshold)

    def _inverse_cache(self):
        func = f"{self.name}.update_inverses"
        cov = self.cov  # the factor's own statistic: already checked, kernels only
        # the constructor's clipping threshold (a number, or a 0-D array like cov)
        xp = namespace_of(func, cov=cov,
                          eigenvalue_clipping_threshold=self.eigenvalue_clipping_threshold)
        if self.uses_eigendecomposition:
            check_namespace_has(func, "cov", cov, "linalg.eigh", _EIGH_WHY)
        cache = {}
        with errors_named(func):
            self._fill_inverse_cache(xp, cov, cache, func)
        return cache

    def _fill_inverse_cache(self, xp, cov, cache, func):
        if self.uses_eigendecomposition:
            for exp, key in self._matpower_regs:
                cache[("matpower", exp, key)] = damped_matpower.kernel(
                    xp, cov, exp, damping_value(func, key, cov),
                    self.eigenvalue_clipping_threshold)
        else:
            for exp, key in self._matpower_regs:
                cache[("matpower", exp, key)] = damped_inverse.kernel(
                    xp, cov, damping_value(func, key, cov))
        for key in self._cholesky_regs:
            cache[("cholesky", None, key)] = damped_cholesky.kernel(
                xp, cov, damping_value(func, key, cov))
        for key in self._cholesky_inverse_regs:
            cache[("cholesky_inverse", None, key)] = damped_cholesky_inverse.kernel(
                xp, cov, damping_value(func, key, cov))

    def update_inverses(self):
        r"""Return a factor whose cached quantities are recomputed from the current
        :attr:`cov` (TF's ``make_inverse_update_ops``).

        .. math::

            \{(C + \lambda I)^{p},\ L_\lambda,\ L_\lambda^{-1}\}
            \ \text{for every registered } (p, \lambda).
        """
        return self._evolve(_cache=self._inverse_cache())

    make_inverse_update_ops = update_inverses

    # -- getters -------------------------------------------------------------------------
    def _cached(self, func, kind, exp, key, regs, reg_key):
        if reg_key not in regs:
            raise KFACValueError(
                f"{func}: the quantity must be registered before use (call the matching "
                f"register_* method); got an unregistered damping {key[1]!r}"
                + ("" if exp is None else f" and exponent {exp}") + "."
            )
        value = self._cache.get((kind, exp, key))
        if value is None:  # registered, never computed: TF initialises inverses at zero
            cov = self.cov
            return zeros_like_shape(cov, cov.shape)
        return value

    def get_matpower(self, exp, damping):
        r""":math:`(C + \lambda I)^{p}`: fresh for :math:`p = 1`, else the cached (possibly
        stale) value of the last :meth:`update_inverses`."""
        func = f"{self.name}.get_matpower"
        exp = exp_value(func, exp)
        key = damping_key(func, damping)
        if exp == 1.0:
            cov = self.cov
            return cov + damping_value(func, key, cov) * eye_like(cov, cov.shape[0])
        return self._cached(func, "matpower", exp, key, self._matpower_regs, (exp, key))

    def get_inverse(self, damping):
        r"""The cached :math:`(C + \lambda I)^{-1}`."""
        return self.get_matpower(-1, damping)

    def get_cholesky(self, damping):
        r"""The cached lower Cholesky factor of :math:`C + \lambda I`."""
        func = f"{self.name}.get_cholesky"
        key = damping_key(func, damping)
        return self._cached(func, "cholesky", None, key, self._cholesky_regs, key)

    def get_cholesky_inverse(self, damping):
        r"""The cached inverse of the lower Cholesky factor of :math:`C + \lambda I`."""
        func = f"{self.name}.get_cholesky_inverse"
        key = damping_key(func, damping)
        return self._cached(func, "cholesky_inverse", None, key, self._cholesky_inverse_regs,
                            key)

    def get_eigendecomp(self):
        r"""Fresh clipped eigendecomposition :math:`(\max(e, c), V)` of the current
        :attr:`cov` (TF computes it from the current covariance, never cached)."""
        func = f"{self.name}.get_eigendecomp"
        cov = self.cov
        xp = namespace_of(func, cov=cov)
        check_namespace_has(func, "cov", cov, "linalg.eigh", "an eigendecomposition")
        return clipped_eigh.kernel(xp, cov, self.eigenvalue_clipping_threshold)


@capabilities(dask="yes")
class DiagonalFactor(FisherFactor):
    r"""A factor stored by its diagonal (in the parameter's shape).

    .. math::

        \begin{aligned}
        (D + \lambda I)^{p} &= \mathrm{diag}\big((d + \lambda)^{p}\big), \\
        \text{Cholesky} &: p = \tfrac12, \qquad \text{Cholesky inverse}: p = -\tfrac12 .
        \end{aligned}

    Nothing is cached: every power is computed from the current diagonal (TF's
    ``DiagonalFactor``), so the ``register_*`` methods and :meth:`update_inverses` return the
    factor unchanged.  Results have the shape of :attr:`cov`; flatten row-major for the
    parameter vector order.

    Raises
    ------
    KFACValueError
        A negative power of a diagonal with a zero (or negative) damped entry.

    References
    ----------
    TF K-FAC ``fisher_factors.DiagonalFactor``.
    """

    _cov_kind = "diagonal"

    def register_matpower(self, exp, damping):
        """No-op (diagonal powers are served fresh)."""
        exp_value(f"{self.name}.register_matpower", exp)
        damping_key(f"{self.name}.register_matpower", damping)
        return self

    def register_inverse(self, damping):
        """No-op."""
        return self.register_matpower(-1, damping)

    def register_cholesky(self, damping):
        """No-op."""
        damping_key(f"{self.name}.register_cholesky", damping)
        return self

    def register_cholesky_inverse(self, damping):
        """No-op."""
        damping_key(f"{self.name}.register_cholesky_inverse", damping)
        return self

    def update_inverses(self):
        """No-op (returns ``self``)."""
        return self

    make_inverse_update_ops = update_inverses

    def get_matpower(self, exp, damping):
        r""":math:`(d + \lambda)^{p}` elementwise, from the current diagonal."""
        func = f"{self.name}.get_matpower"
        exp = exp_value(func, exp)
        cov = self.cov
        xp = namespace_of(func, cov=cov)
        lam = damping_value(func, damping_key(func, damping), cov)
        damped = cov + lam
        # a value check: skipped with value checks off and for lazy arrays (NaN/Inf out)
        if (exp < 0 and math.prod(damped.shape) and checks_values(damped)
                and not bool(xp.min(damped) > 0)):
            raise KFACValueError(
                f"{func}: diagonal + damping must be positive for a negative exponent ({exp}); "
                f"its smallest entry is {float(xp.min(damped)):.3g}. Add damping."
            )
        return damped**exp

    def get_inverse(self, damping):
        r""":math:`(d + \lambda)^{-1}`."""
        return self.get_matpower(-1, damping)

    def get_cholesky(self, damping):
        r""":math:`(d + \lambda)^{1/2}`."""
        return self.get_matpower(0.5, damping)

    def get_cholesky_inverse(self, damping):
        r""":math:`(d + \lambda)^{-1/2}`."""
        return self.get_matpower(-0.5, damping)


def is_number(v):
    """True for real Python/NumPy numbers (not bool)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)

