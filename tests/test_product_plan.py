"""A cached product's plan (``BlockDiagonalCurvature.multiply_matpower``): after a product
of an immutable state with the same options, the next products run the blocks' bound
cached products (``CurvatureBlock.cached_flat_product``) without re-dispatching.  The plan
must give the products of the full path, never outlive its state, never hold a traced
array, and leave every check and error of the full path in place."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest

import kfac_ref.nn as nn
from kfac_ref import KFACValueError
from kfac_ref.blocks.kfac_jax import CurvatureBlock
from kfac_ref.curvature import BlockDiagonalCurvature, BlockDiagonalState
from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss


def _ce(f, y):
    return CategoricalLogitsNegativeLogProbLoss(f, targets=y)


def _cached(xp, **block_kwargs):
    """A small CNN's estimator and a state cached for the approximate power −1."""
    rng = np.random.default_rng(3)
    net = nn.Sequential([("c", nn.Conv2D(2, 3, 3, padding="SAME")), ("r", nn.Activation("relu")),
                         ("p", nn.MeanPool()), ("d", nn.Dense(3, 4))])
    params = tuple(tuple(xp.asarray(a) for a in p)
                   for p in net.init_params(rng, np.zeros(1)))
    batch = (xp.asarray(rng.standard_normal((6, 5, 5, 2))),
             xp.asarray(rng.integers(0, 4, 6), dtype=xp.xp.int64 if xp.float64 else xp.xp.int32))
    est = BlockDiagonalCurvature(net, _ce, block_kwargs=block_kwargs)
    st = est.init(None, (params, batch), approx_powers_to_cache=-1.0)
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, 6, None, (params, batch),
                                              "ggn_exact")
    st = est.update_cache(st, 0.1, None, -1.0, False)
    vec = xp.asarray(rng.standard_normal(est.dim))
    return est, st, vec


def _count_kernel_calls(monkeypatch):
    calls = {"n": 0}
    original = CurvatureBlock.multiply_matpower_flat_kernel

    def counting(self, *a, **k):
        calls["n"] += 1
        return original(self, *a, **k)

    monkeypatch.setattr(CurvatureBlock, "multiply_matpower_flat_kernel", counting)
    return calls


