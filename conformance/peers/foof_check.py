"""FOOF (Benzing 2022): curvlinops' ``KFACLinearOperator(fisher_type="forward-only")``
against kfac_ref's :class:`kfac_ref.blocks.kfac_jax.DenseFOOF` and
:class:`kfac_ref.blocks.kfac_jax.Conv2DFOOF` on small float64 networks.

Run inside the ``torchpeers`` environment (recipe ``torchpeers.txt``), from the repository
root::

    python -m conformance.peers.foof_check

Problems: the 3 → 5 → 4 tanh MLP (N = 4) and the conv(2×2, 2 → 3, VALID) → tanh → flatten →
dense net (N = 2, 4×4×2 inputs, |T| = 9) of :mod:`conformance.peers.common`, with and without
biases, ``MSELoss`` and ``CrossEntropyLoss`` with ``reduction="mean"`` and ``"sum"``, and
``separate_weight_and_bias`` True and False.  kfac_ref's blocks come from
:class:`kfac_ref.curvature.BlockDiagonalCurvature` with ``layer_to_block={"dense": "foof",
"conv2d": "foof"}`` (``weight_sharing`` ``"expand"`` and ``"reduce"`` for the conv net).

Layout (as in ``repro_curvlinops.py``): curvlinops' block of a layer is ``kron(G, A)`` on
PyTorch's ``[out, in]`` weight, ``[W.flatten(), b]`` in order, conv ``A`` in unfold order
(channel slowest) and the dense layer after the flatten reads the NCHW flatten; kfac_ref's is
``A ⊗ G`` on the row-major ``[W; b]`` (patch order (kh, kw, C_in)).  Both are permuted here
(:func:`conformance.peers.torch_common.expected_dense`).  With ``separate_weight_and_bias``
curvlinops' bias block is ``G = I`` alone, the bias corner of kfac_ref's block (the
homogeneous coordinate's entry of ``A`` is 1), without the weight–bias cross block.

Scale: curvlinops sets the whole gradient factor to ``I``; its input factor is the mean over
the N·|T| rows (KFAC-expand) or over the N location-averaged rows (KFAC-reduce), the same for
both reductions and both losses (no backward pass).  kfac_ref's dense and reduce blocks are the
same matrices; its conv expand block is ``|T| Ω ⊗ I`` (``fixed_scale() = |T|``, the
KFAC-expand block with Γ replaced by I), i.e. |T| times curvlinops' ``Ω ⊗ I``: compared
with 1/|T| applied, and a control row shows the unconverted ratio.  A second control row
compares curvlinops' type-2 K-FAC with the FOOF reference: it must differ, or the check
would not tell FOOF from K-FAC.
"""

from __future__ import annotations

from importlib.metadata import version

import numpy as np
import torch
from curvlinops import KFACLinearOperator

import kfac_ref.nn as knn
from kfac_ref.curvature import BlockDiagonalCurvature
from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss

from . import common as C
from . import torch_common as T

TOL = 1e-12  # float64 GEMMs of length ≤ 18 on O(1) data (errors ~1e-16)


def _ce(f, y):
    return CategoricalLogitsNegativeLogProbLoss(f, targets=y)


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _kfac_ref_blocks(net, params, batch, weight_sharing="expand"):
    """(A, G, fixed_scale) per layer of kfac_ref's FOOF blocks, and the blocks' classes."""
    est = BlockDiagonalCurvature(net, _ce, layer_to_block={"dense": "foof", "conv2d": "foof"},
                                 weight_sharing=weight_sharing)
    st = est.init(None, (params, batch))
    n = batch[0].shape[0]
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, n, None, (params, batch),
                                              "ggn_exact")
    out = []
    for blk, bst in zip(est.blocks, st.blocks_states, strict=True):
        a, g = (np.asarray(f.value) for f in bst.statistics)
        out.append((a, g, float(blk.fixed_scale())))
        # the block's own dense matrix is s·A⊗G (guards the factor read-out)
        assert _rel(np.asarray(blk.to_dense_matrix(bst)), out[-1][2] * np.kron(a, g)) < TOL
    return out, [type(b).__name__ for b in est.blocks]


def _curvlinops(model, loss, reduction, x, y, sep, **kw):
    params = [q for q in model.parameters() if q.requires_grad]
    op = KFACLinearOperator(model, T.loss_fn(loss, reduction), params, [(x, y)],
                            check_deterministic=False, separate_weight_and_bias=sep, **kw)
    op.compute_kronecker_factors()
    dim = sum(q.numel() for q in params)
    dense = (op @ torch.eye(dim, dtype=torch.float64)).detach().numpy()
    return op, dense


def _mlp_net(p, bias):
    d0, d1 = p["W1"].shape
    d2 = p["W2"].shape[1]
    net = knn.Sequential([("d1", knn.Dense(d0, d1, use_bias=bias)),
                          ("a", knn.Activation("tanh")),
                          ("d2", knn.Dense(d1, d2, use_bias=bias))])
    params = (((p["W1"], p["b1"]) if bias else (p["W1"],)), (),
              ((p["W2"], p["b2"]) if bias else (p["W2"],)))
    return net, params


def _conv_net(p, bias):
    kh, kw, c_in, c_out = p["K"].shape
    d_flat, classes = p["W"].shape
    net = knn.Sequential([("c", knn.Conv2D(c_in, c_out, (kh, kw), use_bias=bias)),
                          ("a", knn.Activation("tanh")), ("f", knn.Flatten()),
                          ("d", knn.Dense(d_flat, classes, use_bias=bias))])
    params = (((p["K"], p["bc"]) if bias else (p["K"],)), (), (),
              ((p["W"], p["b"]) if bias else (p["W"],)))
    return net, params


