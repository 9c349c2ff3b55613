r"""Laplace evidence: the log marginal likelihood of a Laplace approximation with a
K-FAC, EKFAC, diagonal or full curvature, and its gradient in the prior precision.

The Laplace approximation at a mode :math:`\theta_*` with a Gaussian prior
:math:`\mathcal N(\mu_0, P_0^{-1})`, :math:`P_0 = \operatorname{diag}(\delta_g I_{n_g})`
(one precision :math:`\delta_g > 0` per parameter group :math:`g` of :math:`n_g`
parameters, or one for all), a likelihood tempered by :math:`T > 0` and a curvature
:math:`H` of the negative log-likelihood summed over the data (GGN, Fisher, K-FAC, ...),
approximates the evidence by (MacKay 1992; Immer et al. 2021, eq. 4; Daxberger et al.
2021):

.. math::

    \log p(\mathcal D) \approx \frac{\ell(\theta_*)}{T}
    - \frac12\Big[(\theta_* - \mu_0)^\top P_0 (\theta_* - \mu_0)
    + \log\det P - \log\det P_0\Big],

    P = \frac1T H + P_0,

with :math:`\ell(\theta_*) = \log p(\mathcal D\mid\theta_*)` (the :math:`\tfrac n2\log 2\pi`
of the prior and of the Gaussian integral cancel).  :math:`H` is block diagonal over the
groups, so :math:`\log\det P = \sum_g \log\det P_g = \sum_g\sum_k \log\lambda_{g,k}` with the
eigenvalues :math:`\lambda_{g,k}` of each block, which every structure has in closed form
(``structure``; the curvature of a group in brackets; :math:`s = 1/T`):

.. math::

    \begin{aligned}
    &\texttt{kron}\ (A, G),\ H_g = A\otimes G: && \lambda_{ij} = s\,a_i\gamma_j + \delta_g,\\
    &\texttt{kron\_factored}\ (A, G): &&
      \lambda_{ij} = (\sqrt s\,a_i + \sqrt{\delta_g})(\sqrt s\,\gamma_j + \sqrt{\delta_g}),\\
    &\texttt{ekfac}\ (Q_A, Q_G, S): && \lambda_{ij} = s\,S_{ij} + \delta_g,\\
    &\texttt{diagonal}\ (d,\ n_g \text{ entries}): && \lambda_k = s\,d_k + \delta_g,\\
    &\texttt{full}\ (H_g,\ n_g\times n_g): && \lambda_k = s\,h_k + \delta_g,\
      h = \operatorname{spec}H_g.
    \end{aligned}

``"kron"`` is the exact identity :math:`\operatorname{spec}(sA\otimes G + \delta I) =
\{s\,a_i\gamma_j + \delta\}` (:func:`kfac_ref.spectral.kron_eigenvalues`; Immer et al. 2021,
§4; laplace-torch's ``KronDecomposed`` without damping).  ``"kron_factored"`` is the
posterior precision of Ritter, Botev & Barber (2018), eq. 7,
:math:`(\sqrt s A + \sqrt\delta I)\otimes(\sqrt s G + \sqrt\delta I)`, which adds the prior
to each factor (laplace-torch's damped ``KronDecomposed``): it is *not* :math:`sH + P_0`, the
cross term :math:`\sqrt{s\delta}(A\otimes I + I\otimes G)` comes with it, and the
evidence keeps :math:`\log\det P_0 = n_g\log\delta_g`.  Unlike the exact posterior it
depends on how a scalar is shared between the factors (:math:`(\alpha A, G/\alpha)` gives
another posterior); the factors are used as given.  ``"ekfac"`` is George et al.'s
(2018) :math:`H_g = (Q_A\otimes Q_G)\operatorname{diag}(\operatorname{vec}S)(Q_A\otimes
Q_G)^\top` with orthogonal :math:`Q_A, Q_G`, whose eigenvalues are the entries of
:math:`S`.  In the ``"kron"`` structures a group may also be one full block ``H_g``
(:math:`n_g\times n_g`), as laplace-torch's bias blocks.

The gradient in the prior precision (Immer et al. 2021, §3.1) follows from
:math:`\partial\log\det P_g/\partial\delta_g = \sum_k (\partial\lambda_{g,k}/\partial\delta_g)
/\lambda_{g,k}`:

.. math::

    \frac{\partial\log p(\mathcal D)}{\partial\delta_g} = -\frac12\Big[
    \lVert\theta_{*,g} - \mu_{0,g}\rVert^2 + \sum_k \frac{1}{\lambda_{g,k}}
    \frac{\partial\lambda_{g,k}}{\partial\delta_g} - \frac{n_g}{\delta_g}\Big],

with :math:`\partial\lambda/\partial\delta = 1` for the additive structures (the sum is
:math:`\operatorname{tr}P_g^{-1}`) and
:math:`\frac{1}{2\sqrt\delta}\big(\sqrt s\,a_i + \sqrt s\,\gamma_j + 2\sqrt\delta\big)` for
``"kron_factored"``; a scalar prior precision has the sum over the groups.
"""

