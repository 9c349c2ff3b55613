"""Scale-and-shift factors: per-example gradients built one parameter entry at a time from
the definition y = s ⊙ x + b (directional derivatives of Σ y·g along unit parameters),
then the dense second moment; classes and errors."""

import itertools

import numpy as np
import pytest

import kfac_ref.factors as F
from kfac_ref import KFACValueError


def per_example_grads(x, g, scale_shape, shift_shape):
    """v_n by explicit loops: ∂/∂s_j Σ (s ⊙ x + b)·g = Σ (e_j ⊙ x)·g, e_j broadcast."""
    rows = []
    for n in range(g.shape[0]):
        v = []
        for j in itertools.product(*[range(k) for k in scale_shape]):
            e = np.zeros(scale_shape)
            e[j] = 1.0
            v.append(np.sum(np.broadcast_to(e, g.shape[1:]) * x[n] * g[n]))
        if shift_shape is not None:
            for j in itertools.product(*[range(k) for k in shift_shape]):
                e = np.zeros(shift_shape)
                e[j] = 1.0
                v.append(np.sum(np.broadcast_to(e, g.shape[1:]) * g[n]))
        rows.append(np.array(v))
    return np.array(rows)


@pytest.mark.parametrize("has_shift", [False, True])
def test_scale_and_shift_matches_definition(xp, rng, has_shift):
    x = xp.round_host(rng.standard_normal((4, 3, 2, 5)))
    g = xp.round_host(rng.standard_normal((4, 3, 2, 5)))
    # scale broadcast over axes 1, 2 (per-channel gain [1, 1, 5]); shift over axis 1 only
    v = per_example_grads(x, g, (1, 1, 5), (1, 2, 5) if has_shift else None)
    full = F.scale_and_shift_factor(xp.asarray(x), xp.asarray(g), (1, 2), (1,), has_shift)
    xp.assert_close(full, v.T @ v / 4)
    diag = F.scale_and_shift_factor(xp.asarray(x), xp.asarray(g), [1, 2], [1], has_shift,
                                    approx="diagonal")
    xp.assert_close(diag, (v**2).mean(axis=0))


def test_scale_and_shift_broadcast_inputs(xp, rng):
    x = xp.round_host(rng.standard_normal((3, 1, 4)))  # inputs broadcast along axis 1
    g = xp.round_host(rng.standard_normal((3, 2, 4)))
    v = per_example_grads(np.broadcast_to(x, g.shape), g, (1, 4), None)
    xp.assert_close(F.scale_and_shift_factor(xp.asarray(x), xp.asarray(g), (1,),
                                             has_shift=False), v.T @ v / 3)


def test_scale_and_shift_classes_and_errors(xp, rng):
    x = xp.round_host(rng.standard_normal((4, 2, 3)))
    gs = [xp.round_host(rng.standard_normal((4, 2, 3))) for _ in range(2)]
    f = F.ScaleAndShiftFullFactor((1,), (1,)).update_cov(
        xp.asarray(x), [[xp.asarray(g)] for g in gs], ema_decay=0.5)
    vs = [per_example_grads(x, g, (1, 3), (1, 3)) for g in gs]
    xp.assert_close(f.cov, sum(v.T @ v / 4 for v in vs))
    d = F.ScaleAndShiftDiagonalFactor((1,), (1,)).update_cov(
        xp.asarray(x), [[xp.asarray(g)] for g in gs], ema_decay=0.5)
    xp.assert_close(d.cov, sum((v**2).mean(axis=0) for v in vs))
    with pytest.raises(KFACValueError, match="broadcast_dims_shift must be given"):
        F.scale_and_shift_factor(xp.asarray(x), xp.asarray(gs[0]), (1,))
    with pytest.raises(KFACValueError, match="non-batch axes"):
        F.scale_and_shift_factor(xp.asarray(x), xp.asarray(gs[0]), (0,), (1,))
    with pytest.raises(KFACValueError, match="approx"):
        F.scale_and_shift_factor(xp.asarray(x), xp.asarray(gs[0]), (1,), (1,), approx="kron")
    with pytest.raises(KFACValueError, match="broadcast against"):
        F.scale_and_shift_factor(xp.asarray(rng.standard_normal((4, 3, 3))),
                                 xp.asarray(gs[0]), (1,), (1,))
    with pytest.raises(KFACValueError, match="3-D"):
        F.scale_and_shift_factor(xp.asarray(x), xp.asarray(rng.standard_normal((4, 6))),
                                 (1,), (1,))
