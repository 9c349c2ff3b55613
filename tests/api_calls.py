"""A corpus of valid calls of kfac_ref's public API, shared by the Dask tests and the
argument fuzzer (``tools/fuzz_api.py``).

``CALLS`` maps a public object, by its name in :mod:`kfac_ref.capabilities`, to a call
written as ``lambda f: ...``: every array of the call is made by ``f`` from host NumPy data
(``numpy.asarray`` for the eager reference, a Dask chunker in ``tests/test_dask.py``, a
corrupting wrapper in the fuzzer).  ``DASK_CALLS`` is the part that runs on Dask arrays;
``NUMPY_CALLS`` adds the public objects declared "no" on Dask (they need an
eigendecomposition) that run on NumPy.
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace

import kfac_ref as K
import kfac_ref.curvature as curv
import kfac_ref.nn as knn
from kfac_ref import (
    averaging,
    blocks,
    conv_geometry,
    factors,
    laplace,
    losses,
    optim,
    patches,
    spectral,
)
from kfac_ref.blocks import kfac_jax as kj
from kfac_ref.conv_geometry import ConvGeometry
from kfac_ref.operators import CurvatureOperator


def _xp_of(x):
    """The namespace a caller passes with ``x`` to the functions that take one (NumPy's for
    data that is not an array, so that the callee, not the caller, meets it)."""
    return array_namespace(x if hasattr(x, "shape") else np.zeros(0))


def _closed(f, host):
    """An array closed over by a user callable (the matrix of a matvec), not an argument of
    the call: made by ``f`` like the arguments, except that a fuzzer's ``f`` may offer a
    ``closed`` maker that leaves it as it is."""
    return getattr(f, "closed", f)(host)


def _flat(result):
    """The leaves of a nested list/tuple result."""
    if isinstance(result, (tuple, list)):
        return [leaf for part in result for leaf in _flat(part)]
    return [result]


_W = np.random.default_rng(20261206)


def _spd(n, rng=_W):
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    m = (q * rng.uniform(0.5, 2.0, n)) @ q.T
    return (m + m.T) / 2.0


_A, _B, _C = _spd(4), _spd(3), _spd(3) * 0.1
_X = _W.standard_normal((10, 4))
_G = _W.standard_normal((10, 3))
_V = _W.standard_normal(12)
_V2 = _W.standard_normal((12, 2))
_IMG = _W.standard_normal((4, 5, 5, 2))
_IMG_G = _W.standard_normal((4, 5, 5, 3))
_SEQ = _W.standard_normal((6, 4, 3))
_IDS = _W.integers(0, 6, size=(10,))
_MU = _W.standard_normal(3)
_S_A, _Q_A = np.linalg.eigh(_A)
_S_B, _Q_B = np.linalg.eigh(_B)
_SKETCH = _W.standard_normal((4, 2))
_PROBES = _W.standard_normal((4, 6))

# The public objects that run on Dask arrays, each with a call: ``f`` turns host data into
# the arrays of the call (NumPy for the reference, Dask for the lazy run).
DASK_CALLS = {
    "kfac_ref.linalg.append_homog": lambda f: K.append_homog(f(_X)),
    "kfac_ref.linalg.damped_inverse": lambda f: K.damped_inverse(f(_A), 0.1),
    "kfac_ref.linalg.damped_cholesky": lambda f: K.damped_cholesky(f(_A), 0.1),
    "kfac_ref.linalg.damped_cholesky_inverse": lambda f: K.damped_cholesky_inverse(f(_A), 0.1),
    "kfac_ref.linalg.factor_norm": lambda f: [K.factor_norm(f(_A), n)
                                              for n in ("avg_diag", "avg_fro", "1_norm")],
    "kfac_ref.linalg.pi_tracenorm": lambda f: K.pi_tracenorm(f(_A), f(_B)),
    "kfac_ref.linalg.pi_adjusted_damping": lambda f: K.pi_adjusted_damping(f(_A), f(_B), 0.1),
    "kfac_ref.linalg.kron": lambda f: K.kron(f(_A), f(_B)),
    "kfac_ref.linalg.kron_matvec": lambda f: K.kron_matvec(f(_A), f(_B), f(_V)),
    "kfac_ref.linalg.kron_matmat": lambda f: K.kron_matmat(f(_A), f(_B), f(_V2)),
    "kfac_ref.linalg.kron_eigenbasis_matpower": lambda f: K.kron_eigenbasis_matpower(
        f(_S_A), f(_Q_A), f(_S_B), f(_Q_B), f(_V.reshape(4, 3)), -1.0, 0.1),
    "kfac_ref.spectral.kron_trace": lambda f: [
        spectral.kron_trace(f(_A), f(_B), 0.1, exact=e) for e in (True, False)],
    "kfac_ref.spectral.hutchinson_trace": lambda f: (lambda m: spectral.hutchinson_trace(
        lambda v: m @ v, f(_PROBES)))(_closed(f, _A)),
    "kfac_ref.spectral.hutchpp_trace": lambda f: (lambda m: spectral.hutchpp_trace(
        lambda v: m @ v, f(_SKETCH), f(_PROBES)))(_closed(f, _A)),
    "kfac_ref.factors.fully_connected_diagonal_factor": lambda f:
        factors.fully_connected_diagonal_factor(f(_X), f(_G), has_bias=True),
    "kfac_ref.factors.conv_patch_matrix": lambda f: factors.conv_patch_matrix(
        f(_IMG), (3, 3, 2, 3), "SAME"),
    "kfac_ref.factors.conv_per_example_gradients": lambda f:
        factors.conv_per_example_gradients(f(_IMG), f(_IMG_G), (3, 3, 2, 3), (1, 1), "SAME"),
    "kfac_ref.factors.conv_diagonal_factor": lambda f: factors.conv_diagonal_factor(
        f(_IMG), f(_IMG_G), (3, 3, 2, 3), (1, 1), "SAME"),
    "kfac_ref.factors.conv_input_sua_statistics": lambda f:
        factors.conv_input_sua_statistics(f(_IMG)),
    "kfac_ref.factors.conv_input_sua_factor": lambda f: factors.conv_input_sua_factor(
        f(_B), f(_MU), 4, True, 0.1),
    "kfac_ref.factors.conv_input_sua_inverse": lambda f:
        factors.conv_input_sua_inverse(f(_B), f(_MU), 4, True, 0.1),
    "kfac_ref.factors.params_grads_to_vector": lambda f:
        factors.params_grads_to_vector([f(_X), f(_G)]),
    "kfac_ref.factors.naive_diagonal_factor": lambda f:
        factors.naive_diagonal_factor([f(_X), f(_G)], 10),
    "kfac_ref.factors.full_factor": lambda f: factors.full_factor([f(_X), f(_G)], 10),
    "kfac_ref.factors.embedding_input_kronecker_factor": lambda f:
        factors.embedding_input_kronecker_factor(f(_IDS), 6),
    "kfac_ref.factors.diagonal_kronecker_factor": lambda f:
        factors.diagonal_kronecker_factor(f(_X), has_bias=True),
    "kfac_ref.factors.scale_and_shift_factor": lambda f:
        factors.scale_and_shift_factor(f(_SEQ), f(_SEQ), (1,), (1,)),
    "kfac_ref.factors.conv_input_factor_tap": lambda f: factors.conv_input_factor_tap(
        ConvGeometry.build("t", _IMG.shape, (3, 3, 2, 3), padding="SAME"), True)(
        f(factors.conv_patch_matrix(_IMG, (3, 3, 2, 3), "SAME"))),
    "kfac_ref.factors.fully_connected_multi_kf_cov_dt1": lambda f:
        factors.fully_connected_multi_kf_cov_dt1(f(_X), 2, has_bias=True),
}

_V32 = _W.standard_normal((4, 3))
_DIAG = _W.uniform(1.0, 2.0, 12)
_EV_A, _EV_B = np.linalg.eigvalsh(_A) * 0.5, np.linalg.eigvalsh(_B) * 0.5
_BLOCK_CALLS = {
    "kfac_ref.averaging.MovingAverageVariable": lambda f: [
        averaging.MovingAverageVariable.zeros_like(f(_A)).update(f(_A), 0.9).value,
        averaging.MovingAverageVariable(f(_A), 1.0).update(f(_A * 2.0), 0.9, 0.5).value],
    "kfac_ref.averaging.WeightedMovingAverage": lambda f:
        averaging.WeightedMovingAverage(f(_A)).update(f(_A * 2.0), 0.9, 1.0).value,
    "kfac_ref.averaging.sync_statistics": lambda f: averaging.sync_statistics(
        [f(_A), f(_A * 2.0)]),
    "kfac_ref.averaging.weighted_accumulate": lambda f: averaging.weighted_accumulate(
        f(_A), f(_A * 2.0), 0.3, 0.7),
    "kfac_ref.patches.extract_convolution_patches": lambda f:
        patches.extract_convolution_patches(f(_IMG), (3, 3, 2, 3), "SAME"),
    "kfac_ref.patches.extract_image_patches": lambda f: patches.extract_image_patches(
        f(_IMG), (1, 3, 3, 1), (1, 1, 1, 1), (1, 1, 1, 1), "SAME"),
    "kfac_ref.patches.extract_pointwise_conv2d_patches": lambda f:
        patches.extract_pointwise_conv2d_patches(f(_IMG), (1, 1, 2, 3)),
    "kfac_ref.patches.subsample_rows": lambda f: patches.subsample_rows(
        f(_X), 4, np.random.default_rng(1)),
    "kfac_ref.conv_geometry.to_channels_last": lambda f: (
        lambda x: conv_geometry.to_channels_last(_xp_of(x), x, False))(f(_IMG)),
    "kfac_ref.conv_geometry.from_channels_last": lambda f: (
        lambda x: conv_geometry.from_channels_last(_xp_of(x), x, False))(f(_IMG)),
    "kfac_ref.conv_geometry.ConvGeometry": lambda f: [
        (lambda x: ConvGeometry.build("t", (4, 2, 5, 5), (3, 3, 2, 3), padding="SAME",
                                      data_format="NCHW").to_channels_last(
            _xp_of(x), x))(f(_IMG.transpose(0, 3, 1, 2)))],
    "kfac_ref.blocks.diagonal_block_matpower": lambda f: blocks.diagonal_block_matpower(
        f(_DIAG), f(_V), -0.5, 0.1),
    "kfac_ref.blocks.scaled_identity_matpower": lambda f: blocks.scaled_identity_matpower(
        f(_V), -0.5, 0.1, scale=2.0),
    "kfac_ref.blocks.kronecker_block_matpower": lambda f: [
        blocks.kronecker_block_matpower(f(_A), f(_B), f(_V32), p, 0.1) for p in (1.0, -1.0)],
    "kfac_ref.blocks.series_gamma": lambda f: blocks.series_gamma(f(np.array([0.3, 0.5])), 3),
    "kfac_ref.blocks.series_option1_multiply_inverse": lambda f:
        blocks.series_option1_multiply_inverse(f(_Q_A), f(_EV_A), f(_Q_B), f(_EV_B), 3,
                                               f(_V32)),
    "kfac_ref.blocks.series_option2_multiply_inverse": lambda f:
        blocks.series_option2_multiply_inverse(f(_A * 0.1), f(_Q_A), f(_EV_A), f(_B * 0.1),
                                               f(_Q_B), f(_EV_B), 3, f(_V32)),
}
DASK_CALLS.update(_BLOCK_CALLS)
_LABELS = np.eye(3)[_W.integers(0, 3, 10)]
_VAR = _W.uniform(0.5, 1.5, (10, 3))


def _loss_quantities(loss):
    """What a K-FAC step reads from a loss: value, gradient, the Fisher and its factor
    applied to the replicated one-hot vectors, and a sample."""
    return [loss.evaluate(), loss.grad_of_evaluate(), loss.fisher_matrix(),
            [loss.multiply_fisher_factor_replicated_one_hot([k])
             for k in range(loss.fisher_factor_inner_shape[-1])],
            loss.sample(np.random.default_rng(3))]


DASK_CALLS.update({
    "kfac_ref.losses.OneHotCategoricalLogitsNegativeLogProbLoss": lambda f: _loss_quantities(
        losses.OneHotCategoricalLogitsNegativeLogProbLoss(f(_G), f(_LABELS))),
    "kfac_ref.losses.NormalMeanVarianceNegativeLogProbLoss": lambda f: _loss_quantities(
        losses.NormalMeanVarianceNegativeLogProbLoss(f(_G), f(_VAR), f(_G[::-1]))),
})


def _huber_parts():
    """A Huber loss (δ = 0.5) by its value, gradient and Hessian square root."""
    def value(f, y):
        xp, r = array_namespace(f), f - y
        a = xp.abs(r)
        return xp.sum(xp.where(a <= 0.5, 0.5 * r * r, 0.5 * (a - 0.25)), axis=-1)

    def gradient(f, y):
        return array_namespace(f).clip(f - y, min=-0.5, max=0.5)

    def hessian_sqrt(f, y):
        xp = array_namespace(f)
        inside = xp.astype(xp.abs(f - y) <= 0.5, f.dtype)
        return inside[:, :, None] * xp.eye(f.shape[1], dtype=f.dtype)[None, :, :]

    return {"value": value, "gradient": gradient, "hessian_sqrt": hessian_sqrt}


def _custom_nll(f, y):
    """The unit-variance normal negative log-likelihood as a CustomNegativeLogProbLoss."""
    return losses.CustomNegativeLogProbLoss(
        f, y, value=lambda o, t: array_namespace(o).sum((o - t) ** 2, axis=-1) / 2.0,
        gradient=lambda o, t: o - t,
        hessian_sqrt=lambda o, t: array_namespace(o).ones(
            (o.shape[0], 1, 1), dtype=o.dtype) * array_namespace(o).eye(o.shape[1],
                                                                       dtype=o.dtype),
        sample=lambda o, rng: o + array_namespace(o).asarray(
            rng.standard_normal(tuple(o.shape)), dtype=o.dtype))


DASK_CALLS.update({
    "kfac_ref.losses.CustomLoss": lambda f: (lambda loss: [
        loss.evaluate(), loss.grad_of_evaluate(), loss.ggn_matrix(),
        [loss.multiply_ggn_factor_replicated_one_hot([k]) for k in range(3)]])(
        losses.CustomLoss(f(_G), f(_G[::-1] * 0.3), **_huber_parts())),
    "kfac_ref.losses.CustomNegativeLogProbLoss": lambda f: _loss_quantities(
        _custom_nll(f(_G), f(_G[::-1]))),
})
DASK_CALLS.update({
    "kfac_ref.blocks.kfac_jax.nearest_kronecker_factors": lambda f:
        kj.nearest_kronecker_factors(f(_X), f(_G)),
    "kfac_ref.blocks.kfac_jax.tnt_scale": lambda f: kj.tnt_scale(f(_A), f(_B)),
    "kfac_ref.blocks.tf.compute_pi_tracenorm": lambda f: blocks.tf.compute_pi_tracenorm(
        f(_A), f(_B)),
    "kfac_ref.blocks.tf.compute_pi_adjusted_damping": lambda f:
        blocks.tf.compute_pi_adjusted_damping(f(_A), f(_B), 0.5),
})

# a host-side answer from the array's metadata (a Python int), compared as such
DASK_CALLS["kfac_ref.patches.temporary_bytes_bound"] = lambda f: patches.temporary_bytes_bound(
    f(_IMG))
# --------------------------------------------------------------------------------------
# Networks, exact curvature, estimators, the optimiser, the Laplace evidence and operators
# on Dask arrays: parameters and a batch chunked along its first axis
# --------------------------------------------------------------------------------------
_N = np.random.default_rng(20261207)


def _gauss(f, y):
    return losses.NormalMeanNegativeLogProbLoss(f, y, variance=0.5)


def _ce(f, y):
    return losses.CategoricalLogitsNegativeLogProbLoss(f, targets=y)


_NET = knn.Sequential([("d1", knn.Dense(3, 4)), ("a1", knn.Activation("tanh")),
                       ("d2", knn.Dense(4, 2))])
_NX, _NY = _N.standard_normal((8, 3)), _N.standard_normal((8, 2))
_NP = _NET.init_params(_N, np.zeros(1))
_NV = _N.standard_normal(_NET.num_params)
_CONV = knn.Sequential([("c", knn.Conv2D(2, 2, (2, 2), padding="SAME")),
                        ("p", knn.MeanPool()), ("d", knn.Dense(2, 3))])
_CX, _CY = _N.standard_normal((4, 3, 3, 2)), _N.integers(0, 3, 4)
_CP = _CONV.init_params(_N, np.zeros(1))
_CV = _N.standard_normal(_CONV.num_params)


def _params(f, params=_NP):
    return tuple(tuple(f(a) for a in layer) for layer in params)


def _problem(f):
    """(net, loss, params, batch) of the MLP under a Gaussian loss."""
    return _NET, _gauss, _params(f), (f(_NX), f(_NY))


def _estimator(f, cls=curv.BlockDiagonalCurvature, mode="ggn_exact", **init_kw):
    """An estimator of the MLP after two curvature updates (EMA 0.5) in ``mode``."""
    est = cls(_NET, _gauss, default_estimation_mode=mode)
    fa = (_params(f), (f(_NX), f(_NY)))
    st = est.init(None, fa, **init_kw)
    for _ in range(2):
        st = est.update_curvature_matrix_estimate(st, 0.5, 1.0, 8, np.random.default_rng(3),
                                                  fa)
    return est, st


def _estimator_products(f, cls=curv.BlockDiagonalCurvature, mode="ggn_exact"):
    kfac = cls is curv.BlockDiagonalCurvature
    est, st = _estimator(f, cls, mode, **({"approx_powers_to_cache": -1.0} if kfac else {}))
    out = [est.to_dense_matrix(st), est.to_diagonal_block_dense_matrix(st),
           est.multiply_matpower(st, f(_NV), 0.1, 1.0, False, False),
           est.multiply_matpower(st, _NET.unflatten(f(_NV)), 0.1, 1.0, True, False)]
    if kfac:  # the factored (Cholesky) inverse, fresh and cached
        out.append(est.multiply_matpower(st, f(_NV), 0.1, -1.0, False, False))
        cached = est.update_cache(st, 0.1, None, -1.0, False)
        out.append(est.multiply_matpower(cached, f(_NV), 0.1, -1.0, False, True))
        out.append(est.to_dense_matrix(est.sync(st, batch_sizes=[8])))
    return out


def _implicit(f):
    est = curv.ImplicitExactCurvature(_NET, _gauss)
    fa = (_params(f), (f(_NX), f(_NY)))
    v = _NET.unflatten(f(_NV))
    return [est.multiply_ggn(fa, v), est.multiply_fisher(fa, v), est.multiply_hessian(fa, v),
            est.multiply_fisher_factor_transpose(fa, v), est.multiply_ggn_factor_transpose(fa, v),
            est.multiply_fisher_factor(fa, f(_NY)), est.multiply_ggn_factor(fa, f(_NY)),
            est.multiply_jacobian(fa, v), est.multiply_jacobian_transpose(fa, ((f(_NY),),))]


def _reduced_conv(f):
    """KFAC-reduce of a convolution (ReducedConv2DTwoKroneckerFactored) in an estimator."""
    est = curv.BlockDiagonalCurvature(_CONV, _ce, weight_sharing="reduce")
    fa = (_params(f, _CP), (f(_CX), f(_CY)))
    st = est.update_curvature_matrix_estimate(est.init(None, fa), 0.0, 1.0, 4, None, fa,
                                              "ggn_exact")
    assert type(est.blocks[0]).__name__ == "ReducedConv2DTwoKroneckerFactored"
    return [est.to_dense_matrix(st), est.multiply_matpower(st, f(_CV), 0.1, -1.0, False, False)]


def _conv_foof(f, weight_sharing):
    """FOOF on a convolution (Conv2DFOOF, KFAC-reduce: ReducedConv2DFOOF) in an estimator."""
    est = curv.BlockDiagonalCurvature(_CONV, _ce, layer_to_block={"conv2d": "foof"},
                                      weight_sharing=weight_sharing)
    fa = (_params(f, _CP), (f(_CX), f(_CY)))
    st = est.update_curvature_matrix_estimate(est.init(None, fa), 0.0, 1.0, 4, None, fa,
                                              "ggn_exact")
    want = {"expand": "Conv2DFOOF", "reduce": "ReducedConv2DFOOF"}[weight_sharing]
    assert type(est.blocks[0]).__name__ == want
    return [est.to_dense_matrix(st), est.multiply_matpower(st, f(_CV), 0.1, -1.0, False, False)]


DASK_CALLS.update({
    "kfac_ref.curvature.kfra_factors": lambda f: [
        m for pair in curv.kfra_factors(*_problem(f)) for m in pair],
    "kfac_ref.blocks.kfac_jax.Conv2DFOOF": lambda f: _conv_foof(f, "expand"),
    "kfac_ref.blocks.kfac_jax.ReducedConv2DFOOF": lambda f: _conv_foof(f, "reduce"),
    "kfac_ref.curvature.ggn_matrix": lambda f: curv.ggn_matrix(*_problem(f)),
    "kfac_ref.curvature.fisher_matrix": lambda f: curv.fisher_matrix(*_problem(f)),
    "kfac_ref.curvature.hessian_matrix": lambda f: curv.hessian_matrix(*_problem(f)),
    "kfac_ref.curvature.empirical_fisher_matrix": lambda f: [
        curv.empirical_fisher_matrix(*_problem(f), normalization=n)
        for n in curv.EMPIRICAL_FISHER_NORMALIZATIONS],
    "kfac_ref.curvature.ggn_vector_product": lambda f: curv.ggn_vector_product(
        *_problem(f), f(_NV)),
    "kfac_ref.curvature.fisher_vector_product": lambda f: curv.fisher_vector_product(
        *_problem(f), f(_NV)),
    "kfac_ref.curvature.hessian_vector_product": lambda f: curv.hessian_vector_product(
        *_problem(f), f(_NV)),
    "kfac_ref.curvature.empirical_fisher_vector_product": lambda f:
        curv.empirical_fisher_vector_product(*_problem(f), f(_NV)),
    "kfac_ref.curvature.loss_value_and_grad": lambda f: curv.loss_value_and_grad(*_problem(f)),
    "kfac_ref.curvature.jacobian": lambda f: [
        curv.jacobian(_NET, _params(f), f(_NX)),
        curv.jacobian(_CONV, _params(f, _CP), f(_CX))],
    "kfac_ref.curvature.jacobian_vector_product": lambda f: curv.jacobian_vector_product(
        _NET, _params(f), f(_NX), f(_NV)),
    "kfac_ref.curvature.jacobian_transpose_vector_product": lambda f:
        curv.jacobian_transpose_vector_product(_NET, _params(f), f(_NX), f(_NY)),
    "kfac_ref.curvature.ggn_factor_product": lambda f: curv.ggn_factor_product(
        *_problem(f), f(_NY)),
    "kfac_ref.curvature.fisher_factor_product": lambda f: curv.fisher_factor_product(
        *_problem(f), f(_NY)),
    "kfac_ref.curvature.ggn_factor_transpose_product": lambda f:
        curv.ggn_factor_transpose_product(*_problem(f), f(_NV)),
    "kfac_ref.curvature.fisher_factor_transpose_product": lambda f:
        curv.fisher_factor_transpose_product(*_problem(f), f(_NV)),
    "kfac_ref.curvature.monte_carlo_fisher_matrix": lambda f: curv.monte_carlo_fisher_matrix(
        *_problem(f), np.random.default_rng(2), num_samples=2),
    "kfac_ref.curvature.estimated_matrix": lambda f: [
        curv.estimated_matrix(*_problem(f), m, rng=np.random.default_rng(2))
        for m in curv.ESTIMATION_MODES],
    "kfac_ref.curvature.estimation_output_vectors": lambda f: [
        curv.estimation_output_vectors(*_problem(f), m, rng=np.random.default_rng(2))
        for m in curv.ESTIMATION_MODES],
    "kfac_ref.curvature.block_diag": lambda f: curv.block_diag([f(_A), f(_B)]),
    "kfac_ref.curvature.relative_frobenius_error": lambda f: curv.relative_frobenius_error(
        f(_A), f(_A * 1.1)),
    # every estimation mode; products at power 1, the factored inverse, cache and sync
    "kfac_ref.curvature.BlockDiagonalCurvature": lambda f: [
        _estimator_products(f, mode=m) for m in curv.ESTIMATION_MODES],
    "kfac_ref.curvature.BlockDiagonalState": lambda f: list(
        _estimator(f)[1].blocks_states[0].statistics[0].value),
    "kfac_ref.curvature.ExplicitExactCurvature": lambda f: _estimator_products(
        f, curv.ExplicitExactCurvature),
    "kfac_ref.curvature.ImplicitExactCurvature": _implicit,
    "kfac_ref.blocks.kfac_jax.ReducedConv2DTwoKroneckerFactored": _reduced_conv,
})


def _layer_products(f, layer, shape, ids=False):
    """A layer's forward pass, tangent, input cotangent, parameter gradients (summed and
    per example) and second-order pass, as the network's passes call them."""
    rng = np.random.default_rng(9)
    x = rng.integers(0, 6, shape) if ids else rng.standard_normal(shape)
    p = tuple(f(a) for a in layer.init_params(rng, np.zeros(1)))
    y = layer.forward(p, f(x))
    g = f(rng.standard_normal(tuple(y.shape)))
    out = [y]
    if p:
        out += [layer.param_grads(p, f(x), g), layer.param_grads(p, f(x), g, per_example=True)]
    if not ids:
        dx = f(rng.standard_normal(shape))
        t = tuple(f(rng.standard_normal(tuple(a.shape))) for a in p)
        out += [layer.jvp(p, f(x), t, dx), layer.vjp_input(p, f(x), g),
                layer.rvjp(p, f(x), t, dx, g, g)]
    return out


