"""Error messages name the argument the user passed, never an internal name.

A parameter is ``params[i][j]`` (not an internal keyword such as ``p0_1``), a damping read
from an optimiser state is ``state.damping`` (not the estimator's ``identity_weight`` the
optimiser forwards it as), a constructor argument keeps its constructor name
(``damping_lower_threshold``, not the ``lower_threshold`` of the function it is passed to),
and an unknown name in the support table is a :class:`KFACValueError` that names it and
what is known, never a bare ``KeyError`` or a silent default.
"""

from __future__ import annotations

import re
from dataclasses import replace

import array_api_strict
import numpy as np
import pytest
from losses_helpers import sq

import kfac_ref.nn as nn
from kfac_ref import KFACTypeError, KFACValueError, capabilities, laplace
from kfac_ref.curvature import BlockDiagonalCurvature
from kfac_ref.optim import KFACOptimizer

INTERNAL = re.compile(r"\bp\d+_\d+\b|params_0|curvature_\d")
# a parameter's index may be followed by its layer and parameter name, "(d1.bias)"
LAYER = r"(?: \([\w.]+\))?"


def mlp():
    return nn.Sequential([("d1", nn.Dense(3, 4)), ("a1", nn.Activation("tanh")),
                          ("d2", nn.Dense(4, 2))])


@pytest.fixture
def problem():
    rng = np.random.default_rng(0)
    net = mlp()
    params = net.init_params(rng, np.zeros(1))
    x, y = rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    return net, params, (x, y)


def swap(params, i, j, fn):
    """``params`` with entry ``[i][j]`` replaced by ``fn(entry)``."""
    return tuple(tuple(fn(a) if (k, m) == (i, j) else a for m, a in enumerate(layer))
                 for k, layer in enumerate(params))


# ------------------------------------------------------------------------------------------
# 1. parameters are named as the user indexes them
# ------------------------------------------------------------------------------------------
def test_mixed_namespace_parameter_is_named_by_its_index(problem):
    net, params, batch = problem
    bad = swap(params, 2, 1, array_api_strict.asarray)
    with pytest.raises(KFACTypeError,
                       match=r"params\[2\]\[1\]" + LAYER + r" is from array_api_strict") as e:
        BlockDiagonalCurvature(net, sq).init(None, (bad, batch))
    assert not INTERNAL.search(str(e.value))


def test_mixed_precision_parameter_is_named_by_its_index(problem):
    net, params, batch = problem
    bad = swap(params, 0, 1, lambda a: a.astype(np.float32))
    with pytest.raises(KFACTypeError, match=r"params\[0\]\[1\]" + LAYER + r" must have the "
                                            r"floating dtype of params\[0\]\[0\]" + LAYER
                                            + r" \(float64\)") as e:
        BlockDiagonalCurvature(net, sq).init(None, (bad, batch))
    assert not INTERNAL.search(str(e.value))


def test_input_precision_names_the_parameter_it_disagrees_with(problem):
    net, params, (x, y) = problem
    with pytest.raises(KFACTypeError, match=r"x must have the floating dtype of "
                                            r"params\[0\]\[0\]") as e:
        BlockDiagonalCurvature(net, sq).init(None, (params, (x.astype(np.float32), y)))
    assert not INTERNAL.search(str(e.value))


def test_block_diag_names_blocks_by_index():
    from kfac_ref.curvature import block_diag

    with pytest.raises(KFACTypeError, match=r"blocks\[1\] is from array_api_strict"):
        block_diag([np.eye(2), array_api_strict.eye(3, dtype=array_api_strict.float64)])


def test_laplace_names_curvature_and_params_by_index():
    rng = np.random.default_rng(1)
    params = [rng.standard_normal((2, 3)), rng.standard_normal((3, 2))]
    curv = [np.eye(6), array_api_strict.asarray(np.eye(6))]
    with pytest.raises(KFACTypeError, match=r"params\[0\] is from .* but curvature\[1\] "
                                            r"is from array_api_strict") as e:
        laplace.laplace_log_marginal_likelihood(-1.0, params, curv, structure="full")
    assert not INTERNAL.search(str(e.value))
    kron = [(np.eye(2), np.eye(3)), (np.eye(3), array_api_strict.asarray(np.eye(2)))]
    with pytest.raises(KFACTypeError, match=r"curvature\[1\]\[1\] is from array_api_strict"):
        laplace.laplace_log_marginal_likelihood(-1.0, params, kron, structure="kron")


