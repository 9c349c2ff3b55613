"""Oracle: kfac-jax's Kronecker factors of a small JAX CNN against reference_jax_kfac.

kfac-jax (``BlockDiagonalCurvature`` with hand-registered ``register_conv2d`` /
``register_dense`` layers and ``register_softmax_cross_entropy_loss``, one
``update_curvature_matrix_estimate`` with ``ema_old=0, ema_new=1``) stores, for the patch
order ``(kh, kw, C_in)`` with the ones column last, ``A = Σ ā āᵀ / (N·|T|)`` and
``G = Σ g gᵀ / (N·|T|)`` for a convolution and ``/N`` for a dense layer.  The documented
conversion into conformance.own_model's convention is ``G ← |T|·G`` for the convolution
(``A`` unchanged), and for ``fisher_empirical`` one more ``N`` on every ``G`` (kfac-jax's
empirical-Fisher scale): the raw factors are diagnosed ``scale:1/T`` (``scale:1/(N·T)``,
``scale:1/N``), the converted ones agree.  Skipped where kfac-jax is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
kfac_jax = pytest.importorskip("kfac_jax")
jnp = jax.numpy
lax = jax.lax

from conformance.own_model import check_jax_kfac, reference_jax_kfac  # noqa: E402

N, H, W, C_IN, C_OUT, CLASSES = 3, 6, 5, 2, 3, 3
PADS = ((1, 0), (2, 1))
STRIDES, KERNEL = (2, 1), (3, 2)


pytestmark = pytest.mark.usefixtures("jax_x64")  # float64 for every test


def _setup(dil=(1, 1)):  # kfac-jax 0.0.8 and dilation: see the last test
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((N, H, W, C_IN)))
    k = jnp.asarray(rng.standard_normal((*KERNEL, C_IN, C_OUT)) * 0.5)
    kb = jnp.asarray(rng.standard_normal(C_OUT) * 0.1)
    dn = lax.conv_dimension_numbers(x.shape, k.shape, ("NHWC", "HWIO", "NHWC"))
    d = int(np.prod(lax.conv_general_dilated(x[:1], k, STRIDES, PADS, rhs_dilation=dil,
                                             dimension_numbers=dn).shape))
    w = jnp.asarray(rng.standard_normal((d, CLASSES)) * 0.3)
    y = jnp.asarray(rng.integers(0, CLASSES, N))
    theta = [[k, kb], [w]]

    def conv(x, k):
        return lax.conv_general_dilated(x, k, STRIDES, PADS, rhs_dilation=dil,
                                        dimension_numbers=dn)

    def model(th, x, eps):  # conformance.own_model.check_jax_kfac's form
        s1 = conv(x, th[0][0]) + th[0][1] + eps.get("conv", 0.0)
        h = jnp.tanh(s1).reshape(x.shape[0], -1)
        s2 = h @ th[1][0] + eps.get("fc", 0.0)
        return s2, {"conv": (x, s1), "fc": (h, s2)}

    def loss_fn(th, batch):  # kfac-jax's form: the same network with its tags
        xx, yy = batch
        s1 = conv(xx, th[0][0]) + th[0][1]
        s1 = kfac_jax.register_conv2d(
            s1, xx, th[0][0], th[0][1], window_strides=STRIDES, padding=PADS,
            lhs_dilation=(1, 1), rhs_dilation=dil, dimension_numbers=dn,
            feature_group_count=1, batch_group_count=1, precision=None,
            preferred_element_type=None)
        h = jnp.tanh(s1).reshape(xx.shape[0], -1)
        s2 = kfac_jax.register_dense(h @ th[1][0], h, th[1][0])
        kfac_jax.register_softmax_cross_entropy_loss(s2, yy)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(s2), yy[:, None], 1))

    layers = {"conv": {"kind": "conv2d", "kernel": KERNEL, "strides": STRIDES,
                       "padding": PADS, "dilation": dil, "bias": True},
              "fc": {"kind": "dense", "bias": False}}
    return model, loss_fn, theta, x, y, layers


def _kfac_jax_factors(loss_fn, theta, x, y, mode):
    est = kfac_jax.BlockDiagonalCurvature(loss_fn, auto_register_tags=False)
    key = jax.random.PRNGKey(0)
    st = est.init(key, (theta, (x, y)), exact_powers_to_cache=None,
                  approx_powers_to_cache=None)
    st = est.update_curvature_matrix_estimate(
        st, ema_old=0.0, ema_new=1.0, identity_weight=0.0, batch_size=N, rng=key,
        func_args=(theta, (x, y)), estimation_mode=mode)
    blocks = st.blocks_states
    return {name: {"A": np.asarray(b.factors[0].value), "G": np.asarray(b.factors[1].value)}
            for name, b in zip(("conv", "fc"), blocks, strict=True)}


def test_kfac_jax_ggn_exact_factors_agree_after_the_T_conversion():
    model, loss_fn, theta, x, y, layers = _setup()
    theirs = _kfac_jax_factors(loss_fn, theta, x, y, "ggn_exact")
    ref = reference_jax_kfac(model, theta, x, y, layers)
    t = ref["conv"]["T"]
    assert t == 3 * 7  # H: (6 + 1 - 3) // 2 + 1; W: 5 + 3 - 2 + 1
    np.testing.assert_allclose(theirs["conv"]["A"], ref["conv"]["A"], rtol=1e-11, atol=1e-14)
    np.testing.assert_allclose(t * theirs["conv"]["G"], ref["conv"]["G"], rtol=1e-10,
                               atol=1e-15)
    np.testing.assert_allclose(theirs["fc"]["A"], ref["fc"]["A"], rtol=1e-11, atol=1e-14)
    np.testing.assert_allclose(theirs["fc"]["G"], ref["fc"]["G"], rtol=1e-10, atol=1e-15)
    raw = check_jax_kfac(model, theta, x, y, layers, theirs)
    assert {(c.layer, c.factor): c.diagnosis for c in raw.checks} == {
        ("conv", "A"): "", ("conv", "G"): "scale:1/T", ("fc", "A"): "", ("fc", "G"): ""}, \
        str(raw)
    converted = {**theirs, "conv": {"A": theirs["conv"]["A"], "G": t * theirs["conv"]["G"]}}
    res = check_jax_kfac(model, theta, x, y, layers, converted)
    assert res.ok, str(res)


def test_kfac_jax_empirical_factors():
    """kfac-jax's fisher_empirical carries an extra 1/N (its empirical-Fisher scale), so its
    G is 1/(N·|T|) × the reference's for the convolution and 1/N × for the dense layer: the
    check names both, and the converted factors agree."""
    model, loss_fn, theta, x, y, layers = _setup()
    theirs = _kfac_jax_factors(loss_fn, theta, x, y, "fisher_empirical")
    raw = check_jax_kfac(model, theta, x, y, layers, theirs, mode="fisher_empirical")
    assert {(c.layer, c.factor): c.diagnosis for c in raw.checks} == {
        ("conv", "A"): "", ("conv", "G"): "scale:1/(N·T)", ("fc", "A"): "",
        ("fc", "G"): "scale:1/N"}, str(raw)
    t = reference_jax_kfac(model, theta, x, y, layers)["conv"]["T"]
    converted = {"conv": {"A": theirs["conv"]["A"], "G": N * t * theirs["conv"]["G"]},
                 "fc": {"A": theirs["fc"]["A"], "G": N * theirs["fc"]["G"]}}
    res = check_jax_kfac(model, theta, x, y, layers, converted, mode="fisher_empirical")
    assert res.ok, str(res)


def test_kfac_jax_dilated_conv_input_factor_ignores_the_dilation():
    """Observed with kfac-jax 0.0.8: with rhs_dilation != 1 its input factor is the one of
    the same convolution without dilation (its patch extraction drops rhs_dilation); the
    check names it ``dilation_ignored`` (the reference's dilated patches are checked against the
    kernel Jacobian in test_conformance_own_model_jax.py)."""
    from kfac_ref.factors import conv_input_kronecker_factor

    model, loss_fn, theta, x, y, layers = _setup(dil=(1, 2))
    theirs = _kfac_jax_factors(loss_fn, theta, x, y, "ggn_exact")
    res = check_jax_kfac(model, theta, x, y, layers, theirs)
    by = {(c.layer, c.factor): c for c in res.checks}
    assert not by["conv", "A"].ok and by["conv", "A"].diagnosis == "dilation_ignored", str(res)
    assert by["fc", "A"].ok
    undilated = conv_input_kronecker_factor(np.asarray(x), (*KERNEL, C_IN, C_OUT), PADS,
                                            strides=STRIDES, dilation_rate=(1, 1),
                                            has_bias=True)
    np.testing.assert_allclose(theirs["conv"]["A"], np.asarray(undilated), rtol=1e-12)