_LAYERS = {
    "Dense": (lambda: knn.Dense(3, 2), (6, 3)),
    "Conv2D": (lambda: knn.Conv2D(2, 3, (2, 2), padding="SAME"), (4, 3, 3, 2)),
    "ScaleAndShift": (lambda: knn.ScaleAndShift(2), (4, 3, 2)),
    "Activation": (lambda: knn.Activation("tanh"), (6, 3)),
    "Flatten": (lambda: knn.Flatten(), (4, 3, 2)),
    "MeanPool": (lambda: knn.MeanPool(), (4, 3, 3, 2)),
}
for _name, (_make, _shape) in _LAYERS.items():
    DASK_CALLS[f"kfac_ref.nn.{_name}"] = (
        lambda make, shape: lambda f: _layer_products(f, make(), shape))(_make, _shape)


def _sequential(f):
    p, x, g = _params(f), f(_NX), f(_NY)
    v = _NET.unflatten(f(_NV))
    fp = _NET.forward_pass(p, x)
    return [_NET.forward(p, x), fp.output, list(fp.inputs), _NET.jvp(p, x, v),
            _NET.vjp(p, x, g), _NET.vjp(p, x, g, per_example=True), _NET.flatten(p),
            _NET.unflatten(f(_NV)), _NET.backward_with_cotangents(p, x, g),
            _NET.second_order_backward(p, x, v, lambda fo, fd: (fo - g, fd)),
            _NET.init_params(np.random.default_rng(1), f(np.zeros(1)))]