# ------------------------------------------------------------------------------------------
# 2. an optimiser state's damping is named as the state field
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_bad_state_damping_names_the_state_field(problem, bad):
    net, params, batch = problem
    opt = KFACOptimizer(net, sq, BlockDiagonalCurvature(net, sq), learning_rate=0.1,
                        estimation_mode="ggn_exact")
    state = opt.init(params, batch)
    state = replace(state, damping=np.asarray(bad))
    with pytest.raises(KFACValueError, match=r"KFACOptimizer\.step: state\.damping must be") as e:
        opt.step(state, params, batch)
    assert "identity_weight" not in str(e.value)


def test_bad_state_preconditioner_damping_names_the_state_field(problem):
    net, params, batch = problem
    opt = KFACOptimizer(net, sq, BlockDiagonalCurvature(net, sq), learning_rate=0.1,
                        estimation_mode="ggn_exact", inverse_update_period=2)
    _, state = opt.step(opt.init(params, batch), params, batch)
    state = replace(state, preconditioner_damping=np.asarray(np.nan))
    with pytest.raises(KFACValueError, match=r"state\.preconditioner_damping must be finite"):
        opt.step(state, params, batch)


# ------------------------------------------------------------------------------------------
# 3. constructor arguments keep their constructor names
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"damping_lower_threshold": float("nan")}, r"damping_lower_threshold must be finite"),
    ({"damping_upper_threshold": float("inf")}, r"damping_upper_threshold must be finite"),
    ({"damping_lower_threshold": 0.9},
     r"damping_lower_threshold must not exceed damping_upper_threshold \(0\.75\); got 0\.9"),
    ({"damping_lower_threshold": "a"}, r"damping_lower_threshold must be a real number"),
    ({"damping_rule": "x"}, r"damping_rule must be one of"),
    ({"min_damping": -1.0}, r"min_damping must be non-negative"),
    ({"max_damping": 0.0}, r"max_damping must be positive"),
    ({"min_damping": 1.0, "max_damping": 0.5}, r"max_damping must be at least min_damping"),
    ({"damping_adaptation_decay": 1.5}, r"damping_adaptation_decay must be in \(0, 1\]"),
    ({"damping_adaptation_interval": 0}, r"damping_adaptation_interval must be"),
])
def test_optimizer_constructor_names_its_own_arguments(problem, kwargs, message):
    net, _, _ = problem
    with pytest.raises((KFACValueError, KFACTypeError), match=r"^KFACOptimizer: " + message):
        KFACOptimizer(net, sq, BlockDiagonalCurvature(net, sq), learning_rate=0.1, **kwargs)


def test_adapt_damping_keeps_its_own_argument_names():
    from kfac_ref.optim import adapt_damping

    z = np.asarray(0.0)
    with pytest.raises(KFACValueError, match=r"adapt_damping: lower_threshold must not exceed "
                                             r"upper_threshold"):
        adapt_damping(1.0, z, z, z, 0.5, lower_threshold=0.9, upper_threshold=0.1)
    with pytest.raises(KFACValueError, match=r"adapt_damping: rule must be one of"):
        adapt_damping(1.0, z, z, z, 0.5, rule="x")


# ------------------------------------------------------------------------------------------
# 4. unknown names in the support table
# ------------------------------------------------------------------------------------------
def test_support_of_unknown_dotted_name_suggests_close_matches():
    with pytest.raises(KFACValueError, match=r"support_of: obj must be the dotted name .*got "
                                             r"'kfac_ref\.linalg\.damped_invers'\. Did you "
                                             r"mean 'kfac_ref\.linalg\.damped_inverse'"):
        capabilities.support_of("kfac_ref.linalg.damped_invers")


def test_support_of_unknown_name_in_a_known_module_lists_the_module():
    with pytest.raises(KFACValueError, match=r"got 'kfac_ref\.linalg\.bogus'\. The names in "
                                             r"kfac_ref\.linalg are .*damped_inverse"):
        capabilities.support_of("kfac_ref.linalg.bogus")


def test_support_of_unknown_object_is_a_value_error():
    with pytest.raises(KFACValueError, match=r"support_of: obj must be a public function or "
                                             r"class of kfac_ref or its dotted name; got"):
        capabilities.support_of(object())