def test_the_plan_gives_the_full_paths_products(xp, monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    est, st, vec = _cached(xp)
    first = est.multiply_matpower(st, vec, 0.1, -1.0, False, True)
    assert calls["n"] == 2 and est._plan is not None  # the full path, then the plan kept
    second = est.multiply_matpower(st, vec, 0.1, -1.0, False, True)
    assert calls["n"] == 2  # the plan: no kernel dispatch
    xp.check(second)
    np.testing.assert_allclose(xp.to_numpy(second), xp.to_numpy(first),
                               rtol=1e-12 if xp.float64 else 1e-5)
    # an independent door: each block's own public product on its parameter arrays
    blocks_out = []
    for bl, bs, sl in zip(est.blocks, st.blocks_states, est._block_slices, strict=True):
        v = vec[sl]
        shapes, parts, start = bl.parameters_shapes, [], 0
        for s in shapes:
            size = int(np.prod(s))
            parts.append(xp.xp.reshape(v[start:start + size], s))
            start += size
        out = bl.multiply_matpower(bs, tuple(parts), 0.1, -1.0, False, True)
        blocks_out.append(np.concatenate([xp.to_numpy(o).reshape(-1) for o in out]))
    np.testing.assert_allclose(xp.to_numpy(second), np.concatenate(blocks_out),
                               rtol=1e-12 if xp.float64 else 1e-5)


def test_other_options_take_the_full_path_with_its_errors(monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    est, st, vec = _cached(_Host(), strict_cache=True)
    est.multiply_matpower(st, vec, 0.1, -1.0, False, True)
    n = calls["n"]
    with pytest.raises(KFACValueError, match=r"identity_weight \(effective 0.2\) must equal"):
        est.multiply_matpower(st, vec, 0.2, -1.0, False, True)
    with pytest.raises(KFACValueError, match="power must be one of the cached"):
        est.multiply_matpower(st, vec, 0.1, -0.5, False, True)
    exact = est.multiply_matpower(st, vec, 0.1, 1.0, True, True)  # another path, right
    fresh = est.multiply_matpower(st, vec, 0.1, 1.0, True, False)
    np.testing.assert_allclose(exact, fresh, rtol=1e-12)
    assert calls["n"] > n
    with pytest.raises(KFACValueError, match="parameter_structured_vector must be finite"):
        est.multiply_matpower(st, np.where(np.arange(est.dim) == 3, np.nan, vec), 0.1, -1.0,
                              False, True)


class _Host:
    """The NumPy float64 cell, for the tests that need no backend matrix."""

    xp = np
    float64 = True

    @staticmethod
    def asarray(a, dtype=None):
        return np.asarray(a, dtype=dtype)


def test_the_plan_dies_with_its_state_and_follows_a_new_one():
    est, st, vec = _cached(_Host())
    want = est.multiply_matpower(st, vec, 0.1, -1.0, False, True)
    assert est._plan is not None
    est.multiply_matpower(st, vec, 0.1, -1.0, False, True)
    del st
    gc.collect()
    assert est._plan is None  # dropped with the state: its cached powers are not kept alive
    est2, st, vec = _cached(_Host())
    assert np.allclose(est2.multiply_matpower(st, vec, 0.1, -1.0, False, True), want)
    est2.multiply_matpower(st, vec, 0.1, -1.0, False, True)
    assert est2._plan is not None
    copy = pickle.loads(pickle.dumps(est2))  # the plan is this process's, not pickled
    assert copy._plan is None
    np.testing.assert_array_equal(copy.multiply_matpower(st, vec, 0.1, -1.0, False, True),
                                  est2.multiply_matpower(st, vec, 0.1, -1.0, False, True))


def test_a_state_built_on_lists_takes_no_plan():
    est, st, vec = _cached(_Host())
    listed = BlockDiagonalState(list(st.blocks_states))
    est.multiply_matpower(listed, vec, 0.1, -1.0, False, True)
    assert est._plan is None  # a list can change in place: no plan may trust it


class _Jax:
    """JAX float32 arrays, for the trace test."""

    float64 = False

    def __init__(self):
        import jax.numpy as jnp

        self.xp = jnp

    def asarray(self, a, dtype=None):
        a = np.asarray(a)
        return self.xp.asarray(a, dtype=dtype or (self.xp.float32 if a.dtype.kind == "f"
                                                  else None))


def test_no_plan_holds_a_traced_array():
    jax = pytest.importorskip("jax")
    est, st, vec = _cached(_Jax())
    f = jax.jit(lambda v: est.multiply_matpower(st, v, 0.1, -1.0, False, True))
    got = f(vec)
    assert est._plan is None  # the vector was traced
    want = est.multiply_matpower(st, vec, 0.1, -1.0, False, True)
    assert est._plan is not None  # eager: planned
    np.testing.assert_allclose(np.asarray(f(vec)), np.asarray(got))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    g = jax.jit(lambda s, v: est.multiply_matpower(s, v, 0.1, -1.0, False, True))
    np.testing.assert_allclose(np.asarray(g(st, vec)), np.asarray(want), rtol=1e-5)
    assert est._plan[0]() is st  # a traced state neither replaced nor joined the plan


def test_a_plan_made_without_value_checks_does_not_skip_them_later():
    """A cache built with a 0-D array weight is compared with a product's weight only while
    value checks run (``strict_cache``): a plan made with the checks off must not let a
    later call with the checks on skip that comparison."""
    from kfac_ref import value_checks

    est, st, vec = _cached(_Host(), strict_cache=True)
    st = est.update_cache(st, np.asarray(0.1), None, -1.0, False)
    with value_checks(False):
        est.multiply_matpower(st, vec, 0.2, -1.0, False, True)
        assert est._plan is not None
        est.multiply_matpower(st, vec, 0.2, -1.0, False, True)
    with pytest.raises(KFACValueError, match=r"identity_weight \(effective 0.2\) must equal"):
        est.multiply_matpower(st, vec, 0.2, -1.0, False, True)


def test_a_structured_vector_takes_the_plan_too(monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    est, st, vec = _cached(_Host())
    structured = est.net.unflatten(vec)
    want = est.multiply_matpower(st, vec, 0.1, -1.0, False, True)
    n = calls["n"]
    for _ in range(2):
        got = est.multiply_matpower(st, structured, 0.1, -1.0, False, True)
        assert calls["n"] == n  # the plan made by the flat call: equal options, same state
        assert isinstance(got, tuple)
        np.testing.assert_allclose(est.net.flatten(got), want, rtol=1e-12)
