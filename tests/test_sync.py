"""sync: the statistics of several shards combined exactly, weighted by their batch sizes
(kfac_ref.averaging.sync_statistics, BlockDiagonalCurvature.sync).

The fact tested: a batch split into shards of sizes n_k (unequal), each shard's state updated
from one common state with the same ema_old, ema_new and estimation mode, then synced, equals
the whole batch's update — every statistic's running sum and weight — on NumPy, the array
API matrix and Dask (one shard per chunk).  Oracles: the whole-batch update of the same
estimator and the weighted mean Σ (n_k/n) X_k written out in NumPy.

Tolerances: both sides are sums of the same O(1) products in a different order, so float64
cells use ``xp.rtol``; float32 cells ``16·xp.rtol`` (a network's backward pass plus the
covariance GEMMs, as tests/test_curvature_block_diagonal.py derives).
"""

from __future__ import annotations

import numpy as np
import pytest

import kfac_ref.nn as nn
from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref.averaging import MovingAverageVariable, WeightedMovingAverage, sync_statistics
from kfac_ref.blocks import kfac_jax as kj
from kfac_ref.curvature import BlockDiagonalCurvature
from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss

SIZES = (2, 3, 4)
N = sum(SIZES)


def tol(xp):
    return xp.rtol if xp.float64 else 16 * xp.rtol


def test_sync_statistics_weighted_mean(xp, rng):
    xs = [rng.standard_normal((3, 3)) for _ in SIZES]
    want = sum(n * xp.round_host(x) for n, x in zip(SIZES, xs, strict=True)) / N
    xp.assert_close(sync_statistics([xp.asarray(x) for x in xs], SIZES), want)
    xp.assert_close(sync_statistics([xp.asarray(x) for x in xs]),
                    sum(xp.round_host(x) for x in xs) / 3)
    assert sync_statistics([1.0, 4.0], [3, 1]) == pytest.approx(1.75)
    avgs = [WeightedMovingAverage.zeros_like(xp.asarray(np.zeros((3, 3))))
            .update(xp.asarray(x), 0.0, w) for x, w in zip(xs, (1.0, 2.0, 0.5), strict=True)]
    got = sync_statistics(avgs, SIZES)
    assert isinstance(got, WeightedMovingAverage)
    assert got.weight == pytest.approx((2 * 1.0 + 3 * 2.0 + 4 * 0.5) / N)
    xp.assert_close(got.raw, sum(n * w * xp.round_host(x) for n, w, x in
                                 zip(SIZES, (1.0, 2.0, 0.5), xs, strict=True)) / N)
    tf = [MovingAverageVariable.zeros_like(xp.asarray(np.zeros((3, 3)))).update(
        xp.asarray(x), 0.5) for x in xs]
    got = sync_statistics(tf, SIZES)
    assert isinstance(got, MovingAverageVariable) and got.zero_debias
    xp.assert_close(got.value, want)


def test_sync_statistics_errors(xp):
    a = xp.asarray(np.ones((2, 2)))
    with pytest.raises(KFACValueError, match="sync_statistics: values must be a non-empty"):
        sync_statistics([])
    with pytest.raises(KFACValueError, match="sync_statistics: batch_sizes must be None or"):
        sync_statistics([a, a], [1])
    with pytest.raises(KFACValueError, match=r"sync_statistics: batch_sizes\[1\]"):
        sync_statistics([a, a], [1, 0])
    with pytest.raises(KFACValueError, match=r"sync_statistics: values\[1\] must have the shape"):
        sync_statistics([a, xp.asarray(np.ones(2))])
    with pytest.raises(KFACTypeError, match=r"sync_statistics: values\[1\] must be an array"):
        sync_statistics([a, 1.0])
    avg = WeightedMovingAverage.zeros_like(a)
    with pytest.raises(KFACTypeError, match=r"sync_statistics: values\[1\] must be a Weighted"):
        sync_statistics([avg, MovingAverageVariable.zeros_like(a)])


def small_net():
    return nn.Sequential([("d1", nn.Dense(3, 3)), ("a1", nn.Activation("tanh")),
                          ("d2", nn.Dense(3, 2))])


BLOCKS = {"kron+ekfac": {"d1": kj.DenseEKFAC},
          "diagonal+full": {"d1": kj.DenseDiagonal, "d2": kj.DenseFull}}


