"""Your own model with nn.Conv2d: the reference factors against a brute-force oracle built
here with torch autograd (patches as the Jacobian of the convolution's output with respect to
its kernel, so no padding arithmetic is shared with the code under test), and the per-layer
diagnosis of deliberately wrong hand-written conv K-FACs."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conformance.own_model import (  # noqa: E402
    check_torch_kfac,
    reference_torch_kfac,
    sample_targets,
    torch_conv_padding,
)

N, C_IN, H, W, C_OUT, CLASSES = 3, 2, 6, 5, 3, 3


def check_conv(*args, **kw):
    """The check of the conv layer alone (the classifier layer is not the subject here)."""
    return check_torch_kfac(*args, layers=["conv"], **kw)

CONFIGS = {
    "pad1": dict(kernel_size=3, padding=1),
    "pad_tuple_stride": dict(kernel_size=(3, 2), padding=(1, 2), stride=(2, 1)),
    "valid_dilated": dict(kernel_size=2, padding="valid", dilation=(2, 1)),
    "same_uneven": dict(kernel_size=(4, 2), padding="same"),  # totals 3 and 1: one more after
    "same_dilated": dict(kernel_size=3, padding="same", dilation=2),
    "no_bias_stride": dict(kernel_size=3, padding=0, stride=2, bias=False),
}


class ConvNet(torch.nn.Module):
    def __init__(self, **conv):
        super().__init__()
        self.conv = torch.nn.Conv2d(C_IN, C_OUT, **conv)
        with torch.no_grad():
            d = self.conv(torch.zeros(1, C_IN, H, W)).numel()
        self.fc = torch.nn.Linear(d, CLASSES)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


def _net(name, dtype=torch.float64):
    torch.manual_seed(0)
    net = ConvNet(**CONFIGS[name]).to(dtype)
    x = torch.randn(N, C_IN, H, W, dtype=dtype)
    y = torch.randint(0, CLASSES, (N,))
    return net, x, y


def _oracle_patches(conv, x):
    """[N, T, C·kh·kw] patches: p_{n,t} = ∂ out[n, 0, t] / ∂ weight[0] (out = W p + b)."""
    w = conv.weight.detach().clone()

    def f(weight):
        return torch.nn.functional.conv2d(x, weight, None, conv.stride, conv.padding,
                                          conv.dilation)

    jac = torch.autograd.functional.jacobian(f, w)  # [N, O, H', W', O, C, kh, kw]
    n, _, ho, wo = jac.shape[:4]
    return jac[:, 0, :, :, 0].reshape(n, ho * wo, -1).detach()


def _hand_written(net, x, y, mode, *, hwc=False, bias_first=False, mean_loss=False,
                  tf_norm=False, draws=None):
    """A hand-written conv K-FAC with optional classic bugs, independent of kfac_ref:
    patches from the kernel Jacobian, the softmax's Fisher factor columns by hand."""
    conv = net.conv
    keep = {}
    h = conv.register_forward_hook(lambda m, i, o: keep.__setitem__("out", o))
    logits = net(x)
    h.remove()
    n = x.shape[0]
    p = _oracle_patches(conv, x)  # [N, T, C kh kw], unfold order
    t = p.shape[1]
    if hwc:  # (C, kh, kw) -> (kh, kw, C)
        kh, kw = conv.kernel_size
        p = p.reshape(n, t, C_IN, kh, kw).permute(0, 1, 3, 4, 2).reshape(n, t, -1)
    p = p.reshape(n * t, -1)
    if conv.bias is not None:
        one = torch.ones(n * t, 1, dtype=p.dtype)
        p = torch.cat([one, p] if bias_first else [p, one], dim=1)
    a = p.T @ p / (n * t)
    prob = torch.softmax(logits, dim=1).detach()
    onehot = torch.nn.functional.one_hot
    if mode == "fisher_empirical":
        vecs = [prob - onehot(y, CLASSES).to(prob.dtype)]
    elif mode == "fisher_sampled":
        m = draws.shape[0]
        vecs = [(prob - onehot(torch.as_tensor(d), CLASSES).to(prob.dtype)) / m ** 0.5
                for d in draws]
    else:
        eye = torch.eye(CLASSES, dtype=prob.dtype)
        vecs = [prob[:, k:k + 1].sqrt() * (eye[k] - prob) for k in range(CLASSES)]
    g_sum = 0
    for v in vecs:
        (g,) = torch.autograd.grad(logits, keep["out"], grad_outputs=v, retain_graph=True)
        if mean_loss:
            g = g / n
        g = g.permute(0, 2, 3, 1).reshape(-1, C_OUT)
        g_sum = g_sum + g.T @ g
    g_fac = g_sum / (n * t) if tf_norm else g_sum / n
    return {"conv": {"A": a, "G": g_fac}}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode", ["fisher_exact", "fisher_empirical"])
