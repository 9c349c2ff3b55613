"""BlockDiagonalCurvature's boundary: every bad argument is refused by name before any
computation, in the name of the method the user called, with the block named when one
block's refresh fails; a refused ``init`` leaves the estimator as it was.

The hyper-parameters (identity weight, power, moving-average weights) may be 0-D arrays,
so that they can live on the device or be traced; such an array must share the state's
namespace, device and precision, as the vector must.
"""

from __future__ import annotations

import numpy as np
import pytest
from losses_helpers import ce
from scalar_kinds import other_namespace, other_precision

import kfac_ref.nn as nn
from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref.blocks import kfac_jax as B
from kfac_ref.curvature import BlockDiagonalCurvature


def mlp():
    return nn.Sequential([("d1", nn.Dense(3, 4)), ("a1", nn.Activation("tanh")),
                          ("d2", nn.Dense(4, 3)), ("a2", nn.Activation("tanh")),
                          ("d3", nn.Dense(3, 2))])


def updated(xp, rng, n=5, **init_kw):
    """``(estimator, func_args, state)`` after one exact update of an MLP."""
    net = mlp()
    params = tuple(tuple(xp.asarray(a) for a in p) for p in net.init_params(rng, np.zeros(1)))
    x = xp.asarray(rng.standard_normal((n, 3)))
    y = xp.asarray(rng.integers(0, 2, n))
    est = BlockDiagonalCurvature(net, ce)
    fa = (params, (x, y))
    st = est.init(None, fa, **init_kw)
    st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, n, None, fa, "ggn_exact")
    return est, fa, st


def test_a_0d_weight_of_the_states_precision_is_accepted(xp, rng):
    est, _, st = updated(xp, rng, approx_powers_to_cache=-1.0)
    w = xp.asarray(0.1)
    v = xp.asarray(rng.standard_normal(est.dim))
    st_c = est.update_cache(st, w, None, -1.0, False)
    got = est.multiply_matpower(st_c, v, w, -1.0, False, True)
    want = est.multiply_matpower(st, v, 0.1, -1.0, False, False)
    assert got.dtype == v.dtype
    np.testing.assert_allclose(xp.to_numpy(got), xp.to_numpy(want),
                               rtol=1e-10 if xp.float64 else 1e-4)


def test_a_0d_hyper_parameter_of_another_precision_is_refused(xp, rng):
    # otherwise a float64 weight would turn a float32 product into float64 unannounced, or
    # a float32 one fail inside the library
    est, fa, st = updated(xp, rng, approx_powers_to_cache=-1.0)
    v = xp.asarray(rng.standard_normal(est.dim))
    w = other_precision(xp, 0.1)
    with pytest.raises(KFACTypeError, match=r"multiply_matpower: identity_weight must have the "
                                            r"floating dtype of state\.blocks_states\[0\]"):
        est.multiply_matpower(st, v, w, -1.0, True, False)
    with pytest.raises(KFACTypeError, match=r"multiply_matpower: identity_weight\[1\] must "
                                            r"have the floating dtype"):
        est.multiply_matpower(st, v, (0.1, w, 0.1), -1.0, True, False)
    with pytest.raises(KFACTypeError, match=r"multiply_matpower: power must have"):
        est.multiply_matpower(st, v, 0.1, other_precision(xp, -1.0), True, False)
    with pytest.raises(KFACTypeError, match=r"update_cache: identity_weight must have"):
        est.update_cache(st, w, None, -1.0, False)
    n = int(fa[1][0].shape[0])
    with pytest.raises(KFACTypeError, match=r"update_curvature_matrix_estimate: ema_new must "
                                            r"have"):
        est.update_curvature_matrix_estimate(st, 0.0, other_precision(xp, 1.0), n, None, fa,
                                             "ggn_exact")
    block, bst = est.blocks[0], st.blocks_states[0]
    bv = tuple(xp.asarray(np.ones(s)) for s in block.parameters_shapes)
    with pytest.raises(KFACTypeError, match=r"DenseTwoKroneckerFactored\.multiply_inverse: "
                                            r"identity_weight must have the floating dtype of "
                                            r"state\.like"):
        block.multiply_inverse(bst, bv, w, True, False)
    with pytest.raises(KFACTypeError, match=r"\.update_cache: identity_weight must have"):
        block.update_cache(bst, w, None, -1.0, False)


