"""The reference itself as an implementation under test (the suite's default target).

Three adapters over one class, differing in the array backend the inputs are handed over in:

* ``kfac_ref`` — NumPy.  Against live cases this is a self-check of the plumbing; against the
  committed golden vectors (the default source) it is a regression test of kfac_ref.
* ``kfac_ref_strict`` — array-api-strict (CPU device): every formula must go through the
  standard only.
* ``kfac_ref_torch`` — PyTorch CPU tensors (float64).

The canonical conventions are the reference's, so nothing is converted.
"""

from __future__ import annotations

import numpy as np

from ..adapter import Adapter, AdapterUnavailable, implements
from .kfac_ref_networks import KfacRefNetworksMixin
from .kfac_ref_optimizer import KfacRefOptimizerMixin

ADAPTERS = {
    "kfac_ref": "conformance.adapters.kfac_ref_adapter:KfacRefAdapter",
    "kfac_ref_strict": "conformance.adapters.kfac_ref_adapter:KfacRefStrictAdapter",
    "kfac_ref_torch": "conformance.adapters.kfac_ref_adapter:KfacRefTorchAdapter",
    "kfac_ref_cupy": "conformance.adapters.kfac_ref_adapter:KfacRefCupyAdapter",
    "kfac_ref_float32": "conformance.adapters.kfac_ref_adapter:KfacRefFloat32Adapter",
    "kfac_ref_own_draws": "conformance.adapters.kfac_ref_adapter:KfacRefOwnDrawsAdapter",
}


def _host_dtype(x):
    return np.int64 if np.asarray(x).dtype.kind in "iub" else np.float64


def _conv_args(params):
    return (params["filter_shape"], params["padding"], params["strides"], params["dilation"],
            params["data_format"])


