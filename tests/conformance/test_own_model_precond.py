"""The own-model preconditioner check: a hand-written torch K-FAC preconditioner (written
here with torch.linalg: explicit π, explicit inverses, no kfac_ref, no conformance code)
agrees with the reference damped inverse product; each damping or Kronecker-order mutant of
it is named exactly; the reference itself against a dense NumPy solve."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conformance.own_model import check_torch_preconditioner  # noqa: E402
from conformance.own_model._precond import (  # noqa: E402
    preconditioner_alternatives,
    preconditioner_reference,
)


def _flat(text):
    """The printed result with its line wrapping undone (words joined by one space)."""
    return " ".join(text.split())

LAM = 1e-2


def _mlp():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.Tanh(),
        torch.nn.Linear(8, 9), torch.nn.Tanh(),  # square: d_A = 8 + 1 = d_G
        torch.nn.Linear(9, 3)).double()
    x = torch.randn(10, 5, dtype=torch.float64)
    y = torch.randn(10, 3, dtype=torch.float64)
    return net, x, y, "mse", "fisher_exact"


def _cnn():
    torch.manual_seed(1)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3, stride=2, padding=1), torch.nn.Tanh(),  # 7×7 -> 4×4
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Tanh(),            # 4×4, |T| = 16
        torch.nn.Flatten(), torch.nn.Linear(64, 5)).double()
    x = torch.randn(6, 2, 7, 7, dtype=torch.float64)
    y = torch.randint(0, 5, (6,))
    return net, x, y, "cross_entropy", "fisher_empirical"


def _kfac_factors(net, x, y, loss):
    """Hand-written K-FAC factors: A = Σ āāᵀ/(N|T|) over [a, 1] (conv: unfold patches),
    G = Σ ggᵀ/N over the per-example output vectors: the columns of F = I for the
    squared error (true Fisher), the label gradient of the summed cross-entropy
    (empirical Fisher)."""
    acts, outs, hooks = {}, {}, []
    mods = {n: m for n, m in net.named_modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    for name, m in mods.items():
        def keep(mod, inputs, output, name=name):
            acts[name], outs[name] = inputs[0].detach(), output
        hooks.append(m.register_forward_hook(keep))
    out = net(x)
    for h in hooks:
        h.remove()
    names = [n for n in mods if n in outs]  # modules called in the forward pass
    if loss == "mse":
        vecs = [torch.autograd.grad(out[:, k].sum(), [outs[n] for n in names],
                                    retain_graph=True) for k in range(out.shape[1])]
    else:
        total = torch.nn.functional.cross_entropy(out, y, reduction="sum")
        vecs = [torch.autograd.grad(total, [outs[n] for n in names])]
    n = x.shape[0]
    factors = {}
    for i, name in enumerate(names):
        m = mods[name]
        if isinstance(m, torch.nn.Conv2d):
            p = torch.nn.functional.unfold(acts[name], m.kernel_size, dilation=m.dilation,
                                           padding=m.padding, stride=m.stride)
            a = p.transpose(1, 2).reshape(-1, p.shape[1])          # rows (n, t)
            gs = [v[i].permute(0, 2, 3, 1).reshape(-1, m.out_channels) for v in vecs]
        else:  # [N, d] or positions shared over [N, S, d]: rows (n, s)
            a = acts[name].reshape(-1, m.in_features)
            gs = [v[i].reshape(-1, m.out_features) for v in vecs]
        a = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], dim=1)
        factors[name] = {"A": a.T @ a / len(a), "G": sum(g.T @ g for g in gs) / n}
    return factors


def _mean_loss_grads(net, x, y, loss):
    """The user's own gradient of the mean loss (loss.backward(), then .grad)."""
    net.zero_grad()
    out = net(x)
    if loss == "mse":
        total = 0.5 * ((out - y) ** 2).sum(dim=1).mean()
    else:
        total = torch.nn.functional.cross_entropy(out, y)
    total.backward()
    grads = {n: {"weight": m.weight.grad.clone(), "bias": m.bias.grad.clone()}
             for n, m in net.named_modules()
             if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))}
    net.zero_grad()
    return grads


