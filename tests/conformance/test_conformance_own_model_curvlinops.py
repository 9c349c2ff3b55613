"""Oracle: curvlinops' KFAC factors of a small MLP and CNN against reference_torch_kfac.

curvlinops' ``KFACLinearOperator`` with ``CrossEntropyLoss(reduction="mean")``,
``separate_weight_and_bias=False`` and ``kfac_approx="expand"`` stores
``A = Σ_{n,t} ā āᵀ / (N·|T|)`` over unfold-ordered patches with the bias's 1 last and
``G = Σ_{n,t} g gᵀ / N`` (per-example g): the convention of conformance.own_model, so the
documented conversion is the identity.  Its ``"reduce"`` factors are KFAC-reduce's.  For
``fisher_type="mc"`` the labels are drawn again here with curvlinops' procedure (a torch
Generator seeded with its seed, ``softmax(output).multinomial(1)`` per sample) and handed
to the reference as ``samples``.  Skipped where curvlinops is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
curvlinops = pytest.importorskip("curvlinops")

from conformance.own_model import check_torch_kfac, reference_torch_kfac  # noqa: E402

N, CLASSES = 6, 3
FISHER = {"fisher_exact": "type-2", "fisher_empirical": "empirical", "fisher_sampled": "mc"}


def _mlp():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(),
                              torch.nn.Linear(4, 4, bias=False), torch.nn.Tanh(),
                              torch.nn.Linear(4, CLASSES)).double()
    return net, torch.randn(N, 5, dtype=torch.float64)


def _cnn():
    torch.manual_seed(1)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.Tanh(),
        torch.nn.Conv2d(3, 2, (2, 3), stride=(2, 1), padding=(1, 0), dilation=(1, 2),
                        bias=False), torch.nn.Tanh(),
        torch.nn.Flatten(), torch.nn.Linear(2 * 4 * 1, CLASSES)).double()
    return net, torch.randn(N, 2, 6, 5, dtype=torch.float64)


def _curvlinops_factors(net, x, y, mode, approx="expand", seed=2147483647, mc=1):
    from curvlinops import KFACLinearOperator

    loss = torch.nn.CrossEntropyLoss(reduction="mean")
    params = [p for p in net.parameters() if p.requires_grad]
    op = KFACLinearOperator(net, loss, params, [(x, y)], fisher_type=FISHER[mode],
                            kfac_approx=approx, separate_weight_and_bias=False,
                            check_deterministic=False, seed=seed, mc_samples=mc)
    op.compute_kronecker_factors()
    return {name: {"A": op._input_covariances[name], "G": op._gradient_covariances[name]}
            for name in op._gradient_covariances}


def _curvlinops_draws(net, x, seed, mc):
    """The labels curvlinops draws for one batch (its draw_label, replayed)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        probs = net(x).softmax(dim=1)
    return np.stack([probs.multinomial(num_samples=1, generator=gen).squeeze(-1).numpy()
                     for _ in range(mc)])


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("mode", ["fisher_exact", "fisher_empirical", "fisher_sampled"])
@pytest.mark.parametrize("make", [_mlp, _cnn], ids=["mlp", "cnn"])
def test_curvlinops_factors_agree_with_the_reference(make, mode, approx):
    net, x = make()
    y = torch.randint(0, CLASSES, (N,), generator=torch.Generator().manual_seed(3))
    seed, mc = 11, 3
    kw = {}
    if mode == "fisher_sampled":
        kw["samples"] = _curvlinops_draws(net, x, seed, mc)
    theirs = _curvlinops_factors(net, x, y, mode, approx, seed=seed, mc=mc if kw else 1)
    ref = reference_torch_kfac(net, "cross_entropy", x, y, mode=mode, sharing=approx, **kw)
    assert set(theirs) == set(ref)
    for name, fac in theirs.items():
        np.testing.assert_allclose(fac["A"].numpy(), ref[name]["A"], rtol=1e-11, atol=1e-14)
        np.testing.assert_allclose(fac["G"].numpy(), ref[name]["G"], rtol=1e-10, atol=1e-15)
    res = check_torch_kfac(net, "cross_entropy", x, y, theirs, mode=mode, sharing=approx,
                           **kw)
    assert res.ok, str(res)
    assert len(res.checks) == 2 * len(ref)


def test_curvlinops_expand_where_reduce_is_asked_is_named():
    net, x = _cnn()
    y = torch.randint(0, CLASSES, (N,), generator=torch.Generator().manual_seed(3))
    theirs = _curvlinops_factors(net, x, y, "fisher_exact", "expand")
    res = check_torch_kfac(net, "cross_entropy", x, y, theirs, sharing="reduce")
    diags = {(c.layer, c.factor): c.diagnosis for c in res.checks}
    assert diags["0", "A"] == "expand_instead_of_reduce", str(res)
    assert diags["2", "G"] == "expand_instead_of_reduce", str(res)
