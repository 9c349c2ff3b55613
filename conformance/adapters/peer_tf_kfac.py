"""TensorFlow K-FAC (PyPI ``kfac`` 0.2.4) as an implementation under test.

Environment: ``conformance/peers/tf.txt`` (its own venv).  Findings and reproductions:
``conformance/peers/FINDINGS.md``, ``repro_tf_kfac.py``.

Mapping (graph mode, ``tf.compat.v1``): the portable network spec becomes a TF graph with
``LayerCollection.register_fully_connected`` / ``register_conv2d`` (NHWC, HWIO, explicit
padding via ``tf.pad`` + "VALID", so any padding maps) and the loss
``register_softmax_cross_entropy_loss`` or ``register_normal_predictive_distribution(var=v)``;
one covariance update of ``FisherEstimatorRoundRobin`` (zero-debiased EMA: the factors equal
the batch statistics) with ``estimation_mode`` "exact" (``ggn_exact``/``fisher_exact``: the
Fisher equals the GGN for these losses) or "empirical".  Blocks from
``full_fisher_block()``, factors from ``_input_factor.cov`` / ``_output_factor.cov``.
Factors: ``FullyConnectedKroneckerFactor`` / ``FullyConnectedMultiKF`` (also ``cov_dt1``),
``ConvInputKroneckerFactor`` / ``ConvOutputKroneckerFactor`` after one covariance update
(NCHW inputs transposed and explicit padding pre-applied here); ``utils.MovingAverageVariable``
for ``averaging.ema``.  Linear algebra: ``fisher_factors.compute_cov`` and ``append_homog``,
``fisher_blocks.compute_pi_tracenorm`` / ``compute_pi_adjusted_damping``.

Declared conventions: the canonical ones (the reference uses TF's layouts).
Damping, EMA decay and weight are passed as float64 tensors, so TF's float32 cast of
Python-float hyper-parameters (1.2e-8 relative with a Python-float damping, measured in
``repro_tf_kfac.py``) does not apply and ``hyperparameter_rtol`` stays 0.
"""

from __future__ import annotations

import numpy as np

from ..adapter import AdapterUnavailable, CaseUnsupported, implements
from ..conventions import Conventions
from ._peer import PeerAdapter

ADAPTERS = {"tf_kfac": "conformance.adapters.peer_tf_kfac:TfKfacAdapter"}

_IMPLEMENTED = (
    "losses.fisher",
    "losses.gradient",
    "losses.hessian",
    "averaging.ema",
    "factors.dense_input",
    "factors.dense_output",
    "factors.conv_input",
    "factors.conv_output",
    "factors.series_cov_dt1",
    "networks.kfac_inverse_matvec",
    "networks.kfac",
    "networks.kfac_input_factors",
    "networks.kfac_output_factors",
    "linalg.compute_cov",
    "linalg.cross_cov",
    "linalg.homog_cov",
    "linalg.pi_tracenorm",
    "linalg.pi_adjusted_damping",
)
_REASONS = {
    "losses.sample": "TF K-FAC's loss sample() draws from TF random ops (statistical route only); "
    "not mapped yet",
    "losses.fisher_factor": "TF K-FAC's multiply_fisher_factor is not mapped yet",
    "losses.fisher_factor_transpose": "TF K-FAC's multiply_fisher_factor_transpose is not mapped "
    "yet",
    "losses.ggn_factor": "TF K-FAC's multiply_hessian_factor is not mapped yet",
    "blocks.kron_cached_inverse": "TF K-FAC's inverse update ops (stale inverses between updates) "
    "are not mapped yet",
    "estimator.full_blocks": "TF K-FAC's NaiveFullFB / NaiveDiagonalFB are not mapped yet",
    "sampling": "TF K-FAC's sampling estimation modes ('gradients' with sampled targets, "
    "'curvature_prop') are not mapped yet: they draw from TF's random ops, so only the "
    "statistical route (params['seed'] → tf.random.set_seed) would apply",
    "networks": "TF K-FAC has no exact GGN / empirical-Fisher matrix function",
    "linalg": "not mapped (TF's factor-level damped powers need a registered FisherFactor; "
    "checked end to end in repro_tf_kfac.py)",
    "factors": "not mapped yet (TF's FullyConnectedDiagonalFactor, ConvDiagonalFactor, "
    "EmbeddingInputKroneckerFactor and NaiveDiagonalFactor exist; future work)",
    "blocks": "not mapped yet (blocks are checked through repro_tf_kfac.py multiply_inverse)",
    "averaging": "not mapped yet",
    "estimator": "not mapped yet",
}