def _precondition(factors, grads, lam=LAM, variant="correct", t=None, layers=None):
    """A hand-written K-FAC preconditioner with factored Tikhonov damping and the
    trace-norm π, and its mutants (applied to ``layers``, default all)."""
    out = {}
    for name, g in grads.items():
        a, gg = factors[name]["A"], factors[name]["G"]
        d_a, d_g = a.shape[0], gg.shape[0]
        w = g["weight"].reshape(d_g, -1)
        gam = torch.cat([w, g["bias"][:, None]], dim=1)                 # [out, in + 1]
        v = variant if layers is None or name in layers else "correct"
        lam_l = lam * (t[name] if v in ("lambda_times_T", "pi_nd_lambda_times_T",
                                        "exact_lambda_times_T") else 1.0)
        lam_l = lam_l / (t[name] if v == "lambda_over_T" else 1.0)
        i_a, i_g = torch.eye(d_a, dtype=a.dtype), torch.eye(d_g, dtype=a.dtype)
        pi = torch.sqrt((torch.trace(a) / d_a) / (torch.trace(gg) / d_g))
        if v == "pi_off":
            pi = torch.ones_like(pi)
        if v in ("pi_without_dimensions", "pi_nd_lambda_times_T"):
            pi = torch.sqrt(torch.trace(a) / torch.trace(gg))
        if v == "pi_squared":
            pi = pi * pi
        r = math.sqrt(lam_l)
        da, dg = pi * r, r / pi
        if v == "unsplit":
            da, dg = lam_l, lam_l
        if v == "per_factor":
            da, dg = pi * lam_l, lam_l / pi
        if v == "no_damping":
            da, dg = 0.0, 0.0
        if v in ("exact", "exact_lambda_times_T"):
            s_a, q_a = torch.linalg.eigh(a)
            s_g, q_g = torch.linalg.eigh(gg)
            p = q_g @ ((q_g.T @ gam @ q_a) / (s_g[:, None] * s_a[None, :] + lam_l)) @ q_a.T
        elif v == "kron_swapped":  # the G-side inverse on the input side (square layer)
            p = torch.linalg.inv(a + da * i_a) @ gam @ torch.linalg.inv(gg + dg * i_g)
        else:
            p = torch.linalg.solve(gg + dg * i_g, gam) @ torch.linalg.inv(a + da * i_a)
        if v == "sum_loss":
            p = p * 10.0  # the gradient of the sum over the N = 10 examples
        out[name] = {"weight": p[:, :-1].reshape(g["weight"].shape), "bias": p[:, -1]}
    return out


def _check(net, x, y, loss, mode, pre, **kw):
    kw.setdefault("damping", LAM)
    return check_torch_preconditioner(net, loss, x, y, pre, mode=mode, **kw)


@pytest.mark.parametrize("make", [_mlp, _cnn])
def test_a_correct_preconditioner_passes(make):
    net, x, y, loss, mode = make()
    factors = _kfac_factors(net, x, y, loss)
    grads = _mean_loss_grads(net, x, y, loss)
    res = _check(net, x, y, loss, mode, _precondition(factors, grads))
    assert res.ok, str(res)
    assert [c.layer for c in res.checks] == list(grads)
    assert all(c.rtol < 1e-9 for c in res.checks), str(res)
    assert "): all agree" in _flat(str(res))
    # with the preconditioner's own factors given
    res = _check(net, x, y, loss, mode, _precondition(factors, grads), factors=factors)
    assert res.ok, str(res)
    # a callable: the inverse product applied to the check's own gradients
    res = _check(net, x, y, loss, mode, lambda gr: _precondition(factors, gr))
    assert res.ok, str(res)


@pytest.mark.parametrize("make", [_mlp, _cnn])
def test_a_slightly_wrong_preconditioner_fails(make):
    """The tolerance is not vacuous: a relative error of 1e-8 in one layer fails there."""
    net, x, y, loss, mode = make()
    factors = _kfac_factors(net, x, y, loss)
    grads = _mean_loss_grads(net, x, y, loss)
    pre = _precondition(factors, grads)
    name = next(iter(pre))
    pre[name]["weight"] = pre[name]["weight"] * (1 + 1e-8)
    res = _check(net, x, y, loss, mode, pre)
    assert not res.ok
    assert [c.ok for c in res.checks] == [c.layer != name for c in res.checks]


def _check_mutant(problem, variant, layers, style, want, t=None):
    """The preconditioner with ``variant`` on ``layers`` (None: all) and the other layers
    right in the declared damping ``style``: exactly the changed layers are named ``want``."""
    net, x, y, loss, mode = problem
    factors = _kfac_factors(net, x, y, loss)
    grads = _mean_loss_grads(net, x, y, loss)
    wrong = layers if layers is not None else list(grads)
    other = "exact" if style == "exact" else "correct"  # the layers left right
    pre = _precondition(factors, grads, variant=other, t=t)
    pre.update({k: v for k, v in _precondition(factors, grads, variant=variant, t=t,
                                               layers=wrong).items() if k in wrong})
    res = _check(net, x, y, loss, mode, pre, damping_style=style)
    got = {c.layer: c.diagnosis for c in res.checks if not c.ok}
    assert got == {name: want for name in wrong}, str(res)
    return res