def test_support_state_unknown_column_names_the_known_columns():
    support = capabilities.support_of("kfac_ref.linalg.damped_inverse")
    with pytest.raises(KFACValueError, match=r"Support\.state: column must be .*got 'bogus'\. "
                                             r"The known names are 'numpy', ") as e:
        support.state("bogus")
    for col in capabilities.COLUMNS:
        assert repr(col) in str(e.value)
    with pytest.raises(KFACValueError, match=r"got 'nmupy'\. Did you mean 'numpy'"):
        support.state("nmupy")
    # a known column that is not declared is still "untested", not an error
    assert all(support.state(c) in ("yes", "no", "untested", "n/a") for c in capabilities.COLUMNS)


# ------------------------------------------------------------------------------------------
# 5. estimator states and arguments
# ------------------------------------------------------------------------------------------
def strict(a, device="CPU_DEVICE"):
    return array_api_strict.asarray(np.asarray(a), device=array_api_strict.Device(device))


def strict_problem(problem, device="CPU_DEVICE"):
    net, params, (x, y) = problem
    sp = tuple(tuple(strict(a, device) for a in layer) for layer in params)
    return net, sp, (strict(x, device), strict(y, device))


def updated(est, params, batch, **init_kw):
    state = est.init(None, (params, batch), **init_kw)
    n = int(batch[0].shape[0])
    return est.update_curvature_matrix_estimate(state, 0.0, 1.0, n, None, (params, batch),
                                                "ggn_exact")


def linear_net():
    """No activation: the input's scale reaches every statistic (an overflow of x² is not
    saturated away)."""
    return nn.Sequential([("d1", nn.Dense(3, 4)), ("d2", nn.Dense(4, 2))])


def overflowing_problem():
    """The linear net, its parameters and a batch whose inputs are ~1e200 (x² overflows)."""
    rng = np.random.default_rng(2)
    net = linear_net()
    params = net.init_params(rng, np.zeros(1))
    return net, params, (1e200 * rng.standard_normal((5, 3)), rng.standard_normal((5, 2)))


def test_overflowing_statistics_are_refused_where_they_enter_the_state():
    net, params, (x, y) = overflowing_problem()
    est = BlockDiagonalCurvature(net, sq)
    with np.errstate(over="ignore", invalid="ignore"), pytest.raises(
            KFACValueError, match=r"update_curvature_matrix_estimate: the diagonal of the "
                                  r"updated state\.blocks_states\[0\]\.statistics\[0\] "
                                  r"\(layer 'd1'\) must be finite .* overflowed float64"):
        updated(est, params, (x, y))


def test_overflowing_explicit_estimate_is_refused_in_the_state_name():
    from kfac_ref.curvature import ExplicitExactCurvature

    net, params, (x, y) = overflowing_problem()
    est = ExplicitExactCurvature(net, sq)
    state = est.init(None, (params, (x, y)))
    with np.errstate(over="ignore", invalid="ignore"), pytest.raises(
            KFACValueError, match=r"the updated state\.matrix must be finite") as e:
        est.update_curvature_matrix_estimate(state, 0.0, 1.0, 5, None, (params, (x, y)),
                                             "ggn_exact")
    assert "WeightedMovingAverage" not in str(e.value)


def nan_state(est, state, block=1, statistic=0, entry=(0, 0)):
    """``state`` with one NaN in a statistic, built with value checks off (the only way past
    the scans of WeightedMovingAverage and of the estimator's update)."""
    import kfac_ref

    bs = state.blocks_states[block]
    raw = np.array(bs.statistics[statistic].raw)
    raw[entry] = np.nan
    with kfac_ref.value_checks(False):
        average = replace(bs.statistics[statistic], raw=raw)
        stats = tuple(average if i == statistic else s for i, s in enumerate(bs.statistics))
        blocks = tuple(replace(bs, statistics=stats) if k == block else b
                       for k, b in enumerate(state.blocks_states))
        return replace(state, blocks_states=blocks)


