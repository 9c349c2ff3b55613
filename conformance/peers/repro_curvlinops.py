"""Reproduction: curvlinops (curvlinops-for-pytorch 3.0.1) against kfac_ref, float64.

Run inside the ``torchpeers`` environment (recipe ``torchpeers.txt``), from the repository root::

    python -m conformance.peers.repro_curvlinops [--json out.json]

Conventions applied to the reference before comparing (curvlinops' docs and curvlinops/kfac.py):
PyTorch weight [out, in] flattened row-major, so the weight block is ``kron(G, A)``; the
dense-matrix parameter order is ``[W.flatten(), b]`` per layer (NOT ``vec_r([W b])``: the bias
is a trailing segment); ``separate_weight_and_bias=True`` (default) gives a weight block
``kron(G, A_w)`` (A without the homogeneous coordinate) and a bias block ``G``; G is the
curvature of the loss as reduced by PyTorch (``sum`` → N·G_ref; ``MSELoss`` is ``‖f−y‖²`` so
its Hessian is 2I; ``MSELoss(reduction='mean')`` also divides by C).
"""

from __future__ import annotations

import numpy as np
import torch
from curvlinops import (
    EKFACLinearOperator,
    GGNLinearOperator,
    KFACInverseLinearOperator,
    KFACLinearOperator,
)

from kfac_ref import linalg as L

from . import common as C
from . import torch_common as T

TOL = 1e-12  # float64 GEMMs on O(1) data (errors ~1e-15); far below any convention's effect
TOL_INV = 1e-10  # damped inverses, κ ≤ ~1e3 at the dampings used


def _op(model, loss_mod, x, y, **kw):
    params = [q for q in model.parameters() if q.requires_grad]
    op = KFACLinearOperator(model, loss_mod, params, [(x, y)], check_deterministic=False, **kw)
    op.compute_kronecker_factors()
    return op, params


def _factor(op, name, which):
    d = op._input_covariances if which == "A" else op._gradient_covariances
    return d[name].detach().numpy()


def _dense(op, n_params):
    return (op @ torch.eye(n_params, dtype=torch.float64)).detach().numpy()


def g_scale(loss, reduction, n, c, fisher="type2"):
    """Factor by which curvlinops' G should exceed the reference G (mean of ½‖·‖² / CE).

    Type-2/MC: curvature of the loss as PyTorch reduces it (×N for sum; MSELoss = ‖f−y‖² has
    Hessian 2I, and its mean also divides by C).  Empirical: the gradient of ‖f−y‖² is 2(f−y),
    so the outer product carries 4; curvlinops then scales by the reduction factor R linearly
    (R = 1/(N·C) for MSELoss(mean), documented via ``_maybe_adjust_loss_scale``), i.e.
    EF(mean) = EF(sum)/(N·C) = (4/C)·EF_ref.  (Squaring the per-example loss ‖f−y‖²/C instead
    would give 4/C²; see FINDINGS.md.)"""
    s = n if reduction == "sum" else 1.0
    if loss == "mse":
        s *= 4.0 if fisher == "empirical" else 2.0
        if reduction == "mean":
            s /= c  # MSELoss(mean) also averages over the C outputs
    return s


