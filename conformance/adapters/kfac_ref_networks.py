"""kfac_ref's implementation of the network, sampling and estimator capabilities, mixed into
the kfac_ref adapters.

The catalogue computes each case's expected matrix with kfac_ref too, so the self-check
would be an echo if the adapter called the same code.  It takes another public route
instead:

* an exact curvature (``networks.ggn``, ``networks.empirical_fisher``) is assembled column
  by column from the matrix-free products (:func:`kfac_ref.curvature.ggn_vector_product`,
  :func:`kfac_ref.curvature.empirical_fisher_vector_product`: a Jacobian-vector pass, the
  loss's product, a backward pass) where the expected value is the dense
  :func:`~kfac_ref.curvature.ggn_matrix` (per-example Jacobians);
* a block-diagonal estimate (``networks.kfac``, ``sampling.kfac`` with the case's draws,
  ``estimator.*``) is read
  column by column from the estimator's product
  :meth:`~kfac_ref.curvature.BlockDiagonalCurvature.multiply_matpower` with power
  1 and no damping, where the expected value is its dense
  :meth:`~kfac_ref.curvature.BlockDiagonalCurvature.to_dense_matrix`;
* an exactly damped inverse product (``networks.kfac_inverse_matvec`` with ``exact``) is a
  dense solve with each block's matrix, where the expected value is the estimator's
  eigendecomposition route.

Only the case decoders of the catalogue are shared (the portable network description to a
:class:`kfac_ref.nn.Sequential`, its parameters and loss).  The module defines no adapter of
its own; it needs the host adapter's ``to_backend`` and ``to_numpy``.
"""

from __future__ import annotations

import numpy as np

from ..adapter import implements
from ..catalogue.networks_cases import build_net, loss_fn, params_from_inputs

__all__ = ["KfacRefNetworksMixin"]


