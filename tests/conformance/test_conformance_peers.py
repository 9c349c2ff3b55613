"""Peer adapters: importable without their peers, declared conventions valid, skip reasons
given for everything they do not map; and, where a peer is installed (its own venv, see
conformance/peers/*.txt), a smoke run of its adapter.  CI installs no peer: those parts skip."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

PEERS = {
    # adapter name -> (module, the peer's import name)
    "tf_kfac": ("conformance.adapters.peer_tf_kfac", "kfac"),
    "kfac_jax": ("conformance.adapters.peer_kfac_jax", "kfac_jax"),
    "curvlinops": ("conformance.adapters.peer_curvlinops", "curvlinops"),
    "backpack": ("conformance.adapters.peer_backpack", "backpack"),
    "asdl": ("conformance.adapters.peer_asdl", "asdl"),
    "nngeometry": ("conformance.adapters.peer_nngeometry", "nngeometry"),
    "laplace_torch": ("conformance.adapters.peer_laplace_torch", "laplace"),
}

#: adapter name -> (family, case id) of its smoke run: one small case the peer computes
#: exactly (a network's K-FAC; for laplace-torch, whose curvature comes from a backend, the
#: exact Kronecker Laplace evidence)
SMOKE = {name: ("networks", "networks.kfac/mlp_tanh_n1_ce_ggn_exact") for name in PEERS}
SMOKE["laplace_torch"] = ("laplace", "laplace.log_marginal_likelihood/kron_shared_T1")


def _adapter(name):
    from conformance.adapter import load_adapter

    return load_adapter(name)


@pytest.mark.parametrize("name", sorted(PEERS))
def test_peer_adapter_is_registered_and_lazy(name):
    """The module imports without the peer (no top-level framework import) and registers."""
    from conformance.adapters import shipped

    assert name in shipped()
    mod = importlib.import_module(PEERS[name][0])
    src = importlib.util.find_spec(PEERS[name][0]).origin
    text = open(src, encoding="utf-8").read()
    top = [ln for ln in text.splitlines() if ln.startswith(("import ", "from "))]
    for heavy in (
        "torch",
        "jax",
        "tensorflow",
        "kfac",
        "curvlinops",
        "backpack",
        "asdl",
        "nngeometry",
        "laplace",
    ):
        assert not any(ln.split()[1].split(".")[0] == heavy for ln in top), (name, heavy)
    assert hasattr(mod, "ADAPTERS")


@pytest.mark.parametrize("name", sorted(PEERS))
def test_peer_adapter_declares_and_explains(name):
    """Conventions are valid, and every capability it does not implement has a reason."""
    from conformance.catalogue import capabilities

    ad = _adapter(name)
    ad.conventions.to_dict()  # validated in Conventions.__post_init__
    impl = set(ad.implementations())
    assert impl, name
    unsupported = ad.unsupported
    for cap in capabilities():
        if cap not in impl:
            assert unsupported.get(cap), (name, cap)
    assert not impl & set(unsupported), (name, impl & set(unsupported))


@pytest.mark.parametrize("name", sorted(PEERS))
def test_peer_adapter_smoke(name):
    """Where the peer is installed: its adapter reproduces one small exact case."""
    if importlib.util.find_spec(PEERS[name][1]) is None:
        pytest.skip(f"{PEERS[name][1]} is not installed (peer venv: conformance/peers/*.txt)")
    family, case_id = SMOKE[name]
    pytest.importorskip("kfac_ref.curvature" if family == "networks" else f"kfac_ref.{family}")
    from conformance.catalogue import build_catalogue, capabilities
    from conformance.runner import run_adapter

    ad = _adapter(name)
    cases, _ = build_catalogue([family])
    case = [c for c in cases if c.id == case_id]
    assert case
    report = run_adapter(ad, case, capabilities())
    statuses = {r.status for r in report.results}
    assert statuses <= {"pass", "convention"}, [r.message for r in report.results]