def test_conv_reference_matches_the_autograd_oracle(name, mode):
    net, x, y = _net(name)
    ref = reference_torch_kfac(net, "cross_entropy", x, y, mode=mode)
    mine = _hand_written(net, x, y, mode)["conv"]
    np.testing.assert_allclose(ref["conv"]["A"], mine["A"].numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ref["conv"]["G"], mine["G"].numpy(), rtol=1e-11, atol=1e-15)
    with torch.no_grad():
        t = net.conv(x).shape[2] * net.conv(x).shape[3]
    assert ref["conv"]["T"] == t and ref["conv"]["kind"] == "conv2d"
    res = check_conv(net, "cross_entropy", x, y, _hand_written(net, x, y, mode),
                           mode=mode)
    assert res.ok, str(res)


def test_same_padding_split_is_pytorchs():
    conv = torch.nn.Conv2d(1, 1, (4, 3), padding="same", dilation=(1, 3))
    assert torch_conv_padding(conv) == ((1, 2), (3, 3))
    assert torch_conv_padding(torch.nn.Conv2d(1, 1, 3, padding="valid")) == ((0, 0), (0, 0))
    assert torch_conv_padding(torch.nn.Conv2d(1, 1, 3, padding=(2, 1))) == ((2, 2), (1, 1))


def test_reduce_matches_the_oracle():
    net, x, y = _net("pad1")
    ref = reference_torch_kfac(net, "cross_entropy", x, y, sharing="reduce")["conv"]
    p = _oracle_patches(net.conv, x).mean(dim=1)
    p = torch.cat([p, torch.ones(N, 1, dtype=p.dtype)], 1)
    np.testing.assert_allclose(ref["A"], (p.T @ p / N).numpy(), rtol=1e-12)
    keep = {}
    h = net.conv.register_forward_hook(lambda m, i, o: keep.__setitem__("out", o))
    logits = net(x)
    h.remove()
    prob = torch.softmax(logits, 1).detach()
    eye = torch.eye(CLASSES, dtype=prob.dtype)
    g_sum = 0
    for k in range(CLASSES):
        (g,) = torch.autograd.grad(logits, keep["out"], retain_graph=True,
                                   grad_outputs=prob[:, k:k + 1].sqrt() * (eye[k] - prob))
        g = g.sum(dim=(2, 3))
        g_sum = g_sum + g.T @ g
    np.testing.assert_allclose(ref["G"], (g_sum / N).numpy(), rtol=1e-11)


@pytest.mark.parametrize(("geometry", "faults", "named", "explained"), [
    ("pad_tuple_stride", {"hwc": True, "mean_loss": True},
     {"A": "patch_order", "G": "scale:1/N^2"}, {"A": "unfold", "G": "mean-reduced loss"}),
    ("same_uneven", {"tf_norm": True, "bias_first": True},
     {"A": "bias_position", "G": "scale:1/T"}, {"G": "ConvKFCBasicFB"}),
], ids=["patch_order_and_mean_loss", "missing_T_and_bias_first"])
def test_a_fault_in_each_factor_is_named(geometry, faults, named, explained):
    net, x, y = _net(geometry)
    wrong = _hand_written(net, x, y, "fisher_exact", **faults)
    res = check_conv(net, "cross_entropy", x, y, wrong)
    by = {c.factor: c for c in res.checks if c.layer == "conv"}
    assert {f: by[f].diagnosis for f in named} == named, str(res)
    for factor, words in explained.items():
        assert words in by[factor].explanation


