"""Reproduction: BackPACK (backpack-for-pytorch 1.7.1) against kfac_ref, float64.

Run inside the ``torchpeers`` environment, from the repository root::

    python -m conformance.peers.repro_backpack [--json out.json]

BackPACK's ``KFLR`` is K-FAC with the exact (type-2) Fisher, ``KFAC`` the one-sample MC
version, ``KFRA`` the recursive approximation.  ``weight.kflr == [G, A]`` (block
``kron(G, A)`` on the PyTorch weight), ``bias.kflr == [G]`` (separate bias block); A has no
homogeneous coordinate.  G carries the curvature of the loss as PyTorch reduces it (as in
curvlinops: MSELoss is ‖f−y‖², mean also divides by C).
"""

from __future__ import annotations

import numpy as np
import torch
from backpack import backpack, extend
from backpack.extensions import KFAC, KFLR, KFRA

from . import common as C
from . import torch_common as T

TOL = 1e-12  # float64 GEMMs on O(1) data (errors ~1e-15); far below any convention's effect


def g_scale(loss, reduction, n, c):
    s = n if reduction == "sum" else 1.0
    if loss == "mse":
        s *= 2.0
        if reduction == "mean":
            s /= c
    return s


def _run(model, loss_mod, x, y, ext):
    model = extend(model)
    loss_mod = extend(loss_mod)
    model.zero_grad()
    loss = loss_mod(model(x), y)
    with backpack(ext):
        loss.backward()
    return model


def _kf(param, attr):
    return [m.detach().numpy() for m in getattr(param, attr)]


def run_mlp(rep):
    p = C.mlp_problem()
    n, dims = p["x"].shape[0], C.mlp_dims(p)
    d2 = dims[1][1]
    x = T.inputs(p)
    for bias, loss, y in T.mlp_settings(p):
        ref = C.mlp_reference(p, loss, "type2", bias)
        for reduction in ("mean", "sum"):
            sc = g_scale(loss, reduction, n, d2)
            model = T.mlp_model(p, bias)
            T.check_forward(model, p, bias=bias)
            model = _run(model, T.loss_fn(loss, reduction), x, y, KFLR())
            tag = f"mlp {loss} {reduction} bias={bias} KFLR"
            for i, lin in enumerate((model[0], model[2])):
                g, a = _kf(lin.weight, "kflr")
                a_ref, g_ref = ref[i]
                rep.check(
                    f"{tag} layer{i + 1} A (weight)", a, a_ref[: dims[i][0], : dims[i][0]], TOL
                )
                rep.check(
                    f"{tag} layer{i + 1} G (weight)",
                    g,
                    sc * g_ref,
                    TOL,
                    f"G×{sc:g}" if sc != 1 else "",
                )
                if bias:
                    (gb,) = _kf(lin.bias, "kflr")
                    rep.check(f"{tag} layer{i + 1} G (bias block)", gb, sc * g_ref, TOL)
        # MC (KFAC extension), statistical: average many independent backward passes
        if bias:
            draws = 300
            acc = None
            torch.manual_seed(0)
            for _ in range(draws):
                model = _run(
                    T.mlp_model(p, bias), T.loss_fn(loss, "mean"), x, y, KFAC(mc_samples=1)
                )
                gs = [_kf(lin.weight, "kfac")[0] for lin in (model[0], model[2])]
                acc = gs if acc is None else [u + v for u, v in zip(acc, gs, strict=False)]
            sc = g_scale(loss, "mean", n, d2)
            for i in range(2):
                # MC error ~ c/√(draws·N), c ≤ 2: 0.1 > 3σ
                rep.check(
                    f"mlp {loss} mean bias=True KFAC(mc, {draws} draws) layer{i + 1} G",
                    acc[i] / draws,
                    sc * ref[i][1],
                    0.1,
                    "statistical",
                )
        # KFRA: the recursive approximation differs from K-FAC except at the last layer
        model = _run(T.mlp_model(p, bias), T.loss_fn(loss, "mean"), x, y, KFRA())
        g, a = _kf(model[2].weight, "kfra")
        sc = g_scale(loss, "mean", n, d2)
        rep.check(
            f"mlp {loss} mean bias={bias} KFRA last layer G = K-FAC G (batch-averaged "
            "output Hessian)",
            g,
            sc * ref[1][1],
            TOL,
        )


