"""Dask arrays: factor statistics computed lazily, chunk by chunk along the batch axis.

kfac_ref has no Dask-specific code: a Dask array's namespace is the array API (through
``array_api_compat``), value checks are skipped for it (it is lazy), and the batch
reductions ``Σₙ xₙ xₙᵀ`` of the factor statistics become Dask reductions over the chunks.
These tests check three things against eager NumPy on the same data:

* the results agree (float64 rounding of a differently ordered sum);
* nothing is computed before ``.compute()`` (the result is a Dask array);
* no task materialises the whole batch: every intermediate result is bounded by a small
  multiple of one chunk or of the output, recorded by a scheduler callback.
"""

from __future__ import annotations

import numpy as np
import pytest

from kfac_ref import compute_cov, factors, losses

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
from dask.callbacks import Callback  # noqa: E402

RTOL = 1e-12

# What this module runs on Dask arrays, by the names of kfac_ref.capabilities (the
# declarations' "dask" column must equal it).
DASK_EXERCISED = {
    "kfac_ref.linalg.compute_cov",
    "kfac_ref.factors.dense.fully_connected_kronecker_factor",
    "kfac_ref.factors.conv_kfc.conv_input_kronecker_factor",
    "kfac_ref.factors.conv_kfc.conv_output_kronecker_factor",
    "kfac_ref.losses.CategoricalLogitsNegativeLogProbLoss",
    "kfac_ref.losses.MultiBernoulliNegativeLogProbLoss",
    "kfac_ref.losses.NormalMeanNegativeLogProbLoss",
}


def test_declarations_are_what_is_exercised():
    from kfac_ref import capabilities

    declared = {n for n, s in capabilities.support_table().items() if s.state("dask") == "yes"}
    assert declared == DASK_EXERCISED


