r"""Loss functions: the curvature of a predictive distribution with respect to the network output.

Each class here describes, for a batch of :math:`N` examples, the per-example negative
log-likelihood :math:`\ell_n(f_n) = -\log p(y_n \mid f_n)` of a network output :math:`f_n`
(logits, a mean, a mean and a variance) and the matrices that K-FAC needs from it: the Fisher
:math:`F_n`, the generalised Gauss-Newton matrix (GGN) :math:`G_n`, and factors
:math:`B_n` with :math:`B_n B_n^\top = F_n`.  Names and method semantics follow kfac-jax
(``kfac_jax.CategoricalLogitsNegativeLogProbLoss`` and friends, themselves ported from TF
K-FAC's ``loss_functions.py``).

Conventions (shared by every class)
-----------------------------------
* **Batch axis first.**  Inputs ("parameter dependants") have shape ``[N, ...]``.  Every
  quantity is *per example*: ``evaluate`` returns an array ``[N]`` (not reduced over the
  batch), and every product acts on each example's slice independently (the matrices are
  block diagonal over the batch).
* **Vectors are tuples** of arrays, one per parameter dependant (one for the logits or the
  mean, two for ``(mean, variance)``), each of that input's shape.  Every product returns a
  tuple, except ``multiply_fisher_factor_transpose`` / ``multiply_ggn_factor_transpose``,
  which return one array of the factor's *inner shape*; ``multiply_fisher_factor`` /
  ``multiply_ggn_factor`` take one such array.
* **Weight.**  ``weight`` :math:`w \ge 0` multiplies the loss, hence the Fisher and the GGN;
  the factors carry :math:`\sqrt{w}` so that :math:`(\sqrt w B)(\sqrt w B)^\top = wF`.  The
  ``_unweighted`` methods leave :math:`w` out (the same private formula, called with
  ``weighted=False``).  ``coefficient_mode`` of ``evaluate`` and
  ``grad_of_evaluate`` selects :math:`w` ("regular"), :math:`\sqrt w` ("sqrt", used to
  back-propagate sampled gradients whose outer products must carry :math:`w`) or 1 ("off").
* **The batch normaliser 1/N.**  kfac-jax's ``register_*`` functions declare the objective
  :math:`\mathcal L = \frac{w}{N}\sum_{n=1}^N \ell_n`.  The products here carry *no* 1/N:
  they are the per-example quantities.  The 1/N enters where the per-example vectors become
  statistics: with :math:`g_n = J_n^\top \sqrt{w} B_n u_n` the back-propagated vectors
  (:math:`u_n` a one-hot, Rademacher or sampled-target direction), the Kronecker factor is
  the per-example average :math:`G = \frac1N \sum_n g_n g_n^\top`
  (see the docs page *Conventions*), which is the curvature of :math:`\mathcal L`.  Dividing the
  loss (or the factors) by N as well counts it twice: the :math:`1/N^2` pitfall.
* **Masks** (categorical losses) are 0/1 per example; a masked-out example contributes zero
  to the loss, its gradient and every product.
* **Dense per-example matrices** (``fisher_matrix`` ...) have shape ``[N, D, D]`` (factors
  ``[N, D, K]``), where :math:`D` is the number of output coordinates of one example,
  flattened row-major (for ``(mean, variance)`` the mean block comes first) and :math:`K`
  the size of one example's slice of the factor's inner shape.  They are for oracles and
  teaching; the matrix-free products are what an optimiser uses.
* **Validation, once.**  The constructor checks the inputs (shape, dtype, namespace,
  device, one precision; values — finite, masks 0/1, targets in range, variances positive —
  on eager arrays while ``kfac_ref.value_checks`` is on) and each public method checks
  only its own arguments, then calls one unchecked private method of the loss that holds
  the formula (weight included): ``_evaluate``, ``_grad``, ``_sample``, ``_curvature_vp``
  (:math:`wC_nv_n`), ``_factor_vp`` (:math:`\sqrt w B_nu_n`), ``_factor_t_vp``
  (:math:`\sqrt w B_n^\top v_n`), ``_factor_column`` (:math:`\sqrt w B_ne_i`),
  ``_curvature_matrix``, ``_factor_matrix`` and ``_hessian_matrix``.
  :mod:`kfac_ref.curvature`, which has validated its vectors already, calls these
  directly.  Nothing reads array values without a value check, so the products run under
  ``jax.jit``.
* **One curvature per loss.**  :math:`C_n` is the GGN of a :class:`LossFunction`; for a
  :class:`NegativeLogProbLoss` it is also the Fisher: every loss here has
  :math:`G_n = F_n` (natural parameters, or the stated split of the mean-variance normal),
  so ``multiply_fisher`` and ``multiply_ggn`` (and their factor variants) are two public
  names that validate against their own inner shape and run the same formula.
* **Randomness.**  ``sample(rng)`` takes an explicit :class:`numpy.random.Generator`; the
  noise is drawn on the host in float64 (``kfac_ref._backend.host_draw``) and moved to
  the inputs' device, so one seed gives the same samples on every backend.  For JAX
  inputs ``rng`` may also be a JAX PRNG key: the noise is then drawn with
  :mod:`jax.random` (new numbers on every call of a jitted function that takes the key;
  not the Generator's numbers, the same distribution).

References
----------
J. Martens, "New insights and perspectives on the natural gradient method",
arXiv:1412.1193 (2014/2020), §9 (GGN = Fisher for natural parameters).
J. Martens and R. Grosse, "Optimizing neural networks with Kronecker-factored approximate
curvature", ICML 2015, §5 (sampling targets for the Fisher).
kfac-jax ``loss_functions.py``; TF K-FAC ``loss_functions.py``.
"""

from __future__ import annotations

import abc
import math
import numbers

import numpy as np  # host-side only: index arithmetic for one-hot rows and the noise draws

from ._backend import (
    KFACTypeError,
    KFACValueError,
    any_true,
    asarray_like,
    check_array,
    check_bool,
    check_option,
    check_scalar,
    checks_values,
    describe,
    eye_like,
    is_array,
    namespace_of,
    optional_linalg,
    size_of,
)
from ._random import check_random_source, draw_noise
from ._support import capabilities

__all__ = [
    "COEFFICIENT_MODES",
    "LossFunction",
    "NegativeLogProbLoss",
    "NaturalParamsNegativeLogProbLoss",
    "CategoricalLogitsNegativeLogProbLoss",
    "OneHotCategoricalLogitsNegativeLogProbLoss",
    "MultiBernoulliNegativeLogProbLoss",
    "NormalMeanNegativeLogProbLoss",
    "NormalMeanVarianceNegativeLogProbLoss",
    "CustomLoss",
    "CustomNegativeLogProbLoss",
    "AutodiffLoss",
]

COEFFICIENT_MODES = ("regular", "sqrt", "off")
"""Accepted ``coefficient_mode`` values: multiply by ``weight``, ``sqrt(weight)`` or 1."""

_LOG_2PI = math.log(2.0 * math.pi)


# --------------------------------------------------------------------------------------
# Numerically stable elementary functions (the one home of log-softmax / log-sigmoid)
# --------------------------------------------------------------------------------------
def _log_softmax(xp, z):
    # log p_c = (z_c - m) - log Σ_j exp(z_j - m), m = max_j z_j: the exponents are <= 0, so
    # nothing overflows and the largest term of the sum is exactly 1 (no log(0)).
    s = z - xp.max(z, axis=-1, keepdims=True)
    return s - xp.log(xp.sum(xp.exp(s), axis=-1, keepdims=True))


def _log_sigmoid(xp, z):
    # log σ(z) = min(z, 0) - log1p(exp(-|z|)): exp never overflows, log1p keeps tiny tails.
    zero = xp.zeros_like(z)
    return xp.where(z < zero, z, zero) - xp.log1p(xp.exp(-xp.abs(z)))


def _flat(xp, x):
    """[N, ...] -> [N, D] (row-major flattening of one example's coordinates)."""
    return xp.reshape(x, (x.shape[0], -1))


def _diag_embed(xp, d):
    """[N, D] -> [N, D, D] with ``d`` on the diagonals (broadcast against an identity)."""
    return d[:, :, None] * eye_like(d, d.shape[1])[None, :, :]


def _sqrt(xp, c):
    """Square root of a validated scalar: ``math.sqrt`` for a Python number, ``xp.sqrt``
    for a 0-D array (which may be traced)."""
    return xp.sqrt(c) if is_array(c) else math.sqrt(c)


def _log(xp, c):
    """Natural logarithm of a validated positive scalar (Python number or 0-D array)."""
    return xp.log(c) if is_array(c) else math.log(c)


def _arrays_only(**values):
    """The entries that are arrays (0-D hyper-parameters given as arrays), for
    :func:`~kfac_ref._backend.namespace_of`; Python numbers are left to ``check_scalar``."""
    return {k: v for k, v in values.items() if is_array(v)}


def _prod(shape):
    return int(math.prod(shape))