def _sess_run(build):
    import tensorflow as tf

    g = tf.Graph()
    with g.as_default():
        fetch = build()
        with tf.compat.v1.Session(graph=g) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return fetch(sess)


class TfKfacAdapter(PeerAdapter):
    name = "tf_kfac"
    description = "TensorFlow K-FAC LayerCollection + FisherEstimator (graph mode)"
    conventions = Conventions()
    IMPLEMENTED, REASONS = _IMPLEMENTED, _REASONS
    DISTRIBUTIONS = ("kfac", "tensorflow-cpu")

    def setup(self):
        try:
            import os

            os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            import kfac  # noqa: F401
            import tensorflow as tf

            tf.compat.v1.disable_eager_execution()
        except ImportError as exc:
            raise AdapterUnavailable(
                f"TF K-FAC is not installed ({exc}); see conformance/peers/tf.txt"
            ) from exc

    # -- networks -----------------------------------------------------------------------------
    def _network(self, inputs, params, fetch_kind, damping=1e-3):
        import kfac
        import tensorflow as tf

        from ..peers import nets

        spec = params["net"]
        if np.ndim(inputs["x"]) == 3:
            raise CaseUnsupported(
                "weight-shared dense layers need register_fully_connected_multi; not mapped"
            )
        tf1 = tf.compat.v1

        def build():
            cur = tf.constant(np.asarray(inputs["x"], dtype=np.float64))
            lc = kfac.LayerCollection()
            variables, keys = [], []
            for i, s in enumerate(spec):
                k = s["kind"]
                if k in ("dense", "conv2d"):
                    w = tf1.get_variable(f"w{i}", initializer=tf.constant(inputs[f"w{i}"]))
                    b = (
                        tf1.get_variable(f"b{i}", initializer=tf.constant(inputs[f"b{i}"]))
                        if s["bias"]
                        else None
                    )
                    key = (w, b) if b is not None else w
                    if k == "dense":
                        out = tf.matmul(cur, w) + (b if b is not None else 0.0)
                        lc.register_fully_connected(key, cur, out)
                    else:
                        (pt, pb), (pl, pr) = nets.conv_pads(s, tuple(cur.shape[1:3]))
                        xin = tf.pad(cur, [[0, 0], [pt, pb], [pl, pr], [0, 0]])
                        st = [1, *nets._pair(s["stride"]), 1]
                        dl = [1, *nets._pair(s["dilation"]), 1]
                        out = tf.nn.conv2d(xin, w, strides=st, padding="VALID", dilations=dl)
                        out = out + (b if b is not None else 0.0)
                        lc.register_conv2d(key, st, "VALID", xin, out, dilations=dl)
                    variables += [w] + ([b] if b is not None else [])
                    keys.append(key)
                    cur = out
                elif k == "activation":
                    cur = tf.tanh(cur)
                elif k == "mean_pool":
                    cur = tf.reduce_mean(cur, axis=[1, 2] if cur.shape.ndims == 4 else [1])
                elif k == "flatten":
                    cur = tf.reshape(cur, [cur.shape[0], -1])
            t = np.asarray(inputs["targets"])
            if params["loss"] == "categorical":
                lc.register_softmax_cross_entropy_loss(cur, targets=tf.constant(t.astype(np.int64)))
            else:
                lc.register_normal_predictive_distribution(
                    cur, var=float(params["variance"]), targets=tf.constant(t)
                )
            mode = "empirical" if params["mode"] == "fisher_empirical" else "exact"
            est = kfac.estimator.FisherEstimatorRoundRobin(
                variables=variables,
                cov_ema_decay=0.95,
                damping=tf.constant(float(damping), tf.float64),
                layer_collection=lc,
                estimation_mode=mode,
            )
            cov_thunks, inv_thunks = est.make_vars_and_create_op_thunks()
            cov_ops = [th() for th in cov_thunks]
            inv_ops = [th() for th in inv_thunks]
            blocks = [lc.fisher_blocks[k] for k in keys]
            if fetch_kind == "inverse":
                v = np.asarray(inputs["v"])
                vecs, off = [], 0
                for var in variables:
                    shape = tuple(var.shape)
                    size = int(np.prod(shape))
                    vecs.append(tf.constant(v[off : off + size].reshape(shape)))
                    off += size
                fetches = [
                    u for u, _ in est.multiply_inverse(list(zip(vecs, variables, strict=True)))
                ]
            elif fetch_kind == "kfac":
                fetches = [b.full_fisher_block() for b in blocks]
            elif fetch_kind == "input":
                fetches = [b._input_factor.cov for b in blocks]
            else:
                fetches = [b._output_factor.cov for b in blocks]

            def run(sess):
                sess.run(cov_ops)
                sess.run(inv_ops)
                return [np.asarray(m) for m in sess.run(fetches)]

            return run

        out = _sess_run(build)
        if fetch_kind == "inverse":
            return np.concatenate([m.ravel() for m in out])
        return nets.block_diag(out)

    @implements("networks.kfac_inverse_matvec")
    def inverse_matvec(self, inputs, params):
        if params["exact"]:
            raise CaseUnsupported(
                "TF K-FAC damps each factor (π split); it has no exact damping (A⊗G + λI)⁻¹"
            )
        return self._network(inputs, params, "inverse", damping=params["damping"])

    @implements("networks.kfac")
    def kfac(self, inputs, params):
        return self._network(inputs, params, "kfac")

    @implements("networks.kfac_input_factors")
    def input_factors(self, inputs, params):
        return self._network(inputs, params, "input")

    @implements("networks.kfac_output_factors")
    def output_factors(self, inputs, params):
        return self._network(inputs, params, "output")

    # -- factors (one covariance update of a FisherFactor; zero-debiased, so the value is the
    # batch statistic) -----------------------------------------------------------------------
    def _factor(self, make, cov_dt1=False):
        def build():
            fac = make()
            if cov_dt1:
                fac.register_cov_dt1()
            fac.instantiate_cov_variables()
            op = fac.make_covariance_update_op(0.5, 1.0)
            val = fac.cov_dt1 if cov_dt1 else fac.cov

            def run(sess):
                sess.run(op)
                return np.asarray(sess.run(val))

            return run

        return _sess_run(build)

    @staticmethod
    def _fold(x):
        """[T, N, d] -> ([T·N, d], T) for TF's multi-use factors (time-major fold)."""
        x = np.asarray(x)
        if x.ndim == 3:
            return x.reshape(-1, x.shape[-1]), x.shape[0]
        return x, None

    @implements("factors.dense_input")
    def dense_input(self, inputs, params):
        import tensorflow as tf
        from kfac.python.ops import fisher_factors as ff

        a, uses = self._fold(inputs["a"])
        if uses is None:
            return self._factor(
                lambda: ff.FullyConnectedKroneckerFactor(
                    ((tf.constant(a),),), has_bias=bool(params["has_bias"])
                )
            )
        return self._factor(
            lambda: ff.FullyConnectedMultiKF(
                ((tf.constant(a),),), num_uses=uses, has_bias=bool(params["has_bias"])
            )
        )

    @implements("factors.dense_output")
    def dense_output(self, inputs, params):
        import tensorflow as tf
        from kfac.python.ops import fisher_factors as ff

        g, uses = self._fold(inputs["g"])
        if uses is None:
            return self._factor(lambda: ff.FullyConnectedKroneckerFactor(((tf.constant(g),),)))
        return self._factor(lambda: ff.FullyConnectedMultiKF(((tf.constant(g),),), num_uses=uses))

    @implements("factors.series_cov_dt1")
    def series_cov_dt1(self, inputs, params):
        import tensorflow as tf
        from kfac.python.ops import fisher_factors as ff

        x, uses = self._fold(inputs["x"])
        return self._factor(
            lambda: ff.FullyConnectedMultiKF(
                ((tf.constant(x),),),
                num_uses=int(params["num_uses"]),
                has_bias=bool(params["has_bias"]),
            ),
            cov_dt1=True,
        )

    @staticmethod
    def _nhwc(x, data_format):
        x = np.asarray(x)
        return np.transpose(x, (0, 2, 3, 1)) if str(data_format).upper() == "NCHW" else x

    @implements("factors.conv_input")
    def conv_input(self, inputs, params):
        import tensorflow as tf
        from kfac.python.ops import fisher_factors as ff

        # NCHW inputs are transposed here and explicit padding becomes a zero pad + "VALID"
        # (API mappings: TF's patch extraction is channels-last with string paddings)
        x = self._nhwc(inputs["x"], params.get("data_format", "NHWC"))
        pad = params["padding"]
        if not isinstance(pad, str):
            x = np.pad(x, ((0, 0), tuple(pad[0]), tuple(pad[1]), (0, 0)))
            pad = "VALID"
        st = list(params["strides"])  # spatial: the default patch extractor follows
        dl = list(params["dilation"])  # tf.nn.convolution's conventions
        return self._factor(
            lambda: ff.ConvInputKroneckerFactor(
                (tf.constant(x),),
                filter_shape=tuple(params["filter_shape"]),
                padding=pad,
                strides=st,
                dilation_rate=dl,
                data_format="NHWC",
                has_bias=bool(params["has_bias"]),
            )
        )

    @implements("factors.conv_output")
    def conv_output(self, inputs, params):
        import tensorflow as tf
        from kfac.python.ops import fisher_factors as ff

        g = self._nhwc(inputs["g"], params.get("data_format", "NHWC"))
        return self._factor(
            lambda: ff.ConvOutputKroneckerFactor(((tf.constant(g),),), data_format="NHWC")
        )

    # -- losses (kfac.loss_functions; per example; TF 0.2.4 loss objects carry no weight or
    # mask — the coefficient lives in LayerCollection — so weighted/masked cases are skipped
    # through skips/tf_kfac.txt) ------------------------------------------------------------
    @staticmethod
    def _tf_loss(inputs, params):
        import tensorflow as tf
        from kfac.python.ops import loss_functions as lf

        if float(params.get("weight", 1.0)) != 1.0 or "mask" in inputs:
            raise CaseUnsupported("TF 0.2.4 loss objects have no weight or mask")
        kind = params["loss"]
        t = inputs.get("targets")
        t = None if t is None else tf.constant(t)
        if kind == "categorical":
            return lf.CategoricalLogitsNegativeLogProbLoss(tf.constant(inputs["logits"]), t)
        if kind == "onehot_categorical":
            return lf.OnehotCategoricalLogitsNegativeLogProbLoss(tf.constant(inputs["logits"]), t)
        if kind == "multi_bernoulli":
            return lf.MultiBernoulliNegativeLogProbLoss(tf.constant(inputs["logits"]), t)
        if kind == "normal_mean":
            return lf.NormalMeanNegativeLogProbLoss(
                tf.constant(inputs["mean"]), var=float(params["variance"]), targets=t
            )
        if kind == "normal_mean_variance":
            return lf.NormalMeanVarianceNegativeLogProbLoss(
                tf.constant(inputs["mean"]), tf.constant(inputs["variance"]), t
            )
        raise NotImplementedError(kind)

    @staticmethod
    def _as_list(x):
        return list(x) if isinstance(x, (list, tuple)) else [x]

    def _loss_run(self, inputs, params, what):
        import tensorflow as tf

        from ..peers import nets

        def build():
            loss = self._tf_loss(inputs, params)
            ins = self._as_list(loss.inputs)
            sizes = [int(t.shape[-1]) for t in ins]
            n = int(ins[0].shape[0])
            if what == "gradient":
                out = tf.concat(tf.gradients(loss.evaluate(), ins), axis=-1)
            elif what == "fisher":
                cols = []
                for j in range(sum(sizes)):
                    vec = [tf.constant(v) for v in nets.unit_inputs(sizes, n, j)]
                    res = loss.multiply_fisher(vec if len(vec) > 1 else vec[0])
                    cols.append(tf.concat(self._as_list(res), axis=-1))
                out = tf.stack(cols, axis=-1)
            else:  # per-example Hessian: columns of d(grad)/d(input), the loss being a sum
                grad = tf.concat(tf.gradients(loss.evaluate(), ins), axis=-1)
                cols = [
                    tf.concat(tf.gradients(tf.reduce_sum(grad[:, j]), ins), axis=-1)
                    for j in range(sum(sizes))
                ]
                out = tf.stack(cols, axis=-1)
            return lambda sess: np.asarray(sess.run(out))

        return _sess_run(build)

    @implements("losses.gradient")
    def loss_gradient(self, inputs, params):
        return self._loss_run(inputs, params, "gradient")

    @implements("losses.fisher")
    def loss_fisher(self, inputs, params):
        return self._loss_run(inputs, params, "fisher")

    @implements("losses.hessian")
    def loss_hessian(self, inputs, params):
        return self._loss_run(inputs, params, "hessian")

    # -- averaging --------------------------------------------------------------------------
    @implements("averaging.ema")
    def ema(self, inputs, params):
        import tensorflow as tf
        from kfac.python.ops import utils

        xs = np.asarray(inputs["xs"])

        def build():
            avg = utils.MovingAverageVariable("ema", xs.shape[1:], tf.float64, normalize_value=True)
            x_in = tf.compat.v1.placeholder(tf.float64, xs.shape[1:])
            # decay and weight as float64 tensors: Python floats would pass through float32
            op = avg.add_to_average(
                x_in,
                decay=tf.constant(float(params["decay"]), tf.float64),
                weight=tf.constant(float(params["weight"]), tf.float64),
            )

            def run(sess):
                out = []
                for x in xs:
                    sess.run(op, {x_in: x})
                    out.append(np.asarray(sess.run(avg.value)))
                return np.stack(out)

            return run

        return _sess_run(build)

    # -- linalg -------------------------------------------------------------------------------
    def _run(self, make):
        return _sess_run(lambda: lambda sess: sess.run(make()))

    @implements("linalg.compute_cov")
    def compute_cov(self, inputs, params):
        import tensorflow as tf
        from kfac.python.ops.fisher_factors import compute_cov

        return self._run(lambda: compute_cov(tf.constant(inputs["x"])))

    @implements("linalg.cross_cov")
    def cross_cov(self, inputs, params):
        import tensorflow as tf
        from kfac.python.ops.fisher_factors import compute_cov

        return self._run(
            lambda: compute_cov(tf.constant(inputs["x"]), tensor_right=tf.constant(inputs["y"]))
        )

    @implements("linalg.homog_cov")
    def homog_cov(self, inputs, params):
        import tensorflow as tf
        from kfac.python.ops.fisher_factors import append_homog, compute_cov

        return self._run(lambda: compute_cov(append_homog(tf.constant(inputs["a"]))))

    @implements("linalg.pi_tracenorm")
    def pi_tracenorm(self, inputs, params):
        import tensorflow as tf
        from kfac.python.ops import linear_operator as lo
        from kfac.python.ops.fisher_blocks import compute_pi_tracenorm

        def make():
            a = lo.LinearOperatorFullMatrix(tf.constant(inputs["a"]))
            g = lo.LinearOperatorFullMatrix(tf.constant(inputs["g"]))
            return compute_pi_tracenorm(a, g)

        return np.asarray(self._run(make))

    @implements("linalg.pi_adjusted_damping")
    def pi_adjusted_damping(self, inputs, params):
        import tensorflow as tf
        from kfac.python.ops import linear_operator as lo
        from kfac.python.ops.fisher_blocks import compute_pi_adjusted_damping

        def make():
            a = lo.LinearOperatorFullMatrix(tf.constant(inputs["a"]))
            g = lo.LinearOperatorFullMatrix(tf.constant(inputs["g"]))
            # TF's callers pass √λ (fisher_blocks._setup_damping: damping**0.5) and get
            # (π√λ, √λ/π); this maps the API, it is not a convention
            return compute_pi_adjusted_damping(
                a, g, tf.constant(float(params["damping"]) ** 0.5, tf.float64)
            )

        return np.asarray(self._run(make), dtype=np.float64)
