"""Tests of the conformance suite's machinery: CLI, reports, golden files, comparison rules,
the adapter protocol, conventions and diagnosis."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from conformance.__main__ import main
from conformance.adapter import Adapter, AdapterUnavailable, implements, load_adapter
from conformance.adapters.kfac_ref_adapter import KfacRefAdapter
from conformance.catalogue import build_catalogue, capabilities
from conformance.compare import compare
from conformance.conventions import Conventions
from conformance.diagnosis import PITFALLS, diagnose
from conformance.golden import GOLDEN_DIR, GoldenError, check_golden, load_golden, write_golden
from conformance.mutants.linalg_mutants import KronSwapped
from conformance.mutants.model_mutants import unfold_patches
from conformance.runner import run_adapter


@pytest.fixture(scope="module")
def live():
    cases, absent = build_catalogue()
    return cases, capabilities()


def deterministic(cases, caps):
    """The cases of ``cases`` with one expected value: all but those of the samplers
    (``losses.sample``), which the statistical route meets with thousands of seeded calls each
    (about 95 % of the time of a catalogue run).  For the tests of the runner's bookkeeping
    (skips, xfails, errors), which is case by case and the same on every route; the samplers'
    cases themselves run in test_default_run_passes_and_writes_reports and
    tests/conformance/test_conformance_suite.py."""
    return [c for c in cases if caps[c.capability].statistic is None]


def _by_id(cases, cid):
    (c,) = [c for c in cases if c.id == cid]
    return c


# -- command line and reports ----------------------------------------------------------------
def test_default_run_passes_and_writes_reports(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "-q"]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "capability" in out
    d = tmp_path / "kfac_ref"
    rep = json.loads((d / "report.json").read_text())
    assert rep["ok"] and rep["counts"]["pass"] > 50 and rep["counts"]["fail"] == 0
    assert rep["adapter"]["name"] == "kfac_ref"
    suites = ET.parse(d / "junit.xml").getroot()
    assert sum(int(s.get("tests")) for s in suites) == len(rep["results"])
    assert "**PASSED**" in (d / "report.md").read_text()
    # the samplers' cases compared with the golden files (test_golden_source_runs leaves them
    # to this run)
    sampled = [r for r in rep["results"] if r["capability"] == "losses.sample"]
    assert sampled and all(r["source"] == "golden" and r["status"] == "pass" for r in sampled)


def test_failure_exits_nonzero_with_diagnosis(tmp_path, capsys):
    code = main(["--adapter", "mutant_kron_swapped", "--out", str(tmp_path), "-q",
                 "--family", "linalg"])
    assert code == 1
    out = capsys.readouterr().out
    assert "kron_order_swapped" in out and "FAILED" in out
    rep = json.loads((tmp_path / "mutant_kron_swapped" / "report.json").read_text())
    assert not rep["ok"]
    junit = (tmp_path / "mutant_kron_swapped" / "junit.xml").read_text()
    assert 'type="kron_order_swapped"' in junit


def test_unknown_adapter_is_a_usage_error(tmp_path, capsys):
    assert main(["--adapter", "no_such_module_xyz", "--out", str(tmp_path)]) == 2


def test_empty_selection_never_passes(tmp_path, capsys):
    assert main(["-k", "no-case-has-this-id", "--out", str(tmp_path), "-q"]) == 1
    assert "nothing was compared" in capsys.readouterr().out


def test_list_command(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "linalg.kron" in out and "mutant_kron_swapped" in out


def test_all_adapters_writes_matrix(tmp_path, capsys):
    code = main(["--all-adapters", "--out", str(tmp_path), "-q", "--family", "averaging"])
    matrix = json.loads((tmp_path / "matrix.json").read_text())
    assert "kfac_ref" in matrix["implementations"]
    assert matrix["cells"]["kfac_ref"]["averaging.ema"] == "pass"
    md = (tmp_path / "matrix.md").read_text()
    assert "| `averaging.ema` |" in md
    # peers that are not installed here are reported unavailable, never passed
    for name, info in matrix["implementations"].items():
        if info["unavailable"]:
            assert all(v.startswith("skip") for v in matrix["cells"][name].values())
    assert code in (0, 1)
    # merging saved reports gives the same matrix
    reports = sorted(str(p) for p in tmp_path.glob("*/report.json"))
    out2 = tmp_path / "merged"
    assert main(["matrix", *reports, "--out", str(out2)]) == 0
    assert json.loads((out2 / "matrix.json").read_text())["cells"] == matrix["cells"]


# -- adapter selection -------------------------------------------------------------------------
def test_env_var_selects_adapter(monkeypatch):
    monkeypatch.setenv("KFAC_CONFORMANCE_ADAPTER", "mutant_bias_first")
    assert load_adapter().name == "mutant_bias_first"
    monkeypatch.delenv("KFAC_CONFORMANCE_ADAPTER")
    assert load_adapter().name == "kfac_ref"


def test_adapter_from_a_file(tmp_path, live):
    path = tmp_path / "my_adapter.py"
    path.write_text(
        "import numpy as np\n"
        "from conformance.adapter import Adapter, implements\n"
        "class Mine(Adapter):\n"
        "    name = 'mine'\n"
        "    @implements('linalg.kron')\n"
        "    def kron(self, inputs, params):\n"
        "        return np.kron(inputs['a'], inputs['g'])\n"
        "ADAPTER = Mine()\n")
    ad = load_adapter(str(path))
    assert ad.name == "mine"
    cases, caps = live
    rep = run_adapter(ad, [c for c in cases if c.family == "linalg"], caps)
    kron = [r for r in rep.results if r.capability == "linalg.kron"]
    assert kron and all(r.status == "pass" for r in kron)
    others = [r for r in rep.results if r.capability != "linalg.kron"]
    assert all(r.status == "skip" and "does not implement" in r.message for r in others)
    assert rep.ok


def test_unsupported_and_unavailable(live):
    cases, caps = live

    class Partial(KfacRefAdapter):
        name = "partial"
        unsupported = {"linalg.kron": "no dense Kronecker product in this library"}

    rep = run_adapter(Partial(), deterministic(cases, caps), caps)
    skipped = [r for r in rep.results if r.capability == "linalg.kron"]
    assert skipped and all(r.status == "skip" and "no dense Kronecker" in r.message
                           for r in skipped)
    assert rep.ok

    class Nothing(Adapter):
        name = "nothing"

    assert not run_adapter(Nothing(), cases, caps).ok  # all skipped: nothing compared

    class Missing(Adapter):
        name = "missing"

        def setup(self):
            raise AdapterUnavailable("libfoo is not installed")

    rep = run_adapter(Missing(), cases, caps)
    assert not rep.ok and rep.unavailable == "libfoo is not installed"
    assert all(r.status == "skip" for r in rep.results)


def test_case_unsupported_is_a_skip(live):
    from conformance.adapter import CaseUnsupported

    cases, caps = live

    class NoMask(KfacRefAdapter):
        name = "no_mask"

        @implements("losses.fisher")
        def loss_fisher(self, inputs, params):
            if "mask" in inputs:
                raise CaseUnsupported("no masks in this library")
            return super().loss_fisher(inputs, params)

        skip_cases = {"losses.fisher/normal_mean_variance*": "no mean-variance loss"}

    rep = run_adapter(NoMask(), [c for c in cases if c.capability == "losses.fisher"], caps)
    mv = [r for r in rep.results if "normal_mean_variance" in r.case_id]
    assert mv and all(r.status == "skip" and "mean-variance" in r.message for r in mv)
    st = {r.case_id: r for r in rep.results}
    masked = [c.id for c in cases if c.capability == "losses.fisher" and "mask" in c.inputs]
    assert masked and all(st[m].status == "skip" and "no masks" in st[m].message
                          for m in masked)
    assert rep.ok


def test_unconvertible_declaration_is_a_skip(live):
    cases, caps = live

    class SumLoss(KfacRefAdapter):
        name = "sum_loss"
        conventions = Conventions(curvature_of="sum")

    sel = [c for c in cases if c.capability == "networks.kfac_inverse_matvec"]
    if not sel:
        pytest.skip("kfac_ref.curvature is not importable")
    rep = run_adapter(SumLoss(), sel, caps)
    assert all(r.status == "skip" and "cannot convert" in r.message for r in rep.results)


def test_adapter_exception_is_an_error(live):
    cases, caps = live

    class Broken(KfacRefAdapter):
        name = "broken"

        @implements("linalg.kron")
        def kron(self, inputs, params):
            raise RuntimeError("boom")

    rep = run_adapter(Broken(), deterministic(cases, caps), caps)
    errs = [r for r in rep.results if r.status == "error"]
    assert errs and all("boom" in r.message for r in errs) and not rep.ok


def test_skips_and_xfails_files(tmp_path, live):
    cases, caps = live
    skips = tmp_path / "skips.txt"
    skips.write_text("# comment\nlinalg.kron/*  # not provided\n")
    xfails = tmp_path / "xfails.txt"
    xfails.write_text("linalg.kron_matvec  # known bug, upstream issue 1\n")
    from conformance.runner import read_pattern_file

    ad = load_adapter("mutant_kron_swapped")
    rep = run_adapter(ad, deterministic(cases, caps), caps, skips=read_pattern_file(skips),
                      xfails=read_pattern_file(xfails))
    st = {r.case_id: r for r in rep.results}
    assert all(st[c.id].status == "skip" and "not provided" in st[c.id].message
               for c in cases if c.capability == "linalg.kron")
    xf = [r for r in rep.results if r.capability == "linalg.kron_matvec"]
    assert xf and all(r.status == "xfail" and "kron_order_swapped" in r.message for r in xf)
    assert rep.ok  # the only failures are expected ones


# -- comparison rules ---------------------------------------------------------------------------
def test_compare_rules():
    e = np.array([[1.0, 2.0], [3.0, 4.0]])
    assert compare(e, e, 1e-14).ok
    assert compare(e * (1 + 1e-13), e, 1e-12).ok
    assert not compare(e * (1 + 1e-10), e, 1e-12).ok
    assert compare(np.full((2, 2), np.nan), e, 1e300).reason == "non-finite"
    assert compare(np.array([[np.inf, 0], [0, 0]]), e, 1e300).reason == "non-finite"
    assert compare(np.zeros((0,)), np.zeros((0,)), 1.0).reason == "empty"
    assert compare(np.zeros((2,)), e, 1.0).reason == "shape"
    assert compare("text", e, 1.0).reason == "not-an-array"
    assert compare(None, e, 1.0).reason == "not-an-array"


# -- golden files -----------------------------------------------------------------------------
def test_golden_files_are_intact_and_up_to_date(live):
    cases, _ = live
    problems = check_golden(cases)
    assert not problems, "\n".join(problems[:20])
    total = sum(p.stat().st_size for p in GOLDEN_DIR.iterdir())
    assert total < 2 * 1024 * 1024


def test_golden_write_is_deterministic_and_checked(tmp_path, live):
    cases, caps = live
    sub = [c for c in cases if c.family in ("linalg", "factors")]
    m1 = write_golden(sub, caps, tmp_path / "a")
    m2 = write_golden(sub, caps, tmp_path / "b")
    assert m1["files"] == m2["files"]
    loaded = load_golden(tmp_path / "a")
    assert [c.id for c in loaded] == [c.id for c in sub]
    for g, c in zip(loaded, sub, strict=True):
        assert g.source == "golden" and np.array_equal(g.expected, c.expected)
        assert all(np.array_equal(g.inputs[k], c.inputs[k]) for k in c.inputs)
        assert g.inputs.keys() == c.inputs.keys()
    ids = [c for c in loaded if c.capability == "factors.embedding_input"]
    assert ids and ids[0].inputs["ids"].dtype == np.int64

    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "a", bad)
    f = bad / "linalg.npz"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(GoldenError, match="corrupt"):
        load_golden(bad)
    f.unlink()
    with pytest.raises(GoldenError, match="missing"):
        load_golden(bad)
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    man["schema_version"] = 999
    (bad / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(GoldenError, match="version"):
        load_golden(bad)


def test_golden_source_runs(tmp_path, live):
    """Every golden case passes with the expected values from the files only; the samplers'
    golden cases (the statistical route: most of the run's time) pass in the default run,
    which takes them from the golden files too (test_default_run_passes_and_writes_reports)."""
    _, caps = live
    only = [a for name, cap in caps.items() if cap.statistic is None for a in ("-c", name)]
    assert main(["--source", "golden", "--out", str(tmp_path), "-q", *only]) == 0
    rep = json.loads((tmp_path / "kfac_ref" / "report.json").read_text())
    assert rep["source"] == "golden" and {r["source"] for r in rep["results"]} == {"golden"}
    want = {c.id for c in load_golden() if caps[c.capability].statistic is None}
    assert {r["case_id"] for r in rep["results"]} == want


# -- conventions: an adapter in PyTorch conventions passes, and says so ------------------------
class TorchStyle(Adapter):
    """A NumPy implementation apart from kfac_ref's adapter, in other declared conventions."""

    name = "torch_style"
    conventions = Conventions(kron_order="GA", bias_position="first", curvature_of="sum",
                              ema_style="raw", conv_style="expand", patch_order="chw",
                              mse_variance=0.5)

    # kron(G, A): the kron-swapped mutant's code, right under kron_order="GA"
    kron, kron_matvec = KronSwapped.kron, KronSwapped.kron_matvec

    @implements("linalg.homog_cov", "factors.dense_input")
    def homog(self, inputs, params):
        a = inputs.get("a")
        a = a.reshape(-1, a.shape[-1])
        if params.get("has_bias", True):
            a = np.concatenate([np.ones((a.shape[0], 1)), a], axis=1)
        return a.T @ a / a.shape[0]

    @implements("factors.dense_output")
    def dense_output(self, inputs, params):
        g = inputs["g"]
        uses = g.shape[0] if g.ndim == 3 else 1
        g = g.reshape(-1, g.shape[-1])
        return g.T @ g / uses  # curvature of the SUM loss: no 1/N

    @implements("factors.dense_diagonal")
    def dense_diagonal(self, inputs, params):
        a, g = inputs["a"], inputs["g"]
        if params["has_bias"]:
            a = np.concatenate([np.ones((a.shape[0], 1)), a], axis=1)
        return ((a * a).T @ (g * g)).T  # [out, in]: PyTorch weight layout

    @implements("factors.conv_input")
    def conv_input(self, inputs, params):
        p = unfold_patches(inputs, params)
        if params["has_bias"]:
            p = np.concatenate([np.ones((p.shape[0], 1)), p], axis=1)
        return p.T @ p / p.shape[0]  # expand: averaged over N·|T|

    @implements("factors.conv_output")
    def conv_output(self, inputs, params):
        g = inputs["g"]
        if params["data_format"] == "NCHW":
            g = np.moveaxis(g, 1, -1)
        g2 = g.reshape(-1, g.shape[-1])
        return g2.T @ g2  # expand + sum loss: Σ_{n,t} g gᵀ

    @implements("averaging.ema")
    def ema(self, inputs, params):
        s, out = 0.0, []
        for x in inputs["xs"]:
            s = params["decay"] * s + params["weight"] * x
            out.append(s)
        return np.stack(out)

    @implements("blocks.kron_matpower")
    def kron_matpower(self, inputs, params):
        # X arrives as [q, p] (PyTorch weight layout) with the bias column FIRST; the block is
        # s·kron(G, A) on the row-major vec of that matrix.  Dense NumPy oracle.
        a, g, xt = inputs["a"], inputs["g"], inputs["x"]
        p_, s, lam = params["power"], params["scale"], params["damping"]

        def mpow(m, e):
            w, v = np.linalg.eigh((m + m.T) / 2)
            return (v * np.maximum(w, 0) ** e) @ v.T

        if params["exact"]:
            m = s * np.kron(g, a) + lam * np.eye(a.shape[0] * g.shape[0])
            return (mpow(m, p_) @ xt.reshape(-1)).reshape(xt.shape)
        pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
        r = np.sqrt(lam / s)
        da, dg = pi * r, r / pi
        return s ** p_ * mpow(g + dg * np.eye(g.shape[0]), p_) @ xt @ mpow(
            a + da * np.eye(a.shape[0]), p_)

    @implements("losses.fisher")
    def loss_fisher(self, inputs, params):
        if params["loss"] != "normal_mean":
            return KfacRefAdapter().loss_fisher(inputs, params)
        n, d = inputs["mean"].shape
        return np.broadcast_to(np.eye(d) * params["weight"] / 0.5, (n, d, d))


def test_declared_conventions_pass_and_are_reported(live):
    cases, caps = live
    ad = TorchStyle()
    names = set(ad.implementations())
    rep = run_adapter(ad, [c for c in cases if c.capability in names], caps)
    bad = [f"{r.case_id}: {r.message}" for r in rep.results if r.status not in
           ("pass", "convention")]
    assert not bad, "\n".join(bad)
    conv = {r.capability for r in rep.results if r.status == "convention"}
    assert {"linalg.kron", "linalg.kron_matvec", "factors.dense_input", "blocks.kron_matpower",
            "factors.dense_output", "factors.conv_input", "factors.conv_output",
            "averaging.ema", "losses.fisher"} <= conv
    r = next(r for r in rep.results if r.capability == "factors.conv_output")
    assert r.conventions == {"conv_style": "expand", "curvature_of": "sum"}
    assert "conv_style='expand'" in r.message


def test_exactness_cases_hold_in_the_reference(live):
    """K-FAC equals the block diagonal of the exact curvature in the exactness settings
    (N = 1; deep linear + squared error; weight sharing with the matching expand/reduce),
    and not in the others (Martens & Grosse 2015; Eschenhagen et al. 2023; the docs page
    *K-FAC for dense layers*, "When it is exact")."""
    cases, _ = live
    kfac = [c for c in cases if c.capability == "networks.kfac"]
    if not kfac:
        pytest.skip("kfac_ref.curvature is not importable")
    exact = [c for c in kfac if c.meta.get("exact")]
    assert len(exact) >= 5
    for c in kfac:
        same = "exact_block_diagonal" in c.meta.get("insensitive_to", ())
        assert same == bool(c.meta.get("exact")), c.id


def _torch_param_index(spec):
    """PyTorch parameter order [W.flatten() of the [out, in] weight, b] per dense layer,
    as indices into the canonical order, written out with explicit loops."""
    idx, off = [], 0
    for s in spec:
        if s["kind"] != "dense":
            continue
        d_in, d_out = s["d_in"], s["d_out"]
        idx += [off + i * d_out + o for o in range(d_out) for i in range(d_in)]
        if s["bias"]:
            idx += [off + d_in * d_out + o for o in range(d_out)]
        off += (d_in + s["bias"]) * d_out
    return np.array(idx)


def test_network_matrices_in_pytorch_order(live):
    cases, caps = live
    ggn = [c for c in cases if c.capability == "networks.ggn" and
           all(s["kind"] != "conv2d" for s in c.params["net"])]
    if not ggn:
        pytest.skip("kfac_ref.curvature is not importable")
    conv = Conventions(kron_order="GA", bias_position="separate", curvature_of="sum")
    for c in ggn:
        idx = _torch_param_index(c.params["net"])
        want = c.expected[np.ix_(idx, idx)] * c.meta["N"]
        got = caps["networks.ggn"].expected_for(c, conv)
        assert np.array_equal(got, want), c.id


def test_conversions_against_independent_oracles(live):
    cases, caps = live
    c = _by_id(cases, "linalg.kron/p3_q2")
    a, g = c.inputs["a"], c.inputs["g"]
    assert np.allclose(c.expected, np.kron(a, g), rtol=1e-14, atol=0)
    ga = Conventions(kron_order="GA")
    assert np.allclose(caps["linalg.kron"].expected_for(c, ga), np.kron(g, a), rtol=1e-14,
                       atol=0)
    c = _by_id(cases, "averaging.ema/k4_decay0.9_weight1")
    s, raw = 0.0, []
    for x in c.inputs["xs"]:
        s = 0.9 * s + x
        raw.append(s)
    got = caps["averaging.ema"].expected_for(c, Conventions(ema_style="raw"))
    assert np.allclose(got, np.stack(raw), rtol=1e-13, atol=0)


# -- diagnosis -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cid,factor,pitfall", [
    ("factors.dense_output/3x4", 3.0, "sum_vs_mean"),
    ("factors.dense_output/3x4", 1 / 9, "scale:1/N^2"),
    ("factors.dense_output/3x4", 2.0, "scale:2"),
    ("factors.conv_output/same_s2", 12.0, "conv_style"),
    ("factors.conv_input/same_s2_bias1", 1 / 12, "scale:1/T"),
    ("linalg.kron/p3_q2", -1.0, "negated"),
    ("linalg.kron/p3_q2", 1.2345, "scale"),
])
def test_scalar_diagnoses(live, cid, factor, pitfall):
    cases, caps = live
    c = _by_id(cases, cid)
    cap = caps[c.capability]
    d = diagnose(c.expected * factor, c, cap, Conventions(), c.tolerance.rtol())
    assert d.pitfall == pitfall, d
    assert pitfall.split("+")[0] in PITFALLS