@pytest.mark.parametrize("exact_power", [True, False])
def test_nan_statistics_name_the_state_field_not_a_linalg_error(problem, exact_power):
    net, params, batch = problem
    est = BlockDiagonalCurvature(net, sq)
    bad = nan_state(est, updated(est, params, batch, exact_powers_to_cache=-1.0,
                                 approx_powers_to_cache=-1.0))
    field = r"state\.blocks_states\[1\]\.statistics\[0\] must be finite"
    v = np.ones(est.dim)
    with pytest.raises(KFACValueError, match=r"multiply_matpower: " + field):
        est.multiply_matpower(bad, v, 1e-3, -1.0, exact_power, False)
    with pytest.raises(KFACValueError, match=r"update_cache: " + field):
        est.update_cache(bad, 1e-3, -1.0 if exact_power else None,
                         None if exact_power else -1.0, False)
    with pytest.raises(KFACValueError, match=r"block_eigenvalues: " + field):
        est.block_eigenvalues(bad)
    # entering a state through an update, the statistic is scanned (and named) at once
    with pytest.raises(KFACValueError, match=r"the updated state\.blocks_states\[1\]"
                                             r"\.statistics\[0\] \(layer 'd2'\)"):
        est.update_curvature_matrix_estimate(bad, 1.0, 1.0, 5, None, (params, batch),
                                             "ggn_exact")


def test_an_off_diagonal_nan_is_named_by_the_next_product(problem):
    """The update scans a Kronecker factor's diagonal only (a semidefinite statistic's
    diagonal bounds its entries), so a hand-made state's off-diagonal NaN passes it; the
    next product or cache refresh names the field instead of returning NaN."""
    net, params, batch = problem
    est = BlockDiagonalCurvature(net, sq)
    bad = nan_state(est, updated(est, params, batch), entry=(0, 1))
    bad = est.update_curvature_matrix_estimate(bad, 1.0, 1.0, 5, None, (params, batch),
                                               "ggn_exact")
    field = r"state\.blocks_states\[1\]\.statistics\[0\] must be finite"
    for exact_power in (True, False):
        with pytest.raises(KFACValueError, match=r"multiply_matpower: " + field):
            est.multiply_matpower(bad, np.ones(est.dim), 1e-3, -1.0, exact_power, False)
    with pytest.raises(KFACValueError, match=r"update_cache: " + field):
        est.update_cache(bad, 1e-3, None, -1.0, False)


def test_statistics_scan_respects_value_checks_off():
    """With value checks off the update does not scan: the overflowed state is returned
    (and a later product names the field instead of failing inside LAPACK)."""
    import kfac_ref

    net, params, (x, y) = overflowing_problem()
    est = BlockDiagonalCurvature(net, sq)
    with np.errstate(over="ignore", invalid="ignore"), kfac_ref.value_checks(False):
        state = updated(est, params, (x, y))
    assert not np.isfinite(np.asarray(state.blocks_states[0].statistics[0].raw)).all()
    with pytest.raises(KFACValueError, match=r"state\.blocks_states\[0\]\.statistics\[0\] "
                                             r"must be finite"):
        est.multiply_matpower(state, np.ones(est.dim), 1e-3, -1.0, True, False)


def test_products_of_finite_states_scan_only_the_vector(problem, monkeypatch):
    """The statistics are scanned when they enter the state, never on a product."""
    import kfac_ref._backend as backend

    net, params, batch = problem
    est = BlockDiagonalCurvature(net, sq)
    state = updated(est, params, batch)
    v = np.ones(est.dim)
    scanned = []
    real = backend.all_finite
    monkeypatch.setattr(backend, "all_finite", lambda ns, x: scanned.append(x) or real(ns, x))
    est.multiply_matpower(state, v, 1e-3, -1.0, True, False)
    assert [x is v for x in scanned] == [True]


@pytest.mark.parametrize("which", ["namespace", "device", "precision"])
def test_init_refuses_inputs_unlike_the_params(problem, which):
    from kfac_ref.curvature import ExplicitExactCurvature

    net, params, (x, y) = problem
    if which == "namespace":
        x, match = strict(x), (r"params\[0\]\[0\]" + LAYER
                                + r" is from .* but x is from array_api_strict")
    elif which == "device":
        net, params, (_, y) = strict_problem(problem)
        x, match = strict(x, "device1"), r"params\[0\]\[0\]" + LAYER + r" is on .* but x is on"
    else:
        x, match = x.astype(np.float32), r"x must have the floating dtype of params\[0\]\[0\]"
    for est in (BlockDiagonalCurvature(net, sq), ExplicitExactCurvature(net, sq)):
        with pytest.raises(KFACTypeError, match=r"\.init: .*" + match):
            est.init(None, (params, (x, y)))