MLP_MUTANTS = [  # variant, layers it changes (None: all), declared style, expected id
    ("pi_off", None, "factored", "pi_off"),
    ("pi_without_dimensions", ["0", "4"], "factored", "pi_without_dimensions"),
    ("pi_squared", None, "factored", "pi_squared"),
    ("unsplit", None, "factored", "unsplit_damping"),
    ("per_factor", None, "factored", "damping_parameterisation"),
    ("exact", None, "factored", "exact_damping"),
    ("correct", None, "exact", "factored_damping"),
    ("no_damping", ["0"], "factored", "no_damping"),
    ("kron_swapped", ["2"], "factored", "kron_order_swapped"),
    ("sum_loss", None, "factored", "scale:N"),
    ("unsplit", None, "exact", "factored_damping+unsplit_damping"),
    ("pi_off", ["4"], "exact", "factored_damping+pi_off"),
]


@pytest.mark.parametrize("variant,layers,style,want", MLP_MUTANTS,
                         ids=[m[0] + "_" + m[2] for m in MLP_MUTANTS])
def test_mlp_mutants_are_named(variant, layers, style, want):
    res = _check_mutant(_mlp(), variant, layers, style, want)
    assert not res.ok and f"diagnosis: {want}:" in _flat(str(res))


CNN_T = {"0": 16, "2": 16, "5": 1}
CNN_MUTANTS = [  # variant, layers it changes, declared style, expected id
    ("lambda_times_T", ["0", "2"], "factored", "damping_not_normalised"),
    ("lambda_over_T", ["0", "2"], "factored", "spurious_damping_normalisation"),
    ("pi_nd_lambda_times_T", ["0", "2"], "factored",
     "pi_without_dimensions+damping_not_normalised"),
    ("pi_off", ["2"], "factored", "pi_off"),
    ("unsplit", ["0"], "factored", "unsplit_damping"),
    ("exact", ["2"], "factored", "exact_damping"),
    ("exact_lambda_times_T", ["0", "2"], "exact", "damping_not_normalised"),
    ("correct", ["5"], "exact", "factored_damping"),
    ("lambda_over_T", ["0", "2"], "exact", "factored_damping+spurious_damping_normalisation"),
]


@pytest.mark.parametrize("variant,layers,style,want", CNN_MUTANTS,
                         ids=[m[0] + "_" + m[2] for m in CNN_MUTANTS])
def test_cnn_mutants_are_named(variant, layers, style, want):
    _check_mutant(_cnn(), variant, layers, style, want, t=CNN_T)


def _precondition_tf(factors, grads, lam=LAM, fault=None):
    """TF K-FAC's convolution convention, written out: Γ_TF = G/|T|, the block
    |T|·(A ⊗ Γ_TF), the damping normalised to λ/|T| and split with π of (A, Γ_TF).  The
    same preconditioner as the reference's, so it passes; without the block scale or the
    normalisation it is named."""
    out = {}
    for name, g in grads.items():
        a, t = factors[name]["A"], CNN_T[name]
        gam_tf = factors[name]["G"] / t
        d_a, d_g = a.shape[0], gam_tf.shape[0]
        grad = torch.cat([g["weight"].reshape(d_g, -1), g["bias"][:, None]], dim=1)
        lam_n = lam if fault == "no_normalisation" else lam / t
        pi = torch.sqrt((torch.trace(a) / d_a) / (torch.trace(gam_tf) / d_g))
        r = math.sqrt(lam_n)
        p = torch.linalg.solve(gam_tf + r / pi * torch.eye(d_g, dtype=a.dtype), grad) \
            @ torch.linalg.inv(a + pi * r * torch.eye(d_a, dtype=a.dtype))
        p = p if fault == "no_block_scale" else p / t  # (|T|·X)⁻¹ = X⁻¹/|T|
        out[name] = {"weight": p[:, :-1].reshape(g["weight"].shape), "bias": p[:, -1]}
    return out


def test_tf_convolution_convention_passes_and_its_faults_are_named():
    net, x, y, loss, mode = _cnn()
    factors = _kfac_factors(net, x, y, loss)
    grads = _mean_loss_grads(net, x, y, loss)
    res = _check(net, x, y, loss, mode, _precondition_tf(factors, grads))
    assert res.ok, str(res)
    res = _check(net, x, y, loss, mode, _precondition_tf(factors, grads, fault="no_block_scale"))
    assert {c.layer: c.diagnosis for c in res.checks if not c.ok} == {
        "0": "scale:T", "2": "scale:T"}, str(res)
    assert "TF's Γ = G/|T| (with λ/|T|) used without its block scale" in _flat(str(res))
    res = _check(net, x, y, loss, mode,
                 _precondition_tf(factors, grads, fault="no_normalisation"))
    assert {c.layer: c.diagnosis for c in res.checks if not c.ok} == {
        "0": "damping_not_normalised", "2": "damping_not_normalised"}, str(res)