def shard_update(est, st0, params, x, y, mode, bounds):
    return [est.update_curvature_matrix_estimate(st0, 0.5, 1.0, b - a, None,
                                                 (params, (x[a:b, ...], y[a:b])), mode)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def setup(xp_asarray, rng, blocks, mode, param_asarray=None):
    net = small_net()
    x, y = rng.standard_normal((N, 3)), rng.integers(0, 2, size=N)
    param_asarray = param_asarray or xp_asarray
    params = tuple(tuple(param_asarray(a) for a in p)
                   for p in net.init_params(rng, np.zeros(1)))
    est = BlockDiagonalCurvature(net, CategoricalLogitsNegativeLogProbLoss,
                                 layer_to_block=BLOCKS[blocks])
    batch = (xp_asarray(x), xp_asarray(y))
    st0 = est.init(None, (params, batch))
    # a common starting state of weight 1 from another batch; the update below gives 1.5
    other = (xp_asarray(rng.standard_normal((N, 3))), xp_asarray(rng.integers(0, 2, size=N)))
    st0 = est.update_curvature_matrix_estimate(st0, 0.0, 1.0, N, None, (params, other), mode)
    whole = est.update_curvature_matrix_estimate(st0, 0.5, 1.0, N, None, (params, batch), mode)
    return est, st0, params, batch, whole


def assert_same_states(xp, got, want, rtol):
    for bg, bw in zip(got.blocks_states, want.blocks_states, strict=True):
        for sg, sw in zip(bg.statistics, bw.statistics, strict=True):
            assert sg.weight == pytest.approx(sw.weight) == 1.5
            xp.assert_close(sg.raw, xp.to_numpy(sw.raw), rtol=rtol)


@pytest.mark.parametrize("mode", ["ggn_exact", "fisher_empirical"])
@pytest.mark.parametrize("blocks", list(BLOCKS))
def test_estimator_sync_equals_whole_batch(xp, rng, blocks, mode):
    if xp.name.startswith("jax"):
        pytest.skip("JAX eager compiles the network's ops one by one (slow); sync_statistics "
                    "is exercised on JAX by test_sync_statistics_weighted_mean")
    est, st0, params, (x, y), whole = setup(xp.asarray, rng, blocks, mode)
    bounds = np.cumsum((0,) + SIZES)
    shards = shard_update(est, st0, params, x, y, mode, bounds)
    synced = est.sync(shards, "batch", batch_sizes=list(SIZES))
    assert_same_states(xp, synced, whole, tol(xp))
    assert synced.blocks_states[0].cache is shards[0].blocks_states[0].cache


def test_estimator_sync_one_shard_equal_shards_and_errors(rng):
    est, st0, params, (x, y), whole = setup(np.asarray, rng, "kron+ekfac", "ggn_exact")
    assert est.sync(whole) is whole
    assert est.sync([whole], None, batch_sizes=[N]) is whole
    shards = shard_update(est, st0, params, x, y, "ggn_exact", (0, 3, 6, 9))
    # equal shards: kfac-jax's pmean (the default) is the whole batch
    assert_same_states(_NUMPY, est.sync(shards), whole, 4096 * np.finfo(float).eps)
    with pytest.raises(KFACValueError, match="BlockDiagonalCurvature.sync: batch_sizes"):
        est.sync(shards, batch_sizes=[3, 3])
    with pytest.raises(KFACValueError, match=r"sync: batch_sizes\[0\]"):
        est.sync(shards, batch_sizes=[0, 3, 3])
    with pytest.raises(KFACTypeError, match="sync: pmap_axis_name"):
        est.sync(shards, 3)
    with pytest.raises(KFACTypeError, match=r"sync \(state\[1\]\): state must be"):
        est.sync([whole, "state"])
    with pytest.raises(KFACValueError, match="sync: state must be a BlockDiagonalState or"):
        est.sync([])
    # shards of two precisions are refused, naming the shard (each one is consistent)
    import kfac_ref.curvature as C
    from kfac_ref.blocks import kfac_jax as KB

    single = C.BlockDiagonalState(tuple(
        KB.BlockState(s.statistics, s.cache, np.zeros((), np.float32))
        for s in whole.blocks_states))
    with pytest.raises(KFACTypeError, match=r"sync: state\[1\]\.blocks_states\[0\] must "
                                            r"have the floating dtype"):
        est.sync([whole, single])


class _Numpy:
    """The NumPy cell's helpers for a test that does not take the ``xp`` fixture."""

    rtol = 4096 * np.finfo(float).eps

    @staticmethod
    def to_numpy(a):
        return np.asarray(a)

    def assert_close(self, got, want, rtol):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0,
                                   atol=rtol * np.abs(want).max())


_NUMPY = _Numpy()


@pytest.mark.parametrize("blocks", list(BLOCKS))
def test_sync_on_dask_one_shard_per_chunk(rng, blocks):
    """Dask arrays chunked along the batch, each chunk a shard (``x.blocks[k]``): the synced
    lazy states compute to the whole batch's update."""
    da = pytest.importorskip("dask.array")

    def lazy(a):
        a = np.asarray(a)
        return da.from_array(a, chunks=(SIZES,) + tuple((s,) for s in a.shape[1:]))

    est, st0, params, (x, y), whole = setup(lazy, rng, blocks, "ggn_exact", da.from_array)
    assert x.numblocks[0] == len(SIZES)
    shards = [est.update_curvature_matrix_estimate(st0, 0.5, 1.0, SIZES[k], None,
                                                   (params, (x.blocks[k], y.blocks[k])),
                                                   "ggn_exact")
              for k in range(len(SIZES))]
    synced = est.sync(shards, batch_sizes=list(SIZES))
    assert isinstance(synced.blocks_states[0].statistics[0].raw, da.Array)
    assert_same_states(_NUMPY, synced, whole, _NUMPY.rtol)
