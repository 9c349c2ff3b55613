"""Loss functions: each argument validated once, one precision policy, value checks that
can be switched off, and hyper-parameters given as 0-D arrays."""

from __future__ import annotations

import numpy as np
import pytest

import kfac_ref
import kfac_ref._backend as B
from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref import losses as L

CAT = L.CategoricalLogitsNegativeLogProbLoss
ONEHOT = L.OneHotCategoricalLogitsNegativeLogProbLoss
BERN = L.MultiBernoulliNegativeLogProbLoss
NORMAL = L.NormalMeanNegativeLogProbLoss
MV = L.NormalMeanVarianceNegativeLogProbLoss

MIXED = "does not mix precisions"


def _host(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape)


def _pair(xp):
    """(float64 maker, float32 maker) on the backend's device; float64 cells only."""
    if not xp.float64:
        pytest.skip("needs a float64 and a float32 array on one device")

    def f64(host):
        return xp.xp.asarray(np.asarray(host), dtype=xp.xp.float64, device=xp.device)

    def f32(host):
        return xp.xp.asarray(np.asarray(host), dtype=xp.xp.float32, device=xp.device)

    return f64, f32


# -- mixed precision: rejected by namespace_of's policy, naming function and argument --------
@pytest.mark.parametrize("primary", ["float32", "float64"])
def test_every_loss_rejects_mixed_precision_inputs(xp, primary):
    f64, f32 = _pair(xp)
    main, other = (f32, f64) if primary == "float32" else (f64, f32)
    z = _host(0, (3, 4))
    y = np.eye(4)[[0, 2, 1]]
    cases = [
        ("CategoricalLogitsNegativeLogProbLoss", "mask",
         lambda: CAT(main(z), mask=other(np.ones(3)))),
        ("OneHotCategoricalLogitsNegativeLogProbLoss", "targets",
         lambda: ONEHOT(main(z), other(y))),
        ("OneHotCategoricalLogitsNegativeLogProbLoss", "mask",
         lambda: ONEHOT(main(z), main(y), mask=other(np.ones(3)))),
        ("MultiBernoulliNegativeLogProbLoss", "targets",
         lambda: BERN(main(z), other(y))),
        ("NormalMeanNegativeLogProbLoss", "targets",
         lambda: NORMAL(main(z), other(z))),
        ("NormalMeanNegativeLogProbLoss", "variance",
         lambda: NORMAL(main(z), variance=other(0.5))),
        ("NormalMeanVarianceNegativeLogProbLoss", "variance",
         lambda: MV(main(z), other(z * z + 1.0))),
        ("NormalMeanVarianceNegativeLogProbLoss", "targets",
         lambda: MV(main(z), main(z * z + 1.0), other(z))),
    ]
    for cls in (CAT, ONEHOT, BERN, NORMAL):
        cases.append((cls.__name__, "weight", lambda cls=cls: cls(main(z), weight=other(1.0))))
    cases.append(("NormalMeanVarianceNegativeLogProbLoss", "weight",
                  lambda: MV(main(z), main(z * z + 1.0), weight=other(1.0))))
    for func, arg, build in cases:
        with pytest.raises(KFACTypeError, match=fr"^{func}: {arg} must have the floating "
                                                 fr"dtype of .*{MIXED}"):
            build()


@pytest.mark.parametrize("primary", ["float32", "float64"])
def test_every_loss_method_rejects_mixed_precision_vectors(xp, primary):
    f64, f32 = _pair(xp)
    main, other = (f32, f64) if primary == "float32" else (f64, f32)
    z = _host(1, (3, 4))
    losses = [CAT(main(z)), ONEHOT(main(z)), BERN(main(z)), NORMAL(main(z)),
              MV(main(z), main(z * z + 1.0))]
    for loss in losses:
        name = type(loss).__name__
        vec = tuple(other(np.asarray(p)) for p in (z,) * loss.num_parameter_dependants)
        inner = other(np.zeros(loss.fisher_factor_inner_shape))
        for method in ("multiply_fisher", "multiply_ggn", "multiply_fisher_factor_transpose",
                       "multiply_ggn_factor_transpose_unweighted"):
            with pytest.raises(KFACTypeError, match=fr"^{name}.{method}: vector\[0\] must have "
                                                     fr"the floating dtype of .*{MIXED}"):
                getattr(loss, method)(vec)
        for method in ("multiply_fisher_factor", "multiply_ggn_factor_unweighted"):
            with pytest.raises(KFACTypeError, match=fr"^{name}.{method}: vector must have the "
                                                     fr"floating dtype of .*{MIXED}"):
                getattr(loss, method)(inner)


