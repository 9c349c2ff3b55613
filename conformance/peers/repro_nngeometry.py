"""Reproduction: nngeometry (0.4) against kfac_ref, float64.

Run inside the ``torchpeers`` environment, from the repository root::

    python -m conformance.peers.repro_nngeometry [--json out.json]

nngeometry: ``FIM(model, loader, PMatKFAC, variant="classif_logits" | "regression")``;
``F.data[layer_id] == (A, G)`` with the homogeneous coordinate LAST in A and a scale split
``A·s``, ``G/s`` (see :func:`split_scale`; the product is the ordinary K-FAC block);
``F.to_torch()`` is ``kron(G, A)`` in PyTorch parameter order ``[W.flatten(), b]``;
``F.solvePVec(v, regul=λ)`` is the π-split damped inverse.  The default dtype must be float64
(``torch_common`` sets it).
"""

from __future__ import annotations

import numpy as np
import torch
from nngeometry.metrics import FIM
from nngeometry.object import PMatKFAC
from nngeometry.object.vector import PVector
from torch.utils.data import DataLoader, TensorDataset

from kfac_ref import linalg as L

from . import common as C
from . import torch_common as T

TOL = 1e-12  # float64 GEMMs on O(1) data (errors ~1e-15); far below any convention's effect
TOL_INV = 1e-10


def split_scale(loss, n_classes):
    """nngeometry accumulates A once per column of its output-space square root and divides by
    N/√n, G by N·√n (torch_hooks.py), so A = √n·A_ref and G = G_ref/√n with n the number of
    columns: C for "regression", C − 1 for "classif_logits" (its triangular square root of
    diag(p) − p pᵀ has C − 1 columns).  The product kron(G, A) is unaffected."""
    return np.sqrt(n_classes if loss == "mse" else n_classes - 1)


def _fim(model, x, y, loss, rep=PMatKFAC):
    loader = DataLoader(TensorDataset(x, y), batch_size=x.shape[0])
    return FIM(model, loader, rep, variant="regression" if loss == "mse" else "classif_logits")


def run_mlp(rep):
    p = C.mlp_problem()
    dims = C.mlp_dims(p)
    d2 = dims[1][1]
    x = T.inputs(p)
    for bias, loss, y in T.mlp_settings(p):
        model = T.mlp_model(p, bias)
        T.check_forward(model, p, bias=bias)
        try:
            F = _fim(model, x, y, loss)
        except Exception as exc:  # noqa: BLE001
            rep.note(
                f"mlp {loss} bias={bias}", f"nngeometry raised {type(exc).__name__}: {exc}"
            )
            continue
        ref = C.mlp_reference(p, loss, "type2", bias)
        tag = f"mlp {loss} bias={bias} PMatKFAC"
        layer_ids = list(F.generator.layer_collection.layers.keys())
        for i, lid in enumerate(layer_ids):
            a, g = (m.detach().numpy() for m in F.data[lid])
            a_ref, g_ref = ref[i]
            s = split_scale(loss, d2)
            rep.check(
                f"{tag} layer{i + 1} A (homog last)", a, s * a_ref, TOL, "A·s (scale split)"
            )
            rep.check(f"{tag} layer{i + 1} G", g, g_ref / s, TOL, "G/s (scale split)")
            rep.check(
                f"{tag} layer{i + 1} kron(G, A) == kron(G_ref, A_ref)",
                np.kron(g, a),
                np.kron(g_ref, a_ref),
                TOL,
            )
        dense = F.to_torch().detach().numpy()
        rep.check(
            f"{tag} to_torch() dense",
            dense,
            T.expected_dense(ref, dims, bias, False),
            TOL,
            "kron(G,A), [W.flatten(), b]",
        )
        _check_solve(rep, tag, F, model, ref, dims, bias)