def test_patch_order_and_bias_first_together():
    net, x, y = _net("pad1")
    wrong = _hand_written(net, x, y, "fisher_exact", hwc=True, bias_first=True)
    res = check_conv(net, "cross_entropy", x, y, wrong)
    assert [c.diagnosis for c in res.checks] == ["patch_order+bias_position", ""], str(res)


def test_empirical_where_true_is_asked_conv():
    net, x, y = _net("valid_dilated")
    emp = _hand_written(net, x, y, "fisher_empirical")
    res = check_conv(net, "cross_entropy", x, y, emp, mode="fisher_exact")
    assert [c.diagnosis for c in res.checks] == ["", "empirical_fisher"], str(res)


def test_sampled_mode_with_the_same_draws():
    net, x, y = _net("pad1")
    with torch.no_grad():
        draws = sample_targets("cross_entropy", net(x).numpy(), 7, mc_samples=4)
    assert draws.shape == (4, N) and draws.dtype.kind == "i"
    mine = _hand_written(net, x, y, "fisher_sampled", draws=draws)
    assert check_conv(net, "cross_entropy", x, y, mine, mode="fisher_sampled",
                            samples=draws).ok
    # the same seed gives the same draws
    res = check_conv(net, "cross_entropy", x, y, mine, mode="fisher_sampled", rng=7,
                           mc_samples=4)
    assert res.ok, str(res)
    # other draws disagree; the exact Fisher where sampled is asked is named
    other = check_conv(net, "cross_entropy", x, y, mine, mode="fisher_sampled",
                             rng=np.random.default_rng(8), mc_samples=4)
    assert not other.ok
    exact = _hand_written(net, x, y, "fisher_exact")
    res = check_conv(net, "cross_entropy", x, y, exact, mode="fisher_sampled",
                           samples=draws)
    assert [c.diagnosis for c in res.checks] == ["", "true_fisher"], str(res)


def test_sampled_fisher_converges_to_the_exact_one():
    """Independent check of the sampler: the MC Fisher's mean over many draws is the exact
    Fisher (standard error ~ 1/sqrt(M))."""
    net, x, y = _net("pad1")
    exact = reference_torch_kfac(net, "cross_entropy", x, y)["conv"]["G"]
    mc = reference_torch_kfac(net, "cross_entropy", x, y, mode="fisher_sampled", rng=0,
                              mc_samples=4000)["conv"]["G"]
    rel = np.linalg.norm(mc - exact) / np.linalg.norm(exact)
    assert rel < 0.08, rel
    few = reference_torch_kfac(net, "cross_entropy", x, y, mode="fisher_sampled", rng=0)
    assert np.linalg.norm(few["conv"]["G"] - exact) / np.linalg.norm(exact) > rel


def test_conv_errors_name_the_module():
    torch.manual_seed(0)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    y = torch.randint(0, 2, (2,))
    for bad, match in [(dict(padding=1, padding_mode="reflect"),
                        r"nn.Conv2d '0' must have padding_mode='zeros'; got 'reflect'")]:
        net = torch.nn.Sequential(torch.nn.Conv2d(2, 2, 3, **bad), torch.nn.Flatten(),
                                  torch.nn.LazyLinear(2)).double()
        net(x)
        with pytest.raises(ValueError, match=match):
            check_torch_kfac(net, "cross_entropy", x, y, {"2": {}})
    net, x, y = _net("pad1")
    with pytest.raises(ValueError, match=r"factors\['conv'\]\['A'\] must have shape \(19, 19\)"):
        check_torch_kfac(net, "cross_entropy", x, y, {"conv": {"A": np.eye(17)}})
    with pytest.raises(ValueError, match=r"needs exactly one of rng .* got neither"):
        check_torch_kfac(net, "cross_entropy", x, y, {"conv": {}}, mode="fisher_sampled")
    with pytest.raises(ValueError, match=r"rng and samples are used only with mode="):
        check_torch_kfac(net, "cross_entropy", x, y, {"conv": {}}, rng=0)
    with pytest.raises(ValueError, match=r"samples must be \[M, 3\] \(or \[3\]\) class indices"):
        check_torch_kfac(net, "cross_entropy", x, y, {"conv": {}}, mode="fisher_sampled",
                         samples=np.array([[0, 5, 1]]))
    with pytest.raises(TypeError, match=r"sample_targets: rng must be a non-negative int seed"):
        sample_targets("cross_entropy", np.zeros((2, 3)), "seed")


