"""EKFAC (George et al. 2018): curvlinops' ``EKFACLinearOperator`` and nngeometry's
``PMatEKFAC`` against kfac_ref's ``DenseEKFAC`` on a small float64 MLP.

Run from the repository root inside an environment with torch 2.13.0 and one peer
(``curvlinops-for-pytorch`` 3.0.1 or ``nngeometry`` 0.4) and kfac_ref importable::

    python -m conformance.peers.ekfac_check --peer curvlinops [--json out.json]
    python -m conformance.peers.ekfac_check --peer nngeometry [--json out.json]

Each line is ``agree`` / ``DISAGREE`` / ``diagnose`` with the maximum relative error
``max|peer - ref| / max|ref|`` of the dense EKFAC block (PyTorch parameter order
``[W.flatten() (out, in), b]``: kfac_ref's row-major ``[W; b]`` is permuted, see
``torch_common.torch_param_perm``).  ``diagnose`` lines compute the peer's matrix against
deliberately wrong references (scalings projected with the transposed basis
:math:`Q_A X Q_G^\\top` instead of :math:`Q_A^\\top X Q_G`; damping added to the factors
instead of to :math:`s^*`) to show which convention each peer follows.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

import kfac_ref.curvature as KC
import kfac_ref.nn as knn
from kfac_ref.curvature import BlockDiagonalCurvature
from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss

from . import common as C
from . import torch_common as T

TOL = 1e-10  # float64 eigendecompositions of O(1) factors with gaps O(0.01): errors ~1e-13


def ce(f, y):
    return CategoricalLogitsNegativeLogProbLoss(f, targets=y)


def rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def kfac_ref_side(p, mode):
    """EKFAC, K-FAC and exact blocks (canonical order) and the K-FAC factors, per layer."""
    net = knn.Sequential([("d1", knn.Dense(*p["W1"].shape)), ("a", knn.Activation("tanh")),
                          ("d2", knn.Dense(*p["W2"].shape))])
    params = ((p["W1"], p["b1"]), (), (p["W2"], p["b2"]))
    batch = (p["x"], p["y_cls"])
    n = p["x"].shape[0]
    out = {}
    for name, l2b in (("ekfac", {"dense": "ekfac"}), ("kfac", None)):
        est = BlockDiagonalCurvature(net, ce, layer_to_block=l2b)
        st = est.init(None, (params, batch))
        st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, n, None, (params, batch), mode)
        out[name] = (est, st)
    dense_fn = KC.fisher_matrix if mode == "fisher_exact" else KC.empirical_fisher_matrix
    exact = dense_fn(net, ce, params, batch)
    exact_blocks = [exact[net.layer_slices()[i], net.layer_slices()[i]]
                    for i in net.parametric_layers]
    return out, exact_blocks


def to_torch_order(blocks, dims):
    mats = []
    for b, (d_in, d_out) in zip(blocks, dims, strict=True):
        perm = T.torch_param_perm(d_in, d_out, True)
        mats.append(b[np.ix_(perm, perm)])
    return mats


def transposed_basis_ekfac(a, g, f):
    """The P13 mistake: s* from Q_A X Q_Gᵀ (basis transposed) used in the basis Q_A ⊗ Q_G."""
    qa, qg = np.linalg.eigh(a)[1], np.linalg.eigh(g)[1]
    wrong = np.kron(qa.T, qg.T)  # columns: the transposed projection
    q = np.kron(qa, qg)
    s = np.diag(wrong.T @ f @ wrong)
    return (q * s) @ q.T


def factor_damped_inverse(a, g, lam):
    """Damping added to the factors (√λ each) instead of to s* — another convention."""
    r = np.sqrt(lam)
    return np.linalg.inv(np.kron(a + r * np.eye(a.shape[0]), g + r * np.eye(g.shape[0])))


def peer_curvlinops(model, x, y, fisher_type):
    from curvlinops import EKFACLinearOperator

    params = [q for q in model.parameters()]
    op = EKFACLinearOperator(model, T.loss_fn("ce"), params, [(x, y)],
                             fisher_type=fisher_type, separate_weight_and_bias=False,
                             check_deterministic=False)
    dense = op @ torch.eye(sum(q.numel() for q in params), dtype=torch.float64)
    dense = dense.numpy() if isinstance(dense, torch.Tensor) else np.asarray(dense)
    return dense, None


def peer_nngeometry(model, x, y):
    from nngeometry.metrics import FIM
    from nngeometry.object import PMatEKFAC
    from nngeometry.object.vector import PVector
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(x, y), batch_size=x.shape[0])
    F = FIM(model, loader, PMatEKFAC, variant="classif_logits")
    before = F.to_torch().detach().numpy()  # diagonal: K-FAC's eigenvalues s_G ⊗ s_A
    F.update_diag(loader)  # the EKFAC scalings from per-example gradients
    dense = F.to_torch().detach().numpy()

    def solve(vec_flat, lam):
        v = PVector.from_model(model).clone()
        flat = torch.as_tensor(vec_flat)
        # fill in model parameter order
        start, parts = 0, {}
        for name, q in model.named_parameters():
            parts[name] = flat[start:start + q.numel()].view_as(q)
            start += q.numel()
        v = PVector(v.layer_collection, dict_repr={
            lid: tuple(parts[f"{lid}.{w}"] for w in ("weight", "bias"))
            for lid in v.layer_collection.layers})
        return F.solvePVec(v, regul=lam).to_torch().detach().numpy(), F.pow(-1, regul=lam)

    return dense, solve, before


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", choices=("curvlinops", "nngeometry"), required=True)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    p = C.mlp_problem(n=6)
    dims = [p["W1"].shape, p["W2"].shape]
    x, y = T.inputs(p), T.targets(p, "ce")
    model = T.mlp_model(p, True)
    T.check_forward(model, p, bias=True)
    rows = []

    def line(tag, err, status=None, what="max rel err"):
        status = status or ("agree" if err <= TOL else "DISAGREE")
        rows.append({"case": tag, what.replace(" ", "_"): err, "status": status})
        print(f"{status:9s} {tag}: {what} {err:.3g}")

    cases = ([("fisher_exact", "type-2"), ("fisher_empirical", "empirical")]
             if args.peer == "curvlinops" else [("fisher_exact", None)])
    for mode, ftype in cases:
        ref, exact = kfac_ref_side(p, mode)
        (est, st), (kest, kst) = ref["ekfac"], ref["kfac"]
        ekfac = to_torch_order(est.to_diagonal_block_dense_matrix(st), dims)
        kfac = to_torch_order(kest.to_diagonal_block_dense_matrix(kst), dims)
        exact_t = to_torch_order(exact, dims)
        if args.peer == "curvlinops":
            dense, solve = peer_curvlinops(model, x, y, ftype)
            before = None
        else:
            dense, solve, before = peer_nngeometry(model, x, y)
        o = 0
        for li, (e, k, fx) in enumerate(zip(ekfac, kfac, exact_t, strict=True)):
            n = e.shape[0]
            blk = dense[o:o + n, o:o + n]
            o += n
            tag = f"{args.peer} {mode} layer {li + 1} EKFAC"
            line(tag, rel(blk, e))
            if before is not None:
                line(f"{args.peer} {mode} layer {li + 1} PMatEKFAC before update_diag vs K-FAC",
                     rel(before[o - n:o, o - n:o], k), "diagnose")
            a, g = (np.asarray(s.value) for s in kst.blocks_states[li].statistics)
            canon = T.torch_param_perm(*dims[li], True)
            inv = np.argsort(canon)
            fx_c = fx[np.ix_(inv, inv)]
            wrong = transposed_basis_ekfac(a, g, fx_c)[np.ix_(canon, canon)]
            line(f"{tag} vs transposed-basis scalings (P13)", rel(blk, wrong), "diagnose")
            line(f"{tag} vs K-FAC", rel(blk, k), "diagnose")
            line(f"{tag}: ‖F−EKFAC‖_F/‖F−KFAC‖_F (exact block F)",
                 float(np.linalg.norm(fx - blk) / np.linalg.norm(fx - k)), "diagnose", "ratio")
            if solve is not None and li == 0:
                lam = 0.1
                v = np.random.default_rng(1).standard_normal(dense.shape[0])
                got, _ = solve(v, lam)
                # kfac_ref's damped inverse (λ added to s*), block by block
                want, o2 = [], 0
                for m in ekfac:
                    want.append(np.linalg.solve(m + lam * np.eye(m.shape[0]),
                                                v[o2:o2 + m.shape[0]]))
                    o2 += m.shape[0]
                line(f"{args.peer} solvePVec(regul=λ) vs kfac_ref (sB+λI)^-1 v",
                     rel(got, np.concatenate(want)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
