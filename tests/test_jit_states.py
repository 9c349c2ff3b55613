"""States that cross the ``jax.jit`` boundary: block and estimator states are JAX pytrees
(:func:`kfac_ref.register_jax_pytrees`), passed into a jitted function, returned from it and
closed over by it, with the numbers of the eager NumPy computation on the same data.

Every public method of the blocks declared jit "yes" in :mod:`kfac_ref.capabilities`
(update, cache, every product, eigenvalues, dense matrix, norm, effective weight) runs on a
state that entered the jitted function as an argument and on one it closed over; the
estimators' step (update + cache + product) runs jitted with the state in and out.
Comparisons are at the suite's float64 tolerance ``4096 · eps`` (tests/conftest.py): the same
formulas on the same numbers, in another order of floating-point operations (XLA's kernels),
and for the eigendecompositions another LAPACK path — products and spectra are compared,
not eigenvectors.  The sampling modes take a JAX PRNG key: the jitted and the eager step draw
the same numbers from the same key (not the Generator's numbers, which are another
algorithm's).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import RTOL_FACTOR, assert_allclose_normwise

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import kfac_ref  # noqa: E402
import kfac_ref.nn as nn  # noqa: E402
from kfac_ref import KFACTypeError  # noqa: E402
from kfac_ref.blocks import kfac_jax as kj  # noqa: E402
from kfac_ref.curvature import (  # noqa: E402
    BlockDiagonalCurvature,
    BlockDiagonalState,
    ExplicitExactCurvature,
)
from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss as CE  # noqa: E402

RTOL = RTOL_FACTOR * float(np.finfo(np.float64).eps)


pytestmark = pytest.mark.usefixtures("jax_x64")  # float64 for every test


def _close(got, want):
    """Two pytrees of arrays (JAX, NumPy) equal leaf by leaf at the float64 tolerance."""
    g_leaves, g_def = jax.tree_util.tree_flatten(got)
    w_leaves, w_def = jax.tree_util.tree_flatten(want)
    assert g_def == w_def
    for g, w in zip(g_leaves, w_leaves, strict=True):
        w = np.asarray(w, dtype=np.float64)
        g = np.asarray(g)
        assert g.shape == w.shape
        assert_allclose_normwise(g, w, RTOL)


# -- blocks --------------------------------------------------------------------------------------
_CONV = dict(inputs_shape=(4, 5, 5, 2), kernel_shape=(2, 2, 2, 3))
BLOCKS = {
    "DenseTwoKroneckerFactored": (lambda: kj.DenseTwoKroneckerFactored(3, 2), False),
    "DenseDiagonal": (lambda: kj.DenseDiagonal(3, 2), False),
    "DenseFull": (lambda: kj.DenseFull(3, 2), False),
    "DenseEKFAC": (lambda: kj.DenseEKFAC(3, 2), False),
    "Conv2DTwoKroneckerFactored": (lambda: kj.Conv2DTwoKroneckerFactored(**_CONV), True),
    "Conv2DDiagonal": (lambda: kj.Conv2DDiagonal(**_CONV), True),
    "Conv2DFull": (lambda: kj.Conv2DFull(**_CONV), True),
    "DenseTNT": (lambda: kj.DenseTNT(3, 2), False),
    "Conv2DTNT": (lambda: kj.Conv2DTNT(**_CONV), True),
    "DenseFOOF": (lambda: kj.DenseFOOF(3, 2), False),
    "DenseKPSVD": (lambda: kj.DenseKPSVD(3, 2), False),
}
# what tests/test_transforms.py checks against the jit column of kfac_ref.capabilities
JIT_STATE_EXERCISED = {f"kfac_ref.blocks.kfac_jax.{n}" for n in BLOCKS} | {
    "kfac_ref.blocks.kfac_jax.BlockState",
    "kfac_ref.curvature.BlockDiagonalCurvature",
    "kfac_ref.curvature.ExplicitExactCurvature",
}


def _block_data(conv, rng, zero_grads=False):
    if conv:
        x, g = rng.standard_normal((4, 5, 5, 2)), rng.standard_normal((4, 4, 4, 3))
    else:
        x, g = rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    return x, 0.0 * g if zero_grads else g


def _products(block, st, v):
    """Every state-reading method of a block, in one dict."""
    return {
        "exact": block.multiply_matpower(st, v, 0.1, -1.0, True, False),
        "approx": block.multiply_matpower(st, v, 0.1, -1.0, False, False),
        "exact_cached": block.multiply_matpower(st, v, 0.1, -1.0, True, True),
        "approx_cached": block.multiply_matpower(st, v, 0.1, -1.0, False, True, "avg_diag"),
        "multiply": block.multiply(st, v, 0.1, True, False),
        "inverse": block.multiply_inverse(st, v, 0.1, True, True),
        "eigenvalues": block.eigenvalues(st),
        "eigenvalues_cached": block.eigenvalues(st, True),
        "dense": block.to_dense_matrix(st),
        "norm": block.norm(st, "avg_fro"),
        "weight": block.effective_identity_weight(st, 0.1, "avg_diag", True),
    }


def _cache(block, st):
    # norm-scaled: inside the trace the cached λ is traced, and strict_cache's comparison
    # of it with the product's λ is a value check, skipped there
    return block.update_cache(st, 0.1, [-1.0], [-1.0], True, "avg_diag")


def _update(block, st, x, g):
    return block.update_curvature_matrix_estimate(st, {"inputs": x, "outputs_grad": g}, 0.5,
                                                  1.0, 4)


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_state_crosses_jit(name):
    make, conv = BLOCKS[name]
    block = make()
    rng = np.random.default_rng(20261205)
    x, g = _block_data(conv, rng)
    vec = tuple(rng.standard_normal(s) for s in block.parameters_shapes)
    declared = dict(exact_powers_to_cache=[-1.0], approx_powers_to_cache=[-1.0],
                    cache_eigenvalues=True)

    # eager NumPy reference: two updates (W = 1 then 1.5), the cache, every product
    st = block.init(np.zeros(()), **declared)
    st = _update(block, _update(block, st, x, g), x, g)
    st = _cache(block, st)
    want = _products(block, st, vec)

    # JAX: the state goes into and comes out of every jitted call
    traces = []

    def update(st, x, g):
        traces.append(1)
        return _update(block, st, x, g)

    jst = block.init(jnp.zeros(()), **declared)
    jupdate = jax.jit(update)
    jx, jg = jnp.asarray(x), jnp.asarray(g)
    jst = jupdate(jupdate(jst, jx, jg), jx, jg)
    assert len(traces) == 1  # the moving average's weight is a leaf: one compilation
    assert isinstance(jst, kj.BlockState)
    jst = jax.jit(lambda s: _cache(block, s))(jst)
    jv = tuple(jnp.asarray(a) for a in vec)
    _close(jax.jit(lambda s, v: _products(block, s, v))(jst, jv), want)
    # ... and closed over (concrete arrays staged out inside the trace)
    _close(jax.jit(lambda v: _products(block, jst, v))(jv), want)


def test_zero_factor_with_a_closed_over_state():
    """The issue's case: kfac-jax's zero-factor fallback (a zero G: the damped block is λI)
    with the state captured from outside the jitted function and a traced vector; the
    branch is a ``where`` inside the trace, a host branch eagerly, same numbers."""
    block = kj.DenseTwoKroneckerFactored(3, 2)
    rng = np.random.default_rng(3)
    x, g = _block_data(False, rng, zero_grads=True)
    vec = tuple(jnp.asarray(rng.standard_normal(s)) for s in block.parameters_shapes)
    st = block.init(jnp.zeros(()))
    st = block.update_curvature_matrix_estimate(st, {"inputs": jnp.asarray(x),
                                                     "outputs_grad": jnp.asarray(g)}, 0.0, 1.0, 4)
    eager = block.multiply_matpower(st, vec, 0.1, -1.0, False, False)
    got = jax.jit(lambda v: block.multiply_matpower(st, v, 0.1, -1.0, False, False))(vec)
    for e, j, v in zip(eager, got, vec, strict=True):
        np.testing.assert_allclose(np.asarray(e), np.asarray(v) / 0.1, rtol=RTOL)
        np.testing.assert_allclose(np.asarray(j), np.asarray(v) / 0.1, rtol=RTOL)


@pytest.mark.parametrize("zero_grads", [False, True])
def test_a_cache_built_eagerly_and_under_jit_is_one_pytree(zero_grads):
    """A Kronecker block's cached approximate powers have one structure whether the zero-
    factor test was read on the host (eager) or staged out (jit): a loop whose body refreshes
    the cache (``lax.scan``) starts from an eagerly cached state, and its products equal the
    eager ones (λ^p v for a zero factor)."""
    block = kj.DenseTwoKroneckerFactored(3, 2)
    rng = np.random.default_rng(11)
    x, g = (jnp.asarray(a) for a in _block_data(False, rng, zero_grads=zero_grads))
    vec = tuple(jnp.asarray(rng.standard_normal(s)) for s in block.parameters_shapes)
    st = block.init(jnp.zeros(()), approx_powers_to_cache=[-1.0])
    st = _update(block, st, x, g)

    def cache(s):
        return block.update_cache(s, 0.1, None, [-1.0], False)

    eager, jitted = cache(st), jax.jit(cache)(st)
    assert (jax.tree_util.tree_structure(eager) == jax.tree_util.tree_structure(jitted))

    def body(s, _):
        s = cache(_update(block, s, x, g))
        return s, block.multiply_matpower(s, vec, 0.1, -1.0, False, True)

    _, products = jax.lax.scan(body, eager, None, length=2)
    want = block.multiply_matpower(cache(_update(block, eager, x, g)), vec, 0.1, -1.0, False,
                                   True)
    _close(tuple(p[0] for p in products), want)
    if zero_grads:
        _close(want, tuple(v / 0.1 for v in vec))


def test_states_are_pytrees_with_static_options():
    block = kj.DenseTwoKroneckerFactored(3, 2)
    st = block.init(jnp.zeros(()), exact_powers_to_cache=[-1.0])
    st = block.update_cache(st, 0.1, [-1.0], [], False)
    leaves, treedef = jax.tree_util.tree_flatten(st)
    # A's and G's sums and weights, like, the cached factors and eigendecompositions
    assert all(isinstance(leaf, (jax.Array, float)) for leaf in leaves)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.cache["declared"] == st.cache["declared"]  # static, not a leaf
    assert back.cache["scale"] == 1.0
    doubled = jax.tree_util.tree_map(lambda a: a * 2, BlockDiagonalState((st, st)))
    assert isinstance(doubled, BlockDiagonalState)
    np.testing.assert_array_equal(np.asarray(doubled.blocks_states[1].statistics[0].raw),
                                  2 * np.asarray(st.statistics[0].raw))


def _structure_kept(tree):
    """``tree_map`` to Python numbers or strings keeps a pytree's structure, as for any JAX
    pytree: which cache entries are leaves is remembered, not decided again by value (also
    after a second map)."""
    treedef = jax.tree_util.tree_structure(tree)
    for fill in (lambda _: 0, lambda _: 1.5, lambda _: "x"):
        mapped = jax.tree_util.tree_map(fill, tree)
        assert jax.tree_util.tree_structure(mapped) == treedef
        again = jax.tree_util.tree_map(lambda _: True, mapped)
        assert jax.tree_util.tree_structure(again) == treedef


def test_mapping_a_state_to_numbers_keeps_its_structure():
    """Block, block-diagonal, explicit and optimiser states keep their structure under
    ``tree_map(lambda _: 0, state)``; the mapped tree serves as ``vmap``'s ``in_axes`` over
    a stack of cached states, and the batched products equal the per-state ones."""
    block = kj.DenseTwoKroneckerFactored(3, 2)
    rng = np.random.default_rng(5)
    x, g = (jnp.asarray(a) for a in _block_data(False, rng))
    st = block.init(jnp.zeros(()), exact_powers_to_cache=[-1.0], approx_powers_to_cache=[-1.0])
    st = block.update_cache(_update(block, st, x, g), 0.1, [-1.0], [-1.0], False)
    _structure_kept(st)
    _structure_kept(BlockDiagonalState((st, st)))

    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a, 2 * a]), st)
    vec = tuple(jnp.asarray(rng.standard_normal(s)) for s in block.parameters_shapes)

    def product(s, v):
        return block.multiply_matpower(s, v, 0.1, -1.0, True, True)

    axes = jax.tree_util.tree_map(lambda _: 0, st)
    batched = jax.vmap(product, in_axes=(axes, None))(stacked, vec)
    for i in range(2):
        _close(tuple(b[i] for b in batched),
               product(jax.tree_util.tree_map(lambda a, i=i: a[i], stacked), vec))

    net, params, xs, ys, _ = _net_case()
    for cls in (BlockDiagonalCurvature, ExplicitExactCurvature):
        est = cls(net, _ce)
        est_st = est.init(None, (_jax_tree(params), (jnp.asarray(xs), jnp.asarray(ys))),
                          exact_powers_to_cache=[-1.0])
        _structure_kept(est.update_cache(est_st, 0.1, [-1.0], [], False))

    from kfac_ref.optim import KFACOptimizer

    opt = KFACOptimizer(net, CE, BlockDiagonalCurvature(net, _ce), damping=0.1,
                        momentum_type="qmodel", curvature_ema=0.5)
    jparams, batch = _jax_tree(params), (jnp.asarray(xs), jnp.asarray(ys))
    _, opt_st = opt.step(opt.init(jparams, batch, np.random.default_rng(0)), jparams, batch,
                         np.random.default_rng(1))
    _structure_kept(opt_st)


def test_a_numpy_state_becomes_a_jax_state_by_tree_map():
    kfac_ref.register_jax_pytrees()
    block = kj.DenseDiagonal(3, 2)
    rng = np.random.default_rng(1)
    st = block.update_curvature_matrix_estimate(
        block.init(np.zeros(())), {"inputs": rng.standard_normal((4, 3)),
                                   "outputs_grad": rng.standard_normal((4, 2))}, 0.0, 1.0, 4)
    jst = jax.tree_util.tree_map(jnp.asarray, st)
    vec = tuple(rng.standard_normal(s) for s in block.parameters_shapes)
    want = block.multiply_inverse(st, vec, 0.1, True, False)
    got = jax.jit(lambda s, v: block.multiply_inverse(s, v, 0.1, True, False))(
        jst, tuple(jnp.asarray(a) for a in vec))
    _close(got, want)


def test_importing_kfac_ref_does_not_import_jax():
    code = "import sys, kfac_ref; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- estimators ----------------------------------------------------------------------------------
def _ce(f, y):
    return CE(f, targets=y)


def _net_case():
    rng = np.random.default_rng(7)
    net = nn.Sequential([("d1", nn.Dense(3, 4)), ("a", nn.Activation("tanh")),
                         ("d2", nn.Dense(4, 3))])
    params = net.init_params(rng, np.zeros(1))
    x, y = rng.standard_normal((5, 3)), np.array([0, 2, 1, 1, 0])
    return net, params, x, y, rng.standard_normal(net.num_params)


def _jax_tree(tree):
    return jax.tree_util.tree_map(jnp.asarray, tree)


def _step(est, mode, rng):
    def step(st, params, x, y, v):
        st = est.update_curvature_matrix_estimate(st, 0.5, 1.0, 5, rng, (params, (x, y)), mode)
        st = est.update_cache(st, 0.1, [-1.0], [], False)
        return st, est.multiply_matpower(st, v, 0.1, -1.0, True, True)
    return step


@pytest.mark.parametrize("cls", [BlockDiagonalCurvature, ExplicitExactCurvature])
def test_estimator_step_under_jit(cls):
    """One estimator step (update the curvature estimate, refresh the cache, one cached
    inverse product) jitted twice with the state in and out, against NumPy; then the
    product with the state closed over."""
    net, params, x, y, vec = _net_case()
    est = cls(net, _ce)
    step = _step(est, "ggn_exact", None)
    st = est.init(None, (params, (x, y)), exact_powers_to_cache=[-1.0])
    st, _ = step(st, params, x, y, vec)
    st, want = step(st, params, x, y, vec)

    jst = est.init(None, (_jax_tree(params), (jnp.asarray(x), jnp.asarray(y))),
                   exact_powers_to_cache=[-1.0])
    args = (_jax_tree(params), jnp.asarray(x), jnp.asarray(y), jnp.asarray(vec))
    jstep = jax.jit(step)
    jst, _ = jstep(jst, *args)
    jst, got = jstep(jst, *args)
    _close(got, want)
    _close(jax.jit(lambda v: est.multiply_matpower(jst, v, 0.1, -1.0, True, True))(args[-1]),
           want)
    _close(est.to_dense_matrix(jst), est.to_dense_matrix(st))


@pytest.mark.parametrize("mode", ["fisher_gradients", "ggn_curvature_prop"])
def test_sampling_modes_take_a_jax_key(mode):
    """A JAX key as the random source: the jitted step draws what the eager step draws from
    the same key; another key, other draws; ``num_samples = 2`` splits the key.  (A NumPy
    Generator with JAX arrays: tests/test_transforms.py.)"""
    net, params, x, y, vec = _net_case()
    est = BlockDiagonalCurvature(net, _ce, num_samples=2)
    args = (_jax_tree(params), jnp.asarray(x), jnp.asarray(y), jnp.asarray(vec))
    st0 = est.init(None, (args[0], (args[1], args[2])), exact_powers_to_cache=[-1.0])

    def step(st, key, *a):
        return _step(est, mode, key)(st, *a)

    key = jax.random.key(0)
    eager_state, eager = step(st0, key, *args)
    jstep = jax.jit(step)
    jit_state, got = jstep(st0, key, *args)
    _close(got, eager)
    _close(est.to_dense_matrix(jit_state), est.to_dense_matrix(eager_state))
    _, other = jstep(st0, jax.random.key(1), *args)
    assert not np.allclose(np.asarray(other), np.asarray(got))


def test_a_jax_key_needs_jax_arrays():
    net, params, x, y, _ = _net_case()
    est = BlockDiagonalCurvature(net, _ce)
    st = est.init(None, (params, (x, y)))
    with pytest.raises(KFACTypeError, match=r"rng must be a numpy.random.Generator for arrays "
                                            r"that are not JAX arrays"):
        est.update_curvature_matrix_estimate(st, 0.0, 1.0, 5, jax.random.key(0),
                                             (params, (x, y)), "fisher_gradients")
    with pytest.raises(KFACTypeError, match=r"rng must be a numpy.random.Generator .* or a JAX "
                                            r"PRNG key"):
        est.update_curvature_matrix_estimate(st, 0.0, 1.0, 5, 0, (params, (x, y)),
                                             "fisher_gradients")


def test_loss_samples_from_a_jax_key_follow_the_distribution():
    """Gumbel-max with jax.random's Gumbel noise: sample frequencies within 5 standard errors
    of softmax(z) (4000 draws of 3 classes)."""
    z = np.array([0.3, -1.0, 1.2])
    logits = jnp.asarray(np.tile(z, (4000, 1)))
    draws = np.asarray(CE(logits).sample(jax.random.key(5)))
    p = np.exp(z) / np.exp(z).sum()
    freq = np.bincount(draws, minlength=3) / draws.size
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / draws.size))
    again = np.asarray(jax.jit(lambda k: CE(logits).sample(k))(jax.random.key(5)))
    np.testing.assert_array_equal(again, draws)
    legacy = np.asarray(CE(logits).sample(jax.random.PRNGKey(5)))  # a raw uint32[2] key
    assert legacy.shape == draws.shape and set(np.unique(legacy)) <= {0, 1, 2}


def test_jitted_step_next_to_kfac_jax():
    """kfac_ref's jitted estimator step and kfac-jax's, in one process, on one network:
    the same (unsymmetrised) Kronecker blocks in ``ggn_exact`` mode."""
    kfac_jax = pytest.importorskip("kfac_jax")
    net, params, x, y, _ = _net_case()
    est = BlockDiagonalCurvature(net, _ce, block_kwargs={"symmetrize": False})
    jparams, jx, jy = _jax_tree(params), jnp.asarray(x), jnp.asarray(y)
    st = est.init(None, (jparams, (jx, jy)))
    st = jax.jit(lambda s, p, a, b: est.update_curvature_matrix_estimate(
        s, 0.0, 1.0, 5, None, (p, (a, b)), "ggn_exact"))(st, jparams, jx, jy)
    ours = est.to_diagonal_block_dense_matrix(st)

    def loss_fn(theta, batch):
        h, targets = batch
        for i, (w, b) in enumerate(theta):
            out = h @ w + b
            h = kfac_jax.register_dense(out, h, w, b)
            if i == 0:
                h = jnp.tanh(h)
        kfac_jax.register_softmax_cross_entropy_loss(h, targets)
        return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(h), targets[:, None], 1))

    theta = [[jparams[0][0], jparams[0][1]], [jparams[2][0], jparams[2][1]]]
    peer = kfac_jax.BlockDiagonalCurvature(loss_fn, auto_register_tags=False)
    key = jax.random.PRNGKey(0)
    pst = peer.init(key, (theta, (jx, jy)), exact_powers_to_cache=None,
                    approx_powers_to_cache=None)
    pst = jax.jit(lambda s, th, a, b: peer.update_curvature_matrix_estimate(
        s, ema_old=0.0, ema_new=1.0, identity_weight=0.0, batch_size=5, rng=key,
        func_args=(th, (a, b)), estimation_mode="ggn_exact"))(pst, theta, jx, jy)
    theirs = peer.to_diagonal_block_dense_matrix(pst)
    _close(tuple(theirs), tuple(np.asarray(o) for o in ours))


def test_optimizer_state_crosses_jit():
    """An optimiser state (with its step statistics) is a pytree: it leaves a jitted function
    with the arrays it entered with, and the next eager step from the returned state gives
    the numbers of the next step from the original one; the step counter, the flags and a
    Python-number damping are static."""
    from kfac_ref.optim import KFACOptimizer, OptimizerState, StepStats

    net, params, x, y, _ = _net_case()
    params, batch = _jax_tree(params), (jnp.asarray(x), jnp.asarray(y))
    opt = KFACOptimizer(net, CE, BlockDiagonalCurvature(net, _ce), damping=0.1,
                        momentum_type="qmodel", curvature_ema=0.5)
    state = opt.init(params, batch, np.random.default_rng(0))
    params1, state1 = opt.step(state, params, batch, np.random.default_rng(1))
    assert isinstance(state1.stats, StepStats)

    leaves, treedef = jax.tree_util.tree_flatten(state1)
    # arrays, and the moving averages' weights (leaves even as Python numbers)
    assert all(isinstance(leaf, (jax.Array, float)) for leaf in leaves)
    assert sum(isinstance(leaf, jax.Array) for leaf in leaves) > len(leaves) // 2
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(rebuilt, OptimizerState)
    assert (rebuilt.step, rebuilt.damping) == (state1.step, state1.damping) == (1, 0.1)
    assert rebuilt.stats.updated_inverse == state1.stats.updated_inverse

    through = jax.jit(lambda s: s)(state1)
    assert through.step == 1 and through.stats.step == state1.stats.step
    _close(through, state1)
    want = opt.step(state1, params1, batch, np.random.default_rng(2))
    got = opt.step(through, params1, batch, np.random.default_rng(2))
    _close(got[0], want[0])
    _close(got[1].velocity, want[1].velocity)


def test_closed_over_ids_of_an_embedding_under_jit():
    """Integer ids a jitted function closes over are concrete arrays, but their id-range
    check is staged out inside the trace and cannot be read: it passes, as the finiteness
    scan of closed-over floats does, and the update equals the eager one."""
    rng = np.random.default_rng(0)
    net = nn.Sequential([("e", nn.Embedding(5, 3)), ("f", nn.Flatten()), ("d", nn.Dense(6, 3))])
    params = _jax_tree(net.init_params(rng, np.zeros(1)))
    ids, y = jnp.asarray(rng.integers(0, 5, (5, 2))), jnp.asarray([0, 2, 1, 1, 0])
    est = BlockDiagonalCurvature(net, _ce)
    st = est.init(None, (params, (ids, y)))

    def update(s, p):
        return est.update_curvature_matrix_estimate(s, 0.0, 1.0, 5, None, (p, (ids, y)),
                                                    "ggn_exact")

    _close(jax.jit(update)(st, params), update(st, params))
    with pytest.raises(kfac_ref.KFACValueError, match=r"ids must lie in \[0, vocab_size\)"):
        est.update_curvature_matrix_estimate(st, 0.0, 1.0, 5, None,
                                             (params, (ids + 5, y)), "ggn_exact")
