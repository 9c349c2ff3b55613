"""Device→host reads on the hot paths, counted on torch tensors (a read is ``bool()``,
``float()``, ``int()``, ``.item()`` or ``.tolist()`` of a tensor; on a GPU each one waits
for the device).  With value checks on, an input of a single-array function costs one
read (its finiteness scan), and the scans of a call's several arguments are read together;
with value checks off (:func:`kfac_ref.value_checks`) a curvature update, a cache refresh
and a cached product read nothing back.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import kfac_ref
from kfac_ref.blocks import kfac_jax as kj

torch = pytest.importorskip("torch")

READS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist")


@pytest.fixture
def reads(monkeypatch):
    count = {"n": 0}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _original=original, **k):
            count["n"] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return count


def _t(a):
    return torch.tensor(np.asarray(a), dtype=torch.float64)


@pytest.mark.parametrize("make,data", [
    (lambda: kj.DenseTwoKroneckerFactored(6, 4),
     lambda r: {"inputs": r.standard_normal((16, 6)), "outputs_grad": r.standard_normal((16, 4))}),
    (lambda: kj.Conv2DTwoKroneckerFactored(inputs_shape=(4, 6, 6, 2), kernel_shape=(3, 3, 2, 3),
                                           padding="SAME"),
     lambda r: {"inputs": r.standard_normal((4, 6, 6, 2)),
                "outputs_grad": r.standard_normal((4, 6, 6, 3))}),
], ids=["dense", "conv"])
def test_no_reads_on_the_hot_path_without_value_checks(reads, make, data):
    rng = np.random.default_rng(0)
    block = make()
    batch = {k: _t(v) for k, v in data(rng).items()}
    vec = tuple(_t(rng.standard_normal(s)) for s in block.parameters_shapes)
    with kfac_ref.value_checks(False):
        state = block.init(torch.zeros((), dtype=torch.float64), exact_powers_to_cache=[-1.0])
        reads["n"] = 0
        n = batch["inputs"].shape[0]
        state = block.update_curvature_matrix_estimate(state, batch, 0.0, 1.0, n)
        state = block.update_cache(state, torch.tensor(0.1, dtype=torch.float64), [-1.0], [],
                                   False)
        out = block.multiply_matpower(state, vec, torch.tensor(0.1, dtype=torch.float64), -1.0,
                                      True, True)
        assert reads["n"] == 0
    assert all(o.shape == v.shape for o, v in zip(out, vec, strict=True))


def test_value_checks_cost_one_read_per_input(reads):
    rng = np.random.default_rng(1)
    x = _t(rng.standard_normal((16, 5)))
    reads["n"] = 0
    kfac_ref.compute_cov(x)
    assert reads["n"] == 1
    with kfac_ref.value_checks(False):
        reads["n"] = 0
        kfac_ref.compute_cov(x)
        assert reads["n"] == 0


def test_norm_scaled_cache_of_several_powers_reads_nothing_without_value_checks(reads):
    """A cache refresh with a norm-scaled identity weight and three approximate powers (the
    π norms once, λ and its square root kept on the device): no read with value checks
    off."""
    rng = np.random.default_rng(2)
    block = kj.DenseTwoKroneckerFactored(6, 4)
    batch = {"inputs": _t(rng.standard_normal((16, 6))),
             "outputs_grad": _t(rng.standard_normal((16, 4)))}
    vec = tuple(_t(rng.standard_normal(s)) for s in block.parameters_shapes)
    with kfac_ref.value_checks(False):
        state = block.init(torch.zeros((), dtype=torch.float64), exact_powers_to_cache=[-1.0],
                           approx_powers_to_cache=[-1.0, -0.5, 0.5])
        state = block.update_curvature_matrix_estimate(state, batch, 0.0, 1.0, 16)
        reads["n"] = 0
        state = block.update_cache(state, 0.1, [-1.0], [-1.0, -0.5, 0.5], False, "avg_diag")
        out = block.multiply_matpower(state, vec, 0.1, -0.5, False, True, "avg_diag")
        assert reads["n"] == 0
    assert all(o.shape == v.shape for o, v in zip(out, vec, strict=True))


@pytest.mark.parametrize("fallback", ["identity", "pi_one"])
def test_cache_refresh_reads_its_value_checks_once(reads, fallback):
    """With value checks on, a Kronecker cache refresh (exact −1, approximate −1, −½, ½,
    eigenvalues, a norm-scaled weight) reads all its checks (Cholesky pivots, spectra) back
    in one read; kfac-jax's zero-factor test (a branch, not a check) joins that read."""
    rng = np.random.default_rng(4)
    block = kj.DenseTwoKroneckerFactored(6, 4, zero_factor_fallback=fallback)
    batch = {"inputs": _t(rng.standard_normal((16, 6))),
             "outputs_grad": _t(rng.standard_normal((16, 4)))}
    powers = [-1.0, -0.5, 0.5]
    with kfac_ref.value_checks(False):
        state = block.init(torch.zeros((), dtype=torch.float64), exact_powers_to_cache=[-1.0],
                           approx_powers_to_cache=powers)
        state = block.update_curvature_matrix_estimate(state, batch, 0.0, 1.0, 16)
    reads["n"] = 0
    block.update_cache(state, 0.1, [-1.0], powers, True, "avg_diag")
    assert reads["n"] == 1