def run_mlp(rep):
    p = C.mlp_problem()
    n, (d0, d1, d2) = p["x"].shape[0], (p["W1"].shape[0], p["W1"].shape[1], p["W2"].shape[1])
    dims = [(d0, d1), (d1, d2)]
    x = T.inputs(p)
    for bias in (True, False):
        model = T.mlp_model(p, bias)
        T.check_forward(model, p, bias=bias)
        names = ["0", "2"]
        for loss in ("mse", "ce"):
            y = T.targets(p, loss)
            for reduction in ("mean", "sum"):
                for fisher, ft in (("type2", "type-2"), ("empirical", "empirical")):
                    sc = g_scale(loss, reduction, n, d2, fisher)
                    ref = C.mlp_reference(p, loss, fisher, bias)
                    for separate in (True, False) if bias else (True,):
                        tag = f"mlp {loss} {reduction} bias={bias} {ft} sep={separate}"
                        op, params = _op(
                            model,
                            T.loss_fn(loss, reduction),
                            x,
                            y,
                            fisher_type=ft,
                            separate_weight_and_bias=separate,
                        )
                        conv = f"G×{sc:g}" if sc != 1 else ""
                        for i, (a_ref, g_ref) in enumerate(ref):
                            a = _factor(op, names[i], "A")
                            a_exp = (
                                a_ref[: dims[i][0], : dims[i][0]] if (bias and separate) else a_ref
                            )
                            rep.check(f"{tag} layer{i + 1} A", a, a_exp, TOL)
                            rep.check(
                                f"{tag} layer{i + 1} G",
                                _factor(op, names[i], "G"),
                                sc * g_ref,
                                TOL,
                                conv,
                            )
                        npar = sum(q.numel() for q in params)
                        rep.check(
                            f"{tag} dense (op @ I)",
                            _dense(op, npar),
                            sc * T.expected_dense(ref, dims, bias, separate),
                            TOL,
                            "kron(G,A), [W.flatten(), b]"
                            + (", bias block G" if separate and bias else ""),
                        )
                        if fisher == "type2" and reduction == "mean" and not separate:
                            _check_inverse(rep, tag, op, params, ref, dims, bias, sc)
                        if (
                            fisher == "type2"
                            and reduction == "mean"
                            and separate == (not bias)
                            and loss == "mse"
                        ):
                            # exactness: last layer of a tanh MLP with squared error
                            ggn = GGNLinearOperator(
                                model,
                                T.loss_fn(loss, reduction),
                                params,
                                [(x, y)],
                                check_deterministic=False,
                            )
                            gd = _dense(ggn, npar)
                            kd = _dense(op, npar)
                            o = dims[0][0] * dims[0][1] + (dims[0][1] if bias else 0)
                            rep.check(
                                f"{tag} last layer KFAC == exact GGN (curvlinops' own)",
                                kd[o:, o:],
                                gd[o:, o:],
                                TOL,
                                "exactness",
                            )
    # MC Fisher: statistical check with many samples
    model = T.mlp_model(p, True)
    for loss in ("mse", "ce"):
        y = T.targets(p, loss)
        op, _ = _op(model, T.loss_fn(loss, "mean"), x, y, fisher_type="mc", mc_samples=2000)
        ref = C.mlp_reference(p, loss, "type2", True)
        sc = g_scale(loss, "mean", n, d2)
        for i, (_, g_ref) in enumerate(ref):
            # relative MC error ~ 1/√(2000·4) ≈ 0.011 (times a constant ≤ 2): 0.06 is > 4σ
            rep.check(
                f"mlp {loss} mean mc(2000 samples) layer{i + 1} G",
                _factor(op, names[i], "G"),
                sc * g_ref,
                0.06,
                "statistical",
            )


def _check_inverse(rep, tag, op, params, ref, dims, bias, sc):
    rng = np.random.default_rng(7)
    vs = [rng.standard_normal(tuple(q.shape)) for q in params]
    vt = [torch.as_tensor(v) for v in vs]
    lam = 0.1
    for style in ("heuristic", "exact", "both"):
        kw = {"use_heuristic_damping": style == "heuristic", "use_exact_damping": style == "exact"}
        inv = KFACInverseLinearOperator(op, damping=lam, **kw)
        got = np.concatenate([t.detach().numpy().ravel() for t in inv @ vt])

        def solve(a, g, m, style=style):
            a_c, g_c = a, sc * g  # canonical [in(+1), out] vector layout
            if style == "both":
                return (
                    np.linalg.inv(a_c + lam * np.eye(len(a_c)))
                    @ m
                    @ np.linalg.inv(g_c + lam * np.eye(len(g_c)))
                )
            return np.asarray(
                L.kron_damped_inverse_matvec(
                    a_c,
                    g_c,
                    m,
                    lam,
                    damping_method="factored" if style == "heuristic" else "exact",
                )
            )

        rep.check(
            f"{tag} KFACInverseLinearOperator(λ={lam}, {style})",
            got,
            T.per_layer_solve(ref, dims, vs, bias, solve),
            TOL_INV,
            {
                "heuristic": "π-split",
                "exact": "exact damping",
                "both": "λ on both factors (no π): reference computed with plain inverses",
            }[style],
        )


