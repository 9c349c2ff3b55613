"""Peer rows: a full K-FAC update in kfac_ref against curvlinops and kfac-jax, same process.

A *full update* is what an optimiser pays once per curvature refresh: the Kronecker factors
of one batch (forward and backward passes included), the damped power −1 of every block
(π-split damping, Martens & Grosse 2015, §6.3), and one preconditioned product with the
gradient-shaped vector ``v``:

* kfac_ref: ``update_curvature_matrix_estimate`` → ``update_cache(λ, power −1)`` →
  ``multiply_matpower(v, use_cached=True)``, on the run's array library (``--backend``:
  NumPy, torch tensors, CuPy);
* curvlinops: ``KFACLinearOperator(...).compute_kronecker_factors()`` →
  ``KFACInverseLinearOperator(damping=λ, use_heuristic_damping=True) @ v`` (its Cholesky
  inverses are formed on that first product), on torch tensors on kfac_ref's device
  (:func:`torch_device`: the GPU when kfac_ref's arrays are CUDA tensors or CuPy arrays);
* kfac-jax: the same three estimator calls as kfac_ref under one ``jax.jit`` (compiled
  before timing), on JAX's default backend (its GPU where JAX has one).

Each row records where the peer ran (``peer_on``: ``torch-cpu``, ``torch-cuda``,
``jax-cpu``, ``jax-gpu``), next to where kfac_ref ran (``backend``).

Estimation modes: ``ggn_exact`` (curvlinops' ``fisher_type="type-2"``), ``fisher_empirical``
(``"empirical"``) and ``fisher_gradients`` (``"mc"`` with one sample).  Before a peer's rows
are timed its ``ggn_exact`` factors are compared with kfac_ref's, converted to kfac_ref's
layout (curvlinops: unfold's (C, kh, kw) patch order → (kh, kw, C), and its conv output
factor ``Σ_{n,t} g gᵀ/N`` → ``/|T|``, see the conformance adapter of that peer); a peer
whose factors disagree has its rows marked failed.  The damped inverses are not compared:
the damping conventions differ (kfac_ref and kfac-jax divide λ by a conv block's |T|,
curvlinops does not) and the conformance suite checks each peer's inverse products on its
own.  The peers' networks come from the suite's portable network spec
(``conformance/peers/nets.py``) with the workload's parameters.

The ratio of a peer row is ``median(kfac_ref) / median(peer)``: below 1 kfac_ref is faster.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np

from kfac_ref.curvature import BlockDiagonalCurvature

from .common import DAMPING, agreement, ce, host_problem, on_gpu, rel_err, time_pair

PEERS = ("curvlinops", "kfac_jax")
PEER_MODES = ("ggn_exact", "fisher_empirical", "fisher_gradients")
CURVLINOPS_FISHER = {"ggn_exact": "type-2", "fisher_empirical": "empirical",
                     "fisher_gradients": "mc"}


def installed(peer):
    return importlib.util.find_spec(peer) is not None


def torch_device(backend_name):
    """The torch device of the peers next to kfac_ref on ``backend_name``: ``"cuda"`` when
    kfac_ref's arrays are on the GPU (torch CUDA tensors, CuPy arrays), else ``"cpu"``."""
    return "cuda" if on_gpu(backend_name) else "cpu"


def spec_inputs(host_params, x, y):
    """The portable spec's inputs (``w{i}``, ``b{i}`` per layer index, ``x``, ``targets``)."""
    inputs = {"x": x, "targets": y}
    for i, p in enumerate(host_params):
        if p:
            inputs[f"w{i}"], inputs[f"b{i}"] = p
    return inputs