class KfacRefAdapter(KfacRefNetworksMixin, KfacRefOptimizerMixin, Adapter):
    name = "kfac_ref"
    description = "kfac_ref on NumPy arrays (the reference; canonical conventions)"
    backend = "numpy"
    accepts_draws = ("sampling.kfac",)

    # -- backend plumbing -----------------------------------------------------------------
    def setup(self):
        try:
            import kfac_ref  # noqa: F401
        except ImportError as exc:  # pragma: no cover - the suite ships with kfac_ref
            raise AdapterUnavailable(f"kfac_ref is not importable: {exc}") from exc

    def version(self):
        import kfac_ref

        return f"{kfac_ref.__version__} ({self.backend})"

    def to_backend(self, x):
        return np.asarray(x, dtype=_host_dtype(x))

    def to_numpy(self, x):
        return np.asarray(x, dtype=np.float64)

    def _in(self, inputs, *names):
        return [self.to_backend(inputs[n]) for n in names]

    # -- linalg ---------------------------------------------------------------------------
    @implements("linalg.compute_cov")
    def compute_cov(self, inputs, params):
        from kfac_ref import linalg

        (x,) = self._in(inputs, "x")
        return self.to_numpy(linalg.compute_cov(x))

    @implements("linalg.cross_cov")
    def cross_cov(self, inputs, params):
        from kfac_ref import linalg

        x, y = self._in(inputs, "x", "y")
        return self.to_numpy(linalg.compute_cov(x, y))

    @implements("linalg.homog_cov")
    def homog_cov(self, inputs, params):
        from kfac_ref import linalg

        (a,) = self._in(inputs, "a")
        return self.to_numpy(linalg.compute_cov(linalg.append_homog(a)))

    @implements("linalg.kron")
    def kron(self, inputs, params):
        from kfac_ref import linalg

        a, g = self._in(inputs, "a", "g")
        return self.to_numpy(linalg.kron(a, g))

    @implements("linalg.kron_matvec")
    def kron_matvec(self, inputs, params):
        from kfac_ref import linalg

        a, g, v = self._in(inputs, "a", "g", "v")
        return self.to_numpy(linalg.kron_matvec(a, g, v))

    @implements("linalg.damped_matpower")
    def damped_matpower(self, inputs, params):
        from kfac_ref import linalg

        (m,) = self._in(inputs, "m")
        return self.to_numpy(linalg.damped_matpower(m, params["exp"], params["damping"]))

    @implements("linalg.damped_inverse")
    def damped_inverse(self, inputs, params):
        from kfac_ref import linalg

        (m,) = self._in(inputs, "m")
        return self.to_numpy(linalg.damped_inverse(m, params["damping"]))

    @implements("linalg.pi_tracenorm")
    def pi_tracenorm(self, inputs, params):
        from kfac_ref import linalg

        a, g = self._in(inputs, "a", "g")
        return np.asarray(linalg.pi_tracenorm(a, g))

    @implements("linalg.pi_adjusted_damping")
    def pi_adjusted_damping(self, inputs, params):
        from kfac_ref import linalg

        a, g = self._in(inputs, "a", "g")
        return np.asarray(linalg.pi_adjusted_damping(a, g, params["damping"]))

    @implements("linalg.factored_damped_inverse_matvec")
    def factored_inverse(self, inputs, params):
        from kfac_ref import linalg

        a, g, v = self._in(inputs, "a", "g", "v")
        return self.to_numpy(linalg.kron_damped_inverse_matvec(
            a, g, v, params["damping"], damping_method="factored"))

    @implements("linalg.exact_damped_inverse_matvec")
    def exact_inverse(self, inputs, params):
        from kfac_ref import linalg

        a, g, v = self._in(inputs, "a", "g", "v")
        return self.to_numpy(linalg.kron_damped_inverse_matvec(
            a, g, v, params["damping"], damping_method="exact"))

    @implements("linalg.factored_damped_matpower_matvec")
    def factored_matpower(self, inputs, params):
        from kfac_ref import linalg

        a, g, v = self._in(inputs, "a", "g", "v")
        return self.to_numpy(linalg.kron_damped_matpower_matvec(
            a, g, v, params["exp"], params["damping"], damping_method="factored"))

    @implements("linalg.factor_norm")
    def factor_norm(self, inputs, params):
        from kfac_ref import linalg

        (m,) = self._in(inputs, "m")
        return np.asarray(linalg.factor_norm(m, params["norm_type"]))

    # -- averaging ------------------------------------------------------------------------
    @implements("averaging.ema")
    def ema(self, inputs, params):
        from kfac_ref.averaging import MovingAverageVariable

        xs = inputs["xs"]
        avg = MovingAverageVariable.zeros_like(self.to_backend(xs[0]), zero_debias=True)
        out = []
        for x in xs:
            avg = avg.update(self.to_backend(x), params["decay"], params["weight"])
            out.append(self.to_numpy(avg.value))
        return np.stack(out)

    # -- factors --------------------------------------------------------------------------
    @implements("factors.dense_input")
    def dense_input(self, inputs, params):
        from kfac_ref import factors

        (a,) = self._in(inputs, "a")
        return self.to_numpy(factors.fully_connected_kronecker_factor(a, params["has_bias"]))

    @implements("factors.dense_output")
    def dense_output(self, inputs, params):
        from kfac_ref import factors

        (g,) = self._in(inputs, "g")
        return self.to_numpy(factors.fully_connected_kronecker_factor(g))

    @implements("factors.dense_diagonal")
    def dense_diagonal(self, inputs, params):
        from kfac_ref import factors

        a, g = self._in(inputs, "a", "g")
        return self.to_numpy(factors.fully_connected_diagonal_factor(a, g, params["has_bias"]))

    @implements("factors.conv_input")
    def conv_input(self, inputs, params):
        from kfac_ref import factors

        (x,) = self._in(inputs, "x")
        return self.to_numpy(factors.conv_input_kronecker_factor(
            x, *_conv_args(params), has_bias=params["has_bias"]))

    @implements("factors.conv_output")
    def conv_output(self, inputs, params):
        from kfac_ref import factors

        (g,) = self._in(inputs, "g")
        return self.to_numpy(factors.conv_output_kronecker_factor(g, params["data_format"]))

    @implements("factors.conv_diagonal")
    def conv_diagonal(self, inputs, params):
        from kfac_ref import factors

        x, g = self._in(inputs, "x", "g")
        fs, pad, strides, dil, fmt = _conv_args(params)
        return self.to_numpy(factors.conv_diagonal_factor(
            x, g, fs, strides, pad, fmt, dil, has_bias=params["has_bias"]))

    @implements("factors.embedding_input")
    def embedding_input(self, inputs, params):
        from kfac_ref import factors

        (ids,) = self._in(inputs, "ids")
        return self.to_numpy(factors.embedding_input_kronecker_factor(
            ids, params["vocab_size"]))

    @implements("factors.naive_diagonal")
    def naive_diagonal(self, inputs, params):
        from kfac_ref import factors

        (grad,) = self._in(inputs, "grad")
        return self.to_numpy(factors.naive_diagonal_factor(grad, params["batch_size"]))

    @implements("factors.series_cov_dt1")
    def series_cov_dt1(self, inputs, params):
        from kfac_ref import factors

        (x,) = self._in(inputs, "x")
        return self.to_numpy(factors.fully_connected_multi_kf_cov_dt1(
            x, params["num_uses"], params["has_bias"]))

    # -- losses ---------------------------------------------------------------------------
    def _loss(self, inputs, params):
        import kfac_ref.losses as L

        from ..catalogue.losses_cases import build_loss

        return build_loss(L, inputs, params, self.to_backend)

    @implements("losses.fisher")
    def loss_fisher(self, inputs, params):
        return self.to_numpy(self._loss(inputs, params).fisher_matrix())

    @implements("losses.gradient")
    def loss_gradient(self, inputs, params):
        grads = self._loss(inputs, params).grad_of_evaluate()
        return np.concatenate([self.to_numpy(g) for g in grads], axis=-1)

    @implements("losses.hessian")
    def loss_hessian(self, inputs, params):
        return self.to_numpy(self._loss(inputs, params).hessian_matrix())

    # -- blocks ---------------------------------------------------------------------------
    @implements("losses.fisher_factor")
    def loss_fisher_factor(self, inputs, params):
        from ..catalogue.losses_cases import factor_product

        return factor_product(self._loss(inputs, params), "fisher_factor", inputs["u"],
                              self.to_backend, self.to_numpy)

    @implements("losses.fisher_factor_transpose")
    def loss_fisher_factor_t(self, inputs, params):
        from ..catalogue.losses_cases import factor_product

        return factor_product(self._loss(inputs, params), "fisher_factor_transpose",
                              inputs["v"], self.to_backend, self.to_numpy)

    @implements("losses.ggn_factor")
    def loss_ggn_factor(self, inputs, params):
        from ..catalogue.losses_cases import factor_product

        return factor_product(self._loss(inputs, params), "ggn_factor", inputs["u"],
                              self.to_backend, self.to_numpy)

    @implements("losses.sample")
    def loss_sample(self, inputs, params):
        y = self._loss(inputs, params).sample(np.random.default_rng(params["seed"]))
        return np.asarray(self.to_numpy(y))

    @implements("blocks.kron_matpower")
    def kron_matpower(self, inputs, params):
        from kfac_ref import blocks

        a, g, x = self._in(inputs, "a", "g", "x")
        return self.to_numpy(blocks.kronecker_block_matpower(
            a, g, x, params["power"], params["damping"], scale=params["scale"],
            exact=params["exact"], norm_type=params["norm_type"]))

    @implements("blocks.kron_eigenvalues")
    def kron_eigenvalues(self, inputs, params):
        from kfac_ref import blocks

        a, g = self._in(inputs, "a", "g")
        return np.sort(self.to_numpy(blocks.kronecker_block_eigenvalues(
            a, g, scale=params["scale"])))

    @implements("blocks.diagonal_matpower")
    def diagonal_matpower(self, inputs, params):
        from kfac_ref import blocks

        d, x = self._in(inputs, "diagonal", "x")
        return self.to_numpy(blocks.diagonal_block_matpower(
            d, x, params["power"], params["damping"], scale=params["scale"]))

    @implements("blocks.kron_cached_inverse")
    def kron_cached_inverse(self, inputs, params):
        from ..catalogue.blocks_cases import cached_inverse_block

        return cached_inverse_block(inputs, params, self.to_backend, self.to_numpy)

    @implements("blocks.series_inverse")
    def series_inverse(self, inputs, params):
        from kfac_ref.blocks.tf import FullyConnectedSeriesFB

        from ..catalogue.blocks_cases import series_apply

        a0, a1, g0, g1 = self._in(inputs, "a_cov", "a_cov_dt1", "g_cov", "g_cov_dt1")
        fb = FullyConnectedSeriesFB(a0, g0, params["damping"], params["num_timesteps"],
                                    has_bias=params["has_bias"], option=params["option"],
                                    input_cov_dt1=a1, output_cov_dt1=g1)
        return series_apply(fb, inputs["x"], self.to_backend, self.to_numpy)

    # -- laplace --------------------------------------------------------------------------
    def _laplace_args(self, inputs, params):
        from ..catalogue.laplace_cases import curvature_from_inputs

        k = params["n_groups"]
        conv = {name: self.to_backend(arr) for name, arr in inputs.items()}
        curvature = curvature_from_inputs(params["structure"], conv, k)
        theta = [conv[f"theta_{g}"] for g in range(k)]
        mean = [conv[f"mu_{g}"] for g in range(k)]
        kw = {"structure": params["structure"], "temperature": params["temperature"],
              "prior_mean": mean}
        return theta, curvature, conv["prior_precision"], kw

    @implements("laplace.log_marginal_likelihood")
    def laplace_lml(self, inputs, params):
        from kfac_ref.laplace import laplace_log_marginal_likelihood

        theta, curvature, prior, kw = self._laplace_args(inputs, params)
        return self.to_numpy(laplace_log_marginal_likelihood(
            params["log_likelihood"], theta, curvature, prior, **kw))

    @implements("laplace.prior_precision_grad")
    def laplace_grad(self, inputs, params):
        from kfac_ref.laplace import laplace_log_marginal_likelihood_grad

        theta, curvature, prior, kw = self._laplace_args(inputs, params)
        return self.to_numpy(laplace_log_marginal_likelihood_grad(theta, curvature, prior,
                                                                  **kw))