def test_backpack_style_hybrid_is_named():
    """BackPACK's conv KFAC: A = Σ/N (|T| × expand's) with the reduce G."""
    net, x, y = _net("pad1")
    ref = reference_torch_kfac(net, "cross_entropy", x, y)["conv"]
    red = reference_torch_kfac(net, "cross_entropy", x, y, sharing="reduce")["conv"]
    hybrid = {"conv": {"A": ref["A"] * ref["T"], "G": red["G"]}}
    res = check_conv(net, "cross_entropy", x, y, hybrid)
    assert [c.diagnosis for c in res.checks] == ["scale:T", "reduce_instead_of_expand"], \
        str(res)
    assert "BackPACK" in res.checks[0].explanation


def test_float32_conv_factors_get_float32_tolerances():
    net, x, y = _net("same_dilated", dtype=torch.float32)
    mine = _hand_written(net, x, y, "fisher_exact")
    res = check_conv(net, "cross_entropy", x, y, mine)
    assert res.ok, str(res)
    assert all(c.rtol > 1e-6 for c in res.checks)
    bad = {"conv": {"A": mine["conv"]["A"], "G": mine["conv"]["G"] / N ** 2}}
    res = check_conv(net, "cross_entropy", x, y, bad)
    assert [c.diagnosis for c in res.checks] == ["", "scale:1/N^2"], str(res)


def test_sampled_mse_against_the_hand_computed_gradient():
    """ℓ = ½‖f − ỹ‖², ỹ ~ N(f, I): g = f − ỹ, G = Σ_m g gᵀ / (N M) for a single Linear."""
    torch.manual_seed(2)
    net = torch.nn.Linear(4, 2).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randn(5, 2, dtype=torch.float64)
    with torch.no_grad():
        f = net(x).numpy()
    draws = sample_targets("mse", f, np.random.default_rng(3), mc_samples=6)
    assert draws.shape == (6, 5, 2)
    g = (f[None] - draws).reshape(-1, 2)
    expected = g.T @ g / (5 * 6)
    ref = reference_torch_kfac(net, "mse", x, y, mode="fisher_sampled", samples=draws)
    np.testing.assert_allclose(ref[""]["G"], expected, rtol=1e-13)
    again = reference_torch_kfac(net, "mse", x, y, mode="fisher_sampled",
                                 rng=np.random.default_rng(3), mc_samples=6)
    np.testing.assert_allclose(again[""]["G"], expected, rtol=1e-13)


def _unfold_a(x, kernel, pads, stride, dilation, bias=True):
    """A of patches read with the given geometry (explicit zero padding, then unfold)."""
    (top, bottom), (left, right) = pads
    xp = torch.nn.functional.pad(x, (left, right, top, bottom))
    p = torch.nn.functional.unfold(xp, kernel, dilation=dilation, stride=stride)
    p = p.transpose(1, 2).reshape(-1, p.shape[1])
    if bias:
        p = torch.cat([p, torch.ones(len(p), 1, dtype=p.dtype)], 1)
    return p.T @ p / len(p)


