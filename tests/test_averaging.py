"""Moving averages: TF K-FAC's zero-debiased EMA and kfac-jax's weighted moving average."""

import numpy as np
import pytest
from conftest import assert_allclose_normwise
from hypothesis import given
from hypothesis import strategies as st

from kfac_ref import KFACTypeError, KFACValueError, MovingAverageVariable, WeightedMovingAverage
from kfac_ref.averaging import weighted_accumulate


def test_weighted_accumulate_formula():
    assert weighted_accumulate(2.0, 3.0, 0.5, 4.0) == 0.5 * 2.0 + 4.0 * 3.0


def test_zero_debias_closed_form_after_two_updates(xp, rng):
    """With weight 1: value = (d·c1 + c2)/(d + 1) after two updates (TF K-FAC)."""
    c1, c2 = xp.round_host(rng.standard_normal((3, 3))), xp.round_host(rng.standard_normal((3, 3)))
    d = 0.9
    avg = MovingAverageVariable.zeros_like(xp.asarray(c1))
    avg = avg.update(xp.asarray(c1), d).update(xp.asarray(c2), d)
    xp.assert_close(avg.value, (d * c1 + c2) / (d + 1))
    # after one update the value is the batch statistic itself
    one = MovingAverageVariable.zeros_like(xp.asarray(c1)).update(xp.asarray(c1), d)
    xp.assert_close(one.value, c1)


def test_contrib_assign_moving_average_semantics(xp, rng):
    """TF's assign_moving_average(zero_debias=True): biased ← d·biased + (1-d)·x, value =
    biased / (1 - d^k).  Explicit loop as oracle."""
    xs = [xp.round_host(rng.standard_normal(4)) for _ in range(5)]
    d = 0.7
    avg = MovingAverageVariable.zeros_like(xp.asarray(xs[0]))
    biased = np.zeros(4)
    for k, x in enumerate(xs, start=1):
        avg = avg.update(xp.asarray(x), d, weight=1 - d)
        biased = d * biased + (1 - d) * x
        xp.assert_close(avg.value, biased / (1 - d**k))


def test_without_debias_reports_raw_sum(xp, rng):
    x = xp.round_host(rng.standard_normal(3))
    init = xp.round_host(np.ones(3))
    avg = MovingAverageVariable.zeros_like(xp.asarray(x), zero_debias=False,
                                           initial_value=xp.asarray(init))
    avg = avg.update(xp.asarray(x), 0.9, weight=0.1)
    xp.assert_close(avg.value, 0.9 * init + 0.1 * x)
    # zero-initialised and not debiased: biased low by the factor 1 - d^k (docs page
    # Conventions, moving averages)
    plain = MovingAverageVariable.zeros_like(xp.asarray(x), zero_debias=False)
    for _ in range(3):
        plain = plain.update(xp.asarray(x), 0.9, weight=0.1)
    xp.assert_close(plain.value, (1 - 0.9**3) * x)


def test_weighted_moving_average_semantics(xp, rng):
    xs = [xp.round_host(rng.standard_normal((2, 2))) for _ in range(3)]
    avg = WeightedMovingAverage.zeros_like(xp.asarray(xs[0]))
    xp.assert_close(avg.value, np.zeros((2, 2)), rtol=0)
    # ema_old = 0, ema_new = 1 replaces; ema_old = 1, ema_new = 1 is a running mean
    replaced = avg.update(xp.asarray(xs[0]), 1.0, 1.0).update(xp.asarray(xs[1]), 0.0, 1.0)
    xp.assert_close(replaced.value, xs[1])
    running = avg
    for x in xs:
        running = running.update(xp.asarray(x), 1.0, 1.0)
    xp.assert_close(running.value, sum(xs) / 3)


@given(seed=st.integers(0, 2**32 - 1),
       steps=st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.01, 2.0)), min_size=1,
                      max_size=6))
def test_tf_debiased_and_kfac_jax_coincide(xp, seed, steps):
    """TF zero-debiased EMA with decay = ema_old, weight = ema_new equals kfac-jax's
    WeightedMovingAverage, for any schedule of (ema_old, ema_new)."""
    r = np.random.default_rng(seed)
    first = xp.asarray(r.standard_normal(3))
    tf_avg = MovingAverageVariable.zeros_like(first)
    jax_avg = WeightedMovingAverage.zeros_like(first)
    for old, new in steps:
        x = xp.asarray(r.standard_normal(3))
        tf_avg = tf_avg.update(x, old, new)
        jax_avg = jax_avg.update(x, old, new)
    xp.check(tf_avg.value)
    assert_allclose_normwise(xp.to_numpy(tf_avg.value), xp.to_numpy(jax_avg.value),
                             8 * len(steps) * xp.eps)


def test_updates_do_not_mutate(xp, rng):
    x = xp.asarray(rng.standard_normal(2))
    avg = WeightedMovingAverage.zeros_like(x)
    new = avg.update(x, 0.5, 1.0)
    assert avg.weight == 0.0 and new.weight == 1.0
    np.testing.assert_array_equal(xp.to_numpy(avg.raw), 0.0)
    with pytest.raises(AttributeError):
        new.weight = 3.0  # frozen


