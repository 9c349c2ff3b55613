"""Fixed costs of the small-factor paths, with unchanged results.

* :math:`M + \\lambda I` adds :math:`\\lambda` to the diagonal without forming :math:`I`
  (``kfac_ref.linalg.add_to_diagonal``): bitwise the sum with the identity on every backend,
  and the input is not written;
* a cache of several approximate Kronecker powers computes the π (and zero-factor) norms
  once, and its products are bitwise the uncached ones (NumPy: the same operations on the
  same numbers).
The host reads of a norm-scaled cache refresh are counted in tests/test_host_syncs.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from kfac_ref import linalg
from kfac_ref.blocks import kfac_jax as kj
from kfac_ref.blocks.kfac_jax import _kronecker


@pytest.mark.parametrize("damping", [0.0, 0.37, -1.5])
def test_add_to_diagonal_is_the_identity_sum_bitwise(xp, damping):
    host = np.random.default_rng(4).standard_normal((5, 5))
    m = xp.asarray(host)
    before = xp.to_numpy(m).copy()
    got = linalg.add_to_diagonal(xp.xp, m, damping)
    want = m + damping * xp.xp.eye(5, dtype=m.dtype, device=xp.device)
    xp.check(got)
    np.testing.assert_array_equal(xp.to_numpy(got), xp.to_numpy(want))
    np.testing.assert_array_equal(xp.to_numpy(m), before)


def test_cache_of_several_powers_computes_the_norms_once(monkeypatch):
    calls = {"n": 0}
    original = linalg.kron_factor_norms

    def counting(*a, **k):
        calls["n"] += 1
        return original(*a, **k)

    # the kernel's own calls and the block's (which imported the name)
    monkeypatch.setattr(linalg, "kron_factor_norms", counting)
    monkeypatch.setattr(_kronecker, "kron_factor_norms", counting)
    rng = np.random.default_rng(9)
    block = kj.DenseTwoKroneckerFactored(4, 3)
    st = block.init(np.zeros(()), approx_powers_to_cache=[-1.0, -0.5, 0.5])
    st = block.update_curvature_matrix_estimate(
        st, {"inputs": rng.standard_normal((8, 4)), "outputs_grad": rng.standard_normal((8, 3))},
        0.0, 1.0, 8)
    calls["n"] = 0
    st = block.update_cache(st, 0.1, [], [-1.0, -0.5, 0.5], False, "avg_diag")
    assert calls["n"] == 1
    vec = tuple(rng.standard_normal(s) for s in block.parameters_shapes)
    for p in (-1.0, -0.5, 0.5):
        cached = block.multiply_matpower(st, vec, 0.1, p, False, True, "avg_diag")
        fresh = block.multiply_matpower(st, vec, 0.1, p, False, False, "avg_diag")
        for c, f in zip(cached, fresh, strict=True):
            np.testing.assert_array_equal(c, f)


# PyTorch operations that only make a view (no kernel launch on a device)
_VIEWS = frozenset({"view", "transpose", "diagonal", "permute", "slice", "select", "detach",
                    "alias", "_unsafe_view", "expand", "t", "as_strided", "unsqueeze",
                    "squeeze", "_reshape_alias", "unbind", "split", "lift_fresh"})


def _kernels_launched(fn):
    """``(result, number of PyTorch operations other than views)`` of ``fn()``: on a
    device each is a kernel launch, which is what a small factor's refresh costs there."""
    pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in _VIEWS:
                Counting.n += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        out = fn()
    return out, Counting.n


@pytest.mark.parametrize("fallback,bound", [("identity", 50), ("pi_one", 52)])
def test_a_kronecker_inverse_refresh_launches_few_kernels(fallback, bound):
    """A refresh of one damped Kronecker inverse (two Cholesky inverses) on torch tensors,
    value checks on, stays within ``bound`` operations: two norms of four kernels each
    (no ``where`` guard: the unit is clipped at the smallest normal number), π without its
    zero guard once the zero-factor test has passed (kfac-jax's fall-back), the
    positive-definiteness test on the pivots themselves (no squares), the Cholesky
    factorisation without a read of its own (``cholesky_ex``), one read for the whole
    refresh.  The refresh agrees with NumPy's to rounding."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(13)
    data = {"inputs": rng.standard_normal((16, 6)), "outputs_grad": rng.standard_normal((16, 4))}
    vec = tuple(rng.standard_normal(s) for s in ((6, 4), (4,)))
    out = []
    for to in (np.asarray, lambda a: torch.tensor(a, dtype=torch.float64)):
        block = kj.DenseTwoKroneckerFactored(6, 4, zero_factor_fallback=fallback)
        state = block.init(to(np.zeros(())), approx_powers_to_cache=[-1.0])
        state = block.update_curvature_matrix_estimate(
            state, {k: to(v) for k, v in data.items()}, 0.0, 1.0, 16)
        if to is np.asarray:
            cached = block.update_cache(state, 0.1, [], [-1.0], False)
        else:
            cached, n = _kernels_launched(lambda b=block, s=state: b.update_cache(
                s, 0.1, [], [-1.0], False))
            assert n <= bound, n
        out.append(block.multiply_matpower(cached, tuple(to(v) for v in vec), 0.1, -1.0,
                                           False, True))
    for want, got in zip(*out, strict=True):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)