# --------------------------------------------------------------------------------------
# curvlinops
# --------------------------------------------------------------------------------------
class Curvlinops:
    name = "curvlinops"

    @staticmethod
    def unavailable(device):
        """Why the peer cannot run next to kfac_ref on ``device``, or None."""
        import torch

        if device == "cuda" and not torch.cuda.is_available():
            return "torch here has no CUDA device"
        return None

    def __init__(self, wl, inputs, dtype, damping, device="cpu"):
        import torch

        from conformance.peers import nets

        model, x, pmods = nets.torch_build(wl.spec, inputs)  # float64, NCHW input
        tdt = getattr(torch, np.dtype(dtype).name)
        if device == "cuda":  # float32 convolutions in float32, as kfac_ref's (not cuDNN's TF32)
            torch.backends.cudnn.allow_tf32 = False
        self.model, self.x = model.to(device=device, dtype=tdt), x.to(device=device, dtype=tdt)
        self.y = torch.as_tensor(np.asarray(inputs["targets"], dtype=np.int64), device=device)
        self.on = f"torch-{device}"
        self.loss = torch.nn.CrossEntropyLoss(reduction="mean")  # the workload's objective
        self.params = [p for m in pmods for p in (m.weight, m.bias)]
        self.names = {id(m): n for n, m in self.model.named_modules()}
        self.pmods = pmods
        self.locations = wl.scales  # |T| of each parametric layer (1 for dense layers)
        self.damping = damping
        gen = torch.Generator().manual_seed(7)
        self.v = torch.randn(sum(p.numel() for p in self.params), generator=gen,
                             dtype=tdt).to(device)

    def operator(self, mode, seed=2147483647):
        from curvlinops import KFACLinearOperator

        op = KFACLinearOperator(self.model, self.loss, self.params, [(self.x, self.y)],
                                fisher_type=CURVLINOPS_FISHER[mode], mc_samples=1,
                                kfac_approx="expand", separate_weight_and_bias=False,
                                check_deterministic=False, seed=seed)
        op.compute_kronecker_factors()
        return op

    def full_update(self, mode, seed):
        from curvlinops import KFACInverseLinearOperator

        op = self.operator(mode, seed)
        inv = KFACInverseLinearOperator(op, damping=self.damping, use_heuristic_damping=True)
        return inv @ self.v

    def factors(self, mode):
        """``[(A, G)]`` in kfac_ref's layout: (kh, kw, C) patch rows, bias last, G/|T|."""
        op = self.operator(mode)
        out = []
        for m, locations in zip(self.pmods, self.locations, strict=True):
            name = self.names[id(m)]
            a = op._input_covariances[name].detach().double().cpu().numpy()
            g = op._gradient_covariances[name].detach().double().cpu().numpy()
            if m.weight.ndim == 4:  # unfold order (C, kh, kw) → (kh, kw, C), bias stays last
                c, kh, kw = m.weight.shape[1:]
                perm = np.arange(c * kh * kw).reshape(c, kh, kw).transpose(1, 2, 0).ravel()
                perm = np.concatenate([perm, [c * kh * kw]])
                a = a[np.ix_(perm, perm)]
                g = g / locations
            out.append((a, g))
        return out


# --------------------------------------------------------------------------------------
# kfac-jax
# --------------------------------------------------------------------------------------
class KfacJax:
    name = "kfac_jax"

    @staticmethod
    def unavailable(device):
        """Why the peer cannot run next to kfac_ref on ``device``, or None: next to a GPU
        run it needs JAX's GPU backend (kfac-jax on the host would time the host)."""
        import jax

        if device == "cuda" and jax.default_backend() != "gpu":
            return f"JAX's default backend here is {jax.default_backend()}, not a GPU"
        return None

    def __init__(self, wl, inputs, dtype, damping, device="cpu"):
        """``device`` is unused: kfac-jax runs on JAX's default backend (``peer_on``)."""
        import jax
        import jax.numpy as jnp
        import kfac_jax

        from conformance.peers import nets

        jax.config.update("jax_enable_x64", True)
        fn, theta, batch = nets.jax_build(wl.spec, inputs, {"loss": "categorical"})
        self.theta, self.batch = theta, batch
        self.n = int(np.shape(inputs["x"])[0])
        est = kfac_jax.BlockDiagonalCurvature(fn, auto_register_tags=False)
        self.est = est
        self.state0 = est.init(jax.random.PRNGKey(0), (theta, batch),
                               exact_powers_to_cache=None, approx_powers_to_cache=-1)
        rng = np.random.default_rng(7)
        self.v = jax.tree_util.tree_map(
            lambda a: jnp.asarray(rng.standard_normal(a.shape).astype(a.dtype)), theta)
        self.damping = damping
        self._jitted = {}
        self.on = f"jax-{jax.default_backend()}"

    def _compiled(self, mode):
        import jax

        if mode not in self._jitted:
            est, lam, n = self.est, self.damping, self.n

            def full(state, theta, batch, key, v):
                st = est.update_curvature_matrix_estimate(
                    state, ema_old=0.0, ema_new=1.0, identity_weight=0.0, batch_size=n,
                    rng=key, func_args=(theta, batch), estimation_mode=mode)
                st = est.update_cache(st, identity_weight=lam, exact_powers=None,
                                      approx_powers=-1, eigenvalues=False, pmap_axis_name=None)
                return st, est.multiply_matpower(st, v, identity_weight=lam, power=-1,
                                                 exact_power=False, use_cached=True,
                                                 pmap_axis_name=None)

            self._jitted[mode] = jax.jit(full)
        return self._jitted[mode]

    def full_update(self, mode, seed):
        import jax

        out = self._compiled(mode)(self.state0, self.theta, self.batch,
                                   jax.random.PRNGKey(seed), self.v)
        return jax.block_until_ready(out)

    def factors(self, mode):
        st, _ = self.full_update(mode, 0)
        return [tuple(np.asarray(f.value, dtype=np.float64) for f in bs.factors)
                for bs in st.blocks_states]


