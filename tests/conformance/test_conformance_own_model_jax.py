"""Your own JAX model: reference K-FAC for a function of parameters with per-layer taps,
against a brute-force oracle built here (per-example Jacobians with jax.jacrev, the softmax's
Fisher factor columns by hand, conv patches as the Jacobian of the convolution with respect
to its kernel), and the per-layer diagnosis of deliberately wrong factors."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from conformance.own_model import check_jax_kfac, reference_jax_kfac, sample_targets  # noqa: E402

N, H, W, C_IN, C_OUT, CLASSES, S = 3, 6, 5, 2, 3, 3, 4


pytestmark = pytest.mark.usefixtures("jax_x64")  # float64 for every test


CONV = dict(kernel=(3, 2), strides=(2, 1), padding="SAME", dilation=(1, 2))


def _conv(x, w, spec):
    return jax.lax.conv_general_dilated(
        x, w, spec["strides"], spec["padding"], rhs_dilation=spec["dilation"],
        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _cnn(spec=CONV):
    rng = np.random.default_rng(0)
    params = {"k": rng.standard_normal((*spec["kernel"], C_IN, C_OUT)) * 0.5,
              "kb": rng.standard_normal(C_OUT) * 0.1}
    x = rng.standard_normal((N, H, W, C_IN))
    d = int(np.prod(_conv(x[:1], params["k"], spec).shape))
    params["w"] = rng.standard_normal((d, CLASSES)) * 0.3
    params = {k: jnp.asarray(v) for k, v in params.items()}
    y = rng.integers(0, CLASSES, N)

    def model(p, x, eps):
        s1 = _conv(x, p["k"], spec) + p["kb"] + eps.get("conv", 0.0)
        h = jnp.tanh(s1).reshape(x.shape[0], -1)
        s2 = h @ p["w"] + eps.get("fc", 0.0)
        return s2, {"conv": (x, s1), "fc": (h, s2)}

    layers = {"conv": {"kind": "conv2d", "bias": True, **spec},
              "fc": {"kind": "dense", "bias": False}}
    return model, params, jnp.asarray(x), y, layers


def _shared_mlp():
    rng = np.random.default_rng(1)
    params = {"w1": jnp.asarray(rng.standard_normal((5, 4))),
              "b1": jnp.asarray(rng.standard_normal(4)),
              "w2": jnp.asarray(rng.standard_normal((4, CLASSES)))}
    x = jnp.asarray(rng.standard_normal((N, S, 5)))
    y = rng.integers(0, CLASSES, N)

    def model(p, x, eps):
        s1 = x @ p["w1"] + p["b1"] + eps.get("fc1", 0.0)  # shared over S positions
        h = jnp.tanh(s1).mean(axis=1)
        s2 = h @ p["w2"] + eps.get("fc2", 0.0)
        return s2, {"fc1": (x, s1), "fc2": (h, s2)}

    layers = {"fc1": {"kind": "dense", "bias": True}, "fc2": {"kind": "dense", "bias": False}}
    return model, params, x, y, layers


def _vectors(logits, y, mode, draws=None):
    p = jax.nn.softmax(logits, axis=1)
    eye = jnp.eye(CLASSES)
    if mode == "fisher_empirical":
        return [p - eye[y]]
    if mode == "fisher_sampled":
        return [(p - eye[d]) / np.sqrt(len(draws)) for d in draws]
    return [jnp.sqrt(p[:, k:k + 1]) * (eye[k] - p) for k in range(CLASSES)]


def _oracle(model, params, x, y, layers, mode, draws=None, *, chw=False, bias_first=False,
            mean_loss=False, tf_norm=False):
    """Hand-written JAX K-FAC (optionally with classic bugs) from per-example Jacobians."""
    out, taps = model(params, x, {})
    zeros = {n: jnp.zeros_like(taps[n][1]) for n in layers}
    jac = jax.jacrev(lambda e: model(params, x, e)[0])(zeros)  # name -> [N, C, *out shape]
    n = x.shape[0]
    vecs = _vectors(out, y, mode, draws)
    res = {}
    for name, spec in layers.items():
        a = taps[name][0]
        if spec["kind"] == "conv2d":
            def conv_of(k, a=a, spec=spec):
                return _conv(a, k, spec)
            kern = jnp.zeros((*spec["kernel"], a.shape[-1], 1))
            pj = jax.jacrev(conv_of)(kern)[..., 0, :, :, :, 0]  # [N, H', W', kh, kw, C]
            if chw:
                pj = jnp.moveaxis(pj, -1, 3)
            a = pj.reshape(n, -1, pj.shape[3] * pj.shape[4] * pj.shape[5])
        a = a.reshape(-1, a.shape[-1])
        t = a.shape[0] // n
        if spec["bias"]:
            one = jnp.ones((a.shape[0], 1))
            a = jnp.concatenate([one, a] if bias_first else [a, one], axis=1)
        g_sum = 0
        for v in vecs:
            g = jnp.einsum("nc,nc...->n...", v, jac[name])  # per-example vjp, by the Jacobian
            if mean_loss:
                g = g / n
            g = g.reshape(-1, g.shape[-1])
            g_sum = g_sum + g.T @ g
        res[name] = {"A": a.T @ a / a.shape[0], "G": g_sum / (n * t if tf_norm else n)}
    return res


@pytest.mark.parametrize("mode", ["fisher_exact", "fisher_empirical", "fisher_sampled"])
@pytest.mark.parametrize("make", [_cnn, _shared_mlp], ids=["cnn", "shared_mlp"])
def test_jax_reference_matches_the_oracle(make, mode):
    model, params, x, y, layers = make()
    kw, draws = {}, None
    if mode == "fisher_sampled":
        draws = sample_targets("cross_entropy", model(params, x, {})[0], 5, mc_samples=3)
        kw["samples"] = draws
    ref = reference_jax_kfac(model, params, x, y, layers, mode=mode, **kw)
    mine = _oracle(model, params, x, y, layers, mode, draws)
    for name in layers:
        np.testing.assert_allclose(ref[name]["A"], np.asarray(mine[name]["A"]), rtol=1e-12,
                                   atol=1e-14)
        np.testing.assert_allclose(ref[name]["G"], np.asarray(mine[name]["G"]), rtol=1e-11,
                                   atol=1e-15)
    res = check_jax_kfac(model, params, x, y, layers, mine, mode=mode, **kw)
    assert res.ok, str(res)
    if mode == "fisher_sampled":
        again = check_jax_kfac(model, params, x, y, layers, mine, mode=mode, rng=5,
                               mc_samples=3)
        assert again.ok, str(again)


def test_explicit_and_valid_padding():
    for pad in ("VALID", ((1, 0), (2, 1))):
        spec = dict(kernel=(2, 3), strides=(1, 2), padding=pad, dilation=(2, 1))
        model, params, x, y, layers = _cnn(spec)
        ref = reference_jax_kfac(model, params, x, y, layers)
        mine = _oracle(model, params, x, y, layers, "fisher_exact")
        np.testing.assert_allclose(ref["conv"]["A"], np.asarray(mine["conv"]["A"]),
                                   rtol=1e-12, atol=1e-14)


def test_wrong_jax_kfac_is_diagnosed_per_layer():
    model, params, x, y, layers = _cnn()
    wrong = _oracle(model, params, x, y, layers, "fisher_exact", chw=True, mean_loss=True)
    res = check_jax_kfac(model, params, x, y, layers, wrong)
    d = {(c.layer, c.factor): c.diagnosis for c in res.checks}
    assert d == {("conv", "A"): "patch_order", ("conv", "G"): "scale:1/N^2",
                 ("fc", "A"): "", ("fc", "G"): "scale:1/N^2"}, str(res)
    wrong = _oracle(model, params, x, y, layers, "fisher_exact", bias_first=True,
                    tf_norm=True)
    res = check_jax_kfac(model, params, x, y, layers, wrong)
    d = {(c.layer, c.factor): c.diagnosis for c in res.checks}
    assert d == {("conv", "A"): "bias_position", ("conv", "G"): "scale:1/T",
                 ("fc", "A"): "", ("fc", "G"): ""}, str(res)
    emp = _oracle(model, params, x, y, layers, "fisher_empirical")
    res = check_jax_kfac(model, params, x, y, layers, emp)
    assert {c.diagnosis for c in res.checks if c.factor == "G"} == {"empirical_fisher"}


def test_shared_dense_reduce_is_named():
    model, params, x, y, layers = _shared_mlp()
    mine = _oracle(model, params, x, y, layers, "fisher_exact")
    res = check_jax_kfac(model, params, x, y, layers, {"fc1": mine["fc1"]}, sharing="reduce")
    assert {c.diagnosis for c in res.checks} == {"expand_instead_of_reduce"}, str(res)


def test_jax_errors():
    model, params, x, y, layers = _cnn()
    with pytest.raises(ValueError, match=r"check_jax_kfac: layers\['conv'\] must be a dict "
                                         r"with 'kind' one of"):
        check_jax_kfac(model, params, x, y, {"conv": {"kind": "lstm"}}, {"conv": {}})
    with pytest.raises(ValueError,
                       match=r"layers\['conv'\]\['kernel'\] must be 2 positive ints"):
        check_jax_kfac(model, params, x, y, {"conv": {"kind": "conv2d", "bias": True}},
                       {"conv": {}})
    with pytest.raises(ValueError, match=r"taps must include every layer of layers; missing "
                                         r"fc3"):
        check_jax_kfac(model, params, x, y, {**layers, "fc3": {"kind": "dense",
                                                                "bias": False}}, {"fc": {}})
    with pytest.raises(ValueError, match=r"must return \(outputs, "):
        check_jax_kfac(lambda p, x, e: x, params, x, y, layers, {"fc": {}})
    with pytest.raises(ValueError, match=r"check_jax_kfac: mode must be one of"):
        check_jax_kfac(model, params, x, y, layers, {"fc": {}}, mode="kfac")
    with pytest.raises(ValueError, match=r"factors must name supported layers"):
        check_jax_kfac(model, params, x, y, layers, {"fc9": {}})


def test_float32_jax_model_gets_float32_tolerances():
    jax.config.update("jax_enable_x64", False)  # JAX's default; the fixture restores x64
    model, params, x, y, layers = _cnn()
    params = {k: v.astype(jnp.float32) for k, v in params.items()}
    x = x.astype(jnp.float32)
    mine = _oracle(model, params, x, y, layers, "fisher_exact")
    assert mine["conv"]["A"].dtype == jnp.float32
    res = check_jax_kfac(model, params, x, y, layers, mine)
    assert res.ok, str(res)
    assert all(1e-6 < c.rtol < 1e-3 for c in res.checks)
    bad = {"conv": {"G": mine["conv"]["G"] * 2}}
    res = check_jax_kfac(model, params, x, y, layers, bad)
    assert [c.diagnosis for c in res.checks] == ["scale:2"], str(res)