@pytest.mark.parametrize("name, wrong, pitfall", [
    ("valid_dilated", dict(dilation=(1, 1)), "dilation_ignored"),
    ("pad1", dict(pads=((0, 0), (0, 0))), "padding_ignored"),
    ("same_uneven", dict(pads=((2, 1), (1, 0))), "padding_split"),
    ("pad_tuple_stride", dict(stride=(1, 1)), "stride_ignored"),
])
def test_conv_geometry_faults_are_named(name, wrong, pitfall):
    net, x, y = _net(name)
    conv = net.conv
    geo = dict(pads=torch_conv_padding(conv), stride=conv.stride, dilation=conv.dilation)
    good = _hand_written(net, x, y, "fisher_exact")
    assert torch.allclose(_unfold_a(x, conv.kernel_size, **geo), good["conv"]["A"],
                          rtol=1e-12, atol=1e-14)  # the oracle reads the right patches
    user = {"conv": {"A": _unfold_a(x, conv.kernel_size, **(geo | wrong)),
                     "G": good["conv"]["G"]}}
    res = check_conv(net, "cross_entropy", x, y, user)
    by = _by(res)
    assert by["conv", "A"].diagnosis == pitfall, str(res)
    assert by["conv", "G"].ok and not res.ok


def _by(res):
    return {(c.layer, c.factor): c for c in res.checks}


def test_a_T_split_conv_convention_passes_as_equivalent():
    """A/|T| ⊗ |T|·G is the reference block: the layer passes, the split is named."""
    net, x, y = _net("pad_tuple_stride")
    good = _hand_written(net, x, y, "fisher_exact")
    t = reference_torch_kfac(net, "cross_entropy", x, y)["conv"]["T"]
    user = {"conv": {"A": good["conv"]["A"] / t, "G": good["conv"]["G"] * t}}
    res = check_conv(net, "cross_entropy", x, y, user)
    assert res.ok, str(res)
    assert res.blocks[0].verdict == "equivalent"
    assert res.blocks[0].split == f"A × 1/|T| = 1/{t}, G × |T| = {t}"
    assert not check_conv(net, "cross_entropy", x, y, user, level="factors").ok
    # TF's Γ = G/|T| passes when declared, and is named when not
    tf = {"conv": {"A": good["conv"]["A"], "G": good["conv"]["G"] / t}}
    assert check_conv(net, "cross_entropy", x, y, tf, conventions={"conv_style": "kfc"}).ok
    assert _by(check_conv(net, "cross_entropy", x, y, tf))["conv", "G"].diagnosis == \
        "scale:1/T"


def test_identity_started_average_after_two_steps_is_named_with_its_decay():
    net, x1, y1 = _net("pad1")
    gen = torch.Generator().manual_seed(5)
    x2 = torch.randn(x1.shape, dtype=x1.dtype, generator=gen)
    y2 = torch.randint(0, CLASSES, (N,), generator=gen)
    d = 0.9
    state = {"A": torch.eye(19, dtype=x1.dtype), "G": torch.eye(C_OUT, dtype=x1.dtype)}
    for xb, yb in ((x1, y1), (x2, y2)):  # an optimiser's identity-started running average
        stats = _hand_written(net, xb, yb, "fisher_exact")["conv"]
        state = {k: d * state[k] + (1 - d) * stats[k] for k in state}
    res = check_conv(net, "cross_entropy", x2, y2, {"conv": state}, earlier=[(x1, y1)],
                     decay=d)
    for fac in ("A", "G"):
        c = _by(res)["conv", fac]
        assert c.diagnosis == "ema_identity_init", str(res)
        assert "decay δ = 0.9 over the 2 batches" in c.explanation
    ok = check_conv(net, "cross_entropy", x2, y2, {"conv": state}, earlier=[(x1, y1)],
                    decay=d, conventions={"ema_init": "identity"})
    assert ok.ok, str(ok)


def test_a_partial_factors_dict_fails_and_the_users_tensors_are_copied():
    net, x, y = _net("pad1")
    good = _hand_written(net, x, y, "fisher_exact")
    res = check_torch_kfac(net, "cross_entropy", x, y, good)
    assert not res.ok and res.unchecked == ["fc"]
    a = good["conv"]["A"]
    before = a.clone()
    hook = net.conv.register_forward_hook(lambda m, i, o: [a.mul_(2.0)] and None)  # live
    try:
        res = check_conv(net, "cross_entropy", x, y, good)
    finally:
        hook.remove()
    assert res.ok, str(res)  # checked as given, before the check's passes ran the hook
    assert not torch.equal(a, before)