@pytest.mark.parametrize("which", ["namespace", "precision", "device"])
def test_structured_vector_members_must_match_each_other_and_the_state(problem, which):
    from kfac_ref.curvature import ExplicitExactCurvature

    net, params, batch = strict_problem(problem) if which == "device" else problem
    for est in (BlockDiagonalCurvature(net, sq), ExplicitExactCurvature(net, sq)):
        state = est.init(None, (params, batch))
        ones = tuple(tuple(a * 0.0 + 1.0 for a in layer) for layer in params)
        if which == "namespace":
            bad = swap(ones, 2, 1, strict)
            match = r"parameter_structured_vector\[2\]\[1\] is from array_api_strict"
        elif which == "precision":
            bad = swap(ones, 2, 1, lambda a: a.astype(np.float32))
            match = r"parameter_structured_vector\[2\]\[1\] must have the floating dtype"
        else:
            bad = swap(ones, 0, 1, lambda a: array_api_strict.asarray(
                a, device=array_api_strict.Device("device1")))
            match = r"parameter_structured_vector\[0\]\[1\] is on"
        with pytest.raises(KFACTypeError, match=r"multiply_matpower: .*" + match):
            est.multiply_matpower(state, bad, 1e-3, 1.0, True, False)


def test_vector_of_another_namespace_than_the_state_names_both(problem):
    from kfac_ref.curvature import ExplicitExactCurvature

    net, params, batch = strict_problem(problem)
    for est, state_name in ((BlockDiagonalCurvature(net, sq), r"state\.blocks_states\[0\]"),
                            (ExplicitExactCurvature(net, sq), r"state\.matrix")):
        state = est.init(None, (params, batch))
        host = tuple(tuple(np.ones(tuple(a.shape)) for a in layer) for layer in params)
        with pytest.raises(KFACTypeError, match=r"parameter_structured_vector\[0\]\[0\] is "
                                                r"from .* but " + state_name):
            est.multiply_matpower(state, host, 1e-3, 1.0, True, False)
        with pytest.raises(KFACTypeError, match=r"parameter_structured_vector is from .* "
                                                r"but " + state_name):
            est.multiply_matpower(state, np.ones(est.dim), 1e-3, 1.0, True, False)


def test_explicit_estimator_without_inputs_is_a_clear_error(problem):
    from kfac_ref.curvature import ExplicitExactCurvature

    net, params, (x, y) = problem
    est = ExplicitExactCurvature(net, sq)
    with pytest.raises(KFACTypeError, match=r"ExplicitExactCurvature\.init: x must be an "
                                            r"array; got None"):
        est.init(None, (params, (None, y)))
    state = est.init(None, (params, (x, y)))
    with pytest.raises(KFACTypeError, match=r"update_curvature_matrix_estimate: x must be an "
                                            r"array; got None"):
        est.update_curvature_matrix_estimate(state, 0.0, 1.0, 5, None, (params, (None, y)))
    with pytest.raises(KFACValueError, match=r"update_curvature_matrix_estimate: batch must "
                                             r"be a pair"):
        est.update_curvature_matrix_estimate(state, 0.0, 1.0, 5, None, (params, None))


def test_empty_batch_is_refused_before_any_reshape(problem):
    from kfac_ref import curvature as C

    net, params, (x, y) = problem
    with pytest.raises(KFACValueError, match=r"jacobian: x must hold at least one example"):
        C.jacobian(net, params, x[:0])
    with pytest.raises(KFACValueError, match=r"ggn_matrix: x must hold at least one example"):
        C.ggn_matrix(net, sq, params, (x[:0], y[:0]))
    est = BlockDiagonalCurvature(net, sq)
    state = est.init(None, (params, (x, y)))
    with pytest.raises(KFACValueError, match=r"update_curvature_matrix_estimate: x must hold "
                                             r"at least one example"):
        est.update_curvature_matrix_estimate(state, 0.0, 1.0, 1, None,
                                             (params, (x[:0], y[:0])), "ggn_exact")


