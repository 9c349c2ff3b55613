"""kfac-jax as an implementation under test.

Environment: ``conformance/peers/jax.txt`` (its own venv; jax/jaxlib pinned to 0.9.1).
Findings and reproductions: ``conformance/peers/FINDINGS.md``, ``repro_kfac_jax.py``.

Mapping: the portable network spec becomes a JAX loss function with every layer registered
by hand (``register_dense`` / ``register_conv2d`` with explicit padding pairs, NHWC/HWIO) and
the loss registered with ``register_softmax_cross_entropy_loss`` or
``register_normal_predictive_distribution(variance=v)`` (so the case's variance is used);
parameters are a list of ``[w, b]`` lists (bias after weight).  ``BlockDiagonalCurvature``
with ``auto_register_tags=False``, one ``update_curvature_matrix_estimate(ema_old=0,
ema_new=1)`` in the case's estimation mode; dense blocks from
``to_diagonal_block_dense_matrix``, factors from ``blocks_states[i].factors``.  Also the
``WeightedMovingAverage`` for ``averaging.ema``.

Declared conventions: canonical layouts (kron(A, G), bias last, (kh, kw, C_in) patches, KFC
normalisation), no symmetrisation, and the extra 1/N of ``fisher_empirical``.
"""

from __future__ import annotations

import numpy as np

from ..adapter import AdapterUnavailable, CaseUnsupported, implements
from ..conventions import Conventions
from ._peer import PeerAdapter

ADAPTERS = {"kfac_jax": "conformance.adapters.peer_kfac_jax:KfacJaxAdapter"}

_IMPLEMENTED = (
    "networks.kfac",
    "networks.kfac_input_factors",
    "networks.kfac_output_factors",
    "networks.kfac_inverse_matvec",
    "averaging.ema",
    "losses.fisher",
    "losses.gradient",
    "losses.hessian",
)
_REASONS = {
    "losses.sample": "kfac-jax's loss sample() draws from a jax.random key (statistical route "
    "only); not mapped yet",
    "losses.fisher_factor": "kfac-jax's loss factor products (multiply_fisher_factor, ...) are not "
    "mapped yet",
    "losses.fisher_factor_transpose": "kfac-jax's loss factor products "
    "(multiply_fisher_factor_transpose) are not mapped yet",
    "losses.ggn_factor": "kfac-jax's loss factor products (multiply_ggn_factor) are not mapped yet",
    "blocks.kron_cached_inverse": "kfac-jax's cached block products (use_cached=True after "
    "update_cache) need a traced network's block state; not mapped yet",
    "estimator.full_blocks": "kfac-jax's DenseFull / NaiveFull / NaiveDiagonal blocks need "
    "layer_tag_to_block_ctor overrides of a traced network; not mapped yet",
    "sampling": "kfac-jax's sampling modes (its default ggn_curvature_prop, fisher_gradients, "
    "fisher_curvature_prop) are not mapped yet: they draw from a jax.random key inside the "
    "estimator, so only the statistical route (params['seed'] → jax.random.PRNGKey) would apply",
    "networks": "kfac-jax has no exact GGN / empirical-Fisher matrix function (only its "
    "K-FAC blocks)",
    "linalg": "kfac-jax's linear algebra helpers are private (kfac_jax._src.utils); the "
    "blocks are checked through networks.kfac and repro_kfac_jax.py instead",
    "factors": "kfac-jax computes factors only inside a curvature block driven by a traced "
    "network; checked through networks.kfac_*_factors",
    "blocks": "block matrix powers are checked through repro_kfac_jax.py (multiply_matpower), which"
    " needs a registered network, not bare factors",
    "estimator": "not mapped yet",
}