# --------------------------------------------------------------------------------------
# Base classes
# --------------------------------------------------------------------------------------
@capabilities(dask="yes")
class LossFunction(abc.ABC):
    r"""Abstract per-example loss :math:`w\,\ell_n(f_n)` with its GGN products.

    .. math::

        \mathcal L = \frac{w}{N}\sum_{n=1}^{N} \ell_n(f_n), \qquad
        G_n = J_{\eta_n}^\top\, \nabla^2_{\eta}\ell_n\, J_{\eta_n} = B_n B_n^\top ,

    where :math:`\eta_n(f_n)` is the point at which the loss is split into a (convex)
    outer part and the rest; for natural parameters :math:`\eta = f` and :math:`G_n` is the
    Hessian of :math:`\ell_n`.  ``evaluate`` returns the per-example values
    :math:`w\,\ell_n` (``[N]``, not reduced); the products act per example without the
    :math:`1/N` of :math:`\mathcal L` (see the module docstring).

    Every public method validates its arguments once and then calls the one private
    method that holds its formula (``multiply_ggn`` → ``_curvature_vp``, see the module
    docstring); the constructor validates the inputs once.  Code that has already
    validated its vectors (the exact curvature of :mod:`kfac_ref.curvature`) calls
    the private method directly.  A subclass implements those private methods.

    Parameters
    ----------
    weight : float or 0-D array
        Non-negative scalar :math:`w` that multiplies the loss: a Python number, or a 0-D
        real floating array in the inputs' namespace, device and dtype (it may be traced
        under ``jax.jit``).

    Raises
    ------
    KFACTypeError, KFACValueError
        ``weight`` not a real number, or negative, NaN or infinite.

    References
    ----------
    kfac-jax ``LossFunction``; Martens (2014), arXiv:1412.1193, §8-9.
    """

    _dependant_names: tuple = ("input",)
    """Argument names of the parameter dependants, for error messages."""

    def __init__(self, weight=1.0):
        self._set_weight(self._fname("__init__"), weight)

    def _set_weight(self, func, weight):
        self._weight = check_scalar(func, "weight", weight, nonnegative=True)
        xp = getattr(self, "_ns", None)
        if xp is None and is_array(self._weight):
            xp = namespace_of(func, weight=self._weight)
        self._sqrt_weight = _sqrt(xp, self._weight)

    # -- identification ------------------------------------------------------------------
    @classmethod
    def _fname(cls, method):
        return f"{cls.__name__}.{method}" if method != "__init__" else cls.__name__

    # -- properties ----------------------------------------------------------------------
    @property
    def weight(self):
        """The relative weight :math:`w` of the loss (a float, or the 0-D array given)."""
        return self._weight

    # -- the weight as each formula applies it -------------------------------------------
    def _coefficient(self, coefficient_mode):
        """:math:`w`, :math:`\\sqrt w` or 1 for a validated ``coefficient_mode``."""
        if coefficient_mode == "regular":
            return self._weight
        if coefficient_mode == "sqrt":
            return self._sqrt_weight
        return 1.0

    def _w(self, weighted):
        return self._weight if weighted else 1.0

    def _sqrt_w(self, weighted):
        return self._sqrt_weight if weighted else 1.0

    @property
    def _xp(self):
        """The inputs' namespace, which each constructor sets as ``_ns``."""
        return self._ns

    def _given(self, targets):
        """Validated targets, or the construction-time ones for ``None``."""
        return self.targets if targets is None else targets

    @property
    def dtype(self):
        """Floating dtype of the inputs (and of every result)."""
        return self.parameter_dependants[0].dtype

    @property
    def batch_size(self) -> int:
        """Number :math:`N` of examples (leading axis of the inputs)."""
        return int(self.parameter_dependants[0].shape[0])

    @property
    @abc.abstractmethod
    def targets(self):
        """The targets given at construction (``None`` if none)."""

    @property
    @abc.abstractmethod
    def parameter_dependants(self) -> tuple:
        """The inputs of the loss that depend on the network parameters."""

    @property
    def num_parameter_dependants(self) -> int:
        """Number of parameter-dependent inputs (length of every vector tuple)."""
        return len(self.parameter_dependants)

    @property
    @abc.abstractmethod
    def parameter_independants(self) -> tuple:
        """The inputs that do not depend on the parameters (targets, mask, weight, ...)."""

    @property
    def num_parameter_independants(self) -> int:
        """Number of parameter-independent inputs."""
        return len(self.parameter_independants)

    @property
    @abc.abstractmethod
    def ggn_factor_inner_shape(self) -> tuple:
        """Shape of the array that ``multiply_ggn_factor`` takes (``[N, K...]``)."""

    # -- construction ----------------------------------------------------------------------
    def copy_with_different_inputs(self, parameter_dependants):
        """A copy of this loss with new parameter-dependent inputs (targets, mask, weight
        and hyper-parameters kept).  The new inputs are validated like the constructor's.

        Parameters
        ----------
        parameter_dependants : sequence of arrays
            One array per parameter dependant, in the order of ``parameter_dependants``.

        Returns
        -------
        LossFunction
            Same class, new inputs.
        """
        func = self._fname("copy_with_different_inputs")
        if not isinstance(parameter_dependants, (tuple, list)) or (
                len(parameter_dependants) != self.num_parameter_dependants):
            raise KFACValueError(
                f"{func}: parameter_dependants must be a sequence of "
                f"{self.num_parameter_dependants} array(s); got {describe(parameter_dependants)}."
            )
        return self._with_inputs(tuple(parameter_dependants))

    @abc.abstractmethod
    def _with_inputs(self, inputs):
        """Build the same loss around new parameter dependants."""

    # -- validation (static always, value checks on eager arrays) --------------------------
    def _namespace(self, func, **arrays):
        deps = dict(zip(self._dependant_names, self.parameter_dependants, strict=True))
        return namespace_of(func, **deps, **_arrays_only(weight=self._weight), **arrays)

    def _check_vector(self, func, vector):
        """A tuple of arrays shaped like the parameter dependants, in their dtype."""
        deps = self.parameter_dependants
        if not isinstance(vector, (tuple, list)) or len(vector) != len(deps):
            shapes = ", ".join(str(tuple(d.shape)) for d in deps)
            raise KFACValueError(
                f"{func}: vector must be a tuple of {len(deps)} array(s) of shape(s) {shapes}; "
                f"got {describe(vector)}."
            )
        arrays = {f"vector[{i}]": v for i, v in enumerate(vector)}
        self._namespace(func, **arrays)
        for (name, v), d in zip(arrays.items(), deps, strict=True):
            check_array(func, name, v, shape=tuple(d.shape))
            self._check_dtype(func, name, v)
        return tuple(vector)

    def _check_shaped(self, func, name, array, shape, layout=None):
        """An array of the inputs' namespace and dtype, of the given shape (a factor's inner
        vector, real-valued targets)."""
        self._namespace(func, **{name: array})
        check_array(func, name, array, shape=tuple(shape), layout=layout)
        self._check_dtype(func, name, array)
        return array

    def _check_dtype(self, func, name, v):
        if v.dtype != self.dtype:
            raise KFACTypeError(f"{func}: {name} must be of the inputs' dtype {self.dtype}; "
                                f"got {describe(v)}.")

    def _check_index(self, func, index, inner_shape):
        """A replicated-one-hot index: ints, one per non-batch axis of the inner shape."""
        event = tuple(inner_shape[1:])
        if isinstance(index, numbers.Integral) and not isinstance(index, bool):
            index = (index,)
        if not isinstance(index, (tuple, list)) or len(index) != len(event) or not all(
                isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in index):
            raise KFACValueError(
                f"{func}: index must be a sequence of {len(event)} integer(s) (one per "
                f"non-batch axis of the inner shape {tuple(inner_shape)}); got "
                f"{describe(index)}.")
        for i, (j, size) in enumerate(zip(index, event, strict=True)):
            if not 0 <= j < size:
                raise KFACValueError(f"{func}: index[{i}] must be in [0, {size}); got {j}.")
        return tuple(int(j) for j in index)

    def _one_hot_event(self, index, event_shape):
        """Host-built one-hot array of ``event_shape`` (index arithmetic on the host),
        moved to the inputs' device with a leading batch axis of 1."""
        host = np.zeros(_prod(event_shape))
        host[int(np.ravel_multi_index(index, event_shape))] = 1.0
        return asarray_like(np.reshape(host, (1, *event_shape)), self.parameter_dependants[0])

    def _check_mode(self, func, coefficient_mode):
        return check_option(func, "coefficient_mode", coefficient_mode, COEFFICIENT_MODES)

    def _resolve_targets(self, func, targets):
        """Validated targets, or ``None`` for the construction-time ones (which must exist)."""
        if targets is None:
            if self.targets is None:
                raise KFACValueError(
                    f"{func}: targets must be given (the loss was built without targets); "
                    f"got None.")
            return None
        return self._check_targets(func, targets)

    @abc.abstractmethod
    def _check_targets(self, func, targets):
        """Validate targets (shape, dtype, range) and return them ready for the formulas."""

    # -- values and gradients ----------------------------------------------------------------
    def evaluate(self, targets=None, coefficient_mode="regular"):
        r"""Per-example loss values :math:`c\,\ell_n(y_n)`, not reduced over the batch.

        .. math::

            c = w \ (\text{"regular"}),\quad \sqrt{w}\ (\text{"sqrt"}),\quad
            1\ (\text{"off"}).

        Parameters
        ----------
        targets : array, optional
            Targets to evaluate at; defaults to the construction-time targets.
        coefficient_mode : {"regular", "sqrt", "off"}

        Returns
        -------
        array [N]

        Raises
        ------
        KFACValueError
            No targets at all, targets of wrong shape or out of range, unknown mode.
        """
        func = self._fname("evaluate")
        mode = self._check_mode(func, coefficient_mode)
        return self._evaluate(self._resolve_targets(func, targets), mode)

    def grad_of_evaluate(self, targets=None, coefficient_mode="regular"):
        r"""Gradient of :math:`\sum_n c\,\ell_n(y_n)` with respect to each input.

        .. math::

            \Big(\frac{\partial\, c\,\ell_n}{\partial f_n}\Big)_{n=1}^{N}

        (closed forms in each subclass's docstring).  Per example: there is no 1/N.

        Parameters
        ----------
        targets : array, optional
            Defaults to the construction-time targets.
        coefficient_mode : {"regular", "sqrt", "off"}

        Returns
        -------
        tuple of arrays
            One per parameter dependant, of its shape.
        """
        func = self._fname("grad_of_evaluate")
        mode = self._check_mode(func, coefficient_mode)
        return self._grad(self._resolve_targets(func, targets), mode)

    @abc.abstractmethod
    def _evaluate(self, targets=None, coefficient_mode="regular"):
        """Per-example :math:`c\\,\\ell_n` [N] (masked) at validated targets (``None``: the
        construction-time ones)."""

    @abc.abstractmethod
    def _grad(self, targets=None, coefficient_mode="regular"):
        """:math:`c\\,\\nabla_f\\ell_n` as a tuple (masked), targets as ``_evaluate``."""

    # -- GGN products (each public door checks its argument once, then runs the formula) ------
    def _vp_door(self, method, vector, weighted=True):
        """``_curvature_vp`` behind the public ``method``'s check of its vector tuple."""
        return self._curvature_vp(self._check_vector(self._fname(method), vector),
                                  weighted=weighted)

    def _factor_vp_door(self, method, vector, inner_shape, weighted=True):
        """``_factor_vp`` behind ``method``'s check of an ``inner_shape`` array."""
        func = self._fname(method)
        vector = self._check_shaped(func, "vector", vector, inner_shape)
        return self._factor_vp(vector, weighted=weighted)

    def _factor_t_vp_door(self, method, vector, weighted=True):
        """``_factor_t_vp`` behind ``method``'s check of its vector tuple."""
        return self._factor_t_vp(self._check_vector(self._fname(method), vector),
                                 weighted=weighted)

    def _column_door(self, method, index, inner_shape, weighted=True):
        """``_factor_column`` behind ``method``'s check of a one-hot ``index``."""
        index = self._check_index(self._fname(method), index, inner_shape)
        return self._factor_column(index, weighted=weighted)

    def multiply_ggn(self, vector):
        r"""Per-example GGN product :math:`w\, G_n v_n`.

        Parameters
        ----------
        vector : tuple of arrays
            Shaped like ``parameter_dependants``.

        Returns
        -------
        tuple of arrays
            Shaped like ``parameter_dependants``.
        """
        return self._vp_door("multiply_ggn", vector)

    def multiply_ggn_unweighted(self, vector):
        r""":math:`G_n v_n` (``multiply_ggn`` without the weight)."""
        return self._vp_door("multiply_ggn_unweighted", vector, weighted=False)

    def multiply_ggn_factor(self, vector):
        r"""Per-example :math:`\sqrt{w}\, B_n u_n` with :math:`B_n B_n^\top = G_n`.

        Parameters
        ----------
        vector : array
            Of shape ``ggn_factor_inner_shape``.

        Returns
        -------
        tuple of arrays
            Shaped like ``parameter_dependants``.
        """
        return self._factor_vp_door("multiply_ggn_factor", vector, self.ggn_factor_inner_shape)

    def multiply_ggn_factor_unweighted(self, vector):
        r""":math:`B_n u_n` (``multiply_ggn_factor`` without :math:`\sqrt w`)."""
        return self._factor_vp_door("multiply_ggn_factor_unweighted", vector,
                                    self.ggn_factor_inner_shape, weighted=False)

    def multiply_ggn_factor_transpose(self, vector):
        r"""Per-example :math:`\sqrt{w}\, B_n^\top v_n`.

        Parameters
        ----------
        vector : tuple of arrays
            Shaped like ``parameter_dependants``.

        Returns
        -------
        array
            Of shape ``ggn_factor_inner_shape`` (a single array, not a tuple).
        """
        return self._factor_t_vp_door("multiply_ggn_factor_transpose", vector)

    def multiply_ggn_factor_transpose_unweighted(self, vector):
        r""":math:`B_n^\top v_n` (without :math:`\sqrt w`)."""
        return self._factor_t_vp_door("multiply_ggn_factor_transpose_unweighted", vector,
                                      weighted=False)

    def multiply_ggn_factor_replicated_one_hot(self, index):
        r"""Per-example :math:`\sqrt{w}\, B_n e_{\text{index}}` (a column of the factor).

        The replicated one-hot vector has, in every example's slice of the inner shape, a 1
        at ``index`` and 0 elsewhere; the result equals ``multiply_ggn_factor`` of it.

        Parameters
        ----------
        index : sequence of int
            One integer per non-batch axis of ``ggn_factor_inner_shape``.

        Returns
        -------
        tuple of arrays
            Shaped like ``parameter_dependants``.
        """
        return self._column_door("multiply_ggn_factor_replicated_one_hot", index,
                                 self.ggn_factor_inner_shape)

    def multiply_ggn_factor_replicated_one_hot_unweighted(self, index):
        r""":math:`B_n e_{\text{index}}` (without :math:`\sqrt w`)."""
        return self._column_door("multiply_ggn_factor_replicated_one_hot_unweighted", index,
                                 self.ggn_factor_inner_shape, weighted=False)

    def ggn_matrix(self):
        r"""Dense per-example GGN :math:`w\,G_n`, shape ``[N, D, D]`` (see module docstring)."""
        return self._curvature_matrix()

    def ggn_factor_matrix(self):
        r"""Dense per-example factor :math:`\sqrt{w}\,B_n`, shape ``[N, D, K]``."""
        return self._factor_matrix()

    # -- the formulas a subclass implements (unchecked; weight included) ---------------------
    @abc.abstractmethod
    def _curvature_vp(self, vector, weighted=True):
        """:math:`w\\,C_n v_n` for a validated tuple ``vector`` (:math:`w \\to 1` unweighted)."""

    @abc.abstractmethod
    def _factor_vp(self, vector, weighted=True):
        """:math:`\\sqrt w\\,B_n u_n` (a tuple) for a validated inner-shape array."""

    @abc.abstractmethod
    def _factor_t_vp(self, vector, weighted=True):
        """:math:`\\sqrt w\\,B_n^\\top v_n` (one inner-shape array) for a validated tuple."""

    @abc.abstractmethod
    def _factor_column(self, index, weighted=True):
        """:math:`\\sqrt w\\,B_n e_{\\text{index}}` (a tuple) for a validated index tuple."""

    @abc.abstractmethod
    def _curvature_matrix(self):
        """Dense :math:`w\\,C_n`, ``[N, D, D]``."""

    @abc.abstractmethod
    def _factor_matrix(self):
        """Dense :math:`\\sqrt w\\,B_n`, ``[N, D, K]``."""


