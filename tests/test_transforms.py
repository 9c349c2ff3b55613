"""``jax.jit`` and ``jax.vmap`` of the objects declared "yes" for them in
:mod:`kfac_ref.capabilities`, against the eager NumPy result on the same data.

The parametrisation is generated from the declarations: every declared "yes" must have a
case here (a test fails otherwise), and every case must be declared.  Inside a trace the
value checks are skipped (tracers are lazy); shapes and options are still checked.
"""

from __future__ import annotations

import numpy as np
import pytest
import test_jit as jit_tests
import test_jit_states as jit_state_tests

import kfac_ref
from kfac_ref import averaging, capabilities, factors, linalg, optim
from kfac_ref.blocks import kfac_jax as kj

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jax.config.update("jax_enable_x64", True)


def _spd(rng, n):
    x = rng.standard_normal((2 * n, n))
    return x.T @ x / (2 * n) + 0.1 * np.eye(n)


# name -> (function of arrays, arrays built from a Generator); the same function is run
# eagerly on NumPy and under the transformation on JAX.
JIT_CASES = {
    "kfac_ref.linalg.compute_cov": (
        lambda x: linalg.compute_cov(x), lambda r: (r.standard_normal((20, 4)),)),
    "kfac_ref.linalg.append_homog": (
        lambda x: linalg.append_homog(x), lambda r: (r.standard_normal((5, 3)),)),
    "kfac_ref.linalg.kron_matvec": (
        lambda a, b, v: linalg.kron_matvec(a, b, v),
        lambda r: (_spd(r, 3), _spd(r, 2), r.standard_normal((3, 2)))),
    "kfac_ref.linalg.kron_matmat": (
        lambda a, b, v: linalg.kron_matmat(a, b, v),
        lambda r: (_spd(r, 3), _spd(r, 2), r.standard_normal((6, 4)))),
    "kfac_ref.linalg.damped_matpower": (
        lambda m, d: linalg.damped_matpower(m, -0.5, d), lambda r: (_spd(r, 4), np.array(0.1))),
    "kfac_ref.linalg.damped_inverse": (
        lambda m: linalg.damped_inverse(m, 0.1), lambda r: (_spd(r, 4),)),
    "kfac_ref.linalg.pi_tracenorm": (
        lambda a, g: linalg.pi_tracenorm(a, g), lambda r: (_spd(r, 4), _spd(r, 3))),
    "kfac_ref.linalg.pi_adjusted_damping": (
        lambda a, g: linalg.pi_adjusted_damping(a, g, 0.01)[0],
        lambda r: (_spd(r, 4), _spd(r, 3))),
    "kfac_ref.linalg.factor_norm": (
        lambda a: linalg.factor_norm(a, "avg_fro"), lambda r: (_spd(r, 4),)),
    "kfac_ref.linalg.kron_damped_inverse_matvec": (
        lambda a, g, v: linalg.kron_damped_inverse_matvec(a, g, v, damping=0.01),
        lambda r: (_spd(r, 4), _spd(r, 3), r.standard_normal((4, 3)))),
    "kfac_ref.averaging.weighted_accumulate": (
        lambda old, new: averaging.weighted_accumulate(old, new, 0.9, 0.1),
        lambda r: (r.standard_normal((3, 3)), r.standard_normal((3, 3)))),
    "kfac_ref.factors.fully_connected_kronecker_factor": (
        lambda x: factors.fully_connected_kronecker_factor(x, has_bias=True),
        lambda r: (r.standard_normal((16, 4)),)),
    # the optimiser's 2×2 model (coefficients) and norm constraint (ν) on traced arrays
    "kfac_ref.optim.quadratic_model": (
        lambda a, d, b: optim.quadratic_model(a, d, b, 0.1)[0],
        lambda r: (_spd(r, 2), _spd(r, 2), r.standard_normal(2))),
    "kfac_ref.optim.norm_constraint_coefficient": (
        lambda p, g: optim.norm_constraint_coefficient(p, g, 0.5, 0.01)[0],
        lambda r: (np.abs(r.standard_normal(5)), np.abs(r.standard_normal(5)))),
}

# Blocks: one update from a batch, then a damped inverse product, all in one jitted
# function (the state built inside; tests/test_jit_states.py passes it across the boundary).
_CONV = dict(inputs_shape=(4, 5, 5, 2), kernel_shape=(2, 2, 2, 3))


def _block_case(make, conv, zero_grads=False):
    def build(r):
        if conv:
            x, g = r.standard_normal((4, 5, 5, 2)), r.standard_normal((4, 4, 4, 3))
        else:
            x, g = r.standard_normal((4, 3)), r.standard_normal((4, 2))
        g = 0.0 * g if zero_grads else g
        vec = [r.standard_normal(s) for s in make().parameters_shapes]
        return (x, g, *vec)

    def fn(x, g, *vec):
        block = make()
        state = block.init(x[0, ...])
        state = block.update_curvature_matrix_estimate(
            state, {"inputs": x, "outputs_grad": g}, 0.0, 1.0, 4)
        return block.multiply_matpower(state, tuple(vec), 0.1, -1.0, False, False)[0]

    return fn, build


