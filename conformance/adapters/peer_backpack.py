"""BackPACK (``backpack-for-pytorch``) as an implementation under test.

Environment: ``conformance/peers/torchpeers.txt``.  Findings: ``conformance/peers/FINDINGS.md``,
``repro_backpack.py``.

Mapping: the network spec as an ``nn.Sequential`` (:func:`conformance.peers.nets.torch_build`),
``extend``-ed together with the loss (``reduction="sum"``), one backward pass under
``backpack(KFLR())`` (K-FAC with the exact loss Hessian: ``ggn_exact`` / ``fisher_exact``);
``weight.kflr == [G, A]``, ``bias.kflr == [G]``.  BackPACK has no empirical-Fisher K-FAC.

Declared conventions: kron(G, A), separate bias block, unfold patch order, curvature of the
summed loss, ‖f − y‖² (variance 0.5), conv factors "hybrid" (A = Σ āāᵀ/N, G of KFAC-reduce),
which BackPACK documents as its KFLR/KFAC for convolutions.
"""

from __future__ import annotations

import numpy as np

from ..adapter import CaseUnsupported
from ._peer import TorchKronPeer, torch_conventions

ADAPTERS = {"backpack": "conformance.adapters.peer_backpack:BackpackAdapter"}

_IMPLEMENTED = ("networks.kfac", "networks.kfac_input_factors", "networks.kfac_output_factors")
_REASONS = {
    "losses.sample": "BackPACK draws its Monte-Carlo targets inside the KFAC extension; no sampler "
    "is exposed to map",
    "sampling": "BackPACK's KFAC extension (Monte-Carlo sampled) is not mapped yet: its draws come "
    "from torch's global generator, so only the statistical route (params['seed'] → "
    "torch.manual_seed) would apply",
    "networks": "BackPACK returns no dense GGN/EF matrix (only per-sample or diagonal quantities)",
    "linalg": "BackPACK exposes only curvature quantities of a model, no linear algebra",
    "factors": "factors come only from a model's backward pass; see networks.kfac_*_factors",
    "losses": "BackPACK's loss-Hessian square roots are internal",
    "blocks": "BackPACK does not invert or damp its factors",
    "averaging": "BackPACK has no moving averages",
    "estimator": "BackPACK has no estimator state",
}


class BackpackAdapter(TorchKronPeer):
    name = "backpack"
    description = "BackPACK KFLR extension (PyTorch)"
    conventions = torch_conventions(
        bias_position="separate",
        curvature_of="sum",
        mse_variance=0.5,
        # BackPACK's KFLR/KFAC for Conv2d cite KFC (Grosse & Martens 2016) and this adapter
        # declares that.  What BackPACK computes is the hybrid A = |T|·A_KFC, G = G_reduce
        # (its own TODO in hbp/convnd.py notes the factor |T|; FINDINGS.md shows it is exact
        # in neither exactness setting), so the conv cases fail with the diagnosis
        # conv_style (= matches the reference under conv_style='hybrid').
        conv_style="kfc",
    )
    IMPLEMENTED, REASONS = _IMPLEMENTED, _REASONS
    REQUIRES = ("torch", "backpack")
    DISTRIBUTIONS = ("backpack-for-pytorch", "torch")
    # BackPACK's AvgPool2d second-order backprop builds float32 tensors from the default
    # dtype ("expected scalar type Double but found Float" on a float64 model otherwise);
    # recorded in FINDINGS.md.
    TORCH_FLOAT64_DEFAULT = True

    def _layers(self, inputs, params):
        from backpack import backpack, extend
        from backpack.extensions import KFLR

        from ..peers import nets
        from ..peers.torch_adapter import problem

        if params["mode"] == "fisher_empirical":
            raise CaseUnsupported(
                "BackPACK has no empirical-Fisher K-FAC (KFLR/KFAC/KFRA "
                "use the model's loss Hessian or samples)"
            )
        if params.get("weight_sharing", "expand") == "reduce" or np.ndim(inputs["x"]) == 3:
            raise CaseUnsupported("BackPACK's Linear KFLR needs 2-D inputs")
        model, x, y, pmods = problem(inputs, params)
        model = extend(model)
        loss = extend(nets.torch_loss(params, "sum"))
        with backpack(KFLR()):
            loss(model(x), y).backward()
        out = []
        for m in pmods:
            g, a = (t.detach().numpy() for t in m.weight.kflr)
            out.append((g, a, m.bias is not None))
        return out
