"""curvlinops (``curvlinops-for-pytorch``) as an implementation under test.

Environment: ``conformance/peers/torchpeers.txt`` (its own venv; not installed in CI).
Findings and reproductions: ``conformance/peers/FINDINGS.md``, ``repro_curvlinops.py``.

Mapping: the suite's portable network spec becomes an ``nn.Sequential`` in float64
(:func:`conformance.peers.nets.torch_build`; HWIO → OIHW kernels, NCHW activations, explicit
zero padding, an NHWC flatten); the loss is PyTorch's with ``reduction="sum"``
(``CrossEntropyLoss`` / ``MSELoss`` = ‖f − y‖²).  ``KFACLinearOperator`` with
``fisher_type`` "type-2" (for ``ggn_exact`` and ``fisher_exact``; the two coincide for these
natural-parameter losses) or "empirical", ``kfac_approx`` from ``params["weight_sharing"]``
(conv layers always "expand", which gives the KFC block), ``separate_weight_and_bias=True``
(the default).  Dense matrices are ``op @ I``.

Declared conventions: kron(G, A) on PyTorch's [out, in] weights, bias a separate block after
the weight, unfold patch order (channel slowest), curvature of the summed loss, ‖f − y‖²
(variance 0.5), conv/shared factors in the "expand" normalisation (A over N·|T| rows, G
summed over locations).
"""

from __future__ import annotations

from ..adapter import implements
from ._peer import PeerAdapter, torch_conventions

ADAPTERS = {"curvlinops": "conformance.adapters.peer_curvlinops:CurvlinopsAdapter"}

_IMPLEMENTED = (
    "networks.kfac",
    "networks.kfac_input_factors",
    "networks.kfac_output_factors",
    "networks.ggn",
    "networks.empirical_fisher",
)
_REASONS = {
    "losses.sample": "curvlinops draws its Monte-Carlo targets inside KFACLinearOperator "
    "(fisher_type='mc'); no sampler is exposed to map",
    "blocks.kron_cached_inverse": "not mapped: no counterpart of kfac-jax's cached (stale) block "
    "products is mapped in this adapter",
    "sampling": "curvlinops' KFAC with fisher_type='mc' is not mapped yet: its draws come from a "
    "torch generator seeded by the library, so only the statistical route (params['seed']) would "
    "apply",
    "linalg": "curvlinops works on models, not bare matrices; its damped inverses "
    "(KFACInverseLinearOperator) are checked in repro_curvlinops.py",
    "factors": "factors come only from a model pass; see networks.kfac_*_factors",
    "losses": "loss-Hessian square roots are internal (curvlinops.kfac_utils)",
    "blocks": "KFACInverseLinearOperator needs a KFACLinearOperator of a model; checked in "
    "repro_curvlinops.py",
    "averaging": "curvlinops has no moving averages",
    "estimator": "curvlinops has no estimator state",
}

_FISHER = {"ggn_exact": "type-2", "fisher_exact": "type-2", "fisher_empirical": "empirical"}


class CurvlinopsAdapter(PeerAdapter):
    name = "curvlinops"
    description = "curvlinops KFACLinearOperator / GGNLinearOperator / EFLinearOperator (PyTorch)"
    conventions = torch_conventions(
        bias_position="separate",
        curvature_of="sum",
        mse_variance=0.5,
        conv_style="expand",
        empirical_fisher_unit="loss_term",
    )
    IMPLEMENTED, REASONS = _IMPLEMENTED, _REASONS
    REQUIRES = ("curvlinops", "torch")
    DISTRIBUTIONS = ("curvlinops-for-pytorch", "torch")

    # -- helpers ------------------------------------------------------------------------------
    def _problem(self, inputs, params):
        from ..peers import nets

        model, x, pmods = nets.torch_build(params["net"], inputs)
        nets.check_forward_torch(model, x, params["net"], inputs)
        y = nets.torch_targets(params, inputs)
        loss = nets.torch_loss(params, "sum")
        plist = [p for m in pmods for p in ([m.weight] + ([m.bias] if m.bias is not None else []))]
        return model, x, y, loss, plist, pmods

    @staticmethod
    def _dense(op, n):
        import torch

        return (op @ torch.eye(n, dtype=torch.float64)).detach().numpy()

    def _kfac(self, inputs, params):
        from curvlinops import KFACLinearOperator

        model, x, y, loss, plist, pmods = self._problem(inputs, params)
        op = KFACLinearOperator(
            model,
            loss,
            plist,
            [(x, y)],
            check_deterministic=False,
            fisher_type=_FISHER[params["mode"]],
            kfac_approx=params.get("weight_sharing", "expand"),
            separate_weight_and_bias=True,
        )
        op.compute_kronecker_factors()
        return op, model, plist, pmods

    # -- capabilities -------------------------------------------------------------------------
    @implements("networks.kfac")
    def kfac(self, inputs, params):
        op, _, plist, _ = self._kfac(inputs, params)
        return self._dense(op, sum(p.numel() for p in plist))

    def _factors(self, inputs, params, which):
        from ..peers import nets

        op, model, _, pmods = self._kfac(inputs, params)
        names = {id(m): n for n, m in model.named_modules()}
        d = op._input_covariances if which == "input" else op._gradient_covariances
        return nets.block_diag([d[names[id(m)]].detach().numpy() for m in pmods])

    @implements("networks.kfac_input_factors")
    def input_factors(self, inputs, params):
        return self._factors(inputs, params, "input")

    @implements("networks.kfac_output_factors")
    def output_factors(self, inputs, params):
        return self._factors(inputs, params, "output")

    @implements("networks.ggn")
    def ggn(self, inputs, params):
        from curvlinops import GGNLinearOperator

        model, x, y, loss, plist, _ = self._problem(inputs, params)
        op = GGNLinearOperator(model, loss, plist, [(x, y)], check_deterministic=False)
        return self._dense(op, sum(p.numel() for p in plist))

    @implements("networks.empirical_fisher")
    def empirical_fisher(self, inputs, params):
        from curvlinops import EFLinearOperator

        model, x, y, loss, plist, _ = self._problem(inputs, params)
        op = EFLinearOperator(model, loss, plist, [(x, y)], check_deterministic=False)
        return self._dense(op, sum(p.numel() for p in plist))
