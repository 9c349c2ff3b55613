"""The base of the adapters of other libraries (the ``peer_*`` modules)."""

from __future__ import annotations

from ..adapter import Adapter, implements
from ..conventions import Conventions


def torch_conventions(**others):
    """A PyTorch library's conventions: ``kron(G, A)`` on the [out, in] weight, patches in
    ``unfold`` order (channel slowest), factors not symmetrised; ``others`` declares the rest."""
    return Conventions(kron_order="GA", patch_order="chw", symmetrised=False, **others)


class PeerAdapter(Adapter):
    """An adapter of another library, declared by what it maps and what it needs.

    ``IMPLEMENTED`` names the capabilities it maps and ``REASONS`` (family or full capability
    name -> reason) says why each other one is not; ``REQUIRES`` are the modules ``setup``
    imports (a missing one is ``AdapterUnavailable`` pointing to ``ENVIRONMENT``, the
    requirements file of the library's venv); ``DISTRIBUTIONS`` are what ``version`` names,
    the library first; ``TORCH_FLOAT64_DEFAULT`` makes ``setup`` set torch's default dtype to
    float64, for a library that builds its buffers in the default dtype.
    """

    dtype = "float64"
    IMPLEMENTED: tuple = ()
    REASONS: dict = {}
    REQUIRES: tuple = ()
    ENVIRONMENT = "conformance/peers/torchpeers.txt"
    DISTRIBUTIONS: tuple = ()
    TORCH_FLOAT64_DEFAULT = False

    @property
    def unsupported(self):
        from ..peers.nets import unsupported_reasons

        return unsupported_reasons(self.IMPLEMENTED, self.REASONS)

    def setup(self):
        from ..peers.torch_adapter import require

        require(*self.REQUIRES, environment=self.ENVIRONMENT)
        if self.TORCH_FLOAT64_DEFAULT:
            import torch

            torch.set_default_dtype(torch.float64)

    def version(self):
        import importlib.metadata as md

        return ", ".join(f"{d} {md.version(d)}" for d in self.DISTRIBUTIONS)


class TorchKronPeer(PeerAdapter):
    """A PyTorch peer whose ``_layers(inputs, params)`` gives every parametric layer's factors
    ``(G, A, has_bias)``, the bias a separate block: the K-FAC matrix and both factors."""

    def _layers(self, inputs, params):
        raise NotImplementedError

    @implements("networks.kfac")
    def kfac(self, inputs, params):
        from ..peers.torch_adapter import kron_blocks

        return kron_blocks(self._layers(inputs, params), separate_bias=True)

    @implements("networks.kfac_input_factors")
    def input_factors(self, inputs, params):
        from ..peers import nets

        return nets.block_diag([a for _, a, _ in self._layers(inputs, params)])

    @implements("networks.kfac_output_factors")
    def output_factors(self, inputs, params):
        from ..peers import nets

        return nets.block_diag([g for g, _, _ in self._layers(inputs, params)])