def test_update_refuses_a_state_of_another_namespace_in_the_users_names(problem):
    net, params, batch = problem
    est = BlockDiagonalCurvature(net, sq)
    _, sp, sbatch = strict_problem(problem)
    state = est.init(None, (sp, sbatch))
    with pytest.raises(KFACTypeError, match=r"BlockDiagonalCurvature\.update_curvature_matrix_"
                                            r"estimate: .*params\[0\]\[0\] is from .* but "
                                            r"state\.blocks_states\[0\] is from "
                                            r"array_api_strict"):
        est.update_curvature_matrix_estimate(state, 0.0, 1.0, 5, None, (params, batch),
                                             "ggn_exact")


def test_nan_explicit_matrix_names_the_state_field():
    import kfac_ref
    from kfac_ref.curvature import ExplicitExactCurvature

    rng = np.random.default_rng(3)
    net = mlp()
    params = net.init_params(rng, np.zeros(1))
    batch = (rng.standard_normal((5, 3)), rng.standard_normal((5, 2)))
    est = ExplicitExactCurvature(net, sq)
    state = est.init(None, (params, batch))
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 5, None, (params, batch))
    raw = np.array(state.matrix.raw)
    raw[0, 0] = np.nan
    with kfac_ref.value_checks(False):
        bad = replace(state, matrix=replace(state.matrix, raw=raw))
    for call, name in ((lambda: est.update_cache(bad, 0.1, None, None, False), "update_cache"),
                       (lambda: est.eigenvalues(bad), "eigenvalues"),
                       (lambda: est.multiply_matpower(bad, np.ones(est.dim), 0.1, -1.0),
                        "multiply_matpower")):
        with pytest.raises(KFACValueError, match=rf"ExplicitExactCurvature\.{name}: "
                                                 r"state\.matrix must be finite"):
            call()


def test_explicit_products_do_not_rescan_the_matrix(problem, monkeypatch):
    """The matrix was scanned when it entered the state: a product scans only its
    vector."""
    import kfac_ref._backend as backend
    from kfac_ref.curvature import ExplicitExactCurvature

    net, params, batch = problem
    est = ExplicitExactCurvature(net, sq)
    state = est.init(None, (params, batch))
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 5, None, (params, batch))
    cached = est.update_cache(state, 0.1, None, None, False)
    v = np.ones(est.dim)
    scanned = []
    real = backend.all_finite
    monkeypatch.setattr(backend, "all_finite", lambda ns, x: scanned.append(x) or real(ns, x))
    for st, use_cached in ((state, False), (cached, True)):
        scanned.clear()
        est.multiply_matpower(st, v, 0.1, -1.0, use_cached=use_cached)
        assert [x is v for x in scanned] == [True]


def test_optimizer_refuses_an_unknown_estimation_mode_at_construction(problem):
    net, _, _ = problem
    with pytest.raises(KFACValueError, match=r"^KFACOptimizer: estimation_mode must be one of"):
        KFACOptimizer(net, sq, BlockDiagonalCurvature(net, sq), learning_rate=0.1,
                      estimation_mode="bogus")


# ------------------------------------------------------------------------------------------
# Found by tools/fuzz_api.py: each argument checked at the door, named in the message
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block,match", [
    ([np.eye(2), np.array([[1.0, np.nan], [np.nan, 1.0]])], r"blocks\[1\] must be finite"),
    ([np.eye(2), np.eye(3).astype(np.int64)], r"blocks\[1\] must be an array of real float"),
    ([np.eye(2), np.ones(3)], r"blocks\[1\] must be a 2-D array"),
    ([np.eye(2), np.ones((2, 3))], r"blocks\[1\] must be a square matrix"),
    ([], r"blocks must be a non-empty list"),
])
def test_block_diag_checks_each_block(block, match):
    from kfac_ref.curvature import block_diag

    with pytest.raises((KFACTypeError, KFACValueError), match="^block_diag: " + match):
        block_diag(block)


@pytest.mark.parametrize("name", ["FullFB", "NaiveFullFB", "ScaleAndShiftFullFB"])
@pytest.mark.parametrize("bad,match", [
    (lambda m: np.where(np.eye(len(m)) > 0, np.nan, m), "factor must be finite"),
    (lambda m: m.astype(np.int64), "factor must be an array of real floating dtype"),
    (lambda m: m[:, :1], "factor must be a square matrix"),
    (lambda m: m.reshape(-1), "factor must be a 2-D array"),
])
def test_tf_full_blocks_check_their_factor(name, bad, match):
    from kfac_ref.blocks import tf

    n = 6 if name == "ScaleAndShiftFullFB" else 12
    args = () if name == "ScaleAndShiftFullFB" else ([(3, 3), (3,)],)
    with pytest.raises((KFACTypeError, KFACValueError), match=f"^{name}: {match}"):
        getattr(tf, name)(bad(np.eye(n)), 0.3, *args)


