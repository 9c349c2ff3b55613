"""Reproduction: laplace-torch (0.3) Laplace evidence against kfac_ref.laplace, float64.

Run inside the ``laplace`` environment (recipe ``laplace.txt``), from the repository root::

    python -m conformance.peers.repro_laplace_torch [--json out.json]

The problem is :func:`common.mlp_problem` (tanh MLP 3 → 5 → 4, N = 8, TF layout) as a PyTorch
``Sequential`` (:func:`torch_common.mlp_model`).  laplace-torch's ``KronLaplace`` (exact and
``damping=True``), ``DiagLaplace`` and ``FullLaplace`` are fitted on the whole batch with the
default curvature backend (curvlinops' type-2 GGN: the exact GGN, and K-FAC with
``separate_weight_and_bias=True``), then ``log_marginal_likelihood(prior_precision)`` and its
autograd gradient are compared with :func:`kfac_ref.laplace.laplace_log_marginal_likelihood`
and :func:`kfac_ref.laplace.laplace_log_marginal_likelihood_grad` on curvature computed
WITHOUT the peer: the reference K-FAC factors and the exact GGN of :mod:`common` (explicit
NumPy back-propagation), scaled to the SUM loss (``× N``) as laplace-torch's losses are
``reduction="sum"``.

Conventions applied to the reference before comparing (laplace-torch's ``baselaplace.py``,
``utils/matrix.py``, ``curvature/curvlinops.py``):

* groups are PyTorch's parameter tensors (``W1, b1, W2, b2``); a per-layer prior precision is
  one per tensor; a weight's block is ``A_w ⊗ G`` (``A_w`` the input covariance without the
  homogeneous coordinate), a bias's block is ``G`` alone (a full block in kfac_ref's
  ``"kron"``);
* ``"kron_factored"`` for ``damping=True``: laplace-torch multiplies each factor by
  ``√(1/(σ²T))`` and adds ``√δ`` to each factor's eigenvalues;
* the log-likelihood: softmax cross-entropy, or the Gaussian of variance σ² with its
  normaliser ``N·K·log(σ√(2π))``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from kfac_ref import laplace as LP
from kfac_ref import losses as LS

from . import common as C
from . import torch_common as T

TOL = 1e-10  # float64 eigendecompositions of κ ≲ 1e3 matrices, O(100) evidences

N = 8
PRIORS = {"scalar": 0.5, "per-layer": [0.3, 1.1, 2.0, 0.7]}


def _fit(cls, model, x, y, likelihood, sigma, temperature, **kw):
    kwargs = dict(temperature=temperature, **kw)
    if likelihood == "regression":
        kwargs["sigma_noise"] = sigma
    la = cls(model, likelihood, **kwargs)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=len(x)))
    return la


def _peer(la, prior):
    """laplace-torch's evidence and its autograd gradient in the prior precision."""
    p = torch.tensor(prior, dtype=torch.float64, requires_grad=True)
    lml = la.log_marginal_likelihood(prior_precision=p)
    (grad,) = torch.autograd.grad(lml, p)
    return float(lml.detach()), grad.numpy().reshape(np.shape(prior))


def _peer_damped(la, prior):
    """laplace-torch's documented ``damping=True`` evidence, recomposed from its own parts:
    its decomposed factors scaled by its likelihood factor, a ``KronDecomposed`` with
    ``damping=True`` and the prior added, and its log-likelihood, scatter and prior
    log-determinant (``KronLaplace.log_marginal_likelihood`` loses the flag, see
    LAPLACE_FINDINGS.md)."""
    from laplace.utils.matrix import KronDecomposed

    p = torch.tensor(prior, dtype=torch.float64, requires_grad=True)
    la.prior_precision = p
    scaled = la.H * la._H_factor
    deltas = torch.zeros(len(scaled), dtype=torch.float64) + la.prior_precision
    post = KronDecomposed(scaled.eigenvectors, scaled.eigenvalues, deltas=deltas, damping=True)
    lml = la.log_likelihood - 0.5 * (post.logdet() - la.log_det_prior_precision + la.scatter)
    (grad,) = torch.autograd.grad(lml, p)
    return float(lml.detach()), grad.numpy().reshape(np.shape(prior))


def _params(p):
    """The MAP parameters as kfac_ref groups, in PyTorch's tensor order (W1, b1, W2, b2)."""
    return [p["W1"], p["b1"], p["W2"], p["b2"]]