def test_float32_model_gets_float32_tolerances():
    net, x, y, loss, mode = _mlp()
    net, x, y = net.float(), x.float(), y.float()
    factors = _kfac_factors(net, x, y, loss)
    grads = _mean_loss_grads(net, x, y, loss)
    res = _check(net, x, y, loss, mode, _precondition(factors, grads))
    assert res.ok, str(res)
    assert all(1e-6 < c.rtol < 1e-2 for c in res.checks), str(res)
    res = _check(net, x, y, loss, mode, _precondition(factors, grads, variant="pi_off"))
    assert {c.diagnosis for c in res.checks} == {"pi_off"}, str(res)


def test_sampled_fisher_reference_runs_with_the_users_draws():
    """mode='fisher_sampled' with the draws: the reference factors are the sampled ones; a
    preconditioner built on the true-Fisher factors then fails (no quiet pass)."""
    net, x, y, loss, _ = _cnn()
    factors = _kfac_factors(net, x, y, loss)
    grads = _mean_loss_grads(net, x, y, loss)
    pre = _precondition(factors, grads)
    res = _check(net, x, y, loss, "fisher_sampled", pre, samples=y.numpy()[None])
    assert res.ok, str(res)  # the data labels as the one draw: the empirical Fisher
    res = _check(net, x, y, loss, "fisher_sampled", pre, rng=0)
    assert not res.ok


def test_own_factors_isolate_the_damping_check():
    """Factors with a bug (G of the mean-loss gradients, 1/N² too small) used consistently:
    the damped product passes against those factors and fails against the reference's."""
    net, x, y, loss, mode = _mlp()
    factors = _kfac_factors(net, x, y, loss)
    bad = {k: {"A": v["A"], "G": v["G"] / 100.0} for k, v in factors.items()}
    grads = _mean_loss_grads(net, x, y, loss)
    pre = _precondition(bad, grads)
    assert _check(net, x, y, loss, mode, pre, factors=bad).ok
    res = _check(net, x, y, loss, mode, pre)
    assert not any(c.ok for c in res.checks)
    # and a damping mutant on top of the buggy factors is still named
    res = _check(net, x, y, loss, mode, _precondition(bad, grads, variant="pi_off"),
                 factors=bad)
    assert {c.diagnosis for c in res.checks} == {"pi_off"}, str(res)


def test_flat_vectors_and_the_kron_order_on_a_non_square_layer():
    """flat=True: [weight.flatten(), bias] per layer.  Code that applies kron(A⁻¹, G⁻¹) to
    the row-major vec of [W, b] (the order for a [in + 1, out] kernel) is named on every
    layer, square or not."""
    net, x, y, loss, mode = _mlp()
    factors = _kfac_factors(net, x, y, loss)

    def flat(grads, swapped=False):
        out = {}
        for name, g in grads.items():
            a, gg = factors[name]["A"], factors[name]["G"]
            d_a, d_g = a.shape[0], gg.shape[0]
            n_w = d_g * (d_a - 1)
            gam = torch.cat([g[:n_w].reshape(d_g, -1), g[n_w:, None]], dim=1)
            pi = torch.sqrt((torch.trace(a) / d_a) / (torch.trace(gg) / d_g))
            r = math.sqrt(LAM)
            ia = torch.linalg.inv(a + pi * r * torch.eye(d_a, dtype=a.dtype))
            ig = torch.linalg.inv(gg + r / pi * torch.eye(d_g, dtype=a.dtype))
            k = torch.kron(ia, ig) if swapped else torch.kron(ig, ia)
            p = (k @ gam.reshape(-1)).reshape(d_g, d_a)
            out[name] = torch.cat([p[:, :-1].reshape(-1), p[:, -1]])
        return out

    res = _check(net, x, y, loss, mode, flat, flat=True)
    assert res.ok, str(res)
    res = _check(net, x, y, loss, mode, lambda g: flat(g, swapped=True), flat=True)
    assert {c.layer: c.diagnosis for c in res.checks} == {
        "0": "kron_order_swapped", "2": "kron_order_swapped", "4": "kron_order_swapped"}
    grads = {k: torch.cat([v["weight"].reshape(-1), v["bias"]])
             for k, v in _mean_loss_grads(net, x, y, loss).items()}
    assert _check(net, x, y, loss, mode, flat(grads), flat=True).ok


def test_missing_layers_fail_and_are_listed():
    net, x, y, loss, mode = _mlp()
    factors = _kfac_factors(net, x, y, loss)
    grads = _mean_loss_grads(net, x, y, loss)
    pre = _precondition(factors, grads)
    del pre["2"]
    res = _check(net, x, y, loss, mode, pre)
    assert not res.ok and res.missing == ["2"]
    assert "FAIL not checked (no preconditioned gradient given): 2" in _flat(str(res))
    res = _check(net, x, y, loss, mode, lambda g: {})  # a callable that returns nothing
    assert not res.ok and res.missing == ["0", "2", "4"] and not res.checks
    assert _check(net, x, y, loss, mode, pre, layers=["0", "4"]).ok  # an explicit subset