def test_two_undeclared_conventions_are_diagnosed_together(live):
    cases, caps = live
    c = _by_id(cases, "factors.dense_diagonal/n3_in4_out2_bias1")
    cap = caps[c.capability]
    actual = cap.expected_for(c, Conventions(kron_order="GA", curvature_of="sum"))
    d = diagnose(actual, c, cap, Conventions(), c.tolerance.rtol())
    assert d.pitfall == "kron_order_swapped+sum_vs_mean", d


def test_unexplained_and_shape_diagnoses(live):
    cases, caps = live
    c = _by_id(cases, "linalg.cross_cov/n6_d4")
    cap = caps[c.capability]
    rtol = c.tolerance.rtol()
    noise = np.random.default_rng(0).standard_normal(c.expected.shape)
    assert diagnose(c.expected + noise, c, cap, Conventions(), rtol).pitfall == "unexplained"
    assert diagnose(c.expected.T, c, cap, Conventions(), rtol).pitfall == "transposed"
    v = _by_id(cases, "linalg.kron_matvec/p4_q3")
    flat_f = v.expected.reshape(4, 3).reshape(-1, order="F").reshape(3, 4)
    d = diagnose(flat_f, v, caps[v.capability], Conventions(), v.tolerance.rtol())
    assert d.pitfall in ("shape", "vec_order", "kron_order_swapped")