def _kron_groups(p, loss, sigma, split="natural"):
    """(A_w, G) per weight and G per bias from the reference factors, for the sum loss
    −log p: × N, and 1/σ² on the output side (MSE).  ``split="peer"`` moves scalars between
    the factors as laplace-torch does (the product, and the exact posterior, unchanged):
    MSE's ½ as √½ on each factor of ‖f − y‖²'s curvature, and 1/σ² as 1/σ on each."""
    ref = C.mlp_reference(p, loss, "type2", bias=True)
    f_a = f_g = 1.0
    if loss == "mse" and split == "peer":
        f_a, f_g = 1.0 / (math.sqrt(2.0) * sigma), math.sqrt(2.0) * sigma
    groups = []
    for (a, g), w in zip(ref, ("W1", "W2"), strict=True):
        d_in = p[w].shape[0]
        g_sum = N * g / (sigma**2 if loss == "mse" else 1.0)
        groups += [(f_a * a[:d_in, :d_in], f_g * g_sum), a[d_in, d_in] * g_sum]
    return groups


def _full_ggn(p, loss, sigma):
    """The exact GGN of the sum loss over all parameters, in kfac_ref's group order
    (vec_r W1, b1, vec_r W2, b2), from explicit back-propagation."""
    _, h, f = C.mlp_forward(p)
    cols = np.transpose(C.output_sqrt_columns(loss, f), (0, 2, 1))  # [N, K, C]
    g1, g2 = C.mlp_backprop(p, h, cols)
    js = []
    for a, g in ((p["x"], g1), (h, g2)):
        jw = np.einsum("ni,nkj->nkij", a, g).reshape(N, cols.shape[1], -1)
        js += [jw, g]
    j = np.concatenate(js, axis=2)
    ggn = np.einsum("nkp,nkq->pq", j, j)
    return ggn / (sigma**2 if loss == "mse" else 1.0)


def _split_diag(p, d):
    out, o = [], 0
    for t in _params(p):
        out.append(d[o:o + t.size].reshape(t.shape))
        o += t.size
    return out


def _loglik(p, loss, sigma):
    """ℓ = log p(D | θ) from a kfac_ref loss on the NumPy outputs."""
    f = C.mlp_forward(p)[-1]
    if loss == "ce":
        obj = LS.CategoricalLogitsNegativeLogProbLoss(f, targets=p["y_cls"])
    else:
        obj = LS.NormalMeanNegativeLogProbLoss(f, targets=p["y_reg"], variance=sigma**2,
                                               normalize_log_prob=True)
    return obj


def _ref(structure, p, loss, sigma, curvature, prior, temperature, params=None):
    params = _params(p) if params is None else params
    prior = np.asarray(prior, dtype=np.float64) if isinstance(prior, list) else prior
    kw = dict(structure=structure, temperature=temperature)
    lml = LP.laplace_log_marginal_likelihood(_loglik(p, loss, sigma), params, curvature,
                                             prior, **kw)
    grad = LP.laplace_log_marginal_likelihood_grad(params, curvature, prior, **kw)
    return float(lml), np.asarray(grad)


def _normaliser(loss, sigma, k):
    return N * k * math.log(sigma * math.sqrt(2 * math.pi)) if loss == "mse" else 0.0


def _peer_tempering(lml_ref, loss, sigma, temperature, k):
    """kfac_ref's evidence under laplace-torch's temperature convention (the Gaussian's
    normaliser left untempered)."""
    return lml_ref + _normaliser(loss, sigma, k) * (1.0 / temperature - 1.0)


def _compare(rep, tag, peer, ref, loss, sigma, temperature, k, convention=""):
    lml_p, grad_p = peer
    lml_r, grad_r = ref
    if loss == "mse" and temperature != 1.0:
        # known convention (LAPLACE_FINDINGS.md): the peer tempers only the data fit
        rep.diagnose(f"{tag} evidence", np.array(lml_p), {
            "kfac_ref: ℓ/T, normaliser tempered": np.array(lml_r),
            "data fit/T, normaliser untempered": np.array(
                _peer_tempering(lml_r, loss, sigma, temperature, k)),
        }, TOL)
    else:
        rep.check(f"{tag} evidence", np.array(lml_p), np.array(lml_r), TOL,
                  convention=convention)
    rep.check(f"{tag} ∂/∂δ", grad_p, grad_r, TOL, convention=convention)