def test_bad_input_is_named():
    net, x, y, loss, mode = _mlp()
    factors = _kfac_factors(net, x, y, loss)
    grads = _mean_loss_grads(net, x, y, loss)
    pre = _precondition(factors, grads)
    fn = "check_torch_preconditioner"
    with pytest.raises(TypeError, match=rf"{fn}: preconditioned must be a dict"):
        _check(net, x, y, loss, mode, [1, 2])
    with pytest.raises(ValueError, match=rf"{fn}: damping must be a finite real number"):
        _check(net, x, y, loss, mode, pre, damping=0.0)
    with pytest.raises(ValueError, match=rf"{fn}: damping_style must be one of"):
        _check(net, x, y, loss, mode, pre, damping_style="eigen")
    with pytest.raises(ValueError, match=rf"{fn}: preconditioned must name supported "
                                         r"layers of the model \(0, 2, 4\); got fc"):
        _check(net, x, y, loss, mode, {**pre, "fc": pre["0"]})
    w = pre["0"]["weight"]
    with pytest.raises(ValueError, match=r"preconditioned\['0'\]\['weight'\] must have shape "
                                         r"\(8, 5\) \(the weight's\); got \(5, 8\) \(the "
                                         r"transpose of the expected shape\)"):
        _check(net, x, y, loss, mode, {**pre, "0": {"weight": w.T, "bias": pre["0"]["bias"]}})
    with pytest.raises(ValueError, match=r"preconditioned\['2'\] must be a dict with keys "
                                         r"\['bias', 'weight'\]"):
        _check(net, x, y, loss, mode, {**pre, "2": {"weight": pre["2"]["weight"]}})
    with pytest.raises(ValueError, match=r"preconditioned\(gradients\)\['0'\] must have "
                                         r"shape \(48,\)"):
        _check(net, x, y, loss, mode, lambda g: {"0": torch.zeros(40)}, flat=True)
    with pytest.raises(TypeError, match=r"\['0'\]\['bias'\] must be a float32 or float64 "
                                        r"tensor or array; got dtype int"):
        _check(net, x, y, loss, mode, {"0": {"weight": w, "bias": np.zeros(8, dtype=int)}})
    with pytest.raises(TypeError, match=r"\['0'\]\['weight'\] must be a float32 or "
                                        r"float64 tensor or array; got dtype torch.float16"):
        _check(net, x, y, loss, mode, {**pre, "0": {"weight": w.half(), "bias": w[:, 0]}})
    with pytest.raises(ValueError, match=rf"{fn}: factors must hold every checked layer"):
        _check(net, x, y, loss, mode, pre, factors={"0": factors["0"]})
    skew = {k: dict(v) for k, v in factors.items()}
    skew["4"]["G"] = skew["4"]["G"] + torch.triu(torch.ones(3, 3, dtype=torch.float64), 1)
    with pytest.raises(ValueError, match=r"factors\['4'\]\['G'\] must be symmetric"):
        _check(net, x, y, loss, mode, pre, factors=skew)
    with pytest.raises(ValueError, match=rf"{fn}: layers must name supported layers"):
        _check(net, x, y, loss, mode, pre, layers=["1"])

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.spare = net, torch.nn.Linear(2, 2).double()  # spare: never called

        def forward(self, inputs):
            return self.body(inputs)

    wrapped, renamed = Wrapped(), {f"body.{k}": v for k, v in pre.items()}
    with pytest.raises(ValueError, match=rf"{fn}: every checked layer must be called in the "
                                         r"forward pass; not called: spare"):
        _check(wrapped, x, y, loss, mode, renamed)
    mine = {f"body.{k}": v for k, v in factors.items()}
    assert _check(wrapped, x, y, loss, mode, renamed, layers=list(renamed), factors=mine).ok