_PERM = knn.torch_permutation(_NET)
DASK_CALLS.update({
    "kfac_ref.nn.Embedding": lambda f: _layer_products(f, knn.Embedding(6, 3), (8,), ids=True),
    "kfac_ref.nn.Sequential": _sequential,
    "kfac_ref.nn.ForwardPass": lambda f: (lambda fp: [fp.output, *fp.inputs])(
        _NET.forward_pass(_params(f), f(_NX))),
    "kfac_ref.nn.activation_derivatives": lambda f: [
        knn.activation_derivatives(k, f(_NX)) for k in knn.ACTIVATIONS],
    "kfac_ref.nn.permute_vector": lambda f: knn.permute_vector(f(_NV), _PERM),
    "kfac_ref.nn.permute_matrix": lambda f: knn.permute_matrix(
        f(np.outer(_NV, _NV[::-1])), _PERM),
    "kfac_ref.nn.to_torch_parameters": lambda f: list(
        knn.to_torch_parameters(_NET, _params(f)).values()),
    "kfac_ref.nn.to_kfac_jax_params": lambda f: [
        v for d in knn.to_kfac_jax_params(_NET, _params(f)).values() for v in d.values()],
})

_QV, _QC, _QG = _N.standard_normal((2, 5)), _spd(5), _N.standard_normal(5)
_QA, _QD, _QB = _QV @ _QC @ _QV.T, _QV @ _QV.T, _QV @ _QG