def run(rep):
    p = C.mlp_problem(n=N, dims=(3, 5, 4), seed=3)
    k = p["W2"].shape[1]
    x = T.inputs(p)
    from laplace import DiagLaplace, FullLaplace, KronLaplace

    for loss, likelihood in (("ce", "classification"), ("mse", "regression")):
        y = T.targets(p, loss)
        model = T.mlp_model(p, bias=True)
        T.check_forward(model, p)
        sigma = 1.0
        kron = _kron_groups(p, loss, sigma)
        kron_peer_split = _kron_groups(p, loss, sigma, split="peer")
        ggn = _full_ggn(p, loss, sigma)
        diag = _split_diag(p, np.diag(ggn))
        flat = [np.concatenate([t.reshape(-1) for t in _params(p)])]
        for temperature in (1.0, 0.5):
            def fit(cls, **kw):
                return _fit(cls, model, x, y, likelihood, sigma, temperature, **kw)  # noqa: B023

            kron_la, damped_la = fit(KronLaplace), fit(KronLaplace, damping=True)
            diag_la, full_la = fit(DiagLaplace), fit(FullLaplace)
            for pname, prior in PRIORS.items():
                tag = f"{loss} T={temperature} prior={pname}"
                ref = _ref("kron", p, loss, sigma, kron, prior, temperature)
                _compare(rep, f"{tag} KronLaplace vs kron", _peer(kron_la, prior), ref, loss,
                         sigma, temperature, k)
                ref = _ref("diagonal", p, loss, sigma, diag, prior, temperature)
                _compare(rep, f"{tag} DiagLaplace vs diagonal", _peer(diag_la, prior), ref,
                         loss, sigma, temperature, k)
                if pname == "scalar":  # one group: the full GGN couples the tensors
                    ref = _ref("full", p, loss, sigma, [ggn], prior, temperature, flat)
                    _compare(rep, f"{tag} FullLaplace vs full", _peer(full_la, prior), ref,
                             loss, sigma, temperature, k)
                # damping=True: the evidence it returns, then its documented damped path
                exact = _ref("kron", p, loss, sigma, kron, prior, temperature)
                factored = _ref("kron_factored", p, loss, sigma, kron_peer_split, prior,
                                temperature)
                lml_p, _ = _peer(damped_la, prior)
                rep.diagnose(f"{tag} KronLaplace(damping=True) evidence", np.array(lml_p), {
                    "kron_factored (the damped posterior it documents)": np.array(
                        _peer_tempering(factored[0], loss, sigma, temperature, k)),
                    "kron exact (the damping flag dropped)": np.array(
                        _peer_tempering(exact[0], loss, sigma, temperature, k)),
                }, TOL)
                conv = "factors split as the peer's" if loss == "mse" else ""
                _compare(rep, f"{tag} KronDecomposed(damping=True) vs kron_factored",
                         _peer_damped(damped_la, prior), factored, loss, sigma, temperature,
                         k, convention=conv)
        # the peer's own K-FAC factors against the reference ones (the curvature, alone)
        la = _fit(KronLaplace, model, x, y, likelihood, sigma, 1.0)
        conv = "separate weight and bias, × N" + (", ½ as √½ per factor" if loss == "mse"
                                                   else "")
        for i, ((gq, aq), want) in enumerate(zip(la.H_facs.kfacs[0::2], kron_peer_split[0::2],
                                                 strict=True)):
            # the peer's weight block is [G, A] on PyTorch's [out, in] weight: kron(G, A)
            rep.check(f"{loss} layer{i + 1} A_w", aq.numpy(), want[0], TOL, convention=conv)
            rep.check(f"{loss} layer{i + 1} G", gq.numpy(), want[1], TOL, convention=conv)
        damped = _fit(KronLaplace, model, x, y, likelihood, sigma, 1.0, damping=True)
        flags = (damped.H.damping, (damped.H * 1.0).damping,
                 (damped.H + torch.tensor(1.0, dtype=torch.float64)).damping)
        rep.note(f"{loss} KronLaplace(damping=True) flag",
                 f"la.H.damping = {flags[0]}, (la.H * c).damping = {flags[1]}, "
                 f"(la.H + δ).damping = {flags[2]}: KronDecomposed's __mul__ and __add__ "
                 "build a new KronDecomposed without passing damping on")

    # σ ≠ 1: the exact posterior does not care how 1/σ² is split between the factors; the
    # factored one does
    loss, likelihood, sigma = "mse", "regression", 0.7
    y = T.targets(p, loss)
    model = T.mlp_model(p, bias=True)
    natural = _kron_groups(p, loss, sigma)
    peer_split = _kron_groups(p, loss, sigma, split="peer")
    prior = PRIORS["scalar"]
    la = _fit(KronLaplace, model, x, y, likelihood, sigma, 1.0)
    _compare(rep, f"mse σ={sigma} KronLaplace vs kron", _peer(la, prior),
             _ref("kron", p, loss, sigma, natural, prior, 1.0), loss, sigma, 1.0, k)
    la = _fit(KronLaplace, model, x, y, likelihood, sigma, 1.0, damping=True)
    lml_p, grad_p = _peer_damped(la, prior)
    rep.diagnose(f"mse σ={sigma} KronDecomposed(damping=True) evidence", np.array(lml_p), {
        "1/σ² and ½ on G (kfac_ref's natural factors)": np.array(
            _ref("kron_factored", p, loss, sigma, natural, prior, 1.0)[0]),
        "1/σ and √½ on each factor (the peer's split)": np.array(
            _ref("kron_factored", p, loss, sigma, peer_split, prior, 1.0)[0]),
    }, TOL)


def main(argv=None):
    import laplace

    version = getattr(laplace, "__version__", None)
    if version is None:
        from importlib.metadata import version as _v

        version = _v("laplace-torch")
    C.run_checks(argv, "laplace_torch", f"laplace-torch {version}, torch {torch.__version__}", run)


if __name__ == "__main__":
    main()
