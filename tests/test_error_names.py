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

import kfac_ref.nn as nn
from kfac_ref import KFACTypeError, KFACValueError, capabilities, laplace
from kfac_ref.curvature.estimators import BlockDiagonalCurvature
from kfac_ref.losses import NormalMeanNegativeLogProbLoss
from kfac_ref.optim import KFACOptimizer

INTERNAL = re.compile(r"\bp\d+_\d+\b|params_0|curvature_\d")


def sq(f, y):
    return NormalMeanNegativeLogProbLoss(f, targets=y, variance=0.5)


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
    with pytest.raises(KFACTypeError, match=r"params\[2\]\[1\] is from array_api_strict") as e:
        BlockDiagonalCurvature(net, sq).init(None, (bad, batch))
    assert not INTERNAL.search(str(e.value))


def test_mixed_precision_parameter_is_named_by_its_index(problem):
    net, params, batch = problem
    bad = swap(params, 0, 1, lambda a: a.astype(np.float32))
    with pytest.raises(KFACTypeError, match=r"params\[0\]\[1\] must have the floating dtype "
                                            r"of params\[0\]\[0\] \(float64\)") as e:
        BlockDiagonalCurvature(net, sq).init(None, (bad, batch))
    assert not INTERNAL.search(str(e.value))


def test_input_precision_names_the_parameter_it_disagrees_with(problem):
    net, params, (x, y) = problem
    with pytest.raises(KFACTypeError, match=r"x must have the floating dtype of "
                                            r"params\[0\]\[0\]") as e:
        BlockDiagonalCurvature(net, sq).init(None, (params, (x.astype(np.float32), y)))
    assert not INTERNAL.search(str(e.value))


def test_block_diag_names_blocks_by_index():
    from kfac_ref.curvature.estimators import block_diag

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
