"""The base of the adapters of other libraries (the ``peer_*`` modules)."""

from __future__ import annotations

from ..adapter import Adapter
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
    the library first.
    """

    dtype = "float64"
    IMPLEMENTED: tuple = ()
    REASONS: dict = {}
    REQUIRES: tuple = ()
    ENVIRONMENT = "conformance/peers/torchpeers.txt"
    DISTRIBUTIONS: tuple = ()

    @property
    def unsupported(self):
        from ..peers.nets import unsupported_reasons

        return unsupported_reasons(self.IMPLEMENTED, self.REASONS)

    def setup(self):
        from ..peers.torch_adapter import require

        require(*self.REQUIRES, environment=self.ENVIRONMENT)

    def version(self):
        import importlib.metadata as md

        return ", ".join(f"{d} {md.version(d)}" for d in self.DISTRIBUTIONS)
