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

import re

import numpy as np
import pytest
from array_api_compat import array_namespace

import kfac_ref as K
import kfac_ref.curvature as curv
from kfac_ref import (
    blocks,
    compute_cov,
    factors,
    laplace,
    losses,
    optim,
)
from kfac_ref.operators import CurvatureOperator

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
from api_calls import (  # noqa: E402  (the corpus of valid calls, shared with the fuzzer)
    _A,
    _B,
    _G,
    _NET,
    _NV,
    _NX,
    _NY,
    _TF_BLOCK_NAMES,
    _V32,
    _W,
    DASK_CALLS,
    DASK_FACTOR_CLASSES,
    EIGEN_CALLS,
    _ekfac_product,
    _estimator,
    _factor_run,
    _flat,
    _gauss,
    _kj_products,
    _laplace_problem,
    _params,
    _problem,
    _series_inverse,
    _spd,
)
from dask.callbacks import Callback  # noqa: E402

RTOL = 1e-12

# What this module runs on Dask arrays by chunks, by the names of kfac_ref.capabilities
# (with DASK_CALLS below, the declarations' "yes" of the "dask" column).
DASK_EXERCISED = {
    "kfac_ref.linalg.compute_cov",
    "kfac_ref.factors.fully_connected_kronecker_factor",
    "kfac_ref.factors.conv_input_kronecker_factor",
    "kfac_ref.factors.conv_output_kronecker_factor",
    "kfac_ref.losses.CategoricalLogitsNegativeLogProbLoss",
    "kfac_ref.losses.MultiBernoulliNegativeLogProbLoss",
    "kfac_ref.losses.NormalMeanNegativeLogProbLoss",
}


def test_declarations_are_what_is_exercised():
    from kfac_ref import capabilities

    declared = {n for n, s in capabilities.support_table().items() if s.state("dask") == "yes"}
    classes = {f"kfac_ref.factors.{c}" for c in (*DASK_FACTOR_CLASSES, *_FACTOR_BASES)}
    classes |= {f"kfac_ref.losses.{c}" for c in _LOSS_BASES}
    classes |= {f"kfac_ref.blocks.kfac_jax.{b}" for b in _KJ_BLOCKS if b not in _KJ_FULL}
    classes |= {f"kfac_ref.blocks.tf.{b}" for b in (*_TF_BLOCKS, *_TF_BASES)
                if b not in _TF_FULL and not b.endswith("-diag-input")}
    classes |= {f"kfac_ref.blocks.kfac_jax.{b}" for b in _KJ_BASES}
    classes |= {f"kfac_ref.nn.{c}" for c in _NN_BASES}
    classes |= {f"kfac_ref.optim.{c}" for c in _OPTIM_STATES}
    assert declared == DASK_EXERCISED | set(DASK_CALLS) | classes


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


