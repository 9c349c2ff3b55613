"""nngeometry as an implementation under test.

Environment: ``conformance/peers/torchpeers.txt``.  Findings: ``conformance/peers/FINDINGS.md``,
``repro_nngeometry.py``.

Mapping: the network spec as an ``nn.Sequential``; ``FIM(model, loader, PMatKFAC | PMatDense,
variant="classif_logits" | "regression")`` over one batch of N examples.  ``networks.kfac``
is ``PMatKFAC.to_torch(split_weight_bias=False)`` (per layer ``kron(G, A)`` on the row-major
vec of the [out, in + 1] matrix [W b]: bias interleaved, i.e. the "GA"/"last" layout);
``networks.ggn`` is ``PMatDense`` (the exact Fisher, equal to the GGN for these losses),
permuted here from nngeometry's [W.flatten(), b] order into that same layout.  The factors
themselves carry a scale split (A·√n, G/√n, n the number of output-space square-root columns:
C for regression, C − 1 for classif_logits), so they are not mapped; their product is.
The default dtype is set to float64 (nngeometry otherwise builds float32 buffers; FINDINGS.md).

Declared conventions: kron(G, A), bias last (interleaved), unfold patch order, curvature of the
mean, unit-variance regression (``mse_variance=1.0``).  nngeometry has no empirical Fisher.
"""

from __future__ import annotations

import numpy as np

from ..adapter import CaseUnsupported, implements
from ._peer import PeerAdapter, torch_conventions

ADAPTERS = {"nngeometry": "conformance.adapters.peer_nngeometry:NngeometryAdapter"}

_IMPLEMENTED = ("networks.kfac", "networks.ggn")
_REASONS = {
    "losses.sample": "nngeometry draws its Monte-Carlo targets inside the Fisher computation; no "
    "sampler is exposed to map",
    "blocks.kron_cached_inverse": "not mapped: no counterpart of kfac-jax's cached (stale) block "
    "products is mapped in this adapter",
    "sampling": "nngeometry's Monte-Carlo Fisher (variant 'classif_logits' sampling) is not mapped "
    "yet: its draws come from torch's global generator, so only the statistical route would apply",
    "networks.empirical_fisher": "nngeometry computes the Fisher with model targets only",
    "networks.kfac_input_factors": "PMatKFAC splits a scale √n between A and G (A·√n, G/√n); "
    "only the product is comparable (networks.kfac)",
    "networks.kfac_output_factors": "as for the input factors",
    "linalg": "not exposed as functions of bare matrices",
    "factors": "factors come only from a model pass",
    "losses": "not exposed",
    "blocks": "PMatKFAC.solvePVec (π-split) is checked in repro_nngeometry.py",
    "averaging": "no moving averages",
    "estimator": "no estimator state",
}


class NngeometryAdapter(PeerAdapter):
    name = "nngeometry"
    description = "nngeometry FIM with PMatKFAC / PMatDense (PyTorch)"
    conventions = torch_conventions(mse_variance=1.0)
    IMPLEMENTED, REASONS = _IMPLEMENTED, _REASONS
    REQUIRES = ("torch", "nngeometry")
    DISTRIBUTIONS = ("nngeometry", "torch")
    TORCH_FLOAT64_DEFAULT = True  # nngeometry builds float32 buffers otherwise (FINDINGS.md)

    def _fim(self, inputs, params, rep):
        from nngeometry.metrics import FIM
        from torch.utils.data import DataLoader, TensorDataset

        from ..peers.torch_adapter import problem

        if params["mode"] == "fisher_empirical" if "mode" in params else False:
            raise CaseUnsupported("nngeometry has no empirical Fisher")
        if np.ndim(inputs["x"]) == 3:
            raise CaseUnsupported(
                "nngeometry's FIM takes the last output axis as the "
                "class/regression axis of 2-D outputs only"
            )
        model, x, y, pmods = problem(inputs, params)
        variant = "classif_logits" if params["loss"] == "categorical" else "regression"
        loader = DataLoader(TensorDataset(x, y), batch_size=int(x.shape[0]))
        return FIM(model, loader, rep, variant=variant), pmods

    @implements("networks.kfac")
    def kfac(self, inputs, params):
        from nngeometry.object import PMatKFAC

        F, _ = self._fim(inputs, params, PMatKFAC)
        return F.to_torch(split_weight_bias=False).detach().numpy()

    @implements("networks.ggn")
    def ggn(self, inputs, params):
        from nngeometry.object import PMatDense

        F, pmods = self._fim(inputs, params, PMatDense)
        dense = F.to_torch().detach().numpy()
        # [W.flatten() (o, i), b (o)] per layer -> row-major vec of [W b] ([out, in + 1])
        perm, off = [], 0
        for m in pmods:
            out_dim = m.weight.shape[0]
            in_dim = int(np.prod(m.weight.shape[1:]))
            has_b = m.bias is not None
            for o in range(out_dim):
                perm += [off + o * in_dim + i for i in range(in_dim)]
                if has_b:
                    perm.append(off + out_dim * in_dim + o)
            off += out_dim * in_dim + (out_dim if has_b else 0)
        perm = np.array(perm)
        return dense[np.ix_(perm, perm)]