def test_absent_family_is_reported(monkeypatch):
    import conformance.catalogue as cat

    monkeypatch.setitem(cat.FAMILY_MODULES, "bogus", ".does_not_exist")
    cases, absent = cat.build_catalogue()
    assert "bogus" in absent and cases


@pytest.mark.parametrize("name", ["kfac_ref_strict", "kfac_ref_float32"])
def test_reference_passes_on_other_backends_and_float32(live, name):
    """kfac_ref through array-api-strict (standard-only code path) and in float32 (the
    derived budgets, scaled by eps(float32), must hold)."""
    cases, caps = live
    try:
        ad = load_adapter(name)
        ad.setup()
    except AdapterUnavailable as exc:
        pytest.skip(str(exc))
    rep = run_adapter(ad, cases, caps)
    bad = [f"{r.case_id}: {r.message}" for r in rep.results if r.status != "pass"]
    assert not bad, "\n".join(bad[:10])


def test_readme_tables_are_current():
    """conformance/README.md's generated tables match the code (refresh with
    ``python -m conformance docs``)."""
    from pathlib import Path

    from conformance.__main__ import readme_tables

    text = (Path(__file__).parents[2] / "conformance" / "README.md").read_text()
    for name, body in readme_tables().items():
        assert f"<!-- BEGIN {name} -->\n{body}\n<!-- END {name} -->" in text, (
            f"README section {name!r} is stale: run python -m conformance docs")


