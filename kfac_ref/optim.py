r"""A reference K-FAC optimiser step: kfac-jax's and TF K-FAC's update rules as options.

One step at parameters :math:`\theta` on a mini-batch with mean loss :math:`h` and gradient
:math:`g = \nabla h(\theta)`, with a curvature estimate :math:`\hat C` (any estimator of
:mod:`kfac_ref.curvature`: block-diagonal K-FAC, or the exact Fisher/GGN) and damping
:math:`\lambda`:

.. math::

    \begin{aligned}
    p &= (\hat C + \lambda I)^{-1} g, \\
    \delta &= \begin{cases}
        -\eta\, v,\ \ v \leftarrow \mu v + \nu p & \text{regular momentum,}\\
        -\eta\,\nu\,(\hat C + \lambda I)^{-1} v,\ \ v \leftarrow \mu v + g
            & \texttt{adam}\text{ momentum (TF),}\\
        \alpha^* p + \mu^* \delta_{-1} & \text{quadratic model (kfac-jax adaptive,}\\
            & \quad\text{TF's } \texttt{qmodel}\text{),}
    \end{cases}\\
    \theta &\leftarrow \theta + \delta - \eta\,\omega_{wd}\,\theta,
    \end{aligned}

where :math:`\nu = \min\big(1, \sqrt{c / (\eta^2 p^\top g)}\big)` is the optional norm
(KL) constraint (computed from scaled vectors, without overflow) and :math:`(\alpha^*, \mu^*)`
minimise the exact quadratic model (:func:`quadratic_model`: the Jacobi-scaled 2×2 system,
its minimum-norm minimiser when it is singular — a previous update parallel to :math:`p`,
a zero gradient).  Every ``damping_adaptation_interval`` steps the damping follows
the Levenberg–Marquardt rule (:func:`adapt_damping`).

The pieces are public functions (:func:`preconditioned_direction`, :func:`quadratic_model`,
:func:`reduction_ratio`, :func:`adapt_damping`, :func:`norm_constraint_coefficient`); the
class :class:`KFACOptimizer` chains them with immutable states (:class:`OptimizerState`,
:class:`StepStats`): ``params, state = opt.step(state, params, batch, rng)``.

References: Martens & Grosse (2015), §6.4–6.5 and §7 (damping, the quadratic model,
:math:`\alpha^*`, :math:`\mu^*`); Ba, Grosse & Martens (2017), §5 (the norm constraint);
kfac-jax ``kfac_jax/_src/optimizer.py`` and TF K-FAC ``kfac/python/ops/optimizer.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ._backend import (
    KFACTypeError,
    KFACValueError,
    asarray_like,
    check_array,
    check_bool,
    check_int,
    check_option,
    check_rng,
    check_scalar,
    describe,
    errors_named,
    is_array,
    kernel_of,
    namespace_of,
    zeros_like_shape,
)
from ._pytrees import frozen, join, split, state_class
from ._support import capabilities

__all__ = [
    "MOMENTUM_TYPES",
    "DAMPING_RULES",
    "QUAD_MODEL_MATRICES",
    "preconditioned_direction",
    "quadratic_model",
    "reduction_ratio",
    "adapt_damping",
    "norm_constraint_coefficient",
    "OptimizerState",
    "StepStats",
    "KFACOptimizer",
]

MOMENTUM_TYPES = ("regular", "adam", "qmodel", "qmodel_fixedmu")
"""TF K-FAC's ``momentum_type`` values; ``"qmodel"`` is kfac-jax's
``use_adaptive_learning_rate=use_adaptive_momentum=True``, ``"qmodel_fixedmu"`` its adaptive
learning rate with a fixed momentum, ``"regular"`` with a constant learning rate its default
fixed-coefficient update."""

DAMPING_RULES = ("kfac_jax", "tf")
"""Levenberg–Marquardt variants of :func:`adapt_damping`."""

QUAD_MODEL_MATRICES = ("ggn", "fisher")
"""Exact curvature of the quadratic model: the GGN or the Fisher of the mini-batch."""


def _dot(xp, a, b):
    return xp.sum(a * b)


def _check_estimator(func, estimator):
    for m in ("init", "update_curvature_matrix_estimate", "update_cache", "multiply_matpower"):
        if not callable(getattr(estimator, m, None)):
            raise KFACTypeError(f"{func}: estimator must be a kfac_ref.curvature estimator "
                                f"(with {m}); got {describe(estimator)}.")
    return estimator


# ------------------------------------------------------------------------------------------
# the preconditioned direction
# ------------------------------------------------------------------------------------------
@capabilities(dask="yes")
def preconditioned_direction(estimator, estimator_state, grad, damping, exact_power=True,
                             use_cached=False):
    r"""The K-FAC (or exact natural-gradient / Gauss–Newton) direction.

    .. math:: d = -(\hat C + \lambda I)^{-1} \nabla h

    Parameters
    ----------
    estimator : kfac_ref.curvature estimator
        :class:`~kfac_ref.curvature.BlockDiagonalCurvature` (K-FAC: :math:`\hat C` block
        diagonal, Kronecker factored), :class:`~kfac_ref.curvature.ExplicitExactCurvature`
        (``fisher_exact`` / ``ggn_exact``: the exact matrix), or any object with their
        ``multiply_matpower``.
    estimator_state
        Its state (with a cache from ``update_cache`` when ``use_cached``).
    grad : array [P]
        :math:`\nabla h` (flat, canonical order), or a parameter structure.
    damping : float or 0-D array
        :math:`\lambda \ge 0`.
    exact_power : bool
        Exact :math:`(\hat C_l + \lambda I)^{-1}` per block (True) or the estimator's
        approximate damped power (False: factored π damping for Kronecker blocks).
    use_cached : bool
        Use the snapshot of the estimator's last ``update_cache``.

    Returns
    -------
    array [P] (or the structure of ``grad``)
    """
    func = "preconditioned_direction"
    _check_estimator(func, estimator)
    lam = check_scalar(func, "damping", damping, nonnegative=True)
    exact_power = check_bool(func, "exact_power", exact_power)
    use_cached = check_bool(func, "use_cached", use_cached)
    # the estimator's errors, under the user's call and the user's argument names; it checks
    # a 0-D damping against its state (namespace, device, precision), as it checks grad
    with errors_named(func, inner=True, arguments={"parameter_structured_vector": "grad",
                                                   "state": "estimator_state",
                                                   "identity_weight": "damping"}):
        out = estimator.multiply_matpower(estimator_state, grad, identity_weight=lam,
                                          power=-1.0, exact_power=exact_power,
                                          use_cached=use_cached)
    if isinstance(out, (tuple, list)):
        return tuple(tuple(-a for a in layer) for layer in out)
    return -out


# ------------------------------------------------------------------------------------------
# the quadratic model
# ------------------------------------------------------------------------------------------
def _check_fixed(func, fixed, k, like=None):
    if fixed is None:
        return (None,) * k
    if not isinstance(fixed, (tuple, list)) or len(fixed) != k:
        raise KFACValueError(f"{func}: fixed_coefficients must be a sequence of {k} numbers or "
                             f"None; got {describe(fixed)}.")
    return tuple(check_scalar(func, f"fixed_coefficients[{i}]", c, allow_none=True, like=like)
                 for i, c in enumerate(fixed))


@capabilities(jit="yes", dask="yes")
def quadratic_model(curvature_gram, gram, grad_products, damping, fixed_coefficients=None,
                    include_damping_in_change=False):
    r"""Optimal coefficients of the update vectors under the damped quadratic model.

    With update vectors :math:`V = [v_1, \dots, v_k]` (:math:`k \le 2`: the preconditioned
    gradient :math:`p` and the previous update :math:`\delta_{-1}`), an update
    :math:`\delta = V w` and the exact mini-batch curvature :math:`C` (GGN or Fisher),

    .. math::

        M(w) = \tfrac12 w^\top (A + \lambda D) w + b^\top w,

        A = V^\top C V, \qquad D = V^\top V, \qquad b = V^\top \nabla h,

        w^* = -(A + \lambda D)^{+} b,

        \text{for an invertible } k = 2 \text{ system:}\quad
        \begin{bmatrix}\alpha^*\\ \mu^*\end{bmatrix} = -
        \begin{bmatrix} p^\top C p + \lambda p^\top p & p^\top C\delta + \lambda p^\top\delta\\
        \delta^\top C p + \lambda \delta^\top p & \delta^\top C\delta + \lambda \delta^\top\delta
        \end{bmatrix}^{-1}
        \begin{bmatrix} \nabla h^\top p\\ \nabla h^\top \delta\end{bmatrix}.

    Only the symmetric parts of :math:`A` and :math:`D` enter :math:`M`, so the system is
    :math:`\bar M = \tfrac12 (A + A^\top) + \tfrac\lambda2 (D + D^\top)`.  It is solved
    after Jacobi (diagonal) scaling, for the minimum-norm solution in the scaled variables:

    .. math::

        s_i = \sqrt{|\bar M_{ii}|}\ \ (1 \text{ where } \bar M_{ii} = 0), \quad
        S = \operatorname{diag}(s), \quad \tilde M = S^{-1} \bar M S^{-1}, \quad
        \tilde b = S^{-1} b,

        \tilde M = \sum_{i=1}^{2} \sigma_i u_i u_i^\top, \qquad
        y = -\sum_{i:\ |\sigma_i| > \tau} \frac{u_i^\top \tilde b}{\sigma_i}\, u_i, \qquad
        \tau = 32\,\varepsilon \max_i |\sigma_i|, \qquad w^* = S^{-1} y,

    with the eigenpairs of the symmetric 2×2 matrix in closed form
    (:math:`\sigma_{1,2} = \tfrac12(\tilde M_{11} + \tilde M_{22}) \pm \sqrt{h^2 +
    \tilde M_{12}^2}`, :math:`h = \tfrac12(\tilde M_{11} - \tilde M_{22})`,
    :math:`u_1 = (\cos\phi, \sin\phi)`, :math:`u_2 = (-\sin\phi, \cos\phi)`,
    :math:`\phi = \tfrac12 \operatorname{atan2}(\tilde M_{12}, h)`) and :math:`\varepsilon`
    the machine epsilon of the dtype.  For a positive semi-definite :math:`\bar M`, the
    scaled matrix has a unit diagonal (or a zero row and column), so its entries are at
    most 1 and nothing overflows however large :math:`A, D, b` are (no determinant is
    formed); the solution is unchanged when the whole system is multiplied by a positive
    number, and the update :math:`\delta = V w^*` is unchanged when one update vector
    is.  When :math:`\bar M` is invertible (and not within :math:`\tau` of singular)
    this is :math:`-\bar M^{-1} b`, kfac-jax's and TF's solution.  When it is singular it is
    the minimum-norm minimiser, which covers:

    * the first step (no previous update: the last row and column of :math:`\bar M` and
      :math:`b_2` vanish), where it is kfac-jax's fallback (``psd_solve_maybe_zero_last_idx``:
      :math:`\mu^* = 0`, :math:`\alpha^* = -b_1 / \bar M_{11}`), and TF's;
    * a previous update parallel to :math:`p` (rank 1, e.g. any model with one parameter):
      every minimiser gives the same :math:`\delta`; the one returned splits it evenly,
      :math:`|\alpha^*| s_1 = |\mu^*| s_2`, where an unscaled solve returns NaN;
    * a zero gradient (:math:`p = 0`, :math:`b = 0`): :math:`w^* = 0` (no step);
    * a direction with no curvature at :math:`\lambda = 0` (:math:`\bar M_{ii} = 0`,
      :math:`b_i \ne 0`: the model is unbounded along it): that coefficient is 0, the
      least-squares solution of :math:`\bar M w = -b`.

    A fixed coefficient (``fixed_coefficients[i]`` not None) is kept and the other one
    minimises :math:`M` given it: :math:`w_j = -(b_j + \bar M_{ji} w_i) / \bar M_{jj}`
    (0 where :math:`\bar M_{jj} = 0`, the minimum-norm solution again); with :math:`k = 1`,
    :math:`w = -b_1 / \bar M_{11}` (0 where :math:`\bar M_{11} = 0`).

    The returned model change is the *undamped* model (kfac-jax
    ``include_damping_in_quad_change=False``, TF ``_INCLUDE_DAMPING_IN_QMODEL_CHANGE=False``)

    .. math:: \Delta M = \tfrac12 w^\top A w + b^\top w
        \quad (\tfrac12 w^\top (A + \lambda D) w + b^\top w \text{ when included}),

    evaluated in the scaled variables (:math:`\tfrac12 y^\top S^{-1} A S^{-1} y + \tilde
    b^\top y`, :math:`y = S w`) so that it overflows only where its value does.

    Parameters
    ----------
    curvature_gram : array [k, k]
        :math:`A = V^\top C V`.
    gram : array [k, k]
        :math:`D = V^\top V`.
    grad_products : array [k]
        :math:`b = V^\top \nabla h`.
    damping : float or 0-D array
        :math:`\lambda \ge 0`.
    fixed_coefficients : sequence of k (number or None), optional
        Coefficients not adapted (kfac-jax's ``(-learning_rate, momentum)``).
    include_damping_in_change : bool

    Returns
    -------
    (tuple of k 0-D arrays, 0-D array)
        :math:`w^*` (kfac-jax's learning rate is :math:`-w_1`, its momentum :math:`w_2`) and
        :math:`\Delta M`.  Finite whenever the inputs are (and :math:`\Delta M` is
        representable).
    """
    func = "quadratic_model"
    xp = namespace_of(func, curvature_gram=curvature_gram, gram=gram,
                      grad_products=grad_products)
    check_array(func, "grad_products", grad_products, ndim=1, finite=True, layout="[k]")
    k = int(grad_products.shape[0])
    if k not in (1, 2):
        raise KFACValueError(f"{func}: grad_products must hold 1 or 2 inner products (one per "
                             f"update vector); got {k}.")
    check_array(func, "curvature_gram", curvature_gram, shape=(k, k), finite=True,
                layout="[k, k]")
    check_array(func, "gram", gram, shape=(k, k), finite=True, layout="[k, k]")
    like = {"curvature_gram": curvature_gram}  # the system the 0-D scalars enter
    lam = check_scalar(func, "damping", damping, nonnegative=True, like=like)
    fixed = _check_fixed(func, fixed_coefficients, k, like)
    include = check_bool(func, "include_damping_in_change", include_damping_in_change)
    return quadratic_model.kernel(xp, curvature_gram, gram, grad_products, lam, fixed, include)


# eigenvalues of the Jacobi-scaled system below this multiple of eps times the largest count
# as zero: the scaled entries carry a few roundings each, so an exactly rank-1 system comes
# out with a smallest eigenvalue of a few eps, which must not be inverted
_QMODEL_RCOND = 32.0


def _sym(xp, x):
    return (x + xp.matrix_transpose(x)) / 2


def _min_norm_2x2(xp, mt, bt):
    """Minimum-norm solution y of ``mt y = -bt`` for a symmetric 2×2 ``mt`` whose entries are
    of order one (Jacobi-scaled), from its closed-form eigendecomposition."""
    p, q, r = mt[0, 0], mt[0, 1], mt[1, 1]
    h = (p - r) / 2
    mean = (p + r) / 2
    big = xp.maximum(xp.abs(h), xp.abs(q))
    big_safe = xp.where(big > 0, big, xp.ones_like(big))
    rad = big * xp.sqrt((h / big_safe) ** 2 + (q / big_safe) ** 2)  # hypot without overflow
    phi = xp.atan2(q, h) / 2
    c, s = xp.cos(phi), xp.sin(phi)
    sig1, sig2 = mean + rad, mean - rad
    tau = _QMODEL_RCOND * float(xp.finfo(bt.dtype).eps) * xp.maximum(xp.abs(sig1),
                                                                       xp.abs(sig2))

    def inv(sig):
        keep = xp.abs(sig) > tau
        return xp.where(keep, 1 / xp.where(keep, sig, xp.ones_like(sig)), xp.zeros_like(sig))

    c1 = -(c * bt[0] + s * bt[1]) * inv(sig1)   # -(u1 . bt) / sig1
    c2 = -(-s * bt[0] + c * bt[1]) * inv(sig2)  # -(u2 . bt) / sig2
    return c * c1 - s * c2, s * c1 + c * c2


@kernel_of(quadratic_model)
def _quadratic_model(xp, a, d, b, lam, fixed, include):
    k = int(b.shape[0])
    a = _sym(xp, a)
    m = a + lam * _sym(xp, d)
    zero = xp.zeros_like(b[0])

    # Jacobi scales; dividing by s_i then s_j (never by s_i s_j) keeps every step in range
    diag = xp.abs(xp.stack([m[i, i] for i in range(k)]))
    s = xp.where(diag > 0, xp.sqrt(diag), xp.ones_like(diag))

    def scaled(x):
        return (x / s[:, None]) / s[None, :]

    mt, bt = scaled(m), b / s

    def solve_1x1(num, den):  # -num / den, minimum norm (0) where den = 0
        nz = den != 0
        return xp.where(nz, -num / xp.where(nz, den, xp.ones_like(den)), zero)

    if all(f is not None for f in fixed):
        y = tuple(s[i] * (zero + fixed[i]) for i in range(k))
    elif k == 1:
        y = (solve_1x1(bt[0], mt[0, 0]),)
    elif fixed[0] is None and fixed[1] is None:
        y = _min_norm_2x2(xp, mt, bt)
    else:
        i = 0 if fixed[0] is None else 1  # the adapted one
        j = 1 - i
        yj = s[j] * (zero + fixed[j])
        yi = solve_1x1(bt[i] + mt[i, j] * yj, mt[i, i])
        y = (yi, yj) if i == 0 else (yj, yi)
    yv = xp.stack(list(y))
    # a fixed coefficient is returned as given, not round-tripped through s
    w = tuple(xp.asarray(zero + fixed[i] if fixed[i] is not None else yv[i] / s[i])
              for i in range(k))
    a_final = scaled(m if include else a)
    change = 0.5 * xp.sum(yv * (a_final @ yv)) + xp.sum(yv * bt)
    return w, change


# ------------------------------------------------------------------------------------------
# Levenberg–Marquardt damping
# ------------------------------------------------------------------------------------------
@capabilities(array_free=True, formula=True)
def reduction_ratio(loss, new_loss, quad_change):
    r"""Reduction ratio of the Levenberg–Marquardt rule.

    .. math:: \rho = \frac{h(\theta + \delta) - h(\theta)}{M(\delta) - M(0)}

    Returns
    -------
    0-D array (NaN or ±inf when the model change is zero, as in both peers)
    """
    func = "reduction_ratio"
    xp = namespace_of(func, loss=loss, new_loss=new_loss, quad_change=quad_change)
    for name, v in (("loss", loss), ("new_loss", new_loss), ("quad_change", quad_change)):
        check_array(func, name, v, ndim=0, layout="[]")
    return reduction_ratio.kernel(xp, loss, new_loss, quad_change)


@kernel_of(reduction_ratio)
def _reduction_ratio(xp, loss, new_loss, quad_change):
    safe = xp.where(quad_change == 0, xp.full_like(quad_change, math.nan), quad_change)
    return (new_loss - loss) / safe


@capabilities(dask="yes")
def adapt_damping(damping, loss, new_loss, quad_change, omega, lower_threshold=0.25,
                  upper_threshold=0.75, min_damping=1e-8, max_damping=None, rule="kfac_jax"):
    r"""One Levenberg–Marquardt update of the damping (Martens & Grosse 2015, §6.5).

    .. math::

        \rho = \frac{h(\theta+\delta) - h(\theta)}{M(\delta) - M(0)}, \qquad
        \lambda \leftarrow \begin{cases}
            \omega\,\lambda & \rho > \tfrac34 \\
            \lambda / \omega & \rho < \tfrac14 \\
            \lambda & \text{otherwise}
        \end{cases}, \qquad \omega = d^{\,T},

    with the decay :math:`d` and the adaptation interval :math:`T` (``omega`` is
    :math:`\omega = d^T`: kfac-jax's defaults :math:`d = 0.9, T = 5` give
    :math:`\omega = 0.9^5 \approx 0.59`; TF K-FAC's and the paper's :math:`d = 19/20, T = 5`
    give :math:`(19/20)^5 \approx 0.77`).  The thresholds :math:`\tfrac14, \tfrac34` are both
    peers' defaults.

    ``rule="kfac_jax"`` (``_compute_new_damping_and_rho``): a NaN :math:`\rho` counts as
    :math:`-100` (so the damping rises), the result is clipped to
    :math:`[\lambda_{\min}, \lambda_{\max}]`.  ``rule="tf"`` (``KfacOptimizer._update_damping``):
    the damping also falls when the loss fell while the model predicted a rise
    (:math:`h(\theta+\delta) < h(\theta)` and :math:`\Delta M > 0`), a NaN :math:`\rho` leaves
    it unchanged, and it is floored at :math:`\lambda_{\min}` (and capped at
    :math:`\lambda_{\max}` only when given).

    Parameters
    ----------
    damping, loss, new_loss, quad_change : 0-D arrays (``damping`` may be a float)
    omega : float
        :math:`\omega \in (0, 1]`.
    lower_threshold, upper_threshold : float
        :math:`0 \le \text{lower} \le \text{upper}`.
    min_damping : float
    max_damping : float or None
    rule : {"kfac_jax", "tf"}

    Returns
    -------
    (0-D array, 0-D array)
        The new damping and :math:`\rho`.
    """
    func = "adapt_damping"
    xp = namespace_of(func, loss=loss, new_loss=new_loss, quad_change=quad_change)
    for name, v in (("loss", loss), ("new_loss", new_loss), ("quad_change", quad_change)):
        check_array(func, name, v, ndim=0, layout="[]")
    like = {"loss": loss}  # the 0-D scalars meet rho, computed from the losses
    lam = check_scalar(func, "damping", damping, nonnegative=True, like=like)
    opts = _check_lm(func, omega, lower_threshold, upper_threshold, min_damping, max_damping,
                     rule, like=like)
    return adapt_damping.kernel(xp, asarray_like(lam, loss), loss, new_loss, quad_change, *opts)


_LM_NAMES = ("lower_threshold", "upper_threshold", "rule")
"""The names of :func:`adapt_damping`'s threshold and rule arguments."""

_OPTIMIZER_LM_NAMES = ("damping_lower_threshold", "damping_upper_threshold", "damping_rule")
"""The same arguments as :class:`KFACOptimizer`'s constructor names them."""


def _check_lm(func, omega, lower, upper, min_damping, max_damping, rule, names=_LM_NAMES,
              like=None):
    # ``names``: the caller's own names of (lower, upper, rule), so that a message names
    # the argument the user passed; ``like``: the arrays the 0-D scalars meet (None in
    # KFACOptimizer's constructor, which checks them at init and step)
    lower_name, upper_name, rule_name = names
    omega = check_scalar(func, "omega", omega, positive=True, like=like)
    if omega > 1:
        raise KFACValueError(f"{func}: omega must be in (0, 1]; got {omega}.")
    lower = check_scalar(func, lower_name, lower, like=like)
    upper = check_scalar(func, upper_name, upper, like=like)
    if not lower <= upper:
        raise KFACValueError(f"{func}: {lower_name} must not exceed {upper_name} "
                             f"({upper}); got {lower}.")
    min_damping = check_scalar(func, "min_damping", min_damping, nonnegative=True, like=like)
    max_damping = check_scalar(func, "max_damping", max_damping, positive=True, allow_none=True,
                               like=like)
    if max_damping is not None and max_damping < min_damping:
        raise KFACValueError(f"{func}: max_damping must be at least min_damping "
                             f"({min_damping}); got {max_damping}.")
    rule = check_option(func, rule_name, rule, DAMPING_RULES)
    return omega, lower, upper, min_damping, max_damping, rule


@kernel_of(adapt_damping)
def _adapt_damping(xp, lam, loss, new_loss, quad_change, omega, lower, upper, min_damping,
                   max_damping, rule):
    rho = reduction_ratio.kernel(xp, loss, new_loss, quad_change)
    if rule == "kfac_jax":
        r = xp.where(xp.isnan(rho), xp.full_like(rho, -100.0), rho)
        decrease, increase = r > upper, r < lower
    else:
        decrease = ((new_loss - loss < 0) & (quad_change > 0)) | (rho > upper)
        increase = rho < lower
    new = xp.where(decrease, lam * omega, xp.where(increase, lam / omega, lam))
    new = xp.maximum(new, _filled(xp, new, min_damping))
    if max_damping is not None:
        new = xp.minimum(new, _filled(xp, new, max_damping))
    return new, rho


def _filled(xp, like, value):
    """A checked scalar as an array like the 0-D ``like``: a 0-D array as it is (``full_like``
    takes Python numbers only under the array API)."""
    return value if is_array(value) else xp.full_like(like, value)


# ------------------------------------------------------------------------------------------
# the norm (KL) constraint
# ------------------------------------------------------------------------------------------
@capabilities(jit="yes", dask="yes")
def norm_constraint_coefficient(preconditioned, grad, learning_rate, norm_constraint):
    r"""Rescaling of the preconditioned vector so that the update obeys the norm constraint.

    With :math:`p = (\hat C + \lambda I)^{-1} g` the squared (approximate, damped) Fisher norm
    of the update :math:`-\eta p` is :math:`\eta^2 p^\top (\hat C + \lambda I) p = \eta^2 p^\top
    g`, so (TF ``_update_clip_coeff``, kfac-jax ``_maybe_apply_norm_constraint``; Ba, Grosse &
    Martens 2017, §5)

    .. math::

        \nu = \min\Big(1, \sqrt{\frac{c}{\eta^2\, p^\top g}}\Big), \qquad
        \eta^2 (\nu p)^\top (\hat C + \lambda I) (\nu p) = \min(c,\ \eta^2 p^\top g)

    (:math:`\nu = 1` where :math:`p^\top g \le 0`).  The inner product is formed from the
    vectors scaled by their largest entries, so that :math:`\nu` is computed without
    overflow or underflow at any scale of :math:`p` and :math:`g`:

    .. math::

        \sigma_p = \max_i |p_i|,\ \sigma_g = \max_i |g_i|,\quad
        t = \Big(\frac{p}{\sigma_p}\Big)^{\!\top} \frac{g}{\sigma_g},\quad
        \nu = \min\Big(1,\ \frac{\sqrt c}{\eta \sqrt t \sqrt{\sigma_p} \sqrt{\sigma_g}}
        \Big),\quad \eta^2 p^\top g = \eta\sigma_p\, t\, \eta\sigma_g .

    Returns
    -------
    (0-D array, 0-D array)
        :math:`\nu` and :math:`\eta^2 p^\top g` (kfac-jax's ``scaled_grad_norm_sq``).
    """
    func = "norm_constraint_coefficient"
    xp = namespace_of(func, preconditioned=preconditioned, grad=grad)
    check_array(func, "preconditioned", preconditioned, ndim=1, finite=True, layout="[P]")
    check_array(func, "grad", grad, shape=tuple(preconditioned.shape), finite=True,
                layout="[P]")
    like = {"preconditioned": preconditioned}
    lr = check_scalar(func, "learning_rate", learning_rate, positive=True, like=like)
    c = check_scalar(func, "norm_constraint", norm_constraint, positive=True, like=like)
    return norm_constraint_coefficient.kernel(xp, preconditioned, grad, lr, c)


@kernel_of(norm_constraint_coefficient)
def _norm_constraint_coefficient(xp, p, g, lr, c):
    def peak(v):
        top = xp.max(xp.abs(v))
        return xp.where(top > 0, top, xp.ones_like(top))

    sp, sg = peak(p), peak(g)
    t = _dot(xp, p / sp, g / sg)  # |t| <= P: the scaled inner product cannot overflow
    one = xp.ones_like(t)
    pos = t > 0
    # sqrt(c / (lr^2 t sp sg)) as a chain of divisions: it leaves the range only where nu does
    raw = ((math.sqrt(c) / lr) / xp.sqrt(xp.where(pos, t, one))) / xp.sqrt(sp) / xp.sqrt(sg)
    nu = xp.where(pos & (raw < 1), raw, one)
    sq = ((lr * sp) * t) * (lr * sg)  # the reported eta^2 p^T g: Inf only beyond the range
    return nu, sq


# ------------------------------------------------------------------------------------------
# optimiser state
# ------------------------------------------------------------------------------------------
@capabilities(dask="yes")
@dataclass(frozen=True)
class StepStats:
    r"""What one :meth:`KFACOptimizer.step` computed (kfac-jax's ``stats``).

    .. math::

        \eta = -w_1,\ \mu = w_2,\ \rho = \frac{h(\theta+\delta)-h(\theta)}{\Delta M},\
        \eta^2 p^\top g,\ \nu

    Fields that a step did not compute are None (kfac-jax reports NaN): ``new_loss``,
    ``rho`` and ``quad_model_change`` outside damping-adaptation steps (except the quadratic
    model's change, always computed by the ``qmodel`` types), ``scaled_grad_norm_sq`` and
    ``clip_coefficient`` without a norm constraint.
    """

    step: int
    loss: Any
    learning_rate: Any
    momentum: Any
    damping: Any
    precon_damping: Any
    new_loss: Any = None
    rho: Any = None
    quad_model_change: Any = None
    scaled_grad_norm_sq: Any = None
    clip_coefficient: Any = None
    updated_curvature: bool = False
    updated_inverse: bool = False


@capabilities(dask="yes", formula="a state container: the step count, damping, momentum and "
                                  "curvature states")
@dataclass(frozen=True)
class OptimizerState:
    r"""Immutable state of :class:`KFACOptimizer`.

    ``step`` counts finished steps; ``velocity`` is the momentum vector ([P]: the sum of
    preconditioned gradients for ``"regular"``, of gradients for ``"adam"``, the previous
    update :math:`\delta_{-1}` for the ``qmodel`` types); ``estimator_state`` holds the
    curvature statistics (updated every ``curvature_update_period`` steps) and
    ``preconditioner_state`` the snapshot of the last inverse refresh (every
    ``inverse_update_period`` steps), which the preconditioner uses until the next refresh;
    ``preconditioner_damping`` is the damping that refresh used.  ``stats`` is the last
    step's :class:`StepStats` (None after :meth:`KFACOptimizer.init`).
    """

    step: int
    damping: Any
    velocity: Any
    estimator_state: Any
    preconditioner_state: Any = None
    preconditioner_damping: Any = None
    stats: StepStats | None = None


# JAX pytrees (kfac_ref._pytrees): arrays are leaves (a jitted function takes and returns an
# optimiser state); the step counter and the step's flags stay static, like a Python-number
# damping, because the step's schedule branches on them.
_STATS_VALUES = ("loss", "learning_rate", "momentum", "damping", "precon_damping",
                 "new_loss", "rho", "quad_model_change", "scaled_grad_norm_sq",
                 "clip_coefficient")


def _flatten_stats(stats):
    leaves, skeleton = split(tuple(getattr(stats, f) for f in _STATS_VALUES))
    return (tuple(leaves),), (skeleton, stats.step, stats.updated_curvature,
                              stats.updated_inverse)


def _unflatten_stats(aux, children):
    skeleton, step, curvature, inverse = aux
    values = dict(zip(_STATS_VALUES, join(skeleton, children[0]), strict=True))
    return frozen(StepStats, step=step, updated_curvature=curvature,
                  updated_inverse=inverse, **values)


def _flatten_optimizer_state(st):
    leaves, skeleton = split((st.damping, st.velocity, st.preconditioner_damping))
    return ((tuple(leaves), st.estimator_state, st.preconditioner_state, st.stats),
            (st.step, skeleton))


def _unflatten_optimizer_state(aux, children):
    step, skeleton = aux
    damping, velocity, preconditioner_damping = join(skeleton, children[0])
    return frozen(OptimizerState, step=step, damping=damping, velocity=velocity,
                  estimator_state=children[1], preconditioner_state=children[2],
                  preconditioner_damping=preconditioner_damping, stats=children[3])


state_class(StepStats, _flatten_stats, _unflatten_stats)
state_class(OptimizerState, _flatten_optimizer_state, _unflatten_optimizer_state)


# ------------------------------------------------------------------------------------------
# the optimiser
# ------------------------------------------------------------------------------------------
@capabilities(dask="yes")
class KFACOptimizer:
    r"""The K-FAC optimiser step of kfac-jax and TF K-FAC, as options.

    Step :math:`t` at parameters :math:`\theta` on the batch ``(inputs, targets)``:

    .. math::

        &1.\ \hat C \leftarrow \mathrm{EMA}(\hat C, \hat C_{\text{batch}})
            \quad \text{if } t \bmod T_{\text{cov}} = 0,\\
        &2.\ h = h(\theta),\quad g = \nabla h(\theta),\\
        &3.\ \text{refresh the preconditioner } (\hat C + \lambda_p I)^{-1}
            \quad \text{if } t \bmod T_{\text{inv}} = 0\\
        &\phantom{3.}\ (\lambda_p = \text{precon\_damping\_mult}\cdot\lambda),\\
        &4.\ p = (\hat C_{t_r} + \lambda_p I)^{-1} g \ \ (\text{adam: } v \leftarrow \mu v + g,\
            p = (\hat C_{t_r} + \lambda_p I)^{-1} v),\\
        &\phantom{4.}\ p \leftarrow \nu p \ (\text{norm constraint}),\\
        &5.\ \delta = -\eta v,\ v \leftarrow \mu v + p\ (\text{regular});\quad
            \delta = -\eta p\ (\text{adam});\\
        &\phantom{5.}\ \delta = \alpha^* p + \mu^* \delta_{-1}\ (\text{qmodel}),\\
        &6.\ \theta \leftarrow \theta + \delta - \eta\,\omega_{wd}\,\theta,\\
        &7.\ \lambda \leftarrow \mathrm{LM}(\lambda, \rho)
            \quad \text{if adapt\_damping and } (t+1) \bmod T_{\lambda} = 0 .

    The order (curvature update before the gradient, refresh before the direction, damping
    adaptation at the step *before* the interval ends, so that it precedes the next refresh)
    is the one of both peers.  :math:`(\alpha^*, \mu^*)` come from :func:`quadratic_model` with
    the exact mini-batch GGN or Fisher products of
    :class:`~kfac_ref.curvature.ImplicitExactCurvature` and the damping :math:`\lambda`; the
    model change that :math:`\rho` divides by is the quadratic model's for the qmodel types,
    and :math:`\tfrac12 \delta^\top \hat C \delta + g^\top \delta` (the approximate model,
    kfac-jax's ``_compute_approx_quad_model``; ``damping_quad_model="exact"`` uses the exact
    :math:`C`) for ``"regular"`` and ``"adam"`` (TF's ``"adam"`` instead evaluates
    :math:`\tfrac12\eta^2 p^\top v - \eta p^\top g` with the possibly stale damped inverse).
    The weight-decay term (TF ``use_weight_decay``; :math:`\eta = 1` for the qmodel types,
    TF's learning rate there) is not part of :math:`\delta`, the velocity or the model.

    Mapping to the peers: kfac-jax ``Optimizer(use_adaptive_learning_rate=True,
    use_adaptive_momentum=True)`` is ``momentum_type="qmodel"``, adaptive learning rate with
    a fixed momentum is ``"qmodel_fixedmu"``, fixed ``learning_rate``/``momentum`` is
    ``"regular"`` (identical for a constant learning rate: :math:`-\eta v` with
    :math:`v \leftarrow \mu v + p` is :math:`\delta = -\eta p + \mu\delta_{-1}`);
    ``curvature_ema`` with ``ema_style="kfac_jax"`` is kfac-jax's
    ``(ema_old, ema_new) = (\text{curvature\_ema}, 1)``, ``"tf"`` TF's
    :math:`(d, 1 - d)`.  Not modelled: kfac-jax's ``l2_reg`` (and its masks), burn-in steps,
    initial-damping calibration, step rejection, TF's ``qmodel_update_rescale``.

    Every real-valued option (the floats below) may be a 0-D array instead, in the
    parameters' namespace, device and precision: the constructor sees no array, so
    :meth:`init` and :meth:`step` check it against the parameters.

    Parameters
    ----------
    net : kfac_ref.nn.Sequential
    loss_fn : loss class or callable ``(outputs, targets) -> LossFunction``
    estimator : kfac_ref.curvature estimator
        Built on the same ``net`` and ``loss_fn``: ``BlockDiagonalCurvature`` (K-FAC) or
        ``ExplicitExactCurvature`` (exact Fisher/GGN with ``curvature_ema=0``).
    learning_rate : float, optional
        :math:`\eta > 0` (required for ``"regular"``/``"adam"``, None for the qmodel types).
    momentum : float, optional
        :math:`\mu \in [0, 1)`; 0 when None for ``"regular"``/``"adam"``; required for
        ``"qmodel_fixedmu"``, None for ``"qmodel"``.
    momentum_type : {"regular", "adam", "qmodel", "qmodel_fixedmu"}
    damping : float
        Initial :math:`\lambda \ge 0` (:math:`> 0` with ``adapt_damping``).
    adapt_damping : bool
    damping_adaptation_interval : int
        :math:`T_\lambda` (5 in both peers).
    damping_adaptation_decay : float, optional
        :math:`d`, :math:`\omega = d^{T_\lambda}`; None: 0.9 for ``damping_rule="kfac_jax"``,
        0.95 (= 19/20) for ``"tf"`` (each peer's default).
    damping_lower_threshold, damping_upper_threshold : float
        1/4 and 3/4.
    min_damping, max_damping : float, float or None
    damping_rule : {"kfac_jax", "tf"}
        See :func:`adapt_damping`.
    include_damping_in_quad_change : bool
    damping_quad_model : {"approximate", "exact"}
        Model change for ``"regular"``/``"adam"`` (kfac-jax
        ``always_use_exact_qmodel_for_damping_adjustment``).
    quad_model_matrix : {"ggn", "fisher"}
        Exact curvature of the quadratic model.  The two give the same steps for every loss
        of :mod:`kfac_ref.losses`: each is the negative log-likelihood of an exponential
        family in its natural parameters, whose Fisher equals its GGN.  Kept for the
        peers' vocabulary and for user-defined losses whose Fisher is not their GGN.
    precon_damping_mult : float
    norm_constraint : float, optional
        :math:`c > 0`; only with ``"regular"``/``"adam"`` (both peers).
    weight_decay : float
        :math:`\omega_{wd} \ge 0` (TF ``weight_decay_coeff`` with ``use_weight_decay``).
    curvature_ema : float
        :math:`d \in [0, 1]`.
    ema_style : {"kfac_jax", "tf"}
        Equivalent choices: the estimator divides its moving average by the sum of its
        weights, so :math:`(d, 1)` and :math:`(d, 1 - d)` give the same normalised
        average :math:`\sum_s d^{t-s} \hat C_s / \sum_s d^{t-s}` (TF's zero-debiased
        EMA).  Kept so that each peer's hyper-parameters map one to one.
    curvature_update_period, inverse_update_period : int
        :math:`T_{\text{cov}}`, :math:`T_{\text{inv}} \ge 1` (kfac-jax: 1 and 5).
    exact_power : bool
        Exact damped inverse per block (True) or the estimator's approximate one (False:
        π-damped factors, kfac-jax's default ``use_exact_inverses=False``).  The exact
        cached inverse uses the current damping, the approximate one the damping of its
        refresh (kfac-jax's behaviour).
    estimation_mode : str, optional
        Passed to the estimator (its default when None).

    Raises
    ------
    KFACValueError, KFACTypeError
        Unknown options, negative damping or rates, a learning rate or a norm constraint with
        a qmodel type, a missing learning rate, non-positive periods.
    """

    def __init__(self, net, loss_fn, estimator, *, learning_rate=None, momentum=None,
                 momentum_type="regular", damping=1e-3, adapt_damping=False,
                 damping_adaptation_interval=5, damping_adaptation_decay=None,
                 damping_lower_threshold=0.25, damping_upper_threshold=0.75,
                 min_damping=1e-8, max_damping=None, damping_rule="kfac_jax",
                 include_damping_in_quad_change=False, damping_quad_model="approximate",
                 quad_model_matrix="ggn", precon_damping_mult=1.0, norm_constraint=None,
                 weight_decay=0.0, curvature_ema=0.95, ema_style="kfac_jax",
                 curvature_update_period=1, inverse_update_period=5, exact_power=True,
                 estimation_mode=None):
        func = "KFACOptimizer"
        from .curvature import ImplicitExactCurvature
        from .nn import Sequential

        if not isinstance(net, Sequential):
            raise KFACTypeError(f"{func}: net must be a kfac_ref.nn.Sequential; got "
                                f"{describe(net)}.")
        if not callable(loss_fn):
            raise KFACTypeError(f"{func}: loss_fn must be a loss class or a callable; got "
                                f"{describe(loss_fn)}.")
        self.net, self.loss_fn = net, loss_fn
        self.estimator = _check_estimator(func, estimator)
        self.momentum_type = check_option(func, "momentum_type", momentum_type, MOMENTUM_TYPES)
        qmodel = self.momentum_type.startswith("qmodel")
        if qmodel and learning_rate is not None:
            raise KFACValueError(f"{func}: learning_rate must be None with momentum_type "
                                 f"{self.momentum_type!r} (the quadratic model chooses it); "
                                 f"got {learning_rate!r}.")
        if not qmodel and learning_rate is None:
            raise KFACValueError(f"{func}: learning_rate must be a positive number with "
                                 f"momentum_type {self.momentum_type!r}; got None.")
        self.learning_rate = check_scalar(func, "learning_rate", learning_rate, positive=True,
                                          allow_none=True)
        if self.momentum_type == "qmodel" and momentum is not None:
            raise KFACValueError(f"{func}: momentum must be None with momentum_type 'qmodel' "
                                 f"(the quadratic model chooses it); got {momentum!r}.")
        if self.momentum_type == "qmodel_fixedmu" and momentum is None:
            raise KFACValueError(f"{func}: momentum must be a number with momentum_type "
                                 f"'qmodel_fixedmu'; got None.")
        mu = check_scalar(func, "momentum", momentum, nonnegative=True, allow_none=True)
        if mu is not None and not mu < 1:
            raise KFACValueError(f"{func}: momentum must be in [0, 1); got {mu}.")
        self.momentum = 0.0 if (mu is None and not qmodel) else mu
        self.damping = check_scalar(func, "damping", damping, nonnegative=True)
        self.adapt_damping = check_bool(func, "adapt_damping", adapt_damping)
        if self.adapt_damping and not self.damping > 0:
            raise KFACValueError(f"{func}: damping must be positive with adapt_damping (it is "
                                 f"multiplied and divided by omega); got {damping!r}.")
        self.damping_adaptation_interval = check_int(func, "damping_adaptation_interval",
                                                     damping_adaptation_interval, minimum=1)
        self.damping_rule = check_option(func, "damping_rule", damping_rule, DAMPING_RULES)
        if damping_adaptation_decay is None:
            damping_adaptation_decay = 0.9 if self.damping_rule == "kfac_jax" else 0.95
        decay = check_scalar(func, "damping_adaptation_decay", damping_adaptation_decay,
                             positive=True)
        if decay > 1:
            raise KFACValueError(f"{func}: damping_adaptation_decay must be in (0, 1]; got "
                                 f"{decay}.")
        self.damping_adaptation_decay = decay
        self.omega = decay ** self.damping_adaptation_interval
        self._lm = _check_lm(func, self.omega, damping_lower_threshold, damping_upper_threshold,
                             min_damping, max_damping, self.damping_rule,
                             names=_OPTIMIZER_LM_NAMES)
        self.include_damping_in_quad_change = check_bool(
            func, "include_damping_in_quad_change", include_damping_in_quad_change)
        self.damping_quad_model = check_option(func, "damping_quad_model", damping_quad_model,
                                               ("approximate", "exact"))
        self.quad_model_matrix = check_option(func, "quad_model_matrix", quad_model_matrix,
                                              QUAD_MODEL_MATRICES)
        self.precon_damping_mult = check_scalar(func, "precon_damping_mult",
                                                precon_damping_mult, nonnegative=True)
        self.norm_constraint = check_scalar(func, "norm_constraint", norm_constraint,
                                            positive=True, allow_none=True)
        if qmodel and self.norm_constraint is not None:
            raise KFACValueError(f"{func}: norm_constraint must be None with momentum_type "
                                 f"{self.momentum_type!r} (only 'regular' and 'adam' rescale "
                                 f"the step); got {norm_constraint!r}.")
        self.weight_decay = check_scalar(func, "weight_decay", weight_decay, nonnegative=True)
        ema = check_scalar(func, "curvature_ema", curvature_ema, nonnegative=True)
        if ema > 1:
            raise KFACValueError(f"{func}: curvature_ema must be in [0, 1]; got {ema}.")
        self.curvature_ema = ema
        self.ema_style = check_option(func, "ema_style", ema_style, ("kfac_jax", "tf"))
        if self.ema_style == "tf" and ema == 1:
            raise KFACValueError(f"{func}: curvature_ema must be below 1 with ema_style 'tf' "
                                 f"(the new batch gets weight 1 - curvature_ema); got 1.")
        self.curvature_update_period = check_int(func, "curvature_update_period",
                                                 curvature_update_period, minimum=1)
        self.inverse_update_period = check_int(func, "inverse_update_period",
                                               inverse_update_period, minimum=1)
        self.exact_power = check_bool(func, "exact_power", exact_power)
        if estimation_mode is not None:  # refused here, not at the first step in the
            # estimator's name
            from .curvature._exact import ESTIMATION_MODES

            estimation_mode = check_option(func, "estimation_mode", estimation_mode,
                                           ESTIMATION_MODES)
        self.estimation_mode = estimation_mode
        self._implicit = ImplicitExactCurvature(net, loss_fn)
        # the options given as 0-D arrays, checked against the parameters at init and step
        # (the constructor sees no array); Python numbers take the parameters' dtype
        options = {"learning_rate": self.learning_rate, "momentum": self.momentum,
                   "damping": self.damping, "damping_adaptation_decay": decay,
                   **dict(zip(("damping_lower_threshold", "damping_upper_threshold",
                               "min_damping", "max_damping"), self._lm[1:5], strict=True)),
                   "precon_damping_mult": self.precon_damping_mult,
                   "norm_constraint": self.norm_constraint,
                   "weight_decay": self.weight_decay, "curvature_ema": ema}
        self._array_options = {k: v for k, v in options.items() if is_array(v)}

    # -- helpers ------------------------------------------------------------------------
    def _func_args(self, func, params, batch):
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise KFACValueError(f"{func}: batch must be (inputs, targets); got "
                                 f"{describe(batch)}.")
        params = self.net.check_params(func, params)
        like = next((a for layer in params for a in layer), None)
        if like is None:
            raise KFACValueError(f"{func}: net must have parameters; got a network without.")
        xp = namespace_of(func, params=like, **{"batch[0]": batch[0], "batch[1]": batch[1]},
                          **self._array_options)
        return xp, params, (params, tuple(batch))

    def _loss_and_grad(self, params, batch):
        from .curvature import loss_value_and_grad

        return loss_value_and_grad(self.net, self.loss_fn, params, batch)

    def _loss(self, params, batch):
        return self._loss_and_grad(params, batch)[0]

    def _precondition(self, state, vec, lam_p):
        lam = lam_p if self.exact_power else state.preconditioner_damping
        with errors_named("KFACOptimizer.step", inner=True):
            return self.estimator.multiply_matpower(
                state.preconditioner_state, vec, identity_weight=lam, power=-1.0,
                exact_power=self.exact_power, use_cached=True)

    def _exact_product(self, func_args, v):
        if self.quad_model_matrix == "ggn":
            return self._implicit.multiply_ggn(func_args, v)
        return self._implicit.multiply_fisher(func_args, v)

    # -- public -------------------------------------------------------------------------
    def init(self, params, batch, rng=None):
        r"""The state before the first step: zero curvature and velocity, initial damping.

        .. math:: t = 0,\quad \lambda_0 = \text{damping},\quad v_0 = 0,\quad \hat C_0 = 0

        ``batch`` fixes the layers' input shapes (the estimator's ``init``); ``rng`` (a
        :class:`numpy.random.Generator` or None) is passed to it.
        """
        func = "KFACOptimizer.init"
        xp, params, func_args = self._func_args(func, params, batch)
        if rng is not None:
            check_rng(func, "rng", rng)
        powers = -1.0
        est_state = self.estimator.init(
            rng, func_args, exact_powers_to_cache=powers if self.exact_power else None,
            approx_powers_to_cache=None if self.exact_power else powers)
        flat = self.net.flatten(params)
        velocity = zeros_like_shape(flat, tuple(flat.shape))
        return OptimizerState(step=0, damping=asarray_like(self.damping, flat),
                              velocity=velocity, estimator_state=est_state)

    def step(self, state, params, batch, rng=None):
        r"""One optimiser step (see the class docstring for the formulas).

        .. math:: (\theta_{t+1}, \text{state}_{t+1}) = \mathrm{step}(\text{state}_t,
            \theta_t, \text{batch}_t)

        Parameters
        ----------
        state : OptimizerState
        params : tuple of per-layer tuples of arrays
        batch : (inputs, targets)
        rng : numpy.random.Generator, optional
            Needed by the stochastic estimation modes.

        Returns
        -------
        (params, OptimizerState)
            New parameters in the structure of ``params``; the new state, whose ``stats``
            describe this step.
        """
        func = "KFACOptimizer.step"
        if not isinstance(state, OptimizerState):
            raise KFACTypeError(f"{func}: state must be an OptimizerState from "
                                f"KFACOptimizer.init; got {describe(state)}.")
        xp, params, func_args = self._func_args(func, params, batch)
        if rng is not None:
            check_rng(func, "rng", rng)
        flat = self.net.flatten(params)
        namespace_of(func, params=flat, velocity=state.velocity)
        check_array(func, "state.velocity", state.velocity, shape=tuple(flat.shape),
                    layout="[P]")
        t = state.step
        # checked here, in the state's name: the estimator would report it as its own
        # identity_weight argument, which the user never passed
        like = {"params": flat}  # a state's 0-D dampings are in the parameters' precision
        lam = check_scalar(func, "state.damping", state.damping, nonnegative=True, like=like)
        if state.preconditioner_damping is not None:
            check_scalar(func, "state.preconditioner_damping", state.preconditioner_damping,
                         nonnegative=True, like=like)
        lam_p = lam * self.precon_damping_mult
        n = int(batch[0].shape[0])

        # 1. curvature statistics
        est_state, updated_cov = state.estimator_state, False
        if t % self.curvature_update_period == 0:
            ema_old, ema_new = ((self.curvature_ema, 1.0) if self.ema_style == "kfac_jax"
                                else (self.curvature_ema, 1.0 - self.curvature_ema))
            with errors_named(func, inner=True):  # the estimator's errors, under step
                est_state = self.estimator.update_curvature_matrix_estimate(
                    est_state, ema_old, ema_new, n, rng, func_args,
                    estimation_mode=self.estimation_mode)
            updated_cov = True
        # 2. loss and gradient
        loss, g = self._loss_and_grad(params, batch)
        # 3. inverse refresh
        refreshed = t % self.inverse_update_period == 0
        pre_state, pre_damping = state.preconditioner_state, state.preconditioner_damping
        if refreshed:
            with errors_named(func, inner=True):
                pre_state = self.estimator.update_cache(
                    est_state, lam_p, -1.0 if self.exact_power else None,
                    None if self.exact_power else -1.0, False)
            pre_damping = lam_p
        elif pre_state is None:
            raise KFACValueError(f"{func}: state must have a preconditioner (the first step "
                                 f"refreshes it); got a state without one at step {t}.")
        snap = replace(state, preconditioner_state=pre_state,
                       preconditioner_damping=pre_damping)

        # 4.-5. direction and coefficients
        mt = self.momentum_type
        stats = {}
        velocity = state.velocity
        if mt in ("regular", "adam"):
            lr, mu = self.learning_rate, self.momentum
            src = g if mt == "regular" else mu * velocity + g
            p = self._precondition(snap, src, lam_p)
            if self.norm_constraint is not None:
                nu, sq = norm_constraint_coefficient.kernel(xp, p, src, lr,
                                                            self.norm_constraint)
                p = nu * p
                stats.update(scaled_grad_norm_sq=sq, clip_coefficient=nu)
            if mt == "regular":
                velocity = mu * velocity + p
                delta = -lr * velocity
            else:
                velocity = src
                delta = -lr * p
            coeffs = (asarray_like(lr, flat), asarray_like(mu, flat))
            quad_change = None
        else:
            p = self._precondition(snap, g, lam_p)
            prev = velocity
            cp, cd = self._exact_product(func_args, p), self._exact_product(func_args, prev)
            a = xp.reshape(xp.stack([_dot(xp, p, cp), _dot(xp, p, cd), _dot(xp, prev, cp),
                                     _dot(xp, prev, cd)]), (2, 2))
            d = xp.reshape(xp.stack([_dot(xp, p, p), _dot(xp, p, prev), _dot(xp, prev, p),
                                     _dot(xp, prev, prev)]), (2, 2))
            b = xp.stack([_dot(xp, g, p), _dot(xp, g, prev)])
            fixed = (None, None) if mt == "qmodel" else (None, self.momentum)
            (w0, w1), quad_change = quadratic_model.kernel(
                xp, a, d, b, lam, fixed, self.include_damping_in_quad_change)
            delta = w0 * p + w1 * prev
            velocity = delta
            coeffs = (-w0, w1)
            stats.update(quad_model_change=quad_change)

        # 6. parameter update
        eta = 1.0 if mt.startswith("qmodel") else self.learning_rate
        new_flat = flat + delta
        if self.weight_decay:
            new_flat = new_flat - (eta * self.weight_decay) * flat
        new_params = self.net.unflatten(new_flat)

        # 7. damping adaptation
        new_lam = lam
        if self.adapt_damping and (t + 1) % self.damping_adaptation_interval == 0:
            if quad_change is None:
                if self.damping_quad_model == "exact":
                    cdelta = self._exact_product(func_args, delta)
                else:
                    with errors_named(func, inner=True):
                        cdelta = self.estimator.multiply_matpower(
                            est_state, delta, identity_weight=0.0, power=1.0,
                            exact_power=True, use_cached=False)
                quad = 0.5 * _dot(xp, delta, cdelta)
                if self.include_damping_in_quad_change:
                    quad = quad + 0.5 * lam * _dot(xp, delta, delta)
                quad_change = quad + _dot(xp, g, delta)
            new_loss = self._loss(new_params, batch)
            new_lam, rho = adapt_damping.kernel(xp, lam, loss, new_loss, quad_change,
                                                *self._lm)
            stats.update(new_loss=new_loss, rho=rho, quad_model_change=quad_change)

        info = StepStats(step=t + 1, loss=loss, learning_rate=coeffs[0], momentum=coeffs[1],
                         damping=lam, precon_damping=lam_p, updated_curvature=updated_cov,
                         updated_inverse=refreshed, **stats)
        new_state = OptimizerState(step=t + 1, damping=new_lam, velocity=velocity,
                                   estimator_state=est_state, preconditioner_state=pre_state,
                                   preconditioner_damping=pre_damping, stats=info)
        return new_params, new_state