class KfacRefStrictAdapter(KfacRefAdapter):
    name = "kfac_ref_strict"
    description = "kfac_ref on array-api-strict arrays (CPU device; canonical conventions)"
    backend = "array_api_strict"

    def setup(self):
        super().setup()
        try:
            import array_api_strict  # noqa: F401
        except ImportError as exc:
            raise AdapterUnavailable("array-api-strict is not installed "
                                     "(pip install array-api-strict)") from exc

    def to_backend(self, x):
        import array_api_strict as xs

        return xs.asarray(np.asarray(x, dtype=_host_dtype(x)))

    def to_numpy(self, x):
        if isinstance(x, (float, int, np.ndarray)):
            return np.asarray(x, dtype=np.float64)
        return np.asarray(x._array, dtype=np.float64)  # noqa: SLF001 - host read-back


class KfacRefTorchAdapter(KfacRefAdapter):
    name = "kfac_ref_torch"
    description = "kfac_ref on PyTorch CPU tensors (float64; canonical conventions)"
    backend = "torch"

    def setup(self):
        super().setup()
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            raise AdapterUnavailable("torch is not installed") from exc

    def to_backend(self, x):
        import torch

        return torch.as_tensor(np.asarray(x, dtype=_host_dtype(x)))

    def to_numpy(self, x):
        if isinstance(x, (float, int, np.ndarray)):
            return np.asarray(x, dtype=np.float64)
        return x.detach().cpu().numpy().astype(np.float64)