def _optimizer_run(f, **options):
    """Two steps of K-FAC on the MLP: the parameters, the damping and the step's loss."""
    est = curv.BlockDiagonalCurvature(_NET, _gauss, default_estimation_mode="ggn_exact")
    opt = optim.KFACOptimizer(_NET, _gauss, est, exact_power=False, **options)
    params, batch = _params(f), (f(_NX), f(_NY))
    state = opt.init(params, batch)
    for _ in range(2):
        params, state = opt.step(state, params, batch)
    return [params, state.damping, state.velocity, state.stats.loss, state.stats.damping]


def _preconditioned(f):
    est, st = _estimator(f)
    g = curv.loss_value_and_grad(*_problem(f))[1]
    return optim.preconditioned_direction(est, st, g, 0.2, exact_power=False)


DASK_CALLS.update({
    "kfac_ref.optim.quadratic_model": lambda f: [
        optim.quadratic_model(f(_QA), f(_QD), f(_QB), 0.3),
        optim.quadratic_model(f(_QA), f(_QD), f(_QB), 0.3, include_damping_in_change=True),
        optim.quadratic_model(f(_QA), f(_QD), f(_QB), 0.3, fixed_coefficients=(None, 0.4))],
    "kfac_ref.optim.norm_constraint_coefficient": lambda f: optim.norm_constraint_coefficient(
        f(_QG), f(_QG * 2.0 + 0.1), 0.5, 0.01),
    "kfac_ref.optim.adapt_damping": lambda f: [
        optim.adapt_damping(1.0, f(np.array(1.0)), f(np.array(new)), f(np.array(-1.0)), 0.5,
                            rule=rule)
        for new in (0.9, 0.5, 0.1) for rule in optim.DAMPING_RULES],
    "kfac_ref.optim.preconditioned_direction": _preconditioned,
    # fixed learning rate and momentum; the quadratic model with damping adaptation; adam
    # momentum with a norm constraint and weight decay (the factored inverse: exact_power
    # needs an eigendecomposition, refused below)
    "kfac_ref.optim.KFACOptimizer": lambda f: [
        _optimizer_run(f, learning_rate=0.1, momentum=0.5),
        _optimizer_run(f, momentum_type="qmodel", adapt_damping=True,
                       damping_adaptation_interval=1),
        _optimizer_run(f, momentum_type="adam", learning_rate=0.1, momentum=0.5,
                       norm_constraint=0.01, weight_decay=0.01)],
})