def run_conv(rep):
    p = C.conv_problem()
    n = p["x"].shape[0]
    kh, kw, c_in, c_out = p["K"].shape
    x = T.inputs(p, conv=True)
    for loss, y, ref in T.conv_settings(p):
        sc = g_scale(loss, "mean", n, p["W"].shape[1])
        model = _run(T.conv_model(p, True), T.loss_fn(loss, "mean"), x, y, KFLR())
        g, a = _kf(model[0].weight, "kflr")
        tq = ref["T"]
        a_kfc = T.conv_a_torch(ref["kfc"][0], kh, kw, c_in, True)[:-1, :-1]
        a_red = T.conv_a_torch(ref["reduce"][0], kh, kw, c_in, True)[:-1, :-1]
        a_exp, g_exp = a_kfc, sc * ref["expand"][1]
        g_red = sc * ref["reduce"][1]
        rep.check(
            f"conv {loss} KFLR conv block kron(G, A) vs KFAC-expand (= KFC)",
            np.kron(g, a),
            np.kron(g_exp, a_exp),
            TOL,
        )
        rep.check(
            f"conv {loss} KFLR conv block kron(G, A) vs KFAC-reduce",
            np.kron(g, a),
            np.kron(g_red, a_red),
            TOL,
        )
        rep.diagnose(
            f"conv {loss} KFLR conv A",
            a,
            {"expand A": a_exp, "|T|·expand A": tq * a_exp, "reduce A": a_red},
            TOL,
        )
        rep.diagnose(
            f"conv {loss} KFLR conv G",
            g,
            {"expand G": g_exp, "reduce G": g_red, "expand G/|T|": g_exp / tq},
            TOL,
        )
        (gb,) = _kf(model[0].bias, "kflr")
        rep.check(f"conv {loss} KFLR conv bias G", gb, sc * ref["reduce"][1], TOL)
    _conv_exactness(rep, p)


def _conv_exactness(rep, p):
    """Linear conv with MSE(sum): expand is exact per location, reduce after pooling."""
    for setting, model, x, y, exact in T.conv_exactness_settings(p):
        try:
            model = _run(model, torch.nn.MSELoss(reduction="sum"), x, y, KFLR())
        except Exception as exc:  # noqa: BLE001
            rep.note(f"conv exactness ({setting})", f"BackPACK raised {type(exc).__name__}: {exc}")
            continue
        g, a = _kf(model[0].weight, "kflr")
        rep.check(
            f"conv exactness ({setting}, linear conv, MSE sum): kron(G, A) == exact GGN",
            np.kron(g, a),
            exact,
            TOL,
            note="expand is exact here" if setting == "per-location" else "reduce is exact here",
        )


def run_dtype_fault(rep):
    """A float64 model with default dtype float32: KFLR through AvgPool2d."""
    p = C.conv_problem()
    kh, kw, c_in, c_out = p["K"].shape
    oh, ow = p["out_hw"]
    x = T.inputs(p, conv=True)
    y = torch.as_tensor(np.random.default_rng(5).standard_normal((x.shape[0], c_out)))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        conv = torch.nn.Conv2d(c_in, c_out, (kh, kw)).double()
        model = torch.nn.Sequential(conv, torch.nn.AvgPool2d((oh, ow)), torch.nn.Flatten())
        _run(model, torch.nn.MSELoss(reduction="sum"), x, y, KFLR())
        rep.note("KFLR through AvgPool2d, float64 model, default dtype float32", "runs")
    except Exception as exc:  # noqa: BLE001 - the failure is the finding
        rep.check(
            "KFLR through AvgPool2d, float64 model, default dtype float32 runs",
            np.array([0.0]),
            np.array([1.0]),
            0,
            note=f"raised {type(exc).__name__}: {str(exc)[:100]}",
        )
    finally:
        torch.set_default_dtype(old)


def main(argv=None):
    import backpack as bp

    version = (f"backpack-for-pytorch {getattr(bp, '__version__', '1.7.1')}, "
               f"torch {torch.__version__}")
    C.run_checks(argv, "backpack", version, run_mlp, run_conv, run_dtype_fault)


if __name__ == "__main__":
    main()