def test_a_failing_deferred_check_raises_its_usual_error():
    """A singular damped factor (G = 0, π = 1, no damping): the cache refresh raises the
    error the uncached product raises, word for word."""
    rng = np.random.default_rng(5)
    block = kj.DenseTwoKroneckerFactored(3, 2, zero_factor_fallback="pi_one")
    state = block.init(np.zeros(()), approx_powers_to_cache=[-1.0])
    state = block.update_curvature_matrix_estimate(
        state, {"inputs": rng.standard_normal((4, 3)), "outputs_grad": np.zeros((4, 2))},
        0.0, 1.0, 4)
    vec = tuple(rng.standard_normal(s) for s in block.parameters_shapes)
    with pytest.raises(kfac_ref.KFACValueError) as fresh:
        block.multiply_matpower(state, vec, 0.0, -1.0, False, False)
    with pytest.raises(kfac_ref.KFACValueError) as cached:
        block.update_cache(state, 0.0, [], [-1.0], False)
    assert str(cached.value).replace("update_cache", "multiply_matpower") == str(fresh.value)


def _three_block_estimator(fallback, rng):
    """A three-dense-layer estimator on torch tensors and its state after one update."""
    import kfac_ref.nn as nn
    from kfac_ref.curvature import BlockDiagonalCurvature
    from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss

    net = nn.Sequential([("d1", nn.Dense(5, 6)), ("a1", nn.Activation("tanh")),
                         ("d2", nn.Dense(6, 4)), ("a2", nn.Activation("tanh")),
                         ("d3", nn.Dense(4, 3))])
    params = tuple(tuple(_t(a) for a in p)
                   for p in net.init_params(rng, np.zeros(1)))
    batch = (_t(rng.standard_normal((8, 5))), torch.as_tensor(rng.integers(0, 3, 8)))
    est = BlockDiagonalCurvature(
        net, lambda f, y: CategoricalLogitsNegativeLogProbLoss(f, targets=y),
        block_kwargs={"zero_factor_fallback": fallback})
    with kfac_ref.value_checks(False):
        state = est.init(None, (params, batch), approx_powers_to_cache=-1.0)
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 8, None,
                                                     (params, batch), "ggn_exact")
    return est, state


def _with_output_factor(state, k, raw):
    """``state`` with block ``k``'s output factor average replaced by ``raw`` (its weight
    kept, so the factor's value is ``raw / weight``)."""
    import dataclasses

    blocks = list(state.blocks_states)
    a, g = blocks[k].statistics
    blocks[k] = dataclasses.replace(blocks[k], statistics=(a, dataclasses.replace(g, raw=raw)))
    return dataclasses.replace(state, blocks_states=tuple(blocks))