def test_network_factors_in_curvlinops_like_conventions(live):
    """Per-layer factors under bias 'separate', patch order 'chw', conv style 'expand' and
    the sum loss, against conversions written out by hand."""
    cases, caps = live
    conv = Conventions(bias_position="separate", patch_order="chw", conv_style="expand",
                       curvature_of="sum")
    a_cases = [c for c in cases if c.capability == "networks.kfac_input_factors"]
    if not a_cases:
        pytest.skip("kfac_ref.curvature is not importable")
    for c in a_cases:
        blocks, off = [], 0
        for s in c.params["net"]:
            if s["kind"] not in ("dense", "conv2d"):
                continue
            if s["kind"] == "dense":
                p = s["d_in"] + s["bias"]
                order = list(range(s["d_in"]))
            else:
                kh, kw = s["kernel"]
                ci = s["c_in"]
                p = kh * kw * ci + s["bias"]
                order = [(i * kw + j) * ci + ch for ch in range(ci) for i in range(kh)
                         for j in range(kw)]
            blk = c.expected[off:off + p, off:off + p]
            blocks.append(blk[np.ix_(order, order)])
            off += p
        n = sum(b.shape[0] for b in blocks)
        want, o = np.zeros((n, n)), 0
        for b in blocks:
            want[o:o + b.shape[0], o:o + b.shape[0]] = b
            o += b.shape[0]
        assert np.array_equal(caps[c.capability].expected_for(c, conv), want), c.id
    for c in (c for c in cases if c.capability == "networks.kfac_output_factors"):
        scale, off = np.ones(c.expected.shape[0]), 0
        for s, t in zip((s for s in c.params["net"] if s["kind"] in ("dense", "conv2d")),
                        c.meta["layer_T"], strict=True):
            q = s["d_out"] if s["kind"] == "dense" else s["c_out"]
            scale[off:off + q] = np.sqrt(t)
            off += q
        want = c.expected * np.outer(scale, scale) * c.meta["N"]
        got = caps[c.capability].expected_for(c, conv)
        assert np.allclose(got, want, rtol=1e-15, atol=0), c.id
    cnn = [c for c in cases if c.id == "networks.kfac_output_factors/cnn_pool_n3_mse_ggn_exact"]
    assert cnn and cnn[0].meta["layer_T"] == [12, 1]