def test_mixed_precision_message_names_the_input_argument():
    loss = MV(np.ones((2, 3)), np.ones((2, 3)))
    with pytest.raises(KFACTypeError, match=r"vector\[1\] must have the floating dtype of "
                                             r"mean \(float64\); got float32"):
        loss.multiply_fisher((np.ones((2, 3)), np.ones((2, 3), np.float32)))


# -- one scan per input ------------------------------------------------------------------------
@pytest.fixture
def scans(monkeypatch):
    """Shapes of the arrays that kfac_ref._backend.all_finite scans, in call order."""
    calls = []
    real = B.all_finite
    monkeypatch.setattr(B, "all_finite", lambda ns, x: calls.append(tuple(x.shape)) or
                        real(ns, x))
    return calls


def test_construction_fisher_factor_and_product_scan_each_input_once(xp, scans):
    z = xp.asarray(_host(2, (5, 3)))
    mask = xp.asarray(np.array([1.0, 0.0, 1.0, 1.0, 1.0]))
    targets = xp.asarray(np.array([0, 1, 2, 0, 1]), dtype=xp.xp.int64 if xp.float64
                         else xp.xp.int32)
    loss = CAT(z, targets, mask, weight=0.5)
    assert scans == [(5, 3), (5,)]  # logits, mask (integer targets have no NaN)
    u = xp.asarray(_host(3, (5, 3)))
    loss.multiply_fisher_factor(u)
    assert scans[2:] == [(5, 3)]
    loss.multiply_fisher((u,))
    loss.multiply_ggn_factor_transpose((u,))
    assert scans[3:] == [(5, 3), (5, 3)]
    loss.fisher_matrix(), loss.fisher_factor_matrix(), loss.evaluate()
    loss.grad_of_evaluate_on_sample(np.random.default_rng(0), "sqrt")
    assert len(scans) == 5  # nothing new to check: no scan


@pytest.mark.parametrize("name", ["onehot", "bernoulli", "normal", "mean_variance"])
def test_every_loss_scans_each_input_once(xp, scans, name):
    zh = _host(4, (3, 4))
    z = xp.asarray(zh)
    if name == "onehot":
        loss = ONEHOT(z, xp.asarray(np.eye(4)[[0, 3, 1]]))
    elif name == "bernoulli":
        loss = BERN(z, xp.asarray((zh > 0) * 1.0))
    elif name == "normal":
        loss = NORMAL(z, xp.asarray(zh + 1.0))
    else:
        loss = MV(z, xp.asarray(zh * zh + 1.0), xp.asarray(zh - 1.0))
    n_inputs = 3 if name == "mean_variance" else 2
    assert len(scans) == n_inputs
    loss.multiply_fisher_factor(xp.asarray(np.ones(loss.fisher_factor_inner_shape)))
    assert len(scans) == n_inputs + 1
    loss.multiply_fisher(tuple(loss.params))
    assert len(scans) == n_inputs + 1 + loss.num_parameter_dependants


# -- value checks: skipped when switched off, static checks stay ----------------------------
def test_value_checks_off_skips_only_value_checks():
    z = np.zeros((3, 4))
    bad_mask = np.array([1.0, 0.5, 0.0])
    with pytest.raises(KFACValueError, match="mask must hold only 0 and 1"):
        CAT(z, mask=bad_mask)
    with pytest.raises(KFACValueError, match="class indices in"):
        CAT(z, np.array([0, 9, 1]))
    with pytest.raises(KFACValueError, match="one-hot rows"):
        ONEHOT(z, np.ones((3, 4)))
    with pytest.raises(KFACValueError, match=r"lie in \[0, 1\]"):
        BERN(z, z + 2.0)
    with pytest.raises(KFACValueError, match="strictly positive"):
        MV(z, z)
    with kfac_ref.value_checks(False):
        CAT(z, mask=bad_mask)
        ONEHOT(z, np.ones((3, 4)))
        BERN(z, z + 2.0)
        MV(z, z)
        with pytest.raises(KFACValueError, match=r"targets must be an array of shape \(3\)"):
            CAT(z, np.array([0, 1]))
        with pytest.raises(KFACTypeError, match="normalize_log_prob must be a bool"):
            NORMAL(z, normalize_log_prob="no")


