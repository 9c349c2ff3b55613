"""TNT (Ren & Goldfarb 2021): kfac-jax's ``DenseTNT`` against kfac_ref's
:class:`kfac_ref.blocks.kfac_jax.DenseTNT` on one float64 dense layer.

Run inside the ``jax`` peer environment (recipe ``jax.txt``), from the repository root::

    python -m conformance.peers.tnt_check

One dense layer ``f = x W + b`` under squared error (kfac-jax weight 0.5), the empirical
Fisher (``estimation_mode="fisher_empirical"``), one update with ``ema_old=0, ema_new=1``.
kfac-jax's back-propagated vector is the per-example output gradient times a constant
:math:`c`; :math:`c^2` is read off kfac-jax's own K-FAC block on the same problem
(:math:`G_{\\text{kfac-jax}} = c^2 G`) and kfac_ref's ``DenseTNT`` is fed :math:`c\\,g_n`.
Compared: both factors, the scale :math:`(\\operatorname{tr}A\\operatorname{tr}G)^{-1/2}`, the
dense block and the π-damped inverse product (power −1, ``identity_weight`` 0.1).
"""

from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import kfac_jax  # noqa: E402
import numpy as np  # noqa: E402
from kfac_jax._src.curvature_blocks import tnt as kj_tnt  # noqa: E402
from kfac_jax._src.curvature_blocks.kronecker_factored import (  # noqa: E402
    DenseTwoKroneckerFactored as KjDense,
)

from kfac_ref.blocks import kfac_jax as kj  # noqa: E402

TOL = 1e-12  # float64 GEMMs of length ≤ 16 on O(1) data


def _loss(params, batch):
    x, y = batch
    w, b = params
    f = kfac_jax.register_dense(x @ w + b, x, w, b)
    kfac_jax.register_squared_error_loss(f, y, weight=0.5)
    return 0.5 * jnp.sum((f - y) ** 2) / x.shape[0]


def _estimator(ctor, params, batch, n):
    est = kfac_jax.BlockDiagonalCurvature(_loss, auto_register_tags=False,
                                          layer_tag_to_block_ctor={"dense": ctor})
    rng = jax.random.PRNGKey(0)
    st = est.init(rng, (params, batch), exact_powers_to_cache=None, approx_powers_to_cache=None)
    st = est.update_curvature_matrix_estimate(
        st, ema_old=0.0, ema_new=1.0, identity_weight=0.0, batch_size=n, rng=rng,
        func_args=(params, batch), estimation_mode="fisher_empirical")
    return est, st


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def main():
    rng = np.random.default_rng(31)
    n, d, c = 8, 3, 2
    x = rng.standard_normal((n, d))
    y = rng.standard_normal((n, c))
    w, b = rng.standard_normal((d, c)) / np.sqrt(d), 0.3 * rng.standard_normal(c)
    g = x @ w + b - y  # per-example output gradient of ½‖f − y‖²
    params = [jnp.asarray(w), jnp.asarray(b)]
    batch = (jnp.asarray(x), jnp.asarray(y))

    _, st_k = _estimator(KjDense, params, batch, n)
    c2 = float(np.asarray(st_k.blocks_states[0].factors[1].value)[0, 0] / (g.T @ g / n)[0, 0])
    est, st = _estimator(kj_tnt.DenseTNT, params, batch, n)
    ref = kj.DenseTNT(d, c)
    rst = ref.init(np.zeros(1))
    rst = ref.update_curvature_matrix_estimate(
        rst, {"inputs": x, "outputs_grad": np.sqrt(c2) * g}, 0.0, 1.0, n)

    rows = []
    peer = st.blocks_states[0]
    block = est.blocks[0]
    for i, name in enumerate(("A", "G")):
        rows.append((f"factor {name}", _rel(peer.factors[i].value, rst.statistics[i].value)))
    rows.append(("scale", _rel(block.scale(peer, False), ref.scale(rst))))
    dense = est.to_diagonal_block_dense_matrix(st)[0]
    # kfac-jax orders the flat vector as its parameter list [W, b]: kfac_ref's [W; b] too
    rows.append(("dense block", _rel(dense, ref.to_dense_matrix(rst))))
    v = rng.standard_normal((d, c)), rng.standard_normal(c)
    peer_inv = block.multiply_matpower(peer, (jnp.asarray(v[0]), jnp.asarray(v[1])), 0.1,
                                       -1, False, False)
    ref_inv = ref.multiply_matpower(rst, v, 0.1, -1.0, False, False)
    rows.append(("π-damped inverse product",
                 _rel(np.concatenate([np.ravel(p) for p in peer_inv]),
                      np.concatenate([np.ravel(p) for p in ref_inv]))))
    print(f"kfac-jax {kfac_jax.__version__}, jax {jax.__version__}; c² = {c2:.6g} "
          f"(1/N = {1 / n:.6g})")
    ok = True
    for name, err in rows:
        verdict = "agree" if err <= TOL else "DISAGREE"
        ok &= err <= TOL
        print(f"{verdict:9s} DenseTNT {name}: max rel. error {err:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
