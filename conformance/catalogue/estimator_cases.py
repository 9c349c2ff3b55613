"""Estimator capabilities: the block-diagonal K-FAC estimator's moving-average semantics over
several batches, and its estimation modes.

``estimator.kfac_ema`` runs kfac-jax's ``update_curvature_matrix_estimate`` twice, with
``ema_old = params["decay"]``, ``ema_new = 1``: every factor becomes the zero-debiased average
``(d·F(batch 0) + F(batch 1)) / (d + 1)`` and the K-FAC matrix is built from the averaged
factors — *not* the average of the two batches' K-FAC matrices (a different matrix: a
Kronecker product does not commute with averaging; see the docs page *K-FAC for dense
layers*, "Statistics across steps").

Inputs: the network parameters as in :mod:`networks_cases` plus two batches ``x0, targets0,
x1, targets1``.  Tolerance: as for ``networks.kfac``, ×2 for the two updates.
"""

from __future__ import annotations

import numpy as np

from ..model import SAFETY, Capability, Case, Tolerance
from ._data import to_np
from .networks_cases import (
    _CONV,
    _dense,
    _kfac_matrix,
    _layer_geometry,
    _make_inputs,
    _tanh,
    build_net,
    loss_fn,
    one_update,
    params_from_inputs,
)

REQUIRES = ("kfac_ref.nn", "kfac_ref.curvature", "kfac_ref.losses")


def kfac_two_batches(params, inputs, to_backend=lambda v: v, to_numpy=to_np, decays=None):
    """K-FAC after the EMA updates with the batches of ``inputs`` (kfac_ref)."""
    from kfac_ref.curvature import BlockDiagonalCurvature

    spec = params["net"]
    net = build_net(spec)
    theta = params_from_inputs(spec, inputs, to_backend)
    est = BlockDiagonalCurvature(net, loss_fn(params))
    rng = np.random.default_rng(0)
    batches = [(to_backend(inputs[f"x{i}"]), to_backend(inputs[f"targets{i}"]))
               for i in range(2)]
    st = est.init(rng, (theta, batches[0]))
    for batch, decay in zip(batches, decays or (0.0, params["decay"]), strict=True):
        st = est.update_curvature_matrix_estimate(st, decay, 1.0, int(batch[0].shape[0]), rng,
                                                  (theta, batch), params["mode"])
    return to_numpy(est.to_dense_matrix(st))


#: kfac-jax block classes whose dense-layer blocks estimator.full_blocks covers
FULL_BLOCKS = ("DenseFull", "NaiveFull", "DenseDiagonal", "NaiveDiagonal")


def full_blocks_matrix(params, inputs, to_backend=lambda v: v, to_numpy=to_np, block=None):
    """Block-diagonal curvature (dense [P, P]) with every dense layer's block of
    ``params["block"]`` after one update in ``params["mode"]`` (kfac_ref)."""
    from kfac_ref.blocks import kfac_jax as kj

    est, st = one_update(params, inputs, to_backend,
                         layer_to_block={"dense": getattr(kj, block or params["block"])})
    return to_numpy(est.to_dense_matrix(st))


def _ema_kfac(arr, case, conv):
    out = _kfac_matrix(arr, case, conv)
    if conv.ema_style == "raw":
        # raw weighted sums: every factor is W = d + 1 times its average, a block W² times
        out = out * (case.params["decay"] + 1.0) ** 2
    return out


CAPABILITIES = [
    Capability(
        "estimator.kfac_ema",
        "Block-diagonal K-FAC (dense [P, P]) after two estimator updates with batches 0 and 1, "
        "ema_old = decay, ema_new = 1 (kfac-jax WeightedMovingAverage = TF's zero-debiased "
        "EMA with weight 1): K-FAC of the averaged factors.",
        "inputs: x0, targets0, x1, targets1, w{i}, b{i}; params: net, loss, variance, mode, "
        "decay",
        _CONV + ("empirical_fisher_scale", "ema_style"), convert_output=_ema_kfac),
    Capability(
        "estimator.full_blocks",
        "Block-diagonal curvature (dense [P, P]) after one update in params['mode'] with every "
        "dense layer's block of the kfac-jax class params['block']: DenseFull / NaiveFull = "
        "the layer's exact block (1/N)Σ_n ĝ_n ĝ_nᵀ of per-example parameter gradients (the "
        "block diagonal of the exact GGN / empirical Fisher), DenseDiagonal / NaiveDiagonal = "
        "its diagonal.",
        "inputs: x, targets, w{i}, b{i}; params: net, loss, variance, mode, block",
        _CONV + ("empirical_fisher_scale",), convert_output=_kfac_matrix),
]