@pytest.mark.parametrize("fallback", ["identity", "pi_one"])
def test_an_estimator_cache_refresh_reads_every_blocks_checks_once(reads, fallback):
    """``BlockDiagonalCurvature.update_cache`` reads the value checks of all three blocks
    (their Cholesky pivots) and kfac-jax's zero-factor test of each block (a branch taken
    in Python) back in one read."""
    est, state = _three_block_estimator(fallback, np.random.default_rng(6))
    reads["n"] = 0
    est.update_cache(state, 0.1, None, -1.0, False)
    assert reads["n"] == 1


def test_a_zero_factor_read_with_the_checks_takes_kfac_jaxs_branch(reads):
    """A zero output factor in the second of three blocks under kfac-jax's fall-back: the
    one read of the refresh says so, the refresh runs again with reads at once, and the
    block's cached power is λ^p I, as NumPy's (read at once) is."""
    est, state = _three_block_estimator("identity", np.random.default_rng(11))
    g = state.blocks_states[1].statistics[1]
    state = _with_output_factor(state, 1, torch.zeros_like(g.raw))
    reads["n"] = 0
    cached = est.update_cache(state, 0.1, None, -1.0, False)
    assert reads["n"] > 1  # the failed read, then the refresh with reads at once
    vec = _t(np.random.default_rng(12).standard_normal(est.dim))
    got = est.multiply_matpower(cached, vec, 0.1, -1.0, False, True)
    sizes = [sum(math.prod(s) for s in b.parameters_shapes) for b in est.blocks]
    lo, hi = sizes[0], sizes[0] + sizes[1]
    # kfac-jax's zero-factor case: the damped block is λ I, so its inverse is v / λ
    np.testing.assert_allclose(got[lo:hi].numpy(), vec[lo:hi].numpy() / 0.1, rtol=1e-14)
    with kfac_ref.value_checks(False):  # the branch selected on the device, no read
        unread = est.multiply_matpower(est.update_cache(state, 0.1, None, -1.0, False), vec,
                                       0.1, -1.0, False, True)
    np.testing.assert_array_equal(got.numpy(), unread.numpy())


def test_a_failing_check_of_one_block_raises_that_blocks_error():
    """A singular damped factor in the second block of three (π = 1, no damping): the
    estimator's one read fails, and the refresh run again raises the block's own error,
    the one its refresh raises on its own."""
    est, state = _three_block_estimator("pi_one", np.random.default_rng(7))
    g = state.blocks_states[1].statistics[1]
    state = _with_output_factor(state, 1, torch.zeros_like(g.raw))
    with pytest.raises(kfac_ref.KFACValueError) as alone:
        est.blocks[1].update_cache(state.blocks_states[1], 0.0, None, -1.0, False)
    with pytest.raises(kfac_ref.KFACValueError) as together:
        est.update_cache(state, 0.0, None, -1.0, False)
    assert str(alone.value) in str(together.value)
    assert "positive definite" in str(alone.value)


def test_the_first_failing_block_raises_first():
    """Block 1 numerically singular (a pivot check, read back once for all blocks) and
    block 2 with a zero factor under kfac-jax's fall-back (an error raised at once), no
    damping: the user sees block 1's error, as when each block read its own checks."""
    est, state = _three_block_estimator("identity", np.random.default_rng(8))
    g0, g1 = (st.statistics[1] for st in state.blocks_states[:2])
    d = g0.raw.shape[0]
    tiny = torch.diag(torch.tensor([1.0] + [1e-20] * (d - 1), dtype=torch.float64))
    state = _with_output_factor(state, 0, tiny * g0.weight)
    state = _with_output_factor(state, 1, torch.zeros_like(g1.raw))
    with pytest.raises(kfac_ref.KFACValueError) as first:
        est.blocks[0].update_cache(state.blocks_states[0], 0.0, None, -1.0, False)
    assert "numerically singular" in str(first.value)
    with pytest.raises(kfac_ref.KFACValueError) as together:
        est.update_cache(state, 0.0, None, -1.0, False)
    assert str(first.value) in str(together.value)


def _update_args(rng):
    est, state = _three_block_estimator("pi_one", rng)
    params = tuple(tuple(_t(a) for a in p)
                   for p in est.net.init_params(rng, np.zeros(1)))
    batch = (_t(rng.standard_normal((8, 5))), torch.as_tensor(rng.integers(0, 3, 8)))
    return est, state, params, batch


