"""The JAX own-model route's layer kinds against independent oracles: an embedding, a layer
norm's scale-and-shift, a dense layer used twice (tied weights), Conv1d and a grouped
convolution.  Oracles: direct jax.grad of the per-example loss with respect to a layer's
output or parameters (no perturbation taps), token counts by bincount, the untied model, a
one-row Conv2d, convolutions on channel slices."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from conformance.own_model import check_jax_kfac, reference_jax_kfac  # noqa: E402

N, S, V, D, C = 4, 3, 7, 4, 3


pytestmark = pytest.mark.usefixtures("jax_x64")  # float64 for every test


def _token_model():
    rng = np.random.default_rng(0)
    p = {"emb": rng.standard_normal((V, D)), "gamma": 1 + 0.1 * rng.standard_normal(D),
         "beta": 0.1 * rng.standard_normal(D), "w": rng.standard_normal((D, D)) * 0.5,
         "head": rng.standard_normal((D, C)) * 0.5}
    p = {k: jnp.asarray(v) for k, v in p.items()}
    ids = jnp.asarray(rng.integers(0, V, (N, S)))
    y = rng.integers(0, C, N)

    def body(p, e, eps):
        mu = e.mean(-1, keepdims=True)
        xhat = (e - mu) / jnp.sqrt(((e - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
        z = p["gamma"] * xhat + p["beta"] + eps.get("norm", 0.0)
        tied = eps.get("tied", [0.0, 0.0])
        h1 = z @ p["w"] + tied[0]                  # the tied layer, first use
        h2 = jnp.tanh(h1) @ p["w"] + tied[1]       # and second use
        out = h2.mean(1) @ p["head"] + eps.get("head", 0.0)
        taps = {"norm": (xhat, z), "tied": [(z, h1), (jnp.tanh(h1), h2)],
                "head": (h2.mean(1), out)}
        return out, taps

    def model(p, ids, eps):
        e = p["emb"][ids] + eps.get("emb", 0.0)
        out, taps = body(p, e, eps)
        return out, {**taps, "emb": (ids, e)}

    layers = {"emb": {"kind": "embedding", "vocab": V},
              "norm": {"kind": "scale_shift", "bias": True},
              "tied": {"kind": "dense", "bias": False},
              "head": {"kind": "dense", "bias": False}}
    return model, body, p, ids, y, layers


def _nll(out, y):
    return -jax.nn.log_softmax(out)[jnp.arange(len(y)), y]


def test_embedding_counts_and_G_from_direct_gradients():
    model, body, p, ids, y, layers = _token_model()
    ref = reference_jax_kfac(model, p, ids, y, layers, mode="fisher_empirical")["emb"]
    counts = np.bincount(np.asarray(ids).ravel(), minlength=V)
    np.testing.assert_array_equal(np.diag(ref["A"]), counts / (N * S))
    assert ref["A_diagonal"] and ref["T"] == S
    e = p["emb"][ids]
    g = jax.grad(lambda e: _nll(body(p, e, {})[0], y).sum())(e)  # [N, S, D], per example
    g = np.asarray(g).reshape(-1, D)
    np.testing.assert_allclose(ref["G"], g.T @ g / N, rtol=1e-12, atol=1e-15)


def test_scale_shift_F_is_the_per_example_second_moment():
    model, _, p, ids, y, layers = _token_model()
    ref = reference_jax_kfac(model, p, ids, y, layers, mode="fisher_empirical")["norm"]

    def loss_n(gb, i, n):
        q = {**p, "gamma": gb[:D], "beta": gb[D:]}
        return _nll(model(q, ids[n:n + 1], {})[0], y[n:n + 1]).sum()

    gb = jnp.concatenate([p["gamma"], p["beta"]])
    u = np.stack([np.asarray(jax.grad(loss_n)(gb, None, n)) for n in range(N)])
    np.testing.assert_allclose(ref["F"], u.T @ u / N, rtol=1e-11, atol=1e-15)
    np.testing.assert_allclose(ref["diag"], np.diag(u.T @ u / N), rtol=1e-11, atol=1e-15)


def test_tied_weights_are_the_untied_uses_pooled():
    """KFAC-expand over the uses: A the mean of the uses' A, G the sum of their G."""
    model, _, p, ids, y, layers = _token_model()
    tied = reference_jax_kfac(model, p, ids, y, layers)["tied"]

    def untied(p, ids, eps):
        out, taps = model(p, ids, {**eps, "tied": [eps.get("u1", 0.0), eps.get("u2", 0.0)]})
        first, second = taps.pop("tied")
        return out, {**taps, "u1": first, "u2": second}

    lay = {k: v for k, v in layers.items() if k != "tied"}
    lay |= {"u1": layers["tied"], "u2": layers["tied"]}
    ref = reference_jax_kfac(untied, p, ids, y, lay)
    assert tied["uses"] == 2 and tied["T"] == S
    np.testing.assert_allclose(tied["A"], (ref["u1"]["A"] + ref["u2"]["A"]) / 2, rtol=1e-12)
    np.testing.assert_allclose(tied["G"], ref["u1"]["G"] + ref["u2"]["G"], rtol=1e-12)