def test_reference_against_a_dense_solve_pins_the_kronecker_order():
    """P against np.linalg.solve with the dense Kronecker product: the row-major vec of the
    [d_G, d_A] gradient takes kron(G, A) (the column-major vec kron(A, G)); factored damping
    with an explicit π, exact damping with λI; the swapped-order alternative is kron(A, G)
    applied to the row-major vec."""
    r = np.random.default_rng(0)
    d_a, d_g = 4, 3
    xa, xg = r.standard_normal((9, d_a)), r.standard_normal((9, d_g)) * 0.3
    a, g = xa.T @ xa / 9, xg.T @ xg / 9
    grad = r.standard_normal((d_g, d_a))
    lam = 0.05
    pi = math.sqrt((np.trace(a) / d_a) / (np.trace(g) / d_g))
    a_d = a + pi * math.sqrt(lam) * np.eye(d_a)
    g_d = g + math.sqrt(lam) / pi * np.eye(d_g)
    oracle = np.linalg.solve(np.kron(g_d, a_d), grad.ravel()).reshape(d_g, d_a)
    p = preconditioner_reference(a, g, grad, lam, "factored")
    np.testing.assert_allclose(p, oracle, rtol=1e-12, atol=0)
    col = np.linalg.solve(np.kron(a_d, g_d), grad.ravel(order="F")).reshape((d_g, d_a),
                                                                             order="F")
    np.testing.assert_allclose(p, col, rtol=1e-12, atol=0)
    exact = np.linalg.solve(np.kron(g, a) + lam * np.eye(d_a * d_g),
                            grad.ravel()).reshape(d_g, d_a)
    np.testing.assert_allclose(preconditioner_reference(a, g, grad, lam, "exact"), exact,
                               rtol=1e-12, atol=0)
    alts = preconditioner_alternatives(a, g, grad, lam, "factored", t=5)
    swapped = np.linalg.solve(np.kron(a_d, g_d), grad.ravel()).reshape(d_g, d_a)
    np.testing.assert_allclose(alts["kron_order_swapped"], swapped, rtol=1e-12, atol=0)
    np.testing.assert_allclose(alts["exact_damping"], exact, rtol=1e-12, atol=0)
    unsplit = np.linalg.solve(np.kron(g + lam * np.eye(d_g), a + lam * np.eye(d_a)),
                              grad.ravel()).reshape(d_g, d_a)
    np.testing.assert_allclose(alts["unsplit_damping"], unsplit, rtol=1e-12, atol=0)
    assert not np.allclose(p, swapped, rtol=1e-3)  # the order matters here


def _docs_section():
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "conformance" / "own_model.md"
    if not page.exists():
        pytest.skip("docs sources not present")
    text = page.read_text(encoding="utf-8")
    return text[text.index("## Check your preconditioner"):]