def _laplace_problem(f, structure):
    import test_laplace

    params, curvature, _ = test_laplace.problem(np.random.default_rng(12), structure)
    return ([f(p) for p in params],
            [tuple(f(a) for a in c) if isinstance(c, tuple) else f(c) for c in curvature])


# the structures whose eigenvalues need no eigendecomposition; "kron", "kron_factored" and
# "full" are refused (below)
_LAPLACE_LAZY = ("ekfac", "diagonal")
_PRIORS = np.array([0.7, 1.3])  # one prior precision per group
DASK_CALLS.update({
    "kfac_ref.laplace.laplace_log_marginal_likelihood": lambda f: [
        laplace.laplace_log_marginal_likelihood(-7.25, *_laplace_problem(f, s), 0.7,
                                                structure=s, temperature=0.9)
        for s in _LAPLACE_LAZY],
    "kfac_ref.laplace.laplace_log_marginal_likelihood_grad": lambda f: [
        laplace.laplace_log_marginal_likelihood_grad(*_laplace_problem(f, s), f(_PRIORS),
                                                     structure=s) for s in _LAPLACE_LAZY],
})


def _operators(f):
    est, st = _estimator(f)
    kfac = CurvatureOperator.from_estimator(est, st, 0.1)
    exact = [CurvatureOperator.from_exact(*_problem(f), curvature=c)
             for c in ("ggn", "fisher", "empirical_fisher", "hessian")]
    m = _closed(f, _A)
    dense = CurvatureOperator(lambda v: m @ v, f(_A), 4)
    two = f(np.stack([_NV, _NV * 2.0], axis=1))
    return [kfac.matvec(f(_NV)), kfac.matmat(two), kfac.to_dense(), kfac.trace(),
            [(op.matvec(f(_NV)), op.rmatmat(two)) for op in exact],
            dense.matvec(f(np.ones(4))), dense.to_dense(), dense.trace(), dense @ f(_PROBES),
            dense.hutchinson_trace(4, np.random.default_rng(1))]


DASK_CALLS["kfac_ref.operators.CurvatureOperator"] = _operators


