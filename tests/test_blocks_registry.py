"""Block families plug in through ``from_layer`` and the layer-kind registry: a family
defined here (not in kfac_ref) is used by BlockDiagonalCurvature with no estimator change."""

from __future__ import annotations

import numpy as np
import pytest
from losses_helpers import ce

import kfac_ref.nn as nn
from kfac_ref import KFACTypeError, KFACValueError
from kfac_ref.blocks import kfac_jax as kj
from kfac_ref.curvature import BlockDiagonalCurvature


class MeanSquaredGradientIdentity(kj.CurvatureBlock):
    r"""Toy family: :math:`c\,I` with :math:`c = \frac1N\sum_n \|g_n\|^2` (trace of the
    K-FAC output factor)."""

    built_from_layers = []

    @classmethod
    def from_layer(cls, layer, input_shape, *, weight_sharing="expand", **kwargs):
        cls.built_from_layers.append((layer.kind, tuple(input_shape), weight_sharing))
        return super().from_layer(layer, input_shape, weight_sharing=weight_sharing, **kwargs)

    def _statistics_shapes(self):
        return ((),)

    def _batch_statistics(self, xp, data, batch_size):
        g = data["outputs_grad"]
        return (xp.asarray(xp.sum(g * g) / batch_size),)

    def _product(self, vector, c, lam, power, s):
        return tuple((s * c + lam) ** power * v for v in vector)

    def _multiply_fresh(self, xp, state, vector, lam, power, exact):
        return self._product(vector, state.statistics[0].value, lam, power,
                             self.scale(state, False))

    def _multiply_cached(self, xp, state, vector, lam, power, exact):
        return self._product(vector, self._cache_get(state, "c", "update_cache"), lam, power,
                             self._cache_get(state, "scale", "update_cache"))

    def _build_cache(self, xp, state, lam, exact, approx, eigenvalues):
        return {"c": state.statistics[0].value}

    def _eigenvalues(self, xp, state):
        return self.scale(state, False) * state.statistics[0].value * xp.ones(self.dim)

    def _dense_unscaled(self, xp, state):
        return state.statistics[0].value * xp.eye(self.dim)

    def _norm_unscaled(self, xp, state, norm_type):
        return xp.abs(state.statistics[0].value)


@pytest.fixture
def toy_registered():
    kj.register_layer_block("dense", "toy_msg", MeanSquaredGradientIdentity)
    MeanSquaredGradientIdentity.built_from_layers.clear()
    yield MeanSquaredGradientIdentity
    from kfac_ref.blocks.kfac_jax import _registry

    del _registry._REGISTRY["dense"]["toy_msg"]


def _net_and_batch(rng):
    net = nn.Sequential([("d1", nn.Dense(3, 4)), ("a", nn.Activation("tanh")),
                         ("d2", nn.Dense(4, 2))])
    params = net.init_params(rng, np.zeros(1))
    return net, params, (rng.standard_normal((6, 3)), rng.integers(0, 2, size=6))


def test_a_registered_toy_family_runs_through_the_estimator(toy_registered):
    rng = np.random.default_rng(0)
    net, params, batch = _net_and_batch(rng)
    toy = BlockDiagonalCurvature(net, ce, layer_to_block={"dense": "toy_msg"})
    kfac = BlockDiagonalCurvature(net, ce)
    states = []
    for est in (toy, kfac):
        st = est.init(None, (params, batch))
        states.append(est.update_curvature_matrix_estimate(st, 0.0, 1.0, 6, None,
                                                           (params, batch), "ggn_exact"))
    assert [type(b) for b in toy.blocks] == [MeanSquaredGradientIdentity] * 2
    assert toy_registered.built_from_layers == [("dense", (6, 3), "expand"),
                                                ("dense", (6, 4), "expand")]
    # c = tr(G) of the Kronecker block, both from the same back-propagated vectors
    for blk, st, kblk, kst in zip(toy.blocks, states[0].blocks_states, kfac.blocks,
                                  states[1].blocks_states, strict=True):
        g = kst.statistics[1].value
        dense = blk.to_dense_matrix(st)
        np.testing.assert_allclose(dense, np.trace(g) * np.eye(blk.dim), rtol=1e-13)
        assert kblk.dim == blk.dim
    v = np.ones(toy.dim)
    out = toy.multiply_matpower(states[0], v, 0.5, -1.0, True, False)
    c = np.array([np.trace(kst.statistics[1].value) for kst in states[1].blocks_states])
    np.testing.assert_allclose(out, np.repeat(1.0 / (c + 0.5), toy.block_dims), rtol=1e-13)