class KfacRefNetworksMixin:
    """``networks.*``, ``sampling.kfac`` and ``estimator.*`` through kfac_ref's public API."""

    # -- plumbing ---------------------------------------------------------------------------
    def _network(self, inputs, params, x="x", targets="targets"):
        spec = params["net"]
        theta = params_from_inputs(spec, inputs, self.to_backend)
        batch = (self.to_backend(inputs[x]), self.to_backend(inputs[targets]))
        return build_net(spec), theta, batch

    def _columns(self, product, size):
        """The [size, size] matrix whose column i is ``product(e_i)`` (on the host)."""
        eye = np.eye(size)
        return np.stack([self.to_numpy(product(self.to_backend(eye[i])))
                         for i in range(size)], axis=1)

    def _estimate(self, net, loss, theta, batches, mode, rng=None, decays=(0.0,),
                  **estimator_options):
        """An estimator and its state after one update per batch (EMA decays given)."""
        from kfac_ref.curvature import BlockDiagonalCurvature

        est = BlockDiagonalCurvature(net, loss, **estimator_options)
        rng = np.random.default_rng(0) if rng is None else rng  # unused by exact modes
        st = est.init(rng, (theta, batches[0]))
        for batch, decay in zip(batches, decays, strict=True):
            st = est.update_curvature_matrix_estimate(st, decay, 1.0, int(batch[0].shape[0]),
                                                      rng, (theta, batch), mode)
        return est, st

    def _estimate_columns(self, est, st):
        return self._columns(
            lambda e: est.multiply_matpower(st, e, 0.0, 1.0, True, False), est.net.num_params)

    # -- exact curvature ---------------------------------------------------------------------
    @implements("networks.ggn")
    def net_ggn(self, inputs, params):
        from kfac_ref import curvature

        net, theta, batch = self._network(inputs, params)
        return self._columns(lambda e: curvature.ggn_vector_product(
            net, loss_fn(params), theta, batch, e), net.num_params)

    @implements("networks.empirical_fisher")
    def net_ef(self, inputs, params):
        from kfac_ref import curvature

        net, theta, batch = self._network(inputs, params)
        return self._columns(lambda e: curvature.empirical_fisher_vector_product(
            net, loss_fn(params), theta, batch, e), net.num_params)

    # -- K-FAC of a network ------------------------------------------------------------------
    def _kfac(self, inputs, params):
        net, theta, batch = self._network(inputs, params)
        return self._estimate(net, loss_fn(params), theta, [batch], params["mode"],
                              weight_sharing=params.get("weight_sharing", "expand"))

    @implements("networks.kfac")
    def net_kfac(self, inputs, params):
        return self._estimate_columns(*self._kfac(inputs, params))

    def _factors(self, inputs, params, k):
        _, st = self._kfac(inputs, params)
        mats = [self.to_numpy(bs.factors[k].value) for bs in st.blocks_states]
        out, o = np.zeros((sum(m.shape[0] for m in mats),) * 2), 0
        for m in mats:
            out[o:o + m.shape[0], o:o + m.shape[0]] = m
            o += m.shape[0]
        return out

    @implements("networks.kfac_input_factors")
    def net_kfac_a(self, inputs, params):
        return self._factors(inputs, params, 0)

    @implements("networks.kfac_output_factors")
    def net_kfac_g(self, inputs, params):
        return self._factors(inputs, params, 1)

    @implements("networks.kfac_inverse_matvec")
    def net_kfac_inverse(self, inputs, params):
        est, st = self._kfac(inputs, params)
        if not params["exact"]:  # factored (π) damping: the estimator's own product
            return self.to_numpy(est.multiply_matpower(
                st, self.to_backend(inputs["v"]), params["damping"], -1.0, False, False))
        # exact damping: (C_l + λI)⁻¹ v_l by a dense solve with each block's matrix
        v, out, o = np.asarray(inputs["v"], dtype=np.float64), [], 0
        for block in est.to_diagonal_block_dense_matrix(st):
            c = self.to_numpy(block)
            out.append(np.linalg.solve(c + params["damping"] * np.eye(len(c)), v[o:o + len(c)]))
            o += len(c)
        return np.concatenate(out)

    # -- sampling ----------------------------------------------------------------------------
    @implements("sampling.kfac")
    def sampling_kfac(self, inputs, params):
        if "seed" in params:
            # the statistical route (kfac_ref's own draws, called once per seed): the
            # expected value is the exact Fisher's K-FAC, not this code's, so the dense
            # matrix is read directly
            net, theta, batch = self._network(inputs, params)
            est, st = self._estimate(net, loss_fn(params), theta, [batch], params["mode"],
                                     rng=np.random.default_rng(params["seed"]))
            return self.to_numpy(est.to_dense_matrix(st))
        from kfac_ref import losses

        from ..catalogue.sampling_cases import output_vectors

        # the case's draws u: K-FAC of the empirical Fisher of ½‖f − y‖² at y = f − u
        net, theta, f, u = output_vectors(params, inputs, self.to_backend)
        est, st = self._estimate(
            net, lambda out, y: losses.NormalMeanNegativeLogProbLoss(out, y, variance=1.0),
            theta, [(self.to_backend(inputs["x"]), f - u)], "fisher_empirical")
        return self._estimate_columns(est, st)

    # -- estimator ---------------------------------------------------------------------------
    @implements("estimator.full_blocks")
    def est_full_blocks(self, inputs, params):
        from kfac_ref.blocks import kfac_jax

        net, theta, batch = self._network(inputs, params)
        return self._estimate_columns(*self._estimate(
            net, loss_fn(params), theta, [batch], params["mode"],
            layer_to_block={"dense": getattr(kfac_jax, params["block"])}))

    @implements("estimator.kfac_ema")
    def est_kfac_ema(self, inputs, params):
        net, theta, first = self._network(inputs, params, "x0", "targets0")
        second = (self.to_backend(inputs["x1"]), self.to_backend(inputs["targets1"]))
        return self._estimate_columns(*self._estimate(
            net, loss_fn(params), theta, [first, second], params["mode"],
            decays=(0.0, params["decay"])))