def run_conv(rep):
    p = C.conv_problem()
    n = p["x"].shape[0]
    kh, kw, c_in, c_out = p["K"].shape
    x = T.inputs(p, conv=True)
    model = T.conv_model(p, True)
    T.check_forward(model, p, conv=True)
    for loss, y, ref in T.conv_settings(p):
        sc = g_scale(loss, "mean", n, p["W"].shape[1])
        for approx in ("expand", "reduce"):
            op, params = _op(
                model,
                T.loss_fn(loss, "mean"),
                x,
                y,
                fisher_type="type-2",
                kfac_approx=approx,
                separate_weight_and_bias=False,
            )
            a_ref, g_ref = ref[approx]
            a = _factor(op, "0", "A")
            rep.check(
                f"conv {loss} {approx} conv A (unfold order)",
                a,
                T.conv_a_torch(a_ref, kh, kw, c_in, True),
                TOL,
            )
            rep.check(
                f"conv {loss} {approx} conv G",
                _factor(op, "0", "G"),
                sc * g_ref,
                TOL,
                f"G×{sc:g}" if sc != 1 else "",
            )
    for setting, model_e, xe, ye, exact in T.conv_exactness_settings(p):
        params_e = list(model_e.parameters())
        ggn = _dense(
            GGNLinearOperator(
                model_e,
                torch.nn.MSELoss(reduction="sum"),
                params_e,
                [(xe, ye)],
                check_deterministic=False,
            ),
            exact.shape[0],
        )
        rep.check(
            f"conv exactness ({setting}): curvlinops GGN == NumPy exact GGN",
            ggn,
            exact,
            TOL,
            "validates the oracle",
        )
        approx = "expand" if setting == "per-location" else "reduce"
        op, _ = _op(
            model_e,
            torch.nn.MSELoss(reduction="sum"),
            xe,
            ye,
            fisher_type="type-2",
            kfac_approx=approx,
        )
        rep.check(
            f"conv exactness ({setting}): KFAC-{approx} == exact GGN",
            _dense(op, exact.shape[0]),
            exact,
            TOL,
            "exactness",
        )
    # known fault (FINDINGS.md, curvlinops): MSE on a conv output in NCHW takes the last axis
    # as the event axis
    model1 = torch.nn.Sequential(torch.nn.Conv2d(c_in, c_out, (kh, kw))).double()
    with torch.no_grad():
        model1[0].weight.copy_(T.t(np.transpose(p["K"], (3, 2, 0, 1))))
        model1[0].bias.copy_(T.t(p["bc"]))
    oh, ow = p["out_hw"]
    yy = torch.as_tensor(np.random.default_rng(2).standard_normal((n, c_out, oh, ow)))
    try:
        op, _ = _op(
            model1,
            torch.nn.MSELoss(reduction="sum"),
            x,
            yy,
            fisher_type="type-2",
            kfac_approx="expand",
            separate_weight_and_bias=False,
        )
        g = _factor(op, "0", "G")
        # truth for one linear conv with Σ‖f−y‖²: every output coordinate has Hessian 2, per
        # location the gradient covariance over N·T rows sums to 2·N·T·I/…; expand G (sum) =
        # Σ_{n,t} Σ_c (2 e_c)(e_c)ᵀ·… = 2·N·T·I_Cout
        rep.check(
            "conv-only NCHW MSE(sum) expand G = 2·N·|T|·I (full rank)",
            g,
            2.0 * n * oh * ow * np.eye(c_out),
            TOL,
            note=f"rank(G)={np.linalg.matrix_rank(g)}, G={np.round(g, 6).tolist()}",
        )
    except Exception as exc:  # noqa: BLE001
        rep.note("conv-only NCHW MSE", f"curvlinops raised {type(exc).__name__}: {exc}")


