"""ASDL (PyPI ``asdfghjkl``, imports as ``asdl``) as an implementation under test.

Environment: ``conformance/peers/torchpeers.txt``.  Findings: ``conformance/peers/FINDINGS.md``,
``repro_asdl.py``.

Mapping: the network spec as an ``nn.Sequential``; ``get_fisher_maker(model,
FisherConfig(fisher_type, fisher_shapes=["kron"], loss_type, data_size=N))`` with
``fisher_exact`` (for ``ggn_exact`` / ``fisher_exact``) or ``fisher_emp`` (with the loss given
through ``setup_loss_call``: ASDL forces ``reduction="sum"`` on it; the squared error is
½‖f − y‖², ASDL's own unit variance); ``module.fisher.kron.A`` / ``.B``.

Declared conventions: kron(G, A), separate bias block, unfold patch order, curvature of the
mean (ASDL divides both factors by ``data_size``), unit-variance squared error whatever the
case's variance (``mse_variance=1.0``; ASDL's exact Fisher for MSE ignores ``FisherConfig.var``),
conv factors "expand" (A over N·|T| rows, G summed over locations).
"""

from __future__ import annotations

from ..adapter import CaseUnsupported
from ._peer import TorchKronPeer, torch_conventions

ADAPTERS = {"asdl": "conformance.adapters.peer_asdl:AsdlAdapter"}

_IMPLEMENTED = ("networks.kfac", "networks.kfac_input_factors", "networks.kfac_output_factors")
_REASONS = {
    "losses.sample": "ASDL draws its Monte-Carlo targets inside fisher_mc; no sampler is exposed to"
    " map",
    "blocks.kron_cached_inverse": "not mapped: no counterpart of kfac-jax's cached (stale) block "
    "products is mapped in this adapter",
    "sampling": "ASDL's Monte-Carlo Fisher (fisher_mc) is not mapped yet: its draws come from "
    "torch's global generator, so only the statistical route (params['seed'] → torch.manual_seed)"
    " would apply",
    "networks": "not mapped (ASDL's 'full' Fisher shape could give the exact Fisher; "
    "see FINDINGS.md for why the exact Fisher path is unreliable for >2-D outputs)",
    "linalg": "ASDL's linear algebra (cholesky_inv, KronMatrix.update_inv) needs a fitted "
    "model; the π-split inverse is checked in repro_asdl.py",
    "factors": "factors come only from a model pass; see networks.kfac_*_factors",
    "losses": "not exposed",
    "blocks": "checked in repro_asdl.py (KronMatrix.mvp with use_inv)",
    "averaging": "not mapped",
    "estimator": "not mapped",
}


class AsdlAdapter(TorchKronPeer):
    name = "asdl"
    description = "ASDL FisherMaker, fisher_shapes=['kron'] (PyTorch)"
    conventions = torch_conventions(bias_position="separate", mse_variance=1.0,
                                    conv_style="expand")
    IMPLEMENTED, REASONS = _IMPLEMENTED, _REASONS
    REQUIRES = ("torch", "asdl")
    DISTRIBUTIONS = ("asdfghjkl", "torch")

    def _layers(self, inputs, params):
        import torch
        import torch.nn.functional as F
        from asdl import FisherConfig, get_fisher_maker

        from ..peers.torch_adapter import problem

        if params.get("weight_sharing", "expand") == "reduce":
            raise CaseUnsupported("ASDL has no KFAC-reduce for weight-shared layers")
        # Outputs with more than 2 dimensions run: ASDL's exact Fisher indexes output axis 1
        # as the class axis, so they give wrong numbers or crash (FINDINGS.md) -- a fault
        # the suite must show, not a missing feature.

        class HalfMSE(torch.nn.MSELoss):
            def forward(self, f, t):
                return 0.5 * super().forward(f, t)

        model, x, y, pmods = problem(inputs, params)
        loss_type = "cross_entropy" if params["loss"] == "categorical" else "mse"
        ftype = "fisher_emp" if params["mode"] == "fisher_empirical" else "fisher_exact"
        cfg = FisherConfig(
            fisher_type=ftype,
            fisher_shapes=["kron"],
            loss_type=loss_type,
            data_size=int(x.shape[0]),
        )
        fm = get_fisher_maker(model, cfg)
        dummy = fm.setup_model_call(model, x)
        if ftype == "fisher_emp":
            fm.setup_loss_call(
                F.cross_entropy if loss_type == "cross_entropy" else HalfMSE(), dummy, y
            )
        fm.forward_and_backward()
        return [
            (m.fisher.kron.B.detach().numpy(), m.fisher.kron.A.detach().numpy(), m.bias is not None)
            for m in pmods
        ]