class KfacRefCupyAdapter(KfacRefAdapter):
    name = "kfac_ref_cupy"
    description = "kfac_ref on CuPy arrays (GPU 0, float64; canonical conventions)"
    backend = "cupy"

    def setup(self):
        super().setup()
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no CUDA device")
        except Exception as exc:  # ImportError or CUDA runtime errors without a GPU
            raise AdapterUnavailable(f"CuPy needs a CUDA GPU ({type(exc).__name__}: "
                                     f"{exc})") from exc

    def to_backend(self, x):
        import cupy

        return cupy.asarray(np.asarray(x, dtype=_host_dtype(x)))

    def to_numpy(self, x):
        if isinstance(x, (float, int, np.ndarray)):
            return np.asarray(x, dtype=np.float64)
        return x.get().astype(np.float64)


class KfacRefFloat32Adapter(KfacRefAdapter):
    """kfac_ref computing in float32 (NumPy): checks that the derived error budgets hold for a
    float32 implementation, rtol = budget · eps(float32)."""

    name = "kfac_ref_float32"
    description = "kfac_ref on float32 NumPy arrays (canonical conventions)"
    backend = "numpy-float32"
    dtype = "float32"

    def to_backend(self, x):
        x = np.asarray(x)
        return x.astype(np.int64) if x.dtype.kind in "iub" else x.astype(np.float32)


class KfacRefOwnDrawsAdapter(KfacRefAdapter):
    """kfac_ref drawing its own random numbers (``numpy.random.default_rng(params["seed"])``)
    for the sampling modes: exercises the statistical route of :mod:`conformance.sampling`
    with the estimator's own sampling code."""

    name = "kfac_ref_own_draws"
    description = ("kfac_ref on NumPy arrays, sampling modes with its own draws (statistical "
                   "route)")
    accepts_draws = ()