def test_an_estimator_update_reads_its_arguments_once(reads):
    """With value checks on, one update reads back three times, whatever the number of
    layers: the range of the targets (at once: they index the outputs), the finiteness
    scans of the six parameter arrays, ``x`` and the network output together (after the
    loss is built), and the scans of the six updated statistics together (before the state
    is returned).  A loss built on the output array itself needs no read to show that it
    passes the output unchanged."""
    est, state, params, batch = _update_args(np.random.default_rng(9))
    reads["n"] = 0
    est.update_curvature_matrix_estimate(state, 0.0, 1.0, 8, None, (params, batch),
                                         "ggn_exact")
    assert reads["n"] == 3


def test_a_type_error_after_a_pending_check_comes_second_as_eagerly():
    """Non-finite parameters and targets of a float dtype: an eager run names the
    parameters first.  On torch the parameters' scan is still unread when the loss refuses
    the targets' dtype; the update evaluates again with each check read at once and raises
    the parameters' error, word for word as on NumPy."""
    messages = []
    for to in (np.asarray, _t):
        est, _, params, batch = _update_args(np.random.default_rng(11))
        params = [[np.asarray(a) for a in p] for p in params]
        x, y = np.asarray(batch[0]), np.asarray(batch[1])
        state = est.init(None, (tuple(tuple(to(a) for a in p) for p in params),
                                (to(x), torch.as_tensor(y) if to is _t else y)))
        params[0][0] = params[0][0].copy()
        params[0][0][0, 0] = np.nan
        bad_y = y.astype(np.float64)  # a float dtype: the loss refuses it (a type error)
        fa = (tuple(tuple(to(a) for a in p) for p in params), (to(x), to(bad_y)))
        with pytest.raises(kfac_ref.KFACValueError) as err:
            est.update_curvature_matrix_estimate(state, 0.0, 1.0, 8, None, fa, "ggn_exact")
        messages.append(str(err.value))
    assert messages[0] == messages[1].replace("torch.float64", "float64")
    assert "params[0][0]" in messages[1]


@pytest.mark.parametrize("where", ["params", "x"])
def test_a_non_finite_argument_among_those_read_together_is_named(where):
    """The scans read back together fail together: the checks run again one by one and
    name the argument, word for word as NumPy's (read at once) do."""
    messages = []
    for to in (np.asarray, _t):
        est, _, params, batch = _update_args(np.random.default_rng(10))
        params = [[np.asarray(a) for a in p] for p in params]
        x, y = np.asarray(batch[0]), np.asarray(batch[1])
        good = tuple(tuple(to(a) for a in p) for p in params)
        state = est.init(None, (good, (to(x), to(y))))
        if where == "params":
            params[2][0] = params[2][0].copy()
            params[2][0][1, 1] = np.nan
        else:
            x = x.copy()
            x[3, 0] = np.inf
        fa = (tuple(tuple(to(a) for a in p) for p in params), (to(x), to(y)))
        with pytest.raises(kfac_ref.KFACValueError) as err:
            est.update_curvature_matrix_estimate(state, 0.0, 1.0, 8, None, fa, "ggn_exact")
        messages.append(str(err.value))
    assert messages[0] == messages[1].replace("torch.float64", "float64")
    assert ("params[2][0] (d2.w)" if where == "params" else "x must be finite") in messages[1]


def test_finite_arguments_whose_scans_overflow_together_pass(reads):
    """float32 arrays whose sums are finite but whose total overflows: the one read fails,
    the scans run again one by one, and every array passes."""
    import kfac_ref.nn as nn

    net = nn.Sequential([("d1", nn.Dense(2, 2)), ("d2", nn.Dense(2, 2))])
    big = torch.full((2, 2), 8e37, dtype=torch.float32)  # sum 3.2e38 < 3.4e38
    params = ((big, torch.zeros(2)), (big, torch.zeros(2)))
    x = torch.ones((3, 2))
    reads["n"] = 0
    checked = net.check_params_and_input("f", params, x)
    assert all(a is b for p, q in zip(checked, params, strict=True)
               for a, b in zip(p, q, strict=True))
    assert reads["n"] == 1 + 5  # the total, then each array's own scan (x's too)