# -- hyper-parameters as 0-D arrays -------------------------------------------------------------
def test_weight_and_variance_as_zero_d_arrays_match_python_numbers(xp):
    zh = _host(5, (3, 4))
    z = xp.asarray(zh)
    w, v = xp.asarray(np.array(1.7)), xp.asarray(np.array(0.8))
    u = xp.asarray(_host(6, (3, 4)))
    for make in (lambda w, v: CAT(z, weight=w), lambda w, v: BERN(z, weight=w),
                 lambda w, v: NORMAL(z, xp.asarray(zh + 1.0), variance=v, weight=w)):
        arr, num = make(w, v), make(1.7, 0.8)
        for method in ("multiply_fisher_factor", "multiply_ggn_factor"):
            xp.assert_close(getattr(arr, method)(u)[0], xp.to_numpy(getattr(num, method)(u)[0]))
        xp.assert_close(arr.multiply_fisher_factor_transpose((u,)),
                        xp.to_numpy(num.multiply_fisher_factor_transpose((u,))))
        xp.assert_close(arr.fisher_factor_matrix(), xp.to_numpy(num.fisher_factor_matrix()))
    arr = NORMAL(z, xp.asarray(zh + 1.0), variance=v, weight=w)
    num = NORMAL(z, xp.asarray(zh + 1.0), variance=0.8, weight=1.7)
    xp.assert_close(arr.evaluate(), xp.to_numpy(num.evaluate()))


def test_private_formulas_are_the_public_methods_without_checks(xp):
    z = xp.asarray(_host(7, (3, 4)))
    loss = CAT(z, xp.asarray(np.array([0, 1, 3]), dtype=xp.xp.int64 if xp.float64
                             else xp.xp.int32), weight=2.0)
    u = xp.asarray(_host(8, (3, 4)))
    pairs = [(loss.multiply_fisher((u,))[0], loss._curvature_vp((u,))[0]),
             (loss.multiply_ggn((u,))[0], loss._curvature_vp((u,))[0]),
             (loss.multiply_fisher_unweighted((u,))[0],
              loss._curvature_vp((u,), weighted=False)[0]),
             (loss.multiply_ggn_factor(u)[0], loss._factor_vp(u)[0]),
             (loss.multiply_fisher_factor_transpose((u,)), loss._factor_t_vp((u,))),
             (loss.multiply_fisher_factor_replicated_one_hot([2])[0],
              loss._factor_column((2,))[0]),
             (loss.evaluate(None, "sqrt"), loss._evaluate(None, "sqrt")),
             (loss.grad_of_evaluate(None, "off")[0], loss._grad(None, "off")[0]),
             (loss.hessian_matrix(), loss._hessian_matrix()),
             (loss.ggn_factor_matrix(), loss._factor_matrix())]
    for public, private in pairs:
        xp.assert_close(private, xp.to_numpy(public), rtol=0.0)


# -- sampling from NaN parameters (value checks off, traced or lazy) ----------------------------
def _nan_first_row(xp):
    host = _host(11, (3, 4))
    host[0, 2] = np.nan
    return xp.asarray(host), host


def test_samples_from_nan_logits_are_marked_not_guessed(xp):
    """With value checks off a NaN logit gives no draw: class -1 for class indices, a NaN row
    for one-hot targets, NaN for that Bernoulli entry; the finite rows are drawn as usual
    (the same draws as from the logits without the NaN row)."""
    z, host = _nan_first_row(xp)
    clean = xp.asarray(np.where(np.isnan(host), 0.0, host))
    with kfac_ref.value_checks(False):
        cat = xp.to_numpy(CAT(z).sample(np.random.default_rng(3)))
        onehot = xp.to_numpy(ONEHOT(z).sample(np.random.default_rng(3)))
        bern = xp.to_numpy(BERN(z).sample(np.random.default_rng(3)))
    cat_clean = xp.to_numpy(CAT(clean).sample(np.random.default_rng(3)))
    bern_clean = xp.to_numpy(BERN(clean).sample(np.random.default_rng(3)))
    assert cat[0] == -1 and np.array_equal(cat[1:], cat_clean[1:])
    assert np.isnan(onehot[0]).all() and np.array_equal(onehot[1:], np.eye(4)[cat_clean[1:]])
    assert np.isnan(bern[0, 2]) and np.array_equal(np.isnan(bern), np.isnan(host))
    assert np.array_equal(bern[~np.isnan(host)], bern_clean[~np.isnan(host)])
    with kfac_ref.value_checks(False):
        assert np.isnan(xp.to_numpy(NORMAL(z).sample(np.random.default_rng(3)))[0, 2])
    with pytest.raises(KFACValueError, match="logits"):
        CAT(z)  # value checks on: refused before any draw


def test_samples_from_nan_logits_under_jit():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    host = _host(11, (3, 4)).astype(np.float32)
    host[0, 2] = np.nan
    draw = jax.jit(lambda z, key: (CAT(z).sample(key), ONEHOT(z).sample(key),
                                   BERN(z).sample(key)))
    cat, onehot, bern = (np.asarray(a) for a in draw(jnp.asarray(host), jax.random.key(0)))
    assert cat[0] == -1 and set(cat[1:].tolist()) <= {0, 1, 2, 3}
    assert np.isnan(onehot[0]).all() and not np.isnan(onehot[1:]).any()
    assert np.array_equal(np.isnan(bern), np.isnan(host))