# -- conversions of the networks capabilities, against kfac_ref recomputed -------------------
def _recompute_network(case, params):
    """kfac_ref's value of a networks/estimator case recomputed with other params."""
    from conformance.catalogue import networks_cases as nc
    from conformance.catalogue.estimator_cases import kfac_two_batches

    cap, inputs = case.capability, case.inputs
    if cap == "networks.ggn":
        return nc.exact_matrix(params, inputs, "ggn")
    if cap == "networks.empirical_fisher":
        return nc.exact_matrix(params, inputs, "ef")
    if cap == "networks.kfac":
        return nc.kfac_matrix(params, inputs)
    if cap == "networks.kfac_input_factors":
        return nc.kfac_factors(params, inputs, "input")
    if cap == "networks.kfac_output_factors":
        return nc.kfac_factors(params, inputs, "output")
    assert cap == "estimator.kfac_ema", cap
    return kfac_two_batches(params, inputs)


def test_mse_variance_conversion_equals_the_reference_at_that_variance(live):
    """Declaring a fixed squared-error variance v must turn the reference into what kfac_ref
    computes with variance v: a factor v_case/v for curvatures, (v_case/v)² for every
    empirical-Fisher quantity (PROTOCOL_REQUESTS.md §1: a linear conversion of the latter
    failed curvlinops and ASDL where they were right)."""
    cases, caps = live
    sel = [c for c in cases if c.params.get("loss") == "normal_mean" and c.capability in (
        "networks.ggn", "networks.empirical_fisher", "networks.kfac",
        "networks.kfac_input_factors", "networks.kfac_output_factors", "estimator.kfac_ema")]
    if not sel:
        pytest.skip("kfac_ref.curvature is not importable")
    empirical = 0
    for c in sel:
        v = 0.3  # coincides with no case variance, nor with a factor 2 of one
        want = _recompute_network(c, dict(c.params, variance=v))
        got = caps[c.capability].expected_for(c, Conventions(mse_variance=v))
        # both sides are float64 kfac_ref outputs of the same GEMMs; the bound is the
        # case's own float64 tolerance
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel <= c.tolerance.rtol(), (c.id, rel)
        empirical += (c.capability == "networks.empirical_fisher"
                      or c.params.get("mode") == "fisher_empirical")
    assert empirical >= 5