BLOCK_JIT_CASES = {
    "kfac_ref.blocks.kfac_jax.DenseTwoKroneckerFactored": _block_case(
        lambda: kj.DenseTwoKroneckerFactored(3, 2), False),
    "kfac_ref.blocks.kfac_jax.DenseDiagonal": _block_case(lambda: kj.DenseDiagonal(3, 2), False),
    "kfac_ref.blocks.kfac_jax.DenseFull": _block_case(lambda: kj.DenseFull(3, 2), False),
    "kfac_ref.blocks.kfac_jax.DenseEKFAC": _block_case(lambda: kj.DenseEKFAC(3, 2), False),
    "kfac_ref.blocks.kfac_jax.Conv2DTwoKroneckerFactored": _block_case(
        lambda: kj.Conv2DTwoKroneckerFactored(**_CONV), True),
    "kfac_ref.blocks.kfac_jax.Conv2DDiagonal": _block_case(
        lambda: kj.Conv2DDiagonal(**_CONV), True),
    "kfac_ref.blocks.kfac_jax.Conv2DFull": _block_case(lambda: kj.Conv2DFull(**_CONV), True),
}
JIT_CASES.update(BLOCK_JIT_CASES)


def test_zero_factor_fallback_under_jit():
    """kfac-jax's zero-factor case (a zero G: the damped block is λI) is a branch on values;
    under jit both sides are computed and selected, with the eager result."""
    fn, build = _block_case(lambda: kj.DenseTwoKroneckerFactored(3, 2), False, zero_grads=True)
    host = build(np.random.default_rng(3))
    expected = np.asarray(fn(*host))
    np.testing.assert_allclose(expected, host[2] / 0.1, rtol=1e-12)
    got = np.asarray(jax.jit(fn)(*(jnp.asarray(h) for h in host)))
    np.testing.assert_allclose(got, expected, rtol=1e-12)


VMAP_CASES = {  # a leading batch of 3 independent problems
    "kfac_ref.linalg.compute_cov": (
        lambda x: linalg.compute_cov(x), lambda r: (r.standard_normal((3, 20, 4)),)),
    "kfac_ref.linalg.append_homog": (
        lambda x: linalg.append_homog(x), lambda r: (r.standard_normal((3, 5, 2)),)),
    "kfac_ref.linalg.kron_matvec": (
        lambda a, b, v: linalg.kron_matvec(a, b, v),
        lambda r: (np.stack([_spd(r, 3)] * 3), np.stack([_spd(r, 2)] * 3),
                   r.standard_normal((3, 3, 2)))),
}


def _declared(column):
    return sorted(n for n, s in capabilities.support_table().items() if s.state(column) == "yes")


@pytest.mark.parametrize("column,cases", [("jit", JIT_CASES), ("vmap", VMAP_CASES)])
def test_cases_are_the_declarations(column, cases):
    exercised = set(cases) | (jit_tests.JIT_EXERCISED | jit_state_tests.JIT_STATE_EXERCISED
                              if column == "jit" else set())
    assert sorted(exercised) == _declared(column)


def test_jit_refusals_are_declared():
    refused = sorted(n for n, s in capabilities.support_table().items()
                     if s.state("jit") == "no")
    assert refused == sorted(jit_tests.JIT_REFUSED)


def _run(transform, name, cases):
    fn, make = cases[name]
    host = make(np.random.default_rng(20261203))
    if transform == "jit":
        expected = np.asarray(fn(*host))
        got = jax.jit(fn)(*(jnp.asarray(h) for h in host))
    else:
        expected = np.stack([np.asarray(fn(*(h[i] for h in host))) for i in range(3)])
        got = jax.vmap(fn)(*(jnp.asarray(h) for h in host))
    got = np.asarray(got)
    assert got.shape == expected.shape
    scale = max(float(np.max(np.abs(expected))), 1e-300)
    assert float(np.max(np.abs(got - expected))) <= 1e-12 * scale


@pytest.mark.parametrize("name", sorted(set(_declared("jit")) - jit_tests.JIT_EXERCISED
                                         - (jit_state_tests.JIT_STATE_EXERCISED
                                            - set(BLOCK_JIT_CASES))))
def test_jit(name):
    _run("jit", name, JIT_CASES)


@pytest.mark.parametrize("name", _declared("vmap"))
def test_vmap(name):
    _run("vmap", name, VMAP_CASES)


def test_value_checks_skipped_under_jit_but_not_shape_checks():
    @jax.jit
    def f(x):
        return kfac_ref.compute_cov(x)

    out = f(jnp.asarray(np.array([[np.nan, 1.0], [0.0, 1.0]])))
    assert np.isnan(np.asarray(out)).any()
    with pytest.raises(ValueError, match="compute_cov: tensor must be a 2-D array"):
        f(jnp.zeros((2, 2, 2)))


def test_loss_sample_under_jit_draws_its_noise_once_at_trace_time():
    """As documented in ``NegativeLogProbLoss.sample``: the host noise is drawn when the
    function is traced, so the compiled function returns the same samples on every call
    (those of the eager call with the same seed); eager calls resample."""
    from kfac_ref.losses import CategoricalLogitsNegativeLogProbLoss as CE

    logits = np.random.default_rng(0).standard_normal((64, 5))
    rng = np.random.default_rng(7)
    f = jax.jit(lambda z: CE(z).sample(rng))
    first, second = np.asarray(f(jnp.asarray(logits))), np.asarray(f(jnp.asarray(logits)))
    np.testing.assert_array_equal(first, second)
    eager = np.asarray(CE(logits).sample(np.random.default_rng(7)))
    np.testing.assert_array_equal(first, eager)
    again = np.asarray(CE(logits).sample(rng))  # rng moved on at trace time: new draws
    assert not np.array_equal(again, eager)