from __future__ import annotations

import numbers

from . import spectral
from ._backend import (
    KFACTypeError,
    KFACValueError,
    any_true,
    asarray_like,
    check_array,
    check_namespace_has,
    check_option,
    check_scalar,
    check_symmetric,
    checks_values,
    describe,
    is_array,
    kernel_of,
    namespace_of,
    ones_like_shape,
    optional_linalg,
    size_of,
)
from ._support import capabilities
from .losses import LossFunction

__all__ = [
    "LAPLACE_STRUCTURES",
    "laplace_log_marginal_likelihood",
    "laplace_log_marginal_likelihood_grad",
]

LAPLACE_STRUCTURES = ("kron", "kron_factored", "ekfac", "diagonal", "full")
"""The curvature structures of :func:`laplace_log_marginal_likelihood`."""

_KRON = ("kron", "kron_factored")


# --------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------
def _fail(func, name, expected, got, kind=KFACValueError):
    raise kind(f"{func}: {name} must be {expected}; got {got}.")


def _check_sequence(func, name, value, length=None):
    if not isinstance(value, (list, tuple)) or len(value) == 0:
        _fail(func, name, "a non-empty list or tuple (one entry per parameter group)",
              describe(value), KFACTypeError)
    if length is not None and len(value) != length:
        _fail(func, name, f"a list or tuple of {length} entries (one per parameter group, as "
              "params)", describe(value))
    return value


def _check_block(func, name, f, n):
    check_array(func, name, f, ndim=2, layout=f"[{n}, {n}] (a full block)")
    if tuple(f.shape) != (n, n):
        _fail(func, name, f"a [{n}, {n}] block (the group has {n} parameters)", describe(f))
    check_symmetric(func, name, f)


def _check_kron_group(func, name, block, n):
    if is_array(block):  # a full block inside a Kronecker structure (a bias, say)
        _check_block(func, name, block, n)
        return
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        _fail(func, name, "a pair (A [p, p], G [q, q]) of Kronecker factors or a full "
              f"[{n}, {n}] block", describe(block), KFACTypeError)
    for k, f in enumerate(block):
        check_array(func, f"{name}[{k}]", f, ndim=2, layout="[m, m] (a Kronecker factor)")
        if f.shape[0] != f.shape[1]:
            _fail(func, f"{name}[{k}]", "a square Kronecker factor", describe(f))
        check_symmetric(func, f"{name}[{k}]", f)
    p, q = block[0].shape[0], block[1].shape[0]
    if p * q != n:
        _fail(func, name, f"factors of sizes p, q with p·q = {n} (the group's parameters)",
              f"p = {p}, q = {q}")


def _check_ekfac_group(func, name, block, n):
    if not isinstance(block, (list, tuple)) or len(block) != 3:
        _fail(func, name, "a triple (Q_A [p, p], Q_G [q, q], S [p, q]) of eigenbases and "
              "eigenbasis scalings", describe(block), KFACTypeError)
    qa, qg, s = block
    check_array(func, f"{name}[0]", qa, ndim=2, layout="[p, p] (eigenbasis of A)")
    check_array(func, f"{name}[1]", qg, ndim=2, layout="[q, q] (eigenbasis of G)")
    p, q = qa.shape[0], qg.shape[0]
    for k, f in ((0, qa), (1, qg)):
        if f.shape[0] != f.shape[1]:
            _fail(func, f"{name}[{k}]", "a square eigenbasis", describe(f))
    check_array(func, f"{name}[2]", s, ndim=2, shape=(p, q), layout=f"[{p}, {q}]")
    if p * q != n:
        _fail(func, name, f"sizes p, q with p·q = {n} (the group's parameters)",
              f"p = {p}, q = {q}")


def _check_group(func, structure, name, block, n):
    if structure in _KRON:
        _check_kron_group(func, name, block, n)
    elif structure == "ekfac":
        _check_ekfac_group(func, name, block, n)
    elif structure == "diagonal":
        check_array(func, name, block, layout="(the curvature's diagonal)")
        if size_of(block) != n:
            _fail(func, name, f"an array of {n} entries (the group's parameters)",
                  describe(block))
    else:
        _check_block(func, name, block, n)