def test_a_0d_weight_from_another_namespace_is_refused(xp, rng):
    est, _, st = updated(xp, rng, approx_powers_to_cache=-1.0)
    w = other_namespace(xp, 0.1)
    with pytest.raises(KFACTypeError, match=r"update_cache: all arrays must come from one "
                                            r"array namespace; state\.blocks_states\[0\] is "
                                            r"from .* but identity_weight is from"):
        est.update_cache(st, w, None, -1.0, False)


def test_a_per_block_weight_array_is_explained(xp, rng):
    est, _, st = updated(xp, rng)
    v = xp.asarray(rng.standard_normal(est.dim))
    with pytest.raises(KFACTypeError, match=r"identity_weight must be a scalar or a list or "
                                            r"tuple of one scalar per block \(3\); got a 1-D"):
        est.multiply_matpower(st, v, xp.asarray([0.1, 0.2, 0.3]), -1.0, True, False)


@pytest.mark.parametrize("method", ["multiply_matpower", "update_cache", "sync",
                                    "update_curvature_matrix_estimate", "to_dense_matrix",
                                    "eigenvalues"])
def test_a_missing_state_is_refused_by_name(xp, rng, method):
    est, fa, _ = updated(xp, rng)
    calls = {
        "multiply_matpower": lambda: est.multiply_matpower(
            None, xp.asarray(np.zeros(est.dim)), 0.1, -1.0, True, False),
        "update_cache": lambda: est.update_cache(None, 0.1, None, None, False),
        "sync": lambda: est.sync(None),
        "update_curvature_matrix_estimate": lambda: est.update_curvature_matrix_estimate(
            None, 0.0, 1.0, 5, None, fa, "ggn_exact"),
        "to_dense_matrix": lambda: est.to_dense_matrix(None),
        "eigenvalues": lambda: est.eigenvalues(None),
    }
    with pytest.raises(KFACTypeError, match=rf"BlockDiagonalCurvature\.{method}\b.*state must "
                                            r"be a BlockDiagonalState"):
        calls[method]()


@pytest.mark.parametrize("method", ["to_dense_matrix", "eigenvalues", "block_eigenvalues",
                                    "to_diagonal_block_dense_matrix"])
def test_a_state_of_mixed_precisions_is_refused_by_every_reader(xp, rng, method):
    est, _, st = updated(xp, rng)
    b1 = st.blocks_states[1]
    cast = other_precision(xp, 0.0).dtype
    mixed = type(b1)(tuple(type(s)(xp.xp.astype(s.value, cast), s.weight)
                           for s in b1.statistics), b1.cache, xp.xp.astype(b1.like, cast))
    bad = type(st)((st.blocks_states[0], mixed, st.blocks_states[2]))
    with pytest.raises(KFACTypeError, match=rf"BlockDiagonalCurvature\.{method}: "
                                            r"state\.blocks_states\[1\] must have the floating "
                                            r"dtype of state\.blocks_states\[0\]"):
        getattr(est, method)(bad)