def _ekfac_case(f, conv=False):
    """An EKFAC block (dense or conv), its state after one update from ``f``'s arrays, and a
    parameter-shaped vector."""
    rng = np.random.default_rng(4)
    if conv:
        block = kj.Conv2DEKFAC(inputs_shape=(6, 3, 3, 1), kernel_shape=(2, 2, 1, 2), strides=1,
                               padding="VALID")
        data = {"inputs": rng.standard_normal((6, 3, 3, 1)),
                "outputs_grad": rng.standard_normal((6, 2, 2, 2))}
    else:
        block = kj.DenseEKFAC(3, 2)
        data = {"inputs": rng.standard_normal((6, 3)),
                "outputs_grad": rng.standard_normal((6, 2))}
    state = block.update_curvature_matrix_estimate(
        block.init(f(np.zeros(1))), {k: f(v) for k, v in data.items()}, 0.0, 1.0, 6)
    vec = tuple(f(rng.standard_normal(s)) for s in block.parameters_shapes)
    return block, state, vec


def _ekfac_product(f, conv=False):
    block, state, vec = _ekfac_case(f, conv)
    return block.multiply(state, vec, 0.1, exact_power=False, use_cached=False)


def _series_inverse(f):
    rng = np.random.default_rng(8)
    a, g = _spd(4, rng), _spd(3, rng)
    block = blocks.tf.FullyConnectedSeriesFB(f(a), f(g), 0.1, 3, True, input_cov_dt1=f(a * 0.1),
                                             output_cov_dt1=f(g * 0.1))
    return block.multiply_inverse((f(np.ones((3, 3))), f(np.ones(3))))


# The stateful factor classes (run on Dask in tests/test_dask.py): statistics, the
# Cholesky-based inverses and (for diagonal factors) every power run lazily; a dense
# factor's eigendecomposition paths raise at the call there.  Each: constructor,
# update_cov's arguments, dense or diagonal.
_SEQ8 = _W.standard_normal((8, 4, 3))
DASK_FACTOR_CLASSES = {
    "FullyConnectedKroneckerFactor": (
        lambda: factors.FullyConnectedKroneckerFactor(has_bias=True), lambda f: (f(_X),), True),
    "FullyConnectedDiagonalFactor": (
        lambda: factors.FullyConnectedDiagonalFactor(has_bias=True),
        lambda f: (f(_X), f(_G)), False),
    "ConvInputKroneckerFactor": (
        lambda: factors.ConvInputKroneckerFactor((3, 3, 2, 3), "SAME"),
        lambda f: (f(_IMG),), True),
    "ConvOutputKroneckerFactor": (
        lambda: factors.ConvOutputKroneckerFactor(), lambda f: (f(_IMG_G),), True),
    "ConvDiagonalFactor": (
        lambda: factors.ConvDiagonalFactor((3, 3, 2, 3), (1, 1), "SAME"),
        lambda f: (f(_IMG), f(_IMG_G)), False),
    "ConvInputMultiKF": (  # uses folded into the batch axis
        lambda: factors.ConvInputMultiKF((3, 3, 2, 3), "SAME", 2), lambda f: (f(_IMG),), True),
    "ConvOutputMultiKF": (
        lambda: factors.ConvOutputMultiKF(2), lambda f: (f(_IMG_G),), True),
    "ConvInputSUAKroneckerFactor": (
        lambda: factors.ConvInputSUAKroneckerFactor((3, 3, 2, 3), has_bias=True),
        lambda f: (f(_IMG),), "sua"),
    "NaiveDiagonalFactor": (
        lambda: factors.NaiveDiagonalFactor(10), lambda f: (f(_X),), False),
    "FullFactor": (lambda: factors.NaiveFullFactor(10), lambda f: (f(_X),), True),
    "EmbeddingInputKroneckerFactor": (
        lambda: factors.EmbeddingInputKroneckerFactor(6), lambda f: (f(_IDS),), False),
    "DiagonalKroneckerFactor": (
        lambda: factors.DiagonalKroneckerFactor(has_bias=True), lambda f: (f(_X),), False),
    "DiagonalMultiKF": (
        lambda: factors.DiagonalMultiKF(2, has_bias=True), lambda f: (f(_X),), False),
    "ScaleAndShiftFullFactor": (
        lambda: factors.ScaleAndShiftFullFactor((1,), (1,)), lambda f: (f(_SEQ8), f(_SEQ8)),
        True),
    "ScaleAndShiftDiagonalFactor": (
        lambda: factors.ScaleAndShiftDiagonalFactor((1,), (1,)),
        lambda f: (f(_SEQ8), f(_SEQ8)), False),
    "FullyConnectedMultiKF": (
        lambda: factors.FullyConnectedMultiKF(2, has_bias=True), lambda f: (f(_X),), True),
}

def _factor_run(name, f):
    """Two covariance updates, then every quantity a factor of this kind caches."""
    make, data, dense = DASK_FACTOR_CLASSES[name]
    fac = make()
    for _ in range(2):
        fac = fac.update_cov(*data(f), ema_decay=0.9)
    fac = fac.register_inverse(0.1)
    if dense is True:
        fac = fac.register_cholesky(0.1).register_cholesky_inverse(0.1)
    elif dense is False:
        fac = fac.register_matpower(-0.5, 0.1)
    fac = fac.update_inverses()
    out = [fac.cov, fac.get_inverse(0.1), fac.get_matpower(1, 0.1)]
    if dense is True:
        out += [fac.get_cholesky(0.1), fac.get_cholesky_inverse(0.1)]
    elif dense is False:
        out.append(fac.get_matpower(-0.5, 0.1))
    return out, fac


def _kj_products(name, cell):
    import test_blocks_kfac_jax as shared

    block, state, _, _ = shared.make_state(cell, np.random.default_rng(0), name)
    vec = tuple(cell.asarray(np.random.default_rng(1).standard_normal(s))
                for s in block.parameters_shapes)
    calls = {
        "multiply": lambda: block.multiply(state, vec, 0.1, exact_power=False,
                                           use_cached=False),
        "multiply_inverse": lambda: block.multiply_inverse(state, vec, 0.1, exact_power=False,
                                                           use_cached=False),
        "exact_inverse": lambda: block.multiply_inverse(state, vec, 0.1, exact_power=True,
                                                        use_cached=False),
        "eigenvalues": lambda: block.eigenvalues(state),
        "to_dense_matrix": lambda: block.to_dense_matrix(state),
    }
    return {k: c for k, c in calls.items()}


