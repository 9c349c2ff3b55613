"""Your own model: reference K-FAC for a PyTorch nn.Module, and a per-layer diagnosis of a
hand-written torch K-FAC (correct ones agree; deliberately wrong ones are named)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conformance.own_model import check_torch_kfac, reference_torch_kfac  # noqa: E402


def _mlp(dtype=torch.float64, shared=False):
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(5, 4)
            self.fc2 = torch.nn.Linear(4, 3, bias=False)

        def forward(self, x):
            h = torch.tanh(self.fc1(x))
            return self.fc2(h.mean(dim=1) if shared else h)

    net = Net().to(dtype)
    x = torch.randn(*((7, 3, 5) if shared else (7, 5)), dtype=dtype)
    y = torch.randint(0, 3, (7,))
    return net, x, y


def _hand_written_kfac(net, x, y, mode, *, forget_n=False, bias_first=False):
    """A hand-written torch K-FAC (hooks), independent of kfac_ref: exact Fisher through the
    softmax's factor columns sqrt(p_k)(e_k - p), empirical through the label gradient."""
    acts, outs = {}, {}

    def keep(name):
        def hook(mod, inputs, output):
            acts[name], outs[name] = inputs[0], output
        return hook

    hooks = [m.register_forward_hook(keep(n))
             for n, m in net.named_modules() if isinstance(m, torch.nn.Linear)]
    logits = net(x)
    for h in hooks:
        h.remove()
    n = x.shape[0]
    p = torch.softmax(logits, dim=1).detach()
    if mode == "fisher_empirical":
        vecs = [p - torch.nn.functional.one_hot(y, 3).to(p.dtype)]
    else:
        eye = torch.eye(3, dtype=p.dtype)
        vecs = [p[:, k:k + 1].sqrt() * (eye[k] - p) for k in range(3)]
    factors = {}
    for name, mod in net.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        a = acts[name].detach().reshape(-1, mod.in_features)
        if mod.bias is not None:
            one = torch.ones(a.shape[0], 1, dtype=a.dtype)
            a = torch.cat([one, a] if bias_first else [a, one], dim=1)
        g_sum = 0
        for v in vecs:
            (g,) = torch.autograd.grad(logits, outs[name], grad_outputs=v, retain_graph=True)
            if forget_n:  # gradients of the mean loss used as per-example gradients
                g = g / n
            g = g.reshape(-1, mod.out_features)
            g_sum = g_sum + g.T @ g
        factors[name] = {"A": a.T @ a / a.shape[0], "G": g_sum / n}
    return factors


@pytest.mark.parametrize("mode", ["fisher_exact", "fisher_empirical"])
def test_correct_hand_written_kfac_agrees_per_layer(mode):
    net, x, y = _mlp()
    res = check_torch_kfac(net, "cross_entropy", x, y, _hand_written_kfac(net, x, y, mode),
                           mode=mode)
    assert res.ok, str(res)
    assert [(c.layer, c.factor) for c in res.checks] == [
        ("fc1", "A"), ("fc1", "G"), ("fc2", "A"), ("fc2", "G")]
    assert str(res).startswith(f"K-FAC factors against the reference (mode {mode}): all agree")


def test_reference_layout_is_the_models():
    net, x, y = _mlp()
    ref = reference_torch_kfac(net, "cross_entropy", x, y, mode="fisher_exact")
    assert ref["fc1"]["A"].shape == (6, 6) and ref["fc1"]["G"].shape == (4, 4)
    assert ref["fc2"]["A"].shape == (4, 4) and ref["fc2"]["G"].shape == (3, 3)
    assert ref["fc1"]["A"][-1, -1] == pytest.approx(1.0)  # homogeneous coordinate last