def test_option_errors_name_the_estimators_method_and_arguments(xp, rng):
    est, _, st = updated(xp, rng, approx_powers_to_cache=-1.0)
    v = xp.asarray(rng.standard_normal(est.dim))
    with pytest.raises(KFACValueError, match=r"^BlockDiagonalCurvature\.multiply_matpower: "
                                             r"norm_to_scale_identity_weight_per_block must be"):
        est.multiply_matpower(st, v, 0.1, -1.0, True, False,
                              norm_to_scale_identity_weight_per_block="fro")
    with pytest.raises(KFACValueError, match=r"^BlockDiagonalCurvature\.update_cache: "
                                             r"norm_to_scale_identity_weight_per_block must be"):
        est.update_cache(st, 0.1, None, -1.0, False,
                         norm_to_scale_identity_weight_per_block="fro")
    with pytest.raises(KFACTypeError, match=r"^BlockDiagonalCurvature\.update_cache: "
                                            r"eigenvalues must be a bool"):
        est.update_cache(st, 0.1, None, -1.0, 1)
    with pytest.raises(KFACTypeError, match=r"^BlockDiagonalCurvature\.update_cache: "
                                            r"exact_powers must be a number"):
        est.update_cache(st, 0.1, {-1.0}, None, False)
    for call in (lambda: est.update_cache(st, 0.1, None, -1.0, False, pmap_axis_name=3),
                 lambda: est.multiply_matpower(st, v, 0.1, -1.0, True, False,
                                               pmap_axis_name=3)):
        with pytest.raises(KFACTypeError, match=r"pmap_axis_name must be None or a str"):
            call()
    # a cache entry that is missing: the method called and the block are named
    with pytest.raises(KFACValueError, match=r"^BlockDiagonalCurvature\.multiply_matpower: "
                                             r"block 0 \(layer 'd1'\): "
                                             r"the cache must hold 'approx' for this call; "
                                             r"got a DenseTwoKroneckerFactored cache"):
        est.multiply_matpower(st, v, 0.1, -1.0, False, True)
    with pytest.raises(KFACValueError, match=r"^BlockDiagonalCurvature\.eigenvalues: "
                                             r"block 0 \(layer 'd1'\): .*cache must hold "
                                             r"'eigenvalues'"):
        est.eigenvalues(st, use_cached=True)
    # a structured vector's members are named as the argument the user passed
    params = est.net.unflatten(v)
    bad = tuple(tuple(p) for p in params[:2]) + ((xp.xp.matrix_transpose(params[2][0]),
                                                   params[2][1]),) + params[3:]
    with pytest.raises(KFACValueError, match=r"parameter_structured_vector\[2\]\[0\] \(d2\.w\)"):
        est.multiply_matpower(st, bad, 0.1, -1.0, True, False)


def _one_zero_output_factor(st, block):
    bs = st.blocks_states[block]
    a, g = bs.statistics
    zero = type(g)(g.value * 0.0, g.weight)
    states = list(st.blocks_states)
    states[block] = type(bs)((a, zero), bs.cache, bs.like)
    return type(st)(tuple(states))


@pytest.mark.parametrize("block", [1, 2])
def test_a_failing_refresh_names_its_block(xp, rng, block):
    # the output factor of one block set to zero: with no damping its damped factor is
    # singular, and the error names that block and its layer
    est, _, st = updated(xp, rng, approx_powers_to_cache=-1.0)
    layer = ("d1", "d2", "d3")[block]
    with pytest.raises(KFACValueError, match=rf"^BlockDiagonalCurvature\.update_cache: block "
                                             rf"{block} \(layer '{layer}'\): "
                                             r"DenseTwoKroneckerFactored\.update_cache: .*"
                                             r"singular"):
        est.update_cache(_one_zero_output_factor(st, block), 0.0, None, -1.0, False)


@pytest.mark.parametrize("block", [1, 2])
def test_a_failing_product_names_its_block(xp, rng, block):
    # the same singular block met by an uncached product: the block and its layer named once
    est, fa, st = updated(xp, rng)
    layer = ("d1", "d2", "d3")[block]
    vec = xp.asarray(rng.standard_normal(est.net.num_params))
    with pytest.raises(KFACValueError,
                       match=rf"^BlockDiagonalCurvature\.multiply_matpower: block {block} "
                             rf"\(layer '{layer}'\): [^:]*singular"):
        est.multiply_matpower(_one_zero_output_factor(st, block), vec, 0.0, -1.0, False, False)


def test_a_refused_init_leaves_the_estimator_as_it_was(xp, rng):
    est, fa, st = updated(xp, rng)
    blocks = est.blocks
    params, (x, y) = fa
    wider = (params, (xp.asarray(rng.standard_normal((5, 4, 3))), y))  # another input shape
    with pytest.raises(KFACTypeError, match=r"^BlockDiagonalCurvature\.init: block 0 \(layer "
                                            r"'d1'\): .*cache_eigenvalues must be a bool"):
        est.init(None, wider, cache_eigenvalues=1)
    assert est.blocks is blocks
    again = est.update_curvature_matrix_estimate(st, 1.0, 1.0, 5, None, fa, "ggn_exact")
    assert isinstance(again.blocks_states[0], B.BlockState)