def run_ekfac(rep):
    """EKFAC: eigenvalue corrections s* = diag(Qᵀ F Q) for N = 1 (KFE diagonal of the exact
    per-example GGN) — compared through the dense operator against a NumPy construction."""
    p = C.mlp_problem(n=1)
    x = T.inputs(p)
    model = T.mlp_model(p, True)
    dims = [(p["W1"].shape[0], p["W1"].shape[1]), (p["W2"].shape[0], p["W2"].shape[1])]
    for loss in ("mse", "ce"):
        y = T.targets(p, loss)
        params = list(model.parameters())
        try:
            op = EKFACLinearOperator(
                model,
                T.loss_fn(loss, "sum"),
                params,
                [(x, y)],
                fisher_type="type-2",
                separate_weight_and_bias=False,
                check_deterministic=False,
            )
        except Exception as exc:  # noqa: BLE001
            rep.note(f"ekfac {loss}", f"{type(exc).__name__}: {exc}")
            continue
        npar = sum(q.numel() for q in params)
        got = _dense(op, npar)
        sc = g_scale(loss, "sum", 1, dims[1][1])
        ref = C.mlp_reference(p, loss, "type2", True)
        ex = C.mlp_exact_ggn_blocks(p, loss, True)
        exp_blocks = []
        for (a, g), e, (d_in, d_out) in zip(ref, ex, dims, strict=False):
            _, qa = np.linalg.eigh(a)
            _, qg = np.linalg.eigh(sc * g)
            q = np.kron(qa, qg)
            s = np.diag(q.T @ (sc * e) @ q)
            blk = q @ np.diag(s) @ q.T
            perm = T.torch_param_perm(d_in, d_out, True)
            exp_blocks.append(blk[np.ix_(perm, perm)])
        exp = np.zeros_like(got)
        o = 0
        for b in exp_blocks:
            exp[o : o + len(b), o : o + len(b)] = b
            o += len(b)
        rep.check(
            f"ekfac {loss} N=1 dense = Q diag(Qᵀ F Q) Qᵀ",
            got,
            exp,
            1e-10,
            "N=1: K-FAC is exact, so EKFAC = exact GGN block",
        )


def run_ef_per_term(rep):
    """EFLinearOperator on a weight-shared linear layer with per-position squared error
    ([N, S, C] outputs, MSELoss(sum)): per loss term (n, s) or per example n?"""
    from curvlinops import EFLinearOperator

    rng = np.random.default_rng(17)
    n, s_len, d, c = 3, 4, 3, 2
    x = rng.standard_normal((n, s_len, d))
    w = rng.standard_normal((c, d))
    b = rng.standard_normal(c)
    y = rng.standard_normal((n, s_len, c))
    lin = torch.nn.Linear(d, c).double()
    with torch.no_grad():
        lin.weight.copy_(torch.as_tensor(w))
        lin.bias.copy_(torch.as_tensor(b))
    op = EFLinearOperator(
        lin,
        torch.nn.MSELoss(reduction="sum"),
        [lin.weight, lin.bias],
        [(torch.as_tensor(x), torch.as_tensor(y))],
        check_deterministic=False,
    )
    got = _dense(op, c * d + c)
    r = 2.0 * (x @ w.T + b - y)  # gradient of ‖f − y‖² per position, [N, S, C]
    g_pos = np.concatenate([np.einsum("nsc,nsi->nsci", r, x).reshape(n, s_len, -1), r], -1)
    per_term = np.einsum("nsp,nsq->pq", g_pos, g_pos)
    g_ex = g_pos.sum(1)
    per_example = g_ex.T @ g_ex
    rep.diagnose(
        "EFLinearOperator, [N, S, C] outputs",
        got,
        {
            "per loss term Σ_{n,s} ∇ℓ_ns∇ℓ_nsᵀ": per_term,
            "per example Σ_n (Σ_s∇ℓ_ns)(Σ_s∇ℓ_ns)ᵀ (reference)": per_example,
        },
        TOL,
    )


def main(argv=None):
    import curvlinops

    version = (f"curvlinops {getattr(curvlinops, '__version__', '3.0.1')}, "
               f"torch {torch.__version__}")
    C.run_checks(argv, "curvlinops", version, run_mlp, run_conv, run_ekfac, run_ef_per_term)


if __name__ == "__main__":
    main()