def _network_tolerance(spec, x_shape, n_out, gemms, updates=1):
    """The tolerance of a case of the network ``spec``: Jacobian products and ``gemms`` GEMMs
    of work N·D + P (N examples, D outputs each, P parameters), κ = 1, ×4 for the depth of
    the chain rule, × the number of estimator ``updates``."""
    work = x_shape[0] * int(n_out) + sum(p * q for _, p, q, _, _ in _layer_geometry(spec))
    how = f"Jacobian products and {gemms} GEMMs: work = N·D + P = {work}, κ = 1, ×4 chain depth"
    return Tolerance(SAFETY * 4 * updates * work,
                     how + (f", ×{updates} updates" if updates > 1 else ""))


def _full_block_cases():
    from .networks_cases import kfac_matrix

    tanh = _tanh()
    mlp = [_dense(3, 4), tanh, _dense(4, 3)]
    lin = [_dense(3, 3), _dense(3, 2)]
    runs = [("mlp_tanh_n4_ce", mlp, (4, 3), {"loss": "categorical"}, 3, "ggn_exact", b)
            for b in FULL_BLOCKS]
    runs.append(("deep_linear_n5_mse", lin, (5, 3), {"loss": "normal_mean", "variance": 0.5},
                 2, "fisher_empirical", "NaiveFull"))
    cases = []
    for name, spec, x_shape, lossp, n_out, mode, block in runs:
        cid = f"estimator.full_blocks/{name}_{mode}_{block}"
        inputs = _make_inputs(f"estimator.full_blocks/{name}", spec, x_shape, lossp["loss"],
                              n_out)
        params = {"net": spec, **lossp, "mode": mode, "block": block}
        expected = full_blocks_matrix(params, inputs)
        k = kfac_matrix(params, inputs)
        alts = {"kronecker_instead_of_exact": np.diag(np.diag(k)) if "Diagonal" in block
                else k}
        cases.append(Case(
            cid, "estimator.full_blocks", inputs, params, expected,
            _network_tolerance(spec, x_shape, n_out, "per-example gradient"),
            {"N": x_shape[0]}, alts, f"kfac-jax {block} blocks, {mode}"))
    return cases


def build_cases() -> list[Case]:
    from .networks_cases import kfac_matrix

    tanh = _tanh()
    nets = [
        ("mlp_tanh_ce", [_dense(3, 3), tanh, _dense(3, 3)], (3, 3), {"loss": "categorical"},
         3, "ggn_exact", 0.9),
        ("deep_linear_mse", [_dense(2, 3), _dense(3, 2)], (4, 2),
         {"loss": "normal_mean", "variance": 0.5}, 2, "fisher_empirical", 0.5),
    ]
    cases = []
    for name, spec, x_shape, lossp, n_out, mode, decay in nets:
        cid = f"estimator.kfac_ema/{name}_{mode}_decay{decay:g}"
        base = _make_inputs(cid, spec, x_shape, lossp["loss"], n_out)
        other = _make_inputs(cid + "/batch1", spec, x_shape, lossp["loss"], n_out)
        inputs = {k: v for k, v in base.items() if k not in ("x", "targets")}
        inputs.update(x0=base["x"], targets0=base["targets"], x1=other["x"],
                      targets1=other["targets"])
        params = {"net": spec, **lossp, "mode": mode, "decay": decay}
        expected = kfac_two_batches(params, inputs)
        k0 = kfac_matrix(params, {**inputs, "x": inputs["x0"], "targets": inputs["targets0"]})
        k1 = kfac_matrix(params, {**inputs, "x": inputs["x1"], "targets": inputs["targets1"]})
        alts = {
            "average_of_products": (decay * k0 + k1) / (decay + 1.0),
            "last_batch_only": k1,
        }  # (the raw, not debiased, sums are the ema_style='raw' convention flip)
        cases.append(Case(
            cid, "estimator.kfac_ema", inputs, params, expected,
            _network_tolerance(spec, x_shape, n_out, "factor", updates=2),
            {"N": x_shape[0]}, alts, f"{mode}, decay {decay:g}"))
    return cases + _full_block_cases()