def _homog_perm(perm, bias):
    return np.concatenate([perm, [len(perm)]]) if bias else perm


def _factor_rows(rows, tag, op, names, factors, bias, sep):
    """A row for each layer's A and G = I of curvlinops' operator ``op`` (its modules
    ``names``) against kfac_ref's ``factors``: A without the bias coordinate where the bias is
    a separate block (``sep``)."""
    for name, (a, g) in zip(names, factors, strict=True):
        a_t = a if (bias and not sep) or not bias else a[:-1, :-1]
        rows.append((f"{tag} layer {name} A",
                     _rel(op._input_covariances[name].numpy(), a_t)))
        rows.append((f"{tag} layer {name} G = I",
                     _rel(op._gradient_covariances[name].numpy(), g)))


def run_mlp(rows):
    p = C.mlp_problem()
    dims = [p["W1"].shape, p["W2"].shape]
    for bias in (True, False):
        net, params = _mlp_net(p, bias)
        model = T.mlp_model(p, bias)
        T.check_forward(model, p, bias=bias)
        ref, kinds = _kfac_ref_blocks(net, params, (p["x"], p["y_cls"]))
        assert kinds == ["DenseFOOF", "DenseFOOF"], kinds
        factors = [(a, g) for a, g, s in ref]
        assert all(s == 1.0 for _, _, s in ref)
        for loss in ("mse", "ce"):
            for reduction in ("mean", "sum"):
                for sep in ((True, False) if bias else (True,)):
                    op, dense = _curvlinops(model, loss, reduction, T.inputs(p),
                                            T.targets(p, loss), sep, fisher_type="forward-only")
                    tag = f"MLP bias={bias} {loss}({reduction}) separate={sep}"
                    _factor_rows(rows, tag, op, ("0", "2"), factors, bias, sep)
                    rows.append((f"{tag} dense (op @ I)",
                                 _rel(dense, T.expected_dense(factors, dims, bias, sep))))
        op, dense = _curvlinops(model, "ce", "mean", T.inputs(p), T.targets(p, "ce"), True,
                                fisher_type="type-2")
        rows.append((f"MLP bias={bias} control: curvlinops type-2 K-FAC vs FOOF (must differ)",
                     -_rel(dense, T.expected_dense(factors, dims, bias, True))))


def run_conv(rows):
    p = C.conv_problem()
    kh, kw, c_in, c_out = p["K"].shape
    oh, ow = p["out_hw"]
    n_loc = oh * ow
    d_flat, classes = p["W"].shape
    dims = [(kh * kw * c_in, c_out), (d_flat, classes)]
    for bias in (True, False):
        net, params = _conv_net(p, bias)
        model = T.conv_model(p, bias)
        T.check_forward(model, p, conv=True, bias=bias)
        # kfac_ref (NHWC, patch order (i, j, c), NHWC flatten) → PyTorch order
        conv_perm = _homog_perm(C.torch_conv_perm(kh, kw, c_in), bias)
        flat_perm = _homog_perm(C.torch_flatten_perm(oh, ow, c_out), bias)
        for sharing, approx in (("expand", "expand"), ("reduce", "reduce")):
            ref, kinds = _kfac_ref_blocks(net, params, (p["x"], p["y_cls"]), sharing)
            want = ["Conv2DFOOF" if sharing == "expand" else "ReducedConv2DFOOF", "DenseFOOF"]
            assert kinds == want, kinds
            (ac, gc, sc), (ad, gd, sd) = ref
            assert sc == (n_loc if sharing == "expand" else 1.0) and sd == 1.0
            ac_t = ac[np.ix_(conv_perm, conv_perm)]
            ad_t = ad[np.ix_(flat_perm, flat_perm)]
            # kfac_ref's blocks are s·A⊗I: curvlinops' conv Ω ⊗ I is kfac_ref's block / |T|
            # (expand, s = |T|); the reduce and dense blocks as they are (s = 1)
            factors = [(ac_t, gc), (ad_t, gd)]
            for loss in ("mse", "ce"):
                for reduction in ("mean", "sum"):
                    for sep in ((True, False) if bias else (True,)):
                        op, dense = _curvlinops(model, loss, reduction, T.inputs(p, conv=True),
                                                T.targets(p, loss), sep,
                                                fisher_type="forward-only", kfac_approx=approx)
                        tag = f"conv {approx} bias={bias} {loss}({reduction}) separate={sep}"
                        _factor_rows(rows, tag, op, ("0", "3"), factors, bias, sep)
                        rows.append((f"{tag} dense (op @ I)"
                                     + (f", kfac_ref's conv block × 1/|T| = 1/{n_loc}"
                                        if sharing == "expand" else ""),
                                     _rel(dense, T.expected_dense(factors, dims, bias, sep))))
            if sharing == "expand":
                op, dense = _curvlinops(model, "ce", "mean", T.inputs(p, conv=True),
                                        T.targets(p, "ce"), True, fisher_type="forward-only")
                unconverted = [(sc * ac_t, gc), (ad_t, gd)]
                rows.append((f"conv expand bias={bias} control: without the 1/|T| "
                             f"(must differ)",
                             -_rel(dense, T.expected_dense(unconverted, dims, bias, True))))


def main():
    rows = []
    run_mlp(rows)
    run_conv(rows)
    print(f"curvlinops-for-pytorch {version('curvlinops-for-pytorch')}, torch {torch.__version__}; "
          f"fisher_type='forward-only'")
    return C.print_verdicts(rows, TOL)


if __name__ == "__main__":
    raise SystemExit(main())
