"""KFRA (Botev et al. 2017): BackPACK's ``KFRA`` extension against
:func:`kfac_ref.curvature.kfra_factors` on small float64 MLPs.

Run inside the ``torchpeers`` environment (recipe ``torchpeers.txt``), from the repository
root::

    python -m conformance.peers.kfra_check

Networks 4 → 5 → 4 → 3 with tanh or ReLU between the layers, with and without biases, N = 6,
``MSELoss`` and ``CrossEntropyLoss`` with ``reduction="mean"``.  BackPACK stores
``weight.kfra == [G, A]`` (block ``kron(G, A)`` on the PyTorch ``[out, in]`` weight) and
``bias.kfra == [G]`` (a separate bias block); its ``A`` is the weight-only input moment
:math:`\\frac1N\\sum_n a a^\\top`, the leading ``[d_in, d_in]`` sub-matrix of kfac_ref's
:math:`A = \\frac1N\\sum_n \\bar a\\bar a^\\top`.  Its loss matrix is the Hessian of the
PyTorch loss summed over the batch: for cross-entropy that is kfac_ref's
:math:`\\tilde G_L = \\frac1N\\sum_n H_n`; ``MSELoss`` with the mean reduction divides by
:math:`N D` (:math:`D` = 3 outputs), so its matrix is :math:`\\frac1D` times kfac_ref's for
:math:`\\ell_n = \\lVert f_n - y_n\\rVert^2` (``NormalMeanNegativeLogProbLoss`` with
variance 0.5), a convention converted here.  Compared per dense layer: ``A``, the weight's
``G`` and the bias's ``G``.  A control row compares BackPACK's first-layer ``G`` with K-FAC's
exact-mode ``G`` (``BlockDiagonalCurvature``, ``ggn_exact``), which KFRA is not: it must
differ, or the check would not tell the two apart.

BackPACK builds the ``MSELoss`` matrix in PyTorch's default dtype, so a float64 model under
the default float32 raises; the script shows the error, then sets the default dtype to
float64.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from backpack import backpack, extend
from backpack.extensions import KFRA

import kfac_ref.curvature as kc
import kfac_ref.nn as knn
from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss, NormalMeanNegativeLogProbLoss

from . import common as C

TOL = 1e-12  # float64 GEMM chains of length ≤ 6 on O(1) data (errors ~1e-16)
DIMS = (4, 5, 4, 3)
N = 6


def _ce(f, y):
    return CategoricalLogitsNegativeLogProbLoss(f, targets=y)


def _sq(f, y):
    return NormalMeanNegativeLogProbLoss(f, targets=y, variance=0.5)  # ℓ = ‖f − y‖²


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _networks(act, bias, rng):
    """The same network in kfac_ref (kernels [d_in, d_out]) and in PyTorch (weights Wᵀ)."""
    layers, mods, params = [], [], []
    for i, (d_in, d_out) in enumerate(zip(DIMS[:-1], DIMS[1:], strict=True)):
        w = rng.standard_normal((d_in, d_out)) / np.sqrt(d_in)
        b = 0.5 * rng.standard_normal(d_out)
        layers.append((f"d{i + 1}", knn.Dense(d_in, d_out, use_bias=bias)))
        params.append((w, b) if bias else (w,))
        lin = torch.nn.Linear(d_in, d_out, bias=bias).double()
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w.T.copy()))
            if bias:
                lin.bias.copy_(torch.from_numpy(b))
        mods.append(lin)
        if i < len(DIMS) - 2:
            layers.append((f"a{i + 1}", knn.Activation(act)))
            params.append(())
            mods.append(torch.nn.Tanh() if act == "tanh" else torch.nn.ReLU())
    return knn.Sequential(layers), tuple(params), torch.nn.Sequential(*mods)


def _backpack_kfra(model, loss_name, x, y):
    model = extend(model)
    loss_mod = extend(torch.nn.MSELoss() if loss_name == "mse" else torch.nn.CrossEntropyLoss())
    model.zero_grad()
    # the inputs need no gradient; PyTorch warns that the full backward hooks fire anyway
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    loss = loss_mod(model(torch.from_numpy(x)), torch.from_numpy(y))
    with backpack(KFRA()):
        loss.backward()
    out = []
    for lin in (m for m in model if isinstance(m, torch.nn.Linear)):
        g, a = (t.detach().numpy() for t in lin.weight.kfra)
        gb = lin.bias.kfra[0].detach().numpy() if lin.bias is not None else None
        out.append((a, g, gb))
    return out


def _kfac_exact_g(net, loss, params, batch):
    est = kc.BlockDiagonalCurvature(net, loss)
    st = est.init(None, (params, batch))
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, N, None, (params, batch),
                                              "ggn_exact")
    return [bs.factors[1].value for bs in st.blocks_states]


def _dtype_fault():
    """BackPACK's ``MSELoss`` KFRA matrix (``_sum_hessian``: ``2 * eye(D)``) is built in the
    default dtype: with a float64 model and the default float32 the first ``Linear`` raises.
    Returns the error message, or ``None`` when it does not raise."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        net, params, model = _networks("tanh", True, np.random.default_rng(0))
        x, y = np.zeros((N, DIMS[0])), np.zeros((N, DIMS[-1]))
        _backpack_kfra(model, "mse", x, y)
    except RuntimeError as exc:
        return str(exc)
    finally:
        torch.set_default_dtype(previous)
    return None


def main():
    fault = _dtype_fault()
    print(f"default dtype float32, float64 model, MSELoss: "
          f"{'RuntimeError: ' + fault if fault else 'no error'}")
    torch.set_default_dtype(torch.float64)  # past that fault (as the BackPACK adapter does)
    rng = np.random.default_rng(2017)
    rows = []
    for act in ("tanh", "relu"):
        for bias in (True, False):
            for loss_name in ("mse", "ce"):
                net, params, model = _networks(act, bias, rng)
                x = rng.standard_normal((N, DIMS[0]))
                if loss_name == "ce":
                    y, loss, scale = rng.integers(0, DIMS[-1], size=N), _ce, 1.0
                else:
                    y, loss, scale = rng.standard_normal((N, DIMS[-1])), _sq, 1.0 / DIMS[-1]
                ref = kc.kfra_factors(net, loss, params, (x, y))
                peer = _backpack_kfra(model, loss_name, x, y)
                tag = f"{act} bias={bias} {loss_name}"
                for i, ((a, g), (pa, pg, pgb)) in enumerate(zip(ref, peer, strict=True)):
                    d_in = DIMS[i]
                    rows.append((f"{tag} layer {i + 1} A (weight)", _rel(pa, a[:d_in, :d_in])))
                    rows.append((f"{tag} layer {i + 1} G (weight)", _rel(pg, scale * g)))
                    if bias:
                        rows.append((f"{tag} layer {i + 1} G (bias block)",
                                     _rel(pgb, scale * g)))
                control = _rel(peer[0][1], scale * _kfac_exact_g(net, loss, params, (x, y))[0])
                rows.append((f"{tag} control: layer 1 G vs K-FAC exact-mode G (must differ)",
                             -control))
    print(f"backpack-for-pytorch KFRA, torch {torch.__version__}; MSELoss(mean) matrices "
          f"compared with 1/D = {1 / DIMS[-1]:.6g} × kfac_ref's (ℓ = ‖f − y‖²)")
    return C.print_verdicts(rows, TOL)


if __name__ == "__main__":
    raise SystemExit(main())