# --------------------------------------------------------------------------------------
# Dense linear algebra on Dask arrays, and the walk of the "dask" column
# --------------------------------------------------------------------------------------
def _dask(a):
    """A host array as a Dask array, in two chunks along its first axis where it has one."""
    a = np.asarray(a)
    if a.ndim == 0 or a.shape[0] < 2:
        return da.from_array(a)
    return da.from_array(a, chunks=(a.shape[0] // 2, *a.shape[1:]))


# the base classes' machinery runs in every loss above
_LOSS_BASES = ("LossFunction", "NegativeLogProbLoss", "NaturalParamsNegativeLogProbLoss")

# The public objects that need a function the Dask namespace lacks, each with a call that
# must raise kfac_ref's error naming the function, the argument and what is missing.
DASK_REFUSED = {name: ("linalg.eigh", call) for name, call in EIGEN_CALLS.items()}
# differentiated by the outputs' own library: refused for NumPy (declared) and Dask alike
DASK_REFUSED["kfac_ref.losses.AutodiffLoss"] = (None, lambda f: losses.AutodiffLoss(
    f(_G), loss=lambda o, t: (o * o).sum()))

# what kronecker_block_matpower refuses on Dask (the eigen paths), tested below
_KRON_BLOCK_REFUSED = {
    "linalg.eigh": [lambda f: blocks.kronecker_block_matpower(f(_A), f(_B), f(_V32), -0.5, 0.1),
                    lambda f: blocks.kronecker_block_matpower(f(_A), f(_B), f(_V32), -1.0, 0.1,
                                                              exact=True)],
    "linalg.eigvalsh": [lambda f: blocks.kronecker_block_matpower(
        f(_A), f(_B), f(_V32), -1.0, 0.1, norm_type="2_norm")],
}

# the base class's machinery runs in every layer above
_NN_BASES = ("Layer",)
# the optimiser's state and step statistics are read in every run above
_OPTIM_STATES = ("OptimizerState", "StepStats")
def _dense_full_product(f):
    import test_blocks_kfac_jax as shared

    cell = _DaskCell if f is _dask else np
    block, state, _, _ = shared.make_state(cell, np.random.default_rng(0), "DenseFull")
    vec = tuple(f(np.ones(s)) for s in block.parameters_shapes)
    return block.multiply_inverse(state, vec, 0.1, exact_power=False, use_cached=False)


_NO_EIGH_AT = "the array namespace array_api_compat.dask.array has no {}"
# Objects declared "no" for Dask whose refusal is raised by a method (not at a function's
# boundary): the call, and the start of the error it must raise on Dask arrays.
DASK_REFUSED_METHODS = {
    "kfac_ref.blocks.kfac_jax.DenseEKFAC": (
        "DenseEKFAC.multiply: " + _NO_EIGH_AT.format("linalg.eigh"), _ekfac_product),
    "kfac_ref.blocks.kfac_jax.Conv2DEKFAC": (
        "Conv2DEKFAC.multiply: " + _NO_EIGH_AT.format("linalg.eigh"),
        lambda f: _ekfac_product(f, conv=True)),
    "kfac_ref.blocks.kfac_jax.EigenbasisKroneckerFactored": (
        "DenseEKFAC.multiply: " + _NO_EIGH_AT.format("linalg.eigh"), _ekfac_product),
    "kfac_ref.blocks.kfac_jax.Full": (
        "DenseFull.multiply_inverse: " + _NO_EIGH_AT.format("linalg.eigh"), _dense_full_product),
    "kfac_ref.blocks.tf.FullyConnectedSeriesFB": (
        "FullyConnectedSeriesFB.multiply_matpower: " + _NO_EIGH_AT.format("linalg.eigh"),
        _series_inverse),
    "kfac_ref.curvature.approximation_report": (
        "approximation_report: cannot run under jax.jit or on lazy arrays",
        lambda f: curv.approximation_report(*_problem(f))),
}


def _estimator_refusals(cls):
    short = cls.__name__
    eigh = _NO_EIGH_AT.format("linalg.eigh")
    # the block-diagonal estimator names the block whose refresh failed
    block = "" if cls is curv.ExplicitExactCurvature else "block 0 (layer 'd1'): "
    eigenvalues = (f"{short}.eigenvalues: " if cls is curv.ExplicitExactCurvature else
                   f"{short}.eigenvalues: {block}DenseTwoKroneckerFactored.eigenvalues: ")
    return [
        (f"{short}.multiply_matpower: {eigh}", lambda f: (lambda est, st: est.multiply_matpower(
            st, f(_NV), 0.1, -1.0, True, False))(*_estimator(f, cls))),
        (f"{short}.update_cache: {block}{eigh}", lambda f: (lambda est, st: est.update_cache(
            st, 0.1, -1.0, None, False))(*_estimator(f, cls, exact_powers_to_cache=-1.0))),
        (eigenvalues + eigh, lambda f: (lambda est, st: est.eigenvalues(st))(
            *_estimator(f, cls))),
    ]


def _operator_refusal(method):
    def call(f):
        m = f(_A)
        return getattr(CurvatureOperator(lambda v: m @ v, m, 4), method)()
    return (f"CurvatureOperator.{method}: " + _NO_EIGH_AT.format("linalg.eigvalsh"), call)


def _laplace_refusals(func):
    def call(structure):
        def run(f):
            params, curvature = _laplace_problem(f, structure)
            # by name: a full run's support recorder wraps the module's function
            if func.__name__ == "laplace_log_marginal_likelihood":
                return func(-7.25, params, curvature, 0.7, structure=structure)
            return func(params, curvature, 0.7, structure=structure)
        return run

    needs = {"kron": ("curvature[0][0]", "linalg.eigh"),
             "kron_factored": ("curvature[0][0]", "linalg.eigh"),
             "full": ("curvature[0]", "linalg.eigvalsh")}
    return [(f"{func.__name__}: {re.escape(arg)} must be an array whose namespace has {what} "
             f".*which has no {what}", call(s)) for s, (arg, what) in needs.items()]


# The paths of objects declared "yes" that need what the Dask namespace lacks (an
# eigendecomposition): each raises kfac_ref's error at the call, before computing.
DASK_PARTIAL_REFUSALS = {
    "kfac_ref.curvature.BlockDiagonalCurvature": _estimator_refusals(
        curv.BlockDiagonalCurvature),
    "kfac_ref.curvature.ExplicitExactCurvature": _estimator_refusals(
        curv.ExplicitExactCurvature),
    "kfac_ref.optim.KFACOptimizer": [
        ("KFACOptimizer.step: BlockDiagonalCurvature.update_cache: block 0 (layer 'd1'): "
         + _NO_EIGH_AT.format("linalg.eigh"),
         lambda f: (lambda opt, p, b: opt.step(opt.init(p, b), p, b))(
             optim.KFACOptimizer(_NET, _gauss, curv.BlockDiagonalCurvature(
                 _NET, _gauss, default_estimation_mode="ggn_exact"), learning_rate=0.1,
                 momentum=0.5), _params(f), (f(_NX), f(_NY))))],
    "kfac_ref.optim.preconditioned_direction": [
        ("preconditioned_direction: BlockDiagonalCurvature.multiply_matpower: "
         + _NO_EIGH_AT.format("linalg.eigh"),
         lambda f: (lambda est, st: optim.preconditioned_direction(
             est, st, f(_NV), 0.2, exact_power=True))(*_estimator(f)))],
    "kfac_ref.laplace.laplace_log_marginal_likelihood": _laplace_refusals(
        laplace.laplace_log_marginal_likelihood),
    "kfac_ref.laplace.laplace_log_marginal_likelihood_grad": _laplace_refusals(
        laplace.laplace_log_marginal_likelihood_grad),
    "kfac_ref.operators.CurvatureOperator": [_operator_refusal("eigenvalues"),
                                             _operator_refusal("slogdet")],
}


@pytest.mark.parametrize("name", sorted(DASK_REFUSED_METHODS))
def test_dask_refused_by_a_method(name):
    """An object declared "no" for Dask: the same call works on NumPy and raises kfac_ref's
    error naming the method and what is missing on Dask arrays, before computing."""
    from kfac_ref import KFACTypeError

    pattern, call = DASK_REFUSED_METHODS[name]
    call(np.asarray)
    with pytest.raises(KFACTypeError, match="^" + re.escape(pattern)):
        call(_dask)


@pytest.mark.parametrize("name", sorted(DASK_PARTIAL_REFUSALS))
def test_dask_eigen_paths_of_supported_objects_refused(name):
    """The paths of an object declared "yes" that need an eigendecomposition: each works on
    NumPy and raises kfac_ref's error (naming the method or argument and linalg.eigh /
    linalg.eigvalsh) on Dask arrays — never an AttributeError or a number."""
    from kfac_ref import KFACTypeError

    for pattern, call in DASK_PARTIAL_REFUSALS[name]:
        call(np.asarray)
        with pytest.raises(KFACTypeError, match="^" + (
                pattern if "must be" in pattern else re.escape(pattern))):
            call(_dask)



# the base classes' machinery (moving averages, registrations, caches) runs in every one
_FACTOR_BASES = ("FisherFactor", "DenseSquareMatrixFactor", "DiagonalFactor")


def _short(dotted):
    return dotted.rsplit(".", 1)[-1]


def test_no_public_object_is_untested_on_dask():
    """Every public object that takes arrays, in every module, is declared "yes" (with a
    call here or in the chunked tests above) or "no" (with a call that raises) for Dask —
    none "untested"."""
    from kfac_ref import capabilities

    table = capabilities.support_table()
    arrays = {n for n, s in table.items() if s.state("numpy") != "n/a"}
    classes = {f"kfac_ref.factors.{c}" for c in (*DASK_FACTOR_CLASSES, *_FACTOR_BASES)}
    assert classes <= arrays
    modules = {n.rsplit(".", 1)[0] for n in arrays}
    assert {"kfac_ref.curvature", "kfac_ref.nn", "kfac_ref.optim", "kfac_ref.laplace",
            "kfac_ref.operators", "kfac_ref.blocks.kfac_jax", "kfac_ref.blocks.tf"} <= modules
    left = sorted(n for n in arrays if table[n].state("dask") == "untested")
    assert not left, f"'untested' Dask entries: {left}"
    refused = {n for n, s in table.items() if s.state("dask") == "no"}
    assert refused == set(DASK_REFUSED) | set(DASK_REFUSED_METHODS) | {
        f"kfac_ref.blocks.kfac_jax.{b}" for b in _KJ_FULL} | {
        f"kfac_ref.blocks.tf.{b}" for b in _TF_FULL}


@pytest.mark.parametrize("name", sorted(DASK_CALLS))
def test_dask_agrees_with_numpy(name):
    """Each call of DASK_CALLS on Dask arrays stays lazy and, computed, agrees with the same
    call on NumPy arrays."""
    call = DASK_CALLS[name]
    eager = _flat(call(np.asarray))
    if all(isinstance(e, int) for e in eager):
        assert _flat(call(_dask)) == eager
        return
    expected = [np.asarray(e, dtype=np.float64) for e in eager]
    lazy = _flat(call(_dask))
    assert all(isinstance(r, da.Array) for r in lazy), [type(r) for r in lazy]
    got = dask.compute(*lazy, scheduler="sync")
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert np.shape(g) == e.shape
        _close(np.asarray(g, dtype=np.float64), e)


@pytest.mark.parametrize("name", sorted(DASK_REFUSED))
def test_dask_refused_before_computing(name):
    """A function that needs what the Dask namespace lacks raises kfac_ref's error, naming
    the function and the missing function, at the call — never an AttributeError."""
    from kfac_ref import KFACTypeError

    missing, call = DASK_REFUSED[name]
    if missing is None:  # refused on NumPy too: the declared reason
        from kfac_ref.capabilities import support_table

        reason = support_table()[name].reasons["dask"]
        with pytest.raises(KFACTypeError, match=f"^{_short(name)}: .*must be"):
            call(_dask)
        assert reason == support_table()[name].reasons["numpy"]
        return
    call(np.asarray)  # the same call works on NumPy
    with pytest.raises(KFACTypeError, match=(
            f"^{_short(name)}: [\\w\\[\\]]+ must be an array whose namespace has {missing} .*"
            f"array_api_compat.dask.array, which has no {missing}")):
        call(_dask)


def test_dask_cholesky_functions_against_dense_oracles():
    """The lower Cholesky factor, its inverse and the damped inverse on Dask arrays (one
    chunk and two) against numpy.linalg.cholesky / numpy.linalg.inv of the damped matrix."""
    m = _spd(6)
    damped = m + 0.1 * np.eye(6)
    low = np.linalg.cholesky(damped)
    for chunks in ((6, 6), (3, 6)):
        x = da.from_array(m, chunks=chunks)
        results = (K.damped_cholesky(x, 0.1), K.damped_cholesky_inverse(x, 0.1),
                   K.damped_inverse(x, 0.1))
        assert all(isinstance(r, da.Array) for r in results)
        chol, chol_inv, inv = dask.compute(*results, scheduler="sync")
        _close(chol, low)
        _close(chol_inv, np.linalg.inv(low))
        _close(inv, np.linalg.inv(damped))


@pytest.mark.parametrize("has_bias", [False, True])
def test_dask_sua_inverse_against_dense_oracle(has_bias):
    """The Sherman–Morrison SUA inverse on Dask arrays against numpy.linalg.inv of the dense
    damped SUA factor (built with NumPy)."""
    sigma, mu = _spd(3), _W.standard_normal(3)
    dense = factors.conv_input_sua_factor(sigma, mu, 4, has_bias, 0.1)
    lazy = factors.conv_input_sua_inverse(_dask(sigma), _dask(mu), 4, has_bias, 0.1)
    assert isinstance(lazy, da.Array)
    got = lazy.compute(scheduler="sync")
    assert float(np.max(np.abs(got - np.linalg.inv(dense)))) <= 1e-11 * float(
        np.max(np.abs(np.linalg.inv(dense))))


@pytest.mark.parametrize("func", [K.damped_inverse, K.damped_cholesky,
                                  K.damped_cholesky_inverse])
def test_dask_not_positive_definite_gives_nan_not_a_foreign_error(func):
    """Value checks never run on lazy arrays: a matrix that is not positive definite gives
    NaN at compute time on Dask (no foreign LinAlgError), and kfac_ref's error on NumPy."""
    from kfac_ref import KFACValueError

    m = np.array([[1.0, 2.0], [2.0, 1.0]])  # eigenvalues 3 and -1
    with pytest.raises(KFACValueError, match=f"^{func.__name__}: .*positive definite"):
        func(m, 0.0)
    got = func(da.from_array(m), 0.0).compute(scheduler="sync")
    assert np.isnan(got).any()


@pytest.mark.parametrize("name", sorted(DASK_FACTOR_CLASSES))
def test_dask_factor_class_agrees_with_numpy(name):
    """A factor updated with Dask arrays holds lazy statistics and inverses that, computed,
    agree with the same factor updated with NumPy arrays."""
    expected, _ = _factor_run(name, np.asarray)
    lazy, _ = _factor_run(name, _dask)
    assert all(isinstance(r, da.Array) for r in lazy), [type(r) for r in lazy]
    for g, e in zip(dask.compute(*lazy, scheduler="sync"), expected, strict=True):
        _close(np.asarray(g), np.asarray(e, dtype=np.float64))


@pytest.mark.parametrize("name", sorted(n for n, c in DASK_FACTOR_CLASSES.items()
                                        if c[2] is True))
def test_dask_factor_eigen_paths_refused(name):
    """A dense factor's eigendecomposition (a power other than -1, get_eigendecomp) on Dask
    statistics raises kfac_ref's error naming the method and linalg.eigh."""
    from kfac_ref import KFACTypeError

    _, fac = _factor_run(name, _dask)
    cls = type(fac).__name__  # NaiveFullFactor is FullFactor
    with pytest.raises(KFACTypeError, match=f"^{cls}.update_inverses: cov must be an array "
                       "whose namespace has linalg.eigh .*which has no linalg.eigh"):
        fac.register_matpower(-0.5, 0.1).update_inverses()
    with pytest.raises(KFACTypeError, match=f"^{cls}.get_eigendecomp: cov .*no linalg.eigh"):
        fac.get_eigendecomp()


@pytest.mark.parametrize("missing", sorted(_KRON_BLOCK_REFUSED))
def test_dask_kronecker_block_eigen_paths_refused(missing):
    """kronecker_block_matpower on Dask factors: the factored p = 1 and Cholesky inverse run
    (DASK_CALLS); the paths that need an eigendecomposition raise at the call."""
    from kfac_ref import KFACTypeError

    for call in _KRON_BLOCK_REFUSED[missing]:
        call(np.asarray)
        with pytest.raises(KFACTypeError, match=f"^kronecker_block_matpower: a must be an "
                           f"array whose namespace has {missing} .*which has no {missing}"):
            call(_dask)


def test_no_kernel_calls_an_optional_linalg_function_directly():
    """Every call of an optional linear-algebra function (one a namespace may lack: Dask's
    has no eigh, eigvalsh, slogdet) goes through _backend.optional_linalg, so a path the
    boundary checks did not cover raises kfac_ref's error, not an AttributeError."""
    import pathlib
    import re

    root = pathlib.Path(K.__file__).parent
    direct = re.compile(r"\.linalg\.(eigh|eigvalsh|slogdet|det|pinv)\(")
    found = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if direct.search(line) and "numpy.linalg" not in line and "np.linalg" not in line]
    assert not found, f"direct calls of optional linalg functions: {found}"


def test_an_unchecked_path_to_eigh_raises_kfac_error_on_dask():
    """The kernel guard, reached without a boundary check (a kernel called directly), gives
    kfac_ref's error naming what is missing; under errors_named the public name is put in
    front."""
    from kfac_ref import KFACTypeError
    from kfac_ref._backend import errors_named

    x = _dask(_A)
    xp = array_namespace(x)
    with pytest.raises(KFACTypeError, match="^the array namespace .*dask.* has no linalg.eigh"):
        K.clipped_eigh.kernel(xp, x)
    with pytest.raises(KFACTypeError, match="^some_function: the array namespace .*has no "
                       "linalg.eigvalsh"), errors_named("some_function"):
        K.factor_norm.kernel(xp, x, "2_norm")


# kfac-jax's curvature blocks on Dask statistics, built as tests/test_blocks_kfac_jax.py
# builds them: products and the factored (Cholesky) inverse run; what needs an
# eigendecomposition (exact inverses, eigenvalues, every inverse of a full block) raises.
_KJ_FULL = ("NaiveFull", "DenseFull", "Conv2DFull", "ScaleAndShiftFull")
_KJ_BLOCKS = ("ScaledIdentity", "NaiveDiagonal", "DenseDiagonal", "Conv2DDiagonal",
              "ScaleAndShiftDiagonal", "DenseTwoKroneckerFactored", "Conv2DTwoKroneckerFactored",
              "NaiveTNT", "DenseTNT", "Conv2DTNT", "DenseFOOF", "DenseKPSVD", *_KJ_FULL)
# the base classes' machinery runs in every block below
_KJ_BASES = ("CurvatureBlock", "BlockState", "Diagonal", "TwoKroneckerFactored")
_KJ_EIGEN_FREE = {"ScaledIdentity", "NaiveDiagonal", "DenseDiagonal", "Conv2DDiagonal",
                  "ScaleAndShiftDiagonal"}


class _DaskCell:
    """The ``asarray`` the block tests' builders call, making Dask arrays."""

    asarray = staticmethod(_dask)


@pytest.mark.parametrize("name", _KJ_BLOCKS)
def test_dask_kfac_jax_block_agrees_with_numpy_or_refuses(name):
    """Each product of a block updated with Dask statistics either agrees with the same
    block on NumPy, or — where it needs an eigendecomposition — raises kfac_ref's error
    naming the method and linalg.eigh at the call."""
    from kfac_ref import KFACTypeError

    eager = {k: c() for k, c in _kj_products(name, np).items()}
    eigen = {"exact_inverse", "eigenvalues"} | (
        {"multiply_inverse"} if name in _KJ_FULL else set())
    for what, call in _kj_products(name, _DaskCell).items():
        if what in eigen and name not in _KJ_EIGEN_FREE:
            method = "multiply_inverse" if what == "exact_inverse" else what
            with pytest.raises(KFACTypeError, match=f"^{name}.{method}: the array namespace "
                               ".*dask.* has no linalg.eigh"):
                call()
            continue
        got = _flat(call())
        assert all(isinstance(g, da.Array) for g in got), (what, [type(g) for g in got])
        for g, e in zip(dask.compute(*got, scheduler="sync"), _flat(eager[what]), strict=True):
            _close(np.asarray(g), np.asarray(e, dtype=np.float64))


# TF K-FAC's Fisher blocks on Dask factors, built as tests/test_blocks_tf.py builds them:
# products, inverses and Cholesky products agree with NumPy; another power raises.
def _tf_products(block, vec):
    return {"full_fisher_block": lambda: block.full_fisher_block(),
            "multiply": lambda: block.multiply(vec),
            "multiply_inverse": lambda: block.multiply_inverse(vec),
            "multiply_cholesky": lambda: block.multiply_cholesky(vec),
            "multiply_cholesky_inverse": lambda: block.multiply_cholesky_inverse(vec),
            "multiply_matpower": lambda: block.multiply_matpower(vec, -0.5)}


class _HostCell:
    """The ``asarray``/``round_host`` the TF block tests' builders call (NumPy)."""

    asarray = staticmethod(np.asarray)

    @staticmethod
    def round_host(host):
        return np.asarray(host, dtype=np.float64)


class _DaskTFCell(_HostCell):
    asarray = staticmethod(_dask)


def _tf_blocks(cell):
    import test_blocks_tf as shared
    from conftest import random_spd

    from kfac_ref.blocks import tf

    out = {}
    for name, ctor, a, g, kshape, bias, _, _ in shared.kron_cases(np.random.default_rng(0)):
        vec, _ = shared.make_vector(cell, np.random.default_rng(5), kshape, bias)
        out[name] = (ctor(cell.asarray(a), cell.asarray(g), 0.3), vec)
    rng = np.random.default_rng(1)  # the same draws for both cells
    d = rng.uniform(0.5, 2.0, (4, 3))
    vec = (cell.asarray(rng.standard_normal((3, 3))), cell.asarray(rng.standard_normal(3)))
    out["FullyConnectedDiagonalFB"] = (tf.FullyConnectedDiagonalFB(cell.asarray(d), 0.3,
                                                                   has_bias=True), vec)
    out["NaiveDiagonalFB"] = (tf.NaiveDiagonalFB(cell.asarray(d.reshape(-1)), 0.3,
                                                 [(3, 3), (3,)]), vec)
    out["FullFB"] = (tf.FullFB(cell.asarray(random_spd(rng, 12, 0.5, 2.0)), 0.3,
                               [(3, 3), (3,)]), vec)
    out["NaiveFullFB"] = (tf.NaiveFullFB(cell.asarray(random_spd(rng, 12, 0.5, 2.0)), 0.3,
                                         [(3, 3), (3,)]), vec)
    out["DiagonalFB"] = (tf.DiagonalFB(cell.asarray(d.reshape(-1)), 0.3, [(3, 3), (3,)]), vec)
    ss_vec = (cell.asarray(rng.standard_normal(3)), cell.asarray(rng.standard_normal(3)))
    out["ScaleAndShiftFullFB"] = (tf.ScaleAndShiftFullFB(
        cell.asarray(random_spd(rng, 6, 0.5, 2.0)), 0.3), ss_vec)
    out["ScaleAndShiftDiagonalFB"] = (tf.ScaleAndShiftDiagonalFB(
        cell.asarray(rng.uniform(0.5, 2.0, 6)), 0.3), ss_vec)
    out["ConvDiagonalFB"] = (tf.ConvDiagonalFB(cell.asarray(d), 0.3, (1, 3, 1, 3),
                                               has_bias=True, num_locations=4),
                             (cell.asarray(rng.standard_normal((1, 3, 1, 3))), vec[1]))
    out["EmbeddingKFACMultiIndepFB"] = (tf.EmbeddingKFACMultiIndepFB(
        cell.asarray(rng.uniform(0.5, 2.0, 4)), cell.asarray(random_spd(rng, 3, 0.5, 2.0)),
        0.3, 3), cell.asarray(rng.standard_normal((4, 3))))
    # depthwise blocks from a batch (chunked on Dask): inputs [N, H, W, C], output
    # gradients [N, H', W', C·M] of a VALID 2 × 3 depthwise kernel with multiplier 2
    x, gy = rng.standard_normal((4, 5, 5, 2)), rng.standard_normal((4, 4, 3, 4))
    dw_vec = cell.asarray(rng.standard_normal((2, 3, 2, 2)))
    for name in ("DepthwiseConvDiagonalFB", "DepthwiseConvKFCBasicFB"):
        out[name] = (getattr(tf, name).from_data(cell.asarray(x), cell.asarray(gy), 0.3,
                                                 (2, 3, 2, 2), "VALID"), dw_vec)
    return out


_TF_BLOCKS = _TF_BLOCK_NAMES
_TF_DIAGONAL = {"FullyConnectedDiagonalFB", "NaiveDiagonalFB", "DiagonalFB",
                "ScaleAndShiftDiagonalFB", "ConvDiagonalFB", "DepthwiseConvDiagonalFB"}
# the base classes' machinery runs in every block above
_TF_BASES = ("FisherBlock", "KroneckerProductFB")
# full blocks: every inverse and power takes an eigendecomposition (declared "no")
_TF_FULL = ("FullFB", "NaiveFullFB", "ScaleAndShiftFullFB")


@pytest.mark.parametrize("name", _TF_BLOCKS)
def test_dask_tf_block_agrees_with_numpy_or_refuses(name):
    """A TF Fisher block of Dask factors: every product agrees with the same block on NumPy,
    except those that need an eigendecomposition (a power other than ±1; every inverse of a
    full block), which raise kfac_ref's error naming linalg.eigh."""
    from kfac_ref import KFACTypeError

    eager_block, eager_vec = _tf_blocks(_HostCell)[name]
    lazy_block, lazy_vec = _tf_blocks(_DaskTFCell)[name]
    eager = _tf_products(eager_block, eager_vec)
    eigen = set() if name in _TF_DIAGONAL else {"multiply_matpower"} | (
        {"multiply_inverse"} if name in _TF_FULL else set())
    for what, call in _tf_products(lazy_block, lazy_vec).items():
        if what in eigen:
            with pytest.raises(KFACTypeError, match=f"^{lazy_block.__class__.__name__}"
                               r"\.multiply_\w+: the array namespace .*dask.* has no "
                               "linalg.eigh"):
                call()
            continue
        got = _flat(call())
        assert all(isinstance(g, da.Array) for g in got), (what, [type(g) for g in got])
        for g, e in zip(dask.compute(*got, scheduler="sync"), _flat(eager[what]()),
                        strict=True):
            _close(np.asarray(g), np.asarray(e, dtype=np.float64))