def test_tf_full_block_refuses_a_vector_of_the_wrong_size():
    from kfac_ref.blocks import tf

    block = tf.ScaleAndShiftFullFB(np.eye(6), 0.3)
    with pytest.raises(KFACValueError, match=r"^ScaleAndShiftFullFB.multiply_matpower: vector "
                                             r"must have 6 entries in all; got 4"):
        block.multiply_matpower((np.ones(3), np.ones(1)), -0.5)


@pytest.mark.parametrize("func,args", [
    ("conv_patch_matrix", lambda x: (x, (3, 3, 2, 3), "SAME")),
    ("conv_input_sua_statistics", lambda x: (x,)),
])
def test_data_format_rank_errors_name_the_array(func, args):
    from kfac_ref import factors

    x = np.ones((1, 4, 5, 5, 2))
    with pytest.raises(KFACValueError, match=f"^{func}: inputs must be a 4-D array "
                                             r"\(data_format 'NHWC' describes 4-D arrays\); "
                                             "got a 5-D array"):
        getattr(factors, func)(*args(x))


def test_conv_input_factor_tap_checks_its_patches():
    from kfac_ref import factors
    from kfac_ref.conv_geometry import ConvGeometry

    tap = factors.conv_input_factor_tap(
        ConvGeometry.build("t", (4, 5, 5, 2), (3, 3, 2, 3), padding="SAME"), True)
    good = np.ones((100, 18))
    tap(good)
    with pytest.raises(KFACValueError, match="^conv_input_factor_tap: patches must be finite"):
        tap(np.where(good > 0, np.nan, good))
    with pytest.raises(KFACTypeError, match="^conv_input_factor_tap: patches must be an array "
                                            "of real floating"):
        tap(good.astype(np.int64))
    with pytest.raises(KFACValueError, match="^conv_input_factor_tap: patches must end in the "
                                             "geometry's 18 patch entries"):
        tap(np.ones((100, 17)))


def test_a_zero_dimensional_tower_is_named():
    from kfac_ref import factors

    fac = factors.FullyConnectedKroneckerFactor()
    with pytest.raises((KFACTypeError, KFACValueError),
                       match="^FullyConnectedKroneckerFactor.update_cov: tensors"):
        fac.update_cov(np.asarray(1.0), ema_decay=0.9)


@pytest.mark.parametrize("estimator", ["hutchinson_trace", "hutchpp_trace"])
@pytest.mark.parametrize("result,match", [
    (lambda v: v.astype(np.float32), r"matmat's result must have the floating dtype of "
                                     r"matmat's input"),
    (lambda v: array_api_strict.asarray(v), "all arrays must come from one array namespace"),
    (lambda v: np.where(v > 0, np.nan, v), "matmat's result must be finite"),
    (lambda v: v.astype(np.complex128), "matmat's result must be an array of real floating"),
])
def test_trace_estimators_check_what_matmat_returns(estimator, result, match):
    from kfac_ref import spectral

    rng = np.random.default_rng(2)
    args = (rng.standard_normal((4, 2)), rng.standard_normal((4, 3)))
    args = args if estimator == "hutchpp_trace" else args[1:]
    with pytest.raises((KFACTypeError, KFACValueError), match=f"^{estimator}: {match}"):
        getattr(spectral, estimator)(lambda v: result(2.0 * v), *args)


def test_curvature_operator_checks_what_matvec_returns():
    from kfac_ref.operators import CurvatureOperator

    m = np.eye(4)
    op = CurvatureOperator(lambda v: array_api_strict.asarray(m @ v), m, 4)
    with pytest.raises(KFACTypeError, match="^CurvatureOperator: all arrays must come from one "
                                            "array namespace; like .* but matvec's result"):
        op.to_dense()