def test_conv_styles_of_a_network_are_reference_alternatives(live):
    """Under conv_style reduce / hybrid the networks capabilities of a conv net compare with
    kfac_ref's KFAC-reduce and BackPACK's hybrid (A = |T|·A_KFC, G = G_reduce; conv bias
    block G_reduce), written here from the estimator's per-layer factors."""
    from conformance.catalogue import networks_cases as nc

    cases, caps = live
    sel = [c for c in cases if c.id.startswith("networks.kfac/cnn_")]
    if not sel:
        pytest.skip("kfac_ref.curvature is not importable")
    for c in sel:
        t = c.meta["T"]
        expand = nc.layer_factors(c.params, c.inputs, sharing="expand")
        reduce = nc.layer_factors(c.params, c.inputs, sharing="reduce")
        blocks_r, blocks_h = [], []
        for s, (a_e, g_e), (a_r, g_r) in zip(
                [s for s in c.params["net"] if s["kind"] in ("dense", "conv2d")], expand,
                reduce, strict=True):
            if s["kind"] == "conv2d":
                a_h = t * a_e
                a_h[-1, :] = a_h[:, -1] = 0.0
                a_h[-1, -1] = 1.0
                blocks_r.append(np.kron(a_r, g_r))
                blocks_h.append(np.kron(a_h, g_r))
            else:
                blocks_r.append(np.kron(a_e, g_e))
                blocks_h.append(np.kron(a_e, g_e))
        cap = caps["networks.kfac"]
        for style, blocks in (("reduce", blocks_r), ("hybrid", blocks_h)):
            want, o = np.zeros_like(c.expected), 0
            for b in blocks:
                want[o:o + b.shape[0], o:o + b.shape[0]] = b
                o += b.shape[0]
            got = cap.expected_for(c, Conventions(conv_style=style))
            assert np.allclose(got, want, rtol=1e-13, atol=1e-15), (c.id, style)
            assert not np.allclose(got, c.expected, rtol=1e-3), (c.id, style)
            # the hybrid is |T| times expand on the weight block: the suite diagnoses a KFC
            # answer under a declared hybrid as the conv_style convention
            d = diagnose(c.expected, c, cap, Conventions(conv_style=style), 1e-12)
            assert d.pitfall == "conv_style", d