def test_wrong_hand_written_kfac_is_diagnosed_per_layer():
    net, x, y = _mlp()
    wrong = _hand_written_kfac(net, x, y, "fisher_exact", forget_n=True, bias_first=True)
    res = check_torch_kfac(net, "cross_entropy", x, y, wrong, mode="fisher_exact")
    assert not res.ok
    by = {(c.layer, c.factor): c for c in res.checks}
    assert by["fc1", "A"].diagnosis == "bias_position"
    assert by["fc2", "A"].ok  # no bias: nothing to misplace
    assert by["fc1", "G"].diagnosis == "scale:1/N^2"
    assert by["fc2", "G"].diagnosis == "scale:1/N^2"
    text = str(res)
    flat = " ".join(text.split())  # the printed lines are wrapped
    assert "fc1.G: FAIL" in flat and "diagnosis: scale:1/N^2: output = 1/N² = 1/49" in flat


def test_empirical_where_true_fisher_is_asked():
    net, x, y = _mlp()
    emp = _hand_written_kfac(net, x, y, "fisher_empirical")
    res = check_torch_kfac(net, "cross_entropy", x, y, emp, mode="fisher_exact")
    assert {c.diagnosis for c in res.checks if c.factor == "G"} == {"empirical_fisher"}
    assert all(c.ok for c in res.checks if c.factor == "A")


def test_weight_shared_linear_expand_and_reduce():
    net, x, y = _mlp(shared=True)
    # per-location rows, A over N·S, G = (1/N) Σ_{n,s} g gᵀ: KFAC-expand
    mine = _hand_written_kfac(net, x, y, "fisher_exact")
    del mine["fc2"]  # fc2 is not shared; check only the shared layer
    assert check_torch_kfac(net, "cross_entropy", x, y, mine, mode="fisher_exact",
                            layers=["fc1"]).ok
    res = check_torch_kfac(net, "cross_entropy", x, y, mine, mode="fisher_exact",
                           sharing="reduce", layers=["fc1"])
    assert {c.diagnosis for c in res.checks} == {"expand_instead_of_reduce"}
    assert reference_torch_kfac(net, "cross_entropy", x, y)["fc1"]["T"] == 3


def test_float32_factors_get_float32_tolerances():
    net, x, y = _mlp(dtype=torch.float32)
    mine = _hand_written_kfac(net, x, y, "fisher_exact")
    res = check_torch_kfac(net, "cross_entropy", x, y, mine)
    assert res.ok, str(res)
    assert all(c.rtol > 1e-6 for c in res.checks)


def test_mse_loss():
    torch.manual_seed(1)
    net = torch.nn.Linear(4, 2).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, 2, dtype=torch.float64)
    a = torch.cat([x, torch.ones(6, 1, dtype=x.dtype)], 1)
    ref = reference_torch_kfac(net, "mse", x, y, mode="fisher_exact")
    np.testing.assert_allclose(ref[""]["G"], np.eye(2), atol=1e-15)  # ½‖f−y‖²: H = I
    np.testing.assert_allclose(ref[""]["A"], (a.T @ a / 6).numpy(), rtol=1e-14)
    g = (net(x) - y).detach()
    res = check_torch_kfac(net, "mse", x, y, {"": {"G": 2 * g.T @ g / 6}},
                           mode="fisher_empirical")
    assert [c.diagnosis for c in res.checks] == ["scale:2"]


def test_errors_name_the_function_and_argument():
    net, x, y = _mlp()
    with pytest.raises(TypeError, match=r"check_torch_kfac: model must be a torch.nn.Module"):
        check_torch_kfac(object(), "cross_entropy", x, y, {"fc1": {}})
    with pytest.raises(ValueError, match=r"check_torch_kfac: loss must be one of"):
        check_torch_kfac(net, "hinge", x, y, {"fc1": {}})
    with pytest.raises(ValueError, match=r"check_torch_kfac: mode must be one of"):
        check_torch_kfac(net, "cross_entropy", x, y, {"fc1": {}}, mode="sampled")
    with pytest.raises(ValueError, match=r"check_torch_kfac: factors must name supported "
                                         r"layers of the model \(fc1, fc2\); got conv"):
        check_torch_kfac(net, "cross_entropy", x, y, {"conv": {}})
    with pytest.raises(ValueError, match=r"reference_torch_kfac: sharing must be one of"):
        reference_torch_kfac(net, "cross_entropy", x, y, sharing="pool")


