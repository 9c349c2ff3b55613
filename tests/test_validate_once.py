"""Validate once: each array argument of a public factor, patch or nn call is scanned for
NaN/Inf exactly once (the scans are counted by wrapping kfac_ref._backend.all_finite)."""

import collections
import pathlib
import re

import numpy as np
import pytest

import kfac_ref._backend as B
from kfac_ref import KFACTypeError, factors, nn


@pytest.fixture
def scans(monkeypatch):
    """Counter of finiteness scans by array identity."""
    seen = []
    real = B.all_finite
    monkeypatch.setattr(B, "all_finite", lambda ns, x: seen.append(id(x)) or real(ns, x))

    def count(**named):
        c = collections.Counter(seen)
        seen.clear()
        return {name: c.get(id(a), 0) for name, a in named.items()}, len(c)

    return count


def test_conv_input_kronecker_factor_scans_inputs_once(xp, rng, scans):
    x = xp.asarray(rng.standard_normal((2, 5, 5, 3)))
    factors.conv_input_kronecker_factor(x, (3, 3, 3, 4), "SAME", 2, has_bias=True)
    assert scans(inputs=x) == ({"inputs": 1}, 1)


def test_conv_diagonal_factor_scans_each_input_once(xp, rng, scans):
    x = xp.asarray(rng.standard_normal((2, 5, 5, 3)))
    g = xp.asarray(rng.standard_normal((2, 3, 3, 4)))
    mask = xp.asarray(np.ones((3, 3, 3)))
    factors.conv_diagonal_factor(x, g, (3, 3, 3, 4), 1, "VALID", has_bias=True,
                                 patch_mask=mask)
    assert scans(inputs=x, outputs_grad=g, patch_mask=mask) == (
        {"inputs": 1, "outputs_grad": 1, "patch_mask": 1}, 3)
    factors.conv_per_example_gradients(x, g, (3, 3, 3, 4), 1, "VALID")
    assert scans(inputs=x, outputs_grad=g) == ({"inputs": 1, "outputs_grad": 1}, 2)


def test_fully_connected_kronecker_factor_scans_once(xp, rng, scans):
    a = xp.asarray(rng.standard_normal((6, 4)))
    factors.fully_connected_kronecker_factor(a, True)
    assert scans(tensor=a) == ({"tensor": 1}, 1)


def test_factor_classes_scan_each_tower_once(xp, rng, scans):
    x = xp.asarray(rng.standard_normal((2, 5, 5, 3)))
    g1 = xp.asarray(rng.standard_normal((2, 5, 5, 4)))
    g2 = xp.asarray(rng.standard_normal((2, 5, 5, 4)))
    factors.ConvDiagonalFactor((3, 3, 3, 4), 1, "SAME").update_cov(x, [[g1], [g2]],
                                                                    ema_decay=0.9)
    counts, _ = scans(inputs=x, g1=g1, g2=g2)
    assert counts == {"inputs": 1, "g1": 1, "g2": 1}
    factors.ConvInputKroneckerFactor((3, 3, 3, 4), "SAME").update_cov(x, ema_decay=0.9)
    assert scans(inputs=x)[0] == {"inputs": 1}
    a = xp.asarray(rng.standard_normal((6, 4)))
    factors.FullyConnectedMultiKF(2, True).register_cov_dt1().update_cov(a, ema_decay=0.9)
    assert scans(tensors=a)[0] == {"tensors": 1}


def test_conv2d_network_forward_and_backward_scan_each_input_once(xp, rng, scans):
    net = nn.Sequential([("conv", nn.Conv2D(3, 4, 3, padding="SAME"))])
    x = xp.asarray(rng.standard_normal((2, 5, 5, 3)))
    params = net.init_params(np.random.default_rng(1), x)
    scans()
    net.forward(params, x)
    w, b = params[0]
    assert scans(x=x, w=w, b=b) == ({"x": 1, "w": 1, "b": 1}, 3)
    g = xp.asarray(rng.standard_normal((2, 5, 5, 4)))
    net.vjp(params, x, g, per_example=True)
    assert scans(x=x, g_out=g, w=w, b=b) == ({"x": 1, "g_out": 1, "w": 1, "b": 1}, 4)


@pytest.mark.parametrize("make", [
    lambda v: nn.Dense(2, 3, use_bias=v),
    lambda v: nn.Conv2D(2, 3, 1, use_bias=v),
    lambda v: nn.ScaleAndShift(2, has_scale=v),
    lambda v: nn.ScaleAndShift(2, has_shift=v),
])
@pytest.mark.parametrize("bad", ["no", None, 1])
def test_nn_flags_are_strict_bools(make, bad):
    with pytest.raises(KFACTypeError, match="must be a bool"):
        make(bad)


OWNED = ["patches.py", "conv_geometry.py", "factors", "nn"]


def test_no_cross_module_private_imports():
    root = pathlib.Path(__file__).resolve().parents[1] / "kfac_ref"
    files = [p for o in OWNED for p in ((root / o).rglob("*.py") if (root / o).is_dir()
                                        else [root / o])]
    bad = []
    for path in files:
        text = path.read_text()
        for m in re.finditer(r"^from \.[\w.]* import \(?([^)]*?)\)?$", text, re.M | re.S):
            names = re.findall(r"\b(\w+)\b", m.group(1))
            bad += [f"{path.name}: {n}" for n in names if n.startswith("_") and
                    n != "__future__"]
        bad += [f"{path.name}: {m}" for m in re.findall(r"\b[a-z_]+\._[a-z]\w*\(", text)
                if not m.startswith(("self._", "cls._", "xp._", "new._"))]
    assert bad == []


def test_conv_factors_run_under_jax_jit():
    """Static checks only under tracing: no value check reads a traced array."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((2, 5, 5, 3)), dtype=jnp.float32)
    g = jnp.asarray(r.standard_normal((2, 5, 5, 4)), dtype=jnp.float32)
    omega = jax.jit(lambda x: factors.conv_input_kronecker_factor(
        x, (3, 3, 3, 4), "SAME", has_bias=True))(x)
    np.testing.assert_allclose(np.asarray(omega), np.asarray(
        factors.conv_input_kronecker_factor(x, (3, 3, 3, 4), "SAME", has_bias=True)),
        rtol=1e-5, atol=1e-6)
    diag = jax.jit(lambda x, g: factors.conv_diagonal_factor(x, g, (3, 3, 3, 4), 1, "SAME"))
    np.testing.assert_allclose(np.asarray(diag(x, g)), np.asarray(
        factors.conv_diagonal_factor(x, g, (3, 3, 3, 4), 1, "SAME")), rtol=1e-5, atol=1e-6)
    ids = jnp.asarray(np.array([0, 2, 2]), dtype=jnp.int32)
    counts = jax.jit(lambda i: factors.embedding_input_kronecker_factor(i, 3))(ids)
    np.testing.assert_allclose(np.asarray(counts), [1 / 3, 0.0, 2 / 3], rtol=1e-6)