@capabilities(dask="yes")
class NegativeLogProbLoss(LossFunction):
    r"""Negative log-likelihood :math:`\ell_n = -\log p(y_n \mid f_n)` with Fisher products.

    .. math::

        F_n = \mathbb E_{y\sim p(\cdot\mid f_n)}\big[\nabla_{f}\ell_n(y)\,
        \nabla_{f}\ell_n(y)^\top\big] = B_n B_n^\top ,

    the Fisher information of the predictive distribution with respect to its parameters
    ``params`` (= the parameter dependants).  ``grad_of_evaluate_on_sample`` gives the
    single-sample Monte-Carlo vectors whose outer products are unbiased for :math:`F_n`
    (Martens & Grosse 2015, §5).

    The Fisher products run the same private formulas as the GGN products
    (``_curvature_vp``, ``_factor_vp``, ...): every loss here has :math:`G_n = F_n`, by
    the natural-parameter identity or by the stated split of the mean-variance normal.  A
    subclass whose GGN differs from its Fisher is not one of these.

    Parameters
    ----------
    weight : float or 0-D array
        Non-negative scalar :math:`w`.

    References
    ----------
    kfac-jax ``NegativeLogProbLoss``; TF K-FAC ``NegativeLogProbLoss``.
    """

    _hessian_uses_targets = True
    """Whether the Hessian of the loss depends on the targets (false for natural params)."""

    @property
    def parameter_dependants(self) -> tuple:
        return self.params

    @property
    @abc.abstractmethod
    def params(self) -> tuple:
        """Parameters of the predictive distribution (the network outputs)."""

    @property
    @abc.abstractmethod
    def fisher_factor_inner_shape(self) -> tuple:
        """Shape of the array that ``multiply_fisher_factor`` takes (``[N, K...]``)."""

    # -- sampling -----------------------------------------------------------------------------
    def sample(self, rng):
        """Targets drawn from the predictive distribution :math:`y_n \\sim p(\\cdot\\mid f_n)`.

        Parameters
        ----------
        rng : numpy.random.Generator or JAX PRNG key
            Source of the host-side noise (same seed, same samples on every backend); for
            JAX inputs also a key (``jax.random.key(0)``), drawn with :mod:`jax.random`.

        Returns
        -------
        array
            Targets in the form ``evaluate`` accepts.  Parameters with NaN entries (value
            checks off, traced or lazy) give marked draws, not plausible ones: class −1,
            a NaN one-hot row, a NaN Bernoulli entry, a NaN Gaussian draw.

        Notes
        -----
        The noise (uniforms or normals) is drawn on the host from ``rng`` and moved to the
        logits' device; only the transformation to targets is array code.  Under
        ``jax.jit`` the draw therefore happens once, when the function is traced: the noise
        is a constant of the compiled function and every call returns the same samples.
        To resample under ``jit``, pass a JAX key as an argument of the jitted function
        (drawn with :mod:`jax.random` at every call), or draw outside it (call ``sample``
        eagerly, or pass the targets in as an argument).
        """
        return self._sample(check_random_source(self._fname("sample"), "rng", rng,
                                                self.params[0]))

    @abc.abstractmethod
    def _sample(self, rng): ...

    def grad_of_evaluate_on_sample(self, rng, coefficient_mode="regular"):
        r"""``grad_of_evaluate(sample(rng), coefficient_mode)``.

        .. math::

            \hat g_n = c\,\nabla_f \ell_n(\tilde y_n),\quad \tilde y_n\sim p(\cdot\mid f_n),
            \qquad \mathbb E[\hat g_n \hat g_n^\top] = c^2 F_n .

        With ``coefficient_mode="sqrt"``, :math:`c^2 = w` and the outer products are unbiased
        for the weighted Fisher.
        """
        func = self._fname("grad_of_evaluate_on_sample")
        check_random_source(func, "rng", rng, self.params[0])
        mode = self._check_mode(func, coefficient_mode)
        return self._grad(self._sample(rng), mode)

    # -- Fisher products ----------------------------------------------------------------------
    def multiply_fisher(self, vector):
        r"""Per-example Fisher product :math:`w\, F_n v_n`.

        Parameters
        ----------
        vector : tuple of arrays
            Shaped like ``params``.

        Returns
        -------
        tuple of arrays
            Shaped like ``params``.
        """
        return self._vp_door("multiply_fisher", vector)

    def multiply_fisher_unweighted(self, vector):
        r""":math:`F_n v_n` (without the weight)."""
        return self._vp_door("multiply_fisher_unweighted", vector, weighted=False)

    def multiply_fisher_factor(self, vector):
        r"""Per-example :math:`\sqrt{w}\, B_n u_n` with :math:`B_n B_n^\top = F_n`.

        Parameters
        ----------
        vector : array
            Of shape ``fisher_factor_inner_shape``.

        Returns
        -------
        tuple of arrays
            Shaped like ``params``.
        """
        return self._factor_vp_door("multiply_fisher_factor", vector,
                                    self.fisher_factor_inner_shape)

    def multiply_fisher_factor_unweighted(self, vector):
        r""":math:`B_n u_n` (without :math:`\sqrt w`)."""
        return self._factor_vp_door("multiply_fisher_factor_unweighted", vector,
                                    self.fisher_factor_inner_shape, weighted=False)

    def multiply_fisher_factor_transpose(self, vector):
        r"""Per-example :math:`\sqrt{w}\, B_n^\top v_n`.

        Parameters
        ----------
        vector : tuple of arrays
            Shaped like ``params``.

        Returns
        -------
        array
            Of shape ``fisher_factor_inner_shape`` (a single array, not a tuple).
        """
        return self._factor_t_vp_door("multiply_fisher_factor_transpose", vector)

    def multiply_fisher_factor_transpose_unweighted(self, vector):
        r""":math:`B_n^\top v_n` (without :math:`\sqrt w`)."""
        return self._factor_t_vp_door("multiply_fisher_factor_transpose_unweighted", vector,
                                      weighted=False)

    def multiply_fisher_factor_replicated_one_hot(self, index):
        r"""Per-example :math:`\sqrt{w}\, B_n e_{\text{index}}` (a column of the factor).

        Equals ``multiply_fisher_factor`` of the replicated one-hot vector (1 at ``index``
        in every example's slice of ``fisher_factor_inner_shape``, 0 elsewhere).

        Parameters
        ----------
        index : sequence of int
            One integer per non-batch axis of ``fisher_factor_inner_shape``.

        Returns
        -------
        tuple of arrays
            Shaped like ``params``.
        """
        return self._column_door("multiply_fisher_factor_replicated_one_hot", index,
                                 self.fisher_factor_inner_shape)

    def multiply_fisher_factor_replicated_one_hot_unweighted(self, index):
        r""":math:`B_n e_{\text{index}}` (without :math:`\sqrt w`)."""
        return self._column_door("multiply_fisher_factor_replicated_one_hot_unweighted", index,
                                 self.fisher_factor_inner_shape, weighted=False)

    def fisher_matrix(self):
        r"""Dense per-example Fisher :math:`w\,F_n`, shape ``[N, D, D]``."""
        return self._curvature_matrix()

    def fisher_factor_matrix(self):
        r"""Dense per-example factor :math:`\sqrt{w}\,B_n`, shape ``[N, D, K]``."""
        return self._factor_matrix()

    def hessian_matrix(self, targets=None):
        r"""Dense per-example Hessian :math:`w\,\nabla^2_{f}\ell_n(y_n)`, shape ``[N, D, D]``.

        For natural parameters this is the Fisher and does not depend on the targets (given
        targets are validated, then not used); for
        :class:`~kfac_ref.losses.NormalMeanVarianceNegativeLogProbLoss` it does, and it is
        indefinite in general (only its expectation over :math:`y` is the Fisher).
        """
        func = self._fname("hessian_matrix")
        if self._hessian_uses_targets:
            targets = self._resolve_targets(func, targets)
        elif targets is not None:
            targets = self._check_targets(func, targets)
        return self._hessian_matrix(targets)

    @abc.abstractmethod
    def _hessian_matrix(self, targets=None):
        """Dense :math:`w\\,\\nabla^2_f\\ell_n` ``[N, D, D]`` at validated targets."""

    @property
    def ggn_factor_inner_shape(self) -> tuple:
        return self.fisher_factor_inner_shape