def _page_examples():
    """{name: (code, shown output)} of docs/conformance/own_model.md: the ```python block
    after ``% example: NAME`` and the ```text block after ``% output: NAME``."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "conformance" / "own_model.md"
    if not page.exists():
        pytest.skip("docs sources not present")
    text = page.read_text(encoding="utf-8")
    code = dict(re.findall(r"^% example: (\w+)\n\n```python\n(.*?)```", text, re.S | re.M))
    shown = dict(re.findall(r"^% output: (\w+)\n\n```text\n(.*?)```", text, re.S | re.M))
    assert code and set(code) == set(shown), (sorted(code), sorted(shown))
    return {name: (code[name], shown[name]) for name in code}


def _run_example(tmp_path, code, name):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    (tmp_path / f"{name}.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=str(root))
    # warnings are errors: the page's examples run without a warning
    return subprocess.run([sys.executable, "-W", "error", str(tmp_path / f"{name}.py")],
                          capture_output=True, text=True, env=env, timeout=300)


def test_the_docs_page_prints_what_it_shows(tmp_path):
    """docs/conformance/own_model.md: each example runs, without a warning, and prints the
    output shown on the page."""
    for name, (code, shown) in _page_examples().items():
        p = _run_example(tmp_path, code, name)
        assert p.returncode == 0, (name, p.stderr)
        assert p.stderr == "", (name, p.stderr)
        assert p.stdout == shown, name


def test_the_docs_pages_fix_makes_every_line_ok(tmp_path):
    """The page's claim: with the three bugs fixed, every layer agrees."""
    code = _page_examples()["flawed"][0]
    fixes = [("torch.cat([torch.ones(len(a), 1), a], dim=1)",
              "torch.cat([a, torch.ones(len(a), 1)], dim=1)"),
             ('"G": g.T @ g / len(a)}', '"G": (g * len(x)).T @ (g * len(x)) / len(x)}')]
    for old, new in fixes:
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    p = _run_example(tmp_path, code, "fixed")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].endswith("all agree") and len(lines) == 7
    assert [line.split(": ")[1][:8] for line in lines[1:]] == ["block ok", "ok (rela",
                                                               "ok (rela"] * 2


def test_the_transformer_tutorial_names_its_bug_and_its_fix_passes(tmp_path):
    """The page's transformer: the planted bug fails exactly the sequence layers, fixed
    every layer passes."""
    code, shown = _page_examples()["transformer"]
    rows = {line.split()[0]: line for line in shown.splitlines()[1:]}
    assert {k for k, v in rows.items() if "FAIL" in v} == {"qkv", "out", "fc1", "fc2"}
    assert all("G: scale:1/T" in rows[k] for k in ("qkv", "out", "fc1", "fc2"))
    bug = '"G": g.T @ g / len(g)}'
    assert code.count(bug) == 1
    p = _run_example(tmp_path, code.replace(bug, '"G": g.T @ g / n}'), "fixed_transformer")
    assert p.returncode == 0, p.stderr
    table = p.stdout.splitlines()
    assert len(table) == 9 and not any("FAIL" in line for line in table), p.stdout


def test_scale_shift_F_with_the_empirical_fisher_is_named():
    """A layer norm's F from the empirical Fisher where the exact one is asked: named as for
    a G (the F alternatives come from the other estimate)."""
    from conformance.own_model.examples import tiny_transformer

    model = tiny_transformer()
    gen = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 11, (6, 5), generator=gen), torch.randint(0, 3, (6,))
    emp = reference_torch_kfac(model, "cross_entropy", tokens, labels,
                               mode="fisher_empirical")
    mine = {"ln1": {"F": emp["ln1"]["F"]}, "ln2": {"diag": emp["ln2"]["diag"]}}
    res = check_torch_kfac(model, "cross_entropy", tokens, labels, mine, layers=["ln1", "ln2"])
    assert [(c.layer, c.factor, c.diagnosis) for c in res.checks] == [
        ("ln1", "F", "empirical_fisher"), ("ln2", "diag", "empirical_fisher")], str(res)
    assert check_torch_kfac(model, "cross_entropy", tokens, labels, mine,
                            layers=["ln1", "ln2"], mode="fisher_empirical").ok