# The public functions that need an eigendecomposition (declared "no" on Dask), with a
# valid call on NumPy.
EIGEN_CALLS = {
    "kfac_ref.linalg.clipped_eigh": (lambda f: K.clipped_eigh(f(_A))),
    "kfac_ref.linalg.damped_matpower": (lambda f: K.damped_matpower(
        f(_A), -0.5, 0.1)),
    "kfac_ref.linalg.kron_damped_matpower_matvec": (lambda f:
        K.kron_damped_matpower_matvec(f(_A), f(_B), f(_V), -0.5, 0.1)),
    "kfac_ref.linalg.kron_damped_inverse_matvec": (lambda f:
        K.kron_damped_inverse_matvec(f(_A), f(_B), f(_V), 0.1)),
    "kfac_ref.spectral.kron_eigenvalues": (lambda f: spectral.kron_eigenvalues(
        f(_A), f(_B), 0.1)),
    "kfac_ref.spectral.kron_slogdet": (lambda f: spectral.kron_slogdet(
        f(_A), f(_B), 0.1)),
    "kfac_ref.factors.series_option1_quantities": (lambda f:
        factors.series_option1_quantities(f(_B), f(_C), 0.1)),
    "kfac_ref.factors.series_option2_quantities": (lambda f:
        factors.series_option2_quantities(f(_B), f(_C), 0.1)),
    "kfac_ref.blocks.full_block_matpower": (lambda f:
        blocks.full_block_matpower(f(_A), f(_X[0]), -0.5, 0.1)),
    "kfac_ref.blocks.kronecker_block_eigenvalues": (lambda f:
        blocks.kronecker_block_eigenvalues(f(_A), f(_B))),
    "kfac_ref.blocks.kronecker_difference_inverse": (lambda f:
        blocks.kronecker_difference_inverse(f(_A), f(_B), f(_A * 0.1), f(_B * 0.1), f(_V32))),
    "kfac_ref.blocks.block_tridiagonal_multiply_inverse": (lambda f:
        blocks.block_tridiagonal_multiply_inverse(
            [f(_A), f(_A)], [f(_B), f(_B)], [f(_A * 0.1)], [f(_B * 0.1)], [f(_V32), f(_V32)],
            0.1)),
}


def _kj_all(name):
    """Every product of kfac-jax's block ``name`` (tests/test_blocks_kfac_jax.py's build)."""
    def call(f):
        class Cell:
            asarray = staticmethod(f)
        return [c() for c in _kj_products(name, Cell).values()]
    return call


def _ekfac_all(f, conv=False):
    """EKFAC's products: damped power 1 (fresh), the exact inverse with its cache."""
    block, state, vec = _ekfac_case(f, conv)
    return [block.multiply(state, vec, 0.1, exact_power=False, use_cached=False),
            block.multiply_inverse(state, vec, 0.1, exact_power=True, use_cached=False),
            block.to_dense_matrix(state), block.eigenvalues(state)]


def _tf_block(f, name):
    """TF K-FAC's Fisher block ``name`` built from ``f``'s arrays, and every product."""
    import test_blocks_tf as shared
    from conftest import random_spd

    from kfac_ref.blocks import tf

    class Cell:
        asarray = staticmethod(f)

        @staticmethod
        def round_host(host):
            return np.asarray(host, dtype=np.float64)

    rng = np.random.default_rng(1)
    kron = {c[0]: c for c in shared.kron_cases(np.random.default_rng(0))}
    if name in kron:
        _, ctor, a, g, kshape, bias, _, _ = kron[name]
        block = ctor(f(a), f(g), 0.3)
        vec, _ = shared.make_vector(Cell, np.random.default_rng(5), kshape, bias)
    else:  # host draws first, then only the arrays of this block through f
        d = rng.uniform(0.5, 2.0, (4, 3))
        w, b = rng.standard_normal((3, 3)), rng.standard_normal(3)
        shapes = [(3, 3), (3,)]
        vec = (w, b)
        if name in ("FullyConnectedDiagonalFB", "NaiveDiagonalFB", "DiagonalFB"):
            cov = d if name == "FullyConnectedDiagonalFB" else d.reshape(-1)
        elif name in ("FullFB", "NaiveFullFB"):
            cov = random_spd(rng, 12, 0.5, 2.0)
        elif name == "ScaleAndShiftFullFB":
            vec, cov = (b, rng.standard_normal(3)), random_spd(rng, 6, 0.5, 2.0)
        elif name == "ScaleAndShiftDiagonalFB":
            vec, cov = (b, rng.standard_normal(3)), rng.uniform(0.5, 2.0, 6)
        elif name == "ConvDiagonalFB":
            vec, cov = (rng.standard_normal((1, 3, 1, 3)), b), d
        elif name == "EmbeddingKFACMultiIndepFB":
            cov = (rng.uniform(0.5, 2.0, 4), random_spd(rng, 3, 0.5, 2.0))
            vec = rng.standard_normal((4, 3))
        else:  # depthwise, from a batch
            cov = (rng.standard_normal((4, 5, 5, 2)), rng.standard_normal((4, 4, 3, 4)))
            vec = rng.standard_normal((2, 3, 2, 2))
        make = {
            "FullyConnectedDiagonalFB": lambda c: tf.FullyConnectedDiagonalFB(c, 0.3,
                                                                              has_bias=True),
            "NaiveDiagonalFB": lambda c: tf.NaiveDiagonalFB(c, 0.3, shapes),
            "DiagonalFB": lambda c: tf.DiagonalFB(c, 0.3, shapes),
            "FullFB": lambda c: tf.FullFB(c, 0.3, shapes),
            "NaiveFullFB": lambda c: tf.NaiveFullFB(c, 0.3, shapes),
            "ScaleAndShiftFullFB": lambda c: tf.ScaleAndShiftFullFB(c, 0.3),
            "ScaleAndShiftDiagonalFB": lambda c: tf.ScaleAndShiftDiagonalFB(c, 0.3),
            "ConvDiagonalFB": lambda c: tf.ConvDiagonalFB(c, 0.3, (1, 3, 1, 3), has_bias=True,
                                                          num_locations=4),
            "EmbeddingKFACMultiIndepFB": lambda c: tf.EmbeddingKFACMultiIndepFB(
                c[0], c[1], 0.3, 3),
            "DepthwiseConvDiagonalFB": lambda c: tf.DepthwiseConvDiagonalFB.from_data(
                c[0], c[1], 0.3, (2, 3, 2, 2), "VALID"),
            "DepthwiseConvKFCBasicFB": lambda c: tf.DepthwiseConvKFCBasicFB.from_data(
                c[0], c[1], 0.3, (2, 3, 2, 2), "VALID"),
        }
        block = make[name](tuple(f(c) for c in cov) if isinstance(cov, tuple) else f(cov))
        vec = tuple(f(v) for v in vec) if isinstance(vec, tuple) else f(vec)
    return [block.full_fisher_block(), block.multiply(vec), block.multiply_inverse(vec),
            block.multiply_matpower(vec, -0.5), block.multiply_matpower(vec, 1.0)]


def _tf_all(name):
    return lambda f: _tf_block(f, name)