@capabilities(dask="yes")
class NaturalParamsNegativeLogProbLoss(NegativeLogProbLoss):
    r"""Negative log-likelihood of an exponential family in its natural parameters.

    .. math::

        p(y\mid f) = h(y)\exp\big(T(y)^\top f - A(f)\big)
        \;\Rightarrow\;
        \nabla^2_f \ell = \nabla^2 A(f) = \mathrm{Cov}[T(y)] = F = G ,

    so the Hessian of the loss, the Fisher and the GGN coincide and do not depend on the
    targets.  Softmax cross-entropy, sigmoid cross-entropy and the fixed-variance normal
    are of this kind.

    References
    ----------
    Martens (2014), arXiv:1412.1193, §9.2; kfac-jax / TF K-FAC
    ``NaturalParamsNegativeLogProbLoss``.
    """

    _hessian_uses_targets = False

    @property
    def fisher_factor_inner_shape(self) -> tuple:
        """The shape of ``params[0]``: in natural parameters :math:`B_n` is square."""
        return tuple(self.params[0].shape)

    def _hessian_matrix(self, targets=None):
        return self._curvature_matrix()


# --------------------------------------------------------------------------------------
# Categorical
# --------------------------------------------------------------------------------------
@capabilities(jit="yes", dask="yes")
class CategoricalLogitsNegativeLogProbLoss(NaturalParamsNegativeLogProbLoss):
    r"""Softmax cross-entropy: categorical distribution over :math:`k` classes given by logits.

    .. math::

        \begin{aligned}
        p &= \mathrm{softmax}(z), \\
        \ell(y) &= -\log p_y = \log\textstyle\sum_j e^{z_j} - z_y, \\
        \nabla_z \ell &= p - e_y, \\
        F = G = \nabla^2_z \ell &= \mathrm{diag}(p) - p p^\top, \\
        B &= \mathrm{diag}(\sqrt p) - p\,\sqrt{p}^{\,\top}, \qquad B B^\top = F
        \end{aligned}

    (the last identity uses :math:`\sqrt p^{\,\top}\sqrt p = 1`).  :math:`F` is singular
    (:math:`F\mathbf 1 = 0`: adding a constant to all logits changes nothing), and so is
    :math:`B`.  The inner shape of the factor is that of the logits, ``[N, k]``.

    ``log p`` is computed as :math:`(z - m) - \log\sum_j e^{z_j - m}` with
    :math:`m = \max_j z_j`, and :math:`\sqrt p = \exp(\tfrac12 \log p)`, so logits of any
    finite size (:math:`|z| \approx 100` and beyond) give finite values.  The gradient's
    target entry :math:`p_y - 1` is computed as :math:`-\sum_{c\ne y} p_c`, so it stays
    accurate relative to its size when :math:`p_y \approx 1`; the Fisher entries
    :math:`p_c(1 - p_c)` of a near-certain class are accurate to eps in absolute terms only
    (as in kfac-jax).

    Registered with kfac-jax's ``register_softmax_cross_entropy_loss``, the objective is
    :math:`\frac{w}{N}\sum_n m_n\ell_n` (:math:`m_n` the mask); the products here are the
    per-example :math:`w\,m_n F_n v_n` (no 1/N, see the module docstring).

    Parameters
    ----------
    logits : array [N, k]
        Real floating, finite.
    targets : array [N], optional
        Integer class indices in :math:`[0, k)`.
    mask : array [N], optional
        0/1 values (bool, integer or floating).  Masked-out examples have zero loss,
        gradient and curvature; every product is multiplied by the mask (as in kfac-jax).
    weight : float
        Non-negative :math:`w`.

    Raises
    ------
    KFACValueError, KFACTypeError
        Logits not 2-D, non-floating or non-finite; targets of wrong shape or dtype or out
        of range; mask of wrong shape or not 0/1; negative weight; arrays from different
        namespaces or devices.

    References
    ----------
    kfac-jax / TF K-FAC ``CategoricalLogitsNegativeLogProbLoss``; Martens (2014) §9.2.
    """

    _layout = "[N, k]"
    _dependant_names = ("logits",)

    def __init__(self, logits, targets=None, mask=None, weight=1.0):
        func = self._fname("__init__")
        self._ns = namespace_of(func, logits=logits, targets=targets, mask=mask,
                                **_arrays_only(weight=weight))
        check_array(func, "logits", logits, ndim=2, layout=self._layout)
        if logits.shape[1] == 0:  # softmax over no classes: log Σ_j e^{z_j} = -inf
            raise KFACValueError(f"{func}: logits must have at least one class (k >= 1); got "
                                 f"{describe(logits)}.")
        self._logits = logits
        self._set_weight(func, weight)
        self._targets = None if targets is None else self._check_targets(func, targets)
        self._mask_in = mask
        self._mask = None if mask is None else self._check_mask(func, mask)

    # -- inputs ---------------------------------------------------------------------------
    def _check_mask(self, func, mask):
        xp = self._ns
        n = self._logits.shape[0]
        check_array(func, "mask", mask, shape=(n,), dtype=None, layout="[N] of 0/1")
        if not (xp.isdtype(mask.dtype, "bool") or xp.isdtype(mask.dtype, "numeric")) or \
                xp.isdtype(mask.dtype, "complex floating"):
            raise KFACTypeError(f"{func}: mask must be a bool, integer or real floating array; "
                                f"got {describe(mask)}.")
        m = xp.astype(mask, self._logits.dtype)
        bad = ~((m == 0.0) | (m == 1.0))
        if checks_values(mask) and any_true(xp, bad):
            raise KFACValueError(f"{func}: mask must hold only 0 and 1; got "
                                 f"{int(xp.sum(xp.astype(bad, xp.int32)))} other value(s).")
        return m

    def _check_targets(self, func, targets):
        xp = self._namespace(func, targets=targets)
        n, k = self._logits.shape
        check_array(func, "targets", targets, shape=(n,), dtype="integral",
                    layout="[N] of class indices")
        if n and checks_values(targets) and any_true(xp, (targets < 0) | (targets >= k)):
            raise KFACValueError(
                f"{func}: targets must be class indices in [0, {k}); got values in "
                f"[{int(xp.min(targets))}, {int(xp.max(targets))}].")
        return targets

    @property
    def logits(self):
        """The logits ``[N, k]``."""
        return self._logits

    @property
    def targets(self):
        return self._targets

    @property
    def mask(self):
        """The 0/1 mask ``[N]`` in the logits' dtype (``None`` if not given)."""
        return self._mask

    @property
    def params(self) -> tuple:
        return (self._logits,)

    @property
    def parameter_independants(self) -> tuple:
        return (self._targets, self._mask_in, self._weight)

    def _with_inputs(self, inputs):
        return type(self)(inputs[0], targets=self._targets, mask=self._mask_in,
                          weight=self._weight)

    # -- formulas -------------------------------------------------------------------------
    def _log_probs(self):
        return _log_softmax(self._xp, self._logits)

    def _probs(self):
        return self._xp.exp(self._log_probs())

    def _sqrt_probs(self):
        return self._xp.exp(0.5 * self._log_probs())

    def _masked(self, x):
        """Multiply a per-example quantity [N, ...] by the mask."""
        if self._mask is None:
            return x
        return x * self._xp.reshape(self._mask, (x.shape[0],) + (1,) * (x.ndim - 1))

    def _one_hot_targets(self, targets):
        """[N] class indices -> [N, k] 0/1 rows in the logits' dtype."""
        xp = self._xp
        classes = asarray_like(np.arange(self._logits.shape[1]), targets)
        return xp.astype(targets[:, None] == classes[None, :], self._logits.dtype)

    def _targets_as_one_hot(self, targets):
        return self._one_hot_targets(targets)

    def _evaluate(self, targets=None, coefficient_mode="regular"):
        xp = self._xp
        y = self._targets_as_one_hot(self._given(targets))
        c = self._coefficient(coefficient_mode)
        return self._masked(-xp.sum(y * self._log_probs(), axis=-1)) * c

    def _grad(self, targets=None, coefficient_mode="regular"):
        # p - y written as p(1 - y) - y Σ_c p_c (1 - y_c): equal for one-hot y, and the
        # target-class entry p_y - 1 = -Σ_{c≠y} p_c is then a sum of small accurate terms
        # instead of a cancelling difference (relative accuracy when p_y ≈ 1).
        xp = self._xp
        p = self._probs()
        y = self._targets_as_one_hot(self._given(targets))
        c = self._coefficient(coefficient_mode)
        rest = xp.sum(p * (1.0 - y), axis=-1, keepdims=True)
        return (self._masked(p * (1.0 - y) - y * rest) * c,)

    def _sample(self, rng):
        # Gumbel-max: argmax_c (z_c + g_c), g_c iid Gumbel(0, 1), is distributed as softmax(z)
        # and needs no cumulative sums (exact at any logit size).
        xp = self._xp
        g = draw_noise(rng, self._logits, "gumbel", self._logits.shape)
        draws = xp.argmax(self._logits + g, axis=-1)
        # NaN logits have no distribution: class -1 (no class) instead of argmax's guess,
        # decided without a host read so it holds with value checks off, traced and lazy
        return xp.where(xp.any(xp.isnan(self._logits), axis=-1), -1, draws)

    def _curvature_vp(self, vector, weighted=True):
        xp = self._xp
        (v,) = vector
        p = self._probs()
        fv = p * v - p * xp.sum(p * v, axis=-1, keepdims=True)
        return (self._masked(fv) * self._w(weighted),)

    def _factor_vp(self, vector, weighted=True):
        xp = self._xp
        p, q = self._probs(), self._sqrt_probs()
        bu = q * vector - p * xp.sum(q * vector, axis=-1, keepdims=True)
        return (self._masked(bu) * self._sqrt_w(weighted),)

    def _factor_t_vp(self, vector, weighted=True):
        xp = self._xp
        (v,) = vector
        p, q = self._probs(), self._sqrt_probs()
        btv = q * v - q * xp.sum(p * v, axis=-1, keepdims=True)
        return self._masked(btv) * self._sqrt_w(weighted)

    def _factor_column(self, index, weighted=True):
        # Column c of B: sqrt(p_c) (e_c - p).
        (c,) = index
        e = self._one_hot_event(index, (self._logits.shape[1],))
        q_c = self._sqrt_probs()[:, c:c + 1]
        return (self._masked(q_c * (e - self._probs())) * self._sqrt_w(weighted),)

    def _curvature_matrix(self):
        xp = self._xp
        p = self._probs()
        return self._masked(_diag_embed(xp, p) - p[:, :, None] * p[:, None, :]) * self._weight

    def _factor_matrix(self):
        xp = self._xp
        p, q = self._probs(), self._sqrt_probs()
        b = _diag_embed(xp, q) - p[:, :, None] * q[:, None, :]
        return self._masked(b) * self._sqrt_weight