PEER_CLASSES = {"curvlinops": Curvlinops, "kfac_jax": KfacJax}


# --------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------
def peer_rows(runner, wl, dtype):
    """Append one row per (installed peer, mode) to ``runner.rows``; kfac_ref runs on the
    runner's backend (NumPy, torch tensors or CuPy arrays), the peer on the same device
    (:func:`torch_device`).  A peer that cannot run there is listed as skipped, with the
    reason."""
    b = runner.b
    host_x, host_y, host_params = host_problem(wl, dtype, runner.seed)
    inputs = spec_inputs(host_params, host_x, host_y)
    n = wl.in_shape[0]
    fa = (tuple(tuple(b.to(a) for a in p) for p in host_params), (b.to(host_x), b.to(host_y)))
    est = BlockDiagonalCurvature(wl.net, ce)
    st0 = est.init(None, fa, approx_powers_to_cache=-1.0)
    v = b.to(np.random.default_rng(runner.seed + 5).standard_normal(est.dim).astype(dtype))

    def kfac_full(mode, seed):
        st = est.update_curvature_matrix_estimate(st0, 0.0, 1.0, n,
                                                  np.random.default_rng(seed), fa, mode)
        st = est.update_cache(st, DAMPING, None, -1.0, False)
        return est.multiply_matpower(st, v, DAMPING, -1.0, False, True)

    base = {"workload": wl.name, "dtype": np.dtype(dtype).name, "backend": b.name,
            "op": "peer"}
    device = torch_device(b.name)
    for peer in PEERS:
        if not installed(peer):
            continue
        why = PEER_CLASSES[peer].unavailable(device)
        if why is not None:
            skipped = {"row": f"peer {peer}", "op": "peer_missing", "peer": peer,
                       "status": f"skipped: {why}"}
            if skipped not in runner.rows:
                runner.rows.append(skipped)
            continue
        contestant = PEER_CLASSES[peer](wl, inputs, dtype, DAMPING, device)
        ref = est.update_curvature_matrix_estimate(st0, 0.0, 1.0, n, None, fa, "ggn_exact")
        err = 0.0
        for bs, (a, g) in zip(ref.blocks_states, contestant.factors("ggn_exact"), strict=True):
            ka, kg = (b.to_host(f.value) for f in bs.factors)
            err = max(err, rel_err(a, ka), rel_err(g, kg))
        terms = n * math.prod(wl.in_shape[1:-1]) * 10
        chk = agreement(err, runner.tol(dtype, terms))
        chk["compared"] = "ggn_exact Kronecker factors"
        for mode in PEER_MODES:
            seeds = iter(range(10_000))
            t = time_pair(lambda mode=mode, s=seeds: kfac_full(mode, next(s)),
                          lambda mode=mode, s=seeds, c=contestant: c.full_update(mode, next(s)),
                          runner.repeats, b.sync)
            row = {**base, "row": f"full update {mode} vs {peer}", "peer": peer, "mode": mode,
                   "peer_on": contestant.on, "kfac_ref": t["kfac_ref"], "peer_time": t["hand"],
                   "ratio": t["kfac_ref"]["median_s"] / t["hand"]["median_s"], "check": chk}
            runner.rows.append(row)
            runner.log(f"  {wl.name:>4} {row['dtype']:>7} {row['row']:<40} kfac_ref "
                       f"{t['kfac_ref']['median_s'] * 1e3:9.2f} ms  {peer} ({contestant.on}) "
                       f"{t['hand']['median_s'] * 1e3:9.2f} ms  ratio {row['ratio']:6.2f}  "
                       f"{'ok' if chk['ok'] else 'CHECK FAILED'}")


def missing_rows():
    return [{"row": f"peer {p}", "op": "peer_missing", "peer": p,
             "status": "skipped: not installed"} for p in PEERS if not installed(p)]