def _check_prior_precision(func, prior_precision, n_groups, like):
    if is_array(prior_precision) and prior_precision.ndim == 1:
        check_array(func, "prior_precision", prior_precision, shape=(n_groups,),
                    layout=f"[{n_groups}] (one per parameter group)")
        xp = namespace_of(func, **like, prior_precision=prior_precision)
        if checks_values(prior_precision):
            if any_true(xp, xp.any(prior_precision <= 0)):
                _fail(func, "prior_precision", "positive", describe(prior_precision))
        return prior_precision
    if not is_array(prior_precision) and not isinstance(prior_precision, numbers.Real):
        _fail(func, "prior_precision", f"a positive number, a 0-D array or a 1-D array "
              f"[{n_groups}] (one per parameter group)", describe(prior_precision),
              KFACTypeError)
    return check_scalar(func, "prior_precision", prior_precision, positive=True, like=like)


def _check_prior_mean(func, prior_mean, params, like):
    if isinstance(prior_mean, (list, tuple)):
        _check_sequence(func, "prior_mean", prior_mean, len(params))
        for g, (m, p) in enumerate(zip(prior_mean, params, strict=True)):
            check_array(func, f"prior_mean[{g}]", m, shape=tuple(p.shape),
                        layout="(the shape of params[g])")
        namespace_of(func, **like, **{f"prior_mean[{g}]": m for g, m in enumerate(prior_mean)})
        return prior_mean
    return check_scalar(func, "prior_mean", prior_mean, like=like)


def _check_args(func, params, curvature, prior_precision, structure, temperature,
                prior_mean, log_likelihood=None):
    structure = check_option(func, "structure", structure, LAPLACE_STRUCTURES)
    _check_sequence(func, "params", params)
    _check_sequence(func, "curvature", curvature, len(params))
    arrays = {f"params[{g}]": p for g, p in enumerate(params)}
    xp = namespace_of(func, **arrays)
    for g, p in enumerate(params):
        check_array(func, f"params[{g}]", p)
        if size_of(p) == 0:
            _fail(func, f"params[{g}]", "a non-empty array", describe(p))
    for g, (block, p) in enumerate(zip(curvature, params, strict=True)):
        _check_group(func, structure, f"curvature[{g}]", block, size_of(p))
        leaves = block if isinstance(block, (list, tuple)) else (block,)
        names = ([f"curvature[{g}][{k}]" for k in range(len(leaves))]
                 if isinstance(block, (list, tuple)) else [f"curvature[{g}]"])
        namespace_of(func, **{"params[0]": params[0]}, **dict(zip(names, leaves, strict=True)))
        # the eigenvalues the structure takes, asked of the namespace before any computation
        # (a Dask array's has no linalg.eigh nor linalg.eigvalsh)
        if structure in _KRON and not is_array(block):
            check_namespace_has(func, names[0], leaves[0], "linalg.eigh",
                                "the Kronecker factors' eigenvalues")
        elif structure not in ("ekfac", "diagonal"):
            check_namespace_has(func, names[0], leaves[0], "linalg.eigvalsh",
                                "the eigenvalues of a full block")
    # every scalar and prior array enters the groups' sums with the parameters: one
    # namespace, device and precision
    like = {"params[0]": params[0]}
    prior_precision = _check_prior_precision(func, prior_precision, len(params), like)
    temperature = check_scalar(func, "temperature", temperature, positive=True, like=like)
    prior_mean = _check_prior_mean(func, prior_mean, params, like)
    if log_likelihood is not None:
        log_likelihood = _check_log_likelihood(func, log_likelihood, like)
    return xp, structure, prior_precision, temperature, prior_mean, log_likelihood


def _check_log_likelihood(func, value, like):
    if isinstance(value, LossFunction):
        namespace_of(func, **like, **{f"log_likelihood.{k}": a for k, a in
                                      enumerate(value.parameter_dependants)})
        return value
    return check_scalar(func, "log_likelihood", value, like=like)


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
def _kron_factor_eigenvalues(xp, a, g):
    """The factors' (clipped) eigenvalues, each as the spectrum of the factor times the
    1 × 1 identity (:func:`kfac_ref.spectral.kron_eigenvalues` of ``A ⊗ [1]``, ``[1] ⊗ G``)."""
    one = ones_like_shape(a, (1,))
    return spectral.kron_eigenvalues(a, one), spectral.kron_eigenvalues(one, g)