@capabilities(jit="yes", dask="yes")
class OneHotCategoricalLogitsNegativeLogProbLoss(CategoricalLogitsNegativeLogProbLoss):
    r"""Softmax cross-entropy with one-hot targets (the OneHotCategorical distribution).

    .. math::

        \begin{aligned}
        \ell(y) &= -\sum_c y_c \log p_c, \qquad y\in\{e_1,\dots,e_k\}, \\
        F = G &= \mathrm{diag}(p) - p p^\top, \\
        B &= \mathrm{diag}(\sqrt p) - p\sqrt p^{\,\top}.
        \end{aligned}

    Identical to :class:`~kfac_ref.losses.CategoricalLogitsNegativeLogProbLoss` (same
    Fisher, factors and mask semantics) except that targets and samples are one-hot rows
    ``[N, k]`` in the logits' dtype rather than class indices.

    Parameters
    ----------
    logits : array [N, k]
    targets : array [N, k], optional
        One-hot rows: entries 0/1 (bool, integer or floating), exactly one 1 per row.
        Soft labels are rejected (they are not samples of this distribution).
    mask : array [N], optional
    weight : float

    Raises
    ------
    KFACValueError, KFACTypeError
        As the categorical loss; targets of wrong shape or not one-hot.

    References
    ----------
    kfac-jax ``OneHotCategoricalLogitsNegativeLogProbLoss``.
    """

    def _check_targets(self, func, targets):
        xp = self._namespace(func, targets=targets)
        n, k = self._logits.shape
        check_array(func, "targets", targets, shape=(n, k), dtype=None,
                    layout="[N, k] of one-hot rows")
        if not (xp.isdtype(targets.dtype, "bool") or xp.isdtype(targets.dtype, "integral")
                or xp.isdtype(targets.dtype, "real floating")):
            raise KFACTypeError(f"{func}: targets must be a bool, integer or real floating "
                                f"array; got {describe(targets)}.")
        y = xp.astype(targets, self._logits.dtype)
        if n and k and checks_values(targets) and (any_true(xp, ~((y == 0.0) | (y == 1.0)))
                                                   or any_true(xp, xp.sum(y, axis=-1) != 1.0)):
            raise KFACValueError(f"{func}: targets must be one-hot rows (entries 0/1, exactly "
                                 f"one 1 per row); got {describe(targets)} that is not.")
        return y

    def _targets_as_one_hot(self, targets):
        return targets

    def _sample(self, rng):
        draws = super()._sample(rng)  # class -1 where a row has a NaN logit
        # that row has no distribution: a NaN row, not a one-hot guess
        return self._xp.where((draws == -1)[:, None], self._xp.nan,
                              self._one_hot_targets(draws))


# --------------------------------------------------------------------------------------
# Multi-Bernoulli
# --------------------------------------------------------------------------------------
@capabilities(jit="yes", dask="yes")
class MultiBernoulliNegativeLogProbLoss(NaturalParamsNegativeLogProbLoss):
    r"""Sigmoid cross-entropy: independent Bernoulli variables given by logits.

    .. math::

        p = \sigma(z),\qquad
        \ell(y) = -\sum_j \big[y_j\log\sigma(z_j) + (1-y_j)\log\sigma(-z_j)\big],\qquad
        \nabla_z\ell = p - y,

        F = G = \nabla^2_z\ell = \mathrm{diag}\big(p(1-p)\big),\qquad
        B = B^\top = \mathrm{diag}\big(\sqrt{p(1-p)}\big).

    :math:`\log\sigma(z) = \min(z,0) - \log(1+e^{-|z|})` and
    :math:`p(1-p) = \exp(\log\sigma(z) + \log\sigma(-z))`, so large logits give finite,
    correctly tiny curvature instead of :math:`1\cdot(1-1) = 0`, and the gradient is formed
    as :math:`(1-y)\sigma(z) - y\,\sigma(-z)`, without cancellation when :math:`\sigma(z)
    \approx y`.

    ``evaluate`` sums over all non-batch axes and returns ``[N]``; kfac-jax returns the
    unsummed element-wise values (``distrax.Bernoulli``) — their sum over the non-batch axes
    is this.  Registered via ``register_sigmoid_cross_entropy_loss`` the objective is
    :math:`\frac{w}{N}\sum_n \ell_n`; products here are per example (no 1/N).

    Parameters
    ----------
    logits : array [N, ...]
        At least 2-D, real floating, finite.
    targets : array, optional
        Same shape as ``logits``; values in :math:`[0, 1]` (bool, integer or floating; soft
        labels are accepted for ``evaluate``).  Samples are 0/1 in the logits' dtype.
    weight : float

    Raises
    ------
    KFACValueError, KFACTypeError
        Bad logits, targets of wrong shape or outside [0, 1], negative weight.

    References
    ----------
    kfac-jax / TF K-FAC ``MultiBernoulliNegativeLogProbLoss``.
    """

    _dependant_names = ("logits",)

    def __init__(self, logits, targets=None, weight=1.0):
        func = self._fname("__init__")
        self._ns = namespace_of(func, logits=logits, targets=targets,
                                **_arrays_only(weight=weight))
        check_array(func, "logits", logits, min_ndim=2, layout="[N, ...]")
        self._logits = logits
        self._set_weight(func, weight)
        self._targets = None if targets is None else self._check_targets(func, targets)

    def _check_targets(self, func, targets):
        xp = self._namespace(func, targets=targets)
        check_array(func, "targets", targets, shape=tuple(self._logits.shape), dtype=None,
                    layout="like logits, values in [0, 1]")
        if xp.isdtype(targets.dtype, "real floating"):
            self._check_dtype(func, "targets", targets)
        elif not (xp.isdtype(targets.dtype, "bool") or xp.isdtype(targets.dtype, "integral")):
            raise KFACTypeError(f"{func}: targets must be a bool, integer or real floating "
                                f"array; got {describe(targets)}.")
        y = xp.astype(targets, self._logits.dtype)
        if size_of(y) and checks_values(targets) and any_true(xp, (y < 0.0) | (y > 1.0)):
            raise KFACValueError(f"{func}: targets must lie in [0, 1]; got values in "
                                 f"[{float(xp.min(y))}, {float(xp.max(y))}].")
        return y

    @property
    def logits(self):
        """The logits ``[N, ...]``."""
        return self._logits

    @property
    def targets(self):
        return self._targets

    @property
    def params(self) -> tuple:
        return (self._logits,)

    @property
    def parameter_independants(self) -> tuple:
        return (self._targets, self._weight)

    def _with_inputs(self, inputs):
        return type(self)(inputs[0], targets=self._targets, weight=self._weight)

    def _log_variance(self):
        xp = self._xp
        return _log_sigmoid(xp, self._logits) + _log_sigmoid(xp, -self._logits)

    def _variance(self):  # p (1 - p)
        return self._xp.exp(self._log_variance())

    def _sqrt_variance(self):
        return self._xp.exp(0.5 * self._log_variance())

    def _evaluate(self, targets=None, coefficient_mode="regular"):
        xp = self._xp
        z, y = self._logits, self._given(targets)
        per_element = -(y * _log_sigmoid(xp, z) + (1.0 - y) * _log_sigmoid(xp, -z))
        return xp.sum(_flat(xp, per_element), axis=-1) * self._coefficient(coefficient_mode)

    def _grad(self, targets=None, coefficient_mode="regular"):
        # σ(z) - y = (1 - y) σ(z) - y σ(-z): no cancellation when σ(z) ≈ y.
        xp = self._xp
        z, y = self._logits, self._given(targets)
        g = (1.0 - y) * xp.exp(_log_sigmoid(xp, z)) - y * xp.exp(_log_sigmoid(xp, -z))
        return (g * self._coefficient(coefficient_mode),)

    def _sample(self, rng):
        # y = [z + L > 0] with L ~ Logistic(0, 1): P(y = 1) = P(L > -z) = σ(z).
        xp = self._xp
        noise = draw_noise(rng, self._logits, "logistic", self._logits.shape)
        draws = xp.astype(self._logits + noise > 0.0, self._logits.dtype)
        return xp.where(xp.isnan(self._logits), xp.nan, draws)  # NaN logit: NaN, not 0

    def _curvature_vp(self, vector, weighted=True):
        return (self._variance() * vector[0] * self._w(weighted),)

    def _factor_vp(self, vector, weighted=True):
        return (self._sqrt_variance() * vector * self._sqrt_w(weighted),)

    def _factor_t_vp(self, vector, weighted=True):
        return self._sqrt_variance() * vector[0] * self._sqrt_w(weighted)

    def _factor_column(self, index, weighted=True):
        e = self._one_hot_event(index, tuple(self._logits.shape[1:]))
        return (self._sqrt_variance() * e * self._sqrt_w(weighted),)

    def _curvature_matrix(self):
        return _diag_embed(self._xp, _flat(self._xp, self._variance())) * self._weight

    def _factor_matrix(self):
        return _diag_embed(self._xp, _flat(self._xp, self._sqrt_variance())) * self._sqrt_weight


