"""The benchmark suite runs end to end: ``python -m benchmarks --quick`` writes a JSON file and a
Markdown table with the documented schema, and every hand baseline agreed with kfac_ref.

Nothing here times anything or asserts on speed: the figures of a quick run mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMED_OPS = {"update", "inverses", "cached_product"}
SUMMARY_KEYS = {"median_s", "q1_s", "q3_s", "min_s", "max_s", "times_s"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out, proc.stdout


def test_quick_run_writes_json_and_markdown(quick_run):
    out, stdout = quick_run
    result = json.loads((out / "bench-numpy-quick.json").read_text())
    md = (out / "bench-numpy-quick.md").read_text()
    assert md in stdout  # the table is printed as well as written
    meta = result["meta"]
    assert meta["schema_version"] == 2 and meta["quick"] is True
    assert meta["backend"] == "numpy" and meta["checks_passed"] is True
    assert set(meta["workloads"]) == {"mlp", "cnn"}
    rows = result["rows"]
    timed = [r for r in rows if r["op"] in TIMED_OPS]
    # every estimation mode, the inverses and the cached product, per workload and dtype
    from kfac_ref.curvature import ESTIMATION_MODES

    for wl in ("mlp", "cnn"):
        for dtype in ("float32", "float64"):
            mine = [r for r in timed if r["workload"] == wl and r["dtype"] == dtype]
            assert {r["mode"] for r in mine if r["op"] == "update"} == set(ESTIMATION_MODES)
            assert {r["op"] for r in mine} == TIMED_OPS
    for r in timed:
        assert set(r["kfac_ref"]) == SUMMARY_KEYS and set(r["hand"]) == SUMMARY_KEYS
        assert len(r["kfac_ref"]["times_s"]) >= 1
        assert r["ratio"] > 0
        assert r["row"] in md
    mem = [r for r in rows if r["op"] == "conv_memory"]
    assert len(mem) == 4 and len({r["batch"] for r in mem}) == 2
    assert all(r["kfac_ref_peak_bytes"] > 0 and r["hand_peak_bytes"] > 0 for r in mem)
    # every peer is either timed (installed here) or named as not installed
    named = {r["peer"] for r in rows if r["op"] in ("peer", "peer_missing")}
    assert named == {"curvlinops", "kfac_jax"}
    # the memory bound's cost: chunked against one-shot kfac_ref, two rows per dtype
    chunking = [r for r in rows if r["op"] == "chunking"]
    assert len(chunking) == 4 and {r["dtype"] for r in chunking} == {"float32", "float64"}
    assert all(r["row"] in md and r["ratio"] > 0 for r in chunking)
    assert all(r["budget_bytes"] < r["im2col_bytes"] for r in chunking)  # really chunked


def test_every_baseline_agreed_with_kfac_ref(quick_run):
    out, _ = quick_run
    result = json.loads((out / "bench-numpy-quick.json").read_text())
    checked = [r for r in result["rows"] if "check" in r and r["op"] != "peer"]
    assert len(checked) == 2 * 2 * 8 + 4 + 4
    for r in checked:
        c = r["check"]
        assert c["ok"] and 0 <= c["max_rel_err"] <= c["tol"], r["row"]
        # the tolerance is a rounding bound, not a loophole: far below an O(1) disagreement
        assert c["tol"] < 1e-2, r["row"]


def test_wrong_baseline_fails_the_check():
    """A baseline off by a factor is caught by the agreement check (exit status 1 path)."""
    import numpy as np

    from benchmarks import suite

    want = np.eye(3)
    assert not suite._check(suite.rel_err(2 * want, want), suite.Runner.tol(np.float32, 1e4))["ok"]
    assert suite._check(suite.rel_err(want, want), suite.Runner.tol(np.float64))["ok"]


@pytest.mark.parametrize("peer", ["curvlinops", "kfac_jax"])
def test_peer_rows_check_the_factors_before_timing(peer, monkeypatch):
    """In a peer's environment: one full-update row per workload, dtype and mode, each
    behind the factor agreement check; a peer whose factors are off by a factor 2 fails it."""
    pytest.importorskip(peer)
    import numpy as np

    from benchmarks import peers, suite

    def rows(runner):
        return [r for r in runner.rows if r["op"] == "peer" and r["peer"] == peer]

    runner = suite.Runner(suite.make_backend("numpy"), quick=True, repeats=1, log=lambda s: None)
    for make in (suite.mlp_workload, suite.cnn_workload):
        runner.peer_rows(make(True), np.float64)
    got = rows(runner)
    assert len(got) == 2 * len(peers.PEER_MODES)
    assert all(r["check"]["ok"] and r["ratio"] > 0 for r in got)
    # where the peer ran: curvlinops on the host next to kfac_ref's NumPy arrays, kfac-jax on
    # JAX's default backend
    if peer == "curvlinops":
        assert {r["peer_on"] for r in got} == {"torch-cpu"}
    else:
        import jax

        assert {r["peer_on"] for r in got} == {f"jax-{jax.default_backend()}"}
    cls = peers.PEER_CLASSES[peer]
    real = cls.factors
    monkeypatch.setattr(cls, "factors", lambda self, mode: [(a, 2 * g) for a, g in
                                                             real(self, mode)])
    runner.rows.clear()
    runner.peer_rows(suite.mlp_workload(True), np.float64)
    assert rows(runner) and not any(r["check"]["ok"] for r in rows(runner))


@pytest.mark.parametrize(("backend", "device"), [
    ("numpy", "cpu"), ("strict", "cpu"), ("torch-cpu", "cpu"), ("torch-cuda", "cuda"),
    ("cupy", "cuda")])
def test_the_torch_peers_run_on_kfac_refs_device(backend, device):
    from benchmarks import peers

    assert peers.torch_device(backend) == device


def _stub_peer(monkeypatch, why=None):
    """A peer ``stub`` in place of the real ones, recording the device it was given."""
    from benchmarks import peers

    seen = []

    class Stub:
        name = "stub"

        @staticmethod
        def unavailable(device):
            return why

        def __init__(self, wl, inputs, dtype, damping, device):
            seen.append(device)
            self.on = f"stub-{device}"

        def full_update(self, mode, seed):
            return None

        def factors(self, mode):  # wrong factors: the agreement check fails, rows stay
            return [(np.zeros((1, 1)), np.zeros((1, 1)))] * 3

    monkeypatch.setattr(peers, "PEERS", ("stub",))
    monkeypatch.setattr(peers, "PEER_CLASSES", {"stub": Stub})
    monkeypatch.setattr(peers, "installed", lambda peer: True)
    return seen


@pytest.mark.parametrize("backend", ["numpy", "torch-cuda", "cupy"])
def test_peer_rows_give_the_peer_kfac_refs_device(monkeypatch, backend):
    """The peer is built for kfac_ref's device (here a NumPy backend under the name of
    each library, so that the device logic runs without a GPU) and its rows say where it
    ran; a peer that cannot run there is listed as skipped, once, with the reason."""
    from benchmarks import peers, suite

    seen = _stub_peer(monkeypatch)
    runner = suite.Runner(suite.Backend(backend, lambda a: a, np.asarray), quick=True,
                          repeats=1, log=lambda s: None)
    runner.peer_rows(suite.mlp_workload(True), np.float64)
    device = peers.torch_device(backend)
    assert seen == [device]
    rows = [r for r in runner.rows if r["op"] == "peer"]
    assert len(rows) == len(peers.PEER_MODES)
    assert {r["peer_on"] for r in rows} == {f"stub-{device}"}
    assert not any(r["check"]["ok"] for r in rows)

    seen = _stub_peer(monkeypatch, why="no such device here")
    runner.rows.clear()
    for dtype in (np.float32, np.float64):
        runner.peer_rows(suite.mlp_workload(True), dtype)
    assert seen == []
    assert runner.rows == [{"row": "peer stub", "op": "peer_missing", "peer": "stub",
                            "status": "skipped: no such device here"}]


def test_the_large_cnn_workload_agrees_with_its_baseline():
    """``--workloads cnn-large`` (quick sizes here): every row of the workload is timed
    behind the agreement check, as the default workloads' rows are."""
    import numpy as np

    from benchmarks import suite

    full = suite.WORKLOADS["cnn-large"](False)  # built, not run: N=512, 64 and 128 channels
    assert full.in_shape == (512, 32, 32, 3)
    assert "conv 3→64, conv 64→128/2" in full.title
    wl = suite.WORKLOADS["cnn-large"](True)
    assert wl.name == "cnn-large" and wl.title.endswith("N=8")
    runner = suite.Runner(suite.make_backend("numpy"), quick=True, repeats=1, log=lambda s: None)
    runner.run_workload(wl, np.float64)
    assert {r["op"] for r in runner.rows} == TIMED_OPS
    assert all(r["workload"] == "cnn-large" and r["check"]["ok"] for r in runner.rows)