@pytest.mark.parametrize("estimator", ["hutchinson_trace", "hutchpp_trace"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_curvature_operator_trace_estimators_scan_what_matvec_returns(estimator, bad):
    """A matvec's results are checked statically per product; the trace estimators scan
    their products for NaN/Inf, as spectral's estimators do for a user's matmat."""
    from kfac_ref.operators import CurvatureOperator

    op = CurvatureOperator(lambda v: v * bad, np.zeros(4), 4)
    with pytest.raises(KFACValueError, match=f"^CurvatureOperator.{estimator}: matmat's "
                                             f"result must be finite"):
        getattr(op, estimator)(6, np.random.default_rng(0))


@pytest.mark.parametrize("func", ["to_channels_last", "from_channels_last"])
def test_layout_moves_check_their_array(func):
    from kfac_ref import conv_geometry

    xp = array_api_strict
    with pytest.raises(KFACTypeError, match=f"^{func}: (x|y) must be an array; got a list"):
        getattr(conv_geometry, func)(xp, [[[1.0]]], False)
    with pytest.raises(KFACValueError, match=f"^{func}: (x|y) must be an array of at least 3 "):
        getattr(conv_geometry, func)(xp, xp.ones((2, 3)), False)


def test_block_tridiagonal_checks_diagonals_before_off_diagonals():
    from kfac_ref import blocks

    a, g, x = np.eye(2), np.eye(3), np.ones((2, 3))
    with pytest.raises(KFACValueError, match=r"^block_tridiagonal_multiply_inverse: "
                                             r"a_diag\[1\] must be a 2-D array"):
        blocks.block_tridiagonal_multiply_inverse([a, np.asarray(1.0)], [g, g], [a], [g * 0.1],
                                                  [x, x], 0.1)


def test_optimizer_step_names_the_batch_and_itself_for_estimator_errors(problem):
    """A namespace mix in the batch is named by the optimiser (batch[1]); an error the
    estimator raises while stepping is put under KFACOptimizer.step."""
    net, params, (x, y) = problem
    opt = KFACOptimizer(net, sq, BlockDiagonalCurvature(net, sq), learning_rate=0.1,
                        momentum=0.5)
    state = opt.init(params, (x, y))
    with pytest.raises(KFACTypeError, match=r"^KFACOptimizer.step: .*batch\[1\] is from "
                                            r"array_api_strict"):
        opt.step(state, params, (x, array_api_strict.asarray(y)))


def test_errors_named_inner_puts_an_inner_public_error_under_the_caller():
    from kfac_ref._backend import errors_named

    with pytest.raises(KFACValueError, match="^outer: inner: x must be"), \
            errors_named("outer", inner=True):
        raise KFACValueError("inner: x must be finite; got NaN.")
    with pytest.raises(KFACValueError, match="^outer: x must be finite"), \
            errors_named("outer", inner=True):
        raise KFACValueError("outer: x must be finite; got NaN.")
    with pytest.raises(KFACValueError, match="^inner: x"), errors_named("outer"):
        raise KFACValueError("inner: x must be finite; got NaN.")


def test_approximation_report_names_a_batch_that_is_not_an_array(problem):
    from kfac_ref.curvature import approximation_report

    net, params, (x, y) = problem
    with pytest.raises(KFACTypeError, match=r"^approximation_report: batch\[0\] must be an "
                                            r"array; got a list"):
        approximation_report(net, sq, params, (x.tolist(), y))


def test_preconditioned_direction_names_the_users_arguments(problem):
    """The estimator's errors are raised under the call the user made, with the user's
    argument names: ``grad`` (the estimator calls it ``parameter_structured_vector``) and
    ``estimator_state`` (its ``state``)."""
    from kfac_ref.optim import preconditioned_direction

    net, params, batch = problem
    est = BlockDiagonalCurvature(net, sq)
    st = updated(est, params, batch)
    with pytest.raises(KFACValueError, match=r"^preconditioned_direction: BlockDiagonalCurvature"
                                             r"\.multiply_matpower: grad must"):
        preconditioned_direction(est, st, np.ones(est.dim + 1), 0.1, exact_power=False)
    with pytest.raises(KFACValueError, match=r"preconditioned_direction: .*: grad must be finite"):
        preconditioned_direction(est, st, np.full(est.dim, np.nan), 0.1, exact_power=False)
    bad = nan_state(est, updated(est, params, batch))
    with pytest.raises(KFACValueError, match=r"preconditioned_direction: .*: estimator_state\."
                                             r"blocks_states\[1\]\.statistics\[0\] must be"):
        preconditioned_direction(est, bad, np.ones(est.dim), 0.1, exact_power=True)