# --------------------------------------------------------------------------------------
# Normal with fixed variance
# --------------------------------------------------------------------------------------
@capabilities(jit="yes", dask="yes")
class NormalMeanNegativeLogProbLoss(NaturalParamsNegativeLogProbLoss):
    r"""Normal distribution with mean :math:`\mu` (the output) and fixed scalar variance :math:`v`.

    .. math::

        \ell(y) = \frac{\lVert y-\mu\rVert^2}{2v} + \big[\tfrac D2\log(2\pi v)\big],\qquad
        \nabla_\mu\ell = \frac{\mu - y}{v},

        F = G = \nabla^2_\mu\ell = \frac1v I,\qquad B = B^\top = \frac{1}{\sqrt v} I.

    The bracketed constant is included when ``normalize_log_prob`` is true.

    **The factor-2 pitfall.**  The default :math:`v = 1/2` makes :math:`\ell` the *plain*
    squared error :math:`\lVert y-\mu\rVert^2` (kfac-jax ``register_squared_error_loss``,
    PyTorch ``MSELoss(reduction="sum")``), whose curvature is :math:`2I`, not :math:`I`.
    For :math:`\tfrac12\lVert y-\mu\rVert^2` use :math:`v = 1` (curvature :math:`I`).
    Mixing the two conventions scales every output-side factor by 2 (curvlinops #82).
    ``register_normal_predictive_distribution`` declares
    :math:`\frac{w}{N}\sum_n\ell_n`; the products here are per example (no 1/N).

    Parameters
    ----------
    mean : array [N, ...]
        At least 2-D, real floating, finite.
    targets : array, optional
        Same shape and dtype as ``mean``, finite.
    variance : float or 0-D array
        Positive scalar :math:`v` (a 0-D array in the namespace, device and dtype of
        ``mean``).  Default 0.5 (squared error).
    weight : float
    normalize_log_prob : bool
        Include the additive normalising constant in ``evaluate``.

    Raises
    ------
    KFACValueError, KFACTypeError
        Bad mean or targets, non-positive variance, negative weight.

    References
    ----------
    kfac-jax ``NormalMeanNegativeLogProbLoss``; the docs page *Losses: output curvature and
    its factors* (variance conventions); curvlinops issue #82.
    """

    _dependant_names = ("mean",)

    def __init__(self, mean, targets=None, variance=0.5, weight=1.0, normalize_log_prob=True):
        func = self._fname("__init__")
        self._ns = namespace_of(func, mean=mean, targets=targets,
                                **_arrays_only(variance=variance, weight=weight))
        check_array(func, "mean", mean, min_ndim=2, layout="[N, ...]")
        self._mean = mean
        self._set_weight(func, weight)
        self._variance = check_scalar(func, "variance", variance, positive=True)
        self._sqrt_variance = _sqrt(self._ns, self._variance)
        self._normalize = check_bool(func, "normalize_log_prob", normalize_log_prob)
        self._targets = None if targets is None else self._check_targets(func, targets)

    def _check_targets(self, func, targets):
        return self._check_shaped(func, "targets", targets, self._mean.shape, "like mean")

    @property
    def mean(self):
        """The mean ``[N, ...]``."""
        return self._mean

    @property
    def variance(self):
        """The fixed scalar variance :math:`v` (a float, or the 0-D array given)."""
        return self._variance

    @property
    def normalize_log_prob(self) -> bool:
        r"""Whether ``evaluate`` includes the constant :math:`\tfrac D2\log(2\pi v)`."""
        return self._normalize

    @property
    def targets(self):
        return self._targets

    @property
    def params(self) -> tuple:
        return (self._mean,)

    @property
    def parameter_independants(self) -> tuple:
        return (self._targets, self._variance, self._weight, self._normalize)

    def _with_inputs(self, inputs):
        return type(self)(inputs[0], targets=self._targets, variance=self._variance,
                          weight=self._weight, normalize_log_prob=self._normalize)

    def _evaluate(self, targets=None, coefficient_mode="regular"):
        xp = self._xp
        r = _flat(xp, self._given(targets) - self._mean)
        value = xp.sum(r * r, axis=-1) / (2.0 * self._variance)
        if self._normalize:
            value = value + 0.5 * r.shape[1] * (_LOG_2PI + _log(xp, self._variance))
        return value * self._coefficient(coefficient_mode)

    def _grad(self, targets=None, coefficient_mode="regular"):
        c = self._coefficient(coefficient_mode)
        return ((self._mean - self._given(targets)) * (c / self._variance),)

    def _sample(self, rng):
        z = draw_noise(rng, self._mean, "normal", self._mean.shape)
        return self._mean + self._sqrt_variance * z

    def _curvature_vp(self, vector, weighted=True):
        return (vector[0] * (self._w(weighted) / self._variance),)

    def _factor_vp(self, vector, weighted=True):
        return (vector * (self._sqrt_w(weighted) / self._sqrt_variance),)

    def _factor_t_vp(self, vector, weighted=True):
        return vector[0] * (self._sqrt_w(weighted) / self._sqrt_variance)

    def _factor_column(self, index, weighted=True):
        xp = self._xp
        e = self._one_hot_event(index, tuple(self._mean.shape[1:]))
        ones = xp.ones_like(self._mean)
        return (ones * e * (self._sqrt_w(weighted) / self._sqrt_variance),)

    def _identity_batch(self):
        xp = self._xp
        d = _flat(xp, self._mean).shape[1]
        return xp.ones_like(_flat(xp, self._mean))[:, :, None] * eye_like(self._mean, d)[None, :, :]

    def _curvature_matrix(self):
        return self._identity_batch() * (self._weight / self._variance)

    def _factor_matrix(self):
        return self._identity_batch() * (self._sqrt_weight / self._sqrt_variance)


