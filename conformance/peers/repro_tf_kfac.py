"""Reproduction: TensorFlow K-FAC (PyPI ``kfac`` 0.2.4 on tensorflow-cpu 2.21) against kfac_ref.

Run inside the ``tf`` peer environment (recipe ``tf.txt``), from the repository root::

    python -m conformance.peers.repro_tf_kfac [--json out.json]

Graph mode (``tf.compat.v1``).  Layers registered with ``LayerCollection.register_fully_connected``
/ ``register_conv2d`` (kernels [in, out] / HWIO, so the block is ``kron(A, G)`` with the bias
row last — the reference's canonical layout), losses with ``register_squared_error_loss(coeff=
0.5)`` (½‖f−y‖²) or ``register_softmax_cross_entropy_loss``; one covariance update through
``FisherEstimatorRoundRobin`` (zero-debiased EMA: after one update the factor is the batch
statistic), then the inverse updates and ``multiply_inverse``.  Damping is passed as a float64
tensor (a Python float goes through float32).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1
tf1.disable_eager_execution()

import kfac  # noqa: E402

from kfac_ref import linalg as L  # noqa: E402

from . import common as C  # noqa: E402

TOL = 1e-12  # float64 GEMMs on O(1) data (errors ~1e-15); far below any convention's effect
TOL_INV = 1e-10  # damped inverses through eigh/Cholesky, κ ≤ ~1e3 at the damping used
F64 = tf.float64


def _session_run(build):
    g = tf.Graph()
    with g.as_default():
        fetches = build()
        with tf1.Session(graph=g) as sess:
            sess.run(tf1.global_variables_initializer())
            return fetches["run"](sess)


def _estimator(lc, variables, mode, damping, exps=(-1,)):
    est = kfac.estimator.FisherEstimatorRoundRobin(
        variables=variables,
        cov_ema_decay=0.95,
        damping=damping,
        layer_collection=lc,
        exps=exps,
        estimation_mode=mode,
    )
    cov_thunks, inv_thunks = est.make_vars_and_create_op_thunks()
    return est, [t() for t in cov_thunks], [t() for t in inv_thunks]


def mlp_case(
    p, loss, mode, bias, coeff, lam=0.1, vec=None, n_inverse_updates=1, python_damping=False
):
    def build():
        x = tf.constant(p["x"])
        w1 = tf1.get_variable("W1", initializer=tf.constant(p["W1"]))
        w2 = tf1.get_variable("W2", initializer=tf.constant(p["W2"]))
        if bias:
            b1 = tf1.get_variable("b1", initializer=tf.constant(p["b1"]))
            b2 = tf1.get_variable("b2", initializer=tf.constant(p["b2"]))
        s1 = tf.matmul(x, w1) + (b1 if bias else 0.0)
        h = tf.tanh(s1)
        f = tf.matmul(h, w2) + (b2 if bias else 0.0)
        lc = kfac.LayerCollection()
        lc.register_fully_connected((w1, b1) if bias else w1, x, s1)
        lc.register_fully_connected((w2, b2) if bias else w2, h, f)
        if loss == "mse":
            lc.register_squared_error_loss(f, targets=tf.constant(p["y_reg"]), coeff=coeff)
        else:
            lc.register_softmax_cross_entropy_loss(f, targets=tf.constant(p["y_cls"]), coeff=coeff)
        variables = [w1, b1, w2, b2] if bias else [w1, w2]
        est, cov_ops, inv_ops = _estimator(
            lc, variables, mode, lam if python_damping else tf.constant(lam, F64)
        )
        blocks = [
            lc.fisher_blocks[(w1, b1) if bias else w1],
            lc.fisher_blocks[(w2, b2) if bias else w2],
        ]
        facs = [(b._input_factor.cov, b._output_factor.cov) for b in blocks]
        dense = [b.full_fisher_block() for b in blocks]
        vecs = [tf.constant(v) for v in vec] if vec is not None else None
        inv = (
            est.multiply_inverse(list(zip(vecs, variables, strict=False)))
            if vecs is not None
            else None
        )

        def run(sess):
            sess.run(cov_ops)
            for _ in range(n_inverse_updates):
                sess.run(inv_ops)
            out = sess.run({"facs": facs, "dense": dense})
            if inv is not None:
                out["inv"] = sess.run([v for v, _ in inv])
            return out

        return {"run": run}

    return _session_run(build)


def run_mlp(rep):
    p = C.mlp_problem()
    p["x"].shape[0]
    rng = np.random.default_rng(6)
    for bias in (True, False):
        shapes = (
            [p["W1"].shape, p["b1"].shape, p["W2"].shape, p["b2"].shape]
            if bias
            else [p["W1"].shape, p["W2"].shape]
        )
        vec = [rng.standard_normal(s) for s in shapes]
        for loss in ("mse", "ce"):
            for mode, fisher, coeff, conv in (
                ("exact", "type2", 0.5 if loss == "mse" else 1.0, ""),
                ("empirical", "empirical", 0.5 if loss == "mse" else 1.0, ""),
                (
                    "exact",
                    "type2",
                    1.0 if loss == "mse" else 2.0,
                    "coeff scales the curvature linearly",
                ),
                (
                    "empirical",
                    "empirical",
                    1.0 if loss == "mse" else 2.0,
                    "coeff scales the loss: EF ∝ coeff²",
                ),
            ):
                tag = f"mlp {loss} bias={bias} {mode} coeff={coeff}"
                try:
                    out = mlp_case(p, loss, mode, bias, coeff, vec=vec)
                except Exception as exc:  # noqa: BLE001 - a crash is a finding, not a skip
                    rep.check(
                        f"{tag} runs in float64",
                        np.array([0.0]),
                        np.array([1.0]),
                        0,
                        note=f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:150]}",
                    )
                    continue
                ref = C.mlp_reference(p, loss, fisher, bias)
                base = 0.5 if loss == "mse" else 1.0  # coeff that reproduces the reference loss
                c = coeff / base
                g_sc = c if fisher == "type2" else c * c
                for i, ((a, g), (a_ref, g_ref)) in enumerate(zip(out["facs"], ref, strict=False)):
                    rep.check(f"{tag} layer{i + 1} A", a, a_ref, TOL)
                    rep.check(
                        f"{tag} layer{i + 1} G",
                        g,
                        g_sc * g_ref,
                        TOL,
                        conv + (f" (G×{g_sc:g})" if g_sc != 1 else ""),
                    )
                if coeff == base:
                    for i, (d, (a_ref, g_ref)) in enumerate(zip(out["dense"], ref, strict=False)):
                        rep.check(
                            f"{tag} layer{i + 1} full_fisher_block = kron(A, G)",
                            d,
                            np.asarray(L.kron(a_ref, g_ref)),
                            TOL,
                        )
                    exp = []
                    for i, (a_ref, g_ref) in enumerate(ref):
                        m = (
                            np.concatenate([vec[2 * i], vec[2 * i + 1][None]], 0)
                            if bias
                            else vec[i]
                        )
                        r = np.asarray(L.kron_damped_inverse_matvec(a_ref, g_ref, m, 0.1))
                        exp.append(r)
                    got = []
                    for i in range(2):
                        got.append(
                            np.concatenate([out["inv"][2 * i], out["inv"][2 * i + 1][None]], 0)
                            if bias
                            else out["inv"][i]
                        )
                    rep.check(
                        f"{tag} multiply_inverse(λ=0.1) (π-split)",
                        np.concatenate([q.ravel() for q in got]),
                        np.concatenate([q.ravel() for q in exp]),
                        TOL_INV,
                        "factored π-split damping",
                    )
    # Python-float damping passes through float32: measure the error it adds
    loss = "ce"
    vec = [
        rng.standard_normal(s) for s in (p["W1"].shape, p["b1"].shape, p["W2"].shape, p["b2"].shape)
    ]
    ref = C.mlp_reference(p, loss, "type2", True)
    exp = np.concatenate(
        [
            np.asarray(
                L.kron_damped_inverse_matvec(
                    a, g, np.concatenate([vec[2 * i], vec[2 * i + 1][None]], 0), 0.1
                )
            ).ravel()
            for i, (a, g) in enumerate(ref)
        ]
    )
    for py in (False, True):
        out = mlp_case(p, loss, "exact", True, 1.0, lam=0.1, vec=vec, python_damping=py)
        got = np.concatenate(
            [
                np.concatenate([out["inv"][2 * i], out["inv"][2 * i + 1][None]], 0).ravel()
                for i in range(2)
            ]
        )
        err = C.rel_err(got, exp)
        rep.note(
            f"multiply_inverse damping given as {'Python float' if py else 'float64 tensor'}",
            f"rel err vs float64 reference {err:.2e} (float32 rounding of 0.1 is "
            f"{abs(float(np.float32(0.1)) - 0.1) / 0.1:.1e})",
        )
    # The coeff inconsistency in numbers: ratio EF/F as coeff changes (CE)
    rep.note(
        "coeff semantics",
        "exact/gradients/curvature_prop multiply the loss factor by √coeff (F ∝ coeff); "
        "empirical differentiates coeff·ℓ (EF ∝ coeff²) — see rows with coeff=2 (CE)",
    )


def conv_case(p, loss, lam=0.1, vec=None):
    def build():
        x = tf.constant(p["x"])
        k = tf1.get_variable("K", initializer=tf.constant(p["K"]))
        bc = tf1.get_variable("bc", initializer=tf.constant(p["bc"]))
        w = tf1.get_variable("W", initializer=tf.constant(p["W"]))
        b = tf1.get_variable("b", initializer=tf.constant(p["b"]))
        s = tf.nn.conv2d(x, k, strides=[1, 1, 1, 1], padding="VALID") + bc
        h = tf.reshape(tf.tanh(s), [p["x"].shape[0], -1])
        f = tf.matmul(h, w) + b
        lc = kfac.LayerCollection()
        lc.register_conv2d((k, bc), strides=[1, 1, 1, 1], padding="VALID", inputs=x, outputs=s)
        lc.register_fully_connected((w, b), h, f)
        if loss == "mse":
            lc.register_squared_error_loss(f, targets=tf.constant(p["y_reg"]), coeff=0.5)
        else:
            lc.register_softmax_cross_entropy_loss(f, targets=tf.constant(p["y_cls"]))
        variables = [k, bc, w, b]
        est, cov_ops, inv_ops = _estimator(lc, variables, "exact", tf.constant(lam, F64))
        blk = lc.fisher_blocks[(k, bc)]
        facs = (blk._input_factor.cov, blk._output_factor.cov)
        dense = blk.full_fisher_block()
        inv = est.multiply_inverse(
            list(zip([tf.constant(v) for v in vec], variables, strict=False))
        )

        def run(sess):
            sess.run(cov_ops)
            sess.run(inv_ops)
            return sess.run({"facs": facs, "dense": dense, "inv": [v for v, _ in inv]})

        return {"run": run}

    return _session_run(build)


def run_conv(rep):
    p = C.conv_problem()
    rng = np.random.default_rng(3)
    vec = [rng.standard_normal(p[k].shape) for k in ("K", "bc", "W", "b")]
    for loss in ("mse", "ce"):
        out = conv_case(p, loss, vec=vec)
        ref = C.conv_reference(p, loss, "type2", True)
        t = ref["T"]
        a, g = out["facs"]
        rep.check(f"conv {loss} exact conv A (KFC, ÷N|T|)", a, ref["kfc"][0], TOL)
        rep.check(f"conv {loss} exact conv G (KFC, ÷N|T|)", g, ref["kfc"][1], TOL)
        rep.check(
            f"conv {loss} full_fisher_block = |T|·kron(A, G)",
            out["dense"],
            t * np.asarray(L.kron(*ref["kfc"])),
            TOL,
        )
        m = np.concatenate([vec[0].reshape(-1, p["K"].shape[-1]), vec[1][None]], 0)
        exp = np.asarray(L.kron_damped_inverse_matvec(*ref["kfc"], m, 0.1 / t)) / t
        got = np.concatenate([out["inv"][0].reshape(-1, p["K"].shape[-1]), out["inv"][1][None]], 0)
        rep.check(
            f"conv {loss} multiply_inverse(λ=0.1) conv block = [|T|(A⊗G)]_λ^-1",
            got,
            exp,
            TOL_INV,
            "λ/|T| on the factors, π-split",
        )


def run_cov(rep):
    """compute_cov symmetrises; with tensor_right it does not (kfac/python/ops/utils.py)."""
    from kfac.python.ops import utils  # noqa: F401
    from kfac.python.ops.fisher_factors import compute_cov

    rng = np.random.default_rng(13)
    x = rng.standard_normal((7, 4))
    y = rng.standard_normal((7, 3))

    def build():
        c1 = compute_cov(tf.constant(x))
        c2 = compute_cov(tf.constant(x), tensor_right=tf.constant(y))
        return {"run": lambda sess: sess.run([c1, c2])}

    c1, c2 = _session_run(build)
    rep.check("compute_cov(X) = XᵀX/n", c1, np.asarray(L.compute_cov(x)), TOL)
    rep.check("compute_cov(X, Y) = XᵀY/n", c2, np.asarray(L.compute_cov(x, y)), TOL)
    rep.check("compute_cov(X) exactly symmetric", c1 - c1.T, np.zeros_like(c1), 0)


def main(argv=None):
    import importlib.metadata as md

    version = f"kfac {md.version('kfac')}, tensorflow {tf.__version__}"
    C.run_checks(argv, "tf_kfac", version, run_cov, run_mlp, run_conv)


if __name__ == "__main__":
    main()