_TF_BLOCK_NAMES = ("FullyConnectedKFACBasicFB", "FullyConnectedKFACBasicFB-diag-input",
                   "FullyConnectedMultiIndepFB", "ConvKFCBasicFB", "ConvKFCBasicMultiIndepFB",
                   "EmbeddingKFACFB", "FullyConnectedDiagonalFB", "NaiveDiagonalFB", "FullFB",
                   "NaiveFullFB", "DiagonalFB", "ScaleAndShiftFullFB", "ScaleAndShiftDiagonalFB",
                   "ConvDiagonalFB", "EmbeddingKFACMultiIndepFB", "DepthwiseConvDiagonalFB",
                   "DepthwiseConvKFCBasicFB")
_KJ_BLOCK_NAMES = ("ScaledIdentity", "NaiveDiagonal", "DenseDiagonal", "Conv2DDiagonal",
                   "ScaleAndShiftDiagonal", "DenseTwoKroneckerFactored",
                   "Conv2DTwoKroneckerFactored", "NaiveTNT", "DenseTNT", "Conv2DTNT", "DenseFOOF",
                   "DenseKPSVD", "NaiveFull", "DenseFull", "Conv2DFull", "ScaleAndShiftFull")


def _factor_all(name):
    """A factor class's cached quantities, and its eigendecomposition paths when dense."""
    def call(f):
        out, fac = _factor_run(name, f)
        if DASK_FACTOR_CLASSES[name][2] is True:
            eig = fac.register_matpower(-0.5, 0.1).update_inverses()
            out += [eig.get_matpower(-0.5, 0.1), list(eig.get_eigendecomp())]
        return out
    return call


def _estimator_eigen(f, cls=curv.BlockDiagonalCurvature):
    """An estimator's paths through an eigendecomposition: exact powers, cache, eigenvalues."""
    est, st = _estimator(f, cls, exact_powers_to_cache=-1.0)
    return [est.multiply_matpower(st, f(_NV), 0.1, -1.0, True, False),
            est.multiply_matpower(est.update_cache(st, 0.1, -1.0, None, False), f(_NV), 0.1,
                                  -1.0, True, True),
            est.eigenvalues(st)]


def _optimizer_exact(f):
    """Two K-FAC steps with the exact damped inverse (an eigendecomposition per factor)."""
    est = curv.BlockDiagonalCurvature(_NET, _gauss, default_estimation_mode="ggn_exact")
    opt = optim.KFACOptimizer(_NET, _gauss, est, learning_rate=0.1, momentum=0.5)
    params, batch = _params(f), (f(_NX), f(_NY))
    state = opt.init(params, batch)
    for _ in range(2):
        params, state = opt.step(state, params, batch)
    return [params, state.velocity]


def _laplace_eigen(f):
    return [laplace.laplace_log_marginal_likelihood(-7.25, *_laplace_problem(f, s), 0.7,
                                                    structure=s)
            for s in ("kron", "kron_factored", "full")] + [
        laplace.laplace_log_marginal_likelihood_grad(*_laplace_problem(f, s), f(_PRIORS),
                                                     structure=s)
        for s in ("kron", "kron_factored", "full")]


def _operator_eigen(f):
    m = _closed(f, _A)
    op = CurvatureOperator(lambda v: m @ v, f(_A), 4)
    return [op.eigenvalues(), op.slogdet()]


# Public objects, or their paths, that need an eigendecomposition (declared "no" on Dask,
# or refused there path by path), with a valid call on NumPy; and the blocks and factor
# classes that tests/test_dask.py exercises through its own builders.
NUMPY_CALLS = {
    **EIGEN_CALLS,
    # the objects tests/test_dask.py runs by chunks with its own data
    "kfac_ref.linalg.compute_cov": lambda f: [K.compute_cov(f(_X)),
                                              K.compute_cov(f(_X), f(_X[:, ::-1]))],
    "kfac_ref.factors.fully_connected_kronecker_factor": lambda f:
        factors.fully_connected_kronecker_factor(f(_X), has_bias=True),
    "kfac_ref.factors.conv_input_kronecker_factor": lambda f:
        factors.conv_input_kronecker_factor(f(_IMG), (3, 3, 2, 3), "SAME"),
    "kfac_ref.factors.conv_output_kronecker_factor": lambda f:
        factors.conv_output_kronecker_factor(f(_IMG_G)),
    "kfac_ref.losses.CategoricalLogitsNegativeLogProbLoss": lambda f: _loss_quantities(
        losses.CategoricalLogitsNegativeLogProbLoss(f(_G), targets=f(_IDS % 3))),
    "kfac_ref.losses.MultiBernoulliNegativeLogProbLoss": lambda f: _loss_quantities(
        losses.MultiBernoulliNegativeLogProbLoss(f(_G), targets=f(_LABELS))),
    "kfac_ref.losses.NormalMeanNegativeLogProbLoss": lambda f: _loss_quantities(
        losses.NormalMeanNegativeLogProbLoss(f(_G), f(_G[::-1]), variance=0.5)),
    **{f"kfac_ref.blocks.kfac_jax.{n}": _kj_all(n) for n in _KJ_BLOCK_NAMES},
    **{f"kfac_ref.blocks.tf.{n}": _tf_all(n) for n in _TF_BLOCK_NAMES},
    **{f"kfac_ref.factors.{n}": _factor_all(n) for n in DASK_FACTOR_CLASSES},
    "kfac_ref.blocks.kfac_jax.DenseEKFAC": _ekfac_all,
    "kfac_ref.blocks.kfac_jax.Conv2DEKFAC": lambda f: _ekfac_all(f, conv=True),
    "kfac_ref.blocks.tf.FullyConnectedSeriesFB": _series_inverse,
    "kfac_ref.curvature.approximation_report": lambda f: curv.approximation_report(
        *_problem(f)),
    "kfac_ref.blocks.kronecker_block_matpower (eigen paths)": lambda f: [
        blocks.kronecker_block_matpower(f(_A), f(_B), f(_V32), -0.5, 0.1),
        blocks.kronecker_block_matpower(f(_A), f(_B), f(_V32), -1.0, 0.1, exact=True),
        blocks.kronecker_block_matpower(f(_A), f(_B), f(_V32), -1.0, 0.1, norm_type="2_norm")],
    "kfac_ref.curvature.BlockDiagonalCurvature (eigen paths)": _estimator_eigen,
    "kfac_ref.curvature.ExplicitExactCurvature (eigen paths)": lambda f: _estimator_eigen(
        f, curv.ExplicitExactCurvature),
    "kfac_ref.optim.KFACOptimizer (exact power)": _optimizer_exact,
    "kfac_ref.optim.preconditioned_direction (exact power)": lambda f: (
        lambda est, st: optim.preconditioned_direction(est, st, f(_NV), 0.2, exact_power=True))(
        *_estimator(f)),
    "kfac_ref.laplace (eigen structures)": _laplace_eigen,
    "kfac_ref.operators.CurvatureOperator (eigen paths)": _operator_eigen,
}