# --------------------------------------------------------------------------------------
# Normal with mean and variance
# --------------------------------------------------------------------------------------
@capabilities(jit="yes", dask="yes")
class NormalMeanVarianceNegativeLogProbLoss(NegativeLogProbLoss):
    r"""Normal distribution whose mean :math:`\mu` and variance :math:`v` are both outputs.

    Per coordinate :math:`j` (coordinates independent), with :math:`r = y - \mu`:

    .. math::

        \begin{aligned}
        \ell &= \sum_j \Big[\frac{r_j^2}{2v_j} + \tfrac12\log(2\pi v_j)\Big], \\
        \nabla_{\mu_j}\ell &= -\frac{r_j}{v_j}, \qquad
        \nabla_{v_j}\ell = \frac{1}{2v_j} - \frac{r_j^2}{2v_j^2}, \\
        F &= \mathrm{diag}\Big(\frac1{v},\ \frac{1}{2v^2}\Big), \\
        B &= B^\top = \mathrm{diag}\Big(\frac{1}{\sqrt v},\ \frac{1}{\sqrt2\,v}\Big)
        \end{aligned}

    in the ``[mean, variance]`` parameterisation (the inner shape of the factor is
    ``[N, 2d]``, mean coordinates first, as in kfac-jax).

    **The GGN.**  :math:`(\mu, v)` are not natural parameters, so the Hessian of the loss,

    .. math::

        \nabla^2\ell = \begin{pmatrix} 1/v & r/v^2 \\ r/v^2 & r^2/v^3 - 1/(2v^2)\end{pmatrix}
        \ (\text{per coordinate}),

    depends on :math:`y` and is indefinite when :math:`r^2 < v/2`; only its expectation
    over :math:`y\sim\mathcal N(\mu, v)` is :math:`F` (``hessian_matrix`` returns it).  The
    GGN needs a split of the loss into a convex outer part and an inner map.  kfac_ref splits
    at the natural parameters :math:`\eta = (\mu/v,\ -1/(2v))`: the loss is convex in
    :math:`\eta` with :math:`\nabla^2_\eta\ell = \mathrm{Cov}[(y, y^2)]`, and

    .. math::

        G = J_\eta^\top\,\nabla^2_\eta\ell\,J_\eta = F ,
        \qquad J_\eta = \frac{\partial\eta}{\partial(\mu, v)},

    because the Fisher transforms covariantly under reparameterisation.  So the GGN products
    here equal the Fisher products (PSD, independent of :math:`y`).  kfac-jax raises
    ``NotImplementedError`` for this loss's GGN and TF K-FAC has none; a conformance check
    against them must skip the GGN, not compare with the Hessian.

    Parameters
    ----------
    mean : array [N, d]
        Real floating, finite.
    variance : array [N, d]
        Same dtype, finite and strictly positive.
    targets : array [N, d], optional
        Same dtype, finite.
    weight : float

    Raises
    ------
    KFACValueError, KFACTypeError
        Arrays not 2-D or of different shapes or dtypes, non-finite values, variance with
        a non-positive entry, negative weight.

    References
    ----------
    kfac-jax ``NormalMeanVarianceNegativeLogProbLoss``; Martens (2014), arXiv:1412.1193,
    §9 (GGN = Fisher at the natural parameters).
    """

    _dependant_names = ("mean", "variance")

    def __init__(self, mean, variance, targets=None, weight=1.0):
        func = self._fname("__init__")
        xp = self._ns = namespace_of(func, mean=mean, variance=variance, targets=targets,
                                     **_arrays_only(weight=weight))
        check_array(func, "mean", mean, ndim=2, layout="[N, d]")
        check_array(func, "variance", variance, shape=tuple(mean.shape),
                    layout="[N, d] like mean")
        self._mean = mean
        self._set_weight(func, weight)
        if size_of(variance) and checks_values(variance) and any_true(xp, ~(variance > 0.0)):
            raise KFACValueError(
                f"{func}: variance must be strictly positive; got minimum "
                f"{float(xp.min(variance))!r}.")
        self._variance = variance
        self._targets = None if targets is None else self._check_targets(func, targets)

    def _check_targets(self, func, targets):
        return self._check_shaped(func, "targets", targets, self._mean.shape,
                                  "[N, d] like mean")

    @property
    def mean(self):
        """The mean ``[N, d]``."""
        return self._mean

    @property
    def variance(self):
        """The variance ``[N, d]``."""
        return self._variance

    @property
    def targets(self):
        return self._targets

    @property
    def params(self) -> tuple:
        return (self._mean, self._variance)

    @property
    def parameter_independants(self) -> tuple:
        return (self._targets, self._weight)

    @property
    def fisher_factor_inner_shape(self) -> tuple:
        n, d = self._mean.shape
        return (n, 2 * d)

    def _with_inputs(self, inputs):
        return type(self)(inputs[0], inputs[1], targets=self._targets, weight=self._weight)

    def _factor_diagonals(self, weighted):
        """Diagonals :math:`\\sqrt w/\\sqrt v`, :math:`\\sqrt w/(\\sqrt2\\,v)` of :math:`B`."""
        xp = self._xp
        sw = self._sqrt_w(weighted)
        return sw / xp.sqrt(self._variance), sw / (math.sqrt(2.0) * self._variance)

    def _evaluate(self, targets=None, coefficient_mode="regular"):
        xp = self._xp
        v = self._variance
        r = self._given(targets) - self._mean
        value = xp.sum(r * r / (2.0 * v) + 0.5 * (_LOG_2PI + xp.log(v)), axis=-1)
        return value * self._coefficient(coefficient_mode)

    def _grad(self, targets=None, coefficient_mode="regular"):
        v = self._variance
        r = self._given(targets) - self._mean
        c = self._coefficient(coefficient_mode)
        return (-r / v * c, (0.5 / v - r * r / (2.0 * v * v)) * c)

    def _sample(self, rng):
        xp = self._xp
        z = draw_noise(rng, self._mean, "normal", self._mean.shape)
        return self._mean + xp.sqrt(self._variance) * z

    def _curvature_vp(self, vector, weighted=True):
        v, w = self._variance, self._w(weighted)
        return (vector[0] * w / v, vector[1] * w / (2.0 * v * v))

    def _factor_vp(self, vector, weighted=True):
        a, c = self._factor_diagonals(weighted)
        d = self._mean.shape[1]
        return (a * vector[:, :d], c * vector[:, d:])

    def _factor_t_vp(self, vector, weighted=True):
        a, c = self._factor_diagonals(weighted)
        return self._xp.concat([a * vector[0], c * vector[1]], axis=-1)

    def _factor_column(self, index, weighted=True):
        # Column j of the diagonal factor: mean block for j < d, variance block otherwise.
        a, c = self._factor_diagonals(weighted)
        d = self._mean.shape[1]
        e = self._one_hot_event(index, (2 * d,))
        return (a * e[:, :d], c * e[:, d:])

    def _curvature_matrix(self):
        xp = self._xp
        v = self._variance
        diagonal = xp.concat([1.0 / v, 1.0 / (2.0 * v * v)], axis=-1)
        return _diag_embed(xp, diagonal) * self._weight

    def _factor_matrix(self):
        xp = self._xp
        a, c = self._factor_diagonals(True)
        return _diag_embed(xp, xp.concat([a, c], axis=-1))

    def _hessian_matrix(self, targets=None):
        xp = self._xp
        v = self._variance
        r = self._given(targets) - self._mean
        h_mm = _diag_embed(xp, 1.0 / v)
        h_mv = _diag_embed(xp, r / (v * v))
        h_vv = _diag_embed(xp, r * r / (v * v * v) - 0.5 / (v * v))
        top = xp.concat([h_mm, h_mv], axis=-1)
        bottom = xp.concat([h_mv, h_vv], axis=-1)
        return xp.concat([top, bottom], axis=-2) * self._weight


# --------------------------------------------------------------------------------------
# A user's own loss
# --------------------------------------------------------------------------------------
@capabilities(dask="yes")
class CustomLoss(LossFunction):
    r"""A loss given by three functions of the network output: value, gradient and a square
    root of the Hessian.

    .. math::

        \begin{aligned}
        \texttt{value}(f, y)_n &= \ell_n(f_n, y_n), \qquad
        \texttt{gradient}(f, y)_n = \nabla_{f}\ell_n, \\
        \texttt{hessian\_sqrt}(f, y)_n &= B_n \in \mathbb R^{D\times K},\qquad
        B_n B_n^\top = \nabla^2_{f}\ell_n = G_n ,
        \end{aligned}

    so the loss is split at the output itself (:math:`\eta = f`): the GGN of the network is
    :math:`\frac{w}{N}\sum_n J_n^\top B_n B_n^\top J_n`, which is positive semi-definite
    for any :math:`B_n`, and is the GGN of :math:`\ell` when :math:`\ell` is convex in
    :math:`f` (Schraudolph 2002; Martens 2014, §8).  ``hessian_sqrt`` is called once, at
    construction; every GGN product, the factor and its transpose, the dense matrices and
    the estimation vectors of :mod:`kfac_ref.curvature` are formed from :math:`B_n`.

    Shapes (:math:`D` = the number of output coordinates of one example, flattened
    row-major; :math:`K \ge 1` any number of columns, e.g. :math:`K = D` for a full
    square root, :math:`K = 1` for a rank-one Hessian):

    ==================================  ==============================================
    ``value(outputs, targets)``         ``[N]``: the per-example loss, not reduced
    ``gradient(outputs, targets)``      ``outputs.shape``: per example, no :math:`1/N`
    ``hessian_sqrt(outputs, targets)``  ``[N, D, K]``
    ==================================  ==============================================

    Each returns an array of the outputs' namespace, device and dtype; a result of another
    shape, dtype or namespace, or with a NaN or an infinity (on eager arrays, while value
    checks are on), raises a :class:`~kfac_ref.KFACValueError` or
    :class:`~kfac_ref.KFACTypeError` that names the function.  The functions get the
    targets given here (``None`` when none were given; a function that needs them then
    fails) and must not modify their arguments.  The weight :math:`w` multiplies the loss
    as for the built-in losses (the functions compute the unweighted :math:`\ell_n`).

    A ``CustomLoss`` has no Fisher (it is not a predictive distribution): the estimation
    modes ``ggn_curvature_prop``, ``ggn_exact`` and ``fisher_empirical``, the exact GGN,
    the empirical Fisher and the Hessian-free products accept it; the Fisher modes ask for
    a :class:`CustomNegativeLogProbLoss`.

    Parameters
    ----------
    outputs : array [N, ...]
        The network output (at least 2-D, real floating, finite).
    targets : array [N, ...], optional
        Anything the functions need per example (any dtype; floating targets finite).
    value, gradient, hessian_sqrt : callable
        ``(outputs, targets) -> array`` as in the table.
    weight : float or 0-D array
        Non-negative :math:`w`.

    Raises
    ------
    KFACTypeError, KFACValueError
        A function argument not callable, bad outputs or targets, negative weight, or a
        ``hessian_sqrt`` result of the wrong shape, dtype or namespace or not finite.

    References
    ----------
    N. N. Schraudolph, "Fast curvature matrix-vector products for second-order gradient
    descent", Neural Computation 14 (2002); Martens (2014), arXiv:1412.1193, §8.
    """

    _dependant_names = ("outputs",)

    def __init__(self, outputs, targets=None, *, value, gradient, hessian_sqrt, weight=1.0):
        func = self._fname("__init__")
        self._ns = namespace_of(func, outputs=outputs, targets=targets,
                                **_arrays_only(weight=weight))
        check_array(func, "outputs", outputs, min_ndim=2, layout="[N, ...]")
        self._outputs = outputs
        self._set_weight(func, weight)
        self._functions = {"value": value, "gradient": gradient, "hessian_sqrt": hessian_sqrt}
        for name, fn in self._functions.items():
            if not callable(fn):
                raise KFACTypeError(f"{func}: {name} must be a callable (outputs, targets) -> "
                                    f"array; got {describe(fn)}.")
        self._targets = None if targets is None else self._check_targets(func, targets)
        n, d = outputs.shape[0], _prod(outputs.shape[1:])
        b = self._call(func, "hessian_sqrt", self._targets, "[N, D, K]", ndim=3,
                       shape=(n, d, None))
        if b.shape[2] == 0:
            raise KFACValueError(f"{func}: hessian_sqrt(outputs, targets) must have K >= 1 "
                                 f"columns; got {describe(b)}.")
        self._sqrt = b

    def _check_targets(self, func, targets):
        self._namespace(func, targets=targets)
        n = self._outputs.shape[0]
        check_array(func, "targets", targets, dtype=None, min_ndim=1, layout="[N, ...]")
        if targets.shape[0] != n:
            raise KFACValueError(f"{func}: targets must have the batch size {n} of outputs "
                                 f"on axis 0; got {describe(targets)}.")
        return targets

    def _call(self, func, name, targets, layout, **shape):
        """The user's function ``name`` at (outputs, targets), its result checked: one
        array of the outputs' namespace and dtype, of the shape given, finite."""
        out = self._functions[name](self._outputs, targets)
        what = f"{name}(outputs, targets)"
        if not is_array(out):
            raise KFACTypeError(f"{func}: {what} must return an array {layout}; got "
                                f"{describe(out)}.")
        self._namespace(func, **{what: out})
        check_array(func, what, out, layout=layout, **shape)
        self._check_dtype(func, what, out)
        return out

    @property
    def outputs(self):
        """The network output ``[N, ...]``."""
        return self._outputs

    @property
    def targets(self):
        return self._targets

    @property
    def parameter_dependants(self) -> tuple:
        return (self._outputs,)

    @property
    def parameter_independants(self) -> tuple:
        return (self._targets, self._weight)

    @property
    def ggn_factor_inner_shape(self) -> tuple:
        return (self._outputs.shape[0], self._sqrt.shape[2])

    def _constructor_kwargs(self):
        return dict(weight=self._weight, **self._functions)

    def _with_inputs(self, inputs):
        return type(self)(inputs[0], targets=self._targets, **self._constructor_kwargs())

    # -- formulas -------------------------------------------------------------------------
    def _evaluate(self, targets=None, coefficient_mode="regular"):
        func = self._fname("evaluate")
        n = self._outputs.shape[0]
        value = self._call(func, "value", self._given(targets), "[N]", shape=(n,))
        return value * self._coefficient(coefficient_mode)

    def _grad(self, targets=None, coefficient_mode="regular"):
        func = self._fname("grad_of_evaluate")
        g = self._call(func, "gradient", self._given(targets), "like outputs",
                       shape=tuple(self._outputs.shape))
        return (g * self._coefficient(coefficient_mode),)

    def _as_outputs(self, flat):
        return self._xp.reshape(flat, tuple(self._outputs.shape))

    def _curvature_vp(self, vector, weighted=True):
        xp, b = self._xp, self._sqrt
        btv = xp.sum(b * _flat(xp, vector[0])[:, :, None], axis=1)  # [N, K]
        return (self._as_outputs(xp.sum(b * btv[:, None, :], axis=2)) * self._w(weighted),)

    def _factor_vp(self, vector, weighted=True):
        xp = self._xp
        bu = xp.sum(self._sqrt * vector[:, None, :], axis=2)  # [N, D]
        return (self._as_outputs(bu) * self._sqrt_w(weighted),)

    def _factor_t_vp(self, vector, weighted=True):
        xp = self._xp
        btv = xp.sum(self._sqrt * _flat(xp, vector[0])[:, :, None], axis=1)
        return btv * self._sqrt_w(weighted)

    def _factor_column(self, index, weighted=True):
        (k,) = index
        return (self._as_outputs(self._sqrt[:, :, k]) * self._sqrt_w(weighted),)

    def _curvature_matrix(self):
        b = self._sqrt
        return (b @ self._xp.permute_dims(b, (0, 2, 1))) * self._weight

    def _factor_matrix(self):
        return self._sqrt * self._sqrt_weight