def test_registry_lookup_and_errors():
    assert kj.layer_block("dense") is kj.DenseTwoKroneckerFactored
    assert kj.layer_block("conv2d", "diagonal") is kj.Conv2DDiagonal
    assert kj.default_layer_to_block()["embedding"] is kj.NaiveDiagonal
    assert "naive_full" in kj.registered_layer_blocks()["scale_and_shift"]
    with pytest.raises(KFACValueError, match="approximation must be one registered"):
        kj.layer_block("dense", "nonexistent")
    with pytest.raises(KFACTypeError, match="block_class must be a CurvatureBlock subclass"):
        kj.register_layer_block("dense", "bad", dict)
    rng = np.random.default_rng(0)
    net, params, batch = _net_and_batch(rng)
    est = BlockDiagonalCurvature(net, ce, layer_to_block={"d1": "nonexistent"})
    with pytest.raises(KFACValueError, match="layer_to_block must give a block for layer 'd1'"):
        est.init(None, (params, batch))


def test_registered_names_select_the_same_blocks_as_classes():
    rng = np.random.default_rng(1)
    net, params, batch = _net_and_batch(rng)
    by_name = BlockDiagonalCurvature(net, ce, layer_to_block={"dense": "diagonal"})
    by_class = BlockDiagonalCurvature(net, ce, layer_to_block={"dense": kj.DenseDiagonal})
    mats = []
    for est in (by_name, by_class):
        st = est.init(None, (params, batch))
        st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, 6, None, (params, batch),
                                                  "ggn_exact")
        mats.append(est.to_dense_matrix(st))
    np.testing.assert_array_equal(mats[0], mats[1])


def test_from_layer_rejects_another_layer_kind():
    with pytest.raises(KFACValueError, match="DenseDiagonal.from_layer: layer must be a 'dense'"):
        kj.DenseDiagonal.from_layer(nn.Conv2D(1, 2, (2, 2)), (1, 3, 3, 1))


@pytest.mark.parametrize("ema", [(0.0, 1.0), (0.7, 0.3)])
def test_update_from_output_vectors_override_equals_the_per_vector_default(xp, rng, ema):
    """The Kronecker override (A once, G from the stacked vectors) equals the base class's
    C calls of update_curvature_matrix_estimate (ema_old first, weight ema_new/C)."""
    layer = nn.Dense(3, 4)
    block = kj.DenseTwoKroneckerFactored.from_layer(layer, (5, 3))
    x = xp.asarray(rng.standard_normal((5, 3)))
    gs = [xp.asarray(rng.standard_normal((5, 4))) for _ in range(3)]
    st = block.init(x)
    st = block.update_curvature_matrix_estimate(  # a non-trivial old state
        st, {"inputs": x, "outputs_grad": gs[0] * 2.0}, 0.0, 1.0, 5)
    got = block.update_from_output_vectors(st, layer, x, gs, 5, "expand", *ema)
    want = kj.CurvatureBlock.update_from_output_vectors(block, st, layer, x, gs, 5, "expand",
                                                        *ema)
    for s_got, s_want in zip(got.statistics, want.statistics, strict=True):
        xp.check(s_got.value)
        xp.assert_close(s_got.value, xp.to_numpy(s_want.value))


def test_update_from_output_vectors_errors(rng):
    layer = nn.Dense(3, 4)
    x = rng.standard_normal((5, 3))
    for block in (kj.DenseTwoKroneckerFactored.from_layer(layer, (5, 3)),
                  kj.DenseDiagonal.from_layer(layer, (5, 3))):
        with pytest.raises(KFACValueError, match="update_from_output_vectors: outputs_grads "
                           "must hold at least one back-propagated vector; got none"):
            block.update_from_output_vectors(block.init(x), layer, x, [], 5, "expand", 0.0, 1.0)
    naive = kj.NaiveDiagonal(layer.param_shapes())
    with pytest.raises(KFACValueError, match="reads per-example parameter gradients"):
        naive.update_from_output_vectors(naive.init(x), layer, x, [x], 5, "expand", 0.0, 1.0)