def _group_logdet(xp, structure, block, s, delta):
    r"""``(log det P_g, ∂ log det P_g / ∂δ_g)`` of one group, from its eigenvalues."""
    if structure == "kron_factored" and not is_array(block):
        ea, eg = _kron_factor_eigenvalues(xp, block[0], block[1])
        p, q = ea.shape[0], eg.shape[0]
        root_s, root_d = s**0.5, xp.sqrt(delta)
        u, v = root_s * ea + root_d, root_s * eg + root_d
        logdet = q * xp.sum(xp.log(u)) + p * xp.sum(xp.log(v))
        dlogdet = (q * xp.sum(1.0 / u) + p * xp.sum(1.0 / v)) / (2.0 * root_d)
        return logdet, dlogdet
    if structure in _KRON and not is_array(block):
        ev = spectral.kron_eigenvalues(block[0], block[1])
    elif structure == "ekfac":
        ev = xp.reshape(block[2], (-1,))
    elif structure == "diagonal":
        ev = xp.reshape(block, (-1,))
    else:  # a full block: no clipping, P must be positive definite as the evidence needs
        ev = optional_linalg(xp, "eigvalsh")(block)
    lam = s * ev + delta
    return xp.sum(xp.log(lam)), xp.sum(1.0 / lam)


def _per_group(xp, params, curvature, prior_precision, structure, temperature, prior_mean):
    """``(δ_g, n_g, scatter_g, log det P_g, ∂ log det P_g/∂δ_g)`` for every group."""
    like = params[0]
    s = 1.0 / temperature
    scalar = not (is_array(prior_precision) and prior_precision.ndim == 1)
    out = []
    for g, (theta, block) in enumerate(zip(params, curvature, strict=True)):
        delta = prior_precision if scalar else prior_precision[g]
        if not is_array(delta):
            delta = asarray_like(delta, like)
        mean = prior_mean[g] if isinstance(prior_mean, (list, tuple)) else prior_mean
        r = theta - mean
        scatter = xp.sum(r * r)
        logdet, dlogdet = _group_logdet(xp, structure, block, s, delta)
        out.append((delta, size_of(theta), scatter, logdet, dlogdet))
    return out, scalar


def _log_likelihood_value(xp, log_likelihood, like):
    if is_array(log_likelihood):
        return log_likelihood
    if isinstance(log_likelihood, numbers.Real):
        return asarray_like(float(log_likelihood), like)
    # a kfac_ref loss: ℓ = −Σ_n ℓ_n, the per-example negative log-probabilities unweighted
    return -xp.sum(log_likelihood.evaluate(coefficient_mode="off"))


@capabilities(dask="yes")
def laplace_log_marginal_likelihood(log_likelihood, params, curvature, prior_precision=1.0,
                                    *, structure="kron", temperature=1.0, prior_mean=0.0):
    r"""Laplace approximation to the log marginal likelihood (evidence).

    .. math::

        \log p(\mathcal D) \approx \frac{\ell}{T} - \frac12\sum_g\Big[
        \delta_g\lVert\theta_{*,g} - \mu_{0,g}\rVert^2 + \sum_k\log\lambda_{g,k}
        - n_g\log\delta_g\Big],

    :math:`\lambda_{g,k}` the eigenvalues of the group's posterior precision
    :math:`P_g = H_g/T + \delta_g I` by the structure's identity (module docstring;
    ``"kron"``: :math:`a_i\gamma_j/T + \delta_g`; ``"kron_factored"``:
    :math:`(a_i/\sqrt T + \sqrt{\delta_g})(\gamma_j/\sqrt T + \sqrt{\delta_g})`).  The
    temperature divides the whole log-likelihood, normaliser included (the log-density of
    :math:`p(\mathcal D\mid\theta)^{1/T}`).  Immer et al. (2021), eq. 4; Ritter, Botev &
    Barber (2018) for the factored K-FAC posterior.

    Parameters
    ----------
    log_likelihood : float, 0-D array or kfac_ref loss
        :math:`\ell = \log p(\mathcal D\mid\theta_*)`, summed over the data; a
        :class:`kfac_ref.losses.LossFunction` built on the network's outputs at
        :math:`\theta_*` gives :math:`\ell = -\sum_n \ell_n` (its ``evaluate`` with
        ``coefficient_mode="off"``: the unweighted negative log-probabilities).
    params : list of arrays
        :math:`\theta_{*,g}`, one array per parameter group (any shape, :math:`n_g` entries).
    curvature : list
        One entry per group: ``(A, G)`` (``[p, p]``, ``[q, q]``, :math:`pq = n_g`) or a full
        ``[n_g, n_g]`` block for the ``"kron"`` structures, ``(Q_A, Q_G, S)`` for
        ``"ekfac"``, the diagonal (:math:`n_g` entries) for ``"diagonal"``, ``[n_g, n_g]`` for
        ``"full"``; the curvature of the negative log-likelihood *summed* over the data.
    prior_precision : float, 0-D array or array [n_groups]
        :math:`\delta > 0`, one for all groups or one per group.
    structure : {"kron", "kron_factored", "ekfac", "diagonal", "full"}
        How ``curvature`` is given and which eigenvalue identity applies (module docstring).
    temperature : float
        :math:`T > 0`.
    prior_mean : float or list of arrays
        :math:`\mu_0` (a scalar, or one array of the shape of each ``params[g]``).

    Returns
    -------
    array []

    Raises
    ------
    KFACValueError, KFACTypeError
        A group whose curvature does not match its parameter count, a non-positive prior
        precision or temperature, mixed namespaces, an unknown structure.
    """
    func = "laplace_log_marginal_likelihood"
    xp, structure, prior, t, mean, loglik = _check_args(
        func, params, curvature, prior_precision, structure, temperature, prior_mean,
        log_likelihood)
    if loglik is None:
        _fail(func, "log_likelihood", "a real number, a 0-D array or a kfac_ref loss", "None",
              KFACTypeError)
    return _laplace_log_marginal_likelihood(xp, loglik, params, curvature, prior, structure,
                                            t, mean)