def test_empirical_fisher_per_loss_term(live):
    """empirical_fisher_unit='loss_term': (1/N)Σ_{n,s}∇ℓ_{ns}∇ℓ_{ns}ᵀ, here from an explicit
    sum of per-term outer products of the single dense layer's gradient."""
    cases, caps = live
    sel = [c for c in cases if c.id == "networks.empirical_fisher/shared_linear_expand_n3_mse"]
    if not sel:
        pytest.skip("kfac_ref.curvature is not importable")
    (c,) = sel
    x, y, w, b = c.inputs["x"], c.inputs["targets"], c.inputs["w0"], c.inputs["b0"]
    v = c.params["variance"]
    n, s_, _ = x.shape
    ef = 0.0
    for i in range(n):
        for j in range(s_):
            r = (x[i, j] @ w + b - y[i, j]) / v  # ∂ℓ_ij/∂f of (1/2v)‖f − y‖²
            grad = np.outer(np.append(x[i, j], 1.0), r).ravel()  # [W; b] row-major
            ef = ef + np.outer(grad, grad)
    ef = ef / n
    got = caps[c.capability].expected_for(c, Conventions(empirical_fisher_unit="loss_term"))
    assert np.allclose(got, ef, rtol=1e-12, atol=0)
    assert not np.allclose(c.expected, ef, rtol=1e-2)
    d = diagnose(ef, c, caps[c.capability], Conventions(), c.tolerance.rtol())
    assert d.pitfall == "empirical_fisher_unit", d


def test_matrix_markdown_escapes_pipes_and_shortens_reasons(tmp_path):
    from conformance.reports import write_matrix

    reason = "unsupported: no |T| scaling " + "word " * 40
    rep = {"adapter": {"name": "x", "version": "1", "non_canonical_conventions": {}},
           "started": "2026-01-01T00:00:00+00:00", "ok": False, "unavailable": "",
           "counts": {"skip": 1}, "capabilities": {"linalg.kron": {"skip": 1}},
           "results": [{"capability": "linalg.kron", "status": "skip", "message": reason}]}
    write_matrix([rep], tmp_path)
    row = [r for r in (tmp_path / "matrix.md").read_text().splitlines()
           if r.startswith("| `linalg.kron`")][0]
    assert "\\|T\\|" in row and row.count(" | ") == 1 and row.endswith("…) |")