@capabilities(dask="yes")
class CustomNegativeLogProbLoss(CustomLoss, NegativeLogProbLoss):
    r"""A :class:`CustomLoss` that is the negative log-likelihood of a predictive
    distribution in its natural parameters, with a function that samples it.

    .. math::

        \ell_n = -\log p(y_n\mid f_n),\qquad
        F_n = \nabla^2_f\ell_n = G_n = B_n B_n^\top ,

        \texttt{sample}(f, \texttt{rng})_n = \tilde y_n \sim p(\cdot\mid f_n),

    because for an exponential family in its natural parameters the Hessian of the negative
    log-likelihood is the Fisher and does not depend on :math:`y` (Martens 2014, §9.2).  So
    the Fisher products run the same formulas as the GGN products, and every estimation
    mode accepts the loss: ``fisher_gradients`` back-propagates
    ``gradient(outputs, sample(outputs, rng))``.  That the outputs are natural parameters
    is the caller's claim; the Fisher of any other parameterisation is not :math:`B_nB_n^\top`.

    Parameters
    ----------
    outputs, targets, value, gradient, hessian_sqrt, weight
        As :class:`CustomLoss`; ``hessian_sqrt`` must not depend on the targets.
    sample : callable
        ``(outputs, rng) -> targets``: one draw per example from :math:`p(\cdot\mid f_n)`,
        in the form ``value`` and ``gradient`` accept.  ``rng`` is the
        :class:`numpy.random.Generator` (or JAX key) given to the estimator; draw on the
        host from it and convert to the outputs' namespace for the same numbers on every
        backend.

    Raises
    ------
    KFACTypeError, KFACValueError
        As :class:`CustomLoss`; ``sample`` not callable, or a sample with the wrong batch
        size or namespace.

    References
    ----------
    Martens (2014), arXiv:1412.1193, §9.2; Martens and Grosse (2015), §5.
    """

    _hessian_uses_targets = False

    def __init__(self, outputs, targets=None, *, value, gradient, hessian_sqrt, sample,
                 weight=1.0):
        if not callable(sample):
            raise KFACTypeError(f"{self._fname('__init__')}: sample must be a callable "
                                f"(outputs, rng) -> targets; got {describe(sample)}.")
        self._sampler = sample
        super().__init__(outputs, targets, value=value, gradient=gradient,
                         hessian_sqrt=hessian_sqrt, weight=weight)

    def _constructor_kwargs(self):
        return dict(sample=self._sampler, **super()._constructor_kwargs())

    @property
    def params(self) -> tuple:
        return (self._outputs,)

    @property
    def fisher_factor_inner_shape(self) -> tuple:
        return self.ggn_factor_inner_shape

    def _sample(self, rng):
        y = self._sampler(self._outputs, rng)
        func = self._fname("sample")
        if not is_array(y):
            raise KFACTypeError(f"{func}: sample(outputs, rng) must return an array [N, ...]; "
                                f"got {describe(y)}.")
        return self._check_targets(func, y)

    def _hessian_matrix(self, targets=None):
        return self._curvature_matrix()


def _autodiff_functions(loss, outputs, targets):
    """value, gradient and hessian_sqrt functions of :class:`AutodiffLoss` from the user's
    per-example ``loss`` by the autodiff of the outputs' library (torch.func or JAX).

    Glue for the user's own function, which is written for one of these libraries: the
    library is imported here, lazily, only when the user's arrays are of it."""
    xp = namespace_of("AutodiffLoss", outputs=outputs)
    lib = xp.__name__  # "array_api_compat.torch", "jax.numpy", ...
    axis = None if targets is None else 0
    if lib.endswith("torch"):
        import torch.func as autodiff  # glue for the user's torch function

        def vmap(f):
            return autodiff.vmap(f, in_dims=(0, axis))
        grad, hessian = autodiff.grad, autodiff.hessian
    elif lib.startswith("jax"):
        import jax as autodiff  # glue for the user's JAX function

        def vmap(f):
            return autodiff.vmap(f, in_axes=(0, axis))
        grad, hessian = autodiff.grad, autodiff.hessian
    else:
        raise KFACTypeError(f"AutodiffLoss: outputs must be a torch tensor or a JAX array (the "
                            f"loss is differentiated by their library); got {describe(outputs)}.")

    def value(f, y):
        return vmap(loss)(f, y)

    def gradient(f, y):
        return vmap(grad(loss))(f, y)

    def hessian_sqrt(f, y):
        n, d = f.shape[0], _prod(f.shape[1:])
        h = xp.reshape(vmap(hessian(loss))(f, y), (n, d, d))
        return _psd_sqrt(xp, (h + xp.permute_dims(h, (0, 2, 1))) / 2.0)

    return value, gradient, hessian_sqrt


def _psd_sqrt(xp, h):
    r""":math:`B = V\sqrt{\max(\Lambda, 0)}` for :math:`H = V\Lambda V^\top` ``[N, D, D]``;
    a clearly negative eigenvalue (beyond rounding) is an error: the GGN needs a loss convex
    in the output."""
    lam, v = optional_linalg(xp, "eigh")(h)
    if checks_values(h):
        eps = float(xp.finfo(h.dtype).eps)
        scale = xp.max(xp.abs(lam), axis=-1, keepdims=True)
        bad = lam < -(100.0 * eps * h.shape[-1]) * scale
        if any_true(xp, bad):
            raise KFACValueError(
                f"AutodiffLoss: the Hessian of loss must be positive semi-definite (a loss "
                f"convex in the output, as the GGN needs); got an eigenvalue "
                f"{float(xp.min(lam))!r}.")
    return v * xp.sqrt(xp.clip(lam, min=0.0))[:, None, :]


_NEEDS_AUTODIFF = ("no", "differentiated by the outputs' own library: pass torch tensors or "
                   "JAX arrays")


@capabilities(numpy=_NEEDS_AUTODIFF, array_api_strict=_NEEDS_AUTODIFF, cupy=_NEEDS_AUTODIFF,
              dask=_NEEDS_AUTODIFF)
class AutodiffLoss(CustomLoss):
    r"""A :class:`CustomLoss` whose gradient and Hessian square root come from automatic
    differentiation of a per-example loss written for PyTorch or JAX.

    .. math::

        \ell_n = \texttt{loss}(f_n, y_n),\quad
        \nabla_f\ell_n = \texttt{grad}(\texttt{loss}),

        \nabla^2_f\ell_n = \texttt{hessian}(\texttt{loss}) = V_n\Lambda_nV_n^\top,\quad
        B_n = V_n\Lambda_n^{1/2},

    all vectorised over the batch (``torch.func.vmap`` / ``jax.vmap`` of ``grad`` and
    ``hessian``; no loop over examples), the Hessian symmetrised and its square root taken
    by one batched ``eigh``.  An eigenvalue below :math:`-100\,\varepsilon D\max|\lambda|`
    raises (the loss is not convex in the output there; the GGN needs a convex outer
    loss); smaller negative ones are rounding and are clipped to zero.  The Hessian is
    :math:`D\times D` per example: this is for outputs of modest size.

    Parameters
    ----------
    outputs : torch tensor or JAX array [N, ...]
        The network output (real floating, finite).
    targets : array [N, ...], optional
        Passed to ``loss`` one example at a time (``None`` is passed as is).
    loss : callable
        ``loss(output, target) -> scalar`` for ONE example: ``output`` of shape
        ``outputs.shape[1:]``, ``target`` one row of ``targets`` (or ``None``); written with
        the library's own operations so that it can be differentiated.
    weight : float or 0-D array

    Raises
    ------
    KFACTypeError, KFACValueError
        ``loss`` not callable; outputs not a torch tensor or JAX array; a Hessian that is
        not positive semi-definite; as :class:`CustomLoss` otherwise.

    References
    ----------
    ``torch.func.hessian``; ``jax.hessian``; Martens (2014), arXiv:1412.1193, §8.
    """

    def __init__(self, outputs, targets=None, *, loss, weight=1.0):
        if not callable(loss):
            raise KFACTypeError(f"AutodiffLoss: loss must be a callable (output, target) -> "
                                f"scalar; got {describe(loss)}.")
        self._loss_fn = loss
        value, gradient, hessian_sqrt = _autodiff_functions(loss, outputs, targets)
        super().__init__(outputs, targets, value=value, gradient=gradient,
                         hessian_sqrt=hessian_sqrt, weight=weight)

    def _with_inputs(self, inputs):
        return type(self)(inputs[0], targets=self._targets, loss=self._loss_fn,
                          weight=self._weight)