@kernel_of(laplace_log_marginal_likelihood)
def _laplace_log_marginal_likelihood(xp, log_likelihood, params, curvature, prior_precision,
                                     structure, temperature, prior_mean):
    groups, _ = _per_group(xp, params, curvature, prior_precision, structure, temperature,
                           prior_mean)
    penalty = 0.0
    for delta, n, scatter, logdet, _ in groups:
        penalty = penalty + delta * scatter + logdet - n * xp.log(delta)
    loglik = _log_likelihood_value(xp, log_likelihood, params[0])
    return loglik / temperature - 0.5 * penalty


@capabilities(dask="yes")
def laplace_log_marginal_likelihood_grad(params, curvature, prior_precision=1.0, *,
                                         structure="kron", temperature=1.0, prior_mean=0.0):
    r"""Gradient of :func:`laplace_log_marginal_likelihood` in the prior precision.

    .. math::

        \frac{\partial\log p(\mathcal D)}{\partial\delta_g} = -\frac12\Big[
        \lVert\theta_{*,g} - \mu_{0,g}\rVert^2
        + \sum_k\frac{1}{\lambda_{g,k}}\frac{\partial\lambda_{g,k}}{\partial\delta_g}
        - \frac{n_g}{\delta_g}\Big],

    :math:`\partial\lambda/\partial\delta = 1` (the sum is :math:`\operatorname{tr}P_g^{-1}`)
    except for ``"kron_factored"``, where
    :math:`\lambda_{ij} = (\sqrt s a_i + \sqrt\delta)(\sqrt s\gamma_j + \sqrt\delta)` gives
    :math:`\sum_{ij}\partial_\delta\log\lambda_{ij} = \frac{1}{2\sqrt\delta}\big(q\sum_i
    \frac{1}{\sqrt s a_i + \sqrt\delta} + p\sum_j\frac{1}{\sqrt s\gamma_j + \sqrt\delta}\big)`.
    A scalar prior precision shared by all groups gets the sum over :math:`g`.  The
    log-likelihood does not depend on :math:`\delta` (the mode :math:`\theta_*` is held
    fixed, as in Immer et al. 2021's alternating scheme).

    Parameters
    ----------
    params, curvature, prior_precision, structure, temperature, prior_mean
        As :func:`laplace_log_marginal_likelihood`.

    Returns
    -------
    array [] or array [n_groups]
        The shape of ``prior_precision`` (0-D for a Python number).
    """
    func = "laplace_log_marginal_likelihood_grad"
    xp, structure, prior, t, mean, _ = _check_args(
        func, params, curvature, prior_precision, structure, temperature, prior_mean)
    return _laplace_log_marginal_likelihood_grad(xp, params, curvature, prior, structure, t,
                                                 mean)


@kernel_of(laplace_log_marginal_likelihood_grad)
def _laplace_log_marginal_likelihood_grad(xp, params, curvature, prior_precision, structure,
                                          temperature, prior_mean):
    groups, scalar = _per_group(xp, params, curvature, prior_precision, structure,
                                temperature, prior_mean)
    grads = [-0.5 * (scatter + dlogdet - n / delta) for delta, n, scatter, _, dlogdet in groups]
    if scalar:
        total = grads[0]
        for gr in grads[1:]:
            total = total + gr
        return total
    return xp.stack(grads)