def _run(tmp_path, code):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "example.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=str(root))
    p = subprocess.run([sys.executable, "-W", "ignore", str(tmp_path / "example.py")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_the_docs_section_prints_what_it_shows_and_its_fix_passes(tmp_path):
    import re

    section = _docs_section()
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    assert _run(tmp_path, code) == shown
    assert "diagnosis: pi_without_dimensions" in _flat(shown)
    bug = "torch.sqrt(A.trace() / G.trace())"
    assert code.count(bug) == 1
    fixed = _run(tmp_path, code.replace(
        bug, "torch.sqrt((A.trace() / len(A)) / (G.trace() / len(G)))"))
    flat = _flat(fixed)
    assert "): all agree" in flat and flat.count(": ok (") == 2 and "FAIL" not in flat


def test_tolerance_at_its_documented_value_and_on_both_sides():
    """rtol = 16 ε [(κ(A_λ) + κ(G_λ))(N|T|K + d_A + d_G) + κ(A_λ)κ(G_λ)·N|T|·c_Γ], with κ
    from NumPy eigenvalues and c_Γ from a loop over the examples; the c_Γ term only for a
    given gradient (a callable is handed the check's); a relative error of 0.9·rtol passes
    and 1.1·rtol fails."""
    net, x, y, loss, mode = _mlp()
    factors = _kfac_factors(net, x, y, loss)
    grads = _mean_loss_grads(net, x, y, loss)
    name, lin = "0", net[0]
    a, g = factors[name]["A"].numpy(), factors[name]["G"].numpy()
    d_a, d_g = a.shape[0], g.shape[0]
    pi = math.sqrt((np.trace(a) / d_a) / (np.trace(g) / d_g))
    s_a = np.linalg.eigvalsh(a) + pi * math.sqrt(LAM)
    s_g = np.linalg.eigvalsh(g) + math.sqrt(LAM) / pi
    k_a, k_g = s_a[-1] / s_a[0], s_g[-1] / s_g[0]
    n, k = x.shape[0], 3  # K = C columns of the squared error's Fisher factor
    eps = np.finfo(np.float64).eps
    bound = np.zeros((d_g, d_a))
    for i in range(n):  # Σ_n |∂L/∂z_n| |[x_n, 1]|ᵀ of the mean loss L
        xi = x[i:i + 1].requires_grad_(False)
        z = lin(xi)
        zd = z.detach().requires_grad_(True)
        out = net[1:](zd)
        li = 0.5 * ((out - y[i:i + 1]) ** 2).sum() / n
        gz = torch.autograd.grad(li, zd)[0][0].numpy()
        bound += np.outer(np.abs(gz), np.abs(np.r_[xi[0].numpy(), 1.0]))
    gam = np.c_[grads[name]["weight"].numpy(), grads[name]["bias"].numpy()]
    c_gam = np.linalg.norm(bound) / np.linalg.norm(gam)
    assert c_gam >= 1.0
    base = (k_a + k_g) * (n * k + d_a + d_g)
    want_callable = 16 * eps * base
    want_dict = 16 * eps * (base + k_a * k_g * n * c_gam)
    pre = _precondition(factors, grads)
    res = _check(net, x, y, loss, mode, pre, factors=factors)
    c0 = res.checks[0]
    assert c0.layer == name
    np.testing.assert_allclose(c0.rtol, want_dict, rtol=1e-10)
    np.testing.assert_allclose(c0.kappa, k_a * k_g, rtol=1e-10)
    res = _check(net, x, y, loss, mode, lambda gr: _precondition(factors, gr), factors=factors)
    np.testing.assert_allclose(res.checks[0].rtol, want_callable, rtol=1e-10)
    for f, ok in ((0.9, True), (1.1, False)):
        bumped = {k: dict(v) for k, v in pre.items()}
        bumped[name] = {"weight": pre[name]["weight"] * (1 + f * want_dict),
                        "bias": pre[name]["bias"] * (1 + f * want_dict)}
        c0 = _check(net, x, y, loss, mode, bumped, factors=factors).checks[0]
        assert c0.ok is ok, (f, c0.rel_err, c0.rtol)


def test_the_users_numbers_are_copied_before_the_check_runs():
    """A hook that changes the user's buffers on every forward pass of the model (an
    optimiser's statistics hook) does not change what is checked."""
    net, x, y, loss, mode = _mlp()
    factors = _kfac_factors(net, x, y, loss)
    grads = _mean_loss_grads(net, x, y, loss)
    pre = _precondition(factors, grads)

    def scribble(mod, inputs, output):
        with torch.no_grad():
            pre["0"]["weight"].mul_(2.0)
            factors["0"]["A"].mul_(3.0)

    h = net[0].register_forward_hook(scribble)
    try:
        res = _check(net, x, y, loss, mode, pre, factors=factors)
    finally:
        h.remove()
    assert res.ok, str(res)
    assert not _check(net, x, y, loss, mode, pre, factors=factors).ok  # they did change


def test_non_finite_output_and_bad_targets():
    net, x, y, loss, mode = _mlp()
    factors = _kfac_factors(net, x, y, loss)
    grads = _mean_loss_grads(net, x, y, loss)
    pre = _precondition(factors, grads)
    pre["4"]["bias"] = pre["4"]["bias"].clone()
    pre["4"]["bias"][0] = float("nan")
    res = _check(net, x, y, loss, mode, pre)
    assert {c.layer: c.diagnosis for c in res.checks if not c.ok} == {"4": "non_finite"}
    with pytest.raises(ValueError, match=r"check_torch_preconditioner: targets must be "
                                         r"\[10, 3\] for loss='mse'; got shape \(10,\)"):
        _check(net, x, y[:, 0], loss, mode, pre)
    with pytest.raises(ValueError, match=r"targets must be \[10\] class indices in 0\.\.2"):
        _check(net, x, torch.full((10,), 3), "cross_entropy", "fisher_empirical", pre)


def test_conv_tolerance_at_its_documented_value():
    """The convolution's c_Γ from explicit patches (padded input sliced per output location,
    no unfold), κ from NumPy eigenvalues, K = 1 (empirical Fisher), |T| = 16."""
    net, x, y, loss, mode = _cnn()
    factors = _kfac_factors(net, x, y, loss)
    grads = _mean_loss_grads(net, x, y, loss)
    conv = net[0]
    z = {}
    h = conv.register_forward_hook(lambda m, i, o: z.__setitem__("z", o))
    total = torch.nn.functional.cross_entropy(net(x), y)
    h.remove()
    gz = torch.autograd.grad(total, z["z"])[0].numpy()          # [N, 3, 4, 4]
    xp = np.pad(x.numpy(), ((0, 0), (0, 0), (1, 1), (1, 1)))
    n, t = x.shape[0], 16
    bound = np.zeros((3, 2 * 9 + 1))
    for i in range(n):
        for r in range(4):
            for c in range(4):
                patch = xp[i, :, 2 * r:2 * r + 3, 2 * c:2 * c + 3].ravel()  # (C, kh, kw)
                bound += np.outer(np.abs(gz[i, :, r, c]), np.abs(np.r_[patch, 1.0]))
    gam = np.c_[grads["0"]["weight"].reshape(3, -1).numpy(), grads["0"]["bias"].numpy()]
    c_gam = np.linalg.norm(bound) / np.linalg.norm(gam)
    a, g = factors["0"]["A"].numpy(), factors["0"]["G"].numpy()
    pi = math.sqrt((np.trace(a) / 19) / (np.trace(g) / 3))
    s_a = np.linalg.eigvalsh(a) + pi * math.sqrt(LAM)
    s_g = np.linalg.eigvalsh(g) + math.sqrt(LAM) / pi
    k_a, k_g = s_a[-1] / s_a[0], s_g[-1] / s_g[0]
    want = 16 * np.finfo(np.float64).eps * ((k_a + k_g) * (n * t * 1 + 19 + 3)
                                            + k_a * k_g * n * t * c_gam)
    res = _check(net, x, y, loss, mode, _precondition(factors, grads), factors=factors)
    assert res.checks[0].layer == "0"
    np.testing.assert_allclose(res.checks[0].rtol, want, rtol=1e-10)


def test_a_linear_shared_over_positions():
    """An nn.Linear applied to [N, S, d] (|T| = S, KFAC-expand): the correct preconditioner
    passes, λ·S on it is damping_not_normalised."""
    torch.manual_seed(2)

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(4, 5), torch.nn.Linear(5, 3)

        def forward(self, inputs):
            return self.fc2(torch.tanh(self.fc1(inputs)).mean(dim=1))

    net = Shared().double()
    x, y = torch.randn(7, 3, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    loss, mode = "cross_entropy", "fisher_empirical"
    factors = _kfac_factors(net, x, y, loss)
    grads = _mean_loss_grads(net, x, y, loss)
    assert _check(net, x, y, loss, mode, _precondition(factors, grads)).ok
    pre = _precondition(factors, grads, variant="lambda_times_T", t={"fc1": 3, "fc2": 1})
    res = _check(net, x, y, loss, mode, pre)
    assert {c.layer: c.diagnosis for c in res.checks if not c.ok} == {
        "fc1": "damping_not_normalised"}, str(res)


def test_attention_projections_are_left_out():
    """nn.MultiheadAttention's out_proj is an nn.Linear the module never calls: not a
    checked layer (this check covers nn.Linear and nn.Conv2d called as modules)."""
    torch.manual_seed(3)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(4, 2, batch_first=True)
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, inputs):
            h, _ = self.attn(inputs, inputs, inputs)
            return self.fc(h.mean(dim=1))

    net = Net().double().eval()
    x, y = torch.randn(5, 3, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    loss, mode = "cross_entropy", "fisher_empirical"
    factors = _kfac_factors(net, x, y, loss)
    factors = {"fc": factors["fc"]}
    grads = {"fc": _mean_loss_grads(net, x, y, loss)["fc"]}
    res = _check(net, x, y, loss, mode, _precondition(factors, grads), factors=factors)
    assert res.ok and [c.layer for c in res.checks] == ["fc"], str(res)


def test_declared_damping_per_factor_passes_and_is_refused_for_exact_damping():
    """λ given to each factor: (A + πλI)⊗(G + λ/πI) is the reference with the block damping
    λ²; declared, it passes; undeclared it is named damping_parameterisation."""
    from conformance.own_model import check_torch_preconditioner, reference_torch_kfac

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                              torch.nn.Linear(3, 2)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))
    ref = reference_torch_kfac(net, "cross_entropy", x, y)
    lam = 0.05

    def per_factor(grads):
        out = {}
        for name, gr in grads.items():
            a, g = (torch.as_tensor(ref[name][k]) for k in ("A", "G"))
            pi = ((torch.trace(a) / len(a)) / (torch.trace(g) / len(g))).sqrt()
            m = torch.cat([gr["weight"], gr["bias"][:, None]], 1)
            p = torch.linalg.solve(g + lam / pi * torch.eye(len(g), dtype=g.dtype), m)
            p = torch.linalg.solve(a + pi * lam * torch.eye(len(a), dtype=a.dtype), p.T).T
            out[name] = {"weight": p[:, :-1], "bias": p[:, -1]}
        return out

    res = check_torch_preconditioner(net, "cross_entropy", x, y, per_factor, damping=lam)
    assert {c.diagnosis for c in res.checks} == {"damping_parameterisation"}, str(res)
    ok = check_torch_preconditioner(net, "cross_entropy", x, y, per_factor, damping=lam,
                                    conventions={"damping_per_factor": "lambda"})
    assert ok.ok, str(ok)
    with pytest.raises(ValueError, match=r"needs damping_style='factored'"):
        check_torch_preconditioner(net, "cross_entropy", x, y, per_factor, damping=lam,
                                   damping_style="exact",
                                   conventions={"damping_per_factor": "lambda"})
    with pytest.raises(ValueError, match=r"conventions has no field 'conv_style' here"):
        check_torch_preconditioner(net, "cross_entropy", x, y, per_factor, damping=lam,
                                   conventions={"conv_style": "kfc"})