def test_check_passes_the_oracle_factors_and_names_a_missing_use():
    model, body, p, ids, y, layers = _token_model()
    ref = reference_jax_kfac(model, p, ids, y, layers, mode="fisher_empirical")
    mine = {"emb": {"A": np.diag(ref["emb"]["A"]), "G": ref["emb"]["G"]},  # A as a vector
            "norm": {"F": ref["norm"]["F"]},
            "tied": {"A": ref["tied"]["A"], "G": ref["tied"]["G"]},
            "head": {"A": ref["head"]["A"], "G": ref["head"]["G"]}}
    res = check_jax_kfac(model, p, ids, y, layers, mine, mode="fisher_empirical")
    assert res.ok, str(res)
    half = dict(mine, tied={"A": ref["tied"]["A"], "G": ref["tied"]["G"] / 2})
    res = check_jax_kfac(model, p, ids, y, layers, half, mode="fisher_empirical")
    assert {c.layer for c in res.checks if not c.ok} == {"tied"}, str(res)


def _conv_nd(x, w, groups=1):
    nd = x.ndim - 2
    dims = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC")}[nd]
    return jax.lax.conv_general_dilated(x, w, (1,) * nd, "VALID", dimension_numbers=dims,
                                        feature_group_count=groups)


def _conv_model(nd, c_in, c_out, groups, kernel, spatial):
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.standard_normal((*kernel, c_in // groups, c_out)) * 0.5)
    x = jnp.asarray(rng.standard_normal((N, *spatial, c_in)))
    d = int(np.prod(_conv_nd(x[:1], k, groups).shape))
    w = jnp.asarray(rng.standard_normal((d, C)) * 0.3)
    y = rng.integers(0, C, N)

    def model(p, x, eps):
        s1 = _conv_nd(x, p["k"], groups) + eps.get("conv", 0.0)
        h = jnp.tanh(s1).reshape(len(x), -1)
        return h @ p["w"], {"conv": (x, s1), "fc": (h, h @ p["w"])}

    spec = {"kind": f"conv{nd}d", "kernel": kernel, "padding": "VALID", "bias": False,
            "groups": groups}
    return model, {"k": k, "w": w}, x, y, {"conv": spec, "fc": {"kind": "dense",
                                                               "bias": False}}


def test_conv1d_is_the_one_row_conv2d():
    model, p, x, y, layers = _conv_model(1, 2, 3, 1, (3,), (6,))
    one_d = reference_jax_kfac(model, p, x, y, layers)["conv"]

    def model2(q, x2, eps):
        s1 = _conv_nd(x2, q["k"][None]) + eps.get("conv", 0.0)
        h = jnp.tanh(s1).reshape(len(x2), -1)
        return h @ q["w"], {"conv": (x2, s1), "fc": (h, h @ q["w"])}

    lay2 = {"conv": {"kind": "conv2d", "kernel": (1, 3), "padding": "VALID", "bias": False},
            "fc": layers["fc"]}
    two_d = reference_jax_kfac(model2, p, x[:, None], y, lay2)["conv"]
    np.testing.assert_allclose(one_d["A"], two_d["A"], rtol=1e-12)
    np.testing.assert_allclose(one_d["G"], two_d["G"], rtol=1e-12)
    assert one_d["T"] == two_d["T"] == 4


def test_grouped_conv_is_the_convolutions_of_its_channel_slices():
    groups, c_in, c_out = 2, 4, 6
    model, p, x, y, layers = _conv_model(2, c_in, c_out, groups, (2, 2), (4, 3))
    ref = reference_jax_kfac(model, p, x, y, layers)["conv"]
    assert ref["A"].shape == (2, 8, 8) and ref["G"].shape == (2, 3, 3)
    _, taps = model(p, x, {})
    out0 = taps["conv"][1]
    for j in range(groups):
        xs = x[..., j * 2:(j + 1) * 2]
        kj = p["k"][..., j * 3:(j + 1) * 3]
        # the slice's convolution reproduces the grouped one's output channels ...
        np.testing.assert_allclose(_conv_nd(xs, kj), out0[..., j * 3:(j + 1) * 3],
                                   rtol=1e-12)
        # ... and its A is the patches of the slice (explicit loops over locations)
        rows = np.stack([np.asarray(xs[:, i:i + 2, k:k + 2, :]).reshape(N, -1)
                         for i in range(3) for k in range(2)], 1).reshape(-1, 8)
        np.testing.assert_allclose(ref["A"][j], rows.T @ rows / len(rows), rtol=1e-12)