class _LargestResult(Callback):
    """Records the size in bytes of the largest intermediate result of a computation."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def _posttask(self, key, result, dsk, state, worker_id):
        self.largest = max(self.largest, int(getattr(result, "nbytes", 0)))


def _compute_bounded(lazy, bound_bytes):
    assert isinstance(lazy, da.Array), f"expected a lazy Dask result, got {type(lazy)}"
    with _LargestResult() as rec:
        out = lazy.compute(scheduler="sync", optimize_graph=False)  # every task seen
    assert rec.largest <= bound_bytes, (
        f"a task produced {rec.largest} bytes, more than the bound {bound_bytes}: "
        "the batch was materialised")
    return out


def _close(got, expected):
    scale = float(np.max(np.abs(expected)))
    assert float(np.max(np.abs(got - expected))) <= RTOL * scale


@pytest.fixture
def rng():
    return np.random.default_rng(20261203)


def test_the_bound_detects_a_materialised_batch(rng):
    """The instrument itself: gathering the chunks into one array is caught."""
    x = da.from_array(rng.standard_normal((4000, 12)), chunks=(250, 12))
    with pytest.raises(AssertionError, match="materialised"):
        _compute_bounded(compute_cov(x.rechunk((4000, 12))), 2 * 250 * 12 * 8)


def test_compute_cov_by_chunks(rng):
    x = rng.standard_normal((4000, 12))
    lazy = compute_cov(da.from_array(x, chunks=(250, 12)))
    chunk = 250 * 12 * 8
    got = _compute_bounded(lazy, 2 * chunk)
    _close(got, compute_cov(x))


def test_dense_factors_by_chunks(rng):
    x = rng.standard_normal((3000, 9))
    g = rng.standard_normal((3000, 5))
    chunk = 200 * 10 * 8
    a = factors.fully_connected_kronecker_factor(da.from_array(x, chunks=(200, 9)),
                                                 has_bias=True)
    _close(_compute_bounded(a, 2 * chunk), factors.fully_connected_kronecker_factor(
        x, has_bias=True))
    gg = factors.fully_connected_kronecker_factor(da.from_array(g, chunks=(200, 5)))
    _close(_compute_bounded(gg, 2 * chunk), factors.fully_connected_kronecker_factor(g))


def test_conv_factors_by_chunks(rng):
    # im2col of one chunk is 4·8·8 locations × 27 columns; the whole batch is 16× that.
    x = rng.standard_normal((64, 8, 8, 3))
    g = rng.standard_normal((64, 8, 8, 4))
    patches_per_chunk = 4 * 8 * 8 * 27 * 8
    a = factors.conv_input_kronecker_factor(da.from_array(x, chunks=(4, 8, 8, 3)),
                                            (3, 3, 3, 4), "SAME")
    _close(_compute_bounded(a, 3 * patches_per_chunk),
           factors.conv_input_kronecker_factor(x, (3, 3, 3, 4), "SAME"))
    gg = factors.conv_output_kronecker_factor(da.from_array(g, chunks=(4, 8, 8, 4)))
    _close(_compute_bounded(gg, 3 * 4 * 8 * 8 * 4 * 8),
           factors.conv_output_kronecker_factor(g))


@pytest.mark.parametrize("make", [
    lambda z, xp_t: losses.CategoricalLogitsNegativeLogProbLoss(z),
    lambda z, xp_t: losses.MultiBernoulliNegativeLogProbLoss(z),
    lambda z, xp_t: losses.NormalMeanNegativeLogProbLoss(z, variance=0.5),
], ids=["categorical", "multi_bernoulli", "normal_mean"])
def test_loss_fisher_output_factor_by_chunks(rng, make):
    """The output factor of the last layer, G = (1/N) Σₙ Bₙ Bₙᵀ, from the loss's Fisher
    factor applied to the replicated one-hot vectors: per example, then one reduction."""
    logits = rng.standard_normal((2000, 6))
    eager = make(logits, np)
    lazy = make(da.from_array(logits, chunks=(250, 6)), da)

    def output_factor(loss):
        cols = [loss.multiply_fisher_factor_replicated_one_hot([k])[0]
                for k in range(loss.fisher_factor_inner_shape[-1])]
        # Σₖ over the factor's columns of the per-example outer products
        return sum(compute_cov(c) for c in cols)

    got = _compute_bounded(output_factor(lazy), 4 * 250 * 6 * 8)
    _close(got, output_factor(eager))


def test_value_checks_skipped_for_dask(rng):
    """A NaN inside a Dask array is not read at call time (that would force the graph);
    the eager call rejects it."""
    x = rng.standard_normal((100, 4))
    x[3, 1] = np.nan
    lazy = compute_cov(da.from_array(x, chunks=(25, 4)))
    assert isinstance(lazy, da.Array)
    assert np.isnan(lazy.compute()).any()
    with pytest.raises(ValueError, match="compute_cov: .* finite"):
        compute_cov(x)


def test_mixed_dask_and_numpy_rejected(rng):
    x = rng.standard_normal((10, 3))
    with pytest.raises(TypeError, match="one array namespace"):
        compute_cov(da.from_array(x, chunks=(5, 3)), tensor_right=x)


def test_on_a_distributed_cluster(rng):
    """The same lazy factors computed by a dask.distributed scheduler (a LocalCluster with
    in-process workers) agree with eager NumPy."""
    distributed = pytest.importorskip("distributed")
    x = rng.standard_normal((2000, 7))
    g = rng.standard_normal((2000, 3))
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as client:
        a_lazy = factors.fully_connected_kronecker_factor(da.from_array(x, chunks=(250, 7)),
                                                          has_bias=True)
        g_lazy = compute_cov(da.from_array(g, chunks=(250, 3)))
        a, gg = client.compute([a_lazy, g_lazy], sync=True)
    _close(a, factors.fully_connected_kronecker_factor(x, has_bias=True))
    _close(gg, compute_cov(g))