def _check_solve(rep, tag, F, model, ref, dims, bias):
    rng = np.random.default_rng(8)
    lam = 0.1
    params = list(model.parameters())
    vs = [rng.standard_normal(tuple(q.shape)) for q in params]
    vec = PVector(
        F.generator.layer_collection,
        vector_repr=torch.as_tensor(np.concatenate([v.ravel() for v in vs])),
    )
    try:
        out = F.solvePVec(vec, regul=lam).to_torch().detach().numpy()
    except Exception as exc:  # noqa: BLE001
        rep.note(f"{tag} solvePVec", f"nngeometry raised {type(exc).__name__}: {exc}")
        return
    s = split_scale("mse" if "mse" in tag else "ce", dims[-1][1])

    def solve(a, g, m):
        # the peer's own factors carry the √n split; π absorbs it, so the π-split inverse of
        # (s·A) ⊗ (G/s) equals that of A ⊗ G
        return np.asarray(L.kron_damped_inverse_matvec(s * a, g / s, m, lam))

    rep.check(
        f"{tag} solvePVec(regul={lam}) = π-split damped inverse",
        out,
        T.per_layer_solve(ref, dims, vs, bias, solve),
        TOL_INV,
        "factored π-split damping",
    )


def run_conv(rep):
    p = C.conv_problem()
    kh, kw, c_in, c_out = p["K"].shape
    x = T.inputs(p, conv=True)
    for loss, y, ref in T.conv_settings(p):
        model = T.conv_model(p, True)
        try:
            F = _fim(model, x, y, loss)
        except Exception as exc:  # noqa: BLE001
            rep.note(f"conv {loss}", f"nngeometry raised {type(exc).__name__}: {exc}")
            continue
        lid = list(F.generator.layer_collection.layers.keys())[0]
        a, g = (m.detach().numpy() for m in F.data[lid])
        a_exp = T.conv_a_torch(ref["expand"][0], kh, kw, c_in, True)
        a_red = T.conv_a_torch(ref["reduce"][0], kh, kw, c_in, True)
        rep.check(
            f"conv {loss} PMatKFAC conv block kron(G, A) vs KFAC-expand",
            np.kron(g, a),
            np.kron(ref["expand"][1], a_exp),
            TOL,
        )
        tq = ref["T"]
        s = split_scale(loss, p["W"].shape[1])
        rep.diagnose(
            f"conv {loss} PMatKFAC conv A",
            a,
            {
                "s·expand A (Σ/(N|T|))": s * a_exp,
                "s·|T|·expand A (Σ/N)": s * tq * a_exp,
                "s·reduce A": s * a_red,
            },
            TOL,
        )
        rep.diagnose(
            f"conv {loss} PMatKFAC conv G",
            g,
            {
                "expand G/s": ref["expand"][1] / s,
                "KFC G/s (/(N|T|))": ref["kfc"][1] / s,
                "reduce G/s": ref["reduce"][1] / s,
            },
            TOL,
        )


def run_faults(rep):
    """Known fault: with the default dtype float32, a float64 model crashes or gives float32
    factors, and a failure leaves hooks on the model."""
    p = C.mlp_problem()
    x = T.inputs(p)
    old = torch.get_default_dtype()
    for loss in ("mse", "ce"):
        y = T.targets(p, loss)
        model = T.mlp_model(p, True)
        torch.set_default_dtype(torch.float32)
        try:
            F = _fim(model, x, y, loss)
            a, g = F.data[list(F.generator.layer_collection.layers.keys())[1]]
            rep.check(
                f"default dtype float32, float64 model ({loss}): factor dtype is float64",
                np.array([a.dtype == torch.float64, g.dtype == torch.float64], float),
                np.ones(2),
                0,
                note=f"got {a.dtype}, {g.dtype}",
            )
        except Exception as exc:  # noqa: BLE001
            rep.note(
                f"default dtype float32, float64 model ({loss})",
                f"nngeometry raised {type(exc).__name__}: {str(exc)[:120]}",
            )
        finally:
            torch.set_default_dtype(old)
        hooks = sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
            for m in model.modules()
        )
        rep.check(
            f"default dtype float32 ({loss}): no hooks left on the model afterwards",
            np.array([hooks], float),
            np.zeros(1),
            0,
            note=f"{hooks} hooks left",
        )


def main(argv=None):
    import importlib.metadata as md

    version = f"nngeometry {md.version('nngeometry')}, torch {torch.__version__}"
    C.run_checks(argv, "nngeometry", version, run_mlp, run_conv, run_faults)


if __name__ == "__main__":
    main()