class KfacJaxAdapter(PeerAdapter):
    name = "kfac_jax"
    description = "kfac-jax BlockDiagonalCurvature with hand-registered layers (JAX, x64)"
    conventions = Conventions(symmetrised=False, empirical_fisher_scale="kfac_jax")
    IMPLEMENTED, REASONS = _IMPLEMENTED, _REASONS
    DISTRIBUTIONS = ("kfac-jax", "jax")

    def setup(self):
        try:
            import jax

            jax.config.update("jax_enable_x64", True)
            import kfac_jax  # noqa: F401
        except ImportError as exc:
            raise AdapterUnavailable(
                f"kfac-jax is not installed ({exc}); see conformance/peers/jax.txt"
            ) from exc

    def _state(self, inputs, params):
        import jax
        import kfac_jax

        from ..peers import nets

        if params.get("weight_sharing", "expand") == "reduce":
            raise CaseUnsupported("kfac-jax 0.0.8 has no KFAC-reduce for dense layers")
        fn, theta, batch = nets.jax_build(params["net"], inputs, params)
        est = kfac_jax.BlockDiagonalCurvature(fn, auto_register_tags=False)
        rng = jax.random.PRNGKey(0)
        st = est.init(rng, (theta, batch), exact_powers_to_cache=None, approx_powers_to_cache=None)
        st = est.update_curvature_matrix_estimate(
            st,
            ema_old=0.0,
            ema_new=1.0,
            identity_weight=0.0,
            batch_size=int(inputs["x"].shape[0]),
            rng=rng,
            func_args=(theta, batch),
            estimation_mode=params["mode"],
        )
        return est, st

    @implements("networks.kfac")
    def kfac(self, inputs, params):
        from ..peers import nets

        est, st = self._state(inputs, params)
        return nets.block_diag([np.asarray(b) for b in est.to_diagonal_block_dense_matrix(st)])

    @implements("networks.kfac_inverse_matvec")
    def inverse_matvec(self, inputs, params):
        import jax.numpy as jnp

        est, st = self._state(inputs, params)
        # the canonical [P] vector -> the parameter pytree (per layer w row-major, then b)
        v = np.asarray(inputs["v"])
        tree, off = [], 0
        for i, s in enumerate(params["net"]):
            if s["kind"] not in ("dense", "conv2d"):
                continue
            leaves = []
            for key in (f"w{i}",) + ((f"b{i}",) if s["bias"] else ()):
                shape = np.shape(inputs[key])
                size = int(np.prod(shape))
                leaves.append(jnp.asarray(v[off : off + size].reshape(shape)))
                off += size
            tree.append(leaves)
        out = est.multiply_matpower(
            st,
            tree,
            identity_weight=float(params["damping"]),
            power=-1,
            exact_power=bool(params["exact"]),
            use_cached=False,
            pmap_axis_name=None,
        )
        return np.concatenate([np.asarray(leaf).ravel() for layer in out for leaf in layer])

    def _factors(self, inputs, params, k):
        from ..peers import nets

        _, st = self._state(inputs, params)
        return nets.block_diag([np.asarray(bs.factors[k].value) for bs in st.blocks_states])

    @implements("networks.kfac_input_factors")
    def input_factors(self, inputs, params):
        return self._factors(inputs, params, 0)

    @implements("networks.kfac_output_factors")
    def output_factors(self, inputs, params):
        return self._factors(inputs, params, 1)

    # -- losses (kfac_jax loss_functions; per example, weight included) ---------------------
    @staticmethod
    def _loss(inputs, params):
        import jax.numpy as jnp
        import kfac_jax

        kind, w = params["loss"], float(params.get("weight", 1.0))
        t = inputs.get("targets")
        t = None if t is None else jnp.asarray(t)
        if kind == "categorical":
            mask = jnp.asarray(inputs["mask"]) if "mask" in inputs else None
            return kfac_jax.CategoricalLogitsNegativeLogProbLoss(
                jnp.asarray(inputs["logits"]), t, mask=mask, weight=w
            )
        if kind == "onehot_categorical":
            return kfac_jax.OneHotCategoricalLogitsNegativeLogProbLoss(
                jnp.asarray(inputs["logits"]), t, weight=w
            )
        if kind == "multi_bernoulli":
            return kfac_jax.MultiBernoulliNegativeLogProbLoss(
                jnp.asarray(inputs["logits"]), t, weight=w
            )
        if kind == "normal_mean":
            return kfac_jax.NormalMeanNegativeLogProbLoss(
                jnp.asarray(inputs["mean"]), t, variance=float(params["variance"]), weight=w
            )
        if kind == "normal_mean_variance":
            return kfac_jax.NormalMeanVarianceNegativeLogProbLoss(
                jnp.asarray(inputs["mean"]), jnp.asarray(inputs["variance"]), t, weight=w
            )
        raise NotImplementedError(kind)

    @implements("losses.gradient")
    def loss_gradient(self, inputs, params):
        loss = self._loss(inputs, params)
        grads = loss.grad_of_evaluate(None, "regular")
        return np.concatenate([np.asarray(g) for g in grads], axis=-1)

    @implements("losses.fisher")
    def loss_fisher(self, inputs, params):
        import jax.numpy as jnp

        from ..peers import nets

        loss = self._loss(inputs, params)
        deps = [np.asarray(d) for d in loss.parameter_dependants]
        n = deps[0].shape[0]
        sizes = [d.shape[-1] for d in deps]
        big_d = sum(sizes)
        cols = []
        for j in range(big_d):  # column j of every example's Fisher at once
            vec = tuple(jnp.asarray(v) for v in nets.unit_inputs(sizes, n, j))
            out = loss.multiply_fisher(vec)
            cols.append(np.concatenate([np.asarray(o) for o in out], axis=-1))
        return np.stack(cols, axis=-1)  # [N, D, D]

    @implements("losses.hessian")
    def loss_hessian(self, inputs, params):
        import jax
        import jax.numpy as jnp

        loss = self._loss(inputs, params)
        deps = tuple(jnp.asarray(d) for d in loss.parameter_dependants)
        sizes = [d.shape[-1] for d in deps]

        def total(flat):
            parts, off = [], 0
            for sz in sizes:
                parts.append(flat[:, off : off + sz])
                off += sz
            return jnp.sum(loss.copy_with_different_inputs(tuple(parts)).evaluate(None, "regular"))

        flat = jnp.concatenate(deps, axis=-1)
        h = np.asarray(jax.hessian(total)(flat))  # [N, D, N, D]
        idx = np.arange(flat.shape[0])
        return h[idx, :, idx, :]  # per-example diagonal blocks [N, D, D]

    @implements("averaging.ema")
    def ema(self, inputs, params):
        import jax.numpy as jnp
        from kfac_jax._src.utils import WeightedMovingAverage

        xs = np.asarray(inputs["xs"])
        avg = WeightedMovingAverage.zeros_array(xs.shape[1:], jnp.float64)
        out = []
        for x in xs:
            avg.update(jnp.asarray(x), float(params["decay"]), float(params["weight"]))
            out.append(np.asarray(avg.value))
        return np.stack(out)