def test_error_paths(xp):
    x = xp.asarray(np.ones(3))
    avg = MovingAverageVariable.zeros_like(x)
    with pytest.raises(KFACValueError, match=r"MovingAverageVariable.update: x must have the "
                       r"averaged shape \(3,\); got shape \(2,\)"):
        avg.update(xp.asarray(np.ones(2)), 0.9)
    with pytest.raises(KFACValueError, match="decay must be non-negative"):
        avg.update(x, -0.1)
    with pytest.raises(KFACValueError, match="ema_new must be non-negative"):
        WeightedMovingAverage.zeros_like(x).update(x, 0.5, -1.0)
    with pytest.raises(KFACValueError, match="finite"):
        avg.update(xp.asarray(np.array([np.nan, 0.0, 0.0])), 0.9)
    with pytest.raises(KFACValueError, match="initial_value must be None when zero_debias"):
        MovingAverageVariable.zeros_like(x, zero_debias=True, initial_value=x)
    with pytest.raises(KFACTypeError, match="one array namespace"):
        import array_api_strict as xs

        MovingAverageVariable.zeros_like(np.ones(3)).update(xs.ones(3), 0.5)


def test_weighted_accumulate_validates(xp):
    """Every argument of the public formula is checked (NaN in, NaN out once passed)."""
    x = xp.asarray(np.ones(3))
    xp.assert_close(weighted_accumulate(x, x, 0.5, 2.0), np.full(3, 2.5))
    bad = [
        (lambda: weighted_accumulate(x, xp.asarray(np.array([np.nan, 0.0, 0.0])), 1.0, 1.0),
         KFACValueError, "weighted_accumulate: new must be finite"),
        (lambda: weighted_accumulate(x, x, -1.0, 1.0), KFACValueError,
         "weighted_accumulate: old_weight must be non-negative"),
        (lambda: weighted_accumulate(x, x, 1.0, float("inf")), KFACValueError,
         "weighted_accumulate: new_weight must be finite"),
        (lambda: weighted_accumulate(x, xp.asarray(np.ones(2)), 1.0, 1.0), KFACValueError,
         r"weighted_accumulate: new must have the shape of old \(3,\); got shape \(2,\)"),
        (lambda: weighted_accumulate(x, None, 1.0, 1.0), KFACTypeError,
         "weighted_accumulate: new must be an array"),
        (lambda: weighted_accumulate(1.0, x, 1.0, 1.0), KFACTypeError,
         "weighted_accumulate: old must be an array"),
        (lambda: weighted_accumulate(None, None, 1.0, 1.0), KFACTypeError,
         "weighted_accumulate: old must be a real number"),
    ]
    for call, exc, message in bad:
        with pytest.raises(exc, match=message):
            call()


def test_weighted_accumulate_rejects_mixed_namespaces_and_precisions():
    import array_api_strict as xs

    with pytest.raises(KFACTypeError, match="one array namespace"):
        weighted_accumulate(np.ones(2), xs.ones(2), 1.0, 1.0)
    with pytest.raises(KFACTypeError, match="new must have the floating dtype of old"):
        weighted_accumulate(np.ones(2), np.ones(2, dtype=np.float32), 1.0, 1.0)


def test_averages_validate_their_stored_state(xp):
    """A state built directly (not through zeros_like) is checked once, at construction."""
    x = xp.asarray(np.ones(3))
    bad = [
        (lambda: MovingAverageVariable(x, total_weight=-1.0), KFACValueError,
         "MovingAverageVariable: total_weight must be non-negative"),
        (lambda: MovingAverageVariable(xp.asarray(np.array([np.nan, 1.0]))), KFACValueError,
         "MovingAverageVariable: raw must be finite"),
        (lambda: MovingAverageVariable(None), KFACTypeError,
         "MovingAverageVariable: raw must be an array"),
        (lambda: MovingAverageVariable(x, zero_debias=None), KFACTypeError,
         "MovingAverageVariable: zero_debias must be a bool"),
        (lambda: WeightedMovingAverage(x, weight=-1.0), KFACValueError,
         "WeightedMovingAverage: weight must be non-negative"),
        (lambda: WeightedMovingAverage(xp.asarray(np.ones(3, dtype=np.int64))), KFACTypeError,
         "WeightedMovingAverage: raw must be an array of real floating dtype"),
        (lambda: MovingAverageVariable.zeros_like(x, zero_debias="no"), KFACTypeError,
         "MovingAverageVariable.zeros_like: zero_debias must be a bool"),
    ]
    for call, exc, message in bad:
        with pytest.raises(exc, match=message):
            call()
    assert MovingAverageVariable(x, 2.0).value is not None


def test_complex_stored_sum_is_rejected():
    with pytest.raises(KFACTypeError, match="raw must be an array of real floating dtype"):
        MovingAverageVariable(np.ones(2, dtype=complex), 1.0)
