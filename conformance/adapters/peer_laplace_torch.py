"""laplace-torch (``laplace-torch``, Daxberger et al. 2021) as an implementation under test:
its Laplace evidence ``log_marginal_likelihood`` and the autograd gradient in the prior
precision.

Environment: ``conformance/peers/laplace.txt`` (its own venv; not installed in CI).  Findings
and the reproduction on a fitted MLP: ``conformance/peers/LAPLACE_FINDINGS.md``,
``repro_laplace_torch.py``.

Mapping (laplace-torch's public classes, float64; ``baselaplace.py``, ``utils/matrix.py``):
a ``torch.nn.Module`` holding one flat parameter per group (laplace-torch's groups, "layers",
are the parameter tensors) carries the parameter count; a ``KronLaplace`` (``kron``;
``damping=True`` for ``kron_factored``, the damped ``KronDecomposed`` laplace-torch documents),
``DiagLaplace`` (``diagonal``) or ``FullLaplace`` (``full``; the groups' blocks on the
diagonal of its one matrix) with ``temperature=T`` and ``prior_mean`` the concatenated
``mu_{g}`` gets, in place of ``fit``: ``mean`` = the concatenated ``theta_{g}``; ``H`` = the
case's curvature (``Kron([[A, G] or [H_b], ...])`` and its ``decompose(damping=...)``, the
diagonal, or the block-diagonal matrix) and ``loss = −ℓ`` with ``likelihood="classification"``,
whose ``log_likelihood`` is ``−loss/T`` = ℓ/T: the whole log-likelihood tempered, the suite's
contract.  (laplace-torch's regression likelihood leaves its Gaussian normaliser untempered,
a convention of how ℓ is formed from a loss, outside this capability: the reproduction
diagnoses it.)  The evidence is ``log_marginal_likelihood(prior_precision)``, the gradient
``torch.autograd.grad`` of it in a prior-precision tensor of the case's shape.

laplace-torch's ``Kron.__mul__`` puts a scalar c on a two-factor block as √c on each factor,
so the damped posterior of ``KronDecomposed(damping=True)`` times 1/T is
``(A/√T + √δ I) ⊗ (G/√T + √δ I)`` on the factors as given: kfac_ref's ``kron_factored``.  The
fault of LAPLACE_FINDINGS.md shows here: ``KronDecomposed.__mul__`` and ``__add__`` drop the
``damping`` flag, so ``KronLaplace(damping=True).log_marginal_likelihood`` evaluates the exact
posterior, and the ``kron_factored`` cases fail with the diagnosis
``exact_instead_of_factored``.

Not mapped: ``ekfac`` (laplace-torch has no EKFAC Laplace).
"""

from __future__ import annotations

import numpy as np

from ..adapter import CaseUnsupported, implements
from ._peer import PeerAdapter

ADAPTERS = {"laplace_torch": "conformance.adapters.peer_laplace_torch:LaplaceTorchAdapter"}

_IMPLEMENTED = ("laplace.log_marginal_likelihood", "laplace.prior_precision_grad")
_REASONS = {
    "linalg": "laplace-torch's Kronecker algebra (laplace.utils.matrix) is checked through its "
    "Laplace evidence only",
    "averaging": "laplace-torch has no moving averages",
    "factors": "laplace-torch takes its curvature from a backend (curvlinops, BackPACK, ASDL); "
    "those are checked as their own columns",
    "losses": "laplace-torch exposes no loss-curvature factors",
    "blocks": "laplace-torch's KronDecomposed powers are checked through its Laplace evidence",
    "estimator": "laplace-torch has no K-FAC estimator state",
    "networks": "laplace-torch's curvature comes from its backend (curvlinops by default), "
    "checked in the curvlinops column",
    "sampling": "laplace-torch's Monte-Carlo curvature comes from its backend",
    "optimizer": "laplace-torch has no K-FAC optimiser",
}


class LaplaceTorchAdapter(PeerAdapter):
    name = "laplace_torch"
    description = ("laplace-torch KronLaplace / KronLaplace(damping=True) / DiagLaplace / "
                   "FullLaplace log_marginal_likelihood and its autograd prior-precision "
                   "gradient (PyTorch)")
    IMPLEMENTED, REASONS = _IMPLEMENTED, _REASONS
    REQUIRES = ("laplace", "torch")
    ENVIRONMENT = "conformance/peers/laplace.txt"
    DISTRIBUTIONS = ("laplace-torch", "torch")

    # -- helpers ------------------------------------------------------------------------------
    def _laplace(self, inputs, params):
        import torch
        from laplace import DiagLaplace, FullLaplace, KronLaplace
        from laplace.utils.matrix import Kron

        structure, k = params["structure"], params["n_groups"]
        if structure == "ekfac":
            raise CaseUnsupported("laplace-torch has no EKFAC Laplace approximation")

        def t(name):
            return torch.as_tensor(np.asarray(inputs[name], dtype=np.float64))

        theta = [t(f"theta_{g}") for g in range(k)]
        model = torch.nn.Module()
        model.groups = torch.nn.ParameterList(
            [torch.nn.Parameter(th.clone()) for th in theta])
        kw = {"temperature": float(params["temperature"]),
              "prior_mean": torch.cat([t(f"mu_{g}") for g in range(k)])}
        if structure in ("kron", "kron_factored"):
            damped = structure == "kron_factored"
            la = KronLaplace(model, "classification", damping=damped, **kw)
            blocks = [[t(f"A_{g}"), t(f"G_{g}")] if f"A_{g}" in inputs else [t(f"H_{g}")]
                      for g in range(k)]
            la.H_facs = Kron(blocks)
            la.H = la.H_facs.decompose(damping=damped)
        elif structure == "diagonal":
            la = DiagLaplace(model, "classification", **kw)
            la.H = torch.cat([t(f"d_{g}") for g in range(k)])
        elif structure == "full":
            la = FullLaplace(model, "classification", **kw)
            la.H = torch.block_diag(*[t(f"H_{g}") for g in range(k)])
        else:
            raise CaseUnsupported(f"structure {structure!r} is not mapped")
        la.mean = torch.cat(theta)
        # likelihood "classification": log_likelihood = −loss/T (no normaliser), = ℓ/T
        la.loss = torch.tensor(-float(params["log_likelihood"]), dtype=torch.float64)
        la.n_data = 1
        return la

    def _evidence(self, inputs, params):
        import torch

        la = self._laplace(inputs, params)
        p = torch.tensor(np.asarray(inputs["prior_precision"], dtype=np.float64),
                         requires_grad=True)
        return la.log_marginal_likelihood(prior_precision=p), p

    # -- capabilities -------------------------------------------------------------------------
    @implements("laplace.log_marginal_likelihood")
    def log_marginal_likelihood(self, inputs, params):
        lml, _ = self._evidence(inputs, params)
        return lml.detach().numpy().reshape(())

    @implements("laplace.prior_precision_grad")
    def prior_precision_grad(self, inputs, params):
        import torch

        lml, p = self._evidence(inputs, params)
        (grad,) = torch.autograd.grad(lml, p)
        return grad.numpy().reshape(np.shape(inputs["prior_precision"]))
